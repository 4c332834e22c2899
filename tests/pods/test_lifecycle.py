"""Lifecycle in real pods with a driver really running: suspend -> resume continues from the newest checkpoint.

Suspending deletes the Ray cluster; the driver, terminated with it, reports a failure that belongs to the
teardown. The job must go Running -> Suspended -> Running and finish, never Failed, and the resumed run must
start from the newest checkpoint (not from step 0).
"""

from __future__ import annotations

import time

import pytest

from tests.pods.conftest import _wait, apply, checkpointed_job, pods, status
from tests.pods.test_faults import _events

pytestmark = [pytest.mark.pods, pytest.mark.timeout(2400)]  # the first test also waits for the cluster


def test_suspend_and_resume_continue_from_the_newest_checkpoint(real_cluster, rapi, operator_release, shared_dir,
                                                                 ns) -> None:
    # 0.1-1 s a step: the suspension (applied at step 4, taking effect ~20-30 s later) must land mid-run (at 100
    # and at 200 steps a quiet machine had finished them all before it landed, and this test passed without
    # suspending a run); the first run's length costs nothing, the resumed run is cut short by an edit
    first_steps = 5000
    job = checkpointed_job(real_cluster, shared_dir, ns, "pause", first_steps, retries=0)
    apply(real_cluster, job, ns)
    phases: list[str] = []

    def track(want=None):
        st = status(rapi, ns, "pause")
        if st.get("phase") and (not phases or phases[-1] != st["phase"]):
            phases.append(st["phase"])
        assert st.get("phase") != "Failed", f"{st.get('message')} (phases {phases})"
        return want(st) if want else st

    _wait(real_cluster, rapi, ns, "step >= 4 (a checkpoint at step 3)",
          lambda: track(lambda st: (st.get("step") or 0) >= 4), 900)
    job["spec"]["suspend"] = True
    apply(real_cluster, job, ns)
    t0 = time.monotonic()
    _wait(real_cluster, rapi, ns, "Suspended with no Ray pod left",
          lambda: track(lambda st: st.get("phase") == "Suspended") and not pods(rapi, ns, "ray.io/cluster"), 300)
    suspended_s = time.monotonic() - t0
    at = status(rapi, ns, "pause").get("step") or 0
    # resume with a few steps left (a live edit, allowed while suspended): the rest of 200 would be wait
    steps = at + 4
    job["spec"]["suspend"] = False
    job["spec"]["algorithm"]["steps"] = steps
    apply(real_cluster, job, ns)
    t1 = time.monotonic()
    _wait(real_cluster, rapi, ns, "Running again", lambda: track(lambda st: st.get("phase") == "Running"), 600)
    _wait(real_cluster, rapi, ns, "Succeeded", lambda: track(lambda st: st.get("phase") == "Succeeded"), 1200)
    st = status(rapi, ns, "pause")
    resumed = (st.get("runtime") or {}).get("resumedFromStep")
    print(f"\nSUSPEND at step {at}: Suspended after {suspended_s:.0f}s; resumed from step {resumed}, Succeeded "
          f"{time.monotonic() - t1:.0f}s after resume; phases {phases}")
    assert phases[phases.index("Running"):][:3] == ["Running", "Suspended", "Provisioning"] or \
        phases[phases.index("Running"):][:3] == ["Running", "Suspended", "Running"], phases
    assert "Running" in phases[phases.index("Suspended"):], phases
    assert st["step"] == steps
    assert at < first_steps, f"the suspension landed after the last step ({at}): nothing was left to resume"
    # the newest checkpoint before the suspension (every 3 steps), not step 0
    assert resumed is not None and resumed >= 3 and resumed <= at, (resumed, at)
    _events(rapi, ns, "pause", "^Suspended: ", "^Resumed: ")
