"""The driver's side of multi-turn rollouts (``spec.environment``): ``agent.rollout.AgentRollout`` on the job's
engines, run on an event loop in a thread of its own (the driver's loop is synchronous), and its trajectories as
the step's ``Samples``.

A trajectory becomes one sample: its first prompt as ``prompts``, everything after it as ``completions`` with
``loss_masks`` (1 on the engines' tokens, 0 on tool and environment tokens) and the engines' ``logprobs``; the
text ``spec.reward`` scores is its last assistant content; ``env_rewards`` the environment's reward; a trajectory
that ``zeroReward`` ended scores 0 whatever its sources say (``zeroed``).

A step's rollout (``rollout_step``): in ``weightSync.mode: sync``, the step's batch on the engines' weights. In
``async`` mode, ``AgentStream``: one rollout that runs across steps on an event loop of its own, launching each
batch's groups up to ``weightSync.maxStaleness`` steps ahead of the weights; a weight sync pauses its turns in
flight, which go on with the new weights; each step trains the first full batch of groups to finish and drops
those past the bound (``agent.partial``). Either way the step's record (``last``) holds the staleness of every
trained trajectory.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from rlhf_api.environment import server_url
from rlhf_api.models import RuntimeConfig
from rlhf_api.models import WeightSync as WeightSyncSpec
from rlhf_runtime.agent import partial
from rlhf_runtime.agent.calls import CallParser
from rlhf_runtime.agent.chat import ChatTokens, stop_ids
from rlhf_runtime.agent.environments import Environments
from rlhf_runtime.agent.rollout import AgentRollout, Result
from rlhf_runtime.agent.tools import Tools
from rlhf_runtime.controller.deadlines import WAIT_SLICE_SECONDS, DeadlineExceeded, Deadlines
from rlhf_runtime.controller.experience import Samples

log = logging.getLogger("rlhf_runtime")


@dataclass
class AgentLaunch:
    step: int
    batch: list[Any]
    future: Future[list[Result]]
    t_launch: float
    run: AgentRollout


def generation_config(model: str) -> dict[str, Any]:
    """The model's generation config (its ``eos_token_id``: the engines stop on it too), {} without one."""
    try:
        from transformers import GenerationConfig

        return GenerationConfig.from_pretrained(model).to_dict()
    except Exception:  # noqa: BLE001 - a model without generation_config.json
        return {}


def build_rollout(cfg: RuntimeConfig, tokenizer: Any, engines: Any, context: int | None,
                  sampling: dict[str, Any]) -> AgentRollout:
    """The job's ``AgentRollout`` on ``engines`` (the engine actors' group), every part checked (the budget
    against the engines' ``context``, template, parser, tools, environment class): a ValueError here names the
    field to change, before the first step."""
    spec = cfg.spec
    env = spec.environment
    assert env is not None
    if context is not None and env.max_tokens > context:
        raise ValueError(f"spec.environment.maxTokens {env.max_tokens} exceeds the engines' context of {context} "
                         "tokens (rollout.maxModelLen, else the model's): lower it or raise rollout.maxModelLen")
    tools = Tools(env, (cfg.name, cfg.namespace, cfg.uid))
    chat = ChatTokens(tokenizer, tools.schemas() or None, stop_ids(tokenizer, generation_config(spec.model.name)))
    parser = CallParser(tokenizer, env.tool_parser, tools.schemas()) if env.tools else None
    url = server_url(cfg.name, cfg.namespace, env) if env.http is not None and env.http.server else None
    return AgentRollout(env, chat, parser, tools, Environments(env, url), engines, sampling,
                        spec.rollout.sampling.max_tokens)


class AgentExperience:
    """Launch and collect a step's trajectories (module docstring). ``weight_sync``: the job's; async mode runs the
    rollout as an ``AgentStream``."""

    def __init__(self, rollout: AgentRollout, deadlines: Deadlines, weight_sync: WeightSyncSpec | None = None
                 ) -> None:
        self.rollout, self.deadlines = rollout, deadlines
        self.last: dict[str, Any] = {}
        self.ready = False  # the environment server answered its readiness path (``Environments.wait_ready``)
        self.bound: int | None = None  # weightSync.maxStaleness in async mode (None: sync mode)
        if weight_sync is not None and weight_sync.mode == "async":
            self.bound = weight_sync.max_staleness
            if weight_sync.every_n_steps - 1 > self.bound:  # admission refuses it too
                raise ValueError(f"weightSync.everyNSteps {weight_sync.every_n_steps} exceeds weightSync."
                                 f"maxStaleness + 1 ({self.bound + 1}): between syncs the engines' weights grow "
                                 "older than maxStaleness allows; lower everyNSteps or raise maxStaleness")
        self.stream: AgentStream | None = None

    def wait_ready(self) -> None:
        if not self.ready:
            self.deadlines.watchdog.doing("waiting for the environment server to be ready")
            self.rollout.envs.wait_ready()
            self.ready = True

    def rollout_step(self, batch_of: Callable[[int], list[Any]], n: int, done: int, total: int,
                     synced_at: Callable[[], int]) -> tuple[Samples, float]:
        """Step ``done``'s trajectories (``n`` per sample of ``batch_of(step)``, the prompts of a 0-based step) as
        ``Samples``, and the rollout's seconds; ``synced_at``: the engines' policy version (module docstring)."""
        self.wait_ready()
        self.rollout.version = synced_at
        if self.bound is None:
            launch = self.launch(batch_of(done), n, done, run=self.rollout.fork())
            results = self.collect(launch)
            seconds, dropped, carried = time.perf_counter() - launch.t_launch, 0, 0
        else:
            self.stream = self.stream or AgentStream(self.rollout, n, self.bound)
            groups, dropped = self.stream.take(batch_of, done, total, synced_at(), len(batch_of(done)), self.wait)
            results = [r for g in groups for r in g.results()]
            self.last, seconds = self.stream.window()
            carried = len(self.stream.groups)
        ages = [partial.staleness(done, r.traj.oldest_version()) for r in results]
        self.last.update(partial.summary(ages, sum(r.traj.mixed_versions() for r in results), dropped, carried))
        return to_samples(results), seconds

    def samples(self, batch: list[Any], n: int, step: int,
                sampling: dict[str, Any] | None = None) -> tuple[Samples, float]:
        """A rollout of ``n`` trajectories per sample of ``batch`` (``sampling``: instead of the job's) beside any
        other (evaluation), as ``Samples``, and its seconds."""
        self.wait_ready()
        launch = self.launch(batch, n, step, sampling, self.rollout.fork())
        results = self.collect(launch)
        return to_samples(results), time.perf_counter() - launch.t_launch

    def launch(self, batch: list[Any], n: int, step: int, sampling: dict[str, Any] | None = None,
               run: AgentRollout | None = None) -> AgentLaunch:
        fut: Future[list[Result]] = Future()
        run = run or self.rollout

        def go() -> None:
            try:
                fut.set_result(asyncio.run(run.run(batch, n, sampling)))
            except BaseException as e:  # noqa: BLE001 - handed to the driver's thread
                fut.set_exception(e)

        threading.Thread(target=go, name=f"agent-rollout-{step + 1}", daemon=True).start()
        return AgentLaunch(step, batch, fut, time.perf_counter(), run)

    def collect(self, launch: AgentLaunch) -> list[Result]:
        """The trajectories, bounded by what is left of ``progressDeadlineSeconds``; the step's ``agent`` record
        (``metrics.Counters.summary``) in ``last``."""
        while not launch.future.done():
            self.wait([launch.future], launch.step)
        results = launch.future.result()
        self.last = launch.run.counters.summary(launch.run.load.shares())
        return results

    def wait(self, futures: list[Future[Any]], step: int) -> None:
        """Wait for the first of ``futures`` (at most a slice) unless the watchdog fired or no progress is left of
        ``progressDeadlineSeconds``: then ``DeadlineExceeded``."""
        wd = self.deadlines.watchdog
        wd.doing(f"multi-turn rollout of step {step + 1}")
        if wd.fired:
            raise DeadlineExceeded(wd.fired)
        if wd.remaining() < -1.0:
            raise DeadlineExceeded(f"multi-turn rollout of step {step + 1} did not finish within "
                                   f"spec.progressDeadlineSeconds={self.deadlines.progress_deadline()}s")
        concurrent.futures.wait(futures, timeout=WAIT_SLICE_SECONDS, return_when=concurrent.futures.FIRST_COMPLETED)

    def stats(self) -> dict[str, float]:
        """The step's numeric ``agent`` figures as training statistics (``agent_*``: tracking, status)."""
        return {f"agent_{k}": float(v) for k, v in self.last.items()
                if isinstance(v, (int, float)) and not isinstance(v, bool)}

    def status(self, step: int) -> dict[str, Any]:
        """``status.agent`` of the step (``rlhf_api.environment.AgentStatus``, snake_case names)."""
        a = self.last
        warning = self.warning()
        if warning:
            log.warning("%s", warning)
        return {"step": step, "trajectories": a.get("trajectories"), "turns_mean": a.get("turns_mean"),
                "tool_calls": a.get("tool_calls"), "fault_share": a.get("fault_share"),
                "timeout_share": a.get("timeout_share"), "truncated_share": a.get("truncated_share"),
                "env_latency_p50_seconds": a.get("env_latency_p50_s"),
                "env_latency_p99_seconds": a.get("env_latency_p99_s"),
                "engine_busy_share": a.get("engine_busy_share"), "errors": a.get("tool_errors") or {},
                "sandbox_claims": a.get("sandbox_claims") or None, "sandbox_failures": a.get("sandbox_failures"),
                "sandbox_claim_p50_seconds": a.get("sandbox_claim_p50_s"),
                "sandbox_claim_p99_seconds": a.get("sandbox_claim_p99_s"),
                "staleness_max": a.get("staleness_max"), "staleness_mean": a.get("staleness_mean"),
                "stale_dropped": a.get("stale_dropped"), "warning": warning}

    def warning(self) -> str | None:
        """A Warning's message when the step's tool and environment faults passed
        ``environment.errorWarningFraction`` of the calls."""
        fraction = self.rollout.spec.error_warning_fraction
        share = self.last.get("fault_share") or 0.0
        if share <= fraction:
            return None
        errors = ", ".join(f"{k} {v}" for k, v in sorted((self.last.get("tool_errors") or {}).items()))
        first = "; ".join(self.last.get("first_errors") or [])[:400]
        return (f"{share:.0%} of the step's tool and environment calls failed ({errors}), above "
                f"spec.environment.errorWarningFraction {fraction:g}: {first}")


@dataclass(eq=False)
class Group:
    """The ``n`` trajectories of one prompt, launched together for batch ``step`` (``agent.partial``)."""

    sample: Any
    step: int
    futures: list[Future[Result]]
    oldests: list[partial.Oldest]

    def finished(self) -> bool:
        return all(f.done() for f in self.futures)

    def results(self) -> list[Result]:
        return [f.result() for f in self.futures]  # a trajectory's exception (an unreachable server) fails the run

    def oldest(self) -> int | None:
        """The version of the group's oldest token known so far: of its trajectories whose first turn is back."""
        return min((o.version for o in self.oldests if o.version is not None), default=None)

    def cancel(self) -> None:
        """End the trajectories still running; a turn in flight is cancelled too and its engine aborts its request
        (``agent.rollout.cancel_call``)."""
        for f in self.futures:
            f.cancel()


class AgentStream:
    """``weightSync.mode: async``: the multi-turn rollout as groups that run across steps (``agent.partial``), on
    an event loop of its own for the whole run. A weight sync pauses the engines with the stream's turns in
    flight; they go on with the new weights."""

    def __init__(self, rollout: AgentRollout, n: int, max_staleness: int) -> None:
        self.rollout, self.n, self.bound = rollout, n, max_staleness
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, name="agent-rollout", daemon=True).start()
        self.on_loop(rollout.begin)
        self.groups: list[Group] = []  # in flight or finished and not trained, in launch order
        self.launched: int | None = None  # batches 0 .. launched - 1 were launched
        self.last_done: int | None = None
        self.t_window = time.perf_counter()

    def on_loop(self, fn: Callable[[], Any]) -> Any:
        """``fn()`` on the stream's event loop (the rollout's state is the loop's), its result."""
        async def call() -> Any:
            return fn()

        return asyncio.run_coroutine_threadsafe(call(), self.loop).result()

    def launch(self, sample: Any, step: int) -> Group:
        oldests = [partial.Oldest() for _ in range(self.n)]
        return Group(sample, step, [asyncio.run_coroutine_threadsafe(self.rollout.trajectory(sample, o), self.loop)
                                    for o in oldests], oldests)

    def take(self, batch_of: Callable[[int], list[Any]], done: int, total: int, synced_at: int, need: int,
             wait: Callable[[list[Future[Any]], int], None]) -> tuple[list[Group], int]:
        """Step ``done``'s ``need`` groups, and how many trajectories were dropped past the bound meanwhile: the
        batches up to ``partial.launch_until`` launched, then the first ``need`` finished groups within the bound
        (``partial.select``, waiting with ``wait``); a group past it, finished or running, is dropped and its
        prompt launched again. After the run's last step nothing stays in flight."""
        if self.launched is None or self.last_done is None or done <= self.last_done:  # first step, or a resume
            self.close()
            self.launched = done
        last = partial.launch_until(done, synced_at, self.bound, total)
        for b in range(self.launched, last + 1):
            self.groups += [self.launch(s, b) for s in batch_of(b)]
        self.launched = max(self.launched, last + 1)
        dropped = 0
        while True:
            taken, stale = partial.select(self.groups, need, done, self.bound)
            for g in stale:  # GRPO and RLOO compare a group's trajectories: dropped whole, its prompt again
                g.cancel()
                self.groups[self.groups.index(g)] = self.launch(g.sample, g.step)
                dropped += len(g.futures)
            if taken:
                break
            assert len(self.groups) >= need, f"{len(self.groups)} groups in flight for {need}"
            wait([f for g in self.groups for f in g.futures if not f.done()], done)
        self.groups = [g for g in self.groups if g not in taken]
        self.last_done = done
        if done + 1 >= total:  # the last step: the engines free for what follows (evaluation, export)
            self.close()
        return taken, dropped

    def window(self) -> tuple[dict[str, Any], float]:
        """The rollout's counts since the last step (``AgentRollout.window``) and its seconds."""
        now, t0 = time.perf_counter(), self.t_window
        self.t_window = now
        return self.on_loop(self.rollout.window), now - t0

    def close(self) -> None:
        """Cancel every group in flight (``Group.cancel``)."""
        for g in self.groups:
            g.cancel()
        self.groups = []


def to_samples(results: list[Result]) -> Samples:
    """The trajectories as the step's samples (module docstring)."""
    out = Samples(loss_masks=[], env_rewards=[], zeroed=[])
    for r in results:
        out.items.append((r.sample, r.final_text))
        out.prompts.append(r.traj.prompt)
        out.completions.append(r.traj.response)
        assert out.logprobs is not None and out.loss_masks is not None
        out.logprobs.append(r.traj.logprobs)
        out.loss_masks.append(r.traj.mask)
        out.env_rewards.append(r.reward)  # type: ignore[union-attr]
        out.zeroed.append(r.zeroed)  # type: ignore[union-attr]
        out.tokens += sum(r.traj.mask)
    return out
