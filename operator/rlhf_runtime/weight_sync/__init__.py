"""Trainer -> engines weight sync through vLLM's weight-transfer API (vLLM >= 0.28: its trainer-side engines).

Runs in the trainer process (rank 0 sends). ``make_sender(...)`` returns a ``Sender`` with ``send() -> dict``
(stage timings and bytes). The package is split by responsibility:

* ``producers``: what is sent (``ParamSource``: the trainer's weights in the checkpoint format) and
  ``ResidentExport`` (CUDA IPC: the engines map the trainer's parameters once and copy from them);
* ``formats``: checkpoint vs kernel format (``KernelPlan``, ``effective_format``);
* ``senders``: ``TrainerEngineSender`` (vLLM's trainer engine of the backend, plus the kernel format and the
  resident sync) and ``make_sender``;
* ``fanout``: ``EngineFanOut``, the control plane over the engine actors;
* ``ipc_exchange``: where several trainer ranks of an IPC sync exchange their buffers' handles (vLLM's NCCL
  exchange, or a gloo group: opt-in);
* ``gloo`` (the CPU backend, both sides) and ``kernel`` (the kernel-format worker engines), loaded by vLLM
  through the plugin (``rlhf_runtime.vllm.plugin``).

Every vLLM version difference they depend on lives in ``rlhf_runtime.vllm.compat``.
"""

from rlhf_runtime.weight_sync.fanout import EngineFanOut
from rlhf_runtime.weight_sync.formats import FORMATS, KernelPlan, effective_format
from rlhf_runtime.weight_sync.producers import ParamSource, ResidentExport, cuda_ipc_export
from rlhf_runtime.weight_sync.senders import Sender, TrainerEngineSender, make_sender

__all__ = [
    "FORMATS",
    "EngineFanOut",
    "KernelPlan",
    "ParamSource",
    "ResidentExport",
    "Sender",
    "TrainerEngineSender",
    "cuda_ipc_export",
    "effective_format",
    "make_sender",
]
