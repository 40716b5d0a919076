"""SigLIP vision transformer (Gemma 3, PaliGemma, Idefics3 / SmolVLM, LLaVA-OneVision): a plain
pre-LN ViT without class token.

Module tree (transformers' SiglipVisionTransformer, i.e. SiglipVisionModel.vision_model, and
Idefics3VisionTransformer, which has the same names): `embeddings` (`patch_embedding`: the
stride-p conv with bias as a matmul on flattened patches; `position_embedding`),
`encoder.layers[i]` (`layer_norm1`, `self_attn` (q_proj, k_proj, v_proj, out_proj, with
biases), `layer_norm2`, `mlp` (fc1, fc2; GELU-tanh)), `post_layernorm` (HF's
`last_hidden_state`). The attention-pooling `head` (`vision_use_head`) is part of no VLM's
feature path: its tensors are ignored at load.

A family that reads an inner layer's hidden state (LLaVA-OneVision's vision_feature_layer)
builds the tower short (`num_layers`, `post_layernorm=False`): the blocks after that layer and
the post-layernorm are neither built nor loaded.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from flax import nnx

from mmjax.errors import UnsupportedModelError
from mmjax.models.hf_config import require
from mmjax.models.nn.attention import VisionAttention
from mmjax.models.nn.linear import Linear, activation, param
from mmjax.models.nn.mlp import MLP
from mmjax.models.nn.norm import LayerNorm
from mmjax.models.nn.weights import ignore_tail, load_children
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


class SiglipEmbeddings(nnx.Module):
    """patch_embedding (the stride-p conv with bias as a [p*p*c, d] matmul over patches flattened
    (ph, pw, c)), position_embedding [patches, d] (row-major over the patch grid)."""

    def __init__(self, cfg: SiglipVisionConfig, dtype=jnp.float32):
        self.cfg = cfg
        d, p, c = cfg.hidden_size, cfg.patch_size, cfg.num_channels
        self.patch_embedding = Linear(p * p * c, d, bias=True, dtype=dtype, quantize=False)
        self.position_embedding = param((cfg.num_patches, d), dtype, (None, None))

    def __call__(self, pixels: jax.Array) -> jax.Array:
        """pixels [b, H, W, c] -> [b, patches, d]."""
        pos = self.position_embedding.get_value()
        x = self.patch_embedding(patchify(pixels.astype(pos.dtype), self.cfg.patch_size))
        return x + pos[None]

    def hf_weights(self, w, name: str) -> None:
        d, p, c = self.cfg.hidden_size, self.cfg.patch_size, self.cfg.num_channels
        conv = w.take(f"{name}.patch_embedding.weight", (d, c, p, p))
        # conv [out, c, ph, pw] -> [ph*pw*c, out] to match patches flattened as (ph, pw, c)
        w.set(self.patch_embedding.kernel, conv.transpose(2, 3, 1, 0).reshape(p * p * c, d), matmul=True)
        w.set(self.patch_embedding.bias, w.take(f"{name}.patch_embedding.bias", (d,)))
        w.set(self.position_embedding, w.take(f"{name}.position_embedding.weight", (self.cfg.num_patches, d)))


class SiglipEncoderLayer(nnx.Module):
    """One pre-LN block: layer_norm1, self_attn, layer_norm2, mlp (fc1, fc2)."""

    def __init__(self, cfg: SiglipVisionConfig, dtype=jnp.float32):
        d = cfg.hidden_size
        self.layer_norm1 = LayerNorm(d, cfg.layer_norm_eps, dtype=dtype)
        self.self_attn = VisionAttention(d, cfg.num_heads, dtype=dtype)
        self.layer_norm2 = LayerNorm(d, cfg.layer_norm_eps, dtype=dtype)
        self.mlp = MLP(d, cfg.intermediate_size, d, act=cfg.hidden_act, dtype=dtype,
                       axes=("embed", "vision_mlp", "embed"))

    def __call__(self, x: jax.Array) -> jax.Array:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class SiglipEncoder(nnx.Module):
    def __init__(self, cfg: SiglipVisionConfig, num_layers: int, dtype=jnp.float32):
        self.layers = nnx.List([SiglipEncoderLayer(cfg, dtype) for _ in range(num_layers)])


class SiglipVisionModel(nnx.Module):
    """SiglipVisionTransformer (see the module docstring): embeddings, encoder.layers,
    post_layernorm. num_layers: the blocks built (default all); post_layernorm=False: none (a
    tower read at an inner layer, `hidden_states`)."""

    def __init__(self, cfg: SiglipVisionConfig, num_layers: int | None = None, *, post_layernorm: bool = True,
                 dtype=jnp.float32):
        n = cfg.num_layers if num_layers is None else num_layers
        if post_layernorm and n != cfg.num_layers:
            raise ValueError("the post-layernorm follows the last block: build all blocks or no post_layernorm")
        self.config = cfg
        self.embeddings = SiglipEmbeddings(cfg, dtype)
        self.encoder = SiglipEncoder(cfg, n, dtype)
        self.post_layernorm = LayerNorm(cfg.hidden_size, cfg.layer_norm_eps, dtype=dtype) if post_layernorm else None

    def hidden_states(self, pixels: jax.Array) -> list[jax.Array]:
        """pixels [batch, H, W, 3] -> hidden states [batch, patches, hidden] after the embeddings
        (index 0) and after each built block, without the post-layernorm: index i is HF's
        `hidden_states[i]`."""
        x = self.embeddings(pixels)
        states = [x]
        for layer in self.encoder.layers:
            x = layer(x)
            states.append(x)
        return states

    def __call__(self, pixels: jax.Array) -> jax.Array:
        """pixels [batch, H, W, 3] -> post-layernormed patch features [batch, patches, hidden]
        (HF's `last_hidden_state`), patches in row-major grid order."""
        x = self.embeddings(pixels)
        for layer in self.encoder.layers:
            x = layer(x)
        return self.post_layernorm(x)

    def hf_weights(self, w, name: str) -> None:
        """`name`: the HF prefix of the SiglipVisionTransformer ("vision_tower",
        "model.vision_model", ...)."""
        load_children(self, w, name)
        w.ignore(re.escape(name) + r"\.head\..*")
        if self.post_layernorm is None:
            w.ignore(re.escape(name) + r"\.post_layernorm\..*")
        ignore_tail(w, f"{name}.encoder", len(self.encoder.layers))
