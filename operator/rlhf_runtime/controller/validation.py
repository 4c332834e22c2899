"""Validation (``spec.weightSync.validate`` or the driver's ``--validate``): synced engines == fresh engines.

After the first sync, every engine's greedy output for the first prompts must equal, token for token, that of
a fresh engine of the same shape loaded from the trainer's weights; engines of an expert-parallel DP group are
compared rank by rank with a fresh DP group of the same size (independent engines all with the one fresh
engine). Otherwise the run fails with "weight-sync validation failed" (``ValidationError``). The weights reach
each fresh engine's node through Ray's object store (``infra.node_files``: pods share no filesystem), unless it is
the node where trainer rank 0 staged them, and every copy is removed afterwards, also when validation fails.
With ``path`` the fresh engines load that directory (the exported model, on a volume every pod mounts) instead.

A fresh engine takes no Ray GPU of its own: TP=1 runs on engine ``i``'s GPU (its actor gets engine ``i``'s
``CUDA_VISIBLE_DEVICES`` explicitly); TP>1 workers take the ``VALIDATION_SHARE`` every bundle keeps free.
Memory: what is still free on that GPU (vLLM refuses to start when free < gpu_memory_utilization x total).
"""

from __future__ import annotations

import logging
import math
from typing import Any

from rlhf_runtime.algo.data import render_prompt
from rlhf_runtime.controller.actors import DP_PORTS
from rlhf_runtime.controller.job_actors import JobActors
from rlhf_runtime.infra import config as rc
from rlhf_runtime.infra import node_files
from rlhf_runtime.rollout.api import engine_class
from rlhf_runtime.rollout.options import EngineOptions

log = logging.getLogger("rlhf_runtime")
VALIDATION_PROMPTS = 8


class ValidationError(RuntimeError):
    pass


def mismatches(synced: list[list[Any]], fresh: list[list[Any]], dp: bool) -> dict[int, list[int]]:
    """Per engine, the prompts whose greedy tokens differ from its fresh twin's (rank ``i``'s, or the one
    fresh engine's when the engines are independent)."""
    return {i: [k for k, (a, b) in enumerate(zip(synced[i], fresh[i if dp else 0])) if a != b]
            for i in range(len(synced))}


class Validator:
    def __init__(self, actors: JobActors, max_tokens: int, timeout_s: float, progress: Any) -> None:
        self.actors, self.max_tokens, self.timeout_s = actors, max_tokens, timeout_s
        self.progress = progress  # (record) -> None: the progress file

    def validate(self, tokenizer: Any, samples: list[Any], path: str | None = None) -> dict[str, Any]:
        """Every engine's greedy tokens for the first prompts == those of a fresh engine loaded from the
        trainer's weights (or from ``path``); raises ``ValidationError`` otherwise."""
        engines, layout = self.actors.engines, self.actors.layout
        prompts = [render_prompt(s, tokenizer) for s in samples[:VALIDATION_PROMPTS]]
        greedy = {"n": 1, "temperature": 0.0, "max_tokens": self.max_tokens}
        synced = [[o["samples"][0] for o in out] for out in engines.call(
            "generate", prompts, greedy, what=f"validation: greedy rollout on {engines.describe()}")]
        ranks = list(range(len(engines))) if layout.dp_group else [0]
        dp = self.actors.placement.address_on(layout.engines[0], DP_PORTS) if layout.dp_group else None
        copies = self._copy_weights(ranks) if path is None else [(None, path) for _ in ranks]
        try:
            fresh = self._fresh_outputs(ranks, copies, dp, prompts, greedy)
        finally:
            if path is None:
                self._remove_copies(copies)
        bad = {i: m for i, m in mismatches(synced, fresh, dp is not None).items() if m}
        what = "the exported model" if path else "a fresh engine"
        result = {"validated": not bad, "of": what, "prompts": len(prompts), "engines": len(engines),
                  "mismatched": mismatches(synced, fresh, dp is not None)[0], "mismatched_by_engine": bad,
                  "synced": synced[0], "fresh": fresh[0],
                  "weights": [w for _, w in copies]}  # node-local copies, removed by now
        self.progress({"export_validation" if path else "validation": result})
        if bad:
            i = next(iter(bad))
            k, f = bad[i][0], fresh[i if dp else 0]
            raise ValidationError(
                f"weight-sync validation failed: {len(bad[i])}/{len(prompts)} prompts of engine {i} differ from "
                f"{what} ({len(bad)}/{len(engines)} engines differ); first: prompt {k}: synced "
                f"{synced[i][k][:16]} vs fresh {f[k][:16]}")
        log.info("weight-sync validation passed: %d prompts token for token on %d engine(s) vs %s", len(prompts),
                 len(engines), what)
        return result

    def _fresh_outputs(self, ranks: list[int], copies: list[tuple[Any, str]], dp: tuple[str, int] | None,
                       prompts: list[list[int]], greedy: dict[str, Any]) -> list[list[Any]]:
        """The greedy tokens of a fresh engine per rank (killed afterwards)."""
        import ray

        fresh_actors: list[Any] = []
        try:
            for i, (_, where) in zip(ranks, copies):
                fresh_actors.append(self._fresh_engine(i, where, dp))
            outs = self.actors.deadlines.get(
                [a.generate.remote(prompts, greedy) for a in fresh_actors],
                f"validation: start and greedy rollout of {len(fresh_actors)} fresh engine(s)")
        finally:
            for a in fresh_actors:
                ray.kill(a)
        return [[o["samples"][0] for o in out] for out in outs]

    def _copy_weights(self, ranks: list[int]) -> list[tuple[Any, str]]:
        """The trainer's current weights as a directory on the node of engine ``i`` for each ``i`` in ``ranks``
        (where its fresh twin will run): staged by trainer rank 0 on its node (every FSDP rank takes part in
        the gather), and for an engine on another node moved there file by file through Ray's object store
        (``node_files``). Engines on the staging node (in the trainer's pod, or a one-node run) read the staged
        directory itself: no copy, whatever their number (a 30B model's DP=4 group: one 61 GB directory, not
        four copies beside it). Returns ``(scheduling strategy, path)`` per engine, the strategy None for the
        staged directory; the caller removes them (``_remove_copies``), the staging at once if nobody reads it."""
        trainers = self.actors.trainers
        source = trainers[0]
        copies: list[tuple[Any, str]] = []
        try:
            staged, names = trainers.call("stage_weights",
                                          what=f"validation: staging the weights on {trainers.describe()}")[0]
            home = node_files.node_of(self.actors.placement.strategy(self.actors.layout.trainers[0]), self.timeout_s)
            for i in ranks:
                strategy = self.actors.placement.strategy(self.actors.layout.engines[i])
                if node_files.node_of(strategy, self.timeout_s) == home:
                    copies.append((None, staged))
                else:
                    copies.append((strategy, node_files.copy_to(strategy, names, source.read_staged.remote,
                                                                self.timeout_s)))
        except BaseException:
            self._remove_copies(copies)  # the staging too, where a copy is it
            if all(strategy is not None for strategy, _ in copies):
                self._drop_staged()
            raise
        if all(strategy is not None for strategy, _ in copies):
            self._drop_staged()
        return copies

    def _drop_staged(self) -> None:
        trainers = self.actors.trainers
        try:
            trainers.deadlines.get(trainers[0].drop_staged.remote(), "validation: removing the staged weights")
        except Exception as e:  # noqa: BLE001 - do not hide the error that got us here
            log.warning("could not remove the trainer's staged weights: %s", e)

    def _remove_copies(self, copies: list[tuple[Any, str]]) -> None:
        """The copies removed, and the staged directory if one of them is it."""
        for strategy, path in copies:
            if strategy is None:
                continue
            try:
                node_files.remove(strategy, path)
            except Exception as e:  # noqa: BLE001 - keep removing the others; the pod's disk goes with the pod
                log.warning("could not remove validation weights %s: %s", path, e)
        if any(strategy is None for strategy, _ in copies):
            self._drop_staged()

    def _fresh_engine(self, i: int, path: str, dp: tuple[str, int] | None) -> Any:
        """A fresh engine shaped like engine ``i`` (rank ``i`` of a new DP group when ``dp``) that loads
        ``path`` (a directory on engine ``i``'s node)."""
        import ray

        from rlhf_runtime.infra.placement import VALIDATION_SHARE

        actors = self.actors
        kw = dict(actors.engine_kwargs[i], model=str(path), load_format="auto")
        for key in rc.LORA_ENGINE_KEYS:  # LoRA: a plain engine of the merged weights
            kw.pop(key, None)
        e = actors.layout.engines[i]
        env = actors.actor_env(e, actors.dp_env(i, dp) if dp else None)
        if actors.gpu:
            dev = actors.deadlines.get(actors.engines[i].device_info.remote(), f"device info of engine {i}")
            if e.executor == "ray":
                env["VLLM_RAY_PER_WORKER_GPUS"] = str(VALIDATION_SHARE)
            elif dev.get("cuda_visible_devices"):
                env["CUDA_VISIBLE_DEVICES"] = dev["cuda_visible_devices"]
            if dev.get("total"):
                share = math.floor(dev["free"] / dev["total"] * 90) / 100
                kw["gpu_memory_utilization"] = min(kw["gpu_memory_utilization"], share)
        return ray.remote(engine_class(async_mode=False)).options(
            num_cpus=0, num_gpus=0, scheduling_strategy=actors.placement.strategy(e),
            runtime_env={"env_vars": env}).remote(EngineOptions(kw, env))
