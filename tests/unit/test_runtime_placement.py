"""Placement groups and actor options computed from a spec (pure, no Ray)."""

from __future__ import annotations

from typing import Any

import pytest

from rlhf_api.models import RLHFJobSpec
from rlhf_runtime.config import engine_kwargs
from rlhf_runtime.placement import VALIDATION_SHARE, PlacementError, compute_layout, spread


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
}


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_every_bundle_fits_the_pods_the_operator_renders(name: str) -> None:
    """The runtime's placement groups against what each rendered worker pod's raylet offers (KubeRay v1.6.1:
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
    assert all(a.num_cpus == 0 for a in [*lay.trainers, *lay.engines])


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
    from rlhf_runtime.config import check_model

    s = spec(rollout={"engines": 4, "expertParallel": True})
    check_model(s, {"model_type": "qwen3_moe", "num_experts": 128})
    check_model(s, {"model_type": "mixtral", "num_local_experts": 8})
    with pytest.raises(ValueError, match="needs a mixture-of-experts model, but m has no experts"):
        check_model(s, {"model_type": "qwen2", "hidden_size": 896})
    with pytest.raises(ValueError, match="shards 2 experts over engines x tensorParallelSize = 4 GPUs"):
        check_model(s, {"num_experts": 2})
    check_model(spec(rollout={"engines": 4}), {"model_type": "qwen2"})  # dense without EP: fine
