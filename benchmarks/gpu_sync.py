"""GPU weight-sync benchmark: the runtime's own components (``rlhf_runtime.controller.loop.Runtime``, its trainer and
engine actors, ``rlhf_runtime.weight_sync``) on real GPUs, one layout and model size per child process.

For each ``LAYOUT:MODEL`` (e.g. ``separate-nccl:qwen2-0.5b``) a child process

1. builds a random-init model from a real architecture config with ``save_pretrained`` (no hub) and a
   character-level tokenizer of the model's vocabulary size;
2. measures the floor for the bytes the default sync sends (``sent_bytes``: a tied head once): a raw NCCL
   broadcast GPU0 -> GPU1 (``torch.distributed``, two processes) for NCCL layouts, a device-to-device copy on one
   GPU for IPC layouts; ``floor_shares`` sets each arm's bandwidth beside the floor's and says whether it sent
   the same bytes;
3. starts the runtime exactly as the driver does (local Ray, placement groups, trainer and vLLM engine
   actors, ``init_sync``), syncs once (engines start with dummy weights) and runs the driver's validation
   (the synced engine's greedy tokens == a fresh engine loaded from the trainer's weights);
4. times ``--syncs`` steady-state syncs with the default sender settings (colocated: the engine sleeps first, as
   after a rollout, and the sync wakes it), with the engine-side ``load_weights`` time; then the default and the
   sender variants interleaved, ``--syncs`` rounds, each settings once per round (``interleaved_variants``;
   ``--sequential``: each variant's syncs one after another); for
   each settings one sync into scrambled weights, after which the greedy tokens must equal the validated ones;
5. times a rollout (tokens/s; after one warm-up rollout) and one GRPO training step followed by a sync.

Writes ``<out>/gpu_<layout>_<model>.json`` (device kind, date, exact command, every number) and prints a
table at the end. ``--cpu`` runs the same code on CPU (tiny model, gloo backend) as a smoke test.

    PYTHONPATH=/tmp/site:$PWD/operator python3 benchmarks/gpu_sync.py --kind nvidia-h200-x2 --out $OUT \\
        separate-nccl:qwen2-0.5b colocated-ipc:qwen2-0.5b separate-nccl:qwen3-1.7b colocated-ipc:qwen3-1.7b
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import traceback
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))

import harness
from harness import MODELS, SAFE_ENV, base_spec, build_model, median, merge  # noqa: F401 - shared builders
from stack_dumps import watch
from sync_floors import copy_floor, floor_shares, nccl_floor, sent_bytes

#: Spec overrides per layout (on top of ``base_spec``).
LAYOUTS: dict[str, dict[str, Any]] = {
    "separate-nccl": {"placement": {"mode": "separate"}, "weightSync": {"backend": "nccl"},
                      "rollout": {"gpuMemoryUtilization": 0.5}},
    "colocated-ipc": {"placement": {"mode": "colocated"}, "weightSync": {"backend": "ipc"},
                      "rollout": {"gpuMemoryUtilization": 0.3}},
    # weightSync.packed false: in the kernel format the direct sync (weight_sync.direct: each tensor broadcast
    # straight into the engine's parameter, one NCCL group per bucket). Packed unset means this for TP=1 engines,
    # so separate-nccl is the same sync and separate-nccl-packed (vLLM's packed path) the comparison
    "separate-nccl-unpacked": {"placement": {"mode": "separate"}, "weightSync": {"backend": "nccl", "packed": False},
                               "rollout": {"gpuMemoryUtilization": 0.5}},
    "separate-nccl-packed": {"placement": {"mode": "separate"}, "weightSync": {"backend": "nccl", "packed": True},
                             "rollout": {"gpuMemoryUtilization": 0.5}},
    "separate-nccl-omp16": {"placement": {"mode": "separate"}, "weightSync": {"backend": "nccl"},
                            "rollout": {"gpuMemoryUtilization": 0.5}, "_env": {"OMP_NUM_THREADS": "16"}},
    "colocated-ipc-resident": {"placement": {"mode": "colocated", "colocatedSleep": False},
                               "weightSync": {"backend": "ipc"}, "rollout": {"gpuMemoryUtilization": 0.3}},
    # the whole model in one IPC chunk (3 RPCs per sync instead of 2 + chunks; 4 GiB for a 1.7B in bf16)
    "colocated-ipc-resident-1chunk": {"placement": {"mode": "colocated", "colocatedSleep": False},
                                      "weightSync": {"backend": "ipc", "bucketSizeMB": 4096},
                                      "rollout": {"gpuMemoryUtilization": 0.3}},
    "colocated-ipc-fsdp2": {"placement": {"mode": "colocated"}, "weightSync": {"backend": "ipc"},
                            "trainer": {"replicas": 1, "gpusPerReplica": 2, "strategy": "fsdp2"},
                            "rollout": {"engines": 2, "gpuMemoryUtilization": 0.3}},
    # one TP=2 engine colocated with FSDP2x2 (issue 16's TP>1 kernel format: each trainer rank sends its GPU's shard)
    "colocated-ipc-fsdp2-tp2": {"placement": {"mode": "colocated"}, "weightSync": {"backend": "ipc"},
                                "trainer": {"replicas": 1, "gpusPerReplica": 2, "strategy": "fsdp2"},
                                "rollout": {"engines": 1, "tensorParallelSize": 2, "gpuMemoryUtilization": 0.3}},
    "separate-nccl-tp2": {"placement": {"mode": "separate"}, "weightSync": {"backend": "nccl"},
                          "rollout": {"tensorParallelSize": 2, "gpuMemoryUtilization": 0.5}},
    "separate-nccl-tp2-unpacked": {"placement": {"mode": "separate"}, "weightSync": {"backend": "nccl", "packed": False},
                                   "rollout": {"tensorParallelSize": 2, "gpuMemoryUtilization": 0.5}},
    "separate-nccl-dp2": {"placement": {"mode": "separate"}, "weightSync": {"backend": "nccl"},
                          "rollout": {"engines": 2, "gpuMemoryUtilization": 0.5}},
    "separate-nccl-dp3": {"placement": {"mode": "separate"}, "weightSync": {"backend": "nccl"},
                          "rollout": {"engines": 3, "gpuMemoryUtilization": 0.5}},
    # an FSDP2 trainer on GPUs 0-1 into two TP=1 engines (4 GPUs): packed unset stays packed from FSDP2 trainers
    # until the direct sync (variant direct-sync: FSDP2 gathers between its groups) is validated here
    "separate-nccl-fsdp2-dp2": {"placement": {"mode": "separate"}, "weightSync": {"backend": "nccl"},
                                "trainer": {"replicas": 1, "gpusPerReplica": 2, "strategy": "fsdp2"},
                                "rollout": {"engines": 2, "gpuMemoryUtilization": 0.5}},
    "colocated-ipc-fsdp2-ep2": {"placement": {"mode": "colocated"}, "weightSync": {"backend": "ipc"},
                                "trainer": {"replicas": 1, "gpusPerReplica": 2, "strategy": "fsdp2"},
                                "rollout": {"engines": 2, "expertParallel": True, "gpuMemoryUtilization": 0.3}},
    # the 30B-A3B step with the trainer's memory options: its forward without them (16k-token micro-batches, every
    # layer's activations kept) does not fit an H200's memory
    "colocated-ipc-fsdp4-ep4": {"placement": {"mode": "colocated"}, "weightSync": {"backend": "ipc"},
                                "trainer": {"replicas": 1, "gpusPerReplica": 4, "strategy": "fsdp2",
                                            "gradientCheckpointing": True, "maxTokensPerMicroBatch": 4096},
                                "rollout": {"engines": 4, "expertParallel": True, "gpuMemoryUtilization": 0.3}},
    "separate-nccl-async": {"placement": {"mode": "separate"}, "weightSync": {"backend": "nccl", "mode": "async"},
                            "rollout": {"gpuMemoryUtilization": 0.5}},
    "cpu-gloo": {"placement": {"mode": "separate"}, "trainer": {"replicas": 1, "gpusPerReplica": 0},
                 "rollout": {"gpuMemoryUtilization": 0.05}},
    "cpu-gloo-dp2": {"placement": {"mode": "separate"}, "trainer": {"replicas": 1, "gpusPerReplica": 0},
                     "rollout": {"engines": 2, "gpuMemoryUtilization": 0.05}},
}

#: Sync variants timed beside the default (the job's own options). Each names what it changes: fields of the spec's
#: ``weightSync`` (``SPEC_FIELDS``) and options of ``weight_sync.options.EXPERIMENTAL``; the driver resolves them
#: (``WeightSync.resolve``) and every switch of variant re-creates the weight-sync group with them
#: (``WeightSync.init_group``, as after an engine was replaced), its first sync untimed. Variants run on CPU too
#: (the ``gloo`` ones).
VARIANTS: dict[str, list[tuple[str, dict[str, Any]]]] = {
    "nccl": [
        ("checkpoint-format", {"format": "checkpoint"}),
        ("kernel-format-one-rpc", {"format": "auto", "rpc": "one"}),  # one update_weights_round call per engine
        # the runtime's kernel-format worker engines wherever the plan applies (a plan that does not fails)
        ("kernel-format-forced", {"format": "kernel"}),
        # vLLM's packed path, and the direct sync (weight_sync.direct), alternating turn by turn in one run
        ("packed-sync", {"packed": True}),
        ("direct-sync", {"packed": False}),
        # the direct sync's wire into TP=1 engines (weight_sync.wire): a fused parameter as one broadcast, the
        # small entries (norms) in packs, and both
        ("direct-fused", {"packed": False, "direct_fuse": True}),
        ("direct-packs", {"packed": False, "direct_packs": True}),
        ("direct-fused-packs", {"packed": False, "direct_fuse": True, "direct_packs": True}),
        # the direct sync in groups of 256 MiB instead of weightSync.bucketSizeMB's 1,024 (the engines cut the
        # groups from it too): the wire starts after a quarter of the first group's launches
        ("direct-256mb", {"packed": False, "bucket_size_mb": 256}),
    ],
    "ipc": [
        ("checkpoint-format", {"format": "checkpoint"}),
        ("kernel-format-forced", {"format": "kernel"}),
        # several trainer ranks: the IPC handles and barriers over a gloo group, not NCCL (weight_sync.ipc_exchange)
        ("kernel-format-handles-over-gloo", {"format": "auto", "ipc_exchange": "gloo"}),
    ],
    # CPU (checkpoint format only): the engine calls per sync (one by default), and the gloo backend tensor by
    # tensor
    "gloo": [
        ("three-rpc", {"rpc": "three"}),
        ("one-rpc", {"rpc": "one"}),
        ("pipelined-rpc", {"rpc": "pipelined"}),
        ("unpacked", {"packed": False}),
    ],
}

#: Variant keys that are fields of the spec's ``weightSync`` (its Python names); the others are ``EXPERIMENTAL``.
SPEC_FIELDS = ("format", "packed", "bucket_size_mb")

#: Environment recorded with every result (the device's README asks for these on every command).
ENV_RECORDED = ("PYTHONPATH", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "VLLM_USE_FLASHINFER_SAMPLER",
                "VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_NO_USAGE_STATS", "NCCL_NVLS_ENABLE",
                "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS", "VLLM_BATCH_INVARIANT")

def layout_parts(layout: str) -> tuple[dict[str, Any], dict[str, str]]:
    """A layout's spec overrides and the extra environment of the runtime's actors (its ``_env`` key)."""
    over = dict(LAYOUTS[layout])
    return over, over.pop("_env", {})


# The three FSDP2x2 layouts with the kernel format as the job's own (``weightSync.format: kernel``), so the first
# sync's validation checks it (no variant, no revalidation engine: one engine start less per layout). The TP=2
# engine without FlashInfer's allreduce (VLLM_ALLREDUCE_USE_FLASHINFER=0): on 0.33 each fresh TP>1 engine
# otherwise JIT-builds that module (~60 s); the sync does not use it.
# The same for NCCL into one TP=2 engine (the kernel format's pieces of both ranks in one broadcast).
for _base, _env in (("colocated-ipc", None), ("colocated-ipc-resident", None), ("colocated-ipc-fsdp2", None), ("colocated-ipc-fsdp2-tp2", {"VLLM_ALLREDUCE_USE_FLASHINFER": "0"}),
                    ("colocated-ipc-fsdp2-ep2", None), ("separate-nccl-tp2", {"VLLM_ALLREDUCE_USE_FLASHINFER": "0"})):
    LAYOUTS[f"{_base}-kernel"] = merge(LAYOUTS[_base], {"weightSync": {"format": "kernel"}}
                                       | ({"_env": _env} if _env else {}))


#: Trainer settings a model's GRPO step needs beside the layout's: Qwen3-8B in FSDP2x2 colocated with its engines
#: does not fit an H200's memory in its forward without checkpointing (16k-token micro-batches); train_step.py fits
#: its 16k-token sequences with checkpointing.
MODEL_TRAINER: dict[str, dict[str, Any]] = {"qwen3-8b": {"gradientCheckpointing": True}}


# ------------------------------------------------------------------------------------------------ runtime
def greedy(rt: Any, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    import ray

    sp = {"n": 1, "temperature": 0.0, "max_tokens": max_tokens}
    # a cold prefix cache every time: a cached prefix takes another prefill path (not bitwise equal)
    ray.get([e.reset_prefix_cache.remote() for e in rt.actors.engines])
    outs = ray.get([e.generate.remote(prompts, sp) for e in rt.actors.engines])
    return [[o["samples"][0] for o in out] for out in outs]


def timeline_summary(t0: float, t1: float, trainer: list[dict[str, Any]], workers: list[list[dict[str, Any]]]
                     ) -> dict[str, Any] | None:
    """One direct NCCL sync's timeline (``bench_actors.DirectTimeline`` records of trainer rank 0 and of every
    engine worker) in ms from the driver's call (``t0``; ``t1``: it returned), or None where the sync did not take
    the direct path. ``engine_join_ms``: the last worker's receive start after the trainer's first group launch
    (the broadcast cannot finish before); ``wire_ms``: the slowest worker's GPU time from its first group's start
    to its last group's end (from when it joined: the bytes' own time, to set beside the raw broadcast);
    ``tail_ms``: from the last launch on either side to the driver's return (the wire, the engine's reply, the
    finish call, the trainer's reply)."""
    sends = [r for r in trainer if r["what"] == "send"]
    if not sends:
        return None

    def ms(t: float) -> float:
        return round((t - t0) * 1e3, 3)

    def side(records: list[dict[str, Any]], call: str) -> dict[str, Any]:
        calls = [r for r in records if r["what"] == call]
        groups = [r for r in records if r["what"] == "group"]
        return {"call": [ms(calls[0]["start"]), ms(calls[-1]["end"])] if calls else None,
                "launches": [[ms(g["start"]), ms(g["end"])] for g in groups],
                "group_gpu_ms": [round(g["gpu_ms"], 3) for g in groups if "gpu_ms" in g],
                "group_bytes": [g["bytes"] for g in groups], "group_tensors": [g["tensors"] for g in groups],
                "gpu_span_ms": round(groups[-1]["gpu_from_first_ms"], 3) if groups and "gpu_from_first_ms"
                in groups[-1] else None}

    # ``sends`` > 1: syncs outside timed_sync (the first one, the validation's) since the last drain, run together
    out: dict[str, Any] = {"trainer": side(trainer, "send"), "workers": [side(w, "receive") for w in workers],
                           "driver_ms": ms(t1), "sends": len(sends)}
    tr = out["trainer"]
    first_launch = tr["launches"][0][0] if tr["launches"] else tr["call"][0]
    joins = [w["call"][0] for w in out["workers"] if w["call"]]
    spans = [w["gpu_span_ms"] for w in out["workers"] if w["gpu_span_ms"] is not None]
    last_launch = max([tr["launches"][-1][1]] + [w["launches"][-1][1] for w in out["workers"] if w["launches"]]) \
        if tr["launches"] else tr["call"][1]
    out.update(trainer_start_ms=tr["call"][0], first_launch_ms=first_launch,
               engine_join_ms=round(max(joins) - first_launch, 3) if joins else None,
               wire_ms=max(spans) if spans else None, tail_ms=round(out["driver_ms"] - last_launch, 3))
    return out


def timed_sync(rt: Any) -> dict[str, Any]:
    """One steady-state sync as the driver does it; colocated engines sleep first (as after a rollout). A direct
    NCCL sync also gets its ``timeline`` (``timeline_summary``)."""
    import bench_actors
    import ray

    sleep_s = 0.0
    if rt.sleeps:
        sleep_s = rt.weights.sleep(next_syncs=True)  # the driver's choice when a sync follows
    t0 = time.time()
    r = rt.weights.sync(0)
    t1 = time.time()
    trainer_tl = ray.get(rt.actors.trainers[0].direct_timeline.remote())
    workers_tl = [w for ws in ray.get([e.direct_timeline.remote() for e in rt.actors.engines]) for w in ws]
    timeline = timeline_summary(t0, t1, trainer_tl, workers_tl)
    if timeline is not None:
        r["timeline"] = timeline
    loads = ray.get([e.load_stats.remote(True) for e in rt.actors.engines])
    r["engine_load_s"] = max(w["load_s"] for ws in loads for w in ws)
    r["engine_load_calls"] = max(w["calls"] for ws in loads for w in ws)
    for k in ("start", "receive", "finish"):  # the worker transfer engine's own steps (bench_actors.TIMED)
        r[f"engine_{k}_s"] = max(w.get(f"{k}_s", 0.0) for ws in loads for w in ws)
    r["engine_receive_calls"] = max(w.get("receive_calls", 0) for ws in loads for w in ws)
    sent = ray.get(rt.actors.trainers[0].send_stats.remote(True))  # IPC: vLLM's trainer engine's own steps
    for k in bench_actors.IPC_TRAINER_TIMED:
        r[f"trainer_{k}_s"], r[f"trainer_{k}_calls"] = sent[f"{k}_s"], sent[f"{k}_calls"]
    r["sleep_s"] = sleep_s
    return r


def summarize(syncs: list[dict[str, Any]]) -> dict[str, Any]:
    keys = ["total_s", "pause_s", "start_s", "transfer_s", "gather_s",
            "engine_load_s", "engine_start_s", "engine_receive_s", "engine_finish_s", "trainer_pack_s",
            "trainer_post_s", "finish_s", "resume_s", "engine_call_s",
            "send_s", "sleep_s"]
    out = {f"median_{k}": median([s.get(k, 0.0) for s in syncs]) for k in keys}
    out["bytes"] = syncs[0]["bytes"] if syncs else 0
    out["gbps"] = out["bytes"] / out["median_total_s"] / 1e9 if out["median_total_s"] else 0.0
    out["format"] = syncs[0].get("format", "checkpoint") if syncs else None
    out["ipc"] = syncs[0].get("ipc") if syncs else None  # IPC: resident or vllm
    # the last sync's engine calls and waits for the engines (rpc), trainer rank 0's FSDP2 gathers (tensors, and
    # the all-gathers that moved them), tensors sent as its own shard and parameters left out (senders.agreed_gathers)
    for k in ("engine_calls", "engine_waits", "gathers", "gather_collectives", "local_shards", "skipped"):
        if syncs and k in syncs[-1]:
            out[k] = syncs[-1][k]
    timelines = [s["timeline"] for s in syncs if s.get("timeline")]
    if timelines:  # the direct NCCL sync: where its time went (timeline_summary), medians over the syncs
        out["timeline_medians_ms"] = {k: median([t[k] for t in timelines if t.get(k) is not None] or [0.0])
                                      for k in ("trainer_start_ms", "first_launch_ms", "engine_join_ms", "wire_ms",
                                                "tail_ms", "driver_ms")}
    return out


OUT_FILE: Path | None = None


def save(result: dict[str, Any]) -> None:
    """Write the result so far (a run killed at its time limit still leaves what it measured)."""
    if OUT_FILE is not None:
        harness.write_result(OUT_FILE, result)


def sender_arms(args: argparse.Namespace, backend: str, spec: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """The sync options compared: the default (the layout's own ``weightSync``) first, then the ``VARIANTS`` of the
    backend that ``--variants`` selects (all by default), each as full settings."""
    chosen = [(n, o) for n, o in VARIANTS.get(backend, []) if not args.variants or n in args.variants.split(",")]
    from rlhf_api.models import WeightSync

    own = WeightSync.model_validate(spec["weightSync"])
    default = {k: getattr(own, k) for k in SPEC_FIELDS}
    return [("default", default)] + [(n, {**default, **o}) for n, o in chosen]


def sync_options(rt: Any, arm: dict[str, Any]) -> Any:
    """The driver's sync options for ``arm`` (``SPEC_FIELDS`` over the job's ``weightSync``, the rest
    ``EXPERIMENTAL``), resolved as the driver resolves its own (``WeightSync.resolve``)."""
    ws = rt.cfg.spec.weight_sync.model_copy(update={k: arm[k] for k in SPEC_FIELDS if k in arm})
    return rt.weights.resolve(ws, {k: v for k, v in arm.items() if k not in SPEC_FIELDS})


def _configure(rt: Any, arm: dict[str, Any]) -> dict[str, Any]:
    """Sync with ``arm`` from now on: where its options differ from the group's, the weight-sync group is
    re-created with them (``WeightSync.init_group``: every trainer rank's sender anew, every engine's group anew).
    Returns what trainer rank 0's sender uses and ``regrouped`` (a new group's first sync makes three engine
    calls, ``EngineFanOut``)."""
    options = sync_options(rt, arm)
    regrouped = options != rt.weights.options
    if regrouped:
        rt.weights.init_group(options)
    return {**rt.weights.in_use, "regrouped": regrouped}


def restores_weights(rt: Any, check: tuple[list[Any], int, list[list[int]]]) -> bool:
    """One sync into engines whose weights were scrambled, with the settings configured now: whether the greedy
    tokens after it equal the validated ones (``check``: prompts, max tokens, those tokens)."""
    import ray

    prompts, max_new, reference = check
    ray.get([e.scramble_weights.remote(1234) for e in rt.actors.engines])
    ray.get([e.load_stats.remote(True) for e in rt.actors.engines])
    timed_sync(rt)
    rt.weights.wake()
    return greedy(rt, prompts, max_new) == reference


def sequential_variants(rt: Any, variants: list[tuple[str, dict[str, Any]]], syncs: int,
                        check: tuple[list[Any], int, list[list[int]]], result: dict[str, Any], tag: str) -> None:
    """``--sequential``: each variant after the default's syncs,
    its ``syncs`` syncs one after another, the first into scrambled weights; then its greedy tokens checked."""
    import ray

    prompts, max_new, reference = check
    for name, options in variants:
        try:
            applied = _configure(rt, options)
            ray.get([e.scramble_weights.remote(1234) for e in rt.actors.engines])
            ray.get([e.load_stats.remote(True) for e in rt.actors.engines])
            timed = [timed_sync(rt) for _ in range(syncs)]
            rt.weights.wake()
            result["syncs"][name] = timed
            result["summary"][name] = {**summarize(timed), "options": applied,
                                       "greedy_equals_validated": greedy(rt, prompts, max_new) == reference}
            print(f"[{tag}] {name} {result['summary'][name]}", flush=True)
            save(result)
        except Exception as e:  # noqa: BLE001 - a variant failing must not hide the others
            result["summary"][name] = {"error": f"{type(e).__name__}: {e}"[:2000]}
            print(f"[{tag}] {name} FAILED {traceback.format_exc()}", flush=True)
            break  # the engine may be mid-update: later variants would only hang


def interleaved_variants(rt: Any, arms: list[tuple[str, dict[str, Any]]], rounds: int,
                         check: tuple[list[Any], int, list[list[int]]], result: dict[str, Any], tag: str) -> None:
    """The default (already timed alone, ``syncs.default``) and the variants, interleaved: ``rounds`` rounds, each
    settings once per round in an order rotated by one each round; per turn configure it, one settling sync
    (untimed: a switch's first sync may build a plan) and one timed sync. Then per settings one sync into
    scrambled weights and the greedy check. Results: ``syncs_interleaved`` / ``summary_interleaved`` (per
    settings, ``rounds`` syncs), ``interleaved_order``; a failing turn ends the rounds (the engine may be
    mid-update), keeping what was timed."""
    timed: dict[str, list[dict[str, Any]]] = {n: [] for n, _ in arms}
    applied: dict[str, dict[str, Any]] = {}
    summary: dict[str, dict[str, Any]] = result.setdefault("summary_interleaved", {})
    result["interleaved_order"] = []
    try:
        for r in range(rounds):
            for name, options in arms[r % len(arms):] + arms[: r % len(arms)]:
                applied[name] = _configure(rt, options)
                timed_sync(rt)  # settling
                timed[name].append(timed_sync(rt))
                result["interleaved_order"].append(name)
        for name, options in arms:
            _configure(rt, options)
            summary[name] = {**summarize(timed[name]), "options": applied[name],
                             "greedy_equals_validated": restores_weights(rt, check)}
    except Exception as e:  # noqa: BLE001 - keep what was timed
        result["interleaved_error"] = f"{type(e).__name__}: {e}"[:2000]
        print(f"[{tag}] interleaved FAILED {traceback.format_exc()}", flush=True)
    result["syncs_interleaved"] = timed
    for name, v in summary.items():
        print(f"[{tag}] interleaved {name} {v}", flush=True)
    save(result)


def job_spec(layout: str, model_name: str, model_path: Path, args: argparse.Namespace) -> dict[str, Any]:
    """The job's spec: ``base_spec`` of the built model, the layout's overrides, the model's trainer settings, the
    command's prompts and tokens; the layout's environment, ``SAFE_ENV`` (and batch-invariant kernels for the
    async layout) in ``spec.env``, which every actor gets."""
    gpu = not args.cpu
    over, actor_env = layout_parts(layout)
    spec = merge(base_spec(str(model_path), gpu), over)
    if model_name in MODEL_TRAINER and gpu:
        spec = merge(spec, {"trainer": MODEL_TRAINER[model_name]})
    if args.prompts:
        spec = merge(spec, {"algorithm": {"promptsPerStep": args.prompts}})
    if args.max_tokens:  # longer samples (the context grows with them: the prompts are short)
        spec = merge(spec, {"rollout": {"maxModelLen": max(spec["rollout"]["maxModelLen"], args.max_tokens + 128),
                                        "sampling": {"maxTokens": args.max_tokens}}})
    env = {**SAFE_ENV, **actor_env, **({"VLLM_BATCH_INVARIANT": "1"} if layout.endswith("async") else {})}
    return harness.with_env(spec, env)


def start(rt: Any, args: argparse.Namespace, result: dict[str, Any], tag: str) -> None:
    """The runtime's start (``Runtime.run_stages``), as the driver runs it: through the trainers' weight-transfer
    modules, then (``--sender-options``) the group with the command's options, the engine- and trainer-side
    timers, the first sync and the first sync's validation (``--skip-validation``: none). Each stage's seconds in
    ``result["stages"]``; the first sync and the validation in the result."""
    import ray

    from rlhf_runtime.controller.validation import ValidationError

    try:
        rt.run_stages(until="transfer")
        first = json.loads(args.sender_options) if args.sender_options else None  # the variants reset them
        if first:
            rt.weights.init_group(sync_options(rt, first))
        # the engine-side timers (bench_actors.TIMED; --engine-device-sync: each waits for the GPU too), the trainer
        # side's (bench_actors.IPC_TRAINER_TIMED) and the direct NCCL sync's timeline (bench_actors.DirectTimeline)
        ray.get([e.load_stats.remote(True, args.engine_device_sync) for e in rt.actors.engines])
        ray.get(rt.actors.trainers[0].send_stats.remote(True))
        ray.get([rt.actors.trainers[0].direct_timeline.remote()]
                + [e.direct_timeline.remote() for e in rt.actors.engines])
        rt.run_stages(until="weight_sync")
        result["sync_options"], result["first_sync"] = rt.weights.in_use, rt.weights.last
        print(f"[{tag}] first sync {result['first_sync']}", flush=True)
        save(result)
        try:
            rt.run_stages()
            result["validation"] = ({"validated": None, "skipped": True} if rt.validation is None else
                                    {k: rt.validation[k] for k in ("validated", "prompts", "engines", "mismatched",
                                                                   "mismatched_by_engine")})
        except ValidationError as e:
            result["validation"] = {"validated": False, "error": str(e)}
    finally:
        result["stages"] = dict(rt.startup.seconds)
    print(f"[{tag}] validation {result['validation']}", flush=True)
    save(result)


def steady_syncs(rt: Any, args: argparse.Namespace, result: dict[str, Any], tag: str,
                 check: tuple[list[Any], int, list[list[int]]]) -> None:
    """``--syncs`` syncs with the job's own options after a warm-up one; then the variants (``--variants``,
    interleaved or ``--sequential``) and ``--revalidate``; back on the job's options at the end."""
    import ray

    prompts, max_new, reference = check
    time.sleep(2)  # let the killed validation engine go
    timed_sync(rt)
    ray.get([e.load_stats.remote(True) for e in rt.actors.engines])
    result["syncs"] = {"default": [timed_sync(rt) for _ in range(args.syncs)]}
    result["summary"] = {"default": {**summarize(result["syncs"]["default"]),
                                     "greedy_equals_validated": greedy(rt, prompts, max_new) == reference}}
    print(f"[{tag}] default {result['summary']['default']}", flush=True)
    save(result)
    result["variant_checks"] = {}
    if args.no_variants:
        return
    arms = sender_arms(args, rt.weights.backend, result["spec"])
    if args.sequential:
        sequential_variants(rt, arms[1:], args.syncs, check, result, tag)
    elif len(arms) > 1:
        interleaved_variants(rt, arms, args.syncs, check, result, tag)
    if args.revalidate:
        revalidate_fastest(rt, arms, result, tag)
    # back on the sender's defaults (the job's format) for the training step's sync; a re-created group (a packed
    # variant last) first makes its three-call sync, so the one after training is as the job's
    if _configure(rt, arms[0][1])["regrouped"]:
        timed_sync(rt)


def revalidate_fastest(rt: Any, arms: list[tuple[str, dict[str, Any]]], result: dict[str, Any], tag: str) -> None:
    """``--revalidate``: the fastest variant whose greedy tokens matched, synced into scrambled weights, under the
    driver's fresh-engine validation again."""
    import ray

    from rlhf_runtime.controller.validation import ValidationError

    pool = result.get("summary_interleaved") or result["summary"]
    fastest = min((n for n, v in pool.items() if v.get("greedy_equals_validated")),
                  key=lambda n: pool[n]["median_total_s"], default=None)
    options = dict(arms[1:]).get(fastest) if fastest else None  # full settings (sender_arms)
    if not options:
        return
    _configure(rt, options)
    ray.get([e.scramble_weights.remote(99) for e in rt.actors.engines])
    sync = timed_sync(rt)
    t = time.perf_counter()
    try:
        v = rt.validator.validate(rt.job.tokenizer, rt.job.samples)
        check = {k: v[k] for k in ("validated", "prompts", "engines", "mismatched")}
    except ValidationError as e:
        check = {"validated": False, "error": str(e)}
    result["validation_fastest"] = {"variant": fastest, "options": options, "sync": sync, **check,
                                    "seconds": time.perf_counter() - t}
    print(f"[{tag}] validation of {fastest}: {check}", flush=True)
    save(result)


def rollouts(rt: Any, args: argparse.Namespace, result: dict[str, Any], tag: str, model_path: Path) -> Any:
    """A warm-up rollout, then ``--rollouts`` timed ones of the same batch, as the driver launches them (tokens/s);
    the DP scaling pass on layouts of several independent engines. Returns the last rollout and its outputs."""
    from rlhf_runtime.algo.data import render_prompt, step_batch

    rt.weights.wake()
    job, spec = rt.job, rt.cfg.spec
    runs = []
    for i in range(1 + args.rollouts):  # a warm-up on batch 0, then the same batch 1 every time
        batch = step_batch(job.samples, min(i, 1), spec.algorithm.prompts_per_step, 0)
        ro = rt.experience.launch(job.tokenizer, batch, job.sampling, 0)
        outs = rt.experience.collect(ro)
        dt = time.perf_counter() - ro.t_launch
        tokens = sum(len(c) for o in outs for c in o["samples"])
        runs.append({"seconds": dt, "tokens": tokens, "samples": sum(len(o["samples"]) for o in outs),
                     "tokens_per_second": tokens / dt})
    BARE_INPUTS.update(prompts=[render_prompt(x, job.tokenizer) for x in ro.batch], sampling=job.sampling,
                       kwargs=dict(rt.actors.engine_kwargs[0], model=str(model_path), load_format="auto"),
                       env=dict(rt.actors.env), engine_gpu=0 if spec.placement.mode == "colocated" else 1,
                       engines=len(rt.actors.engines), runs=args.rollouts)
    result["rollout"] = {"runs": runs, "tokens_per_second": median([r["tokens_per_second"] for r in runs[1:]]),
                         "sampling": job.sampling, "prompts": spec.algorithm.prompts_per_step,
                         "enforce_eager": spec.rollout.enforce_eager, "engines": len(rt.actors.engines)}
    print(f"[{tag}] rollout {result['rollout']['tokens_per_second']:.0f} tokens/s", flush=True)
    save(result)
    if len(rt.actors.engines) > 1 and not rt.layout.dp_group:
        def keep(records: list[dict[str, Any]]) -> None:  # saved after every rollout: a cut run keeps them
            result["rollout"]["scaling"] = records
            result["rollout"]["scaling_summary"] = scaling_summary(records)
            save(result)

        dp_scaling(rt, job.samples, job.tokenizer, job.sampling, args.scaling_rounds, f"[{tag}]", keep,
                   args.scaling_per_engine)
    return ro, outs


def train_and_sync(rt: Any, ro: Any, outs: Any, result: dict[str, Any], tag: str,
                   check: tuple[list[Any], int, list[list[int]]]) -> None:
    """One GRPO step on the last rollout (every trainer rank on its share), then the sync the driver would do; the
    greedy tokens must have changed."""
    import ray

    prompts, max_new, reference = check
    if rt.sleeps:
        rt.weights.sleep(next_syncs=True)
    trainers = rt.actors.trainers
    w = len(trainers)
    pr = [ro.prompt_ids[i] for i, o in enumerate(outs) for _ in o["samples"]]
    comps = [c for o in outs for c in o["samples"]]
    adv = [((i % 8) - 3.5) / 2.3 for i in range(len(comps))]
    before = ray.get([tr.memory.remote() for tr in trainers])  # resets the peaks: the step's own next
    t = time.perf_counter()
    stats = ray.get([tr.train.remote({"prompts": pr[r::w], "completions": comps[r::w], "advantages": adv[r::w]})
                     for r, tr in enumerate(trainers)])[0]
    result["train"] = {"seconds": time.perf_counter() - t, "stats": stats, "memory_before": before,
                       "memory": ray.get([tr.memory.remote() for tr in trainers])}
    result["sync_after_train"] = rt.weights.sync(1)
    result["sync_after_train"]["greedy_changed"] = greedy(rt, prompts, max_new) != reference
    print(f"[{tag}] train {result['train']['seconds']:.2f}s, sync after train "
          f"{result['sync_after_train']['total_s'] * 1e3:.1f} ms", flush=True)


def run_one(layout: str, model_name: str, args: argparse.Namespace, result: dict[str, Any]) -> None:
    """One layout and model: the model (built, or found under ``--work``), the runtime started as the driver starts
    it (``start``), the steady syncs and variants, rollouts, a training step and its sync."""
    import bench_actors

    from rlhf_api.models import RuntimeConfig
    from rlhf_runtime.algo.data import render_prompt
    from rlhf_runtime.controller.loop import Runtime
    from rlhf_runtime.infra.report import Metrics, Reporter

    tag, gpu = f"{layout}:{model_name}", not args.cpu
    work = Path(args.work) / f"{layout}_{model_name}"
    work.mkdir(parents=True, exist_ok=True)
    model_path = harness.model_dir(model_name, gpu, Path(args.work) / "models")
    result["model"] = harness.cached_model(model_path, model_name, gpu)
    print(f"[{tag}] model {result['model']['params'] / 1e9:.3f}B params "
          f"{'reused' if result['model'].get('reused') else 'built'}", flush=True)
    if args.build_only:  # the model alone, for a later call on the same machine
        return
    result["spec"] = job_spec(layout, model_name, model_path, args)
    cfg = RuntimeConfig(name=f"bench-{layout}", namespace="bench", spec=result["spec"])
    reporter = Reporter(None, Metrics(cfg.name, cfg.namespace), str(work / "progress.jsonl"))
    # engines with scramble_weights/load_stats, trainers with timelines (the runtime's extension point)
    rt = Runtime(cfg, reporter, local=True, validate=not args.skip_validation,
                 classes=bench_actors.classes(cfg.spec))
    try:
        start(rt, args, result, tag)
        prompts = [render_prompt(s, rt.job.tokenizer) for s in rt.job.samples[:8]]
        max_new = cfg.spec.rollout.sampling.max_tokens
        check = (prompts, max_new, greedy(rt, prompts, max_new))  # the later checks compare with these tokens
        steady_syncs(rt, args, result, tag, check)
        ro, outs = rollouts(rt, args, result, tag, model_path)
        train_and_sync(rt, ro, outs, result, tag, check)
    finally:
        rt.shutdown()


#: What the runtime's last timed rollout ran (filled by ``run_one``), for ``bare_rollout``.
BARE_INPUTS: dict[str, Any] = {}


def scaling_order(n: int, rounds: int) -> list[int]:
    """Engine counts 1..n for ``rounds`` rounds, interleaved: ascending in even rounds, descending in odd ones (so
    no count always runs first or last, on a machine warming up or a batch cached)."""
    ks = list(range(1, n + 1))
    return [k for r in range(rounds) for k in (ks if r % 2 == 0 else ks[::-1])]


def scaling_prompts(k: int, per_engine: int, prompts_per_step: int) -> int:
    """The prompts of a DP-scaling rollout on k engines: k times ``per_engine`` (weak scaling), or with
    ``per_engine`` 0 the job's ``promptsPerStep`` at every k (strong scaling)."""
    return per_engine * k if per_engine else prompts_per_step


def dp_scaling(rt: Any, samples: Any, tokenizer: Any, sampling: dict[str, Any], rounds: int, tag: str,
               keep: Any, per_engine: int = 0) -> list[dict[str, Any]]:
    """A batch on the first k engines (independent replicas) for every k of ``scaling_order``: DP scaling. The
    same batch (``promptsPerStep`` prompts) for every k (strong scaling: each engine's share, and with it its
    decoding batch, shrinks as k grows), or with ``per_engine`` k times that many prompts (weak scaling: every
    engine decodes as many sequences at every k, so linear is what the runtime's fan-out can reach). One record
    per rollout (its round, k, prompts, seconds, tokens, tokens/s), handed to ``keep`` after each."""
    from rlhf_runtime.algo.data import step_batch

    engines, out = rt.actors.engines.actors, []
    try:
        for i, k in enumerate(scaling_order(len(engines), rounds)):
            rt.actors.engines.actors = engines[:k]
            batch = step_batch(samples, 1, scaling_prompts(k, per_engine, rt.cfg.spec.algorithm.prompts_per_step), 0)
            ro = rt.experience.launch(tokenizer, batch, sampling, 0)
            outs = rt.experience.collect(ro)
            dt = time.perf_counter() - ro.t_launch
            tokens = sum(len(c) for o in outs for c in o["samples"])
            out.append({"round": i // len(engines), "engines": k, "prompts": len(batch), "seconds": dt,
                        "tokens": tokens, "tokens_per_second": tokens / dt})
            print(f"{tag} rollout on {k} engine(s): {tokens / dt:.0f} tokens/s", flush=True)
            keep(out)
    finally:
        rt.actors.engines.actors = engines
    return out


def scaling_summary(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per engine count: median tokens/s (min-max) over the rounds, and the median over k times the 1-engine
    median (1.0 = linear)."""
    by_k: dict[int, list[float]] = {}
    for r in records:
        by_k.setdefault(r["engines"], []).append(r["tokens_per_second"])
    one = median(by_k.get(1, [0.0])) or 1.0
    return [{"engines": k, "rounds": len(v), "tokens_per_second": median(v), "min": min(v), "max": max(v),
             "x_linear": median(v) / (k * one)} for k, v in sorted(by_k.items())]


def _bare_rollout_proc(inputs: dict[str, Any], gpu: bool, q: Any) -> None:
    os.environ.update(inputs["env"])
    if gpu:
        os.environ["CUDA_VISIBLE_DEVICES"] = str(inputs["engine_gpu"])
    from bench_actors import time_generate
    from vllm import LLM

    from rlhf_runtime.rollout.base import llm_args

    llm = LLM(**llm_args(inputs["kwargs"]))  # the engine actor's exact LLM arguments
    runs = []
    for _ in range(1 + inputs.get("runs", 1)):  # a warm-up, then timed (as the runtime's rollout)
        r = time_generate(llm, inputs["prompts"], inputs["sampling"])
        runs.append({**r, "tokens_per_second": r["tokens"] / r["seconds"]})
    q.put(runs)


def bare_rollout(gpu: bool) -> dict[str, Any]:
    """The runtime's last rollout batch on a bare ``vllm.LLM`` (same engine arguments and weights, no Ray actor,
    no runtime) in its own process on one engine's GPU: the runtime's overhead is the ratio of the two."""
    import multiprocessing as mp

    if BARE_INPUTS.get("engines", 1) != 1:
        return {"skipped": "only for one-engine layouts (the runtime spreads the batch over its engines)"}
    ctx = mp.get_context("spawn")
    out: dict[str, Any] = {"prompts": len(BARE_INPUTS["prompts"])}
    # as the engine process has it, and with OMP_NUM_THREADS=1 (what Ray gives an actor of one CPU)
    for name, extra in (("default", {}), ("omp1", {"OMP_NUM_THREADS": "1"})):
        q = ctx.Queue()
        inputs = {**BARE_INPUTS, "env": {**BARE_INPUTS["env"], **extra}}
        proc = ctx.Process(target=_bare_rollout_proc, args=(inputs, gpu, q))
        proc.start()
        try:
            runs = q.get(timeout=300)
        finally:
            proc.join(60)
            if proc.is_alive():
                proc.kill()
        out[name] = {"runs": runs, "tokens_per_second": median([r["tokens_per_second"] for r in runs[1:]])}
    out["tokens_per_second"] = out["default"]["tokens_per_second"]
    return out


def measure_floor(layout: str, model_name: str, result: dict[str, Any]) -> None:
    """The run's floor (``sync_floors``), before Ray and the engines take the GPUs, for the bytes the default sync
    sends: a raw NCCL broadcast to every engine GPU for NCCL layouts, a device copy for IPC ones."""
    import torch
    import transformers

    arch, cfg_kw = MODELS[model_name]
    with torch.device("meta"):
        m = getattr(transformers, f"{arch}ForCausalLM")(getattr(transformers, f"{arch}Config")(**cfg_kw))
    nbytes = sent_bytes(m)
    del m
    if "nccl" in layout:
        r = merge(base_spec("m", True), layout_parts(layout)[0])["rollout"]
        result["floor"] = nccl_floor(nbytes, 1 << 30, 1 + r["engines"] * r["tensorParallelSize"])
    else:
        result["floor"] = copy_floor(nbytes)
        torch.cuda.empty_cache()
    print(f"[{layout}:{model_name}] floor {({k: v for k, v in result['floor'].items() if k != 'samples'})}",
          flush=True)
    save(result)


def versions(gpu: bool) -> dict[str, Any]:
    """The versions the run imported (torch, vLLM, Ray, Python) and on a GPU the GPUs' names."""
    import torch

    out: dict[str, Any] = {"versions": {"torch": torch.__version__, "python": sys.version.split()[0]}}
    try:
        import ray
        import vllm

        out["versions"].update(vllm=vllm.__version__, ray=ray.__version__)
    except Exception as e:  # noqa: BLE001 - recorded: the run goes on to fail where it needs them
        out["versions"]["import_error"] = repr(e)
    if gpu:
        out["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return out


def child(args: argparse.Namespace) -> int:
    """One ``LAYOUT:MODEL`` run (``--one``) into ``gpu_<layout>_<model>.json``: the floor, ``run_one``, and with
    ``--bare-rollout`` the last rollout on a bare engine; every failure recorded in the result."""
    import bench_actors

    bench_actors.enable_stack_dumps()  # the parent asks for the stacks before it kills a run past its limit
    layout, model_name = args.one.split(":")
    gpu = not args.cpu
    result: dict[str, Any] = {
        "layout": layout, "model_name": model_name, "device_kind": args.kind,
        "date": datetime.now(UTC).isoformat(timespec="seconds"), "command": args.command,
        "status": "running", "provenance": harness.provenance(args.command),
        "env": {k: os.environ.get(k) for k in ENV_RECORDED if k in os.environ},
    }
    global OUT_FILE
    OUT_FILE = Path(args.out) / f"gpu_{layout}_{model_name}.json"
    try:
        result.update(versions(gpu))
        if gpu:
            measure_floor(layout, model_name, result)
        run_one(layout, model_name, args, result)
        if args.bare_rollout and BARE_INPUTS:
            result["bare_rollout"] = bare = bare_rollout(gpu)
            if "tokens_per_second" in bare:
                result["rollout"]["overhead"] = 1 - result["rollout"]["tokens_per_second"] / bare["tokens_per_second"]
            print(f"[{layout}:{model_name}] bare vLLM rollout {bare}", flush=True)
        result["status"] = "ok"
    except BaseException as e:  # noqa: BLE001 - record every failure in the result file
        result["status"] = "failed"
        result["error"] = f"{type(e).__name__}: {e}"[:4000]
        result["traceback"] = traceback.format_exc()[-8000:]
        print(result["traceback"], flush=True)
    finally:
        result["floor_shares"] = floor_shares(result)
        save(result)
    return 0 if result["status"] == "ok" else 1


def table(out: Path, names: list[str]) -> str:
    lines = [("layout:model | status | valid | sync ms (default) | GB/s | % of floor | best variant ms | best GB/s | "
              "floor GB/s | tok/s   (% of floor marked * where the floor moved other bytes than the syncs sent)")]
    for name in names:
        layout, model_name = name.split(":")
        f = out / f"gpu_{layout}_{model_name}.json"
        if not f.exists():
            lines.append(f"{name} | not run")
            continue
        r = json.loads(f.read_text())
        s = r.get("summary", {})
        d = s.get("default", {})
        arms = {**s, **r.get("summary_interleaved", {})}  # interleaved variants: their own summary
        best = min((v for v in arms.values() if v.get("median_total_s")), key=lambda v: v["median_total_s"],
                   default={})
        fl = r.get("floor", {})
        fg = fl.get("whole_gbps", fl.get("copy_gbps", 0))
        share = floor_shares(r).get("summary", {}).get("default")
        pct = f"{share['share']:.1%}{'' if share['same_bytes'] else '*'}" if share else "-"
        lines.append(
            f"{name} | {r.get('status')} {r.get('error', '')[:80]} | {r.get('validation', {}).get('validated')} | "
            f"{d.get('median_total_s', 0) * 1e3:.1f} | {d.get('gbps', 0):.1f} | {pct} | "
            f"{best.get('median_total_s', 0) * 1e3:.1f} | {best.get('gbps', 0):.1f} | {fg:.0f} | "
            f"{r.get('rollout', {}).get('tokens_per_second', 0):.0f}"
        )
    return "\n".join(lines)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("runs", nargs="*", help="LAYOUT:MODEL, e.g. separate-nccl:qwen2-0.5b")
    p.add_argument("--kind", default="unknown", help="the device kind, recorded in the results")
    p.add_argument("--out", default=str(ROOT / "results" / "sync"))
    p.add_argument("--work", default="/tmp/rlhf-gpu-bench")
    p.add_argument("--syncs", type=int, default=5)
    p.add_argument("--timeout", type=float, default=240, help="seconds per run")
    p.add_argument("--deadline", type=float, default=0, help="skip runs that would start after this many seconds")
    p.add_argument("--cpu", action="store_true", help="CPU smoke test (tiny model, gloo)")
    p.add_argument("--no-variants", action="store_true")
    p.add_argument("--bare-rollout", action="store_true",
                   help="also time the last rollout batch on a bare vllm.LLM (the runtime's overhead)")
    p.add_argument("--rollouts", type=int, default=1, help="timed rollouts of the same batch after a warm-up")
    p.add_argument("--prompts", type=int, default=0, help="prompts per rollout (default: the base spec's 64)")
    p.add_argument("--max-tokens", type=int, default=0, help="sampling.maxTokens (default: the base spec's 128)")
    p.add_argument("--scaling-rounds", type=int, default=1,
                   help="rounds of the DP scaling pass (engine counts interleaved, scaling_order)")
    p.add_argument("--scaling-per-engine", type=int, default=0,
                   help="DP scaling with this many prompts per engine (weak scaling: k engines get k times as "
                        "many); 0: the same batch of promptsPerStep prompts at every engine count")
    p.add_argument("--variants", default="", help="comma-separated variant names to time (default: all)")
    p.add_argument("--sequential", action="store_true",
                   help="time each variant's syncs one after another instead of "
                   "interleaved with the default's")
    p.add_argument("--revalidate", action="store_true",
                   help="after the variants, sync with the fastest one and run the fresh-engine validation again")
    p.add_argument("--engine-device-sync", action="store_true",
                   help="engine-side timers (start/receive/finish of the worker transfer engine) wait for the GPU "
                   "before stopping (device-complete times; adds one synchronize per step)")
    p.add_argument("--sender-options", default="",
                   help="JSON of sync options in force from the first sync (SPEC_FIELDS and "
                        "weight_sync.options.EXPERIMENTAL), e.g. '{\"ipc_exchange\": \"gloo\"}'")
    p.add_argument("--py-spy", default="",
                   help="path of a py-spy executable: a run past its limit also gets the native stacks of every "
                        "Ray process (native_stacks_<layout>_<model>.txt in --out)")
    p.add_argument("--skip-validation", action="store_true",
                   help="no fresh-engine validation after the first sync (a layout validated before, when the call "
                        "has no time for it); the later greedy checks compare with the tokens after the first sync")
    p.add_argument("--build-only", action="store_true",
                   help="build (or find) each run's model under --work and its floor, then stop: a later call on the "
                   "same machine reuses the model")
    p.add_argument("--one", help=argparse.SUPPRESS)
    p.add_argument("--command", help=argparse.SUPPRESS)
    return p


#: Options passed on to each run's child as they are (flags, and options with a value where one is set).
FLAGS = ("cpu", "no_variants", "sequential", "bare_rollout", "revalidate", "engine_device_sync", "build_only",
         "skip_validation")
VALUED = ("variants", "prompts", "max_tokens", "sender_options")


def child_argv(args: argparse.Namespace, name: str, out: Path, command: str) -> list[str]:
    """The child process of run ``name``: this script with ``--one`` and the parent's options."""
    cmd = [sys.executable, __file__, "--one", name, "--kind", args.kind, "--out", str(out), "--work", args.work,
           "--syncs", str(args.syncs), "--command", command, "--scaling-rounds", str(args.scaling_rounds),
           "--scaling-per-engine", str(args.scaling_per_engine), "--rollouts", str(args.rollouts)]
    cmd += [f"--{f.replace('_', '-')}" for f in FLAGS if getattr(args, f)]
    for k in VALUED:
        if getattr(args, k):
            cmd += [f"--{k.replace('_', '-')}", str(getattr(args, k))]
    return cmd


def marked(line: str) -> bool:
    """A child's line the parent prints as it comes: the run's own reports and errors."""
    return line.startswith("[") or "Error" in line or "error" in line[:200]


def run_child(args: argparse.Namespace, name: str, out: Path, command: str, limit: float) -> int | None:
    """One run's child, watched (``stack_dumps.watch``) into ``gpu_sync.log``; past ``limit`` its result says so.
    Ray is stopped after it either way. The exit code, None at the limit."""
    log = out / "gpu_sync.log"
    with open(log, "ab") as f:
        f.write(f"\n=== {name}\n".encode())
    try:
        code = watch(child_argv(args, name, out, command), log, limit, marked,
                     native=out / f"native_stacks_{name.replace(':', '_')}.txt", py_spy=args.py_spy)
        if code is None:
            res = out / f"gpu_{name.replace(':', '_')}.json"
            r = json.loads(res.read_text()) if res.exists() else {"layout": name}
            r.update(status="timeout", error=f"no result within {limit:.0f}s")
            harness.write_result(res, r)
        return code
    finally:
        subprocess.run([sys.executable, "-m", "ray.scripts.scripts", "stop", "--force"],
                       capture_output=True, timeout=60, check=False)


def main() -> int:
    p = parser()
    args = p.parse_args()
    if args.revalidate and args.no_variants:  # it syncs with the fastest variant: there is none without variants
        p.error("--revalidate needs the variants (it re-validates the fastest one): drop --no-variants")
    if args.one:
        return child(args)
    command, out = harness.command_line(), Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    start, codes = time.time(), {}
    for name in args.runs:
        elapsed = time.time() - start
        if args.deadline and elapsed + 60 > args.deadline:
            print(f"skip {name}: {elapsed:.0f}s spent of the {args.deadline:.0f}s deadline", flush=True)
            continue
        limit = args.timeout if not args.deadline else min(args.timeout, args.deadline - elapsed)
        print(f"=== {name} (limit {limit:.0f}s)", flush=True)
        t = time.time()
        codes[name] = run_child(args, name, out, command, limit)
        print(f"=== {name}: exit {codes[name]} in {time.time() - t:.0f}s", flush=True)
    print(table(out, args.runs))
    return 0 if all(c == 0 for c in codes.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
