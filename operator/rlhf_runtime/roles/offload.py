"""The trainer's state off the GPU while colocated engines generate (``trainer.offloadDuringRollout``).

* ``init_optimizer_state``: AdamW's moments are created when the optimiser is, as zeros (what its first step
  would create), not lazily in the first step. The trainer then holds from its start the memory it holds after
  step 1, so the engines that measure the GPU as they start, and the memory plan (``rlhf_api.memory_plan``), see
  the steady state, and the moments never share allocator segments with the step's gradients (whose blocks would
  otherwise keep segments from being released after the step).
* ``StateOffload``: the tensors a rollout does not read (one worker's float32 master weights and the moments of
  every parameter; FSDP2's moment shards, each DTensor's local tensor) copied into one host buffer, page-locked on a
  GPU (``cudaHostRegister``: torch's pinned allocator rounds every allocation up to a power of two), their
  storage swapped to it (``tensor.data``), so that the GPU memory goes back to the allocator (and, with
  ``release_cached_gpu_memory``, to the engines); ``reload`` brings them back into fresh GPU tensors before the
  next step. The tensors keep their identity (the optimiser's parameters and state entries are the same objects),
  so the optimiser, gradient hooks and checkpoints see no difference once reloaded. Disabled (every call a no-op)
  until ``enable``; the driver enables it per the memory plan. Timings and bytes go into the step's statistics.
* ``StateOnHost``: the worker's side (``FSDPWorker`` inherits it): ``memory_report`` for the plan and
  ``set_offload`` for the driver.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator
from typing import Any

import torch

log = logging.getLogger("rlhf_runtime")
#: Byte alignment of each tensor in the host buffer.
ALIGN = 512
GIB = float(1 << 30)


def init_optimizer_state(opt: torch.optim.Optimizer) -> int:
    """Create AdamW's state (step counter, first and second moments; with amsgrad the maxima) for every parameter
    that has none yet, exactly as ``torch.optim.Adam(W)`` creates it on its first step; returns how many."""
    made = 0
    for group in opt.param_groups:
        for p in group["params"]:
            state = opt.state[p]
            if state:
                continue
            on_device = bool(group.get("fused") or group.get("capturable"))
            state["step"] = torch.zeros((), dtype=torch.float32, device=p.device if on_device else "cpu")
            for key in ("exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if group.get("amsgrad") else ()):
                state[key] = torch.zeros_like(p, memory_format=torch.preserve_format)
            made += 1
    return made


def pin(buffer: torch.Tensor) -> bool:
    """Page-lock ``buffer`` (a host tensor) for the GPU's copy engines; False (a warning) where it cannot be."""
    try:
        rc = torch.cuda.cudart().cudaHostRegister(buffer.data_ptr(), buffer.numel() * buffer.element_size(), 0)
        torch.cuda.check_error(rc)
        return True
    except Exception as e:  # noqa: BLE001 - pageable memory still works, slower
        log.warning("could not page-lock %.2f GiB of host memory for the trainer's state (%s): copies stay "
                    "pageable", buffer.numel() / GIB, e)
        return False


class StateOffload:
    """Master weights and optimiser moments between the GPU and one host buffer (module docstring)."""

    def __init__(self, opt: torch.optim.Optimizer, masters: list[torch.Tensor], device: torch.device) -> None:
        self.opt, self.masters, self.device = opt, list(masters), device
        self.enabled = False
        self.moved: list[torch.Tensor] = []  # the tensors on the host now (empty: all on the device)
        self.flat: torch.Tensor | None = None
        self.views: list[torch.Tensor] = []
        self.layout: list[tuple[int, torch.dtype, tuple[int, ...]]] = []
        self.pinned = False

    def tensors(self) -> list[torch.Tensor]:
        """What moves, in a fixed order: the masters, then every state tensor of the optimiser (not the step
        counters), each DTensor as its local shard."""
        out = list(self.masters)
        for group in self.opt.param_groups:
            for p in group["params"]:
                for v in self.opt.state.get(p, {}).values():
                    if isinstance(v, torch.Tensor) and v.dim() > 0:
                        out.append(getattr(v, "_local_tensor", v))
        return out

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.moved or self.tensors()))

    def _layout(self, tensors: list[torch.Tensor]) -> float:
        """The host buffer and a view per tensor, made again only when what moves changed; seconds spent."""
        layout = [(t.numel() * t.element_size(), t.dtype, tuple(t.shape)) for t in tensors]
        if layout == self.layout:
            return 0.0
        t0 = time.perf_counter()
        self._release()
        offsets, at = [], 0
        for n, _, _ in layout:
            offsets.append(at)
            at += -(-n // ALIGN) * ALIGN
        self.flat = torch.empty(at, dtype=torch.uint8)
        self.pinned = self.device.type == "cuda" and pin(self.flat)
        self.views = [self.flat[o : o + n].view(dt).view(shape) for o, (n, dt, shape) in zip(offsets, layout)]
        self.layout = layout
        return time.perf_counter() - t0

    def _release(self) -> None:
        if self.flat is not None and self.pinned:
            torch.cuda.check_error(torch.cuda.cudart().cudaHostUnregister(self.flat.data_ptr()))
        self.flat, self.views, self.layout, self.pinned = None, [], [], False

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def offload(self) -> dict[str, float]:
        """Everything ``tensors`` names to the host buffer (a no-op when disabled or already there); the seconds
        (``offload_s``; ``offload_pin_s``: laying out and page-locking the buffer, the first time) and GiB."""
        if not self.enabled or self.moved:
            return {}
        self._sync()
        t0 = time.perf_counter()
        tensors = self.tensors()
        pin_s = self._layout(tensors)
        for t, v in zip(tensors, self.views):
            v.copy_(t.data, non_blocking=self.pinned)
        self._sync()
        for t, v in zip(tensors, self.views):
            t.data = v  # the device storage goes back to the allocator
        self.moved = tensors
        return {"offload_s": time.perf_counter() - t0 - pin_s, "offload_pin_s": pin_s,
                "offload_gib": self.nbytes() / GIB}

    def reload(self) -> dict[str, float]:
        """The moved tensors back into fresh device tensors (a no-op when nothing is on the host); ``reload_s``."""
        if not self.moved:
            return {}
        t0 = time.perf_counter()
        for t, v in zip(self.moved, self.views):
            g = torch.empty(v.shape, dtype=v.dtype, device=self.device)
            g.copy_(v, non_blocking=self.pinned)
            t.data = g
        self._sync()
        self.moved = []
        return {"reload_s": time.perf_counter() - t0}

    @contextlib.contextmanager
    def resident(self) -> Iterator[None]:
        """On the device for the block (a checkpoint's collectives), back on the host after it if it was."""
        was = bool(self.moved)
        self.reload()
        try:
            yield
        finally:
            if was:
                self.offload()


def memory_stats(device: torch.device) -> dict[str, float]:
    """The training step's peak and what stays allocated and reserved after it (GiB); resets the peak."""
    if device.type != "cuda":
        return {}
    out = {"gpu_peak_allocated_gib": torch.cuda.max_memory_allocated(device) / GIB,
           "gpu_allocated_gib": torch.cuda.memory_allocated(device) / GIB,
           "gpu_reserved_gib": torch.cuda.memory_reserved(device) / GIB}
    torch.cuda.reset_peak_memory_stats(device)
    return out


class StateOnHost:
    """The worker side of the memory plan and the offload (``roles.base.FSDPWorker`` inherits it; it sets
    ``state_offload`` in ``make_optimizer``)."""

    device: torch.device
    state_offload: StateOffload

    def memory_report(self) -> dict[str, Any]:
        """This worker's GPU (``mem_get_info``: total and free bytes) and its allocator (allocated, reserved), and
        the bytes its state offload would move; empty on a CPU."""
        if self.device.type != "cuda":
            return {}
        torch.cuda.empty_cache()  # what loading left cached is not the trainer's: the engines start next
        free, total = torch.cuda.mem_get_info(self.device)
        return {"total": total, "free": free, "allocated": torch.cuda.memory_allocated(self.device),
                "reserved": torch.cuda.memory_reserved(self.device), "offloadable": self.state_offload.nbytes()}

    def set_offload(self, on: bool) -> dict[str, float]:
        """Move the state to the host between steps from now on (``on``), starting now, or keep it on the GPU;
        what the move took (``StateOffload.offload``)."""
        self.state_offload.enabled = on
        if not on:
            return self.state_offload.reload()
        out = self.state_offload.offload()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()  # the engines are built into this memory next
        return out
