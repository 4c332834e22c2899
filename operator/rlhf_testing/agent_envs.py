"""Environments of the environment protocol (``rlhf_runtime.agent.environments``) for multi-turn tests."""

from __future__ import annotations

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
