"""The ``python`` tool's isolated runner: real subprocesses in real namespaces, no mocks.

Where this machine cannot create the namespaces, every test that needs them fails with check_isolation()'s reason
(they do not skip)."""

from __future__ import annotations

import asyncio
import contextlib
import resource
import socket
import sys
import time
from pathlib import Path

import pytest

from rlhf_runtime.agent.isolation import Limits, check_isolation, run_python

pytestmark = pytest.mark.usefixtures("isolated")


@pytest.fixture(scope="module")
def isolated() -> None:
    why = check_isolation()
    if why is not None:
        pytest.fail(f"namespaces cannot be created here: {why}")


def run(code: str, **kwargs):
    limits = kwargs.pop("limits", Limits(timeout_s=20))
    return asyncio.run(run_python(code, limits, **kwargs))


def test_prints_and_exits_zero():
    r = run("print('hello', 6 * 7)")
    assert (r.ok, r.error, r.exit_code, r.truncated) == (True, None, 0, False)
    assert r.output == "hello 42\n"


def test_exception_is_exit_1_with_its_traceback():
    r = run("def f():\n    raise ValueError('boom')\nprint('before')\nf()")
    assert (r.ok, r.error, r.exit_code) == (False, "exit:1", 1)
    assert r.output.startswith("before\n")
    assert "Traceback (most recent call last)" in r.output and "ValueError: boom" in r.output


def test_exit_codes_and_signals_are_reported():
    assert run("import sys; sys.exit(3)").error == "exit:3"
    r = run("import os, signal; os.kill(os.getpid(), signal.SIGSEGV)")
    assert (r.error, r.exit_code) == ("signal:SIGSEGV", -11)


def test_infinite_loop_times_out_within_a_bound():
    r = run("while True:\n    pass", limits=Limits(timeout_s=1.0))
    assert (r.ok, r.error) == (False, "timeout")
    assert r.seconds < 1.0 + 10.0


def test_timeout_kills_what_the_code_started_and_ignores_sigterm():
    code = ("import signal, subprocess, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
            "subprocess.Popen(['sleep', '300'])\nprint('started', flush=True)\ntime.sleep(300)")
    r = run(code, limits=Limits(timeout_s=1.0))
    # The sleeping grandchild holds stdout: the run returning means it is dead too.
    assert (r.error, r.output) == ("timeout", "started\n")
    assert r.seconds < 1.0 + 10.0


def test_background_processes_die_with_the_code():
    code = "import subprocess\nsubprocess.Popen(['sleep', '300'], start_new_session=True)\nprint('bye')"
    r = run(code, limits=Limits(timeout_s=60))
    assert (r.ok, r.output) == (True, "bye\n")
    assert r.seconds < 30


def test_memory_bomb_is_stopped_and_the_parent_is_unharmed():
    before = resource.getrlimit(resource.RLIMIT_AS)
    code = "chunks = []\nwhile True:\n    chunks.append(bytearray(16 * 1024 * 1024))"
    r = run(code, limits=Limits(timeout_s=30, memory_mb=256))
    assert (r.ok, r.error) == (False, "memory")
    assert "MemoryError" in r.output
    assert resource.getrlimit(resource.RLIMIT_AS) == before
    assert bytearray(300 * 1024 * 1024)  # the parent still allocates more than the child's limit
    assert run("print(1)").ok


def test_output_flood_is_cut_and_stopped():
    r = run("import sys\nwhile True:\n    sys.stdout.write('x' * 1000)",
            limits=Limits(timeout_s=60, max_output_bytes=4096))
    assert (r.ok, r.error, r.truncated) == (False, "output_truncated", True)
    assert r.output.startswith("x" * 4096) and "[output truncated" in r.output
    assert len(r.output.encode()) < 4096 + 100
    r = run("import sys\nprint('out', flush=True)\nsys.stderr.write('e' * 100000)",
            limits=Limits(timeout_s=60, max_output_bytes=1000))
    assert (r.error, r.truncated) == ("output_truncated", True)
    assert r.output.startswith("out\neee")


def test_invalid_utf8_becomes_replacement_characters_and_is_flagged():
    r = run("import sys\nsys.stdout.buffer.write(b'ok \\xff\\xfe\\xc3 end\\n')\nsys.stderr.buffer.write(b'\\x80\\n')")
    assert (r.ok, r.invalid_utf8) == (True, True)
    assert r.output == "ok \ufffd\ufffd\ufffd end\n\ufffd\n"
    assert run("import sys\nsys.stderr.buffer.write(b'\\xff')").invalid_utf8  # stderr's bytes too
    assert not run("print('caf\\u00e9 \\u2713')").invalid_utf8
    # a character the cap splits is the cut's, not the code's: flagged only as truncated
    cut = run("print('\\u00e9' * 100)", limits=Limits(timeout_s=20, max_output_bytes=51))
    assert (cut.error, cut.invalid_utf8) == ("output_truncated", False)
    assert cut.output.startswith("\u00e9" * 25 + "\ufffd\n[output truncated")


def test_no_network_not_even_the_hosts_loopback():
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    try:
        socket.create_connection(("127.0.0.1", port), timeout=5).close()  # the listener takes connections
        code = ("import socket\nprint(sorted(n for _, n in socket.if_nameindex()))\n"
                f"try:\n    socket.create_connection(('127.0.0.1', {port}), timeout=5)\n    print('connected')\n"
                "except OSError as e:\n    print('refused', type(e).__name__)")
        r = run(code)
    finally:
        listener.close()
    assert r.ok, r.output
    lines = r.output.splitlines()
    assert lines[0] == "['lo']"
    assert lines[1].startswith("refused")


def test_parent_environment_and_processes_are_invisible(monkeypatch):
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "fake-secret-for-the-test")
    code = ("import os\nprint(os.environ.get('AWS_SECRET_ACCESS_KEY'))\nprint(sorted(os.environ))\n"
            "print(sorted(p for p in os.listdir('/proc') if p.isdigit()))\n"
            "print(open('/proc/self/status').read().split('CapEff:')[1].split()[0])")
    r = run(code)
    assert r.ok, r.output
    secret, names, pids, caps = r.output.splitlines()
    assert secret == "None"
    assert names == "['HOME', 'LANG', 'PATH', 'TMPDIR']"
    assert pids in ("['1', '2']", "[]")  # its own PID namespace: its init and itself (or /proc hidden)
    assert int(caps, 16) == 0


def test_masked_paths_are_hidden_and_stay_hidden(tmp_path):
    secret_dir = tmp_path / "secrets"
    secret_dir.mkdir()
    (secret_dir / "token").write_text("credential")
    workdir = tmp_path / "work"  # not the temp dir, so that the test's own files stay visible outside the mask
    workdir.mkdir()
    code = (f"import ctypes, os\npath = {str(secret_dir / 'token')!r}\n"
            "print(open(path).read() if os.path.exists(path) else 'absent')\n"
            "libc = ctypes.CDLL(None, use_errno=True)\n"
            "print(libc.umount2(os.path.dirname(path).encode(), 2), libc.umount(os.path.dirname(path).encode()))\n"
            "print(open(path).read() if os.path.exists(path) else 'absent')")
    control = run(code, masks=(), workdir=str(workdir))
    assert control.ok and control.output.splitlines()[0] == "credential"
    r = run(code, masks=(str(secret_dir),), workdir=str(workdir))
    assert r.ok, r.output
    assert r.output.splitlines() == ["absent", "-1 -1", "absent"]


def test_home_is_masked_by_default(tmp_path, monkeypatch):
    home = tmp_path / "home"
    home.mkdir()
    (home / ".netrc").write_text("machine example password hunter2")
    monkeypatch.setenv("HOME", str(home))
    (tmp_path / "work").mkdir()
    r = run(f"import os\nprint(os.listdir({str(home)!r}))", workdir=str(tmp_path / "work"))
    assert (r.ok, r.output) == (True, "[]\n")


def test_writes_outside_the_workdir_fail_and_nothing_persists(tmp_path):
    outside = tmp_path / "outside.txt"
    (tmp_path / "work").mkdir()
    code = (f"import os\ntry:\n    open({str(outside)!r}, 'w').write('x')\n    print('written')\n"
            "except OSError as e:\n    print('refused', e.errno)\n"
            "open('inside.txt', 'w').write('scratch')\nprint(os.getcwd(), open('inside.txt').read())")
    r = run(code, workdir=str(tmp_path / "work"))
    assert r.ok, r.output
    assert r.output.splitlines() == ["refused 30", f"{tmp_path / 'work'} scratch"]  # 30: EROFS
    assert not outside.exists()
    assert not (tmp_path / "work" / "inside.txt").exists()


def test_the_default_workdir_is_a_fresh_tmpfs_over_the_temp_dir(tmp_path):
    (tmp_path / "host-file").write_text("x")
    r = run(f"import os, tempfile\nprint(os.path.exists({str(tmp_path)!r}), os.listdir(tempfile.gettempdir()))")
    assert (r.ok, r.output) == (True, "False ['main.py']\n")


def test_an_isolation_failure_does_not_run_the_code():
    r = run("print('RAN')", workdir="/nonexistent-dir-on-a-read-only-root/work")
    assert r.ok is False and r.error.startswith("isolation:") and r.exit_code is None
    assert "RAN" not in r.output


def test_a_missing_interpreter_is_a_result_not_an_exception():
    r = run("print(1)", python="/nonexistent/python3")
    assert r.ok is False and r.error.startswith("isolation:cannot start")


def test_twenty_concurrent_runs_finish():
    async def many():
        return await asyncio.gather(*(run_python(f"print({i} * {i})", Limits(timeout_s=60)) for i in range(20)))

    results = asyncio.run(many())
    assert [(r.ok, r.output) for r in results] == [(True, f"{i * i}\n") for i in range(20)]


def _processes_naming(text: str) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        with contextlib.suppress(OSError):
            if entry.name.isdigit() and text.encode() in (entry / "cmdline").read_bytes():
                found.append(int(entry.name))
    return found


def test_cancelling_a_run_kills_it(tmp_path):
    workdir = tmp_path / "cancelled-run"  # named in the command lines of the launcher and of the code
    workdir.mkdir()

    async def start_then_cancel() -> list[int]:
        task = asyncio.create_task(run_python("import time\nprint('up', flush=True)\ntime.sleep(300)",
                                              Limits(timeout_s=300), workdir=str(workdir)))
        deadline = time.monotonic() + 30
        while len(running := _processes_naming(str(workdir))) < 3 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return running

    assert len(asyncio.run(start_then_cancel())) == 3  # the launcher, the namespace's init, the code
    deadline = time.monotonic() + 10
    while _processes_naming(str(workdir)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _processes_naming(str(workdir)) == []


def test_limits_are_validated():
    with pytest.raises(ValueError):
        Limits(timeout_s=0)
    with pytest.raises(ValueError):
        Limits(memory_mb=1)
    assert Limits(timeout_s=2.5).cpu_seconds == 4
    assert Limits(cpu_s=7).cpu_seconds == 7


def test_importable_without_the_heavy_stack():
    import subprocess

    code = ("import sys, rlhf_runtime.agent.isolation\n"
            "print(sorted(m for m in ('torch', 'ray', 'vllm', 'numpy') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).resolve().parents[2] / "operator")
    assert out.stdout.strip() == "[]"
