"""Golden and property tests of the pure renderer (spec -> ConfigMap + RayJob)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import yaml

from rlhf_api import models as m
from rlhf_operator import naming, render

REPO = Path(__file__).resolve().parents[2]
GOLDEN = Path(__file__).parent / "golden"
SAMPLES = sorted((REPO / "crds" / "samples").glob("*.yaml"))


def job_of(sample: Path) -> render.Job:
    doc = yaml.safe_load(sample.read_text())
    return render.Job(doc["metadata"]["name"], "team-a", "uid-1234", m.RLHFJobSpec.model_validate(doc["spec"]))


def gpus_by_group(ray_job: dict) -> dict[str, tuple[int, int]]:
    out = {}
    for g in ray_job["spec"]["rayClusterSpec"]["workerGroupSpecs"]:
        res = g["template"]["spec"]["containers"][0]["resources"]
        out[g["groupName"]] = (g["replicas"], res["limits"].get(render.GPU, 0))
        assert g["rayStartParams"]["num-gpus"] == str(res["limits"].get(render.GPU, 0))
    return out


@pytest.mark.parametrize("sample", SAMPLES, ids=lambda p: p.stem)
def test_golden(sample: Path) -> None:
    job = job_of(sample)
    rendered = yaml.safe_dump(
        {"configMap": render.render_config_map(job), "rayJob": render.render_ray_job(job)}, sort_keys=True
    )
    golden = GOLDEN / f"{sample.stem}.yaml"
    if os.environ.get("UPDATE_GOLDEN") or not golden.exists():
        golden.write_text(rendered)
    assert rendered == golden.read_text(), f"render changed for {sample.name}; UPDATE_GOLDEN=1 to accept"


@pytest.mark.parametrize("sample", SAMPLES, ids=lambda p: p.stem)
def test_gpu_totals_match_spec(sample: Path) -> None:
    job = job_of(sample)
    groups = gpus_by_group(render.render_ray_job(job))
    assert sum(r * g for r, g in groups.values()) == job.spec.total_gpus()
    for _, per_pod in groups.values():
        assert per_pod <= job.spec.placement.gpus_per_node


def test_layouts() -> None:
    sep = gpus_by_group(render.render_ray_job(job_of(REPO / "crds/samples/separate-nccl-tp2.yaml")))
    assert sep == {"trainer": (1, 1), "rollout": (1, 2)}
    colo = gpus_by_group(render.render_ray_job(job_of(REPO / "crds/samples/colocated-ipc-dp.yaml")))
    assert colo == {"colocated": (1, 4)}
    multi = gpus_by_group(render.render_ray_job(job_of(REPO / "crds/samples/multinode-trainer.yaml")))
    assert multi == {"trainer": (2, 8), "rollout": (4, 2)}


def test_head_has_no_gpus_and_pods_get_shm_config_and_scheduling() -> None:
    job = job_of(REPO / "crds/samples/multinode-trainer.yaml")
    rj = render.render_ray_job(job)
    head = rj["spec"]["rayClusterSpec"]["headGroupSpec"]
    assert render.GPU not in head["template"]["spec"]["containers"][0]["resources"]["limits"]
    assert head["rayStartParams"]["num-gpus"] == "0"
    for g in rj["spec"]["rayClusterSpec"]["workerGroupSpecs"]:
        pod = g["template"]["spec"]
        vols = {v["name"]: v for v in pod["volumes"]}
        assert vols["dshm"]["emptyDir"]["medium"] == "Memory"
        assert vols["rlhf-config"]["configMap"]["name"] == naming.child_names(job.name).config_map
        assert pod["nodeSelector"][render.GPU_PRODUCT_LABEL] == "NVIDIA-H100-80GB-HBM3"
        assert pod["priorityClassName"] == "training"
        assert pod["tolerations"][0]["key"] == "nvidia.com/gpu"
        env = {e["name"]: e["value"] for e in pod["containers"][0]["env"]}
        assert env["RLHF_JOB_CONFIG"] == "/etc/rlhf/job.json"
        custom = json.loads(json.loads(g["rayStartParams"]["resources"]))
        assert custom == {f"rlhf_{g['groupName']}": g["template"]["spec"]["containers"][0]["resources"]["limits"][render.GPU]}


def test_config_map_round_trips_to_the_runtime_contract() -> None:
    job = job_of(REPO / "crds/samples/async-pause-resume.yaml")
    cm = render.render_config_map(job)
    cfg = m.RuntimeConfig.model_validate_json(cm["data"][naming.CONFIG_KEY])
    assert cfg.spec == job.spec and cfg.uid == "uid-1234" and cfg.namespace == "team-a"


def test_user_env_overrides_and_queue_and_suspend() -> None:
    job = job_of(REPO / "crds/samples/separate-nccl-tp2.yaml")
    spec = job.spec.model_copy(
        update={
            "env": [m.EnvVar(name="NCCL_DEBUG", value="INFO"), m.EnvVar(name="X", value="1")],
            "suspend": True,
            "scheduling": m.Scheduling(queue_name="gpu-queue"),
        }
    )
    rj = render.render_ray_job(render.Job(job.name, job.namespace, job.uid, spec))
    assert rj["metadata"]["labels"][naming.KUEUE_QUEUE_LABEL] == "gpu-queue"
    assert rj["spec"]["suspend"] is True
    env = rj["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]["env"]
    assert [e["value"] for e in env if e["name"] == "NCCL_DEBUG"] == ["INFO"]
    assert {"name": "X", "value": "1"} in env


def test_render_is_deterministic() -> None:
    job = job_of(SAMPLES[0])
    assert render.render_ray_job(job) == render.render_ray_job(job)
    assert naming.child_names("a") != naming.child_names("b")


def test_runtime_identity_can_only_touch_its_own_job() -> None:
    job = job_of(SAMPLES[0])
    sa, role, binding = render.render_runtime_rbac(job)
    names = naming.child_names(job.name)
    assert sa["metadata"]["name"] == role["metadata"]["name"] == binding["metadata"]["name"] == names.runtime_identity
    for rule in role["rules"]:
        assert rule["resourceNames"], rule  # never a blanket grant
        assert set(rule["verbs"]) <= {"get", "patch"}
    status_rule = next(r for r in role["rules"] if r["resources"] == ["rlhfjobs/status"])
    assert status_rule["resourceNames"] == [job.name]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": names.runtime_identity, "namespace": "team-a"}]
    rj = render.render_ray_job(job)
    pods = [rj["spec"]["rayClusterSpec"]["headGroupSpec"]] + rj["spec"]["rayClusterSpec"]["workerGroupSpecs"]
    assert all(p["template"]["spec"]["serviceAccountName"] == names.runtime_identity for p in pods)
