"""Paged KV: the host page pool and page tables (mmjax/serving/pages.py) and the paged cache
layout's reads and writes (mmjax/models/nn/kv_cache.py)."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from mmjax.serving.pages import KVPages, PagePool, page_hashes


def _req(keys, ps, salt=""):
    keys = np.asarray(keys, np.int64)
    return SimpleNamespace(prompt_len=len(keys), page_hashes=page_hashes(keys, ps, salt), pages=[], slot=None)


def test_page_hashes_chain():
    a = np.arange(40)
    h = page_hashes(a, 8)
    assert len(h) == 5 and len(set(h)) == 5
    b = a.copy()
    b[20] = 999                                   # page 2 differs: pages 0, 1 agree, 2.. differ
    hb = page_hashes(b, 8)
    assert hb[:2] == h[:2] and all(x != y for x, y in zip(hb[2:], h[2:]))
    assert page_hashes(a, 8, salt="adapter-1")[0] != h[0]       # an adapter never shares
    assert page_hashes(a[:15], 8) == h[:1]                      # the partial page has none
    # an image token's key carries its content hash (caches.token_keys): a different image never hits
    from mmjax.serving.caches import token_keys
    im = lambda key: SimpleNamespace(key=key, num_tokens=8)     # noqa: E731
    ids, pos = np.zeros(16, np.int64), np.arange(8, 16)
    assert page_hashes(token_keys(ids, [im("x")], pos), 8)[1] != page_hashes(token_keys(ids, [im("y")], pos), 8)[1]
    assert page_hashes(token_keys(ids, [im("x")], pos), 8) == page_hashes(token_keys(ids, [im("x")], pos), 8)


def test_pool_alloc_release_evict():
    pool = PagePool(4)
    a = pool.alloc(3)
    assert pool.num_free == 1 and pool.alloc(2) is None and pool.num_free == 1
    pool.register(a[0], b"h0")
    pool.register(a[1], b"h1")
    pool.check([a])
    pool.release(a)
    assert pool.num_free == 4 and pool.stats()["pages_cached"] == 2
    pool.check([])
    assert pool.match([b"h0", b"h1", b"h2"]) == a[:2]
    pool.share(a[:1])                             # h0 held again: not evictable
    b = pool.alloc(3)                             # 2 free + the evictable h1 (forgotten)
    assert b is not None and a[1] in b and pool.lookup(b"h1") is None and pool.lookup(b"h0") == a[0]
    pool.check([a[:1], b])
    pool.release(b)
    pool.release(a[:1])
    pool.clear_cache()
    assert pool.num_free == 4 and pool.stats()["pages_cached"] == 0
    pool.check([])
    with pytest.raises(AssertionError):
        pool.release([0])


def test_kvpages_share_grow_fork_release():
    ps = 4
    kv = KVPages(num_pages=16, page_size=ps, num_slots=4, max_model_len=32)
    system = list(range(100, 110))                # 10 tokens: 2 full pages shared
    r1, r2 = _req(system + [1, 2, 3], ps), _req(system + [7, 8], ps)
    assert kv.admit(r1, 0, kv.cached(r1), r1.prompt_len)
    kv.written(r1, r1.prompt_len)
    kv.check()
    hit = kv.cached(r2)
    assert hit == r1.pages[:2]                    # the shared system prompt, by page
    assert kv.admit(r2, 1, hit, r2.prompt_len)
    assert kv.pool.refs[r1.pages[0]] == 2 and len(r2.pages) == 3
    kv.check()
    assert kv.grow(r2, 20) and len(r2.pages) == 5 and kv.table[1, 4] == r2.pages[4]
    kv.check()
    child = SimpleNamespace(pages=[], slot=None)
    copies = kv.fork(r1, child, 2, 13)            # 3 full pages shared, the 4th copied
    assert child.pages[:3] == r1.pages[:3] and copies == [(r1.pages[3], child.pages[3])]
    kv.check()
    for r in (r1, r2, child):
        kv.release(r)
    kv.check()
    assert kv.pool.num_used == 0 and kv.pool.num_free == 16
    # the released prompt pages stay cached: a third request with the same prompt hits them
    r3 = _req(system + [1, 2, 3], ps)
    assert len(kv.cached(r3)) == 3
    # a request that needs more than the pool: nothing taken
    big = _req(list(range(200)), ps)
    assert not kv.admit(big, 3, [], 17 * ps) and kv.pool.num_used == 0
    kv.check()


@pytest.mark.parametrize("t,window", [(1, None), (5, None), (5, 20)])
def test_paged_attention_matches_slots(t, window):
    """The paged layout's writes and attention (XLA path) == the slot layout's (the CPU kernels
    where they apply), rows' pages scattered over the pool in a random order."""
    import jax
    import jax.numpy as jnp
    from mmjax.models.nn.kv_cache import cache_attention, kv_layer, kv_segments, scatter_kv
    from mmjax.models.nn.metadata import MaskSpec
    rng = np.random.default_rng(0)
    slots, max_len, ps, kvh, hd, h = 3, 96, 16, 2, 8, 4
    max_pages, num_pages = max_len // ps, 20
    lengths = np.array([40, 77, 9], np.int32)
    pool_order = rng.permutation(num_pages)[:slots * max_pages].reshape(slots, max_pages)
    table = np.where(np.arange(max_pages)[None] < -(-(lengths[:, None] + t) // ps), pool_order, num_pages)
    table = table.astype(np.int32)
    dense = kv_layer(slots, kvh, hd, kv_segments(max_len), jnp.float32)
    paged = kv_layer(num_pages, kvh, hd, [ps], jnp.float32)
    # the cached prefixes, then the new tokens, written the same way into both
    idx = np.broadcast_to(np.arange(max_len), (slots, max_len))
    k0, v0 = (jnp.asarray(rng.normal(size=(slots, max_len, kvh, hd)), jnp.float32) for _ in range(2))
    keep = jnp.asarray(np.where(idx < lengths[:, None], idx, 10 ** 6), jnp.int32)
    rows = jnp.arange(slots)
    dense = scatter_kv(dense, k0, v0, keep, rows)
    paged = scatter_kv(paged, k0, v0, keep, rows, jnp.asarray(table))
    q = jnp.asarray(rng.normal(size=(slots, t, h, hd)), jnp.float32)
    q_index = jnp.asarray(lengths[:, None] - t + 1 + np.arange(t)[None], jnp.int32) if t > 1 else \
        jnp.asarray(lengths[:, None], jnp.int32)
    mask = None if window is None else MaskSpec(sliding_window=window)
    kv_len = int(lengths.max()) + 1
    use = None if t == 1 else jnp.asarray([2, 0, 1], jnp.int32)
    perm = np.arange(slots) if use is None else np.asarray(use)
    qi = q_index[perm]
    a = cache_attention(q, dense["k"], dense["v"], qi, kv_len, use, mask=mask)
    b = cache_attention(q, paged["k"], paged["v"], qi, kv_len, use, mask=mask, pages=jnp.asarray(table))
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)
    # an unused table entry (num_pages) drops its write: the pool is unchanged beyond the rows' pages
    stray = scatter_kv(paged, k0[:, :1], v0[:, :1], jnp.full((slots, 1), max_len - 1, jnp.int32), rows,
                       jnp.asarray(table))
    same = table[:, -1] == num_pages
    assert same.any()
    used = np.unique(table[~same, -1])
    untouched = np.setdiff1d(np.arange(num_pages), used)
    np.testing.assert_array_equal(np.asarray(stray["k"][0])[untouched], np.asarray(paged["k"][0])[untouched])
    jax.clear_caches()
