"""When this process began: beside an actor's own times, where its start went (the progress file's
``actors`` record, ``controller.job_actors``).

A Ray actor's start has three parts the driver cannot tell apart from outside: Ray starting the worker process
(or handing it one it started earlier), the process importing its stack, and the actor's constructor. The
constructor records when it began; ``process_started`` says when the process did, so the import time between
them is known too.

Linux only (``/proc``); elsewhere ``None``. Pure standard library: importable in the operator's image too.
"""

from __future__ import annotations

import os
import time
from pathlib import Path


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
