"""Ragged decode attention: a Pallas (Triton) kernel for GPUs over one segment of the KV cache.

Decode attends a few queries per row (one token's GQA group) over that row's own cached keys.
The XLA path (models/text/llama.cache_attention) computes every segment for every row up to the
batch's longest sequence and skips whole segments with a `lax.cond` on the traced kv_len; on a GPU
each cond is a device-to-host sync per segment and layer. This kernel reads each row's visible
key range [lo, hi) itself (one program per (row, KV head), a loop over key blocks from lo to hi),
so a short row costs its own length, a segment past a row's end costs an empty loop, and nothing
syncs with the host.

It returns the same partial the XLA segment computes (running max, sum of exponentials, weighted
sum of V, all float32), so segments merge with `merge_partials` exactly like flash attention's
key blocks. The cache layout is the engine's: K transposed [slots, kv_heads, head_dim, len] and
V [slots, kv_heads, len, head_dim] (int8 / fp8 with per-(token, head) scales [slots, kv_heads,
len] too, applied to scores and weights inside the kernel); rows [0, b) are read in place (no gather, no padding copy of
the cache: out-of-segment key columns are masked loads). Triton needs power-of-two tiles, so the
kernel applies to head_dim in {16, 32, 64, 128, 256} (`supported`); queries are padded to 16
rows (a decode group is 1-16 queries).
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pl_triton

_LOG2E = math.log2(math.e)
# float32 operands: Triton's dot runs them as TF32, JAX's own default precision for f32 dots on
# Ampere / Hopper GPUs (lax.Precision.DEFAULT). Measured on an H200 (`mmjax bench gpu`, accuracy
# section): 2e-4..7e-4 from the float64 oracle, where the CPU tests bound f32 at 1e-5. IEEE
# products (precision=HIGHEST) were tried there (jax 0.11.2): the first flash compile, a 16x16
# tile at head_dim 64, did not finish in the ~280 s the lease had left (XLA's slow-compile alarm
# fired), so the kernels keep the default. Parity at f32 is a CPU matter (the tests run there).
_MIN_TILE = 16


def supported(head_dim: int) -> bool:
    """head_dim the kernel takes without padding the cache (a power of two in [16, 256])."""
    return 16 <= head_dim <= 256 and head_dim & (head_dim - 1) == 0


def _kernel(q_ref, kt_ref, v_ref, lo_ref, hi_ref, *refs, scale_log2: float, block_k: int, seg_len: int,
            quantized: bool):
    """q [n, hd], kt [hd, L], v [L, hd], lo / hi scalars (quantized: then k_scale, v_scale [L])
    -> m, l [n], acc [n, hd] (log2 domain m)."""
    ks_ref, vs_ref, m_ref, l_ref, acc_ref = refs if quantized else (None, None, *refs)
    lo, hi = lo_ref[...], hi_ref[...]
    q = q_ref[...]
    n, hd = q.shape
    first = lo // block_k
    last = jnp.where(hi > lo, (hi + block_k - 1) // block_k, first)

    def body(j, carry):
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
        s = jnp.where(((idx >= lo) & (idx < hi))[None, :], s, -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new)
        alpha = jnp.exp2(m - m_use)
        p = jnp.exp2(s - m_use[:, None])
        pw = p * vs[None, :] if quantized else p
        pv = jax.lax.dot_general(pw.astype(v.dtype), v, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)
        return alpha[:, None] * acc + pv, m_new, alpha * l + jnp.sum(p, axis=1)

    carry = (jnp.zeros((n, hd), jnp.float32), jnp.full((n,), -jnp.inf, jnp.float32), jnp.zeros((n,), jnp.float32))
    acc, m, l = jax.lax.fori_loop(first, last, body, carry)
    m_ref[...] = m
    l_ref[...] = l
    acc_ref[...] = acc


def ragged_decode_attention(q: jax.Array, kt: jax.Array, v: jax.Array, lo: jax.Array, hi: jax.Array, *,
                            scale: float, block_k: int = 64, num_warps: int = 4,
                            interpret: bool | None = None,
                            scales: tuple[jax.Array, jax.Array] | None = None) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Partial attention of rows [0, b) over one cache segment, each over its own key range.

    q [b, kvh, n, hd] (n queries per KV head); kt [slots, kvh, hd, L]; v [slots, kvh, L, hd]
    (slots >= b); lo, hi [b] int32: row i sees the segment's keys [lo_i, hi_i) (empty if hi <= lo).
    scales: (k_scale, v_scale) [slots, kvh, L] of an int8 / fp8 cache (models/text/kv_quant):
    K / V blocks are converted to q's dtype in the kernel, scores multiplied by the key scales,
    weights by the value scales.
    Returns (m [b, kvh, n] running max of the scaled scores, -inf where nothing is visible;
    l [b, kvh, n] sum of exp(s - m); acc [b, kvh, n, hd] sum of exp(s - m) V), all float32.
    interpret=None: the compiled kernel on GPU, the Pallas interpreter elsewhere.
    """
    b, kvh, n, hd = q.shape
    seg_len = v.shape[2]
    if not supported(hd):
        raise ValueError(f"ragged_decode_attention needs a power-of-two head_dim in [16, 256], got {hd}")
    if interpret is None:   # the platform compiled for (a CUDA export on a CPU host gets the real kernel)
        from mmjax.backend import current_platform
        interpret = current_platform() not in ("gpu", "cuda", "rocm")
    n_pad = max(_MIN_TILE, 1 << (n - 1).bit_length())
    block_k = min(block_k, max(_MIN_TILE, 1 << (seg_len - 1).bit_length()))
    qp = jnp.pad(q, ((0, 0), (0, 0), (0, n_pad - n), (0, 0))) if n_pad != n else q
    kernel = functools.partial(_kernel, scale_log2=scale * _LOG2E, block_k=block_k, seg_len=seg_len,
                               quantized=scales is not None)
    row = lambda i, h: (i,)                                               # noqa: E731
    scale_specs = [pl.BlockSpec((None, None, seg_len), lambda i, h: (i, h, 0))] * 2 if scales is not None else []
    m, l, acc = pl.pallas_call(
        kernel,
        grid=(b, kvh),
        in_specs=[pl.BlockSpec((None, None, n_pad, hd), lambda i, h: (i, h, 0, 0)),
                  pl.BlockSpec((None, None, hd, seg_len), lambda i, h: (i, h, 0, 0)),
                  pl.BlockSpec((None, None, seg_len, hd), lambda i, h: (i, h, 0, 0)),
                  pl.BlockSpec((None,), row), pl.BlockSpec((None,), row)] + scale_specs,
        out_specs=[pl.BlockSpec((None, None, n_pad), lambda i, h: (i, h, 0)),
                   pl.BlockSpec((None, None, n_pad), lambda i, h: (i, h, 0)),
                   pl.BlockSpec((None, None, n_pad, hd), lambda i, h: (i, h, 0, 0))],
        out_shape=[jax.ShapeDtypeStruct((b, kvh, n_pad), jnp.float32),
                   jax.ShapeDtypeStruct((b, kvh, n_pad), jnp.float32),
                   jax.ShapeDtypeStruct((b, kvh, n_pad, hd), jnp.float32)],
        compiler_params=pl_triton.CompilerParams(num_warps=num_warps, num_stages=2),
        interpret=interpret,
        name="mmjax_ragged_decode_attention",
    )(qp, kt, v, lo.astype(jnp.int32), hi.astype(jnp.int32), *(scales or ()))
    # back from the kernel's log2 domain: exp2(s2 - m2) == exp(s - m) with m = m2 / log2(e)
    return m[:, :, :n] / _LOG2E, l[:, :, :n], acc[:, :, :n]


def merge_partials(a: tuple, b: tuple) -> tuple:
    """Two (m, l, acc) partials over disjoint keys -> the partial over both."""
    (ma, la, xa), (mb, lb, xb) = a, b
    m = jnp.maximum(ma, mb)
    shift = jnp.where(jnp.isfinite(m), m, 0.0)
    ra, rb = jnp.exp(ma - shift), jnp.exp(mb - shift)          # 0 for a side that saw nothing
    return m, la * ra + lb * rb, xa * ra[..., None] + xb * rb[..., None]
