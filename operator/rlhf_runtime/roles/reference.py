"""The frozen reference policy in Ray actors of its own (``spec.reference.placement`` colocated or separate).

Where they run is ``placement.Layout.roles``: on the trainer's GPUs (colocated: one actor beside each trainer
worker) or in a worker group of their own. With placement ``trainer`` it lives inside each trainer worker instead
(``TrainerReference``, held by ``roles.policy.Trainer``): under FSDP2 sharded like the policy, its shards filled
from rank 0's one copy (``FSDPWorker.fill_shards``), so each GPU holds 1/world of it.

``ReferenceModel.logprobs``: log-probabilities of each completion token under the initial policy (the base model,
``spec.model``), with the same alignment and temperature as the trainer's (``batches.token_logprobs``, in packed
micro-batches of ``trainer.maxTokensPerMicroBatch`` tokens), as lists over each sample's completion tokens
(``batches.to_lists``). No gradients, no optimiser, no checkpoint.
"""

from __future__ import annotations

import os
import time
from typing import Any

import torch

from rlhf_runtime.roles import attention, precision
from rlhf_runtime.roles.base import FSDPWorker, load_kwargs, release_cached_gpu_memory, worker_device
from rlhf_runtime.roles.batches import Packed, TokenScorer, pack, plan, put, token_logprobs
from rlhf_runtime.roles.options import TrainerOptions


class TrainerReference:
    """The frozen initial policy inside a trainer worker (``reference.placement: trainer``): one worker holds it
    whole; FSDP2 workers build a skeleton and shard it in ``shard`` (its decoder layers, then its scorer as the
    root), in ``model.dtype`` since it is never trained (in float32 with ``trainer.autocast``, as the policy)."""

    def __init__(self, worker: FSDPWorker, kw: dict[str, Any]) -> None:
        from transformers import AutoModelForCausalLM

        self.worker = worker
        # FSDP2: ``deferred`` loads it on rank 0's host; ``shard`` fills the shards
        self.model, self.deferred = worker.load_model(AutoModelForCausalLM, worker.options.model.name, kw)
        self.model.eval().requires_grad_(False)
        attention.use_varlen(self.model, worker.device, worker.compute_dtype)
        self.scorer = TokenScorer(self.model)  # the FSDP root: token_logprobs gathers the output layer in it

    def shard(self) -> None:
        """FSDP2: shard and fill (a collective: every rank calls it); one worker: nothing."""
        if self.deferred is None:
            return
        from torch.distributed.fsdp import fully_shard

        for layer in self.worker.decoder_layers(self.model):
            fully_shard(layer)
        fully_shard(self.scorer)
        self.worker.fill_shards(self.deferred, module=self.model)
        self.deferred = None

    def logprobs(self, micro: Packed, temperature: float) -> torch.Tensor:
        """Its log-probabilities of ``micro``'s completion tokens (``batches.token_logprobs``)."""
        return token_logprobs(self.scorer, micro, temperature)[0]


class ReferenceModel:
    """The frozen initial policy in an actor of its own (``spec.reference.placement`` colocated or separate)."""

    def __init__(self, options: TrainerOptions) -> None:
        from transformers import AutoModelForCausalLM

        self.options = options
        self.device = worker_device(options)
        self.dtype = dtype = getattr(torch, options.model.dtype)
        # trainer.autocast: float32 weights under autocast, computing as the policy does (the KL starts at 0)
        self.autocast = precision.uses_autocast(options.trainer.autocast, dtype)
        kw = load_kwargs(options.model, dtype=torch.float32 if self.autocast else None)
        self.model = AutoModelForCausalLM.from_pretrained(options.model.name, **kw).to(self.device)
        self.model.eval().requires_grad_(False)
        attention.use_varlen(self.model, self.device, dtype)

    def info(self) -> dict[str, Any]:
        return {"device": str(self.device), "pid": os.getpid(),
                "parameters": sum(p.numel() for p in self.model.parameters())}

    @torch.no_grad()
    def logprobs(self, batch: dict[str, Any]) -> dict[str, Any]:
        """``{"logp": per completion token, "seconds": compute time}``."""
        t0 = time.perf_counter()
        temp = self.options.temperature
        p, c = batch["prompts"], batch["completions"]
        out: list[list[float]] = [[] for _ in p]
        for idx in plan([len(a) + len(b) for a, b in zip(p, c)], self.options.trainer.max_tokens_per_micro_batch):
            micro = pack(p, c, idx, self.device)
            with precision.compute_context(self.autocast, self.device, self.dtype):
                put(out, token_logprobs(self.model, micro, temp)[0], micro)
        release_cached_gpu_memory(self.options.colocated, self.device)
        return {"logp": out, "seconds": time.perf_counter() - t0}
