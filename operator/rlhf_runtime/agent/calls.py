"""An assistant turn's tool calls, parsed by vLLM's own tool-call parser (``spec.environment.toolParser``).

``CallParser(tokenizer, name, tools).parse(text)`` gives the turn's content and its calls (name and arguments as
a dict), or the reason the turn's call is malformed: the parser's start marker is in the text but the parser
found no call in it, or a call's arguments are not a JSON object. A malformed call is data for the trajectory
(an error observation, ``agent.rollout``), never an exception out of the rollout.

vLLM is imported when a parser is made (the driver's process has it: the runtime image); ``check_parser`` refuses
a parser name this vLLM lacks before the first step.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Call:
    name: str
    arguments: dict[str, Any]
    id: str = ""


@dataclass
class Parsed:
    """One assistant turn: ``content`` (text outside the calls), ``calls``, and ``error`` (why a call in it is
    malformed; then ``calls`` holds the well-formed ones, if any)."""

    content: str
    calls: list[Call] = field(default_factory=list)
    error: str | None = None


def check_parser(name: str) -> None:
    """Raise ValueError naming the choices when this vLLM has no tool-call parser ``name``."""
    from vllm.tool_parsers import ToolParserManager

    known = ToolParserManager.list_registered()
    if name not in known:
        raise ValueError(f"spec.environment.toolParser {name!r} is not a tool-call parser of this vLLM "
                         f"(it has: {', '.join(sorted(known))})")


class CallParser:
    """vLLM's parser ``name`` over ``tokenizer``, for ``tools`` (OpenAI-style tool dicts)."""

    def __init__(self, tokenizer: Any, name: str, tools: list[dict[str, Any]]) -> None:
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
        from vllm.tool_parsers import ToolParserManager

        check_parser(name)
        self.name = name
        self._cls = ToolParserManager.get_tool_parser(name)
        self.tokenizer = tokenizer
        self.request = ChatCompletionRequest(model="rlhf", messages=[{"role": "user", "content": ""}],
                                             tools=tools or None)
        # vLLM's parsers log every JSON error with a traceback; a malformed call is ordinary data here
        logging.getLogger(self._cls.__module__).setLevel(logging.CRITICAL)
        try:  # a parser that cannot work with this tokenizer says so now, not at the first turn
            probe = self._cls(tokenizer, self.request.tools)
        except Exception as e:
            raise ValueError(f"spec.environment.toolParser {name!r} cannot parse this model's output: {e}") from e
        self.start = getattr(probe, "tool_call_start_token", None) or getattr(probe, "bot_token", None)

    def parse(self, text: str) -> Parsed:
        """The turn's content and calls (see the module docstring); never raises on the model's text."""
        parser = self._cls(self.tokenizer, self.request.tools)  # parsers keep per-request state
        try:
            info = parser.extract_tool_calls(text, self.request)
        except Exception as e:  # noqa: BLE001 - the model's text broke the parser: a malformed call
            return Parsed(text, [], f"the tool call could not be parsed ({type(e).__name__}: {e})")
        if not info.tools_called:
            if isinstance(self.start, str) and self.start in text:
                return Parsed(text, [], f"malformed tool call: {self.start} without a valid call after it")
            return Parsed(info.content if info.content is not None else text)
        calls: list[Call] = []
        errors: list[str] = []
        for c in info.tool_calls:
            try:
                args = json.loads(c.function.arguments or "{}")
            except (TypeError, ValueError) as e:
                errors.append(f"the arguments of {c.function.name!r} are not JSON ({e})")
                continue
            if not isinstance(args, dict):
                errors.append(f"the arguments of {c.function.name!r} are not a JSON object")
                continue
            calls.append(Call(str(c.function.name), args, str(getattr(c, "id", "") or "")))
        return Parsed(info.content or "", calls, "; ".join(errors) or None)
