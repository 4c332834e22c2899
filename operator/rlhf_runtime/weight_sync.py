"""Trainer -> engines weight sync through vLLM's native weight-transfer API, one interface for two vLLMs.

Runs in the trainer process (rank 0 is the sender). ``make_sender(...)`` returns a ``Sender`` with
``send() -> dict`` (stage timings and bytes) whatever the installed vLLM:

* vLLM >= 0.28 (CPU CI: 0.32): the trainer-side ``TrainerWeightTransferEngine`` of the backend
  (``WeightTransferTrainerFactory.trainer_init(init_info, client=..., source=...)``) drives the round trip
  ``start_weight_update`` -> ``update_weights`` (concurrent with the broadcast) -> ``finish_weight_update``;
* vLLM 0.24 (GPU image): no trainer engine exists, so ``LegacySender`` drives the same round trip itself
  (``start_weight_update(is_checkpoint_format=True)`` is added by the engine actor, which checks the
  signature) and sends with ``NCCLWeightTransferEngine.trainer_send_weights`` / ``IPCWeightTransferEngine``.

The control plane is ``EngineFanOut``: a ``VLLMWeightSyncClient`` over the engines' Ray actors. It gives each
engine its own ``rank_offset`` (``1 + the world sizes of the engines before it``), because each engine is a
separate vLLM instance whose workers count ranks from 0, and it times every call.

Which tensors are sent (``ParamSource``): ``named_parameters(remove_duplicate=False)``, so a tied
``lm_head.weight`` goes out under its second name too (vLLM's layerwise reload would otherwise keep the
engine's old value), cast to the spec dtype; ``skip`` drops names on purpose (the validation debug option).
"""

from __future__ import annotations

import functools
import inspect
import math
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from typing import Any

import torch

from rlhf_runtime import moe


def vllm_has_trainer_api() -> bool:
    try:
        from vllm.distributed.weight_transfer.base import TrainerWeightTransferEngine  # noqa: F401
    except ImportError:
        return False
    return True


class EngineFanOut:
    """``VLLMWeightSyncClient`` over engine actors (``rlhf_runtime.engines``), with per-engine rank offsets."""

    def __init__(self, handles: list[Any], worlds: list[int], timeout_s: float | None = None) -> None:
        self.handles = handles
        self.worlds = worlds
        self.timeout_s = timeout_s  # spec.weightSync.timeoutSeconds: no engine call waits longer
        self.timings: dict[str, float] = {}

    def get(self, refs: Any, method: str) -> Any:
        """``ray.get`` bounded by ``timeout_s``; a timeout names the call and the engines."""
        import ray
        from ray.exceptions import GetTimeoutError

        try:
            return ray.get(refs, timeout=self.timeout_s)
        except GetTimeoutError:
            raise TimeoutError(
                f"engine call {method} on {len(self.handles)} engine(s) did not finish within "
                f"weightSync.timeoutSeconds={self.timeout_s:g}s"
            ) from None

    def _all(self, method: str, args: list[tuple]) -> None:
        t = time.perf_counter()
        self.get([getattr(h, method).remote(*a) for h, a in zip(self.handles, args)], method)
        self.timings[method] = self.timings.get(method, 0.0) + time.perf_counter() - t

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        infos, offset = [], 1
        for w in self.worlds:
            info = dict(init_info)
            if "rank_offset" in info:
                info["rank_offset"] = offset
            infos.append((info,))
            offset += w
        self._all("init_weight_transfer_engine", infos)

    def start_weight_update(self, checkpoint_format: bool = True) -> None:
        self._all("start_weight_update", [(checkpoint_format,)] * len(self.handles))

    def update_weights(self, update_info: Any) -> None:
        self._all("update_weights", [(update_info,)] * len(self.handles))

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self._all("finish_weight_update", [()] * len(self.handles))

    def update_weights_nowait(self, update_info: Any, round_trip: bool = False) -> list[Any]:
        """``update_weights`` (or, ``round_trip``, the whole ``update_weights_round`` in the kernel format) on
        every engine without waiting: the Ray refs to wait on before the chunk's buffer is reused."""
        if round_trip:
            return [h.update_weights_round.remote(update_info, False) for h in self.handles]
        return [h.update_weights.remote(update_info) for h in self.handles]

    def update_round(self, update_info: Any, checkpoint_format: bool = True) -> None:
        """start -> update -> finish in one actor call per engine (one Ray round trip instead of three); the
        engines' own stage times are recorded as the three calls' (the slowest engine's)."""
        t = time.perf_counter()
        stages = self.get([h.update_weights_round.remote(update_info, checkpoint_format) for h in self.handles],
                          "update_weights_round")
        self.record_rounds(stages, time.perf_counter() - t)

    def record_rounds(self, stages: list[dict[str, float]], wall: float) -> None:
        """Book ``update_weights_round`` results (the engines' own stage seconds) as the three calls' times:
        start and finish of the slowest engine, the rest of ``wall`` as ``update_weights``."""
        start, finish = max(st["start_s"] for st in stages), max(st["finish_s"] for st in stages)
        for method, seconds in (("start_weight_update", start), ("update_weights", wall - start - finish),
                                ("finish_weight_update", finish)):
            self.timings[method] = self.timings.get(method, 0.0) + seconds

    def engine_params(self) -> dict[str, Any]:
        """The first engine's own parameters (name, shape), fused-module mapping and world size."""
        return self.get(self.handles[0].param_layout.remote(), "param_layout")


class ParamSource:
    """The trainer's weights as a re-iterable ``(name, tensor)`` stream with matching ``metadata()``."""

    def __init__(self, model: torch.nn.Module, dtype: torch.dtype, skip: set[str] | None = None) -> None:
        self.model = model
        self.dtype = dtype
        self.skip = skip or set()
        self.gather_s = 0.0
        self.bytes = 0

    def _named(self) -> list[tuple[str, torch.Tensor]]:
        return [(n, p) for n, p in self.model.named_parameters(remove_duplicate=False) if n not in self.skip]

    def _wire_shapes(self) -> list[tuple[str, tuple[int, ...]]]:
        """Names and shapes as sent: fused HF MoE experts appear per expert (``moe.unfused_shapes``)."""
        return [pair for n, p in self._named() for pair in moe.unfused_shapes(n, tuple(p.shape))]

    def metadata(self) -> list[Any]:
        from vllm.distributed.weight_transfer.base import ParamMeta

        return [ParamMeta(n, self.dtype, shape) for n, shape in self._wire_shapes()]

    def legacy_metadata(self) -> tuple[list[str], list[str], list[list[int]]]:
        wire = self._wire_shapes()
        return [n for n, _ in wire], [str(self.dtype).split(".")[-1]] * len(wire), [list(s) for _, s in wire]

    def _gathered(self):
        for name, p in self._named():
            t = time.perf_counter()
            full = p.full_tensor() if callable(getattr(p, "full_tensor", None)) else p
            tensor = full.detach().to(self.dtype).contiguous()
            self.gather_s += time.perf_counter() - t
            yield name, tensor

    def __iter__(self):
        self.gather_s, self.bytes = 0.0, 0
        for name, tensor in moe.unfuse(self._gathered()):
            self.bytes += tensor.numel() * tensor.element_size()
            yield name, tensor

    # vLLM >= 0.28 WeightSource extras (defaults copied in behaviour: one group per decoder layer).
    def held_names(self) -> None:
        return None

    def groups(self) -> list[list[str]]:
        from vllm.distributed.weight_transfer.base import layerwise_groups

        return layerwise_groups([n for n, _ in self._wire_shapes()])


def _as_weight_source(src: ParamSource) -> Any:
    """Wrap in vLLM's ``WeightSource`` ABC when it exists (some engines type-check it)."""
    try:
        from vllm.distributed.weight_transfer.base import WeightSource
    except ImportError:
        return src

    if hasattr(WeightSource, "iter_full"):
        # vLLM >= 0.33: ``metadata`` is a cached property (checked when the class is made) and engines that
        # consume whole tensors (broadcast, IPC) read ``iter_full()``; every rank owns every name (owners None).
        class _SourceFull(WeightSource):
            @functools.cached_property
            def metadata(self) -> list[Any]:
                return src.metadata()

            def iter_full(self):
                return iter(src)

        return _SourceFull()

    class _Source(WeightSource):
        def metadata(self) -> list[Any]:
            return src.metadata()

        def __iter__(self):
            return iter(src)

    return _Source()


class Sender:
    backend: str
    source: ParamSource
    client: EngineFanOut

    def send(self) -> dict[str, float]:
        raise NotImplementedError

    def _result(self, wall: float) -> dict[str, float]:
        t = self.client.timings
        return {
            "start_s": t.get("start_weight_update", 0.0),
            "transfer_s": t.get("update_weights", 0.0),
            "gather_s": self.source.gather_s,
            "finish_s": t.get("finish_weight_update", 0.0),
            "send_s": wall,
            "bytes": float(self.source.bytes),
        }


class TrainerEngineSender(Sender):
    """vLLM >= 0.28: the backend's ``TrainerWeightTransferEngine`` drives the round trip."""

    def __init__(self, backend: str, client: EngineFanOut, source: ParamSource, init: dict[str, Any]) -> None:
        from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

        self.backend, self.client, self.source = backend, client, source
        if backend == "gloo":
            from rlhf_runtime.gloo_transfer import GlooTrainerInitInfo

            info: Any = GlooTrainerInitInfo(
                master_address=init["master_address"], master_port=init["master_port"],
                world_size=init["world_size"], packed=init["packed"],
                packed_buffer_size_bytes=init["bucket_bytes"], rank=init.get("rank", 0),
                **({"timeout_seconds": init["timeout_s"]} if init.get("timeout_s") else {}),
            )
        elif backend == "nccl":
            from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo

            info = NCCLTrainerInitInfo(
                master_address=init["master_address"], master_port=init["master_port"],
                world_size=init["world_size"], packed=init["packed"],
                packed_buffer_size_bytes=init["bucket_bytes"], rank=init.get("rank", 0),
            )
        elif backend == "ipc":
            from vllm.distributed.weight_transfer.ipc_engine import IPCTrainerInitInfo

            info = IPCTrainerInitInfo(packed=init["packed"], packed_buffer_size_bytes=init["bucket_bytes"], rank=init.get("rank", 0))
        else:
            raise ValueError(f"unknown weight-transfer backend {backend!r}")
        self.engine = WeightTransferTrainerFactory.trainer_init(info, client=client, source=_as_weight_source(source))

    def send(self) -> dict[str, float]:
        self.client.timings = {}
        t = time.perf_counter()
        self.engine.send_weights()
        return self._result(time.perf_counter() - t)


#: Default sender options of the vLLM 0.24 path (``LegacySender.configure`` changes them per trainer);
#: ``RLHF_WEIGHT_SYNC_FORMAT`` / ``RLHF_WEIGHT_SYNC_PRODUCER`` / ``RLHF_WEIGHT_SYNC_RPC`` in the trainer's
#: environment override them.
#: The kernel format is the default since it passed the fresh-engine validation on GPUs (NCCL 1.7B with
#: 3 engines, IPC 0.5B; ``benchmarks/README.md``); it falls back to the checkpoint format by itself where
#: its plan does not apply (TP>1 engines, several IPC trainer ranks, expert parallelism). One RPC per engine
#: and sync since it validated on NCCL 1.7B (17.9 ms vs 23.5 ms with three, same run).
DEFAULT_OPTIONS: dict[str, Any] = {"producer": "runtime", "format": "kernel", "rpc": "one"}


def _env_options() -> dict[str, Any]:
    out = dict(DEFAULT_OPTIONS)
    fmt = os.environ.get("RLHF_WEIGHT_SYNC_FORMAT")
    producer = os.environ.get("RLHF_WEIGHT_SYNC_PRODUCER")
    if fmt:
        if fmt not in ("checkpoint", "kernel"):
            raise ValueError(f"RLHF_WEIGHT_SYNC_FORMAT must be checkpoint or kernel, not {fmt!r}")
        out["format"] = fmt
    if producer:
        if producer not in ("vllm", "runtime"):
            raise ValueError(f"RLHF_WEIGHT_SYNC_PRODUCER must be vllm or runtime, not {producer!r}")
        out["producer"] = producer
    rpc = os.environ.get("RLHF_WEIGHT_SYNC_RPC")
    if rpc:
        if rpc not in ("one", "three"):
            raise ValueError(f"RLHF_WEIGHT_SYNC_RPC must be one or three, not {rpc!r}")
        out["rpc"] = rpc
    return out


class LegacySender(Sender):
    """vLLM 0.24: the runtime drives start -> update (beside the trainer send) -> finish itself.

    Only rank 0 joins the engines' NCCL group and talks to the engines; other FSDP ranks iterate the source
    beside it (``full_tensor()`` is a collective) and, for IPC, contribute their GPU's handles (vLLM
    all-gathers them; rank 0 sends the merged handles to every engine).

    ``options`` (``configure``) pick the NCCL producer and the weight format:

    * ``producer``: ``"runtime"``: ``PackedProducer`` below, persistent double buffers reused across
      syncs, packing of chunk k+1 overlapped with the broadcast of chunk k; ``"vllm"``: vLLM's
      ``packed_nccl_broadcast_producer`` (fresh ``torch.cat`` buffers every chunk). Both produce the wire
      format vLLM's consumer expects (chunks cut after the first tensor that takes them past the bucket).
    * ``rpc``: ``"one"`` (default): a single ``update_weights_round`` call per engine does
      ``start_weight_update``, ``update_weights`` and ``finish_weight_update`` (two Ray round trips fewer per
      sync; NCCL, and IPC when the model fits one bucket); ``"three"``: three separate calls per engine.
    * IPC, single trainer worker, kernel format, packed: ``producer="runtime"`` is ``IPCBufferProducer``
      (persistent buffers, chunks pipelined, ``ipc_wire`` ``"packed"``/``"views"``, ``rpc="one"`` when the
      model fits one bucket); ``producer="vllm"`` is vLLM's ``IPCWeightTransferEngine.trainer_send_weights``.
    * ``format``: ``"checkpoint"``: HF names, loaded through vLLM's layerwise reload;
      ``"kernel"`` (default): the engines' own parameter names and layouts (``KernelPlan``: fused ``qkv_proj`` /
      ``gate_up_proj`` written side by side into the packed buffer), loaded by a plain ``param.copy_``
      (``start_weight_update(is_checkpoint_format=False)``); falls back to ``checkpoint`` when the plan
      does not cover the engine's parameters.

    Defaults (``DEFAULT_OPTIONS``): ``producer=runtime``, ``format=kernel``, ``rpc=one``, the fast path measured in
    ``benchmarks/README.md``; ``RLHF_WEIGHT_SYNC_FORMAT=checkpoint`` / ``RLHF_WEIGHT_SYNC_PRODUCER=vllm``
    (driver environment, passed to the actors) go back to vLLM's own producer and layerwise reload.
    """

    def __init__(self, backend: str, client: EngineFanOut, source: ParamSource, init: dict[str, Any]) -> None:
        self.backend, self.client, self.source, self.init = backend, client, source, init
        self.rank = int(init.get("rank", 0))
        self.is_sender = self.rank == 0
        self.group: Any = None
        self.options: dict[str, Any] = {"producer": DEFAULT_OPTIONS["producer"], "format": "checkpoint"}
        env_options = _env_options()
        self.producer: PackedProducer | None = None
        self.ipc_producer: IPCBufferProducer | None = None
        self.plan: KernelPlan | None = None
        if backend == "nccl":
            if not self.is_sender:
                self.configure(**env_options)  # every rank must iterate the same tensors
                return
            from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferEngine

            worker = {k: init[k] for k in ("master_address", "master_port", "world_size")}
            with ThreadPoolExecutor(max_workers=1) as exe:
                fut = exe.submit(client.init_weight_transfer_engine, {**worker, "rank_offset": 1})
                self.group = NCCLWeightTransferEngine.trainer_init(worker)
                fut.result()
        elif backend == "ipc":
            if self.is_sender:
                client.init_weight_transfer_engine({})
        else:
            raise ValueError(f"backend {backend!r} needs vLLM >= 0.28 (trainer-side weight-transfer engines)")
        self.configure(**env_options)  # the kernel format asks the engines for their layout once, here

    def configure(self, **options: Any) -> dict[str, Any]:
        """Change sender options (``producer``, ``format``, ``rpc``, ``ipc_wire``, ``packed``,
        ``bucket_bytes``) for later syncs."""
        for k in ("packed", "bucket_bytes"):
            if k in options:
                self.init[k] = options.pop(k)
        self.options.update(options)
        if self.options.get("format") == "kernel" and self.plan is None:
            if self.backend == "ipc" and int(self.init.get("trainer_world", 1)) > 1:
                # every IPC rank packs the same chunks; only rank 0 can ask the engines for their layout
                self.plan = KernelPlan([], False, "kernel format with IPC needs a single trainer worker")
            elif self.is_sender:
                self.plan = KernelPlan.build(self.source, self.client.engine_params())
            if self.plan is not None and not self.plan.ok:
                self.options["format"] = "checkpoint"
        return {**self.options, "packed": self.init["packed"], "bucket_bytes": self.init["bucket_bytes"],
                "kernel_plan": None if self.plan is None else self.plan.reason}

    def _kernel(self) -> bool:
        """The kernel format is chosen and its plan covers the engine's parameters."""
        return self.options.get("format") == "kernel" and self.plan is not None and self.plan.ok

    def _runtime_producer(self) -> bool:
        """The runtime packs: ``PackedProducer`` (NCCL) or ``IPCBufferProducer`` (IPC: kernel format only, as
        the engine copies each tensor into its parameter before ``update_weights`` returns so buffers can be
        reused; one trainer worker)."""
        if not (self.init["packed"] and self.options.get("producer", "runtime") == "runtime"):
            return False
        return self.backend == "nccl" or (self._kernel() and int(self.init.get("trainer_world", 1)) == 1)

    def _stream(self) -> tuple[Any, list[str], list[str], list[list[int]]]:
        """(iterator of (name, tensor), names, dtype names, shapes) in the chosen weight format."""
        if self._kernel():
            assert self.plan is not None
            fuse = not self._runtime_producer()  # the runtime's producers write fused parts side by side
            return self.plan.iterate(self.source, fuse=fuse), *self.plan.metadata(self.source.dtype)
        names, dtypes, shapes = self.source.legacy_metadata()
        return iter(self.source), names, dtypes, shapes

    def send(self) -> dict[str, float]:
        self.client.timings = {}
        packed = self.init["packed"]
        kernel = self._kernel()
        t = time.perf_counter()
        if not self.is_sender and self.backend == "nccl":
            for _ in self.source:  # take part in the FSDP gathers; rank 0 sends
                pass
            return self._result(time.perf_counter() - t)
        stream, names, dtypes, shapes = self._stream()
        item = self.source.dtype.itemsize
        self.sent_bytes = sum(math.prod(sh) * item for sh in shapes)
        runtime_producer = self._runtime_producer()
        ipc_runtime = self.backend == "ipc" and runtime_producer
        one_rpc = self.options.get("rpc") == "one" and (
            self.backend == "nccl" or (ipc_runtime and self.sent_bytes <= self.init["bucket_bytes"]))
        if not one_rpc:
            self.client.start_weight_update(checkpoint_format=not kernel)
        if self.backend == "nccl":
            from vllm.distributed.weight_transfer.nccl_engine import (
                NCCLTrainerSendWeightsArgs,
                NCCLWeightTransferEngine,
                NCCLWeightTransferUpdateInfo,
            )

            update: dict[str, Any] = {"names": names, "dtype_names": dtypes, "shapes": shapes, "packed": packed}
            fields = NCCLWeightTransferUpdateInfo.__dataclass_fields__
            if "packed_buffer_size_bytes" in fields:  # both sides must cut the same chunks
                update["packed_buffer_size_bytes"] = self.init["bucket_bytes"]
            exe = ThreadPoolExecutor(max_workers=1)
            try:
                if one_rpc:  # the engines start, receive and finish in one call each
                    fut = exe.submit(self.client.update_round, update, not kernel)
                else:
                    fut = exe.submit(self.client.update_weights, update)
                t0 = time.perf_counter()
                if runtime_producer:
                    if self.producer is None or self.producer.bucket_bytes != self.init["bucket_bytes"]:
                        self.producer = PackedProducer(self.init["bucket_bytes"])
                    self.pack_s = self.producer.send(self.group, stream)
                else:
                    kw: dict[str, Any] = {"group": self.group, "packed": packed}
                    if "packed_buffer_size_bytes" in inspect.signature(NCCLTrainerSendWeightsArgs).parameters:
                        kw["packed_buffer_size_bytes"] = self.init["bucket_bytes"]
                    NCCLWeightTransferEngine.trainer_send_weights(
                        iterator=stream, trainer_args=NCCLTrainerSendWeightsArgs(**kw)
                    )
                    self.pack_s = 0.0
                torch.cuda.synchronize()
                self.trainer_send_s = time.perf_counter() - t0
                fut.result()
            finally:
                exe.shutdown(wait=False)
        elif ipc_runtime:
            if self.ipc_producer is None or self.ipc_producer.bucket_bytes != self.init["bucket_bytes"]:
                self.ipc_producer = IPCBufferProducer(self.init["bucket_bytes"])
            t0 = time.perf_counter()
            stages = self.ipc_producer.send(
                stream, lambda info: self.client.update_weights_nowait(info, round_trip=one_rpc),
                wire=self.options.get("ipc_wire", "packed"),
            )
            self.trainer_send_s = time.perf_counter() - t0
            self.pack_s = self.ipc_producer.pack_s
            if one_rpc:  # the engines' own start/finish times, as EngineFanOut.update_round books them
                self.client.record_rounds(stages, self.trainer_send_s)
            else:
                self.client.timings["update_weights"] = self.trainer_send_s
        else:  # ipc: every rank calls the sender (handles are all-gathered); rank 0 sends to every engine
            from vllm.distributed.weight_transfer.ipc_engine import (
                IPCTrainerSendWeightsArgs,
                IPCWeightTransferEngine,
            )

            def deliver(info: Any) -> None:  # one update_weights per chunk, fanned out to all engines
                self.client.update_weights(asdict(info))

            t0 = time.perf_counter()
            IPCWeightTransferEngine.trainer_send_weights(
                iterator=stream,
                trainer_args=IPCTrainerSendWeightsArgs(
                    send_mode=deliver, packed=packed, packed_buffer_size_bytes=self.init["bucket_bytes"],
                ),
            )
            self.trainer_send_s = time.perf_counter() - t0
            self.pack_s = 0.0
        if not one_rpc:
            self.client.finish_weight_update()
        return self._result(time.perf_counter() - t)

    def _result(self, wall: float) -> dict[str, float]:
        r = super()._result(wall)
        if self.is_sender and getattr(self, "sent_bytes", None) is not None:
            r["bytes"] = float(self.sent_bytes)  # what went over the wire (the kernel format drops aliases)
        r["trainer_send_s"] = getattr(self, "trainer_send_s", 0.0)
        r["pack_s"] = getattr(self, "pack_s", 0.0)
        r["format"] = self.options.get("format", "checkpoint")  # type: ignore[assignment]
        return r


class PackedProducer:
    """Trainer side of vLLM's packed NCCL wire format with two persistent buffers.

    vLLM's consumer (``packed_nccl_broadcast_consumer``) cuts a chunk after the first tensor that takes it
    past ``bucket_bytes`` (or at the end); so does this producer. Buffers are allocated once (grown when a
    chunk needs more) and reused across syncs; chunk k+1 is packed on the copy stream while chunk k is
    broadcast on the NCCL stream, ordered by events.
    """

    def __init__(self, bucket_bytes: int) -> None:
        self.bucket_bytes = bucket_bytes
        self.buffers: list[torch.Tensor] = []
        self.copy_stream: Any = None
        self.comm_stream: Any = None

    def _buffer(self, i: int, size: int) -> torch.Tensor:
        while len(self.buffers) <= i:
            self.buffers.append(torch.empty(0, dtype=torch.uint8, device="cuda"))
        if self.buffers[i].numel() < size:
            self.buffers[i] = torch.empty(size, dtype=torch.uint8, device="cuda")
        return self.buffers[i]

    def send(self, group: Any, stream: Any) -> float:
        """Broadcast every tensor of ``stream`` from rank 0; returns host seconds spent packing."""
        if self.copy_stream is None:
            self.copy_stream, self.comm_stream = torch.cuda.Stream(), torch.cuda.Stream()
        packed_ev = [torch.cuda.Event(), torch.cuda.Event()]
        sent_ev: list[Any] = [None, None]
        pack_s = 0.0
        slot = 0
        pending: list[torch.Tensor] = []
        size = 0
        main = torch.cuda.current_stream()

        def flush(pending: list[torch.Tensor], size: int, slot: int) -> None:
            nonlocal pack_s
            t = time.perf_counter()
            with torch.cuda.stream(self.copy_stream):
                self.copy_stream.wait_stream(main)  # the tensors were produced on the main stream
                if sent_ev[slot] is not None:  # the buffer's previous broadcast must be done
                    self.copy_stream.wait_event(sent_ev[slot])
                buf = self._buffer(slot, size)
                off = 0
                for p in pending:
                    n = p.numel()
                    buf[off : off + n].copy_(p, non_blocking=True)
                    off += n
                    p.record_stream(self.copy_stream)
                packed_ev[slot].record(self.copy_stream)
            pack_s += time.perf_counter() - t
            with torch.cuda.stream(self.comm_stream):
                self.comm_stream.wait_event(packed_ev[slot])
                group.broadcast(buf[:size], src=0, stream=self.comm_stream)
                ev = torch.cuda.Event()
                ev.record(self.comm_stream)
                sent_ev[slot] = ev

        for _, t in stream:
            for part in t if isinstance(t, list) else [t]:  # a fused parameter's parts go side by side
                flat = part.detach().contiguous().view(-1).view(torch.uint8)
                pending.append(flat)
                size += flat.numel()
            if size > self.bucket_bytes:
                flush(pending, size, slot)
                pending, size, slot = [], 0, 1 - slot
        if pending:
            flush(pending, size, slot)
        self.comm_stream.synchronize()
        return pack_s


def cuda_ipc_export(tensor: torch.Tensor) -> dict[str, tuple]:
    """``{physical GPU UUID: rebuild_cuda_tensor args}`` for ``tensor``, the handle format of vLLM's IPC
    consumer. Each export pairs with one rebuild-and-release on the engine (torch's cross-process refcount)."""
    from torch.multiprocessing.reductions import reduce_tensor

    uuid = str(torch.cuda.get_device_properties(tensor.device).uuid)
    return {uuid: reduce_tensor(tensor)[1]}


class IPCBufferProducer:
    """Trainer side of the CUDA-IPC sync in the kernel format with persistent buffers (option
    ``producer="runtime"``, one trainer worker).

    vLLM 0.24's packed IPC sender allocates a fresh buffer every sync (exported once but rebuilt and released
    by the engine per chunk, so the trainer's GPU memory grows by one buffer per sync), waits for each chunk
    before packing the next, and its consumer clones every tensor before copying it into the parameter. Here
    two buffers of ``bucket_bytes`` are allocated once (grown if one tensor is larger) and reused across
    syncs, chunk k+1 is packed while the engines load chunk k, each chunk is exported once per delivery
    (``cuda_ipc_export``: pairs with the engine's one rebuild) and ``torch.cuda.ipc_collect()`` runs once per
    sync. ``wire``:

    * ``"packed"``: vLLM's packed IPC format (one handle per chunk, ``tensor_sizes``); the engine clones each
      tensor out of the buffer, then copies it into the parameter;
    * ``"views"``: vLLM's unpacked format, one handle per tensor, every one a view into the chunk's buffer;
      the engine opens the buffer once per chunk (torch caches storages by handle) and copies each view
      straight into its parameter: one device copy per byte on each side, no clone.

    Only the kernel format may use it: the checkpoint format's layerwise reload keeps references to the
    tensors it was given beyond ``update_weights`` and would read a reused buffer. ``deliver(update_info)``
    sends one chunk to every engine without waiting and returns what to wait on (Ray refs) before the
    chunk's buffer is written again; ``send`` returns the engines' results of every delivery.
    """

    def __init__(self, bucket_bytes: int, export: Any = None, wait: Any = None, device: str = "cuda") -> None:
        self.bucket_bytes = bucket_bytes
        self.export = export or cuda_ipc_export
        self.wait = wait  # default ray.get
        self.device = device
        self.buffers: list[torch.Tensor] = []
        self.pack_s = 0.0
        self.chunks = 0

    def _buffer(self, i: int, size: int) -> torch.Tensor:
        while len(self.buffers) <= i:
            self.buffers.append(torch.empty(0, dtype=torch.uint8, device=self.device))
        if self.buffers[i].numel() < size:
            self.buffers[i] = torch.empty(max(size, self.bucket_bytes), dtype=torch.uint8, device=self.device)
        return self.buffers[i]

    def _wait(self, refs: Any) -> list[Any]:
        if refs is None:
            return []
        if self.wait is not None:
            return list(self.wait(refs))
        import ray

        return list(ray.get(refs))

    def send(self, stream: Any, deliver: Any, wire: str = "packed") -> list[Any]:
        if wire not in ("packed", "views"):
            raise ValueError(f"ipc_wire must be packed or views, not {wire!r}")
        self.pack_s, self.chunks = 0.0, 0
        results: list[Any] = []
        inflight: list[Any] = [None, None]
        slot = 0
        pending: list[tuple[str, list[torch.Tensor]]] = []
        size = 0

        def flush(pending: list[tuple[str, list[torch.Tensor]]], size: int, slot: int) -> None:
            results.extend(self._wait(inflight[slot]))  # the engines are done with this buffer's last chunk
            t = time.perf_counter()
            buf = self._buffer(slot, size)
            names, dtypes, shapes, sizes, views = [], [], [], [], []
            off = 0
            for name, parts in pending:
                start = off
                for p in parts:
                    n = p.numel() * p.element_size()
                    buf[off : off + n].copy_(p.reshape(-1).view(torch.uint8), non_blocking=True)
                    off += n
                dtype = parts[0].dtype
                shape = list(parts[0].shape) if len(parts) == 1 else [
                    sum(p.shape[0] for p in parts), *parts[0].shape[1:]]
                names.append(name)
                dtypes.append(str(dtype).split(".")[-1])
                shapes.append(shape)
                sizes.append(off - start)
                if wire == "views":
                    views.append(buf[start:off].view(dtype).view(shape))
            if buf.device.type == "cuda":
                torch.cuda.current_stream(buf.device).synchronize()  # the engine reads after the handle arrives
            info: dict[str, Any] = {"names": names, "dtype_names": dtypes, "shapes": shapes}
            if wire == "packed":
                info.update(packed=True, tensor_sizes=sizes, ipc_handles=self.export(buf[:off]))
            else:
                info.update(packed=False, ipc_handles=[self.export(v) for v in views])
            self.pack_s += time.perf_counter() - t
            inflight[slot] = deliver(info)
            self.chunks += 1

        for name, t in stream:
            parts = [p.detach() for p in (t if isinstance(t, list) else [t])]
            n = sum(p.numel() * p.element_size() for p in parts)
            if pending and size + n > self.bucket_bytes:  # a chunk never exceeds the bucket (unless one tensor does)
                flush(pending, size, slot)
                pending, size, slot = [], 0, 1 - slot
            pending.append((name, parts))
            size += n
        if pending:
            flush(pending, size, slot)
        for refs in (inflight[1 - slot], inflight[slot]):  # the older chunk first
            results.extend(self._wait(refs))
        if self.device == "cuda":
            torch.cuda.ipc_collect()
        return results


class KernelPlan:
    """HF (checkpoint) tensors -> the engine's own parameters, for ``start_weight_update(False)``.

    For each engine parameter (name, shape, dtype, from the engine): the HF tensor of the same name and
    shape, or the HF tensors whose names substitute a fused module's parts (vLLM's
    ``packed_modules_mapping``: ``qkv_proj`` <- ``q_proj, k_proj, v_proj``; ``gate_up_proj`` <-
    ``gate_proj, up_proj``), concatenated along dim 0 (TP=1: vLLM's fused layout). Packing writes the
    parts side by side, so the fusion costs no extra copy. ``ok`` is False (``reason`` says why) when an
    engine parameter has no such source; the sender then keeps the checkpoint format.
    """

    def __init__(self, entries: list[tuple[str, list[int], list[str]]], ok: bool, reason: str) -> None:
        self.entries, self.ok, self.reason = entries, ok, reason

    @classmethod
    def build(cls, source: ParamSource, engine: dict[str, Any]) -> KernelPlan:
        hf = dict(source._wire_shapes())  # names and shapes as the stream yields them
        mapping: dict[str, list[str]] = engine.get("packed_modules_mapping") or {}
        if engine.get("world_size", 1) != 1:
            return cls([], False, "kernel format needs tensor_parallel_size 1")
        entries: list[tuple[str, list[int], list[str]]] = []
        for name, shape in engine["params"]:
            if name in hf and list(hf[name]) == list(shape):
                entries.append((name, list(shape), [name]))
                continue
            found = None
            for fused, parts in mapping.items():
                key = f".{fused}."
                if key in f".{name}":
                    srcs = [name.replace(f"{fused}.", f"{part}.", 1) for part in parts]
                    if all(s in hf for s in srcs) and sum(hf[s][0] for s in srcs) == shape[0] and all(
                        list(hf[s][1:]) == list(shape[1:]) for s in srcs
                    ):
                        found = srcs
                        break
            if found is None:
                return cls([], False, f"no HF source for engine parameter {name} {list(shape)}")
            entries.append((name, list(shape), found))
        # Emit each engine parameter as soon as the HF stream has produced all its parts, so that the
        # send stays lazy (one HF tensor gathered at a time) and every rank iterates the same order.
        order = {n: i for i, n in enumerate(hf)}
        entries.sort(key=lambda e: (max(order[s] for s in e[2]), order[e[2][0]]))
        used = {s for e in entries for s in e[2]}
        reason = f"{len(entries)} engine parameters from {len(used)} of {len(hf)} HF tensors"
        return cls(entries, True, reason)

    def metadata(self, dtype: torch.dtype) -> tuple[list[str], list[str], list[list[int]]]:
        d = str(dtype).split(".")[-1]
        return [e[0] for e in self.entries], [d] * len(self.entries), [e[1] for e in self.entries]

    def iterate(self, source: ParamSource, fuse: bool = True):
        """Yields (engine name, tensor) in ``entries`` order, pulling HF tensors from ``source`` lazily.
        ``fuse=False`` yields fused parameters as a list of parts (``PackedProducer`` writes them side by
        side in its buffer, which is the fused layout, without a ``torch.cat``)."""
        it = iter(source)
        have: dict[str, torch.Tensor] = {}
        for name, _, srcs in self.entries:
            while not all(s in have for s in srcs):
                n, t = next(it)
                have[n] = t
            parts = [have.pop(s) for s in srcs]
            if len(parts) == 1:
                yield name, parts[0]
            else:
                yield name, torch.cat(parts, dim=0) if fuse else parts
        for _ in it:  # HF tensors the engine does not take (e.g. a tied alias): still gathered on every rank
            pass


def make_sender(backend: str, client: EngineFanOut, source: ParamSource, init: dict[str, Any]) -> Sender:
    """``init``: master_address, master_port, world_size, packed, bucket_bytes."""
    from rlhf_runtime import vllm_plugin

    vllm_plugin.register()
    if vllm_has_trainer_api():
        return TrainerEngineSender(backend, client, source, init)
    return LegacySender(backend, client, source, init)

