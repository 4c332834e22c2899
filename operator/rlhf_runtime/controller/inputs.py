"""What every step of a run reads, loaded and checked before the first: the prompts, the reward, the storage
locations, the tokenizer and the model's config (``Runtime.inputs``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rlhf_runtime.algo.data import load_eval_samples, load_samples
from rlhf_runtime.algo.rewards import make_reward
from rlhf_runtime.infra import config as rc
from rlhf_runtime.infra import storage


@dataclass
class Inputs:
    """What every step reads: tokenizer, prompts, eval prompts, the reward rule or hook, sampling settings."""

    tokenizer: Any
    samples: list[Any]
    eval_samples: list[Any]
    reward_fn: Any
    sampling: dict[str, Any]
    n: int  # samples per prompt


def check_inputs(spec: Any) -> tuple[list[Any], list[Any], Any]:
    """Prompts, eval prompts and the reward rule or hook, that the model is there and that the object-store
    checkpoint and export locations answer (bucket, credentials, endpoint): checked before Ray starts (a bad
    input fails fast)."""
    samples, eval_samples = load_samples(spec.data), load_eval_samples(spec.data)
    reward_fn = make_reward(spec.reward, optional=spec.environment is not None)
    rc.check_model_path(spec.model.name)
    for field, loc in (("spec.checkpoint.uri", spec.checkpoint), ("spec.output.uri", spec.output)):
        if loc is not None and loc.uri:
            try:
                storage.Bucket(loc.uri).check()
            except storage.StorageError as e:
                raise storage.StorageError(f"{field}: {e}") from e
    return samples, eval_samples, reward_fn


def load_tokenizer(spec: Any) -> tuple[Any, int | None]:
    """The model's tokenizer, its config checked against the spec, and the engines' context in tokens
    (``rollout.maxModelLen``, else the model's ``max_position_embeddings``; None if it has none)
    (``transformers``: seconds to import, so ``Runtime.run`` does it while Ray starts, before any actor does)."""
    from transformers import AutoConfig, AutoTokenizer

    tok_kw: dict[str, Any] = {"trust_remote_code": spec.model.trust_remote_code}
    if spec.model.revision:
        tok_kw["revision"] = spec.model.revision
    try:
        tokenizer = AutoTokenizer.from_pretrained(spec.model.name, **tok_kw)
    except OSError as e:
        raise OSError(f"cannot load the tokenizer of spec.model.name {spec.model.name!r}: {e}") from e
    config = AutoConfig.from_pretrained(spec.model.name, **tok_kw).to_dict()
    rc.check_model(spec, config)
    rc.check_lora(spec)
    context = spec.rollout.max_model_len or (config.get("text_config") or config).get("max_position_embeddings")
    return tokenizer, int(context) if context else None
