"""The operator's Kubernetes I/O: small, idempotent calls over the official client.

Create calls tolerate ``409 AlreadyExists`` (another replica or a previous life of this process got there
first); reads tolerate ``404``. Nothing here decides anything: that is ``render`` and ``status``.
"""

from __future__ import annotations

import functools
import time
from typing import Any

from kubernetes import client, config
from kubernetes.client.rest import ApiException

from rlhf_api import models as m

RAY_GROUP, RAY_VERSION = "ray.io", "v1"


@functools.cache
def api() -> client.ApiClient:
    try:
        config.load_incluster_config()
    except config.ConfigException:
        config.load_kube_config()
    return client.ApiClient()


def core() -> client.CoreV1Api:
    return client.CoreV1Api(api())


def rbac() -> client.RbacAuthorizationV1Api:
    return client.RbacAuthorizationV1Api(api())


def custom() -> client.CustomObjectsApi:
    return client.CustomObjectsApi(api())


def _missing_ok(call: Any, *args: Any, **kwargs: Any) -> Any:
    try:
        return call(*args, **kwargs)
    except ApiException as e:
        if e.status == 404:
            return None
        raise


def to_dict(obj: Any) -> dict[str, Any]:
    return api().sanitize_for_serialization(obj)


def get_config_map(ns: str, name: str) -> dict[str, Any] | None:
    cm = _missing_ok(core().read_namespaced_config_map, name, ns)
    return to_dict(cm) if cm is not None else None


def _created(call: Any, *args: Any) -> bool:
    """Run a create call: True when created, False when it already existed (409)."""
    try:
        call(*args)
        return True
    except ApiException as e:
        if e.status == 409:
            return False
        raise


def create_config_map(body: dict[str, Any]) -> bool:
    return _created(core().create_namespaced_config_map, body["metadata"]["namespace"], body)


def replace_config_map_data(ns: str, name: str, data: dict[str, str]) -> None:
    core().patch_namespaced_config_map(name, ns, {"data": data})


def ensure_object(body: dict[str, Any]) -> bool:
    """Create a ServiceAccount/Role/RoleBinding if absent (GET first: no write when it exists). True if created."""
    kind, ns, name = body["kind"], body["metadata"]["namespace"], body["metadata"]["name"]
    if kind == "ServiceAccount":
        read, create = core().read_namespaced_service_account, core().create_namespaced_service_account
    elif kind == "Role":
        read, create = rbac().read_namespaced_role, rbac().create_namespaced_role
    elif kind == "RoleBinding":
        read, create = rbac().read_namespaced_role_binding, rbac().create_namespaced_role_binding
    else:
        raise ValueError(f"unsupported kind {kind}")
    if _missing_ok(read, name, ns) is not None:
        return False
    return _created(create, ns, body)


def get_ray_job(ns: str, name: str) -> dict[str, Any] | None:
    return _missing_ok(custom().get_namespaced_custom_object, RAY_GROUP, RAY_VERSION, ns, "rayjobs", name)


def create_ray_job(body: dict[str, Any]) -> bool:
    ns = body["metadata"]["namespace"]
    return _created(custom().create_namespaced_custom_object, RAY_GROUP, RAY_VERSION, ns, "rayjobs", body)


def patch_ray_job(ns: str, name: str, patch: dict[str, Any]) -> None:
    custom().patch_namespaced_custom_object(RAY_GROUP, RAY_VERSION, ns, "rayjobs", name, patch)


def get_ray_cluster(ns: str, name: str) -> dict[str, Any] | None:
    return _missing_ok(custom().get_namespaced_custom_object, RAY_GROUP, RAY_VERSION, ns, "rayclusters", name)


def list_pods(ns: str, selector: str) -> list[dict[str, Any]]:
    return [to_dict(p) for p in core().list_namespaced_pod(ns, label_selector=selector).items]


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
        resources = client.CustomObjectsApi(api()).get_api_resources(RAY_GROUP, RAY_VERSION)
    except ApiException as e:
        if e.status == 404:
            return "the KubeRay CRDs (ray.io/v1) are not installed: install the KubeRay operator first"
        raise
    names = {r.name for r in resources.resources}
    lacking = sorted({"rayjobs", "rayclusters"} - names)
    if lacking:
        return f"KubeRay CRDs missing: {', '.join(lacking)}.ray.io: install the KubeRay operator first"
    return None


def patch_status(ns: str, name: str, status: dict[str, Any]) -> None:
    custom().patch_namespaced_custom_object_status(m.GROUP, m.VERSION, ns, m.PLURAL, name, {"status": status})
