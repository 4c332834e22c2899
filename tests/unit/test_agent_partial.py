"""Partial rollouts (``weightSync.mode: async`` with ``spec.environment``): the policy version of every sampled token,
the staleness of trained trajectories, and the groups a step trains, carries over or drops
(``rlhf_runtime.agent.partial``, ``controller.agent_experience.AgentStream``)."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import pytest
from rlhf_testing.tiny_chat import build_chat_tokenizer

from rlhf_api.environment import Environment
from rlhf_api.models import WeightSync
from rlhf_runtime.agent.chat import ChatTokens, Trajectory, stop_ids
from rlhf_runtime.agent.environments import Environments
from rlhf_runtime.agent.metrics import EngineLoad
from rlhf_runtime.agent.partial import launch_until, select, staleness, summary, turn_versions
from rlhf_runtime.agent.rollout import AgentRollout
from rlhf_runtime.agent.tools import Tools
from rlhf_runtime.algo.dataset import Sample
from rlhf_runtime.controller.agent_experience import AgentExperience
from rlhf_runtime.controller.deadlines import Deadlines, Watchdog


# ------------------------------------------------------------------------------------------- pure parts
def test_a_turn_paused_by_a_sync_records_both_versions() -> None:
    assert turn_versions(4, 3, 3, -1) == [3, 3, 3, 3]
    assert turn_versions(5, 3, 4, 2) == [3, 3, 4, 4, 4]  # paused after 2 tokens, resumed on version 4
    assert turn_versions(3, 3, 4, -1) == [3, 3, 3]  # finished before the swap (or sent during it): the older
    assert turn_versions(3, 3, 3, 1) == [3, 3, 3]  # back before the driver moved its version: the older
    assert turn_versions(2, 0, 1, 5) == [0, 0] and turn_versions(2, 0, 1, 0) == [1, 1]


def test_trajectory_versions_oldest_and_mixed() -> None:
    t = Trajectory([1, 2])
    t.add_turn([3, 4], None, [0, 0])
    t.add_observation([5, 6, 7])
    assert t.oldest_version() == 0 and not t.mixed_versions()
    t.add_turn([8, 9], None, [0, 1])
    assert t.versions == [0, 0, -1, -1, -1, 0, 1] and len(t.versions) == len(t.response)
    assert t.oldest_version() == 0 and t.mixed_versions()
    assert Trajectory([1]).oldest_version() is None and staleness(5, None) == 0 and staleness(5, 3) == 2
    t.add_turn([10], None)  # no versions given: none recorded for the token
    assert t.versions[-1] == -1 and t.oldest_version() == 0


def test_launches_stay_within_the_bound_of_the_engines_weights() -> None:
    assert launch_until(0, 0, 1, 10) == 1  # one step ahead of the weights
    assert launch_until(4, 4, 2, 10) == 6
    assert launch_until(4, 4, 0, 10) == 4  # 0: the step's own batch only
    assert launch_until(4, 3, 1, 10) == 4  # weights a step behind (everyNSteps 2): still the step's own
    assert launch_until(8, 8, 3, 10) == 9  # never past the run's last step


class G:
    def __init__(self, name: str, finished: bool, oldest: int | None) -> None:
        self.name, self._finished, self._oldest = name, finished, oldest

    def finished(self) -> bool:
        return self._finished

    def oldest(self) -> int | None:
        return self._oldest


def names(groups: list[G]) -> list[str]:
    return [g.name for g in groups]


def test_a_step_takes_the_first_finished_groups_and_drops_the_stale() -> None:
    groups = [G("slow", False, 2), G("old", True, 1), G("a", True, 3), G("b", True, 2), G("c", True, 3)]
    taken, stale = select(groups, 2, 3, 1)
    assert names(taken) == ["a", "b"] and names(stale) == ["old"]  # launch order, unfinished ones carry over
    taken, stale = select(groups, 4, 3, 1)
    assert taken == [] and names(stale) == ["old"]  # not yet a full batch: wait
    taken, stale = select(groups, 2, 3, 2)
    assert names(taken) == ["old", "a"] and stale == []
    assert select([G("x", True, None)], 1, 9, 0)[0][0].name == "x"  # no sampled token: nothing stale
    # a group still running whose oldest token is already past the bound: dropped now, not when it finishes
    taken, stale = select([*groups, G("doomed", False, 1)], 2, 3, 1)
    assert names(taken) == ["a", "b"] and names(stale) == ["old", "doomed"]


def test_the_step_record() -> None:
    s = summary([0, 1, 1, 0, 1], 2, 4, 3)
    assert s == {"staleness_max": 1, "staleness_mean": 0.6, "staleness_histogram": {"0": 2, "1": 3},
                 "mixed_version_trajectories": 2, "stale_dropped": 4, "carried_groups": 3}
    assert summary([], 0, 0, 0)["staleness_max"] == 0


def test_engine_busy_windows_carry_the_requests_in_flight() -> None:
    load = EngineLoad(2)
    load.start(0)
    time.sleep(0.02)
    nxt = load.carry()
    assert load.shares()[0] > 0.5 and load.shares()[1] == 0.0
    assert nxt.inflight == [1, 0]
    time.sleep(0.02)
    nxt.end(0)
    nxt.finish()
    assert nxt.shares()[0] > 0.5 and nxt.pick() == 0


# ------------------------------------------------------------------------------- the stream across steps
ANSWER = "the answer is 42"


class HeldEngine:
    """One engine actor's ``generate`` as the rollout calls it (``engine.generate.remote(prompts, sampling)``),
    in this process: a turn answers ``ANSWER`` once the test lets its prompt through (``held``: prompts that
    wait); a turn during which the test moved the policy version comes back as an async engine paused by a sync
    does, with the tokens before the swap counted in ``swap_index``."""

    def __init__(self, tok: Any, version: list[int]) -> None:
        self.tok, self.version, self.held, self.generate = tok, version, set(), self
        self.held_second: dict[str, int] = {}  # prompt -> the version on which its second turns never come back
        self.cancelled: list[str] = []  # prompts whose turn the rollout cancelled
        self.lock = threading.Lock()

    async def remote(self, prompts: list[list[int]], sampling: dict[str, Any]) -> list[dict[str, Any]]:
        text = self.tok.decode(prompts[0], skip_special_tokens=False)
        name = text.split("<|im_start|>user\n", 1)[1].split("<|im_end|>", 1)[0]
        sent = self.version[0]
        second = "go on" in text
        try:
            while True:
                with self.lock:
                    if name not in self.held and not (second and self.held_second.get(name) == sent):
                        break
                await asyncio.sleep(0.002)
        except asyncio.CancelledError:
            self.cancelled.append(name)
            raise
        ids = list(self.tok.encode(ANSWER, add_special_tokens=False)) + [self.tok.eos_token_id]
        swap = len(ids) // 2 if self.version[0] != sent else -1
        return [{"prompt_token_ids": prompts[0], "samples": [ids], "logprobs": [[-0.5] * len(ids)],
                 "finish_reasons": ["stop"], "swap_index": [swap]}]

    def hold(self, *names: str) -> None:
        with self.lock:
            self.held.update(names)

    def release(self, *names: str) -> None:
        with self.lock:
            self.held.difference_update(names)


@pytest.fixture(scope="module")
def chat(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, ChatTokens]:
    from transformers import AutoTokenizer

    path = tmp_path_factory.mktemp("chatml")
    build_chat_tokenizer(path, "chatml")
    tok = AutoTokenizer.from_pretrained(str(path))
    return tok, ChatTokens(tok, None, stop_ids(tok))


def experience(chat: tuple[Any, ChatTokens], version: list[int], max_staleness: int,
               env_class: str = "AnswerEnv") -> tuple[AgentExperience, HeldEngine]:
    tok, tokens = chat
    env = Environment(className=f"rlhf_testing.agent_envs:{env_class}", maxTurns=2, maxTokens=512)
    engine = HeldEngine(tok, version)
    rollout = AgentRollout(env, tokens, None, Tools(env), Environments(env), [engine], {}, 32)
    deadlines = Deadlines(60.0, lambda: 60.0, Watchdog(lambda: 60.0, lambda message: None))
    return AgentExperience(rollout, deadlines, WeightSync(mode="async", maxStaleness=max_staleness)), engine


def batch_of(step: int) -> list[Sample]:
    return [Sample(f"s{step}-{k}") for k in range(2)]


def trained(agent: AgentExperience, version: list[int], done: int, total: int = 4) -> tuple[list[str], dict]:
    batch, _ = agent.rollout_step(batch_of, 2, done, total, lambda: version[0])
    assert len(batch.items) == 4 and all(text == ANSWER for _, text in batch.items)  # a full batch every step
    return sorted({s.prompt for s, _ in batch.items}), dict(agent.last)


def test_groups_carry_over_resume_on_new_weights_and_are_dropped_past_the_bound(chat) -> None:
    version = [0]
    agent, engine = experience(chat, version, max_staleness=1)
    engine.hold("s0-1", "s1-1", "s2-0", "s2-1", "s3-1")
    # step 0 on version 0: batches 0 and 1 in flight; the first two groups to finish train, the others carry over
    prompts, rec = trained(agent, version, 0)
    assert prompts == ["s0-0", "s1-0"] and rec["staleness_histogram"] == {"0": 4}
    assert rec["carried_groups"] == 2 and rec["stale_dropped"] == 0 and rec["trajectories"] == 4
    # a sync to version 1 while the carried groups' turns are in flight: they come back on the new weights
    version[0] = 1
    engine.release("s0-1", "s1-1")
    prompts, rec = trained(agent, version, 1)
    assert prompts == ["s0-1", "s1-1"] and rec["staleness_histogram"] == {"1": 4}
    assert rec["mixed_version_trajectories"] == 4 and rec["paused_turns"] == 4 and rec["staleness_max"] == 1
    assert rec["carried_groups"] == 2  # batch 2, launched on version 1, still held
    version[0] = 2
    engine.release("s2-1", "s3-0")
    prompts, rec = trained(agent, version, 2)
    assert prompts == ["s2-1", "s3-0"] and rec["staleness_histogram"] == {"0": 2, "1": 2}
    # s2-0 was sent on version 1 and comes back at step 3: staleness 2, past the bound: dropped whole and its
    # prompt generated again, the step still trains a full batch
    version[0] = 3
    engine.release("s2-0", "s3-1")
    prompts, rec = trained(agent, version, 3)
    assert prompts == ["s2-0", "s3-1"] and rec["stale_dropped"] == 2 and rec["staleness_max"] <= 1
    assert rec["staleness_histogram"] == {"0": 2, "1": 2}
    assert agent.stream is not None and agent.stream.groups == []  # the last step: nothing left in flight
    assert {"agent_staleness_max", "agent_stale_dropped", "agent_carried_groups"} <= set(agent.stats())
    status = agent.status(4)
    assert (status["staleness_max"], status["stale_dropped"]) == (1, 2)


def test_a_running_group_past_the_bound_is_dropped_without_waiting_for_it(chat) -> None:
    """Two-turn trajectories (``GoOnEnv``): the 's0-1' group's first turns come back on version 0, its second turns
    never do. At step 2 its oldest tokens are 2 steps old, past ``maxStaleness`` 1, while it still runs: it is
    dropped then, its turns cancelled, and its prompt generated again on the new weights."""
    version = [0]
    agent, engine = experience(chat, version, max_staleness=1, env_class="GoOnEnv")
    engine.held_second["s0-1"] = 0
    prompts, rec = trained(agent, version, 0, total=3)
    assert prompts == ["s0-0", "s1-0"] and rec["carried_groups"] == 2
    version[0] = 1
    prompts, rec = trained(agent, version, 1, total=3)
    assert "s0-1" not in prompts and rec["stale_dropped"] == 0  # one step old: within the bound, still running
    version[0] = 2
    prompts, rec = trained(agent, version, 2, total=3)
    assert "s0-1" in prompts and rec["stale_dropped"] == 2 and rec["staleness_max"] <= 1, (prompts, rec)
    deadline = time.monotonic() + 10
    while engine.cancelled.count("s0-1") < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert engine.cancelled.count("s0-1") == 2, engine.cancelled  # the dropped group's held turns, cancelled


def test_max_staleness_0_rolls_out_the_step_alone_and_sync_mode_records_staleness(chat) -> None:
    version = [0]
    agent, engine = experience(chat, version, max_staleness=0)
    prompts, rec = trained(agent, version, 0, total=2)
    assert prompts == ["s0-0", "s0-1"] and rec["carried_groups"] == 0
    tokens = chat[1]
    env = Environment(className="rlhf_testing.agent_envs:AnswerEnv", maxTurns=2, maxTokens=512)
    sync = AgentExperience(AgentRollout(env, tokens, None, Tools(env), Environments(env), [engine], {}, 32),
                           agent.deadlines, WeightSync(everyNSteps=2))
    version[0] = 4  # sync mode, everyNSteps 2: step 5's rollout samples the weights of step 4
    prompts, rec = trained(sync, version, 5, total=8)
    assert prompts == ["s5-0", "s5-1"] and rec["staleness_histogram"] == {"1": 4} and sync.stream is None


def test_syncs_rarer_than_the_bound_allows_are_refused(chat) -> None:
    with pytest.raises(ValueError, match=r"everyNSteps 3 exceeds weightSync.maxStaleness \+ 1 \(2\)"):
        AgentExperience(None, None, WeightSync(mode="async", everyNSteps=3, maxStaleness=1))  # type: ignore[arg-type]


def test_staleness_bound_bounds() -> None:
    from pydantic import ValidationError

    assert WeightSync().max_staleness == 1
    for bad in (-1, 65):
        with pytest.raises(ValidationError):
            WeightSync(maxStaleness=bad)
