#!/bin/bash
# The weight-sync layouts that need 2-4 GPUs (benchmarks/gpu_sync.py, and benchmarks/rendered_cluster.py for the
# rendered RayJob), one part per device call, on a machine with vLLM 0.33 staged (python3 hack/gpu-stage.py
# --vllm 0.33.0 --image-packages hack/gpu/image-freeze.txt --kind nvidia-h200-x4 --print-commands: the calls to
# make, the last one installs; for 2-GPU parts --kind nvidia-h200-x2 and KIND=nvidia-h200-x2). From the repository
# root:
#     bash hack/gpu/multi-gpu-layouts.sh PART   # moe-build then moe | tp2-8b | ipc-8b | ipc-8b-tp2 | rendered | dp
#                                               # | nccl-1.7b | nccl-arms
# Each part stays inside one call (570 s) and leaves one file in $OUT (part-<PART>.tgz): a call returns at most
# 8 files. Parts run on the same warm machine reuse what an earlier part built there (models under /tmp).
#   moe-build:  Qwen3-30B-A3B at full size built on GPU0 and written, and its copy floor: a call of its own, so
#               that the moe part's call has its time for the syncs and the step.
#   moe:        Qwen3-30B-A3B (48 layers, 128 experts) in the rlhf_ipc_fsdp_ep seed's layout: FSDP2 x4 colocated
#               with DP=4 expert-parallel engines over IPC; the sync and its stages, rollout tokens/s, one GRPO step
#               (MOE_ARGS=--skip-validation leaves the call's time to the step).
#   tp2-8b:     the rlhf_nccl seed's layout at the Qwen3-8B shape: trainer GPU0 + one TP=2 engine on GPUs 1-2, NCCL
#               in the kernel format, beside the raw broadcast of the same bytes (16.38 GB) to 2 GPUs.
#   ipc-8b:     FSDP2 x2 colocated with two TP=1 engines over IPC at the Qwen3-8B shape, then with one TP=2 engine
#               (each trainer rank sends its GPU's TP shard); runs on 2 GPUs too.
#   ipc-8b-tp2: ipc-8b's second layout alone: DETAIL=1 runs it under torch's collective checks; native stacks at
#               the limit with .stage/pyspy.
#   dp:         DP scaling: trainer GPU0 + 3 TP=1 engines, k = 1..3 engines interleaved over 5 rounds, 128 prompts
#               x 8 samples x up to 256 tokens per engine (weak scaling), each rollout saved as it ends.
#   nccl-1.7b:  the packed NCCL sync against the direct one (weightSync.packed), alternated run by run (PAIR).
#   nccl-arms:  the same and 256 MiB groups as gpu_sync variants, alternated inside one run (MODELS).
#   rendered:   the operator's rendered RayJob on this host (benchmarks/rendered_cluster.py) for LAYOUTS.
set -u
part=${1:?part: moe-build | moe | tp2-8b | ipc-8b | ipc-8b-tp2 | rendered | dp | nccl-1.7b | nccl-arms}
KIND=${KIND:-nvidia-h200-x4}   # the device kind recorded in the results (ipc-8b and ipc-8b-tp2 run on 2 GPUs too)
T0=${T0:-$(date +%s)}   # T0=<the call's start> when something ran before this part in the same call
left() { echo $(( 560 - ($(date +%s) - T0) )); }
. benchmarks/gpu_env.sh /tmp/site-0.33.0
clear_device
set -o pipefail
R=/tmp/gpu-layouts-$part
mkdir -p $R
nvidia-smi > $R/nvidia-smi.txt
case $part in
  moe-build)
    python3 benchmarks/gpu_sync.py --kind $KIND --out $R --work /tmp/rlhf-gpu-bench --build-only \
        --timeout $(( $(left) - 15 )) colocated-ipc-fsdp4-ep4:qwen3-30b-a3b > $R/driver.log 2>&1
    ;;
  moe)
    # MOE_ARGS=--skip-validation leaves the call's time to the step
    python3 benchmarks/gpu_sync.py --kind $KIND --out $R --work /tmp/rlhf-gpu-bench --syncs 5 --no-variants \
        ${MOE_ARGS:-} --timeout $(( $(left) - 15 )) colocated-ipc-fsdp4-ep4:qwen3-30b-a3b > $R/driver.log 2>&1
    ;;
  tp2-8b)
    python3 -c "import sys,json;sys.path.insert(0,'benchmarks');from gpu_sync import nccl_floor;print(json.dumps([{k:v \
for k,v in nccl_floor(16381470720,1<<30,w).items() if k!='samples'} for w in (2,3)]))" > $R/floor_8b.txt 2>&1
    python3 benchmarks/gpu_sync.py --kind $KIND --out $R --work /tmp/rlhf-gpu-bench --syncs 5 \
        --variants checkpoint-format --timeout $(( $(left) - 15 )) \
        separate-nccl-tp2-kernel:qwen3-8b > $R/driver.log 2>&1
    ;;
  ipc-8b)
    python3 benchmarks/gpu_sync.py --kind $KIND --out $R --work /tmp/rlhf-gpu-bench --syncs 5 --no-variants \
        --timeout 330 --deadline $(( $(left) - 15 )) colocated-ipc-fsdp2:qwen3-8b \
        colocated-ipc-fsdp2-tp2-kernel:qwen3-8b > $R/driver.log 2>&1
    ;;
  ipc-8b-tp2)
    # DETAIL=1: under TORCH_DISTRIBUTED_DEBUG=DETAIL (torch's collective checks). With the py-spy wheel carried
    # (.stage/pyspy: pip download py-spy), a run past its limit also leaves the native stacks of every Ray process,
    # vLLM's engine workers too (gpu_sync.py --py-spy).
    spy=()
    if ls .stage/pyspy/*.whl >/dev/null 2>&1; then
      python3 -m pip install -q --no-index --no-deps --target /tmp/pyspy .stage/pyspy/*.whl && spy=(--py-spy /tmp/pyspy/bin/py-spy)
    fi
    debug=(); [ "${DETAIL:-0}" = 1 ] && debug=(TORCH_DISTRIBUTED_DEBUG=DETAIL)
    env "${debug[@]}" NCCL_DEBUG=WARN python3 benchmarks/gpu_sync.py --kind $KIND --out $R \
        --work /tmp/rlhf-gpu-bench --syncs 5 --no-variants "${spy[@]}" \
        --timeout ${TP2_LIMIT:-$(( $(left) - 15 ))} colocated-ipc-fsdp2-tp2-kernel:qwen3-8b > $R/driver.log 2>&1
    ;;
  dp)
    # weak scaling: 128 prompts per engine at every k (one batch split over k engines measures vLLM's batch-size
    # curve instead: each engine's decoding batch shrinks)
    python3 benchmarks/gpu_sync.py --kind $KIND --out $R --work /tmp/rlhf-gpu-bench --syncs 3 --no-variants \
        --skip-validation --prompts 128 --max-tokens 256 --scaling-per-engine 128 --scaling-rounds 5 \
        --timeout $(( $(left) - 15 )) separate-nccl-dp3:qwen3-1.7b > $R/driver.log 2>&1
    ;;
  nccl-1.7b)
    # vLLM's packed path (the trainer fuses and packs, the engine unpacks) against the direct sync
    # (weight_sync.direct: straight into the engine's parameters, one NCCL group per bucket), alternated run by run
    # (the setting is fixed when the weight-sync group starts), two runs each while the call's time lasts. The
    # direct sync is the default at TP=1, so the default pair names packed explicitly. PAIR: the two layouts (default
    # "separate-nccl-packed separate-nccl", 2 GPUs; TP=2 on 4 GPUs: PAIR="separate-nccl-tp2
    # separate-nccl-tp2-unpacked", TP=2 staying packed by default); MODEL (default qwen3-1.7b; qwen3-8b too);
    # VARIANTS: gpu_sync variants timed interleaved with each run's default after its 5 syncs (e.g.
    # VARIANTS=direct-256mb), none by default. Every direct sync records its
    # timeline (gpu_sync.timeline_summary: the engine joining, the wire's GPU time, the tail).
    read -r first second <<< "${PAIR:-separate-nccl-packed separate-nccl}"
    for run in a1 b1 a2 b2; do
      [ "$(left)" -lt 110 ] && { echo "skip $run: $(left) s left" >> $R/order.txt; continue; }
      layout=$first; [ "${run:0:1}" = b ] && layout=$second
      echo "$(date +%T) $run $layout" >> $R/order.txt
      python3 benchmarks/gpu_sync.py --kind $KIND --out $R/$run --work /tmp/rlhf-gpu-bench --syncs 5 \
          ${VARIANTS:+--variants $VARIANTS} $([ -z "${VARIANTS:-}" ] && echo --no-variants) \
          --timeout $(( $(left) - 15 )) $layout:${MODEL:-qwen3-1.7b} > $R/$run.log 2>&1
      echo "$(date +%T) $run exit $?" >> $R/order.txt
    done
    ;;
  nccl-arms)
    # the variants alternated turn by turn INSIDE one run (same engine, same floor): gpu_sync's
    # packed-sync / direct-sync variants (weightSync.packed; a switch re-creates the weight-sync group) and
    # direct-256mb (groups of 256 MiB, a new group), 5 interleaved rounds after the default's 5 syncs, every
    # direct sync with its timeline. One run per model of MODELS (default "qwen3-1.7b qwen3-8b"); LAYOUT (default
    # separate-nccl: direct by default, so VARIANTS default everything but direct-sync; TP=2 on 3-4 GPUs:
    # LAYOUT=separate-nccl-tp2 VARIANTS=direct-sync, packed by default there).
    # Each model first its wire alone (benchmarks/wire_layouts.py: the same bytes as one tensor and as each wire
    # layout, PyNccl groups between two processes, no Ray or vLLM; ~30 s), unless WIRE=0.
    for model in ${MODELS:-qwen3-1.7b qwen3-8b}; do
      [ "$(left)" -lt 150 ] && { echo "skip $model: $(left) s left" >> $R/order.txt; continue; }
      if [ "${WIRE:-1}" = 1 ]; then
        echo "$(date +%T) wire $model" >> $R/order.txt
        timeout 120 python3 benchmarks/wire_layouts.py --model $model --rounds 20 --kind $KIND \
            --out $R/wire-$model.json > $R/wire-$model.log 2>&1
        echo "$(date +%T) wire $model exit $?" >> $R/order.txt
      fi
      echo "$(date +%T) $model" >> $R/order.txt
      python3 benchmarks/gpu_sync.py --kind $KIND --out $R/$model --work /tmp/rlhf-gpu-bench --syncs 5 \
          --variants ${VARIANTS:-packed-sync,direct-256mb} \
          --timeout $(( $(left) - 15 )) \
          ${LAYOUT:-separate-nccl}:$model > $R/$model.log 2>&1
      echo "$(date +%T) $model exit $?" >> $R/order.txt
    done
    ;;
  rendered)
    for layout in ${LAYOUTS:-separate-nccl-fsdp2-dp2 separate-nccl-tp2-custom-ar separate-nccl-tp2}; do
      [ "$(left)" -lt 150 ] && { echo "skip $layout: $(left) s left" >> $R/order.txt; continue; }
      echo "$(date +%T) $layout" >> $R/order.txt
      python3 benchmarks/rendered_cluster.py --kind $KIND --out $R --work /tmp/rlhf-rendered \
          --model qwen3-1.7b --steps 4 --timeout $(( $(left) - 30 )) $layout > $R/$layout.log 2>&1
      echo "$(date +%T) $layout exit $?" >> $R/order.txt
    done
    ;;
esac
echo "exit $? after $(( $(date +%s) - T0 )) s" >> $R/order.txt
tar czf $OUT/part-$part.tgz -C $R . && ls -la $OUT && tail -5 $R/order.txt
