"""Producers: what the trainer sends, and the trainer side of the resident IPC sync.

* ``ParamSource``: the trainer's weights as a re-iterable ``(name, tensor)`` stream in the checkpoint (HF) format:
  ``named_parameters(remove_duplicate=False)`` (a tied ``lm_head.weight`` under its second name too, or vLLM's
  layerwise reload would keep the engine's old value), FSDP2 shards gathered (collectives: every rank iterates),
  fused HF MoE experts split per expert (``infra.moe``), cast to the spec dtype;
* ``FusedParts``: a fused engine parameter as its parts side by side (``KernelPlan.iterate(fuse=False)``);
* ``ResidentExport`` / ``cuda_ipc_export``: the resident IPC sync's trainer side.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import torch

from rlhf_runtime.infra import moe
from rlhf_runtime.infra.fsdp_gather import gather_shard0, shard0_mesh
from rlhf_runtime.vllm import compat as vllm_compat


class FusedParts(list):
    """A fused engine parameter as the parts that, side by side, are its memory layout, and its ``shape``."""

    def __init__(self, parts: list[torch.Tensor], shape: list[int]) -> None:
        super().__init__(parts)
        self.shape = shape


#: Gathered bytes (in the sync's dtype) per all-gather of FSDP2 shards (``gather_shard0``); what the gather adds to
#: the trainer's memory while it runs.
GATHER_BUCKET_BYTES = 256 << 20


def across_streams(names: list[str], fulls: list[torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` pairs of one gathered bucket for a consumer that may take them on another CUDA stream
    (vLLM's packed producers pack on streams of their own): that stream waits for the copies and keeps their
    memory alive. Start it on the stream the copies ran on (the first ``next`` records their event)."""
    made_on = torch.cuda.current_stream() if fulls and fulls[0].is_cuda else None
    ready = torch.cuda.Event() if made_on is not None else None
    if ready is not None:
        ready.record(made_on)
    for name, full in zip(names, fulls, strict=True):
        if ready is not None:
            now = torch.cuda.current_stream()
            if now != made_on:
                now.wait_event(ready)
                full.record_stream(now)
        yield name, full


class ParamSource:
    """The trainer's weights as a re-iterable ``(name, tensor)`` stream with matching ``metadata()``."""

    def __init__(self, model: torch.nn.Module, dtype: torch.dtype, skip: set[str] | None = None,
                 gather_bucket_bytes: int = GATHER_BUCKET_BYTES) -> None:
        self.model, self.dtype, self.skip = model, dtype, skip or set()
        #: bytes per all-gather of consecutive dim-0 shards (``gather_shard0``); 0: one ``full_tensor()`` each
        self.gather_bucket_bytes = gather_bucket_bytes
        #: names yielded as this rank's FSDP2 shard (``to_local()``) instead of gathered, and names not yielded at
        #: all (``unneeded``): the same sets on every rank (``senders.agreed_gathers``)
        self.local: set[str] = set()
        self.drop: set[str] = set()
        #: the last iteration's gather seconds, tensors gathered, all-gathers and bytes yielded
        self.gather_s, self.gathers, self.collectives, self.bytes = 0.0, 0, 0, 0

    def _named(self) -> list[tuple[str, torch.Tensor]]:
        return [(n, p) for n, p in self.model.named_parameters(remove_duplicate=False) if n not in self.skip]

    def wire_shapes(self) -> list[tuple[str, tuple[int, ...]]]:
        """Names and shapes as sent: fused HF MoE experts appear per expert (``moe.unfused_shapes``)."""
        return [pair for n, p in self._named() for pair in moe.unfused_shapes(n, tuple(p.shape))]

    def metadata(self) -> list[Any]:
        """vLLM's ``ParamMeta`` per tensor as sent (vLLM >= 0.28)."""
        return [vllm_compat.param_meta(n, self.dtype, shape) for n, shape in self.wire_shapes()]

    def local_candidates(self, tp: int, tp_rank: int) -> set[str]:
        """Names whose FSDP2 shard on this rank is exactly piece ``tp_rank`` of ``tp`` along dim 0 (what a TP engine
        worker holds of a column- or vocabulary-parallel weight); not fused MoE tensors (split per expert when
        sent). Differs by rank: the ranks agree on a set before using it (``senders.agreed_gathers``)."""
        out = set()
        for name, p in self._named():
            mesh = shard0_mesh(p)
            if mesh is None or mesh.size() != tp or p.shape[0] % tp or moe.is_fused_expert(name, len(p.shape)):
                continue
            if mesh.get_local_rank() == tp_rank and p.to_local().shape[0] == p.shape[0] // tp:
                out.add(name)
        return out

    def unneeded(self, used: set[str]) -> set[str]:
        """Parameter names none of whose tensors as sent (``wire_shapes``) is in ``used``: a plan that takes only
        ``used`` can leave them out, gathers and all."""
        return {n for n, p in self._named() if not any(w in used for w, _ in moe.unfused_shapes(n, tuple(p.shape)))}

    def _gathered(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The stream in ``_named`` order; runs of dim-0 shards of one mesh gathered together (``gather_shard0``), up
        to ``gather_bucket_bytes`` each: the buckets depend only on names, shapes and placements (every rank's)."""
        bucket: list[tuple[str, Any]] = []
        bucket_mesh, bucket_bytes = None, 0
        element = torch.empty((), dtype=self.dtype).element_size()

        def flush() -> Iterator[tuple[str, torch.Tensor]]:
            nonlocal bucket, bucket_mesh, bucket_bytes
            if not bucket:
                return
            t = time.perf_counter()
            with torch.no_grad():
                fulls = gather_shard0([p for _, p in bucket], bucket_mesh, self.dtype)
            self.collectives += 1
            self.gathers += len(bucket)
            self.gather_s += time.perf_counter() - t
            names = [n for n, _ in bucket]
            bucket, bucket_mesh, bucket_bytes = [], None, 0
            yield from across_streams(names, fulls)

        for name, p in self._named():
            if name in self.drop:
                continue
            mesh = shard0_mesh(p) if self.gather_bucket_bytes > 0 and name not in self.local else None
            if mesh is not None:
                size = p.numel() * element
                if bucket and (mesh != bucket_mesh or bucket_bytes + size > self.gather_bucket_bytes):
                    yield from flush()
                bucket.append((name, p))
                bucket_mesh, bucket_bytes = mesh, bucket_bytes + size
                continue
            yield from flush()
            t = time.perf_counter()
            if name in self.local:
                full = p.to_local()
            elif callable(getattr(p, "full_tensor", None)):
                # cast the shard, then gather: float32 masters travel in the sync's dtype (half the bytes)
                full = p.detach().to(self.dtype).full_tensor()
                self.gathers += 1
                self.collectives += 1
            else:
                full = p
            tensor = full.detach().to(self.dtype).contiguous()
            self.gather_s += time.perf_counter() - t
            yield name, tensor
        yield from flush()

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        self.gather_s, self.bytes, self.gathers, self.collectives = 0.0, 0, 0, 0
        for name, tensor in moe.unfuse(self._gathered()):
            self.bytes += tensor.numel() * tensor.element_size()
            yield name, tensor

    def as_weight_source(self) -> Any:
        """This source in vLLM's ``WeightSource`` form (``vllm_compat.as_weight_source``)."""
        return vllm_compat.as_weight_source(self.metadata, lambda: iter(self))


def cuda_ipc_export(tensor: torch.Tensor) -> dict[str, tuple]:
    """``{physical GPU UUID: rebuild_cuda_tensor args}`` for ``tensor``, the handle format of vLLM's IPC
    consumer. Each export pairs with one rebuild-and-release on the engine (torch's cross-process refcount)."""
    from torch.multiprocessing.reductions import reduce_tensor

    uuid = str(torch.cuda.get_device_properties(tensor.device).uuid)
    return {uuid: reduce_tensor(tensor)[1]}


class ResidentExport:
    """Trainer side of the resident IPC sync (kernel format, one trainer worker, engines on its GPU): every tensor
    of the plan, a view of a trainer parameter, is exported once (``cuda_ipc_export``); the first sync of a
    ``generation`` sends the handles, later ones only the generation, and each engine worker copies the whole
    model in one multi-tensor copy (``kernel.ResidentCopy``), synchronously. ``message`` is None, with ``reason``,
    where a tensor is not such a view (a cast, a gathered shard): the sender takes vLLM's path. A parameter's
    storage that moved (a checkpoint loaded by assignment) exports again."""

    def __init__(self, plan: Any, source: ParamSource, export: Any = None, device_type: str = "cuda") -> None:
        self.plan, self.source = plan, source
        self.export = export or cuda_ipc_export
        self.device_type = device_type  # where the parameters must be (CUDA IPC); tests run the logic on CPU
        self.bytes = 0
        self.generation = ""
        self.exports = 0
        self.reason = ""
        self._signature: tuple[int, ...] | None = None
        self._message: dict[str, Any] | None = None
        self._params: list[torch.Tensor] | None = None
        self._delivered = False

    def views(self) -> list[tuple[str, list[torch.Tensor]]] | None:
        """The plan's tensors as (engine name, parts) when every part is a view of a trainer parameter on its
        GPU, else None (``reason`` says why). Iterates the plan once (no gather: one trainer worker)."""
        if not getattr(self.plan, "ok", False):
            self.reason = "no kernel plan"
            return None
        storages = {p.untyped_storage().data_ptr() for p in self._parameters()}
        entries: list[tuple[str, list[torch.Tensor]]] = []
        for name, t in self.plan.iterate(self.source, fuse=False):
            parts = list(t) if isinstance(t, list) else [t]
            for p in parts:
                if p.device.type != self.device_type or p.untyped_storage().data_ptr() not in storages:
                    self.reason = (f"{name}: the tensor sent is not a view of a trainer parameter on its GPU (a "
                                   "cast to the spec dtype, a gathered shard or a copied piece)")
                    return None
            entries.append((name, parts))
        self.reason = f"{len(entries)} engine parameters mapped from the trainer's parameters"
        return entries

    def signature(self) -> tuple[int, ...]:
        """Where the parameters' data are now (``p.data = ...`` or ``model.to`` moves them); the parameter objects
        are listed once, not the module tree walked every sync."""
        return tuple(p.data_ptr() for p in self._parameters())

    def _parameters(self) -> list[torch.Tensor]:
        if self._params is None:
            self._params = list(self.source.model.parameters())
        return self._params

    def message(self) -> dict[str, Any] | None:
        """What a sync sends (``resident`` of the engines' update info): the generation and, until ``delivered``
        after an export, per engine parameter the handles of its parts; None where the plan's tensors are not
        views of the parameters."""
        sig = self.signature()
        if sig != self._signature:
            import uuid

            self._signature, self._message, self._delivered = sig, None, False
            entries = self.views()
            if entries is not None:
                self.generation = uuid.uuid4().hex
                self.bytes = sum(p.numel() * p.element_size() for _, parts in entries for p in parts)
                self._message = {"generation": self.generation,
                                 "entries": [[name, [self.export(p) for p in parts]] for name, parts in entries]}
                self.exports += 1
        if self._message is not None and self._delivered:
            return {"generation": self.generation}
        return self._message

    def delivered(self, ok: bool = True) -> None:
        """After a sync: ``ok``, every engine has mapped the generation (later messages omit the handles); not
        ``ok``, the next message carries them again."""
        self._delivered = ok and self._message is not None
