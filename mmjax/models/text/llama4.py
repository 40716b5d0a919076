"""Llama 4 decoder (`llama4_text`): the language model of Llama4ForConditionalGeneration.

Module tree (transformers' Llama4TextModel + lm_head): `embed_tokens`, `layers[i]`
(`input_layernorm`, `self_attn` (Llama4Attention: fused `qkv_proj`, `o_proj`),
`post_attention_layernorm`, `feed_forward` (a Llama4TextMoe in `moe_layers`: `router`, `experts`,
`shared_expert`; else a dense nn.GatedMLP of `intermediate_size_mlp`)), `norm`, `lm_head`.

Differences from Llama:
- RoPE rotates interleaved pairs (x[2j], x[2j+1]) (HF's complex `freqs_cis`), not halves, and only
  on the layers `no_rope_layers` marks 1; the others are NoPE layers (no rotation).
- RoPE layers are chunked (local) attention when `attention_chunk_size` is set: a query at cache
  index i reads keys [(i // C) * C, i] only, the chunk it lies in (`nn.Attention(chunk=C)`: a
  mask over the segmented cache, so prefix resumes and packed prefill work at any boundary).
  NoPE layers attend to everything (global).
- QK-norm (`use_qk_norm`) on RoPE layers: a weightless RMSNorm (HF's L2 norm, eps rms_norm_eps)
  of q and k per head, after the rotation.
- Attention temperature tuning (`attn_temperature_tuning`) on NoPE layers: q is scaled per
  position by log1p(floor((pos + 1) / floor_scale)) * attn_scale + 1.
- The MoE feed-forward (Llama4TextMoe): a linear router, the top-k expert logits through a
  sigmoid scale each expert's *input* (routed_in = x * sigmoid(logit)), the expert outputs are
  summed and the shared expert's output (a dense SwiGLU every token takes) added; experts run
  through nn.moe.experts_forward (one assignment row per (token, expert), weight 1).
"""
from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from mmjax.errors import UnsupportedModelError
from mmjax.models.hf_config import require
from mmjax.models.nn.attention import Attention
from mmjax.models.nn.decoder import Decoder
from mmjax.models.nn.linear import Embed, Linear, check_divisible
from mmjax.models.nn.metadata import AttentionMetadata
from mmjax.models.nn.mlp import GatedMLP
from mmjax.models.nn.moe import Experts
from mmjax.models.nn.norm import RMSNorm
from mmjax.models.nn.rope import RopeConfig, cos_sin, rope_inv_freq
from mmjax.models.text.llama import load_lm_head

CHUNKED, FULL = "chunked_attention", "full_attention"


@dataclass(frozen=True)
class Llama4TextConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int          # each expert's (and the shared expert's) width
    intermediate_size_mlp: int      # the dense layers' width
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope: RopeConfig
    use_rope: tuple[bool, ...]      # per layer: RoPE (chunked when configured) or NoPE (global)
    layer_types: tuple[str, ...]
    moe_layers: tuple[int, ...]
    num_experts: int
    top_k: int
    use_qk_norm: bool
    attention_chunk_size: int | None
    attn_temperature_tuning: bool
    floor_scale: float
    attn_scale: float
    attention_bias: bool = False
    tie_word_embeddings: bool = False

    @classmethod
    def from_hf(cls, cfg: dict, where: str = "text_config", **overrides) -> "Llama4TextConfig":
        """transformers' Llama4TextConfig defaults where a field is absent (`no_rope_layers` from
        `no_rope_layer_interval`, `moe_layers` from `interleave_moe_layer_step`, `layer_types`
        from both and `attention_chunk_size`)."""
        hidden = int(require(cfg, "hidden_size", where))
        heads = int(require(cfg, "num_attention_heads", where))
        n = int(require(cfg, "num_hidden_layers", where))
        act = cfg.get("hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise UnsupportedModelError(f"config.json: {where}.hidden_act={act!r} not supported",
                                        param=f"{where}.hidden_act")
        interval = int(cfg.get("no_rope_layer_interval", 4))
        no_rope = cfg.get("no_rope_layers") or [int((i + 1) % interval != 0) for i in range(n)]
        if len(no_rope) < n:
            raise UnsupportedModelError(f"config.json: {where}.no_rope_layers lists {len(no_rope)} layers, "
                                        f"the model has {n}", param=f"{where}.no_rope_layers")
        use_rope = tuple(bool(no_rope[i]) for i in range(n))
        chunk = cfg.get("attention_chunk_size", 8192)
        chunk = int(chunk) if chunk else None
        types = cfg.get("layer_types") or [CHUNKED if r and chunk is not None else FULL for r in use_rope]
        if len(types) != n or any(t not in (CHUNKED, FULL) for t in types) or (CHUNKED in types and chunk is None):
            raise UnsupportedModelError(f"config.json: {where}.layer_types must list {n} of {CHUNKED!r} / {FULL!r} "
                                        "(chunked layers need attention_chunk_size)", param=f"{where}.layer_types")
        step = int(cfg.get("interleave_moe_layer_step", 1))
        moe = cfg.get("moe_layers")
        moe = tuple(int(i) for i in (moe if moe is not None else range(step - 1, n, step)))
        e = int(cfg.get("num_local_experts", 16))
        k = int(cfg.get("num_experts_per_tok", 1))
        if moe and not 0 < k <= e:
            raise UnsupportedModelError(f"config.json: {where}.num_experts_per_tok={k} must be in 1..{e}",
                                        param=f"{where}.num_experts_per_tok")
        parsed = dict(
            vocab_size=int(require(cfg, "vocab_size", where)), hidden_size=hidden,
            intermediate_size=int(cfg.get("intermediate_size", 8192)),
            intermediate_size_mlp=int(cfg.get("intermediate_size_mlp", 16384)),
            num_layers=n, num_heads=heads, num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-5)),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 131072)),
            rope=RopeConfig.from_hf({"rope_theta": 500000.0, **cfg}, where), use_rope=use_rope,
            layer_types=tuple(types), moe_layers=moe, num_experts=e, top_k=k,
            use_qk_norm=bool(cfg.get("use_qk_norm", True)), attention_chunk_size=chunk,
            attn_temperature_tuning=bool(cfg.get("attn_temperature_tuning", True)),
            floor_scale=float(cfg.get("floor_scale", 8192)), attn_scale=float(cfg.get("attn_scale", 0.1)),
            attention_bias=bool(cfg.get("attention_bias", False)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)))
        return cls(**{**parsed, **overrides})

    def build(self, dtype=jnp.float32) -> "Llama4TextModel":
        return Llama4TextModel(self, dtype)


def apply_rope_pairs(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """x [b, t, heads, hd] rotated by pairs (x[2j], x[2j+1]) through angle j (cos, sin [b, t,
    hd / 2]): HF Llama 4's complex multiplication, in float32."""
    xf = x.astype(jnp.float32).reshape(*x.shape[:-1], -1, 2)
    a, b = xf[..., 0], xf[..., 1]
    c, s = cos[:, :, None, :], sin[:, :, None, :]
    return jnp.stack([a * c - b * s, a * s + b * c], axis=-1).reshape(x.shape).astype(x.dtype)


def l2_norm(x: jax.Array, eps: float) -> jax.Array:
    """HF's Llama4TextL2Norm: x * rsqrt(mean(x^2) + eps) over head_dim, in float32, no weight."""
    xf = x.astype(jnp.float32)
    return (xf * jax.lax.rsqrt(jnp.square(xf).mean(-1, keepdims=True) + eps)).astype(x.dtype)


class Llama4Attention(Attention):
    """nn.Attention with Llama 4's projection: pairwise RoPE + L2 QK-norm on RoPE layers, the
    temperature scale of q on NoPE layers (module docstring). `rope` is (cos, sin) on a RoPE layer,
    the per-token q scale [b, t] (or None) on a NoPE layer."""

    def __init__(self, *, use_rope: bool, qk_l2: bool, temperature: bool, **kw):
        super().__init__(**kw)
        self.use_rope, self.qk_l2, self.temperature = use_rope, qk_l2, temperature
        self.l2_eps = kw.get("norm_eps", 1e-5)

    def project(self, x: jax.Array, rope) -> tuple[jax.Array, jax.Array, jax.Array]:
        b, t, _ = x.shape
        q, k, v = (y.reshape(b, t, -1, self.head_dim) for y in self.qkv_proj(x))
        if self.use_rope:
            cos, sin = rope
            q, k = apply_rope_pairs(q, cos, sin), apply_rope_pairs(k, cos, sin)
            if self.qk_l2:
                q, k = l2_norm(q, self.l2_eps), l2_norm(k, self.l2_eps)
        elif self.temperature:
            q = (q.astype(jnp.float32) * rope[:, :, None, None]).astype(q.dtype)
        return q, k, v


class Llama4TextMoe(nnx.Module):
    """HF's Llama4TextMoe: `router` [d, E], `experts` (stacks [E, d, 2f] / [E, f, d]),
    `shared_expert` (gate_proj / up_proj / down_proj of width f)."""

    def __init__(self, cfg: Llama4TextConfig, dtype=jnp.float32):
        self.top_k = cfg.top_k
        d, f = cfg.hidden_size, cfg.intermediate_size
        self.router = Linear(d, cfg.num_experts, dtype=dtype, quantize=False)
        self.experts = Experts(cfg.num_experts, d, f, dtype=dtype)
        self.shared_expert = GatedMLP(d, f, dtype=dtype)

    def __call__(self, x: jax.Array) -> jax.Array:
        """x [b, t, d] -> [b, t, d]: shared_expert(x) + sum over the top k of expert(x * sigmoid(logit))."""
        b, t, d = x.shape
        flat = x.reshape(b * t, d)
        logits = self.router(flat)
        top, idx = jax.lax.top_k(logits, self.top_k)                         # [n, k]
        scale = jax.nn.sigmoid(top.astype(jnp.float32)).astype(flat.dtype)
        rows = (jnp.repeat(flat, self.top_k, axis=0) * scale.reshape(-1, 1))  # [n*k, d] (token, slot) order
        ones = jnp.ones((rows.shape[0], 1), jnp.float32)
        routed = self.experts(rows, ones, idx.reshape(-1, 1).astype(jnp.int32))
        out = self.shared_expert(flat) + routed.reshape(b * t, self.top_k, d).sum(axis=1)
        return out.reshape(b, t, d)

    def hf_weights(self, w, name: str) -> None:
        self.router.hf_weights(w, f"{name}.router")
        self.experts.hf_weights(w, f"{name}.experts")
        self.shared_expert.hf_weights(w, f"{name}.shared_expert")


class Llama4DecoderLayer(nnx.Module):
    """Pre-norm attention and feed-forward (MoE or dense) blocks, each added to the residual."""

    def __init__(self, cfg: Llama4TextConfig, i: int, dtype=jnp.float32):
        d, eps = cfg.hidden_size, cfg.rms_norm_eps
        rope = cfg.use_rope[i]
        self.input_layernorm = RMSNorm(d, eps, dtype=dtype)
        self.self_attn = Llama4Attention(
            use_rope=rope, qk_l2=cfg.use_qk_norm, temperature=cfg.attn_temperature_tuning,
            layer_idx=i, hidden_size=d, num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads,
            head_dim=cfg.head_dim, qkv_bias=cfg.attention_bias, o_bias=cfg.attention_bias, norm_eps=eps,
            chunk=cfg.attention_chunk_size if cfg.layer_types[i] == CHUNKED else None, dtype=dtype)
        self.post_attention_layernorm = RMSNorm(d, eps, dtype=dtype)
        if i in cfg.moe_layers:
            self.feed_forward = Llama4TextMoe(cfg, dtype)
        else:
            self.feed_forward = GatedMLP(d, cfg.intermediate_size_mlp, dtype=dtype)

    def __call__(self, x: jax.Array, rope, meta: AttentionMetadata, kv: dict) -> tuple[jax.Array, dict]:
        h, kv = self.self_attn(self.input_layernorm(x), rope, meta, kv)
        x = x + h
        return x + self.feed_forward(self.post_attention_layernorm(x)), kv


class Llama4TextModel(Decoder):
    """The decoder (see the module docstring)."""

    def __init__(self, cfg: Llama4TextConfig, dtype=jnp.float32):
        self.config = cfg
        self.hidden_size, self.vocab_size, self.num_layers = cfg.hidden_size, cfg.vocab_size, cfg.num_layers
        self.max_position_embeddings = cfg.max_position_embeddings
        self.embed_tokens = Embed(cfg.vocab_size, cfg.hidden_size, dtype=dtype)
        self.layers = nnx.List([Llama4DecoderLayer(cfg, i, dtype) for i in range(cfg.num_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, dtype=dtype, axes=("embed", "vocab"))

    def check_tensor_parallel(self, tp: int) -> None:
        cfg = self.config
        check_divisible(self.layers[0].self_attn.qkv_proj.parts, tp)
        for width, name in ((cfg.intermediate_size, "intermediate_size"),
                            (cfg.intermediate_size_mlp, "intermediate_size_mlp")):
            if width % tp:
                raise UnsupportedModelError(f"tensor_parallel={tp} does not divide {name}={width}",
                                            param="tensor_parallel")

    def rope(self, positions: jax.Array) -> dict:
        """{"rope": (cos, sin) [b, t, hd / 2] of the pairwise rotation, "temp": the NoPE layers' q
        scale [b, t] float32}."""
        cfg = self.config
        pos = positions[0].astype(jnp.float32)
        inv = jnp.asarray(rope_inv_freq(cfg.rope, cfg.head_dim))
        temp = jnp.log1p(jnp.floor((pos + 1.0) / np.float32(cfg.floor_scale))) * np.float32(cfg.attn_scale) + 1.0
        return {"rope": cos_sin(pos[..., None] * inv), "temp": temp}

    def layer_rope(self, i: int, rope: dict):
        return rope["rope"] if self.config.use_rope[i] else rope["temp"]

    def hf_weights(self, w, name: str, lm_head: str | None = None) -> None:
        """`name`: the HF prefix of the Llama4TextModel ("language_model.model"); lm_head: the LM
        head's tensor name (a tied config without one in the file reads the embedding)."""
        from mmjax.models.nn.weights import load_module
        cfg = self.config
        self.embed_tokens.hf_weights(w, f"{name}.embed_tokens")
        for i, layer in enumerate(self.layers):
            load_module(layer, w, f"{name}.layers.{i}")
        self.norm.hf_weights(w, f"{name}.norm")
        load_lm_head(self.lm_head, w, lm_head, f"{name}.embed_tokens.weight", cfg.tie_word_embeddings,
                     (cfg.vocab_size, cfg.hidden_size))


def config_from_hf(cfg: dict, where: str = "text_config", **overrides) -> Llama4TextConfig:
    return Llama4TextConfig.from_hf(cfg, where, **overrides)
