"""WIP Llama 3.2 Vision (Mllama) parity on a tiny random checkpoint (float32, tests/tiny_mllama.py):
MllamaImageProcessor port (tiles, aspect-ratio ids, tile counts: exact), the vision tower
(rel <= 1e-4) and the decoder with gated cross-attention layers (whole-prompt logits rel <=
1e-4 for one image, two images with the processor's span mask, and text only). The engine
integration (per-slot cross-attention K/V cache, decode, prefix-cache image keys) is not built
yet, so these run the pure functions directly."""
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from conftest import noise_image, rel_err
from mmjax.checkpoint import TensorSource
from mmjax.image.mllama import MllamaImagePolicy
from mmjax.models.text.mllama import MllamaTextConfig, forward_full, load_text_params, span_key_mask
from mmjax.models.vision.mllama import MllamaVisionConfig, load_mllama_vision_params, mllama_vision


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from transformers import AutoTokenizer, MllamaForConditionalGeneration
    from transformers.models.mllama.image_processing_pil_mllama import MllamaImageProcessorPil
    from transformers.models.mllama.processing_mllama import MllamaProcessor
    from tiny_mllama import build_mllama
    path = build_mllama(tmp_path_factory.mktemp("mllama") / "tiles4")
    hf = MllamaForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    ip = MllamaImageProcessorPil.from_pretrained(path)
    proc = MllamaProcessor(image_processor=ip, tokenizer=AutoTokenizer.from_pretrained(path))
    hcfg = json.loads((path / "config.json").read_text())
    vcfg = MllamaVisionConfig.from_hf(hcfg["vision_config"])
    tcfg = MllamaTextConfig.from_hf(hcfg["text_config"])
    src = TensorSource(path)
    d = tcfg.base.hidden_size
    params = {"v": load_mllama_vision_params(src, vcfg), "t": load_text_params(src, tcfg),
              "p": {"w": src.take("multi_modal_projector.weight", (d, vcfg.output_dim)).T,
                    "b": src.take("multi_modal_projector.bias", (d,))}}
    src.check_all_used()
    policy = MllamaImagePolicy.from_config(json.loads((path / "preprocessor_config.json").read_text()))
    return hf, ip, proc, hcfg, vcfg, tcfg, jax.tree.map(jnp.asarray, params), policy


def test_pixels_and_vision_features(setup):
    hf, ip, _, _, vcfg, _, params, policy = setup
    for seed, (w, h) in enumerate([(70, 41), (33, 120), (20, 20), (300, 20)]):
        img = noise_image(seed, w, h)
        x = ip(img, return_tensors="np")
        tiles, ar, n = policy(img)
        assert (ar, n) == (int(x["aspect_ratio_ids"][0, 0]), int(x["num_tiles"][0][0]))
        assert np.abs(tiles - x["pixel_values"][0, 0].transpose(0, 2, 3, 1)).max() == 0
        with torch.no_grad():
            ref = hf.model.vision_model(pixel_values=torch.tensor(x["pixel_values"]),
                                        aspect_ratio_ids=torch.tensor(x["aspect_ratio_ids"]),
                                        aspect_ratio_mask=torch.tensor(x["aspect_ratio_mask"])).last_hidden_state[0]
        got = jax.jit(lambda *a: mllama_vision(params["v"], vcfg, *a))(tiles[None], np.asarray([ar]), np.asarray([n]))
        assert rel_err(np.asarray(got), ref.numpy()) <= 1e-4


@pytest.mark.parametrize("prompt,sizes", [("hello <|image|> what is this", [(70, 41)]),
                                          ("a b <|image|> first <|image|> second one", [(33, 120), (20, 20)]),
                                          ("just text here", [])])
def test_cross_attention_logits(setup, prompt, sizes):
    hf, _, proc, hcfg, vcfg, tcfg, params, policy = setup
    imgs = [noise_image(10 + i, w, h) for i, (w, h) in enumerate(sizes)]
    x = proc(text=prompt, images=[imgs] if imgs else None, return_tensors="pt")
    with torch.no_grad():
        ref = hf(**x).logits[0].numpy()
    ids = x["input_ids"][0].numpy()
    d, per_image = tcfg.base.hidden_size, vcfg.max_num_tiles * vcfg.num_patches
    if imgs:
        outs = [policy(im) for im in imgs]
        states = jax.jit(lambda *a: mllama_vision(params["v"], vcfg, *a))(
            np.stack([o[0] for o in outs]), np.asarray([o[1] for o in outs]), np.asarray([o[2] for o in outs]))
        vis = (states @ params["p"]["w"] + params["p"]["b"]).reshape(1, -1, d)
        mask = span_key_mask(ids.tolist(), hcfg["image_token_index"], [o[2] for o in outs], vcfg.max_num_tiles,
                             vcfg.num_patches)
        assert mask.shape == (len(ids), len(imgs) * per_image) and not mask[0].any()  # text before the image
    else:
        vis, mask = jnp.zeros((1, per_image, d)), np.zeros((len(ids), per_image), bool)
    got = jax.jit(lambda *a: forward_full(params["t"], tcfg, *a))(ids[None], vis, mask[None], np.asarray([bool(imgs)]))[0]
    assert got.shape == ref.shape
    assert rel_err(np.asarray(got), ref) <= 1e-4


def test_family_encode_plan_matches(setup):
    """The family's host preparation + encode plan (two images in one padded call) == the pure
    tower + projector per image."""
    from pathlib import Path
    import mmjax.models.mllama as M
    hf, ip, _, hcfg, vcfg, tcfg, params, policy = setup
    path = Path(hf.name_or_path)
    fam, np_params = M.load(path, hcfg)
    jp = jax.tree.map(jnp.asarray, np_params)
    imgs = [noise_image(30, 70, 41), noise_image(31, 20, 20), noise_image(32, 33, 120)]
    inputs = [fam.prepare_image(im) for im in imgs]
    [call] = fam.encode_plan(inputs, max_batch=4)
    assert call.bucket == (4,)
    feats = call.split(np.asarray(jax.jit(fam.encode)(jp, call.inputs)))
    for im, f in zip(imgs, feats):
        x = ip(im, return_tensors="pt")
        with torch.no_grad():
            ref = hf.model.multi_modal_projector(hf.model.vision_model(
                pixel_values=x["pixel_values"], aspect_ratio_ids=x["aspect_ratio_ids"],
                aspect_ratio_mask=x["aspect_ratio_mask"]).last_hidden_state)[0, 0].reshape(-1, tcfg.base.hidden_size)
        assert f.shape == tuple(ref.shape) and rel_err(f, ref.numpy()) <= 1e-4
