"""The layout of the bucketed FSDP2 gather (``infra.fsdp_gather``: ``shard0_layout``, ``pack_shard0``,
``unpack_shard0``): the ranks' buffers, put one after another as an all-gather does, give back every tensor whole,
for dim-0 shards of every unevenness (ranks holding fewer rows, or none), cast in the packing copy. The collective
itself runs on two real gloo ranks in ``tests/runtime/test_fsdp_lean_gathers.py``."""

from __future__ import annotations

import pytest
import torch

from rlhf_runtime.infra.fsdp_gather import pack_shard0, shard0_layout, shard0_rows, unpack_shard0


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_the_ranks_buffers_side_by_side_give_back_every_tensor(world: int) -> None:
    g = torch.Generator().manual_seed(world)
    shapes = [(7, 5), (3,), (2, 3, 4), (12, 1), (1, 9), (5,)]  # rows < world, uneven, one row
    fulls = [torch.randn(s, generator=g, dtype=torch.float32) for s in shapes]
    layout = shard0_layout(shapes, world)
    buffers = []
    for rank in range(world):
        chunks = [torch.chunk(f, world, dim=0) for f in fulls]  # what DTensor's Shard(0) holds on each rank
        shards = [c[rank] if rank < len(c) else f[:0] for c, f in zip(chunks, fulls, strict=True)]
        assert [s.shape[0] for s in shards] == [shard0_rows(s[0], world, rank) for s in shapes]
        buffers.append(pack_shard0(shards, layout, torch.bfloat16))
    assert len({b.numel() for b in buffers}) == 1  # every rank sends the same size
    out = unpack_shard0(torch.cat(buffers), shapes, layout, world)
    for full, got in zip(fulls, out, strict=True):
        assert got.dtype == torch.bfloat16 and got.is_contiguous()
        assert torch.equal(got, full.to(torch.bfloat16))


def test_the_layout_pads_every_shard_to_the_largest_ranks_rows() -> None:
    assert shard0_layout([(7, 5), (3,), (1, 2)], 3) == [(0, 15, 3), (15, 1, 1), (16, 2, 1)]
    assert [shard0_rows(7, 3, r) for r in range(3)] == [3, 3, 1]
    assert [shard0_rows(2, 4, r) for r in range(4)] == [1, 1, 0, 0]
