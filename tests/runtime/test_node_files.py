"""Files copied between Ray nodes through the object store (``rlhf_runtime.infra.node_files``), on a real Ray cluster
of three nodes on this host: a head without CPUs and two workers, each with its own ``TMPDIR`` (as pods have
their own filesystems) and its own custom resource, reached through placement-group bundles that ask for
nothing else, as the runtime's bundles do."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.runtime

SCRIPT = r"""
import hashlib, json, os, sys, tempfile
from pathlib import Path

import ray
from ray.cluster_utils import Cluster
from ray.util.placement_group import placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from rlhf_runtime.infra import node_files

root = Path(sys.argv[1])
trainer_tmp, engine_tmp = root / "trainer-node", root / "engine-node"
trainer_tmp.mkdir(); engine_tmp.mkdir()
cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
cluster.add_node(num_cpus=1, resources={"rlhf_trainer": 1}, env_vars={"TMPDIR": str(trainer_tmp)})
cluster.add_node(num_cpus=1, resources={"rlhf_rollout": 1}, env_vars={"TMPDIR": str(engine_tmp)})
ray.init(address=cluster.address)
try:
    pg = placement_group([{"rlhf_trainer": 1}, {"rlhf_rollout": 1}], strategy="SPREAD")
    ray.get(pg.ready(), timeout=120)
    on = lambda i: PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=i)

    @ray.remote(num_cpus=0)
    class Stager:
        def stage(self):
            self.dir = tempfile.mkdtemp(prefix="rlhf-stage-")
            Path(self.dir, "config.json").write_text('{"a": 1}')
            Path(self.dir, "sub").mkdir()
            Path(self.dir, "sub", "w.bin").write_bytes(os.urandom(3 << 20))
            return self.dir, node_files.list_files(self.dir)

        def read(self, name):
            return Path(self.dir, name).read_bytes()

        def node(self):
            return ray.get_runtime_context().get_node_id()

    @ray.remote(num_cpus=0)
    def digests(path):
        files = node_files.list_files(path) if os.path.isdir(path) else []
        return {n: hashlib.sha256(Path(path, n).read_bytes()).hexdigest() for n in files}

    @ray.remote(num_cpus=0)
    def listing():
        return sorted(os.listdir(tempfile.gettempdir()))

    stager = Stager.options(scheduling_strategy=on(0)).remote()
    staged, names = ray.get(stager.stage.remote())
    copy = node_files.copy_to(on(1), names, stager.read.remote)
    out = {"staged": staged, "names": names, "copy": copy,
           "source": ray.get(digests.options(scheduling_strategy=on(0)).remote(staged)),
           "copied": ray.get(digests.options(scheduling_strategy=on(1)).remote(copy))}
    out["removed"] = node_files.remove(on(1), copy)
    out["removed_again"] = node_files.remove(on(1), copy)
    try:  # a read that fails half-way: the partial copy must not stay behind
        node_files.copy_to(on(1), ["config.json", "missing.bin"], stager.read.remote)
        out["failed"] = None
    except Exception as e:
        out["failed"] = type(e).__name__
    out["engine_node_after"] = ray.get(listing.options(scheduling_strategy=on(1)).remote())
    # where a copy would land: the validator copies only to another node than the staging one
    out["nodes"] = [node_files.node_of(on(0)), node_files.node_of(on(1)), node_files.node_of(on(0))]
    out["stager_node"] = ray.get(stager.node.remote())
    print(json.dumps(out))
finally:
    ray.shutdown()
    cluster.shutdown()
"""


def test_copy_lands_on_the_target_node_and_is_removed(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path)], capture_output=True, text=True,
                          timeout=300, check=False)
    assert proc.returncode == 0, (proc.stdout[-2000:], proc.stderr[-4000:])
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert Path(out["staged"]).parent == tmp_path / "trainer-node"
    assert Path(out["copy"]).parent == tmp_path / "engine-node"  # the engine node's own temporary directory
    assert Path(out["copy"]).name.startswith("rlhf-validate-")
    assert out["names"] == ["config.json", "sub/w.bin"]
    assert out["copied"] == out["source"] and len(out["copied"]) == 2  # byte for byte
    assert out["removed"] is True and out["removed_again"] is False
    assert out["failed"] is not None
    assert out["engine_node_after"] == []  # neither the finished copy nor the failed one is left
    trainer_node, engine_node, again = out["nodes"]
    assert trainer_node == again == out["stager_node"] != engine_node, out
