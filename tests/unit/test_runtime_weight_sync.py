"""Weight-sync sender parts that run without a GPU: the sender defaults and the weight format, the kernel-format
plans (dense, tensor-parallel, MoE experts) and what an engine worker reports for them. The transports and the
fresh-engine validation of the whole path run on the lent GPUs (``benchmarks/gpu_sync.py``)."""

from __future__ import annotations

import re
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("vllm")

from rlhf_runtime.infra import moe


def test_effective_format_follows_the_request_and_the_plan() -> None:
    """``auto`` takes the kernel format wherever the plan covers the engines (a TP=2 engine over one NCCL broadcast
    too), else the checkpoint format; ``kernel`` without a usable plan is refused with the plan's reason."""
    from rlhf_runtime.weight_sync import KernelPlan, effective_format

    ok = KernelPlan([("w", [2], ["w"])], True, "1 engine parameter")
    no = KernelPlan([], False, "kernel format needs tensor_parallel_size 1")
    hf = _hf()
    broadcast = KernelPlan.build(_Source(hf), _engine(hf, 2))
    assert broadcast.ok and broadcast.all_ranks
    assert effective_format("auto", ok) == effective_format("auto", broadcast) == "kernel"
    assert effective_format("auto", no) == "checkpoint"
    assert effective_format("auto", None) == "checkpoint"
    assert effective_format("kernel", ok) == "kernel"
    assert effective_format("checkpoint", ok) == "checkpoint"
    with pytest.raises(ValueError, match=r"weightSync.format kernel cannot be used here \(kernel format needs "
                                         r"tensor_parallel_size 1\)"):
        effective_format("kernel", no)


def test_the_package_names_load_their_modules_on_first_use() -> None:
    """``rlhf_runtime.weight_sync`` names its public parts; the driver imports ``options`` from it without torch."""
    import subprocess
    import sys

    import rlhf_runtime.weight_sync as ws

    for name in ws.__all__:
        assert getattr(ws, name) is not None, name
    code = ("import sys; from rlhf_runtime.weight_sync.options import resolve; "
            "from rlhf_runtime.controller import sync; print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False", out.stderr


# ------------------------------------------------------------------------------------------ kernel plans
class _Source:
    """The trainer side of a plan: HF names and tensors in stream order (``ParamSource``'s two methods)."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.tensors = tensors

    def wire_shapes(self) -> list[tuple[str, tuple[int, ...]]]:
        return [(n, tuple(t.shape)) for n, t in self.tensors.items()]

    def __iter__(self):
        return iter(self.tensors.items())


def _hf(heads: int = 4, kv_heads: int = 2, head_dim: int = 2, hidden: int = 8, inter: int = 12,
        vocab: int = 16) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=g)
    a = "model.layers.0.self_attn."
    m = "model.layers.0.mlp."
    return {"model.embed_tokens.weight": r(vocab, hidden),
            a + "q_proj.weight": r(heads * head_dim, hidden), a + "q_proj.bias": r(heads * head_dim),
            a + "k_proj.weight": r(kv_heads * head_dim, hidden), a + "k_proj.bias": r(kv_heads * head_dim),
            a + "v_proj.weight": r(kv_heads * head_dim, hidden), a + "v_proj.bias": r(kv_heads * head_dim),
            a + "o_proj.weight": r(hidden, heads * head_dim),
            m + "gate_proj.weight": r(inter, hidden), m + "up_proj.weight": r(inter, hidden),
            m + "down_proj.weight": r(hidden, inter),
            "model.norm.weight": r(hidden), "lm_head.weight": r(vocab, hidden)}


MAPPING = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}


def _engine(hf: dict[str, torch.Tensor], tp: int) -> dict[str, Any]:
    """vLLM's per-rank layout of a Qwen2 layer under TP ``tp``: fused qkv / gate_up (column-parallel, split along
    dim 0 per part), o / down (row-parallel, dim 1), vocabulary-parallel embedding and head (dim 0), replicated
    norm."""
    a, m = "model.layers.0.self_attn.", "model.layers.0.mlp."
    rows = lambda *names: sum(hf[n].shape[0] for n in names) // tp
    hidden = hf["model.norm.weight"].shape[0]
    params = [("model.embed_tokens.weight", [hf["model.embed_tokens.weight"].shape[0] // tp, hidden]),
              (a + "qkv_proj.weight", [rows(a + "q_proj.weight", a + "k_proj.weight", a + "v_proj.weight"), hidden]),
              (a + "qkv_proj.bias", [rows(a + "q_proj.bias", a + "k_proj.bias", a + "v_proj.bias")]),
              (a + "o_proj.weight", [hidden, hf[a + "o_proj.weight"].shape[1] // tp]),
              (m + "gate_up_proj.weight", [rows(m + "gate_proj.weight", m + "up_proj.weight"), hidden]),
              (m + "down_proj.weight", [hidden, hf[m + "down_proj.weight"].shape[1] // tp]),
              ("model.norm.weight", [hidden]), ("lm_head.weight", [hf["lm_head.weight"].shape[0] // tp, hidden])]
    # as vLLM reports them: every linear weight has output_dim 0 and input_dim 1, row-parallel ones too
    dims = {n: [0, 1] for n, _ in params if "norm" not in n}
    return {"params": params, "packed_modules_mapping": MAPPING, "world_size": tp, "shard_dims": dims}


def test_kernel_plan_tp1_fuses_parts_side_by_side() -> None:
    from rlhf_runtime.weight_sync import KernelPlan

    hf = _hf()
    plan = KernelPlan.build(_Source(hf), _engine(hf, 1))
    assert plan.ok and plan.shard == {}, plan.reason
    got = dict(plan.iterate(_Source(hf)))
    a = "model.layers.0.self_attn."
    assert torch.equal(got[a + "qkv_proj.weight"], torch.cat([hf[a + p + ".weight"] for p in ("q_proj", "k_proj", "v_proj")]))
    assert torch.equal(got["model.layers.0.mlp.down_proj.weight"], hf["model.layers.0.mlp.down_proj.weight"])
    names, _, shapes = plan.metadata(torch.float32)
    assert sorted(names) == sorted(n for n, _ in _engine(hf, 1)["params"])
    assert all(list(got[n].shape) == s for n, s in zip(names, shapes))


def test_kernel_plan_tp2_sends_each_rank_its_workers_shard() -> None:
    """Rank r's tensors are what vLLM's loaders put in TP rank r's parameters: each part's r-th piece (q, k, v
    by heads; gate, up by rows) side by side, row-parallel weights by columns, vocabulary rows by halves, the
    norm whole; and the pieces of all ranks put back together are the trainer's tensors."""
    from rlhf_runtime.weight_sync import KernelPlan

    hf = _hf()
    engine = _engine(hf, 2)
    a, m = "model.layers.0.self_attn.", "model.layers.0.mlp."
    ranks = []
    for rank in range(2):
        plan = KernelPlan.build(_Source(hf), engine, tp_rank=rank)
        assert plan.ok, plan.reason
        got = dict(plan.iterate(_Source(hf)))
        assert {n: list(t.shape) for n, t in got.items()} == dict(engine["params"])
        piece = lambda n, d=0: hf[n].chunk(2, dim=d)[rank]  # noqa: B023
        assert torch.equal(got[a + "qkv_proj.weight"], torch.cat([piece(a + p + ".weight") for p in ("q_proj", "k_proj", "v_proj")]))
        assert torch.equal(got[a + "qkv_proj.bias"], torch.cat([piece(a + p + ".bias") for p in ("q_proj", "k_proj", "v_proj")]))
        assert torch.equal(got[m + "gate_up_proj.weight"], torch.cat([piece(m + "gate_proj.weight"), piece(m + "up_proj.weight")]))
        assert torch.equal(got[a + "o_proj.weight"], piece(a + "o_proj.weight", 1)) and got[a + "o_proj.weight"].is_contiguous()
        assert torch.equal(got["model.norm.weight"], hf["model.norm.weight"])
        parts = dict(plan.iterate(_Source(hf), fuse=False))
        assert [list(p.shape) for p in parts[m + "gate_up_proj.weight"]] == [[6, 8], [6, 8]]  # packed side by side
        ranks.append(got)
    assert torch.equal(torch.cat([r[m + "down_proj.weight"] for r in ranks], dim=1), hf[m + "down_proj.weight"])
    assert torch.equal(torch.cat([r["lm_head.weight"] for r in ranks]), hf["lm_head.weight"])


def test_kernel_plan_takes_presliced_row_pieces_as_they_come() -> None:
    """The HF tensors split along rows only (column- and vocabulary-parallel) can arrive as this rank's piece
    already (an FSDP2 shard, ``ParamSource.local``): the plan does not split them again, and its tensors are
    the ones it makes from whole tensors."""
    from rlhf_runtime.weight_sync import KernelPlan

    hf = _hf()
    a, m = "model.layers.0.self_attn.", "model.layers.0.mlp."
    for rank in range(2):
        plan = KernelPlan.build(_Source(hf), _engine(hf, 2), tp_rank=rank)
        rows = plan.row_split_sources()
        assert rows == {a + f"{p}.{w}" for p in ("q_proj", "k_proj", "v_proj") for w in ("weight", "bias")} | {
            m + "gate_proj.weight", m + "up_proj.weight", "model.embed_tokens.weight", "lm_head.weight"}
        whole = dict(plan.iterate(_Source(hf)))
        pieces = _Source({n: t.chunk(2, dim=0)[rank] if n in rows else t for n, t in hf.items()})
        pieces.local = rows  # as ParamSource.local: these come as this rank's piece
        got = dict(plan.iterate(pieces))
        assert got.keys() == whole.keys() and all(torch.equal(got[n], whole[n]) for n in whole)


def test_kernel_plan_for_a_broadcast_sends_every_ranks_pieces_side_by_side() -> None:
    """Without a ``tp_rank`` (one NCCL broadcast to every worker of a TP=2 engine) each split parameter is sent
    at twice a worker's size, and its rank-r half is exactly what the plan for rank r sends: fused parts
    reordered rank-major (rank 0's q, k, v pieces, then rank 1's), one-part tensors unchanged. Nothing is sent
    as an FSDP2 shard."""
    from rlhf_runtime.weight_sync import KernelPlan

    hf = _hf()
    engine = _engine(hf, 2)
    plan = KernelPlan.build(_Source(hf), engine)
    assert plan.ok and plan.all_ranks and "the pieces of all 2 ranks side by side" in plan.reason, plan.reason
    assert plan.row_split_sources() == set()
    got = dict(plan.iterate(_Source(hf)))
    names, _, shapes = plan.metadata(torch.float32)
    assert {n: list(got[n].shape) for n in names} == dict(zip(names, shapes))
    for rank in range(2):
        mine = dict(KernelPlan.build(_Source(hf), engine, tp_rank=rank).iterate(_Source(hf)))
        for name, dim in plan.shard.items():
            assert torch.equal(got[name].chunk(2, dim=dim)[rank], mine[name]), (name, rank)
        assert torch.equal(got["model.norm.weight"], mine["model.norm.weight"])
    a, m = "model.layers.0.self_attn.", "model.layers.0.mlp."
    assert got[a + "o_proj.weight"] is hf[a + "o_proj.weight"]  # one part: the trainer's tensor, no copy
    assert not torch.equal(got[a + "qkv_proj.weight"], torch.cat([hf[a + p + ".weight"] for p in ("q_proj", "k_proj", "v_proj")]))
    parts = dict(plan.iterate(_Source(hf), fuse=False))[m + "gate_up_proj.weight"]
    assert parts.shape == [24, 8] and torch.equal(torch.cat(list(parts)), got[m + "gate_up_proj.weight"])


@pytest.mark.parametrize(("tp", "rank", "change", "reason"), [
    (2, None, {"kv_heads": 1}, r"qkv_proj.weight \[8, 8\] \(each rank of 2, split along 0 or 1\)"),
    # KV heads that do not split: vLLM replicates KV heads when there are fewer than TP
    (2, 0, {"kv_heads": 1}, r"no HF source for engine parameter model.layers.0.self_attn.qkv_proj.weight"),
    # a padded vocabulary (vLLM pads the embedding per rank): the engine's rows are not half the trainer's
    (2, 0, {"pad_vocab": 2}, r"no HF source for engine parameter model.embed_tokens.weight \[9, 8\] \(rank 0 of 2"),
])
def test_kernel_plan_refuses_layouts_it_cannot_split(tp, rank, change, reason) -> None:
    from rlhf_runtime.weight_sync import KernelPlan

    hf = _hf(kv_heads=(change or {}).get("kv_heads", 2))
    engine = _engine(hf, tp)
    if change and "kv_heads" in change:  # vLLM: each rank holds the one KV head: q half + k + v
        a = "model.layers.0.self_attn."
        engine["params"][1] = (a + "qkv_proj.weight", [4 + 2 + 2, 8])
    if change and "pad_vocab" in change:
        engine["params"][0] = ("model.embed_tokens.weight", [(16 + change["pad_vocab"]) // 2, 8])
    plan = KernelPlan.build(_Source(hf), engine, tp_rank=rank)
    assert not plan.ok
    assert re.search(reason, plan.reason), plan.reason


def test_a_trainer_rank_without_engine_layouts_plans_no_kernel_format() -> None:
    """Only trainer rank 0 holds the engine handles; without a process group to receive their layouts from
    (a lone rank), the plan says so instead of failing on an empty list."""
    from rlhf_runtime.weight_sync import EngineFanOut
    from rlhf_runtime.weight_sync.senders import kernel_plan

    plan = kernel_plan(_Source(_hf()), EngineFanOut([], []), "ipc")
    assert not plan.ok and plan.reason == "no engine layout reached this trainer rank"


# ------------------------------------------------------------------------------------ MoE experts (EP)
EXPERTS = "model.layers.0.mlp.experts"
W13, W2 = f"{EXPERTS}.routed_experts.w13_weight", f"{EXPERTS}.routed_experts.w2_weight"


def _moe_hf(n: int = 4, inter: int = 3, hidden: int = 4) -> dict[str, torch.Tensor]:
    """A MoE layer as the trainer's stream yields it (``moe.unfuse``: per expert gate, up; then down)."""
    g = torch.Generator().manual_seed(1)
    fused = {f"{EXPERTS}.gate_up_proj": torch.randn(n, 2 * inter, hidden, generator=g),
             f"{EXPERTS}.down_proj": torch.randn(n, hidden, inter, generator=g)}
    return {"model.layers.0.mlp.gate.weight": torch.randn(n, hidden, generator=g), **dict(moe.unfuse(fused.items()))}


def _moe_engine(ids: list[int], order: list[str], inter: int = 3, hidden: int = 4) -> dict[str, Any]:
    """vLLM's layout of that layer on an engine holding experts ``ids`` (its ``RoutedExperts`` parameters)."""
    return {"params": [("model.layers.0.mlp.gate.weight", [4, hidden]), (W13, [len(ids), 2 * inter, hidden]),
                       (W2, [len(ids), hidden, inter])],
            "packed_modules_mapping": {}, "world_size": 1, "shard_dims": {},
            "experts": {W13: {"ids": ids, "parts": order}, W2: {"ids": ids, "parts": ["down_proj"]}}}


@pytest.mark.parametrize("order", [["gate_proj", "up_proj"], ["up_proj", "gate_proj"]])
def test_kernel_plan_sends_an_expert_parallel_engine_only_its_experts_stacked(order: list[str]) -> None:
    """EP rank 1 of 2 holds global experts 2 and 3: its w13 is, per local expert, the two projections in the
    backend's order, its w2 the down projections, each stacked in local order; nothing of experts 0 and 1."""
    from rlhf_runtime.weight_sync import KernelPlan

    hf = _moe_hf()
    plan = KernelPlan.build(_Source(hf), _moe_engine([2, 3], order))
    assert plan.ok, plan.reason
    got = dict(plan.iterate(_Source(hf)))
    e = lambda i, p: hf[f"{EXPERTS}.{i}.{p}.weight"]
    assert torch.equal(got[W13], torch.stack([torch.cat([e(i, order[0]), e(i, order[1])]) for i in (2, 3)]))
    assert torch.equal(got[W2], torch.stack([e(i, "down_proj") for i in (2, 3)]))
    parts = dict(plan.iterate(_Source(hf), fuse=False))
    assert parts[W13].shape == [2, 6, 4] and len(parts[W13]) == 4  # the producers' shape; 4 parts side by side
    assert torch.equal(torch.cat([p.reshape(-1) for p in parts[W13]]), got[W13].reshape(-1))
    used = {s for _, _, srcs in plan.entries for s in srcs}
    assert not any(f"{EXPERTS}.{i}." in s for s in used for i in (0, 1))


def test_kernel_plan_does_not_keep_other_engines_experts_alive() -> None:
    """The stream yields every expert (FSDP gathers all of them on every rank); the ones another engine holds
    are dropped as they pass instead of being held until the end (a whole model of them on a large MoE)."""
    import gc
    import weakref

    from rlhf_runtime.weight_sync import KernelPlan

    hf = _moe_hf()
    refs: dict[str, Any] = {}

    class Fresh(_Source):
        def __iter__(self):  # tensors the source does not hold on to, as FSDP's gathered copies
            for n, t in self.tensors.items():
                c = t.clone()
                refs[n] = weakref.ref(c)
                yield n, c

    plan = KernelPlan.build(_Source(hf), _moe_engine([2, 3], ["gate_proj", "up_proj"]))
    it = plan.iterate(Fresh(hf))
    name, _ = next(it)
    while name != W13:
        name, _ = next(it)
    gc.collect()
    assert refs[f"{EXPERTS}.0.gate_proj.weight"]() is None and refs[f"{EXPERTS}.1.up_proj.weight"]() is None


@pytest.mark.parametrize(("layout", "reason"), [
    ({"refuse": "the MoE backend FlashInfer TRTLLM keeps its own layout"}, r"w13_weight \[2, 6, 4\]: the MoE backend FlashInfer TRTLLM"),
    ({"ids": [2, 9], "parts": ["gate_proj", "up_proj"]}, r"no HF source model.layers.0.mlp.experts.9.gate_proj.weight"),
    ({"ids": [2, 3], "parts": ["gate_proj"]}, r"do not stack to it"),
])
def test_kernel_plan_refuses_experts_it_cannot_fill(layout: dict[str, Any], reason: str) -> None:
    from rlhf_runtime.weight_sync import KernelPlan

    engine = _moe_engine([2, 3], ["gate_proj", "up_proj"])
    engine["experts"][W13] = layout
    plan = KernelPlan.build(_Source(_moe_hf()), engine)
    assert not plan.ok and re.search(reason, plan.reason), plan.reason


class _RoutedExperts(torch.nn.Module):
    """The attributes of vLLM's ``RoutedExperts`` that ``workers.expert_layout`` reads (as of 0.33): its two
    stacked parameters, ``expert_map`` (global -> local id, -1 elsewhere; None without EP) and the unquantized
    method's backend enum."""

    def __init__(self, emap: list[int] | None, backend: str, local: int = 2) -> None:
        super().__init__()
        from types import SimpleNamespace

        self.w13_weight = torch.nn.Parameter(torch.zeros(local, 6, 4), requires_grad=False)
        self.w2_weight = torch.nn.Parameter(torch.zeros(local, 4, 3), requires_grad=False)
        self.expert_map = None if emap is None else torch.tensor(emap)
        self.quant_method = SimpleNamespace(unquantized_backend=SimpleNamespace(value=backend))


@pytest.mark.parametrize(("emap", "backend", "w13"), [
    ([-1, -1, 0, 1], "TRITON", {"ids": [2, 3], "parts": ["gate_proj", "up_proj"]}),
    ([1, -1, -1, 0], "FlashInfer CUTLASS", {"ids": [3, 0], "parts": ["up_proj", "gate_proj"]}),  # local order
    (None, "TRITON", {"ids": [0, 1], "parts": ["gate_proj", "up_proj"]}),  # no EP: all experts
    ([-1, -1, 0, 1], "FlashInfer TRTLLM", {"refuse": "the MoE backend FlashInfer TRTLLM keeps its own layout"}),
    ([0, 0, 1, -1], "TRITON", {"refuse": "the expert map names 3 local experts for 2 (redundant experts, EPLB)"}),
])
def test_engine_reports_its_local_experts_and_their_layout(emap, backend, w13) -> None:
    from types import SimpleNamespace

    from rlhf_runtime.rollout.workers import worker_param_layout

    model = torch.nn.Module()
    model.experts = torch.nn.Module()
    model.experts.routed_experts = _RoutedExperts(emap, backend)
    worker = SimpleNamespace(model_runner=SimpleNamespace(model=model), rank=0, device=None,
                             vllm_config=SimpleNamespace(parallel_config=SimpleNamespace(world_size=1)))
    layout = worker_param_layout(worker)
    assert layout["experts"]["experts.routed_experts.w13_weight"] == w13
    w2 = layout["experts"]["experts.routed_experts.w2_weight"]
    assert w2 == (w13 if "refuse" in w13 else {"ids": w13["ids"], "parts": ["down_proj"]})


def test_engines_holding_different_experts_get_no_shared_stream_plan() -> None:
    """An NCCL broadcast (or one trainer rank's IPC handles) reaches every engine whole: with expert parallelism
    the engines hold different experts, so one plan cannot fill them all; engines with the same experts (DP
    replicas) share it."""
    from rlhf_runtime.weight_sync.senders import one_stream_plan

    hf = _moe_hf()
    order = ["gate_proj", "up_proj"]
    ep = one_stream_plan(_Source(hf), [_moe_engine([0, 1], order), _moe_engine([2, 3], order)])
    assert not ep.ok and "hold different experts" in ep.reason
    dp = one_stream_plan(_Source(hf), [_moe_engine([0, 1, 2, 3], order), _moe_engine([0, 1, 2, 3], order)])
    assert dp.ok, dp.reason


def test_ipc_buffer_holds_the_largest_tensor_a_sync_sends() -> None:
    """vLLM's packed IPC producer refuses a tensor larger than its buffer (a large model's embedding exceeds 1 GiB):
    the sender's IPC buffer is at least the largest tensor, a trainer parameter as sent or a fused engine parameter
    of the kernel plan, in the sync's dtype."""
    from types import SimpleNamespace

    from rlhf_runtime.weight_sync import KernelPlan, ParamSource
    from rlhf_runtime.weight_sync.senders import TrainerEngineSender

    model = torch.nn.Sequential(torch.nn.Embedding(1000, 64), torch.nn.Linear(64, 32))
    source = ParamSource(model, torch.bfloat16)
    largest = TrainerEngineSender.largest_tensor_bytes
    assert largest(SimpleNamespace(source=source, plan=None)) == 1000 * 64 * 2  # the embedding, in bfloat16
    fused = KernelPlan([("qkv_proj.weight", [3000, 64], ["q", "k", "v"])], True, "")
    assert largest(SimpleNamespace(source=source, plan=fused)) == 3000 * 64 * 2  # the fused engine tensor


@pytest.mark.parametrize("tp", [1, 2])
def test_kernel_plan_sends_a_padded_vocabulary_unpadded(tp: int) -> None:
    """vLLM pads vocabulary parameters to a multiple of 64 rows and splits the padded rows over the TP ranks
    (OPT-125m: 50,272 -> 50,304): with the engine's ``vocab`` report the plan sends the HF tensor whole (every
    worker copies its rows, ``KernelTarget``); without it such a plan finds no source (the checkpoint format)."""
    from rlhf_runtime.weight_sync import KernelPlan

    hf = _hf(vocab=100)
    engine = _engine(hf, tp)
    engine["params"] = [(n, [128 // tp, s[1]]) if n in ("model.embed_tokens.weight", "lm_head.weight") else (n, s)
                        for n, s in engine["params"]]
    assert not KernelPlan.build(_Source(hf), engine).ok  # what happened before: a silent checkpoint fallback
    engine["vocab"] = {"model.embed_tokens.weight": 100, "lm_head.weight": 100}
    plan = KernelPlan.build(_Source(hf), engine)
    assert plan.ok and "2 padded vocabularies sent unpadded" in plan.reason, plan.reason
    sent = dict(plan.iterate(_Source(hf)))
    assert torch.equal(sent["model.embed_tokens.weight"], hf["model.embed_tokens.weight"])
    assert dict(zip(*plan.metadata(torch.float32)[::2]))["lm_head.weight"] == [100, 8]
    engine["vocab"] = {"model.embed_tokens.weight": 130, "lm_head.weight": 100}  # more rows than the engine holds
    assert not KernelPlan.build(_Source(hf), engine).ok
