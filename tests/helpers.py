"""Test helpers shared by the tiers: polling with a deadline (never bare sleeps); the runtime's view of its
RLHFJob over HTTP where no apiserver runs (``JobAPI``); a real MLflow tracking server (``MLflowServer``); a port
for a server started next (``free_port``, outside the kernel's ephemeral range: ``localcluster.free_port``)."""

from __future__ import annotations

import json
import sys
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "hack"))
from localcluster import free_port  # re-exported: every tier's servers take their ports from it

#: For a local Ray on a loaded 2-core machine (trainer, engines and Ray's own processes share it): its GCS declares
#: a node dead only after ~60 s without an answer (Ray's defaults: 5 missed checks of 3 s, 10 s timeout), so a
#: raylet starved for a few seconds is not taken for dead (seen: "node ... marked dead" mid-run at load ~9).
#: Single-node runs only: no test of these tiers kills a node.
LOADED_MACHINE_RAY_ENV = {"RAY_health_check_failure_threshold": "20", "RAY_health_check_timeout_ms": "30000"}


def audit_lines(path: Path) -> list[str]:
    """The complete lines of an apiserver audit log (JSON lines): split on newlines only, since an event's strings
    may hold characters that ``str.splitlines()`` also breaks at (U+2028, U+001C... in a refused object's field
    names); the text after the last newline, a line still being written, is left out."""
    return [line for line in path.read_text().split("\n")[:-1] if line.strip()]


def wait_for(check: Callable[[], T], timeout: float, what: str, interval: float = 0.5) -> T:
    """Call ``check`` until it returns a truthy value; fail with ``what`` and the last value/error after ``timeout``."""
    deadline = time.monotonic() + timeout
    last: object = None
    while True:
        try:
            value = check()
            if value:
                return value
            last = value
        except Exception as e:  # noqa: BLE001 - keep polling, report the last error
            last = e
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}; last: {last!r}")
        time.sleep(interval)


def events_until(api: Any, namespace: str, name: str, want: Callable[[list[Any]], bool], what: str,
                 timeout: float = 60) -> list[Any]:
    """The core/v1 Events about object ``name`` once ``want(events)`` holds. The operator posts Events off the
    reconcile's path (one thread, after the status write), so a test that has just seen a status change polls for
    the Event that goes with it instead of reading the list once."""
    from kubernetes import client

    core = client.CoreV1Api(api)

    def listed() -> list[Any] | None:
        evs = core.list_namespaced_event(namespace, field_selector=f"involvedObject.name={name}").items
        return evs if want(evs) else None

    try:
        return wait_for(listed, timeout, what)
    except AssertionError as e:
        evs = core.list_namespaced_event(namespace, field_selector=f"involvedObject.name={name}").items
        raise AssertionError(f"{e}\nevents: {[f'{x.reason}: {x.message}' for x in evs]}") from None


def touch_pod_scheduled(core: Any, namespace: str, pod: str, stamp: int) -> None:
    """Make the operator reconcile the job owning ``pod`` without writing anything it owns: rewrite the pod's
    PodScheduled condition with a new ``lastProbeTime`` (a field the reconcile's pod projection holds, so the
    event wakes the job; an annotation alone wakes nothing by design). ``stamp`` (0-59) makes each touch a change."""
    core.patch_namespaced_pod_status(pod, namespace, {"status": {"conditions": [
        {"type": "PodScheduled", "status": "True", "lastProbeTime": f"2026-01-01T00:00:{stamp:02d}Z"}]}})


def merge_patch(target: Any, patch: Any) -> Any:
    """A JSON merge patch (RFC 7386) applied to ``target`` (a new object): null deletes, objects merge."""
    if not isinstance(patch, dict):
        return patch
    out = dict(target) if isinstance(target, dict) else {}
    for k, v in patch.items():
        if v is None:
            out.pop(k, None)
        else:
            out[k] = merge_patch(out.get(k), v)
    return out


class JobAPI:
    """A local HTTP endpoint that answers, for one RLHFJob, what the apiserver answers the runtime's
    ServiceAccount: ``get`` of the job (metadata with ``generation``, the spec) and ``get``/merge-``patch`` of its
    status subresource. The test edits ``spec``/``generation`` to make a live edit; every PATCH body is kept."""

    def __init__(self, name: str, namespace: str, uid: str, spec: dict[str, Any]) -> None:
        self.name, self.namespace, self.uid = name, namespace, uid
        self.spec, self.generation = json.loads(json.dumps(spec)), 1
        self.patches: list[dict[str, Any]] = []
        self.status: dict[str, Any] = {}  # the patches merged (RFC 7386), as the apiserver keeps them
        self.requests: list[tuple[str, str, str, Any]] = []  # (method, path, content type, body), in order
        self.lock = threading.Lock()
        path = f"/apis/rlhf.dev/v1alpha1/namespaces/{namespace}/rlhfjobs/{name}"
        api = self

        class Handler(BaseHTTPRequestHandler):
            def _reply(self) -> None:
                if self.path not in (path, path + "/status"):
                    self.send_response(404)
                    self.end_headers()
                    return
                with api.lock:
                    obj = {"apiVersion": "rlhf.dev/v1alpha1", "kind": "RLHFJob",
                           "metadata": {"name": api.name, "namespace": api.namespace, "uid": api.uid,
                                        "generation": api.generation},
                           "spec": api.spec, "status": api.status}
                data = json.dumps(obj).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:
                with api.lock:
                    api.requests.append(("GET", self.path, "", None))
                self._reply()

            def do_PATCH(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with api.lock:
                    api.patches.append(body)
                    api.status = merge_patch(api.status, body.get("status") or {})
                    api.requests.append(("PATCH", self.path, self.headers["Content-Type"], body))
                self._reply()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def edit(self, **spec: Any) -> int:
        """A live edit (top-level spec keys; dicts merged one level): bumps ``metadata.generation``."""
        with self.lock:
            for key, value in spec.items():
                if isinstance(value, dict) and isinstance(self.spec.get(key), dict):
                    self.spec[key] = {**self.spec[key], **value}
                else:
                    self.spec[key] = value
            self.generation += 1
            return self.generation

    def runtime_reports(self) -> list[dict[str, Any]]:
        with self.lock:
            return [p["status"]["runtime"] for p in self.patches]

    def kubeconfig(self, path: Path) -> Path:
        path.write_text(json.dumps({
            "apiVersion": "v1", "kind": "Config", "current-context": "c",
            "clusters": [{"name": "c", "cluster": {"server": f"http://127.0.0.1:{self.server.server_port}"}}],
            "users": [{"name": "u", "user": {"token": "t"}}],
            "contexts": [{"name": "c", "context": {"cluster": "c", "user": "u"}}],
        }))
        return path

    def close(self) -> None:
        self.server.shutdown()


class MLflowServer:
    """A real MLflow tracking server (``mlflow server``, from ``hack/mlflow-server.sh``'s venv) on a free loopback
    port, with a SQLite store and proxied artifacts under ``root``. ``start`` returns at once; ``wait`` polls
    ``/health`` with a deadline (the first start migrates the database: ~15 s)."""

    def __init__(self, root: Path) -> None:
        import subprocess

        self.root = root
        root.mkdir(parents=True, exist_ok=True)
        binary = subprocess.run(["bash", str(REPO / "hack/mlflow-server.sh")], check=True, capture_output=True,
                                text=True, timeout=900).stdout.strip().splitlines()[-1]
        self.port = free_port()
        self.uri = f"http://127.0.0.1:{self.port}"
        self.log = root / "server.log"
        with self.log.open("w") as out:
            self.proc = subprocess.Popen(
                [binary, "server", "--host", "127.0.0.1", "--port", str(self.port), "--workers", "1",
                 "--backend-store-uri", f"sqlite:///{root}/mlflow.db", "--artifacts-destination", str(root / "art")],
                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)

    def wait(self, timeout: float = 120) -> str:
        import urllib.request

        def healthy() -> bool:
            if self.proc.poll() is not None:
                raise RuntimeError(f"mlflow server exited {self.proc.returncode}: {self.log.read_text()[-2000:]}")
            try:
                with urllib.request.urlopen(f"{self.uri}/health", timeout=2) as r:
                    return r.status == 200
            except OSError:
                return False

        wait_for(healthy, timeout=timeout, what="the MLflow server's /health", interval=0.5)
        return self.uri

    def close(self) -> None:
        import os
        import signal
        import subprocess

        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(self.proc.pid, sig)
                self.proc.wait(timeout=20)
                return
            except ProcessLookupError:
                return
            except subprocess.TimeoutExpired:
                continue
