"""GPU async mode: the real driver (``python -m rlhf_testing.driver --local --validate``: the runtime's driver with
the test hooks' actor classes) with
``weightSync.mode: async`` on two GPUs (trainer GPU0, one vLLM engine GPU1, NCCL): the next rollout runs
while the trainer trains, the sync pauses it mid-request, swaps the weights and resumes it.

Builds a random-init model from a real config (``gpu_sync.MODELS``), runs ``--steps`` steps with
``--pause-after-tokens`` (the hooked engines wait until a live sample has that many tokens before a sync) and batch-invariant kernels (``VLLM_BATCH_INVARIANT=1``), and writes
``<out>/gpu_async_<engine>_<model>.json``: the fresh-engine validation, every step's sync stages (pause,
transfer, resume), how many samples mixed old and new weights, and throughput. ``--engine`` picks the
async engine (``spec.rollout.asyncEngine``): ``stepped`` (in-process ``LLM`` stepped by the actor) or ``asyncllm``.

    source benchmarks/gpu_env.sh
    python3 benchmarks/gpu_async.py --kind nvidia-h200-x4 --out $OUT --engine stepped qwen2-0.5b
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))

from gpu_sync import LAYOUTS, SAFE_ENV, base_spec, build_model, merge


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model", help="a gpu_sync.MODELS name, e.g. qwen2-0.5b")
    p.add_argument("--engine", default="stepped", choices=["stepped", "asyncllm"])
    p.add_argument("--kind", default="unknown")
    p.add_argument("--out", default=str(ROOT / "results" / "sync"))
    p.add_argument("--work", default="/tmp/rlhf-gpu-async")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--pause-after-tokens", type=int, default=32)
    p.add_argument("--timeout", type=float, default=400)
    p.add_argument("--cpu", action="store_true", help="smoke test on CPU (tiny model, gloo)")
    args = p.parse_args()
    gpu = not args.cpu
    work = Path(args.work) / f"{args.engine}_{args.model}"
    work.mkdir(parents=True, exist_ok=True)
    out = Path(args.out) / f"gpu_async_{args.engine}_{args.model}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    env_prefix = " ".join(f"{k}={os.environ[k]}" for k in sorted(SAFE_ENV) if k in os.environ)
    result: dict = {
        "layout": "separate-nccl-async", "engine": args.engine, "model_name": args.model, "device_kind": args.kind,
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "command": (env_prefix + " " if env_prefix else "") + " ".join(shlex.quote(x) for x in ["python3", *sys.argv]),
    }
    result["model"] = build_model(work / "model", args.model, gpu)
    spec = merge(base_spec(str(work / "model"), gpu), LAYOUTS["separate-nccl-async" if gpu else "cpu-gloo"])
    spec = merge(spec, {"weightSync": {"mode": "async"}, "algorithm": {"steps": args.steps},
                        "rollout": {"asyncEngine": args.engine}})
    from rlhf_api.models import RuntimeConfig

    cfg = RuntimeConfig(name="bench-async", namespace="bench", uid="bench", spec=spec)
    (work / "job.json").write_text(cfg.model_dump_json(by_alias=True))
    progress = work / "progress.jsonl"
    progress.unlink(missing_ok=True)
    env = {**os.environ, **SAFE_ENV}
    if gpu:  # batch-invariant kernels are Triton (GPU) kernels
        env["VLLM_BATCH_INVARIANT"] = "1"
    cmd = [sys.executable, "-m", "rlhf_testing.driver", "--config", str(work / "job.json"), "--local", "--no-report",
           "--validate", "--progress-file", str(progress), "--pause-after-tokens", str(args.pause_after_tokens)]
    t = time.perf_counter()
    with open(Path(args.out) / f"gpu_async_{args.engine}_{args.model}.log", "wb") as log:
        try:
            code = subprocess.run(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=args.timeout,
                                  check=False).returncode
        except subprocess.TimeoutExpired:
            code = "timeout"
    result["driver_exit"] = code
    result["wall_s"] = time.perf_counter() - t
    records = [json.loads(x) for x in progress.read_text().splitlines() if x.strip()] if progress.exists() else []
    validation = [r["validation"] for r in records if "validation" in r]
    result["validation"] = {k: validation[0].get(k) for k in ("validated", "prompts", "engines", "mismatched")} \
        if validation else None
    steps = [r for r in records if "train" in r]
    result["steps"] = [{"step": r.get("step"), "sync": r.get("sync"), "swap": r.get("swap"),
                        "throughput": r.get("throughput"), "tokens": r.get("tokens")} for r in steps]
    result["final_state"] = records[-1].get("runtime", {}).get("state") if records else None
    result["status"] = "ok" if code == 0 and validation and validation[0]["validated"] else "failed"
    out.write_text(json.dumps(result, indent=1, default=str))
    for s in result["steps"]:
        sync, swap = s["sync"] or {}, s["swap"] or {}
        print(f"step {s['step']}: sync {sync.get('total_s', 0) * 1e3:.1f} ms (pause {sync.get('pause_s', 0) * 1e3:.1f},"
              f" resume {sync.get('resume_s', 0) * 1e3:.1f}), mixed samples {swap.get('mixed_samples')}, "
              f"tokens before/after swap {swap.get('tokens_before_swap')}/{swap.get('tokens_after_swap')}")
    print(f"driver exit {code}, validation {result['validation']}, state {result['final_state']}, "
          f"{result['wall_s']:.0f}s")
    return 0 if result["status"] == "ok" else 1


if __name__ == "__main__":
    sys.exit(main())
