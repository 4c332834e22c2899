"""The trainer's state between the device and one host buffer (``rlhf_runtime.roles.offload``), on the CPU with the
real pieces the trainer uses: bfloat16 parameters with ``precision.MasterWeights`` and fused AdamW.

* AdamW's state created at once (``init_optimizer_state``) steps exactly as the state its first step creates;
* steps with the masters and moments moved out between them (``StateOffload``) give bit-identical weights and
  moments to steps without, and between steps every moved tensor lives in the one host buffer;
* ``resident`` brings the state back for a block (a checkpoint) and moves it out again after.
"""

from __future__ import annotations

import torch

from rlhf_runtime.roles.offload import StateOffload, init_optimizer_state
from rlhf_runtime.roles.precision import MasterWeights


def model_and_optimizer(seed: int = 0) -> tuple[torch.nn.Module, MasterWeights, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 8)).to(torch.bfloat16)
    master = MasterWeights(model.parameters())
    opt = torch.optim.AdamW(master.params, lr=1e-2, weight_decay=0.1, fused=True)
    return model, master, opt


def step(model: torch.nn.Module, master: MasterWeights, opt: torch.optim.Optimizer, i: int) -> None:
    x = torch.randn(16, 32, generator=torch.Generator().manual_seed(100 + i)).to(torch.bfloat16)
    model(x).float().pow(2).mean().backward()
    opt.step()
    master.copy_to_model()
    opt.zero_grad(set_to_none=True)


def moments(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [v.clone() for s in opt.state.values() for k, v in s.items() if k != "step"]


def inside(t: torch.Tensor, flat: torch.Tensor) -> bool:
    start = flat.data_ptr()
    return start <= t.data_ptr() and t.data_ptr() + t.numel() * t.element_size() <= start + flat.numel()


def test_state_created_at_once_steps_like_the_state_the_first_step_creates() -> None:
    lazy, eager = model_and_optimizer(), model_and_optimizer()
    assert init_optimizer_state(eager[2]) == len(eager[1].params)
    assert all(torch.count_nonzero(t) == 0 for t in moments(eager[2]))
    for i in range(3):
        step(*lazy, i)
        step(*eager, i)
    assert all(torch.equal(a, b) for a, b in zip(moments(lazy[2]), moments(eager[2])))
    assert all(torch.equal(a, b) for a, b in zip(lazy[0].parameters(), eager[0].parameters()))
    assert init_optimizer_state(eager[2]) == 0  # nothing left to create


def test_steps_with_the_state_moved_out_between_them_equal_steps_without() -> None:
    kept, moved = model_and_optimizer(), model_and_optimizer()
    for m in (kept, moved):
        init_optimizer_state(m[2])
    off = StateOffload(moved[2], [m for _, m in moved[1].pairs], torch.device("cpu"))
    off.enabled = True
    n = len(off.tensors())
    assert n == 3 * len(moved[1].pairs)  # the masters and both moments of each
    assert off.nbytes() == 12 * sum(p.numel() for p in moved[0].parameters())
    for i in range(4):
        assert ("reload_s" in off.reload()) == (i > 0)  # the state back before each step but the first
        step(*kept, i)
        step(*moved, i)
        timing = off.offload()
        assert timing["offload_gib"] > 0 and off.flat is not None
        assert all(inside(t, off.flat) for t in off.tensors())  # between steps: in the host buffer
    off.reload()
    assert not any(inside(t, off.flat) for t in off.tensors())
    assert all(torch.equal(a, b) for a, b in zip(moments(kept[2]), moments(moved[2])))
    assert all(torch.equal(a, b) for a, b in zip(kept[0].parameters(), moved[0].parameters()))
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(kept[1].pairs, moved[1].pairs))


def test_resident_brings_the_state_back_for_a_block_and_moves_it_out_after() -> None:
    _, master, opt = model_and_optimizer()
    init_optimizer_state(opt)
    off = StateOffload(opt, [m for _, m in master.pairs], torch.device("cpu"))
    assert off.offload() == {}  # disabled: nothing moves
    off.enabled = True
    off.offload()
    with off.resident():
        assert not off.moved and not any(inside(t, off.flat) for t in off.tensors())
        saved = [m.detach().clone() for m in master.params]
    assert off.moved and all(inside(t, off.flat) for t in off.tensors())
    assert all(torch.equal(a, b) for a, b in zip(saved, master.params))
