"""Senders: one ``send()`` per sync, from trainer rank 0 (other ranks take part in the gathers).

``make_sender`` picks by what the installed vLLM has (``vllm_compat.has_trainer_api``):

* vLLM >= 0.28 (CPU CI: 0.32; GPU target 0.33): ``TrainerEngineSender``, the backend's trainer-side
  ``TrainerWeightTransferEngine`` (``WeightTransferTrainerFactory.trainer_init(init_info, client=..., source=...)``);
* vLLM 0.24 (GPU image): ``RuntimeDrivenSender``, which drives the same round trip itself and sends with
  ``NCCLWeightTransferEngine.trainer_send_weights`` / ``IPCWeightTransferEngine`` or the runtime's producers.
"""

from __future__ import annotations

import math
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from typing import Any

import torch

from rlhf_runtime.vllm import compat as vllm_compat
from rlhf_runtime.weight_sync.fanout import EngineFanOut
from rlhf_runtime.weight_sync.formats import DEFAULT_OPTIONS, KernelPlan, effective_format
from rlhf_runtime.weight_sync.producers import IPCBufferProducer, PackedProducer, ParamSource, ResidentExport


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
    want the same tensors: TP > 1 and engines holding different experts (expert parallelism) refuse."""
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
        if plan.ok and plan.tp > 1 else set()
    unused = source.unneeded(plan.used_sources()) if plan.ok else set()
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return set(), unused  # one rank: nothing is a shard, and nothing it skips is a collective
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (sorted(local), sorted(unused)))
    return (set.intersection(*(set(x[0]) for x in everyone)), set.intersection(*(set(x[1]) for x in everyone)))


#: Whether the kernel format sends each FSDP2 rank's own shard where it is the TP engine worker's shard
#: (``agreed_gathers``: no gather for column- and vocabulary-parallel weights; IPC from FSDP2 ranks into a TP
#: engine) and skips the trainer parameters no engine takes (a tied head's second name), unless
#: ``configure(lean_gathers=...)`` says otherwise. On since the fresh-engine check passed on vLLM 0.33.0, 2xH200,
#: 2026-11-26 (Qwen3-1.7B, FSDP2x2 colocated: into one TP=2 engine 276 ms vs 366 ms with every gather, and into two
#: TP=1 engines 356 vs 396 ms; greedy tokens equal after the syncs; benchmarks/README.md, sixth round).
LEAN_GATHERS_DEFAULT = True

#: The engine calls of a sync over NCCL or gloo (``configure(rpc=...)``): ``three`` (start, update, finish, each
#: waited on), ``one`` (``EngineFanOut.one_round``: one ``update_weights_round`` call per engine) or ``pipelined``
#: (``EngineFanOut.pipelined``: the three calls submitted back to back, one wait; engines of ``weightSync.mode:
#: sync`` only, three elsewhere).
RPC_MODES = ("one", "three", "pipelined")

#: Engine calls per sync over NCCL on vLLM >= 0.28 unless ``configure(rpc=...)`` says otherwise (see
#: ``TrainerEngineSender.__init__``); the CPU backend (gloo) takes ``DEFAULT_OPTIONS["rpc"]``. ``pipelined``:
#: vLLM's own three worker calls (the path validated first), one round trip; on vLLM 0.33.0, 2xH200, 2026-11-26
#: (Qwen3-1.7B, 4.06 GB) 16.0 ms, 68.8% of the raw NCCL broadcast, vs 18.0 ms (61.2%) with three waits; the one-call
#: round (``rpc="one"``) took 15.0 ms (73.7%) and validated there too, but did not finish on 2xH100 on 2026-11-25
#: (cause not found), so it stays opt-in.
NCCL_RPC_DEFAULT = "pipelined"


def default_rpc(backend: str) -> str:
    """The engine calls per sync a ``TrainerEngineSender`` of ``backend`` starts with (``configure(rpc=None)``
    goes back to it). Pure."""
    return NCCL_RPC_DEFAULT if backend == "nccl" else str(DEFAULT_OPTIONS["rpc"])


def auto_keeps_checkpoint() -> str | None:
    """vLLM >= 0.28: why ``weightSync.format: auto`` stays with the checkpoint format although the kernel format
    may apply (not validated on GPUs on this vLLM; ``format: kernel`` opts in), else None. The same on every
    trainer rank, so all ranks or none build the kernel plan (a collective). Pure.

    Validated on GPUs (greedy tokens of a fresh engine equal the synced engine's), vLLM 0.33: NCCL, IPC from one
    trainer GPU, IPC from FSDP2x2 into two TP=1 engines (DP2, Qwen3-1.7B) and into two expert-parallel engines
    (EP2, Qwen3-30B-A3B shape), 2xH200, 2026-11-24; IPC from FSDP2x2 into one TP=2 engine (each rank sends its
    GPU's shard; Qwen3-1.7B), 2xH100, 2026-11-25. So no layout the plan covers is held back any more; a layout
    that is not validated would be named here."""
    if not vllm_compat.AUTO_KERNEL_SINCE_TRAINER_API:
        return "auto keeps the checkpoint format on this vLLM until the kernel format is validated on GPUs"
    return None


class TrainerEngineSender(Sender):
    """vLLM >= 0.28: the backend's ``TrainerWeightTransferEngine`` drives the round trip ``start_weight_update``
    -> ``update_weights`` (concurrent with the send) -> ``finish_weight_update``.

    ``fmt`` (``spec.weightSync.format``, ``formats.effective_format``): the kernel format sends the engine's own
    parameters (``KernelPlan``, built on every rank from the engines' layout, so every rank iterates and, for
    IPC, exports the same names and shapes; with TP > 1 over IPC each rank its GPU's worker's shard) as the
    stream of the same trainer engine, and switches the engines' workers to copying them in place
    (``kernel_transfer``; ``EngineFanOut.checkpoint_format``); the checkpoint
    format streams HF names into vLLM's layerwise reload. The gloo backend (CPU: vLLM prepacks linear weights
    there) loads the checkpoint format only. ``auto`` takes the kernel format where its plan applies and the path
    was validated on GPUs (``auto_keeps_checkpoint``), else the checkpoint format.

    IPC in the kernel format from one trainer worker whose planned tensors are all views of its parameters
    (``ResidentExport``): the engines map the parameters once and a sync is one call per engine
    (``EngineFanOut.update_round``: start, a multi-tensor copy, finish inside the engine), instead of vLLM's
    trainer engine (a staging copy per sync, three calls per engine and one more per chunk). ``configure(
    ipc_resident=False)`` keeps vLLM's path (the benchmark compares both in one run).

    NCCL and gloo: vLLM's trainer engine calls the client's start, update (beside its broadcast) and finish;
    with ``rpc="one"`` (``formats.DEFAULT_OPTIONS``, gloo's default) the client makes them one
    ``update_weights_round`` call per engine (``EngineFanOut.one_round``): one Ray round trip per sync instead of
    three, as the 0.24 sender's default, from the second sync of a format on (the first still makes three calls,
    so an engine that cannot start raises before the broadcast); with ``rpc="pipelined"`` (NCCL's default,
    ``NCCL_RPC_DEFAULT``; sync-mode engines, three elsewhere) the three calls are submitted back to back and
    waited on once (``EngineFanOut.pipelined``). ``configure(rpc="three")`` waits on each."""

    def __init__(self, backend: str, client: EngineFanOut, source: ParamSource, init: dict[str, Any],
                 fmt: str = "auto") -> None:
        factory = vllm_compat.trainer_factory()
        self.backend, self.client, self.source = backend, client, source
        self.trainer_world = int(init.get("trainer_world", 1))
        self.plan: KernelPlan | None = None
        self.auto_reason: str | None = None
        self.resident: ResidentExport | None = None
        self.ipc_resident = True  # the resident path where it applies (configure: off for comparisons)
        self.lean_gathers = LEAN_GATHERS_DEFAULT  # see LEAN_GATHERS_DEFAULT (configure: lean_gathers)
        self.agreed: tuple[set[str], set[str]] | None = None  # agreed_gathers of the kernel plan (_agree)
        #: "one": one engine call per sync (gloo); NCCL pipelines vLLM's three calls (see NCCL_RPC_DEFAULT)
        self.rpc = default_rpc(backend)
        if backend == "gloo":
            from rlhf_runtime.weight_sync.gloo import GlooTrainerInitInfo

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

            info = IPCTrainerInitInfo(packed=init["packed"], packed_buffer_size_bytes=init["bucket_bytes"],
                                      rank=init.get("rank", 0))
        else:
            raise ValueError(f"unknown weight-transfer backend {backend!r}")
        self._resolve(fmt)
        self.engine = factory.trainer_init(info, client=client, source=self._weight_source())
        self._set_rounds()

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
            self.format = effective_format(fmt, self.plan)
        self.client.checkpoint_format = self.format == "checkpoint"
        self._use_agreed_gathers()
        plan = self.plan
        one_gpu = self.trainer_world == 1 and plan is not None and plan.tp == 1
        if self.backend == "ipc" and self.format == "kernel" and one_gpu and self.resident is None:
            self.resident = ResidentExport(plan, self.source)

    def _agree(self) -> None:
        """``agreed_gathers`` for the kernel plan (built once per sender), once: a collective, so every rank calls
        this at the same point (plan time, or ``configure(lean_gathers=True)`` sent to every rank). With the option
        off (``configure(lean_gathers=False)`` before the plan) the ranks never make it."""
        if self.plan is not None and self.agreed is None:
            self.agreed = agreed_gathers(self.plan, self.source)

    def _use_agreed_gathers(self) -> None:
        """Send the agreed names ungathered or not at all (``agreed``) where the option is on and the kernel plan
        is in use; every name gathered otherwise (the checkpoint format sends every tensor whole)."""
        on = self.lean_gathers and self.format == "kernel"
        local, unused = self.agreed if on and self.agreed is not None else (set(), set())
        self.source.local, self.source.drop = set(local), set(unused)  # KernelPlan.iterate reads source.local

    def _weight_source(self) -> Any:
        if self.format != "kernel":
            return self.source.as_weight_source()
        plan, dtype = self.plan, self.source.dtype
        assert plan is not None
        names, _, shapes = plan.metadata(dtype)
        meta = [vllm_compat.param_meta(n, dtype, tuple(sh)) for n, sh in zip(names, shapes)]
        return vllm_compat.as_weight_source(lambda: meta, lambda: plan.iterate(self.source, fuse=True))

    def configure(self, **options: Any) -> dict[str, Any]:
        """Change the weight format (``format``), the resident IPC path (``ipc_resident``), the gathers the kernel
        plan needs only (``lean_gathers``: ``agreed_gathers``) or the engine calls per sync (``rpc``: one of
        ``RPC_MODES``) for later syncs (the benchmark compares them in one run); ``None`` for ``rpc`` or
        ``lean_gathers`` goes back to the default;
        returns what is in use, the plan's reason and the options this sender does not take."""
        if "format" in options:
            self._resolve(options.pop("format"))
            self.engine.source = self._weight_source()
        if "ipc_resident" in options:
            self.ipc_resident = bool(options.pop("ipc_resident"))
        if "lean_gathers" in options:  # turning it on agrees on the gathers first: send it to every rank
            lean = options.pop("lean_gathers")
            self.lean_gathers = LEAN_GATHERS_DEFAULT if lean is None else bool(lean)
            if self.lean_gathers:
                self._agree()
            self._use_agreed_gathers()
        if "rpc" in options:
            rpc = options.pop("rpc")
            rpc = default_rpc(self.backend) if rpc is None else rpc
            if rpc not in RPC_MODES:
                raise ValueError(f"rpc must be one of {', '.join(RPC_MODES)}, not {rpc!r}")
            self.rpc = rpc
            self._set_rounds()
        out: dict[str, Any] = {"format": self.format,
                               "kernel_plan": self.auto_reason or (None if self.plan is None else self.plan.reason),
                               "ipc_resident": self._resident_on(),
                               "rpc": "one" if self.client.one_round else "pipelined" if self.client.pipelined
                               else "three",
                               "local_shards": len(self.source.local), "skipped": len(self.source.drop),
                               "ipc_resident_reason": None if self.resident is None else self.resident.reason}
        if options:
            out["unsupported"] = sorted(options)
        return out

    def _resident_on(self) -> bool:
        return self.ipc_resident and self.resident is not None and self.format == "kernel"

    def send(self) -> dict[str, float]:
        self.client.new_sync()
        t = time.perf_counter()
        message = self.resident.message() if self._resident_on() else None  # type: ignore[union-attr]
        if message is not None:
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
        else:
            self.engine.send_weights()
            r = self._result(time.perf_counter() - t)
            r.update(gathers=float(self.source.gathers), local_shards=float(len(self.source.local)),
                     skipped=float(len(self.source.drop)))
        r["format"] = self.format  # type: ignore[assignment]
        if self.backend == "ipc":  # which IPC path ran (ResidentExport.reason says why not resident)
            r["ipc"] = "resident" if message is not None else "vllm"  # type: ignore[assignment]
        return r


class RuntimeDrivenSender(Sender):
    """vLLM 0.24 (no trainer-side engines): the runtime drives start -> update (beside the trainer's send) ->
    finish itself, over NCCL or CUDA IPC.

    Only rank 0 joins the engines' NCCL group and talks to the engines; other FSDP ranks iterate the source
    beside it (``full_tensor()`` is a collective) and, for IPC, contribute their GPU's handles (vLLM
    all-gathers them; rank 0 sends the merged handles to every engine).

    ``options`` (``configure``) pick the producer, the engine calls and the weight format:

    * ``producer``: ``"runtime"``: ``PackedProducer`` (persistent double buffers reused across syncs, packing
      of chunk k+1 overlapped with the broadcast of chunk k); ``"vllm"``: vLLM's
      ``packed_nccl_broadcast_producer`` (fresh ``torch.cat`` buffers every chunk). Both produce the wire
      format vLLM's consumer expects (chunks cut after the first tensor that takes them past the bucket).
    * ``rpc``: ``"one"`` (default): a single ``update_weights_round`` call per engine does
      ``start_weight_update``, ``update_weights`` and ``finish_weight_update`` (two Ray round trips fewer per
      sync; NCCL, and IPC when the model fits one bucket); ``"three"``: three separate calls per engine.
    * IPC, single trainer worker, kernel format, packed: ``producer="runtime"`` is ``IPCBufferProducer``
      (persistent buffers, chunks pipelined, ``ipc_wire`` ``"packed"``/``"views"``, ``rpc="one"`` when the
      model fits one bucket); ``producer="vllm"`` is vLLM's ``IPCWeightTransferEngine.trainer_send_weights``.
    * ``format`` (``spec.weightSync.format``; ``formats.effective_format``): ``"auto"`` (default) the kernel
      format where ``KernelPlan`` covers the engines' parameters, else checkpoint; ``"kernel"`` the same but
      refused (ValueError) where the plan does not apply; ``"checkpoint"``: HF names, vLLM's layerwise reload.

    Defaults: ``formats.DEFAULT_OPTIONS``, the fast path measured in ``benchmarks/README.md``.
    """

    def __init__(self, backend: str, client: EngineFanOut, source: ParamSource, init: dict[str, Any],
                 fmt: str = "auto") -> None:
        self.backend, self.client, self.source, self.init = backend, client, source, init
        self.rank = int(init.get("rank", 0))
        self.is_sender = self.rank == 0
        self.group: Any = None
        self.options: dict[str, Any] = {**DEFAULT_OPTIONS, "format": fmt}
        self.format = "checkpoint"  # the format in force (``effective_format`` of the options and the plan)
        self.producer: PackedProducer | None = None
        self.ipc_producer: IPCBufferProducer | None = None
        self.plan: KernelPlan | None = None
        self.sent_bytes: int | None = None
        self.trainer_send_s = 0.0
        self.pack_s = 0.0
        if backend == "nccl":
            if not self.is_sender:
                self.configure()  # every rank must iterate the same tensors
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
        self.configure()  # the kernel format asks the engines for their layout once, here

    def configure(self, **options: Any) -> dict[str, Any]:
        """Change sender options (``producer``, ``format``, ``rpc``, ``ipc_wire``, ``packed``,
        ``bucket_bytes``) for later syncs (``None``: back to the default); returns the options in force,
        ``format`` being the one in use."""
        for k in ("packed", "bucket_bytes"):
            if k in options:
                self.init[k] = options.pop(k)
        for k, v in options.items():
            if v is not None:
                self.options[k] = v
            elif k in DEFAULT_OPTIONS:
                self.options[k] = DEFAULT_OPTIONS[k]
            else:
                self.options.pop(k, None)
        requested = self.options.get("format", "auto")
        if requested != "checkpoint" and self.plan is None:
            if self.backend == "ipc" and int(self.init.get("trainer_world", 1)) > 1:
                # every IPC rank exports its own GPU's tensors: each plans them (kernel_plan; TP > 1: its GPU's
                # worker's shard). Opt-in (format: kernel) until validated on GPUs; auto keeps checkpoint.
                self.plan = (kernel_plan(self.source, self.client, self.backend) if requested == "kernel" else
                             KernelPlan([], False, "kernel format with IPC from several trainer workers is opt-in "
                                                   "(format: kernel) until validated on GPUs"))
            elif self.is_sender:
                self.plan = one_stream_plan(self.source, self.client.engine_layouts())
        if self.is_sender or self.backend == "ipc":
            self.format = effective_format(requested, self.plan)
        # a non-sending NCCL rank only iterates the source (the sender's plan pulls it in the same order)
        return {**self.options, "format": self.format, "packed": self.init["packed"],
                "bucket_bytes": self.init["bucket_bytes"],
                "kernel_plan": None if self.plan is None else self.plan.reason}

    def _kernel(self) -> bool:
        """The kernel format is in use (its plan covers the engines' parameters)."""
        return self.format == "kernel" and self.plan is not None and self.plan.ok

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
        names, dtypes, shapes = self.source.wire_metadata()
        return iter(self.source), names, dtypes, shapes

    def send(self) -> dict[str, float]:
        self.client.new_sync()
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
            if vllm_compat.nccl_takes_bucket_size(NCCLWeightTransferUpdateInfo):  # both sides cut the same chunks
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
                    if vllm_compat.nccl_takes_bucket_size(NCCLTrainerSendWeightsArgs):
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
        if self.is_sender and self.sent_bytes is not None:
            r["bytes"] = float(self.sent_bytes)  # what went over the wire (the kernel format drops aliases)
        r["trainer_send_s"] = self.trainer_send_s
        r["pack_s"] = self.pack_s
        r["format"] = self.format  # type: ignore[assignment]
        return r


def make_sender(backend: str, client: EngineFanOut, source: ParamSource, init: dict[str, Any],
                fmt: str = "auto") -> Sender:
    """The sender for the installed vLLM. ``init``: master_address, master_port, world_size, packed, bucket_bytes,
    rank, trainer_world, timeout_s; ``fmt``: ``spec.weightSync.format``."""
    from rlhf_runtime.vllm import plugin as vllm_plugin

    vllm_compat.require_supported_vllm()
    vllm_plugin.register()
    if vllm_compat.has_trainer_api():
        return TrainerEngineSender(backend, client, source, init, fmt)
    return RuntimeDrivenSender(backend, client, source, init, fmt)
