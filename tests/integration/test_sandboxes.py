"""``spec.environment.sandbox`` on the real control plane: admission refuses bad sandbox specs; without
agent-sandbox's CRDs the job says so (SandboxesReady False, AgentSandboxMissing, a Warning Event) and still runs;
with the real agent-sandbox controller (``Cluster.install_agent_sandbox``) the operator makes the job's
SandboxTemplate and SandboxWarmPool owned by the job, the controller makes the NetworkPolicy from the template (no
egress, ingress from the job's pods only) and the pool's pods, which cannot be scheduled here (KWOK nodes have no
ephemeral storage): the job names that cause (SandboxesReady False, Unschedulable, a Warning Event); the job's
runtime identity may claim a sandbox in its own namespace and not in another, a suspended job's pool goes to 0 with its claims, and nothing is
left once the job is deleted.

The tests run in this order: the first needs a cluster where agent-sandbox is not installed yet."""

from __future__ import annotations

import copy
import json
import uuid

import pytest
from kubernetes import client, config
from kubernetes.client.rest import ApiException

from tests.helpers import wait_for
from tests.integration.conftest import apply, load_sample

pytestmark = pytest.mark.cluster
EXT, CORE, V = "extensions.agents.x-k8s.io", "agents.x-k8s.io", "v1beta1"
SHELL = {"name": "shell", "builtin": "shell", "parameters": {"type": "object", "properties": {
    "command": {"type": "string"}}, "required": ["command"]}}


def sandbox_job(name: str, **sandbox) -> dict:
    job = load_sample("agent-python-tool")
    job["metadata"]["name"] = name
    job["spec"]["environment"]["tools"].append(copy.deepcopy(SHELL))
    job["spec"]["environment"]["sandbox"] = {"image": "rlhf-sandbox:test", "warmPool": 2,
                                             "resources": {"cpu": "100m", "memory": "128Mi",
                                                           "ephemeralStorage": "64Mi"}, **sandbox}
    return job


def rlhf_job(api, ns: str, name: str) -> dict:
    return client.CustomObjectsApi(api).get_namespaced_custom_object("rlhf.dev", "v1alpha1", ns, "rlhfjobs", name)


def condition(api, ns: str, name: str, ctype: str = "SandboxesReady") -> dict | None:
    job = rlhf_job(api, ns, name)
    return next((c for c in (job.get("status") or {}).get("conditions") or [] if c["type"] == ctype), None)


def installed(api) -> bool:
    try:
        client.ApiextensionsV1Api(api).read_custom_resource_definition(f"sandboxwarmpools.{EXT}")
        return True
    except ApiException as e:
        if e.status == 404:
            return False
        raise


@pytest.mark.parametrize(("env_change", "message"), [
    ({"sandbox": None}, "the builtin shell tool runs only in a sandbox: set environment.sandbox"),
    ({"tools": [{"name": "f", "function": "m:f", "parameters": {"type": "object"}}]},
     "environment.sandbox runs the builtin python and shell tools"),
    ({"sandbox": {"image": "x", "resources": {"memory": "32Mi"}}},
     "environment.sandbox.resources.memory must be at least 64Mi"),
    ({"sandbox": {"image": "x", "runtimeClassName": "Not_A_Name"}}, "spec.environment.sandbox.runtimeClassName"),
    ({"sandbox": {"image": "x", "timeoutSeconds": 0}}, "spec.environment.sandbox.timeoutSeconds"),
])
def test_admission_refuses_bad_sandbox_specs(cluster, namespace, env_change, message) -> None:
    job = sandbox_job("badbox")
    for k, v in env_change.items():
        if v is None:
            job["spec"]["environment"].pop(k)
        else:
            job["spec"]["environment"][k] = v
    out = apply(cluster, job, namespace, check=False, data=False)
    assert out.returncode != 0 and message in out.stderr, out.stderr


def test_without_agent_sandbox_the_job_says_so(cluster, api, operator, namespace) -> None:
    if installed(api):
        pytest.skip("agent-sandbox was installed in this cluster by an earlier test module")
    apply(cluster, sandbox_job("nobox"), namespace)
    cond = wait_for(lambda: (c := condition(api, namespace, "nobox")) and c["reason"] == "AgentSandboxMissing" and c,
                    60, "SandboxesReady False, AgentSandboxMissing")
    assert cond["status"] == "False" and "install agent-sandbox" in cond["message"]
    wait_for(lambda: any(e.reason == "AgentSandboxMissing" and e.type == "Warning" for e in client.CoreV1Api(api)
                         .list_namespaced_event(namespace).items), 30, "a Warning Event naming the cause")
    # the job itself goes on (its tool calls become sandbox errors): the RayJob is made
    wait_for(lambda: client.CustomObjectsApi(api).list_namespaced_custom_object(
        "ray.io", "v1", namespace, "rayjobs")["items"], 60, "the RayJob")


def runtime_api(cluster, namespace: str, job: str, tmp_path) -> client.ApiClient:
    """An API client that authenticates as the job's runtime ServiceAccount (its Role is all it holds)."""
    path = cluster.token_kubeconfig(namespace, f"{job}-runtime", tmp_path / f"{job}-runtime.kubeconfig")
    return config.new_client_from_config(str(path))


def claim(name: str, pool: str) -> dict:
    return {"apiVersion": f"{EXT}/{V}", "kind": "SandboxClaim",
            "metadata": {"name": name, "labels": {"rlhf.dev/job": "box"}}, "spec": {"warmPoolRef": {"name": pool}}}


def test_template_pool_policy_claims_release_and_cleanup(cluster, api, operator, namespace, tmp_path) -> None:
    cluster.install_agent_sandbox()
    custom = client.CustomObjectsApi(api)
    apply(cluster, sandbox_job("box", runtimeClassName=None), namespace)
    try:
        template = wait_for(lambda: custom.get_namespaced_custom_object(EXT, V, namespace, "sandboxtemplates",
                                                                        "box-sandbox"), 300, "the SandboxTemplate")
    except AssertionError as e:  # what the operator did with the job, for the failure's reader
        lines = [ln for ln in operator.log.read_text(errors="replace").splitlines() if namespace in ln]
        job = rlhf_job(api, namespace, "box")
        raise AssertionError(f"{e}\njob status: {json.dumps(job.get('status'))[:3000]}\noperator log on "
                             f"{namespace}:\n" + "\n".join(lines[-60:])) from e
    pool = wait_for(lambda: custom.get_namespaced_custom_object(EXT, V, namespace, "sandboxwarmpools",
                                                                "box-sandbox"), 30, "the SandboxWarmPool")
    for obj in (template, pool):
        [owner] = obj["metadata"]["ownerReferences"]
        assert (owner["kind"], owner["name"], owner["controller"]) == ("RLHFJob", "box", True)
    pod = template["spec"]["podTemplate"]["spec"]
    assert pod["automountServiceAccountToken"] is False and pod["securityContext"]["runAsNonRoot"] is True
    assert pod["containers"][0]["securityContext"]["readOnlyRootFilesystem"] is True
    assert pool["spec"]["replicas"] == 2 and pool["spec"]["sandboxTemplateRef"]["name"] == "box-sandbox"

    # agent-sandbox's controller makes the NetworkPolicy from the template: no egress, ingress from the job's pods
    net = client.NetworkingV1Api(api)
    np = wait_for(lambda: net.read_namespaced_network_policy("box-sandbox-network-policy", namespace), 60,
                  "the controller's NetworkPolicy")
    assert sorted(np.spec.policy_types) == ["Egress", "Ingress"] and not np.spec.egress
    [rule] = np.spec.ingress
    assert rule._from[0].pod_selector.match_labels == {"rlhf.dev/job": "box"} and rule._from[0].namespace_selector is None
    assert np.metadata.owner_references[0].kind == "SandboxTemplate"

    # the pool cannot fill here: the KWOK nodes have no ephemeral storage to give the sandbox pods; the job names it
    cond = wait_for(lambda: (c := condition(api, namespace, "box")) and c["reason"] == "Unschedulable" and c, 120,
                    "SandboxesReady False, Unschedulable")
    assert cond["status"] == "False" and "ephemeral-storage" in cond["message"], cond
    job = rlhf_job(api, namespace, "box")
    assert job["status"]["sandbox"]["warmPool"] == "box-sandbox" and job["status"]["sandbox"]["replicas"] == 2
    assert job["status"]["sandbox"]["failure"] == cond["message"] and job["status"]["sandbox"]["ready"] == 0
    wait_for(lambda: any(e.reason == "Unschedulable" and e.type == "Warning" and e.involved_object.name == "box"
                         for e in client.CoreV1Api(api).list_namespaced_event(namespace).items), 30,
             "a Warning Event naming the cause")

    # the job's runtime identity claims in its own namespace only
    rt = client.CustomObjectsApi(runtime_api(cluster, namespace, "box", tmp_path))
    body = claim(f"box-sb-{uuid.uuid4().hex[:6]}", "box-sandbox")
    rt.create_namespaced_custom_object(EXT, V, namespace, "sandboxclaims", body)
    elsewhere = f"it-{uuid.uuid4().hex[:8]}"
    client.CoreV1Api(api).create_namespace({"metadata": {"name": elsewhere}})
    try:
        with pytest.raises(ApiException) as refused:
            rt.create_namespaced_custom_object(EXT, V, elsewhere, "sandboxclaims", claim("x", "box-sandbox"))
        assert refused.value.status == 403
    finally:
        client.CoreV1Api(api).delete_namespace(elsewhere)
    with pytest.raises(ApiException) as refused:  # nor may it change what a sandbox is
        rt.patch_namespaced_custom_object(EXT, V, namespace, "sandboxwarmpools", "box-sandbox",
                                          {"spec": {"replicas": 50}})
    assert refused.value.status == 403

    # suspended: the pool goes to 0 and the job's claims are released
    cluster.kubectl("patch", "rlhfjob", "box", "-n", namespace, "--type=merge", "-p",
                    json.dumps({"spec": {"suspend": True}}))
    wait_for(lambda: custom.get_namespaced_custom_object(EXT, V, namespace, "sandboxwarmpools", "box-sandbox")
             ["spec"]["replicas"] == 0, 60, "the pool scaled to 0")
    wait_for(lambda: not custom.list_namespaced_custom_object(EXT, V, namespace, "sandboxclaims")["items"], 60,
             "the job's claims deleted")
    cond = wait_for(lambda: (c := condition(api, namespace, "box")) and c["reason"] == "Released" and c, 60,
                    "SandboxesReady Released")
    assert "spec.suspend" in cond["message"]

    # deleted: nothing of the job's sandboxes is left
    cluster.kubectl("delete", "rlhfjob", "box", "-n", namespace)

    def left() -> list[str]:
        out = [f"{p}/{o['metadata']['name']}" for g, p in ((EXT, "sandboxtemplates"), (EXT, "sandboxwarmpools"),
                                                           (EXT, "sandboxclaims"), (CORE, "sandboxes"))
               for o in custom.list_namespaced_custom_object(g, V, namespace, p)["items"]]
        out += [f"pod/{p.metadata.name}" for p in client.CoreV1Api(api).list_namespaced_pod(
            namespace, label_selector="rlhf.dev/sandbox-of=box").items]
        return out

    wait_for(lambda: not left(), 120, "every sandbox object gone with the job")
