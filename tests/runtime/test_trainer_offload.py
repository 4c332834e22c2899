"""``trainer.offloadDuringRollout`` on the real ``Trainer`` (tiny Qwen2, CPU, subprocesses that keep torch out of
pytest): a trainer whose state is moved out between steps (``set_offload(True)``, as the driver switches it on)
trains and checkpoints exactly like one that keeps it, one bfloat16 worker with float32 masters and two FSDP2
ranks (each DTensor moment's local shard moved; the checkpoint's collectives gather it back in place). Between
steps the moved tensors are out (``state_offload.moved``), and the AdamW moments exist from the start.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.runtime.conftest import job_config, rank_results, write_config

pytestmark = pytest.mark.runtime

WORKER = r"""
import json, sys
import torch
from rlhf_runtime.roles.options import TrainerOptions
from rlhf_runtime.roles.policy import Trainer
from rlhf_testing.ranks import exit_rank

rank, world, port, out = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
runs = json.loads(sys.argv[5])  # [[name, config path, offload], ...]
g = torch.Generator().manual_seed(0)
n = 8
prompts = [torch.randint(5, 60, (int(k),), generator=g).tolist() for k in torch.randint(2, 7, (n,), generator=g)]
completions = [torch.randint(5, 60, (int(k),), generator=g).tolist() for k in torch.randint(1, 9, (n,), generator=g)]
batch = {"prompts": prompts, "completions": completions, "advantages": torch.randn(n, generator=g).tolist()}
if world == 2:
    part = slice(0, 5) if rank == 0 else slice(5, n)
    batch = {k: v[part] for k, v in batch.items()}
full = lambda p: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().float().clone()
results = {}
for i, (name, cfg, offload) in enumerate(runs):
    t = Trainer(TrainerOptions.from_config(open(cfg).read(), rank, world, "127.0.0.1", port + i))
    moments_at_start = sum(1 for s in t.opt.state.values() if "exp_avg" in s)
    moved = t.set_offload(offload)
    out_between = []
    for _ in range(3):
        t.train(batch)
        out_between.append(bool(t.state_offload.moved))
        t.save_checkpoint()
    t.state_offload.reload()
    weights = torch.cat([full(m).flatten() for _, m in t.master.pairs] if t.master is not None
                        else [full(p).flatten() for p in t.model.parameters()])
    moments = torch.cat([full(s[k]).flatten() for s in t.opt.state.values() for k in ("exp_avg", "exp_avg_sq")])
    if rank == 0:
        torch.save({"weights": weights, "moments": moments}, f"{out}/{name}.pt")
    results[name] = {"moments_at_start": moments_at_start, "params": len(list(t.opt.param_groups[0]["params"])),
                     "moved_gib": moved.get("offload_gib", 0.0), "out_between": out_between}
    t.close()
    del t
print(json.dumps(results))
exit_rank()
"""


def _train(tmp: Path, runs: list[tuple[str, dict, bool]], world: int) -> dict:
    args = json.dumps([[name, str(write_config(tmp / f"{name}.json", spec)), off] for name, spec, off in runs])
    return rank_results(WORKER, world, tmp, args)[0]


def _spec(model: Path, root: Path, world: int) -> dict:
    # CPU ranks: gpusPerReplica counts the FSDP2 ranks (no GPU in the process: they compute on the CPU)
    trainer = {"replicas": 1, "gpusPerReplica": 0 if world == 1 else world, "maxTokensPerMicroBatch": 16,
               **({"strategy": "fsdp2"} if world == 2 else {})}
    spec = job_config(model, trainer=trainer, algorithm={"learningRate": 1e-3, "epochsPerStep": 1, "klCoef": 0.0})
    spec["model"] = {**spec["model"], "dtype": "bfloat16"}
    return {**spec, "checkpoint": {"volume": "ckpt", "path": str(root), "everyNSteps": 1},
            "volumes": [{"name": "ckpt", "emptyDir": {}}]}


@pytest.mark.parametrize("world", [1, 2])
def test_a_trainer_with_its_state_moved_out_between_steps_trains_and_checkpoints_like_one_without(
        tiny_model: Path, tmp_path: Path, world: int) -> None:
    import torch

    runs = [("kept", _spec(tiny_model, tmp_path / "kept", world), False),
            ("moved", _spec(tiny_model, tmp_path / "moved", world), True)]
    res = _train(tmp_path, runs, world)
    kept, moved = torch.load(tmp_path / "kept.pt"), torch.load(tmp_path / "moved.pt")
    assert torch.equal(kept["weights"], moved["weights"]) and torch.equal(kept["moments"], moved["moments"])
    assert res["moved"]["out_between"] == [True] * 3 and res["kept"]["out_between"] == [False] * 3
    assert res["moved"]["moved_gib"] > 0
    assert res["kept"]["moments_at_start"] == res["kept"]["params"]  # the moments exist from the start
    last = {}
    for name in ("kept", "moved"):  # the checkpoints hold the same optimiser state
        steps = sorted((tmp_path / name).glob("step-*"))
        assert [int(s.name.split("-")[1]) for s in steps] == [2, 3]
        last[name] = steps[-1]
    a = torch.load(last["kept"] / "optimizer.pt", weights_only=False)
    b = torch.load(last["moved"] / "optimizer.pt", weights_only=False)
    flat = lambda s: torch.cat([v.flatten().float() for st in s["state"].values() for k, v in sorted(st.items())
                                if k != "step"])
    assert torch.equal(flat(a), flat(b))
