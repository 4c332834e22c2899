"""Training FLOPs and the GPU's peak: what ``Trainer`` reports as training tokens/s per GPU and MFU.

Model FLOPs of one optimiser pass over a batch (the recomputation of gradient checkpointing is not counted):

    6 * (N - V*H) * T  +  6 * V*H * S  +  6 * layers * heads * head_dim * sum_i(len_i^2)

``N`` the model's parameters that one token passes through (``active_params``: of a mixture of experts' routed
experts only the ``top-k`` of ``E`` a token is sent to, so Qwen3-30B-A3B counts 3.35B of its 30.5B), ``V*H`` its
output layer (and its input embedding too when the two are untied: a lookup, not a matmul), ``T`` every token
of the batch, ``S`` the scored (completion) tokens (the output layer runs on those only,
``roles.batches.token_logprobs``), and the last term causal attention: ``QK^T`` and ``AV`` over half the square of
each sequence, forward and backward (3x forward). MFU divides the FLOPs per second by
the GPUs' dense bfloat16 peak (``PEAK_BF16``, from the vendors' data sheets; a GPU not listed has no MFU).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

#: Dense (not 2:4 sparse) bfloat16 tensor-core peak FLOP/s by device-name fragment, most specific first.
PEAK_BF16: tuple[tuple[str, float], ...] = (
    ("GB200", 2.5e15), ("B200", 2.25e15), ("H200", 989e12), ("H100 PCIe", 756e12), ("H100", 989e12),
    ("H800", 989e12), ("H20", 148e12), ("A100", 312e12), ("A800", 312e12), ("L40S", 362e12), ("L4", 121e12),
    ("A10G", 70e12),
)


def peak_flops(device_name: str) -> float | None:
    """The dense bfloat16 peak of the GPU called ``device_name`` (``torch.cuda.get_device_name``), or None."""
    return next((v for k, v in PEAK_BF16 if k in device_name), None)


def train_flops(config: Any, params: int, tokens: int, scored: int, square_sum: int) -> float:
    """Model FLOPs of one training pass (module docstring); ``config`` a Hugging Face model config."""
    vocab, hidden = int(config.vocab_size), int(config.hidden_size)
    heads = int(config.num_attention_heads)
    head_dim = int(getattr(config, "head_dim", None) or hidden // heads)
    head = vocab * hidden
    body = params - head * (1 if getattr(config, "tie_word_embeddings", False) else 2)
    return 6.0 * body * tokens + 6.0 * head * scored + 6.0 * config.num_hidden_layers * heads * head_dim * square_sum


#: Config keys of a mixture of experts' routed expert count and of the experts each token goes to (Qwen-MoE,
#: Mixtral, DeepSeek, GPT-OSS spell them differently).
EXPERT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")
TOP_K_KEYS = ("num_experts_per_tok", "experts_per_token")


def routed_fraction(config: Any) -> float:
    """The share of a routed expert's parameters one token uses: ``top-k / E`` for a mixture of experts, else 1."""
    experts = next((int(v) for k in EXPERT_KEYS if (v := getattr(config, k, None))), 0)
    top_k = next((int(v) for k in TOP_K_KEYS if (v := getattr(config, k, None))), 0)
    return top_k / experts if experts > 1 and 0 < top_k < experts else 1.0


def is_routed_expert(name: str) -> bool:
    """Whether parameter ``name`` belongs to a routed expert (``...experts.<i>...`` or the fused
    ``...experts.gate_up_proj``/``down_proj``), not to a shared expert or the router."""
    return ".experts." in name and "shared_expert" not in name


def active_params(named_sizes: Iterable[tuple[str, int]], config: Any) -> int:
    """``N`` of ``train_flops``: the parameters one token passes through. ``named_sizes``: (name, element count)
    of every parameter; routed experts count with ``routed_fraction``, LoRA adapters (``.lora_``) not at all (the
    base model's FLOPs are the ones counted)."""
    fraction = routed_fraction(config)
    return round(sum(n * fraction if is_routed_expert(name) else n for name, n in named_sizes if ".lora_" not in name))


def model_active_params(model: Any, config: Any) -> int:
    """``active_params`` of a torch module's parameters (FSDP2's DTensors count whole)."""
    return active_params(((n, p.numel()) for n, p in model.named_parameters()), config)
