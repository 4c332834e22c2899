"""The colocated memory plan and the trainer-state offload through the runtime's own driver, on one GPU.

Builds a random-initialised Qwen3-1.7B-shaped model (bfloat16, the character tokenizer of ``rlhf_testing.tiny``
padded to the model's vocabulary), then runs ``python -m rlhf_runtime.driver --local`` once per variant: GRPO,
colocated placement with sleeping engines, float32 master weights, gradient checkpointing, 32k-token micro-batches,
``--prompts`` prompts x 8 samples of up to ``maxTokens`` tokens (a random model rarely samples its end token, so
nearly every sample runs to the limit). A variant is ``NAME:UTIL:OFFLOAD:MAX_TOKENS:STEPS[:FLAGS]`` (OFFLOAD: the
``trainer.offloadDuringRollout`` value; FLAGS, comma-separated: ``graphs`` for CUDA graphs in the engine instead of
``enforceEager``, ``compile`` for ``trainer.compile``, ``fp8kv`` for ``rollout.kvCacheDtype: fp8``, ``nockpt`` for
no gradient checkpointing at 16k-token micro-batches). Per run it
keeps the exit code, the Failed message, the memory plan (the progress file's actors record), and per step the
step / rollout / train / sync seconds, rollout tokens/s, the trainer's memory (peak allocated in the step,
allocated and reserved after it) and the offload's seconds and GiB.

Writes ``<out>/colocated_memory.json`` and prints a table.

    . benchmarks/gpu_env.sh && python3 benchmarks/colocated_memory.py --out $OUT \\
        --variants refused:0.75:never:1024:3 offload:0.75:auto:1024:3
    python3 benchmarks/colocated_memory.py --cpu --out /tmp/cm          # smoke test on CPU (separate placement)
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT.parent / "operator"))

sys.path.insert(0, str(ROOT))
import harness


def build_model(path: Path, gpu: bool) -> dict[str, Any]:
    """The random-initialised model (the Qwen3-1.7B shape in bfloat16 on a GPU, the tiny one in float32 on a CPU)
    and its tokenizer at ``path`` (``harness.cached_model``: reused where a run built it)."""
    return harness.cached_model(path, "qwen3-1.7b" if gpu else "tiny", gpu)


def job(model: Path, name: str, util: float, offload: str, max_tokens: int, steps: int, prompts: int,
        gpu: bool, flags: frozenset[str] = frozenset()) -> dict[str, Any]:
    return {
        "model": {"name": str(model), "dtype": "bfloat16" if gpu else "float32"},
        "image": "local",
        "trainer": {"replicas": 1, "gpusPerReplica": 1 if gpu else 0, "gradientCheckpointing": "nockpt" not in flags,
                    "maxTokensPerMicroBatch": (16384 if "nockpt" in flags else 32768) if gpu else 256,
                    "offloadDuringRollout": offload,
                    "compile": "compile" in flags, "resources": {"memory": "100Gi"}},
        "rollout": {"engines": 1, "gpuMemoryUtilization": util, "enforceEager": "graphs" not in flags,
                    "kvCacheDtype": "fp8" if "fp8kv" in flags else "auto", "maxModelLen": max_tokens + 256,
                    "sampling": {"temperature": 1.0, "maxTokens": max_tokens, "samplesPerPrompt": 8}},
        "placement": {"mode": "colocated" if gpu else "separate"},
        "weightSync": {"backend": "ipc" if gpu else "nccl"},
        "algorithm": {"name": "grpo", "steps": steps, "promptsPerStep": prompts, "learningRate": 1e-6, "seed": 0},
        "data": {"prompts": [f"{name} prompt {i}: " + "count the letters of this line " * 3 for i in range(256)]},
        "reward": {"rule": "length", "targetLength": max_tokens // 2},
        "env": [{"name": "HF_HUB_OFFLINE", "value": "1"}, {"name": "TRANSFORMERS_OFFLINE", "value": "1"}],
    }


STEP_KEYS = ("step_seconds", "rollout_seconds", "train_seconds", "weight_sync_seconds", "rollout_tokens_per_second",
             "train_tokens_per_second_per_gpu", "mfu")
TRAIN_KEYS = ("gpu_peak_allocated_gib", "gpu_allocated_gib", "gpu_reserved_gib", "offload_s", "offload_pin_s",
              "offload_gib", "reload_s", "train_s")


FLAGS = frozenset({"graphs", "compile", "fp8kv", "nockpt"})


def snake(k: str) -> str:
    return "".join("_" + c.lower() if c.isupper() else c for c in k)


def parse_variant(variant: str) -> tuple[str, float, str, int, int, frozenset[str]]:
    """NAME:UTIL:OFFLOAD:MAX_TOKENS:STEPS[:FLAGS] as (name, util, offload, max_tokens, steps, flags)."""
    name, util, offload, max_tokens, steps, *rest = variant.split(":")
    flags = frozenset(f for f in (rest[0] if rest else "").split(",") if f)
    if flags - FLAGS:
        raise SystemExit(f"unknown flags {sorted(flags - FLAGS)} in {variant}: {', '.join(sorted(FLAGS))}")
    return name, float(util), offload, int(max_tokens), int(steps), flags


def run(args: argparse.Namespace, tmp: Path, model: Path, variant: str) -> dict[str, Any]:
    """One driver run of ``variant`` (``parse_variant``); what its progress file recorded."""
    name, util, offload, max_tokens, steps, flags = parse_variant(variant)
    spec = job(model, name, util, offload, max_tokens, steps, args.prompts, not args.cpu, flags)
    ran, records = harness.run_driver(spec, tmp, name=name, timeout=args.run_timeout)
    rc, wall, log = ran["exit"], ran["seconds"], ran["log"]
    result: dict[str, Any] = {"variant": variant, "exit_code": rc, "wall_seconds": round(wall, 1), "steps": []}
    for r in records:
        plan = (r.get("actors") or {}).get("memory_plan")
        if plan:
            result["memory_plan"] = plan
        runtime = r.get("runtime") or {}
        if runtime.get("state") == "Failed":
            result["failed"] = runtime.get("message")
        tp, train = r.get("throughput"), r.get("train") or {}
        if tp and runtime.get("state") == "Running":
            row = {"step": r.get("step"), **{k: tp.get(k) for k in STEP_KEYS if k in tp},
                   **{snake(k): v for k, v in tp.items() if snake(k) in STEP_KEYS},
                   **{k: train[k] for k in TRAIN_KEYS if k in train}}
            result["steps"].append({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()})
    result["log_tail"] = log.read_text(errors="replace").splitlines()[-30:] if rc else []
    return result


def decode_read_floor(config: dict[str, Any], plan: dict[str, Any], prompt_tokens: int, max_tokens: int,
                      fp8_kv: bool, read_write_bytes_per_s: float) -> dict[str, Any]:
    """The least time the rollout's decode can take on this GPU when every sample runs to ``max_tokens``: each
    decode step reads the engine's bfloat16 weights once and the keys and values of every live sequence's context
    (its prompt and the tokens so far), in ``batch / sequences_at_once`` waves; those bytes over the bandwidth of a
    device copy (read and write) on the same GPU. Prefill and the sampler are left out, which makes the floor
    low; samples that end before ``max_tokens`` read less than it counts, which makes it high."""
    from rlhf_api.memory_plan import ModelShape

    shape = ModelShape.from_config(config)
    kv_tok = shape.kv_bytes_per_token(1 if fp8_kv else 2)
    batch, at_once = plan["batch_sequences"], max(1, plan["sequences_at_once"])
    waves = -(-batch // at_once)
    context = max_tokens * prompt_tokens + max_tokens * (max_tokens - 1) // 2  # one sequence's reads, in tokens
    kv = batch * context * kv_tok
    weights = waves * max_tokens * 2 * shape.params
    return {"kv_read_bytes": kv, "weight_read_bytes": weights, "waves": waves,
            "seconds": round((kv + weights) / read_write_bytes_per_s, 2)}


def table(results: list[dict[str, Any]]) -> str:
    head = ("| variant | exit | plan: rollout / training GiB, KV GiB (seqs), offload | step s | rollout s | train s | "
            "tok/s | peak GiB | offload s / reload s / GiB |")
    lines = [head, "|---" * 9 + "|"]
    for r in results:
        p = r.get("memory_plan") or {}
        plan = (f"{p.get('rollout_total_gib')} / {p.get('training_total_gib')}, {p.get('kv_cache_gib')} "
                f"({p.get('sequences_at_once')}/{p.get('batch_sequences')}), {p.get('offload')}") if p else "-"
        for s in r["steps"] or [{}]:
            lines.append(f"| {r['variant']} | {r['exit_code']} | {plan} | {s.get('step_seconds', '-')} | "
                         f"{s.get('rollout_seconds', '-')} | {s.get('train_seconds', '-')} | "
                         f"{round(s.get('rollout_tokens_per_second') or 0)} | {s.get('gpu_peak_allocated_gib', '-')} | "
                         f"{s.get('offload_s', '-')} / {s.get('reload_s', '-')} / {s.get('offload_gib', '-')} |")
        if r.get("failed"):
            lines.append(f"| {r['variant']} failed: {r['failed'][:600]} |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--variants", nargs="+", default=["refused:0.75:never:1024:3", "offload:0.75:auto:1024:3"])
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--model-dir", type=Path, default=Path("/tmp/colocated-memory/model"))
    ap.add_argument("--run-timeout", type=float, default=540)
    ap.add_argument("--cpu", action="store_true", help="a tiny model on the CPU (separate placement)")
    ap.add_argument("--build-only", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    tmp = args.model_dir.parent
    tmp.mkdir(parents=True, exist_ok=True)
    if args.build_only:  # in a process of its own: no CUDA context of this process stays on the GPU
        t0 = time.perf_counter()
        built = build_model(args.model_dir, not args.cpu)
        facts = {"model": {**built, "seconds": round(time.perf_counter() - t0, 1)}, "device": device()}
        if not args.cpu:
            from sync_floors import copy_floor

            facts["device_copy"] = {k: v for k, v in copy_floor(4 * 2**30).items() if k != "samples"}
        print(json.dumps(facts))
        return 0
    build = subprocess.run([sys.executable, __file__, "--build-only", "--out", str(args.out), "--model-dir",
                            str(args.model_dir)] + (["--cpu"] if args.cpu else []),
                           check=True, capture_output=True, text=True)
    out = args.out / "colocated_memory.json"
    prov = harness.provenance()
    result: dict[str, Any] = {"command": prov["command"], "date": prov["date"], "provenance": prov,
                              **json.loads(build.stdout.strip().splitlines()[-1]), "runs": []}
    for v in args.variants:
        result["runs"].append(run(args, tmp, args.model_dir, v))
        with_floor(result, args.model_dir, v)
        harness.write_result(out, result)  # a cut run keeps what finished
        print(f"{v}: exit {result['runs'][-1]['exit_code']} in {result['runs'][-1]['wall_seconds']} s", flush=True)
    print(table(result["runs"]))
    return 0


def with_floor(result: dict[str, Any], model: Path, variant: str) -> None:
    """Adds the decode's read floor (``decode_read_floor``) to the last run, on a GPU, where its plan is known."""
    run, copy = result["runs"][-1], result.get("device_copy")
    if not copy or not run.get("memory_plan"):
        return
    from transformers import AutoTokenizer

    name, _, _, max_tokens, _, flags = parse_variant(variant)
    prompt = job(model, name, 0.5, "never", 1, 1, 1, True)["data"]["prompts"][0]
    prompt_tokens = len(AutoTokenizer.from_pretrained(str(model)).encode(prompt))
    config = json.loads((model / "config.json").read_text())
    run["decode_read_floor"] = {"prompt_tokens": prompt_tokens, **decode_read_floor(
        config, run["memory_plan"], prompt_tokens, max_tokens, "fp8kv" in flags, 2 * copy["bytes"] / copy["copy_s"])}


def device() -> dict[str, Any]:
    import torch

    out: dict[str, Any] = {"torch": torch.__version__}
    if torch.cuda.is_available():
        _, total = torch.cuda.mem_get_info()
        out.update(name=torch.cuda.get_device_name(0), total_gib=round(total / 2**30, 2))
    try:
        out["vllm"] = importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        pass
    return out


if __name__ == "__main__":
    sys.exit(main())
