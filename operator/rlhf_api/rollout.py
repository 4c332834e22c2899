"""The RLHFJob spec's rollout parts: sampling, the vLLM engines, their placement beside the trainer and the
weight sync from trainer to engines. Imports only pydantic."""

from __future__ import annotations

from typing import Literal

from pydantic import ConfigDict, Field

from rlhf_api.base import (
    LABEL_VALUE_PATTERN,
    Model,
    cel,
    sub,
)
from rlhf_api.training import Resources


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
    kv_cache_dtype: Literal["auto", "fp8"] = Field(
        "auto",
        description="The KV cache's element type (vLLM's kv_cache_dtype). auto: the model's dtype. fp8: 8-bit "
        "keys and values (e4m3 on CUDA, unscaled): half the cache bytes per token, so twice the sequences fit and a "
        "long decode reads half the attention bytes. The engine's log-probabilities then drift further from the "
        "trainer's; algorithm.rolloutCorrection weighs that drift and every step reports it (mismatch_kl).",
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
    max_staleness: int = Field(
        1, ge=0, le=64,
        description="Multi-turn rollouts (spec.environment) in mode async: the most steps a trained trajectory's "
        "oldest sampled token may lag the step that trains it (its staleness: that step minus the step of the "
        "weights that sampled the token). The rollout keeps the prompts of up to this many steps ahead of the "
        "engines' weights in flight; trajectories in flight at a sync go on with the new weights; a step trains "
        "the first promptsPerStep groups to finish and the rest carry over into the next step; a group past the "
        "bound is dropped whole and its prompt generated again. 0: no rollout ahead of the weights. Every "
        "trained trajectory's staleness is recorded (status.agent, the step's metrics). Default 1; at least "
        "everyNSteps - 1.",
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
