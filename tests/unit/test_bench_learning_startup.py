"""The learning benchmark's start-up line (``benchmarks/gpu_learning.startup_line``): the actors record placed
on the launch's clock. The record is the shape a CPU run of the benchmark wrote (2026-11-28); the phases are
made from the driver's progress records as the benchmark reads them (``startup_phases``)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import gpu_learning as gl

RECORD = {"since_launch": 28.12, "state": None, "message": "actors", "engine_build_seconds": [11.269],
          "trainer_start": {"asked_after_s": 0.051, "spawned_after_s": [0.056], "init_began_after_s": [2.683],
                            "init_seconds": [3.344], "weight_transfer_import_seconds": [1.8]},
          "engine_start": {"asked_after_s": 0.0, "spawned_after_s": [0.027], "init_began_after_s": [0.992],
                           "import_seconds": [7.67], "built_after_s": [19.931]},
          "first_actor_since_launch": 8.19, "inputs_checked_after_s": 1.5}


def test_phases_keep_what_the_line_reads() -> None:
    # the driver's progress records (controller.loop: the actors record written once the engines are built), from a
    # launch at Unix time 1000: every key of the actors record that startup_line reads survives into the phase
    launched = 1000.0
    actors = {"trainers": [11], "engines": [12], "engine_build_seconds": [11.269],
              "trainer_start": RECORD["trainer_start"], "engine_start": RECORD["engine_start"],
              "first_asked": 1008.19, "inputs_checked_after_s": 1.5, "ray_connect_seconds": 6.4,
              "placement_seconds": 0.31}
    records = [{"time": 1000.5, "runtime": {"state": "Starting", "message": "starting Ray actors"}},
               {"time": 1028.12, "actors": actors},
               {"time": 1028.46, "step": 1, "throughput": {"stepSeconds": 0.3}}]
    phases = gl.startup_phases(records, launched)
    assert [p["since_launch"] for p in phases] == [0.5, 28.12]  # the step's record is not a phase
    assert phases[0]["message"] == "starting Ray actors" and phases[1]["message"] == "actors"
    rec = phases[1]
    assert rec["first_actor_since_launch"] == 8.19 and rec["inputs_checked_after_s"] == 1.5
    assert rec["ray_connect_seconds"] == 6.4 and rec["placement_seconds"] == 0.31 and "trainers" not in rec
    line = gl.startup_line({"variant": "float32", "seed": 1, "startup": phases,
                            "steps": [{"step": 1, "since_launch": 28.46}]})
    assert "(s since launch): Ray connect 6.4 s, placement 0.31 s, actors asked 8.2, tokenizer and config " \
           "checked 9.7;" in line, line


def test_each_phase_is_placed_after_the_launch() -> None:
    run = {"side": "runtime", "variant": "float32", "seed": 0, "startup": [RECORD],
           "steps": [{"step": 1, "since_launch": 28.46}]}
    line = gl.startup_line(run)
    # trainer asked 8.241: process 8.297, constructor 10.924, ready 10.924 + 3.344; engine asked 8.19: built 28.121
    for part in ("actors asked 8.2, tokenizer and config checked 9.7", "trainer 0 process 8.3", "constructor 10.9",
                 "ready 14.3", "vLLM transfer import 1.8 s", "engine 0 process 8.2", "vLLM import 7.67 s", "built 28.1",
                 "first step 28.46"):
        assert part in line, (part, line)


def test_a_run_without_the_record_says_so() -> None:
    run = {"side": "runtime", "variant": "none", "seed": 2, "startup": [{"since_launch": 1.0, "message": "x"}],
           "steps": []}
    assert gl.startup_line(run) == "start-up none seed 2: no actors record; no step"
