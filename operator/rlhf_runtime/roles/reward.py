"""A reward model scorer (``spec.reward.model``): a Hugging Face sequence-classification model with one label.

``RewardScorer`` is a plain class; the driver wraps it with ``ray.remote`` (one scoring worker per GPU, or beside
each trainer worker). torch and transformers are imported when one is built, not with this module.

What is scored is the plain concatenation ``prompt + completion``, tokenized as the tokenizer does by default
(special tokens such as a BOS included), with no chat template applied: a chat reward model gets the prompt as the
runtime hands it over (already templated when ``spec.data`` renders chat messages). The score is the model's single
logit at the last non-padding token, which is what HF's ``...ForSequenceClassification`` pools: batches are padded
on the right, and the model's ``config.pad_token_id`` is set to the tokenizer's pad token (its EOS token when it has
none) so HF finds that token. A text longer than the model's context is cut on the left, keeping the completion's
end, where the score is read.
"""

from __future__ import annotations

import math
from typing import Any

from rlhf_runtime.infra.config import check_model_path

FIELD = "spec.reward.model.name"


class RewardScorer:
    """Loads ``name`` (tokenizer + ``AutoModelForSequenceClassification``) once and scores batches of samples."""

    def __init__(self, name: str, revision: str | None, dtype: str, batch_size: int, device: str | None = None,
                 trust_remote_code: bool = False) -> None:
        import torch
        from safetensors import SafetensorError
        from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer

        if batch_size < 1:
            raise ValueError(f"spec.reward.model.batchSize must be at least 1, got {batch_size}")
        if dtype not in ("bfloat16", "float16", "float32"):
            raise ValueError(f"unknown dtype {dtype!r} for the reward model {name!r} (bfloat16, float16 or float32)")
        torch_dtype = getattr(torch, dtype)
        check_model_path(name, FIELD, "reward model")
        self.name, self.batch_size = name, batch_size
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        kw: dict[str, Any] = {"trust_remote_code": trust_remote_code}
        if revision:
            kw["revision"] = revision
        try:
            config = AutoConfig.from_pretrained(name, **kw)
            self.tokenizer = AutoTokenizer.from_pretrained(name, **kw)
        except OSError as e:
            raise OSError(f"cannot load the reward model {FIELD} {name!r}: {e}") from e
        if config.num_labels != 1:
            raise ValueError(
                f"{FIELD} {name!r} has num_labels {config.num_labels}: a reward model must be a sequence-"
                "classification model with exactly one label (num_labels 1), whose logit is the score"
            )
        try:
            model, info = AutoModelForSequenceClassification.from_pretrained(
                name, dtype=torch_dtype, output_loading_info=True, **kw)
        except (OSError, ValueError, SafetensorError) as e:  # ValueError: no sequence-classification class for
            # this architecture; SafetensorError: a corrupt or truncated weights file
            raise (type(e) if isinstance(e, (OSError, ValueError)) else ValueError)(
                f"cannot load the reward model {FIELD} {name!r} as a sequence-classification model: {e}") from e
        if info.get("missing_keys"):
            missing = sorted(info["missing_keys"])
            raise ValueError(
                f"{FIELD} {name!r} lacks trained weights for {', '.join(missing[:5])}"
                f"{' ...' if len(missing) > 5 else ''}: they would be random, so its scores would mean nothing "
                "(is it a language model rather than a reward model?)"
            )
        tok = self.tokenizer
        if tok.pad_token is None:
            if tok.eos_token is None:
                raise ValueError(f"the tokenizer of {FIELD} {name!r} has neither a pad nor an EOS token: batches "
                                 "cannot be padded")
            tok.pad_token = tok.eos_token
        tok.padding_side = "right"
        tok.truncation_side = "left"
        model.config.pad_token_id = tok.pad_token_id  # HF pools the last token that is not this one
        limit = getattr(model.config, "max_position_embeddings", None)
        self.max_length = min(limit, tok.model_max_length) if isinstance(limit, int) else None
        self.model = model.to(self.device).eval()
        self.model.requires_grad_(False)

    def score(self, prompts: list[str], completions: list[str]) -> list[float]:
        """One float per sample: the model's logit for ``prompt + completion``, in batches of ``batch_size``."""
        import torch

        if len(prompts) != len(completions):
            raise ValueError(f"{len(prompts)} prompts but {len(completions)} completions")
        texts = [p + c for p, c in zip(prompts, completions)]
        out: list[float] = []
        with torch.inference_mode():
            for i in range(0, len(texts), self.batch_size):
                enc = self.tokenizer(texts[i:i + self.batch_size], return_tensors="pt", padding=True,
                                     truncation=self.max_length is not None, max_length=self.max_length)
                logits = self.model(**enc.to(self.device)).logits
                out.extend(float(v) for v in logits[:, 0].float().cpu())
        bad = [i for i, v in enumerate(out) if not math.isfinite(v)]
        if bad:
            raise ValueError(f"the reward model {FIELD} {self.name!r} gave non-finite scores ({out[bad[0]]}) for "
                             f"{len(bad)} of {len(out)} samples (first: sample {bad[0]}); with float16 try bfloat16 "
                             "or float32")
        return out

    def info(self) -> dict[str, Any]:
        return {"name": self.name, "device": str(self.device), "dtype": str(self.model.dtype).split(".")[-1],
                "parameters": sum(p.numel() for p in self.model.parameters()), "batch_size": self.batch_size}
