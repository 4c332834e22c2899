"""A Qwen3-MoE policy: HF's fused expert tensors are un-fused on the way into vLLM, and the synced engine
matches a fresh engine loaded from the trainer's weights token for token (real vLLM CPU MoE kernels)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.runtime.conftest import built, job_config, start_driver, write_config

pytestmark = pytest.mark.runtime


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return built(tmp_path_factory, "tiny-moe", "rlhf_testing.tiny:build_tiny_model", "arch='qwen3_moe', seed=0")


def test_moe_sync_unfuses_experts_and_validates(tiny_moe: Path, tmp_path: Path) -> None:
    cfg = write_config(tmp_path / "job.json", job_config(tiny_moe, algorithm={"steps": 3, "learningRate": 1e-2}))
    run = start_driver(tmp_path, cfg, "--validate")
    assert run.wait(timeout=300) == 0, run.tail()
    validation = [r["validation"] for r in run.records() if "validation" in r]
    assert validation and validation[0]["validated"], validation
    assert validation[0]["synced"] == validation[0]["fresh"]
    assert [r["step"] for r in run.steps()] == [1, 2, 3]
