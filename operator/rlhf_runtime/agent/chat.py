"""Token-in-token-out: a multi-turn trajectory as the token ids the engines saw and sampled.

The trainer must train on exactly the tokens the engine sampled, and score them in exactly the context the engine
saw. Rendering the whole conversation again with the chat template does not give that: the assistant's text can
tokenize differently than it was sampled, and templates rewrite earlier turns (Qwen3's drops the reasoning of
earlier turns). So a trajectory is built by appending, never by re-rendering:

* the first prompt: the chat template over the sample's messages with the tools and the generation prompt;
* each assistant turn: the token ids the engine sampled, as they are (loss mask 1);
* each observation (tool results, environment messages): the tokens the template puts between the end of an
  assistant turn and the start of the next one, i.e. what closes the assistant's turn after its stop token
  (``turn_suffix``: ``\\n`` in ChatML), the observation messages and the next generation prompt (loss mask 0).

The observation's tokens come from the template itself: rendered after a fixed two-message conversation and cut
where that conversation's own rendering ends (``observation_ids``), so they are exactly what the template puts
there, whatever the template. ``ChatTokens`` checks the template once (``check``): the rendering of a longer
conversation must start with the rendering of its first part, and an assistant turn must end with one of the
stop tokens, else the job is refused before its first step with what is wrong.

Pure (a tokenizer with ``apply_chat_template``; no torch, no vLLM).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

#: The fixed conversation an observation is rendered after (its content does not matter, its shape does).
_BASE = [{"role": "user", "content": "?"}, {"role": "assistant", "content": "."}]


class TemplateError(ValueError):
    """The chat template cannot be used token-in-token-out (message says why and what to change)."""


def _ids(out: Any) -> list[int]:
    """``apply_chat_template(tokenize=True)``'s result as a list of ids (a list, or a BatchEncoding)."""
    if isinstance(out, dict) or hasattr(out, "input_ids"):
        out = out["input_ids"]
    return [int(t) for t in out]


@dataclass
class ChatTokens:
    """A tokenizer's chat template as token-in-token-out pieces (module docstring). ``tools``: the OpenAI-style
    tool list given to the template; ``stop_ids``: the token ids that end an assistant turn (the engine's stop
    tokens: the tokenizer's eos and the model's generation config's)."""

    tokenizer: Any
    tools: list[dict[str, Any]] | None
    stop_ids: set[int]
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    turn_suffix: list[int] = field(default_factory=list)
    base: list[int] = field(default_factory=list)  # the fixed conversation's rendering (``check``)

    def __post_init__(self) -> None:
        self.check()

    def render(self, messages: list[dict[str, Any]], generation_prompt: bool) -> list[int]:
        kw: dict[str, Any] = dict(self.template_kwargs)
        if self.tools:
            kw["tools"] = self.tools
        try:
            return _ids(self.tokenizer.apply_chat_template(messages, tokenize=True,
                                                           add_generation_prompt=generation_prompt, **kw))
        except Exception as e:
            raise TemplateError(f"the tokenizer's chat template failed on {[m.get('role') for m in messages]}: "
                                f"{type(e).__name__}: {e}") from e

    def check(self) -> None:
        """The template renders a conversation as a prefix of any longer one, and ends an assistant turn with a
        stop token followed by ``turn_suffix``; raises ``TemplateError`` otherwise."""
        base = self.render(_BASE, False)
        ends = [i for i, t in enumerate(base) if t in self.stop_ids]
        if not ends:
            raise TemplateError("the chat template ends an assistant turn with none of the engine's stop tokens "
                                f"{sorted(self.stop_ids)}: the engine would not stop where a turn ends")
        self.turn_suffix, self.base = base[ends[-1] + 1:], base
        longer = self.render([*_BASE, {"role": "user", "content": "?"}], True)
        if longer[: len(base)] != base:
            raise TemplateError("the chat template renders earlier turns differently once a later turn follows, "
                                "so observations cannot be appended token by token")

    def prompt_ids(self, messages: list[dict[str, Any]]) -> list[int]:
        """The first prompt: the sample's messages, the tools and the generation prompt."""
        return self.render(messages, True)

    def observation_ids(self, messages: list[dict[str, Any]]) -> list[int]:
        """The tokens after an assistant turn that ended with a stop token: ``turn_suffix``, ``messages`` (tool or
        user messages) and the next generation prompt."""
        base = self.base
        full = self.render([*_BASE, *messages], True)
        if full[: len(base)] != base:
            raise TemplateError(f"the chat template renders the conversation differently once "
                                f"{[m.get('role') for m in messages]} messages follow it")
        return self.turn_suffix + full[len(base):]

    def ended(self, ids: list[int]) -> bool:
        """Whether an assistant turn's sampled ids end with a stop token (else it was cut at its length)."""
        return bool(ids) and ids[-1] in self.stop_ids

    def text(self, ids: list[int]) -> str:
        """An assistant turn's text for the tool-call parser: special tokens kept (tool-call tags are special in
        many tokenizers), the final stop token left out, invalid UTF-8 replaced."""
        if self.ended(ids):
            ids = ids[:-1]
        return str(self.tokenizer.decode(ids, skip_special_tokens=False))


def stop_ids(tokenizer: Any, generation_config: dict[str, Any] | None = None) -> set[int]:
    """The ids that end an assistant turn: the tokenizer's eos and the generation config's ``eos_token_id`` (an
    int or a list), as vLLM stops on."""
    out: set[int] = set()
    for v in (getattr(tokenizer, "eos_token_id", None), (generation_config or {}).get("eos_token_id")):
        if isinstance(v, int):
            out.add(v)
        elif isinstance(v, (list, tuple)):
            out.update(int(x) for x in v)
    return out


@dataclass
class Trajectory:
    """One trajectory's tokens: ``prompt`` (the first prompt), then ``response`` (every later token) with
    ``mask`` (1: sampled by the engine, 0: observation), ``logprobs`` (the engine's for sampled tokens, 0.0 on
    observations) and ``versions`` (the policy version that sampled each token, ``agent.partial``; -1 on
    observations); ``turn_starts``: where each turn's engine prompt ended in ``prompt + response`` (the engine saw
    exactly ``(prompt + response)[:turn_starts[k]]`` at turn ``k``)."""

    prompt: list[int]
    response: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    turn_starts: list[int] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)

    def ids(self) -> list[int]:
        return self.prompt + self.response

    def __len__(self) -> int:
        return len(self.prompt) + len(self.response)

    def add_turn(self, sampled: list[int], logprobs: list[float] | None, versions: list[int] | None = None) -> None:
        self.response += sampled
        self.mask += [1] * len(sampled)
        lps = list(logprobs) if logprobs is not None and len(logprobs) == len(sampled) else [0.0] * len(sampled)
        self.logprobs += lps
        self.versions += list(versions) if versions is not None and len(versions) == len(sampled) \
            else [-1] * len(sampled)

    def add_observation(self, ids: list[int]) -> None:
        self.response += ids
        self.mask += [0] * len(ids)
        self.logprobs += [0.0] * len(ids)
        self.versions += [-1] * len(ids)

    def oldest_version(self) -> int | None:
        """The version of the oldest sampled token (None when no token has one)."""
        return min((v for v in self.versions if v >= 0), default=None)

    def mixed_versions(self) -> bool:
        """Whether more than one policy version sampled the trajectory's tokens (it spans a weight sync)."""
        return len({v for v in self.versions if v >= 0}) > 1
