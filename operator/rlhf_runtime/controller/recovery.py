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


def is_dead(actor: Any, probe: str) -> bool:
    """Whether ``actor`` is gone (a cheap call fails with an actor error). A busy or stopped actor that does
    not answer within ``PROBE_SECONDS`` counts as alive: that is a hang, for the deadlines to report."""
    import ray
    from ray.exceptions import GetTimeoutError

    try:
        ray.get(getattr(actor, probe).remote(), timeout=PROBE_SECONDS)
    except GetTimeoutError:
        return False
    except Exception as e:  # noqa: BLE001 - only an actor error means dead
        return actor_died(e)
    return False


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

    def dead(self) -> tuple[list[int], list[int]]:
        """The trainer ranks and engines that are gone."""
        return ([r for r, t in enumerate(self.actors.trainers) if is_dead(t, "info")],
                [i for i, e in enumerate(self.actors.engines) if is_dead(e, "pid")])

    def from_error(self, error: BaseException, done: int) -> Recovered:
        """After a failed step: replace what died, or re-raise ``error`` when nothing died (a hang, a bug) or
        the layout cannot be repaired in-run."""
        if isinstance(error, (DeadlineExceeded, ValidationError)) or not self.repairable():
            raise error
        where = self.watchdog.activity
        dead_trainers, dead_engines = self.dead()
        if not dead_trainers and not dead_engines:
            raise error
        return self.recover(dead_engines, bool(dead_trainers), where, error, done)

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
                done: int) -> Recovered:
        """Replace dead engines (same bundle) and, with ``trainers``, restart every trainer rank (they resume
        from the newest checkpoint); then re-create the weight-sync group and resync."""
        dead = self.check(engines, trainers, where, error)
        t0, actions, step, resumed = time.monotonic(), [], None, None
        if trainers:
            info = self.actors.restart_trainers()
            step, resumed = int(info["step"]), info["resumed_from"]
            actions.append(f"trainers restarted, resumed from checkpoint step {resumed}")
            # a restart like a retried run's (the operator shows Resuming): Starting with the resumed step
            self.reporter.report("Starting", step=step, resumed_from_step=resumed, message=(
                f"resumed from checkpoint step {resumed} after {dead} died during {where} "
                f"(in-run recovery {self.count}/{self.spec.in_run_recoveries})"))
        if engines:
            self.actors.replace_engines(engines)
            actions.append(f"{self.actors.engines.describe(engines)} replaced on the same placement bundle")
        self.weights.init_group()
        self.weights.sync(done if step is None else step)
        actions.append("weight-sync group re-created and weights resynced")
        limit, cause = self.spec.in_run_recoveries, cause_of(error)
        msg = (f"recovered: {dead} died during {where} ({cause}); {'; '.join(actions)} in "
               f"{time.monotonic() - t0:.1f}s (recovery {self.count}/{limit})")
        log.warning("%s", msg)
        record = {"dead": dead, "where": where, "cause": cause, "seconds": time.monotonic() - t0,
                  "engines": engines, "trainers": trainers, "resumed_from": resumed, "count": self.count}
        return Recovered(msg, trainers, step, resumed, record)
