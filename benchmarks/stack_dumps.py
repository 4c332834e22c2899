"""A benchmark run watched from its parent process: its output into a log (``watch``), and at its time limit the
Python stacks of the run and of every benchmark actor (``stack_dump``: each registered ``faulthandler`` on
``STACK_SIGNAL``, ``bench_actors.enable_stack_dumps``; ``actor_stacks`` reads the actors' from Ray's worker
logs) and optionally every Ray process's native stacks (``native_stacks``, py-spy) before it is killed, so a hang
shows where each side waits. Imports neither torch nor the runtime."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

from harness import kill_group

#: ``bench_actors.STACK_SIGNAL`` and ``ACTOR_TITLE`` (the parent does not import the runtime); the most seconds to
#: wait for the stacks; where Ray keeps each worker's stderr (``worker-<id>-<pid>.err``: the actors' stacks).
STACK_SIGNAL, ACTOR_TITLE, STACK_WAIT_S = signal.SIGUSR1, "ray::Bench", 10.0
RAY_LOGS = Path("/tmp/ray/session_latest/logs")


def actor_stacks(pids: list[int], polls: dict[str, str] | None = None) -> str:
    """The stacks the actors ``pids`` wrote to their stderr on ``STACK_SIGNAL`` (Ray's worker logs, ``RAY_LOGS``),
    one section per actor. Polling (``polls``: a dict the caller keeps between calls): "" until every one of them
    has written its stacks and they read the same as at the previous poll (faulthandler writes a dump in pieces,
    so the first sight of one may be cut off mid-line)."""
    parts = []
    for pid in pids:
        text = "".join(f.read_text(errors="replace") for f in RAY_LOGS.glob(f"worker-*-{pid}.err"))
        start = min((i for i in (text.find("Current thread 0x"), text.find("Thread 0x")) if i >= 0), default=-1)
        if start < 0 and polls is not None:
            return ""
        parts.append(f"\n=== stacks of actor pid {pid}\n" + (text[start:] if start >= 0 else "(none written)\n"))
    text = "".join(parts)
    if polls is not None:
        stable, polls["last"] = polls.get("last") == text, text
        return text if stable else ""
    return text


def titled_processes(run_pid: int, title: bytes) -> list[int]:
    """The run ``run_pid`` first, then every other process on this machine whose command line starts with
    ``title`` (a process title such as ``ray::``)."""
    pids = [run_pid]
    for d in Path("/proc").iterdir():
        if d.name.isdigit() and int(d.name) != run_pid:
            try:
                if (d / "cmdline").read_bytes().startswith(title):
                    pids.append(int(d.name))
            except OSError:  # gone meanwhile
                continue
    return pids


def ray_processes(run_pid: int) -> list[int]:
    """The run ``run_pid`` and every Ray process on this machine (process title ``ray::...``: actors, vLLM's
    engine workers, Ray's own), for ``native_stacks``."""
    return titled_processes(run_pid, b"ray::")


def native_stacks(py_spy: str, pids: list[int], timeout_s: float = 20.0) -> str:
    """``py-spy dump --native`` of each of ``pids``: every thread's Python and native frames, read from outside
    the process (no signal handler needed, so vLLM's engine workers too; where a host thread blocks inside NCCL or
    CUDA). One section per process, its command line first."""
    parts = []
    for pid in pids:
        try:
            title = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")[:160]
        except OSError:
            continue
        try:
            out = subprocess.run([py_spy, "dump", "--native", "--pid", str(pid)], capture_output=True, text=True,
                                 timeout=timeout_s, check=False)
            text = out.stdout + out.stderr
        except subprocess.TimeoutExpired:
            text = f"(py-spy took over {timeout_s:.0f} s)\n"
        parts.append(f"\n=== native stacks of pid {pid}: {title}\n{text}")
    return "".join(parts)


def stack_dump(run_pid: int) -> list[int]:
    """Ask a run past its limit (``run_pid``, which registered the dump in ``child``) and every benchmark actor
    (process title ``ACTOR_TITLE``...: they register it when they start) for the stacks of their threads; the pids
    asked, the run's first. Other processes are left alone: the signal would end a process that did not register
    it."""
    asked = []
    for pid in titled_processes(run_pid, ACTOR_TITLE.encode()):
        try:
            os.kill(pid, STACK_SIGNAL)
            asked.append(pid)
        except ProcessLookupError:
            continue
    return asked


def watch(cmd: list[str], log: Path, limit: float, echo: Callable[[str], bool], native: Path | None = None,
          py_spy: str = "") -> int | None:
    """Run ``cmd`` in a process group of its own, its output appended to ``log`` and its lines for which ``echo``
    is true printed; past ``limit`` seconds: the native stacks of every Ray process into ``native`` (with
    ``py_spy``), the Python stacks of the run and of every benchmark actor into ``log``. The group is killed
    once ``cmd`` ends or at the limit: what the run started (its local Ray) ends with it, and nothing else on
    the machine does (``ray stop`` would end every Ray here, another run's too). Returns the exit code, or None
    at the limit."""
    with open(log, "ab") as f:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
        assert proc.stdout is not None
        deadline = time.time() + limit
        os.set_blocking(proc.stdout.fileno(), False)
        while proc.poll() is None and time.time() < deadline:
            chunk = proc.stdout.read() or b""
            f.write(chunk)
            for line in chunk.decode(errors="replace").splitlines():
                if echo(line):
                    print("   ", line[:400], flush=True)
            time.sleep(0.5)
        if proc.poll() is not None:
            f.write(proc.stdout.read() or b"")
            kill_group(proc.pid)
            return proc.returncode
        if py_spy and native is not None:  # before the signals below: the stacks as the run hung
            native.write_text(native_stacks(py_spy, ray_processes(proc.pid)))
        asked = stack_dump(proc.pid)
        print(f"TIMEOUT after {limit:.0f}s; stacks of {len(asked)} processes in {log}", flush=True)
        until = time.time() + STACK_WAIT_S  # the run's own go to its output, the actors' to Ray's logs
        polls: dict[str, str] = {}
        while proc.poll() is None and time.time() < until and not actor_stacks(asked[1:], polls):
            f.write(proc.stdout.read() or b"")
            time.sleep(0.5)
        f.write(proc.stdout.read() or b"")
        f.write(actor_stacks(asked[1:]).encode())
        kill_group(proc.pid)
        proc.wait()
        return None
