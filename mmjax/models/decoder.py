"""Llama-style decoder (Llama / Mistral / Qwen2) over an explicit slot KV cache.

KV cache: a list with one {"k", "v"} dict per layer; each holds the sequence axis cut into
segments, `[slots, kv_heads, segment_len, head_dim]` each, whose boundaries are the window
ladder's rungs (`buckets.Buckets.kv_segments`). Attention over a window rung then reads whole
segments in place: a window slice of one `[.., max_len, ..]` array was a copy of the window on
every layer and step (XLA:CPU materialises slices that feed a dot), about a third of the
16-row decode step at a 512 window (benchmarks/README.md, "KV segments").
Head-major: a slot's segment of one KV head is one contiguous [segment_len, head_dim] block, so
attention reads it without a transpose; see `cache_attention`.
One array per layer (not one stacked array) because slicing a layer out of a stacked array inside
the decode step copied every layer's weights each step on XLA CPU (see facts.md).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from mmjax.checkpoint import TensorSource, fused_linear, linear
from mmjax.config import TextConfig
from mmjax.models.layers import dense, rms_norm

KVCache = list  # [{"k": [[slots, kv_heads, segment_len, head_dim], ...], "v": ...}] * layers


def load_decoder_params(src: TensorSource, cfg: TextConfig, prefix: str, lm_head_name: str) -> dict:
    """HF LlamaForCausalLM-style weights -> params with fused qkv and gate_up matmuls."""
    d, hd, i = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    q_out, kv_out = cfg.num_heads * hd, cfg.num_kv_heads * hd
    layers = []
    for n in range(cfg.num_layers):
        lp = f"{prefix}layers.{n}."
        layers.append({
            "ln1": src.take(lp + "input_layernorm.weight", (d,)),
            "qkv": fused_linear(src, [lp + f"self_attn.{x}_proj" for x in "qkv"], d,
                                [q_out, kv_out, kv_out], cfg.attention_bias),
            "o": linear(src, lp + "self_attn.o_proj", q_out, d, False),
            "ln2": src.take(lp + "post_attention_layernorm.weight", (d,)),
            "gate_up": fused_linear(src, [lp + "mlp.gate_proj", lp + "mlp.up_proj"], d, [i, i], cfg.mlp_bias),
            "down": linear(src, lp + "mlp.down_proj", i, d, cfg.mlp_bias),
        })
    embed = src.take(prefix + "embed_tokens.weight", (cfg.vocab_size, d))
    if cfg.tie_word_embeddings and not src.has(lm_head_name):
        lm_head = np.ascontiguousarray(embed.T)
    else:
        lm_head = np.ascontiguousarray(src.take(lm_head_name, (cfg.vocab_size, d)).T)
    return {"embed": embed, "layers": layers, "norm": src.take(prefix + "norm.weight", (d,)),
            "lm_head": lm_head}


def init_kv_cache(cfg: TextConfig, num_slots: int, max_len: int, dtype,
                  segments: tuple[int, ...] | None = None) -> KVCache:
    """Zero cache; `segments`: lengths of the sequence-axis pieces (sum max_len; default one).
    Every window passed to `forward` must be a segment boundary."""
    segments = tuple(segments or (max_len,))
    if sum(segments) != max_len or min(segments) < 1:
        raise ValueError(f"KV segments {segments} do not cut max_len {max_len}")

    def pieces():
        return [jnp.zeros((num_slots, cfg.num_kv_heads, n, cfg.head_dim), dtype) for n in segments]
    return [{"k": pieces(), "v": pieces()} for _ in range(cfg.num_layers)]


def rope_inv_freq(cfg: TextConfig) -> np.ndarray:
    """Inverse frequencies [head_dim // 2] (float32), with the config's rope scaling applied."""
    r, dim = cfg.rope, cfg.head_dim
    inv = 1.0 / (r.theta ** (np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / dim))
    inv = inv.astype(np.float32)
    if r.rope_type == "linear":
        inv = inv / r.factor
    elif r.rope_type == "llama3":
        low_wavelen = r.original_max_position_embeddings / r.low_freq_factor
        high_wavelen = r.original_max_position_embeddings / r.high_freq_factor
        wavelen = 2 * np.pi / inv
        scaled = np.where(wavelen > low_wavelen, inv / r.factor, inv)
        smooth = (r.original_max_position_embeddings / wavelen - r.low_freq_factor) / (
            r.high_freq_factor - r.low_freq_factor)
        smoothed = (1 - smooth) * scaled / r.factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        inv = np.where(medium, smoothed, scaled).astype(np.float32)
    return inv


def rope_cos_sin(inv_freq: jax.Array, positions: jax.Array, mrope_section=None):
    """positions [b, t] (or [3, b, t] for M-RoPE) -> cos, sin [b, t, head_dim] in float32.

    M-RoPE: frequency band i of `mrope_section` takes its angle from the temporal, height or
    width position row (Qwen2-VL), each section repeated for both rotated halves.
    """
    pos = positions.astype(jnp.float32)
    freqs = pos[..., None] * inv_freq  # [..., b, t, hd/2]
    if mrope_section is not None:
        bands, start = [], 0
        for axis, width in enumerate(mrope_section):
            bands.append(freqs[axis, ..., start:start + width])
            start += width
        freqs = jnp.concatenate(bands, axis=-1)
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb), jnp.sin(emb)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """x [b, t, heads, hd]; HF's rotate_half convention (halves, not interleaved pairs)."""
    half = x.shape[-1] // 2
    rot = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    c, s = cos[:, :, None, :], sin[:, :, None, :]
    return (x.astype(jnp.float32) * c + rot.astype(jnp.float32) * s).astype(x.dtype)


def cache_attention(q: jax.Array, ks: list, vs: list, q_index: jax.Array) -> jax.Array:
    """Causal attention of new queries over a cache window given as consecutive segments.

    q [b, t, heads, hd]; ks, vs: segments [b, kv_heads, len_i, hd] covering cache indexes
    [0, sum len_i); q_index [b, t] = cache index of each query. Key j is visible to a query at
    index i iff j <= i (so stale entries past a sequence's end are never read). Returns
    [b, t, heads, hd]. Softmax across segments: one max over all of them, then the unnormalised
    exp(s - max) of each segment times its V, summed, divided by the summed weights once.

    Per (b, kv_head) both products read a segment [len, hd] as a plain row-major operand:
    scores [len, n] = K q^T and out [n, hd] = P^T V with n = t * group queries. Written any
    other way (e.g. scores as [n, len]) XLA:CPU makes V the transposed left operand of a
    [hd, len] x [len, n] product, which ran 2-3x slower at decode (benchmarks/README.md,
    "KV layout A/B").
    """
    b, t, h, hd = q.shape
    kvh = ks[0].shape[1]
    g = h // kvh
    n = t * g
    qn = q.reshape(b, t, kvh, g, hd).transpose(0, 2, 1, 3, 4).reshape(b, kvh, n, hd)
    scores, start = [], 0
    for k in ks:
        s = jnp.einsum("bksd,bknd->bksn", k, qn, preferred_element_type=jnp.float32) / np.sqrt(hd)
        visible = start + jnp.arange(k.shape[2])[None, :, None] <= q_index[:, None, :]  # [b, len, t]
        s = jnp.where(visible[:, None, :, :, None], s.reshape(b, kvh, -1, t, g), -jnp.inf)
        scores.append(s.reshape(b, kvh, -1, n))
        start += k.shape[2]
    top = scores[0].max(axis=2)
    for s in scores[1:]:
        top = jnp.maximum(top, s.max(axis=2))
    out, total = 0.0, 0.0
    for s, v in zip(scores, vs):
        w = jnp.exp(s - top[:, :, None, :])  # [b, kvh, len, n]
        total = total + w.sum(axis=2)
        out = out + jnp.einsum("bksn,bksd->bknd", w.astype(v.dtype), v, preferred_element_type=jnp.float32)
    out = out / total[..., None]
    return out.reshape(b, kvh, t, g, hd).transpose(0, 2, 1, 3, 4).reshape(b, t, h, hd).astype(q.dtype)


def forward(params: dict, cfg: TextConfig, embeds: jax.Array, positions: jax.Array, cache: KVCache,
            starts: jax.Array, *, window: int, slots: jax.Array | None = None,
            inv_freq: jax.Array | None = None) -> tuple[jax.Array, KVCache]:
    """Run the decoder on new tokens and write their K/V into the cache.

    embeds [b, t, hidden]; positions [b, t] rope positions ([3, b, t] for M-RoPE); starts [b]:
    cache index of each row's first new token; slots [b]: cache row of each batch row (None means
    batch row i is slot i, the decode step's layout: rows [0, b) read with a slice, no gather);
    window (static): cache prefix attended to, >= max(starts) + t and a segment boundary.
    Returns (final-normed hidden [b, t, hidden], updated cache).
    """
    x = embeds
    rope = rope_for(cfg, positions, starts, embeds.shape[1], inv_freq)
    new_cache = []
    for layer, kv in zip(params["layers"], cache):
        x, kv = layer_forward(layer, cfg, x, kv, rope, window=window, slots=slots)
        new_cache.append(kv)
    return rms_norm(params["norm"], x, cfg.rms_norm_eps), new_cache


def rope_for(cfg: TextConfig, positions: jax.Array, starts: jax.Array, t: int,
             inv_freq: jax.Array | None = None) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(cos, sin [b, t, head_dim], q_index [b, t] = cache index of each new token)."""
    if inv_freq is None:
        inv_freq = jnp.asarray(rope_inv_freq(cfg))
    cos, sin = rope_cos_sin(inv_freq, positions, cfg.rope.mrope_section)
    return cos, sin, starts[:, None] + jnp.arange(t)[None, :]


def layer_forward(layer: dict, cfg: TextConfig, x: jax.Array, kv: dict, rope: tuple, *,
                  window: int, slots: jax.Array | None = None) -> tuple[jax.Array, dict]:
    """One decoder layer: x [b, t, hidden] (residual stream) -> (x, updated {"k", "v"} cache of
    this layer). rope = rope_for(...); window / slots as in `forward`."""
    b, t, _ = x.shape
    h, kvh, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    cos, sin, q_index = rope
    rows = jnp.arange(b) if slots is None else slots
    hn = rms_norm(layer["ln1"], x, cfg.rms_norm_eps)
    qkv = dense(layer["qkv"], hn)
    q = qkv[..., : h * hd].reshape(b, t, h, hd)
    k = qkv[..., h * hd: (h + kvh) * hd].reshape(b, t, kvh, hd)
    v = qkv[..., (h + kvh) * hd:].reshape(b, t, kvh, hd)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    # Each new token goes to the segment holding its cache index; indexes outside a segment
    # (and padded tail tokens of a bucketed chunk past max_len) map past its end and mode="drop"
    # skips them (a negative index would wrap). Segments past the window are never written:
    # window >= max(starts) + t. (rows [b, 1], :, idx [b, t]) indexes [b, t, kv_heads, hd].
    new_k, new_v, kw, vw, start = [], [], [], [], 0
    for ck, cv in zip(kv["k"], kv["v"]):
        size = ck.shape[2]
        if start < window:
            idx = q_index - start
            idx = jnp.where((idx >= 0) & (idx < size), idx, size)
            ck = ck.at[rows[:, None], :, idx].set(k.astype(ck.dtype), mode="drop")
            cv = cv.at[rows[:, None], :, idx].set(v.astype(cv.dtype), mode="drop")
            # decode reads rows [0, b) (a no-op slice when b == slots); prefill gathers its slots
            kw.append(ck[:b] if slots is None else ck[slots])
            vw.append(cv[:b] if slots is None else cv[slots])
        new_k.append(ck)
        new_v.append(cv)
        start += size
    if sum(c.shape[2] for c in kw) != window:
        raise ValueError(f"window {window} is not a KV segment boundary "
                         f"{[c.shape[2] for c in kv['k']]}")
    attn = cache_attention(q, kw, vw, q_index)
    x = x + dense(layer["o"], attn.reshape(b, t, h * hd))
    hn = rms_norm(layer["ln2"], x, cfg.rms_norm_eps)
    gu = dense(layer["gate_up"], hn)
    gate, up = gu[..., : cfg.intermediate_size], gu[..., cfg.intermediate_size:]
    x = x + dense(layer["down"], jax.nn.silu(gate) * up)
    return x, {"k": new_k, "v": new_v}


def lm_logits(params: dict, hidden: jax.Array) -> jax.Array:
    """hidden [..., hidden] -> logits [..., vocab] in float32."""
    return (hidden @ params["lm_head"]).astype(jnp.float32)


def embed_tokens(params: dict, token_ids: jax.Array) -> jax.Array:
    return jnp.take(params["embed"], token_ids, axis=0, mode="clip")
