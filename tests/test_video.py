"""Video input for Qwen2-VL / Qwen2.5-VL: parity with transformers (float32) on tiny random
checkpoints, limits, caching, and the server's `video_url` parts.

Videos are written with PyAV in the test (tests/tiny_video.py: moving colored shapes, two frame
rates, non-square). The transformers side decodes them with its own PyAV loader; its video
processor needs torchvision, which is not installable here, so tiny_video.hf_video_inputs runs
the processor's steps with transformers' and torch's own pieces (see its docstring). Measured:
decoded frames and pixel patches identical (0 difference), video features rel <= 1.1e-6, logits
rel <= 1.2e-6 (video alone and image + video, both families), 32 greedy ids identical, logprobs
within 6.3e-7; the asserts use the project's tolerances (1e-4). Frame counts and rates that do not
divide evenly (13 frames at 4 fps, sampled at 2 and 1.5 fps), as a file and as a list of frames
with its rate: prompt ids, second_per_grid_t and positions exact, logits rel <= 1e-6.

CUDA lowering: a video reaches the vision tower as packed patches of the same shapes as images
(`QwenVLFamily.encode_plan`, patch buckets from the same ladder), so no new compiled step exists;
`test_video_uses_the_image_encode_buckets` checks that the video's encode bucket is one of
`warmup_plan`'s (the shapes test_cuda_lowering.py exports).
"""
import time

import numpy as np
import pytest
import torch

import mmjax
from conftest import noise_image, rel_err
from mmjax.errors import ContextLengthError, PromptError, VideoError, VideoTooLargeError
from mmjax.models.family import VideoOptions
from mmjax.video import VideoLimits, decode_frames, plan_video, prepare_video, probe_video
from tiny_qwen import TINY_VIDEO_PROCESSOR, hf_processor_inputs
from tiny_video import hf_video_inputs, write_video

FAMILIES = ("qwen2_vl", "qwen2_5_vl")
VIDEO = ("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n"
         "<|vision_start|><|video_pad|><|vision_end|>What is in the picture ?<|im_end|>\n<|im_start|>assistant\n")
MIXED = ("<|im_start|>user\nPicture 1: <|vision_start|><|image_pad|><|vision_end|>Video 1: "
         "<|vision_start|><|video_pad|><|vision_end|>Compare the two .<|im_end|>\n<|im_start|>assistant\n")


@pytest.fixture(scope="module")
def videos(tmp_path_factory):
    """a: 24 frames at 8 fps, 112x64 (6 frames sampled at 2 fps); b: 15 frames at 6 fps, 80x48
    (4 frames at indices 0, 3, 7, 11; sampled fps 1.6, so Qwen2.5-VL's temporal step is fractional);
    c: 13 frames at 4 fps, 112x64 (6 frames 0, 2, ..., 10 at 2 fps: 13 / 4 * 2 = 6.5 frames, the
    sampled fps 6 / 13 * 4 and second_per_grid_t 13 / 12 divide unevenly)."""
    d = tmp_path_factory.mktemp("videos")
    return {"a": write_video(d / "a.mp4", 24, 8, 112, 64, seed=0),
            "b": write_video(d / "b.mp4", 15, 6, 80, 48, seed=1),
            "c": write_video(d / "c.mp4", 13, 4, 112, 64, seed=3), "dir": d}


@pytest.fixture(scope="module", params=FAMILIES)
def pair(request, qwen_dirs):
    from transformers import AutoModelForImageTextToText, AutoTokenizer, Qwen2VLImageProcessorPil
    path = qwen_dirs[request.param]
    hf = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(path)
    ip = Qwen2VLImageProcessorPil.from_pretrained(path)
    # the engine shapes of test_qwen2_vl.py: its compiled steps come from the persistent cache
    vlm = mmjax.load(path, max_num_seqs=2, max_model_len=2048, prefill_chunk=256)
    return request.param, hf, tok, ip, vlm


def test_preprocessing_matches_transformers(qwen_dirs, videos):
    """Frame sampling, decoded frames, pixel patches, grid, token count and second_per_grid_t
    against transformers for both videos and a list of 5 frames (odd: the last is repeated)."""
    vlm = mmjax.load(qwen_dirs["qwen2_5_vl"])
    fam = vlm.family
    frames5 = [np.asarray(noise_image(70 + i, 90, 50)) for i in range(5)]
    for src in (videos["a"], videos["b"], frames5):
        ref = hf_video_inputs([src if isinstance(src, str) else np.stack(src)], TINY_VIDEO_PROCESSOR)
        clip, plan = plan_video(fam, src)
        item = prepare_video(fam, src)
        assert item.kind == "video"
        assert item.grid == tuple(ref["video_grid_thw"][0].tolist())
        assert item.num_tokens == int(ref["video_grid_thw"][0].prod()) // 4 == plan.num_tokens
        np.testing.assert_array_equal(decode_frames(clip, plan.indices), ref["frames"][0])
        np.testing.assert_allclose(item.pixels, ref["pixel_values_videos"].numpy(), rtol=0, atol=1e-5)
        assert fam.second_per_grid_t(item) == pytest.approx(float(ref["second_per_grid_ts"][0]), rel=1e-6)
    assert [prepare_video(fam, videos[k]).video.indices for k in "ab"] == [(0, 4, 8, 12, 16, 20), (0, 3, 7, 11)]


def _hf_inputs(pair, prompt, images, video_srcs):
    name, _, tok, ip, _ = pair
    v = hf_video_inputs(video_srcs, TINY_VIDEO_PROCESSOR)
    v.pop("frames")
    if name == "qwen2_vl":
        v.pop("second_per_grid_ts")
    return hf_processor_inputs(tok, ip, prompt, images, videos=v)


@pytest.mark.parametrize("prompt", ["video", "mixed"])
def test_positions_features_and_logits_match(pair, videos, prompt):
    _, hf, _, _, vlm = pair
    text, images = (VIDEO, []) if prompt == "video" else (MIXED, [noise_image(5, 150, 100)])
    src = videos["a"] if prompt == "video" else videos["b"]
    x = _hf_inputs(pair, text, images, [src])
    items = vlm.prepare_images(images) + vlm.prepare_videos([src])
    counts = [im.num_tokens for im in items]
    ids = np.asarray(vlm.tokenizer.encode_prompt(text, counts, None, [vlm.family.token_id_of(im) for im in items]))
    assert ids.tolist() == x["input_ids"][0].tolist()
    ours, delta = vlm.family.positions(ids, items, vlm.family.image_starts(ids, counts))
    theirs, hf_delta = hf.model.get_rope_index(x["input_ids"], x["mm_token_type_ids"], x.get("image_grid_thw"),
                                               x["video_grid_thw"], second_per_grid_ts=x.get("second_per_grid_ts"))
    np.testing.assert_array_equal(ours, theirs[:, 0].numpy())
    assert delta == int(hf_delta[0, 0])
    with torch.no_grad():
        feats = hf.model.get_video_features(x["pixel_values_videos"], x["video_grid_thw"]).pooler_output[0].numpy()
        ref = hf(**x).logits[0].numpy()
    assert rel_err(vlm.engine.runner.encode_images([items[-1]])[0], feats) <= 1e-4
    got = vlm.logits(text, items)
    assert rel_err(got, ref) <= 1e-4
    # the video matters: its frames in reverse order (same token count) change the logits
    clip, plan = plan_video(vlm.family, src)
    other = vlm.prepare_videos([{"frames": list(decode_frames(clip, plan.indices)[::-1]), "fps": 2.0}])
    assert other[0].num_tokens == items[-1].num_tokens
    assert rel_err(vlm.logits(text, items[:-1] + other), ref) > 1e-3


def test_uneven_sampling_and_frames_with_a_rate_match_transformers(pair, videos):
    """Clip c (13 frames at 4 fps) sampled at 2 fps as a file and as a list of frames given with
    its rate (transformers samples an array video with its VideoMetadata as it samples a file, so
    the sampled fps is 6 / 13 * 4 for both, not the list's 4 fps), and the file at a request fps
    of 1.5 (4 frames: 0, 3, 6, 9; 13 / 4 * 1.5 = 4.875): prompt ids, second_per_grid_t, M-RoPE
    positions and logits (rel <= 1e-4) against transformers, video alone and image + video."""
    name, hf, tok, ip, vlm = pair
    fam = vlm.family
    clip = probe_video(videos["c"])
    frames = {"frames": list(decode_frames(clip, range(clip.meta.total_frames))), "fps": 4.0}
    cases = [(videos["c"], None, TINY_VIDEO_PROCESSOR), (frames, None, TINY_VIDEO_PROCESSOR),
             (videos["c"], {"fps": 1.5}, {**TINY_VIDEO_PROCESSOR, "fps": 1.5})]
    for src, opts, cfg in cases:
        item = vlm.prepare_videos([src], opts)[0]
        assert item.video.indices == ((0, 3, 6, 9) if opts else (0, 2, 4, 6, 8, 10))
        for text, images in ((VIDEO, []), (MIXED, [noise_image(5, 150, 100)])):
            v = hf_video_inputs([src], cfg)
            v.pop("frames")
            if name == "qwen2_5_vl":
                assert fam.second_per_grid_t(item) == pytest.approx(float(v["second_per_grid_ts"][0]), rel=1e-6)
            else:
                v.pop("second_per_grid_ts")
            x = hf_processor_inputs(tok, ip, text, images, videos=v)
            items = vlm.prepare_images(images) + [item]
            counts = [im.num_tokens for im in items]
            ids = np.asarray(vlm.tokenizer.encode_prompt(text, counts, None, [fam.token_id_of(im) for im in items]))
            assert ids.tolist() == x["input_ids"][0].tolist()
            ours, delta = fam.positions(ids, items, fam.image_starts(ids, counts))
            theirs, hf_delta = hf.model.get_rope_index(x["input_ids"], x["mm_token_type_ids"], x.get("image_grid_thw"),
                                                       x["video_grid_thw"], second_per_grid_ts=x.get("second_per_grid_ts"))
            np.testing.assert_array_equal(ours, theirs[:, 0].numpy())
            assert delta == int(hf_delta[0, 0])
            with torch.no_grad():
                ref = hf(**x).logits[0].numpy()
            assert rel_err(vlm.logits(text, items), ref) <= 1e-4


def test_greedy_generation_batched_and_cached(pair, videos):
    """32 greedy tokens and logprobs for a video prompt and a mixed image + video prompt, both in
    one engine batch, equal to transformers and to running them one at a time; asking the same
    video again decodes and encodes nothing."""
    _, hf, _, _, vlm = pair
    img = noise_image(6, 150, 100)
    reqs = [(VIDEO, [], [videos["a"]]), (MIXED, [img], [videos["b"]])]
    expected, hf_lps = [], []
    for text, images, vids in reqs:
        x = _hf_inputs(pair, text, images, vids)
        with torch.no_grad():
            g = hf.generate(**x, max_new_tokens=32, do_sample=False, eos_token_id=None, output_logits=True,
                            return_dict_in_generate=True, pad_token_id=hf.config.text_config.pad_token_id)
        expected.append(g.sequences[0, x["input_ids"].shape[1]:].tolist())
        hf_lps.append([torch.log_softmax(l[0].double(), -1).numpy() for l in g.logits])
    sp = mmjax.SamplingParams(max_tokens=32, temperature=0.0, logprobs=2, ignore_eos=True)
    batch = [{"prompt": t, "images": i, "videos": v} for t, i, v in reqs]
    outs = vlm.generate(batch, sp)
    for out, exp, lps, (_, images, vids) in zip(outs, expected, hf_lps, reqs):
        assert out.token_ids == exp
        for tok, ours, ref in zip(out.token_ids, out.logprobs, lps):
            assert all(abs(v - ref[i]) <= 1e-4 for i, v in ours.items())
        assert out.num_video_tokens == vlm.prepare_videos(vids)[0].num_tokens > 0
        assert out.num_image_tokens == sum(im.num_tokens for im in vlm.prepare_images(images))
    # one at a time, again: same ids; the videos come from the video cache and the encoder cache
    st, decodes = vlm.engine.stats(), vlm.video_cache.decodes
    alone = [vlm.generate([r], sp)[0] for r in batch]
    assert [o.token_ids for o in alone] == [o.token_ids for o in outs]
    st2 = vlm.engine.stats()
    assert vlm.video_cache.decodes == decodes
    assert st2["videos_encoded"] == st["videos_encoded"]
    # the prompts' KV comes from the prefix cache (keyed by the video's content + plan) or, where
    # the prefix cache misses, the features from the encoder cache
    assert (st2["tokens_cached"] - st["tokens_cached"]) + (st2["encoder_cache_hits"] - st["encoder_cache_hits"]) > 0


def test_chat_video_parts_and_placeholder_guard(pair, videos):
    _, _, _, _, vlm = pair
    msgs = [{"role": "user", "content": [{"type": "video", "video": videos["a"]},
                                         {"type": "text", "text": "What is in the picture ?"}]}]
    prompt, media = vlm.render_chat(msgs, with_kinds=True)
    assert str(prompt).endswith(VIDEO[VIDEO.index("<|im_start|>user"):]) and [k for k, _ in media] == ["video"]
    sp = mmjax.SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    a = vlm.chat(msgs, sp)
    b = vlm.generate([{"prompt": VIDEO, "videos": [videos["a"]]}], sp)[0]
    assert a.token_ids == b.token_ids and a.num_video_tokens > 0
    with pytest.raises(PromptError, match="reserved video placeholder"):
        vlm.chat([{"role": "user", "content": "look <|video_pad|>"}], sp)
    with pytest.raises(PromptError, match="1 video"):   # a video where the prompt has an image placeholder
        vlm.generate([{"prompt": VIDEO.replace("video_pad", "image_pad"), "videos": [videos["a"]]}], sp)


def test_video_uses_the_image_encode_buckets(pair, videos):
    _, _, _, _, vlm = pair
    fam = vlm.family
    item = vlm.prepare_videos([videos["a"]])[0]
    calls = fam.encode_plan([item, *vlm.prepare_images([noise_image(3, 90, 60)])], 8)
    assert len(calls) == 1 and calls[0].bucket in {c.bucket for c in fam.warmup_plan(8)}
    assert item.grid[0] == 3   # t > 1: three temporal patches, one attention segment each
    assert int(calls[0].inputs[2].max()) == 3   # image_seg: frames 0, 1, 2 then the image (3)


def test_limits_are_typed_and_known_before_decoding(qwen_dirs, videos, monkeypatch):
    vlm = mmjax.load(qwen_dirs["qwen2_vl"])
    fam, a = vlm.family, videos["a"]
    data = open(a, "rb").read()
    cases = [
        (VideoLimits(max_bytes=1000), VideoTooLargeError, "bytes"),
        (VideoLimits(max_duration_s=2.0), VideoTooLargeError, "s long"),
        (VideoLimits(max_stream_frames=20), VideoTooLargeError, "24 frames"),
        (VideoLimits(max_frames=4), VideoTooLargeError, "sampled at 6 frames"),
        (VideoLimits(max_pixels=100 * 60), VideoTooLargeError, "112x64"),
        (VideoLimits(codecs=("vp9",)), VideoError, "codec 'h264'"),
        (VideoLimits(max_decoded_bytes=5 * 112 * 64 * 3), VideoTooLargeError, "bytes decoded"),
    ]
    # none of these may decode a frame
    import mmjax.video as V
    monkeypatch.setattr(V, "decode_frames", lambda *a, **k: pytest.fail("decoded"))
    for limits, exc, msg in cases:
        with pytest.raises(exc, match=msg) as e:
            V.prepare_video(fam, data, limits)
        assert e.value.param == "video_url" and 400 <= e.value.status < 500
    with pytest.raises(ContextLengthError, match="video_max_tokens=5") as e:
        V.prepare_video(fam, data, VideoLimits(), VideoOptions(max_tokens=5))
    for bad in (b"\x00" * 4000, data[:300], b"not a video"):
        with pytest.raises(VideoError):
            V.prepare_video(fam, bad)
    monkeypatch.undo()
    with pytest.raises(VideoError, match="longer than") as e:   # the decode deadline
        decode_frames(probe_video(data), [0, 20], deadline=time.monotonic() - 1)
    assert e.value.code == "video_decode_timeout"
    with pytest.raises(Exception, match="fps"):
        VideoOptions.from_dict({"fps": -1})


def _video_uri(path) -> str:
    import base64
    return "data:video/mp4;base64," + base64.b64encode(open(path, "rb").read()).decode()


def test_server_video_url_chat_and_bad_videos(qwen_dirs, videos, monkeypatch):
    """A video_url chat through the openai client (streamed == non-streamed == offline, usage
    counts video tokens; file:// under the allowed path), then every bad-video case is a 4xx with
    an OpenAI error body, a decode that overruns --video-decode-timeout is a 400 while a text
    request is served meanwhile, and the server still answers the good request the same way."""
    import threading

    import serve.media as media
    import openai
    from serve.app import ServerConfig
    from test_serve import Server

    d = videos["dir"]
    bomb = write_video(d / "bomb.mp4", 8, 8, 256, 192)             # over max_video_pixels
    heavy = write_video(d / "heavy.mp4", 24, 8, 160, 120)          # 72 tokens, over video_max_tokens
    long = write_video(d / "long.mp4", 24, 2, 112, 64)             # 12 s, over max_video_duration
    ffv1 = write_video(d / "lossless.mkv", 8, 8, 112, 64, codec="ffv1")   # codec not allowed
    path = qwen_dirs["qwen2_5_vl"]
    vlm = mmjax.load(path, max_num_seqs=2, max_model_len=2048, prefill_chunk=256)
    cfg = ServerConfig(served_model_name="qwen", log_stats_interval=0, max_video_duration=10.0,
                       max_video_pixels=200 * 150, video_max_tokens=30, limit_videos=2, video_decode_timeout=3.0,
                       allowed_local_media_path=str(d))
    s = Server(vlm, cfg)
    try:
        c = s.client()
        msgs = [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": _video_uri(videos["a"])}},
                                             {"type": "text", "text": "What is in the picture ?"}]}]
        r = c.chat.completions.create(model="qwen", messages=msgs, max_tokens=8, temperature=0)
        chunks = list(c.chat.completions.create(model="qwen", messages=msgs, max_tokens=8, temperature=0,
                                                stream=True, stream_options={"include_usage": True}))
        text = r.choices[0].message.content
        assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == text
        ref = mmjax.load(path, max_num_seqs=2, max_model_len=2048, prefill_chunk=256)
        off = ref.chat([{"role": "user", "content": [{"type": "video", "video": videos["a"]},
                                                     {"type": "text", "text": "What is in the picture ?"}]}],
                       mmjax.SamplingParams(max_tokens=8, temperature=0.0))
        assert text == off.text
        u = chunks[-1].usage
        assert u.prompt_tokens_details.video_tokens == off.num_video_tokens == 24
        assert u.prompt_tokens_details.image_tokens == 0
        local = [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": f"file://{videos['a']}"}},
                                              {"type": "text", "text": "What is in the picture ?"}]}]
        assert c.chat.completions.create(model="qwen", messages=local, max_tokens=8,
                                         temperature=0).choices[0].message.content == text

        def part(url):
            return {"type": "video_url", "video_url": {"url": url}}
        bad = [
            ([part("data:video/mp4;base64," + "A" * 400)], 400, "invalid_video"),
            ([part(_video_uri(ffv1))], 400, "invalid_video"),
            ([part(_video_uri(long))], 413, "video_too_large"),
            ([part(_video_uri(bomb))], 413, "video_too_large"),
            ([part(_video_uri(heavy))], 400, "video_token_budget_exceeded"),
            ([part(_video_uri(videos["a"]))] * 3, 400, "too_many_videos"),
            ([part("http://127.0.0.1:9/v.mp4")], 400, "media_url_forbidden"),
            ([part("file:///etc/passwd")], 400, "local_media_forbidden"),
        ]
        for content, status, code in bad:
            resp = s.post("/v1/chat/completions", {"model": "qwen", "max_tokens": 2, "messages": [
                {"role": "user", "content": content + [{"type": "text", "text": "hi"}]}]})
            assert resp.status_code == status, (code, resp.text)
            err = resp.json()["error"]
            assert err["code"] == code and err["type"] and err["message"], err
            assert err["param"].startswith("messages"), err
        with pytest.raises(openai.BadRequestError):
            c.chat.completions.create(model="qwen", messages=[{"role": "user", "content": [part("data:video/mp4;base64,AAAA")]}],
                                      max_tokens=2)
        # a decode that overruns its deadline (stalled here until it has passed) fails alone; a
        # text request is served while it is stuck
        text_only = [{"role": "user", "content": "What is in the picture ?"}]
        plain = c.chat.completions.create(model="qwen", messages=text_only, max_tokens=4, temperature=0)
        real, started, stuck = media._prepare_video, threading.Event(), {}

        def stalled(family, source, limits, opts, deadline, cache):
            started.set()
            time.sleep(max(0.0, deadline - time.monotonic()) + 0.05)
            return real(family, source, limits, opts, deadline, cache)
        monkeypatch.setattr(media, "_prepare_video", stalled)
        worker = threading.Thread(target=lambda: stuck.update(r=s.post("/v1/chat/completions", {
            "model": "qwen", "max_tokens": 2, "messages": [{"role": "user", "content": [part(_video_uri(videos["b"]))]}]})))
        worker.start()
        assert started.wait(30)
        meanwhile = c.chat.completions.create(model="qwen", messages=text_only, max_tokens=4, temperature=0)
        assert worker.is_alive()            # the video was still decoding when the text request finished
        worker.join(60)
        monkeypatch.undo()
        assert meanwhile.choices[0].message.content == plain.choices[0].message.content
        assert stuck["r"].status_code == 400 and stuck["r"].json()["error"]["code"] == "video_decode_timeout"
        again = c.chat.completions.create(model="qwen", messages=msgs, max_tokens=8, temperature=0)
        assert again.choices[0].message.content == text
        assert s.metric("mmjax_videos_total") >= 4 + len(bad)
        assert s.metric("mmjax_video_tokens_total") >= 4 * 24
        assert s.metric("mmjax_video_decode_seconds_count") >= 4
        assert s.state.fetcher.video_cache.decodes == 1       # the same video, decoded once
        assert vlm.engine.stats()["videos_encoded"] == 1       # and encoded once
    finally:
        s.close()


def test_video_url_for_a_model_without_video_is_a_400():
    from serve import schema
    body = {"messages": [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": "data:video/mp4;base64,AAAA"}}]}]}
    with pytest.raises(mmjax.InvalidRequestError) as e:
        schema.parse_chat(body, limits=schema.RequestLimits(limit_videos=0))
    assert e.value.code == "video_not_supported" and e.value.param == "messages[0].content[0].video_url"
    assert schema.parse_chat(body).images[0].kind == "video"


def test_http_video_fetch_byte_cap_and_cache(qwen_dirs, videos):
    """http(s) videos go through the image fetcher (SSRF guard, redirects, byte cap on
    Content-Length and on the streamed body), here against a local server the test allows."""
    import asyncio

    from aiohttp import web

    from serve.media import MediaConfig, MediaFetcher
    from serve.schema import ImageRef

    data = open(videos["a"], "rb").read()
    fam = mmjax.load(qwen_dirs["qwen2_vl"]).family

    async def serve_video(request):
        return web.Response(body=data, content_type="video/mp4")

    async def go():
        app = web.Application()
        app.router.add_get("/a.mp4", serve_video)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        url = f"http://127.0.0.1:{port}/a.mp4"
        ref = ImageRef(url=url, param="messages[0].content[0].video_url", kind="video")
        try:
            guarded = MediaFetcher(MediaConfig(), fam)
            with pytest.raises(mmjax.InvalidRequestError) as e:          # loopback: refused by default
                await guarded.load(ref)
            assert e.value.code == "media_url_forbidden" and e.value.param == ref.param
            await guarded.close()
            f = MediaFetcher(MediaConfig(allow_private_urls=True), fam)
            item = await f.load(ref)
            again = await f.load(ref)
            assert item.kind == "video" and again is item and f.video_cache.decodes == 1
            np.testing.assert_array_equal(item.pixels, prepare_video(fam, data).pixels)
            await f.close()
            small = MediaFetcher(MediaConfig(allow_private_urls=True, video_limits=VideoLimits(max_bytes=1000)), fam)
            with pytest.raises(VideoTooLargeError) as e:
                await small.load(ref)
            assert e.value.status == 413 and e.value.param == ref.param
            await small.close()
        finally:
            await runner.cleanup()
    asyncio.run(go())
