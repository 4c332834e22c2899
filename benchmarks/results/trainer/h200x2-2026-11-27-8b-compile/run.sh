#!/bin/bash
# Issue 32: trainer.compile on FSDP2 GPUs at the Qwen3-8B shape (2 GPUs), eager and compiled interleaved, then the
# 1.7B shape's best configuration with a larger micro-batch. Run from the repository root on nvidia-h200-x2 with
# .stage/pyd carried (pydantic's wheels); $OUT the device's output folder. Each command runs only while the call
# has time left for it (T0: the call's start).
set -u
T0=$(date +%s); left() { echo $(( 570 - ($(date +%s) - T0) )); }
pip install -q --no-deps --no-index --target /tmp/pyd .stage/pyd/*.whl
export PYTHONPATH=/tmp/pyd:$PWD/operator PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
nvidia-smi > $OUT/nvidia-smi.txt
python -c "import torch, transformers; print(torch.__version__, transformers.__version__)" > $OUT/versions.txt
M=/tmp/m8b
run() {  # name, minimum seconds left, arguments
  local name=$1 need=$2; shift 2
  if [ "$(left)" -lt "$need" ]; then echo "SKIP $name: $(left) s left" | tee -a $OUT/order.txt; return; fi
  echo "$(date +%T) $name" >> $OUT/order.txt
  timeout $(( $(left) - 5 )) python benchmarks/train_step.py "$@" --out $OUT/$name.json > $OUT/$name.log 2>&1
  echo "$(date +%T) $name exit $?" >> $OUT/order.txt
}
B8="--model qwen3-8b --world 2 --lengths 4096 --budget 16384 --repeats 3 --skip-mix --model-dir $M"
run 8b_eager_1 200 $B8
run 8b_compiled_1 120 $B8 --compile-layers
run 8b_eager_2 90 $B8
run 8b_compiled_2 90 $B8 --compile-layers
run 8b_compiled_nockpt_4k 90 --model qwen3-8b --world 2 --lengths 4096 --budget 4096 --repeats 3 --skip-mix \
    --model-dir $M --compile-layers --no-checkpointing
run 1.7b_compiled_nockpt_32k 80 --model qwen3-1.7b --lengths 4096 --budget 32768 --repeats 3 --skip-mix \
    --compile-layers --no-checkpointing
echo "done at $(( $(date +%s) - T0 )) s" >> $OUT/order.txt
