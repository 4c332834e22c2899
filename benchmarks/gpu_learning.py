"""Learning, shown: a small decoder is taught multi-digit addition, then GRPO improves it through the runtime.

No hub download. The benchmark

1. builds a small Qwen3-shaped decoder (random init, ``--hidden``/``--layers``) with the character tokenizer
   of ``rlhf_testing.tiny`` and trains it supervised on ``"042+517="`` -> ``"559"`` + EOS (loss on the answer
   only; float32 weights, bfloat16 autocast on a GPU) until its greedy exact-match on held-out problems reaches
   ``--sft-target`` (clearly above 0, far below 100 %: a model worth improving), then saves it in the job's
   dtype;
2. writes GRPO data from problems the supervised phase never saw: a training file and a held-out eval file
   (JSON lines with ``prompt`` and ``answer``), disjoint from each other;
3. runs the runtime's own driver on it, once per variant and seed (``python -m rlhf_runtime.driver --local``:
   local Ray, a vLLM engine, the trainer, the job's weight sync; reward ``exactMatch``; ``spec.data.eval``
   scored greedily every ``--eval-every`` steps), and reads accuracy and wall-clock per step from the
   driver's progress file.

Variants share the checkpoint, data, seeds, hyperparameters and steps and differ in one field:
``trainer.masterWeights`` ``float32`` (float32 master weights, the default since 2026-11-26) vs ``none``
(AdamW updates the bfloat16 weights in place: the trainer before); the variant ``autocast`` is ``float32`` with
``trainer.autocast`` (float32 weights, forward passes under bfloat16 autocast: TRL's own precision). Runs are
interleaved (seed by seed).

With ``--trl-python PY`` every seed also runs TRL's ``GRPOTrainer`` (vLLM colocate) from the same checkpoint,
prompts (in the driver's order), reward, batch, sampling, hyperparameters and steps, through
``benchmarks/trl_learning_run.py`` under ``PY`` (a Python that has TRL), right after the runtime's runs of that
seed. Then both sides are scored by one function, ``greedy_accuracy`` on the policy's weights in bfloat16: the
runtime's run exports every ``--eval-every`` steps (``spec.output``), scored here after the run, TRL's run scores
its trainer's weights in a callback; the runtime's own ``status.eval`` (vLLM greedy) is kept beside it. Wall-clock
on both sides counts from the launch of the side's process (the driver; TRL's script).

Writes ``<out>/learning_<device>.json`` (``learning_trl_<device>.json`` with ``--trl-python``: command, device,
date, the supervised history, every run's per-step records, the runtime's start-up phases) and prints a table.

    . benchmarks/gpu_env.sh && python3 benchmarks/gpu_learning.py --out $OUT      # one GPU, colocated
    python3 benchmarks/gpu_learning.py --cpu --out /tmp/learning                  # smoke test on CPU
    . benchmarks/gpu_env.sh /tmp/site-0.31.0 && python3 benchmarks/gpu_learning.py --out $OUT \
        --variants float32 --resident --trl-python python3 --grpo-steps 30 --seeds 0,1,2   # beside TRL
    # the same with the engine built beside the trainer (an explicit KV cache size): --kv-cache-gib 1
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT.parent / "operator"))
sys.path.insert(0, str(ROOT))
import harness

VOCAB = 64  # the character tokenizer's size (rlhf_testing.tiny.build_tokenizer)
EOS, PAD = 3, 0


# ------------------------------------------------------------------------------------------------ the task
def problems(digits: int, seed: int, n: int, exclude: set[str] | frozenset[str] = frozenset()) -> list[tuple[str, str]]:
    """``n`` distinct addition problems ``("042+517=", "559")`` not in ``exclude`` (zero-padded operands, so every
    prompt has the same length; the answer is not padded)."""
    rng, seen, out = random.Random(seed), set(exclude), []
    top = 10 ** digits
    if n > top * top - len(seen):
        raise ValueError(f"{n} problems of {digits} digits do not exist")
    while len(out) < n:
        a, b = rng.randrange(top), rng.randrange(top)
        prompt = f"{a:0{digits}d}+{b:0{digits}d}="
        if prompt not in seen:
            seen.add(prompt)
            out.append((prompt, str(a + b)))
    return out


def write_jsonl(path: Path, rows: list[tuple[str, str]]) -> Path:
    path.write_text("".join(json.dumps({"prompt": p, "answer": a}) + "\n" for p, a in rows))
    return path


# ------------------------------------------------------------------------------------------------ supervised
def build(path: Path, hidden: int, layers: int, seed: int) -> Any:
    import torch
    from rlhf_testing.tiny import build_tokenizer
    from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=3 * hidden, num_hidden_layers=layers,
                      num_attention_heads=hidden // 64, num_key_value_heads=max(1, hidden // 128), head_dim=64,
                      max_position_embeddings=64, rope_theta=10000.0, tie_word_embeddings=False,
                      bos_token_id=2, eos_token_id=EOS, pad_token_id=PAD)
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(cfg)
    build_tokenizer(path, VOCAB)
    return model, AutoTokenizer.from_pretrained(str(path))


def encode(tok: Any, rows: list[tuple[str, str]], device: Any) -> tuple[Any, Any]:
    """Right-padded ``prompt + answer + EOS`` ids and a mask of the positions whose next token is scored (the
    answer and EOS)."""
    import torch

    seqs, masks = [], []
    for prompt, answer in rows:
        p, a = tok.encode(prompt, add_special_tokens=False), tok.encode(answer, add_special_tokens=False) + [EOS]
        seqs.append(p + a)
        masks.append([0] * (len(p) - 1) + [1] * len(a))
    width = max(map(len, seqs))
    ids = torch.tensor([s + [PAD] * (width - len(s)) for s in seqs], device=device)
    mask = torch.tensor([m + [0] * (width - 1 - len(m)) for m in masks], device=device, dtype=torch.float32)
    return ids, mask


def greedy_accuracy(model: Any, tok: Any, rows: list[tuple[str, str]], device: Any, max_new: int) -> float:
    """Exact match of greedy answers (every prompt has the same length, so one batch without padding)."""
    import torch

    correct = 0
    with torch.no_grad(), torch.autocast(device.type, torch.bfloat16, enabled=device.type == "cuda"):
        for i in range(0, len(rows), 512):
            chunk = rows[i:i + 512]
            ids = torch.tensor([tok.encode(p, add_special_tokens=False) for p, _ in chunk], device=device)
            done = torch.zeros(len(chunk), dtype=torch.bool, device=device)
            out = []
            for _ in range(max_new):
                nxt = model(input_ids=ids, use_cache=False).logits[:, -1].argmax(-1)
                nxt = torch.where(done, torch.full_like(nxt, EOS), nxt)
                done |= nxt == EOS
                out.append(nxt)
                ids = torch.cat([ids, nxt[:, None]], 1)
                if bool(done.all()):
                    break
            gen = torch.stack(out, 1).tolist()
            for (_, answer), g in zip(chunk, gen):
                g = g[:g.index(EOS)] if EOS in g else g
                correct += tok.decode(g, skip_special_tokens=True).strip() == answer
    return correct / len(rows)


def supervised(a: argparse.Namespace, path: Path, train: list[tuple[str, str]], held: list[tuple[str, str]],
               grpo_eval: list[tuple[str, str]]) -> dict[str, Any]:
    """Train until the held-out greedy exact-match reaches ``--sft-target`` (or ``--sft-max-steps``); save the
    model in the job's dtype, and score the saved weights on the GRPO eval set (the runs' step 0). Returns the
    history."""
    import torch

    device = torch.device("cpu" if a.cpu else "cuda")
    model, tok = build(path, a.hidden, a.layers, a.seed)
    model.to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=a.sft_lr, weight_decay=0.0, betas=(0.9, 0.98))
    rng = random.Random(a.seed)
    history, t0, step, acc = [], time.perf_counter(), 0, 0.0
    max_new = a.digits + 2
    while step < a.sft_max_steps:
        step += 1
        ids, mask = encode(tok, rng.sample(train, a.sft_batch), device)
        loss = harness.masked_lm_step(model, opt, ids, mask, a.sft_lr * min(1.0, step / 100), not a.cpu)
        if step % a.sft_eval_every == 0:
            model.eval()
            acc = greedy_accuracy(model, tok, held, device, max_new)
            model.train()
            history.append({"step": step, "loss": round(loss.item(), 4), "held_out_exact_match": acc,
                            "seconds": round(time.perf_counter() - t0, 1)})
            print(f"sft step {step}: loss {loss.item():.4f} held-out exact match {acc:.3f}", flush=True)
            if acc >= a.sft_target:
                break
    dtype = torch.float32 if a.cpu else torch.bfloat16
    model.to(dtype).save_pretrained(str(path))
    model.generation_config.save_pretrained(str(path))
    model.eval()
    start = greedy_accuracy(model, tok, grpo_eval, device, max_new)
    print(f"saved in {dtype}: exact match on the GRPO eval set {start:.3f}", flush=True)
    params = sum(p.numel() for p in model.parameters())
    return {"steps": step, "params": params, "final_held_out_exact_match": acc, "history": history,
            "grpo_eval_exact_match_at_start": start,
            "seconds": round(time.perf_counter() - t0, 1), "saved_dtype": str(dtype).split(".")[-1]}


# ------------------------------------------------------------------------------------------------ GRPO
def spec(a: argparse.Namespace, model: Path, train: Path, evals: Path, master: str, seed: int,
         export: Path | None = None) -> dict[str, Any]:
    gpu = not a.cpu
    return {
        "model": {"name": str(model), "dtype": a.model_dtype or ("bfloat16" if gpu else "float32")},
        "image": "local",
        "trainer": {"replicas": 1, "gpusPerReplica": 1 if gpu else 0,
                    **({"masterWeights": "float32", "autocast": True} if master == "autocast"
                       else {"masterWeights": master})},
        "rollout": {"engines": 1, "tensorParallelSize": 1, "maxModelLen": 32, "enforceEager": not a.cuda_graphs,
                    "gpuMemoryUtilization": 0.25 if gpu else 0.05,
                    **({"kvCacheMemoryGiB": a.kv_cache_gib} if a.kv_cache_gib else {}),
                    "sampling": {"temperature": 1.0, "maxTokens": a.digits + 2, "samplesPerPrompt": a.samples}},
        "placement": {"mode": "colocated" if gpu else "separate",
                      **({"colocatedSleep": False} if gpu and a.resident else {})},
        **({"weightSync": {"backend": "ipc"}} if gpu else {}),
        "algorithm": {"name": "grpo", "steps": a.grpo_steps, "promptsPerStep": a.prompts, "learningRate": a.lr,
                      "seed": seed},
        "data": {"path": str(train), "eval": {"path": str(evals), "maxPrompts": a.eval_prompts},
                 "evalEveryNSteps": a.eval_every},
        "reward": {"rule": "exactMatch"},
        "env": [{"name": "HF_HUB_OFFLINE", "value": "1"}, {"name": "TRANSFORMERS_OFFLINE", "value": "1"}],
        **({"output": {"volume": "out", "path": str(export), "everyNSteps": a.eval_every},
            "volumes": [{"name": "out", "emptyDir": {}}]} if export else {}),
    }


# the actors record's keys a start-up phase keeps (controller.job_actors.record, controller.loop.record_actors)
STARTUP_KEYS = ("engine_build_seconds", "trainer_start", "engine_start", "inputs_checked_after_s",
                "ray_connect_seconds", "placement_seconds")


def startup_phases(records: list[dict[str, Any]], launched: float) -> list[dict[str, Any]]:
    """The driver's start-up, phase by phase (its progress records before the first step), in seconds since the
    launch; the actors record with each engine's build and where the trainers' and engines' starts went (process
    created, constructor begun, imports, built), the driver's Ray start and placement, and its first actor."""
    phases = []
    for r in records:
        if r.get("throughput") or r.get("step"):
            continue
        actors = r.get("actors") or {}
        phases.append({"since_launch": round(r["time"] - launched, 2), "state": (r.get("runtime") or {}).get("state"),
                       "message": (r.get("runtime") or {}).get("message") or ",".join(k for k in r if k != "time"),
                       **{k: actors[k] for k in STARTUP_KEYS if k in actors},
                       **({"first_actor_since_launch": round(actors["first_asked"] - launched, 2)}
                          if actors.get("first_asked") else {})})
    return phases


def grpo(a: argparse.Namespace, tmp: Path, model: Path, train: Path, evals: Path, master: str, seed: int,
         scorer: Any = None) -> dict[str, Any]:
    """One run of the runtime's driver. With ``scorer`` (``path -> exact match``), the run exports every
    ``--eval-every`` steps and at the end, and each export is scored after the run."""
    from rlhf_api.models import RuntimeConfig

    name = f"grpo-{master}-seed{seed}"
    cfg = tmp / f"{name}.json"
    export = tmp / f"{name}-export" if scorer else None
    job = spec(a, model, train, evals, master, seed, export)
    cfg.write_text(RuntimeConfig(name=name, namespace="bench", uid=name, spec=job).model_dump_json(by_alias=True))
    progress, log = tmp / f"{name}.progress.jsonl", tmp / f"{name}.log"
    cmd = [sys.executable, "-m", "rlhf_runtime.driver", "--config", str(cfg), "--local", "--no-report",
           "--progress-file", str(progress)]
    launched = time.time()
    t0 = time.perf_counter()
    with log.open("w") as out:
        rc = subprocess.run(cmd, check=False, stdout=out, stderr=subprocess.STDOUT, timeout=a.run_timeout,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"}).returncode
    wall = time.perf_counter() - t0
    records = [json.loads(line) for line in progress.read_text().splitlines() if line.strip()] if progress.exists() else []
    start = next((r["time"] for r in records), None)
    steps, evals_seen = [], {}
    for r in records:
        if "eval" in r:  # the driver's record: the status' eval with the completions (snake_case keys)
            ev = r["eval"]
            evals_seen[ev["step"]] = (ev.get("reward_mean", ev.get("rewardMean")), round(r["time"] - launched, 2))
        tp, train_stats = r.get("throughput"), r.get("train") or {}
        if tp and (r.get("runtime") or {}).get("state") == "Running":
            steps.append({"step": r["step"], "seconds": round(r["time"] - start, 2),
                          "since_launch": round(r["time"] - launched, 2),
                          "reward_mean": tp.get("rewardMean"), "step_seconds": tp.get("stepSeconds"),
                          **{k: train_stats[k] for k in ("loss", "entropy", "mismatch_kl", "grad_norm")
                             if k in train_stats}})
    phases = startup_phases(records, launched)
    out = {"side": "runtime", "variant": master, "seed": seed, "model_dtype": job["model"]["dtype"],
           "exit_code": rc, "wall_seconds": round(wall, 1),
           "eval": [{"step": s, "exact_match": v, "since_launch": t} for s, (v, t) in sorted(evals_seen.items())],
           "startup": phases, "steps": steps}
    if scorer and export and export.exists():
        t1, scored = time.perf_counter(), []
        for d in sorted(export.iterdir(), key=lambda d: (d.name != "final", d.name)):
            if d.name == "final":
                step = a.grpo_steps
            elif d.name.startswith("step-"):
                step = int(d.name[5:])
            else:
                continue
            scored.append({"step": step, "exact_match": scorer(d)})
        out["export_eval"] = sorted(scored, key=lambda e: e["step"])
        out["export_scoring_seconds"] = round(time.perf_counter() - t1, 1)
    if rc != 0:
        out["log_tail"] = log.read_text(errors="replace").splitlines()[-40:]
    print(f"{name}: exit {rc} in {wall:.0f}s; eval " +
          " ".join(f"{e['step']}:{e['exact_match']:.3f}" for e in out["eval"]) +
          ("; exports " + " ".join(f"{e['step']}:{e['exact_match']:.3f}" for e in out.get("export_eval", []))),
          flush=True)
    return out


def trl(a: argparse.Namespace, tmp: Path, model: Path, train_rows: list[tuple[str, str]],
        eval_rows: list[tuple[str, str]], seed: int) -> dict[str, Any]:
    """One run of TRL's GRPOTrainer (``trl_learning_run.py`` under ``--trl-python``) on the same work: the
    prompts in the order the driver takes them for ``seed``."""
    from rlhf_runtime.algo.data import Sample, step_batch

    samples = [Sample(prompt=p, answer=ans) for p, ans in train_rows]
    order = [(s.prompt, s.answer) for step in range(a.grpo_steps)
             for s in step_batch(samples, step, a.prompts, seed)]
    name = f"trl-seed{seed}"
    work_file, out_file, log = tmp / f"{name}.work.json", tmp / f"{name}.json", tmp / f"{name}.log"
    launched = time.time()
    work_file.write_text(json.dumps({
        "model": str(model), "train": order, "eval": eval_rows, "steps": a.grpo_steps, "prompts_per_step": a.prompts,
        "samples_per_prompt": a.samples, "max_tokens": a.digits + 2, "temperature": 1.0, "learning_rate": a.lr,
        "clip": 0.2, "gpu_memory_utilization": 0.25, "max_model_len": 32, "micro_batch": a.trl_micro_batch,
        "device": "cpu" if a.cpu else "cuda", "use_vllm": not a.trl_no_vllm, "seed": seed,
        "eval_every": a.eval_every, "launched": launched}))
    cmd = [a.trl_python, str(ROOT / "trl_learning_run.py"), str(work_file), str(out_file)]
    t0 = time.perf_counter()
    with log.open("w") as out:
        try:
            rc = subprocess.run(cmd, check=False, stdout=out, stderr=subprocess.STDOUT, timeout=a.run_timeout,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"}).returncode
        except subprocess.TimeoutExpired:
            rc = -9
    wall = time.perf_counter() - t0
    got = json.loads(out_file.read_text()) if out_file.exists() else {}
    res = {"side": "trl", "variant": "trl", "seed": seed, "exit_code": rc, "wall_seconds": round(wall, 1),
           "use_vllm": not a.trl_no_vllm, "versions": got.get("versions"),
           "eval": got.get("eval", []), "steps": [{**s, "since_launch": s["seconds"]} for s in got.get("steps", [])],
           **{k: got[k] for k in ("imported_at", "trainer_ready", "train_begin", "train_seconds", "finished",
                                  "error", "traceback") if k in got}}
    if rc != 0:
        res["log_tail"] = log.read_text(errors="replace").splitlines()[-60:]
    print(f"{name}: exit {rc} in {wall:.0f}s; eval " +
          " ".join(f"{e['step']}:{e['exact_match']:.3f}" for e in res["eval"]) +
          (f"; error {res['error'][:300]}" if "error" in res else ""), flush=True)
    return res


def startup_line(run: dict[str, Any]) -> str:
    """One line of where a runtime run's start went, in seconds since launch: the first actor asked for, the
    driver's check of the tokenizer and the model's config (where recorded), the trainer's process, constructor
    and ready, vLLM's weight-transfer import, the engine's process, vLLM import and build end, the first step
    (from the progress file's actors record, ``controller.job_actors``)."""
    rec = next((p for p in run.get("startup") or [] if p.get("first_actor_since_launch") is not None), None)
    steps = run.get("steps") or []
    first = f"first step {steps[0]['since_launch']}" if steps else "no step"
    if rec is None:
        return f"start-up {run['variant']} seed {run['seed']}: no actors record; {first}"
    t0, tr, en = rec["first_actor_since_launch"], rec.get("trainer_start") or {}, rec.get("engine_start") or {}

    def rank0(d: dict[str, Any], key: str, missing: Any = None) -> Any:
        """Rank 0's value of a per-rank list in the record (``missing`` when absent)."""
        return (d.get(key) or [missing])[0]

    def at(origin: float, after: float | None) -> str:
        return "?" if after is None else f"{origin + after:.1f}"

    t_ask, e_ask = t0 + tr.get("asked_after_s", 0), t0 + en.get("asked_after_s", 0)
    began, init = rank0(tr, "init_began_after_s"), rank0(tr, "init_seconds")
    ready = "?" if began is None or init is None else f"{t_ask + began + init:.1f}"
    checked = rec.get("inputs_checked_after_s")
    inputs = "" if checked is None else f", tokenizer and config checked {t0 + checked:.1f}"
    ray = "".join(f"{name} {rec[key]} s, " for name, key in (("Ray connect", "ray_connect_seconds"),
                                                                ("placement", "placement_seconds")) if key in rec)
    return (f"start-up {run['variant']} seed {run['seed']} (s since launch): {ray}actors asked {t0:.1f}{inputs}; "
            f"trainer 0 process {at(t_ask, rank0(tr, 'spawned_after_s'))}, constructor {at(t_ask, began)}, "
            f"ready {ready}, vLLM transfer import {rank0(tr, 'weight_transfer_import_seconds', '?')} s; engine 0 process "
            f"{at(e_ask, rank0(en, 'spawned_after_s'))}, vLLM import {rank0(en, 'import_seconds', '?')} s, built "
            f"{at(e_ask, rank0(en, 'built_after_s'))}; {first}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--digits", type=int, default=3)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--seed", type=int, default=0, help="the supervised phase's seed")
    p.add_argument("--sft-lr", type=float, default=1e-3)
    p.add_argument("--sft-batch", type=int, default=256)
    p.add_argument("--sft-target", type=float, default=0.3, help="stop supervised training at this exact match")
    p.add_argument("--sft-max-steps", type=int, default=20000)
    p.add_argument("--sft-eval-every", type=int, default=100)
    p.add_argument("--grpo-steps", type=int, default=60)
    p.add_argument("--prompts", type=int, default=64, help="algorithm.promptsPerStep")
    p.add_argument("--samples", type=int, default=8, help="rollout.sampling.samplesPerPrompt")
    p.add_argument("--lr", type=float, default=2e-5, help="algorithm.learningRate")
    p.add_argument("--eval-prompts", type=int, default=512)
    p.add_argument("--eval-every", type=int, default=5)
    p.add_argument("--variants", default="float32,none",
                   help="trainer.masterWeights values, or autocast (float32 with trainer.autocast)")
    p.add_argument("--model-dtype", default="", choices=["", "bfloat16", "float32"],
                   help="model.dtype of the runtime's runs (default bfloat16 on a GPU, float32 on CPU); float32 on a "
                        "GPU tells whether precision explains the runtime's step-30 gap to TRL (whose trainer keeps "
                        "float32 weights under bfloat16 autocast), the engine then sampling in float32 too")
    p.add_argument("--seeds", default="0,1", help="algorithm.seed of the GRPO runs")
    p.add_argument("--model-dir", default="", help="the supervised checkpoint's folder: made there unless it holds "
                   "one already (then reused; the data are the same for the same --digits)")
    p.add_argument("--run-timeout", type=float, default=900)
    p.add_argument("--resident", action="store_true",
                   help="placement.colocatedSleep: false (the engine stays resident, as TRL's colocate mode keeps it)")
    p.add_argument("--kv-cache-gib", type=float, default=0,
                   help="rollout.kvCacheMemoryGiB of the runtime's runs: a colocated engine given its KV cache size "
                        "is built beside the trainer instead of after it (0: vLLM sizes it from "
                        "gpuMemoryUtilization, as TRL's engine does)")
    p.add_argument("--cuda-graphs", action="store_true",
                   help="rollout.enforceEager: false (the engine compiles and captures CUDA graphs; default eager)")
    p.add_argument("--trl-python", default="", help="also run TRL's GRPOTrainer per seed under this Python")
    p.add_argument("--trl-micro-batch", type=int, default=64, help="TRL's per_device_train_batch_size")
    p.add_argument("--trl-no-vllm", action="store_true",
                   help="TRL without vLLM: a CPU smoke test of the plumbing only, never the comparison")
    p.add_argument("--sides", default="runtime,trl", help="with --trl-python: which sides run, in this order per seed")
    p.add_argument("--cpu", action="store_true", help="smoke run on CPU (a smaller model, fewer steps)")
    p.add_argument("--out", default="")
    a = p.parse_args()
    if a.cpu:
        a.digits, a.hidden, a.layers, a.sft_batch, a.sft_max_steps, a.sft_eval_every = 2, 128, 2, 128, 3000, 100
        a.grpo_steps, a.prompts, a.eval_prompts, a.eval_every = min(a.grpo_steps, 10), 16, 128, 5
    import torch

    tmp = Path(tempfile.mkdtemp(prefix="learning-"))
    model = Path(a.model_dir) if a.model_dir else tmp / "model"
    result: dict[str, Any] = {"command": shlex.join(sys.argv), "date": time.strftime("%Y-%m-%d"),
                              "device": "cpu" if a.cpu else torch.cuda.get_device_name(0), "torch": torch.__version__,
                              "task": f"{a.digits}-digit addition, exact match", "args": vars(a)}
    try:
        import vllm
        result["vllm"] = vllm.__version__
    except ImportError as e:
        result["vllm"] = f"not importable here: {e}"
    # disjoint problem sets: supervised training, its held-out check, GRPO training prompts, GRPO eval
    held = problems(a.digits, 1, 512)
    grpo_eval = problems(a.digits, 2, a.eval_prompts, exclude={q for q, _ in held})
    taken = {q for q, _ in held + grpo_eval}
    grpo_train = problems(a.digits, 3, min(4096, (10 ** a.digits) ** 2 // 4), exclude=taken)
    taken |= {q for q, _ in grpo_train}
    if not (model / "supervised.json").exists():
        sft_train = problems(a.digits, 4, min(200_000, (10 ** a.digits) ** 2 - len(taken)), exclude=taken)
        model.mkdir(parents=True, exist_ok=True)
        result["supervised"] = supervised(a, model, sft_train, held, grpo_eval)
        (model / "supervised.json").write_text(json.dumps(result["supervised"]))
    else:
        result["supervised"] = json.loads((model / "supervised.json").read_text())
    train_file, eval_file = write_jsonl(tmp / "train.jsonl", grpo_train), write_jsonl(tmp / "eval.jsonl", grpo_eval)
    result["runs"] = []

    def save() -> None:
        if a.out:
            Path(a.out).mkdir(parents=True, exist_ok=True)
            dev = "cpu" if a.cpu else result["device"].lower().replace("nvidia ", "").replace(" ", "-")
            tag = "_trl" if a.trl_python else ""
            (Path(a.out) / f"learning{tag}_{dev}.json").write_text(json.dumps(result, indent=1))

    scorer = None
    if a.trl_python:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        device = torch.device("cpu" if a.cpu else "cuda")
        tok = AutoTokenizer.from_pretrained(str(model))

        def scorer(path: Path) -> float:
            m = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.bfloat16).to(torch.float32).to(device)
            return greedy_accuracy(m.eval(), tok, grpo_eval, device, a.digits + 2)

        result["scorer"] = ("gpu_learning.greedy_accuracy on the policy's weights in bfloat16 (upcast to float32, "
                            "bfloat16 autocast on a GPU), the GRPO eval set")
        result["step0_exact_match"] = scorer(model)
    save()
    sides = a.sides.split(",") if a.trl_python else ["runtime"]
    for seed in (int(s) for s in a.seeds.split(",")):
        for side in sides:
            if side == "trl":
                result["runs"].append(trl(a, tmp, model, grpo_train, grpo_eval, seed))
                save()
                continue
            for master in a.variants.split(","):
                result["runs"].append(grpo(a, tmp, model, train_file, eval_file, master, seed, scorer))
                save()
    print(f"\nsupervised: {result['supervised']['steps']} steps, held-out exact match "
          f"{result['supervised']['final_held_out_exact_match']:.3f}")
    print(f"{'variant':10} {'seed':>4} {'first eval':>10} {'last eval':>9} {'wall s':>7}")
    for r in result["runs"]:
        ev = r["eval"]
        print(f"{r['variant']:10} {r['seed']:>4} {ev[0]['exact_match'] if ev else float('nan'):>10.3f} "
              f"{ev[-1]['exact_match'] if ev else float('nan'):>9.3f} {r['wall_seconds']:>7.0f}")
    for master in a.variants.split(",") + (["trl"] if a.trl_python else []):
        last = [r["eval"][-1]["exact_match"] for r in result["runs"] if r["variant"] == master and r["eval"]]
        if last:
            print(f"{master}: last eval median {statistics.median(last):.3f} (min {min(last):.3f}, max {max(last):.3f})")
    for r in result["runs"]:
        if r["side"] == "runtime":
            print(startup_line(r))
    if a.trl_python:
        print("same scorer (greedy_accuracy, bfloat16 weights) per step:")
        for r in result["runs"]:
            ev = r.get("export_eval") if r["side"] == "runtime" else r["eval"]
            print(f"  {r['variant']:8} seed {r['seed']}: " + " ".join(f"{e['step']}:{e['exact_match']:.3f}"
                                                                   for e in ev or []) + f"  wall {r['wall_seconds']}s")


if __name__ == "__main__":
    main()
