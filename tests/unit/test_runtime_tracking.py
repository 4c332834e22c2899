"""Experiment tracking (``rlhf_runtime.infra.tracking``): the metrics of a step, TensorBoard event files read back
with TensorBoard's own reader (a resumed run replaces the steps after its checkpoint), W&B offline run files read
back with W&B's own record type, and a tracker that fails being dropped while the others go on.

MLflow against a real ``mlflow server`` is in the runtime tier (``tests/runtime/test_driver.py``: a killed and
resumed driver continues one MLflow run)."""

from __future__ import annotations

import socket
import struct
from pathlib import Path
from typing import Any

import pytest

from rlhf_api.models import RLHFJobSpec
from rlhf_runtime.infra.tracking import Tracker, flatten, step_metrics
from tests.helpers import wait_for

BASE = {"model": {"name": "m"}, "image": "i", "data": {"prompts": ["p"]}, "reward": {"rule": "contains", "target": "x"},
        "volumes": [{"name": "runs", "emptyDir": {}}]}


def spec(tmp: Path, **tracking: Any) -> RLHFJobSpec:
    return RLHFJobSpec.model_validate({**BASE, "tracking": tracking})


def test_step_metrics_are_flat_numbers_under_their_source() -> None:
    got = step_metrics({"reward_mean": 0.5, "mfu": 0.31, "step_seconds": 2}, {
        "loss": -0.1, "entropy": 1.5, "step": 7, "reward_std": 0.25, "learning_rate": 1e-6, "note": "text",
        "flag": True}, {"reward_mean": 0.75, "step": 7})
    assert got == {"throughput/mfu": 0.31, "throughput/step_seconds": 2.0, "train/loss": -0.1, "train/entropy": 1.5,
                   "train/learning_rate": 1e-6, "reward/mean": 0.5, "reward/std": 0.25, "eval/reward_mean": 0.75}
    assert step_metrics(None, None) == {}
    assert flatten({"a": {"b": 1, "c": [1, 2]}, "d": "x"}) == {"a.b": "1", "a.c": "[1, 2]", "d": "x"}


def scalars(logdir: Path, tag: str) -> list[tuple[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(logdir))
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars(tag)]


def test_tensorboard_files_hold_each_step_and_a_resumed_run_replaces_the_steps_after_its_checkpoint(
        tmp_path: Path) -> None:
    """A run logs steps 1-5 and dies; the retry resumes from the checkpoint of step 3 and logs 4-6 again. Read with
    TensorBoard's reader: one point per step, 4-6 from the retry (purge_step), and the spec as text."""
    s = spec(tmp_path, tensorboard={"volume": "runs", "path": str(tmp_path / "tb")})
    first = Tracker.from_spec(s, "job1", "ns1", "u1")
    assert first.start(s.wire(), 0, {}) == {"tensorboard_dir": str(tmp_path / "tb" / "job1")}
    for step in range(1, 6):
        first.log(step, step_metrics({"reward_mean": step / 10}, {"loss": float(step)}))
    first.close("Failed")
    retry = Tracker.from_spec(s, "job1", "ns1", "u1")
    retry.start(s.wire(), 3, {})
    for step in range(4, 7):
        retry.log(step, step_metrics({"reward_mean": step / 10}, {"loss": 100.0 + step}))
    retry.close("Succeeded")
    assert scalars(tmp_path / "tb" / "job1", "train/loss") == [
        (1, 1.0), (2, 2.0), (3, 3.0), (4, 104.0), (5, 105.0), (6, 106.0)]
    assert [st for st, _ in scalars(tmp_path / "tb" / "job1", "reward/mean")] == [1, 2, 3, 4, 5, 6]


def wandb_history(run_file: Path) -> dict[int, dict[str, Any]]:
    """The history records of a W&B ``.wandb`` file: its 7-byte header, then LevelDB-log records (32 KiB blocks;
    each chunk CRC32, length, type: full/first/middle/last), each a ``wandb_internal_pb2.Record``."""
    import json

    from wandb.proto import wandb_internal_pb2 as pb

    data = run_file.read_bytes()
    assert data[:4] == b":W&B", data[:8]
    pos, block, pending, history = 7, 32768, b"", {}
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a chunk header is padding
            pos += block - pos % block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind == 0 and length == 0:
            pos += block - pos % block if pos % block else 0
            continue
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):
            rec = pb.Record()
            rec.ParseFromString(pending)
            if rec.WhichOneof("record_type") == "history":
                items = {(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in rec.history.item}
                history[rec.history.step.num] = items
    return history


def test_wandb_offline_run_files_hold_the_metrics_the_config_and_the_sample_tables(tmp_path: Path) -> None:
    s = spec(tmp_path, wandb={"project": "rl", "mode": "offline", "volume": "runs", "path": str(tmp_path / "wb")},
             samplesEveryNSteps=2, samples=1)
    t = Tracker.from_spec(s, "job1", "ns1", "uid-abc")
    assert t.start(s.wire(), 0, {}) == {"wandb_run_id": "uid-abc"}
    for step in range(1, 4):
        t.log(step, step_metrics({"reward_mean": step / 4}, {"kl": 0.01 * step}))
        if t.wants_samples(step):
            t.samples(step, [{"prompt": "1+1=", "completion": "2", "reward": 1.0}, {"prompt": "x", "completion": "y",
                                                                                     "reward": 0.0}])
    t.close("Succeeded")
    (run_file,) = (tmp_path / "wb" / "job1" / "wandb").glob("offline-run-*-uid-abc/run-uid-abc.wandb")
    # wandb's service may still be writing the file when finish() returns (once in a full suite the history read
    # empty right after it): read it again until it holds every step, for at most 30 s

    def every_step() -> dict[int, dict[str, Any]]:
        history = wandb_history(run_file)
        assert sorted(history) == [1, 2, 3], f"steps {sorted(history)} in {run_file.stat().st_size} bytes"
        return history

    history = wait_for(every_step, 30, f"the history of steps 1-3 (tracker errors: {t.errors})", interval=0.2)
    assert sorted(history) == [1, 2, 3]
    assert [history[st]["reward/mean"] for st in (1, 2, 3)] == [0.25, 0.5, 0.75]
    assert history[3]["train/kl"] == pytest.approx(0.03)
    assert history[2]["samples/_type"] == "table-file" and history[2]["samples/nrows"] == 1
    assert not any(k.startswith("samples") for k in history[3])
    (table,) = (run_file.parent / "files" / "media" / "table").glob("samples_2_*.table.json")
    import json

    assert json.loads(table.read_text())["data"] == [[2, "1+1=", "2", 1.0]]  # samples: 1 row


def test_a_tracker_that_fails_is_dropped_with_its_error_and_the_others_go_on(tmp_path: Path) -> None:
    """An MLflow server that is not there (a closed port): the run goes on, TensorBoard still gets every step,
    and status.tracking says which tracker was dropped and why."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # closed once the block ends: nothing listens there
    s = spec(tmp_path, tensorboard={"volume": "runs", "path": str(tmp_path / "tb")},
             mlflow={"trackingUri": f"http://127.0.0.1:{port}"})
    t = Tracker.from_spec(s, "job1", "ns1", None)
    status = t.start(s.wire(), 0, {})
    assert status["tensorboard_dir"] == str(tmp_path / "tb" / "job1")
    assert status["message"].startswith("mlflow dropped at start: ") and str(port) in status["message"]
    assert [sink.name for sink in t.sinks] == ["tensorboard"]
    t.log(1, step_metrics(None, {"loss": 0.5}))
    t.close("Succeeded")
    assert scalars(tmp_path / "tb" / "job1", "train/loss") == [(1, 0.5)]
