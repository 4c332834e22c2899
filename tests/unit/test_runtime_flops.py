"""The trainer's FLOPs and peaks (``infra.flops``), by hand."""

from __future__ import annotations

from types import SimpleNamespace

from rlhf_runtime.infra.flops import (
    active_params,
    model_active_params,
    peak_flops,
    routed_fraction,
    train_flops,
)


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


def test_a_mixture_of_experts_counts_the_experts_a_token_is_routed_to() -> None:
    """MFU of a mixture of experts divides by the FLOPs of the parameters a token passes through: its top-k of E
    routed experts, every other parameter whole. On a real (tiny) Qwen3-MoE from transformers, whose experts are
    fused tensors, and on per-expert and shared-expert names."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = Qwen3MoeConfig(vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                         num_experts=8, num_experts_per_tok=2, tie_word_embeddings=False)
    model = Qwen3MoeForCausalLM(cfg)
    named = [(n, p.numel()) for n, p in model.named_parameters()]
    total = sum(n for _, n in named)
    experts = 2 * 8 * (2 * 16 * 32 + 32 * 16)  # layers x experts x (gate and up, down)
    assert active_params(named, cfg) == model_active_params(model, cfg) == total - experts + experts * 2 // 8
    assert routed_fraction(cfg) == 0.25
    # Qwen3-30B-A3B's published shapes: 48 layers of 128 experts (768 x 2048, top-8) in 30,532,122,624 parameters
    big = SimpleNamespace(num_experts=128, num_experts_per_tok=8)
    routed = 48 * 128 * 3 * 768 * 2048
    assert active_params([("model.layers.mlp.experts.gate_up_proj", routed), ("rest", 30_532_122_624 - routed)],
                         big) == 3_353_032_704
    # per-expert names (older layouts) count alike; shared experts and the router are dense
    mixtral = SimpleNamespace(num_local_experts=4, num_experts_per_tok=2)
    assert active_params([("m.block_sparse_moe.experts.3.w1.weight", 400), ("m.mlp.shared_expert.up_proj.weight", 10),
                          ("m.block_sparse_moe.gate.weight", 4)], mixtral) == 200 + 10 + 4
    assert active_params([("m.q_proj.lora_A.default.weight", 8), ("m.q_proj.base_layer.weight", 16)], mixtral) == 16
    dense = SimpleNamespace(vocab_size=64)
    assert active_params(named, dense) == total and routed_fraction(dense) == 1.0
