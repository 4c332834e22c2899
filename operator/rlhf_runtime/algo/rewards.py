"""Rewards: built-in rules, a user ``module:function`` hook, a remote HTTP endpoint, and how the sources of
``spec.reward`` (rule or function, model, endpoint) are combined. Pure Python, no torch (the reward model is
``reward_model.py``).

Rules (``spec.reward.rule``), with ``answer`` the sample's reference answer from the data when present:

* ``exactMatch``: 1.0 if the stripped completion equals ``answer`` (else ``target``), else 0.0;
* ``contains``: 1.0 if the completion contains ``answer`` (else ``target``), else 0.0;
* ``regex``: 1.0 if ``pattern`` matches anywhere in the completion (``re.search``), else 0.0;
* ``length``: ``1 - |len - targetLength| / targetLength`` clipped at 0, with ``len`` in tokens when token
  counts are given, else in characters;
* ``math``: 1.0 if the completion's final answer is mathematically equal to ``answer`` (else ``target``), else
  0.0, checked by Hugging Face's ``math-verify`` (``MathVerifier``: LaTeX, ``\\boxed{}``, fractions vs decimals,
  percentages, sets; each check in a worker process under ``mathTimeoutSeconds``, 0.0 past it).

A hook ``fn(prompt, completion, answer) -> float`` is imported once. Its result must be a finite number
(``int``, ``float``, ``bool``, or anything ``float()`` accepts that is not text, e.g. a numpy scalar or a
one-element tensor). A hook that raises, or returns ``None``, text, NaN, an infinity or another non-number,
fails the run with a ``RewardError`` naming the hook, the sample (its index and step when the caller passes
``index=``/``step=``, and the beginning of its prompt and completion) and what was wrong.

``endpoint_rewards`` POSTs batches to ``spec.reward.endpoint.url`` (see ``RewardEndpoint``) and retries what may
pass (connection errors, timeouts, HTTP 5xx and 429) with exponential backoff; ``combine`` weights the sources'
rewards into one, ``normalize`` standardises them over a step's samples (``spec.reward.normalize``).
"""

from __future__ import annotations

import http.client
import importlib
import json
import logging
import math
import re
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

from rlhf_api.models import Reward, RewardEndpoint

RewardFn = Callable[..., float]
log = logging.getLogger(__name__)


class RewardError(ValueError):
    pass


def load_ref(ref: str, what: str, field: str, error: type[Exception] = ValueError) -> Callable[..., Any]:
    """The attribute ``module:name`` of ``ref``, imported and callable, else ``error`` naming ``what`` (e.g.
    "reward function") and the spec ``field`` that gave it, with why: not importable, failing at import,
    missing, not callable."""
    module, _, name = ref.partition(":")
    if not module or not name:
        raise error(f"{field} must be 'module:function', got {ref!r}")
    try:
        mod = importlib.import_module(module)
    except ImportError as e:
        raise error(f"cannot import {what} {ref!r} ({field}): {e}; the module must be importable in the image "
                    "(installed, or on PYTHONPATH)") from e
    except Exception as e:  # the module itself fails: a syntax error, an error at import time
        raise error(f"cannot import {what} {ref!r} ({field}): importing {module!r} raised {type(e).__name__}: "
                    f"{e}") from e
    fn = getattr(mod, name, None)
    if fn is None:
        raise error(f"cannot import {what} {ref!r} ({field}): module {module!r} has no {name!r}")
    if not callable(fn):
        raise error(f"{what} {ref!r} ({field}) is not callable")
    return fn


def load_hook(ref: str) -> Callable[[str, str, str | None], float]:
    return load_ref(ref, "reward function", "spec.reward.function", RewardError)


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


def make_reward(spec: Reward, optional: bool = False) -> RewardFn | None:
    """A function ``(prompt, completion, answer, num_tokens=None, *, index=None, step=None) -> float`` for
    ``spec``'s rule or function; ``index``/``step`` only serve error messages (a hook's).

    ``None`` when ``spec`` has neither (its only sources are ``model`` and/or ``endpoint``): the caller then
    combines just those (``combine``), with no rule part. A ``spec`` with no source at all is an error, as is one
    with both a rule and a function (the CRD rejects both; this guards specs built elsewhere), unless ``optional``
    (another source scores the samples: ``spec.environment``'s reward)."""
    if spec.rule and spec.function:
        raise RewardError("spec.reward takes rule or function, not both (use model or endpoint to combine sources)")
    if not spec.rule and not spec.function:
        if spec.model is None and spec.endpoint is None and not optional:
            raise RewardError("spec.reward needs a source: rule, function, model or endpoint")
        return None
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
    if rule == "math":
        return MathVerifier(spec.target, spec.math_timeout_seconds)
    raise RewardError(f"unknown spec.reward.rule {rule!r} (exactMatch, contains, regex, length or math)")


# -------------------------------------------------------------------------------------------- math
def math_equal(gold: str, completion: str, timeout_s: int) -> bool:
    """Whether ``completion``'s final answer equals ``gold`` by ``math-verify`` (its parse and verify, each under
    its own ``signal.alarm`` limit of ``timeout_s``: this runs in the main thread of ``MathVerifier``'s worker).
    ``gold`` as the data holds it: plain (``0.5``, ``1/2``, ``72``, ``10%``), tried as it is first, or LaTeX
    without delimiters (``\\frac{\\sqrt{3}}{2}``, ``\\{1, 2\\}``: with a backslash), tried as inline math first
    (as it is, math-verify would take a number out of it: ``10\\%`` as 10); then boxed."""
    from math_verify import parse, verify

    want = []
    forms = (f"${gold}$", gold) if "\\" in gold else (gold, f"${gold}$")
    for form in (*forms, f"\\boxed{{{gold}}}"):
        want = parse(form, parsing_timeout=timeout_s)
        if want:
            break
    got = parse(completion, parsing_timeout=timeout_s)
    return bool(want) and bool(got) and bool(verify(want, got, timeout_seconds=timeout_s))


def _ready(check: Callable[[str, str, int], bool]) -> None:
    """Run first in a fresh ``MathVerifier`` worker: ``check`` arrives (its module imported) and, for
    ``math_equal``, math-verify and sympy are imported, so a check's time limit is the check's alone."""
    if check is math_equal:
        import math_verify  # noqa: F401


class MathVerifier:
    """``reward.rule: math``. Each check runs in a worker process (one, started on first use from a clean
    forkserver: the driver has threads, and math-verify's time limits are ``signal.alarm``, which works only in a
    main thread): ``check(gold, completion, timeout_s)``, ``math_equal`` unless a test passes another. A worker is
    ready (process started, imports done: ``_ready``, within ``START_S``) before its first check is sent. A check
    not answered within ``timeout_s`` (+ ``GRACE_S``) scores 0.0, with a warning: its worker is killed and the
    next check starts a new one, so a pathological answer (a huge expression sympy cannot simplify) costs at most
    the limit and never stalls the step. A sample without an answer (and no ``target``) scores 0.0; a worker not
    ready within ``START_S`` is a ``RewardError``."""

    GRACE_S = 2.0
    START_S = 120.0

    def __init__(self, target: str | None, timeout_s: int,
                 check: Callable[[str, str, int], bool] | None = None) -> None:
        try:
            import math_verify  # noqa: F401 - in the runtime image (pyproject: runtime)
        except ImportError as e:
            raise RewardError("reward.rule math needs the math-verify package in the runtime image "
                              f"(spec.image): {e}") from e
        self.target, self.timeout_s = target, int(timeout_s)
        self.check = check or math_equal
        self.pool: ProcessPoolExecutor | None = None
        self.timeouts = 0

    def _worker(self) -> ProcessPoolExecutor:
        """The worker, started and ready (``_ready``) on first use: its start counts against no check's limit."""
        if self.pool is None:
            import multiprocessing

            self.pool = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("forkserver"))
            try:
                self.pool.submit(_ready, self.check).result(timeout=self.START_S)
            except FutureTimeout:
                self.close()
                raise RewardError(f"reward.rule math: the checks' worker process was not ready within "
                                  f"{self.START_S:g} s") from None
        return self.pool

    def close(self) -> None:
        """Stop the worker (at once: a check still running is abandoned)."""
        pool, self.pool = self.pool, None
        if pool is not None:
            for proc in list(getattr(pool, "_processes", {}).values()):  # a stuck check never returns: kill it
                proc.kill()
            pool.shutdown(wait=False, cancel_futures=True)

    def __call__(self, p: str, c: str, a: str | None, n: int | None = None, **_: object) -> float:
        gold = a if a is not None else self.target
        if not gold:
            return 0.0
        future = self._worker().submit(self.check, gold, c, self.timeout_s)
        try:
            return float(bool(future.result(timeout=self.timeout_s + self.GRACE_S)))
        except FutureTimeout:
            self.timeouts += 1
            self.close()
            log.warning("reward.rule math: no verdict within %d s for answer %r (completion %r): scored 0",
                        self.timeout_s, _clip(gold), _clip(c))
            return 0.0


# ------------------------------------------------------------------------------------------ endpoint
#: First retry delay of ``endpoint_rewards``; each next one doubles, up to ``BACKOFF_MAX``.
BACKOFF_FIRST, BACKOFF_MAX = 0.5, 10.0


class _Transient(Exception):
    """A failed attempt worth retrying (connection error, timeout, HTTP 5xx or 429)."""


def _post(url: str, body: bytes, timeout: float) -> object:
    """One POST; the parsed JSON answer, ``_Transient`` for what a retry may fix, ``RewardError`` for the rest."""
    req = urllib.request.Request(url, data=body, method="POST",
                                 headers={"Content-Type": "application/json", "Accept": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            raw = resp.read()
            status = resp.status
    except urllib.error.HTTPError as e:
        try:
            text = e.read(300).decode("utf-8", "replace")
        except Exception:  # noqa: BLE001 - the body is only for the message
            text = ""
        what = f"HTTP {e.code}: {text!r}" if text else f"HTTP {e.code} {e.reason}"
        if e.code >= 500 or e.code == 429:
            raise _Transient(what) from e
        raise RewardError(f"answered {what}; not retried (a 4xx other than 429 is the request's fault)") from e
    except TimeoutError as e:
        raise _Transient(f"no answer within timeoutSeconds {timeout:g}") from e
    except urllib.error.URLError as e:
        if isinstance(e.reason, TimeoutError):
            raise _Transient(f"no answer within timeoutSeconds {timeout:g}") from e
        raise _Transient(f"cannot connect: {e.reason}") from e
    except (OSError, http.client.HTTPException) as e:  # reset, refused, a broken answer
        raise _Transient(f"{type(e).__name__}: {e}") from e
    try:
        return json.loads(raw)
    except ValueError:
        text = raw[:200].decode("utf-8", "replace")
        raise RewardError(f"answered HTTP {status} with a body that is not JSON: {text!r}") from None


def _rewards_of(answer: object, n: int) -> list[float]:
    """The ``rewards`` of an endpoint's ``answer``: exactly ``n`` finite numbers, else a ``RewardError``."""
    rewards = answer.get("rewards") if isinstance(answer, dict) else None
    if not isinstance(rewards, list):
        raise RewardError(f'answered {_clip(json.dumps(answer), 120)}; it must answer {{"rewards": [{n} numbers]}}')
    if len(rewards) != n:
        raise RewardError(f"answered {len(rewards)} rewards for {n} completions; it must answer one per completion")
    for i, r in enumerate(rewards):
        if isinstance(r, bool) or not isinstance(r, (int, float)) or not math.isfinite(r):
            raise RewardError(f"answered reward {i} = {_clip(json.dumps(r), 60)}; every reward must be a finite number")
    return [float(r) for r in rewards]


def endpoint_rewards(endpoint: RewardEndpoint, prompts: Sequence[str], completions: Sequence[str],
                     answers: Sequence[str | None] | None) -> list[float]:
    """One reward per completion from ``endpoint``: POST ``{"prompts", "completions", "answers"}`` (JSON; an
    unknown answer is ``null``) in batches of ``endpoint.batch_size``, each answered by ``{"rewards": [...]}``.

    A batch is tried ``1 + endpoint.retries`` times: connection errors, timeouts (``timeout_seconds``, the socket
    timeout of the connect and of each read), HTTP 5xx and 429 are retried after 0.5 s, 1 s, 2 s, ... (at most
    10 s); any other HTTP error, a body that is not JSON or a wrong ``rewards`` fails at once. Every failure is a
    ``RewardError`` naming ``spec.reward.endpoint.url``, the batch, what went wrong and the attempts made."""
    n = len(completions)
    if len(prompts) != n or (answers is not None and len(answers) != n):
        raise ValueError(f"{len(prompts)} prompts, {n} completions and "
                         f"{'no' if answers is None else len(answers)} answers: they must match")
    url, size, attempts = endpoint.url, endpoint.batch_size, 1 + endpoint.retries
    out: list[float] = []
    for start in range(0, n, size):
        end = min(start + size, n)
        body = json.dumps({
            "prompts": list(prompts[start:end]), "completions": list(completions[start:end]),
            "answers": list(answers[start:end]) if answers is not None else [None] * (end - start),
        }).encode()
        where = f"spec.reward.endpoint.url {url} (samples {start}..{end - 1} of {n})"
        for attempt in range(1, attempts + 1):
            try:
                out.extend(_rewards_of(_post(url, body, endpoint.timeout_seconds), end - start))
                break
            except RewardError as e:
                raise RewardError(f"{where} {e} (attempt {attempt} of {attempts})") from e
            except _Transient as e:
                if attempt == attempts:
                    raise RewardError(f"{where} failed after {attempts} attempt{'s' if attempts > 1 else ''} "
                                      f"(retries {endpoint.retries}); last error: {e}") from e
                time.sleep(min(BACKOFF_FIRST * 2 ** (attempt - 1), BACKOFF_MAX))  # backoff, not a poll
    return out


# --------------------------------------------------------------------------------------- combining
def combine(parts: dict[str, list[float]], weights: dict[str, float]) -> list[float]:
    """The weighted sum ``sum(weights[k] * parts[k][i])`` per sample; every part must have a weight and all parts
    the same length. ``parts`` keyed by source (``Reward.sources()``: rule, model, endpoint)."""
    if not parts:
        raise RewardError("no reward sources to combine")
    missing = sorted(set(parts) - set(weights))
    if missing:
        raise RewardError(f"no weight for reward source(s) {', '.join(missing)}")
    lengths = {k: len(v) for k, v in parts.items()}
    if len(set(lengths.values())) != 1:
        raise RewardError(f"reward sources scored different numbers of samples: {lengths}")
    n = next(iter(lengths.values()))
    return [sum(weights[k] * v[i] for k, v in parts.items()) for i in range(n)]


def normalize(rewards: Sequence[float], how: str) -> list[float]:
    """``spec.reward.normalize``: ``none`` leaves ``rewards`` as they are; ``batch`` gives ``(r - mean) / (std +
    1e-6)`` over them (population std), and zeros when they are all equal."""
    if how == "none":
        return [float(r) for r in rewards]
    if how != "batch":
        raise RewardError(f"unknown spec.reward.normalize {how!r} (none or batch)")
    if not rewards:
        return []
    mean = sum(rewards) / len(rewards)
    if all(r == rewards[0] for r in rewards):
        return [0.0] * len(rewards)
    std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / len(rewards))
    return [(r - mean) / (std + 1e-6) for r in rewards]
