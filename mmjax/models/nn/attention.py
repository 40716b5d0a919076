"""`Attention`: one decoder layer's self-attention over its KV cache, the one reader (with the
cache code in nn/kv_cache.py) of the step's `AttentionMetadata`.

A layer's attention is configured once (heads, head width, per-head norms, score scale, soft-cap,
sliding window, whether the window keeps a ring of its own) and then does what the metadata of
the call says: write the new K/V at their cache indexes and attend over the cache for a decode
step (on the CPU one kernel call does both), a chunk of a prompt, a packed row of several
prompts' chunks with decode riders in its padding (`Packing`), or a captured research forward
(explicit softmax; probabilities and per-head outputs sown). A decoder only calls it.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from mmjax.attention import attention
from mmjax.models.nn.capture import sow
from mmjax.models.nn.kv_cache import (attention_kernel, cache_attention, cache_kv_heads, captured_attention,
                                      cpu_decode_write, dense_rows, dequantize, explicit_attention, kv_layer,
                                      kv_segments,
                                      layer_scales, quantize_kv, ring_attention, ring_key_index, ring_len,
                                      ring_visible, scatter_kv, scatter_segment, softcapped_attention)
from mmjax.models.nn.linear import FusedLinear, Linear, Part
from mmjax.models.nn.metadata import AttentionMetadata, MaskSpec
from mmjax.models.nn.norm import RMSNorm
from mmjax.models.nn.rope import apply_rope


def _scale_dict(scales: tuple | None) -> dict:
    return {} if scales is None else {"k_scale": scales[0], "v_scale": scales[1]}


class Attention(nnx.Module):
    """Self-attention with fused q|k|v (`qkv_proj`, HF's q_proj / k_proj / v_proj), `o_proj`,
    optional per-head `q_norm` / `k_norm` (RMSNorm over head_dim, before RoPE).

    scale: score scale (None: 1 / sqrt(head_dim)); softcap: Gemma's attn_logit_softcapping;
    sliding_window: keys within the window only; ring: in the slot layout the window keeps a ring
    of window + max_chunk - 1 positions instead of the full-length cache (Gemma 3's sliding
    layers; a paged cache pages it as any other layer, the window a mask);
    spans: the layer reads the step's image spans (bidirectional image runs); window_over_spans:
    the window bounds span keys too (Gemma 4's order: (causal | span) & window); chunk: chunked
    (local) attention, each query over its own `chunk`-position block of the sequence (Llama 4;
    the segmented cache, a mask rather than a window: `MaskSpec.chunk`)."""

    def __init__(self, *, layer_idx: int, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 qkv_bias: bool = False, o_bias: bool = False, qk_norm: str | None = None, norm_eps: float = 1e-6,
                 scale: float | None = None, softcap: float | None = None, sliding_window: int | None = None,
                 ring: bool = False, spans: bool = True, window_over_spans: bool = False, chunk: int | None = None,
                 dtype=jnp.float32):
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale, self.softcap, self.sliding_window, self.ring = scale, softcap, sliding_window, ring
        self.spans, self.window_over_spans, self.chunk = spans, window_over_spans, chunk
        self.qkv_proj = FusedLinear(hidden_size, (Part("q_proj", num_heads * head_dim, "heads", head_dim),
                                                  Part("k_proj", num_kv_heads * head_dim, "kv_heads", head_dim),
                                                  Part("v_proj", num_kv_heads * head_dim, "kv_heads", head_dim)),
                                    bias=qkv_bias, dtype=dtype)
        self.o_proj = Linear(num_heads * head_dim, hidden_size, bias=o_bias, dtype=dtype, axes=("heads", "embed"))
        if qk_norm is not None:
            self.q_norm = RMSNorm(head_dim, norm_eps, kind=qk_norm, dtype=dtype)
            self.k_norm = RMSNorm(head_dim, norm_eps, kind=qk_norm, dtype=dtype)
        else:
            self.q_norm = self.k_norm = None

    def hf_weights(self, w, name: str) -> None:
        self.qkv_proj.hf_weights(w, f"{name}.")
        self.o_proj.hf_weights(w, f"{name}.o_proj")
        if self.q_norm is not None:
            self.q_norm.hf_weights(w, f"{name}.q_norm")
            self.k_norm.hf_weights(w, f"{name}.k_norm")

    # ---- the cache -----------------------------------------------------------------------------
    def init_cache(self, num_slots: int, max_len: int, dtype, *, max_chunk: int | None = None, tp: int = 1,
                   pages: tuple[int, int] | None = None) -> dict:
        """This layer's zero cache: a ring of `ring_len` positions, or segments over max_len
        (`kv_segments`); KV heads replicated to tp when fewer (`cache_kv_heads`). pages
        (num_pages, page_size): a pool of pages instead (rows = pages, one segment of page_size
        positions; the step's `AttentionMetadata.pages` maps cache rows to them), for a ring
        layer too: paged, a sliding layer reads its row's pages under the window mask, as a
        windowed layer of the segmented cache does (the ring is the slot layout's)."""
        heads = cache_kv_heads(self.num_kv_heads, tp)
        if pages is not None:
            return kv_layer(pages[0], heads, self.head_dim, [pages[1]], dtype)
        cuts = [ring_len(self.sliding_window, max_len, max_chunk)] if self.ring else kv_segments(max_len)
        return kv_layer(num_slots, heads, self.head_dim, cuts, dtype)

    # ---- the layer -----------------------------------------------------------------------------
    def project(self, x: jax.Array, rope: tuple) -> tuple[jax.Array, jax.Array, jax.Array]:
        """x [b, t, hidden] -> q [b, t, heads, hd], k, v [b, t, KV heads held, hd], RoPE applied."""
        b, t, _ = x.shape
        hd = self.head_dim
        q, k, v = (y.reshape(b, t, -1, hd) for y in self.qkv_proj(x))
        if self.q_norm is not None:     # per head, before RoPE (local to a shard under TP)
            q, k = self.q_norm(q), self.k_norm(k)
        cos, sin = rope
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def __call__(self, x: jax.Array, rope: tuple, meta: AttentionMetadata, kv: dict) -> tuple[jax.Array, dict]:
        """x [b, t, hidden] (normed), rope (cos, sin) [b, t, head_dim] -> (out [b, t, hidden],
        this layer's updated cache)."""
        b, t, _ = x.shape
        q, k, v = self.project(x, rope)
        out, kv = self.attend(q, k, v, meta.layer(self.layer_idx), kv)
        return self.o_proj(out.reshape(b, t, -1)), kv

    def attend(self, q: jax.Array, k: jax.Array | None, v: jax.Array | None, meta: AttentionMetadata,
               kv: dict) -> tuple[jax.Array, dict]:
        """Write k, v (None: a layer reading another layer's cache, written already) and attend
        q over the cache -> (out [b, t, heads, hd], the cache)."""
        if self.ring and meta.pages is None:
            return self._attend_ring(q, k, v, meta, kv)
        return self._attend_segments(q, k, v, meta, kv)

    def _mask(self, meta: AttentionMetadata) -> MaskSpec | None:
        return meta.mask(self.sliding_window, spans=self.spans, chunk=self.chunk)

    def _full(self, q, kts, vs, q_index, kv_len, slots, mask, starts, reduce_small, scales, pages=None):
        if self.softcap is None:
            return cache_attention(q, kts, vs, q_index, kv_len, slots, mask=mask, starts=starts,
                                   reduce_small=reduce_small, scale=self.scale, scales=scales,
                                   window_over_spans=self.window_over_spans, pages=pages)
        if pages is not None:         # the dense rows of the pages (one block, as the slot layout)
            kts, vs, scales = dense_rows({"k": kts, "v": vs, **_scale_dict(scales)}, pages, slots, q.shape[0])
            slots = None
        return softcapped_attention(q, kts, vs, q_index, kv_len, slots, mask=mask, starts=starts, scale=self.scale,
                                    cap=self.softcap, scales=scales)

    def _attend_segments(self, q, k, v, meta: AttentionMetadata, kv: dict) -> tuple[jax.Array, dict]:
        mask, q_index, packing, pages = self._mask(meta), meta.q_index, meta.packing, meta.pages
        capture = meta.captures(self.layer_idx)
        # CPU decode: the kernel writes the new K / V itself, then attends (no scatter into
        # every segment: a handful of small XLA ops per segment and layer)
        if (k is not None and packing is None and not capture and self.softcap is None
                and attention_kernel(q.shape[1], meta.slots, mask, kv["k"], kv["v"], layer_scales(kv), pages) == "cpu"):
            return cpu_decode_write(q, k, v, kv, q_index[:, 0], meta.kv_len, mask, self.scale, pages)
        if k is not None:
            kv = scatter_kv(kv, k, v, q_index, meta.write_rows, pages)
        scales = layer_scales(kv)
        if packing is not None:         # each query block over its own sequence's cache row
            attn = packing.attend(lambda qb, blk: self._full(
                qb, kv["k"], kv["v"], blk.q_index, blk.kv_len, blk.slots, blk.mask, blk.starts, meta.reduce_small,
                scales, pages), q, mask)
            if packing.riders is not None:     # rows [0, D) as a decode step reads them (after the write)
                ride = packing.riders
                window = (None if self.sliding_window is None and self.chunk is None
                          else MaskSpec(sliding_window=self.sliding_window, chunk=self.chunk))
                attn = packing.with_riders(attn, self._full(
                    packing.rider_queries(q), kv["k"], kv["v"], ride.index[:, None], ride.kv_len, None, window,
                    ride.index, meta.reduce_small, scales, pages))
            return attn, kv
        if capture:
            kts, vs, slots = kv["k"], kv["v"], meta.slots
            if pages is not None:
                kts, vs, scales = dense_rows(kv, pages, slots, q.shape[0])
                slots = None
            attn, probs = explicit_attention(q, kts, vs, q_index, meta.kv_len, slots, mask=mask,
                                             starts=meta.starts, scale=self.scale, scales=scales,
                                             window_over_spans=self.window_over_spans, cap=self.softcap)
            self._sow(probs, attn)
            return attn, kv
        return self._full(q, kv["k"], kv["v"], q_index, meta.kv_len, meta.slots, mask, meta.starts,
                          meta.reduce_small, scales, pages), kv

    def _attend_ring(self, q, k, v, meta: AttentionMetadata, kv: dict) -> tuple[jax.Array, dict]:
        b, t = q.shape[:2]
        window, cap, scale = self.sliding_window, self.softcap, self.scale
        q_index, kv_len, packing, starts = meta.q_index, meta.kv_len, meta.packing, meta.starts
        spans = meta.spans if self.spans else None
        ring = kv["v"][0].shape[2]
        # padding, and rows past kv_len (decode rows of free slots, parked there by the engine),
        # are dropped (an index past the ring) so they never evict a position a later resume
        # needs; real tokens of one call are <= ring apart, so their slots are distinct
        valid = meta.token_valid
        idx = jnp.where(valid & (q_index < kv_len), jnp.mod(q_index, ring), ring + jnp.arange(t))
        kv = {name: [a] for name, a in scatter_segment(kv, 0, meta.write_rows, idx, quantize_kv(kv, k, v)).items()}
        ring_scales = layer_scales(kv)
        take = (lambda a: a[:b]) if meta.slots is None else (lambda a: a[meta.slots])   # noqa: E731
        if packing is not None:
            def blocks(qb, blk):    # query blocks of a packed row, each over its sequence's ring
                m = blk.mask
                vis = ring_visible(ring_key_index(blk.ends, ring), blk.q_index, window,
                                   None if m is None else m.spans, blk.starts, None if m is None else m.key_spans)
                sl = blk.slots
                sc = None if ring_scales is None else (ring_scales[0][0][sl], ring_scales[1][0][sl])
                return ring_attention(qb, kv["k"][0][sl], kv["v"][0][sl], vis, scale, cap, sc)
            attn = packing.attend(blocks, q, MaskSpec(spans=spans) if spans is not None else None)
            if packing.riders is not None:     # rows [0, D) of the ring, as a decode step reads them
                ride = packing.riders
                d = ride.index.shape[0]
                sc = None if ring_scales is None else (ring_scales[0][0][:d], ring_scales[1][0][:d])
                vis = ring_visible(ring_key_index(ride.index + 1, ring), ride.index[:, None], window, None, ride.index)
                attn = packing.with_riders(attn, ring_attention(
                    packing.rider_queries(q), kv["k"][0][:d], kv["v"][0][:d], vis, scale, cap, sc))
            return attn, kv
        kts, vs = take(kv["k"][0]), take(kv["v"][0])
        scales = None if ring_scales is None else (take(ring_scales[0][0]), take(ring_scales[1][0]))
        key_index = ring_key_index(starts + valid.sum(axis=1).astype(starts.dtype), ring)
        if meta.captures(self.layer_idx):
            if scales is not None:    # research capture: dequantized (materialised) like the rest of it
                kts, vs = dequantize(kts, scales[0], 2, q.dtype), dequantize(vs, scales[1], 3, q.dtype)
            attn, probs = captured_attention(q, kts, vs, key_index, q_index, window, spans, starts, scale, cap, kv_len)
            self._sow(probs, attn)
            return attn, kv
        vis = ring_visible(key_index, q_index, window, spans, starts)
        return ring_attention(q, kts, vs, vis, scale, cap, scales), kv

    def _sow(self, probs: jax.Array, out: jax.Array) -> None:
        """A captured layer's attention probabilities [b, heads, t, kv_len] and per-head outputs
        [b, t, heads, hd] (before o_proj)."""
        sow(self, "attn_probs", probs)
        sow(self, "attn_out", out)


class VisionAttention(nnx.Module):
    """Full (bidirectional) multi-head attention of a ViT block: q_proj, k_proj, v_proj, out_proj
    (or `o_name`), all with biases by default; the heads' logical axis is "vision_heads"
    (replicated unless the tower is tensor parallel)."""

    def __init__(self, d: int, heads: int, *, bias: bool = True, o_name: str = "out_proj", dtype=jnp.float32):
        self.heads, self.o_name = heads, o_name
        self.q_proj = Linear(d, d, bias=bias, dtype=dtype, axes=("embed", "vision_heads"))
        self.k_proj = Linear(d, d, bias=bias, dtype=dtype, axes=("embed", "vision_heads"))
        self.v_proj = Linear(d, d, bias=bias, dtype=dtype, axes=("embed", "vision_heads"))
        self.out_proj = Linear(d, d, bias=bias, dtype=dtype, axes=("vision_heads", "embed"))

    def __call__(self, x: jax.Array, **kw) -> jax.Array:
        """x [b, s, d] -> [b, s, d]; kw: `mmjax.attention.attention` options (lengths, segment_ids)."""
        b, s, d = x.shape
        hd = d // self.heads
        q, k, v = (p(x).reshape(b, s, self.heads, hd) for p in (self.q_proj, self.k_proj, self.v_proj))
        return self.out_proj(attention(q, k, v, **kw).reshape(b, s, d))

    def hf_weights(self, w, name: str) -> None:
        for n in ("q_proj", "k_proj", "v_proj"):
            getattr(self, n).hf_weights(w, f"{name}.{n}")
        self.out_proj.hf_weights(w, f"{name}.{self.o_name}")
