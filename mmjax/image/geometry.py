"""Where a family's model-input pixels lie on the image they were made from: the resizes, crops
and padding of the image processors kept as one axis-aligned affine map per view (`Frame`),
and `to_image`, which moves a quantity living on the model's pixels (a saliency map, an
attribution) onto the image's own pixels.

A view is (index, Frame): `index` picks it in the family's `image_pixels` layout ([..., H, W, C]:
() for one [H, W, C] image, (k,) for view k of a stacked [views, H, W, C]), the Frame says which
part of the source image each of its pixels shows. `to_image` is the transpose of linear
interpolation from the image onto each view (each view pixel's value spread over the image pixels
under a tent two view pixels wide, then normalised so every view pixel keeps its sum): quantities
that add up (gradients, attributions) keep their total; a view pixel entirely outside the image
(padding) gives nothing; the views of one image (a tile and the overview both show a region) add.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Frame:
    """An array of `height` x `width` pixels made from a source image: on each axis, source
    coordinate = scale * array coordinate + offset (continuous: pixel i spans [i, i + 1)), and
    `box` = (top, left, bottom, right), the part of the array (fractional after a resize) that
    shows the source; the rest is padding."""
    height: int
    width: int
    scale: tuple[float, float]
    offset: tuple[float, float]
    box: tuple[float, float, float, float]

    @classmethod
    def of(cls, height: int, width: int) -> "Frame":
        """The source image itself."""
        return cls(int(height), int(width), (1.0, 1.0), (0.0, 0.0), (0.0, 0.0, float(height), float(width)))

    def resize(self, height: int, width: int) -> "Frame":
        """This array resized (stretched) to height x width."""
        fy, fx = self.height / height, self.width / width
        t, l, b, r = self.box
        return Frame(int(height), int(width), (self.scale[0] * fy, self.scale[1] * fx), self.offset,
                     (t / fy, l / fx, b / fy, r / fx))

    def crop(self, top: int, left: int, height: int, width: int) -> "Frame":
        """The window [top, top + height) x [left, left + width) of this array; the parts of the
        window outside the array (negative top / left, or past the end) are padding."""
        t, l, b, r = self.box
        return Frame(int(height), int(width), self.scale,
                     (self.offset[0] + self.scale[0] * top, self.offset[1] + self.scale[1] * left),
                     (min(max(t - top, 0.0), height), min(max(l - left, 0.0), width),
                      min(max(b - top, 0.0), height), min(max(r - left, 0.0), width)))

    def pad(self, top: int, left: int, height: int, width: int) -> "Frame":
        """This array placed at (top, left) on a height x width canvas of padding."""
        return self.crop(-top, -left, height, width)

    def source_box(self) -> tuple[float, float, float, float]:
        """(top, left, bottom, right) of the source region the array shows."""
        t, l, b, r = self.box
        (sy, sx), (oy, ox) = self.scale, self.offset
        return oy + sy * t, ox + sx * l, oy + sy * b, ox + sx * r


def _tent_cdf(x: np.ndarray) -> np.ndarray:
    """Integral of the unit tent max(0, 1 - |u|) from -inf to x."""
    x = np.clip(x, -1.0, 1.0)
    return np.where(x < 0, (x + 1) ** 2 / 2, 1 - (1 - x) ** 2 / 2)


def _axis_weights(n_source: int, n_view: int, scale: float, offset: float, lo: float, hi: float) -> np.ndarray:
    """[n_source, n_view]: the share of view pixel k's value that source pixel i gets on one axis
    (columns sum to 1 for view pixels that show the source, 0 for padding)."""
    i = np.arange(n_source, dtype=np.float64)
    a = np.clip((i - offset) / scale, lo, hi)[:, None]            # source pixel i in view coordinates
    b = np.clip((i + 1 - offset) / scale, lo, hi)[:, None]
    c = np.arange(n_view, dtype=np.float64)[None, :] + 0.5
    w = _tent_cdf(b - c) - _tent_cdf(a - c)
    k = np.arange(n_view)
    w[:, (k + 1 <= lo) | (k >= hi)] = 0.0                          # padding pixels: nothing
    total = w.sum(0)
    return np.divide(w, total, out=np.zeros_like(w), where=total > 0)


def to_image(values: np.ndarray, views: list[tuple[tuple, Frame]], height: int, width: int) -> np.ndarray:
    """values laid out as the family's image_pixels ([..., H, W] or [..., H, W, C]; a view is
    values[index]) -> [height, width] or [height, width, C] on the source image (module docstring)."""
    values = np.asarray(values, np.float64)
    views = list(views)
    first = values[views[0][0]] if views else values
    channels = first.shape[2:]
    out = np.zeros((height, width) + channels, np.float64)
    for index, f in views:
        v = values[index]
        if v.shape[:2] != (f.height, f.width):
            raise ValueError(f"view {index} is {v.shape[:2]}, its frame {f.height}x{f.width}")
        t, l, b, r = f.box
        wy = _axis_weights(height, f.height, f.scale[0], f.offset[0], t, b)
        wx = _axis_weights(width, f.width, f.scale[1], f.offset[1], l, r)
        rows = np.tensordot(wy, v, axes=(1, 0))                     # [height, W, ...]
        out += np.moveaxis(np.tensordot(wx, rows, axes=(1, 1)), 0, 1)   # [height, width, ...]
    return out.astype(np.float32)
