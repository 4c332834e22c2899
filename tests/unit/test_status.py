"""Table tests of the pure status computation (observed KubeRay state -> phase + conditions)."""

from __future__ import annotations

import datetime as dt

import pytest

from rlhf_operator import status as st

NOW = dt.datetime(2026, 11, 22, 12, 0, 0, tzinfo=dt.UTC)
LATER = NOW + dt.timedelta(minutes=5)


def rayjob(deploy=None, job=None, cluster="j-abcde", message=None, backoff=None, failed=None):
    s = {"rayClusterName": cluster} if cluster else {}
    if failed is not None:
        s["failed"] = failed
    if deploy:
        s["jobDeploymentStatus"] = deploy
    if job:
        s["jobStatus"] = job
    if message:
        s["message"] = message
    return {"metadata": {"name": "j"}, "spec": {} if backoff is None else {"backoffLimit": backoff}, "status": s}


READY_CLUSTER = {"status": {"state": "ready"}}
UNSCHEDULABLE = {
    "metadata": {"name": "j-abcde-trainer-x"},
    "status": {"conditions": [{"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                               "message": "0/4 nodes are available: 4 Insufficient nvidia.com/gpu."}]},
}
SCHEDULED = {"metadata": {"name": "p"}, "status": {"conditions": [{"type": "PodScheduled", "status": "True"}]}}


KUEUE_HELD = {"metadata": {"name": "j"}, "spec": {"suspend": True}, "status": {"jobDeploymentStatus": "Suspended"}}
QUOTA_SHORT = {"status": {"conditions": [{"type": "QuotaReserved", "status": "False", "reason": "Pending",
                                          "message": "couldn't assign flavors to pod set trainer: insufficient "
                                                     "quota for nvidia.com/gpu in flavor gpu"}]}}
PREEMPTED = {"status": {"conditions": [{"type": "Evicted", "status": "True", "reason": "Preempted",
                                        "message": "Preempted to accommodate a workload (UID: x) due to prioritization"}]}}


def obs(**kw) -> st.Observed:
    base = {"generation": 3, "old_status": {}, "total_steps": 10, "now": NOW}
    base.update(kw)
    return st.Observed(**base)


CASES = [
    ("no rayjob yet", obs(), "Pending", "CreatingRayJob"),
    ("kuberay missing", obs(kuberay_missing="KubeRay CRDs missing"), "Pending", "KubeRayMissing"),
    ("invalid spec", obs(invalid="spec.x: bad"), "Pending", "InvalidSpec"),
    ("child refused", obs(child_rejected='RayJob.ray.io "j" is invalid: spec.x: Invalid value'), "Pending",
     "ChildRejected"),
    ("invalid spec fixed (written Failed by an older operator)", obs(
        old_status={"phase": "Failed", "conditions": [{"type": "Ready", "status": "False", "reason": "InvalidSpec",
                                                  "lastTransitionTime": "2026-11-22T11:00:00Z"}]}),
     "Pending", "CreatingRayJob"),
    ("initializing", obs(ray_job=rayjob("Initializing")), "Provisioning", "ProvisioningRayCluster"),
    ("unschedulable", obs(ray_job=rayjob("Initializing"), pods=[UNSCHEDULABLE]), "Pending", "Unschedulable"),
    ("running", obs(ray_job=rayjob("Running", "RUNNING"), ray_cluster=READY_CLUSTER, pods=[SCHEDULED]), "Running", "WaitingForRuntime"),
    ("running but cluster not ready", obs(ray_job=rayjob("Running"), ray_cluster={"status": {}}), "Provisioning", "ProvisioningRayCluster"),
    ("training", obs(ray_job=rayjob("Running"), ray_cluster=READY_CLUSTER,
                     old_status={"runtime": {"state": "Running"}, "step": 4}), "Running", "Training"),
    ("complete", obs(ray_job=rayjob("Complete", "SUCCEEDED")), "Succeeded", "RayJobSucceeded"),
    ("ray job failed", obs(ray_job=rayjob("Failed", "FAILED", message="driver exited 1")), "Failed", "RayJobFailed"),
    ("validation failed", obs(ray_job=rayjob("ValidationFailed", message="bad spec")), "Failed", "RayJobFailed"),
    ("runtime failed", obs(ray_job=rayjob("Running"), old_status={"runtime": {"state": "Failed", "message": "OOM"}}), "Failed", "RuntimeFailed"),
    ("runtime failed, a retry left", obs(ray_job=rayjob("Running", backoff=2, failed=1),
                                          old_status={"runtime": {"state": "Failed", "message": "actor died"}}),
     "Provisioning", "Retrying"),
    ("runtime failed, KubeRay gave up", obs(ray_job=rayjob("Failed", "FAILED", backoff=2, failed=3),
                                            old_status={"runtime": {"state": "Failed", "message": "actor died"}}),
     "Failed", "RuntimeFailed"),
    ("runtime failed, no retries", obs(ray_job=rayjob("Running", backoff=0),
                                       old_status={"runtime": {"state": "Failed", "message": "actor died"}}),
     "Failed", "RuntimeFailed"),
    ("failure reported by the run before a retry", obs(
        ray_job=rayjob("Initializing", cluster="j-new", backoff=1, failed=1),
        old_status={"runtime": {"state": "Failed", "message": "actor died", "rayCluster": "j-old"}}),
     "Provisioning", "Retrying"),
    ("retrying, cluster name not yet chosen", obs(
        ray_job=rayjob("New", cluster=None, backoff=1, failed=1),
        old_status={"runtime": {"state": "Failed", "message": "actor died", "rayCluster": "j-old"}}),
     "Provisioning", "Retrying"),
    ("rayjob retrying", obs(ray_job=rayjob("Retrying", backoff=1, failed=1)), "Provisioning", "Retrying"),
    ("resuming after a restart", obs(ray_job=rayjob("Running"), ray_cluster=READY_CLUSTER,
                                     old_status={"runtime": {"state": "Starting", "resumedFromStep": 18}}),
     "Running", "Resuming"),
    ("runtime succeeded", obs(ray_job=rayjob("Running"), old_status={"runtime": {"state": "Succeeded"}, "step": 10}), "Succeeded", "RuntimeSucceeded"),
    ("pod creation failed", obs(ray_job=rayjob("Initializing"), ray_cluster={"status": {"conditions": [
        {"type": "ReplicaFailure", "status": "True", "reason": "FailedCreateHeadPod",
         "message": "FailedCreateHeadPod\\nno PriorityClass with name x was found"}]}}), "Pending", "PodCreationFailed"),
    ("suspended", obs(suspend=True, ray_job=rayjob("Suspended")), "Suspended", "Suspended"),
    ("suspending", obs(suspend=True, ray_job=rayjob("Running")), "Suspended", "Suspending"),
    # A suspended job's driver is terminated with its cluster and reports a failure: not the job's failure.
    ("suspending, driver terminated", obs(suspend=True, ray_job=rayjob("Suspending"), old_status={
        "runtime": {"state": "Failed", "message": "SystemExit: terminated by signal 15", "rayCluster": "j-abcde"}}),
     "Suspended", "Suspending"),
    ("resumed, the teardown's failure report is stale", obs(ray_job=rayjob("New", cluster=None), old_status={
        "phase": "Suspended", "runtime": {"state": "Failed", "message": "terminated", "rayCluster": "j-abcde"}}),
     "Provisioning", "ProvisioningRayCluster"),
    ("resumed on a new cluster", obs(ray_job=rayjob("Running", cluster="j-fghij"), ray_cluster=READY_CLUSTER,
                                     old_status={"runtime": {"state": "Failed", "rayCluster": "j-abcde"}}),
     "Running", "WaitingForRuntime"),
    ("succeeded just before a suspension", obs(suspend=True, ray_job=rayjob("Suspending"), old_status={
        "runtime": {"state": "Succeeded", "rayCluster": "j-abcde"}, "step": 10}), "Succeeded", "RuntimeSucceeded"),
    # Kueue owns the RayJob's suspend when queueName is set.
    ("kueue: queued", obs(queue_name="q", ray_job=KUEUE_HELD, workload=QUOTA_SHORT), "Pending", "Queued"),
    ("kueue: queued, no workload yet", obs(queue_name="q", ray_job=KUEUE_HELD), "Pending", "Queued"),
    ("kueue: admitted", obs(queue_name="q", ray_job=rayjob("Initializing")), "Provisioning", "ProvisioningRayCluster"),
    ("kueue: preempted", obs(queue_name="q", ray_job=KUEUE_HELD, workload=PREEMPTED, old_status={
        "startTime": "2026-11-22T11:00:00Z", "runtime": {"state": "Failed", "rayCluster": "j-abcde"}}),
     "Suspended", "Preempted"),
    ("kueue: user suspend wins", obs(queue_name="q", suspend=True, ray_job=KUEUE_HELD), "Suspended", "Suspended"),
    # Hangs: no step within the progress deadline, or no report at all.
    ("no progress within the deadline", obs(ray_job=rayjob("Running"), ray_cluster=READY_CLUSTER, progress_deadline=600,
                                            old_status={"runtime": {"state": "Running",
                                                                    "progressTime": "2026-11-22T11:40:00Z",
                                                                    "heartbeatTime": "2026-11-22T11:59:50Z"}}),
     "Running", "ProgressDeadlineExceeded"),
    ("progress within the deadline", obs(ray_job=rayjob("Running"), ray_cluster=READY_CLUSTER, progress_deadline=600,
                                         old_status={"runtime": {"state": "Running",
                                                                 "progressTime": "2026-11-22T11:55:00Z",
                                                                 "heartbeatTime": "2026-11-22T11:59:50Z"}}),
     "Running", "Training"),
    ("runtime stopped reporting", obs(ray_job=rayjob("Running"), ray_cluster=READY_CLUSTER, progress_deadline=3600,
                                      old_status={"runtime": {"state": "Running",
                                                              "progressTime": "2026-11-22T11:50:00Z",
                                                              "heartbeatTime": "2026-11-22T11:50:00Z"}}),
     "Running", "RuntimeUnresponsive"),
]


@pytest.mark.parametrize("name,o,phase,reason", CASES, ids=[c[0] for c in CASES])
def test_phase_table(name, o, phase, reason) -> None:
    v = st.verdict(o)
    assert (v.phase, v.reason) == (phase, reason)
    out = st.compute(o, NOW)
    conds = {c["type"]: c for c in out["conditions"]}
    assert all(c["observedGeneration"] == 3 for c in conds.values())
    stalled = phase == "Failed" or reason in st.STALLED_REASONS
    assert conds["Ready"]["status"] == ("True" if phase in ("Running", "Succeeded") and not stalled else "False")
    assert conds["Stalled"]["status"] == ("True" if stalled else "False")
    assert conds["Reconciling"]["status"] == ("True" if phase in ("Pending", "Provisioning") and not stalled else "False")
    assert conds["Complete"]["status"] == ("True" if phase == "Succeeded" else "False")


def test_unschedulable_message_names_the_pod_and_reason() -> None:
    v = st.verdict(obs(ray_job=rayjob("Initializing"), pods=[SCHEDULED, UNSCHEDULABLE]))
    assert "j-abcde-trainer-x" in v.message and "Insufficient nvidia.com/gpu" in v.message
    conds = {c["type"]: c for c in st.compute(obs(ray_job=rayjob("Initializing"), pods=[UNSCHEDULABLE]), NOW)["conditions"]}
    assert conds["PodsScheduled"]["status"] == "False"


def test_recompute_is_stable_and_keeps_transition_times() -> None:
    o = obs(ray_job=rayjob("Running"), ray_cluster=READY_CLUSTER)
    first = st.compute(o, NOW)
    again = st.compute(obs(ray_job=rayjob("Running"), ray_cluster=READY_CLUSTER, old_status=first), LATER)
    assert st.changed(first, again) == {}
    assert again["startTime"] == first["startTime"] == "2026-11-22T12:00:00Z"


def test_transition_time_moves_only_on_flip() -> None:
    first = st.compute(obs(ray_job=rayjob("Initializing")), NOW)
    second = st.compute(obs(ray_job=rayjob("Running"), ray_cluster=READY_CLUSTER, old_status=first), LATER)
    t1 = {c["type"]: c["lastTransitionTime"] for c in first["conditions"]}
    t2 = {c["type"]: c["lastTransitionTime"] for c in second["conditions"]}
    assert t2["Ready"] != t1["Ready"]  # flipped False -> True
    assert t2["InvalidSpec"] == t1["InvalidSpec"]  # stayed False


def test_terminal_phases_are_sticky() -> None:
    done = st.compute(obs(ray_job=rayjob("Complete", "SUCCEEDED")), NOW)
    # KubeRay deleted the cluster and the RayJob reports nothing useful any more.
    after = st.compute(obs(ray_job=None, old_status=done), LATER)
    assert after["phase"] == "Succeeded" and after["completionTime"] == done["completionTime"]
    assert st.changed(done, after) == {}


def test_operator_never_writes_runtime_fields() -> None:
    old = {"step": 7, "throughput": {"rewardMean": 0.5}, "runtime": {"state": "Running"}}
    out = st.compute(obs(ray_job=rayjob("Running"), ray_cluster=READY_CLUSTER, old_status=old), NOW)
    assert not {"step", "throughput", "runtime"} & out.keys()


def test_missing_data_config_map_stalls_and_says_why() -> None:
    o = obs(ray_job=rayjob("Initializing"), data_missing="ConfigMap prompts (spec.data.configMap) not found")
    conds = {c["type"]: c for c in st.compute(o, NOW)["conditions"]}
    assert conds["DataAvailable"]["status"] == "False"
    assert conds["Stalled"]["status"] == "True" and conds["Stalled"]["reason"] == "DataConfigMapMissing"
    assert "ConfigMap prompts" in conds["Stalled"]["message"]
    assert conds["Reconciling"]["status"] == "False"
    fine = {c["type"]: c for c in st.compute(obs(ray_job=rayjob("Initializing")), NOW)["conditions"]}
    assert fine["DataAvailable"]["status"] == "True" and fine["Stalled"]["status"] == "False"


def test_tools_healthy_follows_the_runtimes_tool_fault_warning() -> None:
    def conds(old: dict) -> dict:
        out = st.compute(obs(ray_job=rayjob("Running"), ray_cluster=READY_CLUSTER, old_status=old), NOW)
        return {c["type"]: c for c in out["conditions"]}

    assert "ToolsHealthy" not in conds({"runtime": {"state": "Running"}})
    healthy = conds({"runtime": {"state": "Running"}, "agent": {"step": 3, "faultShare": 0.1}})["ToolsHealthy"]
    assert (healthy["status"], healthy["reason"]) == ("True", "Fine")
    faulty = conds({"runtime": {"state": "Running"}, "agent": {"step": 4, "warning": "60% of the calls failed"}})
    assert (faulty["ToolsHealthy"]["status"], faulty["ToolsHealthy"]["reason"],
            faulty["ToolsHealthy"]["message"]) == ("False", "ToolErrors", "60% of the calls failed")


def test_engines_in_sync_follows_the_runtimes_mismatch_warning() -> None:
    def conds(old: dict) -> dict:
        out = st.compute(obs(ray_job=rayjob("Running"), ray_cluster=READY_CLUSTER, old_status=old), NOW)
        return {c["type"]: c for c in out["conditions"]}

    # a runtime that does not measure the mismatch (or none yet): no such condition
    assert "EnginesInSync" not in conds({"runtime": {"state": "Running"}, "throughput": {"rewardMean": 0.5}})
    fine = conds({"runtime": {"state": "Running"}, "throughput": {"mismatchKl": 2e-4}})["EnginesInSync"]
    assert (fine["status"], fine["reason"], fine["message"]) == ("True", "Matching", "")
    warning = "step 9: the trainer-vs-engine mismatch (mismatch_kl 0.3) is 1500x its median"
    spike = conds({"runtime": {"state": "Running", "warning": warning}, "throughput": {"mismatchKl": 0.3}})
    assert (spike["EnginesInSync"]["status"], spike["EnginesInSync"]["reason"]) == ("False", "MismatchSpike")
    assert spike["EnginesInSync"]["message"] == warning
    # a warning does not stop the run: Ready and Stalled are what they were
    assert spike["Ready"]["status"] == "True" and spike["Stalled"]["status"] == "False"


def test_kueue_conditions_say_why_a_job_waits() -> None:
    out = st.compute(obs(queue_name="q", ray_job=KUEUE_HELD, workload=QUOTA_SHORT), NOW)
    conds = {c["type"]: c for c in out["conditions"]}
    assert conds["Admitted"]["status"] == "False" and "insufficient quota" in conds["Admitted"]["message"]
    assert "insufficient quota for nvidia.com/gpu" in out["message"] and "LocalQueue q" in out["message"]
    running = st.compute(obs(queue_name="q", ray_job=rayjob("Running"), ray_cluster=READY_CLUSTER), NOW)
    assert {c["type"]: c for c in running["conditions"]}["Admitted"]["status"] == "True"
    assert "Admitted" not in {c["type"] for c in st.compute(obs(ray_job=rayjob("Running")), NOW)["conditions"]}


def test_observed_generation_waits_for_a_live_runtime_to_apply_the_change() -> None:
    live = {"state": "Running", "observedGeneration": 2, "heartbeatTime": "2026-11-22T11:59:50Z"}
    o = obs(ray_job=rayjob("Running"), ray_cluster=READY_CLUSTER, old_status={"runtime": live, "observedGeneration": 2})
    out = st.compute(o, NOW)
    assert out["observedGeneration"] == 2 and all(c["observedGeneration"] == 2 for c in out["conditions"])
    applied = dict(live, observedGeneration=3)
    assert st.compute(obs(ray_job=rayjob("Running"), ray_cluster=READY_CLUSTER,
                          old_status={"runtime": applied}), NOW)["observedGeneration"] == 3
    # no live runtime (suspended, or an older runtime that does not say): the operator's own apply counts
    assert st.compute(obs(suspend=True, ray_job=rayjob("Suspended"), old_status={"runtime": dict(
        live, state="Failed")}), NOW)["observedGeneration"] == 3
    assert st.compute(obs(ray_job=rayjob("Running"), ray_cluster=READY_CLUSTER,
                          old_status={"runtime": {"state": "Running"}}), NOW)["observedGeneration"] == 3


def test_unschedulable_message_carries_the_capacity() -> None:
    v = st.verdict(obs(ray_job=rayjob("Initializing"), pods=[UNSCHEDULABLE],
                       capacity="29 GPUs free on 4 nodes, at most 8 on one node: the free GPUs are fragmented"))
    assert v.reason == "Unschedulable" and "fragmented" in v.message and "Insufficient nvidia.com/gpu" in v.message


def _gpu_pod(name: str, gpus: int, scheduled: bool) -> dict:
    cond = {"type": "PodScheduled", "status": "True" if scheduled else "False", "reason": "Unschedulable"}
    return {"metadata": {"name": name}, "spec": {"containers": [{"resources": {"requests": {"nvidia.com/gpu": gpus}}}]},
            "status": {"conditions": [cond]}}


def test_capacity_message_tells_fragmented_from_short() -> None:
    nodes = {f"n{i}": {"labels": {"pool": "a"}, "free": free} for i, free in enumerate([5, 8 - 3, 7, 7])}
    trainer = _gpu_pod("t", 8, scheduled=False)
    msg = st.capacity_message(nodes, [trainer, _gpu_pod("e", 2, scheduled=True)], {"pool": "a"})
    assert "24 GPUs free on 4 matching node(s), at most 7 on one node" in msg and "fragmented" in msg
    short = st.capacity_message(nodes, [_gpu_pod(f"t{i}", 8, scheduled=False) for i in range(4)], None)
    assert "need 32" in short and "not enough GPUs free" in short
    assert st.capacity_message(nodes, [trainer], {"pool": "b"}).startswith("0 GPUs free on 0 matching node(s)")
    assert st.capacity_message(nodes, [_gpu_pod("cpu", 0, scheduled=False)], None) is None


def test_a_stuck_run_is_ended_only_past_deadline_and_grace() -> None:
    def at(progress: str, heartbeat: str, **kw) -> st.Observed:
        return obs(ray_job=rayjob("Running"), ray_cluster=READY_CLUSTER, progress_deadline=600, old_status={
            "runtime": {"state": "Running", "progressTime": progress, "heartbeatTime": heartbeat,
                        "rayCluster": "j-abcde"}}, **kw)

    assert st.stuck_run(at("2026-11-22T11:51:00Z", "2026-11-22T11:59:50Z")) is None  # past the deadline, in grace
    assert "no training step completed for 720 s" in st.stuck_run(at("2026-11-22T11:48:00Z", "2026-11-22T11:59:50Z"))
    assert "no report from the runtime since" in st.stuck_run(at("2026-11-22T11:59:00Z", "2026-11-22T11:55:00Z"))
    assert st.stuck_run(at("2026-11-22T11:00:00Z", "2026-11-22T11:00:00Z", suspend=True)) is None
    stale = at("2026-11-22T11:00:00Z", "2026-11-22T11:00:00Z")
    stale.ray_job = rayjob("Running", cluster="j-new")  # a report from the run before a retry: nothing to end
    assert st.stuck_run(stale) is None
