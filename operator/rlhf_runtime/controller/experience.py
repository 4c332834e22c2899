"""Experience: a step's rollout, its rewards and the per-token passes of the roles beside the policy.

* ``launch`` / ``collect``: generation for a batch of prompts spread round-robin over the engines (DP); every
  rank of an expert-parallel DP group must step, so an idle rank gets a one-token placeholder request. An
  engine that dies mid-rollout (sync mode, independent engines) is handed to ``on_engines_lost`` (the
  controller's recovery: replaced on its bundle, resynced) and only its part of the rollout runs again.
* ``samples``: the rollout's samples flattened to what the trainer trains on (prompt and completion token ids,
  the completion text for the rewards), the tokens generated, and in async mode how many tokens of each
  sample came before the weight swap.
* ``score``: the combined reward (``spec.reward``: rule or hook, reward-model scorers spread over their actors,
  endpoint), weighted, not yet normalised.
* ``launch_token_inputs`` / ``token_inputs``: what the advantages need beyond the scores, started before the
  rewards are computed so that it runs meanwhile: the policy's per-token log-probabilities (trainer ranks),
  the reference's (its actors, or the trainer's own) and the critic's values; then ``advantages.plan``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from rlhf_api.models import RLHFJobSpec
from rlhf_runtime.algo import advantages as adv_plan
from rlhf_runtime.algo.data import render_prompt
from rlhf_runtime.algo.rewards import combine, endpoint_rewards
from rlhf_runtime.controller.actors import merge
from rlhf_runtime.controller.deadlines import DeadlineExceeded, actor_died
from rlhf_runtime.controller.job_actors import JobActors
from rlhf_runtime.controller.recovery import is_dead
from rlhf_runtime.infra.placement import spread


@dataclass
class Rollout:
    """A launched rollout: per engine index its generate ref and its prompts (indices into ``prompt_ids``)."""

    step: int
    refs: dict[int, Any]
    parts: dict[int, list[int]]
    prompt_ids: list[list[int]]
    batch: list[Any]
    sampling: dict[str, Any]
    t_launch: float


@dataclass
class Samples:
    """A collected rollout flattened: one entry per sample (``samplesPerPrompt`` per prompt)."""

    items: list[tuple[Any, str]] = field(default_factory=list)  # (prompt sample, completion text)
    prompts: list[list[int]] = field(default_factory=list)
    completions: list[list[int]] = field(default_factory=list)
    #: the engines' log-probability of each completion token (``rollout.api.Engine.generate``), when every
    #: sample has them
    logprobs: list[list[float]] | None = field(default_factory=list)
    tokens: int = 0
    swap: dict[str, int] = field(default_factory=lambda: {"mixed_samples": 0, "tokens_before_swap": 0,
                                                          "tokens_after_swap": 0})
    #: multi-turn trajectories (``agent_experience``): per completion token 1 if the engine sampled it, 0 for
    #: tool and environment tokens; the environment's reward (None where it gave none); trajectories whose
    #: reward a fault zeroed (``environment.onError: zeroReward``)
    loss_masks: list[list[int]] | None = None
    env_rewards: list[float | None] | None = None
    zeroed: list[bool] | None = None

    def seqs(self) -> dict[str, Any]:
        out: dict[str, Any] = {"prompts": self.prompts, "completions": self.completions}
        if self.loss_masks is not None:
            out["loss_masks"] = self.loss_masks
        return out

    def lengths(self) -> list[int]:
        return [len(c) for c in self.completions]


def samples(ro: Rollout, outs: list[dict[str, Any]], tokenizer: Any, n: int) -> Samples:
    """Every sample of a collected rollout (``outs``: one engine result per prompt)."""
    out = Samples()
    for s, pids, o in zip(ro.batch, ro.prompt_ids, outs):
        lps = o.get("logprobs") or [None] * len(o["samples"])
        for k, comp in enumerate(o["samples"]):
            out.items.append((s, tokenizer.decode(comp, skip_special_tokens=True)))
            out.prompts.append(pids)
            out.completions.append(comp)
            if out.logprobs is not None and lps[k] is not None and len(lps[k]) == len(comp):
                out.logprobs.append(lps[k])
            else:
                out.logprobs = None
            out.tokens += len(comp)
            si = o.get("swap_index", [-1] * n)[k]
            if si >= 0:
                out.swap["tokens_before_swap"] += si
                out.swap["tokens_after_swap"] += len(comp) - si
                out.swap["mixed_samples"] += int(0 < si < len(comp))
    return out


class Experience:
    def __init__(self, spec: RLHFJobSpec, actors: JobActors,
                 on_engines_lost: Callable[[list[int], str, BaseException], None]) -> None:
        self.spec, self.actors, self.on_engines_lost = spec, actors, on_engines_lost
        self.engines = actors.engines
        self.repairable = spec.weight_sync.mode != "async" and not actors.layout.dp_group
        self.rerun_prompts = 0  # prompts of a rollout generated again after their engine died

    # ------------------------------------------------------------------------------------------ rollout
    def launch(self, tokenizer: Any, batch: list[Any], sampling: dict[str, Any], step: int) -> Rollout:
        """Start generation for ``batch`` on the engines (round-robin DP); ``collect`` waits for it."""
        prompt_ids = [render_prompt(s, tokenizer) for s in batch]
        parts = dict(enumerate(spread(prompt_ids, len(self.engines))))
        refs: dict[int, Any] = {}
        for i, idx in parts.items():
            if idx:
                refs[i] = self.engines[i].generate.remote([prompt_ids[k] for k in idx], sampling)
            elif self.actors.layout.dp_group:  # every rank of a DP group must step: a 1-token placeholder
                refs[i] = self.engines[i].generate.remote([prompt_ids[0]], {**sampling, "n": 1, "max_tokens": 1})
        return Rollout(step, refs, {i: idx for i, idx in parts.items() if idx}, prompt_ids, batch, sampling,
                       time.perf_counter())

    def collect(self, ro: Rollout) -> list[dict[str, Any]]:
        """Every prompt's result of ``ro``; the part of an engine that died is generated again."""
        outs: list[Any] = [None] * len(ro.prompt_ids)
        todo = dict(ro.refs)
        while todo:
            lost, errors = self._gather(ro, todo, outs)
            todo = {}
            if lost:
                self.on_engines_lost(lost, f"rollout of step {ro.step + 1}", errors[lost[0]])
                for i in lost:
                    todo[i] = self.engines[i].generate.remote([ro.prompt_ids[k] for k in ro.parts[i]], ro.sampling)
                    self.rerun_prompts += len(ro.parts[i])
        return outs

    def _gather(self, ro: Rollout, todo: dict[int, Any], outs: list[Any]) -> tuple[list[int], dict[int, Any]]:
        """Results of ``todo`` into ``outs``; returns the engines that died (when they can be replaced)."""
        lost: list[int] = []
        errors: dict[int, BaseException] = {}
        for i, ref in todo.items():
            try:
                res = self.engines.deadlines.get_step(ref, f"rollout of step {ro.step + 1}: engine {i}")
            except DeadlineExceeded:
                raise
            except Exception as e:
                if not (self.repairable and actor_died(e) and is_dead(self.engines[i], "pid")):
                    raise
                lost.append(i)
                errors[i] = e
                continue
            for r, k in zip(res, ro.parts.get(i, [])):
                outs[k] = r
        return lost, errors

    # ------------------------------------------------------------------------------------------ rewards
    def score(self, items: list[tuple[Any, str]], lengths: list[int], reward_fn: Any, step: int,
              batch: Samples | None = None) -> list[float]:
        """The combined reward of each (sample, completion text); not yet normalised. With multi-turn
        ``batch``: the environment's reward is one more part (``environment.rewardWeight``; 0 where it gave
        none), and a zeroed trajectory scores 0."""
        rw = self.spec.reward
        prompts, texts = [s.prompt for s, _ in items], [t for _, t in items]
        scorers = self.actors.role("reward")
        refs = [a.score.remote(prompts[r::len(scorers)], texts[r::len(scorers)]) for r, a in enumerate(scorers)]
        parts: dict[str, list[float]] = {}
        weights: dict[str, float] = {}
        if batch is not None and batch.env_rewards is not None and self.spec.environment is not None:
            parts["environment"] = [r or 0.0 for r in batch.env_rewards]
            weights["environment"] = self.spec.environment.reward_weight
        if reward_fn is not None:
            parts["rule"] = [float(reward_fn(s.prompt, t, s.answer, n, index=i, step=step))
                             for i, ((s, t), n) in enumerate(zip(items, lengths))]
            weights["rule"] = rw.rule_weight
        if rw.endpoint is not None:
            parts["endpoint"] = endpoint_rewards(rw.endpoint, prompts, texts, [s.answer for s, _ in items])
            weights["endpoint"] = rw.endpoint.weight
        if refs:
            parts["model"] = merge(scorers.deadlines.get(refs, f"reward model scoring of step {step}"))
            weights["model"] = rw.model.weight if rw.model else 1.0
        out = combine(parts, weights)
        if batch is not None and batch.zeroed is not None:
            out = [0.0 if z else r for r, z in zip(out, batch.zeroed)]
        return out

    # ------------------------------------------------------------------------------------- token inputs
    def launch_token_inputs(self, seqs: dict[str, Any]) -> dict[str, Any] | None:
        """Start the per-token passes the advantages need (None when nothing is needed)."""
        reference = self.actors.role("reference")
        external_ref = bool(len(reference)) and self.spec.reference_active()
        if not adv_plan.needs_token_inputs(self.spec.algorithm) and not external_ref:
            return None
        return {"trainer": self.actors.trainers.submit_shards("logprobs", seqs),
                "reference": reference.submit_shards("logprobs", seqs),
                "critic": self.actors.role("critic").submit_shards("values", seqs),
                "external_ref": external_ref}

    def token_inputs(self, pending: dict[str, Any] | None, seqs: dict[str, Any], scores: list[float],
                     n: int) -> tuple[dict[str, Any], dict[str, float]]:
        """The trainer's advantages (``advantages.plan``) from the scores and what ``launch_token_inputs``
        started: the plan (plus ``old_logprobs``/``ref_logprobs``/``values`` to hand on) and per-role seconds."""
        a, get = self.spec.algorithm, self.actors.deadlines.get_step
        lengths = [len(c) for c in seqs["completions"]]
        role_s: dict[str, float] = {}
        if pending is None:
            return adv_plan.plan(a, scores, n, lengths), role_s
        outs = get(pending["trainer"], f"log-probabilities of the policy: {self.actors.trainers.describe()}")
        logp, ref, values = merge([o["logp"] for o in outs], seqs), None, None
        if outs[0]["ref"] is not None:  # the reference inside the trainer: its pass is part of the trainer's
            ref = merge([o["ref"] for o in outs], seqs)
            role_s["reference_seconds"] = max(o["seconds"] for o in outs)
        if pending["reference"]:
            got = get(pending["reference"], f"reference log-probabilities ({len(pending['reference'])} actor(s))")
            ref = merge([g["logp"] for g in got], seqs)
            role_s["reference_seconds"] = max(g["seconds"] for g in got)
        if pending["critic"]:
            got = get(pending["critic"], f"critic values ({len(pending['critic'])} worker(s))")
            values = merge([g["values"] for g in got], seqs)
            role_s["critic_seconds"] = max(g["seconds"] for g in got)
        plan = adv_plan.plan(a, scores, n, lengths, logp=logp, ref=ref, values=values)
        plan.update(old_logprobs=logp, ref_logprobs=ref if pending["external_ref"] else None, values=values)
        return plan, role_s
