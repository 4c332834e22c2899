"""The roles' batches: token ids per sample in, packed micro-batches for the model, lists per token out.

A batch is the driver's: ``prompts`` and ``completions`` as token ids per sample. Every role runs its forward
(and backward) passes on micro-batches chosen by tokens, not by samples:

* ``plan``: the samples in micro-batches of at most ``budget`` tokens (prompt + completion), first-fit
  decreasing; a sample longer than the budget is a micro-batch of its own. Under FSDP every rank must run the
  same number of forward passes (each is a collective): ``FSDPWorker.micro_batches`` agrees on the largest count
  and the others are filled with empty micro-batches (``pack([])``: one padding token whose loss weighs 0).
* ``pack``: one micro-batch laid out without padding, its sequences end to end in one row ``[1, L]``, with
  position ids that restart at 0 in every sequence. Hugging Face models read restarting position ids (with no
  attention mask and no KV cache: ``use_cache=False``) as packed sequences and keep attention inside each one
  (a block-diagonal mask with SDPA; on GPUs ``roles.attention``'s variable-length FlashAttention over the
  boundaries ``cu``, which costs the sum of the sequences' squares instead of the row's). ``mask`` is 1 on completion tokens, ``seq`` says which
  sequence of the micro-batch a token belongs to (sequence-level loss aggregation).
* ``to_lists`` (``put``) / ``from_lists`` / ``per_token``: per-token values of a micro-batch back to lists over each
  sample's *completion* tokens, and the inverse (advantages, old log-probabilities, returns).

``token_logprobs`` is the one definition of a token's log-probability that the trainer, its reference and the
reference actors share: the model's next-token distribution at the rollout's sampling temperature, for the
completion tokens only. It never materialises the ``[L, vocab]`` float32 logits: the final hidden states of the
completion positions go through the output layer ``LOGIT_CHUNK_ELEMENTS / vocab`` tokens at a time, each chunk's
logits recomputed in the backward pass instead of kept (``_HeadScores``: one matrix multiplication and the softmax
gradient in place; soft-capped heads checkpoint the chunk's whole forward), so peak memory grows with the chunk,
not with the sequence. It can also give each token's entropy (no gradient; a metric).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.utils.checkpoint

#: Float32 logits (tokens x vocabulary) computed at once by ``token_logprobs``: 2^29 elements = 2 GiB, e.g.
#: 3,533 tokens of a 152k vocabulary (Qwen3). Larger chunks mean fewer, larger output-layer matrix
#: multiplications for more peak memory (the comparison: benchmarks/results/trainer/README.md).
LOGIT_CHUNK_ELEMENTS = 1 << 29
#: ``from_pretrained`` config attributes that scale a model's logits in ways ``OutputHead`` does not apply
#: itself: such models score through their own (full) logits.
UNHANDLED_LOGIT_SCALING = ("logit_scale", "logits_scaling", "output_multiplier_scale", "mup_width_scale")


@dataclass
class Packed:
    """One micro-batch (module docstring): the samples ``idx`` of the batch end to end in one row."""

    idx: list[int]
    ids: torch.Tensor  # [1, L] token ids
    pos: torch.Tensor  # [1, L] position ids, from 0 in every sequence
    mask: torch.Tensor  # [1, L] float, 1 on completion tokens
    seq: torch.Tensor  # [1, L] long, the index in ``idx`` of each token's sample
    starts: list[int]  # where each sample's completion starts in the row
    lengths: list[int]  # each sample's completion length
    where: torch.Tensor  # [N] long, the positions scored: the completion tokens (or one padding token, see pack)
    cu: torch.Tensor  # [n + 1] int32, where each sequence of the row starts, and its end (varlen attention)
    trained: int = -1  # completion tokens with loss mask 1 (all of them without loss masks)

    @property
    def tokens(self) -> int:
        """Completion tokens the loss trains on (what a token-mean loss averages over): every completion token,
        except those a loss mask leaves out (a multi-turn trajectory's tool and environment tokens)."""
        return sum(self.lengths) if self.trained < 0 else self.trained

    @property
    def width(self) -> int:
        return int(self.ids.shape[1])

    def attn_kwargs(self) -> dict[str, Any]:
        """The sequence boundaries, as Hugging Face's attention functions take them (``roles.attention``'s
        variable-length attention; FlashAttention-2 too): no mask is needed with them."""
        longest = int((self.cu[1:] - self.cu[:-1]).max())
        return {"cu_seq_lens_q": self.cu, "cu_seq_lens_k": self.cu, "max_length_q": longest, "max_length_k": longest}


def plan(lengths: list[int], budget: int) -> list[list[int]]:
    """Sample indices in micro-batches of at most ``budget`` tokens each (``lengths``: prompt + completion per
    sample): first-fit decreasing, deterministic; a sample over the budget goes alone."""
    if budget < 1:
        raise ValueError(f"token budget {budget} < 1")
    bins: list[list[int]] = []
    loads: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        for b, load in enumerate(loads):
            if load + lengths[i] <= budget:
                bins[b].append(i)
                loads[b] += lengths[i]
                break
        else:
            bins.append([i])
            loads.append(lengths[i])
    return [sorted(b) for b in bins]


def pack(prompts: list[list[int]], completions: list[list[int]], idx: list[int], device: Any,
         loss_masks: list[list[int]] | None = None) -> Packed:
    """The samples ``idx`` as one packed row (module docstring). A completion token at a sequence's first
    position has no previous token to be predicted from: every prompt must be non-empty. ``loss_masks`` (per
    sample, one 0/1 per completion token): ``mask`` is 0 where it is 0 (the tool and environment tokens of a
    multi-turn trajectory: scored, never trained on).

    Without any completion token (``idx`` empty: a micro-batch that only keeps the FSDP ranks' passes in step)
    a padding token is appended and scored (``where``) with mask 0: the forward and backward still run through
    every parameter, so every rank reduces the same gradients, and the loss weighs nothing."""
    ids: list[int] = []
    pos: list[int] = []
    seq: list[int] = []
    starts: list[int] = []
    lengths: list[int] = []
    for k, i in enumerate(idx):
        p, c = prompts[i], completions[i]
        if not p:
            raise ValueError(f"sample {i} has an empty prompt: its first token cannot be scored")
        starts.append(len(ids) + len(p))
        lengths.append(len(c))
        ids += list(p) + list(c)
        pos += range(len(p) + len(c))
        seq += [k] * (len(p) + len(c))
    scored = [t for s, n in zip(starts, lengths) for t in range(s, s + n)]
    bounds = [0] + [len(prompts[i]) + len(completions[i]) for i in idx]
    if not scored:
        ids, pos, seq = ids + [0, 0], pos + [0, 1], seq + [len(idx)] * 2
        scored = [len(ids) - 1]
        bounds.append(2)
    cu = torch.tensor(bounds, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    mask = torch.zeros(len(ids))
    for i, s, n in zip(idx, starts, lengths):
        if loss_masks is None:
            mask[s : s + n] = 1
        elif len(loss_masks[i]) != n:
            raise ValueError(f"sample {i}: a loss mask of {len(loss_masks[i])} for {n} completion tokens")
        elif n:
            mask[s : s + n] = torch.tensor(loss_masks[i], dtype=torch.float32)
    trained = -1 if loss_masks is None else int(mask.sum())
    row = lambda v: torch.tensor([v], dtype=torch.long, device=device)
    return Packed(list(idx), row(ids), row(pos), mask[None].to(device), row(seq), starts, lengths,
                  torch.tensor(scored, dtype=torch.long, device=device), cu.to(device), trained)


def to_lists(x: torch.Tensor, packed: Packed) -> list[list[float]]:
    """The completion positions of ``x`` (``[1, L]``) as one list per sample, in ``packed.idx`` order."""
    row = x.detach().float().reshape(-1).cpu()
    return [row[s : s + n].tolist() for s, n in zip(packed.starts, packed.lengths)]


def put(out: list[list[float]], x: torch.Tensor, packed: Packed) -> None:
    """``to_lists`` written into the batch's lists ``out`` at the micro-batch's sample indices."""
    for i, v in zip(packed.idx, to_lists(x, packed)):
        out[i] = v


def from_lists(values: list[list[float]], packed: Packed) -> torch.Tensor:
    """Inverse of ``to_lists`` (``values``: the batch's lists, indexed by sample): ``[1, L]``, 0 elsewhere."""
    out = torch.zeros(packed.width)
    for i, s, n in zip(packed.idx, packed.starts, packed.lengths):
        v = values[i]
        if len(v) != n:
            raise ValueError(f"sample {i}: {len(v)} per-token values for {n} completion tokens")
        if n:
            out[s : s + n] = torch.tensor(v, dtype=torch.float32)
    return out[None].to(packed.ids.device)


def per_token(values: list[float], packed: Packed) -> torch.Tensor:
    """One value per sample (``values``, indexed by sample) on each of its completion tokens: ``[1, L]``."""
    out = torch.zeros(packed.width)
    for i, s, n in zip(packed.idx, packed.starts, packed.lengths):
        out[s : s + n] = float(values[i])
    return out[None].to(packed.ids.device)


def micro_share(micro: Packed, total_tokens: float, rows: int, aggregation: str) -> float:
    """The weight of one micro-batch's loss in the whole batch's: its share of the batch's ``total_tokens``
    (token aggregation) or of its ``rows`` sequences (sequence aggregation)."""
    if aggregation == "token":
        return micro.tokens / max(total_tokens, 1.0)
    return len(micro.idx) / max(rows, 1)


# ----------------------------------------------------------------------------------------- log-probs
class OutputHead:
    """How a causal LM turns final hidden states into logits, when ``token_logprobs`` can apply it itself: the
    output embedding's weight and bias and Gemma-2's final logit soft-capping; ``of`` is None for a model that
    scales its logits some other way (``UNHANDLED_LOGIT_SCALING``) or has no output embedding."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, softcap: float | None) -> None:
        self.weight, self.bias, self.softcap = weight, bias, softcap

    @staticmethod
    def of(lm: Any) -> OutputHead | None:
        cfg = getattr(lm, "config", None)
        if any(getattr(cfg, a, None) not in (None, 1, 1.0) for a in UNHANDLED_LOGIT_SCALING):
            return None
        head = lm.get_output_embeddings() if hasattr(lm, "get_output_embeddings") else None
        if head is None or not hasattr(head, "weight"):
            return None
        return OutputHead(head.weight, getattr(head, "bias", None), getattr(cfg, "final_logit_softcapping", None))

    def logits(self, h: torch.Tensor, temperature: float) -> torch.Tensor:
        x = torch.nn.functional.linear(h, self.weight, self.bias).float()
        if self.softcap:
            x = torch.tanh(x / self.softcap) * self.softcap
        return x / temperature if temperature > 0 and temperature != 1.0 else x


def _wide(x: torch.Tensor) -> torch.Tensor:
    """``x`` in float32 at least (float64 stays float64)."""
    return x.float() if x.element_size() < 4 else x


def autocast_state(device_type: str) -> torch.dtype | None:
    """The dtype ``torch.autocast`` computes in on ``device_type`` now, or None where it is off."""
    return torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else None


def restored_autocast(device_type: str, dtype: torch.dtype | None) -> Any:
    """The autocast state ``autocast_state`` returned, for a backward pass (which runs outside the forward's
    autocast region): on with ``dtype``, else off."""
    return torch.autocast(device_type=device_type, dtype=dtype, enabled=dtype is not None)


class _HeadScores(torch.autograd.Function):
    """A chunk's log-probabilities (and entropies, no gradient) through the output layer ``h @ W.T + b`` at a
    temperature, keeping only the chunk's log-sum-exp for the backward pass: there the logits are recomputed
    once (one matrix multiplication) and their gradient is formed from the softmax in place, ``g * (onehot -
    softmax) / T``. The same numbers as checkpointing ``_chunk_scores`` without redoing its whole forward in the
    backward pass (the float32 casts, the log-sum-exp and the entropy's softmax over the vocabulary). Under
    ``torch.autocast`` (``trainer.autocast``) the backward recomputes the logits in the forward's autocast state,
    so they match the log-sum-exp kept and its matrix multiplications run in the autocast dtype too."""

    @staticmethod
    def forward(ctx: Any, h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, targets: torch.Tensor,
                temperature: float, entropy: bool) -> tuple[torch.Tensor, torch.Tensor]:
        scale = 1.0 / temperature if temperature > 0 and temperature != 1.0 else 1.0
        logits = _wide(torch.nn.functional.linear(h, weight, bias))
        if scale != 1.0:
            logits.mul_(scale)
        lse = torch.logsumexp(logits, -1)
        lp = logits.gather(-1, targets[:, None]).squeeze(-1) - lse
        ent = lse - (torch.softmax(logits, -1) * logits).sum(-1) if entropy else lp.new_zeros(())
        ctx.save_for_backward(h, weight, bias, targets, lse)
        ctx.scale = scale
        ctx.cast = autocast_state(h.device.type)  # the backward recomputes the logits as this forward did
        ctx.mark_non_differentiable(ent)
        return lp, ent

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor, _g_ent: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        h, weight, bias, targets, lse = ctx.saved_tensors
        with restored_autocast(h.device.type, ctx.cast):
            return _HeadScores._grads(ctx, g, h, weight, bias, targets, lse)

    @staticmethod
    def _grads(ctx: Any, g: torch.Tensor, h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
               targets: torch.Tensor, lse: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        grad = _wide(torch.nn.functional.linear(h, weight, bias))
        if ctx.scale != 1.0:
            grad.mul_(ctx.scale)
        grad.sub_(lse[:, None]).exp_().mul_(-g[:, None])  # -g * softmax
        grad.scatter_add_(-1, targets[:, None], g[:, None].to(grad.dtype))  # + g at the sampled token
        if ctx.scale != 1.0:
            grad.mul_(ctx.scale)
        grad = grad.to(h.dtype)
        gh = grad @ weight if ctx.needs_input_grad[0] else None
        gw = grad.t() @ h if ctx.needs_input_grad[1] else None
        gb = grad.sum(0) if bias is not None and ctx.needs_input_grad[2] else None
        return gh, gw, gb, None, None, None


def _chunk_scores(head: OutputHead, h: torch.Tensor, targets: torch.Tensor, temperature: float,
                  entropy: bool) -> tuple[torch.Tensor, torch.Tensor]:
    logits = head.logits(h, temperature)
    lse = torch.logsumexp(logits, -1)
    lp = logits.gather(-1, targets[:, None]).squeeze(-1) - lse
    if not entropy:
        return lp, lp.new_zeros(())
    with torch.no_grad():
        ent = lse - (torch.softmax(logits, -1) * logits).sum(-1)
    return lp, ent


def causal_lm(model: Any) -> Any:
    """The Hugging Face causal LM inside ``model`` (a PEFT model's base, with its adapter layers)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def scores_from_hidden(head: OutputHead, hidden: torch.Tensor, packed: Packed, temperature: float,
                       entropy: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``token_logprobs`` from the final hidden states ``hidden`` ([L, H]) of ``packed``'s row."""
    where = packed.where
    targets = packed.ids[0, where]
    h = hidden[where - 1]
    step = max(1, LOGIT_CHUNK_ELEMENTS // max(1, int(head.weight.shape[0])))
    lps, ents = [], []
    for i in range(0, len(where), step):
        args = (head, h[i : i + step], targets[i : i + step], temperature, entropy)
        if torch.is_grad_enabled() and not head.softcap:
            lp, ent = _HeadScores.apply(h[i : i + step], head.weight, head.bias, targets[i : i + step], temperature,
                                        entropy)
        elif torch.is_grad_enabled():  # soft-capped logits (Gemma-2): the chunk's whole forward again
            lp, ent = torch.utils.checkpoint.checkpoint(_chunk_scores, *args, use_reentrant=False)
        else:
            lp, ent = _chunk_scores(*args)
        lps.append(lp)
        ents.append(ent)
    flat = torch.cat(lps)
    logp = flat.new_zeros(1, packed.width).scatter(1, where[None], flat[None]) * packed.mask
    if not entropy:
        return logp, None
    e = torch.cat(ents)
    return logp, e.new_zeros(1, packed.width).scatter(1, where[None], e[None]) * packed.mask


def scores_from_logits(logits: torch.Tensor, packed: Packed, temperature: float,
                       entropy: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``token_logprobs`` from a model's own full logits (``[1, L, V]``; models ``OutputHead`` cannot apply)."""
    x = logits[0, :-1].float()
    if temperature > 0 and temperature != 1.0:
        x = x / temperature
    lsm = torch.log_softmax(x, -1)
    lp = torch.cat([lsm.new_zeros(1), lsm.gather(-1, packed.ids[0, 1:, None]).squeeze(-1)])
    ent = None
    if entropy:
        with torch.no_grad():
            ent = torch.cat([lsm.new_zeros(1), -(lsm.exp() * lsm).sum(-1)])[None] * packed.mask
    return lp[None] * packed.mask, ent


class TokenScorer(torch.nn.Module):
    """``token_logprobs`` as a module around the policy: under FSDP2 it is the root that ``fully_shard`` wraps
    (``Trainer.fsdp_root``), so the parameters outside the decoder layers (embeddings, final norm, output layer)
    are gathered for the whole of its forward, the chunked output layer included."""

    def __init__(self, model: Any) -> None:
        super().__init__()
        self.model = model

    def forward(self, packed: Packed, temperature: float = 1.0,
                entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        lm = causal_lm(self.model)
        head = OutputHead.of(lm)
        if head is None:
            out = self.model(input_ids=packed.ids, position_ids=packed.pos, use_cache=False, **packed.attn_kwargs())
            return scores_from_logits(out.logits, packed, temperature, entropy)
        base = getattr(lm, lm.base_model_prefix)
        hidden = base(input_ids=packed.ids, position_ids=packed.pos, use_cache=False,
                      **packed.attn_kwargs()).last_hidden_state[0]
        return scores_from_hidden(head, hidden, packed, temperature, entropy)


def token_logprobs(model: Any, packed: Packed, temperature: float = 1.0,
                   entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probability of each completion token of ``packed`` under ``model`` (a ``TokenScorer`` or a causal LM)
    at ``temperature``, ``[1, L]`` (0 off the completion tokens), and with ``entropy`` the entropy of each of
    those tokens' distributions (no gradient), else None."""
    scorer = model if isinstance(model, TokenScorer) else TokenScorer(model)
    return scorer(packed, temperature, entropy)
