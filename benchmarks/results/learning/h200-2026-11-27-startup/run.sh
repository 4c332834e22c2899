#!/bin/bash
# Issue 32 item 6 again after the engines' two-phase start (engine actors made beside the trainer, built after it):
# the runtime and TRL 1.16.0 per seed, interleaved, as in the first comparison (benchmarks/README.md, "Beside TRL's
# GRPOTrainer"). Usage on nvidia-h200 after staging vLLM 0.31.0 + trl 1.16.0: run.sh SEED [SEED...]; every JSON
# and log comes back in one tarball ($OUT/seeds-<first seed>.tgz).
. benchmarks/gpu_env.sh /tmp/site-0.31.0
T0=$(date +%s)
nvidia-smi > $OUT/nvidia-smi.txt
for S in "$@"; do
  left=$(( 585 - ($(date +%s) - T0) ))
  if [ $left -lt 200 ]; then echo "SKIP seed $S: $left s left" >> $OUT/order.txt; continue; fi
  echo "$(date +%T) seed $S" >> $OUT/order.txt
  timeout $(( left - 10 )) python3 benchmarks/gpu_learning.py --out $OUT/s$S --model-dir /tmp/learn-model \
      --sft-eval-every 20 --sft-target 0.3 --grpo-steps 30 --variants float32 --resident --trl-python python3 \
      --seeds $S --run-timeout 280 > $OUT/s$S.log 2>&1
  echo "$(date +%T) seed $S exit $?" >> $OUT/order.txt
done
cd $OUT && find . -name "*.json" -o -name "*.log" -o -name "*.txt" -o -name "*.jsonl" | grep -v safetensors \
  | tar czf /tmp/seeds.tgz -T - && rm -rf s* && mv /tmp/seeds.tgz $OUT/seeds-$1.tgz; ls -la $OUT; cat $OUT/order.txt 2>/dev/null
