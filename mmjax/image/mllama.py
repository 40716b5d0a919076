"""Port of transformers' MllamaImageProcessor (Pil backend): the image is fitted into the best
canvas of up to `max_image_tiles` square tiles (an arrangement of rows x cols tiles), resized
with its aspect ratio kept, zero-padded (uint8, before rescale/normalize) to the canvas, then
split into tiles row-major. Output: [max_image_tiles, tile, tile, 3] float32 (absent tiles are
zeros, as HF's batch packing), the aspect-ratio id (1-based index of (rows, cols) in
`supported_aspect_ratios`) and the tile count, bit-for-bit like `MllamaImageProcessorPil`."""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import numpy as np
from PIL import Image

from mmjax.errors import UnsupportedModelError
from mmjax.image.geometry import Frame
from mmjax.image.processors import _as_rgb, _channel_triple, _pil_resize, _resample, _rescale_normalize

IMAGENET_STANDARD = (0.5, 0.5, 0.5)


@lru_cache(maxsize=16)
def supported_aspect_ratios(max_image_tiles: int) -> tuple[tuple[int, int], ...]:
    """Every (a, b) with a * b <= max_image_tiles, a major (HF's get_all_supported_aspect_ratios)."""
    return tuple((a, b) for a in range(1, max_image_tiles + 1) for b in range(1, max_image_tiles + 1)
                 if a * b <= max_image_tiles)


@lru_cache(maxsize=1024)
def optimal_canvas(height: int, width: int, max_image_tiles: int, tile: int) -> tuple[int, int]:
    """(canvas height, canvas width): HF's get_optimal_tiled_canvas (smallest upscale >= 1, else
    the largest downscale; ties -> smallest area)."""
    sizes = np.array(supported_aspect_ratios(max_image_tiles)) * tile
    th, tw = sizes.T
    sh, sw = th / height, tw / width
    scales = np.where(sw > sh, sh, sw)
    up = scales[scales >= 1]
    chosen = sizes[scales == (np.min(up) if len(up) else np.max(scales[scales < 1]))]
    best = chosen[np.argmin(chosen[:, 0] * chosen[:, 1])] if len(chosen) > 1 else chosen[0]
    return int(best[0]), int(best[1])


def fit_to_canvas(height: int, width: int, canvas_h: int, canvas_w: int, tile: int) -> tuple[int, int]:
    """HF's get_image_size_fit_to_canvas: the resized (height, width)."""
    tw, th = int(np.clip(width, tile, canvas_w)), int(np.clip(height, tile, canvas_h))
    sh, sw = th / height, tw / width
    if sw < sh:
        return min(math.floor(height * sw) or 1, th), tw
    return th, min(math.floor(width * sh) or 1, tw)


@dataclass(frozen=True)
class MllamaImagePolicy:
    tile: int = 224
    max_image_tiles: int = 4
    resample: int = int(Image.Resampling.BILINEAR)
    do_rescale: bool = True
    rescale_factor: float = 1 / 255
    do_normalize: bool = True
    image_mean: tuple[float, float, float] = IMAGENET_STANDARD
    image_std: tuple[float, float, float] = IMAGENET_STANDARD

    @classmethod
    def from_config(cls, cfg: dict) -> "MllamaImagePolicy":
        d = cls()

        def get(key: str, default: Any) -> Any:
            v = cfg.get(key)
            return default if v is None else v

        size = get("size", {"height": 224, "width": 224})
        if not isinstance(size, dict) or not size.get("height") or size.get("height") != size.get("width"):
            raise UnsupportedModelError(f"Mllama image processor size={size!r} must be a square height/width",
                                        param="size")
        if not get("do_resize", True) or not get("do_pad", True):
            raise UnsupportedModelError("Mllama image processor needs do_resize and do_pad", param="do_resize")
        return cls(tile=int(size["height"]), max_image_tiles=int(get("max_image_tiles", 4)),
                   resample=_resample(cfg.get("resample"), d.resample), do_rescale=bool(get("do_rescale", True)),
                   rescale_factor=float(get("rescale_factor", 1 / 255)), do_normalize=bool(get("do_normalize", True)),
                   image_mean=_channel_triple(cfg.get("image_mean"), d.image_mean, "image_mean"),
                   image_std=_channel_triple(cfg.get("image_std"), d.image_std, "image_std"))

    def arrangement(self, height: int, width: int) -> tuple[int, int]:
        """(tile rows, tile cols) for an image of this size."""
        ch, cw = optimal_canvas(height, width, self.max_image_tiles, self.tile)
        return ch // self.tile, cw // self.tile

    def aspect_ratio_id(self, rows: int, cols: int) -> int:
        return supported_aspect_ratios(self.max_image_tiles).index((rows, cols)) + 1

    def frames(self, height: int, width: int) -> list[Frame]:
        """Where each real tile lies on a height x width image (the image resized into the top
        left of its canvas, the rest padding; tiles row-major)."""
        ch, cw = optimal_canvas(height, width, self.max_image_tiles, self.tile)
        nh, nw = fit_to_canvas(height, width, ch, cw, self.tile)
        canvas = Frame.of(height, width).resize(nh, nw).pad(0, 0, ch, cw)
        t = self.tile
        return [canvas.crop(r, c, t, t) for r in range(0, ch, t) for c in range(0, cw, t)]

    def __call__(self, img: Image.Image) -> tuple[np.ndarray, int, int]:
        """RGB PIL image -> (tiles [max_image_tiles, tile, tile, 3] float32, aspect-ratio id,
        number of real tiles)."""
        img = _as_rgb(img)
        ch, cw = optimal_canvas(img.height, img.width, self.max_image_tiles, self.tile)
        rows, cols = ch // self.tile, cw // self.tile
        nh, nw = fit_to_canvas(img.height, img.width, ch, cw, self.tile)
        canvas = np.zeros((ch, cw, 3), np.uint8)
        canvas[:nh, :nw] = _pil_resize(img, nh, nw, self.resample)
        x = _rescale_normalize(canvas, self.do_rescale, self.rescale_factor, self.do_normalize,
                               self.image_mean, self.image_std)
        t = self.tile
        tiles = x.reshape(rows, t, cols, t, 3).transpose(0, 2, 1, 3, 4).reshape(rows * cols, t, t, 3)
        out = np.zeros((self.max_image_tiles, t, t, 3), np.float32)
        out[:rows * cols] = tiles
        return out, self.aspect_ratio_id(rows, cols), rows * cols

    def cache_key(self) -> tuple:
        return ("mllama", self.tile, self.max_image_tiles, self.resample, self.do_rescale, self.rescale_factor,
                self.do_normalize, self.image_mean, self.image_std)
