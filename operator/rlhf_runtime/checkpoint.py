"""Checkpoint directory layout (pure; the trainer writes the contents).

``<checkpoint.path>/step-<8 digits>/`` holds ``model/`` (HF ``save_pretrained``), ``optimizer.pt`` and
``state.json`` (``{"step": N}``, written last). A checkpoint is written into ``.tmp-step-<N>-<pid>/`` and
renamed into place, so a directory named ``step-*`` is always complete: a driver killed mid-save leaves only
a temporary directory, which the next save cleans up. ``latest`` picks the highest complete step; ``prune``
keeps the newest ``keep``.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

STEP_DIR = re.compile(r"^step-(\d{8})$")
STATE = "state.json"


def step_dir(root: str | Path, step: int) -> Path:
    return Path(root) / f"step-{step:08d}"


def tmp_dir(root: str | Path, step: int) -> Path:
    return Path(root) / f".tmp-step-{step:08d}-{os.getpid()}"


def latest(root: str | Path) -> tuple[int, Path] | None:
    root = Path(root)
    if not root.is_dir():
        return None
    best: tuple[int, Path] | None = None
    for p in root.iterdir():
        m = STEP_DIR.match(p.name)
        if not m or not (p / STATE).is_file():
            continue
        step = int(m.group(1))
        if best is None or step > best[0]:
            best = (step, p)
    return best


def commit(tmp: Path, root: str | Path, step: int, extra: dict | None = None) -> Path:
    """Write ``state.json`` into ``tmp`` and rename it to its final name (atomic on one filesystem)."""
    (tmp / STATE).write_text(json.dumps({"step": step, **(extra or {})}))
    final = step_dir(root, step)
    if final.exists():
        shutil.rmtree(final)
    os.rename(tmp, final)
    return final


def prune(root: str | Path, keep: int = 2) -> None:
    root = Path(root)
    steps = sorted((int(m.group(1)), p) for p in root.iterdir() if (m := STEP_DIR.match(p.name)))
    for _, p in steps[:-keep] if keep > 0 else steps:
        shutil.rmtree(p, ignore_errors=True)
    for p in root.iterdir():
        if p.name.startswith(".tmp-step-") and not p.name.endswith(f"-{os.getpid()}"):
            shutil.rmtree(p, ignore_errors=True)
