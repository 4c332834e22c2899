"""Golden and property tests of the pure renderer (spec -> ConfigMap + RayJob)."""

from __future__ import annotations

import json
import math
import os
import shlex
from fractions import Fraction
from pathlib import Path
from typing import Any

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


def spec_gpus(spec: m.RLHFJobSpec) -> int:
    """The GPUs a spec asks for, read off its fields: the trainer's, the engines' (separate mode: colocated
    engines share the trainer's), and those of each role with a model of its own placed separately."""
    if spec.trainer.gpus_per_replica == 0:
        return 0
    total = spec.trainer.replicas * spec.trainer.gpus_per_replica
    if spec.placement.mode == "separate":
        total += spec.rollout.engines * spec.rollout.tensor_parallel_size
    roles = [spec.reward.model, spec.critic if spec.algorithm.name == "ppo" else None,
             spec.reference if spec.algorithm.kl_coef > 0 else None]
    return total + sum(r.replicas * r.gpus_per_replica for r in roles if r is not None and r.placement == "separate")


@pytest.mark.parametrize("sample", SAMPLES, ids=lambda p: p.stem)
def test_gpu_totals_match_spec(sample: Path) -> None:
    job = job_of(sample)
    groups = gpus_by_group(render.render_ray_job(job))
    assert sum(r * g for r, g in groups.values()) == spec_gpus(job.spec)
    for _, per_pod in groups.values():
        assert per_pod <= job.spec.placement.gpus_per_node


def test_layouts() -> None:
    sep = gpus_by_group(render.render_ray_job(job_of(REPO / "crds/samples/separate-nccl-tp2.yaml")))
    assert sep == {"trainer": (1, 1), "rollout": (1, 2)}
    colo = gpus_by_group(render.render_ray_job(job_of(REPO / "crds/samples/colocated-ipc-dp.yaml")))
    assert colo == {"colocated": (1, 4)}
    multi = gpus_by_group(render.render_ray_job(job_of(REPO / "crds/samples/multinode-trainer.yaml")))
    assert multi == {"trainer": (2, 8), "rollout": (4, 2)}
    ppo = gpus_by_group(render.render_ray_job(job_of(REPO / "crds/samples/ppo-reward-model.yaml")))
    assert ppo == {"trainer": (1, 1), "rollout": (1, 1), "reward": (1, 1), "reference": (1, 1)}  # critic colocated


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
        custom = kuberay_ray_start(g)["resources"]
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


def test_queued_job_is_created_suspended_and_its_suspend_left_to_kueue() -> None:
    job = job_of(REPO / "crds/samples/separate-nccl-tp2.yaml")
    spec = job.spec.model_copy(update={"scheduling": m.Scheduling(queue_name="gpu-queue")})
    rj = render.render_ray_job(render.Job(job.name, job.namespace, job.uid, spec))
    assert rj["spec"]["suspend"] is True  # Kueue admits it by unsuspending
    admitted = {"spec": {**rj["spec"], "suspend": False}}
    assert render.ray_job_mutable_patch(rj, admitted, kueue=True) == {}
    assert render.ray_job_mutable_patch(rj, admitted, kueue=False) == {"spec": {"suspend": True}}


def test_mutable_patch_brings_live_fields_to_the_spec() -> None:
    job = job_of(REPO / "crds/samples/separate-nccl-tp2.yaml")
    live = render.render_ray_job(job)
    spec = job.spec.model_copy(update={"active_deadline_seconds": 3600, "backoff_limit": 2,
                                       "ttl_seconds_after_finished": 60})
    want = render.render_ray_job(render.Job(job.name, job.namespace, job.uid, spec))
    assert render.ray_job_mutable_patch(want, live) == {
        "spec": {"activeDeadlineSeconds": 3600, "backoffLimit": 2, "ttlSecondsAfterFinished": 60}}
    assert render.ray_job_mutable_patch(want, want) == {}
    # a deadline removed from the spec is removed from the RayJob (null in a merge patch)
    assert render.ray_job_mutable_patch(live, want)["spec"]["activeDeadlineSeconds"] is None


def test_worker_pods_pack_by_group_then_by_job() -> None:
    job = job_of(REPO / "crds/samples/separate-nccl-tp2.yaml")
    rj = render.render_ray_job(job)
    for g in rj["spec"]["rayClusterSpec"]["workerGroupSpecs"]:
        terms = g["template"]["spec"]["affinity"]["podAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
        sel = [t["podAffinityTerm"]["labelSelector"]["matchLabels"] for t in terms]
        assert sel == [{naming.LABEL_JOB: job.name, naming.LABEL_ROLE: g["groupName"]}, {naming.LABEL_JOB: job.name}]
        assert [t["weight"] for t in terms] == [100, 50]
        assert g["template"]["metadata"]["labels"][naming.LABEL_ROLE] == g["groupName"]
    assert "affinity" not in rj["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]


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


# ------------------------------------------------------------------------------ KubeRay v1.6.2, ported
_SUFFIX = {"m": Fraction(1, 1000), "": 1, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12,
           "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}


def quantity(q: str) -> Fraction:
    """A Kubernetes quantity (the forms our CRD patterns allow)."""
    num = q.rstrip("KMGTikm")
    return Fraction(num) * _SUFFIX[q[len(num):]]


def kuberay_ray_start(group: dict[str, Any]) -> dict[str, Any]:
    """What KubeRay v1.6.2 (``controllers/ray/common/pod.go``) makes of a rendered worker group, ported line by
    line; all rayStartParams values are strings (Go ``map[string]string``):

    * ``setMissingRayStartParams`` (worker): ``address`` (here ``HEAD:6379``), ``metrics-export-port`` 8080,
      ``block`` true, ``dashboard-agent-listen-port`` 52365;
    * ``generateRayStartCommand``: ``num-cpus`` from the container's CPU limit, else its request
      (``Quantity.Value()``: rounded up), ``memory`` from the memory limit, then
      ``addWellKnownAcceleratorResources``, whose ``getResourcesMap`` must parse ``resources``
      (``strings.Trim(v, "'\"` ")`` then ``json.Unmarshal`` into ``map[string]float64``; its failure is the
      "failed to unmarshal resources" log line), and ``num-gpus`` from ``nvidia.com/gpu`` when absent;
    * ``convertParamMap``: `` --key=value `` per key in sorted order (`` --key `` for "true", nothing for
      "false"), run by ``/bin/bash -c`` (here: ``shlex``).

    Returns the command, the argv Ray gets, the parsed custom resources and what the raylet offers."""
    params = {**group["rayStartParams"]}
    for k, v in {"address": "HEAD:6379", "metrics-export-port": "8080", "block": "true",
                 "dashboard-agent-listen-port": "52365"}.items():
        params.setdefault(k, v)
    res = group["template"]["spec"]["containers"][0]["resources"]
    limits, requests = res.get("limits", {}), res.get("requests", {})
    if "num-cpus" not in params:
        for cpu in (limits.get("cpu"), requests.get("cpu")):
            if cpu and quantity(str(cpu)) != 0:
                params["num-cpus"] = str(math.ceil(quantity(str(cpu))))
                break
    if "memory" not in params and limits.get("memory"):
        params["memory"] = str(math.ceil(quantity(str(limits["memory"]))))
    custom = json.loads(params["resources"].strip("'\"` ")) if "resources" in params else {}
    assert isinstance(custom, dict) and all(isinstance(v, (int, float)) for v in custom.values()), custom
    if "num-gpus" not in params and limits.get(render.GPU):
        params["num-gpus"] = str(limits[render.GPU])
    flags = ""
    for k in sorted(params):
        v = params[k]
        assert isinstance(v, str), (k, v)  # a non-string would not even decode into map[string]string
        if v.lower() in ("true", "false"):
            flags += f" --{k} " if v.lower() == "true" else ""
        else:
            flags += f" --{k}={v} "
    cmd = f"ray start {flags}"
    argv = shlex.split(cmd)
    node = {"CPU": float(params.get("num-cpus", 0)), "GPU": float(params.get("num-gpus", 0))}
    for a in argv:
        if a.startswith("--resources="):
            node.update(json.loads(a.removeprefix("--resources=")))
    return {"cmd": cmd, "argv": argv, "resources": custom, "node": node}


@pytest.mark.parametrize("sample", SAMPLES, ids=lambda p: p.stem)
def test_kuberay_parses_worker_resources_and_ray_gets_them(sample: Path) -> None:
    for g in render.render_ray_job(job_of(sample))["spec"]["rayClusterSpec"]["workerGroupSpecs"]:
        want = {f"rlhf_{g['groupName']}": int(g["rayStartParams"]["num-gpus"]) or 1}
        got = kuberay_ray_start(g)
        assert got["resources"] == want  # KubeRay's getResourcesMap parses it (no "failed to unmarshal")
        assert f"--resources={json.dumps(want, separators=(',', ':'))}" in got["argv"]  # what `ray start` reads


def test_ray_start_command_of_a_trainer_pod() -> None:
    trainer = render.render_ray_job(job_of(REPO / "crds/samples/separate-nccl-tp2.yaml"))[
        "spec"]["rayClusterSpec"]["workerGroupSpecs"][0]
    assert trainer["rayStartParams"] == {"num-gpus": "1", "resources": """'{"rlhf_trainer":1}'"""}
    assert kuberay_ray_start(trainer)["cmd"] == (
        "ray start  --address=HEAD:6379  --block  --dashboard-agent-listen-port=52365  --memory=68719476736 "
        " --metrics-export-port=8080  --num-cpus=8  --num-gpus=1  --resources='{\"rlhf_trainer\":1}' "
    )


def test_the_old_double_encoded_resources_fail_kuberays_parse() -> None:
    old = json.dumps(json.dumps({"rlhf_trainer": 1}))  # what render wrote before: "{\"rlhf_trainer\": 1}"
    with pytest.raises(json.JSONDecodeError):
        json.loads(old.strip("'\"` "))


def test_cpu_only_pod_with_a_fractional_cpu_request() -> None:
    spec = job_of(REPO / "crds/samples/separate-nccl-tp2.yaml").spec.model_copy(update={
        "trainer": m.Trainer(gpus_per_replica=0, resources=m.Resources(cpu="250m", memory="2Gi")),
        "rollout": m.Rollout(resources=m.Resources(cpu="250m", memory="2Gi")),
    })
    for g in render.render_ray_job(render.Job("cpu", "ns", "u", spec))["spec"]["rayClusterSpec"]["workerGroupSpecs"]:
        node = kuberay_ray_start(g)["node"]
        assert node == {"CPU": 1.0, "GPU": 0.0, f"rlhf_{g['groupName']}": 1}  # 250m -> num-cpus 1 (rounded up)
        assert render.GPU not in g["template"]["spec"]["containers"][0]["resources"]["limits"]  # engines too


# ---------------------------------------------------------------------------------- head and submitter
def _pod(t: dict[str, Any]) -> dict[str, Any]:
    return t["template"]["spec"] if "template" in t else t["spec"]


def test_head_and_submitter_are_sized_from_the_spec() -> None:
    job = job_of(REPO / "crds/samples/separate-nccl-tp2.yaml")
    rj = render.render_ray_job(job)["spec"]
    head = rj["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]["containers"][0]["resources"]
    assert head == {"requests": {"cpu": "2", "memory": "8Gi"}, "limits": {"memory": "8Gi"}}  # the defaults
    sub = rj["submitterPodTemplate"]
    assert sub["spec"]["restartPolicy"] == "Never"
    (c,) = sub["spec"]["containers"]
    assert c["name"] == "ray-job-submitter" and c["image"] == job.spec.image and "command" not in c
    assert c["resources"] == {"requests": {"cpu": "200m", "memory": "512Mi"}, "limits": {"memory": "512Mi"}}
    assert sub["metadata"]["labels"][naming.LABEL_ROLE] == "submitter"

    small = job.spec.model_copy(update={"head": m.Head.model_validate(
        {"resources": {"cpu": "500m", "memory": "3Gi"}, "submitter": {"cpu": "100m", "memory": "384Mi"}})})
    rj = render.render_ray_job(render.Job(job.name, job.namespace, job.uid, small))["spec"]
    assert rj["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]["containers"][0]["resources"] == {
        "requests": {"cpu": "500m", "memory": "3Gi"}, "limits": {"memory": "3Gi"}}
    assert rj["submitterPodTemplate"]["spec"]["containers"][0]["resources"] == {
        "requests": {"cpu": "100m", "memory": "384Mi"}, "limits": {"memory": "384Mi"}}
    assert rj["rayClusterSpec"]["headGroupSpec"]["rayStartParams"]["num-cpus"] == "0"


def test_submitter_follows_the_jobs_scheduling_but_selects_no_gpu_product() -> None:
    job = job_of(REPO / "crds/samples/multinode-trainer.yaml")
    sub = render.render_ray_job(job)["spec"]["submitterPodTemplate"]["spec"]
    assert sub["priorityClassName"] == "training"
    assert sub["tolerations"][0]["key"] == "nvidia.com/gpu"
    assert render.GPU_PRODUCT_LABEL not in sub.get("nodeSelector", {})


# ------------------------------------------------------------------------ operator -> older runtime
def _key_paths(node: Any, prefix: str = "") -> set[str]:
    out: set[str] = set()
    if isinstance(node, dict):
        for k, v in node.items():
            p = f"{prefix}.{k}" if prefix else k
            out.add(p)
            if p not in ("spec.volumes",):  # free-form core/v1 Volumes
                out |= _key_paths(v, p)
    elif isinstance(node, list):
        for v in node:
            out |= _key_paths(v, prefix + "[]")
    return out


RUNTIME_0_1_KEYS = {
    line for line in (GOLDEN / "runtime-0.1-config-keys.txt").read_text().splitlines() if line and line[0] != "#"
}


@pytest.mark.parametrize("sample", SAMPLES, ids=lambda p: p.stem)
def test_job_json_of_default_specs_is_readable_by_the_0_1_runtime(sample: Path) -> None:
    """Runtimes up to 0.1.0 refuse unknown keys (``extra="forbid"``): new fields must not reach job.json
    unless the user sets them (operator-only fields never). A sample that asks for newer features (e.g.
    ppo-reward-model) may send new keys, but only at or under a field the sample itself sets."""
    payload = json.loads(render.render_config_map(job_of(sample))["data"][naming.CONFIG_KEY])
    user_set = _key_paths({"spec": yaml.safe_load(sample.read_text())["spec"]})

    def set_by_user(path: str) -> bool:
        parts = path.split(".")
        return any(".".join(parts[:i]) in user_set for i in range(2, len(parts) + 1))

    new = {p for p in _key_paths(payload) - RUNTIME_0_1_KEYS if not set_by_user(p)}
    assert not new, new
    assert "envFrom" not in payload["spec"] and "head" not in payload["spec"]


def test_job_json_leaves_out_operator_only_fields_and_new_defaults() -> None:
    job = job_of(REPO / "crds/samples/separate-nccl-tp2.yaml")
    spec = job.spec.model_copy(update={"head": m.Head.model_validate({"resources": {"cpu": "1"}})})
    payload = json.loads(render.render_config_map(render.Job(job.name, job.namespace, job.uid, spec))["data"][
        naming.CONFIG_KEY])
    assert "head" not in payload["spec"] and "validate" not in payload["spec"]["weightSync"]
    on = spec.model_copy(update={"weight_sync": spec.weight_sync.model_copy(update={"validate_": True})})
    payload = json.loads(render.render_config_map(render.Job(job.name, job.namespace, job.uid, on))["data"][
        naming.CONFIG_KEY])
    assert payload["spec"]["weightSync"]["validate"] is True  # asked for: sent (an old runtime refuses, loudly)
    assert m.RuntimeConfig.model_validate(payload).spec.weight_sync.validate_ is True


def test_weight_format_and_async_engine_reach_job_json_only_when_set() -> None:
    """``weightSync.format`` and ``rollout.asyncEngine`` (issue 16, replacing RLHF_* variables) stay out of
    job.json at their defaults, so an older runtime image still runs every job that does not ask for them."""
    job = job_of(REPO / "crds/samples/async-pause-resume.yaml")
    payload = json.loads(render.render_config_map(job)["data"][naming.CONFIG_KEY])
    assert "format" not in payload["spec"]["weightSync"] and "asyncEngine" not in payload["spec"]["rollout"]
    spec = job.spec.model_copy(update={
        "weight_sync": job.spec.weight_sync.model_copy(update={"format": "checkpoint"}),
        "rollout": job.spec.rollout.model_copy(update={"async_engine": "stepped"})})
    payload = json.loads(render.render_config_map(render.Job(job.name, job.namespace, job.uid, spec))["data"][
        naming.CONFIG_KEY])
    assert payload["spec"]["weightSync"]["format"] == "checkpoint"
    assert payload["spec"]["rollout"]["asyncEngine"] == "stepped"
    cfg = m.RuntimeConfig.model_validate(payload)
    assert (cfg.spec.weight_sync.format, cfg.spec.rollout.async_engine) == ("checkpoint", "stepped")


def test_runtime_ignores_and_names_fields_a_newer_operator_adds() -> None:
    job = job_of(REPO / "crds/samples/async-pause-resume.yaml")
    payload = json.loads(render.render_config_map(job)["data"][naming.CONFIG_KEY])
    payload["spec"]["futureFeature"] = {"on": True}
    payload["spec"]["rollout"]["sampling"]["minP"] = 0.1
    cfg, ignored = m.RuntimeConfig.from_runtime_json(json.dumps(payload))
    assert cfg.spec == job.spec
    assert sorted(ignored) == ["spec.futureFeature", "spec.rollout.sampling.minP"]
    payload["spec"]["rollout"]["engines"] = 0  # anything else is still an error
    with pytest.raises(ValueError, match="engines"):
        m.RuntimeConfig.from_runtime_json(json.dumps(payload))


def test_backoff_limit_becomes_kuberays_retries_and_stays_out_of_job_json() -> None:
    job = job_of(REPO / "crds/samples/separate-nccl-tp2.yaml")
    assert "backoffLimit" not in render.render_ray_job(job)["spec"]  # default 0: KubeRay's own default
    spec = job.spec.model_copy(update={"backoff_limit": 2})
    j = render.Job(job.name, job.namespace, job.uid, spec)
    assert render.render_ray_job(j)["spec"]["backoffLimit"] == 2
    payload = json.loads(render.render_config_map(j)["data"][naming.CONFIG_KEY])
    assert "backoffLimit" not in payload["spec"]  # operator-only: an older runtime never sees it


# ---------------------------------------------------------------------- reward model, critic, reference
def _with(job: render.Job, **update: Any) -> render.Job:
    return render.Job(job.name, job.namespace, job.uid, job.spec.model_copy(update=update))


def _roles_job(**update: Any) -> render.Job:
    """The multinode sample (GPU product, tolerations, priority) as PPO with every role separate."""
    job = job_of(REPO / "crds/samples/multinode-trainer.yaml")
    spec = job.spec.model_copy(update={
        "algorithm": job.spec.algorithm.model_copy(update={"name": "ppo", "kl_coef": 0.01}),
        "reward": job.spec.reward.model_copy(update={"model": m.RewardModel(
            name="rm", replicas=2, gpus_per_replica=2, resources=m.Resources(cpu="4", memory="32Gi"))}),
        "critic": m.Critic(placement="separate", replicas=1, gpus_per_replica=8,
                           resources=m.Resources(cpu="16", memory="128Gi")),
        "reference": m.Reference(placement="separate", replicas=3, gpus_per_replica=1),
        **update,
    })
    return render.Job(job.name, job.namespace, job.uid, spec)


def test_separate_roles_get_worker_groups_of_their_own() -> None:
    job = _roles_job()
    rj = render.render_ray_job(job)
    groups = {g["groupName"]: g for g in rj["spec"]["rayClusterSpec"]["workerGroupSpecs"]}
    assert list(groups) == ["trainer", "rollout", "reward", "critic", "reference"]
    assert gpus_by_group(rj) == {"trainer": (2, 8), "rollout": (4, 2), "reward": (2, 2), "critic": (1, 8),
                                 "reference": (3, 1)}
    assert sum(r * g for r, g in gpus_by_group(rj).values()) == spec_gpus(job.spec) == 16 + 8 + 4 + 8 + 3
    sizes = {"reward": ("4", "32Gi"), "critic": ("16", "128Gi"), "reference": ("8", "64Gi")}
    for name, (cpu, memory) in sizes.items():
        g = groups[name]
        assert (g["minReplicas"], g["maxReplicas"]) == (g["replicas"], g["replicas"])
        pod = g["template"]["spec"]
        res = pod["containers"][0]["resources"]
        assert (res["requests"]["cpu"], res["requests"]["memory"], res["limits"]["memory"]) == (cpu, memory, memory)
        # the role's Ray custom resource, one unit per GPU, as KubeRay hands it to `ray start`
        start = kuberay_ray_start(g)
        assert start["resources"] == {f"rlhf_{name}": res["limits"][render.GPU]}
        assert start["node"][f"rlhf_{name}"] == start["node"]["GPU"] == res["limits"][render.GPU]
        # like every worker group: role label, packing, the job's scheduling, the GPU product, the security
        assert g["template"]["metadata"]["labels"][naming.LABEL_ROLE] == name
        assert pod["affinity"] == render.pack_affinity(job.name, name)
        assert pod["nodeSelector"][render.GPU_PRODUCT_LABEL] == "NVIDIA-H100-80GB-HBM3"
        assert pod["priorityClassName"] == "training" and pod["tolerations"][0]["key"] == "nvidia.com/gpu"
        assert pod["containers"][0]["securityContext"] == render.CONTAINER_SECURITY
        assert pod["serviceAccountName"] == naming.child_names(job.name).runtime_identity
        assert pod["containers"][0]["env"] == groups["trainer"]["template"]["spec"]["containers"][0]["env"]


def test_colocated_and_inactive_roles_get_no_group() -> None:
    job = _roles_job(critic=m.Critic(), reference=m.Reference(placement="colocated"))
    assert [g.name for g in render.worker_groups(job.spec)] == ["trainer", "rollout", "reward"]
    # no KL penalty: no reference at all; GRPO: no critic
    grpo = _roles_job(algorithm=m.Algorithm(), critic=None)
    assert [g.name for g in render.worker_groups(grpo.spec)] == ["trainer", "rollout", "reward"]
    colocated = _with(job_of(REPO / "crds/samples/colocated-ipc-dp.yaml"),
                      algorithm=m.Algorithm(name="ppo", kl_coef=0.1),
                      critic=m.Critic(placement="separate", gpus_per_replica=2),
                      reference=m.Reference(placement="separate"))
    assert [(g.name, g.replicas, g.gpus) for g in render.worker_groups(colocated.spec)] == [
        ("colocated", 1, 4), ("critic", 1, 2), ("reference", 1, 1)]


def test_cpu_job_roles_get_cpu_pods_with_one_custom_resource_unit() -> None:
    job = _roles_job(trainer=m.Trainer(gpus_per_replica=0, resources=m.Resources(cpu="250m", memory="2Gi")))
    rj = render.render_ray_job(job)
    for g in rj["spec"]["rayClusterSpec"]["workerGroupSpecs"]:
        pod = g["template"]["spec"]
        assert render.GPU not in pod["containers"][0]["resources"]["limits"], g["groupName"]
        assert render.GPU_PRODUCT_LABEL not in pod.get("nodeSelector", {})
        assert g["rayStartParams"]["num-gpus"] == "0"
        assert kuberay_ray_start(g)["resources"] == {f"rlhf_{g['groupName']}": 1}
    assert spec_gpus(job.spec) == 0


SECRET_TOKEN = "hf_SECRET-never-rendered-4f1d9c"


def _secret_env_job() -> render.Job:
    job = job_of(REPO / "crds/samples/ppo-reward-model.yaml")
    return _with(job, env=[
        m.EnvVar(name="HF_TOKEN", value_from=m.EnvVarSource(secret_key_ref=m.KeyRef(name="hf-token", key="token"))),
        m.EnvVar(name="DATA_URL", value_from=m.EnvVarSource(
            config_map_key_ref=m.KeyRef(name="urls", key="data", optional=True))),
        m.EnvVar(name="NCCL_DEBUG", value="INFO"),
    ], env_from=[
        m.EnvFromSource(secret_ref=m.NameRef(name="wandb")),
        m.EnvFromSource(prefix="CFG_", config_map_ref=m.NameRef(name="settings", optional=True)),
    ])


def test_env_value_from_and_env_from_on_every_container() -> None:
    rj = render.render_ray_job(_secret_env_job())["spec"]
    containers = [rj["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]["containers"][0]] + [
        g["template"]["spec"]["containers"][0] for g in rj["rayClusterSpec"]["workerGroupSpecs"]]
    assert len(containers) == 1 + 4  # head, trainer, rollout, reward, reference
    for c in containers:
        env = {e["name"]: e for e in c["env"]}
        assert env["HF_TOKEN"] == {"name": "HF_TOKEN", "valueFrom": {
            "secretKeyRef": {"name": "hf-token", "key": "token", "optional": False}}}
        assert env["DATA_URL"] == {"name": "DATA_URL", "valueFrom": {
            "configMapKeyRef": {"name": "urls", "key": "data", "optional": True}}}
        assert env["NCCL_DEBUG"] == {"name": "NCCL_DEBUG", "value": "INFO"}  # literal, overrides BASE_ENV
        assert env["RLHF_JOB_CONFIG"]["value"] == "/etc/rlhf/job.json"
        assert c["envFrom"] == [{"secretRef": {"name": "wandb", "optional": False}},
                                {"prefix": "CFG_", "configMapRef": {"name": "settings", "optional": True}}]
    # KubeRay's submitter pod gets no environment of ours (it did not before either)
    sub = rj["submitterPodTemplate"]["spec"]["containers"][0]
    assert "env" not in sub and "envFrom" not in sub
    # without spec.envFrom no envFrom key at all (the existing renders stay as they were)
    plain = render.render_ray_job(job_of(REPO / "crds/samples/separate-nccl-tp2.yaml"))["spec"]
    assert all("envFrom" not in g["template"]["spec"]["containers"][0]
               for g in [plain["rayClusterSpec"]["headGroupSpec"], *plain["rayClusterSpec"]["workerGroupSpecs"]])


def test_config_map_holds_secret_references_never_values() -> None:
    """The spec can only name a Secret's key (there is no field for its value), and the operator never reads
    Secrets: the ConfigMap (job.json), like the RayJob, carries the reference and no value; spec.envFrom is
    operator-only and stays out of job.json altogether."""
    job = _secret_env_job()
    secret = {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "hf-token"},
              "stringData": {"token": SECRET_TOKEN}}  # what the cluster would hold
    cm = render.render_config_map(job)
    payload = json.loads(cm["data"][naming.CONFIG_KEY])
    (hf,) = [e for e in payload["spec"]["env"] if e["name"] == "HF_TOKEN"]
    assert hf["valueFrom"] == {"secretKeyRef": {"name": "hf-token", "key": "token", "optional": False}}
    assert hf.get("value", "") == ""
    assert "envFrom" not in payload["spec"]
    for rendered in (cm, render.render_ray_job(job), *render.render_runtime_rbac(job)):
        text = json.dumps(rendered)
        assert secret["stringData"]["token"] not in text
        assert "stringData" not in text and '"kind": "Secret"' not in text
    # the runtime reads the same reference back (and can only resolve it from its own environment)
    cfg = m.RuntimeConfig.model_validate_json(cm["data"][naming.CONFIG_KEY])
    assert cfg.spec.env == job.spec.env


def test_head_serves_the_runtime_metrics_beside_rays_own_ports() -> None:
    """``spec.head.metricsPort``: the head container gets RLHF_METRICS_PORT (over a spec.env entry of that name)
    and the port named rlhf-metrics, listed with the ports KubeRay's head Service takes by default (a head that
    names any port gets a Service of only its ports: without the dashboard's, ``ray job submit`` finds no head).
    0: neither, and KubeRay's defaults as before."""
    job = job_of(REPO / "crds/samples/separate-nccl-tp2.yaml")

    def head(spec: m.RLHFJobSpec) -> dict:
        return render.render_ray_job(render.Job(job.name, job.namespace, job.uid, spec))["spec"]["rayClusterSpec"][
            "headGroupSpec"]["template"]["spec"]["containers"][0]

    on = head(job.spec.model_copy(update={"env": [m.EnvVar(name="RLHF_METRICS_PORT", value="1")]}))
    assert {p["name"]: p["containerPort"] for p in on["ports"]} == {
        "gcs-server": 6379, "dashboard": 8265, "client": 10001, "metrics": 8080, "serve": 8000, "rlhf-metrics": 9095}
    assert [e for e in on["env"] if e["name"] == "RLHF_METRICS_PORT"] == [{"name": "RLHF_METRICS_PORT", "value": "9095"}]
    off = head(job.spec.model_copy(update={"head": m.Head.model_validate({"metricsPort": 0})}))
    assert "ports" not in off and not any(e["name"] == "RLHF_METRICS_PORT" for e in off["env"])


def test_tracking_credentials_reach_the_head_container_only() -> None:
    """``spec.tracking``'s Secrets: the MLflow credentials Secret as the head container's envFrom and the W&B key
    as its WANDB_API_KEY (a reference for the kubelet), on no worker or submitter pod (only the driver, on the head,
    talks to the trackers); the ConfigMap carries the Secret's name and key, never a value."""
    job = job_of(REPO / "crds/samples/separate-nccl-tp2.yaml")
    spec = job.spec.model_copy(update={"tracking": m.Tracking.model_validate({
        "mlflow": {"trackingUri": "http://mlflow:5000", "credentialsSecret": "mlflow-auth"},
        "wandb": {"project": "p", "apiKeySecret": {"name": "wandb", "key": "api-key"}}}),
        "env": [m.EnvVar(name="WANDB_API_KEY", value="literal-from-env")]})
    rendered = render.Job(job.name, job.namespace, job.uid, spec)
    cluster = render.render_ray_job(rendered)["spec"]["rayClusterSpec"]
    head = cluster["headGroupSpec"]["template"]["spec"]["containers"][0]
    assert head["envFrom"] == [{"secretRef": {"name": "mlflow-auth"}}]
    assert [e for e in head["env"] if e["name"] == "WANDB_API_KEY"] == [
        {"name": "WANDB_API_KEY", "valueFrom": {"secretKeyRef": {"name": "wandb", "key": "api-key"}}}]
    for group in cluster["workerGroupSpecs"]:
        worker = group["template"]["spec"]["containers"][0]
        assert "envFrom" not in worker
        assert [e["value"] for e in worker["env"] if e["name"] == "WANDB_API_KEY"] == ["literal-from-env"]
    off = render.render_ray_job(render.Job(job.name, job.namespace, job.uid, job.spec))["spec"]["rayClusterSpec"]
    assert "envFrom" not in off["headGroupSpec"]["template"]["spec"]["containers"][0]


def test_object_store_checkpoint_env_on_every_head_and_worker_container() -> None:
    """``spec.checkpoint.uri`` with ``storage``: endpoint and region as AWS_ENDPOINT_URL_S3 / AWS_REGION (over a
    spec.env entry of that name) and the credentials Secret as envFrom on the head and every worker (the trainers
    write, rank 0 resumes); none of it without a uri; the ConfigMap names the Secret, never its keys' values."""
    job = job_of(REPO / "crds/samples/separate-nccl-tp2.yaml")
    spec = job.spec.model_copy(update={
        "checkpoint": m.Checkpoint.model_validate({"uri": "s3://ckpt/run1", "storage": {
            "endpoint": "http://seaweedfs:8333", "region": "eu-west-1", "credentialsSecret": "s3-creds"}}),
        "env": [m.EnvVar(name="AWS_REGION", value="us-east-2")]})
    rendered = render.Job(job.name, job.namespace, job.uid, spec)
    cluster = render.render_ray_job(rendered)["spec"]["rayClusterSpec"]
    containers = [cluster["headGroupSpec"]["template"]["spec"]["containers"][0]] + [
        g["template"]["spec"]["containers"][0] for g in cluster["workerGroupSpecs"]]
    assert len(containers) >= 3
    for c in containers:
        env = {e["name"]: e.get("value") for e in c["env"]}
        assert (env["AWS_ENDPOINT_URL_S3"], env["AWS_REGION"]) == ("http://seaweedfs:8333", "eu-west-1")
        assert [e["name"] for e in c["env"]].count("AWS_REGION") == 1
        assert c["envFrom"] == [{"secretRef": {"name": "s3-creds"}}]
    sub = cluster.get("submitterPodTemplate") or render.render_ray_job(rendered)["spec"]["submitterPodTemplate"]
    assert "envFrom" not in sub["spec"]["containers"][0]
    payload = json.loads(render.render_config_map(rendered)["data"][naming.CONFIG_KEY])
    assert payload["spec"]["checkpoint"] == {"uri": "s3://ckpt/run1", "everyNSteps": 10, "storage": {
        "endpoint": "http://seaweedfs:8333", "region": "eu-west-1", "credentialsSecret": "s3-creds"}}
    plain = render.render_ray_job(job)["spec"]["rayClusterSpec"]
    for g in [plain["headGroupSpec"], *plain["workerGroupSpecs"]]:
        c = g["template"]["spec"]["containers"][0]
        assert "envFrom" not in c and not any(e["name"].startswith("AWS_") for e in c["env"])


def test_checkpoint_takes_a_uri_or_a_volume_path() -> None:
    assert m.Checkpoint.model_validate({"uri": "s3://b-1/x/y"}).location == "s3://b-1/x/y"
    assert m.Checkpoint.model_validate({"volume": "v", "path": "/c"}).location == "/c"
    for bad in ("/data/ckpt", "s3://", "s3://B/x", "http://b/x", "s3://b x/y"):
        with pytest.raises(ValueError, match="uri"):
            m.Checkpoint.model_validate({"uri": bad})


def test_output_uri_storage_reaches_the_containers_too() -> None:
    """``spec.output.uri`` alone (no object-store checkpoint): its storage is the pods' as well."""
    job = job_of(REPO / "crds/samples/separate-nccl-tp2.yaml")
    spec = job.spec.model_copy(update={"output": m.Output.model_validate({
        "uri": "s3://models/run1", "storage": {"endpoint": "http://s3:8333", "credentialsSecret": "keys"}})})
    cluster = render.render_ray_job(render.Job(job.name, job.namespace, job.uid, spec))["spec"]["rayClusterSpec"]
    for g in [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]:
        c = g["template"]["spec"]["containers"][0]
        assert {e["name"]: e.get("value") for e in c["env"]}["AWS_ENDPOINT_URL_S3"] == "http://s3:8333"
        assert c["envFrom"] == [{"secretRef": {"name": "keys"}}]
    assert m.Output.model_validate({"uri": "s3://models/run1"}).location == "s3://models/run1"
