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
