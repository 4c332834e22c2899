"""The runtime end to end on CPU: real Ray, real vLLM engines, the real gloo weight-transfer backend."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from rlhf_runtime.infra import storage
from tests.helpers import JobAPI, MLflowServer, wait_for
from tests.runtime.conftest import job_config, start_driver, start_reporting_driver, write_config
from tests.s3 import S3Server

pytestmark = pytest.mark.runtime


def test_grpo_learns_with_weight_sync_every_step_and_validation(tiny_model: Path, tmp_path: Path) -> None:
    """GRPO with what a user tunes first: a KL penalty against a reference (in an actor of its own beside the
    trainer), DAPO's clip-higher and a sequence-mean loss. (RLOO and REINFORCE++: tests/runtime/test_algorithms.py.)"""
    spec = job_config(tiny_model, algorithm={"steps": 20, "klCoef": 0.01, "clipRatioHigh": 0.28,
                                             "lossAggregation": "sequence"},
                      reference={"placement": "colocated"})
    cfg = write_config(tmp_path / "job.json", spec)
    run = start_driver(tmp_path, cfg, "--validate")
    assert run.wait(timeout=300) == 0, run.tail()

    records = run.records()
    validation = [r["validation"] for r in records if "validation" in r]
    assert validation and validation[0]["validated"], validation
    assert validation[0]["synced"] == validation[0]["fresh"]
    # the fresh engine's copy of the weights was written on its node and removed after the check
    assert validation[0]["weights"] and not any(Path(p).exists() for p in validation[0]["weights"])
    steps = run.steps()
    assert [r["step"] for r in steps] == list(range(1, 21))
    rewards = [r["throughput"]["rewardMean"] for r in steps]
    start, end = sum(rewards[:3]) / 3, sum(rewards[-5:]) / 5
    assert end > start + 0.4, rewards  # the engines only improve if the trainer's weights reach them
    for r in steps:
        sync = r["sync"]
        assert sync["bytes"] > 0 and sync["total_s"] > 0, sync
        # weightSync.format auto, on gloo: the checkpoint format, and the sync record says why not the kernel one
        assert sync["format"] == "checkpoint" and \
            sync["fallback"] == "the gloo backend loads the checkpoint format only", sync
        # the status rounds to 4 significant digits (report.status_patch)
        assert r["throughput"]["weightSyncGbps"] == pytest.approx(sync["bytes"] / sync["total_s"] / 1e9, rel=1e-3)
        assert r["throughput"]["rolloutTokensPerSecond"] > 0
        # the engines report each sampled token's log-probability and the trainer scores the same weights
        # (float32 on CPU both): the rollout correction's mismatch is near zero, the entropy positive
        assert -1e-6 < r["train"]["mismatch_kl"] < 1e-3 and abs(r["train"]["mismatch_log_ratio"]) < 1e-2, r["train"]
        # every step's report clears the mismatch warning (a JSON null): no spike after any of the syncs
        assert "warning" in r["runtime"] and r["runtime"]["warning"] is None, r["runtime"]
        assert r["train"]["entropy"] > 0, r["train"]
        # training tokens/s per trainer worker on the status; no MFU on a CPU (no known peak)
        assert r["throughput"]["trainTokensPerSecondPerGpu"] > 0 and "mfu" not in r["throughput"], r["throughput"]
        assert 0 < r["train"]["response_length_mean"] <= r["train"]["response_length_max"] <= 4, r["train"]
        assert r["throughput"]["referenceSeconds"] > 0, r["throughput"]  # the reference's pass ran every step
    # vLLM's trainer engine drives start -> update -> finish, three calls per engine: from the group's second sync
    # on submitted back to back and waited on twice; the first (before step 1, which reports it) waits on each, so
    # a failing start raises before the broadcast
    calls = [(r["sync"]["engine_calls"], r["sync"]["engine_waits"]) for r in steps]
    assert calls[0] == (3, 3) and set(calls[1:]) == {(3, 2)}, calls
    assert records[-1]["runtime"]["state"] == "Succeeded"
    # the trainer computed on the CPUs its pod asked for (trainer.resources.cpu, at most this machine's share),
    # not on the one thread Ray gives an actor by default
    want = min(8, max(1, len(os.sched_getaffinity(0))))  # one trainer and one engine, taking turns
    actors = [r["actors"] for r in records if "actors" in r]
    assert actors and actors[0]["trainer_threads"] == [want], actors
    # where the trainer's start went: its constructor, then vLLM's weight-transfer modules, imported after it
    # reported ready (beside the engines' start) and before the first sync
    start = actors[0]["trainer_start"]
    assert start["init_began_after_s"][0] >= 0 and start["init_seconds"][0] > 0, start
    assert start["weight_transfer_import_seconds"][0] > 0, start
    # its process began before its constructor did (the imports in between); the kernel's clock ticks are 10 ms
    assert start["spawned_after_s"][0] <= start["init_began_after_s"][0] + 0.011, start
    # and each engine's: its process, its constructor, vLLM's imports in it, then its build, all before the
    # record that reports them (the run's first record is older than any actor)
    eng = actors[0]["engine_start"]
    recorded = next(r["time"] for r in records if "actors" in r) - records[0]["time"]
    assert eng["spawned_after_s"][0] <= eng["init_began_after_s"][0] + 0.011, eng
    assert eng["import_seconds"][0] > 0, eng
    assert eng["init_began_after_s"][0] + eng["import_seconds"][0] <= eng["built_after_s"][0], eng
    assert eng["asked_after_s"] + eng["built_after_s"][0] <= recorded, (eng, recorded)
    # the driver asked for the engines and the trainers before it had loaded the tokenizer and checked the model's
    # config and the samples (those imports run beside the actors' start, not before it)
    checked = actors[0]["inputs_checked_after_s"]
    assert 0 <= eng["asked_after_s"] <= checked and start["asked_after_s"] <= checked, (actors[0], checked)
    # and before its first actor: its own local Ray's start, then the placement groups (the record splits them)
    assert actors[0]["ray_connect_seconds"] > 0 and actors[0]["placement_seconds"] >= 0, actors[0]


def test_corrupted_sync_fails_validation(tiny_model: Path, tmp_path: Path) -> None:
    # two engines (DP=2, one gloo group of 3 ranks): validation compares every engine with a fresh one;
    # turned on by the spec field alone (no --validate)
    spec = job_config(tiny_model, algorithm={"steps": 2}, rollout={"engines": 2}, weightSync={"validate": True})
    cfg = write_config(tmp_path / "job.json", spec)
    run = start_driver(tmp_path, cfg, "--skip-tensor", "lm_head.weight", hooks=True)
    assert run.wait(timeout=300) == 3, run.tail()
    records = run.records()
    validation = [r["validation"] for r in records if "validation" in r]
    assert validation and not validation[0]["validated"]
    assert validation[0]["weights"] and not any(Path(p).exists() for p in validation[0]["weights"])  # removed
    assert validation[0]["mismatched"]
    assert validation[0]["engines"] == 2
    assert sorted(validation[0]["mismatched_by_engine"]) == ["0", "1"]  # both engines missed the tensor
    assert records[-1]["runtime"]["state"] == "Failed"
    assert "weight-sync validation failed" in records[-1]["runtime"]["message"]
    assert not run.steps()  # it stopped before training on a bad engine


#: What every step must carry to the trackers on a CPU job (``spec.tracking``): the trainer's statistics, the
#: reward and the stage times (MFU needs a GPU of known peak: not on CPU).
TRACKED = ("train/loss", "train/kl", "train/entropy", "train/clip_fraction", "train/grad_norm",
           "train/learning_rate", "train/mismatch_kl", "train/response_length_mean", "train/response_length_max",
           "train/response_clipped_fraction", "reward/mean", "reward/std", "throughput/rollout_tokens_per_second",
           "throughput/train_tokens_per_second_per_gpu", "throughput/step_seconds", "throughput/rollout_seconds",
           "throughput/train_seconds", "throughput/weight_sync_seconds", "throughput/reward_seconds")


def test_killed_driver_resumes_from_newest_checkpoint_and_takes_a_live_edit(
        tiny_model: Path, tmp_path: Path, mlflow_server: MLflowServer, s3: S3Server) -> None:
    """A driver killed mid-run (SIGKILL: no report, no cleanup); the next run on the same config resumes from the
    newest checkpoint in the bucket (``spec.checkpoint.uri``: the driver's environment carries the endpoint and
    credentials to the actors, as a pod's does), its checkpoints go on there and its final export
    (``spec.output.uri``) is published there. Both runs report to the job's API, as in a pod: a ``job.json``
    written by a newer operator (keys this runtime does not know) is read with a warning, and a live edit of
    ``algorithm.steps`` ends the run at the new total, acknowledged with the edit's generation.

    Both runs track to TensorBoard, a real MLflow server and W&B (offline) at once (``spec.tracking``): the
    resumed run continues the MLflow run the first put in ``status.tracking``, TensorBoard's reader sees every
    metric once per step (the steps the first run did after its checkpoint replaced by the second's), and the
    resumed run's W&B run file holds the steps it did. The data are a Parquet file with a row the engines'
    context cannot take: it is dropped before the first step and counted in ``status.data``."""
    from mlflow import MlflowClient

    from tests.unit.test_runtime_tracking import scalars, wandb_history

    _killed_and_resumed(tiny_model, tmp_path, mlflow_server.wait(), s3)
    client = MlflowClient(mlflow_server.uri)
    (exp,) = [e for e in client.search_experiments() if e.name == "tiny-exp"]
    (run,) = client.search_runs([exp.experiment_id])
    total, resumed = int(run.data.tags["test/total"]), int(run.data.tags["rlhf.dev/resumed-from-step"])
    assert run.info.status == "FINISHED" and run.info.run_name == "tiny"
    assert run.data.params["algorithm.steps"] == "500" and run.data.params["model.dtype"] == "float32"
    for key in TRACKED:
        steps = {m.step for m in client.get_metric_history(run.info.run_id, key.replace("/", "."))}
        assert steps == set(range(1, total + 1)), (key, sorted(steps))
    arts = {a.path for a in client.list_artifacts(run.info.run_id)} | {
        a.path for a in client.list_artifacts(run.info.run_id, "samples")}
    assert "spec.json" in arts and f"samples/step-{total}.json" in arts, arts
    tb = tmp_path / "runs" / "tb" / "tiny"
    for key in TRACKED:
        assert [st for st, _ in scalars(tb, key)] == list(range(1, total + 1)), key
    wb = sorted((tmp_path / "runs" / "wb" / "tiny" / "wandb").glob("offline-run-*-uid-1/run-uid-1.wandb"))
    assert len(wb) == 2, wb  # one per run, the same run id
    first, second = wandb_history(wb[0]), wandb_history(wb[1])
    # W&B's service process buffers the run file: the SIGKILLed run may have lost its last points (or all)
    assert sorted(second) == list(range(resumed + 1, total + 1)) and set(first) <= set(range(1, total))
    assert all(key in second[total] for key in TRACKED)


def _killed_and_resumed(tiny_model: Path, tmp_path: Path, mlflow_uri: str, s3: S3Server) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq
    from mlflow import MlflowClient

    uri, export = "s3://ckpt/driver-run", "s3://ckpt/driver-export"
    runs = tmp_path / "runs"
    prompts = ["abc", "hello", "xyz", "12", "q", "say", "go", "rl"]
    # the data as a Parquet file with its own column name, one row too long for maxModelLen 96 - maxTokens 16
    pq.write_table(pa.table({"question": prompts[:3] + ["x" * 90] + prompts[3:]}), tmp_path / "train.parquet")
    spec = job_config(
        tiny_model,
        data={"prompts": None, "path": str(tmp_path / "train.parquet"), "promptField": "question"},
        algorithm={"steps": 500, "promptsPerStep": 16},
        rollout={"sampling": {"temperature": 1.0, "maxTokens": 16, "samplesPerPrompt": 8}},
        checkpoint={"uri": uri, "everyNSteps": 2, "storage": {"endpoint": s3.endpoint}},
        output={"uri": export, "storage": {"endpoint": s3.endpoint}},
        volumes=[{"name": "runs", "emptyDir": {}}],
        tracking={"tensorboard": {"volume": "runs", "path": str(runs / "tb")},
                  "mlflow": {"trackingUri": mlflow_uri, "experiment": "tiny-exp"},
                  "wandb": {"project": "tiny", "mode": "offline", "volume": "runs", "path": str(runs / "wb")},
                  "samplesEveryNSteps": 2},
    )
    cfg = write_config(tmp_path / "job.json", spec)
    raw = json.loads(cfg.read_text())
    raw["spec"]["rollout"]["fieldOfANewerOperator"] = {"x": 1}  # a newer operator wrote keys we do not know
    raw["someNewTopLevelField"] = True
    cfg.write_text(json.dumps(raw))
    api = JobAPI("tiny", "default", "uid-1", raw["spec"])
    try:
        first = start_reporting_driver(tmp_path, cfg, api, name="first", env=s3.env())
        first.kill_after_steps(5, total=500)
        run_id = api.status["tracking"]["mlflowRunId"]
        assert api.status["tracking"]["tensorboardDir"] == str(runs / "tb" / "tiny")
        with s3.environ():  # this process reads the bucket too
            newest = storage.latest(uri)
        assert newest is not None and newest[0] >= 4, (newest, first.tail())
        resumed = newest[0]

        second = start_reporting_driver(tmp_path, cfg, api, name="second", env=s3.env())
        try:
            wait_for(lambda: second.proc.poll() is not None or len(second.steps()) >= 2, timeout=240,
                     what="2 steps of the resumed run", interval=0.05)
            assert second.proc.poll() is None, second.tail()
            total = second.steps()[-1]["step"] + 4  # adopted at the driver's next step boundary
            total += total % 2  # a step that checkpoints (every 2)
            gen = api.edit(algorithm={"steps": total})
            assert second.wait(timeout=240) == 0, second.tail()
        finally:
            second.kill_group()
    finally:
        api.close()
    records = second.records()
    assert records[0]["runtime"]["state"] == "Starting"
    assert any(r["runtime"].get("resumedFromStep") == resumed for r in records)
    steps = [r["step"] for r in second.steps()]
    assert steps == list(range(resumed + 1, total + 1)), steps  # the counter continues, nothing is repeated
    with s3.environ():
        assert storage.latest(uri)[0] == total
        assert storage.steps(uri) == [total - 2, total]  # the newest two kept, nothing torn left behind
        files = storage.published(f"{export}/final")
    assert files and "config.json" in files and any(f.endswith(".safetensors") for f in files), files
    assert any((r.get("output") or {}).get("path") == f"{export}/final" for r in records), records[-1]
    reports = api.runtime_reports()
    assert reports[-1]["state"] == "Succeeded" and reports[-1]["observedGeneration"] == gen, reports[-1]
    assert reports[-1]["message"] == f"completed {total} steps"
    running = [r for r in reports if r.get("state") == "Running" and "progressTime" in r]
    assert running and all(r["progressTime"] for r in running)
    log = second.log.read_text(errors="replace")
    assert "ignoring fields this runtime does not know" in log and "rollout.fieldOfANewerOperator" in log
    assert api.status["tracking"]["mlflowRunId"] == run_id and api.status["tracking"]["wandbRunId"] == "uid-1"
    assert "message" not in api.status["tracking"], api.status["tracking"]  # no tracker was dropped
    data = api.status["data"]
    assert (data["samples"], data["dropped"]) == (8, 1) and "prompt + maxTokens 16 > 96 tokens" in data["message"]
    assert "rows 4)" in data["message"], data
    MlflowClient(mlflow_uri).set_tag(run_id, "test/total", str(total))  # for the caller's checks


# asyncllm: engines.AsyncEngine (AsyncLLM, engine core in a subprocess); stepped: stepped_engine.SteppedEngine
# (in-process LLM stepped by the actor). Both must pause mid-request and resume with the new weights.
@pytest.mark.parametrize("engine", ["asyncllm", "stepped"])
def test_async_mode_pauses_mid_request_and_matches_fresh_engine(
    tiny_model: Path, tmp_path: Path, engine: str
) -> None:
    spec = job_config(
        tiny_model,
        weightSync={"backend": "nccl", "mode": "async"},
        # Few, long samples: decoding them takes far longer than training on them, so the next rollout is
        # still running when the trainer finishes and the sync has to pause it mid-request.
        algorithm={"steps": 4, "promptsPerStep": 4},
        rollout={"maxModelLen": 200, "asyncEngine": engine,
                 "sampling": {"temperature": 1.0, "maxTokens": 160, "samplesPerPrompt": 2}},
    )
    cfg = write_config(tmp_path / "job.json", spec)
    run = start_driver(tmp_path, cfg, "--validate", "--pause-after-tokens", "4", hooks=True)
    assert run.wait(timeout=300) == 0, run.tail()
    # the hooked subclasses (rlhf_testing.driver) of AsyncEngine and SteppedEngine
    actor = {"asyncllm": "LatePauseAsyncEngine", "stepped": "LatePauseSteppedEngine"}[engine]
    assert f"({actor} pid=" in run.log.read_text(errors="replace")  # Ray's log prefix: the engine that ran
    records = run.records()
    assert [r["validation"]["validated"] for r in records if "validation" in r] == [True]
    steps = run.steps()
    assert [r["step"] for r in steps] == [1, 2, 3, 4]
    swaps = [r["swap"] for r in steps]
    # The rollouts of steps 2..4 ran while the previous step trained: the sync paused them mid-request.
    assert any(s["mixed_samples"] > 0 for s in swaps), swaps
    assert any(s["tokens_before_swap"] > 0 and s["tokens_after_swap"] > 0 for s in swaps), swaps
    assert swaps[0]["mixed_samples"] == 0  # the first rollout starts after the initial sync
