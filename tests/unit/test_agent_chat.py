"""Token-in-token-out (``rlhf_runtime.agent.chat``) with two chat templates: what the trainer trains on is what the
engine saw at every turn boundary and what it sampled, with loss mask 1 exactly on the sampled tokens."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from rlhf_testing.tiny_chat import build_chat_tokenizer

from rlhf_runtime.agent.chat import ChatTokens, TemplateError, Trajectory, stop_ids

TOOLS = [{"type": "function", "function": {"name": "python", "description": "run code", "parameters": {
    "type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]}}}]


@pytest.fixture(scope="module", params=["chatml", "llama3"])
def chat(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Any, ChatTokens]:
    from transformers import AutoTokenizer

    path = tmp_path_factory.mktemp(request.param)
    build_chat_tokenizer(path, request.param)
    tok = AutoTokenizer.from_pretrained(str(path))
    return request.param, tok, ChatTokens(tok, TOOLS, stop_ids(tok))


def call_text(template: str, code: str) -> str:
    args = json.dumps({"code": code})
    if template == "chatml":
        return f'<tool_call>{{"name": "python", "arguments": {args}}}</tool_call>'
    return f'{{"name": "python", "parameters": {args}}}'


def sampled(tok: Any, text: str) -> list[int]:
    """An assistant turn as an engine samples it: the text's tokens and the end-of-turn token."""
    return list(tok.encode(text, add_special_tokens=False)) + [tok.eos_token_id]


def assistant_call(code: str, content: str = "") -> dict[str, Any]:
    return {"role": "assistant", "content": content,
            "tool_calls": [{"type": "function", "function": {"name": "python", "arguments": {"code": code}}}]}


def two_turns(template: str, tok: Any, chat: ChatTokens, preamble: str = "") -> tuple[Trajectory, list[list[int]]]:
    """A trajectory: a tool call, its result, a final answer; and the prompt the engine got at each turn."""
    traj = Trajectory(chat.prompt_ids([{"role": "user", "content": "what is 6*7?"}]))
    seen: list[list[int]] = []
    for text, obs in ((preamble + call_text(template, "print(6*7)"), [{"role": "tool", "content": "42"}]),
                      ("it is 42", None)):
        traj.turn_starts.append(len(traj))
        seen.append(traj.ids())
        traj.add_turn(sampled(tok, text), None)
        if obs is not None:
            traj.add_observation(chat.observation_ids(obs))
    return traj, seen


def test_every_engine_prompt_is_the_trained_sequence_up_to_its_turn(chat: tuple[str, Any, ChatTokens]) -> None:
    template, tok, ct = chat
    traj, seen = two_turns(template, tok, ct)
    full = traj.ids()
    assert [full[:k] for k in traj.turn_starts] == seen
    assert len(traj.mask) == len(traj.response) == len(traj.logprobs)
    # mask 1 exactly on what the engine sampled: the two turns' tokens, each ending with the stop token
    turn1 = sampled(tok, call_text(template, "print(6*7)"))
    turn2 = sampled(tok, "it is 42")
    obs_len = traj.turn_starts[1] - len(traj.prompt) - len(turn1)
    assert traj.mask == [1] * len(turn1) + [0] * obs_len + [1] * len(turn2)
    assert [t for t, m in zip(traj.response, traj.mask) if m] == turn1 + turn2


def test_the_sequence_is_what_the_template_renders_for_the_conversation(chat: tuple[str, Any, ChatTokens]) -> None:
    """Where the template renders the sampled text back as it was sampled (no rewriting of earlier turns), the
    appended sequence is exactly the template's rendering of the whole conversation, at each turn boundary."""
    template, tok, ct = chat
    traj, seen = two_turns(template, tok, ct)
    convo = [{"role": "user", "content": "what is 6*7?"}, assistant_call("print(6*7)"),
             {"role": "tool", "content": "42"}]
    assert ct.render(convo[:1], True) == seen[0]
    assert ct.render(convo, True) == seen[1]
    final = ct.render([*convo, {"role": "assistant", "content": "it is 42"}], False)
    ended = traj.ids()
    # the rendering closes the last turn with the template's turn suffix; the engine stopped at the stop token
    assert final == ended + ct.turn_suffix


def test_earlier_turns_rewritten_by_the_template_stay_as_sampled(chat: tuple[str, Any, ChatTokens]) -> None:
    """llama3's template drops an assistant's text before its tool call when it renders the conversation again
    (as reasoning templates drop earlier reasoning): re-rendering would train on tokens the engine never saw;
    the trajectory keeps what was sampled."""
    template, tok, ct = chat
    traj, seen = two_turns(template, tok, ct, preamble="let me compute. ")
    convo = [{"role": "user", "content": "what is 6*7?"}, assistant_call("print(6*7)", "let me compute. "),
             {"role": "tool", "content": "42"}]
    rerendered = ct.render(convo, True)
    assert traj.ids()[: traj.turn_starts[1]] == seen[1]
    assert tok.decode(seen[1]).count("let me compute.") == 1
    if template == "llama3":
        assert rerendered != seen[1] and "let me compute." not in tok.decode(rerendered)
    else:
        assert rerendered == seen[1]


def test_sampled_tokens_are_never_retokenized(chat: tuple[str, Any, ChatTokens]) -> None:
    """The engine may sample a tag as characters where the tokenizer has one special token for it: the
    trajectory keeps the characters (re-tokenizing the text would give other ids)."""
    template, tok, ct = chat
    chars = [tok.convert_tokens_to_ids(c) for c in "<tool_call>"] + [tok.eos_token_id]
    traj = Trajectory(ct.prompt_ids([{"role": "user", "content": "x"}]))
    traj.add_turn(chars, [-0.5] * len(chars))
    assert traj.response == chars and traj.logprobs == [-0.5] * len(chars)
    assert tok.encode(tok.decode(chars[:-1]), add_special_tokens=False) != chars[:-1] or template == "llama3"


def test_turn_ends_and_text(chat: tuple[str, Any, ChatTokens]) -> None:
    _, tok, ct = chat
    ids = sampled(tok, "hi")
    assert ct.ended(ids) and not ct.ended(ids[:-1]) and not ct.ended([])
    assert ct.text(ids) == "hi"
    assert "\ufffd" not in ct.text(ids)


def test_a_template_that_never_ends_a_turn_with_a_stop_token_is_refused(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    build_chat_tokenizer(tmp_path, "chatml")
    tok = AutoTokenizer.from_pretrained(str(tmp_path))
    with pytest.raises(TemplateError, match="none of the engine's stop tokens"):
        ChatTokens(tok, None, {tok.convert_tokens_to_ids("<eos>")})
    tok.chat_template = "{% for m in messages %}{{ m.content }}{% endfor %}{{ raise_exception('no') }}"
    with pytest.raises(TemplateError, match="chat template failed"):
        ChatTokens(tok, None, stop_ids(tok))


def test_stop_ids_take_the_generation_config_too() -> None:
    class Tok:
        eos_token_id = 5

    assert stop_ids(Tok(), {"eos_token_id": [7, 8]}) == {5, 7, 8}
    assert stop_ids(Tok(), {"eos_token_id": 9}) == {5, 9}
    assert stop_ids(Tok(), None) == {5}
