"""``benchmarks/train_arms.py``: the trainer's variants interleaved in one process (arms, order, settings)."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import train_arms as m


def test_arms_parse_and_refuse_what_they_cannot_mean() -> None:
    eager, mixed = m.parse_arms("eager, compiled+chunk=536870912")
    assert eager == {"name": "eager", "compiled": False, "chunk": None}
    assert mixed == {"name": "compiled+chunk=536870912", "compiled": True, "chunk": 536870912}
    for bad, says in (("eager", "at least two"), ("eager,fast", "unknown setting 'fast'"),
                      ("eager+compiled,eager", "both eager and compiled"), ("chunk=0,eager", "positive"),
                      ("chunk=x,eager", "positive"), ("eager=1,compiled", "takes no value"),
                      ("eager,eager", "named twice")):
        with pytest.raises(ValueError, match=says):
            m.parse_arms(bad)


def test_rounds_alternate_the_order_and_summaries_cover_every_step() -> None:
    a, b = m.parse_arms("eager,compiled")
    assert [[x["name"] for x in m.round_order([a, b], r)] for r in range(3)] == [
        ["eager", "compiled"], ["compiled", "eager"], ["eager", "compiled"]]
    s = m.summarize([[2.0, 4.0], [3.0, 9.0], [1.0, 5.0]], tokens=600, flops=1e12, peak_flops=1e12)
    assert (s["rounds"], s["steps"], s["median_s"], s["min_s"], s["max_s"]) == (3, 6, 3.5, 1.0, 9.0)
    assert s["round_medians_s"] == [3.0, 6.0, 3.0]
    assert s["tokens_per_s_per_gpu"] == 600 / 3.5 and s["mfu"] == 1 / 3.5
    assert m.summarize([[1.0]], 1, 1.0, None)["mfu"] is None


def test_an_eager_turn_puts_the_compiled_forward_aside_and_a_chunk_is_restored() -> None:
    import torch

    from rlhf_runtime.roles import batches

    layers = [torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)]
    for layer in layers:
        layer.compile()  # lazy: nothing compiles until a call
    compiled = [layer._compiled_call_impl for layer in layers]
    assert all(c is not None for c in compiled)
    trainer = SimpleNamespace(decoder_layers=lambda: layers)
    eager, chunked = m.parse_arms("eager,compiled+chunk=4096")
    before = batches.LOGIT_CHUNK_ELEMENTS
    with m.arm_settings(trainer, eager):
        assert all(layer._compiled_call_impl is None for layer in layers)
        assert batches.LOGIT_CHUNK_ELEMENTS == before
        x = torch.ones(1, 2)
        assert torch.equal(layers[0](x), torch.nn.functional.linear(x, layers[0].weight, layers[0].bias))
    assert [layer._compiled_call_impl for layer in layers] == compiled
    with pytest.raises(RuntimeError, match="inside"), m.arm_settings(trainer, chunked):
        assert batches.LOGIT_CHUNK_ELEMENTS == 4096
        assert [layer._compiled_call_impl for layer in layers] == compiled
        raise RuntimeError("inside")
    assert batches.LOGIT_CHUNK_ELEMENTS == before
