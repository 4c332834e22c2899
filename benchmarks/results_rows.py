"""The rows of ``benchmarks/RESULTS.md``, read from one result file each.

Every reader takes one parsed JSON document and returns its rows: the area, the configuration a row stands for (the
newest row of each configuration is the one shown), when it ran, and the figures as numbers or strings. A figure a
file does not record is ``None`` (an empty cell); a reader returns no rows for a document of another format or a run
that ended before its figure. ``READERS`` is the list ``results_table.py`` tries on every file."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from results_common import Doc, Row, gpu_kind, layout_gpus, median_of, num, per_gpu, vllm_version
from results_loop import (
    read_colocated_memory,
    read_cpu_runtime,
    read_learning,
    read_peer,
    read_ppo,
    read_rendered,
    read_tool_learning,
)


def _floor_share(sent: float | None, seconds: float | None, floor: Any) -> tuple[str | None, float | None]:
    """The floor's kind and the sync's bandwidth over the floor's (bytes per second each, so a floor of other
    bytes still compares)."""
    if not isinstance(floor, dict):
        return None, None
    floor_s = num(floor.get("whole_s")) or num(floor.get("copy_s"))
    kind = "NCCL broadcast" if "whole_s" in floor else "device copy" if "copy_s" in floor else None
    floor_bytes = num(floor.get("bytes"))
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
    seconds = num(summary.get("median_total_s"))
    sent = num(summary.get("bytes"))
    floor_kind, share = _floor_share(sent, seconds, doc.get("floor"))
    rollout = doc.get("rollout") if isinstance(doc.get("rollout"), dict) else {}
    train = doc.get("train") if isinstance(doc.get("train"), dict) else {}
    validated = (doc.get("validation") or {}).get("validated") if isinstance(doc.get("validation"), dict) else None
    values = {
        "model": doc["model_name"], "gpus": gpus, "kind": kind, "layout": doc["layout"],
        "sender": _sender(summary, (doc.get("syncs") or {}).get("default")), "sync_ms": seconds and seconds * 1e3,
        "sent_gb": sent and sent / 1e9, "gbps": num(summary.get("gbps")), "floor": floor_kind, "share": share,
        "rollout_tps_gpu": per_gpu(rollout.get("tokens_per_second"), gpus), "train_s": num(train.get("seconds")),
        "validated": validated, "status": doc.get("status"), "vllm": vllm_version(doc),
    }
    return [Row("sync", (doc["model_name"], kind, gpus, doc["layout"]), str(doc.get("date", "")), values,
                str(doc.get("command", "")))]


def read_async(doc: Doc) -> list[Row]:
    """``gpu_async.py``: the median of the steps' syncs in async mode (pause, transfer, resume)."""
    if not (isinstance(doc.get("steps"), list) and doc.get("engine") and doc.get("layout") and doc.get("model_name")):
        return []
    syncs = [s.get("sync") for s in doc["steps"] if isinstance(s, dict) and isinstance(s.get("sync"), dict)]
    seconds = median_of([s.get("total_s") for s in syncs])
    if seconds is None:
        return []
    kind = gpu_kind(doc.get("device_kind"))
    layout = f"{doc['layout']} ({doc['engine']} engine)"
    values = {
        "model": doc["model_name"], "kind": kind, "layout": layout, "sender": syncs[0].get("format"),
        "sync_ms": seconds * 1e3, "sent_gb": (num(syncs[0].get("bytes")) or 0) / 1e9 or None,
        "gbps": median_of([s.get("gbps") for s in syncs]), "status": doc.get("status"),
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
            "setting": setting, "step_s": num(e.get("median_s")),
            "tps_gpu": num(e.get("tokens_per_s_per_gpu")) or per_gpu(e.get("tokens_per_s"), gpus),
            "mfu": num(e.get("mfu")), "peak_gib": num(e.get("peak_allocated_gib")), "torch": doc.get("torch"),
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
                "setting": setting, "step_s": num(res.get("median_s")), "tps_gpu": num(res.get("tokens_per_s_per_gpu")),
                "mfu": num(res.get("mfu")), "peak_gib": num(res.get("peak_allocated_gib")), "torch": doc.get("torch"),
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
        elif name == "overhead" and num(doc.get("overhead")) is not None and way in tps:
            overhead, low, high = doc["overhead"], None, None
            rounds = len((doc.get("runs") or {}).get("runtime") or []) or None
        else:
            continue
        values = {
            "model": model, "gpus": gpus, "kind": kind, "layout": doc.get("layout"), "engine": engine,
            "against": label, "runtime_tps": num(tps.get("runtime")), "against_tps": num(tps.get(way)),
            "overhead": num(overhead), "low": num(low), "high": num(high), "rounds": rounds,
            "vllm": vllm_version(doc),
        }
        values["tps_gpu"] = per_gpu(values["runtime_tps"], gpus)
        key = (model, kind, doc.get("layout"), engine, label)
        rows.append(Row("rollout", key, str(doc.get("date", "")), values, str(doc.get("command", ""))))
    return rows


def _model_shape(model: Doc) -> str:
    """A model named by its shape where the file has no name: its architecture, hidden size and layers."""
    config = model.get("config") if isinstance(model.get("config"), dict) else {}
    hidden = config.get("hidden_size", model.get("hidden"))
    layers = config.get("num_hidden_layers", model.get("layers"))
    return f"{model.get('architecture') or 'model'} (hidden {hidden}, {layers} layers)"


def _p(stats: Any, q: str) -> float | None:
    return num(stats.get(q)) if isinstance(stats, dict) else None


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
        "ratio_p50": num(ratio.get("p50")), "ratio_p99": num(ratio.get("p99")),
        "converged_s": num(create.get("converged_s")),
        "requests_job": num((create.get("operator_requests") or {}).get("requests_per_job")),
        "rss_mib": num((create.get("operator_at_end") or {}).get("rss_mib")),
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
        "claims": num(claim.get("claims")), "warm": num(claim.get("adopted_warm")),
        "claim_p50": num(claim.get("claim_p50_s")), "claim_p99": num(claim.get("claim_p99_s")),
        "rt_python_ms": round_trip_ms("python"), "rt_shell_ms": round_trip_ms("shell"),
        "overhead_python_ms": num((trip.get("python") or {}).get("overhead_p50_ms")),
        "overhead_shell_ms": num((trip.get("shell") or {}).get("overhead_p50_ms")),
        "jobs": num(churn.get("jobs")), "deadline_s": num(churn.get("deadline_s")),
        "left": num(churn.get("sandboxes_left")), "gone_s": num(churn.get("all_gone_s")),
        "load": num(load[0]) if isinstance(load, list) and load else None,
        "commit": str(doc.get("commit") or "")[:7] or None,
    }
    return [Row("sandbox", ("claims",), str(doc.get("date", "")), values, str(doc.get("command", "")))]


Reader = Callable[[Doc], list[Row]]
READERS: tuple[Reader, ...] = (
    read_sync, read_async, read_train_step, read_train_arms, read_rollout, read_learning, read_tool_learning,
    read_peer, read_cpu_runtime, read_ppo, read_rendered, read_colocated_memory, read_operator_scale,
    read_sandbox_claims,
)
