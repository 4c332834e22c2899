"""``benchmarks/agent_rollout.py``'s pure parts: the scripted turns and fault plans, what the runtime should count of
them, and the result's assembly (warm-up left out, arms paired by round, trajectories off their plan found); and
``rlhf_testing.agent_faults.FaultServer``'s answers to the turns that ask it to fail."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import agent_rollout as ar
from rlhf_testing.agent_faults import HTTP_MARKER, FaultServer

CALL = re.compile(r"<tool_call>(.*?)</tool_call>")


def calls(text: str) -> list[Any]:
    """Each call's JSON body, or None where it is not JSON."""
    out = []
    for body in CALL.findall(text):
        try:
            out.append(json.loads(body))
        except ValueError:
            out.append(None)
    return out


def test_perf_script_gives_every_trajectory_the_same_rounds_of_the_timed_tool() -> None:
    script = ar.perf_script(8, 3, seed=0)
    assert script == ar.perf_script(8, 3, seed=0) and script != ar.perf_script(8, 3, seed=1)
    assert len(script) == 8
    for turns in script.values():
        assert len(turns) == 4 and not calls(turns[-1])
        for k, turn in enumerate(turns[:-1]):
            (call,) = calls(turn)
            assert call["name"] == "wait" and call["arguments"]["query"].startswith(f"t{k}")
    assert len({len(t[0]) for t in script.values()}) > 1  # lengths differ: the trajectories drift apart


def test_fuzz_plan_and_its_script() -> None:
    plan = ar.fuzz_plan(20, "class", seed=0, reset_crashes=2)
    assert plan == ar.fuzz_plan(20, "class", seed=0, reset_crashes=2)
    prompts = list(plan)
    assert all("reset-crash" in p for p in prompts[:2]) and not any("reset-crash" in p for p in prompts[2:])
    kinds = {k for turns in plan.values() for t in turns for k in t}
    assert kinds <= set(ar.COUNTED_AS) and not any(k.startswith("http") for k in kinds)
    assert {"timeout", "exception", "malformed_call", "env_exception"} <= kinds
    script = ar.fuzz_script(plan)
    assert set(script) == set(prompts[2:])
    for p, texts in script.items():
        assert len(texts) == len(plan[p]) + 1 and texts[-1] == "done"
        assert len(set(texts)) == len(texts)  # the environment tells the turns apart
        for kinds_, text in zip(plan[p], texts, strict=False):
            parsed = calls(text)
            if "malformed_call" in kinds_:
                assert parsed == [None]
            else:
                assert all(isinstance(c, dict) for c in parsed) and parsed
            names = {c["name"] for c in parsed if c}
            assert ("unknown_tool" in kinds_) == ("nosuch" in names)
            assert ("env_exception" in kinds_) == ("crash" in text.split("<tool_call>")[0])
    http = ar.fuzz_plan(20, "http", seed=0)
    for p, texts in ar.fuzz_script(http).items():
        for kinds_, text in zip(http[p], texts, strict=False):
            marker = HTTP_MARKER.search(text.split("<tool_call>")[0])
            assert bool(marker) == any(k.startswith("http") for k in kinds_)


def test_what_the_runtime_should_count() -> None:
    plan = {"a": [["timeout", "invalid_utf8"], ["malformed_call", "http_5xx_down"]],
            "b": [["env_reset_exception"]], "c": [["http_5xx_flaky", "exception"], ["http_invalid_utf8", "echo"]]}
    plan["c"][1] = ["http_invalid_utf8"]
    inj = ar.injected(plan, 2)
    assert inj == {"env_reset_exception": 2, "exception": 2, "http_5xx_down": 2, "http_5xx_flaky": 2,
                   "http_invalid_utf8": 2, "invalid_utf8": 2, "malformed_call": 2, "timeout": 2}
    assert ar.expected_counted(inj) == {"environment": 6, "exception": 2, "invalid_utf8": 2, "malformed_call": 2,
                                        "timeout": 2}
    # an HTTP answer that is not UTF-8 is an environment fault (its error is the observation), a tool's is replaced
    assert ar.planned({"x": plan}) == {"a": {"turns": 3, "replaced": 1}, "b": {"turns": 0, "replaced": 0},
                                       "c": {"turns": 3, "replaced": 0}}
    # a turn whose environment step failed answers the error, not the tool's replaced bytes
    assert ar.planned({"x": {"d": [["invalid_utf8", "env_exception"]]}})["d"]["replaced"] == 0


def rollout(arm: str, rnd: int, busy: float | None, overhead: float = 1.0, **extra: Any) -> dict[str, Any]:
    return {"arm": arm, "round": rnd, "seconds": 10.0, "agent_rollout": {
        "engine_busy_share": busy, "turn_overhead_p50_ms": overhead, "tool_latency_p50_s": 0.2, "turns_mean": 4.0,
        "tool_errors": {}}, **extra}


def test_perf_summary_leaves_out_the_warm_up_and_pairs_the_arms_by_round() -> None:
    records = [rollout("continuous", -1, 0.1, overhead=100.0)]
    for r, (c, lock) in enumerate([(1.0, 0.5), (0.9, 0.9), (0.8, 0.4)]):
        records += [rollout("continuous", r, c, overhead=1.0 + r), rollout("lockstep", r, lock)]
    records.append({"arm": "lockstep", "round": 3, "seconds": 1.0, "error": "boom"})
    out = ar.perf_summary(records)
    assert out["continuous"]["engine_busy_share"] == {"median": 0.9, "min": 0.8, "max": 1.0, "n": 3}
    assert out["continuous"]["turn_overhead_p50_ms"] == {"median": 2.0, "min": 1.0, "max": 3.0, "n": 3}
    assert out["lockstep"]["engine_busy_share"]["median"] == 0.5
    assert out["busy_share_continuous_over_lockstep"] == {"median": 2.0, "min": 1.0, "max": 2.0, "n": 3}
    assert out["failed_rollouts"] == 1
    assert ar.spread([None, None]) is None


def test_fuzz_summary_and_targets() -> None:
    plans = {"class": {"p": [["timeout"], ["invalid_utf8"]], "q": [["env_reset_exception"]]}}
    good = {"arm": "class", "seconds": 1.0, "injected": ar.injected(plans["class"], 1),
            "agent_rollout": {"tool_errors": {"timeout": 1, "invalid_utf8": 1, "environment": 1}},
            "trajectories": [{"prompt": "p", "turns": 3, "ended": "done", "replaced": 1},
                             {"prompt": "q", "turns": 0, "ended": "error", "replaced": 0}]}
    out = ar.fuzz_summary([good], plans, {"ok": 3})
    assert out["failed_runs"] == 0 and out["trajectories_off_plan_count"] == 0
    assert out["faults_injected"] == 3 and out["faults_counted"] == 3
    assert out["faults_counted_by_kind"] == out["faults_counted_expected_by_kind"]
    assert out["observations_with_replacement_char"] == out["observations_with_replacement_char_expected"] == 1
    cut = {**good, "trajectories": [{"prompt": "p", "turns": 2, "ended": "budget", "replaced": 1}]}
    failed = {"arm": "http", "seconds": 1.0, "injected": {}, "error": "EnvironmentUnreachable: down"}
    out = ar.fuzz_summary([cut, failed], plans, {})
    assert out["failed_runs"] == 1 and out["trajectories_off_plan_count"] == 1

    perf = ar.perf_summary([rollout("continuous", 0, 0.85, overhead=1.5), rollout("lockstep", 0, 0.5)])
    t = ar.targets(perf, {"failed_runs": 0, "faults_injected": 200})
    assert t["turn_overhead_p50_ms"]["met"] and t["engine_busy_share"]["met"] and t["fault_fuzz"]["met"]
    perf = ar.perf_summary([rollout("continuous", 0, 0.79, overhead=2.5)])
    t = ar.targets(perf, {"failed_runs": 0, "faults_injected": 199})
    assert not (t["turn_overhead_p50_ms"]["met"] or t["engine_busy_share"]["met"] or t["fault_fuzz"]["met"])


def test_fault_server_fails_the_turns_that_ask() -> None:
    server = FaultServer()
    try:
        def step(content: str, episode: str = "e") -> tuple[int, bytes, str]:
            return server.answer("/step", {"episode_id": episode, "action": {"message": {
                "content": content, "tool_results": [{"role": "tool", "content": "r"}]}}})

        assert step("[http:down] 1")[0] == 503 and step("[http:down] 1")[0] == 503
        assert [step("[http:flaky] 2")[0] for _ in range(3)] == [503, 503, 200]
        assert step("[http:4xx] 3")[0] == 400
        status, body, _ = step("[http:garbage] 4")
        assert status == 200 and not body.startswith(b"{")
        status, body, _ = step("[http:badutf8] 5")
        assert status == 200 and "\ufffd" in json.loads(body.decode("utf-8", errors="replace"))["observation"]["text"]
        status, body, _ = step("fine")
        assert status == 200 and json.loads(body) == {"observation": {"messages": [{"role": "tool", "content": "r"}]},
                                                       "reward": None, "done": False}
        server.outage(60)
        assert server.answer("/reset", {"episode_id": "f"})[0] == 503
    finally:
        server.close()


def test_job_spec_is_a_valid_job_on_cpu_and_on_one_gpu(tmp_path: Path) -> None:
    from rlhf_api.models import RLHFJobSpec

    envs = ar.environments("http://127.0.0.1:1", 8)
    cpu, gpu = (RLHFJobSpec.model_validate(ar.job_spec(tmp_path, ["a", "b"], envs["continuous"], g))
                for g in (False, True))
    assert cpu.cpu_only() and cpu.trainer.gpus_per_replica == 0
    assert not gpu.cpu_only() and gpu.trainer.gpus_per_replica == 1 and gpu.placement.mode == "colocated"
    assert gpu.weight_sync.backend == "ipc" and gpu.environment == cpu.environment
