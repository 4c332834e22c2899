"""The memory plan of a colocated layout: what each GPU holds while the engines generate and while the trainer trains.

Pure arithmetic (no torch, vLLM or Ray), so the operator can use it as well as the runtime. From the model's shape
(``ModelShape``, read from its Hugging Face config), the job's spec and the GPU's size, ``plan`` computes, per GPU:

* **rollout** (engines awake): the trainer's resident state as it is after step 1 (the model, float32 master
  weights and AdamW moments: ``trainer_state``; gradients and activations are freed after every step), less what
  ``trainer.offloadDuringRollout`` moves to host memory, and the engine: vLLM's budget ``gpuMemoryUtilization`` x
  the GPU (its weights, its activations and the KV cache that fills the rest), or with
  ``rollout.kvCacheMemoryGiB`` its weights, activations and that cache;
* **training** (engines asleep, their weights and KV cache released): the trainer's state, its gradients and the
  activations of one micro-batch of ``trainer.maxTokensPerMicroBatch`` tokens (``activation_bytes``); with
  ``placement.colocatedSleep`` false the awake engine beside it;
* each process's CUDA context and workspaces (``TRAINER_PROCESS_BYTES``, ``ENGINE_PROCESS_BYTES``) and a margin for
  the allocators' fragmentation (``margin_bytes``).

The KV cache is sized for that steady state: a layout whose engine does not fit beside the trainer's state after
step 1 is refused (``MemoryPlan.check``) with the numbers and the field to change, the largest value that fits
included, before any engine is built. The runtime anchors the trainer's state on what the trainer measures
(``Measured``: its allocator holds the AdamW moments from the start, so the engine measures the steady state too)
and takes the larger of the two. ``trainer.offloadDuringRollout`` ``auto`` moves the state to host memory only
where the engine would not fit otherwise and the trainer pods' memory holds it.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any

from rlhf_api.models import RLHFJobSpec

GIB = 1 << 30
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
#: Float32 logits the trainer's output layer computes at once (``rlhf_runtime.roles.batches.LOGIT_CHUNK_ELEMENTS``).
LOGIT_CHUNK_ELEMENTS = 1 << 29
#: Bytes per logit of that chunk at the step's peak: the float32 logits, their softmax gradient and its cast.
LOGIT_PEAK_BYTES = 12
#: A trainer process's CUDA context, cuBLAS and attention workspaces and the allocator's slack.
TRAINER_PROCESS_BYTES = int(1.5 * GIB)
#: An engine process's CUDA context and what vLLM keeps outside its own budget (asleep: all it holds).
ENGINE_PROCESS_BYTES = int(0.75 * GIB)
#: An engine's captured CUDA graphs (rollout.enforceEager false), kept while it sleeps.
ENGINE_GRAPH_BYTES = int(0.5 * GIB)
#: vLLM's scheduler limits on a large GPU (sequences and tokens per forward pass) that set its activation peak.
ENGINE_MAX_SEQS = 1024
ENGINE_MAX_BATCHED_TOKENS = 16384
#: Host memory a trainer or engine process needs besides pinned state (interpreter, libraries, Ray).
HOST_PROCESS_BYTES = 4 * GIB


class MemoryPlanError(ValueError):
    """A layout that does not fit its GPUs (or its pods' memory): the message has the numbers and what to change."""


def gib(n: float) -> float:
    return round(n / GIB, 2)


# ------------------------------------------------------------------------------------------------ model
@dataclass(frozen=True)
class ModelShape:
    """What the plan needs of a decoder-only transformer (Llama / Qwen / Mistral style, mixture of experts too)."""

    params: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int  # the MLP width a token passes through (mixture of experts: expert width x experts per token)
    vocab: int
    tied: bool = True
    largest: int = 0  # the largest single parameter (the embedding)

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ModelShape:
        """From a Hugging Face config (as a dict; a multimodal model's ``text_config``), its parameters counted
        from the shapes (embedding once when tied, attention with biases and q/k norms where the config has
        them, dense or expert MLPs, norms)."""
        c = config.get("text_config") or config
        h, layers, vocab = int(c["hidden_size"]), int(c["num_hidden_layers"]), int(c["vocab_size"])
        heads = int(c["num_attention_heads"])
        kv = int(c.get("num_key_value_heads") or heads)
        hd = int(c.get("head_dim") or h // heads)
        tied = bool(c.get("tie_word_embeddings", True))
        experts = int(next((c[k] for k in ("num_experts", "num_local_experts", "n_routed_experts") if c.get(k)), 0))
        inter = int(c.get("intermediate_size") or 4 * h)
        q, kvd = heads * hd, kv * hd
        attn = h * q + 2 * h * kvd + q * h
        if c.get("attention_bias") or c.get("model_type") == "qwen2":
            attn += q + 2 * kvd
        if str(c.get("model_type", "")).startswith("qwen3"):
            attn += 2 * hd  # q_norm, k_norm
        if experts:
            moe = int(c.get("moe_intermediate_size") or inter)
            mlp = experts * 3 * h * moe + h * experts
            active = moe * int(c.get("num_experts_per_tok") or 1)
        else:
            mlp, active = 3 * h * inter, inter
        params = layers * (attn + mlp + 2 * h) + vocab * h * (1 if tied else 2) + h
        return cls(params=params, hidden=h, layers=layers, heads=heads, kv_heads=kv, head_dim=hd, intermediate=active,
                   vocab=vocab, tied=tied, largest=vocab * h)

    def adapter_params(self, rank: int, targets: list[str]) -> int:
        """A LoRA adapter's parameters: rank x (in + out) per target module per layer."""
        q, kvd, h, i = self.heads * self.head_dim, self.kv_heads * self.head_dim, self.hidden, self.intermediate
        dims = {"q_proj": (h, q), "k_proj": (h, kvd), "v_proj": (h, kvd), "o_proj": (q, h),
                "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}
        return self.layers * sum(rank * sum(dims.get(t, (h, h))) for t in targets)

    def kv_bytes_per_token(self, dtype_bytes: int, tp: int = 1) -> int:
        """KV cache bytes per token on one engine GPU (key and value of every layer; the KV heads split over TP,
        replicated where there are fewer of them than GPUs)."""
        return 2 * self.layers * max(1, self.kv_heads // tp) * self.head_dim * dtype_bytes


def activation_bytes(shape: ModelShape, tokens: int, dtype_bytes: int, checkpointing: bool) -> int:
    """Peak activation memory of one training micro-batch of ``tokens`` packed tokens: with gradient checkpointing
    each layer's input plus one layer recomputed with its gradients, or the output layer's chunk of logits where that
    is larger; without, every layer's saved tensors; both with the final hidden states and their gradient."""
    h, q, kvd = shape.hidden, shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    per_layer = tokens * dtype_bytes * (4 * h + 4 * shape.intermediate + 2 * q + 2 * kvd)
    chunk = min(tokens, max(1, LOGIT_CHUNK_ELEMENTS // shape.vocab)) * shape.vocab * LOGIT_PEAK_BYTES
    final = tokens * h * 4
    if checkpointing:
        return shape.layers * tokens * h * dtype_bytes + max(2 * per_layer, chunk) + final
    return shape.layers * per_layer + chunk + final


# ---------------------------------------------------------------------------------------------- trainer
@dataclass
class TrainerState:
    """Bytes per trainer GPU of the policy's state: ``resident`` between steps (model, masters, moments),
    ``gradients`` and ``gathered`` (FSDP2's gathered parameters) only while it trains, ``offloadable`` what
    ``trainer.offloadDuringRollout`` can move to host memory (one worker: masters and moments; FSDP2: the
    moments, the shards being the weights every sync reads)."""

    parts: dict[str, int]
    gradients: int
    gathered: int
    offloadable: int

    @property
    def resident(self) -> int:
        return sum(self.parts.values())


def trainer_state(spec: RLHFJobSpec, shape: ModelShape) -> TrainerState:
    """The policy trainer's state per GPU from ``trainer.masterWeights``, ``trainer.autocast``, FSDP2's sharding,
    LoRA and the in-trainer reference (``roles.precision``'s bytes per parameter)."""
    t, p = spec.trainer, shape.params
    b = DTYPE_BYTES[spec.model.dtype]
    world = t.replicas * max(1, t.gpus_per_replica) if t.strategy == "fsdp2" else 1
    wide = b == 4 or t.master_weights == "float32"  # float32 gradients and moments
    autocast = t.autocast and b < 4
    parts: dict[str, int] = {}
    if t.lora is not None:
        a = shape.adapter_params(t.lora.rank, list(t.lora.target_modules))
        parts = {"model": b * p, "adapter": 4 * a, "moments": 8 * a}
        grads, gathered, offloadable = 4 * a, 0, 12 * a
    elif world == 1:
        parts["model"] = (4 if autocast else b) * p
        if wide and b < 4 and not autocast:
            parts["masters"] = 4 * p
        parts["moments"] = (8 if wide else 2 * b) * p
        grads = (4 if wide else b) * p
        gathered, offloadable = 0, parts.get("masters", 0) + parts["moments"]
    else:
        parts["shards"] = (4 if wide else b) * p // world
        parts["moments"] = (8 if wide else 2 * b) * p // world
        grads = (4 if wide else b) * p // world
        layer = (p - shape.vocab * shape.hidden) // max(1, shape.layers)
        gather_b = 4 if autocast else b
        gathered = (2 * layer if t.reshard_after_forward else shape.layers * layer) * gather_b
        offloadable = parts["moments"]
    if spec.reference_active() and spec.reference.placement == "trainer" and t.lora is None:
        parts["reference"] = (4 if autocast else b) * p // world
    return TrainerState(parts, grads, gathered, offloadable)


# ----------------------------------------------------------------------------------------------- engine
def engine_activation_bytes(shape: ModelShape, tp: int) -> int:
    """vLLM's activation peak as its start-up profile measures it: the sampler's float32 logits of its largest
    batch of sequences and one forward pass of its largest token batch."""
    sampler = 3 * ENGINE_MAX_SEQS * shape.vocab * 4
    forward = ENGINE_MAX_BATCHED_TOKENS * (4 * shape.hidden + 2 * shape.intermediate // tp) * 2
    return sampler + forward


def host_bytes(memory: str) -> int:
    """A Kubernetes memory quantity (``64Gi``, ``500M``, ``1e9``) in bytes."""
    m = re.fullmatch(r"([0-9.]+(?:[eE][0-9]+)?)([KMGTPE]i?)?", memory.strip())
    if not m:
        raise ValueError(f"not a memory quantity: {memory!r}")
    unit = m.group(2) or ""
    base = 1024 if unit.endswith("i") else 1000
    power = " KMGTPE".index(unit[:1]) if unit else 0
    return int(float(m.group(1)) * base**power)


def margin_bytes(total: int) -> int:
    """Room left on every GPU for the allocators' fragmentation: 2% of it, at least 1 GiB."""
    return max(GIB, total // 50)


# ------------------------------------------------------------------------------------------------- plan
@dataclass
class Measured:
    """What the trainer ranks report before the engines are built (the largest over the ranks): the GPU's size,
    the trainer's allocator (its model, masters and AdamW moments, which it creates at start) and how much of
    that it can move to host memory."""

    gpu_total: int
    trainer_reserved: int
    offloadable: int


@dataclass
class MemoryPlan:
    """Per GPU, bytes by part in each phase, the KV cache and what does not fit (``problems``: each names the field
    to change)."""

    gpu_total: int
    rollout: dict[str, int]
    training: dict[str, int]
    kv_cache: int
    kv_bytes_per_token: int
    sequences_at_once: int
    batch_sequences: int
    offload: bool
    offload_bytes: int
    host: dict[str, int]
    margin: int
    kv_field: str = "rollout.gpuMemoryUtilization"  # the field that sizes the KV cache
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def fits(self) -> bool:
        return not self.problems

    def record(self) -> dict[str, Any]:
        """The plan in GiB, for the progress record and logs."""
        return {"gpu_total_gib": gib(self.gpu_total), "margin_gib": gib(self.margin),
                "rollout_gib": {k: gib(v) for k, v in self.rollout.items()}, "rollout_total_gib": gib(sum(
                    self.rollout.values())), "training_gib": {k: gib(v) for k, v in self.training.items()},
                "training_total_gib": gib(sum(self.training.values())), "kv_cache_gib": gib(self.kv_cache),
                "kv_cache_tokens": self.kv_cache // max(1, self.kv_bytes_per_token),
                "sequences_at_once": self.sequences_at_once, "batch_sequences": self.batch_sequences,
                "offload": self.offload, "offload_gib": gib(self.offload_bytes),
                "host_gib": {k: gib(v) for k, v in self.host.items()}, "fits": self.fits, "problems": self.problems,
                "notes": self.notes}

    def status(self) -> dict[str, Any]:
        """``status.memory`` (``models.MemoryStatus``, snake_case names)."""
        return {"rollout_gib": gib(sum(self.rollout.values())), "training_gib": gib(sum(self.training.values())),
                "kv_cache_gib": gib(self.kv_cache), "sequences_at_once": self.sequences_at_once,
                "batch_sequences": self.batch_sequences, "offload": self.offload, "summary": self.summary()}

    def summary(self) -> str:
        return (f"per GPU of {gib(self.gpu_total)} GiB: rollout {gib(sum(self.rollout.values()))} GiB (KV cache "
                f"{gib(self.kv_cache)} GiB, {self.sequences_at_once} of {self.batch_sequences} sequences at once), "
                f"training {gib(sum(self.training.values()))} GiB, margin {gib(self.margin)} GiB"
                + (f"; trainer state offloaded during rollouts: {gib(self.offload_bytes)} GiB" if self.offload else ""))

    def check(self) -> None:
        """Raise ``MemoryPlanError`` (the numbers and what to change) unless the layout fits."""
        if self.problems:
            raise MemoryPlanError(f"the colocated layout does not fit ({self.summary()}): " + " ".join(self.problems))


def plan(spec: RLHFJobSpec, shape: ModelShape, gpu_total: int, measured: Measured | None = None,
         offload: bool | None = None) -> MemoryPlan:
    """The memory plan of ``spec``'s colocated layout on GPUs of ``gpu_total`` bytes (module docstring).
    ``offload``: force trainer.offloadDuringRollout's decision (None: the spec's, ``auto`` deciding by fit)."""
    r, t = spec.rollout, spec.trainer
    b = DTYPE_BYTES[spec.model.dtype]
    tp = r.tensor_parallel_size
    state = trainer_state(spec, shape)
    resident, offloadable = state.resident, state.offloadable
    if measured is not None:  # the trainer's own allocator, where it holds more than the arithmetic says
        resident, offloadable = max(resident, measured.trainer_reserved), max(offloadable, measured.offloadable)
    margin = margin_bytes(gpu_total)
    sleeps = spec.placement.colocated_sleep
    engine = engine_parts(spec, shape, gpu_total)
    trainer_rollout = {"trainer_state": resident, "trainer_process": TRAINER_PROCESS_BYTES}
    rollout = {**trainer_rollout, **engine, "engine_process": ENGINE_PROCESS_BYTES}
    host_limit = host_bytes(t.resources.memory)
    pinned_per_pod = offloadable * max(1, t.gpus_per_replica)
    host_fits = pinned_per_pod + HOST_PROCESS_BYTES * 2 * max(1, t.gpus_per_replica) <= host_limit
    fits_without = sum(rollout.values()) + margin <= gpu_total
    mode = t.offload_during_rollout
    if offload is None:
        offload = sleeps and mode != "never" and (mode == "always" or (not fits_without and host_fits))
    notes = []
    if mode == "always" and not sleeps:
        notes.append("trainer.offloadDuringRollout needs engines that sleep (placement.colocatedSleep true): off")
        offload = False
    if offload:
        rollout["trainer_state"] = resident - offloadable
    acts = activation_bytes(shape, max(t.max_tokens_per_micro_batch, r.sampling.max_tokens), b,
                            t.gradient_checkpointing)
    asleep = {"engine_process": ENGINE_PROCESS_BYTES, **({} if r.enforce_eager else {"engine_graphs": ENGINE_GRAPH_BYTES})}
    training = {"trainer_state": resident, "gradients": state.gradients, "activations": acts,
                "trainer_process": TRAINER_PROCESS_BYTES, **({"gathered_params": state.gathered} if state.gathered
                                                              else {}),
                **(asleep if sleeps else {**engine, "engine_process": ENGINE_PROCESS_BYTES})}
    kv_tok = shape.kv_bytes_per_token(1 if r.kv_cache_dtype == "fp8" else b, tp)
    batch = spec.algorithm.prompts_per_step * r.sampling.samples_per_prompt
    per_engine = -(-batch // r.engines)
    seqs = min(per_engine, engine["kv_cache"] // max(1, kv_tok * r.sampling.max_tokens))
    p = MemoryPlan(gpu_total, rollout, training, engine["kv_cache"], kv_tok, seqs, per_engine, offload,
                   offloadable if offload else 0,
                   {"limit": host_limit, "pinned_per_pod": pinned_per_pod if offload else 0}, margin, notes=notes,
                   kv_field="rollout.kvCacheMemoryGiB" if r.kv_cache_memory_gib is not None
                   else "rollout.gpuMemoryUtilization")
    p.problems = problems(spec, shape, p, state, offloadable, host_fits)
    return p


def engine_parts(spec: RLHFJobSpec, shape: ModelShape, gpu_total: int) -> dict[str, int]:
    """One engine GPU awake: its weights, its activation peak and the KV cache (the rest of vLLM's budget
    ``gpuMemoryUtilization`` x the GPU, or ``rollout.kvCacheMemoryGiB``), CUDA graphs unless eager."""
    r = spec.rollout
    b, tp = DTYPE_BYTES[spec.model.dtype], r.tensor_parallel_size
    weights = b * shape.params // tp
    act = engine_activation_bytes(shape, tp)
    graphs = 0 if r.enforce_eager else ENGINE_GRAPH_BYTES
    if r.kv_cache_memory_gib is not None:
        kv = int(r.kv_cache_memory_gib * GIB)
    else:
        kv = max(0, int(r.gpu_memory_utilization * gpu_total) - weights - act - graphs)
    return {"engine_weights": weights, "engine_activations": act, "kv_cache": kv,
            **({"engine_graphs": graphs} if graphs else {})}


def problems(spec: RLHFJobSpec, shape: ModelShape, p: MemoryPlan, state: TrainerState, offloadable: int,
             host_fits: bool) -> list[str]:
    """What does not fit, each with the numbers and the field to change (and the largest value that fits)."""
    r, t = spec.rollout, spec.trainer
    out = []
    free = p.gpu_total - p.margin
    need = sum(p.rollout.values())
    if need > free:
        rest = need - p.rollout["kv_cache"]
        room = free - rest  # the largest KV cache that fits beside the rest
        what = (f"during rollouts each GPU needs {gib(need)} GiB (trainer state after step 1 "
                f"{gib(p.rollout['trainer_state'])} GiB, engine weights {gib(p.rollout['engine_weights'])} GiB, "
                f"KV cache {gib(p.kv_cache)} GiB) of {gib(p.gpu_total)} GiB less a {gib(p.margin)} GiB margin:")
        if room <= 0:
            fix = "no KV cache fits beside the trainer's state: spread the model over more GPUs (trainer.strategy "
            fix += "fsdp2, more engines) or use a larger GPU"
        elif r.kv_cache_memory_gib is not None:
            fix = f"set rollout.kvCacheMemoryGiB to at most {math.floor(room / GIB * 100) / 100}"
        else:
            util = (room + p.rollout["engine_weights"] + p.rollout["engine_activations"]
                    + p.rollout.get("engine_graphs", 0)) / p.gpu_total
            fix = (f"set rollout.gpuMemoryUtilization to at most {math.floor(util * 100) / 100} (a KV cache of "
                   f"{gib(room)} GiB)")
        if not p.offload and spec.placement.colocated_sleep and offloadable > 0:
            fix += (f", or move {gib(offloadable)} GiB of trainer state to host memory during rollouts "
                    f"(trainer.offloadDuringRollout always"
                    + ("" if host_fits else f"; trainer.resources.memory must then hold it: at least "
                       f"{math.ceil((offloadable + 2 * HOST_PROCESS_BYTES) * max(1, t.gpus_per_replica) / GIB)}Gi")
                    + ")")
        out.append(f"{what} {fix}.")
    need = sum(p.training.values())
    if need > free:
        out.append(training_problem(spec, shape, p, state, need, free))
    if p.offload and p.host["pinned_per_pod"] + 2 * HOST_PROCESS_BYTES * max(1, t.gpus_per_replica) > p.host["limit"]:
        out.append(f"the trainer state moved to host memory during rollouts takes {gib(p.host['pinned_per_pod'])} GiB "
                   f"per trainer pod beside its processes, more than trainer.resources.memory {t.resources.memory}: "
                   "raise it or set trainer.offloadDuringRollout never.")
    return out


def training_problem(spec: RLHFJobSpec, shape: ModelShape, p: MemoryPlan, state: TrainerState, need: int,
                     free: int) -> str:
    """The training phase does not fit: the largest micro-batch budget that does, or checkpointing."""
    t, b = spec.trainer, DTYPE_BYTES[spec.model.dtype]
    rest = need - p.training["activations"]
    what = (f"while training each GPU needs {gib(need)} GiB (trainer state {gib(p.training['trainer_state'])} GiB, "
            f"gradients {gib(state.gradients)} GiB, activations of a {t.max_tokens_per_micro_batch}-token "
            f"micro-batch {gib(p.training['activations'])} GiB) of {gib(p.gpu_total)} GiB less a {gib(p.margin)} GiB "
            "margin:")
    lo, hi = 0, t.max_tokens_per_micro_batch
    while lo < hi:  # the largest budget whose activations fit
        mid = (lo + hi + 1) // 2
        if rest + activation_bytes(shape, mid, b, t.gradient_checkpointing) <= free:
            lo = mid
        else:
            hi = mid - 1
    fixes = []
    if lo >= max(16, spec.rollout.sampling.max_tokens):
        fixes.append(f"set trainer.maxTokensPerMicroBatch to at most {lo}")
    if not t.gradient_checkpointing and rest + activation_bytes(shape, t.max_tokens_per_micro_batch, b, True) <= free:
        fixes.append("set trainer.gradientCheckpointing true")
    if not fixes:
        fixes.append("the trainer's state does not leave room for one sequence of rollout.sampling.maxTokens: "
                     "shorten it, spread the trainer over more GPUs (trainer.strategy fsdp2) or use a larger GPU")
    return f"{what} {', or '.join(fixes)}."


def explain_oom(message: str, p: MemoryPlan | None) -> str:
    """A run's failure message with the plan's numbers and the fields to change where it is a CUDA out-of-memory
    error (an engine's wake, the trainer's step), else as it is."""
    if p is None or "out of memory" not in message.lower():
        return message
    return (f"{message} [memory plan: {p.summary()}; rollouts counted at {gib(sum(p.rollout.values()))} GiB and "
            f"training at {gib(sum(p.training.values()))} GiB per GPU: lower {p.kv_field} (the KV cache) or "
            "trainer.maxTokensPerMicroBatch (the activations)"
            + ("" if p.offload else ", or set trainer.offloadDuringRollout always") + "]")
