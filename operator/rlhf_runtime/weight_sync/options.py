"""Weight-sync options: everything a trainer rank's sender reads, resolved once (``resolve``) from the job's
``weightSync`` and the facts of its layout, and passed whole to every trainer rank (``Trainer.init_weight_sync``).

The driver resolves them (``controller.sync.WeightSync.init_group``); a sender never changes them: other options
mean a new sender and a new weight-transfer group, as after an engine was replaced. Imports neither torch nor vLLM.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rlhf_api.models import WeightSync as WeightSyncSpec

BACKENDS = ("nccl", "ipc", "gloo")
FORMATS = ("auto", "checkpoint", "kernel")
#: Engine calls per sync (``fanout.EngineFanOut``): vLLM's three (start, update, finish), each waited on
#: (``three``), or submitted back to back and waited on twice (``pipelined``: only engine actors that run calls
#: one at a time, in order, the synchronous ``rollout.engines.Engine``: Ray starts an async actor's calls without
#: waiting for those before them, so an update could reach vLLM before its start; not IPC, whose trainer engine
#: updates chunk by chunk).
RPCS = ("three", "pipelined")


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

    def packs(self, fmt: str) -> bool:
        """Whether a sync in the format ``fmt`` (``checkpoint`` or ``kernel``) is sent packed."""
        return self.kernel_packed if fmt == "kernel" else self.packed

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def resolve(ws: WeightSyncSpec, *, backend: str, engine_worlds: Sequence[int],
            trainer_world: int, async_engines: bool = False) -> WeightSyncOptions:
    """The options of a sync from ``ws`` (the job's ``weightSync``; ``backend``: ``gloo`` where the trainer has no
    GPU), the engines' world sizes, the trainer's ranks and whether the engine actors are async actors
    (``rollout.api.async_engines``); ValueError naming a value that cannot run. Pure.
    ``packed`` unset: not packed only for the kernel format over NCCL from one trainer GPU into TP=1 engines (the
    direct sync); a value set applies to every format."""
    if backend not in BACKENDS:
        raise ValueError(f"weight-sync backend must be one of {', '.join(BACKENDS)}, not {backend!r}")
    if ws.format not in FORMATS:
        raise ValueError(f"weightSync.format must be one of {', '.join(FORMATS)}, not {ws.format!r}")
    direct = backend == "nccl" and all(w == 1 for w in engine_worlds) and trainer_world == 1
    return WeightSyncOptions(
        backend=backend, format=ws.format, packed=ws.packed is not False,
        kernel_packed=bool(ws.packed) if ws.packed is not None else not direct,
        bucket_bytes=ws.bucket_size_mb << 20, timeout_s=float(ws.timeout_seconds),
        rpc="three" if backend == "ipc" or async_engines or ws.mode == "async" else "pipelined", trainer_world=trainer_world)
