"""The phases of the operator-at-scale benchmark (``operator_scale.py``), in the order it runs them: create our
jobs and wait until they run, the same RayJobs made directly for KubeRay alone (peer), a steady-state window, the
runtime's first report, and deletion; and the job they all use."""

from __future__ import annotations

import collections
import datetime as dt
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

import yaml
from kubernetes import client
from scale_harness import (
    GPUS_PER_NODE,
    achieved_rate,
    add_nodes,
    added,
    anything_left,
    clusters_per_rayjob,
    counts,
    events,
    first_time,
    latencies,
    log,
    objects,
    paced_creates,
    start_watch,
    stats,
    usage,
    wait_default_sa,
    wait_until,
)

REPO = Path(__file__).resolve().parents[1]
SAMPLE = "separate-nccl-tp2"
#: The smallest job that runs: one trainer GPU and one engine of TP1, no reference group (klCoef 0).
SAMPLE_CHANGES = {"rollout.tensorParallelSize": 1, "algorithm.klCoef": 0}
PODS_PER_NODE = 110
HEADROOM = 0.1
PROVISIONED = ("Provisioning", "Running", "Succeeded")


# ------------------------------------------------------------------------------------------------- jobs
def job_body(i: int) -> dict[str, Any]:
    job = yaml.safe_load((REPO / "crds" / "samples" / f"{SAMPLE}.yaml").read_text())
    job["metadata"] = {"name": f"job-{i:04d}"}
    for path, value in SAMPLE_CHANGES.items():
        *parents, leaf = path.split(".")
        node = job["spec"]
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return job


def job_shape(operator_path: Path) -> dict[str, Any]:
    """GPUs and pods of one job (head + worker groups + KubeRay's submitter), from the operator's own render."""
    sys.path.insert(0, str(operator_path))
    from rlhf_api import models
    from rlhf_operator import render

    spec = models.RLHFJobSpec.model_validate(job_body(0)["spec"])
    groups = render.worker_groups(spec)
    return {"sample": SAMPLE, "changes": SAMPLE_CHANGES, "gpus": sum(g.replicas * g.gpus for g in groups),
            "pods": 2 + sum(g.replicas for g in groups),
            "groups": {g.name: {"replicas": g.replicas, "gpus": g.gpus} for g in groups}}


def node_count(jobs: int, shape: dict[str, Any]) -> int:
    """KWOK nodes (8 GPUs, 110 pods each) for every job's pods, plus 10 % and one node of headroom."""
    need = max(jobs * shape["gpus"] / GPUS_PER_NODE, jobs * shape["pods"] / PODS_PER_NODE)
    return math.ceil(need * (1 + HEADROOM)) + 1


# ---------------------------------------------------------------------------------------------- phases
def create_phase(a, api, cluster, ns, proc) -> dict[str, Any]:
    """Create the jobs at the rate, then wait until every job is Running."""
    w = {p: start_watch(cluster.kubeconfig, ns, p) for p in ("rlhfjobs", "rayjobs", "rayclusters")}
    bodies = {b["metadata"]["name"]: b for b in (job_body(i) for i in range(a.jobs))}
    custom = client.CustomObjectsApi(api)
    log(f"creating {a.jobs} RLHFJobs in {ns} at {a.rate}/s")
    created, call_s = paced_creates(list(bodies), a.rate, lambda n: custom.create_namespaced_custom_object(
        "rlhf.dev", "v1alpha1", ns, "rlhfjobs", bodies[n]))
    t_created = time.time()
    last_log = [0.0]

    def converged() -> bool:
        done = sum(1 for s in objects(w["rlhfjobs"]).values() if s["phase"] == "Running")
        if time.time() - last_log[0] >= 15:
            last_log[0] = time.time()
            log(f"  {done}/{a.jobs} jobs Running")
        return done == a.jobs

    timed_out = None
    try:
        wait_until(f"all {a.jobs} RLHFJobs Running", converged, a.converge_timeout)
    except SystemExit as e:  # measured, not fatal: report what converged
        timed_out = str(e)
        log(timed_out)
    t_converged = time.time()
    use = usage(proc)
    running = first_time(w["rlhfjobs"], lambda _t, s: s["phase"] == "Running")
    rayjob_added = first_time(w["rayjobs"], added)
    cluster_added = first_time(w["rayclusters"], added, key="owner")
    per_rayjob = clusters_per_rayjob(w["rayclusters"])
    return {
        "watches": w, "created": created, "t_converged": t_converged, "usage": use, "timed_out": timed_out,
        "result": {
            "create_calls_s": round(t_created - min(created.values()), 2),
            "achieved_rate_per_s": achieved_rate(created),
            "create_call_s": stats(call_s),
            "create_to_rayjob_added_s": latencies(created, rayjob_added),
            "create_to_provisioning_s": latencies(created, first_time(w["rlhfjobs"], lambda _t, s: s["phase"] in PROVISIONED)),
            "create_to_running_s": latencies(created, running),
            "kuberay_rayjob_added_to_raycluster_added_s": latencies(rayjob_added, cluster_added),
            "converged": timed_out is None,
            "converged_s": round(t_converged - min(created.values()), 1),
            "jobs_running": len(running),
            "jobs_with_finalizer": sum(1 for s in objects(w["rlhfjobs"]).values() if s["finalized"]),
            "rayclusters_added": sum(per_rayjob.values()),
            "rayjobs_with_more_than_one_raycluster_added": sum(1 for n in per_rayjob.values() if n > 1),
            "operator_at_end": use,
        },
    }


def report_phase(a, api, ns, watches) -> dict[str, Any]:
    """What a runtime's first report does: each job's status patched as the runtime patches it (state Running,
    step 1, its Ray cluster, heartbeat and progress now), at the creation rate; per job the seconds from the patch
    call to the first watch event where the job's Ready reason is the operator's verdict on it (Training), i.e.
    what `kubectl get rlhfjobs` then shows."""
    clusters = {s["name"]: s["cluster"] for s in objects(watches["rayjobs"]).values()}
    custom = client.CustomObjectsApi(api)
    now = dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")

    def report(name: str) -> None:
        custom.patch_namespaced_custom_object_status("rlhf.dev", "v1alpha1", ns, "rlhfjobs", name, {"status": {
            "step": 1, "runtime": {"state": "Running", "rayCluster": clusters.get(name), "heartbeatTime": now,
                                   "progressTime": now}}})

    names = sorted(clusters)
    log(f"reporting as the runtime for {len(names)} jobs at {a.rate}/s")
    start = time.time()
    sent, _ = paced_creates(names, a.rate, report)

    def seen() -> dict[str, float]:
        return first_time(watches["rlhfjobs"], lambda _t, s: s["ready_reason"] == "Training", after=start)

    timed_out = None
    try:
        wait_until("every job's Ready reason Training after its report", lambda: len(seen()) == len(names), 300)
    except SystemExit as e:
        timed_out = str(e)
    return {"timed_out": timed_out, "start": start, "end": time.time(),
            "result": {"report_to_training_s": latencies(sent, seen()), "jobs": len(names)}}


def peer_phase(a, api, cluster, ns, peer_ns, nodes) -> dict[str, Any]:
    """KubeRay alone: the operator's RayJobs, created directly in ``peer_ns`` at the same rate."""
    rendered = client.CustomObjectsApi(api).list_namespaced_custom_object("ray.io", "v1", ns, "rayjobs")["items"]
    bodies = {j["metadata"]["name"]: {
        "apiVersion": j["apiVersion"], "kind": j["kind"],
        "metadata": {"name": j["metadata"]["name"], "namespace": peer_ns, "labels": j["metadata"].get("labels") or {}},
        "spec": j["spec"]} for j in rendered}
    # The pods' ServiceAccounts (the operator makes one per job), so that KubeRay's pods are admitted as in ours;
    # and as many nodes again, so that they run (KubeRay then does the same work up to Running).
    accounts = sorted({t["spec"].get("serviceAccountName") for b in bodies.values() for t in pod_templates(b["spec"])} - {None})
    cluster.kubectl("create", "namespace", peer_ns)
    wait_default_sa(api, peer_ns)
    cluster.kubectl("apply", "-n", peer_ns, "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List", "items": [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": n}} for n in accounts]}))
    log(f"peer: {nodes} more KWOK nodes")
    add_nodes(cluster, api, nodes, "peer-node")
    w = {p: start_watch(cluster.kubeconfig, peer_ns, p) for p in ("rayjobs", "rayclusters")}
    custom = client.CustomObjectsApi(api)
    log(f"peer: creating {len(bodies)} RayJobs in {peer_ns} at {a.rate}/s")
    created, call_s = paced_creates(sorted(bodies), a.rate, lambda n: custom.create_namespaced_custom_object(
        "ray.io", "v1", peer_ns, "rayjobs", bodies[n]))
    timeouts = []

    def all_of(what: str, done) -> None:
        try:
            wait_until(f"peer: {what}", done, a.converge_timeout)
        except SystemExit as e:
            timeouts.append(str(e))
            log(str(e))

    all_of(f"{len(bodies)} RayClusters ADDED", lambda: len(first_time(w["rayclusters"], added, key="owner")) >= len(bodies))
    if a.peer_until == "running":
        all_of(f"{len(bodies)} RayJobs Running", lambda: sum(
            1 for s in objects(w["rayjobs"]).values() if s["phase"] == "Running") >= len(bodies))
    rayjob_added = first_time(w["rayjobs"], added)
    cluster_added = first_time(w["rayclusters"], added, key="owner")
    _n, dups, _o = counts(api, peer_ns, ("rayjobs", "rayclusters"))
    log("peer: deleting its RayJobs")
    t_delete = time.time()
    cluster.kubectl("delete", "rayjobs", "--all", "-n", peer_ns, "--wait=false")
    all_of("no RayJob, RayCluster or pod left", lambda: not anything_left(api, peer_ns, ("rayjobs", "rayclusters", "pods")))
    t_deleted = time.time()
    node_names = [f"peer-node-{i}" for i in range(nodes)]
    cluster.kubectl("delete", "nodes", *node_names, "--wait=false")
    wait_until("peer nodes deleted", lambda: not [n for n in client.CoreV1Api(api).list_node().items
                                                 if n.metadata.name in node_names], 300)
    return {
        "namespace": peer_ns,
        "nodes_added": nodes,
        "achieved_rate_per_s": achieved_rate(created),
        "create_call_s": stats(call_s),
        "create_to_rayjob_added_s": latencies(created, rayjob_added),
        "create_to_raycluster_added_s": latencies(created, cluster_added),
        "rayjob_added_to_raycluster_added_s": latencies(rayjob_added, cluster_added),
        "create_to_rayjob_running_s": latencies(created, first_time(w["rayjobs"], lambda _t, s: s["phase"] == "Running")),
        "duplicate_rayclusters_when_running": dups,
        "delete_s": round(t_deleted - t_delete, 1) if not timeouts else None,
        "timeouts": timeouts,
    }


def pod_templates(spec: dict[str, Any]) -> list[dict[str, Any]]:
    rc = spec.get("rayClusterSpec") or {}
    groups = [rc.get("headGroupSpec") or {}, *(rc.get("workerGroupSpecs") or [])]
    return [g.get("template") or {} for g in groups] + [spec.get("submitterPodTemplate") or {}]


def steady_phase(a, api, ns, proc, watches) -> dict[str, Any]:
    """A window with every job converged: nothing should change; the operator's requests are counted after."""
    before = usage(proc)
    log(f"steady state: {a.steady:.0f} s")
    end = before["at"] + a.steady
    while time.time() < end:
        time.sleep(1)  # the measured window itself
    after = usage(proc)
    changed = {p: collections.Counter(typ for t, typ, _s in events(w) if before["at"] <= t < after["at"])
               for p, w in watches.items()}
    n, dups, _o = counts(api, ns, ("rayjobs", "rayclusters"))
    return {
        "start": before["at"], "end": after["at"],
        "result": {
            "window_s": round(after["at"] - before["at"], 1),
            "watch_events_in_window": {p: dict(c) for p, c in changed.items()},
            "operator_at_start": before,
            "operator_at_end": after,
            "operator_cpu_s_per_min": round((after["cpu_s"] - before["cpu_s"]) / ((after["at"] - before["at"]) / 60), 3),
            "objects_at_end": n,
            "duplicate_rayclusters_at_end": dups,
        },
    }


def delete_phase(a, api, cluster, ns, proc, watches) -> dict[str, Any]:
    """``kubectl delete rlhfjobs --all --wait=false``, then poll every 1 s until nothing of the jobs is left."""
    plurals = ("rlhfjobs", "rayjobs", "rayclusters", "pods")
    n, dups, orphans = counts(api, ns, plurals)
    samples = [{"t_s": 0.0, **n, "duplicate_rayclusters": dups, "orphan_rayclusters": len(orphans)}]  # just before
    log("deleting every RLHFJob")
    t0 = time.time()
    cluster.kubectl("delete", "rlhfjobs", "--all", "-n", ns, "--wait=false")
    next_sample, done = t0, False
    deadline = t0 + a.delete_timeout
    while time.time() < deadline:
        if time.time() >= next_sample:
            n, dups, orphans = counts(api, ns, plurals)
            samples.append({"t_s": round(time.time() - t0, 1), **n, "duplicate_rayclusters": dups,
                            "orphan_rayclusters": len(orphans)})
            log(f"  {samples[-1]}")
            next_sample += 10
        if not anything_left(api, ns, plurals):
            done = True
            break
        time.sleep(1)
    t_done = time.time()
    n, dups, orphans = counts(api, ns, plurals)
    samples.append({"t_s": round(t_done - t0, 1), **n, "duplicate_rayclusters": dups, "orphan_rayclusters": len(orphans)})
    return {
        "start": t0, "end": t_done,
        "timed_out": None if done else f"timed out after {a.delete_timeout:.0f} s: nothing of the jobs left in {ns} ({n})",
        "result": {
            "done": done,
            "delete_s": round(t_done - t0, 1) if done else None,
            "left": n,
            "samples_every_10s": samples,
            "max_rayjobs": max(s["rayjobs"] for s in samples),
            "max_rayclusters": max(s["rayclusters"] for s in samples),
            "max_pods": max(s["pods"] for s in samples),
            "rayjobs_added_during_delete": len(first_time(watches["rayjobs"], added, after=t0)),
            "rayclusters_added_during_delete": sum(
                1 for t, typ, _s in events(watches["rayclusters"]) if t >= t0 and typ == "ADDED"),
            "duplicate_rayclusters_max": max(s["duplicate_rayclusters"] for s in samples),
            "duplicate_rayclusters_at_end": dups,
            "orphan_rayclusters_at_end": orphans,
            "operator_at_end": usage(proc),
        },
    }
