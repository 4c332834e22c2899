"""The resident IPC sync (``weight_sync.producers.ResidentExport`` on the trainer, ``kernel_transfer.ResidentCopy``
in the engine's worker) on CPU tensors: what the trainer exports (views of its parameters, once per
generation), what the engine maps and copies (fused parameters filled part by part, in one multi-tensor copy),
and the refusals. The CUDA IPC handle itself (``reduce_tensor`` / ``rebuild_cuda_tensor``) needs a GPU: here the
handle carries the trainer's tensor, which the engine's rebuild hands back, so the engine reads the trainer's
memory as it does through IPC. The whole path, with the fresh-engine validation, runs on the lent GPUs
(``benchmarks/gpu_sync.py``, layout ``colocated-ipc-resident``)."""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("vllm")

from rlhf_runtime.weight_sync import KernelPlan, ParamSource, ResidentExport

UUID = "GPU-resident-test"
MAPPING = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}
A, M = "model.layers.0.self_attn.", "model.layers.0.mlp."


def _model(dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """A module whose parameters carry a Qwen2 layer's HF names (q/k/v and gate/up apart, as HF keeps them)."""
    g = torch.Generator().manual_seed(0)
    shapes = {"model.embed_tokens.weight": (16, 8), A + "q_proj.weight": (8, 8), A + "q_proj.bias": (8,),
              A + "k_proj.weight": (4, 8), A + "k_proj.bias": (4,), A + "v_proj.weight": (4, 8),
              A + "v_proj.bias": (4,), A + "o_proj.weight": (8, 8), M + "gate_proj.weight": (12, 8),
              M + "up_proj.weight": (12, 8), M + "down_proj.weight": (8, 12), "model.norm.weight": (8,)}
    root = torch.nn.Module()
    for name, shape in shapes.items():
        *path, leaf = name.split(".")
        mod = root
        for part in path:
            if not hasattr(mod, part):
                mod.add_module(part, torch.nn.Module())
            mod = getattr(mod, part)
        mod.register_parameter(leaf, torch.nn.Parameter(torch.randn(*shape, generator=g, dtype=dtype)))
    return root


def _engine_params() -> dict[str, torch.Tensor]:
    """The engine's own parameters of that layer (vLLM's fused qkv_proj / gate_up_proj), zeros."""
    shapes = {"model.embed_tokens.weight": (16, 8), A + "qkv_proj.weight": (16, 8), A + "qkv_proj.bias": (16,),
              A + "o_proj.weight": (8, 8), M + "gate_up_proj.weight": (24, 8), M + "down_proj.weight": (8, 12),
              "model.norm.weight": (8,)}
    return {n: torch.zeros(*s) for n, s in shapes.items()}


def _plan(source: ParamSource, engine: dict[str, torch.Tensor]) -> KernelPlan:
    layout = {"params": [(n, list(t.shape)) for n, t in engine.items()], "packed_modules_mapping": MAPPING,
              "world_size": 1}
    plan = KernelPlan.build(source, layout)
    assert plan.ok, plan.reason
    return plan


def _export(t: torch.Tensor) -> dict[str, list[Any]]:
    """Stands in for ``cuda_ipc_export``: the handle carries the tensor (index 6 is the device, as in torch's)."""
    return {UUID: [t, None, None, None, None, None, 0]}


class Rebuild:
    """Stands in for ``rebuild_cuda_tensor`` (maps a CUDA IPC handle: needs a GPU): the trainer's tensor itself."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, *args: Any) -> torch.Tensor:
        self.calls += 1
        assert args[6] == 3  # the engine's own index of that GPU replaced the trainer's
        return args[0]


def _expected(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    p = dict(model.named_parameters())
    cat = lambda *names: torch.cat([p[n] for n in names]).detach()
    return {"model.embed_tokens.weight": p["model.embed_tokens.weight"].detach(),
            A + "qkv_proj.weight": cat(A + "q_proj.weight", A + "k_proj.weight", A + "v_proj.weight"),
            A + "qkv_proj.bias": cat(A + "q_proj.bias", A + "k_proj.bias", A + "v_proj.bias"),
            A + "o_proj.weight": p[A + "o_proj.weight"].detach(),
            M + "gate_up_proj.weight": cat(M + "gate_proj.weight", M + "up_proj.weight"),
            M + "down_proj.weight": p[M + "down_proj.weight"].detach(), "model.norm.weight": p["model.norm.weight"].detach()}


def _setup(dtype: torch.dtype = torch.float32):
    from rlhf_runtime.weight_sync.kernel import ResidentCopy

    model, engine = _model(), _engine_params()
    source = ParamSource(model, dtype)
    export = ResidentExport(_plan(source, engine), source, export=_export, device_type="cpu")
    rebuild = Rebuild()
    return model, engine, export, ResidentCopy(rebuild=rebuild), rebuild


def test_the_engine_copies_the_trainers_parameters_into_its_fused_layout() -> None:
    model, engine, export, copy, _ = _setup()
    msg = export.message()
    assert msg is not None, export.reason
    assert copy.load(msg, engine, UUID, 3) == 12  # 7 parameters, q/k/v (weight, bias) and gate/up as parts
    for name, want in _expected(model).items():
        assert torch.equal(engine[name], want), name
    assert export.bytes == sum(p.numel() * 4 for p in model.parameters())


def test_later_syncs_reuse_the_export_and_the_mapping_and_read_the_trainers_current_values() -> None:
    model, engine, export, copy, rebuild = _setup()
    first = export.message()
    copy.load(first, engine, UUID, 3)
    export.delivered()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(-2).add_(1)  # an optimizer step: in place, same storages
    again = export.message()
    assert again == {"generation": first["generation"]} and export.exports == 1  # no handles, no new export
    copy.load(again, engine, UUID, 3)
    assert rebuild.calls == 12  # mapped once
    for name, want in _expected(model).items():
        assert torch.equal(engine[name], want), name


def test_a_failed_sync_sends_the_handles_again_and_an_engine_without_them_refuses() -> None:
    _, engine, export, copy, _ = _setup()
    first = export.message()
    copy.load(first, engine, UUID, 3)
    export.delivered()
    short = export.message()
    other = type(copy)(rebuild=Rebuild())  # a replaced engine: no mapping
    with pytest.raises(RuntimeError, match="holds no mapping of generation"):
        other.load(short, engine, UUID, 3)
    export.delivered(False)
    assert export.message() is first  # the handles again, same generation
    assert other.load(export.message(), engine, UUID, 3) == 12


def test_a_moved_parameter_makes_a_new_generation_that_the_engine_maps_again() -> None:
    model, engine, export, copy, rebuild = _setup()
    first = export.message()
    copy.load(first, engine, UUID, 3)
    export.delivered()
    norm = dict(model.named_parameters())["model.norm.weight"]
    norm.data = torch.full_like(norm.data, 7.0)  # a new storage (e.g. a checkpoint loaded by assignment)
    second = export.message()
    assert second is not None and second["generation"] != first["generation"] and export.exports == 2
    copy.load(second, engine, UUID, 3)
    assert rebuild.calls == 24 and torch.equal(engine["model.norm.weight"], torch.full((8,), 7.0))


def test_a_cast_is_no_view_of_the_parameters_and_keeps_vllms_path() -> None:
    model, engine = _model(), _engine_params()
    source = ParamSource(model, torch.float64)  # the spec dtype differs from the trainer's: a cast per sync
    export = ResidentExport(_plan(source, engine), source, export=_export, device_type="cpu")
    assert export.message() is None
    assert "not a view of a trainer parameter" in export.reason
    no_plan = ResidentExport(KernelPlan([], False, "x"), source, export=_export, device_type="cpu")
    assert no_plan.message() is None and no_plan.reason == "no kernel plan"


def _bad(msg: dict[str, Any], change: str) -> dict[str, Any]:
    entries = [[n, list(h)] for n, h in msg["entries"]]
    if change == "name":
        entries[-1][0] = "model.missing.weight"
    elif change == "gpu":
        entries[-1][1] = [{"GPU-other": h[UUID]} for h in entries[-1][1]]
    elif change == "parts":
        qkv = next(e for e in entries if e[0].endswith("qkv_proj.weight"))
        qkv[1] = qkv[1][:2]  # v missing: the parts do not fill the parameter
    elif change == "dtype":
        norm = next(e for e in entries if e[0] == "model.norm.weight")
        norm[1] = [_export(torch.zeros(8, dtype=torch.float64))]
    return {"generation": msg["generation"] + change, "entries": entries}


@pytest.mark.parametrize(("change", "error", "match"), [
    ("name", KeyError, "not a parameter of the engine"),
    ("gpu", ValueError, "no handle for this engine's GPU"),
    ("parts", ValueError, "do not fill the engine's parameter"),
    ("dtype", ValueError, r"is \[8\] torch.float64.*takes \[8\] torch.float32"),
])
def test_a_message_that_does_not_fit_the_engine_is_refused_before_anything_is_written(change, error, match) -> None:
    model, engine, export, copy, _ = _setup()
    copy.load(export.message(), engine, UUID, 3)
    before = {n: t.clone() for n, t in engine.items()}
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1)
    with pytest.raises(error, match=match):
        copy.load(_bad(export.message(), change), engine, UUID, 3)
    assert all(torch.equal(engine[n], before[n]) for n in engine)
    assert copy.generation is None and copy.src == []  # the old mapping was released, none half-built is kept


def test_the_worker_engine_takes_resident_update_infos() -> None:
    """vLLM parses the update dict into the engine's ``update_info_cls``: the resident message passes through."""
    from rlhf_runtime.weight_sync.kernel import RlhfIPCWeightTransferEngine

    info = RlhfIPCWeightTransferEngine.update_info_cls(names=[], dtype_names=[], shapes=[], ipc_handles={},
                                                      resident={"generation": "g", "entries": []})
    assert info.resident == {"generation": "g", "entries": []}


def test_a_padded_vocabulary_takes_its_rows_of_the_trainers_parameter_and_keeps_its_padding() -> None:
    """vLLM pads the embedding to a multiple of 64 rows: the engine maps the trainer's unpadded embedding and
    copies it into the first rows of its parameter (``vocab``: ``kernel.vocab_slices``); the padding stays."""
    model, engine, export, copy, _ = _setup()
    emb = engine["model.embed_tokens.weight"]
    rows = emb.shape[0]
    padded = torch.full((rows + 64 - rows % 64, *emb.shape[1:]), -1.0)
    engine["model.embed_tokens.weight"] = padded
    msg = export.message()
    with pytest.raises(ValueError, match="do not fill the engine's parameter"):  # without the report: refused
        copy.load(msg, engine, UUID, 3)
    copy = type(copy)(rebuild=Rebuild())
    assert copy.load(msg, engine, UUID, 3, {"model.embed_tokens.weight": (rows, 0, rows)}) == 12
    assert torch.equal(padded[:rows], _expected(model)["model.embed_tokens.weight"])
    assert bool((padded[rows:] == -1.0).all())
