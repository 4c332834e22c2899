"""Un-fusing of Hugging Face's fused MoE expert tensors into the per-expert layout vLLM's loaders expect.

Recent Transformers (Qwen3-MoE and others) store a layer's experts as two 3-D tensors:

* ``<prefix>.experts.gate_up_proj``: ``(E, 2*I, H)``; the forward does ``gate, up = (x @ W[e].T).chunk(2, -1)``,
  so rows ``[:I]`` are the gate projection and rows ``[I:]`` the up projection;
* ``<prefix>.experts.down_proj``: ``(E, H, I)``.

vLLM's per-expert checkpoint mapping (present in 0.24 and 0.32; only 0.32 also takes the fused form) names
them ``<prefix>.experts.<e>.gate_proj.weight`` ``(I, H)``, ``...up_proj.weight`` ``(I, H)`` and
``...down_proj.weight`` ``(H, I)``. Sending per-expert tensors works with both versions and lets an
expert-parallel rank receive only its experts. Slices are views of the trainer's tensor (no copy) made
contiguous so they can be packed or shared over IPC. Pure torch; no vLLM import.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

GATE_UP = ".experts.gate_up_proj"
DOWN = ".experts.down_proj"


def is_fused_expert(name: str, ndim: int) -> bool:
    return ndim == 3 and (name.endswith((GATE_UP, DOWN)))


def unfused_shapes(name: str, shape: tuple[int, ...]) -> list[tuple[str, tuple[int, ...]]]:
    """The (name, shape) pairs ``unfuse`` yields for one tensor (for metadata, without the data)."""
    if not is_fused_expert(name, len(shape)):
        return [(name, tuple(shape))]
    experts, rows, cols = shape
    if name.endswith(GATE_UP):
        prefix, inter = name[: -len(".gate_up_proj")], rows // 2
        return [
            (f"{prefix}.{e}.{proj}.weight", (inter, cols)) for e in range(experts) for proj in ("gate_proj", "up_proj")
        ]
    prefix = name[: -len(".down_proj")]
    return [(f"{prefix}.{e}.down_proj.weight", (rows, cols)) for e in range(experts)]


def unfuse(named: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
    """Yield ``(name, tensor)`` with every fused expert tensor split per expert; others pass through."""
    for name, tensor in named:
        if not is_fused_expert(name, tensor.dim()):
            yield name, tensor
            continue
        if tensor.shape[1] % 2 and name.endswith(GATE_UP):
            raise ValueError(f"{name}: gate_up_proj has an odd row count {tuple(tensor.shape)}")
        pieces = unfused_shapes(name, tuple(tensor.shape))
        if name.endswith(GATE_UP):
            inter = tensor.shape[1] // 2
            for e in range(tensor.shape[0]):
                yield pieces[2 * e][0], tensor[e, :inter].contiguous()
                yield pieces[2 * e + 1][0], tensor[e, inter:].contiguous()
        else:
            for e in range(tensor.shape[0]):
                yield pieces[e][0], tensor[e].contiguous()


def fuse(named: Iterable[tuple[str, Any]]) -> dict[str, Any]:
    """The inverse of ``unfuse`` (tests and checkpoint conversion): per-expert tensors back to fused 3-D ones."""
    import re

    import torch

    out: dict[str, Any] = {}
    groups: dict[tuple[str, str], dict[int, Any]] = {}
    pattern = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<e>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$")
    for name, tensor in named:
        m = pattern.match(name)
        if not m:
            out[name] = tensor
            continue
        groups.setdefault((m["prefix"], m["proj"]), {})[int(m["e"])] = tensor
    prefixes = {p for p, _ in groups}
    for prefix in sorted(prefixes):
        gate, up, down = (groups.get((prefix, p), {}) for p in ("gate_proj", "up_proj", "down_proj"))
        n = len(down)
        if not (len(gate) == len(up) == n and set(down) == set(range(n))):
            raise ValueError(f"{prefix}: incomplete experts (gate {len(gate)}, up {len(up)}, down {n})")
        out[f"{prefix}.gate_up_proj"] = torch.stack([torch.cat([gate[e], up[e]], dim=0) for e in range(n)])
        out[f"{prefix}.down_proj"] = torch.stack([down[e] for e in range(n)])
    return out
