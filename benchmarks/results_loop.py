"""The rows of ``RESULTS.md``'s whole-loop area (``results_rows.READERS`` includes these readers): learning runs,
peers on the same work, the driver's step on CPU, PPO with every role, the rendered RayJob on GPUs and the colocated
memory plan."""

from __future__ import annotations

import re
from typing import Any

from results_common import Doc, Row, gpu_kind, layout_gpus, median_of, num, per_gpu, vllm_version


def _spec_layout(spec: Any) -> str | None:
    """A job spec's layout in words: placement, trainer GPUs, engines and their tensor parallel size."""
    if not isinstance(spec, dict) or "trainer" not in spec:
        return None
    t, r = spec.get("trainer") or {}, spec.get("rollout") or {}
    mode = (spec.get("placement") or {}).get("mode", "separate")
    trainer = int(t.get("replicas", 1)) * int(t.get("gpusPerReplica", 1))
    return f"{mode}: trainer {trainer} GPU, {r.get('engines', 1)} engine TP={r.get('tensorParallelSize', 1)}"


def _split(**parts: Any) -> str | None:
    text = ", ".join(f"{name} {v:.2f}" for name, v in parts.items() if num(v) is not None)
    return text or None


def read_learning(doc: Doc) -> list[Row]:
    """``gpu_learning.py``: one row per run (side, variant, seed); the rows of one configuration and day combine
    into their medians."""
    if not (isinstance(doc.get("runs"), list) and doc.get("task") and isinstance(doc.get("args"), dict)):
        return []
    if isinstance(doc.get("summary"), dict) and "tools_accuracy" in doc["summary"]:
        return []  # tool_learning.py's: read_tool_learning
    kind = gpu_kind(doc.get("device"))
    steps = doc["args"].get("grpo_steps")
    model = f"{doc['args'].get('layers')}-layer decoder, hidden {doc['args'].get('hidden')}"
    rows = []
    for run in doc["runs"]:
        if not isinstance(run, dict) or run.get("exit_code") not in (0, None):
            continue
        evals = [e for e in run.get("eval") or [] if isinstance(e, dict) and "exact_match" in e]
        side = {"trl": "TRL"}.get(run.get("side"), run.get("side") or "runtime")
        variant = run.get("variant")
        values = {
            "work": f"{doc['task']}, {steps} GRPO steps", "model": model, "gpus": 1, "kind": kind,
            "side": side if variant in (None, "trl") else f"{side}, {variant}",
            "step_s": median_of([s.get("step_seconds") for s in run.get("steps") or [] if isinstance(s, dict)]),
            "outcome": evals[-1]["exact_match"] if evals else None,
            "outcome_step": evals[-1].get("step") if evals else None, "wall_s": num(run.get("wall_seconds")),
            "vllm": vllm_version(doc),
        }
        key = ("learning", doc["task"], steps, kind, values["side"], vllm_version(doc))
        rows.append(Row("learning", key, str(doc.get("date", ""))[:10], values, str(doc.get("command", "")),
                        merge=True))
    return rows


def read_tool_learning(doc: Doc) -> list[Row]:
    """``tool_learning.py``: per arm (the python tool, single turn, TRL's GRPOTrainer with the tool) the held-out
    accuracy after the last step, the median over seeds (the summary's ``tools_accuracy`` /
    ``single_turn_accuracy`` / ``trl_tools_accuracy``); for an arm whose runs all stopped early (their time limit,
    exit 124, or a failure), its last eval, the step it was taken at and why. The tools checkpoint's accuracy
    before the first step is part of the configuration (runs from another checkpoint are another row)."""
    s, args = doc.get("summary"), doc.get("args")
    if not (isinstance(s, dict) and "tools_accuracy" in s and isinstance(args, dict) and doc.get("task")):
        return []
    kind, rows, start = gpu_kind(doc.get("device")), [], num(s.get("tools_accuracy_at_start"))
    work = f"{doc['task']}, {s.get('grpo_steps')} GRPO steps" + (
        f" from a tools checkpoint at {start:.3f}" if start is not None else "")
    for arm, key, side in (("tools", "tools_accuracy", "runtime, python tool"),
                           ("single", "single_turn_accuracy", "runtime, single turn"),
                           ("trl-tools", "trl_tools_accuracy", "TRL GRPOTrainer, python tool")):
        trained = [r for r in doc.get("runs") or [] if isinstance(r, dict) and r.get("arm") == arm
                   and (num(r.get("learning_rate")) or 0) > 1e-9]
        runs = [r for r in trained if r.get("exit_code") == 0]
        outcome, at = s.get(key), s.get("grpo_steps")
        if outcome is None or not runs:
            evals = [e for r in trained for e in r.get("eval") or [] if isinstance(e, dict)]
            if not evals:
                continue
            runs, outcome, at = trained, evals[-1].get("accuracy"), evals[-1].get("step")
            codes = sorted({r.get("exit_code") for r in trained}, key=str)
            why = "its time limit" if codes == [124] else f"exit {', '.join(map(str, codes))}"
            side += f" (stopped at step {max(len(r.get('steps') or []) for r in trained)}: {why})"
        values = {"work": work,
                  "model": f"{args.get('layers')}-layer chat decoder, hidden {args.get('hidden')}", "gpus": 1,
                  "kind": kind, "side": side, "outcome": outcome, "outcome_step": at,
                  "step_s": median_of([st.get("step_seconds") for r in runs for st in r.get("steps") or []
                                       if isinstance(st, dict)]),
                  "wall_s": median_of([r.get("wall_seconds") for r in runs]), "vllm": vllm_version(doc)}
        rows.append(Row("learning", ("tool_learning", work, kind, side, vllm_version(doc)),
                        str(doc.get("date", ""))[:10], values, str(doc.get("command", ""))))
    return rows


def read_peer(doc: Doc) -> list[Row]:
    """``trl_peer.py``: the runtime, TRL and veRL on the same GRPO work, median step and samples/s per side."""
    overall, work = doc.get("overall"), doc.get("work")
    if not (isinstance(overall, dict) and isinstance(work, dict)):
        return []
    model = (doc.get("model") or {}).get("name") if isinstance(doc.get("model"), dict) else None
    kind = gpu_kind(doc.get("device"), "cpu" if work.get("device", "cpu") == "cpu" else None)
    rows = []
    for side, label in (("ours", "runtime"), ("trl", "TRL"), ("verl", "veRL")):
        res = overall.get(side)
        if not isinstance(res, dict):
            continue
        prompt = f", {work['prompt_tokens']}-token prompts" if work.get("prompt_tokens") else ""
        values = {
            "work": f"GRPO, {work.get('samples_per_step')} samples x {work.get('max_tokens')} tokens a step{prompt}",
            "model": model, "kind": kind, "side": label, "step_s": num(res.get("median_step_s")),
            "samples_s": num(res.get("samples_per_s")), "gpus": None if kind == "CPU" else 1,
            "layout": _peer_layout(work, side), "tps_gpu": num(res.get("tokens_per_s_median")),
            "vllm": _peer_vllm(doc), "rollout_tps": num(res.get("rollout_tokens_per_s_median")),
            "split": _split(rollout=res.get("rollout_s_median"), train=res.get("train_s_median")),
            "sync_ms": (num(res.get("sync_s_median")) or 0) * 1e3 or None, "mfu": num(res.get("mfu_median")),
            "outcome_text": (f"{res.get('measured_steps')} steps over {res.get('runs')} interleaved runs; step "
                        f"{res.get('min_step_s'):.2f}-{res.get('max_step_s'):.2f} s" if res.get("runs") else None),
        }
        by_round = overall.get(f"tokens_per_s_ratio_ours_to_{side}_by_round")
        if isinstance(by_round, dict) and values["outcome_text"]:  # on the peer's row: ours / it, round by round
            values["outcome_text"] += (f"; ours / {label} tokens/s by round {by_round['median']:.2f}x "
                                       f"({by_round['min']:.2f}-{by_round['max']:.2f}x, {by_round['rounds']} rounds)")
        key = ("peer", model, kind, label, work.get("samples_per_step"), work.get("max_tokens"))
        rows.append(Row("learning", key, str(doc.get("date", "")), values, str(doc.get("command", ""))))
    return rows


def _peer_layout(work: dict[str, Any], side: str) -> str | None:
    """What a ``trl_peer.py`` GPU run set on both sides (and on ours alone)."""
    if work.get("device") != "cuda" or "sleep" not in work:
        return None
    parts = [f"colocated, vLLM share {work.get('gpu_memory_utilization')}",
             "engine sleeps" if work.get("sleep") else "engine resident"]
    if work.get("gradient_checkpointing"):
        parts.append("checkpointing")
    if side == "ours":
        parts += [p for p, on in (("compiled trainer", work.get("compile")), ("CUDA graphs", work.get("cuda_graphs")))
                  if on]
    else:
        parts.append(f"micro-batch {work.get('micro_batch')}")
    return ", ".join(parts)


def _peer_vllm(doc: Doc) -> str | None:
    """The vLLM a ``trl_peer.py`` run used, as its peer recorded it."""
    for rnd in doc.get("rounds") or []:
        for side in rnd.values() if isinstance(rnd, dict) else []:
            v = ((side.get("versions") or {}) if isinstance(side, dict) else {}).get("vllm")
            if isinstance(v, str):
                return v
    return None


def read_cpu_runtime(doc: Doc) -> list[Row]:
    """``cpu_runtime.py``: the driver's whole step on CPU and its split."""
    med = doc.get("median")
    if not (isinstance(med, dict) and "step_seconds" in med and isinstance(doc.get("model"), dict)):
        return []
    m, w = doc["model"], doc.get("workload") or {}
    values = {
        "work": f"GRPO, length reward, {w.get('prompts_per_step')} prompts x {w.get('samples_per_prompt')}",
        "model": f"hidden {m.get('hidden')}, {m.get('layers')} layers, {m.get('dtype')}", "kind": "CPU",
        "layout": f"local, actors' threads: {w.get('omp_threads')}", "side": "runtime",
        "step_s": num(med["step_seconds"]),
        "split": _split(rollout=med.get("rollout_seconds"), train=med.get("train_seconds")),
        "sync_ms": (num(med.get("weight_sync_seconds")) or 0) * 1e3 or None,
        "rollout_tps": num(med.get("rollout_tokens_per_second")),
    }
    key = ("cpu", values["model"], values["layout"])
    return [Row("learning", key, str(doc.get("date", "")), values, str(doc.get("command", "")))]


def read_ppo(doc: Doc) -> list[Row]:
    """``gpu_ppo.py``: the PPO step's median after step 1, split by role."""
    med = doc.get("median_after_step_1")
    if not (doc.get("benchmark") == "gpu_ppo" and isinstance(med, dict)):
        return []
    gpus = layout_gpus(doc.get("spec"))
    values = {
        "work": "PPO (critic, reference, reward model)", "model": re.sub(r".*--model[ =](\S+).*", r"\1",
                                                                         str(doc.get("command", ""))),
        "gpus": gpus, "kind": gpu_kind(doc.get("device")), "layout": _spec_layout(doc.get("spec")),
        "side": "runtime", "step_s": num(med.get("stepSeconds")),
        "split": _split(rollout=med.get("rolloutSeconds"), train=med.get("trainSeconds"),
                        reward=med.get("rewardSeconds"), reference=med.get("referenceSeconds"),
                        critic=med.get("criticSeconds")),
        "sync_ms": (num(med.get("weightSyncSeconds")) or 0) * 1e3 or None,
        "rollout_tps": num(med.get("rolloutTokensPerSecond")),
    }
    values["tps_gpu"] = per_gpu(values["rollout_tps"], gpus)
    key = ("ppo", values["model"], values["kind"], values["layout"])
    return [Row("learning", key, str(doc.get("date", "")), values, str(doc.get("command", "")))]


def read_rendered(doc: Doc) -> list[Row]:
    """``rendered_cluster.py``: the rendered RayJob's driver on one GPU host, the medians of steps 2 on."""
    summary = doc.get("summary")
    if not (isinstance(summary, dict) and isinstance(doc.get("rendered"), dict) and doc.get("layout")):
        return []
    gpus = layout_gpus(doc.get("spec"))
    report = doc.get("final_report") if isinstance(doc.get("final_report"), dict) else {}
    later = [s for s in doc.get("steps") or [] if isinstance(s, dict) and s.get("step", 0) >= 2]
    values = {
        "work": "GRPO, length reward, through the rendered RayJob", "model": doc.get("model_name"), "gpus": gpus,
        "kind": gpu_kind(doc.get("device_kind")), "layout": doc["layout"], "side": "runtime",
        "step_s": num(summary.get("median_step_s")),
        "split": _split(rollout=median_of([s.get("rollout_s") for s in later]), train=summary.get("median_train_s")),
        "sync_ms": num(summary.get("median_sync_ms")), "rollout_tps": num(summary.get("median_tokens_per_second")),
        "mfu": num((report.get("throughput") or {}).get("mfu")), "vllm": vllm_version(doc),
        "outcome_text": f"{summary.get('steps_completed')} steps, validated: {summary.get('validated')}",
    }
    values["tps_gpu"] = per_gpu(values["rollout_tps"], gpus)
    key = ("rendered", doc.get("model_name"), values["kind"], doc["layout"])
    return [Row("learning", key, str(doc.get("date", "")), values, str(doc.get("command", "")))]


def _colocated_memory_row(doc: Doc, run: Doc, kind: str | None, model: str) -> Row | None:
    """One ``colocated_memory.py`` driver run: the medians of its steps after step 1 (step 1 alone where it has no
    later one), with the settings its variant names and what the memory plan decided."""
    parts = str(run.get("variant", "")).split(":")
    steps = [s for s in run.get("steps") or [] if isinstance(s, dict)]
    if len(parts) < 5 or not steps:
        return None
    _, util, offload, max_tokens, _, *rest = parts
    flags = tuple(sorted(f for f in (rest[0] if rest else "").split(",") if f))
    later = [s for s in steps if (num(s.get("step")) or 0) >= 2]
    used = later or steps
    plan = run.get("memory_plan") if isinstance(run.get("memory_plan"), dict) else {}
    prompts = re.search(r"--prompts[ =](\d+)", str(doc.get("command", "")))

    def med(key: str) -> float | None:
        return median_of([s.get(key) for s in used])

    moved = f" ({'on' if plan['offload'] else 'off'})" if "offload" in plan else ""
    sync_s = med("weight_sync_seconds")
    which = f"medians of steps {used[0].get('step')}-{used[-1].get('step')}" if later else "step 1 only (start-up in it)"
    kv = (f"; plan: KV cache {plan.get('kv_cache_gib')} GiB, {plan.get('sequences_at_once')} of "
          f"{plan.get('batch_sequences')} sequences at once") if plan else ""
    floor = run.get("decode_read_floor") if isinstance(run.get("decode_read_floor"), dict) else {}
    rollout_s = med("rollout_seconds")
    if num(floor.get("seconds")) and rollout_s:
        kv += f"; rollout {floor['seconds'] / rollout_s:.0%} of its read floor ({floor['seconds']:.1f} s)"
    values = {
        "work": f"GRPO, length reward, {prompts.group(1) if prompts else 16} prompts x 8 x {max_tokens} tokens",
        "model": model, "gpus": None if kind == "CPU" else 1, "kind": kind, "side": "runtime",
        "layout": (f"colocated, gpuMemoryUtilization {util}, offloadDuringRollout {offload}{moved}, "
                   f"{'CUDA graphs' if 'graphs' in flags else 'eager'} engine, "
                   f"{'compiled' if 'compile' in flags else 'eager'} trainer"
                   + (", fp8 KV cache" if "fp8kv" in flags else "")),
        "step_s": med("step_seconds"), "split": _split(rollout=med("rollout_seconds"), train=med("train_seconds")),
        "sync_ms": sync_s * 1e3 if sync_s is not None else None, "rollout_tps": med("rollout_tokens_per_second"),
        "mfu": med("mfu"), "vllm": (doc.get("device") or {}).get("vllm"),
        "outcome_text": f"{len(steps)} step(s), exit {run.get('exit_code')}; {which}{kv}",
    }
    values["tps_gpu"] = per_gpu(values["rollout_tps"], values["gpus"])
    key = ("colocated-memory", model, kind, util, offload, max_tokens, flags)
    return Row("learning", key, str(doc.get("date", "")), values, str(doc.get("command", "")))


def read_colocated_memory(doc: Doc) -> list[Row]:
    """``colocated_memory.py``: one row per driver run that recorded a step (a refused run records none)."""
    device, model = doc.get("device"), doc.get("model")
    if not (isinstance(doc.get("runs"), list) and isinstance(device, dict) and "total_gib" in device
            and isinstance(model, dict)):
        return []
    kind = gpu_kind(device.get("name"), "cpu" if not device.get("name") else None)
    name = "tiny" if kind == "CPU" else "qwen3-1.7b"  # the shapes the script builds (random weights)
    rows = [_colocated_memory_row(doc, r, kind, name) for r in doc["runs"] if isinstance(r, dict)]
    return [r for r in rows if r is not None]
