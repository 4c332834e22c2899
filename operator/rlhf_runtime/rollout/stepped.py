"""``SteppedEngine``: the async-mode engine actor with vLLM **in-process** (for ``weightSync.mode: async``).

Same methods, arguments, results and semantics as ``engines.AsyncEngine``, which is built on ``AsyncLLM``
(both on ``base.AsyncEngineBase``: the shared start-up, queries and weight-update calls);
but ``AsyncLLM`` always runs its engine core in a spawned subprocess, which some machines cannot start. This
one builds a sync ``vllm.LLM`` in the actor process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) and drives its
V1 ``LLMEngine`` itself (``add_request`` / ``step`` / ``has_unfinished_requests``) on one dedicated thread:

* Every call into vLLM (construction, add, step, abort, ``collective_rpc``, the weight-transfer calls, prefix
  cache reset, sleep/wake) runs on that thread, since vLLM's engine is not thread-safe. The actor's async
  methods queue a command for it and await the result, so they never block the actor's event loop.
* Between commands the thread steps the engine while requests are unfinished; ``generate`` awaits futures
  the stepping thread resolves when a request finishes.
* ``pause(after_tokens)`` (optionally after some live sample reached ``after_tokens`` tokens, checked after
  every step) pauses the engine core's scheduler in vLLM's ``"keep"`` mode (in-flight requests keep their
  KV cache and are not scheduled), steps out any batch still in flight (async scheduling), then records
  every live sample's token count as its ``swap_index``. ``resume()`` unpauses the scheduler.

Not supported: vLLM data parallelism (``VLLM_DP_SIZE`` > 1, expert-parallel DP groups), whose ranks would
have to pause at the same step.

Selected by ``spec.rollout.asyncEngine: stepped`` (``rollout.api.engine_class``). Import only inside Ray actors,
like ``engines`` (vLLM is imported in ``__init__``).
"""

from __future__ import annotations

import asyncio
import os
import queue
import threading
import uuid
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError
from typing import Any

from rlhf_runtime.rollout.base import AsyncEngineBase, llm_args, sampled_logprobs
from rlhf_runtime.rollout.options import EngineOptions
from rlhf_runtime.vllm import compat as vllm_compat


def _settle(fut: Future[Any], result: Any = None, error: BaseException | None = None) -> None:
    """Resolve ``fut`` unless its caller cancelled it meanwhile (then nobody waits for it)."""
    try:
        if error is not None:
            fut.set_exception(error)
        else:
            fut.set_result(result)
    except InvalidStateError:
        pass


class _Request:
    """One prompt's request (``n`` samples) as the stepping thread tracks it."""

    __slots__ = ("counts", "future", "latest", "prompt", "swap")

    def __init__(self, prompt: list[int], n: int) -> None:
        self.prompt = prompt
        self.latest: dict[int, Any] = {}  # sample index -> its newest (cumulative) CompletionOutput
        self.counts = [0] * n
        self.swap = [-1] * n
        self.future: Future[dict[str, Any]] = Future()

    def result(self, abort: bool = False) -> dict[str, Any]:
        n = len(self.counts)
        outs = [self.latest.get(i) for i in range(n)]
        return {
            "prompt_token_ids": list(self.prompt),
            "samples": [list(c.token_ids) if c is not None else [] for c in outs],
            "logprobs": [sampled_logprobs(c) if c is not None else [] for c in outs],
            "finish_reasons": [
                c.finish_reason
                if c is not None and c.finish_reason is not None
                else ("abort" if abort else None)
                for c in outs
            ],
            "swap_index": list(self.swap),
        }


class SteppedEngine(AsyncEngineBase):
    """An in-process vLLM ``LLM`` stepped by one background thread, in an async Ray actor; generation can be
    paused mid-request for a weight swap (the ``AsyncEngine`` surface)."""

    def __init__(self, options: EngineOptions, build: bool = True) -> None:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the whole point: the engine core in this process
        super().__init__(options, build)
        self._cmds: queue.SimpleQueue[tuple[Callable[[], Any], Future[Any]] | None] = queue.SimpleQueue()
        self._live: dict[str, _Request] = {}
        self._pause_waiter: tuple[int, Future[None]] | None = None  # pause(after_tokens) not yet reached
        self._error: BaseException | None = None  # the engine failed in step(): nothing is stepped any more
        self._thread = threading.Thread(target=self._loop, name="vllm-stepped-engine", daemon=True)
        self._thread.start()
        if build:
            self._build_now()

    def _make_engine(self, kwargs: dict[str, Any]) -> None:
        self._submit(lambda: self._build(kwargs)).result()  # built on the thread that later drives it

    # ------------------------------------------------------------------------ the engine thread
    def _build(self, kwargs: dict[str, Any]) -> None:
        from vllm import LLM

        self.llm = LLM(**llm_args(kwargs))
        self.engine = self.llm.llm_engine
        self.core = vllm_compat.inprocess_core(self.engine)
        if self.core is None:
            raise RuntimeError(
                "SteppedEngine needs vLLM's in-process engine core (VLLM_ENABLE_V1_MULTIPROCESSING=0)"
            )
        if self.engine.vllm_config.parallel_config.data_parallel_size > 1:
            raise NotImplementedError(
                "SteppedEngine does not support vLLM data parallelism (VLLM_DP_SIZE > 1)"
            )

    def _submit(self, fn: Callable[[], Any]) -> Future[Any]:
        fut: Future[Any] = Future()
        self._cmds.put((fn, fut))
        return fut

    async def _call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run ``fn(*args, **kwargs)`` on the engine thread (queued at once, in call order) and await it."""
        return await asyncio.wrap_future(self._submit(lambda: fn(*args, **kwargs)))

    def _loop(self) -> None:
        while True:
            # Commands first; wait for one while there is nothing to step.
            while True:
                try:
                    cmd = self._cmds.get(block=not self._should_step())
                except queue.Empty:
                    break
                if cmd is None:
                    return
                fn, fut = cmd
                if fut.set_running_or_notify_cancel():
                    try:
                        fut.set_result(fn())
                    except BaseException as e:  # noqa: BLE001 - handed to the awaiting caller
                        fut.set_exception(e)
            try:
                self._dispatch(self.engine.step())
                if not self._live:
                    self._maybe_reset_cache()
            except BaseException as e:  # noqa: BLE001 - fail the waiting generate calls, serve commands
                self._error = e
                self._fail_live(e)
                continue
            self._check_pause()

    def _should_step(self) -> bool:
        return (
            self._error is None
            and not self._paused
            and hasattr(self, "engine")
            and self.engine.has_unfinished_requests()
        )

    def _dispatch(self, outputs: list[Any]) -> None:
        for out in outputs:
            req = self._live.get(out.request_id)
            if req is None:
                continue
            for c in out.outputs:
                req.latest[c.index] = c
                req.counts[c.index] = len(c.token_ids)
            if out.finished:
                del self._live[out.request_id]
                _settle(req.future, req.result())

    def _fail_live(self, error: BaseException) -> None:
        live, self._live = self._live, {}
        for req in live.values():
            _settle(req.future, error=error)
        if self._pause_waiter is not None:
            self._pause_waiter[1].set_exception(error)
            self._pause_waiter = None

    def _drain(self) -> None:
        """Collect the batch that async scheduling keeps in flight after a step. Only while the scheduler
        schedules nothing new (paused, or no unfinished request): then the queue empties."""
        while vllm_compat.batches_in_flight(self.core):
            self._dispatch(self.engine.step())

    def _maybe_reset_cache(self) -> None:
        """Reset the prefix cache after a weight update, once no request holds blocks (it fails before)."""
        if self._stale_cache and not self._live:
            self._drain()  # a batch still in flight holds (deferred) blocks
            self._stale_cache = not self.engine.reset_prefix_cache()

    def _add(self, prompts: list[list[int]], sp: Any) -> list[tuple[str, Future[dict[str, Any]]]]:
        if self._error is not None:
            raise RuntimeError("the vLLM engine failed") from self._error
        self._maybe_reset_cache()  # never serve KV of the old weights to a prompt of the new ones
        added = []
        for prompt in prompts:
            rid = uuid.uuid4().hex
            req = self._live[rid] = _Request(list(prompt), sp.n)
            try:
                self.engine.add_request(rid, {"prompt_token_ids": list(prompt)}, sp)
            except BaseException:
                del self._live[rid]
                raise
            added.append((rid, req.future))
        return added

    def _abort(self, rids: list[str]) -> None:
        """End the requests ``rids`` still live (their caller cancelled the call): freed in the engine."""
        gone = [rid for rid in rids if self._live.pop(rid, None) is not None]
        if gone:
            self.engine.abort_request(gone)
            self.aborted += len(gone)

    def _check_pause(self) -> None:
        """Pause once the pending ``pause(after_tokens)`` condition holds (or nothing is live)."""
        if self._pause_waiter is None:
            return
        after, fut = self._pause_waiter
        if self._live and max(max(r.counts) for r in self._live.values()) < after:
            return
        self._pause_waiter = None
        try:
            self._pause_now()
        except BaseException as e:  # noqa: BLE001 - handed to pause()'s caller
            fut.set_exception(e)
        else:
            fut.set_result(None)

    def _pause_now(self) -> None:
        self.core.pause_scheduler(mode="keep", clear_cache=False)
        self._drain()  # the paused scheduler adds no batch
        self._paused = True
        # Paused: whatever each live sample has now was generated with the old weights.
        for req in self._live.values():
            req.swap = list(req.counts)

    def _request_pause(self, after_tokens: int) -> Future[None]:
        if self._pause_waiter is not None:  # a second pause while one waits: both end together
            return self._pause_waiter[1]
        fut: Future[None] = Future()
        self._pause_waiter = (after_tokens if not self._paused else 0, fut)
        self._check_pause()
        return fut

    def _resume(self) -> None:
        self.core.resume_scheduler()
        self._paused = False

    def _finish_weight_update(self) -> None:
        self.llm.finish_weight_update()
        self._stale_cache = True  # reset before the next generate (keeps the reset out of the sync's time)

    def _sleep(self, level: int) -> None:
        # vLLM's sleep aborts in-flight requests (as AsyncLLM.sleep does): end them with what they have.
        if self._live:
            live, self._live = self._live, {}
            self.engine.abort_request(list(live))
            for req in live.values():
                _settle(req.future, req.result(abort=True))
        self._drain()
        self.llm.sleep(level=level)

    def _wake_up(self, tags: list[str] | None) -> None:
        self.llm.wake_up(tags=tags)
        if self._paused:  # a full wake resumes vLLM's scheduler: keep our pause
            self.core.pause_scheduler(mode="keep", clear_cache=False)

    # ----------------------------------------------------------------------- the actor's methods
    def _vllm_config(self) -> Any:
        return self.engine.vllm_config

    async def _collective_rpc(self, fn: Callable[..., Any], args: tuple = ()) -> Any:
        return await self._call(self.llm.collective_rpc, fn, args=args)

    async def _start_update(self) -> None:
        await self._call(self.llm.start_weight_update)

    async def generate(self, prompts: list[list[int]], sampling: dict[str, Any]) -> list[dict[str, Any]]:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        sp = SamplingParams(detokenize=False, output_kind=RequestOutputKind.CUMULATIVE, **sampling)
        add = self._submit(lambda: self._add(prompts, sp))

        def abort_added() -> None:  # on the engine thread, after the add (commands run in order)
            if add.exception() is None:
                self._abort([rid for rid, _ in add.result()])

        try:
            added = await asyncio.shield(asyncio.wrap_future(add))
            return list(await asyncio.gather(*(asyncio.wrap_future(f) for _, f in added)))
        except asyncio.CancelledError:  # the call was cancelled (ray.cancel): its requests end in the engine,
            self._submit(abort_added)  # also where the cancel came while the add was still queued or running
            raise

    async def pause(self, after_tokens: int = 0) -> None:
        """Freeze in-flight requests; with ``after_tokens``, first let the engine step until some live sample
        has that many tokens (or nothing is live)."""
        fut = await self._call(self._request_pause, after_tokens)
        await asyncio.wrap_future(fut)

    async def resume(self) -> None:
        self.version += 1
        await self._call(self._resume)

    async def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        await self._call(self.llm.init_weight_transfer_engine, {"init_info": init_info})

    async def update_weights(self, update_info: dict[str, Any]) -> None:
        await self._call(self.llm.update_weights, {"update_info": update_info})

    async def finish_weight_update(self) -> None:
        await self._call(self._finish_weight_update)

    async def sleep(self, level: int) -> None:
        await self._call(self._sleep, level)

    async def wake_up(self, tags: list[str] | None = None) -> None:
        await self._call(self._wake_up, tags)

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop the engine thread after the commands queued so far (the actor's process exit also ends it)."""
        if self._thread.is_alive():
            self._cmds.put(None)
            self._thread.join(timeout)

    def __ray_shutdown__(self) -> None:  # called by Ray when the actor exits gracefully
        self.shutdown()
