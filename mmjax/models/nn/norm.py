"""Normalization layers (parameter `scale`, Flax's name for HF's `weight`)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from mmjax.models.nn.linear import param


class RMSNorm(nnx.Module):
    """RMSNorm over the last axis, normalised in float32. `kind` is where the scale applies:
    "llama" (cast back, then multiply by `scale`: HF's Llama order), "gemma" ((1 + scale) in
    float32, then cast back), "float32" (scale in float32, then cast back: Gemma 4).
    `with_scale=False`: no parameter (Gemma 4's value norm)."""

    def __init__(self, dim: int, eps: float, *, kind: str = "llama", with_scale: bool = True, dtype=jnp.float32):
        if kind not in ("llama", "gemma", "float32"):
            raise ValueError(f"unknown RMSNorm kind {kind!r}")
        self.dim, self.eps, self.kind = dim, eps, kind
        self.scale = param((dim,), dtype, (None,)) if with_scale else None

    def __call__(self, x: jax.Array) -> jax.Array:
        xf = x.astype(jnp.float32)
        y = xf * jax.lax.rsqrt(jnp.square(xf).mean(-1, keepdims=True) + self.eps)
        if self.scale is None:
            return y.astype(x.dtype)
        w = self.scale.get_value()
        if self.kind == "llama":
            return w * y.astype(x.dtype)
        w = w.astype(jnp.float32)
        return (y * (1.0 + w if self.kind == "gemma" else w)).astype(x.dtype)

    def hf_weights(self, w, name: str) -> None:
        if self.scale is not None:
            w.set(self.scale, w.take(f"{name}.weight", (self.dim,)))


class LayerNorm(nnx.Module):
    """LayerNorm computed in float32 (as torch does for f32 and autocast bf16)."""

    def __init__(self, dim: int, eps: float, *, bias: bool = True, dtype=jnp.float32):
        self.dim, self.eps = dim, eps
        self.scale = param((dim,), dtype, (None,))
        self.bias = param((dim,), dtype, (None,)) if bias else None

    def __call__(self, x: jax.Array) -> jax.Array:
        xf = x.astype(jnp.float32)
        mean = xf.mean(-1, keepdims=True)
        var = jnp.square(xf - mean).mean(-1, keepdims=True)
        y = (xf - mean) * jax.lax.rsqrt(var + self.eps) * self.scale.get_value().astype(jnp.float32)
        if self.bias is not None:
            y = y + self.bias.get_value().astype(jnp.float32)
        return y.astype(x.dtype)

    def hf_weights(self, w, name: str) -> None:
        w.set(self.scale, w.take(f"{name}.weight", (self.dim,)))
        if self.bias is not None:
            w.set(self.bias, w.take(f"{name}.bias", (self.dim,)))
