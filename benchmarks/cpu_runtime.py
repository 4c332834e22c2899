"""CPU runtime benchmark: rollout tokens/s, step-time breakdown and weight-sync GB/s of the real driver.

Builds a random-init Qwen2 locally (no hub), runs ``python -m rlhf_runtime.driver --local`` (real Ray, real
vLLM CPU engine, the gloo weight-transfer backend, a weight sync every step) and summarises the per-step
reports (medians over the steps after the first ``--warmup``). Not a test: numbers depend on the machine.

    .venv/bin/python benchmarks/cpu_runtime.py            # writes benchmarks/results/learning/cpu_runtime.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from rlhf_api.models import RuntimeConfig

ROOT = Path(__file__).resolve().parent
RESULT = ROOT / "results" / "learning" / "cpu_runtime.json"


def build_model(model: Path, hidden: int, layers: int) -> Path:
    """A random-init Qwen2 (``rlhf_testing.tiny``) at ``model``, built in a child process (torch stays out of this
    one)."""
    build = (f"from rlhf_testing.tiny import build_tiny_model; "
             f"build_tiny_model({str(model)!r}, hidden_size={hidden}, layers={layers})")
    subprocess.run([sys.executable, "-c", build], check=True)
    return model


def run_driver(spec: dict[str, Any], work: Path, log: Path | None = None,
               timeout: float | None = None) -> tuple[int, list[dict[str, Any]], float]:
    """``python -m rlhf_runtime.driver --local`` on ``spec`` in ``work`` (config and progress file there; output to
    ``log``, else discarded): (exit code, 124 past ``timeout`` seconds; progress records; wall seconds)."""
    work.mkdir(parents=True, exist_ok=True)
    cfg = work / "job.json"
    cfg.write_text(RuntimeConfig(name="bench", namespace="default", uid="bench", spec=spec).model_dump_json(by_alias=True))
    progress = work / "progress.jsonl"
    t0 = time.perf_counter()
    with open(log or os.devnull, "w") as out:
        try:
            rc = subprocess.run([sys.executable, "-m", "rlhf_runtime.driver", "--config", str(cfg), "--local",
                                 "--no-report", "--progress-file", str(progress)], stdout=out,
                                stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"}, check=False,
                                timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            rc = 124
    wall = time.perf_counter() - t0
    records = [json.loads(x) for x in progress.read_text().splitlines()] if progress.exists() else []
    return rc, records, wall


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--hidden", type=int, default=512, help="model hidden size (4 layers)")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--prompts-per-step", type=int, default=32)
    p.add_argument("--samples-per-prompt", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--bucket-mb", type=int, default=64)
    p.add_argument("--omp-threads", type=int, default=0,
                   help="spec.env OMP_NUM_THREADS for every actor (1: as every actor ran before the runtime gave "
                   "CPU jobs' actors their pod's CPUs; default: the runtime's choice)")
    p.add_argument("--out", default=str(RESULT))
    a = p.parse_args()
    command = " ".join(shlex.quote(x) for x in [".venv/bin/python", "benchmarks/cpu_runtime.py", *sys.argv[1:]])

    work = Path(tempfile.mkdtemp(prefix="rlhf-bench-"))
    model = build_model(work / "model", a.hidden, a.layers)
    spec = {
        "model": {"name": str(model), "dtype": "float32"},
        "image": "local",
        "trainer": {"replicas": 1, "gpusPerReplica": 0},
        "rollout": {"engines": 1, "tensorParallelSize": 1, "gpuMemoryUtilization": 0.05, "maxModelLen": 128,
                    "sampling": {"temperature": 1.0, "maxTokens": a.max_tokens,
                                 "samplesPerPrompt": a.samples_per_prompt}},
        "weightSync": {"backend": "nccl", "bucketSizeMB": a.bucket_mb},
        "algorithm": {"steps": a.steps, "promptsPerStep": a.prompts_per_step, "learningRate": 1e-4},
        "data": {"prompts": [f"prompt {i}:" for i in range(64)]},
        "reward": {"rule": "length", "targetLength": a.max_tokens // 2},
    }
    if a.omp_threads:
        spec["env"] = [{"name": "OMP_NUM_THREADS", "value": str(a.omp_threads)}]
    rc, records, wall = run_driver(spec, work)
    if rc:
        raise subprocess.CalledProcessError(rc, "python -m rlhf_runtime.driver")
    steps = [r for r in records if "throughput" in r and r["runtime"]["state"] == "Running"][a.warmup:]
    med = lambda xs: statistics.median(xs)
    tp = {k: med([r["throughput"][k] for r in steps]) for k in steps[0]["throughput"]}
    syncs = [r["sync"] for r in steps]
    sync = {k: med([s[k] for s in syncs]) for k in syncs[0] if isinstance(syncs[0][k], (int, float))}  # not "format"
    result = {
        "command": command,
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()},
        "model": {"hidden": a.hidden, "layers": a.layers, "param_bytes": int(sync["bytes"]), "dtype": "float32"},
        "workload": {"steps": a.steps, "measured_steps": len(steps), "prompts_per_step": a.prompts_per_step,
                     "samples_per_prompt": a.samples_per_prompt, "max_tokens": a.max_tokens,
                     "bucket_mb": a.bucket_mb, "weight_sync_backend": "gloo (CPU)",
                     "omp_threads": a.omp_threads or "the runtime's (trainer/rollout resources.cpu, capped)"},
        "median": {
            "rollout_tokens_per_second": tp["rolloutTokensPerSecond"],
            "samples_per_second": tp["samplesPerSecond"],
            "step_seconds": tp["stepSeconds"],
            "rollout_seconds": tp["rolloutSeconds"],
            "train_seconds": tp["trainSeconds"],
            "weight_sync_seconds": tp["weightSyncSeconds"],
            "weight_sync_gbps": tp["weightSyncGbps"],
            "sync_stages_seconds": {k: sync[k] for k in
                                    ("pause_s", "start_s", "gather_s", "transfer_s", "finish_s", "resume_s", "total_s")},
            "sync_transfer_gbps": sync["transfer_gbps"],
        },
        "driver_wall_seconds": wall,
    }
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(result, indent=2) + "\n")
    m = result["median"]
    print(f"rollout {m['rollout_tokens_per_second']:.0f} tokens/s, {m['samples_per_second']:.1f} samples/s")
    print(f"step {m['step_seconds']:.3f}s = rollout {m['rollout_seconds']:.3f}s + train {m['train_seconds']:.3f}s "
          f"+ sync {m['weight_sync_seconds']:.3f}s (+ scoring/bookkeeping)")
    print(f"weight sync {result['model']['param_bytes'] / 1e6:.1f} MB: {m['weight_sync_gbps']:.3f} GB/s end to end, "
          f"{m['sync_transfer_gbps']:.3f} GB/s send; stages {m['sync_stages_seconds']}")
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
