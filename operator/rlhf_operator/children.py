"""The job's children: its runtime RBAC, its ConfigMap and its RayJob, created when missing and patched where they
may change; its environment server (``spec.environment.http.server``: a Deployment and a Service), created with
the RayJob; and the RayClusters of its RayJob that KubeRay no longer uses, deleted.

Creating a missing child is the one risky step (a job deleted meanwhile would get it again): it is preceded by a
fresh read of the job, the only read outside the caches. Requests that do not depend on each other run side by
side (``together``)."""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any

import kopf

from rlhf_api import models as m
from rlhf_operator import cache, kube, metrics, naming, render, status
from rlhf_operator.effects import Outcome, post_event
from rlhf_operator.environment_server import render_environment_server

#: Requests of one reconcile that do not depend on each other run side by side here (the reconcile's own thread
#: waits for them): a new job's reads, then its runtime RBAC and ConfigMap, cost one round trip each, not four.
IO = ThreadPoolExecutor(max_workers=32, thread_name_prefix="rlhf-req")
#: Per job, the rendered children of its current generation: most reconciles are of an unchanged spec (events of
#: pods and clusters), and rendering is much of a reconcile's CPU.
_RENDERED: dict[tuple[str, str], tuple[tuple[str, int], Any]] = {}


def together(*calls: Any) -> list[Any]:
    """Run the zero-argument ``calls`` side by side; their results in order (the first error raised, after every
    call has ended, so no request of this reconcile outlives it)."""
    if len(calls) == 1:
        return [calls[0]()]
    futures = [IO.submit(c) for c in calls]
    wait(futures)
    return [f.result() for f in futures]


def forget(ns: str, name: str) -> None:
    """Drop what is kept of a deleted job."""
    _RENDERED.pop((ns, name), None)


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


def missing(job: render.Job, snap: cache.Snapshot, data_missing: bool = False) -> bool:
    """Does the cache say a child of the job is missing (so that a create, preceded by fresh reads, follows)?"""
    names = naming.child_names(job.name)
    return (any((k, names.runtime_identity) not in snap.rbac for k in ("ServiceAccount", "Role", "RoleBinding"))
            or snap.config_map is None or (snap.ray_job is None and not data_missing))


def fresh_reads(job: render.Job) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
    """The job and its RayJob read from the apiserver, side by side (before a create: see ``ensure``)."""
    got = together(lambda: kube.get_rlhfjob(job.namespace, job.name),
                   lambda: kube.get_ray_job(job.namespace, naming.child_names(job.name).ray_job))
    return got[0], got[1]


def _still_wanted(live: dict[str, Any] | None, job: render.Job) -> bool:
    """From a fresh read before creating a child: the job still exists, is the same object and is not being deleted
    (the cache may not have seen a deletion yet; the child of a deleted job would be created again)."""
    return bool(live) and live["metadata"].get("uid") == job.uid and not live["metadata"].get("deletionTimestamp")


def ensure(job: render.Job, body: Any, snap: cache.Snapshot, out: Outcome,
           data_missing: bool = False, fresh: Future[Any] | None = None) -> dict[str, Any] | None:
    """Create what the cache says is missing, patch what may change; returns the RayJob (the one created, if so),
    or None when the job turned out to be gone or its data ConfigMap is missing (no RayJob is made then).

    Creating is done in three round trips: the fresh reads (``fresh``: the job and the RayJob, started by the
    reconcile beside its data check), the runtime RBAC and ConfigMap side by side, then the RayJob (its pods
    need the ServiceAccount and the ConfigMap, so those exist first)."""
    rbac, cm, rj = _rendered(job, body)
    live = snap.ray_job
    if missing(job, snap, data_missing):
        live_job, fetched = fresh.result() if fresh is not None else fresh_reads(job)
        if not _still_wanted(live_job, job):
            return None
        if live is None and fetched is not None:
            # The cache lagged (a peer made it while this replica was paused, and the RayJob watch is re-listed
            # after the RLHFJob one): a create would only be answered 409.
            live = cache.ray_job(fetched)
            out.wrote("RayJob", (job.namespace, rj["metadata"]["name"]), live)
    together(*[lambda obj=obj: _ensure_rbac(obj, snap, body, out) for obj in rbac],
             lambda: _ensure_config_map(cm, snap, body, out))
    if live is None and data_missing:
        return None  # its pods could not mount the data: they would hold GPUs and never start
    if live is None:  # the environment server with the RayJob: the runtime waits for it before its first rollout
        _create_environment_server(job, body)
        return _create_ray_job(job, rj, body, out)
    return _patch_ray_job(job, rj, live, body, out)


def _create_environment_server(job: render.Job, body: Any) -> None:
    """The job's environment server (``spec.environment.http.server``), owned by the job; none is made twice."""
    for obj in render_environment_server(job):
        kopf.adopt(obj, owner=body)
        if kube.create_server_object(obj) is not None:
            post_event(body, "Created", f"{obj['kind']} {obj['metadata']['name']} (the environment server)")


def _ensure_rbac(obj: dict[str, Any], snap: cache.Snapshot, body: Any, out: Outcome) -> None:
    have = snap.rbac.get((obj["kind"], obj["metadata"]["name"]))
    done, written = kube.ensure_object(obj, have)
    if written is not None:
        out.wrote(obj["kind"], (obj["metadata"]["namespace"], obj["metadata"]["name"]),
                  cache.rbac_object({**written, "kind": obj["kind"]}))
    if done == "updated":
        post_event(body, "Updated", f"{obj['kind']} {obj['metadata']['name']} restored to the rendered one")


def _ensure_config_map(cm: dict[str, Any], snap: cache.Snapshot, body: Any, out: Outcome) -> None:
    ns, cm_name = cm["metadata"]["namespace"], cm["metadata"]["name"]
    if snap.config_map is None:
        made = kube.create_config_map(cm)
        if made is not None:
            out.wrote("ConfigMap", (ns, cm_name), cache.config_map(made))
            post_event(body, "Created", f"ConfigMap {cm_name}")
    elif snap.config_map.get("data") != cm["data"]:
        patched = kube.replace_config_map_data(ns, cm_name, cm["data"])
        out.wrote("ConfigMap", (ns, cm_name), cache.config_map(patched))


def _create_ray_job(job: render.Job, rj: dict[str, Any], body: Any, out: Outcome) -> dict[str, Any] | None:
    ns, name = job.namespace, rj["metadata"]["name"]
    made = kube.create_ray_job(rj)
    if made is None:  # made in between by someone else
        fetched = kube.get_ray_job(ns, name)
        return cache.ray_job(fetched) if fetched else None
    live = cache.ray_job(made)
    out.wrote("RayJob", (ns, name), live)
    post_event(body, "Created", f"RayJob {name} ({_layout(job.spec)})")
    return live


def _patch_ray_job(job: render.Job, rj: dict[str, Any], live: dict[str, Any], body: Any,
                   out: Outcome) -> dict[str, Any]:
    """Bring the RayJob's mutable fields to the rendered ones (with Kueue, its ``suspend`` is Kueue's)."""
    ns, name = job.namespace, rj["metadata"]["name"]
    patch = render.ray_job_mutable_patch(rj, live, kueue=bool(job.spec.scheduling.queue_name))
    if not patch:
        return live
    live = cache.ray_job(kube.patch_ray_job(ns, name, patch))
    out.wrote("RayJob", (ns, name), live)
    if "suspend" in patch["spec"]:
        post_event(body, "Suspended" if job.spec.suspend else "Resumed", f"RayJob {name}")
    rest = sorted(set(patch["spec"]) - {"suspend"})
    if rest:
        post_event(body, "Updated", f"RayJob {name}: {', '.join(rest)} from the spec")
    return live


def _layout(spec: m.RLHFJobSpec) -> str:
    return (
        f"{spec.placement.mode}, trainer {spec.trainer.replicas}x{spec.trainer.gpus_per_replica} GPU, "
        f"{spec.rollout.engines} engine(s) x TP{spec.rollout.tensor_parallel_size}"
        f"{' (one expert-parallel DP group)' if spec.rollout.expert_parallel else ''}, sync {spec.weight_sync.backend}"
    )


def delete_duplicates(ray_job: dict[str, Any] | None, snap: cache.Snapshot, body: Any, out: Outcome) -> None:
    """Whatever KubeRay does, a RayJob holds one Ray cluster: older clusters of the same RayJob that its status no
    longer names are deleted (``status.duplicate_clusters``), with a Warning Event and a metric."""
    for c in status.duplicate_clusters(ray_job, snap.clusters):
        meta = c["metadata"]
        kube.delete_ray_cluster(meta["namespace"], meta["name"], meta["uid"])
        out.wrote("RayCluster", (meta["namespace"], meta["name"]), None)  # not deleted twice
        metrics.DUPLICATE_CLUSTERS.inc()
        current = (ray_job or {}).get("status", {}).get("rayClusterName")
        post_event(body, "DuplicateRayClusterDeleted", f"RayCluster {meta['name']} (created "
                   f"{meta.get('creationTimestamp')}) belonged to RayJob {ray_job['metadata']['name']} beside its "
                   f"current cluster {current}: deleted, so that it holds no GPUs", warning=True)
