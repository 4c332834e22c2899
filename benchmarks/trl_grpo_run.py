"""TRL's ``GRPOTrainer`` on one work description, for ``benchmarks/trl_peer.py`` (run by a Python that has TRL).

    python benchmarks/trl_grpo_run.py WORK.json OUT.json

``WORK.json`` (written by ``trl_peer.py``): model path, prompts, steps, prompts per step, samples per prompt,
max tokens, temperature, learning rate, length-reward target, vLLM memory share, device (cpu|cuda), dtype of the
weights (the runtime's ``model.dtype``; on cuda also TRL's bf16 mixed precision), the micro-batch
(``per_device_train_batch_size``), whether the engine sleeps between rollouts (``vllm_enable_sleep_mode``) and
gradient checkpointing. TRL runs with
vLLM in colocate mode (``use_vllm=True, vllm_mode="colocate"``: the engine in the trainer's process), one
optimiser step per rollout batch (``per_device_train_batch_size`` x ``gradient_accumulation_steps`` = prompts x
samples, ``steps_per_generation`` = the accumulation steps), the same reward (``1 - |tokens - target| / target``
clipped at 0, the runtime's ``length`` rule), no KL (``beta=0``), clip 0.2. Writes per-step wall times (trainer
callbacks: step begin -> step end, which covers generation, weight sync, scoring and the update) with TRL's logged
metrics and, on a GPU, memory, or the error.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from pathlib import Path


def step_recorder(result: dict, out: Path, cuda: bool):
    """A trainer callback that records per optimiser step its wall time, TRL's logged metrics (completion lengths
    among them) and, on a GPU, the step's peak allocated and the device memory in use at its end (the sleeping
    engine's included), writing ``result`` to ``out`` after each step."""
    import torch
    from transformers import TrainerCallback

    class Times(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            self.t = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            row = {"step": state.global_step, "seconds": time.perf_counter() - self.t}
            if cuda:
                free, total = torch.cuda.mem_get_info()
                row.update(peak_allocated_gib=torch.cuda.max_memory_allocated() / 2**30,
                           device_used_gib=(total - free) / 2**30)
            result["steps"].append(row)
            out.write_text(json.dumps(result, indent=2) + "\n")

        def on_log(self, args, state, control, logs=None, **kw):
            if result["steps"] and logs and "logs" not in result["steps"][-1]:  # not the run summary
                result["steps"][-1]["logs"] = {k: v for k, v in logs.items() if isinstance(v, (int, float))}

    return Times()


def grpo_config(work: dict, out: Path):
    """TRL's ``GRPOConfig`` for ``work``: one optimiser step per rollout batch of prompts x samples."""
    from trl import GRPOConfig

    samples = work["prompts_per_step"] * work["samples_per_prompt"]
    micro = min(work.get("micro_batch", 64), samples)
    accumulation = samples // micro
    cpu = work["device"] == "cpu"
    return GRPOConfig(
        output_dir=str(out.parent / "trl-out"), max_steps=work["steps"], learning_rate=work["learning_rate"],
        per_device_train_batch_size=micro, gradient_accumulation_steps=accumulation,
        steps_per_generation=accumulation, num_generations=work["samples_per_prompt"],
        max_completion_length=work["max_tokens"], temperature=work["temperature"], beta=0.0, epsilon=0.2,
        num_iterations=1, use_vllm=True, vllm_mode="colocate",
        vllm_gpu_memory_utilization=work["gpu_memory_utilization"], vllm_max_model_length=work["max_model_len"],
        use_cpu=cpu, bf16=not cpu, fp16=False, gradient_checkpointing=work.get("gradient_checkpointing", False),
        vllm_enable_sleep_mode=work.get("sleep", False),
        model_init_kwargs={"dtype": work.get("dtype", "float32")}, logging_steps=1, report_to=[], save_strategy="no",
        seed=work.get("seed", 0), dataloader_num_workers=0, disable_tqdm=True,
    )


def main() -> int:
    work = json.loads(Path(sys.argv[1]).read_text())
    out = Path(sys.argv[2])
    result: dict = {"work": work, "steps": []}
    try:
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # TRL reaches into the engine's worker
        import torch
        import trl
        import vllm
        from datasets import Dataset
        from trl import GRPOTrainer

        result["versions"] = {"trl": trl.__version__, "vllm": vllm.__version__}
        target = work["target_length"]

        def length_reward(completions, completion_ids, **_):
            return [max(0.0, 1.0 - abs(len(ids) - target) / target) for ids in completion_ids]

        recorder = step_recorder(result, out, torch.cuda.is_available() and work["device"] == "cuda")
        dataset = Dataset.from_list([{"prompt": p} for p in work["prompts"]])
        trainer = GRPOTrainer(model=work["model"], reward_funcs=length_reward, args=grpo_config(work, out),
                              train_dataset=dataset, callbacks=[recorder])
        t = time.perf_counter()
        trainer.train()
        result["train_seconds"] = time.perf_counter() - t
        result["ok"] = True
    except Exception as e:  # noqa: BLE001 - the error is the result
        result["ok"] = False
        result["error"] = f"{type(e).__name__}: {e}"[:4000]
        result["traceback"] = traceback.format_exc()[-8000:]
    out.write_text(json.dumps(result, indent=2) + "\n")
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
