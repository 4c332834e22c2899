"""GRPO: group advantages (pure) and its clipped policy-gradient loss, ``policy_loss`` with the symmetric clip and
token aggregation (torch, CPU)."""

from __future__ import annotations

import math

import pytest
import torch

from rlhf_runtime.algo.objectives import MISMATCH_HISTORY, group_advantages, mismatch_spike, policy_loss


def test_advantages_are_relative_within_each_group() -> None:
    adv = group_advantages([1.0, 0.0, 0.0, 0.0, 2.0, 2.0, 2.0, 2.0], group_size=4)
    std = math.sqrt(0.25 * 0.75)
    assert adv[:4] == pytest.approx([0.75 / std, -0.25 / std, -0.25 / std, -0.25 / std], rel=1e-4)
    assert adv[4:] == [0.0, 0.0, 0.0, 0.0]  # equal rewards: no signal
    assert sum(adv[:4]) == pytest.approx(0.0, abs=1e-6)


def test_advantages_need_whole_groups() -> None:
    with pytest.raises(ValueError):
        group_advantages([1.0, 2.0, 3.0], group_size=2)


def test_loss_on_policy_is_minus_mean_advantage_over_completion_tokens() -> None:
    logp = torch.log(torch.tensor([[0.5, 0.5, 0.5], [0.5, 0.5, 0.5]]))
    mask = torch.tensor([[0, 1, 1], [0, 1, 0]])
    adv = torch.tensor([1.0, -2.0])
    loss, stats = policy_loss(logp, logp.clone(), adv, mask, 0.2, 0.2, "token")
    assert float(loss) == pytest.approx(-(1 + 1 - 2) / 3)
    assert stats["clip_fraction"] == 0.0


def test_loss_clips_the_ratio() -> None:
    old = torch.zeros(1, 2)
    new = torch.full((1, 2), math.log(2.0))  # ratio 2 on both tokens
    mask = torch.tensor([[1, 1]])
    loss, stats = policy_loss(new, old, torch.tensor([1.0]), mask, 0.2, 0.2, "token")
    assert float(loss) == pytest.approx(-1.2)  # min(2 * A, 1.2 * A) for A > 0
    assert stats["clip_fraction"] == 1.0
    loss, _ = policy_loss(new, old, torch.tensor([-1.0]), mask, 0.2, 0.2, "token")
    assert float(loss) == pytest.approx(2.0)  # min(-2, -1.2) = -2 -> loss 2: no clipping for A < 0


def test_gradient_raises_logprob_of_positive_advantage_samples() -> None:
    logits = torch.zeros(2, 4, requires_grad=True)
    tokens = torch.tensor([1, 2])
    logp = torch.log_softmax(logits, -1).gather(-1, tokens[:, None])  # [2, 1]
    loss, _ = policy_loss(logp, logp.detach(), torch.tensor([1.0, -1.0]), torch.ones(2, 1), 0.2, 0.2, "token")
    loss.backward()
    assert logits.grad[0, 1] < 0 and logits.grad[1, 2] > 0  # descent raises sample 0, lowers sample 1


def test_kl_term_is_zero_at_the_reference_and_positive_away_from_it() -> None:
    logp = torch.log(torch.tensor([[0.5, 0.25]]))
    mask = torch.ones(1, 2)
    zero_adv = torch.tensor([0.0])
    loss, stats = policy_loss(logp, logp, zero_adv, mask, 0.2, 0.2, "token", ref_logp=logp.clone(), kl_coef=0.5)
    assert float(loss) == pytest.approx(0.0) and stats["kl"] == pytest.approx(0.0)
    loss, stats = policy_loss(logp, logp, zero_adv, mask, 0.2, 0.2, "token", ref_logp=logp - 0.3, kl_coef=0.5)
    assert stats["kl"] > 0 and float(loss) == pytest.approx(0.5 * stats["kl"], rel=1e-5)


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf, None, "1"])
def test_advantages_refuse_a_reward_that_is_not_a_finite_number(bad: object) -> None:
    with pytest.raises(ValueError, match=r"reward 5 \(group 1\) is .*: rewards must be finite numbers"):
        group_advantages([0.0, 1.0, 0.0, 1.0, 0.0, bad, 1.0, 0.0], group_size=4)  # type: ignore[list-item]


def test_mismatch_kl_of_near_equal_log_probabilities_is_not_negative() -> None:
    """k3 (w - log w - 1) is never negative; float32 rounds exp(5e-8) to 1, which would give a token -6e-8."""
    from rlhf_runtime.algo.objectives import correction_weights

    old = torch.zeros(1, 3)
    rollout = torch.tensor([[-3e-8, -5e-8, -5e-8]])  # log w = old - rollout
    mask = torch.ones_like(old)
    log_w = old - rollout
    assert (torch.exp(log_w) - log_w - 1 < 0).all()  # what float32 makes of k3 here, unclamped
    _, st = correction_weights(old, rollout, mask, "tis", "token", 2.0)
    assert st["mismatch_kl"] == 0.0


def test_rollout_correction_weights_are_hand_computed() -> None:
    from rlhf_runtime.algo.objectives import correction_weights

    # two completions in rows: log w per token = old - rollout
    old = torch.tensor([[0.0, -1.0, -2.0, 0.0], [0.0, -0.5, -0.5, -3.0]])
    rollout = torch.tensor([[0.0, -2.0, -1.0, 0.0], [0.0, -0.6, -0.1, 0.0]])
    mask = torch.tensor([[0.0, 1.0, 1.0, 0.0], [0.0, 1.0, 1.0, 0.0]])  # the last column is padding
    log_w = [1.0, -1.0, 0.1, -0.4]
    w = [math.exp(x) for x in log_w]  # e, 1/e, 1.105, 0.670
    tis, st = correction_weights(old, rollout, mask, "tis", "token", 2.0)
    assert tis[mask > 0].tolist() == pytest.approx([2.0, w[1], w[2], w[3]], rel=1e-6)
    assert tis[mask == 0].abs().sum() == 0
    assert st["mismatch_log_ratio"] == pytest.approx(sum(log_w) / 4, rel=1e-6)
    assert st["mismatch_kl"] == pytest.approx(sum(a - b - 1 for a, b in zip(w, log_w)) / 4, rel=1e-5)
    assert st["correction_fraction"] == pytest.approx(0.25)
    mis, st = correction_weights(old, rollout, mask, "mis", "token", 2.0)
    assert mis[mask > 0].tolist() == pytest.approx([0.0, 0.0, w[2], w[3]], rel=1e-6)  # e and 1/e outside [1/2, 2]
    assert st["correction_fraction"] == pytest.approx(0.5)
    seq, _ = correction_weights(old, rollout, mask, "tis", "sequence", 2.0)
    assert seq[0, 1:3].tolist() == pytest.approx([1.0, 1.0])  # exp(1 - 1)
    assert seq[1, 1:3].tolist() == pytest.approx([math.exp(-0.3)] * 2, rel=1e-6)
    none, st = correction_weights(old, rollout, mask, "none", "token", 2.0)
    assert none.tolist() == mask.tolist() and st["correction_fraction"] == 0.0
    with pytest.raises(ValueError, match="rollout correction"):
        correction_weights(old, rollout, mask, "clip", "token", 2.0)


def test_rollout_correction_weights_scale_each_tokens_policy_gradient() -> None:
    from rlhf_runtime.algo.objectives import correction_weights

    logp = torch.tensor([[-1.0, -2.0, -0.5]], requires_grad=True)
    mask = torch.ones(1, 3)
    w, _ = correction_weights(logp.detach(), logp.detach() + torch.tensor([[0.0, -1.0, 1.0]]), mask, "tis", "token",
                              2.0)
    loss, _ = policy_loss(logp, logp.detach(), torch.tensor([1.0]), mask, 0.2, 0.2, "token", weights=w)
    loss.backward()
    # on policy the gradient of -ratio * A per token is -A / 3 (token mean), times each token's weight
    assert logp.grad.tolist()[0] == pytest.approx([-1 / 3, -2 / 3, -math.exp(-1) / 3], rel=1e-5)


def test_mismatch_spike_after_a_sync_is_a_warning_against_the_running_median() -> None:
    level = [2e-4, 3e-4, 2.5e-4, 2e-4]
    assert mismatch_spike(level[:2], 0.5, 3) is None  # too little history to know the running level
    # 10x the median (2.25e-4) is 2.25e-3: below it no warning, above it one ...
    assert mismatch_spike(level, 2.0e-3, 5) is None and mismatch_spike(level, 2.4e-3, 5) is not None
    warning = mismatch_spike(level, 0.05, 5)
    assert warning is not None and warning.startswith("step 5:") and "222x" in warning and "older weights" in warning
    assert mismatch_spike([1e-5] * 4, 5e-4, 5) is None  # ... and a spike must also pass the floor (1e-3)
    assert mismatch_spike([1e-5] * 4, 2e-3, 5) is not None
    assert mismatch_spike(level, float("nan"), 5) is None
    # only the newest MISMATCH_HISTORY steps set the level: an old high stretch is forgotten
    history = [0.5] * 10 + [2e-4] * MISMATCH_HISTORY
    assert mismatch_spike(history, 0.01, 40) is not None
