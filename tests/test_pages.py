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


# ---- the engine on pages (tiny LLaVA) -------------------------------------------------------------

GREEDY = dict(temperature=0.0, ignore_eos=True)


def _prompt(rng, n_words: int, n_images: int = 0) -> str:
    from tiny_checkpoints import WORDS
    return "USER: " + "<image>\n" * n_images + " ".join(rng.choice(WORDS[:60], n_words)) + " ASSISTANT:"


def _check_no_leaks(engine):
    kv = engine.pages
    kv.check()
    assert not kv.holders and kv.pool.num_used == 0 and engine.stats()["kv_pages_used"] == 0


@pytest.fixture(scope="module")
def workload(llava_dirs):
    """Requests of mixed lengths with images; greedy and seeded sampling; their outputs on a cache
    with a row per slot (page_size 0), the reference."""
    import mmjax
    from conftest import noise_image
    path = llava_dirs["gqa"]
    rng = np.random.default_rng(5)
    ref = mmjax.load(path, max_num_seqs=4, max_model_len=256, prefill_chunk=64, page_size=0)
    assert ref.engine.pages is None
    reqs = []
    for i in range(6):
        n_img = i % 2
        imgs = ref.prepare_images([noise_image(70 + i, 40, 50)] * n_img)
        # greedy, and seeded sampling (request 3: n = 2)
        sp = (mmjax.SamplingParams(max_tokens=int(rng.integers(20, 48)), logprobs=1, **GREEDY) if i % 3
              else mmjax.SamplingParams(max_tokens=30, temperature=0.8, seed=i, logprobs=1, ignore_eos=True,
                                        n=2 if i == 3 else 1))
        reqs.append({"prompt": _prompt(rng, int(rng.integers(3, 40)), n_img), "images": imgs, "sampling": sp})
    outs = ref.generate([{"prompt": r["prompt"], "images": r["images"]} for r in reqs], [r["sampling"] for r in reqs])
    return path, reqs, outs, ref


def _same(outs, ref):
    """Same ids and logprobs (1e-4) as the reference, the n = 2 sibling's too."""
    assert sum(len(o.siblings) for o in ref) == 1
    for o, r in zip(outs, ref):
        assert len(o.siblings) == len(r.siblings)
        for a, b in zip(o.siblings, r.siblings):
            assert a.token_ids == b.token_ids
        assert o.token_ids == r.token_ids
        assert max(abs(x[i] - y[i]) for x, y, i in zip(o.logprobs, r.logprobs, o.token_ids)) <= 1e-4


@pytest.mark.parametrize("page_size", [8, 64])
def test_page_sizes_give_the_same_outputs(workload, page_size):
    """A page-size sweep: the same greedy ids (and seeded samples, logprobs within 1e-4) as the
    cache with a row per slot; no page leaked once all finished."""
    import mmjax
    path, reqs, ref, _ = workload
    vlm = mmjax.load(path, max_num_seqs=4, max_model_len=256, prefill_chunk=64, page_size=page_size)
    assert vlm.engine.runner.paged and vlm.engine.runner.page_size == page_size
    outs = vlm.generate([{"prompt": r["prompt"], "images": r["images"]} for r in reqs], [r["sampling"] for r in reqs])
    _same(outs, ref)
    _check_no_leaks(vlm.engine)


def test_preemption_recomputes_the_same_outputs(workload):
    """A KV budget of 14 pages of 16 (224 positions: one max_model_len sequence and a little) for
    four slots: requests are preempted mid-decode and recomputed, with the same ids / logprobs
    as the unconstrained run; none fails; no page leaked."""
    import mmjax
    path, reqs, ref, _ = workload
    ref_runner = workload[3].engine.runner           # 4 rows of 256 positions: a page of 16 is 1/64 of them
    page = ref_runner.memory_report()["kv_cache_bytes_max_device"] // 64
    vlm = mmjax.load(path, max_num_seqs=4, max_model_len=256, prefill_chunk=64, page_size=16,
                     kv_cache_bytes=16 * page)
    eng = vlm.engine
    assert eng.runner.num_pages == 16 and eng.runner.page_bytes() == page
    seen = []
    orig = eng.pages.check

    def step_and_check():      # the invariants hold after every step
        out = type(eng).step(eng)
        orig()
        seen.append(eng.stats()["kv_pages_used"])
        return out
    eng.step = step_and_check
    restored = []
    restore = eng.runner.restore_row
    eng.runner.restore_row = lambda slot, row: (restored.append(slot), restore(slot, row))
    outs = vlm.generate([{"prompt": r["prompt"], "images": r["images"]} for r in reqs], [r["sampling"] for r in reqs])
    # preempted mid-decode: resumed from recomputed KV and the saved decode-state row
    assert eng.stats()["preemptions"] > 0 and restored and max(seen) <= 16
    _same(outs, ref)
    assert all(o.finish_reason == "length" for o in outs)
    _check_no_leaks(eng)


def test_shared_image_and_system_prompt_use_their_pages_once(llava_dirs):
    """16 concurrent requests with the same image and system prompt: the prefix's full pages are
    held once (refcounts 16), `cached_tokens` counts them for all but the first; int8 KV pages."""
    import mmjax
    from conftest import noise_image
    vlm = mmjax.load(llava_dirs["gqa"], max_num_seqs=16, max_model_len=256, prefill_chunk=256, page_size=8,
                     kv_cache_dtype="int8")
    eng = vlm.engine
    img = vlm.prepare_images([noise_image(9, 48, 48)])
    system = "USER: you are a careful assistant who answers in short words only. <image>\n"
    sp = mmjax.SamplingParams(max_tokens=4, **GREEDY)
    first = eng.add_request(system + "question zero ASSISTANT:", img, sp)
    eng.run_until_done([first])
    ids = [eng.add_request(system + f"question {i} ASSISTANT:", img, sp) for i in range(1, 17)]
    eng.step()              # all 16 admitted, each holding its whole prompt's pages
    reqs = [eng.requests[i] for i in ids]
    n_prefix = len(vlm.tokenizer.encode_prompt(system, [img[0].num_tokens]))
    shared = n_prefix // 8
    assert shared >= 3 and all(r.pages[:shared] == reqs[0].pages[:shared] for r in reqs)
    assert (eng.pages.pool.refs[reqs[0].pages[:shared]] == 16).all()
    assert eng.stats()["kv_pages_used"] == sum(len(r.pages) for r in reqs) - 15 * shared
    outs = eng.run_until_done(ids)
    assert all(o.cached_tokens >= shared * 8 and o.cached_tokens % 8 == 0 for o in outs)
    assert eng.stats()["prefix_hit_rate"] > 0.5
    # int8 pages give what int8 slot rows give
    ref = mmjax.load(llava_dirs["gqa"], max_num_seqs=2, max_model_len=256, page_size=0, kv_cache_dtype="int8")
    assert ref.generate([{"prompt": system + "question 3 ASSISTANT:", "images": img}], sp)[0].token_ids \
        == outs[2].token_ids
    _check_no_leaks(eng)
