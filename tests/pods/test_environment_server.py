"""A job's environment server (``spec.environment.http.server``) in real pods: the operator's Deployment runs the
server (``rlhf_testing.env_server`` in the runtime image) on a real node, its readiness probe passes, the job's
own pod reaches it through its Service, and deleting the RLHFJob removes the Deployment, its ReplicaSet, its pods
and the Service (owner references, the garbage collector).

No training step is needed for this: the job's head pod runs the runtime's own HTTP environment client
(``Environments``: the readiness wait, then episodes) against the address the driver uses
(``rlhf_api.environment.server_url``), and the job is deleted as soon as that has answered, before its engines
are up. (The multi-turn rollout itself, against a real HTTP server, is the runtime tier's and the unit tier's.)
"""

from __future__ import annotations

import json
import time

import cpujob
import pytest
from kubernetes import client
from realnodes import NODE_LABEL

from rlhf_api.environment import server_name
from rlhf_operator import naming
from tests.pods.conftest import _wait, apply, cpu_job, pods

pytestmark = [pytest.mark.pods, pytest.mark.timeout(2400)]  # the first test also waits for the cluster

JOB = "envjob"
PORT = 8000

#: Run in the job's head pod: the runtime's client against the job's server, at the driver's address; prints
#: the address and each episode's first observation, reward and done.
PROBE = """
import asyncio, json, sys
from rlhf_api.environment import Environment, server_url
from rlhf_runtime.agent.environments import Environments
job, ns, spec = json.loads(sys.argv[1])
env = Environment.model_validate(spec)
envs = Environments(env, server_url(job, ns, env))
envs.wait_ready()
async def episode(i):
    e = envs.make(f"probe-{i}")
    first = await e.reset({"prompt": f"q{i}", "answer": f"a{i}", "messages": None})
    step = await e.step({"role": "assistant", "content": f"a{i}" if i % 2 == 0 else "no idea"})
    return [first[0]["content"], step.reward, step.done]
async def episodes():
    return await asyncio.gather(*(episode(i) for i in range(6)))
print(json.dumps({"url": envs.url, "episodes": asyncio.run(episodes())}))
"""


def test_environment_server_pods_serve_the_job_and_go_with_it(real_cluster, rapi, operator_release, shared_dir,
                                                              ns) -> None:
    job = cpu_job(real_cluster, shared_dir, JOB, steps=1000)  # deleted long before its last step
    # a chat template, which a job with spec.environment needs (cpujob.make_shared_dir)
    job["spec"]["model"]["name"] = f"{cpujob.SHARED_MOUNT}/tiny-chat"
    environment = {"maxTokens": 96, "http": {"server": {
        "image": real_cluster.images["runtime-cpu"]["ref"], "command": ["python", "-m", "rlhf_testing.env_server"],
        "args": ["--port", str(PORT)], "port": PORT, "resources": {"cpu": "100m", "memory": "256Mi"},
        "nodeSelector": {NODE_LABEL: "true"}}}}
    job["spec"]["environment"] = environment
    apps, core = client.AppsV1Api(rapi), client.CoreV1Api(rapi)
    role = ",".join(f"{k}={v}" for k, v in naming.labels(JOB, "environment").items())
    t0 = time.monotonic()
    apply(real_cluster, job, ns)

    def ready_servers() -> list:
        got = [p for p in pods(rapi, ns, role) if p.status.phase == "Running" and not p.metadata.deletion_timestamp]
        return got if got and all(c.ready for p in got for c in p.status.container_statuses or []) else []

    servers = _wait(real_cluster, rapi, ns, "the environment server's pod Ready (its readiness probe)",
                    ready_servers, 600)
    ready_s = time.monotonic() - t0
    assert [p.spec.node_name.startswith("real-node-") for p in servers] == [True], \
        [(p.metadata.name, p.spec.node_name) for p in servers]
    names = {p.metadata.name for p in servers}
    # the Service's endpoints are the ready server pod
    slices = client.DiscoveryV1Api(rapi).list_namespaced_endpoint_slice(
        ns, label_selector=f"kubernetes.io/service-name={server_name(JOB)}").items
    assert {e.target_ref.name for s in slices for e in s.endpoints or [] if e.conditions.ready} == names

    head = _wait(real_cluster, rapi, ns, "the job's head pod Running",
                 lambda: next((p for p in pods(rapi, ns, "ray.io/node-type=head") if p.status.phase == "Running"),
                              None), 600)
    t1 = time.monotonic()
    out = real_cluster.kubectl("exec", "-n", ns, head.metadata.name, "-c", "ray-head", "--", "python", "-c", PROBE,
                               json.dumps([JOB, ns, environment]), check=False)
    probe_s = time.monotonic() - t1
    assert out.returncode == 0, f"the probe in the head pod failed:\n{out.stdout}\n{out.stderr}"
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen["url"] == f"http://{server_name(JOB)}.{ns}.svc:{PORT}", seen
    # every episode was answered by the job's server pod, its own sample scored
    for i, (first, reward, done) in enumerate(seen["episodes"]):
        host, _, prompt = first.partition(" ")
        assert host.strip("[]") in names and prompt == f"q{i}", (first, names)
        assert (reward, done) == (1.0 if i % 2 == 0 else 0.0, True), seen["episodes"]

    t2 = time.monotonic()
    real_cluster.kubectl("delete", "rlhfjob", JOB, "-n", ns)
    selector = f"{naming.LABEL_JOB}={JOB}"

    def gone() -> bool:
        return not (apps.list_namespaced_deployment(ns, label_selector=selector).items
                    or apps.list_namespaced_replica_set(ns, label_selector=role).items
                    or pods(rapi, ns, role)
                    or core.list_namespaced_service(ns, label_selector=role).items)

    _wait(real_cluster, rapi, ns, "the environment server's Deployment, ReplicaSet, pod and Service gone", gone, 300)
    print(f"\nENVIRONMENT SERVER: pod Ready {ready_s:.0f}s after apply; probe from the head pod {probe_s:.1f}s; "
          f"all gone {time.monotonic() - t2:.0f}s after the delete; {time.monotonic() - t0:.0f}s in all")
