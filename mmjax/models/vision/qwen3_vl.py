"""The Qwen3-VL vision tower as NNX modules and its host-side packing, on top of Qwen2-VL's
(models/vision/qwen2_vl.py: the same attention, 2D rotary, merge-block patch order and packed
block-diagonal encoding with one segment per frame).

What Qwen3-VL adds (transformers Qwen3VLVisionModel):
- a biased patch embedding plus learned absolute position embeddings: a square table
  (`num_position_embeddings` = side**2) bilinearly resampled (align_corners) to each image's patch
  grid (`resampled_pos_embed`: each patch's 2x2 taps and weights from its (row, col) and its
  image's grid size, packed as int32 `sizes_hw` beside `pos_hw`, so the patches stay the call's
  only float input, which mmjax.research.gradients differentiates);
- DeepStack: the hidden states after the blocks in `deepstack_visual_indexes` each go through
  their own merger (LayerNorm after the 2x2 shuffle) and are returned beside the final merger's
  tokens: the encode output is [tokens, (1 + n_deepstack) * out_hidden] (the text model adds block
  k + 1 after decoder layer k, text/llama.py's DeepStack).

Module tree as transformers' `visual`: `patch_embed.proj`, `pos_embed` (the table, a Param: HF's
pos_embed.weight), `blocks[i].{norm1, attn.{qkv, proj}, norm2, mlp.{linear_fc1, linear_fc2}}`,
`merger.{norm, linear_fc1, linear_fc2}`, `deepstack_merger_list[k]` (the same).

Frames: a grid (t, h, w) with t > 1 (video) packs as t full-attention segments of h*w patches, each
frame taking the same position-embedding taps, as HF does; nothing here is image-only.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from mmjax.errors import CheckpointError, UnsupportedModelError
from mmjax.models.nn.linear import Linear, activation, param
from mmjax.models.nn.norm import LayerNorm
from mmjax.models.nn.weights import load_children
from mmjax.models.vision.qwen2_vl import (VISION_EPS, PackedImages, PatchEmbed, QwenVisionConfig, Qwen2VLVisionBlock,
                                          pack_images, vision_rope)


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


# ------------------------------------------------------------------------------------------------
# Tower (traced inside the compiled encode step)
# ------------------------------------------------------------------------------------------------

class Qwen3VLVisionMLP(nnx.Module):
    """linear_fc2(act(linear_fc1(x)))."""

    def __init__(self, d: int, d_hidden: int, d_out: int, *, act: str, dtype=jnp.float32):
        self.act = act
        self.linear_fc1 = Linear(d, d_hidden, bias=True, dtype=dtype, axes=("embed", "vision_mlp"))
        self.linear_fc2 = Linear(d_hidden, d_out, bias=True, dtype=dtype, axes=("vision_mlp", "embed"))

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.linear_fc2(activation(self.act)(self.linear_fc1(x)))


class Qwen3VLVisionBlock(Qwen2VLVisionBlock):
    """Qwen2-VL's block with LayerNorms and the linear_fc1 / linear_fc2 MLP."""

    @staticmethod
    def make_mlp(cfg: QwenVisionConfig, dtype) -> nnx.Module:
        return Qwen3VLVisionMLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_size, act=cfg.hidden_act,
                                dtype=dtype)


class Qwen3VLVisionPatchMerger(Qwen3VLVisionMLP):
    """Patch merger: x [N, width] -> [N / merge**2, out_hidden]; `norm` (LayerNorm) over each
    patch (final merger) or over each shuffled 2x2 group (DeepStack mergers, `postshuffle`), then
    linear_fc1 - GELU - linear_fc2."""

    def __init__(self, cfg: Qwen3VisionConfig, *, postshuffle: bool, dtype=jnp.float32):
        m = cfg.merge_size ** 2 * cfg.hidden_size
        super().__init__(m, m, cfg.out_hidden_size, act="gelu", dtype=dtype)
        self.m, self.postshuffle = m, postshuffle
        self.norm = LayerNorm(m if postshuffle else cfg.hidden_size, VISION_EPS, dtype=dtype)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = self.norm(x.reshape(-1, self.m)) if self.postshuffle else self.norm(x).reshape(-1, self.m)
        return super().__call__(x)


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


class Qwen3VLVisionModel(nnx.Module):
    """HF's `visual` (see the module docstring). attn_impl: as Qwen2VisionTransformer's."""

    def __init__(self, cfg: Qwen3VisionConfig, dtype=jnp.float32, attn_impl: str = "auto"):
        self.config, self.attn_impl = cfg, attn_impl
        self.patch_embed = PatchEmbed(cfg, bias=True, dtype=dtype)
        self.pos_embed = param((cfg.num_position_embeddings, cfg.hidden_size), dtype, (None, None))
        self.blocks = nnx.List([Qwen3VLVisionBlock(cfg, dtype) for _ in range(cfg.depth)])
        self.merger = Qwen3VLVisionPatchMerger(cfg, postshuffle=False, dtype=dtype)
        self.deepstack_merger_list = nnx.List([Qwen3VLVisionPatchMerger(cfg, postshuffle=True, dtype=dtype)
                                               for _ in cfg.deepstack_visual_indexes])

    def __call__(self, patches: jax.Array, pos_hw: jax.Array, image_seg: jax.Array, sizes_hw: jax.Array
                 ) -> jax.Array:
        """Packed patches [N, C*t*p*p] in HF's merge-block order, pos_hw [N, 2], image_seg [N] int32
        (one segment per frame, -1 = padding), sizes_hw [N, 2] int32 (each patch's image grid h, w)
        -> [N / merge**2, (1 + n_deepstack) * out_hidden]: each merged token's final features, then
        its DeepStack features in `deepstack_visual_indexes` order."""
        cfg = self.config
        x = self.patch_embed(patches)
        x = x + resampled_pos_embed(self.pos_embed.get_value(), pos_hw, sizes_hw, cfg.pos_side).astype(x.dtype)
        cos, sin = vision_rope(cfg, pos_hw)
        deep = {}
        for i, blk in enumerate(self.blocks):
            x = blk(x, cos, sin, image_seg, self.attn_impl)
            if i in cfg.deepstack_visual_indexes:
                k = cfg.deepstack_visual_indexes.index(i)
                deep[k] = self.deepstack_merger_list[k](x)
        return jnp.concatenate([self.merger(x)] + [deep[k] for k in sorted(deep)], axis=-1)

    def hf_weights(self, w, name: str) -> None:
        load_children(self, w, name)
        w.set(self.pos_embed, w.take(f"{name}.pos_embed.weight", (self.config.num_position_embeddings,
                                                                   self.config.hidden_size)))


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
