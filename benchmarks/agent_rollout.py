"""Multi-turn rollout on CPU (``spec.environment``): the runtime's own time per turn, the engine's busy share with
a 200 ms tool beside the same rollout in lockstep, and a fuzz of tool and environment faults, in one run.

The job is started as the driver starts it (``controller.loop.Runtime.run_stages``: a local Ray,
the trainer and one vLLM CPU engine, the first weight sync) with the driver's test hook for scripted turns
(``rlhf_testing.driver.classes``, ``--turn-script``): a random tiny chat model (``rlhf_testing.tiny_chat``)
generates each turn's scripted text under vLLM's structured outputs, so every trajectory makes exactly the tool
calls its prompt's script names. Every rollout is the driver's own path: ``AgentExperience.launch`` and
``collect`` over an ``AgentRollout`` that ``build_rollout`` made from the arm's ``spec.environment`` (the continuous
arm is the one the runtime built for the job); its figures are ``metrics.Counters.summary`` (the step's
``agent_rollout`` record). Tools, the environment class and the HTTP server are ``rlhf_testing.agent_faults``.

* **Per-turn overhead** (``turn_overhead_p50_ms``): the rollout's time between an engine's answer and the
  trajectory's next request, tool and environment time excluded (``Counters.overhead``; it includes waiting for
  the event loop that every trajectory shares).
* **Busy share** (``engine_busy_share``, ``EngineLoad``: the share of the rollout's wall time the engine had a
  request in flight): ``--trajectories`` trajectories at once, each ``--tool-turns`` calls of a tool that answers
  after 200 ms (``agent_faults.wait``, a coroutine) with a query of random length, then a final answer of random
  length (the ``continuous`` arm). The ``lockstep`` arm runs the same trajectories (same prompts, same tokens)
  with ``agent_faults.wait_lockstep``: each call waits its 200 ms, then until every trajectory's call of that
  round has arrived, so each turn waits for the whole batch's tools and the next round's requests reach the
  engine together (an ideal lockstep rollout). One warm-up rollout, then ``--rounds`` rounds of both arms, the
  order alternating; ``busy_share_continuous_over_lockstep`` pairs them by round.
* **Fault fuzz**: trajectories whose turns (seeded random plan) call a tool that times out, raises, answers too
  much or answers bytes that are not UTF-8, make a malformed call, call an unknown tool or pass bad arguments;
  an environment class that raises in ``step`` or ``reset`` (``FaultEnv``); an HTTP environment server
  (``FaultServer``) that answers 503 to every request at first, 503 to one turn until the runtime gives up, 503
  twice then recovers, 400, a body that is not JSON, bytes that are not UTF-8. ``failed_runs``: rollouts that
  raised; the faults the plan injected beside those the runtime counted, by kind; whether every trajectory made
  its planned turns; where the text was not UTF-8, whether the observation carries U+FFFD instead.

    .venv/bin/python benchmarks/agent_rollout.py --out benchmarks/results/rollout/agent_rollout_cpu.json
    . benchmarks/gpu_env.sh && python3 benchmarks/agent_rollout.py --gpu --out $OUT/agent_rollout_gpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
FAULTS = "rlhf_testing.agent_faults"
SCHEMA = {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]}
LETTERS = "abcdefghijklmnopqrstuvwxyz"
#: The issue's targets: overhead at most, busy share at least, failed runs at most over at least so many faults.
TARGETS = {"turn_overhead_p50_ms": 2.0, "engine_busy_share": 0.8, "failed_runs": 0, "faults": 200}
#: Tool faults a turn may make: kind -> the tool call's text for a query. Two may share a turn.
TOOL_FAULTS = {
    "timeout": "hang", "exception": "boom", "output_truncated": "flood", "invalid_utf8": "badbytes",
    "unknown_tool": "nosuch",
}
#: Faults that are a turn of their own.
ALONE = {
    "malformed_call": '<tool_call>{{"name": "echo", "arguments": {{"query": "{q}"}}</tool_call>',
    "bad_arguments": '<tool_call>{{"name": "echo", "arguments": {{"q": "{q}"}}}}</tool_call>',
}
#: Environment faults of a turn by environment kind: fault -> the text before the turn's calls.
ENV_FAULTS = {
    "class": {"env_exception": "crash "},
    "http": {"http_5xx_down": "[http:down] ", "http_5xx_flaky": "[http:flaky] ", "http_4xx": "[http:4xx] ",
             "http_garbage": "[http:garbage] ", "http_invalid_utf8": "[http:badutf8] "},
}
#: Which of the runtime's fault kinds (``Counters.errors``) counts each injected fault; None: not a counted
#: fault (retried until it answered, or the bytes replaced): contained, checked otherwise.
COUNTED_AS = {
    "timeout": "timeout", "exception": "exception", "output_truncated": "output_truncated",
    "invalid_utf8": "invalid_utf8",
    "unknown_tool": "unknown_tool", "malformed_call": "malformed_call", "bad_arguments": "bad_arguments",
    "env_exception": "environment", "env_reset_exception": "environment", "http_5xx_down": "environment",
    "http_5xx_flaky": None, "http_4xx": "environment", "http_garbage": "environment",
    "http_invalid_utf8": "environment",
}
REPLACED = ("invalid_utf8",)


# ----------------------------------------------------------------------------------------------- plans
def tool_call(name: str, query: str) -> str:
    return f'<tool_call>{{"name": "{name}", "arguments": {{"query": "{query}"}}}}</tool_call>'


def word(rng: random.Random, lo: int, hi: int) -> str:
    return "".join(rng.choice(LETTERS) for _ in range(rng.randint(lo, hi)))


def perf_script(prompts: int, tool_turns: int, seed: int) -> dict[str, list[str]]:
    """``prompts`` prompts, each ``tool_turns`` calls of ``wait`` (a query of 4-40 letters), then a final answer."""
    rng = random.Random(seed)
    return {f"perf {i:03d}": [tool_call("wait", f"t{k}{word(rng, 4, 40)}") for k in range(tool_turns)]
            + [f"the answer is {word(rng, 2, 40)}"] for i in range(prompts)}


def fuzz_plan(prompts: int, env: str, seed: int, reset_crashes: int = 0) -> dict[str, list[list[str]]]:
    """Each prompt's turns as lists of fault kinds (3-5 turns; a turn: one or two tool faults or an ``ALONE``
    fault, plus an ``ENV_FAULTS[env]`` fault on about half); the first ``reset_crashes`` prompts' environments
    raise in ``reset`` instead (no turns)."""
    rng = random.Random(f"{seed}:{env}")
    plan: dict[str, list[list[str]]] = {}
    for i in range(prompts):
        if i < reset_crashes:
            plan[f"{env} {i:03d} reset-crash"] = [["env_reset_exception"]]
            continue
        turns = []
        for _ in range(rng.randint(3, 5)):
            kinds = rng.sample(sorted(TOOL_FAULTS), rng.randint(1, 2)) if rng.random() < 0.75 else \
                [rng.choice(sorted(ALONE))]
            if rng.random() < 0.5:
                kinds.append(rng.choice(sorted(ENV_FAULTS[env])))
            turns.append(kinds)
        plan[f"{env} {i:03d}"] = turns
    return plan


def turn_text(kinds: list[str], query: str) -> str:
    """One planned turn's text: its environment fault's marker and query (the environment tells the turns of a
    trajectory apart by it), then its calls."""
    env = "".join(text for faults in ENV_FAULTS.values() for k, text in faults.items() if k in kinds)
    calls = [ALONE[k].format(q=query) for k in kinds if k in ALONE]
    calls += [tool_call(TOOL_FAULTS[k], query) for k in kinds if k in TOOL_FAULTS]
    return (f"{env}{query} " if env else "") + "".join(calls or [tool_call("echo", query)])


def fuzz_script(plan: dict[str, list[list[str]]]) -> dict[str, list[str]]:
    """The plan as turn texts (each turn's query names its turn, so no two turns of a trajectory are the same),
    then a final answer; a reset crash has no turns."""
    return {p: [turn_text(kinds, f"{i}x{k}") for k, kinds in enumerate(turns)] + ["done"]
            for i, (p, turns) in enumerate(plan.items()) if "env_reset_exception" not in turns[0]}


def injected(plan: dict[str, list[list[str]]], n: int) -> dict[str, int]:
    """Faults the plan injects by kind, over ``n`` trajectories per prompt."""
    out: dict[str, int] = {}
    for turns in plan.values():
        for kinds in turns:
            for k in kinds:
                out[k] = out.get(k, 0) + n
    return dict(sorted(out.items()))


def planned(plans: dict[str, dict[str, list[list[str]]]]) -> dict[str, dict[str, int]]:
    """Each prompt's planned turns (its fault turns and the final answer; none after a reset crash) and how many
    observations carry U+FFFD (a turn with bytes that are not UTF-8 whose environment step answered)."""
    # the step's answer is an error instead
    lost = ("env_exception", "http_5xx_down", "http_4xx", "http_garbage", "http_invalid_utf8")
    out = {}
    for plan in plans.values():
        for p, turns in plan.items():
            reset = "env_reset_exception" in turns[0]
            out[p] = {"turns": 0 if reset else len(turns) + 1,
                      "replaced": 0 if reset else sum(1 for kinds in turns if any(k in REPLACED for k in kinds)
                                                      and not any(k in lost for k in kinds))}
    return out


def expected_counted(injected_by_kind: dict[str, int]) -> dict[str, int]:
    """What the runtime should count of ``injected_by_kind`` (``COUNTED_AS``), by its kinds."""
    out: dict[str, int] = {}
    for k, v in injected_by_kind.items():
        if COUNTED_AS[k] is not None:
            out[COUNTED_AS[k]] = out.get(COUNTED_AS[k], 0) + v
    return dict(sorted(out.items()))


# ----------------------------------------------------------------------------------------------- specs
def tools_spec(names: dict[str, str]) -> list[dict[str, Any]]:
    """Tools ``name -> agent_faults function``, each taking a string ``query``."""
    return [{"name": name, "function": f"{FAULTS}:{fn}", "parameters": SCHEMA} for name, fn in names.items()]


def environments(server_url: str, trajectories: int) -> dict[str, dict[str, Any]]:
    """``spec.environment`` of each arm."""
    perf = {"toolParser": "hermes", "maxTurns": 16, "maxTokens": 2000, "maxTokensPerTurn": 160,
            "concurrency": max(64, trajectories), "python": {"timeoutSeconds": 120}}
    fuzz_tools = tools_spec({n: n for n in ("echo", "hang", "boom", "flood", "badbytes")})
    fuzz = {"toolParser": "hermes", "maxTurns": 8, "maxTokens": 4000, "maxTokensPerTurn": 200, "tools": fuzz_tools,
            "python": {"timeoutSeconds": 0.5, "maxOutputBytes": 256}, "errorWarningFraction": 1.0}
    return {
        "continuous": {**perf, "tools": tools_spec({"wait": "wait"})},
        "lockstep": {**perf, "tools": tools_spec({"wait": "wait_lockstep"})},
        "class": {**fuzz, "className": f"{FAULTS}:FaultEnv"},
        "http": {**fuzz, "http": {"url": server_url, "timeoutSeconds": 10, "unreachableSeconds": 120}},
    }


def job_spec(model: Path, prompts: list[str], environment: dict[str, Any], gpu: bool = False) -> dict[str, Any]:
    """The tiny job on CPU; with ``gpu`` the trainer and the engine share one GPU (colocated, IPC sync)."""
    from rlhf_testing.tiny import tiny_job_spec

    spec = tiny_job_spec(model, steps=1)
    spec["rollout"] = {**spec["rollout"], "maxModelLen": 4096,
                       "sampling": {"temperature": 1.0, "maxTokens": 160, "samplesPerPrompt": 2}}
    if gpu:
        spec["trainer"] = {**spec["trainer"], "gpusPerReplica": 1}
        spec["rollout"].update(gpuMemoryUtilization=0.3, enforceEager=True)
        spec.update(placement={"mode": "colocated"}, weightSync={"backend": "ipc"})
    spec.update(algorithm={**spec["algorithm"], "promptsPerStep": 2}, data={"prompts": prompts}, reward={},
                environment=environment, progressDeadlineSeconds=3600)
    return spec


# ----------------------------------------------------------------------------------------------- running
class Bench:
    """The started job and one rollout of an arm at a time."""

    def __init__(self, work: Path, spec: dict[str, Any], script: dict[str, list[str]]) -> None:
        from rlhf_testing.driver import classes

        from rlhf_api.models import RuntimeConfig
        from rlhf_runtime.controller.loop import Runtime
        from rlhf_runtime.infra.report import Metrics, Reporter

        self.cfg = RuntimeConfig(name="agent-rollout", namespace="bench", uid="bench", spec=spec)
        (work / "job.json").write_text(self.cfg.model_dump_json(by_alias=True))
        (work / "script.json").write_text(json.dumps(script))
        hooked = classes(str(work / "job.json"), turn_script=str(work / "script.json"))
        reporter = Reporter(None, Metrics(self.cfg.name, self.cfg.namespace), str(work / "progress.jsonl"))
        self.rt = Runtime(self.cfg, reporter, local=True, classes=hooked)
        self.rollouts: dict[str, Any] = {}
        self.step = 0

    def start(self, envs: dict[str, dict[str, Any]]) -> None:
        """The driver's start (every stage of ``Runtime.run_stages``), then each arm's rollout on the job's
        engine."""
        from rlhf_runtime.controller.agent_experience import AgentExperience, build_rollout

        t0 = time.perf_counter()
        self.rt.run_stages()
        self.job = self.rt.job
        self.start_seconds = time.perf_counter() - t0
        self.samples = {s.prompt: s for s in self.job.samples}
        for arm, env in envs.items():
            if arm == "continuous":
                assert self.rt.agent is not None and self.cfg.spec.environment is not None
                rollout = self.rt.agent.rollout  # the one the runtime built for the job (its environment)
            else:
                cfg = self.cfg.model_copy(update={"spec": self.cfg.spec.model_copy(
                    update={"environment": type(self.cfg.spec.environment).model_validate(env)})})
                rollout = build_rollout(cfg, self.job.tokenizer, self.rt.actors.engines, None, self.job.sampling)
            self.rollouts[arm] = AgentExperience(rollout, self.rt.deadlines)

    def run(self, arm: str, prompts: list[str], n: int, facts: bool = False) -> dict[str, Any]:
        """One rollout of ``arm``: its ``agent_rollout`` record and seconds (or the error); ``facts``: each
        trajectory's too (``trajectory_facts``)."""
        exp = self.rollouts[arm]
        self.step += 1
        self.rt.watchdog.progress()
        t0 = time.perf_counter()
        try:
            exp.rollout.envs.wait_ready()
            results = exp.collect(exp.launch([self.samples[p] for p in prompts], n, self.step))
        except Exception as e:  # noqa: BLE001 - a failed run is the fuzz's figure
            return {"arm": arm, "error": f"{type(e).__name__}: {e}"[:2000], "seconds": time.perf_counter() - t0}
        out = {"arm": arm, "seconds": time.perf_counter() - t0, "agent_rollout": exp.last}
        if facts:
            out["trajectories"] = [trajectory_facts(r) for r in results]
        return out

    def close(self) -> None:
        self.rt.shutdown()


def trajectory_facts(r: Any) -> dict[str, Any]:
    """A trajectory's prompt, turns, how it ended, and its observations that carry U+FFFD."""
    obs = [m for m in r.messages if m.get("role") != "assistant"]
    return {"prompt": r.sample.prompt, "turns": r.turns, "ended": r.ended,
            "replaced": sum("\ufffd" in str(m.get("content", "")) for m in obs)}


def perf_rounds(bench: Bench, prompts: list[str], rounds: int) -> list[dict[str, Any]]:
    """A warm-up (the continuous arm: both arms generate the same tokens), then ``rounds`` rounds of both arms,
    the order alternating."""
    from rlhf_testing.agent_faults import set_lockstep

    records = []
    for r in range(-1, rounds):
        arms = ("continuous",) if r < 0 else ("continuous", "lockstep") if r % 2 == 0 else ("lockstep", "continuous")
        for arm in arms:
            set_lockstep(len(prompts))
            rec = bench.run(arm, prompts, 1)
            rec["round"] = r
            a = rec.get("agent_rollout") or {}
            print(f"round {r} {arm}: {rec['seconds']:.1f} s busy {a.get('engine_busy_share')} overhead p50 "
                  f"{a.get('turn_overhead_p50_ms')} ms errors {a.get('tool_errors') or rec.get('error')}", flush=True)
            records.append(rec)
    return records


def fuzz_runs(bench: Bench, plans: dict[str, dict[str, list[list[str]]]], n: int,
              server: Any) -> list[dict[str, Any]]:
    """One rollout per environment kind over its plan's prompts (the HTTP one starts in a 1 s outage)."""
    records = []
    for env, plan in plans.items():
        if env == "http":
            server.outage(1.0)
        rec = bench.run(env, list(plan), n, facts=True)
        rec["injected"] = injected(plan, n)
        print(f"fuzz {env}: {rec['seconds']:.1f} s counted {(rec.get('agent_rollout') or {}).get('tool_errors')} "
              f"{rec.get('error', '')}", flush=True)
        records.append(rec)
    return records


# ----------------------------------------------------------------------------------------------- results
def spread(xs: list[float | None]) -> dict[str, Any] | None:
    """Median, min and max of the values that are there, and how many."""
    vals = [x for x in xs if x is not None]
    if not vals:
        return None
    return {"median": statistics.median(vals), "min": min(vals), "max": max(vals), "n": len(vals)}


def perf_summary(records: list[dict[str, Any]]) -> dict[str, Any]:
    """The timed rounds (not the warm-up) of each arm, and the continuous arm's busy share over the lockstep's,
    paired by round."""
    timed = [r for r in records if r["round"] >= 0 and "agent_rollout" in r]

    def of(arm: str, key: str) -> list[Any]:
        return [r["agent_rollout"].get(key) for r in timed if r["arm"] == arm]

    out: dict[str, Any] = {}
    for arm in ("continuous", "lockstep"):
        out[arm] = {k: spread(of(arm, k)) for k in ("turn_overhead_p50_ms", "engine_busy_share",
                                                    "tool_latency_p50_s", "turns_mean")}
        out[arm]["rollout_seconds"] = spread([r["seconds"] for r in timed if r["arm"] == arm])
        out[arm]["tool_errors"] = [r["agent_rollout"].get("tool_errors") for r in timed if r["arm"] == arm]
    by_round: dict[int, dict[str, float]] = {}
    for r in timed:
        by_round.setdefault(r["round"], {})[r["arm"]] = r["agent_rollout"].get("engine_busy_share")
    ratios = [v["continuous"] / v["lockstep"] for v in by_round.values()
              if v.get("continuous") is not None and v.get("lockstep")]
    out["busy_share_continuous_over_lockstep"] = spread(ratios)
    out["failed_rollouts"] = sum(1 for r in records if "error" in r)
    return out


def fuzz_summary(records: list[dict[str, Any]], plans: dict[str, dict[str, list[list[str]]]],
                 server_answers: dict[str, int]) -> dict[str, Any]:
    """Failed runs, faults injected and counted by kind, and whether every trajectory was contained."""
    inj: dict[str, int] = {}
    counted: dict[str, int] = {}
    plan = planned(plans)
    off_plan, replaced, replaced_expected, trajectories = [], 0, 0, 0
    for r in records:
        for k, v in r["injected"].items():
            inj[k] = inj.get(k, 0) + v
        for k, v in ((r.get("agent_rollout") or {}).get("tool_errors") or {}).items():
            counted[k] = counted.get(k, 0) + v
        for t in r.get("trajectories", []):
            trajectories += 1
            replaced += t["replaced"]
            replaced_expected += plan[t["prompt"]]["replaced"]
            if t["turns"] != plan[t["prompt"]]["turns"] or t["replaced"] != plan[t["prompt"]]["replaced"]:
                off_plan.append(t)
    return {
        "failed_runs": sum(1 for r in records if "error" in r), "rollouts": len(records),
        "trajectories": trajectories, "faults_injected": sum(inj.values()), "faults_injected_by_kind": inj,
        "faults_counted": sum(counted.values()), "faults_counted_by_kind": dict(sorted(counted.items())),
        "faults_counted_expected_by_kind": expected_counted(inj),
        "invalid_utf8_injected": sum(inj.get(k, 0) for k in REPLACED),
        "observations_with_replacement_char": replaced, "observations_with_replacement_char_expected":
            replaced_expected,
        "trajectories_off_plan": off_plan[:10], "trajectories_off_plan_count": len(off_plan),
        "server_answers": dict(sorted(server_answers.items())),
    }


def targets(perf: dict[str, Any], fuzz: dict[str, Any]) -> dict[str, Any]:
    """Each target beside the figure that meets it or not."""
    over = (perf["continuous"]["turn_overhead_p50_ms"] or {}).get("median")
    busy = (perf["continuous"]["engine_busy_share"] or {}).get("median")
    return {
        "turn_overhead_p50_ms": {"target_at_most": TARGETS["turn_overhead_p50_ms"], "median": over,
                                 "met": over is not None and over <= TARGETS["turn_overhead_p50_ms"]},
        "engine_busy_share": {"target_at_least": TARGETS["engine_busy_share"], "median": busy,
                              "met": busy is not None and busy >= TARGETS["engine_busy_share"]},
        "fault_fuzz": {"target": "0 failed runs over >= 200 faults", "failed_runs": fuzz["failed_runs"],
                       "faults_injected": fuzz["faults_injected"],
                       "met": fuzz["failed_runs"] == 0 and fuzz["faults_injected"] >= TARGETS["faults"]},
    }


def machine(gpu: bool = False) -> dict[str, Any]:
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    out = {"cpu_model": cpu, "cpus": os.cpu_count(), "cpus_usable": len(os.sched_getaffinity(0)),
           "platform": platform.platform(), "python": platform.python_version()}
    if gpu:
        from harness import gpu_facts

        out["gpu"] = gpu_facts()
    return out


def git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=False).stdout.strip()


# ----------------------------------------------------------------------------------------------- main
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="benchmarks/results/rollout/agent_rollout_cpu.json")
    p.add_argument("--rounds", type=int, default=5, help="timed rounds of each performance arm (after a warm-up)")
    p.add_argument("--trajectories", type=int, default=64, help="concurrent trajectories of the performance arms")
    p.add_argument("--tool-turns", type=int, default=3, help="tool calls of each performance trajectory")
    p.add_argument("--fuzz-prompts", type=int, default=16, help="prompts of each fuzz rollout (class, http)")
    p.add_argument("--fuzz-samples", type=int, default=2, help="trajectories per fuzz prompt")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--gpu", action="store_true", help="the engine and the trainer on one GPU (colocated)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    os.environ.update({"RAY_health_check_failure_threshold": "20", "RAY_health_check_timeout_ms": "30000",
                       "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"})
    from rlhf_testing.agent_faults import FaultServer
    from rlhf_testing.tiny_chat import build_tiny_chat_model

    result: dict[str, Any] = {
        "command": shlex.join(["python3" if a.gpu else ".venv/bin/python", "benchmarks/agent_rollout.py",
                                *(argv or sys.argv[1:])]),
        "date": datetime.now(UTC).isoformat(timespec="seconds"), "commit": git("rev-parse", "HEAD"),
        "machine": machine(a.gpu), "load_average_start": os.getloadavg(), "args": vars(a),
    }
    work = Path(tempfile.mkdtemp(prefix="rlhf-agent-rollout-"))
    model = long_context(build_tiny_chat_model(work / "model"), 4096)
    perf = perf_script(a.trajectories, a.tool_turns, a.seed)
    plans = {env: fuzz_plan(a.fuzz_prompts, env, a.seed, reset_crashes=2 if env == "class" else 0)
             for env in ("class", "http")}
    script = {**perf, **{p: t for plan in plans.values() for p, t in fuzz_script(plan).items()}}
    server = FaultServer()
    envs = environments(server.url, a.trajectories)
    bench = Bench(work, job_spec(model, list(perf) + [p for pl in plans.values() for p in pl], envs["continuous"],
                                 a.gpu), script)
    try:
        bench.start(envs)
        result["start_seconds"] = bench.start_seconds
        records = perf_rounds(bench, list(perf), a.rounds)
        fuzz = fuzz_runs(bench, plans, a.fuzz_samples, server)
    finally:
        bench.close()
        server.close()
    result.update(versions=versions(), load_average_end=os.getloadavg(), spec_environments=envs,
                  performance=perf_summary(records), fuzz=fuzz_summary(fuzz, plans, dict(server.answers)),
                  rollouts=records + fuzz)
    result["targets"] = targets(result["performance"], result["fuzz"])
    write(Path(a.out), result)
    print(json.dumps({k: result[k] for k in ("targets", "load_average_start", "load_average_end")}, indent=1))
    return 0


def long_context(model: Path, positions: int) -> Path:
    """The tiny model with ``positions`` positions (a random Qwen2: RoPE, nothing learned per position), so a
    fuzz trajectory's tools, turns and observations fit."""
    config = json.loads((model / "config.json").read_text())
    config["max_position_embeddings"] = positions
    (model / "config.json").write_text(json.dumps(config, indent=1))
    return model


def versions() -> dict[str, str]:
    import ray
    import vllm

    return {"vllm": vllm.__version__, "ray": ray.__version__}


def write(out: Path, result: dict[str, Any]) -> None:
    """The JSON, replaced whole (written beside it, then renamed)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(json.dumps(result, indent=1, default=str) + "\n")
    tmp.replace(out)


if __name__ == "__main__":
    raise SystemExit(main())
