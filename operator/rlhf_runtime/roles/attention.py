"""Variable-length attention for packed micro-batches: ``rlhf_varlen``, a Hugging Face attention function.

A packed micro-batch (``roles.batches.pack``) is one row of several sequences. Hugging Face's SDPA path keeps
attention inside each sequence with a block-diagonal ``[L, L]`` mask, which PyTorch's SDPA cannot run in its
FlashAttention kernel: it computes the whole ``L x L`` product, so many short sequences packed into one row cost
as much attention as one sequence of the row's length. ``rlhf_varlen`` attends within each sequence only, over
the sequences' boundaries (``cu_seq_lens_q``/``max_length_q``, which ``Packed.attn_kwargs`` passes through the
model's forward), so a micro-batch costs the sum of its sequences' squares, and no mask is built:

- on CUDA devices of compute capability 8.0 or later whose torch has it, PyTorch's own variable-length
  FlashAttention (``torch.nn.attention.varlen``, causal), computing in bfloat16 or float16 (also under
  ``trainer.autocast``: float32 queries, keys and values are cast to the autocast dtype); other GPUs and dtypes
  keep SDPA and its mask;
- on CPUs, causal SDPA over the sequences as one batch, each padded at its end to the longest (``segments``), in
  any dtype.

Models with attention logit soft-capping or sliding-window layers keep SDPA and its mask everywhere.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

import torch

NAME = "rlhf_varlen"
_registered = False


def _kernel(device_type: str = "cuda") -> Any:
    """The variable-length kernel for ``device_type``: ``segments`` on CPUs, else FlashAttention's (None where
    this torch has none)."""
    if device_type == "cpu":
        return segments
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn


@torch.compiler.disable  # data-dependent boundaries: eager inside a compiled decoder layer (trainer.compile)
def segments(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor,
             max_q: int, max_k: int, *, scale: float | None = None, is_causal: bool = True,
             enable_gqa: bool = False) -> torch.Tensor:
    """FlashAttention's variable-length signature on any device: ``q``/``k``/``v`` ``[L, heads, head_dim]`` of the
    sequences ``cu_q[i]:cu_q[i+1]``; ``[L, heads, head_dim]``. The sequences go as one batch, each padded at its
    end to the longest: under the causal mask a sequence's own positions never see its padding (which comes after
    them), and the padding's rows are dropped. It costs the number of sequences times the longest's square."""
    if not is_causal:
        raise ValueError("segments computes causal attention only")
    starts, lens, longest = cu_q[:-1].long(), (cu_q[1:] - cu_q[:-1]).long(), int(max_q)
    seq = torch.repeat_interleave(torch.arange(len(lens), device=q.device), lens)  # each token's sequence
    pos = torch.arange(q.shape[0], device=q.device) - starts[seq]  # and its position in it

    def batch(x: torch.Tensor) -> torch.Tensor:  # [L, h, d] -> [n, h, longest, d]
        out = x.new_zeros(len(lens), longest, *x.shape[1:])
        out[seq, pos] = x
        return out.transpose(1, 2)

    o = torch.nn.functional.scaled_dot_product_attention(batch(q), batch(k), batch(v), is_causal=True, scale=scale,
                                                         enable_gqa=enable_gqa)
    return o.transpose(1, 2)[seq, pos]


def supports(config: Any) -> bool:
    """Whether ``config``'s attention is plain causal attention (no soft-capping, no sliding window)."""
    if getattr(config, "attn_logit_softcapping", None) is not None:
        return False
    if any("sliding" in str(t) for t in getattr(config, "layer_types", None) or []):
        return False
    return getattr(config, "sliding_window", None) is None or getattr(config, "use_sliding_window", True) is False


def use_varlen(model: Any, device: torch.device, compute: torch.dtype) -> bool:
    """Switch ``model`` (a Hugging Face model computing in ``compute``) to ``rlhf_varlen`` when the model, and on a
    GPU the device, torch and the dtype (FlashAttention: bfloat16 or float16), allow it (module docstring);
    returns whether it did."""
    config = getattr(model, "config", None)
    if config is None or not supports(config):
        return False
    if device.type != "cpu":
        if compute not in (torch.bfloat16, torch.float16):
            return False
        if device.type != "cuda" or _kernel() is None or torch.cuda.get_device_capability(device) < (8, 0):
            return False
    register()
    model.set_attn_implementation(NAME)
    return True


def register() -> None:
    """Make ``rlhf_varlen`` known to Hugging Face Transformers (idempotent): the attention function, and a mask
    function that builds no mask."""
    global _registered
    if _registered:
        return
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(NAME, varlen_attention)
    AttentionMaskInterface.register(NAME, no_mask)
    _registered = True


def no_mask(*args: Any, **kwargs: Any) -> None:
    return None


@functools.cache
def _params(kernel: Any) -> frozenset[str]:
    """The kernel's keyword names, read once (every attention call of every layer asks)."""
    return frozenset(inspect.signature(kernel).parameters)


def _call(kernel: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor, max_len: int,
          scale: float | None) -> torch.Tensor:
    """The kernel, causal, over torch releases whose signatures differ (``is_causal`` in torch 2.10-2.11, a
    ``window_size`` later; ``enable_gqa`` or not)."""
    params = _params(kernel)
    kw: dict[str, Any] = {"scale": scale}
    if "window_size" in params:
        kw["window_size"] = (-1, 0)
    else:
        kw["is_causal"] = True
    if q.shape[1] != k.shape[1]:
        if "enable_gqa" in params:
            kw["enable_gqa"] = True
        else:
            rep = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    return kernel(q, k, v, cu, cu, max_len, max_len, **kw)


def varlen_attention(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                     **kwargs: Any) -> tuple[torch.Tensor, None]:
    """Hugging Face's attention-function contract: ``query``/``key``/``value`` ``[1, heads, L, head_dim]`` of one
    packed row, the boundaries in ``kwargs`` (``cu_seq_lens_q``, ``max_length_q``); returns ``[1, L, heads,
    head_dim]`` and no weights. Without boundaries (a plain forward, e.g. generation) the row is one sequence."""
    if query.shape[0] != 1:
        raise ValueError(f"rlhf_varlen takes one packed row, got a batch of {query.shape[0]}")
    if dropout:
        raise ValueError("rlhf_varlen has no attention dropout")
    cu = kwargs.get("cu_seq_lens_q")
    length = query.shape[2]
    if cu is None:
        cu = torch.tensor([0, length], dtype=torch.int32, device=query.device)
    max_len = int(kwargs.get("max_length_q") or length)
    q, k, v = (x[0].transpose(0, 1) for x in (query, key, value))  # [L, heads, head_dim]
    if q.dtype == torch.float32 and torch.is_autocast_enabled(q.device.type):
        # trainer.autocast: float32 weights and residual stream, so the rotary embedding left q and k in float32;
        # FlashAttention takes the autocast dtype (as Hugging Face's own flash-attention path casts them)
        low = torch.get_autocast_dtype(q.device.type)
        q, k, v = q.to(low), k.to(low), v.to(low)
    out = _call(_kernel(q.device.type), q, k, v, cu.to(torch.int32), max_len, scaling)
    return out[None], None
