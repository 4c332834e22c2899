"""Weight formats and the plans that produce them.

* **checkpoint**: Hugging Face names and shapes (``ParamSource``), loaded through vLLM's layerwise reload: every
  engine layout, every supported vLLM;
* **kernel**: the engine's own parameter names and layouts (``KernelPlan``: fused ``qkv_proj`` / ``gate_up_proj``
  written side by side), copied in place by the runtime's worker engines (``weight_sync.kernel``), for engines
  whose parameters are what the kernels read (GPU; on CPU vLLM prepacks linear weights and the plan finds none).

``weightSync.format`` asks for one: ``auto`` (kernel where its plan covers the engines), ``kernel`` (refused with
the plan's reason where it cannot run) or ``checkpoint``; ``effective_format`` decides.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from rlhf_runtime.weight_sync.options import FORMATS
from rlhf_runtime.weight_sync.producers import FusedParts, ParamSource

__all__ = ["FORMATS", "KernelPlan", "effective_format"]


class KernelPlan:
    """HF (checkpoint) tensors -> the engine's own parameters, for a kernel-format update (a plain copy each):
    per engine parameter the HF tensor of its name, or those of a fused module's parts (``packed_modules_mapping``:
    ``qkv_proj`` <- ``q_proj, k_proj, v_proj``) concatenated along dim 0; MoE experts (``workers.expert_layout``)
    the per-expert HF tensors (``moe.unfuse``) in the backend's order, or the backend's reason to refuse.

    TP > 1: a parameter of the whole source's shape is replicated, else split along the dimension the engine
    reports (``shard_dims``), piece ``tp_rank`` of each part; without ``tp_rank`` (``all_ranks``) every rank's
    pieces side by side, each worker taking its own (``kernel.KernelTarget``). A padded vocabulary goes as the HF
    tensor, whole. Other uneven splits find no source: the plan is not ``ok`` and ``reason`` names the parameter.
    """

    def __init__(self, entries: list[tuple[str, list[int], list[str]]], ok: bool, reason: str,
                 shard: dict[str, int] | None = None, tp: int = 1, tp_rank: int = 0, all_ranks: bool = False) -> None:
        self.entries, self.ok, self.reason = entries, ok, reason
        self.shard = shard or {}  # engine name -> the dimension its sources are split along (TP > 1)
        self.tp, self.tp_rank = tp, tp_rank
        #: every TP rank's pieces in one stream (no ``tp_rank`` given; the engine workers take their own)
        self.all_ranks = all_ranks and tp > 1

    def used_sources(self) -> set[str]:
        """The HF names the plan takes (``iterate`` drops the others)."""
        return {s for _, _, srcs in self.entries for s in srcs}

    def row_split_sources(self) -> set[str]:
        """HF names every entry using them splits along dim 0 (what an FSDP2 shard can be; none for ``all_ranks``)."""
        if self.all_ranks:
            return set()
        rows = {s for n, _, srcs in self.entries if self.shard.get(n) == 0 for s in srcs}
        return rows - {s for n, _, srcs in self.entries if self.shard.get(n) != 0 for s in srcs}

    @staticmethod
    def _sources(name: str, hf: dict[str, Any], mapping: dict[str, list[str]]) -> list[str] | None:
        if name in hf:
            return [name]
        for fused, parts in mapping.items():
            if f".{fused}." in f".{name}":
                srcs = [name.replace(f"{fused}.", f"{part}.", 1) for part in parts]
                if all(s in hf for s in srcs):
                    return srcs
        return None

    @staticmethod
    def _expert_sources(name: str, shape: list[int], hf: dict[str, Any], ex: dict[str, Any],
                        tp: int) -> tuple[list[str] | None, str]:
        """The per-expert HF tensors of a stacked expert parameter in its memory order, or None and why not."""
        what = f"engine parameter {name} {shape}"
        if "refuse" in ex:
            return None, f"{what}: {ex['refuse']}"
        if tp != 1:
            return None, f"{what}: expert weights of a tensor-parallel engine are not planned (tensor_parallel_size {tp})"
        cut = name.find(".experts.")
        if cut < 0:
            return None, f"{what}: not under an .experts. module"
        prefix = name[: cut + len(".experts")]
        srcs = [f"{prefix}.{e}.{part}.weight" for e in ex["ids"] for part in ex["parts"]]
        missing = next((s for s in srcs if s not in hf), None)
        if missing is not None:
            return None, f"{what}: no HF source {missing}"
        first = hf[srcs[0]]
        rows = sum(hf[s][0] for s in srcs[: len(ex["parts"])])
        if (len(first) != 2 or any(hf[s][1:] != first[1:] for s in srcs)
                or shape != [len(ex["ids"]), rows, first[1]]):
            return None, f"{what}: the HF experts {prefix}.<e>.{'/'.join(ex['parts'])} do not stack to it"
        return srcs, ""

    @staticmethod
    def _split_fits(shape: list[int], parts: list[list[int]], dim: int, tp: int) -> bool:
        """Whether ``shape`` is one TP rank's of the HF ``parts`` split ``tp`` ways along ``dim``, a piece of each
        part concatenated along dim 0 (fused parts split along dim 0 only)."""
        if dim >= len(shape) or (len(parts) > 1 and dim != 0):
            return False
        pieces = []
        for part in parts:
            if dim >= len(part) or part[dim] % tp:
                return False
            piece = list(part)
            piece[dim] //= tp
            pieces.append(piece)
        local = [sum(pc[0] for pc in pieces), *pieces[0][1:]] if dim == 0 else pieces[0]
        return local == shape and all(pc[1:] == pieces[0][1:] for pc in pieces)

    @staticmethod
    def _padded_vocab(shape: list[int], srcs: list[str] | None, hf: dict[str, list[int]], rows: int | None,
                      tp: int) -> bool:
        """Whether ``shape`` is a padded vocabulary (vLLM pads to a multiple of 64 rows, then splits over the TP
        ranks; ``rows``: its HF rows) of one HF tensor, sent whole: each worker copies its rows."""
        return (rows is not None and srcs is not None and len(srcs) == 1 and hf[srcs[0]][0] == rows
                and hf[srcs[0]][1:] == shape[1:] and rows <= shape[0] * tp)

    @classmethod
    def build(cls, source: ParamSource, engine: dict[str, Any], tp_rank: int | None = None) -> KernelPlan:
        """``engine``: the layout an engine worker reports (``params`` [(name, shape)], ``packed_modules_mapping``,
        ``world_size`` = TP, ``shard_dims`` {name: dims it may be split along}, ``vocab``, ``experts``).
        ``tp_rank``: the worker this rank's tensors are for when TP > 1; None: every rank's (``all_ranks``)."""
        hf = {n: list(s) for n, s in source.wire_shapes()}  # names and shapes as the stream yields them
        mapping: dict[str, list[str]] = engine.get("packed_modules_mapping") or {}
        tp = int(engine.get("world_size", 1))
        all_ranks = tp > 1 and tp_rank is None
        dims: dict[str, list[int]] = engine.get("shard_dims") or {}
        experts: dict[str, dict[str, Any]] = engine.get("experts") or {}
        entries: list[tuple[str, list[int], list[str]]] = []
        shard: dict[str, int] = {}
        padded: list[str] = []
        for name, shape in engine["params"]:
            shape = list(shape)
            if name in experts:
                srcs, why = cls._expert_sources(name, shape, hf, experts[name], tp)
                if srcs is None:
                    return cls([], False, why)
                entries.append((name, shape, srcs))
                continue
            srcs = cls._sources(name, hf, mapping)
            whole = None if srcs is None else [sum(hf[s][0] for s in srcs), *hf[srcs[0]][1:]]
            if srcs is not None and all(hf[s][1:] == hf[srcs[0]][1:] for s in srcs) and whole == shape:
                entries.append((name, shape, srcs))  # TP = 1, or replicated on every rank
                continue
            cands = list(dims.get(name) or [])
            dim = next((d for d in cands if srcs is not None and tp > 1
                        and cls._split_fits(shape, [hf[s] for s in srcs], d, tp)), None)
            if dim is not None:
                if all_ranks:  # every rank's piece side by side along the split dimension
                    shape[dim] *= tp
                entries.append((name, shape, srcs))
                shard[name] = dim
                continue
            if cls._padded_vocab(shape, srcs, hf, (engine.get("vocab") or {}).get(name), tp):
                entries.append((name, list(hf[srcs[0]]), srcs))  # type: ignore[index]
                padded.append(name)
                continue
            what = f"engine parameter {name} {shape}"
            if tp > 1:
                rank = "each rank" if all_ranks else f"rank {tp_rank}"
                what += f" ({rank} of {tp}, split along {' or '.join(map(str, cands)) or 'no dimension'})"
            return cls([], False, f"no HF source for {what}")
        # Emit each engine parameter as soon as the HF stream has produced all its parts, so that the
        # send stays lazy (one HF tensor gathered at a time) and every rank iterates the same order.
        order = {n: i for i, n in enumerate(hf)}
        entries.sort(key=lambda e: (max(order[s] for s in e[2]), order[e[2][0]]))
        used = {s for e in entries for s in e[2]}
        reason = f"{len(entries)} engine parameters from {len(used)} of {len(hf)} HF tensors"
        if padded:
            reason += f", {len(padded)} padded vocabular{'ies' if len(padded) > 1 else 'y'} sent unpadded"
        if all_ranks:
            reason += f", {len(shard)} split, the pieces of all {tp} ranks side by side"
        elif tp > 1:
            reason += f", {len(shard)} split for rank {tp_rank} of {tp}"
        return cls(entries, True, reason, shard, tp, tp_rank or 0, all_ranks)

    def metadata(self, dtype: torch.dtype) -> tuple[list[str], list[str], list[list[int]]]:
        d = str(dtype).split(".")[-1]
        return [e[0] for e in self.entries], [d] * len(self.entries), [e[1] for e in self.entries]

    def iterate(self, source: ParamSource, fuse: bool = True) -> Iterator[tuple[str, Any]]:
        """(engine name, tensor) in ``entries`` order, the HF tensors pulled from ``source`` lazily. ``fuse=False``:
        fused parameters as their parts (``FusedParts``: written side by side, no ``torch.cat``). Split parameters:
        this rank's pieces (views), except those the source yields as this rank's piece already
        (``ParamSource.local``); an ``all_ranks`` plan yields every rank's pieces in rank order."""
        presliced = getattr(source, "local", ())  # a source without the attribute sends every tensor whole
        it = iter(source)
        needed = {s for e in self.entries for s in e[2]}
        have: dict[str, torch.Tensor] = {}
        for name, shape, srcs in self.entries:
            while not all(s in have for s in srcs):
                n, t = next(it)
                if n in needed:  # others (another engine's experts, a tied alias) are not kept alive
                    have[n] = t
            parts = [have.pop(s) for s in srcs]
            dim = self.shard.get(name)
            if dim is not None and self.all_ranks:
                if len(parts) > 1:  # fused parts split along dim 0 (``_split_fits``): rank 0's pieces, rank 1's, ...
                    parts = [p.chunk(self.tp, dim=0)[r] for r in range(self.tp) for p in parts]
                dim = None  # one part: all ranks' pieces side by side are the tensor itself
            elif dim is not None:
                parts = [p if s in presliced else p.chunk(self.tp, dim=dim)[self.tp_rank]
                         for s, p in zip(srcs, parts)]
            if len(parts) == 1:
                yield name, parts[0] if dim is None else parts[0].contiguous()
            elif fuse:
                fused = torch.cat(parts, dim=0)
                yield name, fused if list(fused.shape) == shape else fused.view(shape)  # stacked experts
            else:
                yield name, FusedParts(parts, shape)
        for _ in it:  # HF tensors the engine does not take (e.g. a tied alias): still gathered on every rank
            pass


def effective_format(requested: str, plan: KernelPlan | None) -> str:
    """The format a sync uses: ``kernel`` when asked (``kernel`` or ``auto``) and ``plan`` covers the engines, else
    ``checkpoint``; ``kernel`` with no usable plan raises ValueError with the plan's reason. Pure."""
    if requested == "checkpoint":
        return "checkpoint"
    if plan is not None and plan.ok:
        return "kernel"
    if requested == "kernel":
        reason = plan.reason if plan is not None else "no kernel plan"
        raise ValueError(f"weightSync.format kernel cannot be used here ({reason}): use auto or checkpoint")
    return "checkpoint"
