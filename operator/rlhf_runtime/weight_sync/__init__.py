"""Trainer -> engines weight sync through vLLM's weight-transfer API, one interface for every supported vLLM.

Runs in the trainer process (rank 0 sends). ``make_sender(...)`` returns a ``Sender`` with ``send() -> dict``
(stage timings and bytes) whatever the installed vLLM. The package is split by responsibility:

* ``producers``: what is sent (``ParamSource``: the trainer's weights in the checkpoint format) and the
  runtime's own packers (``PackedProducer`` for NCCL, ``IPCBufferProducer`` for CUDA IPC) and
  ``ResidentExport`` (CUDA IPC: the engines map the trainer's parameters once and copy from them);
* ``formats``: checkpoint vs kernel format (``KernelPlan``, ``effective_format``) and the sender defaults;
* ``senders``: ``TrainerEngineSender`` (vLLM >= 0.28), ``RuntimeDrivenSender`` (vLLM 0.24), ``make_sender``;
* ``fanout``: ``EngineFanOut``, the control plane over the engine actors.

Every vLLM version difference they depend on lives in ``rlhf_runtime.vllm.compat``.
"""

from rlhf_runtime.weight_sync.fanout import EngineFanOut
from rlhf_runtime.weight_sync.formats import DEFAULT_OPTIONS, FORMATS, KernelPlan, effective_format
from rlhf_runtime.weight_sync.producers import (
    IPCBufferProducer,
    PackedProducer,
    ParamSource,
    ResidentExport,
    cuda_ipc_export,
)
from rlhf_runtime.weight_sync.senders import RuntimeDrivenSender, Sender, TrainerEngineSender, make_sender

__all__ = [
    "DEFAULT_OPTIONS",
    "FORMATS",
    "EngineFanOut",
    "IPCBufferProducer",
    "KernelPlan",
    "PackedProducer",
    "ParamSource",
    "ResidentExport",
    "RuntimeDrivenSender",
    "Sender",
    "TrainerEngineSender",
    "cuda_ipc_export",
    "effective_format",
    "make_sender",
]
