"""Port of transformers' Idefics3ImageProcessor / SmolVLMImageProcessor (Pil backend): resize so
the longest edge is `size.longest_edge` (aspect kept, the short side rounded up to even), then,
with image splitting, resize up to multiples of `max_image_size` and cut into a rows x cols grid
of `max_image_size` tiles plus the global image (the resized image squashed to one tile);
without splitting, the image squashed to one tile. Every view is `max_image_size` square, so the
processor's padding and pixel attention mask are all ones and are not produced here.
Bit-for-bit like `Idefics3ImageProcessorPil` (PIL resizes on uint8, float64 rescale then
float32 normalize)."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
from PIL import Image

from mmjax.errors import ImageError, UnsupportedModelError
from mmjax.image.decode import PARAM as _PARAM
from mmjax.image.geometry import Frame
from mmjax.image.processors import (MAX_RESIZE_PIXELS, _as_rgb, _channel_triple, _pil_resize, _resample,
                                    _rescale_normalize)

IMAGENET_STANDARD = (0.5, 0.5, 0.5)
MAX_IMAGE_SIZE = 4096   # the processor's absolute cap on the resized longest edge


def _longest_edge(value: Any, name: str, default: int) -> int:
    """{"longest_edge": n} (the only size style these processors use) -> n."""
    if value is None:
        return default
    if not isinstance(value, dict) or set(k for k, v in value.items() if v is not None) != {"longest_edge"}:
        raise UnsupportedModelError(f"image processor {name}={value!r}: only {{'longest_edge': n}} is supported",
                                    param=name)
    n = value["longest_edge"]
    if isinstance(n, bool) or not isinstance(n, int) or n <= 0:
        raise UnsupportedModelError(f"image processor {name}.longest_edge must be a positive integer", param=name)
    return n


def rescale_to_max_len(height: int, width: int, max_len: int) -> tuple[int, int]:
    """The processor's `_resize_output_size_rescale_to_max_len` + `_scale_below_upper_bound`:
    the longest edge becomes max_len, the other follows the aspect ratio (truncated, rounded up
    to even), then both are capped at MAX_IMAGE_SIZE."""
    aspect = width / height
    if width >= height:
        width = max_len
        height = int(width / aspect)
        if height % 2:
            height += 1
    else:
        height = max_len
        width = int(height * aspect)
        if width % 2:
            width += 1
    height, width = max(height, 1), max(width, 1)
    aspect = width / height
    if width >= height and width > MAX_IMAGE_SIZE:
        width, height = MAX_IMAGE_SIZE, int(MAX_IMAGE_SIZE / aspect)
    elif height > width and height > MAX_IMAGE_SIZE:
        height, width = MAX_IMAGE_SIZE, int(MAX_IMAGE_SIZE * aspect)
    return max(height, 1), max(width, 1)


def tile_multiple_size(height: int, width: int, tile: int) -> tuple[int, int]:
    """`resize_for_vision_encoder`: both sides rounded up to multiples of the tile size."""
    aspect = width / height
    if width >= height:
        width = math.ceil(width / tile) * tile
        height = int(width / aspect)
        height = math.ceil(height / tile) * tile
    else:
        height = math.ceil(height / tile) * tile
        width = int(height * aspect)
        width = math.ceil(width / tile) * tile
    return height, width


@dataclass(frozen=True)
class Idefics3ImagePolicy:
    """RGB PIL image -> (views [n, tile, tile, 3] float32, rows, cols): the tiles row-major, then
    the global image; rows = cols = 0 (one view) when the image is not split."""
    longest_edge: int = 4 * 364
    tile: int = 364
    do_resize: bool = True
    resample: int = int(Image.Resampling.LANCZOS)
    do_rescale: bool = True
    rescale_factor: float = 1 / 255
    do_normalize: bool = True
    image_mean: tuple[float, float, float] = IMAGENET_STANDARD
    image_std: tuple[float, float, float] = IMAGENET_STANDARD
    do_image_splitting: bool = True

    @classmethod
    def from_config(cls, cfg: dict) -> "Idefics3ImagePolicy":
        d = cls()

        def get(key: str, default: Any) -> Any:
            value = cfg.get(key)
            return default if value is None else value

        return cls(longest_edge=_longest_edge(cfg.get("size"), "size", d.longest_edge),
                   tile=_longest_edge(cfg.get("max_image_size"), "max_image_size", d.tile),
                   do_resize=bool(get("do_resize", True)), resample=_resample(cfg.get("resample"), d.resample),
                   do_rescale=bool(get("do_rescale", True)), rescale_factor=float(get("rescale_factor", 1 / 255)),
                   do_normalize=bool(get("do_normalize", True)),
                   image_mean=_channel_triple(cfg.get("image_mean"), IMAGENET_STANDARD, "image_mean"),
                   image_std=_channel_triple(cfg.get("image_std"), IMAGENET_STANDARD, "image_std"),
                   do_image_splitting=bool(get("do_image_splitting", True)))

    def resized_size(self, height: int, width: int, longest_edge: int | None = None) -> tuple[int, int]:
        """(H, W) after the first resize (the input size when do_resize is off)."""
        if not self.do_resize:
            return height, width
        return rescale_to_max_len(height, width, longest_edge or self.longest_edge)

    def grid(self, height: int, width: int, *, split: bool | None = None,
             longest_edge: int | None = None) -> tuple[int, int]:
        """(rows, cols) of tiles for an input of this size; (0, 0): the global image alone.
        split: image splitting on/off (None: the checkpoint's); longest_edge: the first resize's
        target (None: the checkpoint's `size`)."""
        if not (self.do_image_splitting if split is None else split):
            return 0, 0
        h, w = tile_multiple_size(*self.resized_size(height, width, longest_edge), self.tile)
        if h > self.tile or w > self.tile:
            return (h - self.tile) // self.tile + 1, (w - self.tile) // self.tile + 1
        return 0, 0

    def frames(self, height: int, width: int, rows: int, cols: int) -> list[Frame]:
        """Where each view (`__call__`'s order) lies on a height x width image cut into rows x
        cols tiles (0, 0: one view): the tiles of the image resized to rows x cols tiles (its
        two resizes compose into one), then the global image (the whole image, one tile)."""
        src, t = Frame.of(height, width), self.tile
        if not rows:
            return [src.resize(t, t)]
        canvas = src.resize(rows * t, cols * t)
        return [canvas.crop(r * t, c * t, t, t) for r in range(rows) for c in range(cols)] + [src.resize(t, t)]

    def __call__(self, img: Image.Image, *, split: bool | None = None,
                 longest_edge: int | None = None) -> tuple[np.ndarray, int, int]:
        """(views [rows*cols + 1 or 1, tile, tile, 3], rows, cols) == HF's pixel_values for this
        image (channels last), in the same order."""
        img = _as_rgb(img)
        split = self.do_image_splitting if split is None else split
        pil = img
        if self.do_resize:
            h, w = self.resized_size(img.height, img.width, longest_edge)
            if h * w > MAX_RESIZE_PIXELS:
                raise ImageError(f"image {img.width}x{img.height} is too large to resize to {w}x{h}", param=_PARAM)
            pil = Image.fromarray(_pil_resize(img, h, w, self.resample))
        rows = cols = 0
        if split:
            h, w = tile_multiple_size(pil.height, pil.width, self.tile)
            arr = _pil_resize(pil, h, w, self.resample)
            t = self.tile
            if h > t or w > t:
                rows, cols = (h - t) // t + 1, (w - t) // t + 1
                views = [arr[r * t:(r + 1) * t, c * t:(c + 1) * t] for r in range(rows) for c in range(cols)]
                views.append(_pil_resize(Image.fromarray(arr), t, t, self.resample))
            else:
                views = [arr]
        else:
            views = [_pil_resize(pil, self.tile, self.tile, self.resample)]
        out = np.stack([_rescale_normalize(v, self.do_rescale, self.rescale_factor, self.do_normalize,
                                           self.image_mean, self.image_std) for v in views])
        return out, rows, cols

    def cache_key(self, *, split: bool | None = None, longest_edge: int | None = None) -> tuple:
        """Every parameter that changes the output pixels (the effective split and longest edge)."""
        return ("idefics3", longest_edge or self.longest_edge, self.tile, self.do_resize, self.resample,
                self.do_rescale, self.rescale_factor, self.do_normalize, self.image_mean, self.image_std,
                self.do_image_splitting if split is None else split)
