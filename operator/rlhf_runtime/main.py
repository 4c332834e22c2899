"""The runtime's command line: runs one RLHFJob from its ``RuntimeConfig`` (``controller.loop.Runtime``).

Invocation::

    python -m rlhf_runtime.driver --config /etc/rlhf/job.json      # or RLHF_JOB_CONFIG; console: rlhf-runtime
        [--local] [--num-cpus N]           # own local Ray instead of ray.init(address="auto")
        [--address HOST:PORT]              # or join the Ray running on this machine there (ray start --head)
        [--kubeconfig PATH | --no-report]  # status reports (default: in-cluster config)
        [--validate]                       # validate the first weight sync (also spec.weightSync.validate)
        [--progress-file PATH] [--metrics-port PORT]   # or RLHF_PROGRESS_FILE / RLHF_METRICS_PORT (operator wiring)

(``rlhf_runtime.driver`` is this module under the name the operator renders.) Without ``--local`` the driver
joins the Ray cluster it runs in; if none is reachable it starts a local one.

Code outside the package (benchmarks, tests) runs the same driver with actor classes of its own:
``main(argv, classes=ActorClasses(trainer=..., engine=...))`` (``controller.actors.ActorClasses``).

No silent hang: every driver -> actor call has a deadline (``controller.deadlines``); a watchdog thread fails
the run when no progress (the start, a trainer resume, each completed step) happened within
``spec.progressDeadlineSeconds``: "no training step completed within spec.progressDeadlineSeconds (N s); stuck
in: <activity>", reported as runtime state Failed, exit status 1 (the main thread's bounded waits see it within
a second, and the main thread is interrupted; the process exits by itself if it does not stop within
``WATCHDOG_GRACE_SECONDS``). A job.json that does not parse (JSON,
another apiVersion, invalid values) is reported as Failed with the parse error into the job its raw JSON names.
SIGTERM fails the run with a report. SIGUSR1 writes every thread's stack to stderr and the run goes on. Ray's
shutdown at the end is bounded (``SHUTDOWN_SECONDS``).

Exit status: 0 succeeded, 1 failed, 3 validation failed.
"""

from __future__ import annotations

import _thread
import argparse
import atexit
import faulthandler
import logging
import os
import signal
import sys
import threading
import traceback
from dataclasses import dataclass
from typing import Any

from rlhf_api.memory_plan import explain_oom
from rlhf_runtime.controller.actors import ActorClasses
from rlhf_runtime.controller.deadlines import Watchdog
from rlhf_runtime.controller.loop import Runtime
from rlhf_runtime.controller.validation import ValidationError
from rlhf_runtime.infra import config as rc
from rlhf_runtime.infra.report import ForeignJobError, Metrics, Reporter, StatusClient
from rlhf_runtime.infra.tracking import Tracker

log = logging.getLogger("rlhf_runtime")
EXIT_FAILED, EXIT_VALIDATION = 1, 3
#: After the progress watchdog fired: time the main thread gets to report and clean up before the process exits.
WATCHDOG_GRACE_SECONDS = 60.0
#: Longest Ray shutdown at the end of a run (an actor stopped mid-collective can keep it waiting).
SHUTDOWN_SECONDS = 30.0


@dataclass
class Options:
    config: str | None = None
    local: bool = False
    num_cpus: int | None = None
    address: str | None = None
    kubeconfig: str | None = None
    report: bool = True
    validate: bool = False
    progress_file: str | None = None
    metrics_port: int = 0


def parse_args(argv: list[str] | None = None) -> Options:
    p = argparse.ArgumentParser(prog="rlhf-runtime", description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default=os.environ.get(rc.CONFIG_ENV), help="RuntimeConfig JSON file")
    p.add_argument("--local", action="store_true", help="start a local Ray instead of joining a cluster")
    p.add_argument("--num-cpus", type=int, help="CPUs of the local Ray (default: one per actor + 1)")
    p.add_argument("--address", help="run locally (as --local) in the Ray already running on this machine at "
                   "HOST:PORT (`ray start --head` with the rlhf_* resources the job's bundles ask for) instead of "
                   "starting one")
    p.add_argument("--kubeconfig", help="report through this kubeconfig instead of the in-cluster config")
    p.add_argument("--no-report", action="store_true", help="do not patch the RLHFJob status")
    p.add_argument("--validate", action="store_true",
                   help="validate the first weight sync (also spec.weightSync.validate)")
    p.add_argument("--progress-file", default=os.environ.get("RLHF_PROGRESS_FILE"))
    p.add_argument("--metrics-port", type=int, default=int(os.environ.get("RLHF_METRICS_PORT", "0")))
    a = p.parse_args(argv)
    return Options(a.config, a.local, a.num_cpus, a.address, a.kubeconfig, not a.no_report, a.validate,
                   a.progress_file, a.metrics_port)


def _report_bad_config(opts: Options, error: BaseException) -> int:
    """A job.json that does not parse: report Failed with the parse error into the job named (best effort) by
    the raw JSON, and to the progress file; exit status 1."""
    path = opts.config or os.environ.get(rc.CONFIG_ENV)
    msg = f"invalid job config {path}: {type(error).__name__}: {error}"[:1000]
    log.error("%s", msg)
    name, namespace, uid = rc.identity(path)
    status = None
    if opts.report and name and namespace:
        try:
            status = StatusClient(name, namespace, uid, opts.kubeconfig)
        except Exception as e:  # noqa: BLE001 - no API: the log and the exit status still say it
            log.warning("status reporting disabled: %s", e)
    elif opts.report:
        log.error("cannot report the failure: no name/namespace readable from %s", path)
    reporter = Reporter(status, None, opts.progress_file)
    try:
        reporter.report("Failed", message=msg)
    except ForeignJobError as e:
        log.error("%s", e)
    return EXIT_FAILED


def failure_message(e: BaseException) -> str:
    """The ``Failed`` message of a run that raised ``e``: an actor's own exception where Ray wrapped one
    (``RayTaskError(X)``, whose text is Ray's traceback of the actor) - what the user can act on - else ``e``."""
    seen = 0
    while type(e).__name__.startswith("RayTaskError") and isinstance(getattr(e, "cause", None), BaseException) \
            and seen < 8:
        e, seen = e.cause, seen + 1  # type: ignore[attr-defined]
    return f"{type(e).__name__}: {e}"[:1000]


def make_reporter(cfg: Any, opts: Options) -> Reporter:
    """Status (the RLHFJob's, unless ``--no-report`` or no API is reachable), Prometheus, the progress file and the
    trackers of ``spec.tracking``."""
    status = None
    if opts.report:
        from kubernetes.config import ConfigException

        try:
            status = StatusClient(cfg.name, cfg.namespace, cfg.uid, opts.kubeconfig)
        except ConfigException as e:  # not in a pod and no --kubeconfig: run, but report nowhere
            log.warning("status reporting disabled: %s", e)
    metrics = Metrics(cfg.name, cfg.namespace)
    if opts.metrics_port:
        metrics.serve(opts.metrics_port)
    tracker = Tracker.from_spec(cfg.spec, cfg.name, cfg.namespace, cfg.uid)
    return Reporter(status, metrics, opts.progress_file, tracker=tracker)


def _on_term(signum: int, frame: Any) -> None:
    raise SystemExit(f"terminated by signal {signum}")


def main(argv: list[str] | None = None, classes: ActorClasses | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    opts = parse_args(argv)
    try:
        cfg = rc.load_config(opts.config)
    except Exception as e:  # noqa: BLE001 - any parse error is the job's failure, reported into its status
        return _report_bad_config(opts, e)
    # The pods already have spec.env (the operator renders it); a local run gets it here, before anything
    # reads it (e.g. HF_HUB_OFFLINE, read when huggingface_hub is imported; a local Ray inherits it).
    os.environ.update(rc.spec_env(cfg.spec))
    reporter = make_reporter(cfg, opts)
    signal.signal(signal.SIGTERM, _on_term)
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    finished = threading.Event()

    def expire(message: str) -> None:
        """The watchdog fired: report, interrupt the main thread, and end the process if it does not end."""
        log.error("%s", message)
        try:
            reporter.report("Failed", message=message)
        except Exception as e:  # noqa: BLE001 - the exit status still fails the run
            log.error("could not report the stall: %s", e)
        _thread.interrupt_main()
        if not finished.wait(WATCHDOG_GRACE_SECONDS):
            log.error("the driver did not stop within %ss of the progress deadline: exiting", WATCHDOG_GRACE_SECONDS)
            os._exit(EXIT_FAILED)

    runtime: Runtime | None = None
    watchdog = Watchdog(lambda: runtime.progress_deadline if runtime else cfg.spec.progress_deadline_seconds,
                        expire)
    runtime = Runtime(cfg, reporter, watchdog, local=opts.local, num_cpus=opts.num_cpus, validate=opts.validate,
                      classes=classes, address=opts.address)
    try:
        return run(runtime, reporter, watchdog)
    finally:
        finished.set()


def run(runtime: Runtime, reporter: Reporter, watchdog: Watchdog) -> int:
    """``runtime.run()`` with every failure reported; the exit status. Ray is shut down (bounded) after."""
    code = 0
    try:
        reporter.mark_progress()
        watchdog.start()
        reporter.start_heartbeat(on_beat=runtime.refresh_spec)
        runtime.run()
    except ForeignJobError as e:
        log.error("%s", e)
        code = EXIT_FAILED
    except ValidationError as e:
        log.error("%s", e)
        reporter.report("Failed", message=str(e))
        code = EXIT_VALIDATION
    except BaseException as e:  # noqa: BLE001 - report every failure, including SIGTERM, before exiting
        log.error("run failed:\n%s", traceback.format_exc())
        try:
            # a CUDA out-of-memory error with the memory plan's numbers and the fields to change
            message = explain_oom(failure_message(e), runtime.actors.memory_plan)
            reporter.report("Failed", message=watchdog.fired or message)
        except ForeignJobError:
            pass
        code = EXIT_FAILED
    finally:
        watchdog.stop()
        reporter.close()
        _bounded_shutdown(runtime, code)
    return code


def _bounded_shutdown(runtime: Runtime, code: int) -> None:
    """``runtime.shutdown()``, but a Ray that does not let go (an actor stopped mid-collective) must not keep a
    finished run alive: past ``SHUTDOWN_SECONDS`` the process exits with ``code``."""
    t = threading.Thread(target=runtime.shutdown, name="rlhf-shutdown", daemon=True)
    t.start()
    t.join(SHUTDOWN_SECONDS)
    if t.is_alive():
        log.error("Ray shutdown did not finish within %ss: exiting", SHUTDOWN_SECONDS)
        logging.shutdown()
        os._exit(code)


def exit_process(code: int) -> None:
    """End the driver's process with ``code`` once ``main`` returned: threads that are not daemons are waited
    for and the atexit handlers, the log handlers and the output streams run and flush as in a normal exit; the
    interpreter's teardown after them does not (freeing torch's, transformers' and Ray's modules takes a while
    and does nothing a finished run needs)."""
    for t in threading.enumerate():
        if t is not threading.main_thread() and not t.daemon:
            t.join()
    atexit._run_exitfuncs()  # what a normal exit runs first
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed or broken stream: nothing left to flush
            pass
    os._exit(code)


def cli() -> None:
    """The console script and ``python -m``: ``main``, then ``exit_process`` with its exit status."""
    exit_process(main())


if __name__ == "__main__":
    cli()
