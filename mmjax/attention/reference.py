"""Plain jnp attention: the oracle every other implementation is tested against.

Materializes the full [B, H, Sq, Sk] score matrix, so memory is O(N^2): use it for short
sequences and as ground truth. Softmax runs in float32 (float64 when the inputs are float64).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from mmjax.attention.common import (
    SegmentIds, Window, check_lengths, check_shapes, default_scale, normalize_window,
    split_segment_ids, visible,
)


def reference_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, causal: bool = False,
                        segment_ids: SegmentIds = None, lengths: jax.Array | None = None,
                        window: Window = None, scale: float | None = None) -> jax.Array:
    """q [B, Sq, H, D], k/v [B, Sk, Hkv, D] -> [B, Sq, H, D] in q.dtype (semantics: common.py)."""
    b, sq, h, d, sk, hkv = check_shapes(q, k, v)
    g = h // hkv
    scale = default_scale(d, scale)
    q_seg, kv_seg = split_segment_ids(segment_ids, b, sq, sk)
    lengths = check_lengths(lengths, b)
    acc = jnp.promote_types(q.dtype, jnp.float32)
    hi = jax.lax.Precision.HIGHEST

    # GQA without repeating k/v: query head h uses kv head h // g (HF repeat_kv order).
    qg = q.reshape(b, sq, hkv, g, d).astype(acc)
    s = jnp.einsum("bqhgd,bkhd->bhgqk", qg, k.astype(acc), precision=hi) * scale

    mask = visible(
        jnp.arange(sq)[:, None], jnp.arange(sk)[None, :], offset=sk - sq, causal=causal,
        window=normalize_window(window),
        q_seg=None if q_seg is None else q_seg[:, :, None],
        kv_seg=None if kv_seg is None else kv_seg[:, None, :],
        kv_len=None if lengths is None else lengths[:, None, None])
    mask = jnp.broadcast_to(mask, (b, sq, sk))[:, None, None]  # [B, 1, 1, Sq, Sk]

    s = jnp.where(mask, s, -jnp.inf)
    m = jnp.max(s, axis=-1, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0.0)  # fully masked rows: exp(-inf - 0) = 0, no NaN
    p = jnp.exp(s - m)
    l = jnp.sum(p, axis=-1, keepdims=True)
    o = jnp.einsum("bhgqk,bkhd->bhgqd", p, v.astype(acc), precision=hi)
    o = o / jnp.where(l == 0.0, 1.0, l)
    return jnp.transpose(o, (0, 3, 1, 2, 4)).reshape(b, sq, h, d).astype(q.dtype)
