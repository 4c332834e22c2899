"""``reward.rule: math`` (``rewards.MathVerifier`` on Hugging Face's math-verify): hand-made answers a math RL
dataset holds (GSM8K's numbers, MATH's LaTeX) against completions as models write them, and the per-check time
limit on a real worker process (a check that never answers costs the limit, scores 0, and the next check runs;
the worker's start is not part of any check's limit)."""

from __future__ import annotations

import time

import pytest

pytest.importorskip("math_verify")

from rlhf_api.models import Reward
from rlhf_runtime.algo.rewards import MathVerifier, make_reward
from tests.unit import slow_start_check


@pytest.fixture(scope="module")
def verifier():
    v = make_reward(Reward(rule="math"))
    assert isinstance(v, MathVerifier)
    yield v
    v.close()


CASES = [
    # (the data's answer, a completion, reward)
    ("72", "Natalia sold 48 + 24 = 72 clips.\n#### 72", 1.0),            # GSM8K style
    ("1/2", "So the probability is \\boxed{0.5}.", 1.0),                   # fraction vs decimal
    ("0.5", "which gives $\\frac{1}{2}$", 1.0),                             # decimal vs LaTeX fraction
    ("\\frac{\\sqrt{3}}{2}", "Hence \\boxed{\\frac{\\sqrt3}{2}}", 1.0),    # LaTeX answer without delimiters
    ("x+1", "The result simplifies to \\boxed{1 + x}", 1.0),               # commuted expression
    ("10\\%", "\\boxed{0.1}", 1.0),                                          # percentage
    ("\\{1, 2\\}", "The roots are \\boxed{\\{2, 1\\}}", 1.0),              # a set, any order
    ("3", "I think it is \\boxed{4}", 0.0),                                  # wrong answer
    ("1/2", "\\boxed{\\frac{1}{3}}", 0.0),                                   # wrong fraction
    ("72", "}{ \\frac garbage \\boxed{", 0.0),                               # garbage
    ("72", "", 0.0),                                                         # empty completion
]


@pytest.mark.parametrize(("answer", "completion", "reward"), CASES, ids=[f"{a}|{c[:20]}" for a, c, _ in CASES])
def test_math_rule_scores_equal_answers_1_and_others_0(verifier, answer, completion, reward) -> None:
    assert verifier("prompt", completion, answer) == reward


def test_math_rule_uses_the_target_without_an_answer_and_0_without_either(verifier) -> None:
    with_target = make_reward(Reward(rule="math", target="0.25"))
    try:
        assert with_target("p", "\\boxed{\\frac14}", None) == 1.0
        assert with_target("p", "\\boxed{\\frac14}", "3") == 0.0  # the sample's answer wins over target
    finally:
        with_target.close()
    assert verifier("p", "\\boxed{1}", None) == 0.0


def never_answers(gold: str, completion: str, timeout_s: int) -> bool:
    """A check stuck where no signal reaches it (the worker's main thread sleeps uninterrupted)."""
    if completion == "stuck":
        time.sleep(3600)
    return gold == completion


def test_a_check_past_its_limit_scores_0_and_the_next_runs_in_a_new_worker() -> None:
    v = MathVerifier(None, 1, check=never_answers)
    try:
        assert v("p", "7", "7") == 1.0
        first = next(iter(v.pool._processes.values()))
        t = time.monotonic()
        assert v("p", "stuck", "7") == 0.0
        took = time.monotonic() - t
        assert 1.0 <= took < 1.0 + MathVerifier.GRACE_S + 5, took  # the limit, not the check's hour
        assert v.timeouts == 1 and v.pool is None
        first.join(10)
        assert not first.is_alive()  # the stuck worker was killed, not left running
        assert v("p", "8", "8") == 1.0 and v("p", "8", "9") == 0.0  # a new worker answers
    finally:
        v.close()


def test_a_workers_slow_start_counts_against_no_checks_limit() -> None:
    """A fresh worker whose imports take longer than a check's limit and grace answers its first check, and the
    worker started after a timed-out check answers too."""
    assert slow_start_check.IMPORT_S > 1 + MathVerifier.GRACE_S
    v = MathVerifier(None, 1, check=slow_start_check.equal)
    try:
        assert v("p", "7", "7") == 1.0 and v("p", "7", "8") == 0.0
        assert v.timeouts == 0
        v.close()  # as after a timed-out check: the next one starts a new worker
        assert v("p", "8", "8") == 1.0 and v.timeouts == 0
    finally:
        v.close()
