"""The paged Pallas kernel (mmjax/attention/paged.py), interpreted here, against XLA's paged path
(kv_cache.cache_attention over the page table with the kernels off: the oracle), through the
dispatch a GPU step takes (`attention_kernel` -> "gpu_paged"): decode rows and prefill chunks of
ragged lengths, pages smaller than a key block (each key's page gathered), equal to one and
holding several, a page size that is no power of two, rows' pages scattered over the pool in a
random order, GQA, a sliding window, chunked attention, bf16 and int8 / fp8 caches. The CUDA
lowering of a paged runner's steps is in test_cuda_lowering."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mmjax.attention.paged import paged_attention
from mmjax.backend import compiling_for, cpu_kernels, pallas_kernels
from mmjax.models.nn.kv_cache import attention_kernel, cache_attention, kv_layer, layer_scales, scatter_kv
from mmjax.models.nn.metadata import MaskSpec


def _paged_cache(rng, page, max_pages, num_pages, lengths, kvh, hd, dtype):
    """A paged layer of `num_pages` pages holding rows of `lengths` cached positions (random K/V
    written through scatter_kv), rows' pages in a random order over the pool, unused entries
    num_pages (the host's marker) -> (layer dict, table [rows, max_pages])."""
    rows = len(lengths)
    order = rng.permutation(num_pages)[:rows * max_pages].reshape(rows, max_pages)
    table = np.where(np.arange(max_pages)[None] < -(-lengths[:, None] // page), order, num_pages).astype(np.int32)
    layer = kv_layer(num_pages, kvh, hd, [page], dtype)
    max_len = max_pages * page
    idx = np.broadcast_to(np.arange(max_len), (rows, max_len))
    k, v = (jnp.asarray(rng.normal(size=(rows, max_len, kvh, hd)), jnp.float32) for _ in range(2))
    keep = jnp.asarray(np.where(idx < lengths[:, None], idx, 10 ** 6), jnp.int32)
    return scatter_kv(layer, k, v, keep, jnp.arange(rows), jnp.asarray(table)), jnp.asarray(table)


CASES = {   # page, t, group, window, chunk, cache dtype
    "decode-page8-gqa4": (8, 1, 4, None, None, jnp.float32),
    "decode-page64-window": (64, 1, 2, 37, None, jnp.float32),
    "decode-page16-int8": (16, 1, 4, None, None, jnp.int8),
    "prefill-page16-gqa2": (16, 7, 2, None, None, jnp.float32),
    "prefill-page64-two-query-blocks": (64, 40, 2, 45, None, jnp.float32),     # 80 query rows: 2 blocks of 64
    "prefill-page128-window": (128, 20, 1, 50, None, jnp.float32),
    "prefill-page24-chunk": (24, 9, 2, None, 40, jnp.float32),
    "prefill-page32-bf16": (32, 5, 4, 33, None, jnp.bfloat16),
    "prefill-page16-fp8": (16, 6, 2, 29, None, jnp.float8_e4m3fn),
}


@pytest.mark.parametrize("case", list(CASES))
def test_paged_kernel_matches_xla_paged_path(case):
    page, t, group, window, chunk, dtype = CASES[case]
    rng = np.random.default_rng(len(case))
    kvh, hd = 2, 16
    h = kvh * group
    max_pages = -(-300 // page)
    num_pages = 5 * max_pages + 3
    # cached lengths after this call's t tokens are written; row 3 has nothing (a parked / free row)
    lengths = np.array([t + 2, 150, max_pages * page - 1, 0, 61], np.int32)
    layer, table = _paged_cache(rng, page, max_pages, num_pages, lengths, kvh, hd, dtype)
    b = len(lengths)
    model = jnp.bfloat16 if dtype == jnp.bfloat16 else jnp.float32
    q = jnp.asarray(rng.normal(size=(b, t, h, hd)), model)
    q_index = jnp.asarray(np.maximum(lengths[:, None] - t + np.arange(t)[None], 0), jnp.int32)
    if t == 1:      # decode: rows [0, b); the free row parked past the cache, as the engine does
        q_index = q_index.at[3, 0].set(max_pages * page)
        slots = None
    else:           # prefill: the rows in another order (cache rows `slots`), padding past the end
        slots = jnp.asarray([4, 1, 0, 3, 2], jnp.int32)
        q_index = q_index[slots]
        q_index = q_index.at[3].set(10 ** 6)
    kv_len = jnp.int32(int(lengths.max()))          # traced, as a step's
    mask = None if window is None and chunk is None else MaskSpec(sliding_window=window, chunk=chunk)
    scales = layer_scales(layer)

    def attend():
        return cache_attention(q, layer["k"], layer["v"], q_index, kv_len, slots, mask=mask, scale=0.3,
                               scales=scales, pages=table)
    # (each side jitted by its own wrapper: traced inside its own kernel choice)
    with pallas_kernels(False), cpu_kernels(False):
        assert attention_kernel(t, slots, mask, layer["k"], layer["v"], scales, table) is None
        want = jax.jit(lambda: attend())()
    with pallas_kernels(True):
        assert attention_kernel(t, slots, mask, layer["k"], layer["v"], scales, table) == "gpu_paged"
        jaxpr = str(jax.make_jaxpr(attend)())
        got = jax.jit(lambda: attend())()
    # one kernel call, no per-run lax.cond or gathered copy of the pages
    assert jaxpr.count("name=mmjax_paged_attention") == 1 and " cond[" not in jaxpr
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert np.abs(want).max() > 0.1
    tol = 2e-5 if model == jnp.float32 else 2e-2
    live = np.asarray(q_index < kv_len)             # padding / parked queries: zeros from the kernel
    np.testing.assert_allclose(got[live], want[live], rtol=tol, atol=tol)
    np.testing.assert_array_equal(got[~live], 0.0)


def test_spans_keep_the_xla_path():
    """Image runs (bidirectional spans) are not ranges the kernel takes: XLA's paged path."""
    layer = kv_layer(8, 2, 16, [16], jnp.float32)
    table = jnp.zeros((2, 4), jnp.int32)
    mask = MaskSpec(spans=jnp.zeros((2, 3), jnp.int32))
    with pallas_kernels(True):
        assert attention_kernel(3, jnp.arange(2), mask, layer["k"], layer["v"], None, table) is None


def test_paged_kernel_checks_its_operands():
    q = jnp.zeros((2, 2, 4, 16))
    kt, v = jnp.zeros((8, 2, 16, 16)), jnp.zeros((8, 2, 16, 16))
    lo = hi = jnp.zeros((2, 4), jnp.int32)
    table = jnp.zeros((2, 4), jnp.int32)
    with pytest.raises(ValueError, match="head_dim"):
        paged_attention(jnp.zeros((2, 2, 4, 12)), kt, v, table, lo, hi, scale=1.0)
    with pytest.raises(ValueError, match="pool"):
        paged_attention(q, kt, jnp.zeros((8, 2, 8, 16)), table, lo, hi, scale=1.0)
    with pytest.raises(ValueError, match="table"):
        paged_attention(q, kt, v, table[:1], lo, hi, scale=1.0)
    with pytest.raises(ValueError, match="block_k"):
        paged_attention(q, kt, v, table, lo, hi, scale=1.0, block_k=48)


@pytest.mark.parametrize("page,n,hd", [(16, 4, 128), (64, 4, 128), (64, 200, 128), (24, 20, 128), (32, 8, 256)])
def test_paged_kernel_lowers_for_cuda(page, n, hd):
    """The Triton lowering of both key-block forms (one page per block; a gather over pages)
    for decode groups and prefill chunks of several query blocks, bf16 and int8; head_dim 256
    (key blocks of 32)."""
    triton = jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")
    for pool, scaled in ((jnp.bfloat16, False), (jnp.int8, True)):
        sds = jax.ShapeDtypeStruct
        args = [sds((3, 2, n, hd), jnp.bfloat16), sds((40, 2, hd, page), pool), sds((40, 2, page, hd), pool),
                sds((3, 9), jnp.int32), sds((3, n), jnp.int32), sds((3, n), jnp.int32)]
        if scaled:
            args += [sds((40, 2, page), jnp.bfloat16)] * 2

        def fn(q, kt, v, table, lo, hi, *sc):
            return paged_attention(q, kt, v, table, lo, hi, scale=0.1, scales=sc or None)
        with compiling_for("cuda"):
            exp = jax.export.export(jax.jit(fn), platforms=("cuda",), disabled_checks=[triton])(*args)
        assert exp.mlir_module().count("__gpu$xla.gpu.triton") == 1
