"""Mistral 3 (Mistral3ForConditionalGeneration) and Pixtral-12B's layout (LlavaForConditionalGeneration
with a Pixtral tower) parity with transformers on tiny random checkpoints (float32,
tests/tiny_mistral3.py), through transformers' PixtralProcessor: pixels (exact) and the
[IMG]/[IMG_BREAK]/[IMG_END] token layout, image features of differently sized images packed in
one encode call (rel <= 1e-4), whole-prompt logits with two image sizes in one prompt (rel <=
1e-4), 32 greedy tokens (identical) and their logprobs (within 1e-4); the engine batched == one
at a time == caches off with image and text-only requests in one decode batch, including two
requests with the same text and different images.
"""
import contextlib

import numpy as np
import pytest
import torch

import mmjax
from conftest import noise_image, page_floor, rel_err
from mmjax.errors import ContextLengthError, ImageError, PromptError
from mmjax.models.family import ImageOptions
from mmjax.models.mistral3 import Mistral3Family
from mmjax.serving.caches import EncoderCache
from tiny_mistral3 import hf_processor

GREEDY = dict(temperature=0.0, ignore_eos=True)
# pages of 16: the tiny prompts' prefix hits are whole pages (of the default 64, often none)
ENGINE = dict(max_num_seqs=2, max_model_len=256, prefill_chunk=16, page_size=16)
# (width, height): non-square, one over the longest edge, one smaller than a merged token
SIZES = [(70, 41), (33, 120), (150, 97), (11, 9)]
ONE = "[INST]Describe [IMG] in a few words[/INST]"
TWO = "[INST]Look at [IMG] and then [IMG] which one is red?[/INST]"
TEXT = "[INST]hello there, what color is the sky?[/INST]"
_VLMS: dict = {}


def vlm_for(path, **kw) -> "mmjax.VLM":
    """One VLM per (checkpoint, options) for the module: compiled steps are shared by tests."""
    key = (str(path), tuple(sorted(kw.items())))
    if key not in _VLMS:
        _VLMS[key] = mmjax.load(path, **{**ENGINE, **kw})
    return _VLMS[key]


@contextlib.contextmanager
def caches_off(vlm):
    """The same engine (same compiled steps) with its prefix and encoder caches (a paged
    engine's: page sharing) off."""
    eng = vlm.engine
    saved = eng.encoder_cache
    eng.prefix_cache.clear()
    eng.prefix_cache.enabled, eng.encoder_cache = False, EncoderCache(0)
    if eng.pages is not None:
        eng.pages.pool.enable_cache = False
    try:
        yield vlm
    finally:
        eng.prefix_cache.enabled, eng.encoder_cache = True, saved
        if eng.pages is not None:
            eng.pages.pool.enable_cache = True


def load_hf(path):
    from transformers import AutoModelForImageTextToText
    return AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval(), hf_processor(path)


@pytest.fixture(scope="module", params=["merge2", "merge1"])
def pair(request, mistral3_dirs):
    path = mistral3_dirs[request.param]
    return (request.param, path, *load_hf(path), vlm_for(path))


def hf_generate(hf, proc, prompt, images, n=32):
    x = proc(text=prompt, images=images or None, return_tensors="pt")
    with torch.no_grad():
        g = hf.generate(**x, max_new_tokens=n, do_sample=False, eos_token_id=None, output_logits=True,
                        return_dict_in_generate=True, pad_token_id=3)
    return (g.sequences[0, x["input_ids"].shape[1]:].tolist(),
            [torch.log_softmax(l[0].double(), -1).numpy() for l in g.logits])


def check_parity(hf, proc, vlm, imgs):
    """Pixels, token layout, packed features and two-image logits against transformers."""
    fam = vlm.family
    for img in imgs:
        x = proc(text=ONE, images=[img], return_tensors="pt")
        im = fam.prepare_image(img)
        h, w = x["image_sizes"][0].tolist()
        ref = x["pixel_values"][0, :, :h, :w].numpy().transpose(1, 2, 0)
        assert fam.image_pixels(im).shape == ref.shape
        assert np.abs(fam.image_pixels(im) - ref).max() <= 1e-5
        ids = vlm.tokenizer.encode_prompt(ONE, [im.num_tokens], [fam.image_prompt(im)])
        assert ids == x["input_ids"][0].tolist()
        rows, cols = fam.token_grid(im)[1:]
        assert ids.count(fam.image_token_id) == im.num_tokens == rows * cols
        assert ids.count(vlm.tokenizer._tok.token_to_id("[IMG_BREAK]")) == rows - 1
        assert ids.count(vlm.tokenizer._tok.token_to_id("[IMG_END]")) == 1
    # every image in one packed encode call (block-diagonal attention across images)
    runner = vlm.engine.runner
    encode, calls = runner._encode, []
    runner._encode = lambda *a: (calls.append(a[1][0].shape[0]), encode(*a))[1]
    try:
        ours = vlm.encode(imgs)
    finally:
        runner._encode = encode
    assert len(calls) == 1 and calls[0] in fam.encode_ladder
    x = proc(text=ONE * len(imgs), images=imgs, return_tensors="pt")
    with torch.no_grad():
        theirs = hf.model.get_image_features(pixel_values=x["pixel_values"], image_sizes=x["image_sizes"]).pooler_output
    assert [o.shape for o in ours] == [tuple(t.shape) for t in theirs]
    errs = [rel_err(o, t.numpy()) for o, t in zip(ours, theirs)]
    assert max(errs) <= 1e-4, errs
    # one prompt, two image sizes
    two = imgs[:2]
    x = proc(text=TWO, images=two, return_tensors="pt")
    with torch.no_grad():
        ref = hf(**x).logits[0].numpy()
    got = vlm.logits(TWO, two)
    assert got.shape == ref.shape
    assert rel_err(got, ref) <= 1e-4
    return max(errs), rel_err(got, ref)


def test_pixels_tokens_features_logits(pair):
    name, _, hf, proc, vlm = pair
    assert type(vlm.family) is Mistral3Family and vlm.family.name == "mistral3"
    assert type(hf).__name__ == "Mistral3ForConditionalGeneration"
    assert vlm.family.cfg.merge_size == {"merge2": 2, "merge1": 1}[name]
    feat_err, logit_err = check_parity(hf, proc, vlm, [noise_image(s, w, h) for s, (w, h) in enumerate(SIZES)])
    print(f"\n{name}: features rel {feat_err:.2e}, logits rel {logit_err:.2e}")


@pytest.mark.slow
def test_greedy_batched_and_caches(pair):
    """Two-image, text-only and two same-text/different-image requests: 32 greedy tokens equal
    transformers' (logprobs within 1e-4), in one batch == one at a time == prefix and encoder
    caches off; the second same-text request reuses at most the text before its image."""
    name, path, hf, proc, vlm = pair
    imgs = [noise_image(40 + s, w, h) for s, (w, h) in enumerate(SIZES[:3])] + [noise_image(44, 57, 64)]
    reqs = [{"prompt": TWO, "images": imgs[:2]}, {"prompt": TEXT, "images": []},
            {"prompt": ONE, "images": [imgs[2]]}, {"prompt": ONE, "images": [imgs[3]]}]
    sp = mmjax.SamplingParams(max_tokens=32, logprobs=2, **GREEDY)
    together = vlm.generate(reqs, sp)
    alone = [vlm.generate([r], sp)[0] for r in reqs]
    with caches_off(vlm):
        cold = [vlm.generate([r], sp)[0] for r in reqs]
        hits = vlm.engine.encoder_cache.hits
    assert [o.token_ids for o in together] == [o.token_ids for o in alone] == [o.token_ids for o in cold]
    worst = 0.0
    for r, a, b in zip(reqs, together, cold):
        exp, lps = hf_generate(hf, proc, r["prompt"], r["images"])
        assert a.token_ids == exp and len(exp) == 32
        for ours, ref in zip(a.logprobs, lps):
            worst = max(worst, max(abs(v - ref[t]) for t, v in ours.items()))
        np.testing.assert_allclose([a.logprobs[i][t] for i, t in enumerate(a.token_ids)],
                                   [b.logprobs[i][t] for i, t in enumerate(b.token_ids)], atol=1e-4)
    assert worst <= 1e-4
    print(f"\n{name}: greedy 32 tokens identical, logprobs max diff {worst:.2e}")
    # a repeated request resumes from the prefix cache; the same text with a new image reuses
    # only the text before its first [IMG] (never another image's KV), and matches caches off
    again = [vlm.generate([reqs[2]], sp)[0] for _ in range(2)][1]
    assert again.cached_tokens == page_floor(vlm, len(again.prompt_token_ids) - 1) > 0
    assert again.token_ids == alone[2].token_ids
    assert together[2].token_ids != together[3].token_ids       # the images matter
    new = {"prompt": ONE, "images": [noise_image(45, 64, 57)]}
    [warm] = vlm.generate([new], sp)
    with caches_off(vlm):
        [ref] = vlm.generate([new], sp)
    first_img = list(warm.prompt_token_ids).index(vlm.family.image_token_id)
    # (whole pages of it on a paged cache: none when the text before [IMG] is shorter than a page)
    assert warm.cached_tokens == page_floor(vlm, first_img)
    assert warm.token_ids == ref.token_ids
    np.testing.assert_allclose([warm.logprobs[i][t] for i, t in enumerate(warm.token_ids)],
                               [ref.logprobs[i][t] for i, t in enumerate(ref.token_ids)], atol=1e-4)
    assert all(o.cached_tokens == 0 for o in cold) and hits == 0


def test_llava_pixtral(mistral3_dirs):
    """Pixtral-12B's layout (LlavaForConditionalGeneration, no merger) dispatches to this family."""
    path = mistral3_dirs["llava"]
    hf, proc = load_hf(path)
    vlm = vlm_for(path)
    assert type(hf).__name__ == "LlavaForConditionalGeneration"
    assert type(vlm.family) is Mistral3Family and not vlm.family.cfg.merger
    imgs = [noise_image(60 + s, w, h) for s, (w, h) in enumerate(SIZES[:3])]
    check_parity(hf, proc, vlm, imgs)  # (greedy decoding is the same Mistral decoder as above)


def test_chat_template_and_limits(mistral3_dirs):
    path = mistral3_dirs["merge2"]
    vlm = vlm_for(path)
    fam = vlm.family
    proc = hf_processor(path)
    img = noise_image(70, 90, 60)
    msgs = [{"role": "user", "content": [{"type": "text", "text": "What is "}, {"type": "image"},
                                         {"type": "text", "text": " showing?"}]}]
    theirs = proc.tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    ours, images = vlm.render_chat([{"role": "user", "content": [
        {"type": "text", "text": "What is "}, {"type": "image", "image": img}, {"type": "text", "text": " showing?"}]}])
    assert str(ours) == theirs and len(images) == 1
    with pytest.raises(PromptError):
        vlm.render_chat([{"role": "user", "content": "sneaky [IMG] token"}])
    # [IMG_BREAK] typed in a message is text, never the special token
    prompt, _ = vlm.render_chat([{"role": "user", "content": "a [IMG_BREAK] b"}])
    ids = vlm.tokenizer.encode_prompt(prompt, [])
    assert vlm.tokenizer._tok.token_to_id("[IMG_BREAK]") not in ids
    # token budget: checked from the size before any resize or encode
    big = noise_image(71, 300, 200)
    n = fam.prepare_image(big).num_tokens
    assert n == 4 * 6 and fam.token_grid(fam.prepare_image(big)) == (1, 4, 6)  # 96x64 px in 16-px tokens
    with pytest.raises(ContextLengthError) as e:
        fam.prepare_image(big, ImageOptions(max_tokens=n - 1))
    assert e.value.param == "image_max_tokens"
    with pytest.raises(ImageError):
        fam.prepare_image(noise_image(72, 2000, 1))
