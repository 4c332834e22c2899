"""vLLM general plugin (entry point ``vllm.general_plugins: rlhf_gloo``).

vLLM calls ``register()`` in every process it starts (driver, engine core, Ray workers). It registers the
CPU ``gloo`` weight-transfer backend lazily, by module path, so nothing is imported unless a job selects
``WeightTransferConfig(backend="gloo")``; on a GPU image this costs one dict entry.
"""

from __future__ import annotations


def register() -> None:
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    if "gloo" not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(
            "gloo", "rlhf_runtime.gloo_transfer", "GlooWeightTransferEngine"
        )
    from rlhf_runtime import vllm_compat

    trainer_factory = vllm_compat.trainer_factory()
    if trainer_factory is None:  # vLLM 0.24: no trainer-side factory
        return
    if "gloo" not in trainer_factory._registry:
        trainer_factory.register_engine(
            "gloo", "rlhf_runtime.gloo_transfer", "GlooTrainerWeightTransferEngine"
        )
