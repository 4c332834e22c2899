"""``benchmarks/gpu_sync.py`` refuses options that would be silently ignored together."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_sync.py"


def test_revalidate_without_variants_is_refused() -> None:
    out = subprocess.run([sys.executable, str(BENCH), "--revalidate", "--no-variants", "cpu-gloo:tiny"],
                         capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == 2, (out.stdout, out.stderr)
    assert "--revalidate needs the variants" in out.stderr, out.stderr


def _gpu_sync():  # type: ignore[no-untyped-def]
    sys.path.insert(0, str(BENCH.parent))
    import gpu_sync

    return gpu_sync


def test_dp_scaling_interleaves_engine_counts_and_summarises_per_count() -> None:
    _gpu_sync()
    import sync_rollout as g
    assert g.scaling_order(3, 2) == [1, 2, 3, 3, 2, 1]
    assert g.scaling_order(2, 3) == [1, 2, 2, 1, 1, 2]
    records = [{"engines": k, "tokens_per_second": v} for k, v in
               [(1, 100.0), (2, 190.0), (1, 110.0), (2, 170.0), (1, 90.0), (2, 200.0)]]
    one, two = g.scaling_summary(records)
    assert (one["rounds"], one["tokens_per_second"], one["x_linear"]) == (3, 100.0, 1.0)
    assert (two["min"], two["max"], two["tokens_per_second"]) == (170.0, 200.0, 190.0)
    assert abs(two["x_linear"] - 0.95) < 1e-12
    # weak scaling: every engine decodes as many prompts at every count; strong: the one batch is split
    assert [g.scaling_prompts(k, 128, 64) for k in (1, 2, 3)] == [128, 256, 384]
    assert [g.scaling_prompts(k, 0, 64) for k in (1, 2, 3)] == [64, 64, 64]


def test_floor_counts_a_tied_head_once_and_shares_flag_other_bytes() -> None:
    import torch

    g = _gpu_sync()
    emb, head = torch.nn.Embedding(10, 4), torch.nn.Linear(4, 10, bias=False)
    head.weight = emb.weight  # tied, as Qwen3-1.7B's lm_head: the kernel format never sends it
    model = torch.nn.ModuleDict({"embed": emb, "head": head, "norm": torch.nn.LayerNorm(4)})
    assert g.sent_bytes(model) == (40 + 4 + 4) * 2
    result = {"floor": {"bytes": 96, "copy_gbps": 200.0},
              "summary": {"default": {"bytes": 96, "gbps": 50.0}, "broken": {"error": "x"}},
              "summary_interleaved": {"default": {"bytes": 96, "gbps": 60.0},
                                      "checkpoint": {"bytes": 176, "gbps": 100.0}}}
    shares = g.floor_shares(result)
    assert shares["summary"] == {"default": {"share": 0.25, "bytes": 96, "floor_bytes": 96, "same_bytes": True}}
    assert shares["summary_interleaved"]["default"]["share"] == 0.3
    assert shares["summary_interleaved"]["checkpoint"]["same_bytes"] is False
    assert g.floor_shares({"summary": {"default": {"bytes": 1, "gbps": 1.0}}}) == {}  # no floor measured
