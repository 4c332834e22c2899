"""One FSDP worker: what the policy trainer (``roles.policy.Trainer``) and PPO's critic (``roles.critic``) share.

``FSDPWorker`` is the base of both actor classes; one actor per worker of the role. It guarantees:

* Device: ``cuda:0`` when the trainer has GPUs (``trainer.gpusPerReplica`` > 0; the actor sees only its own GPU
  share), else the CPU. The torch seed is ``algorithm.seed`` plus the role's ``seed_offset``.
* Process group: with several workers, a torch.distributed group of all of them (NCCL on GPU, gloo on CPU,
  rank 0's address handed out by the driver). Rendezvous and every collective (FSDP gathers, the checkpoint
  broadcast) are bounded by ``weightSync.timeoutSeconds``: a rank that never joins or hangs fails the others
  instead of blocking them. ``close`` destroys the group (idempotent; the driver calls it before killing actors).
* Sharding (``shard``): FSDP2's ``fully_shard`` of every decoder layer, then of the whole model; nothing with one
  worker.
* Optimiser (``make_optimizer``): AdamW at the role's learning rate with ``trainer.optimizer``'s betas and weight
  decay, its state optionally restored from a checkpoint (``load_optimizer_state``).
* Training step (``optimise``): the batch in micro-batches of ``batches.MICRO_BATCH`` samples, prepared once
  without gradients (``micro_inputs``), then ``epochsPerStep`` passes: gradients zeroed, each micro-batch's loss
  (``micro_loss``) times its share of the batch (``batches.micro_share``, per ``lossAggregation``) backward, the
  role's loss statistics accumulated the same way, gradient clipping at ``maxGradNorm`` (0 disables it; the norm
  is reported as ``grad_norm_stat``, the last pass's), an optimiser step. Afterwards the gradients are freed
  (``set_to_none``), the model is back in eval mode and, colocated on a GPU, the cached memory is released
  (``release_cached_gpu_memory``) for the engines to wake into.
* Checkpoints (``save_step``, ``rlhf_runtime.infra.checkpoint``): a collective under FSDP (every rank gathers the
  full model and optimiser state, ``full_model_state``/``full_optimizer_state``); rank 0 writes the model
  (``write_model``: ``model/`` in ``save_pretrained`` form) and ``optimizer.pt`` into a temporary directory,
  commits it atomically as ``step-<N>`` with its ``state.json``, and keeps the newest two. A failed write leaves
  no partial copy (the newest complete one stays).

Subclasses load ``self.model`` and supply the loss of one micro-batch and what is prepared for it.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

from rlhf_api.models import RLHFJobSpec, RuntimeConfig
from rlhf_runtime.infra import checkpoint as ckpt
from rlhf_runtime.roles.batches import chunks, micro_share, pad


def worker_device(spec: RLHFJobSpec) -> torch.device:
    """``cuda:0`` (made the current device) when the job's trainer has GPUs and this process sees one; else CPU."""
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


def init_process_group(spec: RLHFJobSpec, device: torch.device, rank: int, world: int, addr: str | None,
                       port: int | None) -> None:
    """Join the default torch.distributed group of ``world`` workers at ``addr:port`` (rank 0's): NCCL on GPU,
    gloo on CPU (FSDP2 over gloo: the CPU tests); rendezvous and collectives time out after
    ``weightSync.timeoutSeconds``."""
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


def read_optimizer_state(step_dir: Path) -> dict[str, Any]:
    """The optimiser state a checkpoint step directory holds (``optimizer.pt``, on the CPU)."""
    return torch.load(step_dir / "optimizer.pt", map_location="cpu", weights_only=False)


def load_kwargs(spec: RLHFJobSpec, revision: bool = True) -> dict[str, Any]:
    """``from_pretrained`` arguments for ``spec.model``: its dtype, ``trustRemoteCode`` and (with ``revision``) its
    revision, when set."""
    kw: dict[str, Any] = {"dtype": getattr(torch, spec.model.dtype),
                          "trust_remote_code": spec.model.trust_remote_code}
    if revision and spec.model.revision:
        kw["revision"] = spec.model.revision
    return kw


@dataclass
class MicroBatch:
    """One micro-batch on the worker's device: ``batches.pad``'s ``[B, T]`` tensors and the role's own inputs."""

    ids: torch.Tensor
    attn: torch.Tensor
    mask: torch.Tensor
    inputs: dict[str, Any]


class FSDPWorker:
    """The base of the FSDP2 roles (module docstring). Subclasses set ``self.model`` and call ``shard`` and
    ``make_optimizer`` in their ``__init__``, and define ``micro_inputs`` and ``micro_loss``."""

    #: Added to ``algorithm.seed`` for this role's torch seed.
    seed_offset = 0
    #: The loss statistics ``micro_loss`` returns that a training step reports (share-weighted, over the passes).
    loss_stats: tuple[str, ...] = ()
    #: The key of the clipped gradient norm in a training step's statistics.
    grad_norm_stat = "grad_norm"

    model: Any
    opt: torch.optim.Optimizer

    def __init__(self, config_json: str, rank: int = 0, world_size: int = 1, dist_addr: str | None = None,
                 dist_port: int | None = None) -> None:
        self.spec = RuntimeConfig.model_validate_json(config_json).spec
        self.rank, self.world_size = rank, world_size
        self.check_spec()
        self.device = worker_device(self.spec)
        torch.manual_seed(self.spec.algorithm.seed + self.seed_offset)
        self.owns_group = False
        if world_size > 1:
            init_process_group(self.spec, self.device, rank, world_size, dist_addr, dist_port)
            self.owns_group = True

    def check_spec(self) -> None:
        """Refuse a spec this role cannot run, before anything is set up (a ``ValueError``); default: none."""

    def close(self) -> None:
        """Destroy the torch.distributed process group this worker made (several workers), so its communicators
        are torn down before the actor is killed. Idempotent; a no-op for a single worker."""
        if not self.owns_group:
            return
        self.owns_group = False
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()

    # ------------------------------------------------------------------------------------------- model
    def decoder_layers(self) -> Iterable[Any]:
        """The blocks ``shard`` wraps one by one: the ``layers`` of the model's base (``base_model_prefix``)."""
        base = getattr(self.model, self.model.base_model_prefix, self.model)
        return getattr(base, "layers", [])

    def shard(self) -> None:
        """FSDP2 over several workers: ``fully_shard`` of each decoder layer, then of the whole model."""
        if self.world_size == 1:
            return
        from torch.distributed.fsdp import fully_shard

        for layer in self.decoder_layers():
            fully_shard(layer)
        fully_shard(self.model)

    def make_optimizer(self, params: Iterable[Any], lr: float, state: dict[str, Any] | None) -> None:
        """``self.opt``: AdamW over ``params`` at ``lr`` with ``trainer.optimizer``; ``state``: a checkpoint's."""
        o = self.spec.trainer.optimizer
        self.opt = torch.optim.AdamW(params, lr=lr, betas=(o.beta1, o.beta2), weight_decay=o.weight_decay)
        if state is not None:
            load_optimizer_state(self.model, self.opt, state, self.world_size)

    # ---------------------------------------------------------------------------------------- training
    def micro_inputs(self, batch: dict[str, Any], idx: list[int], prompts: list[list[int]], ids: torch.Tensor,
                     attn: torch.Tensor) -> dict[str, Any]:
        """What ``micro_loss`` needs besides the tokens, for the samples ``idx`` of ``batch`` (``prompts``: theirs;
        ``ids``/``attn``: padded). Runs once per step, before the passes, without gradients, in eval mode."""
        raise NotImplementedError

    def micro_loss(self, micro: MicroBatch) -> tuple[torch.Tensor, dict[str, float]]:
        """The loss of one micro-batch (aggregated over it per ``lossAggregation``) and its ``loss_stats``."""
        raise NotImplementedError

    def prepare(self, batch: dict[str, Any]) -> tuple[list[MicroBatch], float]:
        """The batch's micro-batches on the device (``micro_inputs`` included) and its completion tokens."""
        p, c = batch["prompts"], batch["completions"]
        prepared: list[MicroBatch] = []
        total_tokens = 0.0
        self.model.eval()
        with torch.no_grad():
            for idx in chunks(len(p)):
                pp, cc = [p[i] for i in idx], [c[i] for i in idx]
                ids, attn, mask = pad(pp, cc, self.device)
                prepared.append(MicroBatch(ids, attn, mask, self.micro_inputs(batch, idx, pp, ids, attn)))
                total_tokens += float(mask.sum())
        return prepared, total_tokens

    def optimise(self, batch: dict[str, Any]) -> dict[str, float]:
        """One training step on ``batch`` (module docstring); returns the loss statistics and the grad norm."""
        prepared, total_tokens = self.prepare(batch)
        stats = self.run_passes(prepared, total_tokens, len(batch["prompts"]))
        del prepared
        self.opt.zero_grad(set_to_none=True)  # free the gradients until the next backward (every pass starts
        # from zero): colocated engines wake into that memory
        self.model.eval()
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        release_cached_gpu_memory(self.spec, self.device)  # colocated: the engines wake into this memory next
        return stats

    def run_passes(self, prepared: list[MicroBatch], total_tokens: float, rows: int) -> dict[str, float]:
        """``epochsPerStep`` optimiser passes over the micro-batches (gradient accumulation, clipping, a step
        each); ``rows``: the batch's samples."""
        a = self.spec.algorithm
        stats = dict.fromkeys(self.loss_stats, 0.0)
        self.model.train()
        for _ in range(a.epochs_per_step):
            self.opt.zero_grad(set_to_none=True)
            for micro in prepared:
                loss, st = self.micro_loss(micro)
                share = micro_share(micro.mask, total_tokens, rows, a.loss_aggregation)
                (loss * share).backward()
                for k in self.loss_stats:  # not the grad norm, set per pass below
                    stats[k] += st[k] * share / a.epochs_per_step
            max_norm = self.spec.trainer.optimizer.max_grad_norm
            if max_norm > 0:
                norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm)
                stats[self.grad_norm_stat] = float(norm)
            self.opt.step()
        return stats

    # ------------------------------------------------------------------------------------- checkpoints
    def write_model(self, directory: Path, state: dict[str, torch.Tensor] | None) -> None:
        """Write the model into a checkpoint's step ``directory`` (rank 0; ``state``: the gathered full state
        under FSDP, else None): ``model/`` in ``save_pretrained`` form."""
        self.model.save_pretrained(str(directory / "model"), state_dict=state)

    def save_step(self, root: str | Path, step: int, meta: dict[str, Any]) -> str | None:
        """Checkpoint the model and optimiser as step ``step`` under ``root`` (``meta`` joins its ``state.json``);
        a collective under FSDP: every rank calls it, rank 0 writes and returns the step's directory."""
        state = full_model_state(self.model, self.world_size)  # collectives under FSDP: every rank takes part
        optim = full_optimizer_state(self.model, self.opt, self.world_size)
        if self.rank != 0:
            return None
        Path(root).mkdir(parents=True, exist_ok=True)
        tmp = ckpt.tmp_dir(root, step)
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            self.write_model(tmp, state)
            torch.save(optim, tmp / "optimizer.pt")
            final = ckpt.commit(tmp, root, step, meta)
        except BaseException:  # e.g. a full disk: no partial copy left behind (the newest complete one stays)
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        ckpt.prune(root, keep=2)
        return str(final)

