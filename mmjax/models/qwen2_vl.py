"""Qwen2-VL and Qwen2.5-VL (Qwen2VLForConditionalGeneration, Qwen2_5_VLForConditionalGeneration).

Vision: flattened (C, t, p, p) patches -> linear patch embed -> blocks with 2D rotary embeddings
over the (h, w) patch grid -> 2x2 patch merger (LayerNorm for Qwen2-VL, RMSNorm for Qwen2.5-VL)
-> LLM tokens. Qwen2-VL blocks: LayerNorm + quick_gelu MLP, full attention within each image.
Qwen2.5-VL blocks: RMSNorm + SwiGLU MLP, attention inside `window_size`-pixel windows except in
`fullatt_block_indexes`. Decoder: Qwen2 with M-RoPE (temporal/height/width position rows).

Packed encoding: any set of images (one request or several) becomes ONE padded sequence of
patches. Attention is block-diagonal through `mmjax.attention.attention(segment_ids=...)`: one
segment per image (per frame; t = 1 here), one per window in Qwen2.5-VL's windowed blocks, and
-1 for padding. Qwen2.5-VL's window reordering (HF's `window_index`) is applied on the host to
each image's patches before packing and undone on the host after the merger, exactly as HF does
in-graph. The padded length comes from a patch-count ladder (`patch_ladder`), so the number of
encode compilations is bounded.

Images never change shape inside a compiled step: the token count of an image is known from its
size before the vision tower runs (`Qwen2VLImagePolicy.num_tokens`), so over-budget requests
(`image_max_tokens`) are rejected in `prepare_image` with a ContextLengthError.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from mmjax.attention import attention
from mmjax.checkpoint import TensorSource, fused_linear, linear, norm
from mmjax.buckets import bucket_for
from mmjax.config import TextConfig
from mmjax.errors import CheckpointError, ContextLengthError, InvalidRequestError, UnsupportedModelError
from mmjax.models.decoder import load_decoder_params
from mmjax.models.layers import activation, dense, layer_norm, rms_norm

VISION_EPS = 1e-6  # HF hard-codes eps=1e-6 for every vision norm and the merger's ln_q
DEFAULT_MROPE_SECTION = (16, 24, 24)  # HF's default when the config has none


# ------------------------------------------------------------------------------------------------
# Configs
# ------------------------------------------------------------------------------------------------

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


@dataclass(frozen=True)
class QwenVLConfig:
    vision: QwenVisionConfig
    text: TextConfig
    image_token_id: int
    vision_start_token_id: int | None
    model_type: str

    @classmethod
    def from_hf(cls, cfg: dict) -> "QwenVLConfig":
        mt = cfg.get("model_type")
        if mt not in ("qwen2_vl", "qwen2_5_vl"):
            raise UnsupportedModelError(f"config.json: model_type={mt!r} is not Qwen2-VL", param="model_type")
        # v5 saves nest the decoder in text_config; the original hub configs keep it at top level.
        flat = {k: v for k, v in cfg.items() if k not in ("text_config", "vision_config")}
        text_src = {**flat, **(cfg.get("text_config") or {}), "model_type": f"{mt}_text"}
        tie = bool(cfg.get("tie_word_embeddings", False)) or bool(text_src.get("tie_word_embeddings", False))
        text_src["tie_word_embeddings"] = tie
        text = TextConfig.from_hf(text_src, "text_config", tie_default=tie)
        # Qwen2-VL attention: q/k/v always biased, head_dim = hidden // heads (config head_dim unused).
        section = text.rope.mrope_section or DEFAULT_MROPE_SECTION
        head_dim = text.hidden_size // text.num_heads
        if sum(section) != head_dim // 2:
            raise CheckpointError(f"config.json: rope_parameters.mrope_section={list(section)} must sum to "
                                  f"head_dim/2={head_dim // 2}", param="text_config.rope_parameters.mrope_section")
        text = dataclasses.replace(text, attention_bias=True, mlp_bias=False, head_dim=head_dim,
                                   rope=dataclasses.replace(text.rope, mrope_section=tuple(section)))
        vision = QwenVisionConfig.from_hf(cfg.get("vision_config") or {}, mt)
        if vision.out_hidden_size != text.hidden_size:
            raise CheckpointError(f"config.json: vision output size {vision.out_hidden_size} != text hidden size "
                                  f"{text.hidden_size}", param="vision_config.hidden_size")
        token = cfg.get("image_token_id", (cfg.get("text_config") or {}).get("image_token_id"))
        if token is None:
            raise CheckpointError("config.json: image_token_id is missing", param="image_token_id")
        return cls(vision=vision, text=text, image_token_id=int(token),
                   vision_start_token_id=cfg.get("vision_start_token_id"), model_type=mt)


# ------------------------------------------------------------------------------------------------
# Weights
# ------------------------------------------------------------------------------------------------

def normalize_name(name: str) -> str:
    """Every Qwen2-VL naming seen (v4 hub files: `model.layers.*`, `visual.*`; v5 in-memory names:
    `model.language_model.*`, `model.visual.*`) -> `model.*`, `visual.*`, `lm_head.weight`."""
    for old, new in (("model.language_model.", "model."), ("model.visual.", "visual."),
                     ("language_model.model.", "model."), ("language_model.lm_head.", "lm_head.")):
        if name.startswith(old):
            return new + name[len(old):]
    return name


def load_vision_params(src: TensorSource, cfg: QwenVisionConfig, prefix: str = "visual.") -> dict:
    w, i, out = cfg.hidden_size, cfg.intermediate_size, cfg.out_hidden_size
    rms = cfg.variant == "qwen2_5_vl"
    conv = src.take(f"{prefix}patch_embed.proj.weight",
                    (w, cfg.in_channels, cfg.temporal_patch_size, cfg.patch_size, cfg.patch_size))
    blocks = []
    for n in range(cfg.depth):
        bp = f"{prefix}blocks.{n}."
        blk = {"norm1": norm(src, bp + "norm1", w, bias=not rms), "norm2": norm(src, bp + "norm2", w, bias=not rms),
               "qkv": linear(src, bp + "attn.qkv", w, 3 * w, True), "proj": linear(src, bp + "attn.proj", w, w, True)}
        if rms:
            blk["gate_up"] = fused_linear(src, [bp + "mlp.gate_proj", bp + "mlp.up_proj"], w, [i, i], True)
            blk["down"] = linear(src, bp + "mlp.down_proj", i, w, True)
        else:
            blk["fc1"] = linear(src, bp + "mlp.fc1", w, i, True)
            blk["fc2"] = linear(src, bp + "mlp.fc2", i, w, True)
        blocks.append(blk)
    m = cfg.merge_size ** 2 * w
    return {
        # Conv3d with kernel == stride over a (C, t, p, p) patch is one matmul: [C*t*p*p, width].
        "patch_embed": np.ascontiguousarray(conv.reshape(w, -1).T),
        "blocks": blocks,
        "merger": {"ln_q": norm(src, f"{prefix}merger.ln_q", w, bias=not rms),
                   "fc1": linear(src, f"{prefix}merger.mlp.0", m, m, True),
                   "fc2": linear(src, f"{prefix}merger.mlp.2", m, out, True)},
    }


def load_params(src: TensorSource, cfg: QwenVLConfig) -> dict:
    params = {"vision": load_vision_params(src, cfg.vision),
              "text": load_decoder_params(src, cfg.text, "model.", "lm_head.weight")}
    src.check_all_used()
    return params


# ------------------------------------------------------------------------------------------------
# Vision tower (pure functions, traced inside the compiled encode step)
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
    return jnp.cos(emb), jnp.sin(emb)


def _rotate(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """x [N, heads, hd] rotated in float32 (HF's apply_rotary_pos_emb_vision), back to x.dtype."""
    xf = x.astype(jnp.float32)
    half = x.shape[-1] // 2
    rot = jnp.concatenate([-xf[..., half:], xf[..., :half]], axis=-1)
    return (xf * cos[:, None] + rot * sin[:, None]).astype(x.dtype)


def _norm(p: dict, x: jax.Array, cfg: QwenVisionConfig) -> jax.Array:
    if "bias" in p:
        return layer_norm(p, x, VISION_EPS)
    return rms_norm(p["scale"], x, VISION_EPS)


def vision_block(p: dict, x: jax.Array, cos: jax.Array, sin: jax.Array, segment_ids: jax.Array,
                 cfg: QwenVisionConfig, impl: str) -> jax.Array:
    """One pre-norm block over the packed sequence x [N, width]; segment_ids [N] (-1 = padding).

    Segment ids are non-decreasing along the packed sequence (images, and windows after the
    window reordering, are contiguous), so the blockwise kernels' segment block bounds visit
    only each query block's own image / window: packed attention costs sum(n_i^2), not N^2."""
    n, w = x.shape
    heads, hd = cfg.num_heads, cfg.head_dim
    h = _norm(p["norm1"], x, cfg)
    qkv = dense(p["qkv"], h).reshape(n, 3, heads, hd)
    q, k, v = _rotate(qkv[:, 0], cos, sin), _rotate(qkv[:, 1], cos, sin), qkv[:, 2]
    attn = attention(q[None], k[None], v[None], segment_ids=segment_ids[None], impl=impl)
    x = x + dense(p["proj"], attn.reshape(n, w))
    h = _norm(p["norm2"], x, cfg)
    act = activation(cfg.hidden_act)
    if "gate_up" in p:
        gu = dense(p["gate_up"], h)
        h = act(gu[:, :cfg.intermediate_size]) * gu[:, cfg.intermediate_size:]
        return x + dense(p["down"], h)
    return x + dense(p["fc2"], act(dense(p["fc1"], h)))


def vision_forward(params: dict, cfg: QwenVisionConfig, patches: jax.Array, pos_hw: jax.Array,
                   image_seg: jax.Array, window_seg: jax.Array, *, impl: str = "auto",
                   out_dtype=None) -> jax.Array:
    """Packed patches [N, C*t*p*p] (N a multiple of merge_size**2, every image's patches in HF's
    order — window order for Qwen2.5-VL), pos_hw [N, 2], image_seg / window_seg [N] int32 (-1 =
    padding) -> merged tokens [N / merge_size**2, out_hidden] in the same order."""
    x = patches.astype(params["patch_embed"].dtype) @ params["patch_embed"]
    cos, sin = vision_rope(cfg, pos_hw)
    for i, blk in enumerate(params["blocks"]):
        x = vision_block(blk, x, cos, sin, window_seg if cfg.block_is_windowed(i) else image_seg, cfg, impl)
    mp = params["merger"]
    x = _norm(mp["ln_q"], x, cfg).reshape(-1, cfg.merge_size ** 2 * cfg.hidden_size)
    x = dense(mp["fc2"], jax.nn.gelu(dense(mp["fc1"], x), approximate=False))
    return x if out_dtype is None else x.astype(out_dtype)


def make_encode_fn(cfg: QwenVisionConfig, impl: str = "auto"):
    """A fresh jittable (params, packed) -> merged tokens, e.g. to compare attention impls with
    `jax.jit(fn).lower(...).compile().memory_analysis()`."""
    def encode_fn(params: dict, packed: tuple) -> jax.Array:
        patches, pos_hw, image_seg, window_seg = packed
        return vision_forward(params["vision"], cfg, patches, pos_hw, image_seg, window_seg, impl=impl,
                              out_dtype=params["text"]["embed"].dtype)
    return encode_fn


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
    """ImageInputs (pixels = patches [t*h*w, patch_dim] in HF order, grid_thw) -> PackedImages."""
    m2 = cfg.merge_size ** 2
    total = sum(int(np.prod(im.grid_thw)) for im in images)
    n_pad = total if n_pad is None else n_pad
    if n_pad < total or n_pad % m2:
        raise ValueError(f"bad packed length {n_pad} for {total} patches")
    patches = np.zeros((n_pad, cfg.patch_dim), np.float32)
    pos = np.zeros((n_pad, 2), np.int32)
    img_seg = np.full((n_pad,), -1, np.int32)
    win_seg = np.full((n_pad,), -1, np.int32)
    spans, off, seg, win = [], 0, 0, 0
    for im in images:
        t, h, w = (int(x) for x in im.grid_thw)
        n = t * h * w
        px = np.asarray(im.pixels, np.float32)
        if px.shape != (n, cfg.patch_dim):
            raise InvalidRequestError(f"image patches {px.shape} do not match grid {im.grid_thw} "
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


# ------------------------------------------------------------------------------------------------
# Family
# ------------------------------------------------------------------------------------------------

@dataclass
class QwenLimits:
    """Server-wide image controls. Per-request options (prepare_image) may move the pixel bounds
    and lower the token budget; every image is checked against the effective budget before any
    resize or encode.

    min_pixels / max_pixels: default smart_resize bounds (None: the checkpoint's preprocessor
        config, HF's 56*56 .. 28*28*1280 = 1280 tokens).
    image_max_tokens: hard cap on the LLM tokens of one image (like llama.cpp --image-max-tokens);
        None: max(max_encode_patches / merge**2, max_pixels / (patch*merge)**2), i.e. 4096 tokens
        (3.2 Mpixel) with the defaults, so per-request max_pixels up to that size work and larger
        ones (native 4K is 10549 tokens) need the operator to raise it.
    max_encode_patches: patches packed into one encode call (images are never split; the top
        bucket also covers one image at the token cap).
    """
    min_pixels: int | None = None
    max_pixels: int | None = None
    image_max_tokens: int | None = None
    max_encode_patches: int = 16384


@dataclass(eq=False)
class QwenVLFamily:
    """Host-side description of a loaded Qwen2-VL / Qwen2.5-VL model."""
    cfg: QwenVLConfig
    policy: Any  # vision_io.Qwen2VLImagePolicy
    limits: QwenLimits = field(default_factory=QwenLimits)
    attn_impl: str = "auto"

    @property
    def name(self) -> str:
        return self.cfg.model_type

    @property
    def text(self) -> TextConfig:
        return self.cfg.text

    @property
    def image_token_id(self) -> int:
        return self.cfg.image_token_id

    # ---- limits ----------------------------------------------------------------------------
    def configure(self, *, min_pixels: int | None = None, max_pixels: int | None = None,
                  image_max_tokens: int | None = None, max_encode_patches: int | None = None) -> "QwenVLFamily":
        """Set server-wide image limits (before serving; changes the encode bucket ladder)."""
        lim = dataclasses.replace(self.limits, **{k: v for k, v in dict(
            min_pixels=min_pixels, max_pixels=max_pixels, image_max_tokens=image_max_tokens,
            max_encode_patches=max_encode_patches).items() if v is not None})
        for name in ("image_max_tokens", "max_encode_patches"):
            v = getattr(lim, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v <= 0):
                raise InvalidRequestError(f"{name} must be a positive integer, got {v!r}", param=name)
        self.policy._bounds(lim.min_pixels, lim.max_pixels)  # validates
        self.limits = lim
        return self

    def pixel_bounds(self, min_pixels: int | None = None, max_pixels: int | None = None) -> tuple[int, int]:
        lo = min_pixels if min_pixels is not None else self.limits.min_pixels
        hi = max_pixels if max_pixels is not None else self.limits.max_pixels
        return self.policy._bounds(lo, hi)

    @property
    def default_image_tokens(self) -> int:
        """Most tokens an image resized with the default bounds can take."""
        _, hi = self.pixel_bounds()
        return max(1, hi // self.policy.factor ** 2)

    @property
    def image_max_tokens(self) -> int:
        if self.limits.image_max_tokens is not None:
            return int(self.limits.image_max_tokens)
        return max(self.limits.max_encode_patches // self.cfg.vision.merge_size ** 2, self.default_image_tokens)

    @property
    def encode_ladder(self) -> tuple[int, ...]:
        """Patch buckets: x1.25 steps, plus one rung at the largest default-resized image (most
        real photos land just under it) and one at the token cap."""
        m2 = self.cfg.vision.merge_size ** 2
        cap = self.image_max_tokens * m2
        return patch_ladder(max(self.limits.max_encode_patches, cap), extra=(self.default_image_tokens * m2, cap))

    # ---- host-side hooks used by the engine ---------------------------------------------------
    def num_tokens(self, height: int, width: int, **opts) -> int:
        lo, hi = self.pixel_bounds(opts.get("min_pixels"), opts.get("max_pixels"))
        return self.policy.num_tokens(height, width, min_pixels=lo, max_pixels=hi)

    def prepare_image(self, img, *, min_pixels: int | None = None, max_pixels: int | None = None,
                      image_max_tokens: int | None = None, **_) -> "ImageInput":
        """Decoded RGB PIL image -> patches + grid_thw + exact token count + encoder-cache key.

        The token count is computed from the image size before any resize or encoding; an image
        over the budget raises ContextLengthError(param="image_max_tokens")."""
        from mmjax.engine import ImageInput
        from mmjax.vision_io import pixel_hash

        lo, hi = self.pixel_bounds(min_pixels, max_pixels)
        budget = self.image_max_tokens
        if image_max_tokens is not None:
            if isinstance(image_max_tokens, bool) or not isinstance(image_max_tokens, (int, np.integer)) \
                    or image_max_tokens <= 0:
                raise InvalidRequestError(f"image_max_tokens must be a positive integer, got {image_max_tokens!r}",
                                          param="image_max_tokens")
            budget = min(budget, int(image_max_tokens))
        n = self.policy.num_tokens(img.height, img.width, min_pixels=lo, max_pixels=hi)
        if n > budget:
            rh, rw = self.policy.resized_size(img.height, img.width, min_pixels=lo, max_pixels=hi)
            raise ContextLengthError(
                f"image of {img.width}x{img.height} pixels is resized to {rw}x{rh} (max_pixels={hi}) and needs "
                f"{n} image tokens, over image_max_tokens={budget}; lower max_pixels or raise image_max_tokens",
                param="image_max_tokens")
        patches, grid = self.policy(img, min_pixels=lo, max_pixels=hi)
        key = f"{self.name}:{pixel_hash(img)}:{hash(self.policy.cache_key(min_pixels=lo, max_pixels=hi))}"
        return ImageInput(pixels=patches, num_tokens=n, key=key, grid_thw=tuple(int(g) for g in grid))

    def encode(self, params: dict, packed: tuple) -> jax.Array:
        """The compiled encode step: packed (patches, pos_hw, image_seg, window_seg) -> merged
        tokens [n_pad / merge**2, lm_hidden] (window order for Qwen2.5-VL)."""
        return make_encode_fn(self.cfg.vision, self.attn_impl)(params, packed)

    def encode_batch(self, runner, images: list) -> list[np.ndarray]:
        """Pack images (in order) into as few bucketed calls as the per-call patch budget allows;
        one compiled call per pack; split and un-window-order the result per image."""
        ladder = self.encode_ladder
        cap = self.limits.max_encode_patches
        groups, cur, n = [], [], 0
        for im in images:
            k = int(np.prod(im.grid_thw))
            if k > ladder[-1]:
                raise ContextLengthError(f"image with grid {im.grid_thw} has {k} patches, over the largest encode "
                                         f"bucket {ladder[-1]} (image_max_tokens={self.image_max_tokens})",
                                         param="image_max_tokens")
            if cur and n + k > cap:
                groups.append(cur)
                cur, n = [], 0
            cur.append(im)
            n += k
        if cur:
            groups.append(cur)
        out: list[np.ndarray] = []
        for group in groups:
            total = sum(int(np.prod(im.grid_thw)) for im in group)
            packed = pack_images(group, self.cfg.vision, bucket_for(total, ladder))
            feats = runner.encode_call((packed.n_pad,), packed.arrays())
            out.extend(unpack_features(packed, feats))
        return out

    def warmup_encode(self, runner) -> None:
        """Compile the encode step for every patch bucket."""
        for n in self.encode_ladder:
            runner.encode_call((n,), self.dummy_packed(n))

    def dummy_packed(self, n_pad: int) -> tuple:
        v = self.cfg.vision
        seg = np.zeros((n_pad,), np.int32)
        return (np.zeros((n_pad, v.patch_dim), np.float32), np.zeros((n_pad, 2), np.int32), seg, seg)

    def positions(self, ids: np.ndarray, images: list, image_starts: list[int]) -> tuple[np.ndarray, int]:
        """M-RoPE positions [3, prompt_len] and the decode offset (HF's get_rope_index).

        Text tokens advance all three rows together; an image at text position s takes
        (s, s + row, s + col) over its merged grid and text resumes at s + max(rows, cols).
        Decode positions are cache_index + rope_delta with rope_delta = max(position) + 1 - len.
        """
        m = self.cfg.vision.merge_size
        pos = np.zeros((3, len(ids)), np.int64)
        cur, prev = 0, 0
        for im, s in zip(images, image_starts):
            n_text = s - prev
            pos[:, prev:s] = cur + np.arange(n_text)
            cur += n_text
            t, h, w = (int(x) for x in im.grid_thw)
            lt, lh, lw = t, h // m, w // m
            tt, hh, ww = np.meshgrid(np.arange(lt), np.arange(lh), np.arange(lw), indexing="ij")
            n = lt * lh * lw
            pos[0, s:s + n] = cur + tt.ravel()
            pos[1, s:s + n] = cur + hh.ravel()
            pos[2, s:s + n] = cur + ww.ravel()
            cur += max(lh, lw)
            prev = s + n
        pos[:, prev:] = cur + np.arange(len(ids) - prev)
        delta = int(pos.max()) + 1 - len(ids) if len(ids) else 0
        return pos.astype(np.int32), delta


def load(path, hf_cfg: dict) -> tuple[QwenVLFamily, dict]:
    """config.json + safetensors + preprocessor config -> (family, numpy params)."""
    from mmjax.vision_io import Qwen2VLImagePolicy, find_image_processor_config, load_policy

    cfg = QwenVLConfig.from_hf(hf_cfg)
    params = load_params(TensorSource(path, normalize_name), cfg)
    policy = load_policy(find_image_processor_config(path))
    if not isinstance(policy, Qwen2VLImagePolicy):
        raise CheckpointError(f"{cfg.model_type} needs a Qwen2VLImageProcessor, the checkpoint has "
                              f"{type(policy).__name__}", param="image_processor_type")
    v = cfg.vision
    if (policy.patch_size, policy.merge_size, policy.temporal_patch_size) != (
            v.patch_size, v.merge_size, v.temporal_patch_size):
        raise CheckpointError("image processor patch_size/merge_size/temporal_patch_size "
                              f"{(policy.patch_size, policy.merge_size, policy.temporal_patch_size)} do not match "
                              f"config.json {(v.patch_size, v.merge_size, v.temporal_patch_size)}", param="patch_size")
    return QwenVLFamily(cfg, policy), params


def image_token(path, hf_cfg: dict) -> str:
    return "<|image_pad|>"
