"""``rlhf_runtime.main.exit_process``: the driver's process ends with the run's exit status after what a normal
exit would do first (threads that are not daemons finish, atexit handlers run, buffered output is flushed),
without the interpreter's teardown. Run in a fresh interpreter, since the function ends its process."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

SCRIPT = r'''
import atexit, sys, threading, time
from rlhf_runtime.main import exit_process

out = sys.argv[1]
go = threading.Event()

def late_worker():
    go.wait()  # still running when exit_process is called
    time.sleep(0.2)
    with open(out, "a") as f:
        f.write("thread\n")

atexit.register(lambda: open(out, "a").write("atexit\n"))
threading.Thread(target=late_worker).start()
sys.stdout.write("buffered, no newline")
go.set()
exit_process(3)
print("not reached")
'''


def test_exit_process_keeps_the_status_threads_atexit_and_output(tmp_path: Path) -> None:
    out = tmp_path / "order.txt"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}  # output block-buffered (PYTHONUNBUFFERED unset)
    r = subprocess.run([sys.executable, "-c", SCRIPT, str(out)], capture_output=True, text=True, timeout=60,
                       stdin=subprocess.DEVNULL, env=env, check=False)
    assert r.returncode == 3, r.stderr
    assert r.stdout == "buffered, no newline"  # flushed, and nothing ran after exit_process
    assert out.read_text() == "thread\natexit\n"  # the thread finished before the atexit handlers ran
