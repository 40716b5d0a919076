"""Llama-style decoder (Llama / Mistral / Qwen2, Qwen2-VL's M-RoPE variant, and Qwen3 / Qwen3-VL:
QK-norm, interleaved M-RoPE, DeepStack image features, sparse-MoE feed-forward layers) over an
explicit slot KV cache: the first implementation of the `mmjax.models.text.TextModel` protocol.

KV cache: a list with one {"k", "v"} dict per layer; each holds the sequence axis cut into
segments (`kv_segments`: on the CPU 128 positions each up to 1024, then doubling), K
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

import dataclasses
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from mmjax.checkpoint import TensorSource, fused_linear, linear
from mmjax.errors import UnsupportedModelError
from mmjax.kernels import cpu_attention, cpu_library
from mmjax.models.hf_config import require
from mmjax.models.layers import bf16_einsum, dense, matmul, rms_norm
from mmjax.models.text import Capture, ConfigShape, Dropped, MaskSpec, Output, Prune, prune_order, take_rows
from mmjax.models.text.kv_quant import dequantize, is_quantized, layer_scales, operand, quantize, zero_scales
from mmjax.models.text.moe import MoeConfig, load_moe, moe_mlp
from mmjax.models.text.packing import Packing
from mmjax.models.text.rope import RopeConfig, apply_rope, rope_cos_sin, rope_inv_freq
from mmjax.quant import QArray, as_2d, map_columns

KVCache = list  # per layer {"k": [[slots, kv_heads, head_dim, len_i], ...],
#                              "v": [[slots, kv_heads, len_i, head_dim], ...],
#      int8 / fp8 caches also "k_scale", "v_scale": [[slots, kv_heads, len_i], ...] (kv_quant)}
KV_SEGMENT = 256     # the CPU ladder's segment (backend.Tuning.kv_segment_ladder; backend imports no model code)
# cache_attention avoids dots for <= SMALL_N queries per KV head when a batched dot would make
# >= SMALL_N_MIN_CALLS small matmul calls (one per row and KV head)
SMALL_N, SMALL_N_MIN_CALLS = 8, 32


@dataclass(frozen=True)
class LlamaConfig:
    """A Llama-style decoder (Llama, Mistral, Qwen2 and Qwen2-VL's text model share this shape)."""
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope: RopeConfig
    attention_bias: bool = False
    mlp_bias: bool = False
    tie_word_embeddings: bool = False
    sliding_window: int | None = None
    qk_norm: bool = False                 # Qwen3: RMSNorm over head_dim on q and k before RoPE
    moe: MoeConfig | None = None          # sparse-MoE feed-forward layers (Qwen3-MoE)
    # per-layer image features added after the first `image_feature_layers` layers (Qwen3-VL's
    # DeepStack): image features are then [tokens, (1 + this) * hidden] (models/text `layer_adds`)
    image_feature_layers: int = 0

    @classmethod
    def from_hf(cls, cfg: dict, where: str = "text_config", **overrides) -> "LlamaConfig":
        """`overrides` replace parsed fields (a family's rules, e.g. the top-level tie flag)."""
        hidden = int(require(cfg, "hidden_size", where))
        heads = int(require(cfg, "num_attention_heads", where))
        act = cfg.get("hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise UnsupportedModelError(f"config.json: {where}.hidden_act={act!r} not supported", param=f"{where}.hidden_act")
        # Mistral attends within `sliding_window`; HF's Qwen2 only with use_sliding_window.
        window = cfg.get("sliding_window")
        if cfg.get("model_type", "llama").startswith("qwen2") and not cfg.get("use_sliding_window", False):
            window = None
        num_layers = int(require(cfg, "num_hidden_layers", where))
        parsed = dict(
            vocab_size=int(require(cfg, "vocab_size", where)),
            hidden_size=hidden,
            intermediate_size=int(require(cfg, "intermediate_size", where)),
            num_layers=num_layers,
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
            rope=RopeConfig.from_hf(cfg, where),
            attention_bias=bool(cfg.get("attention_bias", cfg.get("model_type", "").startswith("qwen2"))),
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            sliding_window=int(window) if window else None,
            qk_norm=cfg.get("model_type", "").startswith("qwen3"),
            moe=MoeConfig.from_hf(cfg, where, num_layers),
        )
        return cls(**{**parsed, **overrides})


def load_params(src: TensorSource, cfg: LlamaConfig, prefix: str, lm_head_name: str) -> dict:
    """HF LlamaForCausalLM-style weights -> params with fused qkv and gate_up matmuls. A tied
    config without an lm_head tensor reads the embedding (a file that holds its own lm_head keeps it)."""
    d, hd, i = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    q_out, kv_out = cfg.num_heads * hd, cfg.num_kv_heads * hd
    layers = []
    for n in range(cfg.num_layers):
        lp = f"{prefix}layers.{n}."
        layer = {
            "ln1": src.take(lp + "input_layernorm.weight", (d,)),
            "qkv": fused_linear(src, [lp + f"self_attn.{x}_proj" for x in "qkv"], d,
                                [q_out, kv_out, kv_out], cfg.attention_bias),
            "o": linear(src, lp + "self_attn.o_proj", q_out, d, False),
            "ln2": src.take(lp + "post_attention_layernorm.weight", (d,)),
        }
        if cfg.qk_norm:
            layer["q_norm"] = src.take(lp + "self_attn.q_norm.weight", (hd,))
            layer["k_norm"] = src.take(lp + "self_attn.k_norm.weight", (hd,))
        if cfg.moe is not None and n in cfg.moe.layers:
            layer["moe"] = load_moe(src, lp + "mlp.", d, cfg.moe)
        else:
            layer["gate_up"] = fused_linear(src, [lp + "mlp.gate_proj", lp + "mlp.up_proj"], d, [i, i], cfg.mlp_bias)
            layer["down"] = linear(src, lp + "mlp.down_proj", i, d, cfg.mlp_bias)
        layers.append(layer)
    embed = src.take(prefix + "embed_tokens.weight", (cfg.vocab_size, d))
    if cfg.tie_word_embeddings and not src.has(lm_head_name):
        lm_head = np.ascontiguousarray(embed.T)
    else:
        lm_head = np.ascontiguousarray(src.take(lm_head_name, (cfg.vocab_size, d)).T)
    return {"embed": embed, "layers": layers, "norm": src.take(prefix + "norm.weight", (d,)),
            "lm_head": lm_head}


def kv_segments(max_len: int, segment: int | None = None, fine: int | None = None) -> tuple[int, ...]:
    """Segment lengths cutting [0, max_len): `fine` segments of `segment` positions (the
    granularity decode pays in up to fine * segment), then each one as long as all before it,
    the last cut at max_len. The count grows with log(max_len): every segment costs a scatter
    and a cond per layer and step (32k positions: 13 segments). segment / fine default to the
    platform's (`backend.Tuning.kv_segment_ladder`: 256 x 4 on the CPU, 512 x 1 on GPUs) being
    compiled for (`backend.current_platform`: the runner builds its cache in `compiling_for`)."""
    if segment is None or fine is None:
        from mmjax.backend import tuning
        default_segment, default_fine = tuning().kv_segment_ladder
        segment, fine = segment or default_segment, fine or default_fine
    out, total = [], 0
    while total < max_len:
        n = min(segment if len(out) < fine else total, max_len - total)
        out.append(n)
        total += n
    return tuple(out)


def init_kv_cache(cfg: LlamaConfig, num_slots: int, max_len: int, dtype,
                  segment: int | None = None) -> KVCache:
    """Zero cache of `num_slots` rows, `max_len` positions cut into `kv_segments(max_len, segment)`:
    K segments [slots, kv_heads, head_dim, len] (transposed), V segments [slots, kv_heads, len,
    head_dim]; see `cache_attention` for why. An int8 / fp8 `dtype` adds per-(token, KV head)
    scales (`kv_layer`)."""
    return [kv_layer(num_slots, cfg.num_kv_heads, cfg.head_dim, kv_segments(max_len, segment), dtype)
            for _ in range(cfg.num_layers)]


def kv_layer(num_slots: int, kv_heads: int, head_dim: int, cuts, dtype) -> dict:
    """One layer's zero cache over segments of lengths `cuts`: {"k": [[slots, kv_heads, head_dim,
    len]], "v": [[slots, kv_heads, len, head_dim]]}, plus "k_scale" / "v_scale" [[slots, kv_heads,
    len]] when `dtype` is quantized (int8 / fp8: mmjax.models.text.kv_quant)."""
    layer = {"k": [jnp.zeros((num_slots, kv_heads, head_dim, n), dtype) for n in cuts],
             "v": [jnp.zeros((num_slots, kv_heads, n, head_dim), dtype) for n in cuts]}
    if is_quantized(dtype):
        layer["k_scale"] = zero_scales([(n,) for n in cuts], num_slots, kv_heads)
        layer["v_scale"] = zero_scales([(n,) for n in cuts], num_slots, kv_heads)
    return layer


def allocate_cache(make, sharding=None):
    """make() -> a zero cache pytree; with `sharding` (one Sharding, or a tree of them) each
    array is allocated directly in its (possibly sharded) layout, not on one device first."""
    if sharding is None:
        return make()
    shapes = jax.eval_shape(make)
    if not isinstance(sharding, jax.sharding.Sharding):
        return jax.tree.map(lambda s, sh: jnp.zeros(s.shape, s.dtype, device=sh), shapes, sharding)
    return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype, device=sharding), shapes)


def _when(pred, fn, otherwise, *args):
    """fn(*args) if pred else otherwise(*args): a Python branch for a concrete pred, else
    lax.cond (XLA runs only the taken branch)."""
    if isinstance(pred, (bool, np.bool_)):
        return (fn if pred else otherwise)(*args)
    return jax.lax.cond(pred, fn, otherwise, *args)


def visible_keys(key_index: jax.Array, q_index: jax.Array, mask: MaskSpec | None,
                 starts: jax.Array, *, window_over_spans: bool = False) -> jax.Array:
    """[b, t, len] bool: may the query at cache index q_index [b, t] read the key at cache index
    key_index [len]? Causal (j <= i), within the sliding window, or in the query's own span
    (the span's keys are this call's tokens: key j is new token j - starts[b] of
    `mask.span_keys`). window_over_spans: the window also bounds span keys, (causal | span) &
    window (Gemma 4's order); default (causal & window) | span."""
    vis = key_index[None, None, :] <= q_index[:, :, None]
    if mask is None:
        return vis
    if mask.sliding_window is not None and not window_over_spans:
        vis &= q_index[:, :, None] - key_index[None, None, :] < mask.sliding_window
    if mask.spans is not None:
        keys = mask.span_keys
        u = keys.shape[1]
        new = key_index[None, :] - starts[:, None]                          # [b, len]
        in_call = (new >= 0) & (new < u)
        kspan = jnp.where(in_call, jnp.take_along_axis(keys, jnp.clip(new, 0, u - 1), axis=1), -1)
        qspan = mask.spans[:, :, None]
        vis |= (qspan >= 0) & (qspan == kspan[:, None, :])
    if mask.sliding_window is not None and window_over_spans:
        vis &= q_index[:, :, None] - key_index[None, None, :] < mask.sliding_window
    return vis


def cache_attention(q: jax.Array, kts: list, vs: list, q_index: jax.Array, kv_len,
                    slots: jax.Array | None = None, *, mask: MaskSpec | None = None,
                    starts: jax.Array | None = None, reduce_small: bool = False, scale: float | None = None,
                    window_over_spans: bool = False, scales: tuple | None = None) -> jax.Array:
    """Attention of new queries over a cache given as consecutive segments.

    q [b, t, heads, hd]; kts: K segments transposed [slots, kv_heads, hd, len_i], vs: V segments
    [slots, kv_heads, len_i, hd], covering cache indexes [0, sum len_i); query row i reads cache
    row slots[i] (None: row i, the decode layout); q_index [b, t] = cache index of each query;
    kv_len (int or traced int32 scalar) > every q_index that matters: segments starting at or
    after it are not computed. Key j is visible to a query at index i iff `visible_keys` says so
    (causal at least, so stale entries past a sequence's end are never read; `window_over_spans`
    is passed on); starts [b] is each row's first new cache index (for spans). Scores are scaled
    by `scale` (None: 1/sqrt(head_dim)). Returns [b, t, heads, hd]; a query with no visible key
    gets zeros.

    Each segment yields (max, sum of exp(s - max), exp(s - max) V) and the segments are merged
    with the usual rescaling, as flash attention merges key blocks. `reduce_small` (a backend
    choice, mmjax.backend): with few queries per KV head (n = t * group <= SMALL_N: decode)
    both products become broadcast-multiply-reduce over a non-minor axis (scores sum K^T [hd,
    len] rows, out sums V [len, hd] rows), which the CPU decode step hands to YNN's reductions,
    where a batched dot makes one small matmul call per (row, KV head): 128 per segment at 16
    rows, 1.6x slower (benchmarks/README.md, "K^T decode attention"). Below SMALL_N_MIN_CALLS
    such calls the dots stay (a reduction call has the larger fixed cost). Otherwise dots on the
    same layouts: scores [n, len] = q K^T and out [n, hd] = P V, both plain row-major operands.

    scales: (K scale segments, V scale segments) [slots, kv_heads, len_i] of an int8 / fp8 cache
    (`kv_quant.layer_scales`): the quantized segments enter the dots as they are (converted to
    q's dtype in the operand), the scores are multiplied by the key scales and the softmax
    weights by the value scales: no dequantized copy of the cache.
    """
    b, t, h, hd = q.shape
    kvh = kts[0].shape[1]
    g = h // kvh
    n = t * g
    # a quantized cache always takes the reductions when they apply: they convert int8 / fp8 inside
    # the fused multiply-reduce, where XLA:CPU's dot would first write a converted copy of the segment
    small = reduce_small and n <= SMALL_N and (b * kvh >= SMALL_N_MIN_CALLS or scales is not None)
    qn = q.reshape(b, t, kvh, g, hd).transpose(0, 2, 1, 3, 4).reshape(b, kvh, n, hd)
    kernel = _attention_kernel(t, slots, mask, kts, vs, scales)
    if kernel == "gpu":
        return _ragged_decode(qn, kts, vs, q_index[:, 0], kv_len, mask, scale,
                              scales).reshape(b, 1, h, hd).astype(q.dtype)
    if kernel == "cpu":
        return _cpu_decode(qn, kts, vs, q_index[:, 0], kv_len, mask, scale,
                           scales).reshape(b, 1, h, hd).astype(q.dtype)
    if kernel == "cpu_prefill":
        lo, hi = _visible_range(q_index, kv_len, mask)
        out = cpu_attention.prefill_attention(qn, kts, vs, lo, hi, jnp.arange(b) if slots is None else slots,
                                              scale=1 / np.sqrt(hd) if scale is None else scale, scales=scales)
        return out.reshape(b, kvh, t, g, hd).transpose(0, 2, 1, 3, 4).reshape(b, t, h, hd).astype(q.dtype)
    if starts is None:
        starts = q_index[:, 0]

    def segment(kt, v, sc, start, top, total, out):
        # decode: rows [0, b) (a no-op slice when b == slots); prefill: gather its slots
        rows = (lambda a: a[:b]) if slots is None else (lambda a: a[slots])
        kt, v, sc = rows(kt), rows(v), jax.tree.map(rows, sc)
        size = v.shape[2]
        if small:
            s = (kt[:, :, None].astype(jnp.float32) * qn[..., None].astype(jnp.float32)).sum(axis=3)
        else:
            s = jnp.einsum("bknd,bkds->bkns", qn, operand(kt, qn.dtype), preferred_element_type=jnp.float32)
        if sc is not None:                                    # int8 / fp8: scale per key, not per value
            s = s * sc[0].astype(jnp.float32)[:, :, None, :]
        # scores scaled by 1/sqrt(hd), or by `scale` (None: the former; 1.0: no op at all)
        if scale is None:
            s = s / np.sqrt(hd)                                       # [b, kvh, n, len]
        elif scale != 1.0:
            s = s * scale
        visible = visible_keys(start + jnp.arange(size), q_index, mask, starts,
                               window_over_spans=window_over_spans)  # [b, t, len]
        s = jnp.where(visible[:, None, :, None, :], s.reshape(b, kvh, t, g, size), -jnp.inf)
        s = s.reshape(b, kvh, n, size)
        new_top = jnp.maximum(top, s.max(axis=3))             # [b, kvh, n]; -inf: nothing visible yet
        shift = jnp.where(jnp.isfinite(new_top), new_top, 0.0)
        w = jnp.exp(s - shift[..., None])
        wv = w if sc is None else w * sc[1].astype(jnp.float32)[:, :, None, :]
        if small:
            pv = (wv[..., None] * v[:, :, None].astype(jnp.float32)).sum(axis=3)
        else:
            dt = v.dtype if sc is None else qn.dtype
            pv = jnp.einsum("bkns,bksd->bknd", wv.astype(dt), operand(v, dt), preferred_element_type=jnp.float32)
        rescale = jnp.exp(top - shift)                        # 0 while nothing was visible
        return new_top, total * rescale + w.sum(axis=3), out * rescale[..., None] + pv

    # running (max, sum of exp, exp-weighted V) carried through the segments; a skipped segment
    # passes it on unchanged
    carry = (jnp.full((b, kvh, n), -jnp.inf), jnp.zeros((b, kvh, n)), jnp.zeros((b, kvh, n, hd)))
    start = 0
    for i, (kt, v) in enumerate(zip(kts, vs)):
        sc = None if scales is None else (scales[0][i], scales[1][i])
        carry = _when(start < kv_len, lambda kt, v, sc, *c, start=start: segment(kt, v, sc, start, *c),
                      lambda kt, v, sc, *c: c, kt, v, sc, *carry)
        start += v.shape[2]
    _, total, out = carry
    out = out / jnp.where(total > 0, total, 1.0)[..., None]
    return out.reshape(b, kvh, t, g, hd).transpose(0, 2, 1, 3, 4).reshape(b, t, h, hd).astype(q.dtype)


def _attention_kernel(t: int, slots, mask: MaskSpec | None, kts: list, vs: list, scales: tuple | None) -> str | None:
    """Which kernel takes this attention (trace time); image runs (spans) always take XLA's
    per-segment path (None). One new token per row over rows [0, b) (decode) goes to "gpu", the
    ragged Pallas kernel (mmjax.attention.decode: no per-segment lax.cond, which a GPU runs as a
    host sync per segment and layer), or "cpu" (mmjax.kernels.cpu_attention) where one covers
    it; any other (prefill: several tokens per row, rows in any slots) to "cpu_prefill", the CPU
    kernel with each query over its own causal (window) range, where one covers it."""
    from mmjax.attention.decode import supported
    from mmjax.backend import pallas_kernels_enabled
    if mask is not None and mask.spans is not None:
        return None
    if t == 1 and slots is None:
        if pallas_kernels_enabled() and supported(kts[0].shape[2]):
            return "gpu"
        return "cpu" if cpu_attention.covers(kts, vs, scales) else None
    return "cpu_prefill" if cpu_attention.covers(kts, vs, scales) else None


def _visible_range(q_pos: jax.Array, kv_len, mask: MaskSpec | None) -> tuple[jax.Array, jax.Array]:
    """(lo, hi), each q_pos's shape ([b] decode rows, [b, t] new tokens): the query at cache index
    q_pos reads keys (q_pos - window, q_pos], none if q_pos is at or past kv_len (a parked decode
    row's q_pos is max_len; a prefill bucket's padding tokens sit past the call's end)."""
    window = mask.sliding_window if mask is not None else None
    lo = jnp.zeros_like(q_pos) if window is None else q_pos - window + 1
    return lo, jnp.where(q_pos < kv_len, q_pos + 1, 0)


def _cpu_decode(qn: jax.Array, kts: list, vs: list, q_pos: jax.Array, kv_len, mask: MaskSpec | None,
                scale: float | None, scales: tuple | None = None) -> jax.Array:
    """qn [b, kvh, g, hd] (one token per row) over rows [0, b) of the segmented cache through the
    CPU kernel (mmjax.kernels.cpu_attention), each row over `_visible_range` -> [b, kvh, g, hd]
    float32. scales: an int8 / fp8 cache's (K, V) scale segments."""
    lo, hi = _visible_range(q_pos, kv_len, mask)
    return cpu_attention.decode_attention(qn, kts, vs, lo, hi, scale=1 / np.sqrt(qn.shape[-1]) if scale is None else scale,
                                          scales=scales)


def _cpu_decode_write(q: jax.Array, k: jax.Array, v: jax.Array, kv: dict, q_pos: jax.Array, kv_len,
                      mask: MaskSpec | None) -> tuple[jax.Array, dict]:
    """A decode layer's cache write and attention in one CPU kernel call: q [b, 1, h, hd], the
    new k, v [b, 1, kv_heads, hd] written at cache index q_pos [b] of cache rows [0, b) (as
    `scatter_kv`: quantized on write for an int8 / fp8 cache), then attended as `_cpu_decode`
    -> (attention [b, 1, h, hd] in q's dtype, the layer's updated cache dict)."""
    b, _, h, hd = q.shape
    kvh = kv["k"][0].shape[1]
    kq, vq, ks, vs = quantize_kv(kv, k, v)
    lo, hi = _visible_range(q_pos, kv_len, mask)
    out, kts, vss, scales = cpu_attention.decode_attention_write(
        q.reshape(b, kvh, h // kvh, hd), kq[:, 0], vq[:, 0], kv["k"], kv["v"], lo, hi, q_pos, scale=1 / np.sqrt(hd),
        scales=layer_scales(kv), new_scales=None if ks is None else (ks[:, 0], vs[:, 0]))
    new = {"k": kts, "v": vss}
    if scales is not None:
        new["k_scale"], new["v_scale"] = scales
    return out.reshape(b, 1, h, hd).astype(q.dtype), new


def _ragged_decode(qn: jax.Array, kts: list, vs: list, q_pos: jax.Array, kv_len, mask: MaskSpec | None,
                   scale: float | None, scales: tuple | None = None) -> jax.Array:
    """qn [b, kvh, g, hd] (one token per row) over rows [0, b) of the segmented cache, each row
    reading keys (q_pos - window, q_pos] only -> [b, kvh, g, hd] float32. scales: an int8 / fp8
    cache's scale segments (the kernel applies them to scores and weights)."""
    from mmjax.attention.decode import ragged_decode_attention
    hd = qn.shape[-1]
    window = mask.sliding_window if mask is not None else None
    lo = jnp.zeros_like(q_pos) if window is None else q_pos - window + 1
    if isinstance(kv_len, int):      # a static length: the segments from it on are not passed at all
        ends = np.cumsum([v.shape[2] for v in vs])
        keep = int(np.searchsorted(ends, kv_len)) + 1
        kts, vs = kts[:keep], vs[:keep]
        scales = None if scales is None else (scales[0][:keep], scales[1][:keep])
    hi = jnp.where(q_pos < kv_len, q_pos + 1, 0)     # a parked row (q_pos = max_len) reads nothing
    _, total, out = ragged_decode_attention(qn, kts, vs, lo, hi,
                                            scale=1 / np.sqrt(hd) if scale is None else scale, scales=scales)
    return out / jnp.where(total > 0, total, 1.0)[..., None]


def explicit_attention(q: jax.Array, kts: list, vs: list, q_index: jax.Array, kv_len: int,
                       slots: jax.Array | None = None, *, mask: MaskSpec | None = None,
                       starts: jax.Array | None = None, scale: float | None = None,
                       window_over_spans: bool = False, scales: tuple | None = None) -> tuple[jax.Array, jax.Array]:
    """The same attention as `cache_attention` over the first `kv_len` (static) cache positions,
    with the softmax materialised: (out [b, t, heads, hd], probs [b, heads, t, kv_len] float32).
    For captured layers (research / training), never for serving (a quantized cache, `scales`,
    is dequantized here)."""
    b, t, h, hd = q.shape
    kvh = kts[0].shape[1]
    kt = jnp.concatenate(kts, axis=3)[..., :kv_len]
    v = jnp.concatenate(vs, axis=2)[:, :, :kv_len]
    if scales is not None:
        kt = dequantize(kt, jnp.concatenate(scales[0], axis=2)[..., :kv_len], 2, q.dtype)
        v = dequantize(v, jnp.concatenate(scales[1], axis=2)[..., :kv_len], 3, q.dtype)
    kt, v = (kt[:b], v[:b]) if slots is None else (kt[slots], v[slots])
    kt = jnp.repeat(kt, h // kvh, axis=1)                          # [b, h, hd, len]
    v = jnp.repeat(v, h // kvh, axis=1)                            # [b, h, len, hd]
    s = jnp.einsum("bthd,bhds->bhts", q, kt, preferred_element_type=jnp.float32)
    s = s / np.sqrt(hd) if scale is None else s * scale
    vis = visible_keys(jnp.arange(kv_len), q_index, mask, q_index[:, 0] if starts is None else starts,
                       window_over_spans=window_over_spans)
    s = jnp.where(vis[:, None], s, -jnp.inf)
    probs = jax.nn.softmax(s, axis=-1)
    probs = jnp.where(vis[:, None], probs, 0.0)                    # rows with nothing visible: zeros
    out = jnp.einsum("bhts,bhsd->bthd", probs.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return out.astype(q.dtype), probs


def forward(params: dict, cfg: LlamaConfig, embeds: jax.Array, positions: jax.Array, cache: KVCache,
            starts: jax.Array, kv_len, *, slots: jax.Array | None = None, mask: MaskSpec | None = None,
            capture: Capture | None = None, reduce_small: bool = False,
            inv_freq: jax.Array | None = None, prune: Prune | None = None,
            dropped: Dropped | None = None, layer_adds: jax.Array | None = None,
            packing: Packing | None = None) -> Output:
    """Run the decoder on new tokens and write their K/V into the cache.

    embeds [b, t, hidden]; positions [rows, b, t] rope positions (rows 3 for M-RoPE); starts [b]:
    cache index of each row's first new token; slots [b]: cache row of each batch row (None means
    batch row i is slot i, the decode step's layout: rows [0, b) read with a slice, no gather);
    kv_len (int or traced int32 scalar): cache positions in use, >= max(starts) + t (segments
    from kv_len on are not read; no new token lands there either). The config's sliding window
    is applied on top of `mask`.
    prune (a prefill from cache index 0): FastV pruning after layer prune.layer (see `Prune`);
    the returned hidden then has prune.out_len rows, kept tokens first, and intermediates
    "pruned" [b] (image tokens dropped). dropped: rows pruned earlier (decode; see `Dropped`).
    layer_adds [n, b, t, hidden]: added to the residual stream after layers 0..n-1 (DeepStack
    image features; zeros at other tokens).
    packing: the one row (b = 1) holds several sequences' tokens (models/text/packing.py); slots,
    starts and mask.spans are then per segment / per packed token as `Packing` says (starts and
    slots are ignored: the packing carries them).
    packing.riders (a mixed step): running sequences' next tokens in padding positions of the
    row (models/text/packing.DecodeRows), attending as a decode step does (the config's window,
    no image spans).
    Returns Output(final-normed hidden [b, t, hidden], updated cache, intermediates).
    """
    if packing is not None and (prune is not None or dropped is not None or (capture is not None and capture.any)):
        raise ValueError("a packed prefill takes no prune, dropped or capture")
    if cfg.sliding_window is not None and (mask is None or mask.sliding_window is None):
        mask = dataclasses.replace(mask or MaskSpec(), sliding_window=cfg.sliding_window)
    capture = capture or Capture()
    if prune is not None and (capture.any or dropped is not None or layer_adds is not None):
        raise ValueError("prune cannot be combined with capture, dropped or layer_adds")
    x = embeds
    rope = rope_for(cfg, positions, starts, embeds.shape[1], inv_freq)
    if packing is not None:
        rope = (rope[0], rope[1], packing.token_index[None])
    hidden, attn, attn_out, new_cache, inter = [x], {}, {}, [], {}
    for i, (layer, kv) in enumerate(zip(params["layers"], cache)):
        layer_rope, layer_starts, layer_kv_len = rope, starts, kv_len
        if dropped is not None:
            off = jnp.where(i > dropped.after, dropped.count, 0)               # [b]
            layer_rope, layer_starts, layer_kv_len = (rope[0], rope[1], rope[2] - off[:, None]), starts - off, \
                dropped.kv_lens[i]
        scoring = prune is not None and i == prune.layer
        x, kv, probs = layer_forward(layer, cfg, x, kv, layer_rope, layer_kv_len, slots=slots, mask=mask,
                                     starts=layer_starts, reduce_small=reduce_small,
                                     capture_attn=i in capture.attn_layers or scoring,
                                     explicit_kv_len=x.shape[1] if scoring else None, packing=packing)
        new_cache.append(kv)
        if scoring:
            x, rope, inter["pruned"] = _prune_tokens(x, rope, probs[0], prune)
            mask, kv_len = None, prune.out_len
        elif probs is not None:
            attn[i], attn_out[i] = probs
        hidden.append(x)                    # HF's hidden_states: the layer's output, before DeepStack
        if layer_adds is not None and i < layer_adds.shape[0]:
            x = x + layer_adds[i].astype(x.dtype)
    out = rms_norm(params["norm"], x, cfg.rms_norm_eps)
    if capture.hidden:
        inter["hidden"] = hidden[:-1] + [out]
    if capture.attn_layers:
        inter["attn"], inter["attn_out"] = attn, attn_out
    return Output(out, new_cache, inter)


def _prune_tokens(x: jax.Array, rope: tuple, probs: jax.Array, prune: Prune) -> tuple:
    """FastV after the scoring layer (`prune_order`): (x, rope) gathered to prune.out_len rows,
    cache indexes 0.., and the dropped count [b]."""
    order, dropped = prune_order(probs, prune)
    cos, sin, _ = rope
    b = order.shape[0]
    q_index = jnp.broadcast_to(jnp.arange(prune.out_len)[None], (b, prune.out_len))
    return take_rows(x, order), (take_rows(cos, order), take_rows(sin, order), q_index), dropped


def rope_for(cfg: LlamaConfig, positions: jax.Array, starts: jax.Array, t: int,
             inv_freq: jax.Array | None = None) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(cos, sin [b, t, head_dim], q_index [b, t] = cache index of each new token);
    positions [rows, b, t]."""
    if inv_freq is None:
        inv_freq = jnp.asarray(rope_inv_freq(cfg.rope, cfg.head_dim))
    cos, sin = rope_cos_sin(inv_freq, positions, cfg.rope.mrope_section, cfg.rope.mrope_interleaved)
    return cos, sin, starts[:, None] + jnp.arange(t)[None, :]


def layer_forward(layer: dict, cfg: LlamaConfig, x: jax.Array, kv: dict, rope: tuple, kv_len, *,
                  slots: jax.Array | None = None, mask: MaskSpec | None = None, starts: jax.Array | None = None,
                  reduce_small: bool = False, capture_attn: bool = False,
                  explicit_kv_len: int | None = None,
                  packing: Packing | None = None) -> tuple[jax.Array, dict, tuple | None]:
    """One decoder layer: x [b, t, hidden] (residual stream) -> (x, updated {"k", "v"} cache of
    this layer, (probs, per-head outputs) when capture_attn else None). rope = rope_for(...);
    kv_len / slots / mask / packing as in `forward`; explicit_kv_len: a static kv_len for the
    captured attention when kv_len is traced."""
    b, t, _ = x.shape
    h, kvh, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    cos, sin, q_index = rope
    rows = jnp.arange(b) if slots is None else slots
    hn = rms_norm(layer["ln1"], x, cfg.rms_norm_eps)
    if layer["qkv"]["w"].ndim == 3:   # tensor-parallel layout [hidden, tp, q|k|v of one shard]
        q, k, v = _split_grouped_qkv(_grouped_dense(layer["qkv"], hn), h, hd)
        kvh = k.shape[2]
    else:
        qkv = dense(layer["qkv"], hn)
        q = qkv[..., : h * hd].reshape(b, t, h, hd)
        k = qkv[..., h * hd: (h + kvh) * hd].reshape(b, t, kvh, hd)
        v = qkv[..., (h + kvh) * hd:].reshape(b, t, kvh, hd)
    if "q_norm" in layer:   # Qwen3's QK-norm: per head, before RoPE
        q, k = rms_norm(layer["q_norm"], q, cfg.rms_norm_eps), rms_norm(layer["k_norm"], k, cfg.rms_norm_eps)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    # Each new token goes to the segment holding its cache index; indexes outside a segment
    # (and padded tail tokens of a bucketed chunk past max_len) map to distinct positions past
    # its end, which mode="drop" skips (a negative index would wrap) and which keep the
    # unique_indices promise true (XLA:CPU's scatter walks every update, dropped ones included;
    # the promise cut a 256-token prefill chunk into 8 segments from 501 to ~480 ms). Every
    # segment takes the scatter: a lax.cond around it made prefill slower, decode no faster
    # (benchmarks/README.md, "KV segments", "K^T decode attention"). (rows [b, 1], :, idx [b, t])
    # on V and (rows, :, :, idx) on K^T both index [b, t, kv_heads, hd].
    # CPU decode: the attention kernel writes the new K/V itself, then attends (no scatter into
    # every segment: a handful of small XLA ops per segment and layer)
    fused = (packing is None and not capture_attn
             and _attention_kernel(t, slots, mask, kv["k"], kv["v"], layer_scales(kv)) == "cpu")
    if not fused:
        kv = scatter_kv(kv, k, v, q_index, rows if packing is None else packing.token_slot[None])
    captured = None
    if fused:
        attn, kv = _cpu_decode_write(q, k, v, kv, q_index[:, 0], kv_len, mask)
    elif packing is not None:         # each query block over its own sequence's slot row
        attn = packing.attend(lambda qb, blk: cache_attention(
            qb, kv["k"], kv["v"], blk.q_index, blk.kv_len, blk.slots, mask=blk.mask, starts=blk.starts,
            reduce_small=reduce_small, scales=layer_scales(kv)), q, mask)
        if packing.riders is not None:     # a decode step's attention, rows [0, D) (after the write)
            window = None if mask is None or mask.sliding_window is None else MaskSpec(
                sliding_window=mask.sliding_window)
            ride = packing.riders
            attn = packing.with_riders(attn, cache_attention(
                packing.rider_queries(q), kv["k"], kv["v"], ride.index[:, None], ride.kv_len, mask=window,
                starts=ride.index, reduce_small=reduce_small, scales=layer_scales(kv)))
    elif capture_attn:
        attn, probs = explicit_attention(q, kv["k"], kv["v"], q_index, explicit_kv_len or kv_len, slots, mask=mask,
                                         starts=starts, scales=layer_scales(kv))
        captured = (probs, attn)
    else:
        attn = cache_attention(q, kv["k"], kv["v"], q_index, kv_len, slots, mask=mask, starts=starts,
                               reduce_small=reduce_small, scales=layer_scales(kv))
    x = x + dense(layer["o"], attn.reshape(b, t, h * hd))
    hn = rms_norm(layer["ln2"], x, cfg.rms_norm_eps)
    if "moe" in layer:      # sparse MoE feed-forward (replicated under tensor parallelism)
        return x + moe_mlp(layer["moe"], cfg.moe, hn), kv, captured
    if layer["gate_up"]["w"].ndim == 3:   # tensor-parallel layout [hidden, tp, gate|up of one shard]
        gu = _grouped_dense(layer["gate_up"], hn)                       # [b, t, tp, 2 * mlp / tp]
        half = gu.shape[-1] // 2
        act = (jax.nn.silu(gu[..., :half]) * gu[..., half:]).reshape(b, t, -1)
    else:
        gu = dense(layer["gate_up"], hn)
        gate, up = gu[..., : cfg.intermediate_size], gu[..., cfg.intermediate_size:]
        act = jax.nn.silu(gate) * up
    x = x + dense(layer["down"], act)
    return x, kv, captured


def scatter_kv(kv: dict, k: jax.Array, v: jax.Array, q_index: jax.Array, rows: jax.Array) -> dict:
    """Write new K/V [b, t, kv_heads, hd] at cache indexes q_index [b, t] of cache rows `rows`
    [b] (or [b, t]: a row per token, a packed prefill) into the segments of one layer's {"k",
    "v"(, "k_scale", "v_scale")} -> the updated layer dict (an int8 / fp8 cache quantizes on
    write: `kv_quant.quantize`). See the comment in `layer_forward` for the index scheme."""
    t = k.shape[1]
    new = quantize_kv(kv, k, v)
    if cpu_library.enabled():       # one kernel call writes every token once, in place
        kq, vq, ks, vs = new
        scales = layer_scales(kv)
        kts, vss, written = cpu_attention.kv_write(
            kv["k"], kv["v"], kq, vq, jnp.broadcast_to(rows[:, None] if rows.ndim == 1 else rows, q_index.shape),
            q_index, scales=scales, new_scales=None if ks is None else (ks, vs))
        out = {"k": kts, "v": vss}
        if written is not None:
            out["k_scale"], out["v_scale"] = written
        return out
    out, start = {name: [] for name in kv}, 0
    for i, cv in enumerate(kv["v"]):
        size = cv.shape[2]
        idx = q_index - start
        idx = jnp.where((idx >= 0) & (idx < size), idx, size + jnp.arange(t))
        for name, seg in scatter_segment(kv, i, rows, idx, new).items():
            out[name].append(seg)
        start += size
    return out


def quantize_kv(kv: dict, k: jax.Array, v: jax.Array) -> tuple:
    """New K, V [b, t, kv_heads, hd] in the storage of cache layer `kv`: (k, v, k_scale, v_scale
    [b, t, kv_heads] or None, None when the cache is not quantized)."""
    dtype = kv["k"][0].dtype
    if not is_quantized(dtype):
        return k.astype(dtype), v.astype(dtype), None, None
    (kq, ks), (vq, vs) = quantize(k, dtype), quantize(v, dtype)
    return kq, vq, ks, vs


def scatter_segment(kv: dict, i: int, rows: jax.Array, idx: jax.Array, new: tuple) -> dict:
    """Segment i of cache layer `kv` with `new` (`quantize_kv`) written at rows [b] (or [b, t]:
    a row per token) x idx [b, t] (indexes past the segment are dropped) -> {"k": .., "v": ..
    (, "k_scale", "v_scale")}."""
    k, v, ks, vs = new
    rows = rows[:, None] if rows.ndim == 1 else rows
    out = {"k": _set_bits(kv["k"][i], (rows, slice(None), slice(None), idx), k),
           "v": _set_bits(kv["v"][i], (rows, slice(None), idx), v)}
    if ks is not None:
        out["k_scale"] = _set_bits(kv["k_scale"][i], (rows, slice(None), idx), ks)
        out["v_scale"] = _set_bits(kv["v_scale"][i], (rows, slice(None), idx), vs)
    return out


def _set_bits(x: jax.Array, index: tuple, values: jax.Array) -> jax.Array:
    """x.at[index].set(values) (out-of-range indexes dropped), scattered as same-width unsigned
    ints for narrow floats: XLA:CPU has no bf16 / fp8 scatter and rewrites one into converting
    the whole cache segment to f32 / f16 and back on every write (a bf16 cache made decode slower
    than f32). A set moves bits, so the integer scatter is exact; on CPU the bitcasts around it
    still cost one 16- / 8-bit copy of the segment (why a bf16 model's default cache there is
    f32: `Tuning.auto_kv_cache_dtype`); other backends take them for free."""
    put = dict(mode="drop", unique_indices=True)
    if not jnp.issubdtype(x.dtype, jnp.floating) or x.dtype.itemsize == 4:
        return x.at[index].set(values.astype(x.dtype), **put)
    u = {2: jnp.uint16, 1: jnp.uint8}[x.dtype.itemsize]
    bits = jax.lax.bitcast_convert_type(x, u).at[index].set(
        jax.lax.bitcast_convert_type(values.astype(x.dtype), u), **put)
    return jax.lax.bitcast_convert_type(bits, x.dtype)


def _grouped_dense(p: dict, x: jax.Array) -> jax.Array:
    """x [b, t, in] @ w [in, groups, cols] (+ b [groups, cols]) -> [b, t, groups, cols]: a fused
    projection laid out per tensor-parallel shard (`tp_layout`), so each shard's split is local."""
    w = p["w"]
    if isinstance(w, QArray):   # 8-bit: the grouped columns as one [in, groups * cols] weight
        y = matmul(x, as_2d(w)).reshape(*x.shape[:-1], *w.shape[1:])
    else:
        y = bf16_einsum("btd,dgc->btgc", x, w)
    return y + p["b"] if "b" in p else y


def _split_grouped_qkv(qkv: jax.Array, h: int, hd: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """[b, t, tp, q|k|v of one shard] -> q [b, t, h, hd], k, v [b, t, kv heads held, hd]; head
    order is shard-major, i.e. the original order (shard s holds heads [s h/tp, (s+1) h/tp))."""
    b, t, g, cols = qkv.shape
    qc = h * hd // g
    kc = (cols - qc) // 2
    q = qkv[..., :qc].reshape(b, t, h, hd)
    k = qkv[..., qc:qc + kc].reshape(b, t, g * kc // hd, hd)
    v = qkv[..., qc + kc:].reshape(b, t, g * kc // hd, hd)
    return q, k, v


def cache_kv_heads(cfg: LlamaConfig, tp: int = 1) -> int:
    """KV heads the cache holds: the model's, or tp when there are fewer (each shard keeps a
    copy of the KV head its query heads read: Megatron's KV-head replication)."""
    return cfg.num_kv_heads if cfg.num_kv_heads >= tp else tp


def check_tensor_parallel(cfg: LlamaConfig, tp: int) -> None:
    """Can `cfg` be split over tp shards? (heads, KV heads and the MLP must divide evenly)."""
    problems = []
    if cfg.num_heads % tp:
        problems.append(f"num_attention_heads={cfg.num_heads}")
    if cfg.num_kv_heads % tp and tp % cfg.num_kv_heads:
        problems.append(f"num_key_value_heads={cfg.num_kv_heads}")
    if cfg.intermediate_size % tp:
        problems.append(f"intermediate_size={cfg.intermediate_size}")
    if problems:
        raise UnsupportedModelError(f"tensor_parallel={tp} does not divide {', '.join(problems)}",
                                    param="tensor_parallel")


def tp_kv_index(num_kv_heads: int, tp: int) -> np.ndarray:
    """The KV heads a tp-shard layout holds, in order: all of them, or (kv_heads < tp) each
    repeated so that shard s holds the one its query heads read (Megatron's KV replication)."""
    return np.arange(num_kv_heads) if num_kv_heads >= tp else np.arange(tp) // (tp // num_kv_heads)


def _host(a):
    """(array module, a): numpy on the host; jnp only when traced (abstract shapes:
    benchmarks/sharding.py)."""
    return (jnp, a) if isinstance(a, jax.core.Tracer) else (np, np.asarray(a))


def group_heads(a, num_heads: int, head_dim: int, tp: int, index: np.ndarray | None = None):
    """[..., heads * hd] (head-major columns) -> [..., tp, held/tp * hd]: the heads `index` picks
    (default all, in order) cut into tp consecutive blocks, one per shard."""
    _, a = _host(a)
    lead = a.shape[:-1]
    heads = a.reshape(*lead, num_heads, head_dim)
    if index is not None:
        heads = heads[..., index, :]
    return heads.reshape(*lead, tp, -1)


def group_gate_up(a, tp: int):
    """[..., gate|up] -> [..., tp, gate_s|up_s]: shard s's slice of both halves side by side."""
    xp, a = _host(a)
    lead, half = a.shape[:-1], a.shape[-1] // 2
    return xp.concatenate([a[..., :half].reshape(*lead, tp, -1), a[..., half:].reshape(*lead, tp, -1)], -1)


def pad_vocab(a, axis: int, vocab_size: int, tp: int):
    """Zero rows / columns on `axis` up to a multiple of tp (vocab-parallel embedding / head)."""
    xp, a = _host(a)
    widths = [(0, 0)] * a.ndim
    widths[axis] = (0, -vocab_size % tp)
    return xp.pad(a, widths)


def split_grouped_gate_up(gu: jax.Array) -> tuple[jax.Array, jax.Array]:
    """[b, t, tp, gate_s|up_s] (a `group_gate_up` projection) -> gate, up [b, t, mlp], each in
    the original column order (shard-major)."""
    b, t, _, cols = gu.shape
    return gu[..., :cols // 2].reshape(b, t, -1), gu[..., cols // 2:].reshape(b, t, -1)


def tp_layout(params: dict, cfg: LlamaConfig, tp: int) -> dict:
    """Text params (numpy or jax) -> the tensor-parallel layout for tp shards, on the host, once.
    8-bit weights (`mmjax.quant.QArray`) take the same column re-layout on values and scales.

    qkv w [hidden, q|k|v] -> [hidden, tp, q_s|k_s|v_s]: shard s gets its query heads
    [s h/tp, (s+1) h/tp) and the KV heads they read (kv_heads/tp of them, or, when kv_heads < tp,
    a copy of the one KV head of its group); bias [q|k|v] -> [tp, q_s|k_s|v_s].
    gate_up w [hidden, gate|up] -> [hidden, tp, gate_s|up_s]. With the group axis sharded over
    "model", every shard's q/k/v and gate/up split is local and no weight is ever gathered.
    embed [vocab, hidden] / lm_head [hidden, vocab] are zero-padded to a multiple of tp (vocab
    parallel; `lm_logits` callers cut the padding off). `cfg` needs vocab_size, hidden sizes and
    head counts only (Gemma 3's config serves as well)."""
    check_tensor_parallel(cfg, tp)
    h, kvh, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    kv_index = tp_kv_index(kvh, tp)

    def qkv(a):                                      # [..., q|k|v] -> [..., tp, q_s|k_s|v_s]
        xp, a = _host(a)
        q = group_heads(a[..., :h * hd], h, hd, tp)
        k = group_heads(a[..., h * hd:(h + kvh) * hd], kvh, hd, tp, kv_index)
        v = group_heads(a[..., (h + kvh) * hd:], kvh, hd, tp, kv_index)
        return xp.concatenate([q, k, v], axis=-1)

    # an 8-bit weight (mmjax.quant.QArray) regroups its values and per-column scales alike
    out = dict(params)
    out["embed"] = pad_vocab(params["embed"], 0, cfg.vocab_size, tp)
    out["lm_head"] = map_columns(lambda a: pad_vocab(a, 1, cfg.vocab_size, tp), params["lm_head"])
    # MoE layers keep their experts whole (replicated: no "gate_up" to regroup)
    out["layers"] = [{**lp, "qkv": {k: map_columns(qkv, v) for k, v in lp["qkv"].items()},
                      **({"gate_up": {k: map_columns(lambda a: group_gate_up(a, tp), v)
                                      for k, v in lp["gate_up"].items()}}
                         if "gate_up" in lp else {})}
                     for lp in params["layers"]]
    return out


def lm_logits(params: dict, hidden: jax.Array) -> jax.Array:
    """hidden [..., hidden] -> logits [..., vocab] in float32."""
    return matmul(hidden, params["lm_head"], jnp.float32)


def embed_tokens(params: dict, token_ids: jax.Array) -> jax.Array:
    return jnp.take(params["embed"], token_ids, axis=0, mode="clip")


@dataclass(frozen=True)
class LlamaTextModel(ConfigShape):
    """`TextModel` for Llama-style decoders: binds a config to the functions above."""
    cfg: LlamaConfig
    tp: int = 1          # tensor-parallel shards the params were laid out for (tp_layout)
    supports_packing = True     # forward(..., packing=): packed multi-sequence prefill
    supports_riders = True      # forward(..., packing=) with packing.riders: decode tokens riding in it

    @property
    def supports_prune(self) -> bool:
        """FastV pruning; not with per-layer image features (DeepStack adds after the prune)."""
        return self.cfg.image_feature_layers == 0

    @property
    def image_feature_layers(self) -> int:
        return self.cfg.image_feature_layers

    @property
    def position_rows(self) -> int:
        return 1 if self.cfg.rope.mrope_section is None else len(self.cfg.rope.mrope_section)

    def load_params(self, src: TensorSource, prefix: str, lm_head_name: str) -> dict:
        return load_params(src, self.cfg, prefix, lm_head_name)

    def init_cache(self, num_slots: int, max_len: int, dtype, sharding=None, *,
                   max_chunk: int | None = None) -> KVCache:
        cfg = self.cfg if self.tp == 1 else dataclasses.replace(self.cfg, num_kv_heads=cache_kv_heads(self.cfg, self.tp))
        return allocate_cache(lambda: init_kv_cache(cfg, num_slots, max_len, dtype), sharding)

    # ---- tensor parallelism (mmjax.sharding) -------------------------------------------------
    def tensor_parallel(self, tp: int) -> "LlamaTextModel":
        """This model as run over tp shards (its cache holds `cache_kv_heads(cfg, tp)` KV heads)."""
        check_tensor_parallel(self.cfg, tp)
        return dataclasses.replace(self, tp=tp)

    def tp_layout(self, params: dict, tp: int) -> dict:
        return tp_layout(params, self.cfg, tp)

    def logical_axes(self, params: dict):
        """Logical axis names of every text param (the path table in mmjax.sharding)."""
        from mmjax.sharding import param_logical_axes
        return param_logical_axes({"text": params})["text"]

    def embed(self, params: dict, ids: jax.Array) -> jax.Array:
        return embed_tokens(params, ids)

    def forward(self, params: dict, embeds: jax.Array, positions: jax.Array, cache: KVCache, starts: jax.Array,
                kv_len, *, slots: jax.Array | None = None, mask: MaskSpec | None = None,
                ids: jax.Array | None = None, capture: Capture | None = None, reduce_small: bool = False,
                prune: Prune | None = None, dropped: Dropped | None = None,
                layer_adds: jax.Array | None = None, packing: Packing | None = None) -> Output:
        inv_freq = jnp.asarray(rope_inv_freq(self.cfg.rope, self.cfg.head_dim))
        return forward(params, self.cfg, embeds, positions, cache, starts, kv_len, slots=slots, mask=mask,
                       capture=capture, reduce_small=reduce_small, inv_freq=inv_freq, prune=prune, dropped=dropped,
                       layer_adds=layer_adds, packing=packing)

    def logits(self, params: dict, hidden: jax.Array) -> jax.Array:
        out = lm_logits(params, hidden)
        # a vocab padded for tensor parallelism (tp_layout): the padding is not a token
        return out if out.shape[-1] == self.cfg.vocab_size else out[..., :self.cfg.vocab_size]


def from_hf(cfg: dict, where: str = "text_config", **overrides) -> LlamaTextModel:
    return LlamaTextModel(LlamaConfig.from_hf(cfg, where, **overrides))
