"""Idefics3 (Idefics3ForConditionalGeneration) and SmolVLM (SmolVLMForConditionalGeneration)
parity with transformers on tiny random checkpoints (float32, tests/tiny_idefics3.py): tile
pixels, grids and token counts against the Pil image processors (wide, tall, square images;
splitting off; a tile cap), prompt ids against the real processors (`<fake_token_around_image>`,
`<row_i_col_j>`, `<global-img>`) and chat templates, image features and whole-prompt logits
(rel <= 1e-4), 32 greedy tokens and their logprobs (within 1e-4) for a prompt with two images of
different aspect ratios; the engine (tiles of several requests in shared encode calls, a tiled
image across prefill chunks, prefix and encoder caches) against one-at-a-time and caches-off
runs; the server's `detail` low / high and streaming."""
import numpy as np
import pytest
import torch

import mmjax
from conftest import noise_image, page_floor, rel_err
from mmjax.errors import CheckpointError, ContextLengthError, InvalidRequestError
from mmjax.models.family import ImageOptions
from tiny_idefics3 import load_processor

GREEDY = dict(temperature=0.0, ignore_eos=True)
# pages of 16: the tiny prompts' prefix hits are whole pages (of the default 64, often none)
ENGINE = dict(max_num_seqs=2, max_model_len=512, prefill_chunk=32, max_encode_batch=4, page_size=16)
_VLMS: dict = {}


def vlm_for(path, **kw) -> "mmjax.VLM":
    """One VLM per (checkpoint, options) for the module: compiled steps are shared by tests."""
    key = (str(path), tuple(sorted(kw.items())))
    if key not in _VLMS:
        _VLMS[key] = mmjax.load(path, **{**ENGINE, **kw})
    return _VLMS[key]


def chat(question: str, n_images: int = 2) -> list[dict]:
    content = [{"type": "text", "text": "look at"}]
    for i in range(n_images):
        content += [{"type": "image"}, {"type": "text", "text": ["and then", "too"][i % 2]}]
    return [{"role": "user", "content": content + [{"type": "text", "text": question}]}]


def with_images(messages, images):
    it = iter(images)
    return [{**m, "content": [dict(p, image=next(it)) if p["type"] == "image" else p for p in m["content"]]}
            for m in messages]


@pytest.fixture(scope="module", params=["idefics3", "smolvlm"])
def pair(request, idefics3_dirs):
    from transformers import AutoModelForImageTextToText
    path = idefics3_dirs[request.param]
    hf = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    return request.param, hf, load_processor(path), vlm_for(path)


def hf_inputs(proc, messages, images, **kw):
    text = proc.apply_chat_template(messages, add_generation_prompt=True)
    return proc(text=text, images=images, add_special_tokens=False, return_tensors="pt", **kw)


def test_tiles_token_counts_prompt_ids_and_chat_template(pair):
    from safetensors import safe_open
    name, hf, proc, vlm = pair
    fam = vlm.family
    assert type(hf).__name__ == {"idefics3": "Idefics3ForConditionalGeneration",
                                 "smolvlm": "SmolVLMForConditionalGeneration"}[name]
    with safe_open(str(vlm.loaded.path / "model.safetensors"), "np") as f:   # tied: saved without a head
        assert any("lm_head" in k for k in f.keys()) == (name == "idefics3")
    seq, tile = fam.cfg.tokens_per_tile, fam.policy.tile
    assert seq == proc.image_seq_len
    grids = set()
    for seed, (w, h) in enumerate([(100, 40), (40, 100), (60, 60), (20, 20), (200, 30), (33, 95)]):
        img = noise_image(seed, w, h)
        for opts, kw in (({}, {}), ({"max_tiles": 0}, {"do_image_splitting": False}),
                         ({"max_tiles": 2}, None)):
            [ours] = vlm.prepare_images([img], opts)
            if kw is None:   # a cap lowers the first resize: the processor's largest size whose grid fits
                for m in range(fam.policy.longest_edge // tile, 0, -1):
                    kw = {"size": {"longest_edge": m * tile}}
                    r = proc.image_processor(img, return_row_col_info=True, **kw)
                    if r["rows"][0][0] * r["cols"][0][0] <= 2:
                        break
            theirs = proc.image_processor(img, return_tensors="np", return_row_col_info=True, **kw)
            pv = theirs["pixel_values"][0].transpose(0, 2, 3, 1)
            assert ours.pixels.shape == pv.shape == (ours.rows * ours.cols + 1, tile, tile, 3)
            assert np.abs(ours.pixels - pv).max() <= 1e-6
            assert (ours.rows, ours.cols) == (theirs["rows"][0][0], theirs["cols"][0][0])
            assert ours.num_tokens == seq * len(pv)
            if not opts:
                grids.add((ours.rows, ours.cols))
    assert len(grids) >= 4                      # wide, tall, square and very wide images differ
    # chat template and prompt ids, two images of different aspect ratios (and one unsplit)
    msgs = chat("which is bigger?")
    images = [noise_image(7, 100, 45), noise_image(8, 40, 90)]
    prompt, _ = vlm.render_chat(with_images(msgs, images))
    assert str(prompt) == proc.apply_chat_template(msgs, add_generation_prompt=True)
    for opts, kw in (({}, {}), ({"max_tiles": 0}, {"do_image_splitting": False})):
        inputs = vlm.prepare_images(images, opts)
        ids = vlm.tokenizer.encode_prompt(prompt, [im.num_tokens for im in inputs],
                                          [fam.image_prompt(im) for im in inputs])
        theirs = hf_inputs(proc, msgs, images, **kw)
        assert ids == theirs["input_ids"][0].tolist()
        assert (theirs["input_ids"][0] == fam.image_token_id).sum() == sum(im.num_tokens for im in inputs)
    # the template iterates content parts: a plain-string message is rendered as one text part
    # (transformers would render it as nothing)
    as_str = vlm.tokenizer.render_chat([{"role": "user", "content": "hello <end_of_utterance> there"}])
    as_parts = [{"role": "user", "content": [{"type": "text", "text": "hello <end_of_utterance> there"}]}]
    assert str(as_str) == proc.apply_chat_template(as_parts, add_generation_prompt=True)
    assert "hello" in as_str and as_str.user_spans == vlm.tokenizer.render_chat(as_parts).user_spans != ()
    # budgets and bad input
    assert fam.fit_options(3 * seq).max_tiles == 2 and fam.fit_options(seq).max_tiles == 0
    with pytest.raises(ContextLengthError):
        vlm.prepare_images(images[:1], {"image_max_tokens": 2 * seq})
    with pytest.raises(InvalidRequestError, match="non-negative"):
        ImageOptions.from_dict({"max_tiles": -1})
    text = fam.image_prompt(vlm.prepare_images(images[:1])[0])
    assert "<row_1_col_1>" in text and "<global-img>" in text and text.count("<fake_token_around_image>") > 3


def test_pixel_views_undo_the_tiling(pair):
    """Saliency maps on the image's own pixels: the tiles and the global image lie where
    `Family.pixel_views` says (a marker's change lands on it: tests/marker_check.py)."""
    from marker_check import assert_family_views_find_markers
    assert assert_family_views_find_markers(pair[-1], ({}, {"max_tiles": 0})) >= 6


def test_checkpoint_errors(idefics3_dirs, tmp_path):
    """A processor whose tiles differ from the vision tower's image size, or whose image_seq_len
    disagrees with the config, is refused at load with the field named."""
    import json
    import shutil
    tile = {"longest_edge": 8}
    for field, change in (("max_image_size", lambda c: c["image_processor"].update(max_image_size=tile)),
                          ("image_seq_len", lambda c: c.update(image_seq_len=5))):
        bad = shutil.copytree(idefics3_dirs["idefics3"], tmp_path / field)
        cfg = json.loads((bad / "processor_config.json").read_text())
        change(cfg)
        (bad / "processor_config.json").write_text(json.dumps(cfg))
        with pytest.raises(CheckpointError) as e:
            mmjax.load(bad)
        assert e.value.param == field


def test_features_logits_greedy_and_logprobs(pair):
    """Two images (wide and tall: different grids), features, whole-prompt logits, 32 greedy
    tokens and logprobs."""
    name, hf, proc, vlm = pair
    msgs = chat("what is different?")
    images = [noise_image(11, 110, 50), noise_image(12, 45, 80)]
    inputs = hf_inputs(proc, msgs, images)
    n_prompt = inputs["input_ids"].shape[1]
    ims = vlm.prepare_images(images)
    assert (ims[0].rows, ims[0].cols) != (ims[1].rows, ims[1].cols)

    with torch.no_grad():
        theirs = hf.model.get_image_features(pixel_values=inputs["pixel_values"],
                                             pixel_attention_mask=inputs["pixel_attention_mask"]).pooler_output
        theirs = torch.cat(list(theirs)).numpy()
        hf_logits = hf(**inputs).logits[0].numpy()
    ours = np.concatenate(vlm.engine.runner.encode_images(ims))
    assert ours.shape == theirs.shape
    assert rel_err(ours, theirs) <= 1e-4

    prompt, _ = vlm.render_chat(with_images(msgs, images))
    logits = vlm.logits(prompt, images)
    other = vlm.logits(prompt, [noise_image(21, 110, 50), noise_image(22, 45, 80)])   # same sizes
    assert logits.shape == hf_logits.shape
    assert rel_err(logits, hf_logits) <= 1e-4
    assert rel_err(other, logits) > 1e-3                      # the images reach the logits

    hf.generation_config.eos_token_id = None
    with torch.no_grad():
        gen = hf.generate(**inputs, max_new_tokens=32, do_sample=False, output_logits=True,
                          return_dict_in_generate=True, pad_token_id=3)
    want = gen.sequences[0, n_prompt:].tolist()
    out = vlm.generate([{"prompt": prompt, "images": images}], mmjax.SamplingParams(max_tokens=32, logprobs=2,
                                                                                    **GREEDY))[0]
    assert len(want) == 32 and len(set(want)) > 4             # not a flat model
    assert out.token_ids == want
    assert out.num_image_tokens == sum(im.num_tokens for im in ims)
    hf_lp = [torch.log_softmax(l[0].double(), -1).numpy() for l in gen.logits]
    for step, lp in enumerate(out.logprobs):
        for tok, v in lp.items():
            assert abs(v - hf_lp[step][tok]) <= 1e-4


def test_engine_shared_tile_batches_chunks_and_caches(idefics3_dirs):
    """Tiles of all waiting images share encode calls (one 10-tile image and ten 1-tile images
    cost the same calls); prefill_chunk 32 < a tile's run of image tokens, so tiled images span
    several chunks; batched == one at a time == caches off; a repeat resumes from the prefix
    cache and reuses encoded images."""
    path = idefics3_dirs["idefics3"]
    vlm = vlm_for(path)
    off = vlm_for(path, enable_prefix_cache=False, encoder_cache_bytes=0)
    fam = vlm.family
    big = vlm.prepare_images([noise_image(30, 60, 60)])[0]
    small = vlm.prepare_images([noise_image(31 + i, 50, 30) for i in range(10)], {"max_tiles": 0})
    assert len(big.pixels) == 10 and all(len(im.pixels) == 1 for im in small)
    plans = [fam.encode_plan([big], 4), fam.encode_plan(small, 4)]
    assert [[c.bucket[0] for c in p] for p in plans] == [[4, 4, 2]] * 2
    mixed = vlm.prepare_images([noise_image(41, 100, 40), noise_image(42, 40, 40)], {"max_tiles": 2}) + [big]
    feats = vlm.engine.runner.encode_images(mixed)         # images' tiles straddle the calls
    for im, f in zip(mixed, feats):
        [alone] = vlm.engine.runner.encode_images([im])
        assert f.shape == (im.num_tokens, vlm.model.language_model.hidden_size)
        assert np.abs(f - alone).max() <= 1e-5

    imgs = [noise_image(21, 70, 60), noise_image(22, 160, 50), noise_image(23, 45, 45)]
    reqs = [
        {"prompt": chat("what is it?"), "images": imgs[:2]},
        {"prompt": chat("tell me the color of the left one please"), "images": imgs[:2]},
        {"prompt": chat("tell me the color of the left one please"), "images": imgs[:2]},
        {"prompt": chat("how many?", 1), "images": imgs[2:], "image_options": {"max_tiles": 0}},
        {"prompt": [{"role": "user", "content": [{"type": "text", "text": "hello there"}]}], "images": []},
    ]
    for r in reqs:
        r["prompt"], _ = vlm.render_chat(with_images(r["prompt"], r["images"]))
    sp = mmjax.SamplingParams(max_tokens=10, logprobs=1, **GREEDY)
    calls0 = vlm.engine.stats()["encoder_calls"]
    together = vlm.generate(reqs, sp)
    calls = vlm.engine.stats()["encoder_calls"] - calls0
    alone = [vlm.generate([r], sp)[0] for r in reqs]
    stats = vlm.engine.stats()
    cold = [off.generate([r], sp)[0] for r in reqs]
    assert [o.token_ids for o in together] == [o.token_ids for o in alone] == [o.token_ids for o in cold]
    for a, b in zip(together, cold):
        np.testing.assert_allclose([a.logprobs[i][t] for i, t in enumerate(a.token_ids)],
                                   [b.logprobs[i][t] for i, t in enumerate(b.token_ids)], atol=1e-4)
    n_tiles = sum(len(im.pixels) for im in vlm.prepare_images(imgs[:2])) + 1
    assert calls <= -(-n_tiles // 4) + 1          # tiles of different requests shared calls
    assert alone[0].num_image_tokens > 2 * ENGINE["prefill_chunk"]
    assert alone[2].cached_tokens == page_floor(vlm, len(alone[2].prompt_token_ids) - 1) > 0
    assert stats["encoder_cache_hits"] > 0 and off.engine.stats()["encoder_cache_hits"] == 0
    assert all(o.cached_tokens == 0 for o in cold)


def test_serve_detail_low_high_usage_and_streaming(idefics3_dirs):
    from serve.app import ServerConfig
    from serve.cli import build_parser, config_from_args
    from serve.media import MediaConfig, MediaFetcher
    from test_serve import Server, data_uri, img_part
    path = idefics3_dirs["smolvlm"]
    vlm = vlm_for(path)
    fam = vlm.family
    # detail -> options: "low" the global image alone; the server cap applies to "auto"/"high"
    for flag, cap in ((["--max-image-tiles", "2"], 2), ([], None)):
        cfg = config_from_args(build_parser().parse_args(["--model", "x"] + flag), "x")
        assert cfg.max_image_tiles == cap
        f = MediaFetcher(MediaConfig(max_tiles=cfg.max_image_tiles), fam)
        assert f._options("low").max_tiles == 0
        assert f._options("high").max_tiles == f._options("auto").max_tiles == cap
    uri = data_uri(51, w=120, h=50)

    def messages(detail):
        return [{"role": "user", "content": [{"type": "text", "text": "what is"}, img_part(uri, detail),
                                             {"type": "text", "text": "please"}]}]
    refs = {}   # offline first: the server's loop owns the engine once it runs
    for detail in ("low", "high"):
        prompt, _ = vlm.render_chat(messages(detail))
        opts = {"max_tiles": 0} if detail == "low" else {}
        [im] = vlm.prepare_images([uri], opts)
        refs[detail] = (im, vlm.generate([{"prompt": prompt, "images": [uri], "image_options": opts}],
                                         mmjax.SamplingParams(max_tokens=8, **GREEDY))[0])
    server = Server(vlm, ServerConfig(served_model_name="smol", log_stats_interval=0))
    try:
        c = server.client()
        for detail, (im, ref) in refs.items():
            full = c.chat.completions.create(model="smol", messages=messages(detail), max_tokens=8, temperature=0)
            chunks = list(c.chat.completions.create(model="smol", messages=messages(detail), max_tokens=8,
                                                    temperature=0, stream=True, stream_options={"include_usage": True}))
            text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
            assert full.choices[0].message.content == text == ref.text
            for u in (full.usage, chunks[-1].usage):
                assert u.prompt_tokens == len(ref.prompt_token_ids) and u.completion_tokens == 8
                assert u.prompt_tokens_details.image_tokens == im.num_tokens
        seq, (hi, _) = fam.cfg.tokens_per_tile, refs["high"]
        assert refs["low"][0].key != hi.key         # the encoder cache keeps the two preprocessings apart
        assert refs["low"][0].num_tokens == seq and hi.num_tokens == seq * (hi.rows * hi.cols + 1) > seq
    finally:
        server.close()
