"""Synthetic test videos written with PyAV, and the transformers reference of Qwen2VLVideoProcessor.

Videos: moving colored shapes (a red disc, a green bar, a blue square on a gradient), non-square.

Reference: transformers 5.23's Qwen2VLVideoProcessor cannot be constructed here (it needs
torchvision, whose PyPI wheel does not load against this torch build), so `hf_video_inputs` runs
its steps with transformers' own pieces where they exist: `transformers.video_utils.load_video`
(its PyAV backend: the real HF decode, frame counting and metadata) with the processor's
`sample_frames` transcribed below line for line, transformers' `smart_resize`, the resize that
`torchvision.transforms.v2.functional.resize` performs for uint8 bicubic antialiased frames on
CPU (`torch.nn.functional.interpolate` on the uint8 tensor: the same torch kernel), the fused
rescale + normalize of the torchvision backend, and `patchify` transcribed from the processor.
"""
from __future__ import annotations

import math

import numpy as np


def write_video(path, n_frames: int, fps: int, width: int, height: int, codec: str = "libx264",
                seed: int = 0) -> str:
    """An mp4 of moving colored shapes (yuv420p; width and height even)."""
    import av

    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:height, 0:width]
    base = np.stack([xx * 255 // max(1, width - 1), yy * 255 // max(1, height - 1),
                     np.full_like(xx, 96)], -1).astype(np.uint8)
    phase = rng.uniform(0, 2 * np.pi, 3)
    with av.open(str(path), mode="w") as out:
        stream = out.add_stream(codec, rate=fps)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        if codec == "libx264":
            stream.options = {"preset": "ultrafast", "crf": "18"}
        for t in range(n_frames):
            img = base.copy()
            cx = int(width * (0.5 + 0.35 * np.sin(phase[0] + t * 0.5)))
            cy = int(height * (0.5 + 0.3 * np.cos(phase[1] + t * 0.4)))
            img[(xx - cx) ** 2 + (yy - cy) ** 2 < (height // 5) ** 2] = (230, 30, 40)
            bx = (t * 5) % width
            img[:, bx:bx + 6] = (20, 200, 60)
            sx, sy = (t * 3) % max(1, width - 12), (t * 2) % max(1, height - 12)
            img[sy:sy + 12, sx:sx + 12] = (30, 40, 220)
            frame = av.VideoFrame.from_ndarray(img, format="rgb24")
            for packet in stream.encode(frame):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
    return str(path)


def hf_sample_frames(metadata, cfg: dict, fps: float | None = None):
    """Qwen2VLVideoProcessor.sample_frames (transformers 5.23), fps branch, line for line."""
    import torch

    temporal_patch_size = cfg["temporal_patch_size"]
    min_frames, max_frames = cfg["min_frames"], cfg["max_frames"]
    fps = cfg["fps"] if fps is None else fps
    total_num_frames = metadata.total_num_frames
    max_frames = math.floor(min(max_frames, total_num_frames) / temporal_patch_size) * temporal_patch_size
    num_frames = total_num_frames / metadata.fps * fps
    num_frames = min(max(num_frames, min_frames), max_frames, total_num_frames)
    num_frames = math.floor(num_frames / temporal_patch_size) * temporal_patch_size
    assert num_frames <= total_num_frames
    return torch.arange(0, total_num_frames, total_num_frames / num_frames).int()


def hf_video_inputs(videos, cfg: dict, tokens_per_second_model: bool = False) -> dict:
    """videos: paths (decoded by transformers' PyAV loader), uint8 frame arrays [T, H, W, 3]
    (taken whole, HF's list-of-frames input without metadata) or {"frames": [...], "fps": rate}
    (an array video with its VideoMetadata: sampled like a file). -> {"pixel_values_videos", "video_grid_thw",
    "second_per_grid_ts", "frames" (decoded uint8, for comparison)} as Qwen2VLVideoProcessor +
    Qwen2_5_VLProcessor produce them."""
    import torch
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize
    from transformers.video_utils import VideoMetadata, load_video

    p, m, tp = cfg["patch_size"], cfg["merge_size"], cfg["temporal_patch_size"]
    mean = torch.tensor(cfg["image_mean"]) * (1.0 / cfg["rescale_factor"])
    std = torch.tensor(cfg["image_std"]) * (1.0 / cfg["rescale_factor"])
    pixel_values, grids, spg, frames_out = [], [], [], []
    for v in videos:
        if isinstance(v, str):
            video, meta = load_video(v, backend="pyav", sample_indices_fn=lambda metadata, **kw: hf_sample_frames(
                metadata, cfg))
            sampled_fps = meta.sampled_fps
        elif isinstance(v, dict):
            # an array video with video_metadata (its rate): BaseVideoProcessor samples it with
            # sample_frames and sets metadata.frames_indices (_decode_and_sample_videos)
            frames = np.stack([np.asarray(f) for f in v["frames"]])
            meta = VideoMetadata(total_num_frames=len(frames), fps=float(v["fps"]), height=frames.shape[1],
                                 width=frames.shape[2])
            meta.frames_indices = hf_sample_frames(meta, cfg)
            video, sampled_fps = frames[meta.frames_indices.numpy()], meta.sampled_fps
        else:
            video, sampled_fps = np.asarray(v), 24.0   # VideoMetadata.sampled_fps without metadata
        frames_out.append(video)
        x = torch.from_numpy(np.ascontiguousarray(video)).permute(0, 3, 1, 2).contiguous()   # [T, C, H, W] uint8
        rh, rw = smart_resize(x.shape[-2], x.shape[-1], factor=p * m, min_pixels=cfg["size"]["shortest_edge"],
                              max_pixels=cfg["size"]["longest_edge"])
        x = torch.nn.functional.interpolate(x, size=(rh, rw), mode="bicubic", antialias=True, align_corners=False)
        x = (x.to(torch.float32) - mean[:, None, None]) / std[:, None, None]
        x = x[None]
        b, t, c, h, w = x.shape
        if pad := -t % tp:
            x = torch.cat((x, x[:, -1:].expand(-1, pad, -1, -1, -1)), dim=1)
            t += pad
        gt, gh, gw = t // tp, h // p, w // p
        patches = x.view(b, gt, tp, c, gh // m, m, p, gw // m, m, p).permute(0, 1, 4, 7, 5, 8, 3, 2, 6, 9)
        pixel_values.append(patches.reshape(gt * gh * gw, c * tp * p * p))
        grids.append([gt, gh, gw])
        spg.append(tp / sampled_fps)
    return {"pixel_values_videos": torch.cat(pixel_values), "video_grid_thw": torch.tensor(grids),
            "second_per_grid_ts": torch.tensor(spg), "frames": frames_out}
