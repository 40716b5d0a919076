"""Port of transformers' GotOcr2ImageProcessor (Pil backend) as InternVLProcessor drives it, and of
InternVLVideoProcessor's frame sampling and resize.

Images (`InternVLImagePolicy`): with `crop_to_patches` (InternVLProcessor turns it on whatever the
image processor config says) and `max_patches` > 1, the tile grid (cols, rows) is the arrangement
of min_patches..max_patches tiles whose aspect ratio is closest to the image's (ties go to the
larger grid while the image covers more than half of it: `optimal_grid`); the image is resized to
cols x rows tiles of `size` and cut row-major, then, when there is more than one tile, the whole
image resized to one tile (the thumbnail) follows. Otherwise the image is resized to one tile.
Bit-for-bit like `GotOcr2ImageProcessorPil` (PIL resizes on uint8, float64 rescale then float32
normalize).

Videos (`InternVLVideoPolicy`): each sampled frame becomes one tile: torchvision's uint8 bicubic
antialiased resize to `size` (`mmjax.video.resample`), then the fused rescale + normalize of the
torchvision backend. Frames are sampled like `InternVLVideoProcessor.sample_frames`
(`num_frames`, or `fps` frames a second, from an initial shift of half a step).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import numpy as np
from PIL import Image

from mmjax.errors import InvalidRequestError, UnsupportedModelError
from mmjax.image.geometry import Frame
from mmjax.image.processors import (OPENAI_CLIP_MEAN, OPENAI_CLIP_STD, _as_rgb, _channel_triple, _pil_resize,
                                    _resample, _rescale_normalize)
from mmjax.video.resample import resize_bicubic_aa

# frames taken from a video when neither the request nor the checkpoint's video processor asks for
# a number or a rate (transformers then keeps every decoded frame; InternVL's model cards sample 8)
DEFAULT_NUM_FRAMES = 8


def _square_size(value: Any, default: int) -> int:
    """{"height": n, "width": n} -> n (the processors' tiles are square)."""
    if value is None:
        return default
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, dict) and value.get("height") == value.get("width") and isinstance(value.get("height"), int):
        return int(value["height"])
    raise UnsupportedModelError(f"image processor size={value!r}: only square {{'height': n, 'width': n}} tiles "
                                "are supported", param="size")


@lru_cache(maxsize=64)
def _arrangements(min_tiles: int, max_tiles: int) -> tuple[tuple[int, int], ...]:
    """get_all_supported_aspect_ratios: every (cols, rows) with min <= cols * rows <= max, by tile count."""
    grids = [(w, h) for w in range(1, max_tiles + 1) for h in range(1, max_tiles + 1)
             if min_tiles <= w * h <= max_tiles]
    return tuple(sorted(grids, key=lambda g: g[0] * g[1]))


def optimal_grid(height: int, width: int, tile: int, min_tiles: int, max_tiles: int) -> tuple[int, int]:
    """get_optimal_tiled_canvas: (cols, rows) of the closest aspect ratio (see the module docstring)."""
    aspect, area = width / height, width * height
    best, best_diff = (1, 1), float("inf")
    for grid in _arrangements(min_tiles, max_tiles):
        diff = abs(aspect - grid[0] / grid[1])
        if diff < best_diff:
            best, best_diff = grid, diff
        elif diff == best_diff and area > 0.5 * tile * tile * grid[0] * grid[1]:
            best = grid
    return best


@dataclass(frozen=True)
class InternVLImagePolicy:
    """RGB PIL image -> (views [n, tile, tile, 3] float32, cols, rows): the tiles row-major, then the
    thumbnail; (1, 1) and one view when the image is not cut."""
    tile: int = 448
    min_patches: int = 1
    max_patches: int = 12
    crop_to_patches: bool = True
    resample: int = int(Image.Resampling.BICUBIC)
    do_rescale: bool = True
    rescale_factor: float = 1 / 255
    do_normalize: bool = True
    image_mean: tuple[float, float, float] = OPENAI_CLIP_MEAN
    image_std: tuple[float, float, float] = OPENAI_CLIP_STD

    @classmethod
    def from_config(cls, cfg: dict, crop_to_patches: bool = True) -> "InternVLImagePolicy":
        """preprocessor_config.json keys (GotOcr2ImageProcessor's defaults where missing);
        crop_to_patches: the processor's setting (InternVLProcessor: on)."""
        d = cls()

        def get(key: str, default: Any) -> Any:
            value = cfg.get(key)
            return default if value is None else value
        if not bool(get("do_resize", True)):
            raise UnsupportedModelError("image processor do_resize=false: InternViT needs fixed-size tiles",
                                        param="do_resize")
        lo, hi = int(get("min_patches", d.min_patches)), int(get("max_patches", d.max_patches))
        if lo < 1 or hi < 1:
            raise UnsupportedModelError(f"image processor min_patches={lo} / max_patches={hi} must be positive",
                                        param="max_patches")
        return cls(tile=_square_size(cfg.get("size"), d.tile), min_patches=lo, max_patches=hi,
                   crop_to_patches=crop_to_patches, resample=_resample(cfg.get("resample"), d.resample),
                   do_rescale=bool(get("do_rescale", True)), rescale_factor=float(get("rescale_factor", 1 / 255)),
                   do_normalize=bool(get("do_normalize", True)),
                   image_mean=_channel_triple(cfg.get("image_mean"), OPENAI_CLIP_MEAN, "image_mean"),
                   image_std=_channel_triple(cfg.get("image_std"), OPENAI_CLIP_STD, "image_std"))

    def patches(self, max_tiles: int | None = None) -> int:
        """The processor's max_patches for an image capped at `max_tiles` tiles (None: the checkpoint's)."""
        return self.max_patches if max_tiles is None else min(self.max_patches, max_tiles)

    def grid(self, height: int, width: int, max_patches: int | None = None) -> tuple[int, int]:
        """(cols, rows) of tiles for an image of this size; (1, 1): one view, no thumbnail."""
        hi = self.max_patches if max_patches is None else max_patches
        if not self.crop_to_patches or hi <= 1:
            return 1, 1
        return optimal_grid(height, width, self.tile, self.min_patches, hi)

    @staticmethod
    def views(cols: int, rows: int) -> int:
        """Views of a cols x rows grid: the tiles plus the thumbnail, or the one resized image."""
        return 1 if cols * rows == 1 else cols * rows + 1

    def frames(self, height: int, width: int, cols: int, rows: int) -> list[Frame]:
        """Where each view (`__call__`'s order) lies on the height x width image."""
        src, t = Frame.of(height, width), self.tile
        if cols * rows == 1:
            return [src.resize(t, t)]
        canvas = src.resize(rows * t, cols * t)
        return [canvas.crop(r * t, c * t, t, t) for r in range(rows) for c in range(cols)] + [src.resize(t, t)]

    def __call__(self, img: Image.Image, max_patches: int | None = None) -> tuple[np.ndarray, int, int]:
        """(views [n, tile, tile, 3], cols, rows) == HF's pixel_values for this image (channels last)."""
        img = _as_rgb(img)
        cols, rows = self.grid(img.height, img.width, max_patches)
        t = self.tile
        if cols * rows == 1:
            views = [_pil_resize(img, t, t, self.resample)]
        else:
            arr = _pil_resize(img, rows * t, cols * t, self.resample)
            views = [arr[r * t:(r + 1) * t, c * t:(c + 1) * t] for r in range(rows) for c in range(cols)]
            views.append(_pil_resize(img, t, t, self.resample))
        out = np.stack([_rescale_normalize(v, self.do_rescale, self.rescale_factor, self.do_normalize,
                                           self.image_mean, self.image_std) for v in views])
        return out, cols, rows

    def cache_key(self, max_patches: int | None = None) -> tuple:
        """Every parameter that changes the output pixels."""
        return ("internvl", self.tile, self.min_patches, self.max_patches if max_patches is None else max_patches,
                self.crop_to_patches, self.resample, self.do_rescale, self.rescale_factor, self.do_normalize,
                self.image_mean, self.image_std)


@dataclass(frozen=True)
class InternVLVideoPolicy:
    """InternVLVideoProcessor: frame sampling and one `tile`-square view per frame."""
    tile: int = 448
    num_frames: int | None = None
    fps: float | None = None
    initial_shift: bool | float = True
    do_rescale: bool = True
    rescale_factor: float = 1 / 255
    do_normalize: bool = True
    image_mean: tuple[float, float, float] = OPENAI_CLIP_MEAN
    image_std: tuple[float, float, float] = OPENAI_CLIP_STD

    @classmethod
    def from_config(cls, cfg: dict | None, tile: int) -> "InternVLVideoPolicy":
        """video_preprocessor_config.json (None: the class defaults at the image tile size);
        num_frames / fps apply when the file sets do_sample_frames."""
        cfg = dict(cfg or {})
        if "size" in cfg and _square_size(cfg["size"], tile) != tile:
            raise UnsupportedModelError(f"video processor size={cfg['size']!r} differs from the image tiles "
                                        f"({tile} px)", param="video_preprocessor_config.size")
        sample = bool(cfg.get("do_sample_frames"))
        shift = cfg.get("initial_shift", True)

        def get(key: str, default: Any) -> Any:
            value = cfg.get(key)
            return default if value is None else value
        return cls(tile=tile, num_frames=int(cfg["num_frames"]) if sample and cfg.get("num_frames") else None,
                   fps=float(cfg["fps"]) if sample and cfg.get("fps") else None,
                   initial_shift=shift if isinstance(shift, bool) else float(shift),
                   do_rescale=bool(get("do_rescale", True)), rescale_factor=float(get("rescale_factor", 1 / 255)),
                   do_normalize=bool(get("do_normalize", True)),
                   image_mean=_channel_triple(cfg.get("image_mean"), OPENAI_CLIP_MEAN, "image_mean"),
                   image_std=_channel_triple(cfg.get("image_std"), OPENAI_CLIP_STD, "image_std"))

    def sample_indices(self, total: int, video_fps: float | None, fps: float | None = None) -> tuple[int, ...]:
        """sample_frames: `fps` (the request's, else the checkpoint's) frames a second, or the
        checkpoint's num_frames, or DEFAULT_NUM_FRAMES; at most every frame."""
        fps = fps if fps is not None else (None if self.num_frames else self.fps)
        if fps is not None:
            if not video_fps:
                raise InvalidRequestError("sampling frames by fps needs the video's frame rate", param="fps")
            n = int(total / video_fps * fps)
        else:
            n = self.num_frames or DEFAULT_NUM_FRAMES
        n = max(1, min(n, total))
        shift = total / n / 2 if self.initial_shift is True else float(self.initial_shift or 0)
        step = total / n
        count = max(0, math.ceil((total - shift) / step))
        # torch.arange(shift, total, step).int(): float32 values, truncated
        return tuple(int(i) for i in (shift + np.arange(count, dtype=np.float64) * step).astype(np.float32)
                     .astype(np.int32))

    def __call__(self, frames: np.ndarray) -> np.ndarray:
        """uint8 frames [n, H, W, 3] -> float32 views [n, tile, tile, 3]."""
        x = resize_bicubic_aa(frames, self.tile, self.tile).astype(np.float32)
        if self.do_rescale and self.do_normalize:
            inv = np.float32(1.0 / self.rescale_factor)
            x = (x - np.asarray(self.image_mean, np.float32) * inv) / (np.asarray(self.image_std, np.float32) * inv)
        elif self.do_rescale:
            x = x * np.float32(self.rescale_factor)
        elif self.do_normalize:
            x = (x - np.asarray(self.image_mean, np.float32)) / np.asarray(self.image_std, np.float32)
        return np.ascontiguousarray(x, np.float32)

    def cache_key(self) -> tuple:
        return ("internvl_video", self.tile, self.initial_shift, self.do_rescale, self.rescale_factor,
                self.do_normalize, self.image_mean, self.image_std)
