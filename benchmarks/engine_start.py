"""Where a vLLM engine's start goes in a fresh process: the colocated engine's start is the critical path of the
learning benchmark's whole run (issue 32; on one H200 on 2026-11-28 its vLLM import took 23.6-27.9 s inside the
runtime's engine actor and its build ~11 s, for a 4-layer model: benchmarks/results/learning/README.md, "Six interleaved pairs").

Each repeat is one fresh Python process that times, in order: the interpreter's start (launch to its first line),
``import torch``, CUDA's init (``torch.cuda.init()``; skipped on CPU), ``import vllm`` with ``from vllm import
LLM`` (what ``rollout.base.EngineBase`` imports), the engine's build (``vllm.LLM(...)`` with the learning
benchmark's engine arguments: eager, ``max_model_len`` 32, the KV cache given in GiB or by memory utilisation),
and one greedy generate. ``--beside-import`` also starts a second process that imports torch, transformers and
vLLM at the same moment (as the trainer and the driver's tokenizer do beside the engine in the runtime's start).
``--no-bytecode`` adds runs whose Python finds no cached bytecode and writes none (``PYTHONPYCACHEPREFIX``
an empty folder, ``PYTHONDONTWRITEBYTECODE=1``): what every import costs where packages were installed without
bytecode on a machine that sets ``PYTHONDONTWRITEBYTECODE``. ``--importtime`` adds one ``python -X importtime -c
"from vllm import LLM"`` and lists the packages whose imports took longest (self time summed per top-level
package). Prints one JSON document; ``--out`` also writes it.

    . benchmarks/gpu_env.sh /tmp/site-0.31.0 && python3 benchmarks/engine_start.py --model /tmp/learn-model \
        --kv-cache-gib 1 --repeats 5 --importtime --beside-import --no-bytecode --out $OUT/engine_start.json
    .venv/bin/python benchmarks/engine_start.py --model <tiny model> --cpu --repeats 1 --importtime   # smoke
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

CHILD = r"""
import json, sys, time
t = {"first_line": time.time()}
import torch
t["torch"] = time.time()
if torch.cuda.is_available():
    torch.cuda.init()
t["cuda_init"] = time.time()
import vllm
from vllm import LLM, SamplingParams
t["vllm"] = time.time()
a = json.loads(sys.argv[1])
kw = dict(model=a["model"], enforce_eager=True, max_model_len=32, dtype=a["dtype"], seed=0)
if a["kv_cache_gib"]:
    kw["kv_cache_memory_bytes"] = int(a["kv_cache_gib"] * 2**30)
else:
    kw["gpu_memory_utilization"] = a["gpu_memory_utilization"]
llm = LLM(**kw)
t["built"] = time.time()
llm.generate(["1+2="], SamplingParams(max_tokens=4, temperature=0.0), use_tqdm=False)
t["generated"] = time.time()
print("TIMES " + json.dumps(t), flush=True)
"""

BESIDE = "import torch, transformers\nfrom transformers import AutoConfig\nimport vllm\nfrom vllm import LLM\n"

PHASES = (("interpreter", "launched", "first_line"), ("import torch", "first_line", "torch"),
          ("CUDA init", "torch", "cuda_init"), ("import vllm + LLM", "cuda_init", "vllm"),
          ("build", "vllm", "built"), ("first generate", "built", "generated"), ("total", "launched", "generated"))


def one(a: argparse.Namespace, variant: str) -> dict[str, float]:
    """One fresh process's phases, in seconds (``beside``: another process importing at the same moment;
    ``no-bytecode``: every module compiled from source)."""
    beside, env = variant == "beside", dict(os.environ)
    if variant == "no-bytecode":
        env.update(PYTHONPYCACHEPREFIX=tempfile.mkdtemp(prefix="no-bytecode-"), PYTHONDONTWRITEBYTECODE="1")
    args = json.dumps({"model": a.model, "kv_cache_gib": a.kv_cache_gib, "dtype": a.dtype,
                       "gpu_memory_utilization": a.gpu_memory_utilization})
    other = subprocess.Popen([sys.executable, "-c", BESIDE]) if beside else None
    launched = time.time()
    r = subprocess.run([sys.executable, "-c", CHILD, args], capture_output=True, text=True, timeout=a.timeout,
                       check=False, env=env)
    if other is not None:
        other.wait(timeout=a.timeout)
    line = next((x for x in r.stdout.splitlines() if x.startswith("TIMES ")), None)
    if r.returncode or line is None:
        raise SystemExit(f"the probe failed (exit {r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
    t = {"launched": launched, **json.loads(line[len("TIMES "):])}
    return {name: round(t[b] - t[a_], 3) for name, a_, b in PHASES}


def importtime(top: int) -> list[dict[str, Any]]:
    """``python -X importtime -c "from vllm import LLM"``: self time per top-level package (``rank_imports``)."""
    r = subprocess.run([sys.executable, "-X", "importtime", "-c", "from vllm import LLM"], capture_output=True,
                       text=True, timeout=600, check=False)
    return rank_imports(r.stderr, top)


def rank_imports(stderr: str, top: int) -> list[dict[str, Any]]:
    """``-X importtime``'s report (``import time: self [us] | cumulative | imported package``) as the ``top``
    top-level packages by their modules' summed self time, the longest first, then ``(all)``: every module's."""
    per: dict[str, float] = collections.defaultdict(float)
    total = 0.0
    for line in stderr.splitlines():
        if not line.startswith("import time:") or "self [us]" in line:
            continue
        self_us, _cum, name = (x.strip() for x in line[len("import time:"):].split("|", 2))
        per[name.split(".")[0]] += int(self_us) / 1e6
        total += int(self_us) / 1e6
    ranked = sorted(per.items(), key=lambda kv: -kv[1])[:top]
    return [{"package": k, "self_seconds": round(v, 3)} for k, v in ranked] + [{"package": "(all)",
                                                                                "self_seconds": round(total, 3)}]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="a Hugging Face model folder (config, weights, tokenizer)")
    p.add_argument("--kv-cache-gib", type=float, default=0, help="rollout.kvCacheMemoryGiB (0: by utilisation)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.25)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--beside-import", action="store_true",
                   help="also per repeat a run with another process importing beside it (interleaved)")
    p.add_argument("--no-bytecode", action="store_true", help="also per repeat a run compiling every module")
    p.add_argument("--importtime", action="store_true")
    p.add_argument("--top", type=int, default=15)
    p.add_argument("--dtype", default="", help="the engine's dtype (default bfloat16; float32 with --cpu)")
    p.add_argument("--cpu", action="store_true", help="no GPU here (vLLM's CPU build)")
    p.add_argument("--timeout", type=float, default=300)
    p.add_argument("--out", default="")
    a = p.parse_args()
    a.dtype = a.dtype or ("float32" if a.cpu else "bfloat16")  # bfloat16 kernels need AVX512-BF16 on a CPU
    variants = ["alone"] + ["beside"] * a.beside_import + ["no-bytecode"] * a.no_bytecode
    runs: dict[str, list[dict[str, float]]] = {v: [] for v in variants}
    for i in range(a.repeats):
        for v in variants[i % len(variants):] + variants[:i % len(variants)]:  # the order rotates
            runs[v].append(one(a, v))
            print(v, json.dumps(runs[v][-1]), flush=True)
    summary = {v: {name: {"median": round(statistics.median(r[name] for r in rs), 3), "min": min(r[name] for r in rs),
                          "max": max(r[name] for r in rs)} for name, _, _ in PHASES} for v, rs in runs.items()}
    out: dict[str, Any] = {"command": " ".join(sys.argv), "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
                           "python": sys.version.split()[0], "runs": runs, "summary": summary}
    try:
        import torch
        import vllm

        out["versions"] = {"torch": torch.__version__, "vllm": vllm.__version__}
        out["device"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    except ImportError as e:
        out["versions"] = f"not importable: {e}"
    if a.importtime:
        out["importtime"] = importtime(a.top)
    text = json.dumps(out, indent=1)
    print(text)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
