"""SigLIP vision transformer (Gemma 3, PaliGemma, Idefics3 / SmolVLM, ...): a plain pre-LN ViT
without class token.

Patch embedding (a stride-p conv with bias, as a matmul on flattened patches), learned position
embeddings, pre-LN blocks (MHA with biases, GELU-tanh MLP), and the final `post_layernorm`
(HF's `last_hidden_state`). The attention-pooling head (`vision_use_head`) is not part of any VLM
feature path: its tensors are ignored at load.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import jax
import numpy as np

from mmjax.attention import attention
from mmjax.checkpoint import TensorSource, linear, norm
from mmjax.errors import UnsupportedModelError
from mmjax.models.hf_config import require
from mmjax.models.layers import activation, dense, layer_norm
from mmjax.models.vision.clip import patchify


# Vision configs whose tower is this SigLIP ViT. Idefics3's (SmolVLM's) is SigLIP with NaViT-style
# position ids for padded images; its processors only produce full square tiles, whose position
# ids are the plain row-major ones used here.
SIGLIP_TYPES = ("siglip_vision_model", "siglip", "idefics3_vision", "smolvlm_vision")


@dataclass(frozen=True)
class SiglipVisionConfig:
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    image_size: int
    patch_size: int
    layer_norm_eps: float = 1e-6
    hidden_act: str = "gelu_pytorch_tanh"
    num_channels: int = 3

    @classmethod
    def from_hf(cls, cfg: dict, where: str = "vision_config") -> "SiglipVisionConfig":
        mt = cfg.get("model_type", "siglip_vision_model")
        if mt not in SIGLIP_TYPES:
            raise UnsupportedModelError(f"config.json: {where}.model_type={mt!r} is not supported "
                                        f"({', '.join(SIGLIP_TYPES)})", param=f"{where}.model_type")
        size, patch = require(cfg, "image_size", where, 224), require(cfg, "patch_size", where, 16)
        if isinstance(size, (list, tuple)) or isinstance(patch, (list, tuple)):
            raise UnsupportedModelError(f"config.json: {where}: non-square image_size / patch_size is not supported",
                                        param=f"{where}.image_size")
        act = cfg.get("hidden_act", "gelu_pytorch_tanh")
        activation(act)  # unsupported names fail at load
        return cls(hidden_size=int(require(cfg, "hidden_size", where, 768)),
                   intermediate_size=int(require(cfg, "intermediate_size", where, 3072)),
                   num_layers=int(require(cfg, "num_hidden_layers", where, 12)),
                   num_heads=int(require(cfg, "num_attention_heads", where, 12)),
                   image_size=int(size), patch_size=int(patch),
                   layer_norm_eps=float(cfg.get("layer_norm_eps", 1e-6)), hidden_act=act,
                   num_channels=int(cfg.get("num_channels", 3)))

    @property
    def patches_per_side(self) -> int:
        return self.image_size // self.patch_size

    @property
    def num_patches(self) -> int:
        return self.patches_per_side ** 2


def load_siglip_params(src: TensorSource, cfg: SiglipVisionConfig, prefix: str) -> dict:
    """HF SiglipVisionModel weights (under `prefix`, e.g. "vision_tower.vision_model.") -> params."""
    d, p, c = cfg.hidden_size, cfg.patch_size, cfg.num_channels
    conv = src.take(f"{prefix}embeddings.patch_embedding.weight", (d, c, p, p))
    params = {
        # conv [out, c, ph, pw] -> [ph*pw*c, out], matching patchify's (ph, pw, c) flattening
        "patch_embed": {"w": np.ascontiguousarray(conv.transpose(2, 3, 1, 0).reshape(p * p * c, d)),
                        "b": src.take(f"{prefix}embeddings.patch_embedding.bias", (d,))},
        "pos_embed": src.take(f"{prefix}embeddings.position_embedding.weight", (cfg.num_patches, d)),
        "post_ln": norm(src, f"{prefix}post_layernorm", d),
        "layers": [],
    }
    for i in range(cfg.num_layers):
        lp = f"{prefix}encoder.layers.{i}."
        params["layers"].append({
            "ln1": norm(src, lp + "layer_norm1", d),
            "q": linear(src, lp + "self_attn.q_proj", d, d, True),
            "k": linear(src, lp + "self_attn.k_proj", d, d, True),
            "v": linear(src, lp + "self_attn.v_proj", d, d, True),
            "o": linear(src, lp + "self_attn.out_proj", d, d, True),
            "ln2": norm(src, lp + "layer_norm2", d),
            "fc1": linear(src, lp + "mlp.fc1", d, cfg.intermediate_size, True),
            "fc2": linear(src, lp + "mlp.fc2", cfg.intermediate_size, d, True),
        })
    src.ignore(re.escape(prefix) + r"head\..*")
    return params


def siglip_block(p: dict, x: jax.Array, cfg: SiglipVisionConfig) -> jax.Array:
    """One pre-LN block. x [batch, patches, hidden]."""
    b, s, d = x.shape
    heads, hd = cfg.num_heads, d // cfg.num_heads
    h = layer_norm(p["ln1"], x, cfg.layer_norm_eps)
    q = dense(p["q"], h).reshape(b, s, heads, hd)
    k = dense(p["k"], h).reshape(b, s, heads, hd)
    v = dense(p["v"], h).reshape(b, s, heads, hd)
    x = x + dense(p["o"], attention(q, k, v).reshape(b, s, d))
    h = layer_norm(p["ln2"], x, cfg.layer_norm_eps)
    return x + dense(p["fc2"], activation(cfg.hidden_act)(dense(p["fc1"], h)))


def siglip_hidden_states(params: dict, pixels: jax.Array, cfg: SiglipVisionConfig) -> list[jax.Array]:
    """pixels [batch, H, W, 3] -> hidden states [batch, patches, hidden] after the embeddings
    (index 0) and after each block, without the post layernorm: index i is HF's
    `hidden_states[i]` (what LLaVA-OneVision's vision_feature_layer selects)."""
    x = dense(params["patch_embed"], patchify(pixels.astype(params["pos_embed"].dtype), cfg.patch_size))
    x = x + params["pos_embed"][None]
    states = [x]
    for layer in params["layers"]:
        x = siglip_block(layer, x, cfg)
        states.append(x)
    return states


def siglip_features(params: dict, pixels: jax.Array, cfg: SiglipVisionConfig) -> jax.Array:
    """pixels [batch, H, W, 3] -> post-layernormed patch features [batch, patches, hidden]
    (HF's `last_hidden_state`), patches in row-major grid order."""
    return layer_norm(params["post_ln"], siglip_hidden_states(params, pixels, cfg)[-1], cfg.layer_norm_eps)
