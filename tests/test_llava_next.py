"""LLaVA-NeXT and LLaVA-OneVision (anyres tiling) parity with transformers on tiny random
checkpoints (float32, tests/tiny_llava_next.py: NeXT over Mistral with a sliding window shorter
than its prompts, OneVision over SigLIP + Qwen2): tiles' pixels and token counts for wide, tall and
square images (each picks another grid), image features (rel <= 1e-4) with the tiles of several
images encoded together across calls, logits for one image and for two images of different
aspect ratios (OneVision: HF's multi-image mode, overview only), the tile cap and overview-only
mode against transformers given the same pinpoints, 32 greedy tokens and logprobs (1e-4); the
engine (chunked prefill through tiled images, prefix + encoder caches) against one-at-a-time and
caches-off runs; the encode plan's cost (tiles, not images); the server's `detail` low / high.
"""
import json

import numpy as np
import pytest
import torch

import mmjax
from mmjax.models.family import ImageOptions
from mmjax.research.prompt import prompt_inputs
from conftest import noise_image, page_floor, rel_err

GREEDY = dict(temperature=0.0, ignore_eos=True)
ENGINE = dict(max_num_seqs=2, max_model_len=384, prefill_chunk=16, max_encode_batch=4, page_size=16)   # one prefill bucket
WIDE, TALL, SQUARE, BIG = (50, 21), (23, 61), (40, 37), (100, 90)
_VLMS: dict = {}


def vlm_for(path, **kw) -> "mmjax.VLM":
    """One VLM per (checkpoint, options) for the module: compiled steps are shared by tests."""
    key = (str(path), tuple(sorted(kw.items())))
    if key not in _VLMS:
        _VLMS[key] = mmjax.load(path, **{**ENGINE, **kw})
    return _VLMS[key]


def prompt(n_images: int, question: str = "What is in the picture?") -> str:
    return "USER: " + "<image>\n" * n_images + question + " ASSISTANT:"


@pytest.fixture(scope="module", params=["next", "onevision"])
def pair(request, llava_next_dirs):
    from tiny_llava_next import load_processor
    from transformers import AutoModelForImageTextToText
    path = llava_next_dirs[request.param]
    hf = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    return request.param, hf, load_processor(path), vlm_for(path)


def hf_inputs(proc, text: str, images: list):
    """The processor's inputs for one prompt (its images nested: OneVision's multi-image mode
    for more than one, as its chat-template path does)."""
    return proc(text=text, images=[images] if len(images) > 1 else images, return_tensors="pt")


def hf_features(hf, inputs) -> list[np.ndarray]:
    kw = {"batch_num_images": inputs["batch_num_images"]} if "batch_num_images" in inputs else {}
    with torch.no_grad():
        out = hf.model.get_image_features(pixel_values=inputs["pixel_values"], image_sizes=inputs["image_sizes"], **kw)
    return [f.numpy() for f in out.pooler_output]


def test_tiles_tokens_features_and_logits(pair):
    name, hf, proc, vlm = pair
    tid = vlm.family.image_token_id
    imgs = [noise_image(i, w, h) for i, (w, h) in enumerate((WIDE, TALL, SQUARE, BIG))]
    grids = []
    extreme = [noise_image(9, 1, 300), noise_image(10, 2000, 3)]     # unpadding leaves no column / row
    for img in imgs + extreme:
        im = vlm.prepare_images([img])[0]
        inputs = hf_inputs(proc, prompt(1), [img])
        pv = inputs["pixel_values"][0].numpy().transpose(0, 2, 3, 1)
        assert im.pixels.shape == pv.shape
        assert np.abs(im.pixels - pv).max() <= 1e-5
        assert im.num_tokens == int((inputs["input_ids"] == tid).sum())
        assert im.num_tokens == vlm.family.grid(img.height, img.width).num_tokens   # known from the size alone
        grids.append((im.layout.rows, im.layout.cols))
    assert len(set(grids[:3])) == 3                  # wide, tall and square pick different grids
    assert [im.layout.out_h * im.layout.out_w for im in vlm.prepare_images(extreme[:1])] == [0]
    if name == "onevision":                          # a grid over anyres_max_2 tiles' worth is downscaled
        assert any(im.layout.out_h < im.layout.crop[1] - im.layout.crop[0]
                   for im in vlm.prepare_images([imgs[2]]))
    # all images' tiles encoded together (more views than max_encode_batch: images span calls)
    ours = vlm.encode(imgs)
    assert sum(len(im.pixels) for im in (vlm.prepare_images([i])[0] for i in imgs)) > vlm.engine.runner.max_encode_batch
    for img, f in zip(imgs, ours):
        [theirs] = hf_features(hf, hf_inputs(proc, prompt(1), [img]))
        assert f.shape == theirs.shape
        assert rel_err(f, theirs) <= 1e-4
    # whole-prompt logits, two images of different aspect ratios (one image: the greedy test)
    for images in ([imgs[0], imgs[1]],):
        text = prompt(len(images))
        inputs = hf_inputs(proc, text, images)
        counts = [im.num_tokens for im in vlm.prepare_images(images)]
        assert vlm.tokenizer.encode_prompt(text, counts) == inputs["input_ids"][0].tolist()
        with torch.no_grad():
            theirs = hf(**inputs).logits[0].numpy()
        ours = vlm.logits(text, images)
        assert ours.shape == theirs.shape
        assert rel_err(ours, theirs) <= 1e-4
        other = [noise_image(90 + i, *im.size) for i, im in enumerate(images)]    # same sizes, same tokens
        assert rel_err(vlm.logits(text, other), ours) > 1e-3                      # the images reach the logits
        if name == "onevision" and len(images) > 1:
            assert counts == [17, 17]                # multi-image prompt: overview + newline each


def test_pixel_views_undo_the_anyres_tiling(pair):
    """Saliency maps on the image's own pixels: the overview (OneVision's padded square) and the
    tiles of the padded grid canvas lie where `Family.pixel_views` says (a marker's change lands
    on it: tests/marker_check.py)."""
    from marker_check import assert_family_views_find_markers
    assert assert_family_views_find_markers(pair[-1], ({}, {"max_tiles": 0})) >= 6


def test_tile_cap_and_overview_only(pair):
    """max_tiles=2 drops the bigger grids (transformers given only the allowed pinpoints agrees);
    max_tiles=0 is the overview + one newline (NeXT: the overview's features through HF's tower
    and projector; OneVision: HF's multi-image branch, checked above)."""
    name, hf, proc, vlm = pair
    img = noise_image(7, *SQUARE)
    full, capped, low = (vlm.prepare_images([img], {"max_tiles": t})[0] for t in (None, 2, 0))
    assert full.layout.tiles > 2 >= capped.layout.tiles > 0 and low.layout.tiles == 0
    assert full.num_tokens > capped.num_tokens > low.num_tokens == vlm.family.cfg.side ** 2 + 1
    allowed = [list(p) for p in vlm.family.policy.allowed(2)]
    old = (proc.image_processor.image_grid_pinpoints, hf.config.image_grid_pinpoints)
    proc.image_processor.image_grid_pinpoints, hf.config.image_grid_pinpoints = allowed, allowed
    try:
        inputs = hf_inputs(proc, prompt(1), [img])
        assert capped.num_tokens == int((inputs["input_ids"] == vlm.family.image_token_id).sum())
        with torch.no_grad():
            theirs = hf(**inputs).logits[0].numpy()
        ours, _ = vlm.prompt_forward(prompt_inputs(vlm, prompt(1), [img], image_options={"max_tiles": 2}))
        assert rel_err(ours, theirs) <= 1e-4
    finally:
        proc.image_processor.image_grid_pinpoints, hf.config.image_grid_pinpoints = old
    if name == "next":
        [feats] = vlm.engine.runner.encode_images([low])
        pv = torch.from_numpy(low.pixels.transpose(0, 3, 1, 2).copy())
        with torch.no_grad():
            hs = hf.model.vision_tower(pv, output_hidden_states=True).hidden_states[-2][:, 1:]
            theirs = torch.cat([hf.model.multi_modal_projector(hs)[0], hf.model.image_newline[None]]).numpy()
        assert rel_err(feats, theirs) <= 1e-4


def test_greedy_generation_and_logprobs_match(pair):
    name, hf, proc, vlm = pair
    img = noise_image(4, *(SQUARE if name == "next" else WIDE))
    inputs = hf_inputs(proc, prompt(1), [img])
    hf.generation_config.eos_token_id = None
    with torch.no_grad():
        gen = hf.generate(**inputs, max_new_tokens=32, do_sample=False, output_logits=True,
                          return_dict_in_generate=True, pad_token_id=3)
    theirs = gen.sequences[0, inputs["input_ids"].shape[1]:].tolist()
    out = vlm.generate([{"prompt": prompt(1), "images": [img]}],
                       mmjax.SamplingParams(max_tokens=32, logprobs=3, **GREEDY))[0]
    assert len(theirs) == 32 and out.token_ids == theirs
    hf_lp = [torch.log_softmax(l[0].double(), -1).numpy() for l in gen.logits]
    for step, lp in enumerate(out.logprobs):
        assert len(lp) >= 3
        for tok, v in lp.items():
            assert abs(v - hf_lp[step][tok]) <= 1e-4


def test_engine_batched_alone_and_caches_off(pair, llava_next_dirs):
    """Tiled images of up to 88 tokens through 16-token prefill chunks; batched == one at a time
    == caches off; a repeat resumes from the prefix cache and reuses the encoded tiles."""
    name, _, _, vlm = pair
    off = vlm_for(llava_next_dirs[name], enable_prefix_cache=False, encoder_cache_bytes=0)
    imgs = [noise_image(20 + i, w, h) for i, (w, h) in enumerate((WIDE, TALL, SQUARE, BIG))]
    reqs = [{"prompt": prompt(2, "compare them"), "images": imgs[:2]},
            {"prompt": prompt(1, "tell me the color of the left one please"), "images": imgs[2:3]},
            {"prompt": prompt(1, "tell me the color of the left one please"), "images": imgs[2:3]},
            {"prompt": prompt(1, "how many?"), "images": imgs[3:], "image_options": {"max_tiles": 0}},
            {"prompt": "USER: hello there ASSISTANT:", "images": []}]
    sp = mmjax.SamplingParams(max_tokens=8, logprobs=1, **GREEDY)
    together = vlm.generate(reqs, sp)
    alone = [vlm.generate([r], sp)[0] for r in reqs]
    stats = vlm.engine.stats()
    cold = [off.generate([r], sp)[0] for r in reqs]
    assert [o.token_ids for o in together] == [o.token_ids for o in alone] == [o.token_ids for o in cold]
    for a, b in zip(together, cold):
        np.testing.assert_allclose([a.logprobs[i][t] for i, t in enumerate(a.token_ids)],
                                   [b.logprobs[i][t] for i, t in enumerate(b.token_ids)], atol=1e-4)
    assert alone[2].cached_tokens == page_floor(vlm, len(alone[2].prompt_token_ids) - 1) > ENGINE["prefill_chunk"]
    assert stats["encoder_cache_hits"] > 0 and off.engine.stats()["encoder_cache_hits"] == 0
    assert all(o.cached_tokens == 0 for o in cold)
    assert min(len(o.prompt_token_ids) for o in alone[:3]) > 2 * ENGINE["prefill_chunk"]   # several chunks each


def test_encode_cost_counts_tiles_not_images(llava_next_dirs):
    """One image of 10 views and ten overview-only images make the same calls (same buckets)."""
    fam = vlm_for(llava_next_dirs["onevision"]).family
    big = fam.prepare_image(noise_image(1, *SQUARE))
    small = [fam.prepare_image(noise_image(2 + i, 30, 20 + i), ImageOptions(max_tiles=0))
             for i in range(len(big.pixels))]
    assert len(big.pixels) == 10 and all(len(s.pixels) == 1 for s in small)
    for max_batch in (4, 8):
        a, b = fam.encode_plan([big], max_batch), fam.encode_plan(small, max_batch)
        assert [c.bucket for c in a] == [c.bucket for c in b] and len(a) == -(-10 // max_batch)


def test_options_config_and_server_flags(llava_next_dirs):
    from mmjax.errors import InvalidRequestError, UnsupportedModelError
    from mmjax.models.llava_next import LlavaNextConfig
    from serve.cli import build_parser, config_from_args
    from serve.media import MediaConfig, MediaFetcher
    with pytest.raises(InvalidRequestError):
        ImageOptions.from_dict({"max_tiles": -1})
    assert ImageOptions.from_dict({"max_tiles": 0}).max_tiles == 0
    cfg = json.loads((llava_next_dirs["next"] / "config.json").read_text())
    with pytest.raises(UnsupportedModelError, match="vision_feature_select_strategy"):
        LlavaNextConfig.from_hf({**cfg, "vision_feature_select_strategy": "full"})
    ov = json.loads((llava_next_dirs["onevision"] / "config.json").read_text())
    with pytest.raises(UnsupportedModelError, match="vision_aspect_ratio"):
        LlavaNextConfig.from_hf({**ov, "vision_aspect_ratio": "pad"})
    args = config_from_args(build_parser().parse_args(["--model", "x", "--max-image-tiles", "2"]), "x")
    assert args.max_image_tiles == 2
    for name, multi in (("next", 2), ("onevision", 0)):
        f = MediaFetcher(MediaConfig(max_tiles=2), vlm_for(llava_next_dirs[name]).family)
        assert f._options("auto").max_tiles == f._options("high").max_tiles == 2
        assert f._options("low").max_tiles == 0
        assert f._options("auto", n_images=2).max_tiles == multi       # OneVision: multi-image prompts are overview only
    # --image-max-tokens: the tile cap under which every grid fits, even without unpadding
    fam = vlm_for(llava_next_dirs["next"]).family
    caps = {n: MediaFetcher(MediaConfig(image_max_tokens=n), fam)._options("auto").max_tiles for n in (17, 60, 80, 88)}
    assert caps == {17: 0, 60: 2, 80: 3, 88: None}
    for n, cap in caps.items():
        worst = max(fam.prepare_image(noise_image(50 + i, w, h), ImageOptions(max_tiles=cap)).num_tokens
                    for i, (w, h) in enumerate((WIDE, TALL, SQUARE, (60, 19), (19, 60))))
        assert worst <= n
    from mmjax.errors import ContextLengthError
    with pytest.raises(ContextLengthError, match="image_max_tokens"):
        fam.prepare_image(noise_image(60, *SQUARE), ImageOptions(max_tokens=40))


def test_serve_detail_low_high_and_stream(llava_next_dirs):
    from mmjax.image.decode import load_image
    from serve.app import ServerConfig
    from test_serve import Server, data_uri, img_part
    vlm = vlm_for(llava_next_dirs["next"])
    server = Server(vlm, ServerConfig(served_model_name="ln", log_stats_interval=0))
    try:
        uri = data_uri(31, w=40, h=37)
        c = server.client()
        usage = {}
        for detail in ("low", "high"):
            msgs = [{"role": "user", "content": [img_part(uri, detail), {"type": "text", "text": "describe"}]}]
            full = c.chat.completions.create(model="ln", messages=msgs, max_tokens=6, temperature=0)
            chunks = list(c.chat.completions.create(model="ln", messages=msgs, max_tokens=6, temperature=0,
                                                    stream=True, stream_options={"include_usage": True}))
            text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
            assert text == full.choices[0].message.content
            assert chunks[-1].usage.prompt_tokens_details.image_tokens == full.usage.prompt_tokens_details.image_tokens
            usage[detail] = full.usage.prompt_tokens_details.image_tokens
        want = [vlm.family.prepare_image(load_image(uri), ImageOptions(max_tiles=t)).num_tokens
                for t in (0, None)]
        assert [usage["low"], usage["high"]] == want and want[0] == vlm.family.cfg.side ** 2 + 1 < want[1]
    finally:
        server.close()
    # OneVision: one image is tiled, each image of a two-image request is overview only
    ov = vlm_for(llava_next_dirs["onevision"])
    server = Server(ov, ServerConfig(served_model_name="ov", log_stats_interval=0))
    try:
        c = server.client()
        uris = [data_uri(32, w=50, h=21), data_uri(33, w=23, h=61)]
        counts = []
        for parts in ([img_part(uris[0])], [img_part(u) for u in uris]):
            msgs = [{"role": "user", "content": parts + [{"type": "text", "text": "compare"}]}]
            r = c.chat.completions.create(model="ov", messages=msgs, max_tokens=2, temperature=0)
            counts.append(r.usage.prompt_tokens_details.image_tokens)
        one = ov.family.prepare_image(load_image(uris[0])).num_tokens
        assert counts == [one, 2 * (ov.family.cfg.side ** 2 + 1)] and one > ov.family.cfg.side ** 2 + 1
    finally:
        server.close()


def test_tiling_bench_smoke(tmp_path, monkeypatch, capsys):
    """`mmjax bench tiling --smoke` in process: its JSON line, with the 4-tile image and the five
    overview-only images on the same encode calls (no timing assertions)."""
    from benchmarks import tiling
    monkeypatch.setenv("MMJAX_BENCH_DIR", str(tmp_path))
    assert tiling.main(["--smoke", "--repeats", "1"]) == 0
    r = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    rows = {row["case"]: row for row in r["rows"]}
    assert [row["views"] for row in r["rows"]] == [5, 8, 5]
    assert rows["one 4-tile image"]["buckets"] == rows["five overview-only images"]["buckets"]
    assert all(row["median_s"] > 0 and row["image_tokens"] > 0 for row in r["rows"])
