"""A job's environment server as the operator renders it (``rlhf_operator.environment_server``): a Deployment of
the server pods, placed by the server's own nodeSelector and tolerations, and a headless Service at the address
the runtime is given (``rlhf_api.environment.server_url``). Pure functions."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml

from rlhf_api import models as m
from rlhf_api.environment import server_name, server_url
from rlhf_operator import naming, render
from rlhf_operator.environment_server import render_environment_server

REPO = Path(__file__).resolve().parents[2]


def server_job(**server: Any) -> render.Job:
    doc = yaml.safe_load((REPO / "crds" / "samples" / "agent-python-tool.yaml").read_text())
    spec = copy.deepcopy(doc["spec"])
    spec["environment"]["http"] = {"server": {"image": "envs/echo:1", "port": 8080, **server}}
    return render.Job("envjob", "team-a", "uid-1", m.RLHFJobSpec.model_validate(spec))


def test_nothing_without_a_server() -> None:
    doc = yaml.safe_load((REPO / "crds" / "samples" / "agent-python-tool.yaml").read_text())
    job = render.Job("plain", "team-a", "uid-2", m.RLHFJobSpec.model_validate(doc["spec"]))
    assert render_environment_server(job) == []
    spec = copy.deepcopy(doc["spec"])
    spec["environment"]["http"] = {"url": "http://env.example:8000"}  # the user's own server: nothing to run
    assert render_environment_server(render.Job("own", "team-a", "uid-3", m.RLHFJobSpec.model_validate(spec))) == []


def test_the_service_is_headless_at_the_runtimes_address() -> None:
    """One DNS record per ready pod (the runtime keeps each episode on one), none for a pod that is not ready;
    the name and port the runtime is given are the Service's."""
    job = server_job(replicas=3)
    deployment, service = render_environment_server(job)
    assert (service["kind"], service["metadata"]["name"]) == ("Service", server_name("envjob"))
    assert service["spec"]["clusterIP"] == "None" and service["spec"]["publishNotReadyAddresses"] is False
    assert service["spec"]["ports"] == [{"name": "http", "port": 8080, "targetPort": 8080}]
    assert service["spec"]["selector"] == deployment["spec"]["selector"]["matchLabels"] \
        == deployment["spec"]["template"]["metadata"]["labels"] == naming.labels("envjob", "environment")
    assert "type" not in service["spec"]  # ClusterIP, the only type that can be headless
    env = job.spec.environment
    assert server_url("envjob", "team-a", env) == f"http://{service['metadata']['name']}.team-a.svc:8080"
    assert deployment["spec"]["replicas"] == 3


def test_the_servers_own_placement_not_the_jobs() -> None:
    job = server_job()
    pod = render_environment_server(job)[0]["spec"]["template"]["spec"]
    assert "nodeSelector" not in pod and "tolerations" not in pod
    job = server_job(nodeSelector={"pool": "cpu", "example.com/tier": "env"},
                     tolerations=[{"key": "cpu-only", "operator": "Exists", "effect": "NoSchedule"},
                                  {"key": "team", "operator": "Equal", "value": "a", "effect": "NoExecute",
                                   "tolerationSeconds": 30}])
    job.spec.scheduling.node_selector = {"gpu": "h100"}  # the GPU pods'
    job.spec.scheduling.tolerations = [m.Toleration(key="nvidia.com/gpu", operator="Exists")]
    pod = render_environment_server(job)[0]["spec"]["template"]["spec"]
    assert pod["nodeSelector"] == {"example.com/tier": "env", "pool": "cpu"}
    assert pod["tolerations"] == [{"key": "cpu-only", "operator": "Exists", "effect": "NoSchedule"},
                                  {"key": "team", "operator": "Equal", "value": "a", "effect": "NoExecute",
                                   "tolerationSeconds": 30}]
    c = pod["containers"][0]
    assert c["readinessProbe"]["httpGet"] == {"path": "/health", "port": 8080}  # what takes a pod out of the DNS
    assert c["resources"]["requests"] == c["resources"]["limits"] and "nvidia.com/gpu" not in c["resources"]["limits"]
    assert pod["automountServiceAccountToken"] is False
