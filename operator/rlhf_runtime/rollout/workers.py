"""What an engine asks of its vLLM workers (``collective_rpc``), and the pure helpers that merge their answers.

Each ``worker_*`` function runs inside every worker of one engine (``LLM.collective_rpc(fn, args=...)``; vLLM
passes the worker first): the parameter layout the kernel-format plan needs (``worker_param_layout``, merged by
``engine_layout``), the free GPU memory of validation (``worker_memory``, merged by ``engine_device_info``), the
kernel-format switch (``worker_weight_format``, sent when ``format_rpc`` says so) and a whole weight update in one
call (``worker_update_round``). Importing this module imports nothing heavy (torch and the runtime's vLLM engine
module are imported inside the workers).
"""

from __future__ import annotations

import os
import time
from typing import Any

#: vLLM's unquantized MoE backends (``UnquantizedMoeBackend`` values, as of 0.33) whose expert weights keep the
#: loaded layout, and the order of gate and up in their ``w13_weight``: Triton as loaded; FlashInfer CUTLASS swaps
#: the halves after loading (``swap_w13_to_w31``). Others (FlashInfer TRT-LLM's block layout, ROCm AITER's
#: shuffle, MoonEP, CPU prepacking) re-layout them: the kernel format does not cover their experts.
MOE_W13_ORDER = {"TRITON": ["gate_proj", "up_proj"], "BATCHED_TRITON": ["gate_proj", "up_proj"],
                 "FlashInfer CUTLASS": ["up_proj", "gate_proj"]}


def expert_layout(prefix: str, module: Any) -> dict[str, dict[str, Any]]:
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


def worker_param_layout(worker: Any) -> dict[str, Any]:
    """(collective_rpc) The worker's own parameters, fused-module mapping, the dimensions each tensor-parallel
    parameter may be split along (vLLM's ``output_dim``/``input_dim`` attributes), its MoE experts
    (``expert_layout``), its padded vocabulary parameters (``vocab``: name -> Hugging Face rows), and where the worker is: its TP rank and its GPU's UUID (``weight_sync.KernelPlan``; a
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
            experts.update(expert_layout(prefix, module))
    from rlhf_runtime.weight_sync.kernel import vocab_slices

    vocab = {n: rows for n, (rows, _, _) in vocab_slices(model).items()}
    device = getattr(worker, "device", None)
    gpu = (str(torch.cuda.get_device_properties(device).uuid)
           if device is not None and getattr(device, "type", None) == "cuda" else None)
    return {
        "params": [(n, list(p.shape)) for n, p in params],
        "packed_modules_mapping": {k: list(v) for k, v in dict(mapping).items()},
        "world_size": worker.vllm_config.parallel_config.world_size,
        "shard_dims": dims,
        "experts": experts,
        "vocab": vocab,  # padded vocabulary parameters: their Hugging Face rows (weight_sync.kernel.vocab_slices)
        "tp_rank": int(getattr(worker, "rank", 0)),  # its rank in the engine (TP x PP; TP-only engines: TP)
        "gpu": gpu,
    }


def engine_layout(per_worker: list[dict[str, Any]]) -> dict[str, Any]:
    """An engine's layout (``param_layout``): its first worker's, plus where every worker is (``workers``: TP
    rank and GPU UUID each)."""
    return {**per_worker[0], "workers": [{"tp_rank": w["tp_rank"], "gpu": w["gpu"]} for w in per_worker]}


def worker_memory(worker: Any) -> tuple[int, int]:
    """(collective_rpc) Free and total bytes of the worker's GPU."""
    import torch

    return torch.cuda.mem_get_info(getattr(worker, "device", None))


def engine_device_info(mem: list[tuple[int, int]]) -> dict[str, Any]:
    """(GPU engines) The actor's visible GPUs and the least free/total memory over its engine's workers' GPUs
    (``mem``: ``worker_memory`` of every worker; for a validation engine; a TP>1 engine's workers are other
    processes, on other GPUs than the actor's)."""
    return {"cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
            "free": min(m[0] for m in mem), "total": min(m[1] for m in mem)}


def worker_weight_format(worker: Any, kernel: bool) -> bool:
    """(collective_rpc) Switch the worker's weight-transfer engine to the kernel or the checkpoint format
    (``weight_sync.kernel.set_format``)."""
    from rlhf_runtime.weight_sync import kernel as kernel_transfer

    return kernel_transfer.set_format(getattr(worker, "weight_transfer_engine", None), kernel)


def format_rpc(checkpoint_format: bool, kernel_now: bool) -> tuple[Any, tuple] | None:
    """The worker call an engine makes before ``start_weight_update`` (then ``collective_rpc(fn, args=args)``), or
    None: the format is the worker engine's switch (``weight_sync.kernel``), sent when it changes (``kernel_now``:
    the engine's last switch). Pure."""
    if kernel_now == (not checkpoint_format):
        return None
    return (worker_weight_format, (not checkpoint_format,))


def worker_update_round(worker: Any, update_info: dict[str, Any]) -> dict[str, float]:
    """(collective_rpc) The worker's ``start_weight_update`` -> ``update_weights`` ->
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
