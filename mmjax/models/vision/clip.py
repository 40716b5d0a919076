"""CLIP vision transformer (as used by LLaVA-1.5): pre-LN blocks, class token, learned positions."""
from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np

from dataclasses import dataclass

from mmjax.attention import attention
from mmjax.checkpoint import TensorSource, linear, norm
from mmjax.errors import UnsupportedModelError
from mmjax.models.hf_config import require
from mmjax.models.layers import activation, dense, layer_norm, matmul


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
        return cls(hidden_size=int(require(cfg, "hidden_size", where, 1024)),
                   intermediate_size=int(require(cfg, "intermediate_size", where, 4096)),
                   num_layers=int(require(cfg, "num_hidden_layers", where, 24)),
                   num_heads=int(require(cfg, "num_attention_heads", where, 16)),
                   image_size=int(require(cfg, "image_size", where, 336)),
                   patch_size=int(require(cfg, "patch_size", where, 14)),
                   layer_norm_eps=float(cfg.get("layer_norm_eps", 1e-5)),
                   hidden_act=cfg.get("hidden_act", "quick_gelu"),
                   num_channels=int(cfg.get("num_channels", 3)))

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2


def load_clip_params(src: TensorSource, cfg: ClipVisionConfig, prefix: str, num_layers: int) -> dict:
    """HF CLIPVisionModel weights -> params. Only the first `num_layers` blocks are kept (LLaVA
    reads an inner layer; the blocks after it never influence the output)."""
    d, p, c = cfg.hidden_size, cfg.patch_size, cfg.num_channels
    conv = src.take(f"{prefix}embeddings.patch_embedding.weight", (d, c, p, p))
    params = {
        # conv [out, c, ph, pw] -> [ph*pw*c, out] to match patches flattened as (ph, pw, c)
        "patch_embed": np.ascontiguousarray(conv.transpose(2, 3, 1, 0).reshape(p * p * c, d)),
        "class_embed": src.take(f"{prefix}embeddings.class_embedding", (d,)),
        "pos_embed": src.take(f"{prefix}embeddings.position_embedding.weight", (cfg.num_patches + 1, d)),
        "pre_ln": norm(src, f"{prefix}pre_layrnorm", d),
        "layers": [],
    }
    for i in range(num_layers):
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
    src.ignore(re.escape(prefix) + r"(post_layernorm|encoder\.layers\.\d+)\..*")
    return params


def patchify(pixels: jax.Array, patch: int) -> jax.Array:
    """[b, h, w, c] -> [b, (h/p)*(w/p), p*p*c], row-major over the patch grid like a stride-p conv."""
    b, h, w, c = pixels.shape
    x = pixels.reshape(b, h // patch, patch, w // patch, patch, c)
    return x.transpose(0, 1, 3, 2, 4, 5).reshape(b, (h // patch) * (w // patch), patch * patch * c)


def clip_block(p: dict, x: jax.Array, cfg: ClipVisionConfig) -> jax.Array:
    """One pre-LN transformer block. x: [batch, seq, hidden]."""
    b, s, d = x.shape
    heads, hd = cfg.num_heads, d // cfg.num_heads
    h = layer_norm(p["ln1"], x, cfg.layer_norm_eps)
    q = dense(p["q"], h).reshape(b, s, heads, hd)
    k = dense(p["k"], h).reshape(b, s, heads, hd)
    v = dense(p["v"], h).reshape(b, s, heads, hd)
    x = x + dense(p["o"], attention(q, k, v).reshape(b, s, d))
    h = layer_norm(p["ln2"], x, cfg.layer_norm_eps)
    return x + dense(p["fc2"], activation(cfg.hidden_act)(dense(p["fc1"], h)))


def clip_hidden_states(params: dict, pixels: jax.Array, cfg: ClipVisionConfig) -> list[jax.Array]:
    """pixels [batch, H, W, 3] -> hidden states after embeddings (index 0) and after each kept block.

    Index i matches HF's `hidden_states[i]` (output_hidden_states=True).
    """
    x = matmul(patchify(pixels.astype(params["patch_embed"].dtype), cfg.patch_size), params["patch_embed"])
    cls = jnp.broadcast_to(params["class_embed"], (x.shape[0], 1, x.shape[-1]))
    x = jnp.concatenate([cls, x], axis=1) + params["pos_embed"][None]
    x = layer_norm(params["pre_ln"], x, cfg.layer_norm_eps)
    states = [x]
    for layer in params["layers"]:
        x = clip_block(layer, x, cfg)
        states.append(x)
    return states
