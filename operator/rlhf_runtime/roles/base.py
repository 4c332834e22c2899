"""Models beside the policy, each in Ray actors of its own: the frozen reference and PPO's critic.

(The reward model is ``rlhf_runtime.roles.reward.RewardScorer``.) Where they run is ``placement.Layout.roles``:
on the trainer's GPUs (colocated: one actor beside each trainer worker) or in a worker group of their own.

Batches are the trainer's: ``prompts`` and ``completions`` as token ids per sample. Per-token results are lists
over each sample's *completion* tokens only (``to_lists``/``from_lists`` convert from/to the padded ``[B, T]``
layout, where the completion of sample ``i`` sits at positions ``len(prompt_i) .. len(seq_i) - 1``).

* ``ReferenceModel.logprobs``: log-probabilities of each completion token under the initial policy (the base
  model), the same alignment and temperature as the trainer's (``grpo.token_logprobs``).
* ``CriticModel``: the policy's architecture (or ``spec.critic.model``) with a one-output token head
  (``AutoModelForTokenClassification``, ``num_labels=1``). Its value for completion token ``t`` is the head's
  output at position ``t - 1``: the value of the state the token was generated from. ``train`` takes PPO's
  clipped value loss (``algorithms.value_loss``) against the returns, ``epochsPerStep`` passes, its own AdamW
  at ``algorithm.ppo.criticLearningRate``. Several critic workers shard it with FSDP2, like the trainer.
  With ``spec.checkpoint`` it is checkpointed beside the policy, under ``<checkpoint.path>/critic`` with the
  same crash-safe layout (``rlhf_runtime.infra.checkpoint``), at the trainer's steps; a resumed run's critic loads the
  step the trainer resumed from (the critic is saved first, so that step always has one), or starts afresh
  with a warning when it is missing.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

from rlhf_api.models import RLHFJobSpec, RuntimeConfig
from rlhf_runtime.infra import checkpoint as ckpt
from rlhf_runtime.algo.objectives import value_loss
from rlhf_runtime.algo.grpo import token_logprobs

MICRO_BATCH = 64
log = logging.getLogger("rlhf_runtime")


def pad(prompts: list[list[int]], completions: list[list[int]], device: Any) -> tuple[torch.Tensor, ...]:
    """``(input_ids, attention_mask, completion_mask)``, each ``[B, T]``, right-padded."""
    seqs = [p + c for p, c in zip(prompts, completions)]
    width = max(len(s) for s in seqs)
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    attn = torch.zeros(len(seqs), width, dtype=torch.long)
    mask = torch.zeros(len(seqs), width)
    for i, (s, p) in enumerate(zip(seqs, prompts)):
        ids[i, : len(s)] = torch.tensor(s)
        attn[i, : len(s)] = 1
        mask[i, len(p) : len(s)] = 1
    return ids.to(device), attn.to(device), mask.to(device)


def to_lists(x: torch.Tensor, prompts: list[list[int]], completions: list[list[int]]) -> list[list[float]]:
    """The completion positions of each row of ``x`` ([B, T]) as plain lists."""
    rows = x.detach().float().cpu()
    return [rows[i, len(p) : len(p) + len(c)].tolist() for i, (p, c) in enumerate(zip(prompts, completions))]


def from_lists(values: list[list[float]], prompts: list[list[int]], width: int, device: Any) -> torch.Tensor:
    """Inverse of ``to_lists``: a ``[B, width]`` tensor, zeros outside the completions."""
    out = torch.zeros(len(values), width)
    for i, (v, p) in enumerate(zip(values, prompts)):
        if v:
            out[i, len(p) : len(p) + len(v)] = torch.tensor(v, dtype=torch.float32)
    return out.to(device)


def micro_share(mask: torch.Tensor, total_tokens: float, rows: int, aggregation: str) -> float:
    """The weight of one micro-batch's loss (``mask``: its completion tokens) in the whole batch's: its share of
    the batch's ``total_tokens`` (token aggregation) or of its ``rows`` sequences (sequence aggregation)."""
    if aggregation == "token":
        return float(mask.sum()) / max(total_tokens, 1.0)
    return len(mask) / rows


def chunks(n: int) -> list[list[int]]:
    return [list(range(i, min(i + MICRO_BATCH, n))) for i in range(0, n, MICRO_BATCH)]


def _device(spec: RLHFJobSpec) -> torch.device:
    gpu = torch.cuda.is_available() and spec.trainer.gpus_per_replica > 0
    if gpu:
        torch.cuda.set_device(0)  # the actor sees only its own GPU share
    return torch.device("cuda", 0) if gpu else torch.device("cpu")


def release_cached_gpu_memory(spec: RLHFJobSpec, device: torch.device) -> bool:
    """After a training step, a sync or a role's forward passes in colocated placement: hand the CUDA caching
    allocator's free blocks back to the GPU, so the vLLM engines sharing it can wake their weights and KV cache.
    torch keeps the step's peak (activations, logits, gathered FSDP parameters) reserved otherwise: on 2xH100
    (vLLM 0.33, Qwen3-1.7B, FSDP2x2 colocated with one TP=2 or two TP=1 engines at gpuMemoryUtilization 0.3) the
    engines' wake-up after a GRPO step failed with ``CUDA Error: out of memory`` in vLLM's cumem allocator.
    Separate placement keeps the cache (nothing else runs on those GPUs). Returns whether it released."""
    if device.type != "cuda" or spec.placement.mode != "colocated":
        return False
    torch.cuda.empty_cache()
    return True


def _init_group(spec: RLHFJobSpec, device: torch.device, rank: int, world: int, addr: str | None,
                port: int | None) -> None:
    import torch.distributed as dist

    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = str(addr), str(port)
    timeout = timedelta(seconds=spec.weight_sync.timeout_seconds)
    if device.type == "cuda":
        dist.init_process_group("nccl", rank=rank, world_size=world, device_id=device, timeout=timeout)
    else:
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timeout)


def full_model_state(model: Any, world_size: int) -> dict[str, torch.Tensor] | None:
    """FSDP2: the full (unsharded) state dict on CPU, gathered by every rank (a collective); None without FSDP."""
    if world_size == 1:
        return None
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def full_optimizer_state(model: Any, opt: Any, world_size: int) -> dict[str, Any]:
    """The optimiser state to checkpoint. FSDP2: the *full* state (every rank's shards gathered, keyed by
    parameter name, on rank 0's CPU; a collective, every rank calls it); else the plain state dict."""
    if world_size == 1:
        return opt.state_dict()
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    return get_optimizer_state_dict(model, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def load_optimizer_state(model: Any, opt: Any, state: dict[str, Any], world_size: int) -> None:
    """Inverse of ``full_optimizer_state``; FSDP2: every rank reads the full state and keeps its own shards."""
    if world_size == 1:
        opt.load_state_dict(state)
        return
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    set_optimizer_state_dict(model, opt, optim_state_dict=state, options=StateDictOptions(full_state_dict=True))


def _load_kwargs(spec: RLHFJobSpec, revision: bool = True) -> dict[str, Any]:
    kw: dict[str, Any] = {"dtype": getattr(torch, spec.model.dtype), "trust_remote_code": spec.model.trust_remote_code}
    if revision and spec.model.revision:
        kw["revision"] = spec.model.revision
    return kw


class ReferenceModel:
    """The frozen initial policy in an actor of its own (``spec.reference.placement`` colocated or separate)."""

    def __init__(self, config_json: str) -> None:
        from transformers import AutoModelForCausalLM

        self.spec = spec = RuntimeConfig.model_validate_json(config_json).spec
        self.device = _device(spec)
        self.model = AutoModelForCausalLM.from_pretrained(spec.model.name, **_load_kwargs(spec)).to(self.device)
        self.model.eval().requires_grad_(False)

    def info(self) -> dict[str, Any]:
        return {"device": str(self.device), "pid": os.getpid(),
                "parameters": sum(p.numel() for p in self.model.parameters())}

    @torch.no_grad()
    def logprobs(self, batch: dict[str, Any]) -> dict[str, Any]:
        """``{"logp": per completion token, "seconds": compute time}``."""
        t0 = time.perf_counter()
        temp = self.spec.rollout.sampling.temperature or 1.0
        p, c = batch["prompts"], batch["completions"]
        out: list[list[float]] = []
        for idx in chunks(len(p)):
            pp, cc = [p[i] for i in idx], [c[i] for i in idx]
            ids, attn, _ = pad(pp, cc, self.device)
            out += to_lists(token_logprobs(self.model, ids, attn, temp), pp, cc)
        release_cached_gpu_memory(self.spec, self.device)
        return {"logp": out, "seconds": time.perf_counter() - t0}


class CriticModel:
    """PPO's value model; one actor per critic worker (FSDP2 over all of them when there are several)."""

    def __init__(self, config_json: str, rank: int = 0, world_size: int = 1, dist_addr: str | None = None,
                 dist_port: int | None = None, resume_step: int | None = None) -> None:
        from transformers import AutoModelForTokenClassification

        self.spec = spec = RuntimeConfig.model_validate_json(config_json).spec
        critic = spec.critic_settings()
        if critic is None:
            raise ValueError("a critic runs only for algorithm.name 'ppo'")
        self.rank, self.world_size = rank, world_size
        self.device = _device(spec)
        torch.manual_seed(spec.algorithm.seed + 1)
        if world_size > 1:
            _init_group(spec, self.device, rank, world_size, dist_addr, dist_port)
        source = critic.model or spec.model.name
        self.root = Path(spec.checkpoint.path) / "critic" if spec.checkpoint else None
        opt_state, self.resumed_from = None, None
        if resume_step and self.root is not None:
            saved = ckpt.step_dir(self.root, resume_step)
            if (saved / "state.json").is_file():  # written last: the step directory is complete
                source, self.resumed_from = str(saved / "model"), resume_step
                opt_state = torch.load(saved / "optimizer.pt", map_location="cpu", weights_only=False)
            else:
                log.warning("no critic checkpoint for step %d under %s: the critic starts afresh", resume_step,
                            self.root)
        try:
            self.model = AutoModelForTokenClassification.from_pretrained(
                source, num_labels=1, **_load_kwargs(spec, revision=critic.model is None)).to(self.device)
        except (OSError, ValueError) as e:
            raise ValueError(f"cannot load the critic from {'spec.critic.model' if critic.model else 'spec.model.name'}"
                             f" {source!r} as a token-classification model with one output: {e}") from e
        if spec.trainer.gradient_checkpointing:
            self.model.gradient_checkpointing_enable()
        if world_size > 1:
            from torch.distributed.fsdp import fully_shard

            base = getattr(self.model, self.model.base_model_prefix, self.model)
            for layer in getattr(base, "layers", []):
                fully_shard(layer)
            fully_shard(self.model)
        ppo, o = spec.algorithm.ppo_settings(), spec.trainer.optimizer
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=ppo.critic_learning_rate, betas=(o.beta1, o.beta2),
                                     weight_decay=o.weight_decay)
        if opt_state is not None:
            load_optimizer_state(self.model, self.opt, opt_state, world_size)
        self.updates = 0

    def info(self) -> dict[str, Any]:
        return {"device": str(self.device), "pid": os.getpid(), "rank": self.rank, "world": self.world_size,
                "resumed_from": self.resumed_from}

    def save_checkpoint(self, step: int) -> str | None:
        """The critic at training step ``step`` (a collective under FSDP: every rank calls it; rank 0 writes)."""
        if self.root is None:
            return None
        state = full_model_state(self.model, self.world_size)
        optim = full_optimizer_state(self.model, self.opt, self.world_size)
        if self.rank != 0:
            return None
        self.root.mkdir(parents=True, exist_ok=True)
        tmp = ckpt.tmp_dir(self.root, step)
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            self.model.save_pretrained(str(tmp / "model"), state_dict=state)
            torch.save(optim, tmp / "optimizer.pt")
            final = ckpt.commit(tmp, self.root, step, {"role": "critic"})
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        ckpt.prune(self.root, keep=2)
        return str(final)

    def _values(self, ids: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        v = self.model(input_ids=ids, attention_mask=attn).logits[..., 0].float()[:, :-1]
        return torch.cat([torch.zeros_like(v[:, :1]), v], dim=1)

    @torch.no_grad()
    def values(self, batch: dict[str, Any]) -> dict[str, Any]:
        """``{"values": per completion token, "seconds": compute time}``."""
        t0 = time.perf_counter()
        self.model.eval()
        p, c = batch["prompts"], batch["completions"]
        out: list[list[float]] = []
        for idx in chunks(len(p)):
            pp, cc = [p[i] for i in idx], [c[i] for i in idx]
            ids, attn, _ = pad(pp, cc, self.device)
            out += to_lists(self._values(ids, attn), pp, cc)
        release_cached_gpu_memory(self.spec, self.device)
        return {"values": out, "seconds": time.perf_counter() - t0}

    def train(self, batch: dict[str, Any]) -> dict[str, float]:
        """``batch``: prompts, completions, ``returns`` and ``values`` (the values ``values`` gave before this
        update) per completion token. Returns loss statistics."""
        t0 = time.perf_counter()
        a = self.spec.algorithm
        p, c = batch["prompts"], batch["completions"]
        prepared, total = [], 0.0
        for idx in chunks(len(p)):
            pp, cc = [p[i] for i in idx], [c[i] for i in idx]
            ids, attn, mask = pad(pp, cc, self.device)
            w = ids.shape[1]
            ret = from_lists([batch["returns"][i] for i in idx], pp, w, self.device)
            old = from_lists([batch["values"][i] for i in idx], pp, w, self.device)
            prepared.append((ids, attn, mask, ret, old))
            total += float(mask.sum())
        stats = {"value_loss": 0.0, "value_clip_fraction": 0.0}
        self.model.train()
        for _ in range(a.epochs_per_step):
            self.opt.zero_grad(set_to_none=True)
            for ids, attn, mask, ret, old in prepared:
                loss, st = value_loss(self._values(ids, attn), old, ret, mask, a.ppo_settings().value_clip,
                                      a.loss_aggregation)
                share = micro_share(mask, total, len(p), a.loss_aggregation)
                (loss * share).backward()
                for k in stats:
                    stats[k] += st[k] * share / a.epochs_per_step
            max_norm = self.spec.trainer.optimizer.max_grad_norm
            if max_norm > 0:
                stats["critic_grad_norm"] = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm))
            self.opt.step()
        self.opt.zero_grad(set_to_none=True)  # free the gradients between steps (colocated engines wake into it)
        self.model.eval()
        self.updates += 1
        del prepared
        release_cached_gpu_memory(self.spec, self.device)
        stats["critic_train_s"] = time.perf_counter() - t0
        return stats
