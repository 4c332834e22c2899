"""Runtime faults on CPU with real Ray, real vLLM engines and the real gloo weight transfer: a starved peer
(SIGSTOP of a real actor process) must fail the run within its deadline with a message naming the call, a
stuck step must trip the progress watchdog, a dead engine or trainer (SIGKILL of its process) is repaired
in-run, and live edits of the RLHFJob (steps, progress deadline) reach the running driver."""

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
    """utime + stime of ``pid`` in clock ticks (/proc/<pid>/stat)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])


def the_recovery(run: Run) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The run's progress records and its one in-run recovery (exactly one must have happened)."""
    records = run.records()
    recoveries = [r["recovery"] for r in records if "recovery" in r]
    assert len(recoveries) == 1, recoveries
    return records, recoveries[0]


def signal_pid(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def test_stopped_engine_fails_the_weight_sync_within_its_timeout(tiny_model: Path, tmp_path: Path) -> None:
    # Long training steps (many epochs), short rollouts: the stop lands right after a step, in or before the
    # next sync, which then waits on an engine that never answers.
    spec = job_config(tiny_model, algorithm={"steps": 200, "epochsPerStep": 8},
                      weightSync={"timeoutSeconds": 20}, progressDeadlineSeconds=600)
    cfg = write_config(tmp_path / "job.json", spec)
    run = start_driver(tmp_path, cfg)
    pid = None
    try:
        wait_steps(run, 2, timeout=240, interval=0.01)
        n = len(run.steps())
        wait_for(lambda: len(run.steps()) > n, timeout=60, what="the next step", interval=0.005)
        pid = actors(run)[-1]["engines"][0]
        os.kill(pid, signal.SIGSTOP)
        stopped = time.monotonic()
        code = run.proc.wait(timeout=20 + 90)
        failed_after = time.monotonic() - stopped
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


def test_live_edit_of_steps_ends_the_run_at_the_new_total_and_unknown_fields_are_ignored(
    tiny_model: Path, tmp_path: Path
) -> None:
    spec = job_config(tiny_model, algorithm={"steps": 500})
    cfg = write_config(tmp_path / "job.json", spec)
    raw = json.loads(cfg.read_text())
    raw["spec"]["rollout"]["fieldOfANewerOperator"] = {"x": 1}  # a newer operator wrote a key we do not know
    raw["someNewTopLevelField"] = True
    cfg.write_text(json.dumps(raw))
    api = JobAPI("tiny", "default", "uid-1", raw["spec"])
    run = start_reporting_driver(tmp_path, cfg, api)
    try:
        wait_steps(run, 2, timeout=240, interval=0.05)
        gen = api.edit(algorithm={"steps": 6})
        assert run.wait(timeout=240) == 0, run.tail()
    finally:
        run.kill_group()
        api.close()
    steps = [r["step"] for r in run.steps()]
    assert steps[-1] == 6 and steps == list(range(1, 7)), steps
    reports = api.runtime_reports()
    assert reports[-1]["state"] == "Succeeded" and reports[-1]["observedGeneration"] == gen, reports[-1]
    assert reports[-1]["message"] == "completed 6 steps"
    running = [r for r in reports if r.get("state") == "Running" and "progressTime" in r]
    assert running and all(r["progressTime"] for r in running)
    assert "ignoring fields this runtime does not know" in run.log.read_text(errors="replace")
    assert "rollout.fieldOfANewerOperator" in run.log.read_text(errors="replace")


def test_engine_killed_mid_rollout_is_replaced_and_the_job_succeeds(tiny_model: Path, tmp_path: Path) -> None:
    # Two engines, long samples: a rollout takes far longer than a sync, so the kill lands while generating.
    spec = job_config(
        tiny_model, algorithm={"steps": 6, "promptsPerStep": 8}, rollout={
            "engines": 2, "maxModelLen": 200,
            "sampling": {"temperature": 1.0, "maxTokens": 150, "samplesPerPrompt": 8}},
    )
    cfg = write_config(tmp_path / "job.json", spec)
    run = start_driver(tmp_path, cfg)
    try:
        wait_steps(run, 2, timeout=300, interval=0.05)
        victim = actors(run)[-1]["engines"][1]
        before = cpu_ticks(victim)
        # the engine is generating: it has burnt CPU since the last step ended
        wait_for(lambda: cpu_ticks(victim) - before >= 20, timeout=60, what="engine 1 generating", interval=0.01)
        os.kill(victim, signal.SIGKILL)
        killed = time.monotonic()
        assert run.wait(timeout=300) == 0, run.tail()
        finished_after = time.monotonic() - killed
    finally:
        run.kill_group()
    records, rec = the_recovery(run)
    assert rec["engines"] == [1] and not rec["trainers"], rec
    assert rec["where"].startswith("rollout of step "), rec
    assert "recovered: engine 1 died during rollout of step" in next(
        r["runtime"]["message"] for r in records if "recovery" in r)
    last = records[-1]
    assert last["runtime"]["state"] == "Succeeded", last
    assert last["replacements"] == {"engines": 1, "trainers": 0}
    assert 0 < last["rerun_prompts"] <= 8  # only the dead engine's part of the rollout ran again
    assert [r["step"] for r in run.steps()] == list(range(1, 7))
    pids = actors(run)
    assert pids[-1]["engines"][1] != victim and pids[-1]["engines"][0] == pids[0]["engines"][0]
    print(f"engine kill: recovered in {rec['seconds']:.1f}s, Succeeded {finished_after:.1f}s after the kill")


def test_trainer_killed_restarts_from_the_newest_checkpoint(tiny_model: Path, tmp_path: Path) -> None:
    ckpt_dir = tmp_path / "ckpt"
    spec = job_config(
        tiny_model, algorithm={"steps": 10},
        checkpoint={"volume": "ckpt", "path": str(ckpt_dir), "everyNSteps": 2},
        volumes=[{"name": "ckpt", "emptyDir": {}}],
    )
    cfg = write_config(tmp_path / "job.json", spec)
    run = start_driver(tmp_path, cfg)
    try:
        wait_steps(run, 3, timeout=240, interval=0.02)
        victim = actors(run)[-1]["trainers"][0]
        os.kill(victim, signal.SIGKILL)
        killed = time.monotonic()
        newest = ckpt.latest(ckpt_dir)  # the dead trainer writes no more
        assert newest is not None
        assert run.wait(timeout=300) == 0, run.tail()
        finished_after = time.monotonic() - killed
    finally:
        run.kill_group()
    records, rec = the_recovery(run)
    assert rec["trainers"] and rec["resumed_from"] == newest[0], (rec, newest)
    assert records[-1]["runtime"]["state"] == "Succeeded"
    assert records[-1]["runtime"]["resumedFromStep"] == newest[0]
    assert records[-1]["replacements"] == {"engines": 0, "trainers": 1}
    restart = [r["runtime"] for r in records
               if r.get("runtime", {}).get("state") == "Starting" and "recovery" in r["runtime"].get("message", "")]
    assert restart and restart[0]["resumedFromStep"] == newest[0], restart  # shown as Resuming by the operator
    assert restart[0]["message"].startswith(f"resumed from checkpoint step {newest[0]} after trainer rank 0 died")
    at = next(k for k, r in enumerate(records) if "recovery" in r)
    after = [r["step"] for r in records[at + 1:] if "throughput" in r and r["runtime"]["state"] == "Running"]
    assert after == list(range(newest[0] + 1, 11)), after  # the counter continues from the checkpoint
    steps = [r["step"] for r in run.steps()]
    assert actors(run)[-1]["trainers"][0] != victim
    print(f"trainer kill: resumed from step {newest[0]} in {rec['seconds']:.1f}s, Succeeded "
          f"{finished_after:.1f}s after the kill; steps {steps}")


def test_engine_killed_while_the_trainer_trains_is_replaced_at_the_next_sync(tiny_model: Path, tmp_path: Path) -> None:
    # Long training steps: the kill lands while the trainer trains; the next weight sync finds the engine dead.
    spec = job_config(tiny_model, algorithm={"steps": 5, "epochsPerStep": 16})
    cfg = write_config(tmp_path / "job.json", spec)
    run = start_driver(tmp_path, cfg)
    try:
        wait_steps(run, 2, timeout=240, interval=0.01)
        n = len(run.steps())
        wait_for(lambda: len(run.steps()) > n, timeout=60, what="the next step", interval=0.005)
        trainer, victim = actors(run)[-1]["trainers"][0], actors(run)[-1]["engines"][0]
        before = cpu_ticks(trainer)
        wait_for(lambda: cpu_ticks(trainer) - before >= 20, timeout=60, what="the trainer training", interval=0.01)
        os.kill(victim, signal.SIGKILL)
        killed = time.monotonic()
        assert run.wait(timeout=300) == 0, run.tail()
        finished_after = time.monotonic() - killed
    finally:
        run.kill_group()
    records, rec = the_recovery(run)
    assert rec["engines"] == [0] and not rec["trainers"], rec
    assert rec["where"].startswith("weight sync: trainer rank 0 -> engine 0"), rec
    assert records[-1]["runtime"]["state"] == "Succeeded"
    assert records[-1]["replacements"] == {"engines": 1, "trainers": 0}
    assert records[-1]["rerun_prompts"] == 0  # no rollout was lost: the step ran again from its sync
    assert [r["step"] for r in run.steps()] == list(range(1, 6))
    print(f"engine kill before a sync: recovered in {rec['seconds']:.1f}s, Succeeded {finished_after:.1f}s after")
