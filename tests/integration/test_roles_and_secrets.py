"""Roles with models of their own, and secrets, on the real control plane (apiserver, scheduler, KubeRay, KWOK GPU
nodes, our operator as a process):

* a PPO job with a separate reward model, a separate reference and a colocated critic: KubeRay makes a worker
  group per separate role, and the real scheduler places every pod of every group on a GPU node with the GPUs
  (and the Ray custom resource) the group asks for;
* a job whose HF_TOKEN comes from a Secret (``env[].valueFrom``) and with another Secret as ``envFrom``: the
  pods reference the Secrets, and neither secret value shows up anywhere the operator writes or logs (the job's
  ConfigMap, the RLHFJob's spec and status, the namespace's Events, the operator's log at DEBUG)."""

from __future__ import annotations

import json
import uuid

import pytest
from kubernetes import client

from rlhf_api import models as m
from rlhf_api.groups import total_gpus
from rlhf_operator import render
from tests.helpers import events_until, wait_for
from tests.integration.conftest import Operator, apply, load_sample
from tests.integration.test_lifecycle import (
    condition,
    get_job,
    gpus,
    make_bound_pvc,
    phase,
    ray_objects,
    ray_pods,
)

pytestmark = pytest.mark.cluster


def _command(pod: client.V1Pod) -> str:
    c = pod.spec.containers[0]
    return " ".join([*(c.command or []), *(c.args or [])])


def test_separate_reward_and_reference_groups_are_scheduled_on_gpu_nodes(cluster, api, operator, namespace) -> None:
    job = load_sample("ppo-reward-model")  # reward + reference separate (1 GPU each), critic colocated
    name = job["metadata"]["name"]
    spec = m.RLHFJobSpec.model_validate(job["spec"])
    core = client.CoreV1Api(api)
    make_bound_pvc(api, namespace, "trained-models")
    core.create_namespaced_config_map(namespace, {"metadata": {"name": "chat-prompts"}, "data": {
        "prompts.jsonl": '{"prompt": "2+2?", "answer": "4"}\n', "eval.jsonl": '{"prompt": "3+3?", "answer": "6"}\n'}})
    core.create_namespaced_secret(namespace, {"metadata": {"name": "hf-token"}, "stringData": {"token": "hf_x"}})
    apply(cluster, job, namespace)

    groups = {g.name: g for g in render.worker_groups(spec)}
    assert list(groups) == ["trainer", "rollout", "reward", "reference"]  # no critic group: it is colocated
    rc = wait_for(lambda: ray_objects(api, namespace, "rayclusters"), 90, "RayCluster")[0]
    params = {g["groupName"]: g["rayStartParams"] for g in rc["spec"]["workerGroupSpecs"]}
    assert params["reward"] == {"num-gpus": "1", "resources": """'{"rlhf_reward":1}'"""}
    assert params["reference"] == {"num-gpus": "1", "resources": """'{"rlhf_reference":1}'"""}

    expected = 1 + sum(g.replicas for g in groups.values())
    def scheduled() -> list[client.V1Pod] | None:
        ps = ray_pods(api, namespace)
        return ps if len(ps) == expected and all(p.spec.node_name for p in ps) else None

    placed = wait_for(scheduled, 150, f"all {expected} Ray pods scheduled")
    by_group: dict[str, list[client.V1Pod]] = {}
    for p in placed:
        by_group.setdefault(p.metadata.labels.get("ray.io/group", "head"), []).append(p)
    assert set(by_group) == {"headgroup", *groups}, sorted(by_group)
    nodes = {n.metadata.name: n for n in core.list_node(label_selector="type=kwok").items}
    for gname, g in groups.items():
        assert len(by_group[gname]) == g.replicas, gname
        for p in by_group[gname]:
            assert gpus(p) == g.gpus == 1, (gname, gpus(p))
            node = nodes[p.spec.node_name]  # a KWOK GPU node with room for it
            assert int(node.status.allocatable.get(render.GPU, 0)) >= g.gpus
            assert node.metadata.labels[render.GPU_PRODUCT_LABEL]
            assert p.metadata.labels["rlhf.dev/role"] == gname
            # KubeRay's `ray start` advertises the group's custom resource, which the runtime's bundles ask for
            assert f"""--resources='{{"rlhf_{gname}":1}}'""" in _command(p), _command(p)
    assert sum(gpus(p) for p in placed) == total_gpus(spec) == 4
    wait_for(lambda: phase(api, namespace, name) == "Running", 120, "phase Running")
    assert condition(get_job(api, namespace, name), "PodsScheduled")["status"] == "True"


@pytest.fixture
def verbose_operator(cluster, api, tmp_path):
    """An operator of its own at DEBUG (Kopf logs the patches it sends) for a namespace of its own (sec-*)."""
    ns = f"sec-{uuid.uuid4().hex[:8]}"
    client.CoreV1Api(api).create_namespace({"metadata": {"name": ns}})
    wait_for(lambda: any(sa.metadata.name == "default" for sa in
                         client.CoreV1Api(api).list_namespaced_service_account(ns).items), 60, "default SA")
    op = Operator(cluster, ["--namespace", ns, "--verbose"], tmp_path / "operator.log").start()
    try:
        yield ns, op
    finally:
        op.kill()
        client.CoreV1Api(api).delete_namespace(ns)


def test_secret_values_stay_out_of_everything_the_operator_writes(cluster, api, verbose_operator) -> None:
    ns, op = verbose_operator
    core = client.CoreV1Api(api)
    token, wandb = f"hf_{uuid.uuid4().hex}", f"wandb_{uuid.uuid4().hex}"
    core.create_namespaced_secret(ns, {"metadata": {"name": "hf-token"}, "stringData": {"token": token}})
    core.create_namespaced_secret(ns, {"metadata": {"name": "tracking"}, "stringData": {"WANDB_API_KEY": wandb}})
    name = "secret-env"
    apply(cluster, {"apiVersion": m.API_VERSION, "kind": m.KIND, "metadata": {"name": name}, "spec": {
        "model": {"name": "org/gated-model"}, "image": "ghcr.io/rlhf-operator/runtime:0.1.0",
        "data": {"prompts": ["What is 2+2?"]}, "reward": {"rule": "contains", "target": "4"},
        "env": [{"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf-token", "key": "token"}}},
                {"name": "HF_HUB_OFFLINE", "value": "0"}],
        "envFrom": [{"secretRef": {"name": "tracking"}}],
    }}, ns)
    wait_for(lambda: phase(api, ns, name) == "Running", 150, "phase Running")

    want_env = {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf-token", "key": "token",
                                                                    "optional": False}}}
    want_from = [{"secretRef": {"name": "tracking", "optional": False}}]
    (rj,) = ray_objects(api, ns, "rayjobs")
    cluster_spec = rj["spec"]["rayClusterSpec"]
    for g in [cluster_spec["headGroupSpec"], *cluster_spec["workerGroupSpecs"]]:
        c = g["template"]["spec"]["containers"][0]
        assert want_env in c["env"] and c["envFrom"] == want_from, g.get("groupName", "head")
    pods = ray_pods(api, ns)
    assert len(pods) == 3  # head, trainer, rollout
    for p in pods:  # the pods KubeRay made: the kubelet would resolve the references
        c = api.sanitize_for_serialization(p.spec.containers[0])
        hf = next(e for e in c["env"] if e["name"] == "HF_TOKEN")
        assert hf == want_env and "value" not in hf, hf
        assert c["envFrom"] == want_from, c.get("envFrom")

    cm = core.read_namespaced_config_map(f"{name}-config", ns)
    job = get_job(api, ns, name)
    events_until(api, ns, name, lambda evs: any(e.reason == "Created" for e in evs), "a Created Event")
    events = core.list_namespaced_event(ns).items  # every Event in the namespace, the job's and its children's
    log = wait_for(lambda: op.log.read_text(errors="replace"), 10, "operator log")
    assert "secret-env" in log  # the log is about this job: Kopf at DEBUG logged its handling
    places = {
        "ConfigMap": json.dumps(api.sanitize_for_serialization(cm)),
        "RLHFJob": json.dumps(job),
        "RayJob": json.dumps(rj),
        "Events": json.dumps([api.sanitize_for_serialization(e) for e in events]),
        "operator log": log,
    }
    assert "secretKeyRef" in places["ConfigMap"] and "hf-token" in places["RLHFJob"]  # references only
    assert "status" in job and job["status"].get("phase") == "Running"
    for where, text in places.items():
        for secret in (token, wandb):
            assert secret not in text, f"a secret value leaked into the {where}"
