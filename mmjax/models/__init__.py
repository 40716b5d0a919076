"""All model code, and the family registry: HF `model_type` (or an `architectures` entry, which wins
where one type has several) -> the module implementing that family.

A family module provides `load(path, hf_cfg, dtype) -> (Family, the abstract model, its
TensorSource)` (see models/family.py); `load_family` fills the model from the checkpoint
(nn/weights.py). Adding a family is its module(s) plus one line here.
"""
from __future__ import annotations

import importlib
from pathlib import Path

from mmjax.errors import UnsupportedModelError

FAMILIES: dict[str, str] = {
    "llava": "mmjax.models.llava",
    "qwen2_vl": "mmjax.models.qwen2_vl",
    "qwen2_5_vl": "mmjax.models.qwen2_vl",
    "qwen3_vl": "mmjax.models.qwen3_vl",
    "qwen3_vl_moe": "mmjax.models.qwen3_vl",
    "qwen3_5": "mmjax.models.qwen3_5", "qwen3_5_moe": "mmjax.models.qwen3_5",
    "gemma3": "mmjax.models.gemma3",
    "gemma4": "mmjax.models.gemma4",
    "llava_next": "mmjax.models.llava_next",
    "llava_onevision": "mmjax.models.llava_next",
    "idefics3": "mmjax.models.idefics3",
    "smolvlm": "mmjax.models.idefics3",
    "mistral3": "mmjax.models.mistral3",
    "mllama": "mmjax.models.mllama",
    "internvl": "mmjax.models.internvl",
    "llama4": "mmjax.models.llama4",
    **dict.fromkeys(("glm4v", "glm4v_moe", "glm46v"), "mmjax.models.glm4v"),
    "minicpmv4_6": "mmjax.models.minicpmv", "minicpmv4_7": "mmjax.models.minicpmv",
}


def family_module(hf_cfg: dict):
    """The module registered for this config.json (architectures first, then model_type)."""
    for arch in hf_cfg.get("architectures") or ():
        if arch in FAMILIES:
            return importlib.import_module(FAMILIES[arch])
    mt = hf_cfg.get("model_type")
    if mt not in FAMILIES:
        supported = ", ".join(sorted(k for k in FAMILIES if k.islower()))
        raise UnsupportedModelError(f"config.json: model_type={mt!r} is not supported (supported: {supported})",
                                    param="model_type")
    return importlib.import_module(FAMILIES[mt])


def build_family(path: Path, hf_cfg: dict, dtype=None):
    """config.json + processor configs -> (Family, the model built abstractly, its TensorSource)."""
    import jax.numpy as jnp
    return family_module(hf_cfg).load(Path(path), hf_cfg, dtype or jnp.float32)


def load_family(path: Path, hf_cfg: dict, dtype=None, **weights):
    """config.json + weights + processor configs -> (Family, the loaded model). `weights`: the
    options of `nn.Weights` (placement, pack, quantize, group_size, on_device)."""
    import jax.numpy as jnp
    from mmjax.models.nn.weights import Weights
    family, model, src = build_family(path, hf_cfg, dtype)
    w = Weights(src, dtype=dtype or jnp.float32, **weights)
    model.hf_weights(w)
    w.finish(model)
    return family, model
