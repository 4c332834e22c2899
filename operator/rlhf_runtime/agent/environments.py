"""What a trajectory talks to between its turns: the environment protocol and its three kinds.

The protocol (``spec.environment.className``: a class in the runtime image; one instance per trajectory, made
without arguments). Each method may be a plain method or a coroutine:

* ``reset(sample) -> list[message] | None``: start from a data sample (a dict: ``prompt``, ``answer``,
  ``messages``); the messages the first prompt renders, or None for the sample's own (its chat messages, else
  its prompt as one user message).
* ``step(message) -> Step | dict``: the assistant's turn (``{"role": "assistant", "content": ...,
  "tool_calls": [...]}`` with the calls already run by the rollout when the spec lists tools, their results as
  ``tool`` messages in ``tool_results``) -> the observation messages for the next turn, an optional reward (the
  trajectory's reward is the sum of those returned), and ``done``.
* ``close()`` (optional): called once when the trajectory ends.

``ToolsOnly``: the environment of a spec with tools and no class or server: the tool results are the
observations, and the trajectory ends when the model answers without a tool call (a malformed one is answered
with its error) and has no reward of its own.

``HttpEnvironment``: a server speaking OpenEnv's HTTP shape (``POST /reset``, ``POST /step`` with ``{"action":
...}``, answers ``{"observation": ..., "reward": ..., "done": ...}``), with the trajectory's ``episode_id`` in
every request so that one server holds many episodes. The observation becomes messages: its ``messages`` list
if it has one, else its ``text``/``content``/``message`` string as one user message, else its JSON. A 5xx, a
refused connection or a timeout is retried with backoff; past ``http.unreachableSeconds`` of nothing but such
failures the run fails with ``EnvironmentUnreachable`` naming the server; a shorter outage is an error of the
trajectories it hit (``EnvironmentFault`` -> ``on_error``). Each episode keeps to one address of the server
(``endpoints.Endpoints``: one pod of the operator's server); an episode whose address fails and is no longer
the server's (its pod is gone) is that episode's fault at once, and new episodes go to the other addresses.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from typing import Any

from rlhf_api.environment import Environment as EnvironmentSpec
from rlhf_runtime.agent.endpoints import Endpoints, Resolver, resolve
from rlhf_runtime.agent.tools import load_function


@dataclass
class Step:
    observations: list[dict[str, Any]] = field(default_factory=list)
    reward: float | None = None
    done: bool = False


class EnvironmentFault(Exception):
    """The environment failed on one trajectory (an exception in its code, a bad answer, a short outage)."""


class EnvironmentUnreachable(RuntimeError):
    """The environment server stayed unreachable past ``http.unreachableSeconds``: the run fails."""


async def _maybe(value: Any) -> Any:
    return await value if inspect.isawaitable(value) else value


def sample_dict(sample: Any) -> dict[str, Any]:
    msgs = [{"role": r, "content": c} for r, c in sample.messages] if sample.messages else None
    return {"prompt": sample.prompt, "answer": sample.answer, "messages": msgs}


def first_messages(sample: Any) -> list[dict[str, Any]]:
    d = sample_dict(sample)
    return d["messages"] or [{"role": "user", "content": d["prompt"]}]


def as_step(out: Any) -> Step:
    """A ``step`` answer (a ``Step``, a dict with the same keys, or an OpenEnv-shaped dict) as a ``Step``."""
    if isinstance(out, Step):
        return out
    if not isinstance(out, dict):
        raise EnvironmentFault(f"step returned {type(out).__name__}, not a Step or a dict")
    obs = out.get("observations", out.get("observation"))
    reward = out.get("reward")
    if reward is not None and not isinstance(reward, (int, float)):
        raise EnvironmentFault(f"step returned a reward of type {type(reward).__name__}")
    return Step(observation_messages(obs), None if reward is None else float(reward), bool(out.get("done")))


def observation_messages(obs: Any) -> list[dict[str, Any]]:
    """An observation as chat messages (see the module docstring)."""
    if obs is None:
        return []
    if isinstance(obs, list) and all(isinstance(m, dict) and "role" in m for m in obs):
        return [{"role": str(m["role"]), "content": str(m.get("content", ""))} for m in obs]
    if isinstance(obs, dict):
        if isinstance(obs.get("messages"), list):
            return observation_messages(obs["messages"])
        for key in ("text", "content", "message"):
            if isinstance(obs.get(key), str):
                return [{"role": "user", "content": obs[key]}]
    if isinstance(obs, str):
        return [{"role": "user", "content": obs}]
    return [{"role": "user", "content": json.dumps(obs, default=str)}]


class ToolsOnly:
    """The tool results are the observations; done when a turn makes no tool call."""

    async def reset(self, sample: dict[str, Any]) -> None:
        return None

    async def step(self, message: dict[str, Any]) -> Step:
        results = list(message.get("tool_results") or [])
        return Step(results, None, not results)


class ClassEnvironment:
    """A user class of the protocol, one instance per trajectory; any exception is an ``EnvironmentFault``."""

    def __init__(self, cls: type) -> None:
        self.cls = cls
        self.inst: Any = None

    async def reset(self, sample: dict[str, Any]) -> list[dict[str, Any]] | None:
        try:
            self.inst = self.cls()
            out = await _maybe(self.inst.reset(sample))
        except Exception as e:
            raise EnvironmentFault(f"reset raised {type(e).__name__}: {e}") from e
        return None if out is None else observation_messages(out)

    async def step(self, message: dict[str, Any]) -> Step:
        try:
            return as_step(await _maybe(self.inst.step(message)))
        except EnvironmentFault:
            raise
        except Exception as e:
            raise EnvironmentFault(f"step raised {type(e).__name__}: {e}") from e

    async def close(self) -> None:
        close = getattr(self.inst, "close", None)
        if close is not None:
            try:
                await _maybe(close())
            except Exception:  # noqa: BLE001, S110 - closing is best effort
                pass


class HttpEnvironment:
    """One trajectory's episode on an OpenEnv-shaped server (module docstring), pinned to one of the server's
    addresses for all its requests (``Endpoints``)."""

    def __init__(self, url: str, timeout: float, outage: Outage, episode: str,
                 endpoints: Endpoints | None = None) -> None:
        self.url, self.timeout, self.outage, self.episode = url.rstrip("/"), timeout, outage, episode
        self.endpoints = endpoints or Endpoints(url)
        self.addr: str | None = None

    def _post(self, base: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
        headers = {"Content-Type": "application/json"}
        if self.addr is not None:  # the request goes to the pinned address, named as the server
            headers["Host"] = self.endpoints.host_header
        req = urllib.request.Request(f"{base}{path}", json.dumps(body).encode(), method="POST", headers=headers)
        with urllib.request.urlopen(req, timeout=self.timeout) as resp:
            return json.loads(resp.read().decode("utf-8"))  # invalid UTF-8: a ValueError, the server's fault

    async def _pin(self) -> None:
        """Pin the episode to an address (again, on a retried reset: the episode has no state anywhere yet)."""
        self.endpoints.release(self.addr)
        if self.endpoints.due():
            await asyncio.to_thread(self.endpoints.refresh)
        self.addr = self.endpoints.pin()

    async def _request(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        delay = 0.2
        while True:
            if path == "/reset":
                await self._pin()
            where = f"{self.url}{path}" + (f" (at {self.addr})" if self.addr is not None else "")
            failed = False
            try:
                out = await asyncio.to_thread(self._post, self.endpoints.url_of(self.addr), path, body)
                self.outage.ok()
                self.endpoints.answered(self.addr)
                if not isinstance(out, dict):
                    raise EnvironmentFault(f"{where} answered {type(out).__name__}, not an object")
                return out
            except urllib.error.HTTPError as e:
                if e.code < 500:
                    raise EnvironmentFault(f"{where} answered HTTP {e.code}") from e
                why = f"HTTP {e.code}"
            except (urllib.error.URLError, TimeoutError, ConnectionError, OSError) as e:
                why, failed = f"{type(e).__name__}: {getattr(e, 'reason', e)}", True
            except ValueError as e:  # UnicodeDecodeError too
                raise EnvironmentFault(f"{where} answered invalid JSON or UTF-8: {e}") from e
            self.outage.failed(f"{where}: {why}")  # raises past the deadline
            if failed and self.addr is not None and await asyncio.to_thread(self.endpoints.gone, self.addr) \
                    and path != "/reset":  # a retried reset goes to another address
                raise EnvironmentFault(f"{where}: {why}; {self.addr}, which held episode {self.episode}, is no "
                                       f"longer an address of {self.endpoints.host} (its pod is gone)")
            if delay > 5.0:
                raise EnvironmentFault(f"{where}: {why}")
            await asyncio.sleep(delay)
            delay *= 2

    async def reset(self, sample: dict[str, Any]) -> list[dict[str, Any]] | None:
        out = await self._request("/reset", {"episode_id": self.episode, "sample": sample})
        return observation_messages(out.get("observation")) or None

    async def step(self, message: dict[str, Any]) -> Step:
        return as_step(await self._request("/step", {"episode_id": self.episode, "action": {"message": message}}))

    async def close(self) -> None:
        self.endpoints.release(self.addr)
        self.addr = None


class Outage:
    """Whether the server has failed without a success for longer than ``limit`` seconds (shared by every
    trajectory of a job): ``failed`` raises ``EnvironmentUnreachable`` then."""

    def __init__(self, limit: float) -> None:
        self.limit = limit
        self.since: float | None = None

    def ok(self) -> None:
        self.since = None

    def failed(self, why: str) -> None:
        now = time.monotonic()
        self.since = self.since or now
        if now - self.since > self.limit:
            raise EnvironmentUnreachable(f"the environment server stayed unreachable for {now - self.since:.0f} s "
                                         f"(spec.environment.http.unreachableSeconds {self.limit:g}): {why}")


class Environments:
    """Makes each trajectory's environment for a spec (``spec.environment``) and the url of its server."""

    def __init__(self, spec: EnvironmentSpec, url: str | None = None, resolver: Resolver = resolve) -> None:
        self.spec = spec
        self.cls: type | None = None
        if spec.class_name:
            cls = load_function(spec.class_name, "spec.environment.className", "environment class")
            if not isinstance(cls, type) or not callable(getattr(cls, "step", None)):
                raise ValueError(f"spec.environment.className {spec.class_name!r} is not a class with a step "
                                 "method (see docs/agents.md for the protocol)")
            self.cls = cls
        self.url = url or (spec.http.url if spec.http else None)
        self.outage = Outage(spec.http.unreachable_seconds if spec.http else 0.0)
        # the operator's server: every episode pinned to one of its pods (its headless Service's addresses)
        self.endpoints = Endpoints(self.url, spec.http.server is not None, resolver) if self.url and spec.http \
            else None

    def wait_ready(self) -> None:
        """Before the first rollout: an HTTP environment's server answers its readiness path (``server.readyPath``,
        else ``/health``) with 2xx, polled for at most ``http.unreachableSeconds``; else ``EnvironmentUnreachable``
        naming it. Nothing to wait for otherwise."""
        if self.spec.http is None or not self.url:
            return
        path = self.spec.http.server.ready_path if self.spec.http.server else "/health"
        url, limit = f"{self.url.rstrip('/')}{path}", self.spec.http.unreachable_seconds
        end, why = time.monotonic() + limit, "no answer"
        while time.monotonic() < end:
            try:
                with urllib.request.urlopen(url, timeout=min(5.0, limit)) as resp:
                    if 200 <= resp.status < 300:
                        return
                    why = f"HTTP {resp.status}"
            except (urllib.error.URLError, TimeoutError, ConnectionError, OSError) as e:
                why = f"{type(e).__name__}: {getattr(e, 'reason', e)}"
            time.sleep(0.5)
        raise EnvironmentUnreachable(f"the environment server {url} was not ready within "
                                     f"spec.environment.http.unreachableSeconds {limit:g} ({why})")

    def make(self, episode: str) -> Any:
        if self.cls is not None:
            return ClassEnvironment(self.cls)
        if self.spec.http is not None:
            if not self.url:
                raise ValueError("spec.environment.http.server has no address yet (the operator sets it)")
            return HttpEnvironment(self.url, self.spec.http.timeout_seconds, self.outage, episode, self.endpoints)
        return ToolsOnly()
