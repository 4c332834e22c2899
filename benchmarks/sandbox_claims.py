"""Sandboxes of ``spec.environment.sandbox`` in real pods: claim latency from a warm pool, a tool call's round trip
with the claim held, and what is left after jobs are deleted.

On the local cluster of ``hack/localcluster.py`` with real nodes (containerd, runc, kubelet, cluster DNS), the real
agent-sandbox controller (``--extensions``) and the operator from its chart: the operator makes each job's
SandboxTemplate and SandboxWarmPool, the controller fills the pool with pods of the locally built sandbox image. The
runtime's own sandbox code (``rlhf_runtime.agent.sandbox`` behind ``agent.tools.Tools``) runs here, on the host, with
an admin identity, and reaches the sandbox pods at their pod IPs as a job's pods do.

- **claim**: one trajectory's claim until its sandbox is ready (``SandboxPool.claim``: the SandboxClaim created,
  adopted by the controller, the client's wait for Ready), one at a time with the pool full before each, then
  released; p50 and p99 (``claim_p50_s``), and how many adopted a warm sandbox.
- **round trip**: a held sandbox's builtin calls through ``Tools.call`` (python ``print(1)``, shell ``true``), and
  in each round after them the same commands' own run time measured inside the sandbox pod (fork and exec from a
  Python process there, as the sandbox's server starts them); overhead = median round trip - median run time.
- **churn**: ``--jobs`` jobs, each with a warm pool of one and one sandbox claimed by the runtime (owned by the job),
  deleted at once; the sandboxes, their pods, claims, pools, templates and network policies left ``--deadline``
  seconds later, and when the last went.

The jobs' Ray pods ask for more memory than a node has, so none starts: what is measured is the operator's
template and pool, the controller and the runtime's claims, without engines taking the machine's CPUs.

    .venv/bin/python benchmarks/sandbox_claims.py [--claims 30] [--calls 30] [--jobs 20] [--deadline 60]
        [--cluster-dir DIR] [--keep] [--out benchmarks/results/operator/sandbox_claims.json]

``--cluster-dir``: a cluster with real nodes already up there (``localcluster.py up --real-nodes 2``) is used and
left up; otherwise one is started under /tmp and stopped at the end (unless ``--keep``). The load average at the
start and the end is in the result beside the figures.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
import uuid
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
sys.path.insert(0, str(REPO / "hack"))
sys.path.insert(0, str(BENCH))

import harness
import localcluster
from realnodes import NODE_LABEL

EXT, CORE, VERSION = "extensions.agents.x-k8s.io", "agents.x-k8s.io", "v1beta1"
RELEASE, SYSTEM_NS = "rlhf", "rlhf-system"
SCHEMA = {"type": "object", "properties": {"code": {"type": "string"}, "command": {"type": "string"}}}
#: Memory of the jobs' Ray pods: more than any node has, so none is scheduled.
UNSCHEDULABLE = "1000Gi"
#: Timed inside the sandbox: each command's own run time (fork and exec from Python, as the server runs it).
IN_POD = """
import json, subprocess, time
def timed(argv, n):
    out = []
    for _ in range(n):
        t = time.perf_counter()
        subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL)
        out.append(time.perf_counter() - t)
    return out
print(json.dumps({{"python": timed(["python3", "-c", "print(1)"], {n}), "shell": timed(["sh", "-c", "true"], {n})}}))
"""


def stats(xs: list[float]) -> dict[str, Any]:
    """Count, p50, p99 (nearest rank), min, max and mean of ``xs``."""
    s = sorted(xs)
    if not s:
        return {"n": 0}
    rank = lambda q: s[min(len(s) - 1, max(0, -(-len(s) * q // 100) - 1))]
    return {"n": len(s), "p50": rank(50), "p99": rank(99), "min": s[0], "max": s[-1], "mean": sum(s) / len(s)}


# ------------------------------------------------------------------------------------------------ cluster
def open_cluster(cluster_dir: Path | None) -> tuple[localcluster.Cluster, bool]:
    """The cluster (``cluster_dir``'s when it is up there, else a new one) with agent-sandbox and the operator's
    chart installed; whether this run started it."""
    if cluster_dir is not None:
        c = localcluster.Cluster(cluster_dir, localcluster.build())
        if not c.attach():
            raise SystemExit(f"no cluster with real nodes is up in {cluster_dir}")
        started = False
    else:
        c = localcluster.Cluster(Path(f"/tmp/rlhf-sbbench-{uuid.uuid4().hex[:6]}"), localcluster.build())
        c.up(nodes=1, gpus_per_node=8, real_nodes=2)
        started = True
    c.install_agent_sandbox()
    if c.helm("status", RELEASE, "-n", SYSTEM_NS, check=False).returncode != 0:
        c.install_operator_chart(RELEASE, SYSTEM_NS)
    return c, started


def job_body(name: str, image: str, sandbox: dict[str, Any]) -> dict[str, Any]:
    """A CPU RLHFJob whose Ray pods are never scheduled, with builtin python and shell tools in its sandboxes."""
    from cpujob import cpu_job

    job = cpu_job(name, image, Path("/tmp"), 1000)
    for part in ("trainer", "rollout", "head"):
        job["spec"][part]["resources"]["memory"] = UNSCHEDULABLE
    job["spec"]["environment"] = {
        "maxTokens": 96,
        "tools": [{"name": "python", "builtin": "python", "parameters": SCHEMA},
                  {"name": "shell", "builtin": "shell", "parameters": SCHEMA}],
        "sandbox": {"nodeSelector": {NODE_LABEL: "true"}, **sandbox}}
    return job


def create_jobs(c: localcluster.Cluster, ns: str, jobs: list[dict[str, Any]]) -> None:
    c.kubectl("apply", "-n", ns, "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List", "items": jobs}))


def pool_ready(custom: Any, ns: str, job: str) -> int:
    """Ready sandboxes of ``job``'s warm pool (0 while it does not exist)."""
    try:
        pool = custom.get_namespaced_custom_object(EXT, VERSION, ns, "sandboxwarmpools", f"{job}-sandbox")
    except Exception:  # noqa: BLE001 - not made yet
        return 0
    return int((pool.get("status") or {}).get("readyReplicas") or 0)


def wait_until(what: str, check: Any, timeout: float, interval: float = 0.2) -> float:
    """Seconds until ``check()`` is true; TimeoutError past ``timeout``."""
    t0 = time.monotonic()
    while not check():
        if time.monotonic() - t0 > timeout:
            raise TimeoutError(f"{what}: not within {timeout:.0f} s")
        time.sleep(interval)
    return time.monotonic() - t0


def runtime_tools(api: Any, job: dict[str, Any], ns: str, uid: str) -> Any:
    """The runtime's ``Tools`` of ``job`` (its sandboxes through ``k8s-agent-sandbox`` with ``api``'s identity)."""
    from k8s_agent_sandbox import SandboxClient
    from k8s_agent_sandbox.models import SandboxInClusterConnectionConfig

    from rlhf_api.environment import SANDBOX_PORT, Environment
    from rlhf_runtime.agent.sandbox import SandboxPool
    from rlhf_runtime.agent.tools import Tools

    env = Environment.model_validate(job["spec"]["environment"])
    name = job["metadata"]["name"]
    tools = Tools(env, (name, ns, uid))
    client = SandboxClient(connection_config=SandboxInClusterConnectionConfig(server_port=SANDBOX_PORT),
                           api_client=api, cleanup=False)
    tools.sandboxes = SandboxPool(env.sandbox, name, ns, uid, threads=8, client=client)
    return tools


def job_uid(custom: Any, ns: str, name: str) -> str:
    return custom.get_namespaced_custom_object("rlhf.dev", "v1alpha1", ns, "rlhfjobs", name)["metadata"]["uid"]


# ------------------------------------------------------------------------------------------------ phases
def claim_latency(custom: Any, tools: Any, ns: str, job: str, size: int, claims: int) -> dict[str, Any]:
    """``claims`` claims one at a time, each from a full pool (waited for), released at once."""
    pool = tools.sandboxes
    samples, warm, refill = [], 0, []
    for _ in range(claims):
        refill.append(wait_until("the warm pool full", lambda: pool_ready(custom, ns, job) >= size, 300))
        t = time.perf_counter()
        sandbox = pool.claim()
        samples.append(time.perf_counter() - t)
        warm += sandbox.sandbox_id.startswith(f"{job}-sandbox-")
        pool.release(sandbox)
    s = stats(samples)
    return {"claims": claims, "adopted_warm": warm, "seconds": s, "claim_p50_s": s["p50"], "claim_p99_s": s["p99"],
            "samples_s": [round(x, 4) for x in samples], "refill_wait": stats(refill)}


async def _round_trips(tools: Any, calls: int) -> dict[str, Any]:
    from rlhf_runtime.agent.calls import Call

    async with tools.session() as session:
        await tools.call(Call("shell", {"command": "true"}))  # the claim, and a first connection
        got: dict[str, list[float]] = {"python": [], "shell": []}
        own: dict[str, list[float]] = {"python": [], "shell": []}
        for _ in range(calls):  # each round: both calls, then both commands timed in the pod (same load)
            for builtin, args in (("python", {"code": "print(1)"}), ("shell", {"command": "true"})):
                out = await tools.call(Call(builtin, args))
                assert out.error is None, (builtin, out)
                got[builtin].append(out.seconds)
            timed = await tools.call(Call("python", {"code": IN_POD.format(n=1)}))
            assert timed.error is None, timed
            for builtin, xs in json.loads(timed.text).items():
                own[builtin] += xs
        return {"sandbox": session.sandbox.sandbox_id, "round_trip_s": got, "own_s": own}


def round_trips(tools: Any, calls: int) -> dict[str, Any]:
    """Round trips of ``calls`` python and shell calls in one held sandbox, beside the commands' own run time."""
    raw = asyncio.run(_round_trips(tools, calls))
    out: dict[str, Any] = {"sandbox": raw["sandbox"], "calls": calls}
    for builtin in ("python", "shell"):
        rt, own = stats(raw["round_trip_s"][builtin]), stats(raw["own_s"][builtin])
        out[builtin] = {"round_trip": rt, "own_run": own, "overhead_p50_ms": (rt["p50"] - own["p50"]) * 1000,
                        "round_trip_s": [round(x, 4) for x in raw["round_trip_s"][builtin]]}
    out["overhead_p50_ms"] = out["python"]["overhead_p50_ms"]
    return out


def leftovers(api: Any, ns: str) -> dict[str, int]:
    """Sandboxes and everything of them in ``ns``, by kind."""
    from kubernetes import client

    custom = client.CustomObjectsApi(api)
    out = {plural: len(custom.list_namespaced_custom_object(group, VERSION, ns, plural)["items"])
           for group, plural in ((CORE, "sandboxes"), (EXT, "sandboxclaims"), (EXT, "sandboxwarmpools"),
                                 (EXT, "sandboxtemplates"))}
    out["pods"] = len(client.CoreV1Api(api).list_namespaced_pod(ns, label_selector="rlhf.dev/sandbox-of").items)
    out["networkpolicies"] = len(client.NetworkingV1Api(api).list_namespaced_network_policy(ns).items)
    return out


def churn(c: localcluster.Cluster, api: Any, ns: str, n: int, deadline: float, image: str) -> dict[str, Any]:
    """``n`` jobs with a warm pool of one and one claimed sandbox each, deleted at once (module docstring)."""
    from kubernetes import client

    custom = client.CustomObjectsApi(api)
    small = {"cpu": "50m", "memory": "64Mi", "ephemeralStorage": "16Mi"}
    jobs = [job_body(f"churn-{i:02d}", image, {"image": image, "warmPool": 1, "resources": small})
            for i in range(n)]
    t0 = time.monotonic()
    create_jobs(c, ns, jobs)
    names = [j["metadata"]["name"] for j in jobs]
    wait_until(f"{n} warm pools ready", lambda: all(pool_ready(custom, ns, j) >= 1 for j in names), 900, 1.0)
    ready_s = time.monotonic() - t0
    for job in jobs:  # a claimed sandbox per job, as a running trajectory holds one
        tools = runtime_tools(api, job, ns, job_uid(custom, ns, job["metadata"]["name"]))
        tools.sandboxes.claim()
    before = leftovers(api, ns)
    t1 = time.monotonic()
    c.kubectl("delete", "rlhfjobs", "--all", "-n", ns, "--wait=false")
    at_deadline, gone_s, trace = None, None, []
    while time.monotonic() - t1 < max(deadline, 300) and (gone_s is None or at_deadline is None):
        left = leftovers(api, ns)
        since = time.monotonic() - t1
        trace.append([round(since, 1), left["sandboxes"], left["pods"]])
        if gone_s is None and not any(left.values()):
            gone_s = since
        if at_deadline is None and since >= deadline:
            at_deadline = left
        time.sleep(1.0)
    at_deadline = at_deadline if at_deadline is not None else {k: 0 for k in before}
    return {"jobs": n, "pools_ready_s": ready_s, "before_delete": before, "deadline_s": deadline,
            "left_at_deadline": at_deadline, "sandboxes_left": at_deadline["sandboxes"],
            "objects_left": sum(at_deadline.values()),
            "all_gone_s": gone_s, "trace": trace[::5]}


# ------------------------------------------------------------------------------------------------ main
def measure(c: localcluster.Cluster, a: argparse.Namespace) -> dict[str, Any]:
    import urllib3
    from kubernetes import client, config

    urllib3.disable_warnings(urllib3.exceptions.InsecureRequestWarning)  # the local cluster's own certificate
    api = config.new_client_from_config(str(c.kubeconfig))
    custom = client.CustomObjectsApi(api)
    image = c.images["sandbox"]["ref"]
    out: dict[str, Any] = {"sandbox_image": image}
    ns = f"sbbench-{uuid.uuid4().hex[:6]}"
    client.CoreV1Api(api).create_namespace({"metadata": {"name": ns}})
    try:
        wait_until("the default ServiceAccount", lambda: any(
            s.metadata.name == "default" for s in client.CoreV1Api(api).list_namespaced_service_account(ns).items), 60)
        job = job_body("latency", image, {"image": image, "warmPool": a.pool,
                                          "resources": {"cpu": "500m", "memory": "256Mi", "ephemeralStorage": "64Mi"}})
        create_jobs(c, ns, [job])
        out["pool_ready_s"] = wait_until("the warm pool", lambda: pool_ready(custom, ns, "latency") >= a.pool, 600)
        tools = runtime_tools(api, job, ns, job_uid(custom, ns, "latency"))
        out["claim"] = claim_latency(custom, tools, ns, "latency", a.pool, a.claims)
        out["round_trip"] = round_trips(tools, a.calls)
        c.kubectl("delete", "rlhfjob", "latency", "-n", ns)
        wait_until("the latency job's sandboxes gone", lambda: not any(leftovers(api, ns).values()), 300, 1.0)
        out["churn"] = churn(c, api, ns, a.jobs, a.deadline, image)
    finally:
        client.CoreV1Api(api).delete_namespace(ns)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--claims", type=int, default=30, help="claims timed from a full warm pool")
    p.add_argument("--pool", type=int, default=2, help="warm pool of the latency job")
    p.add_argument("--calls", type=int, default=30, help="timed calls of each builtin in one held sandbox")
    p.add_argument("--jobs", type=int, default=20, help="jobs created and deleted at once")
    p.add_argument("--deadline", type=float, default=60.0, help="seconds after the delete when leftovers count")
    p.add_argument("--cluster-dir", type=Path, help="use the cluster up there (left up)")
    p.add_argument("--keep", action="store_true", help="leave a cluster this run started up")
    p.add_argument("--out", type=Path, default=BENCH / "results" / "operator" / "sandbox_claims.json")
    a = p.parse_args(argv)
    result: dict[str, Any] = {"benchmark": "sandbox_claims",
                              **harness.provenance(harness.command_line(python=".venv/bin/python")),
                              "load_average": {"start": os.getloadavg()}}
    t0 = time.monotonic()
    c, started = open_cluster(a.cluster_dir)
    try:
        result["cluster_s"] = time.monotonic() - t0
        result["load_average"]["cluster_up"] = os.getloadavg()
        result.update(measure(c, a))
    finally:
        result["load_average"]["end"] = os.getloadavg()
        result["seconds"] = time.monotonic() - t0
        harness.write_result(a.out, result)
        if started and not a.keep:
            c.stop()
    claim, rt, ch = result["claim"], result["round_trip"], result["churn"]
    print(f"claim p50 {claim['claim_p50_s']:.3f} s p99 {claim['claim_p99_s']:.3f} s ({claim['adopted_warm']}/"
          f"{claim['claims']} warm); round trip overhead p50 {rt['overhead_p50_ms']:.1f} ms (python), "
          f"{rt['shell']['overhead_p50_ms']:.1f} ms (shell); {ch['jobs']} jobs deleted: {ch['sandboxes_left']} "
          f"sandboxes left after {ch['deadline_s']:.0f} s, all gone in {ch['all_gone_s']} s; load average "
          f"{result['load_average']}; {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
