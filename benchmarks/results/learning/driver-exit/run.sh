#!/bin/bash
# The driver exit A/B (2026-11-28, the 2-core CPU machine): last progress record -> process exit, the old entry
# point (sys.exit(main())) against python -m rlhf_runtime.driver (exit_process), interleaved. Needs the job config
# that /tmp/exit_time.py wrote (benchmarks/cpu_runtime.py build_model 128 hidden, 2 layers; 3 steps) at $W/r0/job.json.
W=${W:-/tmp/exit-n5fmm9ol} .venv/bin/python - "${1:-5}" <<'EOF'
import sys, time, json, subprocess, os, statistics
from pathlib import Path
W = Path(os.environ["W"])
cmds = {"sys.exit(main())": [sys.executable, "-c", "import sys; from rlhf_runtime.main import main; sys.exit(main())"],
        "exit_process": [sys.executable, "-m", "rlhf_runtime.driver"]}
res = {k: [] for k in cmds}
for i in range(int(sys.argv[1])):
    for k in (list(cmds) if i % 2 == 0 else list(cmds)[::-1]):
        prog = W / f"ab-{i}-{len(res[k])}-{k[:4]}.jsonl"
        subprocess.run(["rm", "-f", "/tmp/ray/ray_current_cluster"])
        t0 = time.time()
        rc = subprocess.run(cmds[k] + ["--config", str(W / "r0/job.json"), "--local", "--no-report", "--progress-file", str(prog)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env={**os.environ, "RAY_AUTH_MODE": "disabled"}).returncode
        end = time.time()
        last = json.loads(prog.read_text().splitlines()[-1])["time"]
        res[k].append(round(end - last, 2)); print(k, rc, res[k][-1], round(end - t0, 1), flush=True)
for k, v in res.items(): print(k, "median", statistics.median(v), "min", min(v), "max", max(v), v)
EOF
