"""RLHFJobs on the real control plane: placement by the real scheduler on KWOK GPU nodes, ownership,
cascading delete, crash-restart idempotency, suspend, and honest Pending when a job cannot fit."""

from __future__ import annotations

import collections
import signal

import pytest
from kubernetes import client

from rlhf_api import models as m
from rlhf_api.groups import total_gpus
from rlhf_operator import render
from tests.helpers import events_until, free_port, wait_for
from tests.integration.conftest import Operator, apply, load_sample, peering_namespace

pytestmark = pytest.mark.cluster
SAMPLES = ["separate-nccl-tp2", "colocated-ipc-dp", "async-pause-resume", "multinode-trainer"]


def get_job(api, ns: str, name: str) -> dict:
    return client.CustomObjectsApi(api).get_namespaced_custom_object(m.GROUP, m.VERSION, ns, m.PLURAL, name)


def ray_objects(api, ns: str, plural: str) -> list[dict]:
    return client.CustomObjectsApi(api).list_namespaced_custom_object("ray.io", "v1", ns, plural)["items"]


def pods(api, ns: str) -> list[client.V1Pod]:
    return client.CoreV1Api(api).list_namespaced_pod(ns).items


def ray_pods(api, ns: str) -> list[client.V1Pod]:
    return [p for p in pods(api, ns) if "ray.io/cluster" in (p.metadata.labels or {})]


def phase(api, ns: str, name: str) -> str | None:
    return (get_job(api, ns, name).get("status") or {}).get("phase")


def condition(job: dict, ctype: str) -> dict:
    return next(c for c in job["status"]["conditions"] if c["type"] == ctype)


def gpus(pod: client.V1Pod) -> int:
    limits = pod.spec.containers[0].resources.limits or {}
    return int(limits.get(render.GPU, 0))


def make_bound_pvc(api, ns: str, claim: str) -> None:
    """A PVC bound (by the real PV controller) to a pre-made PV, as a storage class would provide."""
    pv = f"{ns}-{claim}"
    client.CoreV1Api(api).create_persistent_volume({
        "metadata": {"name": pv},
        "spec": {"capacity": {"storage": "10Gi"}, "accessModes": ["ReadWriteMany"], "storageClassName": "manual",
                 "hostPath": {"path": f"/tmp/{pv}"}, "claimRef": {"namespace": ns, "name": claim}},
    })
    client.CoreV1Api(api).create_namespaced_persistent_volume_claim(ns, {
        "metadata": {"name": claim},
        "spec": {"accessModes": ["ReadWriteMany"], "storageClassName": "manual", "volumeName": pv,
                 "resources": {"requests": {"storage": "10Gi"}}},
    })
    wait_for(lambda: client.CoreV1Api(api).read_namespaced_persistent_volume_claim(claim, ns).status.phase == "Bound",
             60, f"PVC {claim} Bound")


@pytest.mark.parametrize("sample", SAMPLES)
def test_sample_is_placed_on_gpu_nodes(cluster, api, operator, namespace, sample) -> None:
    job = load_sample(sample)
    name = job["metadata"]["name"]
    spec = m.RLHFJobSpec.model_validate(job["spec"])
    for vol in job["spec"].get("volumes", []):
        if "persistentVolumeClaim" in vol:
            make_bound_pvc(api, namespace, vol["persistentVolumeClaim"]["claimName"])
    pc = job["spec"].get("scheduling", {}).get("priorityClassName")
    if pc:
        apply(cluster, {"apiVersion": "scheduling.k8s.io/v1", "kind": "PriorityClass",
                        "metadata": {"name": pc}, "value": 1000}, namespace)
    apply(cluster, job, namespace)

    body = wait_for(lambda: (get_job(api, namespace, name).get("status") or {}).get("children"), 60, "child names in status")
    assert body == {"configMap": f"{name}-config", "rayJob": name} or body.get("rayJob") == name

    rj = wait_for(lambda: ray_objects(api, namespace, "rayjobs"), 60, "RayJob")
    assert len(rj) == 1
    owner = rj[0]["metadata"]["ownerReferences"][0]
    assert (owner["kind"], owner["name"], owner["controller"]) == ("RLHFJob", name, True)

    expected_pods = 1 + sum(g.replicas for g in render.worker_groups(spec))
    wait_for(lambda: len(ray_pods(api, namespace)) == expected_pods, 120, f"{expected_pods} Ray pods")
    placed = wait_for(
        lambda: all(p.spec.node_name for p in ray_pods(api, namespace)) and ray_pods(api, namespace),
        120, "all Ray pods scheduled",
    )
    by_group = collections.Counter()
    per_node = collections.Counter()
    for p in placed:
        group = p.metadata.labels.get("ray.io/group", "head")
        by_group[group] += gpus(p)
        per_node[p.spec.node_name] += gpus(p)
        assert p.spec.node_name.startswith("gpu-node-")
    want = {g.name: g.replicas * g.gpus for g in render.worker_groups(spec)}
    assert {g: n for g, n in by_group.items() if g != "headgroup" and n} == {g: n for g, n in want.items() if n}
    assert all(n <= 8 for n in per_node.values()), per_node
    assert sum(by_group.values()) == total_gpus(spec)

    wait_for(lambda: all(p.status.phase == "Running" for p in ray_pods(api, namespace)), 120, "pods Running (KWOK)")
    wait_for(lambda: phase(api, namespace, name) == "Running", 120, "phase Running")
    got = get_job(api, namespace, name)
    assert condition(got, "Ready")["status"] == "True"
    assert condition(got, "RayClusterReady")["status"] == "True"
    assert all(c["observedGeneration"] == got["metadata"]["generation"] for c in got["status"]["conditions"])
    table = cluster.kubectl("get", "rlhfjobs", "-n", namespace).stdout
    assert "Running" in table and name in table
    events_until(api, namespace, name, lambda evs: any(e.reason == "Created" and "RayJob" in e.message for e in evs),
                 "a Created Event naming the RayJob")


def test_job_that_cannot_fit_stays_pending_with_reason(cluster, api, operator, namespace) -> None:
    job = load_sample("multinode-trainer")
    job["metadata"]["name"] = "too-big"
    job["spec"]["placement"]["gpusPerNode"] = 16  # the user claims 16-GPU nodes; the pool has 8-GPU nodes
    job["spec"]["trainer"]["gpusPerReplica"] = 16
    apply(cluster, job, namespace)

    def blocked():
        j = get_job(api, namespace, "too-big")
        return j if (j.get("status") or {}).get("phase") == "Pending" and "Insufficient nvidia.com/gpu" in j["status"].get("message", "") else None

    j = wait_for(blocked, 120, "Pending with Insufficient nvidia.com/gpu")
    assert condition(j, "PodsScheduled")["status"] == "False"
    assert condition(j, "Stalled")["status"] == "True"
    assert condition(j, "Ready")["status"] == "False"


def test_missing_priority_class_is_reported(cluster, api, operator, namespace) -> None:
    job = load_sample("separate-nccl-tp2")
    job["spec"]["scheduling"] = {"priorityClassName": "no-such-class"}
    apply(cluster, job, namespace)
    name = job["metadata"]["name"]

    def reported():
        j = get_job(api, namespace, name)
        return j if "no-such-class" in (j.get("status") or {}).get("message", "") else None

    j = wait_for(reported, 120, "a status message naming the missing PriorityClass")
    assert j["status"]["phase"] == "Pending"
    assert condition(j, "Stalled")["status"] == "True"


def test_delete_removes_all_children(cluster, api, operator, namespace) -> None:
    job = load_sample("separate-nccl-tp2")
    apply(cluster, job, namespace)
    name = job["metadata"]["name"]
    wait_for(lambda: phase(api, namespace, name) == "Running", 180, "Running")
    assert ray_objects(api, namespace, "rayclusters")
    cluster.kubectl("delete", "rlhfjob", name, "-n", namespace)
    wait_for(lambda: not ray_objects(api, namespace, "rayjobs"), 60, "RayJob gone")
    wait_for(lambda: not ray_objects(api, namespace, "rayclusters"), 60, "RayCluster gone")
    wait_for(lambda: not ray_pods(api, namespace), 120, "Ray pods gone")
    cms = client.CoreV1Api(api).list_namespaced_config_map(namespace, label_selector=f"rlhf.dev/job={name}").items
    wait_for(lambda: not client.CoreV1Api(api).list_namespaced_config_map(namespace, label_selector=f"rlhf.dev/job={name}").items,
             60, f"ConfigMap gone (had {len(cms)})")


def test_operator_killed_mid_reconcile_creates_no_duplicates(cluster, api, namespace, tmp_path) -> None:
    # A dedicated operator for this namespace only (the session operator watches it-* and this is rs-*).
    ns = "rs-" + namespace[3:]
    client.CoreV1Api(api).create_namespace({"metadata": {"name": ns}})
    op = Operator(cluster, ["--namespace", ns], tmp_path / "op.log").start()
    try:
        names = []
        for i in range(3):
            job = load_sample("separate-nccl-tp2")
            job["metadata"]["name"] = f"crash-{i}"
            names.append(job["metadata"]["name"])
            apply(cluster, job, ns)
        # Kill -9 as soon as the first child exists: the others are mid-flight.
        wait_for(lambda: ray_objects(api, ns, "rayjobs") or
                 client.CoreV1Api(api).list_namespaced_config_map(ns, label_selector="rlhf.dev/job").items,
                 60, "first child")
        op.kill(signal.SIGKILL)
        op.start()
        for n in names:
            wait_for(lambda n=n: phase(api, ns, n) == "Running", 240, f"{n} Running after restart")
        op.kill(signal.SIGKILL)  # and once more while everything is running
        op.start()
        wait_for(lambda: all(phase(api, ns, n) == "Running" for n in names), 60, "still Running")
        rjs = ray_objects(api, ns, "rayjobs")
        assert sorted(r["metadata"]["name"] for r in rjs) == names
        rcs = ray_objects(api, ns, "rayclusters")
        assert len(rcs) == 3, [r["metadata"]["name"] for r in rcs]
        cms = client.CoreV1Api(api).list_namespaced_config_map(ns, label_selector="rlhf.dev/job").items
        assert sorted(c.metadata.name for c in cms) == [f"{n}-config" for n in names]
    finally:
        op.kill(signal.SIGTERM)
        client.CoreV1Api(api).delete_namespace(ns)


def test_suspend_and_resume(cluster, api, operator, namespace) -> None:
    job = load_sample("separate-nccl-tp2")
    name = job["metadata"]["name"]
    apply(cluster, job, namespace)
    wait_for(lambda: phase(api, namespace, name) == "Running", 180, "Running")
    job["spec"]["suspend"] = True
    apply(cluster, job, namespace)
    wait_for(lambda: phase(api, namespace, name) == "Suspended", 120, "Suspended")
    wait_for(lambda: not ray_pods(api, namespace), 120, "Ray pods released while suspended")
    job["spec"]["suspend"] = False
    apply(cluster, job, namespace)
    wait_for(lambda: phase(api, namespace, name) == "Running", 180, "Running again after resume")


def test_runtime_mismatch_warning_is_a_condition_and_one_warning_event(cluster, api, operator, namespace) -> None:
    """The runtime reports a trainer-vs-engine mismatch spike after a sync (status.runtime.warning, written as the
    runtime writes it: a merge patch of the status subresource): EnginesInSync turns False with one Warning Event;
    the next step's report without it turns it True again. Dropped samples (status.data) turn SamplesValid False
    with a Warning Event the same way."""
    job = load_sample("separate-nccl-tp2")
    name = job["metadata"]["name"]
    apply(cluster, job, namespace)
    wait_for(lambda: phase(api, namespace, name) == "Running", 180, "Running")
    warning = "step 7: the trainer-vs-engine mismatch (mismatch_kl 0.31) is 1400x its median"

    def report(warning: str | None) -> None:
        client.CustomObjectsApi(api).patch_namespaced_custom_object_status(
            m.GROUP, m.VERSION, namespace, m.PLURAL, name,
            {"status": {"step": 7, "throughput": {"mismatchKl": 0.31 if warning else 2e-4},
                        "runtime": {"state": "Running", "warning": warning}}})

    def engines_in_sync() -> dict:
        return next((c for c in get_job(api, namespace, name)["status"].get("conditions") or []
                     if c["type"] == "EnginesInSync"), {})

    report(warning)
    wait_for(lambda: engines_in_sync().get("status") == "False", 60, "EnginesInSync=False")
    assert engines_in_sync()["reason"] == "MismatchSpike" and engines_in_sync()["message"] == warning
    assert phase(api, namespace, name) == "Running"  # a warning, not a failure
    events_until(api, namespace, name, lambda evs: any(e.type == "Warning" and e.reason == "MismatchSpike"
                                                       and e.message == warning for e in evs), "a MismatchSpike Warning")
    report(None)
    wait_for(lambda: engines_in_sync().get("status") == "True", 60, "EnginesInSync=True once the warning is gone")
    assert "warning" not in get_job(api, namespace, name)["status"]["runtime"]
    spikes = [e for e in client.CoreV1Api(api).list_namespaced_event(namespace).items
              if e.reason == "MismatchSpike" and e.involved_object.name == name]
    assert len(spikes) == 1 and (spikes[0].count or 1) == 1, spikes

    # samples the runtime dropped before the first step (data.invalidSamples drop): SamplesValid False, one Event
    dropped = "spec.data: 10 of 100 samples cannot run: 10 too long for the engines' context (lines 3, 9, ...)"
    client.CustomObjectsApi(api).patch_namespaced_custom_object_status(
        m.GROUP, m.VERSION, namespace, m.PLURAL, name,
        {"status": {"data": {"samples": 90, "dropped": 10, "message": dropped}}})

    def samples_valid() -> dict:
        return next((c for c in get_job(api, namespace, name)["status"].get("conditions") or []
                     if c["type"] == "SamplesValid"), {})

    wait_for(lambda: samples_valid().get("status") == "False", 60, "SamplesValid=False")
    assert samples_valid()["reason"] == "SamplesDropped" and samples_valid()["message"] == dropped
    events_until(api, namespace, name, lambda evs: any(e.type == "Warning" and e.reason == "SamplesDropped"
                                                       and e.message == dropped for e in evs), "a SamplesDropped Warning")


def test_allowed_spec_change_reaches_config_and_status(cluster, api, operator, namespace) -> None:
    job = load_sample("separate-nccl-tp2")
    name = job["metadata"]["name"]
    apply(cluster, job, namespace)
    wait_for(lambda: phase(api, namespace, name) == "Running", 180, "Running")
    job["spec"]["algorithm"]["steps"] = 321
    job["spec"]["activeDeadlineSeconds"] = 7200
    job["spec"]["backoffLimit"] = 2
    job["spec"]["ttlSecondsAfterFinished"] = 30
    apply(cluster, job, namespace)

    def propagated() -> bool:
        st = get_job(api, namespace, name)["status"]
        cm = client.CoreV1Api(api).read_namespaced_config_map(f"{name}-config", namespace)
        cfg = m.RuntimeConfig.model_validate_json(cm.data["job.json"])
        rj = client.CustomObjectsApi(api).get_namespaced_custom_object("ray.io", "v1", namespace, "rayjobs", name)
        applied = (rj["spec"].get("activeDeadlineSeconds"), rj["spec"].get("backoffLimit"),
                   rj["spec"].get("ttlSecondsAfterFinished"))
        return (st["totalSteps"] == 321 and cfg.spec.algorithm.steps == 321 and st["observedGeneration"] == 2
                and applied == (7200, 2, 30))

    wait_for(propagated, 60, "steps=321 in status and the runtime's ConfigMap; deadline, retries, ttl in the RayJob")
    events_until(api, namespace, name,
                 lambda evs: any(e.reason == "Updated" and "activeDeadlineSeconds" in e.message for e in evs),
                 "an Updated Event naming activeDeadlineSeconds")
    # a change outside the allowlist is refused at admission, naming the field
    job["spec"]["env"] = [{"name": "X", "value": "1"}]
    out = apply(cluster, job, namespace, check=False)
    assert out.returncode != 0 and "spec.env cannot change on a submitted job" in out.stderr, out.stderr


def test_liveness_endpoint_reports_kuberay(cluster, tmp_path) -> None:
    import json as _json
    import urllib.request

    port = free_port()
    op = Operator(cluster, ["--namespace", "liveness-only", "--liveness", f"http://127.0.0.1:{port}/healthz"],
                  tmp_path / "op.log").start()
    try:
        body = wait_for(lambda: urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=2).read(), 60,
                        "liveness endpoint")
        assert _json.loads(body)["kuberay"] == "ok"
    finally:
        op.kill()


def test_two_peered_replicas_one_active_no_duplicates(cluster, api, tmp_path) -> None:
    ns = peering_namespace(cluster, api, "peer")
    ops = [Operator(cluster, ["--namespace", ns, "--peering", "rlhf", "--priority", str(p)], tmp_path / f"op{p}.log")
           for p in (10, 20)]

    def peers() -> int:
        obj = client.CustomObjectsApi(api).get_namespaced_custom_object("kopf.dev", "v1", ns, "kopfpeerings", "rlhf")
        return len([v for v in (obj.get("status") or {}).values() if v])

    try:
        # Start the second replica once the first has announced itself, so the first sees it arrive (a peer
        # that joins unseen is only noticed at its next keep-alive).
        ops[0].start()
        wait_for(lambda: peers() == 1, 60, "the first replica in the peering object")
        ops[1].start()
        wait_for(lambda: "Pausing operations in favour of" in (tmp_path / "op10.log").read_text(), 120,
                 "the lower-priority replica to pause")
        for i in range(2):
            job = load_sample("separate-nccl-tp2")
            job["metadata"]["name"] = f"peer-{i}"
            apply(cluster, job, ns)
        for i in range(2):
            wait_for(lambda i=i: phase(api, ns, f"peer-{i}") == "Running", 180, f"peer-{i} Running")
        assert sorted(r["metadata"]["name"] for r in ray_objects(api, ns, "rayjobs")) == ["peer-0", "peer-1"]
        assert len(ray_objects(api, ns, "rayclusters")) == 2
        assert "Pausing operations" not in (tmp_path / "op20.log").read_text()
    finally:
        for op in ops:
            op.kill()
        client.CoreV1Api(api).delete_namespace(ns)


def test_missing_data_config_map_is_reported_until_it_exists(cluster, api, operator, namespace) -> None:
    job = load_sample("separate-nccl-tp2")  # data.configMap: gsm8k-prompts / prompts.jsonl
    name = job["metadata"]["name"]
    apply(cluster, job, namespace, data=False)

    def cond(ctype: str) -> dict:
        return condition(get_job(api, namespace, name), ctype)

    wait_for(lambda: cond("DataAvailable")["status"] == "False", 60, "DataAvailable=False")
    assert "gsm8k-prompts" in cond("DataAvailable")["message"]
    assert cond("Stalled")["reason"] == "DataConfigMapMissing"
    # not Running while no pod could mount its data; no RayJob (its pods would hold GPUs and never start)
    assert phase(api, namespace, name) == "Pending" and cond("Ready")["reason"] == "DataConfigMapMissing"
    assert not client.CustomObjectsApi(api).list_namespaced_custom_object(
        "ray.io", "v1", namespace, "rayjobs", label_selector=f"rlhf.dev/job={name}")["items"]
    events_until(api, namespace, name, lambda evs: any(e.type == "Warning" and e.reason == "DataConfigMapMissing"
                                                       for e in evs), "a DataConfigMapMissing Warning")

    client.CoreV1Api(api).create_namespaced_config_map(
        namespace, {"metadata": {"name": "gsm8k-prompts"}, "data": {"prompts.jsonl": '{"prompt": "1+1?"}\n'}}
    )
    wait_for(lambda: cond("DataAvailable")["status"] == "True" and cond("Stalled")["status"] == "False", 60,
             "DataAvailable=True once the ConfigMap exists")
    wait_for(lambda: phase(api, namespace, name) == "Running", 120, "Running once its data exists")
