#!/bin/bash
# The runtime's whole GRPO loop beside TRL's GRPOTrainer on the same GPU at a realistic size
# (benchmarks/trl_peer.py --gpu): Qwen3-1.7B shape (random weights, bfloat16), 512-token prompts, 16 prompts x 8
# samples of up to MAX_TOKENS tokens, both sides colocated with the engine sleeping between rollouts, gradient
# checkpointing and the same vLLM memory share; ours with CUDA graphs in the engine and trainer.compile, TRL with
# its defaults otherwise (vLLM's CUDA graphs, its fused log-prob head). One round per call by default, the order
# given by ORDER (ours-first | peers-first), so successive calls interleave.
#
# On nvidia-h100-x1 after staging vLLM 0.31.0 + trl 1.16.0 (TRL 1.16 supports vLLM 0.22-0.31):
#     python3 hack/gpu-stage.py --vllm 0.31.0 --with trl==1.16.0 --image-packages hack/gpu/image-freeze.txt \
#         --skip nvidia-cudnn-cu13 --skip nvidia-cublas --skip nvidia-cusparselt-cu13 --out .stage/vllm-0.31.0-trl \
#         --kind nvidia-h100-x1 --print-commands
# then, from the repository root, one device call per round (the first after the install, in the same call):
#     ORDER=ours-first bash hack/gpu/loop-vs-trl.sh      # then ORDER=peers-first, ...
# RUN_TIMEOUT (default 280): seconds a side may run; on a fresh machine (empty compile caches) each side's first run
# needs more than 190 s. Leaves trl_peer.json, run.log, nvidia-smi.txt and the runs' logs (logs.tgz) in $OUT.
set -u
. benchmarks/gpu_env.sh /tmp/site-0.31.0
one_gpu_call /tmp/site-0.31.0 $OUT
python3 benchmarks/trl_peer.py --trl-python python3 --gpu qwen3-1.7b --kind "$(head -1 $OUT/nvidia-smi.txt)" \
    --out $OUT/trl_peer.json --rounds ${ROUNDS:-1} --order ${ORDER:-ours-first} --steps ${STEPS:-4} --warmup 1 \
    --prompts 64 --prompts-per-step 16 --samples-per-prompt 8 --prompt-tokens 512 --max-tokens ${MAX_TOKENS:-1024} \
    --learning-rate 1e-6 --micro-batch ${MICRO:-16} --gpu-memory-utilization ${UTIL:-0.55} --sleep \
    --gradient-checkpointing --compile --cuda-graphs --timeout ${RUN_TIMEOUT:-280} > $OUT/run.log 2>&1
echo "exit $?"
tail -c 4000 $OUT/run.log
tar czf $OUT/logs.tgz -C /tmp --exclude model $(cd /tmp && ls -d rlhf-trl-peer-*)
