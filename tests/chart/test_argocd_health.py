"""The Argo CD health script, run by a real Lua interpreter on statuses the operator's own status code makes."""

from __future__ import annotations

import datetime as dt
from pathlib import Path

import pytest
from lupa import LuaRuntime

from rlhf_operator import status as st

SCRIPT = (Path(__file__).resolve().parents[2] / "charts/rlhf-operator/files/argocd-health.lua").read_text()
NOW = dt.datetime(2026, 11, 22, tzinfo=dt.UTC)


def health(obj: dict) -> tuple[str, str]:
    lua = LuaRuntime(unpack_returned_tuples=True)

    def to_lua(v):
        if isinstance(v, dict):
            return lua.table_from({k: to_lua(x) for k, x in v.items()})
        if isinstance(v, list):
            return lua.table_from([to_lua(x) for x in v])
        return v

    fn = lua.eval(f"function(obj) {SCRIPT} end")
    out = fn(to_lua(obj))
    return out["status"], out["message"]


def job(observed: st.Observed | None, generation: int = 1, extra: dict | None = None) -> dict:
    obj = {"metadata": {"name": "j", "generation": generation}}
    if observed is not None:
        obj["status"] = {**st.compute(observed, NOW), **(extra or {})}
    return obj


def o(**kw) -> st.Observed:
    return st.Observed(generation=kw.pop("generation", 1), old_status=kw.pop("old_status", {}), total_steps=10, **kw)


RJ_RUNNING = {"status": {"jobDeploymentStatus": "Running", "rayClusterName": "c"}}
UNSCHED = {"metadata": {"name": "p"}, "status": {"conditions": [
    {"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": "Insufficient nvidia.com/gpu"}]}}

CASES = [
    ("no status yet", job(None), "Progressing"),
    ("provisioning", job(o(ray_job={"status": {"jobDeploymentStatus": "Initializing"}})), "Progressing"),
    ("running", job(o(ray_job=RJ_RUNNING, ray_cluster={"status": {"state": "ready"}}), extra={"step": 3}), "Healthy"),
    ("succeeded", job(o(ray_job={"status": {"jobDeploymentStatus": "Complete", "jobStatus": "SUCCEEDED"}})), "Healthy"),
    ("failed", job(o(ray_job={"status": {"jobDeploymentStatus": "Failed", "message": "boom"}})), "Degraded"),
    ("invalid", job(o(invalid="spec.x: bad")), "Degraded"),
    ("unschedulable", job(o(ray_job={"status": {"jobDeploymentStatus": "Initializing"}}, pods=[UNSCHED])), "Degraded"),
    ("kuberay missing", job(o(kuberay_missing="no CRDs")), "Degraded"),
    ("suspended", job(o(suspend=True, ray_job={"status": {"jobDeploymentStatus": "Suspended"}})), "Suspended"),
    ("stale generation", job(o(ray_job=RJ_RUNNING, ray_cluster={"status": {"state": "ready"}}), generation=2), "Progressing"),
]


@pytest.mark.parametrize("name,obj,want", CASES, ids=[c[0] for c in CASES])
def test_health(name, obj, want) -> None:
    got, message = health(obj)
    assert got == want, (name, message)


def test_running_message_shows_progress() -> None:
    obj = job(o(ray_job=RJ_RUNNING, ray_cluster={"status": {"state": "ready"}}), extra={"step": 3})
    assert health(obj) == ("Healthy", "Running: step 3/10")
