#!/bin/bash
# Issue 32's MFU target (>= 40% at >= 4k tokens per sequence): where the compiled, checkpointing-off step still
# loses time, and three candidate fixes, on the 4 GPUs of nvidia-h200-x4 after staging vLLM 0.33 (the torch the
# runtime runs on: 2.14, from /tmp/site-0.33.0). Three lanes at once, each interleaving its variants:
#   GPUs 0-1: Qwen3-8B shape, FSDP2 x2, 4k tokens per sequence: base (4k budget; the first run also profiles a step),
#             no-reshard (FSDP2 keeps each layer's gathered parameters from forward to backward: one all-gather per
#             layer per micro-batch, not two), budget 8k (half the micro-batches), then again while time is left;
#   GPU 2 and GPU 3: Qwen3-1.7B shape, one GPU, 16k budget: base, chunk (the output layer's logits 2^29 elements
#             per chunk, not 2^27: 3.5k tokens, not 883), steps of 262,144 tokens (a GRPO mini-batch of 64 x 4k:
#             the optimiser's step over 4x the tokens), the two GPUs in rotated orders.
# All compiled (trainer.compile), checkpointing off, bfloat16 with float32 masters, 4,096-token sequences.
# From the repository root: LIMIT=540 bash benchmarks/results/trainer/h200x4-2026-11-27-mfu/run.sh; one tarball.
set -u
T0=$(date +%s); LIMIT=${LIMIT:-540}; left() { echo $(( LIMIT - ($(date +%s) - T0) )); }
R=/tmp/mfu; mkdir -p $R
. benchmarks/gpu_env.sh /tmp/site-0.33.0
nvidia-smi > $R/nvidia-smi.txt
python3 -c "import torch, transformers; print(torch.__version__, transformers.__version__)" > $R/versions.txt 2>&1
COMMON="--lengths 4096 --repeats 3 --skip-mix --compile-layers --no-checkpointing"
run() {  # lane, name, minimum seconds left, train_step.py arguments...
  local lane=$1 name=$2 need=$3; shift 3
  if [ "$(left)" -lt "$need" ]; then echo "$(date +%T) SKIP $name: $(left) s left" >> $R/order-$lane.txt; return; fi
  echo "$(date +%T) $name" >> $R/order-$lane.txt
  timeout $(( $(left) - 3 )) python3 benchmarks/train_step.py $COMMON "$@" --out $R/$name.json > $R/$name.log 2>&1
  echo "$(date +%T) $name exit $?" >> $R/order-$lane.txt
}
lane8b() {
  local m="--model qwen3-8b --world 2 --model-dir /tmp/m8b"
  run 8b 8b_base1 150 $m --budget 4096 --profile $R/8b_profile_base.json
  run 8b 8b_noreshard1 90 $m --budget 4096 --no-reshard
  run 8b 8b_budget8k1 90 $m --budget 8192
  run 8b 8b_base2 90 $m --budget 4096
  run 8b 8b_noreshard2 90 $m --budget 4096 --no-reshard
  run 8b 8b_budget8k2 90 $m --budget 8192
}
lane17() {  # GPU, then the variant order
  local gpu=$1 i=0; shift
  export CUDA_VISIBLE_DEVICES=$gpu
  local m="--model qwen3-1.7b --model-dir /tmp/m17 --budget 16384"
  until [ -e /tmp/m17/info.json ] || [ "$gpu" = 2 ]; do sleep 2; done   # GPU 2's first run builds the model
  for v in "$@"; do
    i=$((i + 1))
    case $v in
      base) run g$gpu 17_g${gpu}_${i}_base 60 $m ;;
      chunk) run g$gpu 17_g${gpu}_${i}_chunk 60 $m --logit-chunk-elements 536870912 ;;
      step262k) run g$gpu 17_g${gpu}_${i}_step262k 80 $m --step-tokens 262144 ;;
    esac
  done
}
lane8b & lane17 2 base chunk step262k base chunk step262k & lane17 3 chunk step262k base chunk step262k base &
wait
echo "done at $(( $(date +%s) - T0 )) s" >> $R/order-8b.txt
tar czf $OUT/mfu.tgz -C $R . ; cat $R/order-*.txt
