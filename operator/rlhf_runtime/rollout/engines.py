"""vLLM engines as Ray actors: ``Engine`` (sync ``LLM``) and ``AsyncEngine`` (``AsyncLLM``, for
``weightSync.mode: async``).

Both implement ``rlhf_runtime.rollout.api.RolloutEngine`` (the weight-transfer surface
``init_weight_transfer_engine(init_info)``, ``start_weight_update(checkpoint_format)``,
``update_weights(update_info)``, ``finish_weight_update()``, and ``generate``) with plain dicts; vLLM's version
differences are ``rlhf_runtime.vllm.compat``'s (e.g. whether ``start_weight_update`` takes
``is_checkpoint_format``). Results come back as plain lists, not vLLM objects. An unsupported vLLM is refused
when the engine starts (``vllm_compat.require_supported_vllm``).

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
import os
import shutil
import tempfile
import time
from typing import Any

from rlhf_runtime.vllm import compat as vllm_compat


def _prepare_env(kwargs: dict[str, Any], env: dict[str, str] | None) -> None:
    """The actor's environment before vLLM is imported. An engine whose workers are Ray actors (TP>1) holds
    no GPU itself, and Ray hides every GPU from such an actor (``CUDA_VISIBLE_DEVICES=""``); the engine
    process must still see the node's GPUs (platform and device checks), as vLLM's RLHF examples do."""
    os.environ.update(env or {})
    if kwargs.get("distributed_executor_backend") == "ray" and os.environ.get("CUDA_VISIBLE_DEVICES") == "":
        del os.environ["CUDA_VISIBLE_DEVICES"]


def _llm_args(kwargs: dict[str, Any]) -> dict[str, Any]:
    from vllm.config import WeightTransferConfig

    from rlhf_runtime.vllm import compat as vllm_compat
    from rlhf_runtime.vllm import plugin as vllm_plugin

    vllm_compat.require_supported_vllm()  # a clear error before vLLM builds anything
    vllm_plugin.register()  # in-process engines (uni executor) do not always load plugins before use
    kw = dict(kwargs)
    backend = kw.pop("weight_transfer_backend")
    if vllm_compat.has_trainer_api():  # 0.28+: the runtime's engines, which also load the kernel format
        backend = vllm_compat.ENGINE_BACKENDS.get(backend, backend)
    kw["weight_transfer_config"] = WeightTransferConfig(backend=backend)
    return kw


#: vLLM's unquantized MoE backends (``UnquantizedMoeBackend`` values, 0.24 and 0.33) whose expert weights keep the
#: loaded layout, and the order of gate and up in their ``w13_weight``: Triton as loaded; FlashInfer CUTLASS swaps
#: the halves after loading (``swap_w13_to_w31``). Others (FlashInfer TRT-LLM's block layout, ROCm AITER's
#: shuffle, MoonEP, CPU prepacking) re-layout them: the kernel format does not cover their experts.
MOE_W13_ORDER = {"TRITON": ["gate_proj", "up_proj"], "BATCHED_TRITON": ["gate_proj", "up_proj"],
                 "FlashInfer CUTLASS": ["up_proj", "gate_proj"]}


def _expert_layout(prefix: str, module: Any) -> dict[str, dict[str, Any]]:
    """The stacked expert parameters of one vLLM MoE module (one that holds ``w13_weight``/``w2_weight``: vLLM's
    ``RoutedExperts``): {parameter name: {``ids``: the global expert ids of its local experts in local order
    (vLLM's ``expert_map``: global -> local or -1; none without expert parallelism), ``parts``: the per-expert
    HF projections in the parameter's memory order}, or {``refuse``: why the kernel format cannot fill it}."""
    base = f"{prefix}." if prefix else ""
    names = (f"{base}w13_weight", f"{base}w2_weight")
    backend = getattr(getattr(getattr(module, "quant_method", None), "unquantized_backend", None), "value", None)
    order = MOE_W13_ORDER.get(backend) if isinstance(backend, str) else None
    gated = getattr(getattr(module, "moe_config", None), "is_act_and_mul", True)
    local = int(module.w13_weight.shape[0])
    emap = getattr(module, "expert_map", None)
    if emap is None:
        ids = list(range(local))
    else:
        ids = [g for _, g in sorted((int(li), g) for g, li in enumerate(emap.tolist()) if int(li) >= 0)]
    why = None
    if order is None:
        why = f"the MoE backend {backend or type(getattr(module, 'quant_method', None)).__name__} keeps its own layout"
    elif not gated:
        why = "a non-gated MoE (w13 holds one projection)"
    elif len(ids) != local:
        why = f"the expert map names {len(ids)} local experts for {local} (redundant experts, EPLB)"
    if why is not None:
        return {n: {"refuse": why} for n in names}
    return {names[0]: {"ids": ids, "parts": order}, names[1]: {"ids": ids, "parts": ["down_proj"]}}


def _worker_param_layout(worker: Any) -> dict[str, Any]:
    """(collective_rpc) The worker's own parameters, fused-module mapping, the dimensions each tensor-parallel
    parameter may be split along (vLLM's ``output_dim``/``input_dim`` attributes), its MoE experts
    (``_expert_layout``), and where the worker is: its TP rank and its GPU's UUID (``weight_sync.KernelPlan``; a
    colocated trainer rank finds its worker by GPU)."""
    import torch

    model = worker.model_runner.model
    mapping = getattr(model, "packed_modules_mapping", None) or {}
    params = list(model.named_parameters())
    # Both attributes where vLLM sets both (every linear weight: output_dim 0, input_dim 1, whether the layer
    # splits its output, column-parallel, or its input, row-parallel): the plan takes the one the shapes fit
    dims = {n: [getattr(p, a) for a in ("output_dim", "input_dim") if isinstance(getattr(p, a, None), int)]
            for n, p in params}
    dims = {n: d for n, d in dims.items() if d}
    experts: dict[str, dict[str, Any]] = {}
    for prefix, module in model.named_modules():
        own = getattr(module, "_parameters", {})
        if "w13_weight" in own and "w2_weight" in own:
            experts.update(_expert_layout(prefix, module))
    device = getattr(worker, "device", None)
    gpu = (str(torch.cuda.get_device_properties(device).uuid)
           if device is not None and getattr(device, "type", None) == "cuda" else None)
    return {
        "params": [(n, list(p.shape)) for n, p in params],
        "packed_modules_mapping": {k: list(v) for k, v in dict(mapping).items()},
        "world_size": worker.vllm_config.parallel_config.world_size,
        "shard_dims": dims,
        "experts": experts,
        "tp_rank": int(getattr(worker, "rank", 0)),  # its rank in the engine (TP x PP; TP-only engines: TP)
        "gpu": gpu,
    }


def _layout(per_worker: list[dict[str, Any]]) -> dict[str, Any]:
    """An engine's layout (``param_layout``): its first worker's, plus where every worker is (``workers``: TP
    rank and GPU UUID each)."""
    return {**per_worker[0], "workers": [{"tp_rank": w["tp_rank"], "gpu": w["gpu"]} for w in per_worker]}


def _worker_memory(worker: Any) -> tuple[int, int]:
    """(collective_rpc) Free and total bytes of the worker's GPU."""
    import torch

    return torch.cuda.mem_get_info(getattr(worker, "device", None))


def _device_info(mem: list[tuple[int, int]]) -> dict[str, Any]:
    """(GPU engines) The actor's visible GPUs and the least free/total memory over its engine's workers' GPUs
    (``mem``: ``_worker_memory`` of every worker; for a validation engine; a TP>1 engine's workers are other
    processes, on other GPUs than the actor's)."""
    return {"cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
            "free": min(m[0] for m in mem), "total": min(m[1] for m in mem)}


def _worker_freeze(worker: Any) -> int:
    """(collective_rpc) ``requires_grad=False`` on every parameter: vLLM 0.24's kernel-format update copies
    into them in place outside ``no_grad``, which autograd refuses for leaves that require grad."""
    n = 0
    for p in worker.model_runner.model.parameters():
        if p.requires_grad:
            p.requires_grad_(False)
            n += 1
    return n


def _worker_weight_format(worker: Any, kernel: bool) -> bool:
    """(collective_rpc, vLLM >= 0.28) Switch the worker's weight-transfer engine to the kernel or the checkpoint
    format (``kernel_transfer.set_format``)."""
    from rlhf_runtime.weight_sync import kernel as kernel_transfer

    return kernel_transfer.set_format(getattr(worker, "weight_transfer_engine", None), kernel)


def format_rpc(format_flag: bool, checkpoint_format: bool, kernel_now: bool) -> tuple[Any, tuple] | None:
    """The worker call an engine makes before ``start_weight_update`` (then ``collective_rpc(fn, args=args)``), or
    None. vLLM 0.24 (``format_flag``): the kernel format copies into parameters outside ``no_grad``, so they are
    frozen first (every kernel sync: cheap). 0.28+: the format is the worker engine's switch, sent when it
    changes (``kernel_now``: the engine's last switch). Pure."""
    if format_flag:
        return (_worker_freeze, ()) if not checkpoint_format else None
    if kernel_now == (not checkpoint_format):
        return None
    return (_worker_weight_format, (not checkpoint_format,))


def _worker_update_round(worker: Any, update_info: dict[str, Any]) -> dict[str, float]:
    """(collective_rpc, vLLM >= 0.28) The worker's ``start_weight_update`` -> ``update_weights`` ->
    ``finish_weight_update`` in one call: one message to the workers per sync instead of three (vLLM's engine
    methods are each a ``collective_rpc`` of these). A failing update ends the worker's session itself (vLLM).
    Stage seconds."""
    t0 = time.perf_counter()
    worker.start_weight_update()
    t1 = time.perf_counter()
    worker.update_weights(update_info)
    t2 = time.perf_counter()
    worker.finish_weight_update()
    return {"start_s": t1 - t0, "update_s": t2 - t1, "finish_s": time.perf_counter() - t2}


async def update_round_async(engine: Any, update_info: dict[str, Any], checkpoint_format: bool) -> dict[str, float]:
    """start -> update -> finish in one actor call on an async engine (``AsyncEngine``, ``SteppedEngine``; see
    ``Engine.update_weights_round``); stage seconds."""
    t0 = time.perf_counter()
    await engine.start_weight_update(checkpoint_format)
    t1 = time.perf_counter()
    await engine.update_weights(update_info)
    t2 = time.perf_counter()
    await engine.finish_weight_update()
    return {"start_s": t1 - t0, "update_s": t2 - t1, "finish_s": time.perf_counter() - t2}


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
        _prepare_env(kwargs, env)
        from vllm import LLM

        t = time.perf_counter()
        self.llm = LLM(**_llm_args(kwargs))
        self.start_seconds = time.perf_counter() - t
        self._format_flag = vllm_compat.takes_format_flag(self.llm.start_weight_update)
        self._kernel = False  # the kernel-format switch last sent to the workers (vLLM >= 0.28)
        self._stale_cache = False  # prefix-cache KV computed with weights that a sync has since replaced
        self._update_open = False  # between start_weight_update and finish_weight_update
        self.lora_request: Any = None  # LoRA: the adapter every generate uses (load_adapter)

    def ready(self) -> float:
        return self.start_seconds

    def pid(self) -> int:
        """The actor's process id (reported in the progress file: which process serves which engine)."""
        return os.getpid()

    def world_size(self) -> int:
        return self.llm.llm_engine.vllm_config.parallel_config.world_size

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
        rpc = format_rpc(self._format_flag, checkpoint_format, self._kernel)
        if rpc is not None:
            self.llm.collective_rpc(rpc[0], args=rpc[1])
            self._kernel = not checkpoint_format

    def start_weight_update(self, checkpoint_format: bool = True) -> None:
        self._prepare_update(checkpoint_format)
        self.llm.start_weight_update(**vllm_compat.start_update_kwargs(self._format_flag, checkpoint_format))
        self._update_open = True

    def param_layout(self) -> dict[str, Any]:
        return _layout(self.llm.collective_rpc(_worker_param_layout))

    def device_info(self) -> dict[str, Any]:
        """(GPU) The actor's visible GPUs and the least free/total memory over its workers' GPUs."""
        return _device_info(self.llm.collective_rpc(_worker_memory))

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self.llm.update_weights({"update_info": update_info})

    def update_weights_round(self, update_info: dict[str, Any], checkpoint_format: bool = True) -> dict[str, float]:
        """start -> update -> finish in one call (``weight_sync`` option ``rpc="one"``, the resident IPC sync);
        stage seconds (vLLM >= 0.28: the workers' own, the slowest worker's; one ``collective_rpc``)."""
        if not self._format_flag:
            t = time.perf_counter()
            self._prepare_update(checkpoint_format)
            stages = self.llm.collective_rpc(_worker_update_round, args=(update_info,))
            self._stale_cache = True
            return {**{k: max(st[k] for st in stages) for k in stages[0]}, "call_s": time.perf_counter() - t}
        t0 = time.perf_counter()
        self.start_weight_update(checkpoint_format)
        t1 = time.perf_counter()
        self.update_weights(update_info)
        t2 = time.perf_counter()
        self.finish_weight_update()
        return {"start_s": t1 - t0, "update_s": t2 - t1, "finish_s": time.perf_counter() - t2}

    def finish_weight_update(self) -> None:
        self._update_open = False
        self.llm.finish_weight_update()
        self._stale_cache = True  # reset before the next generate (keeps the reset out of the sync's time)

    def sleep(self, level: int) -> None:
        self.llm.sleep(level=level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        self.llm.wake_up(tags=tags)


class AsyncEngine:
    """A vLLM ``AsyncLLM`` in an async Ray actor: generation can be paused mid-request for a weight swap."""

    def __init__(self, kwargs: dict[str, Any], env: dict[str, str] | None = None) -> None:
        _prepare_env(kwargs, env)
        from vllm import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        t = time.perf_counter()
        self.llm = AsyncLLM.from_engine_args(AsyncEngineArgs(**_llm_args(kwargs)))
        self.start_seconds = time.perf_counter() - t
        self._format_flag = vllm_compat.takes_format_flag(self.llm.start_weight_update)
        self._kernel = False  # the kernel-format switch last sent to the workers (vLLM >= 0.28)
        self._stale_cache = False  # see Engine
        self.version = 0  # bumped by resume() after a swap
        self._paused = False
        self._live: dict[str, list[int]] = {}
        self._swaps: dict[str, list[int]] = {}

    async def ready(self) -> float:
        return self.start_seconds

    async def pid(self) -> int:
        return os.getpid()

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

    async def start_weight_update(self, checkpoint_format: bool = True) -> None:
        kwargs = vllm_compat.start_update_kwargs(self._format_flag, checkpoint_format)
        rpc = format_rpc(self._format_flag, checkpoint_format, self._kernel)
        if rpc is not None:
            await self.llm.collective_rpc(rpc[0], args=rpc[1])
            self._kernel = not checkpoint_format
        await self.llm.start_weight_update(**kwargs)

    async def param_layout(self) -> dict[str, Any]:
        return _layout(await self.llm.collective_rpc(_worker_param_layout))

    async def device_info(self) -> dict[str, Any]:
        """(GPU) See ``Engine.device_info``."""
        return _device_info(await self.llm.collective_rpc(_worker_memory))

    async def update_weights(self, update_info: dict[str, Any]) -> None:
        await self.llm.collective_rpc("update_weights", kwargs={"update_info": update_info})

    async def update_weights_round(self, update_info: dict[str, Any], checkpoint_format: bool = True) -> dict[str, float]:
        return await update_round_async(self, update_info, checkpoint_format)

    async def finish_weight_update(self) -> None:
        await self.llm.finish_weight_update()
        self._stale_cache = True

    async def sleep(self, level: int) -> None:
        await self.llm.sleep(level=level)

    async def wake_up(self, tags: list[str] | None = None) -> None:
        await self.llm.wake_up(tags=tags)
