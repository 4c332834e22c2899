"""Kopf wiring and the reconcile of one job: event-driven, from watch caches, one reconcile per job at a time.

- **Caches**: Kopf indexes (``cache``) of RLHFJobs and of the RayJobs, RayClusters, pods, ConfigMaps, runtime
  ServiceAccounts/Roles/RoleBindings and Kueue Workloads labelled for our jobs (label selectors applied
  server-side: the operator never receives other pods). Kopf runs no handler before every index is filled, so a
  restarted operator sees everything it made before it decides anything.
- **Triggers**: every watch event of those kinds adds its job's key to a coalescing ``WorkQueue``; a job's
  reconciles never overlap, and the last event is always seen. There is no periodic resync: the only timers are
  the moments a live run's report or progress deadline runs out (``status.next_check``) and, while a pod waits
  for GPUs, the renewal of the shared capacity snapshot.
- **Reconcile**: read the job's snapshot from the caches, create what is missing (owned by the job), patch what
  may change, compute status with the pure ``status.compute`` and write it only when it changed; one Event per
  transition. Writes are remembered in the cache until the watch shows them (``Caches.remember``).
- **No finalizer**: the children are owned objects (the garbage collector deletes them), so a job deletes
  without an operator running. Creating a missing child is the one risky step (a job deleted meanwhile would
  get it again): it is preceded by a fresh read of the job, the only read outside the caches. Kopf removes the
  finalizer (``rlhf.dev/finalizer``) older operators put on jobs.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import logging
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any

import kopf
from kubernetes.client.rest import ApiException
from pydantic import ValidationError

from rlhf_api import models as m
from rlhf_operator import cache, kube, metrics, naming, render, status
from rlhf_operator.workqueue import WorkQueue

log = logging.getLogger("rlhf_operator")
WORKERS = 16  # main --workers
CACHE = cache.Caches()
QUEUE: WorkQueue | None = None
#: Kopf's pause switch (a peer of higher priority is active), set by ``main`` when it runs with peering; while it
#: is on, keys are dropped (the active peer does the work). ``PEERING`` without a switch holds every key.
PAUSED: Any = None
PEERING = False
_EXECUTOR: ThreadPoolExecutor | None = None
#: Seconds before a reconcile refused by the API (conflict, throttling, an apiserver restart) is retried.
API_RETRY_SECONDS = 5.0
#: Re-check a missing data ConfigMap after these many seconds (doubling, at most DATA_RECHECK_MAX).
DATA_RECHECK_MIN, DATA_RECHECK_MAX = 2.0, 60.0


class NoDiffBase(kopf.DiffBaseStorage):
    """Kopf keeps a "diff base" (the last handled essence of each object) for change-detecting handlers
    (``on.create``/``update``/``resume``/``field``, timers' spawning) and builds a new one on every watch event of
    every watched object: a deep copy of the whole body, spec and status, about 15 % of this operator's CPU at 100
    jobs (py-spy). This operator registers none of those handlers (``tests/unit/test_event_driven.py`` checks): its
    diff base is empty and never stored."""

    def build(self, *, body: Any, extra_fields: Any = None) -> Any:
        return {}

    def fetch(self, *, body: Any) -> None:
        return None

    def store(self, *, body: Any, patch: Any, essence: Any) -> None:
        return None


def _held() -> bool:
    return PEERING and (PAUSED is None or PAUSED.is_on())


@kopf.on.startup()
async def configure(settings: kopf.OperatorSettings, **kwargs: Any) -> None:
    global QUEUE, _EXECUTOR
    # Kopf removes this finalizer from jobs an older operator put it on (no handler here requires one).
    settings.persistence.finalizer = naming.FINALIZER
    settings.posting.level = logging.WARNING  # Kopf's own chatter; our Events are posted by kube.post_event
    settings.persistence.diffbase_storage = NoDiffBase()
    settings.watching.server_timeout = 300
    selector = naming.LABEL_JOB  # label present: only what we made (KubeRay copies the RayJob's labels down)
    for res in (("ray.io", "rayjobs"), ("ray.io", "rayclusters"), ("v1", "pods"), ("v1", "configmaps"),
                ("v1", "serviceaccounts"), ("rbac.authorization.k8s.io", "roles"),
                ("rbac.authorization.k8s.io", "rolebindings")):
        settings.watching.label_selectors[res] = selector
    settings.watching.label_selectors[kube.KUEUE_GROUP, "workloads"] = kube.KUEUE_JOB_UID_LABEL
    CACHE.bind({k: v for k, v in kwargs.items() if k.startswith("rlhf_")})
    await asyncio.get_running_loop().run_in_executor(None, kube.warm_up)  # not on the first job's path
    _EXECUTOR = ThreadPoolExecutor(max_workers=WORKERS, thread_name_prefix="rlhf-io")
    QUEUE = WorkQueue(_reconcile_key, WORKERS, hold=_held, on_wait=metrics.QUEUE_WAIT_SECONDS.observe)
    QUEUE.start()


@kopf.on.cleanup()
async def shutdown(**_: Any) -> None:
    if QUEUE is not None:
        await QUEUE.stop()


@kopf.on.login()
def login(**kwargs: Any) -> kopf.ConnectionInfo | None:
    """Authenticate Kopf exactly like our own client (in-cluster ServiceAccount, else KUBECONFIG)."""
    kube.api()  # loads the configuration once
    return kopf.login_via_client(**kwargs)


# ------------------------------------------------------------------------------------- caches (indexes)
@kopf.index(m.GROUP, m.VERSION, m.PLURAL)
def rlhf_jobs(body: kopf.Body, namespace: str, name: str, **_: Any) -> dict[Any, Any]:
    return {(namespace, name): cache.job(body)}


@kopf.index("ray.io", "v1", "rayjobs", labels={naming.LABEL_JOB: kopf.PRESENT})
def rlhf_ray_jobs(body: kopf.Body, namespace: str, labels: dict[str, str], **_: Any) -> dict[Any, Any]:
    return {(namespace, labels[naming.LABEL_JOB]): cache.ray_job(body)}


@kopf.index("ray.io", "v1", "rayclusters", labels={naming.LABEL_JOB: kopf.PRESENT})
def rlhf_ray_clusters(body: kopf.Body, namespace: str, labels: dict[str, str], **_: Any) -> dict[Any, Any]:
    return {(namespace, labels[naming.LABEL_JOB]): cache.ray_cluster(body)}


@kopf.index("v1", "pods", labels={naming.LABEL_JOB: kopf.PRESENT, cache.CLUSTER_LABEL: kopf.PRESENT})
def rlhf_pods(body: kopf.Body, namespace: str, labels: dict[str, str], **_: Any) -> dict[Any, Any]:
    return {(namespace, labels[cache.CLUSTER_LABEL]): cache.pod(body)}


@kopf.index("v1", "configmaps", labels={naming.LABEL_JOB: kopf.PRESENT})
def rlhf_config_maps(body: kopf.Body, namespace: str, name: str, **_: Any) -> dict[Any, Any]:
    return {(namespace, name): cache.config_map(body)}


def _rbac_index(body: kopf.Body, namespace: str, name: str, **_: Any) -> dict[Any, Any]:
    return {(namespace, body["kind"], name): cache.rbac_object(body)}


rlhf_rbac_sa = kopf.index("v1", "serviceaccounts", id="rlhf_rbac_sa", labels={naming.LABEL_JOB: kopf.PRESENT})(
    _rbac_index)
rlhf_rbac_role = kopf.index("rbac.authorization.k8s.io", "v1", "roles", id="rlhf_rbac_role",
                            labels={naming.LABEL_JOB: kopf.PRESENT})(_rbac_index)
rlhf_rbac_binding = kopf.index("rbac.authorization.k8s.io", "v1", "rolebindings", id="rlhf_rbac_binding",
                               labels={naming.LABEL_JOB: kopf.PRESENT})(_rbac_index)


@kopf.index(kube.KUEUE_GROUP, "workloads")
def rlhf_workloads(body: kopf.Body, namespace: str, **_: Any) -> dict[Any, Any]:
    owner = cache.owner_name(body, "RayJob")
    return {(namespace, owner): cache.workload(body)} if owner else {}


# ------------------------------------------------------------------------------------- triggers (events)
@kopf.on.event(m.GROUP, m.VERSION, m.PLURAL)
async def rlhfjob_event(type: str | None, body: kopf.Body, namespace: str, name: str, **_: Any) -> None:
    deleted = type == "DELETED"
    echo = CACHE.seen("job", (namespace, name), body, deleted=deleted)
    changed = CACHE.changed("job", (namespace, name), None if deleted else cache.job(body))
    if deleted:
        metrics.forget(namespace, name)
        forget(namespace, name)
        if QUEUE is not None:
            QUEUE.forget((namespace, name))
        return
    if type is not None and (echo or not changed):
        return  # our own status write coming back, or a change no reconcile reads (annotations, managed fields)
    # A job no reconcile has seen (no status yet) goes ahead of the others: it waits for its children.
    _add((namespace, name), urgent=not (body.get("status") or {}).get("phase"))


#: The projection each child kind is cached as (see the indexes above).
PROJECTIONS = {"RayJob": cache.ray_job, "RayCluster": cache.ray_cluster, "Pod": cache.pod,
               "ConfigMap": cache.config_map, "ServiceAccount": cache.rbac_object, "Role": cache.rbac_object,
               "RoleBinding": cache.rbac_object, "Workload": cache.workload}


def _child_event(kind: str) -> Any:
    project = PROJECTIONS[kind]

    async def on_event(type: str | None, body: kopf.Body, namespace: str, name: str, labels: dict[str, str],
                       **_: Any) -> None:
        deleted = type == "DELETED"
        echo = CACHE.seen(kind, (namespace, name), body, deleted=deleted)
        changed = CACHE.changed(kind, (namespace, name), None if deleted else project(body))
        job = labels.get(naming.LABEL_JOB) or cache.owner_name(body, "RayJob")
        # Only a change the reconcile can see wakes it: a pod's status update outside its phase and scheduling,
        # a RayJob's copy of its cluster's status, or our own write coming back change nothing it reads. A listing
        # (type None: the start, or watches resumed after a peering pause) always does: timers dropped while
        # paused are armed again by the reconciles it causes.
        if job and (type is None or (changed and not echo)):
            _add((namespace, job))
    return on_event


def _add(key: tuple[str, str], urgent: bool = False) -> None:
    if QUEUE is not None:
        QUEUE.add(key, urgent)


_PRESENT = {naming.LABEL_JOB: kopf.PRESENT}
kopf.on.event("ray.io", "v1", "rayjobs", id="rayjob_event", labels=_PRESENT)(_child_event("RayJob"))
kopf.on.event("ray.io", "v1", "rayclusters", id="raycluster_event", labels=_PRESENT)(_child_event("RayCluster"))
kopf.on.event("v1", "pods", id="pod_event", labels=_PRESENT)(_child_event("Pod"))
kopf.on.event("v1", "configmaps", id="configmap_event", labels=_PRESENT)(_child_event("ConfigMap"))
kopf.on.event("v1", "serviceaccounts", id="sa_event", labels=_PRESENT)(_child_event("ServiceAccount"))
kopf.on.event("rbac.authorization.k8s.io", "v1", "roles", id="role_event", labels=_PRESENT)(
    _child_event("Role"))
kopf.on.event("rbac.authorization.k8s.io", "v1", "rolebindings", id="rolebinding_event", labels=_PRESENT)(
    _child_event("RoleBinding"))
kopf.on.event(kube.KUEUE_GROUP, "workloads", id="workload_event")(_child_event("Workload"))


# ------------------------------------------------------------------------------------------- reconcile
@dataclass
class Outcome:
    """What a reconcile wrote (remembered in the cache until the watch shows it) and when to look again."""
    written: list[tuple[str, Any, dict[str, Any] | None]] = field(default_factory=list)  # None: deleted
    again: float | None = None


async def _reconcile_key(key: tuple[str, str]) -> float | None:
    ns, name = key
    snap = CACHE.snapshot(ns, name)
    if snap.job is None:
        return None
    loop = asyncio.get_running_loop()
    started = loop.time()
    try:
        out = await loop.run_in_executor(_EXECUTOR, reconcile, snap)
        metrics.RECONCILES.labels("ok").inc()
    except ApiException as e:
        metrics.RECONCILES.labels("api_error").inc()
        # Transient API trouble (conflict, throttling, apiserver restart): retry soon from the caches.
        log.warning("reconcile of %s/%s: Kubernetes API %s %s; retrying in %s s", ns, name, e.status, e.reason,
                    API_RETRY_SECONDS)
        return API_RETRY_SECONDS
    finally:
        metrics.RECONCILE_SECONDS.observe(loop.time() - started)
    for kind, k, obj in out.written:
        CACHE.remember(kind, k, obj)
    return out.again


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


#: Requests of one reconcile that do not depend on each other run side by side here (the reconcile's own thread
#: waits for them): a new job's reads, then its runtime RBAC and ConfigMap, cost one round trip each, not four.
_IO = ThreadPoolExecutor(max_workers=32, thread_name_prefix="rlhf-req")
#: Events are posted off the reconcile's path, in the order they were decided (one thread), stamped when decided.
_EVENTS = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rlhf-events")


def _together(*calls: Any) -> list[Any]:
    """Run the zero-argument ``calls`` side by side; their results in order (the first error raised, after every
    call has ended, so no request of this reconcile outlives it)."""
    if len(calls) == 1:
        return [calls[0]()]
    futures = [_IO.submit(c) for c in calls]
    wait(futures)
    return [f.result() for f in futures]


def _event(body: Any, reason: str, message: str, warning: bool = False) -> None:
    """Post a core/v1 Event about the job, asynchronously (best effort: an Event never fails a reconcile)."""
    at = dt.datetime.now(dt.UTC)

    def post() -> None:
        try:
            kube.post_event(body, "Warning" if warning else "Normal", reason, message, at=at)
        except Exception:
            log.exception("could not post event %s", reason)

    _EVENTS.submit(post)


def _still_wanted(live: dict[str, Any] | None, job: render.Job) -> bool:
    """From a fresh read before creating a child: the job still exists, is the same object and is not being deleted
    (the cache may not have seen a deletion yet; the child of a deleted job would be created again)."""
    return bool(live) and live["metadata"].get("uid") == job.uid and not live["metadata"].get("deletionTimestamp")


def _ensure_children(job: render.Job, body: Any, snap: cache.Snapshot, out: Outcome,
                     data_missing: bool = False, fresh: Future[Any] | None = None) -> dict[str, Any] | None:
    """Create what the cache says is missing, patch what may change; returns the RayJob (the one created, if so),
    or None when the job turned out to be gone or its data ConfigMap is missing (no RayJob is made then).

    Creating is done in three round trips: the fresh reads (``fresh``: the job and the RayJob, started by
    ``reconcile`` beside its data check), the runtime RBAC and ConfigMap side by side, then the RayJob (its pods
    need the ServiceAccount and the ConfigMap, so those exist first)."""
    ns = job.namespace
    rbac, cm, rj = _rendered(job, body)
    name = rj["metadata"]["name"]
    live = snap.ray_job
    if _missing(job, snap, data_missing):
        live_job, fetched = fresh.result() if fresh is not None else _fresh_reads(job)
        if not _still_wanted(live_job, job):
            return None
        if live is None and fetched is not None:
            # The cache lagged (a peer made it while this replica was paused, and the RayJob watch is re-listed
            # after the RLHFJob one): a create would only be answered 409.
            live = cache.ray_job(fetched)
            out.written.append(("RayJob", (ns, name), live))
    _together(*[lambda obj=obj: _ensure_rbac(obj, snap, body, out) for obj in rbac],
              lambda: _ensure_config_map(cm, snap, body, out))

    queued = bool(job.spec.scheduling.queue_name)
    if live is None and data_missing:
        return None  # its pods could not mount the data: they would hold GPUs and never start
    if live is None:
        made = kube.create_ray_job(rj)
        if made is None:  # made in between by someone else
            fetched = kube.get_ray_job(ns, name)
            return cache.ray_job(fetched) if fetched else None
        live = cache.ray_job(made)
        out.written.append(("RayJob", (ns, name), live))
        _event(body, "Created", f"RayJob {name} ({_layout(job.spec)})")
        return live
    patch = render.ray_job_mutable_patch(rj, live, kueue=queued)
    if patch:
        live = cache.ray_job(kube.patch_ray_job(ns, name, patch))
        out.written.append(("RayJob", (ns, name), live))
        if "suspend" in patch["spec"]:
            _event(body, "Suspended" if job.spec.suspend else "Resumed", f"RayJob {name}")
        rest = sorted(set(patch["spec"]) - {"suspend"})
        if rest:
            _event(body, "Updated", f"RayJob {name}: {', '.join(rest)} from the spec")
    return live


def _missing(job: render.Job, snap: cache.Snapshot, data_missing: bool = False) -> bool:
    """Does the cache say a child of the job is missing (so that a create, preceded by fresh reads, follows)?"""
    names = naming.child_names(job.name)
    return (any((k, names.runtime_identity) not in snap.rbac for k in ("ServiceAccount", "Role", "RoleBinding"))
            or snap.config_map is None or (snap.ray_job is None and not data_missing))


def _fresh_reads(job: render.Job) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
    """The job and its RayJob read from the apiserver, side by side (before a create: see ``_ensure_children``)."""
    got = _together(lambda: kube.get_rlhfjob(job.namespace, job.name),
                    lambda: kube.get_ray_job(job.namespace, naming.child_names(job.name).ray_job))
    return got[0], got[1]


def _ensure_rbac(obj: dict[str, Any], snap: cache.Snapshot, body: Any, out: Outcome) -> None:
    have = snap.rbac.get((obj["kind"], obj["metadata"]["name"]))
    done, written = kube.ensure_object(obj, have)
    if written is not None:
        out.written.append((obj["kind"], (obj["metadata"]["namespace"], obj["metadata"]["name"]),
                            cache.rbac_object({**written, "kind": obj["kind"]})))
    if done == "updated":
        _event(body, "Updated", f"{obj['kind']} {obj['metadata']['name']} restored to the rendered one")


def _ensure_config_map(cm: dict[str, Any], snap: cache.Snapshot, body: Any, out: Outcome) -> None:
    ns, cm_name = cm["metadata"]["namespace"], cm["metadata"]["name"]
    if snap.config_map is None:
        made = kube.create_config_map(cm)
        if made is not None:
            out.written.append(("ConfigMap", (ns, cm_name), cache.config_map(made)))
            _event(body, "Created", f"ConfigMap {cm_name}")
    elif snap.config_map.get("data") != cm["data"]:
        patched = kube.replace_config_map_data(ns, cm_name, cm["data"])
        out.written.append(("ConfigMap", (ns, cm_name), cache.config_map(patched)))


def _kueue_workload(job: render.Job, live: dict[str, Any] | None, body: Any, snap: cache.Snapshot,
                    out: Outcome) -> dict[str, Any] | None:
    """With spec.scheduling.queueName: the RayJob's Kueue Workload, whose ``spec.active`` follows spec.suspend
    (Kueue owns the RayJob's suspend; deactivating the Workload is how a queued job is suspended)."""
    if not job.spec.scheduling.queue_name or not live:
        return None
    uid = live["metadata"].get("uid")
    mine = [w for w in snap.workloads if (w["metadata"].get("labels") or {}).get(kube.KUEUE_JOB_UID_LABEL) == uid]
    workload = max(mine, key=lambda w: w["metadata"].get("creationTimestamp") or "") if mine else None
    if workload is not None and (workload.get("spec") or {}).get("active", True) == job.spec.suspend:
        patched = cache.workload(kube.set_workload_active(workload, not job.spec.suspend))
        out.written.append(("Workload", (job.namespace, workload["metadata"]["name"]), patched))
        _event(body, "Suspended" if job.spec.suspend else "Resumed",
               f"Kueue Workload {workload['metadata']['name']} active={not job.spec.suspend}")
        workload = patched
    return workload


def _layout(spec: m.RLHFJobSpec) -> str:
    return (
        f"{spec.placement.mode}, trainer {spec.trainer.replicas}x{spec.trainer.gpus_per_replica} GPU, "
        f"{spec.rollout.engines} engine(s) x TP{spec.rollout.tensor_parallel_size}"
        f"{' (one expert-parallel DP group)' if spec.rollout.expert_parallel else ''}, sync {spec.weight_sync.backend}"
    )


def reconcile(snap: cache.Snapshot, now: dt.datetime | None = None) -> Outcome:
    """One job, from its snapshot; runs in a worker thread. Returns what it wrote and when to look again."""
    out = Outcome()
    body = snap.job
    assert body is not None
    meta, name, ns = body["metadata"], body["metadata"]["name"], body["metadata"]["namespace"]
    old_status = dict(body.get("status") or {})
    obs = status.Observed(generation=meta.get("generation", 1), old_status=old_status)
    if meta.get("deletionTimestamp"):
        return out
    spec, obs.invalid = _parsed(body)
    children: dict[str, str] = {}
    if spec is not None:
        obs.total_steps = spec.algorithm.steps
        obs.suspend = spec.suspend
        children = naming.child_names(name).as_status()
        job = render.Job(name, ns, meta["uid"], spec)
        creating = old_status.get("phase") not in status.TERMINAL or _invalid_before(old_status)
        # a child is missing: the fresh reads that precede a create go out beside the data check
        fresh = _IO.submit(_fresh_reads, job) if creating and _missing(job, snap) else None
        obs.data_missing, data_again = _data_missing(ns, name, meta.get("generation", 1), spec)
        out.again = data_again
        obs.kuberay_missing = kube.kuberay_missing()
        obs.queue_name = spec.scheduling.queue_name
        obs.progress_deadline = spec.progress_deadline_seconds
        if obs.kuberay_missing:
            out.again = _sooner(out.again, KUBERAY_RECHECK_SECONDS)
        else:
            if creating:
                try:
                    obs.ray_job = _ensure_children(job, body, snap, out, bool(obs.data_missing), fresh)
                except ApiException as e:
                    if e.status not in (400, 422):
                        raise
                    # refused for good (e.g. a value the RayJob's schema does not take): say so, do not retry-loop
                    obs.child_rejected = _api_message(e)
                obs.workload = _kueue_workload(job, obs.ray_job, body, snap, out)
            else:
                obs.ray_job = snap.ray_job
            _delete_duplicates(obs.ray_job, snap, body, out)
            cluster = ((obs.ray_job or {}).get("status") or {}).get("rayClusterName")
            if cluster:
                obs.ray_cluster = next((c for c in snap.clusters if c["metadata"]["name"] == cluster), None)
                obs.pods = snap.pods(cluster)
                if status.capacity_message({}, obs.pods, None) is not None:  # a pod waits for GPUs
                    nodes = kube.gpu_nodes()
                    if nodes is not None:
                        obs.capacity = status.capacity_message(nodes, obs.pods, spec.scheduling.node_selector)
                        # the free GPUs change with other jobs' pods (no event of ours): look again when the
                        # shared capacity snapshot (one list of nodes and pods for all jobs) is renewed
                        out.again = _sooner(out.again, kube.CAPACITY_CACHE_SECONDS)
    obs.now = now or dt.datetime.now(dt.UTC)
    if spec is not None and obs.ray_cluster and old_status.get("phase") not in status.TERMINAL:
        _end_stuck_run(obs, body, out)
    new = status.compute(obs, obs.now)
    if children:
        new["children"] = {**(old_status.get("children") or {}), **children, **(new.get("children") or {})}
    out.again = _sooner(out.again, status.next_check(obs))
    metrics.observe(ns, name, {**old_status, **new})
    patch = status.changed(old_status, new)
    if not patch:
        return out
    written = kube.patch_status(ns, name, patch)
    out.written.append(("job", (ns, name), cache.job(written)))
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
    dropped = (old_status.get("data") or {}).get("message")  # what turned SamplesValid False
    if dropped and _condition_flipped(old_status, new, "SamplesValid"):
        _event(body, "SamplesDropped", dropped, warning=True)
    mismatch = (old_status.get("runtime") or {}).get("warning")  # what turned EnginesInSync False
    if mismatch and _condition_flipped(old_status, new, "EnginesInSync"):
        _event(body, "MismatchSpike", mismatch, warning=True)
    return out


#: While KubeRay's CRDs are missing, look for them again this often (no event says they appeared).
KUBERAY_RECHECK_SECONDS = 30.0


def _sooner(a: float | None, b: float | None) -> float | None:
    return b if a is None else a if b is None else min(a, b)


def _delete_duplicates(ray_job: dict[str, Any] | None, snap: cache.Snapshot, body: Any, out: Outcome) -> None:
    """Whatever KubeRay does, a RayJob holds one Ray cluster: older clusters of the same RayJob that its status no
    longer names are deleted (``status.duplicate_clusters``), with a Warning Event and a metric."""
    for c in status.duplicate_clusters(ray_job, snap.clusters):
        meta = c["metadata"]
        kube.delete_ray_cluster(meta["namespace"], meta["name"], meta["uid"])
        out.written.append(("RayCluster", (meta["namespace"], meta["name"]), None))  # not deleted twice
        metrics.DUPLICATE_CLUSTERS.inc()
        current = (ray_job or {}).get("status", {}).get("rayClusterName")
        _event(body, "DuplicateRayClusterDeleted", f"RayCluster {meta['name']} (created "
               f"{meta.get('creationTimestamp')}) belonged to RayJob {ray_job['metadata']['name']} beside its "
               f"current cluster {current}: deleted, so that it holds no GPUs", warning=True)


#: Per job, the parsed spec and the rendered children of its current generation: most reconciles are of an
#: unchanged spec (events of pods and clusters), and parsing and rendering are most of a reconcile's CPU.
_PARSED: dict[tuple[str, str], tuple[tuple[str, int], m.RLHFJobSpec | None, str | None]] = {}
_RENDERED: dict[tuple[str, str], tuple[tuple[str, int], Any]] = {}


def _parsed(body: dict[str, Any]) -> tuple[m.RLHFJobSpec | None, str | None]:
    """The job's spec, or None and why it is invalid (a defence behind admission)."""
    meta = body["metadata"]
    key, version = (meta["namespace"], meta["name"]), (meta.get("uid", ""), meta.get("generation", 1))
    held = _PARSED.get(key)
    if held is None or held[0] != version:
        try:
            held = (version, m.RLHFJobSpec.model_validate(dict(body.get("spec") or {})), None)
        except ValidationError as e:
            held = (version, None, _spec_error(e))
        _PARSED[key] = held
    return held[1], held[2]


def _rendered(job: render.Job, body: dict[str, Any]) -> tuple[list[dict[str, Any]], dict[str, Any], dict[str, Any]]:
    """The runtime RBAC, ConfigMap and RayJob of the job's generation, owned by the job (read-only: shared by
    the reconciles of that generation)."""
    key, version = (job.namespace, job.name), (job.uid, body["metadata"].get("generation", 1))
    held = _RENDERED.get(key)
    if held is None or held[0] != version:
        rbac, cm, rj = render.render_runtime_rbac(job), render.render_config_map(job), render.render_ray_job(job)
        for obj in (*rbac, cm, rj):
            kopf.adopt(obj, owner=body)
        held = (version, (rbac, cm, rj))
        _RENDERED[key] = held
    return held[1]


def forget(ns: str, name: str) -> None:
    for memo in (_PARSED, _RENDERED, _DATA_CHECKS):
        memo.pop((ns, name), None)


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


def _end_stuck_run(obs: status.Observed, body: Any, out: Outcome) -> None:
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
    out.written.append(("Pod", (head["metadata"]["namespace"], head["metadata"]["name"]), None))  # once
    _event(body, "EndingStuckRun", f"{why}: deleted the Ray head pod {head['metadata']['name']} so that the run "
           "fails and is retried or failed per spec.backoffLimit", warning=True)


#: (namespace, job) -> (generation, ConfigMap name, key, message or None, seconds to the next check)
_DATA_CHECKS: dict[tuple[str, str], tuple[int, str, str, str | None, float]] = {}


def _data_missing(ns: str, job: str, generation: int, spec: m.RLHFJobSpec) -> tuple[str | None, float | None]:
    """The prompts ConfigMap must exist and hold its key, or the pods cannot mount it. It is the user's (not
    labelled, not cached): read once per spec generation while present, and while missing again after 2, 4 ...
    60 s (the only repeated read, and only for a job that waits for its data). Returns (why missing or None,
    seconds until it must be read again or None)."""
    ref = spec.data.config_map
    if ref is None:
        _DATA_CHECKS.pop((ns, job), None)
        return None, None
    seen = _DATA_CHECKS.get((ns, job))
    if seen and seen[:3] == (generation, ref.name, ref.key) and seen[3] is None:
        return None, None
    cm = kube.get_config_map(ns, ref.name)
    if cm is None:
        why = f"ConfigMap {ref.name} (spec.data.configMap) not found in namespace {ns}"
    elif ref.key not in (cm.get("data") or {}) and ref.key not in (cm.get("binaryData") or {}):
        why = f"ConfigMap {ref.name} has no key {ref.key} (spec.data.configMap.key)"
    else:
        why = None
    again = None
    if why is not None:
        again = min(DATA_RECHECK_MAX, 2 * seen[4]) if seen and seen[3] is not None else DATA_RECHECK_MIN
    _DATA_CHECKS[(ns, job)] = (generation, ref.name, ref.key, why, again or 0.0)
    return why, again


@kopf.on.probe(id="kuberay")
def kuberay_probe(**_: Any) -> str:
    return kube.kuberay_missing() or "ok"
