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
# queries per attention block (each block belongs to one segment)
QUERY_BLOCK = 32
# blocks per group run under one lax.cond (None: every block in one batched call, no cond)
GROUP_BLOCKS = None


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

    def attend(self, fn, q: jax.Array, mask: MaskSpec | None = None) -> jax.Array:
        """Attention of the packed queries q [1, T, heads, hd] -> [1, T, heads, hd], each token
        over its own sequence's cache row, in query blocks (`Blocks`: module docstring).
        fn(q_blocks [n, B, heads, hd], blocks: Blocks) -> [n, B, heads, hd] runs n blocks, each
        row over cache row blocks.slots[i] exactly as a one-sequence prefill would (q_index,
        starts, ends, kv_len, mask as there); mask: the packed row's MaskSpec (spans [1, T])."""
        blocks, take = self.blocks(mask)
        b = blocks.q_index.shape[1]
        t, heads, hd = q.shape[1:]
        qb = q[0][take]                                                    # [nb, B, heads, hd]
        groups = blocks.q_index.shape[0] // self.group_blocks(b)
        if groups == 1:     # one batched attention over every block
            out = fn(qb, blocks)
        else:               # groups of blocks one after another; groups past the last used block skipped
            def one(xs):
                qg, bg = xs
                return jax.lax.cond(bg.kv_len > 0, lambda: fn(qg, bg).astype(qg.dtype), lambda: jnp.zeros_like(qg))
            split = lambda x: x.reshape(groups, -1, *x.shape[1:])          # noqa: E731
            kv_len = jnp.where(blocks.used, blocks.ends, 0).reshape(groups, -1).max(axis=1)
            grouped = Blocks(*(jax.tree.map(split, (blocks.q_index, blocks.slots, blocks.starts, blocks.ends,
                                                    blocks.used))), kv_len,
                             jax.tree.map(split, blocks.mask))
            out = jax.lax.map(one, (split(qb), grouped)).reshape(-1, b, heads, hd)
        # each packed token's block entry: its segment's first block, then its index in the segment
        flat = self.first_block(b)[self.token_seg] * b + self.local
        return out.reshape(-1, heads, hd)[jnp.clip(flat, 0, out.shape[0] * b - 1)][None].astype(q.dtype)

    def block_size(self) -> int:
        return min(QUERY_BLOCK, self.width)

    def group_blocks(self, b: int) -> int:
        nb = -(-self.width // b) + self.seg_len.shape[0] - 1
        return nb if GROUP_BLOCKS is None else GROUP_BLOCKS

    def first_block(self, b: int) -> jax.Array:
        """[S] each segment's first block (segments take ceil(len / B) blocks, in order)."""
        n = (self.seg_len + b - 1) // b
        return jnp.cumsum(n) - n

    def blocks(self, mask: MaskSpec | None) -> tuple["Blocks", jax.Array]:
        """The block layout: (Blocks of nb blocks, take [nb, B]: each block query's packed-row
        position (clipped; past its segment's end: padding))."""
        b = self.block_size()
        t, s = self.width, self.seg_len.shape[0]
        nb = -(-t // b) + s - 1          # sum ceil(len_i / B) <= ceil(T / B) + (used segments - 1)
        g = self.group_blocks(b)
        nb = -(-nb // g) * g
        n = (self.seg_len + b - 1) // b
        end = jnp.cumsum(n)
        j = jnp.arange(nb)
        used = j < end[-1]
        seg = jnp.where(used, jnp.minimum((end[None, :] <= j[:, None]).sum(axis=1), s - 1), 0)   # [nb]
        local = (j - (end - n)[seg])[:, None] * b + jnp.arange(b)[None, :]                       # [nb, B]
        take = jnp.clip(self.seg_offset[seg][:, None] + local, 0, t - 1)
        start, length = self.seg_start[seg], self.seg_len[seg]
        bmask = mask
        if mask is not None and mask.spans is not None:
            spans = mask.spans[0]
            real = used[:, None] & (local < length[:, None])
            r = jnp.arange(t)[None, :]
            keys = jnp.where(r < length[:, None], spans[jnp.clip(self.seg_offset[seg][:, None] + r, 0, t - 1)], -1)
            bmask = MaskSpec(sliding_window=mask.sliding_window, spans=jnp.where(real, spans[take], -1),
                             key_spans=keys)
        return Blocks(start[:, None] + local, self.seg_slot[seg], start, start + length, used, self.kv_len,
                      bmask), take


jax.tree_util.register_dataclass(Packing, data_fields=["seg_slot", "seg_start", "seg_offset", "seg_len",
                                                       "token_seg"], meta_fields=[])


@dataclass(frozen=True)
class Blocks:
    """n query blocks of B tokens, each within one segment (traced arrays).

    q_index [n, B]: each query's cache index (past the segment's end: padding, kept from
    anything real by causality); slots [n]: the segment's cache row; starts [n]: its first new
    cache index; ends [n]: its end (start + len; a ring's write end); used [n]: the block holds
    tokens; kv_len: cache positions any block may read (segments past it are skipped); mask:
    None, or spans [n, B] of the queries (-1 at padding) with key_spans [n, T] of the segment's
    new tokens from `starts` on (MaskSpec.key_spans)."""
    q_index: jax.Array
    slots: jax.Array
    starts: jax.Array
    ends: jax.Array
    used: jax.Array
    kv_len: jax.Array
    mask: MaskSpec | None


jax.tree_util.register_dataclass(Blocks, data_fields=["q_index", "slots", "starts", "ends", "used", "kv_len",
                                                      "mask"], meta_fields=[])
