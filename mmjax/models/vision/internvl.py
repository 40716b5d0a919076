"""InternViT (transformers' InternVLVisionModel): a ViT with a class token and learned absolute
positions whose blocks scale each residual branch by a learned per-channel `lambda_1` / `lambda_2`
(layer scale), with LayerNorm or RMSNorm (`norm_type`) and optional RMSNorm over q and k
(`use_qk_norm`, the 6B tower).

Module tree (HF names): `embeddings.{cls_token, patch_embeddings.projection, position_embeddings}`,
`encoder.layer[i].{layernorm_before, attention.{q_proj, k_proj, v_proj, q_norm, k_norm,
projection_layer}, lambda_1, layernorm_after, mlp.{fc1, fc2}, lambda_2}`, `layernorm` (only without
mean pooling; HF's `last_hidden_state` passes through it).

Tiles are always the tower's `image_size` square (the processors resize to it), so the position
table is used as is (HF interpolates it only for other sizes).
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from flax import nnx

from mmjax.attention import attention
from mmjax.errors import UnsupportedModelError
from mmjax.models.hf_config import require
from mmjax.models.nn.linear import Linear, activation, param
from mmjax.models.nn.mlp import MLP
from mmjax.models.nn.norm import LayerNorm, RMSNorm
from mmjax.models.nn.weights import ignore_tail, load_children
from mmjax.models.vision.clip import patchify


def _side(value, where: str, key: str) -> int:
    """image_size / patch_size: an int or a square [h, w]."""
    if isinstance(value, (list, tuple)):
        if len(value) != 2 or value[0] != value[1]:
            raise UnsupportedModelError(f"config.json: {where}.{key}={value!r}: only square sizes are supported",
                                        param=f"{where}.{key}")
        value = value[0]
    return int(value)


@dataclass(frozen=True)
class InternVisionConfig:
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    image_size: int
    patch_size: int
    layer_norm_eps: float = 1e-6
    hidden_act: str = "gelu"
    norm_type: str = "layer_norm"         # or "rms_norm"
    qk_norm: bool = False
    attention_bias: bool = False
    use_mean_pooling: bool = True         # False: a final `layernorm` after the blocks
    absolute_positions: bool = True
    num_channels: int = 3

    @classmethod
    def from_hf(cls, cfg: dict, where: str = "vision_config") -> "InternVisionConfig":
        norm = cfg.get("norm_type", "layer_norm")
        if norm not in ("layer_norm", "rms_norm"):
            raise UnsupportedModelError(f"config.json: {where}.norm_type={norm!r} is not supported",
                                        param=f"{where}.norm_type")
        act = cfg.get("hidden_act", "gelu")
        activation(act)
        out = cls(hidden_size=int(require(cfg, "hidden_size", where, 1024)),
                  intermediate_size=int(require(cfg, "intermediate_size", where, 4096)),
                  num_layers=int(require(cfg, "num_hidden_layers", where, 24)),
                  num_heads=int(require(cfg, "num_attention_heads", where, 16)),
                  image_size=_side(cfg.get("image_size", 448), where, "image_size"),
                  patch_size=_side(cfg.get("patch_size", 14), where, "patch_size"),
                  layer_norm_eps=float(cfg.get("layer_norm_eps", 1e-6)), hidden_act=act, norm_type=norm,
                  qk_norm=bool(cfg.get("use_qk_norm", False)), attention_bias=bool(cfg.get("attention_bias", False)),
                  use_mean_pooling=bool(cfg.get("use_mean_pooling", True)),
                  absolute_positions=bool(cfg.get("use_absolute_position_embeddings", True)),
                  num_channels=int(cfg.get("num_channels", 3)))
        if out.hidden_size % out.num_heads or out.image_size % out.patch_size:
            raise UnsupportedModelError(f"config.json: {where}: hidden_size {out.hidden_size} / heads {out.num_heads} "
                                        f"or image_size {out.image_size} / patch_size {out.patch_size} do not divide",
                                        param=f"{where}.num_attention_heads")
        return out

    @property
    def patches_per_side(self) -> int:
        return self.image_size // self.patch_size


def _norm(cfg: InternVisionConfig, dtype):
    if cfg.norm_type == "rms_norm":
        return RMSNorm(cfg.hidden_size, cfg.layer_norm_eps, dtype=dtype)
    return LayerNorm(cfg.hidden_size, cfg.layer_norm_eps, dtype=dtype)


class InternVisionPatchEmbeddings(nnx.Module):
    """`projection`: the stride-p conv as a [p*p*c, d] matmul over patches flattened (ph, pw, c)."""

    def __init__(self, cfg: InternVisionConfig, dtype=jnp.float32):
        self.cfg = cfg
        p, c, d = cfg.patch_size, cfg.num_channels, cfg.hidden_size
        self.projection = Linear(p * p * c, d, bias=True, dtype=dtype, quantize=False)

    def __call__(self, pixels: jax.Array) -> jax.Array:
        """[b, H, W, c] -> [b, patches, d] (row-major over the patch grid)."""
        w = self.projection.kernel.get_value()
        return self.projection(patchify(pixels.astype(w.dtype), self.cfg.patch_size))

    def hf_weights(self, w, name: str) -> None:
        d, p, c = self.cfg.hidden_size, self.cfg.patch_size, self.cfg.num_channels
        conv = w.take(f"{name}.projection.weight", (d, c, p, p))
        w.set(self.projection.kernel, conv.transpose(2, 3, 1, 0).reshape(p * p * c, d), matmul=True)
        w.set(self.projection.bias, w.take(f"{name}.projection.bias", (d,)))


class InternVisionEmbeddings(nnx.Module):
    """cls_token [1, 1, d], patch_embeddings, position_embeddings [1, patches + 1, d]."""

    def __init__(self, cfg: InternVisionConfig, dtype=jnp.float32):
        self.cfg = cfg
        d, n = cfg.hidden_size, cfg.patches_per_side ** 2
        self.cls_token = param((1, 1, d), dtype, (None, None, None))
        self.patch_embeddings = InternVisionPatchEmbeddings(cfg, dtype)
        self.position_embeddings = param((1, n + 1, d), dtype, (None, None, None)) if cfg.absolute_positions else None

    def __call__(self, pixels: jax.Array) -> jax.Array:
        x = self.patch_embeddings(pixels)
        cls = jnp.broadcast_to(self.cls_token.get_value(), (x.shape[0], 1, x.shape[-1])).astype(x.dtype)
        x = jnp.concatenate([cls, x], axis=1)
        if self.position_embeddings is not None:
            x = x + self.position_embeddings.get_value()
        return x

    def hf_weights(self, w, name: str) -> None:
        d, n = self.cfg.hidden_size, self.cfg.patches_per_side ** 2
        w.set(self.cls_token, w.take(f"{name}.cls_token", (1, 1, d)))
        self.patch_embeddings.hf_weights(w, f"{name}.patch_embeddings")
        if self.position_embeddings is not None:
            w.set(self.position_embeddings, w.take(f"{name}.position_embeddings", (1, n + 1, d)))
        w.ignore(re.escape(name) + r"\.mask_token")


class InternVisionAttention(nnx.Module):
    """q_proj, k_proj, v_proj (biases with attention_bias), q_norm / k_norm (RMSNorm over the whole
    width, eps 1e-6, with use_qk_norm), projection_layer (always biased)."""

    def __init__(self, cfg: InternVisionConfig, dtype=jnp.float32):
        d, b = cfg.hidden_size, cfg.attention_bias
        self.heads = cfg.num_heads
        self.q_proj = Linear(d, d, bias=b, dtype=dtype, axes=("embed", "vision_heads"))
        self.k_proj = Linear(d, d, bias=b, dtype=dtype, axes=("embed", "vision_heads"))
        self.v_proj = Linear(d, d, bias=b, dtype=dtype, axes=("embed", "vision_heads"))
        # the norms span all heads: they stay whole (replicated) under vision tensor parallelism
        self.q_norm = RMSNorm(d, 1e-6, dtype=dtype) if cfg.qk_norm else None
        self.k_norm = RMSNorm(d, 1e-6, dtype=dtype) if cfg.qk_norm else None
        self.projection_layer = Linear(d, d, bias=True, dtype=dtype, axes=("vision_heads", "embed"))

    def __call__(self, x: jax.Array) -> jax.Array:
        """x [b, s, d] -> [b, s, d], bidirectional."""
        b, s, d = x.shape
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        hd = d // self.heads
        q, k, v = (t.reshape(b, s, self.heads, hd) for t in (q, k, v))
        return self.projection_layer(attention(q, k, v).reshape(b, s, d))


class InternVisionLayer(nnx.Module):
    """x + lambda_1 * attention(layernorm_before(x)), then + lambda_2 * mlp(layernorm_after(x))."""

    def __init__(self, cfg: InternVisionConfig, dtype=jnp.float32):
        d = cfg.hidden_size
        self.layernorm_before = _norm(cfg, dtype)
        self.attention = InternVisionAttention(cfg, dtype)
        self.lambda_1 = param((d,), dtype, (None,))
        self.layernorm_after = _norm(cfg, dtype)
        self.mlp = MLP(d, cfg.intermediate_size, d, act=cfg.hidden_act, dtype=dtype,
                       axes=("embed", "vision_mlp", "embed"))
        self.lambda_2 = param((d,), dtype, (None,))
        self.d = d

    def __call__(self, x: jax.Array) -> jax.Array:
        x = x + self.lambda_1.get_value() * self.attention(self.layernorm_before(x))
        return x + self.lambda_2.get_value() * self.mlp(self.layernorm_after(x))

    def hf_weights(self, w, name: str) -> None:
        for child in ("layernorm_before", "layernorm_after", "mlp"):
            getattr(self, child).hf_weights(w, f"{name}.{child}")
        load_children(self.attention, w, f"{name}.attention")
        w.set(self.lambda_1, w.take(f"{name}.lambda_1", (self.d,)))
        w.set(self.lambda_2, w.take(f"{name}.lambda_2", (self.d,)))


class InternVisionEncoder(nnx.Module):
    def __init__(self, cfg: InternVisionConfig, num_layers: int, dtype=jnp.float32):
        self.layer = nnx.List([InternVisionLayer(cfg, dtype) for _ in range(num_layers)])


class InternVisionModel(nnx.Module):
    """InternVLVisionModel read at one depth: `feature_layer` is an index into HF's hidden states
    (0: the embeddings, i: after block i); None: `last_hidden_state` (every block, then the final
    `layernorm` when the config has one). Blocks past the feature layer are not built."""

    def __init__(self, cfg: InternVisionConfig, feature_layer: int | None = None, dtype=jnp.float32):
        self.config = cfg
        last = feature_layer is None
        self.embeddings = InternVisionEmbeddings(cfg, dtype)
        self.encoder = InternVisionEncoder(cfg, cfg.num_layers if last else feature_layer, dtype)
        self.layernorm = LayerNorm(cfg.hidden_size, cfg.layer_norm_eps, dtype=dtype) \
            if last and not cfg.use_mean_pooling else None

    def __call__(self, pixels: jax.Array) -> jax.Array:
        """pixels [b, H, W, 3] -> [b, 1 + patches, d] (class token first)."""
        x = self.embeddings(pixels)
        for layer in self.encoder.layer:
            x = layer(x)
        return x if self.layernorm is None else self.layernorm(x)

    def hf_weights(self, w, name: str) -> None:
        self.embeddings.hf_weights(w, f"{name}.embeddings")
        for i, layer in enumerate(self.encoder.layer):
            layer.hf_weights(w, f"{name}.encoder.layer.{i}")
        ignore_tail(w, f"{name}.encoder", len(self.encoder.layer), what="layer")
        if self.layernorm is not None:
            self.layernorm.hf_weights(w, f"{name}.layernorm")
        else:
            w.ignore(re.escape(name) + r"\.layernorm\..*")
