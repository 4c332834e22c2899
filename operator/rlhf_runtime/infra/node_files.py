"""Directories copied from one Ray node to another through Ray's object store: pods share no filesystem.

The validation mode (``controller.validation.Validator``) needs the trainer's weights as files on the node of every
validation engine, which in a KubeRay cluster is another pod than the trainer's. The trainer's rank 0 stages
them in a temporary directory on its own node (``Trainer.stage_weights``) and hands out one file at a time
(``Trainer.read_staged``, an object reference); ``copy_to`` writes them into a fresh temporary directory on the
node of a placement-group bundle, one file at a time (memory: one file), and ``remove`` deletes it there.
Every step runs as a Ray task on the target bundle's node with ``num_cpus=0``; file contents never pass
through the driver (it holds object references only). Where the target is the staging node itself (``node_of``:
engines in the trainer's pod, or a one-node run) the validator uses the staged directory as it is.

Guarantees: a copy that fails half-way is removed by ``copy_to`` itself; finished copies are removed by the
caller with ``remove`` (in a ``finally``). Directories are named ``rlhf-validate-*`` in the node's temporary
directory (``$TMPDIR``, else ``/tmp``), on the container's own filesystem: they also go when the pod goes.

Import only where Ray runs (the module imports nothing heavy at import time; Ray inside the functions).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

PREFIX = "rlhf-validate-"


def make_temp_dir(prefix: str = PREFIX) -> str:
    """(Ray task) A fresh directory in this node's temporary directory."""
    return tempfile.mkdtemp(prefix=prefix)


def list_files(root: str | os.PathLike[str]) -> list[str]:
    """Relative paths (``/``-separated) of the regular files under ``root``, sorted."""
    base = Path(root)
    return sorted(p.relative_to(base).as_posix() for p in base.rglob("*") if p.is_file())


def write_file(root: str, name: str, data: bytes) -> int:
    """(Ray task) Write ``data`` to ``root/name``; ``name`` must stay inside ``root``. Returns the size."""
    base = Path(root).resolve()
    target = (base / name).resolve()
    if base not in target.parents:
        raise ValueError(f"{name!r} is not a relative path inside {root}")
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_bytes(data)
    return len(data)


def remove_dir(root: str) -> bool:
    """(Ray task) Remove ``root`` and everything under it; False if it did not exist."""
    existed = os.path.isdir(root)
    shutil.rmtree(root, ignore_errors=True)
    return existed


def _on(strategy: Any, fn: Callable[..., Any]) -> Any:
    import ray

    return ray.remote(fn).options(num_cpus=0, scheduling_strategy=strategy)


def node_id() -> str:
    """(Ray task) The Ray node this runs on."""
    import ray

    return str(ray.get_runtime_context().get_node_id())


def node_of(strategy: Any, timeout: float | None = None) -> str:
    """The Ray node ``strategy`` (a placement-group bundle's scheduling strategy) schedules to: where a copy
    would land. A directory already on that node needs no copy."""
    import ray

    return str(ray.get(_on(strategy, node_id).remote(), timeout=timeout))


def copy_to(strategy: Any, names: Iterable[str], read: Callable[[str], Any], timeout: float | None = None) -> str:
    """Write the files ``names`` into a fresh temporary directory on the node ``strategy`` schedules to (a Ray
    scheduling strategy, e.g. a placement-group bundle); ``read(name)`` gives an object reference (or the
    bytes) of a file. Returns the directory's path on that node; removed again if any file fails. ``timeout``
    bounds each task (seconds; Ray's ``GetTimeoutError`` past it)."""
    import ray

    root = ray.get(_on(strategy, make_temp_dir).remote(), timeout=timeout)
    try:
        for name in names:
            ray.get(_on(strategy, write_file).remote(root, name, read(name)), timeout=timeout)
    except BaseException:
        remove(strategy, root, timeout)
        raise
    return root


def remove(strategy: Any, root: str, timeout: float | None = None) -> bool:
    """Remove the directory ``root`` on the node ``strategy`` schedules to; False if it was already gone."""
    import ray

    return bool(ray.get(_on(strategy, remove_dir).remote(root), timeout=timeout))
