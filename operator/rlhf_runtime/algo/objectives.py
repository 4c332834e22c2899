"""Policy-gradient algorithms: advantages, returns and losses for GRPO, PPO, RLOO and REINFORCE++.

Shapes: per-token tensors are [B, T] (one row per sample, prompt + completion + padding); ``mask`` is 1 on the
contiguous run of completion tokens of each row and 0 on prompt and padding tokens. Everything outside the mask
is ignored (and zero in the outputs). Torch is imported lazily: the sequence-level advantages are pure Python.

Sequence advantages (critic-free; ``r`` the finite rewards of the batch, groups of ``group_size`` consecutive
samples share one prompt):

* ``grpo``: ``(r_i - mean(group)) / (std(group) + eps)``, 0 for a group whose std is below ``eps``
  (``group_advantages``).
* ``rloo``: leave-one-out baseline within the group, ``A_i = r_i - sum_{j != i} r_j / (n - 1)``
  ``= n / (n - 1) * (r_i - mean(group))``; needs ``n = group_size >= 2``.
* ``reinforce++`` (REINFORCE++, OpenRLHF): normalisation over the whole batch,
  ``A_i = (r_i - mean(r)) / (std(r) + eps)``, all 0 when ``std(r) < eps``. Standard deviations are population
  ones (divide by n).
* The rewards must split into whole groups, and each must be a finite number (a NaN or an infinity would poison
  its whole group and the update): else ``ValueError``, naming the first bad reward.
* ``ppo`` has no sequence advantages: they come from a critic through ``gae``.

KL in the reward (``token_rewards``): per completion token ``kl_t = logp_t - ref_logp_t`` (the k1 estimator of
KL(pi || pi_ref) on the sampled token), ``reward_t = -kl_coef * kl_t``, and the sequence score is added at each
row's last completion token. ``discounted_returns`` gives the reward-to-go ``G_t = reward_t + gamma * G_{t+1}``
over the completion tokens (``G`` after the last one is 0): REINFORCE++ with KL in the reward uses ``G_t`` as the
token advantage, whitened over the batch (``masked_whiten``) by the caller.

GAE (``gae``): over the completion tokens ``t_1 < ... < t_n`` of a row, with ``V(t_{n+1}) = 0`` (terminal),
``delta_k = r(t_k) + gamma * V(t_{k+1}) - V(t_k)``, ``A(t_k) = delta_k + gamma * lam * A(t_{k+1})`` with
``A(t_{n+1}) = 0``, and ``returns = A + V``. Computed without gradient; not whitened (``masked_whiten`` does that:
``(x - mean) / sqrt(var + eps)`` with mean and population variance over the masked entries).

Policy loss (``policy_loss``): per completion token ``ratio = exp(logp - old_logp)`` and
``pg = -min(ratio * A, clip(ratio, 1 - clip_low, 1 + clip_high) * A)`` (asymmetric "clip-higher" bounds, DAPO;
``clip_low == clip_high`` is the PPO/GRPO clip). ``A`` is per sequence ([B], the same for every token of a row)
or per token ([B, T]). With ``ref_logp`` and ``kl_coef > 0`` the k3 estimator
``exp(ref - logp) - (ref - logp) - 1`` times ``kl_coef`` is added per token (KL in the loss, as GRPO).
``clip_fraction`` is the fraction of completion tokens whose ratio lies outside its bounds.

Rollout correction (``correction_weights``): the engines sample from ``mu`` (their log-probabilities of each
sampled token, after temperature and top-p), the trainer scores the same tokens under the same weights as
``pi_old`` (different kernels and precision: they differ). Per completion token ``log w = old_logp -
rollout_logp``; at ``sequence`` level ``log w`` is summed over each completion and the sum is every one of its
tokens' weight. ``tis``: ``min(w, cap)``; ``mis``: ``w`` where ``1/cap <= w <= cap``, else 0; ``none``: 1. The
weights multiply each token's policy-gradient term (``policy_loss``'s ``weights``; no gradient through them).
Statistics (token means): ``mismatch_kl = mean(w - log w - 1)`` (k3, an estimate of KL(mu || pi_old) from mu's
samples, always computed at token level), ``mismatch_log_ratio = mean(log w)`` and ``correction_fraction``, the
share of tokens whose weight the bound changed.

A sync that did not reach the engines (``mismatch_spike``): right after a weight sync the engines sample from the
trainer's new weights, so ``mismatch_kl`` stays at its running level (numerics: kernels, precision). Engines left
on older weights sample from an older policy: the mismatch jumps. A step whose rollout followed a sync and whose
``mismatch_kl`` is above ``MISMATCH_SPIKE_FACTOR`` times the median of the last ``MISMATCH_HISTORY`` steps (at least
``MISMATCH_MIN_HISTORY`` of them) and above ``MISMATCH_SPIKE_FLOOR`` gives a warning.

Value loss (``value_loss``): per completion token
``0.5 * max((v - R)^2, (old_v + clip(v - old_v, -c, c) - R)^2)`` (PPO value clipping; ``c <= 0`` is the plain
``0.5 * (v - R)^2``). ``value_clip_fraction`` is the fraction of completion tokens where the clipped term is the
strictly larger one, i.e. where the clip removes the token's gradient.

Aggregation (``aggregate``) of a per-token quantity ``x`` over the mask ``m``:

* ``token``: ``sum(x * m) / sum(m)`` over the whole batch: every completion token weighs the same (GRPO's
  loss: ``policy_loss`` with ``clip_low == clip_high`` and token aggregation; DAPO's token-level loss).
* ``sequence``: ``mean_b( sum_t(x * m)[b] / sum_t(m)[b] )`` over the sequences with at least one completion
  token: every sequence weighs the same, whatever its length. A sequence is a row, or, in a packed micro-batch
  (several sequences end to end in one row, ``roles.batches.pack``), the tokens sharing a value of ``seq``.
"""

from __future__ import annotations

import math
import statistics
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Sequence

    import torch

ALGORITHMS = ("grpo", "ppo", "rloo", "reinforce++")
AGGREGATIONS = ("token", "sequence")


def _check_rewards(rewards: list[float], group_size: int) -> None:
    if group_size < 1 or len(rewards) % group_size:
        raise ValueError(f"{len(rewards)} rewards do not split into groups of {group_size}")
    for i, r in enumerate(rewards):
        if not isinstance(r, (int, float)) or not math.isfinite(r):
            raise ValueError(f"reward {i} (group {i // group_size}) is {r!r}: rewards must be finite numbers")


def group_advantages(rewards: list[float], group_size: int, eps: float = 1e-6) -> list[float]:
    """GRPO: each sample's reward relative to its group, ``(r - mean(group)) / (std(group) + eps)``; zeros for a
    group whose rewards are all equal (no signal)."""
    _check_rewards(rewards, group_size)
    out: list[float] = []
    for g in range(0, len(rewards), group_size):
        grp = rewards[g : g + group_size]
        mean = sum(grp) / len(grp)
        std = math.sqrt(sum((r - mean) ** 2 for r in grp) / len(grp))
        out += [0.0 if std < eps else (r - mean) / (std + eps) for r in grp]
    return out


def sequence_advantages(name: str, rewards: list[float], group_size: int, eps: float = 1e-6) -> list[float]:
    """One advantage per sample for the critic-free algorithms ``grpo``, ``rloo`` and ``reinforce++``."""
    if name not in ALGORITHMS:
        raise ValueError(f"unknown algorithm {name!r}: expected one of {', '.join(ALGORITHMS)}")
    if name == "ppo":
        raise ValueError("ppo has no sequence advantages: they come from the critic through gae()")
    _check_rewards(rewards, group_size)
    if name == "grpo":
        return group_advantages(rewards, group_size, eps)
    if name == "rloo":
        if group_size < 2:
            raise ValueError(f"rloo needs groups of at least 2 samples (leave-one-out baseline), got {group_size}")
        out: list[float] = []
        for g in range(0, len(rewards), group_size):
            grp = rewards[g : g + group_size]
            total = sum(grp)
            out += [r - (total - r) / (group_size - 1) for r in grp]
        return out
    if not rewards:
        return []
    mean = sum(rewards) / len(rewards)
    std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / len(rewards))
    return [0.0 if std < eps else (r - mean) / (std + eps) for r in rewards]


def sequence_sums(x: torch.Tensor, seq: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sequence sums of a [B, T] quantity, and each entry's sequence id (flat): sequences are the rows, or
    the runs of equal ``seq`` ids ([B, T] long) of a packed micro-batch."""
    import torch

    ids = seq if seq is not None else torch.arange(x.shape[0], device=x.device)[:, None].expand_as(x)
    flat = ids.reshape(-1)
    n = int(flat.max()) + 1 if flat.numel() else 0
    return torch.zeros(n, dtype=x.dtype, device=x.device).index_add(0, flat, x.reshape(-1)), flat


def aggregate(per_token: torch.Tensor, mask: torch.Tensor, aggregation: str,
              seq: torch.Tensor | None = None) -> torch.Tensor:
    """Scalar aggregate of a [B, T] per-token quantity over the mask: ``token`` or ``sequence`` mean (sequences:
    the rows, or the runs of equal ``seq`` ids, [B, T] long, of a packed micro-batch)."""
    import torch

    if aggregation not in AGGREGATIONS:
        raise ValueError(f"unknown aggregation {aggregation!r}: expected one of {', '.join(AGGREGATIONS)}")
    m = mask.to(per_token.dtype)
    x = torch.where(m > 0, per_token, torch.zeros_like(per_token))
    if aggregation == "token":
        return (x * m).sum() / m.sum().clamp(min=1)
    counts, sums = sequence_sums(m, seq)[0], sequence_sums(x * m, seq)[0]
    per_seq = sums / counts.clamp(min=1)
    present = (counts > 0).to(per_token.dtype)
    return (per_seq * present).sum() / present.sum().clamp(min=1)


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """``(x - mean) / sqrt(var + eps)`` with mean and population variance over the masked entries; 0 elsewhere."""
    import torch

    m = mask.to(x.dtype)
    n = m.sum().clamp(min=1)
    xm = torch.where(m > 0, x, torch.zeros_like(x))
    mean = (xm * m).sum() / n
    var = (((xm - mean) * m) ** 2).sum() / n
    return (xm - mean) * torch.rsqrt(var + eps) * m


def token_rewards(
    scores: torch.Tensor | Sequence[float],
    logp: torch.Tensor,
    ref_logp: torch.Tensor | None,
    mask: torch.Tensor,
    kl_coef: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """KL-in-the-reward token rewards [B, T] and the per-token k1 KL [B, T] (no gradient).

    ``scores``: one per row, added at the row's last completion token (a row without one gets no score).
    """
    import torch

    with torch.no_grad():
        m = mask.to(logp.dtype)
        if ref_logp is None:
            kl = torch.zeros_like(logp)
        else:
            kl = torch.where(m > 0, logp - ref_logp, torch.zeros_like(logp)) * m
        rewards = -kl_coef * kl
        s = torch.as_tensor(scores, dtype=logp.dtype, device=logp.device).reshape(-1)
        if s.shape[0] != logp.shape[0]:
            raise ValueError(f"{s.shape[0]} scores for {logp.shape[0]} rows")
        positions = torch.arange(logp.shape[1], device=logp.device)
        last = (positions * (m > 0)).amax(-1)
        has_tokens = (m > 0).any(-1)
        rows = torch.arange(logp.shape[0], device=logp.device)
        rewards[rows, last] += torch.where(has_tokens, s, torch.zeros_like(s))
    return rewards, kl


def _reverse_scan(
    rewards: torch.Tensor, values: torch.Tensor | None, mask: torch.Tensor, gamma: float, lam: float
) -> torch.Tensor:
    import torch

    m = mask.to(rewards.dtype) > 0
    out = torch.zeros_like(rewards)
    carry = torch.zeros_like(rewards[:, 0])
    next_value = torch.zeros_like(rewards[:, 0])
    for t in reversed(range(rewards.shape[1])):
        if values is None:
            step = rewards[:, t] + gamma * carry
        else:
            delta = rewards[:, t] + gamma * next_value - values[:, t]
            step = delta + gamma * lam * carry
            next_value = torch.where(m[:, t], values[:, t], next_value)
        carry = torch.where(m[:, t], step, carry)
        out[:, t] = torch.where(m[:, t], step, torch.zeros_like(step))
    return out


def discounted_returns(token_rewards: torch.Tensor, mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """Reward-to-go ``G_t = r_t + gamma * G_{t+1}`` over each row's completion tokens; [B, T], 0 off the mask."""
    import torch

    with torch.no_grad():
        return _reverse_scan(token_rewards, None, mask, gamma, 1.0)


def gae(
    token_rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation: (advantages, returns = advantages + values), [B, T], 0 off the mask."""
    import torch

    with torch.no_grad():
        values = values.to(token_rewards.dtype)
        adv = _reverse_scan(token_rewards, values, mask, gamma, lam)
        m = mask.to(token_rewards.dtype) > 0
        returns = torch.where(m, adv + values, torch.zeros_like(adv))
    return adv, returns


CORRECTIONS = ("none", "tis", "mis")


def correction_weights(
    old_logp: torch.Tensor,
    rollout_logp: torch.Tensor,
    mask: torch.Tensor,
    mode: str,
    level: str,
    cap: float,
    seq: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Rollout-correction weights [B, T] (module docstring; 0 off the mask, no gradient) and the mismatch
    statistics; sequences are rows, or ``seq``'s runs in a packed row."""
    import torch

    if mode not in CORRECTIONS:
        raise ValueError(f"unknown rollout correction {mode!r}: expected one of {', '.join(CORRECTIONS)}")
    with torch.no_grad():
        m = mask.to(old_logp.dtype)
        log_w = torch.where(m > 0, old_logp - rollout_logp, torch.zeros_like(old_logp))
        if level == "sequence":
            sums, flat = sequence_sums(log_w, seq)
            log_w_used = sums[flat].reshape(m.shape) * m
        elif level == "token":
            log_w_used = log_w
        else:
            raise ValueError(f"unknown rollout-correction level {level!r}: expected token or sequence")
        w = torch.exp(log_w_used.clamp(max=80.0))
        if mode == "tis":
            out = torch.minimum(w, torch.full_like(w, cap))
        elif mode == "mis":
            out = torch.where((w >= 1.0 / cap) & (w <= cap), w, torch.zeros_like(w))
        else:
            out = torch.ones_like(w)
        out = out * m
        n = m.sum().clamp(min=1)
        token_w = torch.exp(log_w)
        # k3 >= 0; in float32 exp(log w) rounds to 1 for |log w| < ~6e-8, which would make a token's k3 -log w
        stats = {"mismatch_kl": float(((token_w - log_w - 1).clamp(min=0) * m).sum() / n),
                 "mismatch_log_ratio": float((log_w * m).sum() / n),
                 "correction_fraction": 0.0 if mode == "none" else
                 float((((out != w) & (m > 0)).to(m.dtype)).sum() / n)}
    return out, stats


#: A post-sync step's mismatch this many times the running median (and above the floor) is a warning.
MISMATCH_SPIKE_FACTOR = 10.0
MISMATCH_SPIKE_FLOOR = 1e-3
MISMATCH_HISTORY = 20
MISMATCH_MIN_HISTORY = 3


def mismatch_spike(history: Sequence[float], value: float, step: int) -> str | None:
    """The warning for step ``step``'s ``mismatch_kl`` ``value`` (its rollout right after a weight sync), given the
    earlier steps' values ``history`` (the newest last; the last ``MISMATCH_HISTORY`` count), or None."""
    recent = list(history)[-MISMATCH_HISTORY:]
    if len(recent) < MISMATCH_MIN_HISTORY or not math.isfinite(value):
        return None
    level = statistics.median(recent)
    if value <= MISMATCH_SPIKE_FLOOR or value <= MISMATCH_SPIKE_FACTOR * level:
        return None
    return (f"step {step}: the trainer-vs-engine mismatch (mismatch_kl {value:.3g}) is {value / max(level, 1e-12):.0f}x "
            f"its median over the last {len(recent)} steps ({level:.3g}) right after a weight sync: the engines may "
            "still sample from older weights (a sync that did not reach them)")


def policy_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_low: float,
    clip_high: float,
    aggregation: str = "token",
    ref_logp: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    seq: torch.Tensor | None = None,
    weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Clipped surrogate (+ k3 KL) loss; ``advantages`` [B] or [B, T]; ``seq``: a packed micro-batch's sequence
    ids (``aggregate``); ``weights``: rollout-correction weights of each token's policy-gradient term
    (``correction_weights``). Returns (loss, {loss, kl, clip_fraction})."""
    import torch

    if aggregation not in AGGREGATIONS:
        raise ValueError(f"unknown aggregation {aggregation!r}: expected one of {', '.join(AGGREGATIONS)}")
    adv = advantages.to(logp.dtype)
    if adv.dim() == 1:
        adv = adv.unsqueeze(-1)
    elif adv.dim() != 2:
        raise ValueError(f"advantages must be [B] or [B, T], got shape {tuple(advantages.shape)}")
    m = mask.to(logp.dtype)
    ratio = torch.exp(logp - old_logp)
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high) * adv
    per_token = -torch.minimum(unclipped, clipped)
    if weights is not None:
        per_token = per_token * weights.detach().to(per_token.dtype)
    kl_value = 0.0
    if kl_coef > 0 and ref_logp is not None:
        d = ref_logp - logp
        kl = torch.exp(d) - d - 1
        per_token = per_token + kl_coef * kl
        kl_value = float(aggregate(kl.detach(), m, aggregation, seq))
    loss = aggregate(per_token, m, aggregation, seq)
    outside = ((ratio < 1.0 - clip_low) | (ratio > 1.0 + clip_high)).to(m.dtype)
    clip_frac = float((outside * m).sum() / m.sum().clamp(min=1))
    return loss, {"loss": float(loss.detach()), "kl": kl_value, "clip_fraction": clip_frac}


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    clip: float,
    aggregation: str = "token",
    seq: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO clipped value loss (``seq``: ``aggregate``'s). Returns (loss, {value_loss, value_clip_fraction})."""
    import torch

    if aggregation not in AGGREGATIONS:
        raise ValueError(f"unknown aggregation {aggregation!r}: expected one of {', '.join(AGGREGATIONS)}")
    m = mask.to(values.dtype)
    returns = returns.to(values.dtype)
    unclipped = (values - returns) ** 2
    if clip > 0:
        v_clipped = old_values + torch.clamp(values - old_values, -clip, clip)
        clipped = (v_clipped - returns) ** 2
        per_token = 0.5 * torch.maximum(unclipped, clipped)
        active = (clipped > unclipped).to(m.dtype)
        clip_frac = float((active * m).sum() / m.sum().clamp(min=1))
    else:
        per_token = 0.5 * unclipped
        clip_frac = 0.0
    loss = aggregate(per_token, m, aggregation, seq)
    return loss, {"value_loss": float(loss.detach()), "value_clip_fraction": clip_frac}
