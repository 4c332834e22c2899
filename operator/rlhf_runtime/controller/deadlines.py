"""No silent hang: every driver -> actor call has a deadline, and a watchdog fails a run that stops progressing.

* ``Deadlines.get(refs, what)``: a call other than a rollout or a train step (weight-sync group init, syncs,
  sleep/wake, pause/resume, validation, pid/world-size queries), bounded by ``weightSync.timeoutSeconds``.
* ``Deadlines.get_step(refs, what)``: a rollout, a train step, an actor start or a checkpoint save, bounded by
  what is left of ``spec.progressDeadlineSeconds`` (counted like the watchdog, from the last progress).
* Past either, the run fails with ``DeadlineExceeded`` naming the call and its actors, e.g. "weight sync:
  trainer rank 0 -> 2 engines did not finish within weightSync.timeoutSeconds=20s".
* ``Watchdog``: a thread that calls ``on_expire(message)`` once when no progress (the run's start or resume,
  then each completed step) happened within the live ``spec.progressDeadlineSeconds``; ``doing(what)`` names
  the current activity for the message.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

#: How often a bounded wait looks at the watchdog.
WAIT_SLICE_SECONDS = 1.0


class DeadlineExceeded(TimeoutError):
    """A driver -> actor call ran past its deadline (``weightSync.timeoutSeconds`` or
    ``spec.progressDeadlineSeconds``); the message names the call and the actors."""


def actor_died(e: BaseException) -> bool:
    """Whether ``e`` (from ``ray.get``) says an actor died: the call's own actor, or one it called."""
    from ray.exceptions import RayActorError

    return isinstance(e, RayActorError) or isinstance(getattr(e, "cause", None), RayActorError)


class Watchdog:
    """No silent hang: a thread that calls ``on_expire(message)`` once when no progress (``progress()``: the
    run's start or resume, then each completed step) happened within ``deadline()`` seconds (read on every
    check: ``spec.progressDeadlineSeconds`` may be edited live). ``doing(what)`` names the current activity
    for the message."""

    def __init__(self, deadline: Callable[[], float], on_expire: Callable[[str], None],
                 poll_seconds: float = 0.5) -> None:
        self.deadline, self.on_expire, self.poll_seconds = deadline, on_expire, poll_seconds
        self.last = time.monotonic()
        self.activity = "starting"
        self.fired: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def progress(self) -> None:
        self.last = time.monotonic()

    def doing(self, what: str) -> None:
        self.activity = what

    def remaining(self) -> float:
        return float(self.deadline()) - (time.monotonic() - self.last)

    def message(self) -> str:
        return (f"no training step completed within spec.progressDeadlineSeconds ({self.deadline():g} s); "
                f"stuck in: {self.activity}")

    def start(self) -> None:
        def watch() -> None:
            while not self._stop.wait(self.poll_seconds):
                if self.remaining() <= 0:
                    self.fired = self.message()
                    self.on_expire(self.fired)
                    return

        self.progress()
        self._thread = threading.Thread(target=watch, name="rlhf-progress-watchdog", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()


class Deadlines:
    """Bounded ``ray.get`` for the controller. ``sync_timeout``: ``weightSync.timeoutSeconds``;
    ``progress_deadline``: ``spec.progressDeadlineSeconds``, a function (the spec field is live)."""

    def __init__(self, sync_timeout: float, progress_deadline: Callable[[], int], watchdog: Watchdog) -> None:
        self.sync_timeout, self.progress_deadline, self.watchdog = sync_timeout, progress_deadline, watchdog

    def get(self, refs: Any, what: str) -> Any:
        """A call other than a rollout or a train step: bounded by ``weightSync.timeoutSeconds``."""
        return self._bounded(refs, what, self.sync_timeout, f"weightSync.timeoutSeconds={self.sync_timeout:g}s")

    def get_step(self, refs: Any, what: str) -> Any:
        """A rollout, a train step or an actor start: bounded by what is left of ``progressDeadlineSeconds``."""
        left = max(self.watchdog.remaining(), 0.0) + 1.0
        return self._bounded(refs, what, left, f"spec.progressDeadlineSeconds={self.progress_deadline()}s")

    def _bounded(self, refs: Any, what: str, timeout: float, setting: str) -> Any:
        import ray

        self.watchdog.doing(what)
        # waited for in slices: once the watchdog has fired the run ends now, not when this call would have
        # (a wait inside Ray does not see the watchdog's interrupt of the main thread)
        pending = list(dict.fromkeys(refs if isinstance(refs, (list, tuple)) else [refs]))
        end = time.monotonic() + timeout
        while pending and not self.watchdog.fired and time.monotonic() < end:
            _, pending = ray.wait(pending, num_returns=len(pending),
                                  timeout=max(min(end - time.monotonic(), WAIT_SLICE_SECONDS), 0.0))
        if self.watchdog.fired:
            raise DeadlineExceeded(self.watchdog.fired)
        try:
            return ray.get(refs, timeout=max(end - time.monotonic(), 0.0))
        except TimeoutError as e:  # ray's GetTimeoutError, or an actor's own deadline (RayTaskError(TimeoutError))
            inner = "" if type(e).__name__ == "GetTimeoutError" else f" ({str(e).strip().splitlines()[-1][:300]})"
            raise DeadlineExceeded(f"{what} did not finish within {setting}{inner}") from e
