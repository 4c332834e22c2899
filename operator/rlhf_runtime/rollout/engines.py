"""vLLM engines as Ray actors: ``Engine`` (sync ``LLM``) and ``AsyncEngine`` (``AsyncLLM``, for
``weightSync.mode: async``).

Both implement ``rlhf_runtime.rollout.api.RolloutEngine`` (the weight-transfer surface
``init_weight_transfer_engine(init_info)``, ``start_weight_update(checkpoint_format)``,
``update_weights(update_info)``, ``finish_weight_update()``, and ``generate``) with plain dicts, on the shared
start-up and queries of ``rollout.base`` (``EngineBase``; ``AsyncEngineBase`` for ``AsyncEngine``); vLLM's version
differences are ``rlhf_runtime.vllm.compat``'s. Results come back as plain lists, not vLLM objects. An unsupported
vLLM is refused when the engine starts (``vllm_compat.require_supported_vllm``).

After every weight update the prefix cache is reset before the next ``generate`` (its KV blocks were
computed with the old weights; a cached prefix would also take a different prefill path than a fresh
engine, which breaks token-for-token validation).

LoRA (``trainer.lora``): an ``Engine`` started with ``enable_lora`` serves every rollout with its newest adapter.
``load_adapter(payload, adapter_id)`` writes the adapter files (``rlhf_runtime.infra.lora``) to a fresh temporary
directory, drops the previous adapter (vLLM's ``remove_lora`` and its directory) and loads the new one under a new
integer id (``add_lora``), so no request runs on a half-replaced adapter and no KV of the old one is reused.

``AsyncEngine.generate`` runs while the trainer trains; ``pause()`` freezes in-flight requests
(``pause_generation(mode="keep")``), the weight sync runs, ``resume()`` continues them. Each sample records
``swap_index``: how many of its tokens were generated before the swap (``-1`` if it finished before it).

Import only inside Ray actors (the module imports nothing heavy at import time; vLLM is imported in
``__init__``).
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
import time
from collections.abc import Callable
from typing import Any

from rlhf_runtime.rollout import workers
from rlhf_runtime.rollout.base import AsyncEngineBase, EngineBase, llm_args, sampled_logprobs
from rlhf_runtime.rollout.options import EngineOptions


def _pack(outputs: list[Any]) -> list[dict[str, Any]]:
    return [
        {
            "prompt_token_ids": list(o.prompt_token_ids),
            "samples": [list(c.token_ids) for c in o.outputs],
            "logprobs": [sampled_logprobs(c) for c in o.outputs],
            "finish_reasons": [c.finish_reason for c in o.outputs],
        }
        for o in outputs
    ]


class Engine(EngineBase):
    """A vLLM ``LLM`` in a Ray actor (separate or colocated placement, sync weight sync)."""

    def __init__(self, options: EngineOptions, build: bool = True) -> None:
        super().__init__(options, build)
        self._update_open = False  # between start_weight_update and finish_weight_update
        self.lora_request: Any = None  # LoRA: the adapter every generate uses (load_adapter)
        if build:
            self._build_now()

    def _make_engine(self, kwargs: dict[str, Any]) -> None:
        from vllm import LLM

        self.llm = LLM(**llm_args(kwargs))

    def _vllm_config(self) -> Any:
        return self.llm.llm_engine.vllm_config

    def _collective_rpc(self, fn: Callable[..., Any], args: tuple = ()) -> Any:
        return self.llm.collective_rpc(fn, args=args)

    def generate(self, prompts: list[list[int]], sampling: dict[str, Any]) -> list[dict[str, Any]]:
        from vllm import SamplingParams

        if self._stale_cache:  # never serve KV of the old weights to a prompt of the new ones
            self._stale_cache = not self.llm.reset_prefix_cache()
        sp = SamplingParams(detokenize=False, **sampling)
        outs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False,
                                 lora_request=self.lora_request)
        return _pack(outs)

    def load_adapter(self, payload: dict[str, Any], adapter_id: int) -> dict[str, Any]:
        """(LoRA) Serve the rollouts from now on with the adapter of ``payload`` (``Trainer.adapter_payload``),
        under vLLM LoRA id ``adapter_id`` (new for every sync). Returns ``bytes`` received, seconds to write and
        to load it, and the trainer's ``serialize_s``."""
        from vllm.lora.request import LoRARequest

        from rlhf_runtime.infra import lora

        t0 = time.perf_counter()
        path = lora.write_files(payload["files"], tempfile.mkdtemp(prefix=f"rlhf-lora-{adapter_id}-"))
        t1 = time.perf_counter()
        old, self.lora_request = self.lora_request, None
        if old is not None:
            self.llm.llm_engine.remove_lora(old.lora_int_id)
            shutil.rmtree(old.lora_path, ignore_errors=True)
        request = LoRARequest(f"rlhf-adapter-{adapter_id}", adapter_id, str(path))
        try:
            self.llm.llm_engine.add_lora(request)
        except Exception as e:
            shutil.rmtree(path, ignore_errors=True)
            raise RuntimeError(f"vLLM cannot serve the adapter of spec.trainer.lora: {e}") from e
        self.lora_request = request
        self._stale_cache = True
        return {"bytes": sum(len(b) for b in payload["files"].values()), "write_s": t1 - t0,
                "load_s": time.perf_counter() - t1, "serialize_s": payload.get("serialize_s", 0.0)}

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.llm.init_weight_transfer_engine({"init_info": init_info})

    def _prepare_update(self, checkpoint_format: bool) -> None:
        """Before a start: close an update the last sync left open, send the format switch if it changed."""
        if self._update_open:  # the last sync never finished (its trainer died): close it, a full sync follows
            # (vLLM itself closes it when update_weights failed: then finish raises, which is fine)
            with contextlib.suppress(Exception):
                self.llm.finish_weight_update()
            self._update_open = False
        rpc = workers.format_rpc(checkpoint_format, self._kernel)
        if rpc is not None:
            self.llm.collective_rpc(rpc[0], args=rpc[1])
            self._kernel = not checkpoint_format

    def start_weight_update(self, checkpoint_format: bool = True) -> None:
        self._prepare_update(checkpoint_format)
        self.llm.start_weight_update()
        self._update_open = True

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self.llm.update_weights({"update_info": update_info})

    def update_weights_round(self, update_info: dict[str, Any], checkpoint_format: bool = True) -> dict[str, float]:
        """start -> update -> finish in one call (the fan-out's one-call round, the resident IPC sync); stage
        seconds: the workers' own, the slowest worker's (one ``collective_rpc``), and the actor's ``call_s``."""
        t = time.perf_counter()
        self._prepare_update(checkpoint_format)
        stages = self.llm.collective_rpc(workers.worker_update_round, args=(update_info,))
        self._stale_cache = True
        return {**{k: max(st[k] for st in stages) for k in stages[0]}, "call_s": time.perf_counter() - t}

    def finish_weight_update(self) -> None:
        self._update_open = False
        self.llm.finish_weight_update()
        self._stale_cache = True  # reset before the next generate (keeps the reset out of the sync's time)

    def sleep(self, level: int) -> None:
        self.llm.sleep(level=level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        self.llm.wake_up(tags=tags)


class AsyncEngine(AsyncEngineBase):
    """A vLLM ``AsyncLLM`` in an async Ray actor: generation can be paused mid-request for a weight swap."""

    def __init__(self, options: EngineOptions, build: bool = True) -> None:
        super().__init__(options, build)
        self._live: dict[str, list[int]] = {}
        self._swaps: dict[str, list[int]] = {}
        if build:
            self._build_now()

    def _make_engine(self, kwargs: dict[str, Any]) -> None:
        from vllm import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        self.llm = AsyncLLM.from_engine_args(AsyncEngineArgs(**llm_args(kwargs)))

    def _vllm_config(self) -> Any:
        return self.llm.vllm_config

    async def _collective_rpc(self, fn: Callable[..., Any], args: tuple = ()) -> Any:
        return await self.llm.collective_rpc(fn, args=args)

    async def _start_update(self) -> None:
        await self.llm.start_weight_update()

    async def _one(self, prompt: list[int], sp: Any, rid: str) -> dict[str, Any]:
        import asyncio

        latest: dict[int, Any] = {}  # sample index -> its newest (cumulative) output
        prompt_ids: list[int] = list(prompt)
        counts = self._live[rid] = [0] * sp.n
        self._swaps[rid] = [-1] * sp.n
        try:
            async for out in self.llm.generate({"prompt_token_ids": prompt}, sp, request_id=rid):
                for c in out.outputs:
                    latest[c.index] = c
                    counts[c.index] = len(c.token_ids)
        except asyncio.CancelledError:  # the call was cancelled (ray.cancel): AsyncLLM aborted the request
            self.aborted += 1
            raise
        finally:
            self._live.pop(rid, None)
            swap = self._swaps.pop(rid)
        outs = [latest[i] for i in range(sp.n)]
        return {
            "prompt_token_ids": prompt_ids,
            "samples": [list(c.token_ids) for c in outs],
            "logprobs": [sampled_logprobs(c) for c in outs],
            "finish_reasons": [c.finish_reason for c in outs],
            "swap_index": swap,
        }

    async def generate(self, prompts: list[list[int]], sampling: dict[str, Any]) -> list[dict[str, Any]]:
        import asyncio
        import uuid

        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        if self._stale_cache:  # fails (and is retried next time) while paused requests still hold blocks
            self._stale_cache = not await self.llm.reset_prefix_cache()
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

    async def update_weights(self, update_info: dict[str, Any]) -> None:
        await self.llm.collective_rpc("update_weights", kwargs={"update_info": update_info})

    async def finish_weight_update(self) -> None:
        await self.llm.finish_weight_update()
        self._stale_cache = True

    async def sleep(self, level: int) -> None:
        await self.llm.sleep(level=level)

    async def wake_up(self, tags: list[str] | None = None) -> None:
        await self.llm.wake_up(tags=tags)
