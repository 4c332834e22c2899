"""The floor a weight sync is set beside, measured in the same run: a raw NCCL broadcast of the bytes the sync sends
from GPU0 to the engines' GPUs (``nccl_floor``), or a device-to-device copy on one GPU for IPC layouts
(``copy_floor``); ``sent_bytes`` (what the default sync sends) and ``floor_shares`` (each arm's bandwidth as a
share of the floor's). Used by ``gpu_sync.py``; torch is imported inside the functions."""

from __future__ import annotations

import os
import time
from typing import Any

from harness import SAFE_ENV, median


def _nccl_floor_rank(rank: int, port: int, nbytes: int, chunk: int, q: Any, world: int = 2) -> None:
    import torch
    import torch.distributed as dist

    os.environ.update(SAFE_ENV)
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            device_id=torch.device("cuda", rank))
    buf = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    if rank == 0:
        buf.random_(0, 255)

    def timed(fn: Any, n: int = 10) -> list[float]:
        out = []
        for i in range(n + 3):
            dist.barrier()
            torch.cuda.synchronize()
            t = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            if i >= 3:
                out.append(time.perf_counter() - t)
        return out

    whole = timed(lambda: dist.broadcast(buf, 0))
    chunked = timed(lambda: [dist.broadcast(buf[i:i + chunk], 0) for i in range(0, nbytes, chunk)])
    if rank == 0:
        q.put({"whole_s": whole, "chunked_s": chunked, "chunk_bytes": chunk})
    dist.barrier()
    dist.destroy_process_group()


def nccl_floor(nbytes: int, chunk: int, world: int = 2) -> dict[str, Any]:
    """A raw NCCL broadcast of ``nbytes`` from GPU0 to GPUs 1..world-1 (one process each), whole and in
    ``chunk`` pieces: the same GPUs and group size as the trainer -> engines sync."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_nccl_floor_rank, args=(r, port, nbytes, chunk, q, world)) for r in range(world)]
    for p in procs:
        p.start()
    res = q.get(timeout=180)
    for p in procs:
        p.join(60)
    w, c = median(res["whole_s"]), median(res["chunked_s"])
    return {"kind": f"nccl_broadcast_gpu0_to_gpu1-{world - 1}", "world": world, "bytes": nbytes, "whole_s": w, "whole_gbps": nbytes / w / 1e9,
            "chunked_s": c, "chunked_gbps": nbytes / c / 1e9, "chunk_bytes": chunk, "samples": res}


def sent_bytes(model: Any, itemsize: int = 2) -> int:
    """The bytes the default sync sends for ``model`` (bfloat16: ``itemsize`` 2), on which the floor is measured:
    the kernel format sends every parameter once, so a tied head (the embedding's alias, which
    ``named_parameters()`` drops) is not counted again; ``floor_shares`` flags an arm whose syncs sent other bytes
    than its floor moved."""
    return sum(p.numel() for _, p in model.named_parameters()) * itemsize


def floor_shares(result: dict[str, Any]) -> dict[str, dict[str, dict[str, Any]]]:
    """Each timed arm's bandwidth as a share of its run's floor (the raw broadcast, whole, or the device copy),
    beside the bytes each moved: ``same_bytes`` false means the share compares other bytes (by bandwidth only).
    Keyed like the results: ``summary`` (the default alone, sequential variants) and ``summary_interleaved``."""
    fl = result.get("floor") or {}
    floor_gbps = fl.get("whole_gbps", fl.get("copy_gbps"))
    if not floor_gbps:
        return {}
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for key in ("summary", "summary_interleaved"):
        arms = {name: {"share": v["gbps"] / floor_gbps, "bytes": v["bytes"], "floor_bytes": fl.get("bytes"),
                       "same_bytes": v["bytes"] == fl.get("bytes")}
                for name, v in (result.get(key) or {}).items() if v.get("gbps")}
        if arms:
            out[key] = arms
    return out


def copy_floor(nbytes: int) -> dict[str, Any]:
    """A device-to-device copy of ``nbytes`` on one GPU (what an IPC sync must at least do once)."""
    import torch

    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda").random_(0, 255)
    dst = torch.empty_like(src)
    ts = []
    for i in range(13):
        torch.cuda.synchronize()
        t = time.perf_counter()
        dst.copy_(src)
        torch.cuda.synchronize()
        if i >= 3:
            ts.append(time.perf_counter() - t)
    m = median(ts)
    return {"kind": "device_to_device_copy", "bytes": nbytes, "copy_s": m, "copy_gbps": nbytes / m / 1e9,
            "samples": ts}
