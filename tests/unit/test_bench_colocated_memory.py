"""``benchmarks/colocated_memory.py``: the decode's read floor beside each run, and its variant flags."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import colocated_memory as m

QWEN3_17B = {"model_type": "qwen3", "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 6144,
             "num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128,
             "tie_word_embeddings": True}


def test_the_decode_floor_reads_every_live_context_once_a_step_and_the_weights_once_a_step_per_wave() -> None:
    plan = {"batch_sequences": 128, "sequences_at_once": 128}
    f = m.decode_read_floor(QWEN3_17B, plan, prompt_tokens=100, max_tokens=4096, fp8_kv=False,
                            read_write_bytes_per_s=1e12)
    per_token = 2 * 28 * 8 * 128 * 2  # keys and values of every layer, bfloat16
    assert f["kv_read_bytes"] == 128 * sum(100 + t for t in range(4096)) * per_token
    assert f["waves"] == 1 and f["weight_read_bytes"] == 4096 * 2 * 1_720_574_976  # Qwen3-1.7B's parameters
    assert f["seconds"] == pytest.approx((f["kv_read_bytes"] + f["weight_read_bytes"]) / 1e12, abs=0.01)
    fp8 = m.decode_read_floor(QWEN3_17B, plan, 100, 4096, True, 1e12)
    assert fp8["kv_read_bytes"] * 2 == f["kv_read_bytes"] and fp8["weight_read_bytes"] == f["weight_read_bytes"]
    halves = m.decode_read_floor(QWEN3_17B, {"batch_sequences": 128, "sequences_at_once": 85}, 100, 4096, False, 1e12)
    assert halves["waves"] == 2 and halves["weight_read_bytes"] == 2 * f["weight_read_bytes"]


def test_a_variant_with_an_unknown_flag_is_refused_with_the_flags_it_knows(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="unknown flags \\['fp4'\\].*compile, fp8kv, graphs, nockpt"):
        m.run(SimpleNamespace(), tmp_path, tmp_path, "x:0.5:never:1024:3:graphs,fp4")
    spec = m.job(tmp_path, "x", 0.5, "never", 1024, 3, 16, True, frozenset({"fp8kv"}))
    assert spec["rollout"]["kvCacheDtype"] == "fp8"
    assert m.job(tmp_path, "x", 0.5, "never", 1024, 3, 16, True)["rollout"]["kvCacheDtype"] == "auto"
    plain = m.job(tmp_path, "x", 0.5, "never", 1024, 3, 16, True)["trainer"]
    nockpt = m.job(tmp_path, "x", 0.5, "never", 1024, 3, 16, True, frozenset({"nockpt"}))["trainer"]
    assert (plain["gradientCheckpointing"], plain["maxTokensPerMicroBatch"]) == (True, 32768)
    assert (nockpt["gradientCheckpointing"], nockpt["maxTokensPerMicroBatch"]) == (False, 16384)
