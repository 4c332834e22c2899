"""FSDP2's dim-0 shards gathered into full tensors in one all-gather for a run of tensors (``gather_shard0``)
instead of one ``full_tensor()`` each: each rank packs its shards into one buffer (``pack_shard0``, cast in the
copy), the buffers are gathered, and the full tensors cut out of the result (``unpack_shard0``). Pure torch.
"""

from __future__ import annotations

import math
from typing import Any

import torch


def shard0_layout(shapes: list[tuple[int, ...]], world: int) -> list[tuple[int, int, int]]:
    """Where each tensor's dim-0 shard sits in one rank's all-gather buffer: ``(offset, padded elements, rows per
    rank)``, in elements. Under ``Shard(0)`` (``torch.chunk``) rank ``r`` holds rows ``[r*c, min((r+1)*c, n))``,
    ``c = ceil(n / world)``; each tensor takes ``c`` rows in every rank's buffer, so the buffers are alike."""
    out, offset = [], 0
    for shape in shapes:
        rows, inner = -(-shape[0] // world), math.prod(shape[1:])
        out.append((offset, rows * inner, rows))
        offset += rows * inner
    return out


def shard0_rows(n: int, world: int, rank: int) -> int:
    """Rows of an ``n``-row tensor that rank ``rank`` holds under ``Shard(0)`` (``torch.chunk``)."""
    c = -(-n // world)
    return max(0, min(c, n - rank * c))


def pack_shard0(shards: list[torch.Tensor], layout: list[tuple[int, int, int]], dtype: torch.dtype) -> torch.Tensor:
    """One rank's all-gather input: its ``shards`` cast to ``dtype`` at their ``layout`` offsets (padding unset)."""
    total = layout[-1][0] + layout[-1][1] if layout else 0
    device = shards[0].device if shards else None
    buf = torch.empty(total, dtype=dtype, device=device)
    for shard, (offset, _, _) in zip(shards, layout, strict=True):
        if shard.numel():
            buf.narrow(0, offset, shard.numel()).view(shard.shape).copy_(shard)
    return buf


def unpack_shard0(gathered: torch.Tensor, shapes: list[tuple[int, ...]], layout: list[tuple[int, int, int]],
                  world: int) -> list[torch.Tensor]:
    """The full tensors from the gathered buffer (the ranks' buffers one after another), each fresh and contiguous."""
    per_rank = gathered.view(world, -1)
    out = []
    for shape, (offset, padded, rows) in zip(shapes, layout, strict=True):
        inner = tuple(shape[1:])
        pieces = per_rank.narrow(1, offset, padded).reshape(world * rows, *inner)  # a copy where strided
        out.append(pieces.narrow(0, 0, shape[0]).contiguous())  # (one row per rank: reshape keeps the view)
    return out


def shard0_mesh(p: Any) -> Any:
    """The one-dimensional device mesh ``p`` (a DTensor) is sharded over on dim 0, else None (the same on every
    rank: the ranks agree which tensors ``gather_shard0`` takes)."""
    placements, mesh = getattr(p, "placements", None), getattr(p, "device_mesh", None)
    if placements is None or mesh is None or mesh.ndim != 1 or len(placements) != 1:
        return None
    if not placements[0].is_shard(0) or len(p.shape) == 0:
        return None
    return mesh


def gather_shard0(params: list[Any], mesh: Any, dtype: torch.dtype) -> list[torch.Tensor]:
    """The full tensors of ``params`` (DTensors sharded on dim 0 over ``mesh``) in ``dtype``, in one all-gather
    instead of one ``full_tensor()`` each. A collective: every rank calls it with the same tensors in order."""
    import torch.distributed as dist

    world, rank = mesh.size(), mesh.get_local_rank()
    shapes = [tuple(p.shape) for p in params]
    shards = [p.to_local() for p in params]
    for p, s in zip(params, shards, strict=True):
        if s.shape[0] != shard0_rows(p.shape[0], world, rank) or tuple(s.shape[1:]) != tuple(p.shape[1:]):
            raise RuntimeError(f"an FSDP2 shard of {list(p.shape)} on rank {rank} of {world} is {list(s.shape)}, "
                               "not the torch.chunk piece of Shard(0)")
    layout = shard0_layout(shapes, world)
    send = pack_shard0(shards, layout, dtype)
    gathered = torch.empty(world * send.numel(), dtype=dtype, device=send.device)
    dist.all_gather_into_tensor(gathered, send, group=mesh.get_group())
    return unpack_shard0(gathered, shapes, layout, world)
