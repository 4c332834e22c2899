"""The builtin ``python`` and ``shell`` tools in sandbox pods (``spec.environment.sandbox``, kubernetes-sigs/agent-sandbox).

Each trajectory has a ``Session`` (``tools.Tools.session``): at its first builtin call it claims one sandbox from
the job's warm pool (``<job>-sandbox``, made by the operator), runs every builtin call of the trajectory in it
(files it writes stay for its later calls), and releases the claim when the trajectory ends (the sandbox is deleted
and the pool starts a replacement). Claims go through the ``k8s-agent-sandbox`` client: the claim is created here,
labelled with the job and owned by the RLHFJob (so it is deleted with the job whatever happens to this process),
then the client attaches to it (``create_sandbox(claim_name=..., adopt_existing=True)``: it waits until the claim is
bound and ready), runs the calls over the sandbox server's HTTP API (``POST /execute``) at the pod's IP, and
deletes the claim on release. The first claim of a process first deletes the job's claims left by an earlier run
of the job (a restarted driver).

A call runs ``python3 -c CODE`` or ``sh -c COMMAND`` from the sandbox's scratch directory, killed with everything it
started past ``timeoutSeconds``; its output is stdout then stderr, cut at ``maxOutputBytes``. Faults are data:
``call`` returns ``(text, error kind)``, never raises: a claim that fails or times out, or a sandbox that dies or
stops answering mid-call, is a ``sandbox`` error for that call; a sandbox lost mid-call is dropped (its claim
released) and the trajectory's next call claims a new one. ``Session.claim_seconds`` holds how long each claim
took (the rollout's claim latency).

The client is synchronous: claims and calls run in a thread pool of ``environment.concurrency`` threads (at most
``MAX_THREADS``).
"""

from __future__ import annotations

import asyncio
import logging
import shlex
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from rlhf_api.base import API_VERSION, KIND
from rlhf_api.environment import SANDBOX_PORT, Sandbox, sandbox_name

log = logging.getLogger("rlhf_runtime")

GROUP, VERSION, CLAIMS = "extensions.agents.x-k8s.io", "v1beta1", "sandboxclaims"
LABEL_JOB = "rlhf.dev/job"
MAX_THREADS = 256
#: Seconds an HTTP call may take beyond the call's own limit before the sandbox counts as unresponsive.
HTTP_MARGIN_SECONDS = 30
#: What a call of each builtin runs: its argument's name and the command line around it.
COMMANDS = {"python": ("code", ("python3", "-c")), "shell": ("command", ("sh", "-c"))}


def command_line(builtin: str, args: dict[str, Any]) -> str | None:
    """The sandbox server's command (shell words) of a builtin call; None when its argument is not a string."""
    name, argv = COMMANDS[builtin]
    value = args.get(name)
    if not isinstance(value, str):
        return None
    return shlex.join([*argv, value])


def render_output(result: Any, spec: Sandbox) -> tuple[str, str | None]:
    """A finished call's text for the model and its error kind: stdout then stderr cut at ``maxOutputBytes``
    (``output_truncated``), a call killed at its limit (``timeout``), a non-zero exit (``exception``)."""
    out = (result.stdout or "") + (result.stderr or "")
    data = out.encode("utf-8", errors="replace")
    cut = len(data) > spec.max_output_bytes
    text = data[:spec.max_output_bytes].decode("utf-8", errors="ignore") if cut else out
    if cut:
        text += f"\n[... output cut at {spec.max_output_bytes} bytes]"
    if result.timed_out:
        return f"{text}\nerror: the call took longer than {spec.timeout_seconds:g} s and was killed", "timeout"
    if result.exit_code != 0:
        return f"{text}\n(exit code {result.exit_code})", "output_truncated" if cut else "exception"
    return text, "output_truncated" if cut else None


class SandboxPool:
    """The job's sandboxes as this runtime sees them (module docstring). ``client``: a ``SandboxClient`` (made on
    first use, in-cluster)."""

    def __init__(self, spec: Sandbox, job: str, namespace: str, uid: str | None, threads: int,
                 client: Any = None) -> None:
        self.spec, self.job, self.namespace, self.uid = spec, job, namespace, uid
        self.pool = sandbox_name(job)
        self.executor = ThreadPoolExecutor(max_workers=max(1, min(threads, MAX_THREADS)),
                                           thread_name_prefix="sandbox")
        self._client = client
        self._lock = threading.Lock()
        self._cleaned = False

    def client(self) -> Any:
        with self._lock:
            if self._client is None:
                from k8s_agent_sandbox import SandboxClient
                from k8s_agent_sandbox.models import SandboxInClusterConnectionConfig

                self._client = SandboxClient(
                    connection_config=SandboxInClusterConnectionConfig(server_port=SANDBOX_PORT), cleanup=False)
            return self._client

    def _api(self) -> Any:
        return self.client().k8s_helper.custom_objects_api

    def claim_body(self, name: str) -> dict[str, Any]:
        meta: dict[str, Any] = {"name": name, "namespace": self.namespace,
                                "labels": {LABEL_JOB: self.job, "app.kubernetes.io/managed-by": "rlhf-runtime"}}
        if self.uid:
            meta["ownerReferences"] = [{"apiVersion": API_VERSION, "kind": KIND, "name": self.job, "uid": self.uid}]
        return {"apiVersion": f"{GROUP}/{VERSION}", "kind": "SandboxClaim", "metadata": meta,
                "spec": {"warmPoolRef": {"name": self.pool}}}

    def clean_stale(self) -> None:
        """Delete the job's claims an earlier run left (once per process, before its first claim)."""
        with self._lock:
            if self._cleaned:
                return
            self._cleaned = True
        found = self._api().list_namespaced_custom_object(GROUP, VERSION, self.namespace, CLAIMS,
                                                          label_selector=f"{LABEL_JOB}={self.job}")
        for item in found.get("items") or []:
            name = item["metadata"]["name"]
            log.info("deleting sandbox claim %s left by an earlier run", name)
            self.client().k8s_helper.delete_sandbox_claim(name, self.namespace)

    def claim(self) -> Any:
        """Claim a sandbox from the job's pool and wait until it is ready (blocking); the client's handle."""
        self.clean_stale()
        name = f"{self.job}-sb-{uuid.uuid4().hex[:10]}"
        self._api().create_namespaced_custom_object(GROUP, VERSION, self.namespace, CLAIMS, self.claim_body(name))
        try:
            return self.client().create_sandbox(self.pool, self.namespace,
                                                sandbox_ready_timeout=max(1, round(self.spec.claim_timeout_seconds)),
                                                claim_name=name, adopt_existing=True)
        except BaseException:
            self.release_name(name)
            raise

    def run(self, sandbox: Any, command: str) -> Any:
        """One command in a claimed sandbox (blocking): the client's ``ExecutionResult``."""
        return sandbox.commands.run(command, timeout=round(self.spec.timeout_seconds) + HTTP_MARGIN_SECONDS,
                                    command_timeout=self.spec.timeout_seconds)

    def release(self, sandbox: Any) -> None:
        """Release a claim (its sandbox is deleted); best effort: the claim is owned by the job anyway."""
        self.release_name(sandbox.claim_name)

    def release_name(self, name: str | None) -> None:
        if not name:
            return
        try:
            self.client().delete_sandbox(name, self.namespace)
        except Exception:  # owned by the job: deleted with it at the latest
            log.exception("could not release sandbox claim %s", name)

    def close(self) -> None:
        self.executor.shutdown(wait=False, cancel_futures=True)


class Session:
    """One trajectory's sandbox: claimed at its first builtin call, released by ``close`` (module docstring)."""

    def __init__(self, pool: SandboxPool) -> None:
        self.pool = pool
        self.sandbox: Any = None
        self.claim_seconds: list[float] = []
        self.failures = 0
        self._claiming = asyncio.Lock()

    async def _in_thread(self, fn: Any, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self.pool.executor, fn, *args)

    async def _sandbox(self) -> Any:
        async with self._claiming:  # two calls of one turn share the trajectory's one sandbox
            if self.sandbox is None:
                t0 = time.perf_counter()
                self.sandbox = await self._in_thread(self.pool.claim)
                self.claim_seconds.append(time.perf_counter() - t0)
            return self.sandbox

    async def call(self, builtin: str, args: dict[str, Any]) -> tuple[str, str | None]:
        """Run one builtin call; ``(text, error kind or None)``, never an exception (module docstring)."""
        command = command_line(builtin, args)
        if command is None:
            return f"error: the {builtin} tool takes a string argument '{COMMANDS[builtin][0]}'", "bad_arguments"
        try:
            sandbox = await self._sandbox()
        except Exception as e:  # noqa: BLE001 - no sandbox for this call: the trajectory's data
            self.failures += 1
            return f"error: no sandbox could be claimed for this call ({type(e).__name__}: {e})"[:2000], "sandbox"
        try:
            result = await self._in_thread(self.pool.run, sandbox, command)
        except Exception as e:  # noqa: BLE001 - the sandbox died or stopped answering mid-call
            self.failures += 1
            if self.sandbox is sandbox:
                self.sandbox = None
                self.pool.executor.submit(self.pool.release, sandbox)
            return (f"error: the sandbox failed during the call ({type(e).__name__}: {e}); the next call runs in "
                    "a new sandbox")[:2000], "sandbox"
        return render_output(result, self.pool.spec)

    async def close(self) -> None:
        """Release the trajectory's sandbox, if it claimed one."""
        sandbox, self.sandbox = self.sandbox, None
        if sandbox is not None:
            await self._in_thread(self.pool.release, sandbox)
