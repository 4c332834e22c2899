"""The event-driven operator on the real control plane: one Event per transition, reconciles that read only the
watch caches, no finalizer (a job deletes without an operator; the finalizer of older operators is removed),
and a RayJob's duplicate RayCluster deleted."""

from __future__ import annotations

import collections
import json
import signal
import uuid

import pytest
from kubernetes import client

from rlhf_api import models as m
from tests.helpers import audit_lines, touch_pod_scheduled, wait_for
from tests.integration.conftest import Operator, apply, load_sample
from tests.integration.test_lifecycle import get_job, phase, ray_objects

pytestmark = pytest.mark.cluster


def job_events(api, ns: str, name: str) -> list[client.CoreV1Event]:
    return client.CoreV1Api(api).list_namespaced_event(ns, field_selector=f"involvedObject.name={name}").items


def audit_since(cluster, start: str, ns: str) -> list[dict]:
    """The operator's audited requests in ``ns`` after ``start`` (the policy logs every write and every request on
    rlhf.dev and ray.io objects)."""
    return [e for e in map(json.loads, audit_lines(cluster.audit_log))
            if e["stageTimestamp"] > start and (e.get("objectRef") or {}).get("namespace") == ns
            and e.get("userAgent", "").startswith(("OpenAPI-Generator", "kopf")) and e["verb"] != "watch"]


def last_audit_stamp(cluster) -> str:
    return json.loads(audit_lines(cluster.audit_log)[-1])["stageTimestamp"]


def test_each_transition_posts_one_event_and_reconciles_read_only_caches(cluster, api, operator, namespace) -> None:
    job = load_sample("separate-nccl-tp2")
    name = job["metadata"]["name"]
    apply(cluster, job, namespace, data=False)  # first without its data ConfigMap: Pending, then it appears
    wait_for(lambda: any(e.reason == "DataConfigMapMissing" for e in job_events(api, namespace, name)), 60,
             "DataConfigMapMissing Event")
    apply(cluster, {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "gsm8k-prompts"},
                    "data": {"prompts.jsonl": '{"prompt": "1+1?"}\n'}}, namespace)
    wait_for(lambda: phase(api, namespace, name) == "Running", 180, "Running once the data exists")
    # Events are posted off the reconcile's path, after the status write: the Running one may land after the phase.
    wait_for(lambda: any(e.reason == "Running" for e in job_events(api, namespace, name)), 60, "the Running Event")

    # Many events of the job's children after it settled: pods annotated (events no reconcile reads: they wake
    # none) and their PodScheduled condition touched (a field the reconcile reads: each wakes one, which finds
    # nothing to do). Neither may make a request.
    core = client.CoreV1Api(api)
    start = last_audit_stamp(cluster)
    base = operator.reconciles(namespace, name)
    pods = core.list_namespaced_pod(namespace, label_selector=f"rlhf.dev/job={name}").items
    for i in range(3):
        for p in pods:
            core.patch_namespaced_pod(p.metadata.name, namespace, {"metadata": {"annotations": {"test/poke": str(i)}}})
            touch_pod_scheduled(core, namespace, p.metadata.name, i)
        wait_for(lambda i=i: operator.reconciles(namespace, name) >= base + i + 1, 60, f"reconcile after poke {i}")
    theirs = [f"{e['verb']} {e['requestURI']}" for e in audit_since(cluster, start, namespace)
              if not (e["verb"] == "patch" and (e.get("objectRef") or {}).get("resource") == "pods")]  # our pokes
    assert theirs == [], f"a settled job's reconciles made requests: {theirs}"

    events = job_events(api, namespace, name)
    seen = collections.Counter((e.reason, (e.message or "").split(" ")[0]) for e in events)
    for e in events:
        assert (e.count or 1) == 1, f"{e.reason} posted {e.count} times"
    print(f"\n[events] {dict(seen)}")
    assert all(n == 1 for n in seen.values()), seen
    for want in [("Pending", "ConfigMap"), ("DataConfigMapMissing", "ConfigMap"), ("Created", "ConfigMap"),
                 ("Created", "RayJob"), ("Provisioning", "Ray"), ("Running", "the")]:
        assert want in seen, (want, seen)
    # no finalizer on a job of this operator
    assert not get_job(api, namespace, name)["metadata"].get("finalizers")


def test_no_finalizer_old_one_removed_and_delete_works_without_an_operator(cluster, api, tmp_path) -> None:
    ns = f"ed-{uuid.uuid4().hex[:6]}"  # not it-*: an operator of its own, stopped below
    client.CoreV1Api(api).create_namespace({"metadata": {"name": ns}})
    co = client.CustomObjectsApi(api)
    op = Operator(cluster, ["--namespace", ns], tmp_path / "op.log").start()
    try:
        job = load_sample("separate-nccl-tp2")
        job["metadata"]["finalizers"] = ["rlhf.dev/finalizer"]  # as an older operator (resync timer) left it
        apply(cluster, job, ns)
        name = job["metadata"]["name"]
        wait_for(lambda: not get_job(api, ns, name)["metadata"].get("finalizers"), 60, "the old finalizer removed")
        wait_for(lambda: phase(api, ns, name) == "Running", 180, "Running")
        op.kill(signal.SIGKILL)
        co.delete_namespaced_custom_object(m.GROUP, m.VERSION, ns, m.PLURAL, name)
        wait_for(lambda: not co.list_namespaced_custom_object(m.GROUP, m.VERSION, ns, m.PLURAL)["items"], 30,
                 "the job deleted with no operator running")
        wait_for(lambda: not ray_objects(api, ns, "rayjobs") and not ray_objects(api, ns, "rayclusters"), 120,
                 "its RayJob and RayCluster garbage-collected")
    finally:
        op.kill(signal.SIGTERM)
        client.CoreV1Api(api).delete_namespace(ns)


def test_a_ray_jobs_older_second_cluster_is_deleted(cluster, api, operator, namespace) -> None:
    """A RayCluster owned by the RayJob beside the one its status names, and older (what a lost race of
    KubeRay's leaves: two clusters, both holding GPUs): the operator deletes it, says so, keeps the named one."""
    co = client.CustomObjectsApi(api)
    job = load_sample("separate-nccl-tp2")
    name = job["metadata"]["name"]
    job["spec"]["suspend"] = True  # KubeRay makes no cluster for a suspended RayJob
    apply(cluster, job, namespace)
    rj = wait_for(lambda: next((r for r in ray_objects(api, namespace, "rayjobs")
                                if (r.get("status") or {}).get("jobDeploymentStatus") == "Suspended"), None),
                  120, "the RayJob Suspended")
    dup = {
        "apiVersion": "ray.io/v1", "kind": "RayCluster",
        "metadata": {"name": f"{name}-stray", "labels": {"rlhf.dev/job": name},
                     "ownerReferences": [{"apiVersion": "ray.io/v1", "kind": "RayJob", "name": name,
                                          "uid": rj["metadata"]["uid"], "controller": True}]},
        "spec": rj["spec"]["rayClusterSpec"],
    }
    co.create_namespaced_custom_object("ray.io", "v1", namespace, "rayclusters", dup)
    base = operator.reconciles(namespace, name)
    wait_for(lambda: operator.reconciles(namespace, name) > base, 60, "a reconcile after the stray cluster appeared")
    # the RayJob names no cluster while suspended: nothing to compare with, the stray one stays
    assert [c["metadata"]["name"] for c in ray_objects(api, namespace, "rayclusters")] == [f"{name}-stray"]

    co.patch_namespaced_custom_object(m.GROUP, m.VERSION, namespace, m.PLURAL, name, {"spec": {"suspend": False}})
    named = wait_for(lambda: (co.get_namespaced_custom_object("ray.io", "v1", namespace, "rayjobs", name).get("status")
                              or {}).get("rayClusterName"), 120, "KubeRay naming the RayJob's cluster")
    wait_for(lambda: [c["metadata"]["name"] for c in ray_objects(api, namespace, "rayclusters")
                      if not c["metadata"].get("deletionTimestamp")] == [named], 60, "only the named cluster left")
    ev = [e for e in job_events(api, namespace, name) if e.reason == "DuplicateRayClusterDeleted"]
    assert len(ev) == 1 and ev[0].type == "Warning" and f"{name}-stray" in ev[0].message, ev
    wait_for(lambda: phase(api, namespace, name) == "Running", 180, "Running on the named cluster")
