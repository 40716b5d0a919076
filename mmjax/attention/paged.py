"""Ragged paged attention: a Pallas (Triton) kernel for GPUs over a paged layer's page pool.

A paged layer (models/nn/kv_cache.py, serving/pages.py) keeps one pool of pages per layer, K
transposed `[num_pages, kv_heads, head_dim, page_size]` and V `[num_pages, kv_heads, page_size,
head_dim]` (int8 / fp8: scales `[num_pages, kv_heads, page_size]` each), and a page table
`[rows, max_pages]`: cache index i of row r lives at offset i % page_size of page
`table[r, i // page_size]`. XLA's path reads a row's pages in runs, each gathered into a dense
copy inside a `lax.cond` on kv_len (a host sync per run and layer on a GPU). This kernel reads
the pages in place: one program per (row, KV head, block of queries) walks the key blocks that
can hold a key visible to one of its queries, looks each key's page up in the row's table and
loads it from the pool (no gathered copy, no cond, one launch per layer and step).

One kernel serves decode (t = 1: a row's GQA group of queries, one query block) and prefill
chunks (t > 1: t * group query rows in blocks of `block_q`): every query row r carries its own
visible range of cache indexes [lo_r, hi_r) (causal, sliding window and chunked attention all
reduce to one: kv_cache.first_visible), so ragged rows, chunk ends and padding (an empty range)
need nothing else. The same choices as the slot decode kernel (attention/decode.py) otherwise:
scores in float32 in the log2 domain, int8 / fp8 blocks converted in registers with the key
scales on the scores and the value scales on the weights, head_dim a power of two in [16, 256]
(`decode.supported`), queries padded to at least 16 rows (Triton's smallest dot).

Key blocks of block_k positions (64; 32 at head_dim 256, flash.py's tile there): where block_k
divides page_size a block lies in one page (one table entry, contiguous loads); otherwise (pages
smaller than a block, or of another size) each key of the block looks up its own page (a gather:
pages of 16 positions give 4 pages per block), so small pages do not shrink the tiles.

jax ships a paged decode kernel (jax.experimental.pallas.ops.gpu.paged_attention) for another
layout ([kv_heads, pages, page_size, head_dim] K and V, no windows, decode only) and tokamax no
paged kernel; tpu-inference's ragged paged attention is a TPU (Mosaic) kernel. Adopting the
first would mean a transpose of the pool per step, and no prefill; hence this kernel.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pl_triton

from mmjax.attention.decode import supported

_LOG2E = math.log2(math.e)
_MIN_TILE = 16      # the smallest tile Triton's dot takes


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _kernel(table_ref, lo_ref, hi_ref, q_ref, kt_ref, v_ref, *rest, scale_log2: float, page: int, block_k: int,
            quantized: bool):
    """table_ref [max_pages] (this row's); lo_ref, hi_ref [block_q]; q_ref [block_q, hd]; kt_ref
    [num_pages, hd, page], v_ref [num_pages, page, hd] (this KV head's pool); quantized: then
    ks_ref, vs_ref [num_pages, page]; out o_ref [block_q, hd] float32 (normalized; zeros for a
    query with nothing visible)."""
    ks_ref, vs_ref, o_ref = rest if quantized else (None, None, rest[0])
    num_pages, hd, _ = kt_ref.shape
    max_pages = table_ref.shape[0]
    lo, hi = lo_ref[...], hi_ref[...]
    q = q_ref[...]
    n = q.shape[0]
    live = hi > lo
    # key blocks holding a key some query of the block may read ([first, last) empty if none)
    lo_min = jnp.min(jnp.where(live, lo, jnp.iinfo(jnp.int32).max))
    hi_max = jnp.max(jnp.where(live, hi, 0))
    first = lo_min // block_k
    last = jnp.where(hi_max > 0, (hi_max + block_k - 1) // block_k, 0)
    zero = 0 if jnp.issubdtype(kt_ref.dtype, jnp.integer) else 0.0      # int8 needs an int fill
    d = jnp.arange(hd, dtype=jnp.int32)

    def body(j, carry):
        acc, m, l = carry
        start = j * block_k
        idx = start + jnp.arange(block_k, dtype=jnp.int32)                 # cache indexes of the block
        inside = (idx >= lo_min) & (idx < hi_max)                          # loaded at all
        if page % block_k == 0:     # the block lies in one page: one table entry, contiguous loads
            p = jnp.clip(table_ref[jnp.minimum(start // page, max_pages - 1)], 0, num_pages - 1)
            off = pl.multiple_of(start % page, block_k)
            kt = pl_triton.load(kt_ref.at[p, :, pl.ds(off, block_k)], mask=inside[None, :], other=zero)
            v = pl_triton.load(v_ref.at[p, pl.ds(off, block_k), :], mask=inside[:, None], other=zero)
            if quantized:
                ks = pl_triton.load(ks_ref.at[p, pl.ds(off, block_k)], mask=inside, other=0)
                vs = pl_triton.load(vs_ref.at[p, pl.ds(off, block_k)], mask=inside, other=0)
        else:                       # each key's own page (a gather over the block's pages)
            pi = jnp.minimum(idx // page, max_pages - 1)
            p = jnp.clip(pl_triton.load(table_ref.at[pi], mask=inside, other=0), 0, num_pages - 1)
            off = idx % page
            kt = pl_triton.load(kt_ref.at[p[None, :], d[:, None], off[None, :]], mask=inside[None, :], other=zero)
            v = pl_triton.load(v_ref.at[p[:, None], off[:, None], d[None, :]], mask=inside[:, None], other=zero)
            if quantized:
                ks = pl_triton.load(ks_ref.at[p, off], mask=inside, other=0)
                vs = pl_triton.load(vs_ref.at[p, off], mask=inside, other=0)
        if quantized:   # int8 / fp8: the block converted in registers, scales on scores / weights
            kt, v = kt.astype(q.dtype), v.astype(q.dtype)
        s = jax.lax.dot_general(q, kt, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32) * scale_log2
        if quantized:
            s = s * ks.astype(jnp.float32)[None, :]
        s = jnp.where((idx[None, :] >= lo[:, None]) & (idx[None, :] < hi[:, None]), s, -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new)
        alpha = jnp.exp2(m - m_use)
        w = jnp.exp2(s - m_use[:, None])
        wv = w * vs.astype(jnp.float32)[None, :] if quantized else w
        pv = jax.lax.dot_general(wv.astype(v.dtype), v, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)
        return alpha[:, None] * acc + pv, m_new, alpha * l + jnp.sum(w, axis=1)

    carry = (jnp.zeros((n, hd), jnp.float32), jnp.full((n,), -jnp.inf, jnp.float32), jnp.zeros((n,), jnp.float32))
    acc, _, l = jax.lax.fori_loop(first, last, body, carry)
    o_ref[...] = acc / jnp.where(l > 0, l, 1.0)[:, None]


def paged_attention(q: jax.Array, kt: jax.Array, v: jax.Array, table: jax.Array, lo: jax.Array, hi: jax.Array,
                    *, scale: float, scales: tuple[jax.Array, jax.Array] | None = None, block_q: int = 64,
                    block_k: int | None = None, num_warps: int = 4, interpret: bool | None = None) -> jax.Array:
    """Attention of query rows over a paged cache, each row over its own range of cache indexes
    of its batch row's pages, in one kernel call.

    q [b, kvh, n, hd] (n query rows per KV head: decode's GQA group, or a prefill chunk's t
    tokens x group, token-major); kt [num_pages, kvh, hd, P], v [num_pages, kvh, P, hd] (the
    pool); table [b, max_pages] int32: batch row i's pages (entries past the pool, e.g. the
    host's unused marker num_pages, are only ever read for masked keys); lo, hi [b, n] int32:
    query row (i, r) sees cache indexes [lo, hi) of row i (empty if hi <= lo: padding, a parked
    decode row; lo may be negative, hi past the row's pages: both are clipped). scales:
    (k_scale, v_scale) [num_pages, kvh, P] of an int8 / fp8 pool. Scores are scaled by `scale`.
    block_q / block_k: query rows / keys per tile (block_k None: 64, 32 at head_dim 256).
    Returns [b, kvh, n, hd] float32, zeros where nothing is visible. interpret=None: the
    compiled kernel when compiling for a GPU, the Pallas interpreter elsewhere.
    """
    b, kvh, n, hd = q.shape
    num_pages, _, page, _ = v.shape
    if not supported(hd):
        raise ValueError(f"paged_attention needs a power-of-two head_dim in [16, 256], got {hd}")
    if kt.shape != (num_pages, kvh, hd, page) or v.shape != (num_pages, kvh, page, hd):
        raise ValueError(f"paged_attention: pool K {kt.shape} / V {v.shape} do not match q {q.shape}")
    if table.ndim != 2 or table.shape[0] != b or lo.shape != (b, n) or hi.shape != (b, n):
        raise ValueError(f"paged_attention: table {table.shape}, lo {lo.shape}, hi {hi.shape} for q {q.shape}")
    if block_k is None:
        block_k = 64 if hd <= 128 else 32
    for name, x in (("block_q", block_q), ("block_k", block_k)):
        if x < _MIN_TILE or x & (x - 1):
            raise ValueError(f"paged_attention: {name} must be a power of two >= {_MIN_TILE}, got {x}")
    if interpret is None:   # the platform compiled for (a CUDA export on a CPU host gets the real kernel)
        from mmjax.backend import current_platform
        interpret = current_platform() not in ("gpu", "cuda", "rocm")
    # a window's first index may be negative; no row holds more than max_pages pages
    lo, hi = jnp.maximum(lo.astype(jnp.int32), 0), jnp.minimum(hi.astype(jnp.int32), table.shape[1] * page)
    bq = min(block_q, max(_MIN_TILE, _next_pow2(n)))
    n_pad = -(-n // bq) * bq
    if n_pad != n:           # padding rows see nothing (lo = hi = 0)
        q = jnp.pad(q, ((0, 0), (0, 0), (0, n_pad - n), (0, 0)))
        lo, hi = (jnp.pad(x, ((0, 0), (0, n_pad - n))) for x in (lo, hi))
    kernel = functools.partial(_kernel, scale_log2=scale * _LOG2E, page=page, block_k=block_k,
                               quantized=scales is not None)
    rows = lambda i, h, r: (i, r)                                              # noqa: E731
    queries = lambda i, h, r: (i, h, r, 0)                                     # noqa: E731
    pool = lambda i, h, r: (0, h, 0, 0)                                        # noqa: E731
    in_specs = [pl.BlockSpec((None, table.shape[1]), lambda i, h, r: (i, 0)),
                pl.BlockSpec((None, bq), rows), pl.BlockSpec((None, bq), rows),
                pl.BlockSpec((None, None, bq, hd), queries),
                pl.BlockSpec((num_pages, None, hd, page), pool),
                pl.BlockSpec((num_pages, None, page, hd), pool)]
    if scales is not None:
        in_specs += [pl.BlockSpec((num_pages, None, page), lambda i, h, r: (0, h, 0))] * 2
    out = pl.pallas_call(
        kernel,
        grid=(b, kvh, n_pad // bq),
        in_specs=in_specs,
        out_specs=pl.BlockSpec((None, None, bq, hd), queries),
        out_shape=jax.ShapeDtypeStruct((b, kvh, n_pad, hd), jnp.float32),
        compiler_params=pl_triton.CompilerParams(num_warps=num_warps, num_stages=2),
        interpret=interpret,
        name="mmjax_paged_attention",
    )(table.astype(jnp.int32), lo, hi, q, kt, v,
      *(scales if scales is not None else ()))
    return out[:, :, :n]
