"""mmjax.image: decoding/validation of untrusted images and parity of the family pixel policies with
the transformers PIL image processors (CLIPImageProcessorPil, Qwen2VLImageProcessorPil).

Tolerance: the policies resize with the same PIL call on the same uint8 image and repeat
transformers' float64-rescale -> float32-normalize arithmetic, so outputs are expected to be
bit-identical; tests assert max |diff| <= 1e-6 (observed: 0.0).
"""
from __future__ import annotations

import base64
import io
import json
import struct
import warnings
import zlib
from pathlib import Path

import numpy as np
import pytest
from PIL import Image, ImageOps

from mmjax.errors import (
    CheckpointError, ImageError, ImageTooLargeError, InvalidRequestError, UnsupportedModelError,
)
from mmjax.image.decode import ImageLimits, decode_data_uri, load_image, pixel_hash
from mmjax.image.processors import ClipImagePolicy, Qwen2VLImagePolicy, find_image_processor_config, load_policy

from transformers import CLIPImageProcessorPil, Qwen2VLImageProcessorPil  # noqa: E402
from transformers.image_transforms import convert_to_rgb as hf_convert_to_rgb  # noqa: E402

TOL = 1e-6
SIZES_WH = [(37, 53), (53, 37), (200, 96), (336, 500), (640, 480)]


def noise_image(width: int, height: int, seed: int = 0) -> Image.Image:
    """Random RGB noise in [1, 255] (never all zero)."""
    rng = np.random.default_rng(seed + 7919 * width + height)
    return Image.fromarray(rng.integers(1, 256, (height, width, 3), dtype=np.uint8), "RGB")


def encode(img: Image.Image, fmt: str = "PNG", **kw) -> bytes:
    buf = io.BytesIO()
    img.save(buf, fmt, **kw)
    return buf.getvalue()


def png_chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def crafted_png(width: int, height: int, idat: bytes = b"garbage, never decoded") -> bytes:
    """A tiny PNG whose header claims width x height 1-bit grayscale; the IDAT is not a valid
    stream, so reaching a full decode would fail with a *corrupt* error, not a size error."""
    ihdr = struct.pack(">IIBBBBB", width, height, 1, 0, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + png_chunk(b"IHDR", ihdr) + png_chunk(b"IDAT", idat)
            + png_chunk(b"IEND", b""))


def max_abs(a: np.ndarray, b: np.ndarray) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return float(np.max(np.abs(a.astype(np.float64) - b.astype(np.float64))))


# ------------------------------------------------------------------------------------------
# CLIP parity
# ------------------------------------------------------------------------------------------

CLIP_CONFIGS = {
    "llava15_shortest_edge_crop": dict(size={"shortest_edge": 336}, crop_size={"height": 336, "width": 336}),
    "demo_exact_hw_no_crop": dict(size={"height": 96, "width": 512}, do_center_crop=False),
    "crop_bigger_than_resize_pads": dict(size={"shortest_edge": 40}, crop_size={"height": 64, "width": 48}),
    "shortest_longest_bilinear": dict(size={"shortest_edge": 64, "longest_edge": 80},
                                      crop_size={"height": 60, "width": 60}, resample=2),
    "no_rescale_custom_norm": dict(size={"height": 30, "width": 70}, do_center_crop=False, do_rescale=False,
                                   image_mean=[127.0, 120.0, 110.0], image_std=[60.0, 61.0, 62.0]),
}


@pytest.mark.parametrize("name", sorted(CLIP_CONFIGS))
def test_clip_policy_matches_hf(name):
    cfg = CLIP_CONFIGS[name]
    hf = CLIPImageProcessorPil(**cfg)
    policy = ClipImagePolicy.from_config(cfg)
    for w, h in SIZES_WH:
        img = noise_image(w, h)
        ours = policy(img)
        ref = hf(img, return_tensors="np")["pixel_values"][0].transpose(1, 2, 0)
        assert ours.dtype == np.float32 and ours.shape == policy.output_size + (3,)
        assert max_abs(ours, ref) <= TOL, (name, w, h, max_abs(ours, ref))


def test_clip_exact_hw_keeps_whole_canvas():
    # 512x96 canvas -> size {"height": 96, "width": 512}, no crop: nothing near the edges is cut.
    policy = ClipImagePolicy.from_config({"size": {"height": 96, "width": 512}, "do_center_crop": False})
    assert policy.output_size == (96, 512)
    canvas = np.full((96, 512, 3), 200, np.uint8)
    canvas[:, :4] = 10   # marks at the left and right edges survive
    canvas[:, -4:] = 10
    out = policy(Image.fromarray(canvas))
    assert out.shape == (96, 512, 3)
    assert out[:, 0].max() < out[:, 256].min() and out[:, -1].max() < out[:, 256].min()


def test_clip_extreme_aspect_ratio_refused_not_oom():
    policy = ClipImagePolicy.from_config(CLIP_CONFIGS["llava15_shortest_edge_crop"])
    with pytest.raises(ImageError, match="aspect ratio"):
        policy(Image.new("RGB", (1, 200_000), (9, 9, 9)))
    with pytest.raises(ImageError, match="zero size"):
        policy(Image.new("RGB", (0, 3)))


def test_policies_composite_rgb_colour_key_like_hf():
    # An RGB PNG with a tRNS colour key: HF's convert_to_rgb composites the keyed colour on white.
    arr = np.asarray(noise_image(40, 30)).copy()
    arr[:5, :5] = (10, 20, 30)
    img = Image.open(io.BytesIO(encode(Image.fromarray(arr), "PNG", transparency=(10, 20, 30))))
    img.load()
    assert img.mode == "RGB" and img.info.get("transparency") is not None
    cfg = CLIP_CONFIGS["demo_exact_hw_no_crop"]
    ref = CLIPImageProcessorPil(**cfg)(img, return_tensors="np")["pixel_values"][0].transpose(1, 2, 0)
    assert max_abs(ClipImagePolicy.from_config(cfg)(img), ref) <= TOL
    assert pixel_hash(img) == pixel_hash(load_image(encode(img))) != pixel_hash(Image.fromarray(arr))


def test_clip_variable_size_config_rejected():
    with pytest.raises(UnsupportedModelError) as e:
        ClipImagePolicy.from_config({"size": {"shortest_edge": 224}, "do_center_crop": False})
    assert e.value.param == "do_center_crop"


def test_clip_cache_key():
    a = ClipImagePolicy.from_config(CLIP_CONFIGS["llava15_shortest_edge_crop"])
    assert a.cache_key() == ClipImagePolicy.from_config(CLIP_CONFIGS["llava15_shortest_edge_crop"]).cache_key()
    others = [ClipImagePolicy.from_config(c).cache_key() for k, c in CLIP_CONFIGS.items()
              if k != "llava15_shortest_edge_crop"]
    assert a.cache_key() not in others
    hash(a.cache_key())


# ------------------------------------------------------------------------------------------
# Qwen2-VL parity
# ------------------------------------------------------------------------------------------

QWEN_CONFIGS = {
    "default": {},
    "small_budget": dict(min_pixels=1000, max_pixels=50_000),
    "pinned": dict(min_pixels=56 * 56 * 4, max_pixels=56 * 56 * 4),
    "upscale_min": dict(min_pixels=300_000, max_pixels=2_000_000),
    "patch16_bilinear": dict(patch_size=16, merge_size=2, max_pixels=100_000, resample=2),
}


def hf_qwen_tokens(grid: np.ndarray, merge: int) -> int:
    return int(np.prod(grid)) // merge**2


@pytest.mark.parametrize("name", sorted(QWEN_CONFIGS))
def test_qwen2vl_policy_matches_hf(name):
    cfg = QWEN_CONFIGS[name]
    hf = Qwen2VLImageProcessorPil(**cfg)
    policy = Qwen2VLImagePolicy.from_config(cfg)
    for w, h in SIZES_WH:
        img = noise_image(w, h)
        patches, grid = policy(img)
        out = hf(img, return_tensors="np")
        ref, ref_grid = out["pixel_values"], out["image_grid_thw"]
        assert patches.dtype == np.float32
        assert tuple(ref_grid[0]) == grid
        assert max_abs(patches, ref) <= TOL, (name, w, h, max_abs(patches, ref))
        tokens = policy.num_tokens(h, w)
        assert tokens == hf_qwen_tokens(ref_grid[0], policy.merge_size)
        assert tokens * policy.merge_size**2 == hf.get_number_of_image_patches(h, w)
        assert policy.resized_size(h, w) == (grid[1] * policy.patch_size, grid[2] * policy.patch_size)


def test_qwen2vl_per_request_pixel_bounds_match_hf():
    hf = Qwen2VLImageProcessorPil()
    policy = Qwen2VLImagePolicy.from_config({})
    img = noise_image(336, 500)
    lo, hi = 4 * 28 * 28, 64 * 28 * 28
    patches, grid = policy(img, min_pixels=lo, max_pixels=hi)
    out = hf(img, size={"shortest_edge": lo, "longest_edge": hi}, return_tensors="np")
    assert tuple(out["image_grid_thw"][0]) == grid
    assert max_abs(patches, out["pixel_values"]) <= TOL
    assert policy.num_tokens(500, 336, min_pixels=lo, max_pixels=hi) == hf_qwen_tokens(out["image_grid_thw"][0], 2)
    assert policy.cache_key(min_pixels=lo, max_pixels=hi) != policy.cache_key()
    assert policy.cache_key() == Qwen2VLImagePolicy.from_config({}).cache_key()


def test_qwen2vl_4k_token_count_matches_hf():
    hf = Qwen2VLImageProcessorPil()
    policy = Qwen2VLImagePolicy.from_config({})
    img = noise_image(3840, 2160)
    patches, grid = policy(img)
    out = hf(img, return_tensors="np")
    assert tuple(out["image_grid_thw"][0]) == grid
    assert policy.num_tokens(2160, 3840) == hf_qwen_tokens(out["image_grid_thw"][0], 2)
    assert policy.num_tokens(2160, 3840) * 4 == hf.get_number_of_image_patches(2160, 3840)
    assert patches.shape == out["pixel_values"].shape
    assert max_abs(patches, out["pixel_values"]) <= TOL


def test_qwen2vl_config_styles():
    # Original Qwen releases: top-level min/max_pixels; v5 saves size={shortest_edge, longest_edge}.
    top = Qwen2VLImagePolicy.from_config({"min_pixels": 3136, "max_pixels": 12845056})
    v5 = Qwen2VLImagePolicy.from_config({"size": {"shortest_edge": 3136, "longest_edge": 12845056}})
    old = Qwen2VLImagePolicy.from_config({"size": {"min_pixels": 3136, "max_pixels": 12845056}})
    assert top == v5 == old and (top.min_pixels, top.max_pixels) == (3136, 12845056)
    explicit_none = Qwen2VLImagePolicy.from_config(
        {"min_pixels": None, "max_pixels": None, "size": {"shortest_edge": 100, "longest_edge": 9000}})
    assert (explicit_none.min_pixels, explicit_none.max_pixels) == (100, 9000)
    both = Qwen2VLImagePolicy.from_config({"size": {"shortest_edge": 1, "longest_edge": 2}, "max_pixels": 5000})
    hf = Qwen2VLImageProcessorPil(size={"shortest_edge": 1, "longest_edge": 2}, max_pixels=5000)
    assert (both.min_pixels, both.max_pixels) == (hf.size.shortest_edge, hf.size.longest_edge)


def test_qwen2vl_bad_geometry_and_bounds():
    policy = Qwen2VLImagePolicy()
    with pytest.raises(ImageError, match="aspect ratio"):
        policy.num_tokens(10, 2500)
    with pytest.raises(InvalidRequestError) as e:
        policy.num_tokens(100, 100, min_pixels=10_000, max_pixels=5_000)
    assert e.value.param == "min_pixels"
    with pytest.raises(InvalidRequestError):
        policy.num_tokens(100, 100, max_pixels=-1)


# ------------------------------------------------------------------------------------------
# Config discovery and dispatch (files written by transformers 5.23 itself)
# ------------------------------------------------------------------------------------------

def tiny_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    tok = Tokenizer(models.WordLevel({"<unk>": 0, "<image>": 1, "a": 2}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>")
    fast.add_special_tokens({"additional_special_tokens": ["<image>"]})
    return fast


def assert_policy_matches_saved(model_dir: Path, img: Image.Image) -> None:
    from transformers import AutoImageProcessor
    cfg = find_image_processor_config(model_dir)
    policy = load_policy(cfg)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "requires torchvision; falling back to ...Pil"
        hf = AutoImageProcessor.from_pretrained(model_dir)
    assert type(hf).__name__.endswith("Pil")
    out = hf(img, return_tensors="np")
    if isinstance(policy, ClipImagePolicy):
        assert max_abs(policy(img), out["pixel_values"][0].transpose(1, 2, 0)) <= TOL
    else:
        patches, grid = policy(img)
        assert tuple(out["image_grid_thw"][0]) == grid
        assert max_abs(patches, out["pixel_values"]) <= TOL


def test_find_config_standalone_and_nested(tmp_path):
    from transformers import LlavaProcessor
    img = noise_image(200, 96)

    clip_dir = tmp_path / "clip"
    CLIPImageProcessorPil(size={"height": 96, "width": 512}, do_center_crop=False).save_pretrained(clip_dir)
    assert (clip_dir / "preprocessor_config.json").is_file()
    assert find_image_processor_config(clip_dir)["image_processor_type"] == "CLIPImageProcessor"
    assert_policy_matches_saved(clip_dir, img)

    llava_dir = tmp_path / "llava"
    LlavaProcessor(image_processor=CLIPImageProcessorPil(size={"shortest_edge": 48}, crop_size=48),
                   tokenizer=tiny_tokenizer(), patch_size=14, vision_feature_select_strategy="default",
                   num_additional_image_tokens=1).save_pretrained(llava_dir)
    assert not (llava_dir / "preprocessor_config.json").exists()  # v5: nested in processor_config.json
    assert "image_processor" in json.loads((llava_dir / "processor_config.json").read_text())
    assert_policy_matches_saved(llava_dir, img)

    qwen_dir = tmp_path / "qwen"
    Qwen2VLImageProcessorPil(min_pixels=1000, max_pixels=50_000).save_pretrained(qwen_dir)
    cfg = find_image_processor_config(qwen_dir)
    assert cfg["size"] == {"shortest_edge": 1000, "longest_edge": 50_000}
    assert_policy_matches_saved(qwen_dir, img)


def test_find_config_missing(tmp_path):
    with pytest.raises(CheckpointError, match="preprocessor_config.json"):
        find_image_processor_config(tmp_path)


def test_load_policy_dispatch():
    assert isinstance(load_policy({"image_processor_type": "CLIPImageProcessorFast"}), ClipImagePolicy)
    assert isinstance(load_policy({"image_processor_type": "Qwen2VLImageProcessor"}), Qwen2VLImagePolicy)
    with pytest.raises(UnsupportedModelError, match="image_processor_type") as e:
        load_policy({"image_processor_type": "BlipImageProcessor"})
    assert e.value.param == "image_processor_type" and "BlipImageProcessor" in e.value.message
    with pytest.raises(UnsupportedModelError, match="image_processor_type"):
        load_policy({"size": {"height": 3, "width": 3}})


# ------------------------------------------------------------------------------------------
# Decoding: modes, frames, orientation
# ------------------------------------------------------------------------------------------

def hf_rgb(data: bytes) -> np.ndarray:
    """What transformers' convert_to_rgb makes of the same file (first frame, no EXIF handling)."""
    return hf_convert_to_rgb(Image.open(io.BytesIO(data)), return_numpy=True)


def rgba_noise(w: int, h: int) -> Image.Image:
    rng = np.random.default_rng(1)
    a = rng.integers(0, 256, (h, w, 4), dtype=np.uint8)
    a[0, 0, 3] = 0      # fully transparent -> white
    a[0, 1, 3] = 255    # opaque -> unchanged
    return Image.fromarray(a, "RGBA")


def test_rgba_composited_on_white():
    src = rgba_noise(23, 17)
    data = encode(src)
    img = load_image(data)
    arr = np.asarray(img)
    assert img.mode == "RGB" and img.size == (23, 17)
    assert np.array_equal(arr, hf_rgb(data))
    assert tuple(arr[0, 0]) == (255, 255, 255)
    assert tuple(arr[0, 1]) == tuple(np.asarray(src)[0, 1, :3])


def test_la_and_palette_transparency_and_16bit_gray():
    rng = np.random.default_rng(2)
    la = Image.fromarray(rng.integers(0, 256, (11, 13, 2), dtype=np.uint8), "LA")
    pal = Image.fromarray(rng.integers(0, 16, (11, 13), dtype=np.uint8), "P")
    pal.putpalette(list(rng.integers(0, 256, 16 * 3)))
    gray16 = Image.fromarray(rng.integers(0, 65536, (11, 13), dtype=np.uint16))
    cases = [(la, {}), (pal, {"transparency": 3}), (gray16, {})]
    for src, kw in cases:
        data = encode(src, "PNG", **kw)
        reopened = Image.open(io.BytesIO(data))
        img = load_image(data)
        assert img.mode == "RGB" and img.size == (13, 11), reopened.mode
        assert np.array_equal(np.asarray(img), hf_rgb(data)), reopened.mode
    # the palette entry marked transparent became white
    arr = np.asarray(load_image(encode(pal, "PNG", transparency=3)))
    assert (arr[np.asarray(pal) == 3] == 255).all()
    assert Image.open(io.BytesIO(encode(gray16))).mode.startswith("I")


def test_cmyk_jpeg():
    rng = np.random.default_rng(3)
    cmyk = Image.fromarray(rng.integers(0, 256, (20, 30, 4), dtype=np.uint8), "CMYK")
    data = encode(cmyk, "JPEG", quality=95)
    assert Image.open(io.BytesIO(data)).mode == "CMYK"
    img = load_image(data)
    assert img.mode == "RGB" and img.size == (30, 20)
    assert np.array_equal(np.asarray(img), hf_rgb(data))


def test_animated_gif_first_frame():
    frames = [Image.new("RGB", (16, 12), c) for c in ((250, 10, 10), (10, 250, 10), (10, 10, 250))]
    buf = io.BytesIO()
    frames[0].save(buf, "GIF", save_all=True, append_images=frames[1:], duration=50, loop=0)
    data = buf.getvalue()
    assert Image.open(io.BytesIO(data)).n_frames == 3
    arr = np.asarray(load_image(data))
    assert arr.shape == (12, 16, 3)
    assert np.array_equal(arr, hf_rgb(data))
    assert arr[..., 0].min() > 200 and arr[..., 1].max() < 50  # red frame, not green/blue


def test_animated_webp_first_frame():
    frames = [Image.new("RGB", (16, 12), c) for c in ((250, 10, 10), (10, 250, 10))]
    data = encode(frames[0], "WEBP", save_all=True, append_images=frames[1:], lossless=True)
    arr = np.asarray(load_image(data))
    assert arr.shape == (12, 16, 3) and arr[..., 0].min() > 200


def test_exif_orientation_6_rotates():
    src = noise_image(40, 20)
    exif = Image.Exif()
    exif[0x0112] = 6  # Orientation: rotate 90 CW to display
    data = encode(src, "JPEG", exif=exif.tobytes(), quality=95)
    img = load_image(data)
    assert img.size == (20, 40)  # (W, H) after rotation
    expected = ImageOps.exif_transpose(Image.open(io.BytesIO(data))).convert("RGB")
    assert np.array_equal(np.asarray(img), np.asarray(expected))
    # a caller's PIL image is rotated in the result but never mutated
    theirs = Image.open(io.BytesIO(data))
    assert np.array_equal(np.asarray(load_image(theirs)), np.asarray(expected))
    assert theirs.size == (40, 20)


def test_pixel_hash_format_independent():
    src = noise_image(31, 17)
    png, bmp = load_image(encode(src, "PNG")), load_image(encode(src, "BMP"))
    webp = load_image(encode(src, "WEBP", lossless=True))
    tiff = load_image(encode(src, "TIFF", compression="tiff_deflate"))
    assert pixel_hash(png) == pixel_hash(bmp) == pixel_hash(webp) == pixel_hash(tiff) == pixel_hash(src)
    changed = np.asarray(src).copy()
    changed[5, 7, 1] ^= 1
    assert pixel_hash(Image.fromarray(changed)) != pixel_hash(png)
    # same bytes, different shape -> different hash
    flat = Image.fromarray(np.asarray(src).reshape(17 * 31, 1, 3))
    assert pixel_hash(flat) != pixel_hash(png)
    assert len(pixel_hash(png)) == 64


def test_sources_data_uri_path_pil(tmp_path):
    src = noise_image(9, 7)
    data = encode(src)
    b64 = base64.b64encode(data).decode()
    uri = "data:image/png;base64," + b64
    assert decode_data_uri(uri) == data
    wrapped = "data:image/png;base64," + "\n".join(b64[i:i + 76] for i in range(0, len(b64), 76))
    assert decode_data_uri(wrapped) == data
    path = tmp_path / "x.png"
    path.write_bytes(data)
    for source in (data, bytearray(data), uri, str(path), path, src):
        assert pixel_hash(load_image(source)) == pixel_hash(src)


# ------------------------------------------------------------------------------------------
# Bad inputs: typed errors with clear messages
# ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("uri,msg", [
    ("data:image/png;base64,@@@###", "not valid base64"),
    ("data:image/png;base64,", "no image data"),
    ("data:text/plain;base64,aGVsbG8=", "media type"),
    ("data:image/png,rawdata", "base64"),
    ("data:image/png;base64", "no ','"),
    ("image/png;base64,aGVsbG8=", "must start with 'data:'"),
])
def test_bad_data_uri(uri, msg):
    with pytest.raises(ImageError, match=msg) as e:
        decode_data_uri(uri)
    assert e.value.param == "image_url" and e.value.status == 400
    with pytest.raises(ImageError, match=msg):
        load_image(uri) if uri.startswith("data:") else decode_data_uri(uri)


def test_empty_corrupt_truncated_unsupported():
    png = encode(noise_image(64, 64))
    ppm = encode(noise_image(16, 16), "PPM")
    assert Image.open(io.BytesIO(ppm)).size == (16, 16)
    cases = [
        (b"", "empty"),
        (b"this is not an image at all", "unsupported image format"),
        (png[:8] + b"\x00" * 100, "corrupt PNG image"),
        (b"\xff\xd8\xff" + b"\x01" * 50, "corrupt JPEG image"),
        (png[: len(png) // 2], "corrupt or truncated"),
        (encode(noise_image(16, 16), "JPEG")[:200], "corrupt or truncated"),
        (ppm, "unsupported image format"),  # Pillow decodes PPM; the allow-list refuses it
    ]
    for data, msg in cases:
        with pytest.raises(ImageError, match=msg) as e:
            load_image(data)
        assert type(e.value) is ImageError and e.value.code == "invalid_image"


def test_zero_size():
    with pytest.raises(ImageError, match="zero size"):
        load_image(Image.new("RGB", (0, 5)))
    with pytest.raises(ImageError, match="corrupt PNG"):  # Pillow itself refuses a 0-width header
        load_image(crafted_png(0, 10))


def test_bad_source_kinds(tmp_path):
    with pytest.raises(ImageError, match="not found"):
        load_image(tmp_path / "missing.png")
    with pytest.raises(ImageError, match="directory"):
        load_image(tmp_path)
    with pytest.raises(ImageError, match="fetched by the server"):
        load_image("https://example.com/cat.png")
    with pytest.raises(ImageError, match="source type"):
        load_image(12345)


def test_oversized_bytes(tmp_path):
    data = encode(noise_image(40, 40))
    limits = ImageLimits(max_bytes=len(data) - 1)
    path = tmp_path / "big.png"
    path.write_bytes(data)
    uri = "data:image/png;base64," + base64.b64encode(data).decode()
    for source in (data, str(path), uri):
        with pytest.raises(ImageTooLargeError, match="bytes, over the limit") as e:
            load_image(source, limits)
        assert e.value.status == 413 and e.value.code == "image_too_large"
    assert load_image(data, ImageLimits(max_bytes=len(data))).size == (40, 40)


def test_oversized_pixels_rejected_from_header():
    # Our limit (40 MP default): 8000x8000 header, garbage pixel data -> size error, not decode error.
    with pytest.raises(ImageTooLargeError, match="8000x8000 = 64000000 pixels"):
        load_image(crafted_png(8000, 8000))
    # 20000x20000 = 400 MP: Pillow's own DecompressionBombError fires inside open() -> typed error.
    with pytest.raises(ImageTooLargeError, match="decompression-bomb"):
        load_image(crafted_png(20000, 20000))
    # A real (decodable) 20000x20000 1-bit PNG is ~50 KB; still rejected before decoding.
    row = b"\x00" + b"\x00" * 2500
    real = crafted_png(20000, 20000, zlib.compress(row * 20000, 9))
    assert len(real) < 200_000
    with pytest.raises(ImageTooLargeError):
        load_image(real)
    with pytest.raises(ImageTooLargeError, match="over the limit of 1000 pixels"):
        load_image(encode(noise_image(40, 40)), ImageLimits(max_pixels=1000))


def test_pillow_bomb_warning_becomes_error_not_warning():
    # 10000x10000 = 100 MP: over Pillow's warning threshold (~89 MP) but under our raised limit.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(ImageTooLargeError, match="decompression-bomb"):
            load_image(crafted_png(10000, 10000), ImageLimits(max_pixels=200_000_000))
    assert not [w for w in caught if issubclass(w.category, Image.DecompressionBombWarning)]
    # the guard restores the warning filters it changed
    assert not any(f[2] is Image.DecompressionBombWarning for f in warnings.filters)


def test_concurrent_loads_are_isolated():
    # Bad and good images decoded from several threads: each gets its own result or typed error,
    # and the bomb guard leaves no warning filter behind.
    from concurrent.futures import ThreadPoolExecutor
    good = encode(noise_image(64, 48))
    jobs = [good, crafted_png(20000, 20000), b"junk", good[:100]] * 4

    def run(data):
        try:
            return pixel_hash(load_image(data))
        except ImageError as e:
            return type(e).__name__

    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(run, jobs))
    expected = [pixel_hash(noise_image(64, 48)), "ImageTooLargeError", "ImageError", "ImageError"] * 4
    assert results == expected
    assert not any(f[2] is Image.DecompressionBombWarning for f in warnings.filters)


def test_image_keys_are_the_same_in_every_process(llava_dirs, qwen_dirs, tmp_path):
    """The server prepares images in spawned decode processes: an image's encoder-cache key must
    not depend on the process (Python's str hash does, per PYTHONHASHSEED)."""
    import os
    import subprocess
    import sys
    Image.fromarray(np.random.default_rng(3).integers(0, 256, (30, 40, 3), np.uint8)).save(tmp_path / "x.png")
    code = ("import sys; from PIL import Image; from mmjax.api import load_model; "
            "[print(load_model(p).family.prepare_image(Image.open(sys.argv[1]).convert('RGB')).key) "
            "for p in sys.argv[2:]]")
    paths = [str(llava_dirs["gqa"]), str(qwen_dirs["qwen2_vl"])]
    keys = [subprocess.run([sys.executable, "-c", code, str(tmp_path / "x.png"), *paths], capture_output=True,
                           text=True, check=True, env={**os.environ, "PYTHONHASHSEED": seed}).stdout.split()
            for seed in ("1", "2")]
    assert len(keys[0]) == 2 and keys[0] == keys[1]


# ------------------------------------------------------------------------------------------------
# Geometry: where each family's model pixels lie on the image (saliency maps in image coordinates)
# ------------------------------------------------------------------------------------------------

def test_family_geometry_puts_a_marker_back_where_it_was():
    """For each image processor (resize, shortest-edge resize + center crop, a crop larger than
    the image (padding), Qwen2-VL's smart_resize, Gemma 3's pan-and-scan crops, Idefics3's tiles +
    global image, LLaVA-NeXT's overview + padded anyres tiles, OneVision's padded square, Mllama's
    padded canvas tiles): a marker's change in the model pixels, moved back onto the image, lands
    on the marker (>= 95% of it within the resampling kernels' reach) and keeps its total (no view
    pixel of these shows padding where the marker changed anything)."""
    from marker_check import check_marker, marker_views
    from mmjax.image.anyres import AnyresImagePolicy
    from mmjax.image.gemma3 import Gemma3ImagePolicy, PanAndScan
    from mmjax.image.geometry import Frame
    from mmjax.image.idefics3 import Idefics3ImagePolicy
    from mmjax.image.mllama import MllamaImagePolicy

    def one(p):
        return lambda img: p(img)[None]

    clip_sq = ClipImagePolicy(size=(("height", 128), ("width", 128)), do_center_crop=False)          # mmjax-shapes
    clip_crop = ClipImagePolicy(size=(("shortest_edge", 64),), crop_size=(64, 64))                  # LLaVA-1.5
    clip_pad = ClipImagePolicy(size=(("shortest_edge", 40),), crop_size=(56, 56))                   # crop > image
    qwen = Qwen2VLImagePolicy(min_pixels=56 * 56, max_pixels=28 * 28 * 40)
    gemma = Gemma3ImagePolicy(height=64, width=64, do_pan_and_scan=True, pan_and_scan=PanAndScan(min_crop_size=32))
    idefics = Idefics3ImagePolicy(longest_edge=128, tile=48)
    nxt = AnyresImagePolicy.from_config({"size": {"shortest_edge": 32}, "crop_size": {"height": 32, "width": 32},
                                         "image_grid_pinpoints": [[32, 64], [64, 32], [64, 64]]}, onevision=False)
    ov = AnyresImagePolicy.from_config({"size": {"height": 32, "width": 32},
                                        "image_grid_pinpoints": [[32, 64], [64, 32]]}, onevision=True)
    mllama = MllamaImagePolicy(tile=40, max_image_tiles=4)
    cases = [  # (name, views of an image, frames of a width x height image)
        ("clip resize", one(clip_sq), lambda w, h: [clip_sq.frame(Frame.of(h, w))]),
        ("clip crop", one(clip_crop), lambda w, h: [clip_crop.frame(Frame.of(h, w))]),
        ("clip pad", one(clip_pad), lambda w, h: [clip_pad.frame(Frame.of(h, w))]),
        ("qwen", lambda img: _qwen_image(qwen, img)[None],
         lambda w, h: [Frame.of(h, w).resize(*qwen.resized_size(h, w))]),
        ("gemma3", lambda img: np.stack(gemma(img)), lambda w, h: gemma.frames(h, w)),
        ("idefics3", lambda img: idefics(img)[0],
         lambda w, h: idefics.frames(h, w, *idefics.grid(h, w))),
        ("llava-next", lambda img: nxt(img, nxt.grid(img.height, img.width, 4)),
         lambda w, h: nxt.frames(h, w, nxt.grid(h, w, 4))),
        ("onevision square", lambda img: ov(img, ov.grid(img.height, img.width, 4, max_tiles=0)),
         lambda w, h: ov.frames(h, w, ov.grid(h, w, 4, max_tiles=0))),
        ("mllama", lambda img: mllama(img)[0][:mllama(img)[2]], lambda w, h: mllama.frames(h, w)),
    ]
    for name, views, frames_of in cases:
        for w, h, box in ((200, 150, (120, 30, 150, 60)), (90, 230, (30, 150, 60, 175))):
            seen = 0
            for k, (frame, image_map, total) in enumerate(marker_views(views, frames_of(w, h), w, h, box)):
                assert image_map.shape == (h, w)
                if total > 0:
                    check_marker(frame, image_map, total, box, (name, w, h, k))
                    seen += 1
            assert seen, name
    # crops and padding: the views show parts of the image / padding
    crop = clip_crop.frame(Frame.of(150, 200))      # resized to 64 x 85 (long side truncated), columns 10..74 kept
    assert crop.source_box() == pytest.approx((0.0, 10 * 200 / 85, 150.0, 74 * 200 / 85))
    pad = clip_pad.frame(Frame.of(150, 200))        # resized to 40 x 53, centred on 56 x 56 (ceil padding first)
    assert pad.box == (8.0, 2.0, 48.0, 55.0) and pad.source_box() == pytest.approx((0.0, 0.0, 150.0, 200.0))


def _qwen_image(policy, img) -> np.ndarray:
    """Qwen2VLImagePolicy's patches laid out as the resized image [H, W, 3] (the family's image_pixels)."""
    patches, (t, gh, gw) = policy(img)
    p, m, tp = policy.patch_size, policy.merge_size, policy.temporal_patch_size
    x = patches.reshape(gh // m, gw // m, m, m, 3, tp, p, p)[:, :, :, :, :, 0]
    return np.ascontiguousarray(x.transpose(0, 2, 5, 1, 3, 6, 4)).reshape(gh * p, gw * p, 3)
