"""Experiment tracking (``spec.tracking``): every step's metrics, the spec as the run's config and a sample table,
to TensorBoard, MLflow and Weights & Biases, several at once.

The driver owns it (``infra.report.Reporter`` feeds it); only the head pod talks to a tracker, so only the head
pod gets the credentials (the operator renders them there). Each backend is a ``Sink`` on a maintained client:

* ``TensorBoardSink``: ``torch.utils.tensorboard.SummaryWriter`` (the ``tensorboard`` package: the same one
  serves the files, ``tensorboard --logdir``, and reads them back in the tests) into ``<path>/<job name>``. A
  retried run opens it with ``purge_step`` = the step it resumed from, so TensorBoard drops the earlier run's
  points after the checkpoint instead of drawing two curves.
* ``MLflowSink``: ``mlflow.MlflowClient`` (``mlflow-skinny``): the experiment (created when missing), one run per
  job; a retried run continues the run id the last one put in ``status.tracking.mlflowRunId``. The spec goes in
  as the run's params (flattened, one per field) and as ``spec.json``; sample tables as ``samples/step-N.json``.
* ``WandbSink``: ``wandb.init`` with the job's id (``resume="allow"``: a retried run continues it); the spec is
  the run's config; sample tables are ``wandb.Table``s. Offline mode writes the run files under
  ``<path>/wandb``.

A tracker that fails (a server that does not answer, a bad credential) is dropped with its error in
``status.tracking.message`` and the log; training goes on: losing a curve must never cost a run.

What is logged per step (``step_metrics``, pure): the throughput of the status (``throughput/<name>``), the
trainer's statistics (``train/<name>``: loss, kl, entropy, clip_fraction, grad_norm, mismatch_kl, response
length, ...), the reward's mean and spread (``reward/mean``, ``reward/std``), the learning rate
(``train/learning_rate``) and, after an evaluation, ``eval/reward_mean``.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any, Protocol

log = logging.getLogger(__name__)

#: MLflow client defaults retry a dead server for minutes (7 retries, 120 s timeout each): a tracker that does not
#: answer should cost a step seconds, not a progress deadline. A user's own setting (spec.env) wins.
MLFLOW_ENV = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2", "MLFLOW_HTTP_REQUEST_TIMEOUT": "20",
              "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1"}
#: The longest param value MLflow stores (6000 characters since MLflow 2.x) and params per ``log_batch`` call.
MLFLOW_PARAM_CHARS, MLFLOW_PARAMS_PER_BATCH = 6000, 100


def step_metrics(throughput: dict[str, Any] | None, train: dict[str, Any] | None,
                 evaluation: dict[str, Any] | None = None) -> dict[str, float]:
    """The flat metrics of one report (pure): ``throughput/<name>``, ``train/<name>`` (numbers only, the step
    counter left out), ``reward/mean`` and ``reward/std`` and ``eval/reward_mean``."""
    out: dict[str, float] = {}
    for k, v in (throughput or {}).items():
        if k != "reward_mean" and isinstance(v, (int, float)) and not isinstance(v, bool):
            out[f"throughput/{k}"] = float(v)
    for k, v in (train or {}).items():
        if k in ("step", "reward_mean", "reward_std") or not isinstance(v, (int, float)) or isinstance(v, bool):
            continue
        out[f"train/{k}"] = float(v)
    train = train or {}
    if "reward_mean" in (throughput or {}):
        out["reward/mean"] = float(throughput["reward_mean"])  # type: ignore[index]
    if isinstance(train.get("reward_std"), (int, float)):
        out["reward/std"] = float(train["reward_std"])
    if evaluation and isinstance(evaluation.get("reward_mean"), (int, float)):
        out["eval/reward_mean"] = float(evaluation["reward_mean"])
    return out


def flatten(obj: Any, prefix: str = "") -> dict[str, str]:
    """A nested spec as ``a.b.c -> value`` strings (lists as JSON), for trackers whose params are flat (pure)."""
    out: dict[str, str] = {}
    if isinstance(obj, dict):
        for k, v in obj.items():
            out.update(flatten(v, f"{prefix}{k}."))
        return out
    key = prefix[:-1]
    out[key] = json.dumps(obj) if isinstance(obj, (list, tuple)) else str(obj)
    return out


class Sink(Protocol):
    """One tracking backend. ``start`` returns what ``status.tracking`` shows of it (snake_case)."""

    name: str

    def start(self, config: dict[str, Any], step: int, previous: dict[str, Any]) -> dict[str, Any]: ...

    def log(self, step: int, metrics: dict[str, float]) -> None: ...

    def samples(self, step: int, rows: list[dict[str, Any]]) -> None: ...

    def close(self, state: str) -> None: ...


class TensorBoardSink:
    name = "tensorboard"

    def __init__(self, path: str, job: str) -> None:
        self.dir = os.path.join(path, job)
        self.writer: Any = None

    def start(self, config: dict[str, Any], step: int, previous: dict[str, Any]) -> dict[str, Any]:
        from torch.utils.tensorboard import SummaryWriter

        os.makedirs(self.dir, exist_ok=True)
        # purge_step: points after the step this run resumed from (its checkpoint) belong to the last run, whose
        # later steps are redone now: TensorBoard hides them
        self.writer = SummaryWriter(self.dir, purge_step=step + 1 if step else None, flush_secs=30)
        self.writer.add_text("spec", "```json\n" + json.dumps(config, indent=1) + "\n```", step)
        self.writer.flush()
        return {"tensorboard_dir": self.dir}

    def log(self, step: int, metrics: dict[str, float]) -> None:
        for k, v in metrics.items():
            self.writer.add_scalar(k, v, step)
        self.writer.flush()

    def samples(self, step: int, rows: list[dict[str, Any]]) -> None:
        md = "| prompt | completion | reward |\n|---|---|---|\n" + "".join(
            f"| {_cell(r['prompt'])} | {_cell(r['completion'])} | {r['reward']:.4g} |\n" for r in rows)
        self.writer.add_text("samples", md, step)
        self.writer.flush()

    def close(self, state: str) -> None:
        if self.writer is not None:
            self.writer.close()


def _cell(text: str, limit: int = 500) -> str:
    text = text if len(text) <= limit else text[:limit] + "..."
    return text.replace("|", "\\|").replace("\n", "<br>")


class MLflowSink:
    name = "mlflow"

    def __init__(self, uri: str, experiment: str, run_name: str, tags: dict[str, str]) -> None:
        self.uri, self.experiment, self.run_name, self.tags = uri, experiment, run_name, tags
        self.client: Any = None
        self.run_id: str | None = None

    def start(self, config: dict[str, Any], step: int, previous: dict[str, Any]) -> dict[str, Any]:
        for k, v in MLFLOW_ENV.items():
            os.environ.setdefault(k, v)
        from mlflow import MlflowClient
        from mlflow.entities import Param, RunTag

        self.client = client = MlflowClient(tracking_uri=self.uri)
        exp = client.get_experiment_by_name(self.experiment)
        exp_id = exp.experiment_id if exp else client.create_experiment(self.experiment)
        run_id = previous.get("mlflowRunId")
        if run_id:  # a retried run continues the last one's run (a new one if it was deleted or moved)
            try:
                run = client.get_run(run_id)
            except Exception as e:  # noqa: BLE001 - e.g. RESOURCE_DOES_NOT_EXIST: start a new run
                log.warning("tracking: MLflow run %s of the last run is gone (%s): starting a new one", run_id, e)
                run = None
            if run is None or run.info.lifecycle_stage != "active" or run.info.experiment_id != exp_id:
                run_id = None
            else:
                client.update_run(run_id, status="RUNNING")
        if not run_id:
            run = client.create_run(exp_id, run_name=self.run_name, tags=self.tags)
            run_id = run.info.run_id
            params = [Param(k, v[:MLFLOW_PARAM_CHARS]) for k, v in sorted(flatten(config).items())]
            for i in range(0, len(params), MLFLOW_PARAMS_PER_BATCH):
                client.log_batch(run_id, params=params[i:i + MLFLOW_PARAMS_PER_BATCH])
            client.log_dict(run_id, config, "spec.json")
        else:
            client.log_batch(run_id, tags=[RunTag("rlhf.dev/resumed-from-step", str(step))])
        self.run_id = run_id
        return {"mlflow_run_id": run_id,
                "mlflow_run_url": f"{self.uri.rstrip('/')}/#/experiments/{exp_id}/runs/{run_id}"}

    def log(self, step: int, metrics: dict[str, float]) -> None:
        import time

        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(k.replace("/", "."), v, now, step)
                                                    for k, v in metrics.items()])

    def samples(self, step: int, rows: list[dict[str, Any]]) -> None:
        self.client.log_dict(self.run_id, {"step": step, "rows": rows}, f"samples/step-{step}.json")

    def close(self, state: str) -> None:
        if self.client is not None and self.run_id:
            self.client.set_terminated(self.run_id, status={"Succeeded": "FINISHED", "Failed": "FAILED"}.get(
                state, "KILLED"))


class WandbSink:
    name = "wandb"

    def __init__(self, project: str, entity: str | None, group: str | None, mode: str, base_url: str | None,
                 directory: str | None, run_name: str, run_id: str) -> None:
        self.kw = {"project": project, "entity": entity, "group": group, "mode": mode, "dir": directory,
                   "name": run_name}
        self.base_url, self.run_id = base_url, run_id
        self.run: Any = None

    def start(self, config: dict[str, Any], step: int, previous: dict[str, Any]) -> dict[str, Any]:
        if self.base_url:
            os.environ.setdefault("WANDB_BASE_URL", self.base_url)
        import wandb

        if self.kw["dir"]:
            os.makedirs(self.kw["dir"], exist_ok=True)
        run_id = previous.get("wandbRunId") or self.run_id
        self.run = wandb.init(id=run_id, resume="allow", config=config,
                              settings=wandb.Settings(console="off", x_disable_stats=True),
                              **{k: v for k, v in self.kw.items() if v is not None})
        out = {"wandb_run_id": self.run.id}
        url = getattr(self.run, "url", None)
        if url:
            out["wandb_run_url"] = url
        return out

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.run.log(metrics, step=step)

    def samples(self, step: int, rows: list[dict[str, Any]]) -> None:
        import wandb

        table = wandb.Table(columns=["step", "prompt", "completion", "reward"],
                            data=[[step, r["prompt"], r["completion"], r["reward"]] for r in rows])
        self.run.log({"samples": table}, step=step)

    def close(self, state: str) -> None:
        if self.run is not None:
            self.run.finish(exit_code=0 if state == "Succeeded" else 1)


class Tracker:
    """The sinks of ``spec.tracking``, each guarded: the first error drops a sink (``message`` says which and
    why). ``status`` is what ``status.tracking`` carries (snake_case)."""

    def __init__(self, sinks: list[Any], samples_every: int = 0, samples: int = 4) -> None:
        self.sinks = list(sinks)
        self.samples_every, self.samples_n = samples_every, samples
        self.status: dict[str, Any] = {}
        self.errors: list[str] = []
        self.started = False

    @classmethod
    def from_spec(cls, spec: Any, job: str, namespace: str, uid: str | None) -> Tracker | None:
        t = spec.tracking
        if t is None:
            return None
        sinks: list[Any] = []
        if t.tensorboard:
            sinks.append(TensorBoardSink(t.tensorboard.path, job))
        if t.mlflow:
            sinks.append(MLflowSink(t.mlflow.tracking_uri, t.mlflow.experiment or namespace, job,
                                    {"rlhf.dev/job": job, "rlhf.dev/namespace": namespace,
                                     **({"rlhf.dev/uid": uid} if uid else {})}))
        if t.wandb:
            w = t.wandb
            directory = os.path.join(w.path, job) if w.path else None
            # the run id is the job's uid: a retried run (new Ray cluster, same RLHFJob) continues the same run
            sinks.append(WandbSink(w.project, w.entity, w.group, w.mode, w.base_url, directory, job,
                                   (uid or f"{namespace}-{job}")[:64]))
        return cls(sinks, t.samples_every_n_steps, t.samples)

    def _guard(self, sink: Any, what: str, fn: Any, *args: Any) -> Any:
        try:
            return fn(*args)
        except Exception as e:  # noqa: BLE001 - a tracker's failure must not stop training
            msg = f"{sink.name} dropped at {what}: {type(e).__name__}: {e}"[:500]
            log.error("tracking: %s", msg)
            self.errors.append(msg)
            self.status["message"] = "; ".join(self.errors)[:1000]
            if sink in self.sinks:
                self.sinks.remove(sink)
            try:
                sink.close("Failed")
            except Exception as e2:  # noqa: BLE001 - it is being dropped anyway
                log.debug("tracking: closing %s failed too: %s", sink.name, e2)
            return None

    def start(self, config: dict[str, Any], step: int, previous: dict[str, Any] | None) -> dict[str, Any]:
        """Open every sink (``previous``: the live ``status.tracking``, wire names, for run ids to continue)."""
        for sink in list(self.sinks):
            got = self._guard(sink, "start", sink.start, config, step, previous or {})
            if got:
                self.status.update(got)
        self.started = True
        return self.status

    def log(self, step: int, metrics: dict[str, float]) -> None:
        if metrics:
            for sink in list(self.sinks):
                self._guard(sink, f"step {step}", sink.log, step, metrics)

    def wants_samples(self, step: int) -> bool:
        return bool(self.sinks) and self.samples_every > 0 and step % self.samples_every == 0

    def samples(self, step: int, rows: list[dict[str, Any]]) -> None:
        for sink in list(self.sinks):
            self._guard(sink, f"samples at step {step}", sink.samples, step, rows[:self.samples_n])

    def close(self, state: str) -> None:
        for sink in list(self.sinks):
            self._guard(sink, "close", sink.close, state)
        self.sinks = []
