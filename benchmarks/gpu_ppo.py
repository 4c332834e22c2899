"""PPO with every role on GPUs: the real driver (``python -m rlhf_runtime.driver --local``) on a job whose policy
and critic train beside a reference and a reward model, with per-role times from its progress file.

Layout on two GPUs (``separate`` placement): GPU 0 holds the trainer (actor), the critic, the reference and the
reward model, each a Ray actor colocated on the trainer's bundle (a quarter GPU share each); GPU 1 holds one
vLLM engine (TP=1), synced over NCCL every step. Models: a policy from a real architecture config
(``harness.MODELS``, random weights, no hub) and a reward model of the same architecture with a one-output
sequence-classification head (random weights: the scores carry no meaning here, the throughput does). The
first sync is checked against a fresh engine (``weightSync.validate``) and the trained model is exported in
Hugging Face format at the end and checked against the synced engine the same way.

Writes ``<out>/gpu_ppo_<model>.json`` (device kind, date, exact command, the spec, per-step role times) and
prints a table. ``--cpu`` runs the same on CPU with the tiny model (a smoke test, no GPU).

    . benchmarks/gpu_env.sh && python3 benchmarks/gpu_ppo.py --kind nvidia-h200-x2 --out $OUT --model qwen2-0.5b
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))

import harness
from harness import MODELS, build_model

ROLE_KEYS = ("stepSeconds", "rolloutSeconds", "rewardSeconds", "referenceSeconds", "criticSeconds", "trainSeconds",
             "weightSyncSeconds", "rolloutTokensPerSecond")


def job_spec(model: Path, rm: Path, out: Path, args: argparse.Namespace) -> dict[str, Any]:
    gpu = not args.cpu
    prompts = [f"question {i}: what is {i} + {i * 7 % 13}?" for i in range(args.prompts)]
    return {
        "model": {"name": str(model), "dtype": "bfloat16" if gpu else "float32"},
        "image": "local",
        "trainer": {"replicas": 1, "gpusPerReplica": 1 if gpu else 0},
        "rollout": {"engines": 1, "tensorParallelSize": 1, "gpuMemoryUtilization": 0.5 if gpu else 0.05,
                    "maxModelLen": 1024 if gpu else 96,
                    "sampling": {"temperature": 1.0, "maxTokens": args.max_tokens, "samplesPerPrompt": args.samples}},
        "placement": {"mode": "separate", "gpusPerNode": 8},
        "weightSync": {"backend": "nccl", "validate": True},
        "algorithm": {"name": "ppo", "steps": args.steps, "promptsPerStep": args.prompts, "learningRate": 1e-6,
                      "klCoef": 0.01, "klMode": "reward", "ppo": {"criticLearningRate": 1e-6}},
        "data": {"prompts": prompts},
        "reward": {"model": {"name": str(rm), "placement": "colocated", "batchSize": 64}},
        "critic": {"placement": "colocated"},
        "reference": {"placement": "colocated"},
        "output": {"volume": "out", "path": str(out)},
        "volumes": [{"name": "out", "emptyDir": {}}],
        "progressDeadlineSeconds": 1200,
        "env": [{"name": "HF_HUB_OFFLINE", "value": "1"}, {"name": "TRANSFORMERS_OFFLINE", "value": "1"}],
    }


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen2-0.5b", choices=sorted(MODELS))
    p.add_argument("--kind", default="unknown", help="the device kind, recorded in the results")
    p.add_argument("--out", default=str(ROOT / "results" / "learning"))
    p.add_argument("--work", default="/tmp/rlhf-gpu-ppo")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--samples", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--timeout", type=float, default=540)
    p.add_argument("--cpu", action="store_true", help="CPU smoke test (tiny model, gloo)")
    args = p.parse_args()
    if args.cpu:
        args.model = "tiny"
    return args


def summary(records: list[dict[str, Any]]) -> dict[str, Any]:
    """From the driver's progress records: the first sync's and the export's validation, every step's role times,
    the final state, and the medians after step 1."""
    steps = [r for r in records if "throughput" in r and r["runtime"]["state"] == "Running" and "train" in r]
    validation = next((r["validation"] for r in records if "validation" in r), None)
    exported = next((r["export_validation"] for r in records if "export_validation" in r), None)
    out: dict[str, Any] = {
        "first_sync_validated": bool(validation and validation["validated"]),
        "export_validated": bool(exported and exported["validated"]),
        "steps": [{"step": r["step"], **{k: r["throughput"].get(k) for k in ROLE_KEYS},
                   "tokens": r.get("tokens"), "value_loss": r["train"].get("value_loss"),
                   "kl_in_reward": r["train"].get("kl_in_reward")} for r in steps],
        "final_state": records[-1]["runtime"]["state"] if records else None,
        "final_message": records[-1]["runtime"].get("message") if records else None,
    }
    later = out["steps"][1:] or out["steps"]
    out["median_after_step_1"] = {k: statistics.median([s[k] for s in later if s.get(k) is not None] or [0])
                                  for k in ROLE_KEYS}
    return out


def main() -> int:
    args = parse()
    work, out = Path(args.work), Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    model_info = build_model(work / "policy", args.model, not args.cpu)
    # the policy's architecture with a one-output sequence-classification head, random weights
    rm_info = build_model(work / "rm", args.model, not args.cpu, head="ForSequenceClassification", seed=1,
                          num_labels=1)
    build_s = time.time() - t0
    spec = job_spec(work / "policy", work / "rm", work / "export", args)
    ran, records = harness.run_driver(spec, work, name="gpu-ppo", timeout=args.timeout)
    log = out / f"gpu_ppo_{args.model}.log"
    shutil.copyfile(ran["log"], log)
    prov = harness.provenance()
    result = {"benchmark": "gpu_ppo", "device": args.kind, "date": prov["date"], "command": prov["command"],
              "provenance": prov, "exit_code": ran["exit"], "driver_wall_s": round(ran["seconds"], 1),
              "build_s": round(build_s, 1), "model": {"policy": model_info, "reward_model": rm_info}, "spec": spec,
              **summary(records)}
    path = harness.write_result(out / f"gpu_ppo_{args.model}.json", result)
    print(f"exit {ran['exit']}, driver {ran['seconds']:.0f}s, validated first sync {result['first_sync_validated']}, "
          f"export {result['export_validated']}; {path}")
    print("step | " + " | ".join(ROLE_KEYS))
    for s in result["steps"]:
        print(f"{s['step']} | " + " | ".join(f"{s[k]:.3g}" if s.get(k) is not None else "-" for k in ROLE_KEYS))
    if ran["exit"] != 0:
        print("\n".join(log.read_text(errors="replace").splitlines()[-40:]))
    return ran["exit"]


if __name__ == "__main__":
    raise SystemExit(main())
