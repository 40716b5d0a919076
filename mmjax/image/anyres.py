"""Port of transformers' LLaVA-NeXT / LLaVA-OneVision image processors (`LlavaNextImageProcessorPil`,
`LlavaOnevisionImageProcessorPil`): "anyres" tiling, bit-for-bit.

An image is cut into tiles for the grid pinpoint (height, width) that best fits its size: the
image is resized keeping its aspect ratio to fit the pinpoint, zero-padded (centered) to it and
divided into `tile` x `tile` crops, row-major. A low-resolution overview (the whole image resized
to the tile size) comes first. Every view then goes through CLIP-style per-crop steps (resize,
center crop, rescale, normalize: `ClipImagePolicy`).

"Overview only" (no tiles: the server's `detail: "low"`, a tile cap below the smallest grid, or
LLaVA-OneVision's multi-image prompts) is one view: LLaVA-NeXT's overview, or OneVision's image
padded to a square with the mean color (what its processor does for multi-image inputs).

Token counts (`AnyresGrid`) are exact functions of the image size, computed here on the host the
way the processors / models compute them: base tokens + the unpadded feature map (OneVision:
downscaled when larger than `anyres_max` tiles' worth) + one `image_newline` per feature row.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
from PIL import Image

from mmjax.errors import ImageError, UnsupportedModelError
from mmjax.image.decode import PARAM as _PARAM
from mmjax.image.geometry import Frame
from mmjax.image.processors import MAX_RESIZE_PIXELS, ClipImagePolicy, _as_rgb, _pil_resize, _size_spec


def select_best_resolution(height: int, width: int, pinpoints: tuple[tuple[int, int], ...]) -> tuple[int, int]:
    """transformers' select_best_resolution: the (h, w) pinpoint keeping the most of the image's
    resolution, ties broken by the least padding."""
    best, best_eff, best_waste = None, 0, float("inf")
    for ph, pw in pinpoints:
        scale = min(pw / width, ph / height)
        dw, dh = int(width * scale), int(height * scale)
        eff = min(dw * dh, width * height)
        waste = pw * ph - eff
        if eff > best_eff or (eff == best_eff and waste < best_waste):
            best, best_eff, best_waste = (ph, pw), eff, waste
    if best is None:
        raise ImageError(f"no grid pinpoint fits a {width}x{height} image", param=_PARAM)
    return best


def patch_output_size(height: int, width: int, target: tuple[int, int]) -> tuple[int, int]:
    """transformers' get_patch_output_size: the aspect-keeping size that fits `target` (h, w)."""
    th, tw = target
    sw, sh = tw / width, th / height
    if sw < sh:
        return min(math.ceil(height * sw), th), tw
    return th, min(math.ceil(width * sh), tw)


def unpadded_size(height: int, width: int, cur_h: int, cur_w: int) -> tuple[int, int, int, int]:
    """The feature map [cur_h, cur_w] of a padded-to-grid image, its padding rows / columns
    removed (transformers' unpad_image): (top, bottom, left, right) bounds of what is kept."""
    if width / height > cur_w / cur_h:
        new_h = int(round(height * (cur_w / width), 7))
        pad = (cur_h - new_h) // 2
        return pad, cur_h - pad, 0, cur_w
    new_w = int(round(width * (cur_h / height), 7))
    pad = (cur_w - new_w) // 2
    return 0, cur_h, pad, cur_w - pad


@dataclass(frozen=True)
class AnyresGrid:
    """How one image is laid out: `rows` x `cols` tiles (0 x 0: overview only), the feature map
    bounds kept after unpadding (in vision patches), and its size after the anyres_max
    downscale (`out_h` x `out_w`; equal to the unpadded size when none)."""
    rows: int
    cols: int
    side: int                                  # vision patches per tile side
    crop: tuple[int, int, int, int] = (0, 0, 0, 0)
    out_h: int = 0
    out_w: int = 0

    @property
    def tiles(self) -> int:
        return self.rows * self.cols

    @property
    def views(self) -> int:
        """Encoder inputs: the overview, then the tiles."""
        return 1 + self.tiles

    @property
    def num_tokens(self) -> int:
        """Overview tokens + the (unpadded, downscaled) map with one newline per row; overview
        only: its tokens + one newline."""
        if not self.tiles:
            return self.side * self.side + 1
        return self.side * self.side + self.out_h * (self.out_w + 1)


@dataclass(frozen=True)
class AnyresImagePolicy:
    """RGB PIL image -> views float32 [1 + tiles, tile, tile, 3] and its AnyresGrid.

    pinpoints: the checkpoint's `image_grid_pinpoints` as (height, width) pairs.
    base_size: (h, w) the overview is resized to before the per-view steps.
    tile: the tile side in pixels (crop_size, else size).
    view: the per-view CLIP steps (resize, center crop, rescale, normalize).
    pad_overview: overview-only images are padded to a square with the mean color first
        (LLaVA-OneVision); else the overview is the anyres overview (LLaVA-NeXT).
    """
    pinpoints: tuple[tuple[int, int], ...]
    base_size: tuple[int, int]
    tile: int
    view: ClipImagePolicy
    resample: int
    pad_overview: bool = False

    @classmethod
    def from_config(cls, cfg: dict, *, onevision: bool) -> "AnyresImagePolicy":
        """From the image processor config dict (missing keys: the processor class defaults)."""
        def get(key: str, default: Any) -> Any:
            value = cfg.get(key)
            return default if value is None else value

        if onevision:
            size_default, crop_default, crop_on = {"height": 384, "width": 384}, None, False
            pins_default = [[384 * i, 384 * j] for i in range(1, 7) for j in range(1, 7)]
        else:
            size_default, crop_default, crop_on = {"shortest_edge": 224}, {"height": 224, "width": 224}, True
            pins_default = [[336, 672], [672, 336], [672, 672], [1008, 336], [336, 1008]]
        size = dict(_size_spec(get("size", size_default), default_to_square=False, param="size"))
        crop_raw = cfg.get("crop_size", crop_default)
        crop = dict(_size_spec(crop_raw, default_to_square=True, param="crop_size")) if crop_raw else {}
        do_crop = bool(get("do_center_crop", crop_on)) and bool(crop)
        base = (size["height"], size["width"]) if "height" in size else (size["shortest_edge"],) * 2
        tile = crop["height"] if crop else size.get("height", size.get("shortest_edge"))
        view_cfg = dict(cfg, do_center_crop=do_crop, crop_size=crop or {"height": tile, "width": tile},
                        size=get("size", size_default))
        view = ClipImagePolicy.from_config(view_cfg)
        pins = get("image_grid_pinpoints", pins_default)
        try:
            pinpoints = tuple((int(h), int(w)) for h, w in pins)
        except (TypeError, ValueError):
            raise UnsupportedModelError(f"image_grid_pinpoints={pins!r} is not a list of [height, width]",
                                        param="image_grid_pinpoints") from None
        if not pinpoints or any(h <= 0 or w <= 0 or h % tile or w % tile for h, w in pinpoints):
            raise UnsupportedModelError(f"image_grid_pinpoints must be positive multiples of the {tile}-pixel tile, "
                                        f"got {pins!r}", param="image_grid_pinpoints")
        if view.output_size != (tile, tile):
            raise UnsupportedModelError(f"image processor produces {view.output_size} views, not {tile}x{tile} tiles",
                                        param="crop_size")
        return cls(pinpoints=pinpoints, base_size=base, tile=tile, view=view, resample=view.resample,
                   pad_overview=onevision)

    def allowed(self, max_tiles: int | None) -> tuple[tuple[int, int], ...]:
        """The pinpoints with at most `max_tiles` tiles (None: all)."""
        if max_tiles is None:
            return self.pinpoints
        return tuple(p for p in self.pinpoints if (p[0] // self.tile) * (p[1] // self.tile) <= max_tiles)

    def grid(self, height: int, width: int, side: int, *, max_tiles: int | None = None,
             max_patches: int | None = None) -> AnyresGrid:
        """The layout of a height x width image (side: vision patches per tile; max_patches:
        OneVision's anyres_max_N)."""
        pins = self.allowed(max_tiles)
        if not pins:
            return AnyresGrid(0, 0, side)
        bh, bw = select_best_resolution(height, width, pins)
        rows, cols = bh // self.tile, bw // self.tile
        top, bottom, left, right = unpadded_size(height, width, side * rows, side * cols)
        h, w = bottom - top, right - left
        if max_patches is not None:
            ratio = math.sqrt(h * w / (max_patches * side ** 2))
            if ratio > 1.1:
                h, w = int(h // ratio), int(w // ratio)
        return AnyresGrid(rows, cols, side, (top, bottom, left, right), h, w)

    def frames(self, height: int, width: int, grid: AnyresGrid) -> list[Frame]:
        """Where each view (`__call__`'s order) lies on a height x width image: the overview
        (resized to base_size, or OneVision's padded square), then the tiles of the
        resized-and-padded grid canvas; each through the per-view CLIP steps."""
        src = Frame.of(height, width)
        if not grid.tiles and self.pad_overview:
            m = max(height, width)
            top, left = ((m - height) // 2, 0) if width > height else (0, (m - width) // 2)
            return [self.view.frame(src.pad(top, left, m, m))]
        frames = [self.view.frame(src.resize(*self.base_size))]
        if grid.tiles:
            th, tw = grid.rows * self.tile, grid.cols * self.tile
            nh, nw = patch_output_size(height, width, (th, tw))
            canvas = src.resize(nh, nw).pad((th - nh) // 2, (tw - nw) // 2, th, tw)
            t = self.tile
            frames += [self.view.frame(canvas.crop(i, j, t, t)) for i in range(0, th, t) for j in range(0, tw, t)]
        return frames

    def _view(self, pixels: np.ndarray) -> np.ndarray:
        return self.view(Image.fromarray(pixels))

    def __call__(self, img: Image.Image, grid: AnyresGrid) -> np.ndarray:
        """RGB PIL image + its grid -> views float32 [grid.views, tile, tile, 3] ==
        HF pixel_values[i][:views].transpose(0, 2, 3, 1)."""
        img = _as_rgb(img)
        if not grid.tiles and self.pad_overview:
            return self._view(self._pad_to_square(np.asarray(img)))[None]
        views = [_pil_resize(img, *self.base_size, self.resample)]
        if grid.tiles:
            target = (grid.rows * self.tile, grid.cols * self.tile)
            nh, nw = patch_output_size(img.height, img.width, target)
            if nh * nw > MAX_RESIZE_PIXELS:
                raise ImageError(f"image {img.width}x{img.height} would resize to {nw}x{nh} pixels", param=_PARAM)
            resized = _pil_resize(img, nh, nw, self.resample)
            py, ry = divmod(target[0] - nh, 2)
            px, rx = divmod(target[1] - nw, 2)
            padded = np.pad(resized, ((py, py + ry), (px, px + rx), (0, 0)))
            t = self.tile
            views += [np.ascontiguousarray(padded[i:i + t, j:j + t])
                      for i in range(0, target[0], t) for j in range(0, target[1], t)]
        return np.stack([self._view(v) for v in views])

    def _pad_to_square(self, arr: np.ndarray) -> np.ndarray:
        """OneVision's pad_to_square: centered on a square of the mean color (int(mean * 255))."""
        h, w = arr.shape[:2]
        if h == w:
            return arr
        m = max(h, w)
        out = np.empty((m, m, 3), np.uint8)
        out[:] = [int(x * 255) for x in self.view.image_mean]
        if w > h:
            s = (m - h) // 2
            out[s:s + h] = arr
        else:
            s = (m - w) // 2
            out[:, s:s + w] = arr
        return out

    def cache_key(self) -> tuple:
        return ("anyres", self.pinpoints, self.base_size, self.tile, self.view.cache_key(), self.resample,
                self.pad_overview)


__all__ = ["AnyresGrid", "AnyresImagePolicy", "patch_output_size", "select_best_resolution", "unpadded_size"]
