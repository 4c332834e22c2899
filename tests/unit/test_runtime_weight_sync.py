"""Weight-sync sender parts that run without a GPU: the sender options and weight format, and ``IPCBufferProducer`` (the runtime's
CUDA-IPC sender) on CPU tensors: chunking, both wire formats read back
through vLLM's own unpacking, buffers reused across syncs and never overwritten before the engine read them.

The engine is played by a consumer that reads a chunk only when the producer waits on it (as late as a real
engine may), through the same memory the producer exported; the GPU-side handle exchange runs on the lent
GPUs (``benchmarks/gpu_sync.py``)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("vllm")

from vllm.distributed.weight_transfer.packed_tensor import unpack_tensor

from rlhf_runtime.weight_sync import IPCBufferProducer


def _stream(seed: int) -> list[tuple[str, object]]:
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g).to(torch.bfloat16)
    return [
        ("embed.weight", r(64, 16)),
        ("layers.0.qkv_proj.weight", [r(16, 16), r(8, 16), r(8, 16)]),  # fused parts, written side by side
        ("layers.0.o_proj.weight", r(16, 16)),
        ("layers.0.norm.weight", r(16)),
        ("layers.0.gate_up_proj.weight", [r(32, 16), r(32, 16)]),
        ("layers.0.down_proj.weight", r(16, 32)),
        ("big.weight", r(128, 16)),  # larger than the bucket: a chunk of its own
        ("norm.weight", r(16)),
    ]


def _expected(stream) -> dict[str, torch.Tensor]:
    return {n: torch.cat(t, dim=0) if isinstance(t, list) else t for n, t in stream}


class Engine:
    """Reads a chunk when the producer waits on it, from the exported memory itself."""

    def __init__(self) -> None:
        self.weights: dict[str, torch.Tensor] = {}
        self.chunk_bytes: list[int] = []

    def deliver(self, info: dict) -> dict:
        return info  # the "ref" the producer waits on

    def wait(self, info: dict) -> list[int]:
        if info["packed"]:
            buf = info["ipc_handles"]["mem"]
            dtypes = [getattr(torch, d) for d in info["dtype_names"]]
            got = unpack_tensor(buf, info["names"], info["shapes"], dtypes, info["tensor_sizes"])
            self.chunk_bytes.append(sum(info["tensor_sizes"]))
        else:
            got = [(n, h["mem"]) for n, h in zip(info["names"], info["ipc_handles"])]
            self.chunk_bytes.append(sum(t.numel() * t.element_size() for _, t in got))
        for (n, t), shape in zip(got, info["shapes"]):
            assert list(t.shape) == shape
            self.weights[n] = t.clone()
        return [len(got)]


@pytest.mark.parametrize("wire", ["packed", "views"])
def test_chunks_arrive_intact_and_buffers_are_reused(wire: str) -> None:
    bucket = 3000  # bytes: several chunks, one tensor (big.weight, 4096 B) larger than a bucket
    engine = Engine()
    prod = IPCBufferProducer(bucket, export=lambda t: {"mem": t}, wait=engine.wait, device="cpu")
    stream = _stream(0)
    results = prod.send(iter(stream), engine.deliver, wire=wire)

    expected = _expected(stream)
    assert set(engine.weights) == set(expected)
    for name, t in expected.items():
        assert torch.equal(engine.weights[name], t), name
    assert prod.chunks >= 4 and len(results) == prod.chunks  # every chunk was waited for exactly once
    assert len(prod.buffers) == 2
    oversized = [b for b in engine.chunk_bytes if b > bucket]
    assert oversized == [128 * 16 * 2]  # only the tensor that alone exceeds the bucket
    assert sum(engine.chunk_bytes) == sum(t.numel() * 2 for t in expected.values())

    # the next sync reuses the same buffers (no allocation per sync) and delivers the new values
    ptrs = [b.data_ptr() for b in prod.buffers]
    engine2 = Engine()
    prod.wait = engine2.wait
    stream2 = _stream(1)
    prod.send(iter(stream2), engine2.deliver, wire=wire)
    assert [b.data_ptr() for b in prod.buffers] == ptrs
    for name, t in _expected(stream2).items():
        assert torch.equal(engine2.weights[name], t), name


def test_one_chunk_when_the_model_fits_the_bucket() -> None:
    engine = Engine()
    prod = IPCBufferProducer(1 << 20, export=lambda t: {"mem": t}, wait=engine.wait, device="cpu")
    prod.send(iter(_stream(2)), engine.deliver, wire="views")
    assert prod.chunks == 1 and len(prod.buffers) == 1


def test_unknown_wire_is_refused() -> None:
    prod = IPCBufferProducer(1024, export=lambda t: {"mem": t}, wait=lambda x: x, device="cpu")
    with pytest.raises(ValueError, match="ipc_wire must be packed or views"):
        prod.send(iter(_stream(0)), lambda info: info, wire="pickle")


def test_default_options_are_the_validated_fast_path() -> None:
    from rlhf_runtime.weight_sync import DEFAULT_OPTIONS

    assert DEFAULT_OPTIONS == {"producer": "runtime", "format": "auto", "rpc": "one"}


def test_effective_format_follows_the_request_and_the_plan() -> None:
    from rlhf_runtime.weight_sync import KernelPlan, effective_format

    ok = KernelPlan([("w", [2], ["w"])], True, "1 engine parameter")
    no = KernelPlan([], False, "kernel format needs tensor_parallel_size 1")
    assert effective_format("auto", ok) == "kernel"
    assert effective_format("auto", no) == "checkpoint"
    assert effective_format("auto", None) == "checkpoint"
    assert effective_format("kernel", ok) == "kernel"
    assert effective_format("checkpoint", ok) == "checkpoint"
    with pytest.raises(ValueError, match=r"weightSync.format kernel cannot be used here \(kernel format needs "
                                         r"tensor_parallel_size 1\)"):
        effective_format("kernel", no)
    with pytest.raises(ValueError, match="one of auto, checkpoint, kernel"):
        effective_format("fused", ok)


def test_old_names_stay_importable_from_the_package() -> None:
    """Benchmarks and other code import these from ``rlhf_runtime.weight_sync`` (a package since issue 16)."""
    import rlhf_runtime.weight_sync as ws

    for name in ("EngineFanOut", "ParamSource", "PackedProducer", "IPCBufferProducer", "KernelPlan", "Sender",
                 "TrainerEngineSender", "RuntimeDrivenSender", "DEFAULT_OPTIONS", "make_sender", "cuda_ipc_export"):
        assert hasattr(ws, name), name
