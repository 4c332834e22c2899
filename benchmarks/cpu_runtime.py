"""CPU runtime benchmark: rollout tokens/s, step-time breakdown and weight-sync GB/s of the real driver.

Builds a random-init Qwen2 locally (no hub), runs ``python -m rlhf_runtime.driver --local`` (real Ray, real
vLLM CPU engine, the gloo weight-transfer backend, a weight sync every step) and summarises the per-step
reports (medians over the steps after the first ``--warmup``). Not a test: numbers depend on the machine.

    .venv/bin/python benchmarks/cpu_runtime.py            # writes benchmarks/results/learning/cpu_runtime.json
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))

import harness

RESULT = ROOT / "results" / "learning" / "cpu_runtime.json"


def build_model(model: Path, hidden: int, layers: int) -> Path:
    """A random-init Qwen2 (``rlhf_testing.tiny``) at ``model``, built in a child process (torch stays out of this
    one)."""
    build = (f"from rlhf_testing.tiny import build_tiny_model; "
             f"build_tiny_model({str(model)!r}, hidden_size={hidden}, layers={layers})")
    subprocess.run([sys.executable, "-c", build], check=True)
    return model


def parse() -> argparse.Namespace:
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
    return p.parse_args()


def job_spec(a: argparse.Namespace, model: Path) -> dict[str, Any]:
    """The CPU job: one trainer and one engine, a length reward, a sync every step over gloo."""
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
    return harness.with_env(spec, {"OMP_NUM_THREADS": str(a.omp_threads)}) if a.omp_threads else spec


def medians(records: list[dict[str, Any]], warmup: int) -> tuple[int, dict[str, Any], int]:
    """Medians over the steps after ``warmup``: the step's figures (and its sync's stages), the steps measured and
    the bytes a sync sends."""
    steps = [r for r in records if "throughput" in r and r["runtime"]["state"] == "Running"][warmup:]
    tp = {k: statistics.median([r["throughput"][k] for r in steps]) for k in steps[0]["throughput"]}
    syncs = [r["sync"] for r in steps]
    sync = {k: statistics.median([s[k] for s in syncs]) for k in syncs[0]
            if isinstance(syncs[0][k], int | float)}  # not "format"
    stages = ("pause_s", "start_s", "gather_s", "transfer_s", "finish_s", "resume_s", "total_s")
    return len(steps), {
        "rollout_tokens_per_second": tp["rolloutTokensPerSecond"], "samples_per_second": tp["samplesPerSecond"],
        "step_seconds": tp["stepSeconds"], "rollout_seconds": tp["rolloutSeconds"],
        "train_seconds": tp["trainSeconds"], "weight_sync_seconds": tp["weightSyncSeconds"],
        "weight_sync_gbps": tp["weightSyncGbps"], "sync_stages_seconds": {k: sync[k] for k in stages},
        "sync_transfer_gbps": sync["transfer_gbps"]}, int(sync["bytes"])


def main() -> int:
    a = parse()
    work = Path(tempfile.mkdtemp(prefix="rlhf-bench-"))
    ran, records = harness.run_driver(job_spec(a, build_model(work / "model", a.hidden, a.layers)), work)
    if ran["exit"]:
        raise subprocess.CalledProcessError(ran["exit"], "python -m rlhf_runtime.driver")
    measured, m, sent = medians(records, a.warmup)
    prov = harness.provenance(harness.command_line(python=".venv/bin/python"))
    result = {
        "command": prov["command"], "provenance": prov,
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()},
        "model": {"hidden": a.hidden, "layers": a.layers, "param_bytes": sent, "dtype": "float32"},
        "workload": {"steps": a.steps, "measured_steps": measured, "prompts_per_step": a.prompts_per_step,
                     "samples_per_prompt": a.samples_per_prompt, "max_tokens": a.max_tokens,
                     "bucket_mb": a.bucket_mb, "weight_sync_backend": "gloo (CPU)",
                     "omp_threads": a.omp_threads or "the runtime's (trainer/rollout resources.cpu, capped)"},
        "median": m, "driver_wall_seconds": ran["seconds"],
    }
    harness.write_result(a.out, result)
    print(f"rollout {m['rollout_tokens_per_second']:.0f} tokens/s, {m['samples_per_second']:.1f} samples/s")
    print(f"step {m['step_seconds']:.3f}s = rollout {m['rollout_seconds']:.3f}s + train {m['train_seconds']:.3f}s "
          f"+ sync {m['weight_sync_seconds']:.3f}s (+ scoring/bookkeeping)")
    print(f"weight sync {sent / 1e6:.1f} MB: {m['weight_sync_gbps']:.3f} GB/s end to end, "
          f"{m['sync_transfer_gbps']:.3f} GB/s send; stages {m['sync_stages_seconds']}")
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
