"""The segmented slot KV cache (models/nn/kv_cache.py): attention over consecutive segments equals
plain causal attention, segments past kv_len are skipped (also when kv_len is traced), new tokens
land in the right segment; mask specs (sliding window, bidirectional spans) and captured
intermediates (hidden states, attention probabilities) against float64 oracles; packed prefill's
query blocks (models/nn/packing.py) against one-sequence attention."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dataclasses

from flax import nnx

from mmjax.backend import cpu_kernels
from mmjax.kernels import cpu_attention
from mmjax.models.nn import kv_cache as decoder
from mmjax.models.nn.capture import Capture, captured
from mmjax.models.nn.kv_cache import kv_layer, kv_segments, ring_key_index, ring_visible
from mmjax.models.nn.metadata import AttentionMetadata, MaskSpec
from mmjax.models.nn.rope import RopeConfig
from mmjax.models.text.llama import LlamaConfig as TextConfig
from mmjax.models.text.llama import LlamaModel


def naive_attention(q, k, v, q_index, visible=None, probs_out=None):
    """float64 oracle: q [b, t, h, hd], k/v [b, kvh, s, hd] (one piece), GQA by h // (h / kvh).
    visible(i, j, key) -> bool overrides plain causality; probs_out [b, h, t, s] receives the
    softmax."""
    b, t, h, hd = q.shape
    g = h // k.shape[1]
    out = np.zeros(q.shape)
    for i in range(b):
        for j in range(t):
            for head in range(h):
                kk, vv = k[i, head // g], v[i, head // g]
                s = kk @ q[i, j, head] / np.sqrt(hd)
                keys = np.arange(len(s))
                vis = keys <= q_index[i, j] if visible is None else np.array([visible(i, j, x) for x in keys])
                s[~vis] = -np.inf
                p = np.exp(s - s.max())
                out[i, j, head] = (p / p.sum()) @ vv
                if probs_out is not None:
                    probs_out[i, head, j] = p / p.sum()
    return out


def split_cache(x, segments, transpose=False):
    """[b, kvh, s, hd] -> segments along s ([b, kvh, hd, len_i] with transpose: the K layout)."""
    parts = np.split(x, np.cumsum(segments)[:-1], axis=2)
    return [jnp.asarray(p.swapaxes(2, 3) if transpose else p, jnp.float32) for p in parts]


@pytest.mark.parametrize("t,min_calls", [(2, 0), (2, 10 ** 9), (6, 0)])  # broadcast-reduce / dots / dots
@pytest.mark.parametrize("segments", [(16,), (3, 5, 8), (1, 15), (8, 8)])
def test_attention_over_segments_matches_oracle(segments, t, min_calls, monkeypatch):
    """Both formulations of a segment (decode's broadcast-multiply-reduce, the dots) against the
    float64 oracle; t = 6 is 12 queries per KV head, over SMALL_N: dots whatever the batch."""
    monkeypatch.setattr(decoder, "SMALL_N_MIN_CALLS", min_calls)
    rng = np.random.default_rng(sum(segments) + len(segments))
    b, h, kvh, hd, s = 3, 4, 2, 8, sum(segments)
    q = rng.standard_normal((b, t, h, hd))
    k = rng.standard_normal((b, kvh, s, hd))
    v = rng.standard_normal((b, kvh, s, hd))
    q_index = np.array([0, 5, s - t])[:, None] + np.arange(t)  # first key / mid segment / last key
    out = decoder.cache_attention(jnp.asarray(q, jnp.float32), split_cache(k, segments, True),
                                  split_cache(v, segments), jnp.asarray(q_index), s, reduce_small=True)
    np.testing.assert_allclose(np.asarray(out), naive_attention(q, k, v, q_index), rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("min_calls", [0, 10 ** 9])
@pytest.mark.parametrize("traced", [False, True])
def test_segments_past_kv_len_are_not_read(traced, min_calls, monkeypatch):
    """NaN keys/values from kv_len on: a segment that were computed would turn the output NaN
    (0 * NaN); with kv_len covering every query the output equals the oracle on the prefix. XLA's
    path (cpu_kernels(False)); the CPU kernel reads each row's own keys only, so it never meets
    the NaNs, even told that every segment is in use."""
    monkeypatch.setattr(decoder, "SMALL_N_MIN_CALLS", min_calls)
    rng = np.random.default_rng(7)
    b, t, h, kvh, hd, seg = 2, 1, 4, 2, 8, 4
    q = rng.standard_normal((b, t, h, hd))
    k = rng.standard_normal((b, kvh, 6 * seg, hd))
    v = rng.standard_normal((b, kvh, 6 * seg, hd))
    q_index = np.array([[5], [9]])
    kv_len = 10                                   # segments 0-2 are read, 3-5 must not be
    k[:, :, 3 * seg:] = np.nan
    v[:, :, 3 * seg:] = np.nan
    ks, vs = split_cache(k, (seg,) * 6, True), split_cache(v, (seg,) * 6)
    f = lambda q, n: decoder.cache_attention(q, ks, vs, jnp.asarray(q_index), n, reduce_small=True)  # noqa: E731
    want = naive_attention(q, k[:, :, :3 * seg], v[:, :, :3 * seg], q_index)
    with cpu_kernels(False):
        out = jax.jit(f)(jnp.asarray(q, jnp.float32), jnp.int32(kv_len)) if traced else \
            f(jnp.asarray(q, jnp.float32), kv_len)
        np.testing.assert_allclose(np.asarray(out), want, rtol=2e-5, atol=2e-5)
        out_all = f(jnp.asarray(q, jnp.float32), 6 * seg)   # reading them does poison the output
        assert np.isnan(np.asarray(out_all)).all()
    assert cpu_attention.covers(ks, vs)
    np.testing.assert_allclose(np.asarray(f(jnp.asarray(q, jnp.float32), 6 * seg)), want, rtol=2e-5, atol=2e-5)


def tiny_text(layers=2):
    return TextConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=layers, num_heads=4,
                      num_kv_heads=2, head_dim=8, rms_norm_eps=1e-6, max_position_embeddings=64,
                      rope=RopeConfig(theta=10000.0),
                      tie_word_embeddings=False, attention_bias=False, mlp_bias=False)


def random_model(cfg, rng) -> LlamaModel:
    """The decoder with random weights (norm scales around 1)."""
    model = LlamaModel(cfg)
    flat = nnx.to_flat_state(nnx.state(model))
    nnx.update(model, nnx.from_flat_state([
        (path, v.replace(jnp.asarray(0.2 * rng.standard_normal(v.get_value().shape) + (path[-1] == "scale"),
                                     jnp.float32))) for path, v in flat]))
    return model


def segmented_cache(cfg, slots, max_len, segment):
    return [kv_layer(slots, cfg.num_kv_heads, cfg.head_dim, kv_segments(max_len, segment), jnp.float32)
            for _ in range(cfg.num_layers)]


@pytest.mark.parametrize("min_calls", [0, 10 ** 9])  # decode steps: broadcast-reduce / dots
def test_segmented_cache_equals_one_piece_across_boundaries(min_calls, monkeypatch):
    """Prefill 11 tokens of slot 1 in a chunk that crosses segment boundaries, then decode two
    steps for both slots with a traced kv_len of 16 (the 4 segments of 4 before one of 16): the hidden states
    and the written K/V equal those of a one-segment cache read in full (keys past each query
    are masked either way); nothing is written past kv_len or into other slots' rows."""
    monkeypatch.setattr(decoder, "SMALL_N_MIN_CALLS", min_calls)
    cfg = tiny_text()
    rng = np.random.default_rng(0)
    model = random_model(cfg, rng)
    caches = {"one": segmented_cache(cfg, 2, 32, 32), "seg": segmented_cache(cfg, 2, 32, 4)}
    assert [c.shape[2] for c in caches["seg"][0]["v"]] == [4] * 4 + [16]       # the CPU ladder: 4 fine ones
    assert [c.shape[3] for c in caches["seg"][0]["k"]] == [4] * 4 + [16]
    emb = jnp.asarray(rng.standard_normal((1, 11, cfg.hidden_size)), jnp.float32)
    pos = jnp.arange(11)[None, None]
    forward = jax.jit(lambda cache, e, p, starts, n, slots: model(
        e, AttentionMetadata(p, starts, n, slots=slots, reduce_small=True), cache))
    decode = jax.jit(lambda cache, e, p, starts, n: model(e, AttentionMetadata(p, starts, n, reduce_small=True), cache))
    outs = {}
    for name, cache in caches.items():
        kv_len = jnp.int32(16 if name == "seg" else 32)
        h1, cache = forward(cache, emb, pos, jnp.array([0]), kv_len, jnp.array([1]))
        hs = [h1]
        for step in range(2):
            e = jnp.asarray(np.random.default_rng(step).standard_normal((2, 1, cfg.hidden_size)), jnp.float32)
            starts = jnp.array([3 + step, 11 + step])  # slot 0 holds stale zeros: still valid keys
            h, cache = decode(cache, e, starts[None, :, None], starts, kv_len)
            hs.append(h)
        outs[name] = (hs, cache)
    for a, b in zip(outs["one"][0], outs["seg"][0]):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)
    for one, seg in zip(outs["one"][1], outs["seg"][1]):
        for name in ("k", "v"):
            joined = np.concatenate([np.asarray(x) for x in seg[name]], axis=3 if name == "k" else 2)
            (whole,) = one[name]
            np.testing.assert_allclose(joined, np.asarray(whole), rtol=1e-5, atol=1e-6)
            if name == "k":
                joined = joined.swapaxes(2, 3)
            assert np.all(joined[:, :, 16:] == 0)           # past kv_len: untouched
            assert np.all(joined[1, :, :13] != 0) and np.all(joined[1, :, 13:] == 0)


def test_kv_segments_cut_max_len():
    # the CPU: 4 x 256, then doubling (backend.Tuning.kv_segment_ladder)
    assert decoder.kv_segments(600) == (256, 256, 88)
    assert decoder.kv_segments(1024) == (256,) * 4
    assert decoder.kv_segments(2048) == (256,) * 4 + (1024,)
    assert decoder.kv_segments(40) == (40,)
    big = decoder.kv_segments(32768)
    assert big == (256,) * 4 + (1024, 2048, 4096, 8192, 16384) and sum(decoder.kv_segments(5000)) == 5000
    assert decoder.kv_segments(1024, 128, 8) == (128,) * 8
    from mmjax.backend import compiling_for
    with compiling_for("cuda"):     # GPUs: 512 positions, then doubling (backend.Tuning.kv_segment_ladder)
        assert decoder.kv_segments(2048) == (512, 512, 1024) and decoder.kv_segments(300) == (300,)
        assert decoder.kv_segments(32768) == (512, 512, 1024, 2048, 4096, 8192, 16384)


def _qkv(rng, b, t, h, kvh, hd, s):
    return (rng.standard_normal((b, t, h, hd)), rng.standard_normal((b, kvh, s, hd)),
            rng.standard_normal((b, kvh, s, hd)))


@pytest.mark.parametrize("segments", [(16,), (4, 4, 8)])
def test_sliding_window_and_spans_match_oracle(segments):
    """MaskSpec: a sliding window of 3 and bidirectional spans (two spans in row 0's chunk, one
    in row 1's; -1 elsewhere) against the float64 oracle, in both attention paths (segmented
    online softmax and the explicit one that returns probabilities)."""
    rng = np.random.default_rng(3)
    b, t, h, kvh, hd, s = 2, 6, 4, 2, 8, sum(segments)
    q, k, v = _qkv(rng, b, t, h, kvh, hd, s)
    starts = np.array([4, 9])
    q_index = starts[:, None] + np.arange(t)
    spans = np.array([[-1, 0, 0, 0, -1, 1], [2, 2, 2, 2, 2, -1]], np.int32)
    for window, use_spans in ((3, False), (None, True), (4, True)):
        def visible(i, j, key):
            causal = key <= q_index[i, j] and (window is None or q_index[i, j] - key < window)
            if not use_spans:
                return causal
            kj = key - starts[i]
            same = 0 <= kj < t and spans[i, j] >= 0 and spans[i, kj] == spans[i, j]
            return causal or same
        probs = np.zeros((b, h, t, s))
        want = naive_attention(q, k, v, q_index, visible, probs)
        mask = MaskSpec(sliding_window=window, spans=jnp.asarray(spans) if use_spans else None)
        args = (jnp.asarray(q, jnp.float32), split_cache(k, segments, True), split_cache(v, segments),
                jnp.asarray(q_index))
        out = decoder.cache_attention(*args, s, mask=mask, starts=jnp.asarray(starts))
        np.testing.assert_allclose(np.asarray(out), want, rtol=2e-5, atol=2e-5)
        out2, p2 = decoder.explicit_attention(*args, s, mask=mask, starts=jnp.asarray(starts))
        np.testing.assert_allclose(np.asarray(out2), want, rtol=2e-5, atol=2e-5)
        np.testing.assert_allclose(np.asarray(p2), probs, rtol=2e-5, atol=2e-6)
        assert not np.allclose(want, naive_attention(q, k, v, q_index))   # the mask mattered



@pytest.mark.parametrize("block,group", [(4, 8), (32, 128)])
def test_packed_query_blocks_equal_one_sequence_attention(block, group, monkeypatch):
    """Packing.attend (models/text/packing.py): three sequences packed back to back in a 32-token
    row (lengths 11, 3, 17: not multiples of the block, one several blocks long; slots 2, 0, 3;
    starts 5, 0, 20 as after earlier chunks / prefix hits; an unused fourth segment; one padding
    token), with image spans crossing block edges, a sliding window, both, or no mask: each
    token's output equals its sequence's own one-sequence prefill attention. Blocks of 4 in
    groups of 2 (a lax.map step each; groups past the used blocks skipped, one half used), or
    one block of 32 per sequence in one group; the three sequences take more blocks than
    ceil(T / B). One sequence alone takes the whole-row path, which the block layout matches. Gemma 3's ring visibility (key_spans of a block within a longer segment) matches
    per block."""
    from mmjax.models.nn import packing as pk
    monkeypatch.setattr(pk, "QUERY_BLOCK", block)
    monkeypatch.setattr(pk, "GROUP_QUERIES", group)
    rng = np.random.default_rng(11)
    slots, h, kvh, hd, cuts, t = 4, 4, 2, 8, (16, 16, 32), 32
    k = rng.standard_normal((slots, kvh, sum(cuts), hd))
    v = rng.standard_normal((slots, kvh, sum(cuts), hd))
    kts, vs = split_cache(k, cuts, True), split_cache(v, cuts)
    q = jnp.asarray(rng.standard_normal((1, t, h, hd)), jnp.float32)
    spans = np.full(t, -1, np.int32)
    spans[3:9] = 0              # three sequences: tokens 3..8 of the first, 0..9 and 12..14 of the third
    spans[14:24] = 0
    spans[26:29] = 1
    attend = jax.jit(lambda p, q, m: p.attend(lambda qb, blk: decoder.cache_attention(
        qb, kts, vs, blk.q_index, blk.kv_len, blk.slots, mask=blk.mask, starts=blk.starts), q, m))
    blocked = jax.jit(lambda p, q, m: p._attend_blocks(lambda qb, blk: decoder.cache_attention(
        qb, kts, vs, blk.q_index, blk.kv_len, blk.slots, mask=blk.mask, starts=blk.starts), q, m))
    one_sequence = jax.jit(lambda q, q_index, kv_len, slot, mask, starts: decoder.cache_attention(
        q, kts, vs, q_index, kv_len, slot, mask=mask, starts=starts))
    for seg_slot, seg_start, seg_len in (([2, 0, 3, slots], [5, 0, 20, 0], [11, 3, 17, 0]),
                                         ([1, slots, slots, slots], [30, 0, 0, 0], [29, 0, 0, 0])):
        seg_offset = np.cumsum([0] + seg_len[:-1])
        token_seg = np.full(t, max(i for i in range(4) if seg_len[i]), np.int32)
        for i in range(4):
            token_seg[seg_offset[i]:seg_offset[i] + seg_len[i]] = i
        packing = pk.Packing(*(jnp.asarray(x, jnp.int32) for x in (seg_slot, seg_start, seg_offset, seg_len,
                                                                   token_seg)))
        for window, use_spans in ((None, False), (None, True), (6, True)):
            mask = None if window is None and not use_spans else \
                MaskSpec(sliding_window=window, spans=jnp.asarray(spans[None]) if use_spans else None)
            packed = attend(packing, q, mask)
            if sum(map(bool, seg_len)) == 1:    # one sequence: the whole-row path; the block layout agrees
                n = seg_len[0]
                np.testing.assert_allclose(np.asarray(blocked(packing, q, mask)[:, :n]), np.asarray(packed[:, :n]),
                                           rtol=1e-5, atol=1e-5)
            for i in (i for i in range(4) if seg_len[i]):
                # the sequence alone: its n tokens first in a row of t (the rest padding, span -1)
                o, n, st = seg_offset[i], seg_len[i], seg_start[i]
                alone = np.roll(spans, -o)
                alone[n:] = -1
                one = None if mask is None else MaskSpec(sliding_window=window, spans=None if not use_spans else
                                                         jnp.asarray(alone[None]))
                want = one_sequence(jnp.roll(q, -o, axis=1), jnp.asarray(st + np.arange(t))[None], st + n,
                                    jnp.asarray([seg_slot[i]]), one, jnp.asarray([st]))
                np.testing.assert_allclose(np.asarray(packed[:, o:o + n]), np.asarray(want[:, :n]), rtol=1e-5,
                                           atol=1e-5)
        # Gemma 3's sliding-window ring (ring_visible) sees the same keys per block as per sequence
        blocks, _ = packing.blocks(MaskSpec(spans=jnp.asarray(spans[None])))
        vis = np.asarray(ring_visible(ring_key_index(blocks.ends, 16), blocks.q_index, 6, blocks.mask.spans,
                                      blocks.starts, blocks.mask.key_spans))
        used, slot_of, q_index = (np.asarray(x) for x in (blocks.used, blocks.slots, blocks.q_index))
        for i in (i for i in range(4) if seg_len[i]):
            o, n, st = seg_offset[i], seg_len[i], seg_start[i]
            want = np.asarray(ring_visible(ring_key_index(jnp.asarray([st + n]), 16),
                                           jnp.asarray(st + np.arange(n))[None], 6,
                                           jnp.asarray(np.roll(spans, -o)[None, :n]), jnp.asarray([st])))[0]
            mine = used & (slot_of == seg_slot[i])                      # its blocks (slots are distinct)
            local = q_index[mine] - st
            real = local < n
            assert real.sum() == n
            np.testing.assert_array_equal(vis[mine][real], want[local[real]])

def test_captured_intermediates_match_a_plain_layer_loop():
    """Capture(hidden=True, attn_layers=(1,)): hidden states are the residual stream after each
    layer (HF's hidden_states; the last one final-normed), layer 1's probabilities sum to 1 over
    visible keys and are zero on future ones, and capturing changes neither the logits nor the
    cache."""
    cfg = tiny_text()
    rng = np.random.default_rng(5)
    model = random_model(cfg, rng)
    t = 7
    emb = jnp.asarray(rng.standard_normal((1, t, cfg.hidden_size)), jnp.float32)
    pos = jnp.arange(t)[None, None]
    zero = jnp.zeros((1,), jnp.int32)
    meta = AttentionMetadata(pos, zero, 16)
    plain = model(emb, meta, segmented_cache(cfg, 1, 16, None))
    cap, inter = captured(lambda m, *a: m(*a), Capture(hidden=True, attn_layers=(1,)))(
        model, emb, dataclasses.replace(meta, capture=(1,)), segmented_cache(cfg, 1, 16, None))
    np.testing.assert_allclose(np.asarray(cap[0]), np.asarray(plain[0]), rtol=1e-5, atol=1e-5)
    hidden = inter["hidden"]
    assert len(hidden) == cfg.num_layers + 1
    np.testing.assert_array_equal(np.asarray(hidden[0]), np.asarray(emb))
    np.testing.assert_allclose(np.asarray(hidden[-1]), np.asarray(plain[0]), rtol=1e-5, atol=1e-5)
    x, _ = model.layers[0](emb, model.rope(pos), meta, segmented_cache(cfg, 1, 16, None)[0])
    np.testing.assert_allclose(np.asarray(hidden[1]), np.asarray(x), rtol=1e-5, atol=1e-5)
    probs = np.asarray(inter["attn"][1])                    # [1, heads, t, 16]
    assert probs.shape == (1, cfg.num_heads, t, 16)
    np.testing.assert_allclose(probs.sum(-1), 1.0, rtol=1e-5)
    for i in range(t):
        assert np.all(probs[0, :, i, i + 1:] == 0)
    assert inter["attn_out"][1].shape == (1, t, cfg.num_heads, cfg.head_dim)
    for a, b in zip(jax.tree.leaves(cap[1]), jax.tree.leaves(plain[1])):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("window,group,dtype", [(None, 4, jnp.float32), (9, 1, jnp.float32), (None, 8, jnp.bfloat16),
                                                (None, 4, jnp.int8), (9, 2, jnp.float8_e4m3fn)])
def test_gpu_ragged_decode_kernel_matches_oracle(window, group, dtype):
    """The GPU decode path (mmjax.attention.decode's Pallas kernel, interpreted here; the CUDA
    lowering is in test_cuda_lowering) as cache_attention takes it while compiling for CUDA: rows
    of different lengths, each reading only its own keys, over segments whose last one is not a
    multiple of the key block, with and without a sliding window, against the float64 oracle.
    int8 / fp8 caches (kv_quant: per-(token, head) scales): the kernel and the XLA path (the CPU
    one, scales applied to scores and weights) both equal the oracle over the dequantized
    cache to float32 rounding, so the quantization error is all in the stored values."""
    from mmjax.backend import compiling_for
    from mmjax.models.nn import kv_quant
    rng = np.random.default_rng(group)
    segments = (32, 32, 20)
    b, kvh, hd, s = 4, 2, 16, sum(segments)
    h = kvh * group
    q = rng.standard_normal((b, 1, h, hd))
    k = rng.standard_normal((b + 1, kvh, s, hd))          # one slot more than rows: rows [0, b) read
    v = rng.standard_normal((b + 1, kvh, s, hd))
    q_index = np.array([[0], [5], [70], [s - 1]])
    quant = kv_quant.is_quantized(dtype)
    scales = None
    if quant:
        (kq, ks), (vq, vs) = kv_quant.quantize(jnp.asarray(k), dtype), kv_quant.quantize(jnp.asarray(v), dtype)
        kt_segs, v_segs = split_cache(kq, segments, True), split_cache(vq, segments)
        kt_segs, v_segs = [x.astype(dtype) for x in kt_segs], [x.astype(dtype) for x in v_segs]
        cut = np.cumsum(segments)[:-1]
        scales = ([jnp.asarray(x) for x in np.split(np.asarray(ks), cut, axis=2)],
                  [jnp.asarray(x) for x in np.split(np.asarray(vs), cut, axis=2)])
        k = kv_quant.dequantize(kq, ks, 3, jnp.float32)         # what the cache holds
        v = kv_quant.dequantize(vq, vs, 3, jnp.float32)
        dtype = jnp.float32                                    # the queries' (model) dtype
    else:
        kt_segs, v_segs = ([x.astype(dtype) for x in split_cache(k, segments, True)],
                           [x.astype(dtype) for x in split_cache(v, segments)])
    mask = None if window is None else MaskSpec(sliding_window=window)
    with compiling_for("cuda"):
        jaxpr = str(jax.make_jaxpr(lambda *a: decoder.cache_attention(*a, jnp.int32(s), mask=mask, scales=scales))(
            jnp.asarray(q, dtype), kt_segs, v_segs, jnp.asarray(q_index)))
    # one kernel call over every segment of the layer: no per-segment lax.cond, launch or merge
    assert jaxpr.count("name=mmjax_ragged_decode_attention") == 1 and " cond[" not in jaxpr
    # the same path run here (outside compiling_for the kernel is interpreted)
    qn = jnp.asarray(q, dtype).reshape(b, kvh, group, hd)     # t = 1: [b, 1, kvh * g, hd] -> [b, kvh, g, hd]
    out = decoder._ragged_decode(qn, kt_segs, v_segs, jnp.asarray(q_index[:, 0]), jnp.int32(s), mask, None, scales)
    out = out.reshape(b, 1, h, hd)
    want = naive_attention(q, np.asarray(jnp.asarray(k, dtype).astype(jnp.float32)),
                           np.asarray(jnp.asarray(v, dtype).astype(jnp.float32)), q_index,
                           None if window is None else lambda i, j, x: x <= q_index[i, j] and q_index[i, j] - x < window)
    tol = 2e-5 if dtype == jnp.float32 else 3e-2
    np.testing.assert_allclose(np.asarray(out, np.float64), want, rtol=tol, atol=tol)
    if quant:      # XLA's path (sharded steps) over the same quantized cache
        args = (jnp.asarray(q, dtype), kt_segs, v_segs, jnp.asarray(q_index))
        with cpu_kernels(False):   # (int8 / fp8 caches on the CPU take mmjax.kernels.cpu_attention)
            xla = decoder.cache_attention(*args, jnp.int32(s), mask=mask, scales=scales)
            # scales go on the scores / weights: no product has a (dequantized) K or V segment's shape
            jaxpr = jax.make_jaxpr(lambda *a: decoder.cache_attention(*a, jnp.int32(s), mask=mask,
                                                                      scales=scales))(*args)
        np.testing.assert_allclose(np.asarray(xla, np.float64), want, rtol=tol, atol=tol)
        seg_shapes = {rows + tuple(x.shape[1:]) for x in kt_segs + v_segs for rows in ((b,), (b + 1,))}
        muls = [e for e in _all_eqns(jaxpr.jaxpr) if e.primitive.name == "mul"]
        assert muls and not [e for e in muls if tuple(e.outvars[0].aval.shape) in seg_shapes]


def _all_eqns(jaxpr):
    """Every equation of a jaxpr, sub-jaxprs (cond branches) included."""
    for e in jaxpr.eqns:
        yield e
        for p in e.params.values():
            for j in (p if isinstance(p, (tuple, list)) else [p]):
                if hasattr(j, "jaxpr") and hasattr(j.jaxpr, "eqns"):
                    yield from _all_eqns(j.jaxpr)
