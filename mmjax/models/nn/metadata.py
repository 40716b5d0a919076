"""The per-step attention metadata: what one compiled step tells the attention layers.

The runner (or research code) builds one `AttentionMetadata` per call and passes it down the
decoder; the `Attention` modules and the cache code under them are its only readers. A decoder
never branches on a serving mode: packed prefill (`Packing`, with decode riders), chunked
prefill (`starts`, `kv_len`), decode (`slots` None: row i is cache row i), image spans, FastV
(`Dropped` for the decode after it; the pruned prefill is `Decoder.run_layers` with `Prune`) and
captured attention (`capture`) are all read here.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import jax
import jax.numpy as jnp


@dataclass(frozen=True)
class MaskSpec:
    """Visibility of cached keys to new tokens, on top of causality (key index <= query index).

    sliding_window: a query at cache index i sees keys j with i - j < window (None: all).
    chunk: chunked (local) attention, Llama 4's: a query at cache index i sees keys j in its own
        chunk only, j >= (i // chunk) * chunk (None: all). Not a window: the first query of a
        chunk sees itself alone, whatever came before.
    spans: [b, t] int32 per new token, -1 for none: tokens of one span in the same call see each
        other in both directions (a span must lie within one call: the caller keeps chunk
        boundaries outside spans). A traced array, so one compiled step serves every layout.
    key_spans: [b, u] int32 or None (then `spans`): the spans of row b's sequence's new tokens
        from its first new cache index on (attention's `starts`), when the row's queries are only
        part of them (packed prefill: a block of a longer chunk, nn/packing.py).
    """
    sliding_window: int | None = None
    spans: jax.Array | None = None
    key_spans: jax.Array | None = None
    chunk: int | None = None

    @property
    def span_keys(self) -> jax.Array | None:
        """[b, u] the span of each new token as a key (`key_spans`, else `spans`)."""
        return self.spans if self.key_spans is None else self.key_spans


jax.tree_util.register_dataclass(MaskSpec, data_fields=["spans", "key_spans"], meta_fields=["sliding_window", "chunk"])


@dataclass(frozen=True)
class Prune:
    """FastV token pruning inside one prefill call: after decoder layer `layer`, keep the `keep`
    image tokens that `query`'s head-averaged attention at that layer favours most; the other
    image tokens leave the sequence, so later layers compute over and cache `out_len` (static, >=
    the tokens left) positions, kept tokens first in order.

    image_mask [b, t] bool: the call's image tokens; query [b] int32: the scoring token's index
    (the prompt's last). Needs the call to start at cache index 0 (the whole prompt at once)."""
    layer: int
    keep: int
    out_len: int
    image_mask: jax.Array
    query: jax.Array


jax.tree_util.register_dataclass(Prune, data_fields=["image_mask", "query"], meta_fields=["layer", "keep", "out_len"])


def prune_order(probs: jax.Array, prune: Prune) -> tuple[jax.Array, jax.Array]:
    """FastV's choice from the scoring layer's attention probs [b, heads, t, t]: (order [b,
    out_len], the rows of the call that stay, kept tokens first in their order: every
    non-image token and the `keep` image tokens prune.query's head-averaged attention favours;
    dropped [b] int32, the image tokens that leave)."""
    b, t = prune.image_mask.shape
    row = jnp.take_along_axis(probs.mean(axis=1), prune.query[:, None, None], axis=1)[:, 0]   # [b, t]
    score = jnp.where(prune.image_mask, row, -jnp.inf)
    _, top = jax.lax.top_k(score, prune.keep)                                                  # [b, keep]
    chosen = jnp.zeros((b, t), bool).at[jnp.arange(b)[:, None], top].set(True)
    kept = ~prune.image_mask | chosen
    order = jnp.argsort(~kept, axis=1, stable=True)[:, :prune.out_len]
    return order, prune.image_mask.sum(axis=1).astype(jnp.int32) - prune.keep


def take_rows(a: jax.Array, order: jax.Array, axis: int = 1) -> jax.Array:
    """a [..., b (axis - 1), t (axis), ...] gathered along `axis` by order [b, n]."""
    shape = [1] * a.ndim
    shape[axis - 1], shape[axis] = order.shape
    return jnp.take_along_axis(a, order.reshape(shape), axis=axis)


@dataclass(frozen=True)
class Dropped:
    """Rows whose image tokens were pruned earlier: in layers i > after[b] row b's sequence is
    count[b] positions shorter (cache index = its full-length index - count[b]). kv_lens
    [num_layers] int32: the cache positions in use per layer (replaces kv_len).
    after [b], count [b] int32; after = num_layers for rows never pruned."""
    after: jax.Array
    count: jax.Array
    kv_lens: jax.Array


jax.tree_util.register_dataclass(Dropped, data_fields=["after", "count", "kv_lens"], meta_fields=[])


@dataclass(frozen=True)
class AttentionMetadata:
    """One call's view of the KV cache, for b rows of t new tokens each.

    positions [rows, b, t] int32: RoPE positions (rows 3 for M-RoPE); starts [b]: cache index of
    each row's first new token; kv_len (int or traced int32): cache positions in use after the
    call, >= max(starts) + t (segments from kv_len on are neither read nor written); slots [b]:
    the cache row of each batch row (None: row i is cache row i, the decode layout: a slice, no
    gather); spans [b, t] int32 (-1: none): image runs attending to themselves both ways in the
    layers that take them (or, for cross-attention decoders, each token's image range); packing:
    the one row holds several sequences' chunks (b = 1; starts and slots then come from it) and
    maybe decode riders; dropped: FastV-pruned rows (decode after a pruned prefill); valid [b, t]:
    the real tokens (None: a position repeating its predecessor's is padding, as the runner pads
    bucketed chunks); pages [cache rows, max_pages] int32: the page table of paged layers (row r:
    cache row r's pages in cache-index order; entries past its pages = num_pages), None: every
    layer holds a row per slot (serving/pages.py); adapters [b, t] int32: each token's LoRA adapter slot (-1: the base model;
    None: no adapters; nn/lora.py). Static: capture, the layers whose attention probabilities [b, heads, t,
    kv_len] and per-head outputs are sown (`nnx.capture(..., nnx.Intermediate)`; kv_len must be a
    static int); reduce_small, the backend's few-query attention choice (mmjax.backend)."""
    positions: jax.Array
    starts: jax.Array
    kv_len: jax.Array | int
    slots: jax.Array | None = None
    spans: jax.Array | None = None
    packing: object | None = None
    dropped: Dropped | None = None
    valid: jax.Array | None = None
    pages: jax.Array | None = None
    adapters: jax.Array | None = None
    capture: tuple[int, ...] = field(default=())
    reduce_small: bool = False

    @property
    def batch(self) -> int:
        return self.positions.shape[1]

    @property
    def length(self) -> int:
        return self.positions.shape[2]

    @property
    def q_index(self) -> jax.Array:
        """[b, t] each new token's cache index (packed padding: past every cache)."""
        if self.packing is not None:
            return self.packing.token_index[None]
        return self.starts[:, None] + jnp.arange(self.length)[None, :]

    @property
    def write_rows(self) -> jax.Array:
        """The cache rows new K/V go to: [b] (one per batch row) or [1, t] (packed: per token)."""
        if self.packing is not None:
            return self.packing.token_slot[None]
        return jnp.arange(self.batch) if self.slots is None else self.slots

    @property
    def token_valid(self) -> jax.Array:
        """[b, t] bool: real tokens, not a bucket's padding."""
        if self.packing is not None:
            return self.packing.token_valid[None]
        if self.valid is not None:
            return self.valid
        pos = self.positions[0]
        return jnp.concatenate([jnp.ones_like(pos[:, :1], bool), pos[:, 1:] > pos[:, :-1]], axis=1)

    def mask(self, sliding_window: int | None = None, spans: bool = True, chunk: int | None = None) -> MaskSpec | None:
        """The MaskSpec of a layer with this window (or attention chunk) that does (spans=True) or
        does not read image spans."""
        s = self.spans if spans else None
        if sliding_window is None and s is None and chunk is None:
            return None
        return MaskSpec(sliding_window=sliding_window, spans=s, chunk=chunk)

    def layer(self, i: int) -> "AttentionMetadata":
        """The view of layer i: rows pruned after an earlier layer (`dropped`) index a shorter
        sequence there (starts and kv_len shifted); otherwise self."""
        if self.dropped is None:
            return self
        off = jnp.where(i > self.dropped.after, self.dropped.count, 0)
        return dataclasses.replace(self, starts=self.starts - off, kv_len=self.dropped.kv_lens[i], dropped=None)

    def captures(self, i: int) -> bool:
        return i in self.capture

    def compacted(self, order: jax.Array, out_len: int) -> "AttentionMetadata":
        """After FastV dropped tokens: the kept rows (order [b, out_len]) from cache index 0, their
        positions and spans gathered, kv_len out_len."""
        b = order.shape[0]
        positions = take_rows(self.positions, order, axis=2)
        spans = None if self.spans is None else take_rows(self.spans, order)
        return dataclasses.replace(self, positions=positions, starts=jnp.zeros((b,), jnp.int32), kv_len=out_len,
                                   spans=spans, valid=None, capture=())


jax.tree_util.register_dataclass(
    AttentionMetadata, data_fields=["positions", "starts", "kv_len", "slots", "spans", "packing", "dropped", "valid",
                                    "pages", "adapters"],
    meta_fields=["capture", "reduce_small"])
