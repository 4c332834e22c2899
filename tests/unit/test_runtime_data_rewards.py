"""Prompt loading, step batches and reward rules (pure Python)."""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

import pytest

from rlhf_api.models import Data, Reward
from rlhf_runtime.data import (
    DATA_MOUNT,
    DataError,
    Sample,
    config_map_path,
    load_samples,
    parse_lines,
    step_batch,
)
from rlhf_runtime.rewards import RewardError, make_reward


def test_inline_prompts() -> None:
    assert load_samples(Data(prompts=["a", "b"])) == [Sample("a"), Sample("b")]


def test_json_lines_with_answers_and_plain_lines(tmp_path: Path) -> None:
    f = tmp_path / "p.jsonl"
    f.write_text(json.dumps({"prompt": "2+2=", "ans": 4}) + "\n\nplain prompt\n" + json.dumps({"prompt": "x"}))
    got = load_samples(Data(path=str(f), answer_field="ans"))
    assert got == [Sample("2+2=", "4"), Sample("plain prompt"), Sample("x")]


def test_bad_json_line_is_an_error() -> None:
    with pytest.raises(DataError, match="line 1"):
        parse_lines('{"prompt": 3}')
    with pytest.raises(DataError, match="line 2"):
        parse_lines('ok\n{"prompt": "x"')


def test_config_map_is_read_from_the_mount(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert config_map_path("prompts.jsonl") == Path(DATA_MOUNT) / "prompts.jsonl"
    assert DATA_MOUNT == "/etc/rlhf-data"
    (tmp_path / "k.txt").write_text("one\ntwo\n")
    monkeypatch.setenv("RLHF_DATA_DIR", str(tmp_path))
    got = load_samples(Data.model_validate({"configMap": {"name": "cm", "key": "k.txt"}}))
    assert got == [Sample("one"), Sample("two")]


def test_missing_file_is_a_data_error(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="cannot read"):
        load_samples(Data(path=str(tmp_path / "nope")))


def test_step_batches_are_deterministic_permutations_per_epoch() -> None:
    samples = [Sample(str(i)) for i in range(5)]
    seq = [s.prompt for step in range(5) for s in step_batch(samples, step, 2, seed=7)]
    assert sorted(seq[:5]) == [str(i) for i in range(5)]  # epoch 0 is a permutation
    assert sorted(seq[5:10]) == [str(i) for i in range(5)]
    assert seq == [s.prompt for step in range(5) for s in step_batch(samples, step, 2, seed=7)]
    assert seq != [s.prompt for step in range(5) for s in step_batch(samples, step, 2, seed=8)]
    # A resumed job at step 3 sees exactly what the uninterrupted job saw.
    assert [s.prompt for s in step_batch(samples, 3, 2, seed=7)] == seq[6:8]


@pytest.mark.parametrize(
    ("reward", "completion", "answer", "expected"),
    [
        (Reward(rule="exactMatch", target="yes"), " yes ", None, 1.0),
        (Reward(rule="exactMatch", target="yes"), "yes!", None, 0.0),
        (Reward(rule="exactMatch", target="yes"), "4", "4", 1.0),  # the sample's answer wins
        (Reward(rule="contains", target="7"), "a7b", None, 1.0),
        (Reward(rule="contains", target="7"), "abc", None, 0.0),
        (Reward(rule="contains", target="7"), "abc", "b", 1.0),
        (Reward(rule="regex", pattern=r"^\d+$"), "123", None, 1.0),
        (Reward(rule="regex", pattern=r"^\d+$"), "12a", None, 0.0),
        (Reward(rule="length", target_length=4), "abcd", None, 1.0),
        (Reward(rule="length", target_length=4), "ab", None, 0.5),
        (Reward(rule="length", target_length=4), "a" * 20, None, 0.0),
    ],
)
def test_rules(reward: Reward, completion: str, answer: str | None, expected: float) -> None:
    assert make_reward(reward)("p", completion, answer) == expected


def test_length_rule_counts_tokens_when_given() -> None:
    assert make_reward(Reward(rule="length", target_length=10))("p", "ab", None, 10) == 1.0


def test_user_hook(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "my_rewards.py").write_text(textwrap.dedent("""
        def score(prompt, completion, answer):
            return len(prompt) + len(completion) + (100 if answer is None else 0)
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    fn = make_reward(Reward(function="my_rewards:score"))
    assert fn("ab", "cde", None) == 105.0
    assert fn("ab", "cde", "x") == 5.0
    sys.modules.pop("my_rewards", None)


def test_missing_hook_is_a_reward_error() -> None:
    with pytest.raises(RewardError, match="cannot import"):
        make_reward(Reward(function="no_such_module_xyz:fn"))
