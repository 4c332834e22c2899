"""Kopf handlers: thin, level-based, idempotent.

Every trigger (an RLHFJob event, a RayJob event, a periodic timer) runs the same ``reconcile``: parse the
spec, save child names to status, create what is missing (owned via ``kopf.adopt``), patch what may change,
observe children, compute status with the pure ``status.compute`` and write it only if it changed.
No create/update handlers: Kopf then keeps no progress annotations, so an unchanged object is never written.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import os
import threading
from typing import Any

import kopf
from kubernetes.client.rest import ApiException
from pydantic import ValidationError

from rlhf_api import models as m
from rlhf_operator import kube, metrics, naming, render, status

log = logging.getLogger("rlhf_operator")
RESYNC_SECONDS = float(os.environ.get("RLHF_RESYNC_SECONDS", "10"))


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
    settings.persistence.finalizer = naming.FINALIZER
    # A job deleted while its (sync) resync timer runs: Kopf removes the finalizer only once the timer has
    # exited, and looks again every cancellation_polling seconds (default 60: deletions then took a minute).
    settings.background.cancellation_polling = 1.0
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=m.GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(prefix=m.GROUP)
    settings.posting.level = logging.WARNING  # only our own events, not Kopf's handler chatter
    settings.watching.server_timeout = 60
    settings.execution.max_workers = int(os.environ.get("RLHF_WORKERS", "8"))


@kopf.on.login()
def login(**kwargs: Any) -> kopf.ConnectionInfo | None:
    """Authenticate Kopf exactly like our own client (in-cluster ServiceAccount, else KUBECONFIG)."""
    kube.api()  # loads the configuration once
    return kopf.login_via_client(**kwargs)


def _api_message(e: ApiException) -> str:
    """The apiserver's own message of a refused request."""
    try:
        return str(json.loads(e.body or "{}").get("message") or e.reason)[:900]
    except (ValueError, AttributeError):
        return f"{e.status} {e.reason}"


def _spec_error(e: ValidationError) -> str:
    parts = []
    for err in e.errors()[:5]:
        where = ".".join(str(x) for x in err["loc"])
        parts.append(f"spec.{where}: {err['msg']}")
    return "; ".join(parts)


def _event(body: Any, reason: str, message: str, warning: bool = False) -> None:
    try:
        kopf.event(body, type="Warning" if warning else "Normal", reason=reason, message=message[:1000])
    except Exception:  # events are best effort; never fail a reconcile over one
        log.exception("could not post event %s", reason)


def _ensure_children(job: render.Job, body: Any) -> dict[str, Any] | None:
    """Create what is missing, patch what may change; returns the live RayJob (None if just created)."""
    for obj in render.render_runtime_rbac(job):
        kopf.adopt(obj, owner=body)
        if kube.ensure_object(obj) == "updated":
            _event(body, "Updated", f"{obj['kind']} {obj['metadata']['name']} restored to the rendered one")
    cm = render.render_config_map(job)
    kopf.adopt(cm, owner=body)
    existing = kube.get_config_map(job.namespace, cm["metadata"]["name"])
    if existing is None:
        if kube.create_config_map(cm):
            _event(body, "Created", f"ConfigMap {cm['metadata']['name']}")
    elif (existing.get("data") or {}) != cm["data"]:
        kube.replace_config_map_data(job.namespace, cm["metadata"]["name"], cm["data"])

    rj = render.render_ray_job(job)
    kopf.adopt(rj, owner=body)
    name = rj["metadata"]["name"]
    live = kube.get_ray_job(job.namespace, name)
    queued = bool(job.spec.scheduling.queue_name)
    if live is None:
        if kube.create_ray_job(rj):
            _event(body, "Created", f"RayJob {name} ({_layout(job.spec)})")
        return None
    patch = render.ray_job_mutable_patch(rj, live, kueue=queued)
    if patch:
        kube.patch_ray_job(job.namespace, name, patch)
        live = {**live, "spec": {**(live.get("spec") or {}), **patch["spec"]}}
        if "suspend" in patch["spec"]:
            _event(body, "Suspended" if job.spec.suspend else "Resumed", f"RayJob {name}")
        rest = sorted(set(patch["spec"]) - {"suspend"})
        if rest:
            _event(body, "Updated", f"RayJob {name}: {', '.join(rest)} from the spec")
    return live


def _kueue_workload(job: render.Job, live: dict[str, Any] | None, body: Any) -> dict[str, Any] | None:
    """With spec.scheduling.queueName: the RayJob's Kueue Workload, whose ``spec.active`` follows spec.suspend
    (Kueue owns the RayJob's suspend; deactivating the Workload is how a queued job is suspended)."""
    if not job.spec.scheduling.queue_name or not live:
        return None
    workload = kube.find_workload(job.namespace, live["metadata"]["uid"])
    if workload is not None and (workload.get("spec") or {}).get("active", True) == job.spec.suspend:
        kube.set_workload_active(workload, not job.spec.suspend)
        _event(body, "Suspended" if job.spec.suspend else "Resumed",
               f"Kueue Workload {workload['metadata']['name']} active={not job.spec.suspend}")
    return workload


def _layout(spec: m.RLHFJobSpec) -> str:
    return (
        f"{spec.placement.mode}, trainer {spec.trainer.replicas}x{spec.trainer.gpus_per_replica} GPU, "
        f"{spec.rollout.engines} engine(s) x TP{spec.rollout.tensor_parallel_size}"
        f"{' (one expert-parallel DP group)' if spec.rollout.expert_parallel else ''}, sync {spec.weight_sync.backend}"
    )


def reconcile(body: Any, now: dt.datetime | None = None) -> None:
    meta, name, ns = body["metadata"], body["metadata"]["name"], body["metadata"]["namespace"]
    old_status = dict(body.get("status") or {})
    obs = status.Observed(generation=meta.get("generation", 1), old_status=old_status)
    if meta.get("deletionTimestamp"):
        return
    try:
        spec = m.RLHFJobSpec.model_validate(dict(body.get("spec") or {}))
    except ValidationError as e:
        obs.invalid = _spec_error(e)
        spec = None
    if spec is not None:
        obs.total_steps = spec.algorithm.steps
        obs.suspend = spec.suspend
        names = naming.child_names(name)
        if (old_status.get("children") or {}).get("rayJob") != names.ray_job:
            # Names are saved before anything is created: a restarted operator finds, never duplicates.
            kube.patch_status(ns, name, {"children": names.as_status()})
            old_status["children"] = {**(old_status.get("children") or {}), **names.as_status()}
        obs.data_missing = _data_missing(ns, spec)
        obs.kuberay_missing = kube.kuberay_missing()
        obs.queue_name = spec.scheduling.queue_name
        obs.progress_deadline = spec.progress_deadline_seconds
        if not obs.kuberay_missing:
            job = render.Job(name, ns, meta["uid"], spec)
            if old_status.get("phase") not in status.TERMINAL or _invalid_before(old_status):
                try:
                    obs.ray_job = _ensure_children(job, body)
                except ApiException as e:
                    if e.status not in (400, 422):
                        raise
                    # refused for good (e.g. a value the RayJob's schema does not take): say so, do not retry-loop
                    obs.child_rejected = _api_message(e)
                obs.workload = _kueue_workload(job, obs.ray_job, body)
            else:
                obs.ray_job = kube.get_ray_job(ns, names.ray_job)
            cluster = ((obs.ray_job or {}).get("status") or {}).get("rayClusterName")
            if cluster:
                obs.ray_cluster = kube.get_ray_cluster(ns, cluster)
                obs.pods = kube.list_pods(ns, f"ray.io/cluster={cluster}")
                if status.capacity_message({}, obs.pods, None) is not None:  # a pod waits for GPUs
                    nodes = kube.gpu_nodes()
                    if nodes is not None:
                        obs.capacity = status.capacity_message(nodes, obs.pods, spec.scheduling.node_selector)
    obs.now = now or dt.datetime.now(dt.UTC)
    if spec is not None and obs.ray_cluster and old_status.get("phase") not in status.TERMINAL:
        _end_stuck_run(obs, body)
    new = status.compute(obs, obs.now)
    metrics.observe(ns, name, {**old_status, **new})
    patch = status.changed(old_status, new)
    if not patch:
        return
    kube.patch_status(ns, name, patch)
    metrics.STATUS_WRITES.inc()
    old_phase = old_status.get("phase")
    reason = _ready_reason(new)
    if new["phase"] != old_phase or "message" in patch and new["phase"] in ("Pending", "Failed"):
        warn = new["phase"] == "Failed" or reason in status.STALLED_REASONS or bool(obs.kuberay_missing)
        _event(body, new["phase"], new["message"] or new["phase"], warning=warn)
    elif reason in EVENT_REASONS and _ready_reason(old_status) != reason:
        # a run restarted, or stopped making progress, without a phase change
        _event(body, reason, new["message"], warning=reason in WARNING_REASONS)
    if obs.data_missing and _condition_flipped(old_status, new, "DataAvailable"):
        _event(body, "DataConfigMapMissing", obs.data_missing, warning=True)


#: Ready reasons that get an Event when they appear without a phase change: a run restarted (e.g. a lost head pod:
#: KubeRay's submitter resubmits), or a running job stopped making progress.
EVENT_REASONS = ("Retrying", "Resuming", "ProgressDeadlineExceeded", "RuntimeUnresponsive")
WARNING_REASONS = ("Retrying", "ProgressDeadlineExceeded", "RuntimeUnresponsive")


def _invalid_before(st: dict[str, Any]) -> bool:
    """A Failed phase written for an invalid spec by an operator before 0.2 (InvalidSpec was terminal then)."""
    return st.get("phase") == "Failed" and _ready_reason(st) == "InvalidSpec"


def _ready_reason(st: dict[str, Any]) -> str | None:
    return next((c.get("reason") for c in st.get("conditions") or [] if c.get("type") == "Ready"), None)


def _condition_flipped(old: dict[str, Any], new: dict[str, Any], ctype: str) -> bool:
    def of(st: dict[str, Any]) -> str | None:
        return next((c["status"] for c in st.get("conditions") or [] if c["type"] == ctype), None)

    return of(old) != of(new)


def _end_stuck_run(obs: status.Observed, body: Any) -> None:
    """A run that is stuck past its deadline and did not end itself: delete its Ray head pod, once. KubeRay then
    counts a failed run (retried per spec.backoffLimit from the newest checkpoint, or final): the restart policy
    also holds for a frozen driver."""
    why = status.stuck_run(obs)
    if not why:
        return
    head = next((p for p in obs.pods if (p.get("metadata") or {}).get("labels", {}).get("ray.io/node-type") == "head"
                 and not p["metadata"].get("deletionTimestamp")), None)
    reported = status.parse_time((obs.old_status.get("runtime") or {}).get("heartbeatTime"))
    created = status.parse_time((head or {}).get("metadata", {}).get("creationTimestamp"))
    if head is None or not reported or not created or created > reported:
        return  # a head pod newer than the last report runs a run that has not reported yet: not the stuck one
    kube.delete_pod(head["metadata"]["namespace"], head["metadata"]["name"])
    _event(body, "EndingStuckRun", f"{why}: deleted the Ray head pod {head['metadata']['name']} so that the run "
           "fails and is retried or failed per spec.backoffLimit", warning=True)


def _data_missing(ns: str, spec: m.RLHFJobSpec) -> str | None:
    """The prompts ConfigMap must exist and hold its key, or the pods cannot mount it."""
    ref = spec.data.config_map
    if ref is None:
        return None
    cm = kube.get_config_map(ns, ref.name)
    if cm is None:
        return f"ConfigMap {ref.name} (spec.data.configMap) not found in namespace {ns}"
    if ref.key not in (cm.get("data") or {}) and ref.key not in (cm.get("binaryData") or {}):
        return f"ConfigMap {ref.name} has no key {ref.key} (spec.data.configMap.key)"
    return None


#: One lock per job: a job's reconciles never overlap (an RLHFJob event, a RayJob event and the resync timer may
#: fire together), and each starts from a fresh read of the RLHFJob, so no decision is taken on an older body
#: than the one the previous reconcile saw (a stale ``suspend`` would flap the RayJob; a stale body of a deleted
#: job would create its children again).
_LOCKS: dict[tuple[str, str], threading.Lock] = {}
_LOCKS_GUARD = threading.Lock()


def _job_lock(ns: str, name: str) -> threading.Lock:
    with _LOCKS_GUARD:
        return _LOCKS.setdefault((ns, name), threading.Lock())


def _safe_reconcile(ns: str, name: str, uid: str | None = None) -> None:
    with _job_lock(ns, name):
        try:
            body = kube.get_rlhfjob(ns, name)
            if body is None or (uid and body["metadata"]["uid"] != uid):
                return  # deleted (or deleted and re-created: the new one gets its own events)
            reconcile(body)
            metrics.RECONCILES.labels("ok").inc()
        except ApiException as e:
            metrics.RECONCILES.labels("api_error").inc()
            # Transient API trouble (conflict, throttling, apiserver restart): retry on the next trigger.
            raise kopf.TemporaryError(f"Kubernetes API: {e.status} {e.reason}", delay=5) from e


@kopf.on.event(m.GROUP, m.VERSION, m.PLURAL)
def rlhfjob_event(body: kopf.Body, type: str | None, **_: Any) -> None:
    ns, name = body["metadata"]["namespace"], body["metadata"]["name"]
    if type == "DELETED":
        metrics.forget(ns, name)
        with _LOCKS_GUARD:
            _LOCKS.pop((ns, name), None)
        return
    _safe_reconcile(ns, name, body["metadata"].get("uid"))


@kopf.timer(m.GROUP, m.VERSION, m.PLURAL, interval=RESYNC_SECONDS, sharp=False)
def rlhfjob_resync(body: kopf.Body, **_: Any) -> None:
    _safe_reconcile(body["metadata"]["namespace"], body["metadata"]["name"], body["metadata"].get("uid"))


@kopf.on.delete(m.GROUP, m.VERSION, m.PLURAL)
def rlhfjob_deleted(body: kopf.Body, **_: Any) -> None:
    """The finalizer's work: wait out any reconcile of this job that is in flight. Kopf removes the finalizer only
    after this returns, so the garbage collector cannot delete the children between a reconcile's read of the job
    and its create of a missing child (which re-created RayJobs of deleted jobs under load); every later reconcile
    reads the job fresh, sees ``deletionTimestamp`` and creates nothing."""
    with _job_lock(body["metadata"]["namespace"], body["metadata"]["name"]):
        pass


@kopf.on.event("ray.io", "v1", "rayjobs", labels={naming.LABEL_JOB: kopf.PRESENT})
def rayjob_event(body: kopf.Body, type: str | None, **_: Any) -> None:
    """A RayJob changed: reconcile its RLHFJob now instead of at the next resync."""
    owner = body["metadata"]["labels"][naming.LABEL_JOB]
    uid = next((r.get("uid") for r in body["metadata"].get("ownerReferences") or [] if r.get("kind") == m.KIND), None)
    _safe_reconcile(body["metadata"]["namespace"], owner, uid)


@kopf.on.probe(id="kuberay")
def kuberay_probe(**_: Any) -> str:
    return kube.kuberay_missing() or "ok"
