"""Ragged decode attention: a Pallas (Triton) kernel for GPUs over a layer's whole segmented KV cache.

Decode attends a few queries per row (one token's GQA group) over that row's own cached keys.
The XLA path (models/nn/kv_cache.cache_attention) computes every segment for every row up to the
batch's longest sequence and skips whole segments with a `lax.cond` on the traced kv_len; on a GPU
each cond is a device-to-host sync per segment and layer. This kernel reads each row's visible
key range [lo, hi) itself (one program per (row, KV head), a loop over key blocks from lo to hi),
so a short row costs its own length, a segment past a row's end costs an empty loop, and nothing
syncs with the host.

One call covers every segment of a layer (the kernel walks them in order with one running
softmax), so a decode step launches one kernel per layer, not one per segment plus their
merges, which left a GPU step bound by its launches. It returns the
partial the XLA path computes (running max, sum of exponentials, weighted sum of V, all
float32). The cache layout is the engine's: K transposed [slots, kv_heads, head_dim, len] and
V [slots, kv_heads, len, head_dim] (int8 / fp8 with per-(token, head) scales [slots, kv_heads,
len] too, applied to scores and weights inside the kernel); rows [0, b) are read in place (no
gather, no padding copy of the cache: out-of-segment key columns are masked loads). Triton needs
power-of-two tiles, so the kernel applies to head_dim in {16, 32, 64, 128, 256} (`supported`);
queries are padded to 16 rows (a decode group is 1-16 queries).
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pl_triton

_LOG2E = math.log2(math.e)
# float32 operands: TF32 products, as in flash.py (see there why)
_MIN_TILE = 16


def supported(head_dim: int) -> bool:
    """head_dim the kernel takes without padding the cache (a power of two in [16, 256])."""
    return 16 <= head_dim <= 256 and head_dim & (head_dim - 1) == 0


def _kernel(*refs, scale_log2: float, seg_lens: tuple[int, ...], block_ks: tuple[int, ...], quantized: bool):
    """refs: q [n, hd]; per segment j kt_j [hd, L_j]; per segment v_j [L_j, hd]; lo, hi scalars
    (cache indexes); quantized: per segment k_scale_j, then v_scale_j [L_j]; out m, l [n],
    acc [n, hd] (log2 domain m). The segments are visited in order, each over its blocks that
    meet [lo, hi), carrying one running (acc, m, l): no partials to merge afterwards."""
    ns = len(seg_lens)
    q_ref, kt_refs, v_refs = refs[0], refs[1:1 + ns], refs[1 + ns:1 + 2 * ns]
    lo_ref, hi_ref = refs[1 + 2 * ns:3 + 2 * ns]
    rest = refs[3 + 2 * ns:]
    ks_refs, vs_refs = (rest[:ns], rest[ns:2 * ns]) if quantized else ((None,) * ns, (None,) * ns)
    m_ref, l_ref, acc_ref = rest[2 * ns:] if quantized else rest
    lo, hi = lo_ref[...], hi_ref[...]
    q = q_ref[...]
    n, hd = q.shape

    def body(j, carry, kt_ref, v_ref, ks_ref, vs_ref, seg_len, block_k, s_lo, s_hi):
        acc, m, l = carry
        start = pl.multiple_of(j * block_k, block_k)
        idx = start + jnp.arange(block_k, dtype=jnp.int32)
        inside = idx < seg_len
        zero = 0 if jnp.issubdtype(kt_ref.dtype, jnp.integer) else 0.0     # int8 needs an int fill
        kt = pl_triton.load(kt_ref.at[:, pl.ds(start, block_k)], mask=inside[None, :], other=zero)
        v = pl_triton.load(v_ref.at[pl.ds(start, block_k), :], mask=inside[:, None], other=zero)
        if quantized:   # int8 / fp8: the block converted in registers, scales on scores / weights
            kt, v = kt.astype(q.dtype), v.astype(q.dtype)
            ks = pl_triton.load(ks_ref.at[pl.ds(start, block_k)], mask=inside, other=0).astype(jnp.float32)
            vs = pl_triton.load(vs_ref.at[pl.ds(start, block_k)], mask=inside, other=0).astype(jnp.float32)
        s = jax.lax.dot_general(q, kt, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32) * scale_log2
        if quantized:
            s = s * ks[None, :]
        s = jnp.where(((idx >= s_lo) & (idx < s_hi))[None, :], s, -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new)
        alpha = jnp.exp2(m - m_use)
        p = jnp.exp2(s - m_use[:, None])
        pw = p * vs[None, :] if quantized else p
        pv = jax.lax.dot_general(pw.astype(v.dtype), v, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)
        return alpha[:, None] * acc + pv, m_new, alpha * l + jnp.sum(p, axis=1)

    carry = (jnp.zeros((n, hd), jnp.float32), jnp.full((n,), -jnp.inf, jnp.float32), jnp.zeros((n,), jnp.float32))
    offset = 0
    for i in range(ns):
        seg_len, block_k = seg_lens[i], block_ks[i]
        s_lo = jnp.clip(lo - offset, 0, seg_len)            # this segment's part of [lo, hi)
        s_hi = jnp.clip(hi - offset, 0, seg_len)
        first = s_lo // block_k
        last = jnp.where(s_hi > s_lo, (s_hi + block_k - 1) // block_k, first)
        carry = jax.lax.fori_loop(first, last, functools.partial(
            body, kt_ref=kt_refs[i], v_ref=v_refs[i], ks_ref=ks_refs[i], vs_ref=vs_refs[i], seg_len=seg_len,
            block_k=block_k, s_lo=s_lo, s_hi=s_hi), carry)
        offset += seg_len
    acc, m, l = carry
    m_ref[...] = m
    l_ref[...] = l
    acc_ref[...] = acc


def ragged_decode_attention(q: jax.Array, kts: list[jax.Array], vs: list[jax.Array], lo: jax.Array, hi: jax.Array,
                            *, scale: float, block_k: int = 64, num_warps: int = 4,
                            interpret: bool | None = None,
                            scales: tuple[list[jax.Array], list[jax.Array]] | None = None
                            ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Partial attention of rows [0, b) over a cache given as consecutive segments, each row over
    its own range of cache indexes, in one kernel call (one launch per layer and step).

    q [b, kvh, n, hd] (n queries per KV head); kts[j] [slots, kvh, hd, L_j]; vs[j] [slots, kvh,
    L_j, hd] (slots >= b), segment j covering cache indexes [L_0 + .. + L_{j-1}, .. + L_j);
    lo, hi [b] int32: row i sees cache indexes [lo_i, hi_i) (empty if hi <= lo).
    scales: (k_scales, v_scales), per segment [slots, kvh, L_j], of an int8 / fp8 cache
    (models/text/kv_quant): K / V blocks are converted to q's dtype in the kernel, scores
    multiplied by the key scales, weights by the value scales.
    Returns (m [b, kvh, n] running max of the scaled scores, -inf where nothing is visible;
    l [b, kvh, n] sum of exp(s - m); acc [b, kvh, n, hd] sum of exp(s - m) V), all float32.
    interpret=None: the compiled kernel on GPU, the Pallas interpreter elsewhere.
    """
    b, kvh, n, hd = q.shape
    if not supported(hd):
        raise ValueError(f"ragged_decode_attention needs a power-of-two head_dim in [16, 256], got {hd}")
    if len(kts) != len(vs) or not kts:
        raise ValueError(f"ragged_decode_attention needs matching K and V segments, got {len(kts)} and {len(vs)}")
    if interpret is None:   # the platform compiled for (a CUDA export on a CPU host gets the real kernel)
        from mmjax.backend import current_platform
        interpret = current_platform() not in ("gpu", "cuda", "rocm")
    seg_lens = tuple(int(v.shape[2]) for v in vs)
    n_pad = max(_MIN_TILE, 1 << (n - 1).bit_length())
    block_ks = tuple(min(block_k, max(_MIN_TILE, 1 << (length - 1).bit_length())) for length in seg_lens)
    qp = jnp.pad(q, ((0, 0), (0, 0), (0, n_pad - n), (0, 0))) if n_pad != n else q
    kernel = functools.partial(_kernel, scale_log2=scale * _LOG2E, seg_lens=seg_lens, block_ks=block_ks,
                               quantized=scales is not None)
    row = lambda i, h: (i,)                                               # noqa: E731
    whole = lambda i, h: (i, h, 0, 0)                                     # noqa: E731
    kt_specs = [pl.BlockSpec((None, None, hd, length), whole) for length in seg_lens]
    v_specs = [pl.BlockSpec((None, None, length, hd), whole) for length in seg_lens]
    scale_specs = ([pl.BlockSpec((None, None, length), lambda i, h: (i, h, 0)) for length in seg_lens] * 2
                   if scales is not None else [])
    m, l, acc = pl.pallas_call(
        kernel,
        grid=(b, kvh),
        in_specs=[pl.BlockSpec((None, None, n_pad, hd), whole)] + kt_specs + v_specs
                 + [pl.BlockSpec((None,), row), pl.BlockSpec((None,), row)] + scale_specs,
        out_specs=[pl.BlockSpec((None, None, n_pad), lambda i, h: (i, h, 0)),
                   pl.BlockSpec((None, None, n_pad), lambda i, h: (i, h, 0)),
                   pl.BlockSpec((None, None, n_pad, hd), whole)],
        out_shape=[jax.ShapeDtypeStruct((b, kvh, n_pad), jnp.float32),
                   jax.ShapeDtypeStruct((b, kvh, n_pad), jnp.float32),
                   jax.ShapeDtypeStruct((b, kvh, n_pad, hd), jnp.float32)],
        compiler_params=pl_triton.CompilerParams(num_warps=num_warps, num_stages=2),
        interpret=interpret,
        name="mmjax_ragged_decode_attention",
    )(qp, *kts, *vs, lo.astype(jnp.int32), hi.astype(jnp.int32),
      *(list(scales[0]) + list(scales[1]) if scales is not None else ()))
    # back from the kernel's log2 domain: exp2(s2 - m2) == exp(s - m) with m = m2 / log2(e)
    return m[:, :, :n] / _LOG2E, l[:, :, :n], acc[:, :, :n]
