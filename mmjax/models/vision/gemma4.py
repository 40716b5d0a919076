"""Gemma 4's vision tower (transformers Gemma4VisionModel) and its embedder into the text model
(Gemma4MultimodalEmbedder): pure functions of (params, arrays).

Per image: patches [n, 3*p*p] -> linear (pixels mapped to [-1, 1]) + learned 2-D position
embeddings (x table + y table) -> ViT blocks (RMSNorm sandwich, q/k RMSNorm, unscaled scores,
2-D axial RoPE: the first half of each head rotates with the patch column, the second half with
the row; v RMSNorm without scale; gated MLP) -> average pooling of k x k patch blocks (by
position) -> * sqrt(hidden) in float32 -> optional standardisation -> RMSNorm (no scale) ->
linear to the text width.

Images are batched with equal padded patch counts: `encode` takes patches [B, P, 3*p*p] and
positions [B, P, 2] (x, y; -1 rows are padding, always at the end) and returns [B, P / k**2,
text_hidden]; image b's soft tokens are its first n_b / k**2 rows. Padded patches are masked out
as keys (`lengths`) and their outputs dropped, as HF's padding to max_patches does.
"""
from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from mmjax.attention import attention
from mmjax.checkpoint import TensorSource
from mmjax.errors import UnsupportedModelError
from mmjax.models.hf_config import require
from mmjax.models.layers import activation, cos_sin, matmul


@dataclass(frozen=True)
class Gemma4VisionConfig:
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    patch_size: int
    pooling_kernel_size: int
    position_embedding_size: int
    rms_norm_eps: float
    rope_theta: float
    hidden_act: str
    use_clipped_linears: bool
    standardize: bool
    text_hidden_size: int

    @classmethod
    def from_hf(cls, cfg: dict, text_hidden: int, where: str = "vision_config") -> "Gemma4VisionConfig":
        rope = cfg.get("rope_parameters") or {}
        if rope.get("rope_type", "axial") != "axial":
            raise UnsupportedModelError(f"config.json: {where}.rope_parameters.rope_type="
                                        f"{rope.get('rope_type')!r} is not supported (axial)",
                                        param=f"{where}.rope_parameters.rope_type")
        if cfg.get("attention_bias"):
            raise UnsupportedModelError(f"config.json: {where}.attention_bias=true is not supported",
                                        param=f"{where}.attention_bias")
        heads = int(require(cfg, "num_attention_heads", where))
        hidden = int(require(cfg, "hidden_size", where))
        act = cfg.get("hidden_activation", "gelu_pytorch_tanh")
        activation(act)  # validates
        return cls(hidden_size=hidden, intermediate_size=int(require(cfg, "intermediate_size", where)),
                   num_layers=int(require(cfg, "num_hidden_layers", where)), num_heads=heads,
                   num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
                   head_dim=int(cfg.get("head_dim") or hidden // heads),
                   patch_size=int(cfg.get("patch_size", 16)),
                   pooling_kernel_size=int(cfg.get("pooling_kernel_size", 3)),
                   position_embedding_size=int(cfg.get("position_embedding_size", 10240)),
                   rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
                   rope_theta=float(rope.get("rope_theta", 100.0)), hidden_act=act,
                   use_clipped_linears=bool(cfg.get("use_clipped_linears", False)),
                   standardize=bool(cfg.get("standardize", False)), text_hidden_size=text_hidden)

    @property
    def patch_dim(self) -> int:
        return 3 * self.patch_size ** 2


# ------------------------------------------------------------------------------------------------
# weights
# ------------------------------------------------------------------------------------------------

def _clippable(src: TensorSource, name: str, d_in: int, d_out: int, clipped: bool) -> dict:
    """Gemma4ClippableLinear -> {"w": [in, out]} (+ "clip": [in_min, in_max, out_min, out_max])."""
    p = {"w": np.ascontiguousarray(src.take(f"{name}.linear.weight", (d_out, d_in)).T)}
    if clipped:
        p["clip"] = np.asarray([src.take(f"{name}.{b}", ()) for b in
                                ("input_min", "input_max", "output_min", "output_max")], np.float32)
    return p


def load_vision_params(src: TensorSource, cfg: Gemma4VisionConfig, prefix: str = "model.vision_tower.",
                       embed_prefix: str = "model.embed_vision.") -> dict:
    d, hd, c = cfg.hidden_size, cfg.head_dim, cfg.use_clipped_linears
    q_out, kv_out = cfg.num_heads * hd, cfg.num_kv_heads * hd
    layers = []
    for i in range(cfg.num_layers):
        lp = f"{prefix}encoder.layers.{i}."
        a, m = lp + "self_attn.", lp + "mlp."
        layers.append({
            "ln_in": src.take(lp + "input_layernorm.weight", (d,)),
            "ln_post_attn": src.take(lp + "post_attention_layernorm.weight", (d,)),
            "ln_pre_ffn": src.take(lp + "pre_feedforward_layernorm.weight", (d,)),
            "ln_post_ffn": src.take(lp + "post_feedforward_layernorm.weight", (d,)),
            "q": _clippable(src, a + "q_proj", d, q_out, c), "k": _clippable(src, a + "k_proj", d, kv_out, c),
            "v": _clippable(src, a + "v_proj", d, kv_out, c), "o": _clippable(src, a + "o_proj", q_out, d, c),
            "q_norm": src.take(a + "q_norm.weight", (hd,)), "k_norm": src.take(a + "k_norm.weight", (hd,)),
            "gate": _clippable(src, m + "gate_proj", d, cfg.intermediate_size, c),
            "up": _clippable(src, m + "up_proj", d, cfg.intermediate_size, c),
            "down": _clippable(src, m + "down_proj", cfg.intermediate_size, d, c),
        })
    params = {
        "patch": np.ascontiguousarray(src.take(prefix + "patch_embedder.input_proj.weight", (d, cfg.patch_dim)).T),
        "pos_table": src.take(prefix + "patch_embedder.position_embedding_table",
                              (2, cfg.position_embedding_size, d)),
        "layers": layers,
        "embed_proj": np.ascontiguousarray(
            src.take(embed_prefix + "embedding_projection.weight", (cfg.text_hidden_size, d)).T),
    }
    if cfg.standardize:
        params["std_bias"] = src.take(prefix + "std_bias", (d,))
        params["std_scale"] = src.take(prefix + "std_scale", (d,))
    return params


# ------------------------------------------------------------------------------------------------
# compute
# ------------------------------------------------------------------------------------------------

def gemma4_rms_norm(scale: jax.Array | None, x: jax.Array, eps: float) -> jax.Array:
    """Gemma4RMSNorm: x * (mean(x^2) + eps)^-0.5 [* scale], in float32, cast back (no `1 + scale`)."""
    xf = x.astype(jnp.float32)
    y = xf * jax.lax.rsqrt(jnp.square(xf).mean(-1, keepdims=True) + eps)
    if scale is not None:
        y = y * scale.astype(jnp.float32)
    return y.astype(x.dtype)


def _linear(p: dict, x: jax.Array) -> jax.Array:
    """Gemma4ClippableLinear: clamp input, matmul, clamp output (when the checkpoint clips)."""
    if "clip" in p:
        x = jnp.clip(x, p["clip"][0].astype(x.dtype), p["clip"][1].astype(x.dtype))
    y = matmul(x, p["w"])
    if "clip" in p:
        y = jnp.clip(y, p["clip"][2].astype(y.dtype), p["clip"][3].astype(y.dtype))
    return y


def axial_rope(pos: jax.Array, head_dim: int, theta: float) -> tuple[jax.Array, jax.Array]:
    """pos [B, P, 2] (x, y) -> cos, sin [B, P, head_dim]: [fx, fx, fy, fy] over head_dim/4 frequencies."""
    spatial = head_dim // 2
    inv = 1.0 / (theta ** (np.arange(0, spatial, 2, dtype=np.float32) / spatial))
    f = pos.astype(jnp.float32)[..., None] * jnp.asarray(inv, jnp.float32)       # [B, P, 2, hd/4]
    f = jnp.concatenate([f[:, :, 0], f[:, :, 0], f[:, :, 1], f[:, :, 1]], axis=-1)
    return cos_sin(f)


def _rotate(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """HF rotate-half RoPE applied separately to each half of the head (x part, then y part)."""
    half = x.shape[-1] // 2
    out = []
    for part, c, s in ((x[..., :half], cos[..., :half], sin[..., :half]),
                       (x[..., half:], cos[..., half:], sin[..., half:])):
        q = part.shape[-1] // 2
        rot = jnp.concatenate([-part[..., q:], part[..., :q]], axis=-1)
        out.append(part * c[:, :, None].astype(x.dtype) + rot * s[:, :, None].astype(x.dtype))
    return jnp.concatenate(out, axis=-1)


def _block(p: dict, cfg: Gemma4VisionConfig, x: jax.Array, rope, lengths: jax.Array, impl: str) -> jax.Array:
    b, n, _ = x.shape
    hd, eps = cfg.head_dim, cfg.rms_norm_eps
    act = activation(cfg.hidden_act)
    h = gemma4_rms_norm(p["ln_in"], x, eps)
    q = gemma4_rms_norm(p["q_norm"], _linear(p["q"], h).reshape(b, n, cfg.num_heads, hd), eps)
    k = gemma4_rms_norm(p["k_norm"], _linear(p["k"], h).reshape(b, n, cfg.num_kv_heads, hd), eps)
    v = gemma4_rms_norm(None, _linear(p["v"], h).reshape(b, n, cfg.num_kv_heads, hd), eps)
    q, k = _rotate(q, *rope), _rotate(k, *rope)
    a = attention(q, k, v, lengths=lengths, scale=1.0, impl=impl)
    x = x + gemma4_rms_norm(p["ln_post_attn"], _linear(p["o"], a.reshape(b, n, -1)), eps)
    h = gemma4_rms_norm(p["ln_pre_ffn"], x, eps)
    h = _linear(p["down"], act(_linear(p["gate"], h)) * _linear(p["up"], h))
    return x + gemma4_rms_norm(p["ln_post_ffn"], h, eps)


def pool_by_position(h: jax.Array, pos: jax.Array, k: int) -> jax.Array:
    """Average of each k x k block of patches, by patch position: h [B, P, d], pos [B, P, 2] ->
    [B, P / k**2, d] float32; output j of an image of width W patches is block (j % (W/k), j // (W/k)).
    Padding rows (position -1) must hold zeros."""
    b, n, _ = h.shape
    length = n // (k * k)
    cp = jnp.maximum(pos, 0)
    width = cp[..., 0].max(axis=-1, keepdims=True) + 1
    kidx = cp[..., 0] // k + (width // k) * (cp[..., 1] // k)                      # [B, P]
    w = jax.nn.one_hot(kidx, length, dtype=jnp.float32) / (k * k)                 # [B, P, L]
    return jnp.einsum("bpl,bpd->bld", w, h.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST)


def encode(params: dict, cfg: Gemma4VisionConfig, pixels: jax.Array, pos: jax.Array,
           impl: str = "auto") -> jax.Array:
    """pixels [B, P, 3*p*p] (in [0, 1]), pos [B, P, 2] int32 (-1: padding, at the end) ->
    soft tokens in the text model's space [B, P / k**2, text_hidden] (params' dtype)."""
    vp = params
    dtype = vp["patch"].dtype
    pad = jnp.all(pos == -1, axis=-1)                                             # [B, P]
    lengths = jnp.sum(~pad, axis=-1).astype(jnp.int32)
    x = matmul((2.0 * (pixels.astype(jnp.float32) - 0.5)).astype(dtype), vp["patch"])
    cp = jnp.maximum(pos, 0)
    pe = jnp.take(vp["pos_table"][0], cp[..., 0], axis=0) + jnp.take(vp["pos_table"][1], cp[..., 1], axis=0)
    x = x + jnp.where(pad[..., None], 0.0, pe).astype(dtype)
    rope = axial_rope(pos, cfg.head_dim, cfg.rope_theta)
    for layer in vp["layers"]:
        x = _block(layer, cfg, x, rope, lengths, impl)
    x = jnp.where(pad[..., None], 0.0, x)
    k = cfg.pooling_kernel_size
    pooled = pool_by_position(x, pos, k) if k > 1 else x.astype(jnp.float32)
    pooled = pooled.astype(dtype).astype(jnp.float32) * np.float32(cfg.hidden_size ** 0.5)
    if cfg.standardize:
        pooled = (pooled - vp["std_bias"].astype(jnp.float32)) * vp["std_scale"].astype(jnp.float32)
    pooled = pooled.astype(dtype)
    return matmul(gemma4_rms_norm(None, pooled, cfg.rms_norm_eps), vp["embed_proj"])
