"""Untrusted video -> container metadata (before any pixel is decoded) and the sampled frames.

Host code only (PyAV), never traced. Two stages, so that every limit that can be known from the
container is checked before decoding:

1. `probe_video`: bytes / data URI / local path / a list of frames -> `VideoClip` (metadata: frame
   count, fps, duration, declared size, codec, content hash). Byte, duration, frame-count and
   declared-resolution limits (the video-bomb guard) and the codec allow-list apply here.
   The family then plans which frames it samples and how many tokens they make
   (`Family.plan_video`), still without decoding.
2. `decode_frames`: decode the container once from the start (no seeking: seeks land on keyframes
   and differ between demuxers) up to the last sampled frame, converting only the sampled frames
   to RGB (`frame.to_ndarray(format="rgb24")`, as transformers' PyAV reader does), under a
   wall-clock deadline checked per frame.

Frame counting follows transformers' `read_video_pyav`: `stream.frames` and `stream.average_rate`
(frames the header does not count are estimated from the stream / container duration).
"""
from __future__ import annotations

import base64
import binascii
import hashlib
import io
import os
import re
import struct
import time
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from mmjax.errors import VideoError, VideoTooLargeError

__all__ = ["VideoClip", "VideoLimits", "VideoMeta", "decode_frames", "probe_video", "DEFAULT_CODECS"]

PARAM = "video_url"   # the OpenAI request field every video error points at

# Decoders a client plausibly needs; everything else FFmpeg can decode (hundreds of legacy and
# exotic codecs, each its own attack surface) is refused.
DEFAULT_CODECS = ("h264", "hevc", "vp8", "vp9", "av1", "mpeg4", "mpeg1video", "mpeg2video", "mjpeg", "theora")


@dataclass(frozen=True)
class VideoLimits:
    """Limits on one input video.

    max_bytes: encoded size. max_duration_s: declared duration. max_stream_frames: frames the
    container declares (decoding walks every frame up to the last sampled one). max_frames: frames
    sampled from one video (what the vision tower sees). max_pixels: declared and decoded
    width*height of a frame (video-bomb guard, checked before decoding). decode_timeout_s:
    wall-clock budget for decoding one video. codecs: FFmpeg decoder names accepted.
    max_decoded_bytes: the sampled frames as RGB (frames x width x height x 3), checked before
    decoding (the token budget bounds the frames, this bounds their memory at full resolution).
    """
    max_bytes: int = 100 * 2**20
    max_duration_s: float = 3600.0
    max_stream_frames: int = 216_000          # one hour at 60 fps
    max_frames: int = 768                     # Qwen2VLVideoProcessor.max_frames
    max_pixels: int = 4096 * 2304             # 4K UHD (DCI) fits
    decode_timeout_s: float = 60.0
    codecs: tuple[str, ...] = DEFAULT_CODECS
    max_decoded_bytes: int = 2 * 2**30

    def __post_init__(self) -> None:
        for name in ("max_bytes", "max_duration_s", "max_stream_frames", "max_frames", "max_pixels",
                     "decode_timeout_s", "max_decoded_bytes"):
            if not getattr(self, name) > 0:
                raise ValueError(f"VideoLimits.{name} must be positive, got {getattr(self, name)!r}")


@dataclass(frozen=True)
class VideoMeta:
    """What the container says, before decoding: frames, fps (None: unknown, a list of frames
    without one), duration in seconds, frame size, codec, and the content hash (sha256 of the
    encoded bytes, or of the frames' pixels for a list of frames)."""
    total_frames: int
    fps: float | None
    duration: float
    height: int
    width: int
    codec: str
    key: str


@dataclass
class VideoClip:
    """A probed video: metadata plus the encoded bytes (or the already decoded frames)."""
    meta: VideoMeta
    data: bytes | None = None
    frames: np.ndarray | None = None          # uint8 [T, H, W, 3] for a list of frames


def _av():
    try:
        import av
    except ImportError as e:  # pragma: no cover - av is a dependency
        raise VideoError("video input needs PyAV (pip install av)", param=PARAM) from e
    return av


def _too_many_bytes(n: int, limits: VideoLimits) -> VideoTooLargeError:
    return VideoTooLargeError(f"video is {n} bytes, over the limit of {limits.max_bytes} bytes", param=PARAM)


def _data_uri_bytes(uri: str, limits: VideoLimits) -> bytes:
    header, sep, payload = uri[5:].partition(",")
    if not sep:
        raise VideoError("malformed data URI: no ',' between header and data", param=PARAM)
    parts = [p.strip().lower() for p in header.split(";")]
    if not (parts[0].startswith("video/") or parts[0] == "application/octet-stream"):
        raise VideoError(f"data URI media type must be video/*, got {parts[0] or 'none'!r}", param=PARAM)
    if "base64" not in parts[1:]:
        raise VideoError("video data URI must be base64-encoded (';base64,')", param=PARAM)
    payload = re.sub(r"\s+", "", payload)
    if len(payload) // 4 * 3 > limits.max_bytes + 3:
        raise _too_many_bytes(len(payload) // 4 * 3, limits)
    try:
        return base64.b64decode(payload + "=" * (-len(payload) % 4), validate=True)
    except (binascii.Error, ValueError) as e:
        raise VideoError(f"data URI is not valid base64: {e}", param=PARAM) from None


def _read_path(path: str | os.PathLike, limits: VideoLimits) -> bytes:
    try:
        if os.stat(path).st_size > limits.max_bytes:
            raise _too_many_bytes(os.stat(path).st_size, limits)
        with open(path, "rb") as f:
            return f.read(limits.max_bytes + 1)
    except FileNotFoundError:
        raise VideoError(f"video file not found: {os.fspath(path)!r}", param=PARAM) from None
    except IsADirectoryError:
        raise VideoError(f"video path is a directory: {os.fspath(path)!r}", param=PARAM) from None
    except OSError as e:
        raise VideoError(f"cannot read video file {os.fspath(path)!r}: {e.strerror or e}", param=PARAM) from None


def _frames_array(frames: Sequence[Any], limits: VideoLimits) -> np.ndarray:
    """A list of PIL images / uint8 arrays [H, W, 3] (or one uint8 array [T, H, W, 3]) -> uint8 [T, H, W, 3]."""
    from PIL import Image

    out = []
    for i, f in enumerate(frames):
        if isinstance(f, Image.Image):
            if f.width * f.height > limits.max_pixels:
                raise VideoTooLargeError(f"frame {i} is {f.width}x{f.height}, over max_pixels={limits.max_pixels}",
                                         param=PARAM)
            f = np.asarray(f.convert("RGB"))
        f = np.asarray(f)
        if f.dtype != np.uint8 or f.ndim != 3 or f.shape[-1] != 3:
            raise VideoError(f"frame {i} must be an RGB PIL image or uint8 [H, W, 3], got {f.dtype} {f.shape}",
                             param=PARAM)
        if out and f.shape != out[0].shape:
            raise VideoError(f"frame {i} is {f.shape[1]}x{f.shape[0]}, the first frame "
                             f"{out[0].shape[1]}x{out[0].shape[0]}: all frames must have one size", param=PARAM)
        out.append(f)
    if not out:
        raise VideoError("video has no frames", param=PARAM)
    return np.stack(out)


def probe_video(source: Any, limits: VideoLimits = VideoLimits(), fps: float | None = None) -> VideoClip:
    """bytes / data URI / local path / list of frames (PIL or uint8 [H, W, 3]; `fps` may say their
    rate) -> VideoClip, every container-level limit checked and nothing decoded."""
    if isinstance(source, (list, tuple)) or (isinstance(source, np.ndarray) and source.ndim == 4):
        if len(source) > limits.max_frames:
            raise VideoTooLargeError(f"video has {len(source)} frames, over the limit of {limits.max_frames}",
                                     param=PARAM)
        frames = _frames_array(source, limits)
        t, h, w, _ = frames.shape
        if h * w > limits.max_pixels:
            raise VideoTooLargeError(f"frames are {w}x{h}, over max_pixels={limits.max_pixels}", param=PARAM)
        digest = hashlib.sha256(b"mmjax.frames8\0" + struct.pack("<III", t, h, w) + frames.tobytes()).hexdigest()
        return VideoClip(VideoMeta(t, fps, t / fps if fps else 0.0, h, w, "frames", digest), frames=frames)
    if isinstance(source, (bytes, bytearray, memoryview)):
        data = bytes(source)
    elif isinstance(source, str) and source[:5].lower() == "data:":
        data = _data_uri_bytes(source, limits)
    elif isinstance(source, str) and source[:8].lower().startswith(("http://", "https://")):
        raise VideoError("remote video URLs must be fetched by the server first; the offline API takes bytes, "
                         "a data: URI, a local path or a list of frames", param=PARAM)
    elif isinstance(source, (str, os.PathLike)):
        data = _read_path(source, limits)
    else:
        raise VideoError(f"unsupported video source type {type(source).__name__}", param=PARAM)
    if not data:
        raise VideoError("video data is empty", param=PARAM)
    if len(data) > limits.max_bytes:
        raise _too_many_bytes(len(data), limits)
    meta = _container_meta(data, limits)
    return VideoClip(meta, data=data)


def _open(data: bytes):
    av = _av()
    try:
        return av.open(io.BytesIO(data), mode="r", metadata_errors="ignore")
    except (av.error.FFmpegError, ValueError, OSError, UnicodeDecodeError) as e:
        raise VideoError(f"cannot open video (corrupt or unsupported container): {e}", param=PARAM) from None


def _container_meta(data: bytes, limits: VideoLimits) -> VideoMeta:
    with _open(data) as container:
        if not container.streams.video:
            raise VideoError("the file has no video stream", param=PARAM)
        stream = container.streams.video[0]
        codec = stream.codec_context.name if stream.codec_context is not None else None
        if codec not in limits.codecs:
            raise VideoError(f"video codec {codec!r} is not supported (accepted: {', '.join(limits.codecs)})",
                             param=PARAM)
        w, h = int(stream.width or 0), int(stream.height or 0)
        if w <= 0 or h <= 0:
            raise VideoError("the video stream declares no frame size", param=PARAM)
        if w * h > limits.max_pixels:
            raise VideoTooLargeError(f"video frames are {w}x{h} ({w * h} pixels), over the limit of "
                                     f"{limits.max_pixels} pixels", param=PARAM)
        rate = stream.average_rate or stream.guessed_rate
        fps = float(rate) if rate else 0.0
        if not fps > 0:
            raise VideoError("the video stream declares no frame rate", param=PARAM)
        total = int(stream.frames or 0)
        if total <= 0:  # e.g. Matroska/WebM headers do not count frames: estimate from the duration
            seconds = float(stream.duration * stream.time_base) if stream.duration and stream.time_base else (
                container.duration / 1e6 if container.duration else 0.0)
            total = int(round(seconds * fps))
        if total <= 0:
            raise VideoError("cannot tell how many frames the video has (no frame count or duration)", param=PARAM)
        duration = total / fps
        if duration > limits.max_duration_s:
            raise VideoTooLargeError(f"video is {duration:.1f} s long, over the limit of {limits.max_duration_s:g} s",
                                     param=PARAM)
        if total > limits.max_stream_frames:
            raise VideoTooLargeError(f"video has {total} frames, over the limit of {limits.max_stream_frames}",
                                     param=PARAM)
    digest = hashlib.sha256(b"mmjax.video\0" + data).hexdigest()
    return VideoMeta(total, fps, duration, h, w, codec, digest)


def decode_frames(clip: VideoClip, indices: Sequence[int], limits: VideoLimits = VideoLimits(),
                  deadline: float | None = None) -> np.ndarray:
    """The frames at `indices` (sorted, in [0, total_frames)) as uint8 [len(indices), H, W, 3].

    One pass from the start; only sampled frames are converted to RGB. Frames the header counted
    but the stream does not hold (a truncated file) repeat the last decoded one; a stream that
    yields no sampled frame at all, a frame over the pixel limit or of another size than the
    first, a decode error, or passing `deadline` (time.monotonic(); default: now +
    decode_timeout_s) is a VideoError."""
    indices = [int(i) for i in indices]
    if not indices:
        raise VideoError("no frames to decode", param=PARAM)
    if clip.frames is not None:
        return clip.frames[np.asarray(indices)]
    av = _av()
    deadline = time.monotonic() + limits.decode_timeout_s if deadline is None else deadline
    wanted: dict[int, int] = {}
    for i in indices:
        wanted[i] = wanted.get(i, 0) + 1
    last = max(indices)
    got: dict[int, np.ndarray] = {}
    shape = None
    with _open(clip.data) as container:
        stream = container.streams.video[0]
        stream.thread_type = "AUTO"
        try:
            for i, frame in enumerate(container.decode(stream)):
                if time.monotonic() > deadline:
                    raise VideoError(f"decoding the video took longer than {limits.decode_timeout_s:g} s",
                                     param=PARAM, code="video_decode_timeout")
                if i > last:
                    break
                if i not in wanted:
                    continue
                if frame.width * frame.height > limits.max_pixels:
                    raise VideoTooLargeError(f"frame {i} is {frame.width}x{frame.height}, over the limit of "
                                             f"{limits.max_pixels} pixels", param=PARAM)
                rgb = frame.to_ndarray(format="rgb24")
                if shape is not None and rgb.shape != shape:
                    raise VideoError(f"frame {i} is {rgb.shape[1]}x{rgb.shape[0]}, earlier frames "
                                     f"{shape[1]}x{shape[0]}: frame size changes are not supported", param=PARAM)
                shape = rgb.shape
                got[i] = rgb
        except av.error.FFmpegError as e:
            if not got:
                raise VideoError(f"cannot decode video: {e}", param=PARAM) from None
    if not got:
        raise VideoError("the video stream holds no decodable frame", param=PARAM)
    out, prev = [], None
    for i in indices:
        prev = got.get(i, prev)
        if prev is None:      # a sampled frame before the first decodable one
            prev = got[min(got)]
        out.append(prev)
    return np.stack(out)
