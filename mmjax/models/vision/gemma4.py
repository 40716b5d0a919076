"""Gemma 4's vision tower (transformers Gemma4VisionModel) and its embedder into the text model
(Gemma4MultimodalEmbedder), as nnx modules.

Per image: patches [n, 3*p*p] -> `patch_embedder` (input_proj over pixels mapped to [-1, 1], plus
the learned 2-D position table: x row + y row) -> `encoder.layers` (RMSNorm sandwich, q/k
RMSNorm, unscaled scores, 2-D axial RoPE: the first half of each head rotates with the patch
column, the second half with the row; v RMSNorm without scale; gated MLP; every linear a
Gemma4ClippableLinear) -> average pooling of k x k patch blocks (by position) -> * sqrt(hidden) in
float32 -> optional standardisation (`std_bias`, `std_scale`) -> `embed_vision`: RMSNorm (no scale)
-> linear to the text width.

Images are batched with equal padded patch counts: the tower takes patches [B, P, 3*p*p] and
positions [B, P, 2] (x, y; -1 rows are padding, always at the end) and returns [B, P / k**2,
hidden]; image b's soft tokens are its first n_b / k**2 rows. Padded patches are masked out as
keys (`lengths`) and their outputs dropped, as HF's padding to max_patches does.
"""
from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from mmjax.attention import attention
from mmjax.errors import UnsupportedModelError
from mmjax.models.hf_config import require
from mmjax.models.nn.linear import Linear, activation, param
from mmjax.models.nn.norm import RMSNorm
from mmjax.models.nn.rope import cos_sin
from mmjax.models.nn.weights import load_children


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
# modules
# ------------------------------------------------------------------------------------------------

class Gemma4ClippableLinear(nnx.Module):
    """`linear` (no bias); with clipping (use_clipped_linears) the input is clamped to
    [input_min, input_max] and the output to [output_min, output_max] (scalars from the file)."""

    BOUNDS = ("input_min", "input_max", "output_min", "output_max")

    def __init__(self, d_in: int, d_out: int, *, clipped: bool, axes: tuple, dtype=jnp.float32):
        self.clipped = clipped
        self.linear = Linear(d_in, d_out, dtype=dtype, axes=axes)
        for b in self.BOUNDS:
            setattr(self, b, param((), dtype, ()) if clipped else None)

    def __call__(self, x: jax.Array) -> jax.Array:
        if self.clipped:
            x = jnp.clip(x, self.input_min.get_value().astype(x.dtype), self.input_max.get_value().astype(x.dtype))
        y = self.linear(x)
        if self.clipped:
            y = jnp.clip(y, self.output_min.get_value().astype(y.dtype), self.output_max.get_value().astype(y.dtype))
        return y

    def hf_weights(self, w, name: str) -> None:
        self.linear.hf_weights(w, f"{name}.linear")
        if self.clipped:
            for b in self.BOUNDS:
                w.set(getattr(self, b), w.take(f"{name}.{b}", ()))


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


class Gemma4VisionAttention(nnx.Module):
    """q_proj / k_proj / v_proj / o_proj (clippable), q_norm / k_norm (with weight), v_norm (no
    weight); full attention over the image's patches, scores unscaled, axial RoPE."""

    def __init__(self, cfg: Gemma4VisionConfig, dtype=jnp.float32):
        d, hd, c, eps = cfg.hidden_size, cfg.head_dim, cfg.use_clipped_linears, cfg.rms_norm_eps
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, hd
        q_out, kv_out = cfg.num_heads * hd, cfg.num_kv_heads * hd
        self.q_proj = Gemma4ClippableLinear(d, q_out, clipped=c, axes=("embed", "vision_heads"), dtype=dtype)
        self.k_proj = Gemma4ClippableLinear(d, kv_out, clipped=c, axes=("embed", "vision_heads"), dtype=dtype)
        self.v_proj = Gemma4ClippableLinear(d, kv_out, clipped=c, axes=("embed", "vision_heads"), dtype=dtype)
        self.o_proj = Gemma4ClippableLinear(q_out, d, clipped=c, axes=("vision_heads", "embed"), dtype=dtype)
        self.q_norm = RMSNorm(hd, eps, kind="float32", dtype=dtype)
        self.k_norm = RMSNorm(hd, eps, kind="float32", dtype=dtype)
        self.v_norm = RMSNorm(hd, eps, kind="float32", with_scale=False, dtype=dtype)

    def __call__(self, x: jax.Array, rope, lengths: jax.Array, impl: str = "auto") -> jax.Array:
        b, n, _ = x.shape
        hd = self.head_dim
        q = self.q_norm(self.q_proj(x).reshape(b, n, self.num_heads, hd))
        k = self.k_norm(self.k_proj(x).reshape(b, n, self.num_kv_heads, hd))
        v = self.v_norm(self.v_proj(x).reshape(b, n, self.num_kv_heads, hd))
        q, k = _rotate(q, *rope), _rotate(k, *rope)
        a = attention(q, k, v, lengths=lengths, scale=1.0, impl=impl)
        return self.o_proj(a.reshape(b, n, -1))


class Gemma4VisionMLP(nnx.Module):
    """down_proj(act(gate_proj(x)) * up_proj(x)), each clippable."""

    def __init__(self, cfg: Gemma4VisionConfig, dtype=jnp.float32):
        d, f, c = cfg.hidden_size, cfg.intermediate_size, cfg.use_clipped_linears
        self.act = cfg.hidden_act
        self.gate_proj = Gemma4ClippableLinear(d, f, clipped=c, axes=("embed", "vision_mlp"), dtype=dtype)
        self.up_proj = Gemma4ClippableLinear(d, f, clipped=c, axes=("embed", "vision_mlp"), dtype=dtype)
        self.down_proj = Gemma4ClippableLinear(f, d, clipped=c, axes=("vision_mlp", "embed"), dtype=dtype)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down_proj(activation(self.act)(self.gate_proj(x)) * self.up_proj(x))


class Gemma4VisionEncoderLayer(nnx.Module):
    """input_layernorm, self_attn, post_attention_layernorm, pre_feedforward_layernorm, mlp,
    post_feedforward_layernorm (Gemma 4's sandwich)."""

    def __init__(self, cfg: Gemma4VisionConfig, dtype=jnp.float32):
        d, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.input_layernorm = RMSNorm(d, eps, kind="float32", dtype=dtype)
        self.self_attn = Gemma4VisionAttention(cfg, dtype)
        self.post_attention_layernorm = RMSNorm(d, eps, kind="float32", dtype=dtype)
        self.pre_feedforward_layernorm = RMSNorm(d, eps, kind="float32", dtype=dtype)
        self.mlp = Gemma4VisionMLP(cfg, dtype)
        self.post_feedforward_layernorm = RMSNorm(d, eps, kind="float32", dtype=dtype)

    def __call__(self, x: jax.Array, rope, lengths: jax.Array, impl: str = "auto") -> jax.Array:
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), rope, lengths, impl))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class Gemma4VisionPatchEmbedder(nnx.Module):
    """input_proj (a [3*p*p, d] matmul over patches, no bias) and position_embedding_table
    [2, positions, d] (x row, y row)."""

    def __init__(self, cfg: Gemma4VisionConfig, dtype=jnp.float32):
        self.cfg = cfg
        self.input_proj = Linear(cfg.patch_dim, cfg.hidden_size, dtype=dtype, quantize=False)
        self.position_embedding_table = param((2, cfg.position_embedding_size, cfg.hidden_size), dtype,
                                              (None, None, None))

    def __call__(self, pixels: jax.Array, pos: jax.Array, pad: jax.Array) -> jax.Array:
        """pixels [B, P, 3*p*p] in [0, 1], pos [B, P, 2], pad [B, P] -> [B, P, d]."""
        table = self.position_embedding_table.get_value()
        dtype = table.dtype
        x = self.input_proj((2.0 * (pixels.astype(jnp.float32) - 0.5)).astype(dtype))
        cp = jnp.maximum(pos, 0)
        pe = jnp.take(table[0], cp[..., 0], axis=0) + jnp.take(table[1], cp[..., 1], axis=0)
        return x + jnp.where(pad[..., None], 0.0, pe).astype(dtype)

    def hf_weights(self, w, name: str) -> None:
        self.input_proj.hf_weights(w, f"{name}.input_proj")
        c = self.cfg
        w.set(self.position_embedding_table, w.take(f"{name}.position_embedding_table",
                                                    (2, c.position_embedding_size, c.hidden_size)))


class Gemma4VisionEncoder(nnx.Module):
    def __init__(self, cfg: Gemma4VisionConfig, dtype=jnp.float32):
        self.layers = nnx.List([Gemma4VisionEncoderLayer(cfg, dtype) for _ in range(cfg.num_layers)])


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


class Gemma4VisionModel(nnx.Module):
    """Gemma4VisionModel: patch_embedder, encoder.layers, the pooler (no weights) and, with
    `standardize`, std_bias / std_scale."""

    def __init__(self, cfg: Gemma4VisionConfig, dtype=jnp.float32):
        self.config = cfg
        self.patch_embedder = Gemma4VisionPatchEmbedder(cfg, dtype)
        self.encoder = Gemma4VisionEncoder(cfg, dtype)
        if cfg.standardize:
            self.std_bias = param((cfg.hidden_size,), dtype, (None,))
            self.std_scale = param((cfg.hidden_size,), dtype, (None,))
        else:
            self.std_bias = self.std_scale = None

    def __call__(self, pixels: jax.Array, pos: jax.Array, impl: str = "auto") -> jax.Array:
        """pixels [B, P, 3*p*p] (in [0, 1]), pos [B, P, 2] int32 (-1: padding, at the end) ->
        pooled soft tokens [B, P / k**2, hidden] (the weights' dtype)."""
        cfg = self.config
        pad = jnp.all(pos == -1, axis=-1)                                             # [B, P]
        lengths = jnp.sum(~pad, axis=-1).astype(jnp.int32)
        x = self.patch_embedder(pixels, pos, pad)
        dtype = x.dtype
        rope = axial_rope(pos, cfg.head_dim, cfg.rope_theta)
        for layer in self.encoder.layers:
            x = layer(x, rope, lengths, impl)
        x = jnp.where(pad[..., None], 0.0, x)
        k = cfg.pooling_kernel_size
        pooled = pool_by_position(x, pos, k) if k > 1 else x.astype(jnp.float32)
        pooled = pooled.astype(dtype).astype(jnp.float32) * np.float32(cfg.hidden_size ** 0.5)
        if cfg.standardize:
            pooled = ((pooled - self.std_bias.get_value().astype(jnp.float32))
                      * self.std_scale.get_value().astype(jnp.float32))
        return pooled.astype(dtype)

    def hf_weights(self, w, name: str) -> None:
        load_children(self, w, name)
        if self.config.standardize:
            d = self.config.hidden_size
            w.set(self.std_bias, w.take(f"{name}.std_bias", (d,)))
            w.set(self.std_scale, w.take(f"{name}.std_scale", (d,)))


class Gemma4MultimodalEmbedder(nnx.Module):
    """embed_vision: embedding_pre_projection_norm (RMSNorm without weight), embedding_projection
    (vision hidden -> text hidden, no bias)."""

    def __init__(self, d_vision: int, d_text: int, eps: float, dtype=jnp.float32):
        self.embedding_pre_projection_norm = RMSNorm(d_vision, eps, kind="float32", with_scale=False, dtype=dtype)
        self.embedding_projection = Linear(d_vision, d_text, dtype=dtype, axes=(None, "embed"))

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.embedding_projection(self.embedding_pre_projection_norm(x))
