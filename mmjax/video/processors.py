"""Ports of transformers' video processors (decoded RGB frames -> model pixels).

`Qwen2VLVideoPolicy` is `Qwen2VLVideoProcessor` (Qwen2-VL and Qwen2.5-VL): frame sampling
(`sample_frames`: `fps` frames per second, within [min_frames, max_frames], a multiple of
`temporal_patch_size`), smart_resize of the frame size within the video pixel bounds
(`size.shortest_edge` / `size.longest_edge`), the uint8 bicubic antialiased resize of torchvision
(bit-exact port in `mmjax.video.resample`), rescale + normalize, and the temporal patchify (the
last frame repeated up to a multiple of `temporal_patch_size`). The frame plan and token count
come from the container metadata alone (`plan`), before any frame is decoded.

`Qwen3VLVideoPolicy` is `Qwen3VLVideoProcessor` (Qwen3-VL, Qwen3-VL-MoE): the same resize and
patchify, but its own sampling (`int(frames / video_fps * fps)` frames within [min_frames,
max_frames] at `np.linspace(0, total - 1, n).round()`, no rounding to the temporal patch), its own
smart_resize (the size range bounds all the sampled frames together, `t * h * w`), patch 16 and
mean / std 0.5, and the per-temporal-patch timestamps Qwen3VLProcessor writes into the prompt
(`VideoPlan.timestamps`, `_calculate_timestamps`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from mmjax.errors import InvalidRequestError, UnsupportedModelError, VideoError
from mmjax.image.processors import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD, _channel_triple, frames_smart_resize, smart_resize
from mmjax.video.decode import PARAM, VideoMeta
from mmjax.video.resample import resize_bicubic_aa

# qwen-vl-utils' FPS: used when the checkpoint has no video processor config (the original Qwen
# releases ship only the image processor's), and by HF when `do_sample_frames` is set without fps.
DEFAULT_FPS = 2.0


def _getter(cfg: dict):
    """cfg.get where an explicit null also means the default."""
    def get(key: str, default: Any) -> Any:
        v = cfg.get(key)
        return default if v is None else v
    return get


def _shared_fields(cfg: dict, d, fps, num_frames) -> dict:
    """The fields every Qwen video processor config spells the same way (d: the class defaults)."""
    get = _getter(cfg)
    return dict(patch_size=int(get("patch_size", d.patch_size)),
                temporal_patch_size=int(get("temporal_patch_size", d.temporal_patch_size)),
                merge_size=int(get("merge_size", d.merge_size)),
                min_frames=int(get("min_frames", d.min_frames)), max_frames=int(get("max_frames", d.max_frames)),
                fps=None if fps is None else float(fps), num_frames=None if num_frames is None else int(num_frames),
                do_sample_frames=bool(get("do_sample_frames", True)),
                do_rescale=bool(get("do_rescale", d.do_rescale)),
                rescale_factor=float(get("rescale_factor", d.rescale_factor)),
                do_normalize=bool(get("do_normalize", d.do_normalize)),
                image_mean=_channel_triple(cfg.get("image_mean"), d.image_mean, "image_mean"),
                image_std=_channel_triple(cfg.get("image_std"), d.image_std, "image_std"))


@dataclass(frozen=True)
class VideoPlan:
    """What a family will take from one video, known from the metadata before decoding:
    the frame indices to decode, the resized frame size, the vision patch grid (t, h, w), the LLM
    token count and the sampled frame rate (frames per second of the sampled frames)."""
    indices: tuple[int, ...]
    size: tuple[int, int]
    grid: tuple[int, int, int]
    num_tokens: int
    sampled_fps: float
    key: tuple = ()
    # Qwen3-VL: seconds of each temporal patch (the mean time of its first and last frame), the
    # "<t seconds>" text Qwen3VLProcessor writes before each frame's tokens; () for other families
    timestamps: tuple[float, ...] = ()


@dataclass(frozen=True)
class Qwen2VLVideoPolicy:
    """transformers Qwen2VLVideoProcessor semantics (see the module docstring)."""
    patch_size: int = 14
    temporal_patch_size: int = 2
    merge_size: int = 2
    min_pixels: int = 128 * 28 * 28      # size.shortest_edge
    max_pixels: int = 768 * 28 * 28      # size.longest_edge
    min_frames: int = 4
    max_frames: int = 768
    fps: float | None = DEFAULT_FPS
    num_frames: int | None = None
    do_sample_frames: bool = True
    do_rescale: bool = True
    rescale_factor: float = 1 / 255
    do_normalize: bool = True
    image_mean: tuple[float, float, float] = OPENAI_CLIP_MEAN
    image_std: tuple[float, float, float] = OPENAI_CLIP_STD

    def __post_init__(self) -> None:
        for name in ("patch_size", "temporal_patch_size", "merge_size", "min_pixels", "max_pixels",
                     "min_frames", "max_frames"):
            if int(getattr(self, name)) <= 0:
                raise UnsupportedModelError(f"Qwen2-VL video processor {name} must be positive", param=name)
        if self.fps is not None and not self.fps > 0:
            raise UnsupportedModelError(f"Qwen2-VL video processor fps must be positive, got {self.fps}", param="fps")

    @classmethod
    def from_config(cls, cfg: dict | None) -> "Qwen2VLVideoPolicy":
        """From video_preprocessor_config.json (None: no such file -> class defaults, sampling at
        2 fps). Keys missing from a file take Qwen2VLVideoProcessor's class defaults, except that
        `do_sample_frames` without `fps` / `num_frames` samples at 2 fps."""
        d = cls()
        if not cfg:
            return d
        size = cfg.get("size") if isinstance(cfg.get("size"), dict) else {}
        lo = next((v for v in (cfg.get("min_pixels"), size.get("shortest_edge")) if v is not None), d.min_pixels)
        hi = next((v for v in (cfg.get("max_pixels"), size.get("longest_edge")) if v is not None), d.max_pixels)
        num_frames = cfg.get("num_frames")
        fps = cfg.get("fps")
        if fps is None and num_frames is None:
            fps = DEFAULT_FPS
        return cls(min_pixels=int(lo), max_pixels=int(hi), **_shared_fields(cfg, d, fps, num_frames))

    @property
    def factor(self) -> int:
        return self.patch_size * self.merge_size

    def bounds(self, min_pixels: int | None = None, max_pixels: int | None = None) -> tuple[int, int]:
        lo = self.min_pixels if min_pixels is None else min_pixels
        hi = self.max_pixels if max_pixels is None else max_pixels
        for name, value in (("video_min_pixels", lo), ("video_max_pixels", hi)):
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value <= 0:
                raise InvalidRequestError(f"{name} must be a positive integer, got {value!r}", param=name)
        if lo > hi:
            raise InvalidRequestError(f"video_min_pixels ({lo}) must not exceed video_max_pixels ({hi})",
                                      param="video_min_pixels")
        return int(lo), int(hi)

    def sample_indices(self, total: int, video_fps: float | None, fps: float | None = None) -> np.ndarray:
        """Qwen2VLVideoProcessor.sample_frames: indices [n] of the frames to keep.

        num_frames = floor(min(max(total / video_fps * fps, min_frames), max_frames', total) / tp) * tp
        with max_frames' = floor(min(max_frames, total) / tp) * tp, then
        torch.arange(0, total, total / num_frames).int() (float32 values, truncated). A video
        shorter than temporal_patch_size frames keeps all of them (HF would divide by zero)."""
        tp = self.temporal_patch_size
        fps = self.fps if fps is None else fps
        if not self.do_sample_frames:
            return np.arange(total)
        if self.num_frames is not None and fps is None:
            n = round(self.num_frames / tp) * tp
        else:
            if not video_fps:
                return np.arange(total)   # frames given without a rate are taken as sampled
            hi = math.floor(min(self.max_frames, total) / tp) * tp
            n = total / video_fps * fps
            n = min(max(n, self.min_frames), hi, total)
            n = math.floor(n / tp) * tp
        if n <= 0:
            return np.arange(total)
        if n > total:
            raise VideoError(f"cannot sample {n} frames from a video of {total} frames", param=PARAM)
        step = total / n
        count = math.ceil(total / step)
        return (np.arange(count, dtype=np.float64) * step).astype(np.float32).astype(np.int32)

    def plan(self, meta: VideoMeta, *, min_pixels: int | None = None, max_pixels: int | None = None,
             fps: float | None = None) -> VideoPlan:
        """Frames, resized size, grid and token count from the metadata alone."""
        lo, hi = self.bounds(min_pixels, max_pixels)
        indices = self.sample_indices(meta.total_frames, meta.fps, fps)
        try:
            rh, rw = smart_resize(meta.height, meta.width, self.factor, lo, hi)
        except ValueError as e:   # smart_resize refuses aspect ratios over 200
            raise VideoError(f"video frames of {meta.width}x{meta.height}: {e}", param=PARAM) from None
        n = len(indices)
        gt = (n + (-n % self.temporal_patch_size)) // self.temporal_patch_size
        gh, gw = rh // self.patch_size, rw // self.patch_size
        # VideoMetadata.sampled_fps: len(indices) / total * fps, the same for a container and for a
        # list of frames given with its rate (HF samples an array video with metadata the same
        # way, and sets frames_indices); 24 when the rate is unknown
        sampled_fps = n / meta.total_frames * meta.fps if meta.fps else 24.0
        # meta.fps: a list of frames' hash does not cover the rate it was given with (sampled_fps)
        key = ("qwen2_vl_video", tuple(int(i) for i in indices), meta.fps, lo, hi, self.patch_size,
               self.temporal_patch_size, self.merge_size, self.do_rescale, self.rescale_factor, self.do_normalize, self.image_mean,
               self.image_std)
        return VideoPlan(tuple(int(i) for i in indices), (rh, rw), (gt, gh, gw),
                         gt * gh * gw // self.merge_size ** 2, float(sampled_fps), key)

    def __call__(self, frames: np.ndarray, plan: VideoPlan) -> np.ndarray:
        """uint8 frames [n, H, W, 3] (the plan's indices, decoded) -> patches float32
        [gt*gh*gw, 3*tp*p*p] in Qwen2VLVideoProcessor's pixel_values_videos order."""
        rh, rw = plan.size
        x = resize_bicubic_aa(frames, rh, rw)      # HF resizes even when the size is unchanged
        x = x.astype(np.float32)
        if self.do_rescale and self.do_normalize:
            # torchvision backend: rescale fused into normalize (mean / factor, std / factor)
            # (float32 tensors times the float32 1 / factor, as torch multiplies them)
            inv = np.float32(1.0 / self.rescale_factor)
            x = (x - np.asarray(self.image_mean, np.float32) * inv) / (np.asarray(self.image_std, np.float32) * inv)
        elif self.do_rescale:
            x = x * np.float32(self.rescale_factor)
        elif self.do_normalize:
            x = (x - np.asarray(self.image_mean, np.float32)) / np.asarray(self.image_std, np.float32)
        return patchify_video(x, self.patch_size, self.merge_size, self.temporal_patch_size)


QWEN3_MEAN = QWEN3_STD = (0.5, 0.5, 0.5)   # IMAGENET_STANDARD_MEAN / _STD
QWEN3_VIDEO_FPS_UNKNOWN = 24.0             # HF's rate for frames given without one (sampling and timestamps)


@dataclass(frozen=True)
class Qwen3VLVideoPolicy(Qwen2VLVideoPolicy):
    """transformers Qwen3VLVideoProcessor + Qwen3VLProcessor's timestamps (module docstring).

    min_pixels / max_pixels (size.shortest_edge / longest_edge) bound t_bar * h * w, all the
    sampled frames together (t_bar: their count rounded to the temporal patch), as the
    processor's smart_resize does. cap_pixels_per_frame / max_video_tokens: the processor's
    optional per-frame cap (off unless the config turns it on)."""
    patch_size: int = 16
    min_pixels: int = 128 * 32 * 32
    max_pixels: int = 32 * 32 * 768
    image_mean: tuple[float, float, float] = QWEN3_MEAN
    image_std: tuple[float, float, float] = QWEN3_STD
    cap_pixels_per_frame: bool = False
    max_video_tokens: int = 768

    @classmethod
    def from_config(cls, cfg: dict | None) -> "Qwen3VLVideoPolicy":
        """From the checkpoint's video processor config (None: Qwen3VLVideoProcessor's class
        defaults). `fps` and `num_frames` both set is the processor's own error."""
        d = cls()
        if not cfg:
            return d
        size = cfg.get("size") if isinstance(cfg.get("size"), dict) else {}
        fps = cfg.get("fps", d.fps)            # an explicit null turns fps sampling off
        num_frames = cfg.get("num_frames")
        if fps is not None and num_frames is not None:
            raise UnsupportedModelError("Qwen3-VL video processor config sets both fps and num_frames (mutually "
                                        "exclusive in Qwen3VLVideoProcessor.sample_frames)", param="num_frames")
        get = _getter(cfg)
        return cls(min_pixels=int(size.get("shortest_edge") or d.min_pixels),
                   max_pixels=int(size.get("longest_edge") or d.max_pixels),
                   cap_pixels_per_frame=bool(get("cap_pixels_per_frame", False)),
                   max_video_tokens=int(get("max_video_tokens", d.max_video_tokens)),
                   **_shared_fields(cfg, d, fps, num_frames))

    def sample_indices(self, total: int, video_fps: float | None, fps: float | None = None) -> np.ndarray:
        """Qwen3VLVideoProcessor.sample_frames: n = int(total / video_fps * fps) clamped to
        [min_frames, min(max_frames, total)] (or `num_frames`), indices
        np.linspace(0, total - 1, n).round() (round half to even; repeats when n > total).
        A rate-less video counts as 24 fps, as HF's metadata default. `fps` (a request's)
        replaces the config's num_frames."""
        if not self.do_sample_frames:
            return np.arange(total)
        num_frames = self.num_frames if fps is None else None
        fps = self.fps if fps is None else fps
        if num_frames is None and fps is not None:
            n = int(total / (video_fps or QWEN3_VIDEO_FPS_UNKNOWN) * fps)
            num_frames = min(max(n, self.min_frames), self.max_frames, total)
        if num_frames is None:
            num_frames = min(max(total, self.min_frames), self.max_frames)
        return np.linspace(0, total - 1, num_frames).round().astype(int)

    def resized_size(self, n_frames: int, height: int, width: int, lo: int, hi: int) -> tuple[int, int]:
        """Qwen3VLVideoProcessor.resize's size: the optional per-frame cap, then its smart_resize
        (transformers' video_processing_qwen3_vl.smart_resize, line for line)."""
        factor, tf = self.factor, self.temporal_patch_size
        if self.cap_pixels_per_frame:
            frame_cap = self.max_video_tokens * factor * factor
            hi = max(min(frame_cap, hi // n_frames), int(lo * 1.05)) * n_frames
        if n_frames < tf:
            raise VideoError(f"a Qwen3-VL video needs at least {tf} sampled frames (temporal_patch_size), got "
                             f"{n_frames}", param=PARAM)
        return frames_smart_resize(n_frames, height, width, temporal_factor=tf, factor=factor, min_pixels=lo,
                                   max_pixels=hi, error=VideoError, param=PARAM, subject="video frames")

    def timestamps(self, indices, video_fps: float) -> tuple[float, ...]:
        """Qwen3VLProcessor._calculate_timestamps: frame index / fps, the indices padded with the
        last up to a multiple of temporal_patch_size, then the mean of each patch's first and
        last frame time (Python floats, as HF; the prompt prints them with one decimal)."""
        tp = self.temporal_patch_size
        idx = [int(i) for i in indices]
        if len(idx) % tp:
            idx += [idx[-1]] * (tp - len(idx) % tp)
        t = [i / video_fps for i in idx]
        return tuple((t[i] + t[i + tp - 1]) / 2 for i in range(0, len(t), tp))

    def plan(self, meta: VideoMeta, *, min_pixels: int | None = None, max_pixels: int | None = None,
             fps: float | None = None) -> VideoPlan:
        """Frames, resized size, grid, token count and timestamps from the metadata alone."""
        lo, hi = self.bounds(min_pixels, max_pixels)
        video_fps = float(meta.fps) if meta.fps else QWEN3_VIDEO_FPS_UNKNOWN
        indices = [int(i) for i in self.sample_indices(meta.total_frames, video_fps, fps)]
        if not indices:
            raise VideoError("video has no frames to sample", param=PARAM)
        n = len(indices)
        rh, rw = self.resized_size(n, meta.height, meta.width, lo, hi)
        gt = (n + (-n % self.temporal_patch_size)) // self.temporal_patch_size
        gh, gw = rh // self.patch_size, rw // self.patch_size
        key = ("qwen3_vl_video", tuple(indices), video_fps, lo, hi, self.cap_pixels_per_frame, self.max_video_tokens,
               self.patch_size, self.temporal_patch_size, self.merge_size, self.do_rescale, self.rescale_factor,
               self.do_normalize, self.image_mean, self.image_std)
        return VideoPlan(tuple(indices), (rh, rw), (gt, gh, gw), gt * gh * gw // self.merge_size ** 2,
                         n / meta.total_frames * video_fps, key, self.timestamps(indices, video_fps))


def patchify_video(frames: np.ndarray, patch: int, merge: int, temporal: int) -> np.ndarray:
    """float32 [n, H, W, C] -> [gt*gh*gw, C*temporal*patch*patch] (Qwen2VLVideoProcessor.patchify:
    the last frame repeated up to a multiple of `temporal`; rows over (t, merge blocks, patches in
    a block), each row (C, t, ph, pw))."""
    n, h, w, c = frames.shape
    if pad := -n % temporal:
        frames = np.concatenate([frames, np.repeat(frames[-1:], pad, axis=0)])
        n += pad
    gt, gh, gw = n // temporal, h // patch, w // patch
    x = frames.reshape(gt, temporal, gh // merge, merge, patch, gw // merge, merge, patch, c)
    x = x.transpose(0, 2, 5, 3, 6, 8, 1, 4, 7)   # (gt, gh/m, gw/m, mh, mw, C, t, ph, pw)
    return np.ascontiguousarray(x).reshape(gt * gh * gw, c * temporal * patch * patch)


def find_video_processor_config(model_dir) -> dict | None:
    """The video processor config of a checkpoint directory, or None (then the class defaults):
    processor_config.json["video_processor"] (transformers v5 processor saves) first, then
    video_preprocessor_config.json (standalone video processor saves)."""
    from pathlib import Path

    from mmjax.image.processors import _read_json

    d = Path(model_dir)
    if (d / "processor_config.json").is_file():
        nested = _read_json(d / "processor_config.json").get("video_processor")
        if isinstance(nested, dict):
            return nested
    if (d / "video_preprocessor_config.json").is_file():
        return _read_json(d / "video_preprocessor_config.json")
    return None
