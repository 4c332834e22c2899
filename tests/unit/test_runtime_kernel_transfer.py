"""The kernel weight format on vLLM >= 0.28 (``rlhf_runtime.kernel_transfer``): what a worker engine loads into
during a kernel-format update, the format switch around vLLM's own engine lifecycle, and the worker calls an
engine makes before ``start_weight_update`` (``engines.format_rpc``). The transports (NCCL, CUDA IPC) and the
fresh-engine validation of the whole path run on the lent GPUs (``benchmarks/gpu_sync.py``)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("vllm")

from rlhf_runtime import engines, kernel_transfer, vllm_compat
from rlhf_runtime.kernel_transfer import KernelFormatMixin, KernelTarget

pytestmark = pytest.mark.skipif(not vllm_compat.has_trainer_api(), reason="vLLM >= 0.28 worker engines")


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.LayerNorm(6))


def test_kernel_target_copies_into_the_parameters_in_place() -> None:
    m = model()
    weight = m[0].weight
    assert weight.requires_grad  # an in-place copy into such a leaf outside no_grad raises (vLLM 0.24 froze them)
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

    from rlhf_runtime import vllm_plugin

    vllm_plugin.register()
    for backend, parent in (("nccl", NCCLWeightTransferEngine), ("ipc", IPCWeightTransferEngine)):
        name = vllm_compat.ENGINE_BACKENDS[backend]
        assert name in WeightTransferEngineFactory._registry
        cls = getattr(kernel_transfer, {"nccl": "RlhfNCCLWeightTransferEngine", "ipc": "RlhfIPCWeightTransferEngine"}[backend])
        assert issubclass(cls, parent) and issubclass(cls, KernelFormatMixin)
        assert cls.__mro__.index(KernelFormatMixin) < cls.__mro__.index(parent)


def test_format_rpc() -> None:
    # vLLM 0.24 (start takes the format): freeze before every kernel sync, nothing for checkpoint
    assert engines.format_rpc(True, False, False) == (engines._worker_freeze, ())
    assert engines.format_rpc(True, True, False) is None
    # 0.28+: the switch, sent only when the format changes
    assert engines.format_rpc(False, False, False) == (engines._worker_weight_format, (True,))
    assert engines.format_rpc(False, False, True) is None
    assert engines.format_rpc(False, True, True) == (engines._worker_weight_format, (False,))
    assert engines.format_rpc(False, True, False) is None
