"""Engine fan-out: the trainer's control plane to the engine actors (vLLM's ``VLLMWeightSyncClient`` role).

``EngineFanOut`` calls the same method on every engine actor (``rollout.api.RolloutEngine``), waits at most
``weightSync.timeoutSeconds``, gives each engine its own ``rank_offset`` (1 + the world sizes of the engines before
it: each engine's workers count ranks from 0) and times every call (``timings``: seconds per method in a sync).
"""

from __future__ import annotations

import logging
import time
from typing import Any

log = logging.getLogger(__name__)


class EngineFanOut:
    """``VLLMWeightSyncClient`` over engine actors, with per-engine rank offsets. ``pipelined`` (engines that run
    calls one at a time, in order): start, update and finish are submitted back to back, the trainer waits for
    the start with the update, then for a finish already running; else each call is waited on. Either way the
    first sync of a format after the group's init (or after a failed sync) waits on each call, so a failing
    start raises before the trainer's broadcast instead of leaving it waiting for engines that never join."""

    def __init__(self, handles: list[Any], worlds: list[int], timeout_s: float | None = None,
                 pipelined: bool = False) -> None:
        self.handles = handles
        self.worlds = worlds
        self.timeout_s = timeout_s
        self.timings: dict[str, float] = {}
        self.calls = 0  # Ray calls per engine since ``new_sync``
        self.waits = 0  # times the trainer waited for the engines since ``new_sync``
        self.checkpoint_format = True  # the format of ``start_weight_update()`` called without one (the sender's)
        self.pipelined = pipelined
        #: the sync under way: (stage, format), stage "three" (waited calls), "pipelined" (the start submitted)
        #: or "pipelined-finish" (the finish submitted); None between syncs
        self._open: tuple[str, bool] | None = None
        self._proven: bool | None = None  # the format whose last sync completed (pipelined from then on)
        self._start_refs: list[Any] = []  # pipelined: the start calls submitted by start_weight_update
        self._finish_refs: list[Any] = []  # pipelined: the finish calls submitted with the update

    def new_sync(self) -> None:
        """Start counting a sync: ``timings``, ``calls`` and ``waits`` from zero."""
        self.timings, self.calls, self.waits = {}, 0, 0

    def get(self, refs: Any, method: str) -> Any:
        """``ray.get`` bounded by ``timeout_s``; a timeout names the call and the engines. An engine's error is also
        logged at once: vLLM's NCCL trainer engine waits for ``update_weights`` beside its broadcast, which a failed
        engine never joins, so the raise alone would show only when the timeout ends the sync."""
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

    def _time(self, method: str, t: float) -> None:
        self.timings[method] = self.timings.get(method, 0.0) + time.perf_counter() - t

    def _all(self, method: str, args: list[tuple]) -> None:
        t = time.perf_counter()
        self.calls += 1
        self.get([getattr(h, method).remote(*a) for h, a in zip(self.handles, args)], method)
        self._time(method, t)

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        infos, offset = [], 1
        for w in self.worlds:
            info = dict(init_info)
            if "rank_offset" in info:
                info["rank_offset"] = offset
            infos.append((info,))
            offset += w
        self._proven = None  # a new group: its first sync waits on each call
        self._all("init_weight_transfer_engine", infos)

    def start_weight_update(self, checkpoint_format: bool | None = None) -> None:
        fmt = self.checkpoint_format if checkpoint_format is None else checkpoint_format
        if self.pipelined and self._proven == fmt:  # submitted now, waited on with the update
            self.calls += 1
            self._start_refs = [h.start_weight_update.remote(fmt) for h in self.handles]
            self._open = ("pipelined", fmt)
            return
        self._open, self._proven = ("three", fmt), None
        self._all("start_weight_update", [(fmt,)] * len(self.handles))

    def update_weights(self, update_info: Any) -> None:
        if self._open is None or self._open[0] != "pipelined":
            self._all("update_weights", [(update_info,)] * len(self.handles))
            return
        fmt = self._open[1]
        self._open, self._proven = None, None  # until this sync succeeds
        t = time.perf_counter()
        self.calls += 2
        updates = [h.update_weights.remote(update_info) for h in self.handles]
        self._finish_refs = [h.finish_weight_update.remote() for h in self.handles]
        try:
            self.get(self._start_refs + updates, "start_weight_update+update_weights")
        except BaseException:
            self._finish_refs = []  # not waited for: it fails too (no update open), or waits behind a stuck update
            raise
        finally:
            self._start_refs = []
            self._time("update_weights", t)
        self._open = ("pipelined-finish", fmt)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        stage, fmt = self._open or ("", None)
        self._open = None
        if stage == "pipelined-finish":  # submitted with the update: wait for it
            t = time.perf_counter()
            finishing, self._finish_refs = self._finish_refs, []
            self.get(finishing, "finish_weight_update")
            self._time("finish_weight_update", t)
        else:
            self._all("finish_weight_update", [()] * len(self.handles))
        if stage in ("three", "pipelined-finish"):
            self._proven = fmt

    def update_round(self, update_info: Any, checkpoint_format: bool = True) -> None:
        """start -> update -> finish in one actor call per engine (the resident IPC sync); the engines' own stage
        seconds (the slowest engine's) are booked as the three calls', the rest of the call as ``update_weights``,
        and the engine actor's own time in the call (the rest: Ray) as ``update_weights_round_call``."""
        t = time.perf_counter()
        self.calls += 1
        stages = self.get([h.update_weights_round.remote(update_info, checkpoint_format) for h in self.handles],
                          "update_weights_round")
        wall = time.perf_counter() - t
        start, finish = max(st["start_s"] for st in stages), max(st["finish_s"] for st in stages)
        if all("call_s" in st for st in stages):
            self.timings["update_weights_round_call"] = max(st["call_s"] for st in stages)
        for method, seconds in (("start_weight_update", start), ("update_weights", wall - start - finish),
                                ("finish_weight_update", finish)):
            self.timings[method] = self.timings.get(method, 0.0) + seconds

    def engine_layouts(self) -> list[dict[str, Any]]:
        """Every engine's own parameters (name, shape), fused-module mapping, world size, MoE experts and
        workers (TP rank and GPU each): ``rollout.workers.worker_param_layout``."""
        return self.get([h.param_layout.remote() for h in self.handles], "param_layout")
