"""Multi-turn rollouts (``spec.environment``) through the real driver: real Ray, real vLLM (CPU) engines, the
builtin python tool in its isolated process, an environment class, GRPO on the trajectories.

The tiny model is random: ``rlhf_testing.driver --turn-script`` makes the engine generate each scripted turn's
text under vLLM's structured outputs, so every trajectory makes the calls its prompt names: a tool call that
answers, one that hangs past its timeout, a malformed call, a call to a tool that does not exist, and a turn that
crashes the environment. Every fault must become data (an error observation), none may fail the run."""

from __future__ import annotations

import json
from pathlib import Path

from tests.runtime.conftest import job_config, start_driver, write_config

CALL = '<tool_call>{"name": "python", "arguments": {"code": "%s"}}</tool_call>'
SCRIPT = {
    "ok": [CALL % "print(6*7)", "the answer is 42"],
    "hang": [CALL % "while True: pass", "the answer is 42"],
    "bad": ['<tool_call>{"name": "python", "arguments": {"code": "print(1)"</tool_call>', "no"],
    "nosuch": ['<tool_call>{"name": "shell", "arguments": {}}</tool_call>', "the answer is 42"],
    "crash": ["crash"],
}
PYTHON = {"name": "python", "builtin": "python", "description": "run Python code and see what it prints",
          "parameters": {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]}}


def test_tool_calls_environment_and_faults_train_without_failing_the_run(tiny_chat_model: Path,
                                                                        tmp_path: Path) -> None:
    spec = job_config(
        tiny_chat_model,
        algorithm={"steps": 2, "promptsPerStep": len(SCRIPT)},
        data={"prompts": list(SCRIPT)},
        reward={},
        rollout={"maxModelLen": 768, "sampling": {"temperature": 1.0, "maxTokens": 120, "samplesPerPrompt": 2}},
        environment={"className": "rlhf_testing.agent_envs:AnswerEnv", "tools": [PYTHON], "toolParser": "hermes",
                     "maxTurns": 3, "maxTokens": 760, "python": {"timeoutSeconds": 2}, "errorWarningFraction": 0.25},
    )
    cfg = write_config(tmp_path / "job.json", spec)
    script = tmp_path / "script.json"
    script.write_text(json.dumps(SCRIPT))
    run = start_driver(tmp_path, cfg, "--turn-script", str(script), hooks=True)
    assert run.wait(timeout=600) == 0, run.tail()
    steps = run.steps()
    assert [r["step"] for r in steps] == [1, 2]
    for r in steps:
        agent = r["agent_rollout"]
        status = r["agent"]  # status.agent, as the RLHFJob gets it
        assert status["step"] == r["step"] and status["errors"] == agent["tool_errors"]
        # 12 faults in 40 calls: 6 tool calls, 2 malformed ones, 10 resets and 22 steps of the environment
        assert abs(status["faultShare"] - 12 / 40) < 1e-3 and "errorWarningFraction 0.25" in status["warning"]
        assert agent["trajectories"] == 2 * len(SCRIPT)
        errors = agent["tool_errors"]
        # per step: 2 trajectories each of hang, bad, nosuch; crash's 2 trajectories fail on every turn (3)
        assert (errors["timeout"], errors["malformed_call"], errors["unknown_tool"], errors["environment"]) == \
            (2, 2, 2, 6), agent
        assert agent["ended"] == {"done": 8, "max_turns": 2}, agent
        assert agent["tool_calls"] == 6 and agent["turns_max"] == 3 and agent["turns_mean"] > 1.5
        assert agent["engine_busy_share"] is not None and 0 < agent["engine_busy_share"] <= 1
        assert agent["turn_overhead_p50_ms"] is not None
        # 'ok', 'hang' and 'nosuch' end with "the answer is 42" (reward 1), 'bad' and 'crash' do not
        assert abs(r["throughput"]["rewardMean"] - 0.6) < 1e-6, r["throughput"]
        assert r["train"]["agent_fault_share"] > 0
        # the tokens the engines sampled (trained on) are fewer than the trajectories' tokens after their
        # prompts (tool and environment tokens between the turns)
        assert 0 < r["tokens"] < r["train"]["response_length_mean"] * 2 * len(SCRIPT)
    log = run.log.read_text(errors="replace")
    assert "ScriptedEngine pid=" in log


def test_async_mode_trajectories_span_a_sync_within_the_staleness_bound(tiny_chat_model: Path,
                                                                        tmp_path: Path) -> None:
    """``weightSync.mode: async``: the rollout runs across steps, one batch ahead of the weights. A 'hold'
    trajectory's environment holds its first step until step 1 is trained, so those launched before step 1's sync
    finish after it, on the new weights: step 1 trains the 'fast' groups and carries the 'hold' ones over, and a
    later step trains them with tokens of two policy versions (staleness 1). No trained trajectory is older than
    ``maxStaleness``; one that would be is dropped and generated again."""
    spec = job_config(
        tiny_chat_model,
        algorithm={"steps": 3, "promptsPerStep": 2},
        data={"prompts": ["hold", "fast"]},
        rollout={"maxModelLen": 512, "sampling": {"temperature": 1.0, "maxTokens": 32, "samplesPerPrompt": 2}},
        weightSync={"mode": "async", "maxStaleness": 1},
        environment={"className": "rlhf_testing.agent_envs:HeldAnswerEnv", "maxTurns": 3, "maxTokens": 500},
    )
    cfg = write_config(tmp_path / "job.json", spec)
    script = tmp_path / "script.json"
    script.write_text(json.dumps({"hold": ["let me think", "the answer is 42"], "fast": ["the answer is 42"]}))
    run = start_driver(tmp_path, cfg, "--turn-script", str(script), hooks=True,
                       env={"RLHF_TEST_PROGRESS": str(tmp_path / "run.progress.jsonl")})
    assert run.wait(timeout=600) == 0, run.tail()
    steps = run.steps()
    assert [r["step"] for r in steps] == [1, 2, 3]
    records = [r["agent_rollout"] for r in steps]
    for r, agent in zip(steps, records):
        # a full batch of 2 groups x 2 trajectories every step, none older than maxStaleness
        assert sum(agent["staleness_histogram"].values()) == 4, agent
        assert agent["staleness_max"] <= 1 and r["agent"]["stalenessMax"] == agent["staleness_max"], agent
        assert r["train"]["agent_staleness_max"] == agent["staleness_max"]
        assert abs(r["throughput"]["rewardMean"] - 1.0) < 1e-6, r["throughput"]  # every trained one answered
    # step 1 (weights of step 0): the 'fast' groups of the first two batches; the 'hold' ones carry over
    assert records[0]["staleness_histogram"] == {"0": 4} and records[0]["carried_groups"] == 2, records[0]
    # a 'hold' group began on version 0 and ended on version 1: tokens of both versions, staleness 1
    assert sum(a["mixed_version_trajectories"] for a in records) >= 2, records
    assert sum(a["staleness_histogram"].get("1", 0) for a in records) >= 2, records
