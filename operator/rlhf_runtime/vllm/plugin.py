"""vLLM general plugin (entry point ``vllm.general_plugins: rlhf_gloo``).

vLLM calls ``register()`` in every process it starts (driver, engine core, Ray workers). It registers the
CPU ``gloo`` weight-transfer backend and, on vLLM >= 0.28, the kernel-format-capable ``rlhf_nccl``/``rlhf_ipc``
engines (``kernel_transfer``) lazily, by module path, so nothing is imported unless an engine selects one; on a
GPU image this costs three dict entries.
"""

from __future__ import annotations


def register() -> None:
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    if "gloo" not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(
            "gloo", "rlhf_runtime.weight_sync.gloo", "GlooWeightTransferEngine"
        )
    from rlhf_runtime.vllm import compat as vllm_compat

    trainer_factory = vllm_compat.trainer_factory()
    if trainer_factory is None:  # vLLM 0.24: no trainer-side factory (and the format is start's argument)
        return
    for name, cls in (("rlhf_nccl", "RlhfNCCLWeightTransferEngine"), ("rlhf_ipc", "RlhfIPCWeightTransferEngine")):
        if name not in WeightTransferEngineFactory._registry:
            WeightTransferEngineFactory.register_engine(name, "rlhf_runtime.weight_sync.kernel", cls)
    if "gloo" not in trainer_factory._registry:
        trainer_factory.register_engine(
            "gloo", "rlhf_runtime.weight_sync.gloo", "GlooTrainerWeightTransferEngine"
        )
