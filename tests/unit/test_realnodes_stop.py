"""Stopping a cluster's processes (``hack/realnodes.stop_processes``) collects the children it killed: a killed
child left unreaped is a zombie, still a member of its process group, and the stop waited its whole ``wait``
for it (20 s per cluster stop in the test tiers)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "hack"))
import realnodes


def test_stopped_child_is_collected_and_its_group_is_gone(tmp_path: Path) -> None:
    proc = subprocess.Popen(["sleep", "600"], start_new_session=True)
    (tmp_path / "sleeper.pid").write_text(str(proc.pid))
    realnodes.stop_processes(tmp_path, wait=5.0)
    assert not (tmp_path / "sleeper.pid").exists()
    with pytest.raises(ProcessLookupError):
        os.killpg(proc.pid, 0)  # a zombie would still answer
    with pytest.raises(ChildProcessError):
        os.waitpid(proc.pid, os.WNOHANG)  # already collected
