"""The reconcile of one job, from its cached snapshot, in named steps:

1. ``_parsed``: the job's spec (memoised per generation), or why it is invalid;
2. ``_converge``: the data check, KubeRay's presence, the children created or patched (``children``), Kueue's
   Workload (``kueue``), duplicate Ray clusters deleted, then ``_observe_cluster``: the Ray cluster, its pods and,
   while a pod waits for GPUs, the cluster's GPU capacity;
3. ``_end_stuck_run``: a run stuck past its deadline that did not end itself loses its Ray head pod;
4. ``_new_status``: the status from the pure ``status.compute``; ``_write_status`` writes it only when it changed,
   and ``_announce`` posts one Event per transition.

What it wrote and when to look again come back in an ``effects.Outcome``; the Kopf wiring (``handlers``) runs it
in a worker thread, one reconcile per job at a time.
"""

from __future__ import annotations

import datetime as dt
import json
from concurrent.futures import Future
from typing import Any

from kubernetes.client.rest import ApiException
from pydantic import ValidationError

from rlhf_api import models as m
from rlhf_operator import cache, children, kube, kueue, metrics, naming, render, sandboxes, status
from rlhf_operator.effects import Outcome, post_event

#: Re-check a missing data ConfigMap after these many seconds (doubling, at most DATA_RECHECK_MAX).
DATA_RECHECK_MIN, DATA_RECHECK_MAX = 2.0, 60.0
#: While KubeRay's CRDs are missing, look for them again this often (no event says they appeared).
KUBERAY_RECHECK_SECONDS = 30.0
#: Ready reasons that get an Event when they appear without a phase change: a run restarted (e.g. a lost head pod:
#: KubeRay's submitter resubmits), or a running job stopped making progress.
EVENT_REASONS = ("Retrying", "Resuming", "ProgressDeadlineExceeded", "RuntimeUnresponsive")
WARNING_REASONS = ("Retrying", "ProgressDeadlineExceeded", "RuntimeUnresponsive")

#: Per job, the parsed spec of its current generation: most reconciles are of an unchanged spec (events of pods
#: and clusters), and parsing is much of a reconcile's CPU.
_PARSED: dict[tuple[str, str], tuple[tuple[str, int], m.RLHFJobSpec | None, str | None]] = {}
#: (namespace, job) -> (generation, ConfigMap name, key, message or None, seconds to the next check)
_DATA_CHECKS: dict[tuple[str, str], tuple[int, str, str, str | None, float]] = {}


def reconcile(snap: cache.Snapshot, now: dt.datetime | None = None) -> Outcome:
    """One job, from its snapshot; runs in a worker thread. Returns what it wrote and when to look again."""
    out = Outcome()
    body = snap.job
    assert body is not None
    meta = body["metadata"]
    obs = status.Observed(generation=meta.get("generation", 1), old_status=dict(body.get("status") or {}))
    if meta.get("deletionTimestamp"):
        return out
    spec, obs.invalid = _parsed(body)
    pool = None
    if spec is not None:
        _observe_spec(obs, spec)
        job = render.Job(meta["name"], meta["namespace"], meta["uid"], spec)
        _converge(job, body, snap, obs, out)
        if not obs.kuberay_missing:
            pool = sandboxes.converge(job, body, snap.sandbox_pool, obs.old_status.get("phase"), obs.ray_job, out)
    obs.now = now or dt.datetime.now(dt.UTC)
    if spec is not None and obs.ray_cluster and obs.old_status.get("phase") not in status.TERMINAL:
        _end_stuck_run(obs, body, out)
    new = _new_status(obs, naming.child_names(meta["name"]).as_status() if spec is not None else {})
    _sandbox_status(new, sandboxes.report(pool, obs.old_status, obs.generation, obs.now))
    out.look_again(status.next_check(obs))
    metrics.observe(meta["namespace"], meta["name"], {**obs.old_status, **new})
    _write_status(body, obs, new, out)
    return out


def forget(ns: str, name: str) -> None:
    """Drop what is kept of a deleted job."""
    for memo in (_PARSED, _DATA_CHECKS):
        memo.pop((ns, name), None)
    children.forget(ns, name)
    sandboxes.forget(ns, name)


# ------------------------------------------------------------------------------------------------ the spec
def _parsed(body: dict[str, Any]) -> tuple[m.RLHFJobSpec | None, str | None]:
    """The job's spec, or None and why it is invalid (a defence behind admission)."""
    meta = body["metadata"]
    key, version = (meta["namespace"], meta["name"]), (meta.get("uid", ""), meta.get("generation", 1))
    held = _PARSED.get(key)
    if held is None or held[0] != version:
        try:
            held = (version, m.RLHFJobSpec.model_validate(dict(body.get("spec") or {})), None)
        except ValidationError as e:
            held = (version, None, _spec_error(e))
        _PARSED[key] = held
    return held[1], held[2]


def _spec_error(e: ValidationError) -> str:
    parts = []
    for err in e.errors()[:5]:
        where = ".".join(str(x) for x in err["loc"])
        parts.append(f"spec.{where}: {err['msg']}")
    return "; ".join(parts)


def _observe_spec(obs: status.Observed, spec: m.RLHFJobSpec) -> None:
    """What ``status`` reads from the spec itself."""
    obs.total_steps = spec.algorithm.steps
    obs.suspend = spec.suspend
    obs.queue_name = spec.scheduling.queue_name
    obs.progress_deadline = spec.progress_deadline_seconds


# ------------------------------------------------------------------------------------------- the children
def _converge(job: render.Job, body: dict[str, Any], snap: cache.Snapshot, obs: status.Observed,
              out: Outcome) -> None:
    """Bring the job's children to its spec and observe them. Nothing is done while KubeRay is missing; once the
    job is terminal its children are only observed (and duplicate Ray clusters deleted), not created or patched."""
    creating = obs.old_status.get("phase") not in status.TERMINAL or _invalid_before(obs.old_status)
    # a child is missing: the fresh reads that precede a create go out beside the data check
    fresh = children.IO.submit(children.fresh_reads, job) if creating and children.missing(job, snap) else None
    obs.data_missing, data_again = _data_missing(job.namespace, job.name, obs.generation, job.spec)
    out.look_again(data_again)
    obs.kuberay_missing = kube.kuberay_missing()
    if obs.kuberay_missing:
        out.look_again(KUBERAY_RECHECK_SECONDS)
        return
    if creating:
        _ensure_children(job, body, snap, obs, out, fresh)
    else:
        obs.ray_job = snap.ray_job
    children.delete_duplicates(obs.ray_job, snap, body, out)
    _observe_cluster(job.spec, snap, obs, out)


def _ensure_children(job: render.Job, body: dict[str, Any], snap: cache.Snapshot, obs: status.Observed,
                     out: Outcome, fresh: Future[Any] | None) -> None:
    """Create or patch the children; the RayJob (and, with a queue, its Kueue Workload) into ``obs``. A child the
    apiserver refuses for good (e.g. a value the RayJob's schema does not take) is said, not retried in a loop."""
    try:
        obs.ray_job = children.ensure(job, body, snap, out, bool(obs.data_missing), fresh)
    except ApiException as e:
        if e.status not in (400, 422):
            raise
        obs.child_rejected = _api_message(e)
    obs.workload = kueue.workload(job, obs.ray_job, body, snap, out)


def _api_message(e: ApiException) -> str:
    """The apiserver's own message of a refused request."""
    try:
        return str(json.loads(e.body or "{}").get("message") or e.reason)[:900]
    except (ValueError, AttributeError):
        return f"{e.status} {e.reason}"


def _observe_cluster(spec: m.RLHFJobSpec, snap: cache.Snapshot, obs: status.Observed, out: Outcome) -> None:
    """The RayJob's current Ray cluster and its pods; while a pod waits for GPUs, what the capacity says."""
    cluster = ((obs.ray_job or {}).get("status") or {}).get("rayClusterName")
    if not cluster:
        return
    obs.ray_cluster = next((c for c in snap.clusters if c["metadata"]["name"] == cluster), None)
    obs.pods = snap.pods(cluster)
    if status.capacity_message({}, obs.pods, None) is None:  # no pod waits for GPUs
        return
    nodes = kube.gpu_nodes()
    if nodes is not None:
        obs.capacity = status.capacity_message(nodes, obs.pods, spec.scheduling.node_selector)
        # the free GPUs change with other jobs' pods (no event of ours): look again when the shared capacity
        # snapshot (one list of nodes and pods for all jobs) is renewed
        out.look_again(kube.CAPACITY_CACHE_SECONDS)


def _data_missing(ns: str, job: str, generation: int, spec: m.RLHFJobSpec) -> tuple[str | None, float | None]:
    """The prompts ConfigMap must exist and hold its key, or the pods cannot mount it. It is the user's (not
    labelled, not cached): read once per spec generation while present, and while missing again after 2, 4 ...
    60 s (the only repeated read, and only for a job that waits for its data). Returns (why missing or None,
    seconds until it must be read again or None)."""
    ref = spec.data.config_map
    if ref is None:
        _DATA_CHECKS.pop((ns, job), None)
        return None, None
    seen = _DATA_CHECKS.get((ns, job))
    if seen and seen[:3] == (generation, ref.name, ref.key) and seen[3] is None:
        return None, None
    cm = kube.get_config_map(ns, ref.name)
    if cm is None:
        why = f"ConfigMap {ref.name} (spec.data.configMap) not found in namespace {ns}"
    elif ref.key not in (cm.get("data") or {}) and ref.key not in (cm.get("binaryData") or {}):
        why = f"ConfigMap {ref.name} has no key {ref.key} (spec.data.configMap.key)"
    else:
        why = None
    again = None
    if why is not None:
        again = min(DATA_RECHECK_MAX, 2 * seen[4]) if seen and seen[3] is not None else DATA_RECHECK_MIN
    _DATA_CHECKS[(ns, job)] = (generation, ref.name, ref.key, why, again or 0.0)
    return why, again


# ------------------------------------------------------------------------------------------- a stuck run
def _end_stuck_run(obs: status.Observed, body: Any, out: Outcome) -> None:
    """A run that is stuck past its deadline and did not end itself: delete its Ray head pod, once. KubeRay then
    counts a failed run (retried per spec.backoffLimit from the newest checkpoint, or final): the restart policy
    also holds for a frozen driver."""
    why = status.stuck_run(obs)
    if not why:
        return
    head = next((p for p in obs.pods if (p.get("metadata") or {}).get("labels", {}).get("ray.io/node-type") == "head"
                 and not p["metadata"].get("deletionTimestamp")), None)
    reported = status.parse_time((obs.old_status.get("runtime") or {}).get("heartbeatTime"))
    created = status.parse_time((head or {}).get("metadata", {}).get("creationTimestamp"))
    if head is None or not reported or not created or created > reported:
        return  # a head pod newer than the last report runs a run that has not reported yet: not the stuck one
    kube.delete_pod(head["metadata"]["namespace"], head["metadata"]["name"])
    out.wrote("Pod", (head["metadata"]["namespace"], head["metadata"]["name"]), None)  # once
    post_event(body, "EndingStuckRun", f"{why}: deleted the Ray head pod {head['metadata']['name']} so that the run "
               "fails and is retried or failed per spec.backoffLimit", warning=True)


# ---------------------------------------------------------------------------------------------- the status
def _new_status(obs: status.Observed, child_names: dict[str, str]) -> dict[str, Any]:
    """The operator-owned status of what was observed, the children's names (those of the spec, then those
    observed) included."""
    new = status.compute(obs, obs.now or dt.datetime.now(dt.UTC))
    if child_names:
        new["children"] = {**(obs.old_status.get("children") or {}), **child_names, **(new.get("children") or {})}
    return new


def _sandbox_status(new: dict[str, Any], rep: dict[str, Any]) -> None:
    """``status.sandbox`` and the SandboxesReady condition (``sandboxes.report``) into the new status."""
    if rep:
        new["conditions"].append(rep["condition"])
        new["sandbox"] = rep["sandbox"]


def _write_status(body: dict[str, Any], obs: status.Observed, new: dict[str, Any], out: Outcome) -> None:
    """Write what changed of the status (nothing when nothing did), then announce the transition."""
    patch = status.changed(obs.old_status, new)
    if not patch:
        return
    ns, name = body["metadata"]["namespace"], body["metadata"]["name"]
    written = kube.patch_status(ns, name, patch)
    out.wrote("job", (ns, name), cache.job(written))
    metrics.STATUS_WRITES.inc()
    _announce(body, obs, new, patch)


def _announce(body: Any, obs: status.Observed, new: dict[str, Any], patch: dict[str, Any]) -> None:
    """One Event per transition: a new phase (or a new message while Pending or Failed), else a Ready reason that
    says a run restarted or stalled; and the conditions that turned False with what turned them."""
    old = obs.old_status
    reason = _ready_reason(new)
    if new["phase"] != old.get("phase") or "message" in patch and new["phase"] in ("Pending", "Failed"):
        warn = new["phase"] == "Failed" or reason in status.STALLED_REASONS or bool(obs.kuberay_missing)
        post_event(body, new["phase"], new["message"] or new["phase"], warning=warn)
    elif reason in EVENT_REASONS and _ready_reason(old) != reason:
        # a run restarted, or stopped making progress, without a phase change
        post_event(body, reason, new["message"], warning=reason in WARNING_REASONS)
    if obs.data_missing and _condition_flipped(old, new, "DataAvailable"):
        post_event(body, "DataConfigMapMissing", obs.data_missing, warning=True)
    dropped = (old.get("data") or {}).get("message")  # what turned SamplesValid False
    if dropped and _condition_flipped(old, new, "SamplesValid"):
        post_event(body, "SamplesDropped", dropped, warning=True)
    mismatch = (old.get("runtime") or {}).get("warning")  # what turned EnginesInSync False
    if mismatch and _condition_flipped(old, new, "EnginesInSync"):
        post_event(body, "MismatchSpike", mismatch, warning=True)
    sandboxes.announce(body, old, new)
    tools = (old.get("agent") or {}).get("warning")  # what turned ToolsHealthy False
    if tools and _condition_flipped(old, new, "ToolsHealthy"):
        post_event(body, "ToolErrors", tools, warning=True)


def _invalid_before(st: dict[str, Any]) -> bool:
    """A Failed phase written for an invalid spec by an operator before 0.2 (InvalidSpec was terminal then)."""
    return st.get("phase") == "Failed" and _ready_reason(st) == "InvalidSpec"


def _ready_reason(st: dict[str, Any]) -> str | None:
    return next((c.get("reason") for c in st.get("conditions") or [] if c.get("type") == "Ready"), None)


def _condition_flipped(old: dict[str, Any], new: dict[str, Any], ctype: str) -> bool:
    def of(st: dict[str, Any]) -> str | None:
        return next((c["status"] for c in st.get("conditions") or [] if c["type"] == ctype), None)

    return of(old) != of(new)
