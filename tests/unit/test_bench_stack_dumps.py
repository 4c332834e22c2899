"""The GPU benchmark's view into a hang (``benchmarks/stack_dumps.py``): before it kills a run past its limit it asks
the run and the benchmark actors for their threads' stacks. Checked on real processes: one titled as Ray titles a
benchmark actor that registered the dump (``bench_actors.enable_stack_dumps``), waiting in a named function, and
one with another title, which the signal would end and which must not get it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import bench_actors
import stack_dumps

from tests.helpers import wait_for

PROC = """
import sys, time, setproctitle
sys.path.insert(0, {bench!r})
setproctitle.setproctitle({title!r})
if {register!r}:
    import bench_actors
    bench_actors.enable_stack_dumps()
def waiting_in_the_broadcast():
    print("ready", flush=True)
    time.sleep(120)
waiting_in_the_broadcast()
"""


def _start(title: str, register: bool) -> subprocess.Popen:
    code = PROC.format(bench=str(Path(stack_dumps.__file__).parent), title=title, register=register)
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert p.stdout is not None and p.stderr is not None
    assert p.stdout.readline().strip() == b"ready", p.stderr.read()
    os.set_blocking(p.stderr.fileno(), False)
    return p


def _stderr_until(p: subprocess.Popen, text: str, got: dict[int, bytes]) -> str:
    """The process's stderr so far, once it holds ``text``, polled (the process keeps running)."""
    def has() -> bool:
        got[p.pid] = got.get(p.pid, b"") + (p.stderr.read() or b"")  # type: ignore[union-attr]
        return text.encode() in got[p.pid]
    wait_for(has, 30, f"{text!r} on the stderr of {p.pid}", interval=0.2)
    return got[p.pid].decode(errors="replace")


def test_the_parent_asks_the_same_signal_of_the_same_titles_the_actors_register() -> None:
    assert stack_dumps.STACK_SIGNAL == bench_actors.STACK_SIGNAL
    assert stack_dumps.ACTOR_TITLE == bench_actors.ACTOR_TITLE
    assert {c.__name__ for c in bench_actors.BENCH_CLASSES.values()} | {"BenchTrainer"} == {
        c.__name__ for c in bench_actors._StackDumps.__subclasses__()}


def test_a_hung_actor_prints_its_stack_and_lives_on_others_are_left_alone() -> None:
    actor = _start(f"{bench_actors.ACTOR_TITLE}Engine.update_weights_round", register=True)
    other = _start("ray::IDLE", register=False)
    run = _start("gpu_sync --one", register=True)
    try:
        asked = stack_dumps.stack_dump(run.pid)
        assert run.pid in asked and actor.pid in asked and other.pid not in asked, asked
        got: dict[int, bytes] = {}
        for p in (actor, run):
            err = _stderr_until(p, "waiting_in_the_broadcast", got)
            assert "Current thread" in err or "Thread 0x" in err, err
        for p in (actor, run, other):
            assert p.poll() is None, f"the signal ended process {p.pid}"
    finally:
        for p in (actor, other, run):
            p.kill()
            p.wait()


def test_the_actors_stacks_are_read_back_from_their_ray_worker_logs(tmp_path: Path, monkeypatch) -> None:
    """Ray writes an actor's stderr to ``worker-<id>-<pid>.err``: that is where its stacks land, and what the
    parent appends to the run's log (after polling until every actor asked has written them)."""
    monkeypatch.setattr(stack_dumps, "RAY_LOGS", tmp_path)
    code = PROC.format(bench=str(Path(stack_dumps.__file__).parent), title=f"{bench_actors.ACTOR_TITLE}Trainer.sync",
                       register=True)
    err = tmp_path / "stderr"
    with open(err, "wb") as f:
        p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=f)
    try:
        assert p.stdout is not None and p.stdout.readline().strip() == b"ready"
        os.link(err, tmp_path / f"worker-0123abcd-{p.pid}.err")  # as Ray names it
        polls: dict[str, str] = {}
        assert stack_dumps.actor_stacks([p.pid], polls) == ""  # nothing written yet: keep polling
        assert p.pid in stack_dumps.stack_dump(p.pid)  # the pid asked first is signalled like the run
        # a dump is written in pieces: the poll answers once it reads the same twice (first sights were cut off
        # mid-line in 3 of 6 runs before)
        text = wait_for(lambda: stack_dumps.actor_stacks([p.pid], polls), 30, "the actor's stacks", interval=0.2)
        assert f"=== stacks of actor pid {p.pid}" in text and "waiting_in_the_broadcast" in text, text
        assert "(none written)" in stack_dumps.actor_stacks([p.pid, 999999999])  # one that wrote none, at the end
    finally:
        p.kill()
        p.wait()


def test_a_run_past_its_limit_leaves_its_stack_in_the_log_and_is_killed(tmp_path: Path, monkeypatch) -> None:
    """``watch``: the run's marked lines are echoed as they come; at the limit its stacks (it registered the dump,
    as ``gpu_sync.child`` does) go to the log before its process group is killed; a run that ends in time gives
    its exit code."""
    monkeypatch.setattr(stack_dumps, "RAY_LOGS", tmp_path)  # no actors: none of Ray's logs are read
    code = PROC.format(bench=str(Path(stack_dumps.__file__).parent), title="gpu_sync --one", register=True)
    log = tmp_path / "run.log"
    assert stack_dumps.watch([sys.executable, "-c", code], log, 15.0, lambda line: line == "ready") is None
    text = log.read_text()
    assert "ready" in text and "waiting_in_the_broadcast" in text, text
    assert stack_dumps.watch([sys.executable, "-c", "raise SystemExit(3)"], log, 30.0, lambda line: False) == 3
