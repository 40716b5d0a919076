"""The MiniCPM-V 4.6 / 4.7 vision side as NNX modules, and its host-side packing.

transformers' MiniCPMV4_6VisionModel + MiniCPMV4_6Merger: a SigLIP-style NaViT (stride-p patch
embedding, a learned position table indexed by nearest-bucket ids, pre-LN blocks with full
attention inside each view), the window-attention merger after block `insert_layer_id` (each
2x2 window of patches attends to itself, then its four patches, concatenated, go through an MLP
onto one token, plus their mean), the remaining blocks on the merged grid, `post_layernorm`,
then the merger (2x2 neighbours concatenated, LayerNorm, Linear-GELU-Linear into the LLM width).
In "4x" mode the window merger is skipped.

Module tree (HF names): `vision_tower.{embeddings.{patch_embedding, position_embedding},
encoder.layers[i].{layer_norm1, self_attn.{q,k,v,out}_proj, layer_norm2, mlp.{fc1, fc2}},
vit_merger.{layer_norm1, self_attn, pre_norm, linear_1, linear_2}, post_layernorm}`,
`merger.mlp.0.{pre_norm, linear_1, linear_2}`.

Packing (the family's encode_plan): the views of one encode call (each image's source view and slices) are ONE padded
sequence of patches with one attention segment per view (-1: padding). Each view's patches are
laid out on the host in merge-block order (for every merger output token, its 2x2 windows, for
every window its 2x2 patches), so the window merger's windows are consecutive runs of 4, its
outputs come out with every merger block's 4 tokens consecutive, and the merger's output is each
view's tokens in row-major order: the tower needs no gather. Attention inside a view does not
depend on the order of its tokens (the position ids travel with the patches).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from mmjax.errors import UnsupportedModelError
from mmjax.models.hf_config import require
from mmjax.models.nn.attention import VisionAttention
from mmjax.models.nn.linear import Linear, activation, param
from mmjax.models.nn.mlp import MLP
from mmjax.models.nn.norm import LayerNorm
from mmjax.models.nn.weights import load_children


@dataclass(frozen=True)
class MiniCPMVVisionConfig:
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    image_size: int
    patch_size: int
    insert_layer_id: int
    out_hidden_size: int            # the LLM width (the merger's output)
    use_vit_merger: bool = True     # False: downsample_mode "4x"
    layer_norm_eps: float = 1e-6
    hidden_act: str = "gelu_pytorch_tanh"
    num_channels: int = 3

    @classmethod
    def from_hf(cls, cfg: dict, out_hidden_size: int) -> "MiniCPMVVisionConfig":
        """The top-level config.json (vision_config, insert_layer_id, downsample_mode, the merge
        kernels) -> MiniCPMVVisionConfig; shapes transformers does not build are refused."""
        v = require(cfg, "vision_config", "config")
        for key in ("merge_kernel_size",):
            if list(cfg.get(key, [2, 2])) != [2, 2]:
                raise UnsupportedModelError(f"config.json: {key}={cfg[key]} (only [2, 2] is supported)", param=key)
        if list(v.get("window_kernel_size", [2, 2])) != [2, 2]:
            raise UnsupportedModelError("config.json: vision_config.window_kernel_size must be [2, 2]",
                                        param="vision_config.window_kernel_size")
        if int(cfg.get("merger_times", 1)) != 1:
            raise UnsupportedModelError(f"config.json: merger_times={cfg['merger_times']} (only 1 is supported)",
                                        param="merger_times")
        mode = str(cfg.get("downsample_mode", "16x"))
        if mode not in ("16x", "4x"):
            raise UnsupportedModelError(f"config.json: downsample_mode={mode!r}", param="downsample_mode")
        size, patch = v.get("image_size", 224), v.get("patch_size", 16)
        if isinstance(size, (list, tuple)) or isinstance(patch, (list, tuple)):
            raise UnsupportedModelError("config.json: vision_config: non-square image_size / patch_size",
                                        param="vision_config.image_size")
        act = v.get("hidden_act", "gelu_pytorch_tanh")
        activation(act)
        n = int(v.get("num_hidden_layers", 12))
        insert = int(cfg.get("insert_layer_id", v.get("insert_layer_id", 6)))
        use_merger = mode != "4x" and insert >= 0
        if use_merger and insert >= n:
            raise UnsupportedModelError(f"config.json: insert_layer_id={insert} >= {n} vision layers",
                                        param="insert_layer_id")
        return cls(hidden_size=int(v.get("hidden_size", 768)), intermediate_size=int(v.get("intermediate_size", 3072)),
                   num_layers=n, num_heads=int(v.get("num_attention_heads", 12)), image_size=int(size),
                   patch_size=int(patch), insert_layer_id=insert, out_hidden_size=int(out_hidden_size),
                   use_vit_merger=use_merger, layer_norm_eps=float(v.get("layer_norm_eps", 1e-6)),
                   hidden_act=act, num_channels=int(v.get("num_channels", 3)))

    @property
    def patches_per_side(self) -> int:
        return self.image_size // self.patch_size

    @property
    def patch_dim(self) -> int:
        return self.patch_size ** 2 * self.num_channels

    @property
    def merge(self) -> int:
        """Patches per LLM token along each side: 4 with the window merger, 2 without."""
        return 4 if self.use_vit_merger else 2


class MiniCPMVEmbeddings(nnx.Module):
    """patch_embedding (the stride-p conv as a [p*p*c, d] matmul on patches flattened (ph, pw,
    c)) plus position_embedding rows picked by the host's nearest-bucket ids."""

    def __init__(self, cfg: MiniCPMVVisionConfig, dtype=jnp.float32):
        self.cfg = cfg
        self.patch_embedding = Linear(cfg.patch_dim, cfg.hidden_size, bias=True, dtype=dtype, quantize=False)
        self.position_embedding = param((cfg.patches_per_side ** 2, cfg.hidden_size), dtype, (None, None))

    def __call__(self, patches: jax.Array, pos_ids: jax.Array) -> jax.Array:
        """patches [N, p*p*c], pos_ids [N] -> [N, d]."""
        table = self.position_embedding.get_value()
        return self.patch_embedding(patches.astype(table.dtype)) + table[pos_ids]

    def hf_weights(self, w, name: str) -> None:
        d, p, c = self.cfg.hidden_size, self.cfg.patch_size, self.cfg.num_channels
        conv = w.take(f"{name}.patch_embedding.weight", (d, c, p, p))
        w.set(self.patch_embedding.kernel, conv.transpose(2, 3, 1, 0).reshape(p * p * c, d), matmul=True)
        w.set(self.patch_embedding.bias, w.take(f"{name}.patch_embedding.bias", (d,)))
        w.set(self.position_embedding, w.take(f"{name}.position_embedding.weight",
                                              (self.cfg.patches_per_side ** 2, d)))


class MiniCPMVEncoderLayer(nnx.Module):
    """One pre-LN block (layer_norm1, self_attn, layer_norm2, mlp), attention inside each view."""

    def __init__(self, cfg: MiniCPMVVisionConfig, dtype=jnp.float32):
        d = cfg.hidden_size
        self.layer_norm1 = LayerNorm(d, cfg.layer_norm_eps, dtype=dtype)
        self.self_attn = VisionAttention(d, cfg.num_heads, dtype=dtype)
        self.layer_norm2 = LayerNorm(d, cfg.layer_norm_eps, dtype=dtype)
        self.mlp = MLP(d, cfg.intermediate_size, d, act=cfg.hidden_act, dtype=dtype,
                       axes=("embed", "vision_mlp", "embed"))

    def __call__(self, x: jax.Array, segment_ids: jax.Array) -> jax.Array:
        """x [N, d], segment_ids [N] (-1: padding) -> [N, d]."""
        x = x + self.self_attn(self.layer_norm1(x)[None], segment_ids=segment_ids[None])[0]
        return x + self.mlp(self.layer_norm2(x))


class WindowAttentionMerger(nnx.Module):
    """HF's MiniCPMV4_6ViTWindowAttentionMerger: attention inside each 2x2 window (4 consecutive
    tokens), residual, then pre_norm over the window's 4 tokens concatenated, linear_1, GELU-tanh,
    linear_2, plus the window's mean: [N, d] -> [N / 4, d]."""

    def __init__(self, cfg: MiniCPMVVisionConfig, dtype=jnp.float32):
        d, i = cfg.hidden_size, cfg.intermediate_size
        self.layer_norm1 = LayerNorm(d, cfg.layer_norm_eps, dtype=dtype)
        self.self_attn = VisionAttention(d, cfg.num_heads, dtype=dtype)
        self.pre_norm = LayerNorm(4 * d, cfg.layer_norm_eps, dtype=dtype)
        self.linear_1 = Linear(4 * d, 4 * i, bias=True, dtype=dtype, axes=(None, None))
        self.linear_2 = Linear(4 * i, d, bias=True, dtype=dtype, axes=(None, None))

    def __call__(self, x: jax.Array) -> jax.Array:
        n, d = x.shape
        windows = self.self_attn(self.layer_norm1(x).reshape(n // 4, 4, d))
        x = (x + windows.reshape(n, d)).reshape(n // 4, 4, d)
        y = self.linear_2(activation("gelu_pytorch_tanh")(self.linear_1(self.pre_norm(x.reshape(n // 4, 4 * d)))))
        return y + x.mean(axis=1)


class DownsampleMLP(nnx.Module):
    """HF's MiniCPMV4_6DownsampleMLP: pre_norm (eps 1e-6) over 4 neighbours concatenated,
    linear_1, exact GELU, linear_2 into the LLM width."""

    def __init__(self, d: int, d_out: int, dtype=jnp.float32):
        self.pre_norm = LayerNorm(4 * d, 1e-6, dtype=dtype)
        self.linear_1 = Linear(4 * d, 4 * d, bias=True, dtype=dtype, axes=(None, None))
        self.linear_2 = Linear(4 * d, d_out, bias=True, dtype=dtype, axes=(None, None))

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.linear_2(activation("gelu")(self.linear_1(self.pre_norm(x))))


class Merger(nnx.Module):
    """HF's MiniCPMV4_6Merger with merger_times 1: `mlp[0]` on each 2x2 block (4 consecutive
    tokens in the packed order)."""

    def __init__(self, cfg: MiniCPMVVisionConfig, dtype=jnp.float32):
        self.mlp = nnx.List([DownsampleMLP(cfg.hidden_size, cfg.out_hidden_size, dtype)])

    def __call__(self, x: jax.Array) -> jax.Array:
        n, d = x.shape
        return self.mlp[0](x.reshape(n // 4, 4 * d))


class MiniCPMVEncoder(nnx.Module):
    def __init__(self, cfg: MiniCPMVVisionConfig, dtype=jnp.float32):
        self.layers = nnx.List([MiniCPMVEncoderLayer(cfg, dtype) for _ in range(cfg.num_layers)])


class MiniCPMVVisionModel(nnx.Module):
    """HF's MiniCPMV4_6VisionModel (`vision_tower`): embeddings, encoder.layers, vit_merger (None
    in "4x" mode: not loaded), post_layernorm."""

    def __init__(self, cfg: MiniCPMVVisionConfig, dtype=jnp.float32):
        self.config = cfg
        self.embeddings = MiniCPMVEmbeddings(cfg, dtype)
        self.encoder = MiniCPMVEncoder(cfg, dtype)
        self.vit_merger = WindowAttentionMerger(cfg, dtype) if cfg.use_vit_merger else None
        self.post_layernorm = LayerNorm(cfg.hidden_size, cfg.layer_norm_eps, dtype=dtype)

    def __call__(self, patches: jax.Array, pos_ids: jax.Array, segment_ids: jax.Array) -> jax.Array:
        """Packed patches [N, p*p*c] in merge-block order, pos_ids [N], segment_ids [N] (one per
        view, -1: padding; N a multiple of merge^2) -> [N / 4 (window merger) or N, d]."""
        cfg = self.config
        x = self.embeddings(patches, pos_ids)
        seg = segment_ids
        for i, layer in enumerate(self.encoder.layers):
            x = layer(x, seg)
            if cfg.use_vit_merger and i == cfg.insert_layer_id:
                x, seg = self.vit_merger(x), seg[::4]
        return self.post_layernorm(x)

    def hf_weights(self, w, name: str) -> None:
        load_children(self, w, name)
        if self.vit_merger is None:
            w.ignore(name.replace(".", r"\.") + r"\.vit_merger\..*")


# ------------------------------------------------------------------------------------------------
# Host-side packing
# ------------------------------------------------------------------------------------------------

def nearest_position_ids(height: int, width: int, side: int) -> np.ndarray:
    """HF's get_vision_nearest_position_ids for one view [height * width] (row-major): the
    float32 fractional coordinates i / height bucketed on the side x side table (torch's float32
    arange boundaries, `bucketize(right=True)`)."""
    step = 1 / side
    n = int(math.ceil((1.0 - step) / step))
    boundaries = (step + np.arange(n, dtype=np.float64) * step).astype(np.float32)
    bh = np.searchsorted(boundaries, np.arange(height, dtype=np.float32) / np.float32(height), side="right")
    bw = np.searchsorted(boundaries, np.arange(width, dtype=np.float32) / np.float32(width), side="right")
    return (bh[:, None] * side + bw[None, :]).ravel().astype(np.int32)


def merge_block_order(height: int, width: int, merge: int) -> np.ndarray:
    """Row-major patch indices [height * width] of a view in merge-block order: for each output
    token (row-major over the (h / merge, w / merge) grid), its 2x2 sub-blocks row-major, and
    recursively down to single patches (merge 4: 2x2 windows of 2x2 patches)."""
    idx = np.arange(height * width).reshape(height, width)
    levels = int(round(math.log2(merge)))
    # axes: (block row, [sub-row bits, coarse to fine], block col, [sub-col bits])
    x = idx.reshape((height // merge,) + (2,) * levels + (width // merge,) + (2,) * levels)
    rows = list(range(1, levels + 1))
    cols = list(range(levels + 2, 2 * levels + 2))
    perm = [0, levels + 1] + [a for pair in zip(rows, cols) for a in pair]
    return x.transpose(perm).ravel()
