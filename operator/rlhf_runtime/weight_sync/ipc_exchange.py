"""Where the trainer ranks of an IPC sync exchange their buffers' handles: NCCL (vLLM's way) or gloo (the host).

vLLM's IPC trainer engine, with several trainer ranks (FSDP2 colocated with one engine worker per GPU), gathers
every rank's CUDA IPC handle of each packed chunk to the sending rank over the default process group (NCCL:
``all_gather_object``, whose sizes go through the GPU and back), then a barrier and a device sync, and after each
chunk another barrier (``_post_send_sync``): handles of a few hundred bytes travel through NCCL kernels on the
GPUs the engine workers share, between the FSDP2 gathers of the same sync.

``install`` moves the handles and both barriers to a gloo group of the same ranks (``options.EXPERIMENTAL``
``ipc_exchange: gloo``): host memory only, each exchange a rendezvous of the ranks' host threads; the data still
moves by CUDA IPC and the FSDP2 gathers stay on NCCL.
"""

from __future__ import annotations

from typing import Any

import torch

#: The trainer engine's methods ``install`` replaces (on the instance).
REPLACED = ("_all_gather_and_merge_handles", "_post_send_sync")


def merge_handles(gathered: list[list[dict[str, Any]] | None], count: int) -> list[dict[str, Any]]:
    """Per position (a tensor, or a packed chunk), every rank's ``{GPU UUID: args}`` merged into one dict: vLLM's
    handle format, from which each engine worker takes its GPU's. Pure."""
    merged: list[dict[str, Any]] = []
    for i in range(count):
        m: dict[str, Any] = {}
        for rank_handles in gathered:
            if rank_handles is not None:
                m.update(rank_handles[i])
        merged.append(m)
    return merged


def exchange_handles(handles: list[dict[str, Any]], group: Any, is_sender: bool) -> list[dict[str, Any]]:
    """Every rank's ``handles`` gathered over ``group`` (a collective of the trainer ranks) and merged on the
    sending rank; the others get empty dicts (they send nothing). Each rank first waits for its GPU (as vLLM's
    does): the unpacked path queues its copies without waiting, and the engines read them once the sender's
    call goes out, which the gather holds back until every rank is here."""
    import torch.distributed as dist

    if torch.cuda.is_available():
        torch.cuda.synchronize()
    gathered: list[list[dict[str, Any]] | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, handles, group=group)
    return merge_handles(gathered, len(handles)) if is_sender else [{} for _ in handles]


def host_barrier(group: Any) -> None:
    """After a chunk: every rank past it (the sender's engine call returned: the engines have read it) before any
    rank refills its buffer; then the IPC blocks the engines released are freed, as vLLM's own does."""
    import torch.distributed as dist

    dist.barrier(group=group)
    if torch.cuda.is_available():
        torch.cuda.ipc_collect()


def install(engine: Any, group: Any) -> None:
    """Make vLLM's IPC trainer ``engine`` exchange handles and meet at barriers over ``group`` (gloo)."""
    engine._all_gather_and_merge_handles = lambda handles: exchange_handles(handles, group, engine.is_sender)
    engine._post_send_sync = lambda: host_barrier(group)

