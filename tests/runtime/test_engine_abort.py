"""A cancelled ``generate`` call on the async engine actors (real Ray, real vLLM on CPU): ``cancel_call`` on the call
(``ray.cancel``: what the multi-turn rollout does for a partial rollout's dropped group) ends its request in the
engine, here while a pause for a weight sync holds it (so it cannot have finished first); the engine counts it and,
resumed, serves the next call."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.runtime.conftest import engine_script, job_config

pytestmark = pytest.mark.runtime

SCRIPT = r"""
from rlhf_runtime.agent.rollout import cancel_call
from rlhf_runtime.rollout.api import engine_class


def abort_one(name):
    cls = engine_class(True, name)
    actor = ray.remote(cls).options(num_cpus=0, runtime_env={"env_vars": env}).remote(EngineOptions(kw, env))
    ray.get(actor.ready.remote(), timeout=300)
    call = actor.generate.remote([[3, 4, 5]], {"n": 1, "max_tokens": 80, "temperature": 1.0, "seed": 0})
    deadline = time.monotonic() + 60  # the engine has taken the request (Ray may start an async actor's calls
    while ray.get(actor.requests_live.remote(), timeout=30) < 1:  # out of order: pause could come first)
        assert time.monotonic() < deadline, "the generate call's request never reached the engine"
        time.sleep(0.01)
    ray.get(actor.pause.remote(after_tokens=2), timeout=120)  # the request live and frozen, as during a sync
    cancel_call(call)  # what the multi-turn rollout does for a dropped group's turn
    try:
        ray.get(call, timeout=60)
        ended = "finished"
    except ray.exceptions.TaskCancelledError:
        ended = "cancelled"
    aborted = 0
    deadline = time.monotonic() + 30
    while aborted < 1 and time.monotonic() < deadline:
        aborted = ray.get(actor.requests_aborted.remote(), timeout=30)
        time.sleep(0.05)
    ray.get(actor.resume.remote(), timeout=60)
    outs = ray.get(actor.generate.remote([[3, 4, 5]], {"n": 2, "max_tokens": 3, "temperature": 1.0, "seed": 0}),
                   timeout=120)
    ray.kill(actor)
    return {"ended": ended, "aborted": aborted, "samples": [len(s) for s in outs[0]["samples"]]}


try:
    print("RESULT " + json.dumps({name: abort_one(name) for name in ("asyncllm", "stepped")}))
finally:
    ray.shutdown()
"""


def test_a_cancelled_generate_is_aborted_in_the_engine_which_serves_on(tiny_model: Path) -> None:
    spec = job_config(tiny_model, rollout={"kvCacheMemoryGiB": 0.125})
    results = engine_script(SCRIPT, spec)
    for engine in ("asyncllm", "stepped"):  # engines.AsyncEngine (AsyncLLM), stepped.SteppedEngine (in-process)
        out = results[engine]
        assert out["ended"] == "cancelled" and out["aborted"] == 1, (engine, out)
        assert len(out["samples"]) == 2 and all(1 <= n <= 3 for n in out["samples"]), (engine, out)  # serves on
