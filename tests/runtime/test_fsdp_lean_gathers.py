"""The gathers a kernel plan needs only (``senders.agreed_gathers``, always on in the kernel format): FSDP2
shards sent ungathered where they are a tensor-parallel engine worker's shard (the kernel format over IPC from
FSDP2 ranks into a TP engine), and no gather of what no engine takes (a tied head's second name). On two real
``Trainer`` processes that shard a real tiny Qwen2 (tied embeddings) with ``fully_shard`` over gloo (CPU), each
rank's kernel-format tensors for the TP=2 worker on its GPU are the same with and without the gathers left out,
and far fewer gathers run. Ranks whose shards are not their workers' (or that disagree) gather every shard: a
rank skipping a gather the other runs would leave both waiting in it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import free_port
from tests.runtime.conftest import job_config, write_config

pytestmark = pytest.mark.runtime

# A tiny Qwen2 whose KV heads split two ways (the shared tiny model has one KV head: vLLM replicates it under TP=2),
# with a tied head (vLLM's engine has no lm_head parameter then; the trainer's stream has it under both names).
BUILD = r"""
import sys, torch
from transformers import AutoModelForCausalLM, Qwen2Config
from rlhf_testing.tiny import build_tokenizer
cfg = Qwen2Config(vocab_size=64, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
                  num_key_value_heads=2, head_dim=64, max_position_embeddings=512, tie_word_embeddings=True,
                  bos_token_id=2, eos_token_id=3, pad_token_id=0)
torch.manual_seed(0)
AutoModelForCausalLM.from_config(cfg).save_pretrained(sys.argv[1])
build_tokenizer(sys.argv[1], 64)
"""

# One trainer rank: the kernel plan for the TP=2 engine worker ``worker`` (vLLM's per-rank Qwen2 layout: fused
# qkv and gate_up split by rows per part, o and down by columns, vocabulary rows halved, norms whole, the tied
# head not a parameter of its own), its tensors gathered, then with the agreed gathers only.
#
# How it ends matters: each rank waits for the other at a barrier (no collective of either is still running) and
# leaves through ``rlhf_testing.ranks.exit_rank`` (why: its docstring; this test found it).
WORKER = r"""
import json, sys, traceback
import torch
import torch.distributed as dist
from rlhf_runtime.roles.options import TrainerOptions
from rlhf_runtime.roles.policy import Trainer
from rlhf_testing.ranks import exit_rank
from rlhf_runtime.weight_sync.formats import KernelPlan
from rlhf_runtime.weight_sync.producers import GATHER_BUCKET_BYTES, ParamSource
from rlhf_runtime.weight_sync.senders import agreed_gathers


def main(cfg, rank, port, worker):
    t = Trainer(TrainerOptions.from_config(open(cfg).read(), rank, 2, "127.0.0.1", port))
    source = ParamSource(t.model, torch.float32)
    hf = dict(source.wire_shapes())
    params, dims = [], {}
    for name, shape in hf.items():
        rows, rest = shape[0], list(shape[1:])
        if ".k_proj." in name or ".v_proj." in name or ".up_proj." in name or name == "lm_head.weight":
            continue  # fused into the q_proj / gate_proj entry; the tied head
        if ".q_proj." in name:
            fused = name.replace("q_proj", "qkv_proj")
            parts = [name.replace("q_proj", p) for p in ("q_proj", "k_proj", "v_proj")]
            params.append((fused, [sum(hf[p][0] for p in parts) // 2, *rest]))
        elif ".gate_proj." in name:
            fused = name.replace("gate_proj", "gate_up_proj")
            params.append((fused, [(hf[name][0] + hf[name.replace("gate_proj", "up_proj")][0]) // 2, *rest]))
        elif ".o_proj." in name or ".down_proj." in name:
            fused = name
            params.append((name, [rows, rest[0] // 2]))
        elif "norm" in name:
            params.append((name, list(shape)))
            continue
        else:  # embed_tokens
            fused = name
            params.append((name, [rows // 2, *rest]))
        dims[fused] = [0, 1]
    layout = {"params": params, "world_size": 2, "shard_dims": dims,
              "packed_modules_mapping": {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}}
    plan = KernelPlan.build(source, layout, tp_rank=worker)
    assert plan.ok, plan.reason
    local_ok, unused = agreed_gathers(plan, source)  # a collective: both ranks call it here
    # the stream's gathers: one all-gather per tensor (full_tensor), per bucket of 4 KiB, then the default bucket
    source.gather_bucket_bytes = 0
    single = {n: x.clone() for n, x in plan.iterate(source)}
    collectives = [source.collectives]
    source.gather_bucket_bytes = 4096
    small = {n: x.clone() for n, x in plan.iterate(source)}
    collectives.append(source.collectives)
    source.gather_bucket_bytes = GATHER_BUCKET_BYTES
    gathered = {n: x.clone() for n, x in plan.iterate(source)}
    collectives.append(source.collectives)
    full_gathers = source.gathers
    source.local, source.drop = set(local_ok), set(unused)
    local = {n: x.clone() for n, x in plan.iterate(source)}
    return {
        "rank": rank, "worker": worker, "local": sorted(local_ok), "unused": sorted(unused), "names": len(hf),
        "gathers": [full_gathers, source.gathers], "collectives": collectives + [source.collectives],
        "bucketed_differ": sorted(n for n in single if not (torch.equal(single[n], gathered[n])
                                                          and torch.equal(single[n], small[n]))),
        "sizes": {n: x.numel() * x.element_size() for n, x in single.items()},
        "differ": sorted(n for n in gathered if n not in local or not torch.equal(gathered[n], local[n])),
        "shapes_ok": all(list(local[n].shape) == s for n, s in params),
    }


code = 1
try:
    result = main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]))
    dist.barrier()  # both ranks are past every collective before either goes
    print(json.dumps(result))
    code = 0
except BaseException:
    traceback.print_exc()
finally:
    exit_rank(code, barrier=False)  # the barrier above, on success; no finalization under gloo threads (see above)
"""


def _run(tmp: Path, cfg: Path, workers: list[int]) -> list[dict]:
    port = free_port()
    procs = [subprocess.Popen([sys.executable, "-c", WORKER, str(cfg), str(r), str(port), str(w)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r, w in enumerate(workers)]
    out = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=300)
        assert p.returncode == 0, stderr[-3000:]
        out.append(json.loads(stdout.strip().splitlines()[-1]))
    return out


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("local-shards")
    subprocess.run([sys.executable, "-c", BUILD, str(tmp / "model")], check=True, timeout=180)
    spec = job_config(tmp / "model", trainer={"replicas": 1, "gpusPerReplica": 2, "strategy": "fsdp2"})
    return write_config(tmp / "job.json", spec)


def test_each_rank_sends_its_own_shard_where_it_is_its_workers(job: Path, tmp_path: Path) -> None:
    ranks = _run(tmp_path, job, [0, 1])  # trainer rank r shares its GPU with TP worker r
    want = {f"model.layers.{i}.{m}.{p}.{w}" for i in range(2) for m, ps in
            (("self_attn", ("q_proj", "k_proj", "v_proj")), ("mlp", ("gate_proj", "up_proj"))) for p in ps
            for w in (("weight", "bias") if m == "self_attn" else ("weight",))}
    want.add("model.embed_tokens.weight")  # vocabulary-parallel: rows halved
    for r in ranks:
        assert set(r["local"]) == want, r["local"]  # not o_proj/down_proj (split by columns), not the norms
        assert r["unused"] == ["lm_head.weight"], r["unused"]
        assert r["differ"] == [] and r["shapes_ok"], r
        full, lean = r["gathers"]
        assert full == r["names"] and lean == r["names"] - len(want) - 1, r["gathers"]
        assert r["bucketed_differ"] == [], r["bucketed_differ"]
        # every parameter is a dim-0 shard over the one 2-rank mesh: per tensor, one all-gather each; in 4 KiB
        # buckets, fewer (a tensor of more than 4 KiB has one of its own); by default the whole tiny model in one;
        # lean, the runs between the shards sent ungathered
        per_tensor, small, whole, lean_runs = r["collectives"]
        assert per_tensor == r["names"] and whole == 1, r["collectives"]
        assert sum(1 for b in r["sizes"].values() if b > 4096) <= small < per_tensor, (r["collectives"], r["sizes"])
        assert 1 < lean_runs < lean, r["collectives"]


@pytest.mark.parametrize("workers", [[1, 0], [0, 0]], ids=["swapped", "disagreeing"])
def test_ranks_whose_shards_are_not_their_workers_gather_everything(job: Path, tmp_path: Path,
                                                                    workers: list[int]) -> None:
    """Swapped: each rank's shard is the other worker's piece. Disagreeing: rank 0's shards fit, rank 1's do not
    (both plan for worker 0); rank 0 alone skipping its gathers would hang both. The head no plan takes is still
    left out on both."""
    for r in _run(tmp_path, job, workers):
        assert r["local"] == [] and r["unused"] == ["lm_head.weight"], r
        assert r["differ"] == [] and r["shapes_ok"], r
        assert r["gathers"] == [r["names"], r["names"] - 1], r
        assert r["bucketed_differ"] == [] and r["collectives"][2:] == [1, 1], r
