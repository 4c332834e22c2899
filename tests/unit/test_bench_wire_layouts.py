"""``benchmarks/wire_layouts.py``'s layouts: the wire the runtime's direct sync makes (its broadcasts and groups
as ``weight_sync.direct.send`` cuts them), for the model shapes the GPU runs use. The broadcasts themselves run on
the lent GPUs."""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import gpu_sync
import wire_layouts

from rlhf_runtime.weight_sync import direct


class Counting:
    """A communicator that records the byte size of each broadcast, per group."""

    def __init__(self) -> None:
        self.groups: list[list[int]] = []

    def group_start(self) -> None:
        self.groups.append([])

    def group_end(self) -> None:
        pass

    def broadcast(self, tensor: Any, src: int, stream: Any = None) -> None:
        self.groups[-1].append(tensor.numel() * tensor.element_size())


def test_the_qwen3_1_7b_wire_is_the_one_the_gpu_runs_sent() -> None:
    """310 broadcasts of 3,441,149,952 bytes in 4 groups of 1 GiB (the direct sync's entries and bytes on 2xH200,
    2026-11-29); fused 226; every layout the same bytes."""
    got = wire_layouts.layouts(*gpu_sync.MODELS["qwen3-1.7b"], 2, 1 << 30)
    counts = {name: (sum(map(len, groups)), len(groups)) for name, groups in got.items()}
    assert counts == {"whole": (1, 1), "parts": (310, 4), "fused": (226, 4), "parts-256mib": (310, 13)}
    assert {sum(map(sum, groups)) for groups in got.values()} == {3_441_149_952}


@pytest.mark.parametrize(("fused", "name"), [(False, "parts"), (True, "fused")])
def test_each_layout_is_what_direct_send_broadcasts(fused, name) -> None:
    """The runtime's ``direct.send`` on the layout's entries (a small Qwen2 shape, float32, 1 MiB groups) makes
    the groups the benchmark broadcasts."""
    arch, config = "Qwen2", {"hidden_size": 256, "intermediate_size": 384, "vocab_size": 512,
                             "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2}
    entries = wire_layouts.wire_entries(arch, config, fused)
    pairs = [(n, torch.zeros(math.prod(shape))) for n, shape in entries]
    comm = Counting()
    sizes = [math.prod(s) * 4 for _, s in entries]
    direct.send(iter(pairs), sizes, comm, 1 << 20)
    assert len(comm.groups) > 2 and comm.groups == wire_layouts.layouts(arch, config, 4, 1 << 20)[name]


def test_the_script_runs_every_layout_interleaved_between_two_processes(tmp_path) -> None:
    """``wire_layouts.py --cpu`` (gloo between two CPU processes, the tiny shape): every layout timed in every
    round, its broadcasts and groups as ``layouts`` makes them, the percentages against the one-tensor broadcast."""
    import json
    import subprocess

    out = tmp_path / "wire.json"
    script = Path(__file__).resolve().parents[2] / "benchmarks" / "wire_layouts.py"
    subprocess.run([sys.executable, str(script), "--cpu", "--model", "tiny", "--rounds", "2", "--bucket-mib", "1",
                    "--out", str(out)], check=True, timeout=240, capture_output=True)
    got = json.loads(out.read_text())
    plan = wire_layouts.layouts(*wire_layouts.TINY, 2, 1 << 20)
    assert got["kind"] == "cpu" and got["bytes"] == sum(plan["whole"][0]) and got["rounds"] == 2
    assert set(got["layouts"]) == set(plan)
    for name, row in got["layouts"].items():
        assert row["broadcasts"] == sum(map(len, plan[name])) and row["groups"] == len(plan[name])
        low, mid, high = row["wall_ms"][1], row["wall_ms"][0], row["wall_ms"][2]
        assert 0 < low <= mid <= high and row["pct_of_whole"] > 0 and set(row["launch_ms"]) == {"0", "1"}
    assert got["layouts"]["whole"]["pct_of_whole"] == 100
