"""Packed prefill: the new tokens of several sequences in one row, and the attention-side view of it.

A packed prefill call holds the chunks of S sequences (segments) back to back in one row of T
tokens (a prefill bucket), padding at the end. Everything per token (embeddings, norms, the
weight matmuls: one [T, hidden] GEMM per weight instead of one per sequence, RoPE from each
token's own positions, K/V writes to each token's own cache row) runs on that row as it is.
Attention is the one place where a token must see only its own sequence: there the queries are
gathered into `rows` [S, T] (segment s's tokens first, then padding) and `attend` runs each used
segment's row over its own slot's cache row exactly as a one-sequence prefill does (`starts` =
the segment's first cache index, masks and image runs per row), one segment after another
(`lax.map`; an unused segment is skipped by `lax.cond`, so S costs nothing while unused; a
used segment's row is T queries long, padding included: attention pays k x T query rows for k
packed sequences where one call each paid their own chunk buckets), then gathers the outputs
back (`unrows`).

Segments past the call's count are unused: length 0 (their rows are all padding) and a slot
index past the cache (`num_slots`) so that every write aimed at them is dropped.
"""
from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp

from mmjax.models.text import MaskSpec

# cache index given to padding tokens: past every cache, so their K/V writes are dropped
NO_INDEX = 2 ** 30


@dataclass(frozen=True)
class Packing:
    """S segments packed into one row of T new tokens (all int32 arrays, traced).

    seg_slot [S]: each segment's cache row; seg_start [S]: the cache index of its first new
    token; seg_offset [S]: where its tokens start in the row; seg_len [S]: how many (0: unused).
    token_seg [T]: each token's segment (padding: any)."""
    seg_slot: jax.Array
    seg_start: jax.Array
    seg_offset: jax.Array
    seg_len: jax.Array
    token_seg: jax.Array

    @property
    def width(self) -> int:
        return self.token_seg.shape[0]

    @property
    def local(self) -> jax.Array:
        """[T] each token's index within its segment."""
        return jnp.arange(self.width) - self.seg_offset[self.token_seg]

    @property
    def token_valid(self) -> jax.Array:
        """[T] bool: real tokens (not padding)."""
        return self.local < self.seg_len[self.token_seg]

    @property
    def token_slot(self) -> jax.Array:
        """[T] each token's cache row."""
        return self.seg_slot[self.token_seg]

    @property
    def token_index(self) -> jax.Array:
        """[T] each token's cache index (padding: NO_INDEX, past every cache)."""
        return jnp.where(self.token_valid, self.seg_start[self.token_seg] + self.local, NO_INDEX)

    @property
    def kv_len(self) -> jax.Array:
        """Cache positions in use after the call (the longest segment's end)."""
        return (self.seg_start + self.seg_len).max()

    @property
    def row_valid(self) -> jax.Array:
        """[S, T] bool: row position j of segment s holds a real token."""
        return jnp.arange(self.width)[None, :] < self.seg_len[:, None]

    @property
    def row_index(self) -> jax.Array:
        """[S, T] cache index of each row position (padding continues past the segment's end,
        where causality keeps it from anything real)."""
        return self.seg_start[:, None] + jnp.arange(self.width)[None, :]

    def rows(self, x: jax.Array) -> jax.Array:
        """x [1, T, ...] (the packed row) -> [S, T, ...]: segment s's tokens, then padding."""
        t = self.width
        idx = jnp.clip(self.seg_offset[:, None] + jnp.arange(t)[None, :], 0, t - 1)
        return x[0][idx]

    def unrows(self, y: jax.Array) -> jax.Array:
        """y [S, T, ...] -> [1, T, ...]: each packed token's row entry (padding: garbage)."""
        return y[self.token_seg, self.local][None]

    def attend(self, fn, q: jax.Array, extra=None) -> jax.Array:
        """Attention per segment: fn(slot [1], start [1], n (int32 scalar), q_row [1, T, heads,
        hd], extra_row) -> [1, T, heads, hd], one segment's queries over its own cache row (n:
        its tokens; extra_row: `extra`, a pytree of [S, ...] arrays, at that segment, each [1,
        ...]); q [1, T, heads, hd] packed. Used segments run one after another, unused ones
        (n = 0) are skipped; returns the packed [1, T, heads, hd]."""
        def one(xs):
            n, slot, start, qr, ex = xs
            ex = jax.tree.map(lambda x: x[None], ex)
            return jax.lax.cond(n > 0, lambda: fn(slot[None], start[None], n, qr[None], ex)[0].astype(qr.dtype),
                                lambda: jnp.zeros_like(qr))
        return self.unrows(jax.lax.map(one, (self.seg_len, self.seg_slot, self.seg_start, self.rows(q), extra)))

    def row_mask(self, mask: MaskSpec | None) -> MaskSpec | None:
        """A packed-row mask (spans [1, T]) as the rows' mask (spans [S, T], -1 at padding)."""
        if mask is None or mask.spans is None:
            return mask
        return MaskSpec(sliding_window=mask.sliding_window,
                        spans=jnp.where(self.row_valid, self.rows(mask.spans), -1))


jax.tree_util.register_dataclass(Packing, data_fields=["seg_slot", "seg_start", "seg_offset", "seg_len",
                                                       "token_seg"], meta_fields=[])
