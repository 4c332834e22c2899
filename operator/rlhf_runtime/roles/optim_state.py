"""The optimiser state of a checkpoint (``optimizer.pt``), written by one layout and read by either.

One worker writes ``torch.optim.Optimizer.state_dict()``: parameters numbered 0..N-1 in the optimiser's order.
FSDP2 writes the *full* state (``torch.distributed.checkpoint.state_dict``): every rank's shards gathered on rank
0's CPU, keyed by parameter name. A job may resume on another trainer size than the one that wrote its
checkpoint (one GPU, then FSDP2 over several, or back): one worker reads FSDP2's state by position, as
``load_state_dict`` does with any keys; FSDP2 reads one worker's once its numbers are turned into the parameter
names of the same order (``named_state``), each rank keeping its own shards.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch


def full_optimizer_state(model: Any, opt: Any, world_size: int) -> dict[str, Any]:
    """The optimiser state to checkpoint. FSDP2: the *full* state (every rank's shards gathered, keyed by
    parameter name, on rank 0's CPU; a collective, every rank calls it); else the plain state dict."""
    if world_size == 1:
        return opt.state_dict()
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    return get_optimizer_state_dict(model, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def named_state(model: Any, opt: Any, state: dict[str, Any]) -> dict[str, Any]:
    """``state`` keyed by parameter name where one worker numbered its parameters (the optimiser's order, which
    is the model's over the trainable parameters under either layout); as it is where it is keyed by name."""
    groups = state.get("param_groups", [])
    if not all(isinstance(i, int) for g in groups for i in g["params"]):
        return state
    name_of = {id(p): n for n, p in model.named_parameters()}
    names = [name_of[id(p)] for g in opt.param_groups for p in g["params"]]
    numbered = [i for g in groups for i in g["params"]]
    if len(numbered) != len(names):
        raise ValueError(f"the checkpoint's optimiser state holds {len(numbered)} parameters, this trainer "
                         f"optimises {len(names)}")
    name = dict(zip(numbered, names))
    return {"state": {name[i]: v for i, v in state["state"].items()},
            "param_groups": [{**g, "params": [name[i] for i in g["params"]]} for g in groups]}


def load_optimizer_state(model: Any, opt: Any, state: dict[str, Any], world_size: int) -> None:
    """Inverse of ``full_optimizer_state``, from either layout's checkpoint; FSDP2: every rank reads the full
    state and keeps its own shards."""
    if world_size == 1:
        opt.load_state_dict(state)
        return
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    set_optimizer_state_dict(model, opt, optim_state_dict=named_state(model, opt, state),
                             options=StateDictOptions(full_state_dict=True))


def read_optimizer_state(step_dir: Path) -> dict[str, Any]:
    """The optimiser state a checkpoint step directory holds (``optimizer.pt``, on the CPU)."""
    return torch.load(step_dir / "optimizer.pt", map_location="cpu", weights_only=False)
