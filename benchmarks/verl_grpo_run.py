"""veRL's GRPO on one work description, for ``benchmarks/trl_peer.py`` (run by a Python that has veRL).

    python benchmarks/verl_grpo_run.py WORK.json OUT.json

``WORK.json`` is the file ``trl_peer.py`` writes for every peer (model path, prompts, steps, prompts per step,
samples per prompt, max tokens, temperature, learning rate, length-reward target, vLLM memory share, dtype).
veRL (0.9: its default v1 trainer, FSDP actor, vLLM rollout in its hybrid engine on the same GPU) runs
``python -m verl.trainer.main_ppo`` on a Hydra config written here on top of veRL's ``ppo_trainer``:

* the same prompts as plain text (a one-line chat template that renders a message's content as is, so the
  token ids are the runtime's ``render_prompt`` of a plain prompt), ``prompts_per_step`` prompts x
  ``samples_per_prompt`` samples per step, one optimiser step per batch (``ppo_mini_batch_size`` = the batch),
  micro-batches of ``micro_batch`` samples;
* GRPO advantages, no KL (neither in the reward nor as a loss), clip 0.2, no entropy bonus, the learning rate;
* the same reward: ``1 - |tokens - target| / target`` clipped at 0, on the number of tokens of the decoded
  response (veRL hands a reward function text; the character tokenizer maps each character, and each
  ``<extra_N>`` piece, to one token, so they are counted back that way);
* bf16 weights (``fsdp_config.model_dtype``), SDPA attention (no flash-attn on the image), no gradient
  checkpointing, no remove-padding (it needs flash-attn), vLLM at ``gpu_memory_utilization`` with its defaults
  otherwise (CUDA graphs, veRL's sleep between rollouts unless ``WORK["verl_free_cache_engine"]`` is false).

Per-step wall times come from veRL's own ``timing_s/step`` metric (its file logger), which spans generation,
reward, old log-probabilities, advantages, the update and the weight sync. Writes them, veRL's other per-step
timings and its version, or the error, to ``OUT.json``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"

REWARD = '''import re

TARGET = {target}


def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    tokens = len(re.findall(r"<extra_\\d+>|.", solution_str, re.S))
    return max(0.0, 1.0 - abs(tokens - TARGET) / TARGET)
'''


def tokenizer_for_verl(model: Path, d: Path) -> Path:
    """A copy of the model's tokenizer in which the character tokenizer's last spare token (``<extra_N>``) is
    ``"\\n"``. veRL's agent loop picks its chat-boundary helper by the config's ``model_type`` (``qwen2``: the Qwen
    one), which requires ``"\\n"`` to be one token (``ValueError: Expected Qwen newline to tokenize to one
    token, got []``); the character set has no newline. Every other id is unchanged, so the prompts' ids are
    the same as the other systems'."""
    out = d / "tokenizer"
    out.mkdir(exist_ok=True)
    for f in model.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")) and f.is_file():
            (out / f.name).write_bytes(f.read_bytes())
    tj = json.loads((out / "tokenizer.json").read_text())
    vocab = tj["model"]["vocab"]
    if "\n" not in vocab:
        spare = max((t for t in vocab if t.startswith("<extra_")), key=vocab.__getitem__)
        vocab["\n"] = vocab.pop(spare)
    (out / "tokenizer.json").write_text(json.dumps(tj))
    return out


def config_yaml(work: dict, d: Path) -> str:
    samples = work["prompts_per_step"] * work["samples_per_prompt"]
    micro = min(work.get("micro_batch", 64), samples)
    dtype = {"bfloat16": "bf16", "float32": "fp32"}.get(work.get("dtype", "bfloat16"), "bf16")
    cfg = {
        "hydra": {"searchpath": ["pkg://verl.trainer.config"], "run": {"dir": str(d / "hydra")}},
        "defaults": ["ppo_trainer", "_self_"],
        "algorithm": {"adv_estimator": "grpo", "use_kl_in_reward": False},
        "data": {"train_files": str(d / "train.parquet"), "val_files": str(d / "train.parquet"),
                 "train_batch_size": work["prompts_per_step"], "max_prompt_length": 64,
                 "max_response_length": work["max_tokens"], "shuffle": False, "dataloader_num_workers": 0,
                 "filter_overlong_prompts": False, "truncation": "error"},
        "actor_rollout_ref": {
            "model": {"path": work["model"], "tokenizer_path": str(tokenizer_for_verl(Path(work["model"]), d)),
                      "custom_chat_template": CHAT_TEMPLATE, "use_remove_padding": False,
                      "enable_gradient_checkpointing": False,
                      "override_config": {"attn_implementation": "sdpa"}},
            "actor": {"optim": {"lr": work["learning_rate"]}, "ppo_mini_batch_size": work["prompts_per_step"],
                      "ppo_micro_batch_size_per_gpu": micro, "ppo_epochs": 1, "use_kl_loss": False,
                      "kl_loss_coef": 0.0, "entropy_coeff": 0.0, "clip_ratio": 0.2,
                      "fsdp_config": {"model_dtype": dtype}},
            "rollout": {"name": "vllm", "tensor_model_parallel_size": 1, "n": work["samples_per_prompt"],
                        "temperature": work["temperature"], "gpu_memory_utilization": work["gpu_memory_utilization"],
                        "max_model_len": work["max_model_len"], "log_prob_micro_batch_size_per_gpu": micro,
                        "free_cache_engine": bool(work.get("verl_free_cache_engine", True))},
        },
        # Ray's logical CPUs: veRL's actors (task runner, TransferQueue's controller and storage units, reward and
        # agent-loop workers) ask for more than the 16 cores a lent GPU machine has
        "ray_kwargs": {"ray_init": {"num_cpus": 64}},
        "reward": {"custom_reward_function": {"path": str(d / "reward.py"), "name": "compute_score"}},
        "trainer": {"n_gpus_per_node": 1, "nnodes": 1, "total_training_steps": work["steps"], "total_epochs": 1000,
                    "logger": ["console", "file"], "val_before_train": False, "test_freq": -1, "save_freq": -1,
                    "resume_mode": "disable", "default_local_dir": str(d / "ckpt"),
                    "project_name": "rlhf-peer", "experiment_name": "verl"},
    }
    return json.dumps(cfg, indent=1)  # JSON is YAML


def without_trl(pythonpath: str, d: Path) -> str:
    """``pythonpath`` with every entry that holds TRL replaced by a view of it without TRL. veRL 0.9.1 patches
    TRL's ``AutoModelForCausalLMWithValueHead`` whenever TRL is importable (``monkey_patch.py``), and TRL 1.16,
    staged beside it for the other peer, no longer has that class (``ImportError: cannot import name
    'AutoModelForCausalLMWithValueHead' from 'trl'``): veRL runs as in an environment of its own."""
    out = []
    for i, entry in enumerate(x for x in pythonpath.split(os.pathsep) if x):
        src = Path(entry)
        if not (src / "trl").is_dir():
            out.append(entry)
            continue
        view = d / f"site-without-trl-{i}"
        view.mkdir(exist_ok=True)
        for item in src.iterdir():
            if item.name != "trl" and not item.name.startswith("trl-") and not (view / item.name).exists():
                (view / item.name).symlink_to(item)
        out.append(str(view))
    return os.pathsep.join(out)


def main() -> int:
    work = json.loads(Path(sys.argv[1]).read_text())
    out = Path(sys.argv[2])
    d = out.parent / "verl-work"
    d.mkdir(parents=True, exist_ok=True)
    result: dict = {"work": work, "steps": []}
    try:
        import pandas as pd
        import verl
        import vllm

        result["versions"] = {"verl": verl.__version__, "vllm": vllm.__version__}
        rows = [{"data_source": "length", "prompt": [{"role": "user", "content": p}],
                 "reward_model": {"style": "rule", "ground_truth": str(work["target_length"])},
                 "extra_info": {"index": i}} for i, p in enumerate(work["prompts"])]
        pd.DataFrame(rows).to_parquet(d / "train.parquet")
        (d / "reward.py").write_text(REWARD.format(target=work["target_length"]))
        (d / "work.yaml").write_text(config_yaml(work, d))
        metrics = d / "metrics.jsonl"
        env = {**os.environ, "VERL_FILE_LOGGER_PATH": str(metrics), "PYTHONUNBUFFERED": "1"}
        # veRL runs vLLM as its own servers (AsyncLLM in Ray actors): leave vLLM's process layout to it
        env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
        env["PYTHONPATH"] = without_trl(env.get("PYTHONPATH", ""), d)
        t = time.perf_counter()
        with (d / "verl.log").open("w") as log:
            rc = subprocess.run([sys.executable, "-m", "verl.trainer.main_ppo", f"--config-path={d}",
                                 "--config-name=work"], stdout=log, stderr=subprocess.STDOUT, env=env,
                                check=False).returncode
        result["train_seconds"] = time.perf_counter() - t
        for line in metrics.read_text().splitlines() if metrics.exists() else []:
            rec = json.loads(line)
            data = rec.get("data", {})
            if "timing_s/step" in data:
                result["steps"].append({"step": rec["step"], "seconds": data["timing_s/step"],
                                        "timing": {k: v for k, v in data.items() if k.startswith("timing_s/")},
                                        "reward_mean": data.get("critic/score/mean"),
                                        "response_length_mean": data.get("response_length/mean")})
        result["ok"] = rc == 0 and bool(result["steps"])
        if not result["ok"]:
            result["error"] = f"veRL exit {rc}, {len(result['steps'])} steps logged"
            result["traceback"] = (d / "verl.log").read_text(errors="replace")[-8000:]
    except Exception as e:  # noqa: BLE001 - the error is the result
        result["ok"] = False
        result["error"] = f"{type(e).__name__}: {e}"[:4000]
        result["traceback"] = traceback.format_exc()[-8000:]
    out.write_text(json.dumps(result, indent=2) + "\n")
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
