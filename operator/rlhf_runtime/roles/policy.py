"""The trainer: an HF Transformers causal-LM policy trained with a clipped policy gradient, in a Ray actor.

One ``Trainer`` actor per trainer worker, a ``roles.base.FSDPWorker`` (device, seed ``algorithm.seed``, process
group, sharding, optimiser, training step, checkpoint writing). ``strategy: single`` is one worker (GPU or CPU).
``strategy: fsdp2`` runs one worker per trainer GPU, each joining a torch.distributed NCCL group (rank 0's
address is handed out by the driver) and sharding every decoder layer and then the whole model with
``fully_shard``; every worker runs ``train`` on its slice of the batch and all of them iterate the weights for a
sync (``full_tensor()`` is a collective), while only rank 0 sends (GPU only; not exercised by the CPU tests).
The driver calls it through ``roles.api.PolicyActor``.

Guarantees:

* Optimiser: AdamW with ``algorithm.learningRate`` and ``trainer.optimizer`` (betas, weight decay), gradient
  clipping at ``maxGradNorm`` (0 disables it).
* Loss: ``rlhf_runtime.algo.objectives.policy_loss`` (clipped policy gradient with ``clipRatio`` /
  ``clipRatioHigh``, optional k3 KL to the frozen initial policy when ``klCoef > 0`` and ``klMode`` loss),
  aggregated per ``lossAggregation`` over the batch, ``epochsPerStep`` passes, packed micro-batches of at most
  ``trainer.maxTokensPerMicroBatch`` tokens. Advantages (per sample; per token: PPO's GAE) come from the driver.
* Checkpoints (``rlhf_runtime.infra.checkpoint``): the model (``save_pretrained``), the optimiser state and the
  step, written atomically; a new actor resumes from the newest one (the same step on every rank, chosen by rank 0),
  so the step counter continues; a checkpoint of the other kind (adapter or full model) than ``trainer.lora`` asks
  for is refused. Under FSDP2 both are gathered to full tensors (``torch.distributed.checkpoint.state_dict``) and
  every rank takes its own shards back on resume. FSDP2 also runs on CPU over gloo (tests).
* LoRA (``trainer.lora``, ``rlhf_runtime.infra.lora``): the base model is frozen and wrapped with a PEFT adapter;
  the optimiser holds the adapter's parameters only. The in-trainer reference is the same model with the
  adapter disabled (no second copy of the base). A sync is ``adapter_payload`` (the adapter files, handed to
  the engines by the driver through Ray's object store), not the weight-transfer group. Checkpoints hold
  ``adapter/`` (the adapter files, full precision) instead of ``model/``; ``save_weights``/``export``/
  ``stage_weights`` write the merged weights (a plain HF model).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from rlhf_runtime.algo.objectives import aggregate, correction_weights, policy_loss
from rlhf_runtime.infra import checkpoint as ckpt
from rlhf_runtime.infra import flops, node_files, storage
from rlhf_runtime.infra import lora as lora_mod
from rlhf_runtime.roles import attention
from rlhf_runtime.roles.base import (
    FSDPWorker,
    MicroBatch,
    full_model_state,
    load_kwargs,
    release_cached_gpu_memory,
)
from rlhf_runtime.roles.batches import (
    Packed,
    TokenScorer,
    causal_lm,
    from_lists,
    per_token,
    put,
    token_logprobs,
)
from rlhf_runtime.roles.optim_state import read_optimizer_state
from rlhf_runtime.roles.options import TrainerOptions
from rlhf_runtime.roles.reference import TrainerReference
from rlhf_runtime.vllm import compat as vllm_compat

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
                   "merges.txt", "tokenizer.model", "generation_config.json", "chat_template.jinja")


def match_engine_nccl_settings() -> bool:
    """Batch-invariant vLLM engines (``VLLM_BATCH_INVARIANT=1``) switch their process to deterministic NCCL
    settings (one channel, Simple protocol, one thread, ...). The trainer shares a weight-transfer
    communicator with them, so it takes the same settings, before its first NCCL communicator (NCCL reads
    them once per process). Returns whether they were applied."""
    if os.environ.get("VLLM_BATCH_INVARIANT", "0") in ("", "0"):
        return False
    override = vllm_compat.batch_invariance_env_override()
    if override is None:
        return False
    override()
    return True


class Trainer(FSDPWorker):
    """The policy trainer (module docstring); one actor per trainer worker."""

    loss_stats = ("loss", "kl", "clip_fraction", "entropy", "mismatch_kl", "mismatch_log_ratio", "correction_fraction")
    grad_norm_stat = "grad_norm"

    def __init__(self, options: TrainerOptions) -> None:
        self.started = time.time()  # in ``info``: with the driver's times, where an actor's start goes
        match_engine_nccl_settings()
        super().__init__(options)
        self.dtype = getattr(torch, options.model.dtype)
        self.step = 0
        self.resumed_from: int | None = None
        self.lora = options.trainer.lora
        self.base_model = options.model.name
        found = self._agreed_checkpoint()
        opt_state = self._resume(*found) if found else None
        kw = load_kwargs(options.model, revision=not found or bool(self.lora))
        self.model = self._load_policy(found[1] if found else None, kw)
        self.scorer = TokenScorer(self.model)  # the FSDP root: token_logprobs gathers the output layer in it
        self._load_reference(kw)
        self.shard()  # FSDP2: the shards are filled here (``deferred``)
        params = [p for p in self.model.parameters() if p.requires_grad] if self.lora else self.model.parameters()
        self.make_optimizer(params, options.algorithm.learning_rate, opt_state,
                            str(found[1] / "model") if found and not self.lora else None)
        if found and options.checkpoint and options.checkpoint.uri:  # loaded: the downloaded copy is not needed
            shutil.rmtree(found[1], ignore_errors=True)
        self.sender: Any = None
        self.staged: str | None = None  # stage_weights' directory on this node (rank 0)
        # the policy's full weights (a LoRA model's base weights; its adapter is adapter_bytes)
        self.param_bytes = sum(p.numel() * self.dtype.itemsize for n, p in self.model.named_parameters()
                               if ".lora_" not in n)
        self.param_count = flops.model_active_params(self.model, causal_lm(self.model).config)  # MFU's N
        self.init_seconds = time.time() - self.started

    def _resume(self, step: int, path: Path) -> dict[str, Any]:
        """Continue at checkpoint ``step`` (at ``path``): the step counter, and its optimiser state (returned).
        Its kind (a LoRA adapter or a full model) must match ``spec.trainer.lora``."""
        self.step = self.resumed_from = step
        if (path / "adapter").is_dir() != bool(self.lora):
            raise RuntimeError(f"checkpoint step {self.step} at {path} holds "
                               f"{'a LoRA adapter' if (path / 'adapter').is_dir() else 'a full model'}, but "
                               f"spec.trainer.lora is {'set' if self.lora else 'unset'}: use another "
                               "spec.checkpoint.path")
        return read_optimizer_state(path)

    def _load_policy(self, saved: Path | None, kw: dict[str, Any]) -> Any:
        """The policy: ``spec.model`` or the checkpoint at ``saved``. LoRA: the frozen base from ``spec.model``,
        wrapped with a fresh adapter or the checkpoint's."""
        from transformers import AutoModelForCausalLM

        checkpointing = self.options.trainer.gradient_checkpointing
        if not self.lora:
            source = str(saved / "model") if saved else self.options.model.name
            # FSDP2: a skeleton, its shards filled from rank 0's copy in ``shard``
            model, self.deferred = self.load_model(AutoModelForCausalLM, source, {**kw, "dtype": self.train_dtype},
                                                   widen=True)
            model.config.dtype = self.dtype  # float32 masters under FSDP2; exports and checkpoints say model.dtype
            attention.use_varlen(model, self.device, self.dtype)
            if checkpointing:
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            return model
        model = AutoModelForCausalLM.from_pretrained(self.options.model.name, **kw).to(self.device)
        attention.use_varlen(model, self.device, self.dtype)
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            model.enable_input_require_grads()  # the frozen embeddings' output must carry grads
        model = lora_mod.wrap(model, self.lora)
        if saved:
            tensors, _ = lora_mod.deserialize(lora_mod.read_files(saved / "adapter"))
            lora_mod.load_adapter(model, tensors)
        return model

    def _load_reference(self, kw: dict[str, Any]) -> None:
        """The reference inside the trainer (``own_ref``, placement ``trainer`` with a KL penalty): a model of its
        own (``self.ref``, ``reference.TrainerReference``: the initial policy, also after a resume), or (LoRA) the
        policy with its adapter disabled (``self.ref`` None)."""
        self.ref: TrainerReference | None = None
        self.own_ref = self.options.own_reference
        if self.own_ref and not self.lora:  # float32 like the policy with trainer.autocast: the KL starts at 0
            self.ref = TrainerReference(self, {**kw, "dtype": torch.float32} if self.autocast else kw)

    def shard(self) -> None:
        """``FSDPWorker.shard`` of the policy, then of the in-trainer reference (``TrainerReference.shard``)."""
        super().shard()
        if self.ref is not None:
            self.ref.shard()

    def load_weight_transfer(self) -> float:
        """vLLM's weight-transfer modules, imported (seconds returned). The driver asks for it once the trainers
        are up, beside the engines' start, so that a colocated engine, built only after the trainers, no longer
        waits for this import too; bounded by the progress deadline, not by weightSync.timeoutSeconds (which is
        for the transfer itself) as it would be in the first init_weight_sync."""
        t = time.perf_counter()
        from rlhf_runtime.vllm import plugin as vllm_plugin
        from rlhf_runtime.weight_sync import senders  # noqa: F401 - loaded here, not in the first sync

        vllm_compat.require_supported_vllm()
        vllm_plugin.register()
        # vLLM's trainer-side weight-transfer engines, which the senders build (``weight_sync.senders``)
        from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory  # noqa: F401
        return time.perf_counter() - t

    def _agreed_checkpoint(self) -> tuple[int, Path] | None:
        """The checkpoint every rank resumes from. Rank 0 picks the newest complete one (``checkpoint.latest``, or
        ``storage.latest`` for an object-store ``checkpoint.uri``) and broadcasts it (``checkpoint.agree``), so all
        FSDP ranks load the same step even when a save commits (or a torn one is cleaned up) between the ranks'
        own looks at the directory. An object-store step is downloaded by every rank into a local directory of its
        own. ``None``: start from the base model."""
        c = self.options.checkpoint
        if c is None:
            return None
        if c.uri:
            found_uri = ckpt.agree(storage.latest(c.uri) if self.rank == 0 else None, self.rank, remote=True)
            if found_uri is None:
                return None
            step, uri = found_uri
            local = Path(tempfile.gettempdir()) / f"rlhf-resume-{os.getpid()}-rank{self.rank}"
            return step, storage.download(uri, local)
        found = ckpt.agree(ckpt.latest(c.path) if self.rank == 0 else None, self.rank)  # a collective
        if found is None or self.world_size == 1:
            return found
        step, path = found
        if not path.is_dir():
            raise RuntimeError(
                f"trainer rank {self.rank}: checkpoint step {step} chosen by rank 0 is not at {path} here: "
                "spec.checkpoint.volume must be one volume shared by every trainer pod"
            )
        return step, path

    # ------------------------------------------------------------------------------------------ info
    def info(self) -> dict[str, Any]:
        return {"step": self.step, "resumed_from": self.resumed_from, "param_bytes": self.param_bytes,
                "device": str(self.device), "pid": os.getpid(), "threads": torch.get_num_threads(),
                "spawned": self.spawned, "started": self.started, "init_seconds": self.init_seconds}

    def address(self) -> tuple[str, int]:
        """Where the engines reach this rank for the weight-transfer group: the address Ray knows this node
        by (the pod IP), not vLLM's ``get_ip``, which asks the route to a public address and, in a pod
        without one, falls back to 0.0.0.0 (the engines then dial themselves and the first sync hangs)."""
        from ray.util import get_node_ip_address
        return get_node_ip_address(), vllm_compat.open_port()

    # ----------------------------------------------------------------------------------- weight sync
    def init_weight_sync(self, handles: list[Any], worlds: list[int], options: Any,
                         skip: list[str] | None = None) -> dict[str, Any]:
        """(Re-)create the weight-transfer group with ``handles`` (rank 0; other ranks only gather) and a sender
        of ``options`` (``weight_sync.options.WeightSyncOptions``, resolved by the driver); returns what the sender
        uses (``TrainerEngineSender.describe``). Called again after an engine was replaced: the old group is
        dropped. Every engine call and the group's collectives are bounded by ``options.timeout_s``."""
        from rlhf_runtime.weight_sync import EngineFanOut, ParamSource, make_sender

        addr, port = self.address()
        group = {"master_address": addr, "master_port": port, "world_size": 1 + sum(worlds), "rank": self.rank}
        source = ParamSource(self.model, self.dtype, set(skip or []))
        self.sender = None
        fanout = EngineFanOut(handles, worlds, options.timeout_s, pipelined=options.rpc == "pipelined")
        self.sender = make_sender(options, fanout, source, group)
        return self.sender.describe()

    def sync_weights(self) -> dict[str, float]:
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        result = self.sender.send()
        release_cached_gpu_memory(self.options.colocated, self.device)  # colocated: gathered FSDP2 parameters, before the KV wake
        return result

    def adapter_payload(self, skip: list[str] | None = None) -> dict[str, Any]:
        """(LoRA) What a weight sync sends instead of the weights: ``files``, the adapter files
        (``lora.serialize``: safetensors in the spec dtype, and the config), ``bytes`` (their size) and
        ``serialize_s``. ``skip``: leave out every adapter tensor whose name contains one of these (the
        validation debug option)."""
        if not self.lora:
            raise RuntimeError("adapter_payload needs spec.trainer.lora")
        t = time.perf_counter()
        tensors = {k: v.detach().to(self.dtype) for k, v in lora_mod.adapter_tensors(self.model).items()
                   if not any(name in k for name in skip or [])}
        files = lora_mod.serialize(tensors, lora_mod.adapter_config(self.lora, self.base_model))
        return {"files": files, "bytes": sum(len(b) for b in files.values()), "tensors": len(tensors),
                "serialize_s": time.perf_counter() - t}

    # -------------------------------------------------------------------------------------- training
    def fsdp_root(self) -> Any:
        return self.scorer

    @torch.no_grad()
    def logprobs(self, batch: dict[str, Any]) -> dict[str, Any]:
        """Per completion token (``batches.to_lists``): log-probabilities under the current policy (``logp``) and,
        with the reference inside the trainer, under the reference (``ref``, else None); ``seconds`` of compute.
        Under FSDP every rank calls it with its own slice."""
        t0 = time.perf_counter()
        temp = self.options.temperature
        n = len(batch["prompts"])
        logp: list[list[float]] = [[] for _ in range(n)]
        ref: list[list[float]] | None = [[] for _ in range(n)] if self.own_ref else None
        self.model.eval()
        for micro in self.micro_batches(batch["prompts"], batch["completions"]):
            with self.computing():
                put(logp, token_logprobs(self.scorer, micro, temp)[0], micro)
                if ref is not None:
                    put(ref, self._ref_logprobs(micro, temp), micro)
        return {"logp": logp, "ref": ref, "seconds": time.perf_counter() - t0}

    def _ref_logprobs(self, micro: Packed, temp: float) -> torch.Tensor:
        """The in-trainer reference's token log-probabilities (LoRA: the base model, adapter disabled)."""
        if self.ref is not None:
            return self.ref.logprobs(micro, temp)
        with self.model.disable_adapter():
            return token_logprobs(self.scorer, micro, temp)[0]

    def train(self, batch: dict[str, Any]) -> dict[str, float]:
        """``batch``: ``prompts`` and ``completions`` (token ids per sample) and ``advantages``: one float per
        sample, or one per completion token (lists). Optional per-token lists: ``old_logprobs`` (the policy's
        before this step, from ``logprobs``; when absent, computed here for epochsPerStep > 1 and taken from the
        loss pass itself for one pass), ``ref_logprobs`` (from a reference actor; else the trainer's own
        reference, if any) and ``rollout_logprobs`` (the engines', for the rollout correction). The KL penalty
        enters the loss only with ``algorithm.klMode`` loss. Returns loss statistics (``FSDPWorker.optimise``: loss,
        kl, clip_fraction, entropy, mismatch_kl, mismatch_log_ratio, correction_fraction, grad_norm), the step
        counter and ``train_s``."""
        t0 = time.perf_counter()
        stats = self.optimise(batch)
        self.step += 1
        stats["step"] = self.step
        stats["train_s"] = time.perf_counter() - t0
        stats.update(self.efficiency(batch, stats["train_s"]))
        return stats

    def efficiency(self, batch: dict[str, Any], seconds: float) -> dict[str, float]:
        """The step's training tokens (prompt and completion, every rank's), tokens/s per trainer GPU (or worker)
        and, on a GPU of known peak, MFU (``infra.flops``: model FLOPs of ``epochsPerStep`` passes). A collective
        under FSDP."""
        lens = [len(p) + len(c) for p, c in zip(batch["prompts"], batch["completions"])]
        tokens, scored, squares = self.all_reduce([float(sum(lens)), float(sum(len(c) for c in batch["completions"])),
                                                   float(sum(n * n for n in lens))])
        out = {"train_tokens": tokens, "train_tokens_per_second_per_gpu": tokens / seconds / self.world_size}
        peak = flops.peak_flops(torch.cuda.get_device_name(self.device)) if self.device.type == "cuda" else None
        if peak:
            lm = causal_lm(self.model)
            n = self.options.algorithm.epochs_per_step * flops.train_flops(lm.config, self.param_count, int(tokens),
                                                                      int(scored), int(squares))
            out["mfu"] = n / seconds / (self.world_size * peak)
        return out

    def _kl_in_loss(self) -> bool:
        a = self.options.algorithm
        return a.kl_coef > 0 and a.kl_mode == "loss"

    def micro_inputs(self, batch: dict[str, Any], micro: Packed) -> dict[str, Any]:
        """The micro-batch's advantages (per token, ``[1, L]``), old log-probabilities and, with the KL penalty in
        the loss, the reference's. With one optimiser pass and no ``old_logprobs`` the old ones are None: the
        weights do not change before its backward passes, so the "old" policy is the current one and the loss
        pass's log-probabilities (detached) are its values; a separate forward pass would compute the same
        numbers (up to dropout) at a third of the step's compute."""
        temp = self.options.temperature
        adv_in = batch["advantages"]
        adv = from_lists(adv_in, micro) if adv_in and isinstance(adv_in[0], list) else per_token(adv_in, micro)
        if batch.get("old_logprobs") is not None:
            old = from_lists(batch["old_logprobs"], micro)
        elif self.options.algorithm.epochs_per_step == 1:
            old = None  # the loss pass's own log-probabilities, detached: the same weights
        else:
            old = token_logprobs(self.scorer, micro, temp)[0]
        ref = None
        if self._kl_in_loss() and batch.get("ref_logprobs") is not None:
            ref = from_lists(batch["ref_logprobs"], micro)
        elif self._kl_in_loss() and self.own_ref:
            ref = self._ref_logprobs(micro, temp)
        rollout = batch.get("rollout_logprobs")
        return {"advantages": adv, "old": old, "ref": ref,
                "rollout": from_lists(rollout, micro) if rollout is not None else None}

    def micro_loss(self, micro: MicroBatch) -> tuple[torch.Tensor, dict[str, float]]:
        """``objectives.policy_loss`` of the micro-batch under the current weights, with the rollout-correction
        weights (``algorithm.rolloutCorrection``, ``objectives.correction_weights``) when the batch carries the
        engines' log-probabilities, their mismatch statistics, and the mean entropy of its tokens'
        distributions (aggregated like the loss)."""
        a = self.options.algorithm
        p = micro.packed
        logp, ent = token_logprobs(self.scorer, p, self.options.temperature, entropy=True)
        old = logp.detach() if micro.inputs["old"] is None else micro.inputs["old"]
        weights, mismatch = None, dict.fromkeys(("mismatch_kl", "mismatch_log_ratio", "correction_fraction"), 0.0)
        if micro.inputs["rollout"] is not None:  # the engines' log-probabilities of the sampled tokens
            c = a.rollout_correction
            weights, mismatch = correction_weights(old, micro.inputs["rollout"], p.mask, c.mode, c.level, c.cap,
                                                   p.seq)
        loss, stats = policy_loss(logp, old, micro.inputs["advantages"], p.mask, a.clip_ratio, a.clip_high(),
                                  a.loss_aggregation, micro.inputs["ref"], a.kl_coef if self._kl_in_loss() else 0.0,
                                  seq=p.seq, weights=weights)
        stats.update(mismatch)
        stats["entropy"] = float(aggregate(ent, p.mask, a.loss_aggregation, p.seq)) if ent is not None else 0.0
        return loss, stats

    # ----------------------------------------------------------------------------------- persistence
    def save_checkpoint(self) -> str | None:
        """The policy at the current step under ``spec.checkpoint.path`` (``FSDPWorker.save_step``; a collective
        under FSDP: every rank calls it, rank 0 writes and returns the step's directory)."""
        c = self.options.checkpoint
        if c is None:
            return None
        return self.save_step(c.location, self.step, {"base_model": self.base_model, "lora": bool(self.lora)})

    def write_model(self, directory: Path, state: dict[str, torch.Tensor] | None) -> None:
        """``model/``, or with LoRA ``adapter/``: the adapter in full precision (the base is spec.model's)."""
        if not self.lora:
            super().write_model(directory, state)
            return
        files = lora_mod.serialize(lora_mod.adapter_tensors(self.model),
                                   lora_mod.adapter_config(self.lora, self.base_model))
        lora_mod.write_files(files, directory / "adapter")

    def save_weights(self, path: str) -> str:
        """The current policy as a loadable checkpoint (weights, config and tokenizer) at ``path``; with LoRA the
        merged weights (``lora.merged_state``), a plain HF model."""
        out = Path(path)
        # a collective under FSDP: the driver calls every rank. FSDP2's float32 masters are cast to the served dtype
        # on the GPU as they are gathered; one worker's float32 weights (trainer.autocast) as they are written
        state = None if self.lora else full_model_state(self.model, self.world_size, self.dtype)  # LoRA: merged
        if self.rank != 0:
            return str(out)
        if self.lora:
            self.model.get_base_model().save_pretrained(str(out), state_dict=lora_mod.merged_state(self.model,
                                                                                                 self.lora))
        else:
            self.model.save_pretrained(str(out), state_dict=state)
        base = Path(self.base_model)
        for name in TOKENIZER_FILES:
            if (base / name).is_file() and not (out / name).exists():
                shutil.copy(base / name, out / name)
        return str(out)

    def export(self, path: str) -> str | None:
        """The current policy in Hugging Face format at ``path`` (``spec.output``): weights (safetensors),
        config and the base model's tokenizer, written to a temporary sibling and renamed into place, so
        ``path`` is either the previous export or the complete new one. A collective under FSDP: every rank
        calls it; rank 0 writes and returns the path."""
        if storage.is_remote(path):
            return self._export_remote(path)
        out = Path(path)
        tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
        if self.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            out.parent.mkdir(parents=True, exist_ok=True)
        try:
            self.save_weights(str(tmp))
            if self.rank != 0:
                return None
            self._save_tokenizer(str(tmp))
            old = out.with_name(f".{out.name}.old-{os.getpid()}")
            if out.exists():
                out.rename(old)
            tmp.rename(out)
            shutil.rmtree(old, ignore_errors=True)
        except BaseException:
            if self.rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)
            raise
        return str(out)

    def _save_tokenizer(self, directory: str) -> None:
        """The base model's tokenizer (``spec.model``, its revision) into an export's ``directory``."""
        from transformers import AutoTokenizer

        kw: dict[str, Any] = {"trust_remote_code": self.options.model.trust_remote_code}
        if self.options.model.revision:
            kw["revision"] = self.options.model.revision
        AutoTokenizer.from_pretrained(self.base_model, **kw).save_pretrained(directory)

    def _export_remote(self, uri: str) -> str | None:
        """``export`` to an object store (``spec.output.uri``): written into a local temporary directory, then
        published at ``uri`` (``storage.publish``: the previous export's marker removed, the files uploaded, the
        ``_COMPLETE`` marker last). A collective under FSDP; rank 0 returns the URI."""
        tmp = tempfile.mkdtemp(prefix="rlhf-export-") if self.rank == 0 else ""
        try:
            self.save_weights(tmp)  # a collective under FSDP
            if self.rank != 0:
                return None
            self._save_tokenizer(tmp)
            storage.publish(tmp, uri)
        finally:
            if tmp:
                shutil.rmtree(tmp, ignore_errors=True)
        return uri

    def stage_weights(self) -> tuple[str, list[str]] | None:
        """The current policy (``save_weights``) in a fresh temporary directory on this node, to be read there or
        copied to other nodes (``node_files.copy_to`` with ``read_staged``); rank 0 returns the directory and its
        files, other ranks (which only take part in the FSDP gather) None. ``drop_staged`` removes it."""
        self.drop_staged()
        path = tempfile.mkdtemp(prefix="rlhf-stage-") if self.rank == 0 else ""
        try:
            self.save_weights(path)  # a collective under FSDP: the driver calls every rank
        except BaseException:
            if path:
                shutil.rmtree(path, ignore_errors=True)
            raise
        if self.rank != 0:
            return None
        self.staged = path
        return path, node_files.list_files(path)

    def read_staged(self, name: str) -> bytes:
        """One file of the staged weights (a name ``stage_weights`` returned)."""
        if self.staged is None or name not in node_files.list_files(self.staged):
            raise FileNotFoundError(f"{name!r} is not a staged weights file")
        return (Path(self.staged) / name).read_bytes()

    def drop_staged(self) -> None:
        """Remove the staged weights (no-op when none)."""
        if self.staged:
            shutil.rmtree(self.staged, ignore_errors=True)
            self.staged = None
