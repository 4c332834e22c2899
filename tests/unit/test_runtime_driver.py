"""The driver on a simulated multi-pod Ray cluster: where addresses come from and where files land.

A fake ``ray`` module runs every task and actor in-process but "on a node": each placement-group bundle is its
own node (the worst case of a KubeRay cluster: every bundle in another pod) with its own IP and its own
temporary directory (``tempfile.tempdir`` is switched while code runs there), and the driver runs on the head
node. So an address taken on the wrong node, or a file written on one node and read on another, shows up as a
wrong IP or a missing file, as it would across pods. Trainer and engine actors are small fakes with the
methods the driver calls.
"""

from __future__ import annotations

import contextlib
import sys
import tempfile
import types
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import pytest

from rlhf_api.models import RuntimeConfig
from rlhf_runtime.algo.data import Sample
from rlhf_runtime.controller.actors import Placement
from rlhf_runtime.controller.deadlines import Watchdog
from rlhf_runtime.controller.loop import Runtime
from rlhf_runtime.infra import node_files

HEAD_IP = "10.0.0.1"


@dataclass(frozen=True)
class Strategy:
    group: int
    bundle: int


class Cluster:
    """Nodes by name: IP and temporary directory. ``current`` is the node code is running on."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.nodes: dict[str, tuple[str, Path]] = {}
        self.current = "head"
        self.add("head")
        self.calls: list[tuple[str, str]] = []  # (function or method, node)

    def add(self, name: str) -> tuple[str, Path]:
        if name not in self.nodes:
            tmp = self.root / name
            tmp.mkdir()
            self.nodes[name] = (HEAD_IP if name == "head" else f"10.0.{len(self.nodes)}.1", tmp)
        return self.nodes[name]

    one_pod = False  # every bundle on one node (a single pod holding trainer and engines)

    def node_of(self, strategy: Strategy | None) -> str:
        if strategy is None:
            return "head"
        name = "pod" if self.one_pod else f"bundle-{strategy.group}-{strategy.bundle}"
        self.add(name)
        return name

    @contextlib.contextmanager
    def on(self, node: str) -> Iterator[None]:
        before, saved = self.current, tempfile.tempdir
        self.current, tempfile.tempdir = node, str(self.nodes[node][1])
        try:
            yield
        finally:
            self.current, tempfile.tempdir = before, saved

    def ip(self) -> str:
        return self.nodes[self.current][0]


class Ref:
    def __init__(self, value: Any) -> None:
        self.value = value


class Actor:
    def __init__(self, cluster: Cluster, node: str, instance: Any) -> None:
        self._cluster, self._node, self._instance = cluster, node, instance
        self.killed = False

    def __getattr__(self, name: str) -> Any:
        method = getattr(self._instance, name)
        cluster, node = self._cluster, self._node

        def remote(*args: Any) -> Ref:
            assert not self.killed
            args = tuple(a.value if isinstance(a, Ref) else a for a in args)
            cluster.calls.append((name, node))
            with cluster.on(node):
                return Ref(method(*args))

        return types.SimpleNamespace(remote=remote)


class Remote:
    def __init__(self, cluster: Cluster, target: Any, options: dict[str, Any] | None = None) -> None:
        self.cluster, self.target, self.opts = cluster, target, options or {}

    def options(self, **kw: Any) -> Remote:
        return Remote(self.cluster, self.target, {**self.opts, **kw})

    def remote(self, *args: Any) -> Any:
        node = self.cluster.node_of(self.opts.get("scheduling_strategy"))
        args = tuple(a.value if isinstance(a, Ref) else a for a in args)
        with self.cluster.on(node):
            if isinstance(self.target, type):
                self.cluster.calls.append((self.target.__name__, node))
                return Actor(self.cluster, node, self.target(*args))
            self.cluster.calls.append((self.target.__name__, node))
            return Ref(self.target(*args))


def fake_ray(cluster: Cluster) -> types.ModuleType:
    ray = types.ModuleType("ray")
    ray.remote = lambda target: Remote(cluster, target)  # type: ignore[attr-defined]
    ray.get = lambda refs, timeout=None: [r.value for r in refs] if isinstance(refs, list) else refs.value  # type: ignore[attr-defined]
    ray.wait = lambda refs, num_returns=1, timeout=None: (list(refs), [])  # type: ignore[attr-defined] # all ran

    def kill(actor: Actor) -> None:
        actor.killed = True

    ray.kill = kill  # type: ignore[attr-defined]
    ray.get_runtime_context = lambda: types.SimpleNamespace(get_node_id=lambda: cluster.current)  # type: ignore[attr-defined]
    util = types.ModuleType("ray.util")
    util.get_node_ip_address = cluster.ip  # type: ignore[attr-defined]
    ray.util = util  # type: ignore[attr-defined]
    return ray


# ------------------------------------------------------------------------------------- fake actors
class FakeTrainer:
    """Records its rendezvous arguments; stages "weights" (files) on its own node like ``Trainer``."""

    def __init__(self, options: Any) -> None:  # roles.options.TrainerOptions
        r = options.rank
        self.rank, self.world, self.addr, self.port = r.rank, r.world_size, r.addr, r.port
        self.staged: str | None = None

    def info(self) -> dict[str, Any]:
        return {"step": 0, "resumed_from": None, "rank": self.rank, "addr": self.addr, "port": self.port}

    def load_weight_transfer(self) -> float:
        return 0.0

    def stage_weights(self) -> tuple[str, list[str]] | None:
        if self.rank != 0:
            return None
        self.staged = tempfile.mkdtemp(prefix="rlhf-stage-")
        (Path(self.staged) / "config.json").write_text('{"step": 1}')
        (Path(self.staged) / "model.safetensors").write_bytes(b"\x00weights" * 100)
        return self.staged, node_files.list_files(self.staged)

    def read_staged(self, name: str) -> bytes:
        assert self.staged
        return (Path(self.staged) / name).read_bytes()

    def drop_staged(self) -> None:
        import shutil

        if self.staged:
            shutil.rmtree(self.staged)
            self.staged = None


class FakeEngine:
    """A fresh engine loads ``kw["model"]`` on its own node; ``fail`` makes a fresh engine's generate raise."""

    fail = False
    loaded: ClassVar[list[tuple[str, str]]] = []  # (model path, node temp dir)

    def __init__(self, options: Any) -> None:  # rollout.options.EngineOptions
        path = Path(options.kwargs["model"])
        assert (path / "config.json").is_file(), f"{path} is not on this node"
        assert (path / "model.safetensors").read_bytes() == b"\x00weights" * 100
        FakeEngine.loaded.append((str(path), tempfile.gettempdir()))
        self.fresh = True

    def generate(self, prompts: list[list[int]], sampling: dict[str, Any]) -> list[dict[str, Any]]:
        if FakeEngine.fail and getattr(self, "fresh", False):
            raise RuntimeError("engine died")
        return [{"samples": [[1, 2, 3]]} for _ in prompts]

    def device_info(self) -> dict[str, Any]:
        return {"cuda_visible_devices": "0", "free": 80, "total": 80}


class Reporter:
    def __init__(self) -> None:
        self.progress: list[dict[str, Any]] = []
        self.observed_generation: int | None = None

    def live_job(self) -> None:
        return None

    def write_progress(self, record: dict[str, Any]) -> None:
        self.progress.append(record)


class Tokenizer:
    bos_token_id, eos_token_id = 2, 3

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [ord(c) % 50 for c in text]


@pytest.fixture
def cluster(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Cluster:
    c = Cluster(tmp_path)
    ray = fake_ray(c)
    monkeypatch.setitem(sys.modules, "ray", ray)
    monkeypatch.setitem(sys.modules, "ray.util", ray.util)
    monkeypatch.setitem(sys.modules, "rlhf_runtime.roles.policy", types.SimpleNamespace(Trainer=FakeTrainer))
    monkeypatch.setitem(sys.modules, "rlhf_runtime.rollout.engines", types.SimpleNamespace(Engine=FakeEngine))
    monkeypatch.setattr(Placement, "strategy", lambda self, where: Strategy(where.group, where.bundle))
    monkeypatch.setattr(tempfile, "tempdir", str(c.nodes["head"][1]))  # the driver runs on the head node
    monkeypatch.setattr(FakeEngine, "fail", False)
    monkeypatch.setattr(FakeEngine, "loaded", [])
    return c


def runtime(spec: dict[str, Any], validate: bool = False) -> Runtime:
    base: dict[str, Any] = {"model": {"name": "m"}, "image": "i", "data": {"prompts": ["p"] * 4},
                            "reward": {"rule": "contains", "target": "x"}}
    cfg = RuntimeConfig(name="j", namespace="ns", spec={**base, **spec})
    return Runtime(cfg, Reporter(), validate=validate)


# ------------------------------------------------------------------------------------------ tests
def test_fsdp2_ranks_meet_at_rank_0s_node_not_the_drivers(cluster: Cluster) -> None:
    rt = runtime({"trainer": {"replicas": 2, "gpusPerReplica": 2, "strategy": "fsdp2"}})
    rt.actors.start_trainers()
    infos = [t.info.remote().value for t in rt.actors.trainers]
    rank0_node = cluster.node_of(Strategy(rt.layout.trainers[0].group, rt.layout.trainers[0].bundle))
    rank0_ip = cluster.nodes[rank0_node][0]
    assert rank0_ip != HEAD_IP
    assert {(i["addr"], i["port"]) for i in infos} == {(rank0_ip, infos[0]["port"])}  # every rank dials rank 0
    assert 20000 <= infos[0]["port"] < 60000
    assert ("node_address", rank0_node) in cluster.calls  # the free port was found on rank 0's node


def test_a_single_trainer_needs_no_rendezvous(cluster: Cluster) -> None:
    rt = runtime({"trainer": {"replicas": 1, "gpusPerReplica": 1}})
    rt.actors.start_trainers()
    assert rt.actors.trainers[0].info.remote().value["addr"] is None
    assert not [c for c in cluster.calls if c[0] == "node_address"]


def _start_for_validation(rt: Runtime) -> None:
    """Trainers, and running engines (already synced: they load nothing) on their bundles' nodes."""
    import ray

    class Synced(FakeEngine):
        def __init__(self) -> None:
            pass

    rt.actors.start_trainers()
    for e in rt.layout.engines:
        rt.actors.engines.append(ray.remote(Synced).options(scheduling_strategy=Strategy(e.group, e.bundle)).remote())
        rt.actors.engine_kwargs.append({"model": "m", "gpu_memory_utilization": 0.5})


SAMPLES = [Sample(p) for p in ("ab", "cd", "ef", "gh")]


def _leftovers(cluster: Cluster) -> list[str]:
    return sorted(str(p.relative_to(cluster.root)) for _, tmp in cluster.nodes.values() for p in tmp.iterdir())


@pytest.mark.parametrize("layout", ["separate", "expert-parallel"])
def test_validation_weights_reach_each_fresh_engines_node_and_are_removed(cluster: Cluster, layout: str) -> None:
    spec = {"trainer": {"gpusPerReplica": 0}, "rollout": {"engines": 2}} if layout == "separate" else {
        "rollout": {"engines": 2, "expertParallel": True}}
    rt = runtime(spec, validate=True)
    _start_for_validation(rt)
    result = rt.validator.validate(Tokenizer(), SAMPLES)
    assert result["validated"]
    fresh = list(range(2)) if layout == "expert-parallel" else [0]
    want_nodes = [cluster.nodes[cluster.node_of(Strategy(rt.layout.engines[i].group, rt.layout.engines[i].bundle))][1]
                  for i in fresh]
    # each fresh engine loaded a copy in its own node's temporary directory (not the trainer's, not the head's)
    assert [Path(tmp) for _, tmp in FakeEngine.loaded] == want_nodes
    assert all(Path(path).parent == Path(tmp) and Path(path).name.startswith("rlhf-validate-")
               for path, tmp in FakeEngine.loaded)
    assert result["weights"] == [p for p, _ in FakeEngine.loaded]
    assert _leftovers(cluster) == []  # copies and the trainer's staging are gone


@pytest.mark.parametrize("fail", [False, True])
def test_validation_on_the_staging_node_reads_the_staged_weights_without_copies(cluster: Cluster, fail: bool) -> None:
    """Trainer and an expert-parallel group of two engines in one pod: both fresh engines load the directory trainer
    rank 0 staged (no copy), which is removed after the check, whether it passed or a fresh engine failed."""
    cluster.one_pod = True
    rt = runtime({"rollout": {"engines": 2, "expertParallel": True}}, validate=True)
    _start_for_validation(rt)
    FakeEngine.fail = fail
    if fail:
        with pytest.raises(RuntimeError, match="engine died"):
            rt.validator.validate(Tokenizer(), SAMPLES)
    else:
        assert rt.validator.validate(Tokenizer(), SAMPLES)["validated"]
    pod = cluster.nodes["pod"][1]
    assert len(FakeEngine.loaded) == 2 and len({p for p, _ in FakeEngine.loaded}) == 1, FakeEngine.loaded
    assert all(Path(p).parent == pod and Path(p).name.startswith("rlhf-stage-") and Path(tmp) == pod
               for p, tmp in FakeEngine.loaded), FakeEngine.loaded
    assert not [c for c in cluster.calls if c[0] in ("write_file", "read_staged")]  # nothing copied
    assert _leftovers(cluster) == []  # the staging is gone too


def test_validation_removes_every_copy_when_the_fresh_engine_fails(cluster: Cluster) -> None:
    rt = runtime({"rollout": {"engines": 2, "expertParallel": True}}, validate=True)
    _start_for_validation(rt)
    FakeEngine.fail = True
    with pytest.raises(RuntimeError, match="engine died"):
        rt.validator.validate(Tokenizer(), SAMPLES)
    assert len(FakeEngine.loaded) == 2
    assert _leftovers(cluster) == []


def test_validation_is_on_with_the_spec_field_or_the_flag(cluster: Cluster) -> None:
    assert not runtime({}).validate_first_sync
    assert runtime({}, validate=True).validate_first_sync
    assert runtime({"weightSync": {"validate": True}}).validate_first_sync


def test_actors_get_spec_env_over_the_runtime_defaults_and_no_forced_offline_hub(cluster: Cluster) -> None:
    rt = runtime({"trainer": {"gpusPerReplica": 0},
                  "env": [{"name": "TOKENIZERS_PARALLELISM", "value": "true"}, {"name": "X", "value": "1"}]})
    env = rt.actors.env
    assert env["TOKENIZERS_PARALLELISM"] == "true" and env["X"] == "1"
    assert "HF_HUB_OFFLINE" not in env and "TRANSFORMERS_OFFLINE" not in env
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "1"  # CPU job defaults still there


# ------------------------------------------------------------------------------ watchdog, recovery bound
def test_watchdog_fires_once_when_no_progress_within_the_live_deadline() -> None:
    from tests.helpers import wait_for

    deadline = [600.0]
    fired: list[str] = []
    w = Watchdog(lambda: deadline[0], fired.append, poll_seconds=0.01)
    w.start()
    try:
        w.doing("train step 3: trainer rank 0")
        w.progress()
        assert w.remaining() > 590 and not fired
        deadline[0] = 0.2  # a live edit of spec.progressDeadlineSeconds
        wait_for(lambda: fired, timeout=10, what="the watchdog", interval=0.01)
    finally:
        w.stop()
    assert fired == [("no training step completed within spec.progressDeadlineSeconds (0.2 s); "
                     "stuck in: train step 3: trainer rank 0")]
    assert w.fired == fired[0]


def test_watchdog_stays_quiet_while_steps_complete() -> None:
    from tests.helpers import wait_for

    fired: list[str] = []
    w = Watchdog(lambda: 0.5, fired.append, poll_seconds=0.01)
    w.start()
    beats = []
    try:
        def beat() -> bool:
            w.progress()
            beats.append(1)
            return len(beats) >= 40

        wait_for(beat, timeout=30, what="40 progress beats", interval=0.05)  # 2 s of steps every 0.05 s
    finally:
        w.stop()
    assert not fired


def test_in_run_recoveries_are_bounded(cluster: Cluster) -> None:
    rt = runtime({"checkpoint": {"volume": "v", "path": "/ckpt"},
                  "volumes": [{"name": "v", "emptyDir": {}}]})
    rt.recovery.count = rt.spec.in_run_recoveries  # default 3
    with pytest.raises(RuntimeError, match=r"engine 1 died during rollout of step 4: in-run recovery limit \(3\) "
                                           r"reached, failing the run \(spec.backoffLimit"):
        rt.recovery.recover([1], False, "rollout of step 4", RuntimeError("actor died"), 3)


def test_a_dead_trainer_without_checkpoints_fails_the_run(cluster: Cluster) -> None:
    rt = runtime({})
    rt.actors.trainers.actors = [object()]
    with pytest.raises(RuntimeError, match="trainer rank 0 died during train step 2 and spec.checkpoint is not set"):
        rt.recovery.recover([], True, "train step 2", RuntimeError("actor died"), 1)


def test_in_run_recoveries_0_turns_in_run_recovery_off(cluster: Cluster) -> None:
    rt = runtime({"inRunRecoveries": 0})  # every fault goes to backoffLimit
    with pytest.raises(RuntimeError, match=r"engine 0 died during weight sync: in-run recovery limit \(0\) reached"):
        rt.recovery.recover([0], False, "weight sync", RuntimeError("actor died"), 0)


def test_cpu_actor_env_sets_threads_unless_the_job_does() -> None:
    cpu = {"trainer": {"gpusPerReplica": 0, "resources": {"cpu": "6"}},
           "rollout": {"resources": {"cpu": "3"}}}
    rt = runtime(cpu)
    assert rt.actors.actor_env(rt.layout.trainers[0])["OMP_NUM_THREADS"] == "6"
    assert rt.actors.actor_env(rt.layout.engines[0], {"X": "1"})["OMP_NUM_THREADS"] == "3"
    rt.actors.thread_cap = 2  # a local run on a machine of 2 CPUs for one busy actor at a time
    assert rt.actors.actor_env(rt.layout.trainers[0])["OMP_NUM_THREADS"] == "2"
    own = runtime({**cpu, "env": [{"name": "OMP_NUM_THREADS", "value": "5"}]})
    assert own.actors.actor_env(own.layout.trainers[0])["OMP_NUM_THREADS"] == "5"  # spec.env wins
    gpu = runtime({"trainer": {"gpusPerReplica": 1}})
    assert "OMP_NUM_THREADS" not in gpu.actors.actor_env(gpu.layout.engines[0])


def test_a_local_run_starts_a_ray_of_its_own_even_where_one_runs(cluster: Cluster,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """``--local``: a new Ray with the job's resources, never one that already runs on the machine (a plain
    ``ray.init()`` joins the cluster ``ray start`` recorded under /tmp/ray, or a dead one's stale address, and
    then refuses ``num_cpus``: "When connecting to an existing cluster, num_cpus and num_gpus must not be
    provided")."""
    calls: list[dict[str, Any]] = []
    monkeypatch.setattr(sys.modules["ray"], "init", lambda **kw: calls.append(kw), raising=False)
    cfg = RuntimeConfig(name="j", namespace="ns", spec={"model": {"name": "m"}, "image": "i",
                                                        "data": {"prompts": ["p"]}, "reward": {"rule": "contains"}})
    rt = Runtime(cfg, Reporter(), local=True)
    rt.connect()
    assert [c["address"] for c in calls] == ["local"]
    assert calls[0]["resources"] == {k: v for k, v in rt.layout.totals().items() if k.startswith("rlhf_")}


def test_a_run_given_an_address_joins_that_ray_and_stays_a_local_run(cluster: Cluster,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """``--address``: the Ray running at that address on this machine, joined without a Ray start of its own, and
    still a local run (every actor here: the thread cap of a local run applies)."""
    calls: list[dict[str, Any]] = []
    monkeypatch.setattr(sys.modules["ray"], "init", lambda **kw: calls.append(kw), raising=False)
    cfg = RuntimeConfig(name="j", namespace="ns", spec={"model": {"name": "m"}, "image": "i",
                                                        "data": {"prompts": ["p"]}, "reward": {"rule": "contains"}})
    rt = Runtime(cfg, Reporter(), address="127.0.0.1:6379")
    rt.connect()
    assert [c["address"] for c in calls] == ["127.0.0.1:6379"]
    assert "num_cpus" not in calls[0] and "resources" not in calls[0]
    assert rt.local and rt.actors.thread_cap is not None
    assert Runtime(cfg, Reporter()).actors.thread_cap is None


def test_rendezvous_ports_come_from_below_the_kernels_ephemeral_range() -> None:
    """Rank 0's port is checked free, then listened on seconds later (after its imports): drawn from below the
    ephemeral range, no outgoing connection on the node can take it meanwhile."""
    from rlhf_runtime.controller.actors import node_address, port_range

    assert port_range(1, (32768, 60999)) == (20000, 32767)
    assert port_range(3, (32768, 60999)) == (20000, 32765)  # the run of consecutive ports stays below it too
    assert port_range(1, (20500, 60999)) == (20000, 59999)  # too little room below: the whole span
    assert port_range(1, None) == (20000, 59999)
    lo, hi = (int(x) for x in Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    first, last = port_range(2, (lo, hi))
    _, base = node_address(2)
    assert first <= base <= last and not lo <= base + 1 <= hi
