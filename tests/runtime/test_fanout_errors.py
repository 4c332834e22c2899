"""An engine actor's failed weight-sync call on a real Ray: ``EngineFanOut`` logs the engine's own error at once
(vLLM's NCCL trainer engine waits for the call in a thread beside a broadcast the failed engine never joins, so
the raise alone would surface only when ``weightSync.timeoutSeconds`` ends the sync) and still raises it."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

pytestmark = pytest.mark.runtime

SCRIPT = r"""
import json, logging

import ray

from rlhf_runtime.weight_sync import EngineFanOut

logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s %(message)s")
ray.init(address="local", num_cpus=1, include_dashboard=False)


@ray.remote(num_cpus=0)
class Engine:
    def update_weights_round(self, update_info, checkpoint_format=True):
        raise RuntimeError("receive_weights: shape mismatch for model.norm.weight")

    def finish_weight_update(self):
        return None


try:
    fan = EngineFanOut([Engine.remote(), Engine.remote()], [1, 1], timeout_s=60)
    fan.finish_weight_update()  # a call that succeeds logs nothing
    try:
        fan.update_round({"names": []}, checkpoint_format=False)
        raised = None
    except Exception as e:
        raised = f"{type(e).__name__}: {e}"
    print(json.dumps({"raised": raised, "calls": fan.calls}))
finally:
    ray.shutdown()
"""


def test_a_failed_engine_call_is_logged_at_once_and_raised() -> None:
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, (proc.stdout[-2000:], proc.stderr[-4000:])
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["raised"] and "shape mismatch for model.norm.weight" in out["raised"], out
    assert out["calls"] == 2
    # log records as the format writes them: a record starts with its level; Ray's error spans several lines
    records = re.split(r"^(?=(?:DEBUG|INFO|WARNING|ERROR|CRITICAL) )", proc.stderr, flags=re.MULTILINE)
    logged = [r for r in records if r.startswith("ERROR rlhf_runtime.weight_sync.fanout")]
    assert len(logged) == 1, proc.stderr[-4000:]  # the failing call only, not the one that succeeded
    assert "engine call update_weights_round on 2 engine(s) failed: RayTaskError" in logged[0]
    assert "shape mismatch for model.norm.weight" in logged[0]  # the engine's own message, in the same record
