"""The kernel weight format (``rlhf_runtime.weight_sync.kernel``): what a worker engine loads into during a
kernel-format update, the format switch around vLLM's own engine lifecycle, and the worker calls an engine makes
before ``start_weight_update`` (``rollout.workers.format_rpc``). The transports (NCCL, CUDA IPC) and the
fresh-engine validation of the whole path run on the lent GPUs (``benchmarks/gpu_sync.py``)."""

from __future__ import annotations

import types

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("vllm")

from rlhf_runtime.rollout import workers
from rlhf_runtime.vllm import compat as vllm_compat
from rlhf_runtime.weight_sync import kernel as kernel_transfer
from rlhf_runtime.weight_sync.kernel import KernelFormatMixin, KernelTarget


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.LayerNorm(6))


def test_kernel_target_copies_into_the_parameters_in_place() -> None:
    m = model()
    weight = m[0].weight
    assert weight.requires_grad  # an in-place copy into such a leaf outside no_grad raises
    new = torch.randn(6, 4)
    target = KernelTarget(m)
    assert target.load_weights([("0.weight", new), ("1.bias", torch.ones(6))]) == {"0.weight", "1.bias"}
    assert m[0].weight is weight and torch.equal(weight, new)  # the same storage the kernels read
    assert torch.equal(m[1].bias, torch.ones(6)) and target.loaded == 2


@pytest.mark.parametrize(("name", "tensor", "error", "match"), [
    ("0.nonexistent", torch.zeros(6, 4), KeyError, "not a parameter"),
    ("0.weight", torch.zeros(4, 6), ValueError, r"is \[4, 6\].*parameter is \[6, 4\]"),
    ("0.weight", torch.zeros(6, 4, dtype=torch.float64), ValueError, "float64"),
])
def test_kernel_target_refuses_what_is_not_the_engines_layout(name, tensor, error, match) -> None:
    m = model()
    before = m[0].weight.detach().clone()
    with pytest.raises(error, match=match):
        KernelTarget(m).load_weights([(name, tensor)])
    assert torch.equal(m[0].weight, before)


def test_kernel_target_writes_nothing_of_a_chunk_that_fails_a_check() -> None:
    m = model()
    before = m[0].weight.detach().clone()
    with pytest.raises(KeyError, match="not a parameter"):  # the bad tensor comes after a good one
        KernelTarget(m).load_weights([("0.weight", torch.randn(6, 4)), ("0.nonexistent", torch.zeros(1))])
    assert torch.equal(m[0].weight, before)


class Layer(torch.nn.Module):
    """A TP worker's parameters under vLLM's names (``qkv_proj`` of its heads, row-parallel ``o_proj``, a
    replicated norm)."""

    def __init__(self, qkv: list[int], o: list[int], norm: int) -> None:
        super().__init__()
        self.qkv_proj, self.o_proj = torch.nn.Linear(qkv[1], qkv[0], bias=False), torch.nn.Linear(o[1], o[0], bias=False)
        self.norm = torch.nn.LayerNorm(norm, bias=False)


def test_each_tp_worker_takes_its_own_piece_of_a_broadcast_of_all_ranks_pieces() -> None:
    """The kernel format over NCCL into a TP=2 engine: every worker receives the pieces of both ranks side by
    side (``KernelPlan`` without a ``tp_rank``) and copies its own half, along the one dimension where the
    tensor is twice its parameter (dim 0 for column-parallel, dim 1 for row-parallel); a whole tensor is
    copied as it is; a tensor that is not ``tp`` times the parameter is still refused."""
    full = {"qkv_proj.weight": torch.randn(16, 8), "o_proj.weight": torch.randn(8, 8), "norm.weight": torch.randn(8)}
    for rank in range(2):
        worker = Layer([8, 8], [8, 4], 8)
        target = KernelTarget(worker, tp=2, tp_rank=rank)
        assert target.load_weights(full.items()) == set(full)
        assert torch.equal(worker.qkv_proj.weight, full["qkv_proj.weight"].chunk(2, dim=0)[rank])
        assert torch.equal(worker.o_proj.weight, full["o_proj.weight"].chunk(2, dim=1)[rank])
        assert torch.equal(worker.norm.weight, full["norm.weight"])
    with pytest.raises(ValueError, match=r"is \[24, 8\].*parameter is \[8, 8\]"):  # 3x, not 2x
        KernelTarget(Layer([8, 8], [8, 4], 8), tp=2, tp_rank=0).load_weights([("qkv_proj.weight", torch.randn(24, 8))])
    with pytest.raises(ValueError, match=r"is \[16, 16\]"):  # grown along two dimensions
        KernelTarget(Layer([8, 8], [8, 4], 8), tp=2, tp_rank=1).load_weights([("qkv_proj.weight", torch.randn(16, 16))])
    with pytest.raises(ValueError, match=r"is \[16, 8\]"):  # TP=1: never sliced
        KernelTarget(Layer([8, 8], [8, 4], 8)).load_weights([("qkv_proj.weight", torch.randn(16, 8))])


def test_a_worker_outside_an_engine_is_tp_rank_0_of_1() -> None:
    assert kernel_transfer.tp_position() == (1, 0)


class Update:
    """vLLM's ``IPCWeightTransferUpdateInfo`` of a packed chunk: the fields ``packed_views`` reads."""

    def __init__(self, tensors: dict[str, torch.Tensor], handles: dict[str, tuple], sizes: bool = True) -> None:
        self.names = list(tensors)
        self.shapes = [list(t.shape) for t in tensors.values()]
        self.dtype_names = [str(t.dtype).split(".")[-1] for t in tensors.values()]
        self.tensor_sizes = [t.numel() * t.element_size() for t in tensors.values()] if sizes else None
        self.ipc_handles = handles


class Importer:
    """Stands in for vLLM's ``PackedBufferImporter`` (whose ``rebuild`` maps a CUDA IPC handle, which needs a
    GPU): hands back the trainer's buffer itself and records the rebuild arguments."""

    def __init__(self, buffer: torch.Tensor) -> None:
        self.buffer, self.args = buffer, None

    def rebuild(self, args: list) -> torch.Tensor:
        self.args = args
        return self.buffer


def test_packed_views_alias_the_trainers_buffer_and_load_into_the_parameters() -> None:
    m = model()
    new = {"0.weight": torch.randn(6, 4), "0.bias": torch.randn(6), "1.weight": torch.randn(6)}
    buffer = torch.cat([t.reshape(-1).view(torch.uint8) for t in new.values()] + [torch.zeros(64, dtype=torch.uint8)])
    handle = tuple(range(8))  # reduce_tensor's arguments; index 6 is the sender's device index
    importer = Importer(buffer)
    views = kernel_transfer.packed_views(Update(new, {"GPU-a": handle}), "GPU-a", 3, importer)
    assert importer.args[6] == 3 and importer.args[:6] == list(range(6))  # rebuilt on the receiver's device
    assert [n for n, _ in views] == list(new)
    for (name, v), want in zip(views, new.values()):
        assert torch.equal(v, want) and v.dtype == want.dtype
        assert buffer.data_ptr() <= v.data_ptr() < buffer.data_ptr() + buffer.numel()  # no clone
    assert KernelTarget(m).load_weights(views) == set(new)
    assert torch.equal(m[0].weight, new["0.weight"]) and torch.equal(m[1].weight, new["1.weight"])


def test_packed_views_refuse_a_chunk_without_this_gpu_or_sizes() -> None:
    t = {"0.bias": torch.randn(6)}
    buffer = t["0.bias"].view(torch.uint8)
    with pytest.raises(ValueError, match="GPU UUID GPU-b.*GPU-a"):
        kernel_transfer.packed_views(Update(t, {"GPU-a": tuple(range(8))}), "GPU-b", 0, Importer(buffer))
    with pytest.raises(ValueError, match="tensor_sizes"):
        kernel_transfer.packed_views(Update(t, {"GPU-a": tuple(range(8))}, sizes=False), "GPU-a", 0,
                                     Importer(buffer))


def test_ipc_engine_releases_the_trainers_buffer_after_a_kernel_update() -> None:
    class Recorder:
        closed = 0

        def close(self) -> None:
            self.closed += 1

    m = model()
    # the registered class itself, without vLLM's worker setup (its __init__ wants a vLLM config)
    e = object.__new__(kernel_transfer.RlhfIPCWeightTransferEngine)
    e.model, e._packed_importer, e.kernel_format = m, Recorder(), True
    e.start_weight_update()
    assert isinstance(e.model, KernelTarget)
    e.finish_weight_update()
    assert e.model is m and e._packed_importer.closed == 1  # vLLM's finish closes it; the kernel path must too


class Reloading:
    """vLLM's worker-engine lifecycle as the mixin sees it: ``start``/``finish`` run the layerwise reload around
    loads into ``self.model``; ``reset_weight_update_target`` restores the default model."""

    def __init__(self, m: torch.nn.Module) -> None:
        self.model = self._default = m
        self.calls: list[str] = []

    def start_weight_update(self) -> None:
        self.calls.append("reload-start")

    def finish_weight_update(self) -> None:
        self.calls.append("reload-finish")

    def reset_weight_update_target(self) -> None:
        self.model = self._default


class Engine(KernelFormatMixin, Reloading):
    pass


def test_format_switch_kernel_copies_checkpoint_reloads() -> None:
    m = model()
    e = Engine(m)
    e.start_weight_update()
    e.finish_weight_update()
    assert e.calls == ["reload-start", "reload-finish"]  # checkpoint by default: the parent's lifecycle

    assert kernel_transfer.set_format(e, True) is True
    new = torch.randn(6, 4)
    for _ in range(2):
        e.start_weight_update()
        assert isinstance(e.model, KernelTarget) and e.model.model is m
        e.model.load_weights([("0.weight", new)])  # what vLLM's receive_weights calls
        e.finish_weight_update()
        assert e.model is m
    assert e.calls == ["reload-start", "reload-finish"] and torch.equal(m[0].weight, new)
    target = e._kernel_target
    e.start_weight_update()
    assert e.model is target  # one target per engine across syncs (vLLM keys reused metadata by it)
    with pytest.raises(RuntimeError, match="during a weight update"):
        kernel_transfer.set_format(e, False)
    e.reset_weight_update_target()  # what the worker does when update_weights failed
    assert e.model is m and not e._kernel_active

    assert kernel_transfer.set_format(e, False) is False
    e.start_weight_update()
    e.finish_weight_update()
    assert e.calls[-2:] == ["reload-start", "reload-finish"]


def test_set_format_on_engines_without_the_switch() -> None:
    plain = Reloading(model())
    assert kernel_transfer.set_format(plain, False) is False
    with pytest.raises(ValueError, match="cannot load the kernel format"):
        kernel_transfer.set_format(plain, True)
    with pytest.raises(RuntimeError, match="not configured"):
        kernel_transfer.set_format(None, True)


def test_registered_engines_are_vllms_with_the_switch() -> None:
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory
    from vllm.distributed.weight_transfer.ipc_engine import IPCWeightTransferEngine
    from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferEngine

    from rlhf_runtime.vllm import plugin as vllm_plugin

    vllm_plugin.register()
    for backend, parent in (("nccl", NCCLWeightTransferEngine), ("ipc", IPCWeightTransferEngine)):
        name = vllm_compat.ENGINE_BACKENDS[backend]
        assert name in WeightTransferEngineFactory._registry
        cls = getattr(kernel_transfer, {"nccl": "RlhfNCCLWeightTransferEngine", "ipc": "RlhfIPCWeightTransferEngine"}[backend])
        assert issubclass(cls, parent) and issubclass(cls, KernelFormatMixin)
        assert cls.__mro__.index(KernelFormatMixin) < cls.__mro__.index(parent)


def test_format_rpc() -> None:
    # the switch, sent only when the format changes
    assert workers.format_rpc(False, False) == (workers.worker_weight_format, (True,))
    assert workers.format_rpc(False, True) is None
    assert workers.format_rpc(True, True) == (workers.worker_weight_format, (False,))
    assert workers.format_rpc(True, False) is None


class PaddedVocab(torch.nn.Module):
    """What vLLM's ``VocabParallelEmbedding`` holds of a padded vocabulary on TP rank ``rank`` of ``tp``: the padded
    rows split evenly, its Hugging Face rows ``[org_vocab_start_index, org_vocab_end_index)`` at the start."""

    def __init__(self, rows: int, padded: int, hidden: int, tp: int, rank: int) -> None:
        super().__init__()
        per = padded // tp
        self.weight = torch.nn.Parameter(torch.full((per, hidden), -1.0))
        self.org_vocab_size, self.num_added_embeddings = rows, 0
        start = min(rank * per, rows)
        self.shard_indices = types.SimpleNamespace(org_vocab_start_index=start,
                                                   org_vocab_end_index=min(start + per, rows))


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_each_worker_copies_its_rows_of_an_unpadded_vocabulary_and_keeps_its_padding(tp: int) -> None:
    """100 HF rows padded to 128 in the engine: rank r of ``tp`` holds rows [32r, 32r+32) of the padded
    vocabulary, so the last rank of 4 holds 4 real rows and 28 padding rows, which stay as they were."""
    full = torch.randn(100, 8)
    for rank in range(tp):
        model = torch.nn.Module()
        model.embed = PaddedVocab(100, 128, 8, tp, rank)
        target = KernelTarget(model, tp=tp, tp_rank=rank)
        assert target.load_weights([("embed.weight", full)]) == {"embed.weight"}
        per = 128 // tp
        real = max(0, min(per, 100 - rank * per))
        assert torch.equal(model.embed.weight[:real], full[rank * per: rank * per + real])
        assert bool((model.embed.weight[real:] == -1.0).all())
    model = torch.nn.Module()
    model.embed = PaddedVocab(100, 128, 8, 1, 0)
    with pytest.raises(ValueError, match=r"is \[99, 8\].*parameter is \[128, 8\]"):  # not the vocabulary's rows
        KernelTarget(model).load_weights([("embed.weight", torch.randn(99, 8))])
