"""Sandboxes for agent code in real pods: the real agent-sandbox controller (built from its Go module, run as a host
process with ``--extensions``) fills a SandboxWarmPool from a SandboxTemplate with hardened pods of the locally built
sandbox image on the real kubelets; a SandboxClaim made by the ``k8s-agent-sandbox`` client adopts a warm pod and
code runs in it over HTTP (pod IP, port 8888); the pool refills, and releasing the claim removes that sandbox.
Then a job's own sandboxes (``spec.environment.sandbox``): the operator's template and pool, claimed from the job's
head pod by the runtime's tools, faults, and nothing left once the job is deleted
(``test_a_jobs_runtime_runs_tools_in_its_sandboxes``).

The namespace enforces Pod Security "restricted", so the template's pod must pass it for the pool to fill at all.
The template's NetworkPolicy is checked as an object: this cluster's bridge CNI does not enforce NetworkPolicy."""

from __future__ import annotations

import functools
import json
import subprocess
import time

import pytest
from k8s_agent_sandbox import SandboxClient
from k8s_agent_sandbox.models import SandboxInClusterConnectionConfig
from kubernetes import client
from realnodes import NODE_LABEL

from rlhf_operator import naming
from rlhf_operator import sandboxes as sandboxes_mod
from tests.helpers import audit_lines, wait_for
from tests.pods.conftest import RESTRICTED, apply, cpu_job, diagnostics, pods, status

pytestmark = [pytest.mark.pods, pytest.mark.timeout(2400)]  # the first test also waits for the cluster

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


def wait_or_explain(cluster, ns: str, what: str, check, timeout: float):
    """``wait_for`` that, past its deadline, fails with the namespace's diagnostics and the controller's last log
    lines."""
    try:
        return wait_for(check, timeout, what, interval=0.5)
    except AssertionError as e:
        log = (cluster.dir / "agent-sandbox.log").read_text(errors="replace").splitlines()[-30:]
        raise AssertionError(f"{e}\n{diagnostics(cluster, ns)}\n--- controller\n" + "\n".join(log)) from None


def test_warm_pool_sandbox_is_claimed_runs_code_and_is_replaced(agent_sandbox, rapi, ns) -> None:
    cluster = agent_sandbox

    wait = functools.partial(wait_or_explain, cluster, ns)

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


# ------------------------------------------------------------------------------------- a job's own sandboxes
JOB = "sbjob"
#: The workers' memory: more than any node has.
UNSCHEDULABLE = "1000Gi"
SCHEMA = {"type": "object", "properties": {"code": {"type": "string"}, "command": {"type": "string"}}}
#: What a sandbox may read and reach of the cluster, printed as JSON (run in the sandbox by the python tool): a
#: service-account token, credential-like variables, the apiserver without a token, the Ray head's GCS and dashboard.
REACH = """
import json, os, socket, ssl, urllib.error, urllib.request
ns, head = {ns!r}, {head!r}
def get(url):
    try:
        return urllib.request.urlopen(url, timeout=5, context=ssl._create_unverified_context()).status
    except urllib.error.HTTPError as e:
        return e.code
    except Exception as e:
        return f"{{type(e).__name__}}: {{e}}"[:120]
def connect(port):
    try:
        socket.create_connection((head, port), timeout=5).close()
        return "connected"
    except Exception as e:
        return f"{{type(e).__name__}}: {{e}}"[:120]
print(json.dumps({{
    "token": [p for p in ("/var/run/secrets/kubernetes.io/serviceaccount", "/run/secrets/kubernetes.io")
              if os.path.exists(p)],
    "credentials": sorted(k for k in os.environ
                          if any(w in k.upper() for w in ("TOKEN", "SECRET", "PASSW", "CREDENTIAL", "_KEY"))),
    "api_secrets": get(f"https://kubernetes.default.svc/api/v1/namespaces/{{ns}}/secrets"),
    "api_claims": get(f"https://kubernetes.default.svc/apis/extensions.agents.x-k8s.io/v1beta1/namespaces/{{ns}}"
                      "/sandboxclaims"),
    "gcs": connect(6379),
    "dashboard": get(f"http://{{head}}:8265/api/version"),
}}))
"""

#: Run in the job's head pod with its runtime identity: the runtime's own tools (``Tools`` from the job's config, as
#: the rollout builds them), one trajectory's session; prints one JSON line per step. Before the call that loses
#: its sandbox it prints ``{"step": "sleeping", "sandbox": ...}`` and waits for the test to delete that pod.
PROBE = """
import asyncio, json, sys
from rlhf_runtime.agent.calls import Call
from rlhf_runtime.agent.tools import Tools
from rlhf_runtime.infra.config import load_config
reach = sys.argv[1]
cfg = load_config()
tools = Tools(cfg.spec.environment, (cfg.name, cfg.namespace, cfg.uid))
def emit(step, **kw):
    print(json.dumps({"step": step, **kw}), flush=True)
async def call(name, **args):
    o = await tools.call(Call(name, args))
    return {"text": o.text, "error": o.error, "seconds": round(o.seconds, 3)}
async def main():
    async with tools.session() as s:
        emit("ran", out=await call("python", code="import math; print(math.factorial(20))"),
             sandbox=s.sandbox.sandbox_id)
        emit("huge", out=await call("python", code="print('x' * 1000000)"))
        emit("binary", out=await call("python", code="import os; os.write(1, os.urandom(1 << 20))"))
        emit("reach", out=await call("python", code=reach))
        lost = asyncio.ensure_future(call("shell", command="echo started > started; sleep 25"))
        for _ in range(200):
            if (await call("shell", command="cat started 2>/dev/null"))["text"].strip() == "started":
                break
            await asyncio.sleep(0.1)
        emit("sleeping", sandbox=s.sandbox.sandbox_id)
        emit("lost", out=await lost)
        emit("again", out=await call("shell", command="id -u; ls"), sandbox=s.sandbox.sandbox_id,
             claims=len(s.claim_seconds), claim_s=[round(c, 3) for c in s.claim_seconds], failures=s.failures)
asyncio.run(main())
emit("released")
"""


def sandbox_spec(image: str, *, warm: int = 2) -> dict:
    """``spec.environment`` of a job whose builtin python and shell tools run in its sandboxes on the real nodes."""
    return {"maxTokens": 96,
            "tools": [{"name": "python", "builtin": "python", "parameters": SCHEMA},
                      {"name": "shell", "builtin": "shell", "parameters": SCHEMA}],
            "sandbox": {"image": image, "warmPool": warm, "timeoutSeconds": 30, "maxOutputBytes": 4096,
                        "claimTimeoutSeconds": 60,
                        "resources": {"cpu": "250m", "memory": "128Mi", "ephemeralStorage": "64Mi"},
                        "nodeSelector": {NODE_LABEL: "true"}}}


def left_of(api, ns: str) -> dict[str, list[str]]:
    """What of a job's sandboxes is in ``ns``: templates, pools, claims, sandboxes, their pods, network policies."""
    custom, core = client.CustomObjectsApi(api), client.CoreV1Api(api)
    out = {plural: [o["metadata"]["name"] for o in
                    custom.list_namespaced_custom_object(group, VERSION, ns, plural)["items"]]
           for group, plural in ((EXT, "sandboxtemplates"), (EXT, "sandboxwarmpools"), (EXT, "sandboxclaims"),
                                 (CORE, "sandboxes"))}
    out["pods"] = [p.metadata.name for p in core.list_namespaced_pod(ns, label_selector=sandboxes_mod.LABEL_SANDBOX)
                   .items]
    out["networkpolicies"] = [p.metadata.name for p in
                              client.NetworkingV1Api(api).list_namespaced_network_policy(ns).items]
    return {k: v for k, v in out.items() if v}


def test_a_jobs_runtime_runs_tools_in_its_sandboxes(agent_sandbox, rapi, operator_release, shared_dir, ns) -> None:
    """A job with ``spec.environment.sandbox``: the operator's template and warm pool fill with sandbox pods on the
    real nodes (the sandbox's nodeSelector) through the real controller; in the job's head pod, with the job's own
    runtime identity, the runtime's tools (``Tools``, as the rollout builds them) claim a sandbox and run code in it;
    a huge and a binary output come back cut (``output_truncated``), not fatal; the sandbox pod deleted under a
    running call is a ``sandbox`` error of that call and the next call runs in a replacement from the pool; deleting
    the RLHFJob removes its templates, pools, claims, sandboxes, their pods and the network policy.

    Isolation as far as this cluster can show it: the sandbox has no service-account token and no credentials in its
    environment, and the apiserver refuses it (401/403: anonymous). This cluster's bridge network does not enforce
    NetworkPolicy, so a sandbox here can connect to the Ray head's ports (its GCS on 6379 accepts the connection;
    the dashboard on 8265 too once it is up, which is usually after the probe ran): the test does not assert that
    they are refused, it prints what the sandbox reached and checks the policy that refuses it on a network that
    enforces policy (no egress rule at all, so every egress is denied).

    No training step runs: the job's trainer and engine workers ask for more memory than a node has, so its Ray
    cluster never gets ready and no driver starts (nothing else claims the job's sandboxes meanwhile, and no engine
    takes the machine's CPUs); the head pod, with the job's config and runtime identity, is all the probe needs."""
    cluster = agent_sandbox
    job = cpu_job(cluster, shared_dir, JOB, steps=1000)
    for group in ("trainer", "rollout"):  # more than a node has: the Ray cluster never gets ready, no driver runs
        job["spec"][group]["resources"]["memory"] = UNSCHEDULABLE
    job["spec"]["environment"] = sandbox_spec(cluster.images["sandbox"]["ref"])
    t0 = time.monotonic()
    apply(cluster, job, ns)

    wait = functools.partial(wait_or_explain, cluster, ns)

    def pool_ready() -> bool:
        st = status(rapi, ns, JOB)
        cond = next((c for c in st.get("conditions") or [] if c["type"] == "SandboxesReady"), {})
        return cond.get("status") == "True" and (st.get("sandbox") or {}).get("ready") == 2

    wait("SandboxesReady with 2 warm sandboxes", pool_ready, 300)
    pool_s = time.monotonic() - t0
    warm = {p.metadata.name: p for p in pods(rapi, ns, f"{sandboxes_mod.LABEL_SANDBOX}={JOB}")}
    assert len(warm) == 2 and all(p.spec.node_name.startswith("real-node-") for p in warm.values()), \
        {n: p.spec.node_name for n, p in warm.items()}
    assert all(p.spec.node_selector == {NODE_LABEL: "true"} for p in warm.values())
    policy = client.NetworkingV1Api(rapi).read_namespaced_network_policy(f"{JOB}-sandbox-network-policy", ns).spec
    assert policy.policy_types == ["Ingress", "Egress"] and not policy.egress

    head = wait("the job's head pod Running",
                lambda: next((p for p in pods(rapi, ns, "ray.io/node-type=head") if p.status.phase == "Running"),
                             None), 600)
    svc = next(s.metadata.name for s in client.CoreV1Api(rapi).list_namespaced_service(ns).items
               if s.metadata.name.endswith("-head-svc"))
    t1 = time.monotonic()
    seen, lost_pod, out = run_probe(cluster, ns, head.metadata.name, REACH.format(ns=ns, head=svc))
    probe_s = time.monotonic() - t1
    assert "released" in seen, f"the probe in the head pod did not finish:\n{out}\n{diagnostics(cluster, ns)}"

    # the claims were the runtime identity's own (the head pod's ServiceAccount), in the job's namespace
    runtime = naming.child_names(JOB).runtime_identity
    assert head.spec.service_account_name == runtime
    creators = {e["user"]["username"] for e in map(json.loads, (x for x in audit_lines(cluster.audit_log)
                                                                if '"sandboxclaims"' in x and ns in x))
                if e["verb"] == "create" and e["objectRef"].get("namespace") == ns}
    assert creators == {f"system:serviceaccount:{ns}:{runtime}"}, creators

    ran = seen["ran"]
    assert (ran["out"]["text"], ran["out"]["error"]) == ("2432902008176640000\n", None), ran
    assert ran["sandbox"] in warm, "the claim adopts a warm sandbox of the job's pool"
    for step in ("huge", "binary"):
        got = seen[step]["out"]
        assert got["error"] == "output_truncated" and "[... output cut at 4096 bytes]" in got["text"], got
        assert len(got["text"].encode()) < 4096 + 100, len(got["text"])
    assert "\ufffd" in seen["binary"]["out"]["text"]  # bytes that are not UTF-8, replaced

    reach = json.loads(seen["reach"]["out"]["text"])
    assert reach["token"] == [] and reach["credentials"] == [], reach  # nothing to authenticate with
    for what in ("api_secrets", "api_claims"):  # anonymous: refused (or not reachable at all)
        assert reach[what] in (401, 403) or isinstance(reach[what], str), reach

    lost, again = seen["lost"]["out"], seen["again"]
    assert lost["error"] == "sandbox" and "the next call runs in a new sandbox" in lost["text"], lost
    assert lost["seconds"] < 25, "the call ended with its pod, not with its command"
    assert again["out"]["error"] is None and again["out"]["text"].split() == ["65532"], again
    assert again["sandbox"] != lost_pod and again["sandbox"].startswith(f"{JOB}-sandbox-"), again  # from the pool
    assert (again["claims"], again["failures"]) == (2, 1), again

    t2 = time.monotonic()
    cluster.kubectl("delete", "rlhfjob", JOB, "-n", ns, "--wait=false")
    wait("nothing of the job's sandboxes left", lambda: not left_of(rapi, ns), 180)
    gone_s = time.monotonic() - t2
    print(f"\nSANDBOX JOB: pool Ready {pool_s:.0f}s after apply; probe {probe_s:.1f}s (claims "
          f"{again['claim_s']} s); reached from a sandbox: {reach}; all gone {gone_s:.0f}s after the delete; "
          f"{time.monotonic() - t0:.0f}s in all")


def run_probe(cluster, ns: str, head: str, reach: str) -> tuple[dict[str, dict], str | None, str]:
    """``PROBE`` in the head pod's ray-head container; deletes the sandbox pod it names while its call sleeps.
    (what each step printed, the pod deleted, the probe's output)."""
    argv = [str(cluster.bin / "kubectl"), "--kubeconfig", str(cluster.kubeconfig), "exec", "-n", ns, head,
            "-c", "ray-head", "--", "python", "-c", PROBE, reach]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    seen: dict[str, dict] = {}
    lines, deleted = [], None
    try:
        for line in proc.stdout:
            lines.append(line)
            if not line.startswith("{"):
                continue
            step = json.loads(line)
            seen[step["step"]] = step
            if step["step"] == "sleeping":
                deleted = step["sandbox"]
                cluster.kubectl("delete", "pod", deleted, "-n", ns, "--wait=false")
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    return seen, deleted, "".join(lines) + proc.stderr.read()[-4000:]

