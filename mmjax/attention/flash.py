"""Pallas tiled flash-attention forward kernel (FlashAttention-2 style online softmax).

One program per (query block, batch, head): the [block_q, D] query tile stays in registers /
shared memory while a loop walks the key/value tiles [block_k, D] that can hold a visible key,
keeping the running max m, normalizer l and un-normalized output acc in float32. The key range
is bounded by causal/window positions and, for segment ids / `lengths`, by per-query-block
segment bounds computed outside the kernel (packed images cost sum(n_i^2), not N^2). Interior
blocks run a loop without any mask arithmetic; only diagonal/ragged/segment blocks are masked.
Segment ids, `lengths` and sequence padding are applied per tile from index vectors — an
N x N mask is never built, so memory is O(N) (inputs, output and two int32 id vectors).

GPU lowering is Pallas' Triton backend (selected by `triton.CompilerParams`). Triton tiles must
have power-of-two sizes, so the wrapper pads:
  * head_dim up to the next power of two (>= 16): 64 -> 64, 72/80/96 -> 128, 128 -> 128. The
    zero columns add nothing to q.k and produce zero output columns, which are sliced off
    (cost: head_dim 80 does 128/80 = 1.6x the tensor-core work of an ideal kernel);
  * seq_q / seq_k up to multiples of block_q / block_k; padded keys are masked in-kernel,
    padded query rows are sliced off.
On other backends the same kernel runs with `interpret=True` (slow; for tests).
"""
from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pl_triton

from mmjax.attention.common import (
    SegmentIds, Window, check_lengths, check_shapes, default_scale, key_block_range,
    normalize_window, segment_block_bounds, split_segment_ids, visible,
)

_LOG2E = math.log2(math.e)
# float32 operands: Triton's dot runs them as TF32, JAX's own default precision for f32 dots on
# Ampere / Hopper GPUs (lax.Precision.DEFAULT). Measured on an H200 (`mmjax bench gpu`, accuracy
# section): 2e-4..7e-4 from the float64 oracle, where the CPU tests bound f32 at 1e-5. IEEE
# products (precision=HIGHEST) were tried there (jax 0.11.2): the first flash compile, a 16x16
# tile at head_dim 64, did not finish in the ~280 s the lease had left (XLA's slow-compile alarm
# fired), so the kernels keep the default. Parity at f32 is a CPU matter (the tests run there).
_MIN_TILE = 16  # smallest tile Triton's tl.dot accepts


@dataclasses.dataclass(frozen=True)
class FlashBlockSizes:
    """Tile sizes and Triton launch parameters (block sizes must be powers of two >= 16)."""

    block_q: int = 128
    block_k: int = 64
    num_warps: int = 4
    num_stages: int = 3

    def __post_init__(self):
        for name in ("block_q", "block_k"):
            val = getattr(self, name)
            if val < _MIN_TILE or val & (val - 1):
                raise ValueError(f"{name} must be a power of two >= {_MIN_TILE}; got {val}")

    @classmethod
    def for_head_dim(cls, head_dim: int) -> "FlashBlockSizes":
        """Defaults by (padded) head_dim, after the Triton FlashAttention tutorial's configs.

        Larger head_dim means larger q/acc tiles per program, so the key tile shrinks to keep
        registers from spilling. Unmeasured on this project's GPUs so far: tune with
        benchmarks/attention.py --sweep.
        """
        d = _padded_head_dim(head_dim)
        if d <= 64:
            return cls(block_q=128, block_k=128, num_warps=4, num_stages=3)
        if d <= 128:
            return cls(block_q=128, block_k=64, num_warps=8, num_stages=3)
        return cls(block_q=64, block_k=32, num_warps=4, num_stages=2)


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _padded_head_dim(head_dim: int) -> int:
    return max(_MIN_TILE, _next_pow2(head_dim))


def _pad_axis(x: jax.Array, axis: int, size: int, value=0) -> jax.Array:
    if x.shape[axis] == size:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, size - x.shape[axis])
    return jnp.pad(x, widths, constant_values=value)


def _flash_kernel(*refs, scale_log2: float, causal: bool, window, offset: int, block_q: int,
                  block_k: int, num_k_blocks: int, seq_k: int, mask_tail: bool, has_seg: bool):
    """refs: q [bq, Dp], k/v [Sk_pad, Dp], (q_seg [bq], kv_seg [Sk_pad], seg_lo, seg_hi scalars),
    out o [bq, Dp]."""
    if has_seg:
        q_ref, k_ref, v_ref, qs_ref, ks_ref, seg_lo_ref, seg_hi_ref, o_ref = refs
    else:
        q_ref, k_ref, v_ref, o_ref = refs
    q_start = pl.program_id(0) * block_q
    q = q_ref[...]
    q_idx = q_start + jnp.arange(block_q, dtype=jnp.int32)[:, None]
    q_seg = qs_ref[...][:, None] if has_seg else None
    lo, hi = key_block_range(q_start, block_q, block_k, num_k_blocks, offset, causal, window)
    if has_seg:  # packed images: visit only key blocks whose segment ids can match
        lo = jnp.maximum(lo, seg_lo_ref[...])
        hi = jnp.maximum(lo, jnp.minimum(hi, seg_hi_ref[...]))
    # Split [lo, hi) into key blocks every row of this query block sees whole ([lo, mid): no
    # mask work at all) and blocks that need the per-element mask ([mid, hi)): for causal only
    # the diagonal blocks, for ragged seq_k only the last block. Ids/windows mask everywhere.
    if has_seg or window is not None:
        mid = lo
    else:
        mid = hi
        if causal:  # block jb is fully visible iff its last key <= first query's position
            full = jax.lax.div(q_start + offset + 1, jnp.int32(block_k))
            mid = jnp.minimum(mid, jnp.maximum(lo, full))
        if mask_tail:
            mid = jnp.minimum(mid, num_k_blocks - 1)
        mid = jnp.maximum(mid, lo)

    def body(j, carry, masked: bool):
        acc, m, l = carry
        k_start = pl.multiple_of(j * block_k, block_k)
        k = k_ref[pl.ds(k_start, block_k), :]
        v = v_ref[pl.ds(k_start, block_k), :]
        # Scores in the log2 domain (exp2 is the native GPU instruction).
        s = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())),
                                preferred_element_type=jnp.float32) * scale_log2
        if masked:
            k_idx = k_start + jnp.arange(block_k, dtype=jnp.int32)[None, :]
            mask = visible(q_idx, k_idx, offset=offset, causal=causal, window=window,
                           q_seg=q_seg,
                           kv_seg=ks_ref[pl.ds(k_start, block_k)][None, :] if has_seg else None,
                           kv_len=seq_k if mask_tail else None)
            s = jnp.where(mask, s, -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        # A row that has seen no visible key keeps m = -inf; shift by 0 so exp2 gives 0, not NaN.
        m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new) if masked else m_new
        alpha = jnp.exp2(m - m_use)
        p = jnp.exp2(s - m_use[:, None])
        l = alpha * l + jnp.sum(p, axis=1)
        pv = jax.lax.dot_general(p.astype(v.dtype), v, (((1,), (0,)), ((), ())),
                                 preferred_element_type=jnp.float32)
        return alpha[:, None] * acc + pv, m_new, l

    carry = (jnp.zeros((block_q, q.shape[-1]), jnp.float32),
             jnp.full((block_q,), -jnp.inf, jnp.float32),
             jnp.zeros((block_q,), jnp.float32))
    carry = jax.lax.fori_loop(lo, mid, functools.partial(body, masked=False), carry)
    acc, _, l = jax.lax.fori_loop(mid, hi, functools.partial(body, masked=True), carry)
    o_ref[...] = (acc / jnp.where(l == 0.0, 1.0, l)[:, None]).astype(o_ref.dtype)


def flash_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, causal: bool = False,
                    segment_ids: SegmentIds = None, lengths: jax.Array | None = None,
                    window: Window = None, scale: float | None = None,
                    block_sizes: FlashBlockSizes | None = None,
                    interpret: bool | None = None) -> jax.Array:
    """q [B, Sq, H, D], k/v [B, Sk, Hkv, D] -> [B, Sq, H, D] in q.dtype (semantics: common.py).

    interpret=None runs the compiled kernel on GPU and the Pallas interpreter elsewhere.
    """
    b, sq, h, d, sk, hkv = check_shapes(q, k, v)
    g = h // hkv
    scale = default_scale(d, scale)
    window = normalize_window(window)
    q_seg, kv_seg = split_segment_ids(segment_ids, b, sq, sk)
    lengths = check_lengths(lengths, b)
    if interpret is None:   # the platform compiled for (a CUDA export on a CPU host gets the real kernel)
        from mmjax.backend import current_platform
        interpret = current_platform() not in ("gpu", "cuda", "rocm")
    dp = _padded_head_dim(d)
    bs = block_sizes or FlashBlockSizes.for_head_dim(d)
    # Short sequences: shrink tiles (still powers of two) instead of padding to a full block.
    block_q = min(bs.block_q, max(_MIN_TILE, _next_pow2(sq)))
    block_k = min(bs.block_k, max(_MIN_TILE, _next_pow2(sk)))
    nq, nk = -(-sq // block_q), -(-sk // block_k)
    sq_pad, sk_pad = nq * block_q, nk * block_k

    # `lengths` becomes kv segment -1 (padding) so the kernel has a single id test; sequence
    # padding also gets -1. Without ids, padded keys are masked by a static index bound.
    has_seg = q_seg is not None or lengths is not None
    if has_seg:
        if q_seg is None:
            q_seg = jnp.zeros((b, sq), jnp.int32)
            kv_seg = jnp.zeros((b, sk), jnp.int32)
        if lengths is not None:
            kv_seg = jnp.where(jnp.arange(sk)[None, :] < lengths[:, None], kv_seg, -1)
        q_seg = _pad_axis(q_seg, 1, sq_pad, -1)
        kv_seg = _pad_axis(kv_seg, 1, sk_pad, -1)
    mask_tail = sk_pad != sk and not has_seg

    qp = _pad_axis(_pad_axis(q, 1, sq_pad), 3, dp)
    kp = _pad_axis(_pad_axis(k, 1, sk_pad), 3, dp)
    vp = _pad_axis(_pad_axis(v, 1, sk_pad), 3, dp)

    kernel = functools.partial(
        _flash_kernel, scale_log2=scale * _LOG2E, causal=causal, window=window, offset=sk - sq,
        block_q=block_q, block_k=block_k, num_k_blocks=nk, seq_k=sk, mask_tail=mask_tail,
        has_seg=has_seg)
    # Grid (q block, batch, head); GQA reads kv head h // g through the index map (no repeat).
    in_specs = [
        pl.BlockSpec((None, block_q, None, dp), lambda i, bi, hi: (bi, i, hi, 0)),
        pl.BlockSpec((None, sk_pad, None, dp), lambda i, bi, hi: (bi, 0, hi // g, 0)),
        pl.BlockSpec((None, sk_pad, None, dp), lambda i, bi, hi: (bi, 0, hi // g, 0)),
    ]
    args = [qp, kp, vp]
    if has_seg:
        seg_lo, seg_hi = segment_block_bounds(q_seg.reshape(b, nq, block_q),
                                              kv_seg.reshape(b, nk, block_k))
        in_specs += [pl.BlockSpec((None, block_q), lambda i, bi, hi: (bi, i)),
                     pl.BlockSpec((None, sk_pad), lambda i, bi, hi: (bi, 0)),
                     pl.BlockSpec((None, None), lambda i, bi, hi: (bi, i)),
                     pl.BlockSpec((None, None), lambda i, bi, hi: (bi, i))]
        args += [q_seg, kv_seg, seg_lo, seg_hi]
    out = pl.pallas_call(
        kernel,
        grid=(nq, b, h),
        in_specs=in_specs,
        out_specs=pl.BlockSpec((None, block_q, None, dp), lambda i, bi, hi: (bi, i, hi, 0)),
        out_shape=jax.ShapeDtypeStruct((b, sq_pad, h, dp), q.dtype),
        compiler_params=pl_triton.CompilerParams(num_warps=bs.num_warps,
                                                 num_stages=bs.num_stages),
        interpret=interpret,
        name="mmjax_flash_attention",
    )(*args)
    return out[:, :sq, :, :d]
