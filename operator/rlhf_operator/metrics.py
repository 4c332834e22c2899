"""Prometheus metrics of the operator: reconcile outcomes, and each job's phase and throughput as reported in
its status (so one scrape of the operator shows every job's tokens/s and sync time, without reaching pods)."""

from __future__ import annotations

from typing import Any

from prometheus_client import Counter, Gauge, Histogram, start_http_server

from rlhf_api.models import PHASES

RECONCILES = Counter("rlhf_operator_reconciles_total", "Reconcile runs by result.", ["result"])
RECONCILE_SECONDS = Histogram("rlhf_operator_reconcile_seconds", "Wall time of one job's reconcile.",
                              buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10))
QUEUE_WAIT_SECONDS = Histogram("rlhf_operator_queue_wait_seconds", "Time a job waited in the work queue between an "
                               "event (or deadline) and its reconcile's start.",
                               buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10))
DUPLICATE_CLUSTERS = Counter("rlhf_operator_duplicate_rayclusters_deleted_total",
                             "RayClusters deleted because their RayJob had moved on to another cluster.")
STATUS_WRITES = Counter("rlhf_operator_status_writes_total", "Status patches written (only on change).")
JOB_RECONCILES = Counter("rlhf_job_reconciles_total", "Reconciles of the job (each triggered by an event of it or "
                         "of one of its children, or by a deadline of its run).", ["namespace", "job"])
PHASE = Gauge("rlhf_job_phase", "1 for the job's current phase, 0 for the others.", ["namespace", "job", "phase"])
STEP = Gauge("rlhf_job_step", "Last completed training step.", ["namespace", "job"])
THROUGHPUT = {
    field: Gauge(f"rlhf_job_{metric}", help_, ["namespace", "job"])
    for field, metric, help_ in [
        ("rolloutTokensPerSecond", "rollout_tokens_per_second", "Generated tokens per second (last step)."),
        ("stepSeconds", "step_seconds", "Wall time of the last step."),
        ("weightSyncSeconds", "weight_sync_seconds", "Weight sync time of the last sync."),
        ("weightSyncGbps", "weight_sync_gbps", "Weight sync effective GB/s of the last sync."),
        ("rewardMean", "reward_mean", "Mean reward of the last step."),
    ]
}


def serve(port: int) -> None:
    start_http_server(port)


def observe(namespace: str, job: str, status: dict[str, Any]) -> None:
    JOB_RECONCILES.labels(namespace, job).inc()
    for phase in PHASES:
        PHASE.labels(namespace, job, phase).set(1 if status.get("phase") == phase else 0)
    if status.get("step") is not None:
        STEP.labels(namespace, job).set(status["step"])
    for field, gauge in THROUGHPUT.items():
        value = (status.get("throughput") or {}).get(field)
        if value is not None:
            gauge.labels(namespace, job).set(value)


def forget(namespace: str, job: str) -> None:
    for phase in PHASES:
        _remove(PHASE, namespace, job, phase)
    for gauge in [STEP, JOB_RECONCILES, *THROUGHPUT.values()]:
        _remove(gauge, namespace, job)


def _remove(gauge: Gauge, *labels: str) -> None:
    try:
        gauge.remove(*labels)
    except KeyError:
        pass
