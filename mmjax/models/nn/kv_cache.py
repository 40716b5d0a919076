"""The KV cache and the attention over it (the code under `Attention`; nothing else reads it).

Three layouts, one entry per layer that owns K/V:

- segments (full-attention and windowed layers): a {"k", "v"} dict holding the sequence axis cut
  into segments (`kv_segments`: on the CPU 256 positions each up to 1024, then doubling), K
  `[slots, kv_heads, head_dim, segment_len]` and V `[slots, kv_heads, segment_len, head_dim]`.
  Attention takes `kv_len`, a traced count of the cache positions in use, and skips (`lax.cond`)
  every segment from kv_len on: one compiled step serves every sequence length and pays for the
  longest one in segment steps (a window slice of one `[.., max_len, ..]` array was a copy per
  layer and step: XLA:CPU materialises slices that feed a dot). Head-major: a slot's segment of
  one KV head is one contiguous block, K stored transposed ([head_dim, segment_len]) and V not
  ([segment_len, head_dim]), so both of decode attention's reductions run over a non-minor axis
  and prefill's dots read plain row-major operands (`cache_attention`).
- ring (sliding-window layers that keep only their window, Gemma 3): one segment of R = window +
  max_chunk - 1 positions (cache index i lives at i mod R), so a call writing max_chunk tokens
  still leaves every query its full window: memory O(window), not O(max_len) (`ring_key_index`,
  `ring_visible`, `ring_attention`).
- paged (full-attention and windowed layers of a paged engine, serving/pages.py): the segments
  layout with one segment whose rows are pages, K `[num_pages, kv_heads, head_dim, page_size]`,
  V `[num_pages, kv_heads, page_size, head_dim]`, and the step's page table `[cache rows,
  max_pages]` (AttentionMetadata.pages) saying which pages hold each cache row (`page_slots`,
  `read_pages`). The CPU kernels read the table in place; XLA's path gathers runs of pages
  (`page_cuts`).

int8 / fp8 caches add per-(token, KV head) scales "k_scale" / "v_scale" (nn/kv_quant.py).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from mmjax.kernels import cpu_attention, cpu_library
from mmjax.models.nn.kv_quant import dequantize, is_quantized, layer_scales, operand, quantize, zero_scales
from mmjax.models.nn.metadata import MaskSpec

KVCache = list  # per layer {"k": [[slots, kv_heads, head_dim, len_i], ...],
#                              "v": [[slots, kv_heads, len_i, head_dim], ...],
#      int8 / fp8 caches also "k_scale", "v_scale": [[slots, kv_heads, len_i], ...] (kv_quant)}
KV_SEGMENT = 256     # the CPU ladder's segment (backend.Tuning.kv_segment_ladder; backend imports no model code)
# cache_attention avoids dots for <= SMALL_N queries per KV head when a batched dot would make
# >= SMALL_N_MIN_CALLS small matmul calls (one per row and KV head)
SMALL_N, SMALL_N_MIN_CALLS = 8, 32


def kv_segments(max_len: int, segment: int | None = None, fine: int | None = None) -> tuple[int, ...]:
    """Segment lengths cutting [0, max_len): `fine` segments of `segment` positions (the
    granularity decode pays in up to fine * segment), then each one as long as all before it,
    the last cut at max_len. The count grows with log(max_len): every segment costs a scatter
    and a cond per layer and step (32k positions: 13 segments). segment / fine default to the
    platform's (`backend.Tuning.kv_segment_ladder`: 256 x 4 on the CPU, 512 x 1 on GPUs) being
    compiled for (`backend.current_platform`: the runner builds its cache in `compiling_for`)."""
    if segment is None or fine is None:
        from mmjax.backend import tuning
        default_segment, default_fine = tuning().kv_segment_ladder
        segment, fine = segment or default_segment, fine or default_fine
    out, total = [], 0
    while total < max_len:
        n = min(segment if len(out) < fine else total, max_len - total)
        out.append(n)
        total += n
    return tuple(out)


def kv_layer(num_slots: int, kv_heads: int, head_dim: int, cuts, dtype) -> dict:
    """One layer's zero cache over segments of lengths `cuts`: {"k": [[slots, kv_heads, head_dim,
    len]], "v": [[slots, kv_heads, len, head_dim]]}, plus "k_scale" / "v_scale" [[slots, kv_heads,
    len]] when `dtype` is quantized (int8 / fp8: mmjax.models.text.kv_quant)."""
    layer = {"k": [jnp.zeros((num_slots, kv_heads, head_dim, n), dtype) for n in cuts],
             "v": [jnp.zeros((num_slots, kv_heads, n, head_dim), dtype) for n in cuts]}
    if is_quantized(dtype):
        layer["k_scale"] = zero_scales([(n,) for n in cuts], num_slots, kv_heads)
        layer["v_scale"] = zero_scales([(n,) for n in cuts], num_slots, kv_heads)
    return layer


def allocate_cache(make, sharding=None):
    """make() -> a zero cache pytree; with `sharding` (one Sharding, or a tree of them) each
    array is allocated directly in its (possibly sharded) layout, not on one device first."""
    if sharding is None:
        return make()
    shapes = jax.eval_shape(make)
    if not isinstance(sharding, jax.sharding.Sharding):
        return jax.tree.map(lambda s, sh: jnp.zeros(s.shape, s.dtype, device=sh), shapes, sharding)
    return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype, device=sharding), shapes)


def _when(pred, fn, otherwise, *args):
    """fn(*args) if pred else otherwise(*args): a Python branch for a concrete pred, else
    lax.cond (XLA runs only the taken branch)."""
    if isinstance(pred, (bool, np.bool_)):
        return (fn if pred else otherwise)(*args)
    return jax.lax.cond(pred, fn, otherwise, *args)


def visible_keys(key_index: jax.Array, q_index: jax.Array, mask: MaskSpec | None,
                 starts: jax.Array, *, window_over_spans: bool = False) -> jax.Array:
    """[b, t, len] bool: may the query at cache index q_index [b, t] read the key at cache index
    key_index [len]? Causal (j <= i), within the sliding window, or in the query's own span
    (the span's keys are this call's tokens: key j is new token j - starts[b] of
    `mask.span_keys`). window_over_spans: the window also bounds span keys, (causal | span) &
    window (Gemma 4's order); default (causal & window) | span."""
    vis = key_index[None, None, :] <= q_index[:, :, None]
    if mask is None:
        return vis
    if mask.sliding_window is not None and not window_over_spans:
        vis &= q_index[:, :, None] - key_index[None, None, :] < mask.sliding_window
    if mask.spans is not None:
        keys = mask.span_keys
        u = keys.shape[1]
        new = key_index[None, :] - starts[:, None]                          # [b, len]
        in_call = (new >= 0) & (new < u)
        kspan = jnp.where(in_call, jnp.take_along_axis(keys, jnp.clip(new, 0, u - 1), axis=1), -1)
        qspan = mask.spans[:, :, None]
        vis |= (qspan >= 0) & (qspan == kspan[:, None, :])
    if mask.sliding_window is not None and window_over_spans:
        vis &= q_index[:, :, None] - key_index[None, None, :] < mask.sliding_window
    if mask.chunk is not None:
        vis &= key_index[None, None, :] >= (q_index[:, :, None] // mask.chunk) * mask.chunk
    return vis


def cache_attention(q: jax.Array, kts: list, vs: list, q_index: jax.Array, kv_len,
                    slots: jax.Array | None = None, *, mask: MaskSpec | None = None,
                    starts: jax.Array | None = None, reduce_small: bool = False, scale: float | None = None,
                    window_over_spans: bool = False, scales: tuple | None = None,
                    pages: jax.Array | None = None) -> jax.Array:
    """Attention of new queries over a cache given as consecutive segments.

    q [b, t, heads, hd]; kts: K segments transposed [slots, kv_heads, hd, len_i], vs: V segments
    [slots, kv_heads, len_i, hd], covering cache indexes [0, sum len_i); query row i reads cache
    row slots[i] (None: row i, the decode layout); q_index [b, t] = cache index of each query;
    kv_len (int or traced int32 scalar) > every q_index that matters: segments starting at or
    after it are not computed. Key j is visible to a query at index i iff `visible_keys` says so
    (causal at least, so stale entries past a sequence's end are never read; `window_over_spans`
    is passed on); starts [b] is each row's first new cache index (for spans). Scores are scaled
    by `scale` (None: 1/sqrt(head_dim)). Returns [b, t, heads, hd]; a query with no visible key
    gets zeros.

    Each segment yields (max, sum of exp(s - max), exp(s - max) V) and the segments are merged
    with the usual rescaling, as flash attention merges key blocks. `reduce_small` (a backend
    choice, mmjax.backend): with few queries per KV head (n = t * group <= SMALL_N: decode)
    both products become broadcast-multiply-reduce over a non-minor axis (scores sum K^T [hd,
    len] rows, out sums V [len, hd] rows), which the CPU decode step hands to YNN's reductions,
    where a batched dot makes one small matmul call per (row, KV head): 128 per segment at 16
    rows, slower (benchmarks/README.md, "Figures behind code choices"). Below SMALL_N_MIN_CALLS
    such calls the dots stay (a reduction call has the larger fixed cost). Otherwise dots on the
    same layouts: scores [n, len] = q K^T and out [n, hd] = P V, both plain row-major operands.

    scales: (K scale segments, V scale segments) [slots, kv_heads, len_i] of an int8 / fp8 cache
    (`kv_quant.layer_scales`): the quantized segments enter the dots as they are (converted to
    q's dtype in the operand), the scores are multiplied by the key scales and the softmax
    weights by the value scales: no dequantized copy of the cache.

    pages: the page table [cache rows, max_pages] of a paged layer (kts / vs then hold the one
    page pool, K [num_pages, kv_heads, hd, page_size], V [num_pages, kv_heads, page_size, hd]):
    the CPU kernels read each row's pages in place (`attention_kernel`: "cpu", "cpu_prefill"),
    on a GPU the paged Pallas kernel ("gpu_paged"); XLA's path (the oracle) reads runs of a row's
    pages (`page_cuts`), each gathered inside its lax.cond branch, so only the pages below kv_len
    are read.
    """
    b, t, h, hd = q.shape
    kvh = kts[0].shape[1]
    g = h // kvh
    n = t * g
    # a quantized cache always takes the reductions when they apply: they convert int8 / fp8 inside
    # the fused multiply-reduce, where XLA:CPU's dot would first write a converted copy of the segment
    small = reduce_small and n <= SMALL_N and (b * kvh >= SMALL_N_MIN_CALLS or scales is not None)
    qn = q.reshape(b, t, kvh, g, hd).transpose(0, 2, 1, 3, 4).reshape(b, kvh, n, hd)
    kernel = attention_kernel(t, slots, mask, kts, vs, scales, pages)
    if kernel == "gpu_paged":
        out = _paged_gpu(qn, kts[0], vs[0], pages, slots, q_index, kv_len, mask, scale, scales)
        return out.reshape(b, kvh, t, g, hd).transpose(0, 2, 1, 3, 4).reshape(b, t, h, hd).astype(q.dtype)
    if kernel == "gpu":
        return _ragged_decode(qn, kts, vs, q_index[:, 0], kv_len, mask, scale,
                              scales).reshape(b, 1, h, hd).astype(q.dtype)
    if kernel == "cpu":
        return _cpu_decode(qn, kts, vs, q_index[:, 0], kv_len, mask, scale,
                           scales, pages).reshape(b, 1, h, hd).astype(q.dtype)
    if kernel == "cpu_prefill":
        lo, hi = _visible_range(q_index, kv_len, mask)
        out = cpu_attention.prefill_attention(qn, kts, vs, lo, hi, jnp.arange(b) if slots is None else slots,
                                              scale=1 / np.sqrt(hd) if scale is None else scale, scales=scales,
                                              pages=pages)
        return out.reshape(b, kvh, t, g, hd).transpose(0, 2, 1, 3, 4).reshape(b, t, h, hd).astype(q.dtype)
    if starts is None:
        starts = q_index[:, 0]

    # decode: rows [0, b) (a no-op slice when b == slots); prefill: gather its slots
    rows = (lambda a: a[:b]) if slots is None else (lambda a: jnp.take(a, slots, axis=0, mode="clip"))
    if pages is None:
        parts = [(kt, v, None if scales is None else (scales[0][i], scales[1][i]))
                 for i, (kt, v) in enumerate(zip(kts, vs))]
        sizes = [v.shape[2] for v in vs]

        def fetch(kt, v, sc):
            return rows(kt), rows(v), jax.tree.map(rows, sc)
    else:
        table, page = rows(pages), vs[0].shape[2]
        pool_sc = None if scales is None else (scales[0][0], scales[1][0])
        cuts = page_cuts(pages.shape[1], page)
        parts = [(kts[0], vs[0], pool_sc, table[:, a:a + n]) for a, n in cuts]
        sizes = [n * page for _, n in cuts]

        def fetch(kt, v, sc, tab):
            return read_pages(kt, v, sc, tab)

    def segment(part, start, top, total, out):
        kt, v, sc = fetch(*part)
        size = v.shape[2]
        if small:
            s = (kt[:, :, None].astype(jnp.float32) * qn[..., None].astype(jnp.float32)).sum(axis=3)
        else:
            s = jnp.einsum("bknd,bkds->bkns", qn, operand(kt, qn.dtype), preferred_element_type=jnp.float32)
        if sc is not None:                                    # int8 / fp8: scale per key, not per value
            s = s * sc[0].astype(jnp.float32)[:, :, None, :]
        # scores scaled by 1/sqrt(hd), or by `scale` (None: the former; 1.0: no op at all)
        if scale is None:
            s = s / np.sqrt(hd)                                       # [b, kvh, n, len]
        elif scale != 1.0:
            s = s * scale
        visible = visible_keys(start + jnp.arange(size), q_index, mask, starts,
                               window_over_spans=window_over_spans)  # [b, t, len]
        s = jnp.where(visible[:, None, :, None, :], s.reshape(b, kvh, t, g, size), -jnp.inf)
        s = s.reshape(b, kvh, n, size)
        new_top = jnp.maximum(top, s.max(axis=3))             # [b, kvh, n]; -inf: nothing visible yet
        shift = jnp.where(jnp.isfinite(new_top), new_top, 0.0)
        w = jnp.exp(s - shift[..., None])
        wv = w if sc is None else w * sc[1].astype(jnp.float32)[:, :, None, :]
        if small:
            pv = (wv[..., None] * v[:, :, None].astype(jnp.float32)).sum(axis=3)
        else:
            dt = v.dtype if sc is None else qn.dtype
            pv = jnp.einsum("bkns,bksd->bknd", wv.astype(dt), operand(v, dt), preferred_element_type=jnp.float32)
        rescale = jnp.exp(top - shift)                        # 0 while nothing was visible
        return new_top, total * rescale + w.sum(axis=3), out * rescale[..., None] + pv

    # running (max, sum of exp, exp-weighted V) carried through the segments; a skipped segment
    # passes it on unchanged
    carry = (jnp.full((b, kvh, n), -jnp.inf), jnp.zeros((b, kvh, n)), jnp.zeros((b, kvh, n, hd)))
    start = 0
    for part, size in zip(parts, sizes):
        carry = _when(start < kv_len, lambda part, *c, start=start: segment(part, start, *c),
                      lambda part, *c: c, part, *carry)
        start += size
    _, total, out = carry
    out = out / jnp.where(total > 0, total, 1.0)[..., None]
    return out.reshape(b, kvh, t, g, hd).transpose(0, 2, 1, 3, 4).reshape(b, t, h, hd).astype(q.dtype)


def attention_kernel(t: int, slots, mask: MaskSpec | None, kts: list, vs: list, scales: tuple | None,
                     pages: jax.Array | None = None) -> str | None:
    """Which kernel takes this attention (trace time); image runs (spans) always take XLA's
    per-segment path (None). A paged cache (`pages`) where Pallas kernels may run goes to
    "gpu_paged" (mmjax.attention.paged: decode and prefill chunks alike, each query over its
    own causal / window / chunk range of its row's pages, read in place). One new token per row
    over rows [0, b) (decode) of a slot cache goes to "gpu", the ragged Pallas kernel
    (mmjax.attention.decode: no per-segment lax.cond, which a GPU runs as a host sync per
    segment and layer), or "cpu" (mmjax.kernels.cpu_attention) where one covers it; any other
    (prefill: several tokens per row, rows in any slots) to "cpu_prefill", the CPU kernel with
    each query over its own causal (window) range, where one covers it. On the CPU a paged
    cache takes "cpu" / "cpu_prefill" the same way (the CPU kernels read the page table)."""
    from mmjax.attention.decode import supported
    from mmjax.backend import pallas_kernels_enabled
    if mask is not None and mask.spans is not None:
        return None
    if pages is not None and pallas_kernels_enabled() and supported(kts[0].shape[2]):
        return "gpu_paged"
    if t == 1 and slots is None:
        if pages is None and pallas_kernels_enabled() and supported(kts[0].shape[2]):
            return "gpu"
        return "cpu" if cpu_attention.covers(kts, vs, scales) else None
    return "cpu_prefill" if cpu_attention.covers(kts, vs, scales) else None


def _visible_range(q_pos: jax.Array, kv_len, mask: MaskSpec | None) -> tuple[jax.Array, jax.Array]:
    """(lo, hi), each q_pos's shape ([b] decode rows, [b, t] new tokens): the query at cache index
    q_pos reads keys (q_pos - window, q_pos], none if q_pos is at or past kv_len (a parked decode
    row's q_pos is max_len; a prefill bucket's padding tokens sit past the call's end)."""
    return first_visible(q_pos, mask), jnp.where(q_pos < kv_len, q_pos + 1, 0)


def first_visible(q_pos: jax.Array, mask: MaskSpec | None) -> jax.Array:
    """The first cache index the query at q_pos may read: 0, q_pos - window + 1 (sliding window)
    or the start of its attention chunk (chunked attention), whichever is later."""
    lo = jnp.zeros_like(q_pos)
    if mask is not None and mask.sliding_window is not None:
        lo = q_pos - mask.sliding_window + 1
    if mask is not None and mask.chunk is not None:
        lo = jnp.maximum(lo, (q_pos // mask.chunk) * mask.chunk)
    return lo


def _cpu_decode(qn: jax.Array, kts: list, vs: list, q_pos: jax.Array, kv_len, mask: MaskSpec | None,
                scale: float | None, scales: tuple | None = None, pages: jax.Array | None = None) -> jax.Array:
    """qn [b, kvh, g, hd] (one token per row) over rows [0, b) of the segmented (or paged: the
    page table `pages`) cache through the CPU kernel (mmjax.kernels.cpu_attention), each row over
    `_visible_range` -> [b, kvh, g, hd] float32. scales: an int8 / fp8 cache's (K, V) scale segments."""
    lo, hi = _visible_range(q_pos, kv_len, mask)
    return cpu_attention.decode_attention(qn, kts, vs, lo, hi, scale=1 / np.sqrt(qn.shape[-1]) if scale is None else scale,
                                          scales=scales, pages=pages)


def cpu_decode_write(q: jax.Array, k: jax.Array, v: jax.Array, kv: dict, q_pos: jax.Array, kv_len,
                     mask: MaskSpec | None, scale: float | None = None,
                     pages: jax.Array | None = None) -> tuple[jax.Array, dict]:
    """A decode layer's cache write and attention in one CPU kernel call: q [b, 1, h, hd], the
    new k, v [b, 1, kv_heads, hd] written at cache index q_pos [b] of cache rows [0, b) (as
    `scatter_kv`: quantized on write for an int8 / fp8 cache; a paged layer's through its page
    table `pages`), then attended as `_cpu_decode` -> (attention [b, 1, h, hd] in q's dtype, the
    layer's updated cache dict)."""
    b, _, h, hd = q.shape
    kvh = kv["k"][0].shape[1]
    kq, vq, ks, vs = quantize_kv(kv, k, v)
    lo, hi = _visible_range(q_pos, kv_len, mask)
    out, kts, vss, scales = cpu_attention.decode_attention_write(
        q.reshape(b, kvh, h // kvh, hd), kq[:, 0], vq[:, 0], kv["k"], kv["v"], lo, hi, q_pos,
        scale=1 / np.sqrt(hd) if scale is None else scale,
        scales=layer_scales(kv), new_scales=None if ks is None else (ks[:, 0], vs[:, 0]), pages=pages)
    new = {"k": kts, "v": vss}
    if scales is not None:
        new["k_scale"], new["v_scale"] = scales
    return out.reshape(b, 1, h, hd).astype(q.dtype), new


def _ragged_decode(qn: jax.Array, kts: list, vs: list, q_pos: jax.Array, kv_len, mask: MaskSpec | None,
                   scale: float | None, scales: tuple | None = None) -> jax.Array:
    """qn [b, kvh, g, hd] (one token per row) over rows [0, b) of the segmented cache, each row
    reading keys (q_pos - window, q_pos] only -> [b, kvh, g, hd] float32. scales: an int8 / fp8
    cache's scale segments (the kernel applies them to scores and weights)."""
    from mmjax.attention.decode import ragged_decode_attention
    hd = qn.shape[-1]
    lo = first_visible(q_pos, mask)
    if isinstance(kv_len, int):      # a static length: the segments from it on are not passed at all
        ends = np.cumsum([v.shape[2] for v in vs])
        keep = int(np.searchsorted(ends, kv_len)) + 1
        kts, vs = kts[:keep], vs[:keep]
        scales = None if scales is None else (scales[0][:keep], scales[1][:keep])
    hi = jnp.where(q_pos < kv_len, q_pos + 1, 0)     # a parked row (q_pos = max_len) reads nothing
    _, total, out = ragged_decode_attention(qn, kts, vs, lo, hi,
                                            scale=1 / np.sqrt(hd) if scale is None else scale, scales=scales)
    return out / jnp.where(total > 0, total, 1.0)[..., None]


def _paged_gpu(qn: jax.Array, kt: jax.Array, v: jax.Array, pages: jax.Array, slots: jax.Array | None,
               q_index: jax.Array, kv_len, mask: MaskSpec | None, scale: float | None,
               scales: tuple | None = None) -> jax.Array:
    """qn [b, kvh, t * g, hd] (token-major query rows; q_index [b, t] their cache indexes) over
    the pages of cache rows [0, b) (slots None: decode) or `slots` [b] of a paged layer (pool kt
    [num_pages, kvh, hd, P], v [num_pages, kvh, P, hd], page table `pages`), each query over
    `_visible_range` -> [b, kvh, t * g, hd] float32. scales: the pool's (K, V) scale segments."""
    from mmjax.attention.paged import paged_attention
    b, _, n, hd = qn.shape
    g = n // q_index.shape[1]
    table = pages[:b] if slots is None else jnp.take(pages, slots, axis=0, mode="clip")
    lo, hi = _visible_range(q_index, kv_len, mask)                      # [b, t] each
    return paged_attention(qn, kt, v, table, jnp.repeat(lo, g, axis=1), jnp.repeat(hi, g, axis=1),
                           scale=1 / np.sqrt(hd) if scale is None else scale,
                           scales=None if scales is None else (scales[0][0], scales[1][0]))


def explicit_attention(q: jax.Array, kts: list, vs: list, q_index: jax.Array, kv_len: int,
                       slots: jax.Array | None = None, *, mask: MaskSpec | None = None,
                       starts: jax.Array | None = None, scale: float | None = None,
                       window_over_spans: bool = False, scales: tuple | None = None,
                       cap: float | None = None) -> tuple[jax.Array, jax.Array]:
    """The same attention as `cache_attention` over the first `kv_len` (static) cache positions,
    with the softmax materialised: (out [b, t, heads, hd], probs [b, heads, t, kv_len] float32);
    `cap`: scores soft-capped (Gemma's attn_logit_softcapping).
    For captured layers (research / training), never for serving (a quantized cache, `scales`,
    is dequantized here)."""
    b, t, h, hd = q.shape
    kvh = kts[0].shape[1]
    kt = jnp.concatenate(kts, axis=3)[..., :kv_len]
    v = jnp.concatenate(vs, axis=2)[:, :, :kv_len]
    if scales is not None:
        kt = dequantize(kt, jnp.concatenate(scales[0], axis=2)[..., :kv_len], 2, q.dtype)
        v = dequantize(v, jnp.concatenate(scales[1], axis=2)[..., :kv_len], 3, q.dtype)
    kt, v = (kt[:b], v[:b]) if slots is None else (kt[slots], v[slots])
    kt = jnp.repeat(kt, h // kvh, axis=1)                          # [b, h, hd, len]
    v = jnp.repeat(v, h // kvh, axis=1)                            # [b, h, len, hd]
    s = jnp.einsum("bthd,bhds->bhts", q, kt, preferred_element_type=jnp.float32)
    s = softcap(s / np.sqrt(hd) if scale is None else s * scale, cap)
    vis = visible_keys(jnp.arange(kv_len), q_index, mask, q_index[:, 0] if starts is None else starts,
                       window_over_spans=window_over_spans)
    s = jnp.where(vis[:, None], s, -jnp.inf)
    probs = jax.nn.softmax(s, axis=-1)
    probs = jnp.where(vis[:, None], probs, 0.0)                    # rows with nothing visible: zeros
    out = jnp.einsum("bhts,bhsd->bthd", probs.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return out.astype(q.dtype), probs


def scatter_kv(kv: dict, k: jax.Array, v: jax.Array, q_index: jax.Array, rows: jax.Array,
               pages: jax.Array | None = None) -> dict:
    """Write new K/V [b, t, kv_heads, hd] at cache indexes q_index [b, t] of cache rows `rows`
    [b] (or [b, t]: a row per token, a packed prefill) into the segments of one layer's {"k",
    "v"(, "k_scale", "v_scale")} -> the updated layer dict (an int8 / fp8 cache quantizes on
    write: `kv_quant.quantize`). See the comment in `layer_forward` for the index scheme.
    pages: a paged layer's page table [cache rows, max_pages]: each token goes to (page,
    offset) of the pool (`page_slots`), the one segment's rows being pages."""
    t = k.shape[1]
    if pages is not None:
        rows, q_index = page_slots(pages, rows, q_index, kv["v"][0].shape[2], kv["v"][0].shape[0])
    new = quantize_kv(kv, k, v)
    if cpu_library.enabled():       # one kernel call writes every token once, in place
        kq, vq, ks, vs = new
        scales = layer_scales(kv)
        kts, vss, written = cpu_attention.kv_write(
            kv["k"], kv["v"], kq, vq, jnp.broadcast_to(rows[:, None] if rows.ndim == 1 else rows, q_index.shape),
            q_index, scales=scales, new_scales=None if ks is None else (ks, vs))
        out = {"k": kts, "v": vss}
        if written is not None:
            out["k_scale"], out["v_scale"] = written
        return out
    out, start = {name: [] for name in kv}, 0
    for i, cv in enumerate(kv["v"]):
        size = cv.shape[2]
        idx = q_index - start
        idx = jnp.where((idx >= 0) & (idx < size), idx, size + jnp.arange(t))
        for name, seg in scatter_segment(kv, i, rows, idx, new).items():
            out[name].append(seg)
        start += size
    return out


# ---- the paged layout ----------------------------------------------------------------------------

def page_cuts(max_pages: int, page_size: int) -> list[tuple[int, int]]:
    """(first page, pages) of each segment a paged row is read in: `kv_segments` over the row's
    max_pages * page_size positions, each rounded up to whole pages (the same lax.cond skipping
    and the same log-many segments as the slot layout)."""
    bounds = np.cumsum(kv_segments(max_pages * page_size))
    ends = sorted({min(max_pages, -(-int(x) // page_size)) for x in bounds})
    return [(a, e - a) for a, e in zip([0] + ends[:-1], ends)]


def read_pages(kt: jax.Array, v: jax.Array, sc: tuple | None, table: jax.Array) -> tuple:
    """Pool pages K [num_pages, kvh, hd, P], V [num_pages, kvh, P, hd] (scales [num_pages, kvh,
    P]) of table [b, n] (a page past the pool reads the last page: only masked positions map
    there) -> dense rows (K^T [b, kvh, hd, n * P], V [b, kvh, n * P, hd], scales [b, kvh, n * P])."""
    b, n = table.shape
    kvh, hd, p = kt.shape[1:]
    take = lambda a: jnp.take(a, table, axis=0, mode="clip")               # noqa: E731
    k = take(kt).transpose(0, 2, 3, 1, 4).reshape(b, kvh, hd, n * p)
    vv = take(v).transpose(0, 2, 1, 3, 4).reshape(b, kvh, n * p, hd)
    if sc is not None:
        sc = tuple(take(x).transpose(0, 2, 1, 3).reshape(b, kvh, n * p) for x in sc)
    return k, vv, sc


def dense_rows(kv: dict, pages: jax.Array, slots: jax.Array | None, b: int) -> tuple[list, list, tuple | None]:
    """One paged layer's cache as the slot layout's one-segment rows of batch rows [0, b) (slots
    None) or of cache rows `slots` (kts, vs, scales): the dense view the explicit-softmax paths
    (captured research attention, soft-capped layers) read."""
    table = pages[:b] if slots is None else jnp.take(pages, slots, axis=0, mode="clip")
    scales = layer_scales(kv)
    kt, v, sc = read_pages(kv["k"][0], kv["v"][0], None if scales is None else (scales[0][0], scales[1][0]), table)
    return [kt], [v], None if sc is None else ([sc[0]], [sc[1]])


def page_slots(pages: jax.Array, rows: jax.Array, q_index: jax.Array, page_size: int,
               num_pages: int) -> tuple[jax.Array, jax.Array]:
    """Where cache index q_index [b, t] of cache row rows [b] (or [b, t]) lives in a paged layer:
    (page [b, t], offset [b, t]); a row past the table, a negative index or one past the row's
    max_pages gives page num_pages (past the pool: the write is dropped)."""
    n_rows, max_pages = pages.shape
    rows = jnp.broadcast_to(rows[:, None] if rows.ndim == 1 else rows, q_index.shape)
    pi = q_index // page_size
    ok = (rows >= 0) & (rows < n_rows) & (q_index >= 0) & (pi < max_pages)
    page = pages[jnp.clip(rows, 0, n_rows - 1), jnp.clip(pi, 0, max_pages - 1)]
    return jnp.where(ok, page, num_pages), jnp.mod(q_index, page_size)


def quantize_kv(kv: dict, k: jax.Array, v: jax.Array) -> tuple:
    """New K, V [b, t, kv_heads, hd] in the storage of cache layer `kv`: (k, v, k_scale, v_scale
    [b, t, kv_heads] or None, None when the cache is not quantized)."""
    dtype = kv["k"][0].dtype
    if not is_quantized(dtype):
        return k.astype(dtype), v.astype(dtype), None, None
    (kq, ks), (vq, vs) = quantize(k, dtype), quantize(v, dtype)
    return kq, vq, ks, vs


def scatter_segment(kv: dict, i: int, rows: jax.Array, idx: jax.Array, new: tuple) -> dict:
    """Segment i of cache layer `kv` with `new` (`quantize_kv`) written at rows [b] (or [b, t]:
    a row per token) x idx [b, t] (indexes past the segment are dropped) -> {"k": .., "v": ..
    (, "k_scale", "v_scale")}."""
    k, v, ks, vs = new
    rows = rows[:, None] if rows.ndim == 1 else rows
    out = {"k": _set_bits(kv["k"][i], (rows, slice(None), slice(None), idx), k),
           "v": _set_bits(kv["v"][i], (rows, slice(None), idx), v)}
    if ks is not None:
        out["k_scale"] = _set_bits(kv["k_scale"][i], (rows, slice(None), idx), ks)
        out["v_scale"] = _set_bits(kv["v_scale"][i], (rows, slice(None), idx), vs)
    return out


def _set_bits(x: jax.Array, index: tuple, values: jax.Array) -> jax.Array:
    """x.at[index].set(values) (out-of-range indexes dropped), scattered as same-width unsigned
    ints for narrow floats: XLA:CPU has no bf16 / fp8 scatter and rewrites one into converting
    the whole cache segment to f32 / f16 and back on every write (a bf16 cache made decode slower
    than f32). A set moves bits, so the integer scatter is exact; on CPU the bitcasts around it
    still cost one 16- / 8-bit copy of the segment (why a bf16 model's default cache there is
    f32: `Tuning.auto_kv_cache_dtype`); other backends take them for free."""
    put = dict(mode="drop", unique_indices=True)
    if not jnp.issubdtype(x.dtype, jnp.floating) or x.dtype.itemsize == 4:
        return x.at[index].set(values.astype(x.dtype), **put)
    u = {2: jnp.uint16, 1: jnp.uint8}[x.dtype.itemsize]
    bits = jax.lax.bitcast_convert_type(x, u).at[index].set(
        jax.lax.bitcast_convert_type(values.astype(x.dtype), u), **put)
    return jax.lax.bitcast_convert_type(bits, x.dtype)


def cache_kv_heads(num_kv_heads: int, tp: int = 1) -> int:
    """KV heads the cache holds: the model's, or tp when there are fewer (each shard keeps a
    copy of the KV head its query heads read: Megatron's KV-head replication)."""
    return num_kv_heads if num_kv_heads >= tp else tp


def ring_len(window: int, max_len: int, max_chunk: int | None) -> int:
    """Positions a sliding layer's ring holds: window + max_chunk - 1 (at most max_len)."""
    chunk = max_len if max_chunk is None else max_chunk
    return min(window + chunk - 1, max_len)


def softcap(x: jax.Array, cap: float | None) -> jax.Array:
    return x if cap is None else jnp.tanh(x / cap) * cap


# ---- the sliding-window ring ---------------------------------------------------------------------

def ring_key_index(write_end: jax.Array, ring: int) -> jax.Array:
    """[b, ring] cache index held by each ring slot: the last index < write_end[b] that maps to
    the slot (negative: never written by this row)."""
    r = jnp.arange(ring)[None, :]
    last = write_end[:, None] - 1
    return last - jnp.mod(last - r, ring)


def ring_visible(key_index: jax.Array, q_index: jax.Array, window: int, spans: jax.Array | None,
                 starts: jax.Array, key_spans: jax.Array | None = None) -> jax.Array:
    """[b, t, ring] bool: HF's sliding mask AND(kv > q - window, OR(kv <= q, same image run)) on
    ring slots; key_index [b, ring] from `ring_key_index`, q_index [b, t], spans [b, t] or None;
    key_spans [b, u]: the spans of the row's new tokens from starts[b] on (MaskSpec.key_spans;
    None: spans)."""
    k, q = key_index[:, None, :], q_index[:, :, None]
    vis = k <= q
    if spans is not None:
        keys = spans if key_spans is None else key_spans
        u = keys.shape[1]
        new = key_index - starts[:, None]                                   # [b, ring]
        in_call = (new >= 0) & (new < u)
        kspan = jnp.where(in_call, jnp.take_along_axis(keys, jnp.clip(new, 0, u - 1), axis=1), -1)
        qspan = spans[:, :, None]
        vis |= (qspan >= 0) & (qspan == kspan[:, None, :])
    return vis & (k > q - window) & (k >= 0)


def ring_attention(q: jax.Array, kt: jax.Array, v: jax.Array, visible: jax.Array, scale: float,
                   cap: float | None = None, scales: tuple | None = None) -> jax.Array:
    """q [b, t, heads, hd] over ring rows kt [b, kvh, hd, R], v [b, kvh, R, hd] with visible
    [b, t, R] -> [b, t, heads, hd]; scores in float32, zeros where nothing is visible.
    scales: (k_scale, v_scale) [b, kvh, R] of an int8 / fp8 cache, applied to the scores and the
    softmax weights (kv_quant)."""
    b, t, h, hd = q.shape
    kvh = kt.shape[1]
    g = h // kvh
    qn = q.reshape(b, t, kvh, g, hd).transpose(0, 2, 1, 3, 4)                # [b, kvh, t, g, hd]
    s = jnp.einsum("bktgd,bkds->bktgs", qn, operand(kt, q.dtype), preferred_element_type=jnp.float32)
    if scales is not None:
        s = s * scales[0].astype(jnp.float32)[:, :, None, None, :]
    s = softcap(s * scale, cap)
    vis = visible[:, None, :, None, :]
    s = jnp.where(vis, s, -jnp.inf)
    top = jnp.max(s, axis=-1, keepdims=True)
    w = jnp.exp(s - jnp.where(jnp.isfinite(top), top, 0.0))
    w = w / jnp.maximum(w.sum(-1, keepdims=True), 1e-30)
    dt = v.dtype
    if scales is not None:
        w, dt = w * scales[1].astype(jnp.float32)[:, :, None, None, :], q.dtype
    out = jnp.einsum("bktgs,bksd->bktgd", w.astype(dt), operand(v, dt), preferred_element_type=jnp.float32)
    return out.transpose(0, 2, 1, 3, 4).reshape(b, t, h, hd).astype(q.dtype)


def captured_attention(q: jax.Array, kt: jax.Array, v: jax.Array, key_index: jax.Array, q_index: jax.Array,
                       window: int | None, spans, starts, scale: float, cap: float | None, kv_len: int):
    """Explicit-softmax attention for captured layers (research): q [b, t, h, hd] over rows kt
    [b, kvh, hd, K], v [b, kvh, K, hd] holding cache indexes key_index [b, K] -> (out [b, t, h,
    hd], probs [b, h, t, kv_len] float32 over cache indexes 0..kv_len-1)."""
    b, t, h, hd = q.shape
    kvh = kt.shape[1]
    g = h // kvh
    qn = q.reshape(b, t, kvh, g, hd).transpose(0, 2, 1, 3, 4)
    s = softcap(jnp.einsum("bktgd,bkds->bktgs", qn, kt, preferred_element_type=jnp.float32) * scale, cap)
    vis = ring_visible(key_index, q_index, kv_len + 1 if window is None else window, spans, starts)
    s = jnp.where(vis[:, None, :, None, :], s, -jnp.inf)
    probs = jnp.where(vis[:, None, :, None, :], jax.nn.softmax(s, axis=-1), 0.0)        # [b, kvh, t, g, K]
    out = jnp.einsum("bktgs,bksd->bktgd", probs.astype(v.dtype), v, preferred_element_type=jnp.float32)
    out = out.transpose(0, 2, 1, 3, 4).reshape(b, t, h, hd).astype(q.dtype)
    onehot = (key_index[:, :, None] == jnp.arange(kv_len)[None, None, :]).astype(jnp.float32)  # [b, K, kv_len]
    probs = jnp.einsum("bktgs,bsn->bkgtn", probs, onehot).reshape(b, h, t, kv_len)
    return out, probs


def softcapped_attention(q, kts, vs, q_index, kv_len, slots, *, mask, starts, scale, cap, scales=None):
    """Full-attention layers with attn_logit_softcapping: the whole cache as one block."""
    b = q.shape[0]
    rows = (lambda a: a[:b]) if slots is None else (lambda a: a[slots])
    kt, v = rows(jnp.concatenate(kts, axis=3)), rows(jnp.concatenate(vs, axis=2))
    if scales is not None:
        scales = tuple(rows(jnp.concatenate(x, axis=2)) for x in scales)
    key_index = jnp.broadcast_to(jnp.arange(v.shape[2])[None], (b, v.shape[2]))
    vis = ring_visible(key_index, q_index, v.shape[2] + 1, mask.spans if mask else None, starts,
                       mask.key_spans if mask else None)
    return ring_attention(q, kt, v, vis, scale, cap, scales)

