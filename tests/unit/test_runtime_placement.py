"""Placement groups and actor options computed from a spec (pure, no Ray)."""

from __future__ import annotations

from typing import Any

import pytest

from rlhf_api.groups import resource, separate_roles, worker_groups
from rlhf_api.models import RLHFJobSpec
from rlhf_runtime.infra.config import engine_kwargs
from rlhf_runtime.infra.placement import (
    COLOCATED_TRAINER_SHARE,
    VALIDATION_SHARE,
    PlacementError,
    compute_layout,
    cpu_threads,
    local_thread_cap,
    split_share,
    spread,
)


def spec(**over: Any) -> RLHFJobSpec:
    base: dict[str, Any] = {
        "model": {"name": "m"}, "image": "i", "data": {"prompts": ["p"]}, "reward": {"rule": "contains", "target": "x"},
    }
    base.update(over)
    return RLHFJobSpec.model_validate(base)


def test_separate_gpu_trainer_and_tp2_engines() -> None:
    s = spec(trainer={"replicas": 2, "gpusPerReplica": 4, "strategy": "fsdp2"},
             rollout={"engines": 3, "tensorParallelSize": 2})
    lay = compute_layout(s)
    assert lay.gpu
    assert [g.name for g in lay.groups] == ["trainer", "engine-0", "engine-1", "engine-2"]
    assert lay.groups[0].bundles == [{"GPU": 1, "rlhf_trainer": 1}] * 8
    assert lay.groups[0].strategy == "PACK"
    for g in lay.groups[1:]:
        assert g.bundles == [{"GPU": 1, "rlhf_rollout": 1}] * 2
        assert g.strategy == "STRICT_PACK"
    assert [(t.group, t.bundle, t.num_gpus) for t in lay.trainers] == [(0, b, 1) for b in range(8)]
    assert [(e.group, e.executor, e.num_gpus) for e in lay.engines] == [(1, "ray", 0), (2, "ray", 0), (3, "ray", 0)]
    # TP workers take SEPARATE_TP_WORKER_SHARE of their bundle's GPU: the rest is for a validation engine
    assert all(e.env == {"VLLM_RAY_BUNDLE_INDICES": "0,1", "VLLM_RAY_PER_WORKER_GPUS": "0.9"} for e in lay.engines)
    assert not lay.dp_group
    assert lay.totals() == {"GPU": 14, "rlhf_trainer": 8, "rlhf_rollout": 6}


def test_separate_tp1_engine_holds_its_gpu_in_process() -> None:
    lay = compute_layout(spec(rollout={"engines": 2, "tensorParallelSize": 1}))
    assert [(e.group, e.bundle, e.num_gpus, e.executor, e.env) for e in lay.engines] == [
        (1, 0, 1, "uni", {}), (2, 0, 1, "uni", {}),
    ]


def test_colocated_shares_each_gpu_between_trainer_worker_and_engine_shard() -> None:
    s = spec(trainer={"replicas": 1, "gpusPerReplica": 4, "strategy": "fsdp2"},
             rollout={"engines": 2, "tensorParallelSize": 2},
             placement={"mode": "colocated"}, weightSync={"backend": "ipc"})
    lay = compute_layout(s)
    assert [g.name for g in lay.groups] == ["engine-0", "engine-1"]
    assert all(g.bundles == [{"GPU": 1, "rlhf_colocated": 1}] * 2 for g in lay.groups)
    assert [(t.group, t.bundle) for t in lay.trainers] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert all(0 < t.num_gpus < 1 for t in lay.trainers)
    for e in lay.engines:
        assert e.executor == "ray"
        assert e.env["VLLM_RAY_BUNDLE_INDICES"] == "0,1"
        # trainer + engine shares leave VALIDATION_SHARE free on every GPU
        assert float(e.env["VLLM_RAY_PER_WORKER_GPUS"]) + lay.trainers[0].num_gpus + VALIDATION_SHARE <= 1


def test_expert_parallel_engines_form_one_dp_group() -> None:
    s = spec(trainer={"replicas": 1, "gpusPerReplica": 4, "strategy": "fsdp2"},
             rollout={"engines": 4, "tensorParallelSize": 1, "expertParallel": True},
             placement={"mode": "colocated"}, weightSync={"backend": "ipc"})
    lay = compute_layout(s)
    assert lay.dp_group
    assert [(e.group, e.bundle, e.executor) for e in lay.engines] == [(g, 0, "uni") for g in range(4)]
    assert [(t.group, t.bundle) for t in lay.trainers] == [(g, 0) for g in range(4)]
    kw = engine_kwargs(s, "m", "ipc", "uni", True)
    assert kw["enable_expert_parallel"] is True and kw["enable_sleep_mode"] is True
    # one engine has no group to form; dense engines stay independent replicas
    assert not compute_layout(spec(rollout={"engines": 1, "tensorParallelSize": 2, "expertParallel": True})).dp_group
    assert not compute_layout(spec(rollout={"engines": 4})).dp_group
    assert "enable_expert_parallel" not in engine_kwargs(spec(rollout={"engines": 4}), "m", "nccl", "uni", True)


def test_colocated_engines_sleep_unless_kept_resident() -> None:
    colocated = {"placement": {"mode": "colocated"}, "weightSync": {"backend": "ipc"}}
    assert engine_kwargs(spec(**colocated), "m", "ipc", "uni", True)["enable_sleep_mode"] is True
    resident = spec(placement={"mode": "colocated", "colocatedSleep": False}, weightSync={"backend": "ipc"})
    assert "enable_sleep_mode" not in engine_kwargs(resident, "m", "ipc", "uni", True)
    assert "enable_sleep_mode" not in engine_kwargs(spec(**colocated), "m", "gloo", "uni", False)  # CPU vLLM
    assert "enable_sleep_mode" not in engine_kwargs(spec(), "m", "nccl", "uni", True)  # separate


def test_cpu_job_uses_cpu_bundles_only() -> None:
    lay = compute_layout(spec(trainer={"gpusPerReplica": 0}, rollout={"engines": 2}))
    assert not lay.gpu
    assert lay.groups[0].bundles == [{"rlhf_trainer": 1}]
    assert [g.bundles for g in lay.groups[1:]] == [[{"rlhf_rollout": 1}]] * 2
    assert all(a.num_gpus == 0 for a in [*lay.trainers, *lay.engines])
    assert "GPU" not in lay.totals()


LAYOUTS = {
    "cpu-separate": {"trainer": {"gpusPerReplica": 0, "resources": {"cpu": "250m", "memory": "2Gi"}},
                     "rollout": {"engines": 2, "resources": {"cpu": "250m", "memory": "2Gi"}}},
    "gpu-colocated-8": {"trainer": {"gpusPerReplica": 8, "strategy": "fsdp2", "resources": {"cpu": "8"}},
                        "rollout": {"engines": 8}, "placement": {"mode": "colocated"}, "weightSync": {"backend": "ipc"}},
    "gpu-separate-few-cpus": {"trainer": {"replicas": 2, "gpusPerReplica": 8, "strategy": "fsdp2",
                                          "resources": {"cpu": "4"}},
                              "rollout": {"engines": 4, "tensorParallelSize": 2, "resources": {"cpu": "1"}}},
    "gpu-separate-roles": {"trainer": {"replicas": 2, "gpusPerReplica": 2, "strategy": "fsdp2"},
                           "algorithm": {"name": "ppo", "klCoef": 0.01},
                           "reward": {"model": {"name": "rm", "replicas": 2, "gpusPerReplica": 2,
                                                "resources": {"cpu": "2"}}},
                           "critic": {"placement": "separate", "gpusPerReplica": 4, "resources": {"cpu": "1"}},
                           "reference": {"placement": "separate", "replicas": 3}},
    "gpu-colocated-mode-separate-roles": {
        "trainer": {"gpusPerReplica": 4, "strategy": "fsdp2"}, "rollout": {"engines": 4},
        "placement": {"mode": "colocated"}, "weightSync": {"backend": "ipc"},
        "algorithm": {"name": "ppo", "klCoef": 0.01}, "reference": {"placement": "separate", "gpusPerReplica": 2},
        "reward": {"model": {"name": "rm", "placement": "colocated"}}},
    "cpu-roles": {"trainer": {"gpusPerReplica": 0, "resources": {"cpu": "250m", "memory": "2Gi"}},
                  "algorithm": {"name": "ppo", "klCoef": 0.01},
                  "reward": {"model": {"name": "rm", "replicas": 2, "resources": {"cpu": "500m", "memory": "2Gi"}}},
                  "reference": {"placement": "separate", "gpusPerReplica": 2}},
}


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_every_bundle_fits_the_pods_the_operator_renders(name: str) -> None:
    """The runtime's placement groups against what each rendered worker pod's raylet offers (KubeRay v1.6.2:
    ``num-cpus`` = the container's CPU request rounded up, ``num-gpus`` and ``resources`` from rayStartParams,
    see test_render.kuberay_ray_start): every bundle must fit a pod of its group, and each group's pods
    together must hold all of its bundles (the old bundles asked 1 CPU each, 2 when colocated: a colocated pod
    with 8 GPUs and cpu 8 offers 8 CPUs for 16, a pod with 8 GPUs and cpu 4 offers 4 for 8)."""
    from rlhf_operator import render
    from tests.unit.test_render import kuberay_ray_start

    s = spec(**LAYOUTS[name])
    job = render.Job("j", "ns", "uid", s)
    offered: dict[str, tuple[int, dict[str, float]]] = {}  # custom resource -> (pods, what one pod offers)
    for g in render.render_ray_job(job)["spec"]["rayClusterSpec"]["workerGroupSpecs"]:
        node = kuberay_ray_start(g)["node"]
        custom = next(k for k in node if k.startswith("rlhf_"))
        offered[custom] = (g["replicas"], node)
    lay = compute_layout(s)
    for custom, (pods, node) in offered.items():
        bundles = [b for pg in lay.groups for b in pg.bundles if custom in b]
        assert bundles, custom
        for b in bundles:
            assert all(node.get(k, 0) >= v for k, v in b.items()), (b, node)
        for k in {k for b in bundles for k in b}:
            assert sum(b.get(k, 0) for b in bundles) <= pods * node.get(k, 0), (k, bundles, node)
    assert all(a.num_cpus == 0 for a in [*lay.trainers, *lay.engines, *(a for r in lay.roles.values() for a in r)])
    assert set(offered) == {k for pg in lay.groups for b in pg.bundles for k in b if k.startswith("rlhf_")}


@pytest.mark.parametrize(
    "over",
    [
        {"trainer": {"gpusPerReplica": 0}, "rollout": {"tensorParallelSize": 2}},
        {"trainer": {"gpusPerReplica": 0, "replicas": 2, "strategy": "fsdp2"}, "placement": {"mode": "colocated"}},
        {"trainer": {"gpusPerReplica": 0}, "rollout": {"engines": 2, "expertParallel": True}},
    ],
)
def test_cpu_layouts_that_cannot_run_are_refused(over: dict[str, Any]) -> None:
    with pytest.raises(PlacementError):
        compute_layout(spec(**over))


def test_cpu_fsdp2_puts_one_rank_in_each_trainer_pod() -> None:
    layout = compute_layout(spec(trainer={"gpusPerReplica": 0, "replicas": 2, "strategy": "fsdp2"}))
    assert not layout.gpu and len(layout.trainers) == 2
    trainer_group = layout.groups[0]
    # one bundle per rank, each asking the one rlhf_trainer unit a CPU trainer pod advertises
    assert trainer_group.bundles == [{"rlhf_trainer": 1}, {"rlhf_trainer": 1}]


def test_spread_deals_prompts_round_robin() -> None:
    assert spread(list("abcde"), 2) == [[0, 2, 4], [1, 3]]
    assert spread(list("ab"), 3) == [[0], [1], []]


def test_expert_parallel_needs_a_moe_model_with_enough_experts() -> None:
    from rlhf_runtime.infra.config import check_model

    s = spec(rollout={"engines": 4, "expertParallel": True})
    check_model(s, {"model_type": "qwen3_moe", "num_experts": 128})
    check_model(s, {"model_type": "mixtral", "num_local_experts": 8})
    with pytest.raises(ValueError, match="needs a mixture-of-experts model, but m has no experts"):
        check_model(s, {"model_type": "qwen2", "hidden_size": 896})
    with pytest.raises(ValueError, match="shards 2 experts over engines x tensorParallelSize = 4 GPUs"):
        check_model(s, {"num_experts": 2})
    check_model(spec(rollout={"engines": 4}), {"model_type": "qwen2"})  # dense without EP: fine


# ----------------------------------------------------------------------------- reward model, critic, reference
def ppo(**over: Any) -> RLHFJobSpec:
    """A PPO job (a critic always) with a KL penalty (a reference) and a reward model; ``over`` on top."""
    base: dict[str, Any] = {
        "algorithm": {"name": "ppo", "klCoef": 0.01},
        "reward": {"rule": "contains", "target": "x", "model": {"name": "rm"}},
    }
    base.update(over)
    return spec(**base)


def shares_per_bundle(lay: Any) -> dict[tuple[int, int], float]:
    """GPU share taken on each bundle by every actor the driver places (trainers, engines, roles)."""
    out: dict[tuple[int, int], float] = {}
    actors = [*lay.trainers, *lay.engines, *(a for acts in lay.roles.values() for a in acts)]
    for a in actors:
        out[(a.group, a.bundle)] = out.get((a.group, a.bundle), 0) + a.num_gpus
    for e in lay.engines:  # TP>1: the engine's Ray workers take VLLM_RAY_PER_WORKER_GPUS of each of its bundles
        if e.executor == "ray":
            for b in e.env["VLLM_RAY_BUNDLE_INDICES"].split(","):
                key = (e.group, int(b))
                out[key] = out.get(key, 0) + float(e.env["VLLM_RAY_PER_WORKER_GPUS"])
    return out


def test_separate_roles_get_placement_groups_of_their_own() -> None:
    s = ppo(trainer={"replicas": 2, "gpusPerReplica": 2, "strategy": "fsdp2"},
            reward={"rule": "contains", "target": "x",
                    "model": {"name": "rm", "placement": "separate", "replicas": 2, "gpusPerReplica": 2}},
            critic={"placement": "separate", "replicas": 1, "gpusPerReplica": 4},
            reference={"placement": "separate", "replicas": 3, "gpusPerReplica": 1})
    lay = compute_layout(s)
    assert [g.name for g in lay.groups] == ["trainer", "engine-0", "reward", "critic", "reference"]
    assert list(lay.roles) == ["reward", "critic", "reference"] == list(separate_roles(s))
    for name, n in {"reward": 4, "critic": 4, "reference": 3}.items():
        gi = [g.name for g in lay.groups].index(name)
        assert lay.groups[gi].bundles == [{f"rlhf_{name}": 1, "GPU": 1}] * n
        assert lay.groups[gi].strategy == "PACK"
        assert [(a.group, a.bundle, a.num_cpus, a.num_gpus) for a in lay.roles[name]] == [
            (gi, b, 0, 1) for b in range(n)]
    assert [t.num_gpus for t in lay.trainers] == [1] * 4  # no colocated role: the trainer keeps its GPU
    assert lay.totals() == {"GPU": 4 + 1 + 4 + 4 + 3, "rlhf_trainer": 4, "rlhf_rollout": 1, "rlhf_reward": 4,
                            "rlhf_critic": 4, "rlhf_reference": 3}


@pytest.mark.parametrize("k", [1, 2, 3])
def test_colocated_roles_share_each_trainer_gpu_evenly_in_separate_mode(k: int) -> None:
    roles = [("critic", {}), ("reference", {"reference": {"placement": "colocated"}}),
             ("reward", {"reward": {"rule": "contains", "target": "x", "model": {"name": "rm", "placement": "colocated"}}})]
    over: dict[str, Any] = {"trainer": {"replicas": 2, "gpusPerReplica": 2, "strategy": "fsdp2"}}
    for _, o in roles[:k]:
        over.update(o)
    if k < 3:
        over.setdefault("reward", {"rule": "contains", "target": "x"})  # no reward model
    if k < 2:
        over["algorithm"] = {"name": "ppo"}  # no KL: no reference
    lay = compute_layout(ppo(**over))
    assert sorted(lay.roles) == sorted(r for r, _ in roles[:k])
    assert [g.name for g in lay.groups] == ["trainer", "engine-0"]  # no group of their own
    share = {1: 0.5, 2: 0.3333, 3: 0.25}[k]
    assert [t.num_gpus for t in lay.trainers] == [share] * 4
    for acts in lay.roles.values():  # one actor beside each trainer worker, on its bundle
        assert [(a.group, a.bundle, a.num_cpus, a.num_gpus) for a in acts] == [(0, b, 0, share) for b in range(4)]
    per_bundle = shares_per_bundle(lay)
    assert all(per_bundle[(0, b)] <= 1 for b in range(4))
    assert lay.totals() == {"GPU": 5, "rlhf_trainer": 4, "rlhf_rollout": 1}


def test_colocated_roles_split_the_trainer_share_in_colocated_mode() -> None:
    s = ppo(trainer={"replicas": 1, "gpusPerReplica": 4, "strategy": "fsdp2"},
            rollout={"engines": 2, "tensorParallelSize": 2},
            placement={"mode": "colocated"}, weightSync={"backend": "ipc"},
            reward={"rule": "contains", "target": "x", "model": {"name": "rm", "placement": "colocated"}},
            reference={"placement": "colocated"})
    lay = compute_layout(s)
    assert [g.name for g in lay.groups] == ["engine-0", "engine-1"]
    assert list(lay.roles) == ["reward", "critic", "reference"]
    share = 0.1125  # COLOCATED_TRAINER_SHARE / 4
    assert share == COLOCATED_TRAINER_SHARE / 4 and [t.num_gpus for t in lay.trainers] == [share] * 4
    for acts in lay.roles.values():
        assert [(a.group, a.bundle, a.num_gpus) for a in acts] == [(t.group, t.bundle, share) for t in lay.trainers]
    # trainer + its roles + the engine shard leave VALIDATION_SHARE free on every GPU
    assert all(v + VALIDATION_SHARE <= 1 + 1e-9 for v in shares_per_bundle(lay).values())
    # a 3-way split of 0.45 rounds down (0.15 each) and 1/3 to 0.3333: never above the share
    assert split_share(COLOCATED_TRAINER_SHARE, 3) == 0.15 and split_share(1, 3) == 0.3333
    assert split_share(COLOCATED_TRAINER_SHARE, 7) == 0.0642 and 7 * 0.0642 <= COLOCATED_TRAINER_SHARE


def test_colocated_mode_with_separate_roles() -> None:
    s = ppo(trainer={"replicas": 1, "gpusPerReplica": 2, "strategy": "fsdp2"}, rollout={"engines": 2},
            placement={"mode": "colocated"}, weightSync={"backend": "ipc"},
            critic={"placement": "separate", "gpusPerReplica": 2})
    lay = compute_layout(s)
    assert [g.name for g in lay.groups] == ["engine-0", "engine-1", "reward", "critic"]
    assert list(lay.roles) == ["reward", "critic"]  # klCoef > 0 but reference.placement 'trainer': no actor
    assert [t.num_gpus for t in lay.trainers] == [COLOCATED_TRAINER_SHARE] * 2  # nothing colocated beside it
    assert [(a.group, a.bundle, a.num_gpus) for a in lay.roles["critic"]] == [(3, 0, 1), (3, 1, 1)]
    assert [(a.group, a.bundle, a.num_gpus) for a in lay.roles["reward"]] == [(2, 0, 1)]


def test_cpu_job_roles_take_one_bundle_per_pod_and_no_gpu() -> None:
    s = ppo(trainer={"gpusPerReplica": 0, "replicas": 2, "strategy": "fsdp2"},
            reward={"rule": "contains", "target": "x",
                    "model": {"name": "rm", "placement": "separate", "replicas": 2, "gpusPerReplica": 4}},
            reference={"placement": "colocated"})
    lay = compute_layout(s)
    assert not lay.gpu
    assert [g.name for g in lay.groups] == ["trainer", "engine-0", "reward"]
    assert lay.groups[2].bundles == [{"rlhf_reward": 1}] * 2  # one per pod: a CPU job's roles have no GPUs
    assert [(a.group, a.bundle, a.num_gpus) for a in lay.roles["reward"]] == [(2, 0, 0), (2, 1, 0)]
    for role in ("critic", "reference"):
        assert [(a.group, a.bundle, a.num_gpus) for a in lay.roles[role]] == [(0, 0, 0), (0, 1, 0)]
    assert all(t.num_gpus == 0 for t in lay.trainers)
    assert "GPU" not in lay.totals()


def test_a_role_without_gpus_in_a_gpu_job_takes_one_cpu_bundle_per_pod() -> None:
    s = spec(reward={"rule": "contains", "target": "x",
                     "model": {"name": "rm", "replicas": 3, "gpusPerReplica": 0}})
    lay = compute_layout(s)
    assert lay.gpu and lay.groups[-1].bundles == [{"rlhf_reward": 1}] * 3
    assert [a.num_gpus for a in lay.roles["reward"]] == [0, 0, 0]


def test_inactive_roles_leave_the_layout_as_it_was() -> None:
    for s in (spec(), spec(algorithm={"klCoef": 0.1}),  # reference inside the trainer
              spec(reference={"placement": "separate"}),  # klCoef 0: no reference at all
              spec(critic={"placement": "separate"})):  # GRPO: no critic (admission refuses spec.critic anyway)
        lay = compute_layout(s)
        assert lay.roles == {}
        assert lay == compute_layout(spec())
        assert [g.name for g in lay.groups] == ["trainer", "engine-0"]
        assert [t.num_gpus for t in lay.trainers] == [1]


ROLE_COMBOS = {
    "separate-all": {"reward": {"rule": "contains", "target": "x", "model": {"name": "rm"}},
                     "critic": {"placement": "separate"}, "reference": {"placement": "separate"}},
    "colocated-all": {"reward": {"rule": "contains", "target": "x", "model": {"name": "rm", "placement": "colocated"}},
                      "reference": {"placement": "colocated"}},
    "mixed": {"reference": {"placement": "separate", "gpusPerReplica": 2}},
}
MODES = {
    "separate-tp2": {"trainer": {"replicas": 2, "gpusPerReplica": 2, "strategy": "fsdp2"},
                     "rollout": {"engines": 2, "tensorParallelSize": 2}},
    "colocated-tp2": {"trainer": {"replicas": 1, "gpusPerReplica": 4, "strategy": "fsdp2"},
                      "rollout": {"engines": 2, "tensorParallelSize": 2},
                      "placement": {"mode": "colocated"}, "weightSync": {"backend": "ipc"}},
    "cpu": {"trainer": {"gpusPerReplica": 0}},
}


@pytest.mark.parametrize("combo", sorted(ROLE_COMBOS))
@pytest.mark.parametrize("mode", sorted(MODES))
def test_gpu_shares_never_exceed_a_bundle(mode: str, combo: str) -> None:
    lay = compute_layout(ppo(**{**MODES[mode], **ROLE_COMBOS[combo]}))
    bundles = {(gi, bi): b for gi, g in enumerate(lay.groups) for bi, b in enumerate(g.bundles)}
    for key, used in shares_per_bundle(lay).items():
        assert key in bundles, key
        assert used <= bundles[key].get("GPU", 0) + 1e-9, (key, used)
        if mode == "colocated-tp2" and key[0] < 2:  # engine bundles keep the validation share free
            assert used + VALIDATION_SHARE <= 1 + 1e-9
    for acts in lay.roles.values():
        assert all(a.num_cpus == 0 and round(a.num_gpus, 4) == a.num_gpus for a in acts)
    # the bundles take exactly what the worker groups the operator renders offer: GPUs and custom resources
    groups = worker_groups(ppo(**{**MODES[mode], **ROLE_COMBOS[combo]}))
    assert sum(b.get("GPU", 0) for b in bundles.values()) == sum(g.replicas * g.gpus for g in groups)
    assert {k: v for k, v in lay.totals().items() if k != "GPU"} == {
        resource(g.name): g.replicas * (g.gpus or 1) for g in groups}


@pytest.mark.parametrize(("quantity", "threads"), [("8", 8), ("1", 1), ("1.5", 2), ("500m", 1), ("2500m", 3),
                                                    ("0.1", 1), ("16000m", 16)])
def test_cpu_threads_rounds_a_cpu_quantity_up(quantity: str, threads: int) -> None:
    assert cpu_threads(quantity) == threads


def test_cpu_actors_compute_on_their_pods_cpus() -> None:
    """Ray gives every actor of num_cpus=0 OMP_NUM_THREADS=1: on a CPU-only job each actor's ``threads`` is the
    CPU request of the pod it runs in instead."""
    lay = compute_layout(spec(trainer={"gpusPerReplica": 0, "replicas": 2, "strategy": "fsdp2",
                                       "resources": {"cpu": "3"}},
                              rollout={"engines": 2, "resources": {"cpu": "1500m"}},
                              algorithm={"name": "ppo", "klCoef": 0.01},
                              critic={"placement": "colocated"},
                              reward={"model": {"name": "rm", "resources": {"cpu": "6"}}}))
    assert [t.threads for t in lay.trainers] == [3, 3]
    assert [e.threads for e in lay.engines] == [2, 2]
    assert [a.threads for a in lay.roles["critic"]] == [3, 3]  # beside each trainer rank, in its pod
    assert [a.threads for a in lay.roles["reward"]] == [6]  # a pod of its own
    # colocated: trainer and engine share the trainer's pod (and take turns)
    co = compute_layout(spec(trainer={"gpusPerReplica": 0, "resources": {"cpu": "4"}},
                             rollout={"resources": {"cpu": "1"}}, placement={"mode": "colocated"}))
    assert [t.threads for t in co.trainers] == [4] and [e.threads for e in co.engines] == [4]


def test_gpu_actors_keep_rays_default_threads() -> None:
    lay = compute_layout(spec(trainer={"gpusPerReplica": 2, "strategy": "fsdp2", "resources": {"cpu": "16"}},
                              rollout={"engines": 2}))
    assert all(a.threads == 0 for a in [*lay.trainers, *lay.engines])


def test_local_runs_split_the_machines_cpus_among_actors_busy_together() -> None:
    lay = compute_layout(spec(trainer={"gpusPerReplica": 0}, rollout={"engines": 2}))
    assert local_thread_cap(lay, async_mode=False, cpus=8) == 4  # two engines generate at once
    assert local_thread_cap(lay, async_mode=True, cpus=8) == 2  # and the trainer beside them
    assert local_thread_cap(lay, async_mode=False, cpus=1) == 1


def test_colocated_roles_release_the_gpu_cache_only_on_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    from rlhf_runtime.roles.base import release_cached_gpu_memory
    from rlhf_runtime.roles.options import TrainerOptions

    released: list[bool] = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: released.append(True))
    colocated = TrainerOptions.resolve(spec(placement={"mode": "colocated"}, weightSync={"backend": "ipc"},
                                            trainer={"replicas": 1, "gpusPerReplica": 1},
                                            rollout={"engines": 1})).colocated
    separate = TrainerOptions.resolve(spec(trainer={"replicas": 1, "gpusPerReplica": 1},
                                           rollout={"engines": 1})).colocated
    gpu, cpu = torch.device("cuda", 0), torch.device("cpu")
    # the engines sharing the GPU wake into what the trainer's allocator hands back; elsewhere the cache stays
    assert release_cached_gpu_memory(colocated, gpu) and released == [True]
    assert not release_cached_gpu_memory(separate, gpu)
    assert not release_cached_gpu_memory(colocated, cpu)
    assert released == [True]


def test_the_kv_cache_dtype_goes_to_vllm_only_where_it_is_not_the_models() -> None:
    assert "kv_cache_dtype" not in engine_kwargs(spec(), "m", "nccl", "uni", True)
    assert engine_kwargs(spec(rollout={"kvCacheDtype": "fp8"}), "m", "nccl", "uni", True)["kv_cache_dtype"] == "fp8"
    with pytest.raises(ValueError, match="kvCacheDtype"):
        spec(rollout={"kvCacheDtype": "int4"})


def test_explicit_kv_cache_size_goes_to_vllm_and_lets_colocated_engines_build_beside_the_trainers() -> None:
    from rlhf_api.models import RuntimeConfig
    from rlhf_runtime.controller.deadlines import Deadlines
    from rlhf_runtime.controller.job_actors import JobActors

    colocated = {"trainer": {"gpusPerReplica": 1}, "placement": {"mode": "colocated"}, "weightSync": {"backend": "ipc"}}
    sized = spec(**colocated, rollout={"kvCacheMemoryGiB": 1.5})
    assert engine_kwargs(sized, "m", "ipc", "uni", True)["kv_cache_memory_bytes"] == 1_610_612_736
    assert "kv_cache_memory_bytes" not in engine_kwargs(spec(**colocated), "m", "ipc", "uni", True)
    assert sized.wire()["rollout"]["kvCacheMemoryGiB"] == 1.5
    # vLLM's CPU platform would let its env variable override the size
    from rlhf_runtime.infra.config import actor_env
    assert "VLLM_CPU_KVCACHE_SPACE" not in actor_env(spec(rollout={"kvCacheMemoryGiB": 2}), gpu=False)
    assert actor_env(spec(), gpu=False)["VLLM_CPU_KVCACHE_SPACE"] == "1"
    with pytest.raises(ValueError, match="kvCacheMemoryGiB"):
        spec(rollout={"kvCacheMemoryGiB": 0})

    def build_early(s: RLHFJobSpec) -> bool:
        cfg = RuntimeConfig(name="j", namespace="ns", spec=s)
        return JobActors(cfg, compute_layout(s), Deadlines(60.0, lambda: 600, None), None, local=True)\
            .engines_build_early  # type: ignore[arg-type]

    # vLLM measures the GPU memory the trainer leaves unless the size is given: then it need not wait for it
    assert not build_early(spec(**colocated))
    assert build_early(sized)
    assert build_early(spec(trainer={"gpusPerReplica": 1}))  # separate GPUs
    assert build_early(spec(trainer={"gpusPerReplica": 0}, placement={"mode": "colocated"}))  # CPU
