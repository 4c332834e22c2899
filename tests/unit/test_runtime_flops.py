"""The trainer's FLOPs and peaks (``infra.flops``), by hand."""

from __future__ import annotations

from types import SimpleNamespace

from rlhf_runtime.infra.flops import peak_flops, train_flops


def test_train_flops_count_the_body_the_scored_head_and_causal_attention() -> None:
    cfg = SimpleNamespace(vocab_size=100, hidden_size=16, num_attention_heads=4, head_dim=8, num_hidden_layers=3,
                          tie_word_embeddings=True)
    params = 100 * 16 + 5000  # the tied embedding (the output layer) and the body
    # two sequences of 10 and 20 tokens, 12 of them scored
    got = train_flops(cfg, params, tokens=30, scored=12, square_sum=10 * 10 + 20 * 20)
    assert got == 6 * 5000 * 30 + 6 * 1600 * 12 + 6 * 3 * 4 * 8 * 500
    untied = SimpleNamespace(**{**vars(cfg), "tie_word_embeddings": False})  # the input embedding is a lookup
    assert train_flops(untied, params + 1600, 30, 12, 500) == got


def test_peaks_by_device_name() -> None:
    assert peak_flops("NVIDIA H100 80GB HBM3") == 989e12
    assert peak_flops("NVIDIA H100 PCIe") == 756e12
    assert peak_flops("NVIDIA H200") == 989e12
    assert peak_flops("NVIDIA A100-SXM4-80GB") == 312e12
    assert peak_flops("Some Other GPU") is None
