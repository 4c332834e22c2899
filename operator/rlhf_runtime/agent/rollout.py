"""The multi-turn rollout: every trajectory of a step advancing on its own (``spec.environment``).

``AgentRollout.run(samples, n)`` runs ``n`` trajectories per sample at once on one asyncio loop. A trajectory's
turn goes to an engine as soon as its previous observation is ready (each engine is a vLLM ``AsyncLLM`` or
stepped engine, which batches whatever requests are in flight: no lockstep over the batch), to the engine with
the fewest requests in flight. Its tool calls and environment steps run concurrently with every other
trajectory's generation, at most ``environment.concurrency`` at a time.

A trajectory (``chat.Trajectory``) is built token in, token out: the first prompt from the chat template, then
the engine's sampled ids as they are (loss mask 1, with the engine's log-probabilities), then each observation's
template tokens (mask 0). It ends when the environment says done (``ToolsOnly``: a turn without a tool call),
at ``maxTurns``, when the token budget ``maxTokens`` has no room for another turn, or when a turn is cut at its
length (no stop token: the template cannot continue it). Faults are data (``Counters``): a malformed call, a
tool's error, timeout or oversized output, an environment's exception or error answer become an error
observation (``onError: observation``) or end the trajectory with reward 0 (``zeroReward``). Only
``EnvironmentUnreachable`` (a server down past its deadline) leaves the rollout, and fails the run.

Every sampled token records the policy version that sampled it (``version``: the engines' weights, read when a
turn is sent and when it comes back; ``partial.turn_versions``). ``run`` is one rollout of a batch with counters
of its own; a rollout that runs across steps (``weightSync.mode: async``) starts once (``begin``), launches
``trajectory`` as it goes and takes each step's counts with ``window``.
"""

from __future__ import annotations

import asyncio
import copy
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from rlhf_api.environment import Environment as EnvironmentSpec
from rlhf_runtime.agent.calls import Call, CallParser, Parsed
from rlhf_runtime.agent.chat import ChatTokens, TemplateError, Trajectory
from rlhf_runtime.agent.environments import (
    EnvironmentFault,
    Environments,
    Step,
    ToolsOnly,
    first_messages,
    sample_dict,
)
from rlhf_runtime.agent.metrics import Counters, EngineLoad
from rlhf_runtime.agent.partial import Oldest, turn_versions
from rlhf_runtime.agent.tools import Outcome, Tools


@dataclass
class Result:
    """One finished trajectory: its tokens, the environment's reward (sum of its steps'; None if it gave none),
    whether ``zeroReward`` zeroed it, its last assistant content (what ``spec.reward`` scores), its turns and why
    it ended (``done``, ``max_turns``, ``budget``, ``length``, ``error``)."""

    sample: Any
    traj: Trajectory
    reward: float | None = None
    zeroed: bool = False
    final_text: str = ""
    turns: int = 0
    ended: str = "done"
    messages: list[dict[str, Any]] = field(default_factory=list)
    oldest: Oldest = field(default_factory=Oldest)


class AgentRollout:
    """One job's multi-turn rollout (module docstring). ``engines``: the engine actor handles; ``sampling``: the
    job's sampling kwargs (``n`` and ``max_tokens`` are set per turn here)."""

    def __init__(self, spec: EnvironmentSpec, chat: ChatTokens, parser: CallParser | None, tools: Tools,
                 environments: Environments, engines: list[Any], sampling: dict[str, Any],
                 default_turn_tokens: int) -> None:
        self.spec, self.chat, self.parser, self.tools, self.envs = spec, chat, parser, tools, environments
        self.engines = engines
        self.job_sampling = sampling
        self.sampling: dict[str, Any] = {}
        self.turn_tokens = spec.max_tokens_per_turn or default_turn_tokens
        self.counters = Counters()
        self.load = EngineLoad(len(engines))
        self.sem: asyncio.Semaphore | None = None
        self.version: Callable[[], int] = lambda: 0  # the engines' policy version (the driver's weight sync)

    def begin(self, sampling: dict[str, Any] | None = None) -> None:
        """Start a rollout: ``sampling`` (instead of the job's: evaluation's greedy), new counters."""
        self.sampling = {k: v for k, v in (sampling or self.job_sampling).items() if k not in ("n", "max_tokens")}
        self.sem = asyncio.Semaphore(self.spec.concurrency)
        self.counters = Counters()
        self.load = EngineLoad(len(self.engines))

    def fork(self) -> AgentRollout:
        """The same parts (chat, parser, tools, environments, engines) for a rollout of its own beside this one's:
        ``run`` and ``begin`` replace the copy's counters and sampling, never this one's."""
        return copy.copy(self)

    def window(self) -> dict[str, Any]:
        """The counts since ``begin`` or the last window (``Counters.summary``), then new counters; on the
        rollout's event loop."""
        load, self.load = self.load, self.load.carry()
        out = self.counters.summary(load.shares())
        self.counters = Counters()
        return out

    async def run(self, samples: list[Any], n: int, sampling: dict[str, Any] | None = None) -> list[Result]:
        """``n`` trajectories of each sample, in order (sample 0's n, then sample 1's, ...); ``sampling``: for
        this run instead of the job's (evaluation: greedy)."""
        self.begin(sampling)
        tasks = [self.trajectory(s) for s in samples for _ in range(n)]
        results = list(await asyncio.gather(*tasks))
        self.load.finish()
        return results

    # --------------------------------------------------------------------------------------- one trajectory
    async def trajectory(self, sample: Any, oldest: Oldest | None = None) -> Result:
        """One trajectory of ``sample`` in a tool session of its own (``Tools.session``: with
        environment.sandbox, the trajectory's sandbox, released when it ends); ``oldest``: set to the version of
        its oldest sampled token when its first turn is back (``partial``)."""
        async with self.tools.session() as tools:
            res = await self._trajectory(sample, oldest or Oldest())
        self.counters.claim_seconds += tools.claim_seconds
        return res

    async def _trajectory(self, sample: Any, oldest: Oldest) -> Result:
        env = self.envs.make(uuid.uuid4().hex)
        res = Result(sample, Trajectory([]), oldest=oldest)
        try:
            start = await self._reset(env, sample, res)
            if start is not None:
                try:
                    res.traj = Trajectory(self.chat.prompt_ids(start))
                except TemplateError as e:  # the environment's first messages cannot be rendered
                    self.counters.error("environment", str(e))
                    res.traj = Trajectory(self.chat.prompt_ids(first_messages(sample)))
                    res.zeroed, res.ended = True, "error"
                    start = None
            if start is not None:
                res.messages = list(start)
                await self._turns(env, res)
        finally:
            close = getattr(env, "close", None)
            if close is not None:
                await close()
        self.counters.trajectory(res.turns, res.ended)
        return res

    async def _reset(self, env: Any, sample: Any, res: Result) -> list[dict[str, Any]] | None:
        if isinstance(env, ToolsOnly):
            return first_messages(sample)
        t0 = time.perf_counter()
        try:
            async with self._slot():
                msgs = await env.reset(sample_dict(sample))
        except EnvironmentFault as e:  # no first prompt: the trajectory is the sample's prompt, reward 0
            self.counters.error("environment", str(e))
            res.traj, res.zeroed, res.ended = Trajectory(self.chat.prompt_ids(first_messages(sample))), True, "error"
            return None
        finally:
            self.counters.env_latency(time.perf_counter() - t0)
        return msgs or first_messages(sample)

    async def _turns(self, env: Any, res: Result) -> None:
        traj = res.traj
        while True:
            left = self.spec.max_tokens - len(traj)
            if left <= 0:
                res.ended = "budget"
                return
            ids, lps, versions = await self._generate(traj, min(self.turn_tokens, left))
            t_turn = time.perf_counter()
            traj.add_turn(ids, lps, versions)
            res.turns += 1
            if res.turns == 1:
                res.oldest.version = traj.oldest_version()
            parsed = self.parser.parse(self.chat.text(ids)) if self.parser else Parsed(self.chat.text(ids))
            res.final_text = parsed.content
            if not self.chat.ended(ids):
                res.ended = "length"
                return
            step, busy = await self._answer(env, parsed, res)
            if step is None:
                return
            if step.reward is not None:
                res.reward = (res.reward or 0.0) + step.reward
            if step.done or res.turns >= self.spec.max_turns:
                res.ended = "done" if step.done else "max_turns"
                return
            try:
                obs = self.chat.observation_ids(step.observations)
            except TemplateError as e:  # observations the chat template cannot render: the environment's fault
                self.counters.error("environment", str(e))
                res.zeroed, res.ended = self.spec.on_error == "zeroReward", "error"
                return
            if len(traj) + len(obs) >= self.spec.max_tokens:
                res.ended = "budget"
                return
            traj.add_observation(obs)
            res.messages += step.observations
            self.counters.overhead(time.perf_counter() - t_turn - busy)

    async def _generate(self, traj: Trajectory, max_tokens: int) -> tuple[list[int], list[float] | None, list[int]]:
        """One turn on the least busy engine: its sampled ids, their log-probabilities and policy versions."""
        traj.turn_starts.append(len(traj))
        i = self.load.pick()
        self.load.start(i)
        sent = self.version()
        call = self.engines[i].generate.remote([traj.ids()], {**self.sampling, "n": 1, "max_tokens": max_tokens})
        try:
            out = await call
        except asyncio.CancelledError:  # a dropped group's turn: the engine ends its request instead of finishing it
            cancel_call(call)
            raise
        finally:
            self.load.end(i)
        ids = list(out[0]["samples"][0])
        swap = (out[0].get("swap_index") or [-1])[0]
        if 0 < swap < len(ids):
            self.counters.paused_turns += 1
        lps = (out[0].get("logprobs") or [None])[0]
        return ids, lps, turn_versions(len(ids), sent, self.version(), swap)

    async def _answer(self, env: Any, parsed: Parsed, res: Result) -> tuple[Step | None, float]:
        """Run the turn's calls, then the environment's step on it; ``(None, s)`` when the trajectory ends on a
        fault under ``zeroReward``. Also the seconds spent waiting on tools and the environment."""
        t0 = time.perf_counter()
        results: list[dict[str, Any]] = []
        failed = False
        if parsed.error:
            self.counters.error("malformed_call", parsed.error)
            results.append({"role": "tool", "content": f"error: {parsed.error}"})
            failed = True
        outcomes = await asyncio.gather(*(self._call(c) for c in parsed.calls))
        for c, o in zip(parsed.calls, outcomes):
            results.append({"role": "tool", "name": c.name, "content": o.text})
            failed = failed or o.error is not None
        message = {"role": "assistant", "content": parsed.content, "tool_results": results,
                   "tool_calls": [{"type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                                  for c in parsed.calls]}
        if failed and self.spec.on_error == "zeroReward":
            res.zeroed, res.ended = True, "error"
            return None, time.perf_counter() - t0
        step = await self._step(env, message)
        if step is None and self.spec.on_error == "zeroReward":
            res.zeroed, res.ended = True, "error"
            return None, time.perf_counter() - t0
        return step or Step([{"role": "user", "content": "error: the environment failed on this turn"}]), \
            time.perf_counter() - t0

    async def _call(self, call: Call) -> Outcome:
        async with self._slot():
            out = await self.tools.call(call)
        self.counters.tool(out.seconds, out.error, out.text)
        return out

    async def _step(self, env: Any, message: dict[str, Any]) -> Step | None:
        if isinstance(env, ToolsOnly):  # no environment to wait on: the tool results are the observations
            return await env.step(message)
        t0 = time.perf_counter()
        try:
            async with self._slot():
                return await env.step(message)
        except EnvironmentFault as e:
            self.counters.error("environment", str(e))
            return None
        finally:
            self.counters.env_latency(time.perf_counter() - t0)

    def _slot(self) -> asyncio.Semaphore:
        assert self.sem is not None, "run() sets the concurrency bound"
        return self.sem


def cancel_call(call: Any) -> None:
    """Cancel an engine actor's call still running (a Ray ``ObjectRef``): the async actor's coroutine gets
    ``CancelledError`` and the engine aborts the request (``requests_aborted`` counts them)."""
    import ray

    if isinstance(call, ray.ObjectRef):
        ray.cancel(call)
