"""Text decoders: one module per architecture, each an `nn.Decoder` (embed -> layers -> norm ->
head) built from its config.

`text_config(hf_text_config)` parses a HF text config by its `model_type` (one registration per
architecture in `TEXT_MODELS`) into the architecture's config dataclass; `config.build(dtype)`
builds the decoder module (under `nnx.eval_shape` when loading: shapes only).
"""
from __future__ import annotations

import importlib

from mmjax.errors import UnsupportedModelError

# HF text `model_type` -> module with `config_from_hf(cfg, where, **overrides) -> config` (the
# config's `build(dtype)` makes the decoder).
TEXT_MODELS = {
    "llama": "mmjax.models.text.llama",
    "mistral": "mmjax.models.text.llama",
    "qwen2": "mmjax.models.text.llama",
    "gemma3_text": "mmjax.models.text.gemma3",
    "gemma4_text": "mmjax.models.text.gemma4",
    "glm4v_text": "mmjax.models.text.glm4",
    "glm4v_moe_text": "mmjax.models.text.glm4",
    "qwen3_5_text": "mmjax.models.text.qwen3_5",
    "qwen3_5_moe_text": "mmjax.models.text.qwen3_5",
}


def text_config(hf_text_cfg: dict, where: str = "text_config", **overrides):
    """The decoder config for a HF text config (its `model_type` picks the architecture)."""
    mt = hf_text_cfg.get("model_type", "llama")
    if mt not in TEXT_MODELS:
        raise UnsupportedModelError(f"config.json: {where}.model_type={mt!r} is not a supported decoder "
                                    f"(supported: {', '.join(sorted(TEXT_MODELS))})", param=f"{where}.model_type")
    return importlib.import_module(TEXT_MODELS[mt]).config_from_hf(hf_text_cfg, where, **overrides)
