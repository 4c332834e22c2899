"""The trainer's options: what the FSDP workers (the policy trainer, PPO's critic) and the reference models read,
resolved once by the driver from the job's spec (``TrainerOptions.resolve``) and passed whole to every actor of
the role, each with its own ``Rank``. An actor reads its options, not the spec. Frozen; imports neither torch
nor vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rlhf_api.models import Algorithm, Checkpoint, Critic, ModelSource, RLHFJobSpec
    from rlhf_api.models import Trainer as TrainerSpec


@dataclass(frozen=True)
class Rank:
    """A worker's place among its role's workers: its rank, their number and, with several, rank 0's rendezvous
    (an address on rank 0's node, handed out by the driver)."""

    rank: int = 0
    world_size: int = 1
    addr: str | None = None
    port: int | None = None


@dataclass(frozen=True)
class TrainerOptions:
    """The trainer's options (``resolve`` builds them)."""

    model: ModelSource  #: the policy model: name, revision, dtype, trustRemoteCode
    trainer: TrainerSpec  #: strategy, GPUs, precision, micro-batches, optimiser, LoRA, compile, checkpointing
    algorithm: Algorithm  #: seed, learning rate, loss, KL, epochs per step, rollout correction, PPO's settings
    checkpoint: Checkpoint | None  #: where checkpoints go and are resumed from; None: none
    critic: Critic | None  #: PPO's critic (``spec.critic`` or its defaults); None for the critic-free algorithms
    temperature: float  #: the sampling temperature the log-probabilities are taken at (unset: 1.0)
    colocated: bool  #: the engines share the GPUs (``placement.mode: colocated``): caches handed back after use
    timeout_s: float  #: ``weightSync.timeoutSeconds``: the deadline of the workers' rendezvous and collectives
    own_reference: bool  #: the KL reference inside the trainer (``reference.placement: trainer``, KL on)
    rank: Rank = field(default_factory=Rank)

    @classmethod
    def resolve(cls, spec: RLHFJobSpec, rank: Rank | None = None) -> TrainerOptions:
        """The trainer's options from the job's spec (``rank``: the worker's, default the only one). Pure."""
        return cls(model=spec.model, trainer=spec.trainer, algorithm=spec.algorithm, checkpoint=spec.checkpoint,
                   critic=spec.critic_settings(), temperature=spec.rollout.sampling.temperature or 1.0,
                   colocated=spec.placement.mode == "colocated", timeout_s=float(spec.weight_sync.timeout_seconds),
                   own_reference=spec.reference_active() and spec.reference.placement == "trainer",
                   rank=rank or Rank())

    @classmethod
    def from_config(cls, config_json: str, rank: int = 0, world_size: int = 1, addr: str | None = None,
                    port: int | None = None) -> TrainerOptions:
        """``resolve`` of a ``RuntimeConfig`` JSON (a job's config file), for scripts and tests."""
        from rlhf_api.models import RuntimeConfig

        return cls.resolve(RuntimeConfig.model_validate_json(config_json).spec, Rank(rank, world_size, addr, port))

    def at(self, rank: Rank) -> TrainerOptions:
        """The same options for the worker at ``rank``."""
        return replace(self, rank=rank)
