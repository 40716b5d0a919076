"""The Llama 3.2 Vision (Mllama) vision tower as pure functions (HF's MllamaVisionModel).

Per image: max_num_tiles square tiles (absent ones zero) -> Conv2d patch embed -> gated
pre-tile aspect-ratio embedding -> class token -> gated position + tile-position embedding ->
LayerNorm -> pad each tile's patches to a multiple of 8 -> local encoder (LayerNorm blocks,
GELU MLP with bias) over all tiles' tokens at once -> LayerNorm -> gated post-tile embedding ->
global encoder (tanh-gated residuals) -> drop the padding -> concat [final, the local encoder's
`intermediate_layers_indices` outputs] -> `vision_output_dim` per token.

Attention mask (HF's _prepare_aspect_ratio_attention_mask, kept exactly): a key is hidden from a
query only when both are padding (padded patch positions or tiles beyond the image's tile
count); real tokens attend to padding tokens too. Hence every image always runs with all
max_num_tiles tiles, and features depend only on the image (fixed shape per image).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from mmjax.checkpoint import TensorSource, linear, norm
from mmjax.errors import CheckpointError
from mmjax.models.layers import activation, bf16_einsum, dense, layer_norm, matmul


@dataclass(frozen=True)
class MllamaVisionConfig:
    hidden_size: int = 1280
    intermediate_size: int = 5120
    num_layers: int = 32
    num_global_layers: int = 8
    num_heads: int = 16
    num_channels: int = 3
    image_size: int = 448
    patch_size: int = 14
    max_num_tiles: int = 4
    norm_eps: float = 1e-5
    hidden_act: str = "gelu"
    intermediate_layers: tuple[int, ...] = (3, 7, 15, 23, 30)
    num_aspect_ratios: int = 8        # max_aspect_ratio_id

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def num_patches(self) -> int:
        """Tokens per tile including the class token."""
        return (self.image_size // self.patch_size) ** 2 + 1

    @property
    def padded_patches(self) -> int:
        return -(-self.num_patches // 8) * 8

    @property
    def output_dim(self) -> int:
        return self.hidden_size * (len(self.intermediate_layers) + 1)

    @classmethod
    def from_hf(cls, v: dict, where: str = "vision_config") -> "MllamaVisionConfig":
        def get(key, default=dataclasses.MISSING):
            if v.get(key) is not None:
                return v[key]
            if default is dataclasses.MISSING:
                raise CheckpointError(f"config.json: required field '{where}.{key}' is missing", param=f"{where}.{key}")
            return default

        tiles = int(get("max_num_tiles", 4))
        ratios = get("supported_aspect_ratios", None)
        n_ratios = len(ratios) if ratios else sum(1 for a in range(1, tiles + 1) for b in range(1, tiles + 1)
                                                  if a * b <= tiles)
        cfg = cls(hidden_size=int(get("hidden_size", 1280)), intermediate_size=int(get("intermediate_size", 5120)),
                  num_layers=int(get("num_hidden_layers", 32)), num_global_layers=int(get("num_global_layers", 8)),
                  num_heads=int(get("attention_heads", 16)), num_channels=int(get("num_channels", 3)),
                  image_size=int(get("image_size", 448)), patch_size=int(get("patch_size", 14)),
                  max_num_tiles=tiles, norm_eps=float(get("norm_eps", 1e-5)), hidden_act=get("hidden_act", "gelu"),
                  intermediate_layers=tuple(int(i) for i in get("intermediate_layers_indices", (3, 7, 15, 23, 30))),
                  num_aspect_ratios=n_ratios)
        activation(cfg.hidden_act)
        return cfg


def _block_params(src: TensorSource, p: str, cfg: MllamaVisionConfig, gated: bool) -> dict:
    d, i = cfg.hidden_size, cfg.intermediate_size
    blk = {"ln1": norm(src, p + "input_layernorm", d), "ln2": norm(src, p + "post_attention_layernorm", d),
           "q": linear(src, p + "self_attn.q_proj", d, d, False), "k": linear(src, p + "self_attn.k_proj", d, d, False),
           "v": linear(src, p + "self_attn.v_proj", d, d, False), "o": linear(src, p + "self_attn.o_proj", d, d, False),
           "fc1": linear(src, p + "mlp.fc1", d, i, True), "fc2": linear(src, p + "mlp.fc2", i, d, True)}
    if gated:
        blk["gate_attn"] = src.take(p + "gate_attn", (1,))
        blk["gate_ffn"] = src.take(p + "gate_ffn", (1,))
    return blk


def load_mllama_vision_params(src: TensorSource, cfg: MllamaVisionConfig, prefix: str = "vision_model.") -> dict:
    d, t, n, r = cfg.hidden_size, cfg.max_num_tiles, cfg.num_patches, cfg.num_aspect_ratios + 1
    conv = src.take(prefix + "patch_embedding.weight", (d, cfg.num_channels, cfg.patch_size, cfg.patch_size))
    g = prefix + "gated_positional_embedding."
    return {
        "patch_embed": np.ascontiguousarray(conv.reshape(d, -1).T),
        "class_embedding": src.take(prefix + "class_embedding", (d,)),
        "pos": {"embedding": src.take(g + "embedding", (n, d)), "gate": src.take(g + "gate", (1,)),
                "tile": src.take(g + "tile_embedding.weight", (r, t * n * d))},
        "pre_tile": {"embedding": src.take(prefix + "pre_tile_positional_embedding.embedding.weight", (r, t * d)),
                     "gate": src.take(prefix + "pre_tile_positional_embedding.gate", (1,))},
        "post_tile": {"embedding": src.take(prefix + "post_tile_positional_embedding.embedding.weight", (r, t * d)),
                      "gate": src.take(prefix + "post_tile_positional_embedding.gate", (1,))},
        "ln_pre": norm(src, prefix + "layernorm_pre", d), "ln_post": norm(src, prefix + "layernorm_post", d),
        "local": [_block_params(src, f"{prefix}transformer.layers.{i}.", cfg, False) for i in range(cfg.num_layers)],
        "global": [_block_params(src, f"{prefix}global_transformer.layers.{i}.", cfg, True)
                   for i in range(cfg.num_global_layers)],
    }


def _attend(p: dict, x: jax.Array, bias: jax.Array, cfg: MllamaVisionConfig) -> jax.Array:
    """Explicit masked attention over x [b, n, d] with an additive bias [b, n, n] (HF's eager)."""
    b, n, d = x.shape
    h, hd = cfg.num_heads, cfg.head_dim
    q, k, v = (dense(p[w], x).reshape(b, n, h, hd) for w in "qkv")
    s = bf16_einsum("bqhd,bkhd->bhqk", q, k) * (hd ** -0.5) + bias[:, None]
    a = jax.nn.softmax(s.astype(jnp.float32), axis=-1).astype(x.dtype)
    return dense(p["o"], bf16_einsum("bhqk,bkhd->bqhd", a, v).reshape(b, n, d))


def _block(p: dict, x: jax.Array, bias: jax.Array, cfg: MllamaVisionConfig) -> jax.Array:
    ga = jnp.tanh(p["gate_attn"]) if "gate_attn" in p else 1.0
    gf = jnp.tanh(p["gate_ffn"]) if "gate_ffn" in p else 1.0
    x = x + ga * _attend(p, layer_norm(p["ln1"], x, cfg.norm_eps), bias, cfg)
    h = dense(p["fc2"], activation(cfg.hidden_act)(dense(p["fc1"], layer_norm(p["ln2"], x, cfg.norm_eps))))
    return x + gf * h


def _tile_embed(p: dict, ar_ids: jax.Array, cfg: MllamaVisionConfig) -> jax.Array:
    """Gated aspect-ratio embedding [b, tiles, 1, d]."""
    e = p["embedding"][ar_ids].reshape(-1, cfg.max_num_tiles, 1, cfg.hidden_size)
    return e * jnp.tanh(p["gate"])


def mllama_vision(params: dict, cfg: MllamaVisionConfig, tiles: jax.Array, ar_ids: jax.Array,
                  n_tiles: jax.Array) -> jax.Array:
    """tiles [b, max_tiles, S, S, C], ar_ids [b] int32 (1-based aspect-ratio id), n_tiles [b] int32
    -> vision states [b, max_tiles, num_patches, output_dim] (HF's vision last_hidden_state)."""
    b, t, s = tiles.shape[0], cfg.max_num_tiles, cfg.image_size
    p, d, n, npad = cfg.patch_size, cfg.hidden_size, cfg.num_patches, cfg.padded_patches
    g = s // p
    x = tiles.astype(params["patch_embed"].dtype).reshape(b, t, g, p, g, p, -1).transpose(0, 1, 2, 4, 6, 3, 5)
    x = matmul(x.reshape(b, t, g * g, -1), params["patch_embed"])                         # [b, t, n-1, d]
    x = x + _tile_embed(params["pre_tile"], ar_ids, cfg)
    cls = jnp.broadcast_to(params["class_embedding"].astype(x.dtype), (b, t, 1, d))
    x = jnp.concatenate([cls, x], axis=2)                                           # [b, t, n, d]
    pe = params["pos"]
    gate = jnp.tanh(pe["gate"])
    x = x + (1 - gate) * pe["embedding"] + gate * pe["tile"][ar_ids].reshape(b, t, n, d)
    x = layer_norm(params["ln_pre"], x, cfg.norm_eps)
    x = jnp.pad(x, ((0, 0), (0, 0), (0, npad - n), (0, 0))).reshape(b, t * npad, d)
    # padding: patch slots past n, and tiles past the image's tile count; hidden only pad <-> pad
    pad = (jnp.arange(npad)[None, None] >= n) | (jnp.arange(t)[None, :, None] >= n_tiles[:, None, None])
    pad = pad.reshape(b, t * npad)
    bias = jnp.where(pad[:, :, None] & pad[:, None, :], jnp.finfo(x.dtype).min, 0.0).astype(x.dtype)
    inter = []
    for i, blk in enumerate(params["local"]):
        x = _block(blk, x, bias, cfg)
        if i in cfg.intermediate_layers:
            inter.append((i, x))
    x = layer_norm(params["ln_post"], x, cfg.norm_eps).reshape(b, t, npad, d)
    x = (x + _tile_embed(params["post_tile"], ar_ids, cfg)).reshape(b, t * npad, d)
    for blk in params["global"]:
        x = _block(blk, x, bias, cfg)
    x = x.reshape(b, t, npad, d)[:, :, :n]
    by = dict(inter)
    st = jnp.stack([by[i] for i in cfg.intermediate_layers], axis=-1).reshape(b, t, npad, -1)[:, :, :n]
    return jnp.concatenate([x, st], axis=-1)
