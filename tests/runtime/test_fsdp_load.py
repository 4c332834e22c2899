"""FSDP2 trainers start from a meta-device skeleton whose shards rank 0 fills from its one copy of the checkpoint
(``FSDPWorker.fill_shards``), on the two cases where names and tensors differ between a checkpoint and the module:
tied embeddings (one parameter under two names) and a Qwen3-MoE checkpoint, whose per-expert tensors Transformers
fuses into stacked expert weights as it loads; and the in-trainer reference of a KL penalty, sharded the same way.
Two real ranks over gloo (CPU), subprocesses that keep torch out of pytest; the untied dense policy alone is in
``test_trainer_precision.py``."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import free_port
from tests.runtime.conftest import job_config, write_config

pytestmark = pytest.mark.runtime

WORKER = r"""
import json, sys
import torch
from rlhf_runtime.roles.options import TrainerOptions
from rlhf_runtime.roles.policy import Trainer
from rlhf_testing.ranks import exit_rank

rank, port, cfg, model = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
t = Trainer(TrainerOptions.from_config(open(cfg).read(), rank, 2, "127.0.0.1", port))
full = lambda p: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().float()
ours = {k: full(p) for k, p in t.model.named_parameters()}
refs = {k: full(p) for k, p in t.ref.model.named_parameters()} if t.ref is not None else None  # collectives: all ranks
from rlhf_runtime.roles.precision import host_load_dtype
out = {"tied": t.model.get_input_embeddings().weight is t.model.get_output_embeddings().weight,
       "shards": str(t.train_dtype), "host": str(host_load_dtype(model, t.train_dtype)),
       "ref_sharded": None if t.ref is None else all(hasattr(p, "full_tensor") for p in t.ref.model.parameters())}
if rank == 0:
    from transformers import AutoModelForCausalLM
    ref = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    theirs = {k: p.detach().float() for k, p in ref.named_parameters()}
    bufs = dict(ref.named_buffers())
    out.update(names=sorted(ours) == sorted(theirs), params=len(theirs),
               max_diff=max(float((ours[k] - theirs[k]).abs().max()) for k in theirs),
               buffer_diff=max(float((b.float() - bufs[n].float()).abs().max()) for n, b in t.model.named_buffers()))
    if refs is not None:
        out["ref_diff"] = max(float((refs[k] - theirs[k]).abs().max()) for k in theirs)
        out["ref_buffer_diff"] = max(float((b.float() - bufs[n].float()).abs().max()) for n, b in t.ref.model.named_buffers())
batch = {"prompts": [[5, 6, 7], [8, 9]], "completions": [[10, 11], [12, 13, 14]], "advantages": [1.0, -1.0]}
steps = [t.train(batch) for _ in range(2)]
out["grad_norm"] = steps[0]["grad_norm"]
out["kl"] = [s["kl"] for s in steps]
print(json.dumps(out))
exit_rank()  # not a plain return: see rlhf_testing.ranks
"""


def _port() -> int:
    return free_port()


@pytest.mark.parametrize("kind", ["tied", "moe", "kl", "moe-bf16"])
def test_fsdp2_shards_of_tied_moe_and_reference_models_equal_the_checkpoint(kind: str, tmp_path: Path) -> None:
    """``moe-bf16``: a bfloat16 file for float32 masters (``model.dtype: bfloat16``), which rank 0 loads as
    bfloat16 (half the host memory) and the float32 shards widen exactly."""
    model = tmp_path / "model"
    build = (f"from rlhf_testing.tiny import build_tiny_model; build_tiny_model({str(model)!r}, seed=0, "
             + {"tied": "tie_word_embeddings=True)", "moe": "arch='qwen3_moe')", "kl": ")",
                "moe-bf16": "arch='qwen3_moe', dtype='bfloat16')"}[kind])
    subprocess.run([sys.executable, "-c", build], check=True, timeout=180, capture_output=True)
    spec = job_config(model, trainer={"replicas": 1, "gpusPerReplica": 2, "strategy": "fsdp2"},
                      algorithm={"learningRate": 1e-2, "klCoef": 0.1 if kind == "kl" else 0.0})
    if kind == "moe-bf16":
        spec["model"] = {**spec["model"], "dtype": "bfloat16"}
    cfg = write_config(tmp_path / "job.json", spec)
    port = _port()
    procs = [subprocess.Popen([sys.executable, "-c", WORKER, str(r), str(port), str(cfg), str(model)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(2)]
    done = [p.communicate(timeout=300) for p in procs]
    failed = [f"rank {r}: {e[-2500:]}" for r, (p, (_, e)) in enumerate(zip(procs, done)) if p.returncode]
    assert not failed, "\n".join(failed)
    rank0, rank1 = (json.loads(o.strip().splitlines()[-1]) for o, _ in done)
    assert rank0["tied"] == rank1["tied"] == (kind == "tied"), (rank0, rank1)  # still one parameter, if it was
    # the host copy: the file's own bfloat16 for float32 shards; float32 files load as float32
    assert (rank0["shards"], rank0["host"]) == ("torch.float32", "torch.bfloat16" if kind == "moe-bf16"
                                                else "torch.float32"), rank0
    assert rank0["names"] and rank0["params"] > 0, rank0
    assert rank0["max_diff"] == 0.0 and rank0["buffer_diff"] == 0.0, rank0
    assert rank0["grad_norm"] == rank1["grad_norm"] > 0, (rank0, rank1)  # and the ranks train together
    if kind != "kl":
        assert rank0["ref_sharded"] is None
        return
    # the in-trainer reference (reference.placement: trainer) is sharded too, holds the checkpoint, and gives the
    # KL penalty: none while the policy still equals it, some after one update
    assert rank0["ref_sharded"] and rank1["ref_sharded"], (rank0, rank1)
    assert rank0["ref_diff"] == 0.0 and rank0["ref_buffer_diff"] == 0.0, rank0
    assert abs(rank0["kl"][0]) < 1e-6 and rank0["kl"][1] > 1e-6, rank0
    assert rank0["kl"] == rank1["kl"], (rank0, rank1)


CRITIC = r"""
import sys
from rlhf_runtime.roles.critic import CriticModel
from rlhf_runtime.roles.options import TrainerOptions
from rlhf_testing.ranks import exit_rank

rank, world, port, cfg = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
try:
    CriticModel(TrainerOptions.from_config(open(cfg).read(), rank, world, "127.0.0.1" if world > 1 else None,
                                           port if world > 1 else None))
except ValueError as e:
    print("ERROR", e)
exit_rank(barrier=False)  # rank 1, if any, waits in the weights' broadcast: no barrier
"""


def test_critic_weights_that_cannot_load_name_the_field_under_fsdp2_too(tiny_model: Path, tmp_path: Path) -> None:
    """spec.critic.model with a readable config but a corrupt weights file: the error names the field, for one
    worker (weights loaded with the config) and under FSDP2, where the config builds every rank's skeleton and rank
    0 alone reads the weights later, in ``shard``. Rank 1, left waiting in the broadcast, is stopped."""
    import shutil

    critic = tmp_path / "critic"
    shutil.copytree(tiny_model, critic)
    (critic / "model.safetensors").write_bytes(b"not a safetensors file")
    spec = job_config(tiny_model, algorithm={"name": "ppo"}, critic={"model": str(critic)})
    cfg = write_config(tmp_path / "job.json", spec)
    for world in (1, 2):
        port = _port()
        procs = [subprocess.Popen([sys.executable, "-c", CRITIC, str(r), str(world), str(port), str(cfg)],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(world)]
        try:
            out, err = procs[0].communicate(timeout=180)
        finally:
            for p in procs[1:]:
                p.kill()
                p.communicate()
        assert f"ERROR cannot load the critic from spec.critic.model {str(critic)!r}" in out, (world, out, err[-2000:])
