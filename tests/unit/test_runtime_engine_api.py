"""Every engine actor class implements ``engine_api.RolloutEngine`` (async ones as coroutines), with the same
parameters, so the driver and the weight-sync fan-out can call any of them the same way through Ray."""

from __future__ import annotations

import inspect

import pytest

from rlhf_runtime.rollout import api as engine_api
from rlhf_runtime.rollout.api import AdapterEngine, PausableEngine, RolloutEngine, engine_class
from rlhf_runtime.rollout.engines import AsyncEngine, Engine
from rlhf_runtime.rollout.stepped import SteppedEngine


def _methods(proto: type) -> dict[str, inspect.Signature]:
    return {n: inspect.signature(f) for n, f in vars(proto).items()
            if callable(f) and not n.startswith("_")}


def _params(sig: inspect.Signature) -> list[tuple[str, object]]:
    return [(p.name, p.default) for p in sig.parameters.values()]


@pytest.mark.parametrize(("cls", "protos"), [
    (Engine, [RolloutEngine, AdapterEngine]),
    (AsyncEngine, [RolloutEngine, PausableEngine]),
    (SteppedEngine, [RolloutEngine, PausableEngine]),
])
def test_engine_classes_implement_the_interface(cls: type, protos: list[type]) -> None:
    for proto in protos:
        for name, sig in _methods(proto).items():
            impl = getattr(cls, name, None)
            assert impl is not None, f"{cls.__name__} lacks {proto.__name__}.{name}"
            assert _params(inspect.signature(impl)) == _params(sig), f"{cls.__name__}.{name}"
            if cls is not Engine:
                assert inspect.iscoroutinefunction(impl), f"{cls.__name__}.{name} must be async (one actor loop)"


def test_no_benchmark_hooks_in_production_actors() -> None:
    for cls in (Engine, AsyncEngine, SteppedEngine):
        for hook in ("scramble_weights", "load_stats", "reset_prefix_cache", "configure_sync"):
            assert not hasattr(cls, hook), f"{cls.__name__}.{hook}"
    from rlhf_runtime.roles.policy import Trainer

    assert not hasattr(Trainer, "configure_sync")


def test_one_engine_base() -> None:
    """The three engine classes share their start-up and queries (``rollout.base``); the sync ``Engine`` has no
    coroutine method (one would make it an async Ray actor, and the fan-out pipelines calls to sync actors only)."""
    from rlhf_runtime.rollout.base import AsyncEngineBase, EngineBase

    assert all(issubclass(cls, EngineBase) for cls in (Engine, AsyncEngine, SteppedEngine))
    assert issubclass(AsyncEngine, AsyncEngineBase) and issubclass(SteppedEngine, AsyncEngineBase)
    assert not [n for n in dir(Engine) if inspect.iscoroutinefunction(getattr(Engine, n))]


def test_engine_class_by_mode_and_async_engine() -> None:
    assert engine_class(False) is Engine
    assert engine_class(False, "stepped") is Engine  # sync mode runs vLLM's LLM whatever asyncEngine says
    assert engine_class(True, "asyncllm") is AsyncEngine
    assert engine_class(True, "stepped") is SteppedEngine
    with pytest.raises(ValueError, match="rollout.asyncEngine must be one of asyncllm, stepped"):
        engine_class(True, "threads")
    assert engine_api.ASYNC_ENGINES == ("asyncllm", "stepped")


@pytest.mark.parametrize("cls", [Engine, AsyncEngine, SteppedEngine])
def test_an_engine_is_made_from_one_options_object(cls: type) -> None:
    """Every engine class takes its ``rollout.options.EngineOptions`` whole (and whether to build at once)."""
    assert _params(inspect.signature(cls.__init__)) == [("self", inspect.Parameter.empty),
                                                         ("options", inspect.Parameter.empty), ("build", True)]


def test_engine_options_are_frozen_and_replaced_for_a_fresh_engine() -> None:
    import dataclasses

    from rlhf_runtime.rollout.options import EngineOptions

    o = EngineOptions({"model": "m", "load_format": "dummy", "weight_transfer_backend": "gloo"}, {"A": "1"})
    fresh = o.with_args(model="/tmp/w", load_format="auto")
    assert fresh.kwargs == {"model": "/tmp/w", "load_format": "auto", "weight_transfer_backend": "gloo"}
    assert fresh.env == o.env and o.kwargs["model"] == "m"  # the job's engines' options are untouched
    with pytest.raises(dataclasses.FrozenInstanceError):
        o.env = {}  # type: ignore[misc]
