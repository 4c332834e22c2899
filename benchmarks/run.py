#!/usr/bin/env python3
"""One command per suite: runs the suite's steps (benchmark scripts, each with a time limit, into a log), then
writes ``suite.json`` beside their results: the command, the commit, the device, every step's exit and seconds,
and the figures each result file holds (the rows ``RESULTS.md`` is made of, ``results_rows.READERS``).

    python3 benchmarks/run.py sync --out $OUT/sync      # or: python3 -m benchmarks sync ...
    python3 benchmarks/run.py trainer --out $OUT/trainer
    .venv/bin/python -m benchmarks sync --cpu           # the same code on CPU (a tiny model, gloo)
    python3 -m benchmarks --list                        # every suite's steps and what they need

A suite has GPU steps and CPU steps: on a machine with GPUs the GPU steps run (those needing more GPUs than the
machine has are skipped, and said so), with ``--cpu`` or without GPUs the CPU ones. ``--only`` picks steps by name;
``--budget`` is the seconds the whole suite may take (a step's limit is cut to what is left; a step that would
start with less than a minute left is skipped), so that the suite ends inside one device call. The default
``--out`` is ``benchmarks/results/<suite>/<kind>-<date>-suite``. Where the tree has no ``.git`` (a copy on a GPU
machine), ``BENCH_COMMIT`` and ``BENCH_DIRTY`` give the commit (``harness.git_facts``).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tarfile
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import harness

#: Seconds a step must have at least to be started; what a step's own limit keeps for its teardown.
MIN_STEP_S, TEARDOWN_S = 60.0, 20.0


@dataclass(frozen=True)
class Step:
    """One benchmark run of a suite. ``argv``: the script (relative to the repository) and its arguments, where
    ``{out}``, ``{kind}`` and ``{timeout}`` (the step's limit less ``TEARDOWN_S``) are filled in; ``gpus``: GPUs
    it needs (0: a CPU step); ``timeout``: its limit in seconds; ``default``: run unless ``--only`` names steps;
    ``expect_s``: about how long it takes (``--list``)."""

    name: str
    argv: tuple[str, ...]
    gpus: int = 0
    timeout: float = 540.0
    default: bool = True
    expect_s: float = 0.0
    what: str = ""


@dataclass(frozen=True)
class Suite:
    name: str
    what: str
    steps: tuple[Step, ...] = field(default=())


_SYNC = ("benchmarks/gpu_sync.py", "--kind", "{kind}", "--out", "{out}", "--timeout", "{timeout}", "--no-variants")
_ARMS = ("benchmarks/train_arms.py", "--model", "qwen3-1.7b", "--budget", "32768", "--rounds", "5", "--repeats", "2")
_OVERHEAD = ("benchmarks/rollout_overhead.py", "--kind", "{kind}", "--layout", "colocated-ipc-resident", "--graphs",
             "--model", "qwen3-1.7b", "--ways", "in_actor,bare,bare_default", "--bare-memory", "0.2",
             "--spec-json", '{"rollout": {"gpuMemoryUtilization": 0.2}}', "--timeout", "300")

SUITES: dict[str, Suite] = {s.name: s for s in (
    Suite("sync", "the weight sync: the job's default sender, validated, then a rollout and a GRPO step", (
        Step("ipc-resident", (*_SYNC, "--syncs", "10", "colocated-ipc-resident:qwen3-1.7b"), gpus=1,
             timeout=420, expect_s=190, what="trainer and engine on one GPU, the engine awake: resident IPC"),
        Step("nccl-separate", (*_SYNC, "--syncs", "5", "separate-nccl:qwen3-1.7b"), gpus=2, timeout=420,
             expect_s=200, what="trainer GPU -> engine GPU over NCCL"),
        Step("cpu-gloo", ("benchmarks/gpu_sync.py", "--cpu", "--out", "{out}", "--timeout", "{timeout}", "--syncs",
                          "3", "--no-variants", "cpu-gloo:tiny"), timeout=400, expect_s=150,
             what="the same code on CPU: a tiny model, the gloo backend"),
    )),
    Suite("trainer", "the trainer's GRPO step: arms interleaved in one process", (
        Step("compile", (*_ARMS, "--lengths", "1024,4096", "--arms", "eager,compiled",
                         "--out", "{out}/train_arms_compile.json"), gpus=1, timeout=480, expect_s=200,
             what="trainer.compile against eager, 1k and 4k tokens per sequence, checkpointing on"),
        Step("compile-16k", (*_ARMS, "--lengths", "16384", "--arms", "eager,compiled",
                             "--out", "{out}/train_arms_compile_16k.json"), gpus=1, timeout=400, default=False,
             expect_s=150, what="the same at 16k tokens per sequence"),
        Step("cpu-chunk", ("benchmarks/train_arms.py", "--cpu", "--arms", "chunk=4096,chunk=65536",
                           "--out", "{out}/train_arms_cpu.json"), timeout=300, expect_s=40,
             what="the output layer's chunk, two sizes, the tiny model on CPU"),
    )),
    Suite("rollout", "the runtime's rollout beside a bare vllm.LLM on the same batch, interleaved rounds", (
        Step("overhead-1.7b", (*_OVERHEAD, "--minutes", "5", "--out", "{out}/rollout_overhead_1.7b.json"), gpus=1,
             timeout=560, expect_s=540, what="Qwen3-1.7B shape, CUDA graphs, the like-for-like bare engine"),
        Step("cpu-overhead", ("benchmarks/rollout_overhead.py", "--cpu", "--rounds", "5",
                              "--out", "{out}/rollout_overhead_cpu.json"), timeout=560, expect_s=300,
             what="the same comparison on CPU"),
        Step("cpu-agent", ("benchmarks/agent_rollout.py", "--out", "{out}/agent_rollout_cpu.json"), timeout=560,
             default=False, expect_s=300, what="the multi-turn rollout on CPU"),
    )),
    Suite("learning", "the whole loop: a job end to end", (
        Step("ppo", ("benchmarks/gpu_ppo.py", "--kind", "{kind}", "--out", "{out}", "--model", "qwen2-0.5b",
                     "--steps", "4", "--timeout", "{timeout}"), gpus=2, timeout=560, expect_s=400,
             what="PPO with every role on GPUs"),
        Step("tools", ("benchmarks/tool_learning.py", "--out", "{out}", "--seeds", "0", "--grpo-steps", "30",
                       "--prompts", "32", "--run-timeout", "240"), gpus=1, timeout=560, expect_s=420,
             what="multi-turn GRPO with the python tool beside the same budget single-turn, a small chat model"),
        Step("cpu-runtime", ("benchmarks/cpu_runtime.py", "--out", "{out}/cpu_runtime.json"), timeout=560,
             expect_s=240, what="the driver on CPU: rollout, step split, sync"),
    )),
    Suite("operator", "the operator at scale on the local control plane", (
        Step("scale-100", ("benchmarks/operator_scale.py", "--jobs", "100", "--steady", "60",
                           "--out", "{out}/operator_scale_100.json"), timeout=1200, expect_s=600,
             what="100 RLHFJobs beside KubeRay's own RayJob path (needs the control-plane binaries)"),
    )),
)}


def default_kind(facts: dict[str, Any]) -> str:
    """``nvidia-<model>-x<count>`` of the GPUs found (``harness.gpu_facts``), else ``cpu``."""
    if not facts.get("gpu_count"):
        return "cpu"
    m = re.search(r"\b([ABH]\d{2,3})\b", facts["gpus"][0])
    return f"nvidia-{(m.group(1) if m else 'gpu').lower()}-x{facts['gpu_count']}"


def chosen(suite: Suite, gpus: int, cpu: bool, only: list[str]) -> list[tuple[Step, str | None]]:
    """The suite's steps for this machine, each with why it is skipped (None: it runs): with ``only`` those named
    (an unknown name is an error), else the default ones; GPU steps on a machine with GPUs (unless ``cpu``), CPU
    steps otherwise."""
    names = {s.name for s in suite.steps}
    unknown = sorted(set(only) - names)
    if unknown:
        raise ValueError(f"suite {suite.name} has no step {', '.join(unknown)} (it has {', '.join(sorted(names))})")
    on_gpu = gpus > 0 and not cpu
    out = []
    for s in suite.steps:
        if (only and s.name not in only) or (not only and not s.default) or (s.gpus > 0) != on_gpu:
            continue
        out.append((s, f"needs {s.gpus} GPUs, this machine has {gpus}" if s.gpus > gpus else None))
    return out


def fill(argv: tuple[str, ...], out: Path, kind: str, limit: float) -> list[str]:
    """``argv`` with ``{out}``, ``{kind}`` and ``{timeout}`` filled in, run by this Python."""
    values = {"{out}": str(out), "{kind}": kind, "{timeout}": str(int(max(limit - TEARDOWN_S, 30)))}
    filled = []
    for arg in argv:
        for key, value in values.items():
            arg = arg.replace(key, value)
        filled.append(arg)
    return [sys.executable, *filled]


def figures(path: Path) -> list[dict[str, Any]]:
    """The rows of ``RESULTS.md`` that the result file at ``path`` holds (``results_rows.READERS``)."""
    from results_rows import READERS

    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError):
        return []
    if not isinstance(doc, dict):
        return []
    return [{"area": r.area, **r.values} for reader in READERS for r in reader(doc)]


def run_step(step: Step, out: Path, kind: str, limit: float) -> dict[str, Any]:
    """One step into ``<out>/<step>.log``; its record (argv, exit, seconds) with the figures of every JSON it
    wrote or rewrote under ``out``."""
    argv = fill(step.argv, out, kind, limit)
    before = {p: p.stat().st_mtime for p in out.glob("*.json")}
    print(f"=== {step.name} (limit {limit:.0f} s): {' '.join(argv[1:])}", flush=True)
    ran = harness.run_logged(argv, out / f"{step.name}.log", timeout=limit, cwd=harness.REPO)
    written = sorted(p for p in out.glob("*.json") if p.name != "suite.json" and before.get(p) != p.stat().st_mtime)
    rec = {"name": step.name, "argv": argv[1:], "gpus": step.gpus, **ran, "log": f"{step.name}.log",
           "results": [{"file": p.name, "rows": figures(p)} for p in written]}
    print(f"=== {step.name}: exit {ran['exit']} in {ran['seconds']:.0f} s; " + "; ".join(
        f"{r['file']}: {len(r['rows'])} rows" for r in rec["results"]), flush=True)
    return rec


def run_suite(suite: Suite, a: argparse.Namespace, facts: dict[str, Any]) -> dict[str, Any]:
    """Every chosen step in order within ``a.budget``; the suite's record, rewritten after each step."""
    kind = a.kind or default_kind(facts)
    date = datetime.now(UTC).strftime("%Y-%m-%d")
    out = Path(a.out) if a.out else harness.BENCH / "results" / suite.name / f"{kind}-{date}-suite"
    out.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {"suite": suite.name, "kind": kind, "out": str(out), "command": harness.command_line(),
                              "provenance": harness.provenance(), "steps": [], "status": "running"}
    start = time.monotonic()
    for step, skip in chosen(suite, facts["gpu_count"], a.cpu, a.only):
        left = a.budget - (time.monotonic() - start) if a.budget else step.timeout
        if skip is None and left < MIN_STEP_S:
            skip = f"{left:.0f} s of the suite's --budget left"
        if skip:
            print(f"=== {step.name}: skipped ({skip})", flush=True)
            result["steps"].append({"name": step.name, "skipped": skip})
        else:
            result["steps"].append(run_step(step, out, kind, min(step.timeout, left)))
        harness.write_result(out / "suite.json", result)
    ran = [s for s in result["steps"] if "exit" in s]
    result["status"] = "ok" if ran and all(s["exit"] == 0 for s in ran) else "failed" if ran else "nothing ran"
    result["seconds"] = round(time.monotonic() - start, 1)
    harness.write_result(out / "suite.json", result)
    print(f"suite {suite.name}: {result['status']} in {result['seconds']:.0f} s; {out / 'suite.json'}")
    return result


def listing() -> str:
    lines = []
    for s in SUITES.values():
        lines.append(f"{s.name}: {s.what}")
        for st in s.steps:
            need = f"{st.gpus} GPU{'s' if st.gpus > 1 else ''}" if st.gpus else "CPU"
            lines.append(f"  {st.name:<14} {need:<7} ~{st.expect_s:.0f} s{'' if st.default else ' (--only)'}  "
                         f"{st.what}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python3 -m benchmarks", description=__doc__.split("\n\n")[0])
    p.add_argument("suite", nargs="?", choices=sorted(SUITES))
    p.add_argument("--out", default="", help="where the results go (default: "
                   "benchmarks/results/<suite>/<kind>-<date>-suite)")
    p.add_argument("--kind", default="", help="the device kind, recorded in the results (default: from the GPUs "
                   "found, e.g. nvidia-h100-x1)")
    p.add_argument("--cpu", action="store_true", help="the suite's CPU steps, also on a machine with GPUs")
    p.add_argument("--only", default="", help="comma-separated step names (default: the suite's default steps)")
    p.add_argument("--budget", type=float, default=0.0, help="seconds the whole suite may take (0: no limit)")
    p.add_argument("--archive", default="", help="also pack the results folder into this .tgz (one file to carry "
                   "back where few files may come back, e.g. a lent GPU machine's $OUT)")
    p.add_argument("--list", action="store_true", help="list the suites and their steps")
    a = p.parse_args(argv)
    if a.list or not a.suite:
        print(listing())
        return 0 if a.list else 2
    a.only = [x.strip() for x in a.only.split(",") if x.strip()]
    facts = harness.gpu_facts()
    try:
        chosen(SUITES[a.suite], facts["gpu_count"], a.cpu, a.only)
    except ValueError as e:
        p.error(str(e))
    result = run_suite(SUITES[a.suite], a, facts)
    if a.archive:
        with tarfile.open(a.archive, "w:gz") as tar:
            tar.add(result["out"], arcname=Path(result["out"]).name)
        print(f"packed {result['out']} into {a.archive}")
    return 0 if result["status"] == "ok" else 1


if __name__ == "__main__":
    sys.exit(main())
