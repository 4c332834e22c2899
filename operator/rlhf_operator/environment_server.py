"""The environment server of a job (``spec.environment.http.server``): a Deployment and a Service, rendered here,
created and owned by the RLHFJob (deleted with it), reached by the runtime at ``rlhf_api.environment.server_url``.

The pods run the user's image with the job's security defaults (no privilege escalation, no capabilities, the
runtime's default seccomp profile) and no service-account token (an environment server has no business with the
Kubernetes API), a readiness probe on ``readyPath``, and requests equal to limits. They are not placed with the
job's GPU pods: they ask for no GPU and take no node selector or toleration of ``spec.scheduling``, only the
server's own (``server.nodeSelector``, ``server.tolerations``).

The Service is headless (``clusterIP: None``): its name resolves to the ready pods' addresses, one A record each
(not-ready pods are not published), and the runtime keeps each episode on one of them
(``rlhf_runtime.agent.endpoints``); a cluster IP would balance per connection, sending an episode's requests to
different pods. A Service is created once, with the RayJob, and never replaced: a job whose Service was made with
a cluster IP (by an operator before this one) keeps it, and its runtime sees one address, balanced per connection
as before; the job's runtime pods, made with that Service, are of that earlier runtime too.

Pure: same input, same output.
"""

from __future__ import annotations

from typing import Any

from rlhf_api.environment import server_name
from rlhf_operator import naming
from rlhf_operator.render import CONTAINER_SECURITY, POD_SECURITY, Job

ROLE = "environment"


def render_environment_server(job: Job) -> list[dict[str, Any]]:
    """The Deployment and Service of the job's environment server; none when the spec has none."""
    env = job.spec.environment
    server = env.http.server if env is not None and env.http is not None else None
    if server is None:
        return []
    name = server_name(job.name)
    labels = naming.labels(job.name, ROLE)
    meta = {"name": name, "namespace": job.namespace, "labels": labels}
    res = {"cpu": server.resources.cpu, "memory": server.resources.memory}
    container: dict[str, Any] = {
        "name": "environment",
        "image": server.image,
        "imagePullPolicy": "IfNotPresent",
        "ports": [{"name": "http", "containerPort": server.port}],
        "resources": {"requests": dict(res), "limits": dict(res)},
        "readinessProbe": {"httpGet": {"path": server.ready_path, "port": server.port},
                           "periodSeconds": 2, "failureThreshold": 3},
        "securityContext": CONTAINER_SECURITY,
    }
    if server.command:
        container["command"] = list(server.command)
    if server.args:
        container["args"] = list(server.args)
    pod: dict[str, Any] = {"automountServiceAccountToken": False, "containers": [container],
                           "securityContext": POD_SECURITY, "enableServiceLinks": False}
    if server.node_selector:
        pod["nodeSelector"] = dict(sorted(server.node_selector.items()))
    if server.tolerations:
        pod["tolerations"] = [t.wire() for t in server.tolerations]
    deployment = {
        "apiVersion": "apps/v1", "kind": "Deployment", "metadata": meta,
        "spec": {"replicas": server.replicas, "selector": {"matchLabels": labels},
                 "template": {"metadata": {"labels": labels}, "spec": pod}},
    }
    service = {
        "apiVersion": "v1", "kind": "Service", "metadata": meta,
        "spec": {"clusterIP": "None", "publishNotReadyAddresses": False, "selector": labels,
                 "ports": [{"name": "http", "port": server.port, "targetPort": server.port}]},
    }
    return [deployment, service]
