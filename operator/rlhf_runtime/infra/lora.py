"""LoRA training with adapter-only weight sync (``spec.trainer.lora``).

The trainer wraps the base model with PEFT (``wrap``): every base parameter is frozen, each target module gets a
trainable ``lora_A`` (r x in) and ``lora_B`` (out x r, zero at start, so training starts at the base model), and
the forward pass computes ``W x + (alpha / r) B A x``. A weight sync sends only the adapter, as PEFT's adapter
files (``adapter_files``):

* ``adapter_config.json``: ``{"peft_type": "LORA", "r", "lora_alpha", "target_modules", ...}`` (``adapter_config``);
* ``adapter_model.safetensors``: one tensor per ``base_model.model.<module>.lora_A.weight`` / ``.lora_B.weight``
  (``adapter_key``), in the spec dtype.

Those are the files PEFT's ``save_pretrained`` writes and what vLLM's ``LoRARequest`` loads, so an engine writes
them to a directory and serves rollouts with it (``engines.Engine.load_adapter``). ``merge`` gives the plain
weights the adapter stands for, ``W' = W + (alpha / r) B A`` (computed in float32, then cast back), which exports
and weight-sync validation use: any engine loads them without LoRA support.

Pure parts (key names, config, (de)serialisation, merge) take tensors and dicts; torch, safetensors and PEFT are
imported inside the functions that need them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from rlhf_api.models import LoRA

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
#: PEFT's prefix of a causal LM's adapter tensors (``PeftModel`` -> ``LoraModel`` -> the HF model).
PEFT_PREFIX = "base_model.model."
ADAPTER_NAME = "default"


def scale(lora: LoRA) -> float:
    """The factor of the low-rank update: ``alpha / rank`` (PEFT's ``scaling`` without rsLoRA)."""
    return lora.alpha / lora.rank


def adapter_key(module: str, part: str) -> str:
    """The tensor name of ``part`` (``"A"`` or ``"B"``) of ``module``'s adapter in PEFT's adapter files, e.g.
    ``model.layers.0.self_attn.q_proj`` -> ``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight``."""
    if part not in ("A", "B"):
        raise ValueError(f"part must be A or B, not {part!r}")
    return f"{PEFT_PREFIX}{module}.lora_{part}.weight"


def module_of(key: str) -> tuple[str, str]:
    """Inverse of ``adapter_key``: ``(module, part)``."""
    for part in ("A", "B"):
        suffix = f".lora_{part}.weight"
        if key.startswith(PEFT_PREFIX) and key.endswith(suffix):
            return key[len(PEFT_PREFIX) : -len(suffix)], part
    raise ValueError(f"{key!r} is not a LoRA adapter tensor name (base_model.model.<module>.lora_A|B.weight)")


def adapter_config(lora: LoRA, base_model: str) -> dict[str, Any]:
    """PEFT's ``adapter_config.json`` for ``lora`` (the fields PEFT and vLLM read; PEFT fills in the rest)."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": lora.rank,
        "lora_alpha": lora.alpha,
        "lora_dropout": lora.dropout,
        "target_modules": sorted(lora.target_modules),
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
        "init_lora_weights": True,
    }


def serialize(tensors: dict[str, Any], config: dict[str, Any]) -> dict[str, bytes]:
    """The adapter files (name -> bytes): ``adapter_model.safetensors`` (``tensors``, contiguous, on the CPU)
    and ``adapter_config.json``."""
    from safetensors.torch import save

    cpu = {k: v.detach().to("cpu").contiguous() for k, v in sorted(tensors.items())}
    return {WEIGHTS_FILE: save(cpu, metadata={"format": "pt"}),
            CONFIG_FILE: json.dumps(config, indent=2, sort_keys=True).encode()}


def deserialize(files: dict[str, bytes]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Inverse of ``serialize``: ``(tensors, config)``."""
    from safetensors.torch import load

    missing = {WEIGHTS_FILE, CONFIG_FILE} - set(files)
    if missing:
        raise ValueError(f"adapter files without {', '.join(sorted(missing))}")
    return load(files[WEIGHTS_FILE]), json.loads(files[CONFIG_FILE])


def write_files(files: dict[str, bytes], directory: str | Path) -> Path:
    """Write the adapter files into ``directory`` (created); returns it."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    for name, data in files.items():
        if name not in (WEIGHTS_FILE, CONFIG_FILE):
            raise ValueError(f"{name!r} is not an adapter file")
        (out / name).write_bytes(data)
    return out


def read_files(directory: str | Path) -> dict[str, bytes]:
    """The adapter files of ``directory`` (``write_files``, or PEFT's ``save_pretrained``)."""
    d = Path(directory)
    return {name: (d / name).read_bytes() for name in (WEIGHTS_FILE, CONFIG_FILE)}


def merge(base: dict[str, Any], adapter: dict[str, Any], factor: float) -> dict[str, Any]:
    """The merged weights: ``base`` (HF names, ``<module>.weight``) with ``W + factor * B @ A`` for every module
    of ``adapter`` (PEFT names, ``adapter_key``), computed in float32 and cast to the base dtype; other tensors
    are ``base``'s own (not copied). Raises ValueError when an adapter tensor has no base weight, lacks its other
    half, or does not fit the base weight's shape."""
    import torch

    parts: dict[str, dict[str, Any]] = {}
    for key, t in adapter.items():
        module, part = module_of(key)
        parts.setdefault(module, {})[part] = t
    out = dict(base)
    for module, ab in sorted(parts.items()):
        if set(ab) != {"A", "B"}:
            raise ValueError(f"adapter of {module} has lora_{''.join(sorted(ab))} only")
        name = f"{module}.weight"
        if name not in base:
            raise ValueError(f"adapter module {module} has no base weight {name}")
        w, a, b = base[name], ab["A"], ab["B"]
        if tuple(b.shape[:1]) + tuple(a.shape[1:]) != tuple(w.shape) or b.shape[1] != a.shape[0]:
            raise ValueError(f"adapter of {module} (B {list(b.shape)} x A {list(a.shape)}) does not fit "
                             f"{name} {list(w.shape)}")
        delta = b.to(device=w.device, dtype=torch.float32) @ a.to(device=w.device, dtype=torch.float32)
        out[name] = (w.to(torch.float32) + factor * delta).to(w.dtype)
    return out


# ------------------------------------------------------------------------------------- trainer side (PEFT)
def wrap(model: Any, lora: LoRA) -> Any:
    """``model`` (an HF causal LM) as a PEFT ``PeftModel`` with a fresh adapter: base parameters frozen, the
    adapter's trainable. A target module the model does not have raises ValueError naming the field."""
    from peft import LoraConfig, get_peft_model

    cfg = LoraConfig(r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                     target_modules=list(lora.target_modules), bias="none", task_type="CAUSAL_LM")
    try:
        return get_peft_model(model, cfg, adapter_name=ADAPTER_NAME)
    except ValueError as e:
        raise ValueError(f"spec.trainer.lora.targetModules {list(lora.target_modules)} do not fit the model: "
                         f"{e}") from e


def adapter_tensors(model: Any) -> dict[str, Any]:
    """The adapter of a ``wrap``ped model under PEFT's file names (``adapter_key``)."""
    from peft import get_peft_model_state_dict

    return dict(get_peft_model_state_dict(model, adapter_name=ADAPTER_NAME))


def load_adapter(model: Any, tensors: dict[str, Any]) -> None:
    """Set the adapter of a ``wrap``ped model from ``tensors`` (PEFT's file names); every adapter tensor must be
    there (a checkpoint of another rank or target modules fails here instead of training from zero)."""
    from peft import set_peft_model_state_dict

    expected = set(adapter_tensors(model))
    if set(tensors) != expected:
        missing, extra = sorted(expected - set(tensors)), sorted(set(tensors) - expected)
        raise ValueError(f"the adapter does not match spec.trainer.lora: missing {missing[:4]}, unexpected "
                         f"{extra[:4]} ({len(missing)} missing, {len(extra)} unexpected)")
    set_peft_model_state_dict(model, tensors, adapter_name=ADAPTER_NAME)


def base_state(model: Any) -> dict[str, Any]:
    """The frozen base weights of a ``wrap``ped model under their plain HF names (PEFT's ``base_layer`` level
    removed, adapter tensors left out)."""
    out = {}
    for key, t in model.get_base_model().state_dict().items():
        if ".lora_" in key:
            continue
        out[key.replace(".base_layer.", ".")] = t
    return out


def merged_state(model: Any, lora: LoRA) -> dict[str, Any]:
    """The plain weights the trained adapter stands for (``merge`` of ``base_state`` and the adapter)."""
    return merge(base_state(model), adapter_tensors(model), scale(lora))
