"""The weight-sync benchmark's variants (``gpu_sync.py``): sync options timed beside the job's own, each chosen
through the driver's own options (``sync_options``: the spec's ``weightSync`` fields, resolved as the driver
resolves its own) and applied by re-creating the weight-sync group (``configure``),
timed interleaved or one after another, each checked against the validated greedy tokens."""

from __future__ import annotations

import argparse
import time
import traceback
from collections.abc import Callable
from typing import Any

from sync_timing import greedy, summarize, timed_sync

#: Writes the result so far (``gpu_sync.save``).
Save = Callable[[dict[str, Any]], None]

#: Sync variants timed beside the default (the job's own options). Each names what it changes: fields of the spec's
#: ``weightSync`` (``SPEC_FIELDS``); the driver resolves them (``WeightSync.resolve``) and every switch of variant
#: re-creates the weight-sync group with them (``WeightSync.init_group``, as after an engine was replaced), its
#: first sync untimed. Variants run on CPU too
#: (the ``gloo`` ones).
VARIANTS: dict[str, list[tuple[str, dict[str, Any]]]] = {
    "nccl": [
        ("checkpoint-format", {"format": "checkpoint"}),
        # the runtime's kernel-format worker engines wherever the plan applies (a plan that does not fails)
        ("kernel-format-forced", {"format": "kernel"}),
        # vLLM's packed path, and the direct sync (weight_sync.direct), alternating turn by turn in one run
        ("packed-sync", {"packed": True}),
        ("direct-sync", {"packed": False}),
        # the direct sync in groups of 256 MiB instead of weightSync.bucketSizeMB's 1,024 (the engines cut the
        # groups from it too): the wire starts after a quarter of the first group's launches
        ("direct-256mb", {"packed": False, "bucket_size_mb": 256}),
    ],
    "ipc": [
        ("checkpoint-format", {"format": "checkpoint"}),
        ("kernel-format-forced", {"format": "kernel"}),
    ],
    # CPU (checkpoint format only): the gloo backend tensor by tensor
    "gloo": [
        ("unpacked", {"packed": False}),
    ],
}


#: The variant keys: fields of the spec's ``weightSync`` (its Python names).
SPEC_FIELDS = ("format", "packed", "bucket_size_mb")


def sender_arms(args: argparse.Namespace, backend: str, spec: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """The sync options compared: the default (the layout's own ``weightSync``) first, then the ``VARIANTS`` of the
    backend that ``--variants`` selects (all by default), each as full settings."""
    chosen = [(n, o) for n, o in VARIANTS.get(backend, []) if not args.variants or n in args.variants.split(",")]
    from rlhf_api.models import WeightSync

    own = WeightSync.model_validate(spec["weightSync"])
    default = {k: getattr(own, k) for k in SPEC_FIELDS}
    return [("default", default)] + [(n, {**default, **o}) for n, o in chosen]


def sync_options(rt: Any, arm: dict[str, Any]) -> Any:
    """The driver's sync options for ``arm`` (``SPEC_FIELDS`` over the job's ``weightSync``), resolved as the
    driver resolves its own (``WeightSync.resolve``)."""
    unknown = sorted(set(arm) - set(SPEC_FIELDS))
    if unknown:
        raise ValueError(f"sync options {unknown} are not weightSync fields: {', '.join(SPEC_FIELDS)}")
    return rt.weights.resolve(rt.cfg.spec.weight_sync.model_copy(update=arm))


def configure(rt: Any, arm: dict[str, Any]) -> dict[str, Any]:
    """Sync with ``arm`` from now on: where its options differ from the group's, the weight-sync group is
    re-created with them (``WeightSync.init_group``: every trainer rank's sender anew, every engine's group anew).
    Returns what trainer rank 0's sender uses and ``regrouped`` (a new group's first sync makes three engine
    calls, ``EngineFanOut``)."""
    options = sync_options(rt, arm)
    regrouped = options != rt.weights.options
    if regrouped:
        rt.weights.init_group(options)
    return {**rt.weights.in_use, "regrouped": regrouped}


def restores_weights(rt: Any, check: tuple[list[Any], int, list[list[int]]]) -> bool:
    """One sync into engines whose weights were scrambled, with the settings configured now: whether the greedy
    tokens after it equal the validated ones (``check``: prompts, max tokens, those tokens)."""
    import ray

    prompts, max_new, reference = check
    ray.get([e.scramble_weights.remote(1234) for e in rt.actors.engines])
    ray.get([e.load_stats.remote(True) for e in rt.actors.engines])
    timed_sync(rt)
    rt.weights.wake()
    return greedy(rt, prompts, max_new) == reference


def sequential_variants(rt: Any, variants: list[tuple[str, dict[str, Any]]], syncs: int,
                        check: tuple[list[Any], int, list[list[int]]], result: dict[str, Any], tag: str,
                        save: Save) -> None:
    """``--sequential``: each variant after the default's syncs,
    its ``syncs`` syncs one after another, the first into scrambled weights; then its greedy tokens checked."""
    import ray

    prompts, max_new, reference = check
    for name, options in variants:
        try:
            applied = configure(rt, options)
            ray.get([e.scramble_weights.remote(1234) for e in rt.actors.engines])
            ray.get([e.load_stats.remote(True) for e in rt.actors.engines])
            timed = [timed_sync(rt) for _ in range(syncs)]
            rt.weights.wake()
            result["syncs"][name] = timed
            result["summary"][name] = {**summarize(timed), "options": applied,
                                       "greedy_equals_validated": greedy(rt, prompts, max_new) == reference}
            print(f"[{tag}] {name} {result['summary'][name]}", flush=True)
            save(result)
        except Exception as e:  # noqa: BLE001 - a variant failing must not hide the others
            result["summary"][name] = {"error": f"{type(e).__name__}: {e}"[:2000]}
            print(f"[{tag}] {name} FAILED {traceback.format_exc()}", flush=True)
            break  # the engine may be mid-update: later variants would only hang


def interleaved_variants(rt: Any, arms: list[tuple[str, dict[str, Any]]], rounds: int,
                         check: tuple[list[Any], int, list[list[int]]], result: dict[str, Any], tag: str,
                         save: Save) -> None:
    """The default (already timed alone, ``syncs.default``) and the variants, interleaved: ``rounds`` rounds, each
    settings once per round in an order rotated by one each round; per turn configure it, one settling sync
    (untimed: a switch's first sync may build a plan) and one timed sync. Then per settings one sync into
    scrambled weights and the greedy check. Results: ``syncs_interleaved`` / ``summary_interleaved`` (per
    settings, ``rounds`` syncs), ``interleaved_order``; a failing turn ends the rounds (the engine may be
    mid-update), keeping what was timed."""
    timed: dict[str, list[dict[str, Any]]] = {n: [] for n, _ in arms}
    applied: dict[str, dict[str, Any]] = {}
    summary: dict[str, dict[str, Any]] = result.setdefault("summary_interleaved", {})
    result["interleaved_order"] = []
    try:
        for r in range(rounds):
            for name, options in arms[r % len(arms):] + arms[: r % len(arms)]:
                applied[name] = configure(rt, options)
                timed_sync(rt)  # settling
                timed[name].append(timed_sync(rt))
                result["interleaved_order"].append(name)
        for name, options in arms:
            configure(rt, options)
            summary[name] = {**summarize(timed[name]), "options": applied[name],
                             "greedy_equals_validated": restores_weights(rt, check)}
    except Exception as e:  # noqa: BLE001 - keep what was timed
        result["interleaved_error"] = f"{type(e).__name__}: {e}"[:2000]
        print(f"[{tag}] interleaved FAILED {traceback.format_exc()}", flush=True)
    result["syncs_interleaved"] = timed
    for name, v in summary.items():
        print(f"[{tag}] interleaved {name} {v}", flush=True)
    save(result)


def revalidate_fastest(rt: Any, arms: list[tuple[str, dict[str, Any]]], result: dict[str, Any], tag: str,
                       save: Save) -> None:
    """``--revalidate``: the fastest variant whose greedy tokens matched, synced into scrambled weights, under the
    driver's fresh-engine validation again."""
    import ray

    from rlhf_runtime.controller.validation import ValidationError

    pool = result.get("summary_interleaved") or result["summary"]
    fastest = min((n for n, v in pool.items() if v.get("greedy_equals_validated")),
                  key=lambda n: pool[n]["median_total_s"], default=None)
    options = dict(arms[1:]).get(fastest) if fastest else None  # full settings (sender_arms)
    if not options:
        return
    configure(rt, options)
    ray.get([e.scramble_weights.remote(99) for e in rt.actors.engines])
    sync = timed_sync(rt)
    t = time.perf_counter()
    try:
        v = rt.validator.validate(rt.job.tokenizer, rt.job.samples)
        check = {k: v[k] for k in ("validated", "prompts", "engines", "mismatched")}
    except ValidationError as e:
        check = {"validated": False, "error": str(e)}
    result["validation_fastest"] = {"variant": fastest, "options": options, "sync": sync, **check,
                                    "seconds": time.perf_counter() - t}
    print(f"[{tag}] validation of {fastest}: {check}", flush=True)
    save(result)
