"""GLM-4.1V (Glm4vForConditionalGeneration), GLM-4.5V (Glm4vMoeForConditionalGeneration) and GLM-4.6V
(Glm46VForConditionalGeneration) parity with transformers on tiny random checkpoints (float32),
against the real Glm4vProcessor (tiny_glm4v.hf_processor) and its chat template.

Checked: pixel patches (max abs <= 1e-5; measured 0), grids and token counts exact (GLM's
smart_resize: the bounds count an image as two frames); prompt ids exact
(`<|begin_of_image|><|image|>...<|end_of_image|>`); image features rel <= 1e-4 (one packed call
of three non-square images == one at a time; bicubic position-table resampling); M-RoPE prompt
positions exact against Glm4vModel.get_rope_index and the decode offset; logits of a two-image
prompt rel <= 1e-4 and the images reach them; 32 greedy tokens identical and logprobs within 1e-4
through the engine with 16-token prefill chunks (images straddle chunk edges; the MoE decoder's
group-limited sigmoid router and shared expert in chunk and decode steps); the image-token budget
(`fit_options`, `image_max_tokens`) maps to the processor's max_pixels. The engine invariants, the
openai-client server and TP 2 are tests/conformance.py's; CUDA lowering is test_cuda_lowering.py's.

Video, against the real Glm4vVideoProcessor / Glm46VVideoProcessor + Glm4vProcessor (transformers'
own code with the torchvision calls stood in for, tiny_qwen3.torchvision_stand_in): sampled frames,
pixel patches, grids, token counts and prompt ids with the per-frame
`<|begin_of_image|>...<|end_of_image|>{seconds}` text exact; positions exact (each frame placed
like an image); video features rel <= 1e-4 and the logits of a video prompt rel <= 1e-4; 32
greedy tokens identical (an image + video prompt: prompt ids and positions against the processor,
batched == alone; transformers' forward refuses images beside a video, its image mask counting
the frames' tokens); a `video_url` chat through the openai client with
usage video_tokens; GLM-4.6V's dynamic-rate sampling against Glm46VVideoProcessor.sample_frames.
"""
import numpy as np
import pytest
import torch

import mmjax
from conftest import noise_image, rel_err
from conformance import chat_request, engine_invariants, served_through_openai, tensor_parallel_matches
from mmjax.errors import CheckpointError, ContextLengthError
from mmjax.models import glm4v as G
from mmjax.models.family import ImageOptions, image_runs
from tiny_glm4v import hf_processor, video_processor_class
from tiny_qwen3 import torchvision_stand_in
from tiny_video import write_video

KINDS = ("dense", "moe")
SIZES = [(150, 110), (90, 200), (230, 75)]   # (width, height), non-square
CHUNK = 16
# pages of 16: the tiny prompts' prefix hits are whole pages (of the default 64, often none)
ENGINE = dict(max_num_seqs=2, max_model_len=512, prefill_chunk=CHUNK, page_size=16)
ARCH = {"dense": "Glm4vForConditionalGeneration", "moe": "Glm4vMoeForConditionalGeneration",
        "46v": "Glm46VForConditionalGeneration"}


def chat_text(proc, n_images: int, question: str) -> str:
    content = [{"type": "image"}] * n_images + [{"type": "text", "text": question}]
    return proc.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True)


@pytest.fixture(scope="module", params=KINDS)
def pair(request, glm4v_dirs):
    from transformers import AutoModelForImageTextToText
    path = glm4v_dirs[request.param]
    hf = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    return request.param, hf, hf_processor(path), mmjax.load(path, **ENGINE)


def test_config_and_errors(pair, glm4v_dirs):
    kind, hf, _, vlm = pair
    assert type(hf).__name__ == ARCH[kind]
    fam, text = vlm.family, vlm.family.cfg.text
    assert fam.name == hf.config.model_type and fam.image_token_id == hf.config.image_token_id
    assert text.rotary_dim == text.head_dim // 2 and text.rope.mrope_section == (1, 1, 2)
    assert text.post_norms == (kind == "dense") and (text.glm_moe is not None) == (kind == "moe")
    if kind == "moe":
        moe = text.glm_moe
        assert (moe.num_experts, moe.top_k, moe.n_group, moe.topk_group, moe.first_k_dense) == (8, 2, 4, 2, 1)
        # the router stays float32 in a bf16 model (as transformers keeps it)
        from mmjax.api import load_model
        gate = load_model(glm4v_dirs[kind], "bfloat16").module.language_model.layers[1].mlp.gate
        assert gate.weight.get_value().dtype == gate.e_score_correction_bias.get_value().dtype == np.float32
    cfg = hf.config.to_dict()
    cfg["text_config"]["rope_parameters"]["mrope_section"] = [2, 2, 2]
    with pytest.raises(CheckpointError) as e:
        G.Glm4vConfig.from_hf(cfg)
    assert "mrope_section" in e.value.param


def test_pixels_features_and_budget(pair):
    _, hf, proc, vlm = pair
    imgs = [noise_image(10 + i, w, h) for i, (w, h) in enumerate(SIZES)] + [noise_image(9, 20, 300)]
    ref = proc.image_processor(imgs, return_tensors="pt")
    inputs = vlm.prepare_images(imgs)
    assert [im.grid for im in inputs] == [tuple(g) for g in ref["image_grid_thw"].tolist()]
    assert [im.num_tokens for im in inputs] == [int(g.prod()) // 4 for g in ref["image_grid_thw"]]
    assert np.abs(np.concatenate([im.pixels for im in inputs]) - ref["pixel_values"].numpy()).max() <= 1e-5
    runner = vlm.engine.runner
    packed = runner.encode_images(inputs)                  # one packed call
    alone = [runner.encode_images([im])[0] for im in inputs]
    with torch.no_grad():
        out = hf.model.get_image_features(pixel_values=ref["pixel_values"], image_grid_thw=ref["image_grid_thw"])
    for p, a, t in zip(packed, alone, out.pooler_output):
        assert p.shape == tuple(t.shape) and rel_err(p, t.numpy()) <= 1e-4
        assert np.abs(p - a).max() <= 1e-5 * max(np.abs(a).max(), 1.0)
    # the token budget maps to the processor's max_pixels (counted over two frames)
    fam, big = vlm.family, noise_image(5, 400, 300)
    opts = fam.fit_options(12)
    im = fam.prepare_image(big, opts)
    ref = proc.image_processor([big], size={"shortest_edge": fam.pixel_bounds()[0],
                                            "longest_edge": opts.max_pixels}, return_tensors="pt")
    assert im.num_tokens <= 12 and im.grid == tuple(ref["image_grid_thw"][0].tolist())
    with pytest.raises(ContextLengthError):
        fam.prepare_image(big, ImageOptions(max_tokens=im.num_tokens - 1, max_pixels=opts.max_pixels * 4))


def test_positions_and_logits_two_images(pair):
    _, hf, proc, vlm = pair
    text = chat_text(proc, 2, "Compare the two images.")
    imgs = [noise_image(30, *SIZES[0]), noise_image(31, *SIZES[2])]
    x = proc(text=[text], images=imgs, return_tensors="pt")
    inputs = vlm.prepare_images(imgs)
    counts = [im.num_tokens for im in inputs]
    ids = np.asarray(vlm.tokenizer.encode_prompt(text, counts), np.int32)
    assert ids.tolist() == x["input_ids"][0].tolist()
    ours, delta = vlm.family.positions(ids, inputs, vlm.family.image_starts(ids, counts))
    theirs, hf_delta = hf.model.get_rope_index(x["input_ids"], x["mm_token_type_ids"], x["image_grid_thw"])
    np.testing.assert_array_equal(ours, theirs[:, 0].numpy())
    assert delta == int(hf_delta[0, 0]) < 0
    with torch.no_grad():
        ref = hf(**x).logits[0].numpy()
    got = vlm.logits(text, imgs)
    assert got.shape == ref.shape and rel_err(got, ref) <= 1e-4
    other = vlm.logits(text, [noise_image(32, *SIZES[0]), noise_image(33, *SIZES[2])])   # same sizes
    assert rel_err(other, got) > 1e-3                          # the images reach the logits


def test_greedy_32_tokens_chunked(pair):
    """32 greedy tokens == transformers (logprobs within 1e-4) for a one-image and a two-image
    prompt through 16-token prefill chunks, batched; every prompt has an image across a chunk edge."""
    _, hf, proc, vlm = pair
    a, b = noise_image(40, 260, 190), noise_image(41, *SIZES[2])
    reqs = [{"prompt": chat_text(proc, 1, "Describe this image."), "images": [a]},
            {"prompt": chat_text(proc, 2, "Compare the two images."), "images": [b, a]}]
    outs = vlm.generate(reqs, mmjax.SamplingParams(max_tokens=32, temperature=0.0, logprobs=2, ignore_eos=True))
    runs = [image_runs(np.asarray(o.prompt_token_ids), vlm.family.image_token_id) for o in outs]
    assert all(any(s < k < e for s, e in rs for k in range(CHUNK, 512, CHUNK)) for rs in runs), runs
    for r, o in zip(reqs, outs):
        x = proc(text=[r["prompt"]], images=r["images"], return_tensors="pt")
        assert x["input_ids"][0].tolist() == list(o.prompt_token_ids)
        with torch.no_grad():
            g = hf.generate(**x, max_new_tokens=32, do_sample=False, eos_token_id=None, output_logits=True,
                            return_dict_in_generate=True, pad_token_id=hf.config.text_config.pad_token_id)
        expected = g.sequences[0, x["input_ids"].shape[1]:].tolist()
        assert len(set(expected)) > 2 and o.token_ids == expected
        for ours, ref in zip(o.logprobs, g.logits):
            ref = torch.log_softmax(ref[0].double(), -1).numpy()
            assert all(abs(v - ref[i]) <= 1e-4 for i, v in ours.items())


def test_engine_invariants_and_server(pair):
    kind, _, _, vlm = pair
    reqs = [chat_request(vlm, [noise_image(50, 150, 110)], "Describe this image."),
            chat_request(vlm, [noise_image(51, 90, 200), noise_image(52, 60, 60)], "Compare the two images.")]
    figures = engine_invariants(vlm, reqs)
    assert figures["cached_tokens"] > 0
    if kind == "dense":
        import io
        buf = io.BytesIO()
        noise_image(53, 120, 90).save(buf, format="PNG")
        assert served_through_openai(vlm, buf.getvalue(), "What is in the picture ?")


@pytest.mark.parametrize("kind", ["moe"])
def test_tensor_parallel_2(glm4v_dirs, kind):
    out = tensor_parallel_matches(glm4v_dirs[kind])
    assert out["tp2"]["ids_equal"]


def test_glm46v_logits(glm4v_dirs):
    """Glm46VForConditionalGeneration (GLM-4.6V's class over the dense text model) loads and matches."""
    from transformers import AutoModelForImageTextToText
    path = glm4v_dirs["46v"]
    hf = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    assert type(hf).__name__ == ARCH["46v"]
    proc, vlm = hf_processor(path), mmjax.load(path, **ENGINE)
    assert vlm.family.name == "glm46v"
    text, imgs = chat_text(proc, 1, "What is in the picture ?"), [noise_image(60, 120, 150)]
    x = proc(text=[text], images=imgs, return_tensors="pt")
    with torch.no_grad():
        ref = hf(**x).logits[0].numpy()
    assert rel_err(vlm.logits(text, imgs), ref) <= 1e-4


# ------------------------------------------------------------------------------------------------
# Video
# ------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def clips(tmp_path_factory):
    """a: 24 frames at 8 fps, 112x64 (fps 2: frames 0, 4, .. 20, three temporal patches); a2: a with
    other shapes' phases; b: 15 frames at 6 fps, 80x48 (duration 2.5 s: 5 frames, the last repeated)."""
    d = tmp_path_factory.mktemp("glm4v_videos")
    return {"a": write_video(d / "a.mp4", 24, 8, 112, 64, seed=0),
            "a2": write_video(d / "a2.mp4", 24, 8, 112, 64, seed=5),
            "b": write_video(d / "b.mp4", 15, 6, 80, 48, seed=1)}


def _hf_video(proc, text: str, images: list, video) -> dict:
    with torchvision_stand_in():
        return proc(text=[text], images=images or None, videos=[video], return_tensors="pt")


def _video_chat(proc, with_image: bool) -> str:
    content = ([{"type": "image"}] if with_image else []) + [{"type": "video"}, {"type": "text", "text": "Compare ."}]
    return proc.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True)


def test_video_pixels_prompt_positions_features_and_logits(pair, clips):
    _, hf, proc, vlm = pair
    fam = vlm.family
    for text, images, src in ((_video_chat(proc, False), [], clips["a"]),
                              (_video_chat(proc, True), [noise_image(5, 150, 100)], clips["b"])):
        x = _hf_video(proc, text, images, src)
        items = vlm.prepare_images(images) + vlm.prepare_videos([src])
        video = items[-1]
        assert video.kind == "video" and video.grid == tuple(x["video_grid_thw"][0].tolist())
        assert video.num_tokens == int(x["video_grid_thw"][0].prod()) // 4
        assert np.abs(video.pixels - x["pixel_values_videos"].numpy()).max() <= 1e-5
        ids = np.asarray(vlm.tokenizer.encode_prompt(text, [im.num_tokens for im in items],
                                                     [fam.image_prompt(im) for im in items],
                                                     [fam.token_id_of(im) for im in items]), np.int32)
        assert ids.tolist() == x["input_ids"][0].tolist()
        ours, delta = fam.positions(ids, items, fam.image_starts(ids, [im.num_tokens for im in items]))
        theirs, hf_delta = hf.model.get_rope_index(x["input_ids"], x["mm_token_type_ids"], x.get("image_grid_thw"),
                                                   x["video_grid_thw"])
        np.testing.assert_array_equal(ours, theirs[:, 0].numpy())
        assert delta == int(hf_delta[0, 0])
        with torch.no_grad():
            feats = hf.model.get_video_features(x["pixel_values_videos"], x["video_grid_thw"]).pooler_output[0]
        assert rel_err(vlm.engine.runner.encode_images([video])[0], feats.numpy()) <= 1e-4
        if not images:   # transformers' forward refuses images beside a video (its image mask counts the frames)
            with torch.no_grad():
                ref = hf(**x).logits[0].numpy()
            got = vlm.logits(text, items)
            assert got.shape == ref.shape and rel_err(got, ref) <= 1e-4
        calls = fam.encode_plan(items, 8)
        assert len(calls) == 1 and calls[0].bucket in {c.bucket for c in fam.warmup_plan(8)}
    assert vlm.prepare_videos([clips["a"]])[0].video.indices == (0, 4, 8, 12, 16, 20)
    other, first = vlm.prepare_videos([clips["a2"]]), vlm.prepare_videos([clips["a"]])
    text = _video_chat(proc, False)
    assert rel_err(vlm.logits(text, other), vlm.logits(text, first)) > 1e-3


def test_video_generation_and_server(pair, clips):
    import base64

    from serve.app import ServerConfig
    from test_serve import Server

    kind, hf, proc, vlm = pair
    img = noise_image(6, 150, 100)
    reqs = [{"prompt": _video_chat(proc, False), "images": [], "videos": [clips["a"]]},
            {"prompt": _video_chat(proc, True), "images": [img], "videos": [clips["b"]]}]
    sp = mmjax.SamplingParams(max_tokens=32, temperature=0.0, logprobs=2, ignore_eos=True)
    together = vlm.generate(reqs, sp)
    alone = vlm.generate(reqs[1:], sp)[0]
    assert alone.token_ids == together[1].token_ids
    for r, o in zip(reqs, together):
        x = _hf_video(proc, r["prompt"], r["images"], r["videos"][0])
        assert list(o.prompt_token_ids) == x["input_ids"][0].tolist()
        assert o.num_video_tokens == int(x["video_grid_thw"][0].prod()) // 4
        if r["images"]:  # transformers' forward refuses images beside a video: batched == alone above
            continue
        with torch.no_grad():
            g = hf.generate(**x, max_new_tokens=32, do_sample=False, eos_token_id=None, output_logits=True,
                            return_dict_in_generate=True, pad_token_id=hf.config.text_config.pad_token_id)
        assert o.token_ids == g.sequences[0, x["input_ids"].shape[1]:].tolist()
        for ours, ref in zip(o.logprobs, g.logits):
            ref = torch.log_softmax(ref[0].double(), -1).numpy()
            assert all(abs(v - ref[i]) <= 1e-4 for i, v in ours.items())
    if kind != "dense":
        return
    uri = "data:video/mp4;base64," + base64.b64encode(open(clips["a"], "rb").read()).decode()
    msgs = [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": uri}},
                                         {"type": "text", "text": "Compare ."}]}]
    s = Server(vlm, ServerConfig(served_model_name="glm", log_stats_interval=0))
    try:
        r = s.client().chat.completions.create(model="glm", messages=msgs, max_tokens=8, temperature=0,
                                               extra_body={"ignore_eos": True})
    finally:
        s.close()
    assert r.choices[0].message.content == vlm.tokenizer.decode(together[0].token_ids[:8])
    assert r.usage.prompt_tokens_details.video_tokens == together[0].num_video_tokens


def test_glm46v_video_sampling_and_prompt(glm4v_dirs, clips):
    """GLM-4.6V: Glm46VVideoProcessor's dynamic-rate frames and Glm46VProcessor's "{t:.1f} seconds"."""
    from transformers.video_utils import VideoMetadata
    path = glm4v_dirs["46v"]
    vlm = mmjax.load(path, **ENGINE)
    policy, ref = vlm.family.video_policy, video_processor_class("46v").from_pretrained(path)
    for total, fps in ((24, 8.0), (15, 6.0), (400, 10.0), (7, 1.0), (4000, 2.0)):
        meta = VideoMetadata(total_num_frames=total, fps=fps, duration=total / fps)
        assert policy.sample_indices(total, fps, None, total / fps).tolist() == ref.sample_frames(meta).tolist()
    proc = hf_processor(path, "46v")
    text = _video_chat(proc, False)
    x = _hf_video(proc, text, [], clips["a"])
    item = vlm.prepare_videos([clips["a"]])[0]
    fam = vlm.family
    ids = vlm.tokenizer.encode_prompt(text, [item.num_tokens], [fam.image_prompt(item)], [fam.token_id_of(item)])
    assert fam.glm46v and ids == x["input_ids"][0].tolist() and "seconds" in fam.image_prompt(item)
