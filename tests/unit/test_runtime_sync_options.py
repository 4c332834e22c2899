"""The weight sync's options (``weight_sync.options``): resolved once from the job's ``weightSync`` and its layout,
frozen, and refused with a message naming the option where a combination cannot run. Pure: no torch, no vLLM."""

from __future__ import annotations

import dataclasses

import pytest

from rlhf_api.models import WeightSync
from rlhf_runtime.weight_sync.options import WeightSyncOptions, resolve


def _resolve(backend: str = "nccl", worlds: tuple[int, ...] = (1,), trainer_world: int = 1,
             async_engines: bool = False, **spec) -> WeightSyncOptions:
    return resolve(WeightSync.model_validate(spec), backend=backend, engine_worlds=list(worlds),
                   trainer_world=trainer_world, async_engines=async_engines)


def test_the_spec_defaults_resolve_to_the_runtimes_sync() -> None:
    """A job that sets nothing: ``auto`` format, 1 GiB buckets, the spec's deadline; NCCL into sync-mode engines
    and gloo pipeline vLLM's three calls into sync-mode engines and wait on each into async ones (async mode, or the
    async actors of multi-turn rollouts: Ray may start their calls out of order); IPC waits on each (vLLM's IPC
    trainer engine updates chunk by chunk)."""
    o = _resolve()
    assert (o.backend, o.format, o.bucket_bytes, o.timeout_s) == ("nccl", "auto", 1 << 30, 600.0)
    assert o.rpc == "pipelined" and _resolve("gloo").rpc == "pipelined"
    assert _resolve(mode="async").rpc == "three" and _resolve("gloo", mode="async").rpc == "three"
    assert _resolve(async_engines=True).rpc == "three" and _resolve("gloo", async_engines=True).rpc == "three"
    assert _resolve("ipc").rpc == "three"
    assert _resolve(bucketSizeMB=256, timeoutSeconds=30).bucket_bytes == 256 << 20
    with pytest.raises(dataclasses.FrozenInstanceError):
        o.rpc = "three"  # type: ignore[misc]


@pytest.mark.parametrize(("setting", "backend", "worlds", "trainer_world", "checkpoint", "kernel"), [
    (None, "nccl", (1,), 1, True, False),  # unset: the direct sync in the kernel format
    (None, "nccl", (1, 1), 1, True, False),  # several TP=1 engines too
    (None, "nccl", (2,), 1, True, True),  # TP > 1 engines: packed
    (None, "nccl", (1,), 2, True, True),  # an FSDP2 trainer: packed
    (None, "ipc", (1,), 1, True, True), (None, "gloo", (1,), 1, True, True),
    (True, "nccl", (1,), 1, True, True),
    (False, "nccl", (2,), 2, False, False), (False, "ipc", (1,), 1, False, False),
])
def test_packed_unset_is_the_direct_sync_only_from_one_gpu_into_tp1_engines(setting, backend, worlds, trainer_world,
                                                                             checkpoint, kernel) -> None:
    """``weightSync.packed`` unset: not packed only for NCCL in the kernel format from a one-GPU trainer into TP=1
    engines (the direct sync); the checkpoint format packed. A value the user set applies to both formats."""
    o = _resolve(backend, worlds, trainer_world, packed=setting)
    assert (o.packs("checkpoint"), o.packs("kernel")) == (checkpoint, kernel)


def test_the_spec_leaves_packed_unset_unless_the_user_sets_it() -> None:
    assert WeightSync().packed is None
    assert WeightSync.model_validate({"packed": True}).packed is True
    assert "packed" not in WeightSync().model_dump(by_alias=True, exclude_none=True)


def test_a_backend_that_cannot_run_is_refused_naming_it() -> None:
    with pytest.raises(ValueError, match="weight-sync backend must be one of nccl, ipc, gloo, not 'shm'"):
        _resolve("shm")


def test_no_module_of_the_sync_keeps_a_mutable_switch() -> None:
    """The sender reads its options alone: the switches that other code set on the modules, and the arms they
    chose, are gone."""
    import importlib

    pytest.importorskip("torch")
    pytest.importorskip("vllm")
    gone = {"senders": ("LEAN_GATHERS_DEFAULT", "NCCL_RPC_DEFAULT", "RPC_DEFAULT", "BROADCAST_TP_VALIDATED",
                        "apply_settings", "auto_keeps_checkpoint", "resolve_packed", "default_rpc"),
            "options": ("EXPERIMENTAL", "EXCHANGES", "default_rpc")}
    for module, names in gone.items():
        mod = importlib.import_module(f"rlhf_runtime.weight_sync.{module}")
        assert not [n for n in names if hasattr(mod, n)], module
    for module in ("wire", "ipc_exchange"):
        with pytest.raises(ModuleNotFoundError):
            importlib.import_module(f"rlhf_runtime.weight_sync.{module}")
    from rlhf_runtime.weight_sync.senders import TrainerEngineSender

    assert not [n for n in ("apply_settings", "lean_gathers", "ipc_resident", "rpc", "requested_format")
                if hasattr(TrainerEngineSender, n)]


def test_multi_turn_and_async_jobs_run_async_engine_actors() -> None:
    """``rollout.api.async_engines``: the engine actors of a multi-turn job (``spec.environment``) are async even in
    ``weightSync.mode: sync``, so their sync waits on each call; a single-turn sync-mode job's are not."""
    from rlhf_testing.tiny import tiny_job_spec

    from rlhf_api.models import RLHFJobSpec
    from rlhf_runtime.rollout.api import async_engines

    base = tiny_job_spec("/models/tiny", steps=2)
    plain = RLHFJobSpec.model_validate(base)
    turns = RLHFJobSpec.model_validate({**base, "reward": {}, "environment": {"className": "envs:Env"}})
    asynchronous = RLHFJobSpec.model_validate({**base, "weightSync": {**base.get("weightSync", {}), "mode": "async"}})
    assert (async_engines(plain), async_engines(turns), async_engines(asynchronous)) == (False, True, True)
