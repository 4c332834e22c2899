"""A coalescing work queue of job keys, in the operator's event loop (the controller-runtime pattern).

- ``add(key)``: reconcile the key soon. A key waits in the queue at most once, however many events name it.
- A key is handed to at most one worker at a time: an ``add`` while it runs marks it dirty, and it runs once more
  after the current run (so the last event is always seen, and one job's reconciles never overlap).
- ``add_after(key, seconds)``: reconcile the key then (a time-dependent verdict: a deadline passes). One timer per
  key; every reconcile returns when it next needs to look (or None: only on events) and that replaces the timer.
- ``add(key, urgent=True)``: the key goes ahead of every key that is not urgent (a new job waits for its children
  behind no reconcile of a settled one: under load, pods' events queue many of those). An urgent add of a key
  already waiting moves it ahead.
- ``hold``: a callable; while it answers True (the operator is paused for a peer), keys are dropped instead of run
  (the peer that is active does the work; on resuming, the watches list everything again and re-add every key).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Awaitable, Callable, Hashable

log = logging.getLogger("rlhf_operator")
#: Seconds before a key whose reconcile raised is tried again.
RETRY_SECONDS = 5.0


class WorkQueue:
    def __init__(self, work: Callable[[Hashable], Awaitable[float | None]], workers: int,
                 hold: Callable[[], bool] = lambda: False,
                 on_wait: Callable[[float], None] = lambda seconds: None) -> None:
        """``work(key)`` reconciles one key and returns seconds until it must look again (None: only on events);
        ``on_wait(seconds)`` hears how long each key waited in the queue before its run (a metric)."""
        self._work, self._hold, self._workers, self._on_wait = work, hold, workers, on_wait
        # (0 urgent | 1, arrival, key); a key moved ahead leaves a stale entry behind, skipped when it comes up
        self._queue: asyncio.PriorityQueue[tuple[int, int, Hashable]] = asyncio.PriorityQueue()
        self._order = itertools.count()
        self._queued: dict[Hashable, tuple[int, float]] = {}  # key -> (its priority, when it was first queued)
        self._running: set[Hashable] = set()
        self._dirty: set[Hashable] = set()
        self._timers: dict[Hashable, asyncio.TimerHandle] = {}
        self._tasks: list[asyncio.Task[None]] = []
        self.processed = 0

    def start(self) -> None:
        self._tasks = [asyncio.create_task(self._worker(), name=f"rlhf-worker-{i}") for i in range(self._workers)]

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for h in self._timers.values():
            h.cancel()
        self._timers.clear()

    def add(self, key: Hashable, urgent: bool = False) -> None:
        priority = 0 if urgent else 1
        if key in self._running:
            self._dirty.add(key)
            return
        held = self._queued.get(key)
        if held is not None and held[0] <= priority:
            return
        since = held[1] if held is not None else asyncio.get_running_loop().time()
        self._queued[key] = (priority, since)
        self._queue.put_nowait((priority, next(self._order), key))

    def add_after(self, key: Hashable, seconds: float) -> None:
        old = self._timers.pop(key, None)
        if old is not None:
            old.cancel()
        self._timers[key] = asyncio.get_running_loop().call_later(max(0.0, seconds), self._fire, key)

    def _fire(self, key: Hashable) -> None:
        self._timers.pop(key, None)
        self.add(key)

    def forget(self, key: Hashable) -> None:
        """The object is gone: no timer for it any more (a queued or running reconcile finds it gone)."""
        h = self._timers.pop(key, None)
        if h is not None:
            h.cancel()

    def idle(self) -> bool:
        return not self._queued and not self._running

    async def _worker(self) -> None:
        while True:
            priority, _, key = await self._queue.get()
            held = self._queued.get(key)
            if held is None or held[0] != priority:
                continue  # a stale entry: the key ran already, or was moved ahead
            del self._queued[key]
            self._on_wait(asyncio.get_running_loop().time() - held[1])
            if self._hold():
                self.forget(key)
                continue
            self._running.add(key)
            try:
                while True:
                    self._dirty.discard(key)
                    again = None
                    try:
                        again = await self._work(key)
                    except asyncio.CancelledError:
                        raise
                    except Exception:  # a worker never dies of a reconcile's error: the key is retried
                        log.exception("reconcile of %s failed; retrying in %s s", key, RETRY_SECONDS)
                        again = RETRY_SECONDS
                    self.processed += 1
                    if again is None:
                        self.forget(key)
                    else:
                        self.add_after(key, again)
                    if key not in self._dirty or self._hold():
                        break
            finally:
                self._running.discard(key)
                self._dirty.discard(key)
