"""The engine calls of a weight sync (``weight_sync.options``' ``rpc``: pipelined into ``weightSync.mode: sync``
engines) on real Ray, a real vLLM engine and a real trainer over gloo (CPU), through the benchmark that compares
sync options on GPUs (``benchmarks/gpu_sync.py --cpu``): the default and the gloo backend tensor by tensor
(``packed`` false) are timed interleaved (a round of each, the order rotated; every switch re-creates the
weight-sync group with the arm's options), each arm's sync lands (the engine's weights are scrambled, and its
greedy tokens after the arm's sync equal those of the validated first sync), and each makes the engine calls and
waits the fan-out promises: a new group's first sync three calls waited on one by one, then three calls submitted
back to back and waited on twice (``EngineFanOut.pipelined``)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.runtime

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_sync.py"


def test_each_sync_makes_the_calls_and_waits_it_promises(tmp_path: Path) -> None:
    cmd = [sys.executable, str(BENCH), "--cpu", "--syncs", "3", "--timeout", "500", "--out", str(tmp_path / "out"),
           "--work", str(tmp_path / "work"), "--variants", "unpacked", "cpu-gloo:tiny"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False)
    result_file = tmp_path / "out" / "gpu_cpu-gloo_tiny.json"
    assert result_file.exists(), (proc.stdout[-3000:], proc.stderr[-3000:])
    r = json.loads(result_file.read_text())
    assert r["status"] == "ok", (r.get("error"), r.get("traceback"), proc.stdout[-3000:])
    assert r["validation"]["validated"], r["validation"]  # the first sync, against a fresh engine
    # the default alone first: pipelined calls from the group's second sync on
    assert (r["summary"]["default"]["engine_calls"], r["summary"]["default"]["engine_waits"]) == (3, 2), r["summary"]
    # then the default and the variant interleaved: 3 rounds, the order rotated by one each round
    arms = ["default", "unpacked"]
    assert r["interleaved_order"] == arms + arms[::-1] + arms, r["interleaved_order"]
    assert all(len(v) == 3 for v in r["syncs_interleaved"].values()), r["syncs_interleaved"]
    s = r["summary_interleaved"]
    # every switch re-creates the weight-sync group: the settling sync makes the new group's three waited calls,
    # the timed one the pipelined calls
    for name, packed in (("default", True), ("unpacked", False)):
        v = s[name]
        assert v["options"]["rpc"] == "pipelined" and v["options"]["packed"] is packed, v["options"]
        assert v["greedy_equals_validated"], v  # the scrambled engine has the trainer's weights again
        assert (v["engine_calls"], v["engine_waits"]) == (3, 2), v
    # after the variants the benchmark syncs with the job's own options again (a new group, and its settling
    # sync): the sync after the training step is pipelined again
    after = r["sync_after_train"]
    assert (after["engine_calls"], after["engine_waits"]) == (3, 2), after
