"""The algorithms beyond GRPO on real Ray + vLLM (CPU): PPO with a critic, a reward model and a reference of
their own; RLOO and REINFORCE++ with the KL penalty in the reward; the trained model exported and checked
against the synced engine; an eval set."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.runtime.conftest import built, job_config, start_driver, write_config

pytestmark = pytest.mark.runtime


@pytest.fixture(scope="module")
def reward_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny sequence-classification reward model whose score rises with the share of '7' in the text."""
    return built(tmp_path_factory, "tiny-rm", "rlhf_testing.tiny:build_tiny_reward_model", "target='7'")


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)


def test_ppo_with_critic_and_reward_model_learns_exports_and_resumes(tiny_model: Path, reward_model: Path,
                                                                      tmp_path: Path) -> None:
    """PPO learns against a reward model (separate) with a critic (colocated) and a reference (separate), is
    evaluated before its first step and every 8 steps, exports and checkpoints; a second run on the same
    checkpoint volume, its critic now FSDP2 over two workers in a group of their own and the reward model
    colocated, resumes the policy and every critic rank at the same step."""
    out, ckpt = tmp_path / "out", tmp_path / "ckpt"
    spec = job_config(
        tiny_model,
        algorithm={"name": "ppo", "steps": 16, "promptsPerStep": 8, "learningRate": 3e-3, "klCoef": 0.01,
                   "klMode": "reward", "ppo": {"gamma": 1.0, "lambda": 0.95, "criticLearningRate": 3e-3}},
        rollout={"engines": 1, "tensorParallelSize": 1, "gpuMemoryUtilization": 0.05, "maxModelLen": 96,
                 "sampling": {"temperature": 1.0, "maxTokens": 4, "samplesPerPrompt": 4}},
        reward={"model": {"name": str(reward_model), "placement": "separate", "batchSize": 8}},
        critic={"placement": "colocated"},
        reference={"placement": "separate"},
        data={"prompts": ["abc", "hello", "xyz", "12", "q", "say", "go", "rl"],
              "eval": {"prompts": ["abc", "go", "q"]}, "evalEveryNSteps": 8, "evalOnStart": True},
        output={"volume": "out", "path": str(out), "everyNSteps": 8},
        checkpoint={"volume": "ckpt", "path": str(ckpt), "everyNSteps": 8},
        volumes=[{"name": "out", "emptyDir": {}}, {"name": "ckpt", "emptyDir": {}}],
        weightSync={"validate": True},
    )
    run = start_driver(tmp_path, write_config(tmp_path / "job.json", spec), name="first")
    assert run.wait(timeout=600) == 0, run.tail()
    records = run.records()
    steps = run.steps()
    assert [r["step"] for r in steps] == list(range(1, 17))
    rewards = [r["throughput"]["rewardMean"] for r in steps]
    assert _mean(rewards[-4:]) > _mean(rewards[:4]) + 0.05, rewards  # the reward model's score rises
    for r in steps:
        tp, train = r["throughput"], r["train"]
        assert tp["rewardSeconds"] > 0 and tp["referenceSeconds"] > 0 and tp["criticSeconds"] > 0, tp
        assert "value_loss" in train and train["kl_in_reward"] >= 0, train
    # exported every 8 steps and at the end, in Hugging Face format, with the tokenizer
    assert (out / "step-8" / "config.json").is_file() and (out / "final" / "model.safetensors").is_file()
    assert (out / "final" / "tokenizer.json").is_file()
    assert not [p.name for p in out.iterdir() if p.name.startswith(".")]  # no temporary leftovers
    outputs = [r["output"] for r in records if "output" in r]
    assert outputs[-1]["path"] == str(out / "final") and outputs[-1]["step"] == 16
    # the exported model gives the synced engine's greedy tokens, token for token
    exported = [r["export_validation"] for r in records if "export_validation" in r]
    assert exported and exported[0]["validated"] and exported[0]["synced"] == exported[0]["fresh"], exported
    evals = [r["eval"] for r in records if "eval" in r]
    assert [e["step"] for e in evals] == [0, 8, 16] and all(e["prompts"] == 3 for e in evals), evals
    assert records[-1]["runtime"]["state"] == "Succeeded"
    assert (ckpt / "critic" / "step-00000016" / "state.json").is_file()

    spec = {**{k: v for k, v in spec.items() if k != "output"}, "algorithm": {**spec["algorithm"], "steps": 18},
            "critic": {"placement": "separate", "replicas": 2},
            "reward": {"model": {"name": str(reward_model), "placement": "colocated"}},
            "data": {k: v for k, v in spec["data"].items() if k not in ("eval", "evalEveryNSteps", "evalOnStart")}}
    second = start_driver(tmp_path, write_config(tmp_path / "job2.json", spec), name="second")
    assert second.wait(timeout=400) == 0, second.tail()
    roles = next(r["roles"] for r in second.records() if "roles" in r)
    assert [c["resumed_from"] for c in roles["critic"]] == [16, 16], roles
    assert [r["step"] for r in second.steps()] == [17, 18]
    assert (ckpt / "critic" / "step-00000018" / "state.json").is_file()


@pytest.mark.parametrize("name,extra", [
    ("rloo", {"klCoef": 0.01, "klMode": "reward"}),
    ("reinforce++", {"klCoef": 0.01, "klMode": "reward", "clipRatioHigh": 0.28, "lossAggregation": "sequence"}),
])
def test_critic_free_algorithms_train_ten_steps(tiny_model: Path, tmp_path: Path, name: str,
                                                extra: dict) -> None:
    """Each runs 10 steps with weight sync every step, the reference in an actor of its own beside the trainer.
    (GRPO with the same: ``test_grpo_learns_with_weight_sync_every_step_and_validation``.)"""
    spec = job_config(tiny_model, algorithm={"name": name, "steps": 10, "learningRate": 3e-3, **extra},
                      reference={"placement": "colocated"})
    run = start_driver(tmp_path, write_config(tmp_path / "job.json", spec))
    assert run.wait(timeout=400) == 0, run.tail()
    steps = run.steps()
    assert [r["step"] for r in steps] == list(range(1, 11))
    for r in steps:
        assert r["throughput"]["referenceSeconds"] > 0 and r["sync"]["bytes"] > 0, r
    rewards = [r["throughput"]["rewardMean"] for r in steps]
    assert _mean(rewards[-3:]) > _mean(rewards[:3]), rewards
