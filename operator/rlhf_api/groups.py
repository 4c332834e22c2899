"""The Ray worker groups of an RLHFJob: the one model of them that the operator and the runtime share.

The operator renders one KubeRay worker group per entry of ``worker_groups(spec)`` (``rlhf_operator.render``);
the runtime's placement groups ask for those groups' Ray custom resources (``rlhf_runtime.infra.placement``), so
that each bundle lands on a pod of the group meant to host it.

* ``placement.mode: separate``: group ``trainer`` (``trainer.replicas`` pods x ``gpusPerReplica``) and group
  ``rollout`` (``rollout.engines`` pods x ``tensorParallelSize``: one pod per engine keeps a TP group on one node;
  no GPU when the job is CPU-only, ``trainer.gpusPerReplica: 0``).
* ``placement.mode: colocated``: one group ``colocated`` (``trainer.replicas`` pods x ``gpusPerReplica``): the
  trainer workers and the engines share its GPUs.
* the roles that run a model of their own (``active_roles``: the reward model when ``reward.model`` is set, PPO's
  critic, the reference when ``algorithm.klCoef > 0`` and it does not run inside the trainer), in the order of
  ``ROLES``, in either mode: those with ``placement: separate`` (``separate_roles``) get a group each, named after
  the role (the role's ``replicas`` pods x ``gpusPerReplica``, no GPU when the job is CPU-only; the role's
  ``resources``); a colocated one shares the trainer workers' GPUs and has no group.

Each worker pod advertises the Ray custom resource ``resource(group)`` (``rlhf_<group>``), one unit per GPU (one
per pod without GPUs). Pure: it imports only the API models.
"""

from __future__ import annotations

from dataclasses import dataclass

from rlhf_api.models import RLHFJobSpec, RolePlacement

#: The groups of the two placement modes: ``separate`` has TRAINER and ROLLOUT, ``colocated`` has COLOCATED.
TRAINER = "trainer"
ROLLOUT = "rollout"
COLOCATED = "colocated"
#: The roles that may run a model of their own, in the order of their groups (and placement groups).
ROLES = ("reward", "critic", "reference")


@dataclass(frozen=True)
class WorkerGroup:
    """One Ray worker group: ``replicas`` pods of ``gpus`` GPUs each, with these CPU and memory requests."""

    name: str
    replicas: int
    gpus: int
    cpu: str
    memory: str


def resource(group: str) -> str:
    """The Ray custom resource the pods of ``group`` advertise and its bundles ask for: ``rlhf_<group>``."""
    return f"rlhf_{group}"


def active_roles(spec: RLHFJobSpec) -> dict[str, RolePlacement]:
    """The roles that run a model of their own (name -> settings, in ``ROLES`` order): the reward model when
    set, PPO's critic, the reference when the KL penalty is on and it does not run inside the trainer."""
    roles: dict[str, RolePlacement] = {}
    if spec.reward.model is not None:
        roles["reward"] = spec.reward.model
    critic = spec.critic_settings()
    if critic is not None:
        roles["critic"] = critic
    if spec.reference_active() and spec.reference.placement != "trainer":
        roles["reference"] = spec.reference
    return roles


def separate_roles(spec: RLHFJobSpec) -> dict[str, RolePlacement]:
    """The active roles with a worker group of their own (``placement: separate``), in ``ROLES`` order."""
    return {name: role for name, role in active_roles(spec).items() if role.placement == "separate"}


def worker_groups(spec: RLHFJobSpec) -> list[WorkerGroup]:
    """The Ray worker groups of ``spec``, in order: the trainer's and the engines' (one ``colocated`` group in
    colocated mode), then one per separate role."""
    t, r = spec.trainer, spec.rollout
    if spec.placement.mode == "colocated":
        groups = [WorkerGroup(COLOCATED, t.replicas, t.gpus_per_replica, t.resources.cpu, t.resources.memory)]
    else:
        engine_gpus = 0 if spec.cpu_only() else r.tensor_parallel_size  # CPU-only jobs: CPU engine pods too
        groups = [
            WorkerGroup(TRAINER, t.replicas, t.gpus_per_replica, t.resources.cpu, t.resources.memory),
            WorkerGroup(ROLLOUT, r.engines, engine_gpus, r.resources.cpu, r.resources.memory),
        ]
    for name, role in separate_roles(spec).items():
        groups.append(WorkerGroup(name, role.replicas, spec.role_gpus(role), role.resources.cpu, role.resources.memory))
    return groups


def total_gpus(spec: RLHFJobSpec) -> int:
    """GPUs of all the job's worker pods."""
    return sum(g.replicas * g.gpus for g in worker_groups(spec))
