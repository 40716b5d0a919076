"""Gemma 4's decoder (transformers Gemma4TextModel + lm_head) behind the TextModel protocol.

What it adds to a Llama-style decoder, all read from the text config:

- `layer_types`: sliding-window layers (`sliding_window`) and full-attention layers, each with its
  own RoPE (`rope_parameters[type]`: default, or "proportional" = rotate only
  partial_rotary_factor of the head) and, for full layers, its own head width and KV heads
  (`per_layer_config`, or the hub's `global_head_dim` / `num_global_key_value_heads`).
- q/k RMSNorm, v RMSNorm without scale, unscaled scores (scale 1.0); `attention_k_eq_v`: full
  layers have no v_proj and use the k projection (before k_norm) as values.
- KV sharing (`num_kv_shared_layers`): the last layers have no K/V of their own and attend over
  the cache of the last earlier layer of their type; they hold no cache here either.
- per-layer input embeddings (`hidden_size_per_layer_input`): a second token embedding
  [vocab, layers * d_ple] plus a projection of the input embeddings, mixed into each layer's
  residual through a gate; needs the token ids (`forward(..., ids=)`). Multimodal placeholder ids
  look up the pad token's row, as transformers replaces them before the lookup.
- `use_double_wide_mlp`: KV-shared layers' MLP is twice as wide.
- `enable_moe_block`: a routed expert block (models/text/moe.py) beside the dense MLP, each with
  its own norms, summed.
- sandwich norms (post-attention / pre- and post-feed-forward RMSNorm, weight not 1 + weight),
  embeddings scaled by sqrt(hidden), a per-layer output scalar, final logit soft-capping.
- `use_bidirectional_attention="vision"`: image tokens of one run see each other both ways, in
  sliding layers only, and the window bounds them too ((causal | span) & window); full layers stay
  causal (transformers' create_masks_for_vision_model).

KV cache: the segmented slot cache of models/text/llama.py, one {"k", "v"} per layer that owns
K/V (not the shared ones), each with that layer's KV heads and head width, full length: sliding
layers mask by window (a ring buffer would save memory; not needed for parity).

Tensor parallelism: `tp_layout` / `logical_axes` / `tensor_parallel` below (Megatron; the MoE
block stays replicated).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from mmjax.checkpoint import TensorSource
from mmjax.errors import UnsupportedModelError
from mmjax.models.hf_config import require
from mmjax.models.layers import activation, matmul
from mmjax.models.text import Capture, ConfigShape, Dropped, MaskSpec, Output, Prune, prune_order, take_rows
from mmjax.models.text.kv_quant import layer_scales
from mmjax.models.text.llama import (_grouped_dense, _host, allocate_cache, cache_attention, explicit_attention,
                                     group_gate_up, group_heads, kv_layer, kv_segments, pad_vocab, scatter_kv,
                                     split_grouped_gate_up, tp_kv_index)
from mmjax.models.text.moe import experts_forward, gemma4_route
from mmjax.models.text.packing import Packing
from mmjax.models.text.rope import apply_rope, rope_cos_sin
from mmjax.models.vision.gemma4 import gemma4_rms_norm as norm
from mmjax.quant import map_columns

SLIDING, FULL = "sliding_attention", "full_attention"


@dataclass(frozen=True)
class LayerSpec:
    """One decoder layer's static shape."""
    kind: str                   # SLIDING or FULL
    head_dim: int
    num_kv_heads: int
    k_eq_v: bool                # values = k projection (no v_proj; layers owning K/V only)
    kv_source: int              # layer whose cache this layer reads (itself unless KV-shared)
    intermediate_size: int      # dense MLP width (doubled in KV-shared layers with double-wide MLP)


@dataclass(frozen=True)
class RopeSpec:
    theta: float
    rope_type: str = "default"       # default | proportional
    partial_rotary_factor: float = 1.0
    factor: float = 1.0

    def inv_freq(self, head_dim: int) -> np.ndarray:
        """[head_dim / 2] float32; proportional: the rotated fraction, then zeros (no rotation)."""
        if self.rope_type == "default":
            inv = 1.0 / (self.theta ** (np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / head_dim))
        else:
            angles = int(self.partial_rotary_factor * head_dim // 2)
            rot = 1.0 / (self.theta ** (np.arange(0, 2 * angles, 2, dtype=np.int64).astype(np.float32) / head_dim))
            inv = np.concatenate([rot, np.zeros(head_dim // 2 - angles, np.float32)])
        return (inv.astype(np.float32) / np.float32(self.factor)).astype(np.float32)


@dataclass(frozen=True)
class Gemma4TextConfig:
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    layers: tuple[LayerSpec, ...]
    rope: tuple[tuple[str, RopeSpec], ...]      # (layer kind, rope) pairs
    sliding_window: int
    rms_norm_eps: float
    max_position_embeddings: int
    hidden_act: str
    final_logit_softcapping: float | None
    bidirectional_vision: bool
    ple_size: int                 # hidden_size_per_layer_input (0: no per-layer embeddings)
    ple_vocab_size: int
    moe: tuple[int, int, int] | None   # (experts, top_k, expert intermediate size)
    pad_token_id: int
    multimodal_token_ids: tuple[int, ...] = ()   # placeholder ids embedded as the pad token
    attention_bias: bool = False

    @classmethod
    def from_hf(cls, cfg: dict, where: str = "text_config", **overrides) -> "Gemma4TextConfig":
        hidden = int(require(cfg, "hidden_size", where))
        heads = int(require(cfg, "num_attention_heads", where))
        n = int(require(cfg, "num_hidden_layers", where))
        head_dim = int(cfg.get("head_dim") or hidden // heads)
        kvh = int(cfg.get("num_key_value_heads") or heads)
        if cfg.get("attention_bias"):
            raise UnsupportedModelError(f"config.json: {where}.attention_bias=true is not supported",
                                        param=f"{where}.attention_bias")
        bidir = cfg.get("use_bidirectional_attention")
        if bidir not in (None, "vision"):
            raise UnsupportedModelError(f"config.json: {where}.use_bidirectional_attention={bidir!r} is not "
                                        "supported for generation (supported: null, 'vision')",
                                        param=f"{where}.use_bidirectional_attention")
        types = list(cfg.get("layer_types") or [SLIDING if (i + 1) % 6 else FULL for i in range(n)])
        if len(types) != n or any(t not in (SLIDING, FULL) for t in types):
            raise UnsupportedModelError(f"config.json: {where}.layer_types must be {n} of "
                                        f"{SLIDING!r} / {FULL!r}", param=f"{where}.layer_types")
        types[-1] = FULL   # transformers forces the last layer to full attention
        k_eq_v = bool(cfg.get("attention_k_eq_v", False))
        # full layers' head shape: per_layer_config (what transformers 5.23 saves), else the hub
        # fields it is built from
        per_layer = {int(k): v for k, v in (cfg.get("per_layer_config") or {}).items()}
        if not per_layer:
            g_hd = int(cfg.get("global_head_dim", 512))
            g_kv = cfg.get("num_global_key_value_heads") if k_eq_v else None
            per_layer = {i: {"head_dim": g_hd, **({"num_key_value_heads": g_kv} if g_kv else {})}
                         for i, t in enumerate(types) if t == FULL}
        shared = int(cfg.get("num_kv_shared_layers", 0) or 0)
        first_shared = n - shared
        if shared and set(types[:first_shared]) != set(types):
            raise UnsupportedModelError(f"config.json: {where}.num_kv_shared_layers={shared} leaves a layer "
                                        "type with no layer producing its KV", param=f"{where}.num_kv_shared_layers")
        inter = int(require(cfg, "intermediate_size", where))
        double = bool(cfg.get("use_double_wide_mlp", False))
        layers = []
        for i, t in enumerate(types):
            lc = per_layer.get(i, {})
            src = i if i < first_shared else max(j for j in range(first_shared) if types[j] == t)
            layers.append(LayerSpec(kind=t, head_dim=int(lc.get("head_dim", head_dim)),
                                    num_kv_heads=int(lc.get("num_key_value_heads", kvh)),
                                    k_eq_v=k_eq_v and t == FULL and src == i, kv_source=src,
                                    intermediate_size=inter * (2 if double and i >= first_shared else 1)))
        rope_params = cfg.get("rope_parameters") or {
            SLIDING: {"rope_type": "default", "rope_theta": 10_000.0},
            FULL: {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0}}
        rope = []
        for t in sorted(set(types)):
            rp = rope_params.get(t) or {}
            rt = rp.get("rope_type", "default")
            if rt not in ("default", "proportional"):
                raise UnsupportedModelError(f"config.json: {where}.rope_parameters.{t}.rope_type={rt!r} is not "
                                            "supported (default, proportional)", param=f"{where}.rope_parameters")
            rope.append((t, RopeSpec(theta=float(rp.get("rope_theta", 10_000.0)), rope_type=rt,
                                     partial_rotary_factor=float(rp.get("partial_rotary_factor", 1.0)),
                                     factor=float(rp.get("factor", 1.0)))))
        act = cfg.get("hidden_activation", "gelu_pytorch_tanh")
        activation(act)
        moe = None
        if cfg.get("enable_moe_block"):
            moe = (int(require(cfg, "num_experts", where)), int(require(cfg, "top_k_experts", where)),
                   int(require(cfg, "moe_intermediate_size", where)))
        cap = cfg.get("final_logit_softcapping")
        parsed = dict(
            vocab_size=int(require(cfg, "vocab_size", where)), hidden_size=hidden, num_layers=n, num_heads=heads,
            layers=tuple(layers), rope=tuple(rope), sliding_window=int(cfg.get("sliding_window", 512)),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 131072)), hidden_act=act,
            final_logit_softcapping=float(cap) if cap else None, bidirectional_vision=bidir == "vision",
            ple_size=int(cfg.get("hidden_size_per_layer_input") or 0),
            ple_vocab_size=int(cfg.get("vocab_size_per_layer_input") or cfg["vocab_size"]),
            moe=moe, pad_token_id=int(cfg.get("pad_token_id") or 0))
        return cls(**{**parsed, **overrides})

    def rope_for(self, kind: str) -> RopeSpec:
        return dict(self.rope)[kind]

    @property
    def cached_layers(self) -> tuple[int, ...]:
        """Layers that own K/V (and a cache entry), in order."""
        return tuple(i for i, l in enumerate(self.layers) if l.kv_source == i)


# ------------------------------------------------------------------------------------------------
# weights
# ------------------------------------------------------------------------------------------------

def _w(src: TensorSource, name: str, d_in: int, d_out: int) -> np.ndarray:
    """HF Linear weight [out, in] -> [in, out] (see checkpoint.linear)."""
    return np.ascontiguousarray(src.take(name + ".weight", (d_out, d_in)).T)


def load_params(src: TensorSource, cfg: Gemma4TextConfig, prefix: str = "model.language_model.",
                lm_head_name: str = "lm_head.weight") -> dict:
    d, h, L = cfg.hidden_size, cfg.num_heads, cfg.num_layers
    layers = []
    for i, spec in enumerate(cfg.layers):
        lp = f"{prefix}layers.{i}."
        a = lp + "self_attn."
        hd = spec.head_dim
        p = {
            "ln_in": src.take(lp + "input_layernorm.weight", (d,)),
            "ln_post_attn": src.take(lp + "post_attention_layernorm.weight", (d,)),
            "ln_pre_ffn": src.take(lp + "pre_feedforward_layernorm.weight", (d,)),
            "ln_post_ffn": src.take(lp + "post_feedforward_layernorm.weight", (d,)),
            "scalar": src.take(lp + "layer_scalar", (1,)),
            "q": _w(src, a + "q_proj", d, h * hd), "q_norm": src.take(a + "q_norm.weight", (hd,)),
            "o": _w(src, a + "o_proj", h * hd, d),
            "gate_up": np.concatenate([_w(src, lp + "mlp.gate_proj", d, spec.intermediate_size),
                                       _w(src, lp + "mlp.up_proj", d, spec.intermediate_size)], axis=1),
            "down": _w(src, lp + "mlp.down_proj", spec.intermediate_size, d),
        }
        kv_out = spec.num_kv_heads * hd
        if spec.kv_source == i:
            p["k_norm"] = src.take(a + "k_norm.weight", (hd,))
            parts = [_w(src, a + "k_proj", d, kv_out)]
            if not spec.k_eq_v:
                parts.append(_w(src, a + "v_proj", d, kv_out))
            p["kv"] = np.concatenate(parts, axis=1)
        else:   # transformers ignores these for KV-shared layers (if a file has them)
            src.ignore(rf"{a}(k_proj|v_proj|k_norm|v_norm)\..*")
        if cfg.ple_size:
            p["ple_gate"] = _w(src, lp + "per_layer_input_gate", d, cfg.ple_size)
            p["ple_proj"] = _w(src, lp + "per_layer_projection", cfg.ple_size, d)
            p["ple_norm"] = src.take(lp + "post_per_layer_input_norm.weight", (d,))
        if cfg.moe:
            e, _, f = cfg.moe
            p["router"] = {"scale": src.take(lp + "router.scale", (d,)), "proj": _w(src, lp + "router.proj", d, e),
                           "per_expert_scale": src.take(lp + "router.per_expert_scale", (e,))}
            p["experts"] = {
                "gate_up": np.ascontiguousarray(src.take(lp + "experts.gate_up_proj", (e, 2 * f, d)).transpose(0, 2, 1)),
                "down": np.ascontiguousarray(src.take(lp + "experts.down_proj", (e, d, f)).transpose(0, 2, 1))}
            for nm in ("post_feedforward_layernorm_1", "post_feedforward_layernorm_2", "pre_feedforward_layernorm_2"):
                p[nm] = src.take(lp + nm + ".weight", (d,))
        layers.append(p)
    embed = src.take(prefix + "embed_tokens.weight", (cfg.vocab_size, d))
    params = {"embed": embed, "layers": layers, "norm": src.take(prefix + "norm.weight", (d,))}
    # Gemma 4 always ties (tie_word_embeddings defaults to true); a file with its own lm_head keeps it
    params["lm_head"] = np.ascontiguousarray(
        (src.take(lm_head_name, (cfg.vocab_size, d)) if src.has(lm_head_name) else embed).T)
    if cfg.ple_size:
        params["ple_embed"] = src.take(prefix + "embed_tokens_per_layer.weight", (cfg.ple_vocab_size, L * cfg.ple_size))
        params["ple_model_proj"] = _w(src, prefix + "per_layer_model_projection", d, L * cfg.ple_size)
        params["ple_proj_norm"] = src.take(prefix + "per_layer_projection_norm.weight", (cfg.ple_size,))
    return params


# ------------------------------------------------------------------------------------------------
# compute
# ------------------------------------------------------------------------------------------------

def text_ids(cfg: Gemma4TextConfig, ids: jax.Array) -> jax.Array:
    """Multimodal placeholder ids -> the pad id (transformers embeds pad there, then overwrites)."""
    for t in cfg.multimodal_token_ids:
        ids = jnp.where(ids == t, cfg.pad_token_id, ids)
    return ids


def embed_tokens(params: dict, cfg: Gemma4TextConfig, ids: jax.Array) -> jax.Array:
    """ids [...] -> embeddings * sqrt(hidden) (the scale rounded to the weights' dtype, as HF)."""
    e = jnp.take(params["embed"], text_ids(cfg, ids), axis=0, mode="clip")
    return e * jnp.asarray(cfg.hidden_size ** 0.5, e.dtype)


def per_layer_inputs(params: dict, cfg: Gemma4TextConfig, ids: jax.Array, embeds: jax.Array) -> jax.Array:
    """[b, t, layers, d_ple]: (RMSNorm(embeds @ P / sqrt(hidden)) + E_ple[ids] * sqrt(d_ple)) / sqrt(2)."""
    b, t = ids.shape
    L, s = cfg.num_layers, cfg.ple_size
    tok = jnp.take(params["ple_embed"], text_ids(cfg, ids), axis=0, mode="clip")
    tok = (tok * jnp.asarray(s ** 0.5, tok.dtype)).reshape(b, t, L, s)
    proj = _scaled(matmul(embeds, params["ple_model_proj"]), cfg.hidden_size ** -0.5)
    proj = norm(params["ple_proj_norm"], proj.reshape(b, t, L, s), cfg.rms_norm_eps)
    return _scaled(proj + tok, 2.0 ** -0.5)


def _scaled(x: jax.Array, c: float) -> jax.Array:
    """x * a Python float as torch computes it: in float32, rounded once to x's dtype."""
    return (x.astype(jnp.float32) * np.float32(c)).astype(x.dtype)


def init_cache(cfg: Gemma4TextConfig, num_slots: int, max_len: int, dtype, tp: int = 1) -> list:
    """One segmented {"k", "v"} (llama layout) per layer owning K/V, with its own heads / width
    (KV heads replicated to tp when fewer: `cache_kv_heads`)."""
    cuts = kv_segments(max_len)
    out = []
    for i in cfg.cached_layers:
        sp = cfg.layers[i]
        kvh = cache_kv_heads(sp.num_kv_heads, tp)
        out.append(kv_layer(num_slots, kvh, sp.head_dim, cuts, dtype))
    return out


# ---- tensor parallelism (mmjax.sharding; Megatron over the "model" axis) --------------------------
# q [hidden, heads * hd] is column parallel as it is (its columns are head-major), o and down
# row parallel; the fused kv and gate_up are regrouped per shard (`tp_layout`) so each shard's
# split is local. The MoE block (router, experts) and the per-layer-input gate / projections stay
# replicated; the per-layer embedding table is vocab parallel like the token embedding.

def cache_kv_heads(num_kv_heads: int, tp: int) -> int:
    """KV heads a layer's cache holds: its own, or tp when fewer (each shard keeps the KV head
    its query heads read)."""
    return num_kv_heads if num_kv_heads >= tp else tp


def check_tensor_parallel(cfg: Gemma4TextConfig, tp: int) -> None:
    """Can `cfg` be split over tp shards? (heads, every layer's KV heads and MLP width)."""
    problems = [f"num_attention_heads={cfg.num_heads}"] if cfg.num_heads % tp else []
    for i, sp in enumerate(cfg.layers):
        if sp.kv_source == i and sp.num_kv_heads % tp and tp % sp.num_kv_heads:
            problems.append(f"layer {i}'s {sp.num_kv_heads} KV heads")
        if sp.intermediate_size % tp:
            problems.append(f"layer {i}'s intermediate size {sp.intermediate_size}")
    if problems:
        raise UnsupportedModelError(f"tensor_parallel={tp} does not divide {', '.join(problems)}",
                                    param="tensor_parallel")


def tp_layout(params: dict, cfg: Gemma4TextConfig, tp: int) -> dict:
    """Text params -> the tensor-parallel layout for tp shards, on the host, once.

    kv [hidden, k|v] (k only with k_eq_v) -> [hidden, tp, k_s|v_s]: shard s's KV heads (a copy of
    the one its query heads read when kv_heads < tp); gate_up [hidden, gate|up] -> [hidden, tp,
    gate_s|up_s]; embed / lm_head / ple_embed zero-padded to a multiple of tp on the vocab axis."""
    check_tensor_parallel(cfg, tp)

    def kv(a, sp: LayerSpec):                        # [..., k|v] -> [..., tp, k_s|v_s]
        xp, a = _host(a)
        w = sp.num_kv_heads * sp.head_dim
        index = tp_kv_index(sp.num_kv_heads, tp)
        return xp.concatenate([group_heads(a[..., j * w:(j + 1) * w], sp.num_kv_heads, sp.head_dim, tp, index)
                               for j in range(1 if sp.k_eq_v else 2)], axis=-1)

    out = dict(params)
    out["embed"] = pad_vocab(params["embed"], 0, cfg.vocab_size, tp)
    out["lm_head"] = map_columns(lambda a: pad_vocab(a, 1, cfg.vocab_size, tp), params["lm_head"])
    if "ple_embed" in params:
        out["ple_embed"] = pad_vocab(params["ple_embed"], 0, cfg.ple_vocab_size, tp)
    layers = []
    for p, sp in zip(params["layers"], cfg.layers):
        # 8-bit weights (mmjax.quant.QArray): values and per-column scales regrouped alike
        p = {**p, "gate_up": map_columns(lambda a: group_gate_up(a, tp), p["gate_up"])}
        if "kv" in p:
            p["kv"] = map_columns(lambda a, sp=sp: kv(a, sp), p["kv"])
        layers.append(p)
    out["layers"] = layers
    return out


# logical axes by parameter name (mmjax.sharding.LOGICAL_RULES), for the decoder's own names;
# nested leaves (router, experts) and everything else replicate
_TOP_AXES = {"embed": ("vocab", "embed"), "lm_head": ("embed", "vocab"), "ple_embed": ("vocab", None)}
_LAYER_AXES = {"q": ("embed", "heads"), "kv": ("embed", "kv_heads", None), "o": ("heads", "embed"),
               "gate_up": ("embed", "mlp", None), "down": ("mlp", "embed")}


def logical_axes(params: dict) -> dict:
    """The pytree of logical-axis tuples for the text params (tp_layout's shapes: a 2-D kv or
    gate_up, i.e. not laid out, replicates)."""
    from mmjax.sharding import is_qarray, key_names, qarray_axes

    def one(path, x):
        names = key_names(path)
        if len(names) == 1:
            ax = _TOP_AXES.get(names[0])
        elif len(names) == 3 and names[0] == "layers":
            ax = _LAYER_AXES.get(names[2])
        else:
            ax = None
        ax = ax if ax is not None and len(ax) == np.ndim(x) else (None,) * np.ndim(x)
        return qarray_axes(ax, x)
    return jax.tree_util.tree_map_with_path(one, params, is_leaf=is_qarray)


def _own_kv(p: dict, spec: LayerSpec, hn: jax.Array) -> tuple[jax.Array, jax.Array]:
    """hn [b, t, hidden] -> k, v [b, t, kv heads, hd] before their norms (v = k with k_eq_v).
    A 3-D kv is the tensor-parallel layout [hidden, tp, k_s|v_s]: each shard splits its own
    block and k / v hold the cache's KV heads (replicated when fewer than tp)."""
    b, t, _ = hn.shape
    kvh, hd = spec.num_kv_heads, spec.head_dim
    if p["kv"].ndim == 3:
        kvp = _grouped_dense({"w": p["kv"]}, hn)                         # [b, t, tp, k_s|v_s]
        g, cols = kvp.shape[2:]
        kc = cols if spec.k_eq_v else cols // 2
        k = kvp[..., :kc].reshape(b, t, g * kc // hd, hd)
        return k, (k if spec.k_eq_v else kvp[..., kc:].reshape(b, t, g * kc // hd, hd))
    kvp = matmul(hn, p["kv"])
    k = kvp[..., : kvh * hd].reshape(b, t, kvh, hd)
    v = k if spec.k_eq_v else kvp[..., kvh * hd:].reshape(b, t, kvh, hd)
    return k, v


def _gated(p: dict, spec: LayerSpec, hn: jax.Array, act) -> jax.Array:
    """hn [b, t, hidden] -> act(gate) * up [b, t, f] (3-D weight: the per-shard layout; the 2-D
    path keeps its op order, so one device compiles what it always did)."""
    if p["gate_up"].ndim == 3:
        gate, up = split_grouped_gate_up(_grouped_dense({"w": p["gate_up"]}, hn))
        return act(gate) * up
    gu = matmul(hn, p["gate_up"])
    f = spec.intermediate_size
    return act(gu[..., :f]) * gu[..., f:]


def _layer(p: dict, cfg: Gemma4TextConfig, spec: LayerSpec, x: jax.Array, kv: dict | None, own: bool,
           rope, q_index, kv_len, ple, *, slots, mask, starts, reduce_small, capture_attn, packing=None):
    """One decoder layer -> (x, this layer's cache entry if it owns K/V else the source's, captured).
    packing: a packed prefill (models/text/packing.py): K/V written per token, attention per segment;
    its riders attend as a decode step does."""
    b, t, d = x.shape
    h, kvh, hd, eps = cfg.num_heads, spec.num_kv_heads, spec.head_dim, cfg.rms_norm_eps
    act = activation(cfg.hidden_act)
    cos, sin = rope
    hn = norm(p["ln_in"], x, eps)
    q = apply_rope(norm(p["q_norm"], matmul(hn, p["q"]).reshape(b, t, h, hd), eps), cos, sin)
    if own:
        k, v = _own_kv(p, spec, hn)
        k = apply_rope(norm(p["k_norm"], k, eps), cos, sin)
        v = norm(None, v, eps)
        rows = jnp.arange(b) if slots is None else slots
        kv = scatter_kv(kv, k, v, q_index, rows if packing is None else packing.token_slot[None])
    # full layers: causal only; sliding: the window over causal | image spans
    lmask = MaskSpec(sliding_window=cfg.sliding_window, spans=mask.spans if mask is not None else None) \
        if spec.kind == SLIDING else None
    akw = dict(mask=lmask, starts=starts, scale=1.0, window_over_spans=True, scales=layer_scales(kv))
    captured = None
    if packing is not None:         # each query block over its own sequence's slot row
        attn = packing.attend(lambda qb, blk: cache_attention(
            qb, kv["k"], kv["v"], blk.q_index, blk.kv_len, blk.slots, reduce_small=reduce_small,
            **{**akw, "mask": blk.mask, "starts": blk.starts}), q, lmask)
        if packing.riders is not None:     # cache rows [0, D), as a decode step reads them (no image spans)
            ride = packing.riders
            window = None if lmask is None else MaskSpec(sliding_window=cfg.sliding_window)
            attn = packing.with_riders(attn, cache_attention(
                packing.rider_queries(q), kv["k"], kv["v"], ride.index[:, None], ride.kv_len, reduce_small=reduce_small,
                **{**akw, "starts": ride.index, "mask": window}))
    elif capture_attn:
        attn, probs = explicit_attention(q, kv["k"], kv["v"], q_index, kv_len, slots, **akw)
        captured = (probs, attn)
    else:
        attn = cache_attention(q, kv["k"], kv["v"], q_index, kv_len, slots, reduce_small=reduce_small, **akw)
    x = x + norm(p["ln_post_attn"], matmul(attn.reshape(b, t, h * hd), p["o"]), eps)
    residual = x
    m = matmul(_gated(p, spec, norm(p["ln_pre_ffn"], x, eps), act), p["down"])
    if cfg.moe:
        flat = residual.reshape(b * t, d)
        w, idx = gemma4_route(p["router"], flat, cfg.moe[1], eps)
        e = experts_forward(p["experts"], norm(p["pre_feedforward_layernorm_2"], flat, eps), w, idx, act)
        m = norm(p["post_feedforward_layernorm_1"], m, eps) + \
            norm(p["post_feedforward_layernorm_2"], e.reshape(b, t, d), eps)
    x = residual + norm(p["ln_post_ffn"], m, eps)
    if ple is not None:
        g = act(matmul(x, p["ple_gate"])) * ple
        x = x + norm(p["ple_norm"], matmul(g, p["ple_proj"]), eps)
    return x * p["scalar"].astype(x.dtype), kv, captured


def forward(params: dict, cfg: Gemma4TextConfig, embeds: jax.Array, positions: jax.Array, cache: list,
            starts: jax.Array, kv_len, *, slots: jax.Array | None = None, mask: MaskSpec | None = None,
            capture: Capture | None = None, reduce_small: bool = False, ids: jax.Array | None = None,
            prune: Prune | None = None, dropped: Dropped | None = None, packing: Packing | None = None) -> Output:
    """Run the decoder on new tokens [b, t] and write their K/V into the cache (llama.forward's
    contract, prune / dropped / packing and its riders included). ids [b, t]: the new tokens' ids (image positions may hold
    the image token id), needed when the model has per-layer input embeddings. mask.spans: image
    runs, applied in sliding layers when the config enables bidirectional vision attention."""
    capture = capture or Capture()
    if prune is not None and (capture.any or dropped is not None):
        raise ValueError("prune cannot be combined with capture or dropped")
    if packing is not None and (prune is not None or dropped is not None or capture.any):
        raise ValueError("a packed prefill takes no prune, dropped or capture")
    b, t, _ = embeds.shape
    if not cfg.bidirectional_vision and mask is not None and mask.spans is not None:
        mask = dataclasses.replace(mask, spans=None)
    ple = None
    if cfg.ple_size:
        if ids is None:
            raise ValueError("Gemma 4 with per-layer input embeddings needs the token ids (forward(..., ids=))")
        ple = per_layer_inputs(params, cfg, ids, embeds)

    def ropes_at(pos):
        return {kind: rope_cos_sin(jnp.asarray(r.inv_freq(_head_dim(cfg, kind))), pos) for kind, r in cfg.rope}

    ropes = ropes_at(positions)
    where = {layer: n for n, layer in enumerate(cfg.cached_layers)}
    new_cache = list(cache)
    x = embeds
    hidden, attn, attn_out, inter = [x], {}, {}, {}
    for i, (p, spec) in enumerate(zip(params["layers"], cfg.layers)):
        c = where[spec.kv_source]
        own = spec.kv_source == i
        layer_starts, layer_kv_len = starts, kv_len
        if dropped is not None:      # rows pruned after an earlier layer index a shorter sequence here
            layer_starts = starts - jnp.where(i > dropped.after, dropped.count, 0)
            layer_kv_len = dropped.kv_lens[i]
        q_index = layer_starts[:, None] + jnp.arange(t)[None, :] if packing is None else packing.token_index[None]
        scoring = prune is not None and i == prune.layer
        x, kv, probs = _layer(p, cfg, spec, x, new_cache[c], own, ropes[spec.kind], q_index, layer_kv_len,
                              None if ple is None else ple[:, :, i], slots=slots, mask=mask, starts=layer_starts,
                              reduce_small=reduce_small, capture_attn=i in capture.attn_layers or scoring,
                              packing=packing)
        if own:
            new_cache[c] = kv
        if scoring:
            order, inter["pruned"] = prune_order(probs[0], prune)
            x, positions, t, kv_len = take_rows(x, order), take_rows(positions, order, axis=2), prune.out_len, \
                prune.out_len
            ropes = ropes_at(positions)
            ple = None if ple is None else take_rows(ple, order)
            if mask is not None and mask.spans is not None:
                mask = dataclasses.replace(mask, spans=take_rows(mask.spans, order))
        elif probs is not None:
            attn[i], attn_out[i] = probs
        hidden.append(x)
    out = norm(params["norm"], x, cfg.rms_norm_eps)
    if capture.hidden:
        inter["hidden"] = hidden[:-1] + [out]
    if capture.attn_layers:
        inter["attn"], inter["attn_out"] = attn, attn_out
    return Output(out, new_cache, inter)


def _head_dim(cfg: Gemma4TextConfig, kind: str) -> int:
    return next(l.head_dim for l in cfg.layers if l.kind == kind)


def logits(params: dict, cfg: Gemma4TextConfig, hidden: jax.Array) -> jax.Array:
    """hidden [..., d] -> float32 logits, soft-capped: cap * tanh(logits / cap)."""
    z = matmul(hidden, params["lm_head"], jnp.float32)
    # a vocab padded for tensor parallelism (tp_layout): the padding is not a token
    z = z if z.shape[-1] == cfg.vocab_size else z[..., :cfg.vocab_size]
    if cfg.final_logit_softcapping:
        c = cfg.final_logit_softcapping
        z = jnp.tanh(z / c) * c
    return z


@dataclass(frozen=True)
class Gemma4TextModel(ConfigShape):
    """`TextModel` for Gemma 4 decoders."""
    cfg: Gemma4TextConfig
    position_rows: int = 1
    tp: int = 1          # tensor-parallel shards the params were laid out for (tp_layout)
    supports_prune = True
    supports_packing = True     # forward(..., packing=): packed multi-sequence prefill
    supports_riders = True      # forward(..., packing=) with packing.riders: decode tokens riding in it

    @property
    def max_prune_layer(self) -> int:
        """KV-shared layers read an earlier layer's cache: pruning must happen before every such
        source, or a shared layer would attend over the dropped tokens' K/V."""
        sources = [sp.kv_source for i, sp in enumerate(self.cfg.layers) if sp.kv_source != i]
        return min(sources, default=self.cfg.num_layers - 1) - 1

    def load_params(self, src: TensorSource, prefix: str = "model.language_model.",
                    lm_head_name: str = "lm_head.weight") -> dict:
        return load_params(src, self.cfg, prefix, lm_head_name)

    def init_cache(self, num_slots: int, max_len: int, dtype, sharding=None, *, max_chunk: int | None = None):
        return allocate_cache(lambda: init_cache(self.cfg, num_slots, max_len, dtype, self.tp), sharding)

    # ---- tensor parallelism (mmjax.sharding) -------------------------------------------------
    def tensor_parallel(self, tp: int) -> "Gemma4TextModel":
        """This model as run over tp shards (its caches hold `cache_kv_heads(kv_heads, tp)`)."""
        check_tensor_parallel(self.cfg, tp)
        return dataclasses.replace(self, tp=tp)

    def tp_layout(self, params: dict, tp: int) -> dict:
        return tp_layout(params, self.cfg, tp)

    def logical_axes(self, params: dict):
        return logical_axes(params)

    def embed(self, params: dict, ids: jax.Array) -> jax.Array:
        return embed_tokens(params, self.cfg, ids)

    def forward(self, params: dict, embeds: jax.Array, positions: jax.Array, cache, starts: jax.Array, kv_len, *,
                slots: jax.Array | None = None, mask: MaskSpec | None = None, capture: Capture | None = None,
                reduce_small: bool = False, ids: jax.Array | None = None, prune: Prune | None = None,
                dropped: Dropped | None = None, packing: Packing | None = None) -> Output:
        return forward(params, self.cfg, embeds, positions, cache, starts, kv_len, slots=slots, mask=mask,
                       capture=capture, reduce_small=reduce_small, ids=ids, prune=prune, dropped=dropped,
                       packing=packing)

    def logits(self, params: dict, hidden: jax.Array) -> jax.Array:
        return logits(params, self.cfg, hidden)


def from_hf(cfg: dict, where: str = "text_config", **overrides) -> Gemma4TextModel:
    return Gemma4TextModel(Gemma4TextConfig.from_hf(cfg, where, **overrides))
