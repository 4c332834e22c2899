"""Writes ``benchmarks/RESULTS.md``: one current table per area (weight sync, trainer, rollout, the whole loop,
operator, sandboxes) from the raw result files under ``benchmarks/results/``.

Every JSON file is tried by the readers of ``results_rows.py``; a row stands for one configuration (model, GPUs,
layout, settings) and the table keeps the newest run of each (by the date the file records; runs of one
configuration on one day combine where a row is per seed). A figure a file does not record stays an empty cell.
Files no reader knows, runs on a vLLM the runtime no longer supports and the old arms named in ``EXCLUDED`` are
counted at the end of the page, not tabled. ``tests/unit/test_results_table.py`` fails when the page is stale.

    .venv/bin/python benchmarks/results_table.py            # rewrite benchmarks/RESULTS.md
    .venv/bin/python benchmarks/results_table.py --check    # exit 1 when it is not what the files give
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import re
import statistics
import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from results_rows import READERS, Row

ROOT = Path(__file__).resolve().parent
RESULTS = ROOT / "results"
OUT = ROOT / "RESULTS.md"
#: The oldest vLLM the runtime runs on; results on older ones are history only.
MIN_VLLM = (0, 28)

_OLD_PEERS = "on vLLM 0.24, which the runtime refuses (the history records the version; the file does not)"
#: Files that measure something other than the current code: the old arm of a comparison.
EXCLUDED: dict[str, str] = {
    "trainer/h200-2026-11-27-head/mfu_old*.json": "the old arm of an interleaved comparison (an earlier trainer)",
    "trainer/h200x2-2026-11-27-8b-head/old*.json": "the old arm of an interleaved comparison (an earlier trainer)",
    "operator/operator_scale_100_before-*.json": "the old arm of a comparison (an earlier operator)",
    "learning/vllm0.24/*": _OLD_PEERS,
    "learning/trl_peer_gpu*.json": _OLD_PEERS,
    "*/suite.json": "a suite's summary (`run.py`): its rows are read from its steps' own result files beside it",
    "learning/h100-2026-12-07-loop-vs-trl-rounds-5-6/*": "rounds on a machine a killed call had left busy (round 5 "
    "failed at start; round 6's TRL ran 26% slower than in rounds 1-4): not pooled (`results/learning/README.md`)",
    "learning/h100-2026-12-07-loop-vs-trl-rounds-7-9/round*/*": "one round each: pooled in that folder's "
    "`pooled_rounds_1-4_7-9.json`",
    "learning/h100-2026-12-07-loop-vs-trl-rounds-7-9/trl_peer.json": "rounds 7-9 alone: pooled with rounds 1-4 in "
    "`pooled_rounds_1-4_7-9.json` beside it",
    "learning/h100-2026-12-07-loop-vs-trl-rounds-7-9/pooled_rounds_1-4_7-9.json": "pooled again with round 10 in "
    "`../h100-2026-12-07-loop-vs-trl-round-10/pooled_rounds_1-4_7-10.json`",
    "learning/h100-2026-12-07-loop-vs-trl-round-10/trl_peer.json": "round 10 alone: pooled with rounds 1-4 and 7-9 "
    "in `pooled_rounds_1-4_7-10.json` beside it",
    "learning/h100-2026-12-07-loop-vs-trl-round-10/pooled_rounds_1-4_7-10.json": "pooled again with rounds 11-12 in "
    "`../h100-2026-12-07-loop-vs-trl-rounds-11-12/pooled_rounds_1-4_7-12.json`",
    "learning/h100-2026-12-07-loop-vs-trl-rounds-11-12/round*/*": "one round each: merged in that folder's "
    "`trl_peer.json`",
    "learning/h100-2026-12-07-loop-vs-trl-rounds-11-12/trl_peer.json": "rounds 11-12 alone (2 rounds): pooled "
    "with rounds 1-4 and 7-10 in `pooled_rounds_1-4_7-12.json` beside it",
    "learning/h100-2026-12-07-loop-vs-trl-rounds-11-12/cold-call/*": "a call whose runs were killed at its 190 s "
    "limit on a fresh machine (no step measured on either side)",
}

_LIKE = ("against a bare `vllm.LLM` with the same settings the 1.7B rollout is -9.6% (-25.3 .. +3.8) over 9 rounds "
         "(`results/rollout/vllm0.33/h200-2026-11-29-overhead/overhead-1.7b.json`, `paired.overhead`): inconclusive")
#: Notes a row carries: (file pattern, the rollout baseline it applies to or None for any row, the note).
NOTES: list[tuple[str, str | None, str]] = [
    ("rollout/vllm0.33/h200-2026-11-29-overhead/overhead-1.7b*.json", "`vllm.LLM`, vLLM's defaults",
     "Not like for like: vLLM's defaults run the engine core in a process of its own, the runtime's engine runs "
     "it in-process. The history's -17.0% (22 rounds) pools this run with the four-way one; " + _LIKE + "."),
    ("rollout/vllm0.33/h200-2026-11-29-overhead/overhead-8b*.json", "`vllm.LLM`, vLLM's defaults",
     ("Against vLLM's defaults (its engine core in a process of its own); no 8B run against the runtime's own "
     "settings in a plain process was made.")),
    ("learning/h100-2026-12-07-loop-vs-trl-rounds-11-12/pooled_rounds_1-4_7-12.json", None,
     ("10 interleaved rounds on three H100 machines; rounds 1-4 and 7-10 ran the trainer compiled for the first "
      "shapes (recompiled for new ones), rounds 11-12 with dynamic shapes.")),
    ("trainer/h100-2026-12-06-suite/train_arms_compile.json", None,
     ("Peak GiB is not the step's peak: the trainer resets the allocator's peak at the end of its step, so "
      "`train_arms.py` read what stays allocated after it (the state, 22.5 GiB); the step's own peak at this shape "
      "is 37.0-39.1 GiB (`results/trainer/README.md`, 2026-12-06).")),
    ("trainer/h200x2-2026-11-27-8b-compile/8b_compiled_*.json", None,
     ("The history's 1.19x for compile at this shape divides the eager run of 2026-11-26 by this one: not a "
     "same-day comparison (the same-day eager arm was lost).")),
]

Column = tuple[str, Callable[[dict[str, Any]], str]]


def _f(key: str, spec: str = "{:,.1f}", scale: float = 1.0) -> Callable[[dict[str, Any]], str]:
    def cell(v: dict[str, Any]) -> str:
        x = v.get(key)
        if x is None or x == "":
            return ""
        if isinstance(x, int | float) and not isinstance(x, bool):
            return spec.format(x * scale if scale != 1.0 else x)
        return str(x)
    return cell


def _gpus(v: dict[str, Any]) -> str:
    kind, n = v.get("kind"), v.get("gpus")
    if kind == "CPU":
        return "CPU"
    return f"{int(n)}x {kind}" if n and kind else str(kind or "")


def _yes(v: dict[str, Any]) -> str:
    ok = {True: "yes", False: "no"}.get(v.get("validated"), "")
    status = v.get("status")
    return f"{ok} (run: {status})" if status not in (None, "ok") else ok


def _interval(v: dict[str, Any]) -> str:
    if v.get("overhead") is None:
        return ""
    text = f"{v['overhead'] * 100:+.1f}%"
    if v.get("low") is not None and v.get("high") is not None:
        return f"{text} ({v['low'] * 100:+.1f} .. {v['high'] * 100:+.1f})"
    return text + " (medians; no interval)"


def _outcome(v: dict[str, Any]) -> str:
    if v.get("outcome") is not None:
        return f"exact match {v['outcome']:.3f} at step {v.get('outcome_step') or 0:.0f}; run {v.get('wall_s') or 0:.0f} s"
    if v.get("samples_s") is not None:
        return f"{v['samples_s']:.1f} samples/s" + (f"; {v['outcome_text']}" if v.get("outcome_text") else "")
    return str(v.get("outcome_text") or "")


DATE: Column = ("Date", lambda v: str(v.get("_when", ""))[:10])
COLUMNS: dict[str, list[Column]] = {
    "sync": [
        ("Model", _f("model")), ("GPUs", _gpus), ("Layout", _f("layout")), ("Sender", _f("sender")),
        ("Sync ms", _f("sync_ms", "{:,.2f}")), ("Sent GB", _f("sent_gb", "{:.3g}")), ("GB/s", _f("gbps", "{:,.3g}")),
        ("Floor", _f("floor")), ("% of floor", _f("share", "{:.1f}%", 100)),
        ("Rollout tokens/s/GPU", _f("rollout_tps_gpu", "{:,.0f}")), ("Train step s", _f("train_s", "{:.2f}")),
        ("Validated", _yes), ("vLLM", _f("vllm")), DATE,
    ],
    "trainer": [
        ("Model", _f("model")), ("GPUs", _gpus), ("Tokens/sequence", _f("length", "{:,}")),
        ("Tokens/step", _f("tokens", "{:,}")), ("Setting", _f("setting")), ("Step s", _f("step_s", "{:.3f}")),
        ("Tokens/s/GPU", _f("tps_gpu", "{:,.0f}")), ("MFU", _f("mfu", "{:.1f}%", 100)),
        ("Peak GiB", _f("peak_gib")), ("torch", _f("torch")), DATE,
    ],
    "rollout": [
        ("Model", _f("model")), ("GPUs", _gpus), ("Layout", _f("layout")), ("Engine", _f("engine")),
        ("Against", _f("against")), ("Runtime tokens/s", _f("runtime_tps", "{:,.0f}")),
        ("Tokens/s/GPU", _f("tps_gpu", "{:,.0f}")), ("Against tokens/s", _f("against_tps", "{:,.0f}")),
        ("Overhead (95%)", _interval), ("Rounds", _f("rounds", "{:.0f}")), ("vLLM", _f("vllm")), DATE,
    ],
    "learning": [
        ("Work", _f("work")), ("Model", _f("model")), ("GPUs", _gpus), ("Layout", _f("layout")),
        ("Side", _f("side")), ("Step s", _f("step_s", "{:.2f}")), ("Split s", _f("split")),
        ("Sync ms", _f("sync_ms", "{:,.1f}")), ("Rollout tokens/s", _f("rollout_tps", "{:,.0f}")),
        ("Tokens/s/GPU", _f("tps_gpu", "{:,.0f}")), ("MFU", _f("mfu", "{:.1f}%", 100)), ("Outcome", _outcome),
        ("vLLM", _f("vllm")), DATE,
    ],
    "operator": [
        ("Jobs", _f("jobs", "{:,}")), ("KWOK nodes", _f("nodes", "{:,}")),
        ("Create -> RayJob p50 / p99 s", lambda v: _f("create_p50", "{:.2f}")(v) + " / " + _f("create_p99", "{:.2f}")(v)),
        ("KubeRay RayJob -> RayCluster p50 s", _f("peer_p50", "{:.2f}")),
        ("Ratio p50 / p99", lambda v: _f("ratio_p50", "{:.3f}")(v) + " / " + _f("ratio_p99", "{:.3f}")(v)),
        ("Converged s", _f("converged_s", "{:.0f}")), ("Operator requests/job", _f("requests_job", "{:.2f}")),
        ("Operator RSS MiB", _f("rss_mib")), ("Failures", _f("failures", "{:.0f}")), ("Operator", _f("commit")), DATE,
    ],
    "sandbox": [
        ("Claims (warm)", lambda v: _f("claims", "{:.0f}")(v) + " (" + _f("warm", "{:.0f}")(v) + ")"),
        ("Claim p50 / p99 s", lambda v: _f("claim_p50", "{:.2f}")(v) + " / " + _f("claim_p99", "{:.2f}")(v)),
        ("Round trip p50 ms, python / shell",
         lambda v: _f("rt_python_ms", "{:.1f}")(v) + " / " + _f("rt_shell_ms", "{:.1f}")(v)),
        ("Beyond the code's run, p50 ms, python / shell",
         lambda v: _f("overhead_python_ms", "{:.1f}")(v) + " / " + _f("overhead_shell_ms", "{:.1f}")(v)),
        ("Jobs deleted", _f("jobs", "{:.0f}")),
        ("Sandboxes left after", lambda v: _f("left", "{:.0f}")(v) + " (" + _f("deadline_s", "{:.0f} s")(v) + ")"),
        ("All gone s", _f("gone_s", "{:.0f}")), ("Load average", _f("load", "{:.1f}")), ("Commit", _f("commit")),
        DATE,
    ],
}

TITLES: dict[str, tuple[str, str]] = {
    "sync": ("Weight sync", ("`gpu_sync.py` and `gpu_async.py`: the job's default sender, median of the timed syncs. "
             "GB/s = bytes sent / sync time; % of floor = that bandwidth over the floor's, measured in the same run "
             "(a raw NCCL broadcast between the GPUs, or a device-to-device copy on one GPU for IPC). Rollout: 64 "
             "prompts x 8 samples x 128 tokens over every GPU of the layout. History: `results/sync/README.md`.")),
    "trainer": ("Trainer", ("`train_step.py` and `train_arms.py`: one GRPO training step on random weights of the "
                "model's published shape, bfloat16 with float32 masters; median seconds per step. MFU: model FLOPs "
                "(recomputation not counted) over 989 TFLOP/s per GPU. History: `results/trainer/README.md`.")),
    "rollout": ("Rollout", ("`rollout_overhead.py`: the runtime's rollout (64 prompts x 8 samples x 128 tokens) against "
                "a bare engine on the same GPU, interleaved rounds; GPUs: the engine's. Overhead: the rounds' paired log ratio with its "
                "95% bootstrap interval; negative means the runtime produced more tokens per second. History: "
                "`results/rollout/README.md`.")),
    "learning": ("The whole loop", ("The driver's whole step end to end (`cpu_runtime.py`, `gpu_ppo.py`, "
                 "`rendered_cluster.py`, `colocated_memory.py`: one GPU, per driver run the medians of steps 2 on), learning a task on a GPU beside TRL (`gpu_learning.py`: medians over the "
                 "day's seeds) and the same work as TRL and veRL (`trl_peer.py`). History: "
                 "`results/learning/README.md`.")),
    "operator": ("Operator", ("`operator_scale.py`: N RLHFJobs on the local control plane with KWOK GPU nodes; latency "
                 "from the create call to the child RayJob, beside KubeRay's own RayJob -> RayCluster (ratio: ours "
                 "over KubeRay's). History: `results/operator/README.md`.")),
    "sandbox": ("Sandboxes", ("`sandbox_claims.py`: `spec.environment.sandbox` in real pods (the local cluster's "
                "real nodes, the agent-sandbox controller, the operator from its chart); a trajectory's claim from "
                "a full warm pool until its sandbox is ready, a held sandbox's tool call round trip and what of it "
                "is beyond the command's own run time in the pod, and the sandboxes left after jobs with claimed "
                "sandboxes are deleted. Load average: the machine's (1 min) at the start. History: "
                "`results/operator/README.md`.")),
}


def _vllm_too_old(version: str | None) -> bool:
    nums = tuple(int(x) for x in re.findall(r"\d+", version or "")[:2])
    return len(nums) == 2 and nums < MIN_VLLM


def scan(results: Path = RESULTS) -> tuple[list[Row], dict[str, list[str]]]:
    """Every JSON file under ``results``: its rows, and the files left out by reason."""
    rows: list[Row] = []
    left: dict[str, list[str]] = {}
    for path in sorted(results.rglob("*.json")):
        rel = path.relative_to(results).as_posix()
        reason = next((why for pat, why in EXCLUDED.items() if fnmatch.fnmatch(rel, pat)), None)
        found: list[Row] = []
        if reason is None:
            try:
                doc = json.loads(path.read_text())
            except (OSError, ValueError):
                doc = None
            found = [r for read in READERS for r in (read(doc) if isinstance(doc, dict) else [])]
            reason = None if found else "no table reads this file's format, or the run has no figure"
        if found and all(_vllm_too_old(r.values.get("vllm")) for r in found):
            found, reason = [], f"on a vLLM older than {MIN_VLLM[0]}.{MIN_VLLM[1]}, which the runtime refuses"
        if reason:
            left.setdefault(reason, []).append(rel)
        rows += [replace(r, path=rel) for r in found if not _vllm_too_old(r.values.get("vllm"))]
    return rows, left


def _combine(rows: list[Row]) -> Row:
    """Rows of one configuration and day as one: the median of each number, the last row's words."""
    values: dict[str, Any] = {}
    for k in rows[-1].values:
        xs = [r.values.get(k) for r in rows]
        nums = [x for x in xs if isinstance(x, int | float) and not isinstance(x, bool)]
        values[k] = statistics.median(nums) if nums and len(nums) == len(xs) else xs[-1]
    return replace(rows[-1], values=values, runs=len(rows), extra_paths=tuple(r.path for r in rows[:-1]))


def pick(rows: list[Row]) -> tuple[list[Row], list[str]]:
    """The newest row of each configuration (ties: the later file), and the files whose rows all lost."""
    groups: dict[tuple, list[Row]] = {}
    for r in rows:
        groups.setdefault((r.area, r.key), []).append(r)
    kept: list[Row] = []
    for group in groups.values():
        group.sort(key=lambda r: (r.when, r.path))
        newest = [r for r in group if r.when == group[-1].when] if group[-1].merge else [group[-1]]
        kept.append(_combine(newest) if len(newest) > 1 else newest[0])
    used = {p for r in kept for p in (r.path, *r.extra_paths)}
    return kept, sorted({r.path for r in rows} - used)


def _note(row: Row) -> str:
    against = row.values.get("against")
    return " ".join(text for pat, which, text in NOTES
                    if fnmatch.fnmatch(row.path, pat) and which in (None, against))


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _sort_key(row: Row) -> tuple:
    return tuple(str(x) for x in row.key)


def table(area: str, rows: list[Row]) -> list[str]:
    """One area's section: its title, what the columns mean, the table, and every row's run with its command."""
    title, intro = TITLES[area]
    cols = COLUMNS[area]
    out = [f"## {title}", "", intro, "", "| " + " | ".join(h for h, _ in cols) + " | Run |",
           "|" + "---|" * (len(cols) + 1)]
    runs: list[str] = []
    for i, row in enumerate(sorted(rows, key=_sort_key), 1):
        values = {**row.values, "_when": row.when}
        note = _note(row)
        out.append("| " + " | ".join(_cell(fn(values)) for _, fn in cols) + f" | [{i}]{'*' if note else ''} |")
        more = f" and {len(row.extra_paths)} more file(s) of that day ({row.runs} runs, medians)" if row.runs > 1 else ""
        runs.append(f"{i}. [`results/{row.path}`](results/{row.path}){more}: `{row.command}`"
                    + (f"\n   - *Note:* {note}" if note else ""))
    return out + ["", "Runs (`*`: the row carries a note):", "", *runs, ""]


def render(results: Path = RESULTS) -> str:
    """The whole page for the result files under ``results``."""
    rows, left = scan(results)
    kept, superseded = pick(rows)
    if superseded:
        left["superseded by a newer run of the same configuration"] = superseded
    out = ["# Benchmark results", "",
           ("Generated by `benchmarks/results_table.py` from the files under `benchmarks/results/`; do not edit by "
           "hand. One current table per area: each row the newest run of one configuration. Compare rows only on "
           "the same GPU kind. How to run the suites: `benchmarks/README.md`."), ""]
    for area in COLUMNS:
        out += table(area, [r for r in kept if r.area == area])
    out += ["## Files not in the tables", ""]
    for reason, paths in sorted(left.items()):
        out.append(f"- {reason}: {len(paths)}")
        if reason.startswith("no table"):
            out += [f"  - `{p}`" for p in paths]
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--check", action="store_true", help="exit 1 when RESULTS.md is not what the files give")
    a = p.parse_args(argv)
    text = render()
    if a.check:
        current = OUT.read_text() if OUT.exists() else ""
        if current != text:
            print(f"{OUT} is stale: run .venv/bin/python benchmarks/results_table.py", file=sys.stderr)
            return 1
        return 0
    OUT.write_text(text)
    print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
