"""The Qwen3-VL vision tower (pure functions of params) and its host-side packing, on top of
Qwen2-VL's (models/vision/qwen2_vl.py: the same blocks, 2D rotary, merge-block patch order and
packed block-diagonal encoding with one segment per frame).

What Qwen3-VL adds (transformers Qwen3VLVisionModel):
- a biased patch embedding plus learned absolute position embeddings: a square table
  (`num_position_embeddings` = side**2) bilinearly resampled (align_corners) to each image's patch
  grid (`resampled_pos_embed`: each patch's 2x2 taps and weights from its (row, col) and its
  image's grid size, packed as int32 `sizes_hw` beside `pos_hw`, so the patches stay the call's
  only float input, which mmjax.research.gradients differentiates);
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


def resampled_pos_embed(table: jax.Array, pos_hw: jax.Array, sizes_hw: jax.Array, side: int) -> jax.Array:
    """The side x side position table [side**2, width] bilinearly resampled (align_corners=True)
    at each patch: pos_hw [N, 2] (row, col) on a grid of sizes_hw [N, 2] (h, w) -> [N, width].
    Float32 index math in transformers' order (get_vision_interpolation_indices_and_weights)."""
    src = pos_hw.astype(jnp.float32) * np.float32(side - 1) / jnp.maximum(sizes_hw - 1, 1).astype(jnp.float32)
    floor = jnp.floor(src)                                                         # [N, 2]
    offsets = jnp.arange(2)
    taps = jnp.clip(floor.astype(jnp.int32)[..., None] + offsets, 0, side - 1)     # [N, 2 axes, 2 taps]
    weights = jnp.maximum(1 - jnp.abs(src[..., None] - floor[..., None] - offsets.astype(jnp.float32)), 0)
    idx = (taps[:, 0, :, None] * side + taps[:, 1, None, :]).reshape(-1, 4)
    w = (weights[:, 0, :, None] * weights[:, 1, None, :]).reshape(-1, 4)
    # float32 like torch (the bf16 table promotes against float32 weights), cast by the caller
    return (table[idx].astype(jnp.float32) * w[..., None]).sum(axis=1)


def vision_forward(params: dict, cfg: Qwen3VisionConfig, patches: jax.Array, pos_hw: jax.Array,
                   image_seg: jax.Array, sizes_hw: jax.Array, *, impl: str = "auto", out_dtype=None) -> jax.Array:
    """Packed patches [N, C*t*p*p] in HF's merge-block order, pos_hw [N, 2], image_seg [N] int32
    (one segment per frame, -1 = padding), sizes_hw [N, 2] int32 (each patch's image grid h, w) ->
    [N / merge**2, (1 + n_deepstack) * out_hidden]: each merged token's final features, then its
    DeepStack features in `deepstack_visual_indexes` order."""
    pe = params["patch_embed"]
    x = dense(pe, patches.astype(pe["w"].dtype))
    x = x + resampled_pos_embed(params["pos_embed"], pos_hw, sizes_hw, cfg.pos_side).astype(x.dtype)
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
        patches, pos_hw, image_seg, sizes_hw = packed
        return vision_forward(params["vision"], cfg, patches, pos_hw, image_seg, sizes_hw, impl=impl,
                              out_dtype=params["text"]["embed"].dtype)
    return encode_fn


# ------------------------------------------------------------------------------------------------
# Host-side packing
# ------------------------------------------------------------------------------------------------

@dataclass
class Qwen3PackedImages(PackedImages):
    """PackedImages plus each patch's image grid (h, w) [n_pad, 2] int32 (padding: 1, 1)."""
    sizes_hw: np.ndarray = None

    def arrays(self) -> tuple:
        return self.patches, self.pos_hw, self.image_seg, self.sizes_hw


def pack(images: list, cfg: Qwen3VisionConfig, n_pad: int | None = None) -> Qwen3PackedImages:
    """ImageInputs (pixels = patches [t*h*w, patch_dim] in HF order, grid (t, h, w)) -> one packed
    call (Qwen2-VL's packing plus each patch's grid size for the position-embedding resampling)."""
    base = pack_images(images, cfg, n_pad)
    sizes = np.ones((base.n_pad, 2), np.int32)
    off = 0
    for im in images:
        t, h, w = (int(x) for x in im.grid)
        sizes[off:off + t * h * w] = (h, w)
        off += t * h * w
    fields = {f.name: getattr(base, f.name) for f in dataclasses.fields(PackedImages)}
    return Qwen3PackedImages(**fields, sizes_hw=sizes)
