#!/bin/bash
# The multi-turn rollout's figures (benchmarks/agent_rollout.py: per-turn overhead, the engine's busy share with a
# 200 ms tool beside lockstep, the fault fuzz) with the engine and the trainer on one GPU, after staging vLLM
# (e.g. python3 hack/gpu-stage.py --vllm 0.31.0 ... --print-commands: the last call installs into
# /tmp/site-0.31.0). From the repository root, in one device call:
#     [SITE=/tmp/site-0.31.0] [ROUNDS=5] bash hack/gpu/agent-rollout.sh
# Leaves agent_rollout_gpu.json, run.log and nvidia-smi.txt in $OUT.
set -u
SITE=${SITE:-/tmp/site-0.31.0}
. benchmarks/gpu_env.sh $SITE
one_gpu_call $SITE $OUT
timeout ${RUN_TIMEOUT:-420} python3 benchmarks/agent_rollout.py --gpu --rounds ${ROUNDS:-5} \
    --out $OUT/agent_rollout_gpu.json > $OUT/run.log 2>&1
echo "exit $?"
grep -v "Writing\|Loading" $OUT/run.log | tail -40
