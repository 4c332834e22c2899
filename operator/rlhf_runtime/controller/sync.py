"""Weight-sync coordination: when the engines get the trainer's weights, and what happens around a transfer.

* ``init_group``: (re-)create the weight-transfer group trainer rank 0 <-> every engine (after a replacement
  too) with the sync's options (``weight_sync.options.resolve``: the spec's ``weightSync`` and the layout,
  resolved here once and passed whole to every trainer rank, which takes part: FSDP2 gathers). LoRA: none (the
  adapter travels through Ray's object store).
* ``sync``: pause (async mode: ``pause_generation(mode="keep")``) or wake the weights (colocated engines that
  sleep) -> transfer through vLLM's weight-transfer API (``Trainer.sync_weights``), or the adapter
  (``sync_adapter``) -> resume or wake the KV cache; timings and GB/s. The trainer's sender does the transfer
  itself (``weight_sync``): the driver only starts it on every rank.
* ``sync_adapter`` (LoRA): trainer rank 0's adapter files to every engine through Ray's object store (the
  driver passes the object on without fetching it); each engine serves from then on with it, under a new
  LoRA id. The result says ``format: lora``, the adapter's ``bytes`` and the policy's ``full_bytes``.
* ``sleep``: colocated engines sleep while the trainer trains. Level 2 (weights discarded, nothing copied to
  the CPU) when the next wake is followed by a full weight sync, which overwrites every weight anyway; level 1
  (weights offloaded to CPU) otherwise, and always with LoRA (an adapter sync does not bring the base weights
  back). ``wake`` brings them back without a sync.
* ``due(done)``: a sync is due every ``weightSync.everyNSteps`` steps (and before the first rollout of a run:
  engines start with dummy weights).
"""

from __future__ import annotations

import time
from typing import Any

from rlhf_api.models import RLHFJobSpec
from rlhf_api.models import WeightSync as WeightSyncSpec
from rlhf_runtime.controller.actors import ActorGroup
from rlhf_runtime.rollout.api import async_engines
from rlhf_runtime.weight_sync.options import WeightSyncOptions, resolve


class WeightSync:
    def __init__(self, spec: RLHFJobSpec, trainers: ActorGroup, engines: ActorGroup, backend: str,
                 param_bytes: Any) -> None:
        self.spec, self.trainers, self.engines, self.backend = spec, trainers, engines, backend
        self.param_bytes = param_bytes  # () -> the policy's full weights in bytes (beside an adapter's)
        self.async_mode = spec.weight_sync.mode == "async"
        self.lora = spec.trainer.lora is not None
        self.every = spec.weight_sync.every_n_steps
        self.asleep = False  # colocated engines sleep while the trainer trains
        self.adapter_id = 0  # the engines' vLLM LoRA id: one more per adapter sync
        self.synced_at = 0  # the training step the engines' weights are from
        self.last: dict[str, float] | None = None  # the newest sync's result
        self.options: WeightSyncOptions | None = None  # the group's (``init_group``)
        self.in_use: dict[str, Any] = {}  # what trainer rank 0's sender uses (``TrainerEngineSender.describe``)

    def _desc(self) -> str:
        return f"trainer rank 0 -> {self.engines.describe()}"

    def due(self, done: int) -> bool:
        """Whether the engines need the weights of step ``done`` before its rollout."""
        return done - self.synced_at >= self.every

    def _worlds(self) -> list[int]:
        return self.engines.call("world_size", what=f"world size of {self.engines.describe()}")

    def resolve(self, weight_sync: WeightSyncSpec | None = None, worlds: list[int] | None = None
                ) -> WeightSyncOptions:
        """The sync's options from ``weight_sync`` (default: the spec's ``weightSync``; benchmarks pass another
        to compare) and this job's layout (``weight_sync.options.resolve``)."""
        return resolve(weight_sync or self.spec.weight_sync, backend=self.backend,
                       engine_worlds=self._worlds() if worlds is None else worlds, trainer_world=len(self.trainers),
                       async_engines=async_engines(self.spec))

    def init_group(self, options: WeightSyncOptions | None = None) -> dict[str, Any]:
        """(Re-)create the weight-transfer group trainer rank 0 <-> every engine, with ``options`` (default:
        ``resolve()``); returns what trainer rank 0's sender uses."""
        if self.lora:
            return {}
        worlds = self._worlds()
        options = options or self.resolve(worlds=worlds)
        args = [(list(self.engines) if r == 0 else [], worlds, options) for r in range(len(self.trainers))]
        in_use = self.trainers.deadlines.get(self.trainers.submit_each("init_weight_sync", args),
                                             f"weight-sync group init: {self._desc()}")
        self.options, self.in_use = options, in_use[0]
        return self.in_use

    def sync(self, step: int) -> dict[str, float]:
        """The weights of training step ``step`` to every engine; the result (also ``self.last``)."""
        t0 = time.perf_counter()
        if self.async_mode:
            self.engines.call("pause", what=f"pause of {self.engines.describe()}")
        elif self.asleep:
            self.engines.call("wake_up", ["weights"], what=f"wake-up of {self.engines.describe()}")
        t1 = time.perf_counter()
        if self.lora:
            results = [self.sync_adapter()]
        else:
            results = self.trainers.call("sync_weights", what=f"weight sync: {self._desc()}")
        t2 = time.perf_counter()
        if self.async_mode:
            self.engines.call("resume", what=f"resume of {self.engines.describe()}")
        elif self.asleep:
            self.engines.call("wake_up", ["kv_cache"], what=f"wake-up of {self.engines.describe()}")
            self.asleep = False
        t3 = time.perf_counter()
        r = dict(results[0])
        r.update(pause_s=t1 - t0, resume_s=t3 - t2, total_s=t3 - t0)
        r["gbps"] = r["bytes"] / r["total_s"] / 1e9 if r["total_s"] > 0 else 0.0
        r["transfer_gbps"] = r["bytes"] / r["send_s"] / 1e9 if r["send_s"] > 0 else 0.0
        self.last, self.synced_at = r, step
        return r

    def sync_adapter(self) -> dict[str, Any]:
        """(LoRA) Trainer rank 0's adapter files to every engine, through Ray's object store."""
        self.adapter_id += 1
        t = time.perf_counter()
        payload = self.trainers[0].adapter_payload.remote()
        loads = self.engines.call("load_adapter", payload, self.adapter_id,
                                  what=f"adapter sync: trainer rank 0 -> {self.engines.describe()}")
        wall = time.perf_counter() - t
        return {"format": "lora", "bytes": float(loads[0]["bytes"]), "full_bytes": float(self.param_bytes()),
                "adapter_id": self.adapter_id, "send_s": wall, "serialize_s": loads[0]["serialize_s"],
                "write_s": max(x["write_s"] for x in loads), "load_s": max(x["load_s"] for x in loads)}

    def sleep(self, next_syncs: bool) -> float:
        """Colocated: the engines sleep while the trainer trains; returns the seconds it took."""
        t = time.perf_counter()
        level = 2 if next_syncs and not self.lora else 1
        self.engines.call("sleep", level, what=f"sleep of {self.engines.describe()}")
        self.asleep = True
        return time.perf_counter() - t

    def wake(self) -> None:
        """Sleeping engines wake (weights and KV cache) without a sync."""
        if self.asleep:
            self.engines.call("wake_up", None, what=f"wake-up of {self.engines.describe()}")
            self.asleep = False

    def ready(self, done: int) -> None:
        """The engines hold the weights of step ``done`` and are awake: a sync when one is outstanding."""
        if self.synced_at != done:
            self.sync(done)
        else:
            self.wake()
