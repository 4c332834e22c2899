"""advantages.plan: from scores (and per-token log-probabilities and values) to the trainer's advantages,
against hand-computed examples."""

from __future__ import annotations

import pytest

from rlhf_api.models import Algorithm, EnvVar, RLHFJobSpec
from rlhf_runtime.algo import advantages
from rlhf_runtime.infra.config import spec_env


def test_critic_free_with_kl_in_the_loss_gives_one_advantage_per_sample() -> None:
    a = Algorithm(name="rloo", klCoef=0.1)
    out = advantages.plan(a, [1.0, 0.0, 0.0, 1.0], 2, [3, 1, 2, 2])
    assert out == {"advantages": [1.0, -1.0, -1.0, 1.0]}  # r_i - the other sample of its group
    assert not advantages.needs_token_inputs(a)


def test_ppo_gae_hand_computed() -> None:
    # one sample, two completion tokens, score 1 on the last; gamma = lambda = 1; values 0.5, 0.25
    # delta_1 = 1 + 0 - 0.25 = 0.75 -> A_1 = 0.75; delta_0 = 0 + 0.25 - 0.5 = -0.25 -> A_0 = -0.25 + 0.75 = 0.5
    # returns = A + V = [1.0, 1.0]
    a = Algorithm(name="ppo", ppo={"gamma": 1.0, "lambda": 1.0, "whitenAdvantages": False})
    out = advantages.plan(a, [1.0], 1, [2], logp=[[-1.0, -1.0]], values=[[0.5, 0.25]])
    assert out["advantages"] == [pytest.approx([0.5, 0.75])]
    assert out["returns"] == [pytest.approx([1.0, 1.0])]
    assert advantages.needs_token_inputs(a)


def test_ppo_needs_values_and_kl_in_reward_needs_the_reference() -> None:
    with pytest.raises(ValueError, match="critic's values"):
        advantages.plan(Algorithm(name="ppo"), [1.0], 1, [1], logp=[[0.0]])
    with pytest.raises(ValueError, match="reference's log-probabilities"):
        advantages.plan(Algorithm(name="ppo", klCoef=0.1, klMode="reward"), [1.0], 1, [1], logp=[[0.0]],
                        values=[[0.0]])


def test_rloo_with_kl_in_the_reward_hand_computed() -> None:
    # scores [1, 0] in one group -> leave-one-out advantages [1, -1], placed on each sample's last token;
    # k1 KL = logp - ref = [[0.5, 0], [-1]]; token rewards -0.5 * KL = [[-0.25, 0], [0.5]];
    # with the advantages: [[-0.25, 1], [-0.5]]; reward-to-go (gamma 1): [[0.75, 1], [-0.5]]
    a = Algorithm(name="rloo", klCoef=0.5, klMode="reward")
    out = advantages.plan(a, [1.0, 0.0], 2, [2, 1], logp=[[-1.0, -1.0], [-2.0]], ref=[[-1.5, -1.0], [-1.0]])
    assert out["advantages"][0] == pytest.approx([0.75, 1.0])
    assert out["advantages"][1] == pytest.approx([-0.5])
    assert out["kl"] == pytest.approx((0.5 + 0.0 - 1.0) / 3)


def test_reinforce_pp_with_kl_in_the_reward_is_whitened_over_the_batch_tokens() -> None:
    a = Algorithm(name="reinforce++", klCoef=0.1, klMode="reward")
    out = advantages.plan(a, [1.0, 0.0, 0.5], 1, [2, 3, 1], logp=[[-1.0, -2.0], [-1.0, -1.0, -1.0], [-3.0]],
                          ref=[[-1.0, -1.0], [-2.0, -1.0, -1.0], [-1.0]])
    flat = [x for row in out["advantages"] for x in row]
    mean = sum(flat) / len(flat)
    var = sum((x - mean) ** 2 for x in flat) / len(flat)
    assert [len(r) for r in out["advantages"]] == [2, 3, 1]
    assert mean == pytest.approx(0.0, abs=1e-6) and var == pytest.approx(1.0, rel=1e-4)


def test_secret_env_is_left_to_the_kubelet() -> None:
    spec = RLHFJobSpec.model_validate({
        "model": {"name": "m"}, "image": "i", "data": {"prompts": ["a"]}, "reward": {"rule": "length"},
        "env": [EnvVar(name="A", value="1").wire(),
                {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "s", "key": "token"}}}]})
    assert spec_env(spec) == {"A": "1"}  # an empty HF_TOKEN would override the pod's own
