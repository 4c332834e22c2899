"""The runtime's sandboxed builtin tools (``rlhf_runtime.agent.sandbox`` behind ``agent.tools.Tools``): each
"sandbox" is a real process of the sandbox image's server (images/sandbox/server.py) on loopback, driven by the real
``k8s-agent-sandbox`` client's ``Sandbox`` over a direct connection; only the claim API is a stand-in
(``Claims``: it starts a server per claim and stops it on release, as the controller binds and deletes a pod).

Checked: python and shell calls, a trajectory's files kept across its calls and not seen by another trajectory, a
call past its limit, oversized and binary output, a non-zero exit, bad arguments; a sandbox killed mid-call is a
``sandbox`` error for that call and the next call runs in a new one; a claim that fails is a ``sandbox`` error;
claims are released when the trajectory ends and stale ones deleted first; the claim's labels and owner."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from k8s_agent_sandbox.models import SandboxDirectConnectionConfig
from k8s_agent_sandbox.sandbox import Sandbox as ClientSandbox

from rlhf_api.environment import Environment
from rlhf_runtime.agent.calls import Call
from rlhf_runtime.agent.sandbox import SandboxPool, command_line
from rlhf_runtime.agent.tools import Tools
from tests.helpers import REPO, free_port, wait_for

SERVER = REPO / "images" / "sandbox" / "server.py"
SCHEMA = {"type": "object", "properties": {"code": {"type": "string"}, "command": {"type": "string"}}}


class Claims:
    """The claim API's stand-in: ``create_sandbox`` starts a server (a sandbox pod), ``delete_sandbox`` stops it."""

    def __init__(self, tmp: Path, stale: list[str] | None = None, fail: bool = False) -> None:
        self.tmp, self.fail = tmp, fail
        self.created: list[dict] = []
        self.deleted: list[str] = []
        self.procs: dict[str, subprocess.Popen] = {}
        self.stale = list(stale or [])
        self.k8s_helper = self
        self.custom_objects_api = self

    # the Kubernetes API calls the pool makes through the client's helper
    def create_namespaced_custom_object(self, group, version, ns, plural, body) -> dict:
        self.created.append(body)
        return body

    def list_namespaced_custom_object(self, group, version, ns, plural, label_selector=None) -> dict:
        self.listed = label_selector
        return {"items": [{"metadata": {"name": n}} for n in self.stale]}

    def delete_sandbox_claim(self, name: str, ns: str) -> None:
        self.deleted.append(name)

    # the client
    def create_sandbox(self, pool: str, ns: str, sandbox_ready_timeout: int, claim_name: str,
                       adopt_existing: bool) -> ClientSandbox:
        assert adopt_existing and claim_name == self.created[-1]["metadata"]["name"]
        if self.fail:
            raise TimeoutError(f"claim {claim_name} not ready within {sandbox_ready_timeout}s")
        scratch = self.tmp / claim_name
        scratch.mkdir()
        port = free_port()
        env = {"PATH": os.environ["PATH"], "SANDBOX_PORT": str(port), "SANDBOX_BASE_DIR": str(scratch),
               "SANDBOX_OUTPUT_LIMIT_BYTES": "4097"}
        self.procs[claim_name] = subprocess.Popen([sys.executable, "-I", str(SERVER)], env=env,
                                                  stderr=subprocess.DEVNULL)
        url = f"http://127.0.0.1:{port}"
        wait_for(lambda: urllib.request.urlopen(url + "/", timeout=2).status == 200, 30, "the sandbox server")
        return ClientSandbox(claim_name, claim_name, ns, SandboxDirectConnectionConfig(api_url=url),
                             k8s_helper=self)

    def delete_sandbox(self, name: str, ns: str) -> None:
        self.deleted.append(name)
        self.kill(name)

    def kill(self, name: str) -> None:
        proc = self.procs.pop(name, None)
        if proc is not None:
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=10)

    def close(self) -> None:
        for name in list(self.procs):
            self.kill(name)


@pytest.fixture
def claims(tmp_path):
    c = Claims(tmp_path, stale=["toolrun-sb-old"])
    yield c
    c.close()


def tools_with(claims: Claims, **sandbox: Any) -> Tools:
    env = Environment.model_validate({
        "tools": [{"name": "python", "builtin": "python", "parameters": SCHEMA},
                  {"name": "shell", "builtin": "shell", "parameters": SCHEMA}],
        "sandbox": {"image": "rlhf-sandbox:1", "timeoutSeconds": 2, "maxOutputBytes": 4096, **sandbox}})
    tools = Tools(env, ("toolrun", "team-a", "uid-1"))
    tools.sandboxes = SandboxPool(env.sandbox, "toolrun", "team-a", "uid-1", threads=8, client=claims)
    return tools


def run(coro):
    return asyncio.run(coro)


def test_command_lines() -> None:
    assert command_line("python", {"code": "print('a b')"}) == "python3 -c 'print('\"'\"'a b'\"'\"')'"
    assert command_line("shell", {"command": "ls | wc -l"}) == "sh -c 'ls | wc -l'"
    assert command_line("shell", {"command": 3}) is None


def test_calls_in_a_trajectorys_sandbox(claims) -> None:
    tools = tools_with(claims)

    async def trajectory() -> list:
        async with tools.session() as s:
            outs = [await tools.call(Call("python", {"code": "print(6 * 7)"})),
                    await tools.call(Call("shell", {"command": "echo kept > notes.txt && echo written"})),
                    await tools.call(Call("python", {"code": "print(open('notes.txt').read().strip())"})),
                    await tools.call(Call("shell", {"command": "exit 3"})),
                    await tools.call(Call("python", {"code": 42}))]
            return outs, s.claim_seconds

    outs, claimed = run(trajectory())
    assert [(o.text.strip(), o.error) for o in outs[:3]] == [("42", None), ("written", None), ("kept", None)]
    assert outs[3].error == "exception" and "(exit code 3)" in outs[3].text
    assert outs[4].error == "bad_arguments"
    # one claim for the whole trajectory, released at its end; the earlier run's claim deleted first
    assert len(claims.created) == 1 and len(claimed) == 1 and claimed[0] > 0
    assert claims.deleted == ["toolrun-sb-old", claims.created[0]["metadata"]["name"]]
    assert claims.listed == "rlhf.dev/job=toolrun"
    meta = claims.created[0]["metadata"]
    assert meta["labels"]["rlhf.dev/job"] == "toolrun" and meta["namespace"] == "team-a"
    assert meta["ownerReferences"] == [{"apiVersion": "rlhf.dev/v1alpha1", "kind": "RLHFJob", "name": "toolrun",
                                        "uid": "uid-1"}]
    assert claims.created[0]["spec"] == {"warmPoolRef": {"name": "toolrun-sandbox"}}


def test_trajectories_do_not_share_a_sandbox(claims) -> None:
    tools = tools_with(claims)

    async def one(i: int) -> str:
        async with tools.session():
            await tools.call(Call("shell", {"command": f"echo {i} > mine.txt"}))
            return (await tools.call(Call("shell", {"command": "cat *.txt"}))).text.strip()

    async def both() -> list[str]:
        return list(await asyncio.gather(one(1), one(2)))

    assert run(both()) == ["1", "2"]
    assert len(claims.created) == 2 and not claims.procs  # both released


def test_limits_timeout_truncation_binary(claims) -> None:
    tools = tools_with(claims)

    async def calls() -> list:
        async with tools.session():
            return [await tools.call(Call("python", {"code": "import time; print('start', flush=True); "
                                                              "time.sleep(30)"})),
                    await tools.call(Call("python", {"code": "print('x' * 100000)"})),
                    await tools.call(Call("python", {"code": "import sys; sys.stdout.buffer.write(bytes(range(256)))"})),
                    await tools.call(Call("python", {"code": "print('still here')"}))]

    slow, big, binary, after = run(calls())
    assert slow.error == "timeout" and "took longer than 2 s" in slow.text and slow.seconds < 20
    assert big.error == "output_truncated" and big.text.startswith("x" * 4000)
    assert "[... output cut at 4096 bytes]" in big.text and len(big.text) < 4200
    assert binary.error is None and "\ufffd" in binary.text  # replacement characters, not a fault of the run
    assert (after.text.strip(), after.error) == ("still here", None)


def test_a_sandbox_killed_mid_call_is_an_error_then_replaced(claims) -> None:
    tools = tools_with(claims, timeoutSeconds=20)

    async def trajectory() -> tuple:
        async with tools.session() as s:
            first = await tools.call(Call("shell", {"command": "echo up"}))
            [name] = list(claims.procs)
            call = asyncio.ensure_future(tools.call(Call("python", {"code": "import time; time.sleep(15)"})))
            await asyncio.sleep(0.5)
            claims.kill(name)  # the sandbox pod is deleted under the call
            lost = await call
            again = await tools.call(Call("shell", {"command": "echo replaced"}))
            return first, lost, again, len(s.claim_seconds), name

    first, lost, again, n_claims, name = run(trajectory())
    assert first.text.strip() == "up"
    assert lost.error == "sandbox" and "the next call runs in a new sandbox" in lost.text
    assert (again.text.strip(), again.error) == ("replaced", None)
    assert n_claims == 2 and name in claims.deleted  # the lost sandbox's claim released, a second one made


def test_a_claim_that_fails_is_a_sandbox_error(tmp_path) -> None:
    claims = Claims(tmp_path, fail=True)
    tools = tools_with(claims)

    async def trajectory():
        async with tools.session():
            return await tools.call(Call("python", {"code": "print(1)"}))

    out = run(trajectory())
    assert out.error == "sandbox" and "no sandbox could be claimed" in out.text and "not ready" in out.text
    assert claims.deleted == [claims.created[0]["metadata"]["name"]]  # the claim that never became ready


def test_a_call_outside_a_session_gets_a_sandbox_of_its_own(claims) -> None:
    tools = tools_with(claims)
    out = run(tools.call(Call("python", {"code": "print('alone')"})))
    assert out.text.strip() == "alone" and len(claims.created) == 1 and not claims.procs


def test_without_a_sandbox_spec_no_session_state() -> None:
    env = Environment.model_validate({"tools": [{"name": "f", "function": "json:dumps", "parameters": SCHEMA}]})
    tools = Tools(env)
    assert tools.sandboxes is None

    async def trajectory():
        async with tools.session() as s:
            return s.claim_seconds

    assert run(trajectory()) == []
