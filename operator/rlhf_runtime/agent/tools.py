"""The tools of ``spec.environment.tools``: the schemas the model sees and the calls that run them.

``Tools(specs, limits)`` holds every tool: the builtin ``python`` (``isolation.run_python``: an isolated process
with time, memory and output limits, no network, no credentials) and user tools ``module:function`` from the
runtime image (a plain function in a thread, a coroutine function on the loop; both trusted code of the image:
a plain function past its timeout keeps its thread until it returns, since threads cannot be stopped; code the
model writes belongs in the ``python`` tool). ``await tools.call(call)`` never
raises on the model's input or the tool's behaviour: an unknown tool, arguments that do not match the tool's
schema, an exception, a timeout, an oversized answer or one that is not UTF-8 become an ``Outcome`` with
``error`` set (its kind in ``ERROR_KINDS``) and a ``text`` the model can read.

With ``environment.sandbox`` the builtin ``python`` and ``shell`` tools run in sandbox pods instead
(``sandbox.SandboxPool``): ``async with tools.session()`` around a trajectory gives it its own sandbox, claimed at
its first builtin call and released when the block ends (``session().claim_seconds``: how long its claims took).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import inspect
import json
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from rlhf_api.environment import Environment, Tool
from rlhf_runtime.agent.calls import Call
from rlhf_runtime.algo.rewards import load_ref

#: Kinds of tool faults counted in the metrics.
ERROR_KINDS = ("unknown_tool", "bad_arguments", "malformed_call", "exception", "timeout", "memory",
               "output_truncated", "invalid_utf8", "isolation", "environment", "sandbox")
#: The trajectory's tool session (``Tools.session``), seen by the calls it makes (asyncio copies it into them).
_SESSION: contextvars.ContextVar[Any] = contextvars.ContextVar("rlhf_tool_session", default=None)


@dataclass
class NoSession:
    """A trajectory's tool state without sandboxes: nothing to claim or release."""

    claim_seconds: list[float] = field(default_factory=list)


@dataclass
class Outcome:
    """A tool call's answer: ``text`` for the model, ``error`` (an ``ERROR_KINDS`` entry) when it failed,
    ``seconds`` it took."""

    text: str
    error: str | None = None
    seconds: float = 0.0


def load_function(ref: str, field: str, what: str = "tool function") -> Callable[..., Any]:
    """``module:function`` imported, or ValueError naming ``field`` and what went wrong (``rewards.load_ref``)."""
    return load_ref(ref, what, field)


def openai_tools(specs: list[Tool]) -> list[dict[str, Any]]:
    """The tools as the chat template and vLLM's parsers take them (OpenAI's function-tool shape)."""
    return [{"type": "function", "function": {"name": t.name, "description": t.description,
                                              "parameters": t.parameters}} for t in specs]


def _cut(text: str, limit: int) -> tuple[str, bool]:
    data = text.encode("utf-8", errors="replace")
    if len(data) <= limit:
        return text, False
    return data[:limit].decode("utf-8", errors="ignore") + f"\n[... {len(data) - limit} bytes cut]", True


class Tools:
    """Every tool of an environment spec (module docstring)."""

    def __init__(self, env: Environment, job: tuple[str, str, str | None] | None = None) -> None:
        """``job``: (name, namespace, uid) of the RLHFJob, whose warm pool the sandboxes are claimed from."""
        import jsonschema

        self.env = env
        self.sandboxes: Any = None
        if env.sandbox is not None:
            from rlhf_runtime.agent.sandbox import SandboxPool

            if job is None:
                raise ValueError("spec.environment.sandbox: the sandboxes need the job's name and namespace")
            self.sandboxes = SandboxPool(env.sandbox, *job, threads=env.concurrency)
        self.specs = {t.name: t for t in env.tools or []}
        self.functions: dict[str, Callable[..., Any]] = {}
        self.validators: dict[str, Any] = {}
        for i, t in enumerate(env.tools or []):
            field = f"spec.environment.tools[{i}]"
            try:
                jsonschema.Draft202012Validator.check_schema(t.parameters)
            except jsonschema.SchemaError as e:
                raise ValueError(f"{field}.parameters is not a valid JSON schema: {e.message}") from e
            if t.parameters.get("type") != "object":
                raise ValueError(f"{field}.parameters must be a JSON schema of type object (the call's arguments), "
                                 f"not type {t.parameters.get('type')!r}")
            self.validators[t.name] = jsonschema.Draft202012Validator(t.parameters)
            if t.function:
                self.functions[t.name] = load_function(t.function, f"{field}.function")
        if env.wants_python():
            from rlhf_runtime.agent import isolation

            why = isolation.check_isolation()
            if why:
                raise ValueError(f"the builtin python tool cannot run isolated here: {why}")

    @contextlib.asynccontextmanager
    async def session(self) -> AsyncIterator[Any]:
        """One trajectory's tool state: with sandboxes, its sandbox (released at the end of the block)."""
        if self.sandboxes is None:
            yield NoSession()
            return
        from rlhf_runtime.agent.sandbox import Session

        session = Session(self.sandboxes)
        token = _SESSION.set(session)
        try:
            yield session
        finally:
            _SESSION.reset(token)
            await session.close()

    def schemas(self) -> list[dict[str, Any]]:
        return openai_tools(list(self.specs.values()))

    async def call(self, call: Call) -> Outcome:
        """Run one call; every fault is an ``Outcome`` with ``error`` (module docstring)."""
        t0 = time.perf_counter()
        out = await self._call(call)
        out.seconds = time.perf_counter() - t0
        return out

    async def _call(self, call: Call) -> Outcome:
        spec = self.specs.get(call.name)
        if spec is None:
            return Outcome(f"error: there is no tool {call.name!r} (tools: {', '.join(self.specs)})", "unknown_tool")
        problems = sorted(self.validators[call.name].iter_errors(call.arguments), key=lambda e: list(e.path))
        if problems:
            where = "/".join(str(p) for p in problems[0].path) or "arguments"
            return Outcome(f"error: bad arguments for {call.name} ({where}: {problems[0].message})", "bad_arguments")
        if spec.builtin and self.sandboxes is not None:
            return await self._sandboxed(spec.builtin, call.arguments)
        if spec.builtin == "python":
            return await self._python(call.arguments)
        return await self._function(call)

    async def _sandboxed(self, builtin: str, args: dict[str, Any]) -> Outcome:
        """A builtin call in the trajectory's sandbox (outside a session: a sandbox of its own for this call)."""
        session = _SESSION.get()
        if session is not None:
            return Outcome(*await session.call(builtin, args))
        async with self.session() as own:
            return Outcome(*await own.call(builtin, args))

    async def _python(self, args: dict[str, Any]) -> Outcome:
        from rlhf_runtime.agent import isolation

        lim = self.env.python
        code = args.get("code")
        if not isinstance(code, str):
            return Outcome("error: the python tool takes a string argument 'code'", "bad_arguments")
        res = await isolation.run_python(code, isolation.Limits(timeout_s=lim.timeout_seconds,
                                                                memory_mb=lim.memory_mib,
                                                                max_output_bytes=lim.max_output_bytes))
        kind = None
        if res.error == "timeout":
            kind = "timeout"
        elif res.error == "memory":
            kind = "memory"
        elif res.error and res.error.startswith("isolation"):
            kind = "isolation"
        elif res.error == "output_truncated" or res.truncated:
            kind = "output_truncated"
        elif res.error:
            kind = "exception"
        elif res.invalid_utf8:  # the model still sees it, with replacement characters
            kind = "invalid_utf8"
        text = res.output if kind in (None, "output_truncated", "exception", "invalid_utf8") else \
            f"{res.output}\nerror: {res.error}"
        return Outcome(text, kind)

    async def _function(self, call: Call) -> Outcome:
        fn = self.functions[call.name]
        limit = self.env.python.max_output_bytes
        try:
            if inspect.iscoroutinefunction(fn):
                value = await asyncio.wait_for(fn(**call.arguments), self.env.python.timeout_seconds)
            else:
                value = await asyncio.wait_for(asyncio.to_thread(fn, **call.arguments),
                                               self.env.python.timeout_seconds)
        except TimeoutError:
            return Outcome(f"error: {call.name} took longer than {self.env.python.timeout_seconds} s", "timeout")
        except Exception as e:  # noqa: BLE001 - a user tool's failure is the trajectory's data
            return Outcome(f"error: {call.name} raised {type(e).__name__}: {e}", "exception")
        invalid = False
        if isinstance(value, bytes):
            try:
                value = value.decode("utf-8")
            except UnicodeDecodeError:  # the model still sees it, with replacement characters
                value, invalid = value.decode("utf-8", errors="replace"), True
        elif not isinstance(value, str):
            try:
                value = json.dumps(value)
            except (TypeError, ValueError):
                value = str(value)
        text, cut = _cut(value, limit)
        return Outcome(text, "output_truncated" if cut else "invalid_utf8" if invalid else None)
