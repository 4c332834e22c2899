"""Rewards: built-in rules and a user ``module:function`` hook. Pure Python, no torch.

Rules (``spec.reward.rule``), with ``answer`` the sample's reference answer from the data when present:

* ``exactMatch``: 1.0 if the stripped completion equals ``answer`` (else ``target``), else 0.0;
* ``contains``: 1.0 if the completion contains ``answer`` (else ``target``), else 0.0;
* ``regex``: 1.0 if ``pattern`` matches anywhere in the completion (``re.search``), else 0.0;
* ``length``: ``1 - |len - targetLength| / targetLength`` clipped at 0, with ``len`` in tokens when token
  counts are given, else in characters.

A hook ``fn(prompt, completion, answer) -> float`` is imported once; its result is cast to float.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable

from rlhf_api.models import Reward

RewardFn = Callable[[str, str, "str | None", "int | None"], float]


class RewardError(ValueError):
    pass


def load_hook(ref: str) -> Callable[[str, str, str | None], float]:
    module, _, name = ref.partition(":")
    if not module or not name:
        raise RewardError(f"reward.function must be 'module:function', got {ref!r}")
    try:
        fn = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise RewardError(f"cannot import reward function {ref!r}: {e}") from e
    if not callable(fn):
        raise RewardError(f"reward function {ref!r} is not callable")
    return fn


def make_reward(spec: Reward) -> RewardFn:
    """A function ``(prompt, completion, answer, num_tokens) -> float`` for ``spec``."""
    if spec.function:
        hook = load_hook(spec.function)
        return lambda prompt, completion, answer, n=None: float(hook(prompt, completion, answer))
    rule = spec.rule
    if rule == "exactMatch":
        return lambda p, c, a, n=None: float(c.strip() == (a if a is not None else spec.target or "").strip())
    if rule == "contains":
        def contains(p: str, c: str, a: str | None, n: int | None = None) -> float:
            want = a if a is not None else spec.target
            return float(bool(want) and want in c)
        return contains
    if rule == "regex":
        if not spec.pattern:
            raise RewardError("reward.rule regex needs reward.pattern")
        rx = re.compile(spec.pattern)
        return lambda p, c, a, n=None: float(rx.search(c) is not None)
    if rule == "length":
        target = spec.target_length

        def length(p: str, c: str, a: str | None, n: int | None = None) -> float:
            got = n if n is not None else len(c)
            return max(0.0, 1.0 - abs(got - target) / target)
        return length
    raise RewardError("reward needs exactly one of rule or function")
