"""Reporting: the RLHFJob status subresource, Prometheus metrics and a local progress file.

Imports neither torch nor vLLM nor Ray (the ``kubernetes`` client and ``prometheus_client`` are imported only
when used).

Status contract
---------------
Each report is one JSON merge patch on ``rlhfjobs/<name>/status`` (group ``rlhf.dev``, ``v1alpha1``) whose
body holds ONLY::

    {"status": {"step": N,                       # completed training steps
                "throughput": {<rlhf_api.models.Throughput wire names>},
                "runtime": {"state": Starting|Running|Succeeded|Failed, "message": ...,
                            "heartbeatTime": RFC 3339, "resumedFromStep": N}}}

``step``/``throughput`` are omitted when unknown. The operator owns every other status field and derives the
phase from ``status.runtime.state``. A heartbeat thread re-patches ``status.runtime`` (state and
``heartbeatTime``) every ``HEARTBEAT_SECONDS`` while the driver lives, so a long engine start or step still
shows progress.

Security design
---------------
The driver runs with the job's own ServiceAccount, bound by the operator to a Role in the job's namespace
with exactly::

    - apiGroups: ["rlhf.dev"]
      resources: ["rlhfjobs/status"]
      resourceNames: ["<job name>"]
      verbs: ["get", "patch"]

so the runtime can read and patch its own job's status and nothing else: not its spec, not another job,
not any other object. ``get`` (on the status subresource, which returns the object with its metadata) is
used to check the live object's ``metadata.uid`` against ``RuntimeConfig.uid`` before the first report:
a driver whose job was deleted and re-created under the same name refuses to report into the new one
(``ForeignJobError``). Every patch response is checked the same way. A merge patch on the status
subresource cannot change metadata or spec (the apiserver keeps only ``status`` from it).

Prometheus
----------
``Metrics.serve(port)`` exports gauges ``rlhf_step``, ``rlhf_rollout_tokens_per_second``,
``rlhf_samples_per_second``, ``rlhf_step_seconds``, ``rlhf_rollout_seconds``, ``rlhf_train_seconds``,
``rlhf_weight_sync_seconds``, ``rlhf_weight_sync_gbps``, ``rlhf_reward_mean`` (labels ``job``,
``namespace``), on their own registry.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from rlhf_api.models import GROUP, PLURAL, VERSION, RuntimeReport, Throughput

log = logging.getLogger(__name__)

HEARTBEAT_SECONDS = 15.0
STATES = ("Starting", "Running", "Succeeded", "Failed")
METRICS = {
    "rollout_tokens_per_second": "Generated tokens per second (last step)",
    "samples_per_second": "Scored samples per second (last step)",
    "step_seconds": "Wall time of the last step",
    "rollout_seconds": "Generation time of the last step",
    "train_seconds": "Training time of the last step",
    "weight_sync_seconds": "Wall time of the last weight sync",
    "weight_sync_gbps": "Effective GB/s of the last weight sync",
    "reward_mean": "Mean reward of the last step",
}


class ForeignJobError(RuntimeError):
    """The live RLHFJob is not the one this runtime was configured for (uid differs)."""


def now_rfc3339() -> str:
    return datetime.now(UTC).replace(microsecond=0).isoformat().replace("+00:00", "Z")


def own_ray_cluster() -> str | None:
    """The Ray cluster this runtime runs in: KubeRay sets ``RAY_CLUSTER_NAME`` in every Ray container, and the
    driver inherits the head's environment. The operator tells a retried run's reports from the last one's."""
    return os.environ.get("RAY_CLUSTER_NAME") or None


def status_patch(
    state: str | None = None,
    *,
    step: int | None = None,
    throughput: dict[str, float] | None = None,
    message: str | None = None,
    resumed_from_step: int | None = None,
    heartbeat: str | None = None,
    ray_cluster: str | None = None,
) -> dict[str, Any]:
    """The merge-patch body (pure). ``throughput`` uses snake_case ``Throughput`` field names."""
    if state is not None and state not in STATES:
        raise ValueError(f"state must be one of {STATES}")
    status: dict[str, Any] = {}
    if step is not None:
        status["step"] = step
    if throughput:
        # 4 significant digits: what `kubectl get rlhfjobs` shows is read by people, not by a profiler.
        rounded = {k: (float(f"{v:.4g}") if isinstance(v, float) else v) for k, v in throughput.items()}
        status["throughput"] = Throughput(**rounded).wire()
    runtime = RuntimeReport(
        state=state, message=message, resumed_from_step=resumed_from_step, ray_cluster=ray_cluster
    ).wire()
    runtime["heartbeatTime"] = heartbeat or now_rfc3339()
    status["runtime"] = runtime
    return {"status": status}


class StatusClient:
    """Patches one RLHFJob's status through the Kubernetes API."""

    def __init__(self, name: str, namespace: str, uid: str | None, kubeconfig: str | None = None) -> None:
        from kubernetes import client, config

        if kubeconfig:
            api_client = config.new_client_from_config(config_file=kubeconfig)
        else:
            config.load_incluster_config()
            api_client = client.ApiClient()
        self.api = client.CustomObjectsApi(api_client)
        self.name, self.namespace, self.uid = name, namespace, uid
        self.checked = False

    def _check(self, obj: dict[str, Any]) -> None:
        live = (obj.get("metadata") or {}).get("uid")
        if self.uid and live != self.uid:
            raise ForeignJobError(
                f"RLHFJob {self.namespace}/{self.name} has uid {live}, this runtime belongs to uid {self.uid}: "
                "refusing to report"
            )

    def verify(self) -> None:
        obj = self.api.get_namespaced_custom_object_status(GROUP, VERSION, self.namespace, PLURAL, self.name)
        self._check(obj)
        self.checked = True

    def patch(self, body: dict[str, Any]) -> None:
        if not self.checked:
            self.verify()
        obj = self.api.patch_namespaced_custom_object_status(
            GROUP, VERSION, self.namespace, PLURAL, self.name, body,
            _content_type="application/merge-patch+json", _request_timeout=10,
        )
        self._check(obj)


class Metrics:
    def __init__(self, job: str, namespace: str) -> None:
        from prometheus_client import CollectorRegistry, Gauge

        self.registry = CollectorRegistry()
        labels = ["job", "namespace"]
        self.step = Gauge("rlhf_step", "Completed training steps", labels, registry=self.registry)
        self.gauges = {k: Gauge(f"rlhf_{k}", doc, labels, registry=self.registry) for k, doc in METRICS.items()}
        self.labels = {"job": job, "namespace": namespace}

    def serve(self, port: int) -> None:
        from prometheus_client import start_http_server

        start_http_server(port, registry=self.registry)

    def update(self, step: int, throughput: dict[str, float]) -> None:
        self.step.labels(**self.labels).set(step)
        for k, v in throughput.items():
            if k in self.gauges and v is not None:
                self.gauges[k].labels(**self.labels).set(v)


class Reporter:
    """Fans one report out to the API (if enabled), Prometheus and the progress file (JSON lines).

    API errors are logged and do not stop training, except ``ForeignJobError``, which disables API
    reporting for good and is re-raised once so the driver can stop.
    """

    def __init__(
        self,
        status: StatusClient | None = None,
        metrics: Metrics | None = None,
        progress_file: str | None = None,
        heartbeat_seconds: float = HEARTBEAT_SECONDS,
    ) -> None:
        self.status = status
        self.metrics = metrics
        self.progress = Path(progress_file) if progress_file else None
        self.state: str = "Starting"
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.heartbeat_seconds = heartbeat_seconds
        self.thread: threading.Thread | None = None

    def _write_progress(self, record: dict[str, Any]) -> None:
        if self.progress:
            self.progress.parent.mkdir(parents=True, exist_ok=True)
            with self.progress.open("a", encoding="utf-8") as f:
                f.write(json.dumps(record) + "\n")
                f.flush()

    def _patch(self, body: dict[str, Any]) -> None:
        if self.status is None:
            return
        try:
            self.status.patch(body)
        except ForeignJobError:
            self.status = None
            raise
        except Exception as e:  # noqa: BLE001 - the API being briefly unreachable must not kill training
            log.warning("status report failed: %s", e)

    def report(
        self,
        state: str,
        *,
        step: int | None = None,
        throughput: dict[str, float] | None = None,
        message: str | None = None,
        resumed_from_step: int | None = None,
        extra: dict[str, Any] | None = None,
    ) -> None:
        body = status_patch(
            state, step=step, throughput=throughput, message=message, resumed_from_step=resumed_from_step,
            ray_cluster=own_ray_cluster(),
        )
        with self.lock:
            self.state = state
            self._patch(body)
            if self.metrics and step is not None:
                self.metrics.update(step, throughput or {})
            self._write_progress({"time": time.time(), **body["status"], **(extra or {})})

    def start_heartbeat(self) -> None:
        def beat() -> None:
            while not self.stop.wait(self.heartbeat_seconds):
                with self.lock:
                    try:
                        self._patch(status_patch(self.state, ray_cluster=own_ray_cluster()))
                    except ForeignJobError as e:
                        log.error("%s", e)

        self.thread = threading.Thread(target=beat, name="rlhf-heartbeat", daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.stop.set()
        if self.thread:
            self.thread.join(timeout=5)
