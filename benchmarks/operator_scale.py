#!/usr/bin/env python3
"""Operator at scale: N RLHFJobs on the real local control plane (KWOK GPU nodes, the real KubeRay operator).

One run measures one N (``--jobs``), on one machine, with the operator as a real process:

1. create: N RLHFJobs created at ``--rate`` jobs/s (one CustomObjectsApi create each, from a pacing loop; the
   time is taken right before each call). Watches started before the first create (RLHFJobs, RayJobs,
   RayClusters) time, per job, create -> RayJob ADDED, create -> status.phase Provisioning (or later) and
   create -> Running, and KubeRay's RayJob ADDED -> RayCluster ADDED, all as receive times of watch events.
2. peer: once our jobs are Running, the same number of RayJobs (copies of those the operator rendered: name,
   labels, spec) created directly in a second namespace at the same rate; KubeRay's create RayJob ->
   RayCluster ADDED, same watch method. ratio = our create -> RayJob over KubeRay's create -> RayCluster; the
   same from the audit log's timestamps (create received -> child created), free of any client's lag.
   The peer gets as many KWOK nodes again (its pods run as ours do); it is deleted (timed too) and its nodes
   removed before the steady state.
3. the operator's API requests per job during the create phase (apiserver audit log), its RSS and CPU time.
4. steady state: a ``--steady`` s window with every job Running: the operator's requests and writes.
5. duplicate RayClusters (a RayJob owning more than one RayCluster not being deleted) at the end of the steady
   state and during deletion; RayClusters whose RayJob is gone once deletion finished.
6. deletion: ``kubectl delete rlhfjobs --all --wait=false`` -> no RLHFJob, RayJob, RayCluster or job pod left,
   with counts every 10 s.

    .venv/bin/python benchmarks/operator_scale.py --jobs 10      # ~6 min; writes results/operator/operator_scale_10.json
    .venv/bin/python benchmarks/operator_scale.py --jobs 100     # ~10 min; results/operator/operator_scale_100.json
    .venv/bin/python benchmarks/operator_scale.py --jobs 1000 --steady 120 --peer-until clusters \
        --converge-timeout 1200 --delete-timeout 900   # the peer waits for its RayClusters only, not Running

Each run starts a fresh cluster in ``--dir`` (default /tmp/rlhf-scale-bench) and stops it at the end; KWOK
nodes (8 GPUs, 110 pods) are sized for every job's pods plus 10 % and one node. The job is the smallest that
runs: ``crds/samples/separate-nccl-tp2.yaml`` with one engine of TP1 and no reference group (2 GPUs; head,
trainer, engine and KubeRay's submitter pod).

``--operator-path DIR`` runs the operator from DIR (first on its PYTHONPATH), e.g. a frozen worktree of a
commit: ``git worktree add /tmp/opsnap HEAD`` then ``--operator-path /tmp/opsnap/operator``.

This script runs the phases (``scale_phases.py``) on a fresh cluster and writes the result; the tools they
measure with (watches, the audit log, the operator process, percentiles) are in ``scale_harness.py``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import shlex
import signal
import sys
from pathlib import Path
from typing import Any

import urllib3
from kubernetes import client
from scale_harness import (
    GPUS_PER_NODE,
    OPERATOR_AGENTS,
    audit_creates,
    audit_latencies,
    git_commit,
    kuberay_started,
    localcluster,
    log,
    machine,
    new_api,
    operator_requests,
    ratio,
    request_report,
    start_operator,
    stop_operator,
    usage,
    version_default,
    wait_audit,
    wait_default_sa,
    wait_until,
)
from scale_phases import (
    create_phase,
    delete_phase,
    job_shape,
    node_count,
    peer_phase,
    report_phase,
    steady_phase,
)

REPO = Path(__file__).resolve().parents[1]
DATA_CONFIG_MAP = {"metadata": {"name": "gsm8k-prompts"}, "data": {"prompts.jsonl": '{"prompt": "1+1?"}\n'}}
AUDIT_COVERS = ("the audit policy of hack/localcluster.py logs every write (create/update/patch/delete) and every "
                "request on rlhf.dev and ray.io objects; the operator's reads of other resources (ConfigMaps, "
                "pods, nodes, RBAC objects, CRDs) are not logged, so they are not in these counts")


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--jobs", type=int, required=True, help="N RLHFJobs")
    p.add_argument("--rate", type=float, default=20.0, help="jobs (and peer RayJobs) created per second")
    p.add_argument("--nodes", type=int, default=0, help="KWOK nodes of 8 GPUs (default: every job's pods + 10%% + 1)")
    p.add_argument("--steady", type=float, default=300.0, help="steady-state window, seconds")
    p.add_argument("--converge-timeout", type=float, default=1800.0, help="seconds for every job to run")
    p.add_argument("--delete-timeout", type=float, default=900.0, help="seconds for everything to be deleted")
    p.add_argument("--operator-path", type=Path, default=REPO / "operator",
                   help="put this directory first on the operator's PYTHONPATH (default: the repository's operator/)")
    p.add_argument("--peer-until", choices=("running", "clusters"), default="running",
                   help="the peer phase waits until every peer RayJob is Running (default), or only until every one "
                   "has its RayCluster (enough for the ratio; at N=1000 KubeRay alone needs tens of minutes to Running)")
    p.add_argument("--namespace", default="scale")
    p.add_argument("--dir", type=Path, default=Path("/tmp/rlhf-scale-bench"), help="the local cluster's directory")
    p.add_argument("--out", type=Path, help="default: benchmarks/results/operator/operator_scale_<N>.json")
    return p.parse_args(argv)


def main() -> int:
    a = parse()
    a.operator_path = a.operator_path.resolve()
    out = a.out or REPO / "benchmarks" / "results" / "operator" / f"operator_scale_{a.jobs}.json"
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the finally blocks
    urllib3.disable_warnings()  # the local apiserver's kubeconfig skips TLS verification
    shape = job_shape(a.operator_path)
    nodes = a.nodes or node_count(a.jobs, shape)
    cluster = localcluster.Cluster(a.dir, localcluster.build())
    a.dir.mkdir(parents=True, exist_ok=True)
    proc = None
    failures: list[str] = []
    result = run_header(a, shape, nodes)
    try:
        api = cluster_up(a, cluster, shape, nodes)
        audit_offset = cluster.audit_log.stat().st_size
        proc = start_operator(cluster, a.namespace, a.operator_path, a.dir / "operator.log")
        wait_audit(cluster.audit_log, audit_offset, f"the operator's watch of rlhfjobs in {a.namespace} (audit log)",
                   lambda e: e.get("userAgent", "").startswith("kopf") and e["verb"] == "watch"
                   and (e.get("objectRef") or {}).get("resource") == "rlhfjobs", 120)
        result["operator_at_start"] = usage(proc)
        windows, watches = run_phases(a, api, cluster, proc, nodes, result, failures)
        audit_report(a, cluster.audit_log, audit_offset, windows, result)
        result["watch_errors"] = {f"{a.namespace}/{p}": w["errors"] for p, w in watches.items() if w["errors"]}
        result["failures"] = failures
    finally:
        stop_operator(proc)
        (a.dir / "operator.pid").unlink(missing_ok=True)
        cluster.stop()
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print_table(result)
    log(f"wrote {out}")
    if failures:
        raise SystemExit("; ".join(failures))
    return 0


def run_header(a: argparse.Namespace, shape: dict[str, Any], nodes: int) -> dict[str, Any]:
    """What the result says of the run before it starts: command, machine, versions, the jobs and nodes."""
    return {
        "command": shlex.join(sys.orig_argv),
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "machine": machine(),
        "kuberay_version": version_default("KUBERAY_VERSION"),
        "kubernetes_version": version_default("K8S_VERSION"),
        "operator": {**git_commit(a.operator_path),
                     "env": {k: v for k, v in os.environ.items() if k.startswith("RLHF_")}},
        "jobs": a.jobs, "rate_per_s": a.rate, "peer_until": a.peer_until, "nodes": nodes, "gpus_per_node": GPUS_PER_NODE,
        "job_shape": shape, "namespace": a.namespace,
        "audit_policy_covers": AUDIT_COVERS,
        "operator_requests_are": f"audited requests with a userAgent starting with {' or '.join(OPERATOR_AGENTS)}",
    }


def cluster_up(a: argparse.Namespace, cluster: localcluster.Cluster, shape: dict[str, Any], nodes: int) -> Any:
    """A fresh local cluster with its KWOK nodes and KubeRay running, the jobs' namespace and their data
    ConfigMap. Returns the benchmark's API client."""
    kuberay_log = a.dir / "kuberay-operator.log"
    kuberay_offset = kuberay_log.stat().st_size if kuberay_log.exists() else 0
    log(f"cluster in {a.dir}: {nodes} KWOK nodes x {GPUS_PER_NODE} GPUs for {a.jobs} jobs of "
        f"{shape['gpus']} GPUs / {shape['pods']} pods")
    cluster.up(nodes=nodes, gpus_per_node=GPUS_PER_NODE)
    wait_until("KubeRay's RayJob and RayCluster controllers started (kuberay-operator.log)",
               lambda: kuberay_started(kuberay_log, kuberay_offset), 120)
    api = new_api(cluster.kubeconfig)
    cluster.kubectl("create", "namespace", a.namespace)
    wait_default_sa(api, a.namespace)
    client.CoreV1Api(api).create_namespaced_config_map(a.namespace, DATA_CONFIG_MAP)  # the sample's prompts
    return api


def run_phases(a: argparse.Namespace, api: Any, cluster: localcluster.Cluster, proc: Any, nodes: int,
               result: dict[str, Any], failures: list[str]) -> tuple[dict[str, tuple[float, float]], dict[str, Any]]:
    """Create, peer, steady state, report and delete, in that order, each into ``result`` (a timeout into
    ``failures``). Returns each phase's window (start, end) and the watches of our namespace."""
    ns, peer_ns = a.namespace, f"{a.namespace}-peer"
    created = create_phase(a, api, cluster, ns, proc)
    result["create"] = created["result"]
    if created["timed_out"]:
        failures.append(created["timed_out"])
    t_first = min(created["created"].values())
    t_converged = created["t_converged"]

    peer = peer_phase(a, api, cluster, ns, peer_ns, nodes)
    result["peer"] = peer
    failures += peer["timeouts"]
    ours, theirs = result["create"]["create_to_rayjob_added_s"], peer["create_to_raycluster_added_s"]
    result["ratio"] = {
        "what": "our create RLHFJob -> RayJob ADDED over KubeRay's create RayJob -> RayCluster ADDED (peer)",
        "p50": ratio(ours["p50"], theirs["p50"]), "p99": ratio(ours["p99"], theirs["p99"])}

    steady = steady_phase(a, api, ns, proc, created["watches"])
    result["steady"] = steady["result"]
    reported = report_phase(a, api, ns, created["watches"])
    result["report"] = reported["result"]
    if reported["timed_out"]:
        failures.append(reported["timed_out"])
    deleted = delete_phase(a, api, cluster, ns, proc, created["watches"])
    result["delete"] = deleted["result"]
    if deleted["timed_out"]:
        failures.append(deleted["timed_out"])
    windows = {"create": (t_first, t_converged), "peer": (t_converged, steady["start"]),
               "steady": (steady["start"], steady["end"]), "report": (reported["start"], reported["end"]),
               "delete": (deleted["start"], deleted["end"])}
    return windows, created["watches"]


def audit_report(a: argparse.Namespace, audit_log: Path, offset: int, windows: dict[str, tuple[float, float]],
                 result: dict[str, Any]) -> None:
    """From the audit log: the operator's requests per phase, and the create -> child times of ours and of the
    peer on the apiserver's own clock (their ratio beside the watch-timed one)."""
    log("reading the audit log")
    reqs = operator_requests(audit_log, offset)
    result["create"]["operator_requests"] = request_report(reqs, *windows["create"], a.jobs)
    result["peer"]["our_operator_requests_meanwhile"] = request_report(reqs, *windows["peer"], a.jobs)
    result["steady"]["operator_requests"] = request_report(reqs, *windows["steady"], a.jobs)
    result["report"]["operator_requests"] = request_report(reqs, *windows["report"], a.jobs)
    result["delete"]["operator_requests"] = request_report(reqs, *windows["delete"], a.jobs)
    ours_audit = audit_creates(audit_log, offset, a.namespace)
    peer_audit = audit_creates(audit_log, offset, f"{a.namespace}-peer")
    result["create"]["audit_rlhfjob_received_to_rayjob_created_s"] = audit_latencies(
        ours_audit, "rlhfjob_received", "rayjob_created")
    result["peer"]["audit_rayjob_received_to_raycluster_created_s"] = audit_latencies(
        peer_audit, "rayjob_received", "raycluster_created")
    result["ratio_audit"] = {
        "what": "the same ratio from the apiserver's audit timestamps (create received -> child created)",
        **{q: ratio(result["create"]["audit_rlhfjob_received_to_rayjob_created_s"][q],
                    result["peer"]["audit_rayjob_received_to_raycluster_created_s"][q]) for q in ("p50", "p99")}}


def num(v: float | None, digits: int = 2) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def print_table(r: dict[str, Any]) -> None:
    def row(label: str, s: dict[str, Any] | None) -> None:
        if not s:
            return
        print(f"{label:<52} {num(s['p50'], 3):>8} {num(s['p95'], 3):>8} {num(s['p99'], 3):>8} "
              f"{num(s['max'], 3):>8} {num(s.get('last_s'), 3):>8} {s.get('missing', 0):>4}")

    c, p, st, d = r["create"], r["peer"], r["steady"], r["delete"]
    print(f"\n{r['jobs']} jobs at {r['rate_per_s']}/s on {r['nodes']} KWOK nodes; operator {r['operator']['commit']}, "
          f"KubeRay {r['kuberay_version']}")
    print(f"{'seconds':<52} {'p50':>8} {'p95':>8} {'p99':>8} {'max':>8} {'last':>8} {'miss':>4}")
    row("ours: create RLHFJob -> RayJob ADDED", c["create_to_rayjob_added_s"])
    row("ours: create RLHFJob -> Provisioning", c["create_to_provisioning_s"])
    row("ours: create RLHFJob -> Running", c["create_to_running_s"])
    row("KubeRay (ours): RayJob ADDED -> RayCluster ADDED", c["kuberay_rayjob_added_to_raycluster_added_s"])
    row("peer: create RayJob -> RayJob ADDED", p["create_to_rayjob_added_s"])
    row("peer (KubeRay): create RayJob -> RayCluster ADDED", p["create_to_raycluster_added_s"])
    row("peer (KubeRay): create RayJob -> RayJob Running", p["create_to_rayjob_running_s"])
    row("ours: runtime report -> Ready reason Training", r["report"]["report_to_training_s"])
    row("ours (audit): RLHFJob create received -> RayJob created", c.get("audit_rlhfjob_received_to_rayjob_created_s"))
    row("peer (audit): RayJob create received -> RayCluster created", p.get("audit_rayjob_received_to_raycluster_created_s"))
    print(f"ratio ours/KubeRay: p50 {num(r['ratio']['p50'])}, p99 {num(r['ratio']['p99'])}; from audit times: "
          f"p50 {num((r.get('ratio_audit') or {}).get('p50'))}, p99 {num((r.get('ratio_audit') or {}).get('p99'))}")
    cr = c["operator_requests"]
    print(f"create phase ({cr['window_s']} s): operator {cr['requests_per_job']} requests/job, "
          f"{cr['writes_per_job']} writes/job; RSS {c['operator_at_end']['rss_mib']} MiB, "
          f"CPU {c['operator_at_end']['cpu_s']} s")
    sr = st["operator_requests"]
    print(f"steady ({sr['window_s']} s): operator {sr['requests']} requests ({sr['requests_per_job_per_min']}/job/min), "
          f"{sr['writes']} writes; RSS {st['operator_at_end']['rss_mib']} MiB, CPU {st['operator_cpu_s_per_min']} s/min; "
          f"duplicate RayClusters {st['duplicate_rayclusters_at_end']}")
    print(f"delete: {num(d['delete_s'])} s (peer KubeRay alone {num(p['delete_s'])} s); max RayClusters "
          f"{d['max_rayclusters']}, RayClusters added while deleting {d['rayclusters_added_during_delete']}, "
          f"duplicates max {d['duplicate_rayclusters_max']} / end {d['duplicate_rayclusters_at_end']}, "
          f"orphans {len(d['orphan_rayclusters_at_end'])}")


if __name__ == "__main__":
    raise SystemExit(main())
