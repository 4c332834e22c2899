"""What one reconcile does to the world besides reading it: the objects it wrote (``Outcome``, remembered in the
cache until the watch shows them), when it wants to look again, and the Events it posts (``post_event``)."""

from __future__ import annotations

import datetime as dt
import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from rlhf_operator import kube

log = logging.getLogger("rlhf_operator")


@dataclass
class Outcome:
    """What a reconcile wrote (remembered in the cache until the watch shows it) and when to look again."""
    written: list[tuple[str, Any, dict[str, Any] | None]] = field(default_factory=list)  # None: deleted
    again: float | None = None

    def wrote(self, kind: str, key: tuple[str, str], obj: dict[str, Any] | None) -> None:
        """``obj`` (a cache projection; None for a deletion) of ``kind`` at ``key`` (namespace, name) was written."""
        self.written.append((kind, key, obj))

    def look_again(self, seconds: float | None) -> None:
        """Look again after ``seconds`` at the latest (the soonest of all asked for wins; None asks nothing)."""
        if seconds is not None:
            self.again = seconds if self.again is None else min(self.again, seconds)


#: Events are posted off the reconcile's path, in the order they were decided (one thread), stamped when decided.
_EVENTS = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rlhf-events")


def post_event(body: Any, reason: str, message: str, warning: bool = False) -> None:
    """Post a core/v1 Event about the job, asynchronously (best effort: an Event never fails a reconcile)."""
    at = dt.datetime.now(dt.UTC)

    def post() -> None:
        try:
            kube.post_event(body, "Warning" if warning else "Normal", reason, message, at=at)
        except Exception:
            log.exception("could not post event %s", reason)

    _EVENTS.submit(post)
