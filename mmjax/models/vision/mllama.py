"""The Llama 3.2 Vision (Mllama) vision tower as Flax NNX modules (HF's MllamaVisionModel).

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

Module tree (transformers' names): `patch_embedding` (the conv as a [c*p*p, d] matmul),
`class_embedding`, `gated_positional_embedding` (`embedding`, `gate`, `tile_embedding`),
`pre_tile_positional_embedding` / `post_tile_positional_embedding` (`embedding`, `gate`),
`layernorm_pre`, `layernorm_post`, `transformer.layers[i]` and `global_transformer.layers[i]`
(`input_layernorm`, `self_attn` (q_proj, k_proj, v_proj, o_proj), `post_attention_layernorm`,
`mlp` (fc1, fc2); the global layers also `gate_attn`, `gate_ffn`). Every weight's heads / MLP
axes are "vision_heads" / "vision_mlp" (replicated unless the tower is tensor parallel).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from flax import nnx

from mmjax.errors import CheckpointError
from mmjax.models.nn.linear import Linear, activation, bf16_einsum, param
from mmjax.models.nn.mlp import MLP
from mmjax.models.nn.norm import LayerNorm
from mmjax.models.nn.weights import load_children, load_module


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


class MllamaVisionAttention(nnx.Module):
    """Full attention with an additive bias [b, n, n] (HF's eager path, explicit softmax in
    float32): q_proj, k_proj, v_proj, o_proj, no biases."""

    def __init__(self, d: int, heads: int, dtype=jnp.float32):
        self.heads = heads
        self.q_proj = Linear(d, d, dtype=dtype, axes=("embed", "vision_heads"))
        self.k_proj = Linear(d, d, dtype=dtype, axes=("embed", "vision_heads"))
        self.v_proj = Linear(d, d, dtype=dtype, axes=("embed", "vision_heads"))
        self.o_proj = Linear(d, d, dtype=dtype, axes=("vision_heads", "embed"))

    def __call__(self, x: jax.Array, bias: jax.Array) -> jax.Array:
        b, n, d = x.shape
        hd = d // self.heads
        q, k, v = (p(x).reshape(b, n, self.heads, hd) for p in (self.q_proj, self.k_proj, self.v_proj))
        s = bf16_einsum("bqhd,bkhd->bhqk", q, k) * (hd ** -0.5) + bias[:, None]
        a = jax.nn.softmax(s.astype(jnp.float32), axis=-1).astype(x.dtype)
        return self.o_proj(bf16_einsum("bhqk,bkhd->bqhd", a, v).reshape(b, n, d))


class MllamaVisionEncoderLayer(nnx.Module):
    """Pre-LN block; `gated` (the global encoder): tanh-gated residuals (`gate_attn`, `gate_ffn`)."""

    def __init__(self, cfg: MllamaVisionConfig, gated: bool, dtype=jnp.float32):
        d = cfg.hidden_size
        self.input_layernorm = LayerNorm(d, cfg.norm_eps, dtype=dtype)
        self.self_attn = MllamaVisionAttention(d, cfg.num_heads, dtype)
        self.post_attention_layernorm = LayerNorm(d, cfg.norm_eps, dtype=dtype)
        self.mlp = MLP(d, cfg.intermediate_size, d, act=cfg.hidden_act, dtype=dtype,
                       axes=("embed", "vision_mlp", "embed"))
        self.gate_attn = param((1,), dtype, (None,)) if gated else None
        self.gate_ffn = param((1,), dtype, (None,)) if gated else None

    def __call__(self, x: jax.Array, bias: jax.Array) -> jax.Array:
        ga = 1.0 if self.gate_attn is None else jnp.tanh(self.gate_attn.get_value())
        gf = 1.0 if self.gate_ffn is None else jnp.tanh(self.gate_ffn.get_value())
        x = x + ga * self.self_attn(self.input_layernorm(x), bias)
        return x + gf * self.mlp(self.post_attention_layernorm(x))

    def hf_weights(self, w, name: str) -> None:
        load_children(self, w, name)
        if self.gate_attn is not None:
            w.set(self.gate_attn, w.take(f"{name}.gate_attn", (1,)))
            w.set(self.gate_ffn, w.take(f"{name}.gate_ffn", (1,)))


class MllamaVisionEncoder(nnx.Module):
    def __init__(self, cfg: MllamaVisionConfig, num_layers: int, gated: bool, dtype=jnp.float32):
        self.layers = nnx.List([MllamaVisionEncoderLayer(cfg, gated, dtype) for _ in range(num_layers)])


class MllamaAspectRatioEmbedding(nnx.Module):
    """Gated per-tile embedding of the aspect-ratio id (HF's MllamaPrecomputedAspectRatioEmbedding):
    `embedding` [ratios + 1, tiles * d] (HF's embedding.weight), `gate` [1]."""

    def __init__(self, cfg: MllamaVisionConfig, dtype=jnp.float32):
        self.tiles, self.d = cfg.max_num_tiles, cfg.hidden_size
        self.embedding = param((cfg.num_aspect_ratios + 1, self.tiles * self.d), dtype, (None, None))
        self.gate = param((1,), dtype, (None,))

    def __call__(self, ar_ids: jax.Array) -> jax.Array:
        """ar_ids [b] -> [b, tiles, 1, d]."""
        e = self.embedding.get_value()[ar_ids].reshape(-1, self.tiles, 1, self.d)
        return e * jnp.tanh(self.gate.get_value())

    def hf_weights(self, w, name: str) -> None:
        w.set(self.embedding, w.take(f"{name}.embedding.weight", self.embedding.get_value().shape))
        w.set(self.gate, w.take(f"{name}.gate", (1,)))


class MllamaPositionEmbedding(nnx.Module):
    """HF's MllamaPrecomputedPositionEmbedding: `embedding` [patches, d], `gate` [1],
    `tile_embedding` [ratios + 1, tiles * patches * d] (HF's tile_embedding.weight)."""

    def __init__(self, cfg: MllamaVisionConfig, dtype=jnp.float32):
        self.tiles, self.n, self.d = cfg.max_num_tiles, cfg.num_patches, cfg.hidden_size
        self.embedding = param((self.n, self.d), dtype, (None, None))
        self.gate = param((1,), dtype, (None,))
        self.tile_embedding = param((cfg.num_aspect_ratios + 1, self.tiles * self.n * self.d), dtype, (None, None))

    def __call__(self, x: jax.Array, ar_ids: jax.Array) -> jax.Array:
        """x [b, tiles, patches, d] + the gated mix of the position and tile-position embeddings."""
        gate = jnp.tanh(self.gate.get_value())
        tile = self.tile_embedding.get_value()[ar_ids].reshape(-1, self.tiles, self.n, self.d)
        return x + (1 - gate) * self.embedding.get_value() + gate * tile

    def hf_weights(self, w, name: str) -> None:
        w.set(self.embedding, w.take(f"{name}.embedding", (self.n, self.d)))
        w.set(self.gate, w.take(f"{name}.gate", (1,)))
        w.set(self.tile_embedding, w.take(f"{name}.tile_embedding.weight", self.tile_embedding.get_value().shape))


class MllamaVisionModel(nnx.Module):
    """HF's MllamaVisionModel (see the module docstring)."""

    def __init__(self, cfg: MllamaVisionConfig, dtype=jnp.float32):
        self.config = cfg
        d, p, c = cfg.hidden_size, cfg.patch_size, cfg.num_channels
        self.patch_embedding = Linear(c * p * p, d, dtype=dtype, quantize=False)
        self.class_embedding = param((d,), dtype, (None,))
        self.gated_positional_embedding = MllamaPositionEmbedding(cfg, dtype)
        self.pre_tile_positional_embedding = MllamaAspectRatioEmbedding(cfg, dtype)
        self.post_tile_positional_embedding = MllamaAspectRatioEmbedding(cfg, dtype)
        self.layernorm_pre = LayerNorm(d, cfg.norm_eps, dtype=dtype)
        self.layernorm_post = LayerNorm(d, cfg.norm_eps, dtype=dtype)
        self.transformer = MllamaVisionEncoder(cfg, cfg.num_layers, False, dtype)
        self.global_transformer = MllamaVisionEncoder(cfg, cfg.num_global_layers, True, dtype)

    def hf_weights(self, w, name: str) -> None:
        cfg = self.config
        d, p, c = cfg.hidden_size, cfg.patch_size, cfg.num_channels
        conv = w.take(f"{name}.patch_embedding.weight", (d, c, p, p))
        # conv [out, c, ph, pw] -> [c*ph*pw, out]: patches flattened (c, ph, pw) in __call__
        w.set(self.patch_embedding.kernel, conv.reshape(d, -1).T, matmul=True)
        w.set(self.class_embedding, w.take(f"{name}.class_embedding", (d,)))
        for attr in ("gated_positional_embedding", "pre_tile_positional_embedding", "post_tile_positional_embedding",
                     "layernorm_pre", "layernorm_post", "transformer", "global_transformer"):
            load_module(getattr(self, attr), w, f"{name}.{attr}")

    def __call__(self, tiles: jax.Array, ar_ids: jax.Array, n_tiles: jax.Array) -> jax.Array:
        """tiles [b, max_tiles, S, S, C], ar_ids [b] int32 (1-based aspect-ratio id), n_tiles [b]
        int32 -> vision states [b, max_tiles, num_patches, output_dim] (HF's last_hidden_state)."""
        cfg = self.config
        b, t, s = tiles.shape[0], cfg.max_num_tiles, cfg.image_size
        p, d, n, npad = cfg.patch_size, cfg.hidden_size, cfg.num_patches, cfg.padded_patches
        g = s // p
        dtype = self.patch_embedding.kernel.get_value().dtype
        x = tiles.astype(dtype).reshape(b, t, g, p, g, p, -1).transpose(0, 1, 2, 4, 6, 3, 5)
        x = self.patch_embedding(x.reshape(b, t, g * g, -1))                                 # [b, t, n-1, d]
        x = x + self.pre_tile_positional_embedding(ar_ids)
        cls = jnp.broadcast_to(self.class_embedding.get_value().astype(x.dtype), (b, t, 1, d))
        x = jnp.concatenate([cls, x], axis=2)                                               # [b, t, n, d]
        x = self.gated_positional_embedding(x, ar_ids)
        x = self.layernorm_pre(x)
        x = jnp.pad(x, ((0, 0), (0, 0), (0, npad - n), (0, 0))).reshape(b, t * npad, d)
        # padding: patch slots past n, and tiles past the image's tile count; hidden only pad <-> pad
        pad = (jnp.arange(npad)[None, None] >= n) | (jnp.arange(t)[None, :, None] >= n_tiles[:, None, None])
        pad = pad.reshape(b, t * npad)
        bias = jnp.where(pad[:, :, None] & pad[:, None, :], jnp.finfo(x.dtype).min, 0.0).astype(x.dtype)
        inter = {}
        for i, layer in enumerate(self.transformer.layers):
            x = layer(x, bias)
            if i in cfg.intermediate_layers:
                inter[i] = x
        x = self.layernorm_post(x).reshape(b, t, npad, d)
        x = (x + self.post_tile_positional_embedding(ar_ids)).reshape(b, t * npad, d)
        for layer in self.global_transformer.layers:
            x = layer(x, bias)
        x = x.reshape(b, t, npad, d)[:, :, :n]
        st = jnp.stack([inter[i] for i in cfg.intermediate_layers], axis=-1).reshape(b, t, npad, -1)[:, :, :n]
        return jnp.concatenate([x, st], axis=-1)
