"""Kopf wiring: the watch caches, the triggers and the work queue that runs one job's reconcile at a time.

- **Caches**: Kopf indexes (``cache``) of RLHFJobs and of the RayJobs, RayClusters, pods, ConfigMaps, runtime
  ServiceAccounts/Roles/RoleBindings and Kueue Workloads labelled for our jobs (label selectors applied
  server-side: the operator never receives other pods). Kopf runs no handler before every index is filled, so a
  restarted operator sees everything it made before it decides anything.
- **Triggers**: every watch event of those kinds adds its job's key to a coalescing ``WorkQueue``; a job's
  reconciles never overlap, and the last event is always seen. There is no periodic resync: the only timers are
  the moments a live run's report or progress deadline runs out (``status.next_check``) and, while a pod waits
  for GPUs, the renewal of the shared capacity snapshot.
- **Reconcile** (``reconcile``, in a worker thread): read the job's snapshot from the caches, create what is
  missing (owned by the job), patch what may change, compute status with the pure ``status.compute`` and write it
  only when it changed; one Event per transition. Its writes are remembered in the cache until the watch shows
  them (``Caches.remember``); an API error retries the job after ``API_RETRY_SECONDS``.
- **No finalizer**: the children are owned objects (the garbage collector deletes them), so a job deletes
  without an operator running. Creating a missing child is the one risky step (a job deleted meanwhile would
  get it again): it is preceded by a fresh read of the job, the only read outside the caches. Kopf removes the
  finalizer (``rlhf.dev/finalizer``) older operators put on jobs.
"""

from __future__ import annotations

import asyncio
import logging
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import kopf
from kubernetes.client.rest import ApiException

from rlhf_api import models as m
from rlhf_operator import cache, kube, metrics, naming, reconcile, sandboxes
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
                ("rbac.authorization.k8s.io", "rolebindings"), (sandboxes.GROUP, sandboxes.POOLS)):
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


# ------------------------------------------------------------------------------------- triggers (events)
@kopf.on.event(m.GROUP, m.VERSION, m.PLURAL)
async def rlhfjob_event(type: str | None, body: kopf.Body, namespace: str, name: str, **_: Any) -> None:
    deleted = type == "DELETED"
    echo = CACHE.seen("job", (namespace, name), body, deleted=deleted)
    changed = CACHE.changed("job", (namespace, name), None if deleted else cache.job(body))
    if deleted:
        metrics.forget(namespace, name)
        reconcile.forget(namespace, name)
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
               "RoleBinding": cache.rbac_object, "Workload": cache.workload, "SandboxWarmPool": sandboxes.pool}


def _child_event(kind: str) -> Any:
    project = PROJECTIONS[kind]

    async def on_event(type: str | None, body: kopf.Body, namespace: str, name: str, labels: dict[str, str],
                       **_: Any) -> None:
        deleted = type == "DELETED"
        echo = CACHE.seen(kind, (namespace, name), body, deleted=deleted)
        projection = None if deleted else project(body)
        changed = CACHE.changed(kind, (namespace, name), projection)
        job = labels.get(naming.LABEL_JOB) or cache.owner_name(body, "RayJob")
        if kind in cache.EVENT_INDEXES:  # a Workload under its RayJob's name, a pool under its job's
            owner = cache.owner_name(body, "RayJob") if kind == "Workload" else labels.get(naming.LABEL_JOB)
            if owner:
                CACHE.put(kind, (namespace, owner), name, projection)
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
kopf.on.event(sandboxes.GROUP, sandboxes.VERSION, sandboxes.POOLS, id="sandboxpool_event", labels=_PRESENT)(
    _child_event("SandboxWarmPool"))


# ------------------------------------------------------------------------------------------- reconcile
async def _reconcile_key(key: tuple[str, str]) -> float | None:
    ns, name = key
    snap = CACHE.snapshot(ns, name)
    if snap.job is None:
        return None
    loop = asyncio.get_running_loop()
    started = loop.time()
    try:
        out = await loop.run_in_executor(_EXECUTOR, reconcile.reconcile, snap)
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


@kopf.on.probe(id="kuberay")
def kuberay_probe(**_: Any) -> str:
    return kube.kuberay_missing() or "ok"
