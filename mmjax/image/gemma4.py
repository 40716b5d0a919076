"""Gemma 4's image processor (transformers `Gemma4ImageProcessorPil`), ported: an RGB image ->
patches of the aspect-ratio-preserving resize and their (x, y) patch positions, bit-for-bit.

The image is resized (PIL bicubic on uint8, skipped when the size already fits) to the largest
size whose sides are multiples of pooling_kernel_size * patch_size and that holds at most
max_soft_tokens * pooling_kernel_size**2 patches; rescaled by 1/255 (float64 then float32, no
normalisation: the model maps pixels to [-1, 1] itself); cut into patch_size**2 * 3 rows in
(patch row, patch col) order, each row (py, px, channel). The soft-token count is
patches / pooling_kernel_size**2, known from the image size alone (`num_tokens`).
Unlike HF, patches are not padded to max_patches here: the encode plan pads them to its bucket.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
from PIL import Image

from mmjax.errors import ImageError, UnsupportedModelError
from mmjax.image.decode import PARAM as _PARAM
from mmjax.image.processors import _as_rgb, _pil_resize, _resample, _rescale_normalize

SUPPORTED_SOFT_TOKENS = (70, 140, 280, 560, 1120)   # Gemma4ImageProcessor's allowed budgets


def aspect_ratio_preserving_size(height: int, width: int, patch_size: int, max_patches: int,
                                 pooling_kernel_size: int) -> tuple[int, int]:
    """transformers' get_aspect_ratio_preserving_size (same float ops, same edge cases)."""
    total_px = height * width
    target_px = max_patches * (patch_size ** 2)
    factor = math.sqrt(target_px / total_px)
    side_mult = pooling_kernel_size * patch_size
    th = int(math.floor(factor * height / side_mult)) * side_mult
    tw = int(math.floor(factor * width / side_mult)) * side_mult
    if th == 0 and tw == 0:
        raise ImageError(f"image of {width}x{height} pixels resizes to nothing", param=_PARAM)
    max_side = (max_patches // pooling_kernel_size ** 2) * side_mult
    if th == 0:
        th = side_mult
        tw = min(int(math.floor(width / height)) * side_mult, max_side)
    elif tw == 0:
        tw = side_mult
        th = min(int(math.floor(height / width)) * side_mult, max_side)
    if th * tw > target_px:
        raise ImageError(f"image of {width}x{height} pixels cannot fit {max_patches} patches", param=_PARAM)
    return th, tw


@dataclass(frozen=True)
class Gemma4ImagePolicy:
    """Gemma4ImageProcessor semantics; defaults are its class defaults."""
    patch_size: int = 16
    pooling_kernel_size: int = 3
    max_soft_tokens: int = 280
    do_resize: bool = True
    resample: int = int(Image.Resampling.BICUBIC)
    do_rescale: bool = True
    rescale_factor: float = 1 / 255
    do_normalize: bool = False
    image_mean: tuple[float, float, float] = (0.0, 0.0, 0.0)
    image_std: tuple[float, float, float] = (1.0, 1.0, 1.0)

    @classmethod
    def from_config(cls, cfg: dict) -> "Gemma4ImagePolicy":
        d = cls()

        def get(key: str, default: Any) -> Any:
            v = cfg.get(key)
            return default if v is None else v

        soft = int(get("max_soft_tokens", d.max_soft_tokens))
        if soft not in SUPPORTED_SOFT_TOKENS:
            raise UnsupportedModelError(f"image processor max_soft_tokens={soft} is not one of "
                                        f"{SUPPORTED_SOFT_TOKENS}", param="max_soft_tokens")
        mean, std = get("image_mean", d.image_mean), get("image_std", d.image_std)
        return cls(patch_size=int(get("patch_size", d.patch_size)),
                   pooling_kernel_size=int(get("pooling_kernel_size", d.pooling_kernel_size)),
                   max_soft_tokens=soft, do_resize=bool(get("do_resize", d.do_resize)),
                   resample=_resample(cfg.get("resample"), d.resample),
                   do_rescale=bool(get("do_rescale", d.do_rescale)),
                   rescale_factor=float(get("rescale_factor", d.rescale_factor)),
                   do_normalize=bool(get("do_normalize", d.do_normalize)),
                   image_mean=tuple(float(x) for x in (mean if isinstance(mean, (list, tuple)) else [mean] * 3)),
                   image_std=tuple(float(x) for x in (std if isinstance(std, (list, tuple)) else [std] * 3)))

    @property
    def max_patches(self) -> int:
        return self.max_soft_tokens * self.pooling_kernel_size ** 2

    @property
    def patch_dim(self) -> int:
        return 3 * self.patch_size ** 2

    def resized_size(self, height: int, width: int) -> tuple[int, int]:
        if not self.do_resize:
            m = self.patch_size * self.pooling_kernel_size
            if height % m or width % m:
                raise ImageError(f"with do_resize=False the image sides must be multiples of {m}, "
                                 f"got {width}x{height}", param=_PARAM)
            return height, width
        return aspect_ratio_preserving_size(height, width, self.patch_size, self.max_patches,
                                            self.pooling_kernel_size)

    def num_tokens(self, height: int, width: int) -> int:
        """Soft tokens of an image of this size (the processor's num_soft_tokens_per_image)."""
        rh, rw = self.resized_size(height, width)
        return (rh // self.patch_size) * (rw // self.patch_size) // self.pooling_kernel_size ** 2

    def __call__(self, img: Image.Image) -> tuple[np.ndarray, np.ndarray]:
        """RGB PIL image -> (patches float32 [n, patch**2 * 3], positions int32 [n, 2] as (x, y))."""
        img = _as_rgb(img)
        rh, rw = self.resized_size(img.height, img.width)
        if (rh, rw) != (img.height, img.width):
            pixels = _pil_resize(img, rh, rw, self.resample)
        else:
            pixels = np.asarray(img)
        pixels = _rescale_normalize(pixels, self.do_rescale, self.rescale_factor, self.do_normalize,
                                    self.image_mean, self.image_std)
        p = self.patch_size
        gh, gw = rh // p, rw // p
        patches = pixels.reshape(gh, p, gw, p, 3).transpose(0, 2, 1, 3, 4).reshape(gh * gw, p * p * 3)
        gx, gy = np.meshgrid(np.arange(gw), np.arange(gh), indexing="xy")
        pos = np.stack([gx, gy], axis=-1).reshape(gh * gw, 2).astype(np.int32)
        return np.ascontiguousarray(patches), pos

    def cache_key(self) -> tuple:
        return ("gemma4", self.patch_size, self.pooling_kernel_size, self.max_soft_tokens, self.do_resize,
                self.resample, self.do_rescale, self.rescale_factor, self.do_normalize, self.image_mean,
                self.image_std)
