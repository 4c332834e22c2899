"""Runtime faults on CPU with real Ray, real vLLM engines and the real gloo weight transfer: a starved peer
(SIGSTOP of a real actor process) must fail the run within its deadline with a message naming the call, a
stuck step must trip the progress watchdog after a live edit of the RLHFJob lowered its deadline, and dead
engines and a dead trainer (SIGKILL of their processes) are repaired in-run. (A live edit of the steps:
``tests/runtime/test_driver.py``, in the resumed run of a killed driver.)"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest

from rlhf_runtime.infra import checkpoint as ckpt
from tests.helpers import JobAPI, wait_for
from tests.runtime.conftest import Run, job_config, start_driver, start_reporting_driver, write_config

pytestmark = pytest.mark.runtime


def actors(run: Run) -> list[dict[str, Any]]:
    """The driver's ``actors`` records (which pid serves which actor), oldest first."""
    return [r["actors"] for r in run.records() if "actors" in r]


def wait_steps(run: Run, n: int, timeout: float, interval: float = 0.05) -> None:
    """Until the run has reported ``n`` steps; fails at once (with the log) when the driver exits first."""
    wait_for(lambda: run.proc.poll() is not None or len(run.steps()) >= n, timeout=timeout,
             what=f"{n} steps", interval=interval)
    assert run.proc.poll() is None, f"the driver exited before {n} steps:\n{run.tail()}"


def cpu_ticks(pid: int) -> int:
    """utime + stime of ``pid`` in clock ticks (/proc/<pid>/stat); fails naming the pid once it has exited."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except FileNotFoundError:
        raise AssertionError(f"process {pid} has exited (the run ended before the fault?)") from None
    return int(fields[11]) + int(fields[12])


def wait_alone(busy: int, idle: int, timeout: float, what: str, window: float = 0.2) -> None:
    """Until ``busy`` has burnt CPU through two windows of ``window`` s in a row in which ``idle`` burnt none. With an
    engine and a trainer: the engine alone is the rollout, the trainer alone its training; in a weight sync both
    work (the trainer sends, the engine takes the weights in). CPU ticks, not wall time: what the machine's load
    does to the phases' lengths does not matter."""
    deadline = time.monotonic() + timeout
    in_a_row = 0
    while in_a_row < 2:
        assert time.monotonic() < deadline, f"never saw {what} in {timeout} s"
        b, i = cpu_ticks(busy), cpu_ticks(idle)
        time.sleep(window)
        in_a_row = in_a_row + 1 if cpu_ticks(busy) - b >= 3 and cpu_ticks(idle) - i <= 1 else 0


def stop_while_generating(engine: int, trainer: int, timeout: float, hold: float = 3.0) -> None:
    """SIGSTOP ``engine`` in a rollout that waits for it: stopped once ``wait_alone`` sees the rollout, it stays
    stopped only if ``trainer`` then burns no CPU for ``hold`` s (the rollout cannot end without it). Where the
    trainer trains instead, the engine had already returned its share: it is continued, and the next rollout tried."""
    deadline = time.monotonic() + timeout
    while True:
        wait_alone(engine, trainer, max(1.0, deadline - time.monotonic()), f"engine {engine} generating alone")
        os.kill(engine, signal.SIGSTOP)
        before, until = cpu_ticks(trainer), time.monotonic() + hold
        while time.monotonic() < until:
            if cpu_ticks(trainer) - before >= 20:
                break
            time.sleep(0.05)
        else:
            return
        os.kill(engine, signal.SIGCONT)
        assert time.monotonic() < deadline, f"engine {engine} was never stopped inside a rollout in {timeout} s"


def signal_pid(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def test_stopped_engine_fails_the_weight_sync_within_its_timeout(tiny_model: Path, tmp_path: Path) -> None:
    # Long training steps (many epochs), short rollouts. The engine is stopped while the trainer trains (the
    # engine idle, its rollout done): the sync after that step then waits on an engine that never answers. (A stop
    # right after a step could land after the next sync, in the rollout, which waits for the progress deadline.)
    spec = job_config(tiny_model, algorithm={"steps": 200, "epochsPerStep": 8},
                      weightSync={"timeoutSeconds": 20}, progressDeadlineSeconds=600)
    cfg = write_config(tmp_path / "job.json", spec)
    run = start_driver(tmp_path, cfg)
    pid = None
    try:
        wait_steps(run, 2, timeout=240, interval=0.01)
        n = len(run.steps())
        wait_for(lambda: len(run.steps()) > n, timeout=120, what="the next step", interval=0.005)
        n, first = len(run.steps()), actors(run)[-1]
        pid, trainer = first["engines"][0], first["trainers"][0]
        wait_alone(trainer, pid, 120, "the trainer training alone")  # after the next sync and rollout
        os.kill(pid, signal.SIGSTOP)
        wait_for(lambda: len(run.steps()) > n or run.proc.poll() is not None, timeout=300,
                 what="the step in training to end", interval=0.005)
        synced = time.monotonic()  # the next sync starts
        code = run.proc.wait(timeout=20 + 90)
        failed_after = time.monotonic() - synced
    finally:
        if pid:
            signal_pid(pid, signal.SIGKILL)
        run.kill_group()
    assert code == 1, run.tail()
    last = run.records()[-1]["runtime"]
    assert last["state"] == "Failed", last
    assert "weight sync: trainer rank 0 -> engine 0 did not finish within weightSync.timeoutSeconds=20s" in \
        last["message"], last
    print(f"stopped engine: Failed after {failed_after:.1f}s: {last['message']}")
    assert failed_after < 20 + 45, failed_after  # the deadline plus reporting and a bounded Ray shutdown


def test_watchdog_fails_a_stuck_step_after_a_live_lowered_progress_deadline(tiny_model: Path, tmp_path: Path) -> None:
    spec = job_config(tiny_model, algorithm={"steps": 200, "epochsPerStep": 4})
    cfg = write_config(tmp_path / "job.json", spec)
    api = JobAPI("tiny", "default", "uid-1", served_spec(cfg))
    run = start_reporting_driver(tmp_path, cfg, api)
    pid = None
    try:
        wait_steps(run, 2, timeout=240, interval=0.05)
        gen = api.edit(progressDeadlineSeconds=12)  # a live edit: the driver adopts it at the next step
        wait_for(lambda: any(r.get("observedGeneration") == gen for r in api.runtime_reports()), timeout=60,
                 what="the runtime to apply the edit", interval=0.05)
        pid = actors(run)[-1]["trainers"][0]
        os.kill(pid, signal.SIGSTOP)  # the trainer hangs: no step completes any more
        stopped = time.monotonic()
        wait_for(lambda: any(r.get("state") == "Failed" for r in api.runtime_reports()), timeout=12 + 90,
                 what="the runtime to report Failed", interval=0.1)
        failed_after = time.monotonic() - stopped  # when the failure reached the job's status
        code = run.proc.wait(timeout=90)  # then the driver exits (watchdog grace and Ray shutdown bound it)
    finally:
        if pid:
            signal_pid(pid, signal.SIGKILL)
        run.kill_group()
        api.close()
    assert code == 1, run.tail()
    reports = api.runtime_reports()
    failed = [r for r in reports if r.get("state") == "Failed"]
    assert failed, reports[-3:]
    msg = failed[0]["message"]
    assert msg.startswith("no training step completed within spec.progressDeadlineSeconds (12 s); stuck in: "), msg
    assert failed[0]["observedGeneration"] == gen and failed[0]["progressTime"], failed[0]
    print(f"stopped trainer: Failed after {failed_after:.1f}s: {msg}")
    # counted from the last completed step (at most a step before the stop), plus reporting
    assert failed_after < 12 + 45, failed_after


def served_spec(cfg: Path) -> dict[str, Any]:
    """The spec of a job.json as the apiserver would serve it."""
    return json.loads(cfg.read_text())["spec"]


def test_dead_engines_and_trainer_are_repaired_in_the_run_and_the_job_succeeds(tiny_model: Path,
                                                                                tmp_path: Path) -> None:
    """Three faults in one run, one after the other, each repaired in place (``inRunRecoveries`` 3):

    1. engine 1 killed while it generates: replaced on its bundle, only its part of the rollout runs again;
    2. engine 0 killed while the trainer trains: the next weight sync finds it dead; it is replaced, and so is
       engine 1, stuck in that sync's collective; the step runs again from its sync (no rollout lost);
    3. the trainer killed: every rank restarts from the newest checkpoint and the step counter continues from it.

    The job asks for more steps than the faults can take; once the third repair has run a step, a live edit of
    ``algorithm.steps`` ends the run a few steps later (the first kill may need many rollouts to land in).
    """
    ckpt_dir = tmp_path / "ckpt"
    # Two engines, long samples: a rollout (0.5-1.5 s) takes far longer than a sync, so the first kill lands while
    # generating; training on them takes a while too, so the second lands while the trainer trains.
    spec = job_config(
        tiny_model, algorithm={"steps": 500, "promptsPerStep": 8}, rollout={
            "engines": 2, "maxModelLen": 200,
            "sampling": {"temperature": 1.0, "maxTokens": 150, "samplesPerPrompt": 8}},
        checkpoint={"volume": "ckpt", "path": str(ckpt_dir), "everyNSteps": 2},
        volumes=[{"name": "ckpt", "emptyDir": {}}],
    )
    cfg = write_config(tmp_path / "job.json", spec)
    api = JobAPI("tiny", "default", "uid-1", served_spec(cfg))
    run = start_reporting_driver(tmp_path, cfg, api)

    def recoveries() -> list[dict[str, Any]]:
        return [r["recovery"] for r in run.records() if "recovery" in r]

    try:
        # 1. engine 1, mid-rollout: stopped while generating, the trainer waiting on the rollout; then killed
        wait_steps(run, 2, timeout=300, interval=0.05)
        first_pids = actors(run)[-1]
        victim1 = first_pids["engines"][1]
        stop_while_generating(victim1, first_pids["trainers"][0], timeout=180)
        os.kill(victim1, signal.SIGKILL)
        wait_for(lambda: len(recoveries()) >= 1, timeout=180, what="the first recovery", interval=0.05)

        # 2. engine 0, while the trainer trains: a step ended, the next one's rollout ran, its training burns CPU
        n = len(run.steps())
        wait_for(lambda: len(run.steps()) > n, timeout=120, what="a step after the first recovery", interval=0.005)
        trainer, victim0 = first_pids["trainers"][0], first_pids["engines"][0]  # untouched by the first repair
        before = cpu_ticks(trainer)
        wait_for(lambda: cpu_ticks(trainer) - before >= 20, timeout=120, what="the trainer training", interval=0.01)
        os.kill(victim0, signal.SIGKILL)
        wait_for(lambda: len(recoveries()) >= 2, timeout=180, what="the second recovery", interval=0.05)

        # 3. the trainer, in the step after its first checkpoint since the repairs; the dead trainer writes no more
        at = run.steps()[-1]["step"]
        saved = wait_for(lambda: (ckpt.latest(ckpt_dir) or (0,))[0] > at and ckpt.latest(ckpt_dir)[0], timeout=120,
                         what="a checkpoint after the repairs", interval=0.02)
        wait_for(lambda: run.proc.poll() is not None or run.steps()[-1]["step"] >= saved, timeout=120,
                 what=f"step {saved} reported", interval=0.01)
        victim_t = actors(run)[-1]["trainers"][0]
        os.kill(victim_t, signal.SIGKILL)
        newest = ckpt.latest(ckpt_dir)
        assert newest is not None
        wait_for(lambda: len(recoveries()) >= 3, timeout=180, what="the third recovery", interval=0.05)
        wait_steps(run, len(run.steps()) + 1, timeout=120)
        steps = run.steps()[-1]["step"] + 4  # adopted at the driver's next step boundary
        api.edit(algorithm={"steps": steps})
        assert run.wait(timeout=300) == 0, run.tail()
    finally:
        run.kill_group()
        api.close()
    records = run.records()
    recs = [r["recovery"] for r in records if "recovery" in r]
    assert len(recs) == 3, recs
    engine1, engine0, trainer_rec = recs
    # 1: the dead engine's part of the rollout ran again; the other engine kept its process
    assert engine1["engines"] == [1] and not engine1["trainers"], engine1
    assert engine1["where"].startswith("rollout of step "), engine1
    assert "recovered: engine 1 died during rollout of step" in next(
        r["runtime"]["message"] for r in records if "recovery" in r)
    at_1 = next(k for k, r in enumerate(records) if "recovery" in r)
    after_first = next(r["actors"] for r in records[at_1:] if "actors" in r)
    assert after_first["engines"][1] != victim1 and after_first["engines"][0] == victim0, (after_first, first_pids)
    # 2: found dead by the next weight sync; engine 1, left waiting inside that sync's collective for data the
    # trainer no longer sends, is replaced with it (it would never take the new group's setup)
    assert engine0["engines"] == [0] and engine0["stuck"] == [1] and not engine0["trainers"], engine0
    assert engine0["where"].startswith("weight sync: trainer rank 0 -> "), engine0
    # 3: every rank restarted from the newest checkpoint
    assert trainer_rec["trainers"] and trainer_rec["resumed_from"] == newest[0], (trainer_rec, newest)
    last = records[-1]
    assert last["runtime"]["state"] == "Succeeded", last
    assert last["runtime"]["resumedFromStep"] == newest[0]
    assert last["replacements"] == {"engines": 3, "trainers": 1}
    # only engine 1's part of one rollout ran again; the sync-time repair and the trainer's restart lost none
    rerun = [r["rerun_prompts"] for r in run.steps()]
    assert rerun[0] == 0 and 0 < last["rerun_prompts"] <= 8 and set(rerun) == {0, last["rerun_prompts"]}, rerun
    restart = [r["runtime"] for r in records
               if r.get("runtime", {}).get("state") == "Starting" and "recovery" in r["runtime"].get("message", "")]
    assert restart and restart[0]["resumedFromStep"] == newest[0], restart  # shown as Resuming by the operator
    assert restart[0]["message"].startswith(f"resumed from checkpoint step {newest[0]} after trainer rank 0 died")
    # the steps: contiguous from 1 up to the trainer's death, then from the checkpoint on to the end
    at_t = [k for k, r in enumerate(records) if "recovery" in r][2]
    before_t = [r["step"] for r in records[:at_t] if "throughput" in r and r["runtime"]["state"] == "Running"]
    after_t = [r["step"] for r in records[at_t + 1:] if "throughput" in r and r["runtime"]["state"] == "Running"]
    assert before_t == list(range(1, len(before_t) + 1)) and before_t[-1] >= newest[0], before_t
    assert after_t == list(range(newest[0] + 1, steps + 1)), after_t  # the counter continues from the checkpoint
    assert actors(run)[-1]["trainers"][0] != victim_t
    secs = ", ".join(f"{r['seconds']:.1f}s" for r in recs)
    print(f"repairs: engine 1 mid-rollout, engine 0 (and stuck engine 1) at a sync, the trainer from step "
          f"{newest[0]}: recovered in {secs}")
