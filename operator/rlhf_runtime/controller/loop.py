"""The control loop: one RLHFJob from its ``RuntimeConfig``, a step as a pipeline of stages.

A step (``weightSync.mode: sync``): engines ready (a weight sync if due: every ``everyNSteps`` steps, and always
before the first rollout of a run, since engines start with dummy weights) -> rollout of ``promptsPerStep``
prompts x ``samplesPerPrompt`` samples spread over the engines -> rewards (while the roles' per-token passes
run) -> advantages -> one update of the policy (and the critic) -> checkpoint if due -> export if due ->
report. In ``async`` mode the rollout of the next step runs while the trainer trains, and the sync after the
update pauses it mid-request (``pause_generation(mode="keep")``), swaps the weights and resumes it; every sample
records how many of its tokens came before the swap. Colocated engines sleep while the trainer trains.

The parts: ``job_actors.JobActors`` (every actor, by role, as ``actors.ActorGroup``s), ``sync.WeightSync``,
``experience.Experience`` (rollout, rewards, role passes), ``recovery.Recovery``, ``validation.Validator``,
``deadlines`` (every call bounded; the watchdog). Weight sync uses the spec's backend on GPUs and the CPU
``gloo`` backend whenever the trainer has no GPUs, through the same vLLM engine calls.

Live edits: at each step boundary and from the heartbeat thread the loop reads its RLHFJob and adopts
``spec.algorithm.steps`` (the loop ends at the new total, raised or lowered) and
``spec.progressDeadlineSeconds``; ``status.runtime.observedGeneration`` is the generation applied.
"""

from __future__ import annotations

import collections
import logging
import statistics
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from rlhf_api.models import RuntimeConfig
from rlhf_runtime.algo.data import ANSWER_RULES, check_samples, step_batch
from rlhf_runtime.algo.objectives import MISMATCH_HISTORY, mismatch_spike
from rlhf_runtime.algo.rewards import normalize
from rlhf_runtime.controller.actors import ActorClasses
from rlhf_runtime.controller.agent_experience import AgentExperience, build_rollout
from rlhf_runtime.controller.deadlines import Deadlines, Watchdog
from rlhf_runtime.controller.experience import Experience, Rollout, Samples, samples
from rlhf_runtime.controller.inputs import Inputs, check_inputs, load_tokenizer
from rlhf_runtime.controller.job_actors import JobActors
from rlhf_runtime.controller.recovery import Recovered, Recovery
from rlhf_runtime.controller.sync import WeightSync
from rlhf_runtime.controller.validation import Validator
from rlhf_runtime.infra import config as rc
from rlhf_runtime.infra.placement import compute_layout
from rlhf_runtime.infra.report import now_rfc3339
from rlhf_runtime.infra.startup import Stages

log = logging.getLogger("rlhf_runtime")


def throughput(step_s: float, rollout_s: float, train_s: float, tokens: int, samples: int,
               sync: dict[str, float] | None, reward_mean: float) -> dict[str, float]:
    out = {"rollout_tokens_per_second": tokens / rollout_s if rollout_s > 0 else 0.0,
           "samples_per_second": samples / step_s if step_s > 0 else 0.0,
           "step_seconds": step_s, "rollout_seconds": rollout_s, "train_seconds": train_s,
           "reward_mean": reward_mean}
    if sync:
        out["weight_sync_seconds"] = sync["total_s"]
        out["weight_sync_gbps"] = sync["gbps"]
    return out


class Runtime:
    """One run. ``classes``: the actors' classes (``actors.ActorClasses``, the extension point for code
    outside the package); ``local``: every actor on this machine, in a Ray of its own (``num_cpus``) or, with
    ``address``, in the Ray already running at that address on this machine, instead of joining the cluster."""

    def __init__(self, cfg: RuntimeConfig, reporter: Any, watchdog: Watchdog | None = None, *,
                 local: bool = False, num_cpus: int | None = None, validate: bool = False,
                 classes: ActorClasses | None = None, address: str | None = None) -> None:
        self.cfg, self.spec, self.reporter = cfg, cfg.spec, reporter
        self.local, self.num_cpus, self.address = local or address is not None, num_cpus, address
        # without a started watchdog (unit tests) nothing fires; the deadlines still bound every call
        self.watchdog = watchdog or Watchdog(lambda: self.progress_deadline, lambda message: None)
        self.total = self.spec.algorithm.steps  # live: spec.algorithm.steps (refresh_spec)
        self.progress_deadline = self.spec.progress_deadline_seconds  # live: spec.progressDeadlineSeconds
        self.layout = compute_layout(self.spec)
        self.deadlines = Deadlines(float(self.spec.weight_sync.timeout_seconds), lambda: self.progress_deadline,
                                   self.watchdog)
        self.actors = JobActors(cfg, self.layout, self.deadlines, classes, self.local)
        self.weights = WeightSync(self.spec, self.actors.trainers, self.actors.engines, self.actors.backend,
                                  lambda: self.actors.param_bytes)
        self.experience = Experience(self.spec, self.actors, self.recover_engines)
        self.recovery = Recovery(self.spec, self.actors, self.weights, self.watchdog, reporter)
        self.validator = Validator(self.actors, self.spec.rollout.sampling.max_tokens,
                                   float(self.spec.weight_sync.timeout_seconds), reporter.write_progress)
        self.async_mode = self.spec.weight_sync.mode == "async"
        self.sleeps = rc.engines_sleep(self.spec, self.layout.gpu)
        self.validate_first_sync = rc.validation_enabled(self.spec, validate)
        self.lora = self.spec.trainer.lora is not None
        self.done = 0
        self.resumed: int | None = None
        self.pending: Rollout | None = None
        self.output: dict[str, Any] | None = None  # status.output: the newest export
        self.evaluation: dict[str, Any] | None = None  # status.eval: the newest evaluation
        self.mismatch_history: collections.deque[float] = collections.deque(maxlen=MISMATCH_HISTORY)
        self.agent: AgentExperience | None = None  # spec.environment: multi-turn rollouts (``inputs``)
        self.inputs_checked: float | None = None  # when ``inputs`` had checked the tokenizer, config and samples
        self.job: Inputs | None = None  # what every step reads (the ``inputs`` stage)
        self.checked: tuple[Any, Any, Any] | None = None  # samples, eval samples, reward (``check``)
        self.loading: Future[Any] | None = None  # the tokenizer and the model's config, loading (``check``)
        self.validation: dict[str, Any] | None = None  # the first sync's validation, when it ran (``validation``)
        self.startup = Stages(self.stages())  # the start's stages and their seconds (``run_stages``)

    # ------------------------------------------------------------------------------------------ start
    def stages(self) -> list[tuple[str, Callable[[], Any]]]:
        """The start, in order: ``check`` (the prompts, the reward and the storage before Ray: a bad input fails
        before any actor starts; the tokenizer and the model's config begin loading beside what follows),
        ``connect`` (Ray), ``placement`` (the placement groups), ``actors`` (every actor that needs nothing from
        another asked for, so that each starts importing and loading at once), ``inputs`` (the tokenizer and the
        samples checked against the model's context), ``trainers`` (started: resumed from the newest checkpoint),
        ``roles``, ``engines`` (built, beside the memory plan), ``transfer`` (the trainers' weight-transfer
        modules), ``weight_sync`` (the group and the first sync: engines start with dummy weights),
        ``validation`` (when asked)."""
        return [("check", self.check), ("connect", self.connect), ("placement", self.actors.placement.place),
                ("actors", self.create_actors), ("inputs", self.load_inputs), ("trainers", self.start_trainers),
                ("roles", self.start_roles), ("engines", self.start_engines), ("transfer", self.await_transfer),
                ("weight_sync", self.first_sync), ("validation", self.validate_start)]

    def run_stages(self, until: str | None = None) -> dict[str, float]:
        """The start's stages not run yet, through ``until`` (default: all); the seconds of each run so far. Once
        every stage ran, the progress file gets them (``startup``)."""
        finished = self.startup.finished
        seconds = self.startup.run(until)
        if self.startup.finished and not finished:
            self.reporter.write_progress({"time": time.time(), "startup": seconds})
        return seconds

    def check(self) -> None:
        self.watchdog.doing("loading data, tokenizer and reward")
        self.checked = check_inputs(self.spec)  # before Ray
        pool = ThreadPoolExecutor(1, thread_name_prefix="tokenizer")
        self.loading = pool.submit(load_tokenizer, self.spec)
        pool.shutdown(wait=False)  # its one task runs on
        self.refresh_spec()
        self.reporter.report("Starting", message="starting Ray actors")
        self.watchdog.doing("connecting to Ray and placing actors")

    def connect(self) -> None:
        import ray

        env = {"env_vars": dict(self.actors.env)}
        if self.address is not None:  # a running Ray (``ray start --head``) with the bundles' rlhf_* resources
            ray.init(address=self.address, runtime_env=env, log_to_driver=True)
            return
        if not self.local:
            try:
                ray.init(address="auto", runtime_env=env, log_to_driver=True)
                return
            except ConnectionError:
                log.warning("no Ray cluster reachable: starting a local one")
        resources = {k: v for k, v in self.layout.totals().items() if k.startswith("rlhf_")}
        # bundles ask for no CPUs (placement.py); one per actor keeps Ray's worker pool warm
        cpus = self.num_cpus or len(self.layout.trainers) + len(self.layout.engines) + 1
        # address="local": a new Ray even where one already runs on this machine (plain ray.init() would join it)
        ray.init(address="local", num_cpus=cpus, resources=resources, runtime_env=env, include_dashboard=False)

    def create_actors(self) -> None:
        """Every actor that needs nothing from another asked for, so that each starts importing and loading at
        once: the roles beside the policy that do not resume (reward, reference), the engines (built now where
        they can be: ``JobActors.engines_build_early``) and the trainer ranks."""
        self.actors.create_roles(None, only=("reward", "reference"))
        self.actors.create_engines(build=self.actors.engines_build_early)
        self.actors.create_trainers()

    def load_inputs(self) -> None:
        """The tokenizer and the model's config (``load_tokenizer``: seconds of imports, loaded while Ray started
        and the actors began theirs; engines and trainers are independent until the first sync), the
        multi-turn rollout (``spec.environment``) and the samples checked, before the driver waits for any actor."""
        assert self.loading is not None and self.checked is not None, "the check stage runs first"
        self.watchdog.doing("loading the tokenizer and the model's config")
        tok, context = self.loading.result()
        samples, eval_samples, reward_fn = self.checked
        if self.spec.environment is not None:  # its template, parser, tools and environment checked now
            self.agent = AgentExperience(build_rollout(self.cfg, tok, self.actors.engines, context,
                                                       rc.sampling_kwargs(self.spec)), self.deadlines,
                                         self.spec.weight_sync)
        samples = self.check_samples(samples, tok, context)
        self.inputs_checked = time.time()
        self.job = Inputs(tok, samples, eval_samples, reward_fn, rc.sampling_kwargs(self.spec),
                          self.spec.rollout.sampling.samples_per_prompt)

    def check_samples(self, samples: Any, tokenizer: Any, context: int | None) -> Any:
        """``data.check_samples`` before the first step: the samples the run can take (``data.invalidSamples``),
        reported as ``status.data``."""
        spec = self.spec
        self.watchdog.doing(f"checking {len(samples)} samples against the engines' context")
        needs_answer = spec.reward.rule in ANSWER_RULES and spec.reward.target is None
        kept, self.reporter.data = check_samples(samples, tokenizer, context, spec.rollout.sampling.max_tokens,
                                                 needs_answer, spec.data.invalid_samples)
        if self.reporter.data.get("dropped"):
            log.warning("%s", self.reporter.data["message"])
        return kept

    def start_trainers(self) -> None:
        """Every trainer rank started (resuming from the newest checkpoint); their vLLM imports beside the engines'
        start (``transfer``)."""
        info = self.actors.start_trainers(defer_transfer=True)
        self.done, self.resumed = int(info["step"]), info["resumed_from"]
        msg = f"resumed from checkpoint step {self.resumed}" if self.resumed is not None else "starting engines"
        self.reporter.report("Starting", step=self.done, message=msg, resumed_from_step=self.resumed)

    def start_roles(self) -> None:
        roles = self.actors.start_roles(self.done)
        if roles:
            self.reporter.write_progress({"time": time.time(), "roles": roles})

    def start_engines(self) -> None:
        self.actors.start_engines()
        plan = self.actors.memory_plan
        if plan is not None:  # status.memory: what the engines were sized beside
            self.reporter.report("Starting", step=self.done, message=f"memory plan: {plan.summary()}",
                                 memory=plan.status())

    def await_transfer(self) -> None:
        self.actors.await_transfer()
        self.record_actors()

    def first_sync(self) -> None:
        """The weight-transfer group (unless one was made before this stage) and the first sync (dummy weights)."""
        if self.weights.options is None:
            self.weights.init_group()
        self.weights.sync(self.done)

    def validate_start(self) -> None:
        if self.validate_first_sync:
            assert self.job is not None
            self.watchdog.doing("weight-sync validation")
            self.validation = self.validator.validate(self.job.tokenizer, self.job.samples)

    def record_actors(self) -> None:
        """``JobActors.record``, and when the driver had checked the tokenizer, the model's config and the samples
        (``inputs``), in seconds after the run's first actor was asked for; how long Ray's connect (or local
        start) and the placement groups took before it (``ray_connect_seconds``, ``placement_seconds``)."""
        rec, took = self.actors.record(), self.startup.seconds
        rec.update({k: took[s] for s, k in (("connect", "ray_connect_seconds"), ("placement", "placement_seconds"))
                    if s in took})
        first = rec.get("first_asked")
        if first is not None and self.inputs_checked is not None:
            rec["inputs_checked_after_s"] = round(self.inputs_checked - first, 3)
        self.reporter.write_progress({"time": time.time(), "actors": rec})

    # ------------------------------------------------------------------------------------------- run
    def run(self) -> None:
        self.run_stages()
        job = self.job
        assert job is not None
        self.watchdog.doing("starting the trackers (spec.tracking)")
        self.reporter.start_tracking(self.cfg.spec.wire(), self.done)
        self.reporter.report("Running", step=self.done, message=f"training: step {self.done}/{self.total}",
                             resumed_from_step=self.resumed, extra={"sync": self.weights.last})
        tp: dict[str, float] = {}
        while True:
            self.refresh_spec()
            if self.done >= self.total:
                break
            try:
                tp = self.step(job) or tp
            except Exception as e:  # noqa: BLE001 - recovery re-raises what it cannot repair
                self.pending = None
                self.after_recovery(self.recovery.from_error(e, self.done))
        self.finish(job)
        self.reporter.report("Succeeded", step=self.done, throughput=tp or None,
                             message=f"completed {self.done} steps", resumed_from_step=self.resumed,
                             extra={"replacements": dict(self.actors.replacements),
                                    "rerun_prompts": self.experience.rerun_prompts})

    def step(self, job: Inputs) -> dict[str, float]:
        """One training step from ``self.done``, stage by stage; returns its throughput."""
        done, t_step = self.done, time.perf_counter()
        self.engines_ready(done)
        fresh = not self.async_mode and self.weights.synced_at == done  # this rollout samples just-synced weights
        self.maybe_evaluate(job, done)
        batch, rollout_s = self.rollout(job, done)
        if self.sleeps:  # free the GPU for training
            self.weights.sleep(next_syncs=not self.async_mode and self.weights.due(done + 1))
        passes = self.experience.launch_token_inputs(batch.seqs())  # runs while the rewards are computed
        t_reward = time.perf_counter()
        rewards = self.experience.score(batch.items, batch.lengths(), job.reward_fn, done + 1, batch)
        reward_s = time.perf_counter() - t_reward
        scores = normalize(rewards, self.spec.reward.normalize)
        plan, role_s = self.experience.token_inputs(passes, batch.seqs(), scores, job.n)
        t_train = time.perf_counter()
        stats = self.update(batch, plan, role_s, done)
        train_s = time.perf_counter() - t_train
        done = int(stats["step"])
        self.checkpoint(done)
        if self.async_mode and done < self.total and self.weights.due(done):
            self.weights.sync(done)  # pauses the next rollout mid-request
        self.done = done
        self.maybe_export(done)
        self.watchdog.progress()
        self.reporter.mark_progress()
        tp = throughput(time.perf_counter() - t_step, rollout_s, train_s, batch.tokens, len(rewards),
                        self.weights.last, sum(rewards) / len(rewards))
        tp.update(reward_seconds=reward_s, **role_s)
        tp.update({k: stats[k] for k in ("train_tokens_per_second_per_gpu", "mfu", "mismatch_kl") if k in stats})
        lengths = batch.lengths()
        stats.update(response_length_mean=sum(lengths) / len(lengths), response_length_max=max(lengths),
                     response_clipped_fraction=sum(n >= self.spec.rollout.sampling.max_tokens for n in lengths)
                     / len(lengths), reward_std=statistics.pstdev(rewards),
                     learning_rate=self.spec.algorithm.learning_rate)
        rows = [{"prompt": s.prompt, "completion": text, "reward": r} for (s, text), r in zip(batch.items, rewards)] \
            if self.reporter.wants_samples(done) else None
        if self.agent is not None:
            stats.update(self.agent.stats())
        self.report_step(tp, stats, batch, self.mismatch_warning(stats, fresh, done), rows)
        return tp

    def mismatch_warning(self, stats: dict[str, Any], fresh: bool, done: int) -> str | None:
        """``objectives.mismatch_spike`` for a step whose rollout followed a sync; the value joins the history."""
        value = stats.get("mismatch_kl")
        if value is None:
            return None
        warning = mismatch_spike(self.mismatch_history, value, done) if fresh else None
        self.mismatch_history.append(value)
        if warning:
            log.warning("%s", warning)
        return warning

    # ---------------------------------------------------------------------------------------- stages
    def engines_ready(self, done: int) -> None:
        """Sync mode: the weights of step ``done`` reach the engines when a sync is due; else they wake."""
        if not self.async_mode and self.weights.due(done):
            self.weights.sync(done)
        else:
            self.weights.wake()

    def rollout(self, job: Inputs, done: int) -> tuple[Samples, float]:
        """The step's samples and the rollout's seconds (async mode: launched during the last step, and the next
        one launched now; ``spec.environment``: multi-turn trajectories)."""
        if self.agent is not None:  # in async mode of a rollout that runs across steps (AgentExperience)
            a = self.spec.algorithm
            return self.agent.rollout_step(lambda step: step_batch(job.samples, step, a.prompts_per_step, a.seed),
                                           job.n, done, self.total, lambda: self.weights.synced_at)
        ro = self.pending or self.launch(job, done)
        outs = self.experience.collect(ro)
        rollout_s = time.perf_counter() - ro.t_launch
        self.pending = self.launch(job, done + 1) if self.async_mode and done + 1 < self.total else None
        return samples(ro, outs, job.tokenizer, job.n), rollout_s

    def launch(self, job: Inputs, step: int) -> Rollout:
        batch = step_batch(job.samples, step, self.spec.algorithm.prompts_per_step, self.spec.algorithm.seed)
        return self.experience.launch(job.tokenizer, batch, job.sampling, step)

    def update(self, batch: Samples, plan: dict[str, Any], role_s: dict[str, float], done: int) -> dict[str, Any]:
        """One update of the policy (every trainer rank on its shard) and, for PPO, of the critic."""
        seqs, trainers, critic = batch.seqs(), self.actors.trainers, self.actors.role("critic")
        train_batch: dict[str, Any] = {**seqs, "advantages": plan["advantages"]}
        for key in ("old_logprobs", "ref_logprobs"):
            if plan.get(key) is not None:
                train_batch[key] = plan[key]
        if batch.logprobs is not None:
            train_batch["rollout_logprobs"] = batch.logprobs
        critic_refs = critic.submit_shards("train", {**seqs, "returns": plan["returns"], "values": plan["values"]}
                                           ) if len(critic) else []
        stats = self.deadlines.get_step(trainers.submit_shards("train", train_batch),
                                        f"train step {done + 1}: {trainers.describe()}")[0]
        if critic_refs:
            stats.update(self.deadlines.get_step(critic_refs, f"critic update of step {done + 1}")[0])
            role_s["critic_seconds"] = role_s.get("critic_seconds", 0.0) + stats.get("critic_train_s", 0.0)
        if plan.get("kl") is not None:
            stats["kl_in_reward"] = plan["kl"]
        return stats

    def checkpoint(self, done: int) -> None:
        """Every ``checkpoint.everyNSteps`` steps and at the last: the critic first (so that every policy
        checkpoint has its critic), then the policy."""
        c, critic, trainers = self.spec.checkpoint, self.actors.role("critic"), self.actors.trainers
        if c is None or (done % c.every_n_steps and done != self.total):
            return
        if len(critic):
            critic.call_step("save_checkpoint", done, what=f"critic checkpoint save at step {done}")
        trainers.call_step("save_checkpoint", what=f"checkpoint save at step {done}: {trainers.describe()}")

    def maybe_export(self, done: int) -> None:
        out = self.spec.output
        if out and out.every_n_steps and done % out.every_n_steps == 0 and done < self.total:
            self.export(f"{out.location.rstrip('/')}/step-{done}")

    def maybe_evaluate(self, job: Inputs, done: int) -> None:
        due = done % self.spec.data.eval_every_n_steps == 0 if done else self.spec.data.eval_on_start
        if job.eval_samples and due and self.weights.synced_at == done != (self.evaluation or {}).get("step"):
            self.evaluate(job)

    def report_step(self, tp: dict[str, float], stats: dict[str, Any], batch: Samples, warning: str | None,
                    rows: list[dict[str, Any]] | None = None) -> None:
        extra: dict[str, Any] = {"train": stats, "sync": self.weights.last, "tokens": batch.tokens,
                                 "replacements": dict(self.actors.replacements),
                                 "rerun_prompts": self.experience.rerun_prompts}
        if self.async_mode:
            extra["swap"] = batch.swap
        if self.agent is not None:  # the whole count (status.agent: its summary)
            extra["agent_rollout"] = self.agent.last
        log.info("step %d/%d reward %.3f rollout %.2fs train %.2fs step %.2fs", self.done, self.total,
                 tp["reward_mean"], tp["rollout_seconds"], tp["train_seconds"], tp["step_seconds"])
        self.reporter.report("Running", step=self.done, throughput=tp, message=f"training: step {self.done}/"
                             f"{self.total}", resumed_from_step=self.resumed, extra=extra, warning=warning,
                             samples=rows, agent=self.agent.status(self.done) if self.agent is not None else None)

    # -------------------------------------------------------------------------------------- recovery
    def recover_engines(self, engines: list[int], where: str, error: BaseException) -> None:
        """A rollout lost engines ``engines``: replace them (``Recovery``), then go on."""
        self.after_recovery(self.recovery.recover(engines, False, where, error, self.done))

    def after_recovery(self, r: Recovered) -> None:
        if r.trainers:  # a resume: progress is counted from it
            self.done, self.resumed = int(r.step or 0), r.resumed_from
            self.watchdog.progress()
            self.reporter.mark_progress()
        self.reporter.report("Running", step=self.done, message=r.message, resumed_from_step=self.resumed,
                             extra={"recovery": r.record, "replacements": dict(self.actors.replacements)})
        self.record_actors()

    # ---------------------------------------------------------------------------------- evaluation, end
    def evaluate(self, job: Inputs) -> dict[str, Any]:
        """Greedy answers (one each) of the synced engines to the eval prompts, scored like training samples
        (not normalised); the mean goes to ``status.eval``."""
        greedy = {"n": 1, "temperature": 0.0, "max_tokens": self.spec.rollout.sampling.max_tokens}
        self.watchdog.doing(f"evaluation at step {self.done}")
        if self.agent is not None:  # multi-turn: one greedy trajectory per prompt
            batch, _ = self.agent.samples(job.eval_samples, 1, self.done, {**job.sampling, **greedy})
            items, comps = batch.items, batch.completions
        else:
            ro = self.experience.launch(job.tokenizer, job.eval_samples, greedy, self.done)
            comps = [o["samples"][0] for o in self.experience.collect(ro)]
            items = [(s, job.tokenizer.decode(c, skip_special_tokens=True)) for s, c in zip(job.eval_samples, comps)]
            batch = None
        rewards = self.experience.score(items, [len(c) for c in comps], job.reward_fn, self.done, batch)
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
        t0, trainers = time.perf_counter(), self.actors.trainers
        trainers.call_step("export", path, what=f"export to {path}: {trainers.describe()}")
        self.output = {"path": path, "step": self.done, "time": now_rfc3339()}
        log.info("exported step %d to %s in %.1fs", self.done, path, time.perf_counter() - t0)
        self.reporter.report("Running", step=self.done, message=f"exported step {self.done} to {path}",
                             resumed_from_step=self.resumed, output=self.output)
        return path

    def finish(self, job: Inputs) -> None:
        """After the last step: sync the engines to the final policy when anything reads them (evaluation,
        validation of the export or, with LoRA, of the trained adapter), evaluate, export to
        ``<output.path>/final``; with validation on, the exported directory (without an export and with LoRA: a
        fresh engine of the merged weights) must give the synced engines' greedy tokens."""
        out, validate = self.spec.output, self.validate_first_sync
        lora_check = validate and self.lora and not out  # the first validation saw the zero adapter only
        if job.eval_samples or (out and validate) or lora_check:
            self.weights.ready(self.done)
        if job.eval_samples and (self.evaluation or {}).get("step") != self.done:
            self.evaluate(job)
        if out:
            path = self.export(f"{out.location.rstrip('/')}/final")
            if validate:
                self.watchdog.doing("validation of the exported model")
                # an object-store export is not on the engines' disks: a fresh engine of the weights it was made of
                self.validator.validate(job.tokenizer, job.samples, path=None if out.uri else path)
        if lora_check:
            self.watchdog.doing("weight-sync validation of the trained adapter")
            self.validator.validate(job.tokenizer, job.samples)

    # ------------------------------------------------------------------------------------ live edits
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

    def shutdown(self) -> None:
        import ray

        if not ray.is_initialized():
            return
        self.actors.shutdown()
        ray.shutdown()
