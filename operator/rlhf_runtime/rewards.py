"""Rewards: built-in rules and a user ``module:function`` hook. Pure Python, no torch.

Rules (``spec.reward.rule``), with ``answer`` the sample's reference answer from the data when present:

* ``exactMatch``: 1.0 if the stripped completion equals ``answer`` (else ``target``), else 0.0;
* ``contains``: 1.0 if the completion contains ``answer`` (else ``target``), else 0.0;
* ``regex``: 1.0 if ``pattern`` matches anywhere in the completion (``re.search``), else 0.0;
* ``length``: ``1 - |len - targetLength| / targetLength`` clipped at 0, with ``len`` in tokens when token
  counts are given, else in characters.

A hook ``fn(prompt, completion, answer) -> float`` is imported once. Its result must be a finite number
(``int``, ``float``, ``bool``, or anything ``float()`` accepts that is not text, e.g. a numpy scalar or a
one-element tensor). A hook that raises, or returns ``None``, text, NaN, an infinity or another non-number,
fails the run with a ``RewardError`` naming the hook, the sample (its index and step when the caller passes
``index=``/``step=``, and the beginning of its prompt and completion) and what was wrong.
"""

from __future__ import annotations

import importlib
import math
import re
from collections.abc import Callable

from rlhf_api.models import Reward

RewardFn = Callable[..., float]


class RewardError(ValueError):
    pass


def load_hook(ref: str) -> Callable[[str, str, str | None], float]:
    module, _, name = ref.partition(":")
    if not module or not name:
        raise RewardError(f"spec.reward.function must be 'module:function', got {ref!r}")
    try:
        mod = importlib.import_module(module)
    except ImportError as e:
        raise RewardError(f"cannot import reward function {ref!r} (spec.reward.function): {e}; the module must "
                          "be importable in the image (installed, or on PYTHONPATH)") from e
    except Exception as e:  # the module itself fails: a syntax error, an error at import time
        raise RewardError(f"cannot import reward function {ref!r} (spec.reward.function): importing {module!r} "
                          f"raised {type(e).__name__}: {e}") from e
    fn = getattr(mod, name, None)
    if fn is None:
        raise RewardError(f"cannot import reward function {ref!r} (spec.reward.function): module {module!r} "
                          f"has no {name!r}")
    if not callable(fn):
        raise RewardError(f"reward function {ref!r} (spec.reward.function) is not callable")
    return fn


def _clip(text: str, n: int = 60) -> str:
    return repr(text if len(text) <= n else text[:n] + "...")


def _where(prompt: str, completion: str, index: int | None, step: int | None) -> str:
    at = "on a sample" if index is None else f"on sample {index}"
    if step is not None:
        at += f" of step {step}"
    return f"{at} (prompt {_clip(prompt)}, completion {_clip(completion)})"


def checked(value: object, ref: str, where: str) -> float:
    """``value`` (what hook ``ref`` returned) as a finite float, or a ``RewardError`` saying what it was."""
    got = f"returned {value!r}" if value is None or isinstance(value, (int, float)) else \
        f"returned {_clip(repr(value), 80)} (a {type(value).__name__})"
    need = "; it must return a finite number (a float)"
    if value is None or isinstance(value, (str, bytes)):
        raise RewardError(f"reward function {ref!r} {got} {where}{need}")
    try:
        f = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise RewardError(f"reward function {ref!r} {got} {where}{need}") from None
    if not math.isfinite(f):
        raise RewardError(f"reward function {ref!r} returned {f} {where}{need}")
    return f


def hook_reward(hook: Callable[[str, str, str | None], object], ref: str) -> RewardFn:
    """``hook`` as a ``RewardFn`` whose failures and bad results are ``RewardError``s naming ``ref``."""

    def reward(prompt: str, completion: str, answer: str | None, n: int | None = None, *,
               index: int | None = None, step: int | None = None) -> float:
        try:
            value = hook(prompt, completion, answer)
        except Exception as e:  # any error of user code, reported with where it happened
            msg = str(e) if len(str(e)) <= 300 else str(e)[:300] + "..."
            raise RewardError(f"reward function {ref!r} raised {type(e).__name__}: {msg} "
                              f"{_where(prompt, completion, index, step)}") from e
        return checked(value, ref, _where(prompt, completion, index, step))

    return reward


def make_reward(spec: Reward) -> RewardFn:
    """A function ``(prompt, completion, answer, num_tokens=None, *, index=None, step=None) -> float`` for
    ``spec``; ``index``/``step`` only serve error messages (a hook's)."""
    if spec.function:
        return hook_reward(load_hook(spec.function), spec.function)
    rule = spec.rule
    if rule == "exactMatch":
        return lambda p, c, a, n=None, **_: float(c.strip() == (a if a is not None else spec.target or "").strip())
    if rule == "contains":
        def contains(p: str, c: str, a: str | None, n: int | None = None, **_: object) -> float:
            want = a if a is not None else spec.target
            return float(bool(want) and want in c)
        return contains
    if rule == "regex":
        if not spec.pattern:
            raise RewardError("reward.rule regex needs reward.pattern")
        rx = re.compile(spec.pattern)
        return lambda p, c, a, n=None, **_: float(rx.search(c) is not None)
    if rule == "length":
        target = spec.target_length

        def length(p: str, c: str, a: str | None, n: int | None = None, **_: object) -> float:
            got = n if n is not None else len(c)
            return max(0.0, 1.0 - abs(got - target) / target)
        return length
    raise RewardError("reward needs exactly one of rule or function")
