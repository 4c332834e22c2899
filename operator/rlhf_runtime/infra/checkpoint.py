"""Checkpoint directory layout and its crash-safe commit (pure Python; the trainer writes the contents).

Layout: ``<checkpoint.path>/step-<8 digits>/`` holds ``model/`` (HF ``save_pretrained``), ``optimizer.pt`` and
``state.json`` (``{"step": N, "files": {relative path: size, ...}, ...}``, written last).

Writing (``tmp_dir`` + ``commit``): the trainer writes everything into ``.tmp-step-<N>-<host>-<pid>/``;
``commit`` then

1. fsyncs every regular file and every directory under it (the weights are on disk, not in the page cache),
2. writes ``state.json`` (the step, the size of every file, ``extra``), fsyncs it and the directory,
3. renames it to ``step-<N>`` and fsyncs the parent (and its parent). When ``step-<N>`` already exists (a re-save of the same
   step) the old one is first renamed aside to ``.old-step-<N>-<host>-<pid>/``, the new one renamed in, the
   parent fsynced, and only then the old one removed. If renaming the new one in fails, the old one is renamed
   back before the error propagates.

So a crash (or a failing filesystem operation) at any point leaves, for every step that was complete before,
a complete copy: as ``step-<N>``, or, killed between the two renames of a re-save, as ``.old-step-<N>-...``,
which ``latest`` accepts while ``step-<N>`` is missing and ``prune`` renames back once its writer is gone.

Reading (``latest``): the highest *complete* step: ``state.json`` present, a JSON object whose ``step`` equals
the number in the name, and every file it lists present with its recorded size (checkpoints of older
runtimes have no ``files`` and are accepted on the first two). Anything else is skipped with a warning.

Pruning (``prune``): keeps the newest ``keep`` complete steps, removes older ``step-*`` directories and the
temporary (``.tmp-step-*``) and set-aside (``.old-step-*``) directories of writers that are gone. A writer is
gone when its directory is for a step *older than the newest complete step* (whatever it is still doing is
superseded, and its commit, if it is alive after all, fails on the missing directory without harming anything
complete), or when its name says it ran on *this host* (``socket.gethostname()``: the pod name) under a pid
that no longer exists here. Pids alone are not enough: the checkpoint volume may be shared by pods, each with
its own pid namespace, so a pid from another host says nothing, and is never used. A pid that was reused by
another process on this host reads as alive: such a directory waits until it is superseded (never removed
too early). The directory of a live concurrent writer of the newest step is never touched.

FSDP (``agree``): every rank must resume from the same step. ``agree(found, rank)`` returns rank 0's ``found``
on every rank (``torch.distributed.broadcast_object_list`` when a process group is initialised; the value
itself otherwise), so the trainer does
``found = ckpt.agree(ckpt.latest(path) if rank == 0 else None, rank)``. torch is imported only there.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import socket
import stat
from pathlib import Path
from typing import Any

log = logging.getLogger("rlhf_runtime.infra.checkpoint")

STEP_DIR = re.compile(r"^step-(\d{8})$")
#: ``.tmp-step-<N>-<host>-<pid>`` (a write in progress) and ``.old-step-<N>-<host>-<pid>`` (a re-save's set-aside
#: previous copy); ``.tmp-step-<N>-<pid>`` is the name older runtimes used (host unknown).
WORK_DIR = re.compile(r"^\.(tmp|old)-step-(\d{8})-(?:(.+)-)?(\d+)$")
STATE = "state.json"

Found = tuple[int, Path]


def _host() -> str:
    return socket.gethostname() or "localhost"


def step_dir(root: str | Path, step: int) -> Path:
    return Path(root) / f"step-{step:08d}"


def tmp_dir(root: str | Path, step: int) -> Path:
    """Where this process writes step ``step`` before ``commit``."""
    return Path(root) / f".tmp-step-{step:08d}-{_host()}-{os.getpid()}"


def aside_dir(root: str | Path, step: int) -> Path:
    """Where ``commit`` puts the previous ``step-<N>`` while it renames the new one in."""
    return Path(root) / f".old-step-{step:08d}-{_host()}-{os.getpid()}"


# ------------------------------------------------------------------------------------------- durability
def _fsync(path: str | Path, directory: bool = False) -> None:
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if directory else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(root: Path) -> dict[str, int]:
    """fsync every regular file and directory under ``root``; returns ``{relative path: size}`` of the files."""
    files: dict[str, int] = {}
    for dirpath, _, filenames in os.walk(root):
        for name in filenames:
            p = os.path.join(dirpath, name)
            st = os.lstat(p)
            if stat.S_ISREG(st.st_mode):
                _fsync(p)
                files[Path(p).relative_to(root).as_posix()] = st.st_size
        _fsync(dirpath, directory=True)
    return files


# ---------------------------------------------------------------------------------------------- reading
def read_state(path: str | Path, step: int | None = None) -> dict[str, Any]:
    """``state.json`` of the checkpoint directory ``path``, checked for completeness; raises ``ValueError``
    saying what is wrong (missing, not JSON, step not ``step``, a listed file missing or of another size)."""
    path = Path(path)
    try:
        text = (path / STATE).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ValueError(f"{path}: no {STATE} (an incomplete checkpoint)") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: cannot read {STATE}: {e}") from e
    try:
        state = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: {STATE} is not valid JSON ({e})") from e
    if not isinstance(state, dict) or not isinstance(state.get("step"), int):
        raise ValueError(f"{path}: {STATE} has no integer 'step'")  # noqa: TRY004 - one error type for callers
    if step is not None and state["step"] != step:
        raise ValueError(f"{path}: {STATE} says step {state['step']}, the directory name step {step}")
    files = state.get("files")
    if files is not None:
        if not isinstance(files, dict):
            raise ValueError(f"{path}: {STATE} 'files' is not an object")
        for name, size in files.items():
            try:
                got = (path / name).stat().st_size
            except OSError:
                raise ValueError(f"{path}: {name} is missing") from None
            if got != size:
                raise ValueError(f"{path}: {name} has {got} bytes, {STATE} recorded {size}")
    return state


def _entries(root: Path) -> tuple[dict[int, Path], list[tuple[str, int, str | None, int, Path]]]:
    steps: dict[int, Path] = {}
    work: list[tuple[str, int, str | None, int, Path]] = []
    for p in root.iterdir():
        if m := STEP_DIR.match(p.name):
            steps[int(m.group(1))] = p
        elif m := WORK_DIR.match(p.name):
            work.append((m.group(1), int(m.group(2)), m.group(3), int(m.group(4)), p))
    return steps, work


def _complete(path: Path, step: int, warn: bool) -> bool:
    try:
        read_state(path, step)
        return True
    except ValueError as e:
        if warn:
            log.warning("skipping checkpoint: %s", e)
        return False


def latest(root: str | Path) -> Found | None:
    """``(step, directory)`` of the highest complete checkpoint under ``root``, or None. A re-save killed between
    its two renames left ``step-<N>`` missing and the previous copy as ``.old-step-<N>-...``: that one counts."""
    root = Path(root)
    if not root.is_dir():
        return None
    steps, work = _entries(root)
    candidates: dict[int, list[Path]] = {s: [p] for s, p in steps.items()}
    for kind, s, _, _, p in work:
        if kind == "old":
            candidates.setdefault(s, []).append(p)
    for s in sorted(candidates, reverse=True):
        for p in candidates[s]:
            if _complete(p, s, warn=p.name.startswith("step-")):
                return s, p
    return None


# ---------------------------------------------------------------------------------------------- writing
def commit(tmp: Path, root: str | Path, step: int, extra: dict | None = None) -> Path:
    """Make ``tmp`` (fully written) the checkpoint of ``step``: durable, then atomically in place (module
    docstring). Returns the final directory. Any error before the new copy is in place propagates and leaves
    the previous checkpoints as they were."""
    tmp, root = Path(tmp), Path(root)
    files = _fsync_tree(tmp)
    files.pop(STATE, None)
    with open(tmp / STATE, "w", encoding="utf-8") as f:
        json.dump({"step": step, **(extra or {}), "files": files}, f)
        f.flush()
        os.fsync(f.fileno())
    _fsync(tmp, directory=True)
    final = step_dir(root, step)
    aside: Path | None = None
    if os.path.lexists(final):  # a re-save of the same step: never a moment without a complete copy
        aside = aside_dir(root, step)
        os.rename(final, aside)
    try:
        os.rename(tmp, final)
    except BaseException:
        if aside is not None:
            try:
                os.rename(aside, final)
            except OSError as e:  # latest() still finds the set-aside copy; prune() restores it later
                log.warning("could not restore %s from %s: %s", final, aside, e)
        raise
    _fsync(root, directory=True)
    try:  # the root's own entry, in case the trainer has just created it (the first checkpoint)
        _fsync(root.parent, directory=True)
    except OSError as e:  # e.g. a parent this process may not read: the checkpoint itself is durable
        log.debug("fsync %s: %s", root.parent, e)
    if aside is not None:
        try:
            shutil.rmtree(aside)
        except OSError as e:  # committed all the same; prune() retries
            log.warning("could not remove the previous copy %s: %s", aside, e)
    return final


# ---------------------------------------------------------------------------------------------- pruning
def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def writer_gone(host: str | None, pid: int, step: int, newest: int | None) -> bool:
    """Whether the writer of a ``.tmp``/``.old`` directory for ``step`` is gone (module docstring)."""
    if newest is not None and step < newest:
        return True
    return host is not None and host == _host() and pid != os.getpid() and not _pid_alive(pid)


def prune(root: str | Path, keep: int = 2) -> None:
    """Keep the newest ``keep`` complete checkpoints; remove older ``step-*`` directories and what dead writers
    left behind (restoring a re-save's set-aside copy whose ``step-<N>`` is missing)."""
    root = Path(root)
    if not root.is_dir():
        return
    steps, work = _entries(root)
    complete = sorted(s for s, p in steps.items() if _complete(p, s, warn=False))
    newest = complete[-1] if complete else None
    for kind, s, host, pid, p in work:
        if not writer_gone(host, pid, s, newest):
            continue
        if kind == "old" and s not in complete and _complete(p, s, warn=False):
            try:  # killed between the renames of a re-save: put the previous copy back
                if s in steps:
                    shutil.rmtree(steps[s])
                os.rename(p, step_dir(root, s))
                steps[s] = step_dir(root, s)
                complete = sorted([*complete, s])
                log.warning("restored checkpoint step %d from %s", s, p.name)
                continue
            except OSError as e:
                log.warning("could not restore %s: %s", p, e)
                continue
        shutil.rmtree(p, ignore_errors=True)
    kept = set(complete[-keep:]) if keep > 0 else set()
    newest = complete[-1] if complete else None
    for s, p in steps.items():
        # older than the newest complete one and not kept: superseded (incomplete ones included)
        if s not in kept and newest is not None and s < newest:
            shutil.rmtree(p, ignore_errors=True)


# ------------------------------------------------------------------------------------------------- FSDP
def agree(found: tuple[int, Any] | None, rank: int, remote: bool = False) -> tuple[int, Any] | None:
    """Rank 0's ``found`` (``latest``'s result, or None) on every rank of the default torch.distributed process
    group, so all FSDP ranks resume from the same step (another rank's own view may differ: a save committed
    between two scans, or a shared filesystem's stale directory cache). Without an initialised process group
    (one trainer) it returns ``found``. Every rank of the group must call it (a collective). Under NCCL, call
    it after ``torch.cuda.set_device``. ``remote``: the location is an object-store URI (``infra.storage``), kept
    as a string (a ``Path`` would fold its ``//``)."""
    try:
        import torch.distributed as dist
    except ImportError:
        return found
    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size() == 1:
        return found
    payload: list[Any] = [None if found is None else [found[0], str(found[1])]] if rank == 0 else [None]
    dist.broadcast_object_list(payload, src=0)
    got = payload[0]
    if got is None:
        return None
    return int(got[0]), (str(got[1]) if remote else Path(got[1]))
