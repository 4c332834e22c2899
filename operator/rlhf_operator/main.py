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
    p.add_argument("--verbose", action="store_true")
    return p.parse_args(argv)


def own_identity() -> str:
    """This replica's peering identity, ``<pod or host name>/<pid>``. Kopf's own default asks the passwd
    database for the user name, which fails in images run as a UID without a passwd entry (the chart runs
    as 65532; OpenShift assigns arbitrary UIDs): ``KeyError: 'getpwuid(): uid not found: 65532'``."""
    return f"{socket.gethostname()}/{os.getpid()}"


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO, format="%(asctime)s %(name)s %(message)s")
    if not args.verbose:  # Kopf logs every timer run at INFO; keep the operator log about our own decisions
        logging.getLogger("kopf.objects").setLevel(logging.WARNING)
    import rlhf_operator.handlers  # noqa: F401  (registers the handlers)

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
