"""Environments of the environment protocol (``rlhf_runtime.agent.environments``) for multi-turn tests."""

from __future__ import annotations

import asyncio
import json
import os
import time
from pathlib import Path
from typing import Any


class AnswerEnv:
    """The tool results are the observations; a turn without a tool call is the final answer: reward 1 when it
    contains ``42``, else 0, and done. A turn whose text says ``crash`` makes ``step`` raise (an environment that
    crashes on one trajectory)."""

    def reset(self, sample: dict[str, Any]) -> None:
        return None

    def step(self, message: dict[str, Any]) -> dict[str, Any]:
        if "crash" in (message.get("content") or ""):
            raise RuntimeError("the environment crashed")
        results = message.get("tool_results") or []
        if results:
            return {"observations": results, "done": False}
        return {"observations": [], "reward": 1.0 if "42" in (message.get("content") or "") else 0.0, "done": True}


class GoOnEnv(AnswerEnv):
    """``AnswerEnv`` that answers a trajectory's first turn with "go on": every trajectory takes two turns."""

    def reset(self, sample: dict[str, Any]) -> None:
        self.steps = 0

    def step(self, message: dict[str, Any]) -> dict[str, Any]:
        self.steps += 1
        if self.steps == 1:
            return {"observations": [{"role": "user", "content": "go on"}], "done": False}
        return super().step(message)


class HeldAnswerEnv(AnswerEnv):
    """``AnswerEnv`` (without tools) whose first step of a trajectory on a prompt that starts with ``hold`` waits
    until the run's progress file (``RLHF_TEST_PROGRESS``) records a trained step, then asks the model to go on:
    the trajectory's next turn runs on the weights of the sync after that step (a trajectory that spans a weight
    sync, ``weightSync.mode: async``)."""

    async def reset(self, sample: dict[str, Any]) -> None:
        self.prompt, self.steps = sample["prompt"], 0

    async def step(self, message: dict[str, Any]) -> dict[str, Any]:
        self.steps += 1
        if self.prompt.startswith("hold") and self.steps == 1:
            await trained(Path(os.environ["RLHF_TEST_PROGRESS"]), 1)
            return {"observations": [{"role": "user", "content": "go on"}], "done": False}
        return super().step(message)


async def trained(progress: Path, step: int, timeout: float = 300.0) -> None:
    """Wait until ``progress`` (a driver's progress file) records training step ``step``."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        for line in progress.read_text().splitlines() if progress.exists() else []:
            try:
                record = json.loads(line)
            except ValueError:  # a line still being written
                continue
            if "throughput" in record and record.get("step", 0) >= step:
                return
        await asyncio.sleep(0.05)
    raise TimeoutError(f"{progress} recorded no step {step} within {timeout:g} s")
