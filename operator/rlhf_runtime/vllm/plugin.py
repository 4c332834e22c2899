"""vLLM general plugin (entry point ``vllm.general_plugins: rlhf_gloo``).

vLLM calls ``register()`` in every process it starts (driver, engine core, Ray workers). It registers the
CPU ``gloo`` weight-transfer backend (both sides) and the kernel-format-capable ``rlhf_nccl``/``rlhf_ipc`` worker
engines (``weight_sync.kernel``) lazily, by module path, so nothing is imported unless an engine selects one; on a
GPU image this costs four dict entries.
"""

from __future__ import annotations


def register() -> None:
    from vllm.distributed.weight_transfer.factory import (
        WeightTransferEngineFactory,
        WeightTransferTrainerFactory,
    )

    if "gloo" not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(
            "gloo", "rlhf_runtime.weight_sync.gloo", "GlooWeightTransferEngine"
        )
    for name, cls in (("rlhf_nccl", "RlhfNCCLWeightTransferEngine"), ("rlhf_ipc", "RlhfIPCWeightTransferEngine")):
        if name not in WeightTransferEngineFactory._registry:
            WeightTransferEngineFactory.register_engine(name, "rlhf_runtime.weight_sync.kernel", cls)
    if "gloo" not in WeightTransferTrainerFactory._registry:
        WeightTransferTrainerFactory.register_engine(
            "gloo", "rlhf_runtime.weight_sync.gloo", "GlooTrainerWeightTransferEngine"
        )
