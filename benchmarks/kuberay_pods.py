"""The pods KubeRay makes of a RayJob's cluster, and the one-host version of each that ``rendered_cluster.py`` runs.

For every pod of the rendered RayJob (head, then each worker group's replicas): the ``rayStartParams`` KubeRay
v1.6.1 ends up with (``setMissingRayStartParams`` + ``generateRayStartCommand``: ``num-cpus`` from the container's
CPU limit/request, ``memory`` from its limit, ``num-gpus`` from ``nvidia.com/gpu``; a first-class group
``resources`` map as ``updateRayStartParamsResources`` applies it), its ``ray start`` command, the container env
with KubeRay's own variables, and the one-host adaptations: distinct ports per pod, a fixed object store, no
``--block``, ConfigMap mounts mapped to local directories and the next ``nvidia.com/gpu`` GPUs of the host.
"""

from __future__ import annotations

import json
import math
import re
import shlex
from pathlib import Path
from typing import Any

HEAD_PORT = 6379  # KubeRay's DefaultGcsServerPort
KUBERAY_VERSION = "v1.6.1"
#: Fixed ports KubeRay gives every pod (each pod has its own network namespace there, not here).
PER_NODE_PORTS = {"metrics-export-port": 8080, "dashboard-agent-listen-port": 52365,
                  "dashboard-agent-grpc-port": 52400, "runtime-env-agent-port": 52450}
OBJECT_STORE_BYTES = 10_000_000_000  # validation moves the weights between pods through it


# ------------------------------------------------------------------------------------------- KubeRay
def k8s_quantity(q: Any) -> float:
    """A Kubernetes quantity ("8", "500m", "64Gi", 2) as a number."""
    if isinstance(q, (int, float)):
        return float(q)
    m = re.fullmatch(r"([0-9.]+)([a-zA-Z]*)", str(q).strip())
    if not m:
        raise ValueError(f"bad quantity {q!r}")
    num, suf = float(m.group(1)), m.group(2)
    mult = {"": 1, "m": 1e-3, "k": 1e3, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15, "E": 1e18,
            "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60}[suf]
    return num * mult


def quantity_value(q: Any) -> int:
    """``resource.Quantity.Value()``: rounded up to an integer."""
    return math.ceil(k8s_quantity(q))


def kuberay_resources_map(value: str | None) -> tuple[dict[str, float] | None, str | None]:
    """KubeRay's ``getResourcesMap``: trim quotes/backticks/spaces, then JSON. (map, error)."""
    if value is None:
        return {}, None
    try:
        out = json.loads(value.strip("'\"` "))
        if not isinstance(out, dict):
            return None, f"not a JSON object: {out!r}"
        return out, None
    except json.JSONDecodeError as e:
        return None, f"failed to unmarshal resources {e}"


def convert_param_map(params: dict[str, str]) -> str:
    """KubeRay's ``convertParamMap``: sorted keys, "true"/"false" are switches (except log-color,
    include-dashboard), everything else ``--key=value``, verbatim (bash parses it)."""
    out = ""
    for k in sorted(params):
        v = params[k]
        if v.lower() in ("true", "false") and k not in ("log-color", "include-dashboard"):
            if v.lower() == "true":
                out += f" --{k} "
        else:
            out += f" --{k}={v} "
    return out


def kuberay_start_params(group: dict[str, Any], node_type: str, container: dict[str, Any],
                         head_address: str) -> tuple[dict[str, str], list[str]]:
    """The rayStartParams KubeRay v1.6.1 ends up with for one pod of ``group`` (head or worker group spec),
    and what KubeRay would log or refuse on the way (``validateRayGroupResources``, accelerator parsing)."""
    notes: list[str] = []
    params = {k: (v if isinstance(v, str) else json.dumps(v)) for k, v in (group.get("rayStartParams") or {}).items()}
    group_resources = group.get("resources") or {}
    if group_resources:  # first-class RayCluster group field (KubeRay >= 1.4)
        if any(params.get(k) for k in ("num-cpus", "num-gpus", "memory", "resources")):
            notes.append("KubeRay refuses this RayCluster: resource fields should not be set in both "
                         "rayStartParams and Resources")
        custom: dict[str, float] = {}
        for name, qty in group_resources.items():
            n = name.lower()
            if n == "cpu":
                params["num-cpus"] = str(quantity_value(qty))
            elif n == "memory":
                params["memory"] = str(quantity_value(qty))
            elif n in ("nvidia.com/gpu", "amd.com/gpu") or n.endswith("/gpu"):
                params["num-gpus"] = str(quantity_value(qty))
            else:
                custom[name] = k8s_quantity(qty)
        if custom:
            params["resources"] = "'" + json.dumps(custom, separators=(",", ":")) + "'"
    # setMissingRayStartParams
    if node_type == "worker":
        params.setdefault("address", head_address)
    else:
        params.setdefault("dashboard-host", "0.0.0.0")
    params.setdefault("metrics-export-port", "8080")
    params["block"] = "true"
    params.setdefault("dashboard-agent-listen-port", "52365")
    # generateRayStartCommand
    res = container.get("resources") or {}
    limits, requests = res.get("limits") or {}, res.get("requests") or {}
    if "num-cpus" not in params:
        if limits.get("cpu") and k8s_quantity(limits["cpu"]):
            params["num-cpus"] = str(quantity_value(limits["cpu"]))
        elif requests.get("cpu") and k8s_quantity(requests["cpu"]):
            params["num-cpus"] = str(quantity_value(requests["cpu"]))
    if "memory" not in params and limits.get("memory") and k8s_quantity(limits["memory"]):
        params["memory"] = str(quantity_value(limits["memory"]))
    if limits:  # addWellKnownAcceleratorResources
        _, err = kuberay_resources_map(params.get("resources"))
        if err:
            notes.append(f"KubeRay logs 'failed to add accelerator resources to rayStartParams': {err} "
                         "(the ray start command keeps the string as is)")
        elif "num-gpus" not in params and limits.get("nvidia.com/gpu") and k8s_quantity(limits["nvidia.com/gpu"]):
            params["num-gpus"] = str(quantity_value(limits["nvidia.com/gpu"]))
    return params, notes


def argv_value(cmd: str, flag: str) -> str | None:
    """What ``ray start`` receives for ``--flag=...`` once bash has parsed ``cmd``."""
    try:
        words = shlex.split(cmd.split(";", 1)[-1])
    except ValueError:
        return None
    for w in words:
        if w.startswith(f"--{flag}="):
            return w.split("=", 1)[1]
    return None


# ------------------------------------------------------------------------------------------------ pods
def plan_pods(ray_job: dict[str, Any], config_map: dict[str, Any], work: Path, n_gpus: int, cpu: bool,
              head_address: str) -> list[dict[str, Any]]:
    """One entry per pod of the RayJob's cluster: group, GPUs, env, the KubeRay command and the one we run."""
    cluster = ray_job["spec"]["rayClusterSpec"]
    cluster_name = ray_job["metadata"]["name"] + "-raycluster"
    groups = [("head", "head", 1, cluster["headGroupSpec"])]
    groups += [(g["groupName"], "worker", int(g.get("replicas", 1)), g) for g in cluster["workerGroupSpecs"]]
    pods: list[dict[str, Any]] = []
    next_gpu = 0
    for gname, node_type, replicas, group in groups:
        path_map = mount_config_maps(group["template"]["spec"], config_map, work / "mounts")
        for r in range(replicas):
            pod_name = f"{cluster_name}-head" if node_type == "head" else f"{cluster_name}-{gname}-worker-{r}"
            pod = plan_pod(ray_job, cluster_name, pod_name, gname, node_type, group, path_map, len(pods),
                           head_address)
            next_gpu = give_gpus(pod, next_gpu, n_gpus, cpu)
            pods.append(pod)
    return pods


def mount_config_maps(pod_spec: dict[str, Any], config_map: dict[str, Any], mounts_root: Path) -> dict[str, str]:
    """The container's ConfigMap volumes as local directories holding the rendered keys (the job's own ConfigMap
    only): mount path -> local directory."""
    container = pod_spec["containers"][0]
    path_map: dict[str, str] = {}
    volumes = {v["name"]: v for v in pod_spec.get("volumes", [])}
    for m in container.get("volumeMounts", []):
        v = volumes.get(m["name"], {})
        if "configMap" in v:
            local = mounts_root / m["name"]
            local.mkdir(parents=True, exist_ok=True)
            if v["configMap"]["name"] == config_map["metadata"]["name"]:
                for key, text in config_map["data"].items():
                    (local / key).write_text(text)
            path_map[m["mountPath"]] = str(local)
    return path_map


def mapped(s: str, path_map: dict[str, str]) -> str:
    """``s`` with each mount path replaced by its local directory."""
    for k, v in path_map.items():
        s = s.replace(k, v)
    return s


def ray_start(params: dict[str, str], node_type: str) -> str:
    """The pod's command: KubeRay's ``ulimit`` and ``ray start`` (``--head`` on the head)."""
    head = "--head " if node_type == "head" else ""
    return f"ulimit -n 65536; ray start {head}{convert_param_map(params)}"


def one_host_overrides(n: int, node_type: str) -> dict[str, str]:
    """What the ``n``-th pod's ``ray start`` changes to share this host's network with the others."""
    overrides = {k: str(v + n) for k, v in PER_NODE_PORTS.items()}
    overrides.update({"min-worker-port": str(20000 + 1000 * n), "max-worker-port": str(20999 + 1000 * n),
                      "object-store-memory": str(OBJECT_STORE_BYTES)})
    if node_type == "head":
        overrides["port"] = str(HEAD_PORT)
    return overrides


def plan_pod(ray_job: dict[str, Any], cluster_name: str, pod_name: str, gname: str, node_type: str,
             group: dict[str, Any], path_map: dict[str, str], n: int, head_address: str) -> dict[str, Any]:
    """The ``n``-th pod: KubeRay's parameters and command, the one run here, its env (GPUs not given yet)."""
    container = group["template"]["spec"]["containers"][0]
    params, notes = kuberay_start_params(group, node_type, container, head_address)
    kuberay_cmd = ray_start(params, node_type)
    local = dict(params)
    local.pop("block", None)
    overrides = one_host_overrides(n, node_type)
    local.update(overrides)
    gpus = quantity_value((container.get("resources", {}).get("limits") or {}).get("nvidia.com/gpu", 0))
    env = {e["name"]: mapped(e.get("value", ""), path_map) for e in container.get("env", [])}
    env.update({  # what KubeRay adds to the Ray container (setContainerEnvVars)
        "RAY_CLUSTER_NAME": cluster_name, "RAY_CLUSTER_NAMESPACE": ray_job["metadata"]["namespace"],
        "RAY_CLOUD_INSTANCE_ID": pod_name, "RAY_NODE_TYPE_NAME": gname, "RAY_PORT": str(HEAD_PORT),
        "KUBERAY_GEN_RAY_START_CMD": kuberay_cmd.split("; ", 1)[1], "RAY_ADDRESS": head_address,
        "RAY_USAGE_STATS_KUBERAY_IN_USE": "1", "RAY_DASHBOARD_ENABLE_K8S_DISK_USAGE": "1",
    })
    if node_type == "worker":
        env.update(FQ_RAY_IP=head_address.split(":")[0], RAY_IP=head_address.split(":")[0])
    return {
        "pod": pod_name, "group": gname, "type": node_type, "gpus": gpus, "cuda_visible_devices": None,
        "rendered_ray_start_params": group.get("rayStartParams"),
        "rendered_group_resources": group.get("resources"),
        "kuberay_params": params, "kuberay_command": kuberay_cmd, "kuberay_notes": notes,
        "one_host_overrides": overrides, "command": ray_start(local, node_type), "container_env": container.get("env", []),
        "env": env, "path_map": path_map, "_mapped_entrypoint": mapped(ray_job["spec"]["entrypoint"], path_map),
        "resources_argv": argv_value(kuberay_cmd, "resources"),
    }


def give_gpus(pod: dict[str, Any], next_gpu: int, n_gpus: int, cpu: bool) -> int:
    """The pod gets the host's next ``nvidia.com/gpu`` GPUs (``CUDA_VISIBLE_DEVICES``, "" for a GPU-less pod such as
    the head: no device, as in the pod); the CPU smoke test has none to split. Returns the next free GPU."""
    if cpu:
        return next_gpu
    gpus = pod["gpus"]
    if next_gpu + gpus > n_gpus:
        raise RuntimeError(f"pod {pod['pod']} needs {gpus} GPU(s), the host has {n_gpus - next_gpu} left")
    visible = ",".join(str(i) for i in range(next_gpu, next_gpu + gpus))
    pod["cuda_visible_devices"] = visible
    pod["env"]["CUDA_VISIBLE_DEVICES"] = visible
    return next_gpu + gpus
