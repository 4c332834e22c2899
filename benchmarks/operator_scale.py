#!/usr/bin/env python3
"""Operator at scale on the real local control plane: N RLHFJobs on KWOK GPU nodes.

Measures (one run, same machine): seconds from `kubectl apply` of N jobs to all Running (p50/p90/max per
job), the operator's API requests per job per minute at steady state (from the apiserver's audit log), and
its writes at steady state (should be 0: status is only written when it changes).

    .venv/bin/python benchmarks/operator_scale.py --jobs 30 --nodes 16     # writes results/operator_scale.json
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "hack"))
import localcluster

NS = "scale"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--jobs", type=int, default=30)
    p.add_argument("--nodes", type=int, default=16)
    p.add_argument("--resync", type=float, default=10.0, help="operator resync seconds")
    p.add_argument("--steady", type=float, default=60.0, help="steady-state observation window, seconds")
    p.add_argument("--dir", type=Path, default=Path("/tmp/rlhf-scale"))
    p.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "operator_scale.json")
    a = p.parse_args()

    cluster = localcluster.Cluster(a.dir, localcluster.build())
    cluster.up(nodes=a.nodes, gpus_per_node=8)
    env = {**os.environ, "KUBECONFIG": str(cluster.kubeconfig), "RLHF_RESYNC_SECONDS": str(a.resync)}
    with open(a.dir / "operator.log", "ab") as log:
        op = subprocess.Popen([sys.executable, "-m", "rlhf_operator.main", "--liveness", "", "-n", NS],
                              stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    (a.dir / "operator.pid").write_text(str(op.pid))
    try:
        cluster.kubectl("create", "namespace", NS)
        base = yaml.safe_load((REPO / "crds/samples/separate-nccl-tp2.yaml").read_text())
        docs = []
        for i in range(a.jobs):
            job = json.loads(json.dumps(base))
            job["metadata"]["name"] = f"job-{i:03d}"
            docs.append(job)
        t0 = time.time()
        cluster.kubectl("apply", "-n", NS, "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List", "items": docs}))
        running_at: dict[str, float] = {}
        deadline = t0 + 600
        while len(running_at) < a.jobs and time.time() < deadline:
            items = json.loads(cluster.kubectl("get", "rlhfjobs", "-n", NS, "-o", "json").stdout)["items"]
            for it in items:
                if (it.get("status") or {}).get("phase") == "Running":
                    running_at.setdefault(it["metadata"]["name"], time.time() - t0)
            time.sleep(0.5)
        if len(running_at) < a.jobs:
            raise SystemExit(f"only {len(running_at)}/{a.jobs} jobs Running after 600 s")
        lat = sorted(running_at.values())

        def converged() -> bool:  # Running and Kopf's finalizer on every job (it retries on 422 until then)
            items = json.loads(cluster.kubectl("get", "rlhfjobs", "-n", NS, "-o", "json").stdout)["items"]
            return all("rlhf.dev/finalizer" in (it["metadata"].get("finalizers") or []) for it in items)

        while not converged() and time.time() < deadline:
            time.sleep(0.5)
        converged_s = time.time() - t0

        # Steady state: every job Running, nothing changing. Count the operator's requests in a window.
        start = dt.datetime.now(dt.UTC).isoformat()
        end_at = time.time() + a.steady
        while time.time() < end_at:
            time.sleep(1)
        reqs = writes = 0
        kinds: dict[str, int] = {}
        for line in cluster.audit_log.read_text().splitlines():
            e = json.loads(line)
            if e["stageTimestamp"] < start or not e.get("userAgent", "").startswith(("kopf", "OpenAPI-Generator")):
                continue
            if (e.get("objectRef") or {}).get("namespace") != NS:
                continue
            reqs += 1
            ref = e.get("objectRef") or {}
            key = f'{e["verb"]} {ref.get("resource")}{"/" + ref["subresource"] if ref.get("subresource") else ""}'
            kinds[key] = kinds.get(key, 0) + 1
            writes += e["verb"] in ("create", "update", "patch", "delete")
    finally:
        cluster.stop()
    result = {
        "command": " ".join([".venv/bin/python", "benchmarks/operator_scale.py", *sys.argv[1:]]),
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores (local control plane, KWOK nodes)",
        "jobs": a.jobs,
        "nodes": a.nodes,
        "gpus": a.nodes * 8,
        "resync_seconds": a.resync,
        "apply_to_running_s": {"p50": statistics.median(lat), "p90": lat[int(0.9 * (len(lat) - 1))], "max": lat[-1]},
        "apply_to_converged_s": converged_s,
        "steady_window_s": a.steady,
        "steady_operator_requests_per_job_per_min": reqs / a.jobs / (a.steady / 60),
        "steady_operator_writes": writes,
        "steady_operator_requests_by_kind": dict(sorted(kinds.items())),
        "note": "requests are the operator's audited requests to rlhf.dev and ray.io objects in the namespace "
        "(the audit policy logs those resources and every write)",
    }
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
