"""What the readers of ``results_rows.py`` and ``results_loop.py`` share: the row, and reading numbers, GPU kinds and
versions out of a result document."""

from __future__ import annotations

import re
import statistics
from dataclasses import dataclass, field
from typing import Any

Doc = dict[str, Any]


@dataclass(frozen=True)
class Row:
    """One table row: ``key`` the configuration, ``when`` the run's date as recorded (ISO; compared as text),
    ``values`` the figures by column, ``merge`` whether rows of one configuration and day combine (seeds)."""

    area: str
    key: tuple
    when: str
    values: dict[str, Any]
    command: str = ""
    path: str = ""
    merge: bool = False
    runs: int = 1
    extra_paths: tuple[str, ...] = field(default=())


def gpu_kind(*names: Any) -> str | None:
    """The accelerator named in the first of ``names`` that names one (``NVIDIA H200``, ``nvidia-h100-x2``), or
    ``CPU`` for a CPU device; None when none does."""
    for name in names:
        if not isinstance(name, str):
            continue
        m = re.search(r"\b(?:nvidia-)?([ABH]\d{2,3})\b", name, re.IGNORECASE)
        if m:
            return m.group(1).upper()
        if name.lower().startswith("cpu"):
            return "CPU"
    return None


def layout_gpus(spec: Any) -> int | None:
    """GPUs a job spec's layout takes: trainer replicas x GPUs each, engines x tensor parallel size; one set for
    colocated placement, both for separate."""
    if not isinstance(spec, dict) or "trainer" not in spec:
        return None
    t = spec.get("trainer") or {}
    r = spec.get("rollout") or {}
    trainer = int(t.get("replicas", 1)) * int(t.get("gpusPerReplica", 1))
    engines = int(r.get("engines", 1)) * int(r.get("tensorParallelSize", 1))
    if (spec.get("placement") or {}).get("mode", "separate").startswith("coloc"):
        return max(trainer, engines)
    return trainer + engines


def vllm_version(doc: Doc) -> str | None:
    versions = doc.get("versions") if isinstance(doc.get("versions"), dict) else {}
    v = versions.get("vllm") or doc.get("vllm")
    return v if isinstance(v, str) else None


def num(x: Any) -> float | None:
    return float(x) if isinstance(x, int | float) and not isinstance(x, bool) else None


def per_gpu(rate: Any, gpus: int | None) -> float | None:
    rate = num(rate)
    return rate / gpus if rate is not None and gpus else None


def median_of(xs: list[Any]) -> float | None:
    nums = [v for v in (num(x) for x in xs) if v is not None]
    return statistics.median(nums) if nums else None
