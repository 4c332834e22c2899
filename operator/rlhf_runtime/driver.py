"""The Ray driver: runs one RLHFJob from its ``RuntimeConfig``.

Invocation::

    python -m rlhf_runtime.driver --config /etc/rlhf/job.json      # or RLHF_JOB_CONFIG; console: rlhf-runtime
        [--local] [--num-cpus N]           # own local Ray instead of ray.init(address="auto")
        [--kubeconfig PATH | --no-report]  # status reports (default: in-cluster config)
        [--validate] [--debug-skip-tensor NAME] [--async-pause-after-tokens N]    # tests and benchmarks
        [--progress-file PATH] [--metrics-port PORT]   # or RLHF_PROGRESS_FILE / RLHF_METRICS_PORT (operator wiring)

Without ``--local`` the driver joins the Ray cluster it runs in; if none is reachable it starts a local one.

A step (``weightSync.mode: sync``): sync weights to the engines if due (every ``everyNSteps`` steps and
always before the first rollout of a run, since engines start with dummy weights) -> rollout of
``promptsPerStep`` prompts x ``samplesPerPrompt`` samples spread over the engines -> rewards -> GRPO
advantages -> one trainer update -> checkpoint if due -> report. In ``async`` mode the rollout of the next
step runs on ``AsyncLLM`` engines while the trainer trains; the sync pauses those requests mid-generation
(``pause_generation(mode="keep")``), swaps the weights and resumes them, and every sample records how many of
its tokens came before the swap. ``spec.rollout.asyncEngine: stepped`` runs async mode on ``SteppedEngine``
instead, which steps an in-process vLLM ``LLM`` itself (for machines where AsyncLLM's engine-core subprocess
cannot start); the default, ``asyncllm``, is ``AsyncEngine`` (``engine_api.engine_class``; every engine class
implements ``engine_api.RolloutEngine``). Colocated engines sleep while the trainer trains (level 2, weights
discarded, when a full sync follows the wake; level 1 otherwise) and wake weights -> sync -> wake KV cache
(GPU; CPU vLLM ignores sleep).

Weight sync uses the spec's backend on GPUs and the CPU ``gloo`` backend (``rlhf_runtime.weight_sync.gloo``)
whenever the trainer has no GPUs, through the same vLLM engine calls.

LoRA (``spec.trainer.lora``): the engines start with the base model's real weights and LoRA enabled; a sync is
the adapter only: trainer rank 0 serialises it (``Trainer.adapter_payload``) and the driver hands that object,
through Ray's object store and without fetching it itself, to every engine (``Engine.load_adapter``), which
switches its rollouts to it under a new LoRA id. No weight-transfer group is made. The sync result says
``format: lora``, the adapter's ``bytes`` and the policy's ``full_bytes``. Validation compares the synced engines
(base + adapter) with a fresh plain engine loaded from the merged weights, after the first sync (the adapter is
still zero there) and again after the last step (the trained adapter; the exported model when ``spec.output``
is set).

Validation (``spec.weightSync.validate`` or ``--validate``): after the first sync, every engine's
greedy output for the first prompts must equal, token for token, that of a fresh engine of the same shape
loaded from the trainer's weights; engines of an expert-parallel DP group are compared rank by rank with a
fresh DP group. Otherwise the run fails with "weight-sync validation failed". The weights reach each fresh
engine's node through Ray's object store (``rlhf_runtime.infra.node_files``: pods share no filesystem) and every copy
is removed afterwards, also when validation fails.

Multi-pod addresses: FSDP2 trainer ranks meet at rank 0's node (IP and free port found there, never the
driver's head pod), as the engines of an expert-parallel DP group meet at engine 0's.

``rollout.expertParallel`` (MoE): the engines form one vLLM data-parallel group with expert parallelism
(vLLM's offline SPMD variables ``VLLM_DP_*``, master on engine 0's node); all ranks step together, so a rank
without prompts gets a one-token placeholder request.
``--debug-skip-tensor NAME`` leaves one tensor out of every sync, which validation must catch.

No silent hang. Every driver -> actor call has a deadline: weight-sync group init, syncs, sleep/wake,
pause/resume, validation and pid/world-size queries ``spec.weightSync.timeoutSeconds``; actor starts, rollouts,
train steps and checkpoint saves what is left of ``spec.progressDeadlineSeconds``. Past it the run fails with
the call and its actors, e.g. "weight sync: trainer rank 0 -> 2 engines did not finish within
weightSync.timeoutSeconds=20s". The trainer's engine calls, the gloo weight-transfer group and the FSDP2
process group are bounded by ``weightSync.timeoutSeconds`` too. A watchdog thread (``Watchdog``) fails the run
when no progress (the start, a trainer resume, each completed step) happened within
``spec.progressDeadlineSeconds``: "no training step completed within spec.progressDeadlineSeconds (N s);
stuck in: <activity>", reported as runtime state Failed, exit status 1 (the main thread is interrupted; the
process exits by itself if it does not stop within ``WATCHDOG_GRACE_SECONDS``).

Live edits: at each step boundary and from the heartbeat thread the driver reads its RLHFJob and adopts
``spec.algorithm.steps`` (the loop ends at the new total, raised or lowered) and
``spec.progressDeadlineSeconds``; ``status.runtime.observedGeneration`` is the generation applied and
``status.runtime.progressTime`` the last progress. A job.json that does not parse (JSON, another apiVersion,
invalid values) is reported as Failed with the parse error into the job its raw JSON names; exit status 1.

In-run recovery (``weightSync.mode: sync``, independent engines): an engine actor that dies is replaced on
its placement bundle, the weight-sync group is re-created with the trainer and the weights resynced; a rollout
it was generating re-runs only its part. A dead trainer rank restarts every rank, which resume from the newest
checkpoint (rank 0 picks it for all ranks; without ``spec.checkpoint`` the run fails). The runtime message
says what happened ("recovered: engine 1 died during rollout of step 5 ..."), the progress file counts
``replacements``. At most ``spec.inRunRecoveries`` (default 3; 0 turns it off) per run; the next fault fails the
run and KubeRay's ``backoffLimit`` decides on a retry. A hang (deadline) is never "recovered" in-run.

Exit status: 0 succeeded, 1 failed, 3 validation failed.
"""

from __future__ import annotations

import _thread
import argparse
import logging
import math
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rlhf_api.models import RuntimeConfig
from rlhf_runtime.algo import advantages as adv_plan
from rlhf_runtime.infra import config as rc
from rlhf_runtime.infra import node_files
from rlhf_runtime.algo.data import load_eval_samples, load_samples, render_prompt, step_batch
from rlhf_runtime.rollout.api import RolloutEngine, engine_class
from rlhf_runtime.infra.placement import ActorPlacement, compute_layout, local_thread_cap, spread
from rlhf_runtime.infra.report import ForeignJobError, Metrics, Reporter, StatusClient, now_rfc3339
from rlhf_runtime.algo.rewards import combine, endpoint_rewards, make_reward, normalize

log = logging.getLogger("rlhf_runtime")
VALIDATION_PROMPTS = 8
EXIT_FAILED, EXIT_VALIDATION = 1, 3


#: Consecutive ports a vLLM data-parallel group uses from its master port (engine and worker groups).
DP_PORTS = 16
#: How long a liveness probe of an actor may take; one that does not answer is busy or stopped, not dead.
PROBE_SECONDS = 10.0
#: After the progress watchdog fired: time the main thread gets to report and clean up before the process exits.
WATCHDOG_GRACE_SECONDS = 60.0
#: Longest Ray shutdown at the end of a run (an actor stopped mid-collective can keep it waiting).
SHUTDOWN_SECONDS = 30.0


class ValidationError(RuntimeError):
    pass


class DeadlineExceeded(TimeoutError):
    """A driver -> actor call ran past its deadline (``weightSync.timeoutSeconds`` or
    ``spec.progressDeadlineSeconds``); the message names the call and the actors."""


def _actor_died(e: BaseException) -> bool:
    """Whether ``e`` (from ``ray.get``) says an actor died: the call's own actor, or one it called."""
    from ray.exceptions import RayActorError

    return isinstance(e, RayActorError) or isinstance(getattr(e, "cause", None), RayActorError)


class Watchdog:
    """No silent hang: a thread that calls ``on_expire(message)`` once when no progress (``progress()``: the
    run's start or resume, then each completed step) happened within ``deadline()`` seconds (read on every
    check: ``spec.progressDeadlineSeconds`` may be edited live). ``doing(what)`` names the current activity
    for the message."""

    def __init__(self, deadline: Callable[[], float], on_expire: Callable[[str], None],
                 poll_seconds: float = 0.5) -> None:
        self.deadline, self.on_expire, self.poll_seconds = deadline, on_expire, poll_seconds
        self.last = time.monotonic()
        self.activity = "starting"
        self.fired: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def progress(self) -> None:
        self.last = time.monotonic()

    def doing(self, what: str) -> None:
        self.activity = what

    def remaining(self) -> float:
        return float(self.deadline()) - (time.monotonic() - self.last)

    def message(self) -> str:
        return (f"no training step completed within spec.progressDeadlineSeconds ({self.deadline():g} s); "
                f"stuck in: {self.activity}")

    def start(self) -> None:
        def watch() -> None:
            while not self._stop.wait(self.poll_seconds):
                if self.remaining() <= 0:
                    self.fired = self.message()
                    self.on_expire(self.fired)
                    return

        self.progress()
        self._thread = threading.Thread(target=watch, name="rlhf-progress-watchdog", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()


@dataclass
class Rollout:
    """A launched rollout: per engine index its generate ref and its prompts (indices into ``prompt_ids``)."""

    step: int
    refs: dict[int, Any]
    parts: dict[int, list[int]]
    prompt_ids: list[list[int]]
    batch: list[Any]
    sampling: dict[str, Any]
    t_launch: float


def _node_address(ports: int = 1) -> tuple[str, int]:
    """(Ray task) This node's IP and the first of ``ports`` consecutive TCP ports that are free on it."""
    import random
    import socket

    from ray.util import get_node_ip_address

    for _ in range(200):
        base = random.randint(20000, 60000 - ports)
        socks = []
        try:
            for p in range(base, base + ports):
                s = socket.socket()
                socks.append(s)
                s.bind(("", p))
            return get_node_ip_address(), base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError(f"no {ports} consecutive free ports on this node")


@dataclass
class Options:
    config: str | None = None
    local: bool = False
    num_cpus: int | None = None
    kubeconfig: str | None = None
    report: bool = True
    validate: bool = False
    skip_tensor: str | None = None
    progress_file: str | None = None
    metrics_port: int = 0
    pause_after_tokens: int = 0


def parse_args(argv: list[str] | None = None) -> Options:
    p = argparse.ArgumentParser(prog="rlhf-runtime", description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default=os.environ.get(rc.CONFIG_ENV), help="RuntimeConfig JSON file")
    p.add_argument("--local", action="store_true", help="start a local Ray instead of joining a cluster")
    p.add_argument("--num-cpus", type=int, help="CPUs of the local Ray (default: one per actor + 1)")
    p.add_argument("--kubeconfig", help="report through this kubeconfig instead of the in-cluster config")
    p.add_argument("--no-report", action="store_true", help="do not patch the RLHFJob status")
    p.add_argument("--validate", action="store_true",
                   help="validate the first weight sync (also spec.weightSync.validate)")
    p.add_argument("--debug-skip-tensor",
                   help="debug: leave this tensor out of every weight sync (LoRA: every adapter tensor whose name "
                   "contains it)")
    p.add_argument("--progress-file", default=os.environ.get("RLHF_PROGRESS_FILE"))
    p.add_argument("--metrics-port", type=int, default=int(os.environ.get("RLHF_METRICS_PORT", "0")))
    p.add_argument("--async-pause-after-tokens", type=int, default=0,
                   help="async mode (tests, benchmarks): before a sync, wait until a live sample has this many tokens")
    a = p.parse_args(argv)
    return Options(a.config, a.local, a.num_cpus, a.kubeconfig, not a.no_report, a.validate,
                   a.debug_skip_tensor, a.progress_file, a.metrics_port, a.async_pause_after_tokens)


def _throughput(step_s: float, rollout_s: float, train_s: float, tokens: int, samples: int,
                sync: dict[str, float] | None, reward_mean: float) -> dict[str, float]:
    out = {
        "rollout_tokens_per_second": tokens / rollout_s if rollout_s > 0 else 0.0,
        "samples_per_second": samples / step_s if step_s > 0 else 0.0,
        "step_seconds": step_s,
        "rollout_seconds": rollout_s,
        "train_seconds": train_s,
        "reward_mean": reward_mean,
    }
    if sync:
        out["weight_sync_seconds"] = sync["total_s"]
        out["weight_sync_gbps"] = sync["gbps"]
    return out


class Runtime:
    def __init__(self, cfg: RuntimeConfig, opts: Options, reporter: Reporter, watchdog: Watchdog | None = None) -> None:
        self.cfg, self.spec, self.opts, self.reporter = cfg, cfg.spec, opts, reporter
        # without a started watchdog (unit tests) nothing fires; the deadlines still bound every call
        self.watchdog = watchdog or Watchdog(lambda: self.progress_deadline, lambda message: None)
        self.total = self.spec.algorithm.steps  # live: spec.algorithm.steps (refresh_spec)
        self.progress_deadline = self.spec.progress_deadline_seconds  # live: spec.progressDeadlineSeconds
        self.layout = compute_layout(self.spec)
        self.gpu = self.layout.gpu
        self.backend = rc.resolve_backend(self.spec, self.gpu)
        self.async_mode = self.spec.weight_sync.mode == "async"
        self.colocated = self.spec.placement.mode == "colocated"
        self.sleeps = rc.engines_sleep(self.spec, self.gpu)
        self.env = rc.actor_env(self.spec, self.gpu)
        # CPU-only jobs: each actor computes on its pod's CPUs (placement ``threads``), not on the one thread Ray
        # gives an actor, unless spec.env sets OMP_NUM_THREADS (a value, or valueFrom: then the pods have it).
        # Not the driver's own environment: Ray's job supervisor runs it with OMP_NUM_THREADS=1.
        self.own_threads = any(e.name == "OMP_NUM_THREADS" for e in self.spec.env or [])
        self.thread_cap = (local_thread_cap(self.layout, self.async_mode, len(os.sched_getaffinity(0)))
                           if opts.local else None)
        self.validate_first_sync = rc.validation_enabled(self.spec, opts.validate)
        self.lora = self.spec.trainer.lora is not None  # adapter-only syncs (sync_adapter)
        self.adapter_id = 0  # the engines' vLLM LoRA id: one more per adapter sync
        self.param_bytes = 0  # the policy's full weights (Trainer.info), beside an adapter sync's bytes
        self.pgs: list[Any] = []
        self.trainers: list[Any] = []
        #: every engine actor serves ``engine_api.RolloutEngine`` (``PausableEngine`` in async mode)
        self.engine_class: type[RolloutEngine] = engine_class(self.async_mode, self.spec.rollout.async_engine)
        self.engines: list[Any] = []  # Ray actor handles of ``engine_class``
        self.trainer_class: type | None = None  # None: ``rlhf_runtime.roles.policy.Trainer``
        self.engine_kwargs: list[dict[str, Any]] = []
        self.asleep = False  # colocated engines sleep while the trainer trains
        self.dp_address: tuple[str, int] | None = None
        self.trainer_pids: list[Any] = []
        self.trainer_threads: list[Any] = []  # each trainer's torch threads (OMP_NUM_THREADS, ``actor_env``)
        self.done = 0
        self.resumed: int | None = None
        self.synced_at = 0
        self.last_sync: dict[str, float] | None = None
        self.pending: Rollout | None = None
        self.recoveries = 0
        self.replacements = {"engines": 0, "trainers": 0}
        self.rerun_prompts = 0  # prompts of a rollout generated again after their engine died
        self.roles: dict[str, list[Any]] = {}  # "reward" / "critic" / "reference" actors (placement.Layout.roles)
        self.output: dict[str, Any] | None = None  # status.output: the newest export
        self.evaluation: dict[str, Any] | None = None  # status.eval: the newest evaluation

    # ----------------------------------------------------------------------------------- setup
    def connect(self) -> None:
        import ray

        env = {"env_vars": dict(self.env)}
        if not self.opts.local:
            try:
                ray.init(address="auto", runtime_env=env, log_to_driver=True)
                return
            except ConnectionError:
                log.warning("no Ray cluster reachable: starting a local one")
        totals = self.layout.totals()
        resources = {k: v for k, v in totals.items() if k.startswith("rlhf_")}
        # bundles ask for no CPUs (placement.py); one per actor keeps Ray's worker pool warm as before
        cpus = self.opts.num_cpus or len(self.layout.trainers) + len(self.layout.engines) + 1
        ray.init(num_cpus=cpus, resources=resources, runtime_env=env, include_dashboard=False)

    def place(self) -> None:
        import ray
        from ray.util.placement_group import placement_group

        self.pgs = [
            placement_group(g.bundles, strategy=g.strategy, name=f"{self.cfg.name}-{g.name}-{os.getpid()}")
            for g in self.layout.groups
        ]
        deadline = time.time() + 600
        pending = [pg.ready() for pg in self.pgs]
        while pending:
            _, pending = ray.wait(pending, num_returns=len(pending), timeout=10)
            if pending and time.time() > deadline:
                raise TimeoutError("placement groups not ready after 600 s: not enough GPUs/CPUs in the cluster")

    def _strategy(self, group: int, bundle: int) -> Any:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        return PlacementGroupSchedulingStrategy(
            placement_group=self.pgs[group], placement_group_bundle_index=bundle,
            placement_group_capture_child_tasks=True,
        )

    # ------------------------------------------------------------------------------------- deadlines
    def _settings(self) -> str:
        return f"weightSync.timeoutSeconds={self.spec.weight_sync.timeout_seconds}s"

    def _get(self, refs: Any, what: str) -> Any:
        """A driver -> actor call other than a rollout or a train step: bounded by ``weightSync.timeoutSeconds``;
        past it the run fails with ``what`` (the call and its actors) in the message."""
        return self._bounded(refs, what, float(self.spec.weight_sync.timeout_seconds), self._settings())

    def _get_step(self, refs: Any, what: str) -> Any:
        """A rollout, a train step or an actor start: bounded by what is left of ``spec.progressDeadlineSeconds``
        (counted like the watchdog, from the last progress)."""
        left = max(self.watchdog.remaining(), 0.0) + 1.0
        return self._bounded(refs, what, left, f"spec.progressDeadlineSeconds={self.progress_deadline}s")

    def _bounded(self, refs: Any, what: str, timeout: float, setting: str) -> Any:
        import ray

        self.watchdog.doing(what)
        try:
            return ray.get(refs, timeout=timeout)
        except TimeoutError as e:  # ray's GetTimeoutError, or an actor's own deadline (RayTaskError(TimeoutError))
            inner = "" if type(e).__name__ == "GetTimeoutError" else f" ({str(e).strip().splitlines()[-1][:300]})"
            raise DeadlineExceeded(f"{what} did not finish within {setting}{inner}") from e

    def _engines_desc(self, idx: list[int] | None = None) -> str:
        idx = list(range(len(self.engines))) if idx is None else idx
        return f"engine {idx[0]}" if len(idx) == 1 else f"{len(idx)} engines"

    def _sync_desc(self) -> str:
        return f"trainer rank 0 -> {self._engines_desc()}"

    def _trainers_desc(self) -> str:
        n = len(self.trainers)
        return "trainer rank 0" if n == 1 else f"trainer ranks 0-{n - 1}"

    # ----------------------------------------------------------------------------------- actors
    def start_trainers(self) -> dict[str, Any]:
        import ray

        from rlhf_runtime.roles.policy import Trainer

        trainer_class = self.trainer_class or Trainer
        cfg_json = self.cfg.model_dump_json(by_alias=True)
        n = len(self.layout.trainers)
        addr = port = None
        if n > 1:  # torch.distributed rendezvous: rank 0 listens on its own node (not the driver's head pod)
            addr, port = self._address_on(self.layout.trainers[0])
        for rank, a in enumerate(self.layout.trainers):
            actor = ray.remote(trainer_class).options(
                num_cpus=a.num_cpus, num_gpus=a.num_gpus, scheduling_strategy=self._strategy(a.group, a.bundle),
                runtime_env={"env_vars": self.actor_env(a)},
            ).remote(cfg_json, rank, n, addr, port)
            self.trainers.append(actor)
        infos = self._get_step([t.info.remote() for t in self.trainers], f"start of {self._trainers_desc()}")
        self.trainer_pids = [i.get("pid") for i in infos]
        self.trainer_threads = [i.get("threads") for i in infos]
        self.param_bytes = int(infos[0].get("param_bytes") or 0)
        return infos[0]

    def start_roles(self) -> None:
        """The actors of the roles beside the policy (``placement.Layout.roles``): reward model scorers, the
        critic's workers (FSDP2 over them when there are several), reference workers."""
        import ray

        from rlhf_runtime.roles.reward import RewardScorer
        from rlhf_runtime.roles.base import CriticModel, ReferenceModel

        spec, cfg_json = self.spec, self.cfg.model_dump_json(by_alias=True)
        for role, places in self.layout.roles.items():
            addr = port = None
            if role == "critic" and len(places) > 1:
                addr, port = self._address_on(places[0])
            actors = []
            for rank, a in enumerate(places):
                opts = ray.remote({"reward": RewardScorer, "critic": CriticModel, "reference": ReferenceModel}[role])
                opts = opts.options(num_cpus=a.num_cpus, num_gpus=a.num_gpus,
                                    scheduling_strategy=self._strategy(a.group, a.bundle),
                                    runtime_env={"env_vars": self.actor_env(a)})
                if role == "reward":
                    m = spec.reward.model
                    assert m is not None
                    actors.append(opts.remote(m.name, m.revision, spec.model.dtype, m.batch_size, None,
                                              spec.model.trust_remote_code))
                elif role == "critic":  # resumes at the trainer's step (self.done, from start_trainers)
                    actors.append(opts.remote(cfg_json, rank, len(places), addr, port, self.done or None))
                else:
                    actors.append(opts.remote(cfg_json))
            self.roles[role] = actors
        if self.roles:
            flat = self._get_step([a.info.remote() for acts in self.roles.values() for a in acts],
                                  f"start of {', '.join(f'{len(v)} {k} actor(s)' for k, v in self.roles.items())}")
            infos, at = {}, 0
            for k, v in self.roles.items():
                infos[k], at = flat[at : at + len(v)], at + len(v)
            self.reporter._write_progress({"time": time.time(), "roles": infos})

    def actor_env(self, a: ActorPlacement, extra: dict[str, str] | None = None) -> dict[str, str]:
        """The environment of the actor placed at ``a``: the job's (``self.env``), the placement's, ``extra``,
        and on CPU-only jobs ``OMP_NUM_THREADS`` = ``a.threads`` (at most ``self.thread_cap`` in a local run)."""
        env = {**self.env, **a.env, **(extra or {})}
        if a.threads and not self.own_threads:
            env["OMP_NUM_THREADS"] = str(min(a.threads, self.thread_cap or a.threads))
        return env

    def _make_engine(self, i: int) -> Any:
        """Engine actor ``i`` on its own placement bundle (a replacement takes the same bundle)."""
        import ray

        e = self.layout.engines[i]
        env = self.actor_env(e, self._dp_env(i, self.dp_address) if self.dp_address else None)
        return ray.remote(self.engine_class).options(
            num_cpus=e.num_cpus, num_gpus=e.num_gpus, scheduling_strategy=self._strategy(e.group, e.bundle),
            runtime_env={"env_vars": env}, max_concurrency=16 if self.async_mode else 1,
        ).remote(self.engine_kwargs[i], env)

    def start_engines(self) -> None:
        dp = self._address_on(self.layout.engines[0], DP_PORTS) if self.layout.dp_group else None
        self.dp_address = dp
        for i, _ in enumerate(self.layout.engines):
            # one vLLM DP group (expert parallel): same seed on every rank, they step together
            seed = self.spec.algorithm.seed + (0 if dp else i)
            kw = rc.engine_kwargs(self.spec, self.spec.model.name, self.backend, self.layout.engines[i].executor,
                                  self.gpu, seed=seed)
            self.engine_kwargs.append(kw)
            self.engines.append(self._make_engine(i))
        # a DP group starts together
        self._get_step([e.ready.remote() for e in self.engines], f"start of {self._engines_desc()}")

    def record_actors(self) -> None:
        """Which process serves which actor (progress file): for people reading a run, and for fault tests."""
        pids = self._get([e.pid.remote() for e in self.engines], f"pid of {self._engines_desc()}")
        self.reporter._write_progress({"time": time.time(), "actors": {
            "trainers": self.trainer_pids, "engines": pids, "replacements": dict(self.replacements),
            "trainer_threads": self.trainer_threads}})

    def _address_on(self, where: ActorPlacement, ports: int = 1) -> tuple[str, int]:
        """The node IP of bundle ``where`` and the first of ``ports`` consecutive ports free there, found by a
        task on that node: the address a process placed there can listen on (trainer rank 0 for FSDP2,
        engine 0 as master of the engines' vLLM DP group)."""
        import ray

        task = ray.remote(_node_address).options(
            num_cpus=0, scheduling_strategy=self._strategy(where.group, where.bundle)
        )
        addr, port = self._get_step(task.remote(ports), "free port lookup on a placement bundle")
        return str(addr), int(port)

    def _dp_env(self, rank: int, address: tuple[str, int]) -> dict[str, str]:
        """vLLM's offline SPMD data-parallel settings for engine ``rank`` (each engine sees only its own GPUs,
        so its local DP rank is 0)."""
        return {"VLLM_DP_RANK": str(rank), "VLLM_DP_RANK_LOCAL": "0", "VLLM_DP_SIZE": str(len(self.layout.engines)),
                "VLLM_DP_MASTER_IP": address[0], "VLLM_DP_MASTER_PORT": str(address[1])}

    def init_sync(self) -> None:
        """(Re-)create the weight-transfer group trainer rank 0 <-> every engine (after a replacement too). LoRA:
        none (the adapter travels through Ray's object store)."""
        if self.lora:
            return
        worlds = self._get([e.world_size.remote() for e in self.engines], f"world size of {self._engines_desc()}")
        ws = self.spec.weight_sync
        skip = [self.opts.skip_tensor] if self.opts.skip_tensor else None
        self._get([
            t.init_weight_sync.remote(self.engines if r == 0 else [], worlds, self.backend, ws.packed,
                                      ws.bucket_size_mb * 1024 * 1024, skip)
            for r, t in enumerate(self.trainers)
        ], f"weight-sync group init: {self._sync_desc()}")

    # -------------------------------------------------------------------------------- operations
    def sync(self) -> dict[str, float]:
        """Pause/sleep -> transfer through the weight-transfer API -> resume/wake; timings and GB/s."""
        t0 = time.perf_counter()
        if self.async_mode:
            self._get([e.pause.remote(self.opts.pause_after_tokens) for e in self.engines],
                      f"pause of {self._engines_desc()}")
        elif self.asleep:
            self._get([e.wake_up.remote(["weights"]) for e in self.engines], f"wake-up of {self._engines_desc()}")
        t1 = time.perf_counter()
        if self.lora:
            results = [self.sync_adapter()]
        else:
            results = self._get([t.sync_weights.remote() for t in self.trainers], f"weight sync: {self._sync_desc()}")
        t2 = time.perf_counter()
        if self.async_mode:
            self._get([e.resume.remote() for e in self.engines], f"resume of {self._engines_desc()}")
        elif self.asleep:
            self._get([e.wake_up.remote(["kv_cache"]) for e in self.engines], f"wake-up of {self._engines_desc()}")
            self.asleep = False
        t3 = time.perf_counter()
        r = dict(results[0])
        r.update(pause_s=t1 - t0, resume_s=t3 - t2, total_s=t3 - t0)
        r["gbps"] = r["bytes"] / r["total_s"] / 1e9 if r["total_s"] > 0 else 0.0
        r["transfer_gbps"] = r["bytes"] / r["send_s"] / 1e9 if r["send_s"] > 0 else 0.0
        return r

    def sync_adapter(self) -> dict[str, Any]:
        """(LoRA) Trainer rank 0's adapter files to every engine, through Ray's object store (the driver passes
        the object on without fetching it); each engine serves from then on with it, under a new LoRA id."""
        self.adapter_id += 1
        t = time.perf_counter()
        skip = [self.opts.skip_tensor] if self.opts.skip_tensor else None
        payload = self.trainers[0].adapter_payload.remote(skip)
        loads = self._get([e.load_adapter.remote(payload, self.adapter_id) for e in self.engines],
                          f"adapter sync: trainer rank 0 -> {self._engines_desc()}")
        wall = time.perf_counter() - t
        return {"format": "lora", "bytes": float(loads[0]["bytes"]), "full_bytes": float(self.param_bytes),
                "adapter_id": self.adapter_id, "send_s": wall, "serialize_s": loads[0]["serialize_s"],
                "write_s": max(x["write_s"] for x in loads), "load_s": max(x["load_s"] for x in loads)}

    def sleep_engines(self, next_syncs: bool) -> float:
        """Colocated: put the engines to sleep while the trainer trains. Level 2 (weights discarded, nothing
        copied to the CPU) when the next wake is followed by a full weight sync, which overwrites every
        weight anyway; level 1 (weights offloaded to CPU) otherwise, and always with LoRA (an adapter sync does
        not bring the base weights back). Returns the seconds it took."""
        t = time.perf_counter()
        full = next_syncs and not self.lora
        level = 2 if full else 1
        self._get([e.sleep.remote(level) for e in self.engines], f"sleep of {self._engines_desc()}")
        self.asleep = True
        return time.perf_counter() - t

    def launch_rollout(self, tokenizer: Any, batch: list[Any], sampling: dict[str, Any], step: int) -> Rollout:
        """Start generation for ``batch`` on the engines (round-robin DP); ``collect`` waits for it."""
        prompt_ids = [render_prompt(s, tokenizer) for s in batch]
        parts = {i: idx for i, idx in enumerate(spread(prompt_ids, len(self.engines)))}
        refs: dict[int, Any] = {}
        for i, idx in parts.items():
            if idx:
                refs[i] = self.engines[i].generate.remote([prompt_ids[k] for k in idx], sampling)
            elif self.layout.dp_group:  # every rank of a DP group must step: idle ranks get a 1-token placeholder
                refs[i] = self.engines[i].generate.remote([prompt_ids[0]], {**sampling, "n": 1, "max_tokens": 1})
        return Rollout(step, refs, {i: idx for i, idx in parts.items() if idx}, prompt_ids, batch, sampling,
                       time.perf_counter())

    def collect(self, ro: Rollout) -> list[dict[str, Any]]:
        """Every sample of ``ro``. An engine that dies mid-rollout (sync mode, independent engines) is replaced
        on its placement bundle, the weight-sync group re-created and the weights resynced, and only its part
        of the rollout runs again (on the replacement)."""
        outs: list[Any] = [None] * len(ro.prompt_ids)
        todo = dict(ro.refs)
        while todo:
            lost: list[int] = []
            errors: dict[int, BaseException] = {}
            for i, ref in todo.items():
                try:
                    res = self._get_step(ref, f"rollout of step {ro.step + 1}: engine {i}")
                except DeadlineExceeded:
                    raise
                except Exception as e:
                    if self.async_mode or self.layout.dp_group or not _actor_died(e) or not self._dead(self.engines[i], "pid"):
                        raise
                    lost.append(i)
                    errors[i] = e
                    continue
                for r, k in zip(res, ro.parts.get(i, [])):
                    outs[k] = r
            todo = {}
            if lost:
                where = f"rollout of step {ro.step + 1}"
                self.recover(engines=lost, trainers=False, where=where, error=errors[lost[0]])
                for i in lost:
                    todo[i] = self.engines[i].generate.remote([ro.prompt_ids[k] for k in ro.parts[i]], ro.sampling)
                    self.rerun_prompts += len(ro.parts[i])
        return outs
    # --------------------------------------------------------------------------------- recovery
    def _dead(self, actor: Any, probe: str) -> bool:
        """Whether ``actor`` is gone (a cheap call fails with an actor error). A busy or stopped actor that does
        not answer within ``PROBE_SECONDS`` counts as alive: that is a hang, for the deadlines to report."""
        import ray
        from ray.exceptions import GetTimeoutError

        try:
            ray.get(getattr(actor, probe).remote(), timeout=PROBE_SECONDS)
        except GetTimeoutError:
            return False
        except Exception as e:  # noqa: BLE001 - only an actor error means dead
            return _actor_died(e)
        return False

    def _kill(self, actor: Any) -> None:
        import ray

        try:
            ray.kill(actor, no_restart=True)
        except Exception as e:  # noqa: BLE001 - it is usually dead already
            log.debug("kill: %s", e)

    def recover_from(self, error: BaseException) -> None:
        """After a failed step: replace what died (engines: same bundle; trainers: all ranks, from the newest
        checkpoint), or re-raise ``error`` when nothing died (a hang, a bug) or the layout cannot be repaired
        in-run (async mode, an expert-parallel DP group)."""
        if isinstance(error, (DeadlineExceeded, ValidationError)) or self.async_mode or self.layout.dp_group:
            raise error
        where = self.watchdog.activity
        dead_trainers = [r for r, t in enumerate(self.trainers) if self._dead(t, "info")]
        dead_engines = [i for i, e in enumerate(self.engines) if self._dead(e, "pid")]
        if not dead_trainers and not dead_engines:
            raise error
        self.recover(engines=dead_engines, trainers=bool(dead_trainers), where=where, error=error)

    def recover(self, engines: list[int], trainers: bool, where: str, error: BaseException) -> None:
        """Replace dead engines (same placement bundle) and, with ``trainers``, restart every trainer rank (they
        resume from the newest checkpoint); then re-create the weight-sync group and resync. At most
        ``spec.inRunRecoveries`` per run; past that the run fails and KubeRay's backoffLimit takes over."""
        self.recoveries += 1
        limit = self.spec.in_run_recoveries
        first = str(error).strip().splitlines()[0] if str(error).strip() else ""
        cause = f"{type(error).__name__}: {first[:200]}"
        dead = ", ".join(([self._trainers_desc()] if trainers else []) + [f"engine {i}" for i in engines])
        if self.recoveries > limit:
            raise RuntimeError(
                f"{dead} died during {where}: in-run recovery limit ({limit}) reached, failing the run "
                f"(spec.backoffLimit decides on a retry): {cause}"
            ) from error
        if trainers and self.spec.checkpoint is None:
            raise RuntimeError(f"{dead} died during {where} and spec.checkpoint is not set: no state to resume "
                               f"the trainer from, failing the run: {cause}") from error
        log.warning("%s died during %s (%s): recovering (%d/%d)", dead, where, cause, self.recoveries, limit)
        t0 = time.monotonic()
        actions = []
        if trainers:
            for t in self.trainers:
                self._kill(t)
            self.trainers = []
            info = self.start_trainers()
            self.done, self.resumed = int(info["step"]), info["resumed_from"]
            self.replacements["trainers"] += 1
            actions.append(f"trainers restarted, resumed from checkpoint step {self.resumed}")
            # a restart like a retried run's (the operator shows Resuming): Starting with the resumed step
            self.reporter.report("Starting", step=self.done, resumed_from_step=self.resumed, message=(
                f"resumed from checkpoint step {self.resumed} after {dead} died during {where} "
                f"(in-run recovery {self.recoveries}/{limit})"))
        for i in engines:
            self._kill(self.engines[i])
            self.engines[i] = self._make_engine(i)
            self.replacements["engines"] += 1
        if engines:
            self._get_step([self.engines[i].ready.remote() for i in engines],
                           f"start of replacement {self._engines_desc(engines)}")
            actions.append(f"{self._engines_desc(engines)} replaced on the same placement bundle")
        self.init_sync()
        self.last_sync = self.sync()
        self.synced_at = self.done
        seconds = time.monotonic() - t0
        actions.append("weight-sync group re-created and weights resynced")
        msg = (f"recovered: {dead} died during {where} ({cause}); {'; '.join(actions)} in {seconds:.1f}s "
               f"(recovery {self.recoveries}/{limit})")
        log.warning("%s", msg)
        if trainers:  # a resume: progress is counted from it
            self.watchdog.progress()
            self.reporter.mark_progress()
        self.reporter.report("Running", step=self.done, message=msg, resumed_from_step=self.resumed, extra={
            "recovery": {"dead": dead, "where": where, "cause": cause, "seconds": seconds, "engines": engines,
                         "trainers": trainers, "resumed_from": self.resumed if trainers else None,
                         "count": self.recoveries},
            "replacements": dict(self.replacements)})
        self.record_actors()
    def validate(self, tokenizer: Any, samples: list[Any], path: str | None = None) -> dict[str, Any]:
        """Every engine's greedy tokens for the first prompts == those of a fresh engine (same shape, on the
        same GPUs) loaded from the trainer's weights, or from ``path`` (the exported model, on a volume every
        pod mounts). Engines of a DP (expert-parallel) group are compared rank by rank with a fresh DP group
        of the same size."""
        import ray

        prompts = [render_prompt(s, tokenizer) for s in samples[:VALIDATION_PROMPTS]]
        greedy = {"n": 1, "temperature": 0.0, "max_tokens": self.spec.rollout.sampling.max_tokens}
        synced = [[o["samples"][0] for o in out]
                  for out in self._get([e.generate.remote(prompts, greedy) for e in self.engines],
                                       f"validation: greedy rollout on {self._engines_desc()}")]
        ranks = list(range(len(self.engines))) if self.layout.dp_group else [0]
        dp = self._address_on(self.layout.engines[0], DP_PORTS) if self.layout.dp_group else None
        copies = self._copy_weights(ranks) if path is None else [(None, path) for _ in ranks]
        what = "the exported model" if path else "a fresh engine"
        try:
            fresh_actors: list[Any] = []
            try:
                for i, (_, where) in zip(ranks, copies):
                    fresh_actors.append(self._fresh_engine(i, where, dp))
                outs = self._get([a.generate.remote(prompts, greedy) for a in fresh_actors],
                                 f"validation: start and greedy rollout of {len(fresh_actors)} fresh engine(s)")
            finally:
                for a in fresh_actors:
                    ray.kill(a)
        finally:
            if path is None:
                self._remove_copies(copies)
        fresh = [[o["samples"][0] for o in out] for out in outs]
        # independent engines (no DP group) are all compared with the one fresh engine
        mismatched_by_engine = {
            i: [k for k, (a, b) in enumerate(zip(synced[i], fresh[i if dp else 0])) if a != b]
            for i in range(len(self.engines))
        }
        mismatched = mismatched_by_engine[0]
        bad = {i: m for i, m in mismatched_by_engine.items() if m}
        result = {"validated": not bad, "of": what, "prompts": len(prompts), "engines": len(self.engines),
                  "mismatched": mismatched, "mismatched_by_engine": bad, "synced": synced[0], "fresh": fresh[0],
                  "weights": [w for _, w in copies]}  # node-local copies, removed by now
        self.reporter._write_progress({"export_validation" if path else "validation": result})
        if bad:
            i = next(iter(bad))
            k = bad[i][0]
            f = fresh[i if dp else 0]
            raise ValidationError(
                f"weight-sync validation failed: {len(bad[i])}/{len(prompts)} prompts of engine {i} differ from "
                f"{what} ({len(bad)}/{len(self.engines)} engines differ); first: prompt {k}: synced "
                f"{synced[i][k][:16]} vs fresh {f[k][:16]}"
            )
        log.info("weight-sync validation passed: %d prompts token for token on %d engine(s) vs %s", len(prompts),
                 len(self.engines), what)
        return result

    def _copy_weights(self, ranks: list[int]) -> list[tuple[Any, str]]:
        """The trainer's current weights as a directory on the node of engine ``i`` for each ``i`` in ``ranks``
        (where its fresh twin will run): staged by trainer rank 0 on its node (every FSDP rank takes part in
        the gather), moved file by file through Ray's object store (``node_files``), the staging removed.
        Returns ``(scheduling strategy, path)`` per copy; the caller removes them (``_remove_copies``)."""

        source = self.trainers[0]
        copies: list[tuple[Any, str]] = []
        try:
            names = self._get([t.stage_weights.remote() for t in self.trainers],
                              f"validation: staging the weights on {self._trainers_desc()}")[0]
            for i in ranks:
                e = self.layout.engines[i]
                strategy = self._strategy(e.group, e.bundle)
                copies.append((strategy, node_files.copy_to(strategy, names, source.read_staged.remote,
                                                            float(self.spec.weight_sync.timeout_seconds))))
        except BaseException:
            self._remove_copies(copies)
            raise
        finally:
            try:
                self._get(source.drop_staged.remote(), "validation: removing the staged weights")
            except Exception as e:  # noqa: BLE001 - do not hide the error that got us here
                log.warning("could not remove the trainer's staged weights: %s", e)
        return copies

    @staticmethod
    def _remove_copies(copies: list[tuple[Any, str]]) -> None:
        for strategy, path in copies:
            try:
                node_files.remove(strategy, path)
            except Exception as e:  # noqa: BLE001 - keep removing the others; the pod's disk goes with the pod
                log.warning("could not remove validation weights %s: %s", path, e)

    def _fresh_engine(self, i: int, path: str, dp: tuple[str, int] | None) -> Any:
        """A fresh engine shaped like engine ``i`` (rank ``i`` of a new DP group when ``dp``) that loads
        ``path`` (a directory on engine ``i``'s node). It takes no Ray GPU of its own: TP=1 runs on engine ``i``'s GPU (its actor gets engine
        ``i``'s CUDA_VISIBLE_DEVICES explicitly); TP>1 workers take the
        ``VALIDATION_SHARE`` every bundle keeps free. Memory: what is still free on that GPU (vLLM refuses to
        start when free < gpu_memory_utilization x total)."""
        import ray

        from rlhf_runtime.infra.placement import VALIDATION_SHARE

        kw = dict(self.engine_kwargs[i], model=str(path), load_format="auto")
        for key in rc.LORA_ENGINE_KEYS:  # LoRA: a plain engine of the merged weights
            kw.pop(key, None)
        e = self.layout.engines[i]
        env = self.actor_env(e, self._dp_env(i, dp) if dp else None)
        if self.gpu:
            dev = self._get(self.engines[i].device_info.remote(), f"device info of engine {i}")
            if e.executor == "ray":
                env["VLLM_RAY_PER_WORKER_GPUS"] = str(VALIDATION_SHARE)
            elif dev.get("cuda_visible_devices"):
                env["CUDA_VISIBLE_DEVICES"] = dev["cuda_visible_devices"]
            if dev.get("total"):
                share = math.floor(dev["free"] / dev["total"] * 90) / 100
                kw["gpu_memory_utilization"] = min(kw["gpu_memory_utilization"], share)
        return ray.remote(engine_class(async_mode=False)).options(
            num_cpus=0, num_gpus=0, scheduling_strategy=self._strategy(e.group, e.bundle),
            runtime_env={"env_vars": env},
        ).remote(kw, env)

    # --------------------------------------------------------------------------------- live edits
    def refresh_spec(self) -> None:
        """Adopt live edits of the RLHFJob (``spec.algorithm.steps``, ``spec.progressDeadlineSeconds``; the
        other fields cannot change on a submitted job) and report the generation applied. Called at each step
        boundary and from the heartbeat thread; without API reporting nothing changes."""
        job = self.reporter.live_job()
        if not job:
            return
        spec = job.get("spec") or {}
        gen = (job.get("metadata") or {}).get("generation")
        steps = (spec.get("algorithm") or {}).get("steps")
        deadline = spec.get("progressDeadlineSeconds")
        if isinstance(steps, int) and steps >= 1 and steps != self.total:
            log.info("spec.algorithm.steps changed: %d -> %d (generation %s)", self.total, steps, gen)
            self.total = steps
        if isinstance(deadline, int) and deadline >= 1 and deadline != self.progress_deadline:
            log.info("spec.progressDeadlineSeconds changed: %d -> %d (generation %s)", self.progress_deadline,
                     deadline, gen)
            self.progress_deadline = deadline
        if isinstance(gen, int):
            self.reporter.observed_generation = gen

    # --------------------------------------------------------------------------------------- loop
    def run(self) -> None:
        from transformers import AutoTokenizer

        spec = self.spec
        self.watchdog.doing("loading data, tokenizer and reward")
        samples = load_samples(spec.data)
        eval_samples = load_eval_samples(spec.data)
        reward_fn = make_reward(spec.reward)
        tok_kw: dict[str, Any] = {"trust_remote_code": spec.model.trust_remote_code}
        if spec.model.revision:
            tok_kw["revision"] = spec.model.revision
        rc.check_model_path(spec.model.name)
        try:
            tokenizer = AutoTokenizer.from_pretrained(spec.model.name, **tok_kw)
        except OSError as e:
            raise OSError(f"cannot load the tokenizer of spec.model.name {spec.model.name!r}: {e}") from e
        from transformers import AutoConfig

        rc.check_model(spec, AutoConfig.from_pretrained(spec.model.name, **tok_kw).to_dict())
        rc.check_lora(spec)
        self.refresh_spec()
        self.reporter.report("Starting", message="starting Ray actors")
        self.watchdog.doing("connecting to Ray and placing actors")
        self.connect()
        self.place()
        info = self.start_trainers()
        self.done = int(info["step"])
        self.resumed = info["resumed_from"]
        msg = f"resumed from checkpoint step {self.resumed}" if self.resumed is not None else "starting engines"
        self.reporter.report("Starting", step=self.done, message=msg, resumed_from_step=self.resumed)
        self.start_roles()
        self.start_engines()
        self.record_actors()
        self.init_sync()
        sampling = rc.sampling_kwargs(spec)
        n = spec.rollout.sampling.samples_per_prompt
        self.last_sync = self.sync()  # engines start with dummy weights
        self.synced_at = self.done
        if self.validate_first_sync:
            self.watchdog.doing("weight-sync validation")
            self.validate(tokenizer, samples)
        self.reporter.report("Running", step=self.done, message=f"training: step {self.done}/{self.total}",
                             resumed_from_step=self.resumed, extra={"sync": self.last_sync})
        every = spec.weight_sync.every_n_steps
        self.pending = None
        tp: dict[str, float] = {}
        while True:
            self.refresh_spec()
            if self.done >= self.total:
                break
            try:
                tp = self.step(tokenizer, samples, reward_fn, sampling, n, every, eval_samples) or tp
            except Exception as e:  # noqa: BLE001 - recover_from re-raises what it cannot repair
                self.pending = None
                self.recover_from(e)
        self.finish(tokenizer, samples, reward_fn, eval_samples)
        self.reporter.report("Succeeded", step=self.done, throughput=tp or None,
                             message=f"completed {self.done} steps", resumed_from_step=self.resumed,
                             extra={"replacements": dict(self.replacements), "rerun_prompts": self.rerun_prompts})

    def step(self, tokenizer: Any, samples: list[Any], reward_fn: Any, sampling: dict[str, Any], n: int,
             every: int, eval_samples: list[Any] | None = None) -> dict[str, float]:
        """One training step from ``self.done``; returns its throughput."""
        a, spec = self.spec.algorithm, self.spec
        done = self.done
        t_step = time.perf_counter()
        if not self.async_mode and done - self.synced_at >= every:
            self.last_sync = self.sync()
            self.synced_at = done
        elif self.asleep:
            self._get([e.wake_up.remote(None) for e in self.engines], f"wake-up of {self._engines_desc()}")
            self.asleep = False
        if (eval_samples and done and done % spec.data.eval_every_n_steps == 0 and self.synced_at == done
                and (self.evaluation or {}).get("step") != done):
            self.evaluate(tokenizer, eval_samples, reward_fn)
        if self.pending is None:
            batch = step_batch(samples, done, a.prompts_per_step, a.seed)
            self.pending = self.launch_rollout(tokenizer, batch, sampling, done)
        ro = self.pending
        outs = self.collect(ro)
        rollout_s = time.perf_counter() - ro.t_launch
        self.pending = None
        batch, prompt_ids = ro.batch, ro.prompt_ids
        if self.async_mode and done + 1 < self.total:  # the next rollout runs while this step trains
            self.pending = self.launch_rollout(
                tokenizer, step_batch(samples, done + 1, a.prompts_per_step, a.seed), sampling, done + 1
            )
        if self.sleeps:  # free the GPU for training
            self.sleep_engines(next_syncs=not self.async_mode and done + 1 - self.synced_at >= every)

        t_prompts: list[list[int]] = []
        t_completions: list[list[int]] = []
        items: list[tuple[Any, str]] = []  # (sample, completion text) per trained sample
        tokens = 0
        swap = {"mixed_samples": 0, "tokens_before_swap": 0, "tokens_after_swap": 0}
        for s, pids, o in zip(batch, prompt_ids, outs):
            for k, comp in enumerate(o["samples"]):
                items.append((s, tokenizer.decode(comp, skip_special_tokens=True)))
                t_prompts.append(pids)
                t_completions.append(comp)
                tokens += len(comp)
                si = o.get("swap_index", [-1] * n)[k]
                if si >= 0:
                    swap["tokens_before_swap"] += si
                    swap["tokens_after_swap"] += len(comp) - si
                    swap["mixed_samples"] += int(0 < si < len(comp))
        seqs = {"prompts": t_prompts, "completions": t_completions}
        pending = self.launch_token_inputs(seqs)  # runs while the rewards are computed
        t_reward = time.perf_counter()
        rewards = self.score(items, [len(c) for c in t_completions], reward_fn, self.done + 1)
        reward_s = time.perf_counter() - t_reward
        scores = normalize(rewards, spec.reward.normalize)
        plan, role_s = self.token_inputs(pending, seqs, scores, n)
        t_train = time.perf_counter()
        train_batch: dict[str, Any] = {**seqs, "advantages": plan["advantages"]}
        for key in ("old_logprobs", "ref_logprobs"):
            if plan.get(key) is not None:
                train_batch[key] = plan[key]
        w = len(self.trainers)
        critic = self.roles.get("critic") or []
        critic_refs = [c.train.remote(self._shard({**seqs, "returns": plan["returns"], "values": plan["values"]},
                                                  r, len(critic))) for r, c in enumerate(critic)]
        stats = self._get_step([
            t.train.remote(self._shard(train_batch, r, w)) for r, t in enumerate(self.trainers)
        ], f"train step {done + 1}: {self._trainers_desc()}")[0]
        if critic_refs:
            stats.update(self._get_step(critic_refs, f"critic update of step {done + 1}")[0])
            role_s["critic_seconds"] = role_s.get("critic_seconds", 0.0) + stats.get("critic_train_s", 0.0)
        if plan.get("kl") is not None:
            stats["kl_in_reward"] = plan["kl"]
        train_s = time.perf_counter() - t_train
        done = int(stats["step"])
        if spec.checkpoint and (done % spec.checkpoint.every_n_steps == 0 or done == self.total):
            if critic:  # first: every policy checkpoint then has its critic
                self._get_step([c.save_checkpoint.remote(done) for c in critic],
                               f"critic checkpoint save at step {done}")
            self._get_step([t.save_checkpoint.remote() for t in self.trainers],
                           f"checkpoint save at step {done}: {self._trainers_desc()}")
        if self.async_mode and done < self.total and done - self.synced_at >= every:
            self.last_sync = self.sync()  # pauses the next rollout mid-request
            self.synced_at = done
        self.done = done
        out = self.spec.output
        if out and out.every_n_steps and done % out.every_n_steps == 0 and done < self.total:
            self.export(f"{out.path.rstrip('/')}/step-{done}")
        self.watchdog.progress()
        self.reporter.mark_progress()
        step_s = time.perf_counter() - t_step
        reward_mean = sum(rewards) / len(rewards)
        tp = _throughput(step_s, rollout_s, train_s, tokens, len(rewards), self.last_sync, reward_mean)
        tp.update(reward_seconds=reward_s, **role_s)
        extra: dict[str, Any] = {"train": stats, "sync": self.last_sync, "tokens": tokens,
                                 "replacements": dict(self.replacements)}
        if self.async_mode:
            extra["swap"] = swap
        log.info("step %d/%d reward %.3f rollout %.2fs train %.2fs step %.2fs", done, self.total, reward_mean,
                 rollout_s, train_s, step_s)
        self.reporter.report("Running", step=done, throughput=tp, message=f"training: step {done}/{self.total}",
                             resumed_from_step=self.resumed, extra=extra)
        return tp

    # ------------------------------------------------------------------------- rewards, roles, outputs
    @staticmethod
    def _shard(batch: dict[str, Any], r: int, w: int) -> dict[str, Any]:
        """Worker ``r`` of ``w``'s slice (every ``w``-th sample from ``r``) of each list in ``batch``."""
        return {k: v[r::w] for k, v in batch.items()}

    @staticmethod
    def _merge(parts: list[list[Any]]) -> list[Any]:
        """Inverse of ``_shard`` over all workers' results."""
        out: list[Any] = [None] * sum(len(p) for p in parts)
        for r, part in enumerate(parts):
            out[r::len(parts)] = part
        return out

    def score(self, items: list[tuple[Any, str]], lengths: list[int], reward_fn: Any, step: int) -> list[float]:
        """The combined reward of each (sample, completion text): rule or hook, reward model scorers (spread
        over them) and endpoint, weighted (``spec.reward``); not yet normalised."""
        rw = self.spec.reward
        prompts, texts = [s.prompt for s, _ in items], [t for _, t in items]
        scorers = self.roles.get("reward") or []
        refs = [a.score.remote(prompts[r::len(scorers)], texts[r::len(scorers)]) for r, a in enumerate(scorers)]
        parts: dict[str, list[float]] = {}
        weights: dict[str, float] = {}
        if reward_fn is not None:
            parts["rule"] = [float(reward_fn(s.prompt, t, s.answer, n, index=i, step=step))
                             for i, ((s, t), n) in enumerate(zip(items, lengths))]
            weights["rule"] = rw.rule_weight
        if rw.endpoint is not None:
            parts["endpoint"] = endpoint_rewards(rw.endpoint, prompts, texts, [s.answer for s, _ in items])
            weights["endpoint"] = rw.endpoint.weight
        if refs:
            parts["model"] = self._merge(self._get(refs, f"reward model scoring of step {step}"))
            weights["model"] = rw.model.weight if rw.model else 1.0
        return combine(parts, weights)

    def launch_token_inputs(self, seqs: dict[str, Any]) -> dict[str, Any] | None:
        """Start what the advantages need beyond the scores (``token_inputs`` gathers it), so that it runs
        while the rewards are computed: the policy's per-token log-probabilities (trainer ranks), the
        reference's (its actors, or the trainer's own) and the critic's values. None when nothing is needed."""
        a, spec = self.spec.algorithm, self.spec
        refs_actors = self.roles.get("reference") or []
        external_ref = bool(refs_actors) and spec.reference_active()
        if not adv_plan.needs_token_inputs(a) and not external_ref:
            return None
        w, critic = len(self.trainers), self.roles.get("critic") or []
        return {
            "trainer": [t.logprobs.remote(self._shard(seqs, r, w)) for r, t in enumerate(self.trainers)],
            "reference": [x.logprobs.remote(self._shard(seqs, r, len(refs_actors)))
                          for r, x in enumerate(refs_actors)],
            "critic": [c.values.remote(self._shard(seqs, r, len(critic))) for r, c in enumerate(critic)],
            "external_ref": external_ref,
        }

    def token_inputs(self, pending: dict[str, Any] | None, seqs: dict[str, Any], scores: list[float],
                     n: int) -> tuple[dict[str, Any], dict[str, float]]:
        """The trainer's advantages (``advantages.plan``) from the scores and what ``launch_token_inputs``
        started. Returns the plan (plus ``old_logprobs``/``ref_logprobs``/``values`` to hand on) and per-role
        seconds (each role's own compute time)."""
        a = self.spec.algorithm
        lengths = [len(c) for c in seqs["completions"]]
        role_s: dict[str, float] = {}
        if pending is None:
            return adv_plan.plan(a, scores, n, lengths), role_s
        outs = self._get_step(pending["trainer"], f"log-probabilities of the policy: {self._trainers_desc()}")
        logp = self._merge([o["logp"] for o in outs])
        ref = None
        if outs[0]["ref"] is not None:  # the reference inside the trainer: its pass is part of the trainer's
            ref = self._merge([o["ref"] for o in outs])
            role_s["reference_seconds"] = max(o["seconds"] for o in outs)
        if pending["reference"]:
            got = self._get_step(pending["reference"], f"reference log-probabilities ({len(pending['reference'])} actor(s))")
            ref = self._merge([g["logp"] for g in got])
            role_s["reference_seconds"] = max(g["seconds"] for g in got)
        values = None
        if pending["critic"]:
            got = self._get_step(pending["critic"], f"critic values ({len(pending['critic'])} worker(s))")
            values = self._merge([g["values"] for g in got])
            role_s["critic_seconds"] = max(g["seconds"] for g in got)
        plan = adv_plan.plan(a, scores, n, lengths, logp=logp, ref=ref, values=values)
        plan["old_logprobs"] = logp
        plan["ref_logprobs"] = ref if pending["external_ref"] else None
        plan["values"] = values
        return plan, role_s

    def evaluate(self, tokenizer: Any, eval_samples: list[Any], reward_fn: Any) -> dict[str, Any]:
        """Greedy answers (one each) of the synced engines to the eval prompts, scored like training samples
        (not normalised); the mean goes to ``status.eval``."""
        greedy = {"n": 1, "temperature": 0.0, "max_tokens": self.spec.rollout.sampling.max_tokens}
        self.watchdog.doing(f"evaluation at step {self.done}")
        ro = self.launch_rollout(tokenizer, eval_samples, greedy, self.done)
        outs = self.collect(ro)
        comps = [o["samples"][0] for o in outs]
        items = [(s, tokenizer.decode(c, skip_special_tokens=True)) for s, c in zip(eval_samples, comps)]
        rewards = self.score(items, [len(c) for c in comps], reward_fn, self.done)
        self.evaluation = {"reward_mean": sum(rewards) / len(rewards), "step": self.done, "prompts": len(rewards),
                           "time": now_rfc3339()}
        log.info("eval at step %d: mean reward %.4f over %d prompts", self.done, self.evaluation["reward_mean"],
                 len(rewards))
        self.reporter.report("Running", step=self.done, message=f"training: step {self.done}/{self.total}",
                             resumed_from_step=self.resumed, evaluation=self.evaluation,
                             extra={"eval": {**self.evaluation, "completions": [t for _, t in items]}})
        return self.evaluation

    def export(self, path: str) -> str:
        """The current policy in Hugging Face format at ``path`` (``Trainer.export``); ``status.output``."""
        self.watchdog.doing(f"export to {path}")
        t0 = time.perf_counter()
        self._get_step([t.export.remote(path) for t in self.trainers], f"export to {path}: {self._trainers_desc()}")
        self.output = {"path": path, "step": self.done, "time": now_rfc3339()}
        log.info("exported step %d to %s in %.1fs", self.done, path, time.perf_counter() - t0)
        self.reporter.report("Running", step=self.done, message=f"exported step {self.done} to {path}",
                             resumed_from_step=self.resumed, output=self.output)
        return path

    def finish(self, tokenizer: Any, samples: list[Any], reward_fn: Any, eval_samples: list[Any]) -> None:
        """After the last step: sync the engines to the final policy when anything reads them (evaluation,
        validation of the export or, with LoRA, of the trained adapter), evaluate, export to
        ``<output.path>/final``; with validation on, the exported directory (without an export and with LoRA: a
        fresh engine of the merged weights) must give the synced engines' greedy tokens."""
        out, validate = self.spec.output, self.validate_first_sync
        lora_check = validate and self.lora and not out  # the first validation saw the zero adapter only
        if eval_samples or (out and validate) or lora_check:
            if self.synced_at != self.done:
                self.last_sync = self.sync()
                self.synced_at = self.done
            elif self.asleep:
                self._get([e.wake_up.remote(None) for e in self.engines], f"wake-up of {self._engines_desc()}")
                self.asleep = False
        if eval_samples and (self.evaluation or {}).get("step") != self.done:
            self.evaluate(tokenizer, eval_samples, reward_fn)
        if out:
            path = self.export(f"{out.path.rstrip('/')}/final")
            if validate:
                self.watchdog.doing("validation of the exported model")
                self.validate(tokenizer, samples, path=path)
        if lora_check:
            self.watchdog.doing("weight-sync validation of the trained adapter")
            self.validate(tokenizer, samples)

    def shutdown(self) -> None:
        import ray

        if not ray.is_initialized():
            return
        from ray.util.placement_group import remove_placement_group

        for actor in self.engines + self.trainers + [a for acts in self.roles.values() for a in acts]:
            try:
                ray.kill(actor)
            except ValueError as e:  # not an actor handle any more
                log.debug("kill: %s", e)
        for pg in self.pgs:
            try:
                remove_placement_group(pg)
            except Exception as e:  # noqa: BLE001 - best effort cleanup, Ray may already be gone
                log.debug("remove placement group: %s", e)
        ray.shutdown()


def _report_bad_config(opts: Options, error: BaseException) -> int:
    """A job.json that does not parse: report Failed with the parse error into the job named (best effort) by
    the raw JSON, and to the progress file; exit status 1."""
    path = opts.config or os.environ.get(rc.CONFIG_ENV)
    msg = f"invalid job config {path}: {type(error).__name__}: {error}"[:1000]
    log.error("%s", msg)
    name, namespace, uid = rc.identity(path)
    status = None
    if opts.report and name and namespace:
        try:
            status = StatusClient(name, namespace, uid, opts.kubeconfig)
        except Exception as e:  # noqa: BLE001 - no API: the log and the exit status still say it
            log.warning("status reporting disabled: %s", e)
    elif opts.report:
        log.error("cannot report the failure: no name/namespace readable from %s", path)
    reporter = Reporter(status, None, opts.progress_file)
    try:
        reporter.report("Failed", message=msg)
    except ForeignJobError as e:
        log.error("%s", e)
    return EXIT_FAILED


def failure_message(e: BaseException) -> str:
    """The ``Failed`` message of a run that raised ``e``: an actor's own exception where Ray wrapped one
    (``RayTaskError(X)``, whose text is Ray's traceback of the actor) - what the user can act on - else ``e``."""
    seen = 0
    while type(e).__name__.startswith("RayTaskError") and isinstance(getattr(e, "cause", None), BaseException) \
            and seen < 8:
        e, seen = e.cause, seen + 1  # type: ignore[attr-defined]
    return f"{type(e).__name__}: {e}"[:1000]


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    opts = parse_args(argv)
    try:
        cfg = rc.load_config(opts.config)
    except Exception as e:  # noqa: BLE001 - any parse error is the job's failure, reported into its status
        return _report_bad_config(opts, e)
    # The pods already have spec.env (the operator renders it); a local run gets it here, before anything
    # reads it (e.g. HF_HUB_OFFLINE, read when huggingface_hub is imported; a local Ray inherits it).
    os.environ.update(rc.spec_env(cfg.spec))
    status = None
    if opts.report:
        from kubernetes.config import ConfigException

        try:
            status = StatusClient(cfg.name, cfg.namespace, cfg.uid, opts.kubeconfig)
        except ConfigException as e:  # not in a pod and no --kubeconfig: run, but report nowhere
            log.warning("status reporting disabled: %s", e)
    metrics = Metrics(cfg.name, cfg.namespace)
    if opts.metrics_port:
        metrics.serve(opts.metrics_port)
    reporter = Reporter(status, metrics, opts.progress_file)

    def on_term(signum: int, frame: Any) -> None:
        raise SystemExit(f"terminated by signal {signum}")

    signal.signal(signal.SIGTERM, on_term)
    finished = threading.Event()

    def expire(message: str) -> None:
        """The watchdog fired: report, interrupt the main thread, and end the process if it does not end."""
        log.error("%s", message)
        try:
            reporter.report("Failed", message=message)
        except Exception as e:  # noqa: BLE001 - the exit status still fails the run
            log.error("could not report the stall: %s", e)
        _thread.interrupt_main()
        if not finished.wait(WATCHDOG_GRACE_SECONDS):
            log.error("the driver did not stop within %ss of the progress deadline: exiting", WATCHDOG_GRACE_SECONDS)
            os._exit(EXIT_FAILED)

    runtime: Runtime | None = None
    watchdog = Watchdog(lambda: runtime.progress_deadline if runtime else cfg.spec.progress_deadline_seconds,
                        expire)
    runtime = Runtime(cfg, opts, reporter, watchdog)
    code = 0
    try:
        reporter.mark_progress()
        watchdog.start()
        reporter.start_heartbeat(on_beat=runtime.refresh_spec)
        runtime.run()
    except ForeignJobError as e:
        log.error("%s", e)
        code = EXIT_FAILED
    except ValidationError as e:
        log.error("%s", e)
        reporter.report("Failed", message=str(e))
        code = EXIT_VALIDATION
    except BaseException as e:  # noqa: BLE001 - report every failure, including SIGTERM, before exiting
        log.error("run failed:\n%s", traceback.format_exc())
        msg = watchdog.fired or failure_message(e)
        try:
            reporter.report("Failed", message=msg)
        except ForeignJobError:
            pass
        code = EXIT_FAILED
    finally:
        watchdog.stop()
        reporter.close()
        _bounded_shutdown(runtime, code)
        finished.set()
    return code


def _bounded_shutdown(runtime: Runtime, code: int) -> None:
    """``runtime.shutdown()``, but a Ray that does not let go (an actor stopped mid-collective) must not keep a
    finished run alive: past ``SHUTDOWN_SECONDS`` the process exits with ``code``."""
    t = threading.Thread(target=runtime.shutdown, name="rlhf-shutdown", daemon=True)
    t.start()
    t.join(SHUTDOWN_SECONDS)
    if t.is_alive():
        log.error("Ray shutdown did not finish within %ss: exiting", SHUTDOWN_SECONDS)
        logging.shutdown()
        os._exit(code)


if __name__ == "__main__":
    sys.exit(main())
