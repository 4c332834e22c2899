"""The event-driven operator's pure parts: the coalescing work queue, the watch-cache projections and the
remembered writes, when to look again without an event, and which RayClusters are duplicates."""

from __future__ import annotations

import asyncio
import datetime as dt

from rlhf_operator import cache, naming
from rlhf_operator import status as st
from rlhf_operator.workqueue import WorkQueue

NOW = dt.datetime(2026, 11, 23, 12, 0, 0, tzinfo=dt.UTC)


def stamp(seconds_ago: float) -> str:
    return (NOW - dt.timedelta(seconds=seconds_ago)).strftime("%Y-%m-%dT%H:%M:%SZ")


# ----------------------------------------------------------------------------------------------- work queue
async def _until(check, timeout: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not check():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.005)


def test_a_key_runs_once_per_burst_and_never_twice_at_once() -> None:
    async def main() -> None:
        runs: list[str] = []
        running: set[str] = set()
        overlaps = 0
        release = asyncio.Event()

        async def work(key):
            nonlocal overlaps
            overlaps += key in running
            running.add(key)
            runs.append(key)
            await release.wait()
            running.discard(key)

        q = WorkQueue(work, workers=4)
        q.start()
        for _ in range(50):  # a burst of events for one job while nothing runs yet: one run
            q.add("a")
        await _until(lambda: runs == ["a"])
        for _ in range(20):  # events while it runs: exactly one more run, after this one
            q.add("a")
        q.add("b")
        await _until(lambda: sorted(runs) == ["a", "b"])
        release.set()
        await _until(lambda: runs.count("a") == 2 and q.idle())
        assert overlaps == 0 and runs.count("a") == 2 and runs.count("b") == 1
        await q.stop()

    asyncio.run(main())


def test_urgent_keys_go_ahead_of_waiting_ones_and_each_key_runs_once() -> None:
    async def main() -> None:
        runs: list[str] = []
        waits: list[float] = []
        release = asyncio.Event()

        async def work(key):
            runs.append(key)
            if key == "busy":
                await release.wait()

        q = WorkQueue(work, workers=1, on_wait=waits.append)
        q.start()
        q.add("busy")  # holds the only worker while the others queue up
        await _until(lambda: runs == ["busy"])
        for key in ("a", "b", "c"):
            q.add(key)
        q.add("new", urgent=True)
        q.add("b", urgent=True)  # a waiting key moved ahead: it runs once, not twice
        q.add("new")  # a later ordinary event does not move it back
        release.set()
        await _until(lambda: q.idle())
        assert runs == ["busy", "new", "b", "a", "c"], runs
        assert len(waits) == 5 and all(w >= 0 for w in waits)
        await q.stop()

    asyncio.run(main())


def test_returned_delay_schedules_the_next_look_and_none_cancels_it() -> None:
    async def main() -> None:
        answers = {"a": [0.05, None], "b": [0.05, 0.05, None]}
        runs: dict[str, int] = {"a": 0, "b": 0}

        async def work(key):
            runs[key] += 1
            return answers[key].pop(0) if answers[key] else None

        q = WorkQueue(work, workers=2)
        q.start()
        q.add("a")
        q.add("b")
        await _until(lambda: runs == {"a": 2, "b": 3} and q.idle() and not q._timers)
        await q.stop()

    asyncio.run(main())


def test_a_failing_reconcile_is_retried_and_the_worker_survives() -> None:
    async def main() -> None:
        calls = []

        async def work(key):
            calls.append(key)
            if len(calls) == 1:
                raise RuntimeError("boom")

        import rlhf_operator.workqueue as wq

        old, wq.RETRY_SECONDS = wq.RETRY_SECONDS, 0.01
        try:
            q = WorkQueue(work, workers=1)
            q.start()
            q.add("a")
            await _until(lambda: len(calls) == 2 and q.idle())
            q.add("b")  # the one worker still runs keys
            await _until(lambda: calls[-1] == "b")
            await q.stop()
        finally:
            wq.RETRY_SECONDS = old

    asyncio.run(main())


def test_held_queue_drops_keys_and_their_timers() -> None:
    async def main() -> None:
        paused = True
        runs = []

        async def work(key):
            runs.append(key)
            return 0.01

        q = WorkQueue(work, workers=1, hold=lambda: paused)
        q.start()
        q.add("a")
        await _until(lambda: q.idle())
        assert runs == [] and not q._timers
        paused = False
        q.add("a")
        await _until(lambda: len(runs) >= 2)  # runs, then looks again after its delay
        paused = True
        await _until(lambda: q.idle() and not q._timers)
        await q.stop()

    asyncio.run(main())


# ------------------------------------------------------------------------------------------------- caches
POD = {
    "metadata": {"name": "j-abc-head-x", "namespace": "ns", "uid": "u1", "resourceVersion": "7",
                 "creationTimestamp": "2026-11-23T11:00:00Z",
                 "labels": {"ray.io/node-type": "head", "ray.io/cluster": "j-abc", naming.LABEL_JOB: "j", "other": "x"},
                 "annotations": {"big": "x" * 5000}, "managedFields": [{"manager": "kubelet"}] * 20},
    "spec": {"containers": [{"name": "ray", "image": "i", "env": [{"name": "A", "value": "b" * 2000}],
                             "resources": {"requests": {"cpu": "1", "nvidia.com/gpu": "2"}}},
                            {"name": "side", "resources": {"requests": {"cpu": "1"}}}]},
    "status": {"phase": "Pending", "conditions": [
        {"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": "no GPUs"},
        {"type": "Initialized", "status": "True"}]},
}


def test_pod_projection_keeps_what_status_reads_and_drops_the_rest() -> None:
    p = cache.pod(POD)
    assert len(repr(p)) < 700, repr(p)
    assert p["metadata"]["labels"] == {"ray.io/node-type": "head", "ray.io/cluster": "j-abc", naming.LABEL_JOB: "j"}
    assert st._gpus(p) == 2
    assert st._unschedulable([p]) == "pod j-abc-head-x: Unschedulable: no GPUs"
    POD["status"]["conditions"][0]["message"] = "changed"  # a copy, not a view of the watch event's body
    assert st._unschedulable([p]).endswith("no GPUs")


class Index(dict):
    """A Kopf index has this shape: key -> a collection of the values the index function returned."""


def caches(jobs=(), ray_jobs=(), clusters=()) -> cache.Caches:
    c = cache.Caches()
    c.bind({"rlhf_jobs": Index({("ns", j["metadata"]["name"]): [j] for j in jobs}),
            "rlhf_ray_jobs": Index({("ns", "j"): list(ray_jobs)}),
            "rlhf_ray_clusters": Index({("ns", "j"): list(clusters)})})
    return c


def job(rv: str, phase: str) -> dict:
    return cache.job({"apiVersion": "rlhf.dev/v1alpha1", "kind": "RLHFJob",
                      "metadata": {"name": "j", "namespace": "ns", "uid": "u", "resourceVersion": rv, "generation": 1},
                      "spec": {}, "status": {"phase": phase}})


def test_a_remembered_write_wins_until_the_watch_shows_it() -> None:
    c = caches(jobs=[job("10", "Pending")])
    c.remember("job", ("ns", "j"), job("12", "Running"))
    assert c.job("ns", "j")["status"]["phase"] == "Running"  # the watch still shows rv 10: ours is newer
    c.seen("job", ("ns", "j"), job("11", "Pending"))  # an older event (someone else's write before ours)
    assert c.overlays() == 1 and c.job("ns", "j")["status"]["phase"] == "Running"
    c.indexes["rlhf_jobs"][("ns", "j")] = [job("13", "Running")]  # the watch caught up (and beyond)
    assert c.job("ns", "j")["metadata"]["resourceVersion"] == "13" and c.overlays() == 0


def test_a_remembered_write_of_a_deleted_object_is_dropped() -> None:
    c = caches()
    c.remember("RayJob", ("ns", "j"), cache.ray_job({"metadata": {"name": "j", "resourceVersion": "5"}}))
    assert c.snapshot("ns", "j").ray_job is not None  # just created: the watch has not shown it yet
    c.seen("RayJob", ("ns", "j"), {"metadata": {"name": "j", "resourceVersion": "9"}}, deleted=True)
    assert c.snapshot("ns", "j").ray_job is None


def test_ray_job_projection_keeps_mutable_spec_and_status_not_the_cluster_spec() -> None:
    rj = {"metadata": {"name": "j", "resourceVersion": "3", "uid": "r", "labels": {naming.LABEL_JOB: "j"}},
          "spec": {"suspend": True, "backoffLimit": 2, "rayClusterSpec": {"headGroupSpec": {"x": "y" * 10000}},
                   "entrypoint": "python -m x"},
          "status": {"rayClusterName": "j-abc", "jobDeploymentStatus": "Running"}}
    p = cache.ray_job(rj)
    assert p["spec"] == {"suspend": True, "backoffLimit": 2} and p["status"]["rayClusterName"] == "j-abc"


# ---------------------------------------------------------------------------------------- next look, dups
def running(heartbeat_ago: float, progress_ago: float | None = None, state: str = "Running") -> st.Observed:
    runtime = {"state": state, "heartbeatTime": stamp(heartbeat_ago), "rayCluster": "j-abc"}
    if progress_ago is not None:
        runtime["progressTime"] = stamp(progress_ago)
    return st.Observed(generation=1, old_status={"phase": "Running", "runtime": runtime}, now=NOW,
                       ray_job={"status": {"rayClusterName": "j-abc"}}, progress_deadline=600)


def test_next_look_is_when_the_report_or_the_progress_deadline_runs_out() -> None:
    # report 10 s old: unresponsive at 120 s -> look again in 110 s (+1 s margin)
    assert st.next_check(running(10)) == 111
    # progress 550 s old, deadline 600 s: in 50 s (before the report's 110 s)
    assert st.next_check(running(10, progress_ago=550)) == 51
    # past the deadline, not yet past deadline + grace (60 s): the grace's end
    assert st.next_check(running(10, progress_ago=630)) == 31
    # report 200 s old: unresponsive already; the operator ends the run at 240 s
    assert st.next_check(running(200)) == 41
    # nothing live: only events matter
    assert st.next_check(running(10, state="Succeeded")) is None
    idle = running(10)
    idle.suspend = True
    assert st.next_check(idle) is None
    stale = running(10)
    stale.ray_job = {"status": {"rayClusterName": "j-new"}}  # the report is of an earlier run's cluster
    assert st.next_check(stale) is None


def cluster(name: str, created: str, owner: str = "rj-uid", deleting: bool = False) -> dict:
    meta = {"name": name, "namespace": "ns", "uid": f"uid-{name}", "creationTimestamp": created,
            "ownerReferences": [{"kind": "RayJob", "name": "j", "uid": owner, "controller": True}]}
    if deleting:
        meta["deletionTimestamp"] = "2026-11-23T11:59:00Z"
    return {"metadata": meta, "status": {}}


def test_duplicate_clusters_are_the_older_unnamed_ones_of_the_same_ray_job() -> None:
    rj = {"metadata": {"name": "j", "uid": "rj-uid"}, "status": {"rayClusterName": "j-b"}}
    older, named = cluster("j-a", "2026-11-23T11:00:00Z"), cluster("j-b", "2026-11-23T11:00:05Z")
    newer = cluster("j-c", "2026-11-23T11:00:09Z")  # perhaps the next one, named in a status not seen yet
    gone = cluster("j-d", "2026-11-23T10:00:00Z", deleting=True)
    other = cluster("j-e", "2026-11-23T10:00:00Z", owner="an-earlier-rayjob")  # the garbage collector's
    dups = st.duplicate_clusters(rj, [older, named, newer, gone, other])
    assert [c["metadata"]["name"] for c in dups] == ["j-a"]
    # no cluster named (suspended, retrying) or the named one not seen yet: nothing is a duplicate
    assert st.duplicate_clusters({**rj, "status": {}}, [older, named]) == []
    assert st.duplicate_clusters(rj, [older, newer]) == []
    assert st.duplicate_clusters(None, [older]) == []


def test_a_deletion_of_ours_hides_the_object_until_the_watch_shows_it_going() -> None:
    stray = cluster("j-a", "2026-11-23T11:00:00Z")
    c = caches(clusters=[stray, cluster("j-b", "2026-11-23T11:00:05Z")])
    c.remember("RayCluster", ("ns", "j-a"), None)  # deleted by a reconcile: the next one must not delete it again
    assert [x["metadata"]["name"] for x in c.snapshot("ns", "j").clusters] == ["j-b"]
    c.seen("RayCluster", ("ns", "j-a"), {"metadata": {"name": "j-a", "resourceVersion": "3"}})  # an older event
    assert c.overlays() == 1
    c.seen("RayCluster", ("ns", "j-a"), {"metadata": {"name": "j-a", "deletionTimestamp": "2026-11-23T12:00:00Z"}})
    assert c.overlays() == 0


# ------------------------------------------------------------------------------------- requests side by side
def test_independent_requests_run_side_by_side_and_errors_come_after_all_ended() -> None:
    import threading

    from rlhf_operator import children

    barrier = threading.Barrier(3, timeout=5)  # passes only if all three calls run at the same time
    assert children.together(*[lambda i=i: (barrier.wait(), i)[1] for i in range(3)]) == [0, 1, 2]

    ended: list[str] = []

    def fails() -> None:
        raise ValueError("refused")

    def slow() -> str:
        threading.Event().wait(0.2)
        ended.append("slow")
        return "ok"

    try:
        children.together(fails, slow)
    except ValueError as e:
        assert str(e) == "refused"
    else:
        raise AssertionError("the failing call's error was not raised")
    assert ended == ["slow"], "the error was raised before the other request ended"


def test_no_change_detecting_handlers_so_the_empty_diff_base_is_safe() -> None:
    """``handlers.NoDiffBase`` keeps no diff base: valid only while no handler needs one."""
    import kopf

    from rlhf_operator import handlers  # registers the handlers

    registry = kopf.get_default_registry()
    assert not list(registry._changing.get_all_handlers())
    assert not list(registry._spawning.get_all_handlers())
    assert list(registry._watching.get_all_handlers()), "the event handlers are registered"
    assert handlers.NoDiffBase().build(body={"spec": {"a": 1}}) == {}


def test_only_changes_a_reconcile_can_see_and_not_our_own_echo_wake_it() -> None:
    c = cache.Caches()
    pod = {"metadata": {"name": "p", "namespace": "ns", "resourceVersion": "5", "labels": {"ray.io/node-type": "head"}},
           "spec": {"containers": [{"resources": {"requests": {"nvidia.com/gpu": "1"}}}]},
           "status": {"phase": "Pending", "conditions": [{"type": "PodScheduled", "status": "False"}]}}
    assert c.changed("Pod", ("ns", "p"), cache.pod(pod))  # first sight
    later = {**pod, "metadata": {**pod["metadata"], "resourceVersion": "6", "annotations": {"x": "y"}},
             "status": {**pod["status"], "podIP": "10.0.0.1", "hostIP": "10.0.0.2"}}
    assert not c.changed("Pod", ("ns", "p"), cache.pod(later)), "a field no reconcile reads woke it"
    running = {**later, "status": {**later["status"], "phase": "Running"}}
    assert c.changed("Pod", ("ns", "p"), cache.pod(running))
    assert c.changed("Pod", ("ns", "p"), None)  # deleted

    rj = {"metadata": {"name": "j", "namespace": "ns", "resourceVersion": "7"}, "spec": {},
          "status": {"jobDeploymentStatus": "Running", "rayClusterStatus": {"state": "ready"}}}
    assert "rayClusterStatus" not in cache.ray_job(rj)["status"]
    c.changed("RayJob", ("ns", "j"), cache.ray_job(rj))
    copied = {**rj, "status": {**rj["status"], "rayClusterStatus": {"state": "ready", "endpoints": {"a": "1"}}}}
    assert not c.changed("RayJob", ("ns", "j"), cache.ray_job(copied))

    # our own write: its echo (the very resourceVersion) is ours; a newer one is somebody else's change
    c.remember("job", ("ns", "a"), {"metadata": {"resourceVersion": "10"}})
    assert c.seen("job", ("ns", "a"), {"metadata": {"resourceVersion": "10"}}) is True
    c.remember("job", ("ns", "a"), {"metadata": {"resourceVersion": "12"}})
    assert c.seen("job", ("ns", "a"), {"metadata": {"resourceVersion": "13"}}) is False
    assert c.seen("job", ("ns", "b"), {"metadata": {"resourceVersion": "1"}}) is False  # nothing remembered


def test_optional_crd_kinds_are_cached_from_their_events_not_kopf_indexes(monkeypatch) -> None:
    """Kopf holds every handler until each index's watch has listed; the watches of a CRD installed while the
    operator runs start in every watched namespace, so the kinds of optional CRDs must not be Kopf indexes."""
    import kopf

    from rlhf_operator import handlers, sandboxes

    indexed = {(h.selector.group, h.selector.any_name or h.selector.plural)
               for h in kopf.get_default_registry()._indexing.get_all_handlers()}
    assert ("rlhf.dev", "rlhfjobs") in indexed and ("ray.io", "rayjobs") in indexed
    assert not indexed & {("kueue.x-k8s.io", "workloads"), (sandboxes.GROUP, sandboxes.POOLS)}, indexed

    c = cache.Caches()
    monkeypatch.setattr(handlers, "CACHE", c)
    workload, pool = handlers._child_event("Workload"), handlers._child_event("SandboxWarmPool")

    def wl(name: str, rv: str) -> dict:
        return {"kind": "Workload", "metadata": {
            "name": name, "namespace": "ns", "resourceVersion": rv, "creationTimestamp": stamp(int(rv)),
            "ownerReferences": [{"kind": "RayJob", "name": naming.child_names("j").ray_job}]}, "spec": {"active": True}}

    def run(handler, type_, body: dict) -> None:
        meta = body["metadata"]
        asyncio.run(handler(type=type_, body=body, namespace="ns", name=meta["name"], labels=meta.get("labels") or {}))

    run(workload, None, wl("w1", "5"))
    run(workload, "ADDED", wl("w2", "6"))
    assert sorted(w["metadata"]["name"] for w in c.snapshot("ns", "j").workloads) == ["w1", "w2"]
    run(workload, "DELETED", wl("w1", "7"))
    assert [w["metadata"]["name"] for w in c.snapshot("ns", "j").workloads] == ["w2"]

    box = {"kind": "SandboxWarmPool", "metadata": {"name": "j-sandbox", "namespace": "ns", "resourceVersion": "3",
                                                   "labels": {naming.LABEL_JOB: "j"}},
           "spec": {"replicas": 2}, "status": {"readyReplicas": 1}}
    run(pool, "ADDED", box)
    assert c.snapshot("ns", "j").sandbox_pool["spec"]["replicas"] == 2 and c.snapshot("ns", "k").sandbox_pool is None
    run(pool, "DELETED", box)
    assert c.snapshot("ns", "j").sandbox_pool is None
