"""In-run recovery (``weightSync.mode: sync``, independent engines).

An engine actor that dies is replaced on its placement bundle, the weight-sync group is re-created with the
trainer and the weights resynced; a rollout it was generating re-runs only its part (``Experience.collect``).
A dead trainer rank restarts every rank, which resume from the newest checkpoint (rank 0 picks it for all
ranks; without ``spec.checkpoint`` the run fails). The runtime message says what happened ("recovered: engine
1 died during rollout of step 5 ..."), the progress file counts ``replacements``. At most
``spec.inRunRecoveries`` (default 3; 0 turns it off) per run; the next fault fails the run and KubeRay's
``backoffLimit`` decides on a retry. A hang (a deadline) or a failed validation is never "recovered" in-run,
nor is a fault in async mode or in an expert-parallel DP group (its ranks step together).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

from rlhf_api.models import RLHFJobSpec
from rlhf_runtime.controller.deadlines import DeadlineExceeded, Watchdog, actor_died
from rlhf_runtime.controller.job_actors import JobActors
from rlhf_runtime.controller.sync import WeightSync
from rlhf_runtime.controller.validation import ValidationError

log = logging.getLogger("rlhf_runtime")
#: How long a liveness probe of an actor may take; one that does not answer is busy or stopped, not dead.
PROBE_SECONDS = 10.0


def probe(actors: list[Any], method: str) -> list[str]:
    """Each actor's state from one cheap call each, all at once, answered within ``PROBE_SECONDS``: "dead" (an
    actor error), "busy" (no answer: busy or stopped, not dead) or "alive"."""
    import ray

    refs = [getattr(a, method).remote() for a in actors]
    if not refs:
        return []
    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=PROBE_SECONDS)
    states = []
    for ref in refs:
        if ref not in ready:
            states.append("busy")
            continue
        try:
            ray.get(ref)
            states.append("alive")
        except Exception as e:  # noqa: BLE001 - only an actor error means dead
            states.append("dead" if actor_died(e) else "alive")
    return states


def is_dead(actor: Any, method: str) -> bool:
    """Whether ``actor`` is gone. A busy or stopped actor counts as alive: that is a hang, for the deadlines."""
    return probe([actor], method)[0] == "dead"


@dataclass
class Recovered:
    """What a recovery did: the message, and with restarted trainers the step they resumed from."""

    message: str
    trainers: bool
    step: int | None  # restarted trainers: their step
    resumed_from: int | None  # restarted trainers: the checkpoint they resumed from
    record: dict[str, Any]


def cause_of(error: BaseException) -> str:
    first = str(error).strip().splitlines()[0] if str(error).strip() else ""
    return f"{type(error).__name__}: {first[:200]}"


class Recovery:
    def __init__(self, spec: RLHFJobSpec, actors: JobActors, weights: WeightSync, watchdog: Watchdog,
                 reporter: Any) -> None:
        self.spec, self.actors, self.weights, self.watchdog = spec, actors, weights, watchdog
        self.reporter = reporter
        self.count = 0

    def repairable(self) -> bool:
        return self.spec.weight_sync.mode != "async" and not self.actors.layout.dp_group

    def states(self) -> tuple[list[str], list[str]]:
        """The trainer ranks' and the engines' states (``probe``)."""
        return probe(list(self.actors.trainers), "info"), probe(list(self.actors.engines), "pid")

    def from_error(self, error: BaseException, done: int) -> Recovered:
        """After a failed step: replace what died, or re-raise ``error`` when nothing died (a hang, a bug) or
        the layout cannot be repaired in-run. After a failed weight sync, engines that do not answer are stuck in
        its collective (waiting for data that never comes: the trainer stopped sending when a peer died) and are
        replaced with the dead ones (stuck trainer ranks restart, as dead ones do): a stuck actor would never take
        the new group's setup."""
        if isinstance(error, (DeadlineExceeded, ValidationError)) or not self.repairable():
            raise error
        where = self.watchdog.activity
        trainer_states, engine_states = self.states()
        dead_engines = [i for i, s in enumerate(engine_states) if s == "dead"]
        if "dead" not in trainer_states and not dead_engines:
            raise error
        in_sync = where.startswith("weight sync")
        stuck = [i for i, s in enumerate(engine_states) if s == "busy"] if in_sync else []
        # a trainer rank stuck in the failed sync restarts with the others, as a dead one would
        trainers = "dead" in trainer_states or (in_sync and "busy" in trainer_states)
        return self.recover(dead_engines, trainers, where, error, done, stuck=stuck)

    def check(self, engines: list[int], trainers: bool, where: str, error: BaseException) -> str:
        """Count one recovery; raise when past ``spec.inRunRecoveries`` or when dead trainers cannot resume.
        Returns what died, for the messages."""
        self.count += 1
        limit, cause = self.spec.in_run_recoveries, cause_of(error)
        dead = ", ".join(([self.actors.trainers.describe()] if trainers else []) + [f"engine {i}" for i in engines])
        if self.count > limit:
            raise RuntimeError(f"{dead} died during {where}: in-run recovery limit ({limit}) reached, failing the "
                               f"run (spec.backoffLimit decides on a retry): {cause}") from error
        if trainers and self.spec.checkpoint is None:
            raise RuntimeError(f"{dead} died during {where} and spec.checkpoint is not set: no state to resume "
                               f"the trainer from, failing the run: {cause}") from error
        log.warning("%s died during %s (%s): recovering (%d/%d)", dead, where, cause, self.count, limit)
        return dead

    def recover(self, engines: list[int], trainers: bool, where: str, error: BaseException,
                done: int, stuck: list[int] | None = None) -> Recovered:
        """Replace dead engines and ``stuck`` ones (same bundle) and, with ``trainers``, restart every trainer
        rank (they resume from the newest checkpoint); then re-create the weight-sync group and resync."""
        dead = self.check(engines, trainers, where, error)
        stuck = stuck or []
        t0, actions, step, resumed = time.monotonic(), [], None, None
        if trainers:
            info = self.actors.restart_trainers()
            step, resumed = int(info["step"]), info["resumed_from"]
            actions.append(f"trainers restarted, resumed from checkpoint step {resumed}")
            # a restart like a retried run's (the operator shows Resuming): Starting with the resumed step
            self.reporter.report("Starting", step=step, resumed_from_step=resumed, message=(
                f"resumed from checkpoint step {resumed} after {dead} died during {where} "
                f"(in-run recovery {self.count}/{self.spec.in_run_recoveries})"))
        if stuck:
            log.warning("%s stuck in the failed weight sync: replacing %s too", self.actors.engines.describe(stuck),
                        "it" if len(stuck) == 1 else "them")
        if engines or stuck:
            replaced = sorted({*engines, *stuck})
            self.actors.replace_engines(replaced)
            actions.append(f"{self.actors.engines.describe(replaced)} replaced on the same placement bundle"
                           + (f" ({self.actors.engines.describe(stuck)} stuck in the failed sync)" if stuck else ""))
        self.weights.init_group()
        self.weights.sync(done if step is None else step)
        actions.append("weight-sync group re-created and weights resynced")
        limit, cause = self.spec.in_run_recoveries, cause_of(error)
        msg = (f"recovered: {dead} died during {where} ({cause}); {'; '.join(actions)} in "
               f"{time.monotonic() - t0:.1f}s (recovery {self.count}/{limit})")
        log.warning("%s", msg)
        record = {"dead": dead, "where": where, "cause": cause, "seconds": time.monotonic() - t0,
                  "engines": engines, "stuck": stuck, "trainers": trainers, "resumed_from": resumed,
                  "count": self.count}
        return Recovered(msg, trainers, step, resumed, record)
