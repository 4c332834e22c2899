"""Weight-sync options: everything a trainer rank's sender reads, resolved once (``resolve``) from the job's
``weightSync`` and the facts of its layout, and passed whole to every trainer rank (``Trainer.init_weight_sync``).

The driver resolves them (``controller.sync.WeightSync.init_group``); a sender never changes them: other options
mean a new sender and a new weight-transfer group, as after an engine was replaced. The module imports neither
torch nor vLLM.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rlhf_api.models import WeightSync as WeightSyncSpec

BACKENDS = ("nccl", "ipc", "gloo")
FORMATS = ("auto", "checkpoint", "kernel")
#: Engine calls per NCCL or gloo sync (``fanout.EngineFanOut``): ``one`` ``update_weights_round`` call per engine,
#: ``three`` calls (start, update, finish) each waited on, or the three ``pipelined``: submitted back to back and
#: waited on once (engines that run calls one at a time, in order: ``weightSync.mode: sync``).
RPCS = ("one", "three", "pipelined")
#: Where the trainer ranks of an IPC sync exchange their buffers' handles (``ipc_exchange``).
EXCHANGES = ("nccl", "gloo")

#: What ``resolve``'s ``experimental`` mapping may set: variants that benchmarks and tests choose
#: (``benchmarks/gpu_sync.py``), not part of the job's spec. Name -> what it does (and its default).
EXPERIMENTAL: dict[str, str] = {
    "rpc": "engine calls per NCCL or gloo sync, one of RPCS (default: pipelined over NCCL into weightSync.mode "
           "sync engines, three into async ones, one over gloo; IPC syncs always make three)",
    "ipc_exchange": "where the trainer ranks of an IPC sync exchange their buffers' handles: nccl (vLLM's "
                    "all-gather over the default group, the default) or gloo (a host group of the same ranks)",
    "direct_fuse": "the direct NCCL sync into TP=1 engines sends a fused parameter (q, k, v; gate, up) as one "
                   "tensor, concatenated on a side stream (weight_sync.wire; default false)",
    "direct_packs": "the direct NCCL sync into TP=1 engines sends the entries under 64 KiB in packs, one "
                    "broadcast per pack (weight_sync.wire; default false)",
}


@dataclass(frozen=True)
class WeightSyncOptions:
    """A weight sync's options (``resolve`` builds them)."""

    backend: str  #: ``nccl``, ``ipc`` or ``gloo`` (CPU)
    format: str  #: the format asked for (``FORMATS``); the sender's kernel plan decides what ``auto`` takes
    packed: bool  #: whether the checkpoint format is sent packed (vLLM's packed buffers)
    kernel_packed: bool  #: the same for the kernel format; not packed over NCCL: the direct sync
    bucket_bytes: int  #: bytes per packed buffer, or per NCCL group of the direct sync
    timeout_s: float  #: the deadline of every engine call and collective of a sync
    rpc: str  #: engine calls per sync (``RPCS``)
    trainer_world: int = 1  #: the trainer's ranks (FSDP2); rank 0 sends
    ipc_exchange: str = "nccl"  #: ``EXCHANGES``
    direct_fuse: bool = False  #: ``EXPERIMENTAL``
    direct_packs: bool = False  #: ``EXPERIMENTAL``

    def packs(self, fmt: str) -> bool:
        """Whether a sync in the format ``fmt`` (``checkpoint`` or ``kernel``) is sent packed."""
        return self.kernel_packed if fmt == "kernel" else self.packed

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def default_rpc(backend: str, mode: str) -> str:
    """The engine calls per sync of ``backend`` into engines of ``weightSync.mode`` ``mode``. Pure."""
    if backend == "nccl":
        return "pipelined" if mode == "sync" else "three"
    return "one" if backend == "gloo" else "three"


def resolve(ws: WeightSyncSpec, *, backend: str, engine_worlds: Sequence[int], trainer_world: int,
            experimental: Mapping[str, Any] | None = None) -> WeightSyncOptions:
    """The options of a sync from ``ws`` (the job's ``weightSync``; ``backend`` replaces its backend: ``gloo``
    where the trainer has no GPU), the engines' world sizes, the trainer's ranks and ``experimental``
    (``EXPERIMENTAL``). Raises ValueError, naming the option, for a combination that cannot run. Pure.

    ``weightSync.packed`` unset: the kernel format over NCCL from a one-GPU trainer into TP=1 engines is the
    direct sync (not packed), every other sync packed; a value set applies to every format."""
    if backend not in BACKENDS:
        raise ValueError(f"weight-sync backend must be one of {', '.join(BACKENDS)}, not {backend!r}")
    if ws.format not in FORMATS:
        raise ValueError(f"weightSync.format must be one of {', '.join(FORMATS)}, not {ws.format!r}")
    extra = dict(experimental or {})
    unknown = sorted(set(extra) - set(EXPERIMENTAL))
    if unknown:
        raise ValueError(f"unknown experimental weight-sync options {unknown}: known are {', '.join(EXPERIMENTAL)}")
    direct = backend == "nccl" and all(w == 1 for w in engine_worlds) and trainer_world == 1
    kernel_packed = bool(ws.packed) if ws.packed is not None else not direct
    rpc = extra.get("rpc") or default_rpc(backend, ws.mode)
    if rpc not in RPCS:
        raise ValueError(f"rpc must be one of {', '.join(RPCS)}, not {rpc!r}")
    if rpc != "three" and backend == "ipc":
        raise ValueError(f"rpc {rpc} applies to nccl and gloo syncs; an ipc sync makes vLLM's calls per chunk "
                         "(or the resident sync's one call)")
    if rpc == "pipelined" and ws.mode != "sync":
        raise ValueError("rpc pipelined needs weightSync.mode sync (engines that run calls one at a time, in order)")
    exchange = extra.get("ipc_exchange", "nccl")
    if exchange not in EXCHANGES:
        raise ValueError(f"ipc_exchange must be one of {', '.join(EXCHANGES)}, not {exchange!r}")
    if exchange != "nccl" and backend != "ipc":
        raise ValueError(f"ipc_exchange {exchange} applies to the ipc backend, not {backend}")
    wire = {k: extra.get(k, False) for k in ("direct_fuse", "direct_packs")}
    for name, on in wire.items():
        if not isinstance(on, bool):
            raise TypeError(f"{name} must be true or false, not {on!r}")
        if on and (backend != "nccl" or kernel_packed):
            raise ValueError(f"{name} applies to the direct NCCL sync (backend nccl, kernel format, not packed)")
    return WeightSyncOptions(
        backend=backend, format=ws.format, packed=ws.packed is not False, kernel_packed=kernel_packed,
        bucket_bytes=ws.bucket_size_mb << 20, timeout_s=float(ws.timeout_seconds), rpc=rpc,
        trainer_world=trainer_world, ipc_exchange=exchange, **wire)
