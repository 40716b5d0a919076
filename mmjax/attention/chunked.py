"""Blockwise attention in plain XLA: online softmax over key blocks, query blocks in a loop.

Temporary memory is O(B * H * block_q * block_k) for the scores of one tile plus O(N) for the
operands and output, never the O(N^2) score matrix of the reference. This is the default on
CPU for long sequences (a 42k-patch image would need ~114 GB of scores with the reference).

Structure: an outer `fori_loop` over query blocks writes each block into a head-major output
buffer in place; an inner `fori_loop` walks only the key blocks that causal/window masking can
reach (dynamic bounds, so a causal pass does about half the work), carrying the running max m,
normalizer l and un-normalized output acc in float32.

Ragged lengths need no padding copies: the last query/key block is clamped to end at the
sequence end (so it overlaps the previous block). Overlapping query rows are recomputed with
identical results and rewritten; overlapping keys are masked out (`k_idx >= nominal start`)
so no key is counted twice.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from mmjax.attention.common import (
    SegmentIds, Window, check_lengths, check_shapes, default_scale, key_block_range,
    normalize_window, segment_block_bounds, split_segment_ids, visible,
)

# On the 2-core CPU (N=4096, H=16, D=80) tiles from 256x512 to 2048x128 all ran within the
# machine's noise (0.65-1.2 s); 512 x 256 keeps one f32 score tile at 8 MB for 16 heads.
DEFAULT_BLOCK_Q = 512
DEFAULT_BLOCK_K = 256


def chunked_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, causal: bool = False,
                      segment_ids: SegmentIds = None, lengths: jax.Array | None = None,
                      window: Window = None, scale: float | None = None,
                      block_q: int = DEFAULT_BLOCK_Q, block_k: int = DEFAULT_BLOCK_K) -> jax.Array:
    """q [B, Sq, H, D], k/v [B, Sk, Hkv, D] -> [B, Sq, H, D] in q.dtype (semantics: common.py)."""
    b, sq, h, d, sk, hkv = check_shapes(q, k, v)
    g = h // hkv
    scale = default_scale(d, scale)
    window = normalize_window(window)
    q_seg, kv_seg = split_segment_ids(segment_ids, b, sq, sk)
    lengths = check_lengths(lengths, b)
    offset = sk - sq

    block_q = min(block_q, sq)
    block_k = min(block_k, sk)
    nq = -(-sq // block_q)
    nk = -(-sk // block_k)
    ragged_k = sk % block_k != 0  # last key block overlaps its predecessor

    kv_len = None if lengths is None else lengths[:, None, None]
    # With no masking at all the where/guard passes over every score tile are skipped.
    needs_mask = (causal or window is not None or q_seg is not None or kv_len is not None
                  or ragged_k)
    acc_t = jnp.promote_types(q.dtype, jnp.float32)
    prec = jax.lax.Precision.HIGHEST if acc_t == q.dtype else None
    if acc_t == q.dtype:
        q, scale = q * jnp.asarray(scale, q.dtype), 1.0  # fold the scale in once, O(N)

    # Head-major layout once, outside the loops (O(N) copies), so every tile product is a
    # plain batched matmul; the G query heads sharing a kv head form one [G*bq, D] operand.
    qh = jnp.transpose(q, (0, 2, 1, 3)).reshape(b, hkv, g, sq, d)   # [B, Hkv, G, Sq, D]
    kh = jnp.transpose(k, (0, 2, 1, 3))                              # [B, Hkv, Sk, D]
    vh = jnp.transpose(v, (0, 2, 1, 3))

    q_starts = jnp.minimum(jnp.arange(nq, dtype=jnp.int32) * block_q, sq - block_q)
    seg_lo = seg_hi = None
    if q_seg is not None:  # packed images: per query block, the key blocks ids can match
        rows = q_starts[:, None] + jnp.arange(block_q, dtype=jnp.int32)
        kv_blocks = jnp.pad(kv_seg, ((0, 0), (0, nk * block_k - sk)), constant_values=-1)
        seg_lo, seg_hi = segment_block_bounds(q_seg[:, rows], kv_blocks.reshape(b, nk, block_k))
        seg_lo, seg_hi = jnp.min(seg_lo, axis=0), jnp.max(seg_hi, axis=0)  # one loop per batch
    if lengths is not None:  # keys past the longest row are never visible
        len_hi = jnp.minimum(-(-jnp.max(lengths) // block_k), nk).astype(jnp.int32)
        seg_hi = len_hi if seg_hi is None else jnp.minimum(seg_hi, len_hi)

    def query_block(i, out):
        q_start = q_starts[i]  # clamped: the last block ends at sq
        q_blk = jax.lax.dynamic_slice_in_dim(qh, q_start, block_q, axis=3)
        q_idx = q_start + jnp.arange(block_q, dtype=jnp.int32)
        qs_blk = (None if q_seg is None else
                  jax.lax.dynamic_slice_in_dim(q_seg, q_start, block_q, axis=1)[:, :, None])
        lo, hi = key_block_range(q_start, block_q, block_k, nk, offset, causal, window)
        if seg_lo is not None:
            lo = jnp.maximum(lo, seg_lo[i])
        if seg_hi is not None:
            hi = jnp.maximum(lo, jnp.minimum(hi, seg_hi if seg_hi.ndim == 0 else seg_hi[i]))

        def key_block(j, carry):
            m, l, acc = carry
            k_nominal = j * block_k
            k_start = jnp.minimum(k_nominal, sk - block_k)
            k_blk = jax.lax.dynamic_slice_in_dim(kh, k_start, block_k, axis=2)
            v_blk = jax.lax.dynamic_slice_in_dim(vh, k_start, block_k, axis=2)
            s = jnp.einsum("bhgqd,bhkd->bhgqk", q_blk, k_blk, precision=prec,
                           preferred_element_type=acc_t)
            if scale != 1.0:
                s = s * scale
            if needs_mask:
                k_idx = k_start + jnp.arange(block_k, dtype=jnp.int32)
                mask = visible(
                    q_idx[:, None], k_idx[None, :], offset=offset, causal=causal, window=window,
                    q_seg=qs_blk,
                    kv_seg=None if kv_seg is None else
                    jax.lax.dynamic_slice_in_dim(kv_seg, k_start, block_k, axis=1)[:, None, :],
                    kv_len=kv_len)                         # [bq, bk] or [B, bq, bk]
                if ragged_k:
                    mask = mask & (k_idx >= k_nominal)     # keys the previous block already saw
                mask = mask.reshape((-1, 1, 1) + mask.shape[-2:])  # -> [B or 1, 1, 1, bq, bk]
                s = jnp.where(mask, s, -jnp.inf)
            m_new = jnp.maximum(m, jnp.max(s, axis=-1))
            # A row that has seen no visible key keeps m = -inf; shift by 0 so exp gives 0.
            m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0) if needs_mask else m_new
            alpha = jnp.exp(m - m_safe)
            p = jnp.exp(s - m_safe[..., None])
            l = alpha * l + jnp.sum(p, axis=-1)
            pv = jnp.einsum("bhgqk,bhkd->bhgqd", p.astype(v.dtype) if v.dtype != acc_t else p,
                            v_blk, precision=prec, preferred_element_type=acc_t)
            return m_new, l, alpha[..., None] * acc + pv

        init = (jnp.full((b, hkv, g, block_q), -jnp.inf, acc_t),
                jnp.zeros((b, hkv, g, block_q), acc_t),
                jnp.zeros((b, hkv, g, block_q, d), acc_t))
        _, l, acc = jax.lax.fori_loop(lo, hi, key_block, init)
        res = acc / jnp.where(l == 0.0, 1.0, l)[..., None]           # no visible key -> zeros
        return jax.lax.dynamic_update_slice_in_dim(out, res.astype(out.dtype), q_start, axis=3)

    out = jax.lax.fori_loop(0, nq, query_block, jnp.zeros((b, hkv, g, sq, d), q.dtype))
    return jnp.transpose(out.reshape(b, h, sq, d), (0, 2, 1, 3))
