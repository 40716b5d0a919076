"""Packed prefill: the new tokens of several sequences in one row, and the attention-side view of it.

A packed prefill call holds the chunks of S sequences (segments) back to back in one row of T
tokens (a prefill bucket), padding at the end. Everything per token (embeddings, norms, the
weight matmuls: one [T, hidden] GEMM per weight instead of one per sequence, RoPE from each
token's own positions, K/V writes to each token's own cache row) runs on that row as it is.
Attention is the one place where a token must see only its own sequence. There `attend` cuts
each segment into blocks of B = QUERY_BLOCK queries (32; T for a smaller bucket), segment i
taking ceil(len_i / B) blocks from block sum_{j<i} ceil(len_j / B) on, gathers the queries into
that layout and runs it in groups of G = GROUP_QUERIES / B blocks (2), one group after another
(`lax.map`), each group as a batch of the one-sequence attention unchanged: each block over its
own segment's slot row exactly as a one-sequence prefill does (`starts` = the segment's first
cache index, its queries' cache indexes, its own end for a ring, image runs: the block's
queries' spans plus its whole segment's as keys, `MaskSpec.key_spans`), the group reading cache
positions up to its used blocks' longest end; a group with no used block is skipped
(`lax.cond`). The outputs are gathered back. The packed row itself stays dense (aligning
segments to blocks there would pad the row, and a padded row costs every weight GEMM, far more
than its attention); a segment's last block is padded instead. Attention so computes
ceil(sum_i ceil(len_i / B) / G) * G * B query rows: one sequence about T (rounded up to 64),
k sequences at most k - 1 blocks more (sum_i ceil(len_i / B) <= ceil(T / B) + k - 1); before
this layout every used segment ran over the whole row (k x T). The static block count is
ceil(T / B) + S - 1 rounded up to whole groups. B = 32 and G * B = 64 were the fastest of the
block and group sizes tried on the CPU (against one batch of every block, or the blocks of one
sequence as a batch with the rest behind conds), and the group loop compiles one attention per
layer.

A call holding one sequence (every other segment unused: long prompts fill the budget alone)
skips the block layout: one `lax.cond` runs the whole row as one block, as a one-sequence
prefill does, so packing costs a lone prompt nothing and no extra compiled shape.

Segments past the call's count are unused: length 0 (their rows are all padding) and a slot
index past the cache (`num_slots`) so that every write aimed at them is dropped.

Riders (`DecodeRows`, a mixed step): running sequences' next tokens may take padding positions
of the row after the packed chunks, one token each. They go through every weight GEMM with the
chunks (a decode step of their own reads every weight again, while a token riding along costs
only its share of the chunks' GEMMs); their K / V are written with the
chunks' and their attention is a decode step's, over their own cache rows. The row is a prefill
rung holding chunks + riders, so riding costs no compiled shape beyond the prefill ladder.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import jax
import jax.numpy as jnp

from mmjax.models.nn.metadata import MaskSpec

# cache index given to padding tokens: past every cache, so their K/V writes are dropped
NO_INDEX = 2 ** 30
# queries per attention block (each block belongs to one segment; module docstring)
QUERY_BLOCK = 32
# queries per group of blocks: one lax.map step, skipped when none of its blocks is used
GROUP_QUERIES = 64


@dataclass(frozen=True)
class DecodeRows:
    """Riders of a packed row (module docstring) in the decode step's layout: row j of D is cache
    row j's next token, at cache index index[j] [D] and row position position[j] [D] (traced
    int32). A row that does not ride: index NO_INDEX (nothing written, nothing read), position
    past the row."""
    index: jax.Array
    position: jax.Array

    @property
    def kv_len(self) -> jax.Array:
        """Cache positions the riders use after the call (0: none rides)."""
        return jnp.where(self.index < NO_INDEX, self.index + 1, 0).max(initial=0)


jax.tree_util.register_dataclass(DecodeRows, data_fields=["index", "position"], meta_fields=[])


@dataclass(frozen=True)
class Packing:
    """S segments packed into one row of T new tokens (all int32 arrays, traced).

    seg_slot [S]: each segment's cache row; seg_start [S]: the cache index of its first new
    token; seg_offset [S]: where its tokens start in the row; seg_len [S]: how many (0: unused).
    token_seg [T]: each token's segment (padding: any). riders: decode tokens in the row's
    padding (a mixed step; None: none), which the per-token views below include; their
    attention is the decoder's to run (`rider_queries`, `with_riders`)."""
    seg_slot: jax.Array
    seg_start: jax.Array
    seg_offset: jax.Array
    seg_len: jax.Array
    token_seg: jax.Array
    riders: DecodeRows | None = None

    @property
    def width(self) -> int:
        return self.token_seg.shape[0]

    @property
    def local(self) -> jax.Array:
        """[T] each token's index within its segment."""
        return jnp.arange(self.width) - self.seg_offset[self.token_seg]

    @property
    def _in_segment(self) -> jax.Array:
        return self.local < self.seg_len[self.token_seg]

    def _at_riders(self, x: jax.Array, values) -> jax.Array:
        """x [T] with the riders' positions set to values (no riders: x)."""
        return x if self.riders is None else x.at[self.riders.position].set(values, mode="drop")

    @property
    def token_valid(self) -> jax.Array:
        """[T] bool: real tokens (segments' and riders'; not padding)."""
        return self._at_riders(self._in_segment, True)

    @property
    def token_slot(self) -> jax.Array:
        """[T] each token's cache row (rider j: row j)."""
        d = 0 if self.riders is None else self.riders.index.shape[0]
        return self._at_riders(self.seg_slot[self.token_seg], jnp.arange(d))

    @property
    def token_index(self) -> jax.Array:
        """[T] each token's cache index (padding: NO_INDEX, past every cache)."""
        index = jnp.where(self._in_segment, self.seg_start[self.token_seg] + self.local, NO_INDEX)
        return index if self.riders is None else self._at_riders(index, self.riders.index)

    def rider_queries(self, q: jax.Array) -> jax.Array:
        """The riders' rows of q [1, T, heads, hd] in the decode layout [D, 1, heads, hd]."""
        return q[0, jnp.clip(self.riders.position, 0, self.width - 1)][:, None]

    def with_riders(self, attn: jax.Array, rows: jax.Array) -> jax.Array:
        """attn [1, T, heads, hd] with the riders' positions set to their rows [D, 1, heads, hd]."""
        return attn.at[0, self.riders.position].set(rows[:, 0], mode="drop")

    @property
    def kv_len(self) -> jax.Array:
        """Cache positions in use after the call (the longest segment's end)."""
        return (self.seg_start + self.seg_len).max()

    def attend(self, fn, q: jax.Array, mask: MaskSpec | None = None) -> jax.Array:
        """Attention of the packed queries q [1, T, heads, hd] -> [1, T, heads, hd], each token
        over its own sequence's cache row, in query blocks (module docstring).
        fn(q_blocks [G, B, heads, hd], blocks: Blocks of G) -> [G, B, heads, hd] runs one group
        of G blocks, block i over cache row blocks.slots[i] as a one-sequence prefill would
        (q_index, starts, ends, kv_len, mask as there); mask: the packed row's MaskSpec (spans
        [1, T]) or None. Groups run one after another (`lax.map`); a group without a used
        block is skipped (`lax.cond`)."""
        # one sequence in the call (the common case when prompts are long): the whole row as one
        # block, as a one-sequence prefill runs it (the block layout's gathers, group loop and
        # per-group conds are pure overhead there)
        return jax.lax.cond((self.seg_len[1:] == 0).all(), lambda: self._attend_one(fn, q, mask),
                            lambda: self._attend_blocks(fn, q, mask))

    def _attend_one(self, fn, q: jax.Array, mask: MaskSpec | None) -> jax.Array:
        t = self.width
        start, length = self.seg_start[:1], self.seg_len[:1]
        if mask is not None and mask.spans is not None:
            r = jnp.arange(t)
            spans = jnp.where(r < length[0], mask.spans[0], -1)[None]
            mask = dataclasses.replace(mask, spans=spans, key_spans=spans)
        blk = Blocks(start[:, None] + jnp.arange(t)[None], self.seg_slot[:1], start, start + length,
                     jnp.ones((1,), bool), self.kv_len, mask)
        return fn(q, blk).astype(q.dtype)

    def _attend_blocks(self, fn, q: jax.Array, mask: MaskSpec | None) -> jax.Array:
        blocks, take = self.blocks(mask)
        nb, b = blocks.q_index.shape
        g = max(1, GROUP_QUERIES // b)
        split = lambda x: x.reshape(nb // g, g, *x.shape[1:])             # noqa: E731
        # each group reads cache positions up to its own used blocks' longest end (0: skipped)
        kv_len = jnp.where(blocks.used, blocks.ends, 0).reshape(nb // g, g).max(axis=1)
        groups = Blocks(*(split(x) for x in (blocks.q_index, blocks.slots, blocks.starts, blocks.ends,
                                             blocks.used)), kv_len, jax.tree.map(split, blocks.mask))

        def one(xs):
            qg, bg = xs
            return jax.lax.cond(bg.kv_len > 0, lambda: fn(qg, bg).astype(q.dtype), lambda: jnp.zeros_like(qg))
        out = jax.lax.map(one, (split(q[0][take]), groups)).reshape(nb * b, *q.shape[2:])
        # each packed token's block entry: its segment's first block, then its index in the segment
        n = (self.seg_len + b - 1) // b
        flat = (jnp.cumsum(n) - n)[self.token_seg] * b + self.local
        return out[jnp.clip(flat, 0, nb * b - 1)][None]

    def blocks(self, mask: MaskSpec | None) -> tuple["Blocks", jax.Array]:
        """The block layout -> (Blocks of nb blocks: ceil(T / B) + S - 1 (sum of ceil(len_i / B)
        is at most ceil(T / B) + used segments - 1) rounded up to whole groups; take [nb, B]:
        each block query's position in the packed row (clipped; past its segment's end:
        padding)). Segment i takes ceil(len_i / B) blocks from block sum_{j<i} ceil(len_j / B)
        on; blocks past the last are unused. kv_len: the call's."""
        t, s = self.width, self.seg_len.shape[0]
        b = min(QUERY_BLOCK, t)
        g = max(1, GROUP_QUERIES // b)
        nb = -(-(-(-t // b) + s - 1) // g) * g
        n = (self.seg_len + b - 1) // b
        end = jnp.cumsum(n)
        j = jnp.arange(nb)
        used = j < end[-1]
        seg = jnp.where(used, jnp.minimum((end[None, :] <= j[:, None]).sum(axis=1), s - 1), 0)   # [nb]
        local = (j - (end - n)[seg])[:, None] * b + jnp.arange(b)[None, :]                       # [nb, B]
        take = jnp.clip(self.seg_offset[seg][:, None] + local, 0, t - 1)
        start, length = self.seg_start[seg], self.seg_len[seg]
        if mask is not None and mask.spans is not None:
            spans = mask.spans[0]
            real = used[:, None] & (local < length[:, None])
            r = jnp.arange(t)[None, :]
            keys = jnp.where(r < length[:, None], spans[jnp.clip(self.seg_offset[seg][:, None] + r, 0, t - 1)], -1)
            mask = dataclasses.replace(mask, spans=jnp.where(real, spans[take], -1), key_spans=keys)
        return Blocks(start[:, None] + local, self.seg_slot[seg], start, start + length, used, self.kv_len,
                      mask), take


jax.tree_util.register_dataclass(Packing, data_fields=["seg_slot", "seg_start", "seg_offset", "seg_len",
                                                       "token_seg", "riders"], meta_fields=[])


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
