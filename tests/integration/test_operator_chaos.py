"""Operator faults under churn, on the real control plane (apiserver, KubeRay, KWOK nodes).

1. One operator process, SIGKILLed at random points (>= 20 kills: after a random number of its own API writes,
   or while idle) while 20 jobs are created, edited (allowlisted fields only) and some deleted, restarted after
   each kill (some edits and deletes land while it is down). Every fifth kill, and after the last, the time from
   the kill until every job has converged is measured.
2. Two replicas with Kopf peering under the same churn; the active one is SIGKILLed (the standby takes over once
   the dead peer's record expires), restarted with a higher priority (hand-over back), and the standby is killed.

Converged (polled with a deadline): every live job exactly one RayJob, one ConfigMap, one ServiceAccount, Role
and RoleBinding, at most one RayCluster per RayJob (none while suspended), nothing left of deleted jobs;
phase Running (KWOK runs the pods) or Suspended; status.totalSteps == spec.algorithm.steps and
status.observedGeneration == metadata.generation. Double actions are counted in the apiserver's audit log
(create requests for each RayJob, 201 and 409) and in the operator's ``Created`` Events per child.
"""

from __future__ import annotations

import collections
import json
import random
import signal
import statistics
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client, config

from rlhf_api import models as m
from tests.helpers import touch_pod_scheduled, wait_for
from tests.integration.conftest import Operator, peering_namespace

pytestmark = pytest.mark.cluster

SEED = 20261123
JOBS = 20
KILLS = 20
DELETES = 5
CONVERGE_S = 300
UA = "rlhf-chaos-test"
OPERATOR_UA = ("OpenAPI-Generator", "kopf")  # our operator: the kubernetes client (kube.py) and Kopf


@pytest.fixture(scope="module")
def capi(cluster) -> client.ApiClient:
    """The test's own client, with its own User-Agent so the audit log tells its writes from the operator's."""
    a = config.new_client_from_config(str(cluster.kubeconfig))
    a.user_agent = UA
    return a


def tiny_job(name: str, steps: int) -> dict:
    """CPU-only (no GPU): 20 of them fit beside whatever else runs on the KWOK nodes."""
    small = {"cpu": "100m", "memory": "256Mi"}
    return {
        "apiVersion": m.API_VERSION, "kind": m.KIND, "metadata": {"name": name},
        "spec": {
            "model": {"name": "Qwen/Qwen3-0.6B"}, "image": "runtime:0.1.0",
            "trainer": {"replicas": 1, "gpusPerReplica": 0, "resources": small},
            "rollout": {"engines": 1, "tensorParallelSize": 1, "resources": small},
            "head": {"resources": {"cpu": "100m", "memory": "1Gi"}, "submitter": small},
            "algorithm": {"steps": steps, "promptsPerStep": 2},
            "data": {"prompts": ["1+1?", "2+2?"]}, "reward": {"rule": "exactMatch", "target": "2"},
        },
    }


# ----------------------------------------------------------------------------------------------- audit log
class Audit:
    """The apiserver's audit log (JSON lines), read incrementally."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = path.stat().st_size if path.exists() else 0

    def _read(self, start: int) -> tuple[list[dict], int]:
        with open(self.path, "rb") as f:
            f.seek(start)
            data = f.read()
        end = data.rfind(b"\n") + 1
        return [json.loads(line) for line in data[:end].splitlines() if line.strip()], start + end

    def operator_requests(self, ns: str) -> int:
        """Requests by the operator in ``ns`` since the last call (reads of RLHFJobs and Ray objects, and every
        write: what the audit policy records)."""
        events, self.offset = self._read(self.offset)
        return sum(1 for e in events if e.get("userAgent", "").startswith(OPERATOR_UA)
                   and (e.get("objectRef") or {}).get("namespace") == ns)

    def rayjob_creates(self, ns: str) -> dict[str, collections.Counter]:
        """RayJob name -> Counter of response codes of create requests in ``ns`` (whole log)."""
        events, _ = self._read(0)
        out: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
        for e in events:
            ref = e.get("objectRef") or {}
            if (e["verb"] == "create" and ref.get("resource") == "rayjobs" and ref.get("namespace") == ns
                    and e.get("stage") == "ResponseComplete"):
                out[ref.get("name") or "?"][(e.get("responseStatus") or {}).get("code")] += 1
        return out


# ------------------------------------------------------------------------------------------- the world
class World:
    """The jobs the test wants (spec it last wrote, deleted or not) and what the cluster holds."""

    def __init__(self, capi: client.ApiClient, ns: str, rng: random.Random) -> None:
        self.co, self.core, self.rbac = (client.CustomObjectsApi(capi), client.CoreV1Api(capi),
                                         client.RbacAuthorizationV1Api(capi))
        self.ns, self.rng = ns, rng
        self.want: dict[str, dict[str, Any]] = {}  # name -> {"steps", "suspend", "deleted"}
        self.actions: collections.Counter = collections.Counter()

    # churn
    def create(self) -> None:
        name = f"job-{len(self.want):02d}"
        steps = self.rng.randint(1, 1000)
        self.co.create_namespaced_custom_object(m.GROUP, m.VERSION, self.ns, m.PLURAL, tiny_job(name, steps))
        self.want[name] = {"steps": steps, "suspend": False, "deleted": False}
        self.actions["create"] += 1

    def live(self) -> list[str]:
        return sorted(n for n, w in self.want.items() if not w["deleted"])

    def edit(self) -> None:
        """A merge patch of 1-3 allowlisted fields (values that keep a job Running on KWOK)."""
        name = self.rng.choice(self.live())
        w, spec = self.want[name], {}
        for field in self.rng.sample(["algorithm.steps", "suspend", "activeDeadlineSeconds",
                                      "ttlSecondsAfterFinished", "backoffLimit", "progressDeadlineSeconds"],
                                     self.rng.randint(1, 3)):
            if field == "algorithm.steps":
                w["steps"] = self.rng.randint(1, 1_000_000)
                spec["algorithm"] = {"steps": w["steps"]}
            elif field == "suspend":
                w["suspend"] = not w["suspend"]
                spec["suspend"] = w["suspend"]
            elif field == "activeDeadlineSeconds":
                spec[field] = self.rng.choice([None, 86_400, 604_800])
            elif field == "ttlSecondsAfterFinished":
                spec[field] = self.rng.choice([None, 0, 60, 3600])
            elif field == "backoffLimit":
                spec[field] = self.rng.randint(0, 3)
            else:
                spec[field] = self.rng.choice([600, 1800, 7200])
            self.actions[f"edit {field}"] += 1
        self.co.patch_namespaced_custom_object(m.GROUP, m.VERSION, self.ns, m.PLURAL, name, {"spec": spec})

    def delete(self) -> None:
        name = self.rng.choice(self.live())
        self.co.delete_namespaced_custom_object(m.GROUP, m.VERSION, self.ns, m.PLURAL, name)
        self.want[name]["deleted"] = True
        self.actions["delete"] += 1

    def churn(self, n: int) -> None:
        for _ in range(n):
            if len(self.want) < JOBS and (not self.live() or self.rng.random() < 0.6):
                self.create()
            elif self.actions["delete"] < DELETES and len(self.want) >= 12 and self.rng.random() < 0.3:
                self.delete()
            else:
                self.edit()

    # observation
    def problems(self) -> list[str]:
        """Why the cluster has not converged to what the test wants; empty when it has."""
        ns, out = self.ns, []
        jobs = {j["metadata"]["name"]: j for j in
                self.co.list_namespaced_custom_object(m.GROUP, m.VERSION, ns, m.PLURAL)["items"]}
        sel = "rlhf.dev/job"
        children: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
        owners: dict[str, set] = collections.defaultdict(set)

        def count(kind: str, items: list[Any]) -> None:
            for o in items:
                meta = o["metadata"] if isinstance(o, dict) else o.metadata.to_dict()
                labels = meta.get("labels") or {}
                if sel in labels:
                    children[labels[sel]][kind] += 1
                    for ref in meta.get("owner_references") or meta.get("ownerReferences") or []:
                        owners[labels[sel]].add(ref.get("uid"))

        count("RayJob", self.co.list_namespaced_custom_object("ray.io", "v1", ns, "rayjobs")["items"])
        count("ConfigMap", self.core.list_namespaced_config_map(ns, label_selector=sel).items)
        count("ServiceAccount", self.core.list_namespaced_service_account(ns, label_selector=sel).items)
        count("Role", self.rbac.list_namespaced_role(ns, label_selector=sel).items)
        count("RoleBinding", self.rbac.list_namespaced_role_binding(ns, label_selector=sel).items)
        clusters = collections.Counter(
            ref["name"] for rc in self.co.list_namespaced_custom_object("ray.io", "v1", ns, "rayclusters")["items"]
            for ref in rc["metadata"].get("ownerReferences") or [] if ref.get("kind") == "RayJob")
        for name, w in self.want.items():
            if w["deleted"]:
                if name in jobs:
                    out.append(f"{name}: deleted but still there (deletionTimestamp "
                               f"{jobs[name]['metadata'].get('deletionTimestamp')})")
                if children.get(name):
                    out.append(f"{name}: deleted but children remain: {dict(children[name])}")
                if clusters.get(name):
                    out.append(f"{name}: deleted but {clusters[name]} RayCluster(s) remain")
                continue
            j = jobs.get(name)
            if j is None:
                out.append(f"{name}: missing")
                continue
            st = j.get("status") or {}
            want_phase = "Suspended" if w["suspend"] else "Running"
            if st.get("phase") != want_phase:
                out.append(f"{name}: phase {st.get('phase')} ({st.get('message')}), want {want_phase}")
            if j["spec"]["algorithm"]["steps"] != w["steps"] or bool(j["spec"].get("suspend")) != w["suspend"]:
                out.append(f"{name}: spec is not what the test wrote: {j['spec']}")
            if st.get("totalSteps") != j["spec"]["algorithm"]["steps"]:
                out.append(f"{name}: status.totalSteps {st.get('totalSteps')} != spec {j['spec']['algorithm']['steps']}")
            if st.get("observedGeneration") != j["metadata"]["generation"]:
                out.append(f"{name}: observedGeneration {st.get('observedGeneration')} != "
                           f"generation {j['metadata']['generation']}")
            got = dict(children.get(name) or {})
            want = {"RayJob": 1, "ConfigMap": 1, "ServiceAccount": 1, "Role": 1, "RoleBinding": 1}
            if got != want:
                out.append(f"{name}: children {got}, want one each")
            if owners.get(name, set()) - {j["metadata"]["uid"]}:
                out.append(f"{name}: children owned by another uid: {owners[name]}")
            limit = 0 if w["suspend"] else 1
            if clusters.get(name, 0) > limit:
                out.append(f"{name}: {clusters[name]} RayClusters (at most {limit})")
        strays = set(children) - set(self.want)
        if strays:
            out.append(f"children of unknown jobs: {sorted(strays)}")
        return out

    def converge(self, what: str, timeout: float = CONVERGE_S) -> float:
        """Seconds until converged (polled); fails with the remaining problems at the deadline."""
        t0 = time.monotonic()
        last: list[str] = []

        def ok() -> bool:
            nonlocal last
            last = self.problems()
            return not last

        try:
            wait_for(ok, timeout, what, interval=1)
        except AssertionError:
            raise AssertionError(f"not converged after {timeout}s ({what}): {len(last)} problems:\n" +
                                 "\n".join(last[:40])) from None
        return time.monotonic() - t0

    def created_events(self) -> dict[tuple[str, str], int]:
        """(job, child kind) -> number of the operator's Created Events."""
        out: collections.Counter = collections.Counter()
        for e in self.core.list_namespaced_event(self.ns).items:
            if e.reason == "Created" and e.involved_object.kind == m.KIND:
                out[(e.involved_object.name, (e.message or "").split(" ")[0])] += (e.count or 1)
        return out


def poll_until(check, timeout: float, interval: float = 0.1) -> bool:
    """Poll ``check`` until true or the deadline; unlike wait_for, reaching the deadline is not an error."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(interval)
    return bool(check())


def dup_report(world: World, audit: Audit) -> tuple[list[str], dict[str, Any]]:
    """(problems, numbers): RayJob create requests per job in the audit log, Created Events per child."""
    creates = audit.rayjob_creates(world.ns)
    events = world.created_events()
    problems, numbers = [], collections.Counter()
    for name, w in world.want.items():
        codes = creates.get(name, collections.Counter())
        numbers["rayjob create 201"] += codes[201]
        numbers["rayjob create 409"] += codes[409]
        numbers["rayjob create other"] += sum(v for c, v in codes.items() if c not in (201, 409))
        # More than one 201 is a RayJob created twice (deleted and made again). A live job has at least one
        # create whose outcome was success or unknown: a request cut off by a kill is audited as 5xx (e.g. 504)
        # although the object may have been stored (the convergence check saw exactly one RayJob).
        unknown = sum(v for c, v in codes.items() if c is None or c >= 500)
        if codes[201] > 1 or (codes[201] + unknown == 0 and not w["deleted"]):
            problems.append(f"{name}: {codes[201]} successful RayJob creates (want 1): {dict(codes)}")
        for kind in ("RayJob", "ConfigMap"):
            n = events.get((name, kind), 0)
            numbers[f"Created Events {kind}"] += n
            if n > 1:
                problems.append(f"{name}: {n} Created Events for its {kind}")
            if n == 0 and not w["deleted"]:
                numbers[f"lost Created Events {kind}"] += 1
    return problems, dict(numbers)


def table(rows: list[tuple[str, Any, str, str]]) -> str:
    out = ["| fault | count | outcome | time to recover |", "|---|---|---|---|"]
    out += [f"| {a} | {b} | {c} | {d} |" for a, b, c, d in rows]
    return "\n".join(out)


def fmt(ts: list[float]) -> str:
    if not ts:
        return "-"
    return (f"n={len(ts)} min {min(ts):.1f} s, median {statistics.median(ts):.1f} s, max {max(ts):.1f} s"
            if len(ts) > 1 else f"{ts[0]:.1f} s")


# -------------------------------------------------------------------------------------------- standalone
def test_sigkill_at_random_points_under_churn(cluster, capi, tmp_path) -> None:
    rng = random.Random(SEED)
    ns = f"chaos-{uuid.uuid4().hex[:6]}"
    client.CoreV1Api(capi).create_namespace({"metadata": {"name": ns}})
    world, audit = World(capi, ns, rng), Audit(cluster.audit_log)
    op = Operator(cluster, ["--namespace", ns], tmp_path / "op.log").start()
    kill_points: collections.Counter = collections.Counter()
    recoveries: list[float] = []
    try:
        audit.operator_requests(ns)
        for i in range(KILLS):
            world.churn(rng.randint(1, 3))
            # Kill after the restarted operator has made k API requests in the namespace (a random point inside
            # its startup and reconciles), or at the deadline.
            k = rng.randint(1, 40)
            seen = 0

            def enough(k=k) -> bool:
                nonlocal seen
                seen += audit.operator_requests(ns)
                return seen >= k

            hit = poll_until(enough, 12)
            kill_points["after k requests" if hit else "at the 12 s deadline"] += 1
            assert op.alive(), f"operator died by itself before kill {i + 1}; log {op.log}"
            killed_at = time.monotonic()
            op.kill(signal.SIGKILL)
            world.churn(rng.randint(0, 2))  # edits and deletes while it is down
            op.start()
            if i % 5 == 4:
                world.converge(f"converged after kill {i + 1}")
                recoveries.append(time.monotonic() - killed_at)
        while len(world.want) < JOBS:  # every job created, whatever the draws were
            world.create()
        world.churn(3)
        seen = 0

        def some_requests() -> bool:
            nonlocal seen
            seen += audit.operator_requests(ns)
            return seen >= 5

        poll_until(some_requests, 12)  # mid-reconcile of the last churn
        final_kill = time.monotonic()
        op.kill(signal.SIGKILL)
        world.churn(2)
        op.start()
        world.converge("final convergence")
        final = time.monotonic() - final_kill
        assert op.alive()
        dups, numbers = dup_report(world, audit)
        live = len(world.live())
        print(f"\n[chaos standalone] seed {SEED}: {KILLS + 1} SIGKILLs, kill points {dict(kill_points)}; "
              f"actions {dict(world.actions)}; {live} live jobs, {len(world.want) - live} deleted; {numbers}")
        print(table([
            ("SIGKILL operator at random points under churn (checked every 5th kill)", KILLS, "converged, no dups",
             fmt(recoveries)),
            ("SIGKILL mid-churn after all jobs exist, churn while down (final)", 1, "converged, no dups", f"{final:.1f} s"),
        ]))
        assert not dups, "double actions:\n" + "\n".join(dups)
        assert world.actions["delete"] >= 1 and world.actions["create"] == JOBS, world.actions
    finally:
        op.kill(signal.SIGTERM)
        client.CoreV1Api(capi).delete_namespace(ns)


# ----------------------------------------------------------------------------------------------- peering
def test_peered_replicas_under_churn_and_kills(cluster, capi, tmp_path) -> None:
    rng = random.Random(SEED + 1)
    ns = peering_namespace(cluster, capi, "chaos-peer")
    world, audit = World(capi, ns, rng), Audit(cluster.audit_log)
    co = client.CustomObjectsApi(capi)

    def replica(priority: int) -> Operator:
        return Operator(cluster, ["--namespace", ns, "--peering", "rlhf", "--priority", str(priority)],
                        tmp_path / f"op{priority}.log")

    def peers() -> dict:
        return co.get_namespaced_custom_object("kopf.dev", "v1", ns, "kopfpeerings", "rlhf").get("status") or {}

    def paused(op: Operator) -> bool:
        return "Pausing operations in favour of" in op.log.read_text() if op.log.exists() else False

    active, standby = replica(20), replica(10)
    rows: list[tuple[str, Any, str, str]] = []
    try:
        # The standby first: a replica that starts beside a higher-priority peer starts paused and says nothing,
        # one that sees a higher-priority peer arrive logs that it pauses (as in test_lifecycle's peered test).
        standby.start()
        wait_for(lambda: len(peers()) == 1, 60, "the first replica in the peering object")
        active.start()
        wait_for(lambda: paused(standby), 120, "the standby (priority 10) to pause for the active one (20)")
        world.churn(JOBS + 6)
        world.converge("two replicas, initial churn")

        # 1. SIGKILL the active replica and leave it dead: the standby takes over once the dead peer expires.
        killed = time.monotonic()
        active.kill(signal.SIGKILL)
        world.churn(6)
        world.converge("the standby took over", timeout=CONVERGE_S + 120)
        rows.append(("SIGKILL active replica, not restarted (standby takes over)", 1, "converged, no dups",
                     f"{time.monotonic() - killed:.1f} s"))

        # 2. Restart it with a higher priority: the hand-over back under churn must not double anything.
        handed = time.monotonic()
        active = replica(30)
        active.start()
        world.churn(4)
        wait_for(lambda: "Pausing operations in favour of" in standby.log.read_text().split(
            "Resuming operations")[-1], 120, "the standby to pause again for the restarted replica")
        world.converge("after the hand-over to the restarted replica")
        rows.append(("active restarted with higher priority (hand-over under churn)", 1, "converged, no dups",
                     f"{time.monotonic() - handed:.1f} s"))

        # 3. SIGKILL the standby: nothing changes.
        killed = time.monotonic()
        standby.kill(signal.SIGKILL)
        world.churn(4)
        world.converge("standby killed")
        rows.append(("SIGKILL standby replica", 1, "converged, no dups", f"{time.monotonic() - killed:.1f} s"))
        standby = replica(5)
        standby.start()

        # 4. SIGKILL the active again and restart it at once (as a Deployment would), with the highest priority.
        killed = time.monotonic()
        active.kill(signal.SIGKILL)
        world.churn(4)
        active = replica(40)
        active.start()
        world.converge("active killed and restarted at once")
        rows.append(("SIGKILL active replica, restarted at once", 1, "converged, no dups",
                     f"{time.monotonic() - killed:.1f} s"))
        assert active.alive() and standby.alive()

        dups, numbers = dup_report(world, audit)
        live = len(world.live())
        print(f"\n[chaos peering] seed {SEED + 1}: actions {dict(world.actions)}; {live} live jobs, "
              f"{len(world.want) - live} deleted; {numbers}")
        print(table(rows))
        assert not dups, "double actions:\n" + "\n".join(dups)
        # One active replica: no create ever raced another (a 409 on a RayJob create is a second attempt).
        assert numbers.get("rayjob create 409", 0) == 0, numbers
        for kind in ("RayJob", "ConfigMap"):
            assert numbers.get(f"lost Created Events {kind}", 0) == 0, numbers
    finally:
        for op in (active, standby):
            op.kill(signal.SIGTERM)
        client.CoreV1Api(capi).delete_namespace(ns)


# ---------------------------------------------------------------------------------- delete, no recreation
def test_deleted_jobs_children_are_not_recreated(cluster, capi, tmp_path) -> None:
    """Delete each job as soon as its RayJob exists (no kill): the garbage collector removes the children and
    the operator must not make them again (each RayJob created once, per the audit log). Judged after the
    operator has reconciled a live sentinel job many times since the deletions."""
    ns = f"chaos-del-{uuid.uuid4().hex[:6]}"
    client.CoreV1Api(capi).create_namespace({"metadata": {"name": ns}})
    world, audit = World(capi, ns, random.Random(SEED + 2)), Audit(cluster.audit_log)
    co = world.co
    op = Operator(cluster, ["--namespace", ns], tmp_path / "op.log").start()
    try:
        for _ in range(7):
            world.create()
        doomed = [f"job-{i:02d}" for i in range(1, 7)]  # job-00 stays: the sentinel
        for name in doomed:
            wait_for(lambda name=name: co.list_namespaced_custom_object(
                "ray.io", "v1", ns, "rayjobs", label_selector=f"rlhf.dev/job={name}")["items"], 120, f"{name} RayJob")
            co.delete_namespaced_custom_object(m.GROUP, m.VERSION, ns, m.PLURAL, name)
            world.want[name]["deleted"] = True
        # Every child the garbage collector deletes is an event that reconciles its (deleted) job: judged once the
        # collector is done and a reconcile queued after all of those has run (the sentinel's, after a poke).
        def leftovers() -> list[str]:
            return [f"{plural}/{o['metadata']['name']}" for plural in ("rayjobs", "rayclusters")
                    for o in co.list_namespaced_custom_object("ray.io", "v1", ns, plural)["items"]
                    if o["metadata"].get("labels", {}).get("rlhf.dev/job") in doomed]

        wait_for(lambda: not leftovers(), 180, "the deleted jobs' RayJobs and RayClusters garbage-collected")
        core = client.CoreV1Api(capi)
        sentinel_pod = wait_for(lambda: core.list_namespaced_pod(ns, label_selector="rlhf.dev/job=job-00").items,
                                120, "a pod of the sentinel")[0]
        base = op.reconciles(ns, "job-00")
        touch_pod_scheduled(core, ns, sentinel_pod.metadata.name, 1)
        wait_for(lambda: op.reconciles(ns, "job-00") > base, 60, "a reconcile of the sentinel after the deletions")
        world.converge("deleted jobs gone, sentinel Running", timeout=180)
        creates = audit.rayjob_creates(ns)
        made = {n: dict(creates.get(n, {})) for n in doomed}
        print(f"\n[delete] RayJob create requests per deleted job: {made}")
        assert all(c.get(201, 0) <= 1 and not c.get(409) for c in made.values()), (
            f"children of deleted jobs were created again: {made}; operator log {op.log}")
    finally:
        op.kill(signal.SIGTERM)
        client.CoreV1Api(capi).delete_namespace(ns)
