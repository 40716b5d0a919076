"""LLaVA-NeXT (LlavaNextForConditionalGeneration) and LLaVA-OneVision
(LlavaOnevisionForConditionalGeneration, images only): high resolution by "anyres" tiling.

Each image becomes an overview plus the tiles of its best grid pinpoint (mmjax/image/anyres.py),
all of one size. The compiled encode runs the vision tower (CLIP for NeXT, SigLIP for OneVision;
any layer / strategy pair HF can run) and the LLaVA projector on a batch of tiles, whichever
images they come from: tiles of all waiting images are packed into calls of the power-of-two
encode ladder (one image of 10 tiles costs the same calls as ten images of one). The host then
lays out each image's features as HF's pack_image_features does: the tiles' feature maps joined
into one map, its padding rows / columns removed (unpad), OneVision's bilinear downscale when the
map is over `anyres_max_N` tiles' worth, one `image_newline` after every row, the overview's
features first. An overview-only image (detail "low", `max_tiles=0`, OneVision multi-image
prompts) is the overview's features + one newline, HF's one-view branch.

Module tree (`LlavaNextModel`, transformers' names): `vision_tower` (CLIP, vision/clip.py, or
SigLIP, vision/siglip.py; built up to the deepest feature layer), `multi_modal_projector`
(linear_1, linear_2), `image_newline` [text_hidden], `language_model` (the decoder with its
lm_head). The encode step returns each view's projected features followed by one row holding
`image_newline` (so the host layout step reads the live model's newline).

The prompt's `<image>` placeholder becomes `num_tokens` image tokens (as LLaVA-1.5); positions
are 1-D; the text model is Llama / Mistral / Qwen2 (models/text/llama.py).
"""
from __future__ import annotations

import re
from dataclasses import dataclass, replace
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from mmjax.buckets import bucket_for, pow2_ladder
from mmjax.checkpoint import TensorSource
from mmjax.errors import CheckpointError, ContextLengthError, InvalidRequestError, UnsupportedModelError
from mmjax.image.anyres import AnyresGrid, AnyresImagePolicy
from mmjax.image.decode import pixel_hash
from mmjax.image.processors import digest, find_image_processor_config
from mmjax.models.family import EncodeCall, Family, ImageInput, ImageOptions, VisionLanguageModel
from mmjax.models.hf_config import require, tie_word_embeddings
from mmjax.models.llava import (feature_layer_indices, image_token, normalize_name as llava_normalize_name,
                                vision_layers_needed)
from mmjax.models.nn.linear import param
from mmjax.models.nn.weights import build
from mmjax.models.text import text_config
from mmjax.models.vision.clip import ClipVisionConfig, ClipVisionModel
from mmjax.models.vision.projector import LlavaMultiModalProjector
from mmjax.models.vision.siglip import SiglipVisionConfig, SiglipVisionModel

_ONEVISION = "llava_onevision"


@dataclass(frozen=True)
class LlavaNextConfig:
    vision: ClipVisionConfig | SiglipVisionConfig
    text: object            # the decoder's config (models/text)
    image_token_id: int
    vision_feature_layers: tuple[int, ...]
    select_strategy: str
    pinpoints: tuple[tuple[int, int], ...]
    max_patches: int | None = None       # OneVision's vision_aspect_ratio "anyres_max_N"
    projector_act: str = "gelu"
    projector_bias: bool = True
    model_type: str = "llava_next"

    @classmethod
    def from_hf(cls, cfg: dict) -> "LlavaNextConfig":
        mt = cfg.get("model_type", "llava_next")
        onevision = mt == _ONEVISION
        text_cfg = dict(require(cfg, "text_config", "config"))
        text_cfg.setdefault("model_type", "qwen2" if onevision else "llama")
        tie = tie_word_embeddings(cfg, text_cfg)
        if onevision:   # LlavaOnevisionConfig also ties when only the text config says so
            tie = tie or bool(text_cfg.get("tie_word_embeddings", False))
        text = text_config(text_cfg, "text_config", tie_word_embeddings=tie)
        vcfg = dict(require(cfg, "vision_config", "config"))
        vcfg.setdefault("model_type", "siglip_vision_model" if onevision else "clip_vision_model")
        if vcfg["model_type"] in ("siglip_vision_model", "siglip"):
            vision = SiglipVisionConfig.from_hf(vcfg, "vision_config")
            has_cls = False
        else:
            vision = ClipVisionConfig.from_hf(vcfg, "vision_config")
            has_cls = True
        layer = cfg.get("vision_feature_layer", -1 if onevision else -2)
        layers = tuple(layer) if isinstance(layer, (list, tuple)) else (int(layer),)
        for l in layers:
            if not -(vision.num_layers + 1) <= l <= vision.num_layers:
                raise CheckpointError(f"config.json: vision_feature_layer={l} out of range for "
                                      f"{vision.num_layers} vision layers", param="vision_feature_layer")
        strategy = cfg.get("vision_feature_select_strategy", "full" if onevision else "default")
        # HF lays the tiles' features out as a side x side map: a CLS token must be dropped
        # ("default") and a tower without one must keep all ("full"); other pairs fail in HF too.
        if strategy not in ("default", "full") or (strategy == "default") != has_cls:
            raise UnsupportedModelError(f"config.json: vision_feature_select_strategy={strategy!r} with a "
                                        f"{'CLIP' if has_cls else 'SigLIP'} tower is not supported (tiles need "
                                        f"{'default' if has_cls else 'full'})",
                                        param="vision_feature_select_strategy")
        token = cfg.get("image_token_index", cfg.get("image_token_id"))
        if token is None:
            raise CheckpointError("config.json: image_token_index is missing", param="image_token_index")
        pins = cfg.get("image_grid_pinpoints")
        if pins is None:
            pins = ([[384 * i, 384 * j] for i in range(1, 7) for j in range(1, 7)] if onevision else
                    [[336, 672], [672, 336], [672, 672], [1008, 336], [336, 1008]])
        max_patches = None
        if onevision:
            ar = str(cfg.get("vision_aspect_ratio", "anyres_max_9"))
            m = re.fullmatch(r"anyres_max_(\d+)", ar)
            if m is None or int(m.group(1)) <= 0:
                raise UnsupportedModelError(f"config.json: vision_aspect_ratio={ar!r} is not supported "
                                            "(anyres_max_N)", param="vision_aspect_ratio")
            max_patches = int(m.group(1))
        return cls(vision=vision, text=text, image_token_id=int(token), vision_feature_layers=layers,
                   select_strategy=strategy, pinpoints=tuple((int(h), int(w)) for h, w in pins),
                   max_patches=max_patches, projector_act=cfg.get("projector_hidden_act", "gelu"),
                   projector_bias=bool(cfg.get("multimodal_projector_bias", True)), model_type=mt)

    @property
    def side(self) -> int:
        """Vision patches per tile side (each tile's feature map is side x side)."""
        return self.vision.image_size // self.vision.patch_size


def normalize_name(name: str) -> str:
    """LLaVA's naming (`language_model.model.*`, `vision_tower.*`, ...) plus `image_newline`."""
    if name in ("model.image_newline", "image_newline"):
        return "image_newline"
    return llava_normalize_name(name)


class LlavaNextModel(VisionLanguageModel):
    """LlavaNextForConditionalGeneration / LlavaOnevisionForConditionalGeneration (images):
    vision_tower (CLIP or SigLIP, cut after the deepest feature layer), multi_modal_projector,
    image_newline, language_model (the decoder with its lm_head)."""

    def __init__(self, cfg: LlavaNextConfig, dtype=jnp.float32):
        self.config = cfg
        needed = vision_layers_needed(cfg)
        if isinstance(cfg.vision, SiglipVisionConfig):
            self.vision_tower = SiglipVisionModel(cfg.vision, needed, post_layernorm=False, dtype=dtype)
        else:
            self.vision_tower = ClipVisionModel(cfg.vision, needed, dtype)
        self.multi_modal_projector = LlavaMultiModalProjector(
            cfg.vision.hidden_size * len(cfg.vision_feature_layers), cfg.text.hidden_size, act=cfg.projector_act,
            bias=cfg.projector_bias, dtype=dtype)
        self.image_newline = param((cfg.text.hidden_size,), dtype, ("embed",))
        self.language_model = cfg.text.build(dtype)

    def encode(self, pixels: jax.Array) -> jax.Array:
        """pixels [views, S, S, 3] -> [views, side*side + 1, text_hidden]: each view's projected
        features (the vision feature layer(s), the CLS token dropped for "default", the
        projector), then `image_newline` (read by the host layout step, `pack_features`)."""
        cfg = self.config
        if isinstance(cfg.vision, SiglipVisionConfig):
            states = self.vision_tower.hidden_states(pixels)
        else:
            states = self.vision_tower(pixels)
        feats = jnp.concatenate([states[i] for i in feature_layer_indices(cfg)], axis=-1)
        if cfg.select_strategy == "default":
            feats = feats[:, 1:]
        feats = self.multi_modal_projector(feats).astype(self.embed_dtype)
        newline = self.image_newline.get_value().astype(feats.dtype)
        return jnp.concatenate([feats, jnp.broadcast_to(newline, (feats.shape[0], 1, feats.shape[-1]))], axis=1)

    def hf_weights(self, w, name: str = "") -> None:
        """Tensor names as `normalize_name` maps them."""
        self.vision_tower.hf_weights(w, "vision_tower")
        self.multi_modal_projector.linear_1.hf_weights(w, "multi_modal_projector.linear_1")
        self.multi_modal_projector.linear_2.hf_weights(w, "multi_modal_projector.linear_2")
        w.set(self.image_newline, w.take("image_newline", (self.config.text.hidden_size,)))
        self.language_model.hf_weights(w, "language_model.model", "language_model.lm_head.weight")


def bilinear_resize(x: np.ndarray, out_h: int, out_w: int) -> np.ndarray:
    """[h, w, d] -> [out_h, out_w, d], torch's F.interpolate(mode="bilinear",
    align_corners=False) with an output size (source index (i + 0.5) * in / out - 0.5, clamped)."""
    def axis(n_in: int, n_out: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        src = np.maximum((np.arange(n_out, dtype=np.float32) + 0.5) * np.float32(n_in / n_out) - 0.5, 0)
        i0 = np.minimum(np.floor(src).astype(np.int64), n_in - 1)
        return i0, np.minimum(i0 + 1, n_in - 1), (src - i0).astype(np.float32)
    y0, y1, ly = axis(x.shape[0], out_h)
    x0, x1, lx = axis(x.shape[1], out_w)
    top = x[y0] * (1 - ly)[:, None, None] + x[y1] * ly[:, None, None]
    return top[:, x0] * (1 - lx)[None, :, None] + top[:, x1] * lx[None, :, None]


def pack_features(views: np.ndarray, grid: AnyresGrid) -> np.ndarray:
    """One image's encode outputs [1 + tiles, side*side + 1, d] (each view's features, then the
    image_newline row) -> its LLM tokens [num_tokens, d] (HF's pack_image_features; host
    float32, cast back to the features' dtype)."""
    dtype, d, s = views.dtype, views.shape[-1], grid.side
    v = views[:, :-1].astype(np.float32)
    nl = views[0, -1:].astype(np.float32)
    if not grid.tiles:
        return np.concatenate([v[0], nl]).astype(dtype)
    fmap = v[1:].reshape(grid.rows, grid.cols, s, s, d).transpose(0, 2, 1, 3, 4).reshape(grid.rows * s,
                                                                                         grid.cols * s, d)
    top, bottom, left, right = grid.crop
    fmap = fmap[top:bottom, left:right]
    if fmap.shape[:2] != (grid.out_h, grid.out_w):
        fmap = bilinear_resize(fmap, grid.out_h, grid.out_w)
    rows = np.concatenate([fmap, np.broadcast_to(nl[None], (grid.out_h, 1, d))], axis=1)
    return np.concatenate([v[0], rows.reshape(-1, d)]).astype(dtype)


@dataclass
class TiledImageInput(ImageInput):
    """An ImageInput that carries its tile layout (the host layout step needs it after encode;
    it travels with the image from a decode worker process)."""
    layout: AnyresGrid | None = None


@dataclass(eq=False)
class LlavaNextFamily(Family):
    """A loaded LLaVA-NeXT / LLaVA-OneVision model (see the module docstring)."""
    cfg: LlavaNextConfig
    policy: AnyresImagePolicy
    image_token: str = "<image>"
    name: str = "llava_next"

    @property
    def image_token_id(self) -> int:
        return self.cfg.image_token_id

    # ---- host ---------------------------------------------------------------------------------
    def grid(self, height: int, width: int, opts: ImageOptions = ImageOptions()) -> AnyresGrid:
        """The tile layout (and so the exact token count) of a height x width image."""
        return self.policy.grid(height, width, self.cfg.side, max_tiles=opts.max_tiles,
                                max_patches=self.cfg.max_patches)

    def prompt_options(self, opts: ImageOptions, n_images: int) -> ImageOptions:
        """OneVision's processor tiles only the image of a one-image prompt: the images of a
        multi-image prompt are overview only (HF's batch_num_images rule)."""
        if self.cfg.model_type == _ONEVISION and n_images > 1:
            return replace(opts, max_tiles=0)
        return opts

    def prepare_image(self, img, opts: ImageOptions = ImageOptions()) -> ImageInput:
        """Decoded RGB PIL image -> views [1 + tiles, S, S, 3] + exact token count + cache key
        (content hash + preprocessing + tiling). Over `opts.max_tokens`: ContextLengthError
        before any resize."""
        grid = self.grid(img.height, img.width, opts)
        if opts.max_tokens is not None and grid.num_tokens > opts.max_tokens:
            raise ContextLengthError(f"this image takes {grid.num_tokens} tokens ({grid.tiles} tile(s) + overview), "
                                     f"over image_max_tokens={opts.max_tokens}", param="image_max_tokens")
        pixels = self.policy(img, grid)
        size = self.cfg.vision.image_size
        if pixels.shape[1:] != (size, size, 3):
            raise CheckpointError(f"image processor produces {pixels.shape[1:3]} tiles but the vision tower expects "
                                  f"{size}x{size}: the preprocessor config does not match config.json",
                                  param="image_size")
        key = f"{self.name}:{pixel_hash(img)}:{digest(self.policy.cache_key() + (grid,))}"
        return TiledImageInput(pixels=pixels, num_tokens=grid.num_tokens, key=key,
                               grid=(grid.views, self.cfg.side, self.cfg.side), layout=grid)

    def pixel_views(self, image: ImageInput, height: int, width: int) -> list:
        """The overview, then the tiles of the resized-and-padded grid canvas (`AnyresImagePolicy.frames`)."""
        layout = getattr(image, "layout", None) or self.grid(height, width)
        return [((k,), f) for k, f in enumerate(self.policy.frames(height, width, layout))]

    def fit_options(self, max_tokens: int) -> ImageOptions:
        """A tile cap under which every image fits `max_tokens` (the server's --image-max-tokens):
        the most tiles t such that every grid pinpoint of at most t tiles fits even without
        unpadding (overview + rows * (cols + 1) features); 0 (overview only) if none does; no
        cap when all fit."""
        s, tile = self.cfg.side, self.policy.tile
        grids = sorted(((h // tile) * (w // tile), s * s + (h // tile) * s * ((w // tile) * s + 1))
                       for h, w in self.policy.pinpoints)          # (tiles, worst-case tokens)
        cap = 0
        for t in sorted({t for t, _ in grids}):
            if any(worst > max_tokens for t2, worst in grids if t2 <= t):
                break
            cap = t
        return ImageOptions() if cap == grids[-1][0] else ImageOptions(max_tiles=cap)

    # ---- encode -------------------------------------------------------------------------------
    def encode_plan(self, images: list[ImageInput], max_batch: int, shards: int = 1) -> list[EncodeCall]:
        """All images' views in order, cut into calls of `max_batch` views (an image may span
        calls), each padded up the power-of-two ladder (repeating its last view; the runner
        splits a call's views over its `shards` devices). A call's split returns the images
        whose last view it holds, laid out (`pack_features`). The model's `encode` is the
        compiled step."""
        ladder = pow2_ladder(1, max_batch)
        views = [im.pixels for im in images]
        ends = np.cumsum([len(v) for v in views])
        flat = np.concatenate(views) if views else np.zeros((0,))
        grids = [self._layout(im) for im in images]
        done: list[np.ndarray] = []          # view features so far (shared by the calls' splits)
        calls = []
        for lo in range(0, len(flat), max_batch):
            part = flat[lo:lo + max_batch]
            n = len(part)
            b = bucket_for(n, ladder)
            if b > n:
                part = np.concatenate([part, np.repeat(part[-1:], b - n, axis=0)])

            def split(f, lo=lo, n=n):
                done.append(np.asarray(f[:n]))
                have = lo + n
                first = int(np.searchsorted(ends, lo, side="right"))      # first image ending after lo
                last = int(np.searchsorted(ends, have, side="right"))     # images ending by `have`
                if first >= last:
                    return []
                allv = np.concatenate(done) if len(done) > 1 else done[0]
                return [pack_features(allv[ends[i] - len(views[i]):ends[i]], grids[i])
                        for i in range(first, last)]
            calls.append(EncodeCall((b,) + part.shape[1:], part, split))
        return calls

    def _layout(self, image: ImageInput) -> AnyresGrid:
        """The grid an image was prepared with (a one-view image without one: overview only)."""
        layout = getattr(image, "layout", None)
        if layout is None:
            if len(image.pixels) != 1:
                raise InvalidRequestError(f"{self.name} images must come from its prepare_image (their tile "
                                          "layout is missing)", param="images")
            layout = AnyresGrid(0, 0, self.cfg.side)
        return layout

    def warmup_plan(self, max_batch: int, shards: int = 1) -> list[EncodeCall]:
        size = self.cfg.vision.image_size
        return [EncodeCall((b, size, size, 3), np.zeros((b, size, size, 3), np.float32), list)
                for b in pow2_ladder(1, max_batch)]


def load(path: Path, hf_cfg: dict, dtype=jnp.float32) -> tuple[LlavaNextFamily, LlavaNextModel, TensorSource]:
    """config.json + image processor config -> (family, the abstract model, its tensors)."""
    cfg = LlavaNextConfig.from_hf(hf_cfg)
    ipc = find_image_processor_config(path)
    kind = str(ipc.get("image_processor_type", ""))
    want = "LlavaOnevisionImageProcessor" if cfg.model_type == _ONEVISION else "LlavaNextImageProcessor"
    if not kind.startswith(want):
        raise CheckpointError(f"{cfg.model_type} needs a {want}, the checkpoint has {kind!r}",
                              param="image_processor_type")
    policy = AnyresImagePolicy.from_config(ipc, onevision=cfg.model_type == _ONEVISION)
    if policy.tile != cfg.vision.image_size:
        raise CheckpointError(f"image processor tiles are {policy.tile} pixels but the vision tower takes "
                              f"{cfg.vision.image_size}", param="crop_size")
    if set(policy.pinpoints) != set(cfg.pinpoints):
        raise CheckpointError("image processor image_grid_pinpoints differ from config.json's",
                              param="image_grid_pinpoints")
    return (LlavaNextFamily(cfg, policy, image_token=image_token(path), name=cfg.model_type),
            build(lambda: LlavaNextModel(cfg, dtype)), TensorSource(path, normalize_name))
