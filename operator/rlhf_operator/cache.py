"""Watch caches of what the operator reconciles from: Kopf indexes of compact projections, plus our own writes.

Each watched kind is indexed by the job it belongs to (the ``rlhf.dev/job`` label, filtered server-side): a
reconcile reads the cache, never the apiserver. Only the fields that ``render``/``status`` use are kept (a pod
is a few hundred bytes here, not the apiserver's ~8 KB), so memory grows with jobs, not with object sizes.

Our own writes are remembered (``remember``) until the watch delivers them: a reconcile that follows a write
(the next event of the job can arrive before the watch event of our write) then sees what it wrote, and never
writes the same status twice, posts the same Event twice, or creates a child it just created. Between the
index and a remembered write, the newer ``resourceVersion`` wins (etcd's revisions: integers that only grow;
an unparsable one is taken as current); a remembered write the watch has caught up with, or whose object was
deleted, or older than ``OVERLAY_SECONDS``, is dropped.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Hashable, Mapping
from dataclasses import dataclass, field
from typing import Any

from rlhf_api.environment import sandbox_name
from rlhf_operator import naming, render

GPU = "nvidia.com/gpu"
NODE_TYPE = "ray.io/node-type"
CLUSTER_LABEL = "ray.io/cluster"
#: A remembered write older than this is dropped even if the watch never showed it (the object was deleted and
#: re-created in between, say): the index is the truth then.
OVERLAY_SECONDS = 60.0
RBAC_INDEXES = {"ServiceAccount": "rlhf_rbac_sa", "Role": "rlhf_rbac_role", "RoleBinding": "rlhf_rbac_binding"}


def _meta(body: Mapping[str, Any], *keys: str) -> dict[str, Any]:
    meta = body.get("metadata") or {}
    return {k: copy.deepcopy(meta[k]) for k in ("name", "namespace", "uid", "resourceVersion", *keys) if k in meta}


# ------------------------------------------------------------------------------------------- projections
def job(body: Mapping[str, Any]) -> dict[str, Any]:
    """An RLHFJob: all of spec and status (the reconcile needs both), the metadata it reads."""
    return {"apiVersion": body.get("apiVersion"), "kind": body.get("kind"),
            "metadata": _meta(body, "generation", "deletionTimestamp", "creationTimestamp"),
            "spec": copy.deepcopy(dict(body.get("spec") or {})), "status": copy.deepcopy(dict(body.get("status") or {}))}


def ray_job(body: Mapping[str, Any]) -> dict[str, Any]:
    """A RayJob: its mutable spec and its status without ``rayClusterStatus`` (the cluster's own status, copied by
    KubeRay and updated with it; the operator reads the RayCluster for that)."""
    spec = body.get("spec") or {}
    st = body.get("status") or {}
    return {"metadata": _meta(body, "deletionTimestamp", "creationTimestamp", "labels"),
            "spec": {k: copy.deepcopy(spec[k]) for k in render.RAY_JOB_MUTABLE if k in spec},
            "status": {k: copy.deepcopy(v) for k, v in st.items() if k != "rayClusterStatus"}}


def ray_cluster(body: Mapping[str, Any]) -> dict[str, Any]:
    st = body.get("status") or {}
    return {"metadata": _meta(body, "deletionTimestamp", "creationTimestamp", "ownerReferences"),
            "status": {k: copy.deepcopy(st[k]) for k in ("state", "conditions") if k in st}}


def pod(body: Mapping[str, Any]) -> dict[str, Any]:
    meta = _meta(body, "deletionTimestamp", "creationTimestamp")
    labels = (body.get("metadata") or {}).get("labels") or {}
    meta["labels"] = {k: labels[k] for k in (NODE_TYPE, CLUSTER_LABEL, naming.LABEL_JOB) if k in labels}
    containers = [{"resources": {"requests": {GPU: c["resources"]["requests"][GPU]}}}
                  for c in (body.get("spec") or {}).get("containers") or []
                  if GPU in (((c.get("resources") or {}).get("requests")) or {})]
    st = body.get("status") or {}
    conditions = [dict(c) for c in st.get("conditions") or [] if c.get("type") == "PodScheduled"]
    return {"metadata": meta, "spec": {"containers": containers}, "status": {"phase": st.get("phase"), "conditions": conditions}}


def config_map(body: Mapping[str, Any]) -> dict[str, Any]:
    return {"metadata": _meta(body), "data": copy.deepcopy(dict(body.get("data") or {}))}


def rbac_object(body: Mapping[str, Any]) -> dict[str, Any]:
    out = {"kind": body.get("kind"), "metadata": _meta(body)}
    for f in ("rules", "subjects", "roleRef"):
        if f in body:
            out[f] = copy.deepcopy(body[f])
    return out


def workload(body: Mapping[str, Any]) -> dict[str, Any]:
    return {"apiVersion": body.get("apiVersion"), "metadata": _meta(body, "creationTimestamp", "labels"),
            "spec": {"active": (body.get("spec") or {}).get("active", True)},
            "status": {"conditions": copy.deepcopy(((body.get("status") or {}).get("conditions")) or [])}}


def owner_name(body: Mapping[str, Any], kind: str) -> str | None:
    return next((r.get("name") for r in (body.get("metadata") or {}).get("ownerReferences") or []
                 if r.get("kind") == kind), None)


def resource_version(obj: Mapping[str, Any] | None) -> int | None:
    try:
        return int(((obj or {}).get("metadata") or {}).get("resourceVersion"))
    except (TypeError, ValueError):
        return None


# ------------------------------------------------------------------------------------------- the caches
@dataclass
class Snapshot:
    """What one reconcile of one job sees (read in the event loop; read-only afterwards)."""
    job: dict[str, Any] | None
    ray_job: dict[str, Any] | None
    clusters: list[dict[str, Any]] = field(default_factory=list)
    pods_by_cluster: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    config_map: dict[str, Any] | None = None
    rbac: dict[tuple[str, str], dict[str, Any]] = field(default_factory=dict)  # (kind, name) -> object
    workloads: list[dict[str, Any]] = field(default_factory=list)
    sandbox_pool: dict[str, Any] | None = None  # the job's SandboxWarmPool (spec.environment.sandbox)

    def pods(self, cluster: str | None) -> list[dict[str, Any]]:
        return list(self.pods_by_cluster.get(cluster or "", []))


#: Kinds of optional CRDs (Kueue's, agent-sandbox's), cached from their watch events by ``Caches.put`` instead
#: of a Kopf index: Kopf holds every handler until each index's watch has listed, and the watches of a CRD
#: installed while the operator runs start in every watched namespace at once; one in a namespace being deleted
#: can end before its listing, and the hold is never released. Kind -> the index name the snapshot reads.
EVENT_INDEXES: dict[str, str] = {"Workload": "rlhf_workloads", "SandboxWarmPool": "rlhf_sandbox_pools"}


class Caches:
    """The Kopf indexes (bound at startup), the event-fed indexes of ``EVENT_INDEXES`` and the writes remembered on
    top of them. Event-loop thread only."""

    def __init__(self) -> None:
        self.indexes: Mapping[str, Any] = {}
        self._fed: dict[str, dict[Hashable, dict[str, dict[str, Any]]]] = {i: {} for i in EVENT_INDEXES.values()}
        self._overlay: dict[tuple[str, Hashable], tuple[float, dict[str, Any]]] = {}
        self._last: dict[tuple[str, Hashable], int] = {}  # a digest of each watched object's last projection

    def bind(self, indexes: Mapping[str, Any]) -> None:
        self.indexes = indexes

    def put(self, kind: str, key: Hashable, name: str, projection: dict[str, Any] | None) -> None:
        """A watch event of an ``EVENT_INDEXES`` kind: its projection under index key ``key`` (None: deleted)."""
        store = self._fed[EVENT_INDEXES[kind]]
        if projection is not None:
            store.setdefault(key, {})[name] = projection
        elif name in store.get(key, {}):
            del store[key][name]
            if not store[key]:
                del store[key]

    def _values(self, index: str, key: Hashable) -> list[dict[str, Any]]:
        fed = self._fed.get(index)
        store = fed.get(key, {}).values() if fed is not None else (self.indexes.get(index) or {}).get(key)
        return list(store) if store is not None else []

    # ---- writes we made, until the watch shows them
    def remember(self, kind: str, key: Hashable, obj: dict[str, Any] | None) -> None:
        """A write of ours: the object as written, or None for one we deleted (absent until the watch says so)."""
        self._overlay[(kind, key)] = (time.monotonic(), obj)

    def seen(self, kind: str, key: Hashable, obj: Mapping[str, Any] | None, deleted: bool = False) -> bool:
        """A watch event of ``kind``/``key``: drop our remembered write once the watch caught up (or it is gone;
        for a deletion of ours: once the watch shows it deleted or being deleted). True when the event is the echo
        of our own write (the very resourceVersion we wrote: nothing changed since the reconcile that wrote it)."""
        held = self._overlay.get((kind, key))
        if held is None:
            return False
        if held[1] is None:
            if deleted or ((obj or {}).get("metadata") or {}).get("deletionTimestamp"):
                self._overlay.pop((kind, key), None)
            return False
        mine, theirs = resource_version(held[1]), resource_version(obj)
        if deleted or mine is None or theirs is None or theirs >= mine:
            self._overlay.pop((kind, key), None)
        return not deleted and mine is not None and theirs == mine

    def changed(self, kind: str, key: Hashable, projection: Mapping[str, Any] | None) -> bool:
        """Whether a watch event changed the object as the reconcile sees it (its projection, resourceVersion
        aside); None for a deleted object. The first sight of an object is a change."""
        if projection is None:
            self._last.pop((kind, key), None)
            return True
        meta = {k: v for k, v in (projection.get("metadata") or {}).items() if k != "resourceVersion"}
        # a digest, not a copy (the indexes hold the projections already): the apiserver serialises fields in a
        # fixed order, so an unchanged object gives the same repr; a differing repr at worst costs one reconcile
        digest = hash(repr({**projection, "metadata": meta}))
        if self._last.get((kind, key)) == digest:
            return False
        self._last[(kind, key)] = digest
        return True

    def _newest(self, kind: str, key: Hashable, indexed: dict[str, Any] | None) -> dict[str, Any] | None:
        held = self._overlay.get((kind, key))
        if held is None:
            return indexed
        at, mine = held
        if time.monotonic() - at > OVERLAY_SECONDS:
            self._overlay.pop((kind, key), None)
            return indexed
        if mine is None:  # deleted by us; the watch has not shown it yet
            return None
        if indexed is not None:
            a, b = resource_version(mine), resource_version(indexed)
            if a is None or b is None or b >= a:
                self._overlay.pop((kind, key), None)
                return indexed
        return mine

    def overlays(self) -> int:
        return len(self._overlay)

    # ---- reads
    def job(self, ns: str, name: str) -> dict[str, Any] | None:
        found = self._values("rlhf_jobs", (ns, name))
        return self._newest("job", (ns, name), found[0] if found else None)

    def snapshot(self, ns: str, name: str) -> Snapshot:
        names = naming.child_names(name)
        rj = next((r for r in self._values("rlhf_ray_jobs", (ns, name)) if r["metadata"]["name"] == names.ray_job), None)
        cm = next(iter(self._values("rlhf_config_maps", (ns, names.config_map))), None)
        rbac = {}
        for kind in ("ServiceAccount", "Role", "RoleBinding"):
            found = next(iter(self._values(RBAC_INDEXES[kind], (ns, kind, names.runtime_identity))), None)
            found = self._newest(kind, (ns, names.runtime_identity), found)
            if found is not None:
                rbac[(kind, names.runtime_identity)] = found
        rj = self._newest("RayJob", (ns, names.ray_job), rj)
        clusters = self._each("RayCluster", ns, self._values("rlhf_ray_clusters", (ns, name)))
        cluster_names = {c["metadata"]["name"] for c in clusters} | {((rj or {}).get("status") or {}).get("rayClusterName")}
        return Snapshot(
            job=self.job(ns, name),
            ray_job=rj,
            clusters=clusters,
            pods_by_cluster={c: self._each("Pod", ns, self._values("rlhf_pods", (ns, c))) for c in cluster_names if c},
            config_map=self._newest("ConfigMap", (ns, names.config_map), cm),
            rbac=rbac,
            workloads=self._each("Workload", ns, self._values("rlhf_workloads", (ns, names.ray_job))),
            sandbox_pool=self._newest("SandboxWarmPool", (ns, sandbox_name(name)),
                                      next(iter(self._values("rlhf_sandbox_pools", (ns, name))), None)),
        )

    def _each(self, kind: str, ns: str, indexed: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Objects of a many-per-job index, each with our remembered write over it (a deleted one left out)."""
        newest = (self._newest(kind, (ns, o["metadata"]["name"]), o) for o in indexed)
        return [o for o in newest if o is not None]
