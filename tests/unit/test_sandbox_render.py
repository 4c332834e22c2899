"""The sandboxes of ``spec.environment.sandbox`` as the operator renders and reports them (``rlhf_operator.sandboxes``):
the SandboxTemplate's hardened pod and network policy, the warm pool, the runtime's Role, when the pool is
released, and the SandboxesReady condition with the cause a pool's pods and sandboxes name. Pure functions."""

from __future__ import annotations

import copy
import datetime as dt
from pathlib import Path

import pytest
import yaml

from rlhf_api import models as m
from rlhf_operator import naming, render, sandboxes

REPO = Path(__file__).resolve().parents[2]
NOW = dt.datetime(2026, 1, 2, 3, 4, 5, tzinfo=dt.UTC)
SHELL = {"name": "shell", "builtin": "shell", "parameters": {"type": "object", "properties": {
    "command": {"type": "string"}}, "required": ["command"]}}


def sandbox_job(name: str = "toolrun", **sandbox) -> render.Job:
    doc = yaml.safe_load((REPO / "crds" / "samples" / "agent-python-tool.yaml").read_text())
    spec = copy.deepcopy(doc["spec"])
    spec["environment"]["tools"].append(SHELL)
    spec["environment"]["sandbox"] = {"image": "rlhf-sandbox:1", **sandbox}
    return render.Job(name, "team-a", "uid-1", m.RLHFJobSpec.model_validate(spec))


def plain_job() -> render.Job:
    doc = yaml.safe_load((REPO / "crds" / "samples" / "agent-python-tool.yaml").read_text())
    return render.Job("plain", "team-a", "uid-2", m.RLHFJobSpec.model_validate(doc["spec"]))


def test_nothing_without_a_sandbox_spec() -> None:
    job = plain_job()
    assert sandboxes.render_template(job) is None and sandboxes.render_warm_pool(job, 2) is None
    role = next(o for o in render.render_runtime_rbac(job) if o["kind"] == "Role")
    assert not any("agents.x-k8s.io" in g for r in role["rules"] for g in r["apiGroups"])


def test_template_pod_is_hardened() -> None:
    job = sandbox_job(resources={"cpu": "250m", "memory": "256Mi", "ephemeralStorage": "128Mi"},
                      runtimeClassName="gvisor", timeoutSeconds=7, maxOutputBytes=4096)
    t = sandboxes.render_template(job)
    assert (t["apiVersion"], t["kind"]) == ("extensions.agents.x-k8s.io/v1beta1", "SandboxTemplate")
    assert t["metadata"] == {"name": "toolrun-sandbox", "namespace": "team-a",
                             "labels": naming.labels("toolrun", "sandbox")}
    pod = t["spec"]["podTemplate"]["spec"]
    assert pod["automountServiceAccountToken"] is False and pod["enableServiceLinks"] is False
    assert pod["runtimeClassName"] == "gvisor"
    assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] != 0
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    [c] = pod["containers"]
    sc = c["securityContext"]
    assert sc["readOnlyRootFilesystem"] is True and sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"] == {"drop": ["ALL"]} and sc["runAsNonRoot"] is True
    want = {"cpu": "250m", "memory": "256Mi", "ephemeral-storage": "128Mi"}
    assert c["resources"] == {"requests": want, "limits": want}
    # the only writable path: a scratch emptyDir of the ephemeral-storage size, the server's working directory
    assert c["volumeMounts"] == [{"name": "scratch", "mountPath": "/tmp"}]
    assert pod["volumes"] == [{"name": "scratch", "emptyDir": {"sizeLimit": "128Mi"}}]
    env = {e["name"]: e["value"] for e in c["env"]}
    # one byte more than the runtime keeps: output the server cut is longer than maxOutputBytes, so the runtime
    # marks it cut (output_truncated) rather than passing exactly maxOutputBytes on as complete
    assert env["SANDBOX_EXEC_TIMEOUT_SECONDS"] == "7" and env["SANDBOX_OUTPUT_LIMIT_BYTES"] == "4097"
    assert c["ports"][0]["containerPort"] == 8888 and c["readinessProbe"]["httpGet"]["port"] == 8888
    # no Service, claims cannot inject environment or volumes (a warm sandbox is what the template says)
    spec = t["spec"]
    assert spec["service"] is False
    assert (spec["envVarsInjectionPolicy"], spec["volumeClaimTemplatesPolicy"]) == ("Disallowed", "Disallowed")
    # sandbox pods are not the job's own pods (those may reach them; the operator's pod watch is of those)
    labels = t["spec"]["podTemplate"]["metadata"]["labels"]
    assert naming.LABEL_JOB not in labels and labels[sandboxes.LABEL_SANDBOX] == "toolrun"


def test_template_pod_is_placed_by_the_sandbox_spec_only() -> None:
    """The sandbox's own nodeSelector and tolerations place its pods; spec.scheduling's (the GPU pods') do not."""
    pod = sandboxes.render_template(sandbox_job())["spec"]["podTemplate"]["spec"]
    assert "nodeSelector" not in pod and "tolerations" not in pod
    job = sandbox_job(nodeSelector={"pool": "cpu", "example.com/tier": "sandbox"},
                      tolerations=[{"key": "sandbox", "operator": "Exists", "effect": "NoSchedule"}])
    job.spec.scheduling.node_selector = {"gpu": "h100"}
    pod = sandboxes.render_template(job)["spec"]["podTemplate"]["spec"]
    assert pod["nodeSelector"] == {"example.com/tier": "sandbox", "pool": "cpu"}
    assert pod["tolerations"] == [{"key": "sandbox", "operator": "Exists", "effect": "NoSchedule"}]


def test_network_policy_denies_egress_and_admits_only_the_jobs_pods() -> None:
    t = sandboxes.render_template(sandbox_job())
    assert t["spec"]["networkPolicyManagement"] == "Managed"  # the controller makes it from these rules
    np = t["spec"]["networkPolicy"]
    assert "egress" not in np  # no egress rule with both policy types: every egress denied, DNS included
    [rule] = np["ingress"]
    assert rule["from"] == [{"podSelector": {"matchLabels": {naming.LABEL_JOB: "toolrun"}}}]  # no namespaceSelector
    assert rule["ports"] == [{"protocol": "TCP", "port": 8888}]


def test_warm_pool_refers_to_the_template() -> None:
    job = sandbox_job(warmPool=5)
    p = sandboxes.render_warm_pool(job, 5)
    assert p["kind"] == "SandboxWarmPool" and p["metadata"]["name"] == "toolrun-sandbox"
    assert p["spec"] == {"replicas": 5, "sandboxTemplateRef": {"name": "toolrun-sandbox"}}


def test_runtime_role_claims_sandboxes_in_its_namespace_only() -> None:
    _, role, binding = render.render_runtime_rbac(sandbox_job())
    assert role["kind"] == "Role" and role["metadata"]["namespace"] == "team-a"
    rules = {(r["apiGroups"][0], r["resources"][0]): r for r in role["rules"]}
    claims = rules[("extensions.agents.x-k8s.io", "sandboxclaims")]
    assert sorted(claims["verbs"]) == ["create", "delete", "get", "list", "watch"]
    assert rules[("agents.x-k8s.io", "sandboxes")]["verbs"] == ["get"]
    # nothing on templates, pools or pods: the runtime cannot change what a sandbox is
    assert not {k for k in rules if k[1] in ("sandboxtemplates", "sandboxwarmpools", "pods")}
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "toolrun-runtime", "namespace": "team-a"}]


def test_a_sandboxed_python_tool_leaves_the_head_confined() -> None:
    head = render.render_ray_job(sandbox_job())["spec"]["rayClusterSpec"]["headGroupSpec"]
    assert "seccompProfile" not in head["template"]["spec"]["containers"][0]["securityContext"]
    head = render.render_ray_job(plain_job())["spec"]["rayClusterSpec"]["headGroupSpec"]
    assert head["template"]["spec"]["containers"][0]["securityContext"]["seccompProfile"]["type"] == "Unconfined"


@pytest.mark.parametrize(("phase", "suspend", "queue", "rj_suspended", "why"), [
    ("Running", False, None, False, None),
    ("Pending", False, None, None, None),
    ("Suspended", True, None, True, "spec.suspend is true"),
    ("Pending", False, "q", True, "Kueue holds the job (LocalQueue q)"),
    ("Running", False, "q", False, None),
    ("Succeeded", False, None, False, "the job has succeeded"),
    ("Failed", False, None, False, "the job has failed"),
])
def test_held(phase, suspend, queue, rj_suspended, why) -> None:
    job = sandbox_job()
    spec = job.spec.model_copy(update={"suspend": suspend})
    spec.scheduling = spec.scheduling.model_copy(update={"queue_name": queue})
    rj = None if rj_suspended is None else {"spec": {"suspend": rj_suspended}}
    assert sandboxes.held(render.Job(job.name, job.namespace, job.uid, spec), phase, rj) == why


def pod(name: str, waiting: str | None = None, unscheduled: str | None = None) -> dict:
    st: dict = {"containerStatuses": [{"state": {"waiting": {"reason": waiting, "message": "pull access denied"}}
                                       if waiting else {"running": {}}}]}
    if unscheduled:
        st["conditions"] = [{"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                             "message": unscheduled}]
    return {"metadata": {"name": name}, "status": st}


def test_causes_from_pods_and_sandboxes() -> None:
    assert sandboxes.cause_from_pods([pod("a"), pod("b")], []) is None
    assert sandboxes.cause_from_pods([pod("a"), pod("b", waiting="ImagePullBackOff")], []) == (
        "ImagePullFailed", "sandbox pod b: ImagePullBackOff: pull access denied")
    assert sandboxes.cause_from_pods([pod("c", waiting="CrashLoopBackOff")], [])[0] == "SandboxCrashing"
    assert sandboxes.cause_from_pods([pod("d", unscheduled="0/3 nodes: Insufficient cpu")], []) == (
        "Unschedulable", "sandbox pod d: Unschedulable: 0/3 nodes: Insufficient cpu")
    quota = {"metadata": {"name": "toolrun-sandbox-x1"}, "status": {"conditions": [
        {"type": "Ready", "status": "False", "reason": "ReconcilerError",
         "message": "Error seen: pods \"toolrun-sandbox-x1\" is forbidden: exceeded quota: q, requested: cpu=500m"}]}}
    reason, message = sandboxes.cause_from_pods([], [quota])
    assert reason == "PodCreationFailed" and "exceeded quota" in message


def test_no_controller_after_the_grace() -> None:
    made = (NOW - dt.timedelta(seconds=sandboxes.CONTROLLER_GRACE_SECONDS + 1)).isoformat()
    fresh = (NOW - dt.timedelta(seconds=5)).isoformat()
    live = {"metadata": {"name": "p", "creationTimestamp": made}, "status": {}}
    assert sandboxes.no_controller(live, NOW)[0] == "NoSandboxController"
    assert sandboxes.no_controller({**live, "metadata": {"name": "p", "creationTimestamp": fresh}}, NOW) is None
    assert sandboxes.no_controller({**live, "status": {"observedGeneration": 1}}, NOW) is None


def cond(rep: dict) -> tuple[str, str]:
    return rep["condition"]["status"], rep["condition"]["reason"]


def test_report_and_condition() -> None:
    Obs = sandboxes.Observed
    assert sandboxes.report(None, {}, 1, NOW) == {}
    filling = sandboxes.report(Obs("p", 4, ready=1), {}, 1, NOW)
    assert cond(filling) == ("False", "Filling") and filling["sandbox"] == {
        "warmPool": "p", "replicas": 4, "ready": 1, "failure": None}
    full = sandboxes.report(Obs("p", 4, ready=4), {"conditions": [filling["condition"]]}, 1, NOW)
    assert cond(full) == ("True", "Ready")
    later = NOW + dt.timedelta(minutes=1)
    # claims drain the pool: it refills without the condition (or its time) changing
    refill = sandboxes.report(Obs("p", 4, ready=2), {"conditions": [full["condition"]]}, 1, later)
    assert refill["condition"] == full["condition"]
    bad = sandboxes.report(Obs("p", 4, cause=("ImagePullFailed", "sandbox pod x: ErrImagePull")),
                           {"conditions": [full["condition"]]}, 1, later)
    assert cond(bad) == ("False", "ImagePullFailed") and bad["sandbox"]["failure"] == "sandbox pod x: ErrImagePull"
    assert bad["condition"]["lastTransitionTime"] == later.strftime("%Y-%m-%dT%H:%M:%SZ")
    released = sandboxes.report(Obs("p", 0, held="spec.suspend is true"), {}, 2, NOW)
    assert cond(released) == ("True", "Released") and released["sandbox"]["replicas"] == 0
    assert "spec.suspend" in released["condition"]["message"]


def test_announce_only_a_new_cause(monkeypatch) -> None:
    posted = []
    monkeypatch.setattr(sandboxes, "post_event", lambda body, reason, msg, warning=False: posted.append(
        (reason, warning)))
    bad = {"conditions": [{"type": "SandboxesReady", "status": "False", "reason": "ImagePullFailed",
                           "message": "m"}]}
    filling = {"conditions": [{"type": "SandboxesReady", "status": "False", "reason": "Filling", "message": ""}]}
    sandboxes.announce({}, {}, filling)
    sandboxes.announce({}, filling, bad)
    sandboxes.announce({}, bad, bad)
    assert posted == [("ImagePullFailed", True)]


def test_pool_projection_keeps_what_the_reconcile_reads() -> None:
    body = {"metadata": {"name": "p", "namespace": "n", "uid": "u", "resourceVersion": "7", "generation": 2,
                         "creationTimestamp": "2026-01-01T00:00:00Z", "managedFields": [{}], "labels": {"a": "b"}},
            "spec": {"replicas": 3, "sandboxTemplateRef": {"name": "t"}},
            "status": {"replicas": 3, "readyReplicas": 2, "selector": "x=y", "observedGeneration": 2}}
    p = sandboxes.pool(body)
    assert p["spec"] == {"replicas": 3} and p["status"] == body["status"]
    assert "managedFields" not in p["metadata"] and p["metadata"]["generation"] == 2
