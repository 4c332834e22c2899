"""What a real vLLM engine reports about its MoE experts for the kernel-format plan
(``rollout.workers.expert_layout``): vLLM's own module and parameter names, the expert ids and the backend's
layout. On CPU vLLM's MoE backend (``CPU``) prepacks the expert weights, so every stacked expert parameter
carries a refusal naming it, and the kernel plan falls back to the checkpoint format. A tiny random Qwen3-MoE,
built locally, in a subprocess (keeps torch and vLLM out of pytest)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

SCRIPT = r"""
import json, sys, torch, transformers
from rlhf_testing.tiny import build_tokenizer
path = sys.argv[1]
cfg = transformers.Qwen3MoeConfig(vocab_size=64, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
    num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=32, num_experts=4,
    num_experts_per_tok=2, max_position_embeddings=256, bos_token_id=2, eos_token_id=3, pad_token_id=0,
    tie_word_embeddings=False)
torch.manual_seed(0)
transformers.Qwen3MoeForCausalLM(cfg).save_pretrained(path)
build_tokenizer(path, 64)
from vllm import LLM
from rlhf_runtime.rollout.workers import worker_param_layout
llm = LLM(path, dtype="float32", max_model_len=128, gpu_memory_utilization=0.05, enforce_eager=True)
layout = llm.collective_rpc(worker_param_layout)[0]
print("LAYOUT " + json.dumps({"experts": layout["experts"], "params": layout["params"],
                              "shard_dims": layout["shard_dims"]}))
"""


def test_cpu_engine_reports_its_stacked_experts_and_why_the_kernel_format_skips_them(tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path / "moe")], capture_output=True, text=True,
                         timeout=600, check=False, env={**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"})
    line = next((x for x in out.stdout.splitlines() if x.startswith("LAYOUT ")), None)
    assert line is not None, out.stderr[-3000:]
    layout = json.loads(line[len("LAYOUT "):])
    shapes = {n: s for n, s in layout["params"]}
    stacked = sorted(n for n in shapes if n.endswith(("w13_weight", "w2_weight")))
    assert len(stacked) == 4  # two layers, w13 and w2 each
    assert sorted(layout["experts"]) == stacked
    for name in stacked:
        assert ".experts." in name
        assert layout["experts"][name] == {"refuse": "the MoE backend CPU keeps its own layout"}
    w13 = next(n for n in stacked if n.endswith("w13_weight"))
    assert shapes[w13] == [4, 2 * 32, 64]  # (experts, gate + up rows, hidden): what KernelPlan stacks
    # vLLM's parameters carry both output_dim and input_dim (its embeddings here; on a GPU every linear weight,
    # row-parallel ones too; the CPU build prepacks linear weights and drops theirs): the layout reports both and
    # KernelPlan takes the one the shapes fit (reporting only output_dim split o_proj/down_proj along the wrong
    # dimension on a TP=2 engine, 2xH200 2026-11-24)
    assert layout["shard_dims"]["model.embed_tokens.weight"] == [0, 1]
