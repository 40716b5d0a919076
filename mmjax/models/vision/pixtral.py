"""The Pixtral vision tower (PixtralVisionModel, Pixtral-12B / Mistral Small 3.x) as pure functions.

Images at their native size (patch multiples) -> Conv2d patch embed (one matmul over flattened
(C, p, p) patches, no bias) -> RMSNorm `ln_pre` -> pre-norm blocks (RMSNorm eps 1e-5, bias-free
q/k/v/o attention with 2-D axial RoPE over each patch's (row, col), gated MLP) -> the hidden
states the family's `vision_feature_layer` selects.

Packed encoding reuses Qwen2-VL's machinery (models/vision/qwen2_vl.py): any set of images is
one padded patch sequence with one attention segment per image (block-diagonal attention, HF's
`generate_block_attention_mask`), padded up a patch ladder. Patches are laid out merge-block
major (`patch_positions`), so the Mistral 3 patch merger is a plain reshape; the order inside the
tower does not matter (attention is bidirectional inside an image and positions are explicit).
"""
from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from mmjax.attention import attention
from mmjax.checkpoint import TensorSource, fused_linear, linear
from mmjax.errors import CheckpointError, UnsupportedModelError
from mmjax.models.layers import activation, cos_sin, dense, matmul, rms_norm
from mmjax.models.vision.qwen2_vl import _rotate

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


def load_pixtral_params(src: TensorSource, cfg: PixtralVisionConfig, prefix: str, num_layers: int) -> dict:
    """HF PixtralVisionModel weights (the first `num_layers` blocks; later ones are ignored) ->
    {"patch_embed": [C*p*p, width], "ln_pre", "blocks": [...]}."""
    w, i = cfg.hidden_size, cfg.intermediate_size
    conv = src.take(f"{prefix}patch_conv.weight", (w, cfg.num_channels, cfg.patch_size, cfg.patch_size))
    blocks = []
    for n in range(num_layers):
        bp = f"{prefix}transformer.layers.{n}."
        blocks.append({
            "attention_norm": src.take(bp + "attention_norm.weight", (w,)),
            "qkv": fused_linear(src, [bp + f"attention.{x}_proj" for x in "qkv"], w, [w, w, w], False),
            "o": linear(src, bp + "attention.o_proj", w, w, False),
            "ffn_norm": src.take(bp + "ffn_norm.weight", (w,)),
            "gate_up": fused_linear(src, [bp + "feed_forward.gate_proj", bp + "feed_forward.up_proj"], w, [i, i],
                                    False),
            "down": linear(src, bp + "feed_forward.down_proj", i, w, False),
        })
    for n in range(num_layers, cfg.num_layers):  # blocks past the feature layer never run
        src.ignore(re.escape(f"{prefix}transformer.layers.{n}.") + ".*")
    return {"patch_embed": np.ascontiguousarray(conv.reshape(w, -1).T),
            "ln_pre": src.take(f"{prefix}ln_pre.weight", (w,)), "blocks": blocks}


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
    emb = jnp.concatenate([hw, hw], axis=-1)
    return cos_sin(emb)


def pixtral_block(p: dict, x: jax.Array, cos: jax.Array, sin: jax.Array, segment_ids: jax.Array,
                  cfg: PixtralVisionConfig, impl: str) -> jax.Array:
    """One pre-norm block over the packed sequence x [N, width]; segment_ids [N] (-1 = padding)."""
    n, w = x.shape
    heads, hd = cfg.num_heads, cfg.head_dim
    h = rms_norm(p["attention_norm"], x, PIXTRAL_EPS)
    qkv = dense(p["qkv"], h).reshape(n, 3, heads, hd)
    q, k, v = _rotate(qkv[:, 0], cos, sin), _rotate(qkv[:, 1], cos, sin), qkv[:, 2]
    attn = attention(q[None], k[None], v[None], segment_ids=segment_ids[None], impl=impl)
    x = x + dense(p["o"], attn.reshape(n, w))
    h = rms_norm(p["ffn_norm"], x, PIXTRAL_EPS)
    gu = dense(p["gate_up"], h)
    h = activation(cfg.hidden_act)(gu[:, :cfg.intermediate_size]) * gu[:, cfg.intermediate_size:]
    return x + dense(p["down"], h)


def pixtral_hidden_state(params: dict, cfg: PixtralVisionConfig, patches: jax.Array, pos_hw: jax.Array,
                         segment_ids: jax.Array, layer: int, *, impl: str = "auto") -> jax.Array:
    """Packed patches [N, C*p*p], pos_hw [N, 2], segment_ids [N] (-1 = padding) -> HF's
    hidden_states[layer] [N, width] (0 = ln_pre output, i = after block i; blocks past `layer`
    are not run)."""
    x = matmul(patches.astype(params["patch_embed"].dtype), params["patch_embed"])
    x = rms_norm(params["ln_pre"], x, PIXTRAL_EPS)
    cos, sin = pixtral_rope(cfg, pos_hw)
    for blk in params["blocks"][:layer]:
        x = pixtral_block(blk, x, cos, sin, segment_ids, cfg, impl)
    return x
