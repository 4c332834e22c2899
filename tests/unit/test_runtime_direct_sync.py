"""The direct NCCL sync's wire (``weight_sync.direct``): the engine side's receive plan (straight into its
parameters: whole, the parts of a fused one, the rows of a padded vocabulary; scratch tensors on a worker of a
tensor-parallel engine), its refusals before anything is received, and the trainer and engine sides run against
each other over real gloo groups (one group of broadcasts per bucket, the same buckets on both
sides). NCCL itself, the streams and the fresh-engine validation run on the lent GPUs (``benchmarks/gpu_sync.py``,
layout ``separate-nccl-unpacked``)."""

from __future__ import annotations

import types
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("vllm")

from rlhf_runtime.weight_sync import direct
from rlhf_runtime.weight_sync.formats import KernelPlan
from rlhf_runtime.weight_sync.kernel import KernelTarget
from tests.unit.test_runtime_weight_sync import _engine, _hf, _Source

F32 = torch.float32


def _engine_model(params: list[tuple[str, list[int]]], vocab: dict[str, int] | None = None, tp: int = 1,
                  rank: int = 0) -> torch.nn.Module:
    """A module whose ``named_parameters`` are an engine's (vLLM's names and shapes), all -1; ``vocab``: padded
    vocabulary parameters and their Hugging Face rows (the attributes ``kernel.vocab_slices`` reads)."""
    root = torch.nn.Module()
    for name, shape in params:
        *path, leaf = name.split(".")
        mod = root
        for part in path:
            if not hasattr(mod, part):
                mod.add_module(part, torch.nn.Module())
            mod = getattr(mod, part)
        mod.register_parameter(leaf, torch.nn.Parameter(torch.full(shape, -1.0)))
        rows = (vocab or {}).get(name)
        if rows is not None:
            start = min(rank * shape[0], rows)
            mod.org_vocab_size, mod.num_added_embeddings = rows, 0
            mod.shard_indices = types.SimpleNamespace(org_vocab_start_index=start,
                                                      org_vocab_end_index=min(start + shape[0], rows))
    return root


def _padded(hf: dict[str, torch.Tensor], tp: int = 1) -> tuple[dict[str, Any], dict[str, int]]:
    """The engine layout of ``_engine`` with the vocabulary (16 HF rows) padded to 64 rows as vLLM pads it."""
    engine = _engine(hf, tp)
    rows = hf["model.embed_tokens.weight"].shape[0]
    vocab = {"model.embed_tokens.weight": rows, "lm_head.weight": rows}
    engine["params"] = [(n, [64 // tp, s[1]]) if n in vocab else (n, s) for n, s in engine["params"]]
    engine["vocab"] = vocab
    return engine, vocab


def _wire(plan: KernelPlan, hf: dict[str, torch.Tensor], fuse: bool = False
          ) -> tuple[list[tuple[str, torch.Tensor]], list[Any]]:
    """What the trainer sends (``direct.pieces``: TP=1, the parts unfused; TP > 1, every rank's piece; or with
    ``fuse`` at TP=1 one tensor per engine parameter, as the packed path fuses them) and the metadata it
    declares (name, shape)."""
    if fuse:
        pairs = list(plan.iterate(_Source(hf), fuse=True))
        meta = [(n, list(sh)) for n, sh, _ in plan.entries]
    else:
        pairs = list(direct.pieces(plan, plan.iterate(_Source(hf), fuse=False)))
        meta = direct.piece_shapes(plan, {n: list(t.shape) for n, t in hf.items()})
    assert [(n, list(t.shape)) for n, t in pairs] == [(n, list(s)) for n, s in meta]  # declared = sent
    return pairs, meta


def _expected(hf: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    a, m = "model.layers.0.self_attn.", "model.layers.0.mlp."
    parts = {a + "qkv_proj.weight": ["q_proj.weight", "k_proj.weight", "v_proj.weight"],
             a + "qkv_proj.bias": ["q_proj.bias", "k_proj.bias", "v_proj.bias"],
             m + "gate_up_proj.weight": ["gate_proj.weight", "up_proj.weight"]}.get(name)
    if parts is None:
        return hf[name]
    prefix = a if "self_attn" in name else m
    return torch.cat([hf[prefix + p] for p in parts])


# ------------------------------------------------------------------------------------------ the receive plan
def test_tp1_entries_land_in_the_parameters_themselves() -> None:
    """Every entry is a view of its parameter's memory: the parts of ``qkv_proj`` one after another from its
    start, a padded vocabulary's 16 HF rows in its first rows; copying the wire into the views is the sync."""
    hf = _hf()
    engine, vocab = _padded(hf)
    plan = KernelPlan.build(_Source(hf), engine)
    assert plan.ok, plan.reason
    pairs, meta = _wire(plan, hf)
    assert [n for n, _ in meta].count("model.layers.0.self_attn.qkv_proj.weight") == 3  # q, k, v unfused
    model = _engine_model(engine["params"], vocab)
    target = KernelTarget(model)
    p = direct.plan(target, [n for n, _ in meta], ["float32"] * len(meta), [s for _, s in meta], 1 << 20)
    assert p.direct == len(meta) and not any(p.scratch) and p.groups == [(0, len(meta))]
    params = dict(model.named_parameters())
    for buf, (name, _) in zip(p.buffers, meta, strict=True):
        assert buf.untyped_storage().data_ptr() == params[name].untyped_storage().data_ptr()  # no scratch
    with torch.no_grad():
        for buf, (_, t) in zip(p.buffers, pairs, strict=True):
            buf.copy_(t.reshape(-1))
    for name, param in params.items():
        if name in vocab:
            assert torch.equal(param[:16], hf[name]) and bool((param[16:] == -1).all())  # padding untouched
        else:
            assert torch.equal(param, _expected(hf, name)), name


def test_buckets_split_by_bytes_and_give_a_large_entry_its_own() -> None:
    assert direct.buckets([4, 4, 4, 10, 1], 8) == [(0, 2), (2, 3), (3, 4), (4, 5)]
    assert direct.buckets([0, 10, 4], 8) == [(0, 1), (1, 2), (2, 3)]  # as gloo's trainer side cuts them
    assert direct.buckets([], 8) == []
    assert direct.entry_bytes([[2, 3], [5]], [torch.bfloat16, F32]) == [12, 20]


@pytest.mark.parametrize(("names", "shapes", "dtype", "error", "match"), [
    (["nope.weight"], [[4]], "float32", KeyError, "not a parameter"),
    (["a.weight"], [[2, 4]], "bfloat16", ValueError, "bfloat16; the engine's parameter is torch.float32"),
    (["a.weight", "a.weight"], [[4, 4], [1, 4]], "float32", ValueError, "overruns"),
    (["a.weight"], [[3, 4]], "float32", ValueError, "fills 12 of the engine's parameter's 16"),
    (["a.weight", "b.weight", "a.weight"], [[2, 4], [4], [2, 4]], "float32", ValueError, "not consecutive"),
    (["v.weight"], [[9, 4]], "float32", ValueError, "fills 36"),  # a padded vocabulary: exactly its HF rows
])
def test_a_plan_that_does_not_fit_the_engine_is_refused_before_receiving(names, shapes, dtype, error, match) -> None:
    model = _engine_model([("a.weight", [4, 4]), ("b.weight", [4]), ("v.weight", [64, 4])], {"v.weight": 10})
    with pytest.raises(error, match=match):
        direct.plan(KernelTarget(model), names, [dtype] * len(names), shapes, 1 << 20)


@pytest.mark.parametrize("rank", [0, 1])
def test_a_tp_worker_receives_its_pieces_into_its_parameters_and_discards_the_others(rank) -> None:
    """TP=2, every rank's piece on the wire (``pieces``): worker ``rank``'s pieces are views of its
    parameters (q, k, v pieces one after another in ``qkv_proj``; its columns of ``o_proj`` as one piece), the
    other worker's are thrown away, replicated parameters come whole, and a padded vocabulary's HF rows go to
    scratch (``KernelTarget`` copies the worker's rows)."""
    hf = _hf()
    engine, vocab = _padded(hf, 2)
    plan = KernelPlan.build(_Source(hf), engine)  # no tp_rank: every rank's pieces
    assert plan.ok and plan.all_ranks, plan.reason
    pairs, meta = _wire(plan, hf)
    qkv, o = "model.layers.0.self_attn.qkv_proj.weight", "model.layers.0.self_attn.o_proj.weight"
    assert [n for n, _ in meta].count(qkv) == 6 and [n for n, _ in meta].count(o) == 2
    model = _engine_model(engine["params"], vocab, 2, rank)
    p = direct.plan(KernelTarget(model, tp=2, tp_rank=rank), [n for n, _ in meta], ["float32"] * len(meta),
                    [s for _, s in meta], 1 << 20)
    params = dict(model.named_parameters())
    names = [n for n, _ in meta]
    for i, (name, buf) in enumerate(zip(names, p.buffers, strict=True)):
        if name in vocab:
            assert buf is None, name
        elif isinstance(buf, torch.Tensor):
            assert buf.untyped_storage().data_ptr() == params[name].untyped_storage().data_ptr(), name
        else:
            assert buf is direct.DISCARD
    assert p.direct + p.discarded + sum(p.scratch) == len(meta) and p.discarded > 0
    with torch.no_grad():  # the wire copied into the plan's views is this worker's part of every parameter
        for buf, (_, t) in zip(p.buffers, pairs, strict=True):
            if isinstance(buf, torch.Tensor):
                buf.copy_(t.reshape(-1))
    a = "model.layers.0.self_attn."
    assert torch.equal(params[qkv], torch.cat([hf[a + x + ".weight"].chunk(2)[rank] for x in ("q_proj", "k_proj",
                                                                                               "v_proj")]))
    assert torch.equal(params[o], hf[o].chunk(2, dim=1)[rank])
    assert torch.equal(params["model.norm.weight"], hf["model.norm.weight"])


@pytest.mark.parametrize(("names", "shapes", "match"), [
    (["nope"], [[2]], "not a parameter"),
    (["a.weight"], [[3, 4]], "12 elements sent for a parameter of 8 on each of 2 workers"),
    (["a.weight", "a.weight"], [[3, 4], [1, 4]], "straddles worker 1's piece"),
    (["a.weight", "b.weight", "a.weight"], [[2, 4], [4], [2, 4]], "not consecutive"),
])
def test_a_tp_plan_that_does_not_fit_is_refused_before_receiving(names, shapes, match) -> None:
    model = _engine_model([("a.weight", [2, 4]), ("b.weight", [4])])
    with pytest.raises((KeyError, ValueError), match=match):
        direct.plan(KernelTarget(model, tp=2, tp_rank=1), names, ["float32"] * len(names), shapes, 1 << 20)


# ------------------------------------------------------------------------------------------ both sides, gloo
class GlooGroup:
    """``PyNcclCommunicator``'s three calls over a gloo process group of its own: a group's broadcasts are
    started asynchronously and waited for at ``group_end`` (NCCL launches them together there)."""

    def __init__(self, pg: Any) -> None:
        self.pg, self.works, self.groups, self.broadcasts = pg, None, 0, 0

    def broadcast(self, tensor: torch.Tensor, src: int, stream: Any = None) -> None:
        import torch.distributed as dist

        self.broadcasts += 1

        opts = dist.BroadcastOptions()
        opts.rootRank = src
        work = self.pg.broadcast([tensor], opts)
        if self.works is None:
            work.wait()
        else:
            self.works.append(work)

    def group_start(self) -> None:
        self.works = []

    def group_end(self) -> None:
        for work in self.works or []:
            work.wait()
        self.works, self.groups = None, self.groups + 1


def _side(rank: int, pg: Any, tp: int, bucket: int) -> dict[str, Any]:
    """Rank 0 the trainer, the others the workers of one engine of ``tp`` workers."""
    hf = _hf(hidden=64, inter=96)
    engine, vocab = _padded(hf, tp)
    plan = KernelPlan.build(_Source(hf), engine)
    pairs, meta = _wire(plan, hf)
    comm = GlooGroup(pg)
    names = [n for n, _ in meta]
    if rank == 0:
        sent = direct.send(iter(pairs), direct.entry_bytes([s for _, s in meta], [F32] * len(meta)), comm, bucket)
        return {"bytes": sent, "groups": comm.groups, "broadcasts": comm.broadcasts}
    model = _engine_model(engine["params"], vocab, tp, rank - 1)
    target = KernelTarget(model, tp=tp, tp_rank=rank - 1)
    p = direct.plan(target, names, ["float32"] * len(meta), [s for _, s in meta], bucket)
    got = direct.receive(p, target, comm)
    return {"bytes": got, "groups": comm.groups, "direct": p.direct, "params": dict(model.named_parameters()),
            "broadcasts": comm.broadcasts}


def _run(world: int, tp: int, bucket: int) -> dict[int, dict[str, Any]]:
    return _ranks(world, lambda rank, pg: _side(rank, pg, tp, bucket))


def _ranks(world: int, side: Any) -> dict[int, Any]:
    """``side(rank, process group)`` of every rank in a thread of this process, each with its own gloo process
    group over one store (real sockets, real collectives; no process start)."""
    import threading
    from datetime import timedelta

    import torch.distributed as dist

    store = dist.HashStore()
    got: dict[int, Any] = {}

    def rank_main(rank: int) -> None:
        try:
            opts = dist.ProcessGroupGloo._Options()
            opts._timeout = timedelta(seconds=60)
            opts._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
            got[rank] = side(rank, dist.ProcessGroupGloo(store, rank, world, opts))
        except BaseException as e:  # noqa: BLE001 (reported below; the others then time out)
            got[rank] = e

    threads = [threading.Thread(target=rank_main, args=(r,), daemon=True) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    errors = [v for v in got.values() if isinstance(v, BaseException)]
    if errors:
        raise errors[0]
    assert sorted(got) == list(range(world)), f"ranks that did not finish: {set(range(world)) - set(got)}"
    return got


def test_trainer_and_tp1_engine_agree_over_a_real_group() -> None:
    """Trainer (rank 0) and a TP=1 engine worker (rank 1): 5 KiB buckets make several groups of broadcasts on
    both sides; the engine ends with the fused layout, the padded vocabulary's padding untouched."""
    got = _run(2, 1, 5 << 10)
    hf = _hf(hidden=64, inter=96)
    assert got[0]["bytes"] == got[1]["bytes"] and got[0]["groups"] == got[1]["groups"] > 2
    assert got[1]["direct"] > 0
    for name, param in got[1]["params"].items():
        if "embed" in name or "lm_head" in name:
            assert torch.equal(param[:16], hf[name]) and bool((param[16:] == -1).all()), name
        else:
            assert torch.equal(param, _expected(hf, name)), name


def test_trainer_and_both_workers_of_a_tp2_engine_agree_over_a_real_group() -> None:
    """Trainer and the two workers of a TP=2 engine (ranks 1, 2): each worker receives its own pieces into its
    parameters (column-parallel rows, row-parallel columns) and its rows of the padded vocabulary from scratch."""
    got = _run(3, 2, 5 << 10)
    hf = _hf(hidden=64, inter=96)
    a = "model.layers.0.self_attn."
    for w in (1, 2):
        params, r = got[w]["params"], w - 1
        assert got[w]["groups"] == got[0]["groups"] and got[w]["direct"] > 0
        qkv = torch.cat([hf[a + p + ".weight"].chunk(2)[r] for p in ("q_proj", "k_proj", "v_proj")])
        assert torch.equal(params[a + "qkv_proj.weight"], qkv)
        assert torch.equal(params[a + "o_proj.weight"], hf[a + "o_proj.weight"].chunk(2, dim=1)[r])
        assert torch.equal(params["model.norm.weight"], hf["model.norm.weight"])
        rows = hf["model.embed_tokens.weight"][r * 32: r * 32 + 32]  # 16 HF rows: all on worker 0
        assert torch.equal(params["model.embed_tokens.weight"][: len(rows)], rows)


# ------------------------------------------------------------------------------------------ the sender's source
def _bare_sender(hf: dict[str, torch.Tensor], tp: int = 1, backend: str = "nccl", packed: bool = False,
                 fmt: str = "kernel") -> Any:
    """A ``TrainerEngineSender`` without its ``__init__`` (which opens the NCCL group): the attributes its weight
    source reads, its options resolved from ``packed``, the plan of one engine of ``tp`` workers over ``hf``."""
    from rlhf_api.models import WeightSync
    from rlhf_runtime.weight_sync.options import resolve
    from rlhf_runtime.weight_sync.senders import TrainerEngineSender

    source = _Source(hf)
    source.dtype = F32
    sender = object.__new__(TrainerEngineSender)
    sender.options = resolve(WeightSync(packed=packed), backend=backend, engine_worlds=[tp], trainer_world=1)
    sender.backend, sender.format, sender.source = backend, fmt, source
    sender.packed = sender.options.packs(fmt)
    sender.plan = KernelPlan.build(source, _engine(hf, tp))
    return sender


def _declared_and_sent(ws: Any) -> tuple[list[tuple[str, list[int]]], list[tuple[str, torch.Tensor]]]:
    """A weight source's declared entries (name, shape) and what it yields."""
    from rlhf_runtime.vllm import compat as vllm_compat

    return ([(m.name, list(m.shape)) for m in vllm_compat.source_metadata(ws)],
            list(vllm_compat.source_tensors(ws)))


@pytest.mark.parametrize(("backend", "packed", "fmt", "direct_on"), [
    ("nccl", False, "kernel", True), ("nccl", True, "kernel", False), ("nccl", False, "checkpoint", False),
    ("ipc", False, "kernel", False),
])
def test_the_sender_declares_what_it_yields_parts_only_on_the_direct_sync(backend, packed, fmt, direct_on) -> None:
    """``TrainerEngineSender``'s weight source: on the direct sync (NCCL, kernel format, not packed) a fused
    parameter goes out as its parts under its name, declared so (the engines build their receive plan from the
    declaration); otherwise the fused tensors (or the checkpoint format's HF tensors) as before."""
    from rlhf_runtime.vllm import compat as vllm_compat

    hf = _hf()
    sender = _bare_sender(hf, backend=backend, packed=packed, fmt=fmt)
    sender.source.as_weight_source = lambda: vllm_compat.as_weight_source(
        lambda: [vllm_compat.param_meta(n, F32, tuple(t.shape)) for n, t in hf.items()], lambda: iter(hf.items()))
    assert sender.direct is direct_on
    meta, sent = _declared_and_sent(sender._weight_source())
    assert meta == [(n, list(t.shape)) for n, t in sent]
    qkv = "model.layers.0.self_attn.qkv_proj.weight"
    assert [n for n, _ in meta].count(qkv) == (3 if direct_on else 0 if fmt == "checkpoint" else 1)


@pytest.mark.parametrize("packed", [False, True])
def test_into_a_tp_engine_the_direct_sync_declares_every_ranks_pieces(packed) -> None:
    """The sender's weight source for one TP=2 engine over NCCL: on the direct sync every rank's piece under the
    parameter's name (declared = sent; q, k, v of each rank: 6 entries); packed, vLLM's one tensor per
    parameter, every rank's pieces side by side."""
    meta, sent = _declared_and_sent(_bare_sender(_hf(), tp=2, packed=packed)._weight_source())
    assert meta == [(n, list(t.shape)) for n, t in sent]
    assert [n for n, _ in meta].count("model.layers.0.self_attn.qkv_proj.weight") == (1 if packed else 6)


# ------------------------------------------------------------------------------------------ vLLM's engine classes
def test_the_runtimes_vllm_engines_run_the_direct_sync_and_reuse_the_metadata() -> None:
    """``kernel.DirectNCCLTrainerEngine._broadcast`` and ``kernel.RlhfNCCLWeightTransferEngine.receive_weights``
    (vLLM's NCCL engines with the direct sync; their constructors open NCCL, so the attributes the handshake sets
    are set here) over a gloo group, two syncs: the first with the metadata, the second without (vLLM 0.33's
    trainer sends it only when it changed), which the engine answers from the plan it kept; a third with one
    tensor per fused parameter (new metadata: a new plan)."""
    from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferUpdateInfo

    from rlhf_runtime.vllm import compat as vllm_compat
    from rlhf_runtime.weight_sync.kernel import DirectNCCLTrainerEngine, RlhfNCCLWeightTransferEngine

    hf = _hf(hidden=64, inter=96)
    engine_layout, vocab = _padded(hf)
    plan = KernelPlan.build(_Source(hf), engine_layout)
    _, meta = _wire(plan, hf)
    _, meta2 = _wire(plan, hf, fuse=True)  # the third sync: other metadata
    model = _engine_model(engine_layout["params"], vocab)
    worker = object.__new__(RlhfNCCLWeightTransferEngine)
    worker.packed, worker.packed_buffer_size_bytes, worker.device = False, 5 << 10, "cpu"
    worker._kernel_active, worker._kernel_target = True, KernelTarget(model)
    trainer = object.__new__(DirectNCCLTrainerEngine)
    trainer.is_sender, trainer.packed, trainer.direct, trainer.packed_buffer_size_bytes = True, False, True, 5 << 10
    infos = [NCCLWeightTransferUpdateInfo(names=[n for n, _ in m], dtype_names=["float32"] * len(m),
                                          shapes=[list(s) for _, s in m]) for m in (meta, meta2)]
    infos.insert(1, NCCLWeightTransferUpdateInfo(names=[], dtype_names=[], shapes=[]))
    plans = []
    for sync, info in enumerate(infos):
        weights = {n: t + sync for n, t in hf.items()}  # new values every sync
        pairs, m = _wire(plan, weights, fuse=sync == 2)
        params = [vllm_compat.param_meta(n, F32, tuple(sh)) for n, sh in m]
        source = vllm_compat.as_weight_source(lambda params=params: params, lambda pairs=pairs: iter(pairs))

        def side(rank: int, pg: Any, source: Any = source, info: Any = info) -> None:
            if rank == 0:
                trainer.model_update_group = GlooGroup(pg)
                trainer._broadcast(source, vllm_compat.source_metadata(source))
            else:
                worker.model_update_group = GlooGroup(pg)
                worker.receive_weights(info)

        _ranks(2, side)
        plans.append(worker.direct_plan)
        for name, param in model.named_parameters():
            want = _expected(weights, name)
            assert torch.equal(param[: want.shape[0]], want), (sync, name)
    assert plans[0] is plans[1] and plans[2] is not plans[1] and len(plans[2].names) < len(plans[1].names)
    assert worker._kernel_target.loaded == 2 * plans[0].direct + plans[2].direct
