"""The one interface of a rollout engine actor, and which class serves a job.

``RolloutEngine`` is what the driver and the trainer's ``weight_sync.EngineFanOut`` call on an engine actor:
start-up queries, ``generate``, the weight-transfer round trip of vLLM's API
(``init_weight_transfer_engine`` -> ``start_weight_update`` -> ``update_weights`` -> ``finish_weight_update``,
or all three in one ``update_weights_round``), the kernel-format layout query, the GPU query of validation
and sleep/wake. ``PausableEngine`` adds mid-request ``pause``/``resume`` (``weightSync.mode: async``);
``AdapterEngine`` adds ``load_adapter`` (``trainer.lora``).

Implementations, all on ``base.EngineBase`` (the shared start-up and queries): ``engines.Engine`` (sync
``vllm.LLM``: ``RolloutEngine`` + ``AdapterEngine``), ``engines.AsyncEngine`` (``AsyncLLM``) and
``stepped.SteppedEngine`` (an in-process ``LLM`` stepped by the actor), both ``PausableEngine``. The async classes implement the same methods as coroutines: through a Ray
actor handle (``handle.method.remote(...)``) a caller sees the same arguments and results either way, which is
the contract this module states (and ``tests/unit/test_runtime_engine_api.py`` checks method by method).
Arguments and results are plain Python data (dicts, lists, numbers), never vLLM objects.

Pure: importing it imports no engine class and nothing heavy.
"""

from __future__ import annotations

from typing import Any, Literal, Protocol, cast, runtime_checkable

AsyncEngineName = Literal["asyncllm", "stepped"]
ASYNC_ENGINES: tuple[str, ...] = ("asyncllm", "stepped")


@runtime_checkable
class RolloutEngine(Protocol):
    """What every engine actor serves (results as a Ray caller sees them)."""

    def build(self) -> float:
        """Build the vLLM engine of an actor made with ``build=False`` (a no-op once built); the seconds the
        build took."""
        ...

    def ready(self) -> float:
        """Seconds the engine took to start (returns once it is up)."""
        ...

    def startup(self) -> dict[str, Any]:
        """Where the actor's start went (Unix times and seconds): ``spawned``, ``init_began``,
        ``import_seconds``, ``built_at``, ``start_seconds`` (``rollout.base.EngineBase.startup``)."""
        ...

    def pid(self) -> int:
        """The actor's process id."""
        ...

    def world_size(self) -> int:
        """The engine's workers (tensor x pipeline parallel); ranks in the weight-transfer group."""
        ...

    def generate(self, prompts: list[list[int]], sampling: dict[str, Any]) -> list[dict[str, Any]]:
        """Per prompt: ``prompt_token_ids``, ``samples`` (token ids per sample), ``logprobs`` (per sample the
        engine's log-probability of each sampled token, after temperature and top-p, when the sampling asked for
        them, ``logprobs=0``; else None), ``finish_reasons`` and, on
        pausable engines, ``swap_index``. Never serves prefix-cache KV computed with replaced weights."""
        ...

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        """Join the weight-transfer group described by ``init_info`` (the backend's init info as a dict)."""
        ...

    def start_weight_update(self, checkpoint_format: bool = True) -> None:
        """Open a weight update: checkpoint format (HF names, layerwise reload) or the kernel format (the engine's
        own parameters, copied in place by the runtime's worker engines, ``weight_sync.kernel``); ValueError where
        the engine's weight-transfer backend cannot load it."""
        ...

    def update_weights(self, update_info: dict[str, Any]) -> None:
        """Receive one batch of tensors described by ``update_info`` (the backend's update info as a dict)."""
        ...

    def finish_weight_update(self) -> None:
        """Close the update; the next ``generate`` starts from an empty prefix cache."""
        ...

    def update_weights_round(self, update_info: dict[str, Any], checkpoint_format: bool = True) -> dict[str, float]:
        """start -> update -> finish in one call; the stage seconds ``start_s``, ``update_s``, ``finish_s``."""
        ...

    def param_layout(self) -> dict[str, Any]:
        """The engine's own parameters ``params`` [(name, shape)], ``packed_modules_mapping`` and
        ``world_size`` (for ``weight_sync.KernelPlan``)."""
        ...

    def device_info(self) -> dict[str, Any]:
        """(GPU) ``cuda_visible_devices`` of the actor and the least ``free``/``total`` bytes over its workers."""
        ...

    def sleep(self, level: int) -> None:
        """vLLM sleep mode (1: weights offloaded to CPU, 2: discarded); frees the GPU."""
        ...

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Wake (``tags``: ``["weights"]``, ``["kv_cache"]`` or all)."""
        ...


@runtime_checkable
class PausableEngine(RolloutEngine, Protocol):
    """An engine whose in-flight requests can be frozen for a weight swap (``weightSync.mode: async``)."""

    def pause(self, after_tokens: int = 0) -> None:
        """Freeze in-flight requests (keeping their KV); with ``after_tokens``, first let some live sample reach
        that many tokens (or nothing be live). Records each live sample's ``swap_index``."""
        ...

    def resume(self) -> None:
        """Continue the frozen requests (with the weights now in place)."""
        ...

    def requests_aborted(self) -> int:
        """How many requests ended unfinished because their ``generate`` call was cancelled (``ray.cancel``: a
        partial rollout's dropped group), each aborted in vLLM at once rather than run to its end."""
        ...

    def requests_live(self) -> int:
        """How many requests the engine has taken and not yet ended (running, queued or paused)."""
        ...


@runtime_checkable
class AdapterEngine(RolloutEngine, Protocol):
    """An engine that serves LoRA adapters (``trainer.lora``)."""

    def load_adapter(self, payload: dict[str, Any], adapter_id: int) -> dict[str, Any]:
        """Serve every later rollout with the adapter files of ``payload`` under LoRA id ``adapter_id``."""
        ...


def async_engines(spec: Any) -> bool:
    """Whether a job's engine actors are async actors (``engine_class``): in ``weightSync.mode: async`` and for
    multi-turn rollouts (``spec.environment``: every trajectory's turn is a call of its own, batched by the
    engine)."""
    return spec.weight_sync.mode == "async" or spec.environment is not None


def engine_class(async_mode: bool, async_engine: str = "asyncllm") -> type[RolloutEngine]:
    """The engine actor class of a job: ``engines.Engine`` in ``weightSync.mode: sync``; in async mode
    ``spec.rollout.asyncEngine``: ``asyncllm`` (``engines.AsyncEngine``) or ``stepped``
    (``stepped.SteppedEngine``). Imports the class's module (light: vLLM loads in the actor)."""
    if not async_mode:
        from rlhf_runtime.rollout.engines import Engine

        return Engine
    if async_engine == "asyncllm":
        from rlhf_runtime.rollout.engines import AsyncEngine

        return cast("type[RolloutEngine]", AsyncEngine)  # coroutines: the same results through Ray
    if async_engine == "stepped":
        from rlhf_runtime.rollout.stepped import SteppedEngine

        return cast("type[RolloutEngine]", SteppedEngine)
    raise ValueError(f"rollout.asyncEngine must be one of {', '.join(ASYNC_ENGINES)}, not {async_engine!r}")
