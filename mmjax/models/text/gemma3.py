"""Gemma 3 decoder (`gemma3_text`): the language model of Gemma3ForConditionalGeneration.

Module tree (transformers' Gemma3TextModel + lm_head): `embed_tokens`, `layers[i]`
(`input_layernorm`, `self_attn` (nn.Attention: fused `qkv_proj`, `o_proj`, `q_norm`, `k_norm`),
`post_attention_layernorm`, `pre_feedforward_layernorm`, `mlp` (nn.GatedMLP: fused
`gate_up_proj`, `down_proj`), `post_feedforward_layernorm`), `norm`, `lm_head`.

Differences from Llama: (1 + w) RMSNorm computed in float32 (`RMSNorm(kind="gemma")`, the
per-head QK-norms too), sandwich norms around attention and MLP, embeddings scaled by
sqrt(hidden) (in the weights' dtype, as HF does), GELU-tanh MLP, scores scaled by
query_pre_attn_scalar ** -0.5, and per-layer `layer_types`: sliding-window layers with their own
RoPE (local theta) and full-attention layers (global theta + scaling).

KV cache, one entry per layer (nn/kv_cache.py):
- full-attention layers: the segmented slot cache over max_len;
- sliding layers: a ring of R = window + max_chunk - 1 positions (`nn.Attention(ring=True)`:
  cache index i lives at i mod R), so a call writing max_chunk tokens still leaves every query
  its full window: memory O(window), not O(max_len). Padded tail tokens of a bucketed chunk and
  tokens at cache index >= kv_len (the decode rows of free slots, parked at max_model_len) are
  not written, so a retained row keeps exactly its last R positions and can resume from any
  prefix within max_chunk of its end (`min_resume`).
- paged (serving/pages.py, `page_size`): every layer is a page pool read through the step's page
  table; sliding layers read their row's pages under the window mask, as Gemma 4's do (memory
  grows with the tokens held, not O(window): the pages below the window are not recycled yet).

Masks (transformers' Gemma 3 vision masks): full layers see causal OR same-image-run keys;
sliding layers see (causal OR same run) AND inside the window (kv > q - window), so an image's
tokens see their later image tokens both ways but old ones only within the window.

Tensor parallelism: the fused q|k|v and gate|up name their parts, so their per-shard layout
follows (nn/linear.py); with fewer KV heads than shards both cache kinds hold tp KV heads
(`cache_kv_heads`); QK-norm is per head, so local to a shard.

transformers 5.23's Gemma3ForConditionalGeneration applies neither `final_logit_softcapping` nor
`attn_logit_softcapping` (Gemma3Attention never passes softcap to its attention function, and
only Gemma3ForCausalLM caps logits); both are implemented here and the family decides
(`Gemma3TextConfig.final_logit_softcapping` / `attn_logit_softcapping`).
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
from mmjax.models.nn.kv_cache import softcap
from mmjax.models.nn.linear import Embed, Linear, activation, check_divisible
from mmjax.models.nn.metadata import AttentionMetadata
from mmjax.models.nn.mlp import GatedMLP
from mmjax.models.nn.norm import RMSNorm
from mmjax.models.nn.rope import RopeConfig, rope_cos_sin, rope_inv_freq

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

    def build(self, dtype=jnp.float32) -> "Gemma3TextModel":
        return Gemma3TextModel(self, dtype)


class Gemma3DecoderLayer(nnx.Module):
    """Sandwich-normed attention and MLP blocks: x + post_norm(block(pre_norm(x)))."""

    def __init__(self, cfg: Gemma3TextConfig, i: int, dtype=jnp.float32):
        d, eps = cfg.hidden_size, cfg.rms_norm_eps
        sliding = cfg.layer_types[i] == SLIDING
        self.input_layernorm = RMSNorm(d, eps, kind="gemma", dtype=dtype)
        self.self_attn = Attention(layer_idx=i, hidden_size=d, num_heads=cfg.num_heads,
                                   num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, qkv_bias=cfg.attention_bias,
                                   o_bias=cfg.attention_bias, qk_norm="gemma", norm_eps=eps, scale=cfg.scale,
                                   softcap=cfg.attn_logit_softcapping,
                                   sliding_window=cfg.sliding_window if sliding else None, ring=sliding,
                                   window_over_spans=sliding, dtype=dtype)
        self.post_attention_layernorm = RMSNorm(d, eps, kind="gemma", dtype=dtype)
        self.pre_feedforward_layernorm = RMSNorm(d, eps, kind="gemma", dtype=dtype)
        self.mlp = GatedMLP(d, cfg.intermediate_size, act=cfg.hidden_act, dtype=dtype)
        self.post_feedforward_layernorm = RMSNorm(d, eps, kind="gemma", dtype=dtype)

    def __call__(self, x: jax.Array, rope, meta: AttentionMetadata, kv: dict) -> tuple[jax.Array, dict]:
        h, kv = self.self_attn(self.input_layernorm(x), rope, meta, kv)
        x = x + self.post_attention_layernorm(h)
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x))), kv


class Gemma3TextModel(Decoder):
    """The decoder (see the module docstring)."""

    def __init__(self, cfg: Gemma3TextConfig, dtype=jnp.float32):
        self.config = cfg
        self.hidden_size, self.vocab_size, self.num_layers = cfg.hidden_size, cfg.vocab_size, cfg.num_layers
        self.max_position_embeddings = cfg.max_position_embeddings
        self.embed_tokens = Embed(cfg.vocab_size, cfg.hidden_size, dtype=dtype)
        self.layers = nnx.List([Gemma3DecoderLayer(cfg, i, dtype) for i in range(cfg.num_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, kind="gemma", dtype=dtype)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, dtype=dtype, axes=("embed", "vocab"))

    def check_tensor_parallel(self, tp: int) -> None:
        cfg = self.config
        check_divisible(self.layers[0].self_attn.qkv_proj.parts, tp)
        if cfg.intermediate_size % tp:
            raise UnsupportedModelError(f"tensor_parallel={tp} does not divide intermediate_size="
                                        f"{cfg.intermediate_size}", param="tensor_parallel")

    def embed(self, ids: jax.Array) -> jax.Array:
        """Token embeddings scaled by sqrt(hidden) in the embedding's dtype (HF's
        Gemma3TextScaledWordEmbedding); image features enter unscaled."""
        e = self.embed_tokens(ids)
        return e * jnp.asarray(np.sqrt(self.hidden_size), e.dtype)

    def rope(self, positions: jax.Array) -> dict:
        """{layer type: (cos, sin)}: local RoPE for sliding layers, global for full ones."""
        cfg = self.config
        return {kind: rope_cos_sin(jnp.asarray(rope_inv_freq(r, cfg.head_dim)), positions)
                for kind, r in ((SLIDING, cfg.rope_local), (FULL, cfg.rope_global))}

    def layer_rope(self, i: int, rope: dict):
        return rope[self.config.layer_types[i]]

    @property
    def pages_by_default(self) -> bool:
        """Slot rows unless asked: the sliding layers' ring is window-sized, their pages are not
        recycled below the window yet (`Decoder.pages_by_default`)."""
        return False

    def min_resume(self, held_len: int, max_chunk: int) -> int:
        """A row holding `held_len` positions of a cache built for `max_chunk` keeps, in each ring,
        the window before any prefix p >= held_len - max_chunk (later writes reach back at most
        ring - window + 1 slots)."""
        if SLIDING in self.config.layer_types:
            return max(0, held_len - max_chunk)
        return 0

    def logits(self, hidden: jax.Array) -> jax.Array:
        return softcap(super().logits(hidden), self.config.final_logit_softcapping)

    def hf_weights(self, w, name: str, lm_head: str | None = None) -> None:
        """`name`: the HF prefix of the Gemma3TextModel ("language_model.model", "model", ...);
        lm_head: the LM head's tensor name (a tied config without one in the file reads the
        embedding, as transformers saves tied checkpoints)."""
        from mmjax.models.nn.weights import load_module
        cfg = self.config
        self.embed_tokens.hf_weights(w, f"{name}.embed_tokens")
        for i, layer in enumerate(self.layers):
            load_module(layer, w, f"{name}.layers.{i}")
        self.norm.hf_weights(w, f"{name}.norm")
        shape = (cfg.vocab_size, cfg.hidden_size)
        tied = cfg.tie_word_embeddings and (lm_head is None or not w.has(lm_head))
        w.set(self.lm_head.kernel, w.take(f"{name}.embed_tokens.weight" if tied else lm_head, shape).T, matmul=True)


def config_from_hf(cfg: dict, where: str = "text_config", **overrides) -> Gemma3TextConfig:
    return Gemma3TextConfig.from_hf(cfg, where, **overrides)
