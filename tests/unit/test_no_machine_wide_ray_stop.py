"""Nothing that the suite runs stops every Ray on the machine. ``ray stop --force`` ends every Ray process here,
and ``make test`` runs two tiers side by side: a benchmark or test calling it kills the other worker's driver, its
raylet and its GCS mid-run. A run's own Ray ends with its process group (``harness.run_logged``,
``stack_dumps.watch``, the runtime tier's ``Run.kill_group``) instead.

The one exception, ``benchmarks/rendered_cluster.py``, starts its nodes with ``ray start`` (daemons outside any
process group of its own, ended only by ``ray stop``) and is run by hand on a machine of its own, never by the
suite."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
ALLOWED = {"benchmarks/rendered_cluster.py"}
#: ``ray stop`` in a command string (``"ray stop --force"``) or an argument list (``["ray", "stop", ...]``,
#: ``[..., "ray.scripts.scripts", "stop"``); prose that names it (in double backquotes) is not a call
RAY_STOP = re.compile(r"""["']ray\s+stop\b|["']ray["'],\s*["']stop["']|ray\.scripts\.scripts["'],\s*["']stop["']""")


def test_no_code_stops_every_ray_on_the_machine() -> None:
    offenders = []
    for top in ("benchmarks", "tests", "hack", "operator"):
        for f in sorted((REPO / top).rglob("*.py")):
            rel = f.relative_to(REPO).as_posix()
            if rel in ALLOWED or f == Path(__file__).resolve():
                continue
            for n, line in enumerate(f.read_text(errors="replace").splitlines(), 1):
                code = line.split("#", 1)[0]
                if RAY_STOP.search(code):
                    offenders.append(f"{rel}:{n}: {line.strip()}")
    assert not offenders, "stops every Ray on the machine (kill the run's own process group instead):\n" + \
        "\n".join(offenders)


def test_the_pattern_finds_each_form() -> None:
    for line in ('subprocess.run(["ray", "stop", "--force"])', "os.system('ray stop --force')",
                 'subprocess.run([sys.executable, "-m", "ray.scripts.scripts", "stop", "--force"])'):
        assert RAY_STOP.search(line), line
    assert not RAY_STOP.search('subprocess.run(["ray", "start", "--head"])')
