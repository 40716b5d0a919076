"""Gemma 4's decoder (transformers Gemma4TextModel + lm_head) as an `nn.Decoder`.

Module tree (transformers' names): `embed_tokens` (scaled by sqrt(hidden)), with per-layer input
embeddings also `embed_tokens_per_layer`, `per_layer_model_projection`,
`per_layer_projection_norm`; `layers[i]`: `input_layernorm`, `self_attn` (`Gemma4Attention`: fused
`qkv_proj` holding HF's q_proj / k_proj / v_proj, only the q_proj / k_proj parts with k_eq_v,
only q_proj in KV-shared layers; `o_proj`, `q_norm`, `k_norm`, `v_norm`), `post_attention_layernorm`,
`pre_feedforward_layernorm`, `mlp` (nn.GatedMLP: fused `gate_up_proj`, `down_proj`),
`post_feedforward_layernorm`, with the MoE block also `router`, `experts`,
`pre_feedforward_layernorm_2`, `post_feedforward_layernorm_1` / `_2`, with per-layer inputs
`per_layer_input_gate`, `per_layer_projection`, `post_per_layer_input_norm`, and `layer_scalar`;
`norm`, `lm_head` (the tied embedding unless the file holds one).

What it adds to a Llama-style decoder, all read from the text config:

- `layer_types`: sliding-window layers (`sliding_window`) and full-attention layers, each with its
  own RoPE (`rope_parameters[type]`: default, or "proportional" = rotate only
  partial_rotary_factor of the head) and, for full layers, its own head width and KV heads
  (`per_layer_config`, or the hub's `global_head_dim` / `num_global_key_value_heads`).
- q/k RMSNorm, v RMSNorm without scale, unscaled scores (scale 1.0); `attention_k_eq_v`: full
  layers have no v_proj and use the k projection (before k_norm) as values.
- KV sharing (`num_kv_shared_layers`): the last layers have no K/V of their own and attend over
  the cache of the last earlier layer of their type, without writing it (`cache_index`); they
  hold no cache entry (`cache_layers`).
- per-layer input embeddings (`hidden_size_per_layer_input`): a second token embedding
  [vocab, layers * d_ple] plus a projection of the input embeddings, mixed into each layer's
  residual through a gate; needs the token ids, in decode too (`inputs` / `token_inputs` pass
  them, `per_token` makes the per-layer inputs). Multimodal placeholder ids look up the pad
  token's row, as transformers replaces them before the lookup.
- `use_double_wide_mlp`: KV-shared layers' MLP is twice as wide.
- `enable_moe_block`: a routed expert block (nn/moe.py: `gemma4_route` + `Experts`) beside the
  dense MLP, each with its own norms, summed.
- sandwich norms (RMSNorm kind "float32": weight, not 1 + weight), embeddings scaled by
  sqrt(hidden), a per-layer output scalar, final logit soft-capping.
- `use_bidirectional_attention="vision"`: image tokens of one run see each other both ways, in
  sliding layers only, and the window bounds them too ((causal | span) & window:
  `window_over_spans`); full layers stay causal (transformers' create_masks_for_vision_model).

KV cache: the segmented slot cache (nn/kv_cache.py), one entry per layer that owns K/V, each with
that layer's KV heads and head width, full length: sliding layers mask by window.

Tensor parallelism (Megatron over the "model" axis, layouts from the parts' logical axes): q|k|v
and gate|up regrouped per shard, o and down row parallel, the token and per-layer embeddings vocab
parallel; the MoE block and the per-layer-input gate / projections stay replicated.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from mmjax.errors import UnsupportedModelError
from mmjax.models.hf_config import require
from mmjax.models.nn.attention import Attention
from mmjax.models.nn.decoder import Decoder
from mmjax.models.nn.linear import Embed, FusedLinear, Linear, Part, activation, param
from mmjax.models.nn.metadata import AttentionMetadata
from mmjax.models.nn.mlp import GatedMLP
from mmjax.models.nn.moe import Experts, gemma4_route
from mmjax.models.nn.norm import RMSNorm
from mmjax.models.nn.rope import apply_rope, rope_cos_sin
from mmjax.models.nn.weights import load_children

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

    def head_dim_of(self, kind: str) -> int:
        """The head width of the layers of one kind (RoPE tables are per kind)."""
        return next(l.head_dim for l in self.layers if l.kind == kind)

    @property
    def cached_layers(self) -> tuple[int, ...]:
        """Layers that own K/V (and a cache entry), in order."""
        return tuple(i for i, l in enumerate(self.layers) if l.kv_source == i)

    def build(self, dtype=jnp.float32) -> "Gemma4TextModel":
        return Gemma4TextModel(self, dtype)


def config_from_hf(cfg: dict, where: str = "text_config", **overrides) -> Gemma4TextConfig:
    return Gemma4TextConfig.from_hf(cfg, where, **overrides)


def _scaled(x: jax.Array, c: float) -> jax.Array:
    """x * a Python float as torch computes it: in float32, rounded once to x's dtype."""
    return (x.astype(jnp.float32) * np.float32(c)).astype(x.dtype)


# ------------------------------------------------------------------------------------------------
# modules
# ------------------------------------------------------------------------------------------------

class Gemma4Attention(Attention):
    """Gemma 4's self-attention: `qkv_proj` fuses HF's q_proj | k_proj | v_proj (q_proj | k_proj
    with k_eq_v, where the values are the k projection before k_norm; q_proj alone in a KV-shared
    layer, which reads its source layer's cache and writes nothing); q_norm / k_norm (RMSNorm
    with weight), v_norm (no weight), scores unscaled; sliding layers attend within the window,
    over image runs both ways when the config says so (window over spans)."""

    def __init__(self, cfg: Gemma4TextConfig, i: int, dtype=jnp.float32):
        spec = cfg.layers[i]
        d, h, hd, eps = cfg.hidden_size, cfg.num_heads, spec.head_dim, cfg.rms_norm_eps
        sliding = spec.kind == SLIDING
        self.layer_idx = i
        self.num_heads, self.num_kv_heads, self.head_dim = h, spec.num_kv_heads, hd
        self.scale, self.softcap, self.ring = 1.0, None, False
        self.sliding_window = cfg.sliding_window if sliding else None
        self.spans, self.window_over_spans, self.chunk = sliding and cfg.bidirectional_vision, True, None
        self.owns_kv, self.k_eq_v = spec.kv_source == i, spec.k_eq_v
        parts = [Part("q_proj", h * hd, "heads", hd)]
        if self.owns_kv:
            parts.append(Part("k_proj", spec.num_kv_heads * hd, "kv_heads", hd))
            if not spec.k_eq_v:
                parts.append(Part("v_proj", spec.num_kv_heads * hd, "kv_heads", hd))
        self.qkv_proj = FusedLinear(d, tuple(parts), dtype=dtype)
        self.o_proj = Linear(h * hd, d, dtype=dtype, axes=("heads", "embed"))
        self.q_norm = RMSNorm(hd, eps, kind="float32", dtype=dtype)
        self.k_norm = RMSNorm(hd, eps, kind="float32", dtype=dtype) if self.owns_kv else None
        self.v_norm = RMSNorm(hd, eps, kind="float32", with_scale=False, dtype=dtype) if self.owns_kv else None

    def hf_weights(self, w, name: str) -> None:
        self.qkv_proj.hf_weights(w, f"{name}.")
        self.o_proj.hf_weights(w, f"{name}.o_proj")
        self.q_norm.hf_weights(w, f"{name}.q_norm")
        if self.owns_kv:
            self.k_norm.hf_weights(w, f"{name}.k_norm")
        else:   # transformers ignores these for KV-shared layers (if a file has them)
            w.ignore(re.escape(name) + r"\.(k_proj|v_proj|k_norm|v_norm)\..*")

    def project(self, x: jax.Array, rope: tuple):
        """x [b, t, hidden] -> q [b, t, heads, hd], k, v [b, t, KV heads held, hd] (None, None in
        a KV-shared layer)."""
        b, t, _ = x.shape
        hd = self.head_dim
        ys = [y.reshape(b, t, -1, hd) for y in self.qkv_proj(x)]
        cos, sin = rope
        q = apply_rope(self.q_norm(ys[0]), cos, sin)
        if not self.owns_kv:
            return q, None, None
        k = ys[1]
        v = k if self.k_eq_v else ys[2]
        return q, apply_rope(self.k_norm(k), cos, sin), self.v_norm(v)


class Gemma4Router(nnx.Module):
    """Gemma4TextRouter: `scale` [hidden], `proj` (hidden -> experts), `per_expert_scale`
    [experts] (nn.moe.gemma4_route)."""

    def __init__(self, hidden: int, num_experts: int, top_k: int, eps: float, dtype=jnp.float32):
        self.hidden, self.num_experts, self.top_k, self.eps = hidden, num_experts, top_k, eps
        self.scale = param((hidden,), dtype, (None,))
        self.proj = Linear(hidden, num_experts, dtype=dtype, quantize=False)
        self.per_expert_scale = param((num_experts,), dtype, (None,))

    def __call__(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        """x [n, hidden] -> (weights [n, k] float32, expert ids [n, k])."""
        return gemma4_route({"scale": self.scale.get_value(), "proj": self.proj,
                             "per_expert_scale": self.per_expert_scale.get_value()}, x, self.top_k, self.eps)

    def hf_weights(self, w, name: str) -> None:
        w.set(self.scale, w.take(f"{name}.scale", (self.hidden,)))
        self.proj.hf_weights(w, f"{name}.proj")
        w.set(self.per_expert_scale, w.take(f"{name}.per_expert_scale", (self.num_experts,)))


class Gemma4Experts(Experts):
    """Gemma4TextExperts: the files hold gate_up_proj [E, 2f, d] and down_proj [E, d, f] (as
    torch multiplies them), kept here as [E, d, 2f] / [E, f, d]."""

    def hf_weights(self, w, name: str) -> None:
        e, d, f = self.num_experts, self.hidden, self.intermediate
        w.set(self.gate_up_proj, w.take(f"{name}.gate_up_proj", (e, 2 * f, d)).transpose(0, 2, 1), matmul=True)
        w.set(self.down_proj, w.take(f"{name}.down_proj", (e, d, f)).transpose(0, 2, 1), matmul=True)


class Gemma4DecoderLayer(nnx.Module):
    """Gemma4TextDecoderLayer (see the module docstring)."""

    def __init__(self, cfg: Gemma4TextConfig, i: int, dtype=jnp.float32):
        spec = cfg.layers[i]
        d, eps = cfg.hidden_size, cfg.rms_norm_eps

        def norm(dim=d):
            return RMSNorm(dim, eps, kind="float32", dtype=dtype)
        self.act = cfg.hidden_act
        self.input_layernorm = norm()
        self.self_attn = Gemma4Attention(cfg, i, dtype)
        self.post_attention_layernorm = norm()
        self.pre_feedforward_layernorm = norm()
        self.mlp = GatedMLP(d, spec.intermediate_size, act=cfg.hidden_act, dtype=dtype)
        self.post_feedforward_layernorm = norm()
        if cfg.moe is not None:
            e, k, f = cfg.moe
            self.router = Gemma4Router(d, e, k, eps, dtype=dtype)
            self.experts = Gemma4Experts(e, d, f, act=cfg.hidden_act, dtype=dtype)
            self.pre_feedforward_layernorm_2 = norm()
            self.post_feedforward_layernorm_1 = norm()
            self.post_feedforward_layernorm_2 = norm()
        else:
            self.router = self.experts = None
        if cfg.ple_size:
            self.per_layer_input_gate = Linear(d, cfg.ple_size, dtype=dtype)
            self.per_layer_projection = Linear(cfg.ple_size, d, dtype=dtype)
            self.post_per_layer_input_norm = norm()
        else:
            self.per_layer_input_gate = None
        self.layer_scalar = param((1,), dtype, (None,))

    def __call__(self, x: jax.Array, rope, meta: AttentionMetadata, kv: dict,
                 ple: jax.Array | None = None) -> tuple[jax.Array, dict]:
        """ple [b, t, d_ple]: this layer's per-layer input (models with per-layer embeddings)."""
        b, t, d = x.shape
        act = activation(self.act)
        h, kv = self.self_attn(self.input_layernorm(x), rope, meta, kv)
        x = x + self.post_attention_layernorm(h)
        residual = x
        m = self.mlp(self.pre_feedforward_layernorm(x))
        if self.experts is not None:
            flat = residual.reshape(b * t, d)
            w, idx = self.router(flat)
            e = self.experts(self.pre_feedforward_layernorm_2(flat), w, idx)
            m = self.post_feedforward_layernorm_1(m) + self.post_feedforward_layernorm_2(e.reshape(b, t, d))
        x = residual + self.post_feedforward_layernorm(m)
        if ple is not None:
            g = act(self.per_layer_input_gate(x)) * ple
            x = x + self.post_per_layer_input_norm(self.per_layer_projection(g))
        return x * self.layer_scalar.get_value().astype(x.dtype), kv

    def hf_weights(self, w, name: str) -> None:
        load_children(self, w, name)
        w.set(self.layer_scalar, w.take(f"{name}.layer_scalar", (1,)))


class Gemma4TextModel(Decoder):
    """The decoder (see the module docstring)."""

    def __init__(self, cfg: Gemma4TextConfig, dtype=jnp.float32):
        self.config = cfg
        self.hidden_size, self.vocab_size, self.num_layers = cfg.hidden_size, cfg.vocab_size, cfg.num_layers
        self.max_position_embeddings = cfg.max_position_embeddings
        d, n, s = cfg.hidden_size, cfg.num_layers, cfg.ple_size
        self.embed_tokens = Embed(cfg.vocab_size, d, dtype=dtype)
        if s:
            self.embed_tokens_per_layer = Embed(cfg.ple_vocab_size, n * s, dtype=dtype)
            self.per_layer_model_projection = Linear(d, n * s, dtype=dtype)
            self.per_layer_projection_norm = RMSNorm(s, cfg.rms_norm_eps, kind="float32", dtype=dtype)
        else:
            self.embed_tokens_per_layer = None
        self.layers = nnx.List([Gemma4DecoderLayer(cfg, i, dtype) for i in range(n)])
        self.norm = RMSNorm(d, cfg.rms_norm_eps, kind="float32", dtype=dtype)
        self.lm_head = Linear(d, cfg.vocab_size, dtype=dtype, axes=("embed", "vocab"))

    @property
    def max_prune_layer(self) -> int:
        """KV-shared layers read an earlier layer's cache: pruning must happen before every such
        source, or a shared layer would attend over the dropped tokens' K/V."""
        specs = self.config.layers
        sources = [sp.kv_source for i, sp in enumerate(specs) if sp.kv_source != i]
        return min(sources, default=self.num_layers - 1) - 1

    def check_tensor_parallel(self, tp: int) -> None:
        """Can the decoder be split over tp shards? (heads, every layer's KV heads and MLP width)"""
        cfg = self.config
        problems = [f"num_attention_heads={cfg.num_heads}"] if cfg.num_heads % tp else []
        for i, sp in enumerate(cfg.layers):
            if sp.kv_source == i and sp.num_kv_heads % tp and tp % sp.num_kv_heads:
                problems.append(f"layer {i}'s {sp.num_kv_heads} KV heads")
            if sp.intermediate_size % tp:
                problems.append(f"layer {i}'s intermediate size {sp.intermediate_size}")
        if problems:
            raise UnsupportedModelError(f"tensor_parallel={tp} does not divide {', '.join(problems)}",
                                        param="tensor_parallel")

    # ---- inputs --------------------------------------------------------------------------------
    def text_ids(self, ids: jax.Array) -> jax.Array:
        """Multimodal placeholder ids -> the pad id (transformers embeds pad there, then overwrites)."""
        cfg = self.config
        for t in cfg.multimodal_token_ids:
            ids = jnp.where(ids == t, cfg.pad_token_id, ids)
        return ids

    def embed(self, ids: jax.Array) -> jax.Array:
        """ids [...] -> embeddings * sqrt(hidden) (the scale rounded to the weights' dtype, as HF)."""
        e = self.embed_tokens(self.text_ids(ids))
        return e * jnp.asarray(self.hidden_size ** 0.5, e.dtype)

    def token_inputs(self, ids):
        return self.embed(ids), ({"ids": ids} if self.config.ple_size else {})

    def inputs(self, ids, image_embeds, image_mask):
        embeds, _ = super().inputs(ids, image_embeds, image_mask)
        return embeds, ({"ids": ids} if self.config.ple_size else {})

    def per_token(self, embeds, ids=None):
        """{"ple": [b, t, layers, d_ple]}: (RMSNorm(embeds @ P / sqrt(hidden)) + E_ple[ids] *
        sqrt(d_ple)) / sqrt(2); none without per-layer embeddings."""
        cfg = self.config
        if not cfg.ple_size:
            return {}
        if ids is None:
            raise ValueError("Gemma 4 with per-layer input embeddings needs the token ids (ids=)")
        b, t = ids.shape
        n, s = cfg.num_layers, cfg.ple_size
        tok = self.embed_tokens_per_layer(self.text_ids(ids))
        tok = (tok * jnp.asarray(s ** 0.5, tok.dtype)).reshape(b, t, n, s)
        proj = _scaled(self.per_layer_model_projection(embeds), cfg.hidden_size ** -0.5)
        proj = self.per_layer_projection_norm(proj.reshape(b, t, n, s))
        return {"ple": _scaled(proj + tok, 2.0 ** -0.5)}

    def layer_kwargs(self, i, per_token):
        ple = per_token.get("ple")
        return {} if ple is None else {"ple": ple[:, :, i]}

    # ---- the cache -----------------------------------------------------------------------------
    def cache_layers(self) -> tuple[int, ...]:
        return self.config.cached_layers

    def cache_index(self, i: int) -> int:
        return self.config.cached_layers.index(self.config.layers[i].kv_source)

    # ---- the forward ---------------------------------------------------------------------------
    def rope(self, positions):
        """{layer kind: (cos, sin) [b, t, that kind's head_dim]}."""
        cfg = self.config
        return {kind: rope_cos_sin(jnp.asarray(r.inv_freq(cfg.head_dim_of(kind))), positions) for kind, r in cfg.rope}

    def layer_rope(self, i, rope):
        return rope[self.config.layers[i].kind]

    def logits(self, hidden: jax.Array) -> jax.Array:
        """hidden [..., d] -> float32 logits, soft-capped: cap * tanh(logits / cap)."""
        z = super().logits(hidden)
        c = self.config.final_logit_softcapping
        return z if not c else jnp.tanh(z / c) * c

    def hf_weights(self, w, name: str, lm_head: str | None = None) -> None:
        """`name`: the HF prefix of Gemma4TextModel ("model.language_model"); lm_head: the LM
        head's tensor name (Gemma 4 always ties: without that tensor the head is the embedding)."""
        cfg = self.config
        self.embed_tokens.hf_weights(w, f"{name}.embed_tokens")
        if cfg.ple_size:
            self.embed_tokens_per_layer.hf_weights(w, f"{name}.embed_tokens_per_layer")
            self.per_layer_model_projection.hf_weights(w, f"{name}.per_layer_model_projection")
            self.per_layer_projection_norm.hf_weights(w, f"{name}.per_layer_projection_norm")
        for i, layer in enumerate(self.layers):
            layer.hf_weights(w, f"{name}.layers.{i}")
        self.norm.hf_weights(w, f"{name}.norm")
        shape = (cfg.vocab_size, cfg.hidden_size)
        src = lm_head if lm_head is not None and w.has(lm_head) else f"{name}.embed_tokens.weight"
        w.set(self.lm_head.kernel, w.take(src, shape).T, matmul=True)
