# Environment for benchmarks on the lent GPU machines. Source it from the repository root:
#     . benchmarks/gpu_env.sh [SITE]
# SITE: where `hack/gpu-stage.py`'s device commands installed vLLM, Ray and the torch they pin
# (default /tmp/site-0.33.0; the runtime supports vLLM >= 0.28).
# The device has the repository as a working tree, not installed: the project's vLLM plugin
# (pyproject's `vllm.general_plugins` entry point, which vLLM loads in every process it starts, Ray and
# multiprocessing workers of TP>1 engines included) is made visible by a dist-info folder with that entry
# point, which is what `pip install` would write. NVLink multicast stays off (the multi-GPU machines require it).
_site=${1:-/tmp/site-0.33.0}
_meta=/tmp/rlhf-entry-points/rlhf_operator-0.1.0.dist-info
mkdir -p "$_meta"
printf 'Metadata-Version: 2.1\nName: rlhf-operator\nVersion: 0.1.0\n' > "$_meta/METADATA"
sed -n '/^\[project.entry-points."vllm.general_plugins"\]/,/^$/p' pyproject.toml \
    | sed -e 's/^\[project.entry-points."\(.*\)"\]/[\1]/' -e 's/"//g' > "$_meta/entry_points.txt"
export PYTHONPATH=$_site:$PWD/operator:/tmp/rlhf-entry-points PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 \
       TRANSFORMERS_OFFLINE=1 VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_ENABLE_V1_MULTIPROCESSING=0 VLLM_NO_USAGE_STATS=1 \
       NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
unset _site _meta
# lean_staging SITE: a lean staging (hack/gpu-stage.py --skip nvidia-cudnn-cu13 ...) leaves cuDNN to the image, older
# than the one the staged torch is built against: torch's variable-length attention would ask cuDNN for its version
# and fail the trainer's first step. Take its FlashAttention path instead, and skip torch's cuDNN version check.
lean_staging() {
  local f=$1/torch/nn/attention/varlen.py
  [ -f "$f" ] && sed -i 's/^    cudnn_version = torch.backends.cudnn.version()$/    return False  # lean staging/' "$f"
  export PYTORCH_SKIP_CUDNN_COMPATIBILITY_CHECK=1
}
# clear_device: end what an earlier device call left running (a call stopped at its time limit leaves its Ray and
# benchmark processes holding GPU memory, and the next call's engines then find less free memory than they ask
# for), then wait up to 60 s for the GPUs to have no process. The device machine runs nothing else of ours; this
# shell and the ones that started it are spared (their command lines may name a benchmark too).
clear_device() {
  ray stop --force >/dev/null 2>&1
  local mine=" $$ " p=$$ pid
  while [ "${p:-1}" -gt 1 ]; do p=$(ps -o ppid= -p "$p" | tr -d ' '); mine="$mine$p "; done
  for pid in $(pgrep -f 'benchmarks/[a-z_]+\.py|rlhf_runtime\.driver'); do
    case "$mine" in *" $pid "*) ;; *) kill -9 "$pid" 2>/dev/null ;; esac
  done
  for _ in $(seq 60); do
    [ -z "$(nvidia-smi --query-compute-apps=pid --format=csv,noheader 2>/dev/null)" ] && return 0
    sleep 1
  done
  echo "clear_device: GPU processes still running after 60 s:" >&2
  nvidia-smi --query-compute-apps=pid,process_name,used_memory --format=csv,noheader >&2
}
# one_gpu_call SITE DIR: the start of a call that runs on a lean staging: clear_device, lean_staging SITE, and the
# GPU's name, memory and driver into DIR/nvidia-smi.txt (and on the output).
one_gpu_call() {
  clear_device
  lean_staging "$1"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$2/nvidia-smi.txt"
}
