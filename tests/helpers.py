"""Test helpers shared by the tiers: polling with a deadline (never bare sleeps)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def wait_for(check: Callable[[], T], timeout: float, what: str, interval: float = 0.5) -> T:
    """Call ``check`` until it returns a truthy value; fail with ``what`` and the last value/error after ``timeout``."""
    deadline = time.monotonic() + timeout
    last: object = None
    while True:
        try:
            value = check()
            if value:
                return value
            last = value
        except Exception as e:  # noqa: BLE001 - keep polling, report the last error
            last = e
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}; last: {last!r}")
        time.sleep(interval)
