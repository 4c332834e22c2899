"""``gloo``: a CPU weight-transfer backend for vLLM's weight-transfer API.

vLLM ships ``nccl`` and ``ipc``, both GPU-only. This backend speaks the same engine protocol (init, start, update,
finish) over a torch gloo ``ProcessGroup`` with its own ``TCPStore``, so CPU CI drives exactly the engine calls the
GPU path drives. The plugin entry point (``rlhf_runtime.vllm.plugin:register``) registers it in every vLLM process.

Wire (both sides derive it from the same metadata): rank 0 is the trainer, an engine's workers sit at
``rank_offset + data_parallel_index * world + rank``; the tensors go as raw bytes, one uint8 broadcast per bucket
of ``direct.buckets`` (packed) or per tensor. Received weights go through
``model.load_weights`` inside vLLM's layerwise reload (a ``load_format="dummy"`` engine takes them too).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, fields
from datetime import timedelta
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from vllm.distributed.weight_transfer.base import (
    TrainerInitInfo,
    TrainerWeightTransferEngine,
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from rlhf_runtime.vllm import compat as vllm_compat
from rlhf_runtime.weight_sync.direct import buckets, entry_bytes

BACKEND = "gloo"
DEFAULT_BUCKET_BYTES = 64 * 1024 * 1024
#: Default deadline of the group's rendezvous and of each collective (the runtime passes
#: ``weightSync.timeoutSeconds``): a peer that never joins or a stuck broadcast raises instead of hanging.
TIMEOUT = timedelta(minutes=10)


def _process_group(address: str, port: int, rank: int, world_size: int, is_master: bool,
                   timeout_seconds: float | None = None) -> Any:
    timeout = timedelta(seconds=timeout_seconds) if timeout_seconds else TIMEOUT
    store = dist.TCPStore(address, port, world_size, is_master, timeout=timeout, wait_for_workers=False)
    opts = dist.ProcessGroupGloo._Options()
    opts._timeout = timeout
    opts._devices = [dist.ProcessGroupGloo.create_default_device()]
    pg = dist.ProcessGroupGloo(dist.PrefixStore("rlhf-weights", store), rank, world_size, opts)
    return store, pg


@dataclass
class GlooGroupInfo:
    """The group both sides join (the trainer's and the workers' init infos)."""

    master_address: str
    master_port: int
    world_size: int
    packed: bool = True
    packed_buffer_size_bytes: int = DEFAULT_BUCKET_BYTES
    timeout_seconds: float = TIMEOUT.total_seconds()


def groups(sizes: list[int], packed: bool, bucket_bytes: int) -> list[tuple[int, int]]:
    """The broadcasts, as ``[start, end)`` ranges of the tensors: buckets packed, else one tensor each."""
    return buckets(sizes, bucket_bytes) if packed else [(i, i + 1) for i in range(len(sizes))]


# ------------------------------------------------------------------------------------------- worker side
@dataclass
class GlooWeightTransferInitInfo(GlooGroupInfo, WeightTransferInitInfo):
    rank_offset: int = 1


@dataclass
class GlooWeightTransferUpdateInfo(WeightTransferUpdateInfo):
    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]

    def __post_init__(self) -> None:
        if not (len(self.names) == len(self.dtype_names) == len(self.shapes)):
            raise ValueError("names, dtype_names and shapes must have the same length")


def _reprepack_cpu_moe(model: torch.nn.Module) -> int:
    """Prepack vLLM's CPU MoE experts again after a reload; returns the layers fixed. The first load prepacks
    ``w13_weight``/``w2_weight`` into a grouped-GEMM layout (``CPUUnquantizedExperts``); a reload copies plain
    weights into that storage and skips the prepack (it runs only while ``moe_kernel`` is None), so the synced
    engine would disagree with a fresh one. CPU experts classes only."""
    fixed = 0
    for module in model.modules():
        kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        if experts is not None and type(experts).__name__.endswith("CPUUnquantizedExperts"):
            experts.process_weights_after_loading(module)
            fixed += 1
    return fixed


class GlooWeightTransferEngine(WeightTransferEngine[GlooWeightTransferInitInfo, GlooWeightTransferUpdateInfo]):
    """Worker side (runs inside each vLLM worker)."""

    init_info_cls = GlooWeightTransferInitInfo
    update_info_cls = GlooWeightTransferUpdateInfo

    def __init__(self, config: Any, vllm_config: Any, device: torch.device, model: torch.nn.Module) -> None:
        super().__init__(config, vllm_config, device, model)
        self.store: Any = None
        self.group: Any = None
        self.packed = True
        self.bucket_bytes = DEFAULT_BUCKET_BYTES

    def init_transfer_engine(self, init_info: GlooWeightTransferInitInfo) -> None:
        pc = self.parallel_config
        rank = init_info.rank_offset + pc.data_parallel_index * pc.world_size + pc.rank
        self.packed = init_info.packed
        self.bucket_bytes = init_info.packed_buffer_size_bytes
        self.store, self.group = _process_group(init_info.master_address, init_info.master_port, rank,
                                                init_info.world_size, False, init_info.timeout_seconds)

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self.model)

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)
        _reprepack_cpu_moe(self.model)

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # The base class synchronises the accelerator afterwards, which a CPU build does not need.
        self.receive_weights(self.parse_update_info(update_info))

    def receive_weights(self, update_info: GlooWeightTransferUpdateInfo) -> None:
        if self.group is None:
            raise RuntimeError("gloo weight transfer not initialised: call init_weight_transfer_engine first")
        dtypes = [getattr(torch, d) for d in update_info.dtype_names]
        shapes = [tuple(s) for s in update_info.shapes]
        sizes = entry_bytes(shapes, dtypes)
        for start, end in groups(sizes, self.packed, self.bucket_bytes):
            buf = torch.empty(sum(sizes[start:end]), dtype=torch.uint8)
            self.group.broadcast(buf, 0).wait()
            self.model.load_weights([(update_info.names[i], p.view(dtypes[i]).view(shapes[i]))
                                     for i, p in zip(range(start, end), buf.split(sizes[start:end]))])

    def shutdown(self) -> None:
        self.group = None
        self.store = None


# ------------------------------------------------------------------------------------------ trainer side
def send(group: Any, pairs: Iterator[tuple[str, torch.Tensor]], sizes: list[int], packed: bool,
         bucket_bytes: int) -> int:
    """Broadcast ``pairs`` (``sizes``: their bytes) from rank 0 in the wire format above; returns the bytes sent."""
    total = 0
    for start, end in groups(sizes, packed, bucket_bytes):
        parts = [next(pairs)[1].detach().contiguous().view(-1).view(torch.uint8) for _ in range(start, end)]
        total += sum(t.numel() for t in parts)
        group.broadcast(parts[0] if len(parts) == 1 else torch.cat(parts), 0).wait()
    return total


@dataclass
class GlooTrainerInitInfo(GlooGroupInfo, TrainerInitInfo):
    """Trainer init info (vLLM's trainer-engine API)."""

    backend: ClassVar[str] = BACKEND


class GlooTrainerWeightTransferEngine(TrainerWeightTransferEngine[GlooTrainerInitInfo]):
    """Trainer side: rank 0 of the gloo group; drives the engines through ``client``."""

    init_info_cls = GlooTrainerInitInfo

    def __init__(self, *, client: Any, source: Any, is_sender: bool = True, packed: bool = True,
                 packed_buffer_size_bytes: int = DEFAULT_BUCKET_BYTES) -> None:
        super().__init__(client=client, source=source, is_sender=is_sender)
        self.packed = packed
        self.bucket_bytes = packed_buffer_size_bytes
        self.store: Any = None
        self.group: Any = None
        self.bytes_sent = 0

    @classmethod
    def trainer_init(cls, init_info: GlooTrainerInitInfo, *, client: Any, source: Any = None) -> GlooTrainerWeightTransferEngine:
        if source is None:
            raise ValueError("gloo trainer weight transfer needs a WeightSource")
        engine = cls(client=client, source=source, is_sender=init_info.is_sender, packed=init_info.packed,
                     packed_buffer_size_bytes=init_info.packed_buffer_size_bytes)
        if not engine.is_sender:
            return engine
        worker_info = GlooWeightTransferInitInfo(**{f.name: getattr(init_info, f.name) for f in fields(GlooGroupInfo)},
                                                 rank_offset=1)
        # The workers block in init until every rank joined: run their RPC beside our own join.
        with ThreadPoolExecutor(max_workers=1) as exe:
            fut = exe.submit(client.init_weight_transfer_engine, asdict(worker_info))
            engine.store, engine.group = _process_group(init_info.master_address, init_info.master_port, 0,
                                                        init_info.world_size, True, init_info.timeout_seconds)
            fut.result()
        return engine

    def send_weights(self) -> None:
        meta = vllm_compat.source_metadata(self.source)
        if not self.is_sender:
            for _ in vllm_compat.source_tensors(self.source):
                pass
            return
        update = GlooWeightTransferUpdateInfo(names=[m.name for m in meta], shapes=[list(m.shape) for m in meta],
                                              dtype_names=[str(m.dtype).split(".")[-1] for m in meta])
        self.client.start_weight_update()
        exe = ThreadPoolExecutor(max_workers=1)
        try:
            fut = exe.submit(self.client.update_weights, asdict(update))
            self.bytes_sent = send(self.group, vllm_compat.source_tensors(self.source),
                                   entry_bytes([m.shape for m in meta], [m.dtype for m in meta]), self.packed,
                                   self.bucket_bytes)
            fut.result()
        finally:
            exe.shutdown(wait=False)
        self.client.finish_weight_update()

    def shutdown(self) -> None:
        self.group = None
        self.store = None


_lock = threading.Lock()


def register() -> None:
    """Register both sides with vLLM's factories (idempotent)."""
    from vllm.distributed.weight_transfer import factory

    with _lock:
        if BACKEND not in factory.WeightTransferEngineFactory._registry:
            factory.WeightTransferEngineFactory.register_engine(BACKEND, GlooWeightTransferEngine)
        if BACKEND not in factory.WeightTransferTrainerFactory._registry:
            factory.WeightTransferTrainerFactory.register_engine(BACKEND, GlooTrainerWeightTransferEngine)
