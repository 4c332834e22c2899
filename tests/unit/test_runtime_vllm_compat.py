"""``rlhf_runtime.vllm.compat``: the supported-version check (pure) and the probes on the installed vLLM."""

from __future__ import annotations

import pytest

from rlhf_runtime.vllm import compat as vc


@pytest.mark.parametrize("version", ["0.28.0", "0.29.1", "0.31.0", "0.32.0+cpu", "0.33.0", "0.33.0rc1", "0.40.2",
                                     "1.0.0", "0.28.dev5+g1234"])
def test_supported_versions_pass(version: str) -> None:
    assert vc.check_version(version) >= (0, 28)


@pytest.mark.parametrize("version", ["0.24.0", "0.24.1", "0.23.9", "0.10.2", "0.25.0", "0.26.1", "0.27.0rc2"])
def test_unsupported_versions_are_refused_naming_version_and_range(version: str) -> None:
    with pytest.raises(vc.UnsupportedVLLMError) as e:
        vc.check_version(version)
    msg = str(e.value)
    assert f"vLLM {version} is " in msg
    assert ">= 0.28" in msg and "install a supported version" in msg


def test_the_range_is_stated_once() -> None:
    assert vc.SUPPORTED_RANGE == ">= 0.28" and vc.OLDEST_SUPPORTED == (0, 28)
    assert set(vc.VALIDATED) == {"0.31", "0.32", "0.33"}
    assert ">= 0.28" in (vc.__doc__ or "")


def test_older_versions_say_why() -> None:
    with pytest.raises(vc.UnsupportedVLLMError, match="older than 0.28, the oldest the runtime supports"):
        vc.check_version("0.24.0")
    with pytest.raises(vc.UnsupportedVLLMError, match="the first with trainer-side weight-transfer engines"):
        vc.check_version("0.27.0")


def test_unreadable_version_is_refused() -> None:
    with pytest.raises(vc.UnsupportedVLLMError, match="cannot read a vLLM version from 'dev'"):
        vc.check_version("dev")


def test_parse_version() -> None:
    assert vc.parse_version("0.32.0+cpu") == (0, 32)
    assert vc.parse_version("v0.24.0") == (0, 24)


def test_probes_on_the_installed_vllm() -> None:
    """CI's vLLM (>= 0.28): supported, trainer API present, its engines' start takes no format flag (the format
    is the runtime's worker engines' switch, ``weight_sync.kernel``)."""
    pytest.importorskip("vllm")
    import inspect

    assert vc.require_supported_vllm() >= (0, 28)
    from vllm import LLM
    from vllm.distributed.weight_transfer.base import TrainerWeightTransferEngine  # noqa: F401
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory  # noqa: F401

    assert "is_checkpoint_format" not in inspect.signature(LLM.start_weight_update).parameters


def test_weight_source_round_trip() -> None:
    """The wrapper hands vLLM's engines the metadata and the stream, whichever ``WeightSource`` form exists."""
    pytest.importorskip("vllm")
    items = [("a", 1), ("b", 2)]
    src = vc.as_weight_source(lambda: ["meta-a", "meta-b"], lambda: iter(items))
    assert vc.source_metadata(src) == ["meta-a", "meta-b"]
    assert list(vc.source_tensors(src)) == items
    assert list(vc.source_tensors(src)) == items  # re-iterable: one stream per sync
