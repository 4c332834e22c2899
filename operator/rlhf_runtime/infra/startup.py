"""Where a start went: when this process began (``process_started``: beside an actor's own times, the progress
file's ``actors`` record, ``controller.job_actors``), and a start as named stages with their seconds (``Stages``:
the driver's, ``controller.loop.Runtime``).

A Ray actor's start has three parts the driver cannot tell apart from outside: Ray starting the worker process
(or handing it one it started earlier), the process importing its stack, and the actor's constructor. The
constructor records when it began; ``process_started`` says when the process did, so the import time between
them is known too.

Linux only (``/proc``); elsewhere ``None``. Pure standard library: importable in the operator's image too.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any


def process_started(pid: int | str = "self") -> float | None:
    """Unix time at which process ``pid`` (default: this one) was created, to the kernel's clock tick (10 ms on
    common kernels), or None where ``/proc`` does not say. The kernel keeps a process's start as ticks since
    boot (``/proc/PID/stat``, field 22, counted against the boot-time clock); it is placed on the wall clock by
    reading both clocks now, so a wall clock stepped since the process began does not move it."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        # the command name (field 2) is in parentheses and may hold spaces: count fields after its closing one
        ticks = int(stat.rsplit(")", 1)[1].split()[19])
        since_boot = ticks / os.sysconf("SC_CLK_TCK")
        boot_now = time.clock_gettime(time.CLOCK_BOOTTIME)
    except (OSError, ValueError, IndexError, AttributeError):
        return None
    return time.time() - (boot_now - since_boot)


class Stages:
    """A start as named stages run in order, each once, with the seconds each took (``seconds``, to the
    millisecond). ``run(until=name)`` runs the stages not yet run up to and including ``name`` (default: all), so
    that a caller may stop after any stage, do its own work and go on later from where it stopped."""

    def __init__(self, stages: list[tuple[str, Callable[[], Any]]]) -> None:
        names = [n for n, _ in stages]
        if len(set(names)) != len(names):
            raise ValueError(f"stage names repeat: {names}")
        self.stages = stages
        self.seconds: dict[str, float] = {}

    @property
    def names(self) -> list[str]:
        return [n for n, _ in self.stages]

    @property
    def finished(self) -> bool:
        return len(self.seconds) == len(self.stages)

    def run(self, until: str | None = None) -> dict[str, float]:
        """The stages not run yet, in order, through ``until``; the seconds of every stage run so far. A stage that
        raises is not recorded (the exception goes to the caller)."""
        if until is not None and until not in self.names:
            raise ValueError(f"no start-up stage {until!r} (the stages: {', '.join(self.names)})")
        for name, fn in self.stages:
            if name not in self.seconds:
                t = time.perf_counter()
                fn()
                self.seconds[name] = round(time.perf_counter() - t, 3)
            if name == until:
                break
        return dict(self.seconds)
