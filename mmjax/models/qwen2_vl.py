"""Qwen2-VL and Qwen2.5-VL (Qwen2VLForConditionalGeneration, Qwen2_5_VLForConditionalGeneration).

The vision tower and its packing live in models/vision/qwen2_vl.py; the decoder is the Llama
text model with M-RoPE (temporal / height / width position rows, `positions` below).

Images never change shape inside a compiled step: the token count of an image is known from its
size before the vision tower runs (`Qwen2VLImagePolicy.num_tokens`), so over-budget requests
(`image_max_tokens`) are rejected in `prepare_image` with a ContextLengthError.

Video (`<|video_pad|>` tokens): `plan_video` samples frames and sizes them from the container
metadata (`mmjax.video.processors.Qwen2VLVideoPolicy`, Qwen2VLVideoProcessor's rules), so the
token count and the `video_max_tokens` check come before decoding; the decoded frames become
patches with grid t = frames / temporal_patch_size and go through the same packed encode as
images (one attention segment per temporal patch, as HF's cu_seqlens). Positions follow HF
5.23's get_rope_index: Qwen2-VL counts temporal patches 0, 1, 2...; Qwen2.5-VL spaces them by
`tokens_per_second * second_per_grid_t` (absolute time, second_per_grid_t =
temporal_patch_size / sampled fps); text resumes at start + max(grid_h, grid_w) / merge after
any image or video (HF 5.23; Qwen's original code resumed after the largest position).

Modules (`Qwen2VLModel`, transformers' Qwen2VLModel tree): `visual` (models/vision/qwen2_vl.py)
and `language_model` (text/llama.py's LlamaModel with M-RoPE, its `lm_head` included).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from mmjax.buckets import bucket_for
from mmjax.checkpoint import TensorSource
from mmjax.errors import CheckpointError, ContextLengthError, InvalidRequestError, UnsupportedModelError
from mmjax.image.decode import pixel_hash
from mmjax.image.processors import Qwen2VLImagePolicy, digest, find_image_processor_config, load_policy, patchify
from mmjax.models.family import EncodeCall, Family, ImageInput, ImageOptions, VideoOptions, VisionLanguageModel
from mmjax.models.hf_config import tie_word_embeddings
from mmjax.models.nn.weights import build, load_module
from mmjax.models.text.llama import LlamaConfig
from mmjax.models.vision.qwen2_vl import (QwenVisionConfig, Qwen2VisionTransformer, pack_images, patch_ladder,
                                          unpack_features)
from mmjax.video.processors import Qwen2VLVideoPolicy, VideoPlan, find_video_processor_config

DEFAULT_MROPE_SECTION = (16, 24, 24)  # HF's default when the config has none


@dataclass(frozen=True)
class QwenVLConfig:
    vision: QwenVisionConfig
    text: LlamaConfig
    image_token_id: int
    vision_start_token_id: int | None
    model_type: str
    video_token_id: int | None = None
    tokens_per_second: float = 4.0   # Qwen2.5-VL: M-RoPE temporal positions per second of video

    @classmethod
    def from_hf(cls, cfg: dict) -> "QwenVLConfig":
        mt = cfg.get("model_type")
        if mt not in ("qwen2_vl", "qwen2_5_vl"):
            raise UnsupportedModelError(f"config.json: model_type={mt!r} is not Qwen2-VL", param="model_type")
        # v5 saves nest the decoder in text_config; the original hub configs keep it at top level.
        flat = {k: v for k, v in cfg.items() if k not in ("text_config", "vision_config")}
        text_src = {**flat, **(cfg.get("text_config") or {}), "model_type": "qwen2"}
        tie = tie_word_embeddings(cfg, cfg.get("text_config"))
        text = LlamaConfig.from_hf(text_src, "text_config", tie_word_embeddings=tie)
        # Qwen2-VL attention: q/k/v always biased, head_dim = hidden // heads (config head_dim unused).
        section = text.rope.mrope_section or DEFAULT_MROPE_SECTION
        head_dim = text.hidden_size // text.num_heads
        if sum(section) != head_dim // 2:
            raise CheckpointError(f"config.json: rope_parameters.mrope_section={list(section)} must sum to "
                                  f"head_dim/2={head_dim // 2}", param="text_config.rope_parameters.mrope_section")
        text = dataclasses.replace(text, attention_bias=True, mlp_bias=False, head_dim=head_dim,
                                   rope=dataclasses.replace(text.rope, mrope_section=tuple(section)))
        vision = QwenVisionConfig.from_hf(cfg.get("vision_config") or {}, mt)
        if vision.out_hidden_size != text.hidden_size:
            raise CheckpointError(f"config.json: vision output size {vision.out_hidden_size} != text hidden size "
                                  f"{text.hidden_size}", param="vision_config.hidden_size")
        token = cfg.get("image_token_id", (cfg.get("text_config") or {}).get("image_token_id"))
        if token is None:
            raise CheckpointError("config.json: image_token_id is missing", param="image_token_id")
        video = cfg.get("video_token_id", (cfg.get("text_config") or {}).get("video_token_id"))
        tps = (cfg.get("vision_config") or {}).get("tokens_per_second")
        return cls(vision=vision, text=text, image_token_id=int(token),
                   vision_start_token_id=cfg.get("vision_start_token_id"), model_type=mt,
                   video_token_id=None if video is None else int(video),
                   tokens_per_second=4.0 if tps is None else float(tps))


def normalize_name(name: str) -> str:
    """Every Qwen2-VL naming seen (v4 hub files: `model.layers.*`, `visual.*`; v5 in-memory names:
    `model.language_model.*`, `model.visual.*`) -> `model.*`, `visual.*`, `lm_head.weight`."""
    for old, new in (("model.language_model.", "model."), ("model.visual.", "visual."),
                     ("language_model.model.", "model."), ("language_model.lm_head.", "lm_head.")):
        if name.startswith(old):
            return new + name[len(old):]
    return name


class Qwen2VLModel(VisionLanguageModel):
    """Qwen2VLForConditionalGeneration / Qwen2_5_VLForConditionalGeneration: `visual` (the packed
    vision tower with its merger) and `language_model` (the M-RoPE decoder with its lm_head).
    attn_impl: the tower's attention impl ("auto")."""

    def __init__(self, cfg: QwenVLConfig, dtype=jnp.float32, attn_impl: str = "auto"):
        self.config = cfg
        self.visual = self.make_visual(cfg, dtype, attn_impl)
        self.language_model = cfg.text.build(dtype)

    @staticmethod
    def make_visual(cfg, dtype, attn_impl: str) -> nnx.Module:
        return Qwen2VisionTransformer(cfg.vision, dtype, attn_impl)

    def encode(self, packed: tuple) -> jax.Array:
        """The compiled encode step: one packed group (the tower's inputs: patches, pos_hw,
        image_seg and window_seg, or Qwen3-VL's sizes_hw) -> merged tokens [n_pad / merge**2,
        feature width] in the decoder's dtype (window order for Qwen2.5-VL); with a leading
        [shards] axis on every array (`encode_plan(shards=)` > 1), one packed group per shard."""
        if packed[0].ndim == 3:
            out = jax.vmap(lambda p: self.visual(*p))(tuple(packed))
        else:
            out = self.visual(*packed)
        return out.astype(self.embed_dtype)

    def hf_weights(self, w, name: str = "") -> None:
        """Tensor names as `normalize_name` maps them (`visual.*`, `model.*`, `lm_head.weight`)."""
        load_module(self.visual, w, "visual")
        self.language_model.hf_weights(w, "model", "lm_head.weight")


# ------------------------------------------------------------------------------------------------
# Family
# ------------------------------------------------------------------------------------------------

@dataclass
class QwenLimits:
    """Server-wide image controls. Per-request options (prepare_image) may move the pixel bounds
    and lower the token budget; every image is checked against the effective budget before any
    resize or encode.

    min_pixels / max_pixels: default smart_resize bounds (None: the checkpoint's preprocessor
        config, HF's 56*56 .. 28*28*1280 = 1280 tokens).
    image_max_tokens: hard cap on the LLM tokens of one image (like llama.cpp --image-max-tokens);
        None: max(max_encode_patches / merge**2, max_pixels / (patch*merge)**2), i.e. 4096 tokens
        (3.2 Mpixel) with the defaults, so per-request max_pixels up to that size work and larger
        ones (native 4K is 10549 tokens) need the operator to raise it.
    max_encode_patches: patches packed into one encode call (images are never split; the top
        bucket also covers one image at the token cap).
    """
    min_pixels: int | None = None
    max_pixels: int | None = None
    image_max_tokens: int | None = None
    max_encode_patches: int = 16384
    video_max_tokens: int | None = None      # None: image_max_tokens (one video fits one encode call)
    video_min_pixels: int | None = None      # None: the video processor config's size range
    video_max_pixels: int | None = None


@dataclass(eq=False)
class QwenVLFamily(Family):
    """A loaded Qwen2-VL / Qwen2.5-VL model's family: dynamic resolution, packed encoding, M-RoPE."""
    cfg: QwenVLConfig
    policy: Qwen2VLImagePolicy
    limits: QwenLimits = field(default_factory=QwenLimits)
    image_token: str = "<|image_pad|>"
    video_policy: Qwen2VLVideoPolicy = field(default_factory=Qwen2VLVideoPolicy)

    @property
    def name(self) -> str:
        return self.cfg.model_type

    @property
    def image_token_id(self) -> int:
        return self.cfg.image_token_id

    @property
    def video_token_id(self) -> int | None:
        return self.cfg.video_token_id

    @property
    def video_token(self) -> str | None:
        return None if self.cfg.video_token_id is None else "<|video_pad|>"

    # ---- limits ----------------------------------------------------------------------------
    def configure(self, *, min_pixels: int | None = None, max_pixels: int | None = None,
                  image_max_tokens: int | None = None, max_encode_patches: int | None = None,
                  video_max_tokens: int | None = None, video_min_pixels: int | None = None,
                  video_max_pixels: int | None = None) -> "QwenVLFamily":
        """Set server-wide image / video limits (before serving; changes the encode bucket ladder)."""
        lim = dataclasses.replace(self.limits, **{k: v for k, v in dict(
            min_pixels=min_pixels, max_pixels=max_pixels, image_max_tokens=image_max_tokens,
            max_encode_patches=max_encode_patches, video_max_tokens=video_max_tokens,
            video_min_pixels=video_min_pixels, video_max_pixels=video_max_pixels).items() if v is not None})
        self.video_policy.bounds(lim.video_min_pixels, lim.video_max_pixels)  # validates
        for name in ("image_max_tokens", "max_encode_patches", "video_max_tokens"):
            v = getattr(lim, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v <= 0):
                raise InvalidRequestError(f"{name} must be a positive integer, got {v!r}", param=name)
        self.policy._bounds(lim.min_pixels, lim.max_pixels)  # validates
        self.limits = lim
        return self

    def pixel_bounds(self, min_pixels: int | None = None, max_pixels: int | None = None) -> tuple[int, int]:
        lo = min_pixels if min_pixels is not None else self.limits.min_pixels
        hi = max_pixels if max_pixels is not None else self.limits.max_pixels
        return self.policy._bounds(lo, hi)

    def fit_options(self, max_tokens: int) -> ImageOptions:
        """max_pixels = max_tokens merged tokens' worth of pixels, kept within the default bounds."""
        lo, hi = self.pixel_bounds()
        return ImageOptions(max_pixels=max(lo, min(hi, max_tokens * self.policy.factor ** 2)))

    @property
    def default_image_tokens(self) -> int:
        """Most tokens an image resized with the default bounds can take."""
        _, hi = self.pixel_bounds()
        return max(1, hi // self.policy.factor ** 2)

    @property
    def image_max_tokens(self) -> int:
        if self.limits.image_max_tokens is not None:
            return int(self.limits.image_max_tokens)
        return max(self.limits.max_encode_patches // self.cfg.vision.merge_size ** 2, self.default_image_tokens)

    @property
    def encode_ladder(self) -> tuple[int, ...]:
        """Patch buckets: x1.25 steps, plus one rung at the largest default-resized image (most
        real photos land just under it) and one at the token cap."""
        m2 = self.cfg.vision.merge_size ** 2
        cap = self.image_max_tokens * m2
        top = max(self.limits.max_encode_patches, cap, self.video_max_tokens * m2)
        return patch_ladder(top, extra=(self.default_image_tokens * m2, cap, self.video_max_tokens * m2))

    @property
    def video_max_tokens(self) -> int:
        """Hard cap on the LLM tokens of one video (default: image_max_tokens)."""
        if self.video_token_id is None:
            return 0
        v = self.limits.video_max_tokens
        return self.image_max_tokens if v is None else int(v)

    # ---- host: images -------------------------------------------------------------------------
    def num_tokens(self, height: int, width: int, opts: ImageOptions = ImageOptions()) -> int:
        lo, hi = self.pixel_bounds(opts.min_pixels, opts.max_pixels)
        return self.policy.num_tokens(height, width, min_pixels=lo, max_pixels=hi)

    def prepare_image(self, img, opts: ImageOptions = ImageOptions()) -> ImageInput:
        """Decoded RGB PIL image -> patches + grid (t, h, w) + exact token count + encoder-cache key.

        The token count is computed from the image size before any resize or encoding; an image
        over the budget raises ContextLengthError(param="image_max_tokens")."""
        lo, hi = self.pixel_bounds(opts.min_pixels, opts.max_pixels)
        budget = self.image_max_tokens
        if opts.max_tokens is not None:
            budget = min(budget, opts.max_tokens)
        n = self.policy.num_tokens(img.height, img.width, min_pixels=lo, max_pixels=hi)
        if n > budget:
            rh, rw = self.policy.resized_size(img.height, img.width, min_pixels=lo, max_pixels=hi)
            raise ContextLengthError(
                f"image of {img.width}x{img.height} pixels is resized to {rw}x{rh} (max_pixels={hi}) and needs "
                f"{n} image tokens, over image_max_tokens={budget}; lower max_pixels or raise image_max_tokens",
                param="image_max_tokens")
        patches, grid = self.policy(img, min_pixels=lo, max_pixels=hi)
        key = f"{self.name}:{pixel_hash(img)}:{digest(self.policy.cache_key(min_pixels=lo, max_pixels=hi))}"
        return ImageInput(pixels=patches, num_tokens=n, key=key, grid=tuple(int(g) for g in grid))

    def token_grid(self, image: ImageInput) -> tuple[int, int, int]:
        """(t, h / merge, w / merge): merged tokens in HF's row-major order."""
        if image.token_grid is not None:
            return image.token_grid
        m = self.cfg.vision.merge_size
        t, h, w = (int(x) for x in image.grid)
        return t, h // m, w // m

    def image_pixels(self, image: ImageInput) -> np.ndarray:
        """patches [t*h*w, C*T*P*P] -> the normalized resized image [H, W, C] (frame 0: an image's
        temporal patch repeats its one frame)."""
        p, m, tp = self.policy.patch_size, self.policy.merge_size, self.policy.temporal_patch_size
        _, gh, gw = (int(x) for x in image.grid)
        x = np.asarray(image.pixels).reshape(gh // m, gw // m, m, m, -1, tp, p, p)[:, :, :, :, :, 0]
        return np.ascontiguousarray(x.transpose(0, 2, 5, 1, 3, 6, 4)).reshape(gh * p, gw * p, -1)

    def input_pixels(self, image: ImageInput, pixels: np.ndarray) -> np.ndarray:
        p = self.policy
        return patchify(np.asarray(pixels), p.patch_size, p.merge_size, p.temporal_patch_size)

    # ---- host: videos -----------------------------------------------------------------------------
    def plan_video(self, meta, opts: VideoOptions = VideoOptions()) -> VideoPlan:
        """Container metadata -> frames to decode, grid and token count (no decoding); a video
        over `video_max_tokens` (or the request's lower max_tokens) is a ContextLengthError."""
        if self.video_token_id is None:
            return super().plan_video(meta, opts)
        lo = opts.min_pixels if opts.min_pixels is not None else self.limits.video_min_pixels
        hi = opts.max_pixels if opts.max_pixels is not None else self.limits.video_max_pixels
        plan = self.video_policy.plan(meta, min_pixels=lo, max_pixels=hi, fps=opts.fps)
        budget = self.video_max_tokens if opts.max_tokens is None else min(self.video_max_tokens, opts.max_tokens)
        if plan.num_tokens > budget:
            raise ContextLengthError(
                f"video of {meta.width}x{meta.height} pixels and {meta.total_frames} frames samples "
                f"{len(plan.indices)} frames resized to {plan.size[1]}x{plan.size[0]}, which need {plan.num_tokens} "
                f"video tokens, over video_max_tokens={budget}; lower fps or max_pixels, or raise video_max_tokens",
                param="video_max_tokens")
        return plan

    def prepare_video(self, frames: np.ndarray, plan: VideoPlan, key: str) -> ImageInput:
        """Decoded frames [n, H, W, 3] uint8 -> ImageInput(kind="video") with temporal patches."""
        patches = self.video_policy(frames, plan)
        return ImageInput(pixels=patches, num_tokens=plan.num_tokens,
                          key=f"{self.name}:{key}:{digest(plan.key)}", grid=plan.grid, kind="video", video=plan)

    def second_per_grid_t(self, item: ImageInput) -> float:
        """Seconds one temporal patch spans (Qwen2_5_VLProcessor's second_per_grid_ts)."""
        return self.video_policy.temporal_patch_size / item.video.sampled_fps

    # ---- encode (the step itself is Qwen2VLModel.encode) -----------------------------------------
    def encode_plan(self, images: list[ImageInput], max_batch: int, shards: int = 1) -> list[EncodeCall]:
        """Pack images (in order) into as few calls as the per-call patch budget allows, each
        padded up the patch ladder; the split un-window-orders each image's tokens (`max_batch`
        does not apply: packing is by patches). shards > 1: every call holds one packed group per
        device ([shards, n_pad, ...] arrays, split on axis 0; `_sharded_plan`)."""
        ladder = self.encode_ladder
        cap = self.limits.max_encode_patches
        for im in images:
            k = int(np.prod(im.grid))
            if k > ladder[-1]:
                raise ContextLengthError(f"image with grid {im.grid} has {k} patches, over the largest encode "
                                         f"bucket {ladder[-1]} (image_max_tokens={self.image_max_tokens})",
                                         param="image_max_tokens")
        if shards > 1:
            return self._sharded_plan(images, ladder, cap, shards)
        groups, cur, n = [], [], 0
        for im in images:
            k = int(np.prod(im.grid))
            if cur and n + k > cap:
                groups.append(cur)
                cur, n = [], 0
            cur.append(im)
            n += k
        if cur:
            groups.append(cur)
        calls = []
        for group in groups:
            total = sum(int(np.prod(im.grid)) for im in group)
            packed = self.pack(group, bucket_for(total, ladder))
            calls.append(EncodeCall((packed.n_pad,), packed.arrays(),
                                    lambda f, packed=packed: unpack_features(packed, f)))
        return calls

    def pack(self, images: list[ImageInput], n_pad: int):
        """One encode call's images packed into `n_pad` patches (a PackedImages)."""
        return pack_images(images, self.cfg.vision, n_pad)

    def _sharded_plan(self, images: list[ImageInput], ladder: tuple[int, ...], cap: int, shards: int
                      ) -> list[EncodeCall]:
        """Images (in order) to the least-loaded of `shards` packed groups, at most `cap`
        patches per group; a call ends when the least-loaded group cannot take the next image.
        Each call pads every group to one bucket (the fullest group's); the split puts each
        image's features back in request order."""
        d = shards
        calls: list[EncodeCall] = []
        groups: list[list[ImageInput]] = [[] for _ in range(d)]
        totals, where = [0] * d, []

        def flush():
            packs = [self.pack(g, bucket_for(max(totals), ladder)) for g in groups]
            arrays = tuple(np.stack(x) for x in zip(*(p.arrays() for p in packs)))

            def split(feats, packs=packs, where=tuple(where)):
                per_group = [unpack_features(p, f) for p, f in zip(packs, feats)]
                return [per_group[g][i] for g, i in where]
            calls.append(EncodeCall((d, packs[0].n_pad), arrays, split))

        for im in images:
            k = int(np.prod(im.grid))
            g = int(np.argmin(totals))
            if groups[g] and totals[g] + k > cap:
                flush()
                groups, totals, where, g = [[] for _ in range(d)], [0] * d, [], 0
            where.append((g, len(groups[g])))
            groups[g].append(im)
            totals[g] += k
        if where:
            flush()
        return calls

    def warmup_plan(self, max_batch: int, shards: int = 1) -> list[EncodeCall]:
        if shards > 1:
            return [EncodeCall((shards, n), tuple(np.stack([x] * shards) for x in self.dummy_packed(n)), list)
                    for n in self.encode_ladder]
        return [EncodeCall((n,), self.dummy_packed(n), list) for n in self.encode_ladder]

    def dummy_packed(self, n_pad: int) -> tuple:
        v = self.cfg.vision
        seg = np.zeros((n_pad,), np.int32)
        return (np.zeros((n_pad, v.patch_dim), np.float32), np.zeros((n_pad, 2), np.int32), seg, seg)

    # ---- prompt ---------------------------------------------------------------------------------
    def positions(self, ids: np.ndarray, images: list[ImageInput], image_starts: list[int]
                  ) -> tuple[np.ndarray, int]:
        """M-RoPE positions [3, prompt_len] and the decode offset (HF's get_rope_index).

        Text tokens advance all three rows together; an image at text position s takes
        (s, s + row, s + col) over its merged grid and text resumes at s + max(rows, cols).
        Decode positions are cache_index + rope_delta with rope_delta = max(position) + 1 - len.
        """
        m = self.cfg.vision.merge_size
        pos = np.zeros((3, len(ids)), np.int64)
        cur, prev = 0, 0
        for im, s in zip(images, image_starts):
            n_text = s - prev
            pos[:, prev:s] = cur + np.arange(n_text)
            cur += n_text
            lt, lh, lw = self.token_grid(im)
            t_pos = np.arange(lt)
            if im.kind == "video" and self.cfg.model_type == "qwen2_5_vl":
                # HF: (arange(t) * (tokens_per_second * second_per_grid_t)).long(), float32 tensors
                interval = np.float32(self.cfg.tokens_per_second) * np.float32(self.second_per_grid_t(im))
                t_pos = (np.arange(lt, dtype=np.float32) * interval).astype(np.int64)
            tt, hh, ww = np.meshgrid(t_pos, np.arange(lh), np.arange(lw), indexing="ij")
            n = lt * lh * lw
            pos[0, s:s + n] = cur + tt.ravel()
            pos[1, s:s + n] = cur + hh.ravel()
            pos[2, s:s + n] = cur + ww.ravel()
            cur += max(lh, lw)
            prev = s + n
        pos[:, prev:] = cur + np.arange(len(ids) - prev)
        delta = int(pos.max()) + 1 - len(ids) if len(ids) else 0
        return pos.astype(np.int32), delta


def checked_policy(path: Path, cfg: QwenVLConfig) -> Qwen2VLImagePolicy:
    """The checkpoint's image processor, checked against the vision config's patch geometry."""
    policy = load_policy(find_image_processor_config(path))
    if not isinstance(policy, Qwen2VLImagePolicy):
        raise CheckpointError(f"{cfg.model_type} needs a Qwen2VLImageProcessor, the checkpoint has "
                              f"{type(policy).__name__}", param="image_processor_type")
    v = cfg.vision
    if (policy.patch_size, policy.merge_size, policy.temporal_patch_size) != (
            v.patch_size, v.merge_size, v.temporal_patch_size):
        raise CheckpointError("image processor patch_size/merge_size/temporal_patch_size "
                              f"{(policy.patch_size, policy.merge_size, policy.temporal_patch_size)} do not match "
                              f"config.json {(v.patch_size, v.merge_size, v.temporal_patch_size)}", param="patch_size")
    return policy


def checked_video_policy(path: Path, cfg: QwenVLConfig, policy_cls: type = Qwen2VLVideoPolicy) -> Qwen2VLVideoPolicy:
    """The checkpoint's video processor (`policy_cls`' defaults where it has none), checked like the image one."""
    video_policy = policy_cls.from_config(find_video_processor_config(path))
    v = cfg.vision
    if (video_policy.patch_size, video_policy.merge_size, video_policy.temporal_patch_size) != (
            v.patch_size, v.merge_size, v.temporal_patch_size):
        raise CheckpointError("video processor patch_size/merge_size/temporal_patch_size do not match config.json",
                              param="video_preprocessor_config.patch_size")
    return video_policy


def load(path: Path, hf_cfg: dict, dtype=jnp.float32) -> tuple[QwenVLFamily, Qwen2VLModel, TensorSource]:
    """config.json + preprocessor configs -> (family, the abstract model, its tensors)."""
    cfg = QwenVLConfig.from_hf(hf_cfg)
    family = QwenVLFamily(cfg, checked_policy(path, cfg), video_policy=checked_video_policy(path, cfg))
    return family, build(lambda: Qwen2VLModel(cfg, dtype)), TensorSource(path, normalize_name)
