"""``RLHFJobSpec``: the whole spec of an RLHFJob. Imports only pydantic."""

from __future__ import annotations

from typing import Any

from pydantic import ConfigDict, Field

from rlhf_api.base import (
    INT32_MAX,
    Model,
    sub,
)
from rlhf_api.environment import Environment
from rlhf_api.inputs import (
    VOLUME_SCHEMA,
    Checkpoint,
    Critic,
    Data,
    EnvFromSource,
    EnvVar,
    ObjectStorage,
    Output,
    Reference,
    Reward,
    RolePlacement,
    Scheduling,
    Tracking,
    VolumeMount,
)
from rlhf_api.rollout import Placement, Rollout, WeightSync
from rlhf_api.rules import SPEC_RULES, edit_rules
from rlhf_api.training import Algorithm, Head, ModelSource, Trainer


class RLHFJobSpec(Model):
    """What to train and how to lay it out on GPUs."""

    model_config = ConfigDict(json_schema_extra={"x-kubernetes-validations": SPEC_RULES})

    model: ModelSource = Field(description="The policy model to train (also loaded by the vLLM engines).")
    image: str = Field(
        min_length=1, max_length=1024, description="Container image with Ray, vLLM, torch and rlhf_runtime."
    )
    trainer: Trainer = sub(Trainer, "Trainer layout: pods, GPUs each, and parallel strategy.")
    rollout: Rollout = sub(Rollout, "vLLM rollout engines: DP engines x TP GPUs each, and sampling.")
    placement: Placement = sub(Placement, "Where trainers and engines run relative to each other.")
    weight_sync: WeightSync = sub(WeightSync, "How trainer weights reach the engines.")
    head: Head = sub(Head, "Size of the Ray head pod (where the driver runs) and of KubeRay's submitter pod.")
    algorithm: Algorithm = sub(Algorithm, "The RL algorithm and its hyper-parameters.")
    data: Data = Field(description="Where the prompts come from.")
    reward: Reward = sub(Reward, "How completions are scored (with spec.environment: the final answer of each "
                         "trajectory, beside the environment's reward).")
    environment: Environment | None = Field(
        None, description="Multi-turn rollouts: tools the model may call and an environment that answers its "
        "turns; each sample becomes a trajectory of several turns. Unset: one completion per sample.")
    critic: Critic | None = Field(
        None, description="PPO's critic (value model), trained beside the policy with FSDP2 like the trainer. Unset "
        "with algorithm.name 'ppo': the policy's model, colocated with the trainer.")
    reference: Reference = sub(Reference, "Where the frozen reference policy of the KL penalty runs.")
    output: Output | None = Field(
        None, description="Export the trained model in Hugging Face format (at the end; optionally every N steps).")
    checkpoint: Checkpoint | None = Field(None, description="Periodic checkpoints; the job resumes from the newest.")
    tracking: Tracking | None = Field(
        None, description="Experiment tracking: every step's metrics (reward, KL, entropy, clip fraction, response "
        "length, grad norm, learning rate, mismatch, MFU, tokens/s, stage times), the spec as the run's config and a "
        "sample table, to TensorBoard, MLflow and/or Weights & Biases (several at once). status.tracking says "
        "where. A tracker that fails is reported there and dropped; training goes on.")
    scheduling: Scheduling = sub(Scheduling, "Node selection, tolerations, priority and Kueue queue.")
    suspend: bool = Field(
        False,
        description="Suspend the job: its Ray cluster is deleted (phase Suspended); set false to resume, from the "
        "newest checkpoint if spec.checkpoint is set. With scheduling.queueName, Kueue owns the RayJob's suspension "
        "(admission, preemption) and this field deactivates the job's Kueue Workload instead.",
    )
    ttl_seconds_after_finished: int | None = Field(
        None, ge=0, le=INT32_MAX, description="Delete the Ray cluster this long after the job finished (status is kept)."
    )
    active_deadline_seconds: int | None = Field(None, ge=1, le=INT32_MAX, description="Fail the job after this many seconds.")
    backoff_limit: int = Field(
        0, ge=0, le=100,
        description="How many times a failed run is retried before the job is Failed: a crashed driver, a lost "
        "worker pod or an actor that died. Each retry runs on a new Ray cluster (KubeRay's RayJob "
        "backoffLimit) and, with spec.checkpoint, resumes from the newest checkpoint; without one it starts "
        "over. 0 (the default): the first failure is final.",
    )
    in_run_recoveries: int = Field(
        3, ge=0, le=100,
        description="How many faults one run repairs in place: an engine actor that died is replaced (same GPUs) "
        "and resynced, and only its part of the rollout re-runs; a dead trainer restarts every rank from the newest "
        "checkpoint (needs spec.checkpoint). The next fault fails the run, and spec.backoffLimit decides on a retry "
        "on a new Ray cluster. 0: every fault fails the run. Hangs are never repaired in place "
        "(spec.progressDeadlineSeconds).",
    )
    progress_deadline_seconds: int = Field(
        1800, ge=10, le=7 * 24 * 3600,
        description="Longest time a running job may go without completing a training step (counted from the "
        "runtime's start or resume and from each completed step). Past it the job is Stalled "
        "(reason ProgressDeadlineExceeded, with an Event): the runtime stops the stuck run, which then counts as a "
        "failed run (retried per spec.backoffLimit, resuming from the newest checkpoint). Set it above your slowest "
        "step plus model loading and engine start.",
    )
    env: list[EnvVar] | None = Field(
        None, max_length=256,
        description="Extra environment for every container: literal values, or valueFrom a Secret or ConfigMap key "
        "(e.g. HF_TOKEN for a gated model; a Secret's value never enters the job's ConfigMap, status or Events).")
    env_from: list[EnvFromSource] | None = Field(
        None, max_length=64, description="Every key of these Secrets or ConfigMaps as environment of every container.")
    volumes: list[dict[str, Any]] | None = Field(
        None, max_length=64, description="Extra volumes for every pod.", json_schema_extra={"items": VOLUME_SCHEMA}
    )
    volume_mounts: list[VolumeMount] | None = Field(
        None, max_length=64, description="Extra volume mounts for every container."
    )

    def cpu_only(self) -> bool:
        """trainer.gpusPerReplica 0: no pod asks for a GPU; the engines run on vLLM's CPU backend."""
        return self.trainer.gpus_per_replica == 0

    def critic_settings(self) -> Critic | None:
        """The critic of a PPO job (spec.critic or its defaults); None for the critic-free algorithms."""
        return (self.critic or Critic()) if self.algorithm.name == "ppo" else None

    def reference_active(self) -> bool:
        return self.algorithm.kl_coef > 0

    def object_storage(self) -> ObjectStorage | None:
        """The object store's endpoint and credentials (checkpoint.storage, else output.storage; admission makes
        them equal when both are set), for every head and worker container."""
        for loc in (self.checkpoint, self.output):
            if loc is not None and loc.uri and loc.storage is not None:
                return loc.storage
        return None

    def role_gpus(self, role: RolePlacement) -> int:
        """GPUs per pod of a separate role (0 for a CPU-only job)."""
        return 0 if self.cpu_only() else role.gpus_per_replica


SPEC_RULES.extend(edit_rules(RLHFJobSpec))  # the class's schema extra holds this list: rules over its own fields
RLHFJobSpec.model_rebuild()
