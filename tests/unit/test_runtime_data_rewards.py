"""Prompt loading, step batches and reward rules (pure Python)."""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

import pytest

from rlhf_api.models import Data, Reward
from rlhf_runtime.algo.data import (
    DATA_MOUNT,
    DataError,
    Sample,
    config_map_path,
    load_samples,
    parse_lines,
    step_batch,
)
from rlhf_runtime.algo.rewards import RewardError, make_reward


def test_inline_prompts() -> None:
    assert load_samples(Data(prompts=["a", "b"])) == [Sample("a"), Sample("b")]


def test_json_lines_with_answers_and_plain_lines(tmp_path: Path) -> None:
    f = tmp_path / "p.txt"  # mixed: plain lines and JSON lines (a *.jsonl file must be JSON throughout)
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


def test_missing_file_is_a_data_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(DataError, match=r"spec.data.path .*/nope: no such file \(is its volume mounted"):
        load_samples(Data(path=str(tmp_path / "nope")))
    monkeypatch.setenv("RLHF_DATA_DIR", str(tmp_path))
    with pytest.raises(DataError, match=r"spec.data.configMap 'cm' key 'k.jsonl' \(mounted at .*/k.jsonl\): no such "
                       r"file \(is 'k.jsonl' a key of ConfigMap 'cm'\?\)"):
        load_samples(Data.model_validate({"configMap": {"name": "cm", "key": "k.jsonl"}}))
    with pytest.raises(DataError, match="a folder without Parquet files, Arrow files or a Hugging Face save_to_disk state.json"):
        load_samples(Data(path=str(tmp_path)))  # a folder: Parquet files or a save_to_disk dataset


@pytest.mark.parametrize(
    ("name", "content", "message"),
    [
        ("p.jsonl", b"\x00\x01\x02binary\x00", r"the file is binary \(a NUL byte at line 1, byte offset 0\)"),
        ("p.jsonl", b'{"prompt": "a"}\n{"prompt": "caf\xe9"}\n',
         r"not UTF-8 text: byte 0xe9 at line 2 \(byte offset 31\) is invalid UTF-8; convert the file to UTF-8"),
        ("p.jsonl", "prompt\n".encode("utf-16"), "UTF-16 text; save it as UTF-8"),
        ("p.jsonl.gz", b"\x1f\x8b\x08\x00\x00", "gzip-compressed, not text"),
        ("p.parquet", b"PAR1\x15\x04", "not a readable Parquet file: Parquet file size is 6 bytes"),
        ("p.csv", b"prompt,answer\n2+2,4\n", "CSV/TSV is not a supported prompts format; convert it to JSON lines"),
        ("p.json", json.dumps([{"prompt": "a"}, {"prompt": "b"}], indent=1).encode(),
         "the file is a JSON array, not JSON lines: write one JSON object per line"),
        ("p.txt", json.dumps({"prompt": "a", "answer": "b"}, indent=2).encode(),
         "one JSON object over several lines, not JSON lines"),
        ("p.jsonl", b'{"prompt": "a"}\nplain\n{"prompt": "b"}\nmore\n',
         (r"line 2: not a JSON object \('plain'\): a .jsonl/.ndjson/.json file needs one JSON object per line.* "
          r"\(and 1 more bad line\)$")),
        ("p.jsonl", b'{"prompt": "a"}\n{"question": "q", "answer": 4}\n',
         (r"line 2: the JSON object has no 'prompt' field \(its fields: 'question', 'answer'\); every JSON line "
          r"needs a string 'prompt'")),
        ("p.jsonl", b'{"prompt": ["a", "b"]}\n', r"line 1: 'prompt' is a JSON array \('\[\"a\", \"b\"\]'\), not a string"),
        ("p.jsonl", b'{"prompt": "  "}\n', "line 1: 'prompt' is empty"),
        ("p.jsonl", b'[1, 2]\n', "line 1: not a JSON object"),
        ("p.txt", b'{"prompt": "a"}\n{"prompt": 1}\n', "line 2: 'prompt' is a JSON number"),
        ("p.txt", b'ok\n{"prompt": "x"\n', r"line 2: invalid JSON \(Expecting ',' delimiter at column 15\)"),
        ("p.txt", b'ok\n["x"]\n', "NEVER"),  # a plain-text prompt may start with '['
        ("p.jsonl", b"", r"no prompts \(the file is empty\); it needs at least one prompt"),
        ("p.txt", b"\n  \n\n", r"no prompts \(the file is 3 lines, all blank\)"),
    ],
)
def test_malformed_prompts_file_says_what_to_fix(tmp_path: Path, name: str, content: bytes, message: str) -> None:
    f = tmp_path / name
    f.write_bytes(content)
    if message == "NEVER":
        assert load_samples(Data(path=str(f))) == [Sample("ok"), Sample('["x"]')]
        return
    with pytest.raises(DataError, match=rf"^spec.data.path {f}: .*{message}") as e:
        load_samples(Data(path=str(f)))
    assert len(str(e.value)) < 1000  # the driver reports at most 1000 characters


def test_utf8_byte_order_mark_is_accepted(tmp_path: Path) -> None:
    f = tmp_path / "p.jsonl"
    f.write_bytes(b"\xef\xbb\xbf" + json.dumps({"prompt": "a"}).encode() + b"\n")
    assert load_samples(Data(path=str(f))) == [Sample("a")]


def test_empty_inline_prompt_is_a_data_error() -> None:
    with pytest.raises(DataError, match=r"spec.data.prompts\[1\] is empty"):
        load_samples(Data(prompts=["a", " "]))


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


def test_missing_hook_is_a_reward_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(RewardError, match=r"cannot import reward function 'no_such_module_xyz:fn' "
                       r"\(spec.reward.function\): No module named .*must be importable in the image"):
        make_reward(Reward(function="no_such_module_xyz:fn"))
    (tmp_path / "broken_rewards.py").write_text("def score(:\n")
    (tmp_path / "fine_rewards.py").write_text("x = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(RewardError, match="importing 'broken_rewards' raised SyntaxError"):
        make_reward(Reward(function="broken_rewards:score"))
    with pytest.raises(RewardError, match="module 'fine_rewards' has no 'score'"):
        make_reward(Reward(function="fine_rewards:score"))
    with pytest.raises(RewardError, match="'fine_rewards:x' .* is not callable"):
        make_reward(Reward(function="fine_rewards:x"))
    sys.modules.pop("fine_rewards", None)


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ("raise KeyError('no answer')",
         (r"reward function 'bad_hooks:score' raised KeyError: 'no answer' on sample 7 of step 3 "
          r"\(prompt 'p', completion 'c7'\)$")),
        ("return float('nan')", r"returned nan on sample 7 of step 3 .*; it must return a finite number"),
        ("return float('-inf')", r"returned -inf on sample 7 of step 3"),
        ("return None", r"returned None on sample 7 of step 3 .*; it must return a finite number"),
        ("return '0.5'", r"returned \"'0.5'\" \(a str\) on sample 7"),
        ("return [1.0]", r"returned '\[1.0\]' \(a list\) on sample 7"),
        ("return {'score': 1}", r"returned \"\{'score': 1\}\" \(a dict\) on sample 7"),
    ],
)
def test_bad_hook_result_names_the_hook_and_the_sample(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                       body: str, message: str) -> None:
    (tmp_path / "bad_hooks.py").write_text(f"def score(prompt, completion, answer):\n    {body}\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("bad_hooks", None)
    fn = make_reward(Reward(function="bad_hooks:score"))
    with pytest.raises(RewardError, match=message):
        fn("p", "c7", None, 2, index=7, step=3)
    with pytest.raises(RewardError, match=r"on a sample \(prompt 'p', completion 'c7'\)"):
        fn("p", "c7", None)  # no index from the caller: the prompt and completion still say which
    sys.modules.pop("bad_hooks", None)


def test_hook_results_that_are_numbers_are_accepted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "ok_hooks.py").write_text("def b(p, c, a):\n    return True\n\ndef i(p, c, a):\n    return 3\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert make_reward(Reward(function="ok_hooks:b"))("p", "c", None) == 1.0
    assert make_reward(Reward(function="ok_hooks:i"))("p", "c", None, index=0, step=1) == 3.0
    assert make_reward(Reward(rule="contains", target="7"))("p", "7", None, 1, index=0, step=1) == 1.0
    sys.modules.pop("ok_hooks", None)
