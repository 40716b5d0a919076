"""Qwen3.5's hybrid decoder (transformers Qwen3_5TextModel / Qwen3_5MoeTextModel): Gated DeltaNet
linear-attention layers (nn/gated_delta.py) and, every `full_attention_interval`-th layer (4),
gated full attention; dense SwiGLU or Qwen-MoE feed-forward layers (nn/moe.py, with the shared
expert).

Differences from Qwen3 (text/llama.py) besides the linear layers:
- full attention has an output gate: q_proj yields, per head, the query then a gate of head_dim
  each; the attention output is multiplied by sigmoid(gate) before o_proj (`GatedAttention`);
- partial rotary: RoPE turns the first head_dim * partial_rotary_factor (0.25) dims only, with
  Qwen3-VL's interleaved M-RoPE over those (mrope_section sums to that width / 2);
- every RMSNorm (layers, q/k norms, final) is zero-centred: x * (1 + weight) in float32.

The cache: full-attention layers own KV (nn/kv_cache.py), linear layers their per-slot conv and
recurrent states (`GatedDeltaNet.init_cache`), one entry per layer in layer order.
`state_layers` names the linear layers, and the engine treats their entries apart: it parks a row
between its prompt's chunks so the decode steps in between feed it nothing, and, since a
recurrent state is only valid at the exact end of the sequence that produced it (not at an
earlier position a prefix match would resume from), it snapshots them at prefill-chunk
boundaries and resumes a cached prefix only where a snapshot ends (serving/state_snapshots.py;
the full-attention layers' KV comes from the slot's row as for every decoder). FastV is off
(`supports_prune`).

Module tree (HF's, `model.language_model`): `embed_tokens`, `layers[i]` (`input_layernorm`,
`linear_attn` or `self_attn`, `post_attention_layernorm`, `mlp`), `norm`, `lm_head`.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from flax import nnx

from mmjax.errors import CheckpointError, UnsupportedModelError
from mmjax.models.hf_config import require
from mmjax.models.nn.attention import Attention
from mmjax.models.nn.decoder import Decoder
from mmjax.models.nn.gated_delta import GatedDeltaNet
from mmjax.models.nn.linear import Embed, FusedLinear, Linear, Part
from mmjax.models.nn.metadata import AttentionMetadata
from mmjax.models.nn.mlp import GatedMLP
from mmjax.models.nn.moe import MoeConfig, SparseMoeBlock
from mmjax.models.nn.norm import RMSNorm
from mmjax.models.nn.rope import RopeConfig, apply_rope, rope_cos_sin, rope_inv_freq

LINEAR, FULL = "linear_attention", "full_attention"


@dataclass(frozen=True)
class Qwen35TextConfig:
    """Qwen3_5TextConfig / Qwen3_5MoeTextConfig (transformers' defaults where a field is absent)."""
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
    rotary_dim: int
    layer_types: tuple[str, ...]
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel: int
    attention_bias: bool = False
    tie_word_embeddings: bool = False
    moe: MoeConfig | None = None

    @classmethod
    def from_hf(cls, cfg: dict, where: str = "text_config", **overrides) -> "Qwen35TextConfig":
        hidden = int(require(cfg, "hidden_size", where))
        heads = int(require(cfg, "num_attention_heads", where))
        num_layers = int(require(cfg, "num_hidden_layers", where))
        act = cfg.get("hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise UnsupportedModelError(f"config.json: {where}.hidden_act={act!r} not supported",
                                        param=f"{where}.hidden_act")
        head_dim = int(cfg.get("head_dim") or 256)
        params = {**(cfg.get("rope_scaling") or {}), **(cfg.get("rope_parameters") or {})}
        factor = float(params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 0.25)))
        rotary = int(head_dim * factor)
        rope = RopeConfig.from_hf({**cfg, "rope_parameters": params}, where)
        section = tuple(rope.mrope_section or (11, 11, 10))
        if len(section) != 3 or sum(section) != rotary // 2:
            raise CheckpointError(f"config.json: {where}.rope_parameters.mrope_section={list(section)} must be three "
                                  f"sections summing to the rotary width / 2 = {rotary // 2}",
                                  param=f"{where}.rope_parameters.mrope_section")
        rope = dataclasses.replace(rope, mrope_section=section, mrope_interleaved=True)
        types = cfg.get("layer_types")
        if types is None:
            interval = int(cfg.get("full_attention_interval", 4))
            types = [LINEAR if (i + 1) % interval else FULL for i in range(num_layers)]
        if len(types) != num_layers or set(types) - {LINEAR, FULL}:
            raise CheckpointError(f"config.json: {where}.layer_types must list {num_layers} of {LINEAR!r} / {FULL!r}",
                                  param=f"{where}.layer_types")
        moe = MoeConfig.from_hf(cfg, where, num_layers)
        if moe is not None:     # Qwen3.5-MoE's router always renormalises; every layer is sparse
            moe = dataclasses.replace(moe, norm_topk_prob=True)
        hk, hv = int(cfg.get("linear_num_key_heads", 16)), int(cfg.get("linear_num_value_heads", 32))
        if hv % hk:
            raise UnsupportedModelError(f"config.json: {where}.linear_num_value_heads={hv} is not a multiple of "
                                        f"linear_num_key_heads={hk}", param=f"{where}.linear_num_value_heads")
        parsed = dict(
            vocab_size=int(require(cfg, "vocab_size", where)), hidden_size=hidden,
            intermediate_size=int(cfg.get("intermediate_size") or 0), num_layers=num_layers, num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads), head_dim=head_dim,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 32768)), rope=rope, rotary_dim=rotary,
            layer_types=tuple(types), linear_num_key_heads=hk, linear_num_value_heads=hv,
            linear_key_head_dim=int(cfg.get("linear_key_head_dim", 128)),
            linear_value_head_dim=int(cfg.get("linear_value_head_dim", 128)),
            linear_conv_kernel=int(cfg.get("linear_conv_kernel_dim", 4)),
            attention_bias=bool(cfg.get("attention_bias", False)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)), moe=moe)
        return cls(**{**parsed, **overrides})

    def build(self, dtype=jnp.float32) -> "Qwen35TextModel":
        return Qwen35TextModel(self, dtype)


def config_from_hf(cfg: dict, where: str = "text_config", **overrides) -> Qwen35TextConfig:
    return Qwen35TextConfig.from_hf(cfg, where, **overrides)


def partial_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """RoPE on the first cos.shape[-1] dims of x [b, t, heads, hd]; the rest pass through."""
    r = cos.shape[-1]
    if r == x.shape[-1]:
        return apply_rope(x, cos, sin)
    return jnp.concatenate([apply_rope(x[..., :r], cos, sin), x[..., r:]], axis=-1)


class GatedAttention(Attention):
    """Qwen3-Next / Qwen3.5 full attention: `qkv_proj` fuses q_proj (per head: query then gate,
    2 * head_dim), k_proj, v_proj; zero-centred q/k norms; partial RoPE; out * sigmoid(gate)."""

    def __init__(self, *, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int, bias: bool,
                 dtype=jnp.float32, **kw):
        super().__init__(hidden_size=hidden_size, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                         qkv_bias=bias, o_bias=bias, qk_norm="gemma", dtype=dtype, **kw)
        self.qkv_proj = FusedLinear(hidden_size, (Part("q_proj", num_heads * 2 * head_dim, "heads", 2 * head_dim),
                                                  Part("k_proj", num_kv_heads * head_dim, "kv_heads", head_dim),
                                                  Part("v_proj", num_kv_heads * head_dim, "kv_heads", head_dim)),
                                    bias=bias, dtype=dtype)

    def __call__(self, x: jax.Array, rope: tuple, meta: AttentionMetadata, kv: dict) -> tuple[jax.Array, dict]:
        b, t, _ = x.shape
        hd = self.head_dim
        qg, k, v = self.qkv_proj(x)
        qg = qg.reshape(b, t, -1, 2 * hd)
        q, gate = qg[..., :hd], qg[..., hd:].reshape(b, t, -1)
        q, k, v = self.q_norm(q), self.k_norm(k.reshape(b, t, -1, hd)), v.reshape(b, t, -1, hd)
        cos, sin = rope
        q, k = partial_rope(q, cos, sin), partial_rope(k, cos, sin)
        out, kv = self.attend(q, k, v, meta.layer(self.layer_idx), kv)
        out = out.reshape(b, t, -1) * jax.nn.sigmoid(gate.astype(jnp.float32)).astype(out.dtype)
        return self.o_proj(out), kv


class Qwen35DecoderLayer(nnx.Module):
    def __init__(self, cfg: Qwen35TextConfig, i: int, dtype=jnp.float32):
        d, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.kind = cfg.layer_types[i]
        self.input_layernorm = RMSNorm(d, eps, kind="gemma", dtype=dtype)
        if self.kind == LINEAR:
            self.linear_attn = GatedDeltaNet(hidden_size=d, num_k_heads=cfg.linear_num_key_heads,
                                             num_v_heads=cfg.linear_num_value_heads, k_dim=cfg.linear_key_head_dim,
                                             v_dim=cfg.linear_value_head_dim, conv_kernel=cfg.linear_conv_kernel,
                                             eps=eps, dtype=dtype)
        else:
            self.self_attn = GatedAttention(layer_idx=i, hidden_size=d, num_heads=cfg.num_heads,
                                            num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
                                            bias=cfg.attention_bias, norm_eps=eps, dtype=dtype)
        self.post_attention_layernorm = RMSNorm(d, eps, kind="gemma", dtype=dtype)
        if cfg.moe is not None and i in cfg.moe.layers:
            self.mlp = SparseMoeBlock(d, cfg.moe, dtype=dtype)
        else:
            self.mlp = GatedMLP(d, cfg.intermediate_size, dtype=dtype)

    def init_cache(self, num_slots: int, max_len: int, dtype, *, max_chunk: int | None = None, tp: int = 1):
        if self.kind == FULL:
            return self.self_attn.init_cache(num_slots, max_len, dtype, max_chunk=max_chunk, tp=tp)
        # the conv window in the activations' dtype (an 8-bit KV dtype does not apply to it)
        conv = dtype if jnp.issubdtype(dtype, jnp.floating) and jnp.dtype(dtype).itemsize >= 2 else jnp.float32
        return self.linear_attn.init_cache(num_slots, conv)

    def __call__(self, x: jax.Array, rope, meta: AttentionMetadata, cache: dict) -> tuple[jax.Array, dict]:
        h = self.input_layernorm(x)
        if self.kind == LINEAR:
            h, cache = self.linear_attn(h, meta, cache)
        else:
            h, cache = self.self_attn(h, rope, meta, cache)
        x = x + h
        return x + self.mlp(self.post_attention_layernorm(x)), cache


class Qwen35TextModel(Decoder):
    """The hybrid decoder (module docstring); M-RoPE positions (3 rows)."""
    supports_prune = False

    def __init__(self, cfg: Qwen35TextConfig, dtype=jnp.float32):
        self.config = cfg
        self.hidden_size, self.vocab_size, self.num_layers = cfg.hidden_size, cfg.vocab_size, cfg.num_layers
        self.max_position_embeddings = cfg.max_position_embeddings
        self.position_rows = 3
        self.embed_tokens = Embed(cfg.vocab_size, cfg.hidden_size, dtype=dtype)
        self.layers = nnx.List([Qwen35DecoderLayer(cfg, i, dtype) for i in range(cfg.num_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, kind="gemma", dtype=dtype)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, dtype=dtype, axes=("embed", "vocab"))

    @property
    def state_layers(self) -> tuple[int, ...]:
        """The Gated DeltaNet layers (their cache entry is a per-slot recurrent state, not KV)."""
        return tuple(i for i, k in enumerate(self.config.layer_types) if k == LINEAR)

    def init_cache(self, num_slots: int, max_len: int, dtype, *, max_chunk: int | None = None, tp: int = 1,
                   pages: tuple[int, int] | None = None):
        """A row per slot: recurrent states are per sequence and the decoder does not page
        (`pages_kv`), so `pages` is always None here."""
        assert pages is None, "a hybrid recurrent decoder keeps a row per slot"
        return [layer.init_cache(num_slots, max_len, dtype, max_chunk=max_chunk, tp=tp) for layer in self.layers]

    @property
    def pages_kv(self) -> bool:
        """Not paged: the recurrent states are a row per slot anyway, and prefixes resume through
        the slot's row and a state snapshot (serving/state_snapshots.py), not shared pages."""
        return False

    def rope(self, positions: jax.Array):
        r = self.config.rope
        inv = jnp.asarray(rope_inv_freq(r, self.config.rotary_dim))
        return rope_cos_sin(inv, positions, r.mrope_section, r.mrope_interleaved)

    def hf_weights(self, w, name: str, lm_head: str | None = None) -> None:
        from mmjax.models.nn.weights import load_module
        from mmjax.models.text.llama import load_lm_head
        cfg = self.config
        self.embed_tokens.hf_weights(w, f"{name}.embed_tokens")
        for i, layer in enumerate(self.layers):
            for n in ("input_layernorm", "post_attention_layernorm", "mlp"):
                load_module(getattr(layer, n), w, f"{name}.layers.{i}.{n}")
            if layer.kind == LINEAR:
                layer.linear_attn.hf_weights(w, f"{name}.layers.{i}.linear_attn")
            else:
                layer.self_attn.hf_weights(w, f"{name}.layers.{i}.self_attn")
        self.norm.hf_weights(w, f"{name}.norm")
        load_lm_head(self.lm_head, w, lm_head, f"{name}.embed_tokens.weight", cfg.tie_word_embeddings,
                     (cfg.vocab_size, cfg.hidden_size))
