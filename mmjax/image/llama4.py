"""Port of transformers' Llama4ImageProcessor: the image is fitted into the best canvas of up to
`max_patches` square tiles (every rows x cols arrangement with rows * cols <= max_patches),
resized with its aspect ratio kept (never upscaled past one tile unless `resize_to_max_canvas`),
zero-padded (uint8, bottom / right) to the canvas, rescaled and normalized in bfloat16 (as the
original implementation, which transformers keeps), cut into tiles row-major, and, when there is
more than one tile, followed by the global tile: the whole image resized to one tile (aspect
ratio not kept). Output: [views, tile, tile, 3] float32 holding bfloat16 values.

The resize is torchvision's on uint8 images (`resize_uint8`: torch's antialiased bilinear with
int16 fixed-point weights, one pass per axis, horizontal first), which differs from PIL's
bilinear by one level in some pixels."""
from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import ml_dtypes
import numpy as np
from PIL import Image

from mmjax.errors import UnsupportedModelError
from mmjax.image.geometry import Frame
from mmjax.image.processors import _as_rgb, _channel_triple

BF16 = ml_dtypes.bfloat16


@lru_cache(maxsize=16)
def supported_resolutions(max_patches: int, tile: int) -> tuple[tuple[int, int], ...]:
    """HF's find_supported_resolutions: (height, width) canvases in its order (grouped by aspect
    ratio, in first-seen order from max_patches tiles down)."""
    by_ratio: dict[float, list] = defaultdict(list)
    for n in range(max_patches, 0, -1):
        factors = sorted({f for i in range(1, int(n ** 0.5) + 1) if n % i == 0 for f in (i, n // i)})
        for h in factors:
            by_ratio[h / (n // h)].append((h, n // h))
    return tuple((h * tile, w * tile) for v in by_ratio.values() for h, w in v)


@lru_cache(maxsize=1024)
def best_fit(height: int, width: int, max_patches: int, tile: int, to_max: bool = False) -> tuple[int, int]:
    """HF's get_best_fit: the canvas needing the smallest upscale >= 1 (the largest with
    `to_max`), else the least downscale; ties -> the smallest area (the first)."""
    res = np.array(supported_resolutions(max_patches, tile), np.int64)
    th, tw = res[:, 0], res[:, 1]
    # torch divides int64 tensors by python ints in float32
    sw = tw.astype(np.float32) / np.float32(width)
    sh = th.astype(np.float32) / np.float32(height)
    scales = np.where(sh > sw, sw, sh)
    up = scales[scales >= 1]
    chosen = res[scales == ((up.max() if to_max else up.min()) if len(up) else scales[scales < 1].max())]
    best = chosen[np.argmin(chosen[:, 0] * chosen[:, 1])] if len(chosen) > 1 else chosen[0]
    return int(best[0]), int(best[1])


def max_res_without_distortion(height: int, width: int, th: int, tw: int) -> tuple[int, int]:
    """HF's get_max_res_without_distortion (each side at least 1)."""
    sw, sh = tw / width, th / height
    if sw < sh:
        nh, nw = min(math.floor(height * sw), th), tw
    else:
        nh, nw = th, min(math.floor(width * sh), tw)
    return max(nh, 1), max(nw, 1)


def _aa_weights(n_in: int, n_out: int) -> tuple[np.ndarray, int]:
    """The int16 fixed-point weights [n_out, n_in] of one axis of torch's antialiased bilinear
    (`_compute_index_ranges_int16_weights`: float64 tent weights normalised per output, the
    precision the largest weight allows in int16) and that precision."""
    scale = n_in / n_out
    support = scale if scale >= 1.0 else 1.0
    inv = 1.0 / scale if scale >= 1.0 else 1.0
    w = np.zeros((n_out, n_in), np.float64)
    for i in range(n_out):
        center = scale * (i + 0.5)
        lo = max(int(center - support + 0.5), 0)
        hi = min(int(center + support + 0.5), n_in)
        x = np.abs((np.arange(lo, hi) - center + 0.5) * inv)
        t = np.where(x < 1.0, 1.0 - x, 0.0)
        if t.sum() != 0.0:
            t = t / t.sum()
        w[i, lo:hi] = t
    prec = 0
    while prec < 22 and int(0.5 + w.max() * (1 << (prec + 1))) < (1 << 15):
        prec += 1
    q = np.trunc(np.where(w < 0, -0.5 + w * (1 << prec), 0.5 + w * (1 << prec))).astype(np.int64)
    return q, prec


def _aa_pass(x: np.ndarray, n_out: int, axis: int) -> np.ndarray:
    q, prec = _aa_weights(x.shape[axis], n_out)
    acc = np.tensordot(q, np.moveaxis(x.astype(np.int64), axis, 0), axes=(1, 0)) + (1 << (prec - 1))
    return np.moveaxis(np.clip(acc >> prec, 0, 255).astype(np.uint8), 0, axis)


def resize_uint8(img: np.ndarray, height: int, width: int) -> np.ndarray:
    """uint8 [H, W, C] -> [height, width, C]: torchvision's antialiased bilinear resize of a uint8
    tensor on the CPU (torch's separable kernel: the width pass, then the height pass, each
    rounding back to uint8), bit for bit."""
    if img.shape[1] != width:
        img = _aa_pass(img, width, 1)
    if img.shape[0] != height:
        img = _aa_pass(img, height, 0)
    return img


@dataclass(frozen=True)
class Llama4ImagePolicy:
    tile: int = 336
    max_patches: int = 16
    resize_to_max_canvas: bool = False
    resample: int = int(Image.Resampling.BILINEAR)
    rescale_factor: float = 1 / 255
    image_mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    image_std: tuple[float, float, float] = (0.5, 0.5, 0.5)

    @classmethod
    def from_config(cls, cfg: dict) -> "Llama4ImagePolicy":
        size = cfg.get("size") or {"height": 336, "width": 336}
        if not isinstance(size, dict) or not size.get("height") or size.get("height") != size.get("width"):
            raise UnsupportedModelError(f"Llama 4 image processor size={size!r} must be a square height/width",
                                        param="size")
        for flag in ("do_resize", "do_rescale", "do_normalize"):
            if cfg.get(flag) is False:
                raise UnsupportedModelError(f"Llama 4 image processor {flag}=false is not supported", param=flag)
        r = cfg.get("resample")
        if r is not None and int(r) != int(Image.Resampling.BILINEAR):
            raise UnsupportedModelError(f"Llama 4 image processor resample={r} (bilinear, 2, is supported)",
                                        param="resample")
        d = cls()
        return cls(tile=int(size["height"]), max_patches=int(cfg.get("max_patches") or 16),
                   resize_to_max_canvas=bool(cfg.get("resize_to_max_canvas", False)),
                   rescale_factor=float(cfg.get("rescale_factor", 1 / 255)),
                   image_mean=_channel_triple(cfg.get("image_mean"), d.image_mean, "image_mean"),
                   image_std=_channel_triple(cfg.get("image_std"), d.image_std, "image_std"))

    def canvas(self, height: int, width: int, max_patches: int | None = None) -> tuple[int, int]:
        return best_fit(height, width, max_patches or self.max_patches, self.tile, self.resize_to_max_canvas)

    def grid(self, height: int, width: int, max_patches: int | None = None) -> tuple[int, int]:
        """(tile rows, tile cols) for an image of this size."""
        ch, cw = self.canvas(height, width, max_patches)
        return ch // self.tile, cw // self.tile

    def _resized(self, height: int, width: int, ch: int, cw: int) -> tuple[int, int]:
        if self.resize_to_max_canvas:
            th, tw = ch, cw
        else:       # no upscale past one tile
            th, tw = min(max(height, self.tile), ch), min(max(width, self.tile), cw)
        return max_res_without_distortion(height, width, th, tw)

    def _normalize(self, u8: np.ndarray) -> np.ndarray:
        """uint8 -> float32 holding bfloat16: (bf16(x) * rescale) then (x - mean) / std, each
        step rounded to bfloat16 as torch computes it."""
        x = (u8.astype(np.float32) * np.float32(self.rescale_factor)).astype(BF16)
        mean = np.asarray(self.image_mean, np.float32).astype(BF16).astype(np.float32)
        std = np.asarray(self.image_std, np.float32).astype(BF16).astype(np.float32)
        x = (x.astype(np.float32) - mean).astype(BF16)
        return (x.astype(np.float32) / std).astype(BF16).astype(np.float32)

    def frames(self, height: int, width: int, max_patches: int | None = None) -> list[Frame]:
        """Where each view lies on a height x width image: the canvas tiles (row-major), then the
        global tile when there are several."""
        ch, cw = self.canvas(height, width, max_patches)
        nh, nw = self._resized(height, width, ch, cw)
        canvas = Frame.of(height, width).resize(nh, nw).pad(0, 0, ch, cw)
        t = self.tile
        out = [canvas.crop(r, c, t, t) for r in range(0, ch, t) for c in range(0, cw, t)]
        return out + [Frame.of(height, width).resize(t, t)] if len(out) > 1 else out

    def __call__(self, img: Image.Image, max_patches: int | None = None) -> tuple[np.ndarray, int, int]:
        """RGB PIL image -> (views [rows * cols (+ 1 global), tile, tile, 3] float32, rows, cols)."""
        img = _as_rgb(img)
        ch, cw = self.canvas(img.height, img.width, max_patches)
        nh, nw = self._resized(img.height, img.width, ch, cw)
        canvas = np.zeros((ch, cw, 3), np.uint8)
        src = np.asarray(img)
        canvas[:nh, :nw] = resize_uint8(src, nh, nw)
        t = self.tile
        rows, cols = ch // t, cw // t
        x = self._normalize(canvas)
        views = x.reshape(rows, t, cols, t, 3).transpose(0, 2, 1, 3, 4).reshape(rows * cols, t, t, 3)
        if rows * cols > 1:
            views = np.concatenate([views, self._normalize(resize_uint8(src, t, t))[None]])
        return np.ascontiguousarray(views), rows, cols

    def cache_key(self, max_patches: int | None = None) -> tuple[Any, ...]:
        return ("llama4", self.tile, max_patches or self.max_patches, self.resize_to_max_canvas, self.resample,
                self.rescale_factor, self.image_mean, self.image_std)
