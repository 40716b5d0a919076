"""transformers' Glm4vVideoProcessor (GLM-4.1V, GLM-4.5V) and Glm46VVideoProcessor (GLM-4.6V) with
the frame text their processors write.

Sampling (`sample_indices`): GLM-4.1V takes `fps` frames per second of a video up to `max_duration`
seconds (index ceil(i * video_fps / fps)), a longer one `max_duration * fps` frames spread over
it; GLM-4.6V picks its own rate from the duration (3 / 1 / 0.5 frames per second up to 30 / 300 /
2400 s, at most 640 frames) and walks the frame times. Both drop repeated indices and repeat the
last to an even count. The frames are resized together by GLM's smart_resize with t = the number of
sampled frames (image/glm4v.py: the bounds cover all of them), with Qwen2-VL's video resize,
normalization and temporal patchify (video/processors.py). The processor writes each temporal
patch as `<|begin_of_image|>` + its `<|image|>` tokens + `<|end_of_image|>` + the time of its first
frame (`int(seconds)`; GLM-4.6V: `{seconds:.1f} seconds`): `VideoPlan.timestamps` holds those times.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from mmjax.errors import VideoError
from mmjax.image.glm4v import glm_smart_resize
from mmjax.video.decode import PARAM, VideoMeta
from mmjax.video.processors import Qwen2VLVideoPolicy, VideoPlan, _shared_fields

UNKNOWN_FPS = 24.0      # the rate GLM's processor assumes for frames given without one


@dataclass(frozen=True)
class Glm4vVideoPolicy(Qwen2VLVideoPolicy):
    """Glm4vVideoProcessor's settings (class defaults where the config has none); `dynamic`:
    Glm46VVideoProcessor's sampling."""
    min_pixels: int = 112 * 112
    max_pixels: int = 28 * 28 * 2 * 30000
    max_duration: int = 300
    dynamic: bool = False

    @classmethod
    def from_config(cls, cfg: dict | None, dynamic: bool = False) -> "Glm4vVideoPolicy":
        d = cls(dynamic=dynamic)
        if not cfg:
            return d
        size = cfg.get("size") if isinstance(cfg.get("size"), dict) else {}
        fields = _shared_fields(cfg, d, cfg.get("fps") or d.fps, None)
        return cls(min_pixels=int(size.get("shortest_edge") or d.min_pixels),
                   max_pixels=int(size.get("longest_edge") or d.max_pixels),
                   max_duration=int(cfg.get("max_duration") or d.max_duration), dynamic=dynamic, **fields)

    def sample_indices(self, total: int, video_fps: float | None, fps: float | None = None,
                       duration: float | None = None) -> np.ndarray:
        """The processor's sample_frames (module docstring); duration: the metadata's (None: HF's
        round((total - 1) / fps) + 1)."""
        if not self.do_sample_frames:
            return np.arange(total)
        video_fps = float(video_fps or UNKNOWN_FPS)
        max_idx = total - 1
        duration = duration or round(max_idx / video_fps) + 1
        idx = self._dynamic(total, video_fps, duration) if self.dynamic else \
            self._fixed(total, video_fps, duration, self.fps if fps is None else fps)
        uniq = list(dict.fromkeys(int(i) for i in idx))
        if len(uniq) & 1:
            uniq.append(uniq[-1])
        return np.asarray(uniq, np.int64)

    def _fixed(self, total: int, video_fps: float, duration: float, fps: float) -> list[int]:
        max_idx = total - 1
        if duration <= self.max_duration:
            n = max(int(math.floor(duration * fps)), 1)
            return [min(max_idx, int(math.ceil(i * video_fps / fps))) for i in range(n)]
        n = int(self.max_duration * fps)
        if n >= total:
            return list(range(total))
        return [min(max_idx, int(math.ceil(t * video_fps))) for t in np.linspace(0, duration, n, endpoint=True)]

    def _dynamic(self, total: int, video_fps: float, duration: float) -> list[int]:
        effective = min(duration, 2400)
        target = 3 if effective <= 30 else 1 if effective <= 300 else 0.5
        extract = min(int(effective * target * self.temporal_patch_size), 640)
        times = [i * (1 / video_fps) for i in range(total)]
        if total < extract:
            idx = np.linspace(0, total - 1, extract, dtype=int).tolist()
        else:
            idx, current, inv = [], 0, 1 / (self.temporal_patch_size * target)
            for i in range(total):
                if times[i] >= current:
                    current += inv
                    idx.append(i)
                    if current >= int(duration):
                        break
        if len(idx) < extract:
            start, end = (0, max(total - 1, 0)) if not idx else (idx[0], idx[-1])
            idx = np.linspace(start, end, extract, dtype=int).tolist()
        elif len(idx) > extract:
            idx = np.linspace(0, total - 1, extract, dtype=int).tolist()
        return idx

    def plan(self, meta: VideoMeta, *, min_pixels: int | None = None, max_pixels: int | None = None,
             fps: float | None = None) -> VideoPlan:
        """Frames, resized size, grid, token count and each temporal patch's time from the metadata."""
        lo, hi = self.bounds(min_pixels, max_pixels)
        video_fps = float(meta.fps) if meta.fps else UNKNOWN_FPS
        # a container's duration as transformers' PyAV loader gives it (frames / rate); frames
        # given with a rate carry none (the processor's rounding rule)
        duration = meta.total_frames / video_fps if meta.codec != "frames" else None
        indices = [int(i) for i in self.sample_indices(meta.total_frames, video_fps, fps, duration)]
        if not indices:
            raise VideoError("video has no frames to sample", param=PARAM)
        n = len(indices)
        rh, rw = glm_smart_resize(max(n, self.temporal_patch_size), meta.height, meta.width,
                                  temporal_factor=self.temporal_patch_size, factor=self.factor, min_pixels=lo,
                                  max_pixels=hi)
        gt = (n + (-n % self.temporal_patch_size)) // self.temporal_patch_size
        gh, gw = rh // self.patch_size, rw // self.patch_size
        stamps = tuple(i / video_fps for i in indices[::2])[:gt]
        stamps = stamps + (stamps[-1] if stamps else 0.0,) * (gt - len(stamps))
        key = ("glm4v_video", self.dynamic, tuple(indices), video_fps, lo, hi, self.patch_size,
               self.temporal_patch_size, self.merge_size, self.do_rescale, self.rescale_factor, self.do_normalize,
               self.image_mean, self.image_std)
        return VideoPlan(tuple(indices), (rh, rw), (gt, gh, gw), gt * gh * gw // self.merge_size ** 2,
                         n / meta.total_frames * video_fps, key, stamps)
