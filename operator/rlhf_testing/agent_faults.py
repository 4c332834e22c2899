"""Tools, an environment class and an environment server for multi-turn benchmarks (``benchmarks/agent_rollout.py``):
a tool that takes a fixed time, the same tool in lockstep (every call of a round waits for the whole batch's), one
tool per fault, an environment class that raises, and an OpenEnv-shaped HTTP server that answers 5xx, 4xx or
garbage on the turns that ask for it.

User tools are ``module:function`` references (``spec.environment.tools[].function``); the class is a
``spec.environment.className``; the server's address is ``spec.environment.http.url``.
"""

from __future__ import annotations

import asyncio
import json
import re
import threading
import time
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

#: Seconds ``wait`` and ``wait_lockstep`` take before they answer.
TOOL_SECONDS = 0.2
#: The barrier of ``wait_lockstep``, set by ``set_lockstep`` (module state: the rollout's tools run in this process).
_LOCKSTEP: dict[str, asyncio.Barrier | None] = {"barrier": None}


async def wait(query: str) -> str:
    """Answers after ``TOOL_SECONDS`` (asynchronously: the event loop goes on meanwhile)."""
    await asyncio.sleep(TOOL_SECONDS)
    return f"found {query}"


def set_lockstep(parties: int) -> None:
    """Until the next call, every ``wait_lockstep`` call waits, after its ``TOOL_SECONDS``, until ``parties`` calls
    (the batch's trajectories, each one call per round) have arrived. Call it before each rollout: the barrier binds
    to the event loop of its first use."""
    _LOCKSTEP["barrier"] = asyncio.Barrier(parties)


async def wait_lockstep(query: str) -> str:
    """``wait``, then the whole batch's round (``set_lockstep``): the rollout goes on in lockstep."""
    barrier = _LOCKSTEP["barrier"]
    if barrier is None:
        raise RuntimeError("set_lockstep(parties) was not called")
    await asyncio.sleep(TOOL_SECONDS)
    await barrier.wait()
    return f"found {query}"


async def echo(query: str) -> str:
    """Answers at once."""
    return query


async def hang(query: str) -> str:
    """Never answers in time: the call's timeout (``python.timeoutSeconds``) ends it."""
    await asyncio.sleep(3600)
    return query


def boom(query: str) -> str:
    """Raises (a plain function: it runs in a thread)."""
    raise RuntimeError(f"boom on {query!r}")


async def flood(query: str) -> str:
    """An answer far over ``python.maxOutputBytes``."""
    return (query + " ") * 20000


async def badbytes(query: str) -> bytes:
    """An answer that is not valid UTF-8."""
    return b"\xff\xfe" + query.encode() + b"\xc3\x28\xa0\xa1"


class FaultEnv:
    """The tool results are the observations; a turn without a tool call ends the trajectory (reward 1).
    ``reset`` raises for a sample whose prompt contains ``reset-crash``; ``step`` raises on a turn whose text
    contains ``crash``."""

    def reset(self, sample: dict[str, Any]) -> None:
        if "reset-crash" in (sample.get("prompt") or ""):
            raise RuntimeError("the environment crashed in reset")

    def step(self, message: dict[str, Any]) -> dict[str, Any]:
        if "crash" in (message.get("content") or ""):
            raise RuntimeError("the environment crashed in step")
        results = message.get("tool_results") or []
        return {"observations": results, "reward": None if results else 1.0, "done": not results}


#: Markers in a turn's text that make ``FaultServer`` fail that turn's ``/step``: ``[http:down]`` 503 on every
#: attempt, ``[http:flaky]`` 503 on the first two attempts, ``[http:4xx]`` 400, ``[http:garbage]`` a body that is
#: not JSON, ``[http:badutf8]`` an observation with bytes that are not UTF-8.
HTTP_MARKER = re.compile(r"\[http:(down|flaky|4xx|garbage|badutf8)\]")


class FaultServer:
    """An OpenEnv-shaped environment server in a thread of this process (``url``): ``/reset`` starts an episode,
    ``/step`` answers the turn's tool results as the observation (done on a turn without calls), failing turns
    marked with ``HTTP_MARKER``; ``outage(seconds)`` answers every request 503 for that long. ``answers`` counts
    what it sent by kind."""

    def __init__(self) -> None:
        self.answers: Counter[str] = Counter()
        self.attempts: Counter[tuple[str, str]] = Counter()
        self.down_until = 0.0
        self.lock = threading.Lock()
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, name="fault-server", daemon=True).start()

    def outage(self, seconds: float) -> None:
        self.down_until = time.monotonic() + seconds

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def answer(self, path: str, body: dict[str, Any]) -> tuple[int, bytes, str]:
        """(status, body, kind) for one request."""
        if time.monotonic() < self.down_until:
            return 503, b"outage", "outage_5xx"
        if path == "/reset":
            return 200, json.dumps({"observation": None, "reward": None, "done": False}).encode(), "ok"
        message = (body.get("action") or {}).get("message") or {}
        content = message.get("content") or ""
        m = HTTP_MARKER.search(content)
        with self.lock:
            self.attempts[(str(body.get("episode_id")), content)] += 1
            attempt = self.attempts[(str(body.get("episode_id")), content)]
        kind = m.group(1) if m else None
        if kind == "down" or (kind == "flaky" and attempt <= 2):
            return 503, b"unavailable", f"{kind}_5xx"
        if kind == "4xx":
            return 400, b"bad request", "4xx"
        if kind == "garbage":
            return 200, b"<html>not json", "garbage"
        results = message.get("tool_results") or []
        obs: Any = {"messages": results} if results else None
        if kind == "badutf8":
            obs = {"text": "\x00"}
        data = json.dumps({"observation": obs, "reward": None if results else 1.0, "done": not results}).encode()
        return 200, data.replace(b"\\u0000", b"\xff\xfe\xc3\x28"), kind or "ok"

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def _send(self, status: int, data: bytes) -> None:
                self.send_response(status)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:
                self._send(200 if self.path == "/health" else 404, b"ok")

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])) or b"{}")
                status, data, kind = server.answer(self.path, body)
                with server.lock:
                    server.answers[kind] += 1
                self._send(status, data)

        return Handler
