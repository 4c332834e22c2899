"""Runs untrusted Python (the agent's built-in ``python`` tool) isolated: no credentials, no network, limits on
time, memory, processes, disk and output. A fault in the code is data for the trajectory (a :class:`RunResult`
with ``ok=False``), never an exception in the caller.

How (the child side is :mod:`rlhf_runtime.agent.isolation_launcher`):

- The code runs as ``python -I -S <workdir>/main.py`` (isolated mode, no site-packages: the standard library
  only) in new user, mount, network, PID and IPC namespaces, in its own session and process group.
- Network: a new network namespace with only a loopback interface, left down: every connect fails, to the host's
  own ``127.0.0.1`` too.
- Credentials: the environment is replaced by ``PATH``, ``LANG`` and ``HOME``/``TMPDIR`` (the work directory),
  none of the parent's variables; a fresh ``/proc`` of the new PID namespace shows no other process, so no other
  process's environment or memory; the masked paths (by default ``/var/run/secrets`` and ``/run/secrets``, where
  Kubernetes mounts service-account tokens, and the parent's home) are hidden under empty read-only tmpfs mounts.
  The interpreter's own installation stays visible where it lies under a mask. The code runs with a non-root uid
  in its namespace and no capabilities, so it cannot unmount a mask.
- Filesystem: every mount is read-only; the work directory (``workdir``, default the temp directory) is a fresh
  tmpfs of ``disk_mb`` over it, hiding the host's temp files, and vanishes with the run. Writes elsewhere fail with
  ``EROFS``; nothing the code writes outlives the run. Reads are those of the parent's uid (as root, a root
  parent's sandbox reads root-readable files that no mask hides: add the paths of mounted secret files to
  ``masks``).
- Limits: the wall clock (a supervisor outside the PID namespace SIGKILLs the namespace's init at the deadline,
  which kills every process the code started); rlimits on address space, CPU time (SIGXCPU counts as a timeout),
  file size, open files, processes (per user namespace; not enforced where the parent is root outside) and core
  dumps (none); output: stdout and stderr are read concurrently, at most ``max_output_bytes`` kept, and a run
  that writes more is stopped and marked ``output_truncated``.

Where it works: Linux with unprivileged user namespaces (or as root). Kubernetes' ``RuntimeDefault`` seccomp
profile and Docker's default profile forbid ``unshare``: the pod needs ``seccompProfile: Unconfined`` (or a
profile that allows ``unshare``). Where the namespaces cannot be created, :func:`check_isolation` says why and
:func:`run_python` returns ``error="isolation:<why>"`` without running the code; it never runs code unisolated.
"""

from __future__ import annotations

import asyncio
import codecs
import contextlib
import functools
import json
import math
import os
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

LAUNCHER = Path(__file__).with_name("isolation_launcher.py")
#: The variables of the child's environment; nothing else of the parent's passes.
BASE_ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8"}
#: Kubernetes' service-account token and other secrets' usual mount points; the parent's home is added.
SECRET_PATHS = ("/var/run/secrets", "/run/secrets")
#: Seconds past ``timeout_s`` before the parent kills the launcher itself (it normally enforces the deadline).
BACKSTOP_S = 10.0
#: Seconds to wait for the pipes to close after a kill.
DRAIN_AFTER_KILL_S = 5.0
READ_CHUNK = 65536
CAP_SETGID = 6


@dataclass(frozen=True)
class Limits:
    """Limits of one isolated run."""

    timeout_s: float = 10.0
    """Wall-clock seconds from the start of the code to its kill (with everything it started); > 0."""
    memory_mb: int = 512
    """Address space of each process in MiB (RLIMIT_AS); >= 64 (the interpreter needs some)."""
    max_output_bytes: int = 16384
    """Bytes of stdout then stderr kept; a run that writes more is stopped and its output cut with a marker."""
    cpu_s: int | None = None
    """CPU seconds per process (RLIMIT_CPU); default ``ceil(timeout_s) + 1``."""
    disk_mb: int = 64
    """Size of the work directory's tmpfs and the largest file (RLIMIT_FSIZE) in MiB; >= 1."""
    max_processes: int = 64
    """Processes and threads the code may run (RLIMIT_NPROC, per user namespace); >= 1."""

    def __post_init__(self) -> None:
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {self.timeout_s}")
        if self.memory_mb < 64:
            raise ValueError(f"memory_mb must be >= 64, got {self.memory_mb}")
        if self.max_output_bytes < 0:
            raise ValueError(f"max_output_bytes must be >= 0, got {self.max_output_bytes}")
        if self.cpu_s is not None and self.cpu_s < 1:
            raise ValueError(f"cpu_s must be >= 1 or None, got {self.cpu_s}")
        if self.disk_mb < 1 or self.max_processes < 1:
            raise ValueError(f"disk_mb and max_processes must be >= 1, got {self.disk_mb}, {self.max_processes}")

    @property
    def cpu_seconds(self) -> int:
        return self.cpu_s if self.cpu_s is not None else math.ceil(self.timeout_s) + 1


@dataclass(frozen=True)
class RunResult:
    """How one isolated run ended."""

    ok: bool
    """Exit code 0 and no limit hit."""
    output: str
    """stdout then stderr, decoded with ``errors="replace"``, cut at ``max_output_bytes`` with a marker."""
    error: str | None
    """``timeout`` | ``memory`` | ``output_truncated`` | ``exit:<code>`` | ``signal:<name>`` |
    ``isolation:<why>`` (the code did not run) | None."""
    exit_code: int | None
    """The code's exit code; ``-N`` when signal N ended it; None when it did not run or the parent killed it."""
    seconds: float
    """Wall-clock seconds of the whole run, the isolation's setup included."""
    truncated: bool
    """Output was cut."""
    invalid_utf8: bool = False
    """The output kept held bytes that are not UTF-8 (replaced in ``output``); a multi-byte character split by the
    cut is not counted."""


def default_masks() -> tuple[str, ...]:
    """The paths hidden by default: :data:`SECRET_PATHS` and the parent's home (``~`` now)."""
    return (*SECRET_PATHS, os.path.expanduser("~"))


@functools.cache
def _launcher_source() -> str:
    return LAUNCHER.read_text()


class _Output:
    """stdout and stderr of one run, each kept up to the cap; ``overflow`` is set once their sum passes it."""

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self.kept = (bytearray(), bytearray())
        self.seen = 0
        self.overflow = asyncio.Event()

    async def drain(self, stream: asyncio.StreamReader, index: int) -> None:
        buf = self.kept[index]
        while chunk := await stream.read(READ_CHUNK):
            self.seen += len(chunk)
            if len(buf) < self.cap:
                buf += chunk[: self.cap - len(buf)]
            if self.seen > self.cap:
                self.overflow.set()

    def text(self) -> tuple[str, bool, bool]:
        """(stdout then stderr, cut at the cap with a marker; whether it was cut; whether the bytes it shows
        are not UTF-8)."""
        data = bytes(self.kept[0] + self.kept[1])
        truncated = self.seen > self.cap
        text = data[: self.cap].decode("utf-8", errors="replace")
        if truncated:
            text += f"\n[output truncated: more than {self.cap} bytes]"
        out, err = bytes(self.kept[0][: self.cap]), bytes(self.kept[1][: self.cap - len(self.kept[0])])
        valid = _utf8(out, len(out) >= self.cap) and _utf8(err, len(out) + len(err) >= self.cap)
        return text, truncated, not valid

    def memory_error(self) -> bool:
        lines = bytes(self.kept[1]).strip().splitlines()
        return bool(lines) and lines[-1].startswith(b"MemoryError")


def _utf8(data: bytes, cut: bool) -> bool:
    """Is ``data`` UTF-8? When ``cut`` (it may end where the cap split a character) an unfinished last character
    is allowed."""
    try:
        codecs.getincrementaldecoder("utf-8")().decode(data, final=not cut)
    except UnicodeDecodeError:
        return False
    return True


def _config(limits: Limits, python: str, masks: Sequence[str], workdir: str, status_fd: int) -> str:
    return json.dumps({
        "status_fd": status_fd, "python": python, "workdir": workdir, "masks": list(masks),
        "env": {**BASE_ENV, "HOME": workdir, "TMPDIR": workdir}, "timeout_s": limits.timeout_s,
        "memory_mb": limits.memory_mb, "cpu_s": limits.cpu_seconds, "disk_mb": limits.disk_mb,
        "max_processes": limits.max_processes,
    })


async def _feed(stdin: asyncio.StreamWriter, code: bytes) -> None:
    try:
        with contextlib.suppress(ConnectionError):
            stdin.write(code)
            await stdin.drain()
    finally:
        stdin.close()


def _signal_group(proc: asyncio.subprocess.Process, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signum)


async def _supervise(proc: asyncio.subprocess.Process, code: bytes, limits: Limits, out: _Output) -> bool:
    """Feed the code, drain the output, wait for the launcher; stop it on overflow; kill it past the backstop.
    Returns whether the parent had to kill it."""
    work = asyncio.gather(_feed(proc.stdin, code), out.drain(proc.stdout, 0), out.drain(proc.stderr, 1),
                          proc.wait())
    overflow = asyncio.ensure_future(out.overflow.wait())
    deadline = time.monotonic() + limits.timeout_s + BACKSTOP_S
    killed = False
    try:
        await asyncio.wait([work, overflow], timeout=limits.timeout_s + BACKSTOP_S,
                           return_when=asyncio.FIRST_COMPLETED)
        if overflow.done() and not work.done():
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)  # the launcher kills the code's whole PID namespace
            await asyncio.wait([work], timeout=max(0.0, deadline - time.monotonic()))
        if not work.done():
            killed = True
            _signal_group(proc, signal.SIGKILL)
            await asyncio.wait([work], timeout=DRAIN_AFTER_KILL_S)
        return killed
    finally:
        overflow.cancel()
        if not work.done():  # cancelled: kill, and let the pipes close before the loop may end
            _signal_group(proc, signal.SIGKILL)
            await asyncio.wait([work], timeout=DRAIN_AFTER_KILL_S)
            work.cancel()


def _read_status(fd: int) -> list[str]:
    os.set_blocking(fd, False)
    data = b""
    with contextlib.suppress(BlockingIOError):
        while chunk := os.read(fd, 4096):
            data += chunk
    return data.decode(errors="replace").splitlines()


def _classify(status: list[str], killed: bool, returncode: int | None, out: _Output) -> tuple[str | None, int | None]:
    """(error, exit code) from the launcher's status lines, the parent's kill and the output."""
    isolation = next((line for line in status if line.startswith("isolation:")), None)
    if isolation:
        return isolation, None
    final = next((line for line in reversed(status) if line.startswith(("exit:", "signal:"))), None)
    if final is None:
        if killed:
            return "timeout", None
        return f"isolation:the launcher ended ({returncode}) without a status", None
    kind, _, number = final.partition(":")
    exit_code = int(number) if kind == "exit" else -int(number)
    if "timeout" in status or killed or exit_code == -signal.SIGXCPU:
        return "timeout", exit_code
    if out.seen > out.cap:
        return "output_truncated", exit_code
    if exit_code != 0 and out.memory_error():
        return "memory", exit_code
    if exit_code < 0:
        return f"signal:{signal.Signals(-exit_code).name}", exit_code
    return (f"exit:{exit_code}" if exit_code else None), exit_code


def _has_capability(number: int) -> bool:
    try:
        with open("/proc/self/status") as f:
            effective = next(line.split()[1] for line in f if line.startswith("CapEff:"))
    except (OSError, StopIteration):
        return False
    return bool(int(effective, 16) >> number & 1)


def _spawn_options(status_w: int) -> dict:
    options = {"stdin": asyncio.subprocess.PIPE, "stdout": asyncio.subprocess.PIPE,
               "stderr": asyncio.subprocess.PIPE, "env": dict(BASE_ENV), "cwd": "/", "close_fds": True,
               "pass_fds": (status_w,), "start_new_session": True}
    if _has_capability(CAP_SETGID):
        options["extra_groups"] = []  # the parent's supplementary groups do not pass
    return options


async def run_python(code: str, limits: Limits, *, python: str = sys.executable, masks: Sequence[str] | None = None,
                     workdir: str | None = None) -> RunResult:
    """Run ``code`` isolated under ``limits`` (see the module docstring); never raises for anything the code does.

    ``python``: the interpreter (an absolute path); ``masks``: paths to hide (default :func:`default_masks`);
    ``workdir``: an existing directory, where the run's fresh tmpfs is mounted over whatever it holds: the code's
    cwd and home (default the temp directory)."""
    start = time.monotonic()
    python = shutil.which(python) or python
    masks = default_masks() if masks is None else tuple(masks)
    workdir = os.path.abspath(workdir or tempfile.gettempdir())
    status_r, status_w = os.pipe()
    out = _Output(limits.max_output_bytes)
    try:
        try:
            proc = await asyncio.create_subprocess_exec(
                python, "-I", "-S", "-c", _launcher_source(), _config(limits, python, masks, workdir, status_w),
                **_spawn_options(status_w))
        except OSError as e:
            return RunResult(False, "", f"isolation:cannot start {python}: {e}", None, time.monotonic() - start, False)
        finally:
            os.close(status_w)
        killed = await _supervise(proc, code.encode("utf-8", errors="replace"), limits, out)
        error, exit_code = _classify(_read_status(status_r), killed, proc.returncode, out)
    finally:
        os.close(status_r)
    text, truncated, invalid = out.text()
    if error and error.startswith("isolation:"):
        exit_code = None
    return RunResult(error is None, text, error, exit_code, time.monotonic() - start, truncated, invalid)


@functools.cache
def check_isolation(python: str = sys.executable) -> str | None:
    """None when :func:`run_python` can isolate code here (a trivial run goes through every step of the
    isolation); else why not and what to change. Cached per interpreter; safe to call inside an event loop."""
    probe = run_python("pass", Limits(timeout_s=30), python=python)
    with ThreadPoolExecutor(1) as pool:
        result = pool.submit(asyncio.run, probe).result()
    if result.ok:
        return None
    if result.error and result.error.startswith("isolation:"):
        return result.error.removeprefix("isolation:")
    return f"a trivial isolated run failed ({result.error}): {result.output[-2000:]}"
