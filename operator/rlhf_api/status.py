"""``RLHFJobStatus``: what the operator reports on an RLHFJob. Imports only pydantic."""

from __future__ import annotations

from datetime import datetime
from typing import Literal

from pydantic import Field

from rlhf_api.base import (
    Model,
)
from rlhf_api.environment import AgentStatus, SandboxStatus

# ---------------------------------------------------------------------------------------------- status
PHASES = ("Pending", "Provisioning", "Running", "Succeeded", "Failed", "Suspended")
Phase = Literal["Pending", "Provisioning", "Running", "Succeeded", "Failed", "Suspended"]


class Condition(Model):
    """metav1.Condition."""

    type: str = Field(description="Condition type, e.g. Ready, Reconciling, Stalled.")
    status: Literal["True", "False", "Unknown"] = Field(description="True, False or Unknown.")
    reason: str = Field(description="CamelCase reason.")
    message: str = Field("", description="Human-readable details.")
    last_transition_time: datetime = Field(description="When status last changed.")
    observed_generation: int | None = Field(None, description="metadata.generation this condition is about.")


class Children(Model):
    config_map: str | None = Field(None, description="ConfigMap with the runtime's job configuration.")
    ray_job: str | None = Field(None, description="KubeRay RayJob running the job.")
    ray_cluster: str | None = Field(None, description="KubeRay RayCluster created for the RayJob.")


class Throughput(Model):
    rollout_tokens_per_second: float | None = Field(None, description="Generated tokens per second (last step).")
    samples_per_second: float | None = Field(None, description="Scored samples per second (last step).")
    step_seconds: float | None = Field(None, description="Wall time of the last step.")
    rollout_seconds: float | None = Field(None, description="Generation time of the last step.")
    train_seconds: float | None = Field(None, description="Training time of the last step.")
    weight_sync_seconds: float | None = Field(None, description="Weight sync time of the last sync.")
    weight_sync_gbps: float | None = Field(None, description="Weight sync effective GB/s of the last sync.")
    reward_mean: float | None = Field(None, description="Mean reward of the last step.")
    reward_seconds: float | None = Field(None, description="Scoring time of the last step (all reward sources).")
    reference_seconds: float | None = Field(None, description="Reference log-probability time of the last step.")
    critic_seconds: float | None = Field(None, description="Critic time of the last step (values and its update).")
    train_tokens_per_second_per_gpu: float | None = Field(
        None, description="Training tokens (prompt and completion) per second per trainer GPU (last step)."
    )
    mfu: float | None = Field(
        None,
        description="Model FLOPs utilisation of the last training step: 6 x parameters x tokens plus causal "
        "attention, where a mixture of experts counts the routed experts a token goes to (top-k of them), over "
        "the trainer GPUs' dense bfloat16 peak (GPUs of known peak only).",
    )
    mismatch_kl: float | None = Field(
        None,
        description="Training-inference mismatch of the last step: mean over completion tokens of w - log w - 1, "
        "w the trainer's over the engine's probability of the sampled token (0: identical).",
    )


class OutputStatus(Model):
    path: str | None = Field(None, description="Directory (or object-store URI) of the newest exported model.")
    step: int | None = Field(None, description="Training step it was exported at.")
    time: datetime | None = Field(None, description="When the export completed.")


class EvalStatus(Model):
    reward_mean: float | None = Field(None, description="Mean reward over the eval prompts (greedy answers).")
    step: int | None = Field(None, description="Training step of the evaluation.")
    prompts: int | None = Field(None, description="Eval prompts scored.")
    time: datetime | None = Field(None, description="When the evaluation completed.")


class DataStatus(Model):
    samples: int | None = Field(None, description="Training samples the run uses (after any dropped).")
    dropped: int | None = Field(None, description="Samples left out by data.invalidSamples drop.")
    message: str | None = Field(None, description="Why samples were dropped, with the first lines or rows named.")


class TrackingStatus(Model):
    tensorboard_dir: str | None = Field(None, description="Where the TensorBoard event files are written.")
    mlflow_run_id: str | None = Field(None, description="The MLflow run (a retried run continues it).")
    mlflow_run_url: str | None = Field(None, description="The MLflow run's page.")
    wandb_run_id: str | None = Field(None, description="The W&B run (a retried run continues it).")
    wandb_run_url: str | None = Field(None, description="The W&B run's page (online mode).")
    message: str | None = Field(None, description="Trackers that failed and were dropped, and why.")


class RuntimeReport(Model):
    """What the in-pod runtime reports; the operator folds it into phase and conditions."""

    state: Literal["Starting", "Running", "Succeeded", "Failed"] | None = Field(None, description="Runtime state.")
    message: str | None = Field(None, description="Runtime message (e.g. the error of a failed run).")
    heartbeat_time: datetime | None = Field(None, description="Last report from the runtime.")
    resumed_from_step: int | None = Field(None, description="Checkpoint step the runtime resumed from.")
    ray_cluster: str | None = Field(
        None, description="The Ray cluster the reporting runtime runs in: a report from an earlier run (before a "
        "retry on a new cluster) is recognised as such.")
    progress_time: datetime | None = Field(
        None, description="When the runtime last made progress: its start or resume, then each completed step "
        "(spec.progressDeadlineSeconds is counted from it).")
    observed_generation: int | None = Field(
        None, description="metadata.generation of the spec the runtime has applied (a live edit of "
        "spec.algorithm.steps takes effect when the runtime reads it).")
    warning: str | None = Field(
        None, description="A problem the runtime sees that does not stop the run, cleared by the next step without "
        "it: the trainer-vs-engine mismatch (status.throughput.mismatchKl) far above its running level right after a "
        "weight sync, i.e. engines that may still sample from older weights. The operator turns it into the "
        "EnginesInSync condition and a Warning Event.")


class MemoryStatus(Model):
    rollout_gib: float | None = Field(None, alias="rolloutGiB", description="Planned GPU memory during rollouts, GiB.")
    training_gib: float | None = Field(None, alias="trainingGiB", description="Planned GPU memory while training, GiB.")
    kv_cache_gib: float | None = Field(None, alias="kvCacheGiB", description="The engine's KV cache, GiB.")
    sequences_at_once: int | None = Field(None, description="Sequences the KV cache holds at once.")
    batch_sequences: int | None = Field(None, description="Sequences of a step's rollout.")
    offload: bool | None = Field(None, description="Whether the trainer's state leaves the GPU during rollouts.")
    summary: str | None = Field(None, description="The plan in one line.")


class RLHFJobStatus(Model):
    phase: Phase | None = Field(None, description="Pending, Provisioning, Running, Succeeded, Failed or Suspended.")
    message: str | None = Field(None, description="Why the job is in this phase.")
    observed_generation: int | None = Field(None, description="Last metadata.generation the operator acted on.")
    conditions: list[Condition] | None = Field(
        None,
        description="Ready, Reconciling, Stalled (kstatus), PodsScheduled, RayClusterReady, Complete, InvalidSpec, "
        "DataAvailable; Admitted under Kueue; EnginesInSync once the runtime measures the trainer-vs-engine mismatch; "
        "SamplesValid once it has checked the samples (False, reason SamplesDropped, when data.invalidSamples drop left "
        "some out); SandboxesReady with spec.environment.sandbox (False with the cause when its warm pool cannot fill).",
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]},
    )
    children: Children | None = Field(None, description="Objects the operator owns for this job.")
    step: int | None = Field(None, description="Last completed training step.")
    total_steps: int | None = Field(None, description="spec.algorithm.steps.")
    throughput: Throughput | None = Field(None, description="Throughput of the last step.")
    runtime: RuntimeReport | None = Field(None, description="The runtime's own report.")
    output: OutputStatus | None = Field(None, description="The newest exported model (spec.output).")
    eval: EvalStatus | None = Field(None, description="The newest evaluation on spec.data.eval.")
    agent: AgentStatus | None = Field(None, description="The last step's multi-turn rollout (spec.environment).")
    sandbox: SandboxStatus | None = Field(
        None, description="The job's warm pool of sandboxes (spec.environment.sandbox), as the operator observed it.")
    memory: MemoryStatus | None = Field(
        None, description="The colocated layout's memory plan per GPU, checked before the engines were built.")
    tracking: TrackingStatus | None = Field(None, description="Where the run's metrics go (spec.tracking).")
    data: DataStatus | None = Field(None, description="The training data as checked before the first step.")
    start_time: datetime | None = Field(None, description="When the job started running.")
    completion_time: datetime | None = Field(None, description="When the job finished.")
