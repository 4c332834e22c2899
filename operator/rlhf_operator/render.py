"""Pure rendering: an RLHFJob spec -> the ConfigMap and KubeRay RayJob that run it.

Why a RayJob (with an embedded RayCluster spec) rather than a RayCluster plus our own submitter: KubeRay then
owns the driver's lifecycle (submission, retries, ``activeDeadlineSeconds``, deleting the cluster when the
job ends so GPUs are freed), and Kueue admits RayJobs natively (queue label + ``suspend``). The operator keeps
what KubeRay does not know: GPU layout per role, the runtime's configuration, and RL-level status.

Layout (GPUs per pod = ``nvidia.com/gpu`` request = Ray ``num-gpus``):

* head: no GPUs, ``num-cpus: 0`` so no actor lands on it; the driver runs there. Sized by ``spec.head.resources``.
* submitter: KubeRay's pod that runs ``ray job submit`` (``submitterPodTemplate``), sized by
  ``spec.head.submitter`` (KubeRay's own default asks 500m CPU, more than a small node spares).
* worker groups, from ``rlhf_api.groups.worker_groups`` (the one model of them the runtime's placement shares):
  ``separate``: ``trainer`` and ``rollout`` (one pod per engine keeps a TP group on one node); ``colocated``:
  one group ``colocated``, each GPU holding a trainer worker and an engine shard (Ray shares it with fractional
  GPUs); and one group per role with a model of its own and ``placement: separate`` (``reward`` / ``critic`` /
  ``reference``). A colocated role needs no group: its actors share the trainer workers' GPUs
  (``rlhf_runtime.infra.placement``).

Each worker advertises its group's Ray custom resource (``rlhf_api.groups.resource``: ``rlhf_<group name>``)
equal to its GPU count (1 on a pod without GPUs), so the runtime's placement groups land on the pods meant for
them. The runtime's bundles ask for that resource (and GPUs), never for Ray CPUs, so the pods' CPU requests (from
which KubeRay derives ``num-cpus``) only size the containers.
Packing: every worker pod prefers the node of its own group's pods (weight 100) and then of its job's pods
(weight 50), a preferred pod affinity on ``kubernetes.io/hostname``. The default scheduler scores GPUs not at
all (its resource scoring looks at CPU and memory), so without it a job's engine pods spread over every node
and no node keeps enough GPUs free for a large trainer pod; packed, a job also keeps its NVLink traffic on
one node where it fits.

Environment: the head and worker containers get ``BASE_ENV``, then ``spec.env`` (a literal ``value``, or a
``valueFrom`` Secret or ConfigMap key rendered as Kubernetes ``valueFrom``: the kubelet resolves it, so a
secret's value never passes through the operator, the ConfigMap, the RayJob or the status), and
``spec.envFrom`` as the container's ``envFrom``; with an object-store ``checkpoint.uri`` or ``output.uri``, its
endpoint and region (``AWS_ENDPOINT_URL_S3``, ``AWS_REGION``) and credentials Secret (``envFrom``). KubeRay's submitter pod gets neither (it only runs
``ray job submit``).

Security: every container runs without privilege escalation and without Linux capabilities, under the
runtime's default seccomp profile (Pod Security ``baseline`` and most of ``restricted``; ``runAsNonRoot`` is
left to the image: the official vLLM images run as root), except the head container of a job with the builtin
python tool, which runs unconfined so that the tool can isolate the model's code in namespaces of its own.

Nothing here reads the environment or the cluster: same input, same output (golden-tested).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from rlhf_api.groups import WorkerGroup, resource, worker_groups
from rlhf_api.models import GROUP, PLURAL, RLHFJobSpec, RuntimeConfig
from rlhf_operator import naming

RAY_API_VERSION = "ray.io/v1"
RAY_VERSION = "2.60.0"
GPU = "nvidia.com/gpu"
GPU_PRODUCT_LABEL = "nvidia.com/gpu.product"
SHM_SIZE = "16Gi"
DRIVER_CMD = f"python -m rlhf_runtime.driver --config {naming.CONFIG_MOUNT}/{naming.CONFIG_KEY}"

#: Environment every container gets before the user's own ``spec.env`` (which wins on a clash).
BASE_ENV = {
    "RLHF_JOB_CONFIG": f"{naming.CONFIG_MOUNT}/{naming.CONFIG_KEY}",
    "NCCL_DEBUG": "WARN",
    "NCCL_CUMEM_ENABLE": "0",  # NCCL's cuMem allocator and CUDA IPC handles do not mix
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # engine core in the Ray actor's process
    "RAY_DEDUP_LOGS": "0",
    "PYTHONUNBUFFERED": "1",
}


@dataclass(frozen=True)
class Job:
    """The identity and spec of one RLHFJob, all the renderers need."""

    name: str
    namespace: str
    uid: str
    spec: RLHFJobSpec


def runtime_config(job: Job) -> RuntimeConfig:
    return RuntimeConfig(name=job.name, namespace=job.namespace, uid=job.uid, spec=job.spec)


def render_config_map(job: Job) -> dict[str, Any]:
    names = naming.child_names(job.name)
    payload = json.dumps(runtime_config(job).to_runtime_json(), indent=2, sort_keys=True)
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": names.config_map, "namespace": job.namespace, "labels": naming.labels(job.name)},
        "data": {naming.CONFIG_KEY: payload},
    }


def _env(spec: RLHFJobSpec) -> list[dict[str, Any]]:
    """``BASE_ENV`` then ``spec.env`` (same name: the user's entry wins, in BASE_ENV's place); a ``valueFrom``
    entry stays a reference (``secretKeyRef`` / ``configMapKeyRef``: name, key, optional) for the kubelet."""
    env: dict[str, dict[str, Any]] = {k: {"name": k, "value": v} for k, v in BASE_ENV.items()}
    for e in spec.env or []:
        env[e.name] = {"name": e.name, "valueFrom": e.value_from.wire()} if e.value_from else {
            "name": e.name, "value": e.value}
    return list(env.values())


def _env_from(spec: RLHFJobSpec) -> list[dict[str, Any]]:
    """``spec.envFrom`` as a container's ``envFrom`` (``secretRef`` / ``configMapRef``: name, optional; prefix)."""
    return [s.wire() for s in spec.env_from or []]


#: Container security context of every pod we render (see the module docstring).
CONTAINER_SECURITY = {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}
POD_SECURITY = {"seccompProfile": {"type": "RuntimeDefault"}}
HOSTNAME = "kubernetes.io/hostname"


def pack_affinity(job_name: str, role: str) -> dict[str, Any]:
    """Preferred pod affinity: onto the node of the same group's pods, then of the same job's pods."""
    def term(weight: int, labels: dict[str, str]) -> dict[str, Any]:
        return {"weight": weight, "podAffinityTerm": {"labelSelector": {"matchLabels": labels}, "topologyKey": HOSTNAME}}

    job_label = {naming.LABEL_JOB: job_name}
    return {"podAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [
        term(100, {**job_label, naming.LABEL_ROLE: role}), term(50, job_label),
    ]}}


def _pod_template(job: Job, role: str, container: str, gpus: int, cpu: str, memory: str) -> dict[str, Any]:
    spec = job.spec
    names = naming.child_names(job.name)
    resources: dict[str, dict[str, Any]] = {"requests": {"cpu": cpu, "memory": memory}, "limits": {"memory": memory}}
    if gpus:
        resources["requests"][GPU] = gpus
        resources["limits"][GPU] = gpus
    mounts: list[dict[str, Any]] = [
        {"name": "dshm", "mountPath": "/dev/shm"},
        {"name": "rlhf-config", "mountPath": naming.CONFIG_MOUNT, "readOnly": True},
    ]
    volumes: list[dict[str, Any]] = [
        {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": SHM_SIZE}},
        {"name": "rlhf-config", "configMap": {"name": names.config_map}},
    ]
    if spec.data.config_map:  # prompts from a ConfigMap appear at /etc/rlhf-data/<key>
        mounts.append({"name": "rlhf-data", "mountPath": naming.DATA_MOUNT, "readOnly": True})
        volumes.append({"name": "rlhf-data", "configMap": {"name": spec.data.config_map.name}})
    mounts += [m.wire() for m in spec.volume_mounts or []]
    volumes += [dict(v) for v in spec.volumes or []]
    main: dict[str, Any] = {
        "name": container,
        "image": spec.image,
        "imagePullPolicy": "IfNotPresent",
        "env": _env(spec),
        "resources": resources,
        "volumeMounts": mounts,
        "securityContext": CONTAINER_SECURITY,
    }
    if spec.env_from:
        main["envFrom"] = _env_from(spec)
    _object_storage(main, spec)
    pod: dict[str, Any] = {
        "serviceAccountName": names.runtime_identity,
        "containers": [main],
        "volumes": volumes,
        "securityContext": POD_SECURITY,
    }
    if role != "head":
        pod["affinity"] = pack_affinity(job.name, role)
    _add_scheduling(pod, spec, gpus)
    return {"metadata": {"labels": naming.labels(job.name, role)}, "spec": pod}


def _add_scheduling(pod: dict[str, Any], spec: RLHFJobSpec, gpus: int) -> None:
    """spec.scheduling on a pod spec; GPU pods also select placement.gpuProduct."""
    selector = dict(spec.scheduling.node_selector or {})
    if gpus and spec.placement.gpu_product:
        selector[GPU_PRODUCT_LABEL] = spec.placement.gpu_product
    if selector:
        pod["nodeSelector"] = dict(sorted(selector.items()))
    if spec.scheduling.tolerations:
        pod["tolerations"] = [t.wire() for t in spec.scheduling.tolerations]
    if spec.scheduling.priority_class_name:
        pod["priorityClassName"] = spec.scheduling.priority_class_name


def ray_resources(group: WorkerGroup) -> str:
    """``rayStartParams.resources`` of a worker group: its custom resource as single-quoted compact JSON,
    ``'{"rlhf_trainer":8}'``.

    KubeRay v1.6.2 (``controllers/ray/common/pod.go``) parses this value in ``getResourcesMap``
    (``strings.Trim(value, "'\"` ")`` then ``json.Unmarshal``: a JSON object after trimming, no escaped
    quotes) and copies it verbatim into the container's ``bash -c`` command line (``convertParamMap``:
    `` --resources=<value> ``), so the shell's single quotes hand Ray the bare JSON. This is the exact form
    KubeRay itself writes from a group's top-level ``resources`` field (``fmt.Sprintf("'%s'", json.Marshal(m))``);
    we keep rayStartParams because that field is new in KubeRay 1.5 (absent in 1.4.2) and older CRDs prune it."""
    return "'" + json.dumps({resource(group.name): group.gpus or 1}, separators=(",", ":"), sort_keys=True) + "'"


#: The ports KubeRay gives the head Service when the head container names none (v1.6.2
#: ``common/service.go`` ``getDefaultPorts``): once it names one, the Service takes only the container's ports,
#: so a head with the runtime's metrics port lists these too (the submitter reaches the dashboard port).
RAY_HEAD_PORTS = (("gcs-server", 6379), ("dashboard", 8265), ("client", 10001), ("metrics", 8080), ("serve", 8000))
METRICS_PORT_NAME = "rlhf-metrics"


def _serve_runtime_metrics(head: dict[str, Any], port: int) -> None:
    """The runtime's /metrics on the head pod (``spec.head.metricsPort``; the driver reads RLHF_METRICS_PORT):
    the port named ``rlhf-metrics`` beside Ray's own (``RAY_HEAD_PORTS``)."""
    if not port:
        return
    main = head["template"]["spec"]["containers"][0]
    main["env"] = [e for e in main["env"] if e["name"] != "RLHF_METRICS_PORT"] + [
        {"name": "RLHF_METRICS_PORT", "value": str(port)}]  # the field decides, not a spec.env entry
    main["ports"] = [{"name": n, "containerPort": p} for n, p in RAY_HEAD_PORTS] + [
        {"name": METRICS_PORT_NAME, "containerPort": port}]


#: ``spec.checkpoint.storage`` / ``spec.output.storage`` fields -> the variables every S3 client reads.
STORAGE_ENV = (("endpoint", "AWS_ENDPOINT_URL_S3"), ("region", "AWS_REGION"))


def _object_storage(main: dict[str, Any], spec: RLHFJobSpec) -> None:
    """The object store of ``spec.checkpoint.uri`` / ``spec.output.uri`` on a head or worker container (the trainers
    write, the driver reads): endpoint and region as ``AWS_ENDPOINT_URL_S3`` and ``AWS_REGION`` (the field wins over
    a ``spec.env`` entry), the credentials Secret as ``envFrom`` (resolved by the kubelet)."""
    st = spec.object_storage()
    if st is None:
        return
    fields = {var: getattr(st, attr) for attr, var in STORAGE_ENV if getattr(st, attr)}
    main["env"] = [e for e in main["env"] if e["name"] not in fields] + [
        {"name": k, "value": v} for k, v in fields.items()]
    if st.credentials_secret:
        main.setdefault("envFrom", []).append({"secretRef": {"name": st.credentials_secret}})


def _tracking_credentials(head: dict[str, Any], spec: RLHFJobSpec) -> None:
    """``spec.tracking``'s Secrets on the head container only, where the driver (the one process that talks to
    the trackers) runs: the MLflow credentials Secret as ``envFrom``, the W&B API key as ``WANDB_API_KEY``. The
    kubelet resolves them; the values never pass through the operator."""
    t = spec.tracking
    if t is None:
        return
    main = head["template"]["spec"]["containers"][0]
    if t.mlflow and t.mlflow.credentials_secret:
        main.setdefault("envFrom", []).append({"secretRef": {"name": t.mlflow.credentials_secret}})
    if t.wandb and t.wandb.api_key_secret:
        ref = t.wandb.api_key_secret
        main["env"] = [e for e in main["env"] if e["name"] != "WANDB_API_KEY"] + [
            {"name": "WANDB_API_KEY", "valueFrom": {"secretKeyRef": {"name": ref.name, "key": ref.key}}}]


def _python_tool_isolation(head: dict[str, Any], spec: RLHFJobSpec) -> None:
    """The builtin python tool (``spec.environment``) runs the model's code in the head container, in user, network
    and mount namespaces of its own (``rlhf_runtime.agent.isolation``); the runtime's default seccomp profile
    forbids creating them, so that container (only) runs unconfined. Its other restrictions stay."""
    if spec.environment is not None and spec.environment.wants_python():
        main = head["template"]["spec"]["containers"][0]
        main["securityContext"] = {**CONTAINER_SECURITY, "seccompProfile": {"type": "Unconfined"}}


def _submitter_template(job: Job) -> dict[str, Any]:
    """KubeRay's submitter pod (``ray job submit``): the runtime image, small requests, the job's scheduling.
    KubeRay fills the command and its environment; ``restartPolicy: Never`` as in KubeRay's default."""
    spec = job.spec
    res = spec.head.submitter
    pod: dict[str, Any] = {
        "restartPolicy": "Never",
        "containers": [
            {
                "name": "ray-job-submitter",
                "image": spec.image,
                "imagePullPolicy": "IfNotPresent",
                "resources": {"requests": {"cpu": res.cpu, "memory": res.memory}, "limits": {"memory": res.memory}},
                "securityContext": CONTAINER_SECURITY,
            }
        ],
        "securityContext": POD_SECURITY,
    }
    _add_scheduling(pod, spec, gpus=0)
    return {"metadata": {"labels": naming.labels(job.name, "submitter")}, "spec": pod}


def render_ray_job(job: Job) -> dict[str, Any]:
    spec = job.spec
    names = naming.child_names(job.name)
    meta_labels = naming.labels(job.name)
    if spec.scheduling.queue_name:
        meta_labels[naming.KUEUE_QUEUE_LABEL] = spec.scheduling.queue_name
    head = {
        "rayStartParams": {"dashboard-host": "0.0.0.0", "num-cpus": "0", "num-gpus": "0"},
        "template": _pod_template(job, "head", "ray-head", 0, spec.head.resources.cpu, spec.head.resources.memory),
    }
    _serve_runtime_metrics(head, spec.head.metrics_port)
    _tracking_credentials(head, spec)
    _python_tool_isolation(head, spec)
    workers = [
        {
            "groupName": g.name,
            "replicas": g.replicas,
            "minReplicas": g.replicas,
            "maxReplicas": g.replicas,
            "rayStartParams": {"num-gpus": str(g.gpus), "resources": ray_resources(g)},
            "template": _pod_template(job, g.name, "ray-worker", g.gpus, g.cpu, g.memory),
        }
        for g in worker_groups(spec)
    ]
    ray_job: dict[str, Any] = {
        "apiVersion": RAY_API_VERSION,
        "kind": "RayJob",
        "metadata": {"name": names.ray_job, "namespace": job.namespace, "labels": meta_labels},
        "spec": {
            "entrypoint": DRIVER_CMD,
            "submissionMode": "K8sJobMode",
            "shutdownAfterJobFinishes": True,
            "ttlSecondsAfterFinished": spec.ttl_seconds_after_finished or 0,
            # Kueue admits a queued job by unsuspending it: it is created suspended (as Kueue's own webhook would
            # make it) and its suspend is Kueue's from then on (ray_job_mutable_patch leaves it alone).
            "suspend": spec.suspend or bool(spec.scheduling.queue_name),
            "rayClusterSpec": {"rayVersion": RAY_VERSION, "headGroupSpec": head, "workerGroupSpecs": workers},
            "submitterPodTemplate": _submitter_template(job),
        },
    }
    if spec.active_deadline_seconds:
        ray_job["spec"]["activeDeadlineSeconds"] = spec.active_deadline_seconds
    if spec.backoff_limit:
        ray_job["spec"]["backoffLimit"] = spec.backoff_limit
    return ray_job


#: With ``spec.environment.sandbox``: the runtime claims, reads and releases SandboxClaims (created with generated
#: names, so not limited by name) and reads the claimed Sandboxes (their pod IPs), in the job's namespace only.
SANDBOX_RUNTIME_RULES = (
    {"apiGroups": ["extensions.agents.x-k8s.io"], "resources": ["sandboxclaims"],
     "verbs": ["create", "get", "list", "watch", "delete"]},
    {"apiGroups": ["agents.x-k8s.io"], "resources": ["sandboxes"], "verbs": ["get"]},
)


def render_runtime_rbac(job: Job) -> list[dict[str, Any]]:
    """ServiceAccount + Role + RoleBinding for the job's pods.

    The runtime may patch the status of its own RLHFJob and nothing else (``resourceNames``), so a
    compromised or buggy driver cannot touch other jobs; it may read its own ConfigMap; with
    ``spec.environment.sandbox`` it may claim sandboxes in its own namespace (``SANDBOX_RUNTIME_RULES``).
    """
    names = naming.child_names(job.name)
    ident, ns, lbl = names.runtime_identity, job.namespace, naming.labels(job.name)
    meta = {"name": ident, "namespace": ns, "labels": lbl}
    env = job.spec.environment
    sandbox_rules = [] if env is None or env.sandbox is None else SANDBOX_RUNTIME_RULES
    return [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": dict(meta), "automountServiceAccountToken": True},
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "Role",
            "metadata": dict(meta),
            "rules": [
                {"apiGroups": [GROUP], "resources": [f"{PLURAL}/status"], "resourceNames": [job.name],
                 "verbs": ["get", "patch"]},
                {"apiGroups": [GROUP], "resources": [PLURAL], "resourceNames": [job.name], "verbs": ["get"]},
                {"apiGroups": [""], "resources": ["configmaps"], "resourceNames": [names.config_map], "verbs": ["get"]},
                *sandbox_rules,
            ],
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "RoleBinding",
            "metadata": dict(meta),
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": ident},
            "subjects": [{"kind": "ServiceAccount", "name": ident, "namespace": ns}],
        },
    ]


#: RayJob fields the operator keeps in line with the spec on a live RayJob (models.MUTABLE_FIELDS that KubeRay reads:
#: it reads each when it acts on it, so a change applies from then on). Every other rendered field is fixed at
#: creation: the spec fields it comes from cannot change (admission refuses the edit).
RAY_JOB_MUTABLE = ("suspend", "activeDeadlineSeconds", "backoffLimit", "ttlSecondsAfterFinished")


def ray_job_mutable_patch(desired: dict[str, Any], live: dict[str, Any], kueue: bool = False) -> dict[str, Any]:
    """A merge patch that brings ``live``'s mutable fields to ``desired``'s (None keys remove a field); empty when
    they agree. With Kueue (``kueue``) the RayJob's ``suspend`` is Kueue's and left alone."""
    want, have = desired["spec"], live.get("spec") or {}
    defaults = {"suspend": False, "backoffLimit": 0, "ttlSecondsAfterFinished": 0}
    patch = {}
    for key in RAY_JOB_MUTABLE:
        if key == "suspend" and kueue:
            continue
        if want.get(key, defaults.get(key)) != have.get(key, defaults.get(key)):
            patch[key] = want.get(key)
    return {"spec": patch} if patch else {}
