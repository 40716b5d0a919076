"""Llama 3.2 Vision's decoder (HF MllamaTextModel + lm_head) as an `nn.Decoder`: Llama
self-attention layers (`nn.Attention` over the slot KV cache, which holds only the
self-attention layers) interleaved with gated cross-attention layers at `cross_attention_layers`
that read per-request image K/V from a per-slot cross-attention cache.

Module tree (transformers' names): `embed_tokens` (vocab + 8 rows, as HF's), `layers[i]`: a
`MllamaSelfAttentionDecoderLayer` (`input_layernorm`, `self_attn` (nn.Attention: fused
`qkv_proj` = HF's q_proj / k_proj / v_proj, `o_proj`), `post_attention_layernorm`, `mlp`
(nn.GatedMLP: fused `gate_up_proj`, `down_proj`)) or a `MllamaCrossAttentionDecoderLayer`
(`input_layernorm`, `cross_attn` (`q_proj`, `kv_proj` = HF's k_proj / v_proj fused, `o_proj`,
`q_norm`, `k_norm`), `cross_attn_attn_gate`, `post_attention_layernorm`, `mlp`,
`cross_attn_mlp_gate`), `norm`, `lm_head`.

Cross-attention layer (HF MllamaCrossAttentionDecoderLayer): x += tanh(attn_gate) *
o(attn(q_norm(q(ln1 x)), k_norm(k(vision)), v(vision))); x += tanh(mlp_gate) * row_mask *
mlp(ln2 x). The key mask says which vision tokens each text token may see (the processor's
cross_attention_mask: the tiles of the image(s) bound to the token's span); a row with none
(text before the first image) attends to every vision token of the request's images uniformly
(HF's mask quirk) and its MLP output is zeroed (row_mask 0). Requests without images skip these
layers (HF does), here per token with the slot's `has` flag, so one compiled step serves every mix.

The cache: {"self": one nn.Attention cache entry per self-attention layer, "cross": {"k", "v":
per cross layer, in the self cache's head-major layouts K [slots, kv_heads, head_dim, n_vis] and
V [slots, kv_heads, n_vis, head_dim] (so it shards by KV heads under the same rules, replicated
to tp when there are fewer), "k_scale" / "v_scale" [slots, kv_heads, n_vis] for an int8 / fp8
cache, "key_ok" [slots, n_vis] (the request's images' tokens), "tile_ok" [slots, n_vis] (real
tiles), "dec" [slots] (decode tokens' packed image range), "has" [slots] bool}}. `fill_cross`
writes a request's image K/V into its slot once; prefill gets each token's packed image range
in `AttentionMetadata.spans` (lo * RANGE_SHIFT + hi, from the prompt on the host), decode uses
the slot's `dec`. A packed prefill row runs the cross attention in the packing's query blocks,
each block over its own sequence's slot. n_vis = max_images * vision tokens per image.
Paged (serving/pages.py, `page_size`): the self-attention layers are page pools like any
decoder's; the cross part stays a row per slot (n_vis positions whatever max_model_len), filled
by `fill_cross` before a request's first chunk in its slot, so a request resuming from shared
prefix pages or forked from its parent refills its own (`copy_pages` leaves it alone).

Tensor parallel like every decoder: heads / kv_heads / mlp axes on the weights (q_proj by heads,
the fused kv_proj by KV heads in per-shard blocks, o_proj row parallel), the cross cache by KV
heads. No decode riders and no FastV pruning (`supports_riders` / `supports_prune` False).
"""
from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from mmjax.models.nn.attention import Attention
from mmjax.models.nn.capture import sow
from mmjax.models.nn.decoder import Decoder
from mmjax.models.nn.kv_cache import cache_kv_heads
from mmjax.models.nn.kv_quant import SCALE_DTYPE, bytes_per_token, is_quantized, layer_scales, quantize
from mmjax.models.nn.linear import Embed, FusedLinear, Linear, Part, bf16_einsum, param
from mmjax.models.nn.metadata import AttentionMetadata, MaskSpec
from mmjax.models.nn.mlp import GatedMLP
from mmjax.models.nn.norm import RMSNorm
from mmjax.models.nn.rope import rope_cos_sin, rope_inv_freq
from mmjax.models.nn.weights import load_children, load_module
from mmjax.models.text.llama import LlamaConfig

RANGE_SHIFT = 1 << 12  # AttentionMetadata.spans packs a token's image range as lo * RANGE_SHIFT + hi


@dataclass(frozen=True)
class MllamaTextConfig:
    base: LlamaConfig                     # num_layers = self-attention layers only
    cross_layers: tuple[int, ...]         # indices in the full layer list
    total_layers: int
    embed_rows: int                       # vocab_size + 8 (HF's embedding has 8 extra rows)

    @classmethod
    def from_hf(cls, t: dict) -> "MllamaTextConfig":
        cross = tuple(int(i) for i in t.get("cross_attention_layers") or ())
        n = int(t["num_hidden_layers"])
        base = LlamaConfig.from_hf({**t, "model_type": "llama"}, "text_config", num_layers=n - len(cross),
                                   tie_word_embeddings=False)
        return cls(base=base, cross_layers=cross, total_layers=n, embed_rows=base.vocab_size + 8)


def visible_images(ranges: jax.Array, tile_ok: jax.Array, vision_tokens: int) -> jax.Array:
    """ranges [b, t] (packed lo * RANGE_SHIFT + hi), tile_ok [b, 1 or t, n_vis] -> [b, t, n_vis]
    bool: the real-tile vision tokens of the images in each token's range."""
    lo, hi = ranges // RANGE_SHIFT, ranges % RANGE_SHIFT
    img = jnp.arange(tile_ok.shape[-1]) // vision_tokens
    return (img >= lo[..., None]) & (img < hi[..., None]) & tile_ok


def allowed_keys(key_mask: jax.Array, key_ok: jax.Array) -> jax.Array:
    """key_mask [b, t, n_vis] -> the keys each token attends to: a token that sees no image
    attends to every token of the request's images (key_ok [b, 1, n_vis]; HF's quirk)."""
    return key_mask | (~key_mask.any(-1, keepdims=True) & key_ok)


@dataclass(frozen=True)
class CrossInputs:
    """One call's view of the cross-attention masks (built once per forward, read by every cross
    layer): ranges [b, t] each token's packed image range; allowed [b, t, n_vis] the keys each
    token attends to (None in a packed row: per query block, `block_allowed`); row [b, t] the
    token sees an image (its MLP output counts); has [b, t] its request has images (else the
    layer passes it through); key_ok / tile_ok [slots, n_vis] of the cache."""
    ranges: jax.Array | None
    allowed: jax.Array | None
    row: jax.Array
    has: jax.Array
    key_ok: jax.Array | None = None
    tile_ok: jax.Array | None = None
    vision_tokens: int = 1

    def block_allowed(self, spans: jax.Array, slots: jax.Array) -> jax.Array:
        """The allowed keys [n, B, n_vis] of query blocks: spans [n, B] their ranges, slots [n]."""
        return allowed_keys(visible_images(spans, self.tile_ok[slots][:, None], self.vision_tokens),
                            self.key_ok[slots][:, None])


class MllamaTextCrossAttention(nnx.Module):
    """HF's MllamaTextCrossAttention: q_proj, k_proj / v_proj fused as `kv_proj`, o_proj,
    q_norm / k_norm (RMSNorm over head_dim)."""

    def __init__(self, cfg: LlamaConfig, dtype=jnp.float32):
        d, h, kvh, hd = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.head_dim = hd
        self.q_proj = Linear(d, h * hd, dtype=dtype, axes=("embed", "heads"))
        self.kv_proj = FusedLinear(d, (Part("k_proj", kvh * hd, "kv_heads", hd),
                                       Part("v_proj", kvh * hd, "kv_heads", hd)), dtype=dtype)
        self.o_proj = Linear(h * hd, d, dtype=dtype, axes=("heads", "embed"))
        self.q_norm = RMSNorm(hd, cfg.rms_norm_eps, dtype=dtype)
        self.k_norm = RMSNorm(hd, cfg.rms_norm_eps, dtype=dtype)

    def hf_weights(self, w, name: str) -> None:
        self.q_proj.hf_weights(w, f"{name}.q_proj")
        self.kv_proj.hf_weights(w, f"{name}.")
        self.o_proj.hf_weights(w, f"{name}.o_proj")
        self.q_norm.hf_weights(w, f"{name}.q_norm")
        self.k_norm.hf_weights(w, f"{name}.k_norm")

    def project_kv(self, vision: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Projected vision tokens [b, n_vis, hidden] -> K (k_norm applied), V [b, n_vis, KV heads
        held, head_dim]: computed once per request, reused by every step."""
        b, n, _ = vision.shape
        k, v = (y.reshape(b, n, -1, self.head_dim) for y in self.kv_proj(vision))
        return self.k_norm(k), v

    def cache_kv(self, vision: jax.Array) -> dict:
        """project_kv in the cache's layouts: {"k" [b, kv_heads, hd, n_vis], "v" [b, kv_heads, n_vis, hd]}."""
        k, v = self.project_kv(vision)
        return {"k": k.transpose(0, 2, 3, 1), "v": v.transpose(0, 2, 1, 3)}

    def attend(self, q: jax.Array, k: jax.Array, v: jax.Array, allowed: jax.Array,
               scales: tuple | None = None) -> jax.Array:
        """q [n, t, heads, hd] over k [n, g, hd, n_vis], v [n, g, n_vis, hd] (g KV heads) with
        allowed [n, t, n_vis] -> [n, t, heads, hd]. scales: (k_scale, v_scale) [n, g, n_vis] of an
        int8 / fp8 cache, applied to the scores and to the softmax weights (kv_quant)."""
        n, t, h, hd = q.shape
        g, m = k.shape[1], k.shape[-1]
        # queries [n, g, t * r, hd] (the self-attention's grouping): both products then have their
        # batch axes leading, the form XLA:CPU's bf16 x bf16 -> f32 dots take
        qn = q.reshape(n, t, g, h // g, hd).transpose(0, 2, 1, 3, 4).reshape(n, g, -1, hd)
        s = bf16_einsum("bgqd,bgdn->bgqn", qn, k.astype(q.dtype)) * hd ** -0.5
        if scales is not None:      # [n, g, n_vis] -> [n, g, 1, n_vis]
            s = (s.astype(jnp.float32) * scales[0].astype(jnp.float32)[:, :, None]).astype(s.dtype)
        s = jnp.where(allowed[:, None, :, None], s.reshape(n, g, t, -1, m), jnp.finfo(s.dtype).min).reshape(s.shape)
        a = jax.nn.softmax(s.astype(jnp.float32), axis=-1)
        if scales is not None:
            a = a * scales[1].astype(jnp.float32)[:, :, None]
        a = a.astype(q.dtype)
        out = bf16_einsum("bgqn,bgnd->bgqd", a, v.astype(q.dtype))                   # [n, g, t * r, hd]
        return out.reshape(n, g, t, -1, hd).transpose(0, 2, 1, 3, 4).reshape(n, t, h, hd)

    def __call__(self, x: jax.Array, meta: AttentionMetadata, inputs: CrossInputs, kv: dict) -> jax.Array:
        """x [b, t, hidden] (normed) over this layer's cross cache `kv` ({"k", "v"(, scales)}, all
        slots) -> [b, t, hidden]: row i reads cache row meta.slots[i] (None: row i); a packed
        row in the packing's query blocks, each over its own sequence's slot."""
        b, t, _ = x.shape
        q = self.q_norm(self.q_proj(x).reshape(b, t, -1, self.head_dim))
        scales = layer_scales(kv)
        if meta.packing is None:
            take = (lambda a: a[:b]) if meta.slots is None else (lambda a: a[meta.slots])    # noqa: E731
            out = self.attend(q, take(kv["k"]), take(kv["v"]), inputs.allowed,
                              None if scales is None else (take(scales[0]), take(scales[1])))
        else:
            def blocks(qb, blk):
                sl = blk.slots
                return self.attend(qb, kv["k"][sl], kv["v"][sl], inputs.block_allowed(blk.mask.spans, sl),
                                   None if scales is None else (scales[0][sl], scales[1][sl]))
            out = meta.packing.attend(blocks, q, MaskSpec(spans=inputs.ranges))
        return self.o_proj(out.reshape(b, t, -1))


class MllamaSelfAttentionDecoderLayer(nnx.Module):
    """A Llama layer: pre-norm self-attention (image ranges in the metadata's spans are not
    bidirectional runs here: `spans=False`) and gated MLP, each added to the residual stream."""

    def __init__(self, cfg: LlamaConfig, i: int, dtype=jnp.float32):
        d, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.input_layernorm = RMSNorm(d, eps, dtype=dtype)
        self.self_attn = Attention(layer_idx=i, hidden_size=d, num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads,
                                   head_dim=cfg.head_dim, qkv_bias=cfg.attention_bias, norm_eps=eps, spans=False,
                                   dtype=dtype)
        self.post_attention_layernorm = RMSNorm(d, eps, dtype=dtype)
        self.mlp = GatedMLP(d, cfg.intermediate_size, bias=cfg.mlp_bias, dtype=dtype)

    def __call__(self, x: jax.Array, rope, meta: AttentionMetadata, kv: dict) -> tuple[jax.Array, dict]:
        h, kv = self.self_attn(self.input_layernorm(x), rope, meta, kv)
        x = x + h
        return x + self.mlp(self.post_attention_layernorm(x)), kv


class MllamaCrossAttentionDecoderLayer(nnx.Module):
    """The gated cross-attention layer (see the module docstring)."""

    def __init__(self, cfg: LlamaConfig, dtype=jnp.float32):
        d, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.input_layernorm = RMSNorm(d, eps, dtype=dtype)
        self.cross_attn = MllamaTextCrossAttention(cfg, dtype)
        self.cross_attn_attn_gate = param((1,), dtype, (None,))
        self.post_attention_layernorm = RMSNorm(d, eps, dtype=dtype)
        self.mlp = GatedMLP(d, cfg.intermediate_size, bias=cfg.mlp_bias, dtype=dtype)
        self.cross_attn_mlp_gate = param((1,), dtype, (None,))

    def hf_weights(self, w, name: str) -> None:
        load_children(self, w, name)
        w.set(self.cross_attn_attn_gate, w.take(f"{name}.cross_attn_attn_gate", (1,)))
        w.set(self.cross_attn_mlp_gate, w.take(f"{name}.cross_attn_mlp_gate", (1,)))

    def __call__(self, x: jax.Array, meta: AttentionMetadata, inputs: CrossInputs, kv: dict) -> jax.Array:
        y = x + jnp.tanh(self.cross_attn_attn_gate.get_value()) * self.cross_attn(self.input_layernorm(x), meta,
                                                                                   inputs, kv)
        m = self.mlp(self.post_attention_layernorm(y))
        y = y + jnp.tanh(self.cross_attn_mlp_gate.get_value()) * m * inputs.row[..., None].astype(x.dtype)
        return jnp.where(inputs.has[..., None], y, x)


class MllamaTextModel(Decoder):
    """The decoder (see the module docstring). max_images: images per request the cross cache
    holds; vision_tokens: vision tokens per image (max_num_tiles * (patches + 1)); patches:
    vision tokens per tile (patches + 1)."""
    position_rows = 1
    supports_riders = False     # decode riders in packed prefill rows: not implemented for the cross layers
    supports_prune = False      # FastV: images are not in the token sequence
    cross_attention = True

    def __init__(self, cfg: MllamaTextConfig, max_images: int, vision_tokens: int, patches: int, dtype=jnp.float32):
        c = cfg.base
        self.config = cfg
        self.max_images, self.vision_tokens, self.patches = max_images, vision_tokens, patches
        self.hidden_size, self.vocab_size, self.num_layers = c.hidden_size, c.vocab_size, cfg.total_layers
        self.max_position_embeddings = c.max_position_embeddings
        self.embed_tokens = Embed(cfg.embed_rows, c.hidden_size, dtype=dtype)
        self.layers = nnx.List([MllamaCrossAttentionDecoderLayer(c, dtype) if i in cfg.cross_layers
                                else MllamaSelfAttentionDecoderLayer(c, i, dtype) for i in range(cfg.total_layers)])
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype=dtype)
        self.lm_head = Linear(c.hidden_size, c.vocab_size, dtype=dtype, axes=("embed", "vocab"))

    @property
    def n_vis(self) -> int:
        """Vision tokens a slot's cross cache holds (every image's, absent tiles included)."""
        return self.max_images * self.vision_tokens

    @property
    def cross_layers(self) -> tuple[int, ...]:
        return self.config.cross_layers

    def hf_weights(self, w, name: str, lm_head: str) -> None:
        """`name`: the HF prefix of the MllamaTextModel ("language_model.model"); lm_head: the LM
        head's tensor name."""
        c = self.config.base
        self.embed_tokens.hf_weights(w, f"{name}.embed_tokens")
        for i, layer in enumerate(self.layers):
            load_module(layer, w, f"{name}.layers.{i}")
        self.norm.hf_weights(w, f"{name}.norm")
        w.set(self.lm_head.kernel, w.take(lm_head, (c.vocab_size, c.hidden_size)).T, matmul=True)

    # ---- inputs --------------------------------------------------------------------------------
    def inputs(self, ids, image_embeds, image_mask):
        """Images enter through the cross-attention cache: <|image|> keeps its token embedding."""
        return self.embed(ids), {}

    # ---- the cache -----------------------------------------------------------------------------
    @property
    def pages_by_default(self) -> bool:
        """Slot rows unless asked: the cross-attention K/V stays a row per slot
        (`Decoder.pages_by_default`)."""
        return False

    def cache_layers(self) -> tuple[int, ...]:
        """The self-attention layers (the "self" cache entries, in order)."""
        return tuple(i for i in range(self.num_layers) if i not in self.cross_layers)

    def _cross_heads(self, tp: int | None = None) -> int:
        """KV heads the cross cache holds: the model's, replicated to tp when fewer (tp None:
        read off the fused kv_proj's layout, [in, tp, per shard] once placed for tp shards)."""
        if tp is None:
            kernel = self.layers[self.cross_layers[0]].cross_attn.kv_proj.kernel.get_value()
            tp = kernel.shape[1] if len(kernel.shape) == 3 else 1
        return cache_kv_heads(self.config.base.num_kv_heads, tp)

    def copy_pages(self, cache: dict, src: jax.Array, dst: jax.Array) -> dict:
        """Paged, only the self-attention layers are pages; the cross-attention rows stay per
        slot (a forked sibling fills its own: `fill_cross`)."""
        return {"self": super().copy_pages(cache["self"], src, dst), "cross": cache["cross"]}

    def init_cache(self, num_slots: int, max_len: int, dtype, *, max_chunk: int | None = None, tp: int = 1,
                   pages: tuple[int, int] | None = None) -> dict:
        c, n, m = self.config.base, len(self.cross_layers), self.n_vis
        g = self._cross_heads(tp)
        cross = {"k": [jnp.zeros((num_slots, g, c.head_dim, m), dtype) for _ in range(n)],
                 "v": [jnp.zeros((num_slots, g, m, c.head_dim), dtype) for _ in range(n)],
                 "key_ok": jnp.zeros((num_slots, m), bool), "tile_ok": jnp.zeros((num_slots, m), bool),
                 "dec": jnp.zeros((num_slots,), jnp.int32), "has": jnp.zeros((num_slots,), bool)}
        if is_quantized(dtype):   # int8 / fp8: per (vision token, KV head) scales, like the self cache
            cross["k_scale"] = [jnp.zeros((num_slots, g, m), SCALE_DTYPE) for _ in range(n)]
            cross["v_scale"] = [jnp.zeros((num_slots, g, m), SCALE_DTYPE) for _ in range(n)]
        return {"self": super().init_cache(num_slots, max_len, dtype, max_chunk=max_chunk, tp=tp, pages=pages),
                "cross": cross}

    def cross_cache_bytes(self, num_slots: int, dtype) -> int:
        """Bytes of the cross-attention part of a cache for `num_slots` slots (static: stats()
        may run on any thread, while a step holds the donated cache)."""
        per_token = bytes_per_token(self._cross_heads(), self.config.base.head_dim, dtype)   # K and V (+ scales)
        return len(self.cross_layers) * num_slots * self.n_vis * per_token + 2 * num_slots * self.n_vis + 5 * num_slots

    def fill_cross(self, cache: dict, slot: jax.Array, feats: jax.Array, n_images: jax.Array, n_tiles: jax.Array,
                   dec: jax.Array) -> dict:
        """Write one request's image K/V into cache row `slot`: feats [n_vis, hidden] (the
        projected vision tokens of its images, zero past n_images), n_tiles [max_images], dec the
        packed image range of its decode tokens. n_images == 0: a text-only request."""
        cr = dict(cache["cross"])
        new = {name: list(cr[name]) for name in ("k", "v", "k_scale", "v_scale") if name in cr}
        for i, layer in enumerate(self.layers[j] for j in self.cross_layers):
            k, v = layer.cross_attn.project_kv(feats[None])            # [1, n_vis, g, hd]
            k, v = k[0], v[0]
            if "k_scale" in cr:    # quantized once per request, on write (kv_quant)
                (k, k_sc), (v, v_sc) = quantize(k, new["k"][i].dtype), quantize(v, new["v"][i].dtype)
                new["k_scale"][i] = new["k_scale"][i].at[slot].set(k_sc.T)
                new["v_scale"][i] = new["v_scale"][i].at[slot].set(v_sc.T)
            new["k"][i] = new["k"][i].at[slot].set(k.transpose(1, 2, 0).astype(new["k"][i].dtype))
            new["v"][i] = new["v"][i].at[slot].set(v.transpose(1, 0, 2).astype(new["v"][i].dtype))
        j = jnp.arange(self.n_vis)
        img, tile = j // self.vision_tokens, (j % self.vision_tokens) // self.patches
        cr.update(new, key_ok=cr["key_ok"].at[slot].set(img < n_images),
                  tile_ok=cr["tile_ok"].at[slot].set(tile < n_tiles[jnp.minimum(img, self.max_images - 1)]),
                  dec=cr["dec"].at[slot].set(dec), has=cr["has"].at[slot].set(n_images > 0))
        return {"self": cache["self"], "cross": cr}

    # ---- the forward ---------------------------------------------------------------------------
    def rope(self, positions: jax.Array):
        r = self.config.base.rope
        inv = jnp.asarray(rope_inv_freq(r, self.config.base.head_dim))
        return rope_cos_sin(inv, positions, r.mrope_section, r.mrope_interleaved)

    def cross_inputs(self, meta: AttentionMetadata, cross: dict) -> CrossInputs:
        """The call's cross masks from the metadata (each token's cache row and image range:
        meta.spans in prefill, the slot's `dec` in decode) and the cross cache."""
        b, t = meta.batch, meta.length
        vt = self.vision_tokens
        if meta.packing is not None:          # one row of several sequences: per token
            rows = meta.packing.token_slot[None]                                 # [1, T]
            tile_ok, key_ok = cross["tile_ok"][rows], cross["key_ok"][rows]      # [1, T, n_vis]
        else:
            rows = (jnp.arange(b) if meta.slots is None else meta.slots)[:, None]
            tile_ok, key_ok = cross["tile_ok"][rows], cross["key_ok"][rows]      # [b, 1, n_vis]
        ranges = jnp.broadcast_to(cross["dec"][rows], (b, t)) if meta.spans is None else meta.spans
        key_mask = visible_images(ranges, tile_ok, vt)
        has = jnp.broadcast_to(cross["has"][rows], (b, t))
        allowed = None if meta.packing is not None else allowed_keys(key_mask, key_ok)
        return CrossInputs(ranges, allowed, key_mask.any(-1), has, cross["key_ok"], cross["tile_ok"], vt)

    def run_layers(self, embeds, meta: AttentionMetadata, cache: dict, prune, **inputs):
        """The layer loop over the {"self", "cross"} cache -> (final-normed hidden, cache, None)."""
        if prune is not None:
            raise ValueError("Mllama has no FastV pruning (supports_prune is False)")
        cr = cache["cross"]
        layer_kv = [{name: cr[name][i] for name in ("k", "v", "k_scale", "v_scale") if name in cr}
                    for i in range(len(self.cross_layers))]
        x, selfs = self._layers(embeds, meta, cache["self"], self.cross_inputs(meta, cr), layer_kv)
        return x, {"self": selfs, "cross": cr}, None

    def _layers(self, x, meta: AttentionMetadata, selfs: list, inputs: CrossInputs, cross_kv: list):
        rope = self.rope(meta.positions)
        selfs, si, ci = list(selfs), 0, 0
        sow(self, "hidden_states", x)
        for i, layer in enumerate(self.layers):
            if i in self.cross_layers:
                x = layer(x, meta, inputs, cross_kv[ci])
                ci += 1
            else:
                x, selfs[si] = layer(x, rope, meta, selfs[si])
                si += 1
            if i < self.num_layers - 1:
                sow(self, "hidden_states", x)
        x = self.norm(x)
        sow(self, "hidden_states", x)
        return x, selfs

    def forward_full(self, ids: jax.Array, vision: jax.Array, key_mask: jax.Array, has_images: jax.Array) -> jax.Array:
        """Whole prompts from cache index 0 with an explicit key mask (reference / parity): ids
        [b, t], vision [b, n_vis, hidden] (projected), key_mask [b, t, n_vis] (HF's
        cross_attention_mask; a row with none attends to every vision token), has_images [b]
        -> logits [b, t, vocab] float32."""
        b, t = ids.shape
        selfs = [self.layers[i].self_attn.init_cache(b, max(128, t), jnp.float32) for i in self.cache_layers()]
        meta = AttentionMetadata(jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32)[None, None], (1, b, t)),
                                 jnp.zeros((b,), jnp.int32), t)
        row = key_mask.any(-1)
        inputs = CrossInputs(None, key_mask | ~row[..., None], row, jnp.broadcast_to(has_images[:, None], (b, t)))
        cross_kv = [self.layers[i].cross_attn.cache_kv(vision) for i in self.cross_layers]
        x, _ = self._layers(self.embed(ids), meta, selfs, inputs, cross_kv)
        return self.logits(x)


def span_key_mask(ids: np.ndarray, image_token_id: int, n_tiles: list[int], max_tiles: int,
                  patches: int) -> np.ndarray:
    """[len(ids), n_images * max_tiles * patches] bool: HF's cross_attention_mask for one prompt
    (get_cross_attention_token_mask + the per-image tile counts) at vision-token granularity."""
    locs = [i for i, x in enumerate(ids) if x == image_token_id]
    spans = []
    if len(locs) == 1:
        spans = [[locs[0], len(ids)]]
    elif locs:
        spans = [[a, b] for a, b in zip(locs[:-1], locs[1:])] + [[locs[-1], len(ids)]]
        last = spans[-1][1]
        for s in spans[::-1]:
            if s[0] == s[1] - 1:
                s[1] = last
            last = s[1]
    m = np.zeros((len(ids), len(n_tiles), max_tiles), bool)
    for j, ((a, b), nt) in enumerate(zip(spans, n_tiles)):
        m[a:b, j, :nt] = True
    return np.repeat(m, patches, axis=2).reshape(len(ids), -1)


def packed_ranges(ids: np.ndarray, image_token_id: int) -> np.ndarray:
    """[len(ids)] int32: each token's image range [lo, hi) packed as lo * RANGE_SHIFT + hi, the
    rule of HF's get_cross_attention_token_mask (a token sees the latest group of consecutive
    <|image|> tokens at or before it; 0 = no image)."""
    out = np.zeros(len(ids), np.int64)
    lo = hi = 0
    prev_img = False
    for i, tok in enumerate(ids):
        if tok == image_token_id:
            if not prev_img:
                lo = hi
            hi += 1
        prev_img = tok == image_token_id
        out[i] = lo * RANGE_SHIFT + hi if hi else 0
    return out.astype(np.int32)
