"""Senders: one ``send()`` per sync, from trainer rank 0 (other ranks take part in the gathers).

``make_sender`` returns a ``TrainerEngineSender``: the backend's trainer-side ``TrainerWeightTransferEngine``
(``WeightTransferTrainerFactory.trainer_init(init_info, client=..., source=...)``, vLLM >= 0.28), plus the
runtime's kernel format (``KernelPlan``), resident IPC sync (``ResidentExport``) and direct NCCL sync
(``weight_sync.direct``).
"""

from __future__ import annotations

import logging
import math
import time
from typing import Any

import torch

from rlhf_runtime.vllm import compat as vllm_compat
from rlhf_runtime.weight_sync import direct, ipc_exchange, wire
from rlhf_runtime.weight_sync.fanout import EngineFanOut
from rlhf_runtime.weight_sync.formats import KernelPlan, effective_format
from rlhf_runtime.weight_sync.producers import ParamSource, ResidentExport

log = logging.getLogger("rlhf_runtime")


class Sender:
    """Sends the trainer's weights to every engine: ``send()`` returns stage seconds and bytes (``_result``);
    ``format`` names the weight format in use."""

    backend: str
    format: str = "checkpoint"
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
            "engine_calls": float(self.client.calls),  # Ray calls per engine in this sync (rank 0; others 0)
            "engine_waits": float(self.client.waits),  # times it waited for the engines (pipelined calls: fewer)
        }


def resolve_packed(setting: bool | None, backend: str, fmt: str, engine_tp: int, trainer_world: int = 1) -> bool:
    """Whether the sync packs (``spec.weightSync.packed``; ``setting`` None: unset). Unset, the direct NCCL sync
    (not packed) where it was measured faster than vLLM's packed path and validated: NCCL in the kernel format from
    a one-GPU trainer into engines of one GPU (Qwen3-1.7B 15.4 vs 16.7 ms, Qwen3-8B 49.6 vs 54.2 ms on 2xH200,
    2026-11-29: benchmarks/README.md); packed elsewhere: vLLM's other paths launch once per tensor, and the direct
    sync into TP > 1 engines (every rank's piece on the wire) and from FSDP2 trainers (gathers between its groups)
    has not run on GPUs yet."""
    if setting is not None:
        return bool(setting)
    return not (backend == "nccl" and fmt == "kernel" and engine_tp == 1 and trainer_world == 1)


def one_stream_plan(source: ParamSource, layouts: list[dict[str, Any]]) -> KernelPlan:
    """The plan of one stream that every engine receives whole (an NCCL broadcast, or one trainer rank's IPC
    handles): the engines must want the same tensors, so engines holding different experts (expert
    parallelism) refuse. No collective."""
    if any(lay.get("experts") != layouts[0].get("experts") for lay in layouts[1:]):
        return KernelPlan([], False, "the engines hold different experts (expert parallelism) and all of them "
                                     "receive the same stream")
    return KernelPlan.build(source, layouts[0])


def kernel_plan(source: ParamSource, client: EngineFanOut, backend: str) -> KernelPlan:
    """This trainer rank's ``KernelPlan``. Only rank 0 holds the engine handles (``Runtime.init_sync``): it asks
    every engine for its layout and, when the trainer has several ranks, broadcasts the layouts over the
    trainer's process group (a collective: every rank calls this at the same point).

    Over CUDA IPC each engine worker reads the tensors of the trainer rank on its own GPU, so with several
    engines or TP > 1 each rank plans for the worker on its GPU (found by GPU UUID): its TP shard, and with expert
    parallelism its engine's experts. Over NCCL every worker receives the same broadcast, so the engines must
    want the same tensors: engines holding different experts (expert parallelism) refuse, and into TP > 1
    engines the plan sends every TP rank's pieces side by side (``KernelPlan.all_ranks``), each worker copying
    its own."""
    import torch.distributed as dist

    layouts = client.engine_layouts() if client.handles else None
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
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
    """What no trainer rank needs to gather for ``plan``: (``local``) the HF names every rank can send as its own
    FSDP2 shard (the plan splits them along dim 0 only and on every rank the shard is the piece the engine worker
    on that rank's GPU holds: ``ParamSource.local_candidates``) and (``unused``) the trainer parameters no rank's
    plan takes (a tied head under its second name; ``ParamSource.unneeded``). With several ranks a collective over
    the trainer's process group (every rank calls it at the same point: ``TrainerEngineSender._agree``): a gather
    one rank skipped and another ran would leave both waiting in it."""
    import torch.distributed as dist

    local = plan.row_split_sources() & source.local_candidates(plan.tp, plan.tp_rank) \
        if plan.ok and plan.tp > 1 and not plan.all_ranks else set()
    unused = source.unneeded(plan.used_sources()) if plan.ok else set()
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return set(), unused  # one rank: nothing is a shard, and nothing it skips is a collective
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (sorted(local), sorted(unused)))
    return (set.intersection(*(set(x[0]) for x in everyone)), set.intersection(*(set(x[1]) for x in everyone)))


#: Whether the kernel format sends each FSDP2 rank's own shard where it is the TP engine worker's shard
#: (``agreed_gathers``: no gather for column- and vocabulary-parallel weights; IPC from FSDP2 ranks into a TP
#: engine) and skips the trainer parameters no engine takes (a tied head's second name): the default of
#: ``TrainerEngineSender.lean_gathers``. Why on: benchmarks/README.md, "Where the defaults come from".
LEAN_GATHERS_DEFAULT = True

#: The engine calls of a sync over NCCL or gloo (``TrainerEngineSender.rpc``): ``three`` (start, update, finish,
#: each waited on), ``one`` (``EngineFanOut.one_round``: one ``update_weights_round`` call per engine) or
#: ``pipelined`` (``EngineFanOut.pipelined``: the three calls submitted back to back, one wait; engines of
#: ``weightSync.mode: sync`` only, three elsewhere).
RPC_MODES = ("one", "three", "pipelined")

#: Engine calls per sync over NCCL: vLLM's own three worker calls (the path validated first), one round trip; the
#: one-call round stays opt-in. Why: benchmarks/README.md, "Where the defaults come from".
NCCL_RPC_DEFAULT = "pipelined"
#: Engine calls per sync over gloo (the CPU backend; IPC syncs ignore the setting): one call per engine.
RPC_DEFAULT = "one"


def default_rpc(backend: str) -> str:
    """The engine calls per sync a ``TrainerEngineSender`` of ``backend`` starts with (``rpc``). Pure."""
    return NCCL_RPC_DEFAULT if backend == "nccl" else RPC_DEFAULT


#: Whether the kernel format over NCCL into tensor-parallel engines (``KernelPlan.all_ranks``: every TP rank's
#: pieces in the one broadcast) passed the GPU validation, so that ``auto`` takes it: yes, 2026-11-27 on 4xH200,
#: vLLM 0.33, trainer GPU0 + one TP=2 engine, Qwen3-1.7B shape (17.4 ms vs 92.5 ms in the checkpoint format;
#: benchmarks/README.md, "2026-11-27 (4xH200, second session)"). False makes it opt-in again.
BROADCAST_TP_VALIDATED = True


def auto_keeps_checkpoint(plan: KernelPlan | None = None) -> str | None:
    """Why ``weightSync.format: auto`` stays with the checkpoint format although the kernel format may apply
    (not validated on GPUs on this vLLM; ``format: kernel`` opts in), else None. The same on every trainer rank,
    so all ranks or none build the kernel plan (a collective). Pure.

    Every layout the plan covers passed the GPU validation (greedy tokens of a fresh engine equal the synced
    engine's; which layouts, where and when: benchmarks/README.md, "Where the defaults come from"), so none is held
    back; a layout that is not validated is named here: ``plan`` (once built) sending every TP rank's pieces in
    one NCCL broadcast (``BROADCAST_TP_VALIDATED``)."""
    if not vllm_compat.AUTO_KERNEL_SINCE_TRAINER_API:
        return "auto keeps the checkpoint format on this vLLM until the kernel format is validated on GPUs"
    if plan is not None and plan.ok and plan.all_ranks and not BROADCAST_TP_VALIDATED:
        return ("auto keeps the checkpoint format for NCCL into a tensor-parallel engine until that path of the "
                "kernel format is validated on GPUs (weightSync.format: kernel takes it)")
    return None


class TrainerEngineSender(Sender):
    """The backend's ``TrainerWeightTransferEngine`` drives the round trip ``start_weight_update`` ->
    ``update_weights`` (concurrent with the send) -> ``finish_weight_update``.

    ``fmt`` (``spec.weightSync.format``, ``formats.effective_format``): the kernel format sends the engine's own
    parameters (``KernelPlan``, built on every rank from the engines' layout, so every rank iterates and, for
    IPC, exports the same names and shapes; with TP > 1 over IPC each rank its GPU's worker's shard) as the
    stream of the same trainer engine, and switches the engines' workers to copying them in place
    (``weight_sync.kernel``; ``EngineFanOut.checkpoint_format``); the checkpoint
    format streams HF names into vLLM's layerwise reload. The gloo backend (CPU: vLLM prepacks linear weights
    there) loads the checkpoint format only. ``auto`` takes the kernel format where its plan applies and the path
    was validated on GPUs (``auto_keeps_checkpoint``), else the checkpoint format.

    IPC in the kernel format from one trainer worker whose planned tensors are all views of its parameters
    (``ResidentExport``): the engines map the parameters once and a sync is one call per engine
    (``EngineFanOut.update_round``: start, a multi-tensor copy, finish inside the engine), instead of vLLM's
    trainer engine (a staging copy per sync, three calls per engine and one more per chunk), unless
    ``ipc_resident`` is off.

    NCCL and gloo: vLLM's trainer engine calls the client's start, update (beside its broadcast) and finish;
    with ``rpc="one"`` (gloo's default, ``RPC_DEFAULT``) the client makes them one ``update_weights_round`` call
    per engine (``EngineFanOut.one_round``): one Ray round trip per sync instead of three, from the second sync of
    a format on (the first still makes three calls, so an engine that cannot start raises before the broadcast);
    with ``rpc="pipelined"`` (NCCL's default, ``NCCL_RPC_DEFAULT``; sync-mode engines, three elsewhere) the three
    calls are submitted back to back and waited on once (``EngineFanOut.pipelined``); ``rpc="three"`` waits on
    each. NCCL in the kernel format with ``packed`` false is the direct sync (``direct``, ``weight_sync.direct``):
    the trainer broadcasts its tensors as they are (a fused parameter's parts unfused where the engines are TP=1;
    every rank's piece, rank after rank, into TP > 1 engines), one NCCL group per bucket, the engines receiving
    into their parameters.

    Settings, plain attributes read at every sync (``apply_settings``): ``requested_format`` (``fmt``),
    ``ipc_resident`` (True), ``lean_gathers`` (``LEAN_GATHERS_DEFAULT``), ``rpc`` (``default_rpc``) and the direct
    sync's wire into TP=1 engines, ``direct_fuse`` and ``direct_packs``."""

    direct_fuse = wire.FUSE_DEFAULT
    direct_packs = wire.PACKS_DEFAULT
    _side: wire.SideStream | None = None  # the fused wire's side stream (``_direct_source``)
    _wire = (wire.FUSE_DEFAULT, wire.PACKS_DEFAULT)  # the wire options the engine's source was made for

    def __init__(self, backend: str, client: EngineFanOut, source: ParamSource, init: dict[str, Any],
                 fmt: str = "auto") -> None:
        from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

        self.backend, self.client, self.source = backend, client, source
        self.trainer_world = int(init.get("trainer_world", 1))
        self.plan: KernelPlan | None = None
        self.auto_reason: str | None = None
        self.resident: ResidentExport | None = None
        self.requested_format = fmt  # spec.weightSync.format: auto, checkpoint or kernel
        self.ipc_resident = True  # the resident IPC path where it applies
        self.lean_gathers = LEAN_GATHERS_DEFAULT  # see LEAN_GATHERS_DEFAULT
        self.agreed: tuple[set[str], set[str]] | None = None  # agreed_gathers of the kernel plan (_agree)
        self.rpc = default_rpc(backend)  # one of RPC_MODES (NCCL and gloo)
        self.ipc_exchange = ipc_exchange.EXCHANGE_DEFAULT  # IPC with several trainer ranks: see ipc_exchange
        self.direct_fuse = wire.FUSE_DEFAULT  # the direct sync into TP=1 engines: wire.FUSE_DEFAULT
        self.direct_packs = wire.PACKS_DEFAULT  # idem: wire.PACKS_DEFAULT
        self._exchange: tuple[str, Any] = (ipc_exchange.EXCHANGE_DEFAULT, None)  # in use, and its gloo group
        self._resolve(fmt)
        # fixed for the group's life: vLLM's engines take it at the init handshake
        self.packed = resolve_packed(init["packed"], backend, self.format, self.plan.tp if self.plan else 1,
                                     self.trainer_world)  # spec.weightSync.packed; None: unset
        init = {**init, "packed": self.packed}
        if backend == "ipc":  # vLLM's packed IPC producer (0.33) refuses a tensor larger than its buffer
            init = {**init, "bucket_bytes": max(int(init["bucket_bytes"]), self.largest_tensor_bytes())}
        info = self._init_info(backend, init)
        self._resolved_format: str | None = fmt  # the requested format the plan and format in use are for
        self._applied_lean = self.lean_gathers  # the lean_gathers the source's gathers were set for
        if backend == "nccl":  # vLLM's NCCL trainer engine, plus the direct sync (weight_sync.direct)
            from rlhf_runtime.weight_sync.kernel import DirectNCCLTrainerEngine

            self.engine = DirectNCCLTrainerEngine.trainer_init(info, client=client, source=self._weight_source())
        else:
            self.engine = WeightTransferTrainerFactory.trainer_init(info, client=client, source=self._weight_source())
        self.engine.direct, self.engine.side = self.direct, self._side
        self._set_rounds()

    def largest_tensor_bytes(self) -> int:
        """The largest tensor a sync may send, in the sync's dtype: a trainer parameter as sent (checkpoint
        format) or an engine parameter of the kernel plan (fused: q, k and v in one)."""
        shapes = [shape for _, shape in self.source.wire_shapes()]
        if self.plan is not None:
            shapes += [tuple(shape) for _, shape, _ in self.plan.entries]
        return max((math.prod(s) * self.source.dtype.itemsize for s in shapes), default=0)

    @staticmethod
    def _init_info(backend: str, init: dict[str, Any]) -> Any:
        """The trainer init info of ``backend`` (``init``: see ``make_sender``)."""
        if backend == "gloo":
            from rlhf_runtime.weight_sync.gloo import GlooTrainerInitInfo

            return GlooTrainerInitInfo(
                master_address=init["master_address"], master_port=init["master_port"],
                world_size=init["world_size"], packed=init["packed"],
                packed_buffer_size_bytes=init["bucket_bytes"], rank=init.get("rank", 0),
                **({"timeout_seconds": init["timeout_s"]} if init.get("timeout_s") else {}),
            )
        if backend == "nccl":
            from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo

            return NCCLTrainerInitInfo(
                master_address=init["master_address"], master_port=init["master_port"],
                world_size=init["world_size"], packed=init["packed"],
                packed_buffer_size_bytes=init["bucket_bytes"], rank=init.get("rank", 0),
            )
        if backend == "ipc":
            from vllm.distributed.weight_transfer.ipc_engine import IPCTrainerInitInfo

            return IPCTrainerInitInfo(packed=init["packed"], packed_buffer_size_bytes=init["bucket_bytes"],
                                      rank=init.get("rank", 0))
        raise ValueError(f"unknown weight-transfer backend {backend!r}")

    def apply_settings(self) -> None:
        """Bring what the sender derives from its settings up to date: the plan and format in use
        (``requested_format``), the gathers the ranks agreed to skip (``lean_gathers``) and the fan-out's engine
        calls per sync (``rpc``). ``send`` calls it first; nothing changes while the settings stay as they are. A
        collective where it plans (a new ``requested_format``) or agrees on the gathers (``lean_gathers`` turned
        on): every rank changes the settings alike and calls it at the same point."""
        if self.requested_format != self._resolved_format:
            self._resolved_format = None  # until it resolves (a kernel format that cannot apply raises)
            self._resolve(self.requested_format)
            self._resolved_format = self.requested_format
            self.engine.source = self._weight_source()
            self.engine.direct, self.engine.side = self.direct, self._side
        if self.lean_gathers != self._applied_lean:
            if self.lean_gathers:
                self._agree()  # the plan's agreement, once (made at plan time where the setting was on then)
            self._applied_lean = self.lean_gathers
            self._use_agreed_gathers()
        if self.ipc_exchange != self._exchange[0]:
            self._use_exchange()
        if (self.direct_fuse, self.direct_packs) != self._wire:  # the engines re-plan from the new metadata
            self.engine.source = self._weight_source()
            self.engine.side = self._side
        self._set_rounds()

    def _use_exchange(self) -> None:
        """The trainer engine exchanges IPC handles as ``ipc_exchange`` says (``ipc_exchange.install``); the gloo
        group is made the first time (a collective: every rank changes the setting alike). Only IPC with several
        trainer ranks exchanges anything."""
        if self.ipc_exchange not in ipc_exchange.EXCHANGES:
            raise ValueError(f"ipc_exchange must be one of {', '.join(ipc_exchange.EXCHANGES)}, "
                             f"not {self.ipc_exchange!r}")
        group = self._exchange[1]
        if self.backend == "ipc" and self.trainer_world > 1 and self.ipc_exchange == "gloo":
            if group is None:
                import torch.distributed as dist

                group = dist.new_group(backend="gloo")
            ipc_exchange.install(self.engine, group)
        else:
            ipc_exchange.uninstall(self.engine)
        self._exchange = (self.ipc_exchange, group)

    def _set_rounds(self) -> None:
        """NCCL and gloo trainer engines call ``update_weights`` once per sync: with ``rpc="one"`` the client
        turns start, update and finish into one call per engine (``EngineFanOut.one_round``), with
        ``rpc="pipelined"`` it submits the three back to back (``EngineFanOut.pipelined``). vLLM's IPC trainer
        engine calls it once per chunk, so it keeps three calls (its resident sync is one call already)."""
        self.client.one_round = self.rpc == "one" and self.backend in ("nccl", "gloo")
        self.client.pipelined = self.rpc == "pipelined" and self.backend in ("nccl", "gloo") and self.client.ordered

    def _resolve(self, fmt: str) -> None:
        self.auto_reason = auto_keeps_checkpoint() if fmt == "auto" else None
        if self.auto_reason is not None:
            self.format = effective_format("checkpoint", None)
        else:
            if fmt != "checkpoint" and self.plan is None:
                if self.backend == "gloo":
                    self.plan = KernelPlan([], False, "the gloo backend loads the checkpoint format only")
                else:
                    self.plan = kernel_plan(self.source, self.client, self.backend)
                    if self.lean_gathers:
                        self._agree()  # every rank is here (kernel_plan is a collective too)
            self.auto_reason = auto_keeps_checkpoint(self.plan) if fmt == "auto" else None
            self.format = effective_format("checkpoint" if self.auto_reason else fmt, self.plan)
        if self.fallback is not None:
            log.warning("weight sync in the checkpoint format, not the kernel format: %s", self.fallback)
        self.client.checkpoint_format = self.format == "checkpoint"
        self._use_agreed_gathers()
        plan = self.plan
        one_gpu = self.trainer_world == 1 and plan is not None and plan.tp == 1
        if self.backend == "ipc" and self.format == "kernel" and one_gpu and self.resident is None:
            self.resident = ResidentExport(plan, self.source)

    def _agree(self) -> None:
        """``agreed_gathers`` for the kernel plan (built once per sender), once: a collective, so every rank calls
        this at the same point (plan time, or the ``apply_settings`` after ``lean_gathers`` was turned on on every
        rank). With the setting off before the plan the ranks never make it."""
        if self.plan is not None and self.agreed is None:
            self.agreed = agreed_gathers(self.plan, self.source)

    def _use_agreed_gathers(self) -> None:
        """Send the agreed names ungathered or not at all (``agreed``) where the option is on and the kernel plan
        is in use; every name gathered otherwise (the checkpoint format sends every tensor whole)."""
        on = self.lean_gathers and self.format == "kernel"
        local, unused = self.agreed if on and self.agreed is not None else (set(), set())
        self.source.local, self.source.drop = set(local), set(unused)  # KernelPlan.iterate reads source.local

    @property
    def direct(self) -> bool:
        """Whether a sync is the direct NCCL sync (``weight_sync.direct``: the kernel format unpacked, received
        straight into the engines' parameters)."""
        return self.backend == "nccl" and self.format == "kernel" and not self.packed

    @property
    def nccl_path(self) -> str | None:
        """Which NCCL path a sync takes: ``direct`` (``weight_sync.direct``), vLLM's ``packed`` or ``per-tensor``;
        None on another backend."""
        if self.backend != "nccl":
            return None
        return "direct" if self.direct else "packed" if self.packed else "per-tensor"

    def _weight_source(self) -> Any:
        if self.format != "kernel":
            return self.source.as_weight_source()
        plan, dtype = self.plan, self.source.dtype
        assert plan is not None
        self._wire, self._side = (self.direct_fuse, self.direct_packs), None
        if self.direct and plan.tp == 1:  # the parts of fused parameters as they are, one entry each, or fused
            return self._direct_source(plan, dtype)
        if self.direct and plan.all_ranks:  # every TP rank's piece, one entry each, rank after rank
            hf = {n: list(s) for n, s in self.source.wire_shapes()}
            meta = [vllm_compat.param_meta(n, dtype, tuple(sh)) for n, sh in direct.rank_piece_shapes(plan, hf)]
            return vllm_compat.as_weight_source(
                lambda: meta, lambda: direct.rank_pieces(plan, plan.iterate(self.source, fuse=False)))
        names, _, shapes = plan.metadata(dtype)
        meta = [vllm_compat.param_meta(n, dtype, tuple(sh)) for n, sh in zip(names, shapes)]
        return vllm_compat.as_weight_source(lambda: meta, lambda: plan.iterate(self.source, fuse=True))

    def _direct_source(self, plan: KernelPlan, dtype: torch.dtype) -> Any:
        """The direct sync's weight source into TP=1 engines: a fused parameter as its parts, one entry each, or
        as one tensor (``direct_fuse``: concatenated on a side stream, ``_side``, which the trainer engine joins
        before each group); the small entries in packs (``direct_packs``: ``wire.with_packs``)."""
        side = wire.SideStream() if self.direct_fuse else None
        self._side = side
        if side is not None:
            entries = [(n, list(sh)) for n, sh, _ in plan.entries]

            def pairs() -> Any:
                return wire.fused(plan.iterate(self.source, fuse=False), side)
        else:
            entries = direct.unfused_shapes(plan.entries, {n: list(s) for n, s in self.source.wire_shapes()})

            def pairs() -> Any:
                return direct.unfused(plan.iterate(self.source, fuse=False))
        make = pairs
        if self.direct_packs:
            entries = wire.with_packs(entries, dtype.itemsize)

            def make() -> Any:
                return wire.packed(pairs(), entries, side)
        meta = [vllm_compat.param_meta(n, dtype, tuple(sh)) for n, sh in entries]
        return vllm_compat.as_weight_source(lambda: meta, make)

    @property
    def fallback(self) -> str | None:
        """Why a sync that could have taken the kernel format (``auto``) takes the checkpoint format, else None."""
        if self.format != "checkpoint" or self.requested_format == "checkpoint":
            return None
        return self.auto_reason or (self.plan.reason if self.plan is not None else "no kernel plan")

    @property
    def resident_active(self) -> bool:
        """Whether a sync takes the resident IPC path (``ResidentExport``: kernel format, one trainer GPU)."""
        return self.ipc_resident and self.resident is not None and self.format == "kernel"

    def send(self) -> dict[str, float]:
        self.apply_settings()
        self.client.new_sync()
        t = time.perf_counter()
        message = self.resident.message() if self.resident_active else None  # type: ignore[union-attr]
        if message is not None:
            r = self._send_resident(message, t)
        else:
            r = self._send_through_vllm(t)
        r["format"] = self.format  # type: ignore[assignment]
        if self.fallback is not None:  # in the progress file's sync record: why not the kernel format
            r["fallback"] = self.fallback  # type: ignore[assignment]
        if self.backend == "nccl":  # which NCCL path ran
            r["nccl"] = self.nccl_path  # type: ignore[assignment]
        if self.backend == "ipc":  # which IPC path ran (ResidentExport.reason says why not resident)
            r["ipc"] = "resident" if message is not None else "vllm"  # type: ignore[assignment]
        return r

    def _send_resident(self, message: dict[str, Any], t: float) -> dict[str, float]:
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

    def _send_through_vllm(self, t: float) -> dict[str, float]:
        """vLLM's trainer engine sends the source (``t``: when the sync began)."""
        self.engine.send_weights()
        r = self._result(time.perf_counter() - t)
        r.update(gathers=float(self.source.gathers), gather_collectives=float(self.source.collectives),
                 local_shards=float(len(self.source.local)),
                 skipped=float(len(self.source.drop)))
        return r


def make_sender(backend: str, client: EngineFanOut, source: ParamSource, init: dict[str, Any],
                fmt: str = "auto") -> Sender:
    """The sender of a trainer rank. ``init``: master_address, master_port, world_size, packed, bucket_bytes,
    rank, trainer_world, timeout_s; ``fmt``: ``spec.weightSync.format``. Refuses an unsupported vLLM."""
    from rlhf_runtime.vllm import plugin as vllm_plugin

    vllm_compat.require_supported_vllm()
    vllm_plugin.register()
    return TrainerEngineSender(backend, client, source, init, fmt)
