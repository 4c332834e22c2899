"""``make test``'s workers (``tests/conftest.py``): a tier that owns a cluster is one unit of work, so one worker
runs it whole and makes its cluster once; every other test is a unit of its own."""

from __future__ import annotations

from tests.conftest import tier_scope


def test_cluster_tiers_are_one_unit_and_other_tests_their_own() -> None:
    assert tier_scope("tests/pods/test_faults.py::test_a") == tier_scope("tests/pods/test_chain.py::test_b")
    assert tier_scope("tests/integration/test_kueue.py::test_a[x]") == "tier:integration"
    assert tier_scope("tests/pods/test_sandbox.py::test_a") == "tier:pods"
    for nodeid in ("tests/runtime/test_agent.py::test_a", "tests/unit/test_crd.py::test_b",
                   "tests/chart/test_helm.py::test_c"):
        assert tier_scope(nodeid) == nodeid
