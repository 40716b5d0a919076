"""Decode and prefill attention on the CPU in one kernel call per layer (cpu_attention.cc).

Why: XLA computes attention over the segmented KV cache segment by segment, each behind a
`lax.cond`, as several small fusions per segment and layer, and every row of a batch computes up
to the batch's longest row. The kernels read each row's own visible keys [lo, hi), in place.

- `decode_attention`: one new token per row over its cached keys.
- `decode_attention_write`: first writes the step's new K / V into the cache, in place, so a
  decode layer's cache update is no scatter into every segment.
- `prefill_attention`: several new tokens per row, each query over its own causal (window)
  range; XLA's path computed whole segments' score blocks behind per-segment conds whose
  compilation dominated the engine's warmup.
- `dense_attention`: a vision tower's full attention (no cache: q, k, v [B, N, heads, hd] as
  they lie; `mmjax.attention` "auto" takes it where the kernels have a SIMD path). The kernel
  puts 32 queries of one (image, head) on the vector lanes (`Lanes` in the .cc; `Lanes8`, 16
  queries a task, on the AVX2 path): K and V rows are broadcast as they lie, a key's scores are
  two vectors and the softmax over keys needs no horizontal reductions. The same core takes
  prefill over an f32 cache.
- `kv_write`: a prefill's K / V written into the segments in place (what `scatter_kv` calls on
  the CPU), where XLA's scatter walked every update for every segment and transposed K first.

The attention calls also read a paged cache (`pages`: the page table [cache rows, max_pages],
the segments then the one page pool, K [num_pages, kvh, hd, page_size], V [num_pages, kvh,
page_size, hd], mmjax/models/nn/kv_cache.py): each row's pages are its segments. `kv_write`
needs no table: its caller names (page, offset) for each token (`kv_cache.page_slots`).

Built and registered with the other CPU kernels (mmjax/kernels/cpu_library.py); only on the CPU
(`enabled()` at trace time: a CPU with one of the kernels' SIMD paths, AVX-512 or AVX2 + FMA;
the AVX2 path is the AVX-512 algorithm 8 lanes wide). Timings against XLA per path:
`python -m benchmarks.cpu_attention_paths`, benchmarks/README.md. Differentiable: derivatives go
through `reference` (XLA ops).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from mmjax.kernels.cpu_library import VMAP, available, enabled

_TARGETS = {jnp.dtype(jnp.float32): "mmjax_decode_attention_f32", jnp.dtype(jnp.bfloat16): "mmjax_decode_attention_bf16",
            jnp.dtype(jnp.int8): "mmjax_decode_attention_s8",
            jnp.dtype(jnp.float8_e4m3fn): "mmjax_decode_attention_f8e4m3fn"}
_WRITE_TARGETS = {d: t.replace("attention_", "attention_write_") for d, t in _TARGETS.items()}
_PREFILL_TARGETS = {d: t.replace("decode_", "prefill_") for d, t in _TARGETS.items()}
_SCALED = {jnp.dtype(jnp.int8), jnp.dtype(jnp.float8_e4m3fn)}     # caches stored with per-token scales
_SCALE_DTYPE = jnp.dtype(jnp.bfloat16)


def covers(kts: list, vs: list, scales: tuple | None = None) -> bool:
    """Does the kernel take attention over these cache segments here? (trace time: `enabled()`;
    f32 or bf16 segments, all of one dtype, or int8 / fp8 (e4m3) segments with their bf16 scales)"""
    dtypes = {jnp.dtype(x.dtype) for x in (*kts, *vs)}
    if len(dtypes) != 1 or not enabled():
        return False
    (dtype,) = dtypes
    if dtype in _SCALED:
        return scales is not None and {jnp.dtype(x.dtype) for x in (*scales[0], *scales[1])} == {_SCALE_DTYPE}
    return dtype in _TARGETS and scales is None


def reference(qn: jax.Array, kts: list, vs: list, lo: jax.Array, hi: jax.Array, scale: float,
              scales: tuple | None = None, slots: jax.Array | None = None, pages: jax.Array | None = None) -> jax.Array:
    """What the kernels compute, in XLA ops (their derivative rule, and the tests' reference):
    qn [b, kvh, n, hd]; kts K^T segments [slots, kvh, hd, L_i]; vs V segments [slots, kvh, L_i, hd];
    scales (an int8 / fp8 cache): (K scale segments, V scale segments) [slots, kvh, L_i], x ~= q * scale;
    row i reads cache row i, or slots[i] (a slot outside the cache: zeros); lo, hi [b]: row i's
    queries see the cache indexes [lo_i, hi_i), or [b, t] (prefill): query j of row i, of token
    j // (n / t), sees [lo_it, hi_it) -> f32 [b, kvh, n, hd] (zeros for a query that sees nothing).
    pages: a paged cache's page table [cache rows, max_pages] (kts / vs / scales: the one pool
    segment): cache row r is the pool's pages pages[r] in order (`kv_cache.read_pages`)."""
    b, _, n, _ = qn.shape
    ok = jnp.ones((b,), bool)
    rows_of = kts[0].shape[0] if pages is None else pages.shape[0]
    if slots is None:
        rows = lambda x: x[:b]                                                    # noqa: E731
    else:
        ok = (slots >= 0) & (slots < rows_of)
        rows = lambda x: x[jnp.clip(slots, 0, x.shape[0] - 1)]                  # noqa: E731
    if pages is not None:
        from mmjax.models.nn.kv_cache import read_pages
        sc = None if scales is None else (scales[0][0], scales[1][0])
        kt, v, sc = read_pages(kts[0], vs[0], sc, rows(pages))
        kts, vs, scales = [kt], [v], None if sc is None else ([sc[0]], [sc[1]])
        rows = lambda x: x                                                        # noqa: E731
    kt = jnp.concatenate([rows(k) for k in kts], axis=3).astype(jnp.float32)    # [b, kvh, hd, T]
    v = jnp.concatenate([rows(x) for x in vs], axis=2).astype(jnp.float32)      # [b, kvh, T, hd]
    if scales is not None:
        ks, vsc = (jnp.concatenate([rows(x) for x in part], axis=2).astype(jnp.float32) for part in scales)
        kt, v = kt * ks[:, :, None, :], v * vsc[..., None]
    s = jnp.einsum("bknd,bkdt->bknt", qn.astype(jnp.float32), kt) * scale
    if lo.ndim == 1:
        lo, hi = lo[:, None], hi[:, None]                                       # [b, 1]: every query
    else:
        lo, hi = jnp.repeat(lo, n // lo.shape[1], axis=1), jnp.repeat(hi, n // hi.shape[1], axis=1)
    idx = jnp.arange(kt.shape[3])
    visible = (idx >= lo[..., None]) & (idx < hi[..., None]) & ok[:, None, None]   # [b, n or 1, T]
    s = jnp.where(visible[:, None], s, -jnp.inf)
    top = s.max(axis=3, keepdims=True)
    w = jnp.exp(s - jnp.where(jnp.isfinite(top), top, 0.0))
    total = w.sum(axis=3, keepdims=True)
    return jnp.einsum("bknt,bktd->bknd", w, v) / jnp.where(total > 0, total, 1.0)


def _table(pages: jax.Array | None) -> list:
    """The page table operand a paged call passes ahead of its pool ([] for the slot layout)."""
    return [] if pages is None else [pages.astype(jnp.int32)]


def _check_paged(kts: list, pages: jax.Array | None) -> None:
    if pages is not None and (len(kts) != 1 or pages.ndim != 2):
        raise ValueError("a paged cache is one pool segment and a page table [cache rows, max_pages]")


@functools.partial(jax.custom_jvp, nondiff_argnums=(5,))
def _attend(qn, kts, vs, lo, hi, scale, scales, pages):
    target = _TARGETS[jnp.dtype(kts[0].dtype)]
    extra = [] if scales is None else [*scales[0], *scales[1]]
    return jax.ffi.ffi_call(target, jax.ShapeDtypeStruct(qn.shape, jnp.float32), vmap_method=VMAP)(
        qn.astype(jnp.float32), lo.astype(jnp.int32), hi.astype(jnp.int32), *_table(pages), *kts, *vs, *extra,
        scale=np.float32(scale))


@_attend.defjvp
def _attend_jvp(scale, primals, tangents):
    qn, kts, vs, lo, hi, scales, pages = primals
    _, tangent = jax.jvp(lambda qn, kts, vs, lo, hi, scales, pages: reference(qn, kts, vs, lo, hi, scale, scales,
                                                                              pages=pages),
                         primals, tangents)
    return _attend(qn, kts, vs, lo, hi, scale, scales, pages), tangent


def decode_attention(qn: jax.Array, kts: list, vs: list, lo: jax.Array, hi: jax.Array, *, scale: float,
                     scales: tuple | None = None, pages: jax.Array | None = None) -> jax.Array:
    """Attention of one token per row over rows [0, b) of a segmented cache, each row over its own
    keys. qn [b, kvh, n, hd] (n queries per KV head: the GQA group); kts: K^T segments [slots,
    kvh, hd, L_i]; vs: V segments [slots, kvh, L_i, hd] (f32, bf16, int8 or fp8 e4m3, slots >= b),
    covering cache indexes [0, sum L_i) in order; scales (int8 / fp8 only): (K scale segments, V scale segments)
    bf16 [slots, kvh, L_i] (`mmjax.models.text.kv_quant`: scores times the key scales, softmax
    weights times the value scales); lo, hi [b] int32: row i sees indexes [lo_i, hi_i) (clipped
    to the cache). Returns f32 [b, kvh, n, hd] = softmax(scale q K^T) V over those keys; zeros
    for a row that sees nothing. pages: a paged cache's page table [cache rows >= b, max_pages]
    int32 (kts / vs / scales then one pool segment each, [num_pages, ..., page_size, ...]; an
    entry outside the pool reads its last page: only masked positions may map there)."""
    if not available():
        raise RuntimeError("mmjax's CPU kernels are unavailable (see the warning); use covers() first")
    _check_paged(kts, pages)
    scales = None if scales is None else (list(scales[0]), list(scales[1]))
    return _attend(qn, list(kts), list(vs), lo, hi, float(scale), scales, pages)


def write_reference(kts: list, vs: list, scales: tuple | None, k: jax.Array, v: jax.Array, new_scales: tuple | None,
                    pos: jax.Array, pages: jax.Array | None = None) -> tuple[list, list, tuple | None]:
    """The cache after row i's new token is written at index pos_i of cache row i, in XLA ops
    (what `decode_attention_write` writes; its derivative rule and the tests' reference): k, v
    [b, kvh, hd] in the cache's dtype, new_scales (K, V) bf16 [b, kvh] for an int8 / fp8 cache;
    an index outside the segments writes nothing; pages: a paged cache's table, the token going
    to (page, offset) `kv_cache.page_slots` (none: dropped). Returns (kts, vs, scales) as given."""
    rows, pos = jnp.arange(pos.shape[0])[:, None], pos[:, None]
    if pages is not None:
        from mmjax.models.nn.kv_cache import page_slots
        rows, pos = page_slots(pages, rows[:, 0], pos, vs[0].shape[2], vs[0].shape[0])
    one = lambda x: None if x is None else tuple(s[:, None] for s in x)          # noqa: E731
    return kv_write_reference(kts, vs, scales, k[:, None], v[:, None], one(new_scales), rows, pos)


@functools.partial(jax.custom_jvp, nondiff_argnums=(9,))
def _write_attend(qn, k, v, new_scales, kts, vs, scales, lo, hi, scale, pos, pages):
    target = _WRITE_TARGETS[jnp.dtype(kts[0].dtype)]
    segments = [*kts, *vs] + ([] if scales is None else [*scales[0], *scales[1]])
    news = [k, v] + ([] if new_scales is None else list(new_scales))
    table = _table(pages)
    first = 4 + len(news) + len(table)             # operand index of the first segment
    out, *segs = jax.ffi.ffi_call(
        target, [jax.ShapeDtypeStruct(qn.shape, jnp.float32)] + [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in segments],
        input_output_aliases={first + i: 1 + i for i in range(len(segments))}, vmap_method=VMAP)(
        qn.astype(jnp.float32), lo.astype(jnp.int32), hi.astype(jnp.int32), pos.astype(jnp.int32), *news, *table,
        *segments, scale=np.float32(scale))
    n = len(kts)
    return out, segs[:n], segs[n:2 * n], None if scales is None else (segs[2 * n:3 * n], segs[3 * n:])


@_write_attend.defjvp
def _write_attend_jvp(scale, primals, tangents):
    def unfused(qn, k, v, new_scales, kts, vs, scales, lo, hi, pos, pages):
        kts, vs, scales = write_reference(kts, vs, scales, k, v, new_scales, pos, pages)
        return reference(qn, kts, vs, lo, hi, scale, scales, pages=pages), kts, vs, scales
    _, tangent = jax.jvp(unfused, primals, tangents)
    return _write_attend(*primals[:9], scale, *primals[9:]), tangent


def decode_attention_write(qn: jax.Array, k: jax.Array, v: jax.Array, kts: list, vs: list, lo: jax.Array,
                           hi: jax.Array, pos: jax.Array, *, scale: float, scales: tuple | None = None,
                           new_scales: tuple | None = None,
                           pages: jax.Array | None = None) -> tuple[jax.Array, list, list, tuple | None]:
    """`decode_attention` after writing each row's new token into the cache, in the same call:
    k, v [b, kvh, hd] (the cache's dtype; an int8 / fp8 cache's new_scales: (K, V) bf16 [b, kvh])
    go to cache index pos_i [b] of cache row i (nothing where pos_i is outside the segments, or
    with `pages` outside the row's pages or on an unused entry), in place: the segments are aliased to the
    results (a donated cache is updated without a copy). Returns (out f32 [b, kvh, n, hd], kts,
    vs, scales) with the written segments. On the CPU this replaces the step's scatter of every
    segment (a handful of small XLA ops per segment and layer) with a store of the one position."""
    if not available():
        raise RuntimeError("mmjax's CPU kernels are unavailable (see the warning); use covers() first")
    _check_paged(kts, pages)
    scales = None if scales is None else (list(scales[0]), list(scales[1]))
    new_scales = None if new_scales is None else (new_scales[0], new_scales[1])
    return _write_attend(qn, k, v, new_scales, list(kts), list(vs), scales, lo, hi, float(scale), pos, pages)


@functools.partial(jax.custom_jvp, nondiff_argnums=(6,))
def _prefill_attend(qn, kts, vs, lo, hi, slots, scale, scales, pages):
    target = _PREFILL_TARGETS[jnp.dtype(kts[0].dtype)]
    extra = [] if scales is None else [*scales[0], *scales[1]]
    return jax.ffi.ffi_call(target, jax.ShapeDtypeStruct(qn.shape, jnp.float32), vmap_method=VMAP)(
        qn.astype(jnp.float32), lo.astype(jnp.int32), hi.astype(jnp.int32), slots.astype(jnp.int32), *_table(pages),
        *kts, *vs, *extra, scale=np.float32(scale))


@_prefill_attend.defjvp
def _prefill_attend_jvp(scale, primals, tangents):
    qn, kts, vs, lo, hi, slots, scales, pages = primals
    _, tangent = jax.jvp(lambda qn, kts, vs, scales: reference(qn, kts, vs, lo, hi, scale, scales, slots, pages),
                         (qn, kts, vs, scales), (tangents[0], tangents[1], tangents[2], tangents[6]))
    return _prefill_attend(qn, kts, vs, lo, hi, slots, scale, scales, pages), tangent


def prefill_attention(qn: jax.Array, kts: list, vs: list, lo: jax.Array, hi: jax.Array, slots: jax.Array, *,
                      scale: float, scales: tuple | None = None, pages: jax.Array | None = None) -> jax.Array:
    """Attention of t new tokens per row, each query over its own keys of cache row slots_i:
    qn [b, kvh, t * g, hd] (query j is token j // g's), lo, hi [b, t] int32 (token j sees cache
    indexes [lo_ij, hi_ij): causal, a sliding window), slots [b] int32 (outside the cache, or the
    page table: zeros); segments, scales and pages as `decode_attention`. Returns f32 [b, kvh,
    t * g, hd]. One task per (row, KV head, 8 queries; 6 on the AVX2 path): the prefill's
    attention without XLA's per-segment conds, masks over the whole segment and full
    (non-causal) score blocks."""
    if not available():
        raise RuntimeError("mmjax's CPU kernels are unavailable (see the warning); use covers() first")
    _check_paged(kts, pages)
    scales = None if scales is None else (list(scales[0]), list(scales[1]))
    return _prefill_attend(qn, list(kts), list(vs), lo, hi, slots, float(scale), scales, pages)


def dense_covers(q: jax.Array, k: jax.Array, v: jax.Array) -> bool:
    """Does `dense_attention` take this full (bidirectional) attention here? (trace time: a SIMD
    path of the kernels, f32 / bf16 operands)"""
    return (enabled()
            and all(jnp.dtype(x.dtype) in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)) for x in (q, k, v)))


def _dense_reference(q, k, v, lengths, scale):
    from mmjax.attention.reference import reference_attention
    return reference_attention(q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32),
                               lengths=lengths, scale=scale)


@functools.partial(jax.custom_jvp, nondiff_argnums=(4,))
def _dense(q, k, v, lengths, scale):
    return jax.ffi.ffi_call("mmjax_dense_attention_f32", jax.ShapeDtypeStruct(q.shape, jnp.float32),
                            vmap_method=VMAP)(q, k, v, lengths, scale=np.float32(scale))


@_dense.defjvp
def _dense_jvp(scale, primals, tangents):
    q, k, v, lengths = primals
    _, tangent = jax.jvp(lambda q, k, v: _dense_reference(q, k, v, lengths, scale), (q, k, v), tangents[:3])
    return _dense(q, k, v, lengths, scale), tangent


def dense_attention(q: jax.Array, k: jax.Array, v: jax.Array, lengths: jax.Array | None = None, *,
                    scale: float | None = None) -> jax.Array:
    """Full (bidirectional) attention, one kernel call: q [B, Sq, H, D], k, v [B, Sk, Hkv, D]
    (H % Hkv == 0, GQA as `mmjax.attention`), lengths [B] (row b's queries see keys [0, lengths_b);
    None: all) -> [B, Sq, H, D] in q.dtype (zeros for a row that sees no key); computed in f32.
    32 queries of a (row, head) on the vector lanes: a key's 32 scores are two vectors, the softmax
    over keys elementwise, K and V read as they lie (no transposes). Differentiable: derivatives
    go through `mmjax.attention.reference_attention`."""
    if not available():
        raise RuntimeError("mmjax's CPU kernels are unavailable (see the warning); use dense_covers() first")
    b, _, _, d = q.shape
    scale = d ** -0.5 if scale is None else float(scale)
    lengths = (jnp.full((b,), k.shape[1], jnp.int32) if lengths is None
               else jnp.broadcast_to(jnp.asarray(lengths), (b,)).astype(jnp.int32))
    f32 = lambda x: x.astype(jnp.float32)                                     # noqa: E731
    return _dense(f32(q), f32(k), f32(v), lengths, scale).astype(q.dtype)


def kv_write_reference(kts: list, vs: list, scales: tuple | None, k: jax.Array, v: jax.Array,
                       new_scales: tuple | None, rows: jax.Array, idx: jax.Array) -> tuple[list, list, tuple | None]:
    """What `kv_write` writes, in XLA ops (its derivative rule, the tests' reference)."""
    t = idx.shape[1]
    out_k, out_v, out_ks, out_vs, start = [], [], [], [], 0
    for i, (kt, vv) in enumerate(zip(kts, vs)):
        size = vv.shape[2]
        j = idx - start
        j = jnp.where((j >= 0) & (j < size), j, size + jnp.arange(t))              # past the segment: dropped
        r = jnp.where((rows >= 0) & (rows < kt.shape[0]), rows, kt.shape[0])       # past the cache: dropped
        put = dict(mode="drop")
        out_k.append(kt.at[r, :, :, j].set(k.astype(kt.dtype), **put))
        out_v.append(vv.at[r, :, j].set(v.astype(vv.dtype), **put))
        if scales is not None:
            out_ks.append(scales[0][i].at[r, :, j].set(new_scales[0], **put))
            out_vs.append(scales[1][i].at[r, :, j].set(new_scales[1], **put))
        start += size
    return out_k, out_v, None if scales is None else (out_ks, out_vs)


@jax.custom_jvp
def _kv_write(kts, vs, scales, k, v, new_scales, rows, idx):
    segments = [*kts, *vs] + ([] if scales is None else [*scales[0], *scales[1]])
    news = [k, v] + ([] if new_scales is None else list(new_scales))
    first = 2 + len(news)             # operand index of the first segment
    segs = jax.ffi.ffi_call(
        "mmjax_kv_write", [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in segments],
        input_output_aliases={first + i: i for i in range(len(segments))}, vmap_method=VMAP)(
        rows.astype(jnp.int32), idx.astype(jnp.int32), *news, *segments, nseg=np.int64(len(kts)))
    n = len(kts)
    return list(segs[:n]), list(segs[n:2 * n]), None if scales is None else (list(segs[2 * n:3 * n]), list(segs[3 * n:]))


@_kv_write.defjvp
def _kv_write_jvp(primals, tangents):
    _, tangent = jax.jvp(kv_write_reference, primals, tangents)
    return _kv_write(*primals), tangent


def kv_write(kts: list, vs: list, k: jax.Array, v: jax.Array, rows: jax.Array, idx: jax.Array, *,
             scales: tuple | None = None, new_scales: tuple | None = None) -> tuple[list, list, tuple | None]:
    """Write a prefill's new K, V [b, t, kvh, hd] (the cache's dtype; an int8 / fp8 cache's
    new_scales (K, V) bf16 [b, t, kvh]) into the segments, in place, one call: token (i, j) goes
    to cache row rows_ij at cache index idx_ij (rows, idx [b, t] int32; a row past the cache or an
    index outside the segments writes nothing). Returns (kts, vs, scales) as given, updated.
    XLA's scatter walks every update for every segment and transposes K into K^T first."""
    if not available():
        raise RuntimeError("mmjax's CPU kernels are unavailable (see the warning); use enabled() first")
    scales = None if scales is None else (list(scales[0]), list(scales[1]))
    return _kv_write(list(kts), list(vs), scales, k, v, new_scales, rows, idx)
