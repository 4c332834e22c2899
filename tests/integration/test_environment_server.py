"""A job's environment server (``spec.environment.http.server``) on the real control plane: the operator makes its
Deployment and headless Service, owned by the job, with the job's security defaults and no service-account token;
the garbage collector removes them with the job. A Service of the job's server made earlier with a cluster IP (an
earlier operator's, which cannot become headless in place) is left as it is, and the job goes on."""

from __future__ import annotations

import pytest
from kubernetes import client

from tests.helpers import wait_for
from tests.integration.conftest import apply, load_sample

pytestmark = pytest.mark.cluster


def test_environment_server_is_made_and_goes_with_the_job(cluster, api, operator, namespace) -> None:
    job = load_sample("separate-nccl-tp2")
    job["metadata"]["name"] = "envjob"
    job["spec"]["environment"] = {"http": {"server": {"image": "envs/echo:1", "replicas": 2, "port": 8000,
                                                      "resources": {"cpu": "500m", "memory": "1Gi"}}}}
    apply(cluster, job, namespace)
    apps, core = client.AppsV1Api(api), client.CoreV1Api(api)
    dep = wait_for(lambda: next(iter(apps.list_namespaced_deployment(namespace).items), None), 60,
                   "the environment server's Deployment")
    svc = wait_for(lambda: next(iter(core.list_namespaced_service(namespace, label_selector="rlhf.dev/job=envjob")
                                     .items), None), 60, "its Service")
    assert dep.metadata.name == svc.metadata.name == "envjob-env"
    for obj in (dep, svc):
        owner = obj.metadata.owner_references[0]
        assert (owner.kind, owner.name, owner.controller) == ("RLHFJob", "envjob", True)
    pod = dep.spec.template.spec
    assert dep.spec.replicas == 2 and pod.automount_service_account_token is False
    c = pod.containers[0]
    assert (c.image, c.ports[0].container_port, c.readiness_probe.http_get.path) == ("envs/echo:1", 8000, "/health")
    assert c.resources.limits == {"cpu": "500m", "memory": "1Gi"} and c.security_context.capabilities.drop == ["ALL"]
    assert svc.spec.selector == dep.spec.selector.match_labels and svc.spec.ports[0].port == 8000
    # headless: the name resolves to the ready pods (one DNS record each), not to one balancing address
    assert svc.spec.cluster_ip == "None" and svc.spec.cluster_ips == ["None"]
    assert svc.spec.type == "ClusterIP" and svc.spec.publish_not_ready_addresses in (False, None)
    # the RayJob is there too (the server does not hold the job back)
    wait_for(lambda: client.CustomObjectsApi(api).list_namespaced_custom_object(
        "ray.io", "v1", namespace, "rayjobs")["items"], 60, "the RayJob")
    cluster.kubectl("delete", "rlhfjob", "envjob", "-n", namespace)
    wait_for(lambda: not apps.list_namespaced_deployment(namespace).items, 120, "the Deployment gone with the job")
    wait_for(lambda: not core.list_namespaced_service(namespace, label_selector="rlhf.dev/job=envjob").items, 120,
             "the Service gone with the job")


def test_a_services_cluster_ip_made_earlier_is_left_as_it_is(cluster, api, operator, namespace) -> None:
    """The operator creates the server's Service once, with the RayJob, and never replaces it: one that exists
    with a cluster IP (a Service's cluster IP is immutable) answers the create with AlreadyExists, stays, and the
    job's Deployment and RayJob are made all the same."""
    core, apps = client.CoreV1Api(api), client.AppsV1Api(api)
    old = core.create_namespaced_service(namespace, {
        "metadata": {"name": "oldenv-env"},
        "spec": {"selector": {"rlhf.dev/job": "oldenv"}, "ports": [{"name": "http", "port": 8000}]}})
    assert old.spec.cluster_ip not in (None, "", "None")
    job = load_sample("separate-nccl-tp2")
    job["metadata"]["name"] = "oldenv"
    job["spec"]["environment"] = {"http": {"server": {"image": "envs/echo:1", "replicas": 2, "port": 8000}}}
    apply(cluster, job, namespace)
    wait_for(lambda: apps.list_namespaced_deployment(namespace).items, 60, "the environment server's Deployment")
    # made after the server's Service and Deployment (children._create_environment_server): the AlreadyExists
    # of the Service did not stop the reconcile
    wait_for(lambda: client.CustomObjectsApi(api).list_namespaced_custom_object(
        "ray.io", "v1", namespace, "rayjobs")["items"], 60, "the RayJob")
    svc = core.read_namespaced_service("oldenv-env", namespace)
    assert (svc.metadata.uid, svc.spec.cluster_ip) == (old.metadata.uid, old.spec.cluster_ip)
    assert not svc.metadata.owner_references  # not the operator's: it did not touch it
    cluster.kubectl("delete", "rlhfjob", "oldenv", "-n", namespace)
    wait_for(lambda: not apps.list_namespaced_deployment(namespace).items, 120, "the Deployment gone with the job")
