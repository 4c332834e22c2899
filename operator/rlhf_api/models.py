"""Typed models of the RLHFJob API (group ``rlhf.dev``, version ``v1alpha1``).

These classes are the single source of truth for three things:

* the CRD schema (``rlhf_api.crdgen`` renders ``crds/rlhf.dev_rlhfjobs.yaml`` from them, with the CEL rules
  declared here, so admission and Python agree);
* the operator's view of a job (``RLHFJobSpec.model_validate(body["spec"])``);
* the contract with the in-pod runtime (``RuntimeConfig``, written by the operator into a ConfigMap and read
  by the Ray driver). No second schema exists.

Field names are snake_case in Python and camelCase on the wire (``by_alias=True``). This module imports only
pydantic: the operator and the runtime both depend on it, neither drags the other in.
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field, ValidationError

from rlhf_api.base import (
    CPU_PATTERN,
    INT32_MAX,
    LABEL_KEY_PATTERN,
    LABEL_VALUE_PATTERN,
    MEMORY_PATTERN,
    Model,
    cel,
    sub,
)
from rlhf_api.environment import AgentStatus, Environment

GROUP = "rlhf.dev"
VERSION = "v1alpha1"
KIND = "RLHFJob"
PLURAL = "rlhfjobs"
SINGULAR = "rlhfjob"
SHORT_NAMES = ["rlhf"]
API_VERSION = f"{GROUP}/{VERSION}"

#: Longest RLHFJob name: children append suffixes and KubeRay appends more (cluster, group, pod hash).
MAX_NAME_LENGTH = 40


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


# --------------------------------------------------------------------------------------------- rollout
class Sampling(Model):
    temperature: float = Field(1.0, ge=0, le=10, description="Sampling temperature for rollouts; 0 = greedy.")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling threshold.")
    max_tokens: int = Field(256, ge=1, le=1_048_576, description="Maximum generated tokens per sample.")
    samples_per_prompt: int = Field(
        8, ge=1, le=1024, description="Samples per prompt; GRPO computes advantages within each group."
    )


class Rollout(Model):
    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                cel(
                    "!self.expertParallel || self.engines * self.tensorParallelSize >= 2",
                    "rollout.expertParallel needs at least 2 engine GPUs (engines x tensorParallelSize) to shard "
                    "the experts over",
                    fieldPath=".expertParallel",
                ),
            ]
        }
    )
    engines: int = Field(1, ge=1, le=1024, description="vLLM engines (data parallel size, DP).")
    tensor_parallel_size: int = Field(
        1, ge=1, le=64, description="GPUs per engine (tensor parallel size, TP); an engine's GPUs share a node."
    )
    gpu_memory_utilization: float = Field(
        0.6, gt=0, le=1, description="Fraction of GPU memory vLLM may use (in colocated mode the trainer has the rest)."
    )
    max_model_len: int | None = Field(None, ge=16, description="vLLM max_model_len (prompt + generation).")
    kv_cache_memory_gib: float | None = Field(
        None,
        alias="kvCacheMemoryGiB",
        gt=0,
        le=4096,
        description="KV cache per engine GPU in GiB (vLLM's kv_cache_memory_bytes) instead of what "
        "gpuMemoryUtilization leaves once the engine has profiled its GPU. Colocated on GPUs this lets the "
        "engines start beside the trainers rather than after them (a shorter start: they no longer wait to see "
        "the memory the trainer leaves); the trainer, the engine's weights, its activations and this cache must "
        "then fit each GPU. vLLM still checks at its start that gpuMemoryUtilization of the GPU is free.",
    )
    enforce_eager: bool = Field(False, description="Disable CUDA graphs (faster start, slower decode).")
    expert_parallel: bool = Field(
        False,
        description="MoE models: the engines form one vLLM data-parallel group with expert parallelism (EP size = "
        "engines x tensorParallelSize); each engine GPU holds its share of the experts and all engines step "
        "together. Dense models: leave false (engines are independent replicas).",
    )
    async_engine: Literal["asyncllm", "stepped"] = Field(
        "asyncllm",
        description="weightSync.mode async only: the engine that can pause requests mid-generation. asyncllm: "
        "vLLM's AsyncLLM (engine core in a subprocess). stepped: a vLLM LLM in the engine actor's own process, "
        "stepped by the runtime (for machines where AsyncLLM's subprocess cannot start; no vLLM data "
        "parallelism).",
    )
    sampling: Sampling = sub(Sampling, "Sampling parameters for rollouts.")
    resources: Resources = sub(Resources, "CPU and memory per engine pod (separate placement).")


# ------------------------------------------------------------------------------------------- placement
class Placement(Model):
    mode: Literal["separate", "colocated"] = Field(
        "separate",
        description="separate: trainers and engines on different GPUs, weights move over NCCL. colocated: "
        "trainer and engine share each GPU (sleep/wake), weights move over CUDA IPC.",
    )
    gpus_per_node: int = Field(
        8, ge=1, le=64, description="GPUs per node in the target pool; a pod never asks for more than this."
    )
    colocated_sleep: bool = Field(
        True,
        description="colocated: engines sleep while the trainer trains (vLLM sleep mode frees their weights and KV "
        "cache; woken before the next sync). false keeps them resident: no wake-up in the sync and no CuMem "
        "allocator, but the trainer (weights, gradients, optimiser state, activations) must fit beside "
        "rollout.gpuMemoryUtilization of each GPU.",
    )
    gpu_product: str | None = Field(
        None,
        max_length=63,
        pattern=LABEL_VALUE_PATTERN,
        description="If set, pods select nodes labelled nvidia.com/gpu.product=<value> (the GPU model name as "
        "NVIDIA's GPU feature discovery labels it).",
    )


class WeightSync(Model):
    backend: Literal["nccl", "ipc"] = Field(
        "nccl", description="nccl (separate placement) or ipc (colocated placement, CUDA IPC handles)."
    )
    packed: bool | None = Field(
        None, description="Send weights packed into reused buffers (true) or tensor by tensor (false). With nccl in "
        "the kernel format, false broadcasts each tensor straight into the engines' parameters, the tensors of "
        "each bucketSizeMB in one NCCL group: no packing or unpacking copies on either side, no staging buffer. "
        "Unset: false for nccl in the kernel format from a trainer of one GPU into engines of tensorParallelSize 1 "
        "(the faster of the two there), true elsewhere.")
    bucket_size_mb: int = Field(
        1024, alias="bucketSizeMB", ge=1, le=65536,
        description="Packed buffer size in MiB: weights go to the engines in chunks of this size, through such a "
        "buffer on the trainer's GPU. Unused by ipc from one trainer GPU in the kernel format on vLLM 0.28+ (the "
        "engines map the trainer's parameters: no buffer, no chunks). Elsewhere with ipc each chunk is one more "
        "call to the engines: at least the model's size in its dtype sends it in one chunk, for that much "
        "trainer GPU memory.",
    )
    every_n_steps: int = Field(1, ge=1, le=100000, description="Sync weights to the engines every N trainer steps.")
    mode: Literal["sync", "async"] = Field(
        "sync",
        description="sync: generation stops between steps. async: the next rollout runs while training, "
        "generation is paused mid-request for the swap and resumed (tokens before/after are recorded).",
    )
    timeout_seconds: int = Field(
        600, ge=5, le=24 * 3600,
        description="Deadline of one weight sync and of every other call between the driver and its Ray actors "
        "(trainer steps and rollouts excepted: spec.progressDeadlineSeconds bounds those). A sync whose peer "
        "never joins, or a hung NCCL/gloo collective, fails the run within it with a message naming the call.",
    )
    validate_: bool = Field(
        False,
        alias="validate",
        description="Check the weight sync once, after the first sync: every engine's greedy tokens for the first "
        "8 prompts must equal, token for token, those of a fresh engine of the same shape loaded from the "
        "trainer's weights, else the job fails ('weight-sync validation failed'). Costs one full copy of the "
        "weights moved through Ray's object store to each validation engine's node and written to its local "
        "temporary directory (removed afterwards), and the start of a fresh engine: minutes for large models.",
    )
    format: Literal["auto", "checkpoint", "kernel"] = Field(
        "auto",
        description="Layout of the weights sent. checkpoint: Hugging Face names and shapes, loaded by vLLM's "
        "layerwise reload (any engine layout, any supported vLLM). kernel: the engines' own fused parameters "
        "(e.g. qkv_proj), copied in place: faster, but only with the nccl or ipc backend on GPU engines (nccl "
        "into tensorParallelSize > 1: one broadcast carries every TP rank's pieces and each worker copies its "
        "own; ipc into TP > 1: each engine worker colocated with a trainer GPU, which sends that worker's "
        "shard); elsewhere the job fails when its weight-sync group is set up, naming the reason. auto: "
        "kernel where it applies and was validated on GPUs (vLLM 0.33: engines over nccl, tensor-parallel "
        "ones too, or over ipc from one trainer GPU, and ipc from several trainer GPUs, e.g. FSDP2 with DP, "
        "expert-parallel or tensor-parallel engines, each trainer GPU sending the shard of the engine worker "
        "beside it), else checkpoint. ipc from one trainer GPU in the kernel format: each engine maps the "
        "trainer's parameters once and a sync is one device copy into its own.",
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


# ------------------------------------------------------------------------------------------ data/reward
class ConfigMapKey(Model):
    name: str = Field(min_length=1, max_length=253, description="ConfigMap name (same namespace).")
    key: str = Field("prompts.jsonl", min_length=1, max_length=253, description="Key holding the prompts.")


#: ``data.path``: an absolute path, or an object-store URI (``s3://bucket/key``; ``gs://``).
DATA_PATH = r"^(/|(s3|gs)://[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]/[^\s]+$)"


class Data(Model):
    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                cel(
                    "(has(self.prompts) ? 1 : 0) + (has(self.configMap) ? 1 : 0) + (has(self.path) ? 1 : 0) == 1",
                    "data needs exactly one of prompts, configMap or path",
                )
            ]
        }
    )
    prompts: list[str] | None = Field(
        None, min_length=1, max_length=10000, description="Inline prompts (for small jobs and tests)."
    )
    config_map: ConfigMapKey | None = Field(
        None, description="Prompts from a ConfigMap key: JSON lines with a 'prompt' string or chat 'messages' "
        "([{role, content}], rendered with the tokenizer's chat template), or plain lines."
    )
    path: str | None = Field(
        None, pattern=DATA_PATH, max_length=4096,
        description="Absolute path on a mounted volume (or an object-store URI, s3://bucket/key, downloaded to the "
        "head pod first with the job's storage: checkpoint.storage or output.storage) of: a prompts file (JSON "
        "lines or text, as for configMap; a "
        "Parquet file; an Arrow file), a folder of Parquet files (e.g. a hub dataset's data/ folder) or a folder "
        "written by Hugging Face datasets' save_to_disk (one split). Read in record batches into a memory-mapped "
        "cache on the head pod's disk: memory is bounded by a batch, not by the file.",
    )
    prompt_field: str = Field(
        "prompt", min_length=1, max_length=256,
        description="Field (JSON lines) or column (Parquet, Arrow) with the prompt text. A 'messages' field or "
        "column (chat conversations) is used instead where a sample has one.")
    answer_field: str = Field("answer", min_length=1, max_length=256,
                              description="Field or column with the reference answer, if any.")
    invalid_samples: Literal["drop", "fail"] = Field(
        "drop",
        description="Before the first step every sample is checked against what the run can take: its rendered "
        "prompt plus rollout.sampling.maxTokens within the engines' context (rollout.maxModelLen, else the model's), "
        "and an answer where spec.reward needs one (exactMatch, contains, math without reward.target). drop: such "
        "samples are left out, counted in status.data with the first lines named (and a Warning Event); fail: the "
        "job fails before training, naming them. Malformed files fail either way.")
    eval: EvalData | None = Field(
        None, description="A held-out eval set: every evalEveryNSteps steps each of its prompts is answered greedily "
        "(one sample, temperature 0) by the synced engines and scored by spec.reward; the mean is status.eval.")
    eval_every_n_steps: int = Field(10, ge=1, le=1_000_000, description="Evaluate every N training steps (and "
                                    "after the last).")


class EvalData(Model):
    model_config = ConfigDict(json_schema_extra={"x-kubernetes-validations": [cel(
        "(has(self.prompts) ? 1 : 0) + (has(self.configMap) ? 1 : 0) + (has(self.path) ? 1 : 0) == 1",
        "data.eval needs exactly one of prompts, configMap or path")]})
    prompts: list[str] | None = Field(None, min_length=1, max_length=10000, description="Inline eval prompts.")
    config_map: ConfigMapKey | None = Field(
        None, description="Eval prompts from a ConfigMap key (same formats as data.configMap; mount as for it).")
    path: str | None = Field(None, pattern=DATA_PATH, max_length=4096,
                             description="Absolute path of an eval file (or s3://bucket/key, as for data.path).")
    max_prompts: int = Field(64, ge=1, le=100_000, description="Use at most the first N eval prompts (file order).")


class RolePlacement(Model):
    """Where a model of its own (reward model, critic, reference) runs."""

    placement: Literal["colocated", "separate"] = Field(
        "colocated",
        description="colocated: on the trainer's GPUs (an actor beside each trainer worker shares its GPU). "
        "separate: a worker group of its own (replicas pods x gpusPerReplica GPUs).",
    )
    replicas: int = Field(1, ge=1, le=512, description="separate: pods of this role.")
    gpus_per_replica: int = Field(
        1, ge=0, le=16,
        description="separate: GPUs per pod, one worker per GPU. Ignored (0) for a CPU-only job "
        "(trainer.gpusPerReplica 0).",
    )
    resources: Resources = sub(Resources, "separate: CPU and memory per pod of this role.")


class RewardModel(RolePlacement):
    name: str = Field(
        min_length=1, max_length=512,
        description="A Hugging Face sequence-classification model with one label (its logit is the score; "
        "e.g. a reward model trained on preferences), as a hub id or an absolute path inside the pods. It scores "
        "the prompt followed by the completion.",
    )
    revision: str | None = Field(None, max_length=128, description="Hub revision (branch, tag or commit).")
    placement: Literal["colocated", "separate"] = Field(
        "separate",
        description="separate (default): a worker group of its own (replicas pods x gpusPerReplica GPUs, one "
        "scoring worker per GPU). colocated: one scoring worker beside each trainer worker, on its GPU.",
    )
    weight: float = Field(1.0, ge=-1000, le=1000, description="Weight of this source in the combined reward.")
    batch_size: int = Field(16, ge=1, le=4096, description="Samples scored per forward pass.")


class RewardEndpoint(Model):
    url: str = Field(
        pattern=r"^https?://\S+$", max_length=2048,
        description="HTTP(S) endpoint. It receives POST {\"prompts\": [...], \"completions\": [...], \"answers\": "
        "[... or null]} (JSON) and answers {\"rewards\": [one number per completion]}.",
    )
    timeout_seconds: float = Field(30, gt=0, le=3600, description="Deadline of one request.")
    retries: int = Field(3, ge=0, le=100, description="Retries of a failed or timed-out request (with backoff).")
    batch_size: int = Field(64, ge=1, le=65536, description="Completions per request.")
    weight: float = Field(1.0, ge=-1000, le=1000, description="Weight of this source in the combined reward.")


class Reward(Model):
    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                cel("!has(self.rule) || !has(self.function)",
                    "reward takes rule or function, not both (use model or endpoint to combine sources)"),
                cel(
                    "!has(self.rule) || self.rule != 'regex' || has(self.pattern)",
                    "reward.rule 'regex' needs reward.pattern",
                ),
                cel(
                    "!has(self.rule) || self.rule != 'exactMatch' || has(self.target)",
                    "reward.rule 'exactMatch' needs reward.target (or answers in the data)",
                ),
            ]
        }
    )
    rule: Literal["exactMatch", "contains", "regex", "length", "math"] | None = Field(
        None,
        description="Built-in rule: exactMatch/contains compare with target (or the sample's answer), regex "
        "matches pattern, length rewards closeness to targetLength tokens, math scores 1 when the completion's "
        "final answer is mathematically equal to the sample's answer (or target) by Hugging Face's math-verify "
        "(LaTeX and \\boxed{} answers, 1/2 = 0.5 = \\frac{1}{2}, percentages as fractions, sets and intervals), else 0.",
    )
    target: str | None = Field(None, max_length=65536, description="Target text for exactMatch/contains.")
    pattern: str | None = Field(None, max_length=4096, description="Regular expression for the regex rule.")
    target_length: int = Field(64, ge=1, description="Target completion length in tokens for the length rule.")
    math_timeout_seconds: int = Field(
        5, ge=1, le=60,
        description="Time limit of one math rule check (parsing and comparison, in a worker process): past it the "
        "sample scores 0 with a warning, so a pathological answer cannot stall a step.",
    )
    function: str | None = Field(
        None,
        pattern=r"^[A-Za-z_][A-Za-z0-9_.]*:[A-Za-z_][A-Za-z0-9_]*$",
        description="User hook 'module:function' importable in the runtime image; called as "
        "fn(prompt: str, completion: str, answer: str | None) -> float.",
    )
    rule_weight: float = Field(
        1.0, ge=-1000, le=1000, description="Weight of rule or function in the combined reward."
    )
    model: RewardModel | None = Field(None, description="A reward model on GPUs (its own worker group or colocated).")
    endpoint: RewardEndpoint | None = Field(None, description="A remote reward service over HTTP.")
    normalize: Literal["none", "batch"] = Field(
        "none",
        description="none: the combined reward as is. batch: standardised over the step's samples (mean 0, std 1) "
        "before advantages; status.throughput.rewardMean stays the raw mean.",
    )

    def sources(self) -> list[str]:
        return [n for n, present in (("rule", self.rule or self.function), ("model", self.model),
                                     ("endpoint", self.endpoint)) if present]


class Critic(RolePlacement):
    model: str | None = Field(
        None, min_length=1, max_length=512,
        description="Model the critic starts from (hub id or absolute path); its language-model head is replaced by "
        "a value head. Unset: the policy's spec.model.name.",
    )


class Reference(RolePlacement):
    placement: Literal["trainer", "colocated", "separate"] = Field(
        "trainer",
        description="Where the frozen reference policy (loaded only when algorithm.klCoef > 0) computes its "
        "log-probabilities. trainer: inside each trainer worker (no extra actor; with trainer.strategy fsdp2 "
        "sharded over the trainer GPUs like the policy). colocated: an actor of its own "
        "beside each trainer worker, on its GPU. separate: a worker group of its own.",
    )


OBJECT_URI = r"^(s3|gs)://[a-z0-9][a-z0-9.-]{1,61}[a-z0-9](/[^\s]*)?$"


class ObjectStorage(Model):
    endpoint: str | None = Field(
        None, pattern=r"^https?://", max_length=2048,
        description="The S3 API endpoint of an S3-compatible server (e.g. http://seaweedfs.storage.svc:8333); "
        "rendered as AWS_ENDPOINT_URL_S3 into every head and worker container. Unset: AWS S3 (or GCS/Azure by "
        "the URI's scheme).",
    )
    region: str | None = Field(None, min_length=1, max_length=64, description="Region (AWS_REGION); unset: us-east-1.")
    credentials_secret: str | None = Field(
        None, min_length=1, max_length=253,
        description="A Secret whose keys become the environment of every head and worker container (the trainers "
        "write): AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (optionally AWS_SESSION_TOKEN); for gs:// "
        "GOOGLE_SERVICE_ACCOUNT_KEY. Unset: the pods' own identity.",
    )


def _location_rules(field: str) -> list[dict[str, str]]:
    """``spec.checkpoint`` / ``spec.output``: a volume path or an object-store URI, exactly one."""
    return [
        cel("has(self.uri) ? !has(self.volume) && !has(self.path) : has(self.volume) && has(self.path)",
            f"{field} needs either uri (object storage: s3://bucket/prefix) or volume and path, not both"),
        cel("!has(self.storage) || has(self.uri)", f"{field}.storage is only for a {field}.uri",
            fieldPath=".storage"),
    ]


class Output(Model):
    model_config = ConfigDict(json_schema_extra={"x-kubernetes-validations": _location_rules("output")})

    volume: str | None = Field(None, min_length=1, max_length=63, description="Name of a volume in spec.volumes.")
    path: str | None = Field(
        None, pattern=r"^/", max_length=4096,
        description="Directory inside the pods (mount the volume there) where the trained model is written in "
        "Hugging Face format (save_pretrained, safetensors, config, tokenizer): <path>/final at the end, "
        "<path>/step-<N> every everyNSteps steps if set. status.output names the newest.",
    )
    uri: str | None = Field(
        None, pattern=OBJECT_URI, max_length=2048,
        description="Object storage instead of volume and path: s3://bucket/prefix (or gs://bucket/prefix). The export is "
        "uploaded to <uri>/final (and <uri>/step-<N>), its _COMPLETE object last: a prefix without one is an "
        "export in progress or cut short.",
    )
    storage: ObjectStorage | None = Field(
        None, description="Endpoint and credentials of uri's object store (the same as checkpoint.storage when "
        "both are set).")
    every_n_steps: int | None = Field(None, ge=1, description="Also export every N steps (unset: only at the end).")

    @property
    def location(self) -> str:
        return self.uri or self.path or ""


class Checkpoint(Model):
    model_config = ConfigDict(json_schema_extra={"x-kubernetes-validations": _location_rules("checkpoint")})

    volume: str | None = Field(None, min_length=1, max_length=63, description="Name of a volume in spec.volumes.")
    path: str | None = Field(None, pattern=r"^/", max_length=4096,
                             description="Directory inside the pods (mount it there).")
    uri: str | None = Field(
        None, pattern=OBJECT_URI, max_length=2048,
        description="Object storage instead of volume and path: s3://bucket/prefix (or gs://bucket/prefix). Each step's "
        "files are uploaded first and a state.json marker last, so a save killed midway is no checkpoint; the job "
        "resumes from the newest step with a marker (every trainer rank downloads the one rank 0 found).",
    )
    storage: ObjectStorage | None = Field(None, description="Endpoint and credentials of uri's object store.")
    every_n_steps: int = Field(10, ge=1, description="Save every N steps; a restarted job resumes from the newest.")

    @property
    def location(self) -> str:
        return self.uri or self.path or ""


# -------------------------------------------------------------------------------------------- tracking
class SecretKeySelector(Model):
    name: str = Field(min_length=1, max_length=253, description="Secret name (same namespace).")
    key: str = Field(min_length=1, max_length=253, description="Key within it.")


class TensorBoardTracking(Model):
    volume: str = Field(min_length=1, max_length=63, description="Name of a volume in spec.volumes, mounted on the "
                        "head pod (spec.volumeMounts) at path or above it.")
    path: str = Field(
        pattern=r"^/", max_length=4096,
        description="Directory inside the pods: the driver writes TensorBoard event files to <path>/<job name>, so "
        "several jobs on one volume are runs of one TensorBoard (tensorboard --logdir <path>). A retried run "
        "continues the same directory; steps after its checkpoint are dropped from the earlier run's curves.",
    )


class MLflowTracking(Model):
    tracking_uri: str = Field(
        pattern=r"^https?://", max_length=2048,
        description="The MLflow tracking server (http:// or https://), e.g. http://mlflow.mlops.svc:5000.",
    )
    experiment: str | None = Field(
        None, min_length=1, max_length=500,
        description="Experiment name (created when missing). Unset: the job's namespace.",
    )
    credentials_secret: str | None = Field(
        None, min_length=1, max_length=253,
        description="A Secret whose keys become the head pod's environment, where the driver runs: "
        "MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD, or MLFLOW_TRACKING_TOKEN (and e.g. AWS_* for an "
        "artifact store the client writes to directly). Only the head pod gets it.",
    )


class WandbTracking(Model):
    model_config = ConfigDict(json_schema_extra={"x-kubernetes-validations": [
        cel("self.mode == 'offline' || has(self.apiKeySecret)",
            "tracking.wandb.apiKeySecret is needed unless mode is offline", fieldPath=".apiKeySecret"),
        cel("self.mode != 'offline' || (has(self.volume) && has(self.path))",
            "tracking.wandb with mode offline needs volume and path: the run files would be lost with the pod",
            fieldPath=".path"),
        cel("has(self.volume) == has(self.path)", "tracking.wandb.volume and path go together", fieldPath=".path"),
    ]})
    project: str = Field(min_length=1, max_length=128, description="W&B project.")
    entity: str | None = Field(None, min_length=1, max_length=128, description="W&B entity (team or user).")
    group: str | None = Field(None, min_length=1, max_length=128, description="W&B run group.")
    mode: Literal["online", "offline"] = Field(
        "online", description="online: sync to the server as the run goes. offline: write the run files to "
        "<path>/wandb only (upload them later with wandb sync).")
    api_key_secret: SecretKeySelector | None = Field(
        None, description="The Secret key holding the W&B API key (WANDB_API_KEY of the head pod only).")
    base_url: str | None = Field(None, pattern=r"^https?://", max_length=2048,
                                 description="A self-hosted W&B server (WANDB_BASE_URL). Unset: W&B's cloud.")
    volume: str | None = Field(None, min_length=1, max_length=63,
                               description="A volume in spec.volumes for the run files (needed with mode offline).")
    path: str | None = Field(None, pattern=r"^/", max_length=4096,
                             description="Directory inside the pods for the run files (<path>/wandb/...).")


class Tracking(Model):
    model_config = ConfigDict(json_schema_extra={"x-kubernetes-validations": [
        cel("has(self.tensorboard) || has(self.mlflow) || has(self.wandb)",
            "tracking needs at least one of tensorboard, mlflow or wandb"),
    ]})
    tensorboard: TensorBoardTracking | None = Field(None, description="TensorBoard event files on a volume.")
    mlflow: MLflowTracking | None = Field(None, description="An MLflow tracking server.")
    wandb: WandbTracking | None = Field(None, description="Weights & Biases.")
    samples_every_n_steps: int = Field(
        10, ge=0, le=1_000_000,
        description="Every N steps also log a table of a few prompts, completions and rewards (0: never).")
    samples: int = Field(4, ge=1, le=256, description="Rows in each sample table.")


# ------------------------------------------------------------------------------------------ scheduling
class Toleration(Model):
    model_config = ConfigDict(json_schema_extra={"x-kubernetes-validations": [
        cel("has(self.key) || (has(self.operator) && self.operator == 'Exists')",
            "a toleration without a key must have operator Exists (it then tolerates every taint)"),
        cel("!has(self.operator) || self.operator != 'Exists' || !has(self.value) || self.value == ''",
            "a toleration with operator Exists must not have a value", fieldPath=".value"),
    ]})
    key: str | None = Field(None, description="Taint key.")
    operator: Literal["Exists", "Equal"] | None = Field(None, description="Exists or Equal.")
    value: str | None = Field(None, description="Taint value.")
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = Field(None, description="Taint effect.")
    toleration_seconds: int | None = Field(None, description="For NoExecute: how long to stay bound.")


class Scheduling(Model):
    node_selector: dict[str, Annotated[str, Field(max_length=63, pattern=LABEL_VALUE_PATTERN)]] | None = Field(
        None,
        description="Node labels every pod of the job requires.",
        json_schema_extra={"maxProperties": 64, "x-kubernetes-validations": [cel(
            "self.all(k, size(k) <= 316 && k.matches('" + LABEL_KEY_PATTERN.replace("\\", "\\\\") + "'))",
            "scheduling.nodeSelector keys must be label keys ([prefix/]name, name at most 63 characters of "
            "letters, digits, '-', '_', '.')")]},
    )
    tolerations: list[Toleration] | None = Field(None, max_length=64, description="Tolerations for every pod.")
    priority_class_name: str | None = Field(None, max_length=253, description="PriorityClass for every pod.")
    queue_name: str | None = Field(
        None, max_length=63, pattern=LABEL_VALUE_PATTERN,
        description="Kueue LocalQueue: the RayJob is created suspended with label kueue.x-k8s.io/queue-name and runs "
        "when Kueue admits it (phase Pending, reason Queued, until then; Suspended, reason Preempted, if Kueue "
        "preempts it later, until it is admitted again).",
    )


class KeyRef(Model):
    name: str = Field(min_length=1, max_length=253, description="Secret or ConfigMap name (same namespace).")
    key: str = Field(min_length=1, max_length=253, description="Key within it.")
    optional: bool = Field(False, description="Start the pods even if it is missing.")


class EnvVarSource(Model):
    model_config = ConfigDict(json_schema_extra={"x-kubernetes-validations": [cel(
        "has(self.secretKeyRef) != has(self.configMapKeyRef)",
        "env[].valueFrom needs exactly one of secretKeyRef or configMapKeyRef")]})
    secret_key_ref: KeyRef | None = Field(
        None, description="A key of a Secret (e.g. HF_TOKEN for a gated model): the kubelet sets it in every "
        "container; the operator and the runtime never read the value.")
    config_map_key_ref: KeyRef | None = Field(None, description="A key of a ConfigMap.")


class EnvVar(Model):
    model_config = ConfigDict(json_schema_extra={"x-kubernetes-validations": [cel(
        "!has(self.valueFrom) || !has(self.value) || self.value == ''",
        "env[].value and env[].valueFrom are exclusive", fieldPath=".valueFrom")]})
    name: str = Field(pattern=r"^[A-Za-z_][A-Za-z0-9_.-]*$", max_length=256, description="Variable name.")
    value: str = Field("", description="Literal value.")
    value_from: EnvVarSource | None = Field(None, description="Take the value from a Secret or ConfigMap key.")


class NameRef(Model):
    name: str = Field(min_length=1, max_length=253, description="Secret or ConfigMap name (same namespace).")
    optional: bool = Field(False, description="Start the pods even if it is missing.")


class EnvFromSource(Model):
    model_config = ConfigDict(json_schema_extra={"x-kubernetes-validations": [cel(
        "has(self.secretRef) != has(self.configMapRef)", "envFrom[] needs exactly one of secretRef or configMapRef")]})
    prefix: str | None = Field(None, max_length=256, pattern=r"^[A-Za-z_][A-Za-z0-9_.-]*$",
                               description="Prefix for every variable name.")
    secret_ref: NameRef | None = Field(None, description="Every key of a Secret as a variable.")
    config_map_ref: NameRef | None = Field(None, description="Every key of a ConfigMap as a variable.")


class VolumeMount(Model):
    name: str = Field(max_length=63, description="Volume name (from spec.volumes).")
    mount_path: str = Field(pattern=r"^/", description="Where to mount it in every container.")
    read_only: bool = Field(False, description="Mount read-only.")
    sub_path: str | None = Field(None, description="Sub-path of the volume.")


VOLUME_SCHEMA = {
    "type": "object",
    "x-kubernetes-preserve-unknown-fields": True,
    "required": ["name"],
    "properties": {"name": {"type": "string", "maxLength": 63, "description": "Volume name."}},
    "description": "A core/v1 Volume (e.g. persistentVolumeClaim, hostPath, nfs), added to every pod.",
}


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
        "!has(self.environment) || self.weightSync.mode == 'sync'",
        "spec.environment runs with weightSync.mode 'sync' (multi-turn rollouts across an async weight swap are "
        "not supported yet)",
        fieldPath=".weightSync.mode",
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
        "some out).",
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
    memory: MemoryStatus | None = Field(
        None, description="The colocated layout's memory plan per GPU, checked before the engines were built.")
    tracking: TrackingStatus | None = Field(None, description="Where the run's metrics go (spec.tracking).")
    data: DataStatus | None = Field(None, description="The training data as checked before the first step.")
    start_time: datetime | None = Field(None, description="When the job started running.")
    completion_time: datetime | None = Field(None, description="When the job finished.")


# ------------------------------------------------------------------------------ operator <-> runtime
#: Spec fields only the operator reads (pod sizes): left out of the runtime's job.json.
OPERATOR_ONLY_FIELDS: tuple[tuple[str, ...], ...] = (("head",), ("backoffLimit",), ("ttlSecondsAfterFinished",),
                                                     ("activeDeadlineSeconds",), ("envFrom",))
#: Spec fields added after runtime 0.1.0, with their defaults. Runtimes up to 0.1.0 refuse a job.json with a key
#: they do not know, so the operator leaves these out while they hold their default: an older runtime image
#: then runs every job that does not ask for the newer feature.
ADDED_AFTER_0_1: tuple[tuple[tuple[str, ...], Any], ...] = (
    (("weightSync", "validate"), False),
    (("weightSync", "timeoutSeconds"), 600),
    (("progressDeadlineSeconds",), 1800),
    (("inRunRecoveries",), 3),
    (("algorithm", "klMode"), "loss"),
    (("algorithm", "lossAggregation"), "token"),
    (("data", "evalEveryNSteps"), 10),
    (("reward", "ruleWeight"), 1.0),
    (("reward", "normalize"), "none"),
    (("reference",), Reference().wire()),
    (("weightSync", "format"), "auto"),
    (("rollout", "asyncEngine"), "asyncllm"),
    (("trainer", "masterWeights"), "float32"),
    (("algorithm", "rolloutCorrection"), RolloutCorrection().wire()),
    (("trainer", "maxTokensPerMicroBatch"), 16384),
    (("trainer", "compile"), False),
    (("trainer", "reshardAfterForward"), True),
    (("trainer", "autocast"), False),
    (("reward", "mathTimeoutSeconds"), 5),
    (("data", "promptField"), "prompt"),
    (("data", "invalidSamples"), "drop"),
    (("trainer", "offloadDuringRollout"), "auto"),
)


class RuntimeConfig(Model):
    """The job configuration the operator hands to the runtime (ConfigMap key ``job.json``).

    Compatibility: the operator may be newer than the runtime image (``spec.image``). ``to_runtime_json`` leaves
    out operator-only fields and newer fields at their default; ``from_runtime_json`` (the runtime's reader)
    ignores keys it does not know instead of refusing the job, and names them."""

    api_version: str = Field(API_VERSION, description="API version of the spec below.")
    name: str = Field(description="RLHFJob name.")
    namespace: str = Field(description="RLHFJob namespace.")
    uid: str | None = Field(None, description="RLHFJob uid; reports for another uid are refused.")
    spec: RLHFJobSpec

    def to_runtime_json(self) -> dict[str, Any]:
        """The wire form for job.json (see the class docstring)."""
        out = self.wire()
        spec = out["spec"]
        for path in OPERATOR_ONLY_FIELDS:
            _pop(spec, path)
        for path, default in ADDED_AFTER_0_1:
            if _get(spec, path, default) == default:
                _pop(spec, path)
        return out

    @classmethod
    def from_runtime_json(cls, text: str | bytes) -> tuple[RuntimeConfig, list[str]]:
        """Parse job.json, ignoring keys this version does not know (written by a newer operator); returns the
        config and the dotted paths of the ignored keys. Every other error is raised as usual."""
        data = json.loads(text)
        ignored: list[str] = []
        while True:
            try:
                return cls.model_validate(data), ignored
            except ValidationError as e:
                errors = e.errors()
                if not errors or any(err["type"] != "extra_forbidden" for err in errors):
                    raise
                for err in errors:
                    _pop(data, tuple(err["loc"]))
                    ignored.append(".".join(str(p) for p in err["loc"]))


def _get(d: Any, path: tuple[Any, ...], default: Any) -> Any:
    for key in path:
        if not isinstance(d, (dict, list)):
            return default
        try:
            d = d[key]
        except (KeyError, IndexError, TypeError):
            return default
    return d


def _pop(d: Any, path: tuple[Any, ...]) -> None:
    parent = _get(d, path[:-1], None)
    if isinstance(parent, dict):
        parent.pop(path[-1], None)


#: Spec fields that may change on a submitted job (wire paths). Each is applied where it matters: ``suspend``,
#: ``activeDeadlineSeconds``, ``ttlSecondsAfterFinished`` and ``backoffLimit`` are patched into the RayJob;
#: ``algorithm.steps`` and ``progressDeadlineSeconds`` are read by the running driver from its RLHFJob. Every other
#: change is refused at admission (``edit_rules``): the Ray cluster, the runtime's config and the pods were made
#: from it and would silently keep the old value.
MUTABLE_FIELDS = ("suspend", "algorithm.steps", "progressDeadlineSeconds", "activeDeadlineSeconds",
                  "ttlSecondsAfterFinished", "backoffLimit")


def edit_rules() -> list[dict[str, str]]:
    """CEL transition rules (spec level): one per field outside ``MUTABLE_FIELDS``, with a message naming it."""
    allowed = ", ".join(f"spec.{f}" for f in MUTABLE_FIELDS)
    rules = []

    def rule(path: str, optional: bool) -> None:
        same = f"self.{path} == oldSelf.{path}"
        expr = f"has(self.{path}) == has(oldSelf.{path}) && (!has(self.{path}) || {same})" if optional else same
        rules.append(cel(expr, f"spec.{path} cannot change on a submitted job (only {allowed} can): delete the "
                         "RLHFJob and create a new one to change it", fieldPath=f".{path}"))

    for name, f in RLHFJobSpec.model_fields.items():
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


SPEC_RULES.extend(edit_rules())  # the class's schema extra holds this list: rules over its own fields
RLHFJobSpec.model_rebuild()
