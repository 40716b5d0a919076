"""CLIP vision transformer (as used by LLaVA-1.5): pre-LN blocks, class token, learned positions."""
from __future__ import annotations

import re

import jax
import jax.numpy as jnp

from dataclasses import dataclass

from flax import nnx

from mmjax.errors import UnsupportedModelError
from mmjax.models.hf_config import require
from mmjax.models.nn.attention import VisionAttention
from mmjax.models.nn.linear import Linear, param
from mmjax.models.nn.mlp import MLP
from mmjax.models.nn.norm import LayerNorm
from mmjax.models.nn.weights import ignore_tail, load_children


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


def patchify(pixels: jax.Array, patch: int) -> jax.Array:
    """[b, h, w, c] -> [b, (h/p)*(w/p), p*p*c], row-major over the patch grid like a stride-p conv."""
    b, h, w, c = pixels.shape
    x = pixels.reshape(b, h // patch, patch, w // patch, patch, c)
    return x.transpose(0, 1, 3, 2, 4, 5).reshape(b, (h // patch) * (w // patch), patch * patch * c)


class ClipEncoderLayer(nnx.Module):
    """One pre-LN transformer block: layer_norm1, self_attn, layer_norm2, mlp (fc1, fc2)."""

    def __init__(self, cfg: ClipVisionConfig, dtype=jnp.float32):
        d = cfg.hidden_size
        self.layer_norm1 = LayerNorm(d, cfg.layer_norm_eps, dtype=dtype)
        self.self_attn = VisionAttention(d, cfg.num_heads, dtype=dtype)
        self.layer_norm2 = LayerNorm(d, cfg.layer_norm_eps, dtype=dtype)
        self.mlp = MLP(d, cfg.intermediate_size, d, act=cfg.hidden_act, dtype=dtype,
                       axes=("embed", "vision_mlp", "embed"))

    def __call__(self, x: jax.Array) -> jax.Array:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class ClipEmbeddings(nnx.Module):
    """patch_embedding (the stride-p conv as a [p*p*c, d] matmul over patches flattened (ph, pw,
    c)), class_embedding [d], position_embedding [patches + 1, d]."""

    def __init__(self, cfg: ClipVisionConfig, dtype=jnp.float32):
        self.cfg = cfg
        d, p, c = cfg.hidden_size, cfg.patch_size, cfg.num_channels
        self.patch_embedding = Linear(p * p * c, d, dtype=dtype, quantize=False)
        self.class_embedding = param((d,), dtype, (None,))
        self.position_embedding = param((cfg.num_patches + 1, d), dtype, (None, None))

    def __call__(self, pixels: jax.Array) -> jax.Array:
        x = self.patch_embedding(patchify(pixels.astype(self.patch_embedding.kernel.get_value().dtype),
                                          self.cfg.patch_size))
        cls = jnp.broadcast_to(self.class_embedding.get_value(), (x.shape[0], 1, x.shape[-1]))
        return jnp.concatenate([cls, x], axis=1) + self.position_embedding.get_value()[None]

    def hf_weights(self, w, name: str) -> None:
        d, p, c = self.cfg.hidden_size, self.cfg.patch_size, self.cfg.num_channels
        conv = w.take(f"{name}.patch_embedding.weight", (d, c, p, p))
        # conv [out, c, ph, pw] -> [ph*pw*c, out] to match patches flattened as (ph, pw, c)
        w.set(self.patch_embedding.kernel, conv.transpose(2, 3, 1, 0).reshape(p * p * c, d), matmul=True)
        w.set(self.class_embedding, w.take(f"{name}.class_embedding", (d,)))
        w.set(self.position_embedding, w.take(f"{name}.position_embedding.weight", (self.cfg.num_patches + 1, d)))


class ClipEncoder(nnx.Module):
    def __init__(self, cfg: ClipVisionConfig, num_layers: int, dtype=jnp.float32):
        self.layers = nnx.List([ClipEncoderLayer(cfg, dtype) for _ in range(num_layers)])


class ClipVisionModel(nnx.Module):
    """CLIPVisionTransformer: embeddings, pre_layrnorm, encoder.layers. Only the first
    `num_layers` blocks are built (LLaVA reads an inner layer; the blocks after it never influence
    the output, and the post-layernorm neither)."""

    def __init__(self, cfg: ClipVisionConfig, num_layers: int, dtype=jnp.float32):
        self.config = cfg
        self.embeddings = ClipEmbeddings(cfg, dtype)
        self.pre_layrnorm = LayerNorm(cfg.hidden_size, cfg.layer_norm_eps, dtype=dtype)
        self.encoder = ClipEncoder(cfg, num_layers, dtype)

    def __call__(self, pixels: jax.Array) -> list[jax.Array]:
        """pixels [batch, H, W, 3] -> hidden states after the embeddings (index 0) and after each
        block; index i matches HF's `hidden_states[i]`."""
        x = self.pre_layrnorm(self.embeddings(pixels))
        states = [x]
        for layer in self.encoder.layers:
            x = layer(x)
            states.append(x)
        return states

    def hf_weights(self, w, name: str) -> None:
        load_children(self, w, name)
        w.ignore(re.escape(name) + r"\.post_layernorm\..*")
        ignore_tail(w, f"{name}.encoder", len(self.encoder.layers))
