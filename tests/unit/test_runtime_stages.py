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


def test_the_drivers_start_is_its_named_stages_and_the_progress_file_gets_their_seconds_once(tmp_path) -> None:
    """``Runtime.stages`` in the order the driver starts a job; ``run_stages`` stops after the stage named and goes
    on from there; the progress file's ``startup`` record comes once, when the last stage has run. The stages'
    own work (Ray, actors) is left to the runtime tier: here each stage only records that it ran."""
    import json

    from rlhf_api.models import RuntimeConfig
    from rlhf_runtime.controller.loop import Runtime
    from rlhf_runtime.infra.report import Metrics, Reporter

    cfg = RuntimeConfig(name="j", namespace="ns", spec={"model": {"name": "m"}, "image": "i",
                                                        "data": {"prompts": ["p"]}, "reward": {"rule": "contains"}})
    progress = tmp_path / "progress.jsonl"
    rt = Runtime(cfg, Reporter(None, Metrics("j", "ns"), str(progress)))
    names = ["check", "connect", "placement", "actors", "inputs", "trainers", "roles", "engines", "transfer",
             "weight_sync", "validation"]
    assert [n for n, _ in rt.stages()] == names == rt.startup.names
    ran: list[str] = []
    rt.startup = Stages([(n, lambda n=n: ran.append(n)) for n in rt.startup.names])
    assert list(rt.run_stages(until="actors")) == names[:4] and not progress.exists()
    assert list(rt.run_stages()) == names and ran == names
    rt.run_stages()
    records = [json.loads(x) for x in progress.read_text().splitlines()]
    assert [list(r["startup"]) for r in records if "startup" in r] == [names]
