"""An OpenEnv-shaped environment server to run as a job's environment server pods (``spec.environment.http.server``
with the runtime image): ``python -m rlhf_testing.env_server [--port 8000]``. Standard library only.

* ``GET /health``: 200 (the pods' readiness path).
* ``POST /reset`` ``{"episode_id", "sample"}``: starts the episode; the first observation is the sample's prompt,
  prefixed with the server's host name (in a pod, the pod's name: which replica answered).
* ``POST /step`` ``{"episode_id", "action": {"message"}}``: a turn with tool results gets them back as the
  observation; a turn without is the final answer: reward 1 when its text contains the sample's answer (``42``
  when the sample has none), else 0, and done (the episode is dropped), its observation the server's host name
  (``[host]``). An unknown episode is answered 404: an episode's requests must all reach the replica that
  holds it.

Each answer is ``{"observation", "reward", "done"}`` (``rlhf_runtime.agent.environments.HttpEnvironment``).
SIGTERM stops the server at once: as a container's PID 1 it would otherwise be ignored until the kill.
"""

from __future__ import annotations

import argparse
import json
import signal
import socket
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


class Episodes:
    """The samples of the episodes in progress, by ``episode_id``."""

    def __init__(self) -> None:
        self.samples: dict[str, dict[str, Any]] = {}
        self.lock = threading.Lock()
        self.host = socket.gethostname()

    def reset(self, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        sample = body.get("sample") or {}
        with self.lock:
            self.samples[str(body.get("episode_id"))] = sample
        text = f"[{self.host}] {sample.get('prompt') or ''}"
        return 200, {"observation": {"text": text}, "reward": None, "done": False}

    def step(self, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        episode = str(body.get("episode_id"))
        message = (body.get("action") or {}).get("message") or {}
        results = message.get("tool_results") or []
        with self.lock:
            sample = self.samples.get(episode) if results else self.samples.pop(episode, None)
        if sample is None:
            return 404, {"error": f"no episode {episode!r}: POST /reset first"}
        if results:
            return 200, {"observation": {"messages": results}, "reward": None, "done": False}
        answer = str(sample.get("answer") or "42")
        reward = 1.0 if answer in (message.get("content") or "") else 0.0
        return 200, {"observation": {"text": f"[{self.host}]"}, "reward": reward, "done": True}


def handler(episodes: Episodes) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: Any) -> None:
            pass

        def _send(self, status: int, body: dict[str, Any]) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            self._send(200 if self.path == "/health" else 404, {"host": episodes.host})

        def do_POST(self) -> None:
            try:
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")
            except ValueError as e:
                self._send(400, {"error": f"not JSON: {e}"})
                return
            if self.path == "/reset":
                self._send(*episodes.reset(body))
            elif self.path == "/step":
                self._send(*episodes.step(body))
            else:
                self._send(404, {"error": f"no {self.path}"})

    return Handler


def serve(port: int, host: str = "") -> ThreadingHTTPServer:
    """The server on ``host:port`` (every interface by default), not yet serving."""
    httpd = ThreadingHTTPServer((host, port), handler(Episodes()))
    httpd.daemon_threads = True
    return httpd


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--port", type=int, default=8000)
    args = p.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    httpd = serve(args.port)
    print(f"environment server on port {args.port}", flush=True)
    httpd.serve_forever()


if __name__ == "__main__":
    main()
