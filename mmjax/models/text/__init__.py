"""Text models: the decoder architectures behind one small protocol.

A family names its text model; the runner only ever talks to it through `TextModel`:

    cache = tm.init_cache(num_slots, max_len, dtype, max_chunk=prefill_chunk)
    x = tm.embed(params["text"], ids)                                  # [b, t, hidden]
    out = tm.forward(params["text"], x, positions, cache, starts, kv_len, slots=..., mask=..., ids=ids,
                     capture=...)
    logits = tm.logits(params["text"], out.hidden)                     # float32

`Output(hidden, cache, intermediates)` carries named intermediates only when `capture` asks for
them (big_vision's `(x, out)` style), so the serving steps compile to the same HLO as before.
`MaskSpec` says which cached keys a new token sees beyond plain causality: a sliding window, and
bidirectional spans (e.g. an image's tokens attending to each other).

Per-layer image features (Qwen3-VL's DeepStack): a text model with `image_feature_layers = n > 0`
takes image features [tokens, (1 + n) * hidden] (the input embedding, then one addition per
layer); `image_inputs` splits them into the embeddings and `forward(..., layer_adds=[n, b, t,
hidden])`, added to the residual stream after layers 0..n-1 at image tokens (zeros elsewhere).
The features are per token, so chunked prefill, the encoder cache and prefix-cache resume carry
them like plain features.

`text_model_for(hf_text_config)` picks the implementation by the text config's `model_type`
(one registration per architecture in `TEXT_MODELS`).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import jax
import jax.numpy as jnp

from mmjax.errors import UnsupportedModelError


@dataclass(frozen=True)
class MaskSpec:
    """Visibility of cached keys to new tokens, on top of causality (key index <= query index).

    sliding_window: a query at cache index i sees keys j with i - j < window (None: all).
    spans: [b, t] int32 per new token, -1 for none: tokens of one span in the same call see each
        other in both directions (a span must lie within one call: the caller keeps chunk
        boundaries outside spans). A traced array, so one compiled step serves every layout.
    key_spans: [b, u] int32 or None (then `spans`): the spans of row b's sequence's new tokens
        from its first new cache index on (attention's `starts`), when the row's queries are only
        part of them (packed prefill: a block of a longer chunk, models/text/packing.py).
    """
    sliding_window: int | None = None
    spans: jax.Array | None = None
    key_spans: jax.Array | None = None

    @property
    def span_keys(self) -> jax.Array | None:
        """[b, u] the span of each new token as a key (`key_spans`, else `spans`)."""
        return self.spans if self.key_spans is None else self.key_spans


jax.tree_util.register_dataclass(MaskSpec, data_fields=["spans", "key_spans"], meta_fields=["sliding_window"])


@dataclass(frozen=True)
class Prune:
    """FastV token pruning inside one prefill call (text models with `supports_prune`): after
    decoder layer `layer`, keep the `keep` image tokens that `query`'s head-averaged attention at
    that layer favours most; the other image tokens leave the sequence, so later layers compute
    over and cache `out_len` (static, >= the tokens left) positions, kept tokens first in order.

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
class Capture:
    """Intermediates to return (static: a different capture compiles a different function).

    hidden: every layer's residual stream as HF's `hidden_states` ([0] = embeddings, [i] = after
        layer i, the last one final-normed), each [b, t, hidden].
    attn_layers: layers whose attention probabilities [b, heads, t, kv_len] and per-head outputs
        [b, t, heads, head_dim] (before the output projection) are returned; needs a static
        kv_len. Those layers run an explicit-softmax attention (same math).
    """
    hidden: bool = False
    attn_layers: tuple[int, ...] = ()

    @property
    def any(self) -> bool:
        return self.hidden or bool(self.attn_layers)


@dataclass
class Output:
    """hidden [b, t, hidden] (final-normed), the updated cache, and the requested intermediates:
    {"hidden": [...], "attn": {layer: probs}, "attn_out": {layer: per-head outputs}}."""
    hidden: jax.Array
    cache: Any
    intermediates: dict = field(default_factory=dict)


jax.tree_util.register_dataclass(Output, data_fields=["hidden", "cache", "intermediates"], meta_fields=[])


class TextModel(Protocol):
    """What the runner needs from a decoder architecture (all pure functions of params/arrays)."""
    hidden_size: int
    vocab_size: int
    num_layers: int
    max_position_embeddings: int
    position_rows: int          # rows of the positions array: 1 (RoPE) or 3 (M-RoPE)

    def init_cache(self, num_slots: int, max_len: int, dtype, sharding=None, *, max_chunk: int | None = None) -> Any:
        """A zero cache for `num_slots` sequences of up to `max_len` positions; max_chunk: the most
        new tokens one call writes per row (a ring-buffer sliding-window cache sizes its ring by it)."""

    # Optional: `min_resume(held_len, max_chunk) -> int`, the shortest prefix a cache row holding
    # `held_len` positions (cache built with `max_chunk`) can resume from (ring-buffer layers drop
    # old positions); absent = any prefix.
    # Optional: `supports_prune = True` when `forward` takes `prune: Prune` and `dropped: Dropped`
    # (FastV image-token pruning, mmjax.research.Prune), and `max_prune_layer` (default
    # num_layers - 2) when pruning after later layers is not defined.
    # Optional: `image_feature_layers = n > 0` when `forward` takes `layer_adds` (see the module
    # docstring; absent = 0).

    def embed(self, params: dict, ids: jax.Array) -> jax.Array: ...

    def forward(self, params: dict, embeds: jax.Array, positions: jax.Array, cache: Any, starts: jax.Array,
                kv_len, *, slots: jax.Array | None = None, mask: MaskSpec | None = None,
                ids: jax.Array | None = None, capture: Capture | None = None,
                reduce_small: bool = False) -> Output:
        """ids [b, t]: the new tokens' ids (image positions hold the image token id), for decoders
        that embed per layer (Gemma 4); others ignore them."""

    def logits(self, params: dict, hidden: jax.Array) -> jax.Array: ...


def image_feature_width(tm: TextModel) -> int:
    """Columns of one image token's features: hidden_size x (1 + image_feature_layers)."""
    return tm.hidden_size * (1 + getattr(tm, "image_feature_layers", 0))


def image_inputs(tm: TextModel, params: dict, ids: jax.Array, image_embeds: jax.Array,
                 image_mask: jax.Array) -> tuple[jax.Array, dict]:
    """(ids [..., t], image features [..., t, image_feature_width], image_mask [..., t]) -> the
    input embeddings [..., t, hidden] (image tokens take their features' first block) and the
    extra `forward` kwargs: {"layer_adds": [n, ..., t, hidden]} (zero at text tokens) for text
    models with image_feature_layers = n > 0, else {}."""
    d = tm.hidden_size
    embeds = jnp.where(image_mask[..., None], image_embeds[..., :d], tm.embed(params, ids))
    n = getattr(tm, "image_feature_layers", 0)
    if not n:
        return embeds, {}
    adds = image_embeds[..., d:].reshape(*image_embeds.shape[:-1], n, d)
    adds = jnp.where(image_mask[..., None, None], adds, 0)
    return embeds, {"layer_adds": jnp.moveaxis(adds, -2, 0)}


class ConfigShape:
    """The `TextModel` size properties read from a `cfg` with hidden_size, vocab_size,
    num_layers and max_position_embeddings (shared by the decoder implementations)."""
    cfg: Any

    @property
    def hidden_size(self) -> int:
        return self.cfg.hidden_size

    @property
    def vocab_size(self) -> int:
        return self.cfg.vocab_size

    @property
    def num_layers(self) -> int:
        return self.cfg.num_layers

    @property
    def max_position_embeddings(self) -> int:
        return self.cfg.max_position_embeddings


def text_model_for(hf_text_cfg: dict, where: str = "text_config", **overrides) -> TextModel:
    """The text model for a HF text config (its `model_type` picks the architecture)."""
    mt = hf_text_cfg.get("model_type", "llama")
    if mt not in TEXT_MODELS:
        raise UnsupportedModelError(f"config.json: {where}.model_type={mt!r} is not a supported decoder "
                                    f"(supported: {', '.join(sorted(TEXT_MODELS))})", param=f"{where}.model_type")
    import importlib

    module = importlib.import_module(TEXT_MODELS[mt])
    return module.from_hf(hf_text_cfg, where, **overrides)


# HF text `model_type` -> module with `from_hf(cfg, where, **overrides) -> TextModel`.
TEXT_MODELS = {
    "llama": "mmjax.models.text.llama",
    "mistral": "mmjax.models.text.llama",
    "qwen2": "mmjax.models.text.llama",
    "gemma3_text": "mmjax.models.text.gemma3",
    "gemma4_text": "mmjax.models.text.gemma4",
}
