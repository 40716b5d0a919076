"""InternVL 3 / 3.5 (InternVLForConditionalGeneration) parity with transformers on tiny random
checkpoints (float32, tests/tiny_internvl.py: Qwen2 text + LayerNorm InternViT, and Qwen3-MoE text
(a dense and an MoE layer) + RMSNorm / QK-norm InternViT with a final layernorm), through the real
InternVLProcessor: tile
pixels, grids and token counts (wide, tall, square, tiny and very wide images; tiling off; a tile
cap) against GotOcr2ImageProcessorPil, prompt ids (`<img>`, `<IMG_CONTEXT>`, `</img>`) and the
chat template, image features and whole-prompt logits (rel <= 1e-4), 32 greedy tokens
(identical) and their logprobs (within 1e-4) for a prompt with two images of different grids;
video (`Frame{i}:` blocks, the video processor's frame sampling and resize run as transformers'
own code) pixels and prompt ids exact, logits (rel <= 1e-4) and greedy ids; tests/conformance.py's
engine invariants, the server through the openai client (image and video) and TP 2.
"""
import copy
import json
import shutil

import numpy as np
import pytest
import torch

import conformance
import mmjax
from conftest import noise_image, page_floor, rel_err
from mmjax.errors import CheckpointError, ContextLengthError
from mmjax.models.family import ImageInput, VideoOptions
from tiny_internvl import hf_processor

GREEDY = dict(temperature=0.0, ignore_eos=True)
# pages of 16: the tiny prompts' prefix hits are whole pages (of the default 64, often none)
ENGINE = dict(max_num_seqs=2, max_model_len=512, prefill_chunk=32, max_encode_batch=4, page_size=16)
_VLMS: dict = {}
ASK = "What is in the picture ?"


def vlm_for(path, **kw) -> "mmjax.VLM":
    key = (str(path), tuple(sorted(kw.items())))
    if key not in _VLMS:
        _VLMS[key] = mmjax.load(path, **{**ENGINE, **kw})
    return _VLMS[key]


def content(kinds: list[str], sources: list | None = None, text: str = ASK) -> list[dict]:
    """One user message: media parts of `kinds` ("image" / "video"), then the text."""
    parts = []
    for i, k in enumerate(kinds):
        parts.append({"type": k} if sources is None else {"type": k, k: sources[i]})
    return [{"role": "user", "content": parts + [{"type": "text", "text": text}]}]


@pytest.fixture(scope="module", params=["qwen2", "qwen3"])
def pair(request, internvl_dirs):
    from transformers import AutoModelForImageTextToText
    path = internvl_dirs[request.param]
    hf = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    return request.param, hf, hf_processor(path), vlm_for(path)


def test_tiles_token_counts_prompt_ids_and_budgets(pair):
    name, hf, proc, vlm = pair
    fam = vlm.family
    assert type(hf).__name__ == "InternVLForConditionalGeneration" and fam.name == "internvl"
    seq, tile = fam.cfg.tokens_per_tile, fam.policy.tile
    assert seq == proc.image_seq_length
    grids = set()
    for seed, (w, h) in enumerate([(100, 40), (40, 100), (60, 60), (20, 20), (200, 30), (33, 95)]):
        img = noise_image(seed, w, h)
        for opts, kw in (({}, {}), ({"max_tiles": 0}, {"crop_to_patches": False}), ({"max_tiles": 2}, {"max_patches": 2})):
            [ours] = vlm.prepare_images([img], opts)
            theirs = proc.image_processor(img, return_tensors="np", **{"crop_to_patches": True, **kw})
            pv = theirs["pixel_values"].transpose(0, 2, 3, 1)
            assert ours.pixels.shape == pv.shape and pv.shape[1:] == (tile, tile, 3)
            assert np.abs(ours.pixels - pv).max() == 0
            assert ours.num_tokens == seq * len(pv) == seq * int(theirs["num_patches"][0])
            if not opts:
                grids.add((ours.cols, ours.rows))
    assert len(grids) >= 4                      # wide, tall, square and tiny images differ
    # chat template and prompt ids: two images of different grids, default and untiled
    images = [noise_image(7, 100, 45), noise_image(8, 40, 90)]
    msgs = content(["image", "image"], text="Compare the two images .")
    prompt, _ = vlm.render_chat(content(["image", "image"], images, "Compare the two images ."))
    assert str(prompt) == proc.apply_chat_template(msgs, add_generation_prompt=True)
    for opts, kw in (({}, {}), ({"max_tiles": 0}, {"crop_to_patches": False})):
        inputs = vlm.prepare_images(images, opts)
        ids = vlm.tokenizer.encode_prompt(prompt, [im.num_tokens for im in inputs],
                                          [fam.image_prompt(im) for im in inputs])
        theirs = proc(text=str(prompt), images=images, return_tensors="pt", **kw)["input_ids"][0]
        assert ids == theirs.tolist()
        assert (theirs == fam.image_token_id).sum() == sum(im.num_tokens for im in inputs)
    # budgets: detail "low" / --image-max-tokens -> max_patches
    assert fam.fit_options(3 * seq).max_tiles == 2 and fam.fit_options(seq).max_tiles == 0
    big = vlm.prepare_images(images[:1], fam.fit_options(3 * seq))[0]
    assert big.num_tokens <= 3 * seq and len(big.pixels) == big.cols * big.rows + 1 == 3
    with pytest.raises(ContextLengthError):
        vlm.prepare_images(images[:1], {"image_max_tokens": 2 * seq})
    with pytest.raises(ContextLengthError):                   # the server's --image-max-tokens
        copy.copy(fam).configure(image_max_tokens=2 * seq).prepare_image(images[0])


def test_checkpoint_errors(internvl_dirs, tmp_path):
    """A processor whose tiles are not the tower's image size, or whose image_seq_length disagrees
    with the config, is refused at load with the field named."""
    for field, fname, change in (("size", "preprocessor_config.json", lambda c: c.update(size={"height": 8, "width": 8})),
                                 ("image_seq_length", "processor_config.json", lambda c: c.update(image_seq_length=5))):
        bad = shutil.copytree(internvl_dirs["qwen2"], tmp_path / field)
        cfg = json.loads((bad / fname).read_text())
        change(cfg)
        (bad / fname).write_text(json.dumps(cfg))
        with pytest.raises(CheckpointError) as e:
            mmjax.load(bad)
        assert e.value.param == field


def test_features_logits_greedy_and_logprobs(pair):
    """Two images of different grids: features, whole-prompt logits, 32 greedy tokens, logprobs."""
    name, hf, proc, vlm = pair
    images = [noise_image(11, 110, 50), noise_image(12, 45, 80)]
    ims = vlm.prepare_images(images)
    assert (ims[0].cols, ims[0].rows) != (ims[1].cols, ims[1].rows)
    prompt, _ = vlm.render_chat(content(["image", "image"], images, "Compare the two images ."))
    inputs = proc(text=str(prompt), images=images, return_tensors="pt")
    n_prompt = inputs["input_ids"].shape[1]
    with torch.no_grad():
        theirs = hf.model.get_image_features(pixel_values=inputs["pixel_values"]).pooler_output
        theirs = theirs.reshape(-1, theirs.shape[-1]).numpy()
        hf_logits = hf(**inputs).logits[0].numpy()
    ours = np.concatenate(vlm.engine.runner.encode_images(ims))
    assert ours.shape == theirs.shape
    feat = rel_err(ours, theirs)
    assert feat <= 1e-4
    logits = vlm.logits(prompt, images)
    other = vlm.logits(prompt, [noise_image(21, 110, 50), noise_image(22, 45, 80)])   # same grids
    assert logits.shape == hf_logits.shape
    assert rel_err(logits, hf_logits) <= 1e-4
    assert rel_err(other, logits) > 1e-3                      # the images reach the logits

    with torch.no_grad():
        gen = hf.generate(**inputs, max_new_tokens=32, do_sample=False, output_logits=True, eos_token_id=None,
                          return_dict_in_generate=True, pad_token_id=0)
    want = gen.sequences[0, n_prompt:].tolist()
    out = vlm.generate([{"prompt": prompt, "images": ims}], mmjax.SamplingParams(max_tokens=32, logprobs=2, **GREEDY))[0]
    assert len(want) == 32 and len(set(want)) > 3             # not a flat model
    assert out.token_ids == want
    assert out.num_image_tokens == sum(im.num_tokens for im in ims)
    hf_lp = [torch.log_softmax(l[0].double(), -1).numpy() for l in gen.logits]
    worst = max(abs(v - hf_lp[step][tok]) for step, lp in enumerate(out.logprobs) for tok, v in lp.items())
    assert worst <= 1e-4
    print(f"\n{name}: features rel {feat:.1e}, logits rel {rel_err(logits, hf_logits):.1e}, "
          f"greedy 32 identical, logprobs max diff {worst:.1e}")


@pytest.fixture(scope="module")
def video(tmp_path_factory):
    from tiny_video import write_video
    return write_video(tmp_path_factory.mktemp("internvl_video") / "a.mp4", 14, 6, 80, 48, seed=0)


def test_video_frames_prompt_logits_and_greedy(internvl_dirs, video):
    """A video then an image: the sampled frames (initial shift), their tiles, the `Frame{i}:`
    prompt ids exact; logits and 16 greedy ids against transformers; reversed frames change them."""
    from transformers import AutoModelForImageTextToText

    from tiny_qwen3 import torchvision_stand_in
    path = internvl_dirs["qwen3"]
    hf = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    proc, vlm = hf_processor(path), vlm_for(path)
    fam = vlm.family
    img = noise_image(3, 50, 70)
    text = "Compare the two images and the video ."
    with torchvision_stand_in():
        x = proc(text=proc.apply_chat_template(content(["video", "image"], text=text), add_generation_prompt=True),
                 images=[img], videos=[video], return_tensors="pt")
    items = vlm.prepare_videos([video]) + vlm.prepare_images([img])
    assert items[0].kind == "video" and items[0].video.indices == (2, 7, 11)     # 3 of 14 frames, shifted
    prompt, _ = vlm.render_chat(content(["video", "image"], [video, img], text))
    ids = vlm.tokenizer.encode_prompt(prompt, [im.num_tokens for im in items], [fam.image_prompt(im) for im in items],
                                      [fam.token_id_of(im) for im in items])
    assert ids == x["input_ids"][0].tolist()
    assert "Frame3: <img>" in fam.image_prompt(items[0])
    # budgets: the request's and the server's (--video-max-tokens), from the metadata before decoding
    from mmjax.video import plan_video
    seq = fam.cfg.tokens_per_tile
    with pytest.raises(ContextLengthError, match="video_max_tokens=18"):
        plan_video(fam, video, opts=VideoOptions(max_tokens=2 * seq))
    capped = copy.copy(fam).configure(video_max_tokens=2 * seq)
    with pytest.raises(ContextLengthError):
        plan_video(capped, video)
    # 1 fps over 14 frames at 6 fps: int(14 / 6) = 2 frames, a step of 7 from a shift of 3.5
    assert plan_video(capped, video, opts=VideoOptions(fps=1.0))[1].indices == (3, 10)
    pixels = np.concatenate([im.pixels for im in items])
    assert np.abs(pixels - x["pixel_values"].numpy().transpose(0, 2, 3, 1)).max() == 0
    with torch.no_grad():
        ref = hf(**x).logits[0].numpy()
        gen = hf.generate(**x, max_new_tokens=16, do_sample=False, eos_token_id=None, pad_token_id=0)
    logits = vlm.logits(prompt, items)
    assert rel_err(logits, ref) <= 1e-4
    out = vlm.generate([{"prompt": prompt, "images": items}], mmjax.SamplingParams(max_tokens=16, **GREEDY))[0]
    assert out.token_ids == gen[0, x["input_ids"].shape[1]:].tolist()
    assert out.num_video_tokens == items[0].num_tokens == 3 * fam.cfg.tokens_per_tile
    flipped = [ImageInput(**{**items[0].__dict__, "pixels": items[0].pixels[::-1].copy(),
                                                 "key": items[0].key + ":flipped"})] + items[1:]
    assert rel_err(vlm.logits(prompt, flipped), logits) > 1e-3
    print(f"\nvideo + image: logits rel {rel_err(logits, ref):.1e}, greedy 16 identical")


def test_engine_invariants_and_server(internvl_dirs, video):
    """tests/conformance.py: batched == alone == caches off with a tiled image chunked across
    prefill, the prefix cache, the image mattering; the openai client with an image and a video."""
    import base64
    import io

    from serve.app import ServerConfig
    from serve.media import MediaConfig, MediaFetcher
    from test_serve import Server
    path = internvl_dirs["qwen2"]
    vlm = vlm_for(path)
    reqs = [conformance.chat_request(vlm, [noise_image(30, 90, 40)], "What is in the picture ?"),
            conformance.chat_request(vlm, [noise_image(31, 40, 40), noise_image(32, 30, 70)], "Compare the two images ."),
            conformance.chat_request(vlm, [], "hello world")]
    figs = conformance.engine_invariants(vlm, reqs)
    print(f"\nengine: {figs}")
    sp = mmjax.SamplingParams(max_tokens=4, **GREEDY)        # a repeat resumes after its two tiled images
    first, again = (vlm.generate([reqs[1]], sp)[0] for _ in range(2))
    assert again.cached_tokens == page_floor(vlm, len(again.prompt_token_ids) - 1) > 0
    assert again.token_ids == first.token_ids
    # detail "low": one tile; "auto" / "high": the checkpoint's tiling capped by --max-image-tiles
    f = MediaFetcher(MediaConfig(max_tiles=2), vlm.family)
    assert f._options("low").max_tiles == 0 and f._options("high").max_tiles == f._options("auto").max_tiles == 2
    wide = noise_image(34, 120, 40)
    low, high = (vlm.prepare_images([wide], f._options(d))[0] for d in ("low", "high"))
    assert len(low.pixels) == 1 and len(high.pixels) == 3 and high.num_tokens == 3 * low.num_tokens
    buf = io.BytesIO()
    noise_image(33, 70, 50).save(buf, format="PNG")
    assert conformance.served_through_openai(vlm, buf.getvalue(), "What is in the picture ?")
    uri = "data:video/mp4;base64," + base64.b64encode(open(video, "rb").read()).decode()
    msgs = [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": uri}},
                                         {"type": "text", "text": ASK}]}]
    s = Server(vlm, ServerConfig(served_model_name="m", log_stats_interval=0))
    try:
        r = s.client().chat.completions.create(model="m", messages=msgs, max_tokens=8, temperature=0)
    finally:
        s.close()
    off = vlm.chat([{"role": "user", "content": [{"type": "video", "video": video}, {"type": "text", "text": ASK}]}],
                   mmjax.SamplingParams(max_tokens=8, temperature=0.0))
    assert r.choices[0].message.content == off.text
    assert r.usage.prompt_tokens_details.video_tokens == off.num_video_tokens == 4 * vlm.family.cfg.tokens_per_tile


def test_tensor_parallel_2_matches_one_device(internvl_dirs):
    out = conformance.tensor_parallel_matches(internvl_dirs["qwen3"])
    print(f"\nTP 2: {out['tp2']['sharded']} sharded weights, greedy ids equal")


def test_pixel_views_undo_the_tiling(internvl_dirs):
    """Saliency maps on the image's own pixels: the tiles and the thumbnail lie where
    `Family.pixel_views` says (a marker's change lands on it: tests/marker_check.py)."""
    from marker_check import assert_family_views_find_markers
    assert assert_family_views_find_markers(vlm_for(internvl_dirs["qwen2"]), ({}, {"max_tiles": 0})) >= 6
