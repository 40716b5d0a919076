"""The segmented slot KV cache (models/decoder.py): attention over consecutive segments equals
plain causal attention, new tokens land in the right segment, windows are segment boundaries."""
import jax.numpy as jnp
import numpy as np
import pytest

from mmjax.buckets import Buckets
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


@pytest.mark.parametrize("segments", [(16,), (3, 5, 8), (1, 15), (8, 8)])
def test_attention_over_segments_matches_oracle(segments):
    rng = np.random.default_rng(sum(segments) + len(segments))
    b, t, h, kvh, hd, s = 3, 2, 4, 2, 8, sum(segments)
    q = rng.standard_normal((b, t, h, hd))
    k = rng.standard_normal((b, kvh, s, hd))
    v = rng.standard_normal((b, kvh, s, hd))
    q_index = np.array([[0, 1], [6, 7], [14, 15]])  # first key only / mid segment / last key
    cuts = np.cumsum(segments)[:-1]
    ks = [jnp.asarray(x, jnp.float32) for x in np.split(k, cuts, axis=2)]
    vs = [jnp.asarray(x, jnp.float32) for x in np.split(v, cuts, axis=2)]
    out = decoder.cache_attention(jnp.asarray(q, jnp.float32), ks, vs, jnp.asarray(q_index))
    np.testing.assert_allclose(np.asarray(out), naive_attention(q, k, v, q_index), rtol=2e-5, atol=2e-5)


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


def test_segmented_cache_equals_one_piece_across_boundaries():
    """Prefill 11 tokens of slot 1 in a chunk that crosses segment boundaries, then decode two
    steps for both slots, attending over a 16-token window (3 of 4 segments): the hidden states
    and the written K/V equal those of a one-piece cache attended in full (keys past each
    query are masked either way); nothing is written past the window or into other slots'
    rows."""
    cfg = tiny_text()
    rng = np.random.default_rng(0)
    params = random_params(cfg, rng)
    segments = (4, 4, 8, 16)
    caches = {"one": decoder.init_kv_cache(cfg, 2, 32, jnp.float32),
              "seg": decoder.init_kv_cache(cfg, 2, 32, jnp.float32, segments)}
    emb = jnp.asarray(rng.standard_normal((1, 11, cfg.hidden_size)), jnp.float32)
    pos = jnp.arange(11)[None]
    outs = {}
    for name, cache in caches.items():
        window = 16 if name == "seg" else 32
        h1, cache = decoder.forward(params, cfg, emb, pos, cache, jnp.array([0]), window=window,
                                    slots=jnp.array([1]))
        hs = [h1]
        for step in range(2):
            e = jnp.asarray(np.random.default_rng(step).standard_normal((2, 1, cfg.hidden_size)), jnp.float32)
            starts = jnp.array([3 + step, 11 + step])  # slot 0 holds stale zeros: still valid keys
            h, cache = decoder.forward(params, cfg, e, starts[:, None], cache, starts, window=window)
            hs.append(h)
        outs[name] = (hs, cache)
    for a, b in zip(outs["one"][0], outs["seg"][0]):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)
    for one, seg in zip(outs["one"][1], outs["seg"][1]):
        for name in ("k", "v"):
            joined = np.concatenate([np.asarray(x) for x in seg[name]], axis=2)
            (whole,) = one[name]
            np.testing.assert_allclose(joined, np.asarray(whole), rtol=1e-5, atol=1e-6)
            assert np.all(joined[:, :, 16:] == 0)           # past the window: untouched
            assert np.all(joined[1, :, :13] != 0) and np.all(joined[1, :, 13:] == 0)


def test_window_must_be_a_segment_boundary():
    cfg = tiny_text(layers=1)
    params = random_params(cfg, np.random.default_rng(1))
    cache = decoder.init_kv_cache(cfg, 1, 32, jnp.float32, (8, 8, 16))
    with pytest.raises(ValueError, match="segment boundary"):
        decoder.forward(params, cfg, jnp.ones((1, 1, cfg.hidden_size)), jnp.zeros((1, 1), jnp.int32), cache,
                        jnp.zeros((1,), jnp.int32), window=12)
    with pytest.raises(ValueError, match="do not cut"):
        decoder.init_kv_cache(cfg, 1, 32, jnp.float32, (8, 8))


def test_kv_segments_follow_the_window_ladder():
    b = Buckets.make(max_model_len=600, prefill_chunk=256, max_encode_batch=4, max_num_seqs=4)
    assert b.window == (128, 256, 512, 600)
    assert b.kv_segments() == (128, 128, 256, 88)
    assert np.cumsum(b.kv_segments()).tolist() == list(b.window)
