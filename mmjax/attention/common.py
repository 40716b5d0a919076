"""Shared semantics of every attention implementation: argument checks and the visibility rule.

All implementations (reference, chunked, flash) call `visible` on index tiles, so the masking
rules below are written once and cannot drift between implementations.

Visibility rule for query row i (0 <= i < seq_q) and key column j (0 <= j < seq_k) of batch b:

* positions are bottom-right aligned: query i sits at key position ``p = i + (seq_k - seq_q)``
  (the chunked-prefill convention: the last query is the last key). With seq_q == seq_k this is
  the plain ``p = i``.
* ``causal``: j <= p.
* ``window=(left, right)``: p - left <= j <= p + right (either side may be None = unbounded).
  An int ``w`` means ``(w, w)`` as in ``jax.nn.dot_product_attention(local_window_size=w)``;
  a Mistral-style ``sliding_window=S`` decoder is ``causal=True, window=(S - 1, 0)``.
* ``segment_ids``: q_seg[b, i] == kv_seg[b, j] and kv_seg[b, j] >= 0. Negative ids mark padding:
  padded keys are never attended and padded query rows see no key, so their output is zeros.
* ``lengths[b]``: j < lengths[b] (number of valid keys in row b).

A query row with no visible key outputs zeros (never NaN).
"""
from __future__ import annotations

import math
from typing import Sequence, Union

import jax
import jax.numpy as jnp

Window = Union[int, Sequence[Union[int, None]], None]
SegmentIds = Union[jax.Array, tuple[jax.Array, jax.Array], None]


def check_shapes(q: jax.Array, k: jax.Array, v: jax.Array) -> tuple[int, int, int, int, int, int]:
    """Validate [batch, seq, heads, head_dim] operands; returns (B, Sq, H, D, Sk, Hkv)."""
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise ValueError(f"q, k, v must be [batch, seq, heads, head_dim]; got {q.shape}, {k.shape}, {v.shape}")
    b, sq, h, d = q.shape
    bk, sk, hkv, dk = k.shape
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape; got {k.shape} and {v.shape}")
    if bk != b or dk != d:
        raise ValueError(f"q {q.shape} and k {k.shape} disagree on batch or head_dim")
    if hkv == 0 or h % hkv:
        raise ValueError(f"query heads ({h}) must be a multiple of kv heads ({hkv}) for GQA")
    return b, sq, h, d, sk, hkv


def default_scale(head_dim: int, scale: float | None) -> float:
    return 1.0 / math.sqrt(head_dim) if scale is None else float(scale)


def normalize_window(window: Window) -> tuple[int | None, int | None] | None:
    """int w -> (w, w); (left, right) kept; None or (None, None) -> None (no window)."""
    if window is None:
        return None
    if isinstance(window, int):
        left = right = window
    else:
        left, right = window
    for side in (left, right):
        if side is not None and (not isinstance(side, int) or side < 0):
            raise ValueError(f"window sides must be non-negative ints or None; got {window!r}")
    if left is None and right is None:
        return None
    return left, right


def split_segment_ids(segment_ids: SegmentIds, batch: int, seq_q: int, seq_k: int
                      ) -> tuple[jax.Array | None, jax.Array | None]:
    """segment_ids [B, S] (self-attention) or (q_seg [B, Sq], kv_seg [B, Sk]) -> int32 pair."""
    if segment_ids is None:
        return None, None
    if isinstance(segment_ids, (tuple, list)):
        q_seg, kv_seg = segment_ids
    else:
        if seq_q != seq_k:
            raise ValueError("a single segment_ids array needs seq_q == seq_k; pass (q_seg, kv_seg)")
        q_seg = kv_seg = segment_ids
    q_seg, kv_seg = jnp.asarray(q_seg), jnp.asarray(kv_seg)
    if q_seg.shape != (batch, seq_q) or kv_seg.shape != (batch, seq_k):
        raise ValueError(f"segment ids must be [batch, seq]: got {q_seg.shape} / {kv_seg.shape} "
                         f"for batch={batch}, seq_q={seq_q}, seq_k={seq_k}")
    return q_seg.astype(jnp.int32), kv_seg.astype(jnp.int32)


def check_lengths(lengths: jax.Array | None, batch: int) -> jax.Array | None:
    if lengths is None:
        return None
    lengths = jnp.asarray(lengths)
    if lengths.shape != (batch,):
        raise ValueError(f"lengths must be [batch]={batch,}; got {lengths.shape}")
    return lengths.astype(jnp.int32)


def visible(q_idx: jax.Array, k_idx: jax.Array, *, offset: int, causal: bool,
            window: tuple[int | None, int | None] | None,
            q_seg: jax.Array | None = None, kv_seg: jax.Array | None = None,
            kv_len: jax.Array | None = None) -> jax.Array:
    """Boolean visibility for broadcastable index tiles.

    q_idx [..., bq, 1] and k_idx [..., 1, bk] are query rows / key columns; q_seg / kv_seg have
    the same broadcast shapes as q_idx / k_idx; kv_len broadcasts against k_idx (e.g. [B, 1, 1]).
    `offset` = seq_k - seq_q (bottom-right alignment). Returns bool [..., bq, bk].
    """
    pos = q_idx + offset
    mask = jnp.ones(jnp.broadcast_shapes(jnp.shape(q_idx), jnp.shape(k_idx)), dtype=jnp.bool_)
    if causal:
        mask = mask & (k_idx <= pos)
    if window is not None:
        left, right = window
        if left is not None:
            mask = mask & (k_idx >= pos - left)
        if right is not None:
            mask = mask & (k_idx <= pos + right)
    if q_seg is not None:
        mask = mask & (q_seg == kv_seg) & (kv_seg >= 0)
    if kv_len is not None:
        mask = mask & (k_idx < kv_len)
    return mask


def key_block_range(q_start: jax.Array, block_q: int, block_k: int, num_k_blocks: int,
                    offset: int, causal: bool, window: tuple[int | None, int | None] | None
                    ) -> tuple[jax.Array, jax.Array]:
    """[lo, hi) key blocks that can hold a visible key for queries q_start .. q_start+block_q-1.

    Only causal/window bound the range (segments are data-dependent). Uses `lax.div`
    (truncating) and min/max only, so it lowers inside Pallas GPU kernels too; truncation can
    only widen the range for negative positions, and the clamps make that harmless.
    """
    first_pos = q_start + offset
    last_pos = q_start + (block_q - 1 + offset)
    lo = jnp.int32(0)
    hi = jnp.int32(num_k_blocks)
    right = None
    if window is not None:
        left, right = window
        if left is not None:
            lo = jnp.maximum(lo, jax.lax.div(first_pos - left, jnp.int32(block_k)))
    if causal:
        right = 0 if right is None else min(right, 0)
    if right is not None:
        hi = jnp.minimum(hi, jax.lax.div(last_pos + right, jnp.int32(block_k)) + 1)
    lo = jnp.minimum(jnp.maximum(lo, 0), num_k_blocks)
    hi = jnp.minimum(jnp.maximum(hi, lo), num_k_blocks)
    return lo, hi


def segment_block_bounds(q_seg_blocks: jax.Array, kv_seg_blocks: jax.Array
                         ) -> tuple[jax.Array, jax.Array]:
    """Per query block, the [lo, hi) key blocks whose segment ids can match: skip the rest.

    q_seg_blocks [B, nq, bq] and kv_seg_blocks [B, nk, bk] are blocked segment ids (negative =
    padding, never matches). A key block is kept if its id range [min, max] over valid ids
    intersects the query block's; lo/hi span the first..last kept block. That is exact for
    packed sequences (ids non-decreasing: a query block only visits its own images' keys)
    and a correct superset for any ids (skipped blocks provably hold no equal id; blocks
    inside [lo, hi) are still masked per element). Returns int32 lo, hi [B, nq]; lo == hi
    when nothing can match. Cost O(B * nq * nk) on ids only.
    """
    big = jnp.iinfo(jnp.int32).max

    def id_range(blocks):
        valid = blocks >= 0
        return (jnp.min(jnp.where(valid, blocks, big), axis=-1),
                jnp.max(jnp.where(valid, blocks, -1), axis=-1))

    q_min, q_max = id_range(q_seg_blocks)                            # [B, nq]
    k_min, k_max = id_range(kv_seg_blocks)                           # [B, nk]
    hit = ((k_min[:, None, :] <= q_max[:, :, None])
           & (k_max[:, None, :] >= q_min[:, :, None]))               # [B, nq, nk]
    nk = hit.shape[-1]
    any_hit = jnp.any(hit, axis=-1)
    lo = jnp.argmax(hit, axis=-1).astype(jnp.int32)
    hi = (nk - jnp.argmax(hit[..., ::-1], axis=-1)).astype(jnp.int32)
    return jnp.where(any_hit, lo, 0), jnp.where(any_hit, hi, 0)
