"""Weight formats and the plans that produce them.

Two formats reach an engine:

* **checkpoint**: Hugging Face names and shapes (``ParamSource``), loaded through vLLM's layerwise reload
  (``model.load_weights``): works for every engine layout and every supported vLLM;
* **kernel**: the engine's own parameter names and layouts (``KernelPlan``: fused ``qkv_proj`` / ``gate_up_proj``
  written side by side), loaded by a plain ``param.copy_`` (``start_weight_update(is_checkpoint_format=False)``):
  vLLM 0.24 only (``vllm_compat.takes_format_flag``), TP=1 engines, one trainer worker for IPC.

``spec.weightSync.format`` asks for one: ``auto`` (the kernel format where its plan covers the engine, else
checkpoint), ``kernel`` (refused at the sender's start, with the plan's reason, where it cannot run) or
``checkpoint``. ``effective_format`` decides; ``DEFAULT_OPTIONS`` are the sender's defaults.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from rlhf_runtime.weight_sync.producers import ParamSource

FORMATS: tuple[str, ...] = ("auto", "checkpoint", "kernel")

#: Default options of the runtime-driven sender (``RuntimeDrivenSender.configure`` changes them per trainer;
#: ``format`` comes from ``spec.weightSync.format``). The kernel format (``auto``) is the default since it passed
#: the fresh-engine validation on GPUs (NCCL 1.7B with 3 engines, IPC 0.5B; ``benchmarks/README.md``); ``auto``
#: falls back to the checkpoint format where its plan does not apply (TP>1 engines, several IPC trainer ranks,
#: expert parallelism). One RPC per engine and sync since it validated on NCCL 1.7B (17.9 ms vs 23.5 ms with
#: three, same run).
DEFAULT_OPTIONS: dict[str, Any] = {"producer": "runtime", "format": "auto", "rpc": "one"}


class KernelPlan:
    """HF (checkpoint) tensors -> the engine's own parameters, for ``start_weight_update(False)``.

    For each engine parameter (name, shape, dtype, from the engine): the HF tensor of the same name and
    shape, or the HF tensors whose names substitute a fused module's parts (vLLM's
    ``packed_modules_mapping``: ``qkv_proj`` <- ``q_proj, k_proj, v_proj``; ``gate_up_proj`` <-
    ``gate_proj, up_proj``), concatenated along dim 0 (TP=1: vLLM's fused layout). Packing writes the
    parts side by side, so the fusion costs no extra copy. ``ok`` is False (``reason`` says why) when an
    engine parameter has no such source; the sender then keeps the checkpoint format.
    """

    def __init__(self, entries: list[tuple[str, list[int], list[str]]], ok: bool, reason: str) -> None:
        self.entries, self.ok, self.reason = entries, ok, reason

    @classmethod
    def build(cls, source: ParamSource, engine: dict[str, Any]) -> KernelPlan:
        hf = dict(source.wire_shapes())  # names and shapes as the stream yields them
        mapping: dict[str, list[str]] = engine.get("packed_modules_mapping") or {}
        if engine.get("world_size", 1) != 1:
            return cls([], False, "kernel format needs tensor_parallel_size 1")
        entries: list[tuple[str, list[int], list[str]]] = []
        for name, shape in engine["params"]:
            if name in hf and list(hf[name]) == list(shape):
                entries.append((name, list(shape), [name]))
                continue
            found = None
            for fused, parts in mapping.items():
                key = f".{fused}."
                if key in f".{name}":
                    srcs = [name.replace(f"{fused}.", f"{part}.", 1) for part in parts]
                    if all(s in hf for s in srcs) and sum(hf[s][0] for s in srcs) == shape[0] and all(
                        list(hf[s][1:]) == list(shape[1:]) for s in srcs
                    ):
                        found = srcs
                        break
            if found is None:
                return cls([], False, f"no HF source for engine parameter {name} {list(shape)}")
            entries.append((name, list(shape), found))
        # Emit each engine parameter as soon as the HF stream has produced all its parts, so that the
        # send stays lazy (one HF tensor gathered at a time) and every rank iterates the same order.
        order = {n: i for i, n in enumerate(hf)}
        entries.sort(key=lambda e: (max(order[s] for s in e[2]), order[e[2][0]]))
        used = {s for e in entries for s in e[2]}
        reason = f"{len(entries)} engine parameters from {len(used)} of {len(hf)} HF tensors"
        return cls(entries, True, reason)

    def metadata(self, dtype: torch.dtype) -> tuple[list[str], list[str], list[list[int]]]:
        d = str(dtype).split(".")[-1]
        return [e[0] for e in self.entries], [d] * len(self.entries), [e[1] for e in self.entries]

    def iterate(self, source: ParamSource, fuse: bool = True) -> Iterator[tuple[str, Any]]:
        """Yields (engine name, tensor) in ``entries`` order, pulling HF tensors from ``source`` lazily.
        ``fuse=False`` yields fused parameters as a list of parts (``PackedProducer`` writes them side by
        side in its buffer, which is the fused layout, without a ``torch.cat``)."""
        it = iter(source)
        have: dict[str, torch.Tensor] = {}
        for name, _, srcs in self.entries:
            while not all(s in have for s in srcs):
                n, t = next(it)
                have[n] = t
            parts = [have.pop(s) for s in srcs]
            if len(parts) == 1:
                yield name, parts[0]
            else:
                yield name, torch.cat(parts, dim=0) if fuse else parts
        for _ in it:  # HF tensors the engine does not take (e.g. a tied alias): still gathered on every rank
            pass


def effective_format(requested: str, plan: KernelPlan | None) -> str:
    """The format a sync uses: ``kernel`` when asked (``kernel`` or ``auto``) and ``plan`` covers the engines,
    else ``checkpoint``. ``requested == "kernel"`` with no usable plan raises ValueError with the plan's reason
    (``weightSync.format: kernel`` is a promise, not a preference). Pure."""
    if requested not in FORMATS:
        raise ValueError(f"weight format must be one of {', '.join(FORMATS)}, not {requested!r}")
    if requested == "checkpoint":
        return "checkpoint"
    if plan is not None and plan.ok:
        return "kernel"
    if requested == "kernel":
        reason = plan.reason if plan is not None else "no kernel plan"
        raise ValueError(f"weightSync.format kernel cannot be used here ({reason}): use auto or checkpoint")
    return "checkpoint"
