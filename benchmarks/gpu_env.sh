# Environment for benchmarks on the lent GPU machines (vLLM 0.24 + Ray staged into /tmp/site as in
# ../shared/gpu/README.md). Source it from the repository root, then run benchmarks/gpu_sync.py.
# NVLink multicast stays off (the multi-GPU machines require it).
export PYTHONPATH=/tmp/site:$PWD/operator PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 \
       VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_ENABLE_V1_MULTIPROCESSING=0 VLLM_NO_USAGE_STATS=1 \
       NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
