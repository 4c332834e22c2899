"""GRPO: group-relative advantages and the clipped policy-gradient loss.

* Advantages (pure Python): the samples of one prompt form a group; each sample's advantage is
  ``(r - mean(group)) / (std(group) + eps)``; a group whose rewards are all equal gets zeros (no signal).
  Every reward must be a finite number (a NaN or an infinity would poison its whole group and the update):
  ``ValueError`` naming the first bad one.
* Loss (``algorithms.policy_loss`` in its symmetric, token-averaged form): per completion token,
  ``ratio = exp(logp - old_logp)``, ``pg = -min(ratio * A, clip(ratio, 1 - eps, 1 + eps) * A)``; plus, when ``kl_coef > 0``, the k3 estimator
  of KL to the frozen reference ``exp(ref - logp) - (ref - logp) - 1`` times ``kl_coef``. Token losses are
  averaged over all completion tokens of the batch (prompt and padding tokens are masked out).
"""

from __future__ import annotations

import math
from typing import Any


def group_advantages(rewards: list[float], group_size: int, eps: float = 1e-6) -> list[float]:
    if group_size < 1 or len(rewards) % group_size:
        raise ValueError(f"{len(rewards)} rewards do not split into groups of {group_size}")
    for i, r in enumerate(rewards):
        if not isinstance(r, (int, float)) or not math.isfinite(r):
            raise ValueError(f"reward {i} (group {i // group_size}) is {r!r}: rewards must be finite numbers")
    out: list[float] = []
    for g in range(0, len(rewards), group_size):
        grp = rewards[g : g + group_size]
        mean = sum(grp) / len(grp)
        std = math.sqrt(sum((r - mean) ** 2 for r in grp) / len(grp))
        out += [0.0 if std < eps else (r - mean) / (std + eps) for r in grp]
    return out


def grpo_loss(
    logp: Any,
    old_logp: Any,
    advantages: Any,
    mask: Any,
    clip_ratio: float,
    ref_logp: Any = None,
    kl_coef: float = 0.0,
) -> tuple[Any, dict[str, float]]:
    """``logp``/``old_logp``/``ref_logp``/``mask``: [B, T] tensors; ``advantages``: [B]. Returns (loss, stats):
    ``algorithms.policy_loss`` with symmetric clipping and token aggregation."""
    from rlhf_runtime.algo.objectives import policy_loss

    return policy_loss(logp, old_logp, advantages, mask, clip_ratio, clip_ratio, "token", ref_logp, kl_coef)


def token_logprobs(model: Any, input_ids: Any, attention_mask: Any, temperature: float = 1.0) -> Any:
    """Log-probability of each next token: [B, T] where position t scores ``input_ids[:, t]`` (t=0 is 0)."""
    import torch

    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits[:, :-1].float()
    if temperature > 0 and temperature != 1.0:
        logits = logits / temperature
    lp = torch.log_softmax(logits, dim=-1).gather(-1, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    return torch.cat([torch.zeros_like(lp[:, :1]), lp], dim=1)
