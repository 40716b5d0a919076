"""uint8 antialiased bicubic resize, bit-exact with torch's CPU uint8 kernel.

transformers' video processors resize frames with `torchvision.transforms.v2.functional.resize`
(bicubic, antialias=True) on uint8 tensors; on x86 CPUs torchvision hands uint8 bicubic straight
to torch's AVX2 kernel (a port of Pillow-SIMD's `ImagingResample`), whose fixed-point
arithmetic differs from Pillow's own (int16 weights with a per-axis precision instead of Pillow's
22 bits): about 0.5% of the pixels differ by one level from `PIL.Image.resize`. This module is
that kernel in numpy, so video pixels match transformers exactly without torch:

- per axis, weights from Keys' cubic (a = -0.5) stretched by the scale when downsampling
  (support 2 * scale), computed in float64, normalized per output pixel, then rounded to int16
  with the largest precision (< 22 bits) that keeps the largest weight under 2**15;
- horizontal pass first (into a uint8 intermediate), then vertical; an axis whose size does not
  change is not resampled; each output = clamp((2**(prec-1) + sum(w_int16 * x)) >> prec, 0, 255).
"""
from __future__ import annotations

import numpy as np

_A = -0.5


def _cubic(x: np.ndarray) -> np.ndarray:
    x = np.abs(x)
    near = ((_A + 2) * x - (_A + 3)) * x * x + 1
    far = ((_A * x - 5 * _A) * x + 8 * _A) * x - 4 * _A
    return np.where(x < 1, near, np.where(x < 2, far, 0.0))


def _weights(in_size: int, out_size: int) -> tuple[np.ndarray, np.ndarray, int]:
    """(first input index [out], int16-valued weights [out, k] as int64, precision bits)."""
    scale = in_size / out_size
    support = 2.0 * scale if scale >= 1.0 else 2.0
    invscale = 1.0 / scale if scale >= 1.0 else 1.0
    k = int(np.ceil(support)) * 2 + 1
    i = np.arange(out_size, dtype=np.float64)
    center = scale * (i + 0.5)
    xmin = np.maximum((center - support + 0.5).astype(np.int64), 0)
    xmax = np.minimum((center + support + 0.5).astype(np.int64), in_size)
    size = xmax - xmin
    j = np.arange(k)
    w = _cubic((j[None, :] + xmin[:, None] - center[:, None] + 0.5) * invscale)
    w = np.where(j[None, :] < size[:, None], w, 0.0)
    total = np.zeros(out_size)
    for c in range(k):                      # sequential sum, as the kernel does
        total = total + w[:, c]
    w = np.where(total[:, None] != 0, w / np.where(total == 0, 1, total)[:, None], w)
    w_max = float(w.max())
    prec = 0
    while prec < 22 and int(0.5 + w_max * (1 << (prec + 1))) < (1 << 15):
        prec += 1
    v = w * (1 << prec)
    wi = np.where(v < 0, v - 0.5, v + 0.5).astype(np.int64)   # C cast: truncation toward zero
    return xmin, wi, prec


def _resample_axis(x: np.ndarray, out_size: int, axis: int) -> np.ndarray:
    """uint8 x resampled along `axis` (1 = width, 0 = height of [..., H, W, C] frames)."""
    ax = x.ndim - 3 + axis
    in_size = x.shape[ax]
    xmin, w, prec = _weights(in_size, out_size)
    acc = np.full(x.shape[:ax] + (out_size,) + x.shape[ax + 1:], 1 << (prec - 1), np.int64)
    shape = [1] * x.ndim
    shape[ax] = out_size
    for c in range(w.shape[1]):
        idx = np.minimum(xmin + c, in_size - 1)   # weights past the window are 0
        acc += np.take(x, idx, axis=ax).astype(np.int64) * w[:, c].reshape(shape)
    return np.clip(acc >> prec, 0, 255).astype(np.uint8)


def resize_bicubic_aa(frames: np.ndarray, height: int, width: int) -> np.ndarray:
    """uint8 [..., H, W, C] -> uint8 [..., height, width, C] (torch CPU uint8 bicubic antialias)."""
    x = np.asarray(frames, np.uint8)
    if x.shape[-2] != width:
        x = _resample_axis(x, width, 1)
    if x.shape[-3] != height:
        x = _resample_axis(x, height, 0)
    return np.ascontiguousarray(x)
