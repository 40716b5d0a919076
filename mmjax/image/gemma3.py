"""Port of transformers' Gemma3ImageProcessor (Pil backend): fixed-size resize, rescale,
normalize, and pan-and-scan (the original image plus up to `max_num_crops` crops along the long
side of an elongated image), bit-for-bit like `Gemma3ImageProcessorPil`."""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
from PIL import Image

from mmjax.errors import UnsupportedModelError
from mmjax.image.geometry import Frame
from mmjax.image.processors import _as_rgb, _channel_triple, _pil_resize, _resample, _rescale_normalize, _size_spec

IMAGENET_STANDARD = (0.5, 0.5, 0.5)


@dataclass(frozen=True)
class PanAndScan:
    """Gemma 3 pan-and-scan settings (the processor's `pan_and_scan_*` fields and defaults)."""
    min_crop_size: int = 256
    max_num_crops: int = 4
    min_ratio_to_activate: float = 1.2

    def crop_boxes(self, height: int, width: int) -> list[tuple[int, int, int, int]]:
        """(top, left, bottom, right) of each crop, HF's `pan_and_scan` arithmetic; [] when the
        image is not elongated enough or the crops would be smaller than min_crop_size. Boxes
        are clipped to the image (numpy slicing, as HF crops)."""
        if width >= height:
            if width / height < self.min_ratio_to_activate:
                return []
            n_w = int(math.floor(width / height + 0.5))
            n_w = min(int(math.floor(width / self.min_crop_size)), n_w)
            n_w = min(self.max_num_crops, max(2, n_w))
            n_h = 1
        else:
            if height / width < self.min_ratio_to_activate:
                return []
            n_h = int(math.floor(height / width + 0.5))
            n_h = min(int(math.floor(height / self.min_crop_size)), n_h)
            n_h = min(self.max_num_crops, max(2, n_h))
            n_w = 1
        cw, ch = int(math.ceil(width / n_w)), int(math.ceil(height / n_h))
        if min(cw, ch) < self.min_crop_size:
            return []
        return [(top, left, min(top + ch, height), min(left + cw, width))
                for top, left in itertools.product([ch * i for i in range(n_h)], [cw * i for i in range(n_w)])]


@dataclass(frozen=True)
class Gemma3ImagePolicy:
    """RGB PIL image -> one float32 [H, W, 3] array per view: the image, then its pan-and-scan
    crops (row-major) when pan-and-scan is on for the request (`do_pan_and_scan` is the
    checkpoint's default)."""
    height: int = 224
    width: int = 224
    do_resize: bool = True
    resample: int = int(Image.Resampling.BILINEAR)
    do_rescale: bool = True
    rescale_factor: float = 1 / 255
    do_normalize: bool = True
    image_mean: tuple[float, float, float] = IMAGENET_STANDARD
    image_std: tuple[float, float, float] = IMAGENET_STANDARD
    do_pan_and_scan: bool = False
    pan_and_scan: PanAndScan = PanAndScan()

    @classmethod
    def from_config(cls, cfg: dict) -> "Gemma3ImagePolicy":
        d = cls()

        def get(key: str, default: Any) -> Any:
            value = cfg.get(key)
            return default if value is None else value

        size = dict(_size_spec(get("size", {"height": 224, "width": 224}), default_to_square=True, param="size"))
        if set(size) != {"height", "width"}:
            raise UnsupportedModelError("Gemma 3 image processor size must have 'height' and 'width'", param="size")
        pas = PanAndScan(int(get("pan_and_scan_min_crop_size", d.pan_and_scan.min_crop_size)),
                         int(get("pan_and_scan_max_num_crops", d.pan_and_scan.max_num_crops)),
                         float(get("pan_and_scan_min_ratio_to_activate", d.pan_and_scan.min_ratio_to_activate)))
        return cls(height=size["height"], width=size["width"], do_resize=bool(get("do_resize", True)),
                   resample=_resample(cfg.get("resample"), d.resample),
                   do_rescale=bool(get("do_rescale", True)), rescale_factor=float(get("rescale_factor", 1 / 255)),
                   do_normalize=bool(get("do_normalize", True)),
                   image_mean=_channel_triple(cfg.get("image_mean"), IMAGENET_STANDARD, "image_mean"),
                   image_std=_channel_triple(cfg.get("image_std"), IMAGENET_STANDARD, "image_std"),
                   do_pan_and_scan=bool(get("do_pan_and_scan", False)), pan_and_scan=pas)

    def with_pan_and_scan(self, on: bool | None) -> "Gemma3ImagePolicy":
        return self if on is None or on == self.do_pan_and_scan else replace(self, do_pan_and_scan=bool(on))

    def num_crops(self, height: int, width: int) -> int:
        return len(self.pan_and_scan.crop_boxes(height, width)) if self.do_pan_and_scan else 0

    def frames(self, height: int, width: int) -> list[Frame]:
        """Where each view (`__call__`'s order) lies on a height x width image: the whole image,
        then each pan-and-scan crop, each resized to the output size."""
        src = Frame.of(height, width)
        boxes = self.pan_and_scan.crop_boxes(height, width) if self.do_pan_and_scan else []
        views = [src] + [src.crop(t, l, b - t, r - l) for t, l, b, r in boxes]
        return [v.resize(self.height, self.width) if self.do_resize else v for v in views]

    def _one(self, pixels: np.ndarray) -> np.ndarray:
        if self.do_resize:
            pixels = _pil_resize(Image.fromarray(pixels), self.height, self.width, self.resample)
        return _rescale_normalize(pixels, self.do_rescale, self.rescale_factor, self.do_normalize,
                                  self.image_mean, self.image_std)

    def __call__(self, img: Image.Image) -> list[np.ndarray]:
        """[original, crop 1, ...], each float32 [H, W, 3] == HF pixel_values[i].transpose(1, 2, 0)."""
        arr = np.asarray(_as_rgb(img))
        views = [arr]
        if self.do_pan_and_scan:
            views += [np.ascontiguousarray(arr[t:b, l:r]) for t, l, b, r in
                      self.pan_and_scan.crop_boxes(arr.shape[0], arr.shape[1])]
        return [self._one(v) for v in views]

    def cache_key(self) -> tuple:
        return ("gemma3", self.height, self.width, self.do_resize, self.resample, self.do_rescale,
                self.rescale_factor, self.do_normalize, self.image_mean, self.image_std, self.do_pan_and_scan,
                self.pan_and_scan)
