"""How a batch is split over a role's workers (``controller.actors.assign``/``shard``/``merge``): by tokens, so
FSDP ranks that meet at every micro-batch's collectives get about the same work, and merged back in order."""

from __future__ import annotations

import random

import pytest

from rlhf_runtime.controller.actors import assign, merge, shard


def batch_of(lengths: list[tuple[int, int]]) -> dict[str, list]:
    return {"prompts": [[1] * p for p, _ in lengths], "completions": [[2] * c for _, c in lengths],
            "advantages": [float(i) for i in range(len(lengths))]}


def tokens(batch: dict[str, list], idx: list[int]) -> int:
    return sum(len(batch["prompts"][i]) + len(batch["completions"][i]) for i in idx)


def test_a_long_tailed_batch_is_balanced_by_tokens_not_by_count() -> None:
    # one long sample every 4 (RL's length tail): every-w-th from r puts all of them on the same rank
    lengths = [(20, 1000 if i % 4 == 0 else 50) for i in range(32)]
    b = batch_of(lengths)
    round_robin = [list(range(r, 32, 4)) for r in range(4)]
    assert max(tokens(b, p) for p in round_robin) / min(tokens(b, p) for p in round_robin) > 10
    parts = assign(b, 4)
    loads = [tokens(b, p) for p in parts]
    assert max(loads) - min(loads) <= max(p + c for p, c in lengths)  # within one sample (greedy LPT bound)
    assert max(loads) / min(loads) < 1.1, loads
    assert sorted(i for p in parts for i in p) == list(range(32))  # every sample once


@pytest.mark.parametrize("w", [1, 2, 3, 5])
def test_merge_puts_every_workers_results_back_in_the_batchs_order(w: int) -> None:
    rng = random.Random(w)
    b = batch_of([(rng.randint(1, 30), rng.randint(1, 300)) for _ in range(23)])
    parts = [shard(b, idx) for idx in assign(b, w)]
    assert [len(p["prompts"]) for p in parts] != [] and sum(len(p["advantages"]) for p in parts) == 23
    # each worker returns one value per sample of its part, computed from that sample
    results = [[len(c) * 10 + a for c, a in zip(p["completions"], p["advantages"])] for p in parts]
    assert merge(results, b) == [len(c) * 10 + a for c, a in zip(b["completions"], b["advantages"])]


def test_without_token_lists_every_wth_sample_from_r() -> None:
    b = {"texts": list("abcdefg")}
    assert assign(b, 3) == [[0, 3, 6], [1, 4], [2, 5]]
    assert merge([["a", "d", "g"], ["b", "e"], ["c", "f"]]) == list("abcdefg")  # no batch: the same order
