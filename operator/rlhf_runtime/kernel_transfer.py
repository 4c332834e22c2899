"""The kernel weight format on vLLM >= 0.28: engine-side backends that copy into the engine's own parameters.

vLLM 0.28 dropped ``start_weight_update(is_checkpoint_format=False)``: its ``nccl`` and ``ipc`` worker engines
always run the layerwise reload (``initialize_layerwise_reload`` in ``start_weight_update``, ``load_weights`` per
chunk, ``finalize_layerwise_reload`` in ``finish_weight_update``), which took 74 of 94 ms of a 1.7B NCCL sync on
2xH200 with 0.33 (``benchmarks/README.md``, fourth round). vLLM 0.28+ leaves each engine its own lifecycle
(``WeightTransferEngine``: "engines that apply weights in place leave those methods as no-ops"), so the runtime
registers its own engines, ``rlhf_nccl`` and ``rlhf_ipc``: vLLM's transport unchanged, plus a per-engine format
switch (``set_format``, a worker RPC the runtime sends when ``weightSync.format`` resolves to kernel). The CPU
``gloo`` engine has no switch (see below why the kernel format cannot apply on CPU).

* checkpoint (default): exactly the parent engine (HF names, layerwise reload);
* kernel: ``start_weight_update`` puts a ``KernelTarget`` where the engine loads into (``self.model``): its
  ``load_weights`` copies each received tensor into the engine parameter of that name (names, shapes and dtypes
  of the engine's own layout: ``weight_sync.KernelPlan`` builds them on the trainer); ``finish_weight_update``
  puts the model back. No reload, no ``process_weights_after_loading``: right for layouts where the parameter
  is what the kernels read (unquantized GPU linear layers); the plan refuses engines whose parameters are not
  (on CPU vLLM prepacks linear weights and empties the parameters: their shapes no longer match any HF tensor).

The module imports torch and vLLM: import it only in processes that run engines (vLLM resolves the backends by
module path, ``vllm_plugin.register``).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from vllm.distributed.weight_transfer.ipc_engine import IPCWeightTransferEngine
from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferEngine


class KernelTarget:
    """Stands in for the model during a kernel-format update: ``load_weights`` copies each tensor into the
    model's parameter of the same name (shape and dtype must match: a wrong plan fails loudly, it never
    writes a parameter partially). One per engine, kept across syncs (vLLM 0.33's NCCL engine keys the
    metadata it reuses by the object it loads into)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.params: dict[str, torch.Tensor] = dict(model.named_parameters())
        self.loaded = 0

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        names = set()
        for name, tensor in weights:
            param = self.params.get(name)
            if param is None:
                raise KeyError(f"kernel-format weight {name!r} is not a parameter of the engine's model")
            if tuple(param.shape) != tuple(tensor.shape) or param.dtype != tensor.dtype:
                raise ValueError(f"kernel-format weight {name!r} is {list(tensor.shape)} {tensor.dtype}; the "
                                 f"engine's parameter is {list(param.shape)} {param.dtype}")
            param.copy_(tensor, non_blocking=True)
            names.add(name)
        self.loaded += len(names)
        return names


class KernelFormatMixin:
    """The format switch of a worker engine (mixed in before the vLLM engine class it extends)."""

    kernel_format: bool = False
    _kernel_target: KernelTarget | None = None
    _kernel_active: bool = False

    def start_weight_update(self) -> None:
        if not self.kernel_format:
            self._kernel_active = False
            super().start_weight_update()  # type: ignore[misc]
            return
        if self._kernel_target is None or self._kernel_target.model is not self.model:  # type: ignore[attr-defined]
            self._kernel_target = KernelTarget(self.model)  # type: ignore[attr-defined]
        self.model = self._kernel_target  # type: ignore[assignment]
        self._kernel_active = True

    def finish_weight_update(self) -> None:
        if not self._kernel_active:
            super().finish_weight_update()  # type: ignore[misc]
            return
        assert self._kernel_target is not None
        self.model = self._kernel_target.model
        self._kernel_active = False

    def reset_weight_update_target(self) -> None:
        self._kernel_active = False
        super().reset_weight_update_target()  # type: ignore[misc]


def set_format(engine: Any, kernel: bool) -> bool:
    """Switch a worker's weight-transfer engine to the kernel (``True``) or checkpoint format; returns the
    format now in force. ``engine`` is ``worker.weight_transfer_engine``. Refused between start and finish."""
    if engine is None:
        raise RuntimeError("weight transfer is not configured on this engine")
    if not isinstance(engine, KernelFormatMixin):
        if kernel:
            raise ValueError(f"the engine's weight-transfer backend ({type(engine).__name__}) cannot load the "
                             "kernel format: use weightSync.format checkpoint or auto")
        return False
    if engine._kernel_active:
        raise RuntimeError("cannot change the weight format during a weight update")
    engine.kernel_format = bool(kernel)
    return engine.kernel_format


# vLLM >= 0.28 only (``vllm_plugin`` registers these there; 0.24's engines take the format in their start).
class RlhfNCCLWeightTransferEngine(KernelFormatMixin, NCCLWeightTransferEngine):
    """vLLM's ``nccl`` worker engine with the kernel-format switch."""


class RlhfIPCWeightTransferEngine(KernelFormatMixin, IPCWeightTransferEngine):
    """vLLM's ``ipc`` worker engine with the kernel-format switch."""
