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

    .venv/bin/python benchmarks/operator_scale.py --jobs 10      # ~6 min; writes results/operator_scale_10.json
    .venv/bin/python benchmarks/operator_scale.py --jobs 100     # ~10 min; results/operator_scale_100.json
    .venv/bin/python benchmarks/operator_scale.py --jobs 1000 --steady 120 --peer-until clusters \
        --converge-timeout 1200 --delete-timeout 900   # the peer waits for its RayClusters only, not Running

Each run starts a fresh cluster in ``--dir`` (default /tmp/rlhf-scale-bench) and stops it at the end; KWOK
nodes (8 GPUs, 110 pods) are sized for every job's pods plus 10 % and one node. The job is the smallest that
runs: ``crds/samples/separate-nccl-tp2.yaml`` with one engine of TP1 and no reference group (2 GPUs; head,
trainer, engine and KubeRay's submitter pod).

``--operator-path DIR`` runs the operator from DIR (first on its PYTHONPATH), e.g. a frozen worktree of a
commit: ``git worktree add /tmp/opsnap HEAD`` then ``--operator-path /tmp/opsnap/operator``.
"""

from __future__ import annotations

import argparse
import collections
import datetime as dt
import json
import math
import os
import platform
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import urllib3
import yaml
from kubernetes import client, config, watch
from kubernetes.client.rest import ApiException

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "hack"))
import localcluster

SAMPLE = "separate-nccl-tp2"
#: The smallest job that runs: one trainer GPU and one engine of TP1, no reference group (klCoef 0).
SAMPLE_CHANGES = {"rollout.tensorParallelSize": 1, "algorithm.klCoef": 0}
DATA_CONFIG_MAP = {"metadata": {"name": "gsm8k-prompts"}, "data": {"prompts.jsonl": '{"prompt": "1+1?"}\n'}}
GPUS_PER_NODE = 8
PODS_PER_NODE = 110
HEADROOM = 0.1
SENDERS = 8  # threads that send the paced creates
LABEL_JOB = "rlhf.dev/job"
FINALIZER = "rlhf.dev/finalizer"
GROUPS = {"rlhfjobs": ("rlhf.dev", "v1alpha1"), "rayjobs": ("ray.io", "v1"), "rayclusters": ("ray.io", "v1")}
PROVISIONED = ("Provisioning", "Running", "Succeeded")
OPERATOR_AGENTS = ("kopf", "OpenAPI-Generator")  # Kopf's own client and the python kubernetes client
BENCH_AGENT = "rlhf-scale-bench"  # this script's requests, so they never count as the operator's
WRITES = ("create", "update", "patch", "delete", "deletecollection")
META_LIST = "application/json;as=PartialObjectMetadataList;g=meta.k8s.io;v=v1"
AUDIT_COVERS = ("the audit policy of hack/localcluster.py logs every write (create/update/patch/delete) and every "
                "request on rlhf.dev and ray.io objects; the operator's reads of other resources (ConfigMaps, "
                "pods, nodes, RBAC objects, CRDs) are not logged, so they are not in these counts")


def log(msg: str) -> None:
    print(f"[operator_scale {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def wait_until(what: str, check, timeout: float, interval: float = 1.0) -> Any:
    """Poll ``check`` until it returns something truthy; SystemExit naming ``what`` after ``timeout`` s."""
    deadline = time.time() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.time() > deadline:
            raise SystemExit(f"timed out after {timeout:.0f} s: {what}")
        time.sleep(interval)


# ------------------------------------------------------------------------------------------------- numbers
def pct(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile."""
    if not values:
        return None
    s = sorted(values)
    return s[max(0, math.ceil(q * len(s)) - 1)]


def stats(values: list[float]) -> dict[str, Any]:
    def r(v: float | None) -> float | None:
        return None if v is None else round(v, 4)

    return {"n": len(values), "p50": r(pct(values, 0.5)), "p95": r(pct(values, 0.95)), "p99": r(pct(values, 0.99)),
            "max": r(max(values)) if values else None}


def latencies(start: dict[str, float], end: dict[str, float]) -> dict[str, Any]:
    """Per name ``end - start`` (names with both), and the last ``end`` after the first ``start``."""
    both = [n for n in start if n in end]
    out = stats([end[n] - start[n] for n in both])
    out["missing"] = len(start) - len(both)
    out["last_s"] = round(max(end[n] for n in both) - min(start.values()), 4) if both else None
    return out


def achieved_rate(created: dict[str, float]) -> float | None:
    """Creates per second from the first call to the last."""
    span = max(created.values()) - min(created.values())
    return round((len(created) - 1) / span, 2) if span > 0 else None


def ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a is not None and b else None


# --------------------------------------------------------------------------------------------- the API
def new_api(kubeconfig: Path) -> client.ApiClient:
    api = config.new_client_from_config(str(kubeconfig))
    api.user_agent = BENCH_AGENT
    return api


def list_meta(api: client.ApiClient, ns: str, plural: str, limit: int | None = None) -> list[dict[str, Any]]:
    """Metadata of the objects of ``plural`` in ``ns`` (pods: those labelled rlhf.dev/job), without specs."""
    kw: dict[str, Any] = {"_headers": {"Accept": META_LIST}, "_preload_content": False}
    if limit:
        kw["limit"] = limit
    if plural == "pods":
        resp = client.CoreV1Api(api).list_namespaced_pod(ns, label_selector=LABEL_JOB, **kw)
    else:
        resp = client.CustomObjectsApi(api).list_namespaced_custom_object(*GROUPS[plural], ns, plural, **kw)
    return [item["metadata"] for item in json.loads(resp.data).get("items") or []]


def owner_uid(meta: dict[str, Any]) -> str | None:
    """The uid of a RayCluster's controller RayJob."""
    return next((r["uid"] for r in meta.get("ownerReferences") or [] if r.get("controller") and r.get("kind") == "RayJob"),
                None)


def duplicate_clusters(clusters: list[dict[str, Any]]) -> int:
    """RayClusters whose RayJob owns more than one RayCluster not being deleted."""
    per_owner = collections.Counter(owner_uid(c) for c in clusters if not c.get("deletionTimestamp") and owner_uid(c))
    return sum(n for n in per_owner.values() if n > 1)


def orphan_clusters(clusters: list[dict[str, Any]], rayjobs: list[dict[str, Any]]) -> list[str]:
    """RayClusters whose RayJob no longer exists."""
    alive = {j["uid"] for j in rayjobs}
    return sorted(c["name"] for c in clusters if owner_uid(c) and owner_uid(c) not in alive)


def counts(api: client.ApiClient, ns: str, plurals: tuple[str, ...]) -> tuple[dict[str, int], int, list[str]]:
    """Objects per plural in ``ns``, duplicate RayClusters, orphan RayClusters."""
    metas = {p: list_meta(api, ns, p) for p in plurals}
    return ({p: len(m) for p, m in metas.items()}, duplicate_clusters(metas["rayclusters"]),
            orphan_clusters(metas["rayclusters"], metas["rayjobs"]))


def anything_left(api: client.ApiClient, ns: str, plurals: tuple[str, ...]) -> bool:
    return any(list_meta(api, ns, p, limit=1) for p in plurals)


# ------------------------------------------------------------------------------------------------ watches
def summarize(obj: dict[str, Any]) -> dict[str, Any]:
    """What the benchmark keeps of a watched object."""
    meta, st = obj["metadata"], obj.get("status") or {}
    owner = next((r for r in meta.get("ownerReferences") or [] if r.get("controller")), {})
    return {
        "name": meta["name"],
        "uid": meta.get("uid"),
        "deleting": bool(meta.get("deletionTimestamp")),
        "finalized": FINALIZER in (meta.get("finalizers") or []),
        "phase": st.get("phase") or st.get("jobDeploymentStatus"),  # RLHFJob phase / RayJob deployment status
        "owner": owner.get("name"),
        "ready_reason": next((c.get("reason") for c in st.get("conditions") or [] if c.get("type") == "Ready"), None),
        "cluster": st.get("rayClusterName"),
    }


def start_watch(kubeconfig: Path, ns: str, plural: str) -> dict[str, Any]:
    """Watch ``plural`` in ``ns`` in a daemon thread (``watch.Watch().stream`` from a list made now); every event
    is kept as (receive time, type, summary), the live objects by name. Returns once the first list is in."""
    group, version = GROUPS[plural]
    w: dict[str, Any] = {"events": [], "objects": {}, "lock": threading.Lock(), "listed": threading.Event(),
                         "errors": []}

    def run() -> None:
        api = client.CustomObjectsApi(new_api(kubeconfig))
        rv = None
        while True:
            try:
                if rv is None:  # (re)list: the objects now, and the version to watch from
                    listed = api.list_namespaced_custom_object(group, version, ns, plural)
                    with w["lock"]:
                        w["objects"] = {o["metadata"]["name"]: summarize(o) for o in listed["items"]}
                    rv = listed["metadata"]["resourceVersion"]
                    w["listed"].set()
                stream = watch.Watch()
                for ev in stream.stream(api.list_namespaced_custom_object, group, version, ns, plural,
                                        resource_version=rv, timeout_seconds=60, allow_watch_bookmarks=True):
                    t = time.time()
                    if ev["type"] == "BOOKMARK":
                        continue
                    s = summarize(ev["object"])
                    with w["lock"]:
                        w["events"].append((t, ev["type"], s))
                        if ev["type"] == "DELETED":
                            w["objects"].pop(s["name"], None)
                        else:
                            w["objects"][s["name"]] = s
                rv = stream.resource_version or rv
            except ApiException as e:
                if e.status == 410:  # too old: list again
                    rv = None
                    continue
                w["errors"].append(f"{time.time():.0f} {e.status} {e.reason}")
                time.sleep(1)  # retry pause after an error
            except Exception as e:  # noqa: BLE001 - a dropped connection: watch again from rv
                w["errors"].append(f"{time.time():.0f} {type(e).__name__}: {e}")
                time.sleep(1)

    threading.Thread(target=run, daemon=True, name=f"watch-{ns}-{plural}").start()
    if not w["listed"].wait(60):
        raise SystemExit(f"timed out after 60 s: first list of {plural} in {ns} for the watch ({w['errors'][-1:]})")
    return w


def events(w: dict[str, Any]) -> list[tuple[float, str, dict[str, Any]]]:
    with w["lock"]:
        return list(w["events"])


def objects(w: dict[str, Any]) -> dict[str, dict[str, Any]]:
    with w["lock"]:
        return dict(w["objects"])


def first_time(w: dict[str, Any], match, key: str = "name", after: float = 0.0) -> dict[str, float]:
    """Per ``key`` of the summary: receive time of the first event that ``match(type, summary)``."""
    out: dict[str, float] = {}
    for t, typ, s in events(w):
        if t >= after and s.get(key) and match(typ, s):
            out.setdefault(s[key], t)
    return out


def added(typ: str, _s: dict[str, Any]) -> bool:
    return typ == "ADDED"


def clusters_per_rayjob(w: dict[str, Any]) -> collections.Counter:
    """Distinct RayClusters ever ADDED per owning RayJob name."""
    seen = {(s["owner"], s["name"]) for _t, typ, s in events(w) if typ == "ADDED" and s["owner"]}
    return collections.Counter(owner for owner, _ in seen)


# --------------------------------------------------------------------------------- the operator process
def start_operator(cluster: localcluster.Cluster, ns: str, operator_path: Path, logfile: Path) -> subprocess.Popen:
    env = {**os.environ, "KUBECONFIG": str(cluster.kubeconfig),
           "PYTHONPATH": os.pathsep.join([str(operator_path), *filter(None, [os.environ.get("PYTHONPATH")])])}
    with open(logfile, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "rlhf_operator.main", "--liveness", "", "-n", ns],
                                stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    (cluster.dir / "operator.pid").write_text(str(proc.pid))  # so that `localcluster.py down` stops it too
    return proc


def stop_operator(proc: subprocess.Popen | None) -> None:
    if proc is None or proc.poll() is not None:
        return
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)


def usage(proc: subprocess.Popen) -> dict[str, float]:
    """The operator's resident memory (VmRSS) and CPU time (utime + stime) now."""
    if proc.poll() is not None:
        raise SystemExit(f"the operator exited ({proc.returncode}); see its log")
    rss_kib = next(int(line.split()[1]) for line in Path(f"/proc/{proc.pid}/status").read_text().splitlines()
                   if line.startswith("VmRSS:"))
    fields = Path(f"/proc/{proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
    ticks = int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15 of stat)
    return {"at": time.time(), "rss_mib": round(rss_kib / 1024, 1), "cpu_s": round(ticks / os.sysconf("SC_CLK_TCK"), 2)}


def git_commit(path: Path) -> dict[str, Any]:
    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(path), *args], capture_output=True, text=True, check=False).stdout.strip()

    return {"path": str(path), "commit": git("rev-parse", "--short", "HEAD"),
            "dirty": bool(git("status", "--porcelain", "--", "."))}


# ------------------------------------------------------------------------------------------- audit log
def audit_time(ts: str) -> float:
    return dt.datetime.fromisoformat(ts).timestamp()


def audit_entries(path: Path, offset: int, keep: Callable[[bytes], bool]) -> Iterator[dict[str, Any]]:
    """The audit log's entries after ``offset`` whose raw line ``keep`` accepts (a cheap byte test before the
    JSON is parsed: the log holds millions of lines at N=1000)."""
    with open(path, "rb") as f:
        f.seek(offset)
        for line in f:
            if line.strip() and keep(line):
                yield json.loads(line)


def operator_requests(path: Path, offset: int) -> list[tuple[float, str, str | None]]:
    """The operator's requests in the audit log after ``offset``: (received, 'verb resource[/sub]', namespace),
    one per request (a watch is logged when it starts and when it ends)."""
    seen: dict[str, tuple[float, str, str | None]] = {}
    for e in audit_entries(path, offset, lambda line: b'"userAgent":"kopf' in line
                           or b'"userAgent":"OpenAPI-Generator' in line):
        if not e.get("userAgent", "").startswith(OPERATOR_AGENTS) or e["auditID"] in seen:
            continue
        ref = e.get("objectRef") or {}
        what = f'{e["verb"]} {ref.get("resource")}' + (f'/{ref["subresource"]}' if ref.get("subresource") else "")
        seen[e["auditID"]] = (audit_time(e["requestReceivedTimestamp"]), what, ref.get("namespace"))
    return list(seen.values())


def audit_creates(path: Path, offset: int, ns: str) -> dict[str, dict[str, float]]:
    """From the audit log after ``offset``, in ``ns``: per name, when the apiserver received the create of an
    RLHFJob and of a RayJob, and when it completed the create of a RayJob and of a RayCluster (the cluster under
    its RayJob's name: KubeRay names it ``<rayjob>-<suffix>``). Server-side times: no client's scheduling or watch
    lag in them."""
    out: dict[str, dict[str, float]] = collections.defaultdict(dict)
    for e in audit_entries(path, offset, lambda line: b'"verb":"create"' in line
                           and b'"stage":"ResponseComplete"' in line):
        ref = e.get("objectRef") or {}
        if ref.get("namespace") != ns or (e.get("responseStatus") or {}).get("code") != 201 or not ref.get("name"):
            continue
        name, res = ref["name"], ref.get("resource")
        if res == "rlhfjobs":
            out[name]["rlhfjob_received"] = audit_time(e["requestReceivedTimestamp"])
        elif res == "rayjobs":
            out[name]["rayjob_received"] = audit_time(e["requestReceivedTimestamp"])
            out[name]["rayjob_created"] = audit_time(e["stageTimestamp"])
        elif res == "rayclusters":
            out[name.rsplit("-", 1)[0]].setdefault("raycluster_created", audit_time(e["stageTimestamp"]))
    return dict(out)


def audit_latencies(creates: dict[str, dict[str, float]], start: str, end: str) -> dict[str, Any]:
    return latencies({n: t[start] for n, t in creates.items() if start in t},
                     {n: t[end] for n, t in creates.items() if end in t})


def request_report(reqs: list[tuple[float, str, str | None]], start: float, end: float, jobs: int) -> dict[str, Any]:
    """The operator's requests received in [start, end): totals, per job, per minute, by verb and resource."""
    inside = [what for t, what, _ns in reqs if start <= t < end]
    by = collections.Counter(inside)
    writes = sum(n for what, n in by.items() if what.split()[0] in WRITES)
    minutes = max(end - start, 1e-9) / 60
    return {
        "window_s": round(end - start, 1),
        "requests": len(inside),
        "writes": writes,
        "requests_per_job": round(len(inside) / jobs, 2),
        "writes_per_job": round(writes / jobs, 2),
        "requests_per_job_per_min": round(len(inside) / jobs / minutes, 3),
        "writes_per_job_per_min": round(writes / jobs / minutes, 3),
        "by_verb_resource": {k: {"count": n, "per_job": round(n / jobs, 2)} for k, n in sorted(by.items())},
    }


def wait_audit(path: Path, offset: int, what: str, match, timeout: float) -> None:
    """Wait for an audit entry after ``offset`` that ``match``es (e.g. the operator's first watch)."""
    def found() -> bool:
        return any(match(e) for e in audit_entries(path, offset, lambda line: True))

    wait_until(what, found, timeout)


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


def paced_creates(names: list[str], rate: float, create) -> tuple[dict[str, float], list[float]]:
    """``create(name)`` for each name at ``rate``/s: the pacing loop hands each call, on time, to one of
    ``SENDERS`` threads, so that a slow answer does not delay the next create. Returns the time taken right
    before each call, and each call's seconds."""
    at: dict[str, float] = {}
    call_s: list[float] = []

    def send(name: str) -> None:
        at[name] = time.time()
        create(name)
        call_s.append(time.time() - at[name])

    t0 = time.time()
    with ThreadPoolExecutor(SENDERS) as pool:
        calls = []
        for i, name in enumerate(names):
            pause = t0 + i / rate - time.time()
            if pause > 0:
                time.sleep(pause)  # pacing, not synchronisation
            calls.append(pool.submit(send, name))
        for call in calls:
            call.result()  # raises a failed create's error
    return at, call_s


def wait_default_sa(api: client.ApiClient, ns: str) -> None:
    wait_until(f"the default ServiceAccount in namespace {ns}", lambda: any(
        sa.metadata.name == "default" for sa in client.CoreV1Api(api).list_namespaced_service_account(ns).items), 60)


def add_nodes(cluster: localcluster.Cluster, api: client.ApiClient, count: int, prefix: str) -> None:
    cluster.add_nodes(count, GPUS_PER_NODE, prefix=prefix)

    def ready() -> bool:
        nodes = client.CoreV1Api(api).list_node(label_selector="type=kwok").items
        ok = [n for n in nodes if n.metadata.name.startswith(prefix + "-") and any(
            c.type == "Ready" and c.status == "True" for c in n.status.conditions or [])]
        return len(ok) == count

    wait_until(f"{count} KWOK nodes {prefix}-* Ready", ready, 300)


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


def kuberay_started(path: Path, offset: int) -> bool:
    """KubeRay's RayJob and RayCluster controllers have started their workers (its log after ``offset``)."""
    with open(path, "rb") as f:
        f.seek(offset)
        started = [line for line in f if b'"Starting workers"' in line]
    return all(any(f'"controllers.{c}"'.encode() in line for line in started) for c in ("RayJob", "RayCluster"))


# ------------------------------------------------------------------------------------------------- main
def machine() -> dict[str, Any]:
    mem_kib = next(int(line.split()[1]) for line in Path("/proc/meminfo").read_text().splitlines()
                   if line.startswith("MemTotal:"))
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    return {"cores": os.cpu_count(), "memory_gib": round(mem_kib / 2**20, 1), "cpu": cpu, "arch": platform.machine()}


def version_default(name: str) -> str | None:
    """``NAME`` of hack/build-controlplane.sh (its environment override, else the script's default)."""
    m = re.search(rf'^{name}="\$\{{{name}:-([^}}]+)\}}"', (REPO / "hack" / "build-controlplane.sh").read_text(), re.MULTILINE)
    return os.environ.get(name) or (m.group(1) if m else None)


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
    p.add_argument("--out", type=Path, help="default: benchmarks/results/operator_scale_<N>.json")
    return p.parse_args(argv)


def main() -> int:
    a = parse()
    a.operator_path = a.operator_path.resolve()
    out = a.out or REPO / "benchmarks" / "results" / f"operator_scale_{a.jobs}.json"
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the finally blocks
    urllib3.disable_warnings()  # the local apiserver's kubeconfig skips TLS verification
    shape = job_shape(a.operator_path)
    nodes = a.nodes or node_count(a.jobs, shape)
    ns, peer_ns = a.namespace, f"{a.namespace}-peer"
    cluster = localcluster.Cluster(a.dir, localcluster.build())
    a.dir.mkdir(parents=True, exist_ok=True)
    kuberay_log = a.dir / "kuberay-operator.log"
    kuberay_offset = kuberay_log.stat().st_size if kuberay_log.exists() else 0
    proc = None
    failures: list[str] = []
    result: dict[str, Any] = {
        "command": shlex.join(sys.orig_argv),
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "machine": machine(),
        "kuberay_version": version_default("KUBERAY_VERSION"),
        "kubernetes_version": version_default("K8S_VERSION"),
        "operator": {**git_commit(a.operator_path),
                     "env": {k: v for k, v in os.environ.items() if k.startswith("RLHF_")}},
        "jobs": a.jobs, "rate_per_s": a.rate, "peer_until": a.peer_until, "nodes": nodes, "gpus_per_node": GPUS_PER_NODE,
        "job_shape": shape, "namespace": ns,
        "audit_policy_covers": AUDIT_COVERS,
        "operator_requests_are": f"audited requests with a userAgent starting with {' or '.join(OPERATOR_AGENTS)}",
    }
    try:
        log(f"cluster in {a.dir}: {nodes} KWOK nodes x {GPUS_PER_NODE} GPUs for {a.jobs} jobs of "
            f"{shape['gpus']} GPUs / {shape['pods']} pods")
        cluster.up(nodes=nodes, gpus_per_node=GPUS_PER_NODE)
        wait_until("KubeRay's RayJob and RayCluster controllers started (kuberay-operator.log)",
                   lambda: kuberay_started(kuberay_log, kuberay_offset), 120)
        api = new_api(cluster.kubeconfig)
        cluster.kubectl("create", "namespace", ns)
        wait_default_sa(api, ns)
        client.CoreV1Api(api).create_namespaced_config_map(ns, DATA_CONFIG_MAP)  # the sample's prompts
        audit_offset = cluster.audit_log.stat().st_size
        proc = start_operator(cluster, ns, a.operator_path, a.dir / "operator.log")
        wait_audit(cluster.audit_log, audit_offset, f"the operator's watch of rlhfjobs in {ns} (audit log)",
                   lambda e: e.get("userAgent", "").startswith("kopf") and e["verb"] == "watch"
                   and (e.get("objectRef") or {}).get("resource") == "rlhfjobs", 120)
        result["operator_at_start"] = usage(proc)

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

        log("reading the audit log")
        reqs = operator_requests(cluster.audit_log, audit_offset)
        result["create"]["operator_requests"] = request_report(reqs, t_first, t_converged, a.jobs)
        result["peer"]["our_operator_requests_meanwhile"] = request_report(reqs, t_converged, steady["start"], a.jobs)
        result["steady"]["operator_requests"] = request_report(reqs, steady["start"], steady["end"], a.jobs)
        result["report"]["operator_requests"] = request_report(reqs, reported["start"], reported["end"], a.jobs)
        result["delete"]["operator_requests"] = request_report(reqs, deleted["start"], deleted["end"], a.jobs)
        ours_audit = audit_creates(cluster.audit_log, audit_offset, ns)
        peer_audit = audit_creates(cluster.audit_log, audit_offset, peer_ns)
        result["create"]["audit_rlhfjob_received_to_rayjob_created_s"] = audit_latencies(
            ours_audit, "rlhfjob_received", "rayjob_created")
        result["peer"]["audit_rayjob_received_to_raycluster_created_s"] = audit_latencies(
            peer_audit, "rayjob_received", "raycluster_created")
        result["ratio_audit"] = {
            "what": "the same ratio from the apiserver's audit timestamps (create received -> child created)",
            **{q: ratio(result["create"]["audit_rlhfjob_received_to_rayjob_created_s"][q],
                        result["peer"]["audit_rayjob_received_to_raycluster_created_s"][q]) for q in ("p50", "p99")}}
        result["watch_errors"] = {f"{ns}/{p}": w["errors"] for p, w in created["watches"].items() if w["errors"]}
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
