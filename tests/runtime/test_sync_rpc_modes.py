"""The engine calls of a weight sync (the sync option ``rpc``, ``weight_sync.options.EXPERIMENTAL``) on real Ray, a
real vLLM engine and a real trainer over gloo (CPU), through the benchmark that compares them on GPUs
(``benchmarks/gpu_sync.py --cpu``): the modes are timed interleaved (a round of each, the order rotated; every
switch re-creates the weight-sync group with the mode's options), each mode's sync lands (the engine's weights are
scrambled, and its greedy tokens after the mode's sync equal those of the validated first sync), and each makes the
engine calls and waits it promises: three calls waited on one by one, one ``update_weights_round`` call, or three
calls submitted back to back and waited on twice (``EngineFanOut.pipelined``); and the gloo backend tensor by
tensor (``packed`` false)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.runtime

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_sync.py"


def test_each_rpc_mode_syncs_with_the_calls_and_waits_it_promises(tmp_path: Path) -> None:
    cmd = [sys.executable, str(BENCH), "--cpu", "--syncs", "3", "--timeout", "500", "--out", str(tmp_path / "out"),
           "--work", str(tmp_path / "work"), "--variants", "three-rpc,pipelined-rpc,unpacked",
           "cpu-gloo:tiny"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False)
    result_file = tmp_path / "out" / "gpu_cpu-gloo_tiny.json"
    assert result_file.exists(), (proc.stdout[-3000:], proc.stderr[-3000:])
    r = json.loads(result_file.read_text())
    assert r["status"] == "ok", (r.get("error"), r.get("traceback"), proc.stdout[-3000:])
    assert r["validation"]["validated"], r["validation"]  # the first sync, against a fresh engine
    # the default alone first: one call per sync from the group's second sync on
    assert (r["summary"]["default"]["engine_calls"], r["summary"]["default"]["engine_waits"]) == (1, 1), r["summary"]
    # then the default and the variants interleaved: 3 rounds, the order rotated by one each round
    arms = ["default", "three-rpc", "pipelined-rpc", "unpacked"]
    assert r["interleaved_order"] == arms + arms[1:] + arms[:1] + arms[2:] + arms[:2], r["interleaved_order"]
    assert all(len(v) == 3 for v in r["syncs_interleaved"].values()), r["syncs_interleaved"]
    s = r["summary_interleaved"]
    # every switch re-creates the weight-sync group: the settling sync makes the new group's three calls, the timed
    # one what the mode promises
    for name, rpc, calls, waits, packed in (("default", "one", 1, 1, True), ("three-rpc", "three", 3, 3, True),
                                            ("pipelined-rpc", "pipelined", 3, 2, True),
                                            ("unpacked", "one", 1, 1, False)):
        v = s[name]
        assert v["options"]["rpc"] == rpc and v["options"]["packed"] is packed, v["options"]
        assert v["greedy_equals_validated"], v  # the scrambled engine has the trainer's weights again
        assert (v["engine_calls"], v["engine_waits"]) == (calls, waits), v
    # after the variants the benchmark syncs with the job's own options again (a new group, and its settling
    # sync): the sync after the training step is one call again
    after = r["sync_after_train"]
    assert (after["engine_calls"], after["engine_waits"]) == (1, 1), after
