"""Fixtures for the real-pod tier: the product as a user runs it, in real containers.

The frozen-driver scenario (``frozen_run``) starts with the tier's first test and plays out beside the others;
the test that checks it runs last (``pytest_collection_modifyitems``).

A real control plane with real nodes (containerd + runc + CNI + kubelet, ``hack/realnodes.py``), cluster DNS
and Service routing; KubeRay as a pod; our operator installed from its Helm chart with the locally built
operator image; RLHFJobs whose head, trainer and engine pods run the locally built CPU runtime image. A tiny
model built from a config is shared with the pods through a hostPath volume (all nodes are on this machine,
as an NFS or CSI volume would be on a real cluster), and so is the checkpoint directory.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest
from kubernetes import client, config

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "hack"))
import cpujob
import localcluster

from tests.helpers import wait_for

#: Real nodes for the tier (two: head and workers can land on different nodes).
REAL_NODES = int(os.environ.get("RLHF_REAL_NODES", "2"))
RELEASE, SYSTEM_NS = "rlhf", "rlhf-system"
RESTRICTED = ("pod-security.kubernetes.io/enforce=restricted", "pod-security.kubernetes.io/enforce-version=latest")


@pytest.fixture(scope="package")
def real_cluster(tmp_path_factory) -> localcluster.Cluster:
    # A short path: containerd's and the kubelet's unix sockets live under it. RLHF_PODS_CLUSTER_DIR names a
    # cluster to reuse if it is up (a development loop: the cluster is then neither started nor stopped here).
    reuse = os.environ.get("RLHF_PODS_CLUSTER_DIR")
    c = localcluster.Cluster(Path(reuse or f"/tmp/rlhf-pods-{uuid.uuid4().hex[:6]}"), localcluster.build())
    if reuse and c.attach():
        yield c
        return
    try:
        c.up(nodes=1, gpus_per_node=8, real_nodes=REAL_NODES)
        yield c
    finally:
        if os.environ.get("RLHF_KEEP_CLUSTER") != "1" and not reuse:
            c.stop()


@pytest.fixture(scope="package")
def rapi(real_cluster) -> client.ApiClient:
    return config.new_client_from_config(str(real_cluster.kubeconfig))


@pytest.fixture(scope="package")
def operator_release(real_cluster) -> str:
    """`helm install` of our chart with the locally built operator image, on a real node."""
    real_cluster.helm("uninstall", RELEASE, "-n", SYSTEM_NS, "--wait", check=False)  # a reused cluster
    # The operator's namespace enforces Pod Security "restricted": the chart's pod must pass it.
    real_cluster.kubectl("create", "namespace", SYSTEM_NS, check=False)
    real_cluster.kubectl("label", "--overwrite", "namespace", SYSTEM_NS, *RESTRICTED)
    real_cluster.install_operator_chart(RELEASE, SYSTEM_NS)
    yield RELEASE
    real_cluster.helm("uninstall", RELEASE, "-n", SYSTEM_NS, check=False)


@pytest.fixture(scope="package")
def agent_sandbox(real_cluster) -> localcluster.Cluster:
    """The real agent-sandbox controller (its CRDs, RBAC and the controller as a host process with
    ``--extensions``; ``Cluster.install_agent_sandbox``), installed once for the tier and stopped with the cluster."""
    real_cluster.install_agent_sandbox()
    return real_cluster


@pytest.fixture(scope="package")
def shared_dir() -> Path:
    """A directory every pod mounts (hostPath): the tiny model and the checkpoints."""
    return cpujob.make_shared_dir(Path(f"/tmp/rlhf-pods-shared-{uuid.uuid4().hex[:6]}"))


def new_namespace(api: client.ApiClient) -> str:
    """A fresh namespace, once its default ServiceAccount exists (pods need it)."""
    name = f"pods-{uuid.uuid4().hex[:6]}"
    client.CoreV1Api(api).create_namespace({"metadata": {"name": name}})
    wait_for(lambda: any(sa.metadata.name == "default"
                         for sa in client.CoreV1Api(api).list_namespaced_service_account(name).items),
             60, "default service account")
    return name


def drop_namespace(api: client.ApiClient, name: str) -> None:
    """Delete ``name``, unless RLHF_KEEP_CLUSTER=1 keeps everything for a look after the run."""
    if os.environ.get("RLHF_KEEP_CLUSTER") != "1":
        client.CoreV1Api(api).delete_namespace(name)


@pytest.fixture
def ns(real_cluster, rapi) -> str:
    name = new_namespace(rapi)
    yield name
    drop_namespace(rapi, name)


def cpu_job(cluster: localcluster.Cluster, shared: Path, name: str, steps: int, *, trainers: int = 1) -> dict:
    return cpujob.cpu_job(name, cluster.images["runtime-cpu"]["ref"], shared, steps, trainers=trainers)


def apply(cluster: localcluster.Cluster, obj: dict, ns: str) -> None:
    cluster.kubectl("apply", "-n", ns, "-f", "-", input=json.dumps(obj))


def get_job(api: client.ApiClient, ns: str, name: str) -> dict:
    return client.CustomObjectsApi(api).get_namespaced_custom_object("rlhf.dev", "v1alpha1", ns, "rlhfjobs", name)


def status(api: client.ApiClient, ns: str, name: str) -> dict:
    return get_job(api, ns, name).get("status") or {}


def pods(api: client.ApiClient, ns: str, selector: str = "") -> list:
    return client.CoreV1Api(api).list_namespaced_pod(ns, label_selector=selector).items


def diagnostics(cluster: localcluster.Cluster, ns: str) -> str:
    """What to print when a real-pod test fails: pods, events, RLHFJob status, the head's and submitter's logs."""
    parts = []
    for args in (("get", "pods", "-o", "wide", "-n", ns), ("get", "rlhfjobs", "-n", ns, "-o", "yaml"),
                 ("get", "events", "-n", ns, "--sort-by=.lastTimestamp")):
        parts.append(cluster.kubectl(*args, check=False).stdout[-4000:])
    out = cluster.kubectl("get", "pods", "-n", ns, "-o", "name", check=False).stdout.split()
    for pod in out:
        log = cluster.kubectl("logs", "-n", ns, pod, "--all-containers", "--tail=60", check=False)
        parts.append(f"--- {pod}\n{(log.stdout or log.stderr)[-3000:]}")
    return "\n".join(parts)


def writable_dir(shared: Path, *parts: str) -> Path:
    """``shared/<parts...>``, made with every level writable by the pods' users (which are not this test's)."""
    path = shared.joinpath(*parts)
    path.mkdir(parents=True, mode=0o777)
    for k in range(1, len(parts) + 1):
        shared.joinpath(*parts[:k]).chmod(0o777)
    return path


def checkpointed_job(cluster, shared, ns: str, name: str, steps: int, retries: int, *, trainers: int = 1) -> dict:
    job = cpu_job(cluster, shared, name, steps, trainers=trainers)
    writable_dir(shared, "ckpt", ns, name)
    job["spec"]["checkpoint"] = {"volume": "shared", "path": f"/shared/ckpt/{ns}/{name}", "everyNSteps": 3}
    job["spec"]["backoffLimit"] = retries
    # these tests are about a run lost with its pod and KubeRay's retry on a new cluster; repairs inside a run
    # (an engine replaced, trainers restarted) are the runtime tier's (tests/runtime/test_runtime_faults.py)
    job["spec"]["inRunRecoveries"] = 0
    return job


def _wait(cluster, api, ns, what, check, timeout):
    try:
        return wait_for(check, timeout, what, interval=1)
    except AssertionError as e:
        raise AssertionError(f"{e}\n{diagnostics(cluster, ns)}") from None


FROZEN_STEPS = 60
#: the test that checks what the frozen-driver scenario saw (tests/pods/test_faults.py)
FROZEN_TEST = "test_frozen_driver_is_ended_and_the_run_retried"


def _frozen_scenario(cluster, api, ns: str, job: dict, out: dict) -> None:
    """The frozen-driver run from its start to its end (``test_frozen_driver_is_ended_and_the_run_retried``),
    what it saw in ``out``; an error is kept there for the test to raise."""
    try:
        _wait(cluster, api, ns, "step >= 4 (a checkpoint at step 3)",
              lambda: (status(api, ns, "frozen").get("step") or 0) >= 4, 900)
        head = next(p for p in pods(api, ns, "ray.io/node-type=head") if p.status.phase == "Running")
        # every process of the driver (not this shell, whose own command line names it too)
        stop = ('for p in /proc/[0-9]*; do n=${p#/proc/}; [ "$n" = "$$" ] && continue; '
                "c=$(tr '\\0' ' ' < $p/cmdline 2>/dev/null); case \"$c\" in *'for p in'*) ;; "
                '*rlhf_runtime.driver*) kill -STOP $n && echo stopped $n;; esac; done')
        r = cluster.kubectl("exec", "-n", ns, head.metadata.name, "-c", "ray-head", "--", "sh", "-c", stop)
        out["stopped"] = r.stdout + r.stderr
        t0 = time.monotonic()
        # the retried run has a few steps left (a live edit: the frozen driver cannot adopt it, the retry reads it)
        out["steps"] = (status(api, ns, "frozen").get("step") or 0) + 6
        job["spec"]["algorithm"]["steps"] = out["steps"]
        apply(cluster, job, ns)

        def stalled() -> bool:
            st = status(api, ns, "frozen")
            c = next((c for c in st.get("conditions") or [] if c["type"] == "Stalled"), {})
            return c.get("status") == "True" and c.get("reason") in ("ProgressDeadlineExceeded", "RuntimeUnresponsive")

        _wait(cluster, api, ns, "Stalled (ProgressDeadlineExceeded)", stalled, 600)
        out["stalled_s"] = time.monotonic() - t0
        _wait(cluster, api, ns, "Succeeded after the retry",
              lambda: status(api, ns, "frozen").get("phase") in ("Succeeded", "Failed"), 1500)
        out["ended_s"] = time.monotonic() - t0
    except BaseException as e:  # noqa: BLE001 - raised by the test
        out["error"] = e


def pytest_collection_modifyitems(session, config, items) -> None:
    """``FROZEN_TEST`` moved to the end of this tier's tests: what it waits for (the frozen run's deadline, the
    operator's grace, KubeRay's retry) then overlaps every other test of the tier (``frozen_run``)."""
    frozen = next((i for i in items if i.name == FROZEN_TEST), None)
    if frozen is None:
        return
    at = items.index(frozen)
    items.pop(at)
    here = Path(__file__).parent  # after this tier's last other test; where it was when it is the tier's only one
    last = max((k for k, i in enumerate(items) if here in Path(str(i.path)).parents), default=at - 1)
    items.insert(last + 1, frozen)


@pytest.fixture(scope="package", autouse=True)
def frozen_run(request):
    """The frozen-driver scenario, started with the tier's first test when ``FROZEN_TEST`` was collected (None
    otherwise) and played out beside the tier's other tests: most of it is waiting (for the progress deadline,
    the operator's grace and KubeRay's retry), which then overlaps their runs. ``FROZEN_TEST`` checks what it saw:
    (namespace, thread, what it saw)."""
    if not any(item.name == FROZEN_TEST for item in request.session.items):
        yield None
        return
    cluster, api = request.getfixturevalue("real_cluster"), request.getfixturevalue("rapi")
    request.getfixturevalue("operator_release")
    ns = new_namespace(api)
    job = checkpointed_job(cluster, request.getfixturevalue("shared_dir"), ns, "frozen", FROZEN_STEPS, retries=1)
    # the retried run must start its engines within it while another test's job runs beside it
    job["spec"]["progressDeadlineSeconds"] = 240
    apply(cluster, job, ns)
    out: dict = {}
    thread = threading.Thread(target=_frozen_scenario, args=(cluster, api, ns, job, out), daemon=True,
                              name="frozen-driver-scenario")
    thread.start()
    yield ns, thread, out
    thread.join(timeout=60)
    drop_namespace(api, ns)
