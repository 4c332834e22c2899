"""``infra.startup.Stages``: the driver's start as named stages (``controller.loop.Runtime.run_stages``), each run
once in order with its seconds, stopped after any stage and gone on with later."""

from __future__ import annotations

import pytest

from rlhf_runtime.infra.startup import Stages


def test_stages_run_in_order_once_each_and_stop_after_the_one_named() -> None:
    ran: list[str] = []
    stages = Stages([(n, lambda n=n: ran.append(n)) for n in ("a", "b", "c", "d")])
    assert list(stages.run(until="b")) == ["a", "b"] and ran == ["a", "b"] and not stages.finished
    assert list(stages.run(until="b")) == ["a", "b"] and ran == ["a", "b"]  # nothing runs twice
    seconds = stages.run()
    assert ran == ["a", "b", "c", "d"] and list(seconds) == ["a", "b", "c", "d"] and stages.finished
    assert all(isinstance(s, float) and s >= 0 for s in seconds.values())


def test_a_failing_stage_is_not_recorded_and_runs_again_next_time() -> None:
    tries: list[int] = []

    def flaky() -> None:
        tries.append(1)
        if len(tries) == 1:
            raise RuntimeError("first try")

    stages = Stages([("a", lambda: None), ("b", flaky), ("c", lambda: None)])
    with pytest.raises(RuntimeError, match="first try"):
        stages.run()
    assert list(stages.seconds) == ["a"]
    assert list(stages.run()) == ["a", "b", "c"] and len(tries) == 2


def test_unknown_and_repeated_stage_names_are_refused() -> None:
    with pytest.raises(ValueError, match="repeat"):
        Stages([("a", lambda: None), ("a", lambda: None)])
    with pytest.raises(ValueError, match="no start-up stage 'z'"):
        Stages([("a", lambda: None)]).run(until="z")
