"""Faults in real pods: a lost worker pod together with the operator's pod, a frozen driver (its head pod deleted).

A job with checkpoints and ``spec.backoffLimit`` resumes from its newest checkpoint on a fresh Ray cluster
(KubeRay's RayJob retry); a job whose retries are used up fails with a clear condition. Nothing hangs: every
wait has a deadline, and the recovery time is printed.
"""

from __future__ import annotations

import re
import time

import pytest
import realnodes
from kubernetes import client

from tests.helpers import events_until
from tests.pods.conftest import _wait, apply, checkpointed_job, diagnostics, pods, status

pytestmark = [pytest.mark.pods, pytest.mark.timeout(2400)]  # the first test also waits for the cluster


def _delete_pod(api, ns: str, selector: str) -> str:
    victim = next(p for p in pods(api, ns, selector) if p.status.phase == "Running")
    client.CoreV1Api(api).delete_namespaced_pod(victim.metadata.name, ns, grace_period_seconds=0)
    return victim.metadata.name


def _events(api, ns: str, name: str, *wanted: str) -> list[str]:
    """The job's Events as "reason: message", once each pattern of ``wanted`` (a regular expression) matches one
    of them: the operator posts Events asynchronously, after the status write a test has just seen."""
    def text(evs) -> list[str]:
        return [f"{e.reason}: {e.message}" for e in evs]

    def has_all(evs) -> bool:
        return all(any(re.search(w, t) for t in text(evs)) for w in wanted)

    return text(events_until(api, ns, name, has_all, f"Events {wanted} about {name}"))


def test_lost_pods_resume_from_the_newest_checkpoint_then_fail_with_no_retry_left(
        real_cluster, rapi, operator_release, shared_dir, ns, tmp_path) -> None:
    """A node's worth of faults at once: the trainer pod and the operator's pod are deleted together mid-run.
    The run fails and KubeRay's retry (``backoffLimit`` 1) resumes it from its newest checkpoint on a new Ray
    cluster; the chart's Deployment replaces the operator pod, and the new operator follows the job and creates
    nothing twice. The checkpoints go to an S3 bucket (S3Proxy on the nodes' bridge address; keys from a Secret):
    the retry resumes from the bucket and commits newer steps there. Then a rollout pod is lost: with no retry
    left the job fails, Stalled with a message and a Warning that says why. (A lost head pod is the same retry,
    with checkpoints on a volume, run to Succeeded, and the "resumes from checkpoint" Event is checked there:
    ``test_frozen_driver_is_ended_and_the_run_retried``, which ends its run by deleting the head pod.)"""
    from tests.s3 import ACCESS_KEY, SECRET_KEY, S3Server

    victim = "ray.io/group=trainer"
    s3 = S3Server(tmp_path / "s3", host=realnodes.HOST_IP).start()
    try:
        _lost_pods_resume_from_the_bucket(real_cluster, rapi, shared_dir, ns, s3, victim,
                                          {"AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY})
    finally:
        s3.stop()


def _lost_pods_resume_from_the_bucket(real_cluster, rapi, shared_dir, ns, s3, victim, keys) -> None:
    import obstore

    core = client.CoreV1Api(rapi)
    core.create_namespaced_secret(ns, client.V1Secret(metadata=client.V1ObjectMeta(name="s3-keys"), string_data=keys))
    # a tiny step takes ~0.4 s: the fault must land while the run still has many steps to go
    job = checkpointed_job(real_cluster, shared_dir, ns, "resume", 60, retries=1)
    job["spec"]["checkpoint"] = {"uri": f"s3://rlhf/{ns}/resume", "everyNSteps": 3,
                                 "storage": {"endpoint": s3.endpoint, "credentialsSecret": "s3-keys"}}
    apply(real_cluster, job, ns)
    _wait(real_cluster, rapi, ns, "step >= 4 (a checkpoint at step 3)",
          lambda: (status(rapi, ns, "resume").get("step") or 0) >= 4, 900)
    operators = [p.metadata.name for p in core.list_namespaced_pod("rlhf-system").items]
    killed = _delete_pod(rapi, ns, victim)
    for name in operators:
        core.delete_namespaced_pod(name, "rlhf-system", grace_period_seconds=0)
    t0 = time.monotonic()
    # the retried run is given steps enough to outlast the second fault below (a live edit of a mutable field; no
    # operator needed to admit it)
    job["spec"]["algorithm"]["steps"] = (status(rapi, ns, "resume").get("step") or 0) + 300
    apply(real_cluster, job, ns)
    seen: list[str] = []

    def replaced() -> bool:
        now = core.list_namespaced_pod("rlhf-system").items
        return any(p.metadata.name not in operators and p.status.phase == "Running"
                   and all(c.ready for c in p.status.container_statuses or []) for p in now)

    _wait(real_cluster, rapi, ns, "a new operator pod Ready", replaced, 300)
    print(f"\nFAULT delete operator pod: replacement Ready after {time.monotonic() - t0:.0f}s")

    def markers() -> list[int]:
        """The steps committed to the bucket (each by its marker)."""
        paths = (o["path"] for batch in obstore.list(s3.store("rlhf"), prefix=f"{ns}/resume/") for o in batch)
        return sorted(int(p.split("/")[-2][len("step-"):]) for p in paths if p.endswith("/state.json"))

    def resumed_and_saved() -> bool:
        st = status(rapi, ns, "resume")
        row = f"{st.get('phase')}/{(st.get('runtime') or {}).get('state')}: {st.get('message')}"
        if not seen or seen[-1] != row:
            seen.append(row)
        resumed = (st.get("runtime") or {}).get("resumedFromStep")
        return st.get("phase") == "Failed" or (
            resumed is not None and st.get("phase") == "Running" and any(m > resumed for m in markers()))

    _wait(real_cluster, rapi, ns, "the retried run resumed and a checkpoint of its own committed",
          resumed_and_saved, 1200)
    st = status(rapi, ns, "resume")
    assert st.get("phase") == "Running", f"{st}\n{seen}\n{diagnostics(real_cluster, ns)}"
    print(f"FAULT delete {killed} ({victim}): {st.get('phase')} again after {time.monotonic() - t0:.0f}s; "
          f"resumed from step {(st.get('runtime') or {}).get('resumedFromStep')}\n  " + "\n  ".join(seen))
    # it resumed from a checkpoint in the bucket (not from step 0), and the retried run committed newer ones
    resumed = st["runtime"]["resumedFromStep"]
    assert resumed >= 3 and markers()[-1] > resumed, (st.get("runtime"), markers())
    # the new operator created nothing twice: one RayJob (KubeRay's retry is a new Ray cluster of the same RayJob)
    # and one runtime ConfigMap
    rayjobs = client.CustomObjectsApi(rapi).list_namespaced_custom_object("ray.io", "v1", ns, "rayjobs")["items"]
    assert len(rayjobs) == 1, [r["metadata"]["name"] for r in rayjobs]
    cms = core.list_namespaced_config_map(ns, label_selector="rlhf.dev/job=resume").items
    assert len(cms) == 1, [c.metadata.name for c in cms]

    # The one retry is used: a lost rollout pod now ends the job.
    killed = _delete_pod(rapi, ns, "ray.io/group=rollout")
    t1 = time.monotonic()
    _wait(real_cluster, rapi, ns, "Failed", lambda: status(rapi, ns, "resume").get("phase") == "Failed", 600)
    st = status(rapi, ns, "resume")
    print(f"FAULT delete {killed} (no retry left): Failed after {time.monotonic() - t1:.0f}s: {st.get('message')}")
    stalled = next(c for c in st["conditions"] if c["type"] == "Stalled")
    assert stalled["status"] == "True" and stalled["message"], stalled
    _events(rapi, ns, "resume", r"^Failed: \S")  # a Warning that says why


def test_frozen_driver_is_ended_and_the_run_retried(frozen_run, real_cluster, rapi) -> None:
    """A driver that cannot act (SIGSTOP: no step, no heartbeat, its own watchdog frozen too): past
    spec.progressDeadlineSeconds the job is Stalled; past the grace the operator deletes the run's head pod and
    KubeRay retries (backoffLimit 1), resuming from the newest checkpoint. This is also the lost-head-pod case
    (the head pod deleted through the API, the job retried on a new cluster). The run started with the tier's
    first test (``tests/pods/conftest.frozen_run``)."""
    ns, thread, out = frozen_run
    thread.join(timeout=2000)
    assert not thread.is_alive(), f"the frozen-driver scenario did not end: {out}\n{diagnostics(real_cluster, ns)}"
    if "error" in out:
        raise out["error"]
    assert "stopped" in out["stopped"], out["stopped"]
    st = status(rapi, ns, "frozen")
    print(f"\nFAULT SIGSTOP driver: Stalled after {out['stalled_s']:.0f}s, {st.get('phase')} after "
          f"{out['ended_s']:.0f}s; resumed from step {(st.get('runtime') or {}).get('resumedFromStep')}")
    assert st.get("phase") == "Succeeded", f"{st}\n{diagnostics(real_cluster, ns)}"
    assert st["step"] == out["steps"] and (st.get("runtime") or {}).get("resumedFromStep", 0) >= 3, st.get("runtime")
    _events(rapi, ns, "frozen", "^EndingStuckRun: ", "^(ProgressDeadlineExceeded|RuntimeUnresponsive): ",
            "resumes from checkpoint step")
