"""Image input: bytes -> validated RGB image -> pixels per model-family policy, plus a content hash.

Host code only (numpy + Pillow), never traced. Three stages:

1. `load_image`: decode untrusted input (bytes, data URI, local path or a PIL image) with byte and
   pixel limits checked *before* the full decode, take the first frame of animations, apply EXIF
   orientation and convert to RGB exactly like transformers' `convert_to_rgb` (transparency
   composited on white).
2. `pixel_hash`: sha256 of the decoded pixels, the key for the encoder cache (format independent).
3. A family policy (`ClipImagePolicy`, `Qwen2VLImagePolicy`) turns the RGB image into the float32
   pixels the vision tower eats, bit-for-bit like the transformers *Pil image processors*
   (`CLIPImageProcessorPil`, `Qwen2VLImageProcessorPil`): same PIL resize on uint8 images, same
   output-size rounding, same float64-rescale-then-float32 arithmetic, same patch order.

transformers is a test-only dependency: the rules are reimplemented here, not imported.
"""
from __future__ import annotations

import base64
import binascii
import contextlib
import hashlib
import io
import json
import math
import os
import re
import struct
import threading
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Union

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

from mmjax.errors import (
    CheckpointError, ImageError, ImageTooLargeError, InvalidRequestError, UnsupportedModelError,
)

__all__ = [
    "ImageLimits", "decode_data_uri", "load_image", "pixel_hash",
    "ClipImagePolicy", "Qwen2VLImagePolicy", "find_image_processor_config", "load_policy",
]

ImageSource = Union[bytes, bytearray, memoryview, Image.Image, str, os.PathLike]

# Same constants as transformers.utils.constants (OPENAI_CLIP_MEAN / OPENAI_CLIP_STD).
OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
_PARAM = "image_url"  # the OpenAI request field every image error points at

# Raster formats a chat client plausibly sends. Everything else Pillow can open (EPS, which shells
# out to Ghostscript, PSD, ICNS, fonts, ...) is refused: more decoders = more attack surface.
# (MPO, the multi-picture JPEG of phone cameras, is opened by the JPEG plugin.)
DEFAULT_FORMATS = ("JPEG", "PNG", "GIF", "WEBP", "BMP", "TIFF", "AVIF")

# Leading bytes of the accepted formats: lets a corrupt header be reported as corrupt rather than
# as an unsupported format (Pillow raises the same UnidentifiedImageError for both).
_SIGNATURES = (
    (b"\x89PNG\r\n\x1a\n", "PNG"), (b"\xff\xd8\xff", "JPEG"), (b"GIF87a", "GIF"), (b"GIF89a", "GIF"),
    (b"BM", "BMP"), (b"II*\x00", "TIFF"), (b"MM\x00*", "TIFF"),
)


# --------------------------------------------------------------------------------------------
# Decoding
# --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class ImageLimits:
    """Limits on one input image.

    max_bytes: encoded size. max_pixels: decoded width*height, checked from the header before the
    full decode (decompression-bomb guard). Pillow's own guard (`Image.MAX_IMAGE_PIXELS`, ~89 MP)
    also applies, so the effective pixel limit is the smaller of the two.
    formats: Pillow format names accepted (others -> ImageError).
    """

    max_bytes: int = 20 * 2**20
    max_pixels: int = 40_000_000
    formats: tuple[str, ...] = DEFAULT_FORMATS

    def __post_init__(self) -> None:
        if self.max_bytes <= 0 or self.max_pixels <= 0:
            raise ValueError(f"ImageLimits must be positive, got max_bytes={self.max_bytes}, "
                             f"max_pixels={self.max_pixels}")


_WHITESPACE = re.compile(r"\s+")


def _strip_whitespace(text: str) -> str:
    # Clients wrap long base64 at 76 columns (MIME style); whitespace is never data.
    return _WHITESPACE.sub("", text) if _WHITESPACE.search(text) else text


def _split_data_uri(uri: str) -> tuple[str, str]:
    """'data:image/png;base64,AAAA' -> ('image/png', 'AAAA'); ImageError if not an image data URI."""
    if not isinstance(uri, str) or not uri[:5].lower() == "data:":
        raise ImageError("image data URI must start with 'data:'", param=_PARAM)
    header, sep, payload = uri[5:].partition(",")
    if not sep:
        raise ImageError("malformed data URI: no ',' between header and data", param=_PARAM)
    parts = [p.strip().lower() for p in header.split(";")]
    media_type = parts[0]
    if not media_type.startswith("image/"):
        raise ImageError(f"data URI media type must be image/*, got {media_type or 'none'!r}", param=_PARAM)
    if "base64" not in parts[1:]:
        raise ImageError("image data URI must be base64-encoded (';base64,')", param=_PARAM)
    return media_type, payload


def _b64decode(payload: str) -> bytes:
    payload = _strip_whitespace(payload)
    if not payload:
        raise ImageError("data URI contains no image data", param=_PARAM)
    payload += "=" * (-len(payload) % 4)  # some encoders drop the padding; it carries no data
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as e:
        raise ImageError(f"data URI is not valid base64: {e}", param=_PARAM) from None


def decode_data_uri(uri: str) -> bytes:
    """Decode `data:image/<type>;base64,<data>` to the encoded image bytes.

    Raises ImageError (param='image_url') on a non-image or non-base64 URI, bad base64 or no data.
    """
    _, payload = _split_data_uri(uri)
    return _b64decode(payload)


def _too_many_bytes(n: int, limits: ImageLimits) -> ImageTooLargeError:
    return ImageTooLargeError(
        f"image is {n} bytes, over the limit of {limits.max_bytes} bytes", param=_PARAM)


def _read_path(path: str | os.PathLike, limits: ImageLimits) -> bytes:
    """Read a local image file, refusing oversized files before reading them."""
    try:
        size = os.stat(path).st_size
        if size > limits.max_bytes:
            raise _too_many_bytes(size, limits)
        with open(path, "rb") as f:
            # Read at most one byte past the limit: the file may have grown since stat().
            data = f.read(limits.max_bytes + 1)
    except IsADirectoryError:
        raise ImageError(f"image path is a directory: {os.fspath(path)!r}", param=_PARAM) from None
    except FileNotFoundError:
        raise ImageError(f"image file not found: {os.fspath(path)!r}", param=_PARAM) from None
    except OSError as e:
        raise ImageError(f"cannot read image file {os.fspath(path)!r}: {e.strerror or e}", param=_PARAM) from None
    return data


def _source_bytes(source: bytes | bytearray | memoryview | str | os.PathLike, limits: ImageLimits) -> bytes:
    """Encoded bytes of a non-PIL source, with the byte limit enforced as early as possible."""
    if isinstance(source, (bytes, bytearray, memoryview)):
        data = bytes(source)
    elif isinstance(source, str) and source[:5].lower() == "data:":
        _, payload = _split_data_uri(source)
        # base64 carries 3 bytes per 4 chars: refuse before allocating the decoded copy.
        if len(payload) // 4 * 3 > limits.max_bytes + 3:
            raise _too_many_bytes(len(payload) // 4 * 3, limits)
        data = _b64decode(payload)
    elif isinstance(source, str) and source[:8].lower().startswith(("http://", "https://")):
        raise ImageError("remote image URLs must be fetched by the server first; load_image takes bytes, "
                         "a data: URI, a local path or a PIL image", param=_PARAM)
    elif isinstance(source, (str, os.PathLike)):
        data = _read_path(source, limits)
    else:
        raise ImageError(f"unsupported image source type {type(source).__name__}", param=_PARAM)
    if not data:
        raise ImageError("image data is empty", param=_PARAM)
    if len(data) > limits.max_bytes:
        raise _too_many_bytes(len(data), limits)
    return data


_BOMB_LOCK = threading.Lock()
# Formats whose load() (not only open()) runs Pillow's bomb check on a size the header did not
# bound: TIFF allocates its tile buffer there. GIF's frame-0 checks run inside open().
_LOAD_TIME_BOMB_CHECK = frozenset({"TIFF"})


def _too_large_from_pillow(e: Exception) -> ImageTooLargeError:
    return ImageTooLargeError(f"image rejected by the decompression-bomb guard: {e}", param=_PARAM)


@contextlib.contextmanager
def _pillow_bomb_guard() -> Iterator[None]:
    """Turn Pillow's decompression-bomb warning/error into ImageTooLargeError.

    Pillow warns above MAX_IMAGE_PIXELS and raises above twice that. The warning must neither leak
    nor pass silently, so it is raised as an error here. `warnings.catch_warnings` edits
    process-global state, hence the lock; it is held only around header parsing (and TIFF loads),
    so full decodes of ordinary images still run in parallel threads.
    """
    with _BOMB_LOCK, warnings.catch_warnings():
        warnings.simplefilter("error", Image.DecompressionBombWarning)
        try:
            yield
        except (Image.DecompressionBombError, Image.DecompressionBombWarning) as e:
            raise _too_large_from_pillow(e) from None


def _check_dimensions(size: tuple[int, int], limits: ImageLimits) -> None:
    """Zero-size -> ImageError; width*height over limits.max_pixels -> ImageTooLargeError."""
    width, height = size
    if width <= 0 or height <= 0:
        raise ImageError(f"image has zero size ({width}x{height})", param=_PARAM)
    if width * height > limits.max_pixels:
        raise ImageTooLargeError(
            f"image is {width}x{height} = {width * height} pixels, over the limit of {limits.max_pixels} pixels",
            param=_PARAM)


def _allowed_formats(limits: ImageLimits) -> list[str]:
    # Pillow raises on a format name it has no plugin for (e.g. AVIF on an old build): drop those.
    Image.init()
    return [f for f in limits.formats if f.upper() in Image.OPEN]


def _sniff(data: bytes) -> str | None:
    """Format name from the file signature, or None (RIFF/WEBP and ISO-BMFF/AVIF checked by tag)."""
    for magic, name in _SIGNATURES:
        if data.startswith(magic):
            return name
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "WEBP"
    if data[4:8] == b"ftyp" and data[8:12] in (b"avif", b"avis"):
        return "AVIF"
    return None


def _open(data: bytes, limits: ImageLimits) -> Image.Image:
    """Parse only the header (Pillow opens lazily) so limits are checked before pixels are decoded."""
    formats = _allowed_formats(limits)
    try:
        with _pillow_bomb_guard():
            return Image.open(io.BytesIO(data), formats=formats)
    except UnidentifiedImageError:
        kind = _sniff(data)
        if kind is not None:
            raise ImageError(f"corrupt {kind} image: its header cannot be parsed", param=_PARAM) from None
        raise ImageError(f"unrecognised or unsupported image format (accepted: {', '.join(formats)})",
                         param=_PARAM) from None
    except (ImageError, MemoryError):
        raise
    except Exception as e:  # any parser failure on untrusted bytes is a bad image, not a server error
        raise ImageError(f"cannot read image header (corrupt or truncated): {e}", param=_PARAM) from None


def _load_frame0(img: Image.Image) -> None:
    if img.tell() != 0:
        img.seek(0)
    img.load()


def _decode_first_frame(img: Image.Image) -> Image.Image:
    """Seek to frame 0 (animated GIF/WebP/APNG/MPO) and decode it fully."""
    try:
        if img.format in _LOAD_TIME_BOMB_CHECK:
            with _pillow_bomb_guard():
                _load_frame0(img)
        else:
            _load_frame0(img)
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as e:
        raise _too_large_from_pillow(e) from None
    except (ImageError, MemoryError):
        raise
    except Exception as e:  # truncated data, bad compression stream, ...
        raise ImageError(f"cannot decode image data (corrupt or truncated): {e}", param=_PARAM) from None
    return img


def _apply_exif_orientation(img: Image.Image, *, owned: bool) -> Image.Image:
    """Rotate/flip per the EXIF Orientation tag, like transformers' `load_image` and browsers.

    owned: the image was decoded here, so it may be transposed in place (saves a full copy);
    a caller's PIL image is never mutated.
    """
    try:
        if owned:
            ImageOps.exif_transpose(img, in_place=True)
            return img
        return ImageOps.exif_transpose(img)
    except Exception:
        # Broken EXIF is common in the wild and the pixels are fine: show them unrotated
        # (what browsers do) rather than refusing the image.
        return img


def _is_plain_rgb(img: Image.Image) -> bool:
    """Already what to_rgb would return (an RGB image with a tRNS colour key is not)."""
    return img.mode == "RGB" and img.info.get("transparency") is None


def to_rgb(img: Image.Image) -> Image.Image:
    """transformers' `convert_to_rgb` for PIL images: transparency composited on white, else convert.

    Transparency = an alpha band (RGBA, LA, PA, ...) or a `transparency` entry (P/L/RGB with tRNS).
    """
    has_alpha = "A" in img.getbands() or img.info.get("transparency") is not None
    if has_alpha:
        rgba = img.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    return img.convert("RGB")


def _finish(img: Image.Image, limits: ImageLimits, *, owned: bool) -> Image.Image:
    """Limits -> frame 0 -> EXIF orientation -> RGB (always a new, detached image)."""
    _check_dimensions(img.size, limits)
    img = _decode_first_frame(img)
    img = _apply_exif_orientation(img, owned=owned)
    try:
        rgb = to_rgb(img)
    except (MemoryError, ImageError):
        raise
    except Exception as e:  # modes Pillow cannot convert (e.g. exotic TIFF sample formats)
        raise ImageError(f"cannot convert image of mode {img.mode!r} to RGB: {e}", param=_PARAM) from None
    return rgb


def load_image(source: ImageSource, limits: ImageLimits = ImageLimits()) -> Image.Image:
    """Decode and validate one image -> PIL image of mode "RGB", size (W, H) after EXIF rotation.

    source: bytes/bytearray/memoryview (encoded file), PIL.Image.Image, local path (str/PathLike)
    or a `data:image/...;base64,...` string.
    Raises ImageError (empty, corrupt, truncated, unsupported format, zero size) or
    ImageTooLargeError (over limits.max_bytes or limits.max_pixels, or Pillow's bomb guard).
    """
    if isinstance(source, Image.Image):
        return _finish(source, limits, owned=False)
    return _finish(_open(_source_bytes(source, limits), limits), limits, owned=True)


def pixel_hash(img: Image.Image) -> str:
    """sha256 hex of (width, height, RGB bytes): same decoded pixels -> same hash, whatever the file."""
    rgb = img if _is_plain_rgb(img) else to_rgb(img)
    h = hashlib.sha256(b"mmjax.rgb8\0")  # domain tag: never collides with a hash of raw file bytes
    h.update(struct.pack("<II", rgb.width, rgb.height))
    h.update(rgb.tobytes())
    return h.hexdigest()


# --------------------------------------------------------------------------------------------
# Shared pixel arithmetic (exactly transformers' PilBackend)
# --------------------------------------------------------------------------------------------

def _resample(value: Any, default: int = Image.Resampling.BICUBIC) -> int:
    """Config `resample` (PIL filter id, 0-5) -> int; None -> the processor's class default."""
    if value is None:
        return int(default)
    try:
        return int(Image.Resampling(int(value)))
    except (TypeError, ValueError):
        raise UnsupportedModelError(f"image processor resample={value!r} is not a PIL filter id (0-5)",
                                    param="resample") from None


def _channel_triple(value: Any, default: tuple[float, ...], name: str) -> tuple[float, float, float]:
    """image_mean/image_std: a float (all channels) or 3 floats."""
    if value is None:
        value = default
    if isinstance(value, (int, float)):
        value = (value,) * 3
    try:
        value = tuple(float(v) for v in value)
    except (TypeError, ValueError):
        raise UnsupportedModelError(f"image processor {name}={value!r} is not a list of numbers", param=name) from None
    if len(value) != 3:
        raise UnsupportedModelError(f"image processor {name} must have 3 values, got {len(value)}", param=name)
    return value  # type: ignore[return-value]


def _rescale_normalize(pixels: np.ndarray, do_rescale: bool, rescale_factor: float, do_normalize: bool,
                       mean: tuple[float, ...], std: tuple[float, ...]) -> np.ndarray:
    """uint8 [H, W, 3] -> float32 [H, W, 3], the same float ops in the same order as transformers.

    transformers rescales in float64 then casts to float32, then normalizes in float32 with
    float32 mean/std (image_transforms.rescale / normalize). Any other order changes the last bit.
    """
    x = pixels
    if do_rescale:
        x = (x.astype(np.float64) * rescale_factor).astype(np.float32)
    if do_normalize:
        if not np.issubdtype(x.dtype, np.floating):
            x = x.astype(np.float32)
        x = (x - np.asarray(mean, dtype=x.dtype)) / np.asarray(std, dtype=x.dtype)
    return np.ascontiguousarray(x, dtype=np.float32)


def _pil_resize(img: Image.Image, height: int, width: int, resample: int) -> np.ndarray:
    """PIL resize of the uint8 RGB image (what image_transforms.resize does) -> uint8 [H, W, 3]."""
    return np.asarray(img.resize((width, height), resample=resample, reducing_gap=None))


def _as_rgb(img: Image.Image) -> Image.Image:
    """Policy input check: a non-empty PIL image, converted like load_image if it is not RGB yet."""
    if not isinstance(img, Image.Image):
        raise ImageError(f"expected a PIL image, got {type(img).__name__}", param=_PARAM)
    if img.width <= 0 or img.height <= 0:
        raise ImageError(f"image has zero size ({img.width}x{img.height})", param=_PARAM)
    return img if _is_plain_rgb(img) else to_rgb(img)


# --------------------------------------------------------------------------------------------
# CLIP (LLaVA-1.5): resize, optional center crop, rescale, normalize -> fixed [H, W, 3]
# --------------------------------------------------------------------------------------------

# A 1x10000 image resized to shortest_edge=336 would need a 336x3.36M intermediate (HF allocates
# it). Refuse intermediates above this many pixels instead of exhausting host memory.
MAX_RESIZE_PIXELS = 40_000_000

SizeSpec = tuple[tuple[str, int], ...]  # a hashable size dict, items sorted by key
_SIZE_KEY_SETS = ({"height", "width"}, {"shortest_edge"}, {"shortest_edge", "longest_edge"})


def _size_spec(value: Any, *, default_to_square: bool, param: str) -> SizeSpec:
    """transformers' get_size_dict for the size styles a fixed-size encoder can use.

    int -> {"shortest_edge": n} (or a square when default_to_square); [h, w] -> height/width.
    """
    if isinstance(value, bool):
        value = None
    if isinstance(value, int):
        value = {"height": value, "width": value} if default_to_square else {"shortest_edge": value}
    elif isinstance(value, (list, tuple)) and len(value) == 2:
        value = {"height": value[0], "width": value[1]}
    if not isinstance(value, dict):
        raise UnsupportedModelError(f"image processor {param}={value!r} is not a size dict", param=param)
    keys = {k for k, v in value.items() if v is not None}
    if keys not in _SIZE_KEY_SETS:
        raise UnsupportedModelError(
            f"image processor {param} keys {sorted(keys)} unsupported; expected one of "
            f"{[sorted(s) for s in _SIZE_KEY_SETS]}", param=param)
    return tuple(sorted((k, int(value[k])) for k in keys))


def _shortest_edge_size(height: int, width: int, shortest: int) -> tuple[int, int]:
    """image_transforms.get_resize_output_image_size(default_to_square=False): long edge truncated."""
    short, long = (width, height) if width <= height else (height, width)
    new_short, new_long = shortest, int(shortest * long / short)
    return (new_long, new_short) if width <= height else (new_short, new_long)


def _shortest_longest_size(height: int, width: int, size: int, max_size: int) -> tuple[int, int]:
    """image_transforms.get_size_with_aspect_ratio (PilBackend: shortest_edge + longest_edge)."""
    raw_size = None
    min_original, max_original = float(min(height, width)), float(max(height, width))
    if max_original / min_original * size > max_size:
        raw_size = max_size * min_original / max_original
        size = int(round(raw_size))
    if (height <= width and height == size) or (width <= height and width == size):
        return height, width
    if width < height:
        oh = int(raw_size * height / width) if raw_size is not None else int(size * height / width)
        return oh, size
    ow = int(raw_size * width / height) if raw_size is not None else int(size * width / height)
    return size, ow


def _center_crop(pixels: np.ndarray, crop_h: int, crop_w: int) -> np.ndarray:
    """image_transforms.center_crop on [H, W, C]: floor offsets; zero-pads (before rescale) when small."""
    h, w = pixels.shape[:2]
    top, left = (h - crop_h) // 2, (w - crop_w) // 2
    if top >= 0 and left >= 0 and top + crop_h <= h and left + crop_w <= w:
        return pixels[top:top + crop_h, left:left + crop_w]
    new_h, new_w = max(crop_h, h), max(crop_w, w)
    padded = np.zeros((new_h, new_w) + pixels.shape[2:], dtype=pixels.dtype)
    top_pad, left_pad = math.ceil((new_h - h) / 2), math.ceil((new_w - w) / 2)
    padded[top_pad:top_pad + h, left_pad:left_pad + w] = pixels
    top, left = top + top_pad, left + left_pad
    return padded[max(0, top):min(new_h, top + crop_h), max(0, left):min(new_w, left + crop_w)]


@dataclass(frozen=True)
class ClipImagePolicy:
    """transformers CLIPImageProcessor semantics (LLaVA-1.5): fixed-size float32 [H, W, 3] output.

    Steps (each optional): PIL resize (shortest_edge, shortest+longest edge, or exact height/width)
    -> center crop -> rescale -> normalize. Defaults are CLIPImageProcessor's class defaults.
    """

    do_resize: bool = True
    size: SizeSpec = (("shortest_edge", 224),)
    resample: int = int(Image.Resampling.BICUBIC)
    do_center_crop: bool = True
    crop_size: tuple[int, int] = (224, 224)  # (height, width)
    do_rescale: bool = True
    rescale_factor: float = 1 / 255
    do_normalize: bool = True
    image_mean: tuple[float, float, float] = OPENAI_CLIP_MEAN
    image_std: tuple[float, float, float] = OPENAI_CLIP_STD
    do_convert_rgb: bool = True  # informational: inputs are always converted to RGB like load_image

    def __post_init__(self) -> None:
        # An encoder with fixed position embeddings needs one output size; refuse configs that
        # would give a different size per image (shortest_edge without a crop, no resize, ...).
        size = dict(self.size)
        if not self.do_center_crop and not (self.do_resize and set(size) == {"height", "width"}):
            raise UnsupportedModelError(
                "CLIP image processor config gives a per-image output size (needs do_center_crop, or "
                "do_resize with size={'height', 'width'})", param="do_center_crop")

    @classmethod
    def from_config(cls, cfg: dict) -> "ClipImagePolicy":
        """From preprocessor_config.json keys; missing keys take CLIPImageProcessor's defaults."""
        d = cls()
        crop = _size_spec(cfg.get("crop_size") or {"height": 224, "width": 224},
                          default_to_square=True, param="crop_size")
        crop_d = dict(crop)
        if set(crop_d) != {"height", "width"}:
            raise UnsupportedModelError("crop_size must have 'height' and 'width'", param="crop_size")

        def get(key: str, default: Any) -> Any:
            value = cfg.get(key)
            return default if value is None else value

        return cls(
            do_resize=bool(get("do_resize", d.do_resize)),
            size=_size_spec(get("size", dict(d.size)), default_to_square=False, param="size"),
            resample=_resample(cfg.get("resample"), d.resample),
            do_center_crop=bool(get("do_center_crop", d.do_center_crop)),
            crop_size=(crop_d["height"], crop_d["width"]),
            do_rescale=bool(get("do_rescale", d.do_rescale)),
            rescale_factor=float(get("rescale_factor", d.rescale_factor)),
            do_normalize=bool(get("do_normalize", d.do_normalize)),
            image_mean=_channel_triple(cfg.get("image_mean"), d.image_mean, "image_mean"),
            image_std=_channel_triple(cfg.get("image_std"), d.image_std, "image_std"),
            do_convert_rgb=bool(get("do_convert_rgb", d.do_convert_rgb)),
        )

    @property
    def output_size(self) -> tuple[int, int]:
        """(H, W) of every output."""
        if self.do_center_crop:
            return self.crop_size
        size = dict(self.size)
        return size["height"], size["width"]

    def resized_size(self, height: int, width: int) -> tuple[int, int]:
        """(H, W) after the resize step (before the crop), PilBackend.resize's rules."""
        size = dict(self.size)
        if "height" in size:
            return size["height"], size["width"]
        if "longest_edge" in size:
            return _shortest_longest_size(height, width, size["shortest_edge"], size["longest_edge"])
        return _shortest_edge_size(height, width, size["shortest_edge"])

    def __call__(self, img: Image.Image) -> np.ndarray:
        """RGB PIL image -> float32 [H, W, 3] (channels-last) == HF pixel_values[0].transpose(1, 2, 0)."""
        img = _as_rgb(img)
        if self.do_resize:
            rh, rw = self.resized_size(img.height, img.width)
            if rh * rw > MAX_RESIZE_PIXELS:
                raise ImageError(f"image aspect ratio {img.width}x{img.height} is too extreme: resizing it to "
                                 f"{rw}x{rh} would exceed {MAX_RESIZE_PIXELS} pixels", param=_PARAM)
            pixels = _pil_resize(img, rh, rw, self.resample)
        else:
            pixels = np.asarray(img)
        if self.do_center_crop:
            pixels = _center_crop(pixels, *self.crop_size)
        return _rescale_normalize(pixels, self.do_rescale, self.rescale_factor, self.do_normalize,
                                  self.image_mean, self.image_std)

    def cache_key(self) -> tuple:
        """Every parameter that changes the output pixels (do_convert_rgb does not: input is RGB)."""
        return ("clip", self.do_resize, self.size, self.resample, self.do_center_crop, self.crop_size,
                self.do_rescale, self.rescale_factor, self.do_normalize, self.image_mean, self.image_std)


# --------------------------------------------------------------------------------------------
# Qwen2-VL / Qwen2.5-VL: smart_resize to a multiple of patch*merge, then flattened patches
# --------------------------------------------------------------------------------------------

def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """transformers' Qwen2-VL smart_resize, line for line (Python's round() is round-half-even).

    Returns (H, W), both multiples of `factor`, area within [min_pixels, max_pixels], aspect kept.
    """
    if height <= 0 or width <= 0:
        raise ImageError(f"image has zero size ({width}x{height})", param=_PARAM)
    if max(height, width) / min(height, width) > 200:
        raise ImageError(f"image aspect ratio must be at most 200:1, got {width}x{height}", param=_PARAM)
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def _qwen_pixel_bounds(cfg: dict) -> tuple[int | None, int | None]:
    """min/max pixels as Qwen2VLImageProcessor.__init__ resolves them: top-level keys win over size.

    Accepts size={"shortest_edge", "longest_edge"} (v5 saves), size={"min_pixels", "max_pixels"}
    (some older hub configs) and top-level min_pixels/max_pixels (original Qwen releases).
    """
    size = cfg.get("size") if isinstance(cfg.get("size"), dict) else {}

    def first(*values: Any) -> Any:
        return next((v for v in values if v is not None), None)

    lo = first(cfg.get("min_pixels"), size.get("shortest_edge"), size.get("min_pixels"))
    hi = first(cfg.get("max_pixels"), size.get("longest_edge"), size.get("max_pixels"))
    return lo, hi


def _patchify(pixels: np.ndarray, patch: int, merge: int, temporal: int) -> np.ndarray:
    """float32 [H, W, C] -> [gh*gw, C*temporal*patch*patch] in Qwen2VLImageProcessorPil.patchify order.

    Rows run over merge blocks (row-major), then the merge x merge patches inside each block; each
    row is (C, t, ph, pw) with the single frame repeated `temporal` times (HF broadcasts it).
    """
    h, w, c = pixels.shape
    gh, gw = h // patch, w // patch
    x = pixels.reshape(gh // merge, merge, patch, gw // merge, merge, patch, c)
    x = x.transpose(0, 3, 1, 4, 6, 2, 5)  # (gh/m, gw/m, mh, mw, C, ph, pw)
    x = np.broadcast_to(x[:, :, :, :, :, None], (*x.shape[:5], temporal, patch, patch))
    return np.ascontiguousarray(x).reshape(gh * gw, c * temporal * patch * patch)


@dataclass(frozen=True)
class Qwen2VLImagePolicy:
    """transformers Qwen2VLImageProcessor semantics (Qwen2-VL and Qwen2.5-VL).

    smart_resize to multiples of patch_size*merge_size within [min_pixels, max_pixels] (per-request
    overrides allowed), PIL resize, rescale, normalize, flatten to patches. Single images: t=1.
    """

    patch_size: int = 14
    temporal_patch_size: int = 2
    merge_size: int = 2
    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280
    do_resize: bool = True
    resample: int = int(Image.Resampling.BICUBIC)
    do_rescale: bool = True
    rescale_factor: float = 1 / 255
    do_normalize: bool = True
    image_mean: tuple[float, float, float] = OPENAI_CLIP_MEAN
    image_std: tuple[float, float, float] = OPENAI_CLIP_STD
    do_convert_rgb: bool = True

    def __post_init__(self) -> None:
        for name in ("patch_size", "temporal_patch_size", "merge_size", "min_pixels", "max_pixels"):
            if int(getattr(self, name)) <= 0:
                raise UnsupportedModelError(f"Qwen2-VL image processor {name} must be positive", param=name)
        if self.min_pixels > self.max_pixels:
            raise UnsupportedModelError(
                f"Qwen2-VL image processor min_pixels={self.min_pixels} > max_pixels={self.max_pixels}",
                param="min_pixels")

    @classmethod
    def from_config(cls, cfg: dict) -> "Qwen2VLImagePolicy":
        """From preprocessor_config.json keys; missing keys take Qwen2VLImageProcessor's defaults."""
        d = cls()
        lo, hi = _qwen_pixel_bounds(cfg)

        def get(key: str, default: Any) -> Any:
            value = cfg.get(key)
            return default if value is None else value

        return cls(
            patch_size=int(get("patch_size", d.patch_size)),
            temporal_patch_size=int(get("temporal_patch_size", d.temporal_patch_size)),
            merge_size=int(get("merge_size", d.merge_size)),
            min_pixels=int(d.min_pixels if lo is None else lo),
            max_pixels=int(d.max_pixels if hi is None else hi),
            do_resize=bool(get("do_resize", d.do_resize)),
            resample=_resample(cfg.get("resample"), d.resample),
            do_rescale=bool(get("do_rescale", d.do_rescale)),
            rescale_factor=float(get("rescale_factor", d.rescale_factor)),
            do_normalize=bool(get("do_normalize", d.do_normalize)),
            image_mean=_channel_triple(cfg.get("image_mean"), d.image_mean, "image_mean"),
            image_std=_channel_triple(cfg.get("image_std"), d.image_std, "image_std"),
            do_convert_rgb=bool(get("do_convert_rgb", d.do_convert_rgb)),
        )

    @property
    def factor(self) -> int:
        """Side multiple of every resized image: one merged LLM token covers factor x factor pixels."""
        return self.patch_size * self.merge_size

    def _bounds(self, min_pixels: int | None, max_pixels: int | None) -> tuple[int, int]:
        """Per-request min/max pixels (None -> the config's), validated as user input."""
        lo = self.min_pixels if min_pixels is None else min_pixels
        hi = self.max_pixels if max_pixels is None else max_pixels
        for name, value in (("min_pixels", lo), ("max_pixels", hi)):
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value <= 0:
                raise InvalidRequestError(f"{name} must be a positive integer, got {value!r}", param=name)
        if lo > hi:
            raise InvalidRequestError(f"min_pixels ({lo}) must not exceed max_pixels ({hi})", param="min_pixels")
        return int(lo), int(hi)

    def resized_size(self, height: int, width: int, *, min_pixels: int | None = None,
                     max_pixels: int | None = None) -> tuple[int, int]:
        """(H, W) the image is resized to: HF's smart_resize (or the input size when do_resize=False)."""
        lo, hi = self._bounds(min_pixels, max_pixels)
        if not self.do_resize:
            if height % self.factor or width % self.factor:
                raise ImageError(f"with do_resize=False the image sides must be multiples of {self.factor}, "
                                 f"got {width}x{height}", param=_PARAM)
            return height, width
        return smart_resize(height, width, self.factor, lo, hi)

    def grid_thw(self, height: int, width: int, *, min_pixels: int | None = None,
                 max_pixels: int | None = None) -> tuple[int, int, int]:
        """image_grid_thw (1, gh, gw) in vision patches, for an input of the given size."""
        rh, rw = self.resized_size(height, width, min_pixels=min_pixels, max_pixels=max_pixels)
        return 1, rh // self.patch_size, rw // self.patch_size

    def num_tokens(self, height: int, width: int, *, min_pixels: int | None = None,
                   max_pixels: int | None = None) -> int:
        """LLM image tokens = gh * gw / merge_size**2, known before the vision tower runs."""
        _, gh, gw = self.grid_thw(height, width, min_pixels=min_pixels, max_pixels=max_pixels)
        return gh * gw // self.merge_size ** 2

    def __call__(self, img: Image.Image, *, min_pixels: int | None = None,
                 max_pixels: int | None = None) -> tuple[np.ndarray, tuple[int, int, int]]:
        """RGB PIL image -> (patches float32 [gh*gw, 3*temporal*patch*patch], grid_thw (1, gh, gw)).

        Same values and row order as Qwen2VLImageProcessorPil's pixel_values for a single image.
        """
        img = _as_rgb(img)
        rh, rw = self.resized_size(img.height, img.width, min_pixels=min_pixels, max_pixels=max_pixels)
        # HF resizes even when the size is unchanged (PIL then returns an identical copy).
        pixels = _pil_resize(img, rh, rw, self.resample) if self.do_resize else np.asarray(img)
        pixels = _rescale_normalize(pixels, self.do_rescale, self.rescale_factor, self.do_normalize,
                                    self.image_mean, self.image_std)
        patches = _patchify(pixels, self.patch_size, self.merge_size, self.temporal_patch_size)
        return patches, (1, rh // self.patch_size, rw // self.patch_size)

    def cache_key(self, *, min_pixels: int | None = None, max_pixels: int | None = None) -> tuple:
        """Every parameter that changes the output (effective min/max pixels included)."""
        lo, hi = self._bounds(min_pixels, max_pixels)
        return ("qwen2_vl", self.patch_size, self.temporal_patch_size, self.merge_size, lo, hi,
                self.do_resize, self.resample, self.do_rescale, self.rescale_factor, self.do_normalize,
                self.image_mean, self.image_std)


# --------------------------------------------------------------------------------------------
# Config discovery and dispatch
# --------------------------------------------------------------------------------------------

def _read_json(path: Path) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"cannot read {path}: {e}") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path} does not hold a JSON object")
    return data


def find_image_processor_config(model_dir: str | os.PathLike) -> dict:
    """The image processor config dict of a checkpoint directory.

    Same priority as transformers' ImageProcessingMixin.get_image_processor_dict:
    processor_config.json["image_processor"] (what transformers v5 writes for processors such as
    LLaVA's) first, then preprocessor_config.json (standalone image processors, older checkpoints).
    """
    model_dir = Path(model_dir)
    processor_file = model_dir / "processor_config.json"
    if processor_file.is_file():
        nested = _read_json(processor_file).get("image_processor")
        if isinstance(nested, dict):
            return nested
    preprocessor_file = model_dir / "preprocessor_config.json"
    if preprocessor_file.is_file():
        return _read_json(preprocessor_file)
    raise CheckpointError(f"no image processor config in {model_dir}: expected preprocessor_config.json or "
                          "processor_config.json with an 'image_processor' entry")


_POLICIES: dict[str, type] = {
    "CLIPImageProcessor": ClipImagePolicy,
    "Qwen2VLImageProcessor": Qwen2VLImagePolicy,
}


def load_policy(cfg: dict) -> ClipImagePolicy | Qwen2VLImagePolicy:
    """Image policy for an image processor config, dispatched on cfg["image_processor_type"].

    The backend suffixes (`...Pil`, `...Fast`) name the same preprocessing and are accepted.
    """
    kind = cfg.get("image_processor_type") if isinstance(cfg, dict) else None
    if not isinstance(kind, str):
        raise UnsupportedModelError("image processor config has no 'image_processor_type'",
                                    param="image_processor_type")
    base = kind
    for suffix in ("Pil", "Fast"):
        if base.endswith(suffix):
            base = base[: -len(suffix)]
    if base not in _POLICIES:
        raise UnsupportedModelError(
            f"unsupported image_processor_type {kind!r} (supported: {', '.join(sorted(_POLICIES))})",
            param="image_processor_type")
    return _POLICIES[base].from_config(cfg)
