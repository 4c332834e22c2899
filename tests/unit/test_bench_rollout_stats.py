"""The rollout-overhead benchmark's statistics (``benchmarks/rollout_overhead.py``): the paired overhead and its
bootstrap interval, the noise attribution, the host's CPU counters. Its GPU results rest on these."""

from __future__ import annotations

import math
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import rollout_overhead as ro


def _runs(overhead: float, rounds: int = 60, spread: float = 0.15, seed: int = 1) -> dict[str, list[dict]]:
    """Rounds whose batches share the round's speed (drift) and each its own noise; ``runtime`` is slower than
    ``bare`` by ``overhead`` on average, ``in_actor`` halfway."""
    rng = random.Random(seed)
    runs: dict[str, list[dict]] = {"runtime": [], "in_actor": [], "bare": []}
    for r in range(rounds):
        base = 40000 * math.exp(rng.gauss(0, spread))
        for name, slow in (("runtime", overhead), ("in_actor", overhead / 2), ("bare", 0.0)):
            steal = rng.random() * 0.01
            tps = base * (1 - slow) * math.exp(rng.gauss(0, 0.02) - 10 * steal)
            runs[name].append({"tokens_per_second": tps, "steal_share": steal, "round": r})
    return runs


def test_paired_recovers_a_known_overhead_through_shared_drift():
    p = ro.paired(_runs(0.10), "runtime", "bare")
    assert p["rounds"] == 60
    assert p["low"] < p["mean"] < p["high"]
    assert abs(p["mean"] - 0.10) < 0.02  # the round's drift (15%) cancels in the pairs
    assert p["low"] < 0.10 < p["high"] and p["high"] - p["low"] < 0.05
    none = ro.paired(_runs(0.0), "runtime", "bare")
    assert abs(none["mean"]) < 0.02
    half = ro.paired(_runs(0.10), "in_actor", "bare")
    assert abs(half["mean"] - 0.05) < 0.02


def test_bootstrap_interval_narrows_with_more_rounds():
    few = ro.paired(_runs(0.05, rounds=10), "runtime", "bare")
    many = ro.paired(_runs(0.05, rounds=200), "runtime", "bare")
    assert many["high"] - many["low"] < few["high"] - few["low"]


def test_noise_correlates_tokens_per_second_with_steal():
    n = ro.noise(_runs(0.0, rounds=80, spread=0.0))
    for name in ("runtime", "in_actor", "bare"):
        assert n[name]["r_steal_share"] < -0.5  # batches with more steal were slower, as built
        assert 0 < n[name]["cv"] < 0.1
        assert "r_clocks_sm" not in n[name]  # no GPU samples: nothing claimed about the clock


def test_host_cpu_counts_forward():
    a = ro.host_cpu()
    if not a:  # no /proc/stat on this system
        return
    deadline = time.monotonic() + 10  # /proc/stat moves in clock ticks: burn CPU until one lands
    b = ro.host_cpu()
    while b["busy"] <= a["busy"] and time.monotonic() < deadline:
        sum(i * i for i in range(200000))
        b = ro.host_cpu()
    assert b["busy"] > a["busy"] and b["steal"] >= a["steal"]
