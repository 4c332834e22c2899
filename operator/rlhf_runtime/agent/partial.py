"""Partial rollouts (``weightSync.mode: async`` with ``spec.environment``): the policy version of every sampled
token, a trajectory's staleness, and which groups of trajectories a step trains.

Versions. A policy version is the training step whose weights the engines hold (``WeightSync.synced_at``: 0 at
the start of a run, the checkpoint's step after a resume). A turn goes to an engine with the version the engines
had then; an engine that a sync paused mid-turn reports how many of the turn's tokens it had sampled before the
swap (``swap_index``), and the rest were sampled after it, on the version the driver knows when the turn comes
back (``turn_versions``). A token's recorded version is never newer than the weights that sampled it: a turn
that spans two syncs, or one sent while a sync was under way, records the older version.

Staleness. A trajectory trained at step ``done`` (the update of version ``done`` into ``done + 1``) has staleness
``done - v``, ``v`` the version of its oldest sampled token (``staleness``).

Groups. GRPO and RLOO compare the ``samplesPerPrompt`` trajectories of one prompt, so a prompt's group is launched,
trained and dropped whole. The rollout keeps in flight the groups of every batch up to ``maxStaleness`` steps
ahead of the engines' weights (``launch_until``: a group launched then is within the bound when its own step
trains it). A step trains the first ``promptsPerStep`` groups to finish, oldest launched first (``select``); the
others carry over into the next step's rollout and go on with whatever weights the engines then hold. A group past
``maxStaleness`` is not trained: it is dropped, counted, and its prompt launched again as a fresh group, so every
step still trains a full batch. A trajectory's oldest token is known once its first turn is back (``Oldest``), and
later tokens are never older: a group still running whose oldest token is already past the bound is dropped then,
its trajectories cancelled (their engine calls too: the engines abort the turns' requests), instead of running
its remaining turns for nothing.

Pure Python.
"""

from __future__ import annotations

import statistics
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar


def turn_versions(n: int, sent: int, back: int, swap_index: int) -> list[int]:
    """The versions of a turn's ``n`` sampled tokens: sent to the engine on version ``sent``, come back on
    ``back``; the engine sampled the first ``swap_index`` of them before a weight swap (-1: no swap)."""
    if swap_index < 0 or back == sent:
        return [sent] * n
    head = min(swap_index, n)
    return [sent] * head + [back] * (n - head)


def staleness(done: int, oldest: int | None) -> int:
    """Steps between the oldest sampled token's version and step ``done`` that trains it (0 without one)."""
    return 0 if oldest is None else done - oldest


def launch_until(done: int, synced_at: int, max_staleness: int, total: int) -> int:
    """The last batch (0-based step) to have in flight at step ``done`` with the engines on version ``synced_at``:
    ``max_staleness`` batches ahead of the weights, at least the step's own, none past the run's last step."""
    return min(max(done, synced_at + max_staleness), total - 1)


@dataclass
class Oldest:
    """The policy version of a trajectory's oldest sampled token, set when its first turn is back (None before, or
    when the turn has no versioned token)."""

    version: int | None = None


class Group(Protocol):
    def finished(self) -> bool: ...

    def oldest(self) -> int | None: ...


G = TypeVar("G", bound=Group)


def select(groups: Sequence[G], need: int, done: int, max_staleness: int) -> tuple[list[G], list[G]]:
    """Of ``groups`` (in launch order): the ``need`` groups step ``done`` trains, the oldest launched of the
    finished ones within ``max_staleness`` (none until ``need`` of them finished), and the groups past it, finished
    or still running (to drop: ``oldest`` is the oldest token known so far, and a later step only ages it)."""
    stale = [g for g in groups if staleness(done, g.oldest()) > max_staleness]
    fresh = [g for g in groups if g.finished() and g not in stale]
    return (fresh[:need] if len(fresh) >= need else []), stale


def summary(stalenesses: list[int], mixed: int, dropped: int, carried: int) -> dict[str, Any]:
    """A step's partial-rollout record: the staleness of every trained trajectory (max, mean, histogram by
    steps), how many trained trajectories hold tokens of more than one version, the trajectories dropped past
    the bound and the groups carried over into the next step's rollout."""
    return {"staleness_max": max(stalenesses, default=0),
            "staleness_mean": statistics.fmean(stalenesses) if stalenesses else 0.0,
            "staleness_histogram": {str(k): v for k, v in sorted(Counter(stalenesses).items())},
            "mixed_version_trajectories": mixed, "stale_dropped": dropped, "carried_groups": carried}
