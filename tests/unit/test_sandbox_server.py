"""The sandbox image's server (images/sandbox/server.py), run as a process on loopback and driven by the real
``k8s-agent-sandbox`` client (its command executor and filesystem over a direct connection) and by plain HTTP for
what the client does not show (the truncation flags, refused paths, bad requests)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from k8s_agent_sandbox.commands.command_executor import CommandExecutor
from k8s_agent_sandbox.connector import SandboxConnector
from k8s_agent_sandbox.files.filesystem import Filesystem
from k8s_agent_sandbox.models import SandboxDirectConnectionConfig

from tests.helpers import REPO, free_port, wait_for

SERVER = REPO / "images" / "sandbox" / "server.py"
LIMIT = 1000


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> tuple[str, Path]:
    scratch = tmp_path_factory.mktemp("scratch")
    port = free_port()
    env = {"PATH": os.environ["PATH"], "SANDBOX_PORT": str(port), "SANDBOX_BASE_DIR": str(scratch),
           "SANDBOX_OUTPUT_LIMIT_BYTES": str(LIMIT), "SANDBOX_EXEC_TIMEOUT_SECONDS": "20"}
    log = (scratch.parent / "server.log").open("wb")
    proc = subprocess.Popen([sys.executable, "-I", str(SERVER)], env=env, stderr=log)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: urllib.request.urlopen(url + "/", timeout=2).status == 200, 30, "the sandbox server")
        yield url, scratch
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        log.close()


@pytest.fixture(scope="module")
def connector(server) -> SandboxConnector:
    return SandboxConnector("sandbox", "ns", SandboxDirectConnectionConfig(api_url=server[0]), k8s_helper=None)


def post(url: str, body: bytes) -> tuple[int, dict]:
    req = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_python_and_shell_commands_run_in_the_scratch_directory(server, connector) -> None:
    run = CommandExecutor(connector, None, "test").run
    r = run("python3 -c 'import os; print(sum(range(10)), os.getcwd())'")
    assert (r.stdout, r.stderr, r.exit_code, r.timed_out) == (f"45 {server[1]}\n", "", 0, False)
    r = run("sh -c 'echo out; echo err >&2; exit 3'")
    assert (r.stdout, r.stderr, r.exit_code) == ("out\n", "err\n", 3)
    r = run("no-such-program --flag")
    assert r.exit_code == 127 and "No such file" in r.stderr
    assert run("sh -c 'kill -9 $$'").exit_code == 128 + 9


def test_a_command_past_its_time_limit_is_killed_with_its_process_group(connector) -> None:
    run = CommandExecutor(connector, None, "test").run
    r = run("sh -c 'sleep 300 & echo $!; sleep 300'", command_timeout=1)
    assert r.timed_out and r.exit_code == 124
    child = int(r.stdout.split()[0])
    # the background child of the shell went with it (a zombie of init at most, never left running)
    state = Path(f"/proc/{child}/stat")
    assert not state.exists() or state.read_text().split(") ", 1)[1].startswith("Z")


def test_huge_and_binary_output_is_truncated_and_decoded(server) -> None:
    code = "import sys; sys.stdout.buffer.write(bytes(range(256)) * 400); sys.stderr.write('e' * 10)"
    status, r = post(server[0] + "/execute", json.dumps({"command": f"python3 -c {json.dumps(code)}"}).encode())
    assert status == 200 and r["exit_code"] == 0
    assert r["stdout_truncated"] and not r["stderr_truncated"] and r["stderr"] == "e" * 10
    assert r["stdout"].startswith("\x00\x01\x02") and "\ufffd" in r["stdout"]
    assert LIMIT // 2 < len(r["stdout"]) <= LIMIT  # the first LIMIT bytes, one character at most for each


def test_bad_requests_are_refused(server) -> None:
    assert post(server[0] + "/execute", b"not json")[0] == 400
    assert post(server[0] + "/execute", json.dumps({"command": ["ls"]}).encode())[0] == 400
    assert post(server[0] + "/execute", json.dumps({"cmd": "ls"}).encode())[0] == 400
    status, r = post(server[0] + "/execute", json.dumps({"command": "echo 'unbalanced"}).encode())
    assert status == 200 and r["exit_code"] == 2 and "quotation" in r["stderr"]


def test_files_round_trip_and_stay_inside_the_scratch_directory(server, connector) -> None:
    fs = Filesystem(connector, None, "test")
    fs.write("work/data.bin", b"\x00\xffhello")
    assert fs.read("work/data.bin") == b"\x00\xffhello"
    assert (server[1] / "work" / "data.bin").read_bytes() == b"\x00\xffhello"
    assert [(e.name, e.size, e.type) for e in fs.list("work")] == [("data.bin", 7, "file")]
    assert fs.exists("work/data.bin") and not fs.exists("work/other")
    for path in ("..%2F..%2Fetc%2Fpasswd", "%2Fetc%2F..%2F..%2Fetc%2Fpasswd"):
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(f"{server[0]}/download/{path}", timeout=10)
        assert e.value.code == 403
