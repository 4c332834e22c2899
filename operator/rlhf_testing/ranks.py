"""The end of a torch.distributed rank script run by a test (``python -c``, gloo, several ranks).

Why not just return: a gloo process group runs its collectives on C++ worker threads; a finished work is released
on such a thread, and with it the last reference to a tensor, which takes the GIL. Should that happen while the
interpreter finalizes (on a loaded machine the thread trails the main one), CPython ends the thread with
pthread_exit, and the unwinding through the noexcept ``~AsyncWork`` calls std::terminate: "terminate called
without an active exception", return code -6, and the rank's buffered output is lost. The group's destructor alone
joins those threads, and once FSDP2 has used the group it never runs (``tests/runtime/test_fsdp_lean_gathers.py``
found this). So a rank waits for the others, tears the group down, flushes and leaves with ``os._exit``: the
interpreter is never finalized under live gloo threads.
"""

from __future__ import annotations

import os
import sys


def exit_rank(code: int = 0, barrier: bool = True) -> None:
    """Leave this rank's process: with ``barrier`` (the other ranks are not stuck elsewhere) wait until every rank is
    past its collectives, destroy the process group, flush stdout and stderr, ``os._exit(code)``."""
    try:
        import torch.distributed as dist

        if dist.is_initialized():
            if barrier:
                dist.barrier()
            dist.destroy_process_group()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
