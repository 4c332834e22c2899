"""The direct NCCL sync's wire options into TP=1 engines (``weight_sync.direct``; ``options.EXPERIMENTAL``
``direct_fuse`` / ``direct_packs``). The entries the engines are told describe the wire, so the engines need no
setting of their own.

* fused (``fused``): a fused parameter (q, k, v; gate, up) as one tensor, its parts concatenated on a CUDA stream
  of its own while the previous group is on the wire (``SideStream``): one broadcast per engine parameter instead
  of one per part.
* packs (``with_packs``, ``packed``): the entries smaller than ``SMALL_BYTES`` (norm weights) move to the end of
  the wire, each run of them followed by an entry ``rlhf.pack:<k>`` (``PACK``) that carries the ``k`` entries
  before it in one broadcast (``carriers``); the engine receives it into a scratch tensor and copies the pieces
  into their parameters after its group (``direct.receive``).

Both cut the number of broadcasts NCCL runs one after another in a group. Pure torch.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from typing import Any

import torch

#: Name prefix of a pack entry (``with_packs``): ``rlhf.pack:<k>`` carries the ``k`` entries just before it.
PACK = "rlhf.pack:"

#: Entries smaller than this travel in packs where the sender packs (``with_packs``): norm weights and biases, no
#: matrix of any model this runtime syncs (Qwen3-1.7B's smallest matrix is 4 MiB).
SMALL_BYTES = 64 << 10

#: At most this many entries in one pack (a pack is received into a scratch tensor of their bytes).
PACK_MAX = 512


def pack_size(name: str) -> int:
    """How many entries before it the entry ``name`` carries (``with_packs``); 0 for an entry of its own."""
    if not name.startswith(PACK):
        return 0
    k = name[len(PACK):]
    if not k.isdigit() or int(k) < 1:
        raise ValueError(f"malformed pack entry {name!r}: {PACK}<number of entries it carries>")
    return int(k)


def carriers(names: list[str]) -> list[int | None]:
    """Per entry, the index of the pack entry that carries it (``with_packs``), None for one broadcast itself
    (a pack too). Raises ValueError where a pack claims entries that are not there (before it, not a pack, not
    carried by another)."""
    out: list[int | None] = [None] * len(names)
    free = 0  # entries since the last pack: the ones a pack may carry
    for i, name in enumerate(names):
        k = pack_size(name)
        if not k:
            free += 1
            continue
        if k > free:
            raise ValueError(f"pack entry {name!r} at {i} carries {k} entries; only {free} precede it uncarried")
        for j in range(i - k, i):
            out[j] = i
        free = 0
    return out


def with_packs(entries: list[tuple[str, list[int]]], itemsize: int, small: int = SMALL_BYTES,
               most: int = PACK_MAX) -> list[tuple[str, list[int]]]:
    """The wire ``entries`` (name, shape) with the small ones packed: every entry smaller than ``small`` bytes whose
    name occurs once (a whole parameter: the parts of a fused one stay in their places) moves towards the end, a
    pack entry (``PACK`` and their number, the shape of their elements together) after every ``most`` of them and
    after the last. Pure."""
    counts: dict[str, int] = {}
    for name, _ in entries:
        counts[name] = counts.get(name, 0) + 1
    out: list[tuple[str, list[int]]] = []
    pending: list[tuple[str, list[int]]] = []

    def flush() -> None:
        if pending:
            out.extend(pending)
            out.append((f"{PACK}{len(pending)}", [sum(math.prod(s) for _, s in pending)]))
            pending.clear()

    for name, shape in entries:
        if counts[name] == 1 and math.prod(shape) * itemsize < small:
            pending.append((name, list(shape)))
            if len(pending) == most:
                flush()
        else:
            out.append((name, list(shape)))
    flush()
    return out


def packed(pairs: Iterable[tuple[str, torch.Tensor]], entries: list[tuple[str, list[int]]],
           side: SideStream | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """``pairs`` (the wire before ``with_packs``) in the order of ``entries`` (``with_packs``' result): an entry
    moved later is held (a reference) until its turn; a pack entry yields its entries' tensors concatenated (on
    ``side`` where the pairs come from ``fused`` on it: an entry may have been made there)."""
    it = iter(pairs)
    held: dict[str, torch.Tensor] = {}
    recent: list[torch.Tensor] = []  # the tensors since the last pack
    for name, _ in entries:
        k = pack_size(name)
        if k:
            flat = [t.reshape(-1) for t in recent[-k:]]
            yield name, side.cat(flat, [sum(t.numel() for t in flat)]) if side is not None else torch.cat(flat)
            recent.clear()
            continue
        tensor = held.pop(name, None)
        while tensor is None:
            n, t = next(it)
            if n == name:
                tensor = t
            elif n in held:
                raise ValueError(f"the weight source yielded {n!r} twice before the wire took it")
            else:  # a small entry the wire moves later
                held[n] = t
        recent.append(tensor)
        yield name, tensor


def wire_sizes(sizes: list[int], carried: list[int | None] | None) -> list[int]:
    """Per entry, the bytes it puts on the wire: its own, 0 where a pack carries it (``carriers``)."""
    if carried is None:
        return list(sizes)
    return [0 if c is not None else n for n, c in zip(sizes, carried, strict=True)]


class SideStream:
    """Where the fused wire concatenates a fused parameter's parts (``fused``): on a CUDA stream of its own, so
    that the copies of a bucket run while the previous group is on the wire (on the current stream they would
    queue after it). ``begin`` (at a sync's start) makes the side stream wait for the current stream's work up to
    then (the trainer's step); ``join`` (before each group: ``send``'s ``before_group``) makes the current stream
    wait for the copies queued so far. Each result is marked in use by the current stream (``record_stream``),
    so its memory is not reused before the broadcast that reads it ran. Without CUDA the parts are concatenated
    where they are."""

    def __init__(self) -> None:
        self.side = torch.cuda.Stream() if torch.cuda.is_available() else None
        self.main: Any = None

    def begin(self) -> None:
        if self.side is not None:
            self.main = torch.cuda.current_stream()
            self.side.wait_stream(self.main)

    def cat(self, parts: list[torch.Tensor], shape: list[int]) -> torch.Tensor:
        if self.side is None or self.main is None:
            return torch.cat(parts, dim=0).view(shape)
        with torch.cuda.stream(self.side):
            out = torch.cat(parts, dim=0).view(shape)
        out.record_stream(self.main)
        return out

    def join(self) -> None:
        if self.side is not None and self.main is not None:
            self.main.wait_stream(self.side)


def fused(pairs: Iterable[tuple[str, Any]], side: SideStream) -> Iterator[tuple[str, torch.Tensor]]:
    """``KernelPlan.iterate(fuse=False)`` as the fused wire's entries: a fused parameter (``FusedParts``) as one
    tensor, its parts concatenated on ``side``; others as they are."""
    side.begin()
    for name, tensor in pairs:
        yield name, side.cat(list(tensor), list(tensor.shape)) if isinstance(tensor, list) else tensor
