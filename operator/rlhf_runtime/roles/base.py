"""One FSDP worker: what the policy trainer (``roles.policy.Trainer``) and PPO's critic (``roles.critic``) share.

``FSDPWorker`` is the base of both actor classes; one actor per worker of the role, made with the role's
``roles.options.TrainerOptions`` (resolved by the driver; ``rank``: this worker's). It guarantees:

* Device: ``cuda:0`` when the trainer has GPUs (``trainer.gpusPerReplica`` > 0; the actor sees only its own GPU
  share), else the CPU. The torch seed is ``algorithm.seed`` plus the role's ``seed_offset``.
* Process group: with several workers, a torch.distributed group of all of them (NCCL on GPU, gloo on CPU,
  rank 0's address handed out by the driver). Rendezvous and every collective (FSDP gathers, the checkpoint
  broadcast) are bounded by ``weightSync.timeoutSeconds``: a rank that never joins or hangs fails the others
  instead of blocking them. ``close`` destroys the group (idempotent).
* Precision (``roles.precision``, ``trainer.masterWeights``): float32 master weights, gradients and optimiser
  state, compute in ``model.dtype``. Under FSDP2 the model is loaded in float32 (``train_dtype``) and sharded
  with a mixed-precision policy; one worker keeps the model in its dtype beside ``MasterWeights``. With
  ``trainer.autocast`` the model is float32 itself (no policy; masters only for trainable parameters PEFT left in
  ``model.dtype``) and every forward pass and its loss run in ``computing`` (``torch.autocast`` to ``model.dtype``).
* Sharding (``shard``): FSDP2's ``fully_shard`` of every decoder layer, then of ``fsdp_root`` (the model, or a
  module around it whose forward must gather the parameters outside the layers); nothing with one worker.
* Optimiser (``make_optimizer``): AdamW at the role's learning rate with ``trainer.optimizer``'s betas and weight
  decay over ``trainable`` (the masters, with one worker and master weights; AdamW's fused kernel, on CPU and
  under FSDP2 too), its state optionally restored from a checkpoint (``load_optimizer_state``), else created at once
  (``offload.init_optimizer_state``). With ``trainer.offloadDuringRollout`` (the driver's ``set_offload``) the
  masters and moments wait in host memory between steps (``offload.StateOffload``; back for each step and save).
* Micro-batches (``micro_batches``): packed by tokens (``roles.batches.plan``/``pack``, at most
  ``trainer.maxTokensPerMicroBatch`` tokens each, no padding); under FSDP every rank runs the same number of them
  (the largest count of any rank; the others are filled with empty ones), since each forward is a collective.
* Training step (``optimise``): the micro-batches prepared once without gradients (``micro_inputs``), then
  ``epochsPerStep`` passes: gradients zeroed, each micro-batch's loss (``micro_loss``) times its share of the
  batch (``batches.micro_share``, per ``lossAggregation``) backward, the role's loss statistics accumulated the
  same way, gradient clipping at ``maxGradNorm`` (0 disables it; the norm is reported as ``grad_norm_stat``, the
  last pass's), an optimiser step. Under FSDP the shares are of the *whole* batch (its tokens or sequences summed
  over the ranks, times the world size, since FSDP averages the ranks' gradients), so the update is the exact
  token (or sequence) mean whatever each rank holds, and the statistics are summed over the ranks. Afterwards
  the gradients are freed (``set_to_none``), the model is back in eval mode and, colocated on a GPU, the cached
  memory is released (``release_cached_gpu_memory``) for the engines to wake into.
* Checkpoints (``save_step``, ``rlhf_runtime.infra.checkpoint``; ``infra.storage`` for an object-store
  ``checkpoint.uri``: written locally, uploaded, a marker object last): a collective under FSDP (every rank gathers the
  full model and optimiser state, ``full_model_state``/``full_optimizer_state``); rank 0 writes the model
  (``write_model``: ``model/`` in ``save_pretrained`` form) and ``optimizer.pt`` (with one worker's master
  weights) into a temporary directory, commits it atomically as ``step-<N>`` with its ``state.json``, and keeps
  the newest two. A failed write leaves no partial copy (the newest complete one stays).

Subclasses load ``self.model`` and supply the loss of one micro-batch and what is prepared for it.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

from rlhf_api.models import ModelSource
from rlhf_runtime.infra import checkpoint as ckpt
from rlhf_runtime.infra import startup, storage
from rlhf_runtime.roles import offload, precision
from rlhf_runtime.roles.batches import Packed, micro_share, pack, plan
from rlhf_runtime.roles.optim_state import full_optimizer_state, load_optimizer_state
from rlhf_runtime.roles.options import TrainerOptions

log = logging.getLogger("rlhf_runtime")


def worker_device(options: TrainerOptions) -> torch.device:
    """``cuda:0`` (made the current device) when the job's trainer has GPUs and this process sees one; else CPU."""
    gpu = torch.cuda.is_available() and options.trainer.gpus_per_replica > 0
    if gpu:
        torch.cuda.set_device(0)  # the actor sees only its own GPU share
    return torch.device("cuda", 0) if gpu else torch.device("cpu")


def release_cached_gpu_memory(colocated: bool, device: torch.device) -> bool:
    """After a training step, a sync or a role's forward passes in colocated placement: hand the CUDA caching
    allocator's free blocks back to the GPU, so the vLLM engines sharing it can wake their weights and KV cache.
    torch keeps the step's peak (activations, logits, gathered FSDP parameters) reserved otherwise, and the
    engines' wake-up after a step can then fail with ``CUDA Error: out of memory`` in vLLM's cumem allocator.
    Separate placement keeps the cache (nothing else runs on those GPUs). Returns whether it released."""
    if device.type != "cuda" or not colocated:
        return False
    torch.cuda.empty_cache()
    return True


def init_process_group(options: TrainerOptions, device: torch.device) -> None:
    """Join the default torch.distributed group of ``world`` workers at ``addr:port`` (rank 0's): NCCL on GPU,
    gloo on CPU (FSDP2 over gloo: the CPU tests); rendezvous and collectives time out after
    ``weightSync.timeoutSeconds``."""
    import torch.distributed as dist

    rank, world = options.rank.rank, options.rank.world_size
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = str(options.rank.addr), str(options.rank.port)
    timeout = timedelta(seconds=options.timeout_s)
    if device.type == "cuda":
        dist.init_process_group("nccl", rank=rank, world_size=world, device_id=device, timeout=timeout)
    else:
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timeout)


def full_model_state(model: Any, world_size: int, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor] | None:
    """FSDP2: the full (unsharded) state dict on rank 0's CPU (the other ranks get an empty one), gathered by every
    rank one tensor at a time (a collective); None without FSDP. With ``dtype`` each floating tensor is cast to it
    on the device before it reaches host memory: rank 0 then holds the model once, in ``dtype``, instead of its
    float32 masters plus a cast copy (a 30B model: 61 GB, not 122 + 61 GB), and the host does no casting; without,
    the tensors keep theirs (checkpoints: the float32 masters). One worker with ``dtype``: ``served_state``."""
    if world_size == 1:
        return None if dtype is None else served_state(model, dtype)
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.tensor import DTensor

    out: dict[str, torch.Tensor] = {}
    done: dict[int, torch.Tensor] = {}  # tied parameters: gathered once, one tensor under both names
    rank0 = dist.get_rank() == 0
    # the sharded state dict: FSDP2's DTensors under the model's own names (wrappers' prefixes removed)
    for name, v in get_model_state_dict(model, options=StateDictOptions(full_state_dict=False)).items():
        if id(v) not in done:
            full = v.full_tensor() if isinstance(v, DTensor) else v
            full = full.detach().to(dtype) if dtype is not None and full.is_floating_point() else full.detach()
            done[id(v)] = full.cpu() if rank0 else torch.empty(0)
        if rank0:
            out[name] = done[id(v)]
    return out


def served_state(model: Any, dtype: torch.dtype) -> dict[str, torch.Tensor] | None:
    """One worker's state dict with its floating tensors in ``dtype`` where some are not (``trainer.autocast``:
    float32 weights, a bfloat16 model served), each cast once (tied tensors stay one tensor under both names);
    None where they all are already (``save_pretrained`` then writes the model as it is)."""
    state = model.state_dict()
    if all(v.dtype == dtype or not v.is_floating_point() for v in state.values()):
        return None

    def where(v: torch.Tensor) -> tuple[Any, ...]:  # the state dict's entries are fresh views: compare their memory
        return v.untyped_storage().data_ptr(), v.storage_offset(), tuple(v.shape), tuple(v.stride())

    cast: dict[tuple[Any, ...], torch.Tensor] = {}
    for v in state.values():
        if where(v) not in cast:
            cast[where(v)] = v.detach().to(dtype) if v.is_floating_point() else v
    return {k: cast[where(v)] for k, v in state.items()}


def load_kwargs(model: ModelSource, revision: bool = True, dtype: torch.dtype | None = None) -> dict[str, Any]:
    """``from_pretrained`` arguments for the policy ``model``: its dtype (or ``dtype``), ``trustRemoteCode`` and
    (with ``revision``) its revision, when set."""
    kw: dict[str, Any] = {"dtype": dtype or getattr(torch, model.dtype), "trust_remote_code": model.trust_remote_code}
    if revision and model.revision:
        kw["revision"] = model.revision
    return kw


@dataclass
class MicroBatch:
    """One micro-batch on the worker's device: the packed sequences (``batches.Packed``) and the role's inputs."""

    packed: Packed
    inputs: dict[str, Any]

    @property
    def mask(self) -> torch.Tensor:
        return self.packed.mask


class FSDPWorker(offload.StateOnHost):
    """The base of the FSDP2 roles (module docstring). Subclasses set ``self.model`` (loaded in ``train_dtype``)
    and call ``shard`` and ``make_optimizer`` in their ``__init__``, and define ``micro_inputs`` and
    ``micro_loss``."""

    #: Added to ``algorithm.seed`` for this role's torch seed.
    seed_offset = 0
    #: The loss statistics ``micro_loss`` returns that a training step reports (share-weighted, over the passes).
    loss_stats: tuple[str, ...] = ()
    #: The key of the clipped gradient norm in a training step's statistics.
    grad_norm_stat = "grad_norm"

    model: Any
    opt: torch.optim.Optimizer

    def __init__(self, options: TrainerOptions) -> None:
        self.spawned = startup.process_started()  # when Ray started this actor's process (``info``)
        self.options = options
        self.rank, self.world_size = options.rank.rank, options.rank.world_size
        self.check_options()
        self.device = worker_device(options)
        torch.manual_seed(options.algorithm.seed + self.seed_offset)
        self.compute_dtype = getattr(torch, options.model.dtype)
        #: ``trainer.autocast``: float32 weights, forward passes under autocast (``computing``), no FSDP2 policy;
        #: one worker's ``MasterWeights`` then hold only trainable parameters left in model.dtype (a LoRA adapter
        #: PEFT did not widen), none of a full model
        self.autocast = precision.uses_autocast(options.trainer.autocast, self.compute_dtype)
        self.masters = precision.wants_masters(options.trainer.master_weights, self.compute_dtype)
        self.master: precision.MasterWeights | None = None
        #: FSDP2: loads the full model on rank 0's host (``self.model`` is then a skeleton on the meta device until
        #: ``shard`` fills its shards, ``fill_shards``); None: ``self.model`` already holds its weights.
        self.deferred: Callable[[], Any] | None = None
        self.owns_group = False
        if self.world_size > 1:
            init_process_group(options, self.device)
            self.owns_group = True

    def check_options(self) -> None:
        """Refuse options this role cannot run, before anything is set up (a ``ValueError``); default: none."""

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
    @property
    def train_dtype(self) -> torch.dtype:
        """The dtype the trained model is loaded in: float32 under FSDP2 with master weights (the shards are
        the masters) and with ``trainer.autocast``, else ``model.dtype``."""
        return torch.float32 if self.autocast or (self.masters and self.world_size > 1) else self.compute_dtype

    def computing(self) -> Any:
        """The context of every forward pass and the loss built from it (``precision.compute_context``):
        ``torch.autocast`` to ``model.dtype`` with ``trainer.autocast``, else none. Backward runs outside it."""
        return precision.compute_context(self.autocast, self.device, self.compute_dtype)

    def decoder_layers(self, model: Any = None) -> Iterable[Any]:
        """The blocks ``shard`` wraps one by one: the ``layers`` of the model's (``self.model``'s) base
        (``base_model_prefix``)."""
        model = self.model if model is None else model
        base = getattr(model, model.base_model_prefix, model)
        return getattr(base, "layers", [])

    def fsdp_root(self) -> Any:
        """The module ``shard`` wraps last, whose forward gathers the parameters outside the decoder layers."""
        return self.model

    def shard(self) -> None:
        """``trainer.compile``: each decoder layer through ``torch.compile`` first (per block, before FSDP2 wraps
        it, as torchtitan does; with dynamic shapes). FSDP2 over several workers: ``fully_shard`` of each decoder
        layer (kept gathered from forward to backward with ``trainer.reshardAfterForward`` false), then of
        ``fsdp_root``; with master weights, computing in ``model.dtype`` over float32 shards
        (``precision.fsdp_policy``)."""
        if self.options.trainer.compile:
            for layer in self.decoder_layers():
                # packed rows vary in length, sequence count and longest sequence: compiled for fixed shapes, a
                # layer would recompile (seconds each) the first time each of them changes
                layer.compile(dynamic=True)
        if self.world_size == 1:
            return
        from torch.distributed.fsdp import fully_shard

        kw = {"mp_policy": precision.fsdp_policy(self.compute_dtype)} if self.masters and not self.autocast else {}
        for layer in self.decoder_layers():
            fully_shard(layer, reshard_after_forward=self.options.trainer.reshard_after_forward, **kw)
        fully_shard(self.fsdp_root(), **kw)
        if self.deferred is not None:
            self.fill_shards(self.deferred)
            self.deferred = None

    def load_model(self, cls: Any, source: str, kw: dict[str, Any], widen: bool = False,
                   **config: Any) -> tuple[Any, Callable[[], Any] | None]:
        """``cls.from_pretrained(source, **kw, **config)`` (``cls`` an ``AutoModel...`` class, ``kw`` holding the
        dtype) and None with one worker, on its device. Under FSDP2 a skeleton of it (``skeleton``) and that call,
        which ``fill_shards`` makes on rank 0's host once ``fully_shard`` has run; with ``widen`` in the file's
        own dtype where the shards' widens it exactly (``precision.host_load_dtype``: a bfloat16 file for float32
        masters), which halves the host copy and leaves the casting to the shards' copies. Only for models whose
        every parameter the file holds: a new head (the critic's) would start from another random draw."""

        def load(dtype: torch.dtype = kw["dtype"]) -> Any:
            return cls.from_pretrained(source, **{**kw, "dtype": dtype}, **config)

        if self.world_size == 1:
            return load().to(self.device), None
        host = precision.host_load_dtype(source, kw["dtype"]) if widen else kw["dtype"]
        return self.skeleton(cls, source, kw, **config), lambda: load(host)

    def skeleton(self, cls: Any, source: str, kw: dict[str, Any], **config: Any) -> Any:
        """``cls`` (an ``AutoModel...`` class) of ``source``'s config (``config``: attributes set on it) on the meta
        device in ``kw``'s dtype: no memory, no weights; ``fill_shards`` gives it its weights after
        ``fully_shard``."""
        from transformers import AutoConfig

        extra = {k: kw[k] for k in ("revision",) if k in kw}
        config = AutoConfig.from_pretrained(source, trust_remote_code=kw.get("trust_remote_code", False), **extra,
                                            **config)
        with torch.device("meta"):
            return cls.from_config(config, dtype=kw["dtype"], trust_remote_code=kw.get("trust_remote_code", False))

    def fill_shards(self, load: Callable[[], Any], module: Any = None) -> None:
        """Every rank's shards of the sharded skeleton ``module`` (default ``self.model``) from one full copy:
        rank 0 loads the model on its host (``load()``: the policy and critic in ``train_dtype``, or a policy's
        bfloat16 file as it is, see ``load_model``; either way the shards get the file's exact values) and
        broadcasts it tensor by tensor, each rank keeping its own shard
        (``set_model_state_dict``, ``broadcast_from_rank0``). So a node holds one full copy in host memory, not
        one per rank, and a GPU never holds more than its shards plus one tensor. Buffers outside the state dict
        (rotary frequencies) are rank 0's."""
        import torch.distributed as dist
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        module = self.model if module is None else module
        full: dict[str, torch.Tensor] = {}
        other: dict[str, torch.Tensor] = {}
        if self.rank == 0:
            host = load()
            full = host.state_dict()
            other = {n: b for n, b in host.named_buffers() if n not in full}
            del host
        kept = set(module.state_dict())
        module.to_empty(device=self.device)
        set_model_state_dict(module, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
        for name, buf in module.named_buffers():
            if name in kept:
                continue
            if self.rank == 0:
                buf.copy_(other[name])
            dist.broadcast(buf, 0)

    def make_optimizer(self, params: Iterable[Any], lr: float, state: dict[str, Any] | None,
                       saved: str | None = None) -> None:
        """``self.opt``: AdamW over ``params`` (one worker with master weights: over their float32 masters) at
        ``lr`` with ``trainer.optimizer``; ``state``: a checkpoint's, ``saved`` its model directory (one worker
        takes its exact float32 weights whichever precision wrote it: ``precision.resume_weights``)."""
        o = self.options.trainer.optimizer
        params = given = list(params)
        if self.masters and self.world_size == 1:
            self.master = precision.MasterWeights(params)
            params = self.master.params
        self.trainable = params
        # the fused kernel everywhere (FSDP2's DTensor shards too): one launch per step on a GPU, and no
        # full-size temporaries; foreach AdamW's sqrt of the second moments is a float32 copy of every shard
        # (4 more bytes per trained parameter on each GPU at every step)
        self.opt = torch.optim.AdamW(params, lr=lr, betas=(o.beta1, o.beta2), weight_decay=o.weight_decay,
                                     fused=True)
        if state is not None:
            masters = state.pop("master_weights", None)
            load_optimizer_state(self.model, self.opt, state, self.world_size)
            ids = {id(p) for p in given}
            named = [(n, p) for n, p in self.model.named_parameters() if id(p) in ids]
            why = precision.resume_weights(self.master, named, masters, saved,
                                           self.model if self.world_size > 1 else None)
            if why:
                log.warning("checkpoint %s: %s; the run goes on from its weights in %s", saved, why,
                            self.compute_dtype)
        offload.init_optimizer_state(self.opt)  # the moments from the start: the memory held after step 1
        self.state_offload = offload.StateOffload(self.opt, [m for _, m in self.master.pairs] if self.master else [],
                                                  self.device)

    # ---------------------------------------------------------------------------------------- training
    def micro_batches(self, prompts: list[list[int]], completions: list[list[int]],
                      loss_masks: list[list[int]] | None = None) -> list[Packed]:
        """This rank's samples packed into micro-batches of at most ``trainer.maxTokensPerMicroBatch`` tokens;
        under FSDP as many as the rank with the most has (empty ones fill up), since every forward is a
        collective. ``loss_masks``: see ``batches.pack``."""
        bins = plan([len(p) + len(c) for p, c in zip(prompts, completions)],
                    self.options.trainer.max_tokens_per_micro_batch)
        if self.world_size > 1:
            bins += [[]] * (int(self.all_reduce([len(bins)], "max")[0]) - len(bins))
        return [pack(prompts, completions, b, self.device, loss_masks) for b in bins]

    def all_reduce(self, values: list[float], op: str = "sum") -> list[float]:
        """``values`` reduced over the workers (sum or max), a collective; themselves with one worker."""
        if self.world_size == 1:
            return values
        import torch.distributed as dist

        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM)
        return t.tolist()

    def micro_inputs(self, batch: dict[str, Any], micro: Packed) -> dict[str, Any]:
        """What ``micro_loss`` needs besides the tokens, for the samples of ``micro`` (``micro.idx``, indices into
        ``batch``). Runs once per step, before the passes, without gradients, in eval mode."""
        raise NotImplementedError

    def micro_loss(self, micro: MicroBatch) -> tuple[torch.Tensor, dict[str, float]]:
        """The loss of one micro-batch (aggregated over it per ``lossAggregation``) and its ``loss_stats``."""
        raise NotImplementedError

    def prepare(self, batch: dict[str, Any]) -> list[MicroBatch]:
        """The batch's micro-batches on the device (``micro_inputs`` included)."""
        self.model.eval()
        with torch.no_grad(), self.computing():
            return [MicroBatch(m, self.micro_inputs(batch, m))
                    for m in self.micro_batches(batch["prompts"], batch["completions"], batch.get("loss_masks"))]

    def optimise(self, batch: dict[str, Any]) -> dict[str, float]:
        """One training step on ``batch`` (module docstring); returns the loss statistics and the grad norm."""
        moved = self.state_offload.reload()  # trainer.offloadDuringRollout: the state back for the step
        prepared = self.prepare(batch)
        stats = self.run_passes(prepared)
        del prepared
        self.opt.zero_grad(set_to_none=True)  # free the gradients until the next backward (every pass starts
        # from zero): colocated engines wake into that memory
        self.model.eval()
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        stats.update(offload.memory_stats(self.device), **moved, **self.state_offload.offload())
        release_cached_gpu_memory(self.options.colocated, self.device)  # colocated: the engines wake into this memory next
        return stats

    def run_passes(self, prepared: list[MicroBatch]) -> dict[str, float]:
        """``epochsPerStep`` optimiser passes over the micro-batches (gradient accumulation, clipping, a step
        each), each micro-batch weighted by its share of the whole batch (over every rank)."""
        a = self.options.algorithm
        tokens, rows = self.all_reduce([float(sum(m.packed.tokens for m in prepared)),
                                        float(sum(len(m.packed.idx) for m in prepared))])
        scale = float(self.world_size)  # FSDP averages the ranks' gradients: each rank's shares add up to its part
        stats = dict.fromkeys(self.loss_stats, 0.0)
        self.model.train()
        for _ in range(a.epochs_per_step):
            self.opt.zero_grad(set_to_none=True)
            for micro in prepared:
                with self.computing():
                    loss, st = self.micro_loss(micro)
                share = micro_share(micro.packed, tokens, int(rows), a.loss_aggregation)
                (loss * share * scale).backward()
                for k in self.loss_stats:  # not the grad norm, set per pass below
                    stats[k] += st[k] * share / a.epochs_per_step
            max_norm = self.options.trainer.optimizer.max_grad_norm
            if max_norm > 0:
                norm = torch.nn.utils.clip_grad_norm_(self.trainable, max_norm)
                stats[self.grad_norm_stat] = float(norm)
            self.opt.step()
            if self.master is not None:
                self.master.copy_to_model()
        summed = self.all_reduce([stats[k] for k in self.loss_stats])  # each rank holds its part of the mean
        stats.update(zip(self.loss_stats, summed))
        return stats

    # ------------------------------------------------------------------------------------- checkpoints
    def write_model(self, directory: Path, state: dict[str, torch.Tensor] | None) -> None:
        """Write the model into a checkpoint's step ``directory`` (rank 0; ``state``: the gathered full state
        under FSDP, else None): ``model/`` in ``save_pretrained`` form."""
        self.model.save_pretrained(str(directory / "model"), state_dict=state)

    def save_step(self, root: str | Path, step: int, meta: dict[str, Any]) -> str | None:
        """Checkpoint the model and optimiser as step ``step`` under ``root`` (``meta`` joins its ``state.json``);
        a collective under FSDP: every rank calls it, rank 0 writes and returns the step's directory. State moved
        to the host (``offload``) is on the GPU while it is gathered and written."""
        with self.state_offload.resident():
            return self._save_step(root, step, meta)

    def _save_step(self, root: str | Path, step: int, meta: dict[str, Any]) -> str | None:
        state = full_model_state(self.model, self.world_size)  # collectives under FSDP: every rank takes part
        optim = full_optimizer_state(self.model, self.opt, self.world_size)
        if self.master is not None:
            optim["master_weights"] = self.master.state_dict()
        if self.rank != 0:
            return None
        if storage.is_remote(root):
            return self._save_remote(str(root), step, meta, state, optim)
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

    def _save_remote(self, uri: str, step: int, meta: dict[str, Any], state: dict[str, torch.Tensor] | None,
                     optim: dict[str, Any]) -> str:
        """Rank 0's save to an object store: written into a local temporary directory, uploaded, the step's marker
        last (``storage.commit``), then the newest two kept; the local copy is removed in any case."""
        tmp = Path(tempfile.mkdtemp(prefix=f"rlhf-ckpt-{step}-"))
        try:
            self.write_model(tmp, state)
            torch.save(optim, tmp / "optimizer.pt")
            final = storage.commit(tmp, uri, step, meta)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        try:
            storage.prune(uri, keep=2)
        except storage.StorageError as e:  # the checkpoint is committed; the next save prunes again
            log.warning("could not prune %s: %s", uri, e)
        return final

