"""The operator's Kubernetes I/O: small, idempotent calls over the official client.

Create calls tolerate ``409 AlreadyExists`` (another replica or a previous life of this process got there
first); reads tolerate ``404``. Nothing here decides anything: that is ``render`` and ``status``.

Every answer is the apiserver's JSON as plain dicts (``_preload_content=False``): the operator works on dicts,
and the client's typed models (pydantic-validated since kubernetes 34) cost a deserialisation into objects and a
serialisation back per call. The client also imports each API and model module on first use, under Python's
import lock (``CoreV1Api`` alone is a large module): ``warm_up`` does that at startup, not on
the first job's create path.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import functools
import json
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from kubernetes import client, config
from kubernetes.client.rest import ApiException

from rlhf_api import models as m

RAY_GROUP, RAY_VERSION = "ray.io", "v1"


#: Keep-alive connections to the apiserver: at least as many as requests in flight (the reconcile workers, the
#: requests each runs side by side, the Event poster); beyond the pool, every request pays a new TLS handshake.
CONNECTIONS = 128


@functools.cache
def api() -> client.ApiClient:
    try:
        config.load_incluster_config()
    except config.ConfigException:
        config.load_kube_config()
    configuration = client.Configuration.get_default_copy()
    configuration.connection_pool_maxsize = CONNECTIONS
    return client.ApiClient(configuration)


@functools.cache
def core() -> client.CoreV1Api:
    return client.CoreV1Api(api())


@functools.cache
def rbac() -> client.RbacAuthorizationV1Api:
    return client.RbacAuthorizationV1Api(api())


@functools.cache
def custom() -> client.CustomObjectsApi:
    return client.CustomObjectsApi(api())


@functools.cache
def apps() -> client.AppsV1Api:
    return client.AppsV1Api(api())


#: Keep-alive connections opened at startup: a burst of new jobs right after a start would otherwise open them
#: all at once, one TLS handshake each, and on a busy machine every request of the burst would wait for those.
WARM_CONNECTIONS = 16


def warm_up() -> None:
    """Import the client's API modules and open ``WARM_CONNECTIONS`` connections now (startup), so that no
    reconcile waits for either. Best effort: an apiserver that does not answer yet only leaves them cold."""
    core(), rbac(), custom()
    version = client.VersionApi(api())

    def ask() -> None:
        with contextlib.suppress(Exception):  # warming only
            _json(version.get_code)

    with ThreadPoolExecutor(WARM_CONNECTIONS) as pool:
        list(pool.map(lambda _: ask(), range(WARM_CONNECTIONS)))


def _json(call: Any, *args: Any, **kwargs: Any) -> Any:
    """Call an API method; its answer as the apiserver's JSON (dicts), never the client's typed models."""
    resp = call(*args, _preload_content=False, **kwargs)
    return json.loads(resp.data) if resp.data else None


def _missing_ok(call: Any, *args: Any, **kwargs: Any) -> Any:
    try:
        return _json(call, *args, **kwargs)
    except ApiException as e:
        if e.status == 404:
            return None
        raise


def get_config_map(ns: str, name: str) -> dict[str, Any] | None:
    return _missing_ok(core().read_namespaced_config_map, name, ns)


def _created(call: Any, *args: Any) -> dict[str, Any] | None:
    """Run a create call: the created object, or None when it already existed (409)."""
    try:
        return _json(call, *args)
    except ApiException as e:
        if e.status == 409:
            return None
        raise


def create_config_map(body: dict[str, Any]) -> dict[str, Any] | None:
    return _created(core().create_namespaced_config_map, body["metadata"]["namespace"], body)


def create_server_object(body: dict[str, Any]) -> dict[str, Any] | None:
    """Create an environment server's Deployment or Service; None when it already exists."""
    call = apps().create_namespaced_deployment if body["kind"] == "Deployment" else core().create_namespaced_service
    return _created(call, body["metadata"]["namespace"], body)


def replace_config_map_data(ns: str, name: str, data: dict[str, str]) -> dict[str, Any]:
    return _json(core().patch_namespaced_config_map, name, ns, {"data": data})


#: The fields of a Role/RoleBinding the operator keeps as rendered (a RoleBinding's roleRef cannot change).
RBAC_FIELDS = {"Role": ("rules",), "RoleBinding": ("subjects",), "ServiceAccount": ()}


def _rbac_calls(kind: str) -> tuple[Any, Any, Any]:
    if kind == "ServiceAccount":
        return core().read_namespaced_service_account, core().create_namespaced_service_account, None
    if kind == "Role":
        return rbac().read_namespaced_role, rbac().create_namespaced_role, rbac().replace_namespaced_role
    if kind == "RoleBinding":
        return (rbac().read_namespaced_role_binding, rbac().create_namespaced_role_binding,
                rbac().replace_namespaced_role_binding)
    raise ValueError(f"unsupported kind {kind}")


def rbac_differs(body: dict[str, Any], have: dict[str, Any]) -> bool:
    return any(have.get(f) != body.get(f) for f in RBAC_FIELDS[body["kind"]])


def ensure_object(body: dict[str, Any], have: dict[str, Any] | None) -> tuple[str | None, dict[str, Any] | None]:
    """Create a ServiceAccount/Role/RoleBinding that ``have`` (the cached one) says is absent; bring a Role's rules
    or a RoleBinding's subjects back to the rendered ones when the cached one differs (edited by hand, or
    rendered differently by a newer operator). No request when the cached one matches.
    Returns ("created" | "updated" | None, the object written or None)."""
    kind, ns, name = body["kind"], body["metadata"]["namespace"], body["metadata"]["name"]
    read, create, replace = _rbac_calls(kind)
    if have is None:
        made = _created(create, ns, body)
        return ("created", made) if made is not None else (None, None)
    if replace is None or not rbac_differs(body, have):
        return None, None
    live = _missing_ok(read, name, ns)  # the full object and its resourceVersion, for an update
    if live is None:
        made = _created(create, ns, body)
        return ("created", made) if made is not None else (None, None)
    current = live
    if not rbac_differs(body, current):
        return None, current
    updated = {**current, **{f: body.get(f) for f in RBAC_FIELDS[kind]}}
    # carries resourceVersion: a concurrent change conflicts (409) and is retried
    return "updated", _json(replace, name, ns, updated)


def get_rlhfjob(ns: str, name: str) -> dict[str, Any] | None:
    return _missing_ok(custom().get_namespaced_custom_object, m.GROUP, m.VERSION, ns, m.PLURAL, name)


def get_ray_job(ns: str, name: str) -> dict[str, Any] | None:
    return _missing_ok(custom().get_namespaced_custom_object, RAY_GROUP, RAY_VERSION, ns, "rayjobs", name)


def create_ray_job(body: dict[str, Any]) -> dict[str, Any] | None:
    ns = body["metadata"]["namespace"]
    return _created(custom().create_namespaced_custom_object, RAY_GROUP, RAY_VERSION, ns, "rayjobs", body)


def patch_ray_job(ns: str, name: str, patch: dict[str, Any]) -> dict[str, Any]:
    return _json(custom().patch_namespaced_custom_object, RAY_GROUP, RAY_VERSION, ns, "rayjobs", name, patch)


def delete_ray_cluster(ns: str, name: str, uid: str) -> None:
    """Delete one RayCluster, only if it still is the one seen (``uid`` precondition)."""
    _missing_ok(custom().delete_namespaced_custom_object, RAY_GROUP, RAY_VERSION, ns, "rayclusters", name,
                body={"preconditions": {"uid": uid}, "propagationPolicy": "Background"})


def post_event(obj: dict[str, Any], type_: str, reason: str, message: str, at: dt.datetime | None = None) -> None:
    """A core/v1 Event about ``obj`` (an RLHFJob), as ``kubectl describe`` shows them, stamped ``at`` (default:
    now)."""
    meta = obj["metadata"]
    now = (at or dt.datetime.now(dt.UTC)).strftime("%Y-%m-%dT%H:%M:%SZ")
    _json(core().create_namespaced_event, meta["namespace"], {
        "metadata": {"generateName": f"{meta['name']}.", "namespace": meta["namespace"]},
        "involvedObject": {"apiVersion": obj.get("apiVersion", f"{m.GROUP}/{m.VERSION}"), "kind": obj.get("kind", m.KIND),
                           "name": meta["name"], "namespace": meta["namespace"], "uid": meta.get("uid")},
        "type": type_, "reason": reason, "message": message[:1000],
        "source": {"component": EVENT_COMPONENT}, "reportingComponent": EVENT_COMPONENT,
        "reportingInstance": socket.gethostname()[:128],
        "firstTimestamp": now, "lastTimestamp": now, "count": 1,
    })


EVENT_COMPONENT = "rlhf-operator"


# ------------------------------------------------------------------------------------------------ Kueue
KUEUE_GROUP = "kueue.x-k8s.io"
KUEUE_VERSIONS = ("v1beta2", "v1beta1")
KUEUE_JOB_UID_LABEL = "kueue.x-k8s.io/job-uid"


def set_workload_active(workload: dict[str, Any], active: bool) -> dict[str, Any]:
    group_version = workload["apiVersion"].split("/", 1)[1]
    meta = workload["metadata"]
    return _json(custom().patch_namespaced_custom_object,
                 KUEUE_GROUP, group_version, meta["namespace"], "workloads", meta["name"], {"spec": {"active": active}})


# ------------------------------------------------------------------------------------------- capacity
GPU_RESOURCE = "nvidia.com/gpu"
_CAPACITY_CACHE: tuple[float, dict[str, dict[str, Any]]] | None = None
CAPACITY_CACHE_SECONDS = 30.0


def _quantity(value: Any) -> int:
    try:
        return int(str(value))
    except ValueError:
        return 0


def gpu_nodes() -> dict[str, dict[str, Any]] | None:
    """Per schedulable node: its labels and free GPUs (allocatable minus the requests of its unfinished pods).
    Cached for ``CAPACITY_CACHE_SECONDS`` (read only while a job has an unschedulable pod); None when the operator
    may not list nodes and pods cluster-wide (chart value rbac.clusterCapacity false)."""
    global _CAPACITY_CACHE
    if _CAPACITY_CACHE and time.monotonic() - _CAPACITY_CACHE[0] < CAPACITY_CACHE_SECONDS:
        return _CAPACITY_CACHE[1]
    try:
        nodes = _json(core().list_node)["items"]
        pods = _json(core().list_pod_for_all_namespaces,
                     field_selector="spec.nodeName!=,status.phase!=Succeeded,status.phase!=Failed")["items"]
    except ApiException as e:
        if e.status == 403:
            return None
        raise
    out: dict[str, dict[str, Any]] = {}
    for n in nodes:
        if (n.get("spec") or {}).get("unschedulable"):
            continue
        gpus = _quantity(((n.get("status") or {}).get("allocatable") or {}).get(GPU_RESOURCE, 0))
        if gpus:
            out[n["metadata"]["name"]] = {"labels": n["metadata"].get("labels") or {}, "free": gpus}
    for p in pods:
        node = out.get((p.get("spec") or {}).get("nodeName"))
        if node is None:
            continue
        for c in p["spec"].get("containers") or []:
            node["free"] -= _quantity(((c.get("resources") or {}).get("requests") or {}).get(GPU_RESOURCE, 0))
    _CAPACITY_CACHE = (time.monotonic(), out)
    return out


def delete_pod(ns: str, name: str) -> None:
    _missing_ok(core().delete_namespaced_pod, name, ns)


_KUBERAY_SEEN_AT = 0.0
KUBERAY_RECHECK_SECONDS = 60.0


def kuberay_missing() -> str | None:
    """None when the KubeRay CRDs the operator needs are served, else a message saying what is missing.

    A positive answer is trusted for ``KUBERAY_RECHECK_SECONDS`` (one discovery call a minute, not one per
    reconcile); a missing KubeRay is checked again on every reconcile, so jobs proceed as soon as it appears.
    """
    global _KUBERAY_SEEN_AT
    if time.monotonic() - _KUBERAY_SEEN_AT < KUBERAY_RECHECK_SECONDS:
        return None
    missing = _discover_kuberay()
    if missing is None:
        _KUBERAY_SEEN_AT = time.monotonic()
    return missing


def _discover_kuberay() -> str | None:
    try:
        resources = _json(custom().get_api_resources, RAY_GROUP, RAY_VERSION)
    except ApiException as e:
        if e.status == 404:
            return "the KubeRay CRDs (ray.io/v1) are not installed: install the KubeRay operator first"
        raise
    names = {r["name"] for r in resources.get("resources") or []}
    lacking = sorted({"rayjobs", "rayclusters"} - names)
    if lacking:
        return f"KubeRay CRDs missing: {', '.join(lacking)}.ray.io: install the KubeRay operator first"
    return None


def patch_status(ns: str, name: str, status: dict[str, Any]) -> dict[str, Any]:
    return _json(custom().patch_namespaced_custom_object_status, m.GROUP, m.VERSION, ns, m.PLURAL, name,
                 {"status": status})
