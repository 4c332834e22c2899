#!/usr/bin/env python3
"""Variants of the trainer's step interleaved inside one process: the same trainer, weights, batches and GPU,
the arms taking turns round by round (the order reversed every other round), so a comparison is not between two
processes, two model loads or two moments of the machine.

An arm is settings joined by ``+``:

- ``eager`` / ``compiled``: ``trainer.compile`` (the trainer is built with it whenever an arm is ``compiled``; an
  ``eager`` turn calls each decoder layer's own forward, the compiled one put aside for the turn: what
  ``nn.Module.compile`` installs, ``_compiled_call_impl``);
- ``chunk=N``: the output layer's logits per chunk (``roles.batches.LOGIT_CHUNK_ELEMENTS``).

Every arm takes one untimed warm-up step per length (a ``compiled`` one compiles), then ``--rounds`` rounds of
``--repeats`` timed steps each. Per length and arm: every step's seconds, each round's median, the median and
min-max over all timed steps, tokens/s per GPU, MFU (``train_step``'s model FLOPs over the GPU's dense peak),
the runtime's own MFU, peak memory of its turns and the last step's loss and entropy. Each step trains (lr 1e-6),
so later steps see slightly other weights, the same for every arm. The JSON is rewritten after every round (a
run cut at a time limit keeps what it timed).

    PYTHONPATH=/tmp/site:$PWD/operator python3 benchmarks/train_arms.py --model qwen3-1.7b --model-dir /tmp/m17 \\
        --lengths 1024,4096,16384 --budget 32768 --rounds 5 --repeats 2 --arms eager,compiled --out $OUT/c.json
    python3 benchmarks/train_arms.py --cpu --arms chunk=4096,chunk=65536 --out /tmp/arms.json   # smoke
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT.parent / "operator"))

import harness

SETTINGS = ("eager", "compiled", "chunk")


def parse_arms(text: str) -> list[dict[str, Any]]:
    """``"eager,compiled+chunk=536870912"`` -> ``[{"name": "eager", "compiled": False, "chunk": None}, ...]``;
    refuses an unknown setting, an arm both eager and compiled, a chunk that is not a positive integer and an arm
    named twice."""
    arms = []
    for name in [a.strip() for a in text.split(",") if a.strip()]:
        arm: dict[str, Any] = {"name": name, "compiled": False, "chunk": None}
        seen = set()
        for part in name.split("+"):
            key, _, value = part.partition("=")
            if key not in SETTINGS:
                raise ValueError(f"arm {name!r}: unknown setting {key!r} (known: {', '.join(SETTINGS)})")
            if key in seen or (key in ("eager", "compiled") and {"eager", "compiled"} & seen):
                raise ValueError(f"arm {name!r}: {key!r} given twice or both eager and compiled")
            seen.add(key)
            if key == "chunk":
                if not value.isdigit() or int(value) <= 0:
                    raise ValueError(f"arm {name!r}: chunk needs a positive number of logits, got {value!r}")
                arm["chunk"] = int(value)
            elif value:
                raise ValueError(f"arm {name!r}: {key!r} takes no value")
            else:
                arm["compiled"] = key == "compiled"
        arms.append(arm)
    if len(arms) < 2:
        raise ValueError("at least two arms are needed to compare")
    if len({a["name"] for a in arms}) != len(arms):
        raise ValueError("an arm is named twice")
    return arms


def round_order(arms: list[dict[str, Any]], r: int) -> list[dict[str, Any]]:
    """The arms' order in round ``r``: as given, reversed every other round (A B, B A, A B, ...), so no arm always
    runs right after the same one."""
    return list(arms) if r % 2 == 0 else list(reversed(arms))


def summarize(times: list[list[float]], tokens: int, flops: float, peak_flops: float | None) -> dict[str, Any]:
    """``times``: the timed seconds of each round. Median and min-max over every timed step, each round's
    median, tokens/s and MFU at the median."""
    flat = [t for rnd in times for t in rnd]
    med = statistics.median(flat)
    return {"rounds": len(times), "steps": len(flat), "median_s": med, "min_s": min(flat), "max_s": max(flat),
            "round_medians_s": [statistics.median(rnd) for rnd in times], "train_s": times,
            "tokens_per_s_per_gpu": tokens / med, "mfu": flops / med / peak_flops if peak_flops else None}


@contextlib.contextmanager
def arm_settings(trainer: Any, arm: dict[str, Any]) -> Iterator[None]:
    """``arm`` in force for the steps inside: an eager turn puts each decoder layer's compiled forward aside (and
    back after), a chunk sets the output layer's logits per chunk (and the one before it back after)."""
    from rlhf_runtime.roles import batches

    put_aside = []
    if not arm["compiled"]:
        for layer in trainer.decoder_layers():
            if layer._compiled_call_impl is not None:
                put_aside.append((layer, layer._compiled_call_impl))
                layer._compiled_call_impl = None
    before = batches.LOGIT_CHUNK_ELEMENTS
    if arm["chunk"] is not None:
        batches.LOGIT_CHUNK_ELEMENTS = arm["chunk"]
    try:
        yield
    finally:
        batches.LOGIT_CHUNK_ELEMENTS = before
        for layer, impl in put_aside:
            layer._compiled_call_impl = impl


def run(a: argparse.Namespace, arms: list[dict[str, Any]], result: dict[str, Any], save: Any) -> None:
    import torch
    import train_step

    gpu = not a.cpu
    model = Path(a.model_dir) if a.model_dir else harness.model_dir(a.model, gpu)
    info = harness.cached_model(model, a.model, gpu)
    lengths = [int(x) for x in a.lengths.split(",")]
    budget = max(a.budget, max(lengths))
    compiled = any(arm["compiled"] for arm in arms)
    t = train_step.make_trainer(train_step.spec(model, gpu, budget, 1e-6, "bfloat16" if gpu else "float32",
                                                "float32", not a.no_checkpointing, 1, compiled))
    if compiled and not t.decoder_layers():
        raise RuntimeError("the trainer has no decoder layers to compile")
    result.update(params=info["params"], budget=budget, gradient_checkpointing=not a.no_checkpointing,
                  trainer_compiled=compiled, peak_flops=train_step.device_peak(), lengths={})
    for n in lengths:
        b = train_step.batch([n] * max(1, a.step_tokens // n), info["config"]["vocab_size"])
        tokens = sum(len(p) + len(q) for p, q in zip(b["prompts"], b["completions"]))
        flops = train_step.step_flops(info, b)
        row: dict[str, Any] = {"samples": len(b["prompts"]), "tokens": tokens, "order": [], "arms": {}}
        result["lengths"][str(n)] = row
        times: dict[str, list[list[float]]] = {arm["name"]: [] for arm in arms}
        peaks: dict[str, float] = {}
        last: dict[str, dict[str, Any]] = {}
        for arm in arms:  # warm-up: a compiled arm compiles here
            with arm_settings(t, arm):
                w = time.perf_counter()
                t.train(b)
                row.setdefault("warmup_s", {})[arm["name"]] = time.perf_counter() - w
        for r in range(a.rounds):
            for arm in round_order(arms, r):
                if gpu:
                    torch.cuda.synchronize()
                    torch.cuda.reset_peak_memory_stats()
                with arm_settings(t, arm):
                    steps = [t.train(b) for _ in range(a.repeats)]
                times[arm["name"]].append([s["train_s"] for s in steps])
                last[arm["name"]] = steps[-1]
                if gpu:  # the trainer resets the allocator's peak after each step and reports the step's own
                    step_peak = max(s.get("gpu_peak_allocated_gib") or 0.0 for s in steps)
                    peaks[arm["name"]] = max(peaks.get(arm["name"], 0.0), step_peak,
                                             torch.cuda.max_memory_allocated() / 2**30)
                row["order"].append(arm["name"])
            for arm in arms:
                s = last[arm["name"]]
                row["arms"][arm["name"]] = {**summarize(times[arm["name"]], tokens, flops, result["peak_flops"]),
                                            "runtime_mfu": s.get("mfu"), "loss": s.get("loss"),
                                            "entropy": s.get("entropy"), "peak_allocated_gib": peaks.get(arm["name"])}
            save()
        base = row["arms"][arms[0]["name"]]["median_s"]
        for arm in arms[1:]:  # the first arm's median over each other's: > 1 means the other is faster
            row["arms"][arm["name"]]["speedup_vs_first"] = base / row["arms"][arm["name"]]["median_s"]
        print(json.dumps({"length": n, **{k: {f: v.get(f) for f in ("median_s", "min_s", "max_s", "mfu",
                                                                  "speedup_vs_first", "peak_allocated_gib")}
                                          for k, v in row["arms"].items()}}), flush=True)
        save()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arms", required=True, help="comma-separated arms, settings joined by + (eager, compiled, chunk=N)")
    p.add_argument("--model", default="qwen3-1.7b", help="a harness.MODELS name")
    p.add_argument("--model-dir", default="", help="build the model here, or reuse the one an earlier run built here "
                   "(default: harness.model_dir, shared with the other benchmarks on this machine)")
    p.add_argument("--lengths", default="4096", help="sequence lengths (prompt + completion)")
    p.add_argument("--step-tokens", type=int, default=65536, help="tokens per training step")
    p.add_argument("--budget", type=int, default=16384, help="trainer.maxTokensPerMicroBatch (at least the longest)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--repeats", type=int, default=3, help="timed steps per arm per round")
    p.add_argument("--no-checkpointing", action="store_true", help="trainer.gradientCheckpointing false")
    p.add_argument("--cpu", action="store_true", help="smoke run: the tiny model on CPU")
    p.add_argument("--out", default="")
    a = p.parse_args()
    try:
        arms = parse_arms(a.arms)
    except ValueError as e:
        p.error(str(e))
    if a.cpu:
        import train_step

        train_step.PROMPT = 16
        a.model, a.lengths, a.step_tokens, a.budget = "tiny", "64", 256, 256
        a.rounds, a.repeats = min(a.rounds, 2), min(a.repeats, 1)
    prov = harness.provenance()
    gpus = prov["device"]["gpus"]
    result: dict[str, Any] = {"command": prov["command"], "model": a.model, "arms": arms,
                              "rounds": a.rounds, "repeats": a.repeats,
                              "device": gpus[0] if gpus and not a.cpu else "cpu",
                              "torch": prov["device"]["versions"]["torch"], "date": time.strftime("%Y-%m-%d %H:%M:%S"),
                              "provenance": prov}

    def save() -> None:
        if a.out:
            harness.write_result(a.out, result)

    try:
        run(a, arms, result, save)
        result["status"] = "ok"
    except Exception as e:
        result["status"] = "failed"
        result["error"] = f"{type(e).__name__}: {e}"[:2000]
        raise
    finally:
        save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
