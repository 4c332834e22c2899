"""The weight-sync benchmark's rollouts (``gpu_sync.py``): timed as the driver launches them (``rollouts``), the
DP scaling pass over independent engines (``dp_scaling``), and the last batch on a bare ``vllm.LLM`` with the
engine actor's own arguments (``bare_rollout``): the runtime's overhead."""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from harness import median


def rollouts(rt: Any, args: argparse.Namespace, result: dict[str, Any], tag: str, model_path: Path,
             save: Callable[[dict[str, Any]], None]) -> Any:
    """A warm-up rollout, then ``--rollouts`` timed ones of the same batch, as the driver launches them (tokens/s);
    the DP scaling pass on layouts of several independent engines. Returns the last rollout and its outputs."""
    from rlhf_runtime.algo.data import render_prompt, step_batch

    rt.weights.wake()
    job, spec = rt.job, rt.cfg.spec
    runs = []
    for i in range(1 + args.rollouts):  # a warm-up on batch 0, then the same batch 1 every time
        batch = step_batch(job.samples, min(i, 1), spec.algorithm.prompts_per_step, 0)
        ro = rt.experience.launch(job.tokenizer, batch, job.sampling, 0)
        outs = rt.experience.collect(ro)
        dt = time.perf_counter() - ro.t_launch
        tokens = sum(len(c) for o in outs for c in o["samples"])
        runs.append({"seconds": dt, "tokens": tokens, "samples": sum(len(o["samples"]) for o in outs),
                     "tokens_per_second": tokens / dt})
    BARE_INPUTS.update(prompts=[render_prompt(x, job.tokenizer) for x in ro.batch], sampling=job.sampling,
                       kwargs=dict(rt.actors.engine_kwargs[0], model=str(model_path), load_format="auto"),
                       env=dict(rt.actors.env), engine_gpu=0 if spec.placement.mode == "colocated" else 1,
                       engines=len(rt.actors.engines), runs=args.rollouts)
    result["rollout"] = {"runs": runs, "tokens_per_second": median([r["tokens_per_second"] for r in runs[1:]]),
                         "sampling": job.sampling, "prompts": spec.algorithm.prompts_per_step,
                         "enforce_eager": spec.rollout.enforce_eager, "engines": len(rt.actors.engines)}
    print(f"[{tag}] rollout {result['rollout']['tokens_per_second']:.0f} tokens/s", flush=True)
    save(result)
    if len(rt.actors.engines) > 1 and not rt.layout.dp_group:
        def keep(records: list[dict[str, Any]]) -> None:  # saved after every rollout: a cut run keeps them
            result["rollout"]["scaling"] = records
            result["rollout"]["scaling_summary"] = scaling_summary(records)
            save(result)

        dp_scaling(rt, job.samples, job.tokenizer, job.sampling, args.scaling_rounds, f"[{tag}]", keep,
                   args.scaling_per_engine)
    return ro, outs


#: What the runtime's last timed rollout ran (filled by ``run_one``), for ``bare_rollout``.
BARE_INPUTS: dict[str, Any] = {}


def scaling_order(n: int, rounds: int) -> list[int]:
    """Engine counts 1..n for ``rounds`` rounds, interleaved: ascending in even rounds, descending in odd ones (so
    no count always runs first or last, on a machine warming up or a batch cached)."""
    ks = list(range(1, n + 1))
    return [k for r in range(rounds) for k in (ks if r % 2 == 0 else ks[::-1])]


def scaling_prompts(k: int, per_engine: int, prompts_per_step: int) -> int:
    """The prompts of a DP-scaling rollout on k engines: k times ``per_engine`` (weak scaling), or with
    ``per_engine`` 0 the job's ``promptsPerStep`` at every k (strong scaling)."""
    return per_engine * k if per_engine else prompts_per_step


def dp_scaling(rt: Any, samples: Any, tokenizer: Any, sampling: dict[str, Any], rounds: int, tag: str,
               keep: Any, per_engine: int = 0) -> list[dict[str, Any]]:
    """A batch on the first k engines (independent replicas) for every k of ``scaling_order``: DP scaling. The
    same batch (``promptsPerStep`` prompts) for every k (strong scaling: each engine's share, and with it its
    decoding batch, shrinks as k grows), or with ``per_engine`` k times that many prompts (weak scaling: every
    engine decodes as many sequences at every k, so linear is what the runtime's fan-out can reach). One record
    per rollout (its round, k, prompts, seconds, tokens, tokens/s), handed to ``keep`` after each."""
    from rlhf_runtime.algo.data import step_batch

    engines, out = rt.actors.engines.actors, []
    try:
        for i, k in enumerate(scaling_order(len(engines), rounds)):
            rt.actors.engines.actors = engines[:k]
            batch = step_batch(samples, 1, scaling_prompts(k, per_engine, rt.cfg.spec.algorithm.prompts_per_step), 0)
            ro = rt.experience.launch(tokenizer, batch, sampling, 0)
            outs = rt.experience.collect(ro)
            dt = time.perf_counter() - ro.t_launch
            tokens = sum(len(c) for o in outs for c in o["samples"])
            out.append({"round": i // len(engines), "engines": k, "prompts": len(batch), "seconds": dt,
                        "tokens": tokens, "tokens_per_second": tokens / dt})
            print(f"{tag} rollout on {k} engine(s): {tokens / dt:.0f} tokens/s", flush=True)
            keep(out)
    finally:
        rt.actors.engines.actors = engines
    return out


def scaling_summary(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per engine count: median tokens/s (min-max) over the rounds, and the median over k times the 1-engine
    median (1.0 = linear)."""
    by_k: dict[int, list[float]] = {}
    for r in records:
        by_k.setdefault(r["engines"], []).append(r["tokens_per_second"])
    one = median(by_k.get(1, [0.0])) or 1.0
    return [{"engines": k, "rounds": len(v), "tokens_per_second": median(v), "min": min(v), "max": max(v),
             "x_linear": median(v) / (k * one)} for k, v in sorted(by_k.items())]


def _bare_rollout_proc(inputs: dict[str, Any], gpu: bool, q: Any) -> None:
    os.environ.update(inputs["env"])
    if gpu:
        os.environ["CUDA_VISIBLE_DEVICES"] = str(inputs["engine_gpu"])
    from bench_actors import time_generate
    from vllm import LLM

    from rlhf_runtime.rollout.base import llm_args

    llm = LLM(**llm_args(inputs["kwargs"]))  # the engine actor's exact LLM arguments
    runs = []
    for _ in range(1 + inputs.get("runs", 1)):  # a warm-up, then timed (as the runtime's rollout)
        r = time_generate(llm, inputs["prompts"], inputs["sampling"])
        runs.append({**r, "tokens_per_second": r["tokens"] / r["seconds"]})
    q.put(runs)


def bare_rollout(gpu: bool) -> dict[str, Any]:
    """The runtime's last rollout batch on a bare ``vllm.LLM`` (same engine arguments and weights, no Ray actor,
    no runtime) in its own process on one engine's GPU: the runtime's overhead is the ratio of the two."""
    import multiprocessing as mp

    if BARE_INPUTS.get("engines", 1) != 1:
        return {"skipped": "only for one-engine layouts (the runtime spreads the batch over its engines)"}
    ctx = mp.get_context("spawn")
    out: dict[str, Any] = {"prompts": len(BARE_INPUTS["prompts"])}
    # as the engine process has it, and with OMP_NUM_THREADS=1 (what Ray gives an actor of one CPU)
    for name, extra in (("default", {}), ("omp1", {"OMP_NUM_THREADS": "1"})):
        q = ctx.Queue()
        inputs = {**BARE_INPUTS, "env": {**BARE_INPUTS["env"], **extra}}
        proc = ctx.Process(target=_bare_rollout_proc, args=(inputs, gpu, q))
        proc.start()
        try:
            runs = q.get(timeout=300)
        finally:
            proc.join(60)
            if proc.is_alive():
                proc.kill()
        out[name] = {"runs": runs, "tokens_per_second": median([r["tokens_per_second"] for r in runs[1:]])}
    out["tokens_per_second"] = out["default"]["tokens_per_second"]
    return out
