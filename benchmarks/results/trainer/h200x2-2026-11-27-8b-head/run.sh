#!/bin/bash
# Issue 32: the output layer's backward before (a4aed6a~1: each chunk checkpointed) and after (a4aed6a:
# roles.batches._HeadScores) at the Qwen3-8B shape, FSDP2 over 2 GPUs, compiled, checkpointing off, 4k budget,
# interleaved (new, old, new, old while the call has time). Run from the repository root on nvidia-h200-x2 with
# .stage/pyd (pydantic's wheels) and .stage/oldhead (git archive a4aed6a~1 operator) carried; leaves one tarball.
set -u
T0=$(date +%s); LIMIT=${LIMIT:-300}; left() { echo $(( LIMIT - ($(date +%s) - T0) )); }
R=/tmp/head8b; mkdir -p $R
pip install -q --no-deps --no-index --target /tmp/pyd .stage/pyd/*.whl
export PYTHONPATH=/tmp/pyd PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
nvidia-smi > $R/nvidia-smi.txt
python -c "import torch, transformers; print(torch.__version__, transformers.__version__)" > $R/versions.txt
run() {  # name, operator checkout, minimum seconds left
  local name=$1 op=$2 need=$3
  if [ "$(left)" -lt "$need" ]; then echo "SKIP $name: $(left) s left" >> $R/order.txt; return; fi
  echo "$(date +%T) $name" >> $R/order.txt
  TRAIN_STEP_OPERATOR=$op timeout $(( $(left) - 3 )) python benchmarks/train_step.py --model qwen3-8b --world 2 \
      --lengths 4096 --budget 4096 --repeats 3 --skip-mix --compile-layers --no-checkpointing --model-dir /tmp/m8b \
      --out $R/$name.json > $R/$name.log 2>&1
  echo "$(date +%T) $name exit $?" >> $R/order.txt
}
run new1 $PWD/operator 150
run old1 $PWD/.stage/oldhead/operator 80
run new2 $PWD/operator 80
run old2 $PWD/.stage/oldhead/operator 80
echo "done at $(( $(date +%s) - T0 )) s" >> $R/order.txt
tar czf $OUT/head8b.tgz -C $R . ; cat $R/order.txt
