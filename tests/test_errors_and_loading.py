"""Bad inputs get clear typed errors; checkpoints with missing/unexpected/mis-shaped weights or an
unknown model_type are refused naming the tensor or field; orbax round trip; CLI."""
import io
import json
import shutil
import subprocess
import sys

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import mmjax
from conftest import noise_image, rel_err
from mmjax.errors import (CheckpointError, ContextLengthError, ImageError, ImageTooLargeError, InvalidRequestError,
                          PromptError, UnsupportedModelError)
from mmjax.image import ImageLimits

PROMPT = "USER: <image>\nWhat is this? ASSISTANT:"


@pytest.fixture(scope="module")
def vlm(llava_dirs):
    return mmjax.load(llava_dirs["gqa"], max_num_seqs=2, max_model_len=128,
                      image_limits=ImageLimits(max_bytes=200_000, max_pixels=1_000_000))


def png_bytes(img) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def test_corrupt_and_empty_images(vlm):
    good = png_bytes(noise_image(0, 20, 20))
    sp = mmjax.SamplingParams(max_tokens=2)
    for bad in (b"", b"not an image at all", good[:40]):
        with pytest.raises(ImageError) as e:
            vlm.generate([{"prompt": PROMPT, "images": [bad]}], sp)
        assert e.value.message and e.value.status == 400


def test_oversized_image_bytes_and_pixels(vlm):
    big = png_bytes(noise_image(1, 400, 400))  # ~480 kB of noise > 200 kB limit
    with pytest.raises(ImageTooLargeError) as e:
        vlm.prepare_images([big])
    assert e.value.status == 413
    from PIL import Image
    wide = Image.new("RGB", (2000, 600), (200, 10, 10))  # 1.2 MP > 1 MP, tiny as PNG
    with pytest.raises(ImageTooLargeError):
        vlm.prepare_images([png_bytes(wide)])


def test_zero_size_image(vlm):
    from PIL import Image
    with pytest.raises(ImageError):
        vlm.prepare_images([Image.new("RGB", (0, 0))])


def test_placeholder_count_mismatch(vlm):
    img = noise_image(2, 30, 30)
    sp = mmjax.SamplingParams(max_tokens=2)
    with pytest.raises(PromptError, match="1 image placeholder"):
        vlm.generate([{"prompt": PROMPT, "images": [img, img]}], sp)
    with pytest.raises(PromptError, match="0 image placeholder"):
        vlm.generate([{"prompt": "USER: hi ASSISTANT:", "images": [img]}], sp)


def test_placeholder_injection_in_chat_is_rejected(vlm):
    msgs = [{"role": "user", "content": "ignore this <image> and answer"}]
    with pytest.raises(PromptError, match="reserved image placeholder") as e:
        vlm.chat(msgs, mmjax.SamplingParams(max_tokens=2))
    assert e.value.param == "messages[0].content"
    msgs = [{"role": "user", "content": [{"type": "image", "image": noise_image(3, 20, 20)},
                                         {"type": "text", "text": "<image>"}]}]
    with pytest.raises(PromptError):
        vlm.chat(msgs, mmjax.SamplingParams(max_tokens=2))


def test_unknown_request_keys_are_named(vlm):
    """A typo in an offline request dict must not silently run the unmodified request: the key is
    named, and nothing of the batch runs (no request reaches the engine)."""
    img = noise_image(4, 30, 30)
    sp = mmjax.SamplingParams(max_tokens=2)
    before = vlm.engine.stats()["requests_finished"]
    with pytest.raises(InvalidRequestError, match="'image_token_keep'") as e:
        vlm.generate([{"prompt": PROMPT, "images": [img]},
                      {"prompt": PROMPT, "images": [img], "image_token_keep": 0.5}], sp)
    assert e.value.param == "image_token_keep" and e.value.status == 400
    assert vlm.engine.stats()["requests_finished"] == before and not vlm.engine.has_work()
    with pytest.raises(InvalidRequestError, match="no \"prompt\""):
        vlm.generate([{"images": [img]}], sp)
    with pytest.raises(InvalidRequestError, match="'image'") as e:
        vlm.embed([{"prompt": PROMPT, "image": [img]}])
    assert e.value.param == "image"
    with pytest.raises(InvalidRequestError, match="'rate'"):
        vlm.prepare_videos([{"frames": [np.zeros((8, 8, 3), np.uint8)] * 2, "rate": 4}])
    assert vlm.generate([{"prompt": PROMPT, "images": [img]}], sp)[0].finish_reason == "length"


def test_prompt_longer_than_context(vlm):
    with pytest.raises(ContextLengthError):
        vlm.generate("USER: " + "tell me " * 200 + "ASSISTANT:", mmjax.SamplingParams(max_tokens=2))


def test_bad_sampling_params():
    with pytest.raises(mmjax.InvalidRequestError) as e:
        mmjax.SamplingParams(top_p=0.0)
    assert e.value.param == "top_p"
    with pytest.raises(mmjax.InvalidRequestError):
        mmjax.SamplingParams(max_tokens=0)
    for field, value in (("top_k", 2**31), ("temperature", float("nan")), ("seed", 2**64), ("logprobs", 21),
                         ("stop_token_ids", [-1]), ("stop", [1])):
        with pytest.raises(mmjax.InvalidRequestError) as e:
            mmjax.SamplingParams(**{field: value})
        assert e.value.param == field


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_unknown_model_type(llava_dirs, tmp_path):
    d = _copy(llava_dirs["gqa"], tmp_path / "m")
    cfg = json.loads((d / "config.json").read_text())
    cfg["model_type"] = "mystery_vlm"
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedModelError, match="mystery_vlm"):
        mmjax.load(d)
    # a text model type no text model implements is named too
    cfg["model_type"] = "llava"
    cfg["text_config"]["model_type"] = "mystery_lm"
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedModelError, match="mystery_lm"):
        mmjax.load(d)


def test_registry_dispatch_by_architecture_then_model_type(llava_dirs):
    from mmjax.models import FAMILIES, family_module
    from mmjax.models import llava, qwen2_vl
    assert family_module({"model_type": "llava"}) is llava
    assert family_module({"model_type": "qwen2_5_vl"}) is qwen2_vl
    FAMILIES["MysteryForConditionalGeneration"] = "mmjax.models.qwen2_vl"
    try:
        assert family_module({"model_type": "llava", "architectures": ["MysteryForConditionalGeneration"]}) is qwen2_vl
    finally:
        del FAMILIES["MysteryForConditionalGeneration"]


def test_shipped_model_is_mmjax_shapes_everywhere():
    """mmjax.load() and mmjax.load("mmjax-shapes") load the shipped model under that name (also
    when given its directory); `mmjax serve` defaults to it and serves it under that name."""
    from mmjax.demo import default_model_path
    from serve.cli import build_parser, config_from_args

    a, b, c = mmjax.load(), mmjax.load("mmjax-shapes"), mmjax.load(default_model_path())
    assert a.name == b.name == c.name == "mmjax-shapes"
    assert a.loaded.path == b.loaded.path
    args = build_parser().parse_args([])
    assert args.model == "mmjax-shapes"
    assert config_from_args(args, args.model).served_model_name is None   # -> the model's name at create_app


def test_missing_unexpected_and_misshaped_weights(llava_dirs, tmp_path):
    src = llava_dirs["gqa"]
    tensors = load_file(src / "model.safetensors")
    name = "language_model.model.layers.1.mlp.up_proj.weight"

    d = _copy(src, tmp_path / "missing")
    save_file({k: v for k, v in tensors.items() if k != name}, d / "model.safetensors")
    with pytest.raises(CheckpointError, match=name.replace(".", r"\.")) as e:
        mmjax.load(d)
    assert e.value.param == name

    d = _copy(src, tmp_path / "extra")
    save_file({**tensors, "language_model.model.layers.1.mlp.extra.weight": np.ones((2, 2), np.float32)},
              d / "model.safetensors")
    with pytest.raises(CheckpointError, match="unexpected weights: language_model.model.layers.1.mlp.extra.weight"):
        mmjax.load(d)

    d = _copy(src, tmp_path / "shape")
    save_file({**tensors, name: tensors[name][:, :-1].copy()}, d / "model.safetensors")
    with pytest.raises(CheckpointError, match="has shape"):
        mmjax.load(d)


def test_sharded_checkpoint_loads(llava_dirs, tmp_path):
    src = llava_dirs["gqa"]
    tensors = load_file(src / "model.safetensors")
    d = _copy(src, tmp_path / "sharded")
    (d / "model.safetensors").unlink()
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for f, ns in shards.items():
        save_file({n: tensors[n] for n in ns}, d / f)
    (d / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {n: f for f, ns in shards.items() for n in ns}}))
    a = mmjax.load(src).logits("USER: hello ASSISTANT:")
    b = mmjax.load(d).logits("USER: hello ASSISTANT:")
    assert np.array_equal(a, b)


def test_orbax_round_trip_and_bfloat16(llava_dirs, tmp_path):
    vlm = mmjax.load(llava_dirs["mha"])
    out = vlm.save_params(tmp_path / "params")
    again = mmjax.load(llava_dirs["mha"], params_dir=out)
    img = noise_image(9, 40, 30)
    ref = vlm.logits("USER: <image>\nhi ASSISTANT:", [img])
    assert np.array_equal(again.logits("USER: <image>\nhi ASSISTANT:", [img]), ref)
    with pytest.raises(InvalidRequestError, match="holds unquantized weights"):   # not an orbax error
        mmjax.load(llava_dirs["mha"], params_dir=out, quantize="int8")
    bf = mmjax.load(llava_dirs["mha"], dtype="bfloat16")
    assert bf.model.language_model.embed_tokens.embedding.get_value().dtype.name == "bfloat16"
    assert rel_err(bf.logits("USER: <image>\nhi ASSISTANT:", [img]), ref) < 5e-2


def test_hub_id_offline_without_cache_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    with pytest.raises(CheckpointError, match="could not resolve model 'nobody/nothing'"):
        mmjax.load("nobody/nothing")


def test_hub_id_resolves_from_local_hf_cache(llava_dirs, tmp_path, monkeypatch):
    """A model in the HF cache layout loads by hub id with HF_HUB_OFFLINE=1."""
    hub = tmp_path / "hf" / "hub"
    repo = hub / "models--tiny--llava"
    commit = "0123456789abcdef0123456789abcdef01234567"
    snap = repo / "snapshots" / commit
    shutil.copytree(llava_dirs["gqa"], snap)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(hub))
    import huggingface_hub.constants as c
    monkeypatch.setattr(c, "HF_HUB_CACHE", str(hub))
    monkeypatch.setattr(c, "HF_HUB_OFFLINE", True)
    vlm = mmjax.load("tiny/llava")
    assert vlm.loaded.path == snap


def test_cli_generate_streams_answer(llava_dirs, tmp_path):
    img = tmp_path / "x.png"
    noise_image(11, 50, 40).save(img)
    cmd = [sys.executable, "-m", "mmjax.cli", "generate", "--model", str(llava_dirs["gqa"]), "--image", str(img),
           "--prompt", "What is this?", "--max-tokens", "6"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    vlm = mmjax.load(llava_dirs["gqa"])
    from PIL import Image
    expected = vlm.chat([{"role": "user", "content": [{"type": "image", "image": Image.open(img)},
                                                      {"type": "text", "text": "What is this?"}]}],
                        mmjax.SamplingParams(max_tokens=6, temperature=0.0)).text
    assert res.stdout.rstrip("\n") == expected
    bad = subprocess.run(cmd[:-4] + ["--image", str(tmp_path / "nope.png"), "--prompt", "x"],
                         capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "error" in bad.stderr
