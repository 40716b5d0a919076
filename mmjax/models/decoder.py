"""Llama-style decoder (Llama / Mistral / Qwen2) over an explicit slot KV cache.

KV cache: a list with one {"k", "v"} dict per layer; each holds the sequence axis cut into
segments (`kv_segments`: 128 positions each up to 1024, then doubling), K
`[slots, kv_heads, head_dim, segment_len]` and V `[slots, kv_heads, segment_len, head_dim]`.
Attention takes `kv_len`, a traced count of the cache positions in use, and skips (`lax.cond`)
every segment from kv_len on: one compiled step serves every sequence length and pays for the
longest one in 128-position steps (a static window ladder compiled one step per rung, and a
window slice of one `[.., max_len, ..]` array was a copy per layer and step: XLA:CPU
materialises slices that feed a dot; benchmarks/README.md, "KV segments").
Head-major: a slot's segment of one KV head is one contiguous block, K stored transposed
([head_dim, segment_len]) and V not ([segment_len, head_dim]), so both of decode attention's
reductions run over a non-minor axis and prefill's dots read plain row-major operands; see
`cache_attention`.
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

KVCache = list  # per layer {"k": [[slots, kv_heads, head_dim, len_i], ...],
#                              "v": [[slots, kv_heads, len_i, head_dim], ...]}
KV_SEGMENT = 128
# cache_attention avoids dots for <= SMALL_N queries per KV head when a batched dot would make
# >= SMALL_N_MIN_CALLS small matmul calls (one per row and KV head)
SMALL_N, SMALL_N_MIN_CALLS = 8, 32


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


def kv_segments(max_len: int, segment: int = KV_SEGMENT, fine: int = 8) -> tuple[int, ...]:
    """Segment lengths cutting [0, max_len): `fine` segments of `segment` positions (the
    granularity decode pays in up to fine * segment), then each one as long as all before it,
    the last cut at max_len. The count grows with log(max_len): every segment costs a scatter
    and a cond per layer and step (32k positions: 13 segments)."""
    out, total = [], 0
    while total < max_len:
        n = min(segment if len(out) < fine else total, max_len - total)
        out.append(n)
        total += n
    return tuple(out)


def init_kv_cache(cfg: TextConfig, num_slots: int, max_len: int, dtype,
                  segment: int = KV_SEGMENT) -> KVCache:
    """Zero cache of `num_slots` rows, `max_len` positions cut into `kv_segments(max_len, segment)`:
    K segments [slots, kv_heads, head_dim, len] (transposed), V segments [slots, kv_heads, len,
    head_dim]; see `cache_attention` for why."""
    def zeros(shapes):
        return [jnp.zeros((num_slots, cfg.num_kv_heads) + shape, dtype) for shape in shapes]
    cuts = kv_segments(max_len, segment)
    return [{"k": zeros([(cfg.head_dim, n) for n in cuts]), "v": zeros([(n, cfg.head_dim) for n in cuts])}
            for _ in range(cfg.num_layers)]


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


def _when(pred, fn, otherwise, *args):
    """fn(*args) if pred else otherwise(*args): a Python branch for a concrete pred, else
    lax.cond (XLA runs only the taken branch)."""
    if isinstance(pred, (bool, np.bool_)):
        return (fn if pred else otherwise)(*args)
    return jax.lax.cond(pred, fn, otherwise, *args)


def cache_attention(q: jax.Array, kts: list, vs: list, q_index: jax.Array, kv_len,
                    slots: jax.Array | None = None) -> jax.Array:
    """Causal attention of new queries over a cache given as consecutive segments.

    q [b, t, heads, hd]; kts: K segments transposed [slots, kv_heads, hd, len_i], vs: V segments
    [slots, kv_heads, len_i, hd], covering cache indexes [0, sum len_i); query row i reads cache
    row slots[i] (None: row i, the decode layout); q_index [b, t] = cache index of each query;
    kv_len (int or traced int32 scalar) > every q_index that matters: segments starting at or
    after it are not computed. Key j is visible to a query at index i iff j <= i (so stale
    entries past a sequence's end are never read). Returns [b, t, heads, hd]; a query with no
    visible key gets zeros.

    Each segment yields (max, sum of exp(s - max), exp(s - max) V) and the segments are merged
    with the usual rescaling, as flash attention merges key blocks. With few queries per KV head
    (n = t * group <= SMALL_N: decode) both products are broadcast-multiply-reduce over a
    non-minor axis (scores sum K^T [hd, len] rows, out sums V [len, hd] rows), which the decode
    step hands to YNN's reductions, where a batched dot makes one small matmul call per (row,
    KV head): 128 per segment at 16 rows, 1.6x slower (benchmarks/README.md, "K^T decode
    attention"). Below SMALL_N_MIN_CALLS such calls the dots stay (a reduction call has the
    larger fixed cost). Larger n (prefill) uses dots on the same layouts: scores [n, len] = q K^T
    and out [n, hd] = P V, both plain row-major operands.
    """
    b, t, h, hd = q.shape
    kvh = kts[0].shape[1]
    g = h // kvh
    n = t * g
    small = n <= SMALL_N and b * kvh >= SMALL_N_MIN_CALLS
    qn = q.reshape(b, t, kvh, g, hd).transpose(0, 2, 1, 3, 4).reshape(b, kvh, n, hd)

    def segment(kt, v, start, top, total, out):
        # decode: rows [0, b) (a no-op slice when b == slots); prefill: gather its slots
        kt, v = (kt[:b], v[:b]) if slots is None else (kt[slots], v[slots])
        size = v.shape[2]
        if small:
            s = (kt[:, :, None].astype(jnp.float32) * qn[..., None].astype(jnp.float32)).sum(axis=3)
        else:
            s = jnp.einsum("bknd,bkds->bkns", qn, kt, preferred_element_type=jnp.float32)
        s = s / np.sqrt(hd)                                           # [b, kvh, n, len]
        visible = start + jnp.arange(size)[None, None, :] <= q_index[:, :, None]  # [b, t, len]
        s = jnp.where(visible[:, None, :, None, :], s.reshape(b, kvh, t, g, size), -jnp.inf)
        s = s.reshape(b, kvh, n, size)
        new_top = jnp.maximum(top, s.max(axis=3))             # [b, kvh, n]; -inf: nothing visible yet
        shift = jnp.where(jnp.isfinite(new_top), new_top, 0.0)
        w = jnp.exp(s - shift[..., None])
        if small:
            pv = (w[..., None] * v[:, :, None].astype(jnp.float32)).sum(axis=3)
        else:
            pv = jnp.einsum("bkns,bksd->bknd", w.astype(v.dtype), v, preferred_element_type=jnp.float32)
        rescale = jnp.exp(top - shift)                        # 0 while nothing was visible
        return new_top, total * rescale + w.sum(axis=3), out * rescale[..., None] + pv

    # running (max, sum of exp, exp-weighted V) carried through the segments; a skipped segment
    # passes it on unchanged
    carry = (jnp.full((b, kvh, n), -jnp.inf), jnp.zeros((b, kvh, n)), jnp.zeros((b, kvh, n, hd)))
    start = 0
    for kt, v in zip(kts, vs):
        carry = _when(start < kv_len, lambda kt, v, *c, start=start: segment(kt, v, start, *c),
                      lambda kt, v, *c: c, kt, v, *carry)
        start += v.shape[2]
    _, total, out = carry
    out = out / jnp.where(total > 0, total, 1.0)[..., None]
    return out.reshape(b, kvh, t, g, hd).transpose(0, 2, 1, 3, 4).reshape(b, t, h, hd).astype(q.dtype)


def forward(params: dict, cfg: TextConfig, embeds: jax.Array, positions: jax.Array, cache: KVCache,
            starts: jax.Array, kv_len, *, slots: jax.Array | None = None,
            inv_freq: jax.Array | None = None) -> tuple[jax.Array, KVCache]:
    """Run the decoder on new tokens and write their K/V into the cache.

    embeds [b, t, hidden]; positions [b, t] rope positions ([3, b, t] for M-RoPE); starts [b]:
    cache index of each row's first new token; slots [b]: cache row of each batch row (None means
    batch row i is slot i, the decode step's layout: rows [0, b) read with a slice, no gather);
    kv_len (int or traced int32 scalar): cache positions in use, >= max(starts) + t (segments
    from kv_len on are not read; no new token lands there either).
    Returns (final-normed hidden [b, t, hidden], updated cache).
    """
    x = embeds
    rope = rope_for(cfg, positions, starts, embeds.shape[1], inv_freq)
    new_cache = []
    for layer, kv in zip(params["layers"], cache):
        x, kv = layer_forward(layer, cfg, x, kv, rope, kv_len, slots=slots)
        new_cache.append(kv)
    return rms_norm(params["norm"], x, cfg.rms_norm_eps), new_cache


def rope_for(cfg: TextConfig, positions: jax.Array, starts: jax.Array, t: int,
             inv_freq: jax.Array | None = None) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(cos, sin [b, t, head_dim], q_index [b, t] = cache index of each new token)."""
    if inv_freq is None:
        inv_freq = jnp.asarray(rope_inv_freq(cfg))
    cos, sin = rope_cos_sin(inv_freq, positions, cfg.rope.mrope_section)
    return cos, sin, starts[:, None] + jnp.arange(t)[None, :]


def layer_forward(layer: dict, cfg: TextConfig, x: jax.Array, kv: dict, rope: tuple, kv_len, *,
                  slots: jax.Array | None = None) -> tuple[jax.Array, dict]:
    """One decoder layer: x [b, t, hidden] (residual stream) -> (x, updated {"k", "v"} cache of
    this layer). rope = rope_for(...); kv_len / slots as in `forward`."""
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
    # (and padded tail tokens of a bucketed chunk past max_len) map to distinct positions past
    # its end, which mode="drop" skips (a negative index would wrap) and which keep the
    # unique_indices promise true (XLA:CPU's scatter walks every update, dropped ones included;
    # the promise cut a 256-token prefill chunk into 8 segments from 501 to ~480 ms). Every
    # segment takes the scatter: a lax.cond around it made prefill slower, decode no faster
    # (benchmarks/README.md, "KV segments", "K^T decode attention"). (rows [b, 1], :, idx [b, t])
    # on V and (rows, :, :, idx) on K^T both index [b, t, kv_heads, hd].
    new_k, new_v, start = [], [], 0
    for ck, cv in zip(kv["k"], kv["v"]):
        size = cv.shape[2]
        idx = q_index - start
        idx = jnp.where((idx >= 0) & (idx < size), idx, size + jnp.arange(t))
        new_k.append(ck.at[rows[:, None], :, :, idx].set(k.astype(ck.dtype), mode="drop",
                                                         unique_indices=True))
        new_v.append(cv.at[rows[:, None], :, idx].set(v.astype(cv.dtype), mode="drop",
                                                      unique_indices=True))
        start += size
    attn = cache_attention(q, new_k, new_v, q_index, kv_len, slots)
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
