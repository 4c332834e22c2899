"""vLLM's flat log-prob container (``SamplingParams.flat_logprobs``) against its per-token dicts (the default, what
the runtime asks for), on the runtime's own request (``logprobs`` 0: the sampled token's log-prob).

One ``vllm.LLM`` in this process (a random tiny Qwen2, built locally), 64 prompts x 8 samples x 128 tokens
(``ignore_eos``), the settings interleaved per round (the order rotating): tokens/s of ``generate``, and the
milliseconds to read the sampled tokens' log-probs out of its outputs (per-token dicts: as
``rollout.base.sampled_logprobs`` does; flat: its list taken whole); medians with min-max, and each setting's
paired gain over the dicts with a 95% bootstrap interval. ``--none`` adds a setting without log-probs (what asking
for them costs).

    PYTHONPATH=operator .venv/bin/python benchmarks/flat_logprobs.py --rounds 15 --none \
        --out benchmarks/results/rollout/flat_logprobs_cpu_none.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import harness
from rollout_stats import bootstrap_mean


def paired(xs: list[dict[str, float]], base: list[dict[str, float]]) -> dict[str, float]:
    """Mean gain of ``xs`` over ``base`` in tokens/s from the rounds' paired log ratios (as exp - 1), with its 95%
    percentile-bootstrap interval (``rollout_stats.bootstrap_mean``)."""
    logs = [math.log(x["tokens_per_second"] / b["tokens_per_second"]) for x, b in zip(xs, base)]
    mean, low, high = bootstrap_mean(logs)
    return {"mean": math.expm1(mean), "low": math.expm1(low), "high": math.expm1(high), "rounds": len(logs)}


def timed_batch(llm: Any, prompts: list[dict[str, Any]], name: str) -> dict[str, float]:
    """One batch in setting ``name`` (``dicts``: a dict per token, ``flat``: vLLM's flat container, ``none``: no
    log-probs): its tokens/s and the milliseconds to read every sampled token's log-prob from it."""
    from vllm import SamplingParams

    flat = name == "flat"
    sp = SamplingParams(n=8, temperature=1.0, max_tokens=128, logprobs=None if name == "none" else 0,
                        ignore_eos=True, detokenize=False, flat_logprobs=flat)
    t = time.perf_counter()
    outs = llm.generate(prompts, sp, use_tqdm=False)
    dt = time.perf_counter() - t
    t = time.perf_counter()
    for o in outs:
        for c in o.outputs:
            if name == "none":
                continue
            if flat:
                assert len(c.logprobs.logprobs) == len(c.token_ids)  # one entry per sampled token
                [float(x) for x in c.logprobs.logprobs]
            else:
                [float(d[tok].logprob) for tok, d in zip(c.token_ids, c.logprobs)]
    return {"tokens_per_second": sum(len(c.token_ids) for o in outs for c in o.outputs) / dt,
            "read_ms": (time.perf_counter() - t) * 1e3}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--none", action="store_true",
                   help="a third setting, no log-probs at all (logprobs None): what asking for them costs")
    p.add_argument("--out", default="")
    a = p.parse_args()
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from rlhf_runtime.infra.config import CPU_ENV

    for k, v in CPU_ENV.items():  # as the runtime's CPU engines run (the KV cache's RAM, threads, no compile)
        os.environ.setdefault(k, v)
    import vllm
    from rlhf_testing.tiny import build_tiny_model
    from vllm import LLM

    model = build_tiny_model(Path(tempfile.mkdtemp()) / "m", vocab_size=a.vocab, hidden_size=64, layers=1)
    llm = LLM(model=str(model), enforce_eager=True, max_model_len=256, seed=0, skip_tokenizer_init=True,
              max_num_seqs=512, logprobs_mode="processed_logprobs", gpu_memory_utilization=0.05)
    prompts = [{"prompt_token_ids": [1 + (i * 7 + j) % 60 for j in range(20)]} for i in range(64)]
    names = ["dicts", "flat"] + (["none"] if a.none else [])
    for name in names:  # warm-up
        timed_batch(llm, prompts, name)
    runs: dict[str, list[dict[str, float]]] = {n: [] for n in names}
    for r in range(a.rounds):  # the order rotates from round to round
        for name in names[r % len(names):] + names[:r % len(names)]:
            runs[name].append(timed_batch(llm, prompts, name))

    def stat(xs: list[float]) -> dict[str, float]:
        return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}

    prov = harness.provenance(harness.command_line(python=Path(sys.executable).name))
    result = {"command": prov["command"], "provenance": prov, "vllm": vllm.__version__,
              "date": time.strftime("%Y-%m-%d"), "device": "cpu", "cpus": len(os.sched_getaffinity(0)),
              "runs": runs, "summary": {k: {m: stat([x[m] for x in v]) for m in ("tokens_per_second", "read_ms")}
                                        for k, v in runs.items()},
              "paired_vs_dicts": {n: paired(runs[n], runs["dicts"]) for n in names if n != "dicts"},
              "flat_faster_rounds": sum(f["tokens_per_second"] > d["tokens_per_second"]
                                        for f, d in zip(runs["flat"], runs["dicts"]))}
    print(json.dumps(result["paired_vs_dicts"], indent=1))
    print(json.dumps(result["summary"], indent=1), f"flat faster in {result['flat_faster_rounds']}/{a.rounds} rounds")
    if a.out:
        harness.write_result(a.out, result)


if __name__ == "__main__":
    main()
