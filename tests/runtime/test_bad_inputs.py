"""Malformed runtime inputs end to end: the real driver (``--local``) reports ``Failed`` with a message that says
what to fix, fails fast (before Ray) where the input can be checked up front, and leaves the checkpoints that
were written before a late failure complete and loadable."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from rlhf_runtime.infra import checkpoint as ckpt
from tests.runtime.conftest import Run, job_config, start_driver, write_config

pytestmark = pytest.mark.runtime

RAY_STARTED = "Started a local Ray instance"


def _failed(run: Run, timeout: float) -> str:
    """The message of the run's final ``Failed`` report (the run must exit 1)."""
    assert run.wait(timeout=timeout) == 1, run.tail()
    records = run.records()
    assert records and records[-1]["runtime"]["state"] == "Failed", (records, run.tail())
    return records[-1]["runtime"]["message"]


def _fails_before_ray(run: Run) -> str:
    msg = _failed(run, timeout=180)
    assert [r["runtime"]["state"] for r in run.records()] == ["Failed"]  # no "Starting": no actor was started
    assert RAY_STARTED not in run.log.read_text(errors="replace")
    return msg


# ----------------------------------------------------------------------------------------- prompts files
@pytest.mark.parametrize(
    ("name", "content", "expected"),
    [
        ("prompts.jsonl", b"\x00\x01\x02\x03" * 64,
         "the file is binary (a NUL byte at line 1, byte offset 0), not text; it must be UTF-8 text"),
        ("prompts.txt", "what is 2+2\ncafé au lait\n".encode("latin-1"),
         "not UTF-8 text: byte 0xe9 at line 2 (byte offset 15) is invalid UTF-8; convert the file to UTF-8"),
        ("prompts.jsonl", b'{"prompt": "a"}\nsay 7\n',
         "line 2: not a JSON object ('say 7'): a .jsonl/.ndjson/.json file needs one JSON object per line"),
        ("prompts.jsonl", b'{"prompt": "a"}\n{"question": "2+2", "answer": "4"}\n',
         ("line 2: the JSON object has no 'prompt' field (its fields: 'question', 'answer'); every JSON line "
          "needs a string 'prompt'")),
        ("prompts.jsonl", b"\n\n", "no prompts (the file is 2 lines, all blank); it needs at least one prompt"),
    ],
    ids=["binary", "not-utf8", "not-json-lines", "no-prompt-field", "empty"],
)
def test_bad_prompts_file_fails_before_ray_with_what_to_fix(
    tiny_model: Path, tmp_path: Path, name: str, content: bytes, expected: str
) -> None:
    data = tmp_path / name
    data.write_bytes(content)
    spec = job_config(tiny_model)
    spec["data"] = {"path": str(data)}
    run = start_driver(tmp_path, write_config(tmp_path / "job.json", spec))
    msg = _fails_before_ray(run)
    assert msg.startswith(f"DataError: spec.data.path {data}: {expected}"), msg


def test_missing_prompts_file_fails_before_ray(tiny_model: Path, tmp_path: Path) -> None:
    spec = job_config(tiny_model)
    spec["data"] = {"path": str(tmp_path / "nope.jsonl")}
    run = start_driver(tmp_path, write_config(tmp_path / "job.json", spec))
    assert _fails_before_ray(run) == (
        f"DataError: spec.data.path {tmp_path / 'nope.jsonl'}: no such file (is its volume mounted in the pod?)")


# ----------------------------------------------------------------------------------------------- model
def test_missing_model_path_fails_before_ray_naming_the_field(tiny_model: Path, tmp_path: Path) -> None:
    spec = job_config(tiny_model)
    spec["model"] = {**spec["model"], "name": str(tmp_path / "no-such-model")}
    run = start_driver(tmp_path, write_config(tmp_path / "job.json", spec))
    msg = _fails_before_ray(run)
    assert f"spec.model.name {tmp_path / 'no-such-model'}" in msg and "does not exist" in msg, msg


# ------------------------------------------------------------------------------------------ reward hooks
def _hook_env(tmp_path: Path, module: str, body: str) -> dict[str, str]:
    """A reward hook module ``module`` with function ``score`` in ``tmp_path``, importable by the driver."""
    (tmp_path / f"{module}.py").write_text(textwrap.dedent(body))
    return {"PYTHONPATH": os.pathsep.join([str(tmp_path), *filter(None, [os.environ.get("PYTHONPATH")])])}


def _hook_job(tiny_model: Path, module: str, steps: int, **over: Any) -> dict[str, Any]:
    spec = job_config(tiny_model, algorithm={"steps": steps, "promptsPerStep": 4},
                      rollout={"sampling": {"temperature": 1.0, "maxTokens": 4, "samplesPerPrompt": 4}}, **over)
    spec["reward"] = {"function": f"{module}:score"}
    return spec


# Where the sample is named: "on a sample (prompt ..., completion ...)" today; "on sample <i> of step <s> (...)"
# once the driver passes index= and step= to the reward function (see the report).
SAMPLE = r"on (a sample|sample \d+ of step {step}) \(prompt '.*', completion '.*'\)"


# A bad result end to end (driver -> Failed report, checkpoints intact): a hook that raises from step 3 on. Every kind of
# bad result (a raise, nan, inf, None, text, ...) and its message is checked on the reward function itself in
# tests/unit/test_runtime_data_rewards.py, without a Ray + vLLM run each.
FLAKY = """
    calls = 0

    def score(prompt, completion, answer):
        global calls
        calls += 1
        if calls > {ok_calls}:  # from step 3 on
            raise RuntimeError("judge unavailable")
        return float("7" in completion)
"""


def test_reward_hook_failing_after_a_checkpoint_leaves_it_complete_and_loadable(
    tiny_model: Path, tmp_path: Path
) -> None:
    ckpt_dir = tmp_path / "ckpt"
    spec = _hook_job(tiny_model, "flaky_judge", steps=6,
                     checkpoint={"volume": "ckpt", "path": str(ckpt_dir), "everyNSteps": 2},
                     volumes=[{"name": "ckpt", "emptyDir": {}}])
    per_step = 4 * 4  # promptsPerStep x samplesPerPrompt
    env = _hook_env(tmp_path, "flaky_judge", FLAKY.format(ok_calls=2 * per_step))
    run = start_driver(tmp_path, write_config(tmp_path / "job.json", spec), env=env)
    msg = _failed(run, timeout=300)
    assert re.fullmatch(r"RewardError: reward function 'flaky_judge:score' raised RuntimeError: judge unavailable "
                        + SAMPLE.format(step=3), msg), msg
    assert [r["step"] for r in run.steps()] == [1, 2]

    found = ckpt.latest(ckpt_dir)
    assert found is not None and found[0] == 2, found
    assert sorted(p.name for p in ckpt_dir.iterdir()) == ["step-00000002"]  # no temporary directory left
    state = ckpt.read_state(found[1], 2)  # complete: every recorded file present with its recorded size
    assert state["step"] == 2 and state["base_model"] == str(tiny_model)
    assert "model/config.json" in state["files"] and "optimizer.pt" in state["files"]
    # the model and optimiser state load (in a child process: keeps torch out of pytest)
    code = textwrap.dedent("""
        import json, sys, torch
        from transformers import AutoModelForCausalLM
        m = AutoModelForCausalLM.from_pretrained(sys.argv[1] + "/model")
        opt = torch.load(sys.argv[1] + "/optimizer.pt", map_location="cpu", weights_only=False)
        print(json.dumps({"params": sum(p.numel() for p in m.parameters()), "opt_steps": len(opt["state"])}))
    """)
    out = subprocess.run([sys.executable, "-c", code, str(found[1])], capture_output=True, text=True, timeout=180,
                         check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    loaded = json.loads(out.stdout.strip().splitlines()[-1])
    assert loaded["params"] > 0 and loaded["opt_steps"] > 0, loaded


# ----------------------------------------------------------------------------------------- weight format
def test_kernel_format_where_it_cannot_apply_fails_naming_the_reason(tiny_model: Path, tmp_path: Path) -> None:
    """``weightSync.format: kernel`` is a promise: on the CPU gloo backend (vLLM prepacks linear weights there,
    so nothing can be copied into them in place) the run fails when its weight-sync group is set up, saying why
    and what to use instead, rather than syncing in the checkpoint format behind the user's back."""
    spec = job_config(tiny_model, algorithm={"steps": 2, "promptsPerStep": 2})
    spec["weightSync"] = {**spec.get("weightSync", {}), "format": "kernel"}
    run = start_driver(tmp_path, write_config(tmp_path / "job.json", spec))
    msg = _failed(run, timeout=600)
    # the trainer actor's own error, not Ray's traceback of it
    assert msg == ("ValueError: weightSync.format kernel cannot be used here (the gloo backend loads the checkpoint "
                   "format only): use auto or checkpoint"), msg
