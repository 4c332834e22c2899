"""The code-execution server of the sandbox image: the HTTP API of agent-sandbox's python runtime, which the
``k8s-agent-sandbox`` client speaks, on the standard library only.

    GET  /                      {"status": "ok", "message": ...}                 (the readiness probe)
    POST /execute               {"command": str, "timeout_seconds": float?}
                                -> {"stdout", "stderr", "exit_code", "timed_out", "stdout_truncated",
                                    "stderr_truncated"}
    POST /upload                multipart/form-data, field "file" (its filename is the path)
    GET  /download/<path>       the file's bytes
    GET  /list/<path>           [{"name", "size", "type": "file"|"directory", "mod_time"}]
    GET  /exists/<path>         {"path", "exists"}

``command`` is split like a shell's words (``shlex.split``) and run without a shell, in its own session, from the
scratch directory: Python code runs as ``python3 -c CODE``, a shell line as ``sh -c LINE``. A command runs for at
most ``timeout_seconds`` (capped by ``SANDBOX_EXEC_TIMEOUT_SECONDS``); then its whole process group is killed,
``timed_out`` is true and ``exit_code`` 124. Each output stream keeps its first ``SANDBOX_OUTPUT_LIMIT_BYTES`` bytes
(the rest is read and dropped) and is decoded as UTF-8 with replacement characters, so binary output is not an
error. A command killed by a signal reports 128 + the signal's number, one that cannot start 126 or 127, one
that does not split into words 2.
File paths are relative to the scratch directory and cannot leave it.

Environment: SANDBOX_PORT (8888), SANDBOX_BASE_DIR (the scratch directory, /tmp), SANDBOX_EXEC_TIMEOUT_SECONDS
(300), SANDBOX_OUTPUT_LIMIT_BYTES (65536), SANDBOX_MAX_REQUEST_BYTES (16 MiB).
"""

from __future__ import annotations

import email.parser
import email.policy
import json
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def _setting(name: str, default: float) -> float:
    try:
        value = float(os.environ.get(name, default))
    except ValueError:
        return default
    return value if value > 0 else default


PORT = int(_setting("SANDBOX_PORT", 8888))
BASE_DIR = os.path.realpath(os.environ.get("SANDBOX_BASE_DIR", "").strip() or "/tmp")
EXEC_TIMEOUT = _setting("SANDBOX_EXEC_TIMEOUT_SECONDS", 300)
OUTPUT_LIMIT = int(_setting("SANDBOX_OUTPUT_LIMIT_BYTES", 65536))
MAX_REQUEST = int(_setting("SANDBOX_MAX_REQUEST_BYTES", 16 << 20))
TIMEOUT_EXIT_CODE = 124


def _drain(stream, out: dict) -> None:
    """Read ``stream`` to its end into ``out["data"]``, keeping its first ``OUTPUT_LIMIT`` bytes."""
    kept = out["data"]
    while chunk := stream.read1(65536):
        room = OUTPUT_LIMIT - len(kept)
        if room > 0:
            kept += chunk[:room]
        if len(chunk) > room:
            out["truncated"] = True


def execute(command: str, timeout: float | None) -> dict:
    """Run ``command`` (shell words, no shell) as described in the module's docstring."""
    limit = min(timeout, EXEC_TIMEOUT) if timeout and timeout > 0 else EXEC_TIMEOUT
    result = {"stdout": "", "stderr": "", "exit_code": 1, "timed_out": False,
              "stdout_truncated": False, "stderr_truncated": False}
    try:
        argv = shlex.split(command)
        if not argv:
            raise ValueError("empty command")
        proc = subprocess.Popen(argv, cwd=BASE_DIR, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, start_new_session=True)
    except (ValueError, OSError) as e:
        result["stderr"] = f"Failed to execute command: {e}"
        result["exit_code"] = 127 if isinstance(e, FileNotFoundError) else 126 if isinstance(e, OSError) else 2
        return result
    streams = {"stdout": {"data": bytearray()}, "stderr": {"data": bytearray()}}
    readers = [threading.Thread(target=_drain, args=(getattr(proc, k), v), daemon=True) for k, v in streams.items()]
    for r in readers:
        r.start()
    try:
        proc.wait(timeout=limit)
    except subprocess.TimeoutExpired:
        result["timed_out"] = True
    try:  # whatever the command left running in its group goes too, and with it the pipes' last writers
        os.killpg(proc.pid, signal.SIGKILL)
    except OSError:
        pass
    proc.wait()
    for r in readers:  # a process that left the group may hold a pipe open: what was read by then is the output
        r.join(timeout=2)
    for name, out in streams.items():
        result[name] = bytes(out["data"]).decode("utf-8", errors="replace")
        result[f"{name}_truncated"] = bool(out.get("truncated"))
    code = proc.returncode
    if result["timed_out"]:
        code = TIMEOUT_EXIT_CODE
    elif code < 0:  # killed by a signal: the shell's convention
        code = 128 - code
    result["exit_code"] = code
    return result


def safe_path(path: str) -> str:
    """``path`` under ``BASE_DIR``; ValueError when it would leave it."""
    full = os.path.realpath(os.path.join(BASE_DIR, path.lstrip("/")))
    if os.path.commonpath([BASE_DIR, full]) != BASE_DIR:
        raise ValueError("path outside the sandbox directory")
    return full


class Handler(BaseHTTPRequestHandler):
    server_version = "rlhf-sandbox/1"
    protocol_version = "HTTP/1.1"
    # TCP_NODELAY: a response is written as headers then body; with Nagle's algorithm on a kept-alive connection
    # the body waits for the client's delayed ACK of the headers (about 40 ms a call)
    disable_nagle_algorithm = True

    def log_message(self, format: str, *args) -> None:
        sys.stderr.write(f"{time.strftime('%H:%M:%S')} {self.address_string()} {format % args}\n")

    def _send(self, status: int, body: bytes, content_type: str = "application/json") -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _json(self, status: int, obj) -> None:
        self._send(status, json.dumps(obj).encode())

    def _body(self) -> bytes | None:
        length = int(self.headers.get("Content-Length") or 0)
        if length > MAX_REQUEST:
            self._json(413, {"message": f"request over {MAX_REQUEST} bytes"})
            self.close_connection = True
            return None
        return self.rfile.read(length)

    def _path(self, prefix: str) -> str | None:
        """The confined file path of a ``/<prefix>/<quoted path>`` request (None after a 403)."""
        rel = urllib.parse.unquote(self.path[len(prefix):].split("?", 1)[0])
        try:
            return safe_path(rel)
        except ValueError:
            self._json(403, {"message": "Access denied"})
            return None

    def do_GET(self) -> None:
        if self.path in ("/", ""):
            self._json(200, {"status": "ok", "message": "Sandbox Runtime is active."})
        elif self.path.startswith("/exists/"):
            if (p := self._path("/exists/")) is not None:
                self._json(200, {"path": urllib.parse.unquote(self.path[8:]), "exists": os.path.exists(p)})
        elif self.path.startswith("/download/"):
            if (p := self._path("/download/")) is not None:
                if not os.path.isfile(p):
                    self._json(404, {"message": "File not found"})
                else:
                    with open(p, "rb") as f:
                        self._send(200, f.read(), "application/octet-stream")
        elif self.path.startswith("/list/"):
            if (p := self._path("/list/")) is not None:
                if not os.path.isdir(p):
                    self._json(404, {"message": "Path is not a directory"})
                else:
                    with os.scandir(p) as it:
                        self._json(200, [{"name": e.name, "size": e.stat().st_size, "mod_time": e.stat().st_mtime,
                                          "type": "directory" if e.is_dir() else "file"} for e in it])
        else:
            self._json(404, {"message": "Not found"})

    def do_POST(self) -> None:
        body = self._body()
        if body is None:
            return
        if self.path == "/execute":
            try:
                req = json.loads(body)
                command, timeout = req["command"], req.get("timeout_seconds")
                if not isinstance(command, str) or not (timeout is None or isinstance(timeout, int | float)):
                    raise TypeError("command must be a string and timeout_seconds a number")
            except (ValueError, KeyError, TypeError) as e:
                self._json(400, {"message": f"bad request: {e}"})
                return
            self._json(200, execute(command, timeout))
        elif self.path == "/upload":
            self._upload(body)
        else:
            self._json(404, {"message": "Not found"})

    def _upload(self, body: bytes) -> None:
        head = f"Content-Type: {self.headers.get('Content-Type', '')}\r\n\r\n".encode()
        msg = email.parser.BytesParser(policy=email.policy.HTTP).parsebytes(head + body)
        part = next((p for p in msg.iter_parts() if p.get_param("name", header="content-disposition") == "file"),
                    None) if msg.is_multipart() else None
        if part is None or not part.get_filename():
            self._json(400, {"message": "expected multipart/form-data with a 'file' field"})
            return
        try:
            path = safe_path(part.get_filename())
        except ValueError:
            self._json(403, {"message": "Access denied"})
            return
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(part.get_payload(decode=True) or b"")
        self._json(200, {"message": f"File '{part.get_filename()}' uploaded successfully."})


def main() -> None:
    server = ThreadingHTTPServer(("0.0.0.0", PORT), Handler)
    server.daemon_threads = True
    signal.signal(signal.SIGTERM, lambda *_: threading.Thread(target=server.shutdown).start())
    print(f"sandbox server on :{PORT}, scratch {BASE_DIR}, limit {EXEC_TIMEOUT:g}s, output {OUTPUT_LIMIT} B",
          file=sys.stderr, flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
