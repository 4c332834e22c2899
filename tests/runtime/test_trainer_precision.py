"""The trainer's update on the real ``Trainer`` (tiny Qwen2, CPU, subprocesses that keep torch out of pytest):

* bfloat16 with float32 master weights (``trainer.masterWeights: float32``, the default) updates like float32;
  ``none`` loses nearly every update at an RL learning rate (10 steps at lr 1e-6, the case the issue measured);
* FSDP2 over two ranks holding unequal shares of a batch (3 samples and 1, micro-batches of a small token budget:
  one rank runs empty micro-batches to keep the collectives in step) makes the same update as one worker on the
  whole batch: the token mean is over the whole batch, not each rank's;
* FSDP2 with bfloat16 compute over float32 shards (mixed precision over gloo) updates like one bfloat16 worker with
  masters, and its export is bfloat16: each trained weight rounded once;
* ``trainer.compile`` (torch.compile per decoder layer) under FSDP2 updates like one eager worker;
* ``trainer.reshardAfterForward: false`` (FSDP2 keeps each layer gathered from forward to backward) too;
* ``trainer.autocast`` (float32 weights, forward passes under autocast to bfloat16), one worker and FSDP2: updates
  like float32, computes log-probabilities closer to a float32 model's than bfloat16 compute over masters does,
  its in-trainer reference computes exactly as the initial policy (the KL starts at 0) and its exports are
  bfloat16, each weight rounded once;
* a checkpoint resumed with ``trainer.autocast`` switched (either way), or one worker's on two FSDP2 ranks and
  back, continues from its exact float32 weights (and its optimiser state);
* FSDP2 ranks start from a skeleton whose shards rank 0 fills from its one copy of the model: every parameter and
  buffer (the rotary frequencies, outside the state dict) equals the checkpoint's.
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
from torch._dynamo.eval_frame import _debug_get_cache_entry_list
from rlhf_runtime.roles.options import TrainerOptions
from rlhf_runtime.roles.policy import Trainer
from rlhf_testing.ranks import exit_rank

rank, world, port, out = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
runs = json.loads(sys.argv[5])  # [[name, config path, steps], ...], in order (one process group at a time)
g = torch.Generator().manual_seed(0)
n = 8
prompts = [torch.randint(5, 60, (int(k),), generator=g).tolist() for k in torch.randint(2, 7, (n,), generator=g)]
completions = [torch.randint(5, 60, (int(k),), generator=g).tolist() for k in torch.randint(1, 9, (n,), generator=g)]
batch = {"prompts": prompts, "completions": completions, "advantages": torch.randn(n, generator=g).tolist()}
if world == 2:  # unequal shares: rank 0 the first 6 samples, rank 1 the last 2
    part = slice(0, 6) if rank == 0 else slice(6, n)
    batch = {k: v[part] for k, v in batch.items()}
full = lambda p: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().float().clone()
results = {}
for i, (name, cfg, steps) in enumerate(runs):
    t = Trainer(TrainerOptions.from_config(open(cfg).read(), rank, world, "127.0.0.1", port + i))
    def weights():
        if t.master is not None and t.master.pairs:
            return {k: m.detach().clone() for (k, _), (_, m) in zip(t.model.named_parameters(), t.master.pairs)}
        return {k: full(p) for k, p in t.model.named_parameters()}
    before = weights()
    loaded = None
    if world == 2 and rank == 0 and i == 0:  # the shards filled from rank 0's copy: the checkpoint's exact values
        from transformers import AutoModelForCausalLM
        ref = AutoModelForCausalLM.from_pretrained(t.options.model.name, dtype=torch.float32)
        ours = {**before, **{k: b.detach().float() for k, b in t.model.named_buffers()}}
        theirs = {**dict(ref.named_parameters()), **dict(ref.named_buffers())}
        loaded = {"names": sorted(ours) == sorted(theirs), "buffers": len(list(ref.named_buffers())),
                  "max_diff": max(float((ours[k] - theirs[k].detach().float()).abs().max()) for k in theirs)}
    micro = len(t.micro_batches(batch["prompts"], batch["completions"]))
    start = t.logprobs(batch)  # before any update: the policy's (and the in-trainer reference's) log-probabilities
    for _ in range(steps):
        t.train(batch)
    after = weights()
    if "ckpt" in name:  # a checkpoint of the trained weights, and (below) a trainer of the other precision on it
        t.save_checkpoint()
    if rank == 0 and ("ckpt" in name or "resumed" in name):
        kept = after if "ckpt" in name else before
        torch.save(torch.cat([kept[k].flatten() for k in kept]), f"{out}/{name}.weights.pt")
    export = None
    exported = world == 2 or "autocast" in name
    if exported:
        t.export(f"{out}/{name}.export")
    if rank == 0:
        torch.save(torch.cat([(after[k] - before[k]).flatten() for k in before]), f"{out}/{name}.pt")
        if exported:
            from safetensors import safe_open
            with safe_open(f"{out}/{name}.export/model.safetensors", "pt") as f:
                tensors = {k: f.get_tensor(k) for k in f.keys()}
            # each exported tensor is the trained weight rounded once to the served dtype
            export = {"dtypes": sorted({str(v.dtype) for v in tensors.values()}), "names": sorted(tensors),
                      "max_diff": max(float((v.float() - after[k].to(v.dtype).float()).abs().max())
                                      for k, v in tensors.items())}
    results[name] = {"micro": micro, "dtypes": sorted({str(p.dtype) for p in t.model.parameters()}),
                     "resumed_from": t.resumed_from,
                     "opt_steps": sorted({float(s["step"]) for s in t.opt.state.values()}),
                     "logp": start["logp"], "ref": start["ref"],
                     "masters": len(t.master.pairs) if t.master is not None else None,
                     "export": export, "loaded": loaded,
                     "compiled": [getattr(l, "_compiled_call_impl", None) is not None for l in t.decoder_layers()],
                     # compiled versions of the decoder layer's forward after micro-batches of several shapes
                     "variants": len(_debug_get_cache_entry_list(type(t.decoder_layers()[0]).forward.__code__))
                     if t.options.trainer.compile else None,
                     # FSDP2 re-shards a layer after its forward unless reshard_after_forward is false
                     "kept": [l._get_fsdp_state()._fsdp_param_group.post_forward_mesh_info is None
                              for l in t.decoder_layers()] if world == 2 else None}
    t.close()
    del t
print(json.dumps(results))
exit_rank()  # not a plain return: see rlhf_testing.ranks
"""


def _train(tmp: Path, runs: list[tuple[str, dict, int]], world: int = 1) -> list[dict]:
    """The trainings ``runs`` (name, spec, steps) one after another in ``world`` rank processes; each update
    (rank 0's gathered weights after minus before) lands in ``tmp/<name>.pt``."""
    args = json.dumps([[name, str(write_config(tmp / f"{name}.json", spec)), steps] for name, spec, steps in runs])
    return rank_results(WORKER, world, tmp, args)


def _spec(model: Path, dtype: str, lr: float = 1e-6, **trainer: object) -> dict:
    spec = job_config(model, trainer={"replicas": 1, "gpusPerReplica": 0, **trainer},
                      algorithm={"learningRate": lr, "epochsPerStep": 1, "klCoef": 0.0})
    spec["model"] = {**spec["model"], "dtype": dtype}
    return spec


def _saved(spec: dict, root: Path) -> dict:
    return {**spec, "checkpoint": {"volume": "ckpt", "path": str(root), "everyNSteps": 1},
            "volumes": [{"name": "ckpt", "emptyDir": {}}]}


def _fsdp(spec: dict) -> dict:
    return {**spec, "trainer": {**spec["trainer"], "gpusPerReplica": 2, "strategy": "fsdp2"}}


@pytest.fixture(scope="module")
def trained(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Every training of this module, in one single-worker process and one pair of FSDP2 ranks."""
    import torch

    tmp = tmp_path_factory.mktemp("precision")
    small_budget = _spec(tiny_model, "float32", lr=1e-3, maxTokensPerMicroBatch=16)
    compiled = _spec(tiny_model, "float32", lr=1e-3, maxTokensPerMicroBatch=16, compile=True)
    single = _train(tmp, [("fp32", _spec(tiny_model, "float32"), 10), ("bf16", _spec(tiny_model, "bfloat16"), 10),
                          ("bf16-none", _spec(tiny_model, "bfloat16", masterWeights="none"), 10),
                          ("bf16-autocast", _spec(tiny_model, "bfloat16", autocast=True), 10),
                          ("ref-autocast", {**_spec(tiny_model, "bfloat16", autocast=True),
                                            "algorithm": {"learningRate": 1e-6, "klCoef": 0.05}}, 0),
                          ("one", small_budget, 2),
                          # trainer.autocast switched on a checkpoint, both ways
                          ("masters-ckpt", _saved(_spec(tiny_model, "bfloat16", lr=1e-3), tmp / "m"), 2),
                          ("autocast-resumed", _saved(_spec(tiny_model, "bfloat16", autocast=True), tmp / "m"), 0),
                          ("autocast-ckpt", _saved(_spec(tiny_model, "bfloat16", lr=1e-3, autocast=True),
                                                   tmp / "a"), 2),
                          ("masters-resumed", _saved(_spec(tiny_model, "bfloat16"), tmp / "a"), 0)])[0]
    ranks = _train(tmp, [("two", _fsdp(small_budget), 2), ("two-bf16", _fsdp(_spec(tiny_model, "bfloat16")), 10),
                         ("two-compiled", _fsdp(compiled), 2),
                         ("two-autocast", _fsdp(_spec(tiny_model, "bfloat16", autocast=True)), 10),
                         ("two-kept", _fsdp({**small_budget, "trainer": {**small_budget["trainer"],
                                                                         "reshardAfterForward": False}}), 2),
                         # one worker's checkpoint, resumed on two FSDP2 ranks; and two ranks' for one worker
                         ("two-resumed", _fsdp(_saved(_spec(tiny_model, "bfloat16"), tmp / "m")), 0),
                         ("two-ckpt", _fsdp(_saved(_spec(tiny_model, "bfloat16", lr=1e-3), tmp / "f")), 2)],
                   world=2)
    single |= _train(tmp, [("one-resumed", _saved(_spec(tiny_model, "bfloat16"), tmp / "f"), 0)])[0]
    updates = {p.stem: torch.load(p) for p in tmp.glob("*.pt")}
    return {"single": single, "ranks": ranks, "updates": updates}


def test_bfloat16_with_master_weights_updates_like_float32(trained: dict) -> None:
    import torch

    u = trained["updates"]
    ref, kept, lost = u["fp32"], u["bf16"], u["bf16-none"]
    assert float(ref.abs().mean()) > 5e-6  # 10 steps at lr 1e-6 moved the float32 weights
    # the size of the update within 1% of float32's, its direction within bfloat16 compute's noise
    assert abs(float(kept.abs().mean() / ref.abs().mean()) - 1) < 0.01
    assert float(torch.nn.functional.cosine_similarity(kept, ref, dim=0)) > 0.99
    # without masters most of it is lost: few bfloat16 weights move at all
    assert float((lost != 0).float().mean()) < 0.1
    assert float(lost.abs().mean() / ref.abs().mean()) < 0.1


def test_compiled_layers_under_fsdp2_update_like_one_eager_worker(trained: dict) -> None:
    """``trainer.compile``: the decoder layers through torch.compile (Inductor, CPU here; compiled before FSDP2
    wraps them, once for every micro-batch shape) make the same update as one eager worker, on two FSDP2 ranks
    with unequal shares. (One compiled GPU worker: the same losses as eager in ``benchmarks/train_step.py``.)"""
    ranks = trained["ranks"]
    assert all(r["two-compiled"]["compiled"] == [True, True] and r["two"]["compiled"] == [False, False]
               for r in ranks), ranks
    # micro-batches of several lengths and sequence counts, compiled once with gradients (training) and once
    # without (the log-probabilities): no recompilation per shape
    assert all(r["two-compiled"]["micro"] > 1 and r["two-compiled"]["variants"] == 2 for r in ranks), \
        [(r["two-compiled"]["micro"], r["two-compiled"]["variants"]) for r in ranks]
    u = trained["updates"]
    assert float(u["one"].abs().max()) > 1e-4
    rel = float((u["two-compiled"] - u["one"]).norm() / u["one"].norm())
    assert rel < 1e-3, rel


def test_layers_kept_gathered_under_fsdp2_update_like_one_worker(trained: dict) -> None:
    """``trainer.reshardAfterForward: false``: FSDP2 keeps each decoder layer's gathered parameters from its
    forward to its backward (the default re-shards them), and the update is the same as one worker's."""
    ranks = trained["ranks"]
    assert all(r["two-kept"]["kept"] == [True, True] and r["two"]["kept"] == [False, False] for r in ranks), ranks
    u = trained["updates"]
    assert float(u["one"].abs().max()) > 1e-4
    rel = float((u["two-kept"] - u["one"]).norm() / u["one"].norm())
    assert rel < 1e-3, rel


def test_fsdp2_ranks_with_unequal_shares_update_like_one_worker(trained: dict) -> None:
    ranks = trained["ranks"]
    assert ranks[0]["two"]["micro"] == ranks[1]["two"]["micro"] > 1  # the rank with 2 samples runs empty ones too
    one, two = trained["updates"]["one"], trained["updates"]["two"]
    assert float(one.abs().max()) > 1e-4
    # equal up to float summation order (each rank's own token mean, averaged over the ranks, was 48% off here)
    rel = float((one - two).norm() / one.norm())
    assert rel < 1e-3, rel


def test_fsdp2_mixed_precision_updates_like_one_bfloat16_worker(trained: dict) -> None:
    import torch

    ranks = trained["ranks"]
    assert all(r["two-bf16"]["dtypes"] == ["torch.float32"] for r in ranks)  # the shards are the float32 masters
    export = ranks[0]["two-bf16"]["export"]
    # the served model is bfloat16: the float32 masters, gathered and rounded once on the way out (full_model_state)
    assert export["dtypes"] == ["torch.bfloat16"] and export["max_diff"] == 0.0, export
    assert ranks[0]["two"]["export"]["dtypes"] == ["torch.float32"] and ranks[0]["two"]["export"]["max_diff"] == 0.0
    one, two = trained["updates"]["bf16"], trained["updates"]["two-bf16"]
    assert abs(float(two.abs().mean() / one.abs().mean()) - 1) < 0.01
    assert float(torch.nn.functional.cosine_similarity(one, two, dim=0)) > 0.99


def test_fsdp2_shards_filled_from_rank_0s_copy_equal_the_checkpoint(trained: dict) -> None:
    """Under FSDP2 the model is a meta-device skeleton until ``fully_shard``; rank 0 alone loads the checkpoint and
    every rank keeps its shard of the broadcast (``FSDPWorker.fill_shards``). Gathered back, every parameter and
    every buffer equals ``from_pretrained``'s, the rotary frequencies (not in the state dict) included."""
    loaded = trained["ranks"][0]["two"]["loaded"]
    assert loaded["names"] and loaded["buffers"] >= 1, loaded
    assert loaded["max_diff"] == 0.0, loaded


def _flat(logp: list[list[float]]) -> torch.Tensor:  # noqa: F821 - torch is imported inside the tests
    import torch

    return torch.tensor([x for row in logp for x in row], dtype=torch.float64)


def test_autocast_updates_like_float32_and_computes_closer_to_it(trained: dict) -> None:
    """``trainer.autocast`` on one worker: the weights are float32 themselves (no separate masters), 10 steps at lr
    1e-6 update like float32, the log-probabilities before training are closer to the float32 model's than
    bfloat16 compute over float32 masters gives (the default), and the export is bfloat16: each trained weight
    rounded once."""
    import torch

    single, u = trained["single"], trained["updates"]
    ac = single["bf16-autocast"]
    assert ac["dtypes"] == ["torch.float32"] and ac["masters"] == 0, ac  # nothing left in bfloat16 to keep
    assert single["bf16"]["dtypes"] == ["torch.bfloat16"] and single["bf16"]["masters"] > 0
    ref = u["fp32"]
    assert abs(float(u["bf16-autocast"].abs().mean() / ref.abs().mean()) - 1) < 0.01
    assert float(torch.nn.functional.cosine_similarity(u["bf16-autocast"], ref, dim=0)) > 0.99
    fp32 = _flat(single["fp32"]["logp"])
    err_autocast = float((_flat(ac["logp"]) - fp32).abs().mean())
    err_bf16 = float((_flat(single["bf16"]["logp"]) - fp32).abs().mean())
    assert 0 < err_autocast < err_bf16, (err_autocast, err_bf16)
    export = ac["export"]
    assert export["dtypes"] == ["torch.bfloat16"] and export["max_diff"] == 0.0, export


def test_autocast_reference_computes_as_the_initial_policy(trained: dict) -> None:
    """With ``trainer.autocast`` the in-trainer reference is float32 under autocast like the policy: before any
    update both give the same log-probabilities (the KL penalty starts at exactly 0)."""
    run = trained["single"]["ref-autocast"]
    assert run["ref"] is not None and run["ref"] == run["logp"]


def test_fsdp2_autocast_updates_like_one_autocast_worker(trained: dict) -> None:
    """FSDP2 with ``trainer.autocast``: float32 shards gathered in float32, forward under autocast; the update
    matches one autocast worker's on the whole batch and the export is bfloat16, rounded once."""
    import torch

    ranks = trained["ranks"]
    assert all(r["two-autocast"]["dtypes"] == ["torch.float32"] for r in ranks)
    export = ranks[0]["two-autocast"]["export"]
    assert export["dtypes"] == ["torch.bfloat16"] and export["max_diff"] == 0.0, export
    one, two = trained["updates"]["bf16-autocast"], trained["updates"]["two-autocast"]
    assert abs(float(two.abs().mean() / one.abs().mean()) - 1) < 0.01
    assert float(torch.nn.functional.cosine_similarity(one, two, dim=0)) > 0.99


def test_one_workers_checkpoint_resumes_on_fsdp2_ranks_with_its_exact_weights_and_optimiser_state(
        trained: dict) -> None:
    """A job resized from one trainer GPU to FSDP2 over two goes on from its checkpoint: the shards are its float32
    masters, the AdamW state its own. (Before, every rank failed its start in ``set_optimizer_state_dict`` with
    "KeyError: 'state.0.step'": one worker numbers its parameters, FSDP2's full state names them.)"""
    import torch

    u, resumed = trained["updates"], trained["ranks"][0]["two-resumed"]
    assert resumed["resumed_from"] == 2 and resumed["opt_steps"] == [2.0]
    assert trained["single"]["masters-ckpt"]["opt_steps"] == [2.0]
    assert torch.equal(u["two-resumed.weights"], u["masters-ckpt.weights"])


def test_fsdp2_checkpoint_resumes_on_one_worker_with_its_exact_weights_and_optimiser_state(trained: dict) -> None:
    """The other way: FSDP2's checkpoint (float32 files, AdamW state keyed by name) on one worker with master
    weights: the masters are the files' float32 values, not the bfloat16 model's."""
    import torch

    u, resumed = trained["updates"], trained["single"]["one-resumed"]
    assert resumed["resumed_from"] == 2 and resumed["opt_steps"] == [2.0] and resumed["masters"] > 0
    after = u["two-ckpt.weights"]
    assert float((after - after.bfloat16().float()).abs().max()) > 0
    assert torch.equal(u["one-resumed.weights"], after)


def test_a_checkpoint_resumed_with_autocast_switched_keeps_its_exact_float32_weights(trained: dict) -> None:
    """Master weights -> trainer.autocast: the float32 parameters are the checkpoint's masters; autocast -> master
    weights: the masters are the checkpoint's float32 files. (Before, either switch failed the trainer's start:
    "ValueError: the checkpoint holds 27 float32 master weights, this model has 0 lower-precision trainable
    parameters", and "holds 0 ..., has 27" the other way.)"""
    import torch

    u, single = trained["updates"], trained["single"]
    for saved, resumed in (("masters-ckpt", "autocast-resumed"), ("autocast-ckpt", "masters-resumed")):
        assert single[resumed]["resumed_from"] == 2, resumed
        before, after = u[f"{resumed}.weights"], u[f"{saved}.weights"]
        assert float((after - after.bfloat16().float()).abs().max()) > 0  # not representable in bfloat16
        assert torch.equal(before, after), resumed
    assert single["autocast-resumed"]["dtypes"] == ["torch.float32"]
    assert single["masters-resumed"]["dtypes"] == ["torch.bfloat16"] and single["masters-resumed"]["masters"] > 0
