"""The statistics of an interleaved comparison of rollouts (``rollout_overhead.py``): each pair of ways' overhead
from the rounds' paired log ratios with a bootstrap interval (``paired``), how each way's spread goes with the
machine (``noise``), and the comparisons of several result files pooled (``pool``). Pure standard library."""

from __future__ import annotations

import json
import math
import random
import statistics
from pathlib import Path
from typing import Any

#: What each pair of ways sizes: name -> (slower, faster) way, as 1 - slower's tokens/s / faster's.
COMPARISONS = {
    "vs_vllm_defaults": ("runtime", "bare_default"),  # the runtime against vLLM as a user builds it
    "overhead": ("runtime", "bare"),  # the runtime against its own engine settings in a plain process
    "driver_path": ("runtime", "in_actor"),
    "actor_process": ("in_actor", "bare"),
    "engine_settings": ("bare", "bare_default"),  # the runtime's engine environment against vLLM's defaults
    "compile_cache": ("bare", "bare_loaded"),
}


def bootstrap_mean(xs: list[float], n: int = 10000, seed: int = 0) -> tuple[float, float, float]:
    """Mean of ``xs`` and its 95% percentile-bootstrap interval."""
    rng = random.Random(seed)
    means = sorted(statistics.fmean(rng.choices(xs, k=len(xs))) for _ in range(n))
    return statistics.fmean(xs), means[int(0.025 * n)], means[int(0.975 * n) - 1]


def pearson(xs: list[float], ys: list[float]) -> float | None:
    if len(xs) < 3 or statistics.pstdev(xs) == 0 or statistics.pstdev(ys) == 0:
        return None
    return statistics.correlation(xs, ys)


def paired(runs: dict[str, list[dict[str, Any]]], slow: str, fast: str) -> dict[str, float]:
    """The overhead of ``slow`` over ``fast`` from the rounds' paired log ratios: the mean (as 1 - 1/exp) with
    its 95% bootstrap interval, so noise shared by a round's batches cancels and what is left is sized."""
    logs = [math.log(f["tokens_per_second"] / s["tokens_per_second"]) for s, f in zip(runs[slow], runs[fast])]
    m, lo, hi = bootstrap_mean(logs)
    return {"mean": 1 - math.exp(-m), "low": 1 - math.exp(-lo), "high": 1 - math.exp(-hi), "rounds": len(logs)}


def noise(runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """How each way's batch-to-batch spread goes with the machine: coefficient of variation of tokens/s, and the
    correlation of log tokens/s with the CPU steal share, the machine's busy CPUs and the GPU's SM clock."""
    out: dict[str, Any] = {}
    for name, xs in runs.items():
        tps = [x["tokens_per_second"] for x in xs]
        row: dict[str, Any] = {"cv": statistics.pstdev(tps) / statistics.mean(tps) if len(tps) > 1 else None}
        logs = [math.log(t) for t in tps]
        for key in ("steal_share", "busy_cpus", "clocks_sm"):
            vals = [x.get(key) for x in xs]
            if all(v is not None for v in vals):
                row[f"{key}_mean"] = statistics.fmean(vals)
                row[f"r_{key}"] = pearson(vals, logs)
        out[name] = row
    return out


def pool(paths: list[str]) -> int:
    """``--pool``: the paired comparisons of each result file and of all their rounds together."""
    def show(what: str, runs: dict[str, list[dict[str, Any]]]) -> None:
        med = {n: round(statistics.median(x["tokens_per_second"] for x in xs)) for n, xs in runs.items() if xs}
        got = {k: paired(runs, slow, fast) for k, (slow, fast) in COMPARISONS.items()
               if runs.get(slow) and runs.get(fast)}
        rows = [f"{k} {v['mean']:+.1%} ({v['low']:+.1%} .. {v['high']:+.1%})" for k, v in got.items()]
        n = min(len(xs) for xs in runs.values())
        print(f"{what}: {n} rounds, median tokens/s {med}; " + "; ".join(rows))

    pooled: dict[str, list[dict[str, Any]]] = {}
    in_every: set[str] | None = None  # the ways every file has
    for path in paths:
        runs = json.loads(Path(path).read_text())["runs"]
        n = min(len(xs) for xs in runs.values())  # a run cut mid-round: its complete rounds only
        runs = {k: xs[:n] for k, xs in runs.items()}
        show(path, runs)
        for k, xs in runs.items():
            pooled.setdefault(k, []).extend(xs)
        in_every = set(runs) if in_every is None else in_every & set(runs)
    if len(paths) > 1:
        show("pooled", {k: xs for k, xs in pooled.items() if k in (in_every or set())})
    return 0
