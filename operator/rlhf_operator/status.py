"""Pure status computation: what the operator observed -> phase, conditions and message.

KubeRay's RayJob has no conditions; we derive them from its ``jobDeploymentStatus``/``jobStatus``, the
RayCluster's conditions and the pods' ``PodScheduled`` condition, and fold in the runtime's own report
(``status.runtime``). Every condition carries ``observedGeneration``; ``lastTransitionTime`` only moves when a
condition's status flips, so recomputing an unchanged world yields an identical status (no write).

kstatus / Argo CD contract: ``Ready`` True = running or succeeded; ``Reconciling`` True = still converging;
``Stalled`` True = needs a human (failed, unschedulable, invalid, KubeRay missing, no progress).
Terminal phases (Succeeded, Failed) are sticky: KubeRay deleting the cluster after the job does not regress.
An invalid spec is not terminal (phase Pending, Stalled): the job proceeds once the spec is fixed.

Suspension comes before any failure the runtime reports: a suspended or preempted job's Ray cluster is
deleted, and its driver, terminated, reports a failure that belongs to that teardown, not to the job. Reports
from a Ray cluster other than the RayJob's current one (or while it has none) are stale and ignored.
With ``scheduling.queueName`` Kueue owns the RayJob's ``suspend``: held before admission = Pending (Queued),
held again after it ran = Suspended (Preempted/Evicted).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

TERMINAL = ("Succeeded", "Failed")
#: Non-terminal reasons that need a human: kstatus Stalled=True, Argo CD Degraded.
STALLED_REASONS = ("Unschedulable", "KubeRayMissing", "PodCreationFailed", "InvalidSpec", "ChildRejected", "ProgressDeadlineExceeded",
                   "RuntimeUnresponsive", "DataConfigMapMissing")
#: A runtime that has not reported for this long (its heartbeat is every 15 s) is unresponsive.
HEARTBEAT_TIMEOUT_SECONDS = 120


@dataclass
class Observed:
    generation: int
    old_status: dict[str, Any]
    total_steps: int | None = None
    suspend: bool = False
    invalid: str | None = None  # why the spec is invalid (defence behind admission), else None
    kuberay_missing: str | None = None  # why KubeRay cannot be used, else None
    data_missing: str | None = None  # why spec.data.configMap cannot be mounted, else None
    child_rejected: str | None = None  # the apiserver refused a child object (its message), else None
    ray_job: dict[str, Any] | None = None
    ray_cluster: dict[str, Any] | None = None
    pods: list[dict[str, Any]] = field(default_factory=list)
    queue_name: str | None = None  # spec.scheduling.queueName: Kueue owns the RayJob's suspend
    workload: dict[str, Any] | None = None  # the Kueue Workload of the RayJob, when queued
    progress_deadline: int | None = None  # spec.progressDeadlineSeconds
    capacity: str | None = None  # GPU capacity of the cluster, said when a pod is unschedulable for GPUs
    now: datetime | None = None


@dataclass(frozen=True)
class Verdict:
    phase: str
    reason: str
    message: str


def _unschedulable(pods: list[dict[str, Any]]) -> str | None:
    for pod in sorted(pods, key=lambda p: p["metadata"]["name"]):
        for c in pod.get("status", {}).get("conditions") or []:
            if c.get("type") == "PodScheduled" and c.get("status") == "False":
                return f"pod {pod['metadata']['name']}: {c.get('reason', 'Unschedulable')}: {c.get('message', '')}".strip()
    return None


def _cluster_ready(cluster: dict[str, Any] | None) -> bool:
    if not cluster:
        return False
    st = cluster.get("status") or {}
    if st.get("state") == "ready":
        return True
    return any(
        c.get("type") == "RayClusterProvisioned" and c.get("status") == "True" for c in st.get("conditions") or []
    )


def _gpus(pod: dict[str, Any]) -> int:
    total = 0
    for c in (pod.get("spec") or {}).get("containers") or []:
        try:
            total += int(str(((c.get("resources") or {}).get("requests") or {}).get("nvidia.com/gpu", 0)))
        except ValueError:
            pass
    return total


def capacity_message(nodes: dict[str, dict[str, Any]], pods: list[dict[str, Any]],
                     node_selector: dict[str, str] | None) -> str | None:
    """What the GPU capacity says about a job's unschedulable pods: fragmented (enough GPUs free in total, not on
    one node) or short. ``nodes``: ``kube.gpu_nodes()``. None when no unschedulable pod asks for GPUs."""
    pending = [p for p in pods if _unschedulable([p]) and _gpus(p)]
    if not pending:
        return None
    need_one, need_all = max(_gpus(p) for p in pending), sum(_gpus(p) for p in pending)
    free = [max(0, n["free"]) for n in nodes.values()
            if all(n["labels"].get(k) == v for k, v in (node_selector or {}).items())]
    total, most = sum(free), max(free, default=0)
    where = f"{total} GPUs free on {len(free)} matching node(s), at most {most} on one node"
    if total >= need_all and most < need_one:
        return (f"{where}; the unscheduled pods need {need_all}, {need_one} on one node: the free GPUs are "
                "fragmented over nodes")
    if total < need_all:
        return f"{where}; the unscheduled pods need {need_all}: not enough GPUs free"
    return where


def _replica_failure(cluster: dict[str, Any] | None) -> str | None:
    """KubeRay could not create pods (quota, missing PriorityClass, admission webhook...)."""
    for c in ((cluster or {}).get("status") or {}).get("conditions") or []:
        if c.get("type") in ("ReplicaFailure", "RayClusterReplicaFailure") and c.get("status") == "True":
            message = " ".join((c.get("message") or "").split())  # KubeRay puts the reason and a newline first
            return f"RayCluster {(cluster or {}).get('metadata', {}).get('name', '')}: {message}".strip()
    return None


def _stale(runtime: dict[str, Any], ray_job: dict[str, Any] | None) -> bool:
    """The runtime's report comes from another Ray cluster than the RayJob's current one (KubeRay retried on a
    new cluster, or the job was suspended and its cluster deleted: KubeRay then clears the name and names the
    next cluster anew). Runtimes that do not name their cluster are taken as current."""
    current = ((ray_job or {}).get("status") or {}).get("rayClusterName")
    return bool(runtime.get("rayCluster")) and runtime["rayCluster"] != current


def _condition_of(obj: dict[str, Any] | None, ctype: str) -> dict[str, Any] | None:
    return next((c for c in ((obj or {}).get("status") or {}).get("conditions") or [] if c.get("type") == ctype), None)


def _kueue_hold(obs: Observed) -> Verdict | None:
    """Kueue holds the job (its RayJob suspended by Kueue, not by spec.suspend): queued or preempted."""
    if not obs.queue_name or obs.ray_job is None or not (obs.ray_job.get("spec") or {}).get("suspend"):
        return None
    evicted = _condition_of(obs.workload, "Evicted")
    ran = bool(obs.old_status.get("startTime"))
    if ran or (evicted and evicted.get("status") == "True"):
        why = evicted.get("reason") if evicted and evicted.get("status") == "True" else "Evicted"
        reason = "Preempted" if why == "Preempted" else "Evicted"
        detail = (evicted or {}).get("message") or "Kueue suspended the RayJob"
        return Verdict("Suspended", reason, f"{detail}: the job waits in LocalQueue {obs.queue_name} to be admitted "
                       "again, then resumes from the newest checkpoint")
    reserved = _condition_of(obs.workload, "QuotaReserved")
    if reserved and reserved.get("status") == "False" and reserved.get("message"):
        return Verdict("Pending", "Queued", f"waiting for Kueue in LocalQueue {obs.queue_name}: {reserved['message']}")
    return Verdict("Pending", "Queued", f"waiting for Kueue to admit the job in LocalQueue {obs.queue_name}")


def parse_time(value: Any) -> datetime | None:
    if not value:
        return None
    try:
        return datetime.fromisoformat(str(value))
    except ValueError:
        return None


#: How long past its deadline a stuck run is left to the runtime's own watchdog (which reports and exits) before
#: the operator ends the run itself (a frozen driver cannot act).
RESTART_GRACE_SECONDS = 60


def stuck_run(obs: Observed) -> str | None:
    """Why the operator must end the current run itself: no progress for progressDeadlineSeconds plus
    ``RESTART_GRACE_SECONDS``, or no report for twice ``HEARTBEAT_TIMEOUT_SECONDS`` (a frozen driver, a lost
    head pod's network). The caller deletes the run's head pod: KubeRay then counts a failed run, retried per
    backoffLimit (resuming from the newest checkpoint) or final. None while the run is healthy or not running."""
    runtime = obs.old_status.get("runtime") or {}
    if obs.now is None or obs.ray_job is None or _stale(runtime, obs.ray_job):
        return None
    if runtime.get("state") not in ("Starting", "Running") or obs.suspend:
        return None
    progress, heartbeat = parse_time(runtime.get("progressTime")), parse_time(runtime.get("heartbeatTime"))
    if progress and obs.progress_deadline:
        idle = (obs.now - progress).total_seconds()
        if idle > obs.progress_deadline + RESTART_GRACE_SECONDS:
            return (f"no training step completed for {idle:.0f} s (spec.progressDeadlineSeconds "
                    f"{obs.progress_deadline} s) and the runtime did not stop the run itself")
    if heartbeat and (obs.now - heartbeat).total_seconds() > 2 * HEARTBEAT_TIMEOUT_SECONDS:
        return f"no report from the runtime since {runtime['heartbeatTime']}"
    return None


def _no_progress(obs: Observed, runtime: dict[str, Any]) -> Verdict | None:
    """A live runtime that completed no step within spec.progressDeadlineSeconds, or stopped reporting."""
    if obs.now is None:
        return None
    heartbeat = parse_time(runtime.get("heartbeatTime"))
    progress = parse_time(runtime.get("progressTime"))
    if progress and obs.progress_deadline and (obs.now - progress).total_seconds() > obs.progress_deadline:
        return Verdict("Running", "ProgressDeadlineExceeded",
                       f"no training step completed within spec.progressDeadlineSeconds ({obs.progress_deadline} s): "
                       f"last progress at {runtime['progressTime']} (step {obs.old_status.get('step', 0)}); the "
                       "runtime stops a stuck run, which then fails or is retried per spec.backoffLimit")
    if heartbeat and (obs.now - heartbeat).total_seconds() > HEARTBEAT_TIMEOUT_SECONDS:
        return Verdict("Running", "RuntimeUnresponsive",
                       f"the runtime has not reported since {runtime['heartbeatTime']} (it reports every 15 s): its "
                       "driver may be hung or its head pod lost")
    return None


def _retry(ray_job: dict[str, Any] | None) -> str | None:
    """What to say while KubeRay may still retry a failed run (RayJob ``backoffLimit`` > 0 and the RayJob not
    Failed); None when a failed run is final."""
    if not ray_job:
        return None
    limit = (ray_job.get("spec") or {}).get("backoffLimit") or 0
    st = ray_job.get("status") or {}
    if not limit or st.get("jobDeploymentStatus") in ("Failed", "ValidationFailed"):
        return None
    return (f"a run failed ({st.get('failed') or 0} of {limit + 1} runs failed so far); KubeRay retries on a new "
            "Ray cluster, resuming from the newest checkpoint if any")


def verdict(obs: Observed) -> Verdict:
    """The phase, with a CamelCase reason and a message a user can act on: the first of these steps that decides,
    in this order (an earlier one outranks a later one)."""
    runtime = _current_report(obs)
    return (_settled(obs) or _finished_or_suspended(obs, runtime) or _kueue_hold(obs)
            or _runtime_failed(obs, runtime) or _cannot_start(obs, runtime) or _ray_job_ended(obs)
            or _pods_blocked(obs) or _running(obs, runtime) or _provisioning(obs))


def _current_report(obs: Observed) -> dict[str, Any]:
    """The runtime's report (``status.runtime``), unless it is of the run before a retry or a suspension (the new
    run has not reported yet)."""
    runtime = obs.old_status.get("runtime") or {}
    return {} if obs.ray_job is not None and _stale(runtime, obs.ray_job) else runtime


def _ray_job_status(obs: Observed) -> dict[str, Any]:
    return (obs.ray_job or {}).get("status") or {}


def _settled(obs: Observed) -> Verdict | None:
    """A terminal phase (sticky), an invalid spec, or a child the apiserver refused."""
    old_phase = obs.old_status.get("phase")
    ready = next((c for c in obs.old_status.get("conditions") or [] if c.get("type") == "Ready"), {})
    # Terminal is sticky; an InvalidSpec Failed (written by operators before 0.2) recovers like InvalidSpec now does.
    if old_phase in TERMINAL and not (ready.get("reason") == "InvalidSpec" and not obs.invalid):
        return Verdict(old_phase, ready.get("reason") or old_phase, obs.old_status.get("message") or "")
    if obs.invalid:
        return Verdict("Pending", "InvalidSpec", f"{obs.invalid}: fix the spec and the job proceeds")
    if obs.child_rejected:
        return Verdict("Pending", "ChildRejected", f"the apiserver refused an object made from the spec: "
                       f"{obs.child_rejected}")
    return None


def _finished_or_suspended(obs: Observed, runtime: dict[str, Any]) -> Verdict | None:
    """A run that finished (before a suspension could stop it: done is done), else ``spec.suspend``, which comes
    before any failure the runtime reports (a suspended job's driver is terminated with its cluster)."""
    if runtime.get("state") == "Succeeded":
        return Verdict("Succeeded", "RuntimeSucceeded", f"finished {obs.old_status.get('step', '?')} steps")
    if not obs.suspend:
        return None
    deploy = _ray_job_status(obs).get("jobDeploymentStatus")
    if deploy in (None, "Suspended", "New", ""):
        return Verdict("Suspended", "Suspended", "spec.suspend is true: no Ray cluster is running")
    return Verdict("Suspended", "Suspending", f"suspending (RayJob is {deploy})")


def _runtime_failed(obs: Observed, runtime: dict[str, Any]) -> Verdict | None:
    """The runtime reported a failure: KubeRay decides whether it retries on a new cluster (then Retrying) or
    marks the RayJob Failed (checked by ``_retry``)."""
    if runtime.get("state") != "Failed":
        return None
    why = runtime.get("message") or "the runtime reported a failure"
    retry = _retry(obs.ray_job)
    if retry:
        return Verdict("Provisioning", "Retrying", f"{retry}: {why}")
    return Verdict("Failed", "RuntimeFailed", why)


def _cannot_start(obs: Observed, runtime: dict[str, Any]) -> Verdict | None:
    """KubeRay missing, the data ConfigMap missing (no pod could mount it: the operator makes no RayJob, whose
    pods would hold GPUs and never start), or no RayJob yet."""
    if obs.kuberay_missing:
        return Verdict("Pending", "KubeRayMissing", obs.kuberay_missing)
    if obs.data_missing and runtime.get("state") not in ("Starting", "Running"):
        return Verdict("Pending", "DataConfigMapMissing", f"{obs.data_missing}: the job starts once it exists")
    if obs.ray_job is None:
        return Verdict("Pending", "CreatingRayJob", "creating the RayJob")
    return None


def _ray_job_ended(obs: Observed) -> Verdict | None:
    """The RayJob completed or failed (its deployment status or the Ray job's own status)."""
    rj_status = _ray_job_status(obs)
    deploy, ray_status = rj_status.get("jobDeploymentStatus"), rj_status.get("jobStatus")
    if deploy == "Complete" or ray_status == "SUCCEEDED":
        if ray_status in (None, "SUCCEEDED"):
            return Verdict("Succeeded", "RayJobSucceeded", rj_status.get("message") or "the Ray job succeeded")
        return Verdict("Failed", "RayJobFailed", rj_status.get("message") or f"the Ray job ended {ray_status}")
    if deploy in ("Failed", "ValidationFailed") or ray_status in ("FAILED", "STOPPED"):
        why = rj_status.get("message") or rj_status.get("reason") or f"RayJob {deploy or ray_status}"
        return Verdict("Failed", "RayJobFailed", why)
    return None


def _pods_blocked(obs: Observed) -> Verdict | None:
    """A pod that cannot be scheduled (with what the GPU capacity says), pods KubeRay could not create, or KubeRay
    retrying on a new cluster."""
    blocked = _unschedulable(obs.pods)
    if blocked:
        return Verdict("Pending", "Unschedulable", f"{blocked} ({obs.capacity})" if obs.capacity else blocked)
    failure = _replica_failure(obs.ray_cluster)
    if failure:
        return Verdict("Pending", "PodCreationFailed", failure)
    if _ray_job_status(obs).get("jobDeploymentStatus") == "Retrying":
        return Verdict("Provisioning", "Retrying", _retry(obs.ray_job) or "KubeRay retries on a new Ray cluster")
    return None


def _running(obs: Observed, runtime: dict[str, Any]) -> Verdict | None:
    """The Ray cluster is ready and the RayJob running: training, resuming, stuck, or not reported yet."""
    if not (_cluster_ready(obs.ray_cluster) and _ray_job_status(obs).get("jobDeploymentStatus") == "Running"):
        return None
    stuck = _no_progress(obs, runtime) if runtime.get("state") in ("Starting", "Running") else None
    if stuck:
        return stuck
    if runtime.get("state") == "Running":
        return Verdict("Running", "Training", f"step {obs.old_status.get('step', 0)}/{obs.total_steps}")
    if runtime.get("state") == "Starting" and runtime.get("resumedFromStep") is not None:
        return Verdict("Running", "Resuming",
                       f"the runtime restarted and resumes from checkpoint step {runtime['resumedFromStep']}")
    # Not a silent Running: until the driver reports (it patches status.runtime from the head pod), say so.
    return Verdict("Running", "WaitingForRuntime",
                   "the Ray cluster is ready and the driver was submitted; no runtime has reported yet")


def _provisioning(obs: Observed) -> Verdict:
    """Everything else: the Ray cluster is on its way (or a later attempt after a failed run, not yet running)."""
    rj_status = _ray_job_status(obs)
    if rj_status.get("failed") and _retry(obs.ray_job):
        return Verdict("Provisioning", "Retrying", _retry(obs.ray_job) or "")
    cluster = (obs.ray_job or {}).get("status", {}).get("rayClusterName") or "pending"
    deploy = rj_status.get("jobDeploymentStatus")
    return Verdict("Provisioning", "ProvisioningRayCluster", f"Ray cluster {cluster}: RayJob {deploy or 'New'}")


def _condition(ctype: str, ok: bool | None, reason: str, message: str, gen: int) -> dict[str, Any]:
    status = "Unknown" if ok is None else ("True" if ok else "False")
    return {"type": ctype, "status": status, "reason": reason, "message": message, "observedGeneration": gen}


def applied_generation(obs: Observed) -> int:
    """The generation whose spec is in effect. The operator applies a change to its children at once; a live
    runtime applies a change to what it reads itself (spec.algorithm.steps, progressDeadlineSeconds) when it
    next reads its RLHFJob and says so in ``runtime.observedGeneration`` (runtimes that do not report it are
    taken as current)."""
    runtime = obs.old_status.get("runtime") or {}
    live = runtime.get("state") in ("Starting", "Running") and not (obs.ray_job and _stale(runtime, obs.ray_job))
    seen = runtime.get("observedGeneration")
    if live and isinstance(seen, int) and seen < obs.generation:
        return max(seen, min(obs.old_status.get("observedGeneration") or seen, obs.generation))
    return obs.generation


def conditions(obs: Observed, v: Verdict) -> list[dict[str, Any]]:
    gen = applied_generation(obs)
    verdict_stalled = v.phase == "Failed" or v.reason in STALLED_REASONS
    stalled = verdict_stalled or bool(obs.data_missing)
    converging = v.phase in ("Pending", "Provisioning") and not stalled
    # The verdict's own stall explains more (it blocks the phase); a missing data ConfigMap comes next.
    stall_reason, stall_message = (v.reason, v.message) if verdict_stalled else ("DataConfigMapMissing", obs.data_missing)
    blocked = _unschedulable(obs.pods)
    pods_scheduled: bool | None = None if not obs.pods else blocked is None
    cluster_ready = _cluster_ready(obs.ray_cluster)
    out = [
        _condition("Ready", v.phase in ("Running", "Succeeded") and not verdict_stalled, v.reason, v.message, gen),
        _condition("Reconciling", converging, v.reason if converging else "Stable", v.message if converging else "", gen),
        _condition("Stalled", stalled, stall_reason if stalled else "NotStalled", stall_message if stalled else "", gen),
        _condition(
            "PodsScheduled",
            pods_scheduled,
            "Unschedulable" if blocked else ("Scheduled" if obs.pods else "NoPods"),
            blocked or "",
            gen,
        ),
        _condition(
            "RayClusterReady",
            cluster_ready,
            "Ready" if cluster_ready else "NotReady",
            "",
            gen,
        ),
        _condition("Complete", v.phase == "Succeeded", v.reason if v.phase in TERMINAL else "NotFinished", "", gen),
        _condition("InvalidSpec", bool(obs.invalid), "InvalidSpec" if obs.invalid else "Valid", obs.invalid or "", gen),
        _condition(
            "DataAvailable",
            not obs.data_missing,
            "DataConfigMapMissing" if obs.data_missing else "Available",
            obs.data_missing or "",
            gen,
        ),
    ]
    runtime = obs.old_status.get("runtime") or {}
    warning = runtime.get("warning")
    if warning or (obs.old_status.get("throughput") or {}).get("mismatchKl") is not None:
        # a runtime that measures the trainer-vs-engine mismatch: False while it reports a spike after a sync
        out.append(_condition("EnginesInSync", not warning, "MismatchSpike" if warning else "Matching",
                              warning or "", gen))
    fault = (obs.old_status.get("agent") or {}).get("warning")
    if obs.old_status.get("agent"):  # spec.environment: False while a step's tool faults pass their threshold
        out.append(_condition("ToolsHealthy", not fault, "ToolErrors" if fault else "Fine", fault or "", gen))
    data = obs.old_status.get("data") or {}
    if data:  # the runtime checked the samples before the first step (spec.data.invalidSamples)
        dropped = int(data.get("dropped") or 0)
        out.append(_condition("SamplesValid", not dropped, "SamplesDropped" if dropped else "AllSamplesValid",
                              data.get("message") or "", gen))
    if obs.queue_name:  # Kueue: admitted = its RayJob is not held suspended by Kueue
        held = v.reason in ("Queued", "Preempted", "Evicted")
        out.append(_condition("Admitted", not held, v.reason if held else "Admitted", v.message if held else "", gen))
    return out


def _with_times(new: list[dict[str, Any]], old: list[dict[str, Any]], now: str) -> list[dict[str, Any]]:
    before = {c["type"]: c for c in old or []}
    for c in new:
        prev = before.get(c["type"])
        c["lastTransitionTime"] = prev["lastTransitionTime"] if prev and prev["status"] == c["status"] else now
    return new


def compute(obs: Observed, now: datetime) -> dict[str, Any]:
    """The operator-owned part of ``status`` (runtime-owned step/throughput/runtime are never touched)."""
    stamp = now.strftime("%Y-%m-%dT%H:%M:%SZ")
    if obs.now is None:
        obs.now = now
    v = verdict(obs)
    old = obs.old_status
    status: dict[str, Any] = {
        "phase": v.phase,
        "message": v.message,
        "observedGeneration": applied_generation(obs),
        "totalSteps": obs.total_steps,
        "conditions": _with_times(conditions(obs, v), old.get("conditions") or [], stamp),
    }
    if v.phase == "Running" or old.get("startTime"):
        status["startTime"] = old.get("startTime") or stamp
    if v.phase in TERMINAL:
        status["completionTime"] = old.get("completionTime") or stamp
    if obs.ray_job:
        cluster = (obs.ray_job.get("status") or {}).get("rayClusterName")
        if cluster:
            status["children"] = {**(old.get("children") or {}), "rayCluster": cluster}
    return status


def changed(old: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
    """The keys of ``new`` whose values differ from ``old`` (a merge patch; empty when nothing changed)."""
    return {k: v for k, v in new.items() if old.get(k) != v}


def next_check(obs: Observed) -> float | None:
    """Seconds until the verdict of an unchanged world changes by the clock alone (a live runtime's report gets
    too old, its progress deadline passes, or either passes the point where the operator ends the run), so the
    operator looks again then without polling; None when only an event can change it."""
    runtime = obs.old_status.get("runtime") or {}
    if (obs.now is None or obs.ray_job is None or obs.suspend or _stale(runtime, obs.ray_job)
            or runtime.get("state") not in ("Starting", "Running")
            or obs.old_status.get("phase") in TERMINAL):
        return None
    moments = []
    heartbeat, progress = parse_time(runtime.get("heartbeatTime")), parse_time(runtime.get("progressTime"))
    if heartbeat:
        moments += [(heartbeat - obs.now).total_seconds() + s
                    for s in (HEARTBEAT_TIMEOUT_SECONDS, 2 * HEARTBEAT_TIMEOUT_SECONDS)]
    if progress and obs.progress_deadline:
        moments += [(progress - obs.now).total_seconds() + s
                    for s in (obs.progress_deadline, obs.progress_deadline + RESTART_GRACE_SECONDS)]
    ahead = [t for t in moments if t > 0]
    return min(ahead) + 1.0 if ahead else None


def duplicate_clusters(ray_job: dict[str, Any] | None, clusters: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """RayClusters of this RayJob that KubeRay no longer uses: owned by it (same uid), not being deleted, and
    created before the cluster its status names. KubeRay names a cluster in the RayJob's status before it
    creates it and never returns to an older name, so an older unnamed cluster is a leftover of a lost race
    (two clusters for one RayJob, each holding GPUs). A newer unnamed one is left alone: it may be the next
    cluster, named in a status the cache has not seen yet."""
    if not ray_job:
        return []
    uid = (ray_job.get("metadata") or {}).get("uid")
    current = ((ray_job.get("status") or {}).get("rayClusterName")) or ""
    named = next((c for c in clusters if c["metadata"]["name"] == current), None)
    if not uid or named is None:
        return []
    since = parse_time(named["metadata"].get("creationTimestamp"))
    out = []
    for c in clusters:
        meta = c["metadata"]
        owned = any(r.get("uid") == uid for r in meta.get("ownerReferences") or [])
        created = parse_time(meta.get("creationTimestamp"))
        if (owned and meta["name"] != current and not meta.get("deletionTimestamp") and created and since
                and created <= since):
            out.append(c)
    return out
