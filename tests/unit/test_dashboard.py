"""The chart's Grafana dashboard (``charts/rlhf-operator/files/grafana-dashboard.json``): it parses, and every
metric its queries read is one the runtime's or the operator's /metrics really exports (scraped from their own
registries after a step is reported), with the labels the queries filter on."""

from __future__ import annotations

import json
import re
from pathlib import Path

from prometheus_client import REGISTRY, generate_latest

REPO = Path(__file__).resolve().parents[2]
DASHBOARD = REPO / "charts" / "rlhf-operator" / "files" / "grafana-dashboard.json"
METRIC = re.compile(r"\brlhf_[a-z0-9_]+")


def exported() -> dict[str, set[str]]:
    """Metric name -> label names, as the runtime's and the operator's /metrics expose them."""
    from rlhf_operator import metrics as operator_metrics
    from rlhf_runtime.infra.report import METRICS, TRAIN_METRICS, Metrics

    runtime = Metrics("job1", "ns1")
    runtime.update(3, {k: 1.0 for k in METRICS}, {k: 0.5 for k in TRAIN_METRICS})
    operator_metrics.PHASE.labels(namespace="ns1", job="job1", phase="Running").set(1)
    text = generate_latest(runtime.registry).decode() + generate_latest(REGISTRY).decode()
    out: dict[str, set[str]] = {}
    for line in text.splitlines():
        m = re.match(r"^(rlhf_[a-z0-9_]+)\{([^}]*)\}", line)
        if m:
            out.setdefault(m.group(1), set()).update(re.findall(r"(\w+)=", m.group(2)))
    return out


def queries(node: object) -> list[str]:
    if isinstance(node, dict):
        return [v for k, v in node.items() if k in ("expr", "query") and isinstance(v, str)] + [
            q for k, v in node.items() for q in queries(v)]
    if isinstance(node, list):
        return [q for v in node for q in queries(v)]
    return []


def test_every_metric_the_dashboard_queries_is_exported_with_its_labels() -> None:
    board = json.loads(DASHBOARD.read_text())
    have = exported()
    exprs = queries(board["panels"]) + queries(board["templating"])
    used = {name for e in exprs for name in METRIC.findall(e)}
    assert len(used) >= 20, used  # every runtime gauge and the operator's phase
    missing = used - have.keys()
    assert not missing, f"the dashboard queries metrics nobody exports: {sorted(missing)}"
    for name in used:
        assert {"job", "namespace"} <= have[name], (name, have[name])


def test_every_runtime_gauge_is_on_the_dashboard_and_in_the_docs() -> None:
    from rlhf_runtime.infra.report import METRICS, TRAIN_METRICS

    text = DASHBOARD.read_text()
    docs = (REPO / "docs" / "operating.md").read_text()
    names = ["rlhf_step"] + [f"rlhf_{k}" for k in METRICS] + [f"rlhf_train_{k}" for k in TRAIN_METRICS]
    assert [n for n in names if not re.search(rf"\b{n}\b", text)] == []
    assert [n for n in names if f"`{n}`" not in docs] == []
