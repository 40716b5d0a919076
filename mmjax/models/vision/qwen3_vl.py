"""The Qwen3-VL vision tower (pure functions of params) and its host-side packing, on top of
Qwen2-VL's (models/vision/qwen2_vl.py: the same blocks, 2D rotary, merge-block patch order and
packed block-diagonal encoding with one segment per frame).

What Qwen3-VL adds (transformers Qwen3VLVisionModel):
- a biased patch embedding plus learned absolute position embeddings: a square table
  (`num_position_embeddings` = side**2) bilinearly resampled (align_corners) to each image's patch
  grid. The 4 taps and weights per patch are computed on the host (`interp_taps`) and packed with
  the patches; the weighted gather runs in the compiled step;
- DeepStack: the hidden states after the blocks in `deepstack_visual_indexes` each go through
  their own merger (LayerNorm after the 2x2 shuffle) and are returned beside the final merger's
  tokens: the encode output is [tokens, (1 + n_deepstack) * out_hidden] (the text model adds block
  k + 1 after decoder layer k, models/text `image_inputs`).

Frames: a grid (t, h, w) with t > 1 (video) packs as t full-attention segments of h*w patches, each
frame taking the same position-embedding taps, as HF does; nothing here is image-only.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from mmjax.checkpoint import TensorSource, linear, norm
from mmjax.errors import CheckpointError, UnsupportedModelError
from mmjax.models.layers import activation, dense, layer_norm
from mmjax.models.vision.qwen2_vl import (VISION_EPS, PackedImages, QwenVisionConfig, pack_images, vision_block,
                                          vision_rope)


@dataclass(frozen=True)
class Qwen3VisionConfig(QwenVisionConfig):
    num_position_embeddings: int = 2304
    deepstack_visual_indexes: tuple[int, ...] = ()

    @property
    def pos_side(self) -> int:
        return int(self.num_position_embeddings ** 0.5)

    @property
    def out_blocks(self) -> int:
        """Feature blocks per token: the merger's, then one per DeepStack layer."""
        return 1 + len(self.deepstack_visual_indexes)

    @classmethod
    def from_hf(cls, v: dict, variant: str = "qwen3_vl") -> "Qwen3VisionConfig":
        where = "vision_config"

        def get(key, default):
            return v[key] if v.get(key) is not None else default

        rope = v.get("rope_parameters") or {}
        cfg = cls(variant="qwen3_vl", depth=int(get("depth", 27)), hidden_size=int(get("hidden_size", 1152)),
                  intermediate_size=int(get("intermediate_size", 4304)),
                  out_hidden_size=int(get("out_hidden_size", 3584)), hidden_act=get("hidden_act", "gelu_pytorch_tanh"),
                  num_heads=int(get("num_heads", 16)), patch_size=int(get("patch_size", 16)),
                  temporal_patch_size=int(get("temporal_patch_size", 2)),
                  merge_size=int(get("spatial_merge_size", 2)), in_channels=int(get("in_channels", 3)),
                  rope_theta=float(rope.get("rope_theta", 10000.0)),
                  num_position_embeddings=int(get("num_position_embeddings", 2304)),
                  deepstack_visual_indexes=tuple(int(i) for i in get("deepstack_visual_indexes", (8, 16, 24))))
        if cfg.pos_side ** 2 != cfg.num_position_embeddings:
            raise UnsupportedModelError(f"config.json: {where}.num_position_embeddings={cfg.num_position_embeddings} "
                                        "is not a square", param=f"{where}.num_position_embeddings")
        bad = [i for i in cfg.deepstack_visual_indexes if not 0 <= i < cfg.depth]
        if bad:
            raise CheckpointError(f"config.json: {where}.deepstack_visual_indexes {bad} outside 0..{cfg.depth - 1}",
                                  param=f"{where}.deepstack_visual_indexes")
        if cfg.hidden_size % cfg.num_heads or cfg.head_dim % 4:
            raise UnsupportedModelError(f"config.json: vision head_dim must be a multiple of 4 (2D rotary), got "
                                        f"{cfg.hidden_size}/{cfg.num_heads}", param=f"{where}.num_heads")
        activation(cfg.hidden_act)  # validate
        return cfg


def _merger(src: TensorSource, prefix: str, cfg: Qwen3VisionConfig, postshuffle: bool) -> dict:
    m = cfg.merge_size ** 2 * cfg.hidden_size
    return {"norm": norm(src, prefix + "norm", m if postshuffle else cfg.hidden_size, bias=True),
            "fc1": linear(src, prefix + "linear_fc1", m, m, True),
            "fc2": linear(src, prefix + "linear_fc2", m, cfg.out_hidden_size, True)}


def load_vision_params(src: TensorSource, cfg: Qwen3VisionConfig, prefix: str = "visual.") -> dict:
    """HF Qwen3VLVisionModel weights -> params (block names as Qwen2-VL's, so `vision_block` runs them)."""
    w, i = cfg.hidden_size, cfg.intermediate_size
    conv = src.take(f"{prefix}patch_embed.proj.weight",
                    (w, cfg.in_channels, cfg.temporal_patch_size, cfg.patch_size, cfg.patch_size))
    blocks = []
    for n in range(cfg.depth):
        bp = f"{prefix}blocks.{n}."
        blocks.append({"norm1": norm(src, bp + "norm1", w, bias=True), "norm2": norm(src, bp + "norm2", w, bias=True),
                       "qkv": linear(src, bp + "attn.qkv", w, 3 * w, True),
                       "proj": linear(src, bp + "attn.proj", w, w, True),
                       "fc1": linear(src, bp + "mlp.linear_fc1", w, i, True),
                       "fc2": linear(src, bp + "mlp.linear_fc2", i, w, True)})
    return {
        # Conv3d with kernel == stride over a (C, t, p, p) patch is one matmul: [C*t*p*p, width] + bias
        "patch_embed": {"w": np.ascontiguousarray(conv.reshape(w, -1).T),
                        "b": src.take(f"{prefix}patch_embed.proj.bias", (w,))},
        "pos_embed": src.take(f"{prefix}pos_embed.weight", (cfg.num_position_embeddings, w)),
        "blocks": blocks,
        "merger": _merger(src, f"{prefix}merger.", cfg, postshuffle=False),
        "deepstack": [_merger(src, f"{prefix}deepstack_merger_list.{k}.", cfg, postshuffle=True)
                      for k in range(len(cfg.deepstack_visual_indexes))],
    }


# ------------------------------------------------------------------------------------------------
# Tower (pure functions, traced inside the compiled encode step)
# ------------------------------------------------------------------------------------------------

def merge(p: dict, x: jax.Array, cfg: Qwen3VisionConfig, postshuffle: bool) -> jax.Array:
    """Patch merger: x [N, width] -> [N / merge**2, out_hidden]; LayerNorm over each patch
    (final merger) or over each shuffled 2x2 group (DeepStack mergers), then fc1 - GELU - fc2."""
    m = cfg.merge_size ** 2 * cfg.hidden_size
    x = layer_norm(p["norm"], x.reshape(-1, m), VISION_EPS) if postshuffle else \
        layer_norm(p["norm"], x, VISION_EPS).reshape(-1, m)
    return dense(p["fc2"], jax.nn.gelu(dense(p["fc1"], x), approximate=False))


def vision_forward(params: dict, cfg: Qwen3VisionConfig, patches: jax.Array, pos_hw: jax.Array,
                   image_seg: jax.Array, taps: jax.Array, tap_weights: jax.Array, *, impl: str = "auto",
                   out_dtype=None) -> jax.Array:
    """Packed patches [N, C*t*p*p] in HF's merge-block order, pos_hw [N, 2], image_seg [N] int32
    (one segment per frame, -1 = padding), taps / tap_weights [N, 4] (the position-embedding
    resampling, `interp_taps`) -> [N / merge**2, (1 + n_deepstack) * out_hidden]: each merged
    token's final features, then its DeepStack features in `deepstack_visual_indexes` order."""
    pe = params["patch_embed"]
    x = dense(pe, patches.astype(pe["w"].dtype))
    pos = (params["pos_embed"][taps] * tap_weights[..., None].astype(params["pos_embed"].dtype)).sum(axis=1)
    x = x + pos.astype(x.dtype)
    cos, sin = vision_rope(cfg, pos_hw)
    deep = {}
    for i, blk in enumerate(params["blocks"]):
        x = vision_block(blk, x, cos, sin, image_seg, cfg, impl)
        if i in cfg.deepstack_visual_indexes:
            k = cfg.deepstack_visual_indexes.index(i)
            deep[k] = merge(params["deepstack"][k], x, cfg, postshuffle=True)
    out = [merge(params["merger"], x, cfg, postshuffle=False)] + [deep[k] for k in sorted(deep)]
    out = jnp.concatenate(out, axis=-1)
    return out if out_dtype is None else out.astype(out_dtype)


def make_encode_fn(cfg: Qwen3VisionConfig, impl: str = "auto"):
    """A jittable (params, packed arrays) -> features in the text model's dtype."""
    def encode_fn(params: dict, packed: tuple) -> jax.Array:
        patches, pos_hw, image_seg, taps, tap_weights = packed
        return vision_forward(params["vision"], cfg, patches, pos_hw, image_seg, taps, tap_weights, impl=impl,
                              out_dtype=params["text"]["embed"].dtype)
    return encode_fn


# ------------------------------------------------------------------------------------------------
# Host-side packing
# ------------------------------------------------------------------------------------------------

def _axis_taps(index: np.ndarray, size: int, side: int) -> tuple[np.ndarray, np.ndarray]:
    """Bilinear, align_corners=True taps on one axis (transformers' _interpolation_axis_taps_weights,
    float32 as torch computes it): (taps [n, 2] clamped to the table, weights [n, 2])."""
    src = index.astype(np.float32) * np.float32(side - 1) / np.float32(max(size - 1, 1))
    floor = np.floor(src)
    offsets = np.arange(2, dtype=np.float32)
    taps = np.clip(floor[:, None].astype(np.int64) + np.arange(2), 0, side - 1)
    weights = np.clip(1 - np.abs(src[:, None] - floor[:, None] - offsets), 0, None).astype(np.float32)
    return taps, weights


def interp_taps(pos_hw: np.ndarray, grid_hw: tuple[int, int], side: int) -> tuple[np.ndarray, np.ndarray]:
    """pos_hw [n, 2] (patch row, col) on an (h, w) patch grid -> (taps [n, 4] int32 into the
    side x side position table, weights [n, 4] float32): the 2x2 bilinear neighbourhood."""
    h_taps, h_w = _axis_taps(pos_hw[:, 0], grid_hw[0], side)
    w_taps, w_w = _axis_taps(pos_hw[:, 1], grid_hw[1], side)
    taps = (h_taps[:, :, None] * side + w_taps[:, None, :]).reshape(-1, 4)
    weights = (h_w[:, :, None] * w_w[:, None, :]).reshape(-1, 4)
    return taps.astype(np.int32), weights.astype(np.float32)


@dataclass
class Qwen3PackedImages(PackedImages):
    """PackedImages plus the position-embedding taps [n_pad, 4] (padding: tap 0, weight 0)."""
    taps: np.ndarray = None
    tap_weights: np.ndarray = None

    def arrays(self) -> tuple:
        return self.patches, self.pos_hw, self.image_seg, self.taps, self.tap_weights


def pack(images: list, cfg: Qwen3VisionConfig, n_pad: int | None = None) -> Qwen3PackedImages:
    """ImageInputs (pixels = patches [t*h*w, patch_dim] in HF order, grid (t, h, w)) -> one packed
    call (Qwen2-VL's packing plus each patch's position-embedding taps)."""
    base = pack_images(images, cfg, n_pad)
    taps = np.zeros((base.n_pad, 4), np.int32)
    weights = np.zeros((base.n_pad, 4), np.float32)
    off = 0
    for im in images:
        t, h, w = (int(x) for x in im.grid)
        n = t * h * w
        taps[off:off + n], weights[off:off + n] = interp_taps(base.pos_hw[off:off + n], (h, w), cfg.pos_side)
        off += n
    fields = {f.name: getattr(base, f.name) for f in dataclasses.fields(PackedImages)}
    return Qwen3PackedImages(**fields, taps=taps, tap_weights=weights)
