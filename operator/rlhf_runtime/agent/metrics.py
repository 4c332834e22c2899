"""What a multi-turn rollout counts: turns, tool calls and their faults by kind, environment latency, the runtime's
own time per turn, truncation, and how busy each engine was (``Counters.summary``: the step's ``agent`` record,
also in its training statistics and tracking as ``agent_*``).

Pure Python.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any


def quantile(values: list[float], q: float) -> float | None:
    """The ``q`` quantile (nearest rank) of ``values``; None when empty."""
    if not values:
        return None
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))]


@dataclass
class Counters:
    turns: list[int] = field(default_factory=list)
    ended: Counter[str] = field(default_factory=Counter)
    tool_calls: int = 0
    tool_seconds: list[float] = field(default_factory=list)
    errors: Counter[str] = field(default_factory=Counter)
    env_seconds: list[float] = field(default_factory=list)
    overheads: list[float] = field(default_factory=list)
    first_errors: list[str] = field(default_factory=list)  # a few messages, for the logs and the warning
    claim_seconds: list[float] = field(default_factory=list)  # each sandbox claim's wait (environment.sandbox)
    paused_turns: int = 0  # turns a weight sync paused mid-generation (async mode)

    def trajectory(self, turns: int, ended: str) -> None:
        self.turns.append(turns)
        self.ended[ended] += 1

    def tool(self, seconds: float, error: str | None, text: str) -> None:
        self.tool_calls += 1
        self.tool_seconds.append(seconds)
        if error:
            self.error(error, text[:200])

    def error(self, kind: str, message: str) -> None:
        self.errors[kind] += 1
        if len(self.first_errors) < 5:
            self.first_errors.append(f"{kind}: {message[:200]}")

    def env_latency(self, seconds: float) -> None:
        self.env_seconds.append(seconds)

    def overhead(self, seconds: float) -> None:
        self.overheads.append(max(0.0, seconds))

    def fault_share(self) -> float:
        """Faults per tool and environment call (malformed calls count as calls)."""
        calls = self.tool_calls + len(self.env_seconds) + self.errors["malformed_call"]
        return sum(self.errors.values()) / calls if calls else 0.0

    def summary(self, busy: list[float]) -> dict[str, Any]:
        n = len(self.turns) or 1
        out: dict[str, Any] = {
            "trajectories": len(self.turns), "turns_mean": sum(self.turns) / n, "turns_max": max(self.turns or [0]),
            "tool_calls": self.tool_calls, "tool_errors": dict(self.errors), "fault_share": self.fault_share(),
            "timeout_share": self.errors["timeout"] / self.tool_calls if self.tool_calls else 0.0,
            "truncated_share": (self.ended["budget"] + self.ended["length"]) / n, "ended": dict(self.ended),
            "env_latency_p50_s": quantile(self.env_seconds, 0.5), "env_latency_p99_s": quantile(self.env_seconds, 0.99),
            "tool_latency_p50_s": quantile(self.tool_seconds, 0.5),
            "sandbox_claims": len(self.claim_seconds), "sandbox_failures": self.errors["sandbox"],
            "sandbox_claim_p50_s": quantile(self.claim_seconds, 0.5),
            "sandbox_claim_p99_s": quantile(self.claim_seconds, 0.99),
            "turn_overhead_p50_ms": None if not self.overheads else 1000 * (quantile(self.overheads, 0.5) or 0.0),
            "engine_busy_share": min(busy) if busy else None, "engine_busy_shares": busy,
            "paused_turns": self.paused_turns,
        }
        if self.first_errors:
            out["first_errors"] = list(self.first_errors)
        return out


class EngineLoad:
    """Requests in flight per engine, which engine takes the next turn (the least loaded), and the share of the
    rollout's wall time each engine had at least one request in flight."""

    def __init__(self, engines: int) -> None:
        self.inflight = [0] * engines
        self.busy = [0.0] * engines
        self.since = [0.0] * engines
        self.t0 = time.perf_counter()
        self.t1: float | None = None

    def pick(self) -> int:
        return min(range(len(self.inflight)), key=lambda i: (self.inflight[i], i))

    def start(self, i: int) -> None:
        if self.inflight[i] == 0:
            self.since[i] = time.perf_counter()
        self.inflight[i] += 1

    def end(self, i: int) -> None:
        self.inflight[i] -= 1
        if self.inflight[i] == 0:
            self.busy[i] += time.perf_counter() - self.since[i]

    def finish(self) -> None:
        self.t1 = time.perf_counter()

    def carry(self) -> EngineLoad:
        """End this window (``shares`` from now on are its own) and start the next: the requests in flight now
        stay in flight, busy from now on (a rollout that runs across steps, counted per step)."""
        now = time.perf_counter()
        nxt = EngineLoad(len(self.inflight))
        for i, k in enumerate(self.inflight):
            if k:
                self.busy[i] += now - self.since[i]
        nxt.inflight, nxt.since, nxt.t0, self.t1 = list(self.inflight), [now] * len(self.inflight), now, now
        return nxt

    def shares(self) -> list[float]:
        wall = (self.t1 or time.perf_counter()) - self.t0
        return [b / wall if wall > 0 else 0.0 for b in self.busy]
