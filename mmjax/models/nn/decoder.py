"""`Decoder`: what every text model is to the runner, and the layer loop they share.

A decoder is its architecture: `embed_tokens` -> `layers` -> `norm` -> `lm_head` (HF keeps the LM
head one level up, on the *ForConditionalGeneration; here it lives with the decoder so the text
steps carry only the decoder's weights). Every layer is called as `layer(x, rope, meta, kv,
**kwargs) -> (x, kv)`: the serving modes are the `AttentionMetadata`'s business, so a decoder
written once gets chunked and packed prefill, decode riders, int8 / fp8 KV, FastV pruning, captured
intermediates and tensor parallelism.

The members below are declared for every decoder (defaults here, overridden where an
architecture differs); the runner reads them and never probes.
"""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from mmjax.models.nn import lora
from mmjax.models.nn.capture import sow
from mmjax.models.nn.metadata import AttentionMetadata, Prune, prune_order, take_rows

Cache = list    # one entry per layer that owns K/V (nn/kv_cache.py layouts)


class Decoder(nnx.Module):
    """Base of the text models. Subclasses build `embed_tokens`, `layers`, `norm`, `lm_head` and
    the static facts: hidden_size, vocab_size, num_layers, max_position_embeddings."""
    hidden_size: int
    vocab_size: int
    num_layers: int
    max_position_embeddings: int
    position_rows: int = 1              # rows of the positions array: 1 (RoPE) or 3 (M-RoPE)
    image_feature_layers: int = 0       # per-layer image features after the first n layers (DeepStack)
    supports_riders: bool = True        # decode tokens may ride in packed prefill calls
    supports_prune: bool = True         # FastV pruning (`forward_pruned`)
    cross_attention: bool = False       # image features enter through cross-attention layers (Mllama)

    @property
    def max_prune_layer(self) -> int:
        """The last layer after which FastV may prune."""
        return self.num_layers - 2

    # ---- inputs --------------------------------------------------------------------------------
    def embed(self, ids: jax.Array) -> jax.Array:
        """ids [..., t] -> the input embeddings [..., t, hidden]."""
        return self.embed_tokens(ids)

    @property
    def feature_width(self) -> int:
        """Columns of one image token's features: hidden x (1 + image_feature_layers)."""
        return self.hidden_size * (1 + self.image_feature_layers)

    def token_inputs(self, ids: jax.Array) -> tuple[jax.Array, dict]:
        """ids [b, t] (no image features: decode) -> (input embeddings, the keyword inputs of
        `__call__`)."""
        return self.embed(ids), {}

    def inputs(self, ids: jax.Array, image_embeds: jax.Array, image_mask: jax.Array) -> tuple[jax.Array, dict]:
        """(ids [b, t], image features [b, t, feature_width], image_mask [b, t]) -> (input
        embeddings [b, t, hidden]: image tokens take their features' first block, the keyword
        inputs of `__call__`)."""
        d = self.hidden_size
        return jnp.where(image_mask[..., None], image_embeds[..., :d], self.embed(ids)), {}

    # ---- the cache -----------------------------------------------------------------------------
    def cache_layers(self) -> tuple[int, ...]:
        """The layers that own a cache entry, in cache order (default: all)."""
        return tuple(range(self.num_layers))

    def cache_index(self, i: int) -> int:
        """The cache entry layer i reads (and writes, if it owns one)."""
        return i

    def init_cache(self, num_slots: int, max_len: int, dtype, *, max_chunk: int | None = None, tp: int = 1,
                   pages: tuple[int, int] | None = None) -> Cache:
        """A zero cache for num_slots sequences of up to max_len positions; max_chunk: the most new
        tokens one call writes per row (a ring sizes itself by it); tp: KV heads replicated to tp;
        pages (num_pages, page_size): full-attention layers hold a page pool instead of a row per
        slot (`pages_kv`)."""
        return [self.layers[i].self_attn.init_cache(num_slots, max_len, dtype, max_chunk=max_chunk, tp=tp,
                                                    pages=pages)
                for i in self.cache_layers()]

    @property
    def pages_kv(self) -> bool:
        """Can this decoder's cache be paged (serving/pages.py)? Every cache layer keeps K/V per
        cache index (a sliding-window ring becomes pages read under the window mask: `Attention.
        init_cache`); False where a cache entry is something else (a recurrent state, a
        cross-attention cache)."""
        return True

    @property
    def pages_by_default(self) -> bool:
        """Page this decoder's cache when the backend pages by default (`Tuning.page_size`), not
        only when asked (`page_size=N`). False where pages do not yet save memory over the slot
        layout: a sliding-window ring is window-sized while paged sliding layers keep their pages
        below the window (no recycling yet); Mllama's cross-attention K/V stays a row per slot."""
        return self.pages_kv

    def copy_pages(self, cache: Cache, src: jax.Array, dst: jax.Array) -> Cache:
        """A paged cache with page src copied into page dst (a forked sibling's partial page):
        every leaf of a paged cache has the page axis first (default); a decoder whose cache
        also holds rows per slot copies only its paged part."""
        return jax.tree.map(lambda x: x.at[dst].set(x[src]), cache)

    def check_tensor_parallel(self, tp: int) -> None:
        """Can the decoder be split over tp shards? Every fused projection's parts (heads, KV
        heads, MLP widths) must divide evenly (fewer KV heads than shards replicate); an
        UnsupportedModelError names what does not."""
        from mmjax.models.nn.linear import FusedLinear, check_divisible
        for path, m in nnx.iter_modules(self):
            if isinstance(m, FusedLinear):
                check_divisible(m.parts, tp, f" (in {'.'.join(map(str, path))})")

    @property
    def state_layers(self) -> tuple[int, ...]:
        """Layers whose cache entry is a per-slot recurrent state, not KV (Qwen3.5's Gated DeltaNet):
        every token fed to a row changes it for good, so the engine parks a row between its prompt's
        chunks (no decode step's token lands in it); default none."""
        return ()

    def min_resume(self, held_len: int, max_chunk: int) -> int:
        """The shortest prefix a cache row holding held_len positions can resume from (ring layers
        drop old positions); default any."""
        return 0

    # ---- the forward ---------------------------------------------------------------------------
    def rope(self, positions: jax.Array) -> Any:
        """positions [rows, b, t] -> the RoPE tables the layers read (`layer_rope`); every leaf
        [b, t, ...] (FastV gathers the kept rows of them)."""
        raise NotImplementedError

    def layer_rope(self, i: int, rope: Any) -> Any:
        """Layer i's (cos, sin) out of `rope` (default: the one table)."""
        return rope

    def per_token(self, embeds: jax.Array, **inputs) -> dict:
        """Per-token inputs [b, t, ...] the layers read besides the residual stream (Gemma 4's
        per-layer embeddings, DeepStack's image features); default none."""
        return {}

    def layer_kwargs(self, i: int, per_token: dict) -> dict:
        """Keyword arguments of layer i from the per-token inputs."""
        return {}

    def after_layer(self, i: int, x: jax.Array, per_token: dict) -> jax.Array:
        """The residual stream after layer i (DeepStack adds image features here); default x."""
        return x

    def __call__(self, embeds: jax.Array, meta: AttentionMetadata, cache: Cache, **inputs) -> tuple[jax.Array, Cache]:
        """embeds [b, t, hidden] -> (final-normed hidden [b, t, hidden], the updated cache). Sows
        `hidden_states` (HF's: the embeddings, every layer's output, the last normed)."""
        x, cache, _ = self.run_layers(embeds, meta, cache, None, **inputs)
        return x, cache

    def forward_pruned(self, embeds: jax.Array, meta: AttentionMetadata, cache: Cache, prune: Prune,
                       **inputs) -> tuple[jax.Array, Cache, jax.Array]:
        """`__call__` with FastV pruning after layer prune.layer (the whole prompt from cache index 0,
        meta.kv_len static): the returned hidden has prune.out_len rows, kept tokens first; also
        the image tokens dropped per row [b]."""
        return self.run_layers(embeds, meta, cache, prune, **inputs)

    def run_layers(self, embeds, meta: AttentionMetadata, cache: Cache, prune: Prune | None, **inputs):
        """The layer loop every decoder shares -> (final-normed hidden, cache, dropped [b] or None)."""
        with lora.adapter_rows(meta.adapters):     # each token's adapter, for the adapted linears
            return self._run_layers(embeds, meta, cache, prune, **inputs)

    def _run_layers(self, embeds, meta: AttentionMetadata, cache: Cache, prune: Prune | None, **inputs):
        per_token = self.per_token(embeds, **inputs)
        rope = self.rope(meta.positions)
        cache = list(cache)
        x, dropped = embeds, None
        sow(self, "hidden_states", x)
        for i, layer in enumerate(self.layers):
            c = self.cache_index(i)
            kwargs = self.layer_kwargs(i, per_token)
            if prune is not None and i == prune.layer:
                (x, cache[c]), probs = _with_probs(layer, x, self.layer_rope(i, rope), meta, cache[c], i, **kwargs)
                order, dropped = prune_order(probs, prune)
                x = take_rows(x, order)
                per_token = jax.tree.map(lambda a: take_rows(a, order), per_token)
                meta = meta.compacted(order, prune.out_len)
                # the kept rows of the tables (every rope leaf is [b, t, ...]): no second cos / sin
                rope = jax.tree.map(lambda a: take_rows(a, order), rope)
            else:
                x, cache[c] = layer(x, self.layer_rope(i, rope), meta, cache[c], **kwargs)
            if i < self.num_layers - 1:
                sow(self, "hidden_states", x)
            x = self.after_layer(i, x, per_token)
        x = self.norm(x)
        sow(self, "hidden_states", x)
        return x, cache, dropped

    def logits(self, hidden: jax.Array) -> jax.Array:
        """hidden [..., hidden] -> logits [..., vocab] in float32 (a vocab padded for tensor
        parallelism cut back)."""
        z = self.lm_head(hidden, jnp.float32)
        return z if z.shape[-1] == self.vocab_size else z[..., :self.vocab_size]


def _with_probs(layer: nnx.Module, x, rope, meta: AttentionMetadata, kv, i: int, **kwargs):
    """layer(...) with its attention probabilities captured (FastV's scoring layer) -> ((x, kv),
    probs [b, heads, t, kv_len])."""
    import dataclasses
    scoring = dataclasses.replace(meta, capture=(i,))
    out, inter = nnx.capture(layer, nnx.Intermediate)(x, rope, scoring, kv, **kwargs)
    return out, find_sown(inter, "attn_probs")[0]


def find_sown(state, name: str):
    """The value sown under `name` anywhere in a captured State (the first found)."""
    for path, v in nnx.to_flat_state(state):
        if path[-1] == name:
            return v.get_value() if hasattr(v, "get_value") else v
    raise KeyError(name)
