#!/bin/bash
# Issue 33's 4-GPU runs that are still open, one device call per part, on nvidia-h200-x4 after staging vLLM 0.33
# (python3 hack/gpu-stage.py --vllm 0.33.0 --image-packages hack/gpu/image-freeze.txt --kind nvidia-h200-x4, the
#  part size computed from the working tree, then --print-commands: ~55 calls back to back, the last one installs;
#  2-GPU parts: --kind nvidia-h200-x2 and KIND=nvidia-h200-x2). Usage, from the repository root:
#     bash hack/gpu/issue33-x4.sh PART   # moe-build then moe | tp2-8b | ipc-8b | ipc-8b-tp2 | rendered | dp | nccl-1.7b
#                                        | nccl-arms
# Each part stays inside one call (570 s) and leaves ONE file in $OUT (part-<PART>.tgz): a call returns at most
# 8 files. Parts run on the same warm machine reuse what an earlier part built there (models under /tmp).
#   moe-build: the 30B model alone (built on GPU0, written in 2 shards: 77 s on 2026-11-27) and its floor, for
#             the moe part's call right after it on the same machine: in one call with the rest it did not fit
#             (the build, the rank-0 load of 3 min and the validation's full gather ran past the call's limit).
#             Since then rank 0 loads the bfloat16 file as it is (f9db669), the validation copy is gathered and
#             cast on the GPUs (f3ca633) and the four fresh EP engines read the one staged directory (300cc06).
#   moe:      item 2, Qwen3-30B-A3B at full size (48 layers, 128 experts, 30.5 B parameters) in the
#             rlhf_ipc_fsdp_ep seed's layout: FSDP2 x4 colocated with DP=4 expert-parallel engines, IPC; sync time
#             and its stages, rollout tokens/s, one GRPO step (its out-of-memory error, if any, is the result).
#             Ran 2026-11-27 19:30 (499 s after moe-build's 111 s): validated, sync 1.148 s median of 5; the step
#             ran out of memory in its forward (16k-token micro-batches, no checkpointing). The layout now trains
#             with gradient checkpointing and 4k-token micro-batches: the next run's step is the open question.
#   tp2-8b:   (ran 2026-11-27 15:47, benchmarks/README.md) item 1 at the Qwen3-8B shape, the rlhf_nccl
#             seed's layout: trainer GPU0 + one TP=2 engine on GPUs 1-2, NCCL in the kernel format, beside the
#             raw broadcast of the same bytes (16.38 GB) to 2 GPUs.
#   rendered: item 6, the operator's rendered RayJob on this host for the seed's layout (trainer pod x1 GPU +
#             one TP=2 engine pod) and a 4-GPU one (FSDP2 x2 trainer pod + two engine pods), Qwen3-1.7B shape.
#   ipc-8b:   item 3's two colocated 8B layouts not yet run (2 of the 4 GPUs; also runs on nvidia-h200-x2):
#             FSDP2 x2 + two TP=1 engines over IPC (its first run failed at the first sync on vLLM's IPC buffer,
#             sized since 769b0e3 to the largest tensor), then FSDP2 x2 + one TP=2 engine, kernel format (each
#             trainer rank sends its GPU's TP shard), the second only while 200 s are left.
#   ipc-8b-tp2: ipc-8b's second layout alone (its hang, below): DETAIL=1 with torch's collective checks,
#             EXCHANGE=gloo with the IPC handles exchanged over gloo; native stacks at the limit with .stage/pyspy.
#   dp:       item 4, DP scaling with the rounds the first runs lacked: trainer GPU0 + 3 TP=1 engines, k = 1..3
#             engines interleaved over 5 rounds (scaling_order), each rollout saved as it ends (a cut call keeps
#             the rounds done). Since 2026-11-28 weak scaling: k x 128 prompts x 8 samples x up to 256 tokens on
#             the first k engines (the one batch split, strong scaling, measured vLLM's batch-size curve: 0.49x).
#             A random-weight model samples to the limit: ~262k tokens per engine, ~15 s a rollout.
# Left after 2026-11-27 19:48 (moe validated, tp2-8b done): moe (its step, now with checkpointing), dp, ipc-8b,
# rendered. One session's 1,800 s hold staging (~400 s) + moe-build + moe + dp (~1,100 s); ipc-8b and rendered
# (~900 s) need another.
# 2026-11-27 23:00 (4-GPU kinds no longer lent; on nvidia-h200-x2, the same gpu_sync command with --kind
# nvidia-h200-x2): ipc-8b's first layout validated (714.6 ms a sync) and its step ran out of memory (checkpointing
# was off: gpu_sync.MODEL_TRAINER turns it on for qwen3-8b since); the TP=2 layout validated at its first sync and
# hung at the next (benchmarks/README.md, sixth session). Left: moe (with MOE_ARGS=--skip-validation, the fused
# optimiser since 4ef234b), dp, rendered, and ipc-8b again (its step; the TP=2 hang).
# 2026-11-28 (4xH200, seventh session): moe ran whole with --skip-validation (the 30B GRPO step fits: 113.8 GiB
# peak; 11.6 s), ipc-8b-tp2 did not hang under TORCH_DISTRIBUTED_DEBUG=DETAIL (6 syncs; cut by its limit in the
# greedy check after them), dp gave 0.63x / 0.49x linear with the one batch split (strong scaling). Left: dp as
# weak scaling (below), rendered, ipc-8b-tp2 without DETAIL (does it hang again?), ipc-8b's first layout's step.
# 2026-11-28 (2xH200, eighth session): ipc-8b-tp2 (nccl, no checks) ran whole: 7 syncs after sleep/wake, 517.9 ms,
# the step 10.48 s; ipc-8b's first layout's step fits with checkpointing (10.74 s, 61.1 GiB). EXCHANGE=gloo not run
# (the machine went back while idle). Left: EXCHANGE=gloo, dp (weak scaling), rendered.
# 2026-11-28 (4xH200, ninth session): rendered ran both layouts in the install's call (T0=<call start>
# LAYOUTS="separate-nccl-fsdp2-dp2 separate-nccl-tp2"): (d) 4/4 steps, validated, sync 277 ms (310 per-tensor
# FSDP2 gathers: bucketed since a871e45); the TP=2 seed layout validated and was cut after step 1 (its engine's
# first start compiled FlashInfer's all-reduce for 91 s). The machine went back before dp. Next 4-GPU session:
# the install's call with LAYOUTS=separate-nccl-fsdp2-dp2 (the bucketed gather), then a call with
# LAYOUTS="separate-nccl-tp2-custom-ar separate-nccl-tp2" (custom all-reduce first, on the cold cache), then dp.
# 2026-11-28 (4xH200, tenth session): rendered (d) with the bucketed gather (sync 32-41 ms, was 277-287), dp as weak
# scaling (0.98x linear at 3 engines), ipc-8b (381 / 309 ms, was 797 / 518 on 2xH200). The TP=2 rendered layouts
# failed at `ray start` (InvalidAuthToken: dp's ray.init() had left ~/.ray/auth_token; fixed in rendered_cluster.py
# since 882a9f9). Left: LAYOUTS="separate-nccl-tp2-custom-ar separate-nccl-tp2" rendered, ipc-8b-tp2 EXCHANGE=gloo.
# 2026-11-29 (one H200 lent; nothing here ran): nccl-1.7b added, the default packed NCCL sync at 1.7B against
# weightSync.packed false, alternated run by run (2 GPUs suffice: KIND=nvidia-h200-x2). Left: nccl-1.7b, rendered with
# LAYOUTS="separate-nccl-tp2-custom-ar separate-nccl-tp2", ipc-8b-tp2 with EXCHANGE=gloo.
# 2026-11-29 (third session, one H200 lent; nothing here ran): weightSync.packed false in the kernel format is now
# the direct NCCL sync (weight_sync.direct), so nccl-1.7b measures it against the packed default; PAIR for TP=2.
# 2026-11-29 (fourth session, 2xH200; 4xH200 lent only after this session's device time was spent): nccl-1.7b ran
# at 1.7B twice (packed and direct alternated, 7 runs) and at 8B once (3 runs): direct faster at both (15.4 vs 16.7
# ms; 49.6 vs 54.2), now the default from one trainer GPU at TP=1 (the default PAIR: "separate-nccl-packed
# separate-nccl"). Built after: the direct sync into TP > 1 engines receives each worker's pieces straight into
# its parameters, the direct sync's timeline, and packed / direct as gpu_sync variants alternated inside one run (nccl-arms). Next
# 2-GPU session: nccl-arms chained after the install (1.7B and 8B: packed vs direct, the one-call round and the
# direct wire's options (fused, packs, 256 MiB groups; built 2026-11-29, fifth session, CPU-tested only),
# interleaved, with timelines: where the 1.7B's fixed ~4.9 ms go and which option cuts them). Next 4-GPU session: LAYOUT=separate-nccl-tp2
# VARIANTS=direct-sync,kernel-format-one-rpc nccl-arms, LAYOUT=separate-nccl-fsdp2-dp2 VARIANTS=direct-sync
# MODELS=qwen3-1.7b nccl-arms (the direct sync from an FSDP2 trainer, still packed by default there), rendered
# with LAYOUTS="separate-nccl-tp2-custom-ar separate-nccl-tp2", ipc-8b-tp2 with EXCHANGE=gloo.
set -u
part=${1:?part: moe-build | moe | tp2-8b | ipc-8b | ipc-8b-tp2 | rendered | dp | nccl-1.7b | nccl-arms}
KIND=${KIND:-nvidia-h200-x4}   # the device kind recorded in the results (ipc-8b and ipc-8b-tp2 run on 2 GPUs too)
T0=${T0:-$(date +%s)}   # T0=<the call's start> when something ran before this part in the same call
left() { echo $(( 560 - ($(date +%s) - T0) )); }
. benchmarks/gpu_env.sh /tmp/site-0.33.0
set -o pipefail
R=/tmp/issue33-$part
mkdir -p $R
nvidia-smi > $R/nvidia-smi.txt
case $part in
  moe-build)
    python3 benchmarks/gpu_sync.py --kind $KIND --out $R --work /tmp/rlhf-gpu-bench --build-only \
        --timeout $(( $(left) - 15 )) colocated-ipc-fsdp4-ep4:qwen3-30b-a3b > $R/driver.log 2>&1
    ;;
  moe)
    # validated on 2026-11-27 (fifth session): $MOE_ARGS=--skip-validation leaves the call's time to the step
    python3 benchmarks/gpu_sync.py --kind $KIND --out $R --work /tmp/rlhf-gpu-bench --syncs 5 --no-variants \
        ${MOE_ARGS:-} --timeout $(( $(left) - 15 )) colocated-ipc-fsdp4-ep4:qwen3-30b-a3b > $R/driver.log 2>&1
    ;;
  tp2-8b)
    python3 -c "import sys,json;sys.path.insert(0,'benchmarks');from gpu_sync import nccl_floor;print(json.dumps([{k:v \
for k,v in nccl_floor(16381470720,1<<30,w).items() if k!='samples'} for w in (2,3)]))" > $R/floor_8b.txt 2>&1
    python3 benchmarks/gpu_sync.py --kind $KIND --out $R --work /tmp/rlhf-gpu-bench --syncs 5 \
        --variants checkpoint-format,kernel-format-pipelined-rpc,kernel-format-one-rpc --timeout $(( $(left) - 15 )) \
        separate-nccl-tp2-kernel:qwen3-8b > $R/driver.log 2>&1
    ;;
  ipc-8b)
    python3 benchmarks/gpu_sync.py --kind $KIND --out $R --work /tmp/rlhf-gpu-bench --syncs 5 --no-variants \
        --timeout 330 --deadline $(( $(left) - 15 )) colocated-ipc-fsdp2:qwen3-8b \
        colocated-ipc-fsdp2-tp2-kernel:qwen3-8b > $R/driver.log 2>&1
    ;;
  ipc-8b-tp2)
    # FSDP2 x2 + one TP=2 engine at 8B hung at its second sync, the first after the engine's sleep and wake
    # (2026-11-27, sixth session: both trainer ranks in vLLM's _all_gather_and_merge_handles, one at the data
    # all_gather, one waiting on the sizes'); under TORCH_DISTRIBUTED_DEBUG=DETAIL (DETAIL=1 here) it ran all six
    # syncs (2026-11-28). With the py-spy wheel carried (.stage/pyspy: pip download py-spy), a run past its limit
    # also leaves the native stacks of every Ray process, vLLM's engine workers too (gpu_sync.py --py-spy).
    spy=()
    if ls .stage/pyspy/*.whl >/dev/null 2>&1; then
      python3 -m pip install -q --no-index --no-deps --target /tmp/pyspy .stage/pyspy/*.whl && spy=(--py-spy /tmp/pyspy/bin/py-spy)
    fi
    # EXCHANGE=gloo: the trainer ranks exchange the IPC handles over gloo (weight_sync.ipc_exchange), the candidate
    # fix; the default (nccl) is vLLM's own exchange, the one that hung
    debug=(); [ "${DETAIL:-0}" = 1 ] && debug=(TORCH_DISTRIBUTED_DEBUG=DETAIL)
    env "${debug[@]}" NCCL_DEBUG=WARN python3 benchmarks/gpu_sync.py --kind $KIND --out $R \
        --work /tmp/rlhf-gpu-bench --syncs 5 --no-variants "${spy[@]}" \
        --sender-options "{\"ipc_exchange\": \"${EXCHANGE:-nccl}\"}" \
        --timeout ${TP2_LIMIT:-$(( $(left) - 15 ))} colocated-ipc-fsdp2-tp2-kernel:qwen3-8b > $R/driver.log 2>&1
    ;;
  dp)
    # weak scaling (2026-11-28: the one batch split over k engines gave 0.63x / 0.49x linear at 2 / 3 engines,
    # each engine's decoding batch shrinking from 1,024 sequences to 341): 128 prompts per engine at every k
    python3 benchmarks/gpu_sync.py --kind $KIND --out $R --work /tmp/rlhf-gpu-bench --syncs 3 --no-variants \
        --skip-validation --prompts 128 --max-tokens 256 --scaling-per-engine 128 --scaling-rounds 5 \
        --timeout $(( $(left) - 15 )) separate-nccl-dp3:qwen3-1.7b > $R/driver.log 2>&1
    ;;
  nccl-1.7b)
    # item 1 at 1.7B (target 75% of the raw broadcast): vLLM's packed path (the trainer fuses and packs, the
    # engine unpacks) against the direct sync (weight_sync.direct: straight into the engine's parameters, one NCCL
    # group per bucket), alternated run by run (the setting is fixed when the weight-sync group starts), two runs
    # each while the call's time lasts. Ran 2026-11-29 on 2xH200 (direct faster at 1.7B and 8B: since then the
    # default at TP=1, so the default pair names packed explicitly). PAIR: the two layouts (default
    # "separate-nccl-packed separate-nccl", 2 GPUs; TP=2 on 4 GPUs: PAIR="separate-nccl-tp2
    # separate-nccl-tp2-unpacked", TP=2 staying packed by default); MODEL (default qwen3-1.7b; qwen3-8b too);
    # VARIANTS: gpu_sync variants timed interleaved with each run's default after its 5 syncs (e.g.
    # VARIANTS=kernel-format-one-rpc: one engine call per sync), none by default. Every direct sync records its
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
    # item 1 again, the variants alternated turn by turn INSIDE one run (same engine, same floor): gpu_sync's
    # packed-sync / direct-sync variants (weightSync.packed; a switch re-creates the weight-sync group),
    # kernel-format-one-rpc (one engine call per sync), the direct wire's options direct-fused / direct-packs /
    # direct-fused-packs (a fused parameter as one broadcast, the norms in packs: fewer broadcasts) and
    # direct-256mb (groups of 256 MiB, a new group), 5 interleaved rounds after the default's 5 syncs, every
    # direct sync with its timeline. One run per model of MODELS (default "qwen3-1.7b qwen3-8b"); LAYOUT (default
    # separate-nccl: direct by default, so VARIANTS default everything but direct-sync; TP=2 on 3-4 GPUs:
    # LAYOUT=separate-nccl-tp2 VARIANTS=direct-sync,kernel-format-one-rpc, packed by default there; the wire
    # options apply to TP=1 engines only).
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
          --variants ${VARIANTS:-packed-sync,kernel-format-one-rpc,direct-fused,direct-packs,direct-fused-packs,direct-256mb} \
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
