"""The RLHFJob spec's training parts: the model, the trainer, the Ray head and the algorithm. Imports only pydantic."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import ConfigDict, Field

from rlhf_api.base import (
    CPU_PATTERN,
    INT32_MAX,
    MEMORY_PATTERN,
    Model,
    cel,
    sub,
)


# ----------------------------------------------------------------------------------------------- model
class ModelSource(Model):
    name: str = Field(
        min_length=1,
        max_length=512,
        description="Hugging Face model id (e.g. Qwen/Qwen3-1.7B) or an absolute path inside the pods "
        "(a volume listed in spec.volumes and mounted with spec.volumeMounts).",
    )
    revision: str | None = Field(None, max_length=128, description="Hub revision (branch, tag or commit).")
    dtype: Literal["bfloat16", "float16", "float32"] = Field(
        "bfloat16", description="Parameter dtype for trainer and engines; also the dtype of weight sync."
    )
    trust_remote_code: bool = Field(False, description="Allow model code from the hub (trust_remote_code).")


# --------------------------------------------------------------------------------------------- trainer
class Optimizer(Model):
    name: Literal["adamw"] = Field("adamw", description="Optimiser. Only AdamW for now.")
    weight_decay: float = Field(0.0, ge=0, description="Decoupled weight decay.")
    beta1: float = Field(0.9, ge=0, lt=1, description="Adam beta1.")
    beta2: float = Field(0.999, ge=0, lt=1, description="Adam beta2.")
    max_grad_norm: float = Field(1.0, ge=0, description="Gradient clipping norm; 0 disables clipping.")




class Resources(Model):
    cpu: str = Field("8", pattern=CPU_PATTERN, max_length=32, description=(
        "CPU request per pod (e.g. 8 or 500m). On a CPU-only job (trainer.gpusPerReplica 0) the runtime's "
        "actors in the pod compute on this many threads, rounded up (OMP_NUM_THREADS; without it Ray gives each "
        "actor one); a spec.env OMP_NUM_THREADS takes precedence."))
    memory: str = Field("64Gi", pattern=MEMORY_PATTERN, max_length=32, description="Memory request per pod.")


#: trainer.lora.targetModules by default: the attention projections of Llama/Qwen-style decoders.
LORA_DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")


class LoRA(Model):
    model_config = ConfigDict(json_schema_extra={"x-kubernetes-validations": [
        cel("self.targetModules.all(m, !(m in ['lm_head', 'embed_tokens']))",
            "trainer.lora.targetModules must name linear layers of the decoder (e.g. q_proj, v_proj, gate_proj): "
            "vLLM serves no LoRA adapter on lm_head or embed_tokens",
            fieldPath=".targetModules"),
    ]})
    rank: int = Field(
        8, ge=1, le=256,
        description="Rank r of the low-rank update B x A (A: r x in_features, B: out_features x r) of each target "
        "module. The adapter, and so every weight sync, grows linearly with it; the engines reserve LoRA slots of "
        "the next vLLM size up (1, 8, 16, 32, 64, 128, 256).",
    )
    alpha: int = Field(
        16, ge=1, le=65536,
        description="LoRA alpha: the update is scaled by alpha / rank (PEFT's lora_alpha), so W' = W + "
        "(alpha / rank) B A.",
    )
    target_modules: list[Annotated[str, Field(min_length=1, max_length=128, pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")]] = (
        Field(
            default_factory=lambda: list(LORA_DEFAULT_TARGETS), min_length=1, max_length=64,
            description="Names of the linear modules that get an adapter, matched against the last part of each "
            "module's name (PEFT's target_modules), e.g. q_proj, k_proj, v_proj, o_proj (attention) and gate_proj, "
            "up_proj, down_proj (MLP) in Llama/Qwen-style models. A name the model does not have fails the trainer "
            "at start; lm_head and embed_tokens are refused (vLLM serves no adapter there).",
            json_schema_extra={"x-kubernetes-list-type": "set", "default": list(LORA_DEFAULT_TARGETS)},
        )
    )
    dropout: float = Field(0.0, ge=0, lt=1, description="Dropout on the adapter's input while training (PEFT's "
                           "lora_dropout); rollouts and log-probabilities never use it.")


class Trainer(Model):
    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                cel(
                    "self.strategy != 'single' || (self.replicas == 1 && self.gpusPerReplica <= 1)",
                    "trainer.strategy 'single' trains in one process on one GPU: use replicas=1 and "
                    "gpusPerReplica<=1, or strategy 'fsdp2'",
                    fieldPath=".strategy",
                ),
                cel(
                    "!self.autocast || self.masterWeights == 'float32'",
                    "trainer.autocast keeps the trained weights in float32 (they are the master weights): use "
                    "trainer.masterWeights 'float32', or drop trainer.autocast",
                    fieldPath=".autocast",
                ),
                cel(
                    "!has(self.lora) || self.strategy == 'single'",
                    "trainer.lora trains the adapter in one process: use trainer.strategy 'single' (FSDP2 sharding "
                    "of a LoRA policy is not supported), or drop trainer.lora for full fine-tuning",
                    fieldPath=".lora",
                ),
            ]
        }
    )
    replicas: int = Field(1, ge=1, le=512, description="Trainer pods (one Ray worker each).")
    gpus_per_replica: int = Field(
        1, ge=0, le=16, description="GPUs per trainer pod; one FSDP2 worker runs per GPU. 0 = CPU only (tests)."
    )
    strategy: Literal["single", "fsdp2"] = Field(
        "single",
        description="single: one process, one GPU. fsdp2: FSDP2 sharding over all trainer GPUs; the first "
        "trainer worker loads the model once in its pod's host memory (in the checkpoint's own dtype where the "
        "shards widen it exactly: 2 bytes per parameter for a bfloat16 checkpoint; 4 for a float32 one with "
        "float32 master weights) and every GPU receives only its own shards. Exports gather the model in "
        "model.dtype on that pod.",
    )
    optimizer: Optimizer = sub(Optimizer, "Optimiser settings (the learning rate is in spec.algorithm).")
    resources: Resources = sub(Resources, "CPU and memory per trainer pod (GPUs come from gpusPerReplica).")
    gradient_checkpointing: bool = Field(
        False,
        description="Recompute each decoder layer's activations in the backward pass instead of keeping them: "
        "activation memory per micro-batch drops from every layer's to about one layer's, for one more forward "
        "pass of each layer in the backward. Needed for long sequences (thousands of tokens per micro-batch on "
        "billion-parameter models).",
    )
    compile: bool = Field(
        False,
        description="Compile each decoder layer of the policy and critic with torch.compile (fused normalisation, "
        "rotary, activation and cast kernels; the attention and matrix multiplications stay as they are): "
        "a longer start-up (each layer compiled once) for more training tokens/s, the same losses.",
    )
    reshard_after_forward: bool = Field(
        True,
        description="trainer.strategy fsdp2 only: free each decoder layer's gathered parameters after its forward "
        "pass and gather them again for its backward (FSDP2's reshard_after_forward). false keeps them from "
        "forward to backward: one all-gather per layer and micro-batch instead of two, for a whole model.dtype "
        "copy of the decoder on every trainer GPU during each micro-batch (2 bytes per parameter in bfloat16). "
        "Default true; a larger maxTokensPerMicroBatch, where it fits, also cuts the gathers per step.",
    )
    master_weights: Literal["float32", "none"] = Field(
        "float32",
        description="float32: the optimiser updates float32 master weights with float32 gradients and AdamW "
        "state while forward and backward compute in model.dtype (FSDP2: float32 shards under a "
        "mixed-precision policy; one worker: a float32 copy beside the model); weight syncs, exports and "
        "engines stay in model.dtype. 16 bytes per trained parameter (+2 for the model copy with one worker) "
        "before activations. none: update the model.dtype weights directly (8 bytes per parameter in "
        "bfloat16): bfloat16 rounds away updates smaller than about 1/256 of a weight, so at RL learning rates "
        "most are lost. No effect when model.dtype is float32.",
    )
    autocast: bool = Field(
        False,
        description="Compute the way Hugging Face Trainer's bf16/fp16 option and TRL do: the policy, critic and "
        "reference keep float32 weights and every forward pass runs under torch.autocast to model.dtype "
        "(its backward follows the forward's dtypes): matrix multiplications and attention in "
        "model.dtype, normalisation, softmax, losses and the residual stream in float32. false (default):"
        " forward and backward run wholly in model.dtype over float32 master weights (veRL's and "
        "OpenRLHF's mixed precision). Same optimiser state and update precision either way; autocast "
        "rounds less in the forward pass (closer to a float32 model's log-probabilities) for a cast of "
        "every weight per forward; with FSDP2 it gathers float32 parameters (twice the bytes of "
        "model.dtype). Memory per trained parameter: 16 bytes (no model.dtype copy beside the masters); "
        "the reference (any placement) is float32 too (4 bytes per parameter instead of 2), so it "
        "computes as the initial policy. Weight syncs and exports still send model.dtype (cast on the way"
        " out: the resident IPC sync, which maps the trainer's model.dtype parameters, falls back to the "
        "packed copy). Needs masterWeights float32; no effect when model.dtype is float32; with LoRA the "
        "frozen base stays in model.dtype.",
    )
    max_tokens_per_micro_batch: int = Field(
        16384,
        ge=16,
        le=4_194_304,
        description="Token budget of a micro-batch (prompt + completion tokens) in every forward and backward "
        "pass of the trainer, critic and reference: samples are packed end to end without padding into "
        "micro-batches of at most this many tokens (a longer sample runs alone), gradients accumulate over "
        "them. Peak activation memory grows with it; with FSDP2 every worker runs as many micro-batches as the "
        "busiest one, and each micro-batch gathers the parameters and reduce-scatters the gradients (float32 "
        "with master weights), so the largest budget that fits is the fastest.",
    )
    offload_during_rollout: Literal["auto", "always", "never"] = Field(
        "auto",
        description="Colocated placement with sleeping engines only: move the trainer's state that a rollout does "
        "not read to pinned host memory while the engines generate, and back before each training step, so that "
        "the engines' KV cache can use that GPU memory. One worker moves its float32 master weights and AdamW "
        "moments (12 bytes per parameter), FSDP2 its moments (8 bytes per parameter over the trainer GPUs); "
        "gradients are freed after every step anyway. The trainer pods' memory (trainer.resources.memory) must "
        "hold it. always: move it; never: keep it on the GPU; auto (default): move it only where the memory plan "
        "finds that the engines (rollout.gpuMemoryUtilization or rollout.kvCacheMemoryGiB) do not fit beside it "
        "and the trainer pods' memory holds it.",
    )
    lora: LoRA | None = Field(
        None,
        description="Train a LoRA adapter instead of the whole model: the base model (spec.model) stays frozen, "
        "the optimiser updates only the adapter (rank x (in + out) values per target module), and each weight "
        "sync sends only the adapter (a safetensors file, kilobytes to megabytes, through Ray's object store; "
        "weightSync.backend, packed and bucketSizeMB do not apply): the engines load the base model's real "
        "weights at start and serve every rollout with the newest adapter (vLLM LoRA). Checkpoints hold the "
        "adapter and its optimiser state; exports (spec.output) and weight-sync validation use the merged "
        "weights W + (alpha / rank) B A, a plain Hugging Face model. Needs trainer.strategy 'single', "
        "weightSync.mode 'sync' and no rollout.expertParallel. Unset: full fine-tuning.",
    )


# ------------------------------------------------------------------------------------------------ head
class HeadResources(Resources):
    cpu: str = Field(
        "2", pattern=CPU_PATTERN, max_length=32, description="CPU request of the head pod (e.g. 2 or 500m)."
    )
    memory: str = Field(
        "8Gi", pattern=MEMORY_PATTERN, max_length=32,
        description="Memory request (and limit) of the head pod; at least 1Gi.",
    )


class SubmitterResources(Resources):
    cpu: str = Field("200m", pattern=CPU_PATTERN, max_length=32, description="CPU request of KubeRay's submitter pod.")
    memory: str = Field(
        "512Mi", pattern=MEMORY_PATTERN, max_length=32,
        description="Memory request (and limit) of KubeRay's submitter pod; at least 256Mi.",
    )


class Head(Model):
    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                cel(
                    "quantity(self.resources.memory).compareTo(quantity('1Gi')) >= 0",
                    "head.resources.memory must be at least 1Gi: the head pod runs Ray's GCS, dashboard and raylet "
                    "and the driver (Ray, transformers and the tokenizer)",
                    fieldPath=".resources.memory",
                ),
                cel(
                    "!(self.metricsPort in [6379, 8000, 8080, 8265, 10001])",
                    "head.metricsPort must not be one of Ray's ports on the head pod (6379 GCS, 8000 Serve, 8080 "
                    "Ray's metrics, 8265 dashboard, 10001 client)",
                    fieldPath=".metricsPort",
                ),
                cel(
                    "quantity(self.submitter.memory).compareTo(quantity('256Mi')) >= 0",
                    "head.submitter.memory must be at least 256Mi: `ray job submit` is a Python process that imports "
                    "Ray (about 150 MiB resident)",
                    fieldPath=".submitter.memory",
                ),
            ]
        }
    )
    resources: HeadResources = sub(
        HeadResources,
        "CPU and memory of the Ray head pod, where the driver runs (GCS, dashboard, the driver process, the "
        "tokenizer; no GPU and no Ray actors: its Ray num-cpus is 0).",
    )
    metrics_port: int = Field(
        9095, ge=0, le=65535,
        description="Port of the runtime's Prometheus /metrics on the head pod, where the driver runs (the gauges "
        "of the last step: tokens/s, stage seconds, reward, MFU, mismatch, loss, KL, entropy, ...; labels job and "
        "namespace), as the container port named rlhf-metrics (the chart's PodMonitor scrapes it). Must not be one "
        "of Ray's ports on the head (6379, 8000, 8080, 8265, 10001). 0: not served.",
    )
    submitter: SubmitterResources = sub(
        SubmitterResources,
        "CPU and memory of the pod in which KubeRay runs `ray job submit` (a Python process that imports Ray "
        "and follows the job's logs); KubeRay's own default asks 500m CPU.",
    )


# ------------------------------------------------------------------------------------------- algorithm
class PPO(Model):
    gamma: float = Field(1.0, ge=0, le=1, description="Discount of future token rewards in GAE.")
    lambda_: float = Field(0.95, alias="lambda", ge=0, le=1, description="GAE lambda (bias/variance trade-off).")
    value_clip: float = Field(
        0.2, ge=0, le=100, description="Clip of the critic's value change per update (PPO value clipping); 0 disables it."
    )
    critic_learning_rate: float = Field(1e-5, gt=0, le=1, description="Learning rate of the critic.")
    whiten_advantages: bool = Field(True, description="Normalise GAE advantages over the batch's completion tokens.")


ALGORITHM_NAMES = ("grpo", "ppo", "rloo", "reinforce++")


class RolloutCorrection(Model):
    mode: Literal["none", "tis", "mis"] = Field(
        "tis",
        description="Importance weights for the gap between the engines' sampling and the trainer's log-"
        "probabilities of the same weights (different kernels, bfloat16, a sync in flight): w = pi_trainer / "
        "pi_engine per token (level token) or its product over a completion (level sequence), from the "
        "log-probabilities vLLM reports for each sampled token after temperature and top-p. tis: each token's "
        "policy-gradient term times min(w, cap) (truncated importance sampling). mis: times w where 1/cap <= w "
        "<= cap, else 0 (masked). none: no weights. Every step reports the mismatch either way "
        "(mismatch_kl: the mean of w - log w - 1).",
    )
    level: Literal["token", "sequence"] = Field(
        "token", description="token: a weight per token. sequence: one weight per completion (the product)."
    )
    cap: float = Field(2.0, gt=1, le=1000, description="The truncation (tis) or mask (mis) bound of the weight.")


class Algorithm(Model):
    model_config = ConfigDict(json_schema_extra={"x-kubernetes-validations": [
        cel("self.name == 'ppo' || !has(self.ppo)",
            "algorithm.ppo (GAE and critic settings) applies to algorithm.name 'ppo' only", fieldPath=".ppo"),
        cel("self.name != 'grpo' || self.klMode == 'loss'",
            "algorithm.klMode 'reward' applies to ppo, rloo and reinforce++: GRPO puts the KL penalty in the loss",
            fieldPath=".klMode"),
        cel("!has(self.clipRatioHigh) || self.clipRatioHigh >= self.clipRatio",
            "algorithm.clipRatioHigh must be at least algorithm.clipRatio (clip-higher widens the upper bound only)",
            fieldPath=".clipRatioHigh"),
    ]})
    name: Literal["grpo", "ppo", "rloo", "reinforce++"] = Field(
        "grpo",
        description="RL algorithm. grpo: advantages relative to the prompt's group (mean and std of its samples), "
        "no critic. rloo: leave-one-out baseline (each sample's reward minus the mean of the others of its prompt), "
        "no critic. reinforce++: REINFORCE with the batch's mean and std as baseline (OpenRLHF's REINFORCE++), no "
        "critic. ppo: a learned critic (spec.critic) and GAE advantages (algorithm.ppo).",
    )
    steps: int = Field(100, ge=1, le=10_000_000, description="Training steps (may be raised on a running job).")
    prompts_per_step: int = Field(32, ge=1, le=1_000_000, description="Prompts per step (each sampled samplesPerPrompt times).")
    learning_rate: float = Field(1e-6, gt=0, le=1, description="Learning rate.")
    kl_coef: float = Field(
        0.0, ge=0, description="KL penalty to the frozen reference policy (spec.reference); 0 disables the reference."
    )
    kl_mode: Literal["loss", "reward"] = Field(
        "loss",
        description="Where the KL penalty goes: loss (k3 estimator added to the policy loss, GRPO's form) or reward "
        "(k1 estimator subtracted from each token's reward before advantages, PPO's and REINFORCE++'s form).",
    )
    clip_ratio: float = Field(0.2, gt=0, le=10, description="PPO-style ratio clip epsilon (lower bound 1 - clipRatio).")
    clip_ratio_high: float | None = Field(
        None, gt=0, le=10,
        description="Upper clip epsilon (\"clip-higher\", DAPO): the ratio is clipped to [1 - clipRatio, "
        "1 + clipRatioHigh]. Unset: clipRatio.",
    )
    loss_aggregation: Literal["token", "sequence"] = Field(
        "token",
        description="token: the loss is the mean over all completion tokens of the batch (long answers weigh "
        "more). sequence: the mean over each completion's tokens, then over completions.",
    )
    epochs_per_step: int = Field(1, ge=1, le=64, description="Optimiser passes over each rollout batch.")
    rollout_correction: RolloutCorrection = sub(
        RolloutCorrection, "Correction for the training-inference mismatch (importance weights of the trainer's "
        "over the engines' sampling probabilities)."
    )
    seed: int = Field(0, ge=0, le=INT32_MAX, description="Seed for data order, sampling and init.")
    ppo: PPO | None = Field(None, description="PPO settings (algorithm.name 'ppo'); unset: their defaults.")

    def ppo_settings(self) -> PPO:
        return self.ppo or PPO()

    def clip_high(self) -> float:
        return self.clip_ratio if self.clip_ratio_high is None else self.clip_ratio_high
