#!/usr/bin/env python3
"""`make demo`: the whole product on this machine, watched through `kubectl get rlhfjobs`.

1. A real control plane (etcd, kube-apiserver, scheduler, controller-manager), KWOK GPU nodes and the real
   KubeRay operator (hack/localcluster.py), plus our operator.
2. Two RLHFJobs: the `separate-nccl-tp2` sample (placed on fake H100 nodes; no containers run there, so it
   stays Running with no steps) and a tiny CPU job whose driver really trains.
3. KWOK runs no containers, so the tiny job's driver (what KubeRay would start in the head pod) runs here, with
   the pod's inputs: job.json from the operator's ConfigMap and the job's own ServiceAccount token. It trains a
   tiny Qwen2 with GRPO on real Ray + vLLM (CPU) and reports step, tokens/s and sync time into the status.

The cluster stays up afterwards (`export KUBECONFIG=/tmp/rlhf-demo/kubeconfig`); `make demo-down` stops it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "hack"))
import localcluster

from rlhf_runtime.tiny import tiny_job_spec

DIR = Path(os.environ.get("RLHF_DEMO_DIR", "/tmp/rlhf-demo"))
NS = "demo"
STEPS = 20


def say(msg: str) -> None:
    print(f"\n\033[1m== {msg}\033[0m", flush=True)


def main() -> int:
    cluster = localcluster.Cluster(DIR, localcluster.build())
    say("starting the local control plane + KWOK GPU nodes + KubeRay")
    cluster.up(nodes=4, gpus_per_node=8)
    print(cluster.kubectl("get", "nodes", "-L", "nvidia.com/gpu.product").stdout)

    say("starting rlhf-operator")
    env = {**os.environ, "KUBECONFIG": str(cluster.kubeconfig), "RLHF_RESYNC_SECONDS": "2"}
    op = subprocess.Popen(
        [sys.executable, "-W", "ignore", "-m", "rlhf_operator.main", "--liveness", ""],
        stdout=open(DIR / "operator.log", "ab"), stderr=subprocess.STDOUT, env=env, start_new_session=True,  # noqa: SIM115
    )
    (DIR / "operator.pid").write_text(str(op.pid))  # `make demo-down` stops it with the rest

    say("building a tiny Qwen2 + tokenizer locally (no hub)")
    model = DIR / "tiny-model"
    subprocess.run(
        [sys.executable, "-c", f"from rlhf_runtime.tiny import build_tiny_model; build_tiny_model({str(model)!r}, seed=0)"],
        check=True, capture_output=True,
    )
    cluster.kubectl("create", "namespace", NS)
    tiny = {"apiVersion": "rlhf.dev/v1alpha1", "kind": "RLHFJob", "metadata": {"name": "tiny-grpo"},
            "spec": tiny_job_spec(model, STEPS)}
    manifest = DIR / "tiny-grpo.yaml"
    manifest.write_text(yaml.safe_dump(tiny, sort_keys=False))
    say(f"kubectl apply -f crds/samples/separate-nccl-tp2.yaml -f {manifest}")
    print(cluster.kubectl("apply", "-n", NS, "-f", str(REPO / "crds/samples/separate-nccl-tp2.yaml"), "-f", str(manifest)).stdout)

    def table() -> str:
        return cluster.kubectl("get", "rlhfjobs", "-n", NS).stdout.rstrip()

    def key(t: str) -> str:  # the table without its AGE column: print only real changes
        return "\n".join(line.rsplit(None, 1)[0] for line in t.splitlines())

    def phase(name: str) -> str:
        out = cluster.kubectl("get", "rlhfjob", name, "-n", NS, "-o", "jsonpath={.status.phase}", check=False)
        return out.stdout

    last = ""

    def watch_until(done, seconds: float, what: str) -> None:
        """Print `kubectl get rlhfjobs` whenever it changes, until ``done()`` or the deadline."""
        nonlocal last
        deadline = time.time() + seconds
        while not done():
            if time.time() > deadline:
                raise SystemExit(f"{what} did not happen within {seconds}s; logs in {DIR}")
            cur = table()
            if key(cur) != last:
                print(cur, flush=True)
                last = key(cur)
            time.sleep(1)

    watch_until(lambda: phase("tiny-grpo") == "Running", 180, "tiny-grpo Running")
    print(table())
    print(cluster.kubectl("get", "pods", "-n", NS, "-o", "wide").stdout)

    say("running the tiny job's driver (real Ray + vLLM on CPU) with the job's own ServiceAccount")
    cm = json.loads(cluster.kubectl("get", "configmap", "tiny-grpo-config", "-n", NS, "-o", "json").stdout)
    config = DIR / "job.json"
    config.write_text(cm["data"]["job.json"])
    kc = cluster.token_kubeconfig(NS, "tiny-grpo-runtime", DIR / "runtime.kubeconfig")
    with open(DIR / "driver.log", "w") as log:
        driver = subprocess.Popen(
            [sys.executable, "-m", "rlhf_runtime.driver", "--config", str(config), "--local", "--kubeconfig", str(kc)],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )
    watch_until(lambda: phase("tiny-grpo") in ("Succeeded", "Failed"), 600, "tiny-grpo finishing")
    driver.wait(timeout=60)
    print(table())
    say("done")
    print(cluster.kubectl("get", "rlhfjob", "tiny-grpo", "-n", NS, "-o", "jsonpath={.status.throughput}").stdout)
    print(f"\nexport KUBECONFIG={cluster.kubeconfig}   # explore; `make demo-down` stops everything")
    return 0 if phase("tiny-grpo") == "Succeeded" else 1


if __name__ == "__main__":
    raise SystemExit(main())
