"""GPU weight-sync benchmark: the runtime's own components (``rlhf_runtime.controller.loop.Runtime``, its trainer and
engine actors, ``rlhf_runtime.weight_sync``) on real GPUs, one layout and model size per child process.

For each ``LAYOUT:MODEL`` (e.g. ``separate-nccl:qwen2-0.5b``) a child process

1. builds a random-init model from a real architecture config with ``save_pretrained`` (no hub) and a
   character-level tokenizer of the model's vocabulary size;
2. measures the floor for the bytes the default sync sends (``sent_bytes``: a tied head once): a raw NCCL
   broadcast GPU0 -> GPU1 (``torch.distributed``, two processes) for NCCL layouts, a device-to-device copy on one
   GPU for IPC layouts; ``floor_shares`` sets each arm's bandwidth beside the floor's and says whether it sent
   the same bytes;
3. starts the runtime exactly as the driver does (local Ray, placement groups, trainer and vLLM engine
   actors, ``init_sync``), syncs once (engines start with dummy weights) and runs the driver's validation
   (the synced engine's greedy tokens == a fresh engine loaded from the trainer's weights);
4. times ``--syncs`` steady-state syncs with the default sender settings (colocated: the engine sleeps first, as
   after a rollout, and the sync wakes it), with the engine-side ``load_weights`` time; then the default and the
   sender variants interleaved, ``--syncs`` rounds, each settings once per round (``interleaved_variants``;
   ``--sequential``: each variant's syncs one after another); for
   each settings one sync into scrambled weights, after which the greedy tokens must equal the validated ones;
5. times a rollout (tokens/s; after one warm-up rollout) and one GRPO training step followed by a sync.

Writes ``<out>/gpu_<layout>_<model>.json`` (device kind, date, exact command, every number) and prints a
table at the end. ``--cpu`` runs the same code on CPU (tiny model, gloo backend) as a smoke test.

    PYTHONPATH=/tmp/site:$PWD/operator python3 benchmarks/gpu_sync.py --kind nvidia-h200-x2 --out $OUT \\
        separate-nccl:qwen2-0.5b colocated-ipc:qwen2-0.5b separate-nccl:qwen3-1.7b colocated-ipc:qwen3-1.7b
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))

import harness
from harness import MODELS, SAFE_ENV, base_spec, build_model, median, merge  # noqa: F401 - shared builders
from stack_dumps import watch
from sync_floors import copy_floor, floor_shares, nccl_floor, sent_bytes
from sync_layouts import LAYOUTS, MODEL_TRAINER, layout_parts  # noqa: F401 - LAYOUTS: the layouts, by name
from sync_rollout import BARE_INPUTS, bare_rollout, rollouts
from sync_timing import greedy, summarize, timed_sync
from sync_variants import (
    configure,
    interleaved_variants,
    revalidate_fastest,
    sender_arms,
    sequential_variants,
    sync_options,
)

#: Environment recorded with every result (the device's README asks for these on every command).
ENV_RECORDED = ("PYTHONPATH", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "VLLM_USE_FLASHINFER_SAMPLER",
                "VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_NO_USAGE_STATS", "NCCL_NVLS_ENABLE",
                "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS", "VLLM_BATCH_INVARIANT")


OUT_FILE: Path | None = None


def save(result: dict[str, Any]) -> None:
    """Write the result so far (a run killed at its time limit still leaves what it measured)."""
    if OUT_FILE is not None:
        harness.write_result(OUT_FILE, result)


def job_spec(layout: str, model_name: str, model_path: Path, args: argparse.Namespace) -> dict[str, Any]:
    """The job's spec: ``base_spec`` of the built model, the layout's overrides, the model's trainer settings, the
    command's prompts and tokens; the layout's environment, ``SAFE_ENV`` (and batch-invariant kernels for the
    async layout) in ``spec.env``, which every actor gets."""
    gpu = not args.cpu
    over, actor_env = layout_parts(layout)
    spec = merge(base_spec(str(model_path), gpu), over)
    if model_name in MODEL_TRAINER and gpu:
        spec = merge(spec, {"trainer": MODEL_TRAINER[model_name]})
    if args.prompts:
        spec = merge(spec, {"algorithm": {"promptsPerStep": args.prompts}})
    if args.max_tokens:  # longer samples (the context grows with them: the prompts are short)
        spec = merge(spec, {"rollout": {"maxModelLen": max(spec["rollout"]["maxModelLen"], args.max_tokens + 128),
                                        "sampling": {"maxTokens": args.max_tokens}}})
    env = {**SAFE_ENV, **actor_env, **({"VLLM_BATCH_INVARIANT": "1"} if layout.endswith("async") else {})}
    return harness.with_env(spec, env)


def start(rt: Any, args: argparse.Namespace, result: dict[str, Any], tag: str) -> None:
    """The runtime's start (``Runtime.run_stages``), as the driver runs it: through the trainers' weight-transfer
    modules, then (``--sender-options``) the group with the command's options, the engine- and trainer-side
    timers, the first sync and the first sync's validation (``--skip-validation``: none). Each stage's seconds in
    ``result["stages"]``; the first sync and the validation in the result."""
    import ray

    from rlhf_runtime.controller.validation import ValidationError

    try:
        rt.run_stages(until="transfer")
        first = json.loads(args.sender_options) if args.sender_options else None  # the variants reset them
        if first:
            rt.weights.init_group(sync_options(rt, first))
        # the engine-side timers (bench_actors.TIMED; --engine-device-sync: each waits for the GPU too), the trainer
        # side's (bench_actors.IPC_TRAINER_TIMED) and the direct NCCL sync's timeline (bench_actors.DirectTimeline)
        ray.get([e.load_stats.remote(True, args.engine_device_sync) for e in rt.actors.engines])
        ray.get(rt.actors.trainers[0].send_stats.remote(True))
        ray.get([rt.actors.trainers[0].direct_timeline.remote()]
                + [e.direct_timeline.remote() for e in rt.actors.engines])
        rt.run_stages(until="weight_sync")
        result["sync_options"], result["first_sync"] = rt.weights.in_use, rt.weights.last
        print(f"[{tag}] first sync {result['first_sync']}", flush=True)
        save(result)
        try:
            rt.run_stages()
            result["validation"] = ({"validated": None, "skipped": True} if rt.validation is None else
                                    {k: rt.validation[k] for k in ("validated", "prompts", "engines", "mismatched",
                                                                   "mismatched_by_engine")})
        except ValidationError as e:
            result["validation"] = {"validated": False, "error": str(e)}
    finally:
        result["stages"] = dict(rt.startup.seconds)
    print(f"[{tag}] validation {result['validation']}", flush=True)
    save(result)


def steady_syncs(rt: Any, args: argparse.Namespace, result: dict[str, Any], tag: str,
                 check: tuple[list[Any], int, list[list[int]]]) -> None:
    """``--syncs`` syncs with the job's own options after a warm-up one; then the variants (``--variants``,
    interleaved or ``--sequential``) and ``--revalidate``; back on the job's options at the end."""
    import ray

    prompts, max_new, reference = check
    time.sleep(2)  # let the killed validation engine go
    timed_sync(rt)
    ray.get([e.load_stats.remote(True) for e in rt.actors.engines])
    result["syncs"] = {"default": [timed_sync(rt) for _ in range(args.syncs)]}
    result["summary"] = {"default": {**summarize(result["syncs"]["default"]),
                                     "greedy_equals_validated": greedy(rt, prompts, max_new) == reference}}
    print(f"[{tag}] default {result['summary']['default']}", flush=True)
    save(result)
    result["variant_checks"] = {}
    if args.no_variants:
        return
    arms = sender_arms(args, rt.weights.backend, result["spec"])
    if args.sequential:
        sequential_variants(rt, arms[1:], args.syncs, check, result, tag, save)
    elif len(arms) > 1:
        interleaved_variants(rt, arms, args.syncs, check, result, tag, save)
    if args.revalidate:
        revalidate_fastest(rt, arms, result, tag, save)
    # back on the sender's defaults (the job's format) for the training step's sync; a re-created group (a packed
    # variant last) first makes its three-call sync, so the one after training is as the job's
    if configure(rt, arms[0][1])["regrouped"]:
        timed_sync(rt)


def train_and_sync(rt: Any, ro: Any, outs: Any, result: dict[str, Any], tag: str,
                   check: tuple[list[Any], int, list[list[int]]]) -> None:
    """One GRPO step on the last rollout (every trainer rank on its share), then the sync the driver would do; the
    greedy tokens must have changed."""
    import ray

    prompts, max_new, reference = check
    if rt.sleeps:
        rt.weights.sleep(next_syncs=True)
    trainers = rt.actors.trainers
    w = len(trainers)
    pr = [ro.prompt_ids[i] for i, o in enumerate(outs) for _ in o["samples"]]
    comps = [c for o in outs for c in o["samples"]]
    adv = [((i % 8) - 3.5) / 2.3 for i in range(len(comps))]
    before = ray.get([tr.memory.remote() for tr in trainers])  # resets the peaks: the step's own next
    t = time.perf_counter()
    stats = ray.get([tr.train.remote({"prompts": pr[r::w], "completions": comps[r::w], "advantages": adv[r::w]})
                     for r, tr in enumerate(trainers)])[0]
    result["train"] = {"seconds": time.perf_counter() - t, "stats": stats, "memory_before": before,
                       "memory": ray.get([tr.memory.remote() for tr in trainers])}
    result["sync_after_train"] = rt.weights.sync(1)
    result["sync_after_train"]["greedy_changed"] = greedy(rt, prompts, max_new) != reference
    print(f"[{tag}] train {result['train']['seconds']:.2f}s, sync after train "
          f"{result['sync_after_train']['total_s'] * 1e3:.1f} ms", flush=True)


def run_one(layout: str, model_name: str, args: argparse.Namespace, result: dict[str, Any]) -> None:
    """One layout and model: the model (built, or found under ``--work``), the runtime started as the driver starts
    it (``start``), the steady syncs and variants, rollouts, a training step and its sync."""
    import bench_actors

    from rlhf_api.models import RuntimeConfig
    from rlhf_runtime.algo.data import render_prompt
    from rlhf_runtime.controller.loop import Runtime
    from rlhf_runtime.infra.report import Metrics, Reporter

    tag, gpu = f"{layout}:{model_name}", not args.cpu
    work = Path(args.work) / f"{layout}_{model_name}"
    work.mkdir(parents=True, exist_ok=True)
    model_path = harness.model_dir(model_name, gpu, Path(args.work) / "models")
    result["model"] = harness.cached_model(model_path, model_name, gpu)
    print(f"[{tag}] model {result['model']['params'] / 1e9:.3f}B params "
          f"{'reused' if result['model'].get('reused') else 'built'}", flush=True)
    if args.build_only:  # the model alone, for a later call on the same machine
        return
    result["spec"] = job_spec(layout, model_name, model_path, args)
    cfg = RuntimeConfig(name=f"bench-{layout}", namespace="bench", spec=result["spec"])
    reporter = Reporter(None, Metrics(cfg.name, cfg.namespace), str(work / "progress.jsonl"))
    # engines with scramble_weights/load_stats, trainers with timelines (the runtime's extension point)
    rt = Runtime(cfg, reporter, local=True, validate=not args.skip_validation,
                 classes=bench_actors.classes(cfg.spec))
    try:
        start(rt, args, result, tag)
        prompts = [render_prompt(s, rt.job.tokenizer) for s in rt.job.samples[:8]]
        max_new = cfg.spec.rollout.sampling.max_tokens
        check = (prompts, max_new, greedy(rt, prompts, max_new))  # the later checks compare with these tokens
        steady_syncs(rt, args, result, tag, check)
        ro, outs = rollouts(rt, args, result, tag, model_path, save)
        train_and_sync(rt, ro, outs, result, tag, check)
    finally:
        rt.shutdown()


def measure_floor(layout: str, model_name: str, result: dict[str, Any]) -> None:
    """The run's floor (``sync_floors``), before Ray and the engines take the GPUs, for the bytes the default sync
    sends: a raw NCCL broadcast to every engine GPU for NCCL layouts, a device copy for IPC ones."""
    import torch
    import transformers

    arch, cfg_kw = MODELS[model_name]
    with torch.device("meta"):
        m = getattr(transformers, f"{arch}ForCausalLM")(getattr(transformers, f"{arch}Config")(**cfg_kw))
    nbytes = sent_bytes(m)
    del m
    if "nccl" in layout:
        r = merge(base_spec("m", True), layout_parts(layout)[0])["rollout"]
        result["floor"] = nccl_floor(nbytes, 1 << 30, 1 + r["engines"] * r["tensorParallelSize"])
    else:
        result["floor"] = copy_floor(nbytes)
        torch.cuda.empty_cache()
    print(f"[{layout}:{model_name}] floor {({k: v for k, v in result['floor'].items() if k != 'samples'})}",
          flush=True)
    save(result)


def versions(gpu: bool) -> dict[str, Any]:
    """The versions the run imported (torch, vLLM, Ray, Python) and on a GPU the GPUs' names."""
    import torch

    out: dict[str, Any] = {"versions": {"torch": torch.__version__, "python": sys.version.split()[0]}}
    try:
        import ray
        import vllm

        out["versions"].update(vllm=vllm.__version__, ray=ray.__version__)
    except Exception as e:  # noqa: BLE001 - recorded: the run goes on to fail where it needs them
        out["versions"]["import_error"] = repr(e)
    if gpu:
        out["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return out


def child(args: argparse.Namespace) -> int:
    """One ``LAYOUT:MODEL`` run (``--one``) into ``gpu_<layout>_<model>.json``: the floor, ``run_one``, and with
    ``--bare-rollout`` the last rollout on a bare engine; every failure recorded in the result."""
    import bench_actors

    bench_actors.enable_stack_dumps()  # the parent asks for the stacks before it kills a run past its limit
    layout, model_name = args.one.split(":")
    gpu = not args.cpu
    result: dict[str, Any] = {
        "layout": layout, "model_name": model_name, "device_kind": args.kind,
        "date": datetime.now(UTC).isoformat(timespec="seconds"), "command": args.command,
        "status": "running", "provenance": harness.provenance(args.command),
        "env": {k: os.environ.get(k) for k in ENV_RECORDED if k in os.environ},
    }
    global OUT_FILE
    OUT_FILE = Path(args.out) / f"gpu_{layout}_{model_name}.json"
    try:
        result.update(versions(gpu))
        if gpu:
            measure_floor(layout, model_name, result)
        run_one(layout, model_name, args, result)
        if args.bare_rollout and BARE_INPUTS:
            result["bare_rollout"] = bare = bare_rollout(gpu)
            if "tokens_per_second" in bare:
                result["rollout"]["overhead"] = 1 - result["rollout"]["tokens_per_second"] / bare["tokens_per_second"]
            print(f"[{layout}:{model_name}] bare vLLM rollout {bare}", flush=True)
        result["status"] = "ok"
    except BaseException as e:  # noqa: BLE001 - record every failure in the result file
        result["status"] = "failed"
        result["error"] = f"{type(e).__name__}: {e}"[:4000]
        result["traceback"] = traceback.format_exc()[-8000:]
        print(result["traceback"], flush=True)
    finally:
        result["floor_shares"] = floor_shares(result)
        save(result)
    return 0 if result["status"] == "ok" else 1


def table(out: Path, names: list[str]) -> str:
    lines = [("layout:model | status | valid | sync ms (default) | GB/s | % of floor | best variant ms | best GB/s | "
              "floor GB/s | tok/s   (% of floor marked * where the floor moved other bytes than the syncs sent)")]
    for name in names:
        layout, model_name = name.split(":")
        f = out / f"gpu_{layout}_{model_name}.json"
        if not f.exists():
            lines.append(f"{name} | not run")
            continue
        r = json.loads(f.read_text())
        s = r.get("summary", {})
        d = s.get("default", {})
        arms = {**s, **r.get("summary_interleaved", {})}  # interleaved variants: their own summary
        best = min((v for v in arms.values() if v.get("median_total_s")), key=lambda v: v["median_total_s"],
                   default={})
        fl = r.get("floor", {})
        fg = fl.get("whole_gbps", fl.get("copy_gbps", 0))
        share = floor_shares(r).get("summary", {}).get("default")
        pct = f"{share['share']:.1%}{'' if share['same_bytes'] else '*'}" if share else "-"
        lines.append(
            f"{name} | {r.get('status')} {r.get('error', '')[:80]} | {r.get('validation', {}).get('validated')} | "
            f"{d.get('median_total_s', 0) * 1e3:.1f} | {d.get('gbps', 0):.1f} | {pct} | "
            f"{best.get('median_total_s', 0) * 1e3:.1f} | {best.get('gbps', 0):.1f} | {fg:.0f} | "
            f"{r.get('rollout', {}).get('tokens_per_second', 0):.0f}"
        )
    return "\n".join(lines)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("runs", nargs="*", help="LAYOUT:MODEL, e.g. separate-nccl:qwen2-0.5b")
    p.add_argument("--kind", default="unknown", help="the device kind, recorded in the results")
    p.add_argument("--out", default=str(ROOT / "results" / "sync"))
    p.add_argument("--work", default="/tmp/rlhf-gpu-bench")
    p.add_argument("--syncs", type=int, default=5)
    p.add_argument("--timeout", type=float, default=240, help="seconds per run")
    p.add_argument("--deadline", type=float, default=0, help="skip runs that would start after this many seconds")
    p.add_argument("--cpu", action="store_true", help="CPU smoke test (tiny model, gloo)")
    p.add_argument("--no-variants", action="store_true")
    p.add_argument("--bare-rollout", action="store_true",
                   help="also time the last rollout batch on a bare vllm.LLM (the runtime's overhead)")
    p.add_argument("--rollouts", type=int, default=1, help="timed rollouts of the same batch after a warm-up")
    p.add_argument("--prompts", type=int, default=0, help="prompts per rollout (default: the base spec's 64)")
    p.add_argument("--max-tokens", type=int, default=0, help="sampling.maxTokens (default: the base spec's 128)")
    p.add_argument("--scaling-rounds", type=int, default=1,
                   help="rounds of the DP scaling pass (engine counts interleaved, scaling_order)")
    p.add_argument("--scaling-per-engine", type=int, default=0,
                   help="DP scaling with this many prompts per engine (weak scaling: k engines get k times as "
                        "many); 0: the same batch of promptsPerStep prompts at every engine count")
    p.add_argument("--variants", default="", help="comma-separated variant names to time (default: all)")
    p.add_argument("--sequential", action="store_true",
                   help="time each variant's syncs one after another instead of "
                   "interleaved with the default's")
    p.add_argument("--revalidate", action="store_true",
                   help="after the variants, sync with the fastest one and run the fresh-engine validation again")
    p.add_argument("--engine-device-sync", action="store_true",
                   help="engine-side timers (start/receive/finish of the worker transfer engine) wait for the GPU "
                   "before stopping (device-complete times; adds one synchronize per step)")
    p.add_argument("--sender-options", default="",
                   help="JSON of sync options in force from the first sync (the spec's weightSync "
                        "fields of sync_variants.SPEC_FIELDS), e.g. '{\"packed\": false}'")
    p.add_argument("--py-spy", default="",
                   help="path of a py-spy executable: a run past its limit also gets the native stacks of every "
                        "Ray process (native_stacks_<layout>_<model>.txt in --out)")
    p.add_argument("--skip-validation", action="store_true",
                   help="no fresh-engine validation after the first sync (a layout validated before, when the call "
                        "has no time for it); the later greedy checks compare with the tokens after the first sync")
    p.add_argument("--build-only", action="store_true",
                   help="build (or find) each run's model under --work and its floor, then stop: a later call on the "
                   "same machine reuses the model")
    p.add_argument("--one", help=argparse.SUPPRESS)
    p.add_argument("--command", help=argparse.SUPPRESS)
    return p


#: Options passed on to each run's child as they are (flags, and options with a value where one is set).
FLAGS = ("cpu", "no_variants", "sequential", "bare_rollout", "revalidate", "engine_device_sync", "build_only",
         "skip_validation")
VALUED = ("variants", "prompts", "max_tokens", "sender_options")


def child_argv(args: argparse.Namespace, name: str, out: Path, command: str) -> list[str]:
    """The child process of run ``name``: this script with ``--one`` and the parent's options."""
    cmd = [sys.executable, __file__, "--one", name, "--kind", args.kind, "--out", str(out), "--work", args.work,
           "--syncs", str(args.syncs), "--command", command, "--scaling-rounds", str(args.scaling_rounds),
           "--scaling-per-engine", str(args.scaling_per_engine), "--rollouts", str(args.rollouts)]
    cmd += [f"--{f.replace('_', '-')}" for f in FLAGS if getattr(args, f)]
    for k in VALUED:
        if getattr(args, k):
            cmd += [f"--{k.replace('_', '-')}", str(getattr(args, k))]
    return cmd


def marked(line: str) -> bool:
    """A child's line the parent prints as it comes: the run's own reports and errors."""
    return line.startswith("[") or "Error" in line or "error" in line[:200]


def run_child(args: argparse.Namespace, name: str, out: Path, command: str, limit: float) -> int | None:
    """One run's child, watched (``stack_dumps.watch``) into ``gpu_sync.log``; past ``limit`` its result says so.
    Its local Ray ends with its process group either way. The exit code, None at the limit."""
    log = out / "gpu_sync.log"
    with open(log, "ab") as f:
        f.write(f"\n=== {name}\n".encode())
    code = watch(child_argv(args, name, out, command), log, limit, marked,
                 native=out / f"native_stacks_{name.replace(':', '_')}.txt", py_spy=args.py_spy)
    if code is None:
        res = out / f"gpu_{name.replace(':', '_')}.json"
        r = json.loads(res.read_text()) if res.exists() else {"layout": name}
        r.update(status="timeout", error=f"no result within {limit:.0f}s")
        harness.write_result(res, r)
    return code


def main() -> int:
    p = parser()
    args = p.parse_args()
    if args.revalidate and args.no_variants:  # it syncs with the fastest variant: there is none without variants
        p.error("--revalidate needs the variants (it re-validates the fastest one): drop --no-variants")
    if args.one:
        return child(args)
    command, out = harness.command_line(), Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    start, codes = time.time(), {}
    for name in args.runs:
        elapsed = time.time() - start
        if args.deadline and elapsed + 60 > args.deadline:
            print(f"skip {name}: {elapsed:.0f}s spent of the {args.deadline:.0f}s deadline", flush=True)
            continue
        limit = args.timeout if not args.deadline else min(args.timeout, args.deadline - elapsed)
        print(f"=== {name} (limit {limit:.0f}s)", flush=True)
        t = time.time()
        codes[name] = run_child(args, name, out, command, limit)
        print(f"=== {name}: exit {codes[name]} in {time.time() - t:.0f}s", flush=True)
    print(table(out, args.runs))
    return 0 if all(c == 0 for c in codes.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
