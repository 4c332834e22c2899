"""Trainer -> engines weight sync through vLLM's native weight-transfer API, one interface for two vLLMs.

Runs in the trainer process (rank 0 is the sender). ``make_sender(...)`` returns a ``Sender`` with
``send() -> dict`` (stage timings and bytes) whatever the installed vLLM:

* vLLM >= 0.28 (CPU CI: 0.32): the trainer-side ``TrainerWeightTransferEngine`` of the backend
  (``WeightTransferTrainerFactory.trainer_init(init_info, client=..., source=...)``) drives the round trip
  ``start_weight_update`` -> ``update_weights`` (concurrent with the broadcast) -> ``finish_weight_update``;
* vLLM 0.24 (GPU image): no trainer engine exists, so ``LegacySender`` drives the same round trip itself
  (``start_weight_update(is_checkpoint_format=True)`` is added by the engine actor, which checks the
  signature) and sends with ``NCCLWeightTransferEngine.trainer_send_weights`` / ``IPCWeightTransferEngine``.

The control plane is ``EngineFanOut``: a ``VLLMWeightSyncClient`` over the engines' Ray actors. It gives each
engine its own ``rank_offset`` (``1 + the world sizes of the engines before it``), because each engine is a
separate vLLM instance whose workers count ranks from 0, and it times every call.

Which tensors are sent (``ParamSource``): ``named_parameters(remove_duplicate=False)``, so a tied
``lm_head.weight`` goes out under its second name too (vLLM's layerwise reload would otherwise keep the
engine's old value), cast to the spec dtype; ``skip`` drops names on purpose (the validation debug option).
"""

from __future__ import annotations

import inspect
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch


def vllm_has_trainer_api() -> bool:
    try:
        from vllm.distributed.weight_transfer.base import TrainerWeightTransferEngine  # noqa: F401
    except ImportError:
        return False
    return True


class EngineFanOut:
    """``VLLMWeightSyncClient`` over engine actors (``rlhf_runtime.engines``), with per-engine rank offsets."""

    def __init__(self, handles: list[Any], worlds: list[int]) -> None:
        self.handles = handles
        self.worlds = worlds
        self.timings: dict[str, float] = {}

    def _all(self, method: str, args: list[tuple]) -> None:
        import ray

        t = time.perf_counter()
        ray.get([getattr(h, method).remote(*a) for h, a in zip(self.handles, args)])
        self.timings[method] = self.timings.get(method, 0.0) + time.perf_counter() - t

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        infos, offset = [], 1
        for w in self.worlds:
            info = dict(init_info)
            if "rank_offset" in info:
                info["rank_offset"] = offset
            infos.append((info,))
            offset += w
        self._all("init_weight_transfer_engine", infos)

    def start_weight_update(self) -> None:
        self._all("start_weight_update", [()] * len(self.handles))

    def update_weights(self, update_info: Any) -> None:
        self._all("update_weights", [(update_info,)] * len(self.handles))

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self._all("finish_weight_update", [()] * len(self.handles))


class ParamSource:
    """The trainer's weights as a re-iterable ``(name, tensor)`` stream with matching ``metadata()``."""

    def __init__(self, model: torch.nn.Module, dtype: torch.dtype, skip: set[str] | None = None) -> None:
        self.model = model
        self.dtype = dtype
        self.skip = skip or set()
        self.gather_s = 0.0
        self.bytes = 0

    def _named(self) -> list[tuple[str, torch.Tensor]]:
        return [(n, p) for n, p in self.model.named_parameters(remove_duplicate=False) if n not in self.skip]

    def metadata(self) -> list[Any]:
        from vllm.distributed.weight_transfer.base import ParamMeta

        return [ParamMeta(n, self.dtype, tuple(p.shape)) for n, p in self._named()]

    def legacy_metadata(self) -> tuple[list[str], list[str], list[list[int]]]:
        named = self._named()
        return [n for n, _ in named], [str(self.dtype).split(".")[-1]] * len(named), [list(p.shape) for _, p in named]

    def __iter__(self):
        self.gather_s, self.bytes = 0.0, 0
        for name, p in self._named():
            t = time.perf_counter()
            full = p.full_tensor() if callable(getattr(p, "full_tensor", None)) else p
            tensor = full.detach().to(self.dtype).contiguous()
            self.gather_s += time.perf_counter() - t
            self.bytes += tensor.numel() * tensor.element_size()
            yield name, tensor

    # vLLM >= 0.28 WeightSource extras (defaults copied in behaviour: one group per decoder layer).
    def held_names(self) -> None:
        return None

    def groups(self) -> list[list[str]]:
        from vllm.distributed.weight_transfer.base import layerwise_groups

        return layerwise_groups([n for n, _ in self._named()])


def _as_weight_source(src: ParamSource) -> Any:
    """Wrap in vLLM's ``WeightSource`` ABC when it exists (some engines type-check it)."""
    try:
        from vllm.distributed.weight_transfer.base import WeightSource
    except ImportError:
        return src

    class _Source(WeightSource):
        def metadata(self) -> list[Any]:
            return src.metadata()

        def __iter__(self):
            return iter(src)

    return _Source()


class Sender:
    backend: str
    source: ParamSource
    client: EngineFanOut

    def send(self) -> dict[str, float]:
        raise NotImplementedError

    def _result(self, wall: float) -> dict[str, float]:
        t = self.client.timings
        return {
            "start_s": t.get("start_weight_update", 0.0),
            "transfer_s": t.get("update_weights", 0.0),
            "gather_s": self.source.gather_s,
            "finish_s": t.get("finish_weight_update", 0.0),
            "send_s": wall,
            "bytes": float(self.source.bytes),
        }


class TrainerEngineSender(Sender):
    """vLLM >= 0.28: the backend's ``TrainerWeightTransferEngine`` drives the round trip."""

    def __init__(self, backend: str, client: EngineFanOut, source: ParamSource, init: dict[str, Any]) -> None:
        from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

        self.backend, self.client, self.source = backend, client, source
        if backend == "gloo":
            from rlhf_runtime.gloo_transfer import GlooTrainerInitInfo

            info: Any = GlooTrainerInitInfo(
                master_address=init["master_address"], master_port=init["master_port"],
                world_size=init["world_size"], packed=init["packed"],
                packed_buffer_size_bytes=init["bucket_bytes"], rank=init.get("rank", 0),
            )
        elif backend == "nccl":
            from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo

            info = NCCLTrainerInitInfo(
                master_address=init["master_address"], master_port=init["master_port"],
                world_size=init["world_size"], packed=init["packed"],
                packed_buffer_size_bytes=init["bucket_bytes"], rank=init.get("rank", 0),
            )
        elif backend == "ipc":
            from vllm.distributed.weight_transfer.ipc_engine import IPCTrainerInitInfo

            info = IPCTrainerInitInfo(packed=init["packed"], packed_buffer_size_bytes=init["bucket_bytes"], rank=init.get("rank", 0))
        else:
            raise ValueError(f"unknown weight-transfer backend {backend!r}")
        self.engine = WeightTransferTrainerFactory.trainer_init(info, client=client, source=_as_weight_source(source))

    def send(self) -> dict[str, float]:
        self.client.timings = {}
        t = time.perf_counter()
        self.engine.send_weights()
        return self._result(time.perf_counter() - t)


class LegacySender(Sender):
    """vLLM 0.24: the runtime drives start -> update (beside the trainer send) -> finish itself."""

    def __init__(self, backend: str, client: EngineFanOut, source: ParamSource, init: dict[str, Any]) -> None:
        self.backend, self.client, self.source, self.init = backend, client, source, init
        self.group: Any = None
        if backend == "nccl":
            from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferEngine

            worker = {k: init[k] for k in ("master_address", "master_port", "world_size")}
            with ThreadPoolExecutor(max_workers=1) as exe:
                fut = exe.submit(client.init_weight_transfer_engine, {**worker, "rank_offset": 1})
                self.group = NCCLWeightTransferEngine.trainer_init(worker)
                fut.result()
        elif backend == "ipc":
            client.init_weight_transfer_engine({})
        else:
            raise ValueError(f"backend {backend!r} needs vLLM >= 0.28 (trainer-side weight-transfer engines)")

    def send(self) -> dict[str, float]:
        self.client.timings = {}
        names, dtypes, shapes = self.source.legacy_metadata()
        packed = self.init["packed"]
        t = time.perf_counter()
        self.client.start_weight_update()
        if self.backend == "nccl":
            from vllm.distributed.weight_transfer.nccl_engine import (
                NCCLTrainerSendWeightsArgs,
                NCCLWeightTransferEngine,
            )

            update = {"names": names, "dtype_names": dtypes, "shapes": shapes, "packed": packed}
            exe = ThreadPoolExecutor(max_workers=1)
            try:
                fut = exe.submit(self.client.update_weights, update)
                kw: dict[str, Any] = {"group": self.group, "packed": packed}
                if "packed_buffer_size_bytes" in inspect.signature(NCCLTrainerSendWeightsArgs).parameters:
                    kw["packed_buffer_size_bytes"] = self.init["bucket_bytes"]
                NCCLWeightTransferEngine.trainer_send_weights(
                    iterator=iter(self.source), trainer_args=NCCLTrainerSendWeightsArgs(**kw)
                )
                fut.result()
            finally:
                exe.shutdown(wait=False)
        else:  # ipc, send_mode "ray": the trainer calls update_weights on its colocated engine actor itself
            from vllm.distributed.weight_transfer.ipc_engine import (
                IPCTrainerSendWeightsArgs,
                IPCWeightTransferEngine,
            )

            t0 = time.perf_counter()
            IPCWeightTransferEngine.trainer_send_weights(
                iterator=iter(self.source),
                trainer_args=IPCTrainerSendWeightsArgs(
                    send_mode="ray", llm_handle=self.client.handles[0], packed=packed,
                    packed_buffer_size_bytes=self.init["bucket_bytes"],
                ),
            )
            self.client.timings["update_weights"] = time.perf_counter() - t0
        self.client.finish_weight_update()
        return self._result(time.perf_counter() - t)


def make_sender(backend: str, client: EngineFanOut, source: ParamSource, init: dict[str, Any]) -> Sender:
    """``init``: master_address, master_port, world_size, packed, bucket_bytes."""
    from rlhf_runtime import vllm_plugin

    vllm_plugin.register()
    if vllm_has_trainer_api():
        return TrainerEngineSender(backend, client, source, init)
    return LegacySender(backend, client, source, init)

