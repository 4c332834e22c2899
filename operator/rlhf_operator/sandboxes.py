"""The sandboxes of a job's builtin tools (``spec.environment.sandbox``), through kubernetes-sigs/agent-sandbox.

Per job, owned by the RLHFJob (the garbage collector deletes them with it):

- a ``SandboxTemplate`` (``<job>-sandbox``): the sandbox pod, isolated by default: no service-account token, no
  service links, uid/gid 65532 (non-root), a read-only root filesystem with a scratch emptyDir at ``/tmp`` of the
  ephemeral-storage size, every capability dropped, no privilege escalation, seccomp ``RuntimeDefault``, requests
  equal to limits (CPU, memory, ephemeral storage), ``runtimeClassName``, ``nodeSelector`` and ``tolerations``
  when the spec names them (not ``spec.scheduling``'s: that places the job's GPU pods), no Service. Its
  ``networkPolicy`` (agent-sandbox's controller makes the NetworkPolicy ``<job>-sandbox-network-policy`` from it,
  owned by the template, selecting the template's pods) has no egress rule, so all egress is denied (DNS too), and
  one ingress rule: TCP 8888 from the pods labelled with the job (its Ray head, workers and submitter), in the
  job's namespace only.
- a ``SandboxWarmPool`` of that template: ``warmPool`` sandboxes kept ready, scaled to 0 while the job is suspended,
  queued or preempted by Kueue, or finished; scaling it to 0 also deletes the job's ``SandboxClaim``s (a
  suspended run's runtime is gone and cannot release them).

The runtime (``rlhf_runtime.agent.sandbox``) claims one sandbox per trajectory from the pool, with a
``SandboxClaim`` labelled with the job and owned by the RLHFJob; its Role (``render.render_runtime_rbac``) lets it
claim, read and release claims and read sandboxes in the job's namespace only.

The pool is watched (``handlers``: labelled with the job) and reported in ``status.sandbox`` and the
``SandboxesReady`` condition: False, with a Warning Event naming the cause, when agent-sandbox's CRDs are not
installed, no controller acts on the pool, or its pods cannot start (image pull, scheduling, a crashing server,
pod creation refused: quota, admission). The causes are read from the pool's pods and sandboxes (its
``status.selector``), at most every ``DIAGNOSE_SECONDS`` while the pool is short.

``render_template``/``render_warm_pool``/``report`` are pure; ``converge`` does the I/O.
"""

from __future__ import annotations

import datetime as dt
import time
from dataclasses import dataclass
from typing import Any

import kopf
from kubernetes.client.rest import ApiException

from rlhf_api.base import GROUP as API_GROUP
from rlhf_api.environment import SANDBOX_PORT, SANDBOX_SCRATCH, Sandbox, sandbox_name
from rlhf_operator import kube, naming
from rlhf_operator.effects import Outcome, post_event
from rlhf_operator.render import Job

GROUP, VERSION = "extensions.agents.x-k8s.io", "v1beta1"
CORE_GROUP, CORE_VERSION = "agents.x-k8s.io", "v1beta1"
TEMPLATES, POOLS, CLAIMS, SANDBOXES = "sandboxtemplates", "sandboxwarmpools", "sandboxclaims", "sandboxes"
ROLE = "sandbox"
#: The label every sandbox pod of a job carries (not ``rlhf.dev/job``: the job's own pods are those that may
#: reach the sandboxes, and the operator's pod watch is of those).
LABEL_SANDBOX = f"{API_GROUP}/sandbox-of"
#: The sandbox pods' uid and gid (the rlhf-sandbox image's user).
SANDBOX_UID = 65532
#: A pool that no controller has acted on this long after its creation: no agent-sandbox controller runs.
CONTROLLER_GRACE_SECONDS = 30.0
#: While a pool is short, its pods and sandboxes are read for a cause at most this often (per job).
DIAGNOSE_SECONDS = 10.0
#: Known agent-sandbox CRDs are trusted this long; missing ones are looked for again after MISSING_RECHECK_SECONDS.
CRD_RECHECK_SECONDS, MISSING_RECHECK_SECONDS = 60.0, 30.0
#: A container waiting for one of these reasons is a pool that cannot fill, with this condition reason.
WAITING_CAUSES = {"ErrImagePull": "ImagePullFailed", "ImagePullBackOff": "ImagePullFailed",
                  "InvalidImageName": "ImagePullFailed", "CrashLoopBackOff": "SandboxCrashing",
                  "CreateContainerConfigError": "PodCreationFailed", "CreateContainerError": "PodCreationFailed",
                  "RunContainerError": "PodCreationFailed"}


# ------------------------------------------------------------------------------------------------ render
def render_template(job: Job) -> dict[str, Any] | None:
    """The job's SandboxTemplate (module docstring); None without ``spec.environment.sandbox``."""
    sb = _sandbox(job)
    if sb is None:
        return None
    res = {"cpu": sb.resources.cpu, "memory": sb.resources.memory,
           "ephemeral-storage": sb.resources.ephemeral_storage}
    container = {
        "name": "sandbox",
        "image": sb.image,
        "imagePullPolicy": "IfNotPresent",
        "ports": [{"name": "http", "containerPort": SANDBOX_PORT, "protocol": "TCP"}],
        # the server keeps one byte more of each stream than maxOutputBytes: the runtime, which cuts at
        # maxOutputBytes, then sees that there was more (and says so to the model)
        "env": [{"name": "SANDBOX_EXEC_TIMEOUT_SECONDS", "value": f"{sb.timeout_seconds:g}"},
                {"name": "SANDBOX_OUTPUT_LIMIT_BYTES", "value": str(sb.max_output_bytes + 1)},
                {"name": "HOME", "value": SANDBOX_SCRATCH}, {"name": "TMPDIR", "value": SANDBOX_SCRATCH}],
        "resources": {"requests": dict(res), "limits": dict(res)},
        "readinessProbe": {"httpGet": {"path": "/", "port": SANDBOX_PORT}, "periodSeconds": 1,
                           "failureThreshold": 3},
        "securityContext": {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]},
                            "privileged": False, "readOnlyRootFilesystem": True, "runAsNonRoot": True},
        "volumeMounts": [{"name": "scratch", "mountPath": SANDBOX_SCRATCH}],
    }
    pod: dict[str, Any] = {
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "terminationGracePeriodSeconds": 2,
        "securityContext": {"runAsNonRoot": True, "runAsUser": SANDBOX_UID, "runAsGroup": SANDBOX_UID,
                            "fsGroup": SANDBOX_UID, "seccompProfile": {"type": "RuntimeDefault"}},
        "containers": [container],
        "volumes": [{"name": "scratch", "emptyDir": {"sizeLimit": sb.resources.ephemeral_storage}}],
    }
    if sb.runtime_class_name:
        pod["runtimeClassName"] = sb.runtime_class_name
    if sb.node_selector:
        pod["nodeSelector"] = dict(sorted(sb.node_selector.items()))
    if sb.tolerations:
        pod["tolerations"] = [t.wire() for t in sb.tolerations]
    return {
        "apiVersion": f"{GROUP}/{VERSION}", "kind": "SandboxTemplate", "metadata": _meta(job),
        "spec": {
            "podTemplate": {"metadata": {"labels": {LABEL_SANDBOX: job.name}}, "spec": pod},
            "service": False,
            "networkPolicyManagement": "Managed",
            "networkPolicy": network_policy(job),
            "envVarsInjectionPolicy": "Disallowed",
            "volumeClaimTemplatesPolicy": "Disallowed",
        },
    }


def network_policy(job: Job) -> dict[str, Any]:
    """The template's ``networkPolicy``: no egress rule (all egress denied), ingress to the server's port from the
    job's own pods in its namespace only."""
    return {"ingress": [{"from": [{"podSelector": {"matchLabels": {naming.LABEL_JOB: job.name}}}],
                         "ports": [{"protocol": "TCP", "port": SANDBOX_PORT}]}]}


def render_warm_pool(job: Job, replicas: int) -> dict[str, Any] | None:
    """The job's SandboxWarmPool of ``replicas`` sandboxes; None without ``spec.environment.sandbox``."""
    if _sandbox(job) is None:
        return None
    return {"apiVersion": f"{GROUP}/{VERSION}", "kind": "SandboxWarmPool", "metadata": _meta(job),
            "spec": {"replicas": replicas, "sandboxTemplateRef": {"name": sandbox_name(job.name)}}}


def _meta(job: Job) -> dict[str, Any]:
    return {"name": sandbox_name(job.name), "namespace": job.namespace, "labels": naming.labels(job.name, ROLE)}


def _sandbox(job: Job) -> Sandbox | None:
    env = job.spec.environment
    return env.sandbox if env is not None else None


def held(job: Job, phase: str | None, ray_job: dict[str, Any] | None) -> str | None:
    """Why the job's pool is scaled to 0 now (None: it is not)."""
    if phase in ("Succeeded", "Failed"):
        return f"the job has {phase.lower()}"
    if job.spec.suspend:
        return "spec.suspend is true"
    if job.spec.scheduling.queue_name and ((ray_job or {}).get("spec") or {}).get("suspend"):
        return f"Kueue holds the job (LocalQueue {job.spec.scheduling.queue_name})"
    return None


def pool(body: Any) -> dict[str, Any]:
    """A SandboxWarmPool as cached (``handlers``): its name, age, wanted replicas and status."""
    meta = body.get("metadata") or {}
    st = body.get("status") or {}
    return {"metadata": {k: meta[k] for k in ("name", "namespace", "uid", "resourceVersion", "creationTimestamp",
                                              "generation", "deletionTimestamp") if k in meta},
            "spec": {"replicas": (body.get("spec") or {}).get("replicas")},
            "status": {k: st[k] for k in ("replicas", "readyReplicas", "selector", "observedGeneration") if k in st}}


# ---------------------------------------------------------------------------------------------- observe
@dataclass
class Observed:
    """What ``converge`` saw of the job's pool."""

    name: str
    wanted: int
    ready: int = 0
    held: str | None = None
    cause: tuple[str, str] | None = None  # (condition reason, message): why the pool cannot fill


def report(obs: Observed | None, old: dict[str, Any], generation: int, now: dt.datetime) -> dict[str, Any]:
    """``status.sandbox`` and the ``SandboxesReady`` condition (merged into ``new`` by the caller); {} without a
    sandbox spec. Before the pool was first full and without a cause: False, Filling; once it was, a pool refilling
    after claims stays True."""
    if obs is None:
        return {}
    before = next((c for c in old.get("conditions") or [] if c.get("type") == "SandboxesReady"), None)
    if obs.cause:
        ok, (reason, message) = False, obs.cause
    elif obs.held:
        ok, reason, message = True, "Released", f"the warm pool is scaled to 0: {obs.held}"
    elif obs.ready >= obs.wanted or (before or {}).get("status") == "True":
        ok, reason, message = True, "Ready", f"{obs.ready} of {obs.wanted} warm sandboxes ready"
    else:
        ok, reason, message = False, "Filling", f"{obs.ready} of {obs.wanted} warm sandboxes ready"
    if reason == "Ready":
        message = ""  # the counts are in status.sandbox; the condition does not change with every claim
    status = "True" if ok else "False"
    stamp = before["lastTransitionTime"] if before and before.get("status") == status and \
        before.get("lastTransitionTime") else now.strftime("%Y-%m-%dT%H:%M:%SZ")
    cond = {"type": "SandboxesReady", "status": status, "reason": reason, "message": message,
            "observedGeneration": generation, "lastTransitionTime": stamp}
    return {"condition": cond, "sandbox": {"warmPool": obs.name, "replicas": 0 if obs.held else obs.wanted,
                                           "ready": obs.ready, "failure": obs.cause[1] if obs.cause else None}}


def announce(body: Any, old: dict[str, Any], new: dict[str, Any]) -> None:
    """A Warning Event when SandboxesReady turns False with a cause (not while the pool first fills)."""
    cond = next((c for c in new.get("conditions") or [] if c.get("type") == "SandboxesReady"), None)
    if not cond or cond["status"] != "False" or cond["reason"] == "Filling":
        return
    before = next((c for c in old.get("conditions") or [] if c.get("type") == "SandboxesReady"), {})
    if (before.get("status"), before.get("reason")) != ("False", cond["reason"]):
        post_event(body, cond["reason"], cond["message"], warning=True)


def cause_from_pods(pods: list[dict[str, Any]], sandboxes: list[dict[str, Any]]) -> tuple[str, str] | None:
    """Why a short pool cannot fill, from its pods (a container waiting for an image or crashing, a pod that
    cannot be scheduled) and its sandboxes (the controller could not create their pods: quota, admission)."""
    for p in sorted(pods, key=lambda p: p["metadata"]["name"]):
        name, st = p["metadata"]["name"], p.get("status") or {}
        for cs in st.get("containerStatuses") or []:
            waiting = (cs.get("state") or {}).get("waiting") or {}
            why = WAITING_CAUSES.get(waiting.get("reason") or "")
            if why:
                return why, f"sandbox pod {name}: {waiting['reason']}: {waiting.get('message') or ''}".strip()
        for c in st.get("conditions") or []:
            if c.get("type") == "PodScheduled" and c.get("status") == "False":
                return "Unschedulable", f"sandbox pod {name}: {c.get('reason')}: {c.get('message') or ''}".strip()
    for s in sorted(sandboxes, key=lambda s: s["metadata"]["name"]):
        for c in (s.get("status") or {}).get("conditions") or []:
            if c.get("type") == "Ready" and c.get("status") == "False" and c.get("reason") == "ReconcilerError":
                return "PodCreationFailed", f"sandbox {s['metadata']['name']}: {c.get('message') or ''}".strip()
    return None


def no_controller(live: dict[str, Any], now: dt.datetime) -> tuple[str, str] | None:
    """A pool no agent-sandbox controller has acted on ``CONTROLLER_GRACE_SECONDS`` after its creation."""
    if live.get("status"):  # a controller wrote the pool's status
        return None
    try:
        created = dt.datetime.fromisoformat(str(live["metadata"].get("creationTimestamp")))
    except ValueError:
        return None
    if (now - created).total_seconds() < CONTROLLER_GRACE_SECONDS:
        return None
    meta = live["metadata"]
    return "NoSandboxController", (f"no agent-sandbox controller has acted on SandboxWarmPool {meta['name']} "
                                   f"since {meta['creationTimestamp']}: run agent-sandbox's controller with its "
                                   "extensions enabled")


# ------------------------------------------------------------------------------------------------- I/O
_CRDS_SEEN_AT = 0.0
#: (namespace, job) -> (monotonic time of the last diagnosis, its cause)
_DIAGNOSED: dict[tuple[str, str], tuple[float, tuple[str, str] | None]] = {}


def forget(ns: str, name: str) -> None:
    _DIAGNOSED.pop((ns, name), None)


def crds_missing() -> str | None:
    """None when agent-sandbox's template, pool and claim CRDs are served, else what to install."""
    global _CRDS_SEEN_AT
    if time.monotonic() - _CRDS_SEEN_AT < CRD_RECHECK_SECONDS:
        return None
    try:
        names = {r["name"] for r in kube._json(kube.custom().get_api_resources, GROUP, VERSION).get("resources")
                 or []}
    except ApiException as e:
        if e.status != 404:
            raise
        names = set()
    lacking = sorted({TEMPLATES, POOLS, CLAIMS} - names)
    if lacking:
        return (f"agent-sandbox's CRDs are not installed ({', '.join(f'{n}.{GROUP}' for n in lacking)} missing): "
                "install agent-sandbox with its extensions (spec.environment.sandbox needs them)")
    _CRDS_SEEN_AT = time.monotonic()
    return None


def converge(job: Job, body: Any, live: dict[str, Any] | None, phase: str | None, ray_job: dict[str, Any] | None,
             out: Outcome, now: dt.datetime | None = None) -> Observed | None:
    """Create the job's template and pool when missing, scale the pool to what the job wants now (0 while
    ``held``; then the job's claims are deleted too), and observe it. None without a sandbox spec."""
    sb = _sandbox(job)
    if sb is None:
        return None
    now = now or dt.datetime.now(dt.UTC)
    why_held = held(job, phase, ray_job)
    obs = Observed(sandbox_name(job.name), 0 if why_held else sb.warm_pool, held=why_held)
    missing = crds_missing()
    if missing:
        obs.cause = ("AgentSandboxMissing", missing)
        out.look_again(MISSING_RECHECK_SECONDS)
        return obs
    if live is None:  # not in the watch cache (yet): a pool made before the watch of pools began is read
        live = _get(job)
    if live is None or live["metadata"].get("deletionTimestamp"):
        if live is None and phase not in ("Succeeded", "Failed"):
            live = _create(job, body, obs.wanted, out)
        out.look_again(DIAGNOSE_SECONDS)
        return obs
    if (live.get("spec") or {}).get("replicas") != obs.wanted:
        live = _scale(job, body, live, obs, out)
    obs.ready = int((live.get("status") or {}).get("readyReplicas") or 0)
    if obs.ready < obs.wanted:
        obs.cause = _diagnose(job, live, now)
        out.look_again(DIAGNOSE_SECONDS)
    return obs


def _get(job: Job) -> dict[str, Any] | None:
    found = kube._missing_ok(kube.custom().get_namespaced_custom_object, GROUP, VERSION, job.namespace, POOLS,
                             sandbox_name(job.name))
    return pool(found) if found else None


def _create(job: Job, body: Any, replicas: int, out: Outcome) -> dict[str, Any] | None:
    template, warm = render_template(job), render_warm_pool(job, replicas)
    assert template is not None and warm is not None
    made = None
    for obj, plural in ((template, TEMPLATES), (warm, POOLS)):
        kopf.adopt(obj, owner=body)
        try:
            made = kube._created(kube.custom().create_namespaced_custom_object, GROUP, VERSION, job.namespace,
                                 plural, obj)
        except ApiException as e:
            if e.status == 404:  # the namespace is being deleted, or the CRDs went: the next reconcile says which
                return None
            raise
        if made is not None:
            post_event(body, "Created", f"{obj['kind']} {obj['metadata']['name']} ({replicas} warm sandboxes)"
                       if plural == POOLS else f"{obj['kind']} {obj['metadata']['name']}")
    if made is not None:
        made = pool(made)
        out.wrote("SandboxWarmPool", (job.namespace, made["metadata"]["name"]), made)
    return made


def _scale(job: Job, body: Any, live: dict[str, Any], obs: Observed, out: Outcome) -> dict[str, Any]:
    name = live["metadata"]["name"]
    patched = pool(kube._json(kube.custom().patch_namespaced_custom_object, GROUP, VERSION, job.namespace, POOLS,
                              name, {"spec": {"replicas": obs.wanted}}))
    out.wrote("SandboxWarmPool", (job.namespace, name), patched)
    if obs.held:
        kube._missing_ok(kube.custom().delete_collection_namespaced_custom_object, GROUP, VERSION, job.namespace,
                         CLAIMS, label_selector=f"{naming.LABEL_JOB}={job.name}")
        post_event(body, "SandboxesReleased", f"SandboxWarmPool {name} scaled to 0 and the job's sandbox claims "
                   f"deleted: {obs.held}")
    else:
        post_event(body, "SandboxesResumed", f"SandboxWarmPool {name} scaled to {obs.wanted}")
    return patched


def _diagnose(job: Job, live: dict[str, Any], now: dt.datetime) -> tuple[str, str] | None:
    """Why the short pool cannot fill (read at most every ``DIAGNOSE_SECONDS``); None when nothing says."""
    stuck = no_controller(live, now)
    if stuck:
        return stuck
    key = (job.namespace, job.name)
    seen = _DIAGNOSED.get(key)
    if seen and time.monotonic() - seen[0] < DIAGNOSE_SECONDS:
        return seen[1]
    selector = (live.get("status") or {}).get("selector")
    cause = None
    if selector:
        pods = kube._json(kube.core().list_namespaced_pod, job.namespace, label_selector=selector)["items"]
        sandboxes = kube._json(kube.custom().list_namespaced_custom_object, CORE_GROUP, CORE_VERSION,
                               job.namespace, SANDBOXES, label_selector=selector)["items"]
        cause = cause_from_pods(pods, sandboxes)
    _DIAGNOSED[key] = (time.monotonic(), cause)
    return cause
