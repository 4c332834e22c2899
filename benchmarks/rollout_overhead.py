"""Rollout overhead: the runtime's rollout beside bare vLLM on the same batch, interleaved in one run.

One layout of ``gpu_sync.py`` (one engine; on CPU ``cpu-gloo`` with a random-init model) is started exactly as
the driver starts it (``rlhf_runtime.controller.loop.Runtime``: Ray, placement, trainer and engine actors, one weight
sync, so the engine holds the model's weights). Beside it, in a process of its own, a bare ``vllm.LLM`` with the
engine actor's own arguments and environment (``load_format: auto`` from the same files; on a GPU the same GPU,
at ``--bare-memory``; a vLLM cache root of its own, so it compiles the model as the actor did instead of loading the
actor's compiled artifact, unless ``--bare-shares-cache``) and no Ray (so with the threads a plain process has:
every CPU it may use). Then ``--rounds`` rounds, each timing, in an order that rotates from round to round, the
same batch (``promptsPerStep`` prompts x ``samplesPerPrompt`` samples, one warm-up of each first) these ways:

* ``runtime``: ``Runtime.experience.launch`` + ``collect``, as the driver does a step's rollout (prompt rendering,
  the Ray call, the engine's generate, result packing and transfer);
* ``in_actor``: the engine actor's own ``LLM.generate`` on the same prompts, timed inside the actor
  (``bench_actors.BenchEngine.timed_generate``: no Ray transfer, no packing);
* ``bare``: the bare ``LLM.generate`` in its own process;
* ``bare_default``: a bare ``vllm.LLM`` as a user builds it: the same arguments less the weight-transfer backend
  and the executor (``RUNTIME_ONLY_ARGS``), and vLLM's own environment (the runtime's ``ACTOR_ENV`` unset but
  ``KEPT_ENV``: its engine core in a process of its own), a cache root of its own;
* ``bare_loaded``: a second bare engine that loads the actor's compiled model from the shared cache while
  ``bare`` compiles its own.

``--ways`` picks them (each bare engine holds a share of the GPU: an 8B model leaves room for one). Each
comparison (``COMPARISONS``) is 1 - slower tokens/s / faster tokens/s: ``vs_vllm_defaults`` (runtime vs
bare_default, the issue's "against a bare vllm.LLM"), ``overhead`` (runtime vs bare), split into the driver's path
(runtime vs in_actor) and the actor's process (in_actor vs bare); ``engine_settings`` (bare vs bare_default) and
``compile_cache`` (bare vs bare_loaded). Each is given from the medians, as the median of the rounds, and in
``paired`` from the rounds' paired log ratios with a 95% bootstrap interval. Each batch also records the machine
around it (CPU steal share, busy CPUs; on a GPU its SM clock, power and temperature from ``nvidia-smi``), and
``noise`` correlates them with tokens/s, to say where a batch-to-batch spread comes from. Writes ``--out`` (JSON
with the exact command).

    .venv/bin/python benchmarks/rollout_overhead.py --cpu --out benchmarks/results/rollout/rollout_overhead_cpu.json
    . benchmarks/gpu_env.sh /tmp/site-0.33.0 && python3 benchmarks/rollout_overhead.py --kind nvidia-h200-x2 \\
        --layout separate-nccl --model qwen3-1.7b --rounds 7 --out $OUT/rollout_overhead.json
    T0=$(date +%s) bash hack/gpu/rollout-overhead.sh 1.7b      # one GPU, against vLLM as users build it
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))

import harness
import sync_layouts  # the layouts of the GPU benchmarks
from rollout_stats import COMPARISONS, noise, paired, pool

#: The ways a batch is timed (the module's docstring).
WAYS = ("runtime", "in_actor", "bare", "bare_default", "bare_loaded")
#: The runtime's engine environment that ``bare_default`` keeps: without it the staged GPU machine's vLLM (no
#: ``flashinfer-cubin``) would fetch FlashInfer's sampling kernels and hang (``hack/gpu-stage.py``); on this batch
#: (top-p 1, no top-k) vLLM samples without FlashInfer either way (``TopKTopPSampler.forward_cuda``).
KEPT_ENV = {"VLLM_USE_FLASHINFER_SAMPLER"}
#: The engine arguments of the runtime's that ``bare_default`` leaves to vLLM: the weight-transfer backend and the
#: executor (the runtime runs a TP=1 engine in its actor's process, ``uni``; vLLM picks its own by default).
RUNTIME_ONLY_ARGS = {"weight_transfer_backend", "distributed_executor_backend"}
def _bare(conn: Any, kwargs: dict[str, Any], env: dict[str, str], defaults: bool) -> None:
    """The bare engine's process: build ``vllm.LLM(**kwargs)``, then time each batch it is sent. ``defaults``:
    as a user would build it, with vLLM's own environment (the runtime's ``ACTOR_ENV`` settings unset, e.g. the
    engine core in a process of its own) and no weight-transfer backend."""
    os.environ.update(env)
    if defaults:
        from rlhf_runtime.infra.config import ACTOR_ENV

        for key in set(ACTOR_ENV) - KEPT_ENV:  # the runtime's settings for its engines (the engine core in
            os.environ.pop(key, None)            # the actor's process, ...)
    from bench_actors import engine_facts, time_generate
    from vllm import LLM

    from rlhf_runtime.rollout.base import llm_args

    try:
        if defaults:
            llm = LLM(**{k: v for k, v in kwargs.items() if k not in RUNTIME_ONLY_ARGS})
        else:
            llm = LLM(**llm_args(kwargs))
        conn.send(engine_facts(llm))
        while (msg := conn.recv()) is not None:
            conn.send(time_generate(llm, *msg))
    except BaseException as e:  # noqa: BLE001 - the parent reports it
        conn.send({"error": f"{type(e).__name__}: {e}"})


class Bare:
    def __init__(self, kwargs: dict[str, Any], env: dict[str, str], timeout: float, defaults: bool = False) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.timeout = timeout
        # not a daemon with vLLM's defaults: it starts its engine core as a child process, which daemons may not
        self.proc = ctx.Process(target=_bare, args=(child, kwargs, env, defaults), daemon=not defaults)
        self.proc.start()
        self.facts = self._recv()

    def _recv(self) -> dict[str, Any]:
        if not self.conn.poll(self.timeout):
            raise TimeoutError(f"the bare vLLM process did not answer within {self.timeout:.0f}s")
        msg = self.conn.recv()
        if "error" in msg:
            raise RuntimeError(f"bare vLLM: {msg['error']}")
        return msg

    def generate(self, prompts: list[list[int]], sampling: dict[str, Any]) -> dict[str, Any]:
        self.conn.send((prompts, sampling))
        return self._recv()

    def close(self) -> None:
        try:
            self.conn.send(None)
        except OSError:
            pass
        self.proc.join(30)
        if self.proc.is_alive():
            self.proc.kill()


def host_cpu() -> dict[str, float]:
    """The machine's CPU seconds so far from ``/proc/stat`` (all CPUs): busy (user, nice, system, irq, softirq)
    and steal (time the hypervisor ran something else while a CPU of this machine wanted to run)."""
    try:
        f = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except (OSError, ValueError):
        return {}
    hz = os.sysconf("SC_CLK_TCK")
    f += [0] * (8 - len(f))
    return {"busy": (f[0] + f[1] + f[2] + f[5] + f[6]) / hz, "steal": f[7] / hz}


class GpuClocks:
    """The GPU's SM clock, power and temperature sampled every 100 ms by ``nvidia-smi`` in a thread, each sample
    stamped on arrival (``time.perf_counter``); ``window(t0, t1)`` summarises one batch's samples."""

    FIELDS = ("clocks.sm", "power.draw", "temperature.gpu")

    def __init__(self, index: str) -> None:
        self.samples: list[tuple[float, list[float]]] = []
        self.proc = None
        exe = shutil.which("nvidia-smi")
        if exe is None:
            return
        self.proc = subprocess.Popen(
            [exe, f"--id={index}", "--query-gpu=" + ",".join(self.FIELDS), "--format=csv,noheader,nounits",
             "-lms", "100"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        for line in self.proc.stdout:
            try:
                self.samples.append((time.perf_counter(), [float(x) for x in line.split(",")]))
            except ValueError:
                continue

    def window(self, t0: float, t1: float) -> dict[str, float]:
        xs = [v for t, v in self.samples if t0 <= t <= t1]
        if not xs:
            return {}
        return {name.replace(".", "_"): statistics.mean(v[i] for v in xs) for i, name in enumerate(self.FIELDS)}

    def close(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(10)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cpu", action="store_true", help="on CPU: layout cpu-gloo, float32, the gloo backend")
    p.add_argument("--layout", default="", help="a gpu_sync.py layout with one engine (default: separate-nccl; "
                   "cpu-gloo with --cpu)")
    p.add_argument("--model", default="", help="a gpu_sync.py model (default: qwen3-1.7b; with --cpu a random "
                   "Qwen2 of --hidden x --layers)")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--minutes", type=float, default=0.0,
                   help="stop starting rounds after this many minutes of rounds (0: run all --rounds)")
    p.add_argument("--until", type=float, default=0.0,
                   help="a Unix time: start no round that would end after it, judged by the last round's length "
                   "(a device call's limit, so that the results are written before it)")
    p.add_argument("--write-every-round", action="store_true",
                   help="write --out after every round too (the batches so far, \"complete\": false), for a run "
                   "that outlives the device calls that watch it (hack/gpu/rollout-overhead.sh, BACKGROUND)")
    p.add_argument("--graphs", action="store_true", help="GPU: CUDA graphs (rollout.enforceEager false, the API's "
                   "default; gpu_sync.py's layouts run eager for a faster start)")
    p.add_argument("--prompts", type=int, default=0, help="prompts per batch (default: 64 GPU, 16 CPU)")
    p.add_argument("--samples-per-prompt", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=0, help="default: 128 GPU, 32 CPU")
    p.add_argument("--bare-memory", type=float, default=0.0,
                   help="gpu_memory_utilization of the bare engine (default: the engine's, capped at 0.4 on a GPU, "
                   "where both engines share one)")
    p.add_argument("--bare-shares-cache", action="store_true",
                   help="let the bare engine use vLLM's compile cache as the engine actor wrote it (with CUDA graphs "
                   "it then loads the actor's AOT-compiled model instead of compiling its own; default: a cache "
                   "root of its own, so both engines compile)")
    p.add_argument("--bare-loaded", action="store_true",
                   help="add the way bare_loaded: a second bare engine that loads the engine actor's compiled "
                   "model from its cache (as --bare-shares-cache does) while bare compiles its own: both plain "
                   "processes, so paired compile_cache sizes what loading a compiled artifact changes")
    p.add_argument("--ways", default="runtime,in_actor,bare",
                   help=f"comma-separated, of {', '.join(WAYS)} (the module's docstring; runtime always runs)")
    p.add_argument("--spec-json", default="", help="JSON merged into the layout's spec (e.g. the trainer's "
                   "settings, which a rollout does not use, to leave the GPU's memory to the engines)")
    p.add_argument("--kind", default="cpu", help="device kind, recorded")
    p.add_argument("--timeout", type=float, default=600, help="seconds for any one step (start, rollout)")
    p.add_argument("--out", default=str(ROOT / "results" / "rollout" / "rollout_overhead_cpu.json"))
    p.add_argument("--pool", default="", help="comma-separated result JSONs (complete or a run's rounds so far): "
                   "print each one's and their pooled comparisons (rounds concatenated) and exit; nothing runs")
    return p


def ways_of(a: argparse.Namespace, p: argparse.ArgumentParser) -> list[str]:
    """The ways asked (``runtime`` first, ``bare_loaded`` with ``--bare-loaded``); an unknown one is an error."""
    ways = ["runtime"] + [w for w in a.ways.split(",") if w and w != "runtime"]
    if a.bare_loaded and "bare_loaded" not in ways:
        ways.append("bare_loaded")
    if unknown := [w for w in ways if w not in WAYS]:
        p.error(f"--ways: unknown {', '.join(unknown)} (known: {', '.join(WAYS)})")
    return ways


def job(a: argparse.Namespace, model_path: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """The model (built at ``model_path``) and the job's spec: the layout (one engine, sync mode) of that model, the
    batch, CUDA graphs with ``--graphs``, ``--spec-json`` on top, ``SAFE_ENV`` and the layout's environment for
    every actor."""
    gpu = not a.cpu
    if gpu:
        model = harness.build_model(model_path, a.model or "qwen3-1.7b", True)
    else:
        from rlhf_testing.tiny import build_tiny_model

        build_tiny_model(str(model_path), hidden_size=a.hidden, layers=a.layers)
        model = {"architecture": "Qwen2ForCausalLM", "hidden": a.hidden, "layers": a.layers, "dtype": "float32"}
    over, actor_env = sync_layouts.layout_parts(a.layout)
    spec = harness.merge(harness.base_spec(str(model_path), gpu), over)
    spec = harness.merge(spec, {"algorithm": {"promptsPerStep": a.prompts},
                                "rollout": {"sampling": {"maxTokens": a.max_tokens,
                                                         "samplesPerPrompt": a.samples_per_prompt}}})
    if not gpu:
        spec = harness.merge(spec, {"rollout": {"maxModelLen": 32 + a.max_tokens}})
    elif a.graphs:
        spec = harness.merge(spec, {"rollout": {"enforceEager": False}})
    if a.spec_json:
        spec = harness.merge(spec, json.loads(a.spec_json))
    if spec["rollout"].get("engines", 1) != 1 or spec["weightSync"].get("mode") == "async":
        raise SystemExit(f"{a.layout}: one engine in sync mode only (the bare engine stands for one engine)")
    return model, harness.with_env(spec, {**harness.SAFE_ENV, **actor_env})  # every actor's (the engine's too)


def bare_engines(rt: Any, a: argparse.Namespace, model_path: Path, work: Path, ways: list[str],
                 result: dict[str, Any]) -> tuple[dict[str, Bare], dict[str, str]]:
    """The bare engines of ``ways``, one at a time (each measures the GPU memory it may take at its start), with
    the engine actor's arguments and environment (on a GPU its GPU); their facts and settings in ``result``.
    Returns them and the bare engine's environment."""
    import ray
    from vllm import envs as vllm_envs

    gpu = not a.cpu
    layout_engine = rt.layout.engines[0]
    env = {**rt.actors.env, **layout_engine.env}
    kwargs = dict(rt.actors.engine_kwargs[0], model=str(model_path), load_format="auto")
    if gpu:
        kwargs["gpu_memory_utilization"] = a.bare_memory or min(kwargs["gpu_memory_utilization"], 0.4)
        # the engine actor's own GPU (Ray's CUDA_VISIBLE_DEVICES in the actor)
        env["CUDA_VISIBLE_DEVICES"] = ray.get(rt.actors.engines[0].device_info.remote())["cuda_visible_devices"]
    elif a.bare_memory:
        kwargs["gpu_memory_utilization"] = a.bare_memory
    # the engine actor's compute threads (placement threads on CPU jobs; Ray's default, 1, where unset)
    result["engine_threads"] = rt.actors.actor_env(layout_engine).get("OMP_NUM_THREADS", "Ray's default (1)")
    result["engine_kwargs"] = {k: v for k, v in rt.actors.engine_kwargs[0].items() if k != "model"}
    result["bare_kwargs"] = {k: v for k, v in kwargs.items() if k != "model"}
    actor_cache = env.get("VLLM_CACHE_ROOT") or vllm_envs.VLLM_CACHE_ROOT  # where the actor's engine caches
    if not a.bare_shares_cache:  # compile as the actor did, not load what it compiled (results/rollout/README.md)
        env["VLLM_CACHE_ROOT"] = str(work / "bare-vllm-cache")
    result["bare_compile_cache"] = env.get("VLLM_CACHE_ROOT", "shared with the engine actor")
    result["engine_facts"] = {"runtime": ray.get(rt.actors.engines[0].engine_facts.remote(), timeout=a.timeout)}
    bares: dict[str, Bare] = {}
    for way in ways:
        if way == "bare":
            bares[way] = Bare(kwargs, env, a.timeout)
        elif way == "bare_default":  # a cache root of its own too (compiles, as the actor did)
            bares[way] = Bare(kwargs, {**env, "VLLM_CACHE_ROOT": str(work / "default-vllm-cache")}, a.timeout,
                              defaults=True)
        elif way == "bare_loaded":  # the actor's own cache root, so it loads what the actor compiled
            bares[way] = Bare(kwargs, {**env, "VLLM_CACHE_ROOT": actor_cache}, a.timeout)
        if way in bares:
            result["engine_facts"][way] = bares[way].facts
    print("engines: " + json.dumps(result["engine_facts"]), flush=True)
    return bares, env


def timed_ways(rt: Any, a: argparse.Namespace, bares: dict[str, Bare]) -> dict[str, Any]:
    """Each way's batch as a call: ``runtime`` (launched and collected as a step does), ``in_actor`` (the engine
    actor's own generate) and the bare engines; the same first batch of the job's samples for all."""
    import ray

    from rlhf_runtime.algo.data import render_prompt, step_batch

    job, sampling = rt.job, rt.job.sampling
    batch = step_batch(job.samples, 0, a.prompts, 0)
    ids = [render_prompt(x, job.tokenizer) for x in batch]

    def runtime() -> dict[str, Any]:
        ro = rt.experience.launch(job.tokenizer, batch, sampling, 0)
        outs = rt.experience.collect(ro)
        return {"seconds": time.perf_counter() - ro.t_launch, "tokens": sum(len(c) for o in outs for c in o["samples"])}

    def in_actor() -> dict[str, Any]:
        return ray.get(rt.actors.engines[0].timed_generate.remote(ids, sampling), timeout=a.timeout)

    return {"runtime": runtime, "in_actor": in_actor,
            **{w: (lambda b=b: b.generate(ids, sampling)) for w, b in bares.items()}}


def timer(clocks: GpuClocks | None) -> Any:
    """``timed(way)``: one batch with the machine's state around it (CPU steal and busy CPUs, the GPU's clocks)."""
    cpus = len(os.sched_getaffinity(0))

    def timed(way: Any) -> dict[str, Any]:
        c0, t0 = host_cpu(), time.perf_counter()
        x = way()
        c1, t1 = host_cpu(), time.perf_counter()
        if c0 and c1:
            x["steal_share"] = (c1["steal"] - c0["steal"]) / ((t1 - t0) * cpus)
            x["busy_cpus"] = (c1["busy"] - c0["busy"]) / (t1 - t0)
        if clocks is not None:
            x.update(clocks.window(t0, t1))
        return x
    return timed


def rounds(a: argparse.Namespace, ways: dict[str, Any], names: list[str], timed: Any,
           result: dict[str, Any]) -> tuple[dict[str, Any], dict[str, list[dict[str, Any]]]]:
    """One warm-up batch of each way, then up to ``--rounds`` rounds (``--minutes``, ``--until``), the order
    rotated each round; each batch's tokens/s. The warm-ups and the rounds."""
    warm = {n: timed(ways[n]) for n in names}
    runs: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
    start, last = time.monotonic(), 0.0
    for r in range(a.rounds):
        if (a.minutes and r and time.monotonic() - start > a.minutes * 60) or (
                a.until and r and time.time() + last > a.until):
            break
        t_round = time.monotonic()
        for n in names[r % len(names):] + names[:r % len(names)]:
            x = timed(ways[n])
            x["tokens_per_second"] = x["tokens"] / x["seconds"]
            x["round"] = r
            runs[n].append(x)
        last = time.monotonic() - t_round
        print(f"round {r}: " + ", ".join(f"{n} {runs[n][-1]['tokens_per_second']:.0f}" for n in names)
              + " tokens/s", flush=True)
        if a.write_every_round:  # the batches so far (the summary is made at the end, or from these)
            result.update(warmup=warm, runs=runs, rounds_done=r + 1, complete=False)
            harness.write_result(a.out, result)
    return warm, runs


def summarize(a: argparse.Namespace, warm: dict[str, Any], runs: dict[str, list[dict[str, Any]]],
              result: dict[str, Any]) -> None:
    """The medians and each comparison's overhead (of the medians, of each round, and paired) into ``result``."""
    names = list(runs)
    med = {n: statistics.median(x["tokens_per_second"] for x in runs[n]) for n in names}
    pairs = {k: (slow, fast) for k, (slow, fast) in COMPARISONS.items() if slow in runs and fast in runs}
    result.update({
        "batch": {"prompts": a.prompts, "samples_per_prompt": a.samples_per_prompt, "max_tokens": a.max_tokens},
        "warmup": warm, "runs": runs, "rounds_done": len(runs[names[0]]), "complete": True,
        "median_tokens_per_second": med,
        # each comparison: 1 - slow / fast of the medians, of each round, and from the paired log ratios
        "medians": {k: 1 - med[slow] / med[fast] for k, (slow, fast) in pairs.items()},
        "median_of_rounds": {k: statistics.median(1 - x["tokens_per_second"] / y["tokens_per_second"]
                                                  for x, y in zip(runs[slow], runs[fast]))
                             for k, (slow, fast) in pairs.items()},
        "paired": {k: paired(runs, slow, fast) for k, (slow, fast) in pairs.items()},
        "noise": noise(runs),
    })
    print(f"median tokens/s: {med}", flush=True)
    for k, v in result["paired"].items():
        print(f"{k} ({' vs '.join(pairs[k])}): medians {result['medians'][k]:.1%}, median of rounds "
              f"{result['median_of_rounds'][k]:.1%}, paired {v['mean']:.1%} (95% {v['low']:.1%} .. "
              f"{v['high']:.1%}, {v['rounds']} rounds)", flush=True)
    print("noise: " + json.dumps(result["noise"]), flush=True)


def main() -> int:
    p = parser()
    a = p.parse_args()
    if a.pool:
        return pool(a.pool.split(","))
    ways_asked = ways_of(a, p)
    gpu = not a.cpu
    a.layout = a.layout or ("separate-nccl" if gpu else "cpu-gloo")
    a.prompts, a.max_tokens = a.prompts or (64 if gpu else 16), a.max_tokens or (128 if gpu else 32)

    import bench_actors
    import ray

    from rlhf_api.models import RuntimeConfig
    from rlhf_runtime.controller.loop import Runtime
    from rlhf_runtime.infra.report import Metrics, Reporter

    work = Path(tempfile.mkdtemp(prefix="rlhf-rollout-"))
    model, spec = job(a, work / "model")
    cfg = RuntimeConfig(name="rollout-overhead", namespace="bench", spec=spec)
    rt = Runtime(cfg, Reporter(None, Metrics(cfg.name, cfg.namespace), str(work / "progress.jsonl")), local=True,
                 classes=bench_actors.classes(cfg.spec))
    prov = harness.provenance()
    result: dict[str, Any] = {
        "command": prov["command"], "date": prov["date"], "device_kind": a.kind, "provenance": prov,
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()},
        "layout": a.layout, "model": model, "spec": spec, "ways": ways_asked,
    }
    bares: dict[str, Bare] = {}
    clocks: GpuClocks | None = None
    try:
        rt.run_stages()  # the driver's start: the first sync gives the engine the model's weights, as the bare one has
        rt.weights.wake()
        result["sampling"] = rt.job.sampling
        import vllm

        result["versions"] = {"vllm": vllm.__version__, "ray": ray.__version__}
        bares, env = bare_engines(rt, a, work / "model", work, ways_asked, result)
        clocks = GpuClocks(env["CUDA_VISIBLE_DEVICES"].split(",")[0]) if gpu else None
        ways = timed_ways(rt, a, bares)
        warm, runs = rounds(a, ways, [w for w in ways_asked if w in ways], timer(clocks), result)
        summarize(a, warm, runs, result)
    finally:
        if clocks is not None:
            clocks.close()
        for b in bares.values():
            b.close()
        rt.shutdown()
        harness.write_result(a.out, result)
        print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
