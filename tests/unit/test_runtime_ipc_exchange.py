"""The IPC handle exchange over gloo (``weight_sync.ipc_exchange``): two real trainer processes exchange handles
over a gloo group made beside their default group, and the override sits on vLLM's own IPC trainer engine class."""

from __future__ import annotations

from typing import Any

import torch.multiprocessing as mp

from rlhf_runtime.weight_sync import ipc_exchange
from tests.helpers import free_port


def _free_port() -> int:
    return free_port()


def _rank(rank: int, port: int, out: Any) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        group = dist.new_group(backend="gloo")  # as TrainerEngineSender makes it (ipc_exchange gloo)
        # two packed chunks: each rank's {GPU UUID: rebuild args} of its buffer, rank 0 the sender
        handles = [{f"GPU-{rank}": ("chunk", 0, rank)}, {f"GPU-{rank}": ("chunk", 1, rank)}]
        merged = ipc_exchange.exchange_handles(handles, group, is_sender=rank == 0)
        ipc_exchange.host_barrier(group)
        out.put((rank, merged))
    finally:
        dist.destroy_process_group()


def test_the_sending_rank_gets_every_ranks_handles_merged_per_chunk() -> None:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_rank, args=(r, port, out)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        got = dict(out.get(timeout=120) for _ in procs)
        for p in procs:
            p.join(timeout=60)
            assert p.exitcode == 0
    finally:  # a rank that failed leaves the other waiting in the rendezvous
        for p in procs:
            if p.is_alive():
                p.kill()
    assert got[0] == [{"GPU-0": ("chunk", 0, 0), "GPU-1": ("chunk", 0, 1)},
                      {"GPU-0": ("chunk", 1, 0), "GPU-1": ("chunk", 1, 1)}]
    assert got[1] == [{}, {}]  # the other rank sends nothing


def test_merge_keeps_positions_and_skips_missing_ranks() -> None:
    gathered = [[{"a": 1}, {"a": 2}], None, [{"b": 3}, {"b": 4}]]
    assert ipc_exchange.merge_handles(gathered, 2) == [{"a": 1, "b": 3}, {"a": 2, "b": 4}]
    assert ipc_exchange.merge_handles([], 1) == [{}]


def test_install_overrides_vllms_ipc_trainer_engine() -> None:
    import torch.distributed as dist
    from vllm.distributed.weight_transfer.ipc_engine import IPCTrainerWeightTransferEngine as Engine

    assert all(callable(getattr(Engine, name)) for name in ipc_exchange.REPLACED)  # vLLM still names them so
    engine = object.__new__(Engine)  # its __init__ needs a GPU; the methods replaced are what is checked here
    engine.is_sender = True
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
    try:
        group = dist.new_group(backend="gloo")
        ipc_exchange.install(engine, group)
        assert engine._all_gather_and_merge_handles([{"GPU-0": 1}, {"GPU-0": 2}]) == [{"GPU-0": 1}, {"GPU-0": 2}]
        engine._post_send_sync()  # a barrier of the one rank
        engine.is_sender = False  # a rank that does not send gets nothing to send
        assert engine._all_gather_and_merge_handles([{"GPU-0": 1}]) == [{}]
    finally:
        dist.destroy_process_group()
