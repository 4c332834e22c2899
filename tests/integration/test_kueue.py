"""RLHFJobs under the real Kueue (``spec.scheduling.queueName``): the real Kueue manager (built from
``sigs.k8s.io/kueue``, ``ray.io/rayjob`` integration) admits the operator's RayJobs against a ClusterQueue quota
of fake GPUs on KWOK nodes.

Contract: the RayJob is created suspended with the queue label and the operator never writes it again (Kueue
owns ``suspend``); held by Kueue = ``Pending``/``Queued`` with Kueue's reason; admitted = it runs; preempted =
``Suspended``/``Preempted`` (never ``Failed``) and runs again when re-admitted; ``spec.suspend`` of a queued
job deactivates its Kueue Workload (``spec.active``) instead of touching the RayJob.
"""

from __future__ import annotations

import collections
import json
import threading

import pytest
from kubernetes import client, watch

from rlhf_api import models as m
from tests.helpers import audit_lines, wait_for
from tests.integration.conftest import apply, load_sample

pytestmark = pytest.mark.cluster

KUEUE, KUEUE_V = "kueue.x-k8s.io", "v1beta2"
QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
SAMPLE = "separate-nccl-tp2"  # 3 GPUs: trainer 1 + one TP2 engine
JOB_GPUS = 3


# ------------------------------------------------------------------------------------------------ helpers
def get_job(api, ns: str, name: str) -> dict:
    return client.CustomObjectsApi(api).get_namespaced_custom_object(m.GROUP, m.VERSION, ns, m.PLURAL, name)


def status(api, ns: str, name: str) -> dict:
    return get_job(api, ns, name).get("status") or {}


def cond(obj: dict, ctype: str) -> dict:
    return next((c for c in (obj.get("status") or {}).get("conditions") or [] if c["type"] == ctype), {})


def ready_reason(api, ns: str, name: str) -> tuple[str | None, str | None]:
    job = get_job(api, ns, name)
    return (job.get("status") or {}).get("phase"), cond(job, "Ready").get("reason")


def ray_job(api, ns: str, name: str) -> dict:
    return client.CustomObjectsApi(api).get_namespaced_custom_object("ray.io", "v1", ns, "rayjobs", name)


def ray_pods(api, ns: str, job: str) -> list[client.V1Pod]:
    pods = client.CoreV1Api(api).list_namespaced_pod(ns, label_selector=f"rlhf.dev/job={job}").items
    return [p for p in pods if "ray.io/cluster" in (p.metadata.labels or {})]


def workload(api, ns: str, rayjob: str) -> dict | None:
    """The Kueue Workload Kueue made for the RayJob (found by its owner reference)."""
    items = client.CustomObjectsApi(api).list_namespaced_custom_object(KUEUE, KUEUE_V, ns, "workloads")["items"]
    for w in items:
        if any(o["kind"] == "RayJob" and o["name"] == rayjob for o in w["metadata"].get("ownerReferences", [])):
            return w
    return None


def queued_job(name: str, queue: str, priority_class: str | None = None) -> dict:
    job = load_sample(SAMPLE)
    job["metadata"]["name"] = name
    job["spec"]["scheduling"] = {"queueName": queue, **({"priorityClassName": priority_class} if priority_class else {})}
    return job


class History:
    """Every (phase, Ready reason) written to the RLHFJobs of a namespace, from a watch (no polling gaps)."""

    def __init__(self, api, ns: str):
        self.seen: dict[str, list[tuple[str | None, str | None]]] = collections.defaultdict(list)
        self._api, self._ns, self._w, self._stop = api, ns, watch.Watch(), threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        co = client.CustomObjectsApi(self._api)
        rv = None  # a re-opened watch goes on from the last event seen, so no write falls between two watches
        while not self._stop.is_set():
            try:
                for ev in self._w.stream(co.list_namespaced_custom_object, m.GROUP, m.VERSION, self._ns, m.PLURAL,
                                         timeout_seconds=30, **({"resource_version": rv} if rv else {})):
                    obj = ev["object"]
                    rv = obj["metadata"]["resourceVersion"]
                    entry = ((obj.get("status") or {}).get("phase"), cond(obj, "Ready").get("reason"))
                    log = self.seen[obj["metadata"]["name"]]
                    if entry[0] and (not log or log[-1] != entry):
                        log.append(entry)
            except Exception:  # noqa: BLE001 - the watch is re-opened until stopped (a list again after 410 Gone)
                rv = None
                if self._stop.is_set():
                    return

    def stop(self) -> None:
        self._stop.set()
        self._w.stop()

    def phases(self, name: str) -> list[str | None]:
        return [p for p, _ in self.seen[name]]


@pytest.fixture
def history(api, namespace):
    h = History(api, namespace)
    yield h
    h.stop()


def audit_events(cluster) -> list[dict]:
    return [json.loads(line) for line in audit_lines(cluster.audit_log) if line.strip()]


def writer(event: dict) -> tuple[str, str]:
    return event["user"]["username"], event.get("userAgent", "")


def operator_identity(cluster, ns: str, rayjob: str) -> tuple[str, str]:
    """(user, user agent) of whoever created the RayJob: the operator."""
    creates = [e for e in audit_events(cluster)
               if e["verb"] == "create" and e["objectRef"].get("resource") == "rayjobs"
               and e["objectRef"].get("namespace") == ns and (e.get("responseStatus") or {}).get("code") == 201
               and e["objectRef"].get("name") in (rayjob, None)]
    assert creates, f"no audited create of RayJob {ns}/{rayjob}"
    return writer(creates[0])


def operator_rayjob_writes(cluster, ns: str, rayjob: str, who: tuple[str, str]) -> list[dict]:
    """The operator's update/patch requests to the RayJob itself (not its status)."""
    return [e for e in audit_events(cluster)
            if e["verb"] in ("update", "patch") and e["objectRef"].get("resource") == "rayjobs"
            and e["objectRef"].get("namespace") == ns and e["objectRef"].get("name") == rayjob
            and not e["objectRef"].get("subresource") and writer(e) == who]


@pytest.fixture
def queue(kueue, cluster, api, namespace):
    """make(gpus, preemption=None) -> LocalQueue name: a ResourceFlavor, a ClusterQueue with a quota of
    ``gpus`` fake GPUs (cpu and memory ample) and a LocalQueue in the test's namespace."""
    made: list[tuple[str, str]] = []

    def make(gpus: int, preemption: dict | None = None) -> str:
        tag = namespace.removeprefix("it-")
        flavor, cq, lq = f"kwok-gpu-{tag}", f"rlhf-{tag}", "rlhf-queue"
        cq_spec = {
            "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": namespace}},
            "resourceGroups": [{"coveredResources": ["cpu", "memory", "nvidia.com/gpu"], "flavors": [{
                "name": flavor, "resources": [
                    {"name": "cpu", "nominalQuota": "1000"},
                    {"name": "memory", "nominalQuota": "10Ti"},
                    {"name": "nvidia.com/gpu", "nominalQuota": str(gpus)},
                ]}]}],
        }
        if preemption:
            cq_spec["preemption"] = preemption
        objs = [
            {"apiVersion": f"{KUEUE}/{KUEUE_V}", "kind": "ResourceFlavor", "metadata": {"name": flavor}},
            {"apiVersion": f"{KUEUE}/{KUEUE_V}", "kind": "ClusterQueue", "metadata": {"name": cq}, "spec": cq_spec},
            {"apiVersion": f"{KUEUE}/{KUEUE_V}", "kind": "LocalQueue", "metadata": {"name": lq, "namespace": namespace},
             "spec": {"clusterQueue": cq}},
        ]
        made.extend([("resourceflavor", flavor), ("clusterqueue", cq)])
        cluster.kubectl("apply", "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List", "items": objs}))
        co = client.CustomObjectsApi(api)
        wait_for(lambda: cond(co.get_cluster_custom_object(KUEUE, KUEUE_V, "clusterqueues", cq), "Active")
                 .get("status") == "True", 60, f"ClusterQueue {cq} Active")
        wait_for(lambda: cond(co.get_namespaced_custom_object(KUEUE, KUEUE_V, namespace, "localqueues", lq),
                              "Active").get("status") == "True", 60, f"LocalQueue {lq} Active")
        return lq

    yield make
    for kind, name in reversed(made):  # their workloads go with the namespace; Kueue's finalizers wait for that
        cluster.kubectl("delete", kind, name, "--wait=false", "--ignore-not-found", check=False)


def priority_classes(cluster, namespace: str, **values: int) -> dict[str, str]:
    names = {k: f"{k}-{namespace}" for k in values}
    items = [{"apiVersion": "scheduling.k8s.io/v1", "kind": "PriorityClass", "metadata": {"name": names[k]},
              "value": v} for k, v in values.items()]
    cluster.kubectl("apply", "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List", "items": items}))
    return names


def assert_held_by_kueue(api, ns: str, name: str, queue: str) -> dict:
    rj = ray_job(api, ns, name)
    assert rj["spec"]["suspend"] is True
    assert rj["metadata"]["labels"][QUEUE_LABEL] == queue
    assert not ray_pods(api, ns, name), "a job Kueue holds has no Ray pods"
    return rj


# -------------------------------------------------------------------------------------------------- tests
def test_job_beyond_quota_waits_then_is_admitted_when_quota_frees(cluster, api, operator, namespace, queue, history):
    lq = queue(gpus=JOB_GPUS + 1)  # room for one job
    apply(cluster, queued_job("first", lq), namespace)
    wait_for(lambda: ready_reason(api, namespace, "first")[0] == "Running", 180, "first Running")
    assert cond(get_job(api, namespace, "first"), "Admitted").get("status") == "True"

    apply(cluster, queued_job("second", lq), namespace)

    def queued_with_kueue_message():
        j, w = get_job(api, namespace, "second"), workload(api, namespace, "second")
        kueue_msg = cond(w or {}, "QuotaReserved").get("message", "")
        st = j.get("status") or {}
        if st.get("phase") == "Pending" and cond(j, "Ready").get("reason") == "Queued" and kueue_msg \
                and kueue_msg in st.get("message", "") and kueue_msg in cond(j, "Ready").get("message", ""):
            return j, w
        return None

    j, w = wait_for(queued_with_kueue_message, 120, "second Pending/Queued with the Workload's QuotaReserved message")
    assert "insufficient" in cond(w, "QuotaReserved")["message"], cond(w, "QuotaReserved")
    assert cond(w, "QuotaReserved")["status"] == "False"
    assert cond(j, "Admitted")["status"] == "False"
    assert_held_by_kueue(api, namespace, "second", lq)
    assert set(history.phases("second")) == {"Pending"}, history.seen["second"]

    cluster.kubectl("delete", "rlhfjob", "first", "-n", namespace)
    wait_for(lambda: ready_reason(api, namespace, "second")[0] == "Running", 240, "second Running once quota frees")
    j = get_job(api, namespace, "second")
    assert cond(j, "Admitted")["status"] == "True"
    assert cond(workload(api, namespace, "second"), "Admitted")["status"] == "True"
    assert ray_job(api, namespace, "second")["spec"].get("suspend", False) is False
    seen = history.phases("second")
    assert "Failed" not in seen, history.seen["second"]
    queued_at = history.seen["second"].index(("Pending", "Queued"))
    after = seen[queued_at:]
    assert "Provisioning" in after and after.index("Provisioning") < after.index("Running"), history.seen["second"]

    who = operator_identity(cluster, namespace, "second")
    for name in ("first", "second"):
        assert operator_rayjob_writes(cluster, namespace, name, who) == [], f"the operator wrote RayJob {name}"


def test_preempted_job_is_suspended_not_failed_and_runs_again(cluster, api, operator, namespace, queue, history):
    pcs = priority_classes(cluster, namespace, low=100, high=1000)
    try:
        lq = queue(gpus=JOB_GPUS + 1, preemption={"withinClusterQueue": "LowerPriority"})
        apply(cluster, queued_job("low", lq, pcs["low"]), namespace)
        wait_for(lambda: ready_reason(api, namespace, "low")[0] == "Running", 180, "low Running")
        assert workload(api, namespace, "low")["spec"]["priority"] == 100

        apply(cluster, queued_job("high", lq, pcs["high"]), namespace)
        wait_for(lambda: ready_reason(api, namespace, "low") == ("Suspended", "Preempted"), 180,
                 "low Suspended/Preempted")
        w = workload(api, namespace, "low")
        assert cond(w, "Evicted").get("status") == "True" and cond(w, "Evicted").get("reason") == "Preempted", w["status"]
        low = get_job(api, namespace, "low")
        assert cond(low, "Admitted")["status"] == "False"
        wait_for(lambda: ready_reason(api, namespace, "high")[0] == "Running", 240, "high Running")
        wait_for(lambda: not ray_pods(api, namespace, "low"), 120, "the preempted job's Ray pods gone")
        assert_held_by_kueue(api, namespace, "low", lq)
        assert ready_reason(api, namespace, "low") == ("Suspended", "Preempted")

        cluster.kubectl("delete", "rlhfjob", "high", "-n", namespace)
        wait_for(lambda: ready_reason(api, namespace, "low")[0] == "Running", 240, "low Running again once re-admitted")
        assert cond(get_job(api, namespace, "low"), "Admitted")["status"] == "True"
        seen = history.phases("low")
        assert "Failed" not in seen, history.seen["low"]
        assert ("Suspended", "Preempted") in history.seen["low"], history.seen["low"]
        assert seen.index("Suspended") < len(seen) - 1 - seen[::-1].index("Running"), history.seen["low"]

        who = operator_identity(cluster, namespace, "low")
        for name in ("low", "high"):
            assert operator_rayjob_writes(cluster, namespace, name, who) == [], f"the operator wrote RayJob {name}"
    finally:
        cluster.kubectl("delete", "priorityclass", *pcs.values(), "--ignore-not-found", check=False)


def test_spec_suspend_toggles_the_workload_not_the_rayjob(cluster, api, operator, namespace, queue, history):
    lq = queue(gpus=JOB_GPUS + 1)
    job = queued_job("toggled", lq)
    apply(cluster, job, namespace)
    wait_for(lambda: ready_reason(api, namespace, "toggled")[0] == "Running", 180, "Running")
    assert workload(api, namespace, "toggled")["spec"].get("active", True) is True

    job["spec"]["suspend"] = True
    apply(cluster, job, namespace)
    wait_for(lambda: workload(api, namespace, "toggled")["spec"].get("active") is False, 60,
             "the operator deactivates the Workload")
    wait_for(lambda: ready_reason(api, namespace, "toggled")[0] == "Suspended", 120, "Suspended")
    wait_for(lambda: cond(workload(api, namespace, "toggled"), "Evicted").get("status") == "True", 60,
             "Kueue evicts the deactivated Workload")
    wait_for(lambda: not ray_pods(api, namespace, "toggled"), 120, "Ray pods gone while suspended")
    assert ray_job(api, namespace, "toggled")["spec"]["suspend"] is True

    job["spec"]["suspend"] = False
    apply(cluster, job, namespace)
    wait_for(lambda: workload(api, namespace, "toggled")["spec"].get("active", True) is True, 60,
             "the operator reactivates the Workload")
    wait_for(lambda: ready_reason(api, namespace, "toggled")[0] == "Running", 240, "Running again")
    assert "Failed" not in history.phases("toggled"), history.seen["toggled"]

    who = operator_identity(cluster, namespace, "toggled")
    assert operator_rayjob_writes(cluster, namespace, "toggled", who) == [], "the operator wrote the RayJob"
    wl_patches = [e for e in audit_events(cluster) if e["verb"] == "patch" and writer(e) == who
                  and e["objectRef"].get("resource") == "workloads" and e["objectRef"].get("namespace") == namespace]
    assert len(wl_patches) >= 2, "spec.active false and then true, patched by the operator"
