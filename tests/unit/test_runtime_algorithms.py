"""Advantages, returns and losses of rlhf_runtime.algo.objectives against hand-computed examples (torch, CPU)."""

from __future__ import annotations

import math

import pytest
import torch

from rlhf_runtime.algo.objectives import (
    ALGORITHMS,
    aggregate,
    discounted_returns,
    gae,
    group_advantages,
    masked_whiten,
    policy_loss,
    sequence_advantages,
    token_rewards,
    value_loss,
)


def test_algorithm_names() -> None:
    assert ALGORITHMS == ("grpo", "ppo", "rloo", "reinforce++")


def test_grpo_advantages_delegate_to_group_advantages() -> None:
    rewards = [1.0, 0.0, 0.0, 0.0, 2.0, 2.0, 2.0, 2.0]
    assert sequence_advantages("grpo", rewards, 4) == group_advantages(rewards, 4)


def test_rloo_leave_one_out_baseline() -> None:
    # group of 4 on [1, 0, 0, 1]: A_0 = 1 - (0 + 0 + 1) / 3 = 2/3, A_1 = 0 - (1 + 0 + 1) / 3 = -2/3, ...
    assert sequence_advantages("rloo", [1.0, 0.0, 0.0, 1.0], 4) == pytest.approx([2 / 3, -2 / 3, -2 / 3, 2 / 3])
    # groups of 2, [1, 0] and [0, 1]: A = 1 - 0, 0 - 1, 0 - 1, 1 - 0
    assert sequence_advantages("rloo", [1.0, 0.0, 0.0, 1.0], 2) == pytest.approx([1.0, -1.0, -1.0, 1.0])
    # equal rewards: the baseline is the reward itself
    assert sequence_advantages("rloo", [3.0, 3.0, 3.0], 3) == [0.0, 0.0, 0.0]


def test_reinforce_pp_normalises_over_the_whole_batch() -> None:
    # [2, 0, 1, 1]: mean 1, var (1 + 1 + 0 + 0) / 4 = 0.5, std = 0.70710678 -> A = [+-1 / 0.7071, 0, 0]
    adv = sequence_advantages("reinforce++", [2.0, 0.0, 1.0, 1.0], 2)
    assert adv == pytest.approx([math.sqrt(2), -math.sqrt(2), 0.0, 0.0], rel=1e-5)
    # GRPO would zero the second group ([1, 1]: no spread within it) and give +-1 in the first
    assert sequence_advantages("grpo", [2.0, 0.0, 1.0, 1.0], 2) == pytest.approx([1.0, -1.0, 0.0, 0.0], rel=1e-5)
    assert sequence_advantages("reinforce++", [5.0, 5.0, 5.0, 5.0], 2) == [0.0, 0.0, 0.0, 0.0]


@pytest.mark.parametrize("name", ["grpo", "rloo", "reinforce++"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), None])
def test_non_finite_reward_is_named(name: str, bad: object) -> None:
    with pytest.raises(ValueError, match="reward 2 "):
        sequence_advantages(name, [1.0, 0.0, bad, 1.0], 2)  # type: ignore[list-item]


def test_sequence_advantage_errors() -> None:
    with pytest.raises(ValueError, match="at least 2"):
        sequence_advantages("rloo", [1.0, 0.0], 1)
    with pytest.raises(ValueError, match="gae"):
        sequence_advantages("ppo", [1.0, 0.0], 2)
    with pytest.raises(ValueError, match="unknown algorithm"):
        sequence_advantages("dpo", [1.0, 0.0], 2)
    for name in ("rloo", "reinforce++"):
        with pytest.raises(ValueError, match="groups of 2"):
            sequence_advantages(name, [1.0, 0.0, 1.0], 2)
        with pytest.raises(ValueError, match="groups of 0"):
            sequence_advantages(name, [1.0, 0.0], 0)


def test_gae_one_row_of_three_tokens() -> None:
    # gamma = 0.9, lam = 0.8 (gamma * lam = 0.72), rewards [0, 0, 1], values [0.5, 0.4, 0.3], V after = 0:
    # t=2: delta = 1 + 0.9 * 0 - 0.3 = 0.7;              A = 0.7
    # t=1: delta = 0 + 0.9 * 0.3 - 0.4 = -0.13;          A = -0.13 + 0.72 * 0.7 = 0.374
    # t=0: delta = 0 + 0.9 * 0.4 - 0.5 = -0.14;          A = -0.14 + 0.72 * 0.374 = 0.12928
    # returns = A + V = [0.62928, 0.774, 1.0]
    rewards = torch.tensor([[0.0, 0.0, 1.0]])
    values = torch.tensor([[0.5, 0.4, 0.3]])
    adv, ret = gae(rewards, values, torch.ones(1, 3), gamma=0.9, lam=0.8)
    assert adv.tolist()[0] == pytest.approx([0.12928, 0.374, 0.7], abs=1e-6)
    assert ret.tolist()[0] == pytest.approx([0.62928, 0.774, 1.0], abs=1e-6)


def test_gae_ignores_prompt_and_padding_positions() -> None:
    # row 0: the 1x3 example above behind one prompt token and before one padding token (values there are junk);
    # row 1: a 2-token completion, gamma = 0.9, lam = 0.8:
    #   t=2: delta = 2 - 1 = 1, A = 1;  t=1: delta = 0 + 0.9 * 1 - 0 = 0.9, A = 0.9 + 0.72 * 1 = 1.62
    rewards = torch.tensor([[5.0, 0.0, 0.0, 1.0, 5.0], [5.0, 0.0, 2.0, 5.0, 5.0]])
    values = torch.tensor([[9.0, 0.5, 0.4, 0.3, 7.0], [9.0, 0.0, 1.0, 7.0, 7.0]])
    mask = torch.tensor([[0, 1, 1, 1, 0], [0, 1, 1, 0, 0]])
    adv, ret = gae(rewards, values, mask, gamma=0.9, lam=0.8)
    assert adv.tolist()[0] == pytest.approx([0.0, 0.12928, 0.374, 0.7, 0.0], abs=1e-6)
    assert adv.tolist()[1] == pytest.approx([0.0, 1.62, 1.0, 0.0, 0.0], abs=1e-6)
    assert ret.tolist()[1] == pytest.approx([0.0, 1.62, 2.0, 0.0, 0.0], abs=1e-6)


def test_gae_with_gamma_lam_one_is_monte_carlo_return_minus_value() -> None:
    # returns are the undiscounted reward-to-go [3, 2]; A = returns - values = [3 - 1, 2 - 0.5]
    adv, ret = gae(torch.tensor([[1.0, 2.0]]), torch.tensor([[1.0, 0.5]]), torch.ones(1, 2), 1.0, 1.0)
    assert adv.tolist()[0] == pytest.approx([2.0, 1.5])
    assert ret.tolist()[0] == pytest.approx([3.0, 2.0])


def test_masked_whiten() -> None:
    # masked [1, 2, 3]: mean 2, var (1 + 0 + 1) / 3 = 2/3 -> [-1, 0, 1] / sqrt(2/3) = [-1.2247, 0, 1.2247]
    x = torch.tensor([[1.0, 2.0, 3.0, 100.0]])
    out = masked_whiten(x, torch.tensor([[1, 1, 1, 0]]))
    k = 1 / math.sqrt(2 / 3)
    assert out.tolist()[0] == pytest.approx([-k, 0.0, k, 0.0], rel=1e-5)


def test_token_rewards_kl_in_reward() -> None:
    # kl_coef = 0.1; row 0: kl = logp - ref on tokens 1, 2 = [-1 - -1.5, -2 - -1] = [0.5, -1]
    #   rewards = [0, -0.1 * 0.5, -0.1 * -1 + score 2] = [0, -0.05, 2.1, 0]
    # row 1: kl = [0, 0, -1 - -0.5 = -0.5] on tokens 1..3, rewards = [0, 0, 0, 0.05 + score -1 = -0.95]
    logp = torch.tensor([[0.0, -1.0, -2.0, 0.0], [0.0, -1.0, -1.0, -1.0]])
    ref = torch.tensor([[0.0, -1.5, -1.0, 0.0], [0.0, -1.0, -1.0, -0.5]])
    mask = torch.tensor([[0, 1, 1, 0], [0, 1, 1, 1]])
    rewards, kl = token_rewards(torch.tensor([2.0, -1.0]), logp, ref, mask, kl_coef=0.1)
    assert kl.flatten().tolist() == pytest.approx([0.0, 0.5, -1.0, 0.0, 0.0, 0.0, 0.0, -0.5])
    assert rewards.tolist()[0] == pytest.approx([0.0, -0.05, 2.1, 0.0])
    assert rewards.tolist()[1] == pytest.approx([0.0, 0.0, 0.0, -0.95])
    # no reference: only the scores, at the last completion token
    rewards, kl = token_rewards([2.0, -1.0], logp, None, mask, kl_coef=0.1)
    assert rewards.tolist() == [[0.0, 0.0, 2.0, 0.0], [0.0, 0.0, 0.0, -1.0]]
    assert kl.abs().sum() == 0


def test_discounted_returns() -> None:
    # gamma = 0.5 on the rewards of row 0 above: G_2 = 2.1, G_1 = -0.05 + 0.5 * 2.1 = 1.0; 0 off the mask
    ret = discounted_returns(torch.tensor([[0.0, -0.05, 2.1, 0.0]]), torch.tensor([[0, 1, 1, 0]]), gamma=0.5)
    assert ret.tolist()[0] == pytest.approx([0.0, 1.0, 2.1, 0.0])


def test_clip_higher_bounds() -> None:
    old = torch.zeros(1, 1)
    new = torch.full((1, 1), math.log(1.25))
    mask = torch.ones(1, 1)
    # ratio 1.25, A = 1: inside the clip-higher bound 1 + 0.28 -> loss -1.25; outside 1 + 0.2 -> loss -1.2
    loss, stats = policy_loss(new, old, torch.tensor([1.0]), mask, clip_low=0.2, clip_high=0.28)
    assert float(loss) == pytest.approx(-1.25) and stats["clip_fraction"] == 0.0
    loss, stats = policy_loss(new, old, torch.tensor([1.0]), mask, clip_low=0.2, clip_high=0.2)
    assert float(loss) == pytest.approx(-1.2) and stats["clip_fraction"] == 1.0
    # ratio 0.75, A = -1: below 1 - 0.2 -> min(-0.75, -0.8) = -0.8 -> loss 0.8, even with clip_high = 0.28
    low = torch.full((1, 1), math.log(0.75))
    loss, stats = policy_loss(low, old, torch.tensor([-1.0]), mask, clip_low=0.2, clip_high=0.28)
    assert float(loss) == pytest.approx(0.8) and stats["clip_fraction"] == 1.0


def test_token_and_sequence_aggregation_differ_on_unequal_lengths() -> None:
    logp = torch.zeros(3, 3)
    mask = torch.tensor([[0, 1, 1], [0, 1, 0], [0, 0, 0]])  # lengths 2, 1, and an empty row
    # on policy (ratio 1), A = [1, -2, 7] per sequence: token losses -A = [-1, -1], [2]
    # token: (-1 - 1 + 2) / 3 = 0; sequence: mean(-1, 2) = 0.5 (the empty row is left out)
    seq_adv = torch.tensor([1.0, -2.0, 7.0])
    loss, _ = policy_loss(logp, logp, seq_adv, mask, 0.2, 0.2, aggregation="token")
    assert float(loss) == pytest.approx(0.0)
    loss, _ = policy_loss(logp, logp, seq_adv, mask, 0.2, 0.2, aggregation="sequence")
    assert float(loss) == pytest.approx(0.5)
    # per-token A: row 0 [1, 3], row 1 [-2]: token (-1 - 3 + 2) / 3 = -2/3; sequence mean(-2, 2) = 0
    tok_adv = torch.tensor([[9.0, 1.0, 3.0], [9.0, -2.0, 9.0], [9.0, 9.0, 9.0]])
    loss, _ = policy_loss(logp, logp, tok_adv, mask, 0.2, 0.2, aggregation="token")
    assert float(loss) == pytest.approx(-2 / 3)
    loss, _ = policy_loss(logp, logp, tok_adv, mask, 0.2, 0.2, aggregation="sequence")
    assert float(loss) == pytest.approx(0.0, abs=1e-7)


def test_aggregate_directly() -> None:
    x = torch.tensor([[1.0, 2.0, float("nan")], [4.0, float("inf"), 0.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    assert float(aggregate(x, mask, "token")) == pytest.approx((1 + 2 + 4) / 3)  # junk off the mask ignored
    assert float(aggregate(x, mask, "sequence")) == pytest.approx((1.5 + 4) / 2)


def test_kl_in_loss_k3_estimator() -> None:
    # logp = log 0.5, ref = log 0.25: d = ref - logp = -ln 2, k3 = e^d - d - 1 = 0.5 + ln 2 - 1 = 0.193147
    logp = torch.log(torch.tensor([[0.5]]))
    ref = torch.log(torch.tensor([[0.25]]))
    loss, stats = policy_loss(logp, logp, torch.tensor([0.0]), torch.ones(1, 1), 0.2, 0.2, ref_logp=ref, kl_coef=0.5)
    assert stats["kl"] == pytest.approx(0.5 + math.log(2) - 1)
    assert float(loss) == pytest.approx(0.5 * (0.5 + math.log(2) - 1))
    loss, stats = policy_loss(logp, logp, torch.tensor([0.0]), torch.ones(1, 1), 0.2, 0.2, ref_logp=ref)
    assert float(loss) == 0.0 and stats["kl"] == 0.0  # kl_coef 0: no KL term


@pytest.mark.parametrize("kl_coef", [0.0, 0.05])
def test_symmetric_token_policy_loss_is_grpo_loss(kl_coef: float) -> None:
    g = torch.Generator().manual_seed(0)
    logp = -torch.rand(4, 6, generator=g)
    old = logp + 0.3 * torch.randn(4, 6, generator=g)  # some ratios outside [0.8, 1.2]
    ref = logp + 0.2 * torch.randn(4, 6, generator=g)
    adv = torch.randn(4, generator=g)
    mask = torch.tensor([[0, 1, 1, 1, 0, 0], [0, 0, 1, 1, 1, 1], [0, 1, 0, 0, 0, 0], [0, 0, 0, 0, 0, 0]])
    ours, ours_stats = policy_loss(logp, old, adv, mask, 0.2, 0.2, "token", ref_logp=ref, kl_coef=kl_coef)
    # GRPO's loss written out: -min(ratio * A, clip(ratio, 0.8, 1.2) * A) + kl_coef * k3 per token, averaged over
    # every completion token of the batch
    m = mask.float()
    ratio = torch.exp(logp - old)
    pg = -torch.minimum(ratio * adv[:, None], ratio.clamp(0.8, 1.2) * adv[:, None])
    k3 = torch.exp(ref - logp) - (ref - logp) - 1
    theirs = float(((pg + kl_coef * k3) * m).sum() / m.sum())
    their_stats = {"loss": theirs, "kl": float((k3 * m).sum() / m.sum()) if kl_coef > 0 else 0.0,
                   "clip_fraction": float((((ratio < 0.8) | (ratio > 1.2)).float() * m).sum() / m.sum())}
    assert float(ours) == pytest.approx(theirs, rel=1e-6, abs=1e-7)
    assert ours_stats == pytest.approx(their_stats, rel=1e-6, abs=1e-7)
    assert 0 < ours_stats["clip_fraction"] < 1


def test_policy_loss_gradients_flow() -> None:
    logp = torch.tensor([[0.0, -1.0, -2.0], [0.0, -0.5, -0.7]], requires_grad=True)
    old = torch.tensor([[0.0, -1.1, -1.9], [0.0, -0.4, -0.8]])
    adv = torch.tensor([[0.0, 1.0, -0.5], [0.0, 0.3, 2.0]])
    mask = torch.tensor([[0, 1, 1], [0, 1, 1]])
    for aggregation in ("token", "sequence"):
        loss, _ = policy_loss(logp, old, adv, mask, 0.2, 0.28, aggregation, ref_logp=old, kl_coef=0.1)
        logp.grad = None
        loss.backward()
        grad = logp.grad
        assert grad is not None and torch.isfinite(grad).all()
        assert (grad[:, 1:] != 0).all() and (grad[:, 0] == 0).all()  # prompt tokens get none


def test_value_loss_clipping() -> None:
    # clip 0.2; token a: v 1, old 0.5, R 1.5: (1 - 1.5)^2 = 0.25; clipped v = 0.5 + 0.2 = 0.7, (0.7 - 1.5)^2 = 0.64
    #   -> 0.5 * 0.64 = 0.32, the clip is active; token b: v 1, old 0.5, R 0: 1.0 vs (0.7)^2 = 0.49 -> 0.5;
    # token loss (0.32 + 0.5) / 2 = 0.41, clip fraction 1/2; unclipped: (0.125 + 0.5) / 2 = 0.3125
    values = torch.tensor([[1.0, 1.0, 8.0]])
    old = torch.tensor([[0.5, 0.5, 8.0]])
    returns = torch.tensor([[1.5, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 0]])
    loss, stats = value_loss(values, old, returns, mask, clip=0.2)
    assert float(loss) == pytest.approx(0.41)
    assert stats == pytest.approx({"value_loss": 0.41, "value_clip_fraction": 0.5})
    loss, stats = value_loss(values, old, returns, mask, clip=0.0)
    assert float(loss) == pytest.approx(0.3125) and stats["value_clip_fraction"] == 0.0


def test_value_loss_sequence_aggregation_and_gradients() -> None:
    # row 0 as above (0.32, 0.5); row 1 one token v 0, old 0, R 1 -> 0.5 * 1 = 0.5
    # token: (0.32 + 0.5 + 0.5) / 3 = 0.44; sequence: mean(0.41, 0.5) = 0.455
    values = torch.tensor([[1.0, 1.0, 8.0], [0.0, 8.0, 8.0]], requires_grad=True)
    old = torch.tensor([[0.5, 0.5, 8.0], [0.0, 8.0, 8.0]])
    returns = torch.tensor([[1.5, 0.0, 0.0], [1.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    loss, stats = value_loss(values, old, returns, mask, clip=0.2, aggregation="token")
    assert stats["value_loss"] == pytest.approx(0.44) and stats["value_clip_fraction"] == pytest.approx(1 / 3)
    loss, stats = value_loss(values, old, returns, mask, clip=0.2, aggregation="sequence")
    assert stats["value_loss"] == pytest.approx(0.455)
    loss.backward()
    grad = values.grad
    assert grad is not None and torch.isfinite(grad).all()
    # token a is clipped (no gradient); b: d/dv 0.5 (v - 0)^2 / 2 / 2 = 0.25; row 1: (0 - 1) / 2 = -0.5
    assert grad.flatten().tolist() == pytest.approx([0.0, 0.25, 0.0, -0.5, 0.0, 0.0])


def test_bad_aggregation_name() -> None:
    x = torch.zeros(1, 2)
    mask = torch.ones(1, 2)
    with pytest.raises(ValueError, match="aggregation"):
        aggregate(x, mask, "batch")
    with pytest.raises(ValueError, match="aggregation"):
        policy_loss(x, x, torch.zeros(1), mask, 0.2, 0.2, aggregation="mean")
    with pytest.raises(ValueError, match="aggregation"):
        value_loss(x, x, x, mask, 0.2, aggregation="seq")
    with pytest.raises(ValueError, match="advantages"):
        policy_loss(x, x, torch.zeros(1, 2, 1), mask, 0.2, 0.2)
