"""Least privilege, proven on a real apiserver (RBAC, audit log, PodSecurity admission), real KubeRay, KWOK nodes.

* The operator runs as the chart's ServiceAccount only (``helm template`` applied, a token kubeconfig of its
  ServiceAccount) through a full scenario; the audit log gives every (verb, group, resource, subresource,
  scope) it called. Every call was allowed, and every (group, resource, verb) the chart grants was used, or is
  listed in ``GRANTED_NOT_CALLED`` with the reason.
* A job's runtime identity (the ServiceAccount the operator creates for the job's pods) can, by real calls,
  read and patch its own job's status and read its own job and ConfigMap; nothing else.
* The runtime Role and RoleBinding follow the rendered ones: a hand edit is reverted by the operator.
* Pod Security: the chart's operator pod passes ``restricted``; what ``restricted`` and ``baseline`` say about
  the runtime pods (the templates ``render.render_ray_job`` writes and the pods KubeRay makes from them).

This module starts its own control plane: the shared cluster's audit policy logs reads only for rlhf.dev and
ray.io, and this table needs every read of a ServiceAccount (``AUDIT_SA_RULE``).
Run: ``.venv/bin/python -m pytest tests/integration/test_privilege.py -s`` (``-s`` prints the tables).
"""

from __future__ import annotations

import collections
import copy
import datetime as dt
import json
import re
import signal
import uuid
from pathlib import Path

import pytest
import yaml
from kubernetes import client, config
from kubernetes.client.rest import ApiException
from rlhf_testing.tiny import tiny_job_spec

from rlhf_api import models as m
from rlhf_operator import naming, render
from rlhf_runtime.infra.report import StatusClient, status_patch
from tests.helpers import audit_lines, wait_for
from tests.integration.conftest import REPO, Operator, apply, free_port, load_sample, localcluster

pytestmark = pytest.mark.cluster
CHART = REPO / "charts" / "rlhf-operator"
NODES, GPUS_PER_NODE, FILLER_GPUS = 3, 8, 5  # 3 free GPUs per node after the fillers: no pod asking 4 fits

#: Why this cluster runs without Kueue ("missing"), if it does.
KUEUE: dict[str, str] = {}
#: Every request of a ServiceAccount at Metadata level (reads included), before the shared policy's final None.
AUDIT_SA_RULE = '  - level: Metadata\n    userGroups: ["system:serviceaccounts"]\n'

#: Granted (group, resource, verb) the operator never calls itself, and why each stays in the chart.
GRANTED_NOT_CALLED = {
    ("rlhf.dev", "rlhfjobs/status", "get"): "RBAC escalation check: the runtime Role grants it, so its creator "
                                           "must hold it (test_runtime_role_needs_get_on_status_held_by_the_operator)",
    ("rlhf.dev", "rlhfjobs", "patch"): "Kopf removes the finalizer older operators put on jobs; no job here has "
                                      "one (test_event_driven.py::test_no_finalizer_old_one_removed_...)",
    ("ray.io", "rayclusters", "delete"): "a RayJob's duplicate RayCluster; none here "
                                        "(test_event_driven.py::test_a_ray_jobs_older_second_cluster_is_deleted)",
    ("apps", "deployments", "create"): "a job's environment server; none here "
                                      "(test_environment_server.py::test_environment_server_is_made_and_goes_with_the_job)",
    ("", "services", "create"): "the environment server's Service; none here "
                               "(test_environment_server.py::test_environment_server_is_made_and_goes_with_the_job)",
}
#: spec.environment.sandbox: agent-sandbox is not installed in this scenario's cluster (no job here has a sandbox).
_SANDBOX_IT = "test_sandboxes.py::test_template_pool_policy_claims_release_and_cleanup"
_RUNTIME_GRANT = f"RBAC escalation check: a sandbox job's runtime Role grants it, so its creator must hold it ({_SANDBOX_IT})"
GRANTED_NOT_CALLED.update({
    ("extensions.agents.x-k8s.io", "sandboxtemplates", "create"): f"a sandbox job's template ({_SANDBOX_IT})",
    ("extensions.agents.x-k8s.io", "sandboxwarmpools", "create"): f"a sandbox job's warm pool ({_SANDBOX_IT})",
    ("extensions.agents.x-k8s.io", "sandboxwarmpools", "patch"): f"a held job's pool scaled to 0 ({_SANDBOX_IT})",
    ("extensions.agents.x-k8s.io", "sandboxwarmpools", "list"): f"the pools' watch, without the CRD ({_SANDBOX_IT})",
    ("extensions.agents.x-k8s.io", "sandboxwarmpools", "watch"): f"the pools' watch, without the CRD ({_SANDBOX_IT})",
    ("extensions.agents.x-k8s.io", "sandboxwarmpools", "get"): f"a pool the watch has not shown ({_SANDBOX_IT})",
    ("extensions.agents.x-k8s.io", "sandboxclaims", "deletecollection"): f"a held job's claims ({_SANDBOX_IT})",
    ("agents.x-k8s.io", "sandboxes", "list"): f"why a pool cannot fill ({_SANDBOX_IT})",
    **{("extensions.agents.x-k8s.io", "sandboxclaims", v): _RUNTIME_GRANT
       for v in ("create", "get", "list", "watch", "delete")},
    ("agents.x-k8s.io", "sandboxes", "get"): _RUNTIME_GRANT,
})


# ------------------------------------------------------------------------------------------------ fixtures
@pytest.fixture(scope="module")
def pcluster(tmp_path_factory):
    c = localcluster.Cluster(tmp_path_factory.mktemp("privcluster"), localcluster.build())
    shared = localcluster.AUDIT_POLICY
    assert shared.endswith("  - level: None\n"), "the shared audit policy changed: adapt AUDIT_SA_RULE"
    localcluster.AUDIT_POLICY = shared[: -len("  - level: None\n")] + AUDIT_SA_RULE + "  - level: None\n"
    try:
        c.up(nodes=NODES, gpus_per_node=GPUS_PER_NODE)
        if not hasattr(c, "install_kueue"):
            KUEUE["missing"] = "hack/localcluster.py cannot install Kueue (no Cluster.install_kueue)"
        else:
            try:
                c.install_kueue()  # the real Kueue manager
            except Exception as e:  # noqa: BLE001 - the scenario then runs without a queued job, and says why
                KUEUE["missing"] = f"Cluster.install_kueue failed: {str(e)[:200]}"
                print(f"\nno Kueue: {KUEUE['missing']}")
        yield c
    finally:
        localcluster.AUDIT_POLICY = shared
        c.stop()


@pytest.fixture(scope="module")
def papi(pcluster) -> client.ApiClient:
    return config.new_client_from_config(str(pcluster.kubeconfig))


class ChartOperator:
    """The chart rendered (``helm template``, default values but ``watch.scope``) and applied, and our operator
    process with the Deployment's arguments, authenticated as the chart's ServiceAccount only."""

    def __init__(self, cluster, api, tmp: Path, scope: str = "cluster", release: str = "priv") -> None:
        suffix = uuid.uuid4().hex[:6]
        self.system, self.team, self.release = f"rlhf-system-{suffix}", f"team-{suffix}", release
        for ns in (self.system, self.team):
            client.CoreV1Api(api).create_namespace({"metadata": {"name": ns}})
        sets = ["--set", "watch.scope=namespaces", "--set", f"watch.watchNamespaces={{{self.team}}}"] \
            if scope == "namespaces" else []
        # replicaCount=0: the Deployment's pod would only be a KWOK placeholder; the operator runs here instead.
        out = cluster.helm("template", release, str(CHART), "-n", self.system, "--kube-version", "1.36.3",
                           "--set", "replicaCount=0", *sets)
        self.docs = [d for d in yaml.safe_load_all(out.stdout) if d]
        cluster.kubectl("apply", "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List", "items": self.docs}))
        self.sa = f"{release}-rlhf-operator"
        self.user = f"system:serviceaccount:{self.system}:{self.sa}"
        self.kubeconfig = kc = cluster.token_kubeconfig(self.system, self.sa, tmp / f"{release}-sa.kubeconfig")
        args = [a for a in self.deployment["spec"]["template"]["spec"]["containers"][0]["args"]
                if not a.startswith(("--liveness", "--metrics-port", "--workers"))]
        assert args == (["--all-namespaces"] if scope == "cluster" else [f"--namespace={self.team}"]), args
        self.op = Operator(cluster, [*args, "--metrics-port", str(free_port())], tmp / f"{release}-operator.log",
                           kubeconfig=kc).start()

    @property
    def deployment(self) -> dict:
        return next(d for d in self.docs if d["kind"] == "Deployment")

    def granted(self) -> dict[tuple[str, str, str], list[str]]:
        """(group, resource, verb) -> the ClusterRoles/Roles bound to our ServiceAccount that grant it."""
        bound = {(d["roleRef"]["kind"], d["roleRef"]["name"]) for d in self.docs
                 if d["kind"] in ("ClusterRoleBinding", "RoleBinding")
                 and any(s["kind"] == "ServiceAccount" and s["name"] == self.sa for s in d["subjects"])}
        out: dict[tuple[str, str, str], list[str]] = collections.defaultdict(list)
        for d in self.docs:
            if (d["kind"], d["metadata"]["name"]) in bound:
                for r in d["rules"]:
                    assert not r.get("resourceNames"), r
                    for g in r["apiGroups"]:
                        for res in r["resources"]:
                            for v in r["verbs"]:
                                where = f" in {d['metadata']['namespace']}" if d["kind"] == "Role" else ""
                                out[(g, res, v)].append(f'{d["kind"]}/{d["metadata"]["name"]}{where}')
        return out

    def stop(self) -> None:
        self.op.kill(signal.SIGTERM)
        print(f"\noperator log: {self.op.log} ({len(self.op.log.read_text().splitlines())} lines)")


@pytest.fixture(scope="module")
def chart_op(pcluster, papi, tmp_path_factory):
    co = ChartOperator(pcluster, papi, tmp_path_factory.mktemp("chartop"))
    yield co
    co.stop()


# ------------------------------------------------------------------------------------------------ helpers
def get_job(api, ns: str, name: str) -> dict:
    return client.CustomObjectsApi(api).get_namespaced_custom_object(m.GROUP, m.VERSION, ns, m.PLURAL, name)


def cpu_job(name: str) -> dict:
    return {"apiVersion": f"{m.GROUP}/{m.VERSION}", "kind": "RLHFJob", "metadata": {"name": name},
            "spec": tiny_job_spec("/models/tiny", 5)}


def rendered_rbac(api, ns: str, name: str) -> dict[str, dict]:
    body = get_job(api, ns, name)
    job = render.Job(name, ns, body["metadata"]["uid"], m.RLHFJobSpec.model_validate(body["spec"]))
    return {o["kind"]: o for o in render.render_runtime_rbac(job)}


def live(api, kind: str, ns: str, name: str) -> dict:
    rb = client.RbacAuthorizationV1Api(api)
    obj = (rb.read_namespaced_role if kind == "Role" else rb.read_namespaced_role_binding)(name, ns)
    return api.sanitize_for_serialization(obj)


def canon(x):
    """Rules/subjects as compared by RBAC: key order and absent-vs-empty fields do not matter."""
    def strip(d):
        return {k: v for k, v in sorted(d.items()) if v not in (None, [], "")}
    return sorted(json.dumps(strip(i), sort_keys=True) for i in x)


def forbidden(call, *args, **kwargs) -> int:
    try:
        call(*args, **kwargs)
    except ApiException as e:
        return e.status
    return 200


def audit_events(cluster, user: str) -> list[dict]:
    seen, out = set(), []
    for line in audit_lines(cluster.audit_log):
        e = json.loads(line)
        if e["user"]["username"] != user or e["auditID"] in seen:
            continue
        seen.add(e["auditID"])
        out.append(e)
    return out


def call_key(e: dict) -> tuple:
    ref = e.get("objectRef")
    if not ref:
        return ("nonResource", e["verb"], e["requestURI"].split("?")[0])
    res = ref["resource"] + (f"/{ref['subresource']}" if ref.get("subresource") else "")
    return (ref.get("apiGroup", ""), res, e["verb"], "namespaced" if ref.get("namespace") else "cluster-wide")


# ------------------------------------------------------------------------------------ 2. runtime identity
def test_runtime_identity_reaches_its_own_job_only(pcluster, papi, chart_op, tmp_path) -> None:
    ns = chart_op.team
    for name in ("alpha", "beta"):
        apply(pcluster, cpu_job(name), ns)
    core, cust = client.CoreV1Api(papi), client.CustomObjectsApi(papi)
    for name in ("alpha", "beta"):
        wait_for(lambda n=name: core.read_namespaced_config_map(f"{n}-config", ns)
                 and client.RbacAuthorizationV1Api(papi).read_namespaced_role_binding(f"{n}-runtime", ns), 120,
                 f"{name}'s ConfigMap and runtime RBAC, created by the operator")
    rj = wait_for(lambda: cust.get_namespaced_custom_object("ray.io", "v1", ns, "rayjobs", "alpha"), 60, "RayJob")
    assert rj["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]["serviceAccountName"] == "alpha-runtime"
    kc = pcluster.token_kubeconfig(ns, "alpha-runtime", tmp_path / "alpha-runtime.kubeconfig")
    rt = config.new_client_from_config(str(kc))
    rcore, rcust = client.CoreV1Api(rt), client.CustomObjectsApi(rt)
    uid = get_job(papi, ns, "alpha")["metadata"]["uid"]

    # allowed, with the runtime's own client (uid check, then a merge patch of status.step and status.runtime)
    sc = StatusClient("alpha", ns, uid, kubeconfig=str(kc))
    sc.patch(status_patch("Running", step=1, throughput={"rollout_tokens_per_second": 10.0}))
    assert get_job(papi, ns, "alpha")["status"]["step"] == 1
    assert rcust.get_namespaced_custom_object(m.GROUP, m.VERSION, ns, m.PLURAL, "alpha")["metadata"]["uid"] == uid
    assert rcore.read_namespaced_config_map("alpha-config", ns).data[naming.CONFIG_KEY]

    # refused (403 from RBAC, not 404)
    secret = core.create_namespaced_secret(ns, {"metadata": {"name": "s"}, "stringData": {"k": "v"}})
    pod_name = wait_for(lambda: core.list_namespaced_pod(ns).items, 60, "a pod in the namespace")[0].metadata.name
    grp = (m.GROUP, m.VERSION, ns, m.PLURAL)
    refused = {
        "get another job": forbidden(rcust.get_namespaced_custom_object, *grp, "beta"),
        "get another job's status": forbidden(rcust.get_namespaced_custom_object_status, *grp, "beta"),
        "patch another job's status": forbidden(rcust.patch_namespaced_custom_object_status, *grp, "beta",
                                                {"status": {"step": 99}}),
        "patch another job": forbidden(rcust.patch_namespaced_custom_object, *grp, "beta", {"spec": {"suspend": True}}),
        "list jobs": forbidden(rcust.list_namespaced_custom_object, *grp),
        "patch its own spec": forbidden(rcust.patch_namespaced_custom_object, *grp, "alpha",
                                        {"spec": {"algorithm": {"steps": 1}}}),
        "delete its own job": forbidden(rcust.delete_namespaced_custom_object, *grp, "alpha"),
        "get a Secret": forbidden(rcore.read_namespaced_secret, secret.metadata.name, ns),
        "list Secrets": forbidden(rcore.list_namespaced_secret, ns),
        "list pods": forbidden(rcore.list_namespaced_pod, ns),
        "get a pod": forbidden(rcore.read_namespaced_pod, pod_name, ns),
        "get another job's ConfigMap": forbidden(rcore.read_namespaced_config_map, "beta-config", ns),
        "patch its own ConfigMap": forbidden(rcore.patch_namespaced_config_map, "alpha-config", ns, {"data": {"x": "1"}}),
        "get its own RayJob": forbidden(rcust.get_namespaced_custom_object, "ray.io", "v1", ns, "rayjobs", "alpha"),
        "patch its own Role": forbidden(client.RbacAuthorizationV1Api(rt).patch_namespaced_role, "alpha-runtime", ns,
                                        {"rules": []}),
    }
    print("\nruntime identity alpha-runtime, refused calls:", json.dumps(refused, indent=1))
    assert all(code == 403 for code in refused.values()), refused
    assert get_job(papi, ns, "alpha")["spec"]["algorithm"]["steps"] == 5
    assert (get_job(papi, ns, "beta").get("status") or {}).get("step") is None


# ---------------------------------------------------------------- 3. RBAC children follow the rendered Role
def test_runtime_role_and_binding_follow_the_rendered_ones(pcluster, papi, chart_op) -> None:
    """A hand edit of the job's Role (an extra rule) or RoleBinding (an extra subject) is reverted by the
    operator's next reconcile (kube.ensure_object updates a Role/RoleBinding that differs from the render)."""
    ns, name = chart_op.team, "alpha"
    apply(pcluster, cpu_job(name), ns)  # present when run alone (-k)
    rb = client.RbacAuthorizationV1Api(papi)
    want = wait_for(lambda: rendered_rbac(papi, ns, name), 60, "alpha rendered")
    wait_for(lambda: canon(live(papi, "Role", ns, f"{name}-runtime")["rules"]) == canon(want["Role"]["rules"]),
             60, "the Role as rendered")

    extra = {"apiGroups": [""], "resources": ["secrets"], "verbs": ["get", "list"]}
    edited = rb.patch_namespaced_role(f"{name}-runtime", ns, {"rules": [*want["Role"]["rules"], extra]})
    # the patch's answer (a read after it may already see the operator's revert)
    assert len(edited.rules) == len(want["Role"]["rules"]) + 1
    wait_for(lambda: canon(live(papi, "Role", ns, f"{name}-runtime")["rules"]) == canon(want["Role"]["rules"]),
             30, "the operator to restore the rendered Role rules (extra secrets rule removed)")

    intruder = {"kind": "ServiceAccount", "name": "default", "namespace": ns}
    rb.patch_namespaced_role_binding(f"{name}-runtime", ns,
                                     {"subjects": [*want["RoleBinding"]["subjects"], intruder]})
    wait_for(lambda: canon(live(papi, "RoleBinding", ns, f"{name}-runtime")["subjects"])
             == canon(want["RoleBinding"]["subjects"]), 30, "the operator to restore the RoleBinding subjects")

    rb.delete_namespaced_role(f"{name}-runtime", ns)
    wait_for(lambda: canon(live(papi, "Role", ns, f"{name}-runtime")["rules"]) == canon(want["Role"]["rules"]),
             30, "the operator to recreate a deleted Role")


def test_runtime_role_needs_get_on_status_held_by_the_operator(pcluster, papi, chart_op) -> None:
    """Why ``GRANTED_NOT_CALLED`` keeps rlhfjobs/status get: the chart's ClusterRole without it cannot create a
    job's runtime Role (RBAC refuses to grant what the creator does not hold); with it, it can."""
    ns, system = chart_op.team, chart_op.system
    apply(pcluster, cpu_job("alpha"), ns)
    role = wait_for(lambda: rendered_rbac(papi, ns, "alpha"), 60, "alpha rendered")["Role"]
    role["metadata"] = {"name": "escalation-probe", "namespace": ns}
    full = next(d for d in chart_op.docs if d["kind"] == "ClusterRole" and d["metadata"]["name"] == chart_op.sa)
    minus = [{**r, "verbs": [v for v in r["verbs"] if v != "get"]} if r["resources"] == ["rlhfjobs/status"] else r
             for r in full["rules"]]
    assert minus != full["rules"]
    rbac = client.RbacAuthorizationV1Api(papi)
    rbac.create_cluster_role({"metadata": {"name": "priv-minus-status-get"}, "rules": minus})
    client.CoreV1Api(papi).create_namespaced_service_account(system, {"metadata": {"name": "minus"}})
    rbac.create_cluster_role_binding({
        "metadata": {"name": "priv-minus-status-get"},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "priv-minus-status-get"},
        "subjects": [{"kind": "ServiceAccount", "name": "minus", "namespace": system}]})

    def create_as(kubeconfig: Path) -> tuple[int, str]:
        try:
            client.RbacAuthorizationV1Api(config.new_client_from_config(str(kubeconfig))).create_namespaced_role(
                ns, role, dry_run="All")
        except ApiException as e:
            return e.status, json.loads(e.body)["message"]
        return 201, ""

    kc = pcluster.token_kubeconfig(system, "minus", chart_op.kubeconfig.parent / "minus.kubeconfig")
    # (polled: until the new binding is in the authorizer's cache the refusal is a plain "cannot create roles")
    _, msg = wait_for(lambda: (r := create_as(kc))[0] == 403 and "not currently held" in r[1] and r, 30,
                      "the RBAC escalation refusal")
    print(f"\nwithout rlhfjobs/status get: {msg[:400]}")
    assert "attempting to grant RBAC permissions not currently held" in msg and "rlhfjobs/status" in msg, msg
    assert create_as(chart_op.kubeconfig) == (201, "")


# ------------------------------------------------------------------------------------------ 4. Pod Security
def psa_namespace(api, level: str) -> str:
    ns = f"psa-{level}-{uuid.uuid4().hex[:6]}"
    client.CoreV1Api(api).create_namespace({"metadata": {"name": ns, "labels": {
        "pod-security.kubernetes.io/enforce": level, "pod-security.kubernetes.io/enforce-version": "latest"}}})
    wait_for(lambda: client.CoreV1Api(api).read_namespaced_service_account("default", ns), 60, "default SA")
    return ns


def dry_run_pod(api, ns: str, name: str, pod_spec: dict, labels: dict | None = None) -> str:
    """'' when admitted (server-side dry run: all admission, nothing stored), else the apiserver's message."""
    sa = pod_spec.get("serviceAccountName")
    if sa and sa != "default":
        try:
            client.CoreV1Api(api).create_namespaced_service_account(ns, {"metadata": {"name": sa}})
        except ApiException as e:
            if e.status != 409:
                raise
    for c in pod_spec.get("initContainers", []) + pod_spec["containers"]:  # the client types quantities as str
        for kind in ("requests", "limits"):
            q = (c.get("resources") or {}).get(kind) or {}
            q.update({k: str(v) for k, v in q.items()})
    body = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "labels": labels or {}}, "spec": pod_spec}
    try:
        client.CoreV1Api(api).create_namespaced_pod(ns, body, dry_run="All")
    except ApiException as e:
        assert e.status in (400, 403, 422), e.body
        return json.loads(e.body)["message"]
    return ""


def test_chart_operator_pod_passes_restricted(pcluster, papi, chart_op) -> None:
    ns = chart_op.system
    client.CoreV1Api(papi).patch_namespace(ns, {"metadata": {"labels": {
        "pod-security.kubernetes.io/enforce": "restricted", "pod-security.kubernetes.io/enforce-version": "latest"}}})
    tmpl = chart_op.deployment["spec"]["template"]
    msg = dry_run_pod(papi, ns, "operator-dry-run", tmpl["spec"], tmpl["metadata"]["labels"])
    assert msg == "", msg
    # and the namespace label really enforces: the same pod without its securityContext is refused
    bare = copy.deepcopy(tmpl["spec"])
    bare.pop("securityContext")
    assert "violates PodSecurity \"restricted:latest\"" in dry_run_pod(papi, ns, "bare", bare)


def kuberay_pods(api, ns: str, job: str) -> dict[str, dict]:
    """One live pod per role of the job (what KubeRay and the Job controller made from our templates), as a
    spec to submit again: server-set fields and the injected token volume removed."""
    out = {}
    for p in client.CoreV1Api(api).list_namespaced_pod(ns, label_selector=f"{naming.LABEL_JOB}={job}").items:
        role = (p.metadata.labels or {}).get(naming.LABEL_ROLE) or "?"
        spec = api.sanitize_for_serialization(p.spec)
        for k in ("nodeName", "serviceAccount"):
            spec.pop(k, None)
        spec["volumes"] = [v for v in spec.get("volumes", []) if not v["name"].startswith("kube-api-access")]
        for c in spec.get("initContainers", []) + spec["containers"]:
            c["volumeMounts"] = [v for v in c.get("volumeMounts", []) if not v["name"].startswith("kube-api-access")]
        out.setdefault(role, spec)
    return out


def test_runtime_pods_under_pod_security(pcluster, papi, chart_op) -> None:
    """Findings for render.py: each template of every sample, and the live pods KubeRay made for a job (its
    wait-gcs-ready init container included), dry-run in a ``baseline`` and a ``restricted`` namespace.
    ``baseline`` must admit them; ``restricted`` may refuse them for ``runAsNonRoot`` only."""
    ns = chart_op.team
    apply(pcluster, cpu_job("alpha"), ns)
    live_pods = wait_for(lambda: (p := kuberay_pods(papi, ns, "alpha")) and {"head", "trainer", "rollout",
                                                                             "submitter"} <= set(p) and p,
                         120, "alpha's head, worker and submitter pods (KubeRay, Job controller)")
    candidates: dict[str, dict] = {f"live alpha {r}": s for r, s in sorted(live_pods.items())}
    for f in sorted((REPO / "crds" / "samples").glob("*.yaml")):
        body = load_sample(f.stem)
        rj = render.render_ray_job(render.Job(body["metadata"]["name"], "x", "uid",
                                              m.RLHFJobSpec.model_validate(body["spec"])))
        cs = rj["spec"]["rayClusterSpec"]
        candidates[f"render {f.stem} head"] = cs["headGroupSpec"]["template"]["spec"]
        for g in cs["workerGroupSpecs"]:
            candidates[f"render {f.stem} worker {g['groupName']}"] = g["template"]["spec"]
        candidates[f"render {f.stem} submitter"] = rj["spec"]["submitterPodTemplate"]["spec"]
    for pc in {s.get("priorityClassName") for s in candidates.values()} - {None}:  # admission checks it exists
        try:
            client.SchedulingV1Api(papi).create_priority_class({"metadata": {"name": pc}, "value": 1000})
        except ApiException as e:
            if e.status != 409:
                raise
    findings: dict[str, dict[str, str]] = collections.defaultdict(dict)
    for level in ("baseline", "restricted"):
        pns = psa_namespace(papi, level)
        for i, (what, spec) in enumerate(candidates.items()):
            findings[level][what] = dry_run_pod(papi, pns, f"p{i}", copy.deepcopy(spec))
    for level, res in findings.items():
        print(f"\n--- PodSecurity {level}")
        for msg, whats in _group(res).items():
            print(f"{len(whats)} pod(s): {msg or 'ADMITTED'}\n    " + "\n    ".join(whats))
    # A sample's own hostPath volume is the user's choice; everything render.py and KubeRay add must be baseline,
    # except the head container of a job with the builtin python tool: unconfined seccomp, so that the tool can
    # isolate the model's code in namespaces of its own (render._python_tool_isolation; docs/agents.md)
    user_hostpath = {w for w in candidates if any("hostPath" in v for v in candidates[w].get("volumes", []))}
    user_hostpath |= {w for w in candidates if w == "render agent-python-tool head"}
    baseline_refused = {w: msg for w, msg in findings["baseline"].items() if msg and w not in user_hostpath}
    assert not baseline_refused, baseline_refused
    # restricted: everything but runAsNonRoot, which is the image's (render.py: the vLLM images run as root)
    only_non_root = re.compile(r'^pods "p\d+" is forbidden: violates PodSecurity "restricted:latest": '
                               r'runAsNonRoot != true \([^)]*\)$')
    restricted_refused = {w: msg for w, msg in findings["restricted"].items()
                          if msg and w not in user_hostpath and not only_non_root.match(msg)}
    assert not restricted_refused, "runtime pods refused by restricted for more than runAsNonRoot:\n" + "\n".join(
        f"{msg}\n    {', '.join(w)}" for msg, w in _group(restricted_refused).items())


def _group(res: dict[str, str]) -> dict[str, list[str]]:
    out: dict[str, list[str]] = collections.defaultdict(list)
    for what, msg in res.items():
        out[msg].append(what)
    return out


# ----------------------------------------------------------------------- 1. the operator's calls vs grants
def kueue_installed(api) -> bool:
    return "missing" not in KUEUE and forbidden(client.ApiextensionsV1Api(api).read_custom_resource_definition,
                                                "workloads.kueue.x-k8s.io") == 200


def kueue_version(api) -> str:
    crd = client.ApiextensionsV1Api(api).read_custom_resource_definition("clusterqueues.kueue.x-k8s.io")
    return next(v.name for v in crd.spec.versions if v.storage)


@pytest.fixture(scope="module")
def gpu_fillers(pcluster, papi) -> None:
    """FILLER_GPUS of every node's GPUs taken by plain pods (KWOK runs them): 3 free per node."""
    core, fill = client.CoreV1Api(papi), f"filler-{uuid.uuid4().hex[:6]}"
    core.create_namespace({"metadata": {"name": fill}})
    wait_for(lambda: core.read_namespaced_service_account("default", fill), 60, "default SA")
    for i in range(NODES):
        core.create_namespaced_pod(fill, {"metadata": {"name": f"fill-{i}"}, "spec": {
            "nodeSelector": {"kubernetes.io/hostname": f"gpu-node-{i}"},
            "containers": [{"name": "c", "image": "fill", "resources": {"limits": {render.GPU: str(FILLER_GPUS)}}}]}})
    wait_for(lambda: all(p.status.phase == "Running" for p in core.list_namespaced_pod(fill).items), 60,
             "fillers Running on KWOK")


def kueue_queue(cluster, api, ns: str) -> None:
    """A ClusterQueue with CPU/memory quota (no GPUs: the queued job is CPU-only) and a LocalQueue in ``ns``."""
    v = f"kueue.x-k8s.io/{kueue_version(api)}"
    objs = [
        {"apiVersion": v, "kind": "ResourceFlavor", "metadata": {"name": "priv-flavor"}},
        {"apiVersion": v, "kind": "ClusterQueue", "metadata": {"name": "priv-cq"}, "spec": {
            "namespaceSelector": {}, "resourceGroups": [{
                "coveredResources": ["cpu", "memory"],
                "flavors": [{"name": "priv-flavor", "resources": [{"name": "cpu", "nominalQuota": "100"},
                                                                  {"name": "memory", "nominalQuota": "1000Gi"}]}]}]}},
        {"apiVersion": v, "kind": "LocalQueue", "metadata": {"name": "user-queue", "namespace": ns},
         "spec": {"clusterQueue": "priv-cq"}},
    ]
    cluster.kubectl("apply", "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List", "items": objs}))


def workloads(api, ns: str) -> list[dict]:
    return client.CustomObjectsApi(api).list_namespaced_custom_object("kueue.x-k8s.io", kueue_version(api), ns,
                                                                      "workloads")["items"]


def run_scenario(cluster, api, ns: str, tmp: Path) -> None:
    """Create (data ConfigMap, unschedulable GPU job, Kueue queue), edit (steps, suspend, progress deadline),
    a stuck run, hand-edited RBAC, delete: what the operator does for a user, in namespace ``ns``."""
    core, cust = client.CoreV1Api(api), client.CustomObjectsApi(api)
    grp = (m.GROUP, m.VERSION, ns, m.PLURAL)
    # (1) data from a ConfigMap; 3 GPUs (trainer 1 + one TP2 engine): fits in the free GPUs
    data = load_sample("separate-nccl-tp2")
    ref = data["spec"]["data"]["configMap"]
    core.create_namespaced_config_map(ns, {"metadata": {"name": ref["name"]}, "data": {ref["key"]: '{"prompt": "1+1"}\n'}})
    data["metadata"]["name"] = "with-data"
    apply(cluster, data, ns)
    # (2) a trainer pod asking 4 GPUs: 4+ free in total, never 4 on one node -> unschedulable, fragmentation
    frag = load_sample("separate-nccl-tp2")
    frag["metadata"]["name"] = "big-trainer"
    frag["spec"]["trainer"].update(gpusPerReplica=4, strategy="fsdp2")
    frag["spec"]["data"] = {"prompts": ["a", "b"]}
    apply(cluster, frag, ns)
    # (3) a Kueue queue, when the cluster has Kueue
    names = ["with-data", "big-trainer"]
    if kueue_installed(api):
        kueue_queue(cluster, api, ns)
        q = cpu_job("queued")
        q["spec"]["scheduling"] = {"queueName": "user-queue"}
        apply(cluster, q, ns)
        names.append("queued")

    def phase(name):
        return (get_job(api, ns, name).get("status") or {}).get("phase")

    wait_for(lambda: phase("with-data") == "Running", 180, "with-data Running")
    st = wait_for(lambda: (s := get_job(api, ns, "big-trainer").get("status") or {}).get("phase") == "Pending"
                  and "fragmented over nodes" in (s.get("message") or "") and s, 180,
                  "big-trainer Pending, its message saying the free GPUs are fragmented (nodes and pods listed)")
    print(f"\n[{ns}] big-trainer: {st['message']}")

    # edits: steps (ConfigMap patched), later suspend and resume (RayJob patched; a queued job's Kueue Workload)
    cust.patch_namespaced_custom_object(*grp, "with-data", {"spec": {"algorithm": {"steps": 150}}})
    wait_for(lambda: json.loads(core.read_namespaced_config_map("with-data-config", ns).data[naming.CONFIG_KEY])
             ["spec"]["algorithm"]["steps"] == 150, 60, "ConfigMap follows algorithm.steps")
    # a stuck run: the runtime (with its own token) reports progress 20 min ago, past progressDeadlineSeconds plus
    # the operator's grace; the operator deletes the run's Ray head pod once (Event EndingStuckRun)
    cust.patch_namespaced_custom_object(*grp, "with-data", {"spec": {"progressDeadlineSeconds": 10}})

    def head_pod_cluster() -> str | None:  # the current Ray cluster, once its head pod exists
        name = (cust.get_namespaced_custom_object("ray.io", "v1", ns, "rayjobs", "with-data").get("status") or {}
                ).get("rayClusterName")
        heads = core.list_namespaced_pod(ns, label_selector=f"ray.io/cluster={name},ray.io/node-type=head").items
        return name if name and heads else None

    cluster_name = wait_for(head_pod_cluster, 120, "the run's Ray cluster and head pod")
    kc = cluster.token_kubeconfig(ns, "with-data-runtime", tmp / f"{ns}-with-data-runtime.kubeconfig")
    old = (dt.datetime.now(dt.UTC) - dt.timedelta(minutes=20)).replace(microsecond=0).isoformat().replace("+00:00", "Z")
    StatusClient("with-data", ns, get_job(api, ns, "with-data")["metadata"]["uid"], kubeconfig=str(kc)).patch(
        status_patch("Running", ray_cluster=cluster_name, progress_time=old))
    try:
        wait_for(lambda: any(e.reason == "EndingStuckRun" for e in core.list_namespaced_event(
            ns, field_selector="involvedObject.name=with-data").items), 60, "the operator ending the stuck run")
    except AssertionError as e:
        evs = core.list_namespaced_event(ns, field_selector="involvedObject.name=with-data").items
        raise AssertionError(f"{e}\nreported for Ray cluster {cluster_name}; RayJob now: "
                             f"{cust.get_namespaced_custom_object('ray.io', 'v1', ns, 'rayjobs', 'with-data')['status']}"
                             f"\nevents of with-data:\n" + "\n".join(
                                 f"{x.count}x {x.reason}: {x.message}" for x in evs)) from None
    for suspend in (True, False):
        cust.patch_namespaced_custom_object(*grp, "with-data", {"spec": {"suspend": suspend}})
        wait_for(lambda s=suspend: cust.get_namespaced_custom_object("ray.io", "v1", ns, "rayjobs", "with-data")
                 ["spec"].get("suspend", False) is s, 60, f"RayJob suspend={suspend}")
    if "queued" in names:
        wait_for(lambda: workloads(api, ns), 120, "Kueue's Workload of the queued RayJob")
        cust.patch_namespaced_custom_object(*grp, "queued", {"spec": {"suspend": True}})
        wait_for(lambda: workloads(api, ns)[0]["spec"].get("active", True) is False, 60,
                 "the queued job's Workload deactivated by the operator")
    # a hand-edited Role, then RoleBinding: the operator restores them (asserted by their own test). One after the
    # other: a RoleBinding update while its Role holds a rule the operator lacks is refused by RBAC (escalation)
    rb = client.RbacAuthorizationV1Api(api)
    want = rendered_rbac(api, ns, "with-data")
    rb.patch_namespaced_role("with-data-runtime", ns, {"rules": [
        *want["Role"]["rules"], {"apiGroups": [""], "resources": ["pods"], "verbs": ["get"]}]})
    wait_for(lambda: canon(live(api, "Role", ns, "with-data-runtime")["rules"]) == canon(want["Role"]["rules"]),
             30, "Role restored")
    rb.patch_namespaced_role_binding("with-data-runtime", ns, {"subjects": [
        *want["RoleBinding"]["subjects"], {"kind": "ServiceAccount", "name": "default", "namespace": ns}]})
    wait_for(lambda: canon(live(api, "RoleBinding", ns, "with-data-runtime")["subjects"])
             == canon(want["RoleBinding"]["subjects"]), 30, "RoleBinding restored")

    # delete: Kopf removes its finalizer, owner references remove the children
    for name in names:
        cust.delete_namespaced_custom_object(*grp, name)
    wait_for(lambda: not {j["metadata"]["name"] for j in cust.list_namespaced_custom_object(*grp)["items"]}
             & set(names), 60, "jobs deleted (finalizer removed)")


def compare_calls_with_grants(cluster, co: ChartOperator, not_exercised: dict) -> None:
    """The audit log of ``co``'s ServiceAccount against the chart's grants: print both tables, then assert."""
    events = audit_events(cluster, co.user)
    assert events, f"no audit events for {co.user}"
    denied = [(call_key(e), e["requestURI"], e["responseStatus"].get("message", "")) for e in events
              if e.get("responseStatus", {}).get("code") == 403]
    calls = collections.Counter(call_key(e) for e in events)
    granted = co.granted()
    used = {(k[0], k[1], k[2]) for k in calls if k[0] != "nonResource"}
    print(f"\n=== calls of {co.user} (audit log), {len(events)} requests")
    print(f"{'verb':<7} {'apiGroup':<26} {'resource':<26} {'scope':<13} {'calls':>6}  granted by")
    for k, n in sorted(calls.items(), key=lambda kv: (kv[0][0] == "nonResource", kv[0])):
        if k[0] == "nonResource":
            print(f"{k[1]:<7} {'(non-resource URL)':<26} {k[2]:<40} {n:>6}  system:discovery (default)")
        else:
            by = ", ".join(granted.get(k[:3], ["NOT GRANTED"]))
            print(f"{k[2]:<7} {k[0] or 'core':<26} {k[1]:<26} {k[3]:<13} {n:>6}  {by}")
    print(f"\n=== granted to {co.sa} by the chart, used?")
    for g in sorted(granted):
        why = "yes" if g in used else GRANTED_NOT_CALLED.get(g) or not_exercised.get(g) or "NO"
        print(f"{g[2]:<7} {g[0] or 'core':<26} {g[1]:<26} {', '.join(granted[g]):<48} {why}")

    assert not denied, "\n".join(map(str, denied[:20]))
    assert used <= set(granted), used - set(granted)
    unused = {g for g in granted if g not in used and g not in GRANTED_NOT_CALLED and g not in not_exercised}
    assert not unused, f"granted by the chart, never called in the scenario: {sorted(unused)}"
    stale = {g for g in GRANTED_NOT_CALLED if g in used or g not in granted}
    assert not stale, f"GRANTED_NOT_CALLED lists calls that were made or are no longer granted: {stale}"


def no_kueue_reason(api) -> dict:
    if kueue_installed(api):
        return {}
    why = KUEUE.get("missing") or "no Kueue CRDs"
    return {("kueue.x-k8s.io", "workloads", v): f"no queued job could run: {why}" for v in ("list", "patch")}


def test_operator_calls_match_the_charts_grants(pcluster, papi, chart_op, gpu_fillers, tmp_path) -> None:
    """watch.scope=cluster (the chart's default): one ClusterRole, the operator with --all-namespaces."""
    run_scenario(pcluster, papi, chart_op.team, tmp_path)
    compare_calls_with_grants(pcluster, chart_op, no_kueue_reason(papi))


def test_namespaced_operator_calls_match_the_charts_grants(pcluster, papi, chart_op, gpu_fillers, tmp_path) -> None:
    """watch.scope=namespaces: a Role in the watched namespace, the operator with --namespace. The cluster-wide
    operator is stopped first (it would reconcile the same jobs)."""
    chart_op.stop()
    co = ChartOperator(pcluster, papi, tmp_path, scope="namespaces", release="privns")
    try:
        run_scenario(pcluster, papi, co.team, tmp_path)
    finally:
        co.stop()
    compare_calls_with_grants(pcluster, co, no_kueue_reason(papi))
