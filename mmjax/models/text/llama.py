"""Llama-style decoder: Llama / Mistral / Qwen2, Qwen2-VL's M-RoPE variant, and Qwen3 / Qwen3-VL
(QK-norm, interleaved M-RoPE, DeepStack image features, sparse-MoE feed-forward layers).

Module tree (transformers' LlamaModel + lm_head): `embed_tokens`, `layers[i]` (`input_layernorm`,
`self_attn` (nn.Attention: fused `qkv_proj`, `o_proj`, Qwen3's `q_norm` / `k_norm`),
`post_attention_layernorm`, `mlp` (nn.GatedMLP: fused `gate_up_proj`, `down_proj`; or a
nn.SparseMoeBlock)), `norm`, `lm_head`.
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
from mmjax.models.nn.moe import MoeConfig, SparseMoeBlock
from mmjax.models.nn.norm import RMSNorm
from mmjax.models.nn.rope import RopeConfig, rope_cos_sin, rope_inv_freq


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

    def build(self, dtype=jnp.float32) -> "LlamaModel":
        return LlamaModel(self, dtype)



class LlamaDecoderLayer(nnx.Module):
    """Pre-norm attention and MLP blocks, each added to the residual stream."""

    def __init__(self, cfg: LlamaConfig, i: int, dtype=jnp.float32):
        d, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.input_layernorm = RMSNorm(d, eps, dtype=dtype)
        self.self_attn = Attention(layer_idx=i, hidden_size=d, num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads,
                                   head_dim=cfg.head_dim, qkv_bias=cfg.attention_bias, qk_norm="llama" if cfg.qk_norm
                                   else None, norm_eps=eps, sliding_window=cfg.sliding_window, dtype=dtype)
        self.post_attention_layernorm = RMSNorm(d, eps, dtype=dtype)
        if cfg.moe is not None and i in cfg.moe.layers:
            self.mlp = SparseMoeBlock(d, cfg.moe, dtype=dtype)
        else:
            self.mlp = GatedMLP(d, cfg.intermediate_size, bias=cfg.mlp_bias, dtype=dtype)

    def __call__(self, x: jax.Array, rope, meta: AttentionMetadata, kv: dict) -> tuple[jax.Array, dict]:
        h, kv = self.self_attn(self.input_layernorm(x), rope, meta, kv)
        x = x + h
        return x + self.mlp(self.post_attention_layernorm(x)), kv


class LlamaModel(Decoder):
    """The decoder (see the module docstring). `image_feature_layers` > 0 (Qwen3-VL's DeepStack):
    image features are [tokens, (1 + n) * hidden], the input embedding then one addition after
    each of layers 0..n-1 at image tokens."""

    def __init__(self, cfg: LlamaConfig, dtype=jnp.float32):
        self.config = cfg
        self.hidden_size, self.vocab_size, self.num_layers = cfg.hidden_size, cfg.vocab_size, cfg.num_layers
        self.max_position_embeddings = cfg.max_position_embeddings
        self.position_rows = 1 if cfg.rope.mrope_section is None else len(cfg.rope.mrope_section)
        self.image_feature_layers = cfg.image_feature_layers
        self.supports_prune = cfg.image_feature_layers == 0    # DeepStack adds after the prune point
        self.embed_tokens = Embed(cfg.vocab_size, cfg.hidden_size, dtype=dtype)
        self.layers = nnx.List([LlamaDecoderLayer(cfg, i, dtype) for i in range(cfg.num_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, dtype=dtype, axes=("embed", "vocab"))

    def check_tensor_parallel(self, tp: int) -> None:
        cfg = self.config
        check_divisible(self.layers[0].self_attn.qkv_proj.parts, tp)
        if cfg.intermediate_size % tp:
            raise UnsupportedModelError(f"tensor_parallel={tp} does not divide intermediate_size="
                                        f"{cfg.intermediate_size}", param="tensor_parallel")

    def rope(self, positions: jax.Array):
        r = self.config.rope
        inv = jnp.asarray(rope_inv_freq(r, self.config.head_dim))
        return rope_cos_sin(inv, positions, r.mrope_section, r.mrope_interleaved)

    def inputs(self, ids, image_embeds, image_mask):
        embeds, extra = super().inputs(ids, image_embeds, image_mask)
        n = self.image_feature_layers
        if not n:
            return embeds, extra
        d = self.hidden_size
        adds = image_embeds[..., d:].reshape(*image_embeds.shape[:-1], n, d)
        return embeds, {"deepstack": jnp.where(image_mask[..., None, None], adds, 0)}

    def per_token(self, embeds, deepstack=None):
        return {} if deepstack is None else {"deepstack": deepstack}     # [b, t, n, hidden]

    def after_layer(self, i, x, per_token):
        adds = per_token.get("deepstack")
        if adds is not None and i < adds.shape[2]:
            x = x + adds[:, :, i].astype(x.dtype)
        return x

    def hf_weights(self, w, name: str, lm_head: str | None = None) -> None:
        """`name`: the HF prefix of the LlamaModel ("model", "model.language_model", ...);
        lm_head: the LM head's tensor name (a tied config without one reads the embedding; a file
        that holds its own lm_head keeps it)."""
        from mmjax.models.nn.weights import load_module
        cfg = self.config
        self.embed_tokens.hf_weights(w, f"{name}.embed_tokens")
        for i, layer in enumerate(self.layers):
            load_module(layer, w, f"{name}.layers.{i}")
        self.norm.hf_weights(w, f"{name}.norm")
        load_lm_head(self.lm_head, w, lm_head, f"{name}.embed_tokens.weight", cfg.tie_word_embeddings,
                     (cfg.vocab_size, cfg.hidden_size))


def load_lm_head(head: Linear, w, name: str | None, embed_name: str, tied: bool, shape: tuple) -> None:
    """An LM head [hidden, vocab] from `name` ([vocab, hidden]), or from the embedding when the
    config ties them and the file holds no head."""
    if tied and (name is None or not w.has(name)):
        w.set(head.kernel, w.take(embed_name, shape).T, matmul=True)
    else:
        w.set(head.kernel, w.take(name, shape).T, matmul=True)


def config_from_hf(cfg: dict, where: str = "text_config", **overrides) -> LlamaConfig:
    return LlamaConfig.from_hf(cfg, where, **overrides)
