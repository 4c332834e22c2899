"""The weight sync's options (``weight_sync.options``): resolved once from the job's ``weightSync`` and its layout,
frozen, and refused with a message naming the option where a combination cannot run. Pure: no torch, no vLLM."""

from __future__ import annotations

import dataclasses

import pytest

from rlhf_api.models import WeightSync
from rlhf_runtime.weight_sync.options import EXPERIMENTAL, RPCS, WeightSyncOptions, resolve


def _resolve(backend: str = "nccl", worlds: tuple[int, ...] = (1,), trainer_world: int = 1,
             experimental: dict | None = None, **spec) -> WeightSyncOptions:
    return resolve(WeightSync.model_validate(spec), backend=backend, engine_worlds=list(worlds),
                   trainer_world=trainer_world, experimental=experimental)


def test_the_spec_defaults_resolve_to_the_runtimes_sync() -> None:
    """A job that sets nothing: ``auto`` format, 1 GiB buckets, the spec's deadline; NCCL into sync-mode engines
    pipelines vLLM's three calls, into async engines waits on each; gloo makes one call; IPC three (vLLM's own)."""
    o = _resolve()
    assert (o.backend, o.format, o.bucket_bytes, o.timeout_s) == ("nccl", "auto", 1 << 30, 600.0)
    assert (o.ipc_exchange, o.direct_fuse, o.direct_packs) == ("nccl", False, False)
    assert o.rpc == "pipelined"
    assert _resolve(mode="async").rpc == "three"
    assert _resolve("gloo").rpc == "one" and _resolve("ipc").rpc == "three"
    assert _resolve(bucketSizeMB=256, timeoutSeconds=30).bucket_bytes == 256 << 20
    with pytest.raises(dataclasses.FrozenInstanceError):
        o.rpc = "one"  # type: ignore[misc]


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


def test_experimental_options_are_typed_and_documented() -> None:
    """The experimental mapping sets only the options ``EXPERIMENTAL`` documents; each takes effect as given."""
    assert set(EXPERIMENTAL) == {"rpc", "ipc_exchange", "direct_fuse", "direct_packs"}
    assert all(isinstance(v, str) and v for v in EXPERIMENTAL.values())
    assert [_resolve(experimental={"rpc": r}).rpc for r in RPCS] == list(RPCS)
    assert _resolve("ipc", trainer_world=2, experimental={"ipc_exchange": "gloo"}).ipc_exchange == "gloo"
    o = _resolve(experimental={"direct_fuse": True, "direct_packs": True})
    assert (o.direct_fuse, o.direct_packs) == (True, True)


@pytest.mark.parametrize(("backend", "spec", "experimental", "error", "match"), [
    ("nccl", {}, {"lean_gathers": False}, ValueError, r"unknown experimental weight-sync options \['lean_gathers'\]"),
    ("nccl", {}, {"rpc": "two"}, ValueError, "rpc must be one of one, three, pipelined, not 'two'"),
    ("ipc", {}, {"rpc": "one"}, ValueError, "rpc one applies to nccl and gloo syncs"),
    ("nccl", {"mode": "async"}, {"rpc": "pipelined"}, ValueError, "rpc pipelined needs weightSync.mode sync"),
    ("ipc", {}, {"ipc_exchange": "shm"}, ValueError, "ipc_exchange must be one of nccl, gloo, not 'shm'"),
    ("nccl", {}, {"ipc_exchange": "gloo"}, ValueError, "ipc_exchange gloo applies to the ipc backend, not nccl"),
    ("ipc", {}, {"direct_fuse": True}, ValueError, "direct_fuse applies to the direct NCCL sync"),
    ("nccl", {"packed": True}, {"direct_packs": True}, ValueError, "direct_packs applies to the direct NCCL sync"),
    ("nccl", {}, {"direct_fuse": "yes"}, TypeError, "direct_fuse must be true or false, not 'yes'"),
    ("shm", {}, {}, ValueError, "weight-sync backend must be one of nccl, ipc, gloo, not 'shm'"),
])
def test_combinations_that_cannot_run_are_refused_naming_the_option(backend, spec, experimental, error, match) -> None:
    with pytest.raises(error, match=match):
        _resolve(backend, experimental=experimental, **spec)


def test_no_module_of_the_sync_keeps_a_mutable_switch() -> None:
    """The sender reads its options alone: the switches that other code set on the modules are gone."""
    import importlib

    pytest.importorskip("torch")
    pytest.importorskip("vllm")
    gone = {"senders": ("LEAN_GATHERS_DEFAULT", "NCCL_RPC_DEFAULT", "RPC_DEFAULT", "BROADCAST_TP_VALIDATED",
                        "apply_settings", "auto_keeps_checkpoint", "resolve_packed", "default_rpc"),
            "wire": ("FUSE_DEFAULT", "PACKS_DEFAULT"), "ipc_exchange": ("EXCHANGE_DEFAULT", "uninstall")}
    for module, names in gone.items():
        mod = importlib.import_module(f"rlhf_runtime.weight_sync.{module}")
        assert not [n for n in names if hasattr(mod, n)], module
    from rlhf_runtime.weight_sync.senders import TrainerEngineSender

    assert not [n for n in ("apply_settings", "lean_gathers", "ipc_resident", "rpc", "requested_format")
                if hasattr(TrainerEngineSender, n)]
