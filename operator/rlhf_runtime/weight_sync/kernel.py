"""The kernel weight format: worker engines that copy into the engine's own parameters.

vLLM's ``nccl`` and ``ipc`` worker engines always run the layerwise reload (most of a NCCL sync's time). The
runtime registers its own, ``rlhf_nccl`` and ``rlhf_ipc``: vLLM's transport plus a per-engine format switch
(``set_format``, a worker RPC sent when the sender's format resolves to kernel):

* checkpoint (default): exactly the parent engine (HF names, layerwise reload);
* kernel: ``start_weight_update`` puts a ``KernelTarget`` where the engine loads into (``self.model``), whose
  ``load_weights`` copies each tensor into the parameter of that name (``formats.KernelPlan`` builds the names,
  shapes and dtypes on the trainer); ``finish_weight_update`` puts the model back. No reload, no
  ``process_weights_after_loading``: right where the parameter is what the kernels read (unquantized GPU layers).

``rlhf_nccl`` also receives the direct sync (``weight_sync.direct``), ``rlhf_ipc`` the resident sync
(``ResidentCopy``). Imports torch and vLLM: only for processes that run engines (``vllm.plugin.register``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from vllm.distributed.weight_transfer.ipc_engine import IPCWeightTransferEngine, IPCWeightTransferUpdateInfo
from vllm.distributed.weight_transfer.nccl_engine import (
    NCCLTrainerWeightTransferEngine,
    NCCLWeightTransferEngine,
)

from rlhf_runtime.weight_sync import direct


def vocab_slices(model: torch.nn.Module) -> dict[str, tuple[int, int, int]]:
    """The padded vocabulary parameters of an engine's model: ``{name: (vocabulary rows, first, end)}``, the HF rows
    ``[first, end)`` this worker holds at the start of its parameter. vLLM's ``VocabParallelEmbedding`` and
    ``ParallelLMHead`` pad the vocabulary to a multiple of 64 and split the padded rows over the TP ranks; the
    padding is never read. Modules with added (LoRA) vocabulary rows are left out."""
    out: dict[str, tuple[int, int, int]] = {}
    for prefix, module in model.named_modules():
        idx = getattr(module, "shard_indices", None)
        rows = getattr(module, "org_vocab_size", None)
        if idx is None or not isinstance(rows, int) or getattr(module, "num_added_embeddings", 0):
            continue
        if "weight" in getattr(module, "_parameters", {}):
            out[f"{prefix}.weight" if prefix else "weight"] = (rows, int(idx.org_vocab_start_index),
                                                                int(idx.org_vocab_end_index))
    return out


def vocab_rows(slices: dict[str, tuple[int, int, int]], name: str, tensor: torch.Tensor, param: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(parameter rows, tensor rows)`` to copy where ``tensor`` is the whole unpadded vocabulary of the padded
    parameter ``name`` (``slices``: ``vocab_slices`` of the engine's model), else None."""
    if name not in slices or tensor.dim() != param.dim() or tensor.shape[1:] != param.shape[1:]:
        return None
    rows, first, end = slices[name]
    if tensor.shape[0] != rows or end - first > param.shape[0]:
        return None
    return param.narrow(0, 0, end - first), tensor.narrow(0, first, end - first)


class KernelTarget:
    """Stands in for the model during a kernel-format update: ``load_weights`` copies each tensor into the
    model's parameter of that name (shape and dtype must match: a wrong plan fails before writing). One per
    engine worker, kept across syncs (vLLM's NCCL engine keys the metadata it reuses by the object it loads into).
    A worker of a TP engine (``tp`` > 1) given every rank's pieces side by side takes piece ``tp_rank`` along the
    one dimension that is ``tp`` times the parameter's; a padded vocabulary (``vocab_slices``) given the HF
    tensor whole copies the rows it holds and leaves the padding."""

    def __init__(self, model: torch.nn.Module, tp: int = 1, tp_rank: int = 0) -> None:
        self.model = model
        self.params: dict[str, torch.Tensor] = dict(model.named_parameters())
        self.vocab = vocab_slices(model)
        self.tp, self.tp_rank = tp, tp_rank
        self.loaded = 0

    def own_piece(self, tensor: torch.Tensor, param: torch.Tensor) -> torch.Tensor | None:
        """This worker's piece of ``tensor`` (a view) where it holds every rank's piece of ``param``, else None."""
        if self.tp == 1 or tensor.dim() != param.dim():
            return None
        grown = [d for d in range(tensor.dim()) if tensor.shape[d] != param.shape[d]]
        if len(grown) != 1 or tensor.shape[grown[0]] != param.shape[grown[0]] * self.tp:
            return None
        size = param.shape[grown[0]]
        return tensor.narrow(grown[0], self.tp_rank * size, size)

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Check every tensor of the chunk, then copy them all in one multi-tensor copy (a chunk that fails a check
        writes nothing)."""
        names, dst, src = set(), [], []
        for name, tensor in weights:
            param = self.params.get(name)
            if param is None:
                raise direct.not_a_parameter(name)
            if tuple(param.shape) != tuple(tensor.shape):
                padded = vocab_rows(self.vocab, name, tensor, param)
                if padded is not None and param.dtype == tensor.dtype:
                    param, tensor = padded
                else:
                    piece = self.own_piece(tensor, param)
                    tensor = tensor if piece is None else piece
            if tuple(param.shape) != tuple(tensor.shape) or param.dtype != tensor.dtype:
                raise ValueError(f"kernel-format weight {name!r} is {list(tensor.shape)} {tensor.dtype}; the "
                                 f"engine's parameter is {list(param.shape)} {param.dtype}")
            dst.append(param)
            src.append(tensor)
            names.add(name)
        if dst:
            torch._foreach_copy_(dst, src, non_blocking=True)
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
            self._kernel_target = KernelTarget(self.model, *tp_position())  # type: ignore[attr-defined]
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


def tp_position() -> tuple[int, int]:
    """(tensor-parallel size, this worker's rank in it); (1, 0) outside an engine's model-parallel groups."""
    try:
        from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size

        return int(get_tensor_model_parallel_world_size()), int(get_tensor_model_parallel_rank())
    except (AssertionError, ImportError, RuntimeError):  # groups not initialised (no engine in this process)
        return 1, 0


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


class RlhfNCCLWeightTransferEngine(KernelFormatMixin, NCCLWeightTransferEngine):
    """vLLM's ``nccl`` worker engine with the kernel-format switch; in the kernel format, not packed, the direct
    sync (``weight_sync.direct``; trainer side ``DirectNCCLTrainerEngine``). ``direct_plan`` keeps the receive
    plan of the last metadata (vLLM's trainer sends the metadata only when it changed)."""

    direct_plan: Any = None
    _direct_key: Any = None

    def receive_weights(self, update_info: Any) -> None:
        if not (self._kernel_active and not self.packed):
            super().receive_weights(update_info)
            return
        if self.model_update_group is None:
            raise RuntimeError("NCCL weight transfer not initialized. Call init_transfer_engine() first.")
        target = self._kernel_target
        key = (tuple(update_info.names), tuple(update_info.dtype_names), tuple(map(tuple, update_info.shapes)),
               id(target))
        if update_info.names and key != self._direct_key:
            self.direct_plan = direct.plan(target, list(update_info.names), list(update_info.dtype_names),
                                           [list(s) for s in update_info.shapes], self.packed_buffer_size_bytes,
                                           self.device)
            self._direct_key = key
        elif not update_info.names and (self.direct_plan is None or self._direct_key[-1] != id(target)):
            raise RuntimeError("a direct NCCL update without metadata, and none received before")
        # on the current stream, which the next forward runs on (vLLM's update_weights synchronizes after this)
        direct.receive(self.direct_plan, target, self.model_update_group, _current_stream())
        target.loaded += self.direct_plan.direct


class DirectNCCLTrainerEngine(NCCLTrainerWeightTransferEngine):
    """vLLM's NCCL trainer engine; with ``direct`` set (the sender sets it: NCCL, kernel format, not packed) its
    broadcast is ``weight_sync.direct.send`` (one group per bucket, the tensors as they are), the engines'
    ``RlhfNCCLWeightTransferEngine`` receiving into their parameters. Otherwise vLLM's own."""

    direct: bool = False

    def _broadcast(self, source: Any, meta: list[Any]) -> None:
        if not (self.direct and self.is_sender and not self.packed):
            super()._broadcast(source, meta)
            return
        assert self.model_update_group is not None, "trainer_init() must be called before _broadcast()."
        sizes = direct.entry_bytes([m.shape for m in meta], [m.dtype for m in meta])
        direct.send(self._checked_iter(source, meta), sizes, self.model_update_group, self.packed_buffer_size_bytes,
                    _current_stream())


def _current_stream() -> Any:
    """The current CUDA stream; None without CUDA (the communicators of the CPU tests take no stream)."""
    return torch.cuda.current_stream() if torch.cuda.is_available() else None


class ResidentCopy:
    """Engine side of the resident IPC sync (``producers.ResidentExport``): maps the trainer's parameters once per
    ``generation`` and copies them all into the engine's parameters in one multi-tensor copy per sync.
    ``resident``: ``{"generation", "entries": [[engine name, [{GPU UUID: rebuild_cuda_tensor args} per part]]]}``;
    a fused parameter's parts fill its rows in order. A new generation drops the old mapping first (releasing the
    trainer's refcounts) and checks every destination before anything is written."""

    def __init__(self, rebuild: Callable[..., torch.Tensor] | None = None) -> None:
        if rebuild is None:
            from torch.multiprocessing.reductions import rebuild_cuda_tensor as rebuild
        self.rebuild = rebuild
        self.generation: str | None = None
        self.dst: list[torch.Tensor] = []
        self.src: list[torch.Tensor] = []

    def close(self) -> None:
        self.generation, self.dst, self.src = None, [], []

    def _map(self, resident: dict[str, Any], params: dict[str, torch.Tensor], uuid: str, index: int,
             vocab: dict[str, tuple[int, int, int]]) -> None:
        self.close()
        dst: list[torch.Tensor] = []
        src: list[torch.Tensor] = []
        for name, handles in resident["entries"]:
            param = params.get(name)
            if param is None:
                raise KeyError(f"resident IPC: {name!r} is not a parameter of the engine's model")
            parts = [self.rebuild(*local_args(h, uuid, index, "resident IPC")) for h in handles]
            padded = vocab_rows(vocab, name, parts[0], param) if len(parts) == 1 else None
            if len(parts) == 1 and tuple(parts[0].shape) == tuple(param.shape):
                views = [param]
            elif padded is not None:  # a padded vocabulary: this worker's rows
                views, parts = [padded[0]], [padded[1]]
            else:
                rows = param.view(-1, *parts[0].shape[1:]) if parts[0].dim() > 0 else param.view(-1)
                if sum(p.shape[0] for p in parts) != rows.shape[0]:
                    raise ValueError(f"resident IPC: the parts of {name!r} ({[list(p.shape) for p in parts]}) do "
                                     f"not fill the engine's parameter {list(param.shape)}")
                views, r = [], 0
                for p in parts:
                    views.append(rows[r : r + p.shape[0]])
                    r += p.shape[0]
            for v, p in zip(views, parts):
                if tuple(v.shape) != tuple(p.shape) or v.dtype != p.dtype:
                    raise ValueError(f"resident IPC: a part of {name!r} is {list(p.shape)} {p.dtype}; the engine's "
                                     f"parameter takes {list(v.shape)} {v.dtype} there")
            dst += views
            src += parts
        self.dst, self.src, self.generation = dst, src, resident["generation"]

    @torch.no_grad()
    def load(self, resident: dict[str, Any], params: dict[str, torch.Tensor], uuid: str, index: int,
             vocab: dict[str, tuple[int, int, int]] | None = None) -> int:
        """Copy the trainer's parameters into ``params``; returns the tensors copied. A message without ``entries``
        names a generation this engine must hold. ``vocab``: ``vocab_slices`` (they take their rows)."""
        if resident.get("generation") != self.generation:
            if "entries" not in resident:
                self.close()
                raise RuntimeError(f"resident IPC: this engine holds no mapping of generation "
                                   f"{resident.get('generation')!r} (it holds {self.generation!r}); the trainer "
                                   "sends the handles again after a failed sync or a new weight-sync group")
            self._map(resident, params, uuid, index, vocab or {})
        if self.dst:
            torch._foreach_copy_(self.dst, self.src, non_blocking=True)
        return len(self.dst)


@dataclass
class RlhfIPCWeightTransferUpdateInfo(IPCWeightTransferUpdateInfo):
    """vLLM's IPC update info plus ``resident`` (``ResidentCopy.load``'s message; the others then empty)."""

    resident: dict[str, Any] | None = None


class RlhfIPCWeightTransferEngine(KernelFormatMixin, IPCWeightTransferEngine):
    """vLLM's ``ipc`` worker engine with the kernel-format switch and the resident sync (``ResidentCopy``). A packed
    kernel-format chunk is copied straight from the trainer's buffer (``packed_views``), without the clone of
    every tensor vLLM's consumer makes for its layerwise reload: ``KernelTarget`` keeps nothing, and vLLM's
    ``update_weights`` waits for the device before answering, so the trainer refills its buffer after the copy."""

    update_info_cls = RlhfIPCWeightTransferUpdateInfo
    _resident: ResidentCopy | None = None

    def receive_weights(self, update_info: Any) -> None:
        resident = getattr(update_info, "resident", None)
        importer = getattr(self, "_packed_importer", None)  # vLLM's one mapping per trainer buffer
        if resident is None and not (self._kernel_active and self.packed and importer is not None):
            super().receive_weights(update_info)
            return
        if not self._kernel_active:
            raise RuntimeError("a resident IPC update needs the kernel format (the engine's own parameters)")
        target, index = self._kernel_target, self.device.index
        assert target is not None
        uuid = str(torch.cuda.get_device_properties(index).uuid)
        if resident is None:
            target.load_weights(packed_views(update_info, uuid, index, importer))
            return
        self._resident = self._resident or ResidentCopy()
        target.loaded += self._resident.load(resident, target.params, uuid, index, target.vocab)

    def finish_weight_update(self) -> None:
        kernel = self._kernel_active
        super().finish_weight_update()
        importer = getattr(self, "_packed_importer", None)
        if kernel and importer is not None:
            # release the trainer's buffer, as vLLM's own finish does, so its post-send ipc_collect can free it
            importer.close()

    def shutdown(self) -> None:
        if self._resident is not None:  # the trainer's parameters stay mapped between syncs until here
            self._resident.close()
        super().shutdown()


def local_args(handles: dict[str, Any], uuid: str, device_index: int, what: str) -> list[Any]:
    """The ``rebuild_cuda_tensor`` args of the handle for this engine's GPU (``uuid``, vLLM's handle format
    ``{GPU UUID: args}``), with the device set to this process's index of that GPU (``device_index``)."""
    if uuid not in handles:
        raise ValueError(f"{what}: no handle for this engine's GPU UUID {uuid}; the trainer sent handles for "
                         f"{list(handles)} (ipc needs the trainer colocated with the engine)")
    args = list(handles[uuid])
    args[6] = device_index  # rebuild_cuda_tensor's device argument
    return args


def packed_views(update_info: Any, uuid: str, device_index: int, importer: Any) -> list[tuple[str, torch.Tensor]]:
    """The named tensors of one packed IPC chunk as views of the trainer's buffer (vLLM's ``packed_ipc_consumer``
    without its clones), mapped by ``importer`` (vLLM's ``PackedBufferImporter``: once per trainer buffer)."""
    from vllm.distributed.weight_transfer.packed_tensor import unpack_tensor

    if update_info.tensor_sizes is None:
        raise ValueError("`tensor_sizes` is required when packed=True")
    args = local_args(update_info.ipc_handles, uuid, device_index, "packed IPC")
    packed = importer.rebuild(args)[: sum(update_info.tensor_sizes)]
    dtypes = [getattr(torch, d) for d in update_info.dtype_names]
    return unpack_tensor(packed, update_info.names, update_info.shapes, dtypes, update_info.tensor_sizes)
