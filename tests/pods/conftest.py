"""Fixtures for the real-pod tier: the product as a user runs it, in real containers.

A real control plane with real nodes (containerd + runc + CNI + kubelet, ``hack/realnodes.py``), cluster DNS
and Service routing; KubeRay as a pod; our operator installed from its Helm chart with the locally built
operator image; RLHFJobs whose head, trainer and engine pods run the locally built CPU runtime image. A tiny
model built from a config is shared with the pods through a hostPath volume (all nodes are on this machine,
as an NFS or CSI volume would be on a real cluster), and so is the checkpoint directory.
"""

from __future__ import annotations

import json
import os
import sys
import uuid
from pathlib import Path

import pytest
from kubernetes import client, config

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "hack"))
import cpujob
import localcluster

from tests.helpers import wait_for

#: Real nodes for the tier (two: head and workers can land on different nodes).
REAL_NODES = int(os.environ.get("RLHF_REAL_NODES", "2"))
RELEASE, SYSTEM_NS = "rlhf", "rlhf-system"
RESTRICTED = ("pod-security.kubernetes.io/enforce=restricted", "pod-security.kubernetes.io/enforce-version=latest")


@pytest.fixture(scope="package")
def real_cluster(tmp_path_factory) -> localcluster.Cluster:
    # A short path: containerd's and the kubelet's unix sockets live under it. RLHF_PODS_CLUSTER_DIR names a
    # cluster to reuse if it is up (a development loop: the cluster is then neither started nor stopped here).
    reuse = os.environ.get("RLHF_PODS_CLUSTER_DIR")
    c = localcluster.Cluster(Path(reuse or f"/tmp/rlhf-pods-{uuid.uuid4().hex[:6]}"), localcluster.build())
    if reuse and c.attach():
        yield c
        return
    try:
        c.up(nodes=1, gpus_per_node=8, real_nodes=REAL_NODES)
        yield c
    finally:
        if os.environ.get("RLHF_KEEP_CLUSTER") != "1" and not reuse:
            c.stop()


@pytest.fixture(scope="package")
def rapi(real_cluster) -> client.ApiClient:
    return config.new_client_from_config(str(real_cluster.kubeconfig))


@pytest.fixture(scope="package")
def operator_release(real_cluster) -> str:
    """`helm install` of our chart with the locally built operator image, on a real node."""
    real_cluster.helm("uninstall", RELEASE, "-n", SYSTEM_NS, "--wait", check=False)  # a reused cluster
    # The operator's namespace enforces Pod Security "restricted": the chart's pod must pass it.
    real_cluster.kubectl("create", "namespace", SYSTEM_NS, check=False)
    real_cluster.kubectl("label", "--overwrite", "namespace", SYSTEM_NS, *RESTRICTED)
    real_cluster.install_operator_chart(RELEASE, SYSTEM_NS)
    yield RELEASE
    real_cluster.helm("uninstall", RELEASE, "-n", SYSTEM_NS, check=False)


@pytest.fixture(scope="package")
def shared_dir() -> Path:
    """A directory every pod mounts (hostPath): the tiny model and the checkpoints."""
    return cpujob.make_shared_dir(Path(f"/tmp/rlhf-pods-shared-{uuid.uuid4().hex[:6]}"))


def new_namespace(api: client.ApiClient) -> str:
    """A fresh namespace, once its default ServiceAccount exists (pods need it)."""
    name = f"pods-{uuid.uuid4().hex[:6]}"
    client.CoreV1Api(api).create_namespace({"metadata": {"name": name}})
    wait_for(lambda: any(sa.metadata.name == "default"
                         for sa in client.CoreV1Api(api).list_namespaced_service_account(name).items),
             60, "default service account")
    return name


def drop_namespace(api: client.ApiClient, name: str) -> None:
    """Delete ``name``, unless RLHF_KEEP_CLUSTER=1 keeps everything for a look after the run."""
    if os.environ.get("RLHF_KEEP_CLUSTER") != "1":
        client.CoreV1Api(api).delete_namespace(name)


@pytest.fixture
def ns(real_cluster, rapi) -> str:
    name = new_namespace(rapi)
    yield name
    drop_namespace(rapi, name)


def cpu_job(cluster: localcluster.Cluster, shared: Path, name: str, steps: int, *, trainers: int = 1) -> dict:
    return cpujob.cpu_job(name, cluster.images["runtime-cpu"]["ref"], shared, steps, trainers=trainers)


def apply(cluster: localcluster.Cluster, obj: dict, ns: str) -> None:
    cluster.kubectl("apply", "-n", ns, "-f", "-", input=json.dumps(obj))


def get_job(api: client.ApiClient, ns: str, name: str) -> dict:
    return client.CustomObjectsApi(api).get_namespaced_custom_object("rlhf.dev", "v1alpha1", ns, "rlhfjobs", name)


def status(api: client.ApiClient, ns: str, name: str) -> dict:
    return get_job(api, ns, name).get("status") or {}


def pods(api: client.ApiClient, ns: str, selector: str = "") -> list:
    return client.CoreV1Api(api).list_namespaced_pod(ns, label_selector=selector).items


def diagnostics(cluster: localcluster.Cluster, ns: str) -> str:
    """What to print when a real-pod test fails: pods, events, RLHFJob status, the head's and submitter's logs."""
    parts = []
    for args in (("get", "pods", "-o", "wide", "-n", ns), ("get", "rlhfjobs", "-n", ns, "-o", "yaml"),
                 ("get", "events", "-n", ns, "--sort-by=.lastTimestamp")):
        parts.append(cluster.kubectl(*args, check=False).stdout[-4000:])
    out = cluster.kubectl("get", "pods", "-n", ns, "-o", "name", check=False).stdout.split()
    for pod in out:
        log = cluster.kubectl("logs", "-n", ns, pod, "--all-containers", "--tail=60", check=False)
        parts.append(f"--- {pod}\n{(log.stdout or log.stderr)[-3000:]}")
    return "\n".join(parts)
