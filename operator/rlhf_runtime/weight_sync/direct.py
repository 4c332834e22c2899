"""The direct NCCL sync: the kernel format, not packed, broadcast straight into the engines' parameters.

vLLM's packed NCCL path copies every byte three times besides the wire (the trainer fuses and packs, the engine
unpacks); its unpacked path is one NCCL launch per tensor into a fresh tensor the engine then copies. Here each
tensor the trainer sends, as it is (a fused parameter's parts unfused), is a contiguous range of one engine
parameter (vLLM fuses along dim 0), received in place, a bucket's broadcasts in one NCCL group.

Wire (both sides derive it from the update info and ``packed_buffer_size_bytes``): the entries ``(name, dtype,
shape)`` in order (``pieces``), consecutive entries of a name filling it from its start, one group per byte bucket
(``buckets``). Into a TP engine every split parameter goes out as every rank's piece, rank after rank; each worker
receives its own pieces into its parameter and the others' into a throw-away buffer (``rank_plan``). A padded
vocabulary's HF rows are received into scratch and copied after the group (``KernelTarget``). Every check runs on
the metadata before the first broadcast: a plan that does not fit raises without writing a parameter.

``send`` and ``receive`` take any communicator with ``broadcast(tensor, src, stream)``, ``group_start()`` and
``group_end()`` (vLLM's ``PyNcclCommunicator``; a gloo one in the CPU tests).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

#: ``Plan.buffers`` entry of a piece another TP worker keeps: received into the group's throw-away buffer.
DISCARD = "discard"


@dataclass
class Plan:
    """The engine side of one update info: per entry, the tensor to receive into, and the groups."""

    names: list[str]
    #: a parameter's view; None: scratch, copied in by ``KernelTarget`` after its group (a padded vocabulary into
    #: a TP worker); ``DISCARD``: another worker's piece
    buffers: list[Any]
    groups: list[tuple[int, int]]
    sizes: list[int]  # per entry, its bytes (``entry_bytes``)
    shapes: list[list[int]]
    dtypes: list[torch.dtype]
    device: Any = None

    @property
    def bytes(self) -> int:
        return sum(self.sizes)

    @property
    def scratch(self) -> list[bool]:
        return [b is None for b in self.buffers]

    @property
    def direct(self) -> int:  # entries received into a parameter
        return sum(isinstance(b, torch.Tensor) for b in self.buffers)

    @property
    def discarded(self) -> int:  # entries another TP worker keeps
        return sum(isinstance(b, str) for b in self.buffers)


def entry_bytes(shapes: Iterable[Iterable[int]], dtypes: Iterable[torch.dtype]) -> list[int]:
    return [math.prod(shape) * dtype.itemsize for shape, dtype in zip(shapes, dtypes, strict=True)]


def buckets(sizes: list[int], bucket_bytes: int) -> list[tuple[int, int]]:
    """Entries (by byte size, in order) as ``[start, end)`` ranges of at most ``bucket_bytes`` each (a larger entry
    alone); the gloo backend's buckets too."""
    out: list[tuple[int, int]] = []
    start, acc = 0, 0
    for i, size in enumerate(sizes):
        if i > start and acc + size > bucket_bytes:
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
    of one name fill the parameter from its start. Every parameter named is filled whole, except a padded
    vocabulary (``vocab``, ``kernel.vocab_slices``) sent as its HF rows, which fill its first rows. Raises
    KeyError / ValueError, naming the entry, where the entries do not fit."""
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
    name are every worker's parameter one after another (``pieces``) or the parameter once (replicated); those in
    this worker's range are views of its parameter, the others ``DISCARD``; a padded vocabulary (its HF rows,
    whole) None. Raises KeyError / ValueError, naming the entry, where the entries do not fit."""
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
    if target.tp == 1:
        buffers: list[Any] = list(flat_plan(target.params, target.vocab, names, dtypes, shapes))
    else:
        buffers = rank_plan(target.params, target.vocab, names, dtypes, shapes, target.tp, target.tp_rank)
    return Plan(list(names), buffers, buckets(sizes, bucket_bytes), sizes, [list(s) for s in shapes], dtypes,
                device)


def receive(p: Plan, target: Any, comm: Any, stream: Any = None) -> int:
    """Receive every entry of ``p`` from rank 0, one NCCL group per bucket: into the parameters, the other TP
    workers' pieces into one throw-away buffer per group (never read: they may overwrite each other), scratch
    entries copied in by ``target.load_weights`` after their group. Returns the bytes received."""
    for start, end in p.groups:
        discard = [p.sizes[i] for i in range(start, end) if p.buffers[i] is DISCARD]
        trash = torch.empty(max(discard), dtype=torch.uint8, device=p.device) if discard else None
        bufs = []
        for i in range(start, end):
            buf = p.buffers[i]
            if buf is None:
                buf = torch.empty(p.shapes[i], dtype=p.dtypes[i], device=p.device)
            elif buf is DISCARD:
                buf = trash[: p.sizes[i]].view(p.dtypes[i]).view(p.shapes[i])  # type: ignore[index]
            bufs.append(buf)
        broadcast_group(comm, bufs, stream)
        pieces = [(p.names[i], buf) for i, buf in zip(range(start, end), bufs) if p.buffers[i] is None]
        if pieces:
            target.load_weights(pieces)
    return p.bytes


def send(pairs: Iterator[tuple[str, torch.Tensor]], sizes: list[int], comm: Any, bucket_bytes: int,
         stream: Any = None) -> int:
    """Broadcast ``pairs`` (``sizes``: the bytes the engines were told) from rank 0, one group per bucket. A
    bucket's tensors are taken before its group starts: taking one may run another collective (an FSDP2
    all-gather), which must not fall into the group. Returns the bytes sent."""
    sent = 0
    for start, end in buckets(sizes, bucket_bytes):
        tensors = []
        for i in range(start, end):
            _, tensor = next(pairs)
            tensor = tensor if tensor.is_contiguous() else tensor.contiguous()
            if tensor.numel() * tensor.element_size() != sizes[i]:
                raise ValueError(f"tensor {i} of the sync is {tensor.numel() * tensor.element_size()} bytes, "
                                 f"the engines expect {sizes[i]}")
            tensors.append(tensor)
        broadcast_group(comm, tensors, stream)
        sent += sum(sizes[start:end])
    for extra in pairs:  # the checked iterator raises where the source yields more than it declared
        raise ValueError(f"the weight source yielded {extra[0]!r} beyond the {len(sizes)} tensors declared")
    return sent


def pieces(plan: Any, pairs: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, torch.Tensor]]:
    """``KernelPlan.iterate(fuse=False)`` as the direct wire's entries: a fused parameter's parts (``FusedParts``)
    one after another (of an ``all_ranks`` plan: rank by rank already); a split parameter of an ``all_ranks`` plan
    (TP > 1 engines) as every rank's piece, rank after rank, each contiguous (pieces of columns are copied);
    others whole."""
    for name, tensor in pairs:
        dim = plan.shard.get(name)
        if isinstance(tensor, list):
            yield from ((name, part) for part in tensor)
        elif dim is None:
            yield name, tensor
        else:
            for piece in tensor.chunk(plan.tp, dim=dim):
                yield name, piece if piece.is_contiguous() else piece.contiguous()


def piece_shapes(plan: Any, wire: dict[str, list[int]]) -> list[tuple[str, list[int]]]:
    """The entries (name, shape) of ``pieces`` for ``plan`` (``wire``: the HF shapes as the stream yields them)."""
    out: list[tuple[str, list[int]]] = []
    for name, shape, srcs in plan.entries:
        dim = plan.shard.get(name)
        if len(srcs) > 1:  # the parts; split: rank 0's piece (rows) of each part, then rank 1's, ...
            n = plan.tp if dim is not None else 1
            for _ in range(n):
                out.extend((name, [wire[s][0] // n, *wire[s][1:]]) for s in srcs)
        elif dim is None:  # whole (a padded vocabulary: the HF shape the plan recorded)
            out.append((name, list(shape)))
        else:
            piece = list(shape)
            piece[dim] //= plan.tp
            out.extend((name, list(piece)) for _ in range(plan.tp))
    return out
