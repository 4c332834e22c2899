"""``spec.environment``: multi-turn rollouts with tools and environments (agentic RL).

A job without ``spec.environment`` trains single-turn samples (prompt -> one completion -> reward). With it, each
sample is a trajectory: the model answers, its tool calls (parsed by vLLM's tool-call parser ``toolParser``) run,
or the environment (``class`` or ``http``) answers the turn, and the results come back as the next turn's
context, until the environment says done, the model answers without a tool call, ``maxTurns`` or the token budget.
The trainer trains on exactly the token ids the engines sampled; tool and environment tokens are in the sequence
with loss mask 0.

Imports only pydantic (shared by the operator and the runtime, like ``models``).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field

from rlhf_api.base import CPU_PATTERN, LABEL_KEY_PATTERN, LABEL_VALUE_PATTERN, MEMORY_PATTERN, Model, cel, sub
from rlhf_api.inputs import Toleration

#: vLLM tool-call parsers a job may name (``--tool-call-parser`` names); the runtime refuses a name its vLLM lacks
#: before the first step.
TOOL_PARSERS = ("hermes", "qwen3_xml", "qwen3_coder", "llama3_json", "mistral", "pythonic", "granite",
                "internlm", "deepseek_v3", "kimi_k2", "glm45", "openai")

#: A tool's name: what the model writes in its call.
TOOL_NAME = r"^[A-Za-z_][A-Za-z0-9_-]{0,63}$"
#: ``module:attribute`` importable in the runtime image.
IMPORT_REF = r"^[A-Za-z_][A-Za-z0-9_.]*:[A-Za-z_][A-Za-z0-9_]*$"

JSON_SCHEMA = {"type": "object", "x-kubernetes-preserve-unknown-fields": True}


class Tool(Model):
    model_config = ConfigDict(json_schema_extra={"x-kubernetes-validations": [
        cel("(has(self.function) ? 1 : 0) + (has(self.builtin) ? 1 : 0) == 1",
            "a tool takes exactly one of function (a user tool 'module:function') or builtin"),
    ]})
    name: str = Field(pattern=TOOL_NAME, max_length=64, description="The tool's name, as the model calls it.")
    description: str = Field("", max_length=4096, description="What the tool does, shown to the model.")
    parameters: dict[str, Any] = Field(
        description="JSON schema (type object) of the tool's arguments, given to the model through the chat "
        "template's tools argument (checked before the first step). Arguments that do not match it reach the "
        "model as an error observation.",
        json_schema_extra=JSON_SCHEMA)
    builtin: Literal["python", "shell"] | None = Field(
        None, description="python: runs the argument 'code' with Python and returns what it prints; without "
        "environment.sandbox in an isolated process of the runtime image (no network, no credentials, an empty "
        "working directory) within environment.python's limits, with it in the trajectory's sandbox pod. shell: "
        "runs the argument 'command' with sh in the trajectory's sandbox pod (needs environment.sandbox).")
    function: str | None = Field(
        None, pattern=IMPORT_REF,
        description="A user tool 'module:function' importable in the runtime image, called with the call's "
        "arguments as keyword arguments; returns a string (or JSON-serialisable value). A plain function runs in "
        "a thread, a coroutine function on the rollout's event loop.")


class PythonLimits(Model):
    timeout_seconds: float = Field(10.0, gt=0, le=600, description="Wall-clock limit of one python tool call.")
    memory_mib: int = Field(512, alias="memoryMiB", ge=64, le=65536,
                            description="Address-space limit of one python tool call, MiB.")
    max_output_bytes: int = Field(
        16384, ge=256, le=1 << 20, description="Output kept of one call (stdout then stderr); the rest is cut "
        "with a marker that says how much was cut.")


#: The port of the sandbox image's server (agent-sandbox's python-runtime HTTP API: ``POST /execute``).
SANDBOX_PORT = 8888
#: Where the sandbox pods' scratch emptyDir is mounted (their working directory and HOME; the root is read-only).
SANDBOX_SCRATCH = "/tmp"
#: A DNS-1123 subdomain (a RuntimeClass name).
DNS_SUBDOMAIN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"


class SandboxResources(Model):
    model_config = ConfigDict(json_schema_extra={"x-kubernetes-validations": [
        cel("quantity(self.memory).compareTo(quantity('64Mi')) >= 0",
            "environment.sandbox.resources.memory must be at least 64Mi: the sandbox's server and the code's "
            "Python interpreter need it", fieldPath=".memory"),
        cel("quantity(self.ephemeralStorage).compareTo(quantity('16Mi')) >= 0",
            "environment.sandbox.resources.ephemeralStorage must be at least 16Mi (the scratch directory)",
            fieldPath=".ephemeralStorage"),
    ]})
    cpu: str = Field("500m", pattern=CPU_PATTERN, max_length=32,
                     description="CPU request and limit of one sandbox pod.")
    memory: str = Field("512Mi", pattern=MEMORY_PATTERN, max_length=32,
                        description="Memory request and limit of one sandbox pod (at least 64Mi).")
    ephemeral_storage: str = Field(
        "1Gi", pattern=MEMORY_PATTERN, max_length=32,
        description="Ephemeral-storage request and limit of one sandbox pod, and the size of its scratch "
        "directory (/tmp, the only writable path; at least 16Mi).")


class Sandbox(Model):
    """Sandboxes for the builtin tools, through kubernetes-sigs/agent-sandbox (a prerequisite, like KubeRay)."""

    image: str = Field(
        min_length=1, max_length=1024,
        description="Image of the sandbox pods: serves agent-sandbox's python-runtime HTTP API (POST /execute) on "
        "port 8888 and runs as a non-root user (the project's rlhf-sandbox image does both).")
    resources: SandboxResources = sub(SandboxResources, "CPU, memory and ephemeral storage of one sandbox pod.")
    warm_pool: int = Field(
        2, ge=0, le=1024,
        description="Sandboxes kept started and ready for the job (its SandboxWarmPool's replicas): a claim takes "
        "one at once and the pool starts a replacement. 0: every claim starts a sandbox cold. The pool is "
        "scaled to 0 while the job is suspended, queued or preempted by Kueue, and once it has finished.")
    timeout_seconds: float = Field(
        30.0, gt=0, le=3600,
        description="Wall-clock limit of one python or shell call in a sandbox: past it the command and everything "
        "it started are killed and the call is a timeout error observation.")
    max_output_bytes: int = Field(
        16384, ge=256, le=1 << 20,
        description="Output kept of one sandbox call (stdout then stderr); the rest is cut with a marker that says "
        "how much was cut. Binary output reaches the model with replacement characters.")
    claim_timeout_seconds: float = Field(
        120.0, gt=0, le=3600,
        description="How long a trajectory waits for its sandbox (a warm one is bound at once, a cold one when its "
        "pod is ready); past it the call is a sandbox error observation and the next call tries again.")
    runtime_class_name: str | None = Field(
        None, pattern=DNS_SUBDOMAIN, max_length=253,
        description="RuntimeClass of the sandbox pods (e.g. gVisor or Kata where the cluster has one); default: "
        "the cluster's default container runtime.")
    node_selector: dict[str, Annotated[str, Field(max_length=63, pattern=LABEL_VALUE_PATTERN)]] | None = Field(
        None,
        description="Node labels the sandbox pods require (spec.scheduling places the job's GPU pods, not these); "
        "default: none, any node.",
        json_schema_extra={"maxProperties": 64, "x-kubernetes-validations": [cel(
            "self.all(k, size(k) <= 316 && k.matches('" + LABEL_KEY_PATTERN.replace("\\", "\\\\") + "'))",
            "environment.sandbox.nodeSelector keys must be label keys ([prefix/]name, name at most 63 "
            "characters of letters, digits, '-', '_', '.')")]},
    )
    tolerations: list[Toleration] | None = Field(
        None, max_length=64, description="Tolerations of the sandbox pods (at most 64); default: none.")


class ServerResources(Model):
    cpu: str = Field("1", pattern=CPU_PATTERN, max_length=32, description="CPU request and limit per server pod.")
    memory: str = Field("2Gi", pattern=MEMORY_PATTERN, max_length=32,
                        description="Memory request and limit per server pod.")


class EnvironmentServer(Model):
    image: str = Field(min_length=1, max_length=1024, description="Image of the environment server.")
    command: list[str] | None = Field(None, max_length=64, description="Container command (default: the image's).")
    args: list[str] | None = Field(None, max_length=256, description="Container arguments.")
    port: int = Field(8000, ge=1, le=65535, description="Port the server listens on (HTTP).")
    replicas: int = Field(1, ge=1, le=256, description="Server pods; the runtime spreads episodes over them, each episode on one pod (a headless Service lists them).")
    resources: ServerResources = sub(ServerResources, "CPU and memory per server pod.")
    ready_path: str = Field("/health", pattern=r"^/\S*$", max_length=1024,
                            description="HTTP path of the pods' readiness probe.")
    node_selector: dict[str, Annotated[str, Field(max_length=63, pattern=LABEL_VALUE_PATTERN)]] | None = Field(
        None,
        description="Node labels the server pods require (spec.scheduling places the job's GPU pods, not these).",
        json_schema_extra={"maxProperties": 64, "x-kubernetes-validations": [cel(
            "self.all(k, size(k) <= 316 && k.matches('" + LABEL_KEY_PATTERN.replace("\\", "\\\\") + "'))",
            "environment.http.server.nodeSelector keys must be label keys ([prefix/]name, name at most 63 "
            "characters of letters, digits, '-', '_', '.')")]},
    )
    tolerations: list[Toleration] | None = Field(None, max_length=64, description="Tolerations of the server pods.")


class HttpEnvironment(Model):
    model_config = ConfigDict(json_schema_extra={"x-kubernetes-validations": [
        cel("(has(self.url) ? 1 : 0) + (has(self.server) ? 1 : 0) == 1",
            "environment.http takes exactly one of url (a running server) or server (pods the operator runs)"),
    ]})
    url: str | None = Field(None, pattern=r"^https?://\S+$", max_length=2048,
                            description="Base URL of a running environment server.")
    server: EnvironmentServer | None = Field(
        None, description="An environment server the operator runs as pods of the job (a Deployment and a "
        "Service owned by the RLHFJob, deleted with it); the first rollout waits until they are ready.")
    timeout_seconds: float = Field(60.0, gt=0, le=3600, description="Deadline of one request.")
    unreachable_seconds: float = Field(
        300.0, gt=0, le=86400,
        description="How long the server may stay unreachable (connection refused, 5xx, timeouts on every "
        "attempt) before the run fails with a message that names it. Shorter faults are errors of the "
        "trajectories they hit.")


class Environment(Model):
    """What a trajectory talks to between its turns."""

    model_config = ConfigDict(json_schema_extra={"x-kubernetes-validations": [
        cel("!has(self.http) || !has(self.className)",
            "environment takes className or http, not both"),
        cel("!has(self.maxTokensPerTurn) || self.maxTokensPerTurn <= self.maxTokens",
            "environment.maxTokensPerTurn must not exceed environment.maxTokens", fieldPath=".maxTokensPerTurn"),
        cel("has(self.sandbox) || !has(self.tools) || !self.tools.exists(t, has(t.builtin) && t.builtin == 'shell')",
            "the builtin shell tool runs only in a sandbox: set environment.sandbox (or remove the shell tool)",
            fieldPath=".tools"),
        cel("!has(self.sandbox) || (has(self.tools) && self.tools.exists(t, has(t.builtin)))",
            "environment.sandbox runs the builtin python and shell tools: add one of them to environment.tools "
            "(builtin: python or shell) or remove environment.sandbox", fieldPath=".sandbox"),
    ]})
    class_name: str | None = Field(
        None, alias="className", pattern=IMPORT_REF,
        description="An environment class 'module:Class' importable in the runtime image (see "
        "docs/agents.md for its protocol: reset from a data sample, step on the assistant's turn returning "
        "observation messages, an optional reward and done). Unset: the tools alone (the trajectory ends when "
        "the model answers without a tool call).")
    http: HttpEnvironment | None = Field(
        None, description="An environment served over HTTP (OpenEnv's reset/step protocol).")
    tools: list[Tool] | None = Field(
        None, max_length=64, description="Tools the model may call (names unique).",
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["name"]})
    tool_parser: Literal[TOOL_PARSERS] = Field(  # type: ignore[valid-type]
        "hermes", description="vLLM's tool-call parser for the model's chat format (hermes for the Qwen2.5/Qwen3 "
        "<tool_call> format).")
    max_turns: int = Field(8, ge=1, le=1024, description="Most assistant turns of one trajectory.")
    max_tokens: int = Field(
        8192, ge=16, le=1_048_576,
        description="Token budget of one trajectory: the prompt, every turn's generation and every observation. "
        "A turn generates at most what is left of it.")
    max_tokens_per_turn: int | None = Field(
        None, ge=1, le=1_048_576, description="Most tokens one assistant turn generates (default: "
        "rollout.sampling.maxTokens).")
    concurrency: int = Field(64, ge=1, le=65536,
                             description="Most tool and environment calls in flight at once (per job).")
    on_error: Literal["observation", "zeroReward"] = Field(
        "observation",
        description="A tool or environment fault (timeout, exception, malformed call, oversized output, server "
        "error): observation: the error goes back to the model as the tool's answer and the trajectory goes on; "
        "zeroReward: the trajectory ends with reward 0. Either way it is counted in the step's metrics.")
    reward_weight: float = Field(
        1.0, ge=-1000, le=1000,
        description="Weight of the environment's reward (the sum of what its steps returned) in the combined "
        "reward; spec.reward's sources, if any, score the trajectory's final assistant answer beside it.")
    python: PythonLimits = sub(PythonLimits, "Limits of the builtin python tool when it runs without a sandbox.")
    sandbox: Sandbox | None = Field(
        None, description="Run the builtin python and shell tools in sandbox pods of kubernetes-sigs/agent-sandbox "
        "instead of a process of the runtime: each trajectory claims one sandbox from the job's warm pool at its "
        "first builtin call and releases it when it ends. The operator makes a SandboxTemplate and a "
        "SandboxWarmPool owned by the job (pods without a service-account token, non-root, a read-only root "
        "filesystem with a scratch emptyDir, no capabilities, seccomp RuntimeDefault, these limits; no egress, "
        "ingress only from the job's own pods). Needs agent-sandbox's CRDs and controller with its extensions.")
    error_warning_fraction: float = Field(
        0.5, ge=0, le=1,
        description="A step whose tool and environment calls fail more often than this raises a Warning Event.")

    def wants_python(self) -> bool:
        """The builtin python tool runs in the runtime's own isolated process (no sandbox)."""
        return self.sandbox is None and any(t.builtin == "python" for t in self.tools or [])

    def wants_sandbox(self) -> bool:
        return self.sandbox is not None


def server_name(job: str) -> str:
    """The Deployment and Service of a job's environment server (``environment.http.server``)."""
    return f"{job}-env"


def sandbox_name(job: str) -> str:
    """The SandboxTemplate and SandboxWarmPool of a job (``environment.sandbox``)."""
    return f"{job}-sandbox"


def server_url(job: str, namespace: str, env: Environment) -> str:
    """Where the runtime reaches the job's environment server (its Service's cluster DNS name)."""
    port = env.http.server.port if env.http is not None and env.http.server is not None else 80
    return f"http://{server_name(job)}.{namespace}.svc:{port}"


class AgentStatus(Model):
    """The last step's multi-turn rollout (``spec.environment``), as the runtime counted it."""

    step: int | None = Field(None, description="Training step these figures are of.")
    trajectories: int | None = Field(None, description="Trajectories of the step.")
    turns_mean: float | None = Field(None, description="Assistant turns per trajectory, mean.")
    tool_calls: int | None = Field(None, description="Tool calls of the step.")
    fault_share: float | None = Field(
        None, description="Failed tool and environment calls (malformed calls included) per call.")
    timeout_share: float | None = Field(None, description="Tool calls that timed out, per tool call.")
    truncated_share: float | None = Field(
        None, description="Trajectories cut by the token budget or a turn's length limit, per trajectory.")
    env_latency_p50_seconds: float | None = Field(None, description="Environment call latency, median.")
    env_latency_p99_seconds: float | None = Field(None, description="Environment call latency, 99th percentile.")
    engine_busy_share: float | None = Field(
        None, description="Share of the rollout's wall time the least busy engine had a request in flight.")
    errors: dict[str, int] | None = Field(None, description="Faults of the step by kind (timeout, exception, ...).")
    staleness_max: int | None = Field(
        None, description="The largest staleness of the step's trained trajectories: steps between the step and "
        "the weights that sampled a trajectory's oldest token (weightSync.maxStaleness bounds it in async mode).")
    staleness_mean: float | None = Field(None, description="The staleness of the step's trained trajectories, mean.")
    stale_dropped: int | None = Field(
        None, description="Trajectories dropped past weightSync.maxStaleness while the step's rollout ran (their "
        "prompts generated again).")
    sandbox_claims: int | None = Field(None, description="Sandboxes claimed in the step (environment.sandbox).")
    sandbox_claim_p50_seconds: float | None = Field(
        None, description="Time from a trajectory's claim to its sandbox being ready, median.")
    sandbox_claim_p99_seconds: float | None = Field(
        None, description="Time from a trajectory's claim to its sandbox being ready, 99th percentile.")
    sandbox_failures: int | None = Field(
        None, description="Sandbox faults of the step: claims that failed or timed out, sandboxes lost mid-call.")
    warning: str | None = Field(
        None, description="Set when the step's faults passed environment.errorWarningFraction (with a Warning "
        "Event); cleared by a step below it.")


class SandboxStatus(Model):
    """The job's warm pool of sandboxes (``spec.environment.sandbox``), as the operator observed it."""

    warm_pool: str | None = Field(None, description="The job's SandboxWarmPool.")
    replicas: int | None = Field(
        None, description="Sandboxes the pool is asked to keep warm now (0 while the job is suspended, queued, "
        "preempted or finished).")
    ready: int | None = Field(None, description="Warm sandboxes ready to be claimed.")
    failure: str | None = Field(
        None, description="Why the pool cannot fill (agent-sandbox not installed, no controller, image pull, "
        "scheduling, pod creation refused), as in the SandboxesReady condition; unset while it can.")
