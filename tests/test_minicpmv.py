"""MiniCPM-V 4.6 and 4.7 (MiniCPMV4_6ForConditionalGeneration, MiniCPMV4_7ForConditionalGeneration)
parity with transformers on tiny random checkpoints (float32, tests/tiny_minicpmv.py: Qwen3.5's
hybrid decoder, the window-merger tower), through the real MiniCPMV4_6Processor /
MiniCPMV4_7Processor, image processor and video processor:

- pixels (exact) and patch grids of every view (source + slices) for several sizes and slice caps,
  token counts, the prompt ids of a two-image prompt (`<image_id>`, `<image>`, `<slice>` rows);
  4.7's canvas M-RoPE positions and rope delta (exact);
- image features of five images' views packed into two calls (rel <= 1e-4), two-image logits (rel <= 1e-4),
  another image changes them, 32 greedy ids identical and their logprobs within 1e-4;
- video (one frame a second, per-frame slices; the video processor run with the torchvision
  calls stood in for): pixels exact, prompt ids, positions, image + video logits (rel <= 1e-4);
- the slicing knobs (max_tiles = max_slice_nums, `detail: low` = the source view alone, a token
  budget dropping slices) and the engine invariants and server (tests/conformance.py).
"""
import numpy as np
import pytest
import torch

import mmjax
from conformance import GREEDY, engine_invariants, served_through_openai
from conftest import noise_image, rel_err
from mmjax.errors import ContextLengthError
from mmjax.models.family import ImageOptions
from mmjax.models.minicpmv import MiniCPMVFamily
from mmjax.models.vision.minicpmv import merge_block_order
from tiny_minicpmv import hf_processor
from tiny_qwen3 import torchvision_stand_in
from tiny_video import write_video

# pages of 16: the tiny prompts' prefix hits are whole pages (of the default 64, often none)
ENGINE = dict(max_num_seqs=2, max_model_len=512, prefill_chunk=32, page_size=16)
ONE = "<|im_start|>user\n<unk>Describe this image .<|im_end|>\n<|im_start|>assistant\n"
TWO = "<|im_start|>user\nLook at <unk> and then <unk> which one is red ?<|im_end|>\n<|im_start|>assistant\n"
VID = "<|im_start|>user\n<unk> and <|video_pad|> Compare the two .<|im_end|>\n<|im_start|>assistant\n"
# (width, height): unsliced, 1x3, 3x1, 2x2, 1x4 (1x2 at 2 slices) grids
SIZES = [(90, 60), (300, 140), (40, 500), (250, 230), (1000, 90)]


@pytest.fixture(scope="module", params=["4.6", "4.7"])
def pair(request, minicpmv_dirs):
    from transformers import AutoModelForImageTextToText
    v = request.param
    path = minicpmv_dirs[v]
    hf = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    return v, hf, hf_processor(path, v), mmjax.load(path, **ENGINE)


def hf_views(pixel_values, target_sizes, p: int = 14) -> list[np.ndarray]:
    """The processor's NaViT-packed pixels [1, 3, p, L] -> each view's patches [h*w, p*p*3] in
    mmjax's order (patches flattened (ph, pw, c), views in merge-block order)."""
    pv, out, off = np.asarray(pixel_values)[0], [], 0
    for h, w in np.asarray(target_sizes).tolist():
        n = h * w
        x = pv[:, :, off * p:(off + n) * p].reshape(3, p, n, p).transpose(2, 1, 3, 0).reshape(n, p * p * 3)
        out.append(x[merge_block_order(h, w, 4)])
        off += n
    return out


def check_views(item, pixel_values, target_sizes):
    assert [tuple(s) for s in np.asarray(target_sizes).tolist()] == list(item.sizes)
    assert np.array_equal(np.concatenate(hf_views(pixel_values, target_sizes)), item.pixels)


def check_prompt(vlm, x, items) -> np.ndarray:
    """Our prompt ids (and for 4.7 positions and rope delta) equal the processor's / HF's."""
    fam = vlm.family
    counts = [im.num_tokens for im in items]
    ids = np.asarray(vlm.tokenizer.encode_prompt(x["prompt"], counts, fam.image_prompts(items),
                                                 [fam.token_id_of(im) for im in items]), np.int32)
    assert ids.tolist() == x["input_ids"][0].tolist()
    pos, delta = fam.positions(ids, items, fam.image_starts(ids, counts))
    if fam.cfg.version == "4.7":
        ref, ref_delta = x["hf"].model.get_rope_index(
            x["input_ids"], mm_token_type_ids=x["mm_token_type_ids"], target_sizes=x.get("target_sizes"),
            target_sizes_videos=x.get("target_sizes_videos"))
        np.testing.assert_array_equal(pos, ref[:, 0].numpy())
        assert delta == int(ref_delta[0, 0]) and delta < 0
    else:
        assert (pos == np.arange(len(ids))).all() and delta == 0
    return ids


def test_pixels_tokens_prompt_positions(pair):
    version, hf, proc, vlm = pair
    fam = vlm.family
    assert type(fam) is MiniCPMVFamily and fam.cfg.version == version and len(fam.cfg.text.layer_types) == 4
    for i, (w, h) in enumerate(SIZES):
        img = noise_image(i, w, h)
        for cap in (None, 2):
            x = proc.image_processor(img, return_tensors="np", **({} if cap is None else {"max_slice_nums": cap}))
            item = fam.prepare_image(img, ImageOptions(max_tiles=cap))
            check_views(item, x["pixel_values"], x["target_sizes"])
            assert tuple(x["grids"][0]) == item.slice_grid
            assert item.num_tokens == int((x["target_sizes"].prod(-1) // 16).sum())
    imgs = [noise_image(10, 300, 140), noise_image(11, 250, 230)]
    x = proc(text=[TWO], images=imgs, return_tensors="pt")
    ids = check_prompt(vlm, {**x, "prompt": TWO, "hf": hf}, vlm.prepare_images(imgs))
    marker = vlm.tokenizer.token_id
    assert (ids == marker("<slice>")).sum() == 3 + 4 and (ids == marker("<image_id>")).sum() == 2


def _greedy(hf, x, n=32):
    with torch.no_grad():
        g = hf.generate(**x, max_new_tokens=n, do_sample=False, eos_token_id=None, output_logits=True,
                        return_dict_in_generate=True, pad_token_id=0)
    return (g.sequences[0, x["input_ids"].shape[1]:].tolist(),
            [torch.log_softmax(lg[0].double(), -1).numpy() for lg in g.logits])


def test_features_logits_greedy(pair):
    version, hf, proc, vlm = pair
    imgs = [noise_image(20 + i, w, h) for i, (w, h) in enumerate(SIZES)]
    runner = vlm.engine.runner
    encode, calls = runner._encode, []
    runner._encode = lambda *a: (calls.append(a[1][0].shape[0]), encode(*a))[1]
    try:
        ours = vlm.encode(imgs)
    finally:
        runner._encode = encode
    # the views overflow the largest call: two calls, one image's views split between them
    assert len(calls) == 2 and all(c in vlm.family.encode_ladder for c in calls)
    x = proc.image_processor(imgs, return_tensors="pt")
    with torch.no_grad():
        theirs = hf.model.get_image_features(x["pixel_values"], x["target_sizes"]).pooler_output
    per_image = np.cumsum([0] + [1 + int(np.prod(g)) for g in x["grids"]])
    theirs = [torch.cat(theirs[a:b]).numpy() for a, b in zip(per_image[:-1], per_image[1:])]
    feat_err = max(rel_err(o, t) for o, t in zip(ours, theirs))
    assert [o.shape for o in ours] == [t.shape for t in theirs] and feat_err <= 1e-4
    two = imgs[1:3]
    x = proc(text=[TWO], images=two, return_tensors="pt")
    with torch.no_grad():
        ref = hf(**x).logits[0].numpy()
    got = vlm.logits(TWO, two)
    assert got.shape == ref.shape and rel_err(got, ref) <= 1e-4, rel_err(got, ref)
    assert rel_err(vlm.logits(TWO, [noise_image(30, 300, 140), two[1]]), got) > 1e-3
    ids, lps = _greedy(hf, x)
    out = vlm.generate([{"prompt": TWO, "images": two}], mmjax.SamplingParams(max_tokens=32, logprobs=1, **GREEDY))[0]
    assert out.token_ids == ids and len(set(ids)) > 4
    lp_err = max(abs(d[t] - lp[t]) for d, lp, t in zip(out.logprobs, lps, ids))
    assert lp_err <= 1e-4
    print(f"\n{version}: features rel {feat_err:.1e}, logits rel {rel_err(got, ref):.1e}, logprobs {lp_err:.1e}")


def test_video(pair, tmp_path_factory):
    """A 3 s clip at 8 fps (frames 0, 8, 16; 1x3 slices each) and a 5 s one at 10 fps (over
    max_num_frames 4: 0.1 s stamps thinned to 4 frames), beside an image."""
    version, hf, proc, vlm = pair
    d = tmp_path_factory.mktemp(f"minicpmv_videos_{version}")
    clips = [write_video(d / "a.mp4", 24, 8, 300, 140, seed=0), write_video(d / "b.mp4", 50, 10, 80, 48, seed=1)]
    img = noise_image(40, 250, 230)
    for clip, frames in zip(clips, ((0, 8, 16), (0, 16, 32, 49))):
        with torchvision_stand_in():
            x = proc(text=[VID], images=[img], videos=[clip], return_tensors="pt")
        items = vlm.prepare_images([img]) + vlm.prepare_videos([clip])
        assert items[1].kind == "video" and items[1].video.indices == frames
        check_views(items[1], x["pixel_values_videos"], x["target_sizes_videos"])
        check_prompt(vlm, {**x, "prompt": VID, "hf": hf}, items)
    with torch.no_grad():
        ref = hf(**x).logits[0].numpy()
    got = vlm.logits(VID, items)
    assert got.shape == ref.shape and rel_err(got, ref) <= 1e-4, rel_err(got, ref)
    print(f"\n{version}: image + video logits rel {rel_err(got, ref):.1e}")


def test_slicing_knobs(pair):
    """max_tiles caps the slices (0: the source view alone, `detail: low`); a token budget drops
    slices until the image fits, and an image whose source view alone is over it is refused."""
    _, _, proc, vlm = pair
    fam, img = vlm.family, noise_image(50, 1000, 90)
    full = fam.prepare_image(img)
    low = fam.prepare_image(img, ImageOptions(max_tiles=0))
    assert full.slice_grid == (1, 4) and low.slice_grid == (0, 0) and len(low.sizes) == 1
    x = proc.image_processor(img, return_tensors="np", max_slice_nums=1)
    check_views(low, x["pixel_values"], x["target_sizes"])
    fit = fam.prepare_image(img, fam.fit_options(full.num_tokens - 1))
    assert fit.num_tokens < full.num_tokens and fit.slice_grid == (1, 2)
    with pytest.raises(ContextLengthError):
        fam.prepare_image(img, fam.fit_options(low.num_tokens - 1))


def test_marker_ids_from_the_tokenizer(minicpmv_dirs):
    """A 4.7 config.json without the canvas marker ids (converted before transformers stored them)
    gets them from the tokenizer; 4.6 has none."""
    import json

    from mmjax.models import minicpmv
    path = minicpmv_dirs["4.7"]
    cfg = json.loads((path / "config.json").read_text())
    stored = {k: cfg.pop(k) for k in minicpmv.MARKERS}
    assert minicpmv.load(path, cfg)[0].cfg.markers == stored
    path = minicpmv_dirs["4.6"]
    assert minicpmv.load(path, json.loads((path / "config.json").read_text()))[0].cfg.markers == {}


def test_engine_and_server(pair):
    """tests/conformance.py: batched == alone == caches off across chunked image prompts, a
    repeat resumes from a snapshot of the decoder's recurrent states (serving/state_snapshots.py)
    at a chunk boundary, the image matters; the openai client."""
    _, _, _, vlm = pair
    imgs = [noise_image(60, 300, 140), noise_image(61, 90, 60)]
    reqs = [{"prompt": TWO, "images": vlm.prepare_images(imgs)},
            {"prompt": ONE, "images": vlm.prepare_images([noise_image(62, 250, 230)])}]
    figures = engine_invariants(vlm, reqs)
    assert figures["cached_tokens"] > 0
    import io
    buf = io.BytesIO()
    imgs[0].save(buf, format="PNG")
    served_through_openai(vlm, buf.getvalue(), "What is in the picture ?")
