"""``infra.startup.process_started``: a process's creation time, read from ``/proc`` (the actors' start-up record)."""

from __future__ import annotations

import subprocess
import sys
import time

from rlhf_runtime.infra.startup import process_started


def test_a_child_process_began_between_the_calls_around_its_start() -> None:
    before = time.time()
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        after = time.time()
        began = process_started(child.pid)
        assert began is not None
        # the kernel counts in clock ticks (10 ms): the start is floored to one
        assert before - 0.011 <= began <= after, (before, began, after)
    finally:
        child.kill()
        child.wait()


def test_this_process_began_before_now_and_a_missing_one_is_none() -> None:
    began = process_started()
    assert began is not None and began <= time.time()
    assert process_started(2**22 + 7) is None  # above Linux's largest pid
