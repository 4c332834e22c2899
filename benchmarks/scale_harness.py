"""The operator-at-scale benchmark's harness (``operator_scale.py``): percentiles, the API seen by metadata,
watches that time every event, the operator as a process (its memory and CPU time), the apiserver's audit log
(the operator's requests, server-side create times), paced creates and KWOK nodes, and the machine's facts."""

from __future__ import annotations

import collections
import datetime as dt
import json
import math
import os
import platform
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from kubernetes import client, config, watch
from kubernetes.client.rest import ApiException

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "hack"))
import localcluster

GPUS_PER_NODE = 8
SENDERS = 8  # threads that send the paced creates
LABEL_JOB = "rlhf.dev/job"
FINALIZER = "rlhf.dev/finalizer"
GROUPS = {"rlhfjobs": ("rlhf.dev", "v1alpha1"), "rayjobs": ("ray.io", "v1"), "rayclusters": ("ray.io", "v1")}
OPERATOR_AGENTS = ("kopf", "OpenAPI-Generator")  # Kopf's own client and the python kubernetes client
BENCH_AGENT = "rlhf-scale-bench"  # this script's requests, so they never count as the operator's
WRITES = ("create", "update", "patch", "delete", "deletecollection")
META_LIST = "application/json;as=PartialObjectMetadataList;g=meta.k8s.io;v=v1"


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


# ------------------------------------------------------------------------------------------ jobs and nodes
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


def kuberay_started(path: Path, offset: int) -> bool:
    """KubeRay's RayJob and RayCluster controllers have started their workers (its log after ``offset``)."""
    with open(path, "rb") as f:
        f.seek(offset)
        started = [line for line in f if b'"Starting workers"' in line]
    return all(any(f'"controllers.{c}"'.encode() in line for line in started) for c in ("RayJob", "RayCluster"))


# ---------------------------------------------------------------------------------------------- the machine
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
