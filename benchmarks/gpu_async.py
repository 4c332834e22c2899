"""GPU async mode: the real driver (``python -m rlhf_testing.driver --local --validate``: the runtime's driver with
the test hooks' actor classes) with
``weightSync.mode: async`` on two GPUs (trainer GPU0, one vLLM engine GPU1, NCCL): the next rollout runs
while the trainer trains, the sync pauses it mid-request, swaps the weights and resumes it.

Builds a random-init model from a real config (``harness.MODELS``), runs ``--steps`` steps with
``--pause-after-tokens`` (the hooked engines wait until a live sample has that many tokens before a sync) and batch-invariant kernels (``VLLM_BATCH_INVARIANT=1``), and writes
``<out>/gpu_async_<engine>_<model>.json``: the fresh-engine validation, every step's sync stages (pause,
transfer, resume), how many samples mixed old and new weights, and throughput. ``--engine`` picks the
async engine (``spec.rollout.asyncEngine``): ``stepped`` (in-process ``LLM`` stepped by the actor) or ``asyncllm``.

    source benchmarks/gpu_env.sh
    python3 benchmarks/gpu_async.py --kind nvidia-h200-x4 --out $OUT --engine stepped qwen2-0.5b
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))

import harness
from sync_layouts import LAYOUTS


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model", help="a harness.MODELS name, e.g. qwen2-0.5b")
    p.add_argument("--engine", default="stepped", choices=["stepped", "asyncllm"])
    p.add_argument("--kind", default="unknown")
    p.add_argument("--out", default=str(ROOT / "results" / "sync"))
    p.add_argument("--work", default="/tmp/rlhf-gpu-async")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--pause-after-tokens", type=int, default=32)
    p.add_argument("--timeout", type=float, default=400)
    p.add_argument("--cpu", action="store_true", help="smoke test on CPU (tiny model, gloo)")
    return p.parse_args()


def summary(records: list[dict[str, Any]], code: int) -> dict[str, Any]:
    """From the driver's progress records: its validation, every step's sync, swap and throughput, the final
    state and ``status`` (ok: exit 0 and validated)."""
    validation = [r["validation"] for r in records if "validation" in r]
    return {
        "validation": {k: validation[0].get(k) for k in ("validated", "prompts", "engines", "mismatched")}
        if validation else None,
        "steps": [{"step": r.get("step"), "sync": r.get("sync"), "swap": r.get("swap"),
                   "throughput": r.get("throughput"), "tokens": r.get("tokens")} for r in records if "train" in r],
        "final_state": records[-1].get("runtime", {}).get("state") if records else None,
        "status": "ok" if code == 0 and validation and validation[0]["validated"] else "failed",
    }


def main() -> int:
    args = parse()
    gpu = not args.cpu
    work = Path(args.work) / f"{args.engine}_{args.model}"
    prov, model = harness.provenance(), harness.model_dir(args.model, gpu, Path(args.work) / "models")
    result: dict[str, Any] = {
        "layout": "separate-nccl-async", "engine": args.engine, "model_name": args.model, "device_kind": args.kind,
        "date": prov["date"], "command": prov["command"], "provenance": prov,
        "model": harness.cached_model(model, args.model, gpu),
    }
    spec = harness.merge(harness.base_spec(str(model), gpu),
                         LAYOUTS["separate-nccl-async" if gpu else "cpu-gloo"])
    spec = harness.merge(spec, {"weightSync": {"mode": "async"}, "algorithm": {"steps": args.steps},
                                "rollout": {"asyncEngine": args.engine}})
    env = {**harness.SAFE_ENV, **({"VLLM_BATCH_INVARIANT": "1"} if gpu else {})}  # batch-invariant: Triton kernels
    ran, records = harness.run_driver(spec, work, name="bench-async", timeout=args.timeout, env=env,
                                      module="rlhf_testing.driver", extra=("--validate", "--pause-after-tokens",
                                                                           str(args.pause_after_tokens)))
    Path(args.out).mkdir(parents=True, exist_ok=True)
    shutil.copyfile(ran["log"], Path(args.out) / f"gpu_async_{args.engine}_{args.model}.log")
    result.update(driver_exit=ran["exit"], wall_s=ran["seconds"], **summary(records, ran["exit"]))
    harness.write_result(Path(args.out) / f"gpu_async_{args.engine}_{args.model}.json", result)
    for s in result["steps"]:
        sync, swap = s["sync"] or {}, s["swap"] or {}
        print(f"step {s['step']}: sync {sync.get('total_s', 0) * 1e3:.1f} ms (pause {sync.get('pause_s', 0) * 1e3:.1f},"
              f" resume {sync.get('resume_s', 0) * 1e3:.1f}), mixed samples {swap.get('mixed_samples')}, "
              f"tokens before/after swap {swap.get('tokens_before_swap')}/{swap.get('tokens_after_swap')}")
    print(f"driver exit {ran['exit']}, validation {result['validation']}, state {result['final_state']}, "
          f"{result['wall_s']:.0f}s")
    return 0 if result["status"] == "ok" else 1


if __name__ == "__main__":
    sys.exit(main())
