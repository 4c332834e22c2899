"""Chat-format prompts (``messages``), rendering prompts to token ids, and the held-out eval set (pure Python
but for the tokenizer)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from rlhf_api.models import Data
from rlhf_runtime.algo.data import (
    DataError,
    Sample,
    load_eval_samples,
    load_samples,
    parse_lines,
    render_prompt,
)

#: A chat template in the tiny tokenizer's alphabet (lower-case letters, digits, some punctuation).
TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}; {% endfor %}"
            "{% if add_generation_prompt %}assistant:{% endif %}")


def _line(**obj: Any) -> str:
    return json.dumps(obj)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from rlhf_testing.tiny import build_tokenizer
    from transformers import AutoTokenizer

    path = tmp_path_factory.mktemp("tok")
    build_tokenizer(path)
    return AutoTokenizer.from_pretrained(str(path))


# ------------------------------------------------------------------------------------------------ parsing
def test_chat_lines_parse() -> None:
    text = "\n".join([
        _line(messages=[{"role": "system", "content": "be brief"}, {"role": "user", "content": "2+2="}],
              answer=4),
        _line(prompt="plain"),
        _line(messages=[{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
                        {"role": "user", "content": "and 3+3?"}]),
        _line(messages=[{"role": "user", "content": "weather?"}, {"role": "assistant", "content": ""},
                        {"role": "tool", "content": "sunny"}]),
    ])
    got = parse_lines(text)
    assert got == [
        Sample("2+2=", "4", (("system", "be brief"), ("user", "2+2="))),
        Sample("plain"),
        Sample("and 3+3?", None, (("user", "hi"), ("assistant", "hello"), ("user", "and 3+3?"))),
        Sample("weather?", None, (("user", "weather?"), ("assistant", ""), ("tool", "sunny"))),
    ]
    assert len(set(got)) == 4  # still hashable


def test_chat_lines_load_from_a_jsonl_file_with_the_answer_field(tmp_path: Path) -> None:
    f = tmp_path / "chat.jsonl"
    f.write_text(_line(messages=[{"role": "user", "content": "q"}], ans="a") + "\n")
    assert load_samples(Data(path=str(f), answer_field="ans")) == [Sample("q", "a", (("user", "q"),))]


@pytest.mark.parametrize(
    ("obj", "message"),
    [
        ({"prompt": "p", "messages": [{"role": "user", "content": "q"}]},
         "line 1: the JSON object has both 'prompt' and 'messages'; give exactly one"),
        ({"question": "q"},
         (r"line 1: the JSON object has no 'prompt' field \(its fields: 'question'\); every JSON line needs a "
          r"string 'prompt' or a chat 'messages' list")),
        ({"messages": "hi"},
         (r"line 1: 'messages' is a JSON string \('\"hi\"'\), not a list: 'messages' must be "
          r"a list like \[\{\"role\": \"user\"")),
        ({"messages": []}, "line 1: 'messages' is empty: it needs at least one user message"),
        ({"messages": ["hi"]}, r"line 1: messages\[0\] is a JSON string .*, not an object: each message must be"),
        ({"messages": [{"role": "user"}]},
         (r"line 1: messages\[0\] has no 'content' field \(its fields: 'role'\); each message needs a string "
          r"'role' and a string 'content'")),
        ({"messages": [{"text": "x"}]}, r"line 1: messages\[0\] has no 'role' and no 'content' field"),
        ({"messages": [{"role": "bot", "content": "x"}]},
         r"line 1: messages\[0\]: 'role' is 'bot'; it must be one of system, user, assistant, tool"),
        ({"messages": [{"role": 1, "content": "x"}]},
         r"line 1: messages\[0\]: 'role' is a JSON number \('1'\); it must be"),
        ({"messages": [{"role": "user", "content": [{"type": "text", "text": "x"}]}]},
         r"line 1: messages\[0\] \(user\): 'content' is a JSON array .*, not a string"),
        ({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]},
         (r"line 1: the conversation ends with an assistant message \(messages\[1\]\); it must end with the "
          r"message the model answers .*remove the trailing assistant message")),
        ({"messages": [{"role": "system", "content": "s"}]},
         r"line 1: 'messages' has no user message \(roles: system\)"),
        ({"messages": [{"role": "user", "content": "q"}, {"role": "user", "content": " "}]},
         r"line 1: the last user message \(messages\[1\]\) has empty 'content'"),
    ],
)
def test_bad_chat_lines_say_what_to_fix(tmp_path: Path, obj: dict[str, Any], message: str) -> None:
    f = tmp_path / "chat.jsonl"
    f.write_text(json.dumps(obj) + "\n" + _line(prompt="fine") + "\n")
    with pytest.raises(DataError, match=rf"^spec.data.path {f}: {message}") as e:
        load_samples(Data(path=str(f)))
    assert len(str(e.value)) < 1000


def test_bad_chat_lines_are_counted_like_other_bad_lines() -> None:
    text = "\n".join([_line(messages=[]), _line(prompt="ok"), _line(prompt="p", messages=[])])
    with pytest.raises(DataError, match=r"^prompts: line 1: 'messages' is empty.* \(and 1 more bad line\)$"):
        parse_lines(text)


# ---------------------------------------------------------------------------------------------- rendering
def test_render_prompt_applies_the_chat_template(tokenizer: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tokenizer, "chat_template", TEMPLATE)
    (sample,) = parse_lines(_line(messages=[{"role": "system", "content": "be brief"},
                                            {"role": "user", "content": "2+2="}]))
    ids = render_prompt(sample, tokenizer)
    assert ids == tokenizer.encode("system: be brief; user: 2+2=; assistant:", add_special_tokens=False)
    assert all(isinstance(i, int) for i in ids)
    assert tokenizer.unk_token_id not in ids


def test_render_prompt_takes_input_ids_of_a_dict_result(tokenizer: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tokenizer, "chat_template", TEMPLATE)
    sample = Sample("q", None, (("user", "q"),))
    expected = tokenizer.encode("user: q; assistant:", add_special_tokens=False)
    for result in ({"input_ids": expected, "attention_mask": [1] * len(expected)}, {"input_ids": [expected]},
                   [expected], expected):
        monkeypatch.setattr(tokenizer, "apply_chat_template", lambda *a, r=result, **k: r)
        assert render_prompt(sample, tokenizer) == expected


def test_chat_sample_without_a_chat_template_is_a_data_error(tokenizer: Any) -> None:
    assert tokenizer.chat_template is None  # the tiny tokenizer has none
    with pytest.raises(DataError, match=r"spec.model's tokenizer has no chat template and the data uses "
                       r"'messages' .*: use 'prompt' \(plain text\) instead"):
        render_prompt(Sample("q", None, (("user", "q"),)), tokenizer)


def test_a_template_that_rejects_the_conversation_is_a_data_error(tokenizer: Any,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tokenizer, "chat_template", "{% if messages[0]['role'] == 'system' %}"
                        "{{ raise_exception('system role not supported') }}{% endif %}" + TEMPLATE)
    sample = Sample("q", None, (("system", "s"), ("user", "q")))
    with pytest.raises(DataError, match=r"^spec.model's chat template rejected the conversation \(roles: system, "
                       r"user\) ending 'q': TemplateError: system role not supported"):
        render_prompt(sample, tokenizer)


@pytest.mark.parametrize("text", ["2+2=", "hello, world!", "", "   ", "UPPER"])
def test_plain_prompts_render_as_the_driver_encodes(tokenizer: Any, monkeypatch: pytest.MonkeyPatch,
                                                    text: str) -> None:
    # the driver's encoding of a plain prompt: no special tokens; an empty one is the BOS token alone
    expected = tokenizer.encode(text, add_special_tokens=False) or [tokenizer.bos_token_id]
    assert render_prompt(Sample(text), tokenizer) == expected
    monkeypatch.setattr(tokenizer, "chat_template", TEMPLATE)  # a template does not apply to plain prompts
    assert render_prompt(Sample(text), tokenizer) == expected


# ---------------------------------------------------------------------------------------------- eval set
def test_no_eval_set_is_empty() -> None:
    assert load_eval_samples(Data(prompts=["a"])) == []


def test_eval_inline_keeps_order_and_max_prompts() -> None:
    data = Data.model_validate({"prompts": ["t"], "eval": {"prompts": [f"e{i}" for i in range(5)],
                                                           "maxPrompts": 3}})
    assert load_eval_samples(data) == [Sample("e0"), Sample("e1"), Sample("e2")]
    assert load_samples(data) == [Sample("t")]  # the training prompts are not the eval set


def test_eval_from_a_path_in_file_order_with_answers(tmp_path: Path) -> None:
    f = tmp_path / "eval.jsonl"
    f.write_text("\n".join([_line(prompt=f"p{i}", ans=i) for i in range(100)]
                           + [_line(messages=[{"role": "user", "content": "q"}])]) + "\n")
    data = Data.model_validate({"prompts": ["t"], "answerField": "ans", "eval": {"path": str(f)}})
    got = load_eval_samples(data)
    assert got == [Sample(f"p{i}", str(i)) for i in range(64)]  # the default maxPrompts, no shuffling
    data = Data.model_validate({"prompts": ["t"], "eval": {"path": str(f), "maxPrompts": 1000}})
    assert load_eval_samples(data)[-1] == Sample("q", None, (("user", "q"),))


def test_eval_from_a_config_map(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "eval.txt").write_text("one\ntwo\nthree\n")
    monkeypatch.setenv("RLHF_DATA_DIR", str(tmp_path))
    data = Data.model_validate({"prompts": ["t"], "eval": {"configMap": {"name": "cm", "key": "eval.txt"},
                                                           "maxPrompts": 2}})
    assert load_eval_samples(data) == [Sample("one"), Sample("two")]


def test_eval_errors_name_spec_data_eval(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def eval_of(spec: dict[str, Any]) -> Data:
        return Data.model_validate({"prompts": ["t"], "eval": spec})

    with pytest.raises(DataError, match=r"^spec.data.eval.path .*/nope: no such file \(is its volume mounted"):
        load_eval_samples(eval_of({"path": str(tmp_path / "nope")}))
    monkeypatch.setenv("RLHF_DATA_DIR", str(tmp_path))
    with pytest.raises(DataError, match=r"^spec.data.eval.configMap 'cm' key 'e.jsonl' \(mounted at .*/e.jsonl\): "
                       r"no such file \(is 'e.jsonl' a key of ConfigMap 'cm'\?\)"):
        load_eval_samples(eval_of({"configMap": {"name": "cm", "key": "e.jsonl"}}))
    bad = tmp_path / "bad.jsonl"
    bad.write_text(_line(prompt="a") + "\n" + _line(messages=[{"role": "assistant", "content": "x"}]) + "\n")
    with pytest.raises(DataError, match=rf"^spec.data.eval.path {bad}: line 2: the conversation ends with an "
                       "assistant message"):
        load_eval_samples(eval_of({"path": str(bad)}))
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(DataError, match=r"^spec.data.eval.path .*/empty.txt: no prompts \(the file is empty\)"):
        load_eval_samples(eval_of({"path": str(tmp_path / "empty.txt")}))
    with pytest.raises(DataError, match=r"^spec.data.eval.prompts\[1\] is empty: remove it or give it text"):
        load_eval_samples(eval_of({"prompts": ["a", " "]}))
    with pytest.raises(DataError, match=r"^spec.data.eval needs exactly one of prompts, configMap or path"):
        load_eval_samples(eval_of({}))
