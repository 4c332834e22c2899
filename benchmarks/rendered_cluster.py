"""The operator's rendered RayJob, run on ONE host: the same contract as on Kubernetes, on real GPUs.

For each layout (``separate-nccl``, ``colocated-ipc``; ``cpu-gloo`` as a CPU smoke test) this script

1. builds a random-init model from a published config (``gpu_sync.MODELS``; no hub on the device) and an
   RLHFJob spec for it (``gpu_sync.base_spec`` + the layout + ``spec.weightSync.validate: true``);
2. renders it with the operator's own ``rlhf_operator.render.render_ray_job`` / ``render_config_map``;
3. turns every pod the RayJob describes into the ``ray start`` command KubeRay v1.6.1 would put in that pod
   (``setMissingRayStartParams`` + ``generateRayStartCommand``: ``num-cpus`` from the container's CPU
   limit/request, ``memory`` from its limit, ``num-gpus`` from ``nvidia.com/gpu``; a first-class group
   ``resources`` map is applied as ``updateRayStartParamsResources`` does; the command runs through
   ``/bin/bash -c --`` as in the pod, so the quoting of ``rayStartParams.resources`` is exercised for real) and
   runs it on this host with the pod's container ``env`` (``spec.env`` + the operator's ``BASE_ENV`` + KubeRay's
   own variables) and ``CUDA_VISIBLE_DEVICES`` = the next ``nvidia.com/gpu`` GPUs of the host. One-host
   adaptations, recorded per pod: distinct metrics / agent / worker ports, a 10 GB object store, no ``--block``
   (``ray start`` returns; ``ray stop --force`` ends every node), ConfigMap volume mounts mapped to local
   directories (``/etc/rlhf/job.json`` -> ``<work>/mounts/rlhf-config/job.json``), and ``RAY_AUTH_MODE=disabled``
   unless the rendered env sets it (a pod has no ``~/.ray/auth_token``; this host may: ``one_host_env``);
4. checks that the nodes Ray registered offer what the runtime's placement groups ask for
   (``rlhf_runtime.infra.placement.compute_layout(spec).totals()``), then runs the RayJob's entrypoint as KubeRay
   would (``python -m rlhf_runtime.driver --config <job.json>`` on the "head pod": its env, no GPU,
   ``RAY_ADDRESS`` = the head) with ``--no-report`` (no apiserver) and ``--progress-file`` (the runtime's
   local copy of what it would patch into ``status``);
5. stops every Ray node (``ray stop --force``) and writes ``<out>/rendered_<layout>_<model>.json`` (the exact
   command, rendered ``rayStartParams`` per group, the KubeRay-equivalent and the executed ``ray start``
   commands, the GPU split, the nodes Ray saw, validation verdict, per-step sync time and tokens/s) plus the
   driver's log tail (``.driver.log``).

    source benchmarks/gpu_env.sh
    python3 benchmarks/rendered_cluster.py --kind nvidia-h200-x2 --out $OUT --model qwen3-1.7b --steps 4 \\
        separate-nccl colocated-ipc
    .venv/bin/python benchmarks/rendered_cluster.py --cpu --out /tmp/x cpu-gloo     # CPU smoke test
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import time
import traceback
import uuid
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent
REPO = ROOT.parent
if str(REPO / "operator") not in sys.path:
    sys.path.insert(0, str(REPO / "operator"))
sys.path.insert(0, str(ROOT))

#: Spec overrides per layout (on top of ``gpu_sync.base_spec``). gpusPerNode = what this one host has.
LAYOUTS: dict[str, dict[str, Any]] = {
    # (a) 1 trainer pod x 1 GPU + 1 engine pod, TP=1 (GPU 0 -> trainer pod, GPU 1 -> engine pod), NCCL
    "separate-nccl": {"placement": {"mode": "separate", "gpusPerNode": 2}, "weightSync": {"backend": "nccl"},
                      "rollout": {"gpuMemoryUtilization": 0.5}},
    # (b) 1 colocated pod (trainer worker + engine share its GPU), CUDA IPC, sleep/wake (the default)
    "colocated-ipc": {"placement": {"mode": "colocated", "gpusPerNode": 2}, "weightSync": {"backend": "ipc"},
                      "rollout": {"gpuMemoryUtilization": 0.3}},
    # (c) vLLM's rlhf_nccl example's layout (issue 33 item 6, 3 GPUs): a trainer pod x 1 GPU + one engine pod of
    # 2 GPUs holding one TP=2 engine, NCCL in the kernel format (each TP worker its own shard)
    "separate-nccl-tp2": {"placement": {"mode": "separate", "gpusPerNode": 2}, "weightSync": {"backend": "nccl"},
                          "rollout": {"tensorParallelSize": 2, "gpuMemoryUtilization": 0.5}},
    # (c') the same with vLLM's own custom all-reduce instead of FlashInfer's (whose module a fresh container
    # compiles on first use: 91 s on 4xH200, 2026-11-28); run it before (c) on a fresh machine to see both starts
    "separate-nccl-tp2-custom-ar": {"placement": {"mode": "separate", "gpusPerNode": 2},
                                    "weightSync": {"backend": "nccl"},
                                    "rollout": {"tensorParallelSize": 2, "gpuMemoryUtilization": 0.5},
                                    "env": [{"name": "VLLM_ALLREDUCE_USE_FLASHINFER", "value": "0"}]},
    # (d) 4 GPUs: a trainer pod of 2 GPUs (FSDP2 x2) + two engine pods of 1 GPU (DP2, TP=1), NCCL
    "separate-nccl-fsdp2-dp2": {"placement": {"mode": "separate", "gpusPerNode": 2},
                                "weightSync": {"backend": "nccl"},
                                "trainer": {"replicas": 1, "gpusPerReplica": 2, "strategy": "fsdp2"},
                                "rollout": {"engines": 2, "gpuMemoryUtilization": 0.5}},
    # CPU smoke test of this script (gloo backend, tiny model)
    "cpu-gloo": {"placement": {"mode": "separate"}, "trainer": {"gpusPerReplica": 0},
                 "rollout": {"gpuMemoryUtilization": 0.05}},
}

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


# --------------------------------------------------------------------------------------------- helpers
def median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def tail(path: Path, n: int) -> str:
    if not path.exists():
        return ""
    data = path.read_bytes()
    return data[-n:].decode(errors="replace")


def host_gpus() -> list[str]:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=index,name,memory.total", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30, check=True).stdout
        return [line.strip() for line in out.splitlines() if line.strip()]
    except (OSError, subprocess.SubprocessError):
        return []


def ray_shim(work: Path) -> Path:
    """A ``ray`` executable (the image has one on PATH; the staged wheels do not) running this Python's Ray."""
    d = work / "bin"
    d.mkdir(parents=True, exist_ok=True)
    shim = d / "ray"
    shim.write_text(f'#!/bin/sh\nexec {shlex.quote(sys.executable)} -m ray.scripts.scripts "$@"\n')
    shim.chmod(0o755)
    return d


def ray_stop(env: dict[str, str]) -> dict[str, Any]:
    t = time.perf_counter()
    p = subprocess.run(["ray", "stop", "--force"], env=env, capture_output=True, text=True, timeout=120, check=False)
    return {"rc": p.returncode, "seconds": time.perf_counter() - t, "output_tail": (p.stdout + p.stderr)[-1500:]}


def build_model_cached(name: str, path: Path, cpu: bool, env: dict[str, str]) -> dict[str, Any]:
    """``gpu_sync.build_model`` in a child process (no CUDA context left in this one), cached on disk."""
    meta = path / "rendered_model.json"
    if meta.exists():
        return {**json.loads(meta.read_text()), "cached": True}
    t = time.perf_counter()
    code = ("import json,sys; sys.path[:0]=[sys.argv[1], sys.argv[2]]; from gpu_sync import build_model; "
            "r=build_model(__import__('pathlib').Path(sys.argv[3]), sys.argv[4], sys.argv[5]=='gpu'); "
            "open(sys.argv[3]+'/rendered_model.json','w').write(json.dumps(r))")
    benv = dict(env)
    if not cpu:
        benv["CUDA_VISIBLE_DEVICES"] = "0"
    subprocess.run([sys.executable, "-c", code, str(ROOT), str(REPO / "operator"), str(path), name,
                    "cpu" if cpu else "gpu"], env=benv, check=True, timeout=600)
    return {**json.loads(meta.read_text()), "build_s": time.perf_counter() - t, "cached": False}


def make_spec(layout: str, model_path: str, args: argparse.Namespace) -> dict[str, Any]:
    from gpu_sync import base_spec, merge

    gpu = not args.cpu
    spec = merge(base_spec(model_path, gpu), LAYOUTS[layout])
    spec["image"] = "ghcr.io/rlhf-operator/runtime:0.1.0"  # stands for this host's Python (see gpu_env.sh)
    spec["algorithm"]["steps"] = args.steps
    if args.prompts:
        spec["algorithm"]["promptsPerStep"] = args.prompts
    if args.max_tokens:
        spec["rollout"]["sampling"]["maxTokens"] = args.max_tokens
    spec["weightSync"]["validate"] = True
    return spec


# ------------------------------------------------------------------------------------------------ pods
def plan_pods(ray_job: dict[str, Any], config_map: dict[str, Any], work: Path, n_gpus: int, cpu: bool,
              head_address: str) -> list[dict[str, Any]]:
    """One entry per pod of the RayJob's cluster: group, GPUs, env, the KubeRay command and the one we run."""
    cluster = ray_job["spec"]["rayClusterSpec"]
    cluster_name = ray_job["metadata"]["name"] + "-raycluster"
    groups = [("head", "head", 1, cluster["headGroupSpec"])]
    groups += [(g["groupName"], "worker", int(g.get("replicas", 1)), g) for g in cluster["workerGroupSpecs"]]
    mounts_root = work / "mounts"
    pods, next_gpu = [], 0
    for index, (gname, node_type, replicas, group) in enumerate(groups):
        pod_spec = group["template"]["spec"]
        container = pod_spec["containers"][0]
        # ConfigMap volumes -> local directories with the rendered keys (the job's own ConfigMap only)
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

        def mapped(s: str, path_map: dict[str, str] = path_map) -> str:
            for k, v in path_map.items():
                s = s.replace(k, v)
            return s

        for r in range(replicas):
            pod_name = f"{cluster_name}-head" if node_type == "head" else f"{cluster_name}-{gname}-worker-{r}"
            params, notes = kuberay_start_params(group, node_type, container, head_address)
            kuberay_cmd = (f"ulimit -n 65536; ray start --head {convert_param_map(params)}" if node_type == "head"
                           else f"ulimit -n 65536; ray start {convert_param_map(params)}")
            n = len(pods)
            local = dict(params)
            local.pop("block", None)
            overrides = {k: str(v + n) for k, v in PER_NODE_PORTS.items()}
            overrides.update({"min-worker-port": str(20000 + 1000 * n), "max-worker-port": str(20999 + 1000 * n),
                              "object-store-memory": str(OBJECT_STORE_BYTES)})
            if node_type == "head":
                overrides["port"] = str(HEAD_PORT)
            local.update(overrides)
            run_cmd = (f"ulimit -n 65536; ray start --head {convert_param_map(local)}" if node_type == "head"
                       else f"ulimit -n 65536; ray start {convert_param_map(local)}")
            gpus = quantity_value((container.get("resources", {}).get("limits") or {}).get("nvidia.com/gpu", 0))
            env = {e["name"]: mapped(e.get("value", "")) for e in container.get("env", [])}
            env.update({  # what KubeRay adds to the Ray container (setContainerEnvVars)
                "RAY_CLUSTER_NAME": cluster_name, "RAY_CLUSTER_NAMESPACE": ray_job["metadata"]["namespace"],
                "RAY_CLOUD_INSTANCE_ID": pod_name, "RAY_NODE_TYPE_NAME": gname, "RAY_PORT": str(HEAD_PORT),
                "KUBERAY_GEN_RAY_START_CMD": kuberay_cmd.split("; ", 1)[1], "RAY_ADDRESS": head_address,
                "RAY_USAGE_STATS_KUBERAY_IN_USE": "1", "RAY_DASHBOARD_ENABLE_K8S_DISK_USAGE": "1",
            })
            if node_type == "worker":
                env.update(FQ_RAY_IP=head_address.split(":")[0], RAY_IP=head_address.split(":")[0])
            if cpu:
                visible = None  # CPU smoke test: no devices to split
            else:
                if next_gpu + gpus > n_gpus:
                    raise RuntimeError(f"pod {pod_name} needs {gpus} GPU(s), the host has {n_gpus - next_gpu} left")
                visible = ",".join(str(i) for i in range(next_gpu, next_gpu + gpus))
                next_gpu += gpus
                env["CUDA_VISIBLE_DEVICES"] = visible  # "" for GPU-less pods (head): no device, as in the pod
            pods.append({
                "pod": pod_name, "group": gname, "type": node_type, "gpus": gpus, "cuda_visible_devices": visible,
                "rendered_ray_start_params": group.get("rayStartParams"),
                "rendered_group_resources": group.get("resources"),
                "kuberay_params": params, "kuberay_command": kuberay_cmd, "kuberay_notes": notes,
                "one_host_overrides": overrides, "command": run_cmd, "container_env": container.get("env", []),
                "env": env, "path_map": path_map, "_mapped_entrypoint": mapped(ray_job["spec"]["entrypoint"]),
                "resources_argv": argv_value(kuberay_cmd, "resources"),
            })
    return pods


NODES_SNIPPET = r"""
import json, sys, time, ray
want = int(sys.argv[1])
ray.init(address=sys.argv[2], logging_level="ERROR", log_to_driver=False)
deadline = time.time() + 90
while True:
    nodes = [n for n in ray.nodes() if n["Alive"]]
    if len(nodes) >= want or time.time() > deadline:
        break
    time.sleep(1)
print("NODES_JSON " + json.dumps({
    "nodes": [{"node_id": n["NodeID"], "address": n["NodeManagerAddress"], "resources": n["Resources"],
               "labels": n.get("Labels", {})} for n in nodes],
    "cluster_resources": ray.cluster_resources()}))
"""


# --------------------------------------------------------------------------------------------- one run
def run_layout(layout: str, args: argparse.Namespace, command: str, out: Path) -> dict[str, Any]:
    from rlhf_api.models import RLHFJobSpec
    from rlhf_operator.render import BASE_ENV, Job, render_config_map, render_ray_job
    from rlhf_runtime.infra.placement import compute_layout

    cpu = args.cpu
    model_name = "tiny" if cpu else args.model
    res_file = out / f"rendered_{layout}_{model_name}.json"
    log_file = out / f"rendered_{layout}_{model_name}.driver.log"
    work = Path(args.work) / layout
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {
        "layout": layout, "model_name": model_name, "device_kind": args.kind,
        "date": datetime.now(UTC).isoformat(timespec="seconds"), "command": command, "status": "running",
        "host_gpus": host_gpus(), "kuberay_version_emulated": KUBERAY_VERSION,
    }

    def save() -> None:
        res_file.write_text(json.dumps(result, indent=1, default=str))

    host_env = dict(os.environ)
    host_env.pop("RAY_ADDRESS", None)
    host_env.pop("CUDA_VISIBLE_DEVICES", None)
    host_env["PATH"] = f"{ray_shim(work)}:{host_env.get('PATH', '')}"
    # A pod starts without ~/.ray/auth_token; this host may hold one left by any earlier `ray.init()` (Ray 2.60
    # writes it and turns token auth on for local clusters). With RAY_AUTH_MODE unset, `ray start --head` turns
    # token auth on when that file exists while a worker's `ray start --address` stays 'disabled', so no worker
    # could join (InvalidAuthToken; 4xH200, 2026-11-28, after a gpu_sync.py run on the same machine). What a fresh
    # pod's head does: disabled. The rendered env (spec.env) still wins where it sets RAY_AUTH_MODE.
    host_env.setdefault("RAY_AUTH_MODE", "disabled")
    result["one_host_env"] = {"RAY_AUTH_MODE": host_env["RAY_AUTH_MODE"]}
    stages: dict[str, float] = {}
    result["stages_s"] = stages
    started_ray = False
    try:
        try:
            import ray
            import torch

            result["versions"] = {"ray": ray.__version__, "torch": torch.__version__, "python": sys.version.split()[0]}
            import vllm

            result["versions"]["vllm"] = vllm.__version__
        except Exception as e:  # noqa: BLE001
            result.setdefault("versions", {})["import_error"] = repr(e)
        # 1. model + spec
        model_path = Path(args.work) / "models" / model_name
        model_path.mkdir(parents=True, exist_ok=True)
        t = time.perf_counter()
        result["model"] = build_model_cached(model_name, model_path, cpu, host_env)
        stages["model_s"] = time.perf_counter() - t
        spec = make_spec(layout, str(model_path), args)
        result["spec"] = spec
        # 2. render with the operator's code
        job = Job(name=f"rendered-{layout}", namespace="bench", uid=str(uuid.uuid4()),
                  spec=RLHFJobSpec.model_validate(spec))
        ray_job, config_map = render_ray_job(job), render_config_map(job)
        result["rendered"] = {
            "ray_start_params": {"head": ray_job["spec"]["rayClusterSpec"]["headGroupSpec"]["rayStartParams"],
                                 **{g["groupName"]: g["rayStartParams"]
                                    for g in ray_job["spec"]["rayClusterSpec"]["workerGroupSpecs"]}},
            "group_resources": {g["groupName"]: g.get("resources")
                                for g in ray_job["spec"]["rayClusterSpec"]["workerGroupSpecs"] if g.get("resources")},
            "entrypoint": ray_job["spec"]["entrypoint"], "base_env": BASE_ENV, "ray_job": ray_job,
            "config_map": config_map,
        }
        n_gpus = len(result["host_gpus"])
        head_address = f"127.0.0.1:{HEAD_PORT}"
        pods = plan_pods(ray_job, config_map, work, n_gpus, cpu, head_address)
        result["gpu_split"] = {p["pod"]: p["cuda_visible_devices"] for p in pods}
        result["pods"] = pods
        need = compute_layout(job.spec).totals()
        result["layout_needs"] = need
        save()
        print(f"[{layout}] rendered {len(pods)} pods; GPU split {result['gpu_split']}", flush=True)

        # 3. the Ray nodes
        result["ray_stop_before"] = ray_stop(host_env)
        t = time.perf_counter()
        started_ray = True
        for p in pods:
            env = {**host_env, **p["env"]}
            if p["cuda_visible_devices"] is None:
                env.pop("CUDA_VISIBLE_DEVICES", None)
            proc = subprocess.run(["/bin/bash", "-c", "--", p["command"]], env=env, capture_output=True, text=True,
                                  timeout=180, check=False)
            p["rc"] = proc.returncode
            p["output_tail"] = (proc.stdout + proc.stderr)[-2500:]
            print(f"[{layout}] {p['pod']}: ray start rc={proc.returncode} (CUDA_VISIBLE_DEVICES="
                  f"{p['cuda_visible_devices']!r})", flush=True)
            if proc.returncode != 0:
                raise RuntimeError(f"ray start of pod {p['pod']} failed (rc {proc.returncode}): "
                                   f"{(proc.stdout + proc.stderr)[-1500:]}")
        stages["ray_start_s"] = time.perf_counter() - t
        head_env = {**host_env, **pods[0]["env"]}
        if pods[0]["cuda_visible_devices"] is None:
            head_env.pop("CUDA_VISIBLE_DEVICES", None)
        q = subprocess.run([sys.executable, "-c", NODES_SNIPPET, str(len(pods)), head_address], env=head_env,
                           capture_output=True, text=True, timeout=180, check=False)
        line = next((x for x in q.stdout.splitlines() if x.startswith("NODES_JSON ")), None)
        if line is None:
            raise RuntimeError(f"could not list the Ray nodes: {(q.stdout + q.stderr)[-1500:]}")
        seen = json.loads(line[len("NODES_JSON "):])
        result["ray_nodes"], result["cluster_resources"] = seen["nodes"], seen["cluster_resources"]
        missing = {k: v for k, v in need.items() if seen["cluster_resources"].get(k, 0) + 1e-9 < v}
        result["layout_fits_cluster"] = not missing
        save()
        print(f"[{layout}] {len(seen['nodes'])} Ray nodes; cluster resources "
              f"{ {k: v for k, v in seen['cluster_resources'].items() if not k.startswith('node:')} }", flush=True)
        if len(seen["nodes"]) != len(pods):
            raise RuntimeError(f"{len(seen['nodes'])} Ray nodes registered, the RayJob describes {len(pods)} pods")
        if missing:
            raise RuntimeError(f"the rendered Ray cluster lacks what the runtime's placement groups ask for: {missing} "
                               f"(cluster: {seen['cluster_resources']})")

        # 4. the driver, as KubeRay's entrypoint on the head pod
        entry = shlex.split(pods[0]["_mapped_entrypoint"])
        exe = [sys.executable if entry[0] in ("python", "python3") else entry[0], *entry[1:]]
        progress = work / "progress.jsonl"
        driver_cmd = [*exe, "--no-report", "--progress-file", str(progress)]
        result["driver"] = {"rendered_entrypoint": ray_job["spec"]["entrypoint"], "argv": driver_cmd,
                            "command": " ".join(shlex.quote(x) for x in driver_cmd), "env_from": pods[0]["pod"],
                            "RAY_ADDRESS": head_address}
        save()
        t = time.perf_counter()
        with open(log_file, "wb") as f:
            proc = subprocess.Popen(driver_cmd, env={**head_env, "RAY_ADDRESS": head_address}, cwd=str(work),
                                    stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
            try:
                rc = proc.wait(timeout=args.timeout)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                rc = None
        stages["driver_s"] = time.perf_counter() - t
        result["driver"].update(rc=rc, seconds=stages["driver_s"], timed_out=rc is None)
        print(f"[{layout}] driver exit {rc} after {stages['driver_s']:.0f}s", flush=True)
        collect(result, progress, log_file)
        if rc is None:
            result["status"], result["error"] = "timeout", f"driver still running after {args.timeout:.0f}s"
        elif rc != 0:
            result["status"] = "failed"
            result["error"] = f"driver exit {rc}: " + (result.get("driver_error") or "see driver_log_tail")
        else:
            result["status"] = "ok"
    except BaseException as e:  # noqa: BLE001 - a failure is a result too
        result["status"] = "failed"
        result["error"] = f"{type(e).__name__}: {e}"[:4000]
        result["traceback"] = traceback.format_exc()[-6000:]
        print(result["traceback"], flush=True)
    finally:
        if started_ray:
            result["ray_stop"] = ray_stop(host_env)
        for p in result.get("pods", []):
            p.pop("_mapped_entrypoint", None)
        if log_file.exists() and log_file.stat().st_size > 200_000:  # keep the tail only
            data = tail(log_file, 200_000)
            log_file.write_text("[... head of the log cut ...]\n" + data)
        save()
    return result


def collect(result: dict[str, Any], progress: Path, log_file: Path) -> None:
    """The runtime's reports (progress file = what it would patch into the RLHFJob status) -> numbers."""
    records = [json.loads(x) for x in progress.read_text().splitlines() if x.strip()] if progress.exists() else []
    log = tail(log_file, 400_000)
    result["driver_log_tail"] = tail(log_file, 6000)
    err = re.findall(r"(?:run failed:|ERROR rlhf_runtime: ).*", log)
    if err:
        result["driver_error"] = err[-1][:2000]
    m = re.search(r"Traceback \(most recent call last\):(?:.|\n)*?\n(\w[\w.]*(?:Error|Exception|Exit)[^\n]*)", log)
    if m:
        result["driver_exception"] = m.group(1)[:2000]
    result["driver_step_lines"] = re.findall(r"step \d+/\d+ reward .*", log)
    validation = next((r["validation"] for r in records if "validation" in r), None)
    if validation:
        result["validation"] = {k: validation.get(k) for k in
                                ("validated", "prompts", "engines", "mismatched", "mismatched_by_engine")}
    elif "weight-sync validation" in log:
        result["validation"] = {"validated": "weight-sync validation passed" in log,
                                "from_log": re.findall(r"weight-sync validation.*", log)[-1][:1000]}
    states = [r.get("runtime", {}).get("state") for r in records if "runtime" in r]
    result["runtime_states"] = states
    result["final_report"] = next((r for r in reversed(records) if "runtime" in r), None)
    initial = next((r for r in records if r.get("runtime", {}).get("state") == "Running" and "sync" in r
                    and "train" not in r), None)
    steps = []
    for r in records:
        if "train" not in r:
            continue
        tp, s = r.get("throughput", {}), r.get("sync") or {}
        steps.append({
            "step": r.get("step"), "tokens": r.get("tokens"),
            "rollout_tokens_per_second": tp.get("rolloutTokensPerSecond"),
            "rollout_s": tp.get("rolloutSeconds"), "train_s": tp.get("trainSeconds"), "step_s": tp.get("stepSeconds"),
            "reward_mean": tp.get("rewardMean"), "sync_s": s.get("total_s"), "sync_gbps": s.get("gbps"),
            "sync_stages": {k: v for k, v in s.items() if isinstance(v, (int, float))},
            "loss": (r.get("train") or {}).get("loss"),
        })
    result["steps"] = steps
    # step 1 reports the initial sync (before validation); steps 2.. each report their own sync
    later = steps[1:]
    result["summary"] = {
        "steps_completed": max([s["step"] or 0 for s in steps], default=0),
        "validated": (result.get("validation") or {}).get("validated"),
        "initial_sync_ms": (initial["sync"]["total_s"] * 1e3) if initial and initial.get("sync") else None,
        "sync_ms_per_step": [round(s["sync_s"] * 1e3, 2) if s["sync_s"] is not None else None for s in later],
        "median_sync_ms": (median([s["sync_s"] for s in later if s["sync_s"] is not None]) or 0) * 1e3 or None,
        "median_sync_gbps": median([s["sync_gbps"] for s in later if s["sync_gbps"] is not None]),
        "sync_bytes": (initial or {}).get("sync", {}).get("bytes"),
        "tokens_per_second_per_step": [s["rollout_tokens_per_second"] for s in steps],
        "median_tokens_per_second": median([s["rollout_tokens_per_second"] for s in later
                                            if s["rollout_tokens_per_second"] is not None]),
        "median_step_s": median([s["step_s"] for s in later if s["step_s"] is not None]),
        "median_train_s": median([s["train_s"] for s in later if s["train_s"] is not None]),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("layouts", nargs="+", choices=sorted(LAYOUTS))
    p.add_argument("--kind", default="unknown", help="the device kind, recorded in the results")
    p.add_argument("--out", default=str(ROOT / "results" / "rendered"))
    p.add_argument("--work", default="/tmp/rlhf-rendered")
    p.add_argument("--model", default="qwen3-1.7b", help="a gpu_sync.MODELS name (GPU runs)")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--prompts", type=int, default=0, help="prompts per step (default: gpu_sync.base_spec's)")
    p.add_argument("--max-tokens", type=int, default=0, help="sampling.maxTokens (default: gpu_sync.base_spec's)")
    p.add_argument("--timeout", type=float, default=300, help="seconds the driver may run, per layout")
    p.add_argument("--cpu", action="store_true", help="CPU smoke test (tiny model, gloo, no GPU split)")
    args = p.parse_args()
    env_prefix = " ".join(f"{k}={os.environ[k]}" for k in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST",
                                                           "NVSHMEM_DISABLE_NVLS") if k in os.environ)
    command = (env_prefix + " " if env_prefix else "") + " ".join(shlex.quote(x) for x in ["python3", *sys.argv])
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for layout in args.layouts:
        r = run_layout(layout, args, command, out)
        s = r.get("summary", {})
        rows.append(f"{layout}: {r['status']} {r.get('error', '')[:300]} | steps {s.get('steps_completed')} | "
                    f"validated {s.get('validated')} | initial sync {s.get('initial_sync_ms')} ms | sync/step "
                    f"{s.get('sync_ms_per_step')} ms | tokens/s {s.get('median_tokens_per_second')}")
    print("\n".join(rows), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
