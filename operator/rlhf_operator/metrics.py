"""Prometheus metrics of the operator: reconcile outcomes, and each job's phase and throughput as reported in
its status (so one scrape of the operator shows every job's tokens/s and sync time, without reaching pods)."""

from __future__ import annotations

from typing import Any

from prometheus_client import Counter, Gauge, start_http_server

from rlhf_api.models import PHASES

RECONCILES = Counter("rlhf_operator_reconciles_total", "Reconcile runs by result.", ["result"])
STATUS_WRITES = Counter("rlhf_operator_status_writes_total", "Status patches written (only on change).")
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
    for gauge in [STEP, *THROUGHPUT.values()]:
        _remove(gauge, namespace, job)


def _remove(gauge: Gauge, *labels: str) -> None:
    try:
        gauge.remove(*labels)
    except KeyError:
        pass
