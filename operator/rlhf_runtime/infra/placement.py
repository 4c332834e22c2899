"""Pure placement: an RLHFJob spec -> the Ray placement groups and actor options that run it.

Nothing here imports Ray: the driver turns a ``Layout`` into placement groups and actor options. Same spec,
same layout (unit-tested).

Bundles ask for the Ray custom resource of the worker group meant to host them (``rlhf_trainer``,
``rlhf_rollout``, ``rlhf_colocated``, ``rlhf_<role>``; ``rlhf_api.groups``: each worker advertises one unit per GPU,
or one per pod when it has no GPU), so a bundle can only land on its own group's pods, and for its GPU. They
ask for no Ray CPUs, and actors take ``num_cpus=0``: KubeRay derives a pod's Ray ``num-cpus`` from its container's
CPU request (rounded up, e.g. 250m -> 1), which need not cover one CPU per bundle (colocated bundles hosted two
actors, a pod with 8 GPUs and ``cpu: 4`` would never have placed its 8 bundles). The custom resource alone says
where and how many; a pod's CPU request only sizes its container. (Ray still gives such an actor
``OMP_NUM_THREADS=1``, as it did for ``num_cpus=1``: on a CPU-only job every actor's ``threads`` says how many
the driver gives it instead, ``cpu_threads`` of its pod's CPU request (``with_threads``); with GPUs the GPU
computes and ``threads`` stays 0, Ray's default.)

* ``separate``: one placement group ``trainer`` (one bundle per trainer GPU, ``PACK``) and one per engine
  (``tensorParallelSize`` bundles, ``STRICT_PACK``: a TP group shares a node). TP=1 engines run vLLM
  in-process in their actor (``uni`` executor) holding the bundle's GPU; TP>1 engines use the ``ray``
  executor, whose workers take bundles ``VLLM_RAY_BUNDLE_INDICES`` while the engine actor holds none.
* ``colocated``: one placement group per engine; trainer worker ``w`` shares engine ``w // TP``'s bundle
  ``w % TP`` (one GPU) with that engine's shard, each with a fractional GPU share.
* CPU (``trainer.gpusPerReplica == 0``): the same shapes without GPUs, one bundle per pod.
* roles with a model of their own (``Layout.roles``, ``rlhf_api.groups.active_roles``: ``reward`` when
  ``spec.reward.model`` is set, ``critic`` for PPO, ``reference`` when ``algorithm.klCoef > 0`` and
  ``spec.reference.placement`` is not ``trainer``), in either mode:

  - ``placement: separate``: a placement group named after the role, after the trainer and engine groups (in
    the order reward, critic, reference), ``PACK``, on the role's worker group (custom resource
    ``rlhf_<role>``): one bundle ``{"rlhf_<role>": 1, "GPU": 1}`` per GPU (``replicas x gpusPerReplica``), or
    one ``{"rlhf_<role>": 1}`` per pod when the role has no GPUs (a CPU job); one actor per bundle with
    ``num_gpus`` 1 (0 without GPUs).
  - ``placement: colocated``: one actor beside each trainer worker, on that worker's bundle, sharing its GPU:
    the trainer's share (1 in ``separate`` mode, ``COLOCATED_TRAINER_SHARE`` in ``colocated`` mode) is split
    evenly between the trainer worker and its ``k`` colocated role actors, ``share / (1 + k)`` each, rounded
    down to Ray's 4 decimals so that they never add up to more than the share (0 on a CPU job). Without
    colocated roles the trainer keeps its whole share (the layouts are those of a job without roles).

  The driver places ``layout.roles[role][i]`` like a trainer: ``group`` indexes ``Layout.groups``, ``bundle``
  that group's bundles.
* ``rollout.expertParallel``: the same shapes; ``Layout.dp_group`` tells the driver that the engines form one
  vLLM data-parallel group (``VLLM_DP_RANK`` / ``VLLM_DP_SIZE`` / ``VLLM_DP_MASTER_*`` per engine, set by the
  driver once it knows engine 0's node) whose ranks step together.

GPU shares are Ray scheduling tokens (memory is set by ``gpuMemoryUtilization``). They never add up to a
whole GPU per bundle: ``VALIDATION_SHARE`` stays free so that ``--validate`` can start a fresh engine of the
same shape (TP>1: its Ray workers) on the same GPUs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from decimal import ROUND_DOWN, Decimal
from typing import Any

from rlhf_api.groups import COLOCATED, ROLLOUT, TRAINER, active_roles, resource
from rlhf_api.models import RLHFJobSpec

#: Fractional GPU shares (Ray scheduling tokens; memory is set by gpuMemoryUtilization). Each bundle keeps
#: VALIDATION_SHARE free for the fresh engine (or its TP workers) of the validation mode.
VALIDATION_SHARE = 0.1
COLOCATED_TRAINER_SHARE = 0.45
COLOCATED_ENGINE_SHARE = 0.45
SEPARATE_TP_WORKER_SHARE = 0.9


@dataclass(frozen=True)
class PlacementGroupSpec:
    name: str
    bundles: list[dict[str, float]]
    strategy: str


@dataclass(frozen=True)
class ActorPlacement:
    """Where one actor goes: bundle ``bundle`` of placement group ``group`` with these resources."""

    group: int
    bundle: int
    num_cpus: float
    num_gpus: float
    env: dict[str, str] = field(default_factory=dict)
    #: CPU-only jobs: the compute threads (``OMP_NUM_THREADS``) the actor's pod has for it; 0: Ray's default
    threads: int = 0


@dataclass(frozen=True)
class EnginePlacement(ActorPlacement):
    executor: str = "uni"


@dataclass(frozen=True)
class Layout:
    groups: list[PlacementGroupSpec]
    trainers: list[ActorPlacement]
    engines: list[EnginePlacement]
    gpu: bool
    dp_group: bool = False  # engines form one vLLM data-parallel (expert-parallel) group
    #: The active roles ("reward", "critic", "reference"; see the module docstring) -> their actors, one per
    #: bundle of the role's own group (separate) or one per trainer worker, on its bundle (colocated).
    roles: dict[str, list[ActorPlacement]] = field(default_factory=dict)

    def totals(self) -> dict[str, float]:
        """Resources of all bundles together (what a local Ray must offer)."""
        out: dict[str, float] = {}
        for g in self.groups:
            for b in g.bundles:
                for k, v in b.items():
                    out[k] = out.get(k, 0) + v
        return out


class PlacementError(ValueError):
    """The spec cannot be laid out (e.g. FSDP2 or TP>1 without GPUs)."""


def _bundle(group: str, gpu: bool) -> dict[str, float]:
    b: dict[str, float] = {resource(group): 1}
    if gpu:
        b["GPU"] = 1
    return b


def split_share(share: float, ways: int) -> float:
    """``share / ways`` rounded down to 4 decimals (Ray's resource granularity): ``ways`` of them never add up
    to more than ``share``."""
    return float((Decimal(str(share)) / ways).quantize(Decimal("0.0001"), rounding=ROUND_DOWN))


def _with_roles(spec: RLHFJobSpec, layout: Layout, trainer_share: float) -> Layout:
    """``layout`` plus the active roles: a group of its own for each separate role, an actor on each trainer
    worker's bundle for each colocated one (the trainer's ``trainer_share`` split evenly with them)."""
    roles = active_roles(spec)
    if not roles:
        return layout
    gpu = layout.gpu
    colocated = [name for name, r in roles.items() if r.placement == "colocated"]
    trainers = layout.trainers
    share = 0.0
    if colocated:
        share = split_share(trainer_share, 1 + len(colocated)) if gpu else 0
        trainers = [replace(t, num_gpus=share) for t in trainers]
    groups = list(layout.groups)
    placed: dict[str, list[ActorPlacement]] = {}
    for name, role in roles.items():
        if role.placement == "colocated":
            placed[name] = [ActorPlacement(t.group, t.bundle, 0, share) for t in trainers]
            continue
        role_gpus = spec.role_gpus(role)
        n = role.replicas * role_gpus if role_gpus else role.replicas
        groups.append(PlacementGroupSpec(name, [_bundle(name, role_gpus > 0) for _ in range(n)], "PACK"))
        placed[name] = [ActorPlacement(len(groups) - 1, b, 0, 1 if role_gpus else 0) for b in range(n)]
    return replace(layout, groups=groups, trainers=trainers, roles=placed)


def compute_layout(spec: RLHFJobSpec) -> Layout:
    """The placement groups and actors of ``spec`` (module docstring), with CPU-only jobs' ``threads``."""
    return with_threads(spec, _groups_and_actors(spec))


def _groups_and_actors(spec: RLHFJobSpec) -> Layout:
    t, r = spec.trainer, spec.rollout
    gpu = t.gpus_per_replica > 0
    tp = r.tensor_parallel_size
    if not gpu:
        # CPU: one trainer rank per trainer pod (FSDP2 over gloo when there are several)
        if spec.placement.mode == "colocated" and t.replicas != 1:
            raise PlacementError("colocated CPU jobs train in one process: use trainer.replicas 1")
        if tp != 1:
            raise PlacementError("CPU jobs need rollout.tensorParallelSize 1")
    workers = t.replicas * t.gpus_per_replica if gpu else t.replicas
    dp_group = r.expert_parallel and r.engines > 1
    if r.expert_parallel and not gpu:
        raise PlacementError("rollout.expertParallel needs GPUs (vLLM's CPU backend has no expert-parallel all-gather)")
    bundle_indices = ",".join(str(i) for i in range(tp))

    if spec.placement.mode == "colocated":
        if gpu and workers != r.engines * tp:
            raise PlacementError("colocated needs trainer GPUs == engines x tensorParallelSize")
        if not gpu and r.engines != 1:
            raise PlacementError("colocated CPU jobs need exactly one engine")
        groups = [
            PlacementGroupSpec(f"engine-{e}", [_bundle(COLOCATED, gpu) for _ in range(tp)], "STRICT_PACK")
            for e in range(r.engines)
        ]
        trainers = [
            ActorPlacement(w // tp, w % tp, 0, COLOCATED_TRAINER_SHARE if gpu else 0) for w in range(workers)
        ]
        engines = []
        for e in range(r.engines):
            if tp == 1:
                engines.append(EnginePlacement(e, 0, 0, COLOCATED_ENGINE_SHARE if gpu else 0))
            else:
                env = {"VLLM_RAY_BUNDLE_INDICES": bundle_indices, "VLLM_RAY_PER_WORKER_GPUS": str(COLOCATED_ENGINE_SHARE)}
                engines.append(EnginePlacement(e, 0, 0, 0, env, executor="ray"))
        return _with_roles(spec, Layout(groups, trainers, engines, gpu, dp_group), COLOCATED_TRAINER_SHARE)

    groups = [PlacementGroupSpec("trainer", [_bundle(TRAINER, gpu) for _ in range(workers)], "PACK")]
    groups += [
        PlacementGroupSpec(f"engine-{e}", [_bundle(ROLLOUT, gpu) for _ in range(tp)], "STRICT_PACK")
        for e in range(r.engines)
    ]
    trainers = [ActorPlacement(0, w, 0, 1 if gpu else 0) for w in range(workers)]
    engines = []
    for e in range(r.engines):
        if tp == 1:
            engines.append(EnginePlacement(1 + e, 0, 0, 1 if gpu else 0))
        else:
            env = {"VLLM_RAY_BUNDLE_INDICES": bundle_indices, "VLLM_RAY_PER_WORKER_GPUS": str(SEPARATE_TP_WORKER_SHARE)}
            engines.append(EnginePlacement(1 + e, 0, 0, 0, env, executor="ray"))
    return _with_roles(spec, Layout(groups, trainers, engines, gpu, dp_group), 1)


def cpu_threads(quantity: str) -> int:
    """The CPUs of a Kubernetes CPU quantity (``Resources.cpu``: ``8``, ``1.5``, ``500m``), rounded up, at least 1."""
    q = quantity.strip()
    cpus = Decimal(q[:-1]) / 1000 if q.endswith("m") else Decimal(q)
    return max(1, math.ceil(cpus))


def with_threads(spec: RLHFJobSpec, layout: Layout) -> Layout:
    """A CPU-only job's ``layout`` with each actor's ``threads``: the CPU request of the pod it runs in (each CPU
    bundle is one pod: a trainer's is sized by ``trainer.resources``, an engine's by ``rollout.resources``, or by
    ``trainer.resources`` in colocated placement, where the two share the pod and take turns; a role beside the
    trainer shares the trainer's, a separate role has ``resources`` of its own). GPU jobs: unchanged."""
    if layout.gpu:
        return layout
    trainer = cpu_threads(spec.trainer.resources.cpu)
    engine = trainer if spec.placement.mode == "colocated" else cpu_threads(spec.rollout.resources.cpu)
    settings = active_roles(spec)
    roles = {name: [replace(a, threads=trainer if settings[name].placement == "colocated"
                            else cpu_threads(settings[name].resources.cpu)) for a in actors]
             for name, actors in layout.roles.items()}
    return replace(layout, trainers=[replace(t, threads=trainer) for t in layout.trainers],
                   engines=[replace(e, threads=engine) for e in layout.engines], roles=roles)


def local_thread_cap(layout: Layout, async_mode: bool, cpus: int) -> int:
    """A local run (``--local``: every actor on this machine): the most threads one actor gets, ``cpus`` split
    among the actors that compute at the same time (the engines generate together and the trainers train
    together, one after the other; in async mode both at once), so that they never ask for more than there is."""
    busy = len(layout.engines) + len(layout.trainers) if async_mode else max(len(layout.engines), len(layout.trainers))
    return max(1, cpus // max(1, busy))


def spread(items: list[Any], n: int) -> list[list[int]]:
    """Indices of ``items`` dealt round-robin over ``n`` engines (DP)."""
    out: list[list[int]] = [[] for _ in range(n)]
    for i in range(len(items)):
        out[i % n].append(i)
    return out
