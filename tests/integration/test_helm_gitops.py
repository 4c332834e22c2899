"""The chart on the real apiserver: install, the operator reconciling with only the chart's RBAC, upgrade,
uninstall (CRDs kept); GitOps hygiene: reapplying an unchanged manifest writes nothing."""

from __future__ import annotations

import json
import uuid

import pytest
import yaml
from kubernetes import client

from tests.helpers import audit_lines, events_until, touch_pod_scheduled, wait_for
from tests.integration.conftest import REPO, Operator, apply, load_sample
from tests.integration.test_lifecycle import get_job, phase

pytestmark = pytest.mark.cluster
CHART = REPO / "charts" / "rlhf-operator"


def helm(cluster, *args: str, check: bool = True):
    import subprocess

    out = subprocess.run([str(cluster.bin / "helm"), "--kubeconfig", str(cluster.kubeconfig), *args],
                         capture_output=True, text=True, check=False)
    if check:
        assert out.returncode == 0, out.stderr
    return out


def test_operator_runs_with_only_the_charts_rbac(cluster, api, tmp_path) -> None:
    suffix = uuid.uuid4().hex[:6]
    system, team = f"rlhf-system-{suffix}", f"team-{suffix}"
    for ns in (system, team):
        client.CoreV1Api(api).create_namespace({"metadata": {"name": ns}})
    release = f"r{suffix}"
    helm(cluster, "install", release, str(CHART), "-n", system, "--set", "watch.scope=namespaces",
         "--set", f"watch.watchNamespaces={{{team}}}", "--wait=false")
    try:
        dep = client.AppsV1Api(api).read_namespaced_deployment(f"{release}-rlhf-operator", system)
        assert dep.spec.template.spec.containers[0].args[0] == f"--namespace={team}"
        # Our operator process, authenticated as the chart's ServiceAccount and nothing else.
        kc = cluster.token_kubeconfig(system, f"{release}-rlhf-operator", tmp_path / "sa.kubeconfig")
        denied = cluster.kubectl("--kubeconfig", str(kc), "auth", "can-i", "delete", "rayjobs", "-n", team, check=False)
        assert denied.stdout.strip() == "no"
        op = Operator(cluster, ["--namespace", team], tmp_path / "op.log", kubeconfig=kc).start()
        try:
            job = load_sample("separate-nccl-tp2")
            apply(cluster, job, team)
            name = job["metadata"]["name"]
            wait_for(lambda: phase(api, team, name) == "Running", 180, "Running under the chart's RBAC")
            events_until(api, team, name, lambda evs: any(e.reason == "Created" for e in evs), "a Created Event")
            log = (tmp_path / "op.log").read_text()
            forbidden = [ln for ln in log.splitlines() if "Forbidden" in ln or " 403" in ln or "forbidden" in ln]
            assert not forbidden, "\n".join(forbidden[:10])
        finally:
            op.kill()

        # helm upgrade with changed values reaches the Deployment.
        helm(cluster, "upgrade", release, str(CHART), "-n", system, "--reuse-values", "--set", "workers=4")
        dep = client.AppsV1Api(api).read_namespaced_deployment(f"{release}-rlhf-operator", system)
        assert "--workers=4" in dep.spec.template.spec.containers[0].args
    finally:
        helm(cluster, "uninstall", release, "-n", system, check=False)
    # Uninstall removes the release's objects but keeps the CRDs (as Helm does for crds/).
    wait_for(lambda: not client.AppsV1Api(api).list_namespaced_deployment(system).items, 60, "Deployment removed")
    assert cluster.kubectl("get", "crd", "rlhfjobs.rlhf.dev", check=False).returncode == 0
    for ns in (system, team):
        client.CoreV1Api(api).delete_namespace(ns)


# Writers that act for the user or for us: kubectl, Kopf and the Python client of our operator. KubeRay and the
# kube-controller-manager (Job status of KubeRay's submitter) are other controllers' business.
OUR_AGENTS = ("kubectl", "kopf", "OpenAPI-Generator")


def audit_writes(cluster, ns: str, since: str) -> list[dict]:
    out = []
    for line in audit_lines(cluster.audit_log):
        e = json.loads(line)
        ref = e.get("objectRef") or {}
        if (e["verb"] in ("create", "update", "patch", "delete") and ref.get("namespace") == ns
                and e["stageTimestamp"] > since and e.get("responseStatus", {}).get("code", 200) < 300
                and e.get("userAgent", "").startswith(OUR_AGENTS)):
            out.append({"verb": e["verb"], "resource": ref.get("resource"), "sub": ref.get("subresource"),
                        "name": ref.get("name"), "agent": e.get("userAgent", "")[:40],
                        "body": json.dumps(e.get("requestObject"))[:300]})
    return out


def test_reapplying_unchanged_manifest_writes_nothing(cluster, api, operator, namespace) -> None:
    job = load_sample("separate-nccl-tp2")
    name = job["metadata"]["name"]
    apply(cluster, job, namespace)
    wait_for(lambda: phase(api, namespace, name) == "Running", 180, "Running")
    core = client.CoreV1Api(api)
    rv_before = {
        "rlhfjob": get_job(api, namespace, name)["metadata"]["resourceVersion"],
        "configmap": core.read_namespaced_config_map(f"{name}-config", namespace).metadata.resource_version,
        "rayjob": client.CustomObjectsApi(api).get_namespaced_custom_object("ray.io", "v1", namespace, "rayjobs", name)["metadata"]["resourceVersion"],
    }
    start = json.loads(audit_lines(cluster.audit_log)[-1])["stageTimestamp"]
    for _ in range(10):
        apply(cluster, job, namespace)
    # An unchanged apply is no event at all; make the operator reconcile the job anyway: an event of one of its
    # pods that changes what the reconcile reads (the only write below that is not the operator's to avoid).
    pod = core.list_namespaced_pod(namespace, label_selector=f"rlhf.dev/job={name},ray.io/node-type=head").items[0]
    base = operator.reconciles(namespace, name)
    touch_pod_scheduled(core, namespace, pod.metadata.name, 1)
    wait_for(lambda: operator.reconciles(namespace, name) > base, 60, "a reconcile of the job after the poke")
    writes = [w for w in audit_writes(cluster, namespace, start)
              if not (w["resource"] == "pods" and w["name"] == pod.metadata.name and w["verb"] == "patch")]
    assert writes == [], yaml.safe_dump(writes)
    # and read nothing: a reconcile works from the watch caches (the audit policy logs reads of rlhf.dev and
    # ray.io objects; the test's own reads of them are all before ``start``)
    reads = [f"{e['verb']} {e['requestURI']}" for e in map(json.loads, audit_lines(cluster.audit_log))
             if e["stageTimestamp"] > start and e["verb"] in ("get", "list")
             and e.get("userAgent", "").startswith(("OpenAPI-Generator", "kopf"))
             and (e.get("objectRef") or {}).get("namespace") == namespace]
    assert reads == [], reads
    assert get_job(api, namespace, name)["metadata"]["resourceVersion"] == rv_before["rlhfjob"]
    assert core.read_namespaced_config_map(f"{name}-config", namespace).metadata.resource_version == rv_before["configmap"]


def test_crds_apply_server_side_idempotently(cluster) -> None:
    for _ in range(2):
        out = cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(REPO / "crds" / "rlhf.dev_rlhfjobs.yaml"))
        assert "serverside-applied" in out.stdout
    explain = cluster.kubectl("explain", "rlhfjob.spec.rollout").stdout
    assert "tensorParallelSize" in explain and "GPUs per engine" in explain
