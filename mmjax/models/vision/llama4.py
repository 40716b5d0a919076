"""The Llama 4 vision tower (Llama4VisionModel) and its pixel-shuffle adapter, as nnx modules.

Square tiles of `image_size` -> `patch_embedding.linear` (HF's Unfold + Linear: one matmul over
flattened (C, p, p) patches, no bias) -> the class token appended *last* -> learned
`positional_embedding_vlm` -> LayerNorm `layernorm_pre` -> pre-norm blocks `model.layers[i]`
(LayerNorm `input_layernorm`, full attention with biases and 2-D RoPE, LayerNorm
`post_attention_layernorm`, GELU `mlp.fc1` / `mlp.fc2`) -> `layernorm_post` -> the class token
dropped -> `vision_adapter`: pixel shuffle (space to depth, ratio `pixel_shuffle_ratio`) and
`mlp` (fc1, GELU, fc2, GELU; no biases).

2-D RoPE (HF's Llama4VisionRotaryEmbedding, the same tables for every tile): head_dim / 2
rotation pairs (x[2j], x[2j+1]); pair j < head_dim / 4 turns by (col + 1) * f_j, the others by
(row + 1) * f_{j - head_dim / 4}, f_j = theta ** (-4j / head_dim); the class token does not turn.
LayerNorms use eps 1e-5 whatever `norm_eps` says (HF builds them with torch's default).
"""
from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from mmjax.attention import attention
from mmjax.errors import CheckpointError, UnsupportedModelError
from mmjax.models.nn.linear import Linear, activation, param
from mmjax.models.nn.mlp import MLP
from mmjax.models.nn.norm import LayerNorm
from mmjax.models.text.llama4 import apply_rope_pairs

LN_EPS = 1e-5


@dataclass(frozen=True)
class Llama4VisionConfig:
    hidden_size: int = 768
    intermediate_size: int = 5632
    num_layers: int = 34
    num_heads: int = 16
    num_channels: int = 3
    image_size: int = 448
    patch_size: int = 14
    pixel_shuffle_ratio: float = 0.5
    projector_input_dim: int = 4096
    projector_output_dim: int = 4096
    vision_output_dim: int = 7680
    rope_theta: float = 10000.0

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patches_per_side(self) -> int:
        return self.image_size // self.patch_size

    @property
    def shuffle(self) -> int:
        """The pixel shuffle's block side (1 / pixel_shuffle_ratio)."""
        return int(round(1 / self.pixel_shuffle_ratio))

    @property
    def tokens_per_tile(self) -> int:
        return (self.patches_per_side // self.shuffle) ** 2

    @classmethod
    def from_hf(cls, v: dict, where: str = "vision_config") -> "Llama4VisionConfig":
        d = cls()

        def get(key, default):
            return default if v.get(key) is None else v[key]

        def square(key, default) -> int:
            x = get(key, default)
            if isinstance(x, (list, tuple)):
                if len(set(x)) != 1:
                    raise UnsupportedModelError(f"config.json: non-square {where}.{key}={x}", param=f"{where}.{key}")
                x = x[0]
            return int(x)

        rope = v.get("rope_parameters") or {}
        cfg = cls(hidden_size=int(get("hidden_size", d.hidden_size)),
                  intermediate_size=int(get("intermediate_size", d.intermediate_size)),
                  num_layers=int(get("num_hidden_layers", d.num_layers)),
                  num_heads=int(get("num_attention_heads", d.num_heads)),
                  num_channels=int(get("num_channels", 3)), image_size=square("image_size", d.image_size),
                  patch_size=square("patch_size", d.patch_size),
                  pixel_shuffle_ratio=float(get("pixel_shuffle_ratio", 0.5)),
                  projector_input_dim=int(get("projector_input_dim", d.projector_input_dim)),
                  projector_output_dim=int(get("projector_output_dim", d.projector_output_dim)),
                  vision_output_dim=int(get("vision_output_dim", d.vision_output_dim)),
                  rope_theta=float(rope.get("rope_theta", v.get("rope_theta", 10000.0))))
        act = get("hidden_act", "gelu")
        if act != "gelu":
            raise UnsupportedModelError(f"config.json: {where}.hidden_act={act!r} (Llama 4's tower is GELU)",
                                        param=f"{where}.hidden_act")
        s = cfg.shuffle
        if abs(cfg.pixel_shuffle_ratio * s - 1) > 1e-9 or cfg.patches_per_side % s:
            raise UnsupportedModelError(f"config.json: {where}.pixel_shuffle_ratio={cfg.pixel_shuffle_ratio} must be "
                                        f"1/n with n dividing the {cfg.patches_per_side} patches per side",
                                        param=f"{where}.pixel_shuffle_ratio")
        if cfg.hidden_size * s * s != cfg.intermediate_size or cfg.projector_input_dim != cfg.projector_output_dim:
            raise CheckpointError(f"config.json: {where}: the adapter needs intermediate_size = hidden_size / "
                                  "pixel_shuffle_ratio^2 and projector_input_dim = projector_output_dim",
                                  param=f"{where}.intermediate_size")
        if cfg.head_dim % 4:
            raise UnsupportedModelError(f"config.json: vision head_dim must be a multiple of 4 (2-D rotary), got "
                                        f"{cfg.head_dim}", param=f"{where}.num_attention_heads")
        return cfg


def vision_rope(cfg: Llama4VisionConfig) -> tuple[np.ndarray, np.ndarray]:
    """cos, sin [side * side + 1, head_dim / 2] float32 (the class token last, angle 0), as HF's
    `_compute_freqs_ci`."""
    side = cfg.patches_per_side
    idx = np.arange(side * side)
    fd = cfg.head_dim // 2
    f = (1.0 / (np.float32(cfg.rope_theta) ** (np.arange(0, fd, 2)[: fd // 2].astype(np.float32) / np.float32(fd))))
    f = f.astype(np.float32)
    fx = ((idx % side + 1)[:, None].astype(np.float32) * f[None])          # [n, hd / 4]
    fy = ((idx // side + 1)[:, None].astype(np.float32) * f[None])
    ang = np.concatenate([np.concatenate([fx, fy], axis=1), np.zeros((1, fd), np.float32)])   # [n + 1, hd / 2]
    return np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)


def pixel_shuffle(x: jax.Array, s: int) -> jax.Array:
    """HF's llama4 pixel_shuffle with ratio 1 / s: [b, side * side, c] -> [b, (side / s)^2, c * s * s]."""
    b, n, c = x.shape
    side = int(round(n ** 0.5))
    x = x.reshape(b, side, side // s, c * s).transpose(0, 2, 1, 3)
    x = x.reshape(b, side // s, side // s, c * s * s).transpose(0, 2, 1, 3)
    return x.reshape(b, -1, c * s * s)


class Llama4VisionAttention(nnx.Module):
    """Full attention with biases (`q_proj`, `k_proj`, `v_proj`, `o_proj`) and 2-D RoPE."""

    def __init__(self, cfg: Llama4VisionConfig, dtype=jnp.float32):
        d = cfg.hidden_size
        self.num_heads, self.head_dim = cfg.num_heads, cfg.head_dim
        for n in ("q_proj", "k_proj", "v_proj"):
            setattr(self, n, Linear(d, d, bias=True, dtype=dtype, axes=("embed", "vision_heads")))
        self.o_proj = Linear(d, d, bias=True, dtype=dtype, axes=("vision_heads", "embed"))

    def __call__(self, x: jax.Array, rope: tuple) -> jax.Array:
        """x [b, n, d], rope (cos, sin) [n, hd / 2] -> [b, n, d]."""
        b, n, d = x.shape
        q, k, v = (p(x).reshape(b, n, self.num_heads, self.head_dim) for p in (self.q_proj, self.k_proj, self.v_proj))
        cos, sin = (jnp.broadcast_to(t[None], (b, *t.shape)) for t in rope)
        q, k = apply_rope_pairs(q, cos, sin), apply_rope_pairs(k, cos, sin)
        return self.o_proj(attention(q, k, v).reshape(b, n, d))


class Llama4VisionEncoderLayer(nnx.Module):
    def __init__(self, cfg: Llama4VisionConfig, dtype=jnp.float32):
        d = cfg.hidden_size
        self.input_layernorm = LayerNorm(d, LN_EPS, dtype=dtype)
        self.self_attn = Llama4VisionAttention(cfg, dtype)
        self.post_attention_layernorm = LayerNorm(d, LN_EPS, dtype=dtype)
        self.mlp = MLP(d, cfg.intermediate_size, d, act="gelu", dtype=dtype, axes=("embed", "vision_mlp", "embed"))

    def __call__(self, x: jax.Array, rope: tuple) -> jax.Array:
        x = x + self.self_attn(self.input_layernorm(x), rope)
        return x + self.mlp(self.post_attention_layernorm(x))


class Llama4VisionEncoder(nnx.Module):
    def __init__(self, cfg: Llama4VisionConfig, dtype=jnp.float32):
        self.layers = nnx.List([Llama4VisionEncoderLayer(cfg, dtype) for _ in range(cfg.num_layers)])


class Llama4VisionMLP2(nnx.Module):
    """The adapter MLP: gelu(fc2(gelu(fc1(x)))), no biases."""

    def __init__(self, cfg: Llama4VisionConfig, dtype=jnp.float32):
        self.fc1 = Linear(cfg.intermediate_size, cfg.projector_input_dim, dtype=dtype)
        self.fc2 = Linear(cfg.projector_output_dim, cfg.projector_output_dim, dtype=dtype)

    def __call__(self, x: jax.Array) -> jax.Array:
        gelu = activation("gelu")
        return gelu(self.fc2(gelu(self.fc1(x))))


class Llama4VisionPixelShuffleMLP(nnx.Module):
    def __init__(self, cfg: Llama4VisionConfig, dtype=jnp.float32):
        self.shuffle = cfg.shuffle
        self.mlp = Llama4VisionMLP2(cfg, dtype)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.mlp(pixel_shuffle(x, self.shuffle))


class Llama4VisionModel(nnx.Module):
    """HF's Llama4VisionModel (module docstring)."""

    def __init__(self, cfg: Llama4VisionConfig, dtype=jnp.float32):
        self.config = cfg
        d, n = cfg.hidden_size, cfg.patches_per_side ** 2 + 1
        self.patch_embedding = Linear(cfg.num_channels * cfg.patch_size ** 2, d, dtype=dtype, quantize=False)
        self.class_embedding = param((d,), dtype, (None,))
        self.positional_embedding_vlm = param((n, d), dtype, (None, None))
        self.layernorm_pre = LayerNorm(d, LN_EPS, dtype=dtype)
        self.layernorm_post = LayerNorm(d, LN_EPS, dtype=dtype)
        self.model = Llama4VisionEncoder(cfg, dtype)
        self.vision_adapter = Llama4VisionPixelShuffleMLP(cfg, dtype)

    def __call__(self, pixels: jax.Array) -> jax.Array:
        """pixels [tiles, size, size, C] -> [tiles, tokens_per_tile, projector_output_dim]."""
        cfg = self.config
        b, p, c = pixels.shape[0], cfg.patch_size, cfg.num_channels
        g = cfg.patches_per_side
        dt = self.patch_embedding.kernel.get_value().dtype
        patches = pixels.astype(dt).reshape(b, g, p, g, p, c).transpose(0, 1, 3, 5, 2, 4).reshape(b, g * g, c * p * p)
        x = self.patch_embedding(patches)
        cls = jnp.broadcast_to(self.class_embedding.get_value().astype(x.dtype), (b, 1, x.shape[-1]))
        x = jnp.concatenate([x, cls], axis=1) + self.positional_embedding_vlm.get_value().astype(x.dtype)
        x = self.layernorm_pre(x)
        rope = tuple(jnp.asarray(t) for t in vision_rope(cfg))
        for layer in self.model.layers:
            x = layer(x, rope)
        x = self.layernorm_post(x)[:, :-1]
        return self.vision_adapter(x)

    def hf_weights(self, w, name: str) -> None:
        from mmjax.models.nn.weights import load_children
        cfg = self.config
        d, n = cfg.hidden_size, cfg.patches_per_side ** 2 + 1
        self.patch_embedding.hf_weights(w, f"{name}.patch_embedding.linear")
        w.set(self.class_embedding, w.take(f"{name}.class_embedding", (d,)))
        w.set(self.positional_embedding_vlm, w.take(f"{name}.positional_embedding_vlm", (n, d)))
        self.layernorm_pre.hf_weights(w, f"{name}.layernorm_pre")
        self.layernorm_post.hf_weights(w, f"{name}.layernorm_post")
        load_children(self.model, w, f"{name}.model")
        load_children(self.vision_adapter, w, f"{name}.vision_adapter")
