"""Shared fixtures of the runtime tier: a tiny model built once per session, job configs, driver runs.

Every driver run is a real subprocess (``python -m rlhf_runtime.driver``) with real vLLM (CPU) engines and the
real ``gloo`` weight-transfer backend; nothing is mocked. Its Ray is this pytest worker's (``shared_ray``: one
``ray start --head`` per worker, joined with ``--address``), which spares every run Ray's own start; a run given an
environment of its own (``env=``) starts a local Ray instead (``--local``), since only a Ray started by the driver
passes the driver's environment on to the actors. ``hooks=True`` runs the same driver with the test hooks of
``rlhf_testing.driver`` (subclasses of the runtime's actors, handed in through its extension point).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from rlhf_testing.tiny import tiny_job_spec

from rlhf_api.groups import COLOCATED, ROLES, ROLLOUT, TRAINER, resource
from rlhf_api.models import RuntimeConfig
from tests.helpers import LOADED_MACHINE_RAY_ENV, JobAPI, MLflowServer, free_port, wait_for
from tests.s3 import S3Server

#: Ray 2.60's `ray start --head` asks its clients for a token unless told otherwise: this worker's own head, no auth.
SHARED_RAY_ENV = {"RAY_AUTH_MODE": "disabled"}
#: This worker's shared Ray, once ``shared_ray`` started it: its address.
_SHARED_RAY: list[str] = []


@pytest.fixture(scope="session", autouse=True)
def shared_ray(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A Ray head on this machine for this pytest worker's driver runs, with every ``rlhf_*`` resource a test job's
    bundles ask for (CPU jobs: one unit per pod, far below 64). In a process group of its own (``--block``): its
    end ends every Ray process it started, and no other Ray on the machine."""
    log = tmp_path_factory.mktemp("shared-ray") / "ray-start.log"
    port = free_port()
    resources = {resource(g): 64 for g in (TRAINER, ROLLOUT, COLOCATED, *ROLES)}
    cmd = [str(Path(sys.executable).parent / "ray"), "start", "--head", "--block", f"--port={port}",
           "--num-cpus=4", f"--resources={json.dumps(resources)}",
           "--include-dashboard=false", "--disable-usage-stats"]
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, **LOADED_MACHINE_RAY_ENV, **SHARED_RAY_ENV})
    try:
        wait_for(lambda: proc.poll() is not None or "Ray runtime started" in log.read_text(), timeout=120,
                 what="the shared Ray head to start")
        assert proc.poll() is None, log.read_text()[-3000:]
        _SHARED_RAY.append(f"127.0.0.1:{port}")
        yield _SHARED_RAY[-1]
    finally:  # nothing in it outlives the session: no graceful stop (it waits out its processes' timeouts)
        _SHARED_RAY.clear()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def ray_args(env: dict[str, str] | None) -> tuple[list[str], dict[str, str]]:
    """How a driver run gets its Ray: this worker's shared one, or a local one where the run has an environment of
    its own for its actors (``env``) or no shared Ray is up. The arguments and the environment to add."""
    if env is None and _SHARED_RAY:
        return ["--address", _SHARED_RAY[-1]], SHARED_RAY_ENV
    return ["--local"], {}


@pytest.fixture(scope="session")
def mlflow_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MLflowServer]:
    """A real MLflow tracking server (``spec.tracking``), started by the first test that asks for it in a test
    worker; the test calls ``wait()`` (the first start migrates its database)."""
    server = MLflowServer(tmp_path_factory.mktemp("mlflow"))
    try:
        yield server
    finally:
        server.close()


def built(factory: pytest.TempPathFactory, name: str, builder: str, args: str = "") -> Path:
    """A fresh folder ``name`` with what ``builder`` (``module:function`` of ``rlhf_testing``, called with the folder
    and ``args``) writes there, built in a subprocess that keeps torch out of pytest."""
    path = factory.mktemp(name)
    module, fn = builder.split(":")
    code = f"from {module} import {fn}; {fn}({str(path)!r}{', ' + args if args else ''})"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=180)
    return path


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random-init tiny Qwen2 (untied embeddings) and a char-level tokenizer, built locally."""
    return built(tmp_path_factory, "tiny-model", "rlhf_testing.tiny:build_tiny_model", "seed=0")


@pytest.fixture(scope="session")
def tiny_chat_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random-init tiny Qwen2 with a chat tokenizer and a ChatML template with Hermes tool calls."""
    return built(tmp_path_factory, "tiny-chat-model", "rlhf_testing.tiny_chat:build_tiny_chat_model")


@pytest.fixture(scope="module")
def s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    """S3Proxy (``tests/s3.py``) with a bucket for checkpoints and exports."""
    server = S3Server(tmp_path_factory.mktemp("s3proxy"), buckets=("ckpt",)).start()
    try:
        yield server
    finally:
        server.stop()


def job_config(model: Path, **over: Any) -> dict[str, Any]:
    """A tiny CPU job: 1 trainer (CPU), 1 engine, reward for emitting '7'; ``over`` patches spec keys."""
    spec: dict[str, Any] = tiny_job_spec(model, steps=20)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(spec.get(key), dict):
            spec[key] = {**spec[key], **value}
        else:
            spec[key] = value
    return spec


#: The start of a script run by ``engine_script``: the job spec (argv[1]) as the runtime reads it, its engine's
#: keyword arguments and actor environment (``kw``, ``env``) and a local Ray of one CPU for the engine actors.
ENGINE_SCRIPT_SETUP = r"""
import json, sys, time

import ray

from rlhf_api.models import RLHFJobSpec
from rlhf_runtime.infra import config as rc
from rlhf_runtime.rollout.options import EngineOptions

spec = RLHFJobSpec.model_validate(json.loads(sys.argv[1]))
kw = rc.engine_kwargs(spec, spec.model.name, "gloo", "uni", gpu=False)
env = rc.actor_env(spec, gpu=False)
ray.init(address="local", num_cpus=1, include_dashboard=False)
"""


def engine_script(body: str, spec: dict[str, Any]) -> Any:
    """Run ``ENGINE_SCRIPT_SETUP`` + ``body`` on ``spec`` in a process of its own (torch and vLLM stay out of pytest);
    the JSON the script printed after ``RESULT ``. The actors' log lines reach its stdout too (Ray's
    log_to_driver), also after the result at times: the last such line counts."""
    proc = subprocess.run([sys.executable, "-c", ENGINE_SCRIPT_SETUP + body, json.dumps(spec)], capture_output=True,
                          text=True, timeout=600, check=False)
    assert proc.returncode == 0, (proc.stdout[-2000:], proc.stderr[-4000:])
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert lines, (proc.stdout[-2000:], proc.stderr[-4000:])
    return json.loads(lines[-1][len("RESULT "):])


def rank_results(worker: str, world: int, tmp: Path, args: str) -> list[Any]:
    """Run the code ``worker`` as ``world`` rank processes (``python -c worker <rank> <world> <port> <tmp>
    <args>``, one free rendezvous port) and return each rank's result: the JSON of its last stdout line; a rank that
    failed fails the test with the end of its stderr."""
    port = free_port()
    procs = [subprocess.Popen([sys.executable, "-c", worker, str(r), str(world), str(port), str(tmp), args],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(world)]
    done = [p.communicate(timeout=600) for p in procs]
    failed = [f"rank {r}: {e[-2500:]}" for r, (p, (_, e)) in enumerate(zip(procs, done)) if p.returncode]
    assert not failed, "\n".join(failed)
    return [json.loads(o.strip().splitlines()[-1]) for o, _ in done]


def write_config(path: Path, spec: dict[str, Any], uid: str = "uid-1") -> Path:
    cfg = RuntimeConfig(name="tiny", namespace="default", uid=uid, spec=spec)
    path.write_text(cfg.model_dump_json(by_alias=True))
    return path


@dataclass
class Run:
    proc: subprocess.Popen
    progress: Path
    log: Path

    def records(self) -> list[dict[str, Any]]:
        if not self.progress.exists():
            return []
        return [json.loads(line) for line in self.progress.read_text().splitlines() if line.strip()]

    def steps(self) -> list[dict[str, Any]]:
        return [r for r in self.records() if "throughput" in r and r["runtime"]["state"] == "Running"]

    def wait(self, timeout: float) -> int:
        """The driver's exit status; past ``timeout`` the test fails with the end of the driver's log, which then
        holds the stack of every driver thread (SIGUSR1)."""
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.send_signal(signal.SIGUSR1)
            with contextlib.suppress(AssertionError):
                wait_for(lambda: "most recent call first" in self.log.read_text(errors="replace"), timeout=10,
                         what="the driver's stacks")
            raise AssertionError(f"the driver did not end within {timeout:g} s; the end of its log:\n"
                                 f"{self.tail(200)}") from None
        finally:
            self.kill_group()

    def kill_group(self) -> None:
        """Kill what this run started (the driver's session: its local Ray and actors)."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(timeout=30)

    def kill_after_steps(self, steps: int, total: int, timeout: float = 240) -> None:
        """SIGKILL the driver (no report, no cleanup) once ``steps`` steps are done, then its session; the run of
        ``total`` steps must not have finished before."""
        try:
            wait_for(lambda: self.proc.poll() is None and len(self.steps()) >= steps, timeout=timeout,
                     what=f"{steps} steps before the kill", interval=0.05)
            self.proc.send_signal(signal.SIGKILL)
        finally:
            self.kill_group()
        assert self.steps()[-1]["step"] < total, "the run finished before it could be killed"

    def tail(self, n: int = 60) -> str:
        """The end of the driver's log, then what its Ray and the kernel recorded about dead nodes and killed
        processes (``ray_record``)."""
        log = "\n".join(self.log.read_text(errors="replace").splitlines()[-n:]) if self.log.exists() else ""
        return f"{log}\n{ray_record(self.proc.pid)}"


#: Lines of a local Ray's own logs and of the kernel's that name why actors died when the driver's log cannot:
#: a node marked dead, failed health checks, workers killed for memory, the kernel's OOM killer.
RAY_DEATH_LINES = ("marked dead", "Health check failed", "Memory on the node", "memory usage threshold",
                   "Killed process", "Out of memory")


def ray_record(driver_pid: int, per_kind: int = 3) -> str:
    """The lines of ``RAY_DEATH_LINES`` from the Ray session of the driver ``driver_pid`` (found by its core-worker
    log's name; in a shared Ray only those stamped from the driver's start on) and from the kernel's log: the first
    ``per_kind`` of each kind with their count, or a line saying there were none."""
    lines: list[str] = []
    cores = sorted(Path("/tmp/ray").glob(f"session_*/logs/python-core-driver-*_{driver_pid}.log"),
                   key=lambda f: f.stat().st_mtime)
    for core in cores[-1:]:  # the newest: an older session's driver may have had the same pid
        since = core.read_text(errors="replace")[:24]  # "[YYYY-MM-DD HH:MM:SS,mmm": Ray's stamps sort as text
        for name in ("gcs_server.out", "raylet.out"):
            f = core.parent / name
            if f.exists():
                lines += [f"{name}: {ln}" for ln in f.read_text(errors="replace").splitlines() if ln[:24] >= since]
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        kernel = subprocess.run(["dmesg"], check=False, capture_output=True, text=True, timeout=10).stdout
        lines += [f"kernel: {ln}" for ln in kernel.splitlines()]
    out = []
    for kind in RAY_DEATH_LINES:
        found = [ln for ln in lines if kind in ln]
        if found:
            out.append(f"[{kind}: {len(found)} line(s)]")
            out += [ln[:300] for ln in found[:per_kind]]
    if not out:
        return "[Ray and the kernel recorded no dead node, failed health check or killed process]"
    return "[Ray and the kernel recorded:]\n" + "\n".join(out)


def start_driver(
    tmp: Path, config: Path, *args: str, name: str = "run", env: dict[str, str] | None = None, hooks: bool = False
) -> Run:
    """Start the driver on ``config``; ``env`` adds to (or overrides) this process's environment; ``hooks``:
    ``rlhf_testing.driver`` (``--skip-tensor``, ``--pause-after-tokens``)."""
    progress = tmp / f"{name}.progress.jsonl"
    log = tmp / f"{name}.log"
    ray, ray_env = ray_args(env)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "RAY_DEDUP_LOGS": "0", **LOADED_MACHINE_RAY_ENV, **ray_env,
           **(env or {})}
    module = "rlhf_testing.driver" if hooks else "rlhf_runtime.driver"
    cmd = [sys.executable, "-m", module, "--config", str(config), *ray, "--no-report",
           "--progress-file", str(progress), *args]
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    return Run(proc, progress, log)



def start_reporting_driver(tmp: Path, config: Path, api: JobAPI, *args: str, name: str = "run",
                           env: dict[str, str] | None = None) -> Run:
    """``start_driver`` that reports to ``api`` (``--kubeconfig``) instead of ``--no-report``."""
    progress = tmp / f"{name}.progress.jsonl"
    log = tmp / f"{name}.log"
    ray, ray_env = ray_args(env)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "RAY_DEDUP_LOGS": "0", **LOADED_MACHINE_RAY_ENV, **ray_env,
           **(env or {})}
    cmd = [sys.executable, "-m", "rlhf_runtime.driver", "--config", str(config), *ray,
           "--kubeconfig", str(api.kubeconfig(tmp / "kubeconfig")), "--progress-file", str(progress), *args]
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    return Run(proc, progress, log)
