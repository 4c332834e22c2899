"""End to end: operator + real control plane + real KubeRay + the real runtime (Ray + vLLM on CPU).

KWOK nodes run no containers, so the driver the RayJob would start in the head pod runs here instead, with
exactly what the pod would get: the job.json from the operator's ConfigMap and the job's own ServiceAccount
token (whose Role allows patching this job's status and nothing else). We watch `kubectl get rlhfjobs` show
the step and tokens/s moving, then Succeeded.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from kubernetes import client
from rlhf_testing.tiny import tiny_job_spec

from rlhf_operator import naming
from tests.helpers import LOADED_MACHINE_RAY_ENV, wait_for
from tests.integration.conftest import apply
from tests.integration.test_lifecycle import get_job, phase

pytestmark = [pytest.mark.cluster, pytest.mark.runtime]
STEPS = 6


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tiny-model")
    code = f"from rlhf_testing.tiny import build_tiny_model; build_tiny_model({str(path)!r}, seed=0)"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=300)
    return path


def tiny_job(model: Path) -> dict:
    return {"apiVersion": "rlhf.dev/v1alpha1", "kind": "RLHFJob", "metadata": {"name": "tiny"},
            "spec": tiny_job_spec(model, STEPS)}


def test_runtime_reports_progress_into_the_rlhfjob(cluster, api, operator, namespace, tiny_model, tmp_path) -> None:
    job = tiny_job(tiny_model)
    # an eval set and an export: status.eval and status.output pass the real apiserver's status schema
    job["spec"]["data"]["eval"] = {"prompts": ["abc", "go"]}
    job["spec"]["data"]["evalEveryNSteps"] = 3
    job["spec"]["output"] = {"volume": "out", "path": str(tmp_path / "out")}
    job["spec"]["volumes"] = [{"name": "out", "emptyDir": {}}]
    apply(cluster, job, namespace)
    wait_for(lambda: phase(api, namespace, "tiny") == "Running", 180, "Running (Ray cluster ready on KWOK)")

    names = naming.child_names("tiny")
    cm = client.CoreV1Api(api).read_namespaced_config_map(names.config_map, namespace)
    config = tmp_path / "job.json"
    config.write_text(cm.data[naming.CONFIG_KEY])
    kc = cluster.token_kubeconfig(namespace, names.runtime_identity, tmp_path / "runtime.kubeconfig")

    # The runtime's identity can patch this job's status and nothing else.
    other = dict(tiny_job(tiny_model), metadata={"name": "other"})
    apply(cluster, other, namespace)
    can = lambda *a: cluster.kubectl("--kubeconfig", str(kc), "auth", "can-i", *a, "-n", namespace, check=False).stdout.strip()
    assert can("patch", "rlhfjobs/tiny", "--subresource=status") == "yes"
    assert can("patch", "rlhfjobs/other", "--subresource=status") == "no"
    assert can("patch", "rlhfjobs/tiny") == "no"
    assert can("create", "rayjobs") == "no"

    log = tmp_path / "driver.log"
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **LOADED_MACHINE_RAY_ENV}
    with log.open("w") as out:
        driver = subprocess.Popen(
            [sys.executable, "-m", "rlhf_runtime.driver", "--config", str(config), "--local", "--kubeconfig", str(kc)],
            stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True,
        )
    try:
        seen_steps: list[int] = []

        def progressed() -> bool:
            st = get_job(api, namespace, "tiny").get("status") or {}
            if st.get("step") is not None and st.get("step") not in seen_steps:
                seen_steps.append(st["step"])
            return len(seen_steps) >= 2 and st["phase"] == "Running"

        wait_for(progressed, 300, f"two distinct steps reported while Running (driver log: {log})")
        st = get_job(api, namespace, "tiny")["status"]
        assert st["runtime"]["state"] == "Running"
        assert st["throughput"]["rolloutTokensPerSecond"] > 0
        assert st["throughput"]["weightSyncSeconds"] > 0 and st["throughput"]["stepSeconds"] > 0
        table = cluster.kubectl("get", "rlhfjobs", "tiny", "-n", namespace).stdout
        header, row = table.splitlines()[:2]
        shown = dict(zip(header.split(), row.split(), strict=False))
        assert shown["PHASE"] == "Running" and int(shown["STEP"]) >= st["step"] and float(shown["TOKENS/S"]) > 0, table

        assert driver.wait(timeout=300) == 0, log.read_text()[-3000:]
        done = wait_for(lambda: phase(api, namespace, "tiny") == "Succeeded" and get_job(api, namespace, "tiny"), 60,
                        "Succeeded after the driver finished")
        assert done["status"]["step"] == STEPS and done["status"]["totalSteps"] == STEPS
        assert done["status"]["completionTime"]
        assert done["status"]["eval"]["step"] == STEPS and done["status"]["eval"]["prompts"] == 2
        assert done["status"]["output"] == {**done["status"]["output"], "path": str(tmp_path / "out" / "final"),
                                            "step": STEPS}
        assert (tmp_path / "out" / "final" / "config.json").is_file()
        assert seen_steps == sorted(seen_steps)
        # The operator exports what the runtime reported, for every job, on its own /metrics.
        import urllib.request

        scrape = urllib.request.urlopen(f"http://127.0.0.1:{operator.metrics_port}/metrics", timeout=5).read().decode()
        label = f'job="tiny",namespace="{namespace}"'  # exposition sorts labels by name
        tokens = [ln for ln in scrape.splitlines() if ln.startswith("rlhf_job_rollout_tokens_per_second{") and label in ln]
        assert tokens and float(tokens[0].split()[-1]) > 0, scrape[-2000:]
        assert f'rlhf_job_phase{{{label},phase="Succeeded"}} 1.0' in scrape
        # The other job was never touched by the runtime.
        assert "runtime" not in (get_job(api, namespace, "other").get("status") or {})
        print(json.dumps({"steps_seen": seen_steps, "throughput": done["status"]["throughput"]}))
    finally:
        if driver.poll() is None:
            os.killpg(driver.pid, 9)
            driver.wait(timeout=30)
