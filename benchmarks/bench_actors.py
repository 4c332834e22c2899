"""Benchmark-only hooks on the runtime's actors, kept out of the production classes.

``BenchEngine`` / ``BenchAsyncEngine`` / ``BenchSteppedEngine`` add to the engine actor classes
(``rlhf_runtime.engine_api.engine_class``):

* ``scramble_weights(seed)``: overwrite every parameter with noise, so a sync that misses a tensor shows in
  the greedy tokens;
* ``load_stats(reset)``: per worker, seconds spent in ``model.load_weights`` since the last reset (installs a
  host-side timer around it the first time);
* ``reset_prefix_cache()``: drop the prefix cache now (a cached prefix takes another prefill path than a cold
  one, so greedy comparisons start cold); whether vLLM did.

``BenchTrainer`` adds ``configure_sync(**options)``: sender options of the runtime-driven sender (vLLM 0.24:
``producer``, ``format``, ``rpc``, ``ipc_wire``, ``packed``, ``bucket_bytes``) for later syncs.

``install(rt)`` makes a ``rlhf_runtime.driver.Runtime`` start these classes instead of its own, and puts this
directory on the ``PYTHONPATH`` of the Ray it starts, so the actors can import this module.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from rlhf_runtime.engines import AsyncEngine, Engine
from rlhf_runtime.stepped_engine import SteppedEngine
from rlhf_runtime.trainer import Trainer

HERE = Path(__file__).resolve().parent


def _worker_time_loads(worker: Any, reset: bool = False) -> dict[str, float]:
    """(collective_rpc) Wrap the model's ``load_weights`` once with a host-side timer; return and reset the
    accumulated seconds and calls (the time vLLM's receive path spends in ``load_weights``)."""
    model = worker.model_runner.model
    stats = model.__dict__.get("_rlhf_load_stats")
    if stats is None:
        stats = model.__dict__["_rlhf_load_stats"] = {"load_s": 0.0, "calls": 0}
        original = model.load_weights

        def timed(weights: Any, *args: Any, **kwargs: Any) -> Any:
            t = time.perf_counter()
            try:
                return original(weights, *args, **kwargs)
            finally:
                stats["load_s"] += time.perf_counter() - t
                stats["calls"] += 1

        model.__dict__["load_weights"] = timed
    out = dict(stats)
    if reset:
        stats.update(load_s=0.0, calls=0)
    return out


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


class BenchEngine(Engine):
    def reset_prefix_cache(self) -> bool:
        self._stale_cache = False
        return bool(self.llm.reset_prefix_cache())

    def load_stats(self, reset: bool = True) -> list[dict[str, float]]:
        return self.llm.collective_rpc(_worker_time_loads, kwargs={"reset": reset})

    def scramble_weights(self, seed: int = 0) -> list[int]:
        return self.llm.collective_rpc(_worker_scramble, kwargs={"seed": seed})


class BenchAsyncEngine(AsyncEngine):
    async def reset_prefix_cache(self) -> bool:
        self._stale_cache = False
        return bool(await self.llm.reset_prefix_cache())

    async def load_stats(self, reset: bool = True) -> list[dict[str, float]]:
        return await self.llm.collective_rpc(_worker_time_loads, kwargs={"reset": reset})

    async def scramble_weights(self, seed: int = 0) -> list[int]:
        return await self.llm.collective_rpc(_worker_scramble, kwargs={"seed": seed})


class BenchSteppedEngine(SteppedEngine):
    def _reset_now(self) -> bool:  # on the engine thread
        self._stale_cache = False
        return bool(self.engine.reset_prefix_cache())

    async def reset_prefix_cache(self) -> bool:
        return await self._call(self._reset_now)

    async def load_stats(self, reset: bool = True) -> list[dict[str, float]]:
        return await self._call(self.llm.collective_rpc, _worker_time_loads, kwargs={"reset": reset})

    async def scramble_weights(self, seed: int = 0) -> list[int]:
        return await self._call(self.llm.collective_rpc, _worker_scramble, kwargs={"seed": seed})


class BenchTrainer(Trainer):
    def configure_sync(self, **options: Any) -> dict[str, Any]:
        """Sender options for later syncs (runtime-driven sender only); returns the options in force."""
        configure = getattr(self.sender, "configure", None)
        if configure is None:
            return {"unsupported": sorted(options)}
        return configure(**options)


BENCH_CLASSES: dict[type, type] = {Engine: BenchEngine, AsyncEngine: BenchAsyncEngine,
                                   SteppedEngine: BenchSteppedEngine}


def install(rt: Any) -> None:
    """Before ``rt.connect()``: ``rt`` (a ``Runtime``) starts the benchmark subclasses of its actor classes."""
    rt.engine_class = BENCH_CLASSES[rt.engine_class]
    rt.trainer_class = BenchTrainer
    path = os.environ.get("PYTHONPATH", "")
    if str(HERE) not in path.split(os.pathsep):  # the actors import this module by name
        os.environ["PYTHONPATH"] = os.pathsep.join([p for p in (path, str(HERE)) if p])
