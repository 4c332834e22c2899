"""Reporting: the RLHFJob status subresource, Prometheus metrics and a local progress file.

Imports neither torch nor vLLM nor Ray (the ``kubernetes`` client and ``prometheus_client`` are imported only
when used).

Status contract
---------------
Each report is one JSON merge patch on ``rlhfjobs/<name>/status`` (group ``rlhf.dev``, ``v1alpha1``) whose
body holds ONLY::

    {"status": {"step": N,                       # completed training steps
                "throughput": {<rlhf_api.models.Throughput wire names>},
                "output": {"path", "step", "time"},   # the newest export (spec.output), when there is one
                "eval": {"rewardMean", "step", "prompts", "time"},   # the newest evaluation (spec.data.eval)
                "agent": {<rlhf_api.environment.AgentStatus wire names>},   # the last step's trajectories
                "memory": {<rlhf_api.models.MemoryStatus wire names>},   # a colocated layout's memory plan
                "data": {"samples", "dropped", "message"},   # the training data as checked before the first step
                "tracking": {"tensorboardDir", "mlflowRunId", "mlflowRunUrl", "wandbRunId", "wandbRunUrl",
                             "message"},                    # where spec.tracking writes (infra.tracking)
                "runtime": {"state": Starting|Running|Succeeded|Failed, "message": ...,
                            "heartbeatTime": RFC 3339, "resumedFromStep": N,
                            "progressTime": RFC 3339,       # run start/resume, then each completed step
                            "observedGeneration": N}}}      # metadata.generation of the spec applied

``step``/``throughput`` are omitted when unknown. The operator owns every other status field and derives the
phase from ``status.runtime.state``. A heartbeat thread re-patches ``status.runtime`` (state, ``heartbeatTime``,
and the last ``progressTime`` and ``observedGeneration``, which a heartbeat never advances) every
``HEARTBEAT_SECONDS`` while the driver lives, so a long engine start or step still shows the driver alive, while
``progressTime`` shows whether it is getting anywhere.

Live edits: the driver reads its own RLHFJob (``StatusClient.get_job``) at each step boundary and from the
heartbeat thread (``Reporter.start_heartbeat(on_beat=...)``) and adopts ``spec.algorithm.steps`` and
``spec.progressDeadlineSeconds``; ``observedGeneration`` is the ``metadata.generation`` it applied.

Security design
---------------
The driver runs with the job's own ServiceAccount, bound by the operator to a Role in the job's namespace
with exactly::

    - apiGroups: ["rlhf.dev"]
      resources: ["rlhfjobs/status"]
      resourceNames: ["<job name>"]
      verbs: ["get", "patch"]
    - apiGroups: ["rlhf.dev"]
      resources: ["rlhfjobs"]
      resourceNames: ["<job name>"]
      verbs: ["get"]

so the runtime can read its own job (the live edits above) and patch its status, and nothing else: not another
job, not any other object. ``get`` (on the status subresource, which returns the object with its metadata) is
used to check the live object's ``metadata.uid`` against ``RuntimeConfig.uid`` before the first report:
a driver whose job was deleted and re-created under the same name refuses to report into the new one
(``ForeignJobError``). Every patch response is checked the same way. A merge patch on the status
subresource cannot change metadata or spec (the apiserver keeps only ``status`` from it).

Progress file
-------------
``--progress-file``: every report and record as one JSON line (``write_progress``), for people reading a run and
for the tests. Among the records the start leaves: ``actors`` (which process serves which actor, where each
actor's start went, Ray's connect and the placement groups' seconds) and, once the start is over, ``startup``
(each start-up stage's seconds, ``controller.loop.Runtime.stages``).

Prometheus
----------
``Metrics.serve(port)`` exports gauges ``rlhf_step``, ``rlhf_rollout_tokens_per_second``,
``rlhf_samples_per_second``, ``rlhf_step_seconds``, ``rlhf_rollout_seconds``, ``rlhf_train_seconds``,
``rlhf_weight_sync_seconds``, ``rlhf_weight_sync_gbps``, ``rlhf_reward_mean``,
``rlhf_train_tokens_per_second_per_gpu``, ``rlhf_mfu``, ``rlhf_mismatch_kl`` (``METRICS``) and the trainer's
statistics of the last step as ``rlhf_train_<name>`` (``TRAIN_METRICS``: loss, kl, entropy, clip_fraction,
grad_norm, correction_fraction, response_length_mean/max, response_clipped_fraction) (labels ``job``,
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

from rlhf_api.environment import AgentStatus
from rlhf_api.models import (
    GROUP,
    PLURAL,
    VERSION,
    DataStatus,
    EvalStatus,
    MemoryStatus,
    OutputStatus,
    RuntimeReport,
    Throughput,
    TrackingStatus,
)

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
    "train_tokens_per_second_per_gpu": "Training tokens per second per trainer GPU (last step)",
    "mfu": "Model FLOPs utilisation of the last training step",
    "mismatch_kl": "Training-inference mismatch (k3 KL estimate) of the last step",
}
#: Gauges of the trainer's statistics of the last step (progress file key ``train``), ``rlhf_train_<name>``.
TRAIN_METRICS = {
    "loss": "Policy loss",
    "kl": "KL to the reference (in the loss)",
    "entropy": "Mean entropy of the sampled tokens' distributions",
    "clip_fraction": "Share of completion tokens whose ratio was clipped",
    "grad_norm": "Gradient norm before clipping",
    "correction_fraction": "Share of tokens whose rollout-correction weight was truncated or masked",
    "response_length_mean": "Mean completion length in tokens",
    "response_length_max": "Longest completion in tokens",
    "response_clipped_fraction": "Share of completions cut at rollout.sampling.maxTokens",
}


class ForeignJobError(RuntimeError):
    """The live RLHFJob is not the one this runtime was configured for (uid differs)."""


def now_rfc3339() -> str:
    return datetime.now(UTC).replace(microsecond=0).isoformat().replace("+00:00", "Z")


def own_ray_cluster() -> str | None:
    """The Ray cluster this runtime runs in: KubeRay sets ``RAY_CLUSTER_NAME`` in every Ray container, and the
    driver inherits the head's environment. The operator tells a retried run's reports from the last one's."""
    return os.environ.get("RAY_CLUSTER_NAME") or None


#: ``status_patch(warning=KEEP)``: leave ``status.runtime.warning`` as it is (heartbeats, reports between steps).
KEEP: Any = object()


def status_patch(
    state: str | None = None,
    *,
    step: int | None = None,
    throughput: dict[str, float] | None = None,
    message: str | None = None,
    resumed_from_step: int | None = None,
    heartbeat: str | None = None,
    ray_cluster: str | None = None,
    progress_time: str | None = None,
    observed_generation: int | None = None,
    output: dict[str, Any] | None = None,
    evaluation: dict[str, Any] | None = None,
    warning: str | None = KEEP,
    tracking: dict[str, Any] | None = None,
    data: dict[str, Any] | None = None,
    agent: dict[str, Any] | None = None,
    memory: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The merge-patch body (pure). ``throughput``, ``output`` (``OutputStatus``), ``evaluation``
    (``EvalStatus``), ``tracking`` (``TrackingStatus``) and ``data`` (``DataStatus``) use snake_case field names.
    ``warning``: text sets ``status.runtime.warning``, None clears it (a JSON null in the merge patch), ``KEEP``
    leaves it."""
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
        state=state, message=message, resumed_from_step=resumed_from_step, ray_cluster=ray_cluster,
        observed_generation=observed_generation,
    ).wire()
    runtime["heartbeatTime"] = heartbeat or now_rfc3339()
    if progress_time:
        runtime["progressTime"] = progress_time
    if warning is not KEEP:
        runtime["warning"] = warning
    status["runtime"] = runtime
    if output:
        status["output"] = OutputStatus(**output).wire()
    if evaluation:
        status["eval"] = EvalStatus(**evaluation).wire()
    if tracking:
        status["tracking"] = TrackingStatus(**tracking).wire()
    if data:
        status["data"] = DataStatus(**data).wire()
    if memory:
        status["memory"] = MemoryStatus(**memory).wire()
    if agent:
        body = AgentStatus(**agent).wire()
        body["warning"] = agent.get("warning")  # None clears an earlier one
        status["agent"] = body
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
        obj = self.api.get_namespaced_custom_object_status(GROUP, VERSION, self.namespace, PLURAL, self.name,
                                                            _request_timeout=10)
        self._check(obj)
        self.checked = True

    def get_job(self) -> dict[str, Any]:
        """The live RLHFJob (metadata and spec; the Role allows ``get`` on it by name), uid-checked."""
        obj = self.api.get_namespaced_custom_object(GROUP, VERSION, self.namespace, PLURAL, self.name,
                                                    _request_timeout=10)
        self._check(obj)
        return obj

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
        self.train_gauges = {k: Gauge(f"rlhf_train_{k}", doc, labels, registry=self.registry)
                             for k, doc in TRAIN_METRICS.items()}
        self.labels = {"job": job, "namespace": namespace}

    def serve(self, port: int) -> None:
        from prometheus_client import start_http_server

        try:
            start_http_server(port, registry=self.registry)
        except OSError as e:  # a port taken on the head pod costs the metrics, not the run
            log.warning("Prometheus metrics not served on port %d: %s", port, e)

    def update(self, step: int, throughput: dict[str, float], train: dict[str, Any] | None = None) -> None:
        self.step.labels(**self.labels).set(step)
        for k, v in throughput.items():
            if k in self.gauges and v is not None:
                self.gauges[k].labels(**self.labels).set(v)
        for k, v in (train or {}).items():
            if k in self.train_gauges and isinstance(v, (int, float)):
                self.train_gauges[k].labels(**self.labels).set(v)


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
        tracker: Any = None,
    ) -> None:
        self.status = status
        self.metrics = metrics
        self.tracker = tracker  # infra.tracking.Tracker (spec.tracking), or None; its ``status``: status.tracking
        self.data: dict[str, Any] = {}  # status.data once the samples were checked
        self.progress = Path(progress_file) if progress_file else None
        self.state: str = "Starting"
        self.progress_time: str | None = None  # RFC 3339: run start/resume, then each completed step
        self.observed_generation: int | None = None  # metadata.generation of the spec applied
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.heartbeat_seconds = heartbeat_seconds
        self.thread: threading.Thread | None = None

    def write_progress(self, record: dict[str, Any]) -> None:
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

    def mark_progress(self) -> str:
        """Progress now (run start/resume, a completed step): the next reports carry it as ``progressTime``."""
        self.progress_time = now_rfc3339()
        return self.progress_time

    def live_job(self) -> dict[str, Any] | None:
        """The live RLHFJob, or None without API reporting or when the API cannot be read now (logged)."""
        status = self.status
        if status is None:
            return None
        try:
            return status.get_job()
        except ForeignJobError:
            self.status = None
            raise
        except Exception as e:  # noqa: BLE001 - an unreachable API must not stop training
            log.warning("could not read the RLHFJob: %s", e)
            return None

    def start_tracking(self, config: dict[str, Any], step: int) -> None:
        """Open the trackers (``spec.tracking``), continuing the run ids of the live ``status.tracking`` (a retried
        run), and report where they write."""
        if self.tracker is None:
            return
        job = self.live_job() or {}
        previous = (job.get("status") or {}).get("tracking") or {}
        log.info("tracking: %s", self.tracker.start(config, step, previous))

    def wants_samples(self, step: int) -> bool:
        """Whether ``report`` should get a sample table for this step (``spec.tracking.samplesEveryNSteps``)."""
        return self.tracker is not None and self.tracker.wants_samples(step)

    def report(
        self,
        state: str,
        *,
        step: int | None = None,
        throughput: dict[str, float] | None = None,
        message: str | None = None,
        resumed_from_step: int | None = None,
        extra: dict[str, Any] | None = None,
        output: dict[str, Any] | None = None,
        evaluation: dict[str, Any] | None = None,
        warning: str | None = KEEP,
        samples: list[dict[str, Any]] | None = None,
        agent: dict[str, Any] | None = None,
        memory: dict[str, Any] | None = None,
    ) -> None:
        """One report to every sink. ``samples``: rows (prompt, completion, reward) for the trackers' table."""
        if self.tracker is not None and self.tracker.started and step is not None and state == "Running":
            from rlhf_runtime.infra.tracking import step_metrics

            # outside the lock: a slow tracker must not hold up the heartbeat
            self.tracker.log(step, step_metrics(throughput, (extra or {}).get("train"), evaluation))
            if samples:
                self.tracker.samples(step, samples)
        body = status_patch(
            state, step=step, throughput=throughput, message=message, resumed_from_step=resumed_from_step,
            ray_cluster=own_ray_cluster(), progress_time=self.progress_time,
            observed_generation=self.observed_generation, output=output, evaluation=evaluation, warning=warning,
            tracking=self.tracker.status if self.tracker is not None else None, data=self.data, agent=agent,
            memory=memory,
        )
        with self.lock:
            self.state = state
            self._patch(body)
            if self.metrics and step is not None:
                self.metrics.update(step, throughput or {}, (extra or {}).get("train"))
            self.write_progress({"time": time.time(), **body["status"], **(extra or {})})

    def start_heartbeat(self, on_beat: Any = None) -> None:
        """Re-patch state, heartbeat, progressTime and observedGeneration every ``heartbeat_seconds``;
        ``on_beat()`` runs first each time (the driver re-reads its RLHFJob there)."""

        def beat() -> None:
            while not self.stop.wait(self.heartbeat_seconds):
                if on_beat is not None:
                    try:
                        on_beat()
                    except Exception as e:  # noqa: BLE001 - the heartbeat itself must go on
                        log.warning("heartbeat hook failed: %s", e)
                with self.lock:
                    try:
                        self._patch(status_patch(
                            self.state, ray_cluster=own_ray_cluster(), progress_time=self.progress_time,
                            observed_generation=self.observed_generation,
                        ))
                    except ForeignJobError as e:
                        log.error("%s", e)

        self.thread = threading.Thread(target=beat, name="rlhf-heartbeat", daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.stop.set()
        if self.thread:
            self.thread.join(timeout=5)
        if self.tracker is not None:
            self.tracker.close(self.state)
