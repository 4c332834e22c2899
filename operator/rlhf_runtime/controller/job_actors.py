"""The job's actors: trainer ranks, engines and the roles beside them, started on their placement bundles.

* Trainers (``roles.policy.Trainer``, or ``ActorClasses.trainer``): one per ``Layout.trainers`` entry; FSDP2
  ranks meet at rank 0's node (IP and a free port found there, never the driver's head pod).
* Roles (``Layout.roles``): reward-model scorers, the critic's workers (FSDP2 over them when there are
  several; a resumed run's critic loads the step the trainer resumed from), reference workers.
* Engines (``rollout.api.engine_class`` of the job's mode, or ``ActorClasses.engine``): one per
  ``Layout.engines`` entry; an expert-parallel DP group gets vLLM's offline SPMD variables (``VLLM_DP_*``,
  master on engine 0's node) and starts together. A replacement takes the dead engine's bundle.
* Memory (colocated on GPUs): before the engines are built, the memory plan (``infra.memory``, from the trainer
  ranks' measurements) is checked: a layout whose engines do not fit beside the trainer's state after step 1 is
  refused with what to change (``rlhf_api.memory_plan.MemoryPlanError``), and where the plan says so the trainers
  keep their state in host memory during rollouts (``trainer.offloadDuringRollout``). The plan is in the progress
  file's actors record (``memory_plan``).
* Environment: the job's (``infra.config.actor_env``), the placement's, and on CPU-only jobs
  ``OMP_NUM_THREADS`` = the placement's ``threads`` (at most ``thread_cap`` in a local run) unless ``spec.env``
  sets it.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

from rlhf_api.memory_plan import MemoryPlan
from rlhf_api.models import RuntimeConfig
from rlhf_runtime.controller.actors import DP_PORTS, ActorClasses, ActorGroup, Placement
from rlhf_runtime.controller.deadlines import Deadlines
from rlhf_runtime.infra import config as rc
from rlhf_runtime.infra import memory
from rlhf_runtime.infra.placement import ActorPlacement, Layout, local_thread_cap
from rlhf_runtime.roles.options import Rank, TrainerOptions
from rlhf_runtime.rollout.api import RolloutEngine, async_engines, engine_class
from rlhf_runtime.rollout.options import EngineOptions

log = logging.getLogger("rlhf_runtime")


#: Calls one engine actor of a multi-turn job takes at once: a turn of every trajectory in flight.
ENGINE_CALLS_IN_FLIGHT = 4096


class JobActors:
    """Every actor of one run, by role (``trainers``, ``engines``, ``roles[name]``: ``ActorGroup``s)."""

    def __init__(self, cfg: RuntimeConfig, layout: Layout, deadlines: Deadlines, classes: ActorClasses | None,
                 local: bool) -> None:
        spec = cfg.spec
        self.cfg, self.spec, self.layout, self.deadlines = cfg, spec, layout, deadlines
        self.gpu = layout.gpu
        self.async_mode = spec.weight_sync.mode == "async"
        self.backend = rc.resolve_backend(spec, self.gpu)
        self.env = rc.actor_env(spec, self.gpu)
        self.trainer_options = TrainerOptions.resolve(spec)  # every trainer, critic and reference actor's, by rank
        # CPU-only jobs: each actor computes on its pod's CPUs (placement ``threads``), not on the one thread Ray
        # gives an actor, unless spec.env sets OMP_NUM_THREADS (a value, or valueFrom: then the pods have it).
        # Not the driver's own environment: Ray's job supervisor runs it with OMP_NUM_THREADS=1.
        self.own_threads = any(e.name == "OMP_NUM_THREADS" for e in spec.env or [])
        self.thread_cap = (local_thread_cap(layout, self.async_mode, len(os.sched_getaffinity(0)))
                           if local else None)
        classes = classes or ActorClasses()
        self.trainer_class = classes.trainer
        #: every engine actor serves ``rollout.api.RolloutEngine`` (``PausableEngine`` in async mode)
        # multi-turn rollouts send every trajectory's turns on their own: engines that batch concurrent calls
        self.turns = spec.environment is not None
        self.engine_class: type[RolloutEngine] = classes.engine or engine_class(async_engines(spec),
                                                                               spec.rollout.async_engine)
        self.placement = Placement(layout, cfg.name, deadlines)
        self.trainers = ActorGroup("trainer", deadlines)
        self.engines = ActorGroup("engine", deadlines)
        self.roles: dict[str, ActorGroup] = {}
        self.engine_kwargs: list[dict[str, Any]] = []
        self.dp_address: tuple[str, int] | None = None
        self.trainer_pids: list[Any] = []
        self.trainer_threads: list[Any] = []  # each trainer's torch threads (OMP_NUM_THREADS, ``actor_env``)
        self.param_bytes = 0  # the policy's full weights (Trainer.info), beside an adapter sync's bytes
        self.build_seconds: list[float] = []  # each engine's vLLM build (start_engines)
        self.trainer_start: dict[str, Any] = {}  # where the trainers' start went (start_trainers)
        self.first_asked: float | None = None  # when the driver first asked Ray for an actor of this run (``asked``)
        self.engines_asked: float | None = None  # when it asked for the engines (``create_engines``)
        self.trainers_asked: float | None = None  # when it asked for the trainers (``create_trainers``)
        self.transfer_loads: list[Any] = []  # the trainers' load_weight_transfer calls, until await_transfer
        self.replacements = {"engines": 0, "trainers": 0}
        self.memory_plan: MemoryPlan | None = None  # colocated on GPUs: the plan checked before the engines' build
        self.offload_start: dict[str, float] = {}  # the trainers' first move of their state to the host

    def actor_env(self, a: ActorPlacement, extra: dict[str, str] | None = None) -> dict[str, str]:
        """The environment of the actor placed at ``a``: the job's (``self.env``), the placement's, ``extra``,
        and on CPU-only jobs ``OMP_NUM_THREADS`` = ``a.threads`` (at most ``self.thread_cap`` in a local run)."""
        env = {**self.env, **a.env, **(extra or {})}
        if a.threads and not self.own_threads:
            env["OMP_NUM_THREADS"] = str(min(a.threads, self.thread_cap or a.threads))
        return env

    def _options(self, a: ActorPlacement, env: dict[str, str], **extra: Any) -> dict[str, Any]:
        return {"num_cpus": a.num_cpus, "num_gpus": a.num_gpus, "scheduling_strategy": self.placement.strategy(a),
                "runtime_env": {"env_vars": env}, **extra}

    def asked(self) -> float:
        """Now: the driver asks Ray for actors (``first_asked`` set the first time)."""
        now = time.time()
        self.first_asked = self.first_asked or now
        return now

    def _rendezvous(self, places: list[ActorPlacement]) -> tuple[str | None, int | None]:
        """torch.distributed rendezvous of several ranks: rank 0 listens on its own node."""
        return self.placement.address_on(places[0]) if len(places) > 1 else (None, None)

    # -------------------------------------------------------------------------------------- trainers
    def create_trainers(self) -> None:
        """Every trainer rank's actor created: each starts importing and loading at once; ``start_trainers``
        waits for them."""
        import ray

        from rlhf_runtime.roles.policy import Trainer

        cls = self.trainer_class or Trainer
        places = self.layout.trainers
        addr, port = self._rendezvous(places)
        self.trainers_asked = self.asked()
        for rank, a in enumerate(places):
            self.trainers.append(ray.remote(cls).options(**self._options(a, self.actor_env(a))).remote(
                self.trainer_options.at(Rank(rank, len(places), addr, port))))

    def start_trainers(self, defer_transfer: bool = False) -> dict[str, Any]:
        """Every trainer rank, created (``create_trainers``, unless it was) and started; returns rank 0's
        ``info`` (step, resumed_from, param_bytes, ...). Then each loads vLLM's weight-transfer modules
        (``Trainer.load_weight_transfer``), waited for here, or with ``defer_transfer`` by ``await_transfer``
        (before the weight-transfer group), so that the import runs beside what the driver starts next."""
        if not self.trainers.actors:
            self.create_trainers()
        created = self.trainers_asked or time.time()
        infos = self.trainers.call_step("info", what=f"start of {self.trainers.describe()}")
        self.trainer_pids = [i.get("pid") for i in infos]
        self.trainer_threads = [i.get("threads") for i in infos]
        self.param_bytes = int(infos[0].get("param_bytes") or 0)
        # where each rank's start went (progress file), after the driver asked for the actor (itself asked_after_s
        # after the run's first actor): its process created (Ray's worker start; negative: a process started
        # earlier), its constructor begun (the imports in between), init_seconds in it (model, shards, optimiser)
        self.trainer_start = {"asked_after_s": round(created - (self.first_asked or created), 3),
                              "spawned_after_s": [_after(i.get("spawned"), created) for i in infos],
                              "init_began_after_s": [round(float(i.get("started", created)) - created, 3)
                                                     for i in infos],
                              "init_seconds": [round(float(i.get("init_seconds") or 0), 3) for i in infos]}
        self.transfer_loads = self.trainers.submit("load_weight_transfer")
        if not defer_transfer:
            self.await_transfer()
        return infos[0]

    def await_transfer(self) -> None:
        """Wait for the trainers' ``load_weight_transfer`` (``start_trainers``); its seconds in the record."""
        if self.transfer_loads:
            seconds = self.deadlines.get_step(self.transfer_loads,
                                              f"vLLM's weight-transfer modules on {self.trainers.describe()}")
            self.trainer_start["weight_transfer_import_seconds"] = [round(float(s), 3) for s in seconds]
            self.transfer_loads = []

    def restart_trainers(self) -> dict[str, Any]:
        """Kill every trainer rank and start them again (they resume from the newest checkpoint)."""
        self.trainers.kill()
        self.trainers.actors = []
        self.replacements["trainers"] += 1
        info = self.start_trainers()
        if self.memory_plan is not None and self.memory_plan.offload:
            self.trainers.call("set_offload", True, what=f"state offload of {self.trainers.describe()}")
        return info

    # ----------------------------------------------------------------------------------------- roles
    def create_roles(self, resume_step: int | None, only: tuple[str, ...] | None = None) -> None:
        """The actors of the roles beside the policy (``Layout.roles``, or those of them in ``only``) created,
        unless they were: each starts loading at once; ``start_roles`` waits for them. The critic resumes at
        the trainer's step: it is created once that is known."""
        for role, places in self.layout.roles.items():
            if role in self.roles or (only is not None and role not in only):
                continue
            self.asked()
            group = ActorGroup(role, self.deadlines)
            addr, port = self._rendezvous(places) if role == "critic" else (None, None)
            for rank, a in enumerate(places):
                group.append(self._start_role(role, a, rank, len(places), addr, port, resume_step))
            self.roles[role] = group

    def start_roles(self, resume_step: int | None) -> dict[str, list[dict[str, Any]]]:
        """The actors of the roles beside the policy (``Layout.roles``), created (``create_roles``, unless they
        were) and started; their ``info`` by role."""
        self.create_roles(resume_step)
        if not self.roles:
            return {}
        what = f"start of {', '.join(g.describe() for g in self.roles.values())}"
        flat = self.deadlines.get_step([r for g in self.roles.values() for r in g.submit("info")], what)
        infos, at = {}, 0
        for k, g in self.roles.items():
            infos[k], at = flat[at : at + len(g)], at + len(g)
        return infos

    def _start_role(self, role: str, a: ActorPlacement, rank: int, world: int, addr: str | None,
                    port: int | None, resume_step: int | None) -> Any:
        import ray

        from rlhf_runtime.roles.critic import CriticModel
        from rlhf_runtime.roles.reference import ReferenceModel
        from rlhf_runtime.roles.reward import RewardScorer

        spec, options = self.spec, self.trainer_options
        cls = {"reward": RewardScorer, "critic": CriticModel, "reference": ReferenceModel}[role]
        actor = ray.remote(cls).options(**self._options(a, self.actor_env(a)))
        if role == "reward":
            m = spec.reward.model
            assert m is not None
            return actor.remote(m.name, m.revision, spec.model.dtype, m.batch_size, None, spec.model.trust_remote_code)
        if role == "critic":  # resumes at the trainer's step
            return actor.remote(options.at(Rank(rank, world, addr, port)), resume_step or None)
        return actor.remote(options)

    def role(self, name: str) -> ActorGroup:
        """The actors of role ``name`` (an empty group when the job has none)."""
        return self.roles.get(name) or ActorGroup(name, self.deadlines)

    # --------------------------------------------------------------------------------------- engines
    def dp_env(self, rank: int, address: tuple[str, int]) -> dict[str, str]:
        """vLLM's offline SPMD data-parallel settings for engine ``rank`` (each engine sees only its own GPUs,
        so its local DP rank is 0)."""
        return {"VLLM_DP_RANK": str(rank), "VLLM_DP_RANK_LOCAL": "0", "VLLM_DP_SIZE": str(len(self.layout.engines)),
                "VLLM_DP_MASTER_IP": address[0], "VLLM_DP_MASTER_PORT": str(address[1])}

    def make_engine(self, i: int, build: bool = True) -> Any:
        """Engine actor ``i`` on its own placement bundle (a replacement takes the same bundle); with ``build``
        False it only imports vLLM until ``build`` is called (``rollout.base``)."""
        import ray

        e = self.layout.engines[i]
        env = self.actor_env(e, self.dp_env(i, self.dp_address) if self.dp_address else None)
        concurrency = ENGINE_CALLS_IN_FLIGHT if self.turns else 16 if self.async_mode else 1
        return ray.remote(self.engine_class).options(**self._options(e, env, max_concurrency=concurrency)).remote(
            EngineOptions(self.engine_kwargs[i], env), build=build)

    def start_engines(self) -> None:
        """Every engine, created (``create_engines``, unless it was), built (unless it was) and ready; each one's
        build seconds in ``build_seconds``."""
        if not self.engines.actors:
            self.create_engines()
        self.plan_memory()
        # a DP group starts together
        self.build_seconds = self.engines.call_step("build", what=f"start of {self.engines.describe()}")

    def plan_memory(self) -> None:
        """Colocated on GPUs, once: the memory plan from the trainer ranks' measurements, checked (a
        ``MemoryPlanError`` with the numbers and what to change) before the engines are built, unless they were
        built beside the trainers (``rollout.kvCacheMemoryGiB``: then before the first sync); the trainers' state
        moved to the host where it says so."""
        if not (self.gpu and self.spec.placement.mode == "colocated") or self.memory_plan is not None:
            return
        reports = self.trainers.call("memory_report", what=f"memory report of {self.trainers.describe()}")
        p = memory.job_plan(self.spec, reports)
        if p is None:
            return
        self.memory_plan = p
        log.info("memory plan: %s", p.summary())
        p.check()
        if p.offload:
            moved = self.trainers.call("set_offload", True, what=f"state offload of {self.trainers.describe()}")
            self.offload_start = {k: round(max(float(m.get(k) or 0) for m in moved), 3) for k in moved[0]}

    def create_engines(self, build: bool = True) -> None:
        """Every engine actor created: each starts importing vLLM at once and, with ``build``, building its
        engine; ``start_engines`` builds those that did not and waits for them."""
        dp = self.placement.address_on(self.layout.engines[0], DP_PORTS) if self.layout.dp_group else None
        self.dp_address = dp
        self.engines_asked = self.asked()
        for i, e in enumerate(self.layout.engines):
            # one vLLM DP group (expert parallel): same seed on every rank, they step together
            seed = self.spec.algorithm.seed + (0 if dp else i)
            self.engine_kwargs.append(rc.engine_kwargs(self.spec, self.spec.model.name, self.backend, e.executor,
                                                       self.gpu, seed=seed))
            self.engines.append(self.make_engine(i, build))

    @property
    def engines_build_early(self) -> bool:
        """Whether engines are built beside the trainers rather than after them: always, except where they share
        GPUs with the trainers (colocated placement on GPUs) and size their KV cache from the memory vLLM measures
        as it starts (no ``rollout.kvCacheMemoryGiB``). Their processes and vLLM imports start beside the trainers
        either way."""
        shared = self.gpu and self.spec.placement.mode == "colocated"
        return not shared or self.spec.rollout.kv_cache_memory_gib is not None

    def replace_engines(self, idx: list[int]) -> None:
        """Engines ``idx`` killed and started again on their bundles; waits until they are ready."""
        for i in idx:
            self.engines.kill(i)
            self.engines[i] = self.make_engine(i)
            self.replacements["engines"] += 1
        self.deadlines.get_step(self.engines.submit("ready", ranks=idx),
                                f"start of replacement {self.engines.describe(idx)}")

    # ------------------------------------------------------------------------------------------ misc
    def record(self) -> dict[str, Any]:
        """Which process serves which actor (progress file): for people reading a run, and for fault tests; and
        where the trainers' and engines' starts went (``trainer_start``, ``engine_start``), counted from
        ``first_asked``."""
        pids = self.engines.call("pid", what=f"pid of {self.engines.describe()}")
        return {"trainers": self.trainer_pids, "engines": pids, "replacements": dict(self.replacements),
                "trainer_threads": self.trainer_threads,
                "engine_build_seconds": [round(float(b), 3) for b in self.build_seconds],
                "trainer_start": self.trainer_start, "engine_start": self.engine_start(),
                "first_asked": self.first_asked,  # the Unix time the *_start records' asked_after_s count from
                **({"memory_plan": {**self.memory_plan.record(), "offload_start": self.offload_start}}
                   if self.memory_plan is not None else {})}

    def engine_start(self) -> dict[str, Any]:
        """Where each engine's start went (``RolloutEngine.startup``), in seconds after the driver asked for the
        engines (itself ``asked_after_s`` after the run's first actor): its process created, its constructor
        begun, vLLM's imports (``import_seconds``), its engine built (None: not yet)."""
        starts = self.engines.call("startup", what=f"start-up times of {self.engines.describe()}")
        t = self.engines_asked or time.time()
        return {"asked_after_s": round(t - (self.first_asked or t), 3),
                "spawned_after_s": [_after(s.get("spawned"), t) for s in starts],
                "init_began_after_s": [_after(s.get("init_began"), t) for s in starts],
                "import_seconds": [round(float(s.get("import_seconds") or 0), 3) for s in starts],
                "built_after_s": [_after(s.get("built_at"), t) for s in starts]}

    def everyone(self) -> list[ActorGroup]:
        return [self.engines, self.trainers, *self.roles.values()]

    def shutdown(self) -> None:
        """Kill every actor and remove the placement groups."""
        for g in self.everyone():
            g.kill()
        self.placement.remove()


def _after(at: Any, origin: float) -> float | None:
    """``at`` (a Unix time, or None) as seconds after ``origin``, to the millisecond."""
    return None if at is None else round(float(at) - origin, 3)
