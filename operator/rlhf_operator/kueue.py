"""Kueue, the batch scheduler a job opts into with ``spec.scheduling.queueName``: the reconcile's side of it.

Kueue admits a RayJob natively: ``render`` gives the RayJob the queue label and creates it suspended, and from then
on its ``suspend`` is Kueue's (``render.ray_job_mutable_patch`` leaves it alone). Kueue makes one Workload per
RayJob (labelled with the RayJob's uid, watched and cached like the job's children); a queued job is suspended by
deactivating that Workload, which ``workload`` does when ``spec.suspend`` says so. ``status`` reads the Workload's
``QuotaReserved`` and ``Evicted`` conditions into the Queued, Preempted and Evicted reasons. A job without a
queue never reaches this module."""

from __future__ import annotations

from typing import Any

from rlhf_operator import cache, kube, render
from rlhf_operator.effects import Outcome, post_event


def queued(job: render.Job) -> bool:
    """Kueue admits this job (``spec.scheduling.queueName`` is set)."""
    return bool(job.spec.scheduling.queue_name)


def _newest(snap: cache.Snapshot, ray_job_uid: str | None) -> dict[str, Any] | None:
    """The newest cached Workload that Kueue made for the RayJob of this uid."""
    mine = [w for w in snap.workloads
            if (w["metadata"].get("labels") or {}).get(kube.KUEUE_JOB_UID_LABEL) == ray_job_uid]
    return max(mine, key=lambda w: w["metadata"].get("creationTimestamp") or "") if mine else None


def workload(job: render.Job, ray_job: dict[str, Any] | None, body: Any, snap: cache.Snapshot,
             out: Outcome) -> dict[str, Any] | None:
    """With ``spec.scheduling.queueName``: the RayJob's Kueue Workload, whose ``spec.active`` is made to follow
    ``spec.suspend`` (deactivating the Workload is how a queued job is suspended). None without a queue, a RayJob
    or a Workload yet."""
    if not queued(job) or not ray_job:
        return None
    found = _newest(snap, ray_job["metadata"].get("uid"))
    if found is None or (found.get("spec") or {}).get("active", True) != job.spec.suspend:
        return found
    active = not job.spec.suspend
    patched = cache.workload(kube.set_workload_active(found, active))
    out.wrote("Workload", (job.namespace, found["metadata"]["name"]), patched)
    post_event(body, "Suspended" if job.spec.suspend else "Resumed",
               f"Kueue Workload {found['metadata']['name']} active={active}")
    return patched
