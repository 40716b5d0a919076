"""Llama 3.2 Vision (MllamaForConditionalGeneration) parity with transformers on tiny random
checkpoints (float32, tests/tiny_mllama.py: up to 4 and up to 2 tiles, cross-attention at two
decoder layers), through transformers' MllamaProcessor: pixels, aspect-ratio ids and tile counts
(exact), vision features (rel <= 1e-4), whole-prompt logits of the decoder with its gated
cross-attention layers (rel <= 1e-4: one image, two images, text only); the engine (per-slot
cross-attention K/V filled once per request, read by every prefill chunk and decode step) gives
transformers' 32 greedy tokens (logprobs within 1e-4) in one batch == one at a time == caches
off, with image and text-only requests in the same decode batch; the prefix cache never shares
KV across different images (not even the text before the image, which attends to them); the
cross-attention cache is in engine.stats() and /metrics; the server streams a multi-turn chat.
"""
import contextlib

import jax
import numpy as np
import pytest
import torch
from flax import nnx

import mmjax
from conftest import noise_image, rel_err
from mmjax.errors import InvalidRequestError, UnsupportedModelError
from mmjax.models.mllama import MllamaFamily
from mmjax.models.text.mllama import span_key_mask
from mmjax.serving.caches import EncoderCache
from tiny_mllama import hf_processor

GREEDY = dict(temperature=0.0, ignore_eos=True)
ENGINE = dict(max_num_seqs=2, max_model_len=128, prefill_chunk=16)
PROMPTS = ["hello <|image|> what is this", "a b <|image|> first <|image|> second one", "just text here"]
SIZES = [(70, 41), (33, 120), (20, 20), (300, 20)]
_VLMS: dict = {}


def vlm_for(path) -> "mmjax.VLM":
    if str(path) not in _VLMS:
        _VLMS[str(path)] = mmjax.load(path, **ENGINE)
    return _VLMS[str(path)]


@contextlib.contextmanager
def caches_off(vlm):
    """The same engine (same compiled steps) with its prefix and encoder caches off."""
    eng = vlm.engine
    saved = eng.encoder_cache
    eng.prefix_cache.clear()
    eng.prefix_cache.enabled, eng.encoder_cache = False, EncoderCache(0)
    try:
        yield vlm
    finally:
        eng.prefix_cache.enabled, eng.encoder_cache = True, saved


@pytest.fixture(scope="module", params=["tiles4", "tiles2"])
def pair(request, mllama_dirs):
    from transformers import MllamaForConditionalGeneration
    path = mllama_dirs[request.param]
    hf = MllamaForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    return request.param, path, hf, hf_processor(path), vlm_for(path)


def test_pixels_features_and_logits(pair):
    name, _, hf, proc, vlm = pair
    fam = vlm.family
    assert type(fam) is MllamaFamily and fam.cross_attention
    v = fam.cfg.vision
    imgs = [noise_image(seed, w, h) for seed, (w, h) in enumerate(SIZES)]
    inputs = [fam.prepare_image(img) for img in imgs]
    feats = vlm.engine.runner.encode_images(inputs)          # one call, four images
    worst = 0.0
    for img, im, f in zip(imgs, inputs, feats):
        x = proc.image_processor(img, return_tensors="np")
        assert (fam.aspect_ratio_id(im), im.grid[0]) == (int(x["aspect_ratio_ids"][0, 0]), int(x["num_tiles"][0][0]))
        assert np.abs(im.pixels - x["pixel_values"][0, 0].transpose(0, 2, 3, 1)).max() == 0
        with torch.no_grad():
            states = hf.model.vision_model(pixel_values=torch.tensor(x["pixel_values"]),
                                           aspect_ratio_ids=torch.tensor(x["aspect_ratio_ids"]),
                                           aspect_ratio_mask=torch.tensor(x["aspect_ratio_mask"])).last_hidden_state
            ref = hf.model.multi_modal_projector(states)[0, 0].reshape(len(f), -1)
        worst = max(worst, rel_err(f, ref.numpy()))
        # vlm.encode: the image's real tiles only (an image smaller than a tile: one tile's rows)
        real = ref.reshape(v.max_num_tiles, v.num_patches, -1)[:im.grid[0]].reshape(-1, ref.shape[-1])
        mine = vlm.encode([img])[0]
        assert mine.shape == (im.grid[0] * v.num_patches, ref.shape[-1])
        worst = max(worst, rel_err(mine, real.numpy()))
    assert worst <= 1e-4
    assert min(im.grid[0] for im in inputs) == 1 < v.max_num_tiles    # (20, 20): one real tile
    d = fam.cfg.text.base.hidden_size
    graph, state = nnx.split(vlm.model.language_model)
    full = jax.jit(lambda state, *a: nnx.merge(graph, state).forward_full(*a))
    logit_err = 0.0
    for i, prompt in enumerate(PROMPTS[1:]):   # (one image: the engine test below)
        imgs = [noise_image(10 + i * 2 + j, *SIZES[j]) for j in range(prompt.count("<|image|>"))]
        x = proc(text=prompt, images=[imgs] if imgs else None, return_tensors="pt")
        with torch.no_grad():
            ref = hf(**x).logits[0].numpy()
        ids = x["input_ids"][0].numpy()
        n_vis = max(1, len(imgs)) * fam.cfg.vision_tokens_per_image
        if imgs:
            inputs = [fam.prepare_image(im) for im in imgs]
            feats = np.concatenate(vlm.engine.runner.encode_images(inputs))[None]
            mask = span_key_mask(ids.tolist(), fam.image_token_id, [im.grid[0] for im in inputs], v.max_num_tiles,
                                 v.num_patches)
            assert not mask[0].any()                       # text before the image sees none
        else:
            feats, mask = np.zeros((1, n_vis, d), np.float32), np.zeros((len(ids), n_vis), bool)
        got = np.asarray(full(state, ids[None], feats, mask[None], np.asarray([bool(imgs)]))[0])
        assert got.shape == ref.shape and rel_err(got, ref) <= 1e-4
        logit_err = max(logit_err, rel_err(got, ref))
    print(f"\n{name}: features rel {worst:.2e}, logits rel {logit_err:.2e}")


def hf_generate(hf, proc, prompt, images, n=32):
    x = proc(text=prompt, images=[images] if images else None, return_tensors="pt")
    with torch.no_grad():
        g = hf.generate(**x, max_new_tokens=n, do_sample=False, eos_token_id=None, output_logits=True,
                        return_dict_in_generate=True, pad_token_id=3)
    return (x["input_ids"][0].tolist(), g.sequences[0, x["input_ids"].shape[1]:].tolist(),
            [torch.log_softmax(l[0].double(), -1).numpy() for l in g.logits])


@pytest.mark.slow
def test_pixel_views_undo_the_canvas_tiling(pair):
    """The real tiles of the padded canvas lie where `Family.pixel_views` says (a marker's change
    lands on it: tests/marker_check.py)."""
    from marker_check import assert_family_views_find_markers
    assert assert_family_views_find_markers(pair[-1]) >= 2


def test_engine_greedy_batched_and_caches(pair):
    """One image, two images, text only, and the one-image text with another image: 32 greedy
    tokens equal transformers' generate (logprobs within 1e-4) in one batch (image and
    text-only rows in the same decode steps) == one at a time == caches off."""
    name, _, hf, proc, vlm = pair
    imgs = [noise_image(40 + j, *SIZES[j]) for j in range(4)]
    cases = [(PROMPTS[0], imgs[:1]), (PROMPTS[1], imgs[1:3]), (PROMPTS[2], []), (PROMPTS[0], imgs[3:4])]
    refs = [hf_generate(hf, proc, p, i) for p, i in cases]
    # the processor's ids (its prompt gets a second BOS); token-id prompts go in as they are
    reqs = [{"prompt": ids, "images": i} for (ids, _, _), (_, i) in zip(refs, cases)]
    sp = mmjax.SamplingParams(max_tokens=32, logprobs=2, **GREEDY)
    together = vlm.generate(reqs, sp)
    alone = [vlm.generate([r], sp)[0] for r in reqs]
    with caches_off(vlm):
        cold = [vlm.generate([r], sp)[0] for r in reqs]
        assert vlm.engine.encoder_cache.hits == 0
    worst = 0.0
    for (_, exp, lps), a, b, c in zip(refs, together, alone, cold):
        assert a.token_ids == b.token_ids == c.token_ids == exp and len(exp) == 32
        for ours, ref in zip(a.logprobs, lps):
            worst = max(worst, max(abs(v - ref[t]) for t, v in ours.items()))
    assert worst <= 1e-4
    first = [together[i].logprobs[0][together[i].token_ids[0]] for i in (0, 3)]
    assert abs(first[0] - first[1]) > 1e-3                               # the image matters
    print(f"\n{name}: greedy 32 tokens identical, logprobs max diff {worst:.2e}")
    # prefix cache: a repeat resumes; the same text with another image shares nothing
    again = [vlm.generate([reqs[0]], sp)[0] for _ in range(2)][1]
    assert again.cached_tokens == len(again.prompt_token_ids) - 1 and again.token_ids == refs[0][1]
    other = vlm.generate([reqs[3]], sp)[0]
    assert other.cached_tokens == 0 and other.token_ids == refs[3][1]
    st = vlm.engine.stats()
    tm = vlm.engine.runner.text_model
    c = tm.config.base
    per_slot = 2 * len(tm.cross_layers) * tm.n_vis * c.num_kv_heads * c.head_dim * 4
    held = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(vlm.engine.runner.cache["cross"]))
    assert st["cross_attention_cache_bytes"] == held >= ENGINE["max_num_seqs"] * per_slot
    assert st["compiled_shapes"]["fill_cross"] == 1
    with pytest.raises(InvalidRequestError):
        vlm.generate([{"prompt": "<|image|>" * 3, "images": imgs[:3]}], sp)
    with pytest.raises(UnsupportedModelError):
        vlm.logits(PROMPTS[0], imgs[:1])


def test_paged_engine_matches_transformers(mllama_dirs):
    """page_size 8 (the self-attention layers in pages, the cross-attention K/V a row per slot):
    image, two-image and text-only requests give transformers' greedy tokens batched == one at a
    time == caches off; a repeat resumes from its shared prefix pages into another slot and
    refills that slot's cross row; n = 2 siblings forked by page (their partial page copied,
    the cross rows untouched) agree; no page leaked."""
    from transformers import MllamaForConditionalGeneration
    path = mllama_dirs["tiles4"]
    hf = MllamaForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    proc = hf_processor(path)
    vlm = mmjax.load(path, page_size=8, **ENGINE)
    eng = vlm.engine
    assert eng.runner.paged and eng.pages is not None
    assert all(kv["v"][0].shape[0] == eng.runner.num_pages for kv in eng.runner.cache["self"])
    assert eng.runner.cache["cross"]["has"].shape == (ENGINE["max_num_seqs"],)
    imgs = [noise_image(60 + j, *SIZES[j]) for j in range(3)]
    cases = [(PROMPTS[0], imgs[:1]), (PROMPTS[1], imgs[1:3]), (PROMPTS[2], [])]
    refs = [hf_generate(hf, proc, p, i, n=16) for p, i in cases]
    reqs = [{"prompt": ids, "images": i} for (ids, _, _), (_, i) in zip(refs, cases)]
    sp = mmjax.SamplingParams(max_tokens=16, logprobs=2, **GREEDY)
    together = vlm.generate(reqs, sp)
    alone = [vlm.generate([r], sp)[0] for r in reqs]
    with caches_off(vlm):
        eng.pages.pool.enable_cache = False
        cold = [vlm.generate([r], sp)[0] for r in reqs]
        eng.pages.pool.enable_cache = True
    for (_, exp, lps), a, b, c in zip(refs, together, alone, cold):
        assert a.token_ids == b.token_ids == c.token_ids == exp
        assert max(abs(v - ref[t]) for ours, ref in zip(a.logprobs, lps) for t, v in ours.items()) <= 1e-4
    assert all(o.cached_tokens == 0 for o in cold)
    # a text-only request fills slot 0's cross row with "no images" while the repeat of the
    # image prompt resumes from its pages in slot 1: its cross row must be its own images'
    again = vlm.generate([reqs[2], reqs[0]], sp)[1]
    assert again.cached_tokens >= (len(again.prompt_token_ids) - 1) // 8 * 8 > 0 and again.token_ids == refs[0][1]
    twins = vlm.generate([reqs[1]], mmjax.SamplingParams(max_tokens=16, n=2, **GREEDY))[0]
    assert [twins.token_ids] + [s.token_ids for s in twins.siblings] == [refs[1][1]] * 2
    assert eng.stats()["tokens_cached"] > 0
    eng.pages.check()
    assert not eng.pages.holders and eng.pages.pool.num_used == 0
    # a page copy (a fork's partial page) moves self-attention pages only, never a slot's cross row
    vlm.generate([reqs[2], reqs[0]], mmjax.SamplingParams(max_tokens=2, **GREEDY))     # two unlike rows
    cross = jax.tree.map(np.asarray, eng.runner.cache["cross"])
    src = np.asarray(eng.runner.cache["self"][0]["k"][0][3])
    eng.runner.copy_pages([(3, 0)])
    np.testing.assert_array_equal(np.asarray(eng.runner.cache["self"][0]["k"][0][0]), src)
    assert cross["has"].tolist() in ([True, False], [False, True])
    jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, eng.runner.cache["cross"]), cross)


def test_serve_multiturn_stream_and_metrics(mllama_dirs):
    import urllib.request

    from mmjax.image.decode import load_image
    from serve.app import ServerConfig
    from test_serve import Server, data_uri, img_part
    vlm = vlm_for(mllama_dirs["tiles4"])
    uri = data_uri(31, w=50, h=40)
    msgs = [{"role": "user", "content": [img_part(uri), {"type": "text", "text": "what is it"}]},
            {"role": "assistant", "content": "a square"},
            {"role": "user", "content": "and the color?"}]
    prompt, _ = vlm.render_chat(msgs)
    with caches_off(vlm):   # offline first: the server's engine loop then owns the engine
        off = vlm.generate([{"prompt": prompt, "images": [load_image(uri)]}],
                           mmjax.SamplingParams(max_tokens=8, **GREEDY))[0]
    server = Server(vlm, ServerConfig(served_model_name="ml", log_stats_interval=0))
    try:
        c = server.client()
        full = c.chat.completions.create(model="ml", messages=msgs, max_tokens=8, temperature=0)
        chunks = list(c.chat.completions.create(model="ml", messages=msgs, max_tokens=8, temperature=0, stream=True,
                                                stream_options={"include_usage": True}))
        text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
        assert full.choices[0].message.content == text == off.text
        assert full.usage.prompt_tokens == len(off.prompt_token_ids) and chunks[-1].usage.completion_tokens == 8
        assert chunks[-1].usage.prompt_tokens_details.cached_tokens == len(off.prompt_token_ids) - 1  # the repeat
        metrics = urllib.request.urlopen(server.url + "/metrics").read().decode()
        assert "mmjax_cross_attention_cache_bytes" in metrics
    finally:
        server.close()


@pytest.mark.slow
def test_tensor_parallel_matches_one_device(mllama_dirs):
    """Tensor parallelism like the other decoders (tiny GQA checkpoint, 4 query heads over 2 KV
    heads), on fake CPU devices in a subprocess (tests/mllama_tp_worker.py, as
    tests/test_sharding.py runs its workers): at TP 2 (KV heads split) and TP 4 (each KV head
    replicated to 2 shards) the mixed batch (one image, two images, text only, packed into shared
    prefill calls) gives one device's 32 greedy ids, again from the prefix cache, logprobs within
    1e-4; every self- and cross-attention projection, MLP, the embedding and the LM head is
    sharded 1/TP per device, and so is the cross-attention K/V cache (by KV heads; the held heads
    and the reported bytes count the replicas)."""
    import json
    import os
    import subprocess
    import sys

    from conftest import FAST_COMPILE_FLAGS
    here = os.path.dirname(os.path.abspath(__file__))
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": FAST_COMPILE_FLAGS}   # the worker adds its devices
    worker = os.path.join(here, "mllama_tp_worker.py")
    p = subprocess.run([sys.executable, worker, str(mllama_dirs["tiles4"]), "2", "4"], capture_output=True, text=True,
                       timeout=900, env=env, cwd=os.path.dirname(here))
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
    assert p.returncode == 0 and lines, f"worker failed (rc {p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-5000:]}"
    res = json.loads(lines[-1][len("RESULT "):])
    assert len({tuple(ids) for ids in res["ids_1dev"]}) >= 3, "requests should differ"
    # per layer: self-attention qkv / o or cross-attention q / kv / o, gate_up / down; embed, lm_head
    cross, selfs = ("cross_attn", ("q_proj", "kv_proj", "o_proj")), ("self_attn", ("qkv_proj", "o_proj"))
    layer = {i: cross if i in (1, 3) else selfs for i in range(5)}
    want = {f"['layers'][{i}]['{m}']['{w}']['kernel']" for i in range(5)
            for m, ws in (layer[i], ("mlp", ("gate_up_proj", "down_proj"))) for w in ws}
    want |= {"['embed_tokens']['embedding']", "['lm_head']['kernel']"}
    for tp, heads in ((2, 2), (4, 4)):
        r, where = res[f"tp{tp}"], f"tp{tp}"
        assert r["mesh"]["axes"] == {"data": 1, "model": tp}, where
        assert r["ids_equal"] and r["ids_again_equal"] and r["tokens_cached"] > 0, where
        assert r["logprob_diff"] <= 1e-4, (where, r["logprob_diff"])
        assert r["packed_prefills"][-1] > 1, where                      # chunks of several requests in one call
        assert set(r["weights"]["names"]) == want and r["weights"]["bad"] == [], (where, r["weights"])
        assert r["cross_cache"] == {"names": [f"['{n}'][{i}]" for n in "kv" for i in range(2)], "bad": []}, where
        assert len(r["self_cache"]["names"]) == 6 and r["self_cache"]["bad"] == [], where
        assert r["cross_k_shape"][1] == heads, where                     # [slots, KV heads held, hd, n_vis]
        assert r["cross_bytes"] == r["cross_bytes_held"], where
    assert res["tp2"]["cross_bytes"] == res["cross_bytes_1dev"] < res["tp4"]["cross_bytes"]
