#!/usr/bin/env python3
"""`make demo`: the whole product on this machine, in real containers, watched through `kubectl get rlhfjobs`.

1. A real control plane (etcd, kube-apiserver, scheduler, controller-manager), KWOK GPU nodes, and real nodes
   (containerd + runc + CNI + kubelet) with cluster DNS and Service routing (hack/localcluster.py
   --real-nodes); KubeRay runs as a pod on a real node. Images (operator, CPU runtime, KubeRay, pause) are
   built here with buildah and imported into the nodes (hack/build-images.sh; cached by content hash).
2. `helm install` of our chart with the local operator image: the operator runs as a pod.
3. Two RLHFJobs: a tiny CPU job whose head, trainer and engine pods really run on the real nodes (KubeRay's
   submitter starts our driver; it trains a tiny Qwen2 with GRPO on Ray + vLLM and patches the status with
   the job's own ServiceAccount token, and logs every step to TensorBoard files on the shared volume:
   `spec.tracking`), and the `separate-nccl-tp2` GPU sample with the prompts ConfigMap it
   names (`gsm8k-prompts`, a few GSM8K-style problems), its trainer and TP=2 engine pods placed on fake H100
   nodes where no container runs: its status says that no runtime has reported.

The cluster stays up afterwards (`export KUBECONFIG=/tmp/rlhf-demo/kubeconfig`); `make demo-down` stops it.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "hack"))
import cpujob
import localcluster
import realnodes

DIR = Path(os.environ.get("RLHF_DEMO_DIR", "/tmp/rlhf-demo"))
NS = "demo"
STEPS = 10
REAL_NODES = int(os.environ.get("RLHF_REAL_NODES", "2"))


#: The GPU sample's data (spec.data.configMap): GSM8K-style problems with their answers.
GSM8K_STYLE = [
    ("A baker makes 24 rolls in the morning and half as many in the afternoon. How many rolls does she make?", "36"),
    ("Tom reads 15 pages a day. How many days does he need for a 180-page book?", "12"),
    ("A ticket costs $8 and a drink $3. How much do 4 tickets and 2 drinks cost, in dollars?", "38"),
    ("A tank holds 60 liters. It is a quarter full. How many liters are needed to fill it?", "45"),
]


def say(msg: str) -> None:
    print(f"\n\033[1m== {msg}\033[0m", flush=True)


def main() -> int:
    cluster = localcluster.Cluster(DIR, localcluster.build())
    say(f"starting the local control plane + KWOK GPU nodes + {REAL_NODES} real nodes + KubeRay (first run: builds images)")
    cluster.up(nodes=4, gpus_per_node=8, real_nodes=REAL_NODES)
    print(cluster.kubectl("get", "nodes", "-o", "wide", "-L", f"nvidia.com/gpu.product,{realnodes.NODE_LABEL}").stdout)

    say("helm install rlhf charts/rlhf-operator (the operator runs as a pod from the local image)")
    cluster.install_operator_chart("rlhf", "rlhf-system")
    print(cluster.kubectl("get", "pods", "-A", "-o", "wide").stdout)

    say("a tiny Qwen2 + tokenizer built locally (no hub), shared with the pods through a hostPath")
    shared = cpujob.make_shared_dir(DIR / "shared")
    cluster.kubectl("create", "namespace", NS, check=False)
    tiny = cpujob.cpu_job("tiny-grpo", cluster.images["runtime-cpu"]["ref"], shared, STEPS)
    # every step's curves as TensorBoard event files on the shared volume (spec.tracking; MLflow and W&B likewise)
    tiny["spec"]["tracking"] = {"tensorboard": {"volume": "shared", "path": f"{cpujob.SHARED_MOUNT}/tb"},
                                "samplesEveryNSteps": 5}
    manifest = DIR / "tiny-grpo.yaml"
    manifest.write_text(yaml.safe_dump(tiny, sort_keys=False))
    # The GPU sample as shipped, with every pod (its head and submitter too) kept on the KWOK nodes: its GPU
    # image is not on this machine, so on a real node those pods could only fail to pull it.
    gpu = yaml.safe_load((REPO / "crds/samples/separate-nccl-tp2.yaml").read_text())
    gpu["spec"].setdefault("scheduling", {})["nodeSelector"] = {"type": "kwok"}
    gpu_manifest = DIR / "separate-nccl-tp2.yaml"
    gpu_manifest.write_text(yaml.safe_dump(gpu, sort_keys=False))
    data = gpu["spec"]["data"]["configMap"]
    say(f"the GPU sample's prompts: ConfigMap {data['name']} (JSON lines, key {data['key']})")
    lines = "".join(json.dumps({"prompt": p, "answer": a}) + "\n" for p, a in GSM8K_STYLE)
    print(cluster.kubectl("create", "configmap", data["name"], "-n", NS, f"--from-literal={data['key']}={lines}",
                          check=False).stdout)
    say(f"kubectl apply -f {gpu_manifest} -f {manifest}")
    print(cluster.kubectl("apply", "-n", NS, "-f", str(gpu_manifest), "-f", str(manifest)).stdout)

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

    watch_until(lambda: phase("tiny-grpo") in ("Succeeded", "Failed") and phase(gpu["metadata"]["name"]) == "Running",
                1200, "tiny-grpo finishing and the GPU sample placed")
    print(table())
    say("where the pods ran: the GPU sample's on the KWOK H100 nodes (KubeRay deletes the tiny job's cluster once "
        "it finished)")
    print(cluster.kubectl("get", "pods", "-n", NS, "-o", "wide", "-L", "ray.io/group").stdout)
    for name in ("tiny-grpo", gpu["metadata"]["name"]):
        out = cluster.kubectl("get", "rlhfjob", name, "-n", NS, "-o",
                              "jsonpath={.status.phase}: {.status.message} {.status.throughput}", check=False)
        print(f"{name}: {out.stdout}")
    tracking = cluster.kubectl("get", "rlhfjob", "tiny-grpo", "-n", NS, "-o", "jsonpath={.status.tracking}",
                               check=False).stdout
    say(f"tiny-grpo's curves (status.tracking {tracking}): TensorBoard event files on the shared volume")
    for f in sorted((shared / "tb").rglob("events.out.tfevents.*")):
        print(f"{f} ({f.stat().st_size} bytes)")
    print(f"open them: .venv/bin/tensorboard --logdir {shared / 'tb'}   # then http://localhost:6006")
    print(f"\nexport KUBECONFIG={cluster.kubeconfig}   # explore; `make demo-down` stops everything")
    return 0 if phase("tiny-grpo") == "Succeeded" else 1


if __name__ == "__main__":
    raise SystemExit(main())
