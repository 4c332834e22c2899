"""Learning to use a tool, shown: a small chat model learns by multi-turn GRPO through the runtime to multiply
numbers with the builtin ``python`` tool, beside the same model and budget trained single-turn without tools.

No hub download. The benchmark

1. builds the chat model of ``rlhf_testing.tiny_chat`` (ChatML with Hermes tool calls, one token per byte) at
   ``--hidden`` / ``--layers`` from random weights;
2. trains two checkpoints from that one initialisation, supervised, with the same steps, batch and learning rate:
   *tools*: user ``What is 482*773?`` -> an assistant tool call ``python`` with ``print(482*773)`` -> the tool's
   answer -> the assistant's ``372586``; *single*: the same question -> ``372586``. Both are rendered by the
   model's chat template (with the tool's schema for *tools*, as the runtime renders a trajectory) and the loss
   is on the assistant turns only. The tools arm trains until its teacher-forced greedy accuracy (every assistant
   token the argmax: the trajectory greedy decoding makes, the tool being deterministic) reaches
   ``--sft-target``, a format learnt partly; the single arm trains the same number of steps;
3. runs GRPO through the runtime's own driver (``python -m rlhf_runtime.driver --local``) once per arm and seed
   with the same steps, prompts, sampling and learning rate: *tools* with ``spec.environment`` (the builtin python
   tool, parser hermes, at most 3 turns), *single* without; reward ``exactMatch`` on the final answer; the same
   held-out problems scored greedily before the first step (``data.evalOnStart``: each checkpoint as the
   runtime sees it) and every ``--eval-every`` steps (``status.eval``);
4. with ``--trl-python``, the peer: TRL's GRPOTrainer with the same python tool from the same tools checkpoint, on
   the same prompts in the same order, steps, sampling, batch, turns and trajectory budget
   (``trl_tool_learning_run.py``: how TRL is configured); the checkpoints it saves every ``--eval-every`` steps
   are scored by the runtime's evaluation above (a one-step run from each: its step-0 eval).

Writes ``<out>/tool_learning_<device>.json``: ``tools_accuracy`` and ``single_turn_accuracy`` (held-out, after the
last step, median over seeds), with TRL ``trl_tools_accuracy`` and both sides' step times
(``tools_step_speedup_vs_trl``: TRL's median step over the runtime's), every eval, every step's reward and the
agent's figures (turns, tool calls, faults, each step's rollout and train seconds), the supervised histories.

    . benchmarks/gpu_env.sh && python3 benchmarks/tool_learning.py --out $OUT [--trl-python python3]  # one GPU
        [--work DIR]  # keeps checkpoints and runs there: a later call with the same settings adds what is missing
    python3 benchmarks/tool_learning.py --cpu --out /tmp/tool-learning \
        [--trl-python /opt/trl-venv/bin/python --trl-no-vllm]                                  # smoke test on CPU

(A TRL venv as ``trl_peer.py`` describes, outside the temp directory: the python tool's sandbox mounts an empty
tmpfs there, which would hide the interpreter the tool runs.)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT.parent / "operator"))
sys.path.insert(0, str(ROOT))
import harness

#: The schema transformers makes of ``trl_tool_learning_run.python``'s signature and docstring, keys in its order
#: (the chat template writes them as they come), so TRL's prompts are the runtime's tokens.
PYTHON_TOOL = {"name": "python", "builtin": "python", "description": "Run Python code and see what it prints.",
               "parameters": {"type": "object", "properties": {
                   "code": {"type": "string", "description": "The Python code to run."}}, "required": ["code"]}}
#: The tools arm's ``spec.environment`` limits, which the TRL arm gets too.
MAX_TURNS, MAX_TRAJECTORY_TOKENS = 3, 600
ARMS = ("tools", "single")


# ------------------------------------------------------------------------------------------------ the task
def problems(digits: int, seed: int, n: int, exclude: frozenset[tuple[int, int]] = frozenset()
             ) -> list[tuple[int, int]]:
    """``n`` distinct pairs of ``digits``-digit operands, none in ``exclude``."""
    lo, hi = 10 ** (digits - 1), 10 ** digits
    if n > (hi - lo) ** 2 - len(exclude):
        raise ValueError(f"{n} problems of {digits} digits do not exist")
    rng, seen, out = random.Random(seed), set(exclude), []
    while len(out) < n:
        pair = (rng.randrange(lo, hi), rng.randrange(lo, hi))
        if pair not in seen:
            seen.add(pair)
            out.append(pair)
    return out


def question(a: int, b: int) -> str:
    return f"What is {a}*{b}?"


def conversation(a: int, b: int, arm: str, tool_output: str) -> list[dict[str, Any]]:
    """The target trajectory: the question, for the tools arm a python call and the tool's answer, the product."""
    user = {"role": "user", "content": question(a, b)}
    answer = {"role": "assistant", "content": str(a * b)}
    if arm == "single":
        return [user, answer]
    call = {"type": "function", "function": {"name": "python", "arguments": {"code": f"print({a}*{b})"}}}
    return [user, {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "content": tool_output.format(a * b)}, answer]


def runtime_tools() -> Any:
    """The runtime's ``Tools`` of the GRPO runs' environment (the python tool), as a rollout holds them."""
    from rlhf_api.environment import Environment
    from rlhf_runtime.agent.tools import Tools

    return Tools(Environment.model_validate({"tools": [PYTHON_TOOL]}))


def tool_output_format(tools: Any) -> str:
    """What the runtime's python tool answers to ``print(n)``, with ``{}`` for n: asked of the runtime's own
    ``tools`` as a rollout calls them, so that the supervised trajectories hold exactly the observation tokens
    GRPO's will."""
    from rlhf_runtime.agent.calls import Call

    out = asyncio.run(tools.call(Call("python", {"code": "print(12*34)"})))
    if out.error or "408" not in out.text:
        raise SystemExit(f"the python tool did not run here: {out}")
    return out.text.replace("408", "{}")


def encode(tok: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> tuple[list[int], list[int]]:
    """The conversation's token ids as the chat template renders it, and a mask of the assistant's own tokens (each
    assistant turn from after its generation prompt to its end-of-turn token, inclusive)."""
    def ids(msgs: list[dict[str, Any]], gen: bool) -> list[int]:
        text = tok.apply_chat_template(msgs, tools=tools, add_generation_prompt=gen, tokenize=False)
        return tok.encode(text, add_special_tokens=False)

    full = ids(messages, False)
    mask = [0] * len(full)
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        start, end = len(ids(messages[:i], True)), len(ids(messages[:i + 1], False))
        turn = full[start:end]
        stop = turn.index(tok.eos_token_id) + 1 if tok.eos_token_id in turn else len(turn)
        mask[start:start + stop] = [1] * stop
    return full, mask


# ------------------------------------------------------------------------------------------------ supervised
def batch_tensors(rows: list[tuple[list[int], list[int]]], device: Any) -> tuple[Any, Any]:
    """Right-padded ids and the mask of positions whose next token is scored."""
    import torch

    width = max(len(r[0]) for r in rows)
    ids = torch.tensor([r[0] + [0] * (width - len(r[0])) for r in rows], device=device)
    mask = torch.tensor([r[1][1:] + [0] * (width - len(r[1])) for r in rows], device=device, dtype=torch.float32)
    return ids, mask


def forced_accuracy(model: Any, rows: list[tuple[list[int], list[int]]], device: Any) -> float:
    """Share of conversations whose every assistant token is the model's argmax given the ones before."""
    import torch

    right = 0
    with torch.no_grad(), torch.autocast(device.type, torch.bfloat16, enabled=device.type == "cuda"):
        for i in range(0, len(rows), 256):
            ids, mask = batch_tensors(rows[i:i + 256], device)
            pred = model(input_ids=ids[:, :-1], use_cache=False).logits.argmax(-1)
            wrong = ((pred != ids[:, 1:]).float() * mask).sum(1)
            right += int((wrong == 0).sum())
    return right / len(rows)


def supervised(a: argparse.Namespace, path: Path, arm: str, train: list[Any], held: list[Any],
               steps: int | None) -> dict[str, Any]:
    """Train ``arm``'s checkpoint at ``path`` from the shared initialisation: until the held-out forced accuracy
    reaches ``--sft-target`` (``steps`` None) or for ``steps`` steps; saved in the job's dtype."""
    import torch
    from transformers import AutoModelForCausalLM

    device = torch.device("cpu" if a.cpu else "cuda")
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=a.sft_lr, weight_decay=0.0, betas=(0.9, 0.98))
    rng, history, t0, step, acc = random.Random(a.seed), [], time.perf_counter(), 0, 0.0
    limit = steps if steps is not None else a.sft_max_steps
    while step < limit:
        step += 1
        ids, mask = batch_tensors(rng.sample(train, a.sft_batch), device)
        loss = harness.masked_lm_step(model, opt, ids, mask, a.sft_lr * min(1.0, step / 50), not a.cpu)
        if step % a.sft_eval_every == 0 or step == limit:
            model.eval()
            acc = forced_accuracy(model, held, device)
            model.train()
            history.append({"step": step, "loss": round(loss.item(), 4), "held_out_forced_accuracy": acc,
                            "seconds": round(time.perf_counter() - t0, 1)})
            print(f"sft {arm} step {step}: loss {loss.item():.4f} held-out forced accuracy {acc:.3f}", flush=True)
            if steps is None and acc >= a.sft_target:
                break
    model.to(torch.float32 if a.cpu else torch.bfloat16).save_pretrained(str(path))
    return {"arm": arm, "steps": step, "final_held_out_forced_accuracy": acc, "history": history,
            "seconds": round(time.perf_counter() - t0, 1)}


def checkpoints(a: argparse.Namespace, tmp: Path, splits: dict[str, list[tuple[int, int]]]) -> dict[str, Any]:
    """Both arms' supervised checkpoints under ``tmp/<arm>`` from one initialisation: the tools arm to its target,
    the single arm for as many steps."""
    import shutil

    from rlhf_testing.tiny_chat import build_tiny_chat_model
    from transformers import AutoTokenizer

    init = build_tiny_chat_model(tmp / "init", "chatml", hidden_size=a.hidden, layers=a.layers, seed=a.seed)
    tok = AutoTokenizer.from_pretrained(str(init))
    tools = runtime_tools()
    fmt, schema = tool_output_format(tools), tools.schemas()  # the schemas the runtime gives the chat template
    out: dict[str, Any] = {"tool_output_format": fmt}
    steps = None
    for arm in ARMS:
        tools = schema if arm == "tools" else None
        rows = {k: [encode(tok, conversation(x, y, arm, fmt), tools) for x, y in splits[k]]
                for k in ("sft", "sft_held")}
        shutil.copytree(init, tmp / arm, dirs_exist_ok=True)
        out[arm] = supervised(a, tmp / arm, arm, rows["sft"], rows["sft_held"], steps)
        out[arm]["tokens_per_conversation"] = round(statistics.mean(len(r[0]) for r in rows["sft"]), 1)
        steps = out[arm]["steps"]
    return out


# ------------------------------------------------------------------------------------------------ GRPO
def write_prompts(path: Path, pairs: list[tuple[int, int]]) -> Path:
    path.write_text("".join(json.dumps({"messages": [{"role": "user", "content": question(x, y)}],
                                        "answer": str(x * y)}) + "\n" for x, y in pairs))
    return path


def job(a: argparse.Namespace, model: Path, arm: str, train: Path, evals: Path, seed: int, steps: int,
        lr: float) -> dict[str, Any]:
    gpu = not a.cpu
    spec: dict[str, Any] = {
        "model": {"name": str(model), "dtype": "bfloat16" if gpu else "float32"},
        "image": "local",
        "trainer": {"replicas": 1, "gpusPerReplica": 1 if gpu else 0},
        "rollout": {"engines": 1, "maxModelLen": 640, "enforceEager": True,
                    "gpuMemoryUtilization": 0.3 if gpu else 0.05,
                    "sampling": {"temperature": 1.0, "maxTokens": 96, "samplesPerPrompt": a.samples}},
        "placement": {"mode": "colocated" if gpu else "separate"},
        **({"weightSync": {"backend": "ipc"}} if gpu else {}),
        "algorithm": {"name": "grpo", "steps": steps, "promptsPerStep": a.prompts, "learningRate": lr, "seed": seed},
        "data": {"path": str(train), "eval": {"path": str(evals), "maxPrompts": a.eval_prompts},
                 "evalEveryNSteps": a.eval_every, "evalOnStart": True},
        "reward": {"rule": "exactMatch"},
        "env": [{"name": "HF_HUB_OFFLINE", "value": "1"}, {"name": "TRANSFORMERS_OFFLINE", "value": "1"}],
    }
    if arm == "tools":
        spec["environment"] = {"tools": [PYTHON_TOOL], "toolParser": "hermes", "maxTurns": MAX_TURNS,
                               "maxTokens": MAX_TRAJECTORY_TOKENS,
                               "python": {"timeoutSeconds": 5}}
    return spec


def grpo(a: argparse.Namespace, tmp: Path, model: Path, arm: str, data: dict[str, Path], seed: int,
         steps: int, lr: float, name: str | None = None) -> dict[str, Any]:
    """One driver run; its evals, its steps' rewards and agent figures."""
    name = name or f"{arm}-seed{seed}-{steps}steps"
    ran, records = harness.run_driver(job(a, model, arm, data["train"], data["eval"], seed, steps, lr), tmp,
                                      name=name, timeout=a.run_timeout)
    evals, steps_out = {}, []
    for r in records:
        if "eval" in r:
            evals[r["eval"]["step"]] = r["eval"].get("reward_mean", r["eval"].get("rewardMean"))
        tp = r.get("throughput")
        if tp and (r.get("runtime") or {}).get("state") == "Running":
            steps_out.append({"step": r.get("step"), "reward_mean": tp.get("rewardMean"),
                              "step_seconds": tp.get("stepSeconds"), "rollout_seconds": tp.get("rolloutSeconds"),
                              "train_seconds": tp.get("trainSeconds"),
                              **({"agent": r["agent"]} if r.get("agent") else {}),
                              **({"agent_rollout": r["agent_rollout"]} if r.get("agent_rollout") else {})})
    out = {"arm": arm, "seed": seed, "learning_rate": lr, "exit_code": ran["exit"],
           "wall_seconds": round(ran["seconds"], 1), "eval": [{"step": s, "accuracy": v}
                                                              for s, v in sorted(evals.items())], "steps": steps_out}
    if ran["exit"]:
        out["log_tail"] = ran["log"].read_text(errors="replace").splitlines()[-40:]
    print(f"{name}: exit {ran['exit']} in {ran['seconds']:.0f}s; eval "
          + " ".join(f"{e['step']}:{e['accuracy']:.3f}" for e in out["eval"]), flush=True)
    return out


def trl(a: argparse.Namespace, tmp: Path, model: Path, data: dict[str, Path], seed: int) -> dict[str, Any]:
    """One run of TRL's GRPOTrainer with the python tool (``trl_tool_learning_run.py`` under ``--trl-python``) from
    the tools checkpoint, on the prompts in the order the driver takes them for ``seed``; each checkpoint it saves
    scored by the runtime's own evaluation (``score``)."""
    from transformers import AutoTokenizer

    from rlhf_runtime.algo.data import step_batch

    rows = [json.loads(line) for line in data["train"].read_text().splitlines()]
    order = [(rows[i]["messages"][0]["content"], rows[i]["answer"]) for step in range(a.grpo_steps)
             for i in step_batch(list(range(len(rows))), step, a.prompts, seed)]
    budget = completion_budget(AutoTokenizer.from_pretrained(str(model)), [q for q, _ in order])
    name = f"trl-tools-seed{seed}"
    work_file, out_file, log = tmp / f"{name}.work.json", tmp / f"{name}.json", tmp / f"{name}.log"
    launched = time.time()
    work_file.write_text(json.dumps({
        "model": str(model), "train": order, "steps": a.grpo_steps, "prompts_per_step": a.prompts,
        "samples_per_prompt": a.samples, "max_turns": MAX_TURNS, "max_completion_tokens": budget,
        "tool_schema": runtime_tools().schemas()[0], "temperature": 1.0, "learning_rate": a.lr, "clip": 0.2,
        "gpu_memory_utilization": 0.3, "max_model_len": 640, "micro_batch": a.trl_micro_batch,
        "device": "cpu" if a.cpu else "cuda", "use_vllm": not a.trl_no_vllm, "seed": seed,
        "eval_every": a.eval_every, "launched": launched}))
    ran = harness.run_logged([a.trl_python, str(ROOT / "trl_tool_learning_run.py"), str(work_file), str(out_file)],
                             log, a.run_timeout, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    rc, wall = ran["exit"], ran["seconds"]
    got = json.loads(out_file.read_text()) if out_file.exists() else {}
    res: dict[str, Any] = {
        "arm": "trl-tools", "seed": seed, "learning_rate": a.lr, "exit_code": rc, "wall_seconds": round(wall, 1),
        "use_vllm": not a.trl_no_vllm, "max_completion_tokens": budget,
        "versions": got.get("versions"), "steps": got.get("steps", []),
        **{k: got[k] for k in ("imported_at", "trainer_ready", "train_begin", "train_seconds", "finished", "error",
                               "traceback") if k in got}}
    if rc != 0:
        res["log_tail"] = log.read_text(errors="replace").splitlines()[-60:]
    res["eval"] = [{"step": c["step"], "accuracy": score(a, tmp, Path(c["path"]), data, seed)}
                   for c in got.get("checkpoints", [])]
    print(f"{name}: exit {rc} in {wall:.0f}s; eval " + " ".join(f"{e['step']}:{e['accuracy']}" for e in res["eval"])
          + (f"; error {res['error'][:300]}" if "error" in res else ""), flush=True)
    return res


def completion_budget(tok: Any, questions: list[str]) -> int:
    """TRL's ``max_completion_length`` for the runtime's trajectory budget (``maxTokens``: the prompt, turns and
    observations): what that budget leaves after the longest first prompt, rendered with the tool as both sides
    render it."""
    schema = runtime_tools().schemas()
    texts = (tok.apply_chat_template([{"role": "user", "content": q}], tools=schema, add_generation_prompt=True,
                                     tokenize=False) for q in set(questions))
    return MAX_TRAJECTORY_TOKENS - max(len(tok.encode(t, add_special_tokens=False)) for t in texts)


def score(a: argparse.Namespace, tmp: Path, model: Path, data: dict[str, Path], seed: int) -> float | None:
    """``model``'s held-out accuracy as the runtime scores its own runs: the tools arm's job from that checkpoint,
    its eval before the first step (``data.evalOnStart``; one step, whose update is not scored)."""
    ran = grpo(a, tmp, model, "tools", data, seed, 1, a.lr, name=f"score-{model.name}")
    return start_accuracy(ran)


def last_accuracy(run: dict[str, Any]) -> float | None:
    return run["eval"][-1]["accuracy"] if run["eval"] and run["exit_code"] == 0 else None


def start_accuracy(run: dict[str, Any]) -> float | None:
    """The eval before the first step (``data.evalOnStart``)."""
    return next((e["accuracy"] for e in run["eval"] if e["step"] == 0), None)


#: The settings a resumed call must share with the calls whose checkpoints and runs it keeps.
SAME = ("digits", "hidden", "layers", "seed", "sft_lr", "sft_batch", "sft_target", "sft_max_steps", "sft_eval_every",
        "grpo_steps", "prompts", "samples", "lr", "eval_prompts", "eval_every", "cpu", "trl_micro_batch")


def keep(a: argparse.Namespace, work: Path, result: dict[str, Any]) -> None:
    """What a later call with ``--work`` resumes from: the settings, the supervised phase, the runs made so far."""
    dates = result.get("resumed", {}).get("dates", [])  # the earlier calls', as this call read them at its start
    (work / "kept.json").write_text(json.dumps({
        "settings": {k: getattr(a, k) for k in SAME}, "supervised": result["supervised"], "runs": result["runs"],
        "dates": sorted(set(dates + [result["date"]]))}, indent=1))


def resumed(a: argparse.Namespace, work: Path) -> dict[str, Any] | None:
    """What ``keep`` left in ``work``, if anything; an error if it was made with other settings."""
    path = work / "kept.json"
    if not path.exists():
        return None
    kept = json.loads(path.read_text())
    if kept["settings"] != {k: getattr(a, k) for k in SAME}:
        differ = sorted(k for k in SAME if kept["settings"].get(k) != getattr(a, k))
        raise SystemExit(f"--work {work} holds runs made with other settings ({', '.join(differ)}): "
                         "use another directory or the same settings")
    return kept


def summary(runs: list[dict[str, Any]], steps: int) -> dict[str, Any]:
    """Held-out accuracy after the last step (median over seeds) per arm, before the first (each run's step-0
    eval, also of runs that stopped early), the ratio."""
    out: dict[str, Any] = {}
    for arm, key in (("tools", "tools_accuracy"), ("single", "single_turn_accuracy")):
        done = [x for r in runs if r["arm"] == arm for x in [last_accuracy(r)] if x is not None]
        start = [x for r in runs if r["arm"] == arm for x in [start_accuracy(r)] if x is not None]
        out[key] = statistics.median(done) if done else None
        out[f"{key}_at_start"] = statistics.median(start) if start else None
        out[f"{key}_seeds"] = done
    t, s = out["tools_accuracy"], out["single_turn_accuracy"]
    out["tools_over_single_turn"] = (t / s if s else None) if t is not None and s is not None else None
    # the target (tools >= 2x single-turn and above 0), also where the single-turn arm scored 0 and the ratio is None
    out["tools_at_least_2x_single_turn"] = t > 0 and t >= 2 * s if t is not None and s is not None else None
    trl_runs = [r for r in runs if r["arm"] == "trl-tools"]
    if trl_runs:  # the peer from the same tools checkpoint, scored by the same evaluation
        done = [x for r in trl_runs for x in [last_accuracy(r)] if x is not None]
        out["trl_tools_accuracy"], out["trl_tools_accuracy_seeds"] = statistics.median(done) if done else None, done
        for arm in ("tools", "trl-tools"):
            out[f"{arm.replace('-', '_')}_step_seconds"] = step_seconds(
                [r for r in runs if r["arm"] == arm and r["exit_code"] == 0])
        ours, peer = out["tools_step_seconds"], out["trl_tools_step_seconds"]
        out["tools_step_speedup_vs_trl"] = peer["median"] / ours["median"] if ours and peer else None
    out["grpo_steps"] = steps
    return out


def step_seconds(runs: list[dict[str, Any]]) -> dict[str, Any] | None:
    """Median (min, max) of the runs' step times after the first step (which includes warm-up), and the whole
    loop's seconds per run (every step's, evaluations not included)."""
    times = [s["step_seconds"] for r in runs for s in r["steps"][1:] if s.get("step_seconds") is not None]
    if not times:
        return None
    return {"median": statistics.median(times), "min": min(times), "max": max(times), "n": len(times),
            "loop_seconds": [round(sum(s.get("step_seconds") or 0.0 for s in r["steps"]), 2) for r in runs]}


def arguments() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--digits", type=int, default=3, help="digits of each operand")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--seed", type=int, default=0, help="the initialisation's and the supervised phase's seed")
    p.add_argument("--sft-lr", type=float, default=1e-3)
    p.add_argument("--sft-batch", type=int, default=64)
    p.add_argument("--sft-target", type=float, default=0.2, help="the tools arm's held-out forced accuracy to stop at")
    p.add_argument("--sft-max-steps", type=int, default=5000)
    p.add_argument("--sft-eval-every", type=int, default=5,
                   help="supervised steps between held-out evals (the tools arm stops at the first at its target)")
    p.add_argument("--grpo-steps", type=int, default=40)
    p.add_argument("--prompts", type=int, default=64, help="algorithm.promptsPerStep")
    p.add_argument("--samples", type=int, default=8, help="rollout.sampling.samplesPerPrompt")
    p.add_argument("--lr", type=float, default=2e-5, help="algorithm.learningRate")
    p.add_argument("--eval-prompts", type=int, default=256)
    p.add_argument("--eval-every", type=int, default=10)
    p.add_argument("--seeds", default="0,1", help="algorithm.seed of the GRPO runs, interleaved by arm")
    p.add_argument("--run-timeout", type=float, default=900)
    p.add_argument("--arms", default="tools,single", help="the runtime's GRPO runs to make (both checkpoints are "
                   "trained either way); e.g. tools with --trl-python for the peer comparison alone")
    p.add_argument("--trl-python", help="also run TRL's GRPOTrainer with the python tool from the tools checkpoint "
                   "under this Python (one that has TRL: trl_tool_learning_run.py)")
    p.add_argument("--trl-no-vllm", action="store_true", help="TRL generates with transformers (a CPU smoke run)")
    p.add_argument("--trl-micro-batch", type=int, default=64, help="TRL's per_device_train_batch_size")
    p.add_argument("--cpu", action="store_true", help="smoke run on CPU (a smaller model, fewer steps)")
    p.add_argument("--work", type=Path, help="keep the checkpoints and runs here; a later call with the same settings "
                   "reuses them and makes only the runs still missing (a comparison spread over several calls)")
    p.add_argument("--out", type=Path, required=True)
    a = p.parse_args()
    if a.cpu:
        a.digits, a.hidden, a.layers, a.sft_max_steps, a.sft_target, a.sft_batch = 2, 64, 2, 150, 0.05, 16
        a.grpo_steps, a.prompts, a.samples, a.eval_prompts, a.eval_every = min(a.grpo_steps, 4), 8, 4, 32, 2
    return a


def main() -> int:
    a = arguments()
    tmp = a.work or Path(tempfile.mkdtemp(prefix="tool-learning-"))
    tmp.mkdir(parents=True, exist_ok=True)
    eval_pairs = problems(a.digits, 1, a.eval_prompts)
    sft_held = problems(a.digits, 2, 256, frozenset(eval_pairs))
    train = problems(a.digits, 3, 2048, frozenset(eval_pairs + sft_held))
    sft = problems(a.digits, 4, 20_000 if not a.cpu else 2_000, frozenset(eval_pairs + sft_held + train))
    prov = harness.provenance()
    result: dict[str, Any] = {"command": prov["command"], "date": prov["date"], "provenance": prov,
                              "task": f"{a.digits}-digit x {a.digits}-digit multiplication, exact match",
                              "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(a).items()}}
    kept = resumed(a, tmp)
    result["supervised"] = kept["supervised"] if kept else checkpoints(a, tmp, {"sft": sft, "sft_held": sft_held})
    data = {"train": write_prompts(tmp / "train.jsonl", train), "eval": write_prompts(tmp / "eval.jsonl", eval_pairs)}
    result["runs"] = kept["runs"] if kept else []
    if kept:
        result["resumed"] = {"from": str(tmp), "runs_kept": len(kept["runs"]), "dates": kept.get("dates", [])}
    gpus = prov["device"]["gpus"]
    result.update(device=gpus[0] if gpus and not a.cpu else "cpu", vllm=prov["device"]["versions"].get("vllm"))
    slug = "cpu" if a.cpu or not gpus else gpus[0].lower().replace("nvidia ", "").replace(" ", "-")
    out = a.out / f"tool_learning_{slug}.json"
    for seed in (int(s) for s in a.seeds.split(",")):
        arms = [arm for arm in ARMS if arm in a.arms.split(",")]
        todo = [arm for arm in (arms if seed % 2 == 0 else arms[::-1]) + (["trl-tools"] if a.trl_python else [])
                if not any(r["arm"] == arm and r["seed"] == seed and r["exit_code"] == 0 for r in result["runs"])]
        for arm in todo:
            ran = trl(a, tmp, tmp / "tools", data, seed) if arm == "trl-tools" else \
                grpo(a, tmp, tmp / arm, arm, data, seed, a.grpo_steps, a.lr)
            result["runs"].append(ran)
            result["summary"] = summary(result["runs"], a.grpo_steps)
            harness.write_result(out, result)
            if a.work:
                keep(a, tmp, result)
    print(json.dumps(result["summary"], indent=1))
    return 0 if all(r["exit_code"] == 0 for r in result["runs"]) else 1


if __name__ == "__main__":
    sys.exit(main())
