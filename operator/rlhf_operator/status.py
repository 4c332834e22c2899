"""Pure status computation: what the operator observed -> phase, conditions and message.

KubeRay's RayJob has no conditions; we derive them from its ``jobDeploymentStatus``/``jobStatus``, the
RayCluster's conditions and the pods' ``PodScheduled`` condition, and fold in the runtime's own report
(``status.runtime``). Every condition carries ``observedGeneration``; ``lastTransitionTime`` only moves when a
condition's status flips, so recomputing an unchanged world yields an identical status (no write).

kstatus / Argo CD contract: ``Ready`` True = running or succeeded; ``Reconciling`` True = still converging;
``Stalled`` True = needs a human (failed, unschedulable, invalid, KubeRay missing).
Terminal phases (Succeeded, Failed) are sticky: KubeRay deleting the cluster after the job does not regress.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

TERMINAL = ("Succeeded", "Failed")
#: Non-terminal reasons that need a human: kstatus Stalled=True, Argo CD Degraded.
STALLED_REASONS = ("Unschedulable", "KubeRayMissing", "PodCreationFailed")


@dataclass
class Observed:
    generation: int
    old_status: dict[str, Any]
    total_steps: int | None = None
    suspend: bool = False
    invalid: str | None = None  # why the spec is invalid (defence behind admission), else None
    kuberay_missing: str | None = None  # why KubeRay cannot be used, else None
    data_missing: str | None = None  # why spec.data.configMap cannot be mounted, else None
    ray_job: dict[str, Any] | None = None
    ray_cluster: dict[str, Any] | None = None
    pods: list[dict[str, Any]] = field(default_factory=list)


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


def _replica_failure(cluster: dict[str, Any] | None) -> str | None:
    """KubeRay could not create pods (quota, missing PriorityClass, admission webhook...)."""
    for c in ((cluster or {}).get("status") or {}).get("conditions") or []:
        if c.get("type") in ("ReplicaFailure", "RayClusterReplicaFailure") and c.get("status") == "True":
            message = " ".join((c.get("message") or "").split())  # KubeRay puts the reason and a newline first
            return f"RayCluster {(cluster or {}).get('metadata', {}).get('name', '')}: {message}".strip()
    return None


def _stale(runtime: dict[str, Any], ray_job: dict[str, Any] | None) -> bool:
    """The runtime's report comes from another Ray cluster than the RayJob's current one (KubeRay retried on a
    new cluster). Runtimes that do not name their cluster are taken as current."""
    current = ((ray_job or {}).get("status") or {}).get("rayClusterName")
    return bool(runtime.get("rayCluster") and current and runtime["rayCluster"] != current)


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
    """The phase, with a CamelCase reason and a message a user can act on."""
    old_phase = obs.old_status.get("phase")
    if old_phase in TERMINAL:
        ready = next((c for c in obs.old_status.get("conditions") or [] if c.get("type") == "Ready"), {})
        return Verdict(old_phase, ready.get("reason") or old_phase, obs.old_status.get("message") or "")
    if obs.invalid:
        return Verdict("Failed", "InvalidSpec", obs.invalid)
    runtime = obs.old_status.get("runtime") or {}
    if _stale(runtime, obs.ray_job):  # a report of the run before a retry: the new run has not reported yet
        runtime = {}
    if runtime.get("state") == "Failed":
        why = runtime.get("message") or "the runtime reported a failure"
        retry = _retry(obs.ray_job)
        if retry:  # KubeRay decides: it retries on a new cluster, or marks the RayJob Failed (checked there)
            return Verdict("Provisioning", "Retrying", f"{retry}: {why}")
        return Verdict("Failed", "RuntimeFailed", why)
    if runtime.get("state") == "Succeeded":
        return Verdict("Succeeded", "RuntimeSucceeded", f"finished {obs.old_status.get('step', '?')} steps")
    if obs.kuberay_missing:
        return Verdict("Pending", "KubeRayMissing", obs.kuberay_missing)
    rj_status = (obs.ray_job or {}).get("status") or {}
    deploy = rj_status.get("jobDeploymentStatus")
    ray_status = rj_status.get("jobStatus")
    if obs.suspend:
        if deploy in (None, "Suspended", "New", ""):
            return Verdict("Suspended", "Suspended", "spec.suspend is true: no Ray cluster is running")
        return Verdict("Suspended", "Suspending", f"suspending (RayJob is {deploy})")
    if obs.ray_job is None:
        return Verdict("Pending", "CreatingRayJob", "creating the RayJob")
    if deploy == "Complete" or ray_status == "SUCCEEDED":
        if ray_status in (None, "SUCCEEDED"):
            return Verdict("Succeeded", "RayJobSucceeded", rj_status.get("message") or "the Ray job succeeded")
        return Verdict("Failed", "RayJobFailed", rj_status.get("message") or f"the Ray job ended {ray_status}")
    if deploy in ("Failed", "ValidationFailed") or ray_status in ("FAILED", "STOPPED"):
        why = rj_status.get("message") or rj_status.get("reason") or f"RayJob {deploy or ray_status}"
        return Verdict("Failed", "RayJobFailed", why)
    blocked = _unschedulable(obs.pods)
    if blocked:
        return Verdict("Pending", "Unschedulable", blocked)
    failure = _replica_failure(obs.ray_cluster)
    if failure:
        return Verdict("Pending", "PodCreationFailed", failure)
    if deploy == "Retrying":
        return Verdict("Provisioning", "Retrying", _retry(obs.ray_job) or "KubeRay retries on a new Ray cluster")
    if _cluster_ready(obs.ray_cluster) and deploy == "Running":
        if runtime.get("state") == "Running":
            return Verdict("Running", "Training", f"step {obs.old_status.get('step', 0)}/{obs.total_steps}")
        if runtime.get("state") == "Starting" and runtime.get("resumedFromStep") is not None:
            return Verdict("Running", "Resuming",
                           f"the runtime restarted and resumes from checkpoint step {runtime['resumedFromStep']}")
        # Not a silent Running: until the driver reports (it patches status.runtime from the head pod), say so.
        return Verdict("Running", "WaitingForRuntime",
                       "the Ray cluster is ready and the driver was submitted; no runtime has reported yet")
    cluster = (obs.ray_job or {}).get("status", {}).get("rayClusterName") or "pending"
    return Verdict("Provisioning", "ProvisioningRayCluster", f"Ray cluster {cluster}: RayJob {deploy or 'New'}")


def _condition(ctype: str, ok: bool | None, reason: str, message: str, gen: int) -> dict[str, Any]:
    status = "Unknown" if ok is None else ("True" if ok else "False")
    return {"type": ctype, "status": status, "reason": reason, "message": message, "observedGeneration": gen}


def conditions(obs: Observed, v: Verdict) -> list[dict[str, Any]]:
    gen = obs.generation
    verdict_stalled = v.phase == "Failed" or v.reason in STALLED_REASONS
    stalled = verdict_stalled or bool(obs.data_missing)
    converging = v.phase in ("Pending", "Provisioning") and not stalled
    # The verdict's own stall explains more (it blocks the phase); a missing data ConfigMap comes next.
    stall_reason, stall_message = (v.reason, v.message) if verdict_stalled else ("DataConfigMapMissing", obs.data_missing)
    blocked = _unschedulable(obs.pods)
    pods_scheduled: bool | None = None if not obs.pods else blocked is None
    cluster_ready = _cluster_ready(obs.ray_cluster)
    out = [
        _condition("Ready", v.phase in ("Running", "Succeeded"), v.reason, v.message, gen),
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
    v = verdict(obs)
    old = obs.old_status
    status: dict[str, Any] = {
        "phase": v.phase,
        "message": v.message,
        "observedGeneration": obs.generation,
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
