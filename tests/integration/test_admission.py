"""Bad specs are refused by the real kube-apiserver at `kubectl apply`, with the message the CRD declares."""

from __future__ import annotations

import copy

import pytest

from tests.integration.conftest import apply, load_sample

pytestmark = pytest.mark.cluster


def base() -> dict:
    job = load_sample("separate-nccl-tp2")
    job["metadata"]["name"] = "bad"
    return job


def with_spec(**patch) -> dict:
    job = base()
    spec = job["spec"]
    for path, value in patch.items():
        node = spec
        keys = path.split("__")
        for k in keys[:-1]:
            node = node.setdefault(k, {})
        if value is DELETE:
            node.pop(keys[-1], None)
        else:
            node[keys[-1]] = value
    return job


DELETE = object()

INVALID = [
    ("tp above gpus per node", with_spec(rollout__tensorParallelSize=16),
     "rollout.tensorParallelSize must not exceed placement.gpusPerNode"),
    ("trainer gpus above gpus per node", with_spec(trainer__gpusPerReplica=9, trainer__strategy="fsdp2"),
     "trainer.gpusPerReplica must not exceed placement.gpusPerNode"),
    ("ipc with separate placement", with_spec(weightSync__backend="ipc"), "weightSync.backend 'ipc' needs placement.mode 'colocated'"),
    ("colocatedSleep false with separate placement", with_spec(placement__colocatedSleep=False),
     "placement.colocatedSleep: false only applies to placement.mode 'colocated'"),
    ("colocated with nccl", with_spec(placement__mode="colocated", rollout__tensorParallelSize=1),
     "placement.mode 'colocated' needs weightSync.backend 'ipc'"),
    ("colocated gpu mismatch", with_spec(placement__mode="colocated", weightSync__backend="ipc", rollout__engines=2),
     "needs as many trainer GPUs"),
    ("async with colocated", with_spec(placement__mode="colocated", weightSync__backend="ipc", weightSync__mode="async",
                                       rollout__tensorParallelSize=1),
     "weightSync.mode 'async' (pause/resume mid-request) needs placement.mode 'separate'"),
    ("expert parallel on one gpu", with_spec(rollout__tensorParallelSize=1, rollout__expertParallel=True),
     "rollout.expertParallel needs at least 2 engine GPUs"),
    ("expert parallel with async", with_spec(rollout__expertParallel=True, weightSync__mode="async"),
     "rollout.expertParallel needs weightSync.mode 'sync'"),
    ("stepped async engine in sync mode", with_spec(rollout__asyncEngine="stepped"),
     "rollout.asyncEngine 'stepped' applies to weightSync.mode 'async' only"),
    ("unknown async engine", with_spec(rollout__asyncEngine="threads", weightSync__mode="async"),
     'Unsupported value: "threads"'),
    ("unknown weight format", with_spec(weightSync__format="fused"), 'Unsupported value: "fused"'),
    ("zero engines", with_spec(rollout__engines=0), "spec.rollout.engines: Invalid value: 0"),
    ("zero tensor parallel", with_spec(rollout__tensorParallelSize=0), "spec.rollout.tensorParallelSize: Invalid value: 0"),
    ("unknown backend", with_spec(weightSync__backend="rdma"), 'Unsupported value: "rdma"'),
    ("unknown placement", with_spec(placement__mode="mixed"), 'Unsupported value: "mixed"'),
    ("single strategy with many gpus", with_spec(trainer__gpusPerReplica=4), "trainer.strategy 'single' trains in one process"),
    ("grpo needs groups", with_spec(rollout__sampling__samplesPerPrompt=1), "GRPO needs rollout.sampling.samplesPerPrompt >= 2"),
    ("two data sources", with_spec(data__prompts=["hi"]), "data needs exactly one of prompts, configMap or path"),
    ("no data source", with_spec(data={}), "data needs exactly one of prompts, configMap or path"),
    ("reward rule and function", with_spec(reward__function="m:f"), "reward takes rule or function, not both"),
    ("reward without a source", with_spec(reward={"normalize": "batch"}),
     "reward needs a source: rule, function, model or endpoint"),
    ("reward endpoint not http", with_spec(reward={"endpoint": {"url": "ftp://x/score"}}),
     "spec.reward.endpoint.url: Invalid value"),
    ("reward model without name", with_spec(reward={"model": {"placement": "separate"}}),
     "spec.reward.model.name: Required value"),
    ("unknown algorithm", with_spec(algorithm__name="dpo"), 'Unsupported value: "dpo"'),
    ("ppo settings on grpo", with_spec(algorithm__ppo={"gamma": 0.99}),
     "algorithm.ppo (GAE and critic settings) applies to algorithm.name 'ppo' only"),
    ("critic on grpo", with_spec(critic={"placement": "separate"}),
     "spec.critic applies to algorithm.name 'ppo' only"),
    ("kl in reward with grpo", with_spec(algorithm__klMode="reward"),
     "algorithm.klMode 'reward' applies to ppo, rloo and reinforce++"),
    ("clip-higher below clip", with_spec(algorithm__clipRatio=0.2, algorithm__clipRatioHigh=0.1),
     "algorithm.clipRatioHigh must be at least algorithm.clipRatio"),
    ("rloo needs groups", with_spec(algorithm__name="rloo", rollout__sampling__samplesPerPrompt=1),
     "RLOO needs rollout.sampling.samplesPerPrompt >= 2"),
    ("bad loss aggregation", with_spec(algorithm__lossAggregation="batch"), 'Unsupported value: "batch"'),
    ("reference placed without kl", with_spec(reference={"placement": "separate"}, algorithm__klCoef=0),
     "spec.reference.placement other than 'trainer' needs algorithm.klCoef > 0"),
    ("output volume missing", with_spec(output={"volume": "out", "path": "/out"}),
     "output.volume must name a volume in spec.volumes"),
    ("env value and valueFrom", with_spec(env=[{"name": "T", "value": "x",
                                               "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}}]),
     "env[].value and env[].valueFrom are exclusive"),
    ("env valueFrom with two sources", with_spec(env=[{"name": "T", "valueFrom": {
        "secretKeyRef": {"name": "s", "key": "k"}, "configMapKeyRef": {"name": "c", "key": "k"}}}]),
     "env[].valueFrom needs exactly one of secretKeyRef or configMapKeyRef"),
    ("envFrom with two sources", with_spec(envFrom=[{"secretRef": {"name": "s"}, "configMapRef": {"name": "c"}}]),
     "envFrom[] needs exactly one of secretRef or configMapRef"),
    ("role gpus above gpus per node", with_spec(reward={"rule": "length", "model": {"name": "rm", "gpusPerReplica": 9}}),
     "reward.model, critic and reference gpusPerReplica must not exceed placement.gpusPerNode"),
    ("eval from another configmap", with_spec(data__eval={"configMap": {"name": "other", "key": "e.jsonl"}}),
     "data.eval.configMap must name the ConfigMap of data.configMap"),
    ("eval set with two sources", with_spec(data__eval={"prompts": ["a"], "path": "/e.jsonl"}),
     "data.eval needs exactly one of prompts, configMap or path"),
    ("regex without pattern", with_spec(reward={"rule": "regex"}), "reward.rule 'regex' needs reward.pattern"),
    ("bad reward hook", with_spec(reward={"function": "not a hook"}), "spec.reward.function: Invalid value"),
    ("checkpoint volume missing", with_spec(checkpoint={"volume": "ckpt", "path": "/ckpt"}),
     "checkpoint.volume must name a volume in spec.volumes"),
    ("checkpoint uri and path", with_spec(checkpoint={"uri": "s3://ckpt/run1", "volume": "data", "path": "/ckpt"}),
     "checkpoint needs either uri (object storage: s3://bucket/prefix) or volume and path, not both"),
    ("checkpoint neither uri nor path", with_spec(checkpoint={"everyNSteps": 5}),
     "checkpoint needs either uri (object storage: s3://bucket/prefix) or volume and path, not both"),
    ("checkpoint storage without uri", with_spec(checkpoint={"volume": "data", "path": "/ckpt",
                                                             "storage": {"endpoint": "http://s3:8333"}}),
     "checkpoint.storage is only for a checkpoint.uri"),
    ("checkpoint uri not an object store", with_spec(checkpoint={"uri": "/data/ckpt"}),
     "spec.checkpoint.uri: Invalid value"),
    ("output uri and path", with_spec(output={"uri": "s3://models/run1", "volume": "data", "path": "/models"}),
     "output needs either uri (object storage: s3://bucket/prefix) or volume and path, not both"),
    ("output storage without uri", with_spec(output={"volume": "data", "path": "/m", "storage": {"region": "x"}}),
     "output.storage is only for a output.uri"),
    ("checkpoint and output storages differ", with_spec(
        checkpoint={"uri": "s3://ckpt/run1", "storage": {"endpoint": "http://a:8333"}},
        output={"uri": "s3://models/run1", "storage": {"endpoint": "http://b:8333"}}),
     "checkpoint.storage and output.storage must be the same when both are set"),
    ("data path neither absolute nor an object store", with_spec(data={"path": "ftp://host/prompts.jsonl"}),
     "spec.data.path: Invalid value"),
    ("checkpoint storage endpoint not http", with_spec(checkpoint={"uri": "s3://ckpt/run1",
                                                                   "storage": {"endpoint": "s3.local:8333"}}),
     "spec.checkpoint.storage.endpoint: Invalid value"),
    ("gpu memory above 1", with_spec(rollout__gpuMemoryUtilization=1.5), "spec.rollout.gpuMemoryUtilization: Invalid value: 1.5"),
    ("negative temperature", with_spec(rollout__sampling__temperature=-1), "spec.rollout.sampling.temperature: Invalid value: -1"),
    ("lora with fsdp2", with_spec(trainer__strategy="fsdp2", trainer__gpusPerReplica=2, trainer__lora={}),
     "trainer.lora trains the adapter in one process: use trainer.strategy 'single'"),
    ("autocast without master weights", with_spec(trainer__autocast=True, trainer__masterWeights="none"),
     "trainer.autocast keeps the trained weights in float32"),
    ("lora with async", with_spec(trainer__lora={}, weightSync__mode="async"),
     "trainer.lora needs weightSync.mode 'sync'"),
    ("lora with expert parallel", with_spec(trainer__lora={}, rollout__expertParallel=True),
     "trainer.lora cannot be combined with rollout.expertParallel"),
    ("metrics port on a ray port", with_spec(head__metricsPort=8265),
     "head.metricsPort must not be one of Ray's ports on the head pod"),
    ("lora on lm_head", with_spec(trainer__lora={"targetModules": ["q_proj", "lm_head"]}),
     "vLLM serves no LoRA adapter on lm_head or embed_tokens"),
    ("lora rank above 256", with_spec(trainer__lora={"rank": 512}), "spec.trainer.lora.rank: Invalid value: 512"),
    ("lora without targets", with_spec(trainer__lora={"targetModules": []}), "spec.trainer.lora.targetModules"),
    ("lora duplicate targets", with_spec(trainer__lora={"targetModules": ["q_proj", "q_proj"]}),
     "spec.trainer.lora.targetModules[1]: Duplicate value"),
    ("tracking with no tracker", with_spec(tracking={"samples": 2}),
     "tracking needs at least one of tensorboard, mlflow or wandb"),
    ("tensorboard on no volume", with_spec(tracking={"tensorboard": {"volume": "runs", "path": "/runs"}}),
     "tracking.tensorboard.volume must name a volume in spec.volumes"),
    ("wandb online without a key", with_spec(tracking={"wandb": {"project": "p"}}),
     "tracking.wandb.apiKeySecret is needed unless mode is offline"),
    ("wandb offline without a volume", with_spec(tracking={"wandb": {"project": "p", "mode": "offline"}}),
     "tracking.wandb with mode offline needs volume and path"),
    ("mlflow uri not http", with_spec(tracking={"mlflow": {"trackingUri": "mlflow:5000"}}),
     "spec.tracking.mlflow.trackingUri: Invalid value"),
    ("tool without a schema", with_spec(environment={"tools": [{"name": "python", "builtin": "python"}]}),
     "spec.environment.tools[0].parameters: Required value"),
    ("tool names not unique", with_spec(environment={"tools": [
        {"name": "f", "function": "m:f", "parameters": {"type": "object"}},
        {"name": "f", "function": "m:g", "parameters": {"type": "object"}}]}),
     "spec.environment.tools[1]: Duplicate value"),
    ("tool both builtin and function", with_spec(environment={"tools": [
        {"name": "f", "function": "m:f", "builtin": "python", "parameters": {"type": "object"}}]}),
     "a tool takes exactly one of function"),
    ("unknown tool parser", with_spec(environment={"className": "m:Env", "toolParser": "regex"}),
     'Unsupported value: "regex"'),
    ("zero turns", with_spec(environment={"className": "m:Env", "maxTurns": 0}),
     "spec.environment.maxTurns: Invalid value: 0"),
    ("environment with nothing", with_spec(environment={}), "spec.environment needs tools, className or http"),
    ("environment async with syncs rarer than the staleness bound", with_spec(
        environment={"className": "m:Env"}, weightSync__mode="async", weightSync__everyNSteps=3),
     "needs weightSync.everyNSteps <= weightSync.maxStaleness + 1"),
    ("max staleness without an environment", with_spec(weightSync__mode="async", weightSync__maxStaleness=2),
     "weightSync.maxStaleness applies to multi-turn rollouts (spec.environment) in weightSync.mode 'async' only"),
    ("max staleness in sync mode", with_spec(environment={"className": "m:Env"}, weightSync__maxStaleness=0),
     "weightSync.maxStaleness applies to multi-turn rollouts"),
    ("negative max staleness", with_spec(environment={"className": "m:Env"}, weightSync__mode="async",
                                         weightSync__maxStaleness=-1), "spec.weightSync.maxStaleness: Invalid value"),
    ("environment class not module:Class", with_spec(environment={"className": "my_env"}),
     "spec.environment.className: Invalid value"),
    ("http environment with url and server", with_spec(environment={"http": {
        "url": "http://env:8000", "server": {"image": "env:1"}}}), "environment.http takes exactly one of url"),
    ("reward without a source", with_spec(reward={"normalize": "batch"}), "reward needs a source"),
    ("missing model", with_spec(model=DELETE), "spec.model: Required value"),
    ("missing image", with_spec(image=DELETE), "spec.image: Required value"),
]


@pytest.mark.parametrize("name,obj,message", INVALID, ids=[c[0] for c in INVALID])
def test_invalid_spec_is_rejected(cluster, name, obj, message) -> None:
    out = apply(cluster, obj, "default", "--dry-run=server", check=False)
    assert out.returncode != 0, f"{name}: accepted but should be rejected"
    assert message in out.stderr, f"{name}: expected {message!r} in:\n{out.stderr}"


def test_long_name_is_rejected(cluster) -> None:
    job = base()
    job["metadata"]["name"] = "x" * 41
    out = apply(cluster, job, "default", "--dry-run=server", check=False)
    assert out.returncode != 0 and "RLHFJob names are at most 40 characters" in out.stderr


def test_valid_samples_pass_admission(cluster) -> None:
    for sample in ("separate-nccl-tp2", "colocated-ipc-dp", "async-pause-resume", "multinode-trainer",
                   "moe-expert-parallel", "ppo-reward-model", "lora-adapter-sync", "agent-python-tool"):
        out = apply(cluster, load_sample(sample), "default", "--dry-run=server", check=False)
        assert out.returncode == 0, f"{sample}: {out.stderr}"


def test_environment_in_async_mode_passes_admission(cluster) -> None:
    """Multi-turn rollouts across async weight syncs, with the staleness bound at its default and raised to
    allow rarer syncs."""
    for weight_sync in ({"mode": "async"}, {"mode": "async", "everyNSteps": 3, "maxStaleness": 2}):
        job = with_spec(environment={"className": "m:Env"}, **{f"weightSync__{k}": v for k, v in weight_sync.items()})
        out = apply(cluster, job, "default", "--dry-run=server", check=False)
        assert out.returncode == 0, f"{weight_sync}: {out.stderr}"


def test_object_store_checkpoint_passes_admission(cluster) -> None:
    """spec.checkpoint.uri with its storage (no volume needed), a bare uri (the pods' own identity), and
    spec.output.uri beside it with the same storage, and data.path in a bucket."""
    for ckpt in ({"uri": "s3://ckpt-bucket/runs/a", "everyNSteps": 5,
                  "storage": {"endpoint": "http://seaweedfs.storage.svc:8333", "region": "eu-west-1",
                              "credentialsSecret": "s3-creds"}},
                 {"uri": "gs://ckpt-bucket"}):
        out = apply(cluster, with_spec(checkpoint=ckpt), "default", "--dry-run=server", check=False)
        assert out.returncode == 0, f"{ckpt}: {out.stderr}"
    storage = {"endpoint": "http://seaweedfs:8333", "credentialsSecret": "s3-creds"}
    both = with_spec(checkpoint={"uri": "s3://ckpt/a", "storage": storage},
                     output={"uri": "s3://models/a", "everyNSteps": 50, "storage": dict(storage)})
    both["spec"]["data"] = {"path": "s3://prompts/gsm8k/train.parquet"}  # data from the bucket too
    out = apply(cluster, both, "default", "--dry-run=server", check=False)
    assert out.returncode == 0, out.stderr


def test_immutable_fields_are_rejected_on_update(cluster) -> None:
    job = base()
    job["metadata"]["name"] = "immut"
    apply(cluster, job, "default")
    try:
        for field, value, message in [
            ("rollout", {"engines": 1, "tensorParallelSize": 1}, "spec.rollout cannot change on a submitted job"),
            ("rollout", {**job["spec"]["rollout"], "expertParallel": True}, "spec.rollout cannot change"),
            ("placement", {"mode": "separate", "gpusPerNode": 4}, "spec.placement cannot change"),
            ("model", {"name": "other/model"}, "spec.model cannot change"),
            ("image", "other:1", "spec.image cannot change"),
            ("env", [{"name": "A", "value": "1"}], "spec.env cannot change"),
            ("algorithm", {**job["spec"]["algorithm"], "learningRate": 0.5}, "spec.algorithm.learningRate cannot"),
            ("volumes", [{"name": "v", "emptyDir": {}}], "spec.volumes cannot change"),
        ]:
            changed = copy.deepcopy(job)
            changed["spec"][field] = value
            out = apply(cluster, changed, "default", check=False)
            assert out.returncode != 0 and message in out.stderr, (field, out.stderr)
        # An allowed change goes through.
        more = copy.deepcopy(job)
        more["spec"]["algorithm"]["steps"] = 400
        more["spec"]["suspend"] = True
        more["spec"]["activeDeadlineSeconds"] = 3600
        more["spec"]["ttlSecondsAfterFinished"] = 60
        more["spec"]["backoffLimit"] = 2
        more["spec"]["progressDeadlineSeconds"] = 900
        out = apply(cluster, more, "default", check=False)
        assert out.returncode == 0, out.stderr
    finally:
        cluster.kubectl("delete", "rlhfjob", "immut", "-n", "default", "--wait=false", check=False)


def test_change_inside_a_volume_is_rejected(cluster) -> None:
    """Volumes keep unknown fields (any core/v1 volume source): a change inside one is still a change."""
    job = base()
    job["metadata"]["name"] = "immut-vol"
    job["spec"]["volumes"] = [{"name": "ckpt", "hostPath": {"path": "/a"}}]
    apply(cluster, job, "default")
    try:
        changed = copy.deepcopy(job)
        changed["spec"]["volumes"][0]["hostPath"]["path"] = "/b"
        out = apply(cluster, changed, "default", check=False)
        assert out.returncode != 0 and "spec.volumes cannot change" in out.stderr, out.stderr
    finally:
        cluster.kubectl("delete", "rlhfjob", "immut-vol", "-n", "default", "--wait=false", check=False)
