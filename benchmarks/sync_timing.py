"""One steady-state weight sync as the driver runs it, with what the benchmark actors timed on both sides
(``timed_sync``; a direct NCCL sync's timeline, ``timeline_summary``), their medians (``summarize``), and the
engines' greedy tokens (``greedy``) that every sync must restore. Used by ``gpu_sync.py``."""

from __future__ import annotations

import time
from typing import Any

from harness import median


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
