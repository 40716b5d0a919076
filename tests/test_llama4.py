"""Llama 4 (Llama4ForConditionalGeneration) parity with transformers on tiny random checkpoints
(float32, tests/tiny_llama4.py: "qk" QK-norm, chunk 6, a NoPE layer with temperature tuning, all
layers MoE top-1; "plain" no QK-norm, chunk 16, [RoPE, NoPE, RoPE], one MoE layer top-2, llama3
RoPE), through transformers' Llama4Processor (its image processor under tiny_llama4's torchvision
stand-in): pixels, tile grids, token counts and prompt ids exact; features of differently tiled
images in one encode call and whole-prompt logits (prompts crossing several attention-chunk
boundaries) rel <= 1e-4; 32 greedy tokens identical with logprobs within 1e-4; the engine
invariants, the server through the openai client and TP 2 == one device (tests/conformance.py).
"""
import numpy as np
import pytest
import torch

import mmjax
from conftest import noise_image, rel_err
from conformance import chat_request, engine_invariants, served_through_openai, tensor_parallel_matches
from mmjax.errors import CheckpointError, ContextLengthError
from mmjax.models.llama4 import Llama4Family
from mmjax.models.nn.kv_cache import first_visible, visible_keys
from mmjax.models.nn.metadata import MaskSpec
from tiny_llama4 import hf_processor, torchvision_stand_in

GREEDY = dict(temperature=0.0, ignore_eos=True)
# pages of 16: the tiny prompts' prefix hits are whole pages (of the default 64, often none)
ENGINE = dict(max_num_seqs=2, max_model_len=256, prefill_chunk=16, page_size=16)
SIZES = [(70, 41), (33, 120), (20, 20), (300, 20)]     # (width, height): 2x2 / 4x1 / one tile / 1xN grids
_VLMS: dict = {}


def vlm_for(path) -> "mmjax.VLM":
    if str(path) not in _VLMS:
        _VLMS[str(path)] = mmjax.load(path, **ENGINE)
    return _VLMS[str(path)]


@pytest.fixture(scope="module", params=["qk", "plain"])
def pair(request, llama4_dirs):
    from transformers import Llama4ForConditionalGeneration
    path = llama4_dirs[request.param]
    hf = Llama4ForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    with torchvision_stand_in():
        proc = hf_processor(path)
    return request.param, path, hf, proc, vlm_for(path)


def hf_inputs(proc, text, images):
    """The processor's inputs for an already rendered prompt (its BOS from the template)."""
    with torchvision_stand_in():
        x = proc(text=text, images=images or None, add_special_tokens=False, return_tensors="pt")
    if "pixel_values" in x:
        x["pixel_values"] = x["pixel_values"].float()     # bfloat16 values, float32 model
    return x


def chat(vlm, images, text):
    content = [{"type": "image", "image": im} for im in images] + [{"type": "text", "text": text}]
    return vlm.render_chat([{"role": "user", "content": content}])[0]


def test_chunk_mask_is_not_a_window():
    """MaskSpec.chunk: a query sees its own chunk's earlier keys only (the first of a chunk itself
    alone), unlike a sliding window of the same size."""
    q = np.array([[0, 7, 8, 9, 15, 16]])
    lo = np.asarray(first_visible(q, MaskSpec(chunk=8)))
    assert lo.tolist() == [[0, 0, 8, 8, 8, 16]]
    assert np.asarray(first_visible(q, MaskSpec(sliding_window=8))).tolist() == [[-7, 0, 1, 2, 8, 9]]
    vis = np.asarray(visible_keys(np.arange(20), q, MaskSpec(chunk=8), q[:, 0]))[0]
    assert [np.flatnonzero(r).tolist() for r in vis[[2, 4]]] == [[8], list(range(8, 16))]


def test_pixels_tokens_and_prompt_ids(pair):
    """Pixels (bit for bit, bfloat16 normalisation included), tile grids, token counts and chat
    prompt ids equal the processor's; `max_tiles` (detail / budget) caps the canvas."""
    name, _, _, proc, vlm = pair
    fam = vlm.family
    assert type(fam) is Llama4Family
    per_tile = fam.tokens_per_tile
    for seed, (w, h) in enumerate(SIZES):
        img = noise_image(seed, w, h)
        with torchvision_stand_in():
            x = proc.image_processor(img, return_tensors="pt")
        im = fam.prepare_image(img)
        assert np.array_equal(im.pixels, x["pixel_values"].float().numpy().transpose(0, 2, 3, 1))
        assert [im.rows, im.cols] == x["aspect_ratios"][0].tolist()
        assert im.num_tokens == len(im.pixels) * per_tile
    grids = {(im.rows, im.cols) for im in (fam.prepare_image(noise_image(0, w, h)) for w, h in SIZES)}
    assert (1, 1) in grids and len(grids) == 4
    # chat prompt ids with two images (a tiled one and a one-tile one) == the processor's
    images = [noise_image(5, *SIZES[0]), noise_image(6, *SIZES[2])]
    prompt = chat(vlm, images, "which one is red?")
    x = hf_inputs(proc, str(prompt), images)
    req = vlm.generate([{"prompt": prompt, "images": images}], mmjax.SamplingParams(max_tokens=1, **GREEDY))[0]
    assert req.prompt_token_ids == x["input_ids"][0].tolist()
    assert (x["input_ids"][0] == fam.image_token_id).sum() == req.num_image_tokens
    text = proc.tokenizer.decode(req.prompt_token_ids)
    tiled = fam.prepare_image(images[0])
    assert tiled.rows * tiled.cols > 1
    assert text.count("<|tile_x_separator|>") == tiled.rows * (tiled.cols - 1)
    assert text.count("<|tile_y_separator|>") == tiled.rows
    assert text.count("<|image_start|>") == text.count("<|image|>") == 2
    # detail / budget knobs: max_tiles lowers the processor's max_patches (0 and 1: one tile)
    big = noise_image(7, 300, 200)
    full = fam.prepare_image(big)
    one = vlm.prepare_images([big], {"max_tiles": 0})[0]
    two = vlm.prepare_images([big], {"max_tiles": 2})[0]
    assert len(one.pixels) == 1 and one.num_tokens == per_tile
    assert two.rows * two.cols == 2 and len(two.pixels) == 3 < len(full.pixels)
    assert fam.fit_options(3 * per_tile).max_tiles == 2 and fam.fit_options(per_tile).max_tiles == 1
    with torchvision_stand_in():
        y = proc.image_processor(big, max_patches=2, return_tensors="pt")
    assert np.array_equal(two.pixels, y["pixel_values"].float().numpy().transpose(0, 2, 3, 1))
    with pytest.raises(ContextLengthError):
        vlm.prepare_images([big], {"image_max_tokens": 2 * per_tile})


def test_checkpoint_errors(llama4_dirs, tmp_path):
    """A processor whose tiles differ from the vision tower's image size, or whose patch size gives
    another token count per tile, is refused at load with the field named."""
    import json
    import shutil
    for field, change in (("size", lambda c: c["image_processor"].update(size={"height": 14, "width": 14})),
                          ("patch_size", lambda c: c.update(patch_size=4))):
        bad = shutil.copytree(llama4_dirs["qk"], tmp_path / field)
        cfg = json.loads((bad / "processor_config.json").read_text())
        change(cfg)
        (bad / "processor_config.json").write_text(json.dumps(cfg))
        with pytest.raises(CheckpointError) as e:
            mmjax.load(bad)
        assert e.value.param == field


def test_pixel_views_undo_the_tiling(pair):
    """Saliency maps on the image's own pixels: the canvas tiles and the global tile lie where
    `Family.pixel_views` says (a marker's change lands on it: tests/marker_check.py)."""
    from marker_check import assert_family_views_find_markers
    assert assert_family_views_find_markers(pair[-1], ({}, {"max_tiles": 0})) >= 6


def test_features_logits_greedy_and_logprobs(pair):
    """Two differently tiled images in one encode call (features), whole-prompt logits over a
    prompt crossing several attention chunks, the image reaching the logits, 32 greedy tokens
    (decode crossing chunk boundaries too) and their logprobs."""
    name, _, hf, proc, vlm = pair
    images = [noise_image(11, 110, 50), noise_image(12, 45, 80)]
    prompt = chat(vlm, images, "what is different between the two pictures? answer in a few words")
    x = hf_inputs(proc, str(prompt), images)
    ims = vlm.prepare_images(images)
    assert (ims[0].rows, ims[0].cols) != (ims[1].rows, ims[1].cols)
    with torch.no_grad():
        theirs = hf.get_image_features(pixel_values=x["pixel_values"]).pooler_output
        hf_logits = hf(**x).logits[0].numpy()
    ours = np.concatenate(vlm.engine.runner.encode_images(ims))
    feat_err = rel_err(ours, theirs.reshape(-1, theirs.shape[-1]).numpy())
    assert feat_err <= 1e-4
    chunk = vlm.family.cfg.text.attention_chunk_size
    assert hf_logits.shape[0] > 3 * chunk
    logits = vlm.logits(prompt, images)
    other = vlm.logits(prompt, [noise_image(21, 110, 50), noise_image(22, 45, 80)])     # same sizes
    logit_err = rel_err(logits, hf_logits)
    assert logits.shape == hf_logits.shape and logit_err <= 1e-4
    assert rel_err(other, logits) > 1e-3
    with torch.no_grad():
        g = hf.generate(**x, max_new_tokens=32, do_sample=False, eos_token_id=None, output_logits=True,
                        return_dict_in_generate=True, pad_token_id=3)
    want = g.sequences[0, x["input_ids"].shape[1]:].tolist()
    out = vlm.generate([{"prompt": prompt, "images": images}], mmjax.SamplingParams(max_tokens=32, logprobs=2,
                                                                                    **GREEDY))[0]
    assert len(want) == 32 and len(set(want)) > 4 and out.token_ids == want
    hf_lp = [torch.log_softmax(l[0].double(), -1).numpy() for l in g.logits]
    lp_err = max(abs(v - hf_lp[s][t]) for s, lp in enumerate(out.logprobs) for t, v in lp.items())
    assert lp_err <= 1e-4
    print(f"\nllama4 {name}: features rel {feat_err:.1e}, logits rel {logit_err:.1e}, logprobs {lp_err:.1e}")


def test_engine_server_and_tensor_parallel(llama4_dirs):
    """tests/conformance.py on the "qk" checkpoint: batched == alone == caches off with prompts
    chunked across their images, the prefix-cache resume, the image mattering; the openai
    client's answer == the offline chat; TP 2 == one device."""
    path = llama4_dirs["qk"]
    vlm = vlm_for(path)
    reqs = [chat_request(vlm, [noise_image(31, 70, 41)], "what is this?"),
            chat_request(vlm, [noise_image(32, 33, 60), noise_image(33, 40, 40)], "compare them"),
            chat_request(vlm, [], "just some text here")]
    engine_invariants(vlm, reqs)
    import io
    buf = io.BytesIO()
    noise_image(34, 60, 50).save(buf, format="PNG")
    served_through_openai(vlm, buf.getvalue(), "what is it?")
    tensor_parallel_matches(path)
