"""Ports of Hugging Face image processors: a decoded RGB image -> the float32 pixels a vision tower
eats, bit-for-bit like the transformers *Pil image processors* (`CLIPImageProcessorPil`,
`Qwen2VLImageProcessorPil`): same PIL resize on uint8 images, same output-size rounding, same
float64-rescale-then-float32 arithmetic, same patch order.

Host code only (numpy + Pillow). transformers is a test-only dependency: the rules are
reimplemented here, not imported. Untrusted bytes are decoded before this, in `mmjax.image.decode`.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from mmjax.errors import CheckpointError, ImageError, InvalidRequestError, UnsupportedModelError
from mmjax.image.decode import PARAM as _PARAM, is_plain_rgb as _is_plain_rgb, to_rgb
from mmjax.image.geometry import Frame

__all__ = ["ClipImagePolicy", "Qwen2VLImagePolicy", "find_image_processor_config", "load_policy", "smart_resize"]

# Same constants as transformers.utils.constants (OPENAI_CLIP_MEAN / OPENAI_CLIP_STD).
OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


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

    def frame(self, source: Frame) -> Frame:
        """Where the output lies on the input (`source`: the input's own frame): the resize,
        then the center crop (a crop larger than the image pads it)."""
        f = source.resize(*self.resized_size(source.height, source.width)) if self.do_resize else source
        if self.do_center_crop:
            ch, cw = self.crop_size
            f = f.crop((f.height - ch) // 2, (f.width - cw) // 2, ch, cw)   # _center_crop's offsets
        return f

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

def frames_smart_resize(num_frames: int, height: int, width: int, *, temporal_factor: int, factor: int,
                        min_pixels: int, max_pixels: int, error=ImageError, param: str = "images",
                        subject: str = "image") -> tuple[int, int]:
    """The smart_resize of frame stacks (transformers' glm4v and video_processing_qwen3_vl, line for
    line; Python's round() is round-half-even): sides under one factor are scaled up first, and the
    pixel bounds apply to t_bar * h * w. Bad sizes raise `error(..., param=param)` naming `subject`."""
    if height <= 0 or width <= 0:
        raise error(f"{subject} of zero size ({width}x{height})", param=param)
    if height < factor or width < factor:
        scale = max(factor / height, factor / width)
        height, width = int(height * scale), int(width * scale)
    if max(height, width) / min(height, width) > 200:
        raise error(f"{subject} of {width}x{height}: aspect ratio must be at most 200:1", param=param)
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    t_bar = round(num_frames / temporal_factor) * temporal_factor
    if t_bar * h_bar * w_bar > max_pixels:
        beta = math.sqrt((num_frames * height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif t_bar * h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (num_frames * height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


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


def patchify(pixels: np.ndarray, patch: int, merge: int, temporal: int) -> np.ndarray:
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
        patches = patchify(pixels, self.patch_size, self.merge_size, self.temporal_patch_size)
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

def digest(cache_key: tuple) -> str:
    """A stable digest of a policy's `cache_key()` for encoder-cache keys. Not hash(): images are
    prepared in spawned decode processes, whose str hashes differ (PYTHONHASHSEED), and a key
    must be the same whichever process made it."""
    return hashlib.sha256(repr(cache_key).encode()).hexdigest()[:16]


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
