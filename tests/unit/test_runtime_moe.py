"""Un-fusing HF fused MoE experts for vLLM: names, shapes, numerics against HF's own expert forward, round trip."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from rlhf_runtime.infra import moe


@pytest.fixture(scope="module")
def model():
    cfg = transformers.Qwen3MoeConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, moe_intermediate_size=8, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=8, num_experts=4, num_experts_per_tok=2,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(cfg).eval()


def test_names_and_shapes(model) -> None:
    named = dict(model.named_parameters())
    assert named["model.layers.0.mlp.experts.gate_up_proj"].shape == (4, 16, 16)  # (E, 2I, H)
    out = dict(moe.unfuse(named.items()))
    for layer in range(2):
        for e in range(4):
            p = f"model.layers.{layer}.mlp.experts.{e}"
            assert out[f"{p}.gate_proj.weight"].shape == (8, 16)
            assert out[f"{p}.up_proj.weight"].shape == (8, 16)
            assert out[f"{p}.down_proj.weight"].shape == (16, 8)
            assert out[f"{p}.gate_proj.weight"].is_contiguous()
        assert f"model.layers.{layer}.mlp.experts.gate_up_proj" not in out
        assert f"model.layers.{layer}.mlp.gate.weight" in out  # the router passes through
    fused = sum(1 for n, t in named.items() if moe.is_fused_expert(n, t.dim()))
    assert len(out) == len(named) - fused + 2 * 4 * 3
    # The metadata-only view agrees with the tensors.
    for name, t in named.items():
        for n, shape in moe.unfused_shapes(name, tuple(t.shape)):
            assert tuple(out[n].shape) == shape


def test_unfused_experts_compute_what_hf_computes(model) -> None:
    experts = model.model.layers[1].mlp.experts
    named = dict(moe.unfuse(model.named_parameters()))
    x = torch.randn(5, 16)
    act = experts.act_fn
    for e in range(4):
        gate, up = torch.nn.functional.linear(x, experts.gate_up_proj[e]).chunk(2, dim=-1)
        want = torch.nn.functional.linear(act(gate) * up, experts.down_proj[e])
        p = f"model.layers.1.mlp.experts.{e}"
        g = x @ named[f"{p}.gate_proj.weight"].T
        u = x @ named[f"{p}.up_proj.weight"].T
        got = (act(g) * u) @ named[f"{p}.down_proj.weight"].T
        torch.testing.assert_close(got, want)


def test_swapped_halves_would_be_caught(model) -> None:
    """The gate/up order matters: a swap changes the expert's output (the check above is not vacuous)."""
    experts = model.model.layers[0].mlp.experts
    x = torch.randn(3, 16)
    gate, up = torch.nn.functional.linear(x, experts.gate_up_proj[0]).chunk(2, dim=-1)
    assert not torch.allclose(experts.act_fn(gate) * up, experts.act_fn(up) * gate)


def test_round_trip(model) -> None:
    named = {n: t.detach() for n, t in model.named_parameters()}
    back = moe.fuse(moe.unfuse(named.items()))
    assert back.keys() == named.keys()
    for n, t in named.items():
        torch.testing.assert_close(back[n], t)


def test_incomplete_experts_are_refused() -> None:
    with pytest.raises(ValueError, match="incomplete experts"):
        moe.fuse([("l.experts.0.gate_proj.weight", torch.zeros(2, 2)), ("l.experts.0.down_proj.weight", torch.zeros(2, 2))])
