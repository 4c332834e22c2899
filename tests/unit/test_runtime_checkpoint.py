"""Checkpoint directory layout: durable, atomic commit; newest complete step; pruning; FSDP rank agreement.

Failures are real: a failing filesystem operation (a directory in the way, a rename across filesystems, an
immutable file) or a real crash of a child process (``os._exit`` from an audit hook right before the k-th
filesystem call of ``commit``, for every k). Nothing is mocked.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest

from rlhf_runtime.infra import checkpoint as ckpt
from tests.helpers import free_port

HOST = socket.gethostname()


def _save(root: Path, step: int, content: str | None = None) -> Path:
    tmp = ckpt.tmp_dir(root, step)
    shutil.rmtree(tmp, ignore_errors=True)
    (tmp / "model").mkdir(parents=True)
    (tmp / "model" / "weights").write_text(content or str(step))
    (tmp / "optimizer.pt").write_bytes(b"x" * step)
    return ckpt.commit(tmp, root, step, {"base_model": "m"})


def _content(found: tuple[int, Path] | None) -> tuple[int, str] | None:
    return None if found is None else (found[0], (found[1] / "model" / "weights").read_text())


def _dead_pid() -> int:
    p = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True,
                       check=True)
    return int(p.stdout)


def _names(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir())


def test_latest_is_the_highest_complete_step(tmp_path: Path) -> None:
    assert ckpt.latest(tmp_path / "missing") is None
    _save(tmp_path, 2)
    _save(tmp_path, 10)
    (tmp_path / "step-00000012").mkdir()  # no state.json: incomplete, ignored
    ckpt.tmp_dir(tmp_path, 14).mkdir()  # a save that was killed midway
    assert _content(ckpt.latest(tmp_path)) == (10, "10")
    assert not ckpt.tmp_dir(tmp_path, 10).exists()  # renamed into place
    state = json.loads((tmp_path / "step-00000010" / "state.json").read_text())
    assert state == {"step": 10, "base_model": "m", "files": {"model/weights": 2, "optimizer.pt": 10}}


def test_resave_of_the_same_step_replaces_it(tmp_path: Path) -> None:
    _save(tmp_path, 4, "first")
    _save(tmp_path, 4, "second")
    assert _content(ckpt.latest(tmp_path)) == (4, "second")
    assert _names(tmp_path) == ["step-00000004"]  # the set-aside copy is gone


@pytest.mark.parametrize(
    ("damage", "why"),
    [
        (lambda d: (d / "state.json").write_text('{"step": 6'), "not valid JSON"),
        (lambda d: (d / "state.json").write_bytes(b"\xff\xfe"), "cannot read"),
        (lambda d: (d / "state.json").write_text('{"step": 5}'), "says step 5"),
        (lambda d: (d / "state.json").write_text('["step", 6]'), "no integer 'step'"),
        (lambda d: (d / "state.json").unlink(), "no state.json"),
        (lambda d: (d / "model" / "weights").write_text("truncat"), "model/weights has 7 bytes"),
        (lambda d: (d / "optimizer.pt").unlink(), "optimizer.pt is missing"),
    ],
)
def test_corrupt_checkpoint_is_skipped_with_a_warning(tmp_path: Path, caplog: pytest.LogCaptureFixture,
                                                      damage, why: str) -> None:
    _save(tmp_path, 4)
    damage(_save(tmp_path, 6, "sixsix"))
    with caplog.at_level(logging.WARNING, logger="rlhf_runtime.infra.checkpoint"):
        assert _content(ckpt.latest(tmp_path)) == (4, "4")
    assert any("step-00000006" in r.getMessage() and why in r.getMessage() for r in caplog.records), caplog.text
    ckpt.prune(tmp_path, keep=2)  # a corrupt newer step is left for a human; it does not count as kept
    assert "step-00000004" in _names(tmp_path)


def test_prune_keeps_the_newest_and_removes_what_dead_writers_left(tmp_path: Path) -> None:
    for s in (2, 4, 6):
        _save(tmp_path, s)
    dead = _dead_pid()
    work = {
        f".tmp-step-00000008-{HOST}-{dead}": False,  # this host, pid gone: removed
        f".tmp-step-00000008-{HOST}-{os.getpid()}": True,  # a live writer (this process): kept
        f".tmp-step-00000008-other-pod-{dead}": True,  # another host: its pid says nothing, kept
        f".tmp-step-00000004-other-pod-{os.getpid()}": False,  # older than the newest complete step: superseded
        f".old-step-00000006-other-pod-{dead}": True,  # a live re-save of the newest step elsewhere: kept
        f".old-step-00000002-{HOST}-{os.getpid()}": False,  # superseded (step-2 goes too)
        f".tmp-step-00000008-{dead}": True,  # an older runtime's name (no host), not superseded: kept
        f".tmp-step-00000005-{dead}": False,  # older runtime's name, superseded
    }
    for name in work:
        (tmp_path / name).mkdir()
        (tmp_path / name / "f").write_text("x")
    ckpt.prune(tmp_path, keep=2)
    assert _names(tmp_path) == sorted(["step-00000004", "step-00000006", *(n for n, kept in work.items() if kept)])
    assert _content(ckpt.latest(tmp_path)) == (6, "6")


# --------------------------------------------------------------------------- failing filesystem operations
def test_failure_writing_state_json_leaves_the_previous_checkpoint(tmp_path: Path) -> None:
    _save(tmp_path, 2)
    tmp = ckpt.tmp_dir(tmp_path, 4)
    (tmp / "model").mkdir(parents=True)
    (tmp / "model" / "weights").write_text("4")
    (tmp / "state.json").mkdir()  # in the way of state.json
    with pytest.raises(IsADirectoryError):
        ckpt.commit(tmp, tmp_path, 4)
    assert _content(ckpt.latest(tmp_path)) == (2, "2")
    assert not (tmp_path / "step-00000004").exists()


def _other_filesystem() -> Path:
    shm = Path("/dev/shm")
    if not shm.is_dir() or os.stat(shm).st_dev == os.stat(tempfile.gettempdir()).st_dev:
        pytest.skip("needs /dev/shm on another filesystem than the temporary directory")
    return shm


def test_failing_rename_of_a_new_step_leaves_the_previous_checkpoint(tmp_path: Path) -> None:
    _save(tmp_path, 2)
    elsewhere = Path(tempfile.mkdtemp(dir=_other_filesystem()))
    try:
        tmp = elsewhere / "tmp"
        (tmp / "model").mkdir(parents=True)
        (tmp / "model" / "weights").write_text("4")
        with pytest.raises(OSError) as e:  # rename across filesystems: EXDEV
            ckpt.commit(tmp, tmp_path, 4)
        assert e.value.errno == errno.EXDEV
    finally:
        shutil.rmtree(elsewhere)
    assert _content(ckpt.latest(tmp_path)) == (2, "2")


def test_failing_rename_aside_on_resave_keeps_the_old_copy(tmp_path: Path) -> None:
    _save(tmp_path, 4, "old")
    blocker = ckpt.aside_dir(tmp_path, 4)
    (blocker / "x").mkdir(parents=True)  # a non-empty directory in the way: ENOTEMPTY
    tmp = ckpt.tmp_dir(tmp_path, 4)
    (tmp / "model").mkdir(parents=True)
    (tmp / "model" / "weights").write_text("new")
    with pytest.raises(OSError):
        ckpt.commit(tmp, tmp_path, 4)
    assert _content(ckpt.latest(tmp_path)) == (4, "old")


def test_failing_rename_in_on_resave_puts_the_old_copy_back(tmp_path: Path) -> None:
    _save(tmp_path, 4, "old")
    elsewhere = Path(tempfile.mkdtemp(dir=_other_filesystem()))
    try:
        tmp = elsewhere / "tmp"
        (tmp / "model").mkdir(parents=True)
        (tmp / "model" / "weights").write_text("new")
        with pytest.raises(OSError) as e:
            ckpt.commit(tmp, tmp_path, 4)  # old renamed aside, then the rename in fails (EXDEV)
        assert e.value.errno == errno.EXDEV
    finally:
        shutil.rmtree(elsewhere)
    assert _content(ckpt.latest(tmp_path)) == (4, "old")
    assert _names(tmp_path) == ["step-00000004"]


def test_undeletable_old_copy_does_not_fail_the_commit(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    old = _save(tmp_path, 4, "old")
    pinned = old / "model" / "pinned"
    pinned.write_text("x")
    if subprocess.run(["chattr", "+i", str(pinned)], check=False, capture_output=True).returncode:
        pytest.skip("chattr +i is not available here (needs root and a filesystem with the immutable flag)")
    try:
        with caplog.at_level(logging.WARNING, logger="rlhf_runtime.infra.checkpoint"):
            _save(tmp_path, 4, "new")  # the old copy cannot be removed after the rename in
        assert _content(ckpt.latest(tmp_path)) == (4, "new")
        assert "could not remove the previous copy" in caplog.text
        assert ckpt.aside_dir(tmp_path, 4).exists()
    finally:
        subprocess.run(["chattr", "-i", str(ckpt.aside_dir(tmp_path, 4) / "model" / "pinned")], check=True)
    ckpt.prune(tmp_path)  # this (live) writer's set-aside copy of the newest step stays ...
    assert ckpt.aside_dir(tmp_path, 4).exists()
    _save(tmp_path, 6)
    ckpt.prune(tmp_path)  # ... until a newer step supersedes it
    assert _names(tmp_path) == ["step-00000004", "step-00000006"]


# ------------------------------------------------------------------------------- a crash at every point
CRASHER = textwrap.dedent("""
    import os, sys
    from pathlib import Path
    from rlhf_runtime.infra import checkpoint as ckpt

    root, crash_at, step, content = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    tmp = ckpt.tmp_dir(root, step)
    (tmp / "model").mkdir(parents=True)
    (tmp / "model" / "weights").write_text(content)
    (tmp / "optimizer.pt").write_bytes(b"o" * 100)
    seen = []

    def hook(event, args):
        if event in ("open", "os.rename", "shutil.rmtree", "os.scandir", "os.remove", "os.rmdir"):
            if len(seen) == crash_at:
                os._exit(137)  # killed right before this filesystem call
            seen.append(event)

    sys.addaudithook(hook)
    ckpt.commit(tmp, root, step, {"base_model": "m"})
    print("completed", len(seen), flush=True)
""")


def _crash_points(root: Path, step: int, content: str) -> list[tuple[int, str]]:
    """Crash a child's ``commit`` before each of its filesystem calls in turn; returns (exit code, stdout)."""
    out = []
    for k in range(200):
        work = root.parent / f"crash-{k}"
        shutil.copytree(root, work)
        p = subprocess.run([sys.executable, "-c", CRASHER, str(work), str(k), str(step), content],
                           check=False, capture_output=True, text=True, timeout=60)
        out.append((p.returncode, work))
        if p.returncode == 0:
            assert p.stdout.startswith("completed"), p.stdout
            return out
        assert p.returncode == 137, p.stderr
    raise AssertionError("commit did not complete within 200 filesystem calls")


def test_a_crash_at_any_point_of_a_new_step_leaves_a_complete_checkpoint(tmp_path: Path) -> None:
    root = tmp_path / "root"
    root.mkdir()
    _save(root, 2)
    runs = _crash_points(root, 4, "new")
    assert len(runs) > 8  # fsyncs of files and directories, state.json, the rename, the parent's fsync
    for code, work in runs:
        found = _content(ckpt.latest(work))
        assert found in ((2, "2"), (4, "new")), (code, found)
        ckpt.prune(work)  # the crashed writer is gone (this host, dead pid): its temporary directory goes
        assert _content(ckpt.latest(work)) == found
        assert all(n.startswith("step-") for n in _names(work)), _names(work)
    assert _content(ckpt.latest(runs[-1][1])) == (4, "new")


def test_a_crash_at_any_point_of_a_resave_leaves_a_complete_checkpoint(tmp_path: Path) -> None:
    root = tmp_path / "root"
    root.mkdir()
    _save(root, 4, "old")
    runs = _crash_points(root, 4, "new")
    between = 0
    for code, work in runs:
        found = _content(ckpt.latest(work))
        assert found in ((4, "old"), (4, "new")), (code, _names(work))
        if not (work / "step-00000004").exists():  # killed between the two renames
            between += 1
            assert found == (4, "old")
        ckpt.prune(work)  # restores the set-aside copy, or removes it when the new one is in place
        assert _content(ckpt.latest(work)) == found
        assert _names(work) == ["step-00000004"], _names(work)
    assert between == 1
    assert _content(ckpt.latest(runs[-1][1])) == (4, "new")


# ------------------------------------------------------------------------------------------ FSDP agreement
AGREE = textwrap.dedent("""
    import sys
    from pathlib import Path
    import torch.distributed as dist
    from rlhf_runtime.infra import checkpoint as ckpt

    rank, port = int(sys.argv[1]), sys.argv[2]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    mine = (12, Path("/ckpt/step-00000012")) if rank == 0 else (10, Path("/ckpt/step-00000010"))
    print(ckpt.agree(mine, rank), ckpt.agree(None if rank == 0 else mine, rank), flush=True)
    dist.destroy_process_group()
""")


def test_agree_without_a_process_group_returns_its_argument() -> None:
    found = (3, Path("/x/step-00000003"))
    assert ckpt.agree(found, 0) == found
    assert ckpt.agree(None, 1) is None


def test_agree_gives_every_rank_rank_zeros_choice() -> None:
    port = free_port()
    procs = [subprocess.Popen([sys.executable, "-c", AGREE, str(r), str(port)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for r in (0, 1)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    for out, _ in outs:
        assert out.strip() == "(12, PosixPath('/ckpt/step-00000012')) None"
