"""Peers side by side: TRL's ``GRPOTrainer`` (vLLM colocate mode), veRL's GRPO (GPU) and the runtime's GRPO on the
same work.

Same model (a random-init Qwen2 built locally, the character tokenizer of ``rlhf_testing.tiny``), prompts,
reward (the runtime's ``length`` rule: ``1 - |tokens - target| / target`` clipped at 0; TRL gets the same
function), batch (prompts per step x samples per prompt, one optimiser step per batch), sampling (temperature,
max tokens), learning rate, no KL, clip 0.2, and number of steps. The two run one after the other, ``--rounds``
times interleaved (ours, TRL, ours, TRL, ...) on this machine; each run's per-step wall times after
``--warmup`` steps give its median step time and samples/s, and the ratio ours / TRL is reported per round
and over all rounds. Not a test.

* Ours: ``python -m rlhf_runtime.driver --local`` (real Ray, real vLLM, the gloo weight sync on CPU), per-step
  ``stepSeconds`` from its progress file.
* TRL: ``benchmarks/trl_grpo_run.py`` under ``--trl-python``, a Python that has TRL (TRL is not a dependency of
  the project). A venv that sees the project's packages and adds TRL::

      python3 -m venv /tmp/trl-venv
      echo "$PWD/.venv/lib/python3.11/site-packages" > /tmp/trl-venv/lib/python3.11/site-packages/zz_project.pth
      /tmp/trl-venv/bin/python -m pip install trl==1.16.0

  If TRL's vLLM mode cannot run here, its error is the result (the issue's rule: never compare against TRL
  without vLLM).
* veRL (``--verl-python``, GPU only): ``benchmarks/verl_grpo_run.py`` under a Python that has veRL 0.9 (its
  default v1 trainer and vLLM rollout in its hybrid engine on the same GPU); per-step ``timing_s/step`` from
  veRL's own metrics. Staging and the result: benchmarks/results/learning/README.md, "veRL beside both".

    .venv/bin/python benchmarks/trl_peer.py --trl-python /tmp/trl-venv/bin/python   # results/learning/trl_peer_cpu.json

On a GPU (``--gpu MODEL``, one of ``harness.MODELS``, random weights in bf16): both on one GPU, ours in its
colocated layout (trainer and engine share the GPU, weights over CUDA IPC, the engine resident as TRL's colocate
mode keeps it: ``placement.colocatedSleep: false``), TRL with ``vllm_mode="colocate"`` and its defaults
otherwise. TRL 1.16.0 supports vLLM 0.22-0.31 and the runtime vLLM >= 0.28, so the GPU comparison runs on a
vLLM in 0.28-0.31, e.g. 0.31.0 (staged with ``hack/gpu-stage.py --vllm 0.31.0 --with trl==1.16.0``). The
comparison of 2026-11-24 in benchmarks/results/learning/README.md ran on vLLM 0.24, which the runtime no longer supports.
At a realistic size (``--prompt-tokens``, ``--sleep``, ``--gradient-checkpointing``, ``--compile``,
``--cuda-graphs``; ``hack/gpu/loop-vs-trl.sh``) one round fits a device call: run it once per call with ``--order``
alternating and pool the results with ``--merge``::

    . benchmarks/gpu_env.sh /tmp/site-0.31.0 && CUDA_VISIBLE_DEVICES=0 python3 benchmarks/trl_peer.py \
        --trl-python python3 --gpu qwen2-0.5b --kind nvidia-h200-x2 --out $OUT/trl_peer_gpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))
import harness
from cpu_runtime import build_model

RESULT = ROOT / "results" / "learning" / "trl_peer_cpu.json"


def work_of(a: argparse.Namespace, model: Path) -> dict[str, Any]:
    gpu = a.gpu is not None
    # a prompt of ``--prompt-tokens`` characters is as many tokens under the character tokenizer
    pad = "count the letters of this line " * (a.prompt_tokens // 31 + 1)
    prompts = [(f"prompt {i}: " + pad)[:a.prompt_tokens] if a.prompt_tokens else f"prompt {i}:"
               for i in range(a.prompts)]
    return {"model": str(model), "prompts": prompts, "steps": a.steps,
            "prompts_per_step": a.prompts_per_step, "samples_per_prompt": a.samples_per_prompt,
            "max_tokens": a.max_tokens, "temperature": 1.0, "learning_rate": a.learning_rate,
            "target_length": a.max_tokens // 2,
            "gpu_memory_utilization": a.gpu_memory_utilization or (0.3 if gpu else 0.05),
            "max_model_len": a.max_tokens + max(64, a.prompt_tokens + 32), "micro_batch": a.micro_batch,
            "device": "cuda" if gpu else "cpu", "dtype": "bfloat16" if gpu else "float32", "seed": 0,
            "sleep": a.sleep, "gradient_checkpointing": a.gradient_checkpointing, "compile": a.compile,
            "cuda_graphs": a.cuda_graphs}


def run_ours(work: dict[str, Any], dirpath: Path, timeout: float | None = None) -> dict[str, Any]:
    gpu = work["device"] == "cuda"
    spec = {
        "model": {"name": work["model"], "dtype": work["dtype"]},
        "image": "local",
        "trainer": {"replicas": 1, "gpusPerReplica": 1 if gpu else 0},
        "rollout": {"engines": 1, "tensorParallelSize": 1, "gpuMemoryUtilization": work["gpu_memory_utilization"],
                    "maxModelLen": work["max_model_len"],
                    "sampling": {"temperature": work["temperature"], "maxTokens": work["max_tokens"],
                                 "samplesPerPrompt": work["samples_per_prompt"]}},
        "algorithm": {"name": "grpo", "steps": work["steps"], "promptsPerStep": work["prompts_per_step"],
                      "learningRate": work["learning_rate"], "klCoef": 0.0, "clipRatio": 0.2, "seed": work["seed"]},
        "data": {"prompts": work["prompts"]},
        "reward": {"rule": "length", "targetLength": work["target_length"]},
        "env": [{"name": "HF_HUB_OFFLINE", "value": "1"}, {"name": "TRANSFORMERS_OFFLINE", "value": "1"}],
    }
    if gpu:  # one GPU shared; the engine sleeps between rollouts where TRL's does (--sleep)
        spec["placement"] = {"mode": "colocated", "colocatedSleep": work.get("sleep", False)}
        spec["weightSync"] = {"backend": "ipc"}
        spec["rollout"]["enforceEager"] = not work.get("cuda_graphs", False)
        spec["trainer"].update(gradientCheckpointing=work.get("gradient_checkpointing", False),
                               compile=work.get("compile", False), maxTokensPerMicroBatch=32768,
                               resources={"memory": "100Gi"})
    # at the limit the driver's process group is killed, its local Ray with it: nothing holds the GPU for TRL's run
    ran, records = harness.run_driver(spec, dirpath, name="driver", timeout=timeout)
    rc, wall, log = ran["exit"], ran["seconds"], ran["log"]
    running = [r for r in records if "throughput" in r and r["runtime"]["state"] == "Running"]
    steps = [r["throughput"]["stepSeconds"] for r in running]
    out: dict[str, Any] = {"ok": rc == 0 and bool(steps), "step_seconds": steps, "wall_seconds": wall,
                           "steps": [{"throughput": r["throughput"], "train": r.get("train")} for r in running]}
    plan = next((r["actors"]["memory_plan"] for r in records if (r.get("actors") or {}).get("memory_plan")), None)
    if plan:
        out["memory_plan"] = plan
    if not out["ok"]:
        out["error"] = f"driver exit {rc}: " + log.read_text(errors="replace")[-3000:]
    return out


PEERS = {"trl": "trl_grpo_run.py", "verl": "verl_grpo_run.py"}


def run_peer(peer: str, work: dict[str, Any], dirpath: Path, python: str, timeout: float | None = None) -> dict[str, Any]:
    """One peer's run (``PEERS[peer]`` under ``python``) on ``work``: its per-step wall times, or its error."""
    dirpath.mkdir(parents=True, exist_ok=True)
    (dirpath / "work.json").write_text(json.dumps(work))
    res, log = dirpath / f"{peer}.json", dirpath / f"{peer}.log"
    log.unlink(missing_ok=True)
    # in a process group of its own, killed at the limit: a peer's Ray (veRL's) ends with it and holds no GPU
    ran = harness.run_logged([python, str(ROOT / PEERS[peer]), str(dirpath / "work.json"), str(res)], log, timeout,
                             env={**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1",
                                  "TRANSFORMERS_OFFLINE": "1"})
    rc, wall = ran["exit"], ran["seconds"]
    r = json.loads(res.read_text()) if res.exists() else {"ok": False, "error": f"no result (exit {rc})"}
    out = {"ok": bool(r.get("ok")) and rc == 0, "step_seconds": [s["seconds"] for s in r.get("steps", [])],
           "wall_seconds": wall, "versions": r.get("versions"), "steps": r.get("steps", [])}
    if peer == "verl" and r.get("steps"):
        out["timing"] = [s.get("timing") for s in r["steps"]]
    if not out["ok"]:
        out["error"] = r.get("error") or f"exit {rc}"
        out["traceback"] = r.get("traceback") or log.read_text(errors="replace")[-3000:]
    return out


def generated_tokens(step: dict[str, Any], samples: int) -> float | None:
    """The tokens a step generated: ours from its rollout rate and time, TRL's from its mean completion length."""
    tp = step.get("throughput")
    if tp:  # the progress file's names
        return tp.get("rolloutTokensPerSecond", 0.0) * tp.get("rolloutSeconds", 0.0) or None
    mean = (step.get("logs") or {}).get("completions/mean_length")
    return mean * samples if mean else None


def summary(run: dict[str, Any], warmup: int, samples: int) -> dict[str, Any] | None:
    """One run's steps after ``warmup`` (``pooled`` over this run alone)."""
    return pooled([{"run": run}], "run", warmup, samples)


def pooled(rounds: list[dict[str, Any]], who: str, warmup: int, samples: int) -> dict[str, Any] | None:
    """``who``'s steps after ``warmup`` over every round it ran in: median step (min-max), samples/s, tokens/s."""
    runs = [r[who] for r in rounds if who in r and r[who]["ok"]]
    steps = [s for run in runs for s in run["step_seconds"][warmup:]]
    if not steps:
        return None
    med = statistics.median(steps)
    out = {"median_step_s": med, "min_step_s": min(steps), "max_step_s": max(steps),
           "samples_per_s": samples / med, "measured_steps": len(steps), "runs": len(runs)}
    rates = [t / s for run in runs for st, s in zip(run.get("steps", [])[warmup:], run["step_seconds"][warmup:])
             if (t := generated_tokens(st, samples))]
    if rates:
        out.update(tokens_per_s_median=statistics.median(rates), tokens_per_s_min=min(rates),
                   tokens_per_s_max=max(rates))
    tps = [st["throughput"] for run in runs for st in run.get("steps", [])[warmup:] if st.get("throughput")]
    for key, name in (("rolloutSeconds", "rollout_s"), ("trainSeconds", "train_s"), ("weightSyncSeconds", "sync_s"),
                      ("rolloutTokensPerSecond", "rollout_tokens_per_s"), ("mfu", "mfu")):
        xs = [tp[key] for tp in tps if isinstance(tp.get(key), int | float)]
        if xs:  # ours: the progress file's split of the step
            out[f"{name}_median"] = statistics.median(xs)
    return out


def overall(rounds: list[dict[str, Any]], warmup: int, samples: int, peers: list[str]) -> dict[str, Any]:
    """Every side pooled over ``rounds`` and the ratios ours / peer of samples/s and of generated tokens/s; beside
    the pooled ratio, each round's own (both sides on the same machine in the same call): median, min, max."""
    out: dict[str, Any] = {who: pooled(rounds, who, warmup, samples) for who in ["ours", *peers]}
    for peer in peers:
        o, q = out["ours"], out[peer]
        if o and q:
            out[f"samples_per_s_ratio_ours_to_{peer}"] = o["samples_per_s"] / q["samples_per_s"]
            if "tokens_per_s_median" in o and "tokens_per_s_median" in q:
                out[f"tokens_per_s_ratio_ours_to_{peer}"] = o["tokens_per_s_median"] / q["tokens_per_s_median"]
        ratios = [a["tokens_per_s_median"] / b["tokens_per_s_median"] for r in rounds
                  if (a := pooled([r], "ours", warmup, samples)) and (b := pooled([r], peer, warmup, samples))
                  and "tokens_per_s_median" in a and "tokens_per_s_median" in b]
        if ratios:
            out[f"tokens_per_s_ratio_ours_to_{peer}_by_round"] = {
                "median": statistics.median(ratios), "min": min(ratios), "max": max(ratios), "rounds": len(ratios)}
    return out


def merge(files: list[str], out: str, warmup: int) -> int:
    """One result from several runs of this script on the same work (one round per device call): their rounds in
    the order given, pooled as one run's."""
    docs = [json.loads(Path(f).read_text()) for f in files]
    works = {json.dumps({k: v for k, v in d["work"].items() if k != "model"}, sort_keys=True) for d in docs}
    if len(works) != 1:
        raise SystemExit(f"the files ran different work: {sorted(works)}")
    first = docs[0]
    rounds = [r for d in docs for r in d["rounds"]]
    peers = [p for p in PEERS if any(p in r for r in rounds)]
    commands = [c for d in docs for c in d.get("commands", [d["command"]])]  # a merged file: its runs' own
    dates = [t for d in docs for t in d.get("dates", [d["date"]])]
    orders = [c.split("--order ")[1].split()[0] for c in commands if "--order " in c]
    result = {**first, "command": commands[0] + (f" (then again with --order {' / '.join(orders[1:])}: "
                                                 f"{len(commands)} runs, merged by --merge)" if len(commands) > 1 else ""),
              "date": dates[-1], "commands": commands, "dates": dates,
              "merged_from": [Path(f).name for f in files], "rounds": rounds,
              "overall": overall(rounds, warmup, first["work"]["samples_per_step"], peers)}
    Path(out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result["overall"], indent=2))
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trl-python", help="a Python with TRL (see the module docstring)")
    p.add_argument("--verl-python", help="a Python with veRL (benchmarks/verl_grpo_run.py; GPU only)")
    p.add_argument("--verl-free-cache-engine", choices=("true", "false"), default="false",
                   help="veRL's rollout.free_cache_engine (its sleep/wake between rollouts; default false: the "
                   "engine stays resident, as ours and TRL's here)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--prompts-per-step", type=int, default=16)
    p.add_argument("--samples-per-prompt", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--learning-rate", type=float, default=1e-4)
    p.add_argument("--prompt-tokens", type=int, default=0, help="prompt length in tokens (default: ~10)")
    p.add_argument("--micro-batch", type=int, default=64, help="TRL's per_device_train_batch_size")
    p.add_argument("--gpu-memory-utilization", type=float, help="both sides' vLLM share (default 0.3 on a GPU)")
    p.add_argument("--sleep", action="store_true", help="engines sleep between rollouts on both sides (ours: "
                   "placement.colocatedSleep; TRL: vllm_enable_sleep_mode)")
    p.add_argument("--gradient-checkpointing", action="store_true", help="on both sides")
    p.add_argument("--compile", action="store_true", help="ours: trainer.compile")
    p.add_argument("--cuda-graphs", action="store_true", help="ours: CUDA graphs in the engine (TRL's vLLM "
                   "captures them by default)")
    p.add_argument("--order", choices=("ours-first", "peers-first"), default="ours-first",
                   help="who runs first in round 0; later rounds alternate")
    p.add_argument("--out", default=str(RESULT))
    p.add_argument("--gpu", metavar="MODEL", help="run on the GPU with this harness.MODELS model (bf16, random "
                   "weights) instead of the tiny CPU model")
    p.add_argument("--kind", default="cpu", help="the device kind, recorded in the results")
    p.add_argument("--timeout", type=float, help="seconds one system's run may take (then it failed)")
    p.add_argument("--merge", nargs="+", metavar="RESULT", help="pool these results' rounds into --out (runs "
                   "nothing)")
    a = p.parse_args()
    if a.merge:
        return merge(a.merge, a.out, a.warmup)
    pythons = {peer: py for peer, py in (("trl", a.trl_python), ("verl", a.verl_python)) if py}
    if not pythons:
        p.error("name at least one peer: --trl-python and/or --verl-python")
    python = ".venv/bin/python" if a.gpu is None else "python3"
    command = " ".join(shlex.quote(x) for x in [python, "benchmarks/trl_peer.py", *sys.argv[1:]])

    work_dir = Path(tempfile.mkdtemp(prefix="rlhf-trl-peer-"))
    if a.gpu is None:
        model = build_model(work_dir / "model", a.hidden, a.layers)
        model_info: dict[str, Any] = {"hidden": a.hidden, "layers": a.layers}
    else:
        model = work_dir / "model"
        model_info = harness.build_model(model, a.gpu, True)
    work = work_of(a, model)
    work["verl_free_cache_engine"] = a.verl_free_cache_engine == "true"
    samples = a.prompts_per_step * a.samples_per_prompt
    result: dict[str, Any] = {
        "command": command, "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "device": a.kind,
        "model": {"name": a.gpu or "tiny", **model_info},
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()},
        "work": {k: v for k, v in work.items() if k != "prompts"} | {"prompts": len(work["prompts"]),
                                                                      "samples_per_step": samples},
        "rounds": [],
    }
    failed: set[str] = set()
    for i in range(a.rounds):
        rnd: dict[str, Any] = {}
        order = ["ours", *[peer for peer in pythons if peer not in failed]]
        if (i + (a.order == "peers-first")) % 2:
            order.reverse()
        for who in order:
            print(f"[trl_peer] round {i}: {who}", flush=True)
            run = (run_ours(work, work_dir / f"ours-{i}", a.timeout) if who == "ours"
                   else run_peer(who, work, work_dir / f"{who}-{i}", pythons[who], a.timeout))
            rnd[who] = {**run, "summary": summary(run, a.warmup, samples)}
            print(f"[trl_peer] round {i}: {who} {rnd[who]['summary'] or rnd[who].get('error', '')[:500]}", flush=True)
            if who != "ours" and not run["ok"]:
                failed.add(who)  # it cannot run here: its error is the result; more rounds would only repeat it
            Path(a.out).write_text(json.dumps({**result, "rounds": [*result["rounds"], rnd]}, indent=2) + "\n")
        for peer in pythons:
            if rnd["ours"]["summary"] and rnd.get(peer, {}).get("summary"):
                rnd[f"samples_per_s_ratio_ours_to_{peer}"] = (rnd["ours"]["summary"]["samples_per_s"]
                                                              / rnd[peer]["summary"]["samples_per_s"])
        result["rounds"].append(rnd)
        Path(a.out).write_text(json.dumps(result, indent=2) + "\n")
        if len(failed) == len(pythons):
            break

    result["overall"] = overall(result["rounds"], a.warmup, samples, list(pythons))
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result["overall"], indent=2))
    print(f"wrote {a.out} (runs under {work_dir})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
