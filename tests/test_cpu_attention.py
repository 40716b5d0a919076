"""mmjax's CPU decode-attention kernel (mmjax.kernels.cpu_attention, issues 25 and 28):

* the kernel against a float64 numpy softmax attention: f32, bf16, int8 and fp8 e4m3 (with
  per-key bf16 K and V scales, the quantized KV cache; fp8 over every bit pattern but NaN)
  cache segments, GQA groups
  of 1-20 queries (padded inside the kernel to 1/2/4/8/16), head dims not multiples of 16 or 8,
  segment lengths not multiples of the kernel's key blocks, more visible keys in one segment than
  a key block holds, rows that see nothing, sliding-window
  ranges, ranges past the cache; on every code path the CPU runs (plain C++, AVX2, AVX-512); each row's result the
  same bit for bit alone or beside other rows;
* wired in: a decode step's `cache_attention` takes it on the CPU (one custom call per layer, no
  per-segment lax.cond) with the XLA path's outputs, sliding window and int8 / fp8 caches
  included, and never when tracing for CUDA or inside a sharded step (XLA's path);
* derivatives equal those of the XLA reference;
* the vision towers' full attention (`dense_attention`) against float64 on every code path, and
  `mmjax.attention`'s "auto" taking it only for full attention on a CPU the kernels run on;
* a prefill's K / V written into the cache by `kv_write`, bit for bit XLA's scatter, for every
  cache dtype, and `scatter_kv` taking it on the CPU;
* a paged cache (page pool + page table): the decode, fused write + decode and prefill kernels
  against float64 over the rows the table names (page sizes 7-128, ragged rows, windows, every
  cache dtype), `cache_attention` / `cpu_decode_write` taking them with the outputs of XLA's
  paged path, derivatives equal to the references'.
"""
from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import kernel_path, rel_err
from mmjax.backend import compiling_for, cpu_kernels, tuning
from mmjax.kernels import cpu_attention, cpu_library
from mmjax.models.nn.metadata import MaskSpec
from mmjax.models.nn.kv_cache import cache_attention


def _want(q, kts, vs, lo, hi, scale, scales=None) -> np.ndarray:
    """float64 softmax attention of row i over cache indexes [lo_i, hi_i) of cache row i (an
    int8 / fp8 cache dequantized with its per-key scales)."""
    q = np.asarray(q, np.float64)
    f64 = lambda xs, axis: np.concatenate([np.asarray(x.astype(jnp.float32), np.float64) for x in xs], axis=axis)  # noqa: E731
    kt, v = f64(kts, 3), f64(vs, 2)
    if scales is not None:
        kt, v = kt * f64(scales[0], 2)[:, :, None, :], v * f64(scales[1], 2)[..., None]
    out = np.zeros(q.shape)
    for i in range(q.shape[0]):
        a, e = max(int(lo[i]), 0), min(int(hi[i]), kt.shape[3])
        if a >= e:
            continue
        s = np.einsum("knd,kdt->knt", q[i], kt[i, :, :, a:e]) * scale
        w = np.exp(s - s.max(axis=2, keepdims=True))
        out[i] = np.einsum("knt,ktd->knd", w / w.sum(axis=2, keepdims=True), v[i, :, a:e])
    return out


CASES = [  # b, slots, kvh, n, hd, segment lengths, lo, hi
    (1, 1, 8, 2, 64, [128, 128, 128], [0], [235]),
    (3, 4, 2, 7, 80, [64, 100, 36], [0, 5, 150], [1, 180, 200]),      # hd 80; a row of one key
    (3, 4, 2, 16, 128, [64, 100], [0, 0, 10], [0, 164, 12]),           # a row that sees nothing
    (2, 2, 1, 20, 32, [17, 33], [-3, 0], [50, 49]),                     # 20 queries: two groups
    (2, 3, 4, 3, 256, [128], [0, 20], [128, 21]),
    (2, 2, 2, 1, 48, [40, 24, 64], [30, 77], [200, 101]),               # window; hi past the cache
    (2, 2, 2, 2, 64, [256, 600], [0, 300], [700, 856]),                 # > 256 keys of one segment
    (2, 3, 2, 5, 36, [40, 27], [0, 3], [67, 30]),                       # hd 36: not whole 8-lane vectors
]


def _fp8(rng, *shape):
    """Random float8_e4m3fn values over every bit pattern but the two NaNs: both signs, the
    subnormals (exponent 0), zero and +-448."""
    bits = rng.integers(0, 254, shape).astype(np.uint8)
    bits = np.where(bits >= 0x7F, bits + 1, bits).astype(np.uint8)          # skip 0x7F; 0xFF is past 254
    return jax.lax.bitcast_convert_type(jnp.asarray(bits), jnp.float8_e4m3fn)


def _cache(rng, dtype, slots, kvh, hd, lens):
    """K^T and V segments of `dtype`, and for int8 / fp8 their bf16 scales ((K, V) scale segments)."""
    if dtype not in (jnp.int8, jnp.float8_e4m3fn):
        return ([jnp.asarray(rng.standard_normal((slots, kvh, hd, L)) * 2, dtype) for L in lens],
                [jnp.asarray(rng.standard_normal((slots, kvh, L, hd)), dtype) for L in lens], None)
    if dtype == jnp.int8:
        q8, lo, hi = (lambda *s: jnp.asarray(rng.integers(-127, 128, s), jnp.int8)), 0.002, 0.03  # noqa: E731
    else:   # (e4m3 reaches 448: smaller scales keep the scores of the int8 case's size)
        q8, lo, hi = (lambda *s: _fp8(rng, *s)), 0.0005, 0.005  # noqa: E731
    sc = lambda *s: jnp.asarray(rng.uniform(lo, hi, s), jnp.bfloat16)  # noqa: E731
    return ([q8(slots, kvh, hd, L) for L in lens], [q8(slots, kvh, L, hd) for L in lens],
            ([sc(slots, kvh, L) for L in lens], [sc(slots, kvh, L) for L in lens]))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.int8, jnp.float8_e4m3fn],
                         ids=["f32", "bf16", "int8", "fp8"])
def test_kernel_equals_reference(dtype):
    assert cpu_attention.available()
    for path in cpu_library.isas():          # every code path this CPU runs
        with kernel_path(path):
            rng = np.random.default_rng(0)
            attend = jax.jit(lambda q, kts, vs, lo, hi, scale, scales=None: cpu_attention.decode_attention(
                q, kts, vs, lo, hi, scale=scale, scales=scales), static_argnums=5)
            for b, slots, kvh, n, hd, lens, lo, hi in CASES:
                q = jnp.asarray(rng.standard_normal((b, kvh, n, hd)), jnp.float32)
                kts, vs, scales = _cache(rng, dtype, slots, kvh, hd, lens)
                assert cpu_attention.covers(kts, vs, scales) == (path != "generic")   # never the plain loops
                lo_, hi_ = jnp.asarray(lo, jnp.int32), jnp.asarray(hi, jnp.int32)
                got = attend(q, kts, vs, lo_, hi_, hd ** -0.5, scales)
                want = _want(q, kts, vs, lo, hi, hd ** -0.5, scales)
                assert got.shape == q.shape and got.dtype == jnp.float32
                # f32 sums over up to 700 keys against float64
                assert rel_err(got, want) < 4e-6, (b, kvh, n, hd, lens)
                for i in range(b):
                    if min(hi[i], sum(lens)) <= max(lo[i], 0):
                        assert not np.asarray(got[i]).any()                  # nothing visible: zeros
                # a row's result does not depend on the rows beside it
                last = (lambda xs: [x[b - 1:] for x in xs])   # noqa: E731
                alone = attend(q[b - 1:], last(kts), last(vs), lo_[b - 1:], hi_[b - 1:], hd ** -0.5,
                               None if scales is None else (last(scales[0]), last(scales[1])))
                np.testing.assert_array_equal(alone[0], got[b - 1])


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.int8, jnp.float8_e4m3fn],
                         ids=["f32", "bf16", "int8", "fp8"])
def test_write_kernel_equals_reference(dtype):
    """decode_attention_write: each row's new K / V (and int8 / fp8 scales) lands at its index
    in the right segment, bit for bit as `write_reference` (rows past b and indexes outside the
    segments untouched), and the attention is the float64 one over the written cache; with the
    segments donated, the compiled call updates them in place (no copy of a segment)."""
    for path in cpu_library.isas():          # every code path this CPU runs
        with kernel_path(path):
            rng = np.random.default_rng(5)
            fn = jax.jit(lambda q, k, v, kts, vs, lo, hi, pos, scale, scales, ns: cpu_attention.decode_attention_write(
                q, k, v, kts, vs, lo, hi, pos, scale=scale, scales=scales, new_scales=ns), static_argnums=8)
            for b, slots, kvh, n, hd, lens, lo, hi in CASES:
                total = sum(lens)
                q = jnp.asarray(rng.standard_normal((b, kvh, n, hd)), jnp.float32)
                kts, vs, scales = _cache(rng, dtype, slots, kvh, hd, lens)
                new_k, new_v, new_sc = _cache(rng, dtype, b, kvh, hd, [1])     # [b, kvh, hd, 1] / [b, kvh, 1, hd]
                k, v = new_k[0][..., 0], new_v[0][:, :, 0]
                ns = None if new_sc is None else (new_sc[0][0][..., 0], new_sc[1][0][..., 0])
                # each row's index: its last visible key (inside any segment), the last row parked past the cache
                pos = np.clip(np.asarray(hi) - 1, 0, total - 1)
                pos[-1] = total if b > 1 else pos[-1]
                pos = jnp.asarray(pos, jnp.int32)
                lo_, hi_ = jnp.asarray(lo, jnp.int32), jnp.asarray(hi, jnp.int32)
                out, kts2, vs2, sc2 = fn(q, k, v, kts, vs, lo_, hi_, pos, hd ** -0.5, scales, ns)
                wk, wv, wsc = cpu_attention.write_reference(kts, vs, scales, k, v, ns, pos)
                for got, want in zip(jax.tree.leaves((kts2, vs2, sc2)), jax.tree.leaves((wk, wv, wsc))):
                    assert got.dtype == want.dtype
                    np.testing.assert_array_equal(np.asarray(got.astype(jnp.float32)), np.asarray(want.astype(jnp.float32)))
                changed = sum(int((np.asarray(a.astype(jnp.float32)) != np.asarray(c.astype(jnp.float32))).any())
                              for a, c in zip(kts + vs, wk + wv))
                assert changed >= 1                                   # (the reference did write something)
                assert rel_err(out, _want(q, wk, wv, lo, hi, hd ** -0.5, wsc)) < 4e-6, (b, kvh, n, hd, lens)
            # donated segments: updated in place (XLA's aliasing), no copy of a segment in the step
            b, slots, kvh, n, hd, lens, lo, hi = CASES[1]
            kts, vs, scales = _cache(rng, dtype, slots, kvh, hd, lens)
            new_k, new_v, new_sc = _cache(rng, dtype, b, kvh, hd, [1])
            ns = None if new_sc is None else (new_sc[0][0][..., 0], new_sc[1][0][..., 0])
            args = (jnp.zeros((b, kvh, n, hd)), new_k[0][..., 0], new_v[0][:, :, 0], kts, vs, jnp.asarray(lo),
                    jnp.asarray(hi), jnp.asarray([1, 70, 150]), hd ** -0.5, scales, ns)
            def segment_copies(**kw):
                hlo = jax.jit(fn.__wrapped__, static_argnums=8, **kw).lower(*args).compile().as_text()
                assert "mmjax_decode_attention_write" in hlo
                return [ln for ln in hlo.splitlines() if re.search(r"= \S+\[4,2,[\d,]+\]\S* copy\(", ln)]
            assert segment_copies(donate_argnums=(3, 4, 9)) == []
            assert len(segment_copies()) >= 6          # not donated: each written segment is a copy


def test_write_kernel_differentiates():
    """Gradients through decode_attention_write (attention output and written cache) equal those
    through write_reference + reference, for the queries, the new K / V and the cache."""
    rng = np.random.default_rng(6)
    q = jnp.asarray(rng.standard_normal((2, 2, 3, 32)), jnp.float32)
    k, v = (jnp.asarray(rng.standard_normal((2, 2, 32)), jnp.float32) for _ in range(2))
    kts = [jnp.asarray(rng.standard_normal((2, 2, 32, 40)), jnp.float32) for _ in range(2)]
    vs = [jnp.asarray(rng.standard_normal((2, 2, 40, 32)), jnp.float32) for _ in range(2)]
    lo, hi, pos = jnp.asarray([0, 10], jnp.int32), jnp.asarray([70, 41], jnp.int32), jnp.asarray([69, 40], jnp.int32)

    def loss(q, k, v, kts, vs, fused):
        if fused:
            out, kts, vs, _ = cpu_attention.decode_attention_write(q, k, v, kts, vs, lo, hi, pos, scale=0.2)
        else:
            kts, vs, _ = cpu_attention.write_reference(kts, vs, None, k, v, None, pos)
            out = cpu_attention.reference(q, kts, vs, lo, hi, 0.2)
        return jnp.sin(out).sum() + sum(jnp.cos(x).sum() for x in kts + vs) * 1e-3
    grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4)), static_argnums=5)
    assert "mmjax_decode_attention_write" in grad.lower(q, k, v, kts, vs, True).as_text()
    for g, w in zip(jax.tree.leaves(grad(q, k, v, kts, vs, True)), jax.tree.leaves(grad(q, k, v, kts, vs, False))):
        assert rel_err(g, w) < 1e-5


def _decode_inputs(rng, b=3, slots=4, h=8, kvh=2, hd=64, lens=(48, 48, 32)):
    q = jnp.asarray(rng.standard_normal((b, 1, h, hd)), jnp.float32)
    kts = [jnp.asarray(rng.standard_normal((slots, kvh, hd, L)), jnp.float32) for L in lens]
    vs = [jnp.asarray(rng.standard_normal((slots, kvh, L, hd)), jnp.float32) for L in lens]
    q_index = jnp.asarray([[5], [100], [127]][:b], jnp.int32)
    return q, kts, vs, q_index


def test_decode_step_takes_the_kernel_with_the_xla_paths_outputs():
    rng = np.random.default_rng(1)
    q, kts, vs, q_index = _decode_inputs(rng)

    def attend(q, kts, vs, q_index, kv_len, window):
        return cache_attention(q, kts, vs, q_index, kv_len, mask=None if window is None else MaskSpec(window),
                               reduce_small=True)
    step = jax.jit(attend, static_argnums=5)
    for kv_len in (128, 101, jnp.int32(128)):
        for window in (None, 16):
            text = step.lower(q, kts, vs, q_index, kv_len, window).as_text()
            assert "mmjax_decode_attention_f32" in text and "stablehlo.case" not in text  # no per-segment cond
            got = step(q, kts, vs, q_index, kv_len, window)
            with cpu_kernels(False):
                want = jax.jit(attend, static_argnums=5)(q, kts, vs, q_index, kv_len, window)
            # rows past kv_len (the third, at index 127, when kv_len is 101) differ by design
            # between the two paths (neither is read: a decode step's kv_len covers every active row)
            rows = 3 if not isinstance(kv_len, int) or kv_len > 127 else 2
            assert rel_err(got[:rows], want[:rows]) < 2e-6, (kv_len, window)
    # XLA's path: tracing for CUDA, a sharded step, an int8 cache
    with compiling_for("cuda"):     # (tests/test_cuda_lowering.py exports whole decode steps for CUDA)
        assert not cpu_attention.covers(kts, vs)
    sharded = dataclasses.replace(tuning("cpu"), sharded=True)
    assert "mmjax_decode_attention" not in jax.jit(sharded.traced(lambda *a: attend(*a, None))).lower(
        q, kts, vs, q_index, 128).as_text()
    assert cpu_attention.covers([k.astype(jnp.bfloat16) for k in kts], [v.astype(jnp.bfloat16) for v in vs])
    # an int8 / fp8 cache with its scales: the kernel, with XLA's outputs (the scales applied to
    # scores and weights either way); without its scales: not the kernel
    def quantized():     # a fresh function per trace: the kernel choice is made at trace time
        return jax.jit(lambda q, kts, vs, scales, kv_len: cache_attention(q, kts, vs, q_index, kv_len,
                                                                          reduce_small=True, scales=scales))
    for dtype, target in ((jnp.int8, "mmjax_decode_attention_s8"), (jnp.float8_e4m3fn, "mmjax_decode_attention_f8e4m3fn")):
        k8, v8, sc8 = _cache(rng, dtype, 4, 2, 64, (48, 48, 32))
        assert not cpu_attention.covers(k8, v8)
        for kv_len in (128, jnp.int32(101)):
            kernel = quantized()
            assert target in kernel.lower(q, k8, v8, sc8, kv_len).as_text()
            got = kernel(q, k8, v8, sc8, kv_len)
            with cpu_kernels(False):
                xla = quantized()
                assert "mmjax_decode_attention" not in xla.lower(q, k8, v8, sc8, kv_len).as_text()
                want = xla(q, k8, v8, sc8, kv_len)
            rows = 3 if kv_len == 128 else 2
            assert rel_err(got[:rows], want[:rows]) < 2e-6, (dtype, kv_len)


def test_kernel_calls_differentiate():
    """Gradients through the kernel (research code differentiates served steps) equal those
    through its XLA reference, for the queries and the cache."""
    rng = np.random.default_rng(2)
    q = jnp.asarray(rng.standard_normal((2, 2, 3, 32)), jnp.float32)
    kts = [jnp.asarray(rng.standard_normal((2, 2, 32, 40)), jnp.float32) for _ in range(2)]
    vs = [jnp.asarray(rng.standard_normal((2, 2, 40, 32)), jnp.float32) for _ in range(2)]
    lo, hi = jnp.asarray([0, 10], jnp.int32), jnp.asarray([70, 41], jnp.int32)

    def loss(fn):
        return lambda q, kts, vs: jnp.sin(fn(q, kts, vs)).sum()
    kernel = loss(lambda q, kts, vs: cpu_attention.decode_attention(q, kts, vs, lo, hi, scale=0.2))
    ref = loss(lambda q, kts, vs: cpu_attention.reference(q, kts, vs, lo, hi, 0.2))
    grad = jax.jit(jax.grad(kernel, argnums=(0, 1, 2)))
    assert "mmjax_decode_attention" in grad.lower(q, kts, vs).as_text()
    got, want = grad(q, kts, vs), jax.jit(jax.grad(ref, argnums=(0, 1, 2)))(q, kts, vs)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert rel_err(g, w) < 1e-5


# prefill: b rows, cache slots, kvh, tokens, g (queries per KV head and token), hd, segment lengths,
# each row's cache row (one past the cache: zeros), each row's first token's cache index, window
PREFILL_CASES = [
    (1, 4, 8, 37, 2, 64, [128, 128, 128], [2], [100], None),          # across a segment boundary
    (2, 3, 2, 11, 3, 80, [64, 100], [0, 2], [50, 140], 20),            # hd 80, 33 queries a head, window
    (2, 2, 1, 5, 1, 48, [40, 24], [1, 2], [3, 60], None),              # a slot past the cache; tokens past kv_len
    (1, 2, 4, 300, 2, 64, [256, 600], [1], [0], None),                 # > 256 keys of one segment
    (1, 2, 2, 9, 3, 20, [30, 13], [0], [20], 7),                       # hd 20: not whole 8-lane vectors
]


def _prefill_ranges(start, t, kv_len, window):
    """lo, hi [b, t] of tokens at cache indexes start_i + j, as llama._visible_range gives them."""
    q = np.asarray(start)[:, None] + np.arange(t)[None]
    lo = np.zeros_like(q) if window is None else q - window + 1
    return lo.astype(np.int32), np.where(q < kv_len, q + 1, 0).astype(np.int32)


def _want_prefill(q, kts, vs, lo, hi, slots, scale, scales=None) -> np.ndarray:
    """float64: query j of row i (token j // g) over [lo_ij, hi_ij) of cache row slots_i (all of
    a row's queries at once, each masked to its own range)."""
    q = np.asarray(q, np.float64)
    b, _, n, _ = q.shape
    g = n // lo.shape[1]
    f64 = lambda xs, axis: np.concatenate([np.asarray(x.astype(jnp.float32), np.float64) for x in xs], axis=axis)  # noqa: E731
    kt, v = f64(kts, 3), f64(vs, 2)
    if scales is not None:
        kt, v = kt * f64(scales[0], 2)[:, :, None, :], v * f64(scales[1], 2)[..., None]
    keys = np.arange(kt.shape[3])
    out = np.zeros(q.shape)
    for i in range(b):
        s = int(slots[i])
        if not 0 <= s < kt.shape[0]:
            continue
        tok = np.arange(n) // g
        vis = (keys[None] >= np.maximum(lo[i, tok], 0)[:, None]) & (keys[None] < hi[i, tok][:, None])   # [n, L]
        sc = np.where(vis[None], np.einsum("knd,kdt->knt", q[i], kt[s]) * scale, -np.inf)
        top = sc.max(axis=2, keepdims=True)
        w = np.where(vis[None], np.exp(sc - np.where(np.isfinite(top), top, 0)), 0.0)
        tot = w.sum(axis=2, keepdims=True)
        out[i] = np.einsum("knt,ktd->knd", w / np.where(tot > 0, tot, 1), v[s])      # no visible key: zeros
    return out


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.int8, jnp.float8_e4m3fn],
                         ids=["f32", "bf16", "int8", "fp8"])
def test_prefill_kernel_equals_reference(dtype):
    """Several tokens per row, each query over its own causal / windowed range of its row's cache
    row (any slot), against float64: f32 / bf16 / int8 / fp8 caches, both code paths; a row whose
    slot is past the cache and tokens past kv_len (a bucket's padding) get zeros."""
    rng = np.random.default_rng(3)
    cases = []      # the inputs and float64 answers, once for every code path
    for b, nslots, kvh, t, g, hd, lens, slots, start, window in PREFILL_CASES:
        kv_len = max(start) + t - 2                                          # the last tokens past it
        q = jnp.asarray(rng.standard_normal((b, kvh, t * g, hd)), jnp.float32)
        kts, vs, scales = _cache(rng, dtype, nslots, kvh, hd, lens)
        lo, hi = _prefill_ranges(start, t, kv_len, window)
        sl = np.asarray(slots, np.int32)
        want = _want_prefill(np.asarray(q), kts, vs, lo, hi, sl, hd ** -0.5, scales)
        assert rel_err(cpu_attention.reference(q, kts, vs, jnp.asarray(lo), jnp.asarray(hi), hd ** -0.5, scales,
                                               jnp.asarray(sl)), want) < 4e-6
        cases.append((b, nslots, kvh, t, g, hd, lens, start, q, kts, vs, scales, lo, hi, sl, want))
    for path in cpu_library.isas():          # every code path this CPU runs
        with kernel_path(path):
            attend = jax.jit(lambda q, kts, vs, lo, hi, slots, scale, scales=None: cpu_attention.prefill_attention(
                q, kts, vs, lo, hi, slots, scale=scale, scales=scales), static_argnums=6)
            for b, nslots, kvh, t, g, hd, lens, start, q, kts, vs, scales, lo, hi, sl, want in cases:
                got = attend(q, kts, vs, jnp.asarray(lo), jnp.asarray(hi), jnp.asarray(sl), hd ** -0.5, scales)
                assert got.shape == q.shape and got.dtype == jnp.float32
                assert rel_err(got, want) < 4e-6, (path, b, kvh, t, g, hd, lens)
                for i in range(b):
                    if sl[i] >= nslots:
                        assert not np.asarray(got[i]).any()
                    if start[i] == max(start):                                   # its last 2 tokens: past kv_len
                        assert (hi[i] == 0).sum() == 2 and not np.asarray(got[i][:, (t - 2) * g:]).any()


def test_prefill_takes_the_kernel_with_the_xla_paths_outputs():
    """A prefill's `cache_attention` (several tokens per row, rows in any slots, causal or a
    sliding window) is one prefill-kernel call per layer on the CPU, without a per-segment cond,
    with XLA's outputs on every real token; with image spans (bidirectional runs) it stays XLA's."""
    rng = np.random.default_rng(4)
    kts, vs, _ = _cache(rng, jnp.float32, 4, 2, 64, (64, 64, 128))
    q = jnp.asarray(rng.standard_normal((2, 40, 4, 64)), jnp.float32)
    starts = jnp.asarray([0, 90], jnp.int32)
    q_index = starts[:, None] + jnp.arange(40)[None]
    slots = jnp.asarray([3, 1], jnp.int32)

    def attend(q, kts, vs, q_index, kv_len, window, spans=None):
        mask = None if window is None and spans is None else MaskSpec(window, spans)
        return cache_attention(q, kts, vs, q_index, kv_len, slots, mask=mask, starts=starts)
    step = jax.jit(attend, static_argnums=5)
    for window in (None, 24):
        text = step.lower(q, kts, vs, q_index, jnp.int32(130), window).as_text()
        assert "mmjax_prefill_attention_f32" in text and "stablehlo.case" not in text
        got = step(q, kts, vs, q_index, jnp.int32(130), window)
        with cpu_kernels(False):
            want = jax.jit(attend, static_argnums=5)(q, kts, vs, q_index, jnp.int32(130), window)
        assert rel_err(got, want) < 2e-6, window
    spans = jnp.where((jnp.arange(40) >= 5) & (jnp.arange(40) < 20), 0, -1)[None].repeat(2, axis=0)
    assert "mmjax_prefill_attention" not in step.lower(q, kts, vs, q_index, 130, None, spans).as_text()


def test_prefill_kernel_differentiates():
    rng = np.random.default_rng(5)
    q = jnp.asarray(rng.standard_normal((2, 2, 6, 32)), jnp.float32)
    kts = [jnp.asarray(rng.standard_normal((3, 2, 32, 40)), jnp.float32) for _ in range(2)]
    vs = [jnp.asarray(rng.standard_normal((3, 2, 40, 32)), jnp.float32) for _ in range(2)]
    lo, hi = _prefill_ranges([10, 50], 3, 60, None)
    lo, hi, slots = jnp.asarray(lo), jnp.asarray(hi), jnp.asarray([2, 0], jnp.int32)

    def loss(fn):
        return lambda q, kts, vs: jnp.sin(fn(q, kts, vs)).sum()
    kernel = loss(lambda q, kts, vs: cpu_attention.prefill_attention(q, kts, vs, lo, hi, slots, scale=0.2))
    ref = loss(lambda q, kts, vs: cpu_attention.reference(q, kts, vs, lo, hi, 0.2, None, slots))
    grad = jax.jit(jax.grad(kernel, argnums=(0, 1, 2)))
    assert "mmjax_prefill_attention" in grad.lower(q, kts, vs).as_text()
    got, want = grad(q, kts, vs), jax.jit(jax.grad(ref, argnums=(0, 1, 2)))(q, kts, vs)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert rel_err(g, w) < 1e-5


# dense (a vision tower's full attention): b, sq, sk, heads, kv heads, hd, lengths (None: all keys)
DENSE_CASES = [
    (1, 197, 197, 12, 12, 64, None),            # CLIP-B/16 at 224 px: 6 blocks of 32 queries + 5
    (2, 50, 77, 4, 2, 80, [77, 0]),              # GQA, hd 80; a row that sees no key
    (3, 13, 300, 2, 1, 72, [300, 257, 5]),       # <= 16 queries (one vector); > 256 keys: two chunks
    (1, 40, 600, 3, 3, 20, [999]),              # hd 20 (8 + 8 + 4 dims); 3 chunks; lengths past sk
    (2, 33, 6, 2, 2, 128, None),                 # fewer keys than one 8-key tile
]


def _want_dense(q, k, v, lengths, scale) -> np.ndarray:
    """float64 softmax attention, row b's queries over keys [0, lengths_b) (zeros for none)."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    g = q.shape[2] // k.shape[2]
    k, v = np.repeat(k, g, axis=2), np.repeat(v, g, axis=2)
    out = np.zeros(q.shape)
    for b in range(q.shape[0]):
        n = k.shape[1] if lengths is None else min(int(lengths[b]), k.shape[1])
        if n <= 0:
            continue
        s = np.einsum("qhd,khd->hqk", q[b], k[b, :n]) * scale
        w = np.exp(s - s.max(axis=2, keepdims=True))
        out[b] = np.einsum("hqk,khd->qhd", w / w.sum(axis=2, keepdims=True), v[b, :n])
    return out


@pytest.mark.parametrize("case", DENSE_CASES, ids=[f"case{i}" for i in range(len(DENSE_CASES))])
def test_dense_kernel_equals_reference(case):
    """Full attention (a vision tower's) against float64 on every code path the CPU runs: blocks of
    32 and of <= 16 queries, several key chunks (the running max moving), key tiles and head dims
    that are not whole, GQA, lengths (a row that sees nothing: zeros; past the keys: clipped);
    each row's result the same bits alone as beside other rows."""
    b, sq, sk, h, hkv, hd, lengths = case
    rng = np.random.default_rng(DENSE_CASES.index(case))
    q = jnp.asarray(rng.standard_normal((b, sq, h, hd)) * 2, jnp.float32)
    k, v = (jnp.asarray(rng.standard_normal((b, sk, hkv, hd)), jnp.float32) for _ in range(2))
    lens = None if lengths is None else jnp.asarray(lengths, jnp.int32)
    scale = hd ** -0.5
    want = _want_dense(q, k, v, lengths, scale)
    for path in cpu_library.isas():
        with kernel_path(path):
            got = np.asarray(cpu_attention.dense_attention(q, k, v, lens, scale=scale))
            assert np.abs(got - want).max() < 2e-6 * max(1.0, np.abs(want).max()), path
            if lengths is not None and 0 in lengths:
                assert not got[lengths.index(0)].any()
            for i in range(b):       # alone: the same bits
                alone = cpu_attention.dense_attention(q[i:i + 1], k[i:i + 1], v[i:i + 1],
                                                      None if lens is None else lens[i:i + 1], scale=scale)
                np.testing.assert_array_equal(np.asarray(alone)[0], got[i])


def test_vision_attention_takes_the_dense_kernel():
    """`mmjax.attention` with impl="auto" on a CPU with AVX2 or AVX-512 sends full attention
    (with or without lengths, f32 or bf16) to the kernel with the XLA reference's outputs;
    causal, windowed and segmented attention, a CUDA lowering, a sharded step and training's
    reference bound keep XLA's ops."""
    from mmjax.attention import attention, auto_reference_up_to, reference_attention
    rng = np.random.default_rng(9)
    q, k, v = (jnp.asarray(rng.standard_normal((2, 197, 4, 64)), jnp.float32) for _ in range(3))
    lens = jnp.asarray([197, 100], jnp.int32)
    auto = jax.jit(lambda q, k, v, lens: attention(q, k, v, lengths=lens))
    text = auto.lower(q, k, v, lens).as_text()
    simd = cpu_library.simd()              # AVX2 or AVX-512: the kernel; plain loops only: XLA
    assert ("mmjax_dense_attention_f32" in text) == simd
    assert rel_err(auto(q, k, v, lens), reference_attention(q, k, v, lengths=lens)) < 2e-6
    bf = [x.astype(jnp.bfloat16) for x in (q, k, v)]
    got = jax.jit(lambda q, k, v: attention(q, k, v))(*bf)
    assert got.dtype == jnp.bfloat16
    assert rel_err(got, reference_attention(*[x.astype(jnp.float32) for x in bf])) < 8e-3
    for kw in (dict(causal=True), dict(window=(16, 16)), dict(segment_ids=jnp.zeros((2, 197), jnp.int32))):
        assert "mmjax_dense_attention" not in jax.jit(lambda q, k, v: attention(q, k, v, **kw)).lower(q, k, v).as_text()
    with compiling_for("cuda"):
        assert not cpu_attention.dense_covers(q, k, v)
    sharded = dataclasses.replace(tuning("cpu"), sharded=True)
    assert "mmjax_dense_attention" not in jax.jit(sharded.traced(lambda q, k, v: attention(q, k, v))).lower(
        q, k, v).as_text()
    small = q[:, :20], k[:, :20], v[:, :20]
    with auto_reference_up_to(2**22):
        assert "mmjax_dense_attention" not in jax.jit(lambda q, k, v: attention(q, k, v)).lower(*small).as_text()
    assert ("mmjax_dense_attention" in jax.jit(lambda q, k, v: attention(q, k, v)).lower(*small).as_text()) == simd
    with pytest.raises(ValueError, match="full attention"):
        attention(q, k, v, causal=True, impl="cpu")


def test_dense_kernel_differentiates():
    rng = np.random.default_rng(6)
    q = jnp.asarray(rng.standard_normal((2, 21, 4, 16)), jnp.float32)
    k, v = (jnp.asarray(rng.standard_normal((2, 30, 2, 16)), jnp.float32) for _ in range(2))
    lens = jnp.asarray([30, 7], jnp.int32)
    from mmjax.attention import reference_attention

    def loss(fn):
        return lambda q, k, v: jnp.sin(fn(q, k, v)).sum()
    kernel = loss(lambda q, k, v: cpu_attention.dense_attention(q, k, v, lens, scale=0.3))
    ref = loss(lambda q, k, v: reference_attention(q, k, v, lengths=lens, scale=0.3))
    grad = jax.jit(jax.grad(kernel, argnums=(0, 1, 2)))
    assert "mmjax_dense_attention" in grad.lower(q, k, v).as_text()
    got, want = grad(q, k, v), jax.jit(jax.grad(ref, argnums=(0, 1, 2)))(q, k, v)
    for g, w in zip(got, want):
        assert rel_err(g, w) < 1e-5


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.int8, jnp.float8_e4m3fn],
                         ids=["f32", "bf16", "int8", "fp8"])
def test_kv_write_equals_scatter(dtype):
    """A prefill's K / V written by the kernel, bit for bit what XLA's scatter writes: every cache
    dtype (int8 / fp8 with their bf16 scales), tokens across segment boundaries, a row per token
    (packed prefill), rows past the cache and indexes outside the segments dropped; and
    `scatter_kv` takes it on the CPU with the XLA path's cache."""
    from mmjax.models.nn.kv_cache import scatter_kv
    rng = np.random.default_rng(11)
    slots, kvh, hd, lens, b, t = 3, 2, 20, (16, 8, 32), 2, 9
    kts, vs, scales = _cache(rng, dtype, slots, kvh, hd, lens)
    _, (k,), _ = _cache(rng, dtype, b, t, hd, (kvh,))        # V-shaped pieces [b, t, kvh, hd] of the dtype
    _, (v,), _ = _cache(rng, dtype, b, t, hd, (kvh,))
    new_scales = None if scales is None else tuple(jnp.asarray(rng.uniform(0.001, 0.01, (b, t, kvh)), jnp.bfloat16)
                                                   for _ in range(2))
    rows = jnp.asarray([[0] * t, [2, 2, 2, 5, 2, 2, -1, 2, 1]], jnp.int32)
    idx = jnp.asarray([list(range(10, 19)), [14, 15, 16, 17, 56, 60, 3, -2, 23]], jnp.int32)
    write = jax.jit(lambda kts, vs, k, v, scales, new_scales: cpu_attention.kv_write(
        kts, vs, k, v, rows, idx, scales=scales, new_scales=new_scales))
    got = write(kts, vs, k, v, scales, new_scales)
    want = cpu_attention.kv_write_reference(kts, vs, scales, k, v, new_scales, rows, idx)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_array_equal(np.asarray(g.astype(jnp.float32)), np.asarray(w.astype(jnp.float32)))
    assert sum(int((g != x).sum()) for g, x in zip(jax.tree.leaves(got), jax.tree.leaves((kts, vs, scales)))) > 0
    # wired: scatter_kv (one row per call row, q_index [b, t]) on the CPU takes the kernel, with
    # the bits of its XLA path
    kv = {"k": kts, "v": vs} if scales is None else {"k": kts, "v": vs, "k_scale": scales[0], "v_scale": scales[1]}
    kf, vf = (x.astype(jnp.float32) * 0.01 for x in (k, v))
    q_index = jnp.asarray([list(range(5, 14)), list(range(20, 29))], jnp.int32)
    def step():      # a fresh function per trace: the kernel choice is made at trace time
        return jax.jit(lambda kv, k, v: scatter_kv(kv, k, v, q_index, jnp.asarray([1, 0], jnp.int32)))
    assert "mmjax_kv_write" in step().lower(kv, kf, vf).as_text()
    got = step()(kv, kf, vf)
    with cpu_kernels(False):
        assert "mmjax_kv_write" not in step().lower(kv, kf, vf).as_text()
        want = step()(kv, kf, vf)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_array_equal(np.asarray(g.astype(jnp.float32)), np.asarray(w.astype(jnp.float32)))


def test_kv_write_differentiates():
    rng = np.random.default_rng(12)
    kts = [jnp.asarray(rng.standard_normal((2, 2, 8, L)), jnp.float32) for L in (6, 10)]
    vs = [jnp.asarray(rng.standard_normal((2, 2, L, 8)), jnp.float32) for L in (6, 10)]
    k, v = (jnp.asarray(rng.standard_normal((1, 5, 2, 8)), jnp.float32) for _ in range(2))
    rows, idx = jnp.asarray([[1, 1, 0, 1, 1]], jnp.int32), jnp.asarray([[3, 4, 5, 6, 7]], jnp.int32)

    def loss(fn):
        return lambda kts, vs, k, v: sum(jnp.sin(x).sum() * (i + 1) for i, x in enumerate(jax.tree.leaves(fn(kts, vs, k, v))))
    kernel = loss(lambda kts, vs, k, v: cpu_attention.kv_write(kts, vs, k, v, rows, idx)[:2])
    ref = loss(lambda kts, vs, k, v: cpu_attention.kv_write_reference(kts, vs, None, k, v, None, rows, idx)[:2])
    grad = jax.jit(jax.grad(kernel, argnums=(0, 1, 2, 3)))
    assert "mmjax_kv_write" in grad.lower(kts, vs, k, v).as_text()
    got, want = grad(kts, vs, k, v), jax.jit(jax.grad(ref, argnums=(0, 1, 2, 3)))(kts, vs, k, v)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert rel_err(g, w) < 1e-6


# ---- the paged cache (page pool + page table: mmjax/models/nn/kv_cache.py) -------------------------

# page size, kvh, n (queries per KV head), hd, each row's keys (ragged; 0: a row that sees
# nothing), window (None: causal)
PAGED_CASES = [
    (16, 2, 4, 64, [40, 77, 1, 0], None),
    (64, 1, 7, 80, [200, 64, 3], None),             # one page exactly full; 7 queries
    (7, 4, 2, 36, [50, 13, 30], 9),                  # a page of 7: not whole vectors; a window
    (128, 2, 1, 64, [300, 129], 100),                # > a key block in one page; a window
]


def _paged(rng, dtype, ps, kvh, hd, lengths, spare=3):
    """A page pool of `dtype` (and bf16 scales) with each row's pages (enough for `lengths` + 1
    positions) scattered over the pool in a random order, unused entries num_pages; `spare` pages
    no row holds -> (kts, vs, scales) of one pool segment, table int32 [rows, max_pages]."""
    lengths = np.asarray(lengths)
    max_pages = -(-(int(lengths.max()) + 1) // ps) + 1
    need = -(-(lengths + 1) // ps)
    num_pages = int(need.sum()) + spare
    order = iter(rng.permutation(num_pages))
    table = np.full((len(lengths), max_pages), num_pages, np.int32)
    for r, n in enumerate(need):
        table[r, :n] = [next(order) for _ in range(n)]
    kts, vs, scales = _cache(rng, dtype, num_pages, kvh, hd, [ps])
    return kts, vs, scales, jnp.asarray(table)


def _rows(kts, vs, scales, table):
    """The paged cache as dense cache rows (one segment each, `kv_cache.read_pages`: a copy)."""
    from mmjax.models.nn.kv_cache import dense_rows
    kv = {"k": kts, "v": vs} if scales is None else {"k": kts, "v": vs, "k_scale": scales[0], "v_scale": scales[1]}
    return dense_rows(kv, table, None, table.shape[0])


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.int8, jnp.float8_e4m3fn],
                         ids=["f32", "bf16", "int8", "fp8"])
def test_paged_kernels_equal_reference(dtype):
    """The decode, fused write + decode and prefill kernels over a paged cache (rows' pages
    scattered over the pool, page sizes 7-128, ragged rows, windows, int8 / fp8 with their
    scales) against float64 over the rows the page table names, on every code path; the XLA
    reference (`reference`, `write_reference` with pages) agrees; the fused write lands bit for
    bit where `write_reference` puts it (a parked row, past its pages, writes nothing)."""
    rng = np.random.default_rng(21)
    cases = []
    for ps, kvh, n, hd, lengths, window in PAGED_CASES:
        kts, vs, scales, table = _paged(rng, dtype, ps, kvh, hd, lengths)
        b, scale = len(lengths), hd ** -0.5
        hi = np.asarray(lengths, np.int32)
        lo = np.zeros_like(hi) if window is None else (hi - window).astype(np.int32)
        q = jnp.asarray(rng.standard_normal((b, kvh, n, hd)), jnp.float32)
        dk, dv, dsc = _rows(kts, vs, scales, table)
        want = _want(q, dk, dv, lo, hi, scale, dsc)
        assert rel_err(cpu_attention.reference(q, kts, vs, jnp.asarray(lo), jnp.asarray(hi), scale, scales,
                                               pages=table), want) < 4e-6
        # the fused write: row i's new token at index hi_i - 1 (its last key), the last row parked
        new_k, new_v, new_sc = _cache(rng, dtype, b, kvh, hd, [1])
        k, v = new_k[0][..., 0], new_v[0][:, :, 0]
        ns = None if new_sc is None else (new_sc[0][0][..., 0], new_sc[1][0][..., 0])
        pos = np.maximum(hi - 1, 0)
        pos[-1] = table.shape[1] * ps                                   # parked past the row's pages
        pos = jnp.asarray(pos, jnp.int32)
        wk, wv, wsc = cpu_attention.write_reference(kts, vs, scales, k, v, ns, pos, table)
        assert sum(int((np.asarray(a.astype(jnp.float32)) != np.asarray(c.astype(jnp.float32))).any())
                   for a, c in zip(kts + vs, wk + wv)) == 1 + 1       # K and V pools written
        want_w = _want(q, *_rows(wk, wv, wsc, table)[:2], lo, hi, scale, _rows(wk, wv, wsc, table)[2])
        # prefill: t tokens ending at each row's length, rows in another order, one past the table
        t, g = 5, max(n // 2, 1)
        slots = np.asarray(list(rng.permutation(b))[:max(b - 1, 1)] + [b], np.int32)
        start = np.maximum(hi[np.minimum(slots, b - 1)] - t + 2, 0)         # the last 2 tokens past kv_len
        kv_len = int(start.max()) + t - 2
        plo, phi = _prefill_ranges(start, t, kv_len, window)
        phi = np.minimum(phi, hi[np.minimum(slots, b - 1)][:, None])         # within each row's pages
        pq = jnp.asarray(rng.standard_normal((len(slots), kvh, t * g, hd)), jnp.float32)
        pwant = _want_prefill(np.asarray(pq), dk, dv, plo, phi, slots, scale, dsc)
        assert rel_err(cpu_attention.reference(pq, kts, vs, jnp.asarray(plo), jnp.asarray(phi), scale, scales,
                                               jnp.asarray(slots), table), pwant) < 4e-6
        cases.append((ps, q, kts, vs, scales, table, lo, hi, want, k, v, ns, pos, (wk, wv, wsc), want_w,
                      pq, plo, phi, slots, pwant, scale))
    decode = jax.jit(lambda q, kts, vs, lo, hi, scale, scales, table: cpu_attention.decode_attention(
        q, kts, vs, lo, hi, scale=scale, scales=scales, pages=table), static_argnums=5)
    write = jax.jit(lambda q, k, v, kts, vs, lo, hi, pos, scale, scales, ns, table: cpu_attention.decode_attention_write(
        q, k, v, kts, vs, lo, hi, pos, scale=scale, scales=scales, new_scales=ns, pages=table), static_argnums=8)
    prefill = jax.jit(lambda q, kts, vs, lo, hi, slots, scale, scales, table: cpu_attention.prefill_attention(
        q, kts, vs, lo, hi, slots, scale=scale, scales=scales, pages=table), static_argnums=6)
    for path in cpu_library.isas():
        with kernel_path(path):
            for (ps, q, kts, vs, scales, table, lo, hi, want, k, v, ns, pos, written, want_w,
                 pq, plo, phi, slots, pwant, scale) in cases:
                lo_, hi_ = jnp.asarray(lo), jnp.asarray(hi)
                got = decode(q, kts, vs, lo_, hi_, scale, scales, table)
                assert rel_err(got, want) < 4e-6, (path, ps)
                assert not np.asarray(got[hi == 0]).any()                      # nothing visible: zeros
                out, *pools = write(q, k, v, kts, vs, lo_, hi_, pos, scale, scales, ns, table)
                for g, w in zip(jax.tree.leaves(pools), jax.tree.leaves(written)):
                    np.testing.assert_array_equal(np.asarray(g.astype(jnp.float32)), np.asarray(w.astype(jnp.float32)))
                assert rel_err(out, want_w) < 4e-6, (path, ps)
                got = prefill(pq, kts, vs, jnp.asarray(plo), jnp.asarray(phi), jnp.asarray(slots), scale, scales, table)
                assert rel_err(got, pwant) < 4e-6, (path, ps)
                assert not np.asarray(got[-1]).any()                          # a row past the page table


def _paged_layer(rng, dtype, ps, lengths, kvh=2, hd=64):
    """A paged layer dict ({"k", "v"(, scales)}: kv_cache.kv_layer over the pool) holding random
    K / V at each row's first `lengths` positions (written by scatter_kv, quantized for int8),
    and its page table."""
    from mmjax.models.nn.kv_cache import kv_layer, scatter_kv
    _, _, _, table = _paged(rng, jnp.float32, ps, kvh, hd, lengths)
    num_pages, max_len = int(table.max()) + 1, table.shape[1] * ps
    layer = kv_layer(num_pages, kvh, hd, [ps], dtype)
    k, v = (jnp.asarray(rng.standard_normal((len(lengths), max_len, kvh, hd)), jnp.float32) for _ in range(2))
    idx = np.arange(max_len)[None].repeat(len(lengths), 0)
    idx = jnp.asarray(np.where(idx < np.asarray(lengths)[:, None], idx, -1), jnp.int32)
    return scatter_kv(layer, k, v, idx, jnp.arange(len(lengths)), table), table


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.int8], ids=["f32", "int8"])
def test_paged_cache_attention_takes_the_kernels_with_the_xla_paths_outputs(dtype):
    """On the CPU a paged layer's decode (`cache_attention`, and the fused `cpu_decode_write`)
    and prefill (rows in any cache rows) take the kernels, without a per-segment cond, with the
    outputs (and for the write the pool, bit for bit) of XLA's paged path; page sizes 16 and 64,
    ragged rows, a sliding window, an int8 pool."""
    from mmjax.models.nn.kv_cache import cpu_decode_write, layer_scales, scatter_kv
    rng = np.random.default_rng(22)
    lengths = [70, 5, 130]
    for ps in (16, 64):
        layer, table = _paged_layer(rng, dtype, ps, lengths)
        scales = layer_scales(layer)
        target = "mmjax_decode_attention_" + {jnp.float32: "f32", jnp.int8: "s8"}[dtype]
        # decode: each row's token at its length
        q = jnp.asarray(rng.standard_normal((3, 1, 8, 64)), jnp.float32)
        q_index = jnp.asarray(lengths, jnp.int32)[:, None]

        def decode(q, layer, kv_len, window):
            return cache_attention(q, layer["k"], layer["v"], q_index, kv_len, reduce_small=True,
                                   mask=None if window is None else MaskSpec(window), scales=layer_scales(layer),
                                   pages=table)

        def fused(q, layer, kv_len, window):
            k, v = q[:, :, :2] * 0.5, q[:, :, 2:4]
            mask = None if window is None else MaskSpec(window)
            if cpu_library.enabled():
                return cpu_decode_write(q, k, v, layer, q_index[:, 0], kv_len, mask, pages=table)
            layer = scatter_kv(layer, k, v, q_index, jnp.arange(3), table)
            return decode(q, layer, kv_len, window), layer
        for kv_len in (131, jnp.int32(131)):
            for window in (None, 24):
                for fn in (decode, fused):
                    step = jax.jit(fn, static_argnums=3)
                    text = step.lower(q, layer, kv_len, window).as_text()
                    want_call = target if fn is decode else target.replace("attention_", "attention_write_")
                    assert want_call in text and "stablehlo.case" not in text, (fn.__name__, ps)
                    got = step(q, layer, kv_len, window)
                    with cpu_kernels(False):
                        xla = jax.jit(lambda *a, fn=fn: fn(*a), static_argnums=3)     # a fresh trace
                        assert "mmjax_decode_attention" not in xla.lower(q, layer, kv_len, window).as_text()
                        want = xla(q, layer, kv_len, window)
                    if fn is fused:
                        for g, w in zip(jax.tree.leaves(got[1]), jax.tree.leaves(want[1])):
                            np.testing.assert_array_equal(np.asarray(g.astype(jnp.float32)),
                                                          np.asarray(w.astype(jnp.float32)))
                        got, want = got[0], want[0]
                    assert rel_err(got, want) < 2e-6, (ps, kv_len, window, fn.__name__)
        # prefill: 9 new tokens of rows 2 and 0 (cache rows in another order) ending at their lengths
        slots = jnp.asarray([2, 0], jnp.int32)
        starts = jnp.asarray([121, 61], jnp.int32)
        pq_index = starts[:, None] + jnp.arange(9)[None]
        pq = jnp.asarray(rng.standard_normal((2, 9, 8, 64)), jnp.float32)

        def prefill(q, layer, window):
            return cache_attention(q, layer["k"], layer["v"], pq_index, jnp.int32(130), slots,
                                   mask=None if window is None else MaskSpec(window), starts=starts,
                                   scales=layer_scales(layer), pages=table)
        for window in (None, 24):
            step = jax.jit(prefill, static_argnums=2)
            text = step.lower(pq, layer, window).as_text()
            assert target.replace("decode", "prefill") in text and "stablehlo.case" not in text
            got = step(pq, layer, window)
            with cpu_kernels(False):
                xla = jax.jit(lambda *a: prefill(*a), static_argnums=2)           # a fresh trace
                assert "mmjax_prefill_attention" not in xla.lower(pq, layer, window).as_text()
                want = xla(pq, layer, window)
            assert rel_err(got, want) < 2e-6, (ps, window)


def test_paged_kernel_calls_differentiate():
    """Gradients through the paged decode, fused write + decode and prefill kernels equal those
    through their XLA references with the same page table."""
    rng = np.random.default_rng(23)
    kts, vs, _, table = _paged(rng, jnp.float32, 8, 2, 16, [20, 9])
    q = jnp.asarray(rng.standard_normal((2, 2, 3, 16)), jnp.float32)
    k, v = (jnp.asarray(rng.standard_normal((2, 2, 16)), jnp.float32) for _ in range(2))
    lo, hi, pos = jnp.asarray([0, 2], jnp.int32), jnp.asarray([20, 9], jnp.int32), jnp.asarray([19, 8], jnp.int32)
    plo, phi = (jnp.asarray(x) for x in _prefill_ranges([15, 3], 2, 17, None))
    slots = jnp.asarray([1, 0], jnp.int32)
    pq = jnp.asarray(rng.standard_normal((2, 2, 6, 16)), jnp.float32)

    def loss(fused, kernel):
        def f(q, k, v, kts, vs, pq):
            if kernel:
                out = cpu_attention.decode_attention(q, kts, vs, lo, hi, scale=0.3, pages=table)
                wout, wk, wv, _ = (cpu_attention.decode_attention_write(q, k, v, kts, vs, lo, hi, pos, scale=0.3,
                                                                        pages=table) if fused else (0.0, [], [], None))
                pout = cpu_attention.prefill_attention(pq, kts, vs, plo, phi, slots, scale=0.3, pages=table)
            else:
                out = cpu_attention.reference(q, kts, vs, lo, hi, 0.3, pages=table)
                wout, wk, wv = 0.0, [], []
                if fused:
                    wk, wv, _ = cpu_attention.write_reference(kts, vs, None, k, v, None, pos, table)
                    wout = cpu_attention.reference(q, wk, wv, lo, hi, 0.3, pages=table)
                pout = cpu_attention.reference(pq, kts, vs, plo, phi, 0.3, None, slots, table)
            return (jnp.sin(out).sum() + jnp.sin(wout).sum() + jnp.cos(pout).sum()
                    + sum(jnp.cos(x).sum() for x in wk + wv) * 1e-3)
        return f
    grad = jax.jit(jax.grad(loss(True, True), argnums=range(6)))
    text = grad.lower(q, k, v, kts, vs, pq).as_text()
    assert all(t in text for t in ("mmjax_decode_attention_f32", "mmjax_decode_attention_write_f32",
                                   "mmjax_prefill_attention_f32"))
    got = grad(q, k, v, kts, vs, pq)
    want = jax.jit(jax.grad(loss(True, False), argnums=range(6)))(q, k, v, kts, vs, pq)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert rel_err(g, w) < 1e-5
