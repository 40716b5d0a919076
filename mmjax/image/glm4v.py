"""transformers' Glm4vImageProcessor (GLM-4.1V, GLM-4.5V, GLM-4.6V): Qwen2-VL's pipeline (resize to
multiples of patch * merge, rescale, normalize, patchify with the frame repeated over the temporal
patch) with GLM's own smart_resize: sides under one factor are scaled up first, and the pixel
bounds apply to t_bar * h * w with t = temporal_patch_size frames (an image counts as two frames),
so an image takes about half the tokens of Qwen's rule at the same `max_pixels`."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mmjax.errors import ImageError
from mmjax.image.processors import Qwen2VLImagePolicy, frames_smart_resize


def glm_smart_resize(num_frames: int, height: int, width: int, *, temporal_factor: int, factor: int,
                     min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """transformers' glm4v smart_resize (`frames_smart_resize`; fewer frames than the temporal
    patch refused)."""
    if height > 0 and width > 0 and num_frames < temporal_factor:
        raise ImageError(f"{num_frames} frames is fewer than the temporal patch {temporal_factor}", param="images")
    return frames_smart_resize(num_frames, height, width, temporal_factor=temporal_factor, factor=factor,
                               min_pixels=min_pixels, max_pixels=max_pixels)


@dataclass(frozen=True)
class Glm4vImagePolicy(Qwen2VLImagePolicy):
    """Glm4vImageProcessor(Pil): min / max pixels are its size.shortest_edge / longest_edge
    (class defaults 112 * 112 and 28 * 28 * 15000), over two frames' worth of pixels."""
    min_pixels: int = 112 * 112
    max_pixels: int = 28 * 28 * 15000

    @classmethod
    def from_config(cls, cfg: dict) -> "Glm4vImagePolicy":
        base = Qwen2VLImagePolicy.from_config(cfg)
        d = cls()
        size = cfg.get("size") if isinstance(cfg.get("size"), dict) else {}
        fields: dict[str, Any] = {k: getattr(base, k) for k in base.__dataclass_fields__}
        fields["min_pixels"] = int(size.get("shortest_edge") or cfg.get("min_pixels") or d.min_pixels)
        fields["max_pixels"] = int(size.get("longest_edge") or cfg.get("max_pixels") or d.max_pixels)
        return cls(**fields)

    def resized_size(self, height: int, width: int, *, min_pixels: int | None = None,
                     max_pixels: int | None = None) -> tuple[int, int]:
        lo, hi = self._bounds(min_pixels, max_pixels)
        if not self.do_resize:
            return super().resized_size(height, width, min_pixels=lo, max_pixels=hi)
        tp = self.temporal_patch_size
        return glm_smart_resize(tp, height, width, temporal_factor=tp, factor=self.factor, min_pixels=lo,
                                max_pixels=hi)

    def cache_key(self, *, min_pixels: int | None = None, max_pixels: int | None = None) -> tuple:
        return ("glm4v",) + super().cache_key(min_pixels=min_pixels, max_pixels=max_pixels)
