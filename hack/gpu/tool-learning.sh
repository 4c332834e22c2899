#!/bin/bash
# Multi-turn GRPO with the builtin python tool against the same budget single-turn (benchmarks/tool_learning.py)
# on one GPU, after staging vLLM (e.g. python3 hack/gpu-stage.py --vllm 0.31.0 --with trl==1.16.0 ... --print-commands:
# the last call installs into /tmp/site-0.31.0). From the repository root, in one device call:
#     [SITE=/tmp/site-0.31.0] [SEEDS=0] [STEPS=20] [ARMS=tools,single] [TRL=1] bash hack/gpu/tool-learning.sh
# TRL=1 adds TRL's GRPOTrainer with the same tool from the same checkpoint (a staging with TRL); with it, ARMS=tools
# keeps the call within the device's 600 s. Leaves tool_learning_<gpu>.json, run.log and nvidia-smi.txt in $OUT.
set -u
SITE=${SITE:-/tmp/site-0.31.0}
. benchmarks/gpu_env.sh $SITE
one_gpu_call $SITE $OUT
python3 benchmarks/tool_learning.py --out $OUT --seeds ${SEEDS:-0} --grpo-steps ${STEPS:-20} --prompts 32 \
    --arms ${ARMS:-tools,single} ${TRL:+--trl-python python3} --run-timeout ${RUN_TIMEOUT:-400} > $OUT/run.log 2>&1
echo "exit $?"
grep -v "Writing\|Loading" $OUT/run.log | tail -40
