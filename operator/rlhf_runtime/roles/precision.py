"""Mixed precision for the trained roles: float32 master weights and optimiser state, compute in the model's dtype.

Why: AdamW on bfloat16 parameters loses every update smaller than half a bfloat16 step of the weight (8 bits of
mantissa: ~0.4% relative). At RL learning rates that is nearly all of them: an AdamW update is about the
learning rate in size (1e-6), far below that share of a weight of typical size (1e-2), so most bfloat16 values
never change. ``trainer.masterWeights`` (default ``float32``) fixes it two ways, one per
layout, both with float32 gradients accumulated over the micro-batches and float32 optimiser state:

* FSDP2 (several workers): the model is loaded in float32 and sharded with a ``MixedPrecisionPolicy``
  (``fsdp_policy``): parameters are gathered and computed in the model's dtype, gradients reduce-scattered and
  kept in float32; the optimiser steps the float32 shards. A weight sync casts each shard to the model's dtype
  before it is gathered (``weight_sync.producers.ParamSource``); checkpoints hold the float32 weights.
* One worker: the model stays in its dtype (the engines' tensors of a sync and the resident IPC path read it
  as is), and ``MasterWeights`` keeps a float32 copy of each lower-precision trainable parameter: each
  backward's gradient is added to the copy's float32 gradient as soon as it is computed (and the model's own
  freed), the optimiser steps the copies, and the model's parameters are set to the copies rounded to their
  dtype. Checkpoints keep the copies in the optimiser state (``state_dict``), so a resumed run continues from
  the exact float32 weights.

``trainer.autocast`` computes the other common way (Hugging Face Trainer's ``bf16=True``, TRL): the weights *are*
float32 (loaded so, one worker or FSDP2 shards gathered in float32, no mixed-precision policy; one worker's
``MasterWeights`` keep only trainable parameters still in the model's dtype, e.g. a LoRA adapter PEFT did not
widen) and the roles' forward passes run under ``torch.autocast`` to the model's dtype (``compute_context``):
matrix multiplications in bfloat16, normalisation, softmax and the residual stream in float32. The update is as
precise as with master weights; the forward pass rounds less (its log-probabilities are closer to a float32
model's), for a cast of every weight per forward. Syncs and exports cast to the model's dtype on the way out.
A run resumed with the other of the two (``trainer.autocast`` switched on a checkpoint) continues from the exact
float32 weights too (``resume_weights``).

Memory per trained parameter: 16 bytes (float32 weights 4, gradients 4, AdamW moments 8) plus, with one worker,
the model's own copy (2 in bfloat16); ``masterWeights: none`` is 8 bytes in bfloat16 (weights, gradients and
moments in the model's dtype) and loses small updates. A float32 model needs neither.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from typing import Any

import torch


def wants_masters(master_weights: str, dtype: torch.dtype) -> bool:
    """Whether float32 master weights apply: asked for (``float32``) and the model's dtype is lower."""
    return master_weights == "float32" and dtype != torch.float32


def uses_autocast(autocast: bool, dtype: torch.dtype) -> bool:
    """Whether ``trainer.autocast`` applies: asked for and the model's dtype is lower than float32."""
    return autocast and dtype != torch.float32


def compute_context(autocast: bool, device: torch.device, dtype: torch.dtype) -> Any:
    """Where the roles' forward passes (and the losses built from them) run: under ``torch.autocast`` to ``dtype``
    on ``device``'s type with ``autocast`` (``uses_autocast``), else as they are (a no-op context)."""
    if not autocast:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


def fsdp_policy(compute: torch.dtype) -> Any:
    """FSDP2's mixed precision over float32 parameters: gathered and computed in ``compute``, gradients reduced
    and kept in float32."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=torch.float32)


class MasterWeights:
    """Float32 masters of a single worker's lower-precision trainable parameters (module docstring).

    ``params`` is what the optimiser steps and what gradient clipping reads: the masters in place of those
    parameters, the float32 ones as they are. After each optimiser step ``copy_to_model`` writes the masters
    back, rounded, into the model's parameters (in place: their storage, which the resident IPC sync maps,
    stays). ``state_dict`` / ``load_state_dict``: the masters' values, for checkpoints."""

    def __init__(self, params: Iterable[torch.nn.Parameter]) -> None:
        self.pairs: list[tuple[torch.nn.Parameter, torch.nn.Parameter]] = []
        self.params: list[torch.nn.Parameter] = []
        for p in params:
            if p.dtype == torch.float32:
                self.params.append(p)
                continue
            m = torch.nn.Parameter(p.detach().float().clone())
            p.register_post_accumulate_grad_hook(self._accumulator(m))
            self.pairs.append((p, m))
            self.params.append(m)

    @staticmethod
    def _accumulator(master: torch.nn.Parameter) -> Any:
        def hook(p: torch.Tensor) -> None:
            g = p.grad
            if g is None:
                return
            if master.grad is None:
                master.grad = g.float()
            else:
                master.grad.add_(g)
            p.grad = None  # the float32 sum is the gradient; the model's lower-precision one is freed

        return hook

    @torch.no_grad()
    def copy_to_model(self) -> None:
        for p, m in self.pairs:
            p.copy_(m)

    def state_dict(self) -> list[torch.Tensor]:
        return [m.detach().cpu() for _, m in self.pairs]

    @torch.no_grad()
    def load_state_dict(self, values: list[torch.Tensor]) -> None:
        if len(values) != len(self.pairs):
            raise ValueError(f"the checkpoint holds {len(values)} float32 master weights, this model has "
                             f"{len(self.pairs)} lower-precision trainable parameters")
        for (p, m), v in zip(self.pairs, values):
            if tuple(v.shape) != tuple(m.shape):
                raise ValueError(f"a master weight of the checkpoint is {list(v.shape)}, the model's parameter "
                                 f"{list(m.shape)}")
            m.copy_(v.to(m.device))
        self.copy_to_model()


#: safetensors' names of the floating dtypes a checkpoint may store
_STORED = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
#: (stored, wanted) pairs where loading in the stored dtype and casting later gives exactly the same values
_EXACT_WIDENING = {(torch.bfloat16, torch.float32), (torch.float16, torch.float32)}


def stored_dtype(source: str) -> torch.dtype | None:
    """The one floating dtype the safetensors files of the local model directory ``source`` hold (read from the
    files' headers, not their tensors), or None: not a local directory, no safetensors files, an unreadable
    header, several floating dtypes, or one torch has no dtype for here (float8)."""
    import json
    import struct
    from pathlib import Path

    files = sorted(Path(source).glob("*.safetensors")) if Path(source).is_dir() else []
    found: set[str] = set()
    for f in files:
        try:
            with f.open("rb") as fh:
                (n,) = struct.unpack("<Q", fh.read(8))
                if n > 100 << 20:  # safetensors' own limit on a header: a corrupt file
                    return None
                header = json.loads(fh.read(n))
        except (OSError, ValueError, struct.error):
            return None  # unreadable here: from_pretrained reports it
        found |= {v["dtype"] for k, v in header.items()
                  if k != "__metadata__" and (v["dtype"] in _STORED or v["dtype"].startswith("F8"))}
    return _STORED.get(found.pop()) if len(found) == 1 else None


def host_load_dtype(source: str, wanted: torch.dtype) -> torch.dtype:
    """The dtype to load ``source`` in on a host before its tensors are copied into parameters of ``wanted``:
    the checkpoint's own when that is narrower and widens exactly (a bfloat16 or float16 file for float32
    masters), so the host holds half the bytes and casts nothing, the copies giving the same values; else
    ``wanted``."""
    stored = stored_dtype(source)
    return stored if (stored, wanted) in _EXACT_WIDENING else wanted


def float32_tensors(source: str, names: list[str]) -> list[torch.Tensor] | None:
    """The tensors ``names`` of the local model directory ``source`` (its safetensors files) when it holds every
    one of them and stores float32 only (written from float32 weights: ``trainer.autocast``'s or FSDP2's
    checkpoints), else None."""
    from pathlib import Path

    from safetensors import safe_open

    if stored_dtype(source) != torch.float32:
        return None
    found: dict[str, torch.Tensor] = {}
    for f in sorted(Path(source).glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as fh:
            for name in set(names).intersection(fh.keys()):
                found[name] = fh.get_tensor(name)
    return [found[n] for n in names] if len(found) == len(set(names)) else None


@torch.no_grad()
def resume_weights(master: MasterWeights | None, named: list[tuple[str, torch.nn.Parameter]],
                   masters: list[torch.Tensor] | None, source: str | None, sharded: Any = None) -> str | None:
    """A checkpoint's exact float32 weights, whichever precision or layout wrote it (``named``: the model's
    trainable parameters; ``masters``: the checkpoint's ``MasterWeights`` values, if one worker with master
    weights wrote it; ``source``: its model directory; ``sharded``: the FSDP2 model, else None). Masters go into
    this worker's masters, or where no lower-precision parameters are left (``trainer.autocast``; FSDP2's float32
    shards, each rank keeping its own) into the float32 parameters they stood for, in the same order; a
    checkpoint without masters but with float32 files (``trainer.autocast``'s, FSDP2's) gives its files' values
    to one worker's masters. Returns why the weights stay as the files held them (rounded once to the model's
    dtype), or None."""
    masters = masters or None  # trainer.autocast's checkpoints hold an empty list (no lower-precision parameters)
    if masters is not None and master is not None and master.pairs:
        master.load_state_dict(masters)
        return None
    if masters is not None:
        wide = [(n, p) for n, p in named if p.dtype == torch.float32]
        if [tuple(v.shape) for v in masters] != [tuple(p.shape) for _, p in wide]:
            return (f"its {len(masters)} float32 master weights do not match this model's {len(wide)} float32 "
                    "trainable parameters")
        if sharded is not None:
            from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

            full = {n: v for (n, _), v in zip(wide, masters)}  # every rank read them all
            set_model_state_dict(sharded, full, options=StateDictOptions(full_state_dict=True, strict=False))
            return None
        for (_, p), v in zip(wide, masters):
            p.copy_(v.to(p.device))
        return None
    if master is None or not master.pairs or source is None:
        return None
    names = {id(p): n for n, p in named}
    values = float32_tensors(source, [names[id(p)] for p, _ in master.pairs])
    if values is None:
        return "it holds no master weights and its model files are not float32"
    master.load_state_dict(values)
    return None
