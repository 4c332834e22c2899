"""The local cluster's harness (``hack/localcluster.py``): ``free_port`` gives the servers the tiers start ports never
from the kernel's ephemeral range (where a port closed by the picker can become some outgoing connection's local
port, or a ``bind(0)`` server's, before the server binds it), and ``_wait`` on a process that exited fails at once
with the end of its log instead of at its deadline."""

from __future__ import annotations

import itertools
import socket
import time
from pathlib import Path

import pytest

from tests.helpers import free_port

EPHEMERAL = Path("/proc/sys/net/ipv4/ip_local_port_range")


def test_ports_are_distinct_bindable_and_outside_the_ephemeral_range() -> None:
    import localcluster

    low, high = (int(x) for x in EPHEMERAL.read_text().split())
    ports = [free_port() for _ in range(200)]
    assert len(set(ports)) == len(ports)
    assert all(localcluster.PORT_RANGE[0] <= p < localcluster.PORT_RANGE[1] for p in ports)
    assert not any(low <= p <= high for p in ports), (low, high)
    for p in ports[:20]:  # free when handed out: a server can bind it
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))


def test_parallel_test_workers_pick_ports_from_disjoint_slices(monkeypatch: pytest.MonkeyPatch) -> None:
    import localcluster

    monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", "3")
    slices = []
    for worker in ("gw0", "gw1", "gw2"):
        monkeypatch.setenv("PYTEST_XDIST_WORKER", worker)
        low, high = localcluster.port_range()
        assert all(low <= localcluster.free_port() < high for _ in range(20))
        slices.append((low, high))
    assert slices[0][0] == localcluster.PORT_RANGE[0] and slices[-1][1] <= localcluster.PORT_RANGE[1]
    assert all(a[1] <= b[0] for a, b in itertools.pairwise(slices)), slices
    import realnodes

    assert localcluster.PORT_RANGE[1] <= realnodes.KUBELET_PORT_BASE  # a kubelet's port is never handed out


def test_a_port_in_use_is_never_handed_out() -> None:
    import localcluster

    held = []
    try:  # hold every port of a small range: the picker must skip them all and say so
        for port in range(localcluster.PORT_RANGE[0], localcluster.PORT_RANGE[0] + 50):
            s = socket.socket()
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                s.close()
                continue
            held.append(s)
        saved = localcluster.PORT_RANGE
        localcluster.PORT_RANGE = (saved[0], saved[0] + 50)
        try:
            try:
                localcluster.free_port()
            except RuntimeError as e:
                assert "no free TCP port" in str(e)
            else:
                raise AssertionError("a port of a fully held range was handed out")
        finally:
            localcluster.PORT_RANGE = saved
    finally:
        for s in held:
            s.close()


def test_a_wait_on_a_process_that_exited_fails_at_once_with_its_log(tmp_path: Path) -> None:
    import localcluster

    c = localcluster.Cluster(tmp_path, tmp_path)
    c._start("server", ["sh", "-c", "echo 'bind: address already in use'; exit 3"])
    t = time.monotonic()
    with pytest.raises(RuntimeError, match="server exited with 3 before the server was ready") as e:
        c._wait("the server", lambda: False, timeout=60, process="server")
    assert "address already in use" in str(e.value)
    assert time.monotonic() - t < 30  # not the deadline
    c._start("alive", ["sleep", "30"])
    try:
        with pytest.raises(TimeoutError, match="not ready after 1"):  # a live process: the deadline, as before
            c._wait("alive", lambda: False, timeout=1, process="alive")
    finally:
        c.procs["alive"].kill()
        c.procs["alive"].wait()
