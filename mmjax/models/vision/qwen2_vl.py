"""The Qwen2-VL / Qwen2.5-VL vision tower as NNX modules, and its host-side packing.

Flattened (C, t, p, p) patches -> linear patch embed -> blocks with 2D rotary embeddings over the
(h, w) patch grid -> 2x2 patch merger (LayerNorm for Qwen2-VL, RMSNorm for Qwen2.5-VL) -> LLM
tokens. Qwen2-VL blocks: LayerNorm + quick_gelu MLP, full attention within each image. Qwen2.5-VL
blocks: RMSNorm + SwiGLU MLP, attention inside `window_size`-pixel windows except in
`fullatt_block_indexes`.

Module tree as transformers' `visual` (Qwen2VisionTransformerPretrainedModel /
Qwen2_5_VisionTransformerPretrainedModel): `patch_embed.proj` (the Conv3d, kernel == stride, as
one [C*t*p*p, width] matmul), `blocks[i].{norm1, attn.{qkv, proj}, norm2, mlp}` (Qwen2-VL's mlp:
`fc1`, `fc2`; Qwen2.5-VL's: `gate_up_proj` (HF gate_proj|up_proj fused), `down_proj`),
`merger.{ln_q, mlp}` (HF's mlp Sequential: its `mlp.0` / `mlp.2` Linears as `mlp.fc1` / `mlp.fc2`).

Packed encoding: any set of images (one request or several) becomes ONE padded sequence of
patches. Attention is block-diagonal through `mmjax.attention.attention(segment_ids=...)`: one
segment per image (per frame; t = 1 here), one per window in Qwen2.5-VL's windowed blocks, and
-1 for padding. Qwen2.5-VL's window reordering (HF's `window_index`) is applied on the host to
each image's patches before packing and undone on the host after the merger, exactly as HF does
in-graph. The padded length comes from a patch-count ladder (`patch_ladder`), so the number of
encode compilations is bounded.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from mmjax.attention import attention
from mmjax.errors import CheckpointError, InvalidRequestError, UnsupportedModelError
from mmjax.models.nn.linear import Linear, activation
from mmjax.models.nn.mlp import MLP, GatedMLP
from mmjax.models.nn.norm import LayerNorm, RMSNorm
from mmjax.models.nn.rope import cos_sin

VISION_EPS = 1e-6  # HF hard-codes eps=1e-6 for every vision norm and the merger's ln_q


@dataclass(frozen=True)
class QwenVisionConfig:
    variant: str               # "qwen2_vl" | "qwen2_5_vl"
    depth: int
    hidden_size: int           # vision width (Qwen2-VL's embed_dim)
    intermediate_size: int
    num_heads: int
    out_hidden_size: int       # LLM hidden size (merger output)
    hidden_act: str
    patch_size: int = 14
    temporal_patch_size: int = 2
    merge_size: int = 2
    in_channels: int = 3
    rope_theta: float = 10000.0
    window_size: int = 0                        # pixels (Qwen2.5-VL)
    fullatt_block_indexes: tuple[int, ...] = ()  # Qwen2.5-VL

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patch_dim(self) -> int:
        return self.in_channels * self.temporal_patch_size * self.patch_size ** 2

    @property
    def windowed(self) -> bool:
        return self.variant == "qwen2_5_vl"

    @property
    def merge_window(self) -> int:
        """Window side in merged tokens (HF's vit_merger_window_size)."""
        return self.window_size // self.merge_size // self.patch_size

    @property
    def window_patches(self) -> int:
        """Most patches one window can hold (edge windows hold fewer)."""
        return self.merge_window ** 2 * self.merge_size ** 2

    def block_is_windowed(self, i: int) -> bool:
        return self.windowed and i not in self.fullatt_block_indexes

    @classmethod
    def from_hf(cls, v: dict, variant: str) -> "QwenVisionConfig":
        where = "vision_config"

        def get(key, default=dataclasses.MISSING, *alts):
            for k in (key,) + alts:
                if v.get(k) is not None:
                    return v[k]
            if default is dataclasses.MISSING:
                raise CheckpointError(f"config.json: required field '{where}.{key}' is missing", param=f"{where}.{key}")
            return default

        rope = v.get("rope_parameters") or {}
        theta = float(rope.get("rope_theta", v.get("rope_theta", 10000.0)))
        common = dict(num_heads=int(get("num_heads", 16, "num_attention_heads")),
                      patch_size=int(get("patch_size", 14)),
                      temporal_patch_size=int(get("temporal_patch_size", 2)),
                      merge_size=int(get("spatial_merge_size", 2)),
                      in_channels=int(get("in_channels", 3, "in_chans")), rope_theta=theta)
        if variant == "qwen2_vl":
            width = int(get("embed_dim", 1280))
            cfg = cls(variant=variant, depth=int(get("depth", 32, "num_hidden_layers")), hidden_size=width,
                      intermediate_size=int(width * float(get("mlp_ratio", 4))),
                      out_hidden_size=int(get("hidden_size", 3584)),
                      hidden_act=get("hidden_act", "quick_gelu"), **common)
        else:
            cfg = cls(variant=variant, depth=int(get("depth", 32, "num_hidden_layers")),
                      hidden_size=int(get("hidden_size", 1280)),
                      intermediate_size=int(get("intermediate_size", 3420)),
                      out_hidden_size=int(get("out_hidden_size", 3584)),
                      hidden_act=get("hidden_act", "silu"),
                      window_size=int(get("window_size", 112)),
                      fullatt_block_indexes=tuple(int(i) for i in get("fullatt_block_indexes", (7, 15, 23, 31))),
                      **common)
            if cfg.merge_window <= 0:
                raise UnsupportedModelError(f"config.json: {where}.window_size={cfg.window_size} is smaller than "
                                            "one merged token", param=f"{where}.window_size")
        if cfg.hidden_size % cfg.num_heads or cfg.head_dim % 4:
            raise UnsupportedModelError(f"config.json: vision head_dim must be a multiple of 4 (2D rotary), got "
                                        f"{cfg.hidden_size}/{cfg.num_heads}", param=f"{where}.num_heads")
        activation(cfg.hidden_act)  # validate
        return cfg


# ------------------------------------------------------------------------------------------------
# Vision tower (traced inside the compiled encode step)
# ------------------------------------------------------------------------------------------------

def vision_inv_freq(cfg: QwenVisionConfig) -> np.ndarray:
    """[head_dim // 4] float32: one frequency set shared by the h and w axes (HF's axial rope)."""
    dim = cfg.head_dim // 2
    return (1.0 / (np.float32(cfg.rope_theta) ** (np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim)))
            ).astype(np.float32)


def vision_rope(cfg: QwenVisionConfig, pos_hw: jax.Array) -> tuple[jax.Array, jax.Array]:
    """pos_hw [N, 2] (row, col of each patch) -> cos, sin [N, head_dim] float32:
    angles (h * f, w * f) concatenated, then repeated for both rotated halves."""
    freqs = pos_hw.astype(jnp.float32)[..., None] * jnp.asarray(vision_inv_freq(cfg))  # [N, 2, hd/4]
    hw = freqs.reshape(freqs.shape[0], -1)                                                # [N, hd/2]
    emb = jnp.concatenate([hw, hw], axis=-1)
    return cos_sin(emb)


def _rotate(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """x [N, heads, hd] rotated in float32 (HF's apply_rotary_pos_emb_vision), back to x.dtype."""
    xf = x.astype(jnp.float32)
    half = x.shape[-1] // 2
    rot = jnp.concatenate([-xf[..., half:], xf[..., :half]], axis=-1)
    return (xf * cos[:, None] + rot * sin[:, None]).astype(x.dtype)


class PatchEmbed(nnx.Module):
    """HF's PatchEmbed: `proj`, the Conv3d over (C, t, p, p) patches with kernel == stride, as one
    [C*t*p*p, width] matmul (bias: Qwen3-VL). Neither quantized nor packed (the first layer)."""

    def __init__(self, cfg: QwenVisionConfig, *, bias: bool = False, dtype=jnp.float32):
        self.cfg = cfg
        self.proj = Linear(cfg.patch_dim, cfg.hidden_size, bias=bias, dtype=dtype, quantize=False)

    def __call__(self, patches: jax.Array) -> jax.Array:
        return self.proj(patches.astype(self.proj.kernel.get_value().dtype))

    def hf_weights(self, w, name: str) -> None:
        c = self.cfg
        conv = w.take(f"{name}.proj.weight", (c.hidden_size, c.in_channels, c.temporal_patch_size, c.patch_size,
                                              c.patch_size))
        w.set(self.proj.kernel, np.ascontiguousarray(conv.reshape(c.hidden_size, -1).T))
        if self.proj.bias is not None:
            w.set(self.proj.bias, w.take(f"{name}.proj.bias", (c.hidden_size,)))


class Qwen2VLVisionAttention(nnx.Module):
    """HF's VisionAttention over a packed patch sequence: `qkv` (one HF Linear [w, 3w]), 2D
    rotary on q and k (float32), block-diagonal attention by segment id, `proj`."""

    def __init__(self, dim: int, num_heads: int, *, dtype=jnp.float32):
        self.num_heads = num_heads
        self.qkv = Linear(dim, 3 * dim, bias=True, dtype=dtype, axes=("embed", "vision_heads"))
        self.proj = Linear(dim, dim, bias=True, dtype=dtype, axes=("vision_heads", "embed"))

    def __call__(self, x: jax.Array, cos: jax.Array, sin: jax.Array, segment_ids: jax.Array,
                 impl: str = "auto") -> jax.Array:
        """x [N, width], cos / sin [N, head_dim], segment_ids [N] (-1 = padding) -> [N, width].

        Segment ids are non-decreasing along the packed sequence (images, and windows after the
        window reordering, are contiguous), so the blockwise kernels' segment block bounds visit
        only each query block's own image / window: packed attention costs sum(n_i^2), not N^2."""
        n, w = x.shape
        heads = self.num_heads
        qkv = self.qkv(x).reshape(n, 3, heads, w // heads)
        q, k, v = _rotate(qkv[:, 0], cos, sin), _rotate(qkv[:, 1], cos, sin), qkv[:, 2]
        out = attention(q[None], k[None], v[None], segment_ids=segment_ids[None], impl=impl)
        return self.proj(out.reshape(n, w))


def vision_norm(cfg: QwenVisionConfig, dim: int, dtype):
    """Qwen2.5-VL's RMSNorm, else LayerNorm (eps 1e-6)."""
    if cfg.variant == "qwen2_5_vl":
        return RMSNorm(dim, VISION_EPS, dtype=dtype)
    return LayerNorm(dim, VISION_EPS, dtype=dtype)


class Qwen2VLVisionBlock(nnx.Module):
    """Pre-norm block: norm1, attn, norm2, mlp (`make_mlp`: Qwen2-VL's fc1 / fc2, Qwen2.5-VL's
    gated gate_up_proj / down_proj)."""

    def __init__(self, cfg: QwenVisionConfig, dtype=jnp.float32):
        w = cfg.hidden_size
        self.norm1 = vision_norm(cfg, w, dtype)
        self.norm2 = vision_norm(cfg, w, dtype)
        self.attn = Qwen2VLVisionAttention(w, cfg.num_heads, dtype=dtype)
        self.mlp = self.make_mlp(cfg, dtype)

    @staticmethod
    def make_mlp(cfg: QwenVisionConfig, dtype) -> nnx.Module:
        w, i = cfg.hidden_size, cfg.intermediate_size
        if cfg.variant == "qwen2_5_vl":
            return GatedMLP(w, i, act=cfg.hidden_act, bias=True, axis="vision_mlp", dtype=dtype)
        return MLP(w, i, w, act=cfg.hidden_act, dtype=dtype, axes=("embed", "vision_mlp", "embed"))

    def __call__(self, x: jax.Array, cos: jax.Array, sin: jax.Array, segment_ids: jax.Array,
                 impl: str = "auto") -> jax.Array:
        x = x + self.attn(self.norm1(x), cos, sin, segment_ids, impl)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nnx.Module):
    """HF's PatchMerger: `ln_q` over each patch, the merge_size**2 neighbours concatenated, then
    `mlp` (HF's Sequential mlp.0 - GELU - mlp.2, here `mlp.fc1` / `mlp.fc2`)."""

    def __init__(self, cfg: QwenVisionConfig, dtype=jnp.float32):
        m = cfg.merge_size ** 2 * cfg.hidden_size
        self.ln_q = vision_norm(cfg, cfg.hidden_size, dtype)
        self.mlp = MLP(m, m, cfg.out_hidden_size, act="gelu", names=("0", "2"), dtype=dtype,
                       axes=("embed", "vision_mlp", "embed"))

    def __call__(self, x: jax.Array) -> jax.Array:
        """x [N, width] -> [N / merge**2, out_hidden]."""
        return self.mlp(self.ln_q(x).reshape(-1, self.mlp.fc1.d_in))


class Qwen2VisionTransformer(nnx.Module):
    """HF's `visual` (see the module docstring). attn_impl: `mmjax.attention.attention`'s impl
    ("auto"; "reference" is the naive O(N^2) path, for comparisons)."""

    def __init__(self, cfg: QwenVisionConfig, dtype=jnp.float32, attn_impl: str = "auto"):
        self.config, self.attn_impl = cfg, attn_impl
        self.patch_embed = PatchEmbed(cfg, dtype=dtype)
        self.blocks = nnx.List([Qwen2VLVisionBlock(cfg, dtype) for _ in range(cfg.depth)])
        self.merger = PatchMerger(cfg, dtype)

    def __call__(self, patches: jax.Array, pos_hw: jax.Array, image_seg: jax.Array,
                 window_seg: jax.Array) -> jax.Array:
        """Packed patches [N, C*t*p*p] (N a multiple of merge_size**2, every image's patches in
        HF's order — window order for Qwen2.5-VL), pos_hw [N, 2], image_seg / window_seg [N] int32
        (-1 = padding) -> merged tokens [N / merge_size**2, out_hidden] in the same order."""
        cfg = self.config
        x = self.patch_embed(patches)
        cos, sin = vision_rope(cfg, pos_hw)
        for i, blk in enumerate(self.blocks):
            x = blk(x, cos, sin, window_seg if cfg.block_is_windowed(i) else image_seg, self.attn_impl)
        return self.merger(x)

# ------------------------------------------------------------------------------------------------
# Host-side packing
# ------------------------------------------------------------------------------------------------

def patch_positions(grid_thw: tuple[int, int, int], merge: int) -> np.ndarray:
    """(row, col) of every patch [t*h*w, 2] in HF's merge-block-major order."""
    t, h, w = grid_thw
    hh, ww = np.meshgrid(np.arange(h), np.arange(w), indexing="ij")
    shape = (h // merge, merge, w // merge, merge)
    hh = hh.reshape(shape).transpose(0, 2, 1, 3).ravel()
    ww = ww.reshape(shape).transpose(0, 2, 1, 3).ravel()
    return np.tile(np.stack([hh, ww], -1), (t, 1)).astype(np.int32)


def window_order(grid_thw: tuple[int, int, int], merge: int, merge_window: int) -> tuple[np.ndarray, np.ndarray]:
    """HF's get_vision_window_index for one image: (merged-token order [t*lh*lw], window sizes in
    merged tokens). Windows tile the merged grid from the top-left; edge windows are partial."""
    t, h, w = grid_thw
    lh, lw = h // merge, w // merge
    nh, nw = -(-lh // merge_window), -(-lw // merge_window)
    idx = np.full((t, nh * merge_window, nw * merge_window), -1, np.int64)
    idx[:, :lh, :lw] = np.arange(t * lh * lw).reshape(t, lh, lw)
    idx = idx.reshape(t, nh, merge_window, nw, merge_window).transpose(0, 1, 3, 2, 4).reshape(t * nh * nw, -1)
    sizes = (idx >= 0).sum(-1)
    order = idx.ravel()
    return order[order >= 0], sizes[sizes > 0]


@dataclass
class PackedImages:
    """One packed encode call: arrays padded to `n_pad` patches + how to split the output."""
    patches: np.ndarray      # [n_pad, patch_dim] float32
    pos_hw: np.ndarray       # [n_pad, 2] int32
    image_seg: np.ndarray    # [n_pad] int32, -1 = padding
    window_seg: np.ndarray   # [n_pad] int32, -1 = padding
    spans: list              # per image: (first merged token, n tokens, inverse window order or None)
    n_valid: int             # real patches

    @property
    def n_pad(self) -> int:
        return len(self.image_seg)

    def arrays(self) -> tuple:
        return self.patches, self.pos_hw, self.image_seg, self.window_seg


def pack_images(images: list, cfg: QwenVisionConfig, n_pad: int | None = None) -> PackedImages:
    """ImageInputs (pixels = patches [t*h*w, patch_dim] in HF order, grid_thw) -> PackedImages.
    cfg: anything with patch_dim, merge_size and windowed (merge_window when windowed): a
    QwenVisionConfig, or the Pixtral family's packing spec (models/mistral3.py)."""
    m2 = cfg.merge_size ** 2
    total = sum(int(np.prod(im.grid)) for im in images)
    n_pad = total if n_pad is None else n_pad
    if n_pad < total or n_pad % m2:
        raise ValueError(f"bad packed length {n_pad} for {total} patches")
    patches = np.zeros((n_pad, cfg.patch_dim), np.float32)
    pos = np.zeros((n_pad, 2), np.int32)
    img_seg = np.full((n_pad,), -1, np.int32)
    win_seg = np.full((n_pad,), -1, np.int32)
    spans, off, seg, win = [], 0, 0, 0
    for im in images:
        t, h, w = (int(x) for x in im.grid)
        n = t * h * w
        px = np.asarray(im.pixels, np.float32)
        if px.shape != (n, cfg.patch_dim):
            raise InvalidRequestError(f"image patches {px.shape} do not match grid {im.grid} "
                                      f"(expected [{n}, {cfg.patch_dim}])", param="images")
        pp = patch_positions((t, h, w), cfg.merge_size)
        inv = None
        if cfg.windowed:
            order, sizes = window_order((t, h, w), cfg.merge_size, cfg.merge_window)
            rows = (order[:, None] * m2 + np.arange(m2)).ravel()
            px, pp = px[rows], pp[rows]
            win_seg[off:off + n] = win + np.repeat(np.arange(len(sizes)), sizes * m2)
            win += len(sizes)
            inv = np.argsort(order)
        patches[off:off + n] = px
        pos[off:off + n] = pp
        # One full-attention segment per frame (HF's cu_seqlens); t == 1 for images.
        img_seg[off:off + n] = seg + np.repeat(np.arange(t), h * w)
        seg += t
        spans.append((off // m2, n // m2, inv))
        off += n
    if not cfg.windowed:
        win_seg = img_seg
    return PackedImages(patches, pos, img_seg, win_seg, spans, total)


def unpack_features(packed: PackedImages, feats: np.ndarray) -> list[np.ndarray]:
    """Merged tokens [n_pad / m2, hidden] -> one [tokens, hidden] array per image, natural order."""
    out = []
    for start, n, inv in packed.spans:
        f = feats[start:start + n]
        out.append(np.ascontiguousarray(f if inv is None else f[inv]))
    return out


def patch_ladder(top: int, *, lo: int = 256, ratio: float = 1.25, multiple: int = 64,
                 extra: tuple[int, ...] = ()) -> tuple[int, ...]:
    """Packed-patch buckets: `lo`, then x`ratio` steps rounded up to `multiple`, ending at `top`
    (rounded up to `multiple`), plus `extra` rungs (the family adds the largest default-resized
    image, because photos resized to max_pixels sit just below it, and the token cap).
    Padding waste per call < 1 - 1/ratio above `lo` patches (benchmarks/qwen_buckets.py)."""
    top = -(-top // multiple) * multiple
    out, x = [], lo
    while x < top:
        out.append(x)
        x = -(-int(math.ceil(x * ratio)) // multiple) * multiple
    out.append(top)
    return tuple(sorted(set(out) | {int(e) for e in extra if 0 < e <= top}))
