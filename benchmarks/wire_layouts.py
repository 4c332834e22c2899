"""What the direct NCCL sync's wire layouts cost on the wire alone: the same bytes broadcast from GPU0 to GPUs
1..N-1 as one tensor (the floor) and as the entries of each layout of ``weight_sync.direct`` (one NCCL group per
bucket, vLLM's ``PyNcclCommunicator`` as the runtime's weight-sync group uses it), every entry a tensor of its own
on both sides (as the trainer's and the engine's parameters are), no Ray, no vLLM engine. It splits a sync's time
beyond the raw broadcast into what the number and size of the broadcasts cost (here) and what the runtime adds
around them (``gpu_sync.py``'s timeline).

Layouts (cut into groups by the runtime's ``direct.buckets``): ``whole`` (one tensor), ``parts`` (the direct
sync's wire: a fused parameter's parts one broadcast each), ``fused`` (one broadcast per engine parameter, what
fusing the parts on the trainer would give); each at ``--bucket-mib`` (default 1024, ``weightSync.bucketSizeMB``)
and the parts also at 256 MiB. All interleaved, the order rotated every round; per layout: the wall time from the first
launch to both sides' synchronize (median, min-max), the host time to launch the groups on each side, and the
receiver's GPU time from its first group's start to its last group's end (CUDA events).

    python3 benchmarks/wire_layouts.py --model qwen3-1.7b --rounds 20 --out $OUT/wire_layouts.json   # 2 GPUs
    python3 benchmarks/wire_layouts.py --cpu --model tiny --rounds 3 --bucket-mib 1   # the script's own smoke run

(``--cpu``: gloo between two CPU processes; its times say nothing about NCCL.)
"""

from __future__ import annotations

import argparse
import json
import math
import os
import socket
import sys
import time
from pathlib import Path
from statistics import median
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "operator"))


def wire_entries(arch: str, config: dict[str, Any], fused: bool) -> list[tuple[str, list[int]]]:
    """The direct sync's entries (name, shape) for a dense ``Qwen2`` / ``Qwen3`` ``config`` (``gpu_sync.MODELS``),
    in the order the trainer sends them into a TP=1 engine: the embedding, per layer q, k, v (or ``qkv_proj``
    fused; Qwen2: their biases likewise), o, Qwen3's q/k norms, gate, up (or ``gate_up_proj``), down, the two
    layer norms, then the final norm and an untied head. Pure."""
    if arch not in ("Qwen2", "Qwen3"):
        raise ValueError(f"wire_entries knows dense Qwen2 and Qwen3 layers, not {arch}")
    h, inter, vocab = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    heads, kv = config["num_attention_heads"], config["num_key_value_heads"]
    hd = config.get("head_dim", h // heads)
    out: list[tuple[str, list[int]]] = [("model.embed_tokens.weight", [vocab, h])]
    for i in range(config["num_hidden_layers"]):
        a, m = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
        out += [(a + "qkv_proj.weight", [(heads + 2 * kv) * hd, h])] if fused else \
            [(a + "qkv_proj.weight", [heads * hd, h]), (a + "qkv_proj.weight", [kv * hd, h]),
             (a + "qkv_proj.weight", [kv * hd, h])]
        if arch == "Qwen2":
            out += [(a + "qkv_proj.bias", [(heads + 2 * kv) * hd])] if fused else \
                [(a + "qkv_proj.bias", [heads * hd]), (a + "qkv_proj.bias", [kv * hd]), (a + "qkv_proj.bias", [kv * hd])]
        out.append((a + "o_proj.weight", [h, heads * hd]))
        if arch == "Qwen3":
            out += [(a + "q_norm.weight", [hd]), (a + "k_norm.weight", [hd])]
        out += [(m + "gate_up_proj.weight", [2 * inter, h])] if fused else \
            [(m + "gate_up_proj.weight", [inter, h]), (m + "gate_up_proj.weight", [inter, h])]
        out += [(m + "down_proj.weight", [h, inter]), (f"model.layers.{i}.input_layernorm.weight", [h]),
                (f"model.layers.{i}.post_attention_layernorm.weight", [h])]
    out.append(("model.norm.weight", [h]))
    if not config.get("tie_word_embeddings", False):
        out.append(("lm_head.weight", [vocab, h]))
    return out


def layouts(arch: str, config: dict[str, Any], itemsize: int, bucket_bytes: int) -> dict[str, list[list[int]]]:
    """Per layout, its groups as the byte sizes of the broadcasts in each, cut as ``direct.send`` cuts them
    (groups of ``bucket_bytes``; ``parts-256mib`` of 256 MiB). Pure."""
    from rlhf_runtime.weight_sync import direct

    out: dict[str, list[list[int]]] = {}
    total = sum(math.prod(s) for _, s in wire_entries(arch, config, False)) * itemsize
    out["whole"] = [[total]]
    for name, fused, bucket in (("parts", False, bucket_bytes), ("fused", True, bucket_bytes),
                                ("parts-256mib", False, 256 << 20)):
        sizes = [math.prod(s) * itemsize for _, s in wire_entries(arch, config, fused)]
        out[name] = [sizes[a:b] for a, b in direct.buckets(sizes, bucket)]
    for name, groups in out.items():
        assert sum(map(sum, groups)) == total, name  # every layout moves the same bytes
    return out


#: ``--model tiny``: a Qwen3 shape of a few MB, for the CPU smoke run (``--cpu``)
TINY = ("Qwen3", {"vocab_size": 512, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
                  "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "tie_word_embeddings": True})


class _Gloo:
    """``--cpu``: ``PyNcclCommunicator``'s calls over the default gloo group (a group's broadcasts started
    asynchronously and waited for at its end), so that the script's own logic runs without GPUs."""

    def __init__(self) -> None:
        self.works: list[Any] | None = None

    def broadcast(self, tensor: Any, src: int, stream: Any = None) -> None:
        import torch.distributed as dist

        work = dist.broadcast(tensor, src, async_op=True)
        if self.works is None:
            work.wait()
        else:
            self.works.append(work)

    def group_start(self) -> None:
        self.works = []

    def group_end(self) -> None:
        for work in self.works or []:
            work.wait()
        self.works = None

    def all_reduce(self, tensor: Any) -> None:
        import torch.distributed as dist

        dist.all_reduce(tensor)


def _rank(rank: int, world: int, port: int, plan: dict[str, list[list[int]]], rounds: int, q: Any,
          cpu: bool = False) -> None:
    import torch

    from rlhf_runtime.weight_sync import direct

    if cpu:
        import torch.distributed as dist

        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        comm: Any = _Gloo()
        device, stream = "cpu", None
    else:
        os.environ.update({"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                           "NVSHMEM_DISABLE_NVLS": "1"})
        torch.cuda.set_device(rank)
        from vllm.distributed.weight_transfer.nccl_common import stateless_init_process_group

        comm = stateless_init_process_group("127.0.0.1", port, rank, world, torch.device("cuda", rank))
        device, stream = "cuda", torch.cuda.current_stream()
    sync = torch.cuda.synchronize if not cpu else (lambda: None)
    tensors = {name: [[torch.empty(n, dtype=torch.uint8, device=device) for n in g] for g in groups]
               for name, groups in plan.items()}
    if rank == 0:
        for groups in tensors.values():
            for g in groups:
                for t in g:
                    t.random_(0, 255)
    names = list(plan)
    samples: dict[str, list[dict[str, float]]] = {n: [] for n in names}
    token = torch.zeros(1, device=device)
    for r in range(rounds + 2):  # two warm-up rounds
        for name in names[r % len(names):] + names[: r % len(names)]:
            comm.all_reduce(token)  # every rank here before either starts
            sync()
            ev = None if cpu else (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            t0 = time.perf_counter()
            if ev is not None:
                ev[0].record(stream)
            for g in tensors[name]:
                direct.broadcast_group(comm, g, stream)
            if ev is not None:
                ev[1].record(stream)
            launched = time.perf_counter()
            sync()
            t1 = time.perf_counter()
            if r >= 2:
                samples[name].append({"wall_s": t1 - t0, "launch_s": launched - t0,
                                      "gpu_s": ev[0].elapsed_time(ev[1]) / 1e3 if ev is not None else 0.0})
    q.put((rank, samples))


def main() -> int:
    import gpu_sync

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen3-1.7b",
                   choices=["qwen2-0.5b", "qwen3-0.6b", "qwen3-1.7b", "qwen3-8b", "tiny"])
    p.add_argument("--cpu", action="store_true", help="gloo between CPU processes: a smoke run of the script")
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--world", type=int, default=2, help="GPUs: GPU0 sends, the others receive")
    p.add_argument("--bucket-mib", type=int, default=1024)
    p.add_argument("--kind", default="", help="the device kind, recorded")
    p.add_argument("--out", default="wire_layouts.json")
    a = p.parse_args()
    plan = layouts(*(TINY if a.model == "tiny" else gpu_sync.MODELS[a.model]), 2, a.bucket_mib << 20)  # bfloat16
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, a.world, port, plan, a.rounds, q, a.cpu)) for r in range(a.world)]
    for proc in procs:
        proc.start()
    got = dict(q.get(timeout=600) for _ in procs)
    for proc in procs:
        proc.join(60)
    total = sum(plan["whole"][0])
    result: dict[str, Any] = {"command": " ".join(sys.argv), "kind": "cpu" if a.cpu else a.kind, "model": a.model,
                              "bytes": total,
                              "world": a.world, "rounds": a.rounds, "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                              "layouts": {}}
    floor = None
    for name, groups in plan.items():
        wall = [max(got[r][name][i]["wall_s"] for r in got) for i in range(a.rounds)]
        row = {"broadcasts": sum(map(len, groups)), "groups": len(groups),
               "wall_ms": [1e3 * median(wall), 1e3 * min(wall), 1e3 * max(wall)],
               "launch_ms": {str(r): 1e3 * median(x["launch_s"] for x in got[r][name]) for r in got},
               "receiver_gpu_ms": 1e3 * median(x["gpu_s"] for r in got if r > 0 for x in got[r][name])}
        if name == "whole":
            floor = row["wall_ms"][0]
        row["pct_of_whole"] = 100 * floor / row["wall_ms"][0] if floor else None
        result["layouts"][name] = row
        print(f"{name:13s} {row['broadcasts']:4d} broadcasts in {row['groups']} groups: "
              f"{row['wall_ms'][0]:.2f} ms ({row['wall_ms'][1]:.2f}-{row['wall_ms'][2]:.2f}), "
              f"{row['pct_of_whole']:.1f}% of whole; launch {row['launch_ms']}; receiver GPU "
              f"{row['receiver_gpu_ms']:.2f} ms", flush=True)
    Path(a.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
