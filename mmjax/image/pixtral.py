"""Port of transformers' PixtralImageProcessor (Pil backend) as PixtralProcessor drives it:
native resolution, the longest edge capped at `longest_edge` (aspect ratio kept, floor), both
sides rounded UP to a multiple of `patch` (the processor passes the vision patch size times
`spatial_merge_size`), PIL resize, rescale, normalize. Bit-for-bit like
`PixtralImageProcessorPil` (before its batch padding, which the vision tower crops away)."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
from PIL import Image

from mmjax.errors import ImageError, UnsupportedModelError
from mmjax.image.decode import PARAM as _PARAM
from mmjax.image.processors import (OPENAI_CLIP_MEAN, OPENAI_CLIP_STD, _as_rgb, _channel_triple, _pil_resize,
                                    _resample, _rescale_normalize)


@dataclass(frozen=True)
class PixtralImagePolicy:
    """RGB PIL image -> float32 [H, W, 3] with H, W multiples of `patch`, max(H, W) <= the
    longest edge rounded up to `patch` (`max_size` = (height, width) caps; longest_edge: both)."""
    max_size: tuple[int, int] = (1024, 1024)
    patch: int = 16
    resample: int = int(Image.Resampling.BICUBIC)
    do_rescale: bool = True
    rescale_factor: float = 1 / 255
    do_normalize: bool = True
    image_mean: tuple[float, float, float] = OPENAI_CLIP_MEAN
    image_std: tuple[float, float, float] = OPENAI_CLIP_STD

    @classmethod
    def from_config(cls, cfg: dict, patch: int) -> "PixtralImagePolicy":
        """From the image processor config; `patch`: the processor's patch_size * spatial_merge_size
        (the image processor's own patch_size is overridden by the processor, as in transformers)."""
        d = cls()

        def get(key: str, default: Any) -> Any:
            value = cfg.get(key)
            return default if value is None else value

        if not get("do_resize", True):
            raise UnsupportedModelError("Pixtral image processor with do_resize=false is not supported",
                                        param="do_resize")
        size = get("size", {"longest_edge": 1024})
        if isinstance(size, int):
            size = {"longest_edge": size}
        if not isinstance(size, dict):
            raise UnsupportedModelError(f"image processor size={size!r} is not a size dict", param="size")
        if size.get("longest_edge"):
            max_size = (int(size["longest_edge"]),) * 2
        elif size.get("height") and size.get("width"):
            max_size = (int(size["height"]), int(size["width"]))
        else:
            raise UnsupportedModelError(f"image processor size={size!r} needs longest_edge or height and width",
                                        param="size")
        return cls(max_size=max_size, patch=int(patch), resample=_resample(cfg.get("resample"), d.resample),
                   do_rescale=bool(get("do_rescale", True)), rescale_factor=float(get("rescale_factor", 1 / 255)),
                   do_normalize=bool(get("do_normalize", True)),
                   image_mean=_channel_triple(cfg.get("image_mean"), d.image_mean, "image_mean"),
                   image_std=_channel_triple(cfg.get("image_std"), d.image_std, "image_std"))

    def resized_size(self, height: int, width: int) -> tuple[int, int]:
        """(H, W) after the resize: transformers' get_resize_output_image_size (downscale only,
        floor), then each side rounded up to a multiple of `patch`."""
        ratio = max(height / self.max_size[0], width / self.max_size[1])
        if ratio > 1:
            height, width = int(math.floor(height / ratio)), int(math.floor(width / ratio))
        if height < 1 or width < 1:  # HF would produce an empty image
            raise ImageError(f"image aspect ratio {width}x{height} is too extreme for a longest edge of "
                             f"{max(self.max_size)} pixels", param=_PARAM)
        p = self.patch
        return ((height - 1) // p + 1) * p, ((width - 1) // p + 1) * p

    def grid(self, height: int, width: int) -> tuple[int, int]:
        """(rows, cols) of `patch`-sized cells after the resize (the LLM token grid)."""
        rh, rw = self.resized_size(height, width)
        return rh // self.patch, rw // self.patch

    def __call__(self, img: Image.Image) -> np.ndarray:
        """RGB PIL image -> float32 [H, W, 3] == HF pixel_values[i, :, :H, :W].transpose(1, 2, 0)."""
        img = _as_rgb(img)
        rh, rw = self.resized_size(img.height, img.width)
        pixels = _pil_resize(img, rh, rw, self.resample)
        return _rescale_normalize(pixels, self.do_rescale, self.rescale_factor, self.do_normalize,
                                  self.image_mean, self.image_std)

    def cache_key(self) -> tuple:
        return ("pixtral", self.max_size, self.patch, self.resample, self.do_rescale, self.rescale_factor,
                self.do_normalize, self.image_mean, self.image_std)
