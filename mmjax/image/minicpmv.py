"""MiniCPM-V 4.6 / 4.7 image slicing: a port of transformers' MiniCPMV4_6ImageProcessorPil.

An image becomes a source view (the whole image resized to about `scale_resolution`^2 pixels)
plus, when it is larger than that, a rows x cols grid of slices (the image resized so each slice
is again about `scale_resolution`^2, then cut row-major). Every view's sides are multiples of
patch_size * merge (merge 4 in "16x" mode: the window merger and the merger each halve the patch
grid; 2 in "4x"), so its token count is (h / patch) * (w / patch) / merge^2, known from the image
size alone. The arithmetic (Python `round`, `int` truncation, the grid search over
slices - 1, slices, slices + 1 and its tie rule) is the processor's, line for line; pixels are
PIL-resized uint8, then rescaled (float64 -> float32) and normalized like transformers.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from PIL import Image

from mmjax.errors import UnsupportedModelError
from mmjax.image.processors import _as_rgb, _channel_triple, _pil_resize, _resample, _rescale_normalize

IMAGENET_STANDARD_MEAN = (0.5, 0.5, 0.5)
IMAGENET_STANDARD_STD = (0.5, 0.5, 0.5)


def ensure_divide(length: float, divisor: int) -> int:
    """The processor's rounding: the nearest multiple of `divisor` (Python's round), at least one."""
    return max(round(length / divisor) * divisor, divisor)


@dataclass(frozen=True)
class SlicePlan:
    """Where an image's views come from: the source view's (height, width), the grid (rows,
    cols; (0, 0): no slices) and the size the image is resized to before it is cut."""
    source: tuple[int, int]
    grid: tuple[int, int]
    refine: tuple[int, int] | None

    @property
    def view_sizes(self) -> list[tuple[int, int]]:
        """(height, width) in pixels of each view: the source, then the slices row-major."""
        rows, cols = self.grid
        if not rows:
            return [self.source]
        return [self.source] + [(self.refine[0] // rows, self.refine[1] // cols)] * (rows * cols)


@dataclass(frozen=True)
class MiniCPMVImagePolicy:
    scale_resolution: int = 448
    max_slice_nums: int = 9
    patch_size: int = 14
    slice_mode: bool = True
    downsample_mode: str = "16x"
    use_image_id: bool = True
    resample: int = int(Image.Resampling.BICUBIC)
    do_rescale: bool = True
    rescale_factor: float = 1 / 255
    do_normalize: bool = True
    image_mean: tuple[float, float, float] = IMAGENET_STANDARD_MEAN
    image_std: tuple[float, float, float] = IMAGENET_STANDARD_STD

    @classmethod
    def from_config(cls, cfg: dict, **extra) -> "MiniCPMVImagePolicy":
        mode = str(cfg.get("downsample_mode", "16x"))
        if mode not in ("16x", "4x"):
            raise UnsupportedModelError(f"image processor downsample_mode={mode!r} (expected '16x' or '4x')",
                                        param="downsample_mode")
        if cfg.get("do_resize") is False:
            raise UnsupportedModelError("image processor do_resize=false is not supported", param="do_resize")
        return cls(scale_resolution=int(cfg.get("scale_resolution", 448)),
                   max_slice_nums=int(cfg.get("max_slice_nums", 9)), patch_size=int(cfg.get("patch_size", 14)),
                   slice_mode=bool(cfg.get("slice_mode", True)), downsample_mode=mode,
                   use_image_id=bool(cfg.get("use_image_id", True)), resample=_resample(cfg.get("resample")),
                   do_rescale=bool(cfg.get("do_rescale", True)),
                   rescale_factor=float(cfg.get("rescale_factor", 1 / 255)),
                   do_normalize=bool(cfg.get("do_normalize", True)),
                   image_mean=_channel_triple(cfg.get("image_mean"), IMAGENET_STANDARD_MEAN, "image_mean"),
                   image_std=_channel_triple(cfg.get("image_std"), IMAGENET_STANDARD_STD, "image_std"), **extra)

    @property
    def merge(self) -> int:
        """Patches per LLM token along each side (4 in "16x" mode, 2 in "4x")."""
        return 2 if self.downsample_mode == "4x" else 4

    # ---- the processor's arithmetic -------------------------------------------------------------
    def best_resize(self, height: float, width: float, allow_upscale: bool) -> tuple[int, int]:
        """find_best_resize: about scale_resolution^2 pixels at the same aspect (only shrinking
        unless `allow_upscale`), sides rounded to patch_size * merge."""
        s = self.scale_resolution
        if height * width > s * s or allow_upscale:
            aspect = width / height
            height = int(s / math.sqrt(aspect))
            width = int(height * aspect)
        unit = self.patch_size * self.merge
        return ensure_divide(height, unit), ensure_divide(width, unit)

    def sliced_grid(self, height: int, width: int, max_slices: int) -> tuple[int, int] | None:
        """get_sliced_grid: (rows, cols) whose aspect is closest (in log) to the image's among
        the factorizations of slices - 1, slices, slices + 1 (slices = ceil(area / s^2) capped at
        max_slices; ties: more rows); None for an image of at most one slice."""
        log_ratio = math.log(width / height)
        multiple = min(math.ceil(width * height / (self.scale_resolution * self.scale_resolution)), max_slices)
        if multiple <= 1:
            return None
        best, min_error = (1, 1), float("inf")
        for n in (multiple - 1, multiple, multiple + 1):
            if n == 1 or n > max_slices:
                continue
            for rows in range(1, n + 1):
                if n % rows == 0:
                    error = abs(log_ratio - math.log((n // rows) / rows))
                    if error < min_error or (error == min_error and rows > best[0]):
                        best, min_error = (rows, n // rows), error
        return best

    def plan(self, height: int, width: int, max_slices: int | None = None) -> SlicePlan:
        """The views of a height x width image; max_slices: the grid's cap (None: the
        checkpoint's max_slice_nums; 0 or 1: the source view alone)."""
        cap = self.max_slice_nums if max_slices is None else max_slices
        grid = self.sliced_grid(height, width, cap) if self.slice_mode and cap > 1 else None
        source = self.best_resize(height, width, allow_upscale=grid is None)
        if grid is None:
            return SlicePlan(source, (0, 0), None)
        rows, cols = grid
        rh, rw = ensure_divide(height, rows), ensure_divide(width, cols)
        bh, bw = self.best_resize(rh / rows, rw / cols, allow_upscale=True)
        return SlicePlan(source, grid, (bh * rows, bw * cols))

    def view_tokens(self, plan: SlicePlan) -> list[int]:
        """LLM tokens of each view (the processor's target_sizes.prod(-1) // merge^2)."""
        p = self.patch_size
        return [(h // p) * (w // p) // self.merge ** 2 for h, w in plan.view_sizes]

    # ---- pixels ---------------------------------------------------------------------------------
    def _resize(self, src, height: int, width: int) -> np.ndarray:
        """The processor's resize: PIL on the uint8 image (the video policy: torch's kernel)."""
        return _pil_resize(src, height, width, self.resample)

    def _finish(self, x: np.ndarray) -> np.ndarray:
        return _rescale_normalize(x, self.do_rescale, self.rescale_factor, self.do_normalize, self.image_mean,
                                  self.image_std)

    def views(self, src, plan: SlicePlan) -> list[np.ndarray]:
        """An image (RGB PIL; the video policy: a uint8 frame [H, W, 3]) -> the plan's views,
        each float32 [h, w, 3] (normalized): the source view, then the slices row-major."""
        views = [self._finish(self._resize(src, *plan.source))]
        rows, cols = plan.grid
        if rows:
            refined = self._resize(src, *plan.refine)
            ph, pw = plan.refine[0] // rows, plan.refine[1] // cols
            views += [self._finish(refined[r * ph:(r + 1) * ph, c * pw:(c + 1) * pw])
                      for r in range(rows) for c in range(cols)]
        return views

    def __call__(self, img: Image.Image, plan: SlicePlan) -> list[np.ndarray]:
        """RGB image -> the plan's views (`views`)."""
        return self.views(_as_rgb(img), plan)

    def cache_key(self) -> tuple:
        return ("minicpmv", self.scale_resolution, self.patch_size, self.slice_mode, self.downsample_mode,
                self.resample, self.do_rescale, self.rescale_factor, self.do_normalize, self.image_mean,
                self.image_std)
