"""The sender: one ``send()`` per sync on every trainer rank (rank 0 sends; the others take part in the gathers).

``TrainerEngineSender`` drives the backend's trainer-side ``TrainerWeightTransferEngine`` (vLLM >= 0.28) and adds
the runtime's kernel format (``formats.KernelPlan``), the resident IPC sync (``producers.ResidentExport``) and the
direct NCCL sync (``direct``). It is built once from its ``options.WeightSyncOptions`` and never reconfigured.
"""

from __future__ import annotations

import logging
import math
import time
from typing import Any

import torch

from rlhf_runtime.vllm import compat as vllm_compat
from rlhf_runtime.weight_sync import direct
from rlhf_runtime.weight_sync.fanout import EngineFanOut
from rlhf_runtime.weight_sync.formats import KernelPlan, effective_format
from rlhf_runtime.weight_sync.options import WeightSyncOptions
from rlhf_runtime.weight_sync.producers import ParamSource, ResidentExport

log = logging.getLogger("rlhf_runtime")


def _several_ranks() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def one_stream_plan(source: ParamSource, layouts: list[dict[str, Any]]) -> KernelPlan:
    """The plan of one stream every engine receives whole (an NCCL broadcast, or one trainer rank's IPC handles):
    none where the engines hold different experts."""
    if any(lay.get("experts") != layouts[0].get("experts") for lay in layouts[1:]):
        return KernelPlan([], False, "the engines hold different experts (expert parallelism) and all of them "
                                     "receive the same stream")
    return KernelPlan.build(source, layouts[0])


def kernel_plan(source: ParamSource, client: EngineFanOut, backend: str) -> KernelPlan:
    """This trainer rank's ``KernelPlan``; a collective: rank 0 (which holds the engine handles) asks the engines
    for their layouts and broadcasts them. Over CUDA IPC each engine worker reads the trainer rank on its GPU, so
    with several engines or TP > 1 each rank plans for the worker on its GPU (by GPU UUID). Over NCCL every worker
    receives the same broadcast (``one_stream_plan``; into TP > 1 engines every rank's pieces, ``all_ranks``)."""
    import torch.distributed as dist

    layouts = client.engine_layouts() if client.handles else None
    if _several_ranks():
        box = [layouts]
        dist.broadcast_object_list(box, src=0)
        layouts = box[0]
    if not layouts:
        return KernelPlan([], False, "no engine layout reached this trainer rank")
    if backend != "ipc" or (len(layouts) == 1 and int(layouts[0].get("world_size", 1)) == 1):
        return one_stream_plan(source, layouts)
    uuid = str(torch.cuda.get_device_properties(torch.cuda.current_device()).uuid) if torch.cuda.is_available() else None
    mine = [(lay, w) for lay in layouts for w in lay.get("workers", []) if uuid is not None and w.get("gpu") == uuid]
    if not mine:
        return KernelPlan([], False, "kernel format over ipc with several engine workers: no engine worker on this "
                                     "trainer rank's GPU (ipc needs the trainer colocated with the engines)")
    if any(lay.get("experts") != mine[0][0].get("experts") for lay, _ in mine[1:]):
        return KernelPlan([], False, "engines holding different experts share this trainer rank's GPU")
    layout, worker = mine[0]
    tp_rank = worker["tp_rank"] if int(layout.get("world_size", 1)) > 1 else None
    return KernelPlan.build(source, layout, tp_rank)


def agreed_gathers(plan: KernelPlan, source: ParamSource) -> tuple[set[str], set[str]]:
    """What no trainer rank gathers for ``plan``: (``local``) the HF names every rank sends as its own FSDP2 shard
    (on every rank the piece its GPU's engine worker holds, ``ParamSource.local_candidates``) and (``unused``) the
    parameters no plan takes (``ParamSource.unneeded``). With several ranks a collective: a gather one rank
    skipped and another ran would leave both waiting in it."""
    import torch.distributed as dist

    local = plan.row_split_sources() & source.local_candidates(plan.tp, plan.tp_rank) \
        if plan.ok and plan.tp > 1 and not plan.all_ranks else set()
    unused = source.unneeded(plan.used_sources()) if plan.ok else set()
    if not _several_ranks():
        return set(), unused  # one rank: nothing is a shard, and nothing it skips is a collective
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (sorted(local), sorted(unused)))
    return (set.intersection(*(set(x[0]) for x in everyone)), set.intersection(*(set(x[1]) for x in everyone)))


class TrainerEngineSender:
    """Sends the trainer's weights to every engine; ``send()`` returns stage seconds, bytes and the path taken.

    Built on every trainer rank alike (a collective). The format is ``formats.effective_format`` (``fallback``:
    why not the kernel format), packed as ``options.packs`` says. A sync is the resident IPC sync
    (``ResidentExport``), the direct NCCL sync (``weight_sync.direct``) or vLLM's trainer engine of the backend
    (start, update, finish: ``options.rpc`` engine calls, ``EngineFanOut``)."""

    def __init__(self, options: WeightSyncOptions, client: EngineFanOut, source: ParamSource,
                 group: dict[str, Any]) -> None:
        from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

        self.options, self.backend, self.client, self.source = options, options.backend, client, source
        self.plan: KernelPlan | None = None
        agreed: tuple[set[str], set[str]] = (set(), set())
        if options.format != "checkpoint":
            if self.backend == "gloo":
                self.plan = KernelPlan([], False, "the gloo backend loads the checkpoint format only")
            else:
                self.plan = kernel_plan(source, client, self.backend)
                agreed = agreed_gathers(self.plan, source)  # every rank is here (kernel_plan is a collective too)
        self.format = effective_format(options.format, self.plan)
        #: why a sync that could have taken the kernel format (``auto``) takes the checkpoint format
        self.fallback = self.plan.reason if self.format == "checkpoint" and self.plan is not None else None
        if self.fallback is not None:
            log.warning("weight sync in the checkpoint format, not the kernel format: %s", self.fallback)
        client.checkpoint_format = self.format == "checkpoint"
        source.local, source.drop = agreed if self.format == "kernel" else (set(), set())
        one_gpu = options.trainer_world == 1 and self.plan is not None and self.plan.tp == 1
        self.resident = ResidentExport(self.plan, source) \
            if self.backend == "ipc" and self.format == "kernel" and one_gpu else None
        self.packed = options.packs(self.format)  # fixed for the group's life: the engines take it at its init
        info = self._init_info(group)
        if self.backend == "nccl":  # vLLM's NCCL trainer engine, plus the direct sync
            from rlhf_runtime.weight_sync.kernel import DirectNCCLTrainerEngine

            self.engine = DirectNCCLTrainerEngine.trainer_init(info, client=client, source=self._weight_source())
            self.engine.direct = self.direct
        else:
            self.engine = WeightTransferTrainerFactory.trainer_init(info, client=client, source=self._weight_source())

    def largest_tensor_bytes(self) -> int:
        """The largest tensor a sync may send, in the sync's dtype: a trainer parameter as sent (checkpoint
        format) or an engine parameter of the kernel plan (fused: q, k and v in one)."""
        shapes = [shape for _, shape in self.source.wire_shapes()]
        if self.plan is not None:
            shapes += [tuple(shape) for _, shape, _ in self.plan.entries]
        return max((math.prod(s) * self.source.dtype.itemsize for s in shapes), default=0)

    def _init_info(self, group: dict[str, Any]) -> Any:
        """The backend's trainer init info (``group``: master_address, master_port, world_size, rank)."""
        bucket = self.options.bucket_bytes
        if self.backend == "ipc":  # vLLM's packed IPC producer refuses a tensor larger than its buffer
            from vllm.distributed.weight_transfer.ipc_engine import IPCTrainerInitInfo

            return IPCTrainerInitInfo(packed=self.packed, packed_buffer_size_bytes=max(bucket, self.largest_tensor_bytes()),
                                      rank=group["rank"])
        common = {"master_address": group["master_address"], "master_port": group["master_port"],
                  "world_size": group["world_size"], "packed": self.packed, "packed_buffer_size_bytes": bucket,
                  "rank": group["rank"]}
        if self.backend == "gloo":
            from rlhf_runtime.weight_sync.gloo import GlooTrainerInitInfo

            return GlooTrainerInitInfo(**common, timeout_seconds=self.options.timeout_s)
        from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo

        return NCCLTrainerInitInfo(**common)

    @property
    def direct(self) -> bool:
        """Whether a sync is the direct NCCL sync (the kernel format unpacked, straight into the parameters)."""
        return self.backend == "nccl" and self.format == "kernel" and not self.packed

    @property
    def nccl_path(self) -> str | None:
        """Which NCCL path a sync takes: ``direct``, vLLM's ``packed`` or ``per-tensor``; None on another backend."""
        if self.backend != "nccl":
            return None
        return "direct" if self.direct else "packed" if self.packed else "per-tensor"

    def _weight_source(self) -> Any:
        if self.format != "kernel":
            return self.source.as_weight_source()
        plan, dtype = self.plan, self.source.dtype
        assert plan is not None
        if self.direct:  # the tensors as they are: a fused parameter's parts, every TP rank's piece
            hf = {n: list(sh) for n, sh in self.source.wire_shapes()}
            return self._source(direct.piece_shapes(plan, hf),
                                lambda: direct.pieces(plan, plan.iterate(self.source, fuse=False)))
        names, _, shapes = plan.metadata(dtype)
        return self._source(list(zip(names, shapes)), lambda: plan.iterate(self.source, fuse=True))

    def _source(self, entries: list[tuple[str, list[int]]], pairs: Any) -> Any:
        """vLLM's ``WeightSource`` of ``entries`` (name, shape) in the sync's dtype, ``pairs()`` their tensors."""
        meta = [vllm_compat.param_meta(n, self.source.dtype, tuple(sh)) for n, sh in entries]
        return vllm_compat.as_weight_source(lambda: meta, pairs)

    def describe(self) -> dict[str, Any]:
        """What this sender uses: its options, the format, packing and path in use, the kernel plan's reason, the
        tensors sent as this rank's own shard or left out (``agreed_gathers``)."""
        return {**self.options.as_dict(), "format_requested": self.options.format, "format": self.format,
                "packed": self.packed, "kernel_plan": None if self.plan is None else self.plan.reason,
                "fallback": self.fallback, "nccl": self.nccl_path, "ipc_resident": self.resident is not None,
                "local_shards": len(self.source.local), "skipped": len(self.source.drop)}

    def send(self) -> dict[str, Any]:
        self.client.new_sync()
        t = time.perf_counter()
        message = self.resident.message() if self.resident is not None else None
        r = self._send_resident(message, t) if message is not None else self._send_through_vllm(t)
        r["format"] = self.format
        if self.fallback is not None:  # in the progress file's sync record: why not the kernel format
            r["fallback"] = self.fallback
        if self.backend == "nccl":
            r["nccl"] = self.nccl_path
        if self.backend == "ipc":  # which IPC path ran (ResidentExport.reason says why not resident)
            r["ipc"] = "resident" if message is not None else "vllm"
        return r

    def _result(self, wall: float) -> dict[str, Any]:
        """Stage seconds, bytes, and the engine calls (per engine; rank 0, others 0) and waits of this sync."""
        t = self.client.timings
        return {"start_s": t.get("start_weight_update", 0.0), "transfer_s": t.get("update_weights", 0.0),
                "gather_s": self.source.gather_s, "finish_s": t.get("finish_weight_update", 0.0), "send_s": wall,
                "bytes": float(self.source.bytes), "engine_calls": float(self.client.calls),
                "engine_waits": float(self.client.waits)}

    def _send_resident(self, message: dict[str, Any], t: float) -> dict[str, Any]:
        """One ``update_weights_round`` per engine with the resident message (``t``: when the sync began)."""
        assert self.resident is not None
        torch.cuda.current_stream().synchronize()  # the engines read the parameters as the trainer left them
        try:
            self.client.update_round({"names": [], "dtype_names": [], "shapes": [], "ipc_handles": {},
                                      "resident": message}, checkpoint_format=False)
        except BaseException:
            self.resident.delivered(False)  # an engine may have dropped its mapping: send the handles again
            raise
        self.resident.delivered()
        r = self._result(time.perf_counter() - t)
        r.update(gather_s=0.0, bytes=float(self.resident.bytes), ipc_exports=float(self.resident.exports),
                 engine_call_s=self.client.timings.get("update_weights_round_call", 0.0))
        return r

    def _send_through_vllm(self, t: float) -> dict[str, Any]:
        """vLLM's trainer engine sends the source (``t``: when the sync began)."""
        self.engine.send_weights()
        r = self._result(time.perf_counter() - t)
        r.update(gathers=float(self.source.gathers), gather_collectives=float(self.source.collectives),
                 local_shards=float(len(self.source.local)), skipped=float(len(self.source.drop)))
        return r


def make_sender(options: WeightSyncOptions, client: EngineFanOut, source: ParamSource,
                group: dict[str, Any]) -> TrainerEngineSender:
    """The sender of a trainer rank (``group``: master_address, master_port, world_size, rank). Refuses an
    unsupported vLLM."""
    from rlhf_runtime.vllm import plugin as vllm_plugin

    vllm_compat.require_supported_vllm()
    vllm_plugin.register()
    return TrainerEngineSender(options, client, source, group)
