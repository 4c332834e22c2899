"""``benchmarks/RESULTS.md`` is what ``benchmarks/results_table.py`` makes of the files under ``benchmarks/results/``,
and the generator keeps the newest run of each configuration, leaves figures a file lacks empty, and tolerates
files it cannot read."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import results_table as rt

REGENERATE = ".venv/bin/python benchmarks/results_table.py"


def test_results_md_is_what_the_result_files_give() -> None:
    current = rt.OUT.read_text() if rt.OUT.exists() else ""
    assert current == rt.render(), f"benchmarks/RESULTS.md is stale: run {REGENERATE} and commit it"


def test_corrected_figures_stand_beside_their_rows() -> None:
    text = rt.OUT.read_text()
    assert "-9.6% (-25.3 .. +3.8)" in text and "Not like for like" in text
    assert "not a same-day comparison" in text


def _sync_doc(date: str, sync_s: float, *, rollout: bool = True) -> dict:
    doc = {
        "layout": "separate-nccl", "model_name": "planted-1b", "device_kind": "nvidia-h200-x2",
        "gpus": ["NVIDIA H200", "NVIDIA H200"], "date": date, "status": "ok",
        "command": f"python3 benchmarks/gpu_sync.py planted {date}", "versions": {"vllm": "0.33.0"},
        "spec": {"trainer": {"replicas": 1, "gpusPerReplica": 1}, "rollout": {"engines": 1, "tensorParallelSize": 1},
                 "placement": {"mode": "separate"}},
        "floor": {"kind": "nccl_broadcast", "bytes": 2_000_000_000, "whole_s": 0.005},
        "summary": {"default": {"median_total_s": sync_s, "bytes": 2_000_000_000, "gbps": 2 / sync_s,
                                "format": "kernel"}},
        "validation": {"validated": True},
    }
    if rollout:
        doc["rollout"] = {"tokens_per_second": 30_000.0}
        doc["train"] = {"seconds": 2.5}
    return doc


def _cells(text: str, needle: str) -> list[list[str]]:
    """The table rows of ``text`` that contain ``needle``, split into cells."""
    return [[c.strip() for c in line.strip().strip("|").split("|")] for line in text.splitlines()
            if line.startswith("|") and needle in line]


def test_the_newest_run_of_a_configuration_is_the_row(tmp_path: Path) -> None:
    (tmp_path / "sync" / "old").mkdir(parents=True)
    (tmp_path / "sync" / "new").mkdir(parents=True)
    (tmp_path / "sync" / "old" / "gpu.json").write_text(json.dumps(_sync_doc("2026-11-20T10:00:00+00:00", 0.020)))
    (tmp_path / "sync" / "new" / "gpu.json").write_text(
        json.dumps(_sync_doc("2026-11-21T10:00:00+00:00", 0.010, rollout=False)))
    text = rt.render(tmp_path)
    rows = _cells(text, "planted-1b")
    assert len(rows) == 1
    cols = [h for h, _ in rt.COLUMNS["sync"]]
    row = dict(zip(cols, rows[0]))
    assert row["Sync ms"] == "10.00" and row["GPUs"] == "2x H200" and row["Date"] == "2026-11-21"
    assert row["% of floor"] == "50.0%"  # 200 GB/s over the floor's 400 GB/s
    assert row["Rollout tokens/s/GPU"] == "" and row["Train step s"] == ""  # not in the newest file: left empty
    assert "planted 2026-11-21" in text and "planted 2026-11-20" not in text
    assert "- superseded by a newer run of the same configuration: 1" in text


def test_files_no_reader_knows_are_listed_not_fatal(tmp_path: Path) -> None:
    (tmp_path / "plan").mkdir()
    (tmp_path / "plan" / "memory_plan.json").write_text(json.dumps({"what": "a GPU memory plan", "gib": [1, 2]}))
    (tmp_path / "plan" / "broken.json").write_text("{not json")
    (tmp_path / "plan" / "list.json").write_text("[1, 2, 3]")
    (tmp_path / "plan" / "run.log").write_text("a log, not a result")
    text = rt.render(tmp_path)
    assert "`plan/memory_plan.json`" in text and "`plan/broken.json`" in text and "`plan/list.json`" in text
    assert "run.log" not in text
    for area in rt.COLUMNS:  # every area keeps its (empty) table
        assert f"## {rt.TITLES[area][0]}" in text


def test_a_rollout_row_shows_its_paired_interval_and_baseline(tmp_path: Path) -> None:
    doc = {
        "command": "python3 benchmarks/rollout_overhead.py --model planted-2b --graphs", "date": "2026-11-22",
        "device_kind": "nvidia-h100-x1", "layout": "colocated-ipc-resident", "versions": {"vllm": "0.33.0"},
        "model": {"architecture": "Qwen3ForCausalLM"}, "batch": {"prompts": 64},
        "engine_kwargs": {"enforce_eager": False}, "spec": {"rollout": {"engines": 1, "tensorParallelSize": 1}},
        "median_tokens_per_second": {"runtime": 20_000.0, "bare": 21_000.0},
        "paired": {"overhead": {"mean": 0.031, "low": -0.012, "high": 0.074, "rounds": 40}},
    }
    (tmp_path / "overhead.json").write_text(json.dumps(doc))
    rows = _cells(rt.render(tmp_path), "planted-2b")
    assert len(rows) == 1
    row = dict(zip([h for h, _ in rt.COLUMNS["rollout"]], rows[0]))
    assert row["Overhead (95%)"] == "+3.1% (-1.2 .. +7.4)" and row["Rounds"] == "40"
    assert row["Against"] == "bare `vllm.LLM`, the runtime's settings" and row["Engine"] == "CUDA graphs"


def test_a_colocated_memory_run_is_a_loop_row_of_its_later_steps(tmp_path: Path) -> None:
    step = {"step_seconds": 100.0, "rollout_seconds": 60.0, "train_seconds": 40.0, "rollout_tokens_per_second": 9000.0,
            "mfu": 0.12, "weight_sync_seconds": 0.05}
    later = [{**step, "step": 2, "step_seconds": 70.0, "train_seconds": 10.0, "mfu": 0.30},
             {**step, "step": 3, "step_seconds": 80.0, "train_seconds": 20.0, "mfu": 0.32}]
    plan = {"offload": True, "kv_cache_gib": 61.2, "sequences_at_once": 128, "batch_sequences": 128}
    doc = {"command": "python3 benchmarks/colocated_memory.py --prompts 4 --variants planted", "date": "2026-12-06",
           "device": {"name": "NVIDIA H100 80GB HBM3", "total_gib": 79.18, "vllm": "0.33.0"}, "model": {"config": {}},
           "runs": [{"variant": "fast:0.85:auto:4096:3:graphs,compile", "exit_code": 0, "memory_plan": plan,
                     "steps": [{**step, "step": 1}, *later]},
                    {"variant": "refused:0.75:never:1024:3", "exit_code": 1, "steps": []}]}
    (tmp_path / "cm").mkdir()
    (tmp_path / "cm" / "colocated_memory.json").write_text(json.dumps(doc))
    (tmp_path / "cm" / "suite.json").write_text(json.dumps({"suite": "learning", "steps": []}))
    text = rt.render(tmp_path)
    rows = _cells(text, "4 prompts x 8")
    assert len(rows) == 1  # the refused run recorded no step
    row = dict(zip([h for h, _ in rt.COLUMNS["learning"]], rows[0]))
    assert row["Step s"] == "75.00" and row["Split s"] == "rollout 60.00, train 15.00" and row["MFU"] == "31.0%"
    assert row["Layout"] == ("colocated, gpuMemoryUtilization 0.85, offloadDuringRollout auto (on), CUDA graphs "
                             "engine, compiled trainer")
    assert "medians of steps 2-3" in row["Outcome"] and "128 of 128" in row["Outcome"] and row["GPUs"] == "1x H100"
    assert "`cm/suite.json`" not in text and "a suite's summary" in text


def test_an_fp8_kv_run_says_so_and_how_near_its_rollout_came_to_the_read_floor(tmp_path: Path) -> None:
    step = {"step_seconds": 50.0, "rollout_seconds": 32.0, "train_seconds": 18.0, "mfu": 0.33}
    doc = {"command": "python3 benchmarks/colocated_memory.py --prompts 16 --variants fp8", "date": "2026-12-07",
           "device": {"name": "NVIDIA H100 80GB HBM3", "total_gib": 79.18, "vllm": "0.31.0"}, "model": {"config": {}},
           "runs": [{"variant": "fp8:0.55:auto:4096:3:graphs,compile,fp8kv", "exit_code": 0,
                     "decode_read_floor": {"seconds": 24.0},
                     "steps": [{**step, "step": 1}, {**step, "step": 2}, {**step, "step": 3}]}]}
    (tmp_path / "cm").mkdir()
    (tmp_path / "cm" / "colocated_memory.json").write_text(json.dumps(doc))
    (row,) = _cells(rt.render(tmp_path), "fp8 KV cache")
    row = dict(zip([h for h, _ in rt.COLUMNS["learning"]], row))
    assert row["Layout"].endswith("compiled trainer, fp8 KV cache")
    assert "rollout 75% of its read floor (24.0 s)" in row["Outcome"]


def test_a_tool_learning_run_is_a_row_per_arm_of_its_held_out_accuracy(tmp_path: Path) -> None:
    def run(arm: str, lr: float, wall: float) -> dict:
        return {"arm": arm, "seed": 0, "learning_rate": lr, "exit_code": 0, "wall_seconds": wall,
                "eval": [{"step": 30, "accuracy": 0.5}], "steps": [{"step": 1, "step_seconds": 2.0}]}

    doc = {"command": "python3 benchmarks/tool_learning.py --out x", "date": "2026-12-07", "device": "NVIDIA H100",
           "vllm": "0.31.0", "task": "3-digit x 3-digit multiplication, exact match",
           "args": {"layers": 4, "hidden": 256, "grpo_steps": 30},
           "summary": {"tools_accuracy": 0.42, "single_turn_accuracy": 0.03, "grpo_steps": 30},
           "runs": [run("tools", 1e-12, 30.0), run("single", 1e-12, 20.0), run("tools", 2e-5, 120.0),
                    run("single", 2e-5, 90.0)]}
    (tmp_path / "tl").mkdir()
    (tmp_path / "tl" / "tool_learning_h100.json").write_text(json.dumps(doc))
    rows = {r[4]: r for r in _cells(rt.render(tmp_path), "multiplication")}
    assert set(rows) == {"runtime, python tool", "runtime, single turn"}  # read once, not as a gpu_learning run
    tools = dict(zip([h for h, _ in rt.COLUMNS["learning"]], rows["runtime, python tool"]))
    single = dict(zip([h for h, _ in rt.COLUMNS["learning"]], rows["runtime, single turn"]))
    assert tools["Outcome"] == "exact match 0.420 at step 30; run 120 s" and tools["GPUs"] == "1x H100"
    assert single["Outcome"] == "exact match 0.030 at step 30; run 90 s"


def test_a_tool_learning_arm_stopped_by_its_time_limit_shows_its_last_eval_and_where_it_stopped(tmp_path: Path) -> None:
    steps = [{"step": k, "step_seconds": 10.0} for k in range(1, 13)]
    doc = {"command": "python3 benchmarks/tool_learning.py --out x", "date": "2026-12-07", "device": "NVIDIA H100",
           "vllm": "0.31.0", "task": "3-digit x 3-digit multiplication, exact match",
           "args": {"layers": 4, "hidden": 256, "grpo_steps": 30},
           "summary": {"tools_accuracy": None, "single_turn_accuracy": 0.0, "grpo_steps": 30},
           "runs": [{"arm": "tools", "seed": 0, "learning_rate": 2e-5, "exit_code": 124, "wall_seconds": 240.0,
                     "eval": [{"step": 10, "accuracy": 0.75}], "steps": steps},
                    {"arm": "single", "seed": 0, "learning_rate": 2e-5, "exit_code": 0, "wall_seconds": 30.0,
                     "eval": [{"step": 30, "accuracy": 0.0}], "steps": steps}]}
    (tmp_path / "tl").mkdir()
    (tmp_path / "tl" / "tool_learning_h100.json").write_text(json.dumps(doc))
    rows = {r[4]: r for r in _cells(rt.render(tmp_path), "multiplication")}
    stopped = "runtime, python tool (stopped at step 12: its time limit)"
    assert set(rows) == {stopped, "runtime, single turn"}
    tools = dict(zip([h for h, _ in rt.COLUMNS["learning"]], rows[stopped]))
    assert tools["Outcome"] == "exact match 0.750 at step 10; run 240 s"
