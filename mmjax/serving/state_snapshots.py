"""Prefix caching for hybrid recurrent decoders (Qwen3.5's Gated DeltaNet layers): snapshots of
the per-slot recurrent + conv states at prefill-chunk boundaries, so that a prompt sharing a
prefix with an earlier one resumes after it instead of recomputing it.

A recurrent state is only valid at the exact end of the sequence that produced it, so a slot's
own row cannot resume part-way as a KV row can (and a released row may have taken a token from a
decode call in flight). After each prefill chunk the engine copies the chunk's slot's states into
a row of a bounded device pool (`StatePool`), keyed by the prefix-cache keys of the prefix they
end (`SnapshotIndex`, least recently used row reused first). A request then resumes from the
longest prefix that both its slot's KV row holds (the full-attention layers, `PrefixCache` as for
every family) and a snapshot ends; the snapshot is copied into the slot's state rows before its
first chunk. This is vLLM's hybrid ("mamba") cache with prefix caching, and SGLang's
MambaRadixCache, with states kept at the engine's chunk boundaries.
"""
from __future__ import annotations

from collections import OrderedDict

import jax
import jax.numpy as jnp
import numpy as np

from mmjax.serving.caches import common_prefix

# snapshot rows per decode slot (the engine's pool; the runner's memory plan counts them)
ROWS_PER_SLOT = 2


class SnapshotIndex:
    """Host side: which pool row holds the states at the end of which key prefix (LRU)."""

    def __init__(self, rows: int):
        self.rows = rows
        self._d: OrderedDict[bytes, tuple[int, np.ndarray]] = OrderedDict()   # key bytes -> (row, keys)
        self.hits = 0

    def __len__(self) -> int:
        return len(self._d)

    def longest(self, keys: np.ndarray, n: int) -> int:
        """The longest prefix of `keys`, at most n tokens, that a snapshot ends (0: none)."""
        best = 0
        for _, held in self._d.values():
            if best < len(held) <= n and common_prefix(held, keys) == len(held):
                best = len(held)
        return best

    def row(self, keys: np.ndarray) -> int:
        """The pool row of the snapshot that ends exactly `keys` (which must be held); marks it used."""
        k = keys.tobytes()
        self._d.move_to_end(k)
        self.hits += 1
        return self._d[k][0]

    def claim(self, keys: np.ndarray) -> int | None:
        """A pool row for the states at the end of `keys` (the least recently used row when the
        pool is full); None when a snapshot of that prefix is already held (marked used) or
        the pool has no rows."""
        k = keys.tobytes()
        if k in self._d:
            self._d.move_to_end(k)
            return None
        if not self.rows:
            return None
        if len(self._d) < self.rows:    # rows 0 .. len - 1 are in use (only clear() frees rows)
            row = len(self._d)
        else:
            _, (row, _) = self._d.popitem(last=False)
        self._d[k] = (row, keys.copy())
        return row

    def clear(self) -> None:
        """Forget every snapshot (new weights, or the device state was reset)."""
        self._d.clear()


class StatePool:
    """Device side: `rows` copies of the state-layer cache entries ({"conv", "ssm"} per layer, a
    row each), laid out as the cache's, and the two compiled copies between a cache slot and a
    pool row. cache: the decoder's cache (a list, an entry per layer); layers: the state
    layers' indexes; shardings: the cache's shardings (the same list; None: one device)."""

    def __init__(self, cache: list, layers: tuple[int, ...], rows: int, shardings: list | None,
                 allocate: bool = True):
        """allocate=False: the pool's shapes only (`ModelRunner.step_signatures` of a runner with
        no pool, e.g. one built to lower the steps for another platform); `cache` may be abstract."""
        self.layers, self.rows = layers, rows
        entries = [jax.tree.map(lambda x: jax.ShapeDtypeStruct((rows,) + x.shape[1:], x.dtype), cache[i])
                   for i in layers]
        shard = None if shardings is None else [shardings[i] for i in layers]
        self.pool = entries if not allocate else jax.jit(
            lambda: jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), entries), out_shardings=shard)()
        # pool[row] <- states[slot] (the pool donated; the cache only read)
        self._save = jax.jit(lambda pool, states, slot, row: jax.tree.map(
            lambda p, s: p.at[row].set(s[slot]), pool, states), donate_argnums=(0,), out_shardings=shard)
        # states[slot] <- pool[row] (the state entries of the cache donated)
        self._load = jax.jit(lambda states, pool, row, slot: jax.tree.map(
            lambda s, p: s.at[slot].set(p[row]), states, pool), donate_argnums=(0,), out_shardings=shard)

    def save(self, cache: list, slot: int, row: int) -> list:
        """Pool row `row` <- slot `slot`'s states in `cache` -> the new pool."""
        self.pool = self._save(self.pool, [cache[i] for i in self.layers], np.int32(slot), np.int32(row))
        return self.pool

    def load(self, cache: list, row: int, slot: int) -> list:
        """-> the cache with slot `slot`'s state entries replaced by pool row `row` (the
        full-attention layers' entries are passed through untouched)."""
        new = self._load([cache[i] for i in self.layers], self.pool, np.int32(row), np.int32(slot))
        cache = list(cache)
        for i, entry in zip(self.layers, new):
            cache[i] = entry
        return cache

    def nbytes(self) -> int:
        return sum(x.nbytes for x in jax.tree.leaves(self.pool))
