"""Packed micro-batches and chunked log-probabilities (``roles.batches``) against the padded, full-logits way they
replace, and the float32 master weights (``roles.precision``); a tiny random Qwen2 built in memory (CPU)."""

from __future__ import annotations

import contextlib

import pytest
import torch

from rlhf_runtime.algo.objectives import aggregate, policy_loss
from rlhf_runtime.roles import batches
from rlhf_runtime.roles.batches import pack, plan, to_lists, token_logprobs
from rlhf_runtime.roles.precision import MasterWeights


def tiny_lm(vocab: int = 64, tie: bool = False, softcap: float | None = None, dtype=torch.float32):
    from transformers import Gemma2Config, Gemma2ForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    common = {"vocab_size": vocab, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
              "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32, "max_position_embeddings": 256,
              "tie_word_embeddings": tie}
    if softcap:
        cfg = Gemma2Config(**common, final_logit_softcapping=softcap, attn_implementation="sdpa")
        return Gemma2ForCausalLM(cfg).to(dtype).eval()
    return Qwen2ForCausalLM(Qwen2Config(**common, attn_implementation="sdpa")).to(dtype).eval()


def samples(n: int = 6, seed: int = 1) -> tuple[list[list[int]], list[list[int]]]:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(1, 9, (n, 2), generator=g).tolist()
    prompts = [torch.randint(5, 60, (a,), generator=g).tolist() for a, _ in lens]
    completions = [torch.randint(5, 60, (b,), generator=g).tolist() for _, b in lens]
    return prompts, completions


def padded_logprobs(model, prompts, completions, temperature: float = 1.0) -> list[list[float]]:
    """The reference: each sample alone in a row, the model's full float32 logits, log-softmax."""
    out = []
    for p, c in zip(prompts, completions):
        ids = torch.tensor([p + c])
        logits = model(input_ids=ids).logits[0, :-1].float() / temperature
        lp = torch.log_softmax(logits, -1).gather(-1, ids[0, 1:, None]).squeeze(-1)
        out.append(lp[len(p) - 1 :].tolist())
    return out


def test_plan_packs_every_sample_once_within_the_budget() -> None:
    lengths = [5, 12, 3, 30, 7, 7, 1, 16]
    bins = plan(lengths, 16)
    assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
    for b in bins:
        assert sum(lengths[i] for i in b) <= 16 or len(b) == 1  # the 30-token sample goes alone
    assert [3] in bins
    # first-fit decreasing: 30 | 16 | 12+3+1 | 7+7 | 5: the fewest (30 alone, the other 51 tokens need 4 bins)
    assert bins == [[3], [7], [1, 2, 6], [4, 5], [0]]
    with pytest.raises(ValueError):
        plan(lengths, 0)


def test_pack_lays_samples_end_to_end_with_restarting_positions() -> None:
    prompts, completions = [[5, 6], [7, 8, 9]], [[10, 11, 12], [13]]
    m = pack(prompts, completions, [1, 0], "cpu")
    assert m.ids.tolist() == [[7, 8, 9, 13, 5, 6, 10, 11, 12]]
    assert m.pos.tolist() == [[0, 1, 2, 3, 0, 1, 2, 3, 4]]
    assert m.mask.tolist() == [[0, 0, 0, 1, 0, 0, 1, 1, 1]]
    assert m.seq.tolist() == [[0, 0, 0, 0, 1, 1, 1, 1, 1]]
    assert m.where.tolist() == [3, 6, 7, 8]
    assert m.tokens == 4 and to_lists(torch.arange(9.0)[None], m) == [[3.0], [6.0, 7.0, 8.0]]
    assert batches.from_lists([[1.0, 2.0, 3.0], [4.0]], m).tolist() == [[0, 0, 0, 4, 0, 0, 1, 2, 3]]
    empty = pack(prompts, completions, [], "cpu")
    assert empty.tokens == 0 and empty.ids.shape == (1, 2) and empty.mask.sum() == 0 and empty.where.tolist() == [1]
    with pytest.raises(ValueError, match="empty prompt"):
        pack([[]], [[1]], [0], "cpu")


@pytest.mark.parametrize("tie", [False, True])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_packed_chunked_logprobs_equal_each_sample_alone_with_full_logits(tie: bool, temperature: float,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    model = tiny_lm(tie=tie)
    prompts, completions = samples()
    want = padded_logprobs(model, prompts, completions, temperature)
    monkeypatch.setattr(batches, "LOGIT_CHUNK_ELEMENTS", 64 * 5)  # 5 tokens per chunk: several chunks
    with torch.no_grad():
        for idx in plan([len(p) + len(c) for p, c in zip(prompts, completions)], 20):
            m = pack(prompts, completions, idx, "cpu")
            got = to_lists(token_logprobs(model, m, temperature)[0], m)
            for i, g in zip(idx, got):
                assert torch.allclose(torch.tensor(g), torch.tensor(want[i]), atol=2e-5), (i, g, want[i])


def test_chunked_gradient_equals_the_full_logits_gradient(monkeypatch: pytest.MonkeyPatch) -> None:
    prompts, completions = samples(4)
    m = pack(prompts, completions, [0, 1, 2, 3], "cpu")
    grads = []
    for chunk in (64 * 3, 1 << 27):  # 3 tokens per chunk (checkpointed), everything at once
        monkeypatch.setattr(batches, "LOGIT_CHUNK_ELEMENTS", chunk)
        model = tiny_lm()
        logp, _ = token_logprobs(model, m)
        (logp * torch.linspace(-1, 1, m.width)).sum().backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    assert torch.allclose(grads[0], grads[1], atol=1e-5, rtol=1e-4)
    # and the full-logits path of models whose logit scaling token_logprobs does not apply itself
    model = tiny_lm()
    logp_full, _ = batches.scores_from_logits(model(input_ids=m.ids, position_ids=m.pos, use_cache=False).logits, m, 1.0, False)
    assert torch.allclose(logp_full, token_logprobs(model, m)[0], atol=2e-5)


def test_softcapped_logits_are_applied() -> None:
    model = tiny_lm(softcap=0.5)  # a tight cap, so that leaving it out would show
    prompts, completions = samples(3)
    want = padded_logprobs(model, prompts, completions)
    m = pack(prompts, completions, [0, 1, 2], "cpu")
    with torch.no_grad():
        got = to_lists(token_logprobs(model, m)[0], m)
    for g, w in zip(got, want):
        assert torch.allclose(torch.tensor(g), torch.tensor(w), atol=2e-5)


def test_entropy_is_the_distributions_entropy() -> None:
    model = tiny_lm()
    prompts, completions = samples(2)
    m = pack(prompts, completions, [0, 1], "cpu")
    with torch.no_grad():
        _, ent = token_logprobs(model, m, entropy=True)
        logits = model(input_ids=m.ids, position_ids=m.pos, use_cache=False).logits[0].float()
    lsm = torch.log_softmax(logits, -1)
    want = -(lsm.exp() * lsm).sum(-1)
    where = m.mask[0].nonzero().squeeze(-1)
    assert torch.allclose(ent[0, where], want[where - 1], atol=1e-5)
    assert float(ent[0][m.mask[0] == 0].abs().sum()) == 0.0


@pytest.mark.parametrize("aggregation", ["token", "sequence"])
def test_packed_loss_equals_the_padded_loss(aggregation: str) -> None:
    g = torch.Generator().manual_seed(3)
    prompts, completions = samples(5, seed=3)
    m = pack(prompts, completions, list(range(5)), "cpu")
    logp = torch.randn(1, m.width, generator=g) * m.mask
    old = logp + 0.3 * torch.randn(1, m.width, generator=g) * m.mask
    adv = [1.0, -0.5, 0.2, 0.0, -1.2]
    loss, stats = policy_loss(logp, old, batches.per_token(adv, m), m.mask, 0.2, 0.28, aggregation, seq=m.seq)
    # the same values laid out one sample per row, right-padded
    width = max(len(p) + len(c) for p, c in zip(prompts, completions))
    rows = torch.zeros(5, width, 3)
    for k, (p, c) in enumerate(zip(prompts, completions)):
        s = m.starts[k]
        rows[k, len(p) : len(p) + len(c), 0] = logp[0, s : s + len(c)]
        rows[k, len(p) : len(p) + len(c), 1] = old[0, s : s + len(c)]
        rows[k, len(p) : len(p) + len(c), 2] = 1
    want, want_stats = policy_loss(rows[..., 0], rows[..., 1], torch.tensor(adv), rows[..., 2], 0.2, 0.28,
                                   aggregation)
    assert torch.allclose(loss, want, atol=1e-6) and stats["clip_fraction"] == pytest.approx(
        want_stats["clip_fraction"])
    assert torch.allclose(aggregate(m.mask * 2.0, m.mask, aggregation, m.seq), torch.tensor(2.0))


def test_master_weights_keep_the_updates_bfloat16_loses() -> None:
    """10 AdamW steps at lr 1e-6 on a bfloat16 weight: with float32 masters the update is float32's; on the
    bfloat16 weight itself nearly all of it is lost."""
    torch.manual_seed(0)
    w0 = torch.randn(256, 256) * 0.02
    grads = [torch.randn(256, 256) for _ in range(10)]

    def run(dtype: torch.dtype, masters: bool) -> torch.Tensor:
        p = torch.nn.Parameter(w0.to(dtype).clone())
        mw = MasterWeights([p]) if masters else None
        opt = torch.optim.AdamW(mw.params if mw else [p], lr=1e-6, weight_decay=0.0)
        for g in grads:
            opt.zero_grad(set_to_none=True)
            (p * g.to(dtype)).sum().backward()  # the gradient of the weight is g (in dtype)
            opt.step()
            if mw:
                mw.copy_to_model()
        final = mw.pairs[0][1] if mw else p
        return (final.detach().float() - w0.to(dtype).float()).flatten()

    ref = run(torch.float32, False)
    kept, lost = run(torch.bfloat16, True), run(torch.bfloat16, False)
    assert float((kept - ref).norm() / ref.norm()) < 0.01  # within 1% of the float32 update
    assert float((lost != 0).float().mean()) < 0.1  # without masters, <10% of the bfloat16 weights moved at all
    assert float(lost.abs().mean() / ref.abs().mean()) < 0.2


def varlen_against_sdpa(monkeypatch: pytest.MonkeyPatch,
                        context) -> tuple[list, list[int], torch.Tensor, torch.Tensor]:
    """``token_logprobs`` of 4 packed samples under ``context`` with SDPA and its mask (``want``) and with
    ``roles.attention``'s function (``got``), whose kernel (CUDA-only) is replaced by causal SDPA over each segment
    with the kernel's signature. Returns the kernel's calls (boundaries, max length, window, GQA, the dtypes of
    q/k/v), the samples' lengths, ``got`` and ``want``."""
    from rlhf_runtime.roles import attention

    calls = []

    def segmentwise(q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None, window_size=(-1, -1), enable_gqa=False):
        calls.append((cu_q.tolist(), max_q, window_size, enable_gqa, {q.dtype, k.dtype, v.dtype}))
        out = []
        for a, b in zip(cu_q[:-1].tolist(), cu_q[1:].tolist()):
            qq, kk, vv = (x[a:b].transpose(0, 1) for x in (q, k, v))
            o = torch.nn.functional.scaled_dot_product_attention(qq, kk, vv, is_causal=True, scale=scale,
                                                                 enable_gqa=enable_gqa)
            out.append(o.transpose(0, 1))
        return torch.cat(out)

    monkeypatch.setattr(attention, "_kernel", lambda *_: segmentwise)
    model = tiny_lm()
    prompts, completions = samples(4)
    m = pack(prompts, completions, [0, 1, 2, 3], "cpu")
    with torch.no_grad(), context:
        want = token_logprobs(model, m)[0]
        attention.register()
        model.set_attn_implementation(attention.NAME)
        got = token_logprobs(model, m)[0]
    return calls, [len(p) + len(c) for p, c in zip(prompts, completions)], got, want


def test_varlen_attention_gets_each_sequences_boundaries(monkeypatch: pytest.MonkeyPatch) -> None:
    """``roles.attention``'s function through a Hugging Face model: the kernel (CUDA-only, replaced here by causal
    SDPA over each segment, with the kernel's signature) receives the packed row's boundaries and the causal
    window, and the log-probabilities equal SDPA's with its block-diagonal mask."""
    calls, lens, got, want = varlen_against_sdpa(monkeypatch, contextlib.nullcontext())
    assert calls and calls[0][:4] == ([0, *torch.tensor(lens).cumsum(0).tolist()], max(lens), (-1, 0), True)
    assert torch.allclose(got, want, atol=2e-5)


def test_cpu_segments_attention_equals_sdpa_with_its_mask() -> None:
    """On a CPU, ``rlhf_varlen`` runs causal SDPA over each packed sequence (``attention.segments``): the
    log-probabilities and the gradients of a packed row equal SDPA's with its block-diagonal mask, and a forward
    without boundaries (one sequence) equals SDPA's causal one."""
    from rlhf_runtime.roles import attention

    prompts, completions = samples(4)
    m = pack(prompts, completions, [0, 1, 2, 3], "cpu")
    results = []
    for varlen in (False, True):
        model = tiny_lm()
        if varlen:
            assert attention.use_varlen(model, torch.device("cpu"), torch.float32)
            assert model.config._attn_implementation == attention.NAME
        lp = token_logprobs(model, m)[0]
        lp.sum().backward()
        grads = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
        with torch.no_grad():
            whole = model(input_ids=m.ids, use_cache=False).logits
        results.append((lp.detach(), grads, whole))
    (want, want_g, want_whole), (got, got_g, got_whole) = results
    assert torch.allclose(got, want, atol=2e-5)
    assert float((got_g - want_g).norm() / want_g.norm()) < 1e-4
    assert torch.allclose(got_whole, want_whole, atol=2e-5)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("with_bias", [False, True])
def test_head_scores_gradient_equals_autograd_through_the_full_logits(temperature: float, with_bias: bool) -> None:
    """``_HeadScores`` (the chunk's logits recomputed in its own backward) against autograd through the plain
    computation, in float64: log-probs, entropies and the gradients of the hidden states, weight and bias."""
    gen = torch.Generator().manual_seed(0)
    h = torch.randn(7, 16, generator=gen, dtype=torch.float64)
    w = torch.randn(40, 16, generator=gen, dtype=torch.float64) * 0.5
    b = torch.randn(40, generator=gen, dtype=torch.float64) if with_bias else None
    targets = torch.randint(0, 40, (7,), generator=gen)
    coef = torch.linspace(-1, 2, 7, dtype=torch.float64)
    leaves = [x.clone().requires_grad_() for x in (h, w, *([b] if b is not None else []))]
    logits = torch.nn.functional.linear(leaves[0], leaves[1], leaves[2] if b is not None else None) / temperature
    lsm = torch.log_softmax(logits, -1)
    want_lp = lsm.gather(-1, targets[:, None]).squeeze(-1)
    want_ent = -(lsm.exp() * lsm).sum(-1)
    (want_lp * coef).sum().backward()
    mine = [x.clone().requires_grad_() for x in (h, w, *([b] if b is not None else []))]
    lp, ent = batches._HeadScores.apply(mine[0], mine[1], mine[2] if b is not None else None, targets, temperature,
                                        True)
    (lp * coef).sum().backward()
    assert torch.allclose(lp, want_lp.detach(), atol=1e-12) and torch.allclose(ent, want_ent.detach(), atol=1e-12)
    assert not ent.requires_grad
    for got, want in zip(mine, leaves, strict=True):
        assert torch.allclose(got.grad, want.grad, atol=1e-12), (got.grad - want.grad).abs().max()
    # a frozen output layer (LoRA) gets no gradient; the hidden states still do
    frozen = w.clone()
    hh = h.clone().requires_grad_()
    lp2, _ = batches._HeadScores.apply(hh, frozen, None, targets, temperature, False)
    (lp2 * coef).sum().backward()
    assert frozen.grad is None and hh.grad is not None


def test_head_scores_under_autocast_equal_autograd_under_autocast() -> None:
    """``trainer.autocast``: the forward runs ``_HeadScores`` inside ``torch.autocast`` (the logits' matrix
    multiplication in bfloat16), its backward outside. The backward recomputes the logits in the forward's
    autocast state, so the gradients are autograd's through the plain computation under the same autocast
    (recomputed in float32 instead they were 0.45% off, and the output layer's matrix multiplications ran in
    float32)."""
    gen = torch.Generator().manual_seed(0)
    h = torch.randn(64, 64, generator=gen)
    w = torch.randn(500, 64, generator=gen) * 0.3
    targets = torch.randint(0, 500, (64,), generator=gen)
    coef = torch.linspace(-1, 2, 64)

    def plain(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        lsm = torch.log_softmax(torch.nn.functional.linear(a, b).float(), -1)
        return lsm.gather(-1, targets[:, None]).squeeze(-1)

    def mine(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return batches._HeadScores.apply(a, b, None, targets, 1.0, False)[0]

    got = []
    for fn in (plain, mine):
        a, b = h.clone().requires_grad_(), w.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            lp = fn(a, b)
        (lp * coef).sum().backward()
        got.append((lp.detach(), a.grad, b.grad))
    (want_lp, want_h, want_w), (lp, gh, gw) = got
    assert gh.dtype == gw.dtype == torch.float32
    assert torch.allclose(lp, want_lp, atol=1e-6)
    for g, want in ((gh, want_h), (gw, want_w)):
        assert float((g - want).norm() / want.norm()) < 1e-5


def test_varlen_attention_under_autocast_gets_the_autocast_dtype(monkeypatch: pytest.MonkeyPatch) -> None:
    """A float32 model under ``torch.autocast`` (``trainer.autocast``) leaves the rotary embedding's queries and keys
    in float32; FlashAttention's kernel (replaced here by causal SDPA per segment) receives them in the autocast
    dtype, and the log-probabilities stay those of SDPA with its mask under the same autocast."""
    calls, _, got, want = varlen_against_sdpa(monkeypatch, torch.autocast("cpu", dtype=torch.bfloat16))
    dtypes = [c[4] for c in calls]
    assert dtypes and all(d == {torch.bfloat16} for d in dtypes), dtypes
    assert float((got - want).abs().max()) < 0.05


def test_served_state_casts_float32_weights_once_and_keeps_tied_ones_tied() -> None:
    """One worker's float32 weights (``trainer.autocast``) written in the served dtype: every floating tensor cast,
    a tied output layer still the embedding's tensor; None where the model already is in that dtype."""
    from rlhf_runtime.roles.base import served_state

    model = tiny_lm(tie=True)
    state = served_state(model, torch.bfloat16)
    assert state is not None and {v.dtype for v in state.values()} == {torch.bfloat16}
    assert state["lm_head.weight"] is state["model.embed_tokens.weight"]
    assert torch.equal(state["model.norm.weight"], model.model.norm.weight.detach().to(torch.bfloat16))
    assert served_state(model.to(torch.bfloat16), torch.bfloat16) is None
