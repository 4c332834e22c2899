"""hack/gpu-stage.py: the parts it writes fit one device call beside the working tree (pure parts only)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def load() -> object:
    spec = importlib.util.spec_from_file_location("gpu_stage", ROOT / "hack" / "gpu-stage.py")
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_parts_fit_one_device_call_beside_the_working_tree() -> None:
    gs = load()
    assert gs.auto_part_mib(4.6) == 58  # 2026-11-25: 4.6 MiB of tree + 60 MiB parts were refused
    assert gs.auto_part_mib(0.2) == 62
    tree = gs.tree_mib()  # this checkout: tracked files and untracked ones git does not ignore
    assert 0 < tree < gs.DEVICE_CARRY_MIB
    assert gs.auto_part_mib(tree) + tree < gs.DEVICE_CARRY_MIB
    with pytest.raises(SystemExit, match="too large"):
        gs.auto_part_mib(57.5)
    # the tree as a tar archive holds it: a header and whole 512-byte blocks per file (2026-11-29: a 9.76 MiB tree
    # of 740 files was 10.31 MiB so, and parts of 54 MiB were refused beside it)
    assert (gs.tar_bytes(0), gs.tar_bytes(1), gs.tar_bytes(512), gs.tar_bytes(513)) == (512, 1024, 1024, 1536)
    assert gs.auto_part_mib(10.31) == 52
