"""Actors: placement groups, actor groups and the job's actor set.

* ``Placement``: the job's Ray placement groups (``infra.placement.Layout.groups``), the scheduling strategy of
  a bundle, and ``address_on(bundle)``: the node IP of a bundle and free ports there, found by a task on that
  node (rank 0 of an FSDP group, engine 0 of a vLLM DP group listen there; never on the driver's head pod).
* ``ActorGroup``: the N actors of one role, each on its own bundle. It owns every fan-out (``submit``: the
  same call on every actor; ``submit_shards``: each worker its part of a batch, balanced by tokens, ``assign``),
  the merge of sharded results (``merge``, the inverse) and the bounded gets (``call``: bounded by
  ``weightSync.timeoutSeconds``; ``call_step``: by what is left of ``spec.progressDeadlineSeconds``), so the
  controller never writes ``ray.get([a.f.remote() for a in actors])`` itself. It reads as a sequence of Ray
  actor handles (``group[i]``, ``len(group)``, iteration).
* ``ActorClasses``: which classes the actors run. The documented extension point for code outside the
  package (benchmarks, tests): subclasses of the runtime's own classes, handed to ``controller.loop.Runtime``
  (or ``main.main(classes=...)``); the classes must be importable by name in the actors' processes.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlhf_runtime.controller.deadlines import Deadlines
from rlhf_runtime.infra.placement import ActorPlacement, Layout

#: Consecutive ports a vLLM data-parallel group uses from its master port (engine and worker groups).
DP_PORTS = 16
#: How long placement groups may wait for their resources before the run fails.
PLACEMENT_SECONDS = 600.0


@dataclass
class ActorClasses:
    """The classes the job's actors run; ``None``: the runtime's own (``roles.policy.Trainer``, the engine
    class of the job's mode, ``rollout.api.engine_class``)."""

    trainer: type | None = None
    engine: type | None = None


def port_range(ports: int, ephemeral: tuple[int, int] | None) -> tuple[int, int]:
    """The first ports ``node_address`` may return: 20000 up to the kernel's ephemeral range (``ephemeral``, from
    ``ip_local_port_range``), from which any outgoing connection on the node may take a port between the check and
    the rank's listen; 20000-60000 where that range leaves too little room below it or is unknown."""
    lo, hi = 20000, 60000 - ports
    if ephemeral is not None and ephemeral[0] - ports - lo >= 1000:
        return lo, ephemeral[0] - ports
    return lo, hi


def _ephemeral_ports() -> tuple[int, int] | None:
    try:
        lo, hi = (int(x) for x in Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    except (OSError, ValueError):
        return None
    return lo, hi


def node_address(ports: int = 1) -> tuple[str, int]:
    """(Ray task) This node's IP and the first of ``ports`` consecutive TCP ports that are free on it
    (``port_range``)."""
    import random
    import socket

    from ray.util import get_node_ip_address

    first, last = port_range(ports, _ephemeral_ports())
    for _ in range(200):
        base = random.randint(first, last)
        socks = []
        try:
            for p in range(base, base + ports):
                s = socket.socket()
                socks.append(s)
                s.bind(("", p))
            return get_node_ip_address(), base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError(f"no {ports} consecutive free ports on this node")


class Placement:
    """The job's placement groups (one per ``Layout.groups`` entry) and where a bundle's actors run."""

    def __init__(self, layout: Layout, name: str, deadlines: Deadlines) -> None:
        self.layout, self.name, self.deadlines = layout, name, deadlines
        self.pgs: list[Any] = []

    def place(self) -> None:
        import ray
        from ray.util.placement_group import placement_group

        self.pgs = [placement_group(g.bundles, strategy=g.strategy, name=f"{self.name}-{g.name}-{os.getpid()}")
                    for g in self.layout.groups]
        deadline = time.time() + PLACEMENT_SECONDS
        pending = [pg.ready() for pg in self.pgs]
        while pending:
            _, pending = ray.wait(pending, num_returns=len(pending), timeout=10)
            if pending and time.time() > deadline:
                raise TimeoutError(f"placement groups not ready after {PLACEMENT_SECONDS:g} s: not enough "
                                   "GPUs/CPUs in the cluster")

    def strategy(self, where: ActorPlacement) -> Any:
        """The scheduling strategy of bundle ``where.bundle`` of group ``where.group``."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        return PlacementGroupSchedulingStrategy(placement_group=self.pgs[where.group],
                                                placement_group_bundle_index=where.bundle,
                                                placement_group_capture_child_tasks=True)

    def address_on(self, where: ActorPlacement, ports: int = 1) -> tuple[str, int]:
        """The node IP of bundle ``where`` and the first of ``ports`` consecutive ports free there, found by a
        task on that node: the address a process placed there can listen on (trainer rank 0 for FSDP2,
        engine 0 as master of the engines' vLLM DP group)."""
        import ray

        task = ray.remote(node_address).options(num_cpus=0, scheduling_strategy=self.strategy(where))
        addr, port = self.deadlines.get_step(task.remote(ports), "free port lookup on a placement bundle")
        return str(addr), int(port)

    def remove(self) -> None:
        from ray.util.placement_group import remove_placement_group

        for pg in self.pgs:
            try:
                remove_placement_group(pg)
            except Exception:  # noqa: BLE001, S110 - best effort cleanup, Ray may already be gone
                pass


def assign(batch: dict[str, Any] | None, w: int, n: int | None = None) -> list[list[int]]:
    """Which samples each of ``w`` workers takes, in order. A batch of token lists (``prompts`` and
    ``completions``) is balanced by tokens: longest sample first, each to the worker with the fewest tokens so
    far, so FSDP ranks (which meet at every micro-batch's collectives) do about the same work on long-tailed
    lengths. Otherwise (or ``batch`` None: ``n`` samples) every ``w``-th sample from ``r``. Pure."""
    if batch is not None:
        n = len(next(iter(batch.values()))) if batch else 0
    n = n or 0
    if w > 1 and batch is not None and "prompts" in batch and "completions" in batch:
        tokens = [len(p) + len(c) for p, c in zip(batch["prompts"], batch["completions"])]
        loads: list[int] = [0] * w
        parts: list[list[int]] = [[] for _ in range(w)]
        for i in sorted(range(n), key=lambda i: (-tokens[i], i)):
            r = min(range(w), key=lambda r: (loads[r], len(parts[r]), r))
            parts[r].append(i)
            loads[r] += tokens[i]
        return [sorted(p) for p in parts]
    return [list(range(r, n, w)) for r in range(w)]


def shard(batch: dict[str, Any], idx: list[int]) -> dict[str, Any]:
    """The samples ``idx`` (a worker's part of ``assign``) of each list in ``batch``."""
    return {k: [v[i] for i in idx] for k, v in batch.items()}


def merge(parts: list[list[Any]], batch: dict[str, Any] | None = None) -> list[Any]:
    """Every worker's results back in the batch's order: the inverse of ``submit_shards`` over ``batch`` (or,
    without it, of every ``w``-th sample from ``r``)."""
    n = sum(len(p) for p in parts)
    out: list[Any] = [None] * n
    for idx, part in zip(assign(batch, len(parts), n), parts):
        for i, value in zip(idx, part, strict=True):
            out[i] = value
    return out


class ActorGroup:
    """The actors of one role (``role``: trainer, engine, critic, reference, reward), one per placement."""

    def __init__(self, role: str, deadlines: Deadlines) -> None:
        self.role, self.deadlines = role, deadlines
        self.actors: list[Any] = []

    # ------------------------------------------------------------------------------ a sequence of actors
    def __len__(self) -> int:
        return len(self.actors)

    def __iter__(self) -> Iterator[Any]:
        return iter(self.actors)

    def __getitem__(self, i: int) -> Any:
        return self.actors[i]

    def __setitem__(self, i: int, actor: Any) -> None:
        self.actors[i] = actor

    def append(self, actor: Any) -> None:
        self.actors.append(actor)

    def describe(self, idx: list[int] | None = None) -> str:
        """How messages name these actors: "trainer rank 0", "trainer ranks 0-1", "engine 1", "2 engines",
        "3 critic actor(s)"."""
        idx = list(range(len(self.actors))) if idx is None else idx
        if self.role == "trainer":
            return "trainer rank 0" if len(idx) == 1 and idx[0] == 0 else f"trainer ranks 0-{len(idx) - 1}"
        if self.role == "engine":
            return f"engine {idx[0]}" if len(idx) == 1 else f"{len(idx)} engines"
        return f"{len(idx)} {self.role} actor(s)"

    # --------------------------------------------------------------------------------------- fan-out
    def submit(self, method: str, *args: Any, ranks: list[int] | None = None, **kwargs: Any) -> list[Any]:
        """The same call on every actor (or on ``ranks``); its object refs."""
        ranks = list(range(len(self.actors))) if ranks is None else ranks
        return [getattr(self.actors[r], method).remote(*args, **kwargs) for r in ranks]

    def submit_each(self, method: str, args: list[tuple[Any, ...]]) -> list[Any]:
        """Actor ``r`` called with ``args[r]``."""
        return [getattr(a, method).remote(*args[r]) for r, a in enumerate(self.actors)]

    def submit_shards(self, method: str, batch: dict[str, Any]) -> list[Any]:
        """Actor ``r`` called with its part of ``batch`` (``assign``: balanced by tokens); ``merge(results,
        batch)`` puts per-sample results back in order."""
        parts = assign(batch, len(self.actors))
        return [getattr(a, method).remote(shard(batch, idx)) for idx, a in zip(parts, self.actors)]

    # ------------------------------------------------------------------------------------ bounded gets
    def call(self, method: str, *args: Any, what: str, **kwargs: Any) -> list[Any]:
        """Every actor's result of ``method``, bounded by ``weightSync.timeoutSeconds``."""
        return self.deadlines.get(self.submit(method, *args, **kwargs), what)

    def call_step(self, method: str, *args: Any, what: str, **kwargs: Any) -> list[Any]:
        """Every actor's result of ``method``, bounded by what is left of ``spec.progressDeadlineSeconds``."""
        return self.deadlines.get_step(self.submit(method, *args, **kwargs), what)

    def kill(self, i: int | None = None) -> None:
        """Kill actor ``i`` (or every actor); an actor that is already gone is fine."""
        import ray

        for a in self.actors if i is None else [self.actors[i]]:
            try:
                ray.kill(a, no_restart=True)
            except Exception:  # noqa: BLE001, S110 - it is usually dead already
                pass
