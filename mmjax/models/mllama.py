"""Llama 3.2 Vision (MllamaForConditionalGeneration): the family's pure pieces (config, image
preparation, encode plan) and its module, `MllamaModel` (`vision_model` -> `multi_modal_projector`,
and `language_model`, the decoder with its gated cross-attention layers). The engine drives it
through `Family.cross_attention`: it fills the decoder's per-slot cross-attention cache once per
request (`MllamaTextModel.fill_cross`) and passes each prefill token's image range.

Images never enter the token sequence: each `<|image|>` is ONE token, and the decoder's
cross-attention layers read the image's projected vision tokens (max_num_tiles * (patches + 1)
per image, absent tiles included, since HF's vision mask lets real tokens see them).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from mmjax.buckets import bucket_for, pow2_ladder
from mmjax.checkpoint import TensorSource
from mmjax.errors import CheckpointError, ContextLengthError, InvalidRequestError
from mmjax.image.decode import pixel_hash
from mmjax.image.mllama import MllamaImagePolicy
from mmjax.image.processors import digest, find_image_processor_config
from mmjax.models.family import EncodeCall, EncodedImage, Family, ImageInput, ImageOptions, VisionLanguageModel
from mmjax.models.hf_config import require
from mmjax.models.nn.linear import Linear
from mmjax.models.nn.weights import build
from mmjax.models.text.mllama import MllamaTextConfig, MllamaTextModel, packed_ranges
from mmjax.models.vision.mllama import MllamaVisionConfig, MllamaVisionModel

MAX_IMAGES = 2       # images per request the per-slot cross-attention cache holds


@dataclass(frozen=True)
class MllamaConfig:
    vision: MllamaVisionConfig
    text: MllamaTextConfig
    image_token_id: int

    @classmethod
    def from_hf(cls, cfg: dict) -> "MllamaConfig":
        vision = MllamaVisionConfig.from_hf(require(cfg, "vision_config", "config"))
        text = MllamaTextConfig.from_hf(require(cfg, "text_config", "config"))
        token = cfg.get("image_token_index", cfg.get("image_token_id"))
        if token is None:
            raise CheckpointError("config.json: image_token_index is missing", param="image_token_index")
        return cls(vision=vision, text=text, image_token_id=int(token))

    @property
    def vision_tokens_per_image(self) -> int:
        return self.vision.max_num_tiles * self.vision.num_patches


def normalize_name(name: str) -> str:
    """v5 in-memory names (`model.language_model.*`, `model.vision_model.*`, ...) -> the saved layout."""
    for old, new in (("model.language_model.", "language_model.model."), ("model.vision_model.", "vision_model."),
                     ("model.multi_modal_projector.", "multi_modal_projector.")):
        if name.startswith(old):
            return new + name[len(old):]
    return "language_model.lm_head.weight" if name == "lm_head.weight" else name


class MllamaModel(VisionLanguageModel):
    """MllamaForConditionalGeneration: vision_model (the tiled tower), multi_modal_projector (one
    Linear, vision_output_dim -> text hidden), language_model (the decoder with its lm_head)."""

    def __init__(self, cfg: MllamaConfig, dtype=jnp.float32):
        self.config = cfg
        d = cfg.text.base.hidden_size
        self.vision_model = MllamaVisionModel(cfg.vision, dtype)
        self.multi_modal_projector = Linear(cfg.vision.output_dim, d, bias=True, dtype=dtype,
                                            axes=("embed", "vision_mlp"))
        self.language_model = MllamaTextModel(cfg.text, MAX_IMAGES, cfg.vision_tokens_per_image,
                                              cfg.vision.num_patches, dtype)

    def encode(self, inputs: tuple) -> jax.Array:
        """(tiles [n, max_tiles, S, S, 3], aspect-ratio ids [n], tile counts [n]) -> projected
        vision tokens [n, max_tiles * (patches + 1), text_hidden] (HF's cross_attention_states per image)."""
        tiles, ar_ids, n_tiles = inputs
        x = self.multi_modal_projector(self.vision_model(tiles, ar_ids, n_tiles))
        return x.reshape(x.shape[0], -1, x.shape[-1]).astype(self.embed_dtype)

    def hf_weights(self, w, name: str = "") -> None:
        """Tensor names as `normalize_name` maps them."""
        self.vision_model.hf_weights(w, "vision_model")
        self.multi_modal_projector.hf_weights(w, "multi_modal_projector")
        self.language_model.hf_weights(w, "language_model.model", "language_model.lm_head.weight")


@dataclass(eq=False)
class MllamaFamily(Family):
    cfg: MllamaConfig
    policy: MllamaImagePolicy
    image_token: str = "<|image|>"
    name: str = "mllama"
    feature_placement: str = "cross_attention"
    max_images: int = MAX_IMAGES     # images per request the per-slot cross-attention cache holds

    def cross_ranges(self, ids: np.ndarray, images: list) -> np.ndarray:
        """Each prompt token's packed image range (HF's cross_attention_mask rule)."""
        if len(images) > self.max_images:
            raise InvalidRequestError(f"{len(images)} images in one request; this model's cross-attention cache "
                                      f"holds {self.max_images}", param="images", code="too_many_images")
        return packed_ranges(np.asarray(ids), self.image_token_id)

    @property
    def image_token_id(self) -> int:
        return self.cfg.image_token_id

    def prepare_image(self, img, opts: ImageOptions = ImageOptions()) -> ImageInput:
        """Decoded RGB PIL image -> pixels = tiles [max_tiles, S, S, 3] (absent tiles zero), grid =
        (real tiles, tile rows, tile cols) (the aspect-ratio id follows from rows, cols), one
        prompt token (`<|image|>`) per image; the encoder-cache key names the preprocessing."""
        if opts.max_tokens is not None and opts.max_tokens < 1:
            raise ContextLengthError("an image takes one prompt token", param="image_max_tokens")
        tiles, ar, n = self.policy(img)
        rows, cols = self.policy.arrangement(img.height, img.width)
        key = f"{self.name}:{pixel_hash(img)}:{digest(self.policy.cache_key())}"
        return ImageInput(pixels=tiles, num_tokens=1, key=key, grid=(n, rows, cols))

    def encoded(self, image: ImageInput, feats: np.ndarray, hidden_size: int) -> EncodedImage:
        """The projected vision tokens of the image's real tiles only, [tiles * (patches + 1),
        hidden] (the encode step returns every max_num_tiles tile, the padding ones included, for
        the cross-attention cache)."""
        n = int(image.grid[0]) * self.cfg.vision.num_patches
        feats = np.asarray(feats)[:n]
        return EncodedImage(feats, np.zeros((0,) + feats.shape, feats.dtype))

    def pixel_views(self, image: ImageInput, height: int, width: int) -> list:
        """The real tiles of the image's canvas (the padding tiles show nothing)."""
        return [((k,), f) for k, f in enumerate(self.policy.frames(height, width))]

    def aspect_ratio_id(self, image: ImageInput) -> int:
        _, rows, cols = image.grid
        return self.policy.aspect_ratio_id(rows, cols)

    def encode_plan(self, images: list[ImageInput], max_batch: int, shards: int = 1) -> list[EncodeCall]:
        """Whole images (all max_num_tiles tiles each) stacked into calls of at most max_batch,
        padded up the power-of-two ladder by repeating the last image."""
        ladder = pow2_ladder(1, max_batch)
        calls = []
        for i in range(0, len(images), max_batch):
            part = images[i:i + max_batch]
            b = bucket_for(len(part), ladder)
            padded = part + [part[-1]] * (b - len(part))
            inputs = (np.stack([im.pixels for im in padded]),
                      np.asarray([self.aspect_ratio_id(im) for im in padded], np.int32),
                      np.asarray([im.grid[0] for im in padded], np.int32))
            calls.append(EncodeCall((b,), inputs, lambda f, n=len(part): list(f[:n])))
        return calls

    def warmup_plan(self, max_batch: int, shards: int = 1) -> list[EncodeCall]:
        v = self.cfg.vision
        return [EncodeCall((b,), (np.zeros((b, v.max_num_tiles, v.image_size, v.image_size, 3), np.float32),
                                  np.ones((b,), np.int32), np.ones((b,), np.int32)), list)
                for b in pow2_ladder(1, max_batch)]


def load(path: Path, hf_cfg: dict, dtype=jnp.float32) -> tuple[MllamaFamily, MllamaModel, TensorSource]:
    """config.json + image processor config -> (family, the abstract model, its tensors)."""
    cfg = MllamaConfig.from_hf(hf_cfg)
    ipc = find_image_processor_config(path)
    if not str(ipc.get("image_processor_type", "")).startswith("MllamaImageProcessor"):
        raise CheckpointError("mllama needs a MllamaImageProcessor", param="image_processor_type")
    policy = MllamaImagePolicy.from_config(ipc)
    if policy.tile != cfg.vision.image_size or policy.max_image_tiles != cfg.vision.max_num_tiles:
        raise CheckpointError("image processor tile size / max_image_tiles do not match config.json",
                              param="max_image_tiles")
    return MllamaFamily(cfg, policy), build(lambda: MllamaModel(cfg, dtype)), TensorSource(path, normalize_name)
