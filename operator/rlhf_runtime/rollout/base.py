"""What every engine actor shares: the start-up, the state of the weight-format switch and the start-up queries.

``EngineBase`` is the base of ``engines.Engine`` (a sync Ray actor) and, through ``AsyncEngineBase``, of
``engines.AsyncEngine`` and ``stepped.SteppedEngine`` (async Ray actors: every method a coroutine, one event loop;
Ray makes an actor async when any of its methods is one, so the sync base has none).

* Options: one ``rollout.options.EngineOptions`` (the engine arguments and the actor's environment).
* Start-up, in two phases: ``EngineBase.__init__`` sets the actor's environment and imports vLLM (the
  process's slow part, ~20 s on a GPU node); ``build()`` (``_build_now``: the subclass's ``_make_engine`` with
  ``llm_args``: the supported-version check ``vllm.compat.require_supported_vllm``, the runtime's vLLM plugin, i.e.
  the ``gloo`` backend and the kernel-format worker engines, and vLLM's weight-transfer config) builds the vLLM
  engine and sets ``start_seconds``. Built at once unless the actor is made with ``build=False``: a colocated
  engine on GPUs is created beside the trainers (its imports overlap theirs) and built after them, since vLLM
  sizes its KV cache from the GPU memory it sees free while it starts (unless ``rollout.kvCacheMemoryGiB`` gives
  the size: then it is built at once). ``build()`` is idempotent.
* Queries (``ready``, ``pid``, ``world_size``, ``param_layout``, ``device_info``): computed here from two things a
  subclass provides, its ``_vllm_config()`` and its ``_collective_rpc(fn, args)`` (awaitable on the async ones);
  ``AsyncEngineBase`` serves the same answers as coroutines. ``startup``: where the actor's start went (its
  process created, vLLM imported, the engine built), for the progress file's actors record.
* The kernel-format switch: ``_kernel`` is what the engine's workers were last told (``workers.format_rpc``);
  ``_stale_cache`` marks prefix-cache KV computed with weights a sync has since replaced (reset before the next
  ``generate``). ``AsyncEngineBase`` also holds the async engines' ``start_weight_update`` and
  ``update_weights_round``, and ``version``, bumped by ``resume()`` after a swap.

Import only inside Ray actors (nothing heavy at import time; vLLM is imported when an engine actor starts).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

from rlhf_runtime.infra import startup
from rlhf_runtime.rollout import workers
from rlhf_runtime.rollout.options import EngineOptions


def _prepare_env(options: EngineOptions) -> None:
    """The actor's environment before vLLM is imported. An engine whose workers are Ray actors (TP>1) holds
    no GPU itself, and Ray hides every GPU from such an actor (``CUDA_VISIBLE_DEVICES=""``); the engine
    process must still see the node's GPUs (platform and device checks), as vLLM's RLHF examples do."""
    os.environ.update(options.env)
    if options.kwargs.get("distributed_executor_backend") == "ray" and os.environ.get("CUDA_VISIBLE_DEVICES") == "":
        del os.environ["CUDA_VISIBLE_DEVICES"]


def llm_args(kwargs: dict[str, Any]) -> dict[str, Any]:
    """vLLM's engine arguments from the runtime's (``weight_transfer_backend``: ``spec.weightSync.backend``, built
    as the runtime's worker engine of that backend, ``vllm.compat.ENGINE_BACKENDS``), after the version check and
    the plugin's registration."""
    from vllm.config import WeightTransferConfig

    from rlhf_runtime.vllm import compat as vllm_compat
    from rlhf_runtime.vllm import plugin as vllm_plugin

    vllm_compat.require_supported_vllm()  # a clear error before vLLM builds anything
    vllm_plugin.register()  # in-process engines (uni executor) do not always load plugins before use
    kw = dict(kwargs)
    backend = kw.pop("weight_transfer_backend")
    backend = vllm_compat.ENGINE_BACKENDS.get(backend, backend)  # the runtime's: they also load the kernel format
    kw["weight_transfer_config"] = WeightTransferConfig(backend=backend)
    return kw


def sampled_logprobs(completion: Any) -> list[float] | None:
    """The log-probability vLLM reported for each sampled token of ``completion`` (a ``CompletionOutput`` of a
    request with ``logprobs=0``; processed, i.e. after temperature and top-p, with the engine's
    ``logprobs_mode`` ``processed_logprobs``), or None when it reported none."""
    lps = getattr(completion, "logprobs", None)
    if lps is None:
        return None
    return [float(d[t].logprob) for t, d in zip(completion.token_ids, lps)]


class EngineBase:
    """The start-up, state and queries every engine actor shares (see the module's docstring). A subclass calls
    ``EngineBase.__init__`` first, sets up its own state, and ends its ``__init__`` with ``if build:
    self._build_now()``; it implements ``_make_engine`` (build the vLLM engine from ``llm_args(kwargs)``),
    ``_vllm_config`` and ``_collective_rpc``."""

    def __init__(self, options: EngineOptions, build: bool = True) -> None:
        # where this actor's start went (``startup``): its process created, this constructor begun, vLLM
        # imported (``import_seconds``), the engine built (``built_at``, after ``start_seconds``)
        self.spawned, self.init_began = startup.process_started(), time.time()
        self.built_at: float | None = None
        _prepare_env(options)
        self.options = options
        self.built = False
        self.start_seconds = 0.0  # how long the vLLM engine took to build (``ready``, ``build``)
        self._kernel = False  # the kernel-format switch last sent to the workers
        self._stale_cache = False  # prefix-cache KV computed with weights that a sync has since replaced
        t = time.perf_counter()
        import vllm  # noqa: F401 - the slow imports now, while whatever the engine waits for loads
        from vllm import LLM  # noqa: F401

        self.import_seconds = time.perf_counter() - t

    def _make_engine(self, kwargs: dict[str, Any]) -> None:
        """Build the vLLM engine (the subclass's ``self.llm`` ...) from the runtime's engine arguments."""
        raise NotImplementedError

    def _build_now(self) -> float:
        """The vLLM engine built, unless it is; ``start_seconds``."""
        if not self.built:
            t = time.perf_counter()
            self._make_engine(self.options.kwargs)
            self.start_seconds = time.perf_counter() - t
            self.built, self.built_at = True, time.time()
        return self.start_seconds

    def build(self) -> float:
        """Build the vLLM engine of an actor made with ``build=False`` (a no-op on a built one); the seconds the
        build took."""
        return self._build_now()

    def _vllm_config(self) -> Any:
        """The engine's ``VllmConfig``."""
        raise NotImplementedError

    def _collective_rpc(self, fn: Callable[..., Any], args: tuple = ()) -> Any:
        """``fn(worker, *args)`` on every worker of the engine: their results (awaitable on async engines)."""
        raise NotImplementedError

    def ready(self) -> float:
        return self.start_seconds

    def startup(self) -> dict[str, Any]:
        """Where this actor's start went, as Unix times and seconds: ``spawned`` (its process created; None where
        ``/proc`` does not say), ``init_began`` (its constructor), ``import_seconds`` (vLLM's imports, in the
        constructor), ``built_at`` (the engine built; None until it is) and ``start_seconds`` (the build)."""
        return {"spawned": self.spawned, "init_began": self.init_began, "import_seconds": self.import_seconds,
                "built_at": self.built_at, "start_seconds": self.start_seconds}

    def pid(self) -> int:
        """The actor's process id (reported in the progress file: which process serves which engine)."""
        return os.getpid()

    def world_size(self) -> int:
        return int(self._vllm_config().parallel_config.world_size)

    def param_layout(self) -> dict[str, Any]:
        return workers.engine_layout(self._collective_rpc(workers.worker_param_layout))

    def device_info(self) -> dict[str, Any]:
        """(GPU) The actor's visible GPUs and the least free/total memory over its workers' GPUs."""
        return workers.engine_device_info(self._collective_rpc(workers.worker_memory))


class AsyncEngineBase(EngineBase):
    """``EngineBase`` for async actors (``AsyncEngine``, ``SteppedEngine``): the same queries as coroutines, and
    the weight-update calls they share. A subclass implements ``_collective_rpc`` and ``_start_update`` as
    coroutines, and ``update_weights`` / ``finish_weight_update``."""

    def __init__(self, options: EngineOptions, build: bool = True) -> None:
        super().__init__(options, build)
        self.version = 0  # bumped by resume() after a swap
        self._paused = False
        self.aborted = 0  # requests ended unfinished because their caller cancelled the call

    async def requests_aborted(self) -> int:
        """How many requests this engine ended unfinished because their ``generate`` call was cancelled (a
        partial rollout's dropped group)."""
        return self.aborted

    async def requests_live(self) -> int:
        """How many requests this engine has taken and not yet ended (running, queued or paused)."""
        return len(self._live)

    async def _start_update(self) -> None:
        """vLLM's ``start_weight_update()`` on this engine."""
        raise NotImplementedError

    async def build(self) -> float:  # type: ignore[override]
        return self._build_now()  # blocks the event loop: nothing else can run on an engine not built yet

    async def ready(self) -> float:  # type: ignore[override]
        return EngineBase.ready(self)

    async def startup(self) -> dict[str, Any]:  # type: ignore[override]
        return EngineBase.startup(self)

    async def pid(self) -> int:  # type: ignore[override]
        return EngineBase.pid(self)

    async def world_size(self) -> int:  # type: ignore[override]
        return EngineBase.world_size(self)

    async def param_layout(self) -> dict[str, Any]:  # type: ignore[override]
        return workers.engine_layout(await self._collective_rpc(workers.worker_param_layout))

    async def device_info(self) -> dict[str, Any]:  # type: ignore[override]
        """(GPU) See ``EngineBase.device_info``."""
        return workers.engine_device_info(await self._collective_rpc(workers.worker_memory))

    async def start_weight_update(self, checkpoint_format: bool = True) -> None:
        rpc = workers.format_rpc(checkpoint_format, self._kernel)
        if rpc is not None:
            await self._collective_rpc(rpc[0], rpc[1])
            self._kernel = not checkpoint_format
        await self._start_update()

    async def update_weights_round(self, update_info: dict[str, Any],
                                   checkpoint_format: bool = True) -> dict[str, float]:
        """start -> update -> finish in one actor call (see ``engines.Engine.update_weights_round``); stage
        seconds."""
        t0 = time.perf_counter()
        await self.start_weight_update(checkpoint_format)
        t1 = time.perf_counter()
        await self.update_weights(update_info)  # type: ignore[attr-defined]
        t2 = time.perf_counter()
        await self.finish_weight_update()  # type: ignore[attr-defined]
        return {"start_s": t1 - t0, "update_s": t2 - t1, "finish_s": time.perf_counter() - t2}
