"""MiniCPM-V 4.6 and 4.7 (MiniCPMV4_6ForConditionalGeneration, MiniCPMV4_7ForConditionalGeneration):
image slices -> NaViT vision tower with the window-attention merger (models/vision/minicpmv.py)
-> 2x2 merger -> Qwen3.5's hybrid decoder (Gated DeltaNet beside full attention).

Images (image/minicpmv.py, MiniCPMV4_6ImageProcessorPil): a source view plus, for an image larger
than `scale_resolution`^2, a rows x cols grid of slices; each view's tokens are its patch grid /
16 ("16x") or / 4 ("4x"). Knobs: `max_tiles` (the server's --max-image-tiles, `detail: "low"` =
0) caps the processor's max_slice_nums; a token budget (`image_max_tokens`) lowers the cap until
the image fits, down to the source view alone.

Prompt (the processor's text for each `image_token` placeholder, `image_prompts`):
`<image_id>i</image_id>` (i: the image's index in the prompt; `use_image_id`), then
`<image>` + the source view's tokens + `</image>`, then per row of slices
`<slice>` + tokens + `</slice>` for each slice, rows joined by "\\n". The image tokens take the
features in view order (each view row-major).

Positions: 4.6 uses plain 1-D positions. 4.7 lays every image on a canvas (HF's get_rope_index,
`canvas_positions`): rows (t, h, w) where the thumbnail is stretched over the slices' canvas,
slices sit at their (row, col) offsets, and the `<image>` / `</image>` / `<slice>` / `</slice>` /
newline markers are pinned to the canvas' halo and corners; text resumes past the canvas'
longer side.

Modules (HF's tree): `vision_tower`, `merger` (`model.vision_tower.*`, `model.merger.*`) and
`language_model` (`model.language_model.*` with the top-level `lm_head`).
"""
from __future__ import annotations

import dataclasses
import itertools
import json
from dataclasses import dataclass, field
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from mmjax.buckets import bucket_for
from mmjax.checkpoint import TensorSource
from mmjax.errors import CheckpointError, ContextLengthError, UnsupportedModelError
from mmjax.image.decode import pixel_hash
from mmjax.image.minicpmv import MiniCPMVImagePolicy
from mmjax.image.processors import digest, find_image_processor_config
from mmjax.models.family import EncodeCall, Family, ImageInput, ImageOptions, VideoOptions, VisionLanguageModel
from mmjax.models.hf_config import require, tie_word_embeddings
from mmjax.models.nn.weights import build, load_module
from mmjax.models.text.qwen3_5 import Qwen35TextConfig
from mmjax.models.vision.minicpmv import (Merger, MiniCPMVVisionConfig, MiniCPMVVisionModel, merge_block_order,
                                          nearest_position_ids)
from mmjax.models.vision.clip import patchify
from mmjax.models.vision.qwen2_vl import patch_ladder
from mmjax.video.minicpmv import MiniCPMVVideoPolicy
from mmjax.video.processors import VideoPlan, find_video_processor_config

ARCHS = {"minicpmv4_6": "4.6", "minicpmv4_7": "4.7"}
MARKERS = ("image_start_id", "image_end_id", "slice_start_id", "slice_end_id", "newline_id")
# the processor's strings (read from the tokenizer's named tokens when it has them)
TOKEN_STRINGS = {"image_token": "<unk>", "video_token": "<|video_pad|>", "image_start_token": "<image>",
                 "image_end_token": "</image>", "slice_start_token": "<slice>", "slice_end_token": "</slice>",
                 "image_id_start_token": "<image_id>", "image_id_end_token": "</image_id>"}


@dataclass(frozen=True)
class MiniCPMVConfig:
    vision: MiniCPMVVisionConfig
    text: object
    version: str                        # "4.6" | "4.7"
    image_token_id: int
    video_token_id: int | None
    markers: dict = field(default_factory=dict)    # 4.7: MARKERS -> ids (canvas M-RoPE)

    @classmethod
    def from_hf(cls, cfg: dict) -> "MiniCPMVConfig":
        mt = cfg.get("model_type")
        if mt not in ARCHS:
            raise UnsupportedModelError(f"config.json: model_type={mt!r} is not MiniCPM-V 4.6 / 4.7", param="model_type")
        text_cfg = dict(require(cfg, "text_config", "config"))
        if text_cfg.get("model_type", "qwen3_5_text") != "qwen3_5_text":
            raise UnsupportedModelError(f"config.json: text_config.model_type={text_cfg['model_type']!r} "
                                        "(MiniCPM-V 4.6 / 4.7 use qwen3_5_text)", param="text_config.model_type")
        text = Qwen35TextConfig.from_hf(text_cfg, "text_config", tie_word_embeddings=tie_word_embeddings(cfg, text_cfg))
        if cfg.get("drop_vision_last_layer"):
            raise UnsupportedModelError("config.json: drop_vision_last_layer=true is not supported",
                                        param="drop_vision_last_layer")
        vision = MiniCPMVVisionConfig.from_hf(cfg, text.hidden_size)
        # 4.7: the canvas markers (`load` resolves the ones a pre-upstream config.json lacks)
        markers = {k: int(cfg[k]) for k in MARKERS if cfg.get(k) is not None} if ARCHS[mt] == "4.7" else {}
        video = cfg.get("video_token_id")
        return cls(vision=vision, text=text, version=ARCHS[mt], image_token_id=int(require(cfg, "image_token_id", "config")),
                   video_token_id=None if video is None else int(video), markers=markers)


class MiniCPMVModel(VisionLanguageModel):
    """HF's MiniCPMV4_6Model / MiniCPMV4_7Model with the lm_head: vision_tower, merger,
    language_model."""

    def __init__(self, cfg: MiniCPMVConfig, dtype=jnp.float32):
        self.config = cfg
        self.vision_tower = MiniCPMVVisionModel(cfg.vision, dtype)
        self.merger = Merger(cfg.vision, dtype)
        self.language_model = cfg.text.build(dtype)

    def encode(self, packed: tuple) -> jax.Array:
        """One packed call (patches, pos_ids, segment_ids; `MiniCPMVFamily.encode_plan`) -> LLM
        tokens [n_pad / merge^2, text_hidden], each view's tokens row-major, views in order."""
        return self.merger(self.vision_tower(*packed)).astype(self.embed_dtype)

    def hf_weights(self, w, name: str = "") -> None:
        self.vision_tower.hf_weights(w, "model.vision_tower")
        load_module(self.merger, w, "model.merger")
        self.language_model.hf_weights(w, "model.language_model", "lm_head.weight")


@dataclass
class SlicedImage(ImageInput):
    """An ImageInput whose `pixels` are its views' patches [patches, p*p*c], each view in
    merge-block order (vision/minicpmv.py), with `sizes`: each view's (rows, cols) of patches
    (source first; a video's views frame after frame), `views`: each view's tokens, `slice_grid`:
    (rows, cols) of slices ((0, 0): none) and `pos_ids`: each patch's row of the position table."""
    sizes: tuple = ()
    views: tuple = ()
    slice_grid: tuple[int, int] = (0, 0)
    pos_ids: np.ndarray | None = None


@dataclass(eq=False)
class MiniCPMVFamily(Family):
    cfg: MiniCPMVConfig
    policy: MiniCPMVImagePolicy
    video_policy: MiniCPMVVideoPolicy
    strings: dict = field(default_factory=lambda: dict(TOKEN_STRINGS))
    name: str = "minicpmv4_6"

    @property
    def image_token_id(self) -> int:
        return self.cfg.image_token_id

    @property
    def image_token(self) -> str:
        return self.strings["image_token"]

    @property
    def video_token_id(self) -> int | None:
        return self.cfg.video_token_id

    @property
    def video_token(self) -> str | None:
        return None if self.cfg.video_token_id is None else self.strings["video_token"]

    # ---- host: images ---------------------------------------------------------------------------
    @property
    def max_encode_patches(self) -> int:
        """The largest packed call: twice the patches of a full default-sliced image."""
        side = -(-self.policy.scale_resolution // (self.policy.patch_size * self.policy.merge)) * self.policy.merge
        return 2 * (self.policy.max_slice_nums + 1) * side * side

    @property
    def encode_ladder(self) -> tuple[int, ...]:
        m2 = self.cfg.vision.merge ** 2
        return patch_ladder(self.max_encode_patches, lo=min(256, self.max_encode_patches), multiple=max(64, m2))

    def _plan(self, height: int, width: int, opts: ImageOptions):
        cap = self.policy.max_slice_nums if opts.max_tiles is None else min(opts.max_tiles, self.policy.max_slice_nums)
        while True:
            plan = self.policy.plan(height, width, cap)
            n = sum(self.policy.view_tokens(plan))
            if opts.max_tokens is None or n <= opts.max_tokens:
                return plan, n
            if plan.grid == (0, 0):
                raise ContextLengthError(f"this image takes {n} tokens even without slices, over "
                                         f"image_max_tokens={opts.max_tokens}", param="image_max_tokens")
            cap = min(cap, plan.grid[0] * plan.grid[1]) - 1

    def prepare_image(self, img, opts: ImageOptions = ImageOptions()) -> SlicedImage:
        """Decoded RGB PIL image -> its views' patches (merge-block order) and token count,
        known before any resize; an image whose patches exceed the largest encode call is a
        ContextLengthError."""
        plan, n = self._plan(img.height, img.width, opts)
        self._check_patches(plan, 1)
        key = f"{self.name}:{pixel_hash(img)}:{digest(self.policy.cache_key() + (plan,))}"
        return self._sliced(self.policy(img, plan), plan, self.policy, n, key, source_size=(img.height, img.width))

    def _check_patches(self, plan, frames: int) -> None:
        """A view larger than the largest encode call (an extreme aspect ratio) is a ContextLengthError."""
        p = self.policy.patch_size
        n = max((h // p) * (w // p) for h, w in plan.view_sizes)
        if n > self.encode_ladder[-1]:
            raise ContextLengthError(f"a view of this input holds {n} patches, over the largest encode call "
                                     f"({self.encode_ladder[-1]}); its aspect ratio is too extreme",
                                     param="images" if frames == 1 else "videos")

    def _sliced(self, views: list[np.ndarray], plan, policy, n: int, key: str, **kw) -> "SlicedImage":
        """Views [h, w, 3] (frame-major for a video) -> a SlicedImage (patches in merge-block order)."""
        p, m = policy.patch_size, self.cfg.vision.merge
        sizes = tuple((v.shape[0] // p, v.shape[1] // p) for v in views)
        orders = [merge_block_order(h, w, m) for h, w in sizes]
        pixels = np.concatenate([patchify(v[None], p)[0][o] for v, o in zip(views, orders)])
        pos = np.concatenate([nearest_position_ids(h, w, self.cfg.vision.patches_per_side)[o]
                              for (h, w), o in zip(sizes, orders)])
        per_frame = policy.view_tokens(plan)
        return SlicedImage(pixels=pixels, num_tokens=n, key=key, grid=(len(sizes), sizes[0][0], sizes[0][1]),
                           sizes=sizes, views=tuple(per_frame * (len(sizes) // len(per_frame))),
                           slice_grid=plan.grid, pos_ids=pos, **kw)

    # ---- host: videos ---------------------------------------------------------------------------
    def plan_video(self, meta, opts: VideoOptions = VideoOptions()) -> VideoPlan:
        """Container metadata -> the frames to decode (one a second) and the token count (every
        frame sliced like an image by the video processor's settings); over `opts.max_tokens` a
        ContextLengthError. The pixel bounds and fps options do not apply (the processor has none)."""
        if self.video_token_id is None:
            return super().plan_video(meta, opts)
        vp = self.video_policy
        indices = vp.sample_indices(meta)
        plan = vp.plan(meta.height, meta.width)
        self._check_patches(plan, len(indices))
        n = len(indices) * sum(vp.view_tokens(plan))
        if opts.max_tokens is not None and n > opts.max_tokens:
            raise ContextLengthError(f"video of {meta.width}x{meta.height} samples {len(indices)} frames of "
                                     f"{sum(vp.view_tokens(plan))} tokens ({n}), over video_max_tokens="
                                     f"{opts.max_tokens}", param="video_max_tokens")
        sampled = len(indices) / meta.total_frames * meta.fps if meta.fps else 1.0
        key = ("minicpmv_video", tuple(indices), vp.cache_key(), plan)
        return VideoPlan(tuple(indices), plan.source, (len(indices), plan.source[0] // vp.patch_size,
                                                       plan.source[1] // vp.patch_size), n, float(sampled), key)

    def prepare_video(self, frames: np.ndarray, plan: VideoPlan, key: str) -> ImageInput:
        """Decoded uint8 frames [n, H, W, 3] -> SlicedImage(kind="video"): every frame's views."""
        vp = self.video_policy
        sp = vp.plan(frames.shape[1], frames.shape[2])
        return self._sliced(vp.frame_views(frames, sp), sp, vp, plan.num_tokens,
                            f"{self.name}:{key}:{digest(plan.key)}", kind="video", video=plan)

    def fit_options(self, max_tokens: int) -> ImageOptions:
        """A token budget: slices are dropped until the image fits (`prepare_image`)."""
        return ImageOptions(max_tokens=max_tokens)

    def token_grid(self, image: ImageInput) -> tuple[int, int, int]:
        if image.token_grid is not None:
            return image.token_grid
        m = self.cfg.vision.merge
        return (1, image.sizes[0][0] // m, image.sizes[0][1] // m) if len(image.sizes) == 1 else (1, 1, image.num_tokens)

    # ---- prompt ---------------------------------------------------------------------------------
    def image_prompt(self, image: ImageInput, index: int = 0) -> str:
        """The processor's text for one image or video (module docstring); `index`: its place
        among the prompt's images (videos) for the `<image_id>` tag. A video: each frame's block
        (its tokens the video token), frames back to back; 4.7 tags no video."""
        s = self.strings
        video = image.kind == "video"
        tok = s["video_token"] if video else s["image_token"]
        rows, cols = image.slice_grid
        per = 1 + rows * cols
        text = ""
        for f in range(len(image.views) // per):
            counts = image.views[f * per:(f + 1) * per]
            text += s["image_start_token"] + tok * counts[0] + s["image_end_token"]
            if rows:
                text += "\n".join("".join(s["slice_start_token"] + tok * counts[1 + r * cols + c] + s["slice_end_token"]
                                          for c in range(cols)) for r in range(rows))
        if self.policy.use_image_id and not (video and self.cfg.version == "4.7"):
            text = f"{s['image_id_start_token']}{index}{s['image_id_end_token']}" + text
        return text

    def image_prompts(self, images: list[ImageInput]) -> list[str]:
        seen = {"image": 0, "video": 0}
        out = []
        for im in images:
            out.append(self.image_prompt(im, seen[im.kind]))
            seen[im.kind] += 1
        return out

    def positions(self, ids: np.ndarray, images: list[ImageInput], image_starts: list[int]
                  ) -> tuple[np.ndarray, int]:
        """4.6: 1-D positions in every row. 4.7: canvas M-RoPE rows [3, len] (`canvas_positions`)
        and the decode offset max(position) + 1 - len."""
        rows = getattr(self.cfg.text, "position_rows", 1)
        if self.cfg.version == "4.6" or not images:
            return np.broadcast_to(np.arange(len(ids), dtype=np.int32), (rows, len(ids))).copy(), 0
        sizes = [hw for im in images for hw in im.sizes]
        ids = np.asarray(ids)
        types = np.where(ids == self.image_token_id, 1, np.where(ids == self.video_token_id, 2, 0))
        pos = canvas_positions(list(map(int, ids)), types.tolist(), sizes, self.cfg.vision.merge, self.cfg.markers)
        return pos.astype(np.int32), int(pos.max()) + 1 - len(ids)

    # ---- encode ---------------------------------------------------------------------------------
    def encode_plan(self, images: list[ImageInput], max_batch: int, shards: int = 1) -> list[EncodeCall]:
        """All inputs' views as one stream, cut into calls of at most the ladder's top patches
        (a view never splits; an image's or video's views may span calls), each padded up the
        ladder, one attention segment per view. Call k's `split` keeps its views' tokens and
        returns the inputs whose last view it holds, in order (the runner splits calls in order)."""
        ladder = self.encode_ladder
        m2 = self.cfg.vision.merge ** 2
        views = [(i, j) for i, im in enumerate(images) for j in range(len(im.sizes))]
        starts = [np.cumsum([0] + [h * w for h, w in im.sizes]) for im in images]
        parts: list[list] = [[] for _ in images]
        calls, cur, n = [], [], 0

        def flush(cur):
            n_pad = bucket_for(sum(images[i].sizes[j][0] * images[i].sizes[j][1] for i, j in cur), ladder)
            v = self.cfg.vision
            patches = np.zeros((n_pad, v.patch_dim), np.float32)
            pos = np.zeros((n_pad,), np.int32)
            seg = np.full((n_pad,), -1, np.int32)
            off, spans = 0, []
            for s_, (i, j) in enumerate(cur):
                a, b = starts[i][j], starts[i][j + 1]
                patches[off:off + b - a] = images[i].pixels[a:b]
                pos[off:off + b - a] = images[i].pos_ids[a:b]
                seg[off:off + b - a] = s_
                spans.append((i, off // m2, (b - a) // m2))
                off += b - a
            done = [i for i in dict.fromkeys(i for i, _ in cur) if (i, len(images[i].sizes) - 1) in cur]

            def split(f, spans=spans, done=done):
                for i, a, k in spans:
                    parts[i].append(np.asarray(f[a:a + k]))
                return [np.concatenate(parts[i]) for i in done]
            calls.append(EncodeCall((n_pad,), (patches, pos, seg), split))

        for i, j in views:
            k = images[i].sizes[j][0] * images[i].sizes[j][1]
            if cur and n + k > ladder[-1]:
                flush(cur)
                cur, n = [], 0
            cur.append((i, j))
            n += k
        if cur:
            flush(cur)
        return calls

    def warmup_plan(self, max_batch: int, shards: int = 1) -> list[EncodeCall]:
        v = self.cfg.vision
        return [EncodeCall((n,), (np.zeros((n, v.patch_dim), np.float32), np.zeros((n,), np.int32),
                                  np.zeros((n,), np.int32)), list) for n in self.encode_ladder]


def canvas_positions(ids: list[int], types: list[int], sizes: list[tuple[int, int]], merge: int,
                     markers: dict) -> np.ndarray:
    """MiniCPMV4_7Model.get_rope_index for one unpadded sequence: ids, mm types (0 text, 1 image,
    2 video), each crop's patch grid (h, w) in sequence order, the merge factor and the marker
    ids -> positions [3, len] (t, h, w)."""
    mk = (markers["slice_start_id"], markers["slice_end_id"], markers["image_start_id"], markers["image_end_id"],
          markers["newline_id"])
    slice_start = mk[0]
    n = len(ids)
    groups, open_slices, prev_end = [], None, 0
    pos_i = 0
    for modality, run in itertools.groupby(range(n), lambda i: types[i]):
        run = list(run)
        if modality == 0:
            continue
        crop = (run[0], run[-1] + 1)
        if open_slices is not None and ids[crop[0] - 1] == slice_start:
            open_slices.append(crop)
        else:
            open_slices = []
            frame = (modality, crop[0], crop[1], open_slices)
            gap = ids[prev_end:crop[0] - 1]
            if groups and all(t in mk for t in gap):
                groups[-1][1].append(frame)
            else:
                groups.append((crop[0] - 1, [frame]))
        prev_end = crop[1]

    def frame_end(last: int) -> int:
        while last < n and ids[last] in mk:
            last += 1
        return last

    visual = []
    for start, frames in groups:
        frames = [(m_, a, b, frame_end(sl[-1][1] if sl else b), sl) for m_, a, b, sl in frames]
        visual.append((start, frames[-1][3], frames))

    grid = iter(sizes)
    pos = np.broadcast_to(np.arange(n, dtype=np.int64), (3, n)).copy()

    def vision_ids(origin, hw, canvas_h=0, canvas_w=0, h_off=0, w_off=0):
        lh, lw = hw[0] // merge, hw[1] // merge
        canvas_h, canvas_w = canvas_h or lh, canvas_w or lw
        # torch.linspace(0, c - 1, n) in float32, then .round() (half to even)
        hs = np.round(_linspace(canvas_h - 1, lh)).astype(np.int64) + h_off
        ws = np.round(_linspace(canvas_w - 1, lw)).astype(np.int64) + w_off
        hh, ww = np.meshgrid(hs, ws, indexing="ij")
        return np.stack([np.zeros_like(hh), hh, ww]).reshape(3, -1) + origin

    cur, cur_idx = 0, 0
    for g_start, g_end, frames in visual:
        if g_start > cur_idx:
            pos[:, cur_idx:g_start] = np.arange(g_start - cur_idx) + cur
            cur += g_start - cur_idx
        cursor = g_start
        for _, t_start, t_end, f_end, slices in frames:
            thumb = next(grid)
            f_start = t_start - 1
            if f_start > cursor:
                pos[:, cursor:f_start] = np.arange(f_start - cursor) + cur
                cur += f_start - cursor + 1
            f_end = min(f_end, g_end)
            origin, halo = cur, max(cur - 1, 0)
            sh = sw = rows = cols = 0
            canvas_h, canvas_w = thumb[0] // merge, thumb[1] // merge
            first = None
            if slices:
                cols = len(slices)
                for k in range(len(slices) - 1):
                    if slices[k + 1][0] - slices[k][1] > 2:
                        cols = k + 1
                        break
                rows = len(slices) // cols if cols > 0 else 1
                if rows * cols != len(slices):
                    rows, cols = 1, len(slices)
                first = next(grid)
                sh, sw = first[0] // merge, first[1] // merge
                canvas_h, canvas_w = rows * sh, cols * sw
            pos[:, f_start:f_end] = origin
            pos[1:, f_start] = halo
            if t_end < f_end:
                pos[1, t_end], pos[2, t_end] = origin + canvas_h, origin + canvas_w
            pos[:, t_start:t_end] = vision_ids(origin, thumb, canvas_h, canvas_w)
            for k, (a, b) in enumerate(slices):
                h_off, w_off = (k // cols) * sh, (k % cols) * sw
                hw = first if k == 0 else next(grid)
                if a - 1 >= f_start:
                    pos[1, a - 1], pos[2, a - 1] = origin + h_off, origin + w_off
                if b < f_end:
                    pos[1, b] = origin + h_off + hw[0] // merge - 1
                    pos[2, b] = origin + w_off + hw[1] // merge - 1
                pos[:, a:b] = vision_ids(origin, hw, h_off=h_off, w_off=w_off)
            for k in range(len(slices) - 1):
                g0, g1 = slices[k][1], slices[k + 1][0]
                if g1 - g0 <= 2:
                    continue
                for j in range(g0 + 1, g1 - 1):
                    pos[1, j] = origin + (k // cols + 1) * sh - 1
                    pos[2, j] = origin + cols * sw
            cur = origin + max(canvas_h, canvas_w) + 1
            cursor = f_end
        if cursor < g_end:
            pos[:, cursor:g_end] = np.arange(g_end - cursor) + cur
            cur += g_end - cursor
        cur_idx = g_end
    if cur_idx < n:
        pos[:, cur_idx:] = np.arange(n - cur_idx) + cur
    return pos


def _linspace(end: int, steps: int) -> np.ndarray:
    """torch.linspace(0, end, steps) in float32 (start + i * step for the first half, end -
    (steps - 1 - i) * step for the rest). Its last bit can differ from torch's vectorized kernel,
    its rounding to integers does not (checked for end < 300, steps < 200)."""
    if steps == 1:
        return np.zeros(1, np.float32)
    step = np.float32(end) / np.float32(steps - 1)
    i = np.arange(steps)
    half = steps // 2
    return np.where(i < half, np.float32(0) + i.astype(np.float32) * step,
                    np.float32(end) - (steps - 1 - i).astype(np.float32) * step).astype(np.float32)


def _token_strings(path: Path) -> dict:
    """The processor's marker strings: the tokenizer's named tokens where it has them."""
    out = dict(TOKEN_STRINGS)
    p = path / "tokenizer_config.json"
    cfg = json.loads(p.read_text()) if p.is_file() else {}
    named = cfg.get("extra_special_tokens") if isinstance(cfg.get("extra_special_tokens"), dict) else {}
    for k in out:
        v = named.get(k, cfg.get(k))
        if isinstance(v, str):
            out[k] = v
    return out


def _marker_ids(path: Path, strings: dict, known: dict) -> dict:
    """4.7's canvas marker ids missing from config.json (checkpoints converted before transformers
    stored them), from the tokenizer: `<image>`, `</image>`, `<slice>`, `</slice>` and the id "\\n"
    encodes to."""
    from tokenizers import Tokenizer as HFTokenizer

    p = path / "tokenizer.json"
    if not p.is_file():
        raise CheckpointError("config.json lacks the canvas marker ids and there is no tokenizer.json to read "
                              "them from", param="image_start_id")
    tok = HFTokenizer.from_file(str(p))
    names = {"image_start_id": "image_start_token", "image_end_id": "image_end_token",
             "slice_start_id": "slice_start_token", "slice_end_id": "slice_end_token"}
    out = dict(known)
    for key, name in names.items():
        if key not in out:
            i = tok.token_to_id(strings[name])
            if i is None:
                raise CheckpointError(f"tokenizer has no {strings[name]!r} token ({key})", param=key)
            out[key] = int(i)
    if "newline_id" not in out:
        ids = tok.encode("\n", add_special_tokens=False).ids
        if len(ids) != 1:
            raise CheckpointError(f"'\\n' is {len(ids)} tokens, not one (newline_id)", param="newline_id")
        out["newline_id"] = int(ids[0])
    return out


def load(path: Path, hf_cfg: dict, dtype=jnp.float32) -> tuple[MiniCPMVFamily, MiniCPMVModel, TensorSource]:
    """config.json + the image processor config + tokenizer -> (family, the abstract model, its tensors)."""
    cfg = MiniCPMVConfig.from_hf(hf_cfg)
    ipc = find_image_processor_config(path)
    kind = str(ipc.get("image_processor_type", ""))
    if not kind.startswith("MiniCPMV4_6ImageProcessor"):
        raise CheckpointError(f"{hf_cfg.get('model_type')} needs a MiniCPMV4_6ImageProcessor, the checkpoint has "
                              f"{kind!r}", param="image_processor_type")
    policy = MiniCPMVImagePolicy.from_config(ipc)
    if policy.patch_size != cfg.vision.patch_size or policy.merge != cfg.vision.merge:
        raise CheckpointError(f"image processor patch_size={policy.patch_size} / downsample_mode="
                              f"{policy.downsample_mode} disagree with the model's vision config",
                              param="downsample_mode")
    video = MiniCPMVVideoPolicy.from_video_config(find_video_processor_config(path))
    if video.patch_size != policy.patch_size or video.merge != policy.merge:
        raise CheckpointError("video processor patch_size / downsample_mode disagree with the image processor's",
                              param="downsample_mode")
    strings = _token_strings(path)
    if cfg.version == "4.7" and len(cfg.markers) < len(MARKERS):
        cfg = dataclasses.replace(cfg, markers=_marker_ids(path, strings, cfg.markers))
    family = MiniCPMVFamily(cfg, policy, video, strings, name=str(hf_cfg["model_type"]))
    return family, build(lambda: MiniCPMVModel(cfg, dtype)), TensorSource(path)
