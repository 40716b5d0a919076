"""Qwen2-VL / Qwen2.5-VL parity with transformers on tiny random checkpoints (float32).

Tolerances (as for LLaVA): pixels max abs 1e-5 (measured 0: same code path as HF's PIL
processor); image features and logits relative error (max|a-b|/max|b|) <= 1e-4 (measured ~1e-6);
packed vs one-at-a-time encoding <= 1e-5; M-RoPE position ids and image_grid_thw exact; greedy
generation identical ids for 32 tokens.
"""
import json

import jax
import numpy as np
import pytest
import torch
from flax import nnx

import mmjax
from conftest import noise_image, rel_err
from mmjax.errors import ContextLengthError, InvalidRequestError, PromptError
from mmjax.models import qwen2_vl as Q
from mmjax.models.vision import qwen2_vl as QV
from mmjax.models.family import ImageOptions
from tiny_qwen import hf_processor_inputs, hf_vision_features

FAMILIES = ("qwen2_vl", "qwen2_5_vl")
ONE = ("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n"
       "<|vision_start|><|image_pad|><|vision_end|>Describe this image.<|im_end|>\n<|im_start|>assistant\n")
TWO = ("<|im_start|>user\nPicture 1: <|vision_start|><|image_pad|><|vision_end|>Picture 2: "
       "<|vision_start|><|image_pad|><|vision_end|>Compare the two images.<|im_end|>\n<|im_start|>assistant\n")
# Non-square sizes (width, height); with patch 14 / merge 2 / 112-px windows these give merged
# grids that are not multiples of the 4x4 window (partial edge windows) and one under min_pixels.
SIZES = [(260, 190), (150, 330), (90, 120), (40, 33), (333, 101)]


@pytest.fixture(scope="module", params=FAMILIES)
def pair(request, qwen_dirs):
    from transformers import AutoModelForImageTextToText, AutoTokenizer, Qwen2VLImageProcessorPil
    path = qwen_dirs[request.param]
    hf = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(path)
    ip = Qwen2VLImageProcessorPil.from_pretrained(path)
    vlm = mmjax.load(path, max_num_seqs=2, max_model_len=2048, prefill_chunk=256)
    return request.param, hf, tok, ip, vlm


def hf_inputs(pair, prompt, images, **kw):
    _, _, tok, ip, _ = pair
    return hf_processor_inputs(tok, ip, prompt, images, **kw)


def test_family_dispatch(pair):
    name, hf, _, _, vlm = pair
    assert type(hf).__name__ == {"qwen2_vl": "Qwen2VLForConditionalGeneration",
                                 "qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration"}[name]
    assert vlm.family.name == name
    assert vlm.tokenizer.image_token == "<|image_pad|>"
    assert vlm.family.image_token_id == hf.config.image_token_id


def test_pixels_and_grid_match(pair):
    _, _, _, ip, vlm = pair
    for seed, (w, h) in enumerate(SIZES):
        img = noise_image(seed, w, h)
        ours = vlm.family.prepare_image(img)
        theirs = ip(img, return_tensors="np")
        assert ours.grid == tuple(theirs["image_grid_thw"][0].tolist())
        assert ours.pixels.shape == theirs["pixel_values"].shape
        assert np.abs(ours.pixels - theirs["pixel_values"]).max() <= 1e-5
        assert ours.num_tokens == int(np.prod(ours.grid)) // 4
    # per-request pixel bounds, same as the processor's kwargs
    img = noise_image(9, 500, 336)
    ours = vlm.family.prepare_image(img, ImageOptions(min_pixels=20_000, max_pixels=40_000))
    theirs = ip(img, size={"shortest_edge": 20_000, "longest_edge": 40_000}, return_tensors="np")
    assert ours.grid == tuple(theirs["image_grid_thw"][0].tolist())
    assert np.abs(ours.pixels - theirs["pixel_values"]).max() <= 1e-5


def test_vision_features_match(pair):
    _, hf, _, ip, vlm = pair
    imgs = [noise_image(10 + i, w, h) for i, (w, h) in enumerate(SIZES[:3])]
    ours = vlm.encode(imgs)  # one packed call
    inp = ip(imgs, return_tensors="pt")
    theirs = hf_vision_features(hf, inp["pixel_values"], inp["image_grid_thw"])
    assert [o.shape for o in ours] == [t.shape for t in theirs]
    for o, t in zip(ours, theirs):
        assert rel_err(o, t) <= 1e-4


def test_packed_equals_alone(pair):
    _, _, _, _, vlm = pair
    inputs = vlm.prepare_images([noise_image(20 + i, w, h) for i, (w, h) in enumerate(SIZES[:3])])
    assert len({im.grid for im in inputs}) == 3
    runner = vlm.engine.runner
    packed = runner.encode_images(inputs)
    alone = [runner.encode_images([im])[0] for im in inputs]
    for p, a in zip(packed, alone):
        assert p.shape == a.shape
        assert np.abs(p - a).max() <= 1e-5 * max(np.abs(a).max(), 1.0)
    # every compiled encode shape is a rung of the ladder (bounded compilations)
    assert {s[0] for s in runner.compiled["encode"]} <= set(vlm.family.encode_ladder)


@pytest.mark.parametrize("prompt,n_images", [(ONE, 1), (TWO, 2)])
def test_mrope_positions_and_logits_match(pair, prompt, n_images):
    _, hf, _, _, vlm = pair
    imgs = [noise_image(30 + i, *SIZES[i]) for i in range(n_images)]
    x = hf_inputs(pair, prompt, imgs)
    inputs = vlm.prepare_images(imgs)
    ids = np.asarray(vlm.tokenizer.encode_prompt(prompt, [im.num_tokens for im in inputs]), np.int32)
    assert ids.tolist() == x["input_ids"][0].tolist()
    starts = vlm.family.image_starts(ids, [im.num_tokens for im in inputs])
    ours, delta = vlm.family.positions(ids, inputs, starts)
    theirs, hf_delta = hf.model.get_rope_index(x["input_ids"], x["mm_token_type_ids"], x["image_grid_thw"])
    np.testing.assert_array_equal(ours, theirs[:, 0].numpy())
    assert delta == int(hf_delta[0, 0]) and delta < 0
    with torch.no_grad():
        ref = hf(**x).logits[0].numpy()
    got = vlm.logits(prompt, imgs)
    assert got.shape == ref.shape
    assert rel_err(got, ref) <= 1e-4


def test_greedy_generation_matches(pair):
    """32 greedy tokens for a one-image and a two-image prompt (both in one engine batch, so
    their three images are packed into one encode call and both prompts into one prefill call)."""
    _, hf, _, _, vlm = pair
    reqs = [(ONE, [noise_image(40, 260, 190)]), (TWO, [noise_image(41, 150, 330), noise_image(42, 333, 101)])]
    expected, hf_logprobs = [], []
    for prompt, imgs in reqs:
        x = hf_inputs(pair, prompt, imgs)
        with torch.no_grad():
            g = hf.generate(**x, max_new_tokens=32, do_sample=False, eos_token_id=None, output_logits=True,
                            return_dict_in_generate=True, pad_token_id=hf.config.text_config.pad_token_id)
        expected.append(g.sequences[0, x["input_ids"].shape[1]:].tolist())
        hf_logprobs.append([torch.log_softmax(l[0].double(), -1).numpy() for l in g.logits])
    runner = vlm.engine.runner
    encode, calls = runner._encode, []
    runner._encode = lambda *a: (calls.append(a[1][0].shape[0]), encode(*a))[1]
    before = dict(vlm.engine.counters)
    try:
        outs = vlm.generate([{"prompt": p, "images": i} for p, i in reqs],
                            mmjax.SamplingParams(max_tokens=32, temperature=0.0, logprobs=2, ignore_eos=True))
    finally:
        runner._encode = encode
    assert len(calls) == 1  # three images of three sizes from two requests: one packed call
    done = {k: vlm.engine.counters[k] - before[k] for k in ("prefill_calls", "prefill_chunks")}
    assert done["prefill_chunks"] > done["prefill_calls"]    # both prompts' chunks in one call (M-RoPE per token)
    for out, exp, lps, (_, imgs) in zip(outs, expected, hf_logprobs, reqs):
        assert len(exp) == 32
        assert out.token_ids == exp
        # decode-step numerics (M-RoPE rope_delta positions) against HF's per-step logits
        for tok, ours, ref in zip(out.token_ids, out.logprobs, lps):
            assert all(abs(v - ref[i]) <= 1e-4 for i, v in ours.items())
        assert out.num_image_tokens == sum(im.num_tokens for im in vlm.prepare_images(imgs))


def test_chat_template_and_injection_guard(pair):
    _, _, tok, _, vlm = pair
    img = noise_image(50, 120, 90)
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is in the picture?"}]}]
    theirs = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ours, images = vlm.render_chat([{"role": "user", "content": [{"type": "image", "image": img},
                                                                 {"type": "text", "text": "What is in the picture?"}]}])
    assert ours == theirs and len(images) == 1
    with pytest.raises(PromptError):
        vlm.render_chat([{"role": "user", "content": "sneaky <|image_pad|> token"}])
    out = vlm.chat([{"role": "user", "content": [{"type": "image", "image": img}, {"type": "text", "text": "hello"}]}],
                   mmjax.SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    assert len(out.token_ids) == 3


def test_image_token_budget(pair):
    _, _, _, _, vlm = pair
    fam = vlm.family
    runner = vlm.engine.runner
    encode, calls = runner._encode, []
    runner._encode = lambda *a: (calls.append(1), encode(*a))[1]
    big = noise_image(60, 640, 480)
    n = fam.prepare_image(big).num_tokens
    assert n == fam.num_tokens(480, 640) == 391
    with pytest.raises(ContextLengthError) as e:  # per request
        fam.prepare_image(big, ImageOptions(max_tokens=n - 1))
    assert e.value.param == "image_max_tokens" and str(n) in e.value.message
    assert fam.prepare_image(big, ImageOptions(max_tokens=n)).num_tokens == n
    # a smaller max_pixels brings it under budget (same count as HF with that max_pixels)
    small = fam.prepare_image(big, ImageOptions(max_pixels=100_000, max_tokens=200))
    assert small.num_tokens == fam.policy.num_tokens(480, 640, max_pixels=100_000) <= 200
    with pytest.raises(InvalidRequestError):
        ImageOptions.from_dict({"image_max_tokens": 0})
    with pytest.raises(InvalidRequestError) as e:
        fam.prepare_image(big, ImageOptions(min_pixels=10_000, max_pixels=5_000))
    assert e.value.param == "min_pixels"
    # server-wide budget, through the offline API, before anything is encoded
    saved = fam.limits
    try:
        fam.configure(image_max_tokens=100)
        with pytest.raises(ContextLengthError) as e:
            vlm.generate([{"prompt": ONE, "images": [big]}], mmjax.SamplingParams(max_tokens=2))
        assert e.value.param == "image_max_tokens"
    finally:
        fam.limits = saved
        runner._encode = encode
    assert calls == []  # rejected before the vision tower ran


def test_4k_image_end_to_end(pair):
    """3840x2160 at the default max_pixels: token count equals transformers' processor, the
    tiny tower runs once through the packed path (parity with HF), the prompt generates, and
    the compiled encode's temp memory is linear in patches (compile-only memory_analysis at the
    42k-patch native-resolution bucket; the naive O(N^2) path is compiled for comparison)."""
    name, hf, _, ip, vlm = pair
    img = noise_image(70, 3840, 2160)
    im = vlm.family.prepare_image(img)
    ref = ip(img, return_tensors="pt")
    assert im.grid == tuple(ref["image_grid_thw"][0].tolist()) == (1, 52, 94)
    assert im.num_tokens == int(ref["image_grid_thw"][0].prod()) // 4 == 1222
    feats = vlm.engine.runner.encode_images([im])[0]
    theirs = hf_vision_features(hf, ref["pixel_values"], ref["image_grid_thw"])[0]
    assert rel_err(feats, theirs) <= 1e-4
    # the 1.2k-token prompt is prefilled in several chunks that cut through the image
    out = vlm.generate([{"prompt": ONE, "images": [img]}], mmjax.SamplingParams(max_tokens=8, temperature=0.0,
                                                                                 ignore_eos=True))[0]
    assert out.num_image_tokens == 1222 and len(out.prompt_token_ids) > 1222
    x = hf_inputs(pair, ONE, [img])
    with torch.no_grad():
        g = hf.generate(**x, max_new_tokens=8, do_sample=False, eos_token_id=None,
                        pad_token_id=hf.config.text_config.pad_token_id)
    assert out.token_ids == g[0, x["input_ids"].shape[1]:].tolist()
    if name != "qwen2_5_vl":
        return  # the memory check is architecture-independent; run it once

    fam = Q.QwenVLFamily(vlm.family.cfg, vlm.family.policy)
    native = fam.configure(max_pixels=3840 * 2160, image_max_tokens=16384).num_tokens(2160, 3840)
    n_native = native * 4
    assert n_native == 42196
    state = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), nnx.state(vlm.model))

    def temp_bytes(n, impl):
        packed = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), fam.dummy_packed(n))
        graphdef = nnx.graphdef(nnx.eval_shape(lambda: Q.Qwen2VLModel(fam.cfg, attn_impl=impl)))
        fn = jax.jit(lambda state, packed: nnx.merge(graphdef, state).encode(packed))
        return fn.lower(state, packed).compile().memory_analysis().temp_size_in_bytes

    n_big = Q.bucket_for(n_native, fam.encode_ladder)
    n_half = n_big // 2 // 64 * 64
    big, half = temp_bytes(n_big, "auto"), temp_bytes(n_half, "auto")
    naive = temp_bytes(n_big, "reference")
    heads = vlm.family.cfg.vision.num_heads
    print(f"\n4K native: {n_native} patches -> bucket {n_big}: temp {big / 2**20:.1f} MiB "
          f"({n_half}: {half / 2**20:.1f} MiB); naive path {naive / 2**20:.0f} MiB")
    assert big / half <= 1.15 * n_big / n_half     # linear, not quadratic
    assert big < 256 * 2**20                       # ~70 MiB for the tiny tower
    assert naive >= heads * n_big ** 2 * 4         # one f32 score matrix per head, at least
    assert naive > 100 * big


def test_window_order_and_positions_match_hf():
    from transformers.vision_utils import get_vision_position_ids, get_vision_window_index
    for grid in [(1, 14, 18), (1, 24, 10), (1, 8, 8), (1, 16, 34), (1, 2, 2), (1, 2, 100), (1, 100, 2), (2, 10, 12)]:
        g = torch.tensor([grid])
        order, sizes = QV.window_order(grid, 2, 4)
        win_idx, cu = get_vision_window_index(g, spatial_merge_size=2, window_size=112, patch_size=14)
        np.testing.assert_array_equal(order, win_idx.numpy())
        np.testing.assert_array_equal(np.cumsum(sizes) * 4, cu.numpy()[1:])
        np.testing.assert_array_equal(QV.patch_positions(grid, 2), get_vision_position_ids(g, 2).numpy())


def test_v4_flat_config_parses_like_v5(qwen_dirs):
    for fam in FAMILIES:
        v5 = json.loads((qwen_dirs[fam] / "config.json").read_text())
        text = dict(v5["text_config"])
        rope = text.pop("rope_parameters")
        flat = {**{k: v for k, v in v5.items() if k != "text_config"}, **text,
                "rope_theta": rope["rope_theta"], "model_type": fam,
                "rope_scaling": {"type": "mrope", "mrope_section": rope["mrope_section"]}}
        assert Q.QwenVLConfig.from_hf(flat) == Q.QwenVLConfig.from_hf(v5)
    assert Q.normalize_name("model.language_model.layers.0.mlp.up_proj.weight") == "model.layers.0.mlp.up_proj.weight"
    assert Q.normalize_name("model.visual.blocks.0.attn.qkv.weight") == "visual.blocks.0.attn.qkv.weight"


def test_patch_ladder():
    ladder = QV.patch_ladder(16384, extra=(5120,))
    assert ladder[0] == 256 and ladder[-1] == 16384 and 5120 in ladder
    assert all(b % 64 == 0 for b in ladder)
    assert all(b2 / b1 <= 1.25 + 64 / b1 for b1, b2 in zip(ladder, ladder[1:]))
