"""TRL's ``GRPOTrainer`` on ``gpu_learning.py``'s task, from its checkpoint (run by a Python that has TRL).

    python benchmarks/trl_learning_run.py WORK.json OUT.json

``WORK.json`` (written by ``gpu_learning.py --trl``): the supervised checkpoint, the training prompts with their
answers **in the order the runtime's driver takes them** (``rlhf_runtime.algo.data.step_batch`` for the run's
seed, step after step), the eval problems, and the hyperparameters of the runtime's run beside it. TRL runs with
vLLM in colocate mode (``use_vllm=True, vllm_mode="colocate"``: the engine in the trainer's process) and

* the same prompts per step: the dataset is the driver's sequence and TRL's sampler does not shuffle it
  (``shuffle_dataset=False``), so TRL's step ``s`` samples exactly the runtime's step-``s`` prompts;
* the same reward: the runtime's ``exactMatch`` rule (``rlhf_runtime.algo.rewards``: 1.0 if the stripped
  completion equals the stripped answer, else 0.0) on the completion decoded without special tokens;
* one optimiser step per rollout batch (``per_device_train_batch_size`` x ``gradient_accumulation_steps`` =
  prompts x samples, ``steps_per_generation`` = the accumulation steps), clip 0.2, no KL (``beta=0``), the
  loss averaged over every completion token of the batch (TRL's default ``dapo``, the runtime's ``token``
  aggregation), group-normalised advantages (TRL's default ``scale_rewards="group"``), AdamW at a constant
  learning rate (the runtime has no schedule; TRL's default would decay it linearly), weight decay 0, betas
  (0.9, 0.999), gradient clipping at 1.0 (both sides' defaults);
* the importance-sampling correction set to the runtime's default (``tis``/token/2: per-token weights truncated
  at 2, ``vllm_importance_sampling_mode="token_truncate"``, ``..._clip_max=2``);
* precision: float32 weights and optimiser with bfloat16 autocast (``bf16=True``): the runtime's float32 master
  weights with bfloat16 compute.

Scoring: every ``eval_every`` steps (callback ``on_step_end``) ``gpu_learning.greedy_accuracy`` on the trainer's
weights rounded to bfloat16 (what the runtime exports and its engine serves), on the same held-out problems that
``gpu_learning.py`` scores the runtime's exports with. Its time is recorded (``eval_seconds``) and is part of the
wall-clock, as the runtime's evaluations are of its own.

Writes OUT.json: per step the seconds since the parent launched this process (``work["launched"]``, epoch),
TRL's step time (callback step begin -> step end: generation, weight sync, reward, the update) and its logged
reward; the evals; versions; or the error.
"""

from __future__ import annotations

import copy
import json
import os
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))


def grpo_config(work: dict, out: Path, **extra):
    """TRL's ``GRPOConfig`` for the runtime's run described by ``work`` (the module's docstring), with ``extra``
    (e.g. ``max_completion_length``) on top."""
    from trl import GRPOConfig

    cpu = work["device"] == "cpu"
    samples = work["prompts_per_step"] * work["samples_per_prompt"]
    micro = min(work.get("micro_batch", 64), samples)
    accumulation = samples // micro
    return GRPOConfig(
        output_dir=str(out.parent / f"trl-out-{out.stem}"), max_steps=work["steps"],
        learning_rate=work["learning_rate"], lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
        adam_beta1=0.9, adam_beta2=0.999, max_grad_norm=1.0,
        per_device_train_batch_size=micro, gradient_accumulation_steps=accumulation,
        steps_per_generation=accumulation, num_generations=work["samples_per_prompt"],
        temperature=work["temperature"], top_p=1.0,
        beta=0.0, epsilon=work["clip"], num_iterations=1, loss_type="dapo", scale_rewards="group",
        shuffle_dataset=False,
        use_vllm=work["use_vllm"], vllm_mode="colocate",
        vllm_gpu_memory_utilization=work["gpu_memory_utilization"], vllm_max_model_length=work["max_model_len"],
        vllm_importance_sampling_correction=True, vllm_importance_sampling_mode="token_truncate",
        vllm_importance_sampling_clip_max=2.0,
        use_cpu=cpu, bf16=not cpu, fp16=False, gradient_checkpointing=False,
        model_init_kwargs={"dtype": "float32"}, logging_steps=1, report_to=[], save_strategy="no",
        seed=work["seed"], data_seed=work["seed"], dataloader_num_workers=0, disable_tqdm=True, **extra,
    )


def main() -> int:
    work = json.loads(Path(sys.argv[1]).read_text())
    out = Path(sys.argv[2])
    launched = work.get("launched", time.time())
    result: dict = {"work": {k: v for k, v in work.items() if k not in ("train", "eval")}, "steps": [], "eval": []}

    def since() -> float:
        return round(time.time() - launched, 2)

    def save() -> None:
        out.write_text(json.dumps(result, indent=1) + "\n")

    try:
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # TRL reaches into the engine's worker
        import torch
        import transformers
        import trl
        from datasets import Dataset
        from gpu_learning import greedy_accuracy
        from transformers import AutoTokenizer, TrainerCallback
        from trl import GRPOTrainer

        result["versions"] = {"trl": trl.__version__, "torch": torch.__version__,
                              "transformers": transformers.__version__}
        if work["use_vllm"]:
            import vllm
            result["versions"]["vllm"] = vllm.__version__
        result["imported_at"] = since()
        cpu = work["device"] == "cpu"
        device = torch.device("cpu" if cpu else "cuda")
        tok = AutoTokenizer.from_pretrained(work["model"])
        eval_rows = [tuple(r) for r in work["eval"]]
        max_new = work["max_tokens"]

        def exact_match(completions, answer, **_):
            return [float(c.strip() == a.strip()) for c, a in zip(completions, answer)]

        def score(model) -> float:
            """Greedy exact match of ``model``'s weights rounded to bfloat16 (computed as gpu_learning scores)."""
            m = copy.deepcopy(model).to(torch.bfloat16).to(torch.float32).eval()
            acc = greedy_accuracy(m, tok, eval_rows, device, max_new)
            del m
            return acc

        class Record(TrainerCallback):
            def on_train_begin(self, args, state, control, **kw):
                result["train_begin"] = since()
                save()

            def on_step_begin(self, args, state, control, **kw):
                self.t = time.perf_counter()

            def on_step_end(self, args, state, control, model=None, **kw):
                took = time.perf_counter() - self.t
                step = state.global_step
                rec = {"step": step, "seconds": since(), "step_seconds": round(took, 4)}
                logged = next((h for h in reversed(state.log_history) if h.get("step") == step), {})
                for k in ("reward", "loss", "entropy", "clip_ratio/region_mean", "grad_norm"):
                    if k in logged:
                        rec[k.split("/")[0]] = logged[k]
                if step % work["eval_every"] == 0 or step == work["steps"]:
                    t = time.perf_counter()
                    acc = score(model)
                    rec["eval_seconds"] = round(time.perf_counter() - t, 3)
                    result["eval"].append({"step": step, "exact_match": acc, "seconds": since()})
                    print(f"trl step {step}: exact match {acc:.3f}", flush=True)
                result["steps"].append(rec)
                save()

            def on_log(self, args, state, control, logs=None, **kw):
                # the log of step N arrives after on_step_end of step N: attach it then
                if logs and result["steps"] and result["steps"][-1]["step"] == state.global_step:
                    for k in ("reward", "loss", "entropy", "grad_norm"):
                        if k in logs:
                            result["steps"][-1][k] = logs[k]

        config = grpo_config(work, out, max_completion_length=work["max_tokens"])
        dataset = Dataset.from_list([{"prompt": p, "answer": a} for p, a in work["train"]])
        trainer = GRPOTrainer(model=work["model"], reward_funcs=exact_match, args=config, train_dataset=dataset,
                              processing_class=tok, callbacks=[Record()])
        result["trainer_ready"] = since()
        t = time.perf_counter()
        trainer.train()
        result["train_seconds"] = round(time.perf_counter() - t, 2)
        result["ok"] = True
    except Exception as e:  # noqa: BLE001 - the error is the result
        result["ok"] = False
        result["error"] = f"{type(e).__name__}: {e}"[:4000]
        result["traceback"] = traceback.format_exc()[-8000:]
    result["finished"] = since()
    save()
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
