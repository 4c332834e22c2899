"""``benchmarks/harness.py`` (what the benchmark scripts share) and ``benchmarks/run.py`` (one command per suite):
the facts a result records, the job spec's environment, a step with a time limit, and which steps a suite runs
where. Real processes and a real git checkout; nothing here needs a GPU."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCH))

import harness
import run


def _git(repo: Path, *args: str) -> None:
    subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True)


def test_the_commit_comes_from_git_or_where_there_is_none_from_the_environment(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    repo.mkdir()
    _git(repo, "init", "-q")
    (repo / "f").write_text("x")
    _git(repo, "add", "f")
    _git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "c")
    head = subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True, text=True,
                          check=True).stdout.strip()
    env = {"BENCH_COMMIT": "ignored", "BENCH_DIRTY": "1"}
    assert harness.git_facts(repo, env) == {"commit": head, "dirty": False, "source": "git"}
    (repo / "new").write_text("y")  # untracked, not ignored: the tree differs from the commit
    assert harness.git_facts(repo, env)["dirty"] is True
    copy = tmp_path / "copy"  # a copy of the tree without .git, as on a GPU machine
    copy.mkdir()
    assert harness.git_facts(copy, {"BENCH_COMMIT": "abc123", "BENCH_DIRTY": "0"}) == {
        "commit": "abc123", "dirty": False, "source": "BENCH_COMMIT"}
    assert harness.git_facts(copy, {"BENCH_COMMIT": "abc123"})["dirty"] is None
    assert harness.git_facts(copy, {}) == {"commit": None, "dirty": None, "source": None}


def test_provenance_names_the_command_the_device_and_the_installed_versions() -> None:
    p = harness.provenance("python3 x.py --flag")
    assert p["command"] == "python3 x.py --flag" and p["date"].endswith("+00:00")
    device = p["device"]
    assert device["cpus"] >= 1 and device["gpu_count"] == len(device["gpus"])
    import torch

    assert device["versions"]["torch"] == torch.__version__  # read from the metadata, not by importing
    assert set(harness.VERSIONED) <= set(device["versions"])


def test_gpu_facts_read_nvidia_smi_and_say_none_without_it(tmp_path: Path) -> None:
    smi = tmp_path / "nvidia-smi"
    smi.write_text("#!/bin/sh\necho 'NVIDIA H100 80GB HBM3, 570.86.15, 81559 MiB'\n"
                   "echo 'NVIDIA H100 80GB HBM3, 570.86.15, 81559 MiB'\n")
    smi.chmod(0o755)
    facts = harness.gpu_facts(str(smi))
    assert facts == {"gpus": ["NVIDIA H100 80GB HBM3"] * 2, "gpu_count": 2, "driver": "570.86.15",
                     "gpu_memory": "81559 MiB"}
    assert run.default_kind(facts) == "nvidia-h100-x2"
    assert harness.gpu_facts(str(tmp_path / "missing"))["gpu_count"] == 0
    assert run.default_kind(harness.gpu_facts(str(tmp_path / "missing"))) == "cpu"


def test_the_environment_goes_to_every_actor_through_the_spec() -> None:
    spec = {"model": {"name": "m"}, "env": [{"name": "A", "value": "old"}, {"name": "B", "value": "b"}]}
    out = harness.with_env(spec, {"A": "new", "C": "c"})
    assert out["env"] == [{"name": "B", "value": "b"}, {"name": "A", "value": "new"}, {"name": "C", "value": "c"}]
    assert spec["env"][0]["value"] == "old"  # the spec given is left as it was
    assert harness.merge({"a": {"b": 1, "c": 2}}, {"a": {"c": 3}, "d": 4}) == {"a": {"b": 1, "c": 3}, "d": 4}


def test_a_step_past_its_limit_is_killed_with_its_children_and_its_output_kept(tmp_path: Path) -> None:
    log = tmp_path / "step.log"
    child = tmp_path / "child.pid"
    script = (f"import subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c', 'import time; "
              f"time.sleep(60)']); open({str(child)!r}, 'w').write(str(p.pid)); print('started', flush=True); "
              "time.sleep(60)")
    t = time.monotonic()
    got = harness.run_logged([sys.executable, "-c", script], log, timeout=3)
    assert got["exit"] == 124 and got["timed_out"] and time.monotonic() - t < 30, got
    assert "started" in log.read_text() and "killed after 3 s" in log.read_text()
    pid = int(child.read_text())
    deadline = time.monotonic() + 10  # the grandchild went with the group
    while Path(f"/proc/{pid}").exists() and Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z":
        assert time.monotonic() < deadline, f"process {pid} outlived its step"
        time.sleep(0.1)
    assert harness.run_logged([sys.executable, "-c", "raise SystemExit(5)"], log)["exit"] == 5


def test_a_result_is_replaced_whole(tmp_path: Path) -> None:
    out = harness.write_result(tmp_path / "a" / "r.json", {"x": 1, "p": Path("/p")})
    assert json.loads(out.read_text()) == {"x": 1, "p": "/p"} and not list(out.parent.glob("*.tmp"))


def test_a_suite_runs_the_steps_the_machine_can_and_says_why_not_the_others() -> None:
    sync = run.SUITES["sync"]
    names = lambda steps: [(s.name, why) for s, why in steps]
    assert names(run.chosen(sync, 1, False, [])) == [("ipc-resident", None),
                                                     ("nccl-separate", "needs 2 GPUs, this machine has 1")]
    assert names(run.chosen(sync, 2, False, [])) == [("ipc-resident", None), ("nccl-separate", None)]
    assert names(run.chosen(sync, 0, False, [])) == [("cpu-gloo", None)]
    assert names(run.chosen(sync, 2, True, [])) == [("cpu-gloo", None)]  # --cpu on a GPU machine
    trainer = run.SUITES["trainer"]
    assert names(run.chosen(trainer, 1, False, [])) == [("compile", None)]  # the 16k arm only when asked
    assert names(run.chosen(trainer, 1, False, ["compile-16k"])) == [("compile-16k", None)]
    with pytest.raises(ValueError, match="no step nope"):
        run.chosen(trainer, 1, False, ["nope"])


def test_a_steps_arguments_get_the_suites_folder_kind_and_limit() -> None:
    step = run.Step("s", ("benchmarks/x.py", "--out", "{out}/r.json", "--kind", "{kind}", "--timeout", "{timeout}",
                          "--spec-json", '{"rollout": {"x": 1}}'))
    argv = run.fill(step.argv, Path("/o"), "nvidia-h100-x1", 300.0)
    assert argv == [sys.executable, "benchmarks/x.py", "--out", "/o/r.json", "--kind", "nvidia-h100-x1",
                    "--timeout", "280", "--spec-json", '{"rollout": {"x": 1}}']
    for suite in run.SUITES.values():  # every script a suite names exists
        for s in suite.steps:
            assert (harness.REPO / s.argv[0]).is_file(), s


def test_every_suites_scripts_take_the_arguments_the_suite_gives(tmp_path: Path) -> None:
    """Each step's filled-in arguments parse in its script (``--help`` aside, argparse refuses an unknown option
    before any work): ``parse_known_args`` through the script's own parser where it has one, else a dry ``-h``."""
    for suite in run.SUITES.values():
        for s in suite.steps:
            argv = run.fill(s.argv, tmp_path, "cpu", 300.0)
            out = subprocess.run([*argv, "--help"], capture_output=True, text=True, timeout=120, cwd=harness.REPO,
                                 check=False)
            assert out.returncode == 0, (s.name, out.stderr[-2000:])
            options = {a for a in argv[2:] if a.startswith("--")}
            missing = {o for o in options if o not in out.stdout}
            assert not missing, (s.name, missing)
