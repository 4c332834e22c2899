"""PPO's critic (value model) in Ray actors of its own: one ``CriticModel`` actor per critic worker.

Where they run is ``placement.Layout.roles``: on the trainer's GPUs (colocated: one actor beside each trainer
worker) or in a worker group of their own. Several critic workers shard it with FSDP2, like the trainer
(``roles.base.FSDPWorker``: process group, sharding, optimiser, training step and checkpoint layout).

* Model: the policy's architecture (or ``spec.critic.model``) with a one-output token head
  (``AutoModelForTokenClassification``, ``num_labels=1``). Its value for completion token ``t`` is the head's
  output at position ``t - 1``: the value of the state the token was generated from. Batches and per-token lists
  are ``roles.batches``'.
* ``train`` takes PPO's clipped value loss (``algo.objectives.value_loss``) against the returns, ``epochsPerStep``
  passes, its own AdamW at ``algorithm.ppo.criticLearningRate``; its torch seed is ``algorithm.seed + 1``.
* With ``spec.checkpoint`` it is checkpointed beside the policy, under ``<checkpoint.path>/critic`` with the same
  crash-safe layout (``rlhf_runtime.infra.checkpoint``), at the trainer's steps; a resumed run's critic loads the
  step the trainer resumed from (the critic is saved first, so that step always has one), or starts afresh with a
  warning when it is missing.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from rlhf_api.models import Critic
from rlhf_runtime.algo.objectives import value_loss
from rlhf_runtime.infra import checkpoint as ckpt
from rlhf_runtime.infra import storage
from rlhf_runtime.roles import attention
from rlhf_runtime.roles.base import (
    FSDPWorker,
    MicroBatch,
    load_kwargs,
    release_cached_gpu_memory,
)
from rlhf_runtime.roles.batches import Packed, from_lists, put
from rlhf_runtime.roles.optim_state import read_optimizer_state
from rlhf_runtime.roles.options import TrainerOptions

log = logging.getLogger("rlhf_runtime")


class CriticModel(FSDPWorker):
    """PPO's value model; one actor per critic worker (FSDP2 over all of them when there are several)."""

    seed_offset = 1
    loss_stats = ("value_loss", "value_clip_fraction")
    grad_norm_stat = "critic_grad_norm"

    def __init__(self, options: TrainerOptions, resume_step: int | None = None) -> None:
        super().__init__(options)
        critic = options.critic
        assert critic is not None  # check_options
        c = options.checkpoint
        self.root: Path | str | None = None if c is None else (f"{c.uri.rstrip('/')}/critic" if c.uri
                                                                else Path(c.path) / "critic")
        source, opt_state = self._resume(critic.model or options.model.name, resume_step)
        self.model = self._load(source, critic)
        if options.trainer.gradient_checkpointing:
            self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self.shard()  # FSDP2: the shards are filled here (``deferred``)
        lr = options.algorithm.ppo_settings().critic_learning_rate
        self.make_optimizer(self.model.parameters(), lr, opt_state, source if self.resumed_from is not None else None)
        if self.resumed_from is not None and isinstance(self.root, str):  # loaded: drop the downloaded copy
            shutil.rmtree(Path(source).parent, ignore_errors=True)
        self.updates = 0

    def check_options(self) -> None:
        if self.options.critic is None:
            raise ValueError("a critic runs only for algorithm.name 'ppo'")

    def _resume(self, source: str, resume_step: int | None) -> tuple[str, dict[str, Any] | None]:
        """Where the model comes from and the optimiser state: the checkpoint of ``resume_step`` when it is
        complete, else ``source`` and none (with a warning when a step was asked for)."""
        self.resumed_from: int | None = None
        if not resume_step or self.root is None:
            return source, None
        if isinstance(self.root, str):  # an object-store checkpoint.uri: this rank downloads the step
            try:
                state = storage.read_state(self.root, resume_step)
            except ValueError as e:
                log.warning("no complete critic checkpoint for step %d (%s): the critic starts afresh", resume_step, e)
                return source, None
            saved = storage.download(f"{self.root}/step-{resume_step:08d}/{state['attempt']}",
                                     Path(tempfile.gettempdir()) / f"rlhf-critic-{os.getpid()}-rank{self.rank}")
        else:
            saved = ckpt.step_dir(self.root, resume_step)
            if not (saved / "state.json").is_file():  # written last: the step directory is complete
                log.warning("no critic checkpoint for step %d under %s: the critic starts afresh", resume_step,
                            self.root)
                return source, None
        self.resumed_from = resume_step
        return str(saved / "model"), read_optimizer_state(saved)

    def _load(self, source: str, critic: Critic) -> Any:
        """The value model from ``source`` (a token head with one output), or a ``ValueError`` naming the field:
        for the config (every rank) and, under FSDP2, for the weights too, which rank 0 loads later in ``shard``."""
        from safetensors import SafetensorError
        from transformers import AutoModelForTokenClassification

        field = "spec.critic.model" if critic.model else "spec.model.name"

        def named(call: Callable[[], Any]) -> Any:
            try:
                return call()
            except (OSError, ValueError, SafetensorError) as e:  # SafetensorError: a corrupt or truncated file
                raise ValueError(f"cannot load the critic from {field} {source!r} as a token-classification model "
                                 f"with one output: {e}") from e

        kw = load_kwargs(self.options.model, revision=critic.model is None, dtype=self.train_dtype)
        # FSDP2: a skeleton, its shards filled from rank 0's copy in ``shard`` (``deferred``)
        model, deferred = named(lambda: self.load_model(AutoModelForTokenClassification, source, kw, num_labels=1))
        self.deferred = None if deferred is None else (lambda: named(deferred))
        model.config.dtype = self.compute_dtype  # float32 masters under FSDP2; checkpoints say model.dtype
        attention.use_varlen(model, self.device, self.compute_dtype)
        return model

    def info(self) -> dict[str, Any]:
        return {"device": str(self.device), "pid": os.getpid(), "rank": self.rank, "world": self.world_size,
                "resumed_from": self.resumed_from}

    def save_checkpoint(self, step: int) -> str | None:
        """The critic at training step ``step`` (a collective under FSDP: every rank calls it; rank 0 writes)."""
        if self.root is None:
            return None
        return self.save_step(self.root, step, {"role": "critic"})

    def _values(self, micro: Packed) -> torch.Tensor:
        """``[1, L]``: the value of each completion token's state (the head's output one position earlier)."""
        v = self.model(input_ids=micro.ids, position_ids=micro.pos, use_cache=False,
                       **micro.attn_kwargs()).logits[0, :, 0].float()
        return v.new_zeros(1, micro.width).scatter(1, micro.where[None], v[micro.where - 1][None]) * micro.mask

    @torch.no_grad()
    def values(self, batch: dict[str, Any]) -> dict[str, Any]:
        """``{"values": per completion token, "seconds": compute time}``."""
        t0 = time.perf_counter()
        self.model.eval()
        out: list[list[float]] = [[] for _ in batch["prompts"]]
        for micro in self.micro_batches(batch["prompts"], batch["completions"]):
            with self.computing():
                put(out, self._values(micro), micro)
        release_cached_gpu_memory(self.options.colocated, self.device)
        return {"values": out, "seconds": time.perf_counter() - t0}

    def train(self, batch: dict[str, Any]) -> dict[str, float]:
        """``batch``: prompts, completions, ``returns`` and ``values`` (the values ``values`` gave before this
        update) per completion token. Returns loss statistics."""
        t0 = time.perf_counter()
        stats = self.optimise(batch)
        self.updates += 1
        stats["critic_train_s"] = time.perf_counter() - t0
        return stats

    def micro_inputs(self, batch: dict[str, Any], micro: Packed) -> dict[str, Any]:
        """The returns and the old values of the micro-batch's samples, ``[1, L]``."""
        return {"returns": from_lists(batch["returns"], micro), "old": from_lists(batch["values"], micro)}

    def micro_loss(self, micro: MicroBatch) -> tuple[torch.Tensor, dict[str, float]]:
        a = self.options.algorithm
        return value_loss(self._values(micro.packed), micro.inputs["old"], micro.inputs["returns"], micro.mask,
                          a.ppo_settings().value_clip, a.loss_aggregation, seq=micro.packed.seq)
