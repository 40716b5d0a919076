"""The GLM-4.xV vision tower (transformers Glm4vVisionModel, shared by GLM-4.1V, GLM-4.5V and
GLM-4.6V) as NNX modules. Host-side packing is Qwen3-VL's (models/vision/qwen3_vl.py `pack`:
Qwen2-VL's merge-block patch order, one full-attention segment per frame, each patch's image grid
size beside its (row, col)).

Patches -> `patch_embed` (the Conv3d as one matmul, biased) -> `post_conv_layernorm` (RMSNorm) ->
learned position embeddings: the square table of `embeddings.position_embedding` resampled to each
image's patch grid by torch's bicubic `grid_sample` (align_corners=False, border padding; the
16 taps and weights computed in-graph from the int32 positions and grid sizes, `bicubic_pos_embed`)
-> blocks (RMSNorm, attention with the 2-D rotary of Qwen2-VL's tower over (row, col), a SwiGLU MLP
of width out_hidden_size) -> `post_layernorm` -> `downsample` (a merge x merge Conv2d with stride
merge over each 2x2 block of patches, one matmul here) -> `merger` (proj, LayerNorm, GELU, then a
SwiGLU `gate_proj` / `up_proj` / `down_proj`) -> [tokens, out_hidden_size].
"""
from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from mmjax.attention import attention
from mmjax.errors import UnsupportedModelError
from mmjax.models.nn.linear import Linear, activation, param
from mmjax.models.nn.mlp import GatedMLP
from mmjax.models.nn.norm import LayerNorm, RMSNorm
from mmjax.models.vision.qwen2_vl import PatchEmbed, QwenVisionConfig, _rotate, vision_rope


@dataclass(frozen=True)
class Glm4vVisionConfig(QwenVisionConfig):
    image_size: int = 336
    rms_norm_eps: float = 1e-5
    attention_bias: bool = False

    @property
    def pos_side(self) -> int:
        """Side of the square position table (image_size / patch_size)."""
        return self.image_size // self.patch_size

    @classmethod
    def from_hf(cls, v: dict, variant: str = "glm4v") -> "Glm4vVisionConfig":
        where = "vision_config"

        def get(key, default):
            return v[key] if v.get(key) is not None else default

        def side(key, default):
            x = get(key, default)
            if isinstance(x, (list, tuple)):
                if len(set(x)) != 1:
                    raise UnsupportedModelError(f"config.json: {where}.{key}={x} must be square",
                                                param=f"{where}.{key}")
                x = x[0]
            return int(x)
        rope = v.get("rope_parameters") or {}
        cfg = cls(variant="glm4v", depth=int(get("depth", 24)), hidden_size=int(get("hidden_size", 1536)),
                  intermediate_size=int(get("intermediate_size", 13696)), num_heads=int(get("num_heads", 12)),
                  out_hidden_size=int(get("out_hidden_size", 4096)), hidden_act=get("hidden_act", "silu"),
                  patch_size=side("patch_size", 14), temporal_patch_size=side("temporal_patch_size", 2),
                  merge_size=int(get("spatial_merge_size", 2)), in_channels=int(get("in_channels", 3)),
                  rope_theta=float(rope.get("rope_theta", 10000.0)), image_size=side("image_size", 336),
                  rms_norm_eps=float(get("rms_norm_eps", 1e-5)), attention_bias=bool(get("attention_bias", False)))
        if cfg.hidden_size % cfg.num_heads or cfg.head_dim % 4:
            raise UnsupportedModelError(f"config.json: vision head_dim must be a multiple of 4 (2D rotary), got "
                                        f"{cfg.hidden_size}/{cfg.num_heads}", param=f"{where}.num_heads")
        if cfg.pos_side < 1:
            raise UnsupportedModelError(f"config.json: {where}.image_size={cfg.image_size} is below one patch",
                                        param=f"{where}.image_size")
        activation(cfg.hidden_act)  # validate
        return cfg


def _cubic_weights(t: jax.Array) -> jax.Array:
    """torch's cubic convolution coefficients (A = -0.75) for the taps at -1, 0, 1, 2 of a
    fractional offset t [...] -> [..., 4]."""
    a = -0.75

    def near(x):    # |x| <= 1
        return ((a + 2) * x - (a + 3)) * x * x + 1

    def far(x):     # 1 < |x| < 2
        return ((a * x - 5 * a) * x + 8 * a) * x - 4 * a
    return jnp.stack([far(t + 1), near(t), near(1 - t), far(2 - t)], axis=-1)


def bicubic_pos_embed(table: jax.Array, pos_hw: jax.Array, sizes_hw: jax.Array, side: int) -> jax.Array:
    """The side x side table [side**2, width] sampled at each patch like Glm4vVisionEmbeddings:
    grid_sample(bicubic, align_corners=False, padding_mode="border") at the normalised centre
    ((col + 0.5) / w * 2 - 1, (row + 0.5) / h * 2 - 1) -> [N, width] float32."""
    pos = pos_hw.astype(jnp.float32)
    size = sizes_hw.astype(jnp.float32)
    norm = ((pos + 0.5) / size) * 2 - 1                                    # [N, 2] (h, w)
    src = ((norm + 1) * side - 1) / 2                                       # unnormalised source coords
    base = jnp.floor(src)
    wts = _cubic_weights(src - base)                                        # [N, 2, 4]
    taps = jnp.clip(base.astype(jnp.int32)[..., None] + jnp.arange(-1, 3), 0, side - 1)   # border: clamp
    idx = (taps[:, 0, :, None] * side + taps[:, 1, None, :]).reshape(-1, 16)
    w = (wts[:, 0, :, None] * wts[:, 1, None, :]).reshape(-1, 16)
    return (table[idx].astype(jnp.float32) * w[..., None]).sum(axis=1)


class Glm4vVisionEmbeddings(nnx.Module):
    """`position_embedding` (HF's nn.Embedding weight [side**2, width])."""

    def __init__(self, cfg: Glm4vVisionConfig, dtype=jnp.float32):
        self.cfg = cfg
        self.position_embedding = param((cfg.pos_side ** 2, cfg.hidden_size), dtype, (None, None))

    def __call__(self, x: jax.Array, pos_hw: jax.Array, sizes_hw: jax.Array) -> jax.Array:
        table = self.position_embedding.get_value()
        pe = bicubic_pos_embed(table, pos_hw, sizes_hw, self.cfg.pos_side)
        return x + pe.astype(table.dtype).astype(x.dtype)

    def hf_weights(self, w, name: str) -> None:
        w.set(self.position_embedding, w.take(f"{name}.position_embedding.weight",
                                              (self.cfg.pos_side ** 2, self.cfg.hidden_size)))


class Glm4vVisionAttention(nnx.Module):
    """`qkv` (biased when attention_bias), 2-D rotary on q and k in float32, block-diagonal
    attention by segment id, `proj` (no bias)."""

    def __init__(self, cfg: Glm4vVisionConfig, dtype=jnp.float32):
        d = cfg.hidden_size
        self.num_heads = cfg.num_heads
        self.qkv = Linear(d, 3 * d, bias=cfg.attention_bias, dtype=dtype, axes=("embed", "vision_heads"))
        self.proj = Linear(d, d, dtype=dtype, axes=("vision_heads", "embed"))

    def __call__(self, x: jax.Array, cos: jax.Array, sin: jax.Array, segment_ids: jax.Array,
                 impl: str = "auto") -> jax.Array:
        """x [N, width], cos / sin [N, head_dim], segment_ids [N] (-1 = padding) -> [N, width]."""
        n, w = x.shape
        qkv = self.qkv(x).reshape(n, 3, self.num_heads, w // self.num_heads)
        q, k, v = _rotate(qkv[:, 0], cos, sin), _rotate(qkv[:, 1], cos, sin), qkv[:, 2]
        out = attention(q[None], k[None], v[None], segment_ids=segment_ids[None], impl=impl)
        return self.proj(out.reshape(n, w))


class Glm4vVisionBlock(nnx.Module):
    """norm1, attn, norm2, mlp (gate_proj / up_proj / down_proj of width out_hidden_size)."""

    def __init__(self, cfg: Glm4vVisionConfig, dtype=jnp.float32):
        d = cfg.hidden_size
        self.norm1 = RMSNorm(d, cfg.rms_norm_eps, dtype=dtype)
        self.norm2 = RMSNorm(d, cfg.rms_norm_eps, dtype=dtype)
        self.attn = Glm4vVisionAttention(cfg, dtype)
        self.mlp = GatedMLP(d, cfg.out_hidden_size, act=cfg.hidden_act, axis="vision_mlp", dtype=dtype)

    def __call__(self, x, cos, sin, segment_ids, impl: str = "auto"):
        x = x + self.attn(self.norm1(x), cos, sin, segment_ids, impl)
        return x + self.mlp(self.norm2(x))


class Glm4vVisionPatchMerger(nnx.Module):
    """proj -> post_projection_norm (LayerNorm, eps 1e-5) -> GELU -> down(act(gate) * up)."""

    def __init__(self, cfg: Glm4vVisionConfig, dtype=jnp.float32):
        d = cfg.out_hidden_size
        self.proj = Linear(d, d, dtype=dtype, axes=("embed", "vision_mlp"))
        self.post_projection_norm = LayerNorm(d, 1e-5, dtype=dtype)
        self.mlp = GatedMLP(d, cfg.intermediate_size, act=cfg.hidden_act, axis="vision_mlp", dtype=dtype)

    def __call__(self, x: jax.Array) -> jax.Array:
        h = activation("gelu")(self.post_projection_norm(self.proj(x)))
        return self.mlp(h)

    def hf_weights(self, w, name: str) -> None:
        self.proj.hf_weights(w, f"{name}.proj")
        self.post_projection_norm.hf_weights(w, f"{name}.post_projection_norm")
        self.mlp.hf_weights(w, name)        # gate_proj / up_proj / down_proj sit on the merger itself


class Glm4vDownsample(nnx.Module):
    """HF's `downsample` Conv2d (kernel = stride = merge) over each merge x merge block of patches,
    as one [merge * merge * width, out] matmul over the block's patches in merge-block order."""

    def __init__(self, cfg: Glm4vVisionConfig, dtype=jnp.float32):
        self.cfg = cfg
        m = cfg.merge_size
        self.proj = Linear(m * m * cfg.hidden_size, cfg.out_hidden_size, bias=True, dtype=dtype,
                           axes=("embed", "vision_mlp"))

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.proj(x.reshape(-1, self.proj.d_in))

    def hf_weights(self, w, name: str) -> None:
        c, m = self.cfg, self.cfg.merge_size
        conv = w.take(f"{name}.weight", (c.out_hidden_size, c.hidden_size, m, m))
        w.set(self.proj.kernel, np.ascontiguousarray(conv.transpose(2, 3, 1, 0).reshape(-1, c.out_hidden_size)),
              matmul=True)
        w.set(self.proj.bias, w.take(f"{name}.bias", (c.out_hidden_size,)))


class Glm4vVisionModel(nnx.Module):
    """HF's `visual` (module docstring). attn_impl: `mmjax.attention.attention`'s impl."""

    def __init__(self, cfg: Glm4vVisionConfig, dtype=jnp.float32, attn_impl: str = "auto"):
        self.config, self.attn_impl = cfg, attn_impl
        self.patch_embed = PatchEmbed(cfg, bias=True, dtype=dtype)
        self.post_conv_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
        self.embeddings = Glm4vVisionEmbeddings(cfg, dtype)
        self.blocks = nnx.List([Glm4vVisionBlock(cfg, dtype) for _ in range(cfg.depth)])
        self.post_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
        self.downsample = Glm4vDownsample(cfg, dtype)
        self.merger = Glm4vVisionPatchMerger(cfg, dtype)

    def __call__(self, patches: jax.Array, pos_hw: jax.Array, image_seg: jax.Array, sizes_hw: jax.Array
                 ) -> jax.Array:
        """Packed patches [N, C*t*p*p] in merge-block order, pos_hw [N, 2], image_seg [N] int32 (one
        segment per frame, -1 = padding), sizes_hw [N, 2] (each patch's grid h, w) ->
        [N / merge**2, out_hidden]."""
        cfg = self.config
        x = self.post_conv_layernorm(self.patch_embed(patches))
        cos, sin = vision_rope(cfg, pos_hw)
        x = self.embeddings(x, pos_hw, sizes_hw)
        for blk in self.blocks:
            x = blk(x, cos, sin, image_seg, self.attn_impl)
        return self.merger(self.downsample(self.post_layernorm(x)))
