"""The whole chain in real containers, on CPU, and the lifecycle of a job that runs there.

`helm install` of the chart (the operator runs as a pod with the chart's ServiceAccount and RBAC) ->
`kubectl apply` of an RLHFJob -> KubeRay creates head and worker pods on the real nodes -> KubeRay's submitter
runs our driver in the Ray cluster -> trainer and vLLM (CPU) actors in separate worker pods (the Ray custom
resource of each group is the only place their placement groups can land) -> weights through vLLM's
weight-transfer API (gloo) -> status patched with the job's own ServiceAccount token (`kubectl get rlhfjobs`, the
operator's /metrics) -> suspended (the Ray cluster deleted with the driver in it) -> resumed from the newest
checkpoint on a new Ray cluster -> evaluated, exported -> `Succeeded`.
"""

from __future__ import annotations

import time

import pytest

from tests.helpers import wait_for
from tests.pods.conftest import (
    SYSTEM_NS,
    _wait,
    apply,
    checkpointed_job,
    diagnostics,
    pods,
    status,
    writable_dir,
)
from tests.pods.test_faults import _events

pytestmark = [pytest.mark.pods, pytest.mark.timeout(2400)]  # the first test also waits for the cluster


class Watch:
    """Polls one RLHFJob: every distinct `kubectl get rlhfjobs` row (phase, step, tokens/s) and phase seen, and
    what the runtime's /metrics on the head pod (``spec.head.metricsPort``, read inside the pod) served while it
    ran, until an answer holds a step's gauge."""

    def __init__(self, cluster, api, ns: str, name: str) -> None:
        self.cluster, self.api, self.ns, self.name = cluster, api, ns, name
        self.rows: list[str] = []
        self.phases: list[str] = []
        self.scraped: list[str] = []

    def poll(self) -> dict:
        st = status(self.api, self.ns, self.name)
        row = f"{st.get('phase', '')} step={st.get('step', '')} tokens/s={(st.get('throughput') or {}).get('rolloutTokensPerSecond', '')}"
        if not self.rows or self.rows[-1] != row:
            self.rows.append(row)
        if st.get("phase") and (not self.phases or self.phases[-1] != st["phase"]):
            self.phases.append(st["phase"])
        if st.get("phase") == "Running" and not any("rlhf_step{" in text for text in self.scraped):
            for p in pods(self.api, self.ns, "ray.io/node-type=head"):
                if p.status.phase != "Running":
                    continue
                out = self.cluster.kubectl("exec", "-n", self.ns, p.metadata.name, "-c", "ray-head", "--", "wget",
                                           "-qO-", "http://127.0.0.1:9095/metrics", check=False)
                if out.returncode == 0 and "rlhf_step" in out.stdout:
                    self.scraped.append(out.stdout)
        return st

    def until(self, what: str, want, timeout: float) -> dict:
        """The status once ``want(status)`` holds; fails at once if the job fails on the way."""
        def check() -> dict | None:
            st = self.poll()
            return st if want(st) or st.get("phase") == "Failed" else None

        st = _wait(self.cluster, self.api, self.ns, what, check, timeout)
        if st.get("phase") == "Failed" and not want(st):
            raise AssertionError(f"{self.name} Failed while waiting for {what}: {st.get('message')}\n"
                                 f"seen: {self.rows}\n{diagnostics(self.cluster, self.ns)}")
        return st


def test_fsdp2_over_two_trainer_pods_validates_suspends_and_resumes_from_the_newest_checkpoint(
        real_cluster, rapi, operator_release, shared_dir, ns) -> None:
    """The chain with two trainer pods that form one FSDP2 group over gloo (the rendezvous crosses pods), and
    validation mode comparing the synced engine with a fresh engine loaded from the trainer's weights (moved
    across pods). The driver in the head pod tracks to TensorBoard on the shared volume and serves its Prometheus
    gauges on the head pod's metrics port while it runs. (One trainer pod runs to Succeeded in every fault test
    of test_faults.py.)

    Mid-run the job is suspended: the Ray cluster goes, and the driver, terminated with it, reports a failure that
    belongs to the teardown. The job must go Running -> Suspended -> Running and finish, never Failed; the resumed
    run (both FSDP2 ranks) starts from the newest checkpoint, not from step 0, and validates again."""
    # 0.1-2 s a step: the suspension (applied at step 4, taking effect ~20-30 s later) must land mid-run; the first
    # run's length costs nothing, the resumed run is cut short by an edit
    first_steps = 5000
    job = checkpointed_job(real_cluster, shared_dir, ns, "fsdp", first_steps, retries=0, trainers=2)
    job["spec"]["weightSync"] = {**job["spec"].get("weightSync", {}), "validate": True}
    # keep the finished Ray cluster and KubeRay's submitter pod (whose log is the driver's) until the namespace
    # goes: with the default 0 KubeRay deletes them as the job completes, racing the log read below
    job["spec"]["ttlSecondsAfterFinished"] = 600
    # the head pod (the driver) writes TensorBoard event files to the shared hostPath volume (spec.tracking)
    job["spec"]["tracking"] = {"tensorboard": {"volume": "shared", "path": "/shared/tb"}}
    # an eval set and an export: status.eval and status.output pass the real apiserver's status schema
    out = writable_dir(shared_dir, "out", ns)
    job["spec"]["data"] = {**job["spec"]["data"], "eval": {"prompts": ["abc", "go"]}, "evalEveryNSteps": 3}
    job["spec"]["output"] = {"volume": "shared", "path": f"/shared/out/{ns}"}
    apply(real_cluster, job, ns)
    watch = Watch(real_cluster, rapi, ns, "fsdp")
    st = watch.until("step >= 4 (a checkpoint at step 3)", lambda st: (st.get("step") or 0) >= 4, 900)
    # `kubectl get rlhfjobs` shows the phase, the step and the rollout's tokens/s of the running job
    header, row = real_cluster.kubectl("get", "rlhfjobs", "fsdp", "-n", ns).stdout.splitlines()[:2]
    shown = dict(zip(header.split(), row.split(), strict=False))
    assert shown["PHASE"] == "Running" and int(shown["STEP"]) >= st["step"] and float(shown["TOKENS/S"]) > 0, shown
    job["spec"]["suspend"] = True
    apply(real_cluster, job, ns)
    t0 = time.monotonic()
    st = watch.until("Suspended with no Ray pod left",
                     lambda st: st.get("phase") == "Suspended" and not pods(rapi, ns, "ray.io/cluster"), 300)
    suspended_s = time.monotonic() - t0
    at = st.get("step") or 0
    # resume with a few steps left (a live edit, allowed while suspended)
    steps = at + 3
    job["spec"]["suspend"] = False
    job["spec"]["algorithm"]["steps"] = steps
    apply(real_cluster, job, ns)
    t1 = time.monotonic()
    watch.until("Running again", lambda st: st.get("phase") == "Running", 600)
    st = watch.until("Succeeded", lambda st: st.get("phase") == "Succeeded", 1200)
    resumed = (st.get("runtime") or {}).get("resumedFromStep")
    print("\n".join(watch.rows))
    print(f"SUSPEND at step {at}: Suspended after {suspended_s:.0f}s; resumed from step {resumed}, Succeeded "
          f"{time.monotonic() - t1:.0f}s after resume; phases {watch.phases}")

    # suspend -> resume from the newest checkpoint (every 3 steps) before the suspension, not step 0
    phases = watch.phases
    assert phases[phases.index("Running"):][:3] in (["Running", "Suspended", "Provisioning"],
                                                    ["Running", "Suspended", "Running"]), phases
    assert "Running" in phases[phases.index("Suspended"):] and "Failed" not in phases, phases
    assert st["step"] == steps
    assert at < first_steps, f"the suspension landed after the last step ({at}): nothing was left to resume"
    assert resumed is not None and 3 <= resumed <= at, (resumed, at)
    _events(rapi, ns, "fsdp", "^Suspended: ", "^Resumed: ")

    # the runtime's Prometheus endpoint on the head pod served the job's gauges, labelled as the PodMonitor keeps
    # them (honorLabels): its job and namespace
    assert watch.scraped, "the head pod's /metrics (port 9095) never answered while the job ran"
    labelled = f'rlhf_step{{job="fsdp",namespace="{ns}"}}'
    assert any(labelled in text for text in watch.scraped), (len(watch.scraped), watch.scraped[-1][:2000])
    assert st["throughput"]["rolloutTokensPerSecond"] > 0
    assert st["throughput"]["weightSyncSeconds"] > 0
    assert st["runtime"]["state"] == "Succeeded" and st["totalSteps"] == steps and st["completionTime"]
    assert st["eval"]["step"] == steps and st["eval"]["prompts"] == 2, st["eval"]
    assert st["output"] == {**st["output"], "path": f"/shared/out/{ns}/final", "step": steps}, st["output"]
    assert (out / "final" / "config.json").is_file()
    # the operator exports what the runtime reported, for every job, on its own /metrics (read through the
    # apiserver's proxy to the operator's pod)
    label = f'job="fsdp",namespace="{ns}"'  # exposition sorts labels by name
    scrape: list[str] = [""]

    def exported() -> bool:
        (op,) = [p.metadata.name for p in pods(rapi, SYSTEM_NS) if p.status.phase == "Running"]
        scrape[0] = real_cluster.kubectl("get", "--raw", f"/api/v1/namespaces/{SYSTEM_NS}/pods/{op}:9090/proxy/metrics"
                                         ).stdout
        tokens = [ln for ln in scrape[0].splitlines()
                  if ln.startswith("rlhf_job_rollout_tokens_per_second{") and label in ln]
        return bool(tokens) and float(tokens[0].split()[-1]) > 0 and \
            f'rlhf_job_phase{{{label},phase="Succeeded"}} 1.0' in scrape[0]

    try:
        wait_for(exported, 60, "the job's tokens/s and Succeeded phase on the operator's /metrics", interval=2)
    except AssertionError as e:
        raise AssertionError(f"{e}\n{scrape[0][-2000:]}") from None
    from tests.unit.test_runtime_tracking import scalars

    # one point per step: the resumed run replaced the steps after its checkpoint (TensorBoard's purge_step)
    assert st["tracking"] == {"tensorboardDir": "/shared/tb/fsdp"}, st.get("tracking")
    assert [step for step, _ in scalars(shared_dir / "tb" / "fsdp", "train/loss")] == list(range(1, steps + 1))
    # every pod of the resumed run on a real node: the head, two trainer pods, one engine pod, the submitter
    placed = {p.metadata.name: p.spec.node_name for p in pods(rapi, ns) if p.spec.node_name}
    assert placed and all(n.startswith("real-node-") for n in placed.values()), placed
    assert len([p for p in placed if "trainer" in p]) == 2, placed
    assert any("rollout" in p for p in placed), placed
    # the resumed driver's log (KubeRay's submitter follows it) says the fresh-engine comparison ran and passed
    logs: list[str] = [""]

    def validated() -> bool:
        logs[0] = "".join(real_cluster.kubectl("logs", "-n", ns, p.metadata.name, check=False).stdout
                          for p in pods(rapi, ns) if "worker" not in p.metadata.name)
        return "weight-sync validation passed" in logs[0]

    try:
        wait_for(validated, 120, "'weight-sync validation passed' in the driver's log", interval=2)
    except AssertionError as e:
        raise AssertionError(f"{e}\n{logs[0][-3000:]}") from None
