"""The runtime's view of a job: ``RuntimeConfig`` (from the operator's ConfigMap) plus derived settings.

Pure: no torch, vLLM or Ray. The config file is ``RuntimeConfig`` JSON (camelCase), by default at
``$RLHF_JOB_CONFIG`` (the operator mounts it at ``/etc/rlhf/job.json``).
"""

from __future__ import annotations

import json
import logging
import os
import re
from pathlib import Path
from typing import Any

from rlhf_api.models import API_VERSION, RLHFJobSpec, RuntimeConfig

log = logging.getLogger("rlhf_runtime")
CONFIG_ENV = "RLHF_JOB_CONFIG"

#: Environment for every runtime process (engine and trainer actors), under the job's own ``spec.env`` (which
#: wins on a clash). Hub access is left alone: a model named by its hub id is downloaded in the pods; jobs that
#: must stay offline set HF_HUB_OFFLINE=1 in spec.env.
ACTOR_ENV = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_NO_USAGE_STATS": "1",
    "VLLM_USE_FLASHINFER_SAMPLER": "0",
    "VLLM_ALLOW_INSECURE_SERIALIZATION": "1",
    "TOKENIZERS_PARALLELISM": "false",
}
#: Extra environment on CPU-only jobs (the KV cache on CPU is RAM, in GiB). ``TORCHDYNAMO_DISABLE``: vLLM compiles
#: its sampler's log-probability gather with ``torch.compile``, which on a CPU needs a C++ compiler the runtime
#: image has none of (``InductorError: InvalidCxxCompiler: No working C++ compiler found``, the first rollout
#: that asks for log-probabilities); CPU engines run eagerly anyway (``enforce_eager``).
CPU_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind", "TORCHDYNAMO_DISABLE": "1"}


def config_path(path: str | os.PathLike[str] | None = None) -> str:
    path = path or os.environ.get(CONFIG_ENV)
    if not path:
        raise ValueError(f"no job config: pass --config or set {CONFIG_ENV}")
    return str(path)


def load_config(path: str | os.PathLike[str] | None = None) -> RuntimeConfig:
    """The job config; keys this runtime does not know (a newer operator wrote them) are ignored with a warning.
    Raises ValueError (JSON or validation errors, another ``apiVersion`` than ``rlhf_api.models.API_VERSION``)."""
    text = Path(config_path(path)).read_text(encoding="utf-8")
    raw = json.loads(text)
    version = raw.get("apiVersion", API_VERSION) if isinstance(raw, dict) else None
    if version != API_VERSION:
        raise ValueError(f"job config apiVersion {version!r} is not {API_VERSION!r}: this runtime image does not "
                         "understand that API (use a runtime image of the operator's version)")
    cfg, ignored = RuntimeConfig.from_runtime_json(text)
    if ignored:
        log.warning("job config: ignoring fields this runtime does not know (the operator is newer than the "
                    "runtime image): %s", ", ".join(ignored))
    return cfg


def identity(path: str | os.PathLike[str] | None = None) -> tuple[str | None, str | None, str | None]:
    """Best effort, for reporting a config that does not parse: ``(name, namespace, uid)`` from the raw JSON
    (each None when unreadable)."""
    try:
        text = Path(config_path(path)).read_text(encoding="utf-8", errors="replace")
    except (OSError, ValueError):
        return None, None, None
    try:
        raw = json.loads(text)
    except ValueError:  # not JSON: the first occurrence of each key (the operator writes them first)
        found = [re.search(rf'"{k}"\s*:\s*"([^"\\]+)"', text) for k in ("name", "namespace", "uid")]
        return tuple(m.group(1) if m else None for m in found)  # type: ignore[return-value]
    if not isinstance(raw, dict):
        return None, None, None
    get = lambda k: raw.get(k) if isinstance(raw.get(k), str) and raw.get(k) else None
    return get("name"), get("namespace"), get("uid")


def check_model_path(name: str, field: str = "spec.model.name", kind: str = "model") -> None:
    """A model named by a local path (``/...`` or ``./...``) must be a directory with ``config.json``: say so,
    naming ``field``, before the hub client reads the path as a malformed repository id."""
    if not name.startswith(("/", ".")):
        return
    path = Path(name)
    if not path.is_dir():
        raise FileNotFoundError(
            f"{field} {name} does not exist: a local {kind} must be a directory with config.json and the "
            "tokenizer files, on a volume mounted in every pod (spec.volumes, spec.volumeMounts)"
        )
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{field} {name} has no config.json: it is not a Hugging Face model directory")


def spec_env(spec: RLHFJobSpec) -> dict[str, str]:
    """``spec.env``'s literal values as a dict: the operator puts them into every container; the runtime applies
    them to its own process and its actors too, so a local run (``--local``, no pod) sees the same environment.
    Entries ``valueFrom`` a Secret or ConfigMap are left out: the kubelet sets them in every container and the
    actors inherit them (an empty value here would override the token)."""
    return {e.name: e.value for e in spec.env or [] if e.value_from is None}


def actor_env(spec: RLHFJobSpec, gpu: bool) -> dict[str, str]:
    """The environment of every actor: ``ACTOR_ENV`` (+ ``CPU_ENV`` without GPUs), then ``spec.env``. vLLM's CPU
    platform lets ``VLLM_CPU_KVCACHE_SPACE`` override ``kv_cache_memory_bytes``, so a CPU job with
    ``rollout.kvCacheMemoryGiB`` does not get it."""
    cpu = {} if gpu else dict(CPU_ENV)
    if spec.rollout.kv_cache_memory_gib is not None:
        cpu.pop("VLLM_CPU_KVCACHE_SPACE", None)
    return {**ACTOR_ENV, **cpu, **spec_env(spec)}


def validation_enabled(spec: RLHFJobSpec, flag: bool) -> bool:
    """Validation mode: ``spec.weightSync.validate`` or the driver's ``--validate`` flag."""
    return spec.weight_sync.validate_ or flag


def resolve_backend(spec: RLHFJobSpec, gpu: bool) -> str:
    """The weight-transfer backend actually used: the spec's on GPUs, ``gloo`` whenever there are none."""
    return spec.weight_sync.backend if gpu else "gloo"


#: The ``max_lora_rank`` values vLLM accepts (``vllm.config.lora.MaxLoRARanks`` as of 0.32).
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
#: Engine keyword arguments that turn on LoRA serving (``engine_kwargs``); a plain engine has none of them.
LORA_ENGINE_KEYS = ("enable_lora", "max_lora_rank", "max_loras")


def vllm_max_lora_rank(rank: int) -> int:
    """The smallest ``max_lora_rank`` vLLM accepts that holds an adapter of rank ``rank``."""
    for r in VLLM_LORA_RANKS:
        if r >= rank:
            return r
    raise ValueError(f"LoRA rank {rank} is above vLLM's largest max_lora_rank {VLLM_LORA_RANKS[-1]}")


def engine_kwargs(
    spec: RLHFJobSpec, model: str, backend: str, executor: str, gpu: bool, seed: int = 0
) -> dict[str, Any]:
    """Keyword arguments for ``vllm.LLM`` / ``AsyncEngineArgs`` (``weight_transfer_config`` is added by the
    engine actor from ``weight_transfer_backend``, since it is a vLLM object). Full fine-tuning: dummy weights
    (the first sync sends the real ones). LoRA: the base model's real weights, which no sync replaces, and one
    LoRA slot of at least the adapter's rank (``LORA_ENGINE_KEYS``)."""
    r = spec.rollout
    lora = spec.trainer.lora
    kw: dict[str, Any] = {
        "model": model,
        "dtype": spec.model.dtype,
        "tensor_parallel_size": r.tensor_parallel_size,
        "distributed_executor_backend": executor,
        # full fine-tuning: real weights arrive with the first sync, before the first rollout
        "load_format": "auto" if lora else "dummy",
        "skip_tokenizer_init": True,
        "enforce_eager": r.enforce_eager or not gpu,
        "gpu_memory_utilization": r.gpu_memory_utilization,
        "seed": seed,
        "weight_transfer_backend": backend,
        # the sampled tokens' log-probabilities after temperature / top-p: the rollout correction's behaviour policy
        "logprobs_mode": "processed_logprobs",
    }
    if spec.model.revision:
        kw["revision"] = spec.model.revision
    if spec.model.trust_remote_code:
        kw["trust_remote_code"] = True
    if r.max_model_len:
        kw["max_model_len"] = r.max_model_len
    if r.kv_cache_memory_gib is not None:
        kw["kv_cache_memory_bytes"] = int(r.kv_cache_memory_gib * 2**30)
    if r.kv_cache_dtype != "auto":
        kw["kv_cache_dtype"] = r.kv_cache_dtype
    if engines_sleep(spec, gpu):
        kw["enable_sleep_mode"] = True
    if r.expert_parallel:
        kw["enable_expert_parallel"] = True
    if lora:
        kw.update(enable_lora=True, max_lora_rank=vllm_max_lora_rank(lora.rank), max_loras=1)
    return kw


def check_lora(spec: RLHFJobSpec) -> None:
    """What ``trainer.lora`` cannot be combined with (the CRD's CEL rules refuse these at admission; a local run
    meets them here): raises ValueError with what to change."""
    if spec.trainer.lora is None:
        return
    if spec.trainer.strategy != "single":
        raise ValueError("trainer.lora needs trainer.strategy 'single' (FSDP2 sharding of a LoRA policy is not "
                         "supported)")
    if spec.weight_sync.mode != "sync":
        raise ValueError("trainer.lora needs weightSync.mode 'sync' (the async engines serve no LoRA adapter)")
    if spec.rollout.expert_parallel:
        raise ValueError("trainer.lora cannot be combined with rollout.expertParallel")


def engines_sleep(spec: RLHFJobSpec, gpu: bool) -> bool:
    """Colocated engines sleep while the trainer trains unless ``placement.colocatedSleep`` is false (GPU only:
    CPU vLLM has no sleep mode)."""
    return spec.placement.mode == "colocated" and spec.placement.colocated_sleep and gpu


def sampling_kwargs(spec: RLHFJobSpec) -> dict[str, Any]:
    s = spec.rollout.sampling
    return {
        "n": s.samples_per_prompt,
        "temperature": s.temperature,
        "top_p": s.top_p,
        "max_tokens": s.max_tokens,
        "logprobs": 0,  # the sampled token's own log-probability (rollout correction, mismatch)
    }


#: Keys of a Hugging Face config that give a model's number of routed experts (Qwen-MoE, Mixtral, DeepSeek, ...).
EXPERT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")


def check_model(spec: RLHFJobSpec, hf_config: dict[str, Any]) -> None:
    """Spec settings that depend on the model itself (its Hugging Face config as a dict); raises ValueError with
    what to change. ``rollout.expertParallel`` needs a mixture-of-experts model (vLLM refuses data-parallel
    groups of dense models, and there are no experts to shard)."""
    if spec.rollout.expert_parallel:
        experts = max((int(hf_config.get(k) or 0) for k in EXPERT_KEYS), default=0)
        if experts <= 0:
            raise ValueError(
                f"rollout.expertParallel needs a mixture-of-experts model, but {spec.model.name} has no experts "
                f"(none of {', '.join(EXPERT_KEYS)} in its config): set expertParallel to false"
            )
        if experts < spec.rollout.engines * spec.rollout.tensor_parallel_size:
            raise ValueError(
                f"rollout.expertParallel shards {experts} experts over engines x tensorParallelSize = "
                f"{spec.rollout.engines * spec.rollout.tensor_parallel_size} GPUs: use at most {experts} engine GPUs"
            )
