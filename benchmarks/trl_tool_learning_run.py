"""TRL's ``GRPOTrainer`` with a tool on ``tool_learning.py``'s task, from its tools checkpoint (run by a Python that
has TRL).

    python benchmarks/trl_tool_learning_run.py WORK.json OUT.json

``WORK.json`` (written by ``tool_learning.py --trl-python``): the tools checkpoint, the training prompts with their
answers **in the order the runtime's driver takes them** (``rlhf_runtime.algo.data.step_batch`` for the run's
seed), and the hyperparameters of the runtime's run beside it. TRL is configured per its own documentation for
tool use (``GRPOTrainer(tools=[...])``, a plain function with type hints and a Google-style docstring; the
tokenizer's response template set by hand, as TRL asks for a chat template it does not know) and otherwise by
``trl_learning_run.grpo_config``, as for the runtime's work there:

* the tool: ``python(code)``, a coroutine that runs the code through the runtime's own builtin python tool
  (``rlhf_runtime.agent.tools.Tools``: the same isolated process, limits and answer text, errors included), so
  both sides' trajectories see the same observations; its schema, made by transformers from the signature and
  docstring, is the one ``tool_learning.PYTHON_TOOL`` gives the runtime, so the prompts are the same tokens;
* the same turns and budget: at most ``max_turns`` generations (``max_tool_calling_iterations`` = turns - 1), the
  completion budget the runtime's ``maxTokens`` leaves after the longest prompt;
* the same reward: exact match of the last assistant message's content with the answer (the runtime's
  ``exactMatch`` on the final answer);
* vLLM in colocate mode, one optimiser step per rollout batch, clip 0.2, no KL, the runtime's defaults for the
  loss aggregation, advantages, optimiser and importance-sampling correction; float32 weights with bfloat16
  autocast.

Scoring: at every ``eval_every`` steps and the last, the trainer's weights are saved in bfloat16 under
``OUT.json``'s folder (``<stem>-step<N>``); ``tool_learning.py`` scores them with the runtime's own greedy
multi-turn evaluation, as it scores its own runs, so both sides are scored by one evaluator.

Writes OUT.json: per step the seconds since the parent launched this process (``work["launched"]``, epoch),
TRL's step time (callback step begin -> step end: generation with the tool calls, weight sync, reward, the
update), its logged reward and tool-call figures, how the calls that reached the tool ended (``tool_runs``: TRL
counts a call whose name or arguments do not fit the function as a failure without running it); the saved
checkpoints; versions; or the error.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT.parent / "operator"))
sys.path.insert(0, str(ROOT))

#: TRL's logged keys kept per step (the rest of its log is not recorded).
LOGGED = ("reward", "loss", "entropy", "grad_norm", "tools/call_frequency", "tools/failure_frequency",
          "completions/mean_length", "completions/clipped_ratio")


def python_tool(tools):
    """The runtime's builtin python tool as a TRL tool: a coroutine with the signature and docstring that give
    ``tool_learning.PYTHON_TOOL``'s schema; it answers what the runtime's rollout would give the model."""
    from rlhf_runtime.agent.calls import Call

    async def python(code: str):
        """Run Python code and see what it prints.

        Args:
            code: The Python code to run.
        """
        out = await tools.call(Call("python", {"code": code}))
        python.runs[out.error or "ok"] = python.runs.get(out.error or "ok", 0) + 1
        return out.text

    python.runs = {}  # how the calls that reached the tool ended, by the runtime's kinds (TRL counts the others)
    return python


def last_answer(completion) -> str:
    """The content of a conversational completion's last assistant message ('' if it has none)."""
    if isinstance(completion, str):
        return completion
    return next((m.get("content") or "" for m in reversed(completion) if m.get("role") == "assistant"), "")


class Run:
    """The result file and the clock of one run."""

    def __init__(self, work: dict, out: Path) -> None:
        self.work, self.out = work, out
        self.launched = work.get("launched", time.time())
        self.result: dict = {"work": {k: v for k, v in work.items() if k != "train"}, "steps": [], "checkpoints": []}

    def since(self) -> float:
        return round(time.time() - self.launched, 2)

    def save(self) -> None:
        self.out.write_text(json.dumps(self.result, indent=1) + "\n")

    def checkpoint(self, model, tok, step: int) -> None:
        """A bfloat16 copy of ``model`` (what the runtime's engine serves; the float32 weights train on unchanged)."""
        import torch

        path = self.out.parent / f"{self.out.stem}-step{step}"
        t = time.perf_counter()
        model.save_pretrained(str(path), state_dict={k: v.detach().to(torch.bfloat16)
                                                     for k, v in model.state_dict().items()})
        tok.save_pretrained(str(path))
        self.result["checkpoints"].append({"step": step, "path": str(path), "seconds": self.since(),
                                           "save_seconds": round(time.perf_counter() - t, 3)})


def recorder(run: Run, tok, tool):
    """A TrainerCallback recording each step (time, TRL's log, the tool's runs) and saving the checkpoints."""
    from transformers import TrainerCallback

    class Record(TrainerCallback):
        def on_train_begin(self, args, state, control, **kw):
            run.result["train_begin"] = run.since()
            run.save()

        def on_step_begin(self, args, state, control, **kw):
            self.t = time.perf_counter()

        def on_step_end(self, args, state, control, model=None, **kw):
            took, step = time.perf_counter() - self.t, state.global_step
            run.result["steps"].append({"step": step, "seconds": run.since(), "step_seconds": round(took, 4),
                                        "tool_runs": dict(tool.runs)})
            tool.runs.clear()
            if step % run.work["eval_every"] == 0 or step == run.work["steps"]:
                run.checkpoint(model, tok, step)
            run.save()

        def on_log(self, args, state, control, logs=None, **kw):
            # the log of step N arrives after on_step_end of step N: attach it then
            steps = run.result["steps"]
            if logs and steps and steps[-1]["step"] == state.global_step:
                steps[-1].update({k: logs[k] for k in LOGGED if k in logs})

    return Record()


def exact_match(completions, answer, **_):
    """The runtime's ``exactMatch`` on the final answer."""
    return [float(last_answer(c).strip() == a.strip()) for c, a in zip(completions, answer)]


def train(run: Run) -> None:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # TRL reaches into the engine's worker
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    import torch
    import transformers
    import trl
    from datasets import Dataset
    from tool_learning import runtime_tools
    from transformers import AutoTokenizer
    from transformers.utils import get_json_schema
    from trl import GRPOTrainer
    from trl.chat_template_utils import qwen3_template
    from trl_learning_run import grpo_config

    work = run.work
    run.result["versions"] = {"trl": trl.__version__, "torch": torch.__version__,
                              "transformers": transformers.__version__}
    if work["use_vllm"]:
        import vllm
        run.result["versions"]["vllm"] = vllm.__version__
    run.result["imported_at"] = run.since()
    tok = AutoTokenizer.from_pretrained(work["model"])
    # the tiny chat template is Qwen2.5's ChatML shape with Hermes tool calls: TRL's Qwen3 response template
    # parses it (TRL sets it itself only for chat templates it recognises verbatim)
    tok.response_template = qwen3_template
    tool = python_tool(runtime_tools())
    if json.dumps(get_json_schema(tool)) != json.dumps(work["tool_schema"]):  # in order: the template keeps it
        raise SystemExit(f"TRL's schema of the tool {get_json_schema(tool)} is not the runtime's "
                         f"{work['tool_schema']}: the prompts would differ")
    dataset = Dataset.from_list([{"prompt": [{"role": "user", "content": q}], "answer": a} for q, a in work["train"]])
    trainer = GRPOTrainer(model=work["model"], reward_funcs=exact_match, args=grpo_config(
                              work, run.out, max_completion_length=work["max_completion_tokens"],
                              max_tool_calling_iterations=work["max_turns"] - 1),
                          train_dataset=dataset, processing_class=tok, tools=[tool],
                          callbacks=[recorder(run, tok, tool)])
    run.result["trainer_ready"] = run.since()
    t = time.perf_counter()
    trainer.train()
    run.result["train_seconds"] = round(time.perf_counter() - t, 2)


def main() -> int:
    run = Run(json.loads(Path(sys.argv[1]).read_text()), Path(sys.argv[2]))
    try:
        train(run)
        run.result["ok"] = True
    except BaseException as e:  # noqa: BLE001 - the error is the result (SystemExit included)
        run.result["ok"] = False
        run.result["error"] = f"{type(e).__name__}: {e}"[:4000]
        run.result["traceback"] = traceback.format_exc()[-8000:]
    run.result["finished"] = run.since()
    run.save()
    return 0 if run.result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
