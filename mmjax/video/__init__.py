"""Video input: untrusted containers -> probed metadata -> sampled frames -> a family's ImageInput.

`prepare_video(family, source, limits, opts)` is the one path the offline API and the server
share: probe the container (byte / duration / frame / resolution limits, codec allow-list),
let the family plan the frames and count the tokens (token budget checked before decoding),
decode only up to the last sampled frame under a deadline, and hand the frames to the family.
"""
from __future__ import annotations

import threading
import time
from collections import OrderedDict
from typing import Any

from mmjax.errors import InvalidRequestError, VideoTooLargeError
from mmjax.models.family import Family, ImageInput, VideoOptions
from mmjax.video.decode import PARAM, VideoClip, VideoLimits, VideoMeta, decode_frames, probe_video
from mmjax.video.processors import VideoPlan

__all__ = ["VideoCache", "VideoClip", "VideoLimits", "VideoMeta", "VideoOptions", "VideoPlan", "decode_frames",
           "plan_video", "prepare_video", "probe_video"]


class VideoCache:
    """Prepared videos by (family, content hash, frame plan), LRU-bounded in bytes: the same
    video asked again (same sampling and sizes) is not decoded again; the engine's encoder cache,
    keyed by the same content + plan, then skips its encode too. Thread-safe (videos are
    prepared in worker threads). Counters: `decodes` (videos decoded), `hits`, `decode_seconds`."""

    def __init__(self, max_bytes: int = 256 * 2**20):
        self.max_bytes = max_bytes
        self._items: OrderedDict = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self.hits = 0
        self.decodes = 0
        self.decode_seconds = 0.0

    def get(self, key: tuple) -> ImageInput | None:
        with self._lock:
            item = self._items.get(key)
            if item is not None:
                self._items.move_to_end(key)
                self.hits += 1
            return item

    def put(self, key: tuple, item: ImageInput, seconds: float) -> None:
        with self._lock:
            self.decodes += 1
            self.decode_seconds += seconds
            n = item.pixels.nbytes
            if n > self.max_bytes or key in self._items:
                return
            self._items[key] = item
            self._bytes += n
            while self._bytes > self.max_bytes:
                _, old = self._items.popitem(last=False)
                self._bytes -= old.pixels.nbytes

    def __len__(self) -> int:
        return len(self._items)


def plan_video(family: Family, source: Any, limits: VideoLimits = VideoLimits(),
               opts: VideoOptions = VideoOptions()) -> tuple[VideoClip, VideoPlan]:
    """Probe and plan without decoding: (clip, plan); every limit known from the metadata raises here."""
    fps = source.get("fps") if isinstance(source, dict) else None
    if isinstance(source, dict):
        for k in source:
            if k not in ("frames", "video", "fps"):
                raise InvalidRequestError(f"unknown video key {k!r} (known: frames, video, fps)", param=k)
        source = source.get("frames", source.get("video"))
    clip = probe_video(source, limits, fps=fps)
    plan = family.plan_video(clip.meta, opts)
    if len(plan.indices) > limits.max_frames:
        raise VideoTooLargeError(f"the video would be sampled at {len(plan.indices)} frames, over the limit of "
                                 f"{limits.max_frames}; lower fps", param=PARAM)
    n_bytes = len(plan.indices) * clip.meta.width * clip.meta.height * 3
    if n_bytes > limits.max_decoded_bytes:
        raise VideoTooLargeError(f"the {len(plan.indices)} sampled frames of {clip.meta.width}x{clip.meta.height} "
                                 f"would take {n_bytes} bytes decoded, over the limit of {limits.max_decoded_bytes}",
                                 param=PARAM)
    return clip, plan


def prepare_video(family: Family, source: Any, limits: VideoLimits = VideoLimits(),
                  opts: VideoOptions = VideoOptions(), deadline: float | None = None,
                  cache: VideoCache | None = None) -> ImageInput:
    """bytes / data URI / path / list of frames (or {"frames": [...], "fps": x}) -> ImageInput(kind="video").

    deadline: time.monotonic() by which decoding must be done (default: now + decode_timeout_s).
    cache: a VideoCache to reuse an earlier decode of the same video with the same plan."""
    t0 = time.monotonic()
    deadline = t0 + limits.decode_timeout_s if deadline is None else deadline
    clip, plan = plan_video(family, source, limits, opts)
    key = (family.name, clip.meta.key, plan.key)
    if cache is not None and (hit := cache.get(key)) is not None:
        return hit
    frames = decode_frames(clip, plan.indices, limits, deadline)
    item = family.prepare_video(frames, plan, clip.meta.key)
    if cache is not None:
        cache.put(key, item, time.monotonic() - t0)
    return item
