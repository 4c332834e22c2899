"""The whole suite runs in parallel, one pytest-xdist worker per tier that waits on clusters or processes.

``make test`` runs ``pytest -n 3 --dist loadgroup``: every test of ``tests/integration`` (one control plane per
session), ``tests/pods`` (one real-node cluster per machine) and ``tests/runtime`` (CPU-bound Ray + vLLM runs)
is put in that tier's group, so each tier runs in order in one worker, with its session fixtures made once,
while the others run beside it: most of the integration and pod tiers' time is waiting on apiservers, kubelets
and containers, not computing. Unit and chart tests are spread over whichever worker is free. Without ``-n``
(a plain ``pytest``) the groups change nothing.
"""

from __future__ import annotations

from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
#: Tiers whose tests share one worker (a session cluster, or heavy CPU runs that must not overlap each other).
GROUPED_TIERS = ("integration", "pods", "runtime")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        try:
            tier = Path(str(item.path)).resolve().relative_to(TESTS).parts[0]
        except ValueError:
            continue
        if tier in GROUPED_TIERS:
            item.add_marker(pytest.mark.xdist_group(tier))
