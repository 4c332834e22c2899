#!/bin/bash
# Interleaved arms on one GPU (nvidia-h200), after staging vLLM 0.33 (python3 hack/gpu-stage.py --vllm 0.33.0
# --image-packages hack/gpu/image-freeze.txt --kind nvidia-h200 --print-commands: the last call installs; chain
# the first part after it):
#   ipc:     the resident colocated IPC sync (the default for one trainer GPU) beside vLLM's IPC trainer engine,
#            Qwen3-1.7B shape, interleaved over 10 rounds, the floor a device copy of the bytes sent
#            (gpu_sync.sent_bytes: the tied head once).
#   trainer: trainer.compile against eager (1k, 4k and 16k tokens per sequence, checkpointing on, 32k budget), then
#            the output layer's chunk of 2^27 against 2^29 logits, each in one process with the arms taking turns
#            (benchmarks/train_arms.py).
# Usage, from the repository root: T0=<call start> LIMIT=570 bash hack/gpu/one-gpu-arms.sh ipc|trainer
# Each part leaves one file in $OUT (part-<PART>.tgz) and prints its summary.
set -u
part=${1:?part: ipc | trainer}
T0=${T0:-$(date +%s)}
LIMIT=${LIMIT:-570}
left() { echo $(( LIMIT - ($(date +%s) - T0) )); }
. benchmarks/gpu_env.sh /tmp/site-0.33.0
clear_device
R=/tmp/one-gpu-arms/$part
mkdir -p $R
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee $R/nvidia-smi.txt
case $part in
  ipc)
    python3 benchmarks/gpu_sync.py --kind nvidia-h200 --out $R --syncs 10 --timeout $(( $(left) - 20 )) \
        --deadline $(( $(left) - 15 )) --no-variants colocated-ipc-resident:qwen3-1.7b \
        > $R/run.log 2>&1
    echo "exit $?" | tee -a $R/run.log
    tail -4 $R/run.log | cut -c1-400
    ;;
  trainer)
    M=/tmp/rlhf-gpu-bench/colocated-ipc-resident_qwen3-1.7b/model   # the ipc part's model, if this machine ran it
    [ -f $M/info.json ] || M=/tmp/m17
    timeout $(( $(left) - 175 )) python3 benchmarks/train_arms.py --model qwen3-1.7b --model-dir $M \
        --lengths 1024,4096,16384 --budget 32768 --rounds 5 --repeats 2 --arms eager,compiled \
        --out $R/compile.json > $R/compile.log 2>&1
    echo "compile exit $? at $(( $(date +%s) - T0 )) s" | tee -a $R/order.txt
    timeout $(( $(left) - 15 )) python3 benchmarks/train_arms.py --model qwen3-1.7b --model-dir $M \
        --lengths 4096 --budget 16384 --no-checkpointing --rounds 5 --repeats 3 \
        --arms compiled+chunk=134217728,compiled+chunk=536870912 --out $R/chunk.json > $R/chunk.log 2>&1
    echo "chunk exit $? at $(( $(date +%s) - T0 )) s" | tee -a $R/order.txt
    grep -h '^{"length"' $R/compile.log $R/chunk.log | cut -c1-700
    ;;
  *) echo "unknown part $part" >&2; exit 2 ;;
esac
tar czf $OUT/part-$part.tgz -C $R .
