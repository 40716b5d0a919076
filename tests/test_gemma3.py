"""Gemma 3 (Gemma3ForConditionalGeneration) parity with transformers on tiny random checkpoints
(float32, tests/tiny_gemma.py): pixels and token ids from the processor path (pan-and-scan
included), image features and whole-prompt logits (rel <= 1e-4), 32 greedy tokens and their
logprobs (within 1e-4), sliding window shorter than the prompt, two images in one prompt; the
engine (chunked prefill with a chunk size that would cut through an image, prefix cache,
encoder cache) against one-at-a-time and caches-off runs; the ring cache's size; the server.

transformers' Gemma3Processor overrides the image processor config's pan-and-scan settings with
its own class defaults, so the HF side is always given the crop settings explicitly (`pas_kw`).
"""
import numpy as np
import pytest
import torch

import mmjax
from conftest import noise_image, rel_err
from mmjax.models.family import image_runs

GREEDY = dict(temperature=0.0, ignore_eos=True)
ENGINE = dict(max_num_seqs=2, max_model_len=384, prefill_chunk=32)
_VLMS: dict = {}


def vlm_for(path, **kw) -> "mmjax.VLM":
    """One VLM per (checkpoint, options) for the module: compiled steps are shared by tests."""
    key = (str(path), tuple(sorted(kw.items())))
    if key not in _VLMS:
        _VLMS[key] = mmjax.load(path, **{**ENGINE, **kw})
    return _VLMS[key]


def pas_kw(vlm, on: bool = True) -> dict:
    p = vlm.family.policy.pan_and_scan
    return dict(do_pan_and_scan=on, pan_and_scan_min_crop_size=p.min_crop_size,
                pan_and_scan_max_num_crops=p.max_num_crops, pan_and_scan_min_ratio_to_activate=p.min_ratio_to_activate)


def chat(question: str, n_images: int = 2) -> list[dict]:
    content = [{"type": "text", "text": "look at"}]
    for i in range(n_images):
        content += [{"type": "image"}, {"type": "text", "text": ["and then", "too"][i % 2]}]
    return [{"role": "system", "content": "You answer briefly."},
            {"role": "user", "content": content + [{"type": "text", "text": question}]}]


def with_images(messages, images):
    it = iter(images)
    return [{**m, "content": [dict(p, image=next(it)) if p["type"] == "image" else p for p in m["content"]]}
            if isinstance(m["content"], list) else m for m in messages]


@pytest.fixture(scope="module", params=["window", "softcap"])
def pair(request, gemma3_dirs):
    from transformers import AutoProcessor, Gemma3ForConditionalGeneration
    path = gemma3_dirs[request.param]
    hf = Gemma3ForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    return request.param, hf, AutoProcessor.from_pretrained(path), vlm_for(path)


def hf_inputs(proc, vlm, messages, images, pan_and_scan: bool):
    text = proc.apply_chat_template(messages, add_generation_prompt=True)
    return proc(text=text, images=images, add_special_tokens=False, return_tensors="pt", **pas_kw(vlm, pan_and_scan))


def test_pixels_token_ids_and_chat_template(pair):
    from safetensors import safe_open
    name, _, proc, vlm = pair
    with safe_open(str(vlm.loaded.path / "model.safetensors"), "np") as f:   # tied: saved without a head
        assert any("lm_head" in k for k in f.keys()) == (name == "softcap")
    text = vlm.model.language_model
    assert text.config.tie_word_embeddings == (name == "window")
    mm = vlm.family.cfg.mm_tokens_per_image
    for seed, (w, h) in enumerate([(40, 40), (130, 40), (30, 95), (47, 40)]):
        img = noise_image(seed, w, h)
        for on in (False, True):
            [ours] = vlm.prepare_images([img], {"pan_and_scan": on})
            theirs = proc.image_processor(img, return_tensors="np", **pas_kw(vlm, on))["pixel_values"]
            assert ours.pixels.shape == theirs.transpose(0, 2, 3, 1).shape
            assert np.abs(ours.pixels - theirs.transpose(0, 2, 3, 1)).max() <= 1e-6
            assert ours.num_tokens == mm * len(theirs)
            if on and max(w / h, h / w) >= 1.2:
                assert len(theirs) > 1                     # the wide and tall images were cropped
    msgs = chat("which is bigger?")
    images = [noise_image(7, 50, 45), noise_image(8, 140, 40)]
    prompt, _ = vlm.render_chat(with_images(msgs, images))
    assert str(prompt) == proc.apply_chat_template(msgs, add_generation_prompt=True)
    for on in (False, True):
        inputs = vlm.prepare_images(images, {"pan_and_scan": on})
        ids = vlm.tokenizer.encode_prompt(prompt, [im.num_tokens for im in inputs],
                                          [vlm.family.image_prompt(im) for im in inputs])
        theirs = hf_inputs(proc, vlm, msgs, images, on)
        assert ids == theirs["input_ids"][0].tolist()
        assert int(theirs["token_type_ids"].sum()) == sum(im.num_tokens for im in inputs)


def test_pixel_views_undo_the_resize_and_pan_and_scan(pair):
    """Saliency maps on the image's own pixels: each view (the image, then its pan-and-scan crops)
    lies where `Family.pixel_views` says (a marker's change lands on it: tests/marker_check.py)."""
    from marker_check import assert_family_views_find_markers
    assert assert_family_views_find_markers(pair[-1], ({"pan_and_scan": False}, {"pan_and_scan": True})) >= 6


def test_features_logits_greedy_and_logprobs(pair):
    """Two images (the second wide, pan-and-scan on in the softcap checkpoint), a prompt longer
    than the sliding window: features, whole-prompt logits, 32 greedy tokens and logprobs."""
    name, hf, proc, vlm = pair
    on = name == "softcap"
    msgs = chat("what is different?")
    images = [noise_image(11, 60, 50), noise_image(12, 150, 50)]
    inputs = hf_inputs(proc, vlm, msgs, images, on)
    n_prompt = inputs["input_ids"].shape[1]
    assert n_prompt > 2 * vlm.model.language_model.config.sliding_window

    with torch.no_grad():
        theirs = hf.model.get_image_features(pixel_values=inputs["pixel_values"]).pooler_output.numpy()
        hf_logits = hf(**inputs).logits[0].numpy()
    ours = vlm.engine.runner.encode_images(vlm.prepare_images(images, {"pan_and_scan": on}))
    ours = np.concatenate(ours).reshape(theirs.shape)
    assert rel_err(ours, theirs) <= 1e-4

    prompt, _ = vlm.render_chat(with_images(msgs, images))
    policy = vlm.family.policy
    vlm.family.policy = policy.with_pan_and_scan(on)          # VLM.logits takes the default options
    try:
        logits = vlm.logits(prompt, images)
        other = vlm.logits(prompt, [noise_image(21, 60, 50), noise_image(22, 150, 50)])  # same sizes
    finally:
        vlm.family.policy = policy
    assert logits.shape == hf_logits.shape
    assert rel_err(logits, hf_logits) <= 1e-4
    assert rel_err(other, logits) > 1e-3                      # the images reach the logits

    hf.generation_config.eos_token_id = None
    with torch.no_grad():
        gen = hf.generate(**inputs, max_new_tokens=32, do_sample=False, output_logits=True,
                          return_dict_in_generate=True, pad_token_id=3)
    want = gen.sequences[0, n_prompt:].tolist()
    out = vlm.generate([{"prompt": prompt, "images": images, "image_options": {"pan_and_scan": on}}],
                       mmjax.SamplingParams(max_tokens=32, logprobs=2, **GREEDY))[0]
    assert len(want) == 32 and len(set(want)) > 4             # not a flat model
    assert out.token_ids == want
    hf_lp = [torch.log_softmax(l[0].double(), -1).numpy() for l in gen.logits]
    for step, lp in enumerate(out.logprobs):
        for tok, v in lp.items():
            assert abs(v - hf_lp[step][tok]) <= 1e-4


def _chunks_of(vlm):
    seen, prefill = [], vlm.engine.runner.prefill

    def spy(chunks, *a, **kw):
        seen.extend((c.start, len(c.token_ids)) for c in chunks)
        return prefill(chunks, *a, **kw)
    vlm.engine.runner.prefill = spy
    return seen


def test_engine_chunks_prefix_and_encoder_caches(gemma3_dirs):
    """prefill_chunk 32 with 16-token image runs placed across chunk edges; batched (prefills
    packed: both slots' chunks in one call) == one at a time == caches off == transformers; a
    repeated request resumes from the prefix cache (its whole prompt is within the rings'
    reach) and reuses encoded images."""
    from transformers import AutoProcessor, Gemma3ForConditionalGeneration
    path = gemma3_dirs["window"]
    vlm = vlm_for(path)
    off = vlm_for(path, enable_prefix_cache=False, encoder_cache_bytes=0)
    imgs = [noise_image(21, 70, 60), noise_image(22, 160, 50), noise_image(23, 45, 45)]
    reqs = [
        {"prompt": chat("what is it?"), "images": imgs[:2], "image_options": {"pan_and_scan": True}},
        {"prompt": chat("tell me the color of the left one please"), "images": imgs[:2],
         "image_options": {"pan_and_scan": True}},
        {"prompt": chat("tell me the color of the left one please"), "images": imgs[:2],
         "image_options": {"pan_and_scan": True}},
        {"prompt": chat("how many?", 1), "images": imgs[2:]},
        {"prompt": [{"role": "user", "content": "hello there"}], "images": []},
    ]
    for r in reqs:
        r["prompt"], _ = vlm.render_chat(with_images(r["prompt"], r["images"]))
    sp = mmjax.SamplingParams(max_tokens=10, logprobs=1, **GREEDY)
    seen = _chunks_of(vlm)
    together = vlm.generate(reqs, sp)
    assert vlm.engine.counters["prefill_chunks"] > vlm.engine.counters["prefill_calls"]   # 2 requests per call
    alone = [vlm.generate([r], sp)[0] for r in reqs]
    stats = vlm.engine.stats()
    cold = [off.generate([r], sp)[0] for r in reqs]
    assert [o.token_ids for o in together] == [o.token_ids for o in alone] == [o.token_ids for o in cold]
    for a, b in zip(together, cold):
        np.testing.assert_allclose([a.logprobs[i][t] for i, t in enumerate(a.token_ids)],
                                   [b.logprobs[i][t] for i, t in enumerate(b.token_ids)], atol=1e-4)
    # the prompts' image runs straddle multiples of the chunk size, yet no chunk ended inside one
    ids = [np.asarray(o.prompt_token_ids) for o in alone]
    runs = [image_runs(i, vlm.family.image_token_id) for i in ids]
    assert any(a < k < b for rs in runs for a, b in rs for k in range(32, 384, 32))
    ends = {s + n for s, n in seen}
    assert not any(a < e < b for rs in runs for a, b in rs for e in ends)
    # caches were used where they could be, and not at all when off
    assert alone[2].cached_tokens == len(alone[2].prompt_token_ids) - 1 > 32
    assert stats["encoder_cache_hits"] > 0 and off.engine.stats()["encoder_cache_hits"] == 0
    assert all(o.cached_tokens == 0 for o in cold)
    # and transformers agrees on the first two requests
    hf = Gemma3ForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    proc = AutoProcessor.from_pretrained(path)
    hf.generation_config.eos_token_id = None
    for r, o in zip(reqs[:2], alone[:2]):
        inputs = proc(text=str(r["prompt"]), images=r["images"], add_special_tokens=False, return_tensors="pt",
                      **pas_kw(vlm, True))
        assert inputs["input_ids"][0].tolist() == list(o.prompt_token_ids)
        with torch.no_grad():
            seq = hf.generate(**inputs, max_new_tokens=10, do_sample=False, pad_token_id=3)
        assert seq[0, inputs["input_ids"].shape[1]:].tolist() == o.token_ids


@pytest.mark.parametrize("variant", ["window", "softcap"])
def test_paged_engine_matches_the_slot_layout(gemma3_dirs, variant):
    """page_size 8 (the sliding layers' rings become pages read under the window mask): two-image
    prompts with crops and a long text prompt over many windows, batched == one at a time ==
    caches off == the ring / slot layout (greedy ids, logprobs within 1e-4); a repeat shares its
    prompt's pages; no page leaked."""
    path = gemma3_dirs[variant]
    slots = vlm_for(path)
    vlm = vlm_for(path, page_size=8)
    off = vlm_for(path, page_size=8, enable_prefix_cache=False, encoder_cache_bytes=0)
    assert vlm.engine.runner.paged and slots.engine.runner.paged is False
    tm = vlm.model.language_model
    w = tm.config.sliding_window
    assert all(len(kv["v"]) == 1 and kv["v"][0].shape[0] == vlm.engine.runner.num_pages
               for kv in vlm.engine.runner.cache)       # every layer, sliding ones too, is a page pool
    imgs = [noise_image(61, 70, 60), noise_image(62, 160, 50)]
    long = " ".join(["the blue car and the red house"] * 30)
    reqs = [{"prompt": chat("what is it?"), "images": imgs, "image_options": {"pan_and_scan": True}},
            {"prompt": [{"role": "user", "content": long}], "images": []},
            {"prompt": chat("what is it?"), "images": imgs, "image_options": {"pan_and_scan": True}},
            {"prompt": chat("how many?", 1), "images": imgs[1:]}]
    for r in reqs:
        r["prompt"], _ = vlm.render_chat(with_images(r["prompt"], r["images"]))
    sp = mmjax.SamplingParams(max_tokens=12, logprobs=1, **GREEDY)
    together = vlm.generate(reqs, sp)
    alone = [vlm.generate([r], sp)[0] for r in reqs]
    cold = [off.generate([r], sp)[0] for r in reqs]
    ref = [slots.generate([r], sp)[0] for r in reqs]
    assert len(ref[1].prompt_token_ids) > 10 * w            # the long prompt spans many windows
    for outs in (together, alone, cold):
        assert [o.token_ids for o in outs] == [o.token_ids for o in ref]
        for a, b in zip(outs, ref):
            np.testing.assert_allclose([a.logprobs[i][t] for i, t in enumerate(a.token_ids)],
                                       [b.logprobs[i][t] for i, t in enumerate(b.token_ids)], atol=1e-4)
    assert alone[2].cached_tokens >= (len(alone[2].prompt_token_ids) - 1) // 8 * 8 > 32     # shared by page
    assert all(o.cached_tokens == 0 for o in cold)
    for v in (vlm, off):
        v.engine.pages.check()
        assert not v.engine.pages.holders and v.engine.pages.pool.num_used == 0


def test_paged_preemption_recomputes_the_same_outputs(gemma3_dirs):
    """Pages for one max_model_len sequence and a few more (56 of 8) under two requests of ~300
    tokens each (prompt and decode): one is preempted mid-decode and recomputed, sliding layers
    included, with the slot layout's greedy ids; none fails; no page leaked."""
    path = gemma3_dirs["window"]
    slots = vlm_for(path)
    page = vlm_for(path, page_size=8).engine.runner.page_bytes()
    vlm = mmjax.load(path, **{**ENGINE, "page_size": 8, "kv_cache_bytes": 56 * page})
    eng = vlm.engine
    assert eng.runner.num_pages == 56
    texts = [" ".join(["the blue car and the red house"] * 8), " ".join(["a small dog runs over the green hill"] * 5)]
    reqs = [{"prompt": t, "images": []} for t in texts]
    sp = mmjax.SamplingParams(max_tokens=200, logprobs=1, **GREEDY)
    outs = vlm.generate(reqs, sp)
    ref = [slots.generate([r], sp)[0] for r in reqs]
    assert all(90 < len(o.prompt_token_ids) < 384 - 200 for o in outs)     # admitted together, ~75 pages at the end
    assert eng.stats()["preemptions"] > 0
    assert [o.token_ids for o in outs] == [o.token_ids for o in ref]
    for a, b in zip(outs, ref):
        np.testing.assert_allclose([a.logprobs[i][t] for i, t in enumerate(a.token_ids)],
                                   [b.logprobs[i][t] for i, t in enumerate(b.token_ids)], atol=1e-4)
    eng.pages.check()
    assert not eng.pages.holders and eng.pages.pool.num_used == 0


def test_ring_cache_is_window_sized(gemma3_dirs):
    from mmjax.models.text.gemma3 import FULL, SLIDING
    vlm = vlm_for(gemma3_dirs["window"])
    tm, cache = vlm.model.language_model, vlm.engine.runner.cache
    w, c = tm.config.sliding_window, ENGINE["prefill_chunk"]
    for kind, kv in zip(tm.config.layer_types, cache):
        lens = [v.shape[2] for v in kv["v"]]
        assert sum(lens) == (w + c - 1 if kind == SLIDING else ENGINE["max_model_len"]), kind
    assert FULL in tm.config.layer_types and SLIDING in tm.config.layer_types
    assert tm.min_resume(100, c) == 100 - c
    assert vlm.engine.scheduler.min_resume(100) == 100 - c     # the engine binds its chunk
    from benchmarks.gemma3_kv_cache import kv_bytes
    table = kv_bytes((8192, 32768), prefill_chunk=256)
    for n, (ring, full) in table.items():
        print(f"Gemma-3-4B KV cache, 1 slot, max_model_len {n}: ring {ring / 2**20:.1f} MiB, "
              f"all-global {full / 2**20:.1f} MiB ({full / ring:.2f}x)")
    per_pos = 2 * 4 * 256 * 2                      # K and V, 4 kv heads, head_dim 256, bf16
    for n, (ring, full) in table.items():
        assert full == 34 * n * per_pos
        assert ring == (5 * n + 29 * (1024 + 256 - 1)) * per_pos


def test_serve_two_images_stream_usage_and_cached_tokens(gemma3_dirs):
    from mmjax.image.decode import load_image
    from mmjax.models.family import ImageOptions
    from serve.app import ServerConfig
    from test_serve import Server, data_uri, img_part
    vlm = vlm_for(gemma3_dirs["window"])
    ref = vlm_for(gemma3_dirs["window"], enable_prefix_cache=False, encoder_cache_bytes=0)
    server = Server(vlm, ServerConfig(served_model_name="g3", log_stats_interval=0))
    try:
        uris = [data_uri(31, w=50, h=40), data_uri(32, w=120, h=40)]
        msgs = [{"role": "user", "content": [{"type": "text", "text": "compare"}, img_part(uris[0]),
                                             {"type": "text", "text": "with"}, img_part(uris[1], "high"),
                                             {"type": "text", "text": "please"}]}]
        c = server.client()
        full = c.chat.completions.create(model="g3", messages=msgs, max_tokens=8, temperature=0)
        chunks = list(c.chat.completions.create(model="g3", messages=msgs, max_tokens=8, temperature=0, stream=True,
                                                stream_options={"include_usage": True}))
        text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
        # offline: the same two images, the first without crops (detail auto), the second with them
        prompt, _ = ref.render_chat(msgs)
        ims = [ref.family.prepare_image(load_image(u), ImageOptions(pan_and_scan=on))
               for u, on in zip(uris, (None, True))]
        rid = ref.engine.add_request(prompt, ims, mmjax.SamplingParams(max_tokens=8, **GREEDY))
        [off] = ref.engine.run_until_done([rid])
        assert full.choices[0].message.content == text == off.text
        n_img = sum(im.num_tokens for im in ims)
        assert ims[1].num_tokens > ims[0].num_tokens      # detail "high": pan-and-scan crops
        for u in (full.usage, chunks[-1].usage):
            assert u.prompt_tokens == len(off.prompt_token_ids) and u.completion_tokens == 8
            assert u.prompt_tokens_details.image_tokens == n_img
        assert chunks[-1].usage.prompt_tokens_details.cached_tokens > n_img   # the repeat hit the prefix cache
    finally:
        server.close()


def test_text_model_softcapping_matches_gemma3_for_causal_lm(tmp_path):
    """The decoder's own softcaps (unused by Gemma3ForConditionalGeneration, which applies
    neither): final_logit_softcapping against Gemma3ForCausalLM, attn_logit_softcapping against
    its eager attention given `softcap` (Gemma3Attention never passes it on by itself); a prompt
    twice the sliding window, sliding and full layers."""
    import jax
    import jax.numpy as jnp
    from flax import nnx
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    from mmjax.checkpoint import TensorSource
    from mmjax.models.nn import AttentionMetadata, Weights, build
    from mmjax.models.text import text_config
    torch.manual_seed(5)
    cfg = Gemma3TextConfig(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=8, sliding_window=6,
                           query_pre_attn_scalar=8, final_logit_softcapping=3.0, attn_logit_softcapping=2.0,
                           layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                           attn_implementation="eager")
    hf = Gemma3ForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    hf.save_pretrained(tmp_path)
    import json
    tcfg = text_config(json.loads((tmp_path / "config.json").read_text()))
    assert tcfg.final_logit_softcapping == 3.0 and tcfg.attn_logit_softcapping == 2.0
    tm = build(lambda: tcfg.build(jnp.float32))
    w = Weights(TensorSource(tmp_path, lambda n: n))
    tm.hf_weights(w, "model", "lm_head.weight")
    w.finish(tm)
    graphdef, state = nnx.split(tm)
    ids = np.random.default_rng(0).integers(4, 97, 13)

    def fwd(state, ids):
        tm = nnx.merge(graphdef, state)
        t = ids.shape[0]
        meta = AttentionMetadata(jnp.arange(t)[None, None], jnp.zeros((1,), jnp.int32), t)
        hidden, _ = tm(tm.embed(ids)[None], meta, tm.init_cache(1, t, jnp.float32))
        return tm.logits(hidden[0])
    ours = np.asarray(jax.jit(fwd)(state, ids))
    with torch.no_grad():
        theirs = hf(torch.as_tensor(ids)[None], softcap=2.0).logits[0].numpy()
        uncapped = hf(torch.as_tensor(ids)[None]).logits[0].numpy()
    assert np.abs(ours).max() < 3.0
    assert rel_err(ours, theirs) <= 1e-4 < rel_err(ours, uncapped)


def test_pan_and_scan_options_per_request_and_server_flag(gemma3_dirs):
    """detail "high" turns crops on, "low" off, "auto" follows --pan-and-scan (None: the
    checkpoint's processor default); image_options carry it offline; bad values are 400s."""
    from mmjax.errors import InvalidRequestError
    from mmjax.models.family import ImageOptions
    from serve.cli import build_parser, config_from_args
    from serve.media import MediaConfig, MediaFetcher
    fam = vlm_for(gemma3_dirs["window"]).family
    for flag, want in ((["--pan-and-scan"], True), (["--no-pan-and-scan"], False), ([], None)):
        cfg = config_from_args(build_parser().parse_args(["--model", "x"] + flag), "x")
        assert cfg.pan_and_scan is want
        f = MediaFetcher(MediaConfig(pan_and_scan=cfg.pan_and_scan), fam)
        assert f._options("auto").pan_and_scan is want
        assert f._options("high").pan_and_scan is True and f._options("low").pan_and_scan is False
    wide = noise_image(41, 120, 40)
    n = {on: fam.prepare_image(wide, ImageOptions(pan_and_scan=on)).num_tokens for on in (None, False, True)}
    assert n[None] == n[False] == 16 < n[True]
    im = fam.prepare_image(wide, ImageOptions(pan_and_scan=True))
    assert fam.token_grid(im) == (n[True] // 16, 4, 4) and im.pixels.shape[0] == n[True] // 16
    assert ImageOptions.from_dict({"pan_and_scan": True}).pan_and_scan is True
    with pytest.raises(InvalidRequestError, match="pan_and_scan"):
        ImageOptions.from_dict({"pan_and_scan": "yes"})
    assert fam.fit_options(16).pan_and_scan is False and fam.fit_options(16 * 4).pan_and_scan is None


def test_prefix_resume_after_slot_sat_under_other_decodes(gemma3_dirs):
    """A finished request's slot keeps its KV while another request decodes 40 more steps with
    the decode rows covering it; resuming from that slot must still see intact ring windows."""
    vlm = vlm_for(gemma3_dirs["window"])
    img = noise_image(51, 64, 48)
    a = {"prompt": vlm.render_chat(with_images(chat("what is it?", 1), [img]))[0], "images": [img]}
    b = {"prompt": "tell me a very long story about the blue car and the red house please", "images": []}
    sp_a = mmjax.SamplingParams(max_tokens=2, logprobs=1, **GREEDY)
    first, _ = vlm.generate([a, b], [sp_a, mmjax.SamplingParams(max_tokens=40, **GREEDY)])
    again = vlm.generate([a], sp_a)[0]
    assert again.cached_tokens == len(again.prompt_token_ids) - 1
    assert again.token_ids == first.token_ids
    np.testing.assert_allclose([again.logprobs[i][t] for i, t in enumerate(again.token_ids)],
                               [first.logprobs[i][t] for i, t in enumerate(first.token_ids)], atol=1e-5)


def test_captured_attention_matches_transformers_eager(gemma3_dirs):
    """Capture(attn_layers=...) on every layer: attention probabilities equal transformers' eager
    `output_attentions` (sliding layers: window AND (causal OR same image), full: causal OR same
    image), and hidden states its `output_hidden_states`."""
    from transformers import AutoProcessor, Gemma3ForConditionalGeneration

    from mmjax.models.nn import Capture
    path = gemma3_dirs["window"]
    vlm = vlm_for(path)
    hf = Gemma3ForConditionalGeneration.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    proc = AutoProcessor.from_pretrained(path)
    msgs, images = chat("why?"), [noise_image(61, 50, 50), noise_image(62, 40, 60)]
    inputs = hf_inputs(proc, vlm, msgs, images, False)
    with torch.no_grad():
        out = hf(**inputs, output_attentions=True, output_hidden_states=True)
    prompt, _ = vlm.render_chat(with_images(msgs, images))
    n = vlm.model.language_model.num_layers
    logits, inter = vlm.logits(prompt, images, capture=Capture(hidden=True, attn_layers=tuple(range(n))))
    assert rel_err(logits, out.logits[0].numpy()) <= 1e-4
    w = vlm.model.language_model.config.sliding_window
    for i in range(n):
        theirs = out.attentions[i][0].numpy()
        assert inter["attn"][i][0].shape == theirs.shape
        assert np.abs(inter["attn"][i][0] - theirs).max() <= 1e-5, i
    # a sliding layer: an image's first token sees its last one, the last does not see its
    # window's past beyond the image
    ids = inputs["input_ids"][0].numpy()
    a, b = image_runs(ids, vlm.family.image_token_id)[0]
    assert b - a > w and (inter["attn"][0][0][:, a, b - 1] > 0).all() and (inter["attn"][0][0][:, b - 1, a] == 0).all()
    for i, hs in enumerate(out.hidden_states[:-1]):
        assert rel_err(inter["hidden"][i][0], hs[0].numpy()) <= 1e-4, i


def test_research_trace_and_pool_on_gemma3(gemma3_dirs):
    """mmjax.research on Gemma 3: trace heatmaps on each view's soft-token grid; Pool shrinks
    every view's block of soft tokens in the prompt text (one <start_of_image> block per view)."""
    from mmjax.research import Pool
    vlm = vlm_for(gemma3_dirs["window"])
    img = noise_image(71, 130, 40)
    tr = vlm.trace(with_images(chat("what?", 1), [img]), layers=(0, 1), what=("attn",))
    assert tr.heatmap(0).shape == tr.heatmap(1).shape == (4, 4)
    [im] = vlm.prepare_images([img], {"pan_and_scan": True})
    pooled = Pool(2).apply(vlm.family, im)
    views = len(im.pixels)
    assert views > 1 and pooled.num_tokens == views * 4 and vlm.family.token_grid(pooled) == (views, 2, 2)
    text = vlm.family.image_prompt(pooled)
    assert text.count("<start_of_image>") == views and text.count("<image_soft_token>") == pooled.num_tokens
    prompt, _ = vlm.render_chat(with_images(chat("what?", 1), [img]))
    out = vlm.generate([{"prompt": prompt, "images": [img], "intervention": Pool(2)}],
                       mmjax.SamplingParams(max_tokens=3, **GREEDY))[0]
    assert out.num_image_tokens == 4 and len(out.token_ids) == 3


def test_fastv_prune_over_ring_and_full_layers(gemma3_dirs):
    """Prune after layer 1 (a full layer; later ones: sliding rings and a full layer, window 8 <
    the 16 soft tokens): serving == the whole-sequence pruned decoder (tests/fastv.py)."""
    from fastv import check_prune
    vlm = vlm_for(gemma3_dirs["window"])
    img = noise_image(72, 50, 70)
    check_prune(vlm, "<s><start_of_image>what?", img, layer=1)      # fits one 32-token prefill call
