"""``benchmarks/trl_peer.py --merge``: a merged file pooled again keeps each run's own command and date, so the
pooled result names every run once, in order."""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import trl_peer

LEARNING = ROOT / "benchmarks" / "results" / "learning"


def test_merging_a_merged_file_keeps_its_runs_commands_and_dates(tmp_path: Path) -> None:
    merged = LEARNING / "h100-2026-12-06-loop-vs-trl" / "trl_peer.json"
    rounds = [LEARNING / "h100-2026-12-07-loop-vs-trl-rounds-7-9" / f"round{i}" / "trl_peer.json" for i in (7, 8, 9)]
    out = tmp_path / "pooled.json"
    assert trl_peer.merge([str(merged), *map(str, rounds)], str(out), 1) == 0
    pooled = json.loads(out.read_text())
    first = json.loads(merged.read_text())
    assert pooled["commands"] == first["commands"] + [json.loads(r.read_text())["command"] for r in rounds]
    assert len(pooled["commands"]) == 7 and pooled["command"].endswith(": 7 runs, merged by --merge)")
    assert pooled["command"].count("then again") == 1
    assert pooled["dates"][:4] == first["dates"] and pooled["date"] == pooled["dates"][-1]
    assert len(pooled["rounds"]) == len(first["rounds"]) + 3
    assert pooled["overall"]["ours"]["measured_steps"] == 3 * 7


def test_the_ratio_of_each_round_is_kept_beside_the_pooled_one(tmp_path: Path) -> None:
    rounds = [LEARNING / "h100-2026-12-07-loop-vs-trl-rounds-7-9" / f"round{i}" / "trl_peer.json" for i in (7, 8, 9)]
    out = tmp_path / "pooled.json"
    assert trl_peer.merge(list(map(str, rounds)), str(out), 1) == 0
    by_round = json.loads(out.read_text())["overall"]["tokens_per_s_ratio_ours_to_trl_by_round"]
    alone = [json.loads(r.read_text())["overall"]["tokens_per_s_ratio_ours_to_trl"] for r in rounds]
    assert by_round["rounds"] == 3 and by_round["min"] == min(alone) and by_round["max"] == max(alone)
    assert by_round["median"] == sorted(alone)[1] and by_round["min"] < by_round["max"]
