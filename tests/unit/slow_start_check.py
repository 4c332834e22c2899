"""A math check whose module imports slowly in a worker process (as math-verify and sympy do on a loaded node):
``test_runtime_math_reward`` passes ``equal`` to a ``MathVerifier`` whose per-check limit is shorter than the
import. In the test's own process it imports at once."""

from __future__ import annotations

import multiprocessing
import time

IMPORT_S = 4.0  #: the import's time in a worker: past a 1 s check limit and its grace

if multiprocessing.parent_process() is not None:
    time.sleep(IMPORT_S)


def equal(gold: str, completion: str, timeout_s: int) -> bool:
    return gold == completion
