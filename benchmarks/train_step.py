#!/usr/bin/env python3
"""The trainer's GRPO training step on one GPU: peak memory, training tokens/s and MFU per sequence length; the
update fidelity of bfloat16 with and without float32 master weights; padding waste on a long-tailed length mix.

What runs is the runtime's own ``roles.policy.Trainer`` (``StepTrainer`` below only skips loading vLLM's
weight-transfer modules: nothing is synced here), on a random-initialised model of a published architecture
(``harness.MODELS``), bfloat16, float32 master weights, gradient checkpointing, packed micro-batches of
``--budget`` tokens. Each sample is a 128-token prompt and a completion up to the sequence length; advantages
alternate +1/-1 (a real, non-zero loss). One step warms up, ``--repeats`` are timed (``train_s`` of
``Trainer.train``: prepare, forward, backward, optimiser step, synchronised).

FLOPs of a step (model FLOPs: the recomputation of gradient checkpointing is not counted):
``6 * (N - V*H) * T + 6 * V*H * S + 6 * layers * heads * head_dim * sum(len_i^2)`` with ``N`` the parameters,
``V*H`` the output layer (and the input embedding when untied, which is a lookup, not a matmul), ``T`` all
tokens, ``S`` the scored (completion) tokens, and the last term causal attention (QK^T and AV, half of the square,
forward + backward = 3x forward). MFU divides by the GPU's dense bfloat16 peak (989 TFLOP/s for H100 and H200
SXM).

``--profile FILE``: one more step of the first length under ``torch.profiler`` (CUDA time per kernel: the top
kernels and a sum per kind, GEMM / attention / elementwise and normalisation / optimiser / copies) written to
FILE, to see where the step's time goes. ``--compile-layers``: ``trainer.compile`` on (every decoder layer through
``torch.compile``), timed the same way. With ``--world`` every rank steps once more and rank 0 profiles its
step (NCCL kernels are the "collective" kind). ``--no-reshard``: ``trainer.reshardAfterForward: false`` (FSDP2
keeps each layer's gathered parameters from forward to backward); ``--logit-chunk-elements N``: the output
layer's logits per chunk, an exploration knob that is not a trainer field (``apply_knobs``).

``--legacy DIR``: the same batches through the trainer of another checkout (``DIR/operator``, e.g. the code before
float32 masters and packing: ``git archive ef2188b operator | tar -x -C DIR``), run in a subprocess, for a before
and after on the same device.

    PYTHONPATH=/tmp/pyd:$PWD/operator python benchmarks/train_step.py --model qwen3-1.7b \\
        --lengths 1024,4096,16384,32768 --fidelity qwen3-0.6b --out $OUT/train_step.json
    python benchmarks/train_step.py --cpu          # smoke: the tiny model on CPU
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))
# the checkout whose trainer runs: this one, or --legacy's (its subprocess sets TRAIN_STEP_OPERATOR)
sys.path.insert(0, os.environ.get("TRAIN_STEP_OPERATOR", str(ROOT.parent / "operator")))

import harness


def _flops_module() -> Any:
    """This checkout's ``rlhf_runtime/infra/flops.py`` (what the trainer reports), loaded by path: a ``--legacy``
    checkout has none, and its subprocess imports the runtime from that checkout."""
    where = ROOT.parent / "operator" / "rlhf_runtime" / "infra" / "flops.py"
    spec = importlib.util.spec_from_file_location("bench_flops", where)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


FLOPS = _flops_module()
PROMPT = 128  # prompt tokens per sample (CPU smoke: 16)


def spec(model: Path, gpu: bool, budget: int, lr: float, dtype: str, master: str | None,
         checkpointing: bool, world: int = 1, compile_layers: bool = False,
         keep_gathered: bool = False) -> dict[str, Any]:
    trainer: dict[str, Any] = {"replicas": 1, "gpusPerReplica": world if gpu or world > 1 else 0,
                               "gradientCheckpointing": checkpointing}
    if compile_layers:  # trainer.compile (a checkout before the field would refuse the key)
        trainer["compile"] = True
    if world > 1:
        trainer["strategy"] = "fsdp2"
    if keep_gathered:  # trainer.reshardAfterForward false (likewise a newer field)
        trainer["reshardAfterForward"] = False
    if master is not None:  # None: a checkout without these fields (--legacy)
        trainer.update(masterWeights=master, maxTokensPerMicroBatch=budget)
    return {
        "model": {"name": str(model), "dtype": dtype}, "image": "runtime:bench", "trainer": trainer,
        "rollout": {"sampling": {"temperature": 1.0, "maxTokens": 256, "samplesPerPrompt": 8}},
        "algorithm": {"steps": 10, "promptsPerStep": 8, "learningRate": lr, "klCoef": 0.0, "epochsPerStep": 1},
        "data": {"prompts": ["a"]}, "reward": {"rule": "contains", "target": "7"},
    }


def make_trainer(cfg: dict[str, Any], rank: int = 0, world: int = 1, port: int = 0) -> Any:
    from rlhf_api.models import RuntimeConfig
    from rlhf_runtime.roles.options import TrainerOptions
    from rlhf_runtime.roles.policy import Trainer

    class StepTrainer(Trainer):
        """The runtime's trainer without vLLM's weight-transfer modules (nothing is synced here)."""

        def _load_weight_transfer(self) -> None:  # an older checkout's (TRAIN_STEP_OPERATOR) constructor calls it
            pass

    return StepTrainer(TrainerOptions.from_config(RuntimeConfig(name="bench", namespace="default", uid="u",
                                                                spec=cfg).model_dump_json(by_alias=True),
                                                   rank, world, "127.0.0.1", port))


def batch(lengths: list[int], vocab: int, seed: int = 0) -> dict[str, Any]:
    rng = random.Random(seed)
    prompts = [[rng.randrange(4, vocab) for _ in range(min(PROMPT, n - 1))] for n in lengths]
    completions = [[rng.randrange(4, vocab) for _ in range(n - len(p))] for n, p in zip(lengths, prompts)]
    return {"prompts": prompts, "completions": completions,
            "advantages": [1.0 if i % 2 == 0 else -1.0 for i in range(len(lengths))]}


def step_flops(info: dict[str, Any], b: dict[str, Any]) -> float:
    lens = [len(p) + len(q) for p, q in zip(b["prompts"], b["completions"])]
    return FLOPS.train_flops(SimpleNamespace(**info["config"]), info["params"], sum(lens),
                             sum(len(q) for q in b["completions"]), sum(n * n for n in lens))


def device_peak() -> float | None:
    import torch

    if not torch.cuda.is_available():
        return None
    return FLOPS.peak_flops(torch.cuda.get_device_name(0))


def timed_steps(t: Any, b: dict[str, Any], repeats: int, flops: float) -> dict[str, Any]:
    """``b``: the whole batch; with several ranks, this rank trains its share (every ``world``-th sample), and
    tokens/s and MFU are per GPU."""
    import torch

    gpu = torch.cuda.is_available()
    world = t.world_size
    whole = b
    b = {k: v[t.rank :: world] for k, v in b.items()}
    t.train(b)  # warm-up
    if gpu:
        torch.cuda.reset_peak_memory_stats()
    times = []
    stats: dict[str, Any] = {}
    for _ in range(repeats):
        stats = t.train(b)
        times.append(stats["train_s"])
    med = sorted(times)[len(times) // 2]
    tokens = sum(len(p) + len(q) for p, q in zip(whole["prompts"], whole["completions"]))
    peak = device_peak()
    return {"train_s": times, "median_s": med, "tokens": tokens, "gpus": world,
            "tokens_per_s_per_gpu": tokens / med / world, "tflops_per_gpu": flops / med / 1e12 / world,
            "mfu": flops / med / world / peak if peak else None, "runtime_mfu": stats.get("mfu"),
            "peak_allocated_gib": torch.cuda.max_memory_allocated() / 2**30 if gpu else None,
            "peak_reserved_gib": torch.cuda.max_memory_reserved() / 2**30 if gpu else None,
            "loss": stats.get("loss"), "entropy": stats.get("entropy")}


KINDS = (("collective", ("nccl",)),
         ("gemm", ("gemm", "cutlass", "cublas", "sm90_xmma", "nvjet", "matmul", "ampere_", "sm80_")),
         ("attention", ("flash", "fmha", "attention")),
         ("optimiser", ("adam", "multi_tensor", "foreach")),
         ("copy / cast", ("copy", "memcpy", "memset", "cast", "fill")),
         ("reduction / softmax", ("reduce", "softmax", "logsumexp", "log_softmax", "nll", "gather", "scatter")),
         ("elementwise / norm", ("elementwise", "vectorized", "norm", "silu", "mul", "add", "pow", "rsqrt", "unrolled")))


ANNOTATIONS = ("nccl:", "FSDP::", "Optimizer.", "ProfilerStep")


def profile_step(t: Any, b: dict[str, Any], path: str) -> dict[str, Any]:
    """One training step under ``torch.profiler``: CUDA kernel time per kernel name, the top 40 and the sum per
    kind (``KINDS``: the first pattern that matches the kernel's name; the rest "other"), written to ``path``."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        stats = t.train(b)
    rows = []
    for e in prof.key_averages():
        dev = getattr(e, "self_device_time_total", None)
        if dev is None:
            dev = getattr(e, "self_cuda_time_total", 0)
        # kernels only: the profiler also gives device time to annotations around them ("nccl:_all_gather_base",
        # "FSDP::post_backward_reduce", "Optimizer.step#AdamW.step"), which would count those kernels twice
        if dev and e.device_type == torch.autograd.DeviceType.CUDA and not e.key.startswith(ANNOTATIONS):
            rows.append((e.key, dev / 1e6, e.count))
    rows.sort(key=lambda r: -r[1])
    total = sum(r[1] for r in rows)
    kinds: dict[str, float] = {}
    for name, sec, _ in rows:
        low = name.lower()
        kind = next((k for k, pats in KINDS if any(pt in low for pt in pats)), "other")
        kinds[kind] = kinds.get(kind, 0.0) + sec
    out = {"train_s": stats["train_s"], "kernel_s": total,
           "kinds": {k: {"s": v, "share": v / total if total else 0.0} for k, v in sorted(kinds.items(), key=lambda kv: -kv[1])},
           "top": [{"kernel": n[:160], "s": sec, "calls": c} for n, sec, c in rows[:40]]}
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(out, indent=1))
    return {k: v for k, v in out.items() if k != "top"}


def varlen_check(t: Any, vocab: int) -> dict[str, Any]:
    """Log-probabilities of 4 sequences packed in one row (the trainer's attention: ``rlhf_varlen`` on GPUs)
    against each sequence alone through SDPA (no packing, no mask)."""
    import torch

    from rlhf_runtime.roles.batches import pack, token_logprobs

    b = batch([300, 200, 500, 129], vocab, seed=4)
    impl = t.model.config._attn_implementation
    with torch.no_grad():
        m = pack(b["prompts"], b["completions"], [0, 1, 2, 3], t.device)
        got = token_logprobs(t.scorer, m)[0][m.mask > 0]
        t.model.set_attn_implementation("sdpa")
        want = torch.cat([token_logprobs(t.scorer, s)[0][s.mask > 0] for s in
                          (pack(b["prompts"], b["completions"], [i], t.device) for i in range(4))])
        t.model.set_attn_implementation(impl)
    d = (got - want).abs()
    return {"attention": impl, "max_abs_diff": float(d.max()), "mean_abs_diff": float(d.mean()),
            "tokens": int(d.numel())}


def apply_knobs(a: argparse.Namespace) -> dict[str, Any]:
    """The exploration knob that is not a trainer field, set in this process before the trainer is built:
    ``--logit-chunk-elements`` (``roles.batches.LOGIT_CHUNK_ELEMENTS``: output-layer logits per chunk); and, for
    the result rows, ``--no-reshard`` (the spec's ``trainer.reshardAfterForward: false``, which ``spec`` sets).
    Returns what was set."""
    knobs: dict[str, Any] = {}
    if getattr(a, "logit_chunk_elements", 0):
        from rlhf_runtime.roles import batches

        batches.LOGIT_CHUNK_ELEMENTS = knobs["logit_chunk_elements"] = a.logit_chunk_elements
    if getattr(a, "no_reshard", False):
        knobs["reshard_after_forward"] = False
    return knobs


def run_lengths(a: argparse.Namespace, model: Path, info: dict[str, Any], legacy: bool) -> list[dict[str, Any]]:
    import torch

    knobs = {} if legacy else apply_knobs(a)
    gpu = not a.cpu
    lengths = [int(x) for x in a.lengths.split(",")]
    budget = max(a.budget, max(lengths))
    t = make_trainer(spec(model, gpu, budget, 1e-6, "bfloat16" if gpu else "float32",
                          None if legacy else "float32", not a.no_checkpointing, a.world,
                          getattr(a, "compile_layers", False), "reshard_after_forward" in knobs),
                     a.rank, a.world, a.port)
    out: list[dict[str, Any]] = []
    if not legacy and a.world == 1:
        out.append({"varlen_check": varlen_check(t, info["config"]["vocab_size"])})
        print(json.dumps(out[-1]), flush=True)
    for n in lengths:
        b = batch([n] * max(1, a.step_tokens // n), info["config"]["vocab_size"])
        row: dict[str, Any] = {"length": n, "samples": len(b["prompts"]), "budget": budget, "legacy": legacy,
                               "gradient_checkpointing": not a.no_checkpointing}
        row["compiled_layers"] = bool(getattr(a, "compile_layers", False))
        row.update(knobs)
        try:
            row.update(timed_steps(t, b, a.repeats, step_flops(info, b)))
            if getattr(a, "profile", "") and n == lengths[0]:  # every rank steps (collectives); rank 0 profiles
                share = {k: v[a.rank :: a.world] for k, v in b.items()}
                if a.rank == 0:
                    row["profile"] = profile_step(t, share, a.profile)
                else:
                    t.train(share)
        except torch.OutOfMemoryError as e:
            row["error"] = str(e).splitlines()[0][:300]
            t.opt.zero_grad(set_to_none=True)
            gc.collect()
            torch.cuda.empty_cache()
        print(json.dumps(row), flush=True)
        out.append(row)
    return out


def run_mix(a: argparse.Namespace, model: Path, info: dict[str, Any]) -> dict[str, Any]:
    """A long-tailed length mix (log-normal, median 1k tokens, capped at 8k): padding of the old layout (64
    samples per micro-batch, right-padded to the longest) vs none when packed; tokens/s of the packed step (CPU
    smoke: median 64, cap 256)."""
    from rlhf_runtime.roles.batches import plan

    rng = random.Random(1)
    median, cap = (64, 256) if a.cpu else (1024, 8192)
    lengths = [max(PROMPT + 1, min(cap, int(median * rng.lognormvariate(0, 0.9)))) for _ in range(a.mix_samples)]
    padded = sum(64 * max(lengths[i : i + 64]) for i in range(0, len(lengths), 64))
    bins = plan(lengths, a.budget)
    row: dict[str, Any] = {"mix": f"log-normal lengths: median {median}, sigma 0.9, at least {PROMPT + 1}, cap {cap}",
                           "samples": len(lengths),
                           "tokens": sum(lengths), "max": max(lengths),
                           "padding_waste_64_per_micro_batch": 1 - sum(lengths) / padded,
                           "packed_micro_batches": len(bins), "packed_padding_tokens": 0}
    t = make_trainer(spec(model, not a.cpu, a.budget, 1e-6, "float32" if a.cpu else "bfloat16", "float32", True))
    b = batch(lengths, info["config"]["vocab_size"], seed=2)
    row.update(timed_steps(t, b, a.repeats, step_flops(info, b)))
    print(json.dumps(row), flush=True)
    return row


def run_fidelity(a: argparse.Namespace, name: str, tmp: Path) -> dict[str, Any]:
    """10 steps at lr 1e-6 from the same weights on the same batch: float32, bfloat16 with float32 masters,
    bfloat16 without; the updates compared with float32's."""
    import torch

    model = tmp / f"fidelity-{name}"
    info = harness.build_model(model, name, not a.cpu)
    b = batch([512] * 16 if not a.cpu else [32] * 4, info["config"]["vocab_size"], seed=3)
    updates = {}
    for label, dtype, master in (("float32", "float32", "float32"), ("bfloat16+masters", "bfloat16", "float32"),
                                 ("bfloat16", "bfloat16", "none")):
        t = make_trainer(spec(model, not a.cpu, 16384, 1e-6, dtype, master, False))
        before = [p.detach().float().clone() for p in t.model.parameters()]
        for _ in range(10):
            t.train(b)
        after = ([m.detach().clone() for _, m in t.master.pairs] if t.master is not None
                 else [p.detach().float().clone() for p in t.model.parameters()])
        updates[label] = torch.cat([(x - y).flatten() for x, y in zip(after, before)]).cpu()
        del t, before, after
        gc.collect()
        if not a.cpu:
            torch.cuda.empty_cache()
    ref = updates["float32"]
    out: dict[str, Any] = {"model": name, "steps": 10, "lr": 1e-6, "samples": len(b["prompts"])}
    for label in ("bfloat16+masters", "bfloat16"):
        u = updates[label]
        out[label] = {"mean_abs_update_vs_float32": float(u.abs().mean() / ref.abs().mean()),
                      "relative_l2_error": float((u - ref).norm() / ref.norm()),
                      "cosine": float((u.double() @ ref.double()) / (u.double().norm() * ref.double().norm())),
                      "fraction_changed": float((u != 0).float().mean())}
    out["float32_fraction_changed"] = float((ref != 0).float().mean())
    print(json.dumps(out), flush=True)
    return out


def run_ranks(a: argparse.Namespace, model: Path) -> list[dict[str, Any]]:
    """``--world`` FSDP2 ranks, one process and GPU each, on the same batches; rank 0's results."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for r in range(a.world):
        cmd = [sys.executable, __file__, "--only", "rank", "--rank", str(r), "--world", str(a.world), "--port",
               str(port), "--model-dir", str(model), "--model", a.model, "--lengths", a.lengths, "--step-tokens",
               str(a.step_tokens), "--budget", str(a.budget), "--repeats", str(a.repeats)]
        cmd += ["--no-checkpointing"] if a.no_checkpointing else []
        cmd += ["--compile-layers"] if a.compile_layers else []
        cmd += ["--no-reshard"] if a.no_reshard else []
        cmd += ["--logit-chunk-elements", str(a.logit_chunk_elements)] if a.logit_chunk_elements else []
        cmd += ["--profile", a.profile] if a.profile else []
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": str(r)}
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outs = [p.communicate(timeout=1200) for p in procs]
    lines = [ln for ln in outs[0][0].splitlines() if ln.startswith("RESULT ")]
    if not lines:
        raise RuntimeError("rank 0 failed:\n" + outs[0][1][-3000:] + "\nrank 1:\n" + outs[-1][1][-2000:])
    rows = json.loads(lines[-1][7:])
    for row in rows:
        print(json.dumps(row), flush=True)
    return rows


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen3-1.7b", help="a harness.MODELS name")
    p.add_argument("--lengths", default="1024,4096,16384,32768", help="sequence lengths (prompt + completion)")
    p.add_argument("--step-tokens", type=int, default=65536, help="tokens per training step")
    p.add_argument("--budget", type=int, default=16384, help="trainer.maxTokensPerMicroBatch (at least the longest)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--mix-samples", type=int, default=256)
    p.add_argument("--fidelity", default="", help="a harness.MODELS name for the update-fidelity run")
    p.add_argument("--legacy", default="", help="a directory holding another checkout's operator/ (before/after)")
    p.add_argument("--legacy-lengths", default="256,512")
    p.add_argument("--no-checkpointing", action="store_true", help="trainer.gradientCheckpointing false")
    p.add_argument("--world", type=int, default=1, help="FSDP2 over this many GPUs (one process each)")
    p.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--only", default="", help="internal: lengths|legacy|rank")
    p.add_argument("--model-dir", default="", help="build the model here, or reuse the one an earlier run built here")
    p.add_argument("--profile", default="", help="write a kernel-time profile of one step of the first length here")
    p.add_argument("--compile-layers", action="store_true", help="trainer.compile: torch.compile every decoder layer")
    p.add_argument("--skip-mix", action="store_true", help="no long-tailed mix run")
    p.add_argument("--no-reshard", action="store_true",
                   help="trainer.reshardAfterForward false: FSDP2 keeps each layer's gathered parameters from "
                   "forward to backward")
    p.add_argument("--logit-chunk-elements", type=int, default=0,
                   help="output-layer logits per chunk (default: the runtime's LOGIT_CHUNK_ELEMENTS)")
    p.add_argument("--cpu", action="store_true", help="smoke run: the tiny model on CPU")
    p.add_argument("--out", default="")
    a = p.parse_args()
    if a.cpu:
        global PROMPT
        PROMPT = 16
        a.model, a.lengths, a.step_tokens, a.budget, a.repeats, a.mix_samples = "tiny", "64,128", 512, 256, 2, 16
        a.fidelity = a.fidelity or "tiny"
        a.legacy_lengths = "64"
    return a


def main() -> None:
    a = parse()
    import torch

    tmp = Path(tempfile.mkdtemp(prefix="train-step-"))
    if a.only == "rank":  # one FSDP2 rank of --world (its own GPU): the lengths only
        info = json.loads(Path(a.model_dir, "info.json").read_text())
        print("RESULT " + json.dumps(run_lengths(a, Path(a.model_dir), info, legacy=False)), flush=True)
        return
    if a.only == "legacy":  # in the subprocess of --legacy: the other checkout's trainer on the same batches
        info = json.loads(Path(a.model_dir, "info.json").read_text())
        a.lengths = a.legacy_lengths
        print("RESULT " + json.dumps(run_lengths(a, Path(a.model_dir), info, legacy=True)), flush=True)
        return
    model = Path(a.model_dir) if a.model_dir else tmp / a.model
    info = harness.cached_model(model, a.model, not a.cpu)  # --model-dir of an earlier run: the same weights
    prov = harness.provenance()
    result: dict[str, Any] = {"command": prov["command"], "provenance": prov, "model": a.model,
                              "params": info["params"], "device": torch.cuda.get_device_name(0) if not a.cpu else "cpu",
                              "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"),
                              "peak_flops": device_peak()}

    def save() -> None:
        if a.out:
            harness.write_result(a.out, result)

    if a.world > 1:
        result["lengths"] = run_ranks(a, model)
        save()
        return
    result["lengths"] = run_lengths(a, model, info, legacy=False)
    save()
    gc.collect()
    if not a.cpu:
        torch.cuda.empty_cache()
    if not a.skip_mix:
        result["mix"] = run_mix(a, model, info)
        save()
    if a.legacy:
        gc.collect()
        if not a.cpu:
            torch.cuda.empty_cache()
        env = {**os.environ, "TRAIN_STEP_OPERATOR": str(Path(a.legacy, "operator").resolve())}
        cmd = [sys.executable, __file__, "--only", "legacy", "--model-dir", str(model), "--model", a.model,
               "--legacy-lengths", a.legacy_lengths, "--step-tokens", str(a.step_tokens), "--budget", str(a.budget),
               "--repeats", str(a.repeats)] + (["--cpu"] if a.cpu else [])
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900, check=False)
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
        result["legacy"] = json.loads(lines[-1][7:]) if lines else {"error": proc.stderr[-2000:]}
        print(json.dumps(result["legacy"]), flush=True)
        save()
    if a.fidelity:
        result["fidelity"] = run_fidelity(a, a.fidelity, tmp)
        save()


if __name__ == "__main__":
    main()
