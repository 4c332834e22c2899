"""The driver's side of multi-turn rollouts (``spec.environment``): ``agent.rollout.AgentRollout`` on the job's
engines, run on an event loop in a thread of its own (the driver's loop is synchronous), and its trajectories as
the step's ``Samples``.

A trajectory becomes one sample: its first prompt as ``prompts``, everything after it as ``completions`` with
``loss_masks`` (1 on the engines' tokens, 0 on tool and environment tokens) and the engines' ``logprobs``; the
text ``spec.reward`` scores is its last assistant content; ``env_rewards`` the environment's reward; a trajectory
that ``zeroReward`` ended scores 0 whatever its sources say (``zeroed``).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from rlhf_api.environment import server_url
from rlhf_api.models import RuntimeConfig
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
    """Launch and collect a step's trajectories (module docstring)."""

    def __init__(self, rollout: AgentRollout, deadlines: Deadlines) -> None:
        self.rollout, self.deadlines = rollout, deadlines
        self.last: dict[str, Any] = {}
        self.ready = False  # the environment server answered its readiness path (``Environments.wait_ready``)

    def samples(self, batch: list[Any], n: int, step: int,
                sampling: dict[str, Any] | None = None) -> tuple[Samples, float]:
        """A rollout of ``n`` trajectories per sample of ``batch`` (``sampling``: instead of the job's), as
        ``Samples``, and its seconds."""
        if not self.ready:
            self.deadlines.watchdog.doing("waiting for the environment server to be ready")
            self.rollout.envs.wait_ready()
            self.ready = True
        launch = self.launch(batch, n, step, sampling)
        results = self.collect(launch)
        return to_samples(results), time.perf_counter() - launch.t_launch

    def launch(self, batch: list[Any], n: int, step: int, sampling: dict[str, Any] | None = None) -> AgentLaunch:
        fut: Future[list[Result]] = Future()

        def run() -> None:
            try:
                fut.set_result(asyncio.run(self.rollout.run(batch, n, sampling)))
            except BaseException as e:  # noqa: BLE001 - handed to the driver's thread
                fut.set_exception(e)

        threading.Thread(target=run, name=f"agent-rollout-{step + 1}", daemon=True).start()
        return AgentLaunch(step, batch, fut, time.perf_counter())

    def collect(self, launch: AgentLaunch) -> list[Result]:
        """The trajectories, bounded by what is left of ``progressDeadlineSeconds``; the step's ``agent`` record
        (``metrics.Counters.summary``) in ``last``."""
        wd = self.deadlines.watchdog
        wd.doing(f"multi-turn rollout of step {launch.step + 1}")
        end = time.monotonic() + max(wd.remaining(), 0.0) + 1.0
        while not launch.future.done():
            if wd.fired:
                raise DeadlineExceeded(wd.fired)
            if time.monotonic() > end:
                raise DeadlineExceeded(f"multi-turn rollout of step {launch.step + 1} did not finish within "
                                       f"spec.progressDeadlineSeconds={self.deadlines.progress_deadline()}s")
            try:
                launch.future.result(timeout=WAIT_SLICE_SECONDS)
            except TimeoutError:
                continue
        results = launch.future.result()
        self.last = self.rollout.counters.summary(self.rollout.load.shares())
        return results

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
                "warning": warning}

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
