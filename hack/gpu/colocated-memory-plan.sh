#!/bin/bash
# The colocated memory plan and the trainer-state offload through the runtime's own driver on one GPU
# (benchmarks/colocated_memory.py), after staging vLLM 0.33 with
#   python3 hack/gpu-stage.py --vllm 0.33.0 --image-packages hack/gpu/image-freeze.txt --skip nvidia-cudnn-cu13 \
#       --skip nvidia-cublas --skip nvidia-cusparselt-cu13 --out .stage/vllm-0.33.0-lean --kind nvidia-h100-x1
# and its device commands (the last one installs into /tmp/site-0.33.0).
# Usage, from the repository root: [RUN_TIMEOUT=seconds per driver run] [SITE=/tmp/site-0.31.0 for a 0.31.0 staging]
#     bash hack/gpu/colocated-memory-plan.sh VARIANT...
#   VARIANT: NAME:UTIL:OFFLOAD:MAX_TOKENS:STEPS[:FLAGS] (benchmarks/colocated_memory.py --variants)
# Leaves colocated_memory.json, run.log, nvidia-smi.txt and the drivers' logs and progress files (logs.tgz) in $OUT.
set -u
SITE=${SITE:-/tmp/site-0.33.0}
. benchmarks/gpu_env.sh $SITE
one_gpu_call $SITE $OUT  # lean_staging: the image's cuDNN 9.19; torch 2.14 is built against 9.24
python3 benchmarks/colocated_memory.py --out $OUT --run-timeout ${RUN_TIMEOUT:-540} --variants "$@" > $OUT/run.log 2>&1
echo "exit $?"
tail -c 6000 $OUT/run.log
tar czf $OUT/logs.tgz -C /tmp/colocated-memory --exclude model .
