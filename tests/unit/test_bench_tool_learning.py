"""``benchmarks/tool_learning.py``: the supervised trajectories are the runtime's chat rendering with the loss on the
assistant's own tokens, the problem sets are disjoint, and the summary reads the last evals of finished runs and
the first (step 0) of every run."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import tool_learning as m


def test_the_loss_mask_covers_each_assistant_turn_to_its_end_token_and_nothing_else(tmp_path: Path) -> None:
    from rlhf_testing.tiny_chat import build_chat_tokenizer
    from transformers import AutoTokenizer

    build_chat_tokenizer(tmp_path)
    tok = AutoTokenizer.from_pretrained(str(tmp_path))
    tools = m.runtime_tools()
    assert m.tool_output_format(tools) == "{}\n"  # the runtime's python tool prints the product and a newline
    ids, mask = m.encode(tok, m.conversation(48, 73, "tools", "{}\n"), tools.schemas())
    kept = [i for i, k in zip(ids, mask) if k]
    assert tok.decode(kept) == ('<tool_call>{"name": "python", "arguments": {"code": "print(48*73)"}}</tool_call>'
                                "<|im_end|>3504<|im_end|>")
    text = tok.decode(ids)
    assert "Tools:" in text and "<tool_response>\n3504\n\n</tool_response>" in text  # schema and observation
    ids, mask = m.encode(tok, m.conversation(48, 73, "single", "{}\n"), None)
    assert tok.decode([i for i, k in zip(ids, mask) if k]) == "3504<|im_end|>" and "Tools:" not in tok.decode(ids)


def test_problem_sets_are_disjoint_and_of_the_digits_asked() -> None:
    held = m.problems(2, 1, 50)
    train = m.problems(2, 2, 500, frozenset(held))
    assert len(set(held)) == 50 and not set(held) & set(train)
    assert all(10 <= x < 100 and 10 <= y < 100 for x, y in held + train)


def test_the_summary_takes_finished_runs_last_evals_and_the_start_of_every_run() -> None:
    def run(arm: str, start: float, acc: float, code: int = 0) -> dict:
        return {"arm": arm, "learning_rate": 2e-5, "exit_code": code,
                "eval": [{"step": 0, "accuracy": start}, {"step": 9, "accuracy": acc}]}

    s = m.summary([run("tools", 0.1, 0.6), run("tools", 0.3, 0.5), run("single", 0.02, 0.1),
                   run("single", 0.04, 0.9, code=1)], 9)
    assert s["tools_accuracy"] == 0.55 and s["single_turn_accuracy"] == 0.1  # the failed run left out
    assert s["tools_accuracy_at_start"] == 0.2 and s["single_turn_accuracy_at_start"] == 0.03  # its start kept
    assert abs(s["tools_over_single_turn"] - 5.5) < 1e-9
    assert s["tools_at_least_2x_single_turn"] is True
    zero = m.summary([run("tools", 0.1, 0.4), run("single", 0.0, 0.0)], 9)
    assert zero["tools_over_single_turn"] is None and zero["tools_at_least_2x_single_turn"] is True
    assert m.summary([run("tools", 0.1, 0.0), run("single", 0.0, 0.0)], 9)["tools_at_least_2x_single_turn"] is False
    assert m.summary([run("tools", 0.1, 0.3), run("single", 0.0, 0.2)], 9)["tools_at_least_2x_single_turn"] is False


def test_the_summary_sets_trl_beside_the_runtime_from_the_same_checkpoint_and_times_steps_after_the_first() -> None:
    def run(arm: str, acc: float, steps: list[float], code: int = 0) -> dict:
        return {"arm": arm, "exit_code": code, "eval": [{"step": 0, "accuracy": 0.5}, {"step": 2, "accuracy": acc}],
                "steps": [{"step": i + 1, "step_seconds": t} for i, t in enumerate(steps)]}

    s = m.summary([run("tools", 0.7, [9.0, 2.0, 4.0]), run("single", 0.0, [1.0, 0.5, 0.5]),
                   run("trl-tools", 0.6, [30.0, 8.0, 6.0])], 3)
    assert s["trl_tools_accuracy"] == 0.6 and s["tools_accuracy"] == 0.7
    assert s["tools_step_seconds"]["median"] == 3.0 and s["tools_step_seconds"]["n"] == 2  # step 1 left out
    assert s["tools_step_seconds"]["loop_seconds"] == [15.0]
    assert s["trl_tools_step_seconds"]["median"] == 7.0 and abs(s["tools_step_speedup_vs_trl"] - 7 / 3) < 1e-9
    failed = m.summary([run("tools", 0.7, [9.0, 2.0]), run("trl-tools", 0.6, [30.0, 8.0], code=1)], 2)
    assert failed["trl_tools_accuracy"] is None and failed["tools_step_speedup_vs_trl"] is None
    assert "trl_tools_accuracy" not in m.summary([run("tools", 0.7, [9.0, 2.0])], 2)


def test_the_trl_arm_gets_the_runtime_s_tool_schema_and_reads_the_final_answer_of_a_conversation() -> None:
    import json

    import trl_tool_learning_run as trl_run
    from transformers.utils import get_json_schema

    tools = m.runtime_tools()
    assert json.dumps(get_json_schema(trl_run.python_tool(tools))) == json.dumps(tools.schemas()[0])
    call = {"role": "assistant", "content": "", "tool_calls": [{"type": "function"}]}
    tool = {"role": "tool", "name": "python", "content": "372586\n"}
    assert trl_run.last_answer([call, tool, {"role": "assistant", "content": " 372586 "}]) == " 372586 "
    assert trl_run.last_answer([call, tool]) == ""  # the turns ran out on a call: no answer
    assert trl_run.last_answer([tool]) == "" and trl_run.last_answer("42") == "42"


def test_trl_gets_the_trajectory_budget_left_after_the_longest_prompt_with_the_tool(tmp_path: Path) -> None:
    from rlhf_testing.tiny_chat import build_chat_tokenizer
    from transformers import AutoTokenizer

    build_chat_tokenizer(tmp_path)
    tok = AutoTokenizer.from_pretrained(str(tmp_path))
    short, long = m.question(12, 34), m.question(123, 456)
    text = tok.apply_chat_template([{"role": "user", "content": long}], tools=m.runtime_tools().schemas(),
                                   add_generation_prompt=True, tokenize=False)
    assert "The Python code to run." in text and text.endswith("<|im_start|>assistant\n")
    prompt = len(tok.encode(text, add_special_tokens=False))
    assert prompt > 200  # the tool's schema is in it, one token per byte
    assert m.completion_budget(tok, [short, long, short]) == m.MAX_TRAJECTORY_TOKENS - prompt
    assert m.completion_budget(tok, [short]) == m.MAX_TRAJECTORY_TOKENS - prompt + 2  # two digits shorter


def test_work_keeps_the_runs_for_a_later_call_with_the_same_settings_only(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(sys, "argv", ["tool_learning.py", "--out", str(tmp_path), "--work", str(tmp_path / "w"),
                                      "--grpo-steps", "20"])
    a = m.arguments()
    assert m.resumed(a, tmp_path) is None  # nothing kept yet
    run = {"arm": "tools", "seed": 0, "exit_code": 0, "eval": [], "steps": []}
    m.keep(a, tmp_path, {"supervised": {"tools": {"steps": 5}}, "runs": [run], "date": "2026-12-07T19:00:00"})
    first = m.resumed(a, tmp_path)  # a second call, as main() resumes it
    m.keep(a, tmp_path, {"supervised": first["supervised"], "runs": first["runs"], "date": "2026-12-07T20:00:00",
                         "resumed": {"dates": first["dates"]}})
    kept = m.resumed(a, tmp_path)
    assert kept["runs"] == [run] and kept["supervised"]["tools"]["steps"] == 5
    assert kept["dates"] == ["2026-12-07T19:00:00", "2026-12-07T20:00:00"]  # every call that added to it
    a.grpo_steps, a.lr = 40, 1e-5
    with pytest.raises(SystemExit, match=r"other settings \(grpo_steps, lr\)"):
        m.resumed(a, tmp_path)
