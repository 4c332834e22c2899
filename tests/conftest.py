"""How the tiers share a run of ``make test`` (pytest-xdist workers, ``-n 2``).

The tiers wait on different things: the integration tier on an apiserver and controllers, the pods tier on
kubelets and containers, the runtime tier on Ray and vLLM, the unit tier on nothing. ``make test`` runs them side by
side in worker processes. A tier that owns a cluster runs whole in one worker, in its file order, so that its
package-scoped cluster is made once: the integration tier (a control plane with KWOK nodes) and the pods tier (real
nodes: one such cluster per machine); so does a module whose tests share a costly module fixture (``WHOLE_MODULES``).
Every other test goes to whichever worker is free. Ports: each worker hands out its own slice of
``localcluster.PORT_RANGE``.
"""

from __future__ import annotations

from typing import Any

import pytest

#: Tier folders whose tests run in one worker, one after the other.
ONE_WORKER = ("integration", "pods")
#: Modules whose tests share a module-scoped fixture that costs more than they do (the trainings they check, a
#: model they build): one unit, so that only one worker makes it.
WHOLE_MODULES = ("tests/runtime/test_trainer_precision.py", "tests/runtime/test_fsdp_lean_gathers.py")


def tier_scope(nodeid: str) -> str:
    """The unit of work a worker takes: a whole tier of ``ONE_WORKER``, a whole module of ``WHOLE_MODULES``, else
    the test alone."""
    parts = nodeid.split("/", 2)
    if len(parts) == 3 and parts[0] == "tests" and parts[1] in ONE_WORKER:
        return f"tier:{parts[1]}"
    module = nodeid.split("::", 1)[0]
    return f"module:{module}" if module in WHOLE_MODULES else nodeid


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's hook: without the plugin (``-p no:xdist``) it is never called
def pytest_xdist_make_scheduler(config: Any, log: Any) -> Any:
    """pytest-xdist's load-by-scope scheduling with ``tier_scope`` as the scope: the largest units first (the
    integration tier, then the pods tier), then single tests to whichever worker is free."""
    from xdist.scheduler import LoadScopeScheduling

    class TierScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return tier_scope(nodeid)

    return TierScheduling(config, log)
