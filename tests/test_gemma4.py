"""Gemma 4 (Gemma4ForConditionalGeneration, images) parity with transformers on tiny random
checkpoints (float32): a dense one (per-layer embeddings, KV sharing, k_eq_v, double-wide MLP,
proportional RoPE, clipped vision linears) and one with the MoE block (vision standardize), both
with bidirectional vision attention, a sliding window (12) shorter than an image's run of soft
tokens, soft-capping and tied embeddings (tests/tiny_gemma4.py).

Reference: transformers' Gemma4Processor (pixels, positions, soft-token counts, prompt ids) and
Gemma4ForConditionalGeneration (image features, whole-prompt logits, greedy generate and its
per-step logits). Tolerances: pixels exact (measured 0), features and logits max|a-b|/max|b| <=
1e-4 (measured ~5e-7 and ~5e-6), 32 greedy ids identical, logprobs within 1e-4.
"""
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import mmjax
from conftest import noise_image, rel_err
from mmjax.errors import ContextLengthError
from mmjax.models.nn.moe import experts_forward, gemma4_route
from tiny_gemma4 import hf_image_features, hf_inputs, load_processor

VARIANTS = ("dense", "moe")
GREEDY = dict(temperature=0.0, ignore_eos=True)
TWO = "<|turn>user\nleft <|image|> right <|image|> which is bigger?<turn|>\n<|turn>model\n"
ONE = "<|turn>user\n<|image|> describe it.<turn|>\n<|turn>model\n"
# (width, height): different soft-token counts, an extreme aspect ratio (the processor's 0-side
# edge case) and one that needs no resize (48x48 = 12x12 patches = 36 tokens, multiple of 8 px)
SIZES = [(50, 37), (23, 61), (200, 9), (48, 48), (64, 40)]


ENGINE = dict(max_num_seqs=2, max_model_len=256, max_encode_batch=2)


@pytest.fixture(scope="module", params=VARIANTS)
def pair(request, gemma4_dirs):
    """(variant, HF model, HF processor, engine under test, reference engine).

    Under test: prefill_chunk 80 (the two-image prompts' first chunk would end inside the second
    image's run; the scheduler cuts it before), prefix cache and encoder cache on. Reference: the
    whole prompt in one prefill call, no prefix cache, no encoder cache."""
    from transformers import Gemma4ForConditionalGeneration
    path = gemma4_dirs[request.param]
    hf = Gemma4ForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    vlm = mmjax.load(path, prefill_chunk=80, page_size=8, **ENGINE)     # prefix shared by pages of 8
    off = mmjax.load(path, prefill_chunk=256, enable_prefix_cache=False, encoder_cache_bytes=0, **ENGINE)
    return request.param, hf, load_processor(path), vlm, off


def test_config_weights_and_dispatch(pair):
    name, hf, proc, vlm, _ = pair
    fam, cfg = vlm.family, vlm.family.cfg.text
    assert fam.name == "gemma4" and type(hf).__name__ == "Gemma4ForConditionalGeneration"
    assert fam.image_token == proc.image_token and fam.image_token_id == hf.config.image_token_id
    assert fam.bidirectional_images and cfg.final_logit_softcapping == 30.0 and cfg.sliding_window == 12
    tc = hf.config.text_config
    for i, spec in enumerate(cfg.layers):
        attn = hf.model.language_model.layers[i].self_attn
        assert spec.head_dim == attn.head_dim and spec.kind == tc.layer_types[i]
        assert (spec.kv_source != i) == attn.is_kv_shared_layer
        assert spec.k_eq_v == (not attn.is_kv_shared_layer and attn.v_proj is None)
        assert spec.intermediate_size == hf.model.language_model.layers[i].mlp.intermediate_size
    if name == "dense":
        assert [s.kv_source for s in cfg.layers] == [0, 1, 2, 1, 2] and cfg.ple_size == 8
        assert any(s.k_eq_v for s in cfg.layers) and cfg.layers[3].intermediate_size == 2 * cfg.layers[0].intermediate_size
    else:
        assert cfg.moe == (4, 2, 24) and cfg.ple_size == 0
    # tied embeddings as transformers saves them: no lm_head tensor, the head is the embedding
    from safetensors import safe_open
    with safe_open(str(vlm.loaded.path / "model.safetensors"), "np") as f:
        assert not any("lm_head" in k for k in f.keys())
    from mmjax.packed_weights import PackedWeight
    lm = vlm.model.language_model
    head = lm.lm_head.kernel.get_value()
    head = head.unpack() if isinstance(head, PackedWeight) else head
    np.testing.assert_array_equal(np.asarray(head), np.asarray(lm.embed_tokens.embedding.get_value()).T)


def test_config_errors_name_the_field(gemma4_dirs):
    from mmjax.errors import UnsupportedModelError
    from mmjax.models.gemma4 import Gemma4Config
    base = json.loads((gemma4_dirs["dense"] / "config.json").read_text())
    cases = [("text_config.use_bidirectional_attention", lambda c: c["text_config"].update(
                 use_bidirectional_attention="all")),
             ("text_config.num_kv_shared_layers", lambda c: c["text_config"].update(num_kv_shared_layers=4)),
             ("text_config.rope_parameters", lambda c: c["text_config"]["rope_parameters"]["full_attention"].update(
                 rope_type="yarn")),
             ("vision_config", lambda c: c.update(vision_config=None))]
    for param, edit in cases:
        cfg = json.loads(json.dumps(base))
        edit(cfg)
        with pytest.raises(UnsupportedModelError) as e:
            Gemma4Config.from_hf(cfg)
        assert e.value.param == param
    # a hub-style config (global_head_dim / num_global_key_value_heads, no per_layer_config)
    # parses to the same layers as the saved one
    hub = json.loads(json.dumps(base))
    del hub["text_config"]["per_layer_config"]
    hub["text_config"].update(global_head_dim=32, num_global_key_value_heads=1)
    assert Gemma4Config.from_hf(hub) == Gemma4Config.from_hf(base)


def test_pixels_token_counts_and_prompt_ids(pair):
    _, _, proc, vlm, _ = pair
    fam = vlm.family
    for seed, (w, h) in enumerate(SIZES):
        img = noise_image(seed, w, h)
        ours = fam.prepare_image(img)
        theirs = proc.image_processor(img, return_tensors="np")
        n = len(ours.pixels)
        assert ours.num_tokens == int(theirs["num_soft_tokens_per_image"][0]) == n // 4
        np.testing.assert_array_equal(ours.pixels, theirs["pixel_values"][0, :n])
        assert (theirs["image_position_ids"][0, n:] == -1).all()
        _, gh, gw = ours.grid
        np.testing.assert_array_equal(theirs["image_position_ids"][0, n - 1], [gw - 1, gh - 1])
    imgs = [noise_image(10, 50, 37), noise_image(11, 23, 61)]
    ins = vlm.prepare_images(imgs)
    x = hf_inputs(proc, TWO, imgs)
    ids = vlm.tokenizer.encode_prompt(TWO, [im.num_tokens for im in ins], [fam.image_prompt(im) for im in ins])
    assert ids == x["input_ids"][0].tolist()
    assert sum(np.asarray(ids) == fam.image_token_id) == sum(im.num_tokens for im in ins) == 63 + 65
    # the chat template is the checkpoint's; a typed placeholder is refused
    msgs = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "what is it?"}]}]
    theirs = proc.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    ours, got = vlm.render_chat([{"role": "user", "content": [{"type": "image", "image": imgs[0]},
                                                              {"type": "text", "text": "what is it?"}]}])
    assert ours == theirs and len(got) == 1
    with pytest.raises(mmjax.errors.PromptError):
        vlm.render_chat([{"role": "user", "content": "sneaky <|image|>"}])
    with pytest.raises(ContextLengthError):
        fam.prepare_image(imgs[0], mmjax.models.family.ImageOptions(max_tokens=62))


def test_image_features_batched_and_alone(pair):
    _, hf, proc, vlm, _ = pair
    imgs = [noise_image(20 + i, w, h) for i, (w, h) in enumerate(SIZES)]
    ins = vlm.prepare_images(imgs)
    runner = vlm.engine.runner
    batched = runner.encode_images(ins)   # 5 images, 3 soft-token rungs, batches of <= 2
    x = proc.image_processor(imgs, return_tensors="pt")
    theirs = hf_image_features(hf, x["pixel_values"], x["image_position_ids"])
    for b, t, im in zip(batched, theirs, ins):
        assert b.shape == t.shape == (im.num_tokens, 64)
        assert rel_err(b, t) <= 1e-4
    for b, im in zip(batched, ins):
        assert rel_err(runner.encode_images([im])[0], b) <= 1e-5
    assert {s[1] // 4 for s in runner.compiled["encode"]} <= set(vlm.family.token_ladder)


def test_whole_prompt_logits_two_images(pair):
    _, hf, proc, vlm, _ = pair
    imgs = [noise_image(30, 50, 37), noise_image(31, 23, 61)]
    x = hf_inputs(proc, TWO, imgs)
    with torch.no_grad():
        ref = hf(**x).logits[0].numpy()
    got = vlm.logits(TWO, imgs)
    assert got.shape == ref.shape and len(ref) > 12 + 65   # longer than window and an image run
    assert rel_err(got, ref) <= 1e-4
    other = vlm.logits(TWO, [noise_image(32, 50, 37), noise_image(33, 23, 61)])   # same sizes
    assert rel_err(other, got) > 1e-3                      # the images reach the logits
    # the soft-capped logits are not flat: greedy has something to pick
    assert np.abs(ref).max() > 1.0 and len(set(ref.argmax(-1).tolist())) > 5


def _hf_generate(hf, proc, prompt, imgs, n=32):
    x = hf_inputs(proc, prompt, imgs)
    with torch.no_grad():
        g = hf.generate(**x, max_new_tokens=n, do_sample=False, eos_token_id=None, output_logits=True,
                        return_dict_in_generate=True, pad_token_id=3)
    return g.sequences[0, x["input_ids"].shape[1]:].tolist(), [torch.log_softmax(l[0].double(), -1).numpy()
                                                              for l in g.logits]


def test_greedy_32_tokens_logprobs_batched_equals_alone(pair):
    """Two requests in one batch on the engine under test (chunked prefill, caches on) == HF's
    generate (32 ids, per-step logprobs) == each alone on the reference engine (caches off)."""
    _, hf, proc, vlm, off = pair
    reqs = [(ONE, [noise_image(40, 64, 40)]), (TWO, [noise_image(41, 23, 61), noise_image(42, 50, 37)])]
    sp = mmjax.SamplingParams(max_tokens=32, logprobs=2, **GREEDY)
    batched = vlm.generate([{"prompt": p, "images": i} for p, i in reqs], sp)
    for out, (prompt, imgs) in zip(batched, reqs):
        exp, lps = _hf_generate(hf, proc, prompt, imgs)
        assert len(set(exp)) > 3                       # not a flat model
        assert out.token_ids == exp
        for ours, ref in zip(out.logprobs, lps):
            assert all(abs(v - ref[t]) <= 1e-4 for t, v in ours.items())
        alone = off.generate([{"prompt": prompt, "images": imgs}], sp)[0]
        assert alone.token_ids == out.token_ids
        assert all(abs(a[t] - b[t]) <= 1e-4 for a, b in zip(alone.logprobs, out.logprobs) for t in a)
        assert out.num_image_tokens == sum(im.num_tokens for im in vlm.prepare_images(imgs))


def test_engine_chunked_prefill_prefix_and_encoder_cache(pair):
    """Chunked prefill (chunks cut before an image run), prefix-cache hits past both images,
    encoder-cache hits for images behind a new preamble: all equal the reference engine."""
    _, _, _, vlm, off = pair
    imgs = [noise_image(50, 50, 37), noise_image(51, 23, 61)]
    sp = mmjax.SamplingParams(max_tokens=6, logprobs=1, **GREEDY)
    qs = [TWO, TWO.replace("which is bigger?", "what color is it?"), "<|turn>user\nsee" + TWO[len("<|turn>user\n"):]]
    seen, prefill = [], vlm.engine.runner.prefill
    vlm.engine.runner.prefill = lambda chunks, *a, **kw: (seen.extend((c.start, len(c.token_ids)) for c in chunks),
                                                          prefill(chunks, *a, **kw))[1]
    try:
        before = vlm.engine.stats()
        outs = [vlm.generate([{"prompt": q, "images": imgs}], sp)[0] for q in qs]
        st = vlm.engine.stats()
    finally:
        vlm.engine.runner.prefill = prefill
    want = [off.generate([{"prompt": q, "images": imgs}], sp)[0] for q in qs]
    for a, b in zip(outs, want):
        assert a.token_ids == b.token_ids and b.cached_tokens == 0
        assert all(abs(x[t] - y[t]) <= 1e-4 for x, y in zip(a.logprobs, b.logprobs) for t in x)
    runs = mmjax.models.family.image_runs(np.asarray(outs[0].prompt_token_ids), vlm.family.image_token_id)
    start, n = seen[0]
    assert len(runs) == 2 and start + n == runs[1][0] and n < 80 <= runs[1][1] - start   # cut before run 2
    # prefix cache: both images' KV reused, in whole pages (up to the page the second run ends in)
    assert outs[1].cached_tokens >= runs[1][1] // 8 * 8 > runs[0][1] and outs[1].cached_tokens % 8 == 0
    assert outs[2].cached_tokens < runs[0][0]                    # new preamble: no image KV reused ...
    assert st["images_encoded"] - before["images_encoded"] == 2  # ... but the encoder cache had them
    assert st["encoder_cache_hits"] - before["encoder_cache_hits"] >= 2


def test_moe_block_is_grouped_and_matches_dense_experts():
    """experts_forward (sorted rows + ragged_dot, and the CPU decode loop that skips idle
    experts) == every expert on every token, weighted by the router's top-k; the CUDA graph has
    two ragged dots and no per-expert loop."""
    rng = np.random.default_rng(0)
    n, d, f, e, k = 9, 16, 12, 5, 2
    p = {"gate_up": rng.normal(size=(e, d, 2 * f)).astype(np.float32) * 0.3,
         "down": rng.normal(size=(e, f, d)).astype(np.float32) * 0.3}
    r = {"scale": rng.normal(size=d).astype(np.float32), "proj": rng.normal(size=(d, e)).astype(np.float32),
         "per_expert_scale": rng.uniform(0.5, 1.5, e).astype(np.float32)}
    x = rng.normal(size=(n, d)).astype(np.float32)
    p, r = jax.tree.map(jnp.asarray, p), jax.tree.map(jnp.asarray, r)
    act = jax.nn.gelu
    w, idx = gemma4_route(r, jnp.asarray(x), k, 1e-6)
    got = np.asarray(experts_forward(p, jnp.asarray(x), w, idx, act, impl="ragged"))
    skip = np.asarray(experts_forward(p, jnp.asarray(x), w, idx, act, impl="skip"))
    gu = np.einsum("nd,edf->enf", x, np.asarray(p["gate_up"]))
    all_out = np.einsum("enf,efd->end", np.asarray(act(gu[..., :f])) * gu[..., f:], np.asarray(p["down"]))
    dense = np.zeros((n, d), np.float32)
    for t in range(n):
        for j in range(k):
            dense[t] += np.asarray(w)[t, j] * all_out[int(idx[t, j]), t]
    np.testing.assert_allclose(got, dense, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(skip, dense, rtol=1e-5, atol=1e-5)
    # Gemma 4's weights: the top-k probabilities renormalised to 1, times the per-expert scale
    np.testing.assert_allclose((np.asarray(w) / np.asarray(r["per_expert_scale"])[np.asarray(idx)]).sum(-1), 1.0,
                               rtol=1e-6)
    # exported for CUDA: two grouped matmuls (CPU lowers ragged_dot through JAX's own fallback)
    fn = jax.jit(lambda p, x, w, i: experts_forward(p, x, w, i, act))   # auto: ragged for CUDA
    from mmjax.backend import compiling_for
    with compiling_for("cuda"):
        mlir = jax.export.export(fn, platforms=("cuda",))(p, x, w, idx).mlir_module()
    assert mlir.count("chlo.ragged_dot") >= 2 and "while" not in mlir


def test_serve_two_image_chat_stream_usage_and_cached_tokens(gemma4_dirs):
    """`mmjax serve`'s app on 127.0.0.1 with the openai client: a two-image chat (images of
    different sizes) equals the offline API, streaming equals non-streaming, usage counts the
    soft tokens as image tokens, and asking again about the same images reports cached tokens."""
    from serve.app import ServerConfig
    from test_serve import Server, data_uri, img_part

    path = gemma4_dirs["dense"]
    vlm = mmjax.load(path, prefill_chunk=128, page_size=8, **ENGINE)    # prefix shared by pages of 8
    server = Server(vlm, ServerConfig(served_model_name="gemma4", limit_images=4, log_stats_interval=0))
    try:
        msgs = [{"role": "user", "content": [{"type": "text", "text": "left"}, img_part(data_uri(60, "PNG", 50, 37)),
                                             {"type": "text", "text": "right"}, img_part(data_uri(61, "PNG", 23, 61)),
                                             {"type": "text", "text": "which is bigger?"}]}]
        c = server.client()
        full = c.chat.completions.create(model="gemma4", messages=msgs, max_tokens=8, temperature=0)
        chunks = list(c.chat.completions.create(model="gemma4", messages=msgs, max_tokens=8, temperature=0,
                                                stream=True, stream_options={"include_usage": True}))
        streamed = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
        ref = mmjax.load(path, prefill_chunk=256, enable_prefix_cache=False, **ENGINE)
        off = ref.chat(msgs, mmjax.SamplingParams(max_tokens=8, temperature=0.0))
        assert full.choices[0].message.content == streamed == off.text and len(off.token_ids) == 8
        u = full.usage
        assert u.prompt_tokens == len(off.prompt_token_ids) and u.completion_tokens == 8
        assert u.prompt_tokens_details.image_tokens == off.num_image_tokens == 63 + 65
        last = chunks[-1]
        assert last.choices == [] and last.usage.prompt_tokens == u.prompt_tokens
        # the same images again (another question): their KV comes from the prefix cache
        msgs2 = [{"role": "user", "content": msgs[0]["content"][:-1] + [{"type": "text", "text": "what colors?"}]}]
        again = c.chat.completions.create(model="gemma4", messages=msgs2, max_tokens=4, temperature=0)
        assert again.usage.prompt_tokens_details.cached_tokens >= (63 + 65) // 8 * 8    # whole pages
        assert again.usage.prompt_tokens_details.image_tokens == 63 + 65
        assert again.choices[0].message.content == ref.chat(msgs2, mmjax.SamplingParams(max_tokens=4,
                                                                                        temperature=0.0)).text
    finally:
        server.close()


def test_research_hooks_pool_trace_and_saliency(pair):
    """The research API on Gemma 4: token_grid is the pooled patch grid (Pool(2) averages 2x2
    soft tokens, and the LLM gets those), trace sees the same features, image_pixels /
    input_pixels invert each other, and saliency has the image's shape (runs for the dense
    checkpoint only: the family code is shared)."""
    from mmjax.research import Pool
    from mmjax.research.interventions import pool_grid
    name, _, _, vlm, _ = pair
    img = noise_image(70, 64, 40)                    # resized to 80 x 48: 20 x 12 patches, 10 x 6 soft tokens
    [im] = vlm.prepare_images([img])
    assert im.grid == (1, 12, 20) and vlm.family.token_grid(im) == (1, 6, 10) and im.num_tokens == 60
    np.testing.assert_array_equal(vlm.family.input_pixels(im, vlm.family.image_pixels(im)), im.pixels)
    assert vlm.family.image_pixels(im).shape == (48, 80, 3)
    feats = vlm.encode([img])[0]
    want = pool_grid(feats.reshape(1, 6, 10, -1), 2).reshape(15, -1)
    [pim] = vlm.prepare_images([img], intervention=Pool(2))
    np.testing.assert_allclose(vlm.engine.runner.encode_images([pim])[0], want, rtol=1e-6)
    msgs = [{"role": "user", "content": [{"type": "image", "image": img}, {"type": "text", "text": "what?"}]}]
    prompt, _ = vlm.render_chat(msgs)
    out = vlm.generate([{"prompt": prompt, "images": [img], "intervention": Pool(2)}],
                       mmjax.SamplingParams(max_tokens=2, **GREEDY))[0]
    assert out.num_image_tokens == 15
    tr = vlm.trace(msgs, layers=(0,), what=("hidden",), intervention=Pool(2))
    np.testing.assert_allclose(tr.image_hidden(0), want, rtol=1e-6)
    if name == "dense":
        sal = vlm.saliency(img, "what color is it", "red")
        assert sal.map.shape == (48, 80) and sal.pixels.shape == (48, 80, 3) and sal.map.max() > 0


def test_fastv_prune_with_per_layer_inputs_and_shared_kv(gemma4_dirs):
    """Dense Gemma 4 (per-layer input embeddings, KV-shared layers 3-4 reading layers 1-2):
    pruning is defined before every shared layer's source (max_prune_layer 0) and matches the
    whole-sequence pruned decoder (tests/fastv.py); a later layer is a 400."""
    from fastv import check_prune
    from mmjax.errors import InvalidRequestError
    from mmjax.research import Prune
    vlm = mmjax.load(gemma4_dirs["dense"], prefill_chunk=128, **ENGINE)
    assert vlm.model.language_model.max_prune_layer == 0
    img = noise_image(73, 48, 40)
    check_prune(vlm, ONE, img, layer=0)
    with pytest.raises(InvalidRequestError, match="Prune.layer"):
        vlm.generate([{"prompt": ONE, "images": [img], "intervention": Prune(keep=2, layer=1)}])
