"""The RLHFJob spec's validation rules: the CEL rules across its fields (``SPEC_RULES``) and the rules that keep a
submitted job's fields fixed (``edit_rules``). Imports only pydantic."""

from __future__ import annotations

from rlhf_api.base import (
    Model,
    cel,
)
from rlhf_api.training import Algorithm

# ------------------------------------------------------------------------------------------------ spec
SPEC_RULES = [
    cel(
        "has(self.environment) || has(self.reward.rule) || has(self.reward.function) || has(self.reward.model) || "
        "has(self.reward.endpoint)",
        "reward needs a source: rule, function, model or endpoint (or spec.environment, whose reward is used)",
        fieldPath=".reward",
    ),
    cel(
        "!has(self.environment) || has(self.environment.className) || has(self.environment.http) || "
        "(has(self.environment.tools) && size(self.environment.tools) > 0)",
        "spec.environment needs tools, className or http",
        fieldPath=".environment",
    ),
    cel(
        "!has(self.environment) || self.weightSync.mode == 'sync' || "
        "self.weightSync.everyNSteps <= self.weightSync.maxStaleness + 1",
        "spec.environment with weightSync.mode 'async' needs weightSync.everyNSteps <= weightSync.maxStaleness + 1: "
        "between syncs the engines' weights grow older than maxStaleness allows, so no trajectory could be "
        "trained; lower everyNSteps or raise maxStaleness",
        fieldPath=".weightSync.maxStaleness",
    ),
    cel(
        "self.weightSync.maxStaleness == 1 || (has(self.environment) && self.weightSync.mode == 'async')",
        "weightSync.maxStaleness applies to multi-turn rollouts (spec.environment) in weightSync.mode 'async' "
        "only: remove it (a single-turn async rollout runs one step ahead; sync mode trains what the engines' "
        "current weights sampled)",
        fieldPath=".weightSync.maxStaleness",
    ),
    cel(
        "!has(self.environment) || (!self.rollout.expertParallel && !has(self.trainer.lora))",
        "spec.environment does not support rollout.expertParallel or trainer.lora yet",
        fieldPath=".environment",
    ),
    cel(
        "self.rollout.tensorParallelSize <= self.placement.gpusPerNode",
        "rollout.tensorParallelSize must not exceed placement.gpusPerNode: an engine's GPUs must share a node",
        fieldPath=".rollout.tensorParallelSize",
    ),
    cel(
        "self.trainer.gpusPerReplica <= self.placement.gpusPerNode",
        "trainer.gpusPerReplica must not exceed placement.gpusPerNode",
        fieldPath=".trainer.gpusPerReplica",
    ),
    cel(
        "self.weightSync.backend != 'ipc' || self.placement.mode == 'colocated'",
        "weightSync.backend 'ipc' needs placement.mode 'colocated' (CUDA IPC only works within a GPU's node "
        "and process pair)",
        fieldPath=".weightSync.backend",
    ),
    cel(
        "self.placement.mode != 'colocated' || self.weightSync.backend == 'ipc'",
        "placement.mode 'colocated' needs weightSync.backend 'ipc' (NCCL cannot connect two ranks on one GPU)",
        fieldPath=".weightSync.backend",
    ),
    cel(
        "self.placement.mode != 'colocated' || "
        "self.trainer.replicas * self.trainer.gpusPerReplica == self.rollout.engines * self.rollout.tensorParallelSize",
        "placement.mode 'colocated' needs as many trainer GPUs (trainer.replicas x trainer.gpusPerReplica) as "
        "engine GPUs (rollout.engines x rollout.tensorParallelSize): each GPU holds one trainer worker and one "
        "engine shard",
    ),
    cel(
        "self.placement.colocatedSleep || self.placement.mode == 'colocated'",
        "placement.colocatedSleep: false only applies to placement.mode 'colocated' (separate engines never sleep)",
        fieldPath=".placement.colocatedSleep",
    ),
    cel(
        "self.weightSync.mode != 'async' || self.placement.mode == 'separate'",
        "weightSync.mode 'async' (pause/resume mid-request) needs placement.mode 'separate': colocated engines "
        "sleep during training",
        fieldPath=".weightSync.mode",
    ),
    cel(
        "self.rollout.asyncEngine == 'asyncllm' || self.weightSync.mode == 'async'",
        "rollout.asyncEngine 'stepped' applies to weightSync.mode 'async' only (sync mode runs vLLM's LLM)",
        fieldPath=".rollout.asyncEngine",
    ),
    cel(
        "!self.rollout.expertParallel || self.weightSync.mode == 'sync'",
        "rollout.expertParallel needs weightSync.mode 'sync': expert-parallel engines step together and cannot be "
        "paused one by one",
        fieldPath=".rollout.expertParallel",
    ),
    cel(
        "!has(self.trainer.lora) || self.weightSync.mode == 'sync'",
        "trainer.lora needs weightSync.mode 'sync': the adapter is swapped between rollouts (the async engines, "
        "paused mid-request, serve no LoRA adapter)",
        fieldPath=".weightSync.mode",
    ),
    cel(
        "!has(self.trainer.lora) || !self.rollout.expertParallel",
        "trainer.lora cannot be combined with rollout.expertParallel: LoRA on expert-parallel engines is not "
        "supported; set expertParallel to false or drop trainer.lora",
        fieldPath=".rollout.expertParallel",
    ),
    cel(
        "self.algorithm.name != 'grpo' || self.rollout.sampling.samplesPerPrompt >= 2",
        "GRPO needs rollout.sampling.samplesPerPrompt >= 2: advantages are relative within a prompt's group",
        fieldPath=".rollout.sampling.samplesPerPrompt",
    ),
    cel(
        "self.algorithm.name != 'rloo' || self.rollout.sampling.samplesPerPrompt >= 2",
        "RLOO needs rollout.sampling.samplesPerPrompt >= 2: each sample's baseline is the mean of the other "
        "samples of its prompt",
        fieldPath=".rollout.sampling.samplesPerPrompt",
    ),
    cel(
        "!has(self.critic) || self.algorithm.name == 'ppo'",
        "spec.critic applies to algorithm.name 'ppo' only (grpo, rloo and reinforce++ have no critic)",
        fieldPath=".critic",
    ),
    cel(
        "self.reference.placement == 'trainer' || self.algorithm.klCoef > 0.0",
        "spec.reference.placement other than 'trainer' needs algorithm.klCoef > 0 (without a KL penalty no "
        "reference is loaded)",
        fieldPath=".reference.placement",
    ),
    cel(
        "(!has(self.reward.model) || self.reward.model.gpusPerReplica <= self.placement.gpusPerNode) && "
        "(!has(self.critic) || self.critic.gpusPerReplica <= self.placement.gpusPerNode) && "
        "self.reference.gpusPerReplica <= self.placement.gpusPerNode",
        "reward.model, critic and reference gpusPerReplica must not exceed placement.gpusPerNode",
    ),
    cel(
        "!has(self.data.eval) || !has(self.data.eval.configMap) || "
        "(has(self.data.configMap) && self.data.eval.configMap.name == self.data.configMap.name)",
        "data.eval.configMap must name the ConfigMap of data.configMap (another key of it): the pods mount that "
        "one ConfigMap",
        fieldPath=".data.eval.configMap",
    ),
    cel(
        "!has(self.output) || !has(self.output.volume) || "
        "(has(self.volumes) && self.volumes.exists(v, v.name == self.output.volume))",
        "output.volume must name a volume in spec.volumes",
        fieldPath=".output.volume",
    ),

    cel(
        "!has(self.checkpoint) || !has(self.checkpoint.volume) || "
        "(has(self.volumes) && self.volumes.exists(v, v.name == self.checkpoint.volume))",
        "checkpoint.volume must name a volume in spec.volumes",
        fieldPath=".checkpoint.volume",
    ),
    cel(
        "!has(self.checkpoint) || !has(self.checkpoint.storage) || !has(self.output) || "
        "!has(self.output.storage) || (" + " && ".join(
            f"(has(self.checkpoint.storage.{f}) ? self.checkpoint.storage.{f} : '') == "
            f"(has(self.output.storage.{f}) ? self.output.storage.{f} : '')"
            for f in ("endpoint", "region", "credentialsSecret")) + ")",
        "checkpoint.storage and output.storage must be the same when both are set (the pods get one endpoint "
        "and one set of credentials)",
        fieldPath=".output.storage",
    ),
    cel(
        "!has(self.tracking) || !has(self.tracking.tensorboard) || (has(self.volumes) && "
        "self.volumes.exists(v, v.name == self.tracking.tensorboard.volume))",
        "tracking.tensorboard.volume must name a volume in spec.volumes",
        fieldPath=".tracking.tensorboard.volume",
    ),
    cel(
        "!has(self.tracking) || !has(self.tracking.wandb) || !has(self.tracking.wandb.volume) || "
        "(has(self.volumes) && self.volumes.exists(v, v.name == self.tracking.wandb.volume))",
        "tracking.wandb.volume must name a volume in spec.volumes",
        fieldPath=".tracking.wandb.volume",
    ),
    cel(
        "!has(self.volumeMounts) || self.volumeMounts.all(m, has(self.volumes) && "
        "self.volumes.exists(v, v.name == m.name))",
        "every volumeMounts[].name must name a volume in spec.volumes",
        fieldPath=".volumeMounts",
    ),
]



#: Spec fields that may change on a submitted job (wire paths). Each is applied where it matters: ``suspend``,
#: ``activeDeadlineSeconds``, ``ttlSecondsAfterFinished`` and ``backoffLimit`` are patched into the RayJob;
#: ``algorithm.steps`` and ``progressDeadlineSeconds`` are read by the running driver from its RLHFJob. Every other
#: change is refused at admission (``edit_rules``): the Ray cluster, the runtime's config and the pods were made
#: from it and would silently keep the old value.
MUTABLE_FIELDS = ("suspend", "algorithm.steps", "progressDeadlineSeconds", "activeDeadlineSeconds",
                  "ttlSecondsAfterFinished", "backoffLimit")


def edit_rules(spec: type[Model]) -> list[dict[str, str]]:
    """CEL transition rules over the fields of ``spec`` (the RLHFJobSpec class): one per field outside ``MUTABLE_FIELDS``, with a message naming it."""
    allowed = ", ".join(f"spec.{f}" for f in MUTABLE_FIELDS)
    rules = []

    def rule(path: str, optional: bool) -> None:
        same = f"self.{path} == oldSelf.{path}"
        expr = f"has(self.{path}) == has(oldSelf.{path}) && (!has(self.{path}) || {same})" if optional else same
        rules.append(cel(expr, f"spec.{path} cannot change on a submitted job (only {allowed} can): delete the "
                         "RLHFJob and create a new one to change it", fieldPath=f".{path}"))

    for name, f in spec.model_fields.items():
        wire = f.alias or name
        if wire in MUTABLE_FIELDS:
            continue
        if wire == "algorithm":
            for aname, af in Algorithm.model_fields.items():
                if f"algorithm.{af.alias or aname}" not in MUTABLE_FIELDS:
                    rule(f"algorithm.{af.alias or aname}", optional=not af.is_required() and af.default is None)
            continue
        rule(wire, optional=not f.is_required() and f.default is None)
    return rules
