"""LoRA (``spec.trainer.lora``) end to end on CPU: real Ray, real vLLM engines serving the adapter (vLLM LoRA),
PEFT in the trainer; each sync moves the adapter only, and validation compares the synced engine (base + adapter)
with a fresh plain engine of the merged weights."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from safetensors import safe_open

from tests.runtime.conftest import job_config, start_driver, write_config

pytestmark = pytest.mark.runtime

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]
RANK, ALPHA = 8, 16


def lora_job(model: Path, steps: int, algorithm: dict | None = None, trainer: dict | None = None, **over) -> dict:
    """The tiny CPU job with a rank-8 adapter on the attention projections, validation on."""
    return job_config(
        model,
        algorithm={"steps": steps, "learningRate": 5e-3, **(algorithm or {})},
        rollout={"sampling": {"temperature": 1.0, "maxTokens": 8, "samplesPerPrompt": 8}},
        trainer={"replicas": 1, "gpusPerReplica": 0,
                 "lora": {"rank": RANK, "alpha": ALPHA, "targetModules": TARGETS}, **(trainer or {})},
        weightSync={"validate": True},
        **over,
    )


def tensors(path: Path) -> dict[str, np.ndarray]:
    with safe_open(str(path), "np") as f:
        names = f.keys()  # a safetensors file, not a dict
        return {k: f.get_tensor(k) for k in names}


def adapter_param_bytes(model: Path) -> int:
    """rank x (in + out) float32 values per target module of the tiny model (from its config)."""
    cfg = json.loads((model / "config.json").read_text())
    h, kv = cfg["hidden_size"], cfg["num_key_value_heads"] * cfg["head_dim"]
    q_out = cfg["num_attention_heads"] * cfg["head_dim"]
    shapes = {"q_proj": (h, q_out), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q_out, h)}
    return cfg["num_hidden_layers"] * sum(RANK * (i + o) * 4 for i, o in (shapes[t] for t in TARGETS))


def test_lora_syncs_the_adapter_only_validates_and_exports_merged_weights(tiny_model: Path, tmp_path: Path) -> None:
    out, ckpt_dir = tmp_path / "out", tmp_path / "ckpt"
    spec = lora_job(tiny_model, 10, output={"volume": "data", "path": str(out)},
                    checkpoint={"volume": "data", "path": str(ckpt_dir), "everyNSteps": 5},
                    volumes=[{"name": "data", "emptyDir": {}}])
    run = start_driver(tmp_path, write_config(tmp_path / "job.json", spec))
    assert run.wait(timeout=240) == 0, run.tail()
    records = run.records()
    assert records[-1]["runtime"]["state"] == "Succeeded"

    # validated twice: after the first sync (zero adapter) and, on the export, with the trained adapter
    first = [r["validation"] for r in records if "validation" in r]
    final = [r["export_validation"] for r in records if "export_validation" in r]
    assert [v["validated"] for v in first] == [True] and [v["validated"] for v in final] == [True]
    assert final[0]["synced"] == final[0]["fresh"] and final[0]["synced"] != first[0]["synced"]

    base = tensors(tiny_model / "model.safetensors")
    full_bytes = sum(t.nbytes for t in base.values())
    expected = adapter_param_bytes(tiny_model)
    steps = run.steps()
    assert [r["step"] for r in steps] == list(range(1, 11))
    for r in steps:
        sync = r["sync"]
        assert sync["format"] == "lora" and sync["full_bytes"] == full_bytes, sync
        # the adapter's tensors plus the safetensors header and adapter_config.json: a few KiB on top
        assert expected <= sync["bytes"] <= expected + 8192, (sync["bytes"], expected)
        assert sync["bytes"] * 15 < full_bytes, (sync["bytes"], full_bytes)  # ~21x smaller for this tiny model
        assert r["throughput"]["weightSyncGbps"] == pytest.approx(sync["bytes"] / sync["total_s"] / 1e9, rel=1e-3)
    assert len({r["sync"]["adapter_id"] for r in steps}) == 10  # a new vLLM LoRA id every sync
    rewards = [r["throughput"]["rewardMean"] for r in steps]
    assert sum(rewards[-3:]) / 3 > sum(rewards[:3]) / 3 + 0.2, rewards  # the engines serve the trained adapter

    # checkpoints hold the adapter (PEFT's files), not the model
    step_dir = ckpt_dir / "step-00000010"
    assert not (step_dir / "model").exists()
    adapter = tensors(step_dir / "adapter" / "adapter_model.safetensors")
    assert json.loads((step_dir / "adapter" / "adapter_config.json").read_text())["r"] == RANK
    assert len(adapter) == 2 * len(TARGETS) * 2  # A and B per target module and layer
    # the export is a plain model (the fresh engine above loaded it): the base with W + alpha/r B A in the
    # target modules and every other tensor unchanged
    merged = tensors(out / "final" / "model.safetensors")
    assert set(merged) == set(base)
    changed = set()
    for name, w in base.items():
        module = name.removesuffix(".weight")
        a = adapter.get(f"base_model.model.{module}.lora_A.weight")
        if a is None:
            assert np.array_equal(merged[name], w), name
            continue
        b = adapter[f"base_model.model.{module}.lora_B.weight"]
        np.testing.assert_allclose(merged[name], w + ALPHA / RANK * (b @ a), atol=1e-5)
        if not np.array_equal(merged[name], w):
            changed.add(name)
    assert len(changed) == 2 * len(TARGETS), changed  # training moved every adapter


def test_validation_catches_an_incomplete_adapter(tiny_model: Path, tmp_path: Path) -> None:
    # one module's adapter is left out of every sync: the first validation (zero adapter) cannot see it, the one
    # after the last step (trained adapter vs a fresh engine of the merged weights) must
    cfg = write_config(tmp_path / "job.json", lora_job(tiny_model, 4))
    run = start_driver(tmp_path, cfg, "--skip-tensor", "layers.1.self_attn.o_proj", hooks=True)
    assert run.wait(timeout=240) == 3, run.tail()
    records = run.records()
    assert [r["validation"]["validated"] for r in records if "validation" in r] == [True, False]
    assert [r["step"] for r in run.steps()] == [1, 2, 3, 4]
    assert records[-1]["runtime"]["state"] == "Failed"
    assert "weight-sync validation failed" in records[-1]["runtime"]["message"]


# A Trainer with LoRA, gradient checkpointing and a reference inside it (klCoef > 0): one step, a checkpoint, then a
# fresh Trainer resumes.
WORKER = r"""
import json, sys
import torch
from transformers import AutoModelForCausalLM
from rlhf_runtime.roles.batches import pack, token_logprobs
from rlhf_runtime.roles.options import TrainerOptions
from rlhf_runtime.roles.policy import Trainer

cfg, base = open(sys.argv[1]).read(), sys.argv[2]
batch = {"prompts": [[5, 6, 7], [8, 9]], "completions": [[20, 21, 22], [24, 25]], "advantages": [1.0, -1.0]}
t = Trainer(TrainerOptions.from_config(cfg))
trainable = {n for n, p in t.model.named_parameters() if p.requires_grad}
opt_params = sum(len(g["params"]) for g in t.opt.param_groups)
t.train(batch)
t.save_checkpoint()
adapter = {k: v.clone() for k, v in t.model.state_dict().items() if ".lora_" in k}
moments = [st["exp_avg"].clone() for st in t.opt.state.values()]
out = t.logprobs(batch)
micro = pack(batch["prompts"], batch["completions"], [0], "cpu")
plain = AutoModelForCausalLM.from_pretrained(base).eval()
with torch.no_grad():
    base_lp = token_logprobs(plain, micro)[0]
ref_is_base = torch.allclose(torch.tensor(out["ref"][0]), base_lp[0, 3:6], atol=1e-5)
r = Trainer(TrainerOptions.from_config(cfg))
same_adapter = all(torch.equal(v, r.model.state_dict()[k]) for k, v in adapter.items())
same_moments = all(torch.equal(a, st["exp_avg"]) for a, st in zip(moments, r.opt.state.values()))
print(json.dumps({"trainable": sorted(trainable), "opt_params": opt_params, "ref_is_base": ref_is_base,
                  "policy_moved": out["logp"] != out["ref"], "resumed_from": r.resumed_from,
                  "same_adapter": same_adapter, "same_moments": same_moments, "n_moments": len(moments)}))
"""


def test_trainer_trains_only_the_adapter_and_resumes_it(tiny_model: Path, tmp_path: Path) -> None:
    spec = lora_job(tiny_model, 1, algorithm={"learningRate": 5e-2, "klCoef": 0.1},
                    trainer={"gradientCheckpointing": True},
                    checkpoint={"volume": "data", "path": str(tmp_path / "ckpt"), "everyNSteps": 1},
                    volumes=[{"name": "data", "emptyDir": {}}])
    cfg = write_config(tmp_path / "job.json", spec)
    proc = subprocess.run([sys.executable, "-c", WORKER, str(cfg), str(tiny_model)], capture_output=True, text=True,
                          timeout=180, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    assert res["trainable"] and all(".lora_A." in n or ".lora_B." in n for n in res["trainable"])
    assert len(res["trainable"]) == 2 * len(TARGETS) * 2 == res["opt_params"] == res["n_moments"]
    assert res["ref_is_base"] and res["policy_moved"]  # the reference is the base: the adapter switched off
    assert res["resumed_from"] == 1 and res["same_adapter"] and res["same_moments"]
