"""How the tiers share a run of ``make test`` (pytest-xdist workers, ``-n 2``).

The tiers wait on different things: the integration tier on an apiserver and controllers, the pods tier on
kubelets and containers, the runtime tier on Ray and vLLM, the unit tier on nothing. ``make test`` runs them side by
side in worker processes. A tier that owns a cluster runs whole in one worker, in its file order, so that its
package-scoped cluster is made once: the integration tier (a control plane with KWOK nodes) and the pods tier (real
nodes: one such cluster per machine). Every other test goes to whichever worker is free. Ports: each worker hands out
its own slice of ``localcluster.PORT_RANGE``.
"""

from __future__ import annotations

from typing import Any

import pytest

#: Tier folders whose tests run in one worker, one after the other.
ONE_WORKER = ("integration", "pods")


def tier_scope(nodeid: str) -> str:
    """The unit of work a worker takes: a whole tier of ``ONE_WORKER``, else the test alone."""
    parts = nodeid.split("/", 2)
    return f"tier:{parts[1]}" if len(parts) == 3 and parts[0] == "tests" and parts[1] in ONE_WORKER else nodeid


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's hook: without the plugin (``-p no:xdist``) it is never called
def pytest_xdist_make_scheduler(config: Any, log: Any) -> Any:
    """pytest-xdist's load-by-scope scheduling with ``tier_scope`` as the scope: the largest units first (the
    integration tier, then the pods tier), then single tests to whichever worker is free."""
    from xdist.scheduler import LoadScopeScheduling

    class TierScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return tier_scope(nodeid)

    return TierScheduling(config, log)
