"""An engine actor's two-phase start on a real Ray and vLLM (CPU): made with ``build=False`` it imports vLLM and
holds no engine, so a colocated GPU engine's process start and imports overlap the trainers' load while its vLLM
engine, which sizes its KV cache from the GPU memory it sees free, is built only after them (``build()``); with
``rollout.kvCacheMemoryGiB`` the cache is that size."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.runtime.conftest import engine_script, job_config

pytestmark = pytest.mark.runtime

SCRIPT = r"""
from rlhf_runtime.rollout.engines import Engine

try:
    actor = ray.remote(Engine).options(num_cpus=0, runtime_env={"env_vars": env}).remote(EngineOptions(kw, env), build=False)
    def probe(self):
        out = {"vllm_imported": "vllm.entrypoints.llm" in sys.modules, "has_llm": hasattr(self, "llm"),
               "import_seconds": self.import_seconds, "env_kv": __import__("os").environ.get("VLLM_CPU_KVCACHE_SPACE")}
        if hasattr(self, "llm"):
            c = self.llm.llm_engine.vllm_config.cache_config
            out.update(kv_bytes=c.kv_cache_memory_bytes, blocks=c.num_gpu_blocks, block_size=c.block_size)
        return out
    before = ray.get(actor.__ray_call__.remote(probe), timeout=300)
    ready_before = ray.get(actor.ready.remote(), timeout=60)
    built = ray.get(actor.build.remote(), timeout=300)
    again = ray.get(actor.build.remote(), timeout=60)
    after = ray.get(actor.__ray_call__.remote(probe), timeout=60)
    outs = ray.get(actor.generate.remote([[3, 4, 5]], {"n": 2, "max_tokens": 3, "temperature": 1.0, "seed": 0}),
                   timeout=120)
    print("RESULT " + json.dumps({"before": before, "ready_before": ready_before, "built": built, "again": again,
                      "after": after, "samples": [len(s) for s in outs[0]["samples"]]}))
finally:
    ray.shutdown()
"""


def test_an_engine_made_without_build_imports_vllm_and_builds_on_request(tiny_model: Path) -> None:
    # with rollout.kvCacheMemoryGiB (which lets a colocated GPU engine build beside the trainers): that KV cache
    spec = job_config(tiny_model, rollout={"kvCacheMemoryGiB": 0.125})
    out = engine_script(SCRIPT, spec)
    # made: vLLM imported in the actor's process, no engine yet
    assert out["before"]["vllm_imported"] and not out["before"]["has_llm"], out
    assert out["before"]["import_seconds"] > 0 and out["ready_before"] == 0.0, out
    # build(): the engine exists, its build time is what ready reports; a second build builds nothing
    assert out["after"]["has_llm"] and out["built"] > 0 and out["again"] == out["built"], out
    assert len(out["samples"]) == 2 and all(1 <= n <= 3 for n in out["samples"]), out  # n=2, max_tokens 3
    # the cache vLLM made is the size asked for, not the CPU default's 1 GiB (VLLM_CPU_KVCACHE_SPACE, which vLLM
    # would let override it, is left out): K and V, per layer, float32, one KV head of head_dim 64
    cfg = json.loads((tiny_model / "config.json").read_text())
    per_block = 2 * cfg["num_hidden_layers"] * out["after"]["block_size"] * cfg["num_key_value_heads"] \
        * cfg["head_dim"] * 4
    assert out["after"]["env_kv"] is None and out["after"]["kv_bytes"] == 2**27, out
    assert out["after"]["blocks"] == 2**27 // per_block, (out, per_block)
