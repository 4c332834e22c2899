"""``python3 -m benchmarks <suite>``: the suite runner (``benchmarks/run.py``), from the repository root."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from run import main  # after the path: the benchmarks' own modules import each other by name

sys.exit(main())
