"""From a step's scores (and, when needed, per-token log-probabilities and values) to the trainer's advantages.

Inputs are per sample (``scores``: the combined, normalised reward) and per completion token (lists:
``logp`` of the policy before the update, ``ref`` of the reference, ``values`` of the critic). The output goes
to the trainer as is: ``advantages`` per sample (a float each) or per completion token (a list each), and for
PPO ``returns`` per token for the critic.

* ``grpo``, ``rloo``, ``reinforce++`` with the KL penalty in the loss (or none): one advantage per sample,
  ``algorithms.sequence_advantages``.
* ``ppo``: token rewards (``algorithms.token_rewards``: the score on the last token, minus ``klCoef`` x k1 KL
  per token when ``klMode`` is reward), GAE with ``algorithm.ppo.gamma``/``lambda`` over the critic's values,
  advantages whitened over the batch's tokens (``ppo.whitenAdvantages``); ``returns = advantages + values``
  before whitening.
* ``rloo`` / ``reinforce++`` with ``klMode`` reward (OpenRLHF's form): rloo puts its leave-one-out advantage,
  reinforce++ the raw score, on the last token, minus the per-token KL; the advantage of each token is its
  reward-to-go (gamma 1); reinforce++ then whitens them over the batch's tokens.

Completion tokens are laid out left-aligned, one row per sample (``_rows``), so the padded ``[B, T]``
functions of ``algorithms`` apply unchanged.
"""

from __future__ import annotations

from typing import Any

from rlhf_api.models import Algorithm
from rlhf_runtime.algo import objectives as alg


def needs_token_inputs(a: Algorithm) -> bool:
    """Whether the advantages need per-token log-probabilities (KL in the reward) or values (PPO)."""
    return a.name == "ppo" or (a.kl_coef > 0 and a.kl_mode == "reward")


def _rows(lists: list[list[float]], width: int) -> Any:
    import torch

    out = torch.zeros(len(lists), width)
    for i, v in enumerate(lists):
        if v:
            out[i, : len(v)] = torch.tensor(v, dtype=torch.float32)
    return out


def _lists(x: Any, lengths: list[int]) -> list[list[float]]:
    return [x[i, :n].tolist() for i, n in enumerate(lengths)]


def plan(a: Algorithm, scores: list[float], group_size: int, lengths: list[int],
         logp: list[list[float]] | None = None, ref: list[list[float]] | None = None,
         values: list[list[float]] | None = None) -> dict[str, Any]:
    """``{"advantages": [...], "returns": [[...]] (ppo only), "kl": mean per-token KL (KL in the reward)}``.
    ``lengths``: completion tokens per sample."""
    if not needs_token_inputs(a):
        return {"advantages": alg.sequence_advantages(a.name, scores, group_size)}
    import torch

    if any(not isinstance(s, (int, float)) for s in scores):
        raise ValueError("scores must be numbers")
    width = max(max(lengths, default=0), 1)
    mask = _rows([[1.0] * n for n in lengths], width)
    kl_reward = a.kl_coef > 0 and a.kl_mode == "reward"
    if kl_reward and (logp is None or ref is None):
        raise ValueError("klMode reward needs the policy's and the reference's log-probabilities")
    lp = _rows(logp, width) if logp is not None else torch.zeros_like(mask)
    rp = _rows(ref, width) if kl_reward and ref is not None else None
    coef = a.kl_coef if kl_reward else 0.0
    out: dict[str, Any] = {}
    if a.name == "ppo":
        if values is None:
            raise ValueError("ppo needs the critic's values")
        p = a.ppo_settings()
        vals = _rows(values, width)
        rewards, kl = alg.token_rewards(torch.tensor(scores, dtype=torch.float32), lp, rp, mask, coef)
        adv, ret = alg.gae(rewards, vals, mask, p.gamma, p.lambda_)
        if p.whiten_advantages:
            adv = alg.masked_whiten(adv, mask)
        out["returns"] = _lists(ret, lengths)
    else:
        seq = scores if a.name == "reinforce++" else alg.sequence_advantages(a.name, scores, group_size)
        rewards, kl = alg.token_rewards(torch.tensor(seq, dtype=torch.float32), lp, rp, mask, coef)
        adv = alg.discounted_returns(rewards, mask, 1.0)
        if a.name == "reinforce++":
            adv = alg.masked_whiten(adv, mask)
    out["advantages"] = _lists(adv * mask, lengths)
    out["kl"] = float((kl * mask).sum() / mask.sum().clamp(min=1)) if kl_reward else 0.0
    return out
