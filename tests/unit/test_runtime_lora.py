"""LoRA's pure parts (``rlhf_runtime.infra.lora``: key names, adapter files, merge) against real PEFT on a tiny Qwen2
built in memory, and the engine settings LoRA needs (``rlhf_runtime.infra.config``)."""

from __future__ import annotations

import json

import pytest
import torch
from pydantic import ValidationError

from rlhf_api.models import LoRA, RLHFJobSpec
from rlhf_runtime.infra import config as rc
from rlhf_runtime.infra import lora

ATTN = ["q_proj", "k_proj", "v_proj", "o_proj"]


def tiny_base(seed: int = 0):
    """A 2-layer Qwen2, random init (the same weights for the same seed)."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=16, tie_word_embeddings=False)
    return AutoModelForCausalLM.from_config(cfg).to(torch.float32)


def tiny_peft(lora_spec: LoRA, seed: int = 0):
    """``tiny_base`` wrapped by ``lora.wrap``, with a non-zero adapter."""
    model = lora.wrap(tiny_base(seed), lora_spec)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.copy_(torch.randn_like(p) * 0.1)
    return model


def spec(**trainer) -> RLHFJobSpec:
    return RLHFJobSpec.model_validate({"model": {"name": "m", "dtype": "float32"}, "image": "i",
                                       "trainer": {"gpusPerReplica": 0, **trainer},
                                       "data": {"prompts": ["a"]}, "reward": {"rule": "length"}})


def test_adapter_key_is_peft_file_naming_and_round_trips() -> None:
    key = lora.adapter_key("model.layers.0.self_attn.q_proj", "A")
    assert key == "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    assert lora.module_of(key) == ("model.layers.0.self_attn.q_proj", "A")
    assert lora.module_of(lora.adapter_key("x.y", "B")) == ("x.y", "B")
    with pytest.raises(ValueError, match="not a LoRA adapter tensor"):
        lora.module_of("model.layers.0.self_attn.q_proj.weight")
    with pytest.raises(ValueError):
        lora.adapter_key("x", "C")


def test_peft_names_its_adapter_tensors_as_adapter_key_says() -> None:
    model = tiny_peft(LoRA(rank=4, alpha=8, target_modules=["q_proj", "down_proj"]))
    names = set(lora.adapter_tensors(model))
    expected = {lora.adapter_key(f"model.layers.{i}.{m}", p) for i in range(2)
                for m in ("self_attn.q_proj", "mlp.down_proj") for p in "AB"}
    assert names == expected
    # the base is frozen, the adapter trains
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert len(trainable) == 8 and all(".lora_" in n for n in trainable)


def test_adapter_files_round_trip() -> None:
    spec_lora = LoRA(rank=4, alpha=8, target_modules=ATTN)
    model = tiny_peft(spec_lora)
    t = lora.adapter_tensors(model)
    files = lora.serialize(t, lora.adapter_config(spec_lora, "/models/base"))
    assert set(files) == {"adapter_model.safetensors", "adapter_config.json"}
    back, cfg = lora.deserialize(files)
    assert set(back) == set(t) and all(torch.equal(back[k], t[k]) for k in t)
    assert cfg["r"] == 4 and cfg["lora_alpha"] == 8 and cfg["peft_type"] == "LORA"
    assert cfg["target_modules"] == sorted(ATTN) and cfg["base_model_name_or_path"] == "/models/base"
    with pytest.raises(ValueError, match="adapter_config.json"):
        lora.deserialize({"adapter_model.safetensors": files["adapter_model.safetensors"]})


def test_adapter_files_on_disk_load_in_peft(tmp_path) -> None:
    from peft import PeftModel

    spec_lora = LoRA(rank=4, alpha=8, target_modules=ATTN)
    model = tiny_peft(spec_lora, seed=1)
    files = lora.serialize(lora.adapter_tensors(model), lora.adapter_config(spec_lora, "base"))
    lora.write_files(files, tmp_path / "adapter")
    assert lora.read_files(tmp_path / "adapter") == files
    with pytest.raises(ValueError, match="not an adapter file"):
        lora.write_files({"model.safetensors": b""}, tmp_path / "x")
    # PEFT itself loads the files onto a fresh base: same outputs as the model they came from
    fresh = tiny_base(seed=1)
    ids = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad():
        before = fresh(ids).logits
        fresh_peft = PeftModel.from_pretrained(fresh, str(tmp_path / "adapter"))
        after = fresh_peft(ids).logits
        assert torch.allclose(after, model(ids).logits, atol=1e-6)
        assert not torch.allclose(after, before, atol=1e-3)  # the adapter was loaded, not ignored


def test_merge_is_base_plus_scaled_b_times_a() -> None:
    torch.manual_seed(0)
    w, other = torch.randn(6, 5), torch.randn(3)
    a, b = torch.randn(2, 5), torch.randn(6, 2)
    base = {"m.proj.weight": w, "m.norm.weight": other}
    merged = lora.merge(base, {lora.adapter_key("m.proj", "A"): a, lora.adapter_key("m.proj", "B"): b}, 2.5)
    assert torch.allclose(merged["m.proj.weight"], w + 2.5 * b @ a, atol=1e-6)
    assert merged["m.norm.weight"] is other and base["m.proj.weight"] is w  # untouched, nothing modified
    half = {lora.adapter_key("m.proj", "A"): a}
    with pytest.raises(ValueError, match="lora_A only"):
        lora.merge(base, half, 1.0)
    with pytest.raises(ValueError, match="no base weight"):
        lora.merge(base, {lora.adapter_key("m.gone", p): t for p, t in (("A", a), ("B", b))}, 1.0)
    with pytest.raises(ValueError, match="does not fit"):
        lora.merge(base, {lora.adapter_key("m.proj", "A"): a, lora.adapter_key("m.proj", "B"): torch.randn(4, 2)},
                   1.0)


def test_merge_keeps_the_base_dtype() -> None:
    w = torch.randn(4, 4).to(torch.bfloat16)
    merged = lora.merge({"p.weight": w}, {lora.adapter_key("p", "A"): torch.randn(1, 4),
                                          lora.adapter_key("p", "B"): torch.randn(4, 1)}, 1.0)
    assert merged["p.weight"].dtype == torch.bfloat16


def test_merged_state_equals_peft_merge_and_unload() -> None:
    spec_lora = LoRA(rank=4, alpha=16, target_modules=["q_proj", "v_proj", "up_proj"])
    model = tiny_peft(spec_lora)
    ours = lora.merged_state(model, spec_lora)
    peft_merged = model.merge_and_unload().state_dict()  # modifies the model: last
    assert set(ours) == set(peft_merged)
    for k, v in peft_merged.items():
        assert torch.allclose(ours[k], v, atol=1e-6), k


def test_unknown_target_module_and_foreign_adapter_are_refused() -> None:
    with pytest.raises(ValueError, match="spec.trainer.lora.targetModules"):
        tiny_peft(LoRA(target_modules=["query_key_value"]))
    model = tiny_peft(LoRA(rank=4, target_modules=["q_proj"]))
    other = lora.adapter_tensors(tiny_peft(LoRA(rank=4, target_modules=["v_proj"])))
    with pytest.raises(ValueError, match="does not match spec.trainer.lora"):
        lora.load_adapter(model, other)


def test_engine_settings_with_and_without_lora() -> None:
    assert [rc.vllm_max_lora_rank(r) for r in (1, 2, 8, 9, 100, 256)] == [1, 8, 8, 16, 128, 256]
    plain = rc.engine_kwargs(spec(), "m", "gloo", "uni", gpu=False)
    assert plain["load_format"] == "dummy" and not set(rc.LORA_ENGINE_KEYS) & set(plain)
    kw = rc.engine_kwargs(spec(lora={"rank": 12}), "m", "gloo", "uni", gpu=False)
    assert kw["load_format"] == "auto"  # the base model's real weights: no sync sends them
    assert (kw["enable_lora"], kw["max_lora_rank"], kw["max_loras"]) == (True, 16, 1)


def test_lora_api_defaults_limits_and_unsupported_combinations() -> None:
    lo = spec(lora={}).trainer.lora
    assert (lo.rank, lo.alpha, lo.target_modules, lo.dropout) == (8, 16, ATTN, 0.0)
    assert lora.scale(lo) == 2.0
    for bad in ({"rank": 0}, {"rank": 257}, {"dropout": 1.0}, {"targetModules": []}, {"targetModules": ["a b"]}):
        with pytest.raises(ValidationError):
            spec(lora=bad)
    rc.check_lora(spec(lora={}))
    with pytest.raises(ValueError, match="strategy 'single'"):
        rc.check_lora(spec(lora={}, strategy="fsdp2", replicas=2))
    async_spec = spec(lora={}).model_copy(update={"weight_sync": spec().weight_sync.model_copy(update={"mode": "async"})})
    with pytest.raises(ValueError, match="weightSync.mode 'sync'"):
        rc.check_lora(async_spec)
    assert json.loads(spec().model_dump_json(by_alias=True))["trainer"].get("lora") is None
