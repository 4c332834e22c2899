"""FSDP2 checkpoints: every rank's optimiser shards and parameters survive save -> resume. Two real ``Trainer``
processes shard a real tiny model with ``fully_shard`` over gloo (CPU), train one GRPO step, checkpoint, and
two fresh processes resume from it; each resumed rank must hold exactly the shards it saved. Killed mid-save, on
a shared path and in an S3 bucket (S3Proxy, ``tests/s3.py``), every rank resumes from the newest complete step."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from rlhf_runtime.infra import checkpoint as ckpt
from rlhf_runtime.infra import storage
from tests.helpers import free_port, wait_for
from tests.runtime.conftest import job_config, start_driver, write_config
from tests.s3 import S3Server

pytestmark = pytest.mark.runtime

# One trainer rank. Phase "train": one step on this rank's half of a fixed batch, checkpoint, save the local
# shards. Phase "resume": a fresh Trainer resumes from the checkpoint; compare its local shards with the saved ones.
WORKER = r"""
import json, sys
import torch
from rlhf_runtime.roles.options import TrainerOptions
from rlhf_runtime.roles.policy import Trainer
from rlhf_testing.ranks import exit_rank

cfg, rank, port, shards, phase = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5]
t = Trainer(TrainerOptions.from_config(open(cfg).read(), rank, 2, "127.0.0.1", port))
local = lambda x: (x.to_local() if hasattr(x, "to_local") else x).detach().clone()
names = {id(p): n for n, p in t.model.named_parameters()}

def snapshot():
    out = {"param/" + n: local(p) for n, p in t.model.named_parameters()}
    for p, st in t.opt.state.items():
        for k in ("exp_avg", "exp_avg_sq"):
            out[f"{k}/{names[id(p)]}"] = local(st[k])
    return out

if phase == "loop":  # train and checkpoint every step until killed
    batch = {"prompts": [[5, 6, 7], [8, 9], [10, 11, 12], [13]],
             "completions": [[20, 21, 22, 23], [24, 25, 26], [27, 28], [29, 30, 31, 32]],
             "advantages": [1.0, -1.0, 0.5, -0.5]}
    for _ in range(10000):
        t.train({k: v[rank::2] for k, v in batch.items()})
        t.save_checkpoint()
elif phase == "which":
    print(json.dumps({"rank": rank, "step": t.step, "resumed_from": t.resumed_from,
                      "checksum": float(sum(local(p).double().sum() for p in t.model.parameters()))}))
elif phase == "train":
    batch = {"prompts": [[5, 6, 7], [8, 9], [10, 11, 12], [13]],
             "completions": [[20, 21, 22, 23], [24, 25, 26], [27, 28], [29, 30, 31, 32]],
             "advantages": [1.0, -1.0, 0.5, -0.5]}
    t.train({k: v[rank::2] for k, v in batch.items()})
    t.save_checkpoint()
    torch.save(snapshot(), shards)
    print(json.dumps({"rank": rank, "step": t.step}))
else:
    saved, now = torch.load(shards), snapshot()
    differ = sorted(k for k in saved if k not in now or not torch.equal(saved[k], now[k]))
    nonzero = sum(int(v.abs().sum() > 0) for k, v in saved.items() if k.startswith("exp_avg/"))
    print(json.dumps({"rank": rank, "step": t.step, "resumed_from": t.resumed_from, "keys": len(saved),
                      "differ": differ[:5], "nonzero_exp_avg": nonzero,
                      "checksum": float(sum(v.double().sum() for k, v in saved.items() if k.startswith("exp_avg/")))}))
exit_rank()  # not a plain return: see rlhf_testing.ranks
"""


def _start_ranks(tmp: Path, cfg: Path, phase: str) -> list[subprocess.Popen]:
    port = free_port()
    return [
        subprocess.Popen([sys.executable, "-c", WORKER, str(cfg), str(r), str(port), str(tmp / f"shards{r}.pt"), phase],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for r in range(2)
    ]


def _run_ranks(tmp: Path, cfg: Path, phase: str) -> list[dict]:
    procs = _start_ranks(tmp, cfg, phase)
    results = []
    for p in procs:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err[-3000:]
        results.append(json.loads(out.strip().splitlines()[-1]))
    return results


def test_fsdp2_checkpoint_restores_every_ranks_shards(tiny_model: Path, tmp_path: Path) -> None:
    spec = job_config(
        tiny_model,
        trainer={"replicas": 1, "gpusPerReplica": 2, "strategy": "fsdp2"},
        algorithm={"steps": 5, "learningRate": 1e-2},
        checkpoint={"volume": "ckpt", "path": str(tmp_path / "ckpt"), "everyNSteps": 1},
        volumes=[{"name": "ckpt", "emptyDir": {}}],
    )
    cfg = write_config(tmp_path / "job.json", spec)
    trained = _run_ranks(tmp_path, cfg, "train")
    assert [r["step"] for r in trained] == [1, 1]
    assert (tmp_path / "ckpt").is_dir()
    resumed = _run_ranks(tmp_path, cfg, "resume")
    for r in resumed:
        assert (r["step"], r["resumed_from"]) == (1, 1), r
        assert r["differ"] == [], r  # parameters and both Adam moments, shard for shard
        assert r["nonzero_exp_avg"] > 0, r  # the step really moved the optimiser state
    # the two ranks hold different shards (the old bug: every rank loaded rank 0's optimiser state)
    assert resumed[0]["checksum"] != resumed[1]["checksum"]


def _kill_ranks_mid_save(tmp: Path, cfg: Path, saving: Callable[[], Any], left: Callable[[], list[Any]], what: str,
                         interval: float) -> tuple[int, list[Any]]:
    """Start two ranks that checkpoint every step and SIGKILL both once ``saving()`` is true, until the kill lands
    inside a save (``left()`` non-empty: what it left behind), at most 5 attempts; (the attempt, ``left()``)."""
    for attempt in range(5):
        procs = _start_ranks(tmp, cfg, "loop")
        try:
            wait_for(lambda procs=procs: any(p.poll() is not None for p in procs) or saving(),
                     timeout=300, what=what, interval=interval)
            for p in procs:
                os.kill(p.pid, signal.SIGKILL)
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                p.communicate(timeout=60)
        assert all(p.returncode == -signal.SIGKILL for p in procs), [p.stderr for p in procs]
        found = left()
        if found:
            return attempt, found
    raise AssertionError(f"no kill landed inside a checkpoint save in 5 attempts ({what})")


def _partial(root: Path) -> list[str]:
    """Entries of the checkpoint directory that are not complete checkpoints (a save in progress)."""
    return sorted(p.name for p in root.iterdir() if not ckpt.STEP_DIR.match(p.name)) if root.is_dir() else []


def test_fsdp2_trainer_killed_while_saving_resumes_every_rank_from_the_newest_complete_step(
    tiny_model: Path, tmp_path: Path
) -> None:
    root = tmp_path / "ckpt"
    spec = job_config(
        tiny_model,
        trainer={"replicas": 1, "gpusPerReplica": 2, "strategy": "fsdp2"},
        algorithm={"steps": 10000, "learningRate": 1e-2},
        checkpoint={"volume": "ckpt", "path": str(root), "everyNSteps": 1},
        volumes=[{"name": "ckpt", "emptyDir": {}}],
    )
    cfg = write_config(tmp_path / "job.json", spec)
    # a save in progress after at least 2 complete ones
    attempt, left = _kill_ranks_mid_save(
        tmp_path, cfg, lambda: (ckpt.latest(root) or (0,))[0] >= 2 and _partial(root), lambda: _partial(root),
        "a checkpoint save in progress", 0.001)
    newest = ckpt.latest(root)
    assert newest is not None
    t = time.monotonic()
    resumed = _run_ranks(tmp_path, cfg, "which")
    print(f"killed mid-save (attempt {attempt + 1}, left {left}); both ranks resumed from step {newest[0]} "
          f"in {time.monotonic() - t:.1f}s")
    assert [(r["step"], r["resumed_from"]) for r in resumed] == [(newest[0], newest[0])] * 2, (resumed, newest)


def _partial_steps(uri: str) -> list[int]:
    """Steps with objects in the bucket but no marker (a save in progress, or one killed)."""
    b = storage.Bucket(uri)
    keys = b.list(b.loc.key())
    marked = {k.split("/")[-2] for k in keys if k.endswith("/" + storage.STATE)}
    return sorted({int(k.split("step-")[1][:8]) for k in keys if "/step-" in k} -
                  {int(s[5:]) for s in marked})


def test_fsdp2_ranks_killed_while_uploading_resume_from_the_newest_step_in_the_bucket(
    tiny_model: Path, tmp_path: Path, s3: S3Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    """spec.checkpoint.uri on a real S3 server: two FSDP2 ranks train and checkpoint every step (rank 0 uploads,
    its marker last) until both are SIGKILLed while a step's objects are in the bucket without its marker; two
    fresh ranks then resume from the newest step with a marker (rank 0 finds it, both download it), and the
    torn step is removed once a newer one is complete."""
    for k, v in s3.env().items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("TMPDIR", str(tmp_path))  # what the killed ranks leave (their local copy) stays here
    storage._STORES.clear()
    uri = "s3://ckpt/fsdp-run"
    spec = job_config(
        tiny_model,
        trainer={"replicas": 1, "gpusPerReplica": 2, "strategy": "fsdp2"},
        algorithm={"steps": 10000, "learningRate": 1e-2},
        checkpoint={"uri": uri, "everyNSteps": 1, "storage": {"endpoint": s3.endpoint}},
    )
    cfg = write_config(tmp_path / "job.json", spec)
    # objects without a marker after at least 2 complete steps; torn: those above the newest complete one
    attempt, torn = _kill_ranks_mid_save(
        tmp_path, cfg, lambda: (storage.latest(uri) or (0,))[0] >= 2 and _partial_steps(uri),
        lambda: [s for s in _partial_steps(uri) if s > (storage.latest(uri) or (0,))[0]],
        "a checkpoint upload in progress", 0.002)
    newest = storage.latest(uri)
    assert newest is not None and newest[1].startswith(f"{uri}/step-{newest[0]:08d}/")
    t = time.monotonic()
    resumed = _run_ranks(tmp_path, cfg, "which")
    print(f"killed mid-upload (attempt {attempt + 1}, torn steps {torn}); both ranks resumed from step "
          f"{newest[0]} in the bucket in {time.monotonic() - t:.1f}s")
    assert [(r["step"], r["resumed_from"]) for r in resumed] == [(newest[0], newest[0])] * 2, (resumed, newest)
    # the resumed run's next save supersedes the torn step, and pruning removes it (two complete ones kept)
    storage.commit(storage.download(newest[1], tmp_path / "again"), uri, torn[-1] + 1, {"base_model": "m"})
    storage.prune(uri, keep=2)
    assert storage.steps(uri) == [newest[0], torn[-1] + 1], storage.steps(uri)


CRITIC = r"""
import json, sys
from rlhf_runtime.roles.critic import CriticModel
from rlhf_runtime.roles.options import TrainerOptions

cfg, phase = sys.argv[1], sys.argv[2]
c = CriticModel(TrainerOptions.from_config(open(cfg).read()), resume_step=None if phase == "save" else 3)
if phase == "save":
    for p in c.model.parameters():  # a critic that differs from a fresh one
        p.data.add_(0.01)
    c.save_checkpoint(3)
print(json.dumps({"resumed_from": c.resumed_from,
                  "checksum": float(sum(p.detach().double().sum() for p in c.model.parameters()))}))
"""


def test_ppo_critic_saves_to_and_resumes_from_the_bucket(tiny_model: Path, tmp_path: Path, s3: S3Server) -> None:
    """PPO's critic with spec.checkpoint.uri: saved under <uri>/critic (its own steps and markers), and a fresh
    critic resumed at that step loads exactly those weights from the bucket."""
    uri = "s3://ckpt/ppo-run"
    spec = job_config(tiny_model, algorithm={"name": "ppo", "steps": 3},
                      checkpoint={"uri": uri, "storage": {"endpoint": s3.endpoint}})
    cfg = write_config(tmp_path / "job.json", spec)
    env = {**os.environ, **s3.env()}
    runs = {}
    for phase in ("save", "resume"):
        out = subprocess.run([sys.executable, "-c", CRITIC, str(cfg), phase], check=False, env=env, capture_output=True,
                             text=True, timeout=300)
        assert out.returncode == 0, out.stderr[-3000:]
        runs[phase] = json.loads(out.stdout.strip().splitlines()[-1])
    assert runs["save"]["resumed_from"] is None and runs["resume"]["resumed_from"] == 3, runs
    assert runs["resume"]["checksum"] == runs["save"]["checksum"], runs
    with s3.environ():
        assert storage.latest(f"{uri}/critic")[0] == 3
        assert storage.latest(uri) is None  # the policy's steps are its own: the critic's do not count


def test_missing_bucket_or_refused_keys_fail_the_driver_before_ray(tiny_model: Path, tmp_path: Path,
                                                                   s3: S3Server) -> None:
    """spec.checkpoint.uri in a bucket that does not exist, and spec.output.uri with keys the server refuses: the
    driver fails before Ray starts, its Failed report naming the field and what to check."""
    cases = [
        ({"checkpoint": {"uri": "s3://no-such-bucket/run", "storage": {"endpoint": s3.endpoint}}}, s3.env(),
         ("StorageError: spec.checkpoint.uri: cannot list s3://no-such-bucket/run: bucket 'no-such-bucket' does "
          "not exist")),
        ({"output": {"uri": "s3://ckpt/export", "storage": {"endpoint": s3.endpoint}}},
         {**s3.env(), "AWS_SECRET_ACCESS_KEY": "not-the-key"},
         "StorageError: spec.output.uri: cannot list s3://ckpt/export: s3://ckpt at "),
    ]
    for i, (over, env, expected) in enumerate(cases):
        run = start_driver(tmp_path, write_config(tmp_path / f"job{i}.json", job_config(tiny_model, **over)),
                           name=f"run{i}", env=env)
        assert run.wait(timeout=180) == 1, run.tail()
        records = run.records()
        assert [r["runtime"]["state"] for r in records] == ["Failed"], (records, run.tail())  # no actor started
        msg = records[-1]["runtime"]["message"]
        assert msg.startswith(expected), msg
        assert i == 0 or "refused the credentials" in msg, msg
        assert "Started a local Ray instance" not in run.log.read_text(errors="replace")
