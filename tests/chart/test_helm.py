"""helm lint/template on the chart; a wrong value fails at install time with a readable schema message."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "rlhf-operator"
sys.path.insert(0, str(REPO / "hack"))
import localcluster


@pytest.fixture(scope="module")
def helm() -> str:
    return str(localcluster.build() / "helm")


def run(helm: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([helm, *args], capture_output=True, text=True, check=False)


def render(helm: str, *sets: str) -> list[dict]:
    out = run(helm, "template", "r", str(CHART), "--namespace", "rlhf-system", "--kube-version", "1.36.3", *sets)
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def test_lint(helm) -> None:
    out = run(helm, "lint", "--strict", str(CHART))
    assert out.returncode == 0, out.stdout + out.stderr


def test_chart_crds_match_top_level() -> None:
    for f in (REPO / "crds").glob("*.yaml"):
        assert (CHART / "crds" / f.name).read_text() == f.read_text(), f"chart copy of {f.name} differs"


def test_default_render_is_hardened_cluster_scoped(helm) -> None:
    docs = render(helm)
    kinds = sorted(d["kind"] for d in docs)
    assert kinds == ["ClusterRole", "ClusterRole", "ClusterRoleBinding", "ClusterRoleBinding", "Deployment", "ServiceAccount"]
    dep = next(d for d in docs if d["kind"] == "Deployment")
    pod = dep["spec"]["template"]["spec"]
    c = pod["containers"][0]
    assert dep["spec"]["strategy"]["type"] == "Recreate" and dep["spec"]["replicas"] == 1
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault"
    assert c["securityContext"]["readOnlyRootFilesystem"] is True
    assert c["securityContext"]["allowPrivilegeEscalation"] is False
    assert c["livenessProbe"]["httpGet"]["path"] == "/healthz" and c["readinessProbe"]
    assert "--all-namespaces" in c["args"]
    rules = [r for d in docs if d["kind"] == "ClusterRole" for r in d["rules"]]
    for rule in rules:
        assert "*" not in rule["verbs"] and "*" not in rule["resources"], rule
        # children go away by owner references; the deletes: a stuck run's Ray head pod (reconcile._end_stuck_run),
        # a RayCluster its RayJob no longer uses (children.delete_duplicates) and sandbox claims (a sandbox job's
        # runtime Role releases its own; a held job's are deleted with deletecollection: sandboxes.converge)
        assert "delete" not in rule["verbs"] or rule["resources"] in (["pods"], ["rayclusters"], ["sandboxclaims"]), rule
    # Kopf's namespace observer runs only with --namespace; Kopf posts core/v1 Events only
    # (tests/integration/test_privilege.py checks every granted rule against the audit log of a scenario)
    assert not [r for r in rules if "namespaces" in r["resources"] or "events.k8s.io" in r["apiGroups"]], rules


def test_namespaced_scope_uses_roles_only(helm) -> None:
    docs = render(helm, "--set", "watch.scope=namespaces", "--set", "watch.watchNamespaces={team-a,team-b}")
    kinds = sorted(d["kind"] for d in docs)
    assert kinds.count("Role") == 2 and kinds.count("RoleBinding") == 2
    observe = [d for d in docs if d["kind"] == "ClusterRole"]
    assert len(observe) == 1  # cluster-wide it may only read: watch CRDs and namespaces, list nodes and pods
    assert all(set(r["verbs"]) <= {"list", "watch"} for r in observe[0]["rules"])
    assert {"apiGroups": [""], "resources": ["namespaces"], "verbs": ["list", "watch"]} in observe[0]["rules"]
    off = render(helm, "--set", "watch.scope=namespaces", "--set", "watch.watchNamespaces={team-a}",
                 "--set", "rbac.clusterCapacity=false")
    observe_off = next(d for d in off if d["kind"] == "ClusterRole")
    assert all(set(r["resources"]) <= {"customresourcedefinitions", "namespaces"} for r in observe_off["rules"])
    dep = next(d for d in docs if d["kind"] == "Deployment")
    assert dep["spec"]["template"]["spec"]["containers"][0]["args"][:2] == ["--namespace=team-a", "--namespace=team-b"]


def test_metrics_service_and_monitor(helm) -> None:
    docs = render(helm, "--set", "metrics.service.enabled=true", "--set", "metrics.serviceMonitor.enabled=true")
    assert {"Service", "ServiceMonitor"} <= {d["kind"] for d in docs}
    dep = next(d for d in docs if d["kind"] == "Deployment")
    c = dep["spec"]["template"]["spec"]["containers"][0]
    assert "--metrics-port=9090" in c["args"] and {"name": "metrics", "containerPort": 9090} in c["ports"]
    mon = next(d for d in docs if d["kind"] == "ServiceMonitor")
    assert mon["spec"]["endpoints"][0]["port"] == "metrics"
    off = render(helm, "--set", "metrics.enabled=false", "--set", "metrics.service.enabled=true")
    assert "Service" not in {d["kind"] for d in off}


def test_runtime_pod_monitor_and_grafana_dashboard(helm) -> None:
    """Off by default. On: the PodMonitor selects exactly what the operator renders on every job's head pod
    (its labels, the container port the runtime's metrics are served on) and keeps the RLHFJob's job label; the
    dashboard ConfigMap carries Grafana's sidecar label and the dashboard file as it is."""
    from rlhf_operator import naming
    from rlhf_operator.render import METRICS_PORT_NAME

    default = render(helm)
    assert "PodMonitor" not in {d["kind"] for d in default}
    assert not any(d["kind"] == "ConfigMap" and d["metadata"]["name"].endswith("-dashboard") for d in default)
    docs = render(helm, "--set", "runtimeMetrics.podMonitor.enabled=true", "--set", "grafanaDashboard.enabled=true")
    mon = next(d for d in docs if d["kind"] == "PodMonitor")
    head_labels = naming.labels("any-job", "head")
    assert mon["spec"]["selector"]["matchLabels"].items() <= head_labels.items()
    assert not mon["spec"]["selector"]["matchLabels"].items() <= naming.labels("any-job", "trainer").items()
    endpoint = mon["spec"]["podMetricsEndpoints"][0]
    assert endpoint["port"] == METRICS_PORT_NAME and endpoint["honorLabels"] is True
    assert mon["spec"]["namespaceSelector"] == {"any": True}
    board = next(d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"].endswith("-dashboard"))
    assert board["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(board["data"]["rlhf-jobs.json"]) == json.loads((CHART / "files/grafana-dashboard.json").read_text())
    scoped = render(helm, "--set", "runtimeMetrics.podMonitor.enabled=true", "--set", "watch.scope=namespaces",
                    "--set", "watch.watchNamespaces={team-a,team-b}")
    mon = next(d for d in scoped if d["kind"] == "PodMonitor")
    assert mon["spec"]["namespaceSelector"] == {"matchNames": ["team-a", "team-b"]}


@pytest.mark.parametrize(
    "sets,message",
    [
        (["--set", "watch.scope=everywhere"], "/watch/scope"),
        (["--set", "replicaCount=-1"], "replicaCount"),
        (["--set", "replicaCount=2"], "peering"),
        (["--set", "watch.scope=namespaces"], "watchNamespaces"),
        (["--set", "image.pullPolicy=Sometimes"], "pullPolicy"),
        (["--set", "workers=0"], "workers"),
        (["--set", "unknownKey=1"], "unknownKey"),
    ],
)
def test_bad_values_are_rejected_by_schema(helm, sets, message) -> None:
    out = run(helm, "template", "r", str(CHART), "--kube-version", "1.36.3", *sets)
    assert out.returncode != 0, f"{sets} accepted"
    assert "values don't meet the specifications of the schema" in out.stderr and message in out.stderr, out.stderr


def test_peering_renders_the_peering_object_and_its_rbac(helm) -> None:
    docs = render(helm, "--set", "replicaCount=2", "--set", "peering.enabled=true")
    peering = [d for d in docs if d["kind"] == "ClusterKopfPeering"]
    assert [p["metadata"]["name"] for p in peering] == ["rlhf-operator"]
    rules = [r for d in docs if d["kind"] == "ClusterRole" for r in d["rules"]]
    assert any(r["resources"] == ["clusterkopfpeerings"] for r in rules)
    args = next(d for d in docs if d["kind"] == "Deployment")["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--peering=rlhf-operator" in args
    ns_docs = render(helm, "--set", "peering.enabled=true", "--set", "watch.scope=namespaces",
                     "--set", "watch.watchNamespaces={a,b}")
    assert sorted(d["metadata"]["namespace"] for d in ns_docs if d["kind"] == "KopfPeering") == ["a", "b"]
