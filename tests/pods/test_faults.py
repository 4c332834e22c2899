"""Faults in real pods: a lost worker pod together with the operator's pod, a frozen driver (its head pod deleted).

A job with checkpoints and ``spec.backoffLimit`` resumes from its newest checkpoint on a fresh Ray cluster
(KubeRay's RayJob retry); a job that allows no retry fails with a clear condition. Nothing hangs: every wait
has a deadline, and the recovery time is printed (the closing note's fault table comes from these lines).
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


def test_lost_pods_resume_from_the_newest_checkpoint_and_duplicate_nothing(real_cluster, rapi, operator_release,
                                                                           shared_dir, ns, tmp_path) -> None:
    """A node's worth of faults at once: the trainer pod and the operator's pod are deleted together mid-run.
    The run fails and KubeRay's retry resumes it from its newest checkpoint on a new Ray cluster; the chart's
    Deployment replaces the operator pod, and the new operator follows the job to Succeeded and creates nothing
    twice. The checkpoints go to an S3 bucket (S3Proxy on the nodes' bridge address; keys from a Secret):
    the retry resumes from the bucket. (A lost head pod is the same retry, with checkpoints on a volume, and the
    "resumes from checkpoint" Event is checked there: ``test_frozen_driver_is_ended_and_the_run_retried``, which
    ends its run by deleting the head pod.)"""
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
    # the retried run has a few steps left (a live edit of a mutable field; no operator needed to admit it); the
    # margin covers the steps the dying run may still report
    steps = (status(rapi, ns, "resume").get("step") or 0) + 15
    job["spec"]["algorithm"]["steps"] = steps
    apply(real_cluster, job, ns)
    seen: list[str] = []

    def replaced() -> bool:
        now = core.list_namespaced_pod("rlhf-system").items
        return any(p.metadata.name not in operators and p.status.phase == "Running"
                   and all(c.ready for c in p.status.container_statuses or []) for p in now)

    _wait(real_cluster, rapi, ns, "a new operator pod Ready", replaced, 300)
    print(f"\nFAULT delete operator pod: replacement Ready after {time.monotonic() - t0:.0f}s")

    def progressed() -> bool:
        st = status(rapi, ns, "resume")
        row = f"{st.get('phase')}/{(st.get('runtime') or {}).get('state')}: {st.get('message')}"
        if not seen or seen[-1] != row:
            seen.append(row)
        return st.get("phase") == "Succeeded" or st.get("phase") == "Failed"

    _wait(real_cluster, rapi, ns, "the job to finish after the faults", progressed, 1200)
    recovered = time.monotonic() - t0
    st = status(rapi, ns, "resume")
    print(f"FAULT delete {killed} ({victim}): {st.get('phase')} after {recovered:.0f}s; "
          f"resumed from step {(st.get('runtime') or {}).get('resumedFromStep')}\n  " + "\n  ".join(seen))
    assert st.get("phase") == "Succeeded", f"{st}\n{seen}\n{diagnostics(real_cluster, ns)}"
    assert st["step"] == steps
    # it resumed from a checkpoint (not from step 0)
    assert (st.get("runtime") or {}).get("resumedFromStep", 0) >= 3, st.get("runtime")
    # the new operator created nothing twice: one RayJob (KubeRay's retry is a new Ray cluster of the same RayJob)
    # and one runtime ConfigMap
    rayjobs = client.CustomObjectsApi(rapi).list_namespaced_custom_object("ray.io", "v1", ns, "rayjobs")["items"]
    assert len(rayjobs) == 1, [r["metadata"]["name"] for r in rayjobs]
    cms = core.list_namespaced_config_map(ns, label_selector="rlhf.dev/job=resume").items
    assert len(cms) == 1, [c.metadata.name for c in cms]
    # the checkpoints are in the bucket, committed by their markers; the retried run committed newer ones
    markers = sorted(o["path"] for batch in obstore.list(s3.store("rlhf"), prefix=f"{ns}/resume/") for o in batch
                     if o["path"].endswith("/state.json"))
    resumed = st["runtime"]["resumedFromStep"]
    assert markers and int(markers[-1].split("/")[-2][len("step-"):]) > resumed, (resumed, markers)


def test_lost_worker_without_retries_fails_with_a_clear_condition(real_cluster, rapi, operator_release, shared_dir,
                                                                   ns) -> None:
    job = checkpointed_job(real_cluster, shared_dir, ns, "noretry", 60, retries=0)
    apply(real_cluster, job, ns)
    _wait(real_cluster, rapi, ns, "step >= 1", lambda: (status(rapi, ns, "noretry").get("step") or 0) >= 1, 900)
    killed = _delete_pod(rapi, ns, "ray.io/group=rollout")
    t0 = time.monotonic()
    _wait(real_cluster, rapi, ns, "Failed", lambda: status(rapi, ns, "noretry").get("phase") == "Failed", 600)
    st = status(rapi, ns, "noretry")
    print(f"\nFAULT delete {killed} (no retries): Failed after {time.monotonic() - t0:.0f}s: {st.get('message')}")
    stalled = next(c for c in st["conditions"] if c["type"] == "Stalled")
    assert stalled["status"] == "True" and stalled["message"], stalled
    _events(rapi, ns, "noretry", r"^Failed: \S")  # a Warning that says why


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
