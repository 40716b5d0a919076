"""Quantized KV cache: int8 / fp8 (e4m3) K and V with one scale per (token, KV head).

`kv_cache_dtype` names the cache's element type: "auto" (the model's dtype), "bfloat16",
"int8" or "fp8" (float8_e4m3fn). A quantized cache layer holds, next to its K / V segments,
"k_scale" / "v_scale" segments [slots, kv_heads, len] (the K / V layout without head_dim).

Why per (token, KV head), computed when the token is written: a scale per KV head alone (vLLM's
fp8 default) needs calibration data to set and clips outliers of tokens it never saw; int8 with
such a static scale loses the small keys of most tokens. One head's K (or V) vector of one token
is head_dim values (64-256): llama.cpp's q8_0 uses 32-value blocks, so this block is the same
idea at head granularity, and it costs 2 bytes (a bfloat16 scale) per head_dim bytes of data,
head_dim = 128: 130 bytes per token and head against 256 in bfloat16 (1.97x) and 512 in
float32 (3.9x). Symmetric: x ~= q * scale, scale = max|x| / QMAX, rounded to bfloat16 BEFORE
quantizing, so the stored scale is exactly the one the values were divided by.

Attention never dequantizes the cache: q K^T reads the int8 / fp8 segment (converted in the dot
operand, which XLA fuses on GPU) and the scores are multiplied by the key scales [.., len];
the softmax weights are multiplied by the value scales before P V (scale_scores / scale_probs).
On the CPU an int8 / fp8 cache's decode attention is mmjax.kernels.cpu_attention (the same
scales applied in registers)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from mmjax.errors import InvalidRequestError

KV_CACHE_DTYPES = ("auto", "bfloat16", "int8", "fp8")
SCALE_DTYPE = jnp.bfloat16
_QMAX = {np.dtype(jnp.int8): 127.0, np.dtype(jnp.float8_e4m3fn): 448.0}


def resolve(kv_cache_dtype: str | None, model_dtype) -> np.dtype:
    """The cache element dtype for a `kv_cache_dtype` name ("auto"/None: the model's dtype)."""
    if kv_cache_dtype in (None, "auto"):
        return np.dtype(model_dtype)
    names = {"bfloat16": jnp.bfloat16, "int8": jnp.int8, "fp8": jnp.float8_e4m3fn}
    if kv_cache_dtype not in names:
        raise InvalidRequestError(f"kv_cache_dtype must be one of {list(KV_CACHE_DTYPES)}, got {kv_cache_dtype!r}",
                                  param="kv_cache_dtype")
    return np.dtype(names[kv_cache_dtype])


def dtype_name(dtype) -> str:
    """The `kv_cache_dtype` name of a cache element dtype ("float32", "bfloat16", "int8", "fp8")."""
    return "fp8" if np.dtype(dtype) == np.dtype(jnp.float8_e4m3fn) else np.dtype(dtype).name


def is_quantized(dtype) -> bool:
    """Does a cache of this element dtype carry scales?"""
    return np.dtype(dtype) in _QMAX


def quantize(x: jax.Array, dtype) -> tuple[jax.Array, jax.Array]:
    """x [..., head_dim] -> (q [..., head_dim] in `dtype`, scale [...] SCALE_DTYPE) with
    x ~= q * scale per vector (symmetric; an all-zero vector gets scale 0 and q 0)."""
    qmax = _QMAX[np.dtype(dtype)]
    xf = x.astype(jnp.float32)
    scale = (jnp.abs(xf).max(axis=-1) / qmax).astype(SCALE_DTYPE)
    s = scale.astype(jnp.float32)
    y = xf / jnp.where(s > 0, s, 1.0)[..., None]
    # a scale rounded down to bfloat16 can push |y| a hair past qmax: clip (fp8 would go to NaN)
    y = jnp.clip(y, -qmax, qmax)
    q = jnp.round(y).astype(dtype) if jnp.issubdtype(dtype, jnp.integer) else y.astype(dtype)
    return q, scale


def dequantize(q: jax.Array, scale: jax.Array, axis: int, dtype) -> jax.Array:
    """q with scale broadcast over `axis` (head_dim's axis) -> dtype. Only for the paths that
    materialise the whole cache anyway (captured / research attention, softcapped full layers)."""
    return (q.astype(jnp.float32) * jnp.expand_dims(scale.astype(jnp.float32), axis)).astype(dtype)


def operand(x: jax.Array, dtype) -> jax.Array:
    """A cache segment as a dot operand: quantized ones converted (exactly) to the compute dtype
    (XLA fuses the convert into the dot's operand on GPU); others unchanged."""
    return x.astype(dtype) if is_quantized(x.dtype) else x


def layer_scales(kv: dict) -> tuple[list, list] | None:
    """(K scale segments, V scale segments) of one cache layer dict, None when not quantized."""
    return (kv["k_scale"], kv["v_scale"]) if "k_scale" in kv else None


def zero_scales(data_shapes: list[tuple], num_slots: int, kv_heads: int) -> list:
    """Scale segments [slots, kv_heads, len] for V segments of shapes (len, head_dim)."""
    return [jnp.zeros((num_slots, kv_heads, shape[0]), SCALE_DTYPE) for shape in data_shapes]


def bytes_per_token(num_kv_heads: int, head_dim: int, dtype) -> int:
    """Cache bytes one token takes in one layer (K and V, scales included)."""
    dtype = np.dtype(dtype)
    per_head = head_dim * dtype.itemsize + (np.dtype(SCALE_DTYPE).itemsize if is_quantized(dtype) else 0)
    return 2 * num_kv_heads * per_head
