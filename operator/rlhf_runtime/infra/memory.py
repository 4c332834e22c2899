"""The memory plan of a colocated GPU job (``rlhf_api.memory_plan``) at its start: the model's shape from its config,
the GPU's size and the trainer's state from what the trainer ranks measure (``roles.offload.StateOnHost``). The
driver (``controller.job_actors.JobActors.plan_memory``) checks it before the engines are built."""

from __future__ import annotations

from typing import Any

from rlhf_api.memory_plan import Measured, MemoryPlan, ModelShape, plan
from rlhf_api.models import RLHFJobSpec


def model_shape(spec: RLHFJobSpec) -> ModelShape:
    """``spec.model``'s shape from its Hugging Face config (the driver has read it already: cached)."""
    from transformers import AutoConfig

    kw: dict[str, Any] = {"trust_remote_code": spec.model.trust_remote_code}
    if spec.model.revision:
        kw["revision"] = spec.model.revision
    return ModelShape.from_config(AutoConfig.from_pretrained(spec.model.name, **kw).to_dict())


def measured(reports: list[dict[str, Any]]) -> Measured | None:
    """The trainer ranks' ``memory_report``s as one measurement: the smallest GPU, the largest state; None
    without GPUs."""
    reports = [r for r in reports if r]
    if not reports:
        return None
    return Measured(gpu_total=min(int(r["total"]) for r in reports),
                    trainer_reserved=max(int(r["reserved"]) for r in reports),
                    offloadable=max(int(r["offloadable"]) for r in reports))


def job_plan(spec: RLHFJobSpec, reports: list[dict[str, Any]], shape: ModelShape | None = None) -> MemoryPlan | None:
    """The plan of ``spec`` from the trainer ranks' reports (None without GPUs)."""
    m = measured(reports)
    if m is None:
        return None
    return plan(spec, shape or model_shape(spec), m.gpu_total, m)
