"""Checkpoint directory layout: atomic commit, newest complete step, pruning (pure)."""

from __future__ import annotations

import os
from pathlib import Path

from rlhf_runtime import checkpoint as ckpt


def _save(root: Path, step: int) -> Path:
    tmp = ckpt.tmp_dir(root, step)
    tmp.mkdir(parents=True)
    (tmp / "weights").write_text(str(step))
    return ckpt.commit(tmp, root, step)


def test_latest_is_the_highest_complete_step(tmp_path: Path) -> None:
    assert ckpt.latest(tmp_path / "missing") is None
    _save(tmp_path, 2)
    _save(tmp_path, 10)
    (tmp_path / "step-00000012").mkdir()  # no state.json: incomplete, ignored
    ckpt.tmp_dir(tmp_path, 14).mkdir()  # a save that was killed midway
    step, path = ckpt.latest(tmp_path)
    assert step == 10 and (path / "weights").read_text() == "10"
    assert not ckpt.tmp_dir(tmp_path, 10).exists()  # renamed into place


def test_prune_keeps_the_newest_and_removes_stale_temporaries(tmp_path: Path) -> None:
    for s in (2, 4, 6):
        _save(tmp_path, s)
    stale = tmp_path / f".tmp-step-00000008-{os.getpid() + 1}"
    stale.mkdir()
    ckpt.prune(tmp_path, keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000004", "step-00000006"]
