"""InternVL 3 / 3.5 (InternVLForConditionalGeneration): image tiles -> InternViT
(models/vision/internvl.py) -> class token dropped, pixel shuffle (space to depth by
1 / `downsample_ratio`) -> LayerNorm + Linear-act-Linear projector -> the Qwen2 / Qwen3 /
Qwen3-MoE / Llama decoder (models/text/llama.py; MoE experts stored one module per expert, as the
hub's files keep them, are read as the stacked experts: `ExpertsSource`).

Images: InternVLProcessor's dynamic tiling (mmjax/image/internvl.py): the grid of min..max_patches
tiles closest to the image's aspect ratio plus a thumbnail, or one resized tile; every view is one
tile of `image_seq_length` tokens, so the token count is known from the image size alone.
`detail` and the token budget flags set the processor's max_patches (`ImageOptions.max_tiles`:
0 or 1, one tile; n, at most n tiles plus the thumbnail).

Prompt: the chat template writes `<IMG_CONTEXT>` per image (the placeholder); the processor's
text replaces it by `<img>` + `<IMG_CONTEXT>` * tokens + `</img>` (`image_prompt`). A video's
`<video>` placeholder becomes one such block per sampled frame, `Frame{i}: <img>...</img>`
joined by newlines; its features go to the same `<IMG_CONTEXT>` tokens (`feature_token_id`).
Positions are 1-D.

Encode: the views of all waiting images and videos are one stream of equally shaped tiles,
cut into calls of `max_batch` tiles padded up the power-of-two ladder (Idefics3's plan).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from mmjax.buckets import pow2_ladder
from mmjax.checkpoint import TensorSource
from mmjax.errors import CheckpointError, ContextLengthError, InvalidRequestError, UnsupportedModelError
from mmjax.image.decode import pixel_hash
from mmjax.image.internvl import InternVLImagePolicy, InternVLVideoPolicy
from mmjax.image.processors import digest, find_image_processor_config
from mmjax.models.family import EncodeCall, Family, ImageInput, ImageOptions, VideoOptions, VisionLanguageModel
from mmjax.models.hf_config import require, tie_word_embeddings
from mmjax.models.idefics3 import Idefics3Family, pixel_shuffle
from mmjax.models.llava import normalize_name
from mmjax.models.nn.linear import Linear, activation
from mmjax.models.nn.norm import LayerNorm
from mmjax.models.nn.weights import build, load_children
from mmjax.models.text import llama
from mmjax.models.vision.internvl import InternVisionConfig, InternVisionModel
from mmjax.video.processors import VideoPlan, find_video_processor_config

TEXT_TYPES = ("qwen2", "qwen3", "qwen3_moe", "llama")


@dataclass(frozen=True)
class InternVLConfig:
    vision: InternVisionConfig
    text: llama.LlamaConfig
    scale: int                    # 1 / downsample_ratio: patches per side merged into one token
    feature_layer: int | None     # index into the tower's hidden states; None: last_hidden_state
    projector_act: str
    image_token_id: int

    @classmethod
    def from_hf(cls, cfg: dict) -> "InternVLConfig":
        text_cfg = dict(require(cfg, "text_config", "config"))
        text_cfg.setdefault("model_type", "qwen2")
        if text_cfg["model_type"] not in TEXT_TYPES:
            raise UnsupportedModelError(f"config.json: text_config.model_type={text_cfg['model_type']!r} is not "
                                        f"supported for InternVL (supported: {', '.join(TEXT_TYPES)})",
                                        param="text_config.model_type")
        text = llama.config_from_hf(text_cfg, "text_config",
                                    tie_word_embeddings=tie_word_embeddings(cfg, text_cfg, True))
        vision = InternVisionConfig.from_hf(require(cfg, "vision_config", "config"))
        ratio = float(cfg.get("downsample_ratio", 0.5))
        scale = int(round(1 / ratio)) if ratio > 0 else 0
        if scale < 1 or abs(scale * ratio - 1) > 1e-6 or vision.patches_per_side % scale:
            raise UnsupportedModelError(f"config.json: downsample_ratio={ratio} must be 1/n with n dividing the "
                                        f"{vision.patches_per_side} patches per side", param="downsample_ratio")
        if cfg.get("vision_feature_select_strategy", "default") != "default":
            raise UnsupportedModelError("config.json: vision_feature_select_strategy must be 'default' (the "
                                        "class token dropped before the pixel shuffle)",
                                        param="vision_feature_select_strategy")
        layer = cfg.get("vision_feature_layer", -1)
        if isinstance(layer, (list, tuple)):
            if len(layer) != 1:
                raise UnsupportedModelError(f"config.json: vision_feature_layer={layer}: several layers are not "
                                            "supported", param="vision_feature_layer")
            layer = layer[0]
        layer, n = int(layer), vision.num_layers
        if not -(n + 1) <= layer <= n:
            raise CheckpointError(f"config.json: vision_feature_layer={layer} out of range for {n} vision layers",
                                  param="vision_feature_layer")
        act = cfg.get("projector_hidden_act", "gelu")
        activation(act)
        return cls(vision=vision, text=text, scale=scale,
                   feature_layer=None if layer == -1 else (layer if layer >= 0 else n + 1 + layer),
                   projector_act=act, image_token_id=int(require(cfg, "image_token_id", "config")))

    @property
    def tokens_per_tile(self) -> int:
        """image_seq_length: (patches per side / scale) ** 2."""
        return (self.vision.patches_per_side // self.scale) ** 2


class InternVLMultiModalProjector(nnx.Module):
    """`layer_norm` (eps 1e-5) -> `linear_1` -> act -> `linear_2` over shuffled features."""

    def __init__(self, cfg: InternVLConfig, dtype=jnp.float32):
        d_in, d = cfg.vision.hidden_size * cfg.scale ** 2, cfg.text.hidden_size
        self.act = cfg.projector_act
        self.layer_norm = LayerNorm(d_in, 1e-5, dtype=dtype)
        self.linear_1 = Linear(d_in, d, bias=True, dtype=dtype, axes=(None, "vision_mlp"))
        self.linear_2 = Linear(d, d, bias=True, dtype=dtype, axes=("vision_mlp", "embed"))

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.linear_2(activation(self.act)(self.linear_1(self.layer_norm(x))))


class InternVLModel(VisionLanguageModel):
    """InternVLForConditionalGeneration: vision_tower (InternViT), multi_modal_projector,
    language_model (the decoder with its lm_head)."""

    def __init__(self, cfg: InternVLConfig, dtype=jnp.float32):
        self.config = cfg
        self.vision_tower = InternVisionModel(cfg.vision, cfg.feature_layer, dtype)
        self.multi_modal_projector = InternVLMultiModalProjector(cfg, dtype)
        self.language_model = cfg.text.build(dtype)

    def encode(self, pixels: jax.Array) -> jax.Array:
        """pixels [tiles, size, size, 3] -> [tiles, tokens_per_tile, text_hidden]: the tower's
        patch features (class token dropped), pixel shuffle, projector."""
        x = self.vision_tower(pixels)[:, 1:]
        return self.multi_modal_projector(pixel_shuffle(x, self.config.scale)).astype(self.embed_dtype)

    def hf_weights(self, w, name: str = "") -> None:
        """Tensor names as `llava.normalize_name` maps them."""
        self.vision_tower.hf_weights(w, "vision_tower")
        load_children(self.multi_modal_projector, w, "multi_modal_projector")
        self.language_model.hf_weights(w, "language_model.model", "language_model.lm_head.weight")


@dataclass
class TiledImage(ImageInput):
    """An ImageInput with its tile grid (cols, rows); (1, 1): one view, no thumbnail."""
    cols: int = 1
    rows: int = 1


@dataclass
class InternVLTokens:
    """The tokenizer's InternVL strings (tokenizer_config.json `extra_special_tokens`)."""
    context: str = "<IMG_CONTEXT>"
    start: str = "<img>"
    end: str = "</img>"
    video: str = "<video>"


@dataclass(eq=False)
class InternVLFamily(Family):
    """A loaded InternVL model: every view is one tile of `tokens_per_tile` tokens."""
    cfg: InternVLConfig
    policy: InternVLImagePolicy
    video_policy: InternVLVideoPolicy
    tokens: InternVLTokens = field(default_factory=InternVLTokens)
    video_id: int | None = None          # the `<video>` placeholder's id (None: no such token)
    name: str = "internvl"
    image_max_tokens: int | None = None  # server-wide caps (`configure`); None: none beyond the context
    video_max_tokens: int | None = None

    @property
    def image_token_id(self) -> int:
        return self.cfg.image_token_id

    @property
    def image_token(self) -> str:
        return self.tokens.context

    @property
    def video_token(self) -> str | None:
        return None if self.video_id is None else self.tokens.video

    @property
    def video_token_id(self) -> int | None:
        return self.video_id

    @property
    def media_token_ids(self) -> tuple[int, ...]:
        """Images and videos both put their features on `<IMG_CONTEXT>` tokens."""
        return (self.image_token_id,)

    def feature_token_id(self, item: ImageInput) -> int:
        return self.image_token_id

    def configure(self, *, image_max_tokens: int | None = None,
                  video_max_tokens: int | None = None) -> "InternVLFamily":
        """Server-wide caps on one image's / one video's tokens (over them: ContextLengthError)."""
        for name, v in (("image_max_tokens", image_max_tokens), ("video_max_tokens", video_max_tokens)):
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v <= 0):
                raise InvalidRequestError(f"{name} must be a positive integer, got {v!r}", param=name)
        if image_max_tokens is not None:
            self.image_max_tokens = int(image_max_tokens)
        if video_max_tokens is not None:
            self.video_max_tokens = int(video_max_tokens)
        return self

    @staticmethod
    def _budget(*caps: int | None) -> int | None:
        given = [c for c in caps if c is not None]
        return min(given) if given else None

    # ---- host: images -----------------------------------------------------------------------
    def prepare_image(self, img, opts: ImageOptions = ImageOptions()) -> TiledImage:
        """Decoded RGB PIL image -> views [cols*rows + 1 (or 1), tile, tile, 3]; tokens = views *
        tokens_per_tile. Over the token budget: a ContextLengthError before any resize."""
        hi = self.policy.patches(opts.max_tiles)
        cols, rows = self.policy.grid(img.height, img.width, hi)
        views = self.policy.views(cols, rows)
        n = views * self.cfg.tokens_per_tile
        budget = self._budget(opts.max_tokens, self.image_max_tokens)
        if budget is not None and n > budget:
            raise ContextLengthError(f"this image takes {n} tokens ({views} tile(s) of {self.cfg.tokens_per_tile}), "
                                     f"over image_max_tokens={budget}", param="image_max_tokens")
        pixels, c, r = self.policy(img, hi)
        assert (c, r) == (cols, rows), "image grid disagrees with the processor arithmetic"
        key = f"{self.name}:{pixel_hash(img)}:{digest(self.policy.cache_key(hi))}"
        side = self.cfg.vision.patches_per_side
        return TiledImage(pixels=pixels, num_tokens=n, key=key, grid=(views, side, side), cols=cols, rows=rows)

    def fit_options(self, max_tokens: int) -> ImageOptions:
        """The most tiles whose tokens, with the thumbnail's, fit the budget."""
        return ImageOptions(max_tiles=max(0, max_tokens // self.cfg.tokens_per_tile - 1))

    def image_prompt(self, image: ImageInput) -> str:
        """InternVLProcessor's text: `<img>` + the tokens + `</img>`; per frame of a video
        `Frame{i}: <img>...</img>`, joined by newlines."""
        t = self.tokens
        if image.kind != "video":
            return f"{t.start}{t.context * image.num_tokens}{t.end}"
        frames = len(image.pixels)
        block = t.context * (image.num_tokens // frames)
        return "\n".join(f"Frame{i + 1}: {t.start}{block}{t.end}" for i in range(frames))

    def pixel_views(self, image: ImageInput, height: int, width: int) -> list:
        """The tiles (row-major), then the thumbnail."""
        cols, rows = getattr(image, "cols", 1), getattr(image, "rows", 1)
        return [((k,), f) for k, f in enumerate(self.policy.frames(height, width, cols, rows))]

    def token_grid(self, image: ImageInput) -> tuple[int, int, int]:
        """(views, rows, cols): each view's tokens are a square grid."""
        if image.token_grid is not None:
            return image.token_grid
        side = self.cfg.vision.patches_per_side // self.cfg.scale
        return (image.num_tokens // (side * side), side, side)

    # ---- host: videos -----------------------------------------------------------------------
    def plan_video(self, meta, opts: VideoOptions = VideoOptions()) -> VideoPlan:
        """Frames to decode and the token count (tokens_per_tile per frame), from the metadata."""
        if self.video_id is None:
            return super().plan_video(meta, opts)
        idx = self.video_policy.sample_indices(meta.total_frames, meta.fps, opts.fps)
        n = len(idx) * self.cfg.tokens_per_tile
        budget = self._budget(opts.max_tokens, self.video_max_tokens)
        if budget is not None and n > budget:
            raise ContextLengthError(f"the video samples {len(idx)} frames of {self.cfg.tokens_per_tile} tokens "
                                     f"({n}), over video_max_tokens={budget}; lower fps", param="video_max_tokens")
        side, t = self.cfg.vision.patches_per_side, self.policy.tile
        fps = len(idx) / meta.total_frames * meta.fps if meta.fps else 24.0
        return VideoPlan(idx, (t, t), (len(idx), side, side), n, float(fps),
                         self.video_policy.cache_key() + (idx, meta.fps))

    def prepare_video(self, frames: np.ndarray, plan: VideoPlan, key: str) -> ImageInput:
        """Decoded frames [n, H, W, 3] uint8 -> one tile per frame."""
        pixels = self.video_policy(frames)
        return ImageInput(pixels=pixels, num_tokens=plan.num_tokens, key=f"{self.name}:{key}:{digest(plan.key)}",
                          grid=plan.grid, kind="video", video=plan)

    # ---- encode -------------------------------------------------------------------------------
    def encode_plan(self, images: list[ImageInput], max_batch: int, shards: int = 1) -> list[EncodeCall]:
        """All views as one stream of tiles in calls of at most `max_batch` (Idefics3's plan)."""
        return Idefics3Family.encode_plan(self, images, max_batch, shards)

    def warmup_plan(self, max_batch: int, shards: int = 1) -> list[EncodeCall]:
        size = self.policy.tile
        return [EncodeCall((b, size, size, 3), np.zeros((b, size, size, 3), np.float32), list)
                for b in pow2_ladder(1, max_batch)]


class ExpertsSource(TensorSource):
    """The checkpoint's tensors, with Qwen3-MoE experts stored one module per expert
    (`experts.{i}.gate_proj / up_proj / down_proj`, the hub's layout) also readable as the stacks
    `nn.moe.Experts` takes (`experts.gate_up_proj` [E, d, 2f], `experts.down_proj` [E, f, d])."""

    def _per_expert(self, name: str) -> tuple[str, str] | None:
        for stack in (".experts.gate_up_proj", ".experts.down_proj"):
            if name.endswith(stack) and not super().has(name) and super().has(f"{name[:-len(stack)]}.experts.0."
                                                                                 "down_proj.weight"):
                return name[:-len(stack)] + ".experts", stack.rsplit(".", 1)[1]
        return None

    def has(self, name: str) -> bool:
        return super().has(name) or self._per_expert(name) is not None

    def take(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
        found = self._per_expert(name)
        if found is None:
            return super().take(name, shape)
        prefix, what = found
        e, a, b = shape
        if what == "down_proj":      # [E, f, d] from each [d, f]
            return np.stack([super(ExpertsSource, self).take(f"{prefix}.{i}.down_proj.weight", (b, a)).T
                             for i in range(e)])
        f = b // 2                   # [E, d, 2f] from each gate / up [f, d]
        return np.stack([np.concatenate([super(ExpertsSource, self).take(f"{prefix}.{i}.{p}.weight", (f, a)).T
                                         for p in ("gate_proj", "up_proj")], axis=1) for i in range(e)])


def _json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}


def _tokens(path: Path) -> tuple[InternVLTokens, dict[str, int]]:
    """The InternVL strings the tokenizer names (tokenizer_config.json) and the added tokens' ids."""
    cfg = _json(path / "tokenizer_config.json")
    named = {**cfg, **(cfg.get("extra_special_tokens") if isinstance(cfg.get("extra_special_tokens"), dict) else {})}
    d = InternVLTokens()
    tokens = InternVLTokens(**{f: named[k] if isinstance(named.get(k), str) else getattr(d, f)
                               for f, k in (("context", "context_image_token"), ("start", "start_image_token"),
                                            ("end", "end_image_token"), ("video", "video_token"))})
    added = {t["content"]: int(t["id"]) for t in _json(path / "tokenizer.json").get("added_tokens", [])}
    return tokens, added


def load(path: Path, hf_cfg: dict, dtype=jnp.float32) -> tuple[InternVLFamily, InternVLModel, TensorSource]:
    """config.json + InternVLProcessor configs -> (family, the abstract model, its tensors)."""
    cfg = InternVLConfig.from_hf(hf_cfg)
    ipc = find_image_processor_config(path)
    kind = str(ipc.get("image_processor_type", ""))
    if not kind.startswith("GotOcr2ImageProcessor"):
        raise CheckpointError(f"internvl needs a GotOcr2ImageProcessor, the checkpoint has {kind!r}",
                              param="image_processor_type")
    proc = _json(path / "processor_config.json")
    policy = InternVLImagePolicy.from_config(ipc, crop_to_patches=bool(proc.get("crop_to_patches", True)))
    if policy.tile != cfg.vision.image_size:
        raise CheckpointError(f"image processor size={policy.tile} != vision_config.image_size="
                              f"{cfg.vision.image_size}: tiles of another size are not supported", param="size")
    seq = proc.get("image_seq_length")
    if seq is not None and int(seq) != cfg.tokens_per_tile:
        raise CheckpointError(f"processor image_seq_length={seq} != (patches per side * downsample_ratio)^2 = "
                              f"{cfg.tokens_per_tile}", param="image_seq_length")
    tokens, added = _tokens(path)
    for what in ("context", "start", "end"):
        if added and getattr(tokens, what) not in added:
            raise CheckpointError(f"tokenizer has no {getattr(tokens, what)!r} token", param="tokenizer")
    if added and added[tokens.context] != cfg.image_token_id:
        raise CheckpointError(f"config image_token_id={cfg.image_token_id} is not the tokenizer's "
                              f"{tokens.context!r} ({added[tokens.context]})", param="image_token_id")
    video_policy = InternVLVideoPolicy.from_config(find_video_processor_config(path), policy.tile)
    family = InternVLFamily(cfg, policy, video_policy, tokens, video_id=added.get(tokens.video))
    return family, build(lambda: InternVLModel(cfg, dtype)), ExpertsSource(path, normalize_name)
