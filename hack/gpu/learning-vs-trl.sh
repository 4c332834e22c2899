#!/bin/bash
# The runtime's whole learning run against TRL's GRPOTrainer per wall-clock second (benchmarks/gpu_learning.py):
# the runtime with its colocated engine built beside the trainer (rollout.kvCacheMemoryGiB, gpu_learning.py
# --kv-cache-gib; B) and with the engine built after the trainer, sizing its KV cache from the memory left (A), and
# TRL 1.16.0 beside both, per seed, the order rotating from seed to seed: 30 GRPO steps of 3-digit addition from the
# same supervised checkpoint, engines resident (benchmarks/results/learning/README.md, "Beside TRL's GRPOTrainer").
#
# On nvidia-h200 after staging vLLM 0.31.0 + trl 1.16.0 (python3 hack/gpu-stage.py --vllm 0.31.0 --image-packages
# hack/gpu/image-freeze.txt --with trl==1.16.0 --kind nvidia-h200 --print-commands: 45 calls, the last installs;
# run the first seeds in that last call: T0=<call start> ... after the install),
# from the repository root, one device call each (~200 s a seed, so 2 seeds a call):
#     bash hack/gpu/learning-vs-trl.sh 0 1      # then: bash hack/gpu/learning-vs-trl.sh 2 3
# Leaves one tarball in $OUT (seeds-<first seed>.tgz: every JSON, log and the order); a call returns <= 8 files.
# KV cache: 1 GiB is ~30x what 512 sequences of at most 32 tokens of this 4-layer model need; without the field the
# engine takes what gpuMemoryUtilization 0.25 leaves (~34 GiB on an H200). The size does not change the rollout here.
set -u
. benchmarks/gpu_env.sh /tmp/site-0.31.0
clear_device
T0=${T0:-$(date +%s)}  # the call's start where the caller gives it (an install before this in the same call)
KV=${KV:-1}
# STEPS: the GRPO steps of every run (30 by default; more weigh the start-up less, e.g. STEPS=100: then one seed a
# call)
STEPS=${STEPS:-30}
# MODE=pairs: per seed one invocation with the explicit KV cache (B) and TRL, the sides' order alternating from seed
# to seed (runtime first, then TRL first): the >= 5 interleaved repeats of B against TRL (~170 s a seed, 3 a call):
#     MODE=pairs bash hack/gpu/learning-vs-trl.sh 0 1 2      # then: MODE=pairs bash hack/gpu/learning-vs-trl.sh 3 4 5
MODE=${MODE:-ab}
nvidia-smi > $OUT/nvidia-smi.txt
# whether imports compile from source (no cached bytecode and none written; hack/gpu-stage.py compiles the staged
# site), and with PROBE=N where the engine's start goes in a bare process (benchmarks/engine_start.py;
# N repeats alone and N beside another importing process, ~40 s each on an H200; needs the supervised checkpoint,
# which the machine's first gpu_learning.py run makes: so on a later call)
{ echo "PYTHONDONTWRITEBYTECODE=${PYTHONDONTWRITEBYTECODE:-unset}"
  for d in /tmp/site-0.31.0/vllm /tmp/site-0.31.0/torch $(python3 -c "import transformers, os; print(os.path.dirname(transformers.__file__))"); do
    echo "$d: $(find $d -name '*.py' | wc -l) .py, $(find $d -name '*.pyc' | wc -l) .pyc"; done; } > $OUT/bytecode.txt 2>&1
if [ "${PROBE:-0}" -gt 0 ] && [ -f /tmp/learn-model/config.json ]; then
  timeout 300 python3 benchmarks/engine_start.py --model /tmp/learn-model --kv-cache-gib $KV --repeats $PROBE \
      --beside-import --no-bytecode --importtime --out $OUT/engine_start.json > $OUT/engine_start.log 2>&1
fi
# DTYPE=float32: the runtime's model.dtype (trainer and engine in float32; TRL unchanged), to see what precision
# does to the held-out accuracy beside TRL's.
# VARIANT=autocast: trainer.autocast (float32 weights, bfloat16 autocast: TRL's precision) instead of master weights;
# VARIANT=float32,autocast: both from the one checkpoint, per seed (~165 s a seed). The machine is released ~30 s
# after a call ends, which a 400-s call's result can outlast before the next call is sent: put every run of a
# machine into its install call where it fits.
common=(--model-dir /tmp/learn-model --sft-eval-every 20 --sft-target 0.3 --grpo-steps $STEPS --variants ${VARIANT:-float32}
        --resident --run-timeout $(( 170 + STEPS )) ${DTYPE:+--model-dtype $DTYPE})
i=0
for S in "$@"; do
  # A: the runtime as it starts today, then TRL (the earlier runs' order); B: the runtime with the explicit KV cache
  if [ $(( i % 2 )) = 0 ]; then order="A B"; sides=runtime,trl; else order="B A"; sides=trl,runtime; fi
  need=120
  if [ $MODE = pairs ]; then order=P; need=170; fi
  for part in $order; do
    left=$(( 585 - ($(date +%s) - T0) ))
    if [ $left -lt $need ]; then echo "SKIP seed $S $part: $left s left" >> $OUT/order.txt; continue; fi
    echo "$(date +%T) seed $S $part" >> $OUT/order.txt
    if [ $part = P ]; then
      echo "  sides $sides" >> $OUT/order.txt
      timeout $(( left - 10 )) python3 benchmarks/gpu_learning.py --out $OUT/s$S-P "${common[@]}" \
          --kv-cache-gib $KV --trl-python python3 --sides $sides --seeds $S > $OUT/s$S-P.log 2>&1
    elif [ $part = A ]; then
      timeout $(( left - 10 )) python3 benchmarks/gpu_learning.py --out $OUT/s$S-A "${common[@]}" \
          --trl-python python3 --seeds $S > $OUT/s$S-A.log 2>&1
    else
      timeout $(( left - 10 )) python3 benchmarks/gpu_learning.py --out $OUT/s$S-B "${common[@]}" \
          --kv-cache-gib $KV --seeds $S > $OUT/s$S-B.log 2>&1
    fi
    echo "$(date +%T) seed $S $part exit $?" >> $OUT/order.txt
  done
  i=$(( i + 1 ))
done
cd $OUT && find . -name "*.json" -o -name "*.log" -o -name "*.txt" -o -name "*.jsonl" | grep -v safetensors \
  | tar czf /tmp/seeds.tgz -T - && rm -rf s[0-9]* && mv /tmp/seeds.tgz $OUT/seeds-$1.tgz; ls -la $OUT; cat order.txt
