"""``precision.host_load_dtype``: the dtype rank 0 of an FSDP2 trainer loads a checkpoint in on its host, read from
the safetensors headers; the file's own only where widening it to the shards' dtype is exact."""

from __future__ import annotations

from pathlib import Path

import pytest


def _write(directory: Path, shards: dict[str, dict[str, str]]) -> Path:
    import torch
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    for name, tensors in shards.items():
        save_file({k: torch.zeros(2, 3, dtype=getattr(torch, d)) for k, d in tensors.items()}, str(directory / name))
    return directory


@pytest.mark.parametrize(("shards", "stored", "host"), [
    # two shards of bfloat16 (an integer buffer does not count): loaded as bfloat16, widened by the shards' copies
    ({"a.safetensors": {"w": "bfloat16", "ids": "int64"}, "b.safetensors": {"v": "bfloat16"}}, "bfloat16", "bfloat16"),
    ({"model.safetensors": {"w": "float16"}}, "float16", "float16"),
    ({"model.safetensors": {"w": "float32"}}, "float32", "float32"),
    # mixed floating dtypes (a float32 norm beside bfloat16 weights): the shards' dtype, as before
    ({"model.safetensors": {"w": "bfloat16", "norm": "float32"}}, None, "float32"),
    # float64 does not narrow to float32 exactly
    ({"model.safetensors": {"w": "float64"}}, "float64", "float32"),
])
def test_host_load_dtype_is_the_files_own_only_where_widening_is_exact(tmp_path: Path, shards: dict, stored: str | None,
                                                                        host: str) -> None:
    import torch

    from rlhf_runtime.roles.precision import host_load_dtype, stored_dtype

    d = _write(tmp_path / "m", shards)
    assert stored_dtype(str(d)) == (getattr(torch, stored) if stored else None)
    assert host_load_dtype(str(d), torch.float32) == getattr(torch, host)
    # a bfloat16 reference or a float16 file for bfloat16 compute: never changed
    assert host_load_dtype(str(d), torch.bfloat16) == torch.bfloat16


def test_host_load_dtype_of_a_hub_id_or_an_unreadable_file_is_the_shards(tmp_path: Path) -> None:
    import torch

    from rlhf_runtime.roles.precision import host_load_dtype

    assert host_load_dtype("Qwen/Qwen3-8B", torch.float32) == torch.float32  # not a local directory
    for junk in (b"xx", b"not a safetensors file"):  # too short, or a header "length" of 10^18 bytes
        (tmp_path / "model.safetensors").write_bytes(junk)  # from_pretrained reports it
        assert host_load_dtype(str(tmp_path), torch.float32) == torch.float32
