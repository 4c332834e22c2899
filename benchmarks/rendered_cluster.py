"""The operator's rendered RayJob, run on ONE host: the same contract as on Kubernetes, on real GPUs.

For each layout (``separate-nccl``, ``colocated-ipc``; ``cpu-gloo`` as a CPU smoke test) this script

1. builds a random-init model from a published config (``harness.MODELS``; no hub on the device) and an
   RLHFJob spec for it (``harness.base_spec`` + the layout + ``spec.weightSync.validate: true``);
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
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent
REPO = ROOT.parent
if str(REPO / "operator") not in sys.path:
    sys.path.insert(0, str(REPO / "operator"))
sys.path.insert(0, str(ROOT))
from kuberay_pods import HEAD_PORT, KUBERAY_VERSION, plan_pods

HEAD_ADDRESS = f"127.0.0.1:{HEAD_PORT}"

#: Spec overrides per layout (on top of ``harness.base_spec``). gpusPerNode = what this one host has.
LAYOUTS: dict[str, dict[str, Any]] = {
    # (a) 1 trainer pod x 1 GPU + 1 engine pod, TP=1 (GPU 0 -> trainer pod, GPU 1 -> engine pod), NCCL
    "separate-nccl": {"placement": {"mode": "separate", "gpusPerNode": 2}, "weightSync": {"backend": "nccl"},
                      "rollout": {"gpuMemoryUtilization": 0.5}},
    # (b) 1 colocated pod (trainer worker + engine share its GPU), CUDA IPC, sleep/wake (the default)
    "colocated-ipc": {"placement": {"mode": "colocated", "gpusPerNode": 2}, "weightSync": {"backend": "ipc"},
                      "rollout": {"gpuMemoryUtilization": 0.3}},
    # (c) vLLM's rlhf_nccl example's layout (3 GPUs): a trainer pod x 1 GPU + one engine pod of 2 GPUs holding
    # one TP=2 engine, NCCL in the kernel format (each TP worker its own shard)
    "separate-nccl-tp2": {"placement": {"mode": "separate", "gpusPerNode": 2}, "weightSync": {"backend": "nccl"},
                          "rollout": {"tensorParallelSize": 2, "gpuMemoryUtilization": 0.5}},
    # (c') the same with vLLM's own custom all-reduce instead of FlashInfer's (whose module a fresh container
    # compiles on first use); run it before (c) on a fresh machine to see both starts
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
    """``harness.build_model`` in a child process (no CUDA context left in this one), cached on disk."""
    meta = path / "rendered_model.json"
    if meta.exists():
        return {**json.loads(meta.read_text()), "cached": True}
    t = time.perf_counter()
    code = ("import json,sys; sys.path[:0]=[sys.argv[1], sys.argv[2]]; from harness import build_model; "
            "r=build_model(__import__('pathlib').Path(sys.argv[3]), sys.argv[4], sys.argv[5]=='gpu'); "
            "open(sys.argv[3]+'/rendered_model.json','w').write(json.dumps(r))")
    benv = dict(env)
    if not cpu:
        benv["CUDA_VISIBLE_DEVICES"] = "0"
    subprocess.run([sys.executable, "-c", code, str(ROOT), str(REPO / "operator"), str(path), name,
                    "cpu" if cpu else "gpu"], env=benv, check=True, timeout=600)
    return {**json.loads(meta.read_text()), "build_s": time.perf_counter() - t, "cached": False}


def make_spec(layout: str, model_path: str, args: argparse.Namespace) -> dict[str, Any]:
    from harness import base_spec, merge

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
@dataclass
class Run:
    """One layout's run: where it works and writes, and its result (written again after each stage)."""
    layout: str
    args: argparse.Namespace
    work: Path
    res_file: Path
    log_file: Path
    host_env: dict[str, str]
    result: dict[str, Any]

    @property
    def stages(self) -> dict[str, float]:
        return self.result["stages_s"]

    def save(self) -> None:
        self.res_file.write_text(json.dumps(self.result, indent=1, default=str))

    def say(self, msg: str) -> None:
        print(f"[{self.layout}] {msg}", flush=True)


def run_layout(layout: str, args: argparse.Namespace, command: str, out: Path) -> dict[str, Any]:
    """Render the layout's RayJob, start its pods' Ray nodes on this host, check them, run the driver; the result
    (also a failure's) is written to ``<out>/rendered_<layout>_<model>.json``."""
    model_name = "tiny" if args.cpu else args.model
    work = Path(args.work) / layout
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True, exist_ok=True)
    run = Run(layout, args, work, out / f"rendered_{layout}_{model_name}.json",
              out / f"rendered_{layout}_{model_name}.driver.log", one_host_env(work), {
                  "layout": layout, "model_name": model_name, "device_kind": args.kind,
                  "date": datetime.now(UTC).isoformat(timespec="seconds"), "command": command, "status": "running",
                  "host_gpus": host_gpus(), "kuberay_version_emulated": KUBERAY_VERSION})
    run.result["one_host_env"] = {"RAY_AUTH_MODE": run.host_env["RAY_AUTH_MODE"]}
    run.result["stages_s"] = {}
    started_ray = False
    try:
        run.result["versions"] = versions()
        ray_job, pods = render(run, model_name)
        run.result["ray_stop_before"] = ray_stop(run.host_env)
        started_ray = True
        start_nodes(run, pods)
        head_env = check_nodes(run, pods)
        rc = run_driver(run, ray_job, pods, head_env)
        if rc is None:
            run.result["status"], run.result["error"] = "timeout", f"driver still running after {args.timeout:.0f}s"
        elif rc != 0:
            run.result["status"] = "failed"
            run.result["error"] = f"driver exit {rc}: " + (run.result.get("driver_error") or "see driver_log_tail")
        else:
            run.result["status"] = "ok"
    except BaseException as e:  # noqa: BLE001 - a failure is a result too
        run.result["status"] = "failed"
        run.result["error"] = f"{type(e).__name__}: {e}"[:4000]
        run.result["traceback"] = traceback.format_exc()[-6000:]
        print(run.result["traceback"], flush=True)
    finally:
        finish(run, started_ray)
    return run.result


def one_host_env(work: Path) -> dict[str, str]:
    """This host's environment for the pods' processes: no Ray address or GPU list of its own, ``ray`` on PATH,
    and token auth as a fresh pod has it.

    A pod starts without ``~/.ray/auth_token``; this host may hold one left by an earlier ``ray.init()`` (Ray
    writes it and turns token auth on for local clusters). With RAY_AUTH_MODE unset, ``ray start --head`` turns
    token auth on when that file exists while a worker's ``ray start --address`` stays 'disabled', so no worker
    could join (InvalidAuthToken). What a fresh pod's head does: disabled. The rendered env (spec.env) still wins
    where it sets RAY_AUTH_MODE."""
    host_env = dict(os.environ)
    host_env.pop("RAY_ADDRESS", None)
    host_env.pop("CUDA_VISIBLE_DEVICES", None)
    host_env["PATH"] = f"{ray_shim(work)}:{host_env.get('PATH', '')}"
    host_env.setdefault("RAY_AUTH_MODE", "disabled")
    return host_env


def versions() -> dict[str, str]:
    """Ray's, torch's, Python's and vLLM's versions (an import that fails is said instead)."""
    out: dict[str, str] = {}
    try:
        import ray
        import torch

        out.update(ray=ray.__version__, torch=torch.__version__, python=sys.version.split()[0])
        import vllm

        out["vllm"] = vllm.__version__
    except Exception as e:  # noqa: BLE001
        out["import_error"] = repr(e)
    return out


def render(run: Run, model_name: str) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """1. the model and the spec; 2. the RayJob and ConfigMap rendered with the operator's code, and its pods."""
    from rlhf_api.models import RLHFJobSpec
    from rlhf_operator.render import Job, render_config_map, render_ray_job
    from rlhf_runtime.infra.placement import compute_layout

    model_path = Path(run.args.work) / "models" / model_name
    model_path.mkdir(parents=True, exist_ok=True)
    t = time.perf_counter()
    run.result["model"] = build_model_cached(model_name, model_path, run.args.cpu, run.host_env)
    run.stages["model_s"] = time.perf_counter() - t
    spec = make_spec(run.layout, str(model_path), run.args)
    run.result["spec"] = spec
    job = Job(name=f"rendered-{run.layout}", namespace="bench", uid=str(uuid.uuid4()),
              spec=RLHFJobSpec.model_validate(spec))
    ray_job, config_map = render_ray_job(job), render_config_map(job)
    run.result["rendered"] = rendered_record(ray_job, config_map)
    pods = plan_pods(ray_job, config_map, run.work, len(run.result["host_gpus"]), run.args.cpu, HEAD_ADDRESS)
    run.result["gpu_split"] = {p["pod"]: p["cuda_visible_devices"] for p in pods}
    run.result["pods"] = pods
    run.result["layout_needs"] = compute_layout(job.spec).totals()
    run.save()
    run.say(f"rendered {len(pods)} pods; GPU split {run.result['gpu_split']}")
    return ray_job, pods


def rendered_record(ray_job: dict[str, Any], config_map: dict[str, Any]) -> dict[str, Any]:
    """What the result keeps of the render: each group's rayStartParams and resources, the entrypoint, the
    operator's base env and both objects."""
    from rlhf_operator.render import BASE_ENV

    cluster = ray_job["spec"]["rayClusterSpec"]
    return {
        "ray_start_params": {"head": cluster["headGroupSpec"]["rayStartParams"],
                             **{g["groupName"]: g["rayStartParams"] for g in cluster["workerGroupSpecs"]}},
        "group_resources": {g["groupName"]: g.get("resources")
                            for g in cluster["workerGroupSpecs"] if g.get("resources")},
        "entrypoint": ray_job["spec"]["entrypoint"], "base_env": BASE_ENV, "ray_job": ray_job,
        "config_map": config_map,
    }


def pod_env(host_env: dict[str, str], pod: dict[str, Any]) -> dict[str, str]:
    """The host's env with the pod's container env over it (no CUDA_VISIBLE_DEVICES where the pod has no GPUs to
    split: the CPU smoke test)."""
    env = {**host_env, **pod["env"]}
    if pod["cuda_visible_devices"] is None:
        env.pop("CUDA_VISIBLE_DEVICES", None)
    return env


def start_nodes(run: Run, pods: list[dict[str, Any]]) -> None:
    """3. each pod's ``ray start`` as the pod would run it (through ``/bin/bash -c --``), in order, head first."""
    t = time.perf_counter()
    for p in pods:
        proc = subprocess.run(["/bin/bash", "-c", "--", p["command"]], env=pod_env(run.host_env, p),
                              capture_output=True, text=True, timeout=180, check=False)
        p["rc"] = proc.returncode
        p["output_tail"] = (proc.stdout + proc.stderr)[-2500:]
        run.say(f"{p['pod']}: ray start rc={proc.returncode} (CUDA_VISIBLE_DEVICES={p['cuda_visible_devices']!r})")
        if proc.returncode != 0:
            raise RuntimeError(f"ray start of pod {p['pod']} failed (rc {proc.returncode}): "
                               f"{(proc.stdout + proc.stderr)[-1500:]}")
    run.stages["ray_start_s"] = time.perf_counter() - t


def check_nodes(run: Run, pods: list[dict[str, Any]]) -> dict[str, str]:
    """The Ray nodes registered: one per pod, offering what the runtime's placement groups ask for. Returns the
    head pod's env."""
    head_env = pod_env(run.host_env, pods[0])
    q = subprocess.run([sys.executable, "-c", NODES_SNIPPET, str(len(pods)), HEAD_ADDRESS], env=head_env,
                       capture_output=True, text=True, timeout=180, check=False)
    line = next((x for x in q.stdout.splitlines() if x.startswith("NODES_JSON ")), None)
    if line is None:
        raise RuntimeError(f"could not list the Ray nodes: {(q.stdout + q.stderr)[-1500:]}")
    seen = json.loads(line[len("NODES_JSON "):])
    run.result["ray_nodes"], run.result["cluster_resources"] = seen["nodes"], seen["cluster_resources"]
    need = run.result["layout_needs"]
    missing = {k: v for k, v in need.items() if seen["cluster_resources"].get(k, 0) + 1e-9 < v}
    run.result["layout_fits_cluster"] = not missing
    run.save()
    run.say(f"{len(seen['nodes'])} Ray nodes; cluster resources "
            f"{ {k: v for k, v in seen['cluster_resources'].items() if not k.startswith('node:')} }")
    if len(seen["nodes"]) != len(pods):
        raise RuntimeError(f"{len(seen['nodes'])} Ray nodes registered, the RayJob describes {len(pods)} pods")
    if missing:
        raise RuntimeError(f"the rendered Ray cluster lacks what the runtime's placement groups ask for: {missing} "
                           f"(cluster: {seen['cluster_resources']})")
    return head_env


def run_driver(run: Run, ray_job: dict[str, Any], pods: list[dict[str, Any]], head_env: dict[str, str]) -> int | None:
    """4. the driver, as KubeRay's entrypoint on the head pod, with ``--no-report`` and ``--progress-file``; its
    reports into the result. Returns its exit code, None when it ran past ``--timeout`` (then killed)."""
    entry = shlex.split(pods[0]["_mapped_entrypoint"])
    exe = [sys.executable if entry[0] in ("python", "python3") else entry[0], *entry[1:]]
    progress = run.work / "progress.jsonl"
    driver_cmd = [*exe, "--no-report", "--progress-file", str(progress)]
    run.result["driver"] = {"rendered_entrypoint": ray_job["spec"]["entrypoint"], "argv": driver_cmd,
                            "command": " ".join(shlex.quote(x) for x in driver_cmd), "env_from": pods[0]["pod"],
                            "RAY_ADDRESS": HEAD_ADDRESS}
    run.save()
    t = time.perf_counter()
    with open(run.log_file, "wb") as f:
        proc = subprocess.Popen(driver_cmd, env={**head_env, "RAY_ADDRESS": HEAD_ADDRESS}, cwd=str(run.work),
                                stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = proc.wait(timeout=run.args.timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            rc = None
    run.stages["driver_s"] = time.perf_counter() - t
    run.result["driver"].update(rc=rc, seconds=run.stages["driver_s"], timed_out=rc is None)
    run.say(f"driver exit {rc} after {run.stages['driver_s']:.0f}s")
    collect(run.result, progress, run.log_file)
    return rc


def finish(run: Run, started_ray: bool) -> None:
    """5. every Ray node stopped, the driver log cut to its tail, the result written."""
    if started_ray:
        run.result["ray_stop"] = ray_stop(run.host_env)
    for p in run.result.get("pods", []):
        p.pop("_mapped_entrypoint", None)
    if run.log_file.exists() and run.log_file.stat().st_size > 200_000:  # keep the tail only
        data = tail(run.log_file, 200_000)
        run.log_file.write_text("[... head of the log cut ...]\n" + data)
    run.save()


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
    p.add_argument("--out", default=str(ROOT / "results" / "learning" / "rendered"))
    p.add_argument("--work", default="/tmp/rlhf-rendered")
    p.add_argument("--model", default="qwen3-1.7b", help="a harness.MODELS name (GPU runs)")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--prompts", type=int, default=0, help="prompts per step (default: harness.base_spec's)")
    p.add_argument("--max-tokens", type=int, default=0, help="sampling.maxTokens (default: harness.base_spec's)")
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
