"""The direct NCCL sync: the kernel format broadcast straight into the engines' parameters (NCCL, kernel format,
not packed).

vLLM's packed NCCL path copies every byte three times besides the wire (the trainer fuses and packs, the engine
unpacks); its unpacked path is one NCCL launch per tensor into a fresh tensor the engine then copies. Here each
tensor the trainer sends, as it is (a fused parameter's parts unfused: ``KernelPlan.iterate(fuse=False)``), is a
contiguous range of one engine parameter (vLLM fuses along dim 0), received in place, and a bucket's broadcasts
go out as one NCCL group.

Wire (both sides derive it from the update info and ``packed_buffer_size_bytes``): the entries ``(name, dtype,
shape)`` in order, consecutive entries of a name filling it from its start (``flat_plan``), one group per byte
bucket (``buckets``). Into a TP engine every split parameter goes out as every rank's piece, rank after rank
(``rank_pieces``); each worker receives its own pieces into its parameter and the others' into a throw-away
buffer (``rank_plan``). A padded vocabulary's HF rows are received into scratch and copied after the group
(``KernelTarget``). The packs of ``weight_sync.wire`` are received into scratch too. Every check runs on the
metadata before the first broadcast: a plan that does not fit raises without writing a parameter.

``send`` and ``receive`` take any communicator with ``broadcast(tensor, src, stream)``, ``group_start()`` and
``group_end()`` (vLLM's ``PyNcclCommunicator``; a gloo one in the CPU tests).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from rlhf_runtime.weight_sync.wire import carriers, pack_size, wire_sizes

#: ``Plan.buffers`` entry of a piece another TP worker keeps: received into the group's throw-away buffer.
DISCARD = "discard"


@dataclass
class Plan:
    """The engine side of one update info: per entry, the tensor to receive into, and the groups."""

    names: list[str]
    #: a parameter's view; None: a scratch tensor made for its group, copied in by ``KernelTarget`` after it (a
    #: padded vocabulary into a TP worker); ``DISCARD``: another worker's piece
    buffers: list[Any]
    groups: list[tuple[int, int]]
    sizes: list[int]  # per entry, its bytes (``entry_bytes``)
    shapes: list[list[int]]
    dtypes: list[torch.dtype]
    device: Any = None
    #: per entry, the index of the pack entry that carries it (``wire.carriers``), None on the wire itself
    carried: list[int | None] | None = None

    @property
    def bytes(self) -> int:
        """The bytes on the wire (a packed entry's once: in its pack)."""
        return sum(wire_sizes(self.sizes, self.carried))

    @property
    def scratch(self) -> list[bool]:
        """Per entry: received into a scratch tensor and copied into the parameter after its group."""
        return [b is None for b in self.buffers]

    @property
    def direct(self) -> int:
        """Entries received into a parameter (straight, or from their pack)."""
        return sum(isinstance(b, torch.Tensor) for b in self.buffers)

    @property
    def discarded(self) -> int:
        """Entries another TP worker keeps (received into the group's throw-away buffer)."""
        return sum(isinstance(b, str) for b in self.buffers)


def entry_bytes(shapes: Iterable[Iterable[int]], dtypes: Iterable[torch.dtype]) -> list[int]:
    return [math.prod(shape) * dtype.itemsize for shape, dtype in zip(shapes, dtypes, strict=True)]


def buckets(sizes: list[int], bucket_bytes: int) -> list[tuple[int, int]]:
    """Split entries (by byte size, in order) into ``[start, end)`` index ranges of at most ``bucket_bytes`` each;
    an entry larger than a bucket gets a bucket of its own; entries of 0 bytes (carried by a pack) never make a
    bucket of their own. (The gloo backend's packing uses it too.)"""
    out: list[tuple[int, int]] = []
    start, acc = 0, 0
    for i, size in enumerate(sizes):
        if i > start and acc > 0 and acc + size > bucket_bytes:
            out.append((start, i))
            start, acc = i, 0
        acc += size
    if start < len(sizes):
        out.append((start, len(sizes)))
    return out


def not_a_parameter(name: str) -> KeyError:
    return KeyError(f"kernel-format weight {name!r} is not a parameter of the engine's model")


def check_receivable(name: str, param: torch.Tensor, dtype: torch.dtype) -> None:
    """Raise ValueError, naming the entry, where ``param`` cannot be received into as ``dtype``."""
    if param.dtype != dtype:
        raise ValueError(f"kernel-format weight {name!r} is {dtype}; the engine's parameter is {param.dtype}")
    if not param.is_contiguous():
        raise ValueError(f"the engine's parameter {name!r} is not contiguous: it cannot be received into")


def broadcast_group(comm: Any, tensors: list[torch.Tensor], stream: Any = None) -> None:
    """Broadcast ``tensors`` from rank 0 as one NCCL group (one launch); the same calls on every rank."""
    comm.group_start()
    try:
        for tensor in tensors:
            comm.broadcast(tensor, src=0, stream=stream)
    finally:
        comm.group_end()


def flat_plan(params: dict[str, torch.Tensor], vocab: dict[str, tuple[int, int, int]], names: list[str],
              dtypes: list[torch.dtype], shapes: list[list[int]]) -> list[torch.Tensor]:
    """Per entry, the contiguous slice of its parameter it fills (a worker of a TP=1 engine): consecutive entries
    of one name fill the parameter from its start, in order (a fused parameter's parts). Every parameter named
    is filled whole, except a padded vocabulary (``vocab``, ``kernel.vocab_slices``) sent as its Hugging Face
    rows, which fill its first rows. Raises KeyError / ValueError, naming the entry, where the entries do not fit
    (nothing has been received yet then)."""
    out: list[torch.Tensor] = []
    filled: dict[str, int] = {}
    last = None
    for name, dtype, shape in zip(names, dtypes, shapes, strict=True):
        param = params.get(name)
        if param is None:
            raise not_a_parameter(name)
        check_receivable(name, param, dtype)
        if name in filled and last != name:
            raise ValueError(f"kernel-format weight {name!r} is sent in parts that are not consecutive")
        start, n = filled.get(name, 0), math.prod(shape)
        if start + n > param.numel():
            raise ValueError(f"kernel-format weight {name!r}: {list(shape)} at element {start} overruns the "
                             f"engine's parameter {list(param.shape)}")
        out.append(param.view(-1).narrow(0, start, n))
        filled[name], last = start + n, name
    for name, n in filled.items():
        param = params[name]
        if n == param.numel():
            continue
        rows = vocab.get(name)
        inner = math.prod(param.shape[1:])
        if rows is None or rows[1] != 0 or n != rows[0] * inner or names.count(name) != 1:
            raise ValueError(f"kernel-format weight {name!r} fills {n} of the engine's parameter's "
                             f"{param.numel()} elements {list(param.shape)}")
    return out


def rank_plan(params: dict[str, torch.Tensor], vocab: dict[str, tuple[int, int, int]], names: list[str],
              dtypes: list[torch.dtype], shapes: list[list[int]], tp: int, tp_rank: int) -> list[Any]:
    """Per entry, what worker ``tp_rank`` of a TP engine receives it into (``Plan.buffers``): the entries of a
    name are, one after another, every worker's parameter (``rank_pieces``: ``tp`` times its elements) or the
    parameter once (replicated): the entries inside this worker's range are views of its parameter, the others
    ``DISCARD``. A padded vocabulary (``vocab``: its Hugging Face rows, whole) gets None (scratch, copied by
    ``KernelTarget``). Raises KeyError / ValueError, naming the entry, where the entries do not fit."""
    totals: dict[str, int] = {}
    last = None
    for name, shape in zip(names, shapes, strict=True):
        if name not in params:
            raise not_a_parameter(name)
        if name in totals and last != name:
            raise ValueError(f"kernel-format weight {name!r} is sent in parts that are not consecutive")
        totals[name], last = totals.get(name, 0) + math.prod(shape), name
    out: list[Any] = []
    filled: dict[str, int] = {}
    for name, dtype, shape in zip(names, dtypes, shapes, strict=True):
        param, n = params[name], math.prod(shape)
        start = filled.get(name, 0)
        filled[name] = start + n
        if name in vocab and totals[name] != tp * param.numel():
            out.append(None)  # a padded vocabulary's HF rows, whole: KernelTarget copies this worker's
            continue
        check_receivable(name, param, dtype)
        size = param.numel()
        if totals[name] == size:
            low = 0  # replicated: every worker receives it whole
        elif totals[name] == tp * size:
            low = tp_rank * size
        else:
            raise ValueError(f"kernel-format weight {name!r}: {totals[name]} elements sent for a parameter of "
                             f"{size} on each of {tp} workers")
        if low <= start and start + n <= low + size:
            out.append(param.view(-1).narrow(0, start - low, n))
        elif start + n <= low or start >= low + size:
            out.append(DISCARD)
        else:
            raise ValueError(f"kernel-format weight {name!r}: {list(shape)} at element {start} straddles worker "
                             f"{tp_rank}'s piece of it")
    return out


def plan(target: Any, names: list[str], dtype_names: list[str], shapes: list[list[int]],
         bucket_bytes: int, device: Any = None) -> Plan:
    """The engine side of an update info for ``target`` (a ``kernel.KernelTarget``): straight into the
    parameters (``flat_plan`` at TP=1, ``rank_plan`` on a worker of a TP > 1 engine)."""
    dtypes = [getattr(torch, d) for d in dtype_names]
    sizes = entry_bytes(shapes, dtypes)
    carried = carriers(names)
    packs = [i for i, name in enumerate(names) if pack_size(name)]
    if packs and target.tp != 1:
        raise ValueError("pack entries (rlhf.pack:<k>) are received by the workers of TP=1 engines only")
    for i in packs:  # a pack is its entries' elements together, in their dtype
        members = range(i - pack_size(names[i]), i)  # a pack carries the entries just before it (``carriers``)
        if any(dtypes[j] != dtypes[i] for j in members) or len(shapes[i]) != 1 \
                or shapes[i][0] != sum(math.prod(shapes[j]) for j in members):
            raise ValueError(f"pack entry {names[i]!r} {list(shapes[i])} {dtypes[i]} is not its {len(members)} "
                             "entries' elements in their dtype")
    own = [i for i, name in enumerate(names) if not pack_size(name)] if packs else list(range(len(names)))
    pick = (lambda xs: [xs[i] for i in own]) if packs else (lambda xs: list(xs))
    if target.tp == 1:
        mapped: list[Any] = list(flat_plan(target.params, target.vocab, pick(names), pick(dtypes), pick(shapes)))
    else:
        mapped = rank_plan(target.params, target.vocab, names, dtypes, shapes, target.tp, target.tp_rank)
    buffers: list[Any] = [None] * len(names)  # a pack: received into scratch
    for i, buf in zip(own, mapped, strict=True):
        buffers[i] = buf
    return Plan(list(names), buffers, buckets(wire_sizes(sizes, carried), bucket_bytes), sizes,
                [list(s) for s in shapes], dtypes, device, carried if packs else None)


def receive(p: Plan, target: Any, comm: Any, stream: Any = None) -> int:
    """Receive every entry of ``p`` from rank 0, one NCCL group per bucket: into the parameters, the other TP
    workers' pieces into one throw-away buffer per group (the size of its largest such piece: their contents are
    never read, so the group's broadcasts may overwrite each other there), scratch entries copied into the
    parameters (``target.load_weights``) after their group, a pack's pieces into their parameters in one
    multi-tensor copy after its group. Returns the bytes received."""
    carried = p.carried or [None] * len(p.names)
    for start, end in p.groups:
        discard = [p.sizes[i] for i in range(start, end) if p.buffers[i] is DISCARD]
        trash = torch.empty(max(discard), dtype=torch.uint8, device=p.device) if discard else None
        wire, bufs = [], []
        for i in range(start, end):
            if carried[i] is not None:
                continue  # in its pack
            buf = p.buffers[i]
            if buf is None:
                buf = torch.empty(p.shapes[i], dtype=p.dtypes[i], device=p.device)
            elif buf is DISCARD:
                buf = trash[: p.sizes[i]].view(p.dtypes[i]).view(p.shapes[i])  # type: ignore[index]
            wire.append(i)
            bufs.append(buf)
        broadcast_group(comm, bufs, stream)
        pieces = []
        for i, buf in zip(wire, bufs):
            if p.buffers[i] is not None:
                continue
            if pack_size(p.names[i]):
                dst = p.buffers[i - pack_size(p.names[i]):i]  # the entries it carries, just before it
                with torch.no_grad():
                    torch._foreach_copy_(dst, [x.view(d.shape) for x, d in
                                               zip(buf.split([d.numel() for d in dst]), dst)], non_blocking=True)
            else:
                pieces.append((p.names[i], buf))
        if pieces:
            target.load_weights(pieces)
    return p.bytes


def send(pairs: Iterator[tuple[str, torch.Tensor]], sizes: list[int], comm: Any, bucket_bytes: int,
         stream: Any = None, names: list[str] | None = None, before_group: Any = None) -> int:
    """Broadcast the tensors of ``pairs`` (as many as ``sizes``, the entries' bytes the engines were told) from
    rank 0, one group per bucket of ``buckets`` over the bytes each entry puts on the wire (``names``, the
    entries' names: a pack carries the entries before it, which are taken from ``pairs`` and not broadcast). A
    bucket's tensors are taken from ``pairs`` before its group starts: taking one may run other collectives (an
    FSDP2 all-gather), which must not fall into the group; ``before_group()`` runs then (``wire.SideStream.join``).
    Returns the bytes sent."""
    carried = carriers(names) if names is not None else None
    wire = wire_sizes(sizes, carried)
    sent = 0
    for start, end in buckets(wire, bucket_bytes):
        tensors = []
        for i in range(start, end):
            _, tensor = next(pairs)
            tensor = tensor if tensor.is_contiguous() else tensor.contiguous()
            if tensor.numel() * tensor.element_size() != sizes[i]:
                raise ValueError(f"tensor {i} of the sync is {tensor.numel() * tensor.element_size()} bytes, "
                                 f"the engines expect {sizes[i]}")
            if carried is None or carried[i] is None:
                tensors.append(tensor)
        if before_group is not None:
            before_group()
        broadcast_group(comm, tensors, stream)
        sent += sum(wire[start:end])
    for extra in pairs:  # the checked iterator raises where the source yields more than it declared
        raise ValueError(f"the weight source yielded {extra[0]!r} beyond the {len(sizes)} tensors declared")
    return sent


def unfused(pairs: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, torch.Tensor]]:
    """``KernelPlan.iterate(fuse=False)`` as the direct wire's entries: a fused parameter's parts
    (``FusedParts``) one after another under its name."""
    for name, tensor in pairs:
        if isinstance(tensor, list):
            for part in tensor:
                yield name, part
        else:
            yield name, tensor


def rank_pieces(plan: Any, pairs: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, torch.Tensor]]:
    """``KernelPlan.iterate(fuse=False)`` of an ``all_ranks`` plan (TP > 1 engines) as the direct wire's entries:
    a split parameter as every rank's piece, rank after rank, each one contiguous tensor (pieces of rows are views;
    pieces of columns are copied: the worker receives them into its parameter as they are); a fused parameter's
    parts as they come (``iterate`` yields them rank by rank already, each a piece of rows); others whole."""
    for name, tensor in pairs:
        dim = plan.shard.get(name)
        if isinstance(tensor, list):
            yield from ((name, part) for part in tensor)
        elif dim is None:
            yield name, tensor
        else:
            for piece in tensor.chunk(plan.tp, dim=dim):
                yield name, piece if piece.is_contiguous() else piece.contiguous()


def rank_piece_shapes(plan: Any, wire: dict[str, list[int]]) -> list[tuple[str, list[int]]]:
    """The entries of ``rank_pieces`` for an ``all_ranks`` plan (``wire``: the HF shapes as the stream yields
    them)."""
    out: list[tuple[str, list[int]]] = []
    for name, shape, srcs in plan.entries:
        dim = plan.shard.get(name)
        if dim is None:
            out.append((name, list(shape)))
        elif len(srcs) > 1:  # rank 0's piece of each part (rows), then rank 1's, ...
            for _ in range(plan.tp):
                out.extend((name, [wire[s][0] // plan.tp, *wire[s][1:]]) for s in srcs)
        else:
            piece = list(shape)
            piece[dim] //= plan.tp
            out.extend((name, list(piece)) for _ in range(plan.tp))
    return out


def unfused_shapes(entries: list[tuple[str, list[int], list[str]]], wire: dict[str, list[int]]
                   ) -> list[tuple[str, list[int]]]:
    """The entries of ``unfused`` for a TP=1 kernel plan's ``entries`` (engine name, shape, HF sources): a
    parameter of several sources is its sources' shapes as the stream yields them (``wire``), one of one source
    its own (a padded vocabulary: the HF shape the plan recorded)."""
    out = []
    for name, shape, srcs in entries:
        if len(srcs) == 1:
            out.append((name, list(shape)))
        else:
            out.extend((name, list(wire[s])) for s in srcs)
    return out
