"""Packing and fragmentation on the real scheduler (KWOK GPU nodes of their own, tainted so no other test's pods
land there): a job's worker pods pack by group and by job, so a large trainer pod still finds a free node; when
free GPUs exist but no node has enough, the job's condition says the GPUs are fragmented."""

from __future__ import annotations

import re
import uuid

import pytest
from kubernetes import client

from tests.helpers import wait_for
from tests.integration.conftest import apply, load_sample
from tests.integration.test_lifecycle import condition, get_job, gpus, ray_pods

pytestmark = pytest.mark.cluster
TAINT = "rlhf.dev/pack-test"


@pytest.fixture
def pool(cluster, api):
    """Four 8-GPU nodes that only this test's pods tolerate."""
    prefix = f"pack-{uuid.uuid4().hex[:4]}"
    cluster.add_nodes(4, 8, prefix=prefix)  # waits until at least 4 KWOK nodes are Ready (these among them)
    names = [f"{prefix}-{i}" for i in range(4)]
    for n in names:
        cluster.kubectl("label", "node", n, f"pool={prefix}")
        cluster.kubectl("taint", "node", n, f"{TAINT}={prefix}:NoSchedule")
    wait_for(lambda: all(any(c.type == "Ready" and c.status == "True" for c in
                             client.CoreV1Api(api).read_node(n).status.conditions or []) for n in names),
             120, "pool nodes Ready")
    yield prefix, names
    for n in names:
        cluster.kubectl("delete", "node", n, "--wait=false", check=False)


def pinned(job: dict, prefix: str) -> dict:
    job["spec"]["scheduling"] = {
        "nodeSelector": {"pool": prefix},
        "tolerations": [{"key": TAINT, "operator": "Equal", "value": prefix, "effect": "NoSchedule"}],
    }
    return job


def big_job(name: str, prefix: str) -> dict:
    """An 8-GPU trainer pod and four 2-GPU engine pods: 16 GPUs; the trainer needs a whole node."""
    job = pinned(load_sample("separate-nccl-tp2"), prefix)
    job["metadata"]["name"] = name
    job["spec"]["trainer"] = {"replicas": 1, "gpusPerReplica": 8, "strategy": "fsdp2"}
    job["spec"]["rollout"]["engines"] = 4
    job["spec"]["rollout"]["tensorParallelSize"] = 2
    return job


def test_worker_pods_pack_so_a_whole_node_stays_free(cluster, api, operator, namespace, pool) -> None:
    prefix, _ = pool
    small = pinned(load_sample("separate-nccl-tp2"), prefix)  # 1 trainer GPU + 1 engine x TP2 = 3 GPUs
    small["metadata"]["name"] = "small"
    apply(cluster, small, namespace)
    wait_for(lambda: (get_job(api, namespace, "small").get("status") or {}).get("phase") == "Running", 180,
             "the 3-GPU job Running")
    apply(cluster, big_job("big", prefix), namespace)
    def running():
        j = get_job(api, namespace, "big")
        return j if (j.get("status") or {}).get("phase") == "Running" else None

    j = wait_for(running, 240, "the 16-GPU job Running on 4 x 8 GPUs with 3 taken")
    assert condition(j, "PodsScheduled")["status"] == "True"
    big = [p for p in ray_pods(api, namespace) if p.metadata.labels.get("rlhf.dev/job") == "big" and gpus(p)]
    by_role: dict[str, set[str]] = {}
    for p in big:
        by_role.setdefault(p.metadata.labels["rlhf.dev/role"], set()).add(p.spec.node_name)
    assert len(by_role["rollout"]) == 1, by_role  # four 2-GPU engine pods on one node
    assert by_role["trainer"].isdisjoint(by_role["rollout"]), by_role


def test_fragmented_gpus_are_reported_as_such(cluster, api, operator, namespace, pool) -> None:
    prefix, nodes = pool
    # one GPU taken on every node by plain pods: 28 free in total, at most 7 on one node
    for i, n in enumerate(nodes):
        client.CoreV1Api(api).create_namespaced_pod(namespace, {
            "metadata": {"name": f"filler-{i}"},
            "spec": {"nodeName": n, "tolerations": [{"key": TAINT, "operator": "Exists"}],
                     "containers": [{"name": "c", "image": "filler", "resources": {
                         "requests": {"nvidia.com/gpu": "1"}, "limits": {"nvidia.com/gpu": "1"}}}]},
        })
    apply(cluster, big_job("frag", prefix), namespace)

    def fragmented():
        j = get_job(api, namespace, "frag")
        msg = (j.get("status") or {}).get("message", "")
        return j if j["status"].get("phase") == "Pending" and "fragmented" in msg else None

    j = wait_for(fragmented, 180, "Pending with a fragmentation message")
    msg = j["status"]["message"]
    # the engine pods took what fits (at most 8 of the 28 free); no node has the trainer's 8 left
    assert re.search(r"(2[0-8]) GPUs free on 4 matching node\(s\), at most 7 on one node", msg), msg
    assert ", 8 on one node: the free GPUs are fragmented over nodes" in msg, msg
    assert condition(j, "Stalled")["status"] == "True" and condition(j, "Stalled")["reason"] == "Unschedulable"
