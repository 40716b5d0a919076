"""The Pixtral vision tower (PixtralVisionModel, Pixtral-12B / Mistral Small 3.x) as an nnx module.

Images at their native size (patch multiples) -> `patch_conv` (the Conv2d patch embed as one
matmul over flattened (C, p, p) patches, no bias) -> RMSNorm `ln_pre` -> pre-norm blocks
`transformer.layers[i]` (RMSNorm eps 1e-5 `attention_norm` / `ffn_norm`, bias-free `attention`
with 2-D axial RoPE over each patch's (row, col), gated `feed_forward`) -> the hidden state the
family's `vision_feature_layer` selects (only the blocks up to it are built and loaded).

Module tree as transformers' (fused where documented): `patch_conv`, `ln_pre`,
`transformer.layers[i].{attention_norm, attention.{qkv_proj (HF q_proj|k_proj|v_proj fused),
o_proj}, ffn_norm, feed_forward.{gate_up_proj (HF gate_proj|up_proj fused), down_proj}}`.

Packed encoding (the family's, Qwen2-VL's host packing): any set of images is one padded patch
sequence with one attention segment per image (block-diagonal attention, HF's
`generate_block_attention_mask`), padded up a patch ladder. Patches are laid out merge-block
major, so the Mistral 3 patch merger is a plain reshape; the order inside the tower does not
matter (attention is bidirectional inside an image and positions are explicit).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from mmjax.attention import attention
from mmjax.errors import CheckpointError, UnsupportedModelError
from mmjax.models.nn.linear import FusedLinear, Linear, Part, activation
from mmjax.models.nn.mlp import GatedMLP
from mmjax.models.nn.norm import RMSNorm
from mmjax.models.nn.rope import apply_rope, cos_sin
from mmjax.models.nn.weights import ignore_tail, load_children

PIXTRAL_EPS = 1e-5  # HF hard-codes eps=1e-5 for ln_pre and every block norm


@dataclass(frozen=True)
class PixtralVisionConfig:
    hidden_size: int = 1024
    intermediate_size: int = 4096
    num_layers: int = 24
    num_heads: int = 16
    patch_size: int = 16
    num_channels: int = 3
    hidden_act: str = "gelu"
    rope_theta: float = 10000.0

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patch_dim(self) -> int:
        return self.num_channels * self.patch_size ** 2

    @classmethod
    def from_hf(cls, v: dict, where: str = "vision_config") -> "PixtralVisionConfig":
        def get(key, default=dataclasses.MISSING):
            if v.get(key) is not None:
                return v[key]
            if default is dataclasses.MISSING:
                raise CheckpointError(f"config.json: required field '{where}.{key}' is missing", param=f"{where}.{key}")
            return default

        rope = v.get("rope_parameters") or {}
        if rope.get("rope_type", "axial") != "axial":
            raise UnsupportedModelError(f"config.json: {where}.rope_parameters.rope_type={rope['rope_type']!r} "
                                        "(Pixtral supports axial)", param=f"{where}.rope_parameters")
        patch = get("patch_size", 16)
        if isinstance(patch, (list, tuple)):
            if len(set(patch)) != 1:
                raise UnsupportedModelError(f"config.json: non-square {where}.patch_size={patch}",
                                            param=f"{where}.patch_size")
            patch = patch[0]
        cfg = cls(hidden_size=int(get("hidden_size", 1024)), intermediate_size=int(get("intermediate_size", 4096)),
                  num_layers=int(get("num_hidden_layers", 24)), num_heads=int(get("num_attention_heads", 16)),
                  patch_size=int(patch), num_channels=int(get("num_channels", 3)),
                  hidden_act=get("hidden_act", "gelu"),
                  rope_theta=float(rope.get("rope_theta", v.get("rope_theta", 10000.0))))
        if cfg.hidden_size % cfg.num_heads or cfg.head_dim % 4:
            raise UnsupportedModelError(f"config.json: vision head_dim must be a multiple of 4 (2-D rotary), got "
                                        f"{cfg.hidden_size}/{cfg.num_heads}", param=f"{where}.num_attention_heads")
        activation(cfg.hidden_act)  # validate
        return cfg


def pixtral_inv_freq(cfg: PixtralVisionConfig) -> tuple[np.ndarray, np.ndarray]:
    """(row freqs, col freqs) [head_dim // 4] each: the head_dim / 2 RoPE frequencies of the full
    head, even ones for rows and odd ones for columns (HF's compute_axial_rope_parameters)."""
    hd = cfg.head_dim
    f = (1.0 / (np.float32(cfg.rope_theta) ** (np.arange(0, hd, 2, dtype=np.float32) / np.float32(hd))))
    f = f.astype(np.float32)
    return f[0::2], f[1::2]


def pixtral_rope(cfg: PixtralVisionConfig, pos_hw: jax.Array) -> tuple[jax.Array, jax.Array]:
    """pos_hw [N, 2] (row, col of each patch) -> cos, sin [N, head_dim] float32: angles
    (row * f_rows, col * f_cols) concatenated, then repeated for both rotated halves."""
    fr, fc = pixtral_inv_freq(cfg)
    pos = pos_hw.astype(jnp.float32)
    hw = jnp.concatenate([pos[:, :1] * jnp.asarray(fr), pos[:, 1:] * jnp.asarray(fc)], axis=-1)  # [N, hd/2]
    return cos_sin(jnp.concatenate([hw, hw], axis=-1))


class PixtralAttention(nnx.Module):
    """Bias-free full attention inside each image's segment: `qkv_proj` (HF's q_proj / k_proj /
    v_proj fused), RoPE on q and k, `o_proj`."""

    def __init__(self, cfg: PixtralVisionConfig, dtype=jnp.float32):
        d, hd = cfg.hidden_size, cfg.head_dim
        self.num_heads, self.head_dim = cfg.num_heads, hd
        self.qkv_proj = FusedLinear(d, tuple(Part(f"{n}_proj", d, "vision_heads", hd) for n in "qkv"), dtype=dtype)
        self.o_proj = Linear(d, d, dtype=dtype, axes=("vision_heads", "embed"))

    def __call__(self, x: jax.Array, rope: tuple[jax.Array, jax.Array], segment_ids: jax.Array) -> jax.Array:
        """x [N, width] (the packed sequence), rope (cos, sin) [N, head_dim], segment_ids [N]
        (-1 = padding) -> [N, width]."""
        n, w = x.shape
        q, k, v = (y.reshape(1, n, self.num_heads, self.head_dim) for y in self.qkv_proj(x))
        cos, sin = (t[None] for t in rope)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        return self.o_proj(attention(q, k, v, segment_ids=segment_ids[None]).reshape(n, w))

    def hf_weights(self, w, name: str) -> None:
        self.qkv_proj.hf_weights(w, f"{name}.")
        self.o_proj.hf_weights(w, f"{name}.o_proj")


class PixtralAttentionLayer(nnx.Module):
    """One pre-norm block: attention_norm, attention, ffn_norm, feed_forward."""

    def __init__(self, cfg: PixtralVisionConfig, dtype=jnp.float32):
        d = cfg.hidden_size
        self.attention_norm = RMSNorm(d, PIXTRAL_EPS, dtype=dtype)
        self.attention = PixtralAttention(cfg, dtype)
        self.ffn_norm = RMSNorm(d, PIXTRAL_EPS, dtype=dtype)
        self.feed_forward = GatedMLP(d, cfg.intermediate_size, act=cfg.hidden_act, axis="vision_mlp", dtype=dtype)

    def __call__(self, x: jax.Array, rope: tuple[jax.Array, jax.Array], segment_ids: jax.Array) -> jax.Array:
        x = x + self.attention(self.attention_norm(x), rope, segment_ids)
        return x + self.feed_forward(self.ffn_norm(x))


class PixtralTransformer(nnx.Module):
    def __init__(self, cfg: PixtralVisionConfig, num_layers: int, dtype=jnp.float32):
        self.layers = nnx.List([PixtralAttentionLayer(cfg, dtype) for _ in range(num_layers)])


class PixtralVisionModel(nnx.Module):
    """PixtralVisionModel cut after `num_layers` blocks (the feature layer: HF's
    hidden_states[num_layers], 0 = the ln_pre output); the blocks past it never reach the
    output and are not built (their tensors are read past)."""

    def __init__(self, cfg: PixtralVisionConfig, num_layers: int, dtype=jnp.float32):
        self.config = cfg
        self.patch_conv = Linear(cfg.patch_dim, cfg.hidden_size, dtype=dtype, quantize=False)
        self.ln_pre = RMSNorm(cfg.hidden_size, PIXTRAL_EPS, dtype=dtype)
        self.transformer = PixtralTransformer(cfg, num_layers, dtype)

    def __call__(self, patches: jax.Array, pos_hw: jax.Array, segment_ids: jax.Array) -> jax.Array:
        """Packed patches [N, C*p*p], pos_hw [N, 2], segment_ids [N] (-1 = padding) -> the
        hidden state after the last built block [N, width]."""
        x = self.ln_pre(self.patch_conv(patches.astype(self.patch_conv.kernel.get_value().dtype)))
        rope = pixtral_rope(self.config, pos_hw)
        for layer in self.transformer.layers:
            x = layer(x, rope, segment_ids)
        return x

    def hf_weights(self, w, name: str) -> None:
        cfg = self.config
        d, p, c = cfg.hidden_size, cfg.patch_size, cfg.num_channels
        conv = w.take(f"{name}.patch_conv.weight", (d, c, p, p))    # [out, C, ph, pw] -> [C*ph*pw, out]
        w.set(self.patch_conv.kernel, np.ascontiguousarray(conv.reshape(d, -1).T), matmul=True)
        self.ln_pre.hf_weights(w, f"{name}.ln_pre")
        load_children(self.transformer, w, f"{name}.transformer")
        ignore_tail(w, f"{name}.transformer", len(self.transformer.layers))
