"""Typed model configs parsed from a Hugging Face config.json, one dataclass per building block.

Parsing is strict: an unsupported `model_type` or a missing required field raises an error naming
the field, so a bad checkpoint fails at load time, not inside a compiled step.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from mmjax.errors import CheckpointError, UnsupportedModelError


def _get(cfg: dict, key: str, where: str, default: Any = dataclasses.MISSING) -> Any:
    if key in cfg and cfg[key] is not None:
        return cfg[key]
    if default is dataclasses.MISSING:
        raise CheckpointError(f"config.json: required field '{where}.{key}' is missing", param=f"{where}.{key}")
    return default


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding. `rope_type` in {default, linear, llama3}; M-RoPE sections for Qwen2-VL."""
    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    mrope_section: tuple[int, ...] | None = None

    @classmethod
    def from_hf(cls, cfg: dict, where: str) -> "RopeConfig":
        # transformers v5 keeps RoPE settings in `rope_parameters`; v4 used rope_theta + rope_scaling.
        params = dict(cfg.get("rope_parameters") or {})
        legacy = cfg.get("rope_scaling") or {}
        for k, v in legacy.items():
            params.setdefault(k, v)
        if "type" in params and "rope_type" not in params:
            params["rope_type"] = params["type"]
        theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
        rope_type = params.get("rope_type", "default")
        if rope_type == "mrope":  # Qwen2-VL v4 configs name M-RoPE this way; it is default RoPE per section
            rope_type = "default"
        if rope_type not in ("default", "linear", "llama3"):
            raise UnsupportedModelError(
                f"config.json: {where}.rope_parameters.rope_type={rope_type!r} is not supported "
                "(supported: default, linear, llama3)", param=f"{where}.rope_parameters.rope_type")
        section = params.get("mrope_section")
        return cls(theta=float(theta), rope_type=rope_type, factor=float(params.get("factor", 1.0)),
                   low_freq_factor=float(params.get("low_freq_factor", 1.0)),
                   high_freq_factor=float(params.get("high_freq_factor", 4.0)),
                   original_max_position_embeddings=int(params.get(
                       "original_max_position_embeddings", cfg.get("max_position_embeddings", 8192))),
                   mrope_section=tuple(section) if section else None)


@dataclass(frozen=True)
class TextConfig:
    """A Llama-style decoder (Llama, Mistral, Qwen2 share this shape)."""
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope: RopeConfig
    hidden_act: str = "silu"
    attention_bias: bool = False
    mlp_bias: bool = False
    tie_word_embeddings: bool = False
    model_type: str = "llama"

    @classmethod
    def from_hf(cls, cfg: dict, where: str = "text_config", tie_default: bool = False) -> "TextConfig":
        mt = cfg.get("model_type", "llama")
        if mt not in ("llama", "mistral", "qwen2", "qwen2_vl_text", "qwen2_5_vl_text"):
            raise UnsupportedModelError(f"config.json: {where}.model_type={mt!r} is not a supported decoder "
                                        "(llama, mistral, qwen2)", param=f"{where}.model_type")
        hidden = int(_get(cfg, "hidden_size", where))
        heads = int(_get(cfg, "num_attention_heads", where))
        act = cfg.get("hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise UnsupportedModelError(f"config.json: {where}.hidden_act={act!r} not supported", param=f"{where}.hidden_act")
        return cls(
            vocab_size=int(_get(cfg, "vocab_size", where)),
            hidden_size=hidden,
            intermediate_size=int(_get(cfg, "intermediate_size", where)),
            num_layers=int(_get(cfg, "num_hidden_layers", where)),
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
            rope=RopeConfig.from_hf(cfg, where),
            hidden_act=act,
            attention_bias=bool(cfg.get("attention_bias", mt.startswith("qwen2"))),
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", tie_default)),
            model_type=mt,
        )


@dataclass(frozen=True)
class ClipVisionConfig:
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    image_size: int
    patch_size: int
    layer_norm_eps: float = 1e-5
    hidden_act: str = "quick_gelu"
    num_channels: int = 3

    @classmethod
    def from_hf(cls, cfg: dict, where: str = "vision_config") -> "ClipVisionConfig":
        mt = cfg.get("model_type", "clip_vision_model")
        if mt not in ("clip_vision_model", "clip"):
            raise UnsupportedModelError(f"config.json: {where}.model_type={mt!r} is not supported for LLaVA "
                                        "(clip_vision_model)", param=f"{where}.model_type")
        return cls(hidden_size=int(_get(cfg, "hidden_size", where, 1024)),
                   intermediate_size=int(_get(cfg, "intermediate_size", where, 4096)),
                   num_layers=int(_get(cfg, "num_hidden_layers", where, 24)),
                   num_heads=int(_get(cfg, "num_attention_heads", where, 16)),
                   image_size=int(_get(cfg, "image_size", where, 336)),
                   patch_size=int(_get(cfg, "patch_size", where, 14)),
                   layer_norm_eps=float(cfg.get("layer_norm_eps", 1e-5)),
                   hidden_act=cfg.get("hidden_act", "quick_gelu"),
                   num_channels=int(cfg.get("num_channels", 3)))

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2


@dataclass(frozen=True)
class LlavaConfig:
    vision: ClipVisionConfig
    text: TextConfig
    image_token_id: int
    vision_feature_layers: tuple[int, ...]
    select_strategy: str
    projector_act: str = "gelu"
    projector_bias: bool = True
    model_type: str = "llava"

    @classmethod
    def from_hf(cls, cfg: dict) -> "LlavaConfig":
        tie = bool(cfg.get("tie_word_embeddings", False))
        text = TextConfig.from_hf(_get(cfg, "text_config", "config"), "text_config", tie_default=tie)
        vision = ClipVisionConfig.from_hf(_get(cfg, "vision_config", "config"), "vision_config")
        layer = cfg.get("vision_feature_layer", -2)
        layers = tuple(layer) if isinstance(layer, (list, tuple)) else (int(layer),)
        strategy = cfg.get("vision_feature_select_strategy", "default")
        if strategy not in ("default", "full"):
            raise UnsupportedModelError(f"config.json: vision_feature_select_strategy={strategy!r} not supported",
                                        param="vision_feature_select_strategy")
        for l in layers:
            if not -(vision.num_layers + 1) <= l <= vision.num_layers:
                raise CheckpointError(f"config.json: vision_feature_layer={l} out of range for "
                                      f"{vision.num_layers} vision layers", param="vision_feature_layer")
        token = cfg.get("image_token_index", cfg.get("image_token_id"))
        if token is None:
            raise CheckpointError("config.json: image_token_index is missing", param="image_token_index")
        return cls(vision=vision, text=text, image_token_id=int(token), vision_feature_layers=layers,
                   select_strategy=strategy, projector_act=cfg.get("projector_hidden_act", "gelu"),
                   projector_bias=bool(cfg.get("multimodal_projector_bias", True)))

    @property
    def image_tokens_per_image(self) -> int:
        n = self.vision.num_patches + 1
        return n - 1 if self.select_strategy == "default" else n
