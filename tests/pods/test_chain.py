"""The whole chain in real containers, on CPU.

`helm install` of the chart (the operator runs as a pod with the chart's ServiceAccount and RBAC) ->
`kubectl apply` of an RLHFJob -> KubeRay creates head and worker pods on the real nodes -> KubeRay's submitter
runs our driver in the Ray cluster -> trainer and vLLM (CPU) actors in separate worker pods (the Ray custom
resource of each group is the only place their placement groups can land) -> weights through vLLM's
weight-transfer API (gloo) -> status patched with the job's own ServiceAccount token -> `Succeeded`.
"""

from __future__ import annotations

import pytest

from tests.helpers import wait_for
from tests.pods.conftest import apply, cpu_job, diagnostics, pods, status

pytestmark = [pytest.mark.pods, pytest.mark.timeout(2400)]  # the first test also waits for the cluster


def run_to_end(cluster, api, ns: str, job: dict, timeout: float, scraped: list[str] | None = None
               ) -> tuple[dict, list[str]]:
    """Apply ``job`` and poll its status until it ends; returns the final status and every distinct
    `kubectl get rlhfjobs` row seen on the way (phase, step). ``scraped``: collects what the runtime's /metrics on
    the head pod (``spec.head.metricsPort``, read inside the pod) served while the job ran."""
    name = job["metadata"]["name"]
    apply(cluster, job, ns)
    seen: list[str] = []
    placed: dict[str, str] = {}

    def ended() -> bool:
        st = status(api, ns, name)
        row = f"{st.get('phase', '')} step={st.get('step', '')} tokens/s={(st.get('throughput') or {}).get('rolloutTokensPerSecond', '')}"
        if not seen or seen[-1] != row:
            seen.append(row)
        for p in pods(api, ns):
            if p.spec.node_name:
                placed[p.metadata.name] = p.spec.node_name
            if scraped is not None and "head" in p.metadata.name and p.status.phase == "Running" \
                    and st.get("phase") == "Running":
                out = cluster.kubectl("exec", "-n", ns, p.metadata.name, "-c", "ray-head", "--", "wget", "-qO-",
                                      "http://127.0.0.1:9095/metrics", check=False)
                if out.returncode == 0 and "rlhf_step" in out.stdout:
                    scraped.append(out.stdout)
        return st.get("phase") in ("Succeeded", "Failed")

    try:
        wait_for(ended, timeout, f"RLHFJob {name} to finish", interval=2)
    except AssertionError as e:
        raise AssertionError(f"{e}\nseen: {seen}\n{diagnostics(cluster, ns)}") from None
    st = status(api, ns, name)
    st["_placed"] = placed
    if st.get("phase") != "Succeeded":
        raise AssertionError(f"{name} ended {st.get('phase')}: {st.get('message')}\nseen: {seen}\n"
                             f"{diagnostics(cluster, ns)}")
    return st, seen


def test_fsdp2_over_two_trainer_pods_with_validation(real_cluster, rapi, operator_release, shared_dir, ns) -> None:
    """The chain to Succeeded, with two trainer pods that form one FSDP2 group over gloo (the rendezvous crosses
    pods), and validation mode comparing the synced engine with a fresh engine loaded from the trainer's weights
    (moved across pods). (One trainer pod runs to Succeeded in every fault test of test_faults.py.) The driver in
    the head pod tracks to TensorBoard on the shared volume (the event files hold every step) and serves its
    Prometheus gauges on the head pod's metrics port while it runs."""
    steps = 3
    job = cpu_job(real_cluster, shared_dir, "fsdp", steps, trainers=2)
    job["spec"]["weightSync"] = {**job["spec"].get("weightSync", {}), "validate": True}
    # keep the finished Ray cluster and KubeRay's submitter pod (whose log is the driver's) until the namespace
    # goes: with the default 0 KubeRay deletes them as the job completes, racing the log read below
    job["spec"]["ttlSecondsAfterFinished"] = 600
    # the head pod (the driver) writes TensorBoard event files to the shared hostPath volume (spec.tracking)
    job["spec"]["tracking"] = {"tensorboard": {"volume": "shared", "path": "/shared/tb"}}
    scraped: list[str] = []
    st, seen = run_to_end(real_cluster, rapi, ns, job, 1200, scraped)
    print("\n".join(seen))
    assert st["step"] == steps
    # the runtime's Prometheus endpoint on the head pod served the job's gauges, labelled as the PodMonitor keeps
    # them (honorLabels): its job and namespace
    assert scraped, "the head pod's /metrics (port 9095) never answered while the job ran"
    labelled = f'rlhf_step{{job="fsdp",namespace="{ns}"}}'
    assert any(labelled in text for text in scraped), (len(scraped), scraped[-1][:2000])
    assert st["throughput"]["rolloutTokensPerSecond"] > 0
    assert st["throughput"]["weightSyncSeconds"] > 0
    assert st["runtime"]["state"] == "Succeeded"
    assert any(p.startswith("Running") for p in seen), seen
    from tests.unit.test_runtime_tracking import scalars

    assert st["tracking"] == {"tensorboardDir": "/shared/tb/fsdp"}, st.get("tracking")
    assert [step for step, _ in scalars(shared_dir / "tb" / "fsdp", "train/loss")] == list(range(1, steps + 1))
    # every pod of the job ran on a real node (the head, two trainer pods, one engine pod, the submitter)
    nodes = set(st["_placed"].values())
    assert nodes and all(n.startswith("real-node-") for n in nodes), st["_placed"]
    trainer_pods = [p for p in st["_placed"] if "trainer" in p]
    assert len(trainer_pods) == 2, st["_placed"]
    assert any("rollout" in p for p in st["_placed"]), st["_placed"]
    # the driver's log (KubeRay's submitter follows it) says the fresh-engine comparison ran and passed
    logs: list[str] = [""]

    def validated() -> bool:
        logs[0] = "".join(real_cluster.kubectl("logs", "-n", ns, p.metadata.name, check=False).stdout
                          for p in pods(rapi, ns) if "worker" not in p.metadata.name)
        return "weight-sync validation passed" in logs[0]

    try:
        wait_for(validated, 120, "'weight-sync validation passed' in the driver's log", interval=2)
    except AssertionError as e:
        raise AssertionError(f"{e}\n{logs[0][-3000:]}") from None
