"""Benchmark-only hooks on the runtime's actors, kept out of the production classes.

``BenchEngine`` / ``BenchAsyncEngine`` / ``BenchSteppedEngine`` add to the engine actor classes
(``rlhf_runtime.rollout.api.engine_class``):

* ``scramble_weights(seed)``: overwrite every parameter with noise, so a sync that misses a tensor shows in
  the greedy tokens;
* ``load_stats(reset, device_sync)``: per worker, seconds spent in ``model.load_weights`` and in the weight-transfer
  engine's start/receive/finish since the last reset (installs host-side timers the first time, ``TIMED``);
* ``timed_generate(prompts, sampling)``: the actor's own ``LLM.generate`` on a batch, timed inside the actor
  (no Ray transfer, no result packing): seconds and tokens (sync ``Engine`` only);
* ``direct_timeline()``: per worker, the direct NCCL sync's timeline since the last call (``DirectTimeline``:
  wall-clock instants of the receive and its groups, each group's GPU time);
* ``reset_prefix_cache()``: drop the prefix cache now (a cached prefix takes another prefill path than a cold
  one, so greedy comparisons start cold); whether vLLM did.

``BenchTrainer`` adds ``direct_timeline()``, the trainer side's timeline, and ``send_stats(reset)``: seconds in
the steps of vLLM's IPC trainer engine that no RPC times (``IPC_TRAINER_TIMED``; installs the timers the first
time). The sync's variants are chosen through its options (``weight_sync.options``), never here.

Every one of these actors prints the Python stack of each of its threads to its stderr (Ray keeps it in the
actor's worker log) on ``SIGUSR1`` (``enable_stack_dumps``): ``gpu_sync.py`` sends it to them, and to its own
run, before it kills a run past its limit, and copies the stacks into the run's log, so a hang shows where each
side waits.

``classes(spec)`` hands these classes to ``rlhf_runtime.controller.loop.Runtime(classes=...)`` (the runtime's
extension point, ``controller.actors.ActorClasses``), and puts this directory on the ``PYTHONPATH`` of the Ray it
starts, so the actors can import this module.
"""

from __future__ import annotations

import faulthandler
import gc
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

from rlhf_runtime.roles.policy import Trainer
from rlhf_runtime.rollout.engines import AsyncEngine, Engine
from rlhf_runtime.rollout.stepped import SteppedEngine

HERE = Path(__file__).resolve().parent


def _wrap_timer(owner: Any, name: str, stats: dict[str, float], key: str, device_sync: bool) -> None:
    """Replace ``owner.name`` (an instance attribute) by the same call that adds its seconds to ``stats[key_s]``
    and counts ``stats[key_calls]``; with ``device_sync`` the timer stops after the device's queued work too."""
    original = getattr(owner, name)

    def timed(*args: Any, **kwargs: Any) -> Any:
        t = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            if device_sync:
                import torch

                if torch.cuda.is_available():
                    torch.cuda.synchronize()
            stats[f"{key}_s"] += time.perf_counter() - t
            stats[f"{key}_calls"] += 1

    owner.__dict__[name] = timed


#: What ``_worker_time_loads`` times, per worker: the model's ``load_weights`` (``load``: vLLM's checkpoint-format
#: path; the kernel format does not call it) and the worker's weight-transfer engine's own steps (``start``,
#: ``receive``: opening the trainer's buffers and loading them, in either format; ``finish``).
TIMED = {"load": "load_weights", "start": "start_weight_update", "receive": "receive_weights",
         "finish": "finish_weight_update"}


def _worker_time_loads(worker: Any, reset: bool = False, device_sync: bool = False) -> dict[str, float]:
    """(collective_rpc) Install host-side timers once (``TIMED``; ``device_sync``, fixed at the first call: each
    timer also waits for the GPU); return and, with ``reset``, zero the accumulated seconds and calls.
    ``load_s``/``calls`` keep their old meaning (the model's ``load_weights``)."""
    model = worker.model_runner.model
    stats = model.__dict__.get("_rlhf_load_stats")
    if stats is None:
        stats = model.__dict__["_rlhf_load_stats"] = {f"{k}_{x}": 0 for k in TIMED for x in ("s", "calls")}
        _wrap_timer(model, "load_weights", stats, "load", device_sync)
        engine = getattr(worker, "weight_transfer_engine", None)
        for key, name in TIMED.items():
            if key != "load" and engine is not None and hasattr(engine, name):
                _wrap_timer(engine, name, stats, key, device_sync)
    out = {**stats, "calls": stats["load_calls"]}
    if reset:
        stats.update({k: 0 for k in stats})
    return out


#: What ``BenchTrainer.send_stats`` times in vLLM's IPC trainer engine (``ipc_engine``), the trainer side
#: of a packed IPC sync between its RPCs: ``pack``: inside ``packed_ipc_producer``'s generator, per chunk
#: (iterating the source: the plan's fused tensors, FSDP gathers; copying each tensor into the one IPC buffer;
#: waiting for those copies); ``post``: ``_post_send_sync`` after each chunk and after the finish
#: (``torch.cuda.ipc_collect``, and a barrier with several trainer ranks).
IPC_TRAINER_TIMED = ("pack", "post")
_IPC_TRAINER_STATS: dict[str, float] = {}


def _time_ipc_trainer(stats: dict[str, float]) -> None:
    """Wrap ``ipc_engine.packed_ipc_producer`` (a module global ``_send_packed`` calls) and the trainer engine's
    ``_post_send_sync`` (a static method) with timers adding to ``stats``."""
    from vllm.distributed.weight_transfer import ipc_engine

    produce = ipc_engine.packed_ipc_producer

    def timed_producer(*args: Any, **kwargs: Any) -> Any:
        chunks = produce(*args, **kwargs)
        while True:
            t = time.perf_counter()
            try:
                chunk = next(chunks)
            except StopIteration:
                return
            finally:
                stats["pack_s"] += time.perf_counter() - t
            stats["pack_calls"] += 1
            yield chunk

    post = ipc_engine.IPCTrainerWeightTransferEngine._post_send_sync

    def timed_post() -> None:
        t = time.perf_counter()
        try:
            post()
        finally:
            stats["post_s"] += time.perf_counter() - t
            stats["post_calls"] += 1

    ipc_engine.packed_ipc_producer = timed_producer
    ipc_engine.IPCTrainerWeightTransferEngine._post_send_sync = staticmethod(timed_post)


class DirectTimeline:
    """The direct NCCL sync's timeline in this process (``weight_sync.direct``): wall-clock instants
    (``time.time()``, one clock for every process of the host, so the trainer's, the engines' and the driver's
    instants compare) of ``send`` / ``receive`` and of each group's launch, and each group's GPU time (CUDA events
    on its stream around the group; none on CPU). ``install`` wraps the module's functions (its other functions
    look ``broadcast_group`` up at call time), ``uninstall`` restores them; ``drain`` returns the records since the
    last drain, the GPU times read after the events completed. What a sync's time is made of beyond the bytes: the
    driver's call reaching the trainer, the engine's call reaching its worker (the broadcast cannot finish before
    the worker joins it), the wire (the engine's GPU time from its first group's start to its last one's end), the
    replies."""

    def __init__(self) -> None:
        self.records: list[dict[str, Any]] = []
        self.saved: dict[str, Any] | None = None

    def install(self) -> None:
        from rlhf_runtime.weight_sync import direct

        if self.saved is not None:
            return
        self.saved = {name: getattr(direct, name) for name in ("broadcast_group", "send", "receive")}
        group, records = self.saved["broadcast_group"], self.records

        def timed_group(comm: Any, tensors: list[Any], stream: Any = None) -> None:
            import torch

            events, on = None, stream
            if torch.cuda.is_available():
                on = stream if stream is not None else torch.cuda.current_stream()
                events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                events[0].record(on)
            start = time.time()
            try:
                group(comm, tensors, stream)
            finally:
                end = time.time()
                if events is not None:
                    events[1].record(on)
                records.append({"what": "group", "start": start, "end": end, "tensors": len(tensors),
                                "bytes": sum(t.numel() * t.element_size() for t in tensors), "events": events})

        def spanned(fn: Any, what: str) -> Any:
            def timed(*args: Any, **kwargs: Any) -> Any:
                start = time.time()
                try:
                    return fn(*args, **kwargs)
                finally:
                    records.append({"what": what, "start": start, "end": time.time()})
            return timed

        direct.broadcast_group = timed_group
        direct.send = spanned(self.saved["send"], "send")
        direct.receive = spanned(self.saved["receive"], "receive")

    def uninstall(self) -> None:
        from rlhf_runtime.weight_sync import direct

        for name, fn in (self.saved or {}).items():
            setattr(direct, name, fn)
        self.saved = None

    def drain(self) -> list[dict[str, Any]]:
        """The records since the last drain, oldest first; a group's ``gpu_ms`` (and ``gpu_from_first_ms``: from
        the first group's start event of this drain to this group's end) where CUDA timed it."""
        out, first = [], None
        for rec in self.records:
            rec = dict(rec)
            events = rec.pop("events", None)
            if events is not None:
                events[1].synchronize()
                if first is None:
                    first = events[0]
                rec["gpu_ms"] = events[0].elapsed_time(events[1])
                rec["gpu_from_first_ms"] = first.elapsed_time(events[1])
            out.append(rec)
        self.records.clear()
        return out


#: This process's ``DirectTimeline`` (the trainer actor's, or an engine worker's): ``direct_timeline``.
TIMELINE = DirectTimeline()


def direct_timeline() -> list[dict[str, Any]]:
    """Install ``TIMELINE`` (the first call) and drain it: its records since the last call."""
    TIMELINE.install()
    return TIMELINE.drain()


def _worker_direct_timeline(worker: Any) -> list[dict[str, Any]]:
    """(collective_rpc) ``direct_timeline`` in an engine worker's process."""
    return direct_timeline()


def _worker_scramble(worker: Any, seed: int = 0) -> int:
    """(collective_rpc) Overwrite every parameter with noise; returns the number of parameters touched."""
    import torch

    gen = torch.Generator(device=next(worker.model_runner.model.parameters()).device).manual_seed(seed)
    n = 0
    with torch.no_grad():
        for p in worker.model_runner.model.parameters():
            if p.is_floating_point():
                p.copy_(torch.randn(p.shape, generator=gen, device=p.device, dtype=torch.float32) * 0.02)
                n += 1
    return n


def engine_facts(llm: Any) -> dict[str, Any]:
    """What sizes a ``vllm.LLM``'s throughput beside its arguments: its KV cache (blocks x block size = tokens it
    can hold), the scheduler's limits, async scheduling, and whether its engine core runs in this process
    (``VLLM_ENABLE_V1_MULTIPROCESSING``) - so that two engines compared on one batch can be shown alike."""
    from vllm import envs

    cfg = getattr(getattr(llm, "llm_engine", None), "vllm_config", None)
    cache, sched = getattr(cfg, "cache_config", None), getattr(cfg, "scheduler_config", None)
    parallel = getattr(cfg, "parallel_config", None)
    blocks, size = getattr(cache, "num_gpu_blocks", None), getattr(cache, "block_size", None)
    return {"kv_cache_tokens": blocks * size if blocks and size else None,
            "max_num_seqs": getattr(sched, "max_num_seqs", None),
            "max_num_batched_tokens": getattr(sched, "max_num_batched_tokens", None),
            "async_scheduling": getattr(sched, "async_scheduling", None),
            "engine_core_in_process": not envs.VLLM_ENABLE_V1_MULTIPROCESSING,
            "executor": str(getattr(parallel, "distributed_executor_backend", None))}


def time_generate(llm: Any, prompts: list[list[int]], sampling: dict[str, Any]) -> dict[str, float]:
    """``llm.generate`` (a ``vllm.LLM``) on token-id prompts with the runtime's sampling arguments, timed around
    the call alone: seconds and generated tokens."""
    from vllm import SamplingParams

    sp = SamplingParams(detokenize=False, **sampling)
    batch = [{"prompt_token_ids": p} for p in prompts]
    pauses: list[tuple[int, float]] = []
    started = [0.0]

    def on_gc(phase: str, info: dict[str, int]) -> None:  # the interpreter's collections during the call
        if phase == "start":
            started[0] = time.perf_counter()
        else:
            pauses.append((info["generation"], time.perf_counter() - started[0]))

    gc.callbacks.append(on_gc)
    try:
        t = time.perf_counter()
        outs = llm.generate(batch, sp, use_tqdm=False)
        seconds = time.perf_counter() - t
    finally:
        gc.callbacks.remove(on_gc)
    sched = getattr(getattr(getattr(llm, "llm_engine", None), "vllm_config", None), "scheduler_config", None)
    return {"seconds": seconds, "tokens": sum(len(c.token_ids) for o in outs for c in o.outputs),
            "gc_s": sum(x for _, x in pauses), "gc_collections": len(pauses),
            "gc_gen2": sum(1 for g, _ in pauses if g == 2), "gc_tracked": len(gc.get_objects()),
            "threads": sorted(th.name for th in threading.enumerate()),
            "async_scheduling": getattr(sched, "async_scheduling", None)}


#: The signal on which a benchmark process prints its threads' stacks (``enable_stack_dumps``), and the start of
#: the process title Ray gives the actors of this module (``ray::BenchEngine.update_weights_round``, ...).
STACK_SIGNAL = signal.SIGUSR1
ACTOR_TITLE = "ray::Bench"


def enable_stack_dumps() -> None:
    """On ``STACK_SIGNAL`` this process writes every thread's Python stack to stderr and goes on (without it the
    signal would end the process)."""
    faulthandler.register(STACK_SIGNAL, all_threads=True)


class _StackDumps:
    """Mixed in first: the actor registers the stack dump before the runtime class's own start (an engine's
    start can hang too)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        enable_stack_dumps()
        super().__init__(*args, **kwargs)


class BenchEngine(_StackDumps, Engine):
    def timed_generate(self, prompts: list[list[int]], sampling: dict[str, Any]) -> dict[str, float]:
        if self._stale_cache:  # as generate does
            self._stale_cache = not self.llm.reset_prefix_cache()
        return time_generate(self.llm, prompts, sampling)

    def engine_facts(self) -> dict[str, Any]:
        return engine_facts(self.llm)

    def reset_prefix_cache(self) -> bool:
        self._stale_cache = False
        return bool(self.llm.reset_prefix_cache())

    def load_stats(self, reset: bool = True, device_sync: bool = False) -> list[dict[str, float]]:
        return self.llm.collective_rpc(_worker_time_loads, kwargs={"reset": reset, "device_sync": device_sync})

    def scramble_weights(self, seed: int = 0) -> list[int]:
        return self.llm.collective_rpc(_worker_scramble, kwargs={"seed": seed})

    def direct_timeline(self) -> list[list[dict[str, Any]]]:
        return self.llm.collective_rpc(_worker_direct_timeline)


class BenchAsyncEngine(_StackDumps, AsyncEngine):
    async def reset_prefix_cache(self) -> bool:
        self._stale_cache = False
        return bool(await self.llm.reset_prefix_cache())

    async def load_stats(self, reset: bool = True, device_sync: bool = False) -> list[dict[str, float]]:
        return await self.llm.collective_rpc(_worker_time_loads, kwargs={"reset": reset, "device_sync": device_sync})

    async def scramble_weights(self, seed: int = 0) -> list[int]:
        return await self.llm.collective_rpc(_worker_scramble, kwargs={"seed": seed})

    async def direct_timeline(self) -> list[list[dict[str, Any]]]:
        return await self.llm.collective_rpc(_worker_direct_timeline)


class BenchSteppedEngine(_StackDumps, SteppedEngine):
    def _reset_now(self) -> bool:  # on the engine thread
        self._stale_cache = False
        return bool(self.engine.reset_prefix_cache())

    async def reset_prefix_cache(self) -> bool:
        return await self._call(self._reset_now)

    async def load_stats(self, reset: bool = True, device_sync: bool = False) -> list[dict[str, float]]:
        return await self._call(self.llm.collective_rpc, _worker_time_loads, kwargs={"reset": reset, "device_sync": device_sync})

    async def scramble_weights(self, seed: int = 0) -> list[int]:
        return await self._call(self.llm.collective_rpc, _worker_scramble, kwargs={"seed": seed})

    async def direct_timeline(self) -> list[list[dict[str, Any]]]:
        return await self._call(self.llm.collective_rpc, _worker_direct_timeline)


class BenchTrainer(_StackDumps, Trainer):
    def direct_timeline(self) -> list[dict[str, Any]]:
        """The direct NCCL sync's timeline on this trainer rank (``DirectTimeline``; installed at the first call)."""
        return direct_timeline()

    def send_stats(self, reset: bool = False) -> dict[str, float]:
        """Seconds and calls of ``IPC_TRAINER_TIMED`` since the last reset (zeros where the path is not taken:
        NCCL, gloo, the resident IPC sync); the timers are installed at the first call."""
        if not _IPC_TRAINER_STATS:
            _IPC_TRAINER_STATS.update({f"{k}_{x}": 0 for k in IPC_TRAINER_TIMED for x in ("s", "calls")})
            _time_ipc_trainer(_IPC_TRAINER_STATS)
        out = dict(_IPC_TRAINER_STATS)
        if reset:
            _IPC_TRAINER_STATS.update({k: 0 for k in _IPC_TRAINER_STATS})
        return out

    def memory(self) -> dict[str, float]:
        """This rank's GPU memory in GiB: the allocator's peak since the actor started (or the last call) and
        now, and the device's total; empty on CPU."""
        import torch

        if not torch.cuda.is_available():
            return {}
        gib = 1 << 30
        out = {"peak_allocated_gib": torch.cuda.max_memory_allocated() / gib,
               "peak_reserved_gib": torch.cuda.max_memory_reserved() / gib,
               "allocated_gib": torch.cuda.memory_allocated() / gib,
               "total_gib": torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory / gib}
        torch.cuda.reset_peak_memory_stats()
        return out


BENCH_CLASSES: dict[type, type] = {Engine: BenchEngine, AsyncEngine: BenchAsyncEngine,
                                   SteppedEngine: BenchSteppedEngine}


def classes(spec: Any) -> Any:
    """The benchmark subclasses for a job of ``spec``, for ``controller.loop.Runtime(classes=...)`` (the
    runtime's extension point); puts this directory on the ``PYTHONPATH`` of the Ray the run starts, so the
    actors can import this module."""
    from rlhf_runtime.controller.actors import ActorClasses
    from rlhf_runtime.rollout.api import engine_class

    install_path()
    engine = engine_class(spec.weight_sync.mode == "async", spec.rollout.async_engine)
    return ActorClasses(trainer=BenchTrainer, engine=BENCH_CLASSES[engine])


def install_path() -> None:
    path = os.environ.get("PYTHONPATH", "")
    if str(HERE) not in path.split(os.pathsep):  # the actors import this module by name
        os.environ["PYTHONPATH"] = os.pathsep.join([p for p in (path, str(HERE)) if p])
