"""Sandboxes for agent code in real pods: the real agent-sandbox controller (built from its Go module, run as a host
process with ``--extensions``) fills a SandboxWarmPool from a SandboxTemplate with hardened pods of the locally built
sandbox image on the real kubelets; a SandboxClaim made by the ``k8s-agent-sandbox`` client adopts a warm pod and
code runs in it over HTTP (pod IP, port 8888); the pool refills, and releasing the claim removes that sandbox.

The namespace enforces Pod Security "restricted", so the template's pod must pass it for the pool to fill at all.
The template's NetworkPolicy is checked as an object: this cluster's bridge CNI does not enforce NetworkPolicy."""

from __future__ import annotations

import json
import time

import pytest
from k8s_agent_sandbox import SandboxClient
from k8s_agent_sandbox.models import SandboxInClusterConnectionConfig
from kubernetes import client

from tests.helpers import wait_for
from tests.pods.conftest import RESTRICTED, diagnostics

pytestmark = pytest.mark.pods

CORE, EXT, VERSION = "agents.x-k8s.io", "extensions.agents.x-k8s.io", "v1beta1"
TEMPLATE, POOL, SIZE = "python", "python-pool", 2
UID = 65532
CLIENT_LABEL = {"rlhf.dev/sandbox-client": "true"}


def sandbox_template(image: str) -> dict:
    """A SandboxTemplate of hardened sandbox pods: no service-account token, non-root, read-only root filesystem
    with a scratch emptyDir at /tmp, all capabilities dropped, seccomp RuntimeDefault, CPU/memory/disk limits; a
    NetworkPolicy that lets in only pods labelled ``CLIENT_LABEL`` and lets nothing out."""
    container = {
        "name": "sandbox", "image": image, "imagePullPolicy": "Never",
        "ports": [{"name": "http", "containerPort": 8888}],
        "readinessProbe": {"httpGet": {"path": "/", "port": 8888}, "periodSeconds": 1, "failureThreshold": 3},
        "env": [{"name": "SANDBOX_EXEC_TIMEOUT_SECONDS", "value": "30"}],
        "resources": {"requests": {"cpu": "10m", "memory": "32Mi", "ephemeral-storage": "16Mi"},
                      "limits": {"cpu": "500m", "memory": "256Mi", "ephemeral-storage": "64Mi"}},
        "securityContext": {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True, "runAsNonRoot": True,
                            "capabilities": {"drop": ["ALL"]}},
        "volumeMounts": [{"name": "scratch", "mountPath": "/tmp"}],
    }
    return {
        "apiVersion": f"{EXT}/{VERSION}", "kind": "SandboxTemplate", "metadata": {"name": TEMPLATE},
        "spec": {
            "podTemplate": {"metadata": {"labels": {"app": "rlhf-sandbox"}}, "spec": {
                "automountServiceAccountToken": False, "enableServiceLinks": False,
                "terminationGracePeriodSeconds": 5,
                "nodeSelector": {"rlhf.dev/real-node": "true"},
                "securityContext": {"runAsNonRoot": True, "runAsUser": UID, "runAsGroup": UID,
                                    "seccompProfile": {"type": "RuntimeDefault"}},
                "containers": [container],
                "volumes": [{"name": "scratch", "emptyDir": {"sizeLimit": "64Mi"}}],
            }},
            "networkPolicyManagement": "Managed",
            "networkPolicy": {"ingress": [{"from": [{"podSelector": {"matchLabels": CLIENT_LABEL}}],
                                           "ports": [{"port": 8888, "protocol": "TCP"}]}]},
        },
    }


def warm_pool() -> dict:
    return {"apiVersion": f"{EXT}/{VERSION}", "kind": "SandboxWarmPool", "metadata": {"name": POOL},
            "spec": {"replicas": SIZE, "sandboxTemplateRef": {"name": TEMPLATE}}}


def sandboxes(api, ns: str) -> dict[str, str]:
    """Sandbox name -> the kind of its controlling owner (SandboxWarmPool while warm, SandboxClaim once claimed)."""
    items = client.CustomObjectsApi(api).list_namespaced_custom_object(CORE, VERSION, ns, "sandboxes")["items"]
    return {s["metadata"]["name"]: next((o["kind"] for o in s["metadata"].get("ownerReferences") or []
                                         if o.get("controller")), "") for s in items}


def ready_pods(api, ns: str) -> dict[str, client.V1Pod]:
    """The Ready pods of ``ns`` that are not going away, by the name of the Sandbox that owns them."""
    out = {}
    for p in client.CoreV1Api(api).list_namespaced_pod(ns).items:
        owner = next((o.name for o in p.metadata.owner_references or [] if o.kind == "Sandbox"), None)
        ready = any(c.type == "Ready" and c.status == "True" for c in p.status.conditions or [])
        if owner and ready and p.metadata.deletion_timestamp is None:
            out[owner] = p
    return out


def warm_ready(api, ns: str) -> set[str]:
    """The pool's sandboxes whose pods are Ready, once the pool's status counts as many."""
    pool = client.CustomObjectsApi(api).get_namespaced_custom_object(EXT, VERSION, ns, "sandboxwarmpools", POOL)
    warm = {n for n, kind in sandboxes(api, ns).items() if kind == "SandboxWarmPool"} & set(ready_pods(api, ns))
    return warm if (pool.get("status") or {}).get("readyReplicas") == len(warm) else set()


def test_warm_pool_sandbox_is_claimed_runs_code_and_is_replaced(agent_sandbox, rapi, ns) -> None:
    cluster = agent_sandbox

    def wait(what, check, timeout):
        try:
            return wait_for(check, timeout, what, interval=0.5)
        except AssertionError as e:
            log = (cluster.dir / "agent-sandbox.log").read_text(errors="replace").splitlines()[-30:]
            raise AssertionError(f"{e}\n{diagnostics(cluster, ns)}\n--- controller\n" + "\n".join(log)) from None

    cluster.kubectl("label", "--overwrite", "namespace", ns, *RESTRICTED)
    t0 = time.monotonic()
    for obj in (sandbox_template(cluster.images["sandbox"]["ref"]), warm_pool()):
        cluster.kubectl("apply", "-n", ns, "-f", "-", input=json.dumps(obj))
    warm = wait(f"{SIZE} warm sandboxes Ready", lambda: len(w := warm_ready(rapi, ns)) == SIZE and w, 180)
    print(f"warm pool of {SIZE} Ready in {time.monotonic() - t0:.1f}s")

    pod = ready_pods(rapi, ns)[next(iter(warm))]
    assert pod.spec.automount_service_account_token is False
    assert not [v for v in pod.spec.volumes if v.projected], "no service-account token volume"
    sc = pod.spec.containers[0].security_context
    assert (sc.read_only_root_filesystem, sc.allow_privilege_escalation, sc.capabilities.drop) == (True, False, ["ALL"])
    policy = client.NetworkingV1Api(rapi).read_namespaced_network_policy(f"{TEMPLATE}-network-policy", ns).spec
    assert policy.policy_types == ["Ingress", "Egress"] and not policy.egress  # nothing may leave
    assert [p.pod_selector.match_labels for p in policy.ingress[0]._from] == [CLIENT_LABEL]
    assert policy.pod_selector.match_labels.items() <= pod.metadata.labels.items()

    sandboxes_client = SandboxClient(connection_config=SandboxInClusterConnectionConfig(), api_client=rapi)
    t0 = time.monotonic()
    sandbox = sandboxes_client.create_sandbox(warmpool=POOL, namespace=ns, sandbox_ready_timeout=60)
    print(f"claimed {sandbox.sandbox_id} in {time.monotonic() - t0:.2f}s")
    assert sandbox.sandbox_id in warm, "the claim adopts a warm sandbox"
    assert sandboxes(rapi, ns)[sandbox.sandbox_id] == "SandboxClaim"

    run = sandbox.commands.run
    r = run("python3 -c 'import math; print(math.factorial(20))'", timeout=30)
    assert (r.stdout, r.stderr, r.exit_code) == ("2432902008176640000\n", "", 0)
    r = run("sh -c 'id -u; grep -E \"^(CapBnd|NoNewPrivs|Seccomp):\" /proc/self/status; touch /etc/x; "
            "ls /var/run/secrets; echo scratch > /tmp/f && cat /tmp/f'", timeout=30)
    lines = r.stdout.split("\n")
    status = dict(line.split(":\t") for line in lines[1:4])
    assert lines[0] == str(UID) and lines[4] == "scratch", r  # non-root; /tmp is writable
    # no capability can be gained, no privilege escalation, seccomp filtering on
    assert status == {"CapBnd": "0000000000000000", "NoNewPrivs": "1", "Seccomp": "2"}, r
    assert "Read-only file system" in r.stderr and "/var/run/secrets" in r.stderr, r  # and no token to read
    r = run("sleep 60", timeout=30, command_timeout=1)
    assert r.timed_out and r.exit_code == 124
    r = run("python3 -c 'import os; os.write(1, os.urandom(1 << 20))'", timeout=30)
    assert r.exit_code == 0 and 0 < len(r.stdout) <= 65536  # the server keeps the first 64 KiB

    print(f"code ran in {time.monotonic() - t0:.1f}s after the claim was made")

    # the pool refills to its size beside the claimed sandbox
    refilled = wait("the pool back to its size", lambda: len(w := warm_ready(rapi, ns)) == SIZE and w, 120)
    assert sandbox.sandbox_id not in refilled and len(refilled - warm) == 1

    t0 = time.monotonic()
    sandboxes_client.delete_sandbox(sandbox.claim_name, namespace=ns)
    wait("the released sandbox and its pod gone", lambda: sandbox.sandbox_id not in sandboxes(rapi, ns)
         and not [p for p in client.CoreV1Api(rapi).list_namespaced_pod(ns).items
                  if any(o.name == sandbox.sandbox_id for o in p.metadata.owner_references or [])], 120)
    print(f"released sandbox and pod gone in {time.monotonic() - t0:.1f}s")
    assert warm_ready(rapi, ns) == refilled
