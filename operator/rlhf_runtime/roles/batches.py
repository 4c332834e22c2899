"""The roles' batches: token ids per sample in, padded ``[B, T]`` tensors for the model, lists per token out.

A batch is the driver's: ``prompts`` and ``completions`` as token ids per sample. ``pad`` lays them out
right-padded, one row per sample, with the completion of sample ``i`` at positions ``len(prompt_i) ..
len(seq_i) - 1``; per-token results go back to the driver as lists over each sample's *completion* tokens only
(``to_lists``; ``from_lists`` is its inverse, for per-token inputs such as advantages, old log-probabilities,
returns). Every role runs its forward passes in micro-batches of ``MICRO_BATCH`` samples (``chunks``); a training
step weighs each micro-batch's loss by ``micro_share`` so that the accumulated gradient is the whole batch's.

``token_logprobs`` is the one definition of a token's log-probability that the trainer, its reference and the
reference actors share: the model's next-token distribution, at the rollout's sampling temperature.
"""

from __future__ import annotations

from typing import Any

import torch

#: Samples per micro-batch of every role's forward and backward passes.
MICRO_BATCH = 64


def pad(prompts: list[list[int]], completions: list[list[int]], device: Any) -> tuple[torch.Tensor, ...]:
    """``(input_ids, attention_mask, completion_mask)``, each ``[B, T]``, right-padded."""
    seqs = [p + c for p, c in zip(prompts, completions)]
    width = max(len(s) for s in seqs)
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    attn = torch.zeros(len(seqs), width, dtype=torch.long)
    mask = torch.zeros(len(seqs), width)
    for i, (s, p) in enumerate(zip(seqs, prompts)):
        ids[i, : len(s)] = torch.tensor(s)
        attn[i, : len(s)] = 1
        mask[i, len(p) : len(s)] = 1
    return ids.to(device), attn.to(device), mask.to(device)


def to_lists(x: torch.Tensor, prompts: list[list[int]], completions: list[list[int]]) -> list[list[float]]:
    """The completion positions of each row of ``x`` ([B, T]) as plain lists."""
    rows = x.detach().float().cpu()
    return [rows[i, len(p) : len(p) + len(c)].tolist() for i, (p, c) in enumerate(zip(prompts, completions))]


def from_lists(values: list[list[float]], prompts: list[list[int]], width: int, device: Any) -> torch.Tensor:
    """Inverse of ``to_lists``: a ``[B, width]`` tensor, zeros outside the completions."""
    out = torch.zeros(len(values), width)
    for i, (v, p) in enumerate(zip(values, prompts)):
        if v:
            out[i, len(p) : len(p) + len(v)] = torch.tensor(v, dtype=torch.float32)
    return out.to(device)


def micro_share(mask: torch.Tensor, total_tokens: float, rows: int, aggregation: str) -> float:
    """The weight of one micro-batch's loss (``mask``: its completion tokens) in the whole batch's: its share of
    the batch's ``total_tokens`` (token aggregation) or of its ``rows`` sequences (sequence aggregation)."""
    if aggregation == "token":
        return float(mask.sum()) / max(total_tokens, 1.0)
    return len(mask) / rows


def chunks(n: int) -> list[list[int]]:
    """The sample indices ``0 .. n - 1`` in micro-batches of at most ``MICRO_BATCH``, in order."""
    return [list(range(i, min(i + MICRO_BATCH, n))) for i in range(0, n, MICRO_BATCH)]


def token_logprobs(model: Any, input_ids: Any, attention_mask: Any, temperature: float = 1.0) -> Any:
    """Log-probability of each next token: [B, T] where position t scores ``input_ids[:, t]`` (t=0 is 0)."""
    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits[:, :-1].float()
    if temperature > 0 and temperature != 1.0:
        logits = logits / temperature
    lp = torch.log_softmax(logits, dim=-1).gather(-1, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    return torch.cat([torch.zeros_like(lp[:, :1]), lp], dim=1)
