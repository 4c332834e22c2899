"""``benchmarks/gpu_sync.py`` refuses options that would be silently ignored together."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_sync.py"


def test_revalidate_without_variants_is_refused() -> None:
    out = subprocess.run([sys.executable, str(BENCH), "--revalidate", "--no-variants", "cpu-gloo:tiny"],
                         capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == 2, (out.stdout, out.stderr)
    assert "--revalidate needs the variants" in out.stderr, out.stderr
