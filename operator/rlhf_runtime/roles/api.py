"""Each role's actor interface, as the driver calls it (through Ray: ``actor.method.remote(...)``).

These ``Protocol``s are the contract between the driver and the role classes: ``roles.policy.Trainer``
(``PolicyActor``), ``roles.critic.CriticModel`` (``CriticActor``), ``roles.reference.ReferenceModel``
(``ReferenceActor``) and ``roles.reward.RewardScorer`` (``ScorerActor``). Names, arguments and results are the
classes' own; the classes do not inherit from them (structural typing), and a type checker holds each class to its
protocol (``_conforms`` below). Nothing here imports torch.

Shared conventions:

* A batch (``Batch``) is a dict with ``prompts`` and ``completions``, token ids per sample; per-token values, in
  and out, are lists over each sample's completion tokens (``roles.batches``).
* Under FSDP (several workers of the policy or the critic), the calls marked *collective* must reach every
  rank, each with its own slice of the batch where there is one; rank 0 alone writes files and returns paths.
* ``info`` is called once after the actor starts: a JSON-able dict (``pid`` and ``device`` always; the policy's
  ``step``, ``resumed_from`` and ``param_bytes``; the critic's ``rank``, ``world`` and ``resumed_from``).
* ``close`` (policy, critic) destroys the worker's torch.distributed group, for code that ends a worker in its own
  process. The driver does not call it: it kills its actors (``ray.kill``), so their interpreters never finalize
  under live gloo threads (the exit-time abort that ``tests/runtime/test_fsdp_lean_gathers.py`` explains).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

#: A batch as the driver hands it to a role (see the module docstring).
Batch = dict[str, Any]


class PolicyActor(Protocol):
    """The policy trainer: one actor per trainer worker."""

    def info(self) -> dict[str, Any]:
        """``step``, ``resumed_from``, ``param_bytes``, ``device``, ``pid``, ``threads``."""
        ...

    def logprobs(self, batch: Batch) -> dict[str, Any]:
        """``logp`` per completion token under the current policy, ``ref`` under the in-trainer reference (or
        None), ``seconds``. Collective."""
        ...

    def train(self, batch: Batch) -> dict[str, float]:
        """One step on ``batch`` (``advantages`` per sample or per token; optional ``old_logprobs``,
        ``ref_logprobs``): loss statistics, ``grad_norm``, ``step``, ``train_s``. Collective."""
        ...

    def save_checkpoint(self) -> str | None:
        """Checkpoint the current step under ``spec.checkpoint.path``; rank 0 returns its directory (None without
        ``spec.checkpoint``). Collective."""
        ...

    def export(self, path: str) -> str | None:
        """The policy in Hugging Face format at ``path``, replaced atomically; rank 0 returns ``path``.
        Collective."""
        ...

    def stage_weights(self) -> list[str] | None:
        """The policy's files in a fresh directory on rank 0's node; rank 0 returns their names. Collective."""
        ...

    def read_staged(self, name: str) -> bytes:
        """One file of the staged weights (rank 0)."""
        ...

    def drop_staged(self) -> None:
        """Remove the staged weights (no-op when none)."""
        ...

    def init_weight_sync(self, handles: list[Any], worlds: list[int], options: Any,
                         skip: list[str] | None = None) -> dict[str, Any]:
        """(Re-)create the weight-transfer group with the engines ``handles`` (rank 0; other ranks: empty) and a
        sender of ``options`` (``weight_sync.options.WeightSyncOptions``); what the sender uses. Collective."""
        ...

    def sync_weights(self) -> dict[str, float]:
        """Send the current weights to the engines of the weight-transfer group; timings. Collective."""
        ...

    def adapter_payload(self, skip: list[str] | None = None) -> dict[str, Any]:
        """(LoRA) The adapter files a sync hands to the engines: ``files``, ``bytes``, ``tensors``,
        ``serialize_s``."""
        ...

    def close(self) -> None:
        """Destroy this worker's torch.distributed group, if it made one (idempotent)."""
        ...


class CriticActor(Protocol):
    """PPO's critic: one actor per critic worker."""

    def info(self) -> dict[str, Any]:
        """``device``, ``pid``, ``rank``, ``world``, ``resumed_from``."""
        ...

    def values(self, batch: Batch) -> dict[str, Any]:
        """``values`` per completion token, ``seconds``. Collective."""
        ...

    def train(self, batch: Batch) -> dict[str, float]:
        """One step on ``batch`` (``returns`` and the earlier ``values`` per token): ``value_loss``,
        ``value_clip_fraction``, ``critic_grad_norm``, ``critic_train_s``. Collective."""
        ...

    def save_checkpoint(self, step: int) -> str | None:
        """Checkpoint the critic as training step ``step`` under ``<checkpoint.path>/critic``; rank 0 returns
        its directory (None without ``spec.checkpoint``). Collective."""
        ...

    def close(self) -> None:
        """Destroy this worker's torch.distributed group, if it made one (idempotent)."""
        ...


class ReferenceActor(Protocol):
    """The frozen reference policy in actors of its own."""

    def info(self) -> dict[str, Any]:
        """``device``, ``pid``, ``parameters``."""
        ...

    def logprobs(self, batch: Batch) -> dict[str, Any]:
        """``logp`` per completion token under the initial policy, ``seconds``."""
        ...


class ScorerActor(Protocol):
    """A reward-model scorer."""

    def info(self) -> dict[str, Any]:
        """``name``, ``device``, ``dtype``, ``parameters``, ``batch_size``."""
        ...

    def score(self, prompts: list[str], completions: list[str]) -> list[float]:
        """One finite score per sample (``prompt + completion``)."""
        ...


if TYPE_CHECKING:
    from rlhf_runtime.roles.critic import CriticModel
    from rlhf_runtime.roles.policy import Trainer
    from rlhf_runtime.roles.reference import ReferenceModel
    from rlhf_runtime.roles.reward import RewardScorer

    def _conforms(t: Trainer, c: CriticModel, r: ReferenceModel,
                  s: RewardScorer) -> tuple[PolicyActor, CriticActor, ReferenceActor, ScorerActor]:
        """For type checkers only: each role class satisfies its protocol."""
        return t, c, r, s
