"""``rlhf-operator``: run the operator.

Namespace-scoped (``--namespace a --namespace b``) or cluster-wide (``--all-namespaces``, the default).
``--peering NAME`` lets several replicas share the work safely (one active, Kopf peering objects from
``crds/kopf-peering.yaml``); ``--standalone`` (the default) runs without peering. ``--liveness`` serves
Kopf's health endpoint (the KubeRay probe included) for the Deployment's liveness probe.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import random
import socket
import warnings
from typing import Any

import kopf


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="rlhf-operator", description=__doc__.splitlines()[0])
    scope = p.add_mutually_exclusive_group()
    scope.add_argument("-n", "--namespace", action="append", help="watch this namespace (repeatable)")
    scope.add_argument("-A", "--all-namespaces", action="store_true", help="watch all namespaces (default)")
    p.add_argument("--peering", help="Kopf peering name (several replicas); default: standalone")
    p.add_argument(
        "--priority", type=int, help="peering priority; default: random, so identical replicas never tie (a tie pauses all)"
    )
    p.add_argument("--liveness", default="http://0.0.0.0:8080/healthz", help="liveness endpoint URL, '' to disable")
    p.add_argument("--metrics-port", type=int, default=0, help="serve Prometheus metrics on this port (0: off)")
    p.add_argument("--workers", type=int, default=16, help="jobs reconciled at the same time (default 16)")
    p.add_argument("--verbose", action="store_true")
    return p.parse_args(argv)


def own_identity() -> str:
    """This replica's peering identity, ``<pod or host name>/<pid>``. Kopf's own default asks the passwd
    database for the user name, which fails in images run as a UID without a passwd entry (the chart runs
    as 65532; OpenShift assigns arbitrary UIDs): ``KeyError: 'getpwuid(): uid not found: 65532'``."""
    return f"{socket.gethostname()}/{os.getpid()}"


def follow_kopf_pauses() -> None:
    """With peering, our work queue must stop while Kopf is paused for a peer of higher priority (Kopf then stops
    its watches; our time-based re-checks would act on a frozen cache). Kopf keeps that switch (a ToggleSet, on
    while paused) private and hands it to its orchestrator: wrap the orchestrator to take it. If Kopf's internals
    change, ``handlers.PAUSED`` stays None and the queue holds every key (safe, and the peering tests fail)."""
    from kopf._core.reactor import orchestration

    from rlhf_operator import handlers

    original = orchestration.orchestrator

    async def orchestrator(*args: Any, operator_paused: Any, **kwargs: Any) -> None:
        handlers.PAUSED = operator_paused
        await original(*args, operator_paused=operator_paused, **kwargs)

    handlers.PEERING = True
    orchestration.orchestrator = orchestrator


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO, format="%(asctime)s %(name)s %(message)s")
    if not args.verbose:  # Kopf logs every timer run at INFO; keep the operator log about our own decisions
        logging.getLogger("kopf.objects").setLevel(logging.WARNING)
    # A kubeconfig that skips TLS verification (local clusters): say so once, not on every request (the client's
    # per-call warning machinery re-arms urllib3's default filter, which then prints and formats it each time).
    warnings.filterwarnings("once", message="Unverified HTTPS request")
    import rlhf_operator.handlers  # registers the handlers

    rlhf_operator.handlers.WORKERS = max(1, args.workers)

    if args.peering:
        follow_kopf_pauses()

    if args.metrics_port:
        from rlhf_operator import metrics

        metrics.serve(args.metrics_port)

    asyncio.run(
        kopf.operator(
            standalone=not args.peering,
            peering_name=args.peering,
            priority=args.priority if args.priority is not None else random.randint(1, 1_000_000),
            clusterwide=not args.namespace,
            namespaces=args.namespace or (),
            liveness_endpoint=args.liveness or None,
            identity=own_identity(),
        )
    )


if __name__ == "__main__":
    main()
