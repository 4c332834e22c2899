"""Fixtures for the integration tier: a real control plane (etcd, kube-apiserver, scheduler,
controller-manager), KWOK GPU nodes, the real KubeRay operator, and our operator as a real process."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import urllib.request
import uuid
from pathlib import Path

import pytest
import yaml
from kubernetes import client, config

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "hack"))
import localcluster

from tests.helpers import wait_for

NODES = 5
GPUS_PER_NODE = 8


@pytest.fixture(scope="package")
def cluster(tmp_path_factory) -> localcluster.Cluster:
    c = localcluster.Cluster(tmp_path_factory.mktemp("cluster"), localcluster.build())
    try:
        c.up(nodes=NODES, gpus_per_node=GPUS_PER_NODE)
        yield c
    finally:
        c.stop()


@pytest.fixture(scope="package")
def kueue(cluster) -> localcluster.Cluster:
    """The real Kueue manager in the session's cluster, installed by the first test that asks for it (it then
    stays; with ``manageJobsWithoutQueueName: false`` it leaves RayJobs without a queue label alone)."""
    cluster.install_kueue()
    return cluster


@pytest.fixture(scope="package")
def api(cluster) -> client.ApiClient:
    return config.new_client_from_config(str(cluster.kubeconfig))


class Operator:
    """Our operator as a child process (so tests can kill -9 and restart it)."""

    def __init__(self, cluster: localcluster.Cluster, args: list[str], log: Path, kubeconfig: Path | None = None):
        self.kubeconfig = kubeconfig or cluster.kubeconfig
        if not any(a.startswith("--metrics-port") for a in args):
            args = [*args, "--metrics-port", str(localcluster.free_port())]
        self.metrics_port = int(next(a.split("=", 1)[1] if "=" in a else args[i + 1]
                                     for i, a in enumerate(args) if a.startswith("--metrics-port")))
        self.args, self.log, self.proc = args, log, None

    def reconciles(self, namespace: str | None = None, job: str | None = None) -> float:
        """Reconciles this operator process has run (its Prometheus counters), of one job if named; 0 before it
        serves metrics."""
        try:
            text = urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5).read().decode()
        except OSError:
            return 0.0
        if job is None:
            prefix = "rlhf_operator_reconciles_total{"
        else:
            prefix = f'rlhf_job_reconciles_total{{job="{job}",namespace="{namespace}"}}'
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(prefix))

    def start(self) -> Operator:
        env = {**os.environ, "KUBECONFIG": str(self.kubeconfig)}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "rlhf_operator.main", "--liveness", "", *self.args],
            stdout=open(self.log, "ab"), stderr=subprocess.STDOUT, env=env, start_new_session=True,  # noqa: SIM115
        )
        return self

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.proc and self.proc.poll() is None:
            os.killpg(self.proc.pid, sig)
            self.proc.wait(timeout=30)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


def free_port() -> int:
    return localcluster.free_port()


@pytest.fixture(scope="package")
def operator(cluster, tmp_path_factory):
    """One operator for the session, watching namespaces named it-*, serving metrics on ``op.metrics_port``."""
    op = Operator(cluster, ["--namespace", "it-*"], tmp_path_factory.mktemp("op") / "operator.log").start()
    yield op
    op.kill(signal.SIGTERM)


@pytest.fixture
def namespace(cluster, api) -> str:
    name = f"it-{uuid.uuid4().hex[:8]}"
    client.CoreV1Api(api).create_namespace({"metadata": {"name": name}})
    wait_for(lambda: _has_default_sa(api, name), 60, "default service account")
    yield name
    client.CoreV1Api(api).delete_namespace(name, propagation_policy="Foreground")


def _has_default_sa(api, ns: str) -> bool:
    return any(sa.metadata.name == "default" for sa in client.CoreV1Api(api).list_namespaced_service_account(ns).items)


def load_sample(name: str) -> dict:
    return yaml.safe_load((REPO / "crds" / "samples" / f"{name}.yaml").read_text())


def apply(cluster, obj: dict, ns: str, *extra: str, check: bool = True, data: bool = True):
    """kubectl apply; for an RLHFJob whose spec.data.configMap names a ConfigMap, that ConfigMap is made first
    (one prompt) unless ``data`` is False: without it the operator holds the job Pending (DataConfigMapMissing)."""
    ref = ((obj.get("spec") or {}).get("data") or {}).get("configMap") if obj.get("kind") == "RLHFJob" else None
    if ref and data:
        cm = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": ref["name"]},
              "data": {ref.get("key", "prompts.jsonl"): '{"prompt": "1+1?"}\n'}}
        cluster.kubectl("apply", "-n", ns, "-f", "-", input=json.dumps(cm))
    return cluster.kubectl("apply", "-n", ns, *extra, "-f", "-", input=json.dumps(obj), check=check)


def peering_namespace(cluster, api, prefix: str) -> str:
    """A fresh namespace with the Kopf peering CRD installed and a KopfPeering ``rlhf`` in it."""
    ns = f"{prefix}-{uuid.uuid4().hex[:6]}"
    client.CoreV1Api(api).create_namespace({"metadata": {"name": ns}})
    cluster.kubectl("apply", "--server-side", "-f", str(REPO / "crds" / "kopf-peering.yaml"))
    wait_for(lambda: cluster.kubectl("wait", "--for=condition=Established", "crd/kopfpeerings.kopf.dev",
                                     "--timeout=5s", check=False).returncode == 0, 60, "peering CRD")
    apply(cluster, {"apiVersion": "kopf.dev/v1", "kind": "KopfPeering", "metadata": {"name": "rlhf"}}, ns)
    return ns
