"""The child side of :mod:`rlhf_runtime.agent.isolation`: isolates one piece of untrusted Python, runs it, and
supervises it until it ends.

Started as ``python -I -S -c <this file's source> <config json>`` with the code on stdin and a status pipe (the
config's ``status_fd``). Stdlib only, and nothing from this package: it runs without site-packages.

Three processes:

- the supervisor (this process) reads the code, enters new user, mount, network, PID and IPC namespaces, maps its
  uid and gid to ``INNER_ID`` inside, forks the init, and waits for it; at the wall-clock deadline, or on SIGTERM
  from the parent, it SIGKILLs the init. It sits outside the new PID namespace, so the code can neither see nor
  signal it.
- the init is PID 1 of the new PID namespace: when it dies, the kernel kills every process of the namespace. It
  makes all mounts private and read-only, hides the masked paths under empty read-only tmpfs mounts (the
  interpreter's own installation stays visible where it lies under one), mounts a fresh ``/proc`` (an empty tmpfs
  where the container runtime refuses that), mounts a fresh size-limited tmpfs on the work directory and writes
  the code there; then it forks the code, reaps every process until the code ends, and reports how it ended.
- the code, PID 2 (an ordinary process: signals it sends itself work, unlike for a namespace's init), gets the
  rlimits and no_new_privs, every other descriptor closed, and execs ``python -I -S <workdir>/main.py`` with a
  non-root uid, which drops every capability.

The status pipe carries lines for the parent: ``isolation:<why>`` when a step of the isolation failed (the code
then never runs), ``timeout`` when the deadline killed the init, and last ``exit:<code>`` or ``signal:<number>``.
"""

import ctypes
import errno
import json
import os
import re
import resource
import signal
import sys

CLONE_NEWNS = 0x00020000
CLONE_NEWIPC = 0x08000000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000
NAMESPACES = CLONE_NEWUSER | CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWPID | CLONE_NEWIPC

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_NOATIME, MS_NODIRATIME, MS_BIND, MS_REC = 32, 1024, 2048, 4096, 16384
MS_PRIVATE, MS_RELATIME, MS_STRICTATIME = 1 << 18, 1 << 21, 1 << 24
#: Per-mount flags a remount inside a user namespace must repeat (the kernel locks them).
LOCKED_FLAGS = {b"nosuid": MS_NOSUID, b"nodev": MS_NODEV, b"noexec": MS_NOEXEC, b"noatime": MS_NOATIME,
                b"nodiratime": MS_NODIRATIME, b"relatime": MS_RELATIME, b"strictatime": MS_STRICTATIME}
PR_SET_PDEATHSIG, PR_SET_NO_NEW_PRIVS = 1, 38
INNER_ID = 1000
ISOLATION_FAILED = 125

libc = ctypes.CDLL(None, use_errno=True)


class IsolationError(Exception):
    """A step of the isolation failed; the message says which and why."""


def _check(result: int, what: str) -> None:
    if result != 0:
        code = ctypes.get_errno()
        raise IsolationError(f"{what}: {errno.errorcode.get(code, code)} ({os.strerror(code)})")


def _mount(source, target, fstype, flags: int, data, what: str) -> None:
    enc = [os.fsencode(x) if isinstance(x, str) else x for x in (source, target, fstype, data)]
    _check(libc.mount(enc[0], enc[1], enc[2], ctypes.c_ulong(flags), enc[3]), what)


def _report(fd: int, line: str) -> None:
    try:
        os.write(fd, (line.replace("\n", " ") + "\n").encode(errors="replace"))
    except OSError:
        pass


def _unshare_hint(code: int) -> str:
    if code == errno.EPERM:
        return ("user namespaces are refused here: a seccomp profile that forbids unshare (Kubernetes "
                "RuntimeDefault, Docker's default) needs seccompProfile Unconfined or a profile that allows "
                "unshare; otherwise the kernel or AppArmor forbids unprivileged user namespaces "
                "(kernel.unprivileged_userns_clone=1, kernel.apparmor_restrict_unprivileged_userns=0)")
    if code == errno.ENOSPC:
        return "the user namespace limit is reached or 0: raise the sysctl user.max_user_namespaces"
    if code == errno.EINVAL:
        return "the kernel lacks one of user, mount, network, PID or IPC namespaces"
    return "the kernel refused to create namespaces"


def enter_namespaces() -> None:
    """New user, mount, network, PID (for the next child) and IPC namespaces; map our uid and gid to ``INNER_ID``."""
    uid, gid = os.geteuid(), os.getegid()
    if libc.unshare(ctypes.c_int(NAMESPACES)) != 0:
        code = ctypes.get_errno()
        raise IsolationError(f"unshare(CLONE_NEWUSER|CLONE_NEWNS|CLONE_NEWNET|CLONE_NEWPID|CLONE_NEWIPC): "
                             f"{errno.errorcode.get(code, code)} ({os.strerror(code)}): {_unshare_hint(code)}")
    for name, text in (("setgroups", "deny"), ("uid_map", f"{INNER_ID} {uid} 1"), ("gid_map", f"{INNER_ID} {gid} 1")):
        try:
            with open(f"/proc/self/{name}", "w") as f:
                f.write(text)
        except OSError as e:
            raise IsolationError(f"writing /proc/self/{name}: {e}") from e


def _read_only_tree() -> None:
    """Remount every mount of this (private) mount namespace read-only, keeping its locked flags."""
    with open("/proc/self/mountinfo", "rb") as f:
        lines = f.read().splitlines()
    for line in lines:
        fields = line.split()
        target = re.sub(rb"\\([0-7]{3})", lambda m: bytes([int(m[1], 8)]), fields[4])
        flags = MS_REMOUNT | MS_BIND | MS_RDONLY
        for option in fields[5].split(b","):
            flags |= LOCKED_FLAGS.get(option, 0)
        if libc.mount(None, target, None, ctypes.c_ulong(flags), None) != 0:
            code = ctypes.get_errno()
            # Unreachable for us (so for the code too), or no longer a mount root (hidden under a later mount,
            # so not reachable by this path either): nothing to protect through this entry.
            if target != b"/" and code in (errno.EACCES, errno.ENOENT, errno.EINVAL):
                continue
            raise IsolationError(f"remount {target.decode(errors='replace')} read-only: "
                                 f"{errno.errorcode.get(code, code)} ({os.strerror(code)})")


def _under(path: str, root: str) -> bool:
    return path != root and path.startswith(root.rstrip("/") + "/")


def _interpreter_paths() -> set[str]:
    paths = {sys.prefix, sys.exec_prefix, sys.base_prefix, sys.base_exec_prefix, os.path.dirname(sys.executable)}
    paths = {os.path.realpath(p) for p in paths} | {os.path.abspath(p) for p in paths}
    return {p for p in paths if not any(_under(p, other) for other in paths)}


def _mask(masks: list[str], keep: set[str]) -> list[str]:
    """Cover each existing mask directory (or file) with an empty tmpfs (or /dev/null); bind the ``keep`` paths that
    lie under a mask back into it. Returns the masked directories (still writable, for the caller to seal)."""
    targets = sorted({os.path.realpath(m) for m in masks if os.path.lexists(m)} - {"/"})
    reexpose = [(k, os.open(k, os.O_PATH)) for k in sorted(keep) if any(_under(k, t) for t in targets)
                and os.path.exists(k)]
    dirs = []
    for target in targets:
        if os.path.isdir(target):
            _mount("tmpfs", target, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,mode=0755", f"mask {target}")
            dirs.append(target)
        elif os.path.exists(target):
            _mount("/dev/null", target, None, MS_BIND, None, f"mask {target}")
    for path, fd in reexpose:
        if os.path.isdir(f"/proc/self/fd/{fd}"):
            os.makedirs(path, exist_ok=True)
        else:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            open(path, "a").close()
        _mount(f"/proc/self/fd/{fd}", path, None, MS_BIND | MS_REC, None, f"keep {path} visible")
        os.close(fd)
    return dirs


def prepare_filesystem(cfg: dict, code: bytes) -> str:
    """The init's mount setup (see the module docstring); returns the path of the code file."""
    _mount(None, "/", None, MS_REC | MS_PRIVATE, None, "make mounts private")
    _read_only_tree()
    workdir = cfg["workdir"]
    sealed = _mask(cfg["masks"], _interpreter_paths())
    os.makedirs(workdir, exist_ok=True)
    for target in sealed:
        _mount(None, target, None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV, None, f"seal mask {target}")
    try:
        _mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, None, "mount /proc")
    except IsolationError:
        # Container runtimes mask parts of /proc, and then the kernel refuses a fresh one: hide it instead.
        _mount("tmpfs", "/proc", "tmpfs", MS_RDONLY | MS_NOSUID | MS_NODEV, "size=4k", "hide /proc")
    _mount("tmpfs", workdir, "tmpfs", MS_NOSUID | MS_NODEV, f"size={cfg['disk_mb']}m,mode=0700", "mount workdir")
    script = os.path.join(workdir, "main.py")
    with open(script, "wb") as f:
        f.write(code)
    os.chdir(workdir)
    return script


def set_limits(cfg: dict) -> None:
    """rlimits of the code, inherited by everything it starts."""
    mb = 1024 * 1024
    cpu = cfg["cpu_s"]
    for limit, value in ((resource.RLIMIT_AS, cfg["memory_mb"] * mb), (resource.RLIMIT_CPU, (cpu, cpu + 1)),
                         (resource.RLIMIT_FSIZE, cfg["disk_mb"] * mb), (resource.RLIMIT_NOFILE, 256),
                         (resource.RLIMIT_NPROC, cfg["max_processes"]), (resource.RLIMIT_CORE, 0)):
        soft, hard = value if isinstance(value, tuple) else (value, value)
        try:
            resource.setrlimit(limit, (soft, hard))
        except (ValueError, OSError) as e:
            raise IsolationError(f"setrlimit {limit}={value}: {e}") from e


def exec_code(cfg: dict, script: str, status: int) -> None:
    """PID 2 of the namespace: set the limits and exec the code. Never returns."""
    try:
        set_limits(cfg)
        _check(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(PR_SET_NO_NEW_PRIVS)")
        os.set_inheritable(status, False)
        os.closerange(3, status)
        os.closerange(status + 1, 1 << 16)
        python = cfg["python"]
        os.execve(python, [python, "-I", "-S", script], cfg["env"])
    except BaseException as e:  # noqa: BLE001 - whatever failed, the code must not run
        what = str(e) if isinstance(e, IsolationError) else f"{type(e).__name__}: {e}"
        _report(status, f"isolation:{what}")
    os._exit(ISOLATION_FAILED)


def run_init(cfg: dict, code: bytes, status: int) -> None:
    """PID 1 of the new PID namespace: set up the filesystem, start the code, reap every process until the code
    ends, report how it ended. Its exit kills whatever the code left running. Never returns."""
    try:
        _check(libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "prctl(PR_SET_PDEATHSIG)")
        script = prepare_filesystem(cfg, code)
        pid = os.fork()
    except BaseException as e:  # noqa: BLE001 - whatever failed, the code must not run
        what = str(e) if isinstance(e, IsolationError) else f"{type(e).__name__}: {e}"
        _report(status, f"isolation:{what}")
        os._exit(ISOLATION_FAILED)
    if pid == 0:
        exec_code(cfg, script, status)
    while True:
        reaped, wait_status = os.waitpid(-1, 0)
        if reaped == pid:
            break
    _report(status, _ending(wait_status))
    os._exit(0)


def _ending(wait_status: int) -> str:
    if os.WIFSIGNALED(wait_status):
        return f"signal:{os.WTERMSIG(wait_status)}"
    return f"exit:{os.waitstatus_to_exitcode(wait_status)}"


def supervise(cfg: dict, code: bytes, status: int) -> None:
    """Fork the init; kill it at the deadline or on SIGTERM; report how it ended if it did not."""
    state = {"pid": 0, "stop": False}

    def stop(signum, _frame) -> None:
        state["stop"] = True
        if signum == signal.SIGALRM:
            _report(status, "timeout")
        if state["pid"]:
            os.kill(state["pid"], signal.SIGKILL)

    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGALRM):
        signal.signal(signum, stop)
    pid = os.fork()
    if pid == 0:
        for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGALRM):
            signal.signal(signum, signal.SIG_DFL)
        run_init(cfg, code, status)
    state["pid"] = pid
    if state["stop"]:
        os.kill(pid, signal.SIGKILL)
    signal.setitimer(signal.ITIMER_REAL, cfg["timeout_s"])
    _, wait_status = os.waitpid(pid, 0)
    signal.setitimer(signal.ITIMER_REAL, 0)
    if wait_status != 0:  # the init reports the code's ending itself, then exits 0
        _report(status, _ending(wait_status))


def main() -> None:
    cfg = json.loads(sys.argv[1])
    status = cfg["status_fd"]
    code = sys.stdin.buffer.read()
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    try:
        enter_namespaces()
    except IsolationError as e:
        _report(status, f"isolation:{e}")
        sys.exit(ISOLATION_FAILED)
    supervise(cfg, code, status)


if __name__ == "__main__":
    main()
