"""MiniCPM-V 4.6 / 4.7 video: a port of transformers' MiniCPMV4_6VideoProcessor (stack_frames 1).

Frames are sampled one per second (`int(i * fps)` for i < ceil(duration)); a video longer than
`max_num_frames` seconds is sampled every 0.1 s and thinned to `max_num_frames` with
`np.linspace(..., dtype=int)`. Every frame is then sliced like an image (image/minicpmv.py's
arithmetic, with the video processor's own `scale_resolution` / `max_slice_nums`), resized with
torch's uint8 antialiased bicubic kernel (video/resample.py, what the torchvision backend runs)
and normalized the torchvision way (rescale fused into normalize: (x - mean / factor) / (std /
factor) in float32). All frames share one plan, so the token count is frames x the plan's tokens.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from mmjax.errors import UnsupportedModelError
from mmjax.image.minicpmv import MiniCPMVImagePolicy, SlicePlan
from mmjax.video.decode import VideoMeta
from mmjax.video.resample import resize_bicubic_aa


@dataclass(frozen=True)
class MiniCPMVVideoPolicy(MiniCPMVImagePolicy):
    max_num_frames: int = 128

    @classmethod
    def from_video_config(cls, cfg: dict | None) -> "MiniCPMVVideoPolicy":
        """video_preprocessor_config.json (None: MiniCPMV4_6VideoProcessor's defaults)."""
        cfg = dict(cfg or {})
        if int(cfg.get("stack_frames", 1) or 1) > 1:
            raise UnsupportedModelError("MiniCPM-V video processor stack_frames > 1 is not supported",
                                        param="stack_frames")
        if cfg.get("do_sample_frames") is False:
            raise UnsupportedModelError("MiniCPM-V video processor do_sample_frames=false is not supported",
                                        param="do_sample_frames")
        return cls.from_config(cfg, max_num_frames=int(cfg.get("max_num_frames", 128) or 128))

    def sample_indices(self, meta: VideoMeta) -> list[int]:
        """MiniCPMV4_6VideoProcessor.sample_frames with stack_frames 1 (module docstring); frames
        given without a rate are taken as sampled."""
        total, fps, duration = meta.total_frames, meta.fps, meta.duration
        if not fps:
            return list(range(total))
        if duration > self.max_num_frames:
            stamps = [round(i * 0.1, 1) for i in range(int(duration / 0.1))]
            main = [min(int(t * fps), total - 1) for t in stamps]
            if len(main) > self.max_num_frames:
                main = [main[i] for i in np.linspace(0, len(main) - 1, self.max_num_frames, dtype=int)]
            return main
        return [int(i * fps) for i in range(math.ceil(duration))]

    def _resize(self, src: np.ndarray, height: int, width: int) -> np.ndarray:
        return resize_bicubic_aa(src, height, width)

    def _finish(self, x: np.ndarray) -> np.ndarray:
        x = x.astype(np.float32)
        if self.do_rescale and self.do_normalize:
            inv = np.float32(1.0 / self.rescale_factor)
            mean = np.asarray(self.image_mean, np.float32) * inv
            std = np.asarray(self.image_std, np.float32) * inv
            return np.ascontiguousarray((x - mean) / std)
        if self.do_rescale:
            return x * np.float32(self.rescale_factor)
        if self.do_normalize:
            return (x - np.asarray(self.image_mean, np.float32)) / np.asarray(self.image_std, np.float32)
        return x

    def frame_views(self, frames: np.ndarray, plan: SlicePlan) -> list[np.ndarray]:
        """uint8 frames [n, H, W, 3] -> every frame's views in order (frame-major)."""
        return [v for f in frames for v in self.views(f, plan)]
