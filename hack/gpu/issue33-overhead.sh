#!/bin/bash
# Issue 33 item 7 on one GPU: the runtime's rollout against a bare `vllm.LLM` on the same batch, interleaved
# (benchmarks/rollout_overhead.py), on nvidia-h200 after staging vLLM 0.33 (python3 hack/gpu-stage.py --vllm 0.33.0
# --image-packages hack/gpu/image-freeze.txt --kind nvidia-h200 --part-mib 54 --print-commands: 51 calls back to
# back, the last one installs). Usage, from the repository root, one part per device call:
#     T0=<the call's start, Unix seconds> [LIMIT=560] [WAYS=...] bash hack/gpu/issue33-overhead.sh PART  # 8b | 1.7b
# (WAYS: the part's other ways instead of its own, e.g. WAYS=bare_default for the most rounds of the comparison)
# Both parts: layout colocated-ipc-resident (trainer and engine on the one GPU, the engine awake), CUDA graphs (the
# API's default), the benchmark's batch (64 prompts x 8 samples x 128 tokens, temperature 1), rounds until
# T0 + LIMIT - 45 s (the rest for the teardown and the results), every bare engine compiling its own model.
#   8b:   the Qwen3-8B shape (host-bound too at this batch, 2026-11-29): ways runtime, in_actor, bare_default
#         (vLLM as a user builds it: its engine core in a process of its own); the trainer without float32
#         masters (a rollout does not use them) so that the engine and the bare one both get 0.3 of the GPU: the
#         same KV cache.
#   1.7b: the Qwen3-1.7B shape of every earlier table (CPU-bound: one engine thread): ways runtime, in_actor,
#         bare (the runtime's engine settings in a plain process), bare_default; every engine at 0.2 of the GPU.
# Writes $OUT/overhead-PART.json and $OUT/overhead-PART.log.gz. Ran 2026-11-29 on one H200 (benchmarks/README.md,
# "2026-11-29 (one H200): issue 33 item 7"): 8b 16 rounds, 1.7b 9 (and 13 of runtime vs bare_default alone, the
# python command there; WAYS=bare_default runs the same); every
# engine's compile before the rounds takes 60-120 s, so a call holds 10-16 rounds of three or four ways.
set -u
part=${1:?usage: T0=... bash hack/gpu/issue33-overhead.sh 8b|1.7b}
T0=${T0:-$(date +%s)}
LIMIT=${LIMIT:-560}
. benchmarks/gpu_env.sh /tmp/site-0.33.0
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
rm -f /tmp/ray/ray_current_cluster
case $part in
  8b) args=(--model qwen3-8b --ways ${WAYS:-in_actor,bare_default} --bare-memory 0.3
            --spec-json '{"trainer": {"masterWeights": "none"}}') ;;
  1.7b) args=(--model qwen3-1.7b --ways ${WAYS:-in_actor,bare,bare_default} --bare-memory 0.2
              --spec-json '{"rollout": {"gpuMemoryUtilization": 0.2}}') ;;
  *) echo "unknown part $part" >&2; exit 2 ;;
esac
left=$((T0 + LIMIT - $(date +%s)))
echo "part $part: $left s left in the call"
timeout -k 10 $((left - 10)) python3 benchmarks/rollout_overhead.py --kind nvidia-h200 \
    --layout colocated-ipc-resident --graphs --rounds 1000 --until $((T0 + LIMIT - 45)) --timeout 300 \
    "${args[@]}" --out "$OUT/overhead-$part.json" > /tmp/overhead-$part.log 2>&1
echo "exit $?"
grep -E "^(round|median|engines|vs_vllm|overhead|driver|actor|engine_settings|noise)" /tmp/overhead-$part.log \
    | cut -c1-600 | tail -40
gzip -c /tmp/overhead-$part.log > "$OUT/overhead-$part.log.gz"
tail -5 /tmp/overhead-$part.log | cut -c1-400
