#!/bin/bash
# The runtime's rollout against a bare `vllm.LLM` on the same batch, interleaved (benchmarks/rollout_overhead.py), on
# one GPU (nvidia-h200) after staging vLLM 0.33 (python3 hack/gpu-stage.py --vllm 0.33.0 --image-packages
# hack/gpu/image-freeze.txt --kind nvidia-h200 --print-commands: the calls to make, the last one installs). Usage,
# from the repository root, one part per device call:
#     T0=<the call's start, Unix seconds> [LIMIT=560] [WAYS=...] [SITE=...] bash hack/gpu/rollout-overhead.sh PART
# (PART: 8b | 1.7b | 1.7b-4k; SITE: where the staging installed vLLM, default /tmp/site-0.33.0)
# (WAYS: the part's other ways instead of its own, e.g. WAYS=bare_default for the most rounds of that comparison)
# Every part: layout colocated-ipc-resident (trainer and engine on the one GPU, the engine awake), CUDA graphs (the
# API's default), the batch (64 prompts x 8 samples x 128 tokens, temperature 1, but 1.7b-4k's), rounds until
# T0 + LIMIT - 45 s (the rest for the teardown and the results), every bare engine compiling its own model.
#   8b:   the Qwen3-8B shape: ways runtime, in_actor, bare_default (vLLM as a user builds it: its engine core in a
#         process of its own); the trainer without float32 masters (a rollout does not use them) so that the
#         engine and the bare one both get 0.3 of the GPU: the same KV cache.
#   1.7b: the Qwen3-1.7B shape: ways runtime, in_actor, bare (the runtime's engine settings in a plain process:
#         the like-for-like comparison), bare_default; every engine at 0.2 of the GPU.
#   1.7b-4k: the same shape at the loop's lengths (16 prompts x 8 samples of up to 4,096 tokens): ways runtime and
#         bare, both engines at 0.25 of the GPU and the trainer without float32 masters (the same KV cache each:
#         the batch runs in waves where the share holds fewer than 128 sequences): minutes a round.
# Writes $OUT/overhead-PART.json and $OUT/overhead-PART.log.gz (the rounds so far where the run has not ended).
# Every engine's compile before the rounds takes 60-120 s, so a call holds 10-35 rounds. One run can last a whole
# session instead (one start, ~160 rounds at 8B in 1,450 s):
#     T0=<install call's start> LIMIT=575 BACKGROUND=1450 WAYS=bare_default bash hack/gpu/rollout-overhead.sh 8b
#     T0=<call start> LIMIT=575 WATCH=8b bash hack/gpu/rollout-overhead.sh watch   # each later call, back to back
# (the run is started in its own process session, which the device keeps while the machine is held; every call
# brings back the JSON as it stands, rewritten after each round).
set -u
part=${1:?usage: T0=... bash hack/gpu/rollout-overhead.sh 8b|1.7b|1.7b-4k|watch}
T0=${T0:-$(date +%s)}
LIMIT=${LIMIT:-560}
. benchmarks/gpu_env.sh ${SITE:-/tmp/site-0.33.0}
clear_device
rm -f /tmp/ray/ray_current_cluster
collect() {  # $1: the part; the run's JSON as it stands (complete or the rounds so far) and its log into $OUT
  cp /tmp/overhead-$1.json "$OUT/overhead-$1.json" 2>/dev/null || echo "no results yet"
  gzip -c /tmp/overhead-$1.log > "$OUT/overhead-$1.log.gz"
  grep -E "^(round|median|engines|vs_vllm|overhead|driver|actor|engine_settings|noise)" /tmp/overhead-$1.log \
      | cut -c1-300 | tail -${2:-40}
  [ -f /tmp/overhead-$1.rc ] && echo "exit $(cat /tmp/overhead-$1.rc)" || echo "still running"
}
wait_run() {  # $1: the part; until its run ends or this call's limit is 20 s away
  while [ ! -f /tmp/overhead-$1.rc ] && [ $(( T0 + LIMIT - 20 - $(date +%s) )) -gt 0 ]; do sleep 5; done
  collect "$1"
}
if [ "$part" = watch ]; then  # WATCH=8b|1.7b: a BACKGROUND run started by an earlier call on this machine
  wait_run "${WATCH:-8b}"
  exit 0
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
case $part in
  8b) args=(--model qwen3-8b --ways ${WAYS:-in_actor,bare_default} --bare-memory 0.3
            --spec-json '{"trainer": {"masterWeights": "none"}}') ;;
  1.7b) args=(--model qwen3-1.7b --ways ${WAYS:-in_actor,bare,bare_default} --bare-memory 0.2
              --spec-json '{"rollout": {"gpuMemoryUtilization": 0.2}}') ;;
  1.7b-4k) args=(--model qwen3-1.7b --ways ${WAYS:-bare} --bare-memory 0.25 --prompts 16 --max-tokens 4096
                 --spec-json '{"rollout": {"gpuMemoryUtilization": 0.25, "maxModelLen": 4160},
                             "trainer": {"masterWeights": "none"}}') ;;
  *) echo "unknown part $part" >&2; exit 2 ;;
esac
# BACKGROUND=<seconds after T0>: one run that outlives this call (its own process session), rounds until T0 +
# BACKGROUND - 45, its JSON rewritten after every round; later calls on the same warm machine run `watch` (back to
# back: the machine goes back ~30 s after a call ends). One start (~4.5 min at 8B) for the whole session.
end=$(( T0 + ${BACKGROUND:-$LIMIT} - 45 ))
rm -f /tmp/overhead-$part.rc /tmp/overhead-$part.json
echo "part $part: rounds until $(( end - $(date +%s) )) s from now"
kind=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
cmd=(python3 benchmarks/rollout_overhead.py --kind "$kind" --layout colocated-ipc-resident --graphs
     --rounds 1000 --until $end --timeout 300 --write-every-round "${args[@]}" --out /tmp/overhead-$part.json)
if [ -n "${BACKGROUND:-}" ]; then
  setsid bash -c 'timeout -k 10 $(( $1 + 35 - $(date +%s) )) "${@:3}" > /tmp/overhead-$2.log 2>&1; echo $? > /tmp/overhead-$2.rc' \
      _ $end $part "${cmd[@]}" < /dev/null &
  sleep 2
  wait_run $part
else
  timeout -k 10 $(( end + 35 - $(date +%s) )) "${cmd[@]}" > /tmp/overhead-$part.log 2>&1
  echo $? > /tmp/overhead-$part.rc
  collect $part
  tail -5 /tmp/overhead-$part.log | cut -c1-400
fi
