"""Tiny, locally built models for tests, demos and CPU benchmarks (no Hugging Face hub needed).

``build_tiny_model(path)`` writes a random-init Qwen2 causal LM (a few hundred thousand parameters) and a
character-level tokenizer to ``path`` with ``save_pretrained``, so both HF Transformers and vLLM load it
like any checkpoint. Embeddings are untied by default: with tied embeddings HF's ``named_parameters()``
yields the shared tensor once, which is the pitfall the weight sync handles by sending every alias
(``named_parameters(remove_duplicate=False)``).
"""

from __future__ import annotations

import string
from pathlib import Path

#: Characters the tokenizer knows, one token each, after the special tokens.
CHARS = string.ascii_lowercase + string.digits + " .,:;!?+-=*/()"
SPECIAL = ["<pad>", "<unk>", "<bos>", "<eos>"]


def build_tokenizer(path: str | Path, vocab_size: int = 64) -> None:
    """A character-level ``PreTrainedTokenizerFast`` saved to ``path``."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tokens = SPECIAL + list(CHARS)
    if len(tokens) > vocab_size:
        raise ValueError(f"vocab_size {vocab_size} < {len(tokens)} tokens")
    tokens += [f"<extra_{i}>" for i in range(vocab_size - len(tokens))]
    vocab = {t: i for i, t in enumerate(tokens)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", unk_token="<unk>", bos_token="<bos>", eos_token="<eos>"
    )
    fast.save_pretrained(str(path))


def build_tiny_model(
    path: str | Path,
    *,
    vocab_size: int = 64,
    hidden_size: int = 128,
    layers: int = 2,
    tie_word_embeddings: bool = False,
    seed: int = 0,
    dtype: str = "float32",
    arch: str = "qwen2",
    experts: int = 4,
) -> Path:
    """Write a random-init tiny model and its tokenizer to ``path``; returns the path.

    ``arch="qwen2"``: dense Qwen2. ``arch="qwen3_moe"``: Qwen3-MoE with ``experts`` experts (2 active), whose
    HF layout fuses each layer's experts into 3-D tensors (the runtime un-fuses them for vLLM, ``moe.py``).
    """
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config, Qwen3MoeConfig

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    common = {
        "vocab_size": vocab_size,
        "hidden_size": hidden_size,
        "intermediate_size": 2 * hidden_size,
        "num_hidden_layers": layers,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": hidden_size // 2,  # vLLM's CPU attention supports 64, 128, ...
        "max_position_embeddings": 512,
        "tie_word_embeddings": tie_word_embeddings,
        "bos_token_id": 2,
        "eos_token_id": 3,
        "pad_token_id": 0,
    }
    if arch == "qwen3_moe":
        cfg = Qwen3MoeConfig(
            **common, moe_intermediate_size=hidden_size // 4, num_experts=experts, num_experts_per_tok=2
        )
    elif arch == "qwen2":
        cfg = Qwen2Config(**common)
    else:
        raise ValueError(f"unknown tiny arch {arch!r}")
    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(cfg).to(getattr(torch, dtype)).save_pretrained(str(path))
    build_tokenizer(path, vocab_size)
    return path


def tiny_job_spec(model: str | Path, steps: int) -> dict:
    """An RLHFJob spec (wire form) that trains a tiny model on CPU in seconds: 1 CPU trainer, 1 engine, GRPO
    with a rule reward for emitting '7'. Used by the demo and the end-to-end test. The model is a local
    directory: ``spec.env`` keeps every process off the Hugging Face hub (the runtime does not force that)."""
    return {
        "model": {"name": str(model), "dtype": "float32"},
        "image": "ghcr.io/rlhf-operator/runtime:0.1.0",
        "trainer": {"replicas": 1, "gpusPerReplica": 0},
        "rollout": {
            "engines": 1, "tensorParallelSize": 1, "gpuMemoryUtilization": 0.05, "maxModelLen": 96,
            "sampling": {"temperature": 1.0, "maxTokens": 4, "samplesPerPrompt": 8},
        },
        "algorithm": {"steps": steps, "promptsPerStep": 8, "learningRate": 3e-3},
        "data": {"prompts": ["abc", "hello", "xyz", "12", "q", "say", "go", "rl"]},
        "reward": {"rule": "contains", "target": "7"},
        "env": [{"name": "HF_HUB_OFFLINE", "value": "1"}, {"name": "TRANSFORMERS_OFFLINE", "value": "1"}],
    }


def build_tiny_reward_model(
    path: str | Path,
    target: str = "a",
    *,
    vocab_size: int = 64,
    hidden_size: int = 32,
    num_labels: int = 1,
) -> Path:
    """Write a tiny Qwen2 reward model (``Qwen2ForSequenceClassification``, one label) and the character tokenizer
    to ``path``; returns the path. Its score MEANS something: it is about the fraction of the scored text's
    characters (prompt + completion) equal to ``target`` (``f / sqrt(1 + 0.01 f^2)``, so 0 for none and 0.995 for
    all), so for a fixed prompt and completion length it rises strictly with the completion's share of ``target``.

    The weights are set, not trained (deterministic, no seed). One decoder layer, one attention head:

    * embeddings: ``target`` is unit vector ``e0``, every other token ``e1`` (equal norms, so RMSNorm scales all
      tokens alike);
    * attention: q_proj and k_proj zero, so every score is 0 and causal softmax averages uniformly over the
      positions up to each token; v_proj reads ``e0`` (is this token ``target``?) and o_proj writes the average,
      scaled by 0.1, into ``e2`` of the residual stream: at the last token ``e2`` holds 0.1 * the fraction;
    * MLP: down_proj zero, so the layer adds nothing there; all norm weights are ones;
    * score head: reads ``e2`` of the final-normed last non-pad token (what HF's sequence classification pools),
      scaled back so the score is about the fraction.

    ``num_labels`` other than 1 gives a model a reward scorer must reject (tests); its extra rows are zero.
    """
    import torch
    from transformers import Qwen2Config, Qwen2ForSequenceClassification

    if len(target) != 1 or target not in CHARS:
        raise ValueError(f"target must be one character of the tiny tokenizer ({CHARS!r}), got {target!r}")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    cfg = Qwen2Config(
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=2 * hidden_size, num_hidden_layers=1,
        num_attention_heads=1, num_key_value_heads=1, head_dim=hidden_size, max_position_embeddings=512,
        tie_word_embeddings=False, bos_token_id=2, eos_token_id=3, pad_token_id=0, num_labels=num_labels,
    )
    model = Qwen2ForSequenceClassification(cfg).to(torch.float32)
    carry = 0.1  # o_proj's scale: small, so the final norm barely bends the fraction
    tid = len(SPECIAL) + CHARS.index(target)
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
        base, layer = model.model, model.model.layers[0]
        base.embed_tokens.weight[:, 1] = 1.0
        base.embed_tokens.weight[tid, 1] = 0.0
        base.embed_tokens.weight[tid, 0] = 1.0
        for norm in (layer.input_layernorm, layer.post_attention_layernorm, base.norm):
            norm.weight.fill_(1.0)
        # after input_layernorm a token is sqrt(hidden) * e0 or e1: v = [is target] in value dim 0
        layer.self_attn.v_proj.weight[0, 0] = hidden_size ** -0.5
        layer.self_attn.o_proj.weight[2, 0] = carry
        # final norm: e2 component = carry * f * sqrt(hidden) / sqrt(1 + (carry f)^2)
        model.score.weight[0, 2] = 1.0 / (carry * hidden_size ** 0.5)
    model.save_pretrained(str(path))
    build_tokenizer(path, vocab_size)
    return path
