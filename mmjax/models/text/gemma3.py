"""Gemma 3 decoder (`gemma3_text`): the `TextModel` of Gemma3ForConditionalGeneration.

Differences from Llama (models/text/llama.py, whose cache layout and attention it reuses):
(1 + w) RMSNorm computed in float32, pre- and post-norms around attention and MLP, RMS QK-norm
per head, embeddings scaled by sqrt(hidden) (in the weights' dtype, as HF does), GELU-tanh MLP,
scores scaled by query_pre_attn_scalar ** -0.5, and per-layer `layer_types`: sliding-window
layers with their own RoPE (local theta) and full-attention layers (global theta + scaling).

KV cache, one entry per layer:
- full-attention layers: llama's segmented slot cache ({"k": K^T segments, "v": V segments},
  `cache_attention` with Gemma's scale);
- sliding layers: a ring {"k": [K^T [slots, kv_heads, hd, R]], "v": [V [slots, kv_heads, R, hd]]}
  of R = window + max_chunk - 1 positions (cache index i lives at i mod R), so a call writing
  max_chunk tokens still leaves every query its full window: memory O(window), not O(max_len).
  A ring slot's cache index is recomputed from the row's write end (`ring_key_index`); slots
  never written by the row, or overwritten, fall outside every query's window or are negative.
  Padded tail tokens of a bucketed chunk (their position repeats the last one: the runner pads
  positions with mode="edge") and tokens at cache index >= kv_len (the decode rows of free
  slots, which the engine parks at max_model_len) are not written, so a retained row keeps
  exactly its last `ring` positions and can resume from any prefix within max_chunk of its end
  (`min_resume`).

Masks (transformers' Gemma 3 vision masks): full layers see causal OR same-image-run keys;
sliding layers see (causal OR same run) AND inside the window (kv > q - window), so an image's
tokens see their later image tokens both ways but old ones only within the window.

Tensor parallelism (mmjax.sharding): the params have llama's names and fused shapes, so llama's
`tp_layout` regroups qkv / gate_up per shard and `PARAM_AXES` splits them; with fewer KV heads
than shards both cache kinds hold tp KV heads (`cache_kv_heads`) and are sharded on that axis
(rings and segments are both `{"k", "v"}` leaves: `CACHE_AXES`); QK-norm is per head, so local.

transformers 5.23's Gemma3ForConditionalGeneration applies neither `final_logit_softcapping` nor
`attn_logit_softcapping` (Gemma3Attention never passes softcap to its attention function, and
only Gemma3ForCausalLM caps logits); both are implemented here and the family decides
(`Gemma3TextConfig.final_logit_softcapping` / `attn_logit_softcapping`).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from mmjax.checkpoint import TensorSource, fused_linear, linear
from mmjax.errors import UnsupportedModelError
from mmjax.models.hf_config import require
from mmjax.models.layers import activation, dense, matmul
from mmjax.models.text import Capture, ConfigShape, Dropped, MaskSpec, Output, Prune, prune_order, take_rows
from mmjax.models.text.kv_quant import dequantize, layer_scales, operand
from mmjax.models.text.llama import (_grouped_dense, _split_grouped_qkv, allocate_cache, cache_attention,
                                     cache_kv_heads, check_tensor_parallel, init_kv_cache, kv_layer, quantize_kv,
                                     scatter_kv, scatter_segment, split_grouped_gate_up, tp_layout)
from mmjax.models.text.packing import Packing
from mmjax.models.text.rope import RopeConfig, apply_rope, rope_cos_sin, rope_inv_freq

SLIDING, FULL = "sliding_attention", "full_attention"


@dataclass(frozen=True)
class Gemma3TextConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    query_pre_attn_scalar: float
    sliding_window: int
    layer_types: tuple[str, ...]
    rope_local: RopeConfig
    rope_global: RopeConfig
    hidden_act: str = "gelu_pytorch_tanh"
    attention_bias: bool = False
    tie_word_embeddings: bool = True
    final_logit_softcapping: float | None = None
    attn_logit_softcapping: float | None = None

    @classmethod
    def from_hf(cls, cfg: dict, where: str = "text_config", **overrides) -> "Gemma3TextConfig":
        """transformers 5 saves `rope_parameters` per layer type ({"sliding_attention": {...},
        "full_attention": {...}}); v4 configs say rope_theta, rope_local_base_freq, rope_scaling."""
        if cfg.get("use_bidirectional_attention"):
            raise UnsupportedModelError(f"config.json: {where}.use_bidirectional_attention=true (an embedding "
                                        "model) is not supported", param=f"{where}.use_bidirectional_attention")
        hidden = int(require(cfg, "hidden_size", where))
        heads = int(require(cfg, "num_attention_heads", where, 8))
        n_layers = int(require(cfg, "num_hidden_layers", where))
        types = cfg.get("layer_types")
        if types is None:
            pattern = int(cfg.get("sliding_window_pattern", 6))
            types = [SLIDING if (i + 1) % pattern else FULL for i in range(n_layers)]
        if len(types) != n_layers or any(t not in (SLIDING, FULL) for t in types):
            raise UnsupportedModelError(f"config.json: {where}.layer_types must list {n_layers} of "
                                        f"{SLIDING!r} / {FULL!r}", param=f"{where}.layer_types")
        act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh"
        activation(act)
        rp = cfg.get("rope_parameters") or {}
        per_type = isinstance(rp, dict) and (SLIDING in rp or FULL in rp)
        glob = dict(rp.get(FULL) or {}) if per_type else dict(rp)
        loc = dict(rp.get(SLIDING) or {}) if per_type else {}
        for k, v in (cfg.get("rope_scaling") or {}).items():
            glob.setdefault(k, v)
        glob.setdefault("rope_theta", cfg.get("rope_theta", 1_000_000.0))
        loc.setdefault("rope_theta", cfg.get("rope_local_base_freq", 10_000.0))
        mpe = int(cfg.get("max_position_embeddings", 131072))

        def rope(params: dict, name: str) -> RopeConfig:
            return RopeConfig.from_hf({"rope_parameters": params, "max_position_embeddings": mpe},
                                      f"{where}.rope_parameters.{name}")

        window = cfg.get("sliding_window")
        if window is None and SLIDING in types:
            raise UnsupportedModelError(f"config.json: {where}.sliding_window is missing", param=f"{where}.sliding_window")
        caps = {k: (float(cfg[k]) if cfg.get(k) is not None else None)
                for k in ("final_logit_softcapping", "attn_logit_softcapping")}
        parsed = dict(
            vocab_size=int(require(cfg, "vocab_size", where)),
            hidden_size=hidden,
            intermediate_size=int(require(cfg, "intermediate_size", where)),
            num_layers=n_layers, num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=mpe,
            query_pre_attn_scalar=float(cfg.get("query_pre_attn_scalar", 256)),
            sliding_window=int(window or 0), layer_types=tuple(types),
            rope_local=rope(loc, SLIDING), rope_global=rope(glob, FULL), hidden_act=act,
            attention_bias=bool(cfg.get("attention_bias", False)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)), **caps)
        return cls(**{**parsed, **overrides})

    @property
    def scale(self) -> float:
        return float(self.query_pre_attn_scalar) ** -0.5

    def ring_len(self, max_len: int, max_chunk: int | None) -> int:
        """Positions a sliding layer's ring holds: window + max_chunk - 1 (at most max_len)."""
        chunk = max_len if max_chunk is None else max_chunk
        return min(self.sliding_window + chunk - 1, max_len)


def load_params(src: TensorSource, cfg: Gemma3TextConfig, prefix: str, lm_head_name: str) -> dict:
    """HF Gemma3TextModel weights under `prefix` -> params (fused qkv and gate_up; norm weights
    kept raw: the (1 + w) happens in float32 in `gemma_rms_norm`). A tied checkpoint (no
    lm_head tensor, as transformers saves it) reads the embedding."""
    d, hd, i = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    q_out, kv_out = cfg.num_heads * hd, cfg.num_kv_heads * hd
    layers = []
    for n in range(cfg.num_layers):
        lp = f"{prefix}layers.{n}."
        layers.append({
            "ln_in": src.take(lp + "input_layernorm.weight", (d,)),
            "qkv": fused_linear(src, [lp + f"self_attn.{x}_proj" for x in "qkv"], d, [q_out, kv_out, kv_out],
                                cfg.attention_bias),
            "q_norm": src.take(lp + "self_attn.q_norm.weight", (hd,)),
            "k_norm": src.take(lp + "self_attn.k_norm.weight", (hd,)),
            "o": linear(src, lp + "self_attn.o_proj", q_out, d, cfg.attention_bias),
            "ln_post_attn": src.take(lp + "post_attention_layernorm.weight", (d,)),
            "ln_pre_ff": src.take(lp + "pre_feedforward_layernorm.weight", (d,)),
            "gate_up": fused_linear(src, [lp + "mlp.gate_proj", lp + "mlp.up_proj"], d, [i, i], False),
            "down": linear(src, lp + "mlp.down_proj", i, d, False),
            "ln_post_ff": src.take(lp + "post_feedforward_layernorm.weight", (d,)),
        })
    embed = src.take(prefix + "embed_tokens.weight", (cfg.vocab_size, d))
    if cfg.tie_word_embeddings and not src.has(lm_head_name):
        lm_head = np.ascontiguousarray(embed.T)
    else:
        lm_head = np.ascontiguousarray(src.take(lm_head_name, (cfg.vocab_size, d)).T)
    return {"embed": embed, "layers": layers, "norm": src.take(prefix + "norm.weight", (d,)), "lm_head": lm_head}


def gemma_rms_norm(w: jax.Array, x: jax.Array, eps: float) -> jax.Array:
    """Gemma's RMSNorm: normalise and scale by (1 + w), all in float32, then cast back."""
    xf = x.astype(jnp.float32)
    y = xf * jax.lax.rsqrt(jnp.square(xf).mean(-1, keepdims=True) + eps)
    return (y * (1.0 + w.astype(jnp.float32))).astype(x.dtype)


def softcap(x: jax.Array, cap: float | None) -> jax.Array:
    return x if cap is None else jnp.tanh(x / cap) * cap


# ---- the sliding-window ring ---------------------------------------------------------------------

def ring_key_index(write_end: jax.Array, ring: int) -> jax.Array:
    """[b, ring] cache index held by each ring slot: the last index < write_end[b] that maps to
    the slot (negative: never written by this row)."""
    r = jnp.arange(ring)[None, :]
    last = write_end[:, None] - 1
    return last - jnp.mod(last - r, ring)


def ring_visible(key_index: jax.Array, q_index: jax.Array, window: int, spans: jax.Array | None,
                 starts: jax.Array, key_spans: jax.Array | None = None) -> jax.Array:
    """[b, t, ring] bool: HF's sliding mask AND(kv > q - window, OR(kv <= q, same image run)) on
    ring slots; key_index [b, ring] from `ring_key_index`, q_index [b, t], spans [b, t] or None;
    key_spans [b, u]: the spans of the row's new tokens from starts[b] on (MaskSpec.key_spans;
    None: spans)."""
    k, q = key_index[:, None, :], q_index[:, :, None]
    vis = k <= q
    if spans is not None:
        keys = spans if key_spans is None else key_spans
        u = keys.shape[1]
        new = key_index - starts[:, None]                                   # [b, ring]
        in_call = (new >= 0) & (new < u)
        kspan = jnp.where(in_call, jnp.take_along_axis(keys, jnp.clip(new, 0, u - 1), axis=1), -1)
        qspan = spans[:, :, None]
        vis |= (qspan >= 0) & (qspan == kspan[:, None, :])
    return vis & (k > q - window) & (k >= 0)


def ring_attention(q: jax.Array, kt: jax.Array, v: jax.Array, visible: jax.Array, scale: float,
                   cap: float | None = None, scales: tuple | None = None) -> jax.Array:
    """q [b, t, heads, hd] over ring rows kt [b, kvh, hd, R], v [b, kvh, R, hd] with visible
    [b, t, R] -> [b, t, heads, hd]; scores in float32, zeros where nothing is visible.
    scales: (k_scale, v_scale) [b, kvh, R] of an int8 / fp8 cache, applied to the scores and the
    softmax weights (kv_quant)."""
    b, t, h, hd = q.shape
    kvh = kt.shape[1]
    g = h // kvh
    qn = q.reshape(b, t, kvh, g, hd).transpose(0, 2, 1, 3, 4)                # [b, kvh, t, g, hd]
    s = jnp.einsum("bktgd,bkds->bktgs", qn, operand(kt, q.dtype), preferred_element_type=jnp.float32)
    if scales is not None:
        s = s * scales[0].astype(jnp.float32)[:, :, None, None, :]
    s = softcap(s * scale, cap)
    vis = visible[:, None, :, None, :]
    s = jnp.where(vis, s, -jnp.inf)
    top = jnp.max(s, axis=-1, keepdims=True)
    w = jnp.exp(s - jnp.where(jnp.isfinite(top), top, 0.0))
    w = w / jnp.maximum(w.sum(-1, keepdims=True), 1e-30)
    dt = v.dtype
    if scales is not None:
        w, dt = w * scales[1].astype(jnp.float32)[:, :, None, None, :], q.dtype
    out = jnp.einsum("bktgs,bksd->bktgd", w.astype(dt), operand(v, dt), preferred_element_type=jnp.float32)
    return out.transpose(0, 2, 1, 3, 4).reshape(b, t, h, hd).astype(q.dtype)


def captured_attention(q: jax.Array, kt: jax.Array, v: jax.Array, key_index: jax.Array, q_index: jax.Array,
                       window: int | None, spans, starts, scale: float, cap: float | None, kv_len: int):
    """Explicit-softmax attention for captured layers (research): q [b, t, h, hd] over rows kt
    [b, kvh, hd, K], v [b, kvh, K, hd] holding cache indexes key_index [b, K] -> (out [b, t, h,
    hd], probs [b, h, t, kv_len] float32 over cache indexes 0..kv_len-1)."""
    b, t, h, hd = q.shape
    kvh = kt.shape[1]
    g = h // kvh
    qn = q.reshape(b, t, kvh, g, hd).transpose(0, 2, 1, 3, 4)
    s = softcap(jnp.einsum("bktgd,bkds->bktgs", qn, kt, preferred_element_type=jnp.float32) * scale, cap)
    vis = ring_visible(key_index, q_index, kv_len + 1 if window is None else window, spans, starts)
    s = jnp.where(vis[:, None, :, None, :], s, -jnp.inf)
    probs = jnp.where(vis[:, None, :, None, :], jax.nn.softmax(s, axis=-1), 0.0)        # [b, kvh, t, g, K]
    out = jnp.einsum("bktgs,bksd->bktgd", probs.astype(v.dtype), v, preferred_element_type=jnp.float32)
    out = out.transpose(0, 2, 1, 3, 4).reshape(b, t, h, hd).astype(q.dtype)
    onehot = (key_index[:, :, None] == jnp.arange(kv_len)[None, None, :]).astype(jnp.float32)  # [b, K, kv_len]
    probs = jnp.einsum("bktgs,bsn->bkgtn", probs, onehot).reshape(b, h, t, kv_len)
    return out, probs


def softcapped_attention(q, kts, vs, q_index, kv_len, slots, *, mask, starts, scale, cap, scales=None):
    """Full-attention layers with attn_logit_softcapping: the whole cache as one block."""
    b = q.shape[0]
    rows = (lambda a: a[:b]) if slots is None else (lambda a: a[slots])
    kt, v = rows(jnp.concatenate(kts, axis=3)), rows(jnp.concatenate(vs, axis=2))
    if scales is not None:
        scales = tuple(rows(jnp.concatenate(x, axis=2)) for x in scales)
    key_index = jnp.broadcast_to(jnp.arange(v.shape[2])[None], (b, v.shape[2]))
    vis = ring_visible(key_index, q_index, v.shape[2] + 1, mask.spans if mask else None, starts,
                       mask.key_spans if mask else None)
    return ring_attention(q, kt, v, vis, scale, cap, scales)


def init_cache(cfg: Gemma3TextConfig, num_slots: int, max_len: int, dtype, max_chunk: int | None = None) -> list:
    """Full layers: llama's segmented cache of max_len; sliding layers: one ring of `ring_len`."""
    one_layer = _KVShape(1, cfg.num_kv_heads, cfg.head_dim)
    ring = cfg.ring_len(max_len, max_chunk)
    out = []
    for t in cfg.layer_types:
        if t == FULL:
            out.append(init_kv_cache(one_layer, num_slots, max_len, dtype)[0])
        else:
            out.append(kv_layer(num_slots, cfg.num_kv_heads, cfg.head_dim, [ring], dtype))
    return out


@dataclass(frozen=True)
class _KVShape:
    """The fields llama's init_kv_cache reads."""
    num_layers: int
    num_kv_heads: int
    head_dim: int


def _valid_tokens(positions: jax.Array) -> jax.Array:
    """[b, t] bool: real tokens of a bucketed chunk (padding repeats the last position)."""
    pos = positions[0]
    return jnp.concatenate([jnp.ones_like(pos[:, :1], bool), pos[:, 1:] > pos[:, :-1]], axis=1)


def _qkv(layer: dict, cfg: Gemma3TextConfig, hn: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """hn [b, t, hidden] -> q [b, t, heads, hd], k, v [b, t, kv heads, hd]. A 3-D weight is the
    tensor-parallel layout [hidden, tp, q_s|k_s|v_s] (llama.tp_layout): each shard splits its
    own block, and k / v then hold the cache's KV heads (replicated when kv_heads < tp)."""
    h, kvh, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    if layer["qkv"]["w"].ndim == 3:
        return _split_grouped_qkv(_grouped_dense(layer["qkv"], hn), h, hd)
    b, t, _ = hn.shape
    qkv = dense(layer["qkv"], hn)
    q = qkv[..., : h * hd].reshape(b, t, h, hd)
    k = qkv[..., h * hd: (h + kvh) * hd].reshape(b, t, kvh, hd)
    v = qkv[..., (h + kvh) * hd:].reshape(b, t, kvh, hd)
    return q, k, v


def _gate_up(layer: dict, cfg: Gemma3TextConfig, hn: jax.Array) -> tuple[jax.Array, jax.Array]:
    """hn [b, t, hidden] -> gate, up [b, t, intermediate] (3-D weight: the per-shard layout)."""
    if layer["gate_up"]["w"].ndim == 3:
        return split_grouped_gate_up(_grouped_dense(layer["gate_up"], hn))
    gu = dense(layer["gate_up"], hn)
    return gu[..., : cfg.intermediate_size], gu[..., cfg.intermediate_size:]


def layer_forward(layer: dict, cfg: Gemma3TextConfig, kind: str, x: jax.Array, kv: dict, rope: tuple,
                  q_index: jax.Array, valid: jax.Array, kv_len, *, slots, mask: MaskSpec | None, starts,
                  reduce_small: bool, capture_attn: bool = False,
                  packing: Packing | None = None) -> tuple[jax.Array, dict, tuple | None]:
    """One decoder layer: x [b, t, hidden] -> (x, this layer's updated cache, (probs [b, h, t,
    kv_len], per-head outputs [b, t, h, hd]) when capture_attn (kv_len static) else None).
    packing: a packed prefill (models/text/packing.py): K/V are written per token, attention
    runs in query blocks, each over its own sequence's cache row (`Packing.attend`); its riders
    attend as a decode step does."""
    b, t, _ = x.shape
    h, hd = cfg.num_heads, cfg.head_dim
    cos, sin = rope
    rows = jnp.arange(b) if slots is None else slots
    if packing is not None:
        rows = packing.token_slot[None]
    hn = gemma_rms_norm(layer["ln_in"], x, cfg.rms_norm_eps)
    q, k, v = _qkv(layer, cfg, hn)
    # per-head norms over head_dim: local to the shard holding the head under tensor parallelism
    q = gemma_rms_norm(layer["q_norm"], q, cfg.rms_norm_eps)
    k = gemma_rms_norm(layer["k_norm"], k, cfg.rms_norm_eps)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    spans = mask.spans if mask is not None else None
    if kind == SLIDING:
        ring = kv["v"][0].shape[2]
        # padding, and rows past kv_len (decode rows of free slots, parked there by the engine),
        # are dropped (an index past the ring) so they never evict a position a later resume
        # needs; real tokens of one call are <= ring apart, so their slots are distinct
        idx = jnp.where(valid & (q_index < kv_len), jnp.mod(q_index, ring), ring + jnp.arange(t))
        new_kv = {name: [a] for name, a in scatter_segment(kv, 0, rows, idx, quantize_kv(kv, k, v)).items()}
        take = (lambda a: a[:b]) if slots is None else (lambda a: a[slots])
        kts, vs = take(new_kv["k"][0]), take(new_kv["v"][0])
        ring_scales = layer_scales(new_kv)
        scales = None if ring_scales is None else (take(ring_scales[0][0]), take(ring_scales[1][0]))
        write_end = starts + valid.sum(axis=1).astype(starts.dtype)
        key_index = ring_key_index(write_end, ring)

        def ring_blocks(qb, blk):    # query blocks of a packed row, each over its sequence's ring
            m = blk.mask
            vis = ring_visible(ring_key_index(blk.ends, ring), blk.q_index, cfg.sliding_window,
                               None if m is None else m.spans, blk.starts, None if m is None else m.key_spans)
            sl = blk.slots
            sc = None if ring_scales is None else (ring_scales[0][0][sl], ring_scales[1][0][sl])
            return ring_attention(qb, new_kv["k"][0][sl], new_kv["v"][0][sl], vis, cfg.scale,
                                  cfg.attn_logit_softcapping, sc)
        if packing is not None:
            attn = packing.attend(ring_blocks, q, mask)
            if packing.riders is not None:     # rows [0, D) of the ring, as a decode step reads them
                ride = packing.riders
                d = ride.index.shape[0]
                sc = None if ring_scales is None else (ring_scales[0][0][:d], ring_scales[1][0][:d])
                vis = ring_visible(ring_key_index(ride.index + 1, ring), ride.index[:, None], cfg.sliding_window,
                                   None, ride.index)
                attn = packing.with_riders(attn, ring_attention(
                    packing.rider_queries(q), new_kv["k"][0][:d], new_kv["v"][0][:d], vis, cfg.scale,
                    cfg.attn_logit_softcapping, sc))
        elif capture_attn:
            if scales is not None:    # research capture: dequantized (materialised) like the rest of it
                kts, vs = dequantize(kts, scales[0], 2, q.dtype), dequantize(vs, scales[1], 3, q.dtype)
            attn, probs = captured_attention(q, kts, vs, key_index, q_index, cfg.sliding_window, spans, starts,
                                             cfg.scale, cfg.attn_logit_softcapping, kv_len)
        else:
            vis = ring_visible(key_index, q_index, cfg.sliding_window, spans, starts)
            attn = ring_attention(q, kts, vs, vis, cfg.scale, cfg.attn_logit_softcapping, scales)
    else:
        new_kv = scatter_kv(kv, k, v, q_index, rows)
        new_k, new_v, scales = new_kv["k"], new_kv["v"], layer_scales(new_kv)

        def full(q, q_index, kv_len, slots, mask, starts):
            if cfg.attn_logit_softcapping is None:
                return cache_attention(q, new_k, new_v, q_index, kv_len, slots, mask=mask,
                                       starts=starts, reduce_small=reduce_small, scale=cfg.scale, scales=scales)
            return softcapped_attention(q, new_k, new_v, q_index, kv_len, slots, mask=mask,
                                        starts=starts, scale=cfg.scale, cap=cfg.attn_logit_softcapping,
                                        scales=scales)
        spans_only = None if spans is None else MaskSpec(spans=spans)      # full layers: no window
        if packing is not None:
            attn = packing.attend(lambda qb, blk: full(qb, blk.q_index, blk.kv_len, blk.slots, blk.mask, blk.starts),
                                  q, spans_only)
            if packing.riders is not None:     # cache rows [0, D), as a decode step reads them
                ride = packing.riders
                attn = packing.with_riders(attn, full(packing.rider_queries(q), ride.index[:, None], ride.kv_len,
                                                      None, None, ride.index))
        elif capture_attn:
            kt, vv = jnp.concatenate(new_k, axis=3)[..., :kv_len], jnp.concatenate(new_v, axis=2)[:, :, :kv_len]
            if scales is not None:    # research capture: dequantized (materialised) like the rest of it
                kt = dequantize(kt, jnp.concatenate(scales[0], axis=2)[..., :kv_len], 2, q.dtype)
                vv = dequantize(vv, jnp.concatenate(scales[1], axis=2)[..., :kv_len], 3, q.dtype)
            kt, vv = (kt[:b], vv[:b]) if slots is None else (kt[slots], vv[slots])
            key_index = jnp.broadcast_to(jnp.arange(kv_len)[None], (b, kv_len))
            attn, probs = captured_attention(q, kt, vv, key_index, q_index, None, spans, starts, cfg.scale,
                                             cfg.attn_logit_softcapping, kv_len)
        else:
            attn = full(q, q_index, kv_len, slots, spans_only, starts)
    captured = (probs, attn) if capture_attn else None
    a = dense(layer["o"], attn.reshape(b, t, h * hd))
    x = x + gemma_rms_norm(layer["ln_post_attn"], a, cfg.rms_norm_eps)
    hn = gemma_rms_norm(layer["ln_pre_ff"], x, cfg.rms_norm_eps)
    gate, up = _gate_up(layer, cfg, hn)
    m = dense(layer["down"], activation(cfg.hidden_act)(gate) * up)
    return x + gemma_rms_norm(layer["ln_post_ff"], m, cfg.rms_norm_eps), new_kv, captured


def forward(params: dict, cfg: Gemma3TextConfig, embeds: jax.Array, positions: jax.Array, cache: list,
            starts: jax.Array, kv_len, *, slots: jax.Array | None = None, mask: MaskSpec | None = None,
            capture: Capture | None = None, reduce_small: bool = False, prune: Prune | None = None,
            dropped: Dropped | None = None, packing: Packing | None = None) -> Output:
    """embeds [b, t, hidden] (already scaled: `embed`), positions [1, b, t], starts [b] (cache
    index of each row's first token), slots [b] or None, kv_len bounds the full layers' segments
    read. mask.spans [b, t]: image runs (bidirectional within a run). prune / dropped: FastV as in
    llama.forward (kept image tokens keep their runs; later layers index the compacted sequence,
    so windows count kept positions). packing: several sequences in the one row, and its riders
    (llama.forward; kv_len then covers theirs too).
    Returns Output(final-normed hidden [b, t, hidden], cache,
    intermediates as `Capture` asks: "hidden", and "attn" / "attn_out" per captured layer, which
    needs a static kv_len; "pruned" [b] under prune)."""
    capture = capture or Capture()
    if prune is not None and (capture.any or dropped is not None):
        raise ValueError("prune cannot be combined with capture or dropped")
    if packing is not None and (prune is not None or dropped is not None or capture.any):
        raise ValueError("a packed prefill takes no prune, dropped or capture")
    t = embeds.shape[1]
    valid = _valid_tokens(positions) if packing is None else packing.token_valid[None]

    def ropes_at(pos):
        return {kind: rope_cos_sin(jnp.asarray(rope_inv_freq(r, cfg.head_dim)), pos)
                for kind, r in ((SLIDING, cfg.rope_local), (FULL, cfg.rope_global))}

    ropes = ropes_at(positions)
    x, hidden, new_cache, attn, attn_out, inter = embeds, [embeds], [], {}, {}, {}
    for i, (layer, kind, kv) in enumerate(zip(params["layers"], cfg.layer_types, cache)):
        layer_starts, layer_kv_len = starts, kv_len
        if dropped is not None:      # rows pruned after an earlier layer index a shorter sequence here
            layer_starts = starts - jnp.where(i > dropped.after, dropped.count, 0)
            layer_kv_len = dropped.kv_lens[i]
        q_index = layer_starts[:, None] + jnp.arange(t)[None, :] if packing is None else packing.token_index[None]
        scoring = prune is not None and i == prune.layer
        x, kv, cap = layer_forward(layer, cfg, kind, x, kv, ropes[kind], q_index, valid, layer_kv_len, slots=slots,
                                   mask=mask, starts=layer_starts, reduce_small=reduce_small,
                                   capture_attn=i in capture.attn_layers or scoring, packing=packing)
        new_cache.append(kv)
        if scoring:
            order, inter["pruned"] = prune_order(cap[0], prune)
            x, positions, t = take_rows(x, order), take_rows(positions, order, axis=2), prune.out_len
            valid, ropes, kv_len = _valid_tokens(positions), ropes_at(positions), t
            if mask is not None and mask.spans is not None:
                mask = dataclasses.replace(mask, spans=take_rows(mask.spans, order))
        elif cap is not None:
            attn[i], attn_out[i] = cap
        hidden.append(x)
    out = gemma_rms_norm(params["norm"], x, cfg.rms_norm_eps)
    if capture.hidden:
        inter["hidden"] = hidden[:-1] + [out]
    if capture.attn_layers:
        inter["attn"], inter["attn_out"] = attn, attn_out
    return Output(out, new_cache, inter)


@dataclass(frozen=True)
class Gemma3TextModel(ConfigShape):
    """`TextModel` for Gemma 3 decoders."""
    cfg: Gemma3TextConfig
    position_rows: int = 1
    tp: int = 1          # tensor-parallel shards the params were laid out for (tp_layout)
    supports_prune = True
    supports_packing = True     # forward(..., packing=): packed multi-sequence prefill
    supports_riders = True      # forward(..., packing=) with packing.riders: decode tokens riding in it

    @property
    def cache_cfg(self) -> Gemma3TextConfig:
        """The config the cache is built from: KV heads replicated to tp when fewer."""
        if self.tp == 1:
            return self.cfg
        return dataclasses.replace(self.cfg, num_kv_heads=cache_kv_heads(self.cfg, self.tp))

    def load_params(self, src: TensorSource, prefix: str, lm_head_name: str) -> dict:
        return load_params(src, self.cfg, prefix, lm_head_name)

    def init_cache(self, num_slots: int, max_len: int, dtype, sharding=None, *, max_chunk: int | None = None):
        return allocate_cache(lambda: init_cache(self.cache_cfg, num_slots, max_len, dtype, max_chunk), sharding)

    def min_resume(self, held_len: int, max_chunk: int) -> int:
        """A row holding `held_len` positions of a cache built for `max_chunk` keeps, in each ring,
        the window before any prefix p >= held_len - max_chunk (later writes reach back at most
        ring - window + 1 slots)."""
        if SLIDING in self.cfg.layer_types:
            return max(0, held_len - max_chunk)
        return 0

    # ---- tensor parallelism (mmjax.sharding) -------------------------------------------------
    def tensor_parallel(self, tp: int) -> "Gemma3TextModel":
        """This model as run over tp shards (sharing `_chunk`: min_resume sees every cache built)."""
        check_tensor_parallel(self.cfg, tp)
        return dataclasses.replace(self, tp=tp)

    def tp_layout(self, params: dict, tp: int) -> dict:
        """Llama's layout: the param names and fused qkv / gate_up are the same (mmjax.sharding's
        PARAM_AXES then covers every split weight; norms, QK-norms and biases of o replicate)."""
        return tp_layout(params, self.cfg, tp)

    def embed(self, params: dict, ids: jax.Array) -> jax.Array:
        e = jnp.take(params["embed"], ids, axis=0, mode="clip")
        return e * jnp.asarray(np.sqrt(self.cfg.hidden_size), e.dtype)

    def forward(self, params: dict, embeds: jax.Array, positions: jax.Array, cache, starts: jax.Array, kv_len, *,
                slots: jax.Array | None = None, mask: MaskSpec | None = None, ids: jax.Array | None = None,
                capture: Capture | None = None, reduce_small: bool = False, prune: Prune | None = None,
                dropped: Dropped | None = None, packing: Packing | None = None) -> Output:
        return forward(params, self.cfg, embeds, positions, cache, starts, kv_len, slots=slots, mask=mask,
                       capture=capture, reduce_small=reduce_small, prune=prune, dropped=dropped, packing=packing)

    def logits(self, params: dict, hidden: jax.Array) -> jax.Array:
        z = matmul(hidden, params["lm_head"], jnp.float32)
        # a vocab padded for tensor parallelism (tp_layout): the padding is not a token
        z = z if z.shape[-1] == self.cfg.vocab_size else z[..., :self.cfg.vocab_size]
        return softcap(z, self.cfg.final_logit_softcapping)

    def cache_bytes(self, num_slots: int, max_len: int, dtype, max_chunk: int | None = None) -> int:
        """Bytes of `init_cache(...)` without allocating it."""
        shapes = jax.eval_shape(lambda: init_cache(self.cache_cfg, num_slots, max_len, dtype, max_chunk))
        return sum(int(np.prod(s.shape)) * jnp.dtype(s.dtype).itemsize for s in jax.tree.leaves(shapes))


def from_hf(cfg: dict, where: str = "text_config", **overrides) -> Gemma3TextModel:
    return Gemma3TextModel(Gemma3TextConfig.from_hf(cfg, where, **overrides))
