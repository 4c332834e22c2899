"""Status reporting: the merge-patch body, the uid guard, and the real kubernetes client against a local
HTTP endpoint that records what it receives (no cluster needed)."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from rlhf_runtime.infra.report import ForeignJobError, Metrics, Reporter, StatusClient, status_patch
from tests.helpers import JobAPI

PATH = "/apis/rlhf.dev/v1alpha1/namespaces/ns1/rlhfjobs/job1/status"


def test_patch_body_holds_only_step_throughput_and_runtime() -> None:
    body = status_patch(
        "Running", step=3, message="m", resumed_from_step=2, heartbeat="2026-01-01T00:00:00Z",
        throughput={"rollout_tokens_per_second": 10.0, "samples_per_second": 1.0, "step_seconds": 2.0,
                    "rollout_seconds": 1.0, "train_seconds": 0.5, "weight_sync_seconds": 0.1,
                    "weight_sync_gbps": 3.0, "reward_mean": 0.25},
    )
    assert body == {"status": {
        "step": 3,
        "throughput": {"rolloutTokensPerSecond": 10.0, "samplesPerSecond": 1.0, "stepSeconds": 2.0,
                       "rolloutSeconds": 1.0, "trainSeconds": 0.5, "weightSyncSeconds": 0.1,
                       "weightSyncGbps": 3.0, "rewardMean": 0.25},
        "runtime": {"state": "Running", "message": "m", "heartbeatTime": "2026-01-01T00:00:00Z",
                    "resumedFromStep": 2},
    }}
    assert set(status_patch("Starting")["status"]) == {"runtime"}
    with pytest.raises(ValueError):
        status_patch("Pending")


@pytest.fixture
def fake_api(tmp_path: Path) -> Iterator[tuple[JobAPI, Path]]:
    api = JobAPI("job1", "ns1", "uid-1", {"algorithm": {"steps": 5}})
    yield api, api.kubeconfig(tmp_path / "kubeconfig")
    api.close()


def test_reports_are_merge_patches_on_the_status_subresource(fake_api: tuple[JobAPI, Path], tmp_path: Path) -> None:
    api, kubeconfig = fake_api
    progress = tmp_path / "progress.jsonl"
    reporter = Reporter(StatusClient("job1", "ns1", "uid-1", str(kubeconfig)), Metrics("job1", "ns1"), str(progress))
    reporter.report("Starting", message="starting")
    reporter.report("Running", step=1, throughput={"reward_mean": 0.5, "step_seconds": 1.0})
    assert [r[0] for r in api.requests] == ["GET", "PATCH", "PATCH"]  # uid checked once, before the first report
    patches = [r for r in api.requests if r[0] == "PATCH"]
    assert all(r[2] == "application/merge-patch+json" for r in patches)
    assert all(set(r[3]) == {"status"} for r in patches)
    assert patches[1][3]["status"]["step"] == 1
    assert patches[1][3]["status"]["throughput"] == {"rewardMean": 0.5, "stepSeconds": 1.0}
    assert patches[1][3]["status"]["runtime"]["state"] == "Running"
    assert [json.loads(line)["runtime"]["state"] for line in progress.read_text().splitlines()] == ["Starting", "Running"]
    value = reporter.metrics.registry.get_sample_value("rlhf_reward_mean", {"job": "job1", "namespace": "ns1"})
    assert value == 0.5


def test_refuses_to_report_into_another_job_with_the_same_name(fake_api: tuple[JobAPI, Path]) -> None:
    api, kubeconfig = fake_api
    reporter = Reporter(StatusClient("job1", "ns1", "uid-OLD", str(kubeconfig)))
    with pytest.raises(ForeignJobError, match="refusing"):
        reporter.report("Running", step=1)
    assert [r[0] for r in api.requests] == ["GET"]  # nothing was patched
    reporter.report("Running", step=2)  # API reporting stays off for good
    assert [r[0] for r in api.requests] == ["GET"]


def test_reporting_module_imports_without_torch_vllm_or_ray() -> None:
    code = ("import sys, rlhf_runtime.infra.report, rlhf_runtime.infra.placement, rlhf_runtime.algo.rewards, rlhf_runtime.algo.data, "
            "rlhf_runtime.infra.config, rlhf_runtime.infra.checkpoint, rlhf_runtime.algo.objectives; "
            "print(' '.join(sorted({k.split('.')[0] for k in sys.modules})))")
    loaded = set(subprocess.run([sys.executable, "-c", code], check=True, capture_output=True,
                                text=True).stdout.split())
    assert not loaded & {"torch", "vllm", "ray", "transformers", "kopf"}, loaded & {"torch", "vllm", "ray", "kopf"}


def test_reports_name_the_ray_cluster_they_come_from(monkeypatch) -> None:
    from rlhf_runtime.infra.report import own_ray_cluster

    assert status_patch("Failed", message="x", ray_cluster="job-abc12")["status"]["runtime"]["rayCluster"] == "job-abc12"
    assert "rayCluster" not in status_patch("Running")["status"]["runtime"]
    monkeypatch.setenv("RAY_CLUSTER_NAME", "job-xyz")  # what KubeRay sets in every Ray container
    assert own_ray_cluster() == "job-xyz"


def test_patch_carries_progress_time_and_observed_generation() -> None:
    runtime = status_patch("Running", progress_time="2026-01-01T00:00:05Z", observed_generation=3,
                           heartbeat="2026-01-01T00:00:09Z")["status"]["runtime"]
    assert runtime == {"state": "Running", "heartbeatTime": "2026-01-01T00:00:09Z",
                       "progressTime": "2026-01-01T00:00:05Z", "observedGeneration": 3}
    assert {"progressTime", "observedGeneration"}.isdisjoint(status_patch("Running")["status"]["runtime"])


def test_patch_sets_clears_or_keeps_the_runtime_warning() -> None:
    assert status_patch("Running", warning="mismatch spike")["status"]["runtime"]["warning"] == "mismatch spike"
    cleared = status_patch("Running", warning=None)["status"]["runtime"]
    assert "warning" in cleared and cleared["warning"] is None  # a JSON null: the merge patch removes it
    assert "warning" not in status_patch("Running")["status"]["runtime"]  # heartbeats leave it as it is


def test_heartbeats_keep_progress_time_and_the_hook_reads_the_live_job(fake_api: tuple[JobAPI, Path]) -> None:
    from tests.helpers import wait_for

    api, kubeconfig = fake_api
    reporter = Reporter(StatusClient("job1", "ns1", "uid-1", str(kubeconfig)), heartbeat_seconds=0.05)
    progress = reporter.mark_progress()
    seen: list[dict[str, Any]] = []

    def on_beat() -> None:
        job = reporter.live_job()
        seen.append(job)
        reporter.observed_generation = job["metadata"]["generation"]

    api.generation = 4
    reporter.start_heartbeat(on_beat=on_beat)
    try:
        wait_for(lambda: [r for r in api.requests if r[0] == "PATCH"], timeout=10, what="a heartbeat", interval=0.02)
    finally:
        reporter.close()
    beat = next(r for r in api.requests if r[0] == "PATCH")[3]["status"]["runtime"]
    assert beat["progressTime"] == progress and beat["observedGeneration"] == 4, beat
    assert seen[0]["spec"] == {"algorithm": {"steps": 5}}
    assert ("GET", PATH.removesuffix("/status"), "", None) in api.requests  # the job itself, by name


def test_a_job_config_that_does_not_parse_is_reported_failed(fake_api: tuple[JobAPI, Path], tmp_path: Path) -> None:
    from rlhf_runtime import driver

    api, kubeconfig = fake_api
    bad = tmp_path / "job.json"
    cases = {
        "not json": '{"apiVersion": "rlhf.dev/v1alpha1", "name": "job1", "namespace": "ns1", "uid": "uid-1", spec',
        "other version": json.dumps({"apiVersion": "rlhf.dev/v2", "name": "job1", "namespace": "ns1",
                                     "uid": "uid-1", "spec": {}}),
        "invalid value": json.dumps({"apiVersion": "rlhf.dev/v1alpha1", "name": "job1", "namespace": "ns1",
                                     "uid": "uid-1", "spec": {"model": {"name": "m"}, "image": "i",
                                                              "algorithm": {"steps": -1}}}),
    }
    messages = {}
    for case, text in cases.items():
        bad.write_text(text)
        api.requests.clear()
        progress = tmp_path / f"{case}.jsonl"
        assert driver.main(["--config", str(bad), "--kubeconfig", str(kubeconfig),
                            "--progress-file", str(progress)]) == 1
        patch = [r for r in api.requests if r[0] == "PATCH"]
        assert len(patch) == 1, (case, api.requests)
        runtime = patch[0][3]["status"]["runtime"]
        assert runtime["state"] == "Failed" and runtime["message"].startswith(f"invalid job config {bad}: ")
        assert json.loads(progress.read_text())["runtime"] == runtime
        messages[case] = runtime["message"]
    assert "JSONDecodeError" in messages["not json"]
    assert "'rlhf.dev/v2' is not 'rlhf.dev/v1alpha1'" in messages["other version"]
    assert "algorithm.steps" in messages["invalid value"]


def test_status_patch_carries_the_memory_plan_and_the_agent_record() -> None:
    from rlhf_runtime.infra.report import status_patch

    body = status_patch("Running", step=3, memory={"rollout_gib": 70.1, "kv_cache_gib": 50.0, "offload": True},
                        agent={"step": 3, "turns_mean": 2.5, "errors": {"timeout": 2}, "warning": None})["status"]
    assert body["memory"] == {"rolloutGiB": 70.1, "kvCacheGiB": 50.0, "offload": True}
    # a step below the fault threshold clears an earlier warning (a JSON null in the merge patch)
    assert body["agent"] == {"step": 3, "turnsMean": 2.5, "errors": {"timeout": 2}, "warning": None}
