"""Llama 3.2 Vision's decoder (HF MllamaTextModel): Llama self-attention layers (llama.py's
`layer_forward` over the slot KV cache, which holds only the self-attention layers) interleaved
with gated cross-attention layers at `cross_attention_layers` that read per-request image K/V.

Cross-attention layer (HF MllamaCrossAttentionDecoderLayer): x += tanh(attn_gate) *
o(attn(q_norm(q(ln1 x)), k_norm(k(vision)), v(vision))); x += tanh(mlp_gate) * row_mask *
mlp(ln2 x). `key_mask [b, t, n_vis]` says which vision tokens each text token may see (the
processor's cross_attention_mask: the tiles of the image(s) bound to the token's span); a row
with none (text before the first image) attends to every vision token uniformly (HF's mask
quirk) and its MLP output is zeroed (row_mask 0). Requests without images skip these layers
(HF does), here per row with `has_images [b]`, so one compiled step serves every mix.

`MllamaTextModel` (below) serves it: a per-slot cross-attention K/V cache next to the slot KV
cache, filled once per request (`fill_cross`); `forward_full` is the whole-prompt reference.
"""
from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from mmjax.checkpoint import TensorSource, fused_linear, linear
from mmjax.models.layers import bf16_einsum, dense, matmul, rms_norm
from mmjax.models.text import llama as L
from mmjax.models.text.kv_quant import SCALE_DTYPE, bytes_per_token, is_quantized, quantize


@dataclass(frozen=True)
class MllamaTextConfig:
    base: L.LlamaConfig                   # num_layers = self-attention layers only
    cross_layers: tuple[int, ...]         # indices in the full layer list
    total_layers: int
    embed_rows: int                       # vocab_size + 8 (HF's embedding has 8 extra rows)

    @classmethod
    def from_hf(cls, t: dict) -> "MllamaTextConfig":
        cross = tuple(int(i) for i in t.get("cross_attention_layers") or ())
        n = int(t["num_hidden_layers"])
        base = L.LlamaConfig.from_hf({**t, "model_type": "llama"}, "text_config", num_layers=n - len(cross),
                                     tie_word_embeddings=False)
        return cls(base=base, cross_layers=cross, total_layers=n, embed_rows=base.vocab_size + 8)


def load_text_params(src: TensorSource, cfg: MllamaTextConfig, prefix: str = "language_model.model.",
                     lm_head: str = "language_model.lm_head.weight") -> dict:
    b = cfg.base
    d, hd, i = b.hidden_size, b.head_dim, b.intermediate_size
    q_out, kv_out = b.num_heads * hd, b.num_kv_heads * hd
    selfs, crosses = [], []
    for n in range(cfg.total_layers):
        lp = f"{prefix}layers.{n}."
        mlp = {"ln2": src.take(lp + "post_attention_layernorm.weight", (d,)),
               "gate_up": fused_linear(src, [lp + "mlp.gate_proj", lp + "mlp.up_proj"], d, [i, i], False),
               "down": linear(src, lp + "mlp.down_proj", i, d, False),
               "ln1": src.take(lp + "input_layernorm.weight", (d,))}
        if n in cfg.cross_layers:
            crosses.append({**mlp, "q": linear(src, lp + "cross_attn.q_proj", d, q_out, False),
                            "kv": fused_linear(src, [lp + "cross_attn.k_proj", lp + "cross_attn.v_proj"], d,
                                               [kv_out, kv_out], False),
                            "o": linear(src, lp + "cross_attn.o_proj", q_out, d, False),
                            "q_norm": src.take(lp + "cross_attn.q_norm.weight", (hd,)),
                            "k_norm": src.take(lp + "cross_attn.k_norm.weight", (hd,)),
                            "attn_gate": src.take(lp + "cross_attn_attn_gate", (1,)),
                            "mlp_gate": src.take(lp + "cross_attn_mlp_gate", (1,))})
        else:
            selfs.append({**mlp, "qkv": fused_linear(src, [lp + f"self_attn.{x}_proj" for x in "qkv"], d,
                                                     [q_out, kv_out, kv_out], False),
                          "o": linear(src, lp + "self_attn.o_proj", q_out, d, False)})
    return {"embed": src.take(prefix + "embed_tokens.weight", (cfg.embed_rows, d)), "layers": selfs,
            "cross": crosses, "norm": src.take(prefix + "norm.weight", (d,)),
            "lm_head": np.ascontiguousarray(src.take(lm_head, (b.vocab_size, d)).T)}


def cross_kv(p: dict, cfg: MllamaTextConfig, vision: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Projected vision tokens [b, n_vis, hidden] -> this layer's K (k_norm applied), V
    [b, n_vis, kv_heads, head_dim]: computed once per request, reused by every step."""
    b, n, _ = vision.shape
    c = cfg.base
    kv = dense(p["kv"], vision)
    k = kv[..., : c.num_kv_heads * c.head_dim].reshape(b, n, c.num_kv_heads, c.head_dim)
    v = kv[..., c.num_kv_heads * c.head_dim:].reshape(b, n, c.num_kv_heads, c.head_dim)
    return rms_norm(p["k_norm"], k, c.rms_norm_eps), v


def cross_layer(p: dict, cfg: MllamaTextConfig, x: jax.Array, k: jax.Array, v: jax.Array,
                key_mask: jax.Array, has_images: jax.Array) -> jax.Array:
    """x [b, t, hidden]; k, v [b, n_vis, kv_heads, hd]; key_mask [b, t, n_vis] bool;
    has_images [b] bool (rows without images pass through unchanged)."""
    c = cfg.base
    b, t, _ = x.shape
    h, kvh, hd = c.num_heads, c.num_kv_heads, c.head_dim
    q = rms_norm(p["q_norm"], dense(p["q"], rms_norm(p["ln1"], x, c.rms_norm_eps)).reshape(b, t, h, hd),
                 c.rms_norm_eps)
    q = q.reshape(b, t, kvh, h // kvh, hd)
    row = key_mask.any(-1)                                             # [b, t]
    allowed = key_mask | ~row[..., None]                               # empty rows: every key (HF)
    s = bf16_einsum("btgrd,bngd->bgrtn", q, k) * hd ** -0.5
    s = jnp.where(allowed[:, None, None], s, jnp.finfo(s.dtype).min)
    a = jax.nn.softmax(s.astype(jnp.float32), axis=-1).astype(x.dtype)
    out = bf16_einsum("bgrtn,bngd->btgrd", a, v).reshape(b, t, h * hd)
    y = x + jnp.tanh(p["attn_gate"]) * dense(p["o"], out)
    hn = rms_norm(p["ln2"], y, c.rms_norm_eps)
    gu = dense(p["gate_up"], hn)
    m = dense(p["down"], jax.nn.silu(gu[..., : c.intermediate_size]) * gu[..., c.intermediate_size:])
    y = y + jnp.tanh(p["mlp_gate"]) * m * row[..., None].astype(x.dtype)
    return jnp.where(has_images[:, None, None], y, x)


def forward_full(params: dict, cfg: MllamaTextConfig, ids: jax.Array, vision: jax.Array, key_mask: jax.Array,
                 has_images: jax.Array) -> jax.Array:
    """Whole prompts from cache index 0 (reference / parity): ids [b, t], vision [b, n_vis, hidden]
    (projected), key_mask [b, t, n_vis] -> logits [b, t, vocab] float32."""
    b, t = ids.shape
    c = cfg.base
    cache = L.init_kv_cache(c, b, max(128, t), jnp.float32)
    x = params["embed"][ids]
    starts = jnp.zeros((b,), jnp.int32)
    rope = L.rope_for(c, jnp.broadcast_to(jnp.arange(t)[None, None], (1, b, t)), starts, t)
    si = ci = 0
    for n in range(cfg.total_layers):
        if n in cfg.cross_layers:
            p = params["cross"][ci]
            k, v = cross_kv(p, cfg, vision)
            x = cross_layer(p, cfg, x, k, v, key_mask, has_images)
            ci += 1
        else:
            x, _, _ = L.layer_forward(params["layers"][si], c, x, cache[si], rope, t, starts=starts)
            si += 1
    x = rms_norm(params["norm"], x, c.rms_norm_eps)
    return matmul(x, params["lm_head"], jnp.float32)


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


# ------------------------------------------------------------------------------------------------
# The serving text model: slot caches for self-attention and for the images' cross-attention K/V
# ------------------------------------------------------------------------------------------------

RANGE_SHIFT = 1 << 12  # MaskSpec.spans packs a token's image range as lo * RANGE_SHIFT + hi


@dataclass(frozen=True)
class MllamaTextModel:
    """`TextModel` for Mllama's decoder. Cache: {"self": llama's slot KV cache (self-attention
    layers only), "cross": {"k", "v": per cross layer [slots, n_vis, kv_heads, hd], "key_ok"
    [slots, n_vis] (the request's images' tokens), "tile_ok" [slots, n_vis] (real tiles),
    "dec" [slots] (decode tokens' packed image range), "has" [slots] bool}}. `fill_cross` writes a
    request's image K/V into its slot once; prefill gets each token's packed image range in
    `mask.spans` (lo * RANGE_SHIFT + hi, computed on the host from the prompt), decode uses the
    slot's `dec`. n_vis = max_images * vision tokens per image."""
    cfg: MllamaTextConfig
    max_images: int
    vision_tokens: int                      # per image: max_num_tiles * (patches + 1)
    patches: int                            # per tile: patches + 1
    position_rows: int = 1

    hidden_size = property(lambda self: self.cfg.base.hidden_size)
    vocab_size = property(lambda self: self.cfg.base.vocab_size)
    num_layers = property(lambda self: self.cfg.base.num_layers)
    max_position_embeddings = property(lambda self: self.cfg.base.max_position_embeddings)

    @property
    def n_vis(self) -> int:
        return self.max_images * self.vision_tokens

    def init_cache(self, num_slots: int, max_len: int, dtype, sharding=None, *, max_chunk: int | None = None):
        c = self.cfg.base
        kv = lambda: jnp.zeros((num_slots, self.n_vis, c.num_kv_heads, c.head_dim), dtype)  # noqa: E731
        n = len(self.cfg.cross_layers)

        def make():
            cross = {"k": [kv() for _ in range(n)], "v": [kv() for _ in range(n)],
                     "key_ok": jnp.zeros((num_slots, self.n_vis), bool),
                     "tile_ok": jnp.zeros((num_slots, self.n_vis), bool),
                     "dec": jnp.zeros((num_slots,), jnp.int32), "has": jnp.zeros((num_slots,), bool)}
            if is_quantized(dtype):   # int8 / fp8: per (vision token, KV head) scales, like the self cache
                scale = lambda: jnp.zeros((num_slots, self.n_vis, c.num_kv_heads), SCALE_DTYPE)  # noqa: E731
                cross.update(k_scale=[scale() for _ in range(n)], v_scale=[scale() for _ in range(n)])
            return {"self": L.init_kv_cache(c, num_slots, max_len, dtype), "cross": cross}
        return L.allocate_cache(make, sharding)

    def cross_cache_bytes(self, num_slots: int, dtype) -> int:
        """Bytes of the cross-attention part of a cache for `num_slots` slots (static: stats()
        may run on any thread, while a step holds the donated cache)."""
        c = self.cfg.base
        per_token = bytes_per_token(c.num_kv_heads, c.head_dim, dtype)      # K and V (+ scales)
        return len(self.cfg.cross_layers) * num_slots * self.n_vis * per_token + 2 * num_slots * self.n_vis \
            + 5 * num_slots

    def embed(self, params: dict, ids: jax.Array) -> jax.Array:
        return params["embed"][ids]

    def logits(self, params: dict, hidden: jax.Array) -> jax.Array:
        return matmul(hidden, params["lm_head"], jnp.float32)

    def fill_cross(self, params: dict, cache, slot: jax.Array, feats: jax.Array, n_images: jax.Array,
                   n_tiles: jax.Array, dec: jax.Array):
        """Write one request's image K/V into cache row `slot`: feats [n_vis, hidden] (the
        projected vision tokens of its images, zero past n_images), n_tiles [max_images], dec the
        packed image range of its decode tokens. n_images == 0: a text-only request."""
        cr = dict(cache["cross"])
        ks, vs = list(cr["k"]), list(cr["v"])
        quant = "k_scale" in cr
        kss, vss = (list(cr["k_scale"]), list(cr["v_scale"])) if quant else ([], [])
        for i, p in enumerate(params["cross"]):
            k, v = cross_kv(p, self.cfg, feats[None])
            if quant:    # quantized once per request, on write (kv_quant)
                (k, k_sc), (v, v_sc) = quantize(k, ks[i].dtype), quantize(v, vs[i].dtype)
                kss[i], vss[i] = kss[i].at[slot].set(k_sc[0]), vss[i].at[slot].set(v_sc[0])
            ks[i] = ks[i].at[slot].set(k[0].astype(ks[i].dtype))
            vs[i] = vs[i].at[slot].set(v[0].astype(vs[i].dtype))
        if quant:
            cr.update(k_scale=kss, v_scale=vss)
        j = jnp.arange(self.n_vis)
        img, tile = j // self.vision_tokens, (j % self.vision_tokens) // self.patches
        cr.update(k=ks, v=vs, key_ok=cr["key_ok"].at[slot].set(img < n_images),
                  tile_ok=cr["tile_ok"].at[slot].set(tile < n_tiles[jnp.minimum(img, self.max_images - 1)]),
                  dec=cr["dec"].at[slot].set(dec), has=cr["has"].at[slot].set(n_images > 0))
        return {"self": cache["self"], "cross": cr}

    def forward(self, params: dict, embeds: jax.Array, positions: jax.Array, cache, starts: jax.Array, kv_len, *,
                slots: jax.Array | None = None, mask=None, ids=None, capture=None, reduce_small: bool = False):
        from mmjax.models.text import Output
        c = self.cfg.base
        b, t, _ = embeds.shape
        rows = jnp.arange(b) if slots is None else slots
        cr = cache["cross"]
        packed = (jnp.broadcast_to(cr["dec"][rows][:, None], (b, t)) if mask is None or mask.spans is None
                  else mask.spans)
        lo, hi = packed // RANGE_SHIFT, packed % RANGE_SHIFT                          # [b, t] image indices
        img = jnp.arange(self.n_vis) // self.vision_tokens
        key_mask = (img >= lo[..., None]) & (img < hi[..., None]) & cr["tile_ok"][rows][:, None]
        # a row that sees no image attends to every token of the request's images (HF's quirk)
        empty = ~key_mask.any(-1, keepdims=True)
        allowed = key_mask | (empty & cr["key_ok"][rows][:, None])
        has = cr["has"][rows]
        inv_freq = jnp.asarray(L.rope_inv_freq(c.rope, c.head_dim))
        rope = L.rope_for(c, positions, starts, t, inv_freq)
        x, new_self, si, ci = embeds, [], 0, 0
        for n in range(self.cfg.total_layers):
            if n in self.cfg.cross_layers:
                sc = (cr["k_scale"][ci][rows], cr["v_scale"][ci][rows]) if "k_scale" in cr else None
                x = _cross_layer_masked(params["cross"][ci], self.cfg, x, cr["k"][ci][rows], cr["v"][ci][rows],
                                        allowed, ~empty[..., 0], has, sc)
                ci += 1
            else:
                x, kv, _ = L.layer_forward(params["layers"][si], c, x, cache["self"][si], rope, kv_len, slots=slots,
                                           starts=starts, reduce_small=reduce_small)
                new_self.append(kv)
                si += 1
        out = rms_norm(params["norm"], x, c.rms_norm_eps)
        return Output(out, {"self": new_self, "cross": cr}, {})


def _cross_layer_masked(p: dict, cfg: MllamaTextConfig, x, k, v, allowed, row, has, scales=None):
    """`cross_layer` with the key mask already resolved: allowed [b, t, n_vis] (empty rows
    already opened to the request's keys), row [b, t] (rows that see an image). scales: (k_scale,
    v_scale) [b, n_vis, kv_heads] of an int8 / fp8 cross cache, applied to the scores and the
    softmax weights (kv_quant)."""
    c = cfg.base
    b, t, _ = x.shape
    h, kvh, hd = c.num_heads, c.num_kv_heads, c.head_dim
    q = rms_norm(p["q_norm"], dense(p["q"], rms_norm(p["ln1"], x, c.rms_norm_eps)).reshape(b, t, h, hd),
                 c.rms_norm_eps).reshape(b, t, kvh, h // kvh, hd)
    s = bf16_einsum("btgrd,bngd->bgrtn", q, k.astype(q.dtype)) * hd ** -0.5
    if scales is not None:      # [b, n, g] -> [b, g, 1, 1, n]
        s = (s.astype(jnp.float32) * scales[0].astype(jnp.float32).transpose(0, 2, 1)[:, :, None, None]).astype(s.dtype)
    s = jnp.where(allowed[:, None, None], s, jnp.finfo(s.dtype).min)
    a = jax.nn.softmax(s.astype(jnp.float32), axis=-1)
    if scales is not None:
        a = a * scales[1].astype(jnp.float32).transpose(0, 2, 1)[:, :, None, None]
    a = a.astype(x.dtype)
    out = bf16_einsum("bgrtn,bngd->btgrd", a, v.astype(x.dtype)).reshape(b, t, h * hd)
    y = x + jnp.tanh(p["attn_gate"]) * dense(p["o"], out)
    gu = dense(p["gate_up"], rms_norm(p["ln2"], y, c.rms_norm_eps))
    m = dense(p["down"], jax.nn.silu(gu[..., : c.intermediate_size]) * gu[..., c.intermediate_size:])
    y = y + jnp.tanh(p["mlp_gate"]) * m * row[..., None].astype(x.dtype)
    return jnp.where(has[:, None, None], y, x)


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
