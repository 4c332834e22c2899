#!/bin/bash
# Multi-turn GRPO with the builtin python tool against the same budget single-turn (benchmarks/tool_learning.py)
# on one GPU, after staging vLLM (e.g. python3 hack/gpu-stage.py --vllm 0.31.0 --with trl==1.16.0 ... --print-commands:
# the last call installs into /tmp/site-0.31.0). From the repository root, in one device call:
#     [SITE=/tmp/site-0.31.0] [SEEDS=0] [STEPS=20] [ARMS=tools,single] [TRL=1] [WORK=/tmp/tool-learning] \
#         bash hack/gpu/tool-learning.sh
# TRL=1 adds TRL's GRPOTrainer with the same tool from the same checkpoint (a staging with TRL). WORK keeps the
# checkpoints and runs on the machine, so a comparison that does not fit the device's 600 s spreads over calls:
#     WORK=/tmp/tool-learning ARMS=tools bash hack/gpu/tool-learning.sh          # the checkpoints, the tools arm
#     WORK=/tmp/tool-learning ARMS=tools TRL=1 bash hack/gpu/tool-learning.sh    # TRL from the same checkpoint
# Leaves tool_learning_<gpu>.json (every run so far), run.log and nvidia-smi.txt in $OUT.
set -u
SITE=${SITE:-/tmp/site-0.31.0}
. benchmarks/gpu_env.sh $SITE
one_gpu_call $SITE $OUT
python3 benchmarks/tool_learning.py --out $OUT --seeds ${SEEDS:-0} --grpo-steps ${STEPS:-20} --prompts 32 \
    --arms ${ARMS:-tools,single} ${TRL:+--trl-python python3} ${WORK:+--work $WORK} \
    --run-timeout ${RUN_TIMEOUT:-400} > $OUT/run.log 2>&1
echo "exit $?"
grep -v "Writing\|Loading" $OUT/run.log | tail -40
