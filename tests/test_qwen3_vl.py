"""Qwen3-VL (dense) and Qwen3-VL-MoE parity with transformers on tiny random checkpoints (float32),
against the real Qwen3VLProcessor (tiny_qwen3.hf_processor).

Checked: pixel patches (max abs <= 1e-5; measured 0), grids, token counts and prompt ids exact;
image features and every DeepStack feature block rel <= 1e-4 (measured ~1e-6; one packed call of
three non-square images; packed == one at a time); interleaved M-RoPE cos/sin (rel <= 1e-6) and
prompt positions exact; logits of a two-image prompt rel <= 1e-4 (measured <= 2.2e-6; whole
prompt at once: the MoE layers take the grouped ragged_dot path) and every layer's hidden state
as HF numbers them; 32 greedy tokens identical and logprobs within 1e-4 (measured <= 1.7e-6) for
a one-image and a two-image prompt through the engine with 16-token prefill chunks (every
prompt has an image across a chunk edge; the MoE chunk and decode steps take the
skip-idle-experts path); batched == one at a time == caches off, with repeated requests resumed
from the prefix cache and a third request resuming its text prefix, then prefilling both images
from encoder-cached features. Also: the MoE layer with a shared expert against transformers'
Qwen2MoeSparseMoeBlock, and the text models' tensor-parallel layout.

Video, against the real Qwen3VLVideoProcessor + Qwen3VLProcessor (transformers' own code with
the torchvision calls stood in for, tiny_qwen3.torchvision_stand_in): sampled frames, pixel
patches (measured 0 difference) and grids, token counts and prompt ids with the "<t seconds>"
timestamp text exact (two files, frames without and with a rate; the MoE checkpoint caps pixels
per frame); M-RoPE positions exact (each temporal patch placed like an image); video features
and every DeepStack block rel <= 1e-4 (measured <= 1.2e-6); logits of a video prompt and an
image + video prompt rel <= 1e-4 (measured <= 2.4e-6); 32 greedy tokens identical and logprobs
within 1e-4 (measured <= 1.9e-6), batched == one at a time; a `video_url` chat through the
openai client with usage video_tokens. A video takes the image encode buckets (no new compiled
step, so test_cuda_lowering.py already covers it).
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

import mmjax
from conftest import noise_image, page_floor, rel_err
from mmjax.errors import CheckpointError, PromptError, UnsupportedModelError, VideoError
from mmjax.models import qwen3_vl as Q3
from mmjax.models.family import image_runs
from mmjax.models.nn import Capture
from mmjax.models.nn.rope import rope_cos_sin, rope_inv_freq
from mmjax.serving.caches import EncoderCache
from mmjax.video.processors import Qwen3VLVideoPolicy
from tiny_qwen3 import hf_processor, torchvision_stand_in
from tiny_video import write_video

KINDS = ("dense", "moe")
ONE = ("<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>Describe this image.<|im_end|>\n"
       "<|im_start|>assistant\n")
TWO = ("<|im_start|>user\nPicture 1: <|vision_start|><|image_pad|><|vision_end|>Picture 2: "
       "<|vision_start|><|image_pad|><|vision_end|>Compare the two images.<|im_end|>\n<|im_start|>assistant\n")
SIZES = [(150, 110), (90, 200), (230, 75)]   # (width, height), non-square
CHUNK = 16
# pages of 16: the tiny prompts' prefix hits are whole pages (of the default 64, often none)
ENGINE = dict(max_num_seqs=2, max_model_len=512, prefill_chunk=CHUNK, page_size=16)


@pytest.fixture(scope="module", params=KINDS)
def pair(request, qwen3_dirs):
    from transformers import AutoModelForImageTextToText
    path = qwen3_dirs[request.param]
    hf = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    return request.param, hf, hf_processor(path), mmjax.load(path, **ENGINE)



def _assert_greedy_matches_hf(hf, x, o) -> None:
    """o (an mmjax output with logprobs) == transformers' greedy 32 tokens on inputs x; logprobs
    within 1e-4; the continuation is not degenerate (more than 2 distinct tokens)."""
    import torch
    with torch.no_grad():
        g = hf.generate(**x, max_new_tokens=32, do_sample=False, eos_token_id=None, output_logits=True,
                        return_dict_in_generate=True, pad_token_id=hf.config.text_config.pad_token_id)
    expected = g.sequences[0, x["input_ids"].shape[1]:].tolist()
    assert len(set(expected)) > 2 and o.token_ids == expected
    for ours, ref in zip(o.logprobs, g.logits):
        ref = torch.log_softmax(ref[0].double(), -1).numpy()
        assert all(abs(v - ref[i]) <= 1e-4 for i, v in ours.items())

def test_config_rope_and_errors(pair):
    kind, hf, _, vlm = pair
    assert type(hf).__name__ == {"dense": "Qwen3VLForConditionalGeneration",
                                 "moe": "Qwen3VLMoeForConditionalGeneration"}[kind]
    fam = vlm.family
    assert fam.name == hf.config.model_type and fam.image_token_id == hf.config.image_token_id
    text = fam.cfg.text
    n_deep = len(hf.config.vision_config.deepstack_visual_indexes)
    assert text.qk_norm and text.rope.mrope_interleaved and text.image_feature_layers == n_deep
    assert vlm.engine.runner.feature_width == 64 * (1 + n_deep)
    assert not vlm.model.language_model.supports_prune
    if kind == "moe":
        assert text.moe.layers == (0, 2) and text.moe.top_k == 2 and text.tie_word_embeddings
    else:
        assert text.moe is None and not text.tie_word_embeddings
    # interleaved M-RoPE cos/sin == transformers' Qwen3VL text rotary for random 3-row positions
    pos = torch.randint(0, 300, (3, 2, 7))
    cos, sin = hf.model.language_model.rotary_emb(torch.zeros(1, dtype=torch.float32), pos)
    ours = rope_cos_sin(rope_inv_freq(text.rope, text.head_dim), pos.numpy(), text.rope.mrope_section, True)
    assert rel_err(ours[0], cos.numpy()) <= 1e-6 and rel_err(ours[1], sin.numpy()) <= 1e-6
    # config errors name the field
    cfg = hf.config.to_dict()
    cfg["text_config"]["rope_parameters"]["mrope_section"] = [4, 3, 3]
    with pytest.raises(CheckpointError) as e:
        Q3.Qwen3VLConfig.from_hf(cfg)
    assert "mrope_section" in e.value.param


def test_pixels_features_and_deepstack(pair):
    _, hf, proc, vlm = pair
    imgs = [noise_image(10 + i, w, h) for i, (w, h) in enumerate(SIZES)]
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
    d = 64
    for i, (p, a) in enumerate(zip(packed, alone)):
        theirs = [out.pooler_output[i]] + [f[i] for f in out.deepstack_features]
        assert p.shape == (inputs[i].num_tokens, d * len(theirs))
        for k, t in enumerate(theirs):
            assert rel_err(p[:, k * d:(k + 1) * d], t.numpy()) <= 1e-4
        assert np.abs(p - a).max() <= 1e-5 * max(np.abs(a).max(), 1.0)
    # vlm.encode: [n_image_tokens, lm_hidden] per image (the embeddings), DeepStack apart
    plain, enc = vlm.encode(imgs), vlm.encode(imgs, with_deepstack=True)
    for i, (f, e) in enumerate(zip(plain, enc)):
        assert f.shape == e.features.shape == (inputs[i].num_tokens, d)
        assert rel_err(f, out.pooler_output[i].numpy()) <= 1e-4
        assert e.deepstack.shape == (len(out.deepstack_features), inputs[i].num_tokens, d)
        for k, t in enumerate(out.deepstack_features):
            assert rel_err(e.deepstack[k], t[i].numpy()) <= 1e-4


def test_positions_and_logits_two_images(pair):
    _, hf, proc, vlm = pair
    imgs = [noise_image(30, *SIZES[0]), noise_image(31, *SIZES[2])]
    x = proc(text=[TWO], images=imgs, return_tensors="pt")
    inputs = vlm.prepare_images(imgs)
    counts = [im.num_tokens for im in inputs]
    ids = np.asarray(vlm.tokenizer.encode_prompt(TWO, counts), np.int32)
    assert ids.tolist() == x["input_ids"][0].tolist()
    ours, delta = vlm.family.positions(ids, inputs, vlm.family.image_starts(ids, counts))
    theirs, hf_delta = hf.model.get_rope_index(x["input_ids"], x["mm_token_type_ids"], x["image_grid_thw"])
    np.testing.assert_array_equal(ours, theirs[:, 0].numpy())
    assert delta == int(hf_delta[0, 0]) < 0
    with torch.no_grad():
        out = hf(**x, output_hidden_states=True)
    ref = out.logits[0].numpy()
    got, inter = vlm.logits(TWO, imgs, capture=Capture(hidden=True))
    assert got.shape == ref.shape and rel_err(got, ref) <= 1e-4
    other = vlm.logits(TWO, [noise_image(32, *SIZES[0]), noise_image(33, *SIZES[2])])   # same sizes
    assert rel_err(other, got) > 1e-3                          # the images reach the logits
    # per-layer hidden states as HF numbers them (a layer's output before its DeepStack addition)
    assert len(inter["hidden"]) == len(out.hidden_states)
    for ours, theirs in zip(inter["hidden"], out.hidden_states):
        assert rel_err(ours[0], theirs[0].numpy()) <= 1e-4


@pytest.mark.slow   # ~10-30 s per config with cold compiles
def test_generation_chunks_batching_and_caches(pair):
    """32 greedy tokens == transformers (logprobs within 1e-4) for a one-image and a two-image
    prompt; batched == one at a time == caches off; images straddle the 16-token chunk edges; a
    repeated request resumes from the prefix cache, and a third request reuses both its images'
    features (DeepStack blocks included) from the encoder cache."""
    _, hf, proc, vlm = pair
    a, b = noise_image(40, 260, 190), noise_image(41, *SIZES[2])   # 48 and 14 image tokens
    reqs = [{"prompt": ONE, "images": [a]}, {"prompt": TWO, "images": [b, a]}, {"prompt": TWO, "images": [a, b]}]
    sp = mmjax.SamplingParams(max_tokens=32, temperature=0.0, logprobs=2, ignore_eos=True)
    engine = vlm.engine
    together = vlm.generate(reqs[:2], sp)
    hits = engine.stats()["encoder_cache_hits"]
    alone = [vlm.generate([r], sp)[0] for r in reqs]            # caches hot
    # the third request's images, and (paged: the repeats resume at a page boundary) each image of a
    # repeat that ends past its cached pages
    def past_cache(o):
        runs = image_runs(np.asarray(o.prompt_token_ids), vlm.family.image_token_id)
        return int((runs[:, 1] > page_floor(vlm, len(o.prompt_token_ids) - 1)).sum())
    assert engine.stats()["encoder_cache_hits"] - hits == 2 + past_cache(alone[0]) + past_cache(alone[1])
    # the repeats resume from the prefix cache; the third request resumes its shared text prefix
    # (up to its first image), then prefills its images from encoder-cached features
    assert [o.cached_tokens == page_floor(vlm, len(o.prompt_token_ids) - 1) > 0 for o in alone] == [True, True, False]
    # (whole pages of it: none when the text before the first image is shorter than a page)
    first_image = image_runs(np.asarray(alone[2].prompt_token_ids), vlm.family.image_token_id)[0, 0]
    assert alone[2].cached_tokens == page_floor(vlm, first_image), alone[2].cached_tokens
    saved = engine.encoder_cache, engine.prefix_cache.enabled
    try:                                                         # both caches off
        engine.encoder_cache, engine.prefix_cache.enabled = EncoderCache(0), False
        engine.prefix_cache.clear()
        if engine.pages is not None:                             # a paged engine's page sharing
            engine.pages.pool.enable_cache = False
        cold = [vlm.generate([r], sp)[0] for r in reqs]
        assert engine.stats()["encoder_cache_hits"] == 0 and all(o.cached_tokens == 0 for o in cold)
    finally:
        engine.encoder_cache, engine.prefix_cache.enabled = saved
        if engine.pages is not None:
            engine.pages.pool.enable_cache = True
    assert [o.token_ids for o in together] == [o.token_ids for o in alone[:2]]
    assert [o.token_ids for o in alone] == [o.token_ids for o in cold]
    for x, y in zip(together + alone, alone[:2] + cold):
        np.testing.assert_allclose([x.logprobs[i][t] for i, t in enumerate(x.token_ids)],
                                   [y.logprobs[i][t] for i, t in enumerate(y.token_ids)], atol=1e-5)
    runs = [image_runs(np.asarray(o.prompt_token_ids), vlm.family.image_token_id) for o in together]
    assert all(any(s < k < e for s, e in rs for k in range(CHUNK, 512, CHUNK)) for rs in runs), runs
    for r, o in zip(reqs[:2], together):
        x = proc(text=[r["prompt"]], images=r["images"], return_tensors="pt")
        assert x["input_ids"][0].tolist() == list(o.prompt_token_ids)
        _assert_greedy_matches_hf(hf, x, o)


def test_moe_block_with_shared_expert_matches_transformers(tmp_path):
    """The sparse-MoE layer as a unit against transformers' Qwen2MoeSparseMoeBlock: softmax top-k
    router without renormalisation (norm_topk_prob False) plus the sigmoid-gated shared expert,
    weights read from a file in transformers 5's layout; grouped (ragged_dot) and skip-idle-experts
    paths."""
    from safetensors.torch import save_file
    from transformers import Qwen2MoeConfig
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock
    from mmjax.checkpoint import TensorSource
    from mmjax.models.nn.moe import MoeConfig, SparseMoeBlock
    from mmjax.models.nn.weights import Weights, build

    cfg = Qwen2MoeConfig(hidden_size=32, num_experts=6, num_experts_per_tok=2, moe_intermediate_size=24,
                         shared_expert_intermediate_size=40, norm_topk_prob=False, num_hidden_layers=1)
    torch.manual_seed(0)
    block = Qwen2MoeSparseMoeBlock(cfg).eval()
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.2)
    save_file({f"mlp.{k}": v.contiguous() for k, v in block.state_dict().items()}, tmp_path / "model.safetensors")
    moe = MoeConfig.from_hf(cfg.to_dict(), "text_config", 1)
    assert moe.shared_intermediate_size == 40 and not moe.norm_topk_prob and moe.layers == (0,)
    ours = build(lambda: SparseMoeBlock(32, moe))
    w = Weights(TensorSource(tmp_path))
    ours.hf_weights(w, "mlp")
    w.finish(ours)                                  # every tensor used, every weight filled
    graphdef, state = nnx.split(ours)
    fn = jax.jit(lambda state, x: nnx.merge(graphdef, state)(x))
    for shape in ((1, 40, 32), (3, 1, 32)):        # 80 assignments: ragged_dot; 6: skip idle experts
        x = torch.randn(shape)
        with torch.no_grad():
            ref = block(x).numpy()
        assert rel_err(fn(state, x.numpy()), ref) <= 1e-5


def test_tensor_parallel_layout_keeps_the_math(qwen3_dirs):
    """The Qwen3 text models (QK-norm, interleaved M-RoPE, DeepStack additions; MoE layers
    replicated) in their tensor_parallel(2) layout (tp_layout), run on one device: the one-device
    logits. (KV-head replication for tp > KV heads is llama.py's, tests/test_sharding.py.)"""
    from mmjax.api import load_model
    from mmjax.models.nn.metadata import AttentionMetadata
    from mmjax.serving.placed_model import tp_layout

    rng = np.random.default_rng(0)
    ids = jnp.asarray(rng.integers(5, 300, (2, 14)), jnp.int32)
    pos = jnp.asarray(rng.integers(0, 40, (3, 2, 14)), jnp.int32)
    meta = AttentionMetadata(positions=pos, starts=jnp.zeros(2, jnp.int32), kv_len=14)
    for kind, path in qwen3_dirs.items():
        lm = load_model(path, on_device=False).module.language_model    # host [in, out] weights
        adds = jnp.asarray(rng.standard_normal((2, 14, lm.image_feature_layers, 64)), jnp.float32)

        def run(lm, tp):
            graphdef, state = nnx.split(lm)

            def fn(state):
                m = nnx.merge(graphdef, state)
                hidden, _ = m(m.embed(ids), meta, m.init_cache(2, 32, jnp.float32, tp=tp), deepstack=adds)
                return m.logits(hidden)
            return np.asarray(jax.jit(fn)(state))
        tp_lm = nnx.clone(lm)
        tp_layout(tp_lm, 2)
        assert tp_lm.layers[0].self_attn.qkv_proj.kernel.get_value().ndim == 3      # [in, tp, per shard]
        np.testing.assert_allclose(run(tp_lm, 2), run(lm, 1), rtol=1e-5, atol=1e-5, err_msg=kind)


# ------------------------------------------------------------------------------------------------
# Video (Qwen3VLVideoProcessor + Qwen3VLProcessor's timestamps, run as transformers' own code in
# tiny_qwen3.torchvision_stand_in)
# ------------------------------------------------------------------------------------------------

VIDEO = ("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n"
         "<|vision_start|><|video_pad|><|vision_end|>What is in the picture ?<|im_end|>\n<|im_start|>assistant\n")
MIXED = ("<|im_start|>user\nPicture 1: <|vision_start|><|image_pad|><|vision_end|>Video 1: "
         "<|vision_start|><|video_pad|><|vision_end|>Compare the two .<|im_end|>\n<|im_start|>assistant\n")


@pytest.fixture(scope="module")
def clips(tmp_path_factory):
    """a: 24 frames at 8 fps, 112x64 (6 sampled: 0, 5, 9, 14, 18, 23); a2: a with other shapes'
    phases (same size, frames, timestamps); b: 15 frames at 6 fps, 80x48 (5 sampled: an odd
    count, the last frame repeated into the third temporal patch; dense: resized up to the size
    range's floor)."""
    d = tmp_path_factory.mktemp("qwen3_videos")
    return {"a": write_video(d / "a.mp4", 24, 8, 112, 64, seed=0), "a2": write_video(d / "a2.mp4", 24, 8, 112, 64, seed=5),
            "b": write_video(d / "b.mp4", 15, 6, 80, 48, seed=1)}


def _hf_video_inputs(proc, text: str, images: list, video) -> dict:
    """Qwen3VLProcessor(text, images, videos) for one video: a path, frames [T, H, W, 3] (no
    rate: HF assumes 24 fps) or {"frames": [...], "fps": x} (passed as video_metadata)."""
    meta = None
    if isinstance(video, dict):
        video, meta = np.stack(video["frames"]), [{"fps": video["fps"], "total_num_frames": len(video["frames"])}]
    with torchvision_stand_in():
        return proc(text=[text], images=images or None, videos=[video], video_metadata=meta, return_tensors="pt")


def _video_ids(vlm, text: str, items: list) -> np.ndarray:
    fam = vlm.family
    return np.asarray(vlm.tokenizer.encode_prompt(text, [im.num_tokens for im in items],
                                                  [fam.image_prompt(im) for im in items],
                                                  [fam.token_id_of(im) for im in items]), np.int32)


def test_video_pixels_prompt_positions_features_and_logits(pair, clips):
    """Against the real Qwen3VLVideoProcessor + Qwen3VLProcessor: sampled frames, pixel patches,
    grids, token counts and the prompt ids with their "<t seconds>" text, for two files (the MoE
    checkpoint caps pixels per frame), four frames without a rate and eight with one; then for a
    video prompt and an image + video prompt the M-RoPE positions (each frame placed on its own),
    the video features with every DeepStack block, and the logits; another video of the same
    geometry changes the logits; the video takes an image encode bucket (no new compiled step)."""
    _, hf, proc, vlm = pair
    fam = vlm.family
    frames = np.stack([np.asarray(noise_image(70 + i, 200, 130)) for i in range(4)])
    for src in (clips["a"], clips["b"], frames, {"frames": list(frames[:3]) + [frames[3]] * 5, "fps": 3.0}):
        x = _hf_video_inputs(proc, VIDEO, [], src)
        item = vlm.prepare_videos([src])[0]
        assert item.kind == "video" and item.grid == tuple(x["video_grid_thw"][0].tolist())
        assert item.num_tokens == int(x["video_grid_thw"][0].prod()) // 4
        assert np.abs(item.pixels - x["pixel_values_videos"].numpy()).max() <= 1e-5
        assert _video_ids(vlm, VIDEO, [item]).tolist() == x["input_ids"][0].tolist()
    assert vlm.prepare_videos([clips["a"]])[0].video.indices == (0, 5, 9, 14, 18, 23)
    # the same frames at another rate: same frames sampled, other timestamps (not a video-cache hit)
    eight = list(frames[:3]) + [frames[3]] * 5
    at3, at32 = (vlm.prepare_videos([{"frames": eight, "fps": r}])[0] for r in (3.0, 3.2))
    assert at3.video.indices == at32.video.indices and at3.video.timestamps != at32.video.timestamps
    with pytest.raises(VideoError, match="at least 2 sampled frames"):   # HF's smart_resize refuses it too
        vlm.prepare_videos([[frames[0]]])
    with pytest.raises(UnsupportedModelError, match="mutually exclusive"):
        Qwen3VLVideoPolicy.from_config({"fps": 2, "num_frames": 8})
    with pytest.raises(PromptError, match="1 video"):   # a video where the prompt has an image placeholder
        _video_ids(vlm, VIDEO.replace("video_pad", "image_pad"), vlm.prepare_videos([clips["b"]]))
    assert "<2.6 seconds><|vision_start|><|video_pad|>" in fam.image_prompt(vlm.prepare_videos([clips["a"]])[0])
    # the processor replaces the whole <|vision_start|><|video_pad|><|vision_end|> of a raw or a
    # chat-rendered prompt by the per-frame blocks (no outer vision_start / vision_end), and a
    # bare <|video_pad|> by the same blocks
    item = vlm.prepare_videos([clips["b"]])[0]
    bare = VIDEO.replace("<|vision_start|><|video_pad|><|vision_end|>", "<|video_pad|>")
    msgs = [{"role": "user", "content": [{"type": "video", "video": clips["b"]},
                                         {"type": "text", "text": "What is in the picture ?"}]}]
    chat = vlm.render_chat(msgs)[0]
    hf_chat = proc.tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert str(chat) == hf_chat
    for ours_text, theirs_text in ((VIDEO, VIDEO), (bare, bare), (chat, hf_chat)):
        x = _hf_video_inputs(proc, theirs_text, [], clips["b"])
        assert _video_ids(vlm, ours_text, [item]).tolist() == x["input_ids"][0].tolist()
    expanded = vlm.tokenizer.decode(_video_ids(vlm, VIDEO, [item]), skip_special_tokens=False)
    assert expanded.count("<|vision_start|>") == expanded.count("<|vision_end|>") == item.grid[0]
    for text, images, src in ((VIDEO, [], clips["a"]), (MIXED, [noise_image(5, 150, 100)], clips["b"])):
        x = _hf_video_inputs(proc, text, images, src)
        items = vlm.prepare_images(images) + vlm.prepare_videos([src])
        ids = _video_ids(vlm, text, items)
        assert ids.tolist() == x["input_ids"][0].tolist()
        ours, delta = fam.positions(ids, items, fam.image_starts(ids, [im.num_tokens for im in items]))
        theirs, hf_delta = hf.model.get_rope_index(x["input_ids"], x["mm_token_type_ids"], x.get("image_grid_thw"),
                                                   x["video_grid_thw"])
        np.testing.assert_array_equal(ours, theirs[:, 0].numpy())
        assert delta == int(hf_delta[0, 0])
        with torch.no_grad():
            out = hf.model.get_video_features(x["pixel_values_videos"], x["video_grid_thw"])
            ref = hf(**x).logits[0].numpy()
        feats = vlm.engine.runner.encode_images([items[-1]])[0]
        blocks = [out.pooler_output[0]] + [f[0] for f in out.deepstack_features]
        assert feats.shape == (items[-1].num_tokens, 64 * len(blocks))
        for k, t in enumerate(blocks):
            assert rel_err(feats[:, k * 64:(k + 1) * 64], t.numpy()) <= 1e-4
        got = vlm.logits(text, items)
        assert got.shape == ref.shape and rel_err(got, ref) <= 1e-4
        calls = fam.encode_plan(items, 8)
        assert len(calls) == 1 and calls[0].bucket in {c.bucket for c in fam.warmup_plan(8)}
    other = vlm.prepare_videos([clips["a2"]])
    first = vlm.prepare_videos([clips["a"]])
    assert (other[0].grid, other[0].video.timestamps) == (first[0].grid, first[0].video.timestamps)
    assert rel_err(vlm.logits(VIDEO, other), vlm.logits(VIDEO, first)) > 1e-3


def test_video_generation_batched_and_served(pair, clips):
    """32 greedy tokens (logprobs within 1e-4) for a video prompt and an image + video prompt in
    one engine batch == transformers == one at a time (16-token prefill chunks cut through the
    frames and their timestamp text); then a `video_url` chat through the openai client,
    streamed == non-streamed == offline chat, usage counting the video tokens (timestamps are
    text)."""
    import base64

    from serve.app import ServerConfig
    from test_serve import Server

    _, hf, proc, vlm = pair
    img = noise_image(6, 150, 100)
    reqs = [{"prompt": VIDEO, "images": [], "videos": [clips["a"]]},
            {"prompt": MIXED, "images": [img], "videos": [clips["b"]]}]
    sp = mmjax.SamplingParams(max_tokens=32, temperature=0.0, logprobs=2, ignore_eos=True)
    together = vlm.generate(reqs, sp)
    alone = [vlm.generate([r], sp)[0] for r in reqs]
    assert [o.token_ids for o in alone] == [o.token_ids for o in together]
    for r, o in zip(reqs, together):
        x = _hf_video_inputs(proc, r["prompt"], r["images"], r["videos"][0])
        assert list(o.prompt_token_ids) == x["input_ids"][0].tolist()
        _assert_greedy_matches_hf(hf, x, o)
        assert o.num_video_tokens == int(x["video_grid_thw"][0].prod()) // 4
        assert o.num_image_tokens == sum(im.num_tokens for im in vlm.prepare_images(r["images"]))

    uri = "data:video/mp4;base64," + base64.b64encode(open(clips["a"], "rb").read()).decode()
    system = {"role": "system", "content": "You are a helpful assistant."}
    msgs = [system, {"role": "user", "content": [{"type": "video_url", "video_url": {"url": uri}},
                                                 {"type": "text", "text": "What is in the picture ?"}]}]
    off = vlm.chat([system, {"role": "user", "content": [{"type": "video", "video": clips["a"]},
                                                         {"type": "text", "text": "What is in the picture ?"}]}],
                   mmjax.SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    assert list(off.prompt_token_ids) == list(together[0].prompt_token_ids)   # the template writes VIDEO
    s = Server(vlm, ServerConfig(served_model_name="qwen3", log_stats_interval=0))
    try:
        c = s.client()
        kw = dict(model="qwen3", messages=msgs, max_tokens=8, temperature=0, extra_body={"ignore_eos": True})
        r = c.chat.completions.create(**kw)
        chunks = list(c.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    finally:
        s.close()
    assert r.choices[0].message.content == off.text
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == off.text
    for u in (r.usage, chunks[-1].usage):
        assert u.prompt_tokens == len(off.prompt_token_ids)
        assert u.prompt_tokens_details.video_tokens == off.num_video_tokens == together[0].num_video_tokens
