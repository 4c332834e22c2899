"""A job's environment server (``spec.environment.http.server``) in real pods: the operator's Deployment runs two
replicas of the server (``rlhf_testing.env_server`` in the runtime image) on real nodes, their readiness probes
pass, the job's own pod reaches them through their headless Service (the cluster DNS answers the pods' addresses),
every episode's reset and step reach the one replica that holds it (the server answers a step of an episode it
does not hold with 404) while the episodes are spread over both, and deleting the RLHFJob removes the Deployment,
its ReplicaSet, its pods and the Service (owner references, the garbage collector).

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
REPLICAS = 2

#: Run in the job's head pod: the runtime's client against the job's server, at the driver's address, once the
#: cluster DNS lists every replica; prints the address, the addresses the name resolves to, and for each of 6
#: episodes side by side: the address it was pinned to, the host that answered its reset and its step, its
#: reward and done.
PROBE = """
import asyncio, json, sys, time
from urllib.parse import urlsplit
from rlhf_api.environment import Environment, server_url
from rlhf_runtime.agent.endpoints import resolve
from rlhf_runtime.agent.environments import Environments
job, ns, spec, replicas = json.loads(sys.argv[1])
env = Environment.model_validate(spec)
envs = Environments(env, server_url(job, ns, env))
envs.wait_ready()
name = urlsplit(envs.url)
end = time.monotonic() + 120
while len(resolve(name.hostname, name.port)) < replicas and time.monotonic() < end:
    time.sleep(0.5)
async def episode(i):
    e = envs.make(f"probe-{i}")
    first = await e.reset({"prompt": f"q{i}", "answer": f"a{i}", "messages": None})
    addr = e.addr
    step = await e.step({"role": "assistant", "content": f"a{i}" if i % 2 == 0 else "no idea"})
    await e.close()
    return [addr, first[0]["content"], step.observations[0]["content"], step.reward, step.done]
async def episodes():
    return await asyncio.gather(*(episode(i) for i in range(6)))
addrs = resolve(name.hostname, name.port)
print(json.dumps({"url": envs.url, "addrs": addrs, "episodes": asyncio.run(episodes())}))
"""


def test_environment_server_pods_serve_the_job_and_go_with_it(real_cluster, rapi, operator_release, shared_dir,
                                                              ns) -> None:
    job = cpu_job(real_cluster, shared_dir, JOB, steps=1000)  # deleted long before its last step
    # a chat template, which a job with spec.environment needs (cpujob.make_shared_dir)
    job["spec"]["model"]["name"] = f"{cpujob.SHARED_MOUNT}/tiny-chat"
    environment = {"maxTokens": 96, "http": {"server": {
        "image": real_cluster.images["runtime-cpu"]["ref"], "command": ["python", "-m", "rlhf_testing.env_server"],
        "args": ["--port", str(PORT)], "port": PORT, "replicas": REPLICAS,
        "resources": {"cpu": "100m", "memory": "256Mi"}, "nodeSelector": {NODE_LABEL: "true"}}}}
    job["spec"]["environment"] = environment
    apps, core = client.AppsV1Api(rapi), client.CoreV1Api(rapi)
    role = ",".join(f"{k}={v}" for k, v in naming.labels(JOB, "environment").items())
    t0 = time.monotonic()
    apply(real_cluster, job, ns)

    def ready_servers() -> list:
        got = [p for p in pods(rapi, ns, role) if p.status.phase == "Running" and not p.metadata.deletion_timestamp]
        ready = all(c.ready for p in got for c in p.status.container_statuses or [])
        return got if len(got) == REPLICAS and ready else []

    servers = _wait(real_cluster, rapi, ns, "the environment server's pods Ready (their readiness probes)",
                    ready_servers, 600)
    ready_s = time.monotonic() - t0
    assert [p.spec.node_name.startswith("real-node-") for p in servers] == [True] * REPLICAS, \
        [(p.metadata.name, p.spec.node_name) for p in servers]
    names = {p.metadata.name for p in servers}
    service = core.read_namespaced_service(server_name(JOB), ns)
    assert service.spec.cluster_ip == "None", service.spec  # headless: its name resolves to the pods
    # the Service's endpoints are the ready server pods
    slices = client.DiscoveryV1Api(rapi).list_namespaced_endpoint_slice(
        ns, label_selector=f"kubernetes.io/service-name={server_name(JOB)}").items
    assert {e.target_ref.name for s in slices for e in s.endpoints or [] if e.conditions.ready} == names

    head = _wait(real_cluster, rapi, ns, "the job's head pod Running",
                 lambda: next((p for p in pods(rapi, ns, "ray.io/node-type=head") if p.status.phase == "Running"),
                              None), 600)
    t1 = time.monotonic()
    out = real_cluster.kubectl("exec", "-n", ns, head.metadata.name, "-c", "ray-head", "--", "python", "-c", PROBE,
                               json.dumps([JOB, ns, environment, REPLICAS]), check=False)
    probe_s = time.monotonic() - t1
    assert out.returncode == 0, f"the probe in the head pod failed:\n{out.stdout}\n{out.stderr}"
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen["url"] == f"http://{server_name(JOB)}.{ns}.svc:{PORT}", seen
    ips = {p.status.pod_ip: p.metadata.name for p in servers}
    assert sorted(seen["addrs"]) == sorted(ips), (seen["addrs"], ips)  # the cluster DNS: one address per pod
    # every episode's reset and step were answered by the one pod it was pinned to, its own sample scored
    for i, (addr, first, last, reward, done) in enumerate(seen["episodes"]):
        host, _, prompt = first.partition(" ")
        assert host.strip("[]") == last.strip("[]") == ips[addr] and prompt == f"q{i}", (seen, ips)
        assert (reward, done) == (1.0 if i % 2 == 0 else 0.0, True), seen["episodes"]
    per_pod = sorted(sum(1 for e in seen["episodes"] if e[0] == ip) for ip in ips)
    assert per_pod == [3, 3], seen["episodes"]  # spread evenly over the replicas

    t2 = time.monotonic()
    real_cluster.kubectl("delete", "rlhfjob", JOB, "-n", ns)
    selector = f"{naming.LABEL_JOB}={JOB}"

    def gone() -> bool:
        return not (apps.list_namespaced_deployment(ns, label_selector=selector).items
                    or apps.list_namespaced_replica_set(ns, label_selector=role).items
                    or pods(rapi, ns, role)
                    or core.list_namespaced_service(ns, label_selector=role).items)

    _wait(real_cluster, rapi, ns, "the environment server's Deployment, ReplicaSet, pods and Service gone", gone, 300)
    print(f"\nENVIRONMENT SERVER: {REPLICAS} pods Ready {ready_s:.0f}s after apply; probe from the head pod "
          f"{probe_s:.1f}s; all gone {time.monotonic() - t2:.0f}s after the delete; "
          f"{time.monotonic() - t0:.0f}s in all")
