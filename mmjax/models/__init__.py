"""All model code, and the family registry: HF `model_type` (or an `architectures` entry, which wins
where one type has several) -> the module implementing that family.

A family module provides `load(path, hf_cfg) -> (Family, numpy params)` (see models/family.py);
adding a family is its module(s) plus one line here.
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
    "gemma3": "mmjax.models.gemma3",
    "gemma4": "mmjax.models.gemma4",
    "llava_next": "mmjax.models.llava_next",
    "llava_onevision": "mmjax.models.llava_next",
    "idefics3": "mmjax.models.idefics3",
    "smolvlm": "mmjax.models.idefics3",
    "mistral3": "mmjax.models.mistral3",
    "mllama": "mmjax.models.mllama",
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


def load_family(path: Path, hf_cfg: dict):
    """config.json + weights + processor configs -> (Family, numpy params pytree)."""
    return family_module(hf_cfg).load(Path(path), hf_cfg)
