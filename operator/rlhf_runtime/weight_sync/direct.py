"""The direct NCCL sync: the kernel format broadcast straight into the engine's parameters (``weightSync.packed:
false`` over NCCL in the kernel format).

vLLM's packed NCCL path copies every byte three times besides the wire: the trainer concatenates fused parameters
(``qkv_proj`` from q, k, v), packs the chunk into a buffer, and the engine copies the received buffer into its
parameters; its unpacked path broadcasts tensor by tensor, one NCCL launch each, into a fresh tensor the engine
then copies. Here the engine receives into its parameters themselves: each tensor the trainer sends is a
contiguous range of one engine parameter's memory (a whole parameter, a part of a fused one: vLLM fuses along dim
0, so q, k and v are consecutive row ranges; the rows of a padded vocabulary that the Hugging Face tensor has),
and a chunk's broadcasts go out as one NCCL group (``group_start`` / ``group_end``: one launch). The trainer sends
its tensors as they are (the parts of a fused parameter unfused: ``formats.KernelPlan.iterate(fuse=False)``), so
neither side copies.

Wire (both sides derive it from the update info and ``packed_buffer_size_bytes``, so they always agree): the
entries ``(name, dtype, shape)`` in order; entries naming the same parameter one after another fill it from its
start (``flat_plan``); the groups are the byte buckets of the entries (``buckets``). A worker of a
tensor-parallel engine receives what every worker receives (the pieces of all ranks side by side,
``KernelPlan.all_ranks``) into scratch tensors and copies its own piece after the group (``KernelTarget``), which
still saves vLLM's per-tensor launches.

Every check runs on the metadata before the first broadcast: a plan that does not fit the engine raises without
writing a parameter (the trainer's broadcast then ends by ``weightSync.timeoutSeconds``, as for any engine error).

Pure torch: ``send`` and ``receive`` take any communicator with ``broadcast(tensor, src, stream)``,
``group_start()`` and ``group_end()`` (vLLM's ``PyNcclCommunicator`` on GPUs; a gloo one in the CPU tests).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class Plan:
    """The engine side of one update info: per entry, the tensor to receive into, and the groups."""

    names: list[str]
    buffers: list[torch.Tensor | None]  # None: received into a scratch tensor made for its group (``receive``)
    groups: list[tuple[int, int]]
    bytes: int = 0
    shapes: list[list[int]] | None = None
    dtypes: list[torch.dtype] | None = None
    device: Any = None

    @property
    def scratch(self) -> list[bool]:
        """Per entry: received into a scratch tensor (a TP worker's piece is copied after the group)."""
        return [b is None for b in self.buffers]

    @property
    def direct(self) -> int:
        """Entries received straight into a parameter."""
        return sum(b is not None for b in self.buffers)


def entry_bytes(shapes: Iterable[Iterable[int]], dtypes: Iterable[torch.dtype]) -> list[int]:
    return [math.prod(shape) * dtype.itemsize for shape, dtype in zip(shapes, dtypes, strict=True)]


def buckets(sizes: list[int], bucket_bytes: int) -> list[tuple[int, int]]:
    """Split entries (by byte size, in order) into ``[start, end)`` index ranges of at most ``bucket_bytes`` each;
    an entry larger than a bucket gets a bucket of its own. (The gloo backend's packing uses it too.)"""
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
        if param.dtype != dtype:
            raise ValueError(f"kernel-format weight {name!r} is {dtype}; the engine's parameter is {param.dtype}")
        if not param.is_contiguous():
            raise ValueError(f"the engine's parameter {name!r} is not contiguous: it cannot be received into")
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


def plan(target: Any, names: list[str], dtype_names: list[str], shapes: list[list[int]],
         bucket_bytes: int, device: Any = None) -> Plan:
    """The engine side of an update info for ``target`` (a ``kernel.KernelTarget``): straight into the
    parameters at TP=1 (``flat_plan``), scratch tensors on a worker of a TP > 1 engine."""
    dtypes = [getattr(torch, d) for d in dtype_names]
    sizes = entry_bytes(shapes, dtypes)
    if target.tp == 1:
        buffers: list[torch.Tensor | None] = list(flat_plan(target.params, target.vocab, names, dtypes, shapes))
    else:  # scratch tensors, made per group: at most a bucket's bytes beside the engine at a time
        missing = next((name for name in names if name not in target.params), None)
        if missing is not None:
            raise not_a_parameter(missing)
        buffers = [None] * len(names)
    return Plan(list(names), buffers, buckets(sizes, bucket_bytes), sum(sizes), [list(s) for s in shapes], dtypes,
                device)


def receive(p: Plan, target: Any, comm: Any, stream: Any = None) -> int:
    """Receive every entry of ``p`` from rank 0, one NCCL group per bucket; scratch entries are copied into the
    parameters (``target.load_weights``) after their group. Returns the bytes received."""
    for start, end in p.groups:
        bufs = [p.buffers[i] if p.buffers[i] is not None else
                torch.empty(p.shapes[i], dtype=p.dtypes[i], device=p.device)  # type: ignore[index]
                for i in range(start, end)]
        broadcast_group(comm, bufs, stream)  # type: ignore[arg-type]
        pieces = [(p.names[i], buf) for i, buf in zip(range(start, end), bufs) if p.buffers[i] is None]
        if pieces:
            target.load_weights(pieces)
    return p.bytes


def send(pairs: Iterator[tuple[str, torch.Tensor]], sizes: list[int], comm: Any, bucket_bytes: int,
         stream: Any = None) -> int:
    """Broadcast the tensors of ``pairs`` (as many as ``sizes``, the entries' bytes the engines were told) from
    rank 0, one group per bucket of ``buckets(sizes, bucket_bytes)``. A bucket's tensors are taken from ``pairs``
    before its group starts: taking one may run other collectives (an FSDP2 all-gather), which must not fall into
    the group. Returns the bytes sent."""
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


def unfused(pairs: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, torch.Tensor]]:
    """``KernelPlan.iterate(fuse=False)`` as the direct wire's entries: a fused parameter's parts
    (``FusedParts``) one after another under its name."""
    for name, tensor in pairs:
        if isinstance(tensor, list):
            for part in tensor:
                yield name, part
        else:
            yield name, tensor


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
