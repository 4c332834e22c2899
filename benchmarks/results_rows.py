"""The rows of ``benchmarks/RESULTS.md``, read from one result file each.

Every reader takes one parsed JSON document and returns its rows: the area, the configuration a row stands for (the
newest row of each configuration is the one shown), when it ran, and the figures as numbers or strings. A figure a
file does not record is ``None`` (an empty cell); a reader returns no rows for a document of another format or a run
that ended before its figure. ``READERS`` is the list ``results_table.py`` tries on every file."""

from __future__ import annotations

import re
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

Doc = dict[str, Any]


@dataclass(frozen=True)
class Row:
    """One table row: ``key`` the configuration, ``when`` the run's date as recorded (ISO; compared as text),
    ``values`` the figures by column, ``merge`` whether rows of one configuration and day combine (seeds)."""

    area: str
    key: tuple
    when: str
    values: dict[str, Any]
    command: str = ""
    path: str = ""
    merge: bool = False
    runs: int = 1
    extra_paths: tuple[str, ...] = field(default=())


def gpu_kind(*names: Any) -> str | None:
    """The accelerator named in the first of ``names`` that names one (``NVIDIA H200``, ``nvidia-h100-x2``), or
    ``CPU`` for a CPU device; None when none does."""
    for name in names:
        if not isinstance(name, str):
            continue
        m = re.search(r"\b(?:nvidia-)?([ABH]\d{2,3})\b", name, re.IGNORECASE)
        if m:
            return m.group(1).upper()
        if name.lower().startswith("cpu"):
            return "CPU"
    return None


def layout_gpus(spec: Any) -> int | None:
    """GPUs a job spec's layout takes: trainer replicas x GPUs each, engines x tensor parallel size; one set for
    colocated placement, both for separate."""
    if not isinstance(spec, dict) or "trainer" not in spec:
        return None
    t = spec.get("trainer") or {}
    r = spec.get("rollout") or {}
    trainer = int(t.get("replicas", 1)) * int(t.get("gpusPerReplica", 1))
    engines = int(r.get("engines", 1)) * int(r.get("tensorParallelSize", 1))
    if (spec.get("placement") or {}).get("mode", "separate").startswith("coloc"):
        return max(trainer, engines)
    return trainer + engines


def vllm_version(doc: Doc) -> str | None:
    versions = doc.get("versions") if isinstance(doc.get("versions"), dict) else {}
    v = versions.get("vllm") or doc.get("vllm")
    return v if isinstance(v, str) else None


def _num(x: Any) -> float | None:
    return float(x) if isinstance(x, int | float) and not isinstance(x, bool) else None


def _per_gpu(rate: Any, gpus: int | None) -> float | None:
    rate = _num(rate)
    return rate / gpus if rate is not None and gpus else None


def _median(xs: list[Any]) -> float | None:
    nums = [v for v in (_num(x) for x in xs) if v is not None]
    return statistics.median(nums) if nums else None


def _floor_share(sent: float | None, seconds: float | None, floor: Any) -> tuple[str | None, float | None]:
    """The floor's kind and the sync's bandwidth over the floor's (bytes per second each, so a floor of other
    bytes still compares)."""
    if not isinstance(floor, dict):
        return None, None
    floor_s = _num(floor.get("whole_s")) or _num(floor.get("copy_s"))
    kind = "NCCL broadcast" if "whole_s" in floor else "device copy" if "copy_s" in floor else None
    floor_bytes = _num(floor.get("bytes"))
    if not (sent and seconds and floor_s and floor_bytes):
        return kind, None
    return kind, (sent / seconds) / (floor_bytes / floor_s)


def _sender(summary: Doc, syncs: Any) -> str | None:
    first = syncs[0] if isinstance(syncs, list) and syncs and isinstance(syncs[0], dict) else {}
    parts = [summary.get("format"), summary.get("ipc") and f"ipc {summary['ipc']}", first.get("nccl")]
    text = ", ".join(p for p in parts if isinstance(p, str) and p)
    return text or None


def read_sync(doc: Doc) -> list[Row]:
    """``gpu_sync.py``: the default sender's median sync beside its floor, the rollout and the training step."""
    summary = (doc.get("summary") or {}).get("default") if isinstance(doc.get("summary"), dict) else None
    if not (isinstance(summary, dict) and doc.get("layout") and doc.get("model_name")):
        return []
    gpus = layout_gpus(doc.get("spec"))
    kind = gpu_kind(*(doc.get("gpus") or []), doc.get("device_kind"), doc["layout"])
    seconds = _num(summary.get("median_total_s"))
    sent = _num(summary.get("bytes"))
    floor_kind, share = _floor_share(sent, seconds, doc.get("floor"))
    rollout = doc.get("rollout") if isinstance(doc.get("rollout"), dict) else {}
    train = doc.get("train") if isinstance(doc.get("train"), dict) else {}
    validated = (doc.get("validation") or {}).get("validated") if isinstance(doc.get("validation"), dict) else None
    values = {
        "model": doc["model_name"], "gpus": gpus, "kind": kind, "layout": doc["layout"],
        "sender": _sender(summary, (doc.get("syncs") or {}).get("default")), "sync_ms": seconds and seconds * 1e3,
        "sent_gb": sent and sent / 1e9, "gbps": _num(summary.get("gbps")), "floor": floor_kind, "share": share,
        "rollout_tps_gpu": _per_gpu(rollout.get("tokens_per_second"), gpus), "train_s": _num(train.get("seconds")),
        "validated": validated, "status": doc.get("status"), "vllm": vllm_version(doc),
    }
    return [Row("sync", (doc["model_name"], kind, gpus, doc["layout"]), str(doc.get("date", "")), values,
                str(doc.get("command", "")))]


def read_async(doc: Doc) -> list[Row]:
    """``gpu_async.py``: the median of the steps' syncs in async mode (pause, transfer, resume)."""
    if not (isinstance(doc.get("steps"), list) and doc.get("engine") and doc.get("layout") and doc.get("model_name")):
        return []
    syncs = [s.get("sync") for s in doc["steps"] if isinstance(s, dict) and isinstance(s.get("sync"), dict)]
    seconds = _median([s.get("total_s") for s in syncs])
    if seconds is None:
        return []
    kind = gpu_kind(doc.get("device_kind"))
    layout = f"{doc['layout']} ({doc['engine']} engine)"
    values = {
        "model": doc["model_name"], "kind": kind, "layout": layout, "sender": syncs[0].get("format"),
        "sync_ms": seconds * 1e3, "sent_gb": (_num(syncs[0].get("bytes")) or 0) / 1e9 or None,
        "gbps": _median([s.get("gbps") for s in syncs]), "status": doc.get("status"),
        "validated": (doc.get("validation") or {}).get("validated"), "vllm": vllm_version(doc),
    }
    return [Row("sync", (doc["model_name"], kind, None, layout), str(doc.get("date", "")), values,
                str(doc.get("command", "")))]


def _train_setting(entry: Doc, command: str) -> str:
    """What a trainer step ran with: compiled or eager, checkpointing, micro-batch budget, and the options that
    are not the default (FSDP2's reshard, the output layer's chunk, the old trainer)."""
    compiled = entry.get("compiled_layers", "--compile-layers" in command)
    ckpt = entry.get("gradient_checkpointing", "--no-checkpointing" not in command)
    parts = ["compiled" if compiled else "eager", "checkpointing " + ("on" if ckpt else "off")]
    if entry.get("budget"):
        parts.append(f"{int(entry['budget']) // 1024}k budget")
    if entry.get("reshard_after_forward") is False or "--no-reshard" in command:
        parts.append("reshardAfterForward false")
    if entry.get("logit_chunk_elements"):
        parts.append(f"output chunks 2^{int(entry['logit_chunk_elements']).bit_length() - 1}")
    return ", ".join(parts)


def _world(command: str) -> int | None:
    m = re.search(r"--world[ =](\d+)", command)
    return int(m.group(1)) if m else 1


def read_train_step(doc: Doc) -> list[Row]:
    """``train_step.py``: per sequence length (and the long-tailed mix), the step's time, tokens/s/GPU and MFU."""
    if not (isinstance(doc.get("lengths"), list) and "peak_flops" in doc and doc.get("model")):
        return []
    command = str(doc.get("command", ""))
    entries = [e for e in doc["lengths"] if isinstance(e, dict) and "length" in e and not e.get("legacy")]
    if isinstance(doc.get("mix"), dict) and "median_s" in doc["mix"]:
        entries.append({**doc["mix"], "length": "mix"})
    kind = gpu_kind(doc.get("device"))
    rows = []
    for e in entries:
        gpus = e.get("gpus") or _world(command)
        setting = _train_setting(e, command)
        values = {
            "model": doc["model"], "gpus": gpus, "kind": kind, "length": e["length"], "tokens": e.get("tokens"),
            "setting": setting, "step_s": _num(e.get("median_s")),
            "tps_gpu": _num(e.get("tokens_per_s_per_gpu")) or _per_gpu(e.get("tokens_per_s"), gpus),
            "mfu": _num(e.get("mfu")), "peak_gib": _num(e.get("peak_allocated_gib")), "torch": doc.get("torch"),
        }
        key = (doc["model"], kind, gpus, str(e["length"]), e.get("tokens"), setting)
        rows.append(Row("trainer", key, str(doc.get("date", "")), values, command))
    return rows


def read_train_arms(doc: Doc) -> list[Row]:
    """``train_arms.py``: every arm at every length, its median over the interleaved rounds."""
    if not (isinstance(doc.get("lengths"), dict) and isinstance(doc.get("arms"), list) and doc.get("model")):
        return []
    command = str(doc.get("command", ""))
    kind = gpu_kind(doc.get("device"))
    rows = []
    for length, at in sorted(doc["lengths"].items(), key=lambda kv: int(kv[0])):
        for arm in doc["arms"]:
            res = (at.get("arms") or {}).get(arm.get("name"))
            if not isinstance(res, dict):
                continue
            entry = {"compiled_layers": arm.get("compiled"), "logit_chunk_elements": arm.get("chunk"),
                     "gradient_checkpointing": doc.get("gradient_checkpointing"), "budget": doc.get("budget")}
            setting = _train_setting(entry, command) + f"; {res.get('rounds')} interleaved rounds"
            values = {
                "model": doc["model"], "gpus": 1, "kind": kind, "length": int(length), "tokens": at.get("tokens"),
                "setting": setting, "step_s": _num(res.get("median_s")), "tps_gpu": _num(res.get("tokens_per_s_per_gpu")),
                "mfu": _num(res.get("mfu")), "peak_gib": _num(res.get("peak_allocated_gib")), "torch": doc.get("torch"),
            }
            key = (doc["model"], kind, 1, str(length), at.get("tokens"), setting.split(";")[0])
            rows.append(Row("trainer", key, str(doc.get("date", "")), values, command))
    return rows


AGAINST = {
    "overhead": ("bare", "bare `vllm.LLM`, the runtime's settings"),
    "vs_vllm_defaults": ("bare_default", "`vllm.LLM`, vLLM's defaults"),
}


def read_rollout(doc: Doc) -> list[Row]:
    """``rollout_overhead.py``: the runtime's rollout against each bare engine it ran beside, paired over the
    interleaved rounds (older files: the medians' ratio, no interval)."""
    tps = doc.get("median_tokens_per_second")
    if not (isinstance(tps, dict) and isinstance(doc.get("batch"), dict) and isinstance(doc.get("model"), dict)):
        return []
    m = re.search(r"--model[ =](\S+)", str(doc.get("command", "")))
    model = m.group(1) if m else _model_shape(doc["model"])
    kind = gpu_kind(doc.get("device_kind"))
    eager = (doc.get("engine_kwargs") or {}).get("enforce_eager")
    engine = None if eager is None else "eager" if eager else "CUDA graphs"
    engine_spec = (doc.get("spec") or {}).get("rollout") or {} if isinstance(doc.get("spec"), dict) else {}
    gpus = None if kind == "CPU" else int(engine_spec.get("engines", 1)) * int(engine_spec.get("tensorParallelSize", 1))
    paired = doc.get("paired") if isinstance(doc.get("paired"), dict) else {}
    rows = []
    for name, (way, label) in AGAINST.items():
        p = paired.get(name)
        if isinstance(p, dict):
            overhead, low, high, rounds = p.get("mean"), p.get("low"), p.get("high"), p.get("rounds")
        elif name == "overhead" and _num(doc.get("overhead")) is not None and way in tps:
            overhead, low, high = doc["overhead"], None, None
            rounds = len((doc.get("runs") or {}).get("runtime") or []) or None
        else:
            continue
        values = {
            "model": model, "gpus": gpus, "kind": kind, "layout": doc.get("layout"), "engine": engine,
            "against": label, "runtime_tps": _num(tps.get("runtime")), "against_tps": _num(tps.get(way)),
            "overhead": _num(overhead), "low": _num(low), "high": _num(high), "rounds": rounds,
            "vllm": vllm_version(doc),
        }
        values["tps_gpu"] = _per_gpu(values["runtime_tps"], gpus)
        key = (model, kind, doc.get("layout"), engine, label)
        rows.append(Row("rollout", key, str(doc.get("date", "")), values, str(doc.get("command", ""))))
    return rows


def _model_shape(model: Doc) -> str:
    """A model named by its shape where the file has no name: its architecture, hidden size and layers."""
    config = model.get("config") if isinstance(model.get("config"), dict) else {}
    hidden = config.get("hidden_size", model.get("hidden"))
    layers = config.get("num_hidden_layers", model.get("layers"))
    return f"{model.get('architecture') or 'model'} (hidden {hidden}, {layers} layers)"


def _spec_layout(spec: Any) -> str | None:
    """A job spec's layout in words: placement, trainer GPUs, engines and their tensor parallel size."""
    if not isinstance(spec, dict) or "trainer" not in spec:
        return None
    t, r = spec.get("trainer") or {}, spec.get("rollout") or {}
    mode = (spec.get("placement") or {}).get("mode", "separate")
    trainer = int(t.get("replicas", 1)) * int(t.get("gpusPerReplica", 1))
    return f"{mode}: trainer {trainer} GPU, {r.get('engines', 1)} engine TP={r.get('tensorParallelSize', 1)}"


def _split(**parts: Any) -> str | None:
    text = ", ".join(f"{name} {v:.2f}" for name, v in parts.items() if _num(v) is not None)
    return text or None


def read_learning(doc: Doc) -> list[Row]:
    """``gpu_learning.py``: one row per run (side, variant, seed); the rows of one configuration and day combine
    into their medians."""
    if not (isinstance(doc.get("runs"), list) and doc.get("task") and isinstance(doc.get("args"), dict)):
        return []
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
            "step_s": _median([s.get("step_seconds") for s in run.get("steps") or [] if isinstance(s, dict)]),
            "outcome": evals[-1]["exact_match"] if evals else None,
            "outcome_step": evals[-1].get("step") if evals else None, "wall_s": _num(run.get("wall_seconds")),
            "vllm": vllm_version(doc),
        }
        key = ("learning", doc["task"], steps, kind, values["side"], vllm_version(doc))
        rows.append(Row("learning", key, str(doc.get("date", ""))[:10], values, str(doc.get("command", "")),
                        merge=True))
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
        values = {
            "work": f"GRPO, {work.get('samples_per_step')} samples x {work.get('max_tokens')} tokens a step",
            "model": model, "kind": kind, "side": label, "step_s": _num(res.get("median_step_s")),
            "samples_s": _num(res.get("samples_per_s")), "gpus": None if kind == "CPU" else 1,
        }
        key = ("peer", model, kind, label, work.get("samples_per_step"), work.get("max_tokens"))
        rows.append(Row("learning", key, str(doc.get("date", "")), values, str(doc.get("command", ""))))
    return rows


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
        "step_s": _num(med["step_seconds"]),
        "split": _split(rollout=med.get("rollout_seconds"), train=med.get("train_seconds")),
        "sync_ms": (_num(med.get("weight_sync_seconds")) or 0) * 1e3 or None,
        "rollout_tps": _num(med.get("rollout_tokens_per_second")),
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
        "side": "runtime", "step_s": _num(med.get("stepSeconds")),
        "split": _split(rollout=med.get("rolloutSeconds"), train=med.get("trainSeconds"),
                        reward=med.get("rewardSeconds"), reference=med.get("referenceSeconds"),
                        critic=med.get("criticSeconds")),
        "sync_ms": (_num(med.get("weightSyncSeconds")) or 0) * 1e3 or None,
        "rollout_tps": _num(med.get("rolloutTokensPerSecond")),
    }
    values["tps_gpu"] = _per_gpu(values["rollout_tps"], gpus)
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
        "step_s": _num(summary.get("median_step_s")),
        "split": _split(rollout=_median([s.get("rollout_s") for s in later]), train=summary.get("median_train_s")),
        "sync_ms": _num(summary.get("median_sync_ms")), "rollout_tps": _num(summary.get("median_tokens_per_second")),
        "mfu": _num((report.get("throughput") or {}).get("mfu")), "vllm": vllm_version(doc),
        "outcome_text": f"{summary.get('steps_completed')} steps, validated: {summary.get('validated')}",
    }
    values["tps_gpu"] = _per_gpu(values["rollout_tps"], gpus)
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
    later = [s for s in steps if (_num(s.get("step")) or 0) >= 2]
    used = later or steps
    plan = run.get("memory_plan") if isinstance(run.get("memory_plan"), dict) else {}
    prompts = re.search(r"--prompts[ =](\d+)", str(doc.get("command", "")))

    def med(key: str) -> float | None:
        return _median([s.get(key) for s in used])

    moved = f" ({'on' if plan['offload'] else 'off'})" if "offload" in plan else ""
    sync_s = med("weight_sync_seconds")
    which = f"medians of steps {used[0].get('step')}-{used[-1].get('step')}" if later else "step 1 only (start-up in it)"
    kv = (f"; plan: KV cache {plan.get('kv_cache_gib')} GiB, {plan.get('sequences_at_once')} of "
          f"{plan.get('batch_sequences')} sequences at once") if plan else ""
    values = {
        "work": f"GRPO, length reward, {prompts.group(1) if prompts else 16} prompts x 8 x {max_tokens} tokens",
        "model": model, "gpus": None if kind == "CPU" else 1, "kind": kind, "side": "runtime",
        "layout": (f"colocated, gpuMemoryUtilization {util}, offloadDuringRollout {offload}{moved}, "
                   f"{'CUDA graphs' if 'graphs' in flags else 'eager'} engine, "
                   f"{'compiled' if 'compile' in flags else 'eager'} trainer"),
        "step_s": med("step_seconds"), "split": _split(rollout=med("rollout_seconds"), train=med("train_seconds")),
        "sync_ms": sync_s * 1e3 if sync_s is not None else None, "rollout_tps": med("rollout_tokens_per_second"),
        "mfu": med("mfu"), "vllm": (doc.get("device") or {}).get("vllm"),
        "outcome_text": f"{len(steps)} step(s), exit {run.get('exit_code')}; {which}{kv}",
    }
    values["tps_gpu"] = _per_gpu(values["rollout_tps"], values["gpus"])
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


def _p(stats: Any, q: str) -> float | None:
    return _num(stats.get(q)) if isinstance(stats, dict) else None


def read_operator_scale(doc: Doc) -> list[Row]:
    """``operator_scale.py``: N jobs on the local control plane beside KubeRay's own RayJob path."""
    create, peer = doc.get("create"), doc.get("peer")
    if not (isinstance(doc.get("jobs"), int) and isinstance(create, dict)):
        return []
    peer = peer if isinstance(peer, dict) else {}
    ratio = doc.get("ratio") if isinstance(doc.get("ratio"), dict) else {}
    to_rayjob = create.get("create_to_rayjob_added_s")
    values = {
        "jobs": doc["jobs"], "nodes": doc.get("nodes"), "create_p50": _p(to_rayjob, "p50"),
        "create_p99": _p(to_rayjob, "p99"), "peer_p50": _p(peer.get("rayjob_added_to_raycluster_added_s"), "p50"),
        "ratio_p50": _num(ratio.get("p50")), "ratio_p99": _num(ratio.get("p99")),
        "converged_s": _num(create.get("converged_s")),
        "requests_job": _num((create.get("operator_requests") or {}).get("requests_per_job")),
        "rss_mib": _num((create.get("operator_at_end") or {}).get("rss_mib")),
        "failures": len(doc.get("failures") or []), "commit": (doc.get("operator") or {}).get("commit"),
    }
    return [Row("operator", ("scale", doc["jobs"]), str(doc.get("date", "")), values, str(doc.get("command", "")))]


def read_sandbox_claims(doc: Doc) -> list[Row]:
    """``sandbox_claims.py``: claims from a warm pool, a held sandbox's round trip, jobs deleted and what was left."""
    claim = doc.get("claim")
    if doc.get("benchmark") != "sandbox_claims" or not isinstance(claim, dict):
        return []
    trip = doc.get("round_trip") if isinstance(doc.get("round_trip"), dict) else {}
    churn = doc.get("churn") if isinstance(doc.get("churn"), dict) else {}
    load = (doc.get("load_average") or {}).get("start") if isinstance(doc.get("load_average"), dict) else None

    def round_trip_ms(builtin: str) -> float | None:
        p50 = _p((trip.get(builtin) or {}).get("round_trip"), "p50")
        return p50 * 1000 if p50 is not None else None

    values = {
        "claims": _num(claim.get("claims")), "warm": _num(claim.get("adopted_warm")),
        "claim_p50": _num(claim.get("claim_p50_s")), "claim_p99": _num(claim.get("claim_p99_s")),
        "rt_python_ms": round_trip_ms("python"), "rt_shell_ms": round_trip_ms("shell"),
        "overhead_python_ms": _num((trip.get("python") or {}).get("overhead_p50_ms")),
        "overhead_shell_ms": _num((trip.get("shell") or {}).get("overhead_p50_ms")),
        "jobs": _num(churn.get("jobs")), "deadline_s": _num(churn.get("deadline_s")),
        "left": _num(churn.get("sandboxes_left")), "gone_s": _num(churn.get("all_gone_s")),
        "load": _num(load[0]) if isinstance(load, list) and load else None,
        "commit": str(doc.get("commit") or "")[:7] or None,
    }
    return [Row("sandbox", ("claims",), str(doc.get("date", "")), values, str(doc.get("command", "")))]


Reader = Callable[[Doc], list[Row]]
READERS: tuple[Reader, ...] = (
    read_sync, read_async, read_train_step, read_train_arms, read_rollout, read_learning, read_peer,
    read_cpu_runtime, read_ppo, read_rendered, read_colocated_memory, read_operator_scale, read_sandbox_claims,
)
