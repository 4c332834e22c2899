"""vLLM engines as Ray actors: ``Engine`` (sync ``LLM``) and ``AsyncEngine`` (``AsyncLLM``, for
``weightSync.mode: async``).

Both expose the same weight-transfer surface (``init_weight_transfer_engine(init_info)``,
``start_weight_update()``, ``update_weights(update_info)``, ``finish_weight_update()``) with plain dicts, and
hide vLLM's version differences: 0.24's ``start_weight_update`` needs ``is_checkpoint_format=True``, 0.32's
takes nothing (checked on the signature). Results come back as plain lists, not vLLM objects.

``AsyncEngine.generate`` runs while the trainer trains; ``pause()`` freezes in-flight requests
(``pause_generation(mode="keep")``), the weight sync runs, ``resume()`` continues them. Each sample records
``swap_index``: how many of its tokens were generated before the swap (``-1`` if it finished before it).

Import only inside Ray actors (the module imports nothing heavy at import time; vLLM is imported in
``__init__``).
"""

from __future__ import annotations

import inspect
import os
import time
from typing import Any


def _llm_args(kwargs: dict[str, Any]) -> dict[str, Any]:
    from vllm.config import WeightTransferConfig

    from rlhf_runtime import vllm_plugin

    vllm_plugin.register()  # in-process engines (uni executor) do not always load plugins before use
    kw = dict(kwargs)
    kw["weight_transfer_config"] = WeightTransferConfig(backend=kw.pop("weight_transfer_backend"))
    return kw


def _pack(outputs: list[Any]) -> list[dict[str, Any]]:
    return [
        {
            "prompt_token_ids": list(o.prompt_token_ids),
            "samples": [list(c.token_ids) for c in o.outputs],
            "finish_reasons": [c.finish_reason for c in o.outputs],
        }
        for o in outputs
    ]


class Engine:
    """A vLLM ``LLM`` in a Ray actor (separate or colocated placement, sync weight sync)."""

    def __init__(self, kwargs: dict[str, Any], env: dict[str, str] | None = None) -> None:
        os.environ.update(env or {})
        from vllm import LLM

        t = time.perf_counter()
        self.llm = LLM(**_llm_args(kwargs))
        self.start_seconds = time.perf_counter() - t
        params = inspect.signature(self.llm.start_weight_update).parameters
        self._start_kwargs = {"is_checkpoint_format": True} if "is_checkpoint_format" in params else {}

    def ready(self) -> float:
        return self.start_seconds

    def world_size(self) -> int:
        return self.llm.llm_engine.vllm_config.parallel_config.world_size

    def generate(self, prompts: list[list[int]], sampling: dict[str, Any]) -> list[dict[str, Any]]:
        from vllm import SamplingParams

        sp = SamplingParams(detokenize=False, **sampling)
        outs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
        return _pack(outs)

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.llm.init_weight_transfer_engine({"init_info": init_info})

    def start_weight_update(self) -> None:
        self.llm.start_weight_update(**self._start_kwargs)

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self.llm.update_weights({"update_info": update_info})

    def finish_weight_update(self) -> None:
        self.llm.finish_weight_update()

    def sleep(self, level: int) -> None:
        self.llm.sleep(level=level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        self.llm.wake_up(tags=tags)


class AsyncEngine:
    """A vLLM ``AsyncLLM`` in an async Ray actor: generation can be paused mid-request for a weight swap."""

    def __init__(self, kwargs: dict[str, Any], env: dict[str, str] | None = None) -> None:
        os.environ.update(env or {})
        from vllm import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        t = time.perf_counter()
        self.llm = AsyncLLM.from_engine_args(AsyncEngineArgs(**_llm_args(kwargs)))
        self.start_seconds = time.perf_counter() - t
        params = inspect.signature(self.llm.start_weight_update).parameters
        self._start_kwargs = {"is_checkpoint_format": True} if "is_checkpoint_format" in params else {}
        self.version = 0  # bumped by resume() after a swap
        self._paused = False
        self._live: dict[str, list[int]] = {}
        self._swaps: dict[str, list[int]] = {}

    async def ready(self) -> float:
        return self.start_seconds

    async def world_size(self) -> int:
        return self.llm.vllm_config.parallel_config.world_size

    async def _one(self, prompt: list[int], sp: Any, rid: str) -> dict[str, Any]:
        latest: dict[int, Any] = {}  # sample index -> its newest (cumulative) output
        prompt_ids: list[int] = list(prompt)
        counts = self._live[rid] = [0] * sp.n
        self._swaps[rid] = [-1] * sp.n
        try:
            async for out in self.llm.generate({"prompt_token_ids": prompt}, sp, request_id=rid):
                for c in out.outputs:
                    latest[c.index] = c
                    counts[c.index] = len(c.token_ids)
        finally:
            self._live.pop(rid, None)
            swap = self._swaps.pop(rid)
        outs = [latest[i] for i in range(sp.n)]
        return {
            "prompt_token_ids": prompt_ids,
            "samples": [list(c.token_ids) for c in outs],
            "finish_reasons": [c.finish_reason for c in outs],
            "swap_index": swap,
        }

    async def generate(self, prompts: list[list[int]], sampling: dict[str, Any]) -> list[dict[str, Any]]:
        import asyncio
        import uuid

        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        sp = SamplingParams(detokenize=False, output_kind=RequestOutputKind.CUMULATIVE, **sampling)
        return list(await asyncio.gather(*(self._one(p, sp, uuid.uuid4().hex) for p in prompts)))

    async def pause(self, after_tokens: int = 0) -> None:
        """Freeze in-flight requests; with ``after_tokens``, first wait until some live sample has that many
        tokens (or nothing is live), as the vLLM async RLHF example does."""
        import asyncio

        while after_tokens and self._live and max(max(c) for c in self._live.values()) < after_tokens:
            await asyncio.sleep(0.002)
        await self.llm.pause_generation(mode="keep", clear_cache=False)
        # Paused: whatever each live sample has now was generated with the old weights.
        for rid, counts in self._live.items():
            self._swaps[rid] = list(counts)
        self._paused = True

    async def resume(self) -> None:
        self.version += 1
        self._paused = False
        await self.llm.resume_generation()

    async def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        await self.llm.collective_rpc("init_weight_transfer_engine", kwargs={"init_info": init_info})

    async def start_weight_update(self) -> None:
        await self.llm.start_weight_update(**self._start_kwargs)

    async def update_weights(self, update_info: dict[str, Any]) -> None:
        await self.llm.collective_rpc("update_weights", kwargs={"update_info": update_info})

    async def finish_weight_update(self) -> None:
        await self.llm.finish_weight_update()

    async def sleep(self, level: int) -> None:
        await self.llm.sleep(level=level)

    async def wake_up(self, tags: list[str] | None = None) -> None:
        await self.llm.wake_up(tags=tags)
