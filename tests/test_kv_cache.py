"""The segmented slot KV cache (models/decoder.py): attention over consecutive segments equals
plain causal attention, segments past kv_len are skipped (also when kv_len is traced), new tokens
land in the right segment."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mmjax.config import RopeConfig, TextConfig
from mmjax.models import decoder


def naive_attention(q, k, v, q_index):
    """float64 oracle: q [b, t, h, hd], k/v [b, kvh, s, hd] (one piece), GQA by h // (h / kvh)."""
    b, t, h, hd = q.shape
    g = h // k.shape[1]
    out = np.zeros(q.shape)
    for i in range(b):
        for j in range(t):
            for head in range(h):
                kk, vv = k[i, head // g], v[i, head // g]
                s = kk @ q[i, j, head] / np.sqrt(hd)
                s[np.arange(len(s)) > q_index[i, j]] = -np.inf
                p = np.exp(s - s.max())
                out[i, j, head] = (p / p.sum()) @ vv
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
                                  split_cache(v, segments), jnp.asarray(q_index), s)
    np.testing.assert_allclose(np.asarray(out), naive_attention(q, k, v, q_index), rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("min_calls", [0, 10 ** 9])
@pytest.mark.parametrize("traced", [False, True])
def test_segments_past_kv_len_are_not_read(traced, min_calls, monkeypatch):
    """NaN keys/values from kv_len on: a segment that were computed would turn the output NaN
    (0 * NaN); with kv_len covering every query the output equals the oracle on the prefix."""
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
    f = lambda q, n: decoder.cache_attention(q, ks, vs, jnp.asarray(q_index), n)
    out = jax.jit(f)(jnp.asarray(q, jnp.float32), jnp.int32(kv_len)) if traced else \
        f(jnp.asarray(q, jnp.float32), kv_len)
    want = naive_attention(q, k[:, :, :3 * seg], v[:, :, :3 * seg], q_index)
    np.testing.assert_allclose(np.asarray(out), want, rtol=2e-5, atol=2e-5)
    out_all = f(jnp.asarray(q, jnp.float32), 6 * seg)   # reading them does poison the output
    assert np.isnan(np.asarray(out_all)).all()


def tiny_text(layers=2):
    return TextConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=layers, num_heads=4,
                      num_kv_heads=2, head_dim=8, rms_norm_eps=1e-6, max_position_embeddings=64,
                      rope=RopeConfig(theta=10000.0),
                      tie_word_embeddings=False, attention_bias=False, mlp_bias=False)


def random_params(cfg, rng):
    d, hd = cfg.hidden_size, cfg.head_dim
    qkv_out = (cfg.num_heads + 2 * cfg.num_kv_heads) * hd
    w = lambda *s: jnp.asarray(0.2 * rng.standard_normal(s), jnp.float32)
    layer = lambda: {"ln1": w(d) + 1, "qkv": {"w": w(d, qkv_out)}, "o": {"w": w(cfg.num_heads * hd, d)},
                     "ln2": w(d) + 1, "gate_up": {"w": w(d, 2 * cfg.intermediate_size)},
                     "down": {"w": w(cfg.intermediate_size, d)}}
    return {"embed": w(cfg.vocab_size, d), "layers": [layer() for _ in range(cfg.num_layers)],
            "norm": w(d) + 1, "lm_head": w(d, cfg.vocab_size)}


@pytest.mark.parametrize("min_calls", [0, 10 ** 9])  # decode steps: broadcast-reduce / dots
def test_segmented_cache_equals_one_piece_across_boundaries(min_calls, monkeypatch):
    """Prefill 11 tokens of slot 1 in a chunk that crosses segment boundaries, then decode two
    steps for both slots with a traced kv_len of 16 (4 of 8 segments of 4): the hidden states
    and the written K/V equal those of a one-segment cache read in full (keys past each query
    are masked either way); nothing is written past kv_len or into other slots' rows."""
    monkeypatch.setattr(decoder, "SMALL_N_MIN_CALLS", min_calls)
    cfg = tiny_text()
    rng = np.random.default_rng(0)
    params = random_params(cfg, rng)
    caches = {"one": decoder.init_kv_cache(cfg, 2, 32, jnp.float32, segment=32),
              "seg": decoder.init_kv_cache(cfg, 2, 32, jnp.float32, segment=4)}
    assert [c.shape[2] for c in caches["seg"][0]["v"]] == [4] * 8
    assert [c.shape[3] for c in caches["seg"][0]["k"]] == [4] * 8
    emb = jnp.asarray(rng.standard_normal((1, 11, cfg.hidden_size)), jnp.float32)
    pos = jnp.arange(11)[None]
    forward = jax.jit(lambda cache, e, p, starts, n, slots: decoder.forward(params, cfg, e, p, cache, starts, n,
                                                                          slots=slots))
    decode = jax.jit(lambda cache, e, p, starts, n: decoder.forward(params, cfg, e, p, cache, starts, n))
    outs = {}
    for name, cache in caches.items():
        kv_len = jnp.int32(16 if name == "seg" else 32)
        h1, cache = forward(cache, emb, pos, jnp.array([0]), kv_len, jnp.array([1]))
        hs = [h1]
        for step in range(2):
            e = jnp.asarray(np.random.default_rng(step).standard_normal((2, 1, cfg.hidden_size)), jnp.float32)
            starts = jnp.array([3 + step, 11 + step])  # slot 0 holds stale zeros: still valid keys
            h, cache = decode(cache, e, starts[:, None], starts, kv_len)
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
    assert decoder.kv_segments(600) == (128, 128, 128, 128, 88)
    assert decoder.kv_segments(1024) == (128,) * 8
    assert decoder.kv_segments(2048) == (128,) * 8 + (1024,)
    assert decoder.kv_segments(40) == (40,)
    big = decoder.kv_segments(32768)
    assert big == (128,) * 8 + (1024, 2048, 4096, 8192, 16384) and sum(decoder.kv_segments(5000)) == 5000
