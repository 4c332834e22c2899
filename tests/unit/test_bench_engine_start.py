"""The engine start-up probe's import report (``benchmarks/engine_start.rank_imports``): ``-X importtime`` lines
summed per top-level package. The lines are the format CPython 3.11 writes (nested modules indented)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import engine_start

REPORT = """\
import time: self [us] | cumulative | imported package
import time:       120 |        120 |   _io
import time:      3000 |       3000 |     torch._C
import time:    900000 |     903000 |   torch
import time:     40000 |      40000 |       vllm.config
import time:    300000 |     340000 |   vllm
some other line a package printed
import time:      1500 |       1500 | transformers.utils
"""


def test_self_time_is_summed_per_top_level_package_longest_first() -> None:
    ranked = engine_start.rank_imports(REPORT, top=2)
    assert ranked == [{"package": "torch", "self_seconds": 0.903}, {"package": "vllm", "self_seconds": 0.34},
                      {"package": "(all)", "self_seconds": 1.245}]


def test_an_empty_report_ranks_nothing() -> None:
    assert engine_start.rank_imports("", top=5) == [{"package": "(all)", "self_seconds": 0.0}]
