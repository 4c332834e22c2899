"""Without KubeRay the operator stays up and says so on every job; when KubeRay arrives the job proceeds."""

from __future__ import annotations

import pytest
from kubernetes import client, config

from rlhf_api import models as m
from tests.helpers import events_until, wait_for
from tests.integration.conftest import Operator, apply, load_sample, localcluster

pytestmark = pytest.mark.cluster


@pytest.fixture(scope="module")
def bare_cluster(tmp_path_factory):
    c = localcluster.Cluster(tmp_path_factory.mktemp("bare"), localcluster.build())
    try:
        c.up(nodes=1, gpus_per_node=8, kuberay=False)
        yield c
    finally:
        c.stop()


def test_missing_kuberay_is_reported_then_recovered(bare_cluster, tmp_path) -> None:
    api = config.new_client_from_config(str(bare_cluster.kubeconfig))
    objs = client.CustomObjectsApi(api)
    op = Operator(bare_cluster, ["--namespace", "default"], tmp_path / "op.log").start()
    try:
        job = load_sample("separate-nccl-tp2")
        apply(bare_cluster, job, "default")
        name = job["metadata"]["name"]

        def get():
            return objs.get_namespaced_custom_object(m.GROUP, m.VERSION, "default", m.PLURAL, name)

        j = wait_for(lambda: (get().get("status") or {}).get("phase") == "Pending"
                     and "KubeRay" in get()["status"].get("message", "") and get(), 60, "KubeRayMissing")
        conds = {c["type"]: c for c in j["status"]["conditions"]}
        assert conds["Stalled"]["status"] == "True" and conds["Stalled"]["reason"] == "KubeRayMissing"
        assert "install the KubeRay operator" in j["status"]["message"]
        events_until(api, "default", name, lambda evs: any(e.type == "Warning" and "KubeRay" in e.message for e in evs),
                     "a Warning naming KubeRay")
        assert op.alive(), (tmp_path / "op.log").read_text()[-2000:]

        bare_cluster.install_kuberay()
        wait_for(lambda: get()["status"]["phase"] == "Running", 180, "Running once KubeRay is installed")
        assert op.alive()
    finally:
        op.kill()
