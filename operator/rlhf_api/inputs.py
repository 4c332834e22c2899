"""The RLHFJob spec's inputs and surroundings: data, reward, the separate roles (reward model, critic,
reference), object storage, output and checkpoints, tracking, scheduling and the pods' environment. Imports only
pydantic."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import ConfigDict, Field

from rlhf_api.base import (
    LABEL_KEY_PATTERN,
    LABEL_VALUE_PATTERN,
    Model,
    cel,
    sub,
)
from rlhf_api.training import Resources


# ------------------------------------------------------------------------------------------ data/reward
class ConfigMapKey(Model):
    name: str = Field(min_length=1, max_length=253, description="ConfigMap name (same namespace).")
    key: str = Field("prompts.jsonl", min_length=1, max_length=253, description="Key holding the prompts.")


#: ``data.path``: an absolute path, or an object-store URI (``s3://bucket/key``; ``gs://``).
DATA_PATH = r"^(/|(s3|gs)://[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]/[^\s]+$)"


class Data(Model):
    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                cel(
                    "(has(self.prompts) ? 1 : 0) + (has(self.configMap) ? 1 : 0) + (has(self.path) ? 1 : 0) == 1",
                    "data needs exactly one of prompts, configMap or path",
                )
            ]
        }
    )
    prompts: list[str] | None = Field(
        None, min_length=1, max_length=10000, description="Inline prompts (for small jobs and tests)."
    )
    config_map: ConfigMapKey | None = Field(
        None, description="Prompts from a ConfigMap key: JSON lines with a 'prompt' string or chat 'messages' "
        "([{role, content}], rendered with the tokenizer's chat template), or plain lines."
    )
    path: str | None = Field(
        None, pattern=DATA_PATH, max_length=4096,
        description="Absolute path on a mounted volume (or an object-store URI, s3://bucket/key, downloaded to the "
        "head pod first with the job's storage: checkpoint.storage or output.storage) of: a prompts file (JSON "
        "lines or text, as for configMap; a "
        "Parquet file; an Arrow file), a folder of Parquet files (e.g. a hub dataset's data/ folder) or a folder "
        "written by Hugging Face datasets' save_to_disk (one split). Read in record batches into a memory-mapped "
        "cache on the head pod's disk: memory is bounded by a batch, not by the file.",
    )
    prompt_field: str = Field(
        "prompt", min_length=1, max_length=256,
        description="Field (JSON lines) or column (Parquet, Arrow) with the prompt text. A 'messages' field or "
        "column (chat conversations) is used instead where a sample has one.")
    answer_field: str = Field("answer", min_length=1, max_length=256,
                              description="Field or column with the reference answer, if any.")
    invalid_samples: Literal["drop", "fail"] = Field(
        "drop",
        description="Before the first step every sample is checked against what the run can take: its rendered "
        "prompt plus rollout.sampling.maxTokens within the engines' context (rollout.maxModelLen, else the model's), "
        "and an answer where spec.reward needs one (exactMatch, contains, math without reward.target). drop: such "
        "samples are left out, counted in status.data with the first lines named (and a Warning Event); fail: the "
        "job fails before training, naming them. Malformed files fail either way.")
    eval: EvalData | None = Field(
        None, description="A held-out eval set: every evalEveryNSteps steps each of its prompts is answered greedily "
        "(one sample, temperature 0) by the synced engines and scored by spec.reward; the mean is status.eval.")
    eval_every_n_steps: int = Field(10, ge=1, le=1_000_000, description="Evaluate every N training steps (and "
                                    "after the last).")
    eval_on_start: bool = Field(False, description="Also evaluate before the first step of a run that starts from "
                                "step 0 (status.eval at step 0): the starting policy's score, the baseline of the "
                                "later evals. A run resumed from a checkpoint keeps the every-N schedule.")


class EvalData(Model):
    model_config = ConfigDict(json_schema_extra={"x-kubernetes-validations": [cel(
        "(has(self.prompts) ? 1 : 0) + (has(self.configMap) ? 1 : 0) + (has(self.path) ? 1 : 0) == 1",
        "data.eval needs exactly one of prompts, configMap or path")]})
    prompts: list[str] | None = Field(None, min_length=1, max_length=10000, description="Inline eval prompts.")
    config_map: ConfigMapKey | None = Field(
        None, description="Eval prompts from a ConfigMap key (same formats as data.configMap; mount as for it).")
    path: str | None = Field(None, pattern=DATA_PATH, max_length=4096,
                             description="Absolute path of an eval file (or s3://bucket/key, as for data.path).")
    max_prompts: int = Field(64, ge=1, le=100_000, description="Use at most the first N eval prompts (file order).")


class RolePlacement(Model):
    """Where a model of its own (reward model, critic, reference) runs."""

    placement: Literal["colocated", "separate"] = Field(
        "colocated",
        description="colocated: on the trainer's GPUs (an actor beside each trainer worker shares its GPU). "
        "separate: a worker group of its own (replicas pods x gpusPerReplica GPUs).",
    )
    replicas: int = Field(1, ge=1, le=512, description="separate: pods of this role.")
    gpus_per_replica: int = Field(
        1, ge=0, le=16,
        description="separate: GPUs per pod, one worker per GPU. Ignored (0) for a CPU-only job "
        "(trainer.gpusPerReplica 0).",
    )
    resources: Resources = sub(Resources, "separate: CPU and memory per pod of this role.")


class RewardModel(RolePlacement):
    name: str = Field(
        min_length=1, max_length=512,
        description="A Hugging Face sequence-classification model with one label (its logit is the score; "
        "e.g. a reward model trained on preferences), as a hub id or an absolute path inside the pods. It scores "
        "the prompt followed by the completion.",
    )
    revision: str | None = Field(None, max_length=128, description="Hub revision (branch, tag or commit).")
    placement: Literal["colocated", "separate"] = Field(
        "separate",
        description="separate (default): a worker group of its own (replicas pods x gpusPerReplica GPUs, one "
        "scoring worker per GPU). colocated: one scoring worker beside each trainer worker, on its GPU.",
    )
    weight: float = Field(1.0, ge=-1000, le=1000, description="Weight of this source in the combined reward.")
    batch_size: int = Field(16, ge=1, le=4096, description="Samples scored per forward pass.")


class RewardEndpoint(Model):
    url: str = Field(
        pattern=r"^https?://\S+$", max_length=2048,
        description="HTTP(S) endpoint. It receives POST {\"prompts\": [...], \"completions\": [...], \"answers\": "
        "[... or null]} (JSON) and answers {\"rewards\": [one number per completion]}.",
    )
    timeout_seconds: float = Field(30, gt=0, le=3600, description="Deadline of one request.")
    retries: int = Field(3, ge=0, le=100, description="Retries of a failed or timed-out request (with backoff).")
    batch_size: int = Field(64, ge=1, le=65536, description="Completions per request.")
    weight: float = Field(1.0, ge=-1000, le=1000, description="Weight of this source in the combined reward.")


class Reward(Model):
    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                cel("!has(self.rule) || !has(self.function)",
                    "reward takes rule or function, not both (use model or endpoint to combine sources)"),
                cel(
                    "!has(self.rule) || self.rule != 'regex' || has(self.pattern)",
                    "reward.rule 'regex' needs reward.pattern",
                ),
                cel(
                    "!has(self.rule) || self.rule != 'exactMatch' || has(self.target)",
                    "reward.rule 'exactMatch' needs reward.target (or answers in the data)",
                ),
            ]
        }
    )
    rule: Literal["exactMatch", "contains", "regex", "length", "math"] | None = Field(
        None,
        description="Built-in rule: exactMatch/contains compare with target (or the sample's answer), regex "
        "matches pattern, length rewards closeness to targetLength tokens, math scores 1 when the completion's "
        "final answer is mathematically equal to the sample's answer (or target) by Hugging Face's math-verify "
        "(LaTeX and \\boxed{} answers, 1/2 = 0.5 = \\frac{1}{2}, percentages as fractions, sets and intervals), else 0.",
    )
    target: str | None = Field(None, max_length=65536, description="Target text for exactMatch/contains.")
    pattern: str | None = Field(None, max_length=4096, description="Regular expression for the regex rule.")
    target_length: int = Field(64, ge=1, description="Target completion length in tokens for the length rule.")
    math_timeout_seconds: int = Field(
        5, ge=1, le=60,
        description="Time limit of one math rule check (parsing and comparison, in a worker process): past it the "
        "sample scores 0 with a warning, so a pathological answer cannot stall a step.",
    )
    function: str | None = Field(
        None,
        pattern=r"^[A-Za-z_][A-Za-z0-9_.]*:[A-Za-z_][A-Za-z0-9_]*$",
        description="User hook 'module:function' importable in the runtime image; called as "
        "fn(prompt: str, completion: str, answer: str | None) -> float.",
    )
    rule_weight: float = Field(
        1.0, ge=-1000, le=1000, description="Weight of rule or function in the combined reward."
    )
    model: RewardModel | None = Field(None, description="A reward model on GPUs (its own worker group or colocated).")
    endpoint: RewardEndpoint | None = Field(None, description="A remote reward service over HTTP.")
    normalize: Literal["none", "batch"] = Field(
        "none",
        description="none: the combined reward as is. batch: standardised over the step's samples (mean 0, std 1) "
        "before advantages; status.throughput.rewardMean stays the raw mean.",
    )

    def sources(self) -> list[str]:
        return [n for n, present in (("rule", self.rule or self.function), ("model", self.model),
                                     ("endpoint", self.endpoint)) if present]


class Critic(RolePlacement):
    model: str | None = Field(
        None, min_length=1, max_length=512,
        description="Model the critic starts from (hub id or absolute path); its language-model head is replaced by "
        "a value head. Unset: the policy's spec.model.name.",
    )


class Reference(RolePlacement):
    placement: Literal["trainer", "colocated", "separate"] = Field(
        "trainer",
        description="Where the frozen reference policy (loaded only when algorithm.klCoef > 0) computes its "
        "log-probabilities. trainer: inside each trainer worker (no extra actor; with trainer.strategy fsdp2 "
        "sharded over the trainer GPUs like the policy). colocated: an actor of its own "
        "beside each trainer worker, on its GPU. separate: a worker group of its own.",
    )


OBJECT_URI = r"^(s3|gs)://[a-z0-9][a-z0-9.-]{1,61}[a-z0-9](/[^\s]*)?$"


class ObjectStorage(Model):
    endpoint: str | None = Field(
        None, pattern=r"^https?://", max_length=2048,
        description="The S3 API endpoint of an S3-compatible server (e.g. http://seaweedfs.storage.svc:8333); "
        "rendered as AWS_ENDPOINT_URL_S3 into every head and worker container. Unset: AWS S3 (or GCS/Azure by "
        "the URI's scheme).",
    )
    region: str | None = Field(None, min_length=1, max_length=64, description="Region (AWS_REGION); unset: us-east-1.")
    credentials_secret: str | None = Field(
        None, min_length=1, max_length=253,
        description="A Secret whose keys become the environment of every head and worker container (the trainers "
        "write): AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (optionally AWS_SESSION_TOKEN); for gs:// "
        "GOOGLE_SERVICE_ACCOUNT_KEY. Unset: the pods' own identity.",
    )


def _location_rules(field: str) -> list[dict[str, str]]:
    """``spec.checkpoint`` / ``spec.output``: a volume path or an object-store URI, exactly one."""
    return [
        cel("has(self.uri) ? !has(self.volume) && !has(self.path) : has(self.volume) && has(self.path)",
            f"{field} needs either uri (object storage: s3://bucket/prefix) or volume and path, not both"),
        cel("!has(self.storage) || has(self.uri)", f"{field}.storage is only for a {field}.uri",
            fieldPath=".storage"),
    ]


class Output(Model):
    model_config = ConfigDict(json_schema_extra={"x-kubernetes-validations": _location_rules("output")})

    volume: str | None = Field(None, min_length=1, max_length=63, description="Name of a volume in spec.volumes.")
    path: str | None = Field(
        None, pattern=r"^/", max_length=4096,
        description="Directory inside the pods (mount the volume there) where the trained model is written in "
        "Hugging Face format (save_pretrained, safetensors, config, tokenizer): <path>/final at the end, "
        "<path>/step-<N> every everyNSteps steps if set. status.output names the newest.",
    )
    uri: str | None = Field(
        None, pattern=OBJECT_URI, max_length=2048,
        description="Object storage instead of volume and path: s3://bucket/prefix (or gs://bucket/prefix). The export is "
        "uploaded to <uri>/final (and <uri>/step-<N>), its _COMPLETE object last: a prefix without one is an "
        "export in progress or cut short.",
    )
    storage: ObjectStorage | None = Field(
        None, description="Endpoint and credentials of uri's object store (the same as checkpoint.storage when "
        "both are set).")
    every_n_steps: int | None = Field(None, ge=1, description="Also export every N steps (unset: only at the end).")

    @property
    def location(self) -> str:
        return self.uri or self.path or ""


class Checkpoint(Model):
    model_config = ConfigDict(json_schema_extra={"x-kubernetes-validations": _location_rules("checkpoint")})

    volume: str | None = Field(None, min_length=1, max_length=63, description="Name of a volume in spec.volumes.")
    path: str | None = Field(None, pattern=r"^/", max_length=4096,
                             description="Directory inside the pods (mount it there).")
    uri: str | None = Field(
        None, pattern=OBJECT_URI, max_length=2048,
        description="Object storage instead of volume and path: s3://bucket/prefix (or gs://bucket/prefix). Each step's "
        "files are uploaded first and a state.json marker last, so a save killed midway is no checkpoint; the job "
        "resumes from the newest step with a marker (every trainer rank downloads the one rank 0 found).",
    )
    storage: ObjectStorage | None = Field(None, description="Endpoint and credentials of uri's object store.")
    every_n_steps: int = Field(10, ge=1, description="Save every N steps; a restarted job resumes from the newest.")

    @property
    def location(self) -> str:
        return self.uri or self.path or ""


# -------------------------------------------------------------------------------------------- tracking
class SecretKeySelector(Model):
    name: str = Field(min_length=1, max_length=253, description="Secret name (same namespace).")
    key: str = Field(min_length=1, max_length=253, description="Key within it.")


class TensorBoardTracking(Model):
    volume: str = Field(min_length=1, max_length=63, description="Name of a volume in spec.volumes, mounted on the "
                        "head pod (spec.volumeMounts) at path or above it.")
    path: str = Field(
        pattern=r"^/", max_length=4096,
        description="Directory inside the pods: the driver writes TensorBoard event files to <path>/<job name>, so "
        "several jobs on one volume are runs of one TensorBoard (tensorboard --logdir <path>). A retried run "
        "continues the same directory; steps after its checkpoint are dropped from the earlier run's curves.",
    )


class MLflowTracking(Model):
    tracking_uri: str = Field(
        pattern=r"^https?://", max_length=2048,
        description="The MLflow tracking server (http:// or https://), e.g. http://mlflow.mlops.svc:5000.",
    )
    experiment: str | None = Field(
        None, min_length=1, max_length=500,
        description="Experiment name (created when missing). Unset: the job's namespace.",
    )
    credentials_secret: str | None = Field(
        None, min_length=1, max_length=253,
        description="A Secret whose keys become the head pod's environment, where the driver runs: "
        "MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD, or MLFLOW_TRACKING_TOKEN (and e.g. AWS_* for an "
        "artifact store the client writes to directly). Only the head pod gets it.",
    )


class WandbTracking(Model):
    model_config = ConfigDict(json_schema_extra={"x-kubernetes-validations": [
        cel("self.mode == 'offline' || has(self.apiKeySecret)",
            "tracking.wandb.apiKeySecret is needed unless mode is offline", fieldPath=".apiKeySecret"),
        cel("self.mode != 'offline' || (has(self.volume) && has(self.path))",
            "tracking.wandb with mode offline needs volume and path: the run files would be lost with the pod",
            fieldPath=".path"),
        cel("has(self.volume) == has(self.path)", "tracking.wandb.volume and path go together", fieldPath=".path"),
    ]})
    project: str = Field(min_length=1, max_length=128, description="W&B project.")
    entity: str | None = Field(None, min_length=1, max_length=128, description="W&B entity (team or user).")
    group: str | None = Field(None, min_length=1, max_length=128, description="W&B run group.")
    mode: Literal["online", "offline"] = Field(
        "online", description="online: sync to the server as the run goes. offline: write the run files to "
        "<path>/wandb only (upload them later with wandb sync).")
    api_key_secret: SecretKeySelector | None = Field(
        None, description="The Secret key holding the W&B API key (WANDB_API_KEY of the head pod only).")
    base_url: str | None = Field(None, pattern=r"^https?://", max_length=2048,
                                 description="A self-hosted W&B server (WANDB_BASE_URL). Unset: W&B's cloud.")
    volume: str | None = Field(None, min_length=1, max_length=63,
                               description="A volume in spec.volumes for the run files (needed with mode offline).")
    path: str | None = Field(None, pattern=r"^/", max_length=4096,
                             description="Directory inside the pods for the run files (<path>/wandb/...).")


class Tracking(Model):
    model_config = ConfigDict(json_schema_extra={"x-kubernetes-validations": [
        cel("has(self.tensorboard) || has(self.mlflow) || has(self.wandb)",
            "tracking needs at least one of tensorboard, mlflow or wandb"),
    ]})
    tensorboard: TensorBoardTracking | None = Field(None, description="TensorBoard event files on a volume.")
    mlflow: MLflowTracking | None = Field(None, description="An MLflow tracking server.")
    wandb: WandbTracking | None = Field(None, description="Weights & Biases.")
    samples_every_n_steps: int = Field(
        10, ge=0, le=1_000_000,
        description="Every N steps also log a table of a few prompts, completions and rewards (0: never).")
    samples: int = Field(4, ge=1, le=256, description="Rows in each sample table.")


# ------------------------------------------------------------------------------------------ scheduling
class Toleration(Model):
    model_config = ConfigDict(json_schema_extra={"x-kubernetes-validations": [
        cel("has(self.key) || (has(self.operator) && self.operator == 'Exists')",
            "a toleration without a key must have operator Exists (it then tolerates every taint)"),
        cel("!has(self.operator) || self.operator != 'Exists' || !has(self.value) || self.value == ''",
            "a toleration with operator Exists must not have a value", fieldPath=".value"),
    ]})
    key: str | None = Field(None, description="Taint key.")
    operator: Literal["Exists", "Equal"] | None = Field(None, description="Exists or Equal.")
    value: str | None = Field(None, description="Taint value.")
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = Field(None, description="Taint effect.")
    toleration_seconds: int | None = Field(None, description="For NoExecute: how long to stay bound.")


class Scheduling(Model):
    node_selector: dict[str, Annotated[str, Field(max_length=63, pattern=LABEL_VALUE_PATTERN)]] | None = Field(
        None,
        description="Node labels every pod of the job requires.",
        json_schema_extra={"maxProperties": 64, "x-kubernetes-validations": [cel(
            "self.all(k, size(k) <= 316 && k.matches('" + LABEL_KEY_PATTERN.replace("\\", "\\\\") + "'))",
            "scheduling.nodeSelector keys must be label keys ([prefix/]name, name at most 63 characters of "
            "letters, digits, '-', '_', '.')")]},
    )
    tolerations: list[Toleration] | None = Field(None, max_length=64, description="Tolerations for every pod.")
    priority_class_name: str | None = Field(None, max_length=253, description="PriorityClass for every pod.")
    queue_name: str | None = Field(
        None, max_length=63, pattern=LABEL_VALUE_PATTERN,
        description="Kueue LocalQueue: the RayJob is created suspended with label kueue.x-k8s.io/queue-name and runs "
        "when Kueue admits it (phase Pending, reason Queued, until then; Suspended, reason Preempted, if Kueue "
        "preempts it later, until it is admitted again).",
    )


class KeyRef(Model):
    name: str = Field(min_length=1, max_length=253, description="Secret or ConfigMap name (same namespace).")
    key: str = Field(min_length=1, max_length=253, description="Key within it.")
    optional: bool = Field(False, description="Start the pods even if it is missing.")


class EnvVarSource(Model):
    model_config = ConfigDict(json_schema_extra={"x-kubernetes-validations": [cel(
        "has(self.secretKeyRef) != has(self.configMapKeyRef)",
        "env[].valueFrom needs exactly one of secretKeyRef or configMapKeyRef")]})
    secret_key_ref: KeyRef | None = Field(
        None, description="A key of a Secret (e.g. HF_TOKEN for a gated model): the kubelet sets it in every "
        "container; the operator and the runtime never read the value.")
    config_map_key_ref: KeyRef | None = Field(None, description="A key of a ConfigMap.")


class EnvVar(Model):
    model_config = ConfigDict(json_schema_extra={"x-kubernetes-validations": [cel(
        "!has(self.valueFrom) || !has(self.value) || self.value == ''",
        "env[].value and env[].valueFrom are exclusive", fieldPath=".valueFrom")]})
    name: str = Field(pattern=r"^[A-Za-z_][A-Za-z0-9_.-]*$", max_length=256, description="Variable name.")
    value: str = Field("", description="Literal value.")
    value_from: EnvVarSource | None = Field(None, description="Take the value from a Secret or ConfigMap key.")


class NameRef(Model):
    name: str = Field(min_length=1, max_length=253, description="Secret or ConfigMap name (same namespace).")
    optional: bool = Field(False, description="Start the pods even if it is missing.")


class EnvFromSource(Model):
    model_config = ConfigDict(json_schema_extra={"x-kubernetes-validations": [cel(
        "has(self.secretRef) != has(self.configMapRef)", "envFrom[] needs exactly one of secretRef or configMapRef")]})
    prefix: str | None = Field(None, max_length=256, pattern=r"^[A-Za-z_][A-Za-z0-9_.-]*$",
                               description="Prefix for every variable name.")
    secret_ref: NameRef | None = Field(None, description="Every key of a Secret as a variable.")
    config_map_ref: NameRef | None = Field(None, description="Every key of a ConfigMap as a variable.")


class VolumeMount(Model):
    name: str = Field(max_length=63, description="Volume name (from spec.volumes).")
    mount_path: str = Field(pattern=r"^/", description="Where to mount it in every container.")
    read_only: bool = Field(False, description="Mount read-only.")
    sub_path: str | None = Field(None, description="Sub-path of the volume.")


VOLUME_SCHEMA = {
    "type": "object",
    "x-kubernetes-preserve-unknown-fields": True,
    "required": ["name"],
    "properties": {"name": {"type": "string", "maxLength": 63, "description": "Volume name."}},
    "description": "A core/v1 Volume (e.g. persistentVolumeClaim, hostPath, nfs), added to every pod.",
}
