"""Paged KV bookkeeping (host only): a pool of fixed-size KV pages, each request's page list,
and prefix sharing by page.

The device cache of a paged layer is `[num_pages, ...page_size positions...]`; a request owns
the pages its tokens occupy (cache index i of the request lives at offset i % page_size of page
`req.pages[i // page_size]`), grown as tokens arrive and returned when it ends. A full page is
keyed by a hash chain over its tokens' prefix-cache keys (`page_hashes`: the keys already fold
each image's / video's content hash in, `caches.token_keys`; a `salt`, e.g. a LoRA adapter's
name, is folded into the chain's start), so two requests whose prompts agree up to a page
boundary map that page to the same hash and share it: reference counted, never copied. A page
whose last holder ended stays cached under its hash (evictable, least recently released first)
until the free list runs dry; that is vLLM's / SGLang's prefix cache at page granularity.

`PagePool`: free list, reference counts, hash -> page map, LRU of evictable cached pages.
`KVPages`: the per-request page lists and the runner's host page table `[slots, max_pages]`
(unused entries = num_pages: an out-of-range page, whose writes the device drops).
"""
from __future__ import annotations

import hashlib
from collections import OrderedDict, deque

import numpy as np


def page_hashes(keys: np.ndarray, page_size: int, salt: str | bytes = b"") -> list[bytes]:
    """One hash per full page of `keys` [n] int64 (`caches.token_keys`: token ids, image tokens
    keyed by their image's content): h_i = blake2b(h_{i-1} || keys of page i), h_{-1} =
    blake2b(salt). A page's hash names its whole prefix, so equal hashes mean equal KV (same
    tokens, same images, same adapter, same position). The partial last page has none."""
    salt = salt.encode() if isinstance(salt, str) else salt
    h = hashlib.blake2b(b"mmjax-pages|" + salt, digest_size=16).digest()
    keys = np.ascontiguousarray(np.asarray(keys, np.int64))
    out = []
    for i in range(len(keys) // page_size):
        h = hashlib.blake2b(h + keys[i * page_size:(i + 1) * page_size].tobytes(), digest_size=16).digest()
        out.append(h)
    return out


class PagePool:
    """`num_pages` KV pages: a free list, reference counts, the hash of each cached full page and
    an LRU of cached pages nobody holds (evicted, hash forgotten, when the free list is empty)."""

    def __init__(self, num_pages: int, enable_cache: bool = True):
        self.num_pages = num_pages
        self.enable_cache = enable_cache
        self.reset()

    def reset(self) -> None:
        """Every page free, nothing cached (a fresh device cache)."""
        self.free: deque[int] = deque(range(self.num_pages))
        self.refs = np.zeros(self.num_pages, np.int32)
        self.hash_of: dict[int, bytes] = {}
        self.page_of: dict[bytes, int] = {}
        self.lru: OrderedDict[int, None] = OrderedDict()    # cached pages with refcount 0
        self.queried = self.hit = 0                          # pages asked for by `match` / found

    # ---- counts --------------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        """Pages an `alloc` can take now: free plus evictable cached ones."""
        return len(self.free) + len(self.lru)

    @property
    def num_used(self) -> int:
        """Pages some request holds."""
        return self.num_pages - self.num_free

    def stats(self) -> dict:
        return {"pages_total": self.num_pages, "pages_used": self.num_used, "pages_free": self.num_free,
                "pages_cached": len(self.hash_of), "pages_evictable": len(self.lru),
                "prefix_pages_queried": self.queried, "prefix_pages_hit": self.hit,
                "prefix_hit_rate": self.hit / self.queried if self.queried else 0.0}

    # ---- pages ---------------------------------------------------------------------------------
    def alloc(self, n: int) -> list[int] | None:
        """n fresh pages (refcount 1), free ones first, then the least recently released cached
        ones (their hashes forgotten); None (nothing taken) if fewer than n are available."""
        if n > self.num_free:
            return None
        out = []
        for _ in range(n):
            if self.free:
                p = self.free.popleft()
            else:
                p, _ = self.lru.popitem(last=False)
                self._forget(p)
            self.refs[p] = 1
            out.append(p)
        return out

    def share(self, pages: list[int]) -> None:
        """One more holder of each page (a cached page leaves the evictable LRU)."""
        for p in pages:
            if self.refs[p] == 0:
                self.lru.pop(p, None)
            self.refs[p] += 1

    def release(self, pages: list[int]) -> None:
        """One holder less of each page; a page nobody holds goes to the evictable LRU if it is
        cached under a hash, else back to the free list."""
        for p in pages:
            assert self.refs[p] > 0, f"page {p} released more often than held"
            self.refs[p] -= 1
            if self.refs[p] == 0:
                if p in self.hash_of:
                    self.lru[p] = None
                else:
                    self.free.append(p)

    # ---- the prefix cache ----------------------------------------------------------------------
    def register(self, page: int, h: bytes) -> None:
        """Page `page` (held, full) holds the KV whose chain hash is h. A hash already cached
        keeps its page (the other copy stays private to its holder)."""
        if not self.enable_cache or h in self.page_of or page in self.hash_of:
            return
        self.page_of[h] = page
        self.hash_of[page] = h

    def lookup(self, h: bytes) -> int | None:
        return self.page_of.get(h)

    def match(self, hashes: list[bytes]) -> list[int]:
        """The cached pages of the longest prefix of `hashes` (not shared yet: `share` them)."""
        out = []
        if self.enable_cache:
            for h in hashes:
                p = self.page_of.get(h)
                if p is None:
                    break
                out.append(p)
        self.queried += len(hashes)
        self.hit += len(out)
        return out

    def clear_cache(self) -> None:
        """Forget every hash (the weights changed); evictable pages become free."""
        for p in list(self.lru):
            self.free.append(p)
        self.lru.clear()
        self.hash_of.clear()
        self.page_of.clear()

    def _forget(self, page: int) -> None:
        h = self.hash_of.pop(page, None)
        if h is not None:
            self.page_of.pop(h, None)

    def check(self, holders: list[list[int]]) -> None:
        """Invariants (tests): refcounts == how often `holders` (every request's page list) name
        each page; free, evictable and held pages partition the pool; hash maps agree."""
        count = np.zeros(self.num_pages, np.int32)
        for pages in holders:
            for p in pages:
                count[p] += 1
        assert (count == self.refs).all(), "refcounts differ from the holders"
        free, lru = set(self.free), set(self.lru)
        held = set(np.flatnonzero(self.refs).tolist())
        assert len(free) == len(self.free) and not (free & lru) and not (free & held) and not (lru & held)
        assert len(free) + len(lru) + len(held) == self.num_pages, "a page leaked"
        assert all(self.page_of[h] == p for p, h in self.hash_of.items()) and len(self.page_of) == len(self.hash_of)
        assert all(p in self.hash_of for p in lru)


class KVPages:
    """Each request's pages (`req.pages`, in cache-index order) and the host page table
    `[num_slots, max_pages]` int32 the runner passes to its steps (row = the request's slot;
    unused entries num_pages: writes there are dropped, reads masked)."""

    def __init__(self, num_pages: int, page_size: int, num_slots: int, max_model_len: int,
                 enable_cache: bool = True):
        self.page_size = page_size
        self.max_pages = -(-max_model_len // page_size)
        self.pool = PagePool(num_pages, enable_cache)
        self.table = np.full((num_slots, self.max_pages), num_pages, np.int32)
        self.holders: dict[int, object] = {}      # slot -> request (for `check`)
        self.dirty = True                          # the table changed since the device's copy

    def pages_for(self, tokens: int) -> int:
        return -(-tokens // self.page_size)

    def _write(self, req) -> None:
        row = self.table[req.slot]
        row[:] = self.pool.num_pages
        row[:len(req.pages)] = req.pages
        self.dirty = True

    def cached(self, req, length: int | None = None) -> list[int]:
        """The cached pages of the prefix of req's sequence of `length` tokens (default its
        prompt_len), at most length - 1 tokens' worth: its last token is always recomputed for
        the logits of the token after it."""
        usable = ((req.prompt_len if length is None else length) - 1) // self.page_size
        return self.pool.match(req.page_hashes[:usable])

    def fresh_needed(self, cached: list[int], tokens: int) -> int:
        """Pages an admission with `cached` shared pages and room for `tokens` takes from the
        free ones (an evictable cached page it shares leaves the free count too)."""
        evictable = sum(1 for p in cached if self.pool.refs[p] == 0)
        return max(self.pages_for(max(tokens, 1)) - len(cached), 0) + evictable

    def admit(self, req, slot: int, cached: list[int], reserve: int) -> bool:
        """Give req (in `slot`) the shared `cached` pages and fresh ones up to `reserve` tokens;
        False (nothing taken) if the pool is short."""
        fresh = self.pages_for(max(reserve, 1)) - len(cached)
        self.pool.share(cached)           # first: the allocation must not evict them
        got = self.pool.alloc(max(fresh, 0))
        if got is None:
            self.pool.release(cached)
            return False
        req.slot, req.pages = slot, list(cached) + got
        self.holders[slot] = req
        self._write(req)
        return True

    def grow(self, req, tokens: int) -> bool:
        """Enough pages for `tokens` cache positions; False (nothing taken) if the pool is short."""
        need = self.pages_for(tokens) - len(req.pages)
        if need <= 0:
            return True
        got = self.pool.alloc(need)
        if got is None:
            return False
        req.pages.extend(got)
        self._write(req)
        return True

    def written(self, req, tokens: int) -> None:
        """req's first `tokens` prompt positions are in the cache: its full prompt pages among
        them become shareable under their hashes."""
        for i in range(min(tokens // self.page_size, len(req.page_hashes), len(req.pages))):
            self.pool.register(req.pages[i], req.page_hashes[i])

    def release(self, req) -> None:
        """req ended or was preempted: its pages go back (cached full pages stay evictable)."""
        self.pool.release(req.pages)
        req.pages = []
        if req.slot is not None and self.holders.get(req.slot) is req:
            self.table[req.slot] = self.pool.num_pages
            del self.holders[req.slot]
            self.dirty = True

    def fork(self, parent, child, slot: int, tokens: int) -> list[tuple[int, int]] | None:
        """child (in `slot`) starts from parent's first `tokens` cache positions: the full pages
        among them shared, the partial last one copied into a fresh page. Returns the (src, dst)
        page copies for the device, or None (nothing taken) if the pool is short."""
        full, part = divmod(tokens, self.page_size)
        got = self.pool.alloc(1 if part else 0)
        if got is None:
            return None
        shared = parent.pages[:full]
        self.pool.share(shared)
        child.slot, child.pages = slot, list(shared) + got
        self.holders[slot] = child
        self._write(child)
        return [(parent.pages[full], got[0])] if part else []

    def reset(self) -> None:
        self.pool.reset()
        self.table[:] = self.pool.num_pages
        for req in self.holders.values():
            req.pages = []
        self.holders.clear()
        self.dirty = True

    def stats(self) -> dict:
        return {"page_size": self.page_size, **self.pool.stats()}

    def check(self) -> None:
        """Invariants (tests): the pool's (`PagePool.check`) over every holder's pages, and each
        holder's table row == its pages."""
        self.pool.check([r.pages for r in self.holders.values()])
        for slot, req in self.holders.items():
            row = self.table[slot]
            assert row[:len(req.pages)].tolist() == req.pages and (row[len(req.pages):] == self.pool.num_pages).all()
        free_rows = [s for s in range(len(self.table)) if s not in self.holders]
        assert (self.table[free_rows] == self.pool.num_pages).all()
