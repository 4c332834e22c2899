"""The colocated memory plan's arithmetic (``rlhf_api.memory_plan``) against memory measured on GPUs.

Recorded figures (Qwen3-1.7B shape, bfloat16 with float32 master weights, one GPU):

* the trainer's step (benchmarks/README.md, "The trainer's step"; results/trainer/): 37.5 GiB allocated at its
  peak with gradient checkpointing and a 32k-token budget (eager, output-layer chunks of 2^27 logits), 39.0 GiB
  (2^29, the default); 65.9 GiB without checkpointing at a 16k budget of 4k-token sequences (2^29);
* a colocated run through the driver on one H100 (79.18 GiB): at rollout.gpuMemoryUtilization 0.75 vLLM took a
  53.81 GiB KV cache, the trainer held ~28.3 GB after step 1 and the engine's wake at step 2 ran out of memory;
  at 0.55 (4,096-token responses, 16 prompts x 8) the run went on and the KV cache held 85 of the 128 sequences
  at once;
* the same job through the driver with the plan (benchmarks/results/learning/h100-2026-12-06-colocated-memory/,
  one H100, eager engines): the trainer measured 22.66 GiB of state before the engine's build, its step peaked at
  38.93-39.05 GiB allocated, and vLLM took KV caches of 38.56, 54.39 and 62.31 GiB at 0.55, 0.75 and 0.85.
"""

from __future__ import annotations

from typing import Any

import pytest

from rlhf_api.memory_plan import (
    GIB,
    Measured,
    MemoryPlanError,
    ModelShape,
    activation_bytes,
    explain_oom,
    host_bytes,
    plan,
    trainer_state,
)
from rlhf_api.models import RLHFJobSpec

QWEN3_17B = {"model_type": "qwen3", "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 6144,
             "num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128,
             "tie_word_embeddings": True}
H100 = int(79.18 * GIB)
SHAPE = ModelShape.from_config(QWEN3_17B)


def job(util: float = 0.75, max_tokens: int = 1024, offload: str = "never", trainer: dict[str, Any] | None = None,
        rollout: dict[str, Any] | None = None, placement: dict[str, Any] | None = None) -> RLHFJobSpec:
    """The recorded run's job: GRPO 16 prompts x 8, colocated, checkpointing, 32k-token micro-batches."""
    return RLHFJobSpec.model_validate({
        "model": {"name": "/models/qwen3-1.7b", "dtype": "bfloat16"}, "image": "runtime:test",
        "trainer": {"gradientCheckpointing": True, "maxTokensPerMicroBatch": 32768, "offloadDuringRollout": offload,
                    **(trainer or {})},
        "rollout": {"gpuMemoryUtilization": util, "enforceEager": True, **(rollout or {}),
                    "sampling": {"maxTokens": max_tokens, "samplesPerPrompt": 8}},
        "placement": {"mode": "colocated", **(placement or {})}, "weightSync": {"backend": "ipc"},
        "algorithm": {"promptsPerStep": 16}, "data": {"prompts": ["p"]}, "reward": {"rule": "length"}})


def training_gib(spec: RLHFJobSpec) -> float:
    """The trainer's own part of the training phase (state, gradients, activations), as torch's allocator counts it."""
    t = plan(spec, SHAPE, H100).training
    return (t["trainer_state"] + t["gradients"] + t["activations"]) / GIB


def test_the_published_qwen3_shape_counts_its_published_parameters() -> None:
    assert SHAPE.params == 1_720_574_976
    untied = ModelShape.from_config({**QWEN3_17B, "tie_word_embeddings": False})
    assert untied.params == SHAPE.params + 151936 * 2048


def test_one_workers_state_is_the_model_and_its_float32_masters_and_moments() -> None:
    state = trainer_state(job(), SHAPE)
    assert state.resident == 14 * SHAPE.params  # bfloat16 model 2 + masters 4 + AdamW moments 8 bytes
    assert state.offloadable == 12 * SHAPE.params and state.gradients == 4 * SHAPE.params
    fsdp = trainer_state(job(trainer={"strategy": "fsdp2", "replicas": 2}), SHAPE)
    assert fsdp.parts["shards"] == 4 * SHAPE.params // 2 and fsdp.offloadable == 8 * SHAPE.params // 2
    lora = trainer_state(job(trainer={"lora": {"rank": 8}}), SHAPE)
    assert lora.parts["model"] == 2 * SHAPE.params and lora.offloadable == 12 * SHAPE.adapter_params(8, ["q_proj", "k_proj", "v_proj", "o_proj"])


@pytest.mark.parametrize("spec_over, measured_gib, tolerance", [
    ({}, (37.5, 39.0), 0.03),  # checkpointing on, 32k budget
    ({"gradientCheckpointing": False, "maxTokensPerMicroBatch": 16384}, (65.9, 65.9), 0.06),
])
def test_the_training_peak_matches_the_recorded_steps(spec_over: dict[str, Any], measured_gib: tuple[float, float],
                                                      tolerance: float) -> None:
    got = training_gib(job(trainer=spec_over))
    assert measured_gib[0] * (1 - tolerance) <= got <= measured_gib[1] * (1 + tolerance)


def test_the_kv_cache_at_075_is_what_vllm_took() -> None:
    p = plan(job(0.75), SHAPE, H100, offload=False)
    assert abs(p.kv_cache / GIB - 53.81) < 0.5


def test_the_075_case_that_died_at_step_2_is_refused_with_the_field_and_the_largest_value() -> None:
    p = plan(job(0.75), SHAPE, H100)
    assert not p.fits
    with pytest.raises(MemoryPlanError) as e:
        p.check()
    text = str(e.value)
    assert "rollout.gpuMemoryUtilization to at most 0.6" in text and "trainer.offloadDuringRollout always" in text
    util = float(text.split("gpuMemoryUtilization to at most ")[1].split()[0])
    assert 0.55 <= util < 0.75
    assert plan(job(util), SHAPE, H100).fits  # the value it names fits


def test_the_recorded_trainer_after_step_1_refuses_075_and_accepts_055() -> None:
    trainer = int(28.3e9) - int(1.5 * GIB)  # the ~28.3 GB the trainer held after step 1, less its process part
    m = Measured(H100, trainer, 12 * SHAPE.params)
    assert not plan(job(0.75), SHAPE, H100, m).fits
    ok = plan(job(0.55, 4096), SHAPE, H100, m)
    assert ok.fits and abs(ok.sequences_at_once - 85) <= 2 and ok.batch_sequences == 128


def test_an_fp8_kv_cache_holds_twice_the_tokens_of_a_bfloat16_one() -> None:
    m = Measured(H100, int(28.3e9) - int(1.5 * GIB), 12 * SHAPE.params)
    bf16 = plan(job(0.55, 4096), SHAPE, H100, m)
    fp8 = plan(job(0.55, 4096, rollout={"kvCacheDtype": "fp8"}), SHAPE, H100, m)
    assert fp8.kv_cache == bf16.kv_cache and fp8.kv_bytes_per_token * 2 == bf16.kv_bytes_per_token
    assert bf16.sequences_at_once < 128 and fp8.sequences_at_once == 128  # 85 of 128 in bfloat16 (above)


def test_auto_offload_makes_075_fit_where_the_pods_memory_holds_the_state() -> None:
    p = plan(job(0.75, offload="auto"), SHAPE, H100)
    assert p.fits and p.offload
    assert p.rollout["trainer_state"] == 2 * SHAPE.params  # the bfloat16 model alone stays on the GPU
    assert p.training["trainer_state"] == 14 * SHAPE.params  # back on the GPU for the step
    small = plan(job(0.75, offload="auto", trainer={"resources": {"memory": "16Gi"}}), SHAPE, H100)
    assert not small.offload and not small.fits
    assert "trainer.resources.memory must then hold it" in " ".join(small.problems)
    assert not plan(job(0.55, offload="auto"), SHAPE, H100).offload  # fits without: nothing moves
    resident = plan(job(0.3, offload="always", placement={"colocatedSleep": False}), SHAPE, H100)
    assert not resident.offload and resident.notes  # awake engines: nothing can move


def test_an_explicit_kv_cache_that_does_not_fit_names_the_largest_that_does() -> None:
    p = plan(job(rollout={"kvCacheMemoryGiB": 60}), SHAPE, H100)
    text = " ".join(p.problems)
    assert "rollout.kvCacheMemoryGiB to at most" in text
    kv = float(text.split("kvCacheMemoryGiB to at most ")[1].split()[0].rstrip(","))
    assert plan(job(rollout={"kvCacheMemoryGiB": kv}), SHAPE, H100).fits


def test_a_training_phase_that_does_not_fit_names_a_micro_batch_budget_that_does() -> None:
    spec = job(0.3, trainer={"gradientCheckpointing": False, "maxTokensPerMicroBatch": 65536})
    text = " ".join(plan(spec, SHAPE, H100).problems)
    assert "trainer.gradientCheckpointing true" in text
    budget = int(text.split("maxTokensPerMicroBatch to at most ")[1].split(",")[0].split()[0])
    assert 1024 <= budget < 65536
    assert plan(job(0.3, trainer={"gradientCheckpointing": False, "maxTokensPerMicroBatch": budget}), SHAPE,
                H100).fits
    assert activation_bytes(SHAPE, budget, 2, False) < activation_bytes(SHAPE, 65536, 2, False)


def test_an_out_of_memory_failure_carries_the_plan_and_other_failures_do_not() -> None:
    p = plan(job(0.55), SHAPE, H100)
    wake = "RuntimeError: CUDA Error: out of memory at /workspace/csrc/cumem_allocator.cpp:163"
    text = explain_oom(wake, p)
    assert text.startswith(wake) and "rollout.gpuMemoryUtilization" in text and "GiB" in text
    assert explain_oom("ValueError: bad prompt", p) == "ValueError: bad prompt"
    assert explain_oom(wake, None) == wake


@pytest.mark.parametrize("text, value", [("64Gi", 64 * GIB), ("500M", 500_000_000), ("1e9", 10**9), ("2Ti", 2 << 40)])
def test_memory_quantities(text: str, value: int) -> None:
    assert host_bytes(text) == value


@pytest.mark.parametrize("util, offload, vllm_kv_gib", [(0.55, False, 38.56), (0.75, True, 54.39), (0.85, True, 62.31)])
def test_the_plan_against_the_runs_through_the_driver(util: float, offload: bool, vllm_kv_gib: float) -> None:
    m = Measured(H100, int(22.66 * GIB), 12 * SHAPE.params)
    p = plan(job(util, 4096, offload="auto"), SHAPE, H100, m)
    assert p.fits and p.offload == offload
    assert 0 <= vllm_kv_gib - p.kv_cache / GIB < 0.7  # never more than vLLM takes, at most 0.7 GiB less
    trainer = (p.training["trainer_state"] + p.training["gradients"] + p.training["activations"]) / GIB
    assert 38.93 * 0.98 <= trainer <= 39.05 * 1.02
