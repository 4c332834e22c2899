"""``make test``'s workers (``tests/conftest.py``): a tier that owns a cluster is one unit of work, so one worker
runs it whole and makes its cluster once; so is a module whose tests share a costly module fixture; every other
test is a unit of its own."""

from __future__ import annotations

from tests.conftest import tier_scope


def test_cluster_tiers_are_one_unit_and_other_tests_their_own() -> None:
    assert tier_scope("tests/pods/test_faults.py::test_a") == tier_scope("tests/pods/test_chain.py::test_b")
    assert tier_scope("tests/integration/test_kueue.py::test_a[x]") == "tier:integration"
    assert tier_scope("tests/pods/test_sandbox.py::test_a") == "tier:pods"
    for nodeid in ("tests/runtime/test_agent.py::test_a", "tests/unit/test_crd.py::test_b",
                   "tests/chart/test_helm.py::test_c"):
        assert tier_scope(nodeid) == nodeid


def test_a_module_with_a_costly_fixture_is_one_unit_and_exists() -> None:
    from pathlib import Path

    from tests.conftest import WHOLE_MODULES

    root = Path(__file__).resolve().parents[2]
    for module in WHOLE_MODULES:
        assert (root / module).is_file(), module
        assert tier_scope(f"{module}::test_a") == tier_scope(f"{module}::test_b[x]") == f"module:{module}"
    assert tier_scope("tests/runtime/test_driver.py::test_a") != tier_scope("tests/runtime/test_driver.py::test_b")
