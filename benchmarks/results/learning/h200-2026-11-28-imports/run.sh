#!/bin/bash
# Do two Python processes importing a trainer's stack at once slow each other on a GPU host? (issue 32: with the
# engine importing vLLM beside it, the trainer became ready 11 s later, benchmarks/README.md "Again after the
# engines' two-phase start".) The GPU image's own torch and transformers; no vLLM on a bare machine. Each probe: a
# fresh python that imports torch, transformers' causal-LM auto class and a Qwen3 model class, then initialises
# CUDA (one tensor on the GPU). Order: one cold probe (the machine's first), then 5 rounds of one alone and two at
# once, alternating which comes first. Usage (device, from the repository root): bash <this file>
set -u
P='import time, json, sys
t0 = time.time(); import torch; t1 = time.time()
from transformers import AutoModelForCausalLM
from transformers.models.qwen3 import modeling_qwen3; t2 = time.time()
torch.zeros(1, device="cuda"); torch.cuda.synchronize(); t3 = time.time()
print(json.dumps({"tag": sys.argv[1], "torch_s": round(t1 - t0, 3), "transformers_s": round(t2 - t1, 3),
                  "cuda_init_s": round(t3 - t2, 3), "total_s": round(t3 - t0, 3)}))'
probe() { local s; s=$(date +%s%N); python3 -c "$P" "$1"; echo "{\"tag\": \"$1\", \"wall_ms\": $(( ($(date +%s%N) - s) / 1000000 ))}"; }
nproc; python3 -c "import torch, transformers; print(torch.__version__, transformers.__version__)"
probe cold
for r in 1 2 3 4 5; do
  if [ $((r % 2)) = 1 ]; then probe alone-$r; probe pair-$r-a & probe pair-$r-b & wait
  else probe pair-$r-a & probe pair-$r-b & wait; probe alone-$r; fi
done
