"""Trainer -> engines weight sync through vLLM's weight-transfer API (vLLM >= 0.28: its trainer-side engines).

``options`` (``WeightSyncOptions``, resolved once by the driver), ``senders`` (``TrainerEngineSender``, built from
them on every trainer rank), ``producers`` (what is sent; the resident IPC sync's trainer side), ``formats``
(checkpoint vs kernel format), ``fanout`` (the control plane over the engine actors), ``direct`` (the direct NCCL
sync); ``gloo`` (the CPU backend) and ``kernel`` (the kernel-format worker engines) are loaded by vLLM through the
plugin (``rlhf_runtime.vllm.plugin``). The names below load their module on first use, so the driver imports
``options`` without torch. Every vLLM version difference lives in ``rlhf_runtime.vllm.compat``.
"""

from __future__ import annotations

import importlib
from typing import Any

_WHERE = {
    "EngineFanOut": "fanout",
    "FORMATS": "options",
    "KernelPlan": "formats",
    "effective_format": "formats",
    "ParamSource": "producers",
    "ResidentExport": "producers",
    "cuda_ipc_export": "producers",
    "TrainerEngineSender": "senders",
    "make_sender": "senders",
    "WeightSyncOptions": "options",
    "resolve": "options",
}

__all__ = list(_WHERE)


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_WHERE[name]}"), name)
