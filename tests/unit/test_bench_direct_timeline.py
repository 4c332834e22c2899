"""The GPU benchmark's timeline of a direct NCCL sync (``bench_actors.DirectTimeline``, ``sync_timing.timeline_summary``):
the wrappers record each side's call and groups around the real ``weight_sync.direct`` functions (run here over
real gloo groups, the trainer and a TP=1 engine worker as threads) and leave the module as it was; the summary
splits a sync's time into the trainer's start, the engine joining, the wire and the tail. The GPU times (CUDA
events) exist only on the lent GPUs."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("vllm")

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import bench_actors
import sync_timing

from rlhf_runtime.weight_sync import direct
from tests.unit.test_runtime_direct_sync import _run


def test_the_timeline_wraps_both_sides_of_a_real_exchange_and_unwraps() -> None:
    originals = (direct.broadcast_group, direct.send, direct.receive)
    timeline = bench_actors.DirectTimeline()
    timeline.install()
    try:
        assert direct.send is not originals[1] and direct.broadcast_group is not originals[0]
        got = _run(2, 1, 5 << 10)
        records = timeline.drain()
    finally:
        timeline.uninstall()
    assert (direct.broadcast_group, direct.send, direct.receive) == originals
    assert timeline.drain() == []  # drained
    calls = {r["what"]: r for r in records if r["what"] != "group"}
    groups = [r for r in records if r["what"] == "group"]
    assert sorted(calls) == ["receive", "send"]
    assert len(groups) == got[0]["groups"] + got[1]["groups"]  # every group of both sides, once
    assert sum(g["bytes"] for g in groups) == got[0]["bytes"] + got[1]["bytes"]
    for rec in records:
        assert rec["start"] <= rec["end"]
    for g in groups:  # inside its side's call
        assert any(c["start"] <= g["start"] and g["end"] <= c["end"] for c in calls.values())
    assert all("gpu_ms" not in g for g in groups)  # no CUDA here


def test_the_summary_splits_a_sync_from_the_drivers_call() -> None:
    t0 = 1000.0

    def at(ms: float) -> float:
        return t0 + ms / 1e3

    trainer = [{"what": "group", "start": at(2.0), "end": at(2.5), "tensors": 80, "bytes": 1 << 30, "gpu_ms": 3.0,
                "gpu_from_first_ms": 3.0},
               {"what": "group", "start": at(2.5), "end": at(3.0), "tensors": 20, "bytes": 1 << 20, "gpu_ms": 1.0,
                "gpu_from_first_ms": 4.5},
               {"what": "send", "start": at(1.5), "end": at(3.1)}]
    worker = [{"what": "group", "start": at(3.2), "end": at(3.4), "tensors": 80, "bytes": 1 << 30, "gpu_ms": 2.0,
               "gpu_from_first_ms": 2.0},
              {"what": "group", "start": at(3.4), "end": at(3.6), "tensors": 20, "bytes": 1 << 20, "gpu_ms": 0.5,
               "gpu_from_first_ms": 2.6},
              {"what": "receive", "start": at(3.1), "end": at(3.7)}]
    s = sync_timing.timeline_summary(t0, at(9.0), trainer, [worker])
    assert s["trainer_start_ms"] == pytest.approx(1.5) and s["first_launch_ms"] == pytest.approx(2.0)
    assert s["engine_join_ms"] == pytest.approx(1.1)  # the worker's receive began 1.1 ms after the first launch
    assert s["wire_ms"] == pytest.approx(2.6) and s["tail_ms"] == pytest.approx(5.4) and s["driver_ms"] == 9.0
    assert s["trainer"]["group_tensors"] == [80, 20] and s["workers"][0]["gpu_span_ms"] == pytest.approx(2.6)
    assert s["sends"] == 1
    assert sync_timing.timeline_summary(t0, at(9.0), [], [worker]) is None  # not the direct sync
    medians = sync_timing.summarize([{"total_s": 0.01, "bytes": 1, "timeline": s}])["timeline_medians_ms"]
    assert medians["wire_ms"] == pytest.approx(2.6)
