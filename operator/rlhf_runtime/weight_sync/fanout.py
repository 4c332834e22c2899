"""Engine fan-out: the trainer's control plane to the engine actors (vLLM's ``VLLMWeightSyncClient`` role).

``EngineFanOut`` calls the same method on every engine actor (``rlhf_runtime.rollout.api.RolloutEngine``) and
waits at most ``weightSync.timeoutSeconds``. It gives each engine its own ``rank_offset`` (``1 + the world
sizes of the engines before it``), because each engine is a separate vLLM instance whose workers count ranks
from 0, and it times every call (``timings``: seconds per method, summed over a sync).
"""

from __future__ import annotations

import logging
import time
from typing import Any

log = logging.getLogger(__name__)


class EngineFanOut:
    """``VLLMWeightSyncClient`` over engine actors, with per-engine rank offsets and ``rpc`` engine calls per
    sync."""

    def __init__(self, handles: list[Any], worlds: list[int], timeout_s: float | None = None,
                 rpc: str = "three") -> None:
        self.handles = handles
        self.worlds = worlds
        self.timeout_s = timeout_s  # spec.weightSync.timeoutSeconds: no engine call waits longer
        self.timings: dict[str, float] = {}
        self.calls = 0  # Ray calls per engine since ``new_sync`` (one per method call, fanned out to every engine)
        self.waits = 0  # times the trainer waited for the engines since ``new_sync`` (``get``)
        #: the format of ``start_weight_update()`` called without one (vLLM's trainer engines call it so; the
        #: sender sets it from the format in use)
        self.checkpoint_format = True
        #: ``rpc`` (``options.RPCS``) for trainer engines that call ``update_weights`` once per sync (NCCL, gloo).
        #: ``one``: ``start_weight_update`` is deferred and ``update_weights`` is one ``update_weights_round`` call
        #: per engine (start, receive, finish). ``pipelined`` (engines that run calls one at a time, in order):
        #: the three calls are submitted back to back, the trainer waits for the start with the update, then for
        #: a finish already running. Either way the first sync of a format after the group's init (or after a
        #: failed sync) makes three calls, so a failing start raises before the trainer's broadcast instead of
        #: leaving it waiting for engines that never join.
        self.one_round = rpc == "one"
        self.pipelined = rpc == "pipelined"
        self._finish_refs: list[Any] = []  # pipelined: the finish calls submitted with the update
        #: the sync under way: (stage, format), stage "deferred" (start left to the round), "round" (the round
        #: finished the update), "three" (three calls), "pipelined" (the start submitted) or "pipelined-finish"
        #: (the finish submitted); None between syncs
        self._open: tuple[str, bool] | None = None
        self._proven: bool | None = None  # the format whose last sync completed (one call from then on)
        self._start_refs: list[Any] = []  # pipelined: the start calls submitted by start_weight_update

    def new_sync(self) -> None:
        """Start counting a sync: ``timings``, ``calls`` and ``waits`` from zero."""
        self.timings, self.calls, self.waits = {}, 0, 0

    def get(self, refs: Any, method: str) -> Any:
        """``ray.get`` bounded by ``timeout_s``; a timeout names the call and the engines. An engine's error is
        logged here as well as raised: vLLM's NCCL trainer engine waits for ``update_weights`` in a thread beside
        its broadcast, which then never returns (the failed engine never joins it), so the raise alone would
        only show once ``weightSync.timeoutSeconds`` ends the sync."""
        import ray
        from ray.exceptions import GetTimeoutError

        self.waits += 1
        try:
            return ray.get(refs, timeout=self.timeout_s)
        except GetTimeoutError:
            raise TimeoutError(
                f"engine call {method} on {len(self.handles)} engine(s) did not finish within "
                f"weightSync.timeoutSeconds={self.timeout_s:g}s"
            ) from None
        except Exception as e:
            log.error("engine call %s on %d engine(s) failed: %s: %s", method, len(self.handles),
                      type(e).__name__, e)
            raise

    def _all(self, method: str, args: list[tuple]) -> None:
        t = time.perf_counter()
        self.calls += 1
        self.get([getattr(h, method).remote(*a) for h, a in zip(self.handles, args)], method)
        self.timings[method] = self.timings.get(method, 0.0) + time.perf_counter() - t

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        infos, offset = [], 1
        for w in self.worlds:
            info = dict(init_info)
            if "rank_offset" in info:
                info["rank_offset"] = offset
            infos.append((info,))
            offset += w
        self._proven = None  # a new group: its first sync makes three calls
        self._all("init_weight_transfer_engine", infos)

    def start_weight_update(self, checkpoint_format: bool | None = None) -> None:
        fmt = self.checkpoint_format if checkpoint_format is None else checkpoint_format
        if self.one_round and self._proven == fmt:  # the engines start inside the update's round
            self._open = ("deferred", fmt)
            return
        if self.pipelined and self._proven == fmt:  # submitted now, waited on with the update
            self.calls += 1
            self._start_refs = [h.start_weight_update.remote(fmt) for h in self.handles]
            self._open = ("pipelined", fmt)
            return
        self._open, self._proven = ("three", fmt), None
        self._all("start_weight_update", [(fmt,)] * len(self.handles))

    def update_weights(self, update_info: Any) -> None:
        if self._open is not None and self._open[0] == "deferred":
            fmt = self._open[1]
            self._open, self._proven = None, None  # until this round succeeds
            self.update_round(update_info, fmt)
            self._open, self._proven = ("round", fmt), fmt
            return
        if self._open is not None and self._open[0] == "pipelined":
            fmt = self._open[1]
            self._open, self._proven = None, None  # until this sync succeeds
            t = time.perf_counter()
            self.calls += 2
            updates = [h.update_weights.remote(update_info) for h in self.handles]
            self._finish_refs = [h.finish_weight_update.remote() for h in self.handles]
            try:
                self.get(self._start_refs + updates, "start_weight_update+update_weights")
            except BaseException:
                # not waited for: it fails too (no update open), or waits behind a stuck update
                self._finish_refs = []
                raise
            finally:
                self._start_refs = []
                self.timings["update_weights"] = self.timings.get("update_weights", 0.0) + time.perf_counter() - t
            self._open = ("pipelined-finish", fmt)
            return
        self._all("update_weights", [(update_info,)] * len(self.handles))

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        stage, fmt = self._open or ("", None)
        self._open = None
        if stage == "round":  # the round finished the engines' update
            return
        if stage == "pipelined-finish":  # submitted with the update: wait for it
            t = time.perf_counter()
            finishing, self._finish_refs = self._finish_refs, []
            self.get(finishing, "finish_weight_update")
            self.timings["finish_weight_update"] = self.timings.get("finish_weight_update", 0.0) + \
                time.perf_counter() - t
            self._proven = fmt
            return
        self._all("finish_weight_update", [()] * len(self.handles))
        if stage == "three":
            self._proven = fmt

    def update_round(self, update_info: Any, checkpoint_format: bool = True) -> None:
        """start -> update -> finish in one actor call per engine (one Ray round trip instead of three); the
        engines' own stage times are recorded as the three calls' (the slowest engine's)."""
        t = time.perf_counter()
        self.calls += 1
        stages = self.get([h.update_weights_round.remote(update_info, checkpoint_format) for h in self.handles],
                          "update_weights_round")
        self.record_rounds(stages, time.perf_counter() - t)

    def record_rounds(self, stages: list[dict[str, float]], wall: float) -> None:
        """Book ``update_weights_round`` results (the engines' own stage seconds) as the three calls' times:
        start and finish of the slowest engine, the rest of ``wall`` as ``update_weights``."""
        start, finish = max(st["start_s"] for st in stages), max(st["finish_s"] for st in stages)
        if all("call_s" in st for st in stages):  # the engine actor's own time in the call (the rest: Ray)
            self.timings["update_weights_round_call"] = max(st["call_s"] for st in stages)
        for method, seconds in (("start_weight_update", start), ("update_weights", wall - start - finish),
                                ("finish_weight_update", finish)):
            self.timings[method] = self.timings.get(method, 0.0) + seconds

    def engine_layouts(self) -> list[dict[str, Any]]:
        """Every engine's own parameters (name, shape), fused-module mapping, world size, MoE experts and
        workers (TP rank and GPU each): ``rollout.workers.worker_param_layout``."""
        return self.get([h.param_layout.remote() for h in self.handles], "param_layout")
