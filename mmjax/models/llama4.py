"""Llama 4 (Llama4ForConditionalGeneration): image tiles -> the Llama 4 ViT with its pixel-shuffle
adapter (models/vision/llama4.py) -> `multi_modal_projector.linear_1` -> the Llama 4 MoE decoder
with chunked local RoPE layers and global NoPE layers (models/text/llama4.py).

Images (image/llama4.py, Llama4ImageProcessor's arithmetic): a rows x cols canvas of square tiles
(rows * cols <= max_patches), plus a global tile when there are several; every tile gives
`tokens_per_tile` features, so the token count is known from the image size alone.
`ImageOptions.max_tiles` (the server's `detail` / --max-image-tiles / token budget) lowers
max_patches; 0 or 1 keeps one tile (the image fitted into a single tile, no global tile).

Prompt: each `<|image|>` placeholder becomes Llama4Processor's text (`image_prompt`):
`<|image_start|>`, per tile row the tiles' `<|patch|>` runs separated by `<|tile_x_separator|>`
and closed by `<|tile_y_separator|>` (multi-tile images only), then `<|image|>` + the global
tile's (or the single tile's) `<|patch|>` run, then `<|image_end|>`. The `<|patch|>` tokens
(config `image_token_index`) take the features in view order. Positions are 1-D.

Encode: all waiting images' tiles form one stream of equally shaped tiles cut into calls of
`max_batch` tiles padded up the power-of-two ladder (Idefics3's plan: an image's tiles may span
calls).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from mmjax.buckets import pow2_ladder
from mmjax.checkpoint import TensorSource
from mmjax.errors import CheckpointError, ContextLengthError
from mmjax.image.decode import pixel_hash
from mmjax.image.llama4 import Llama4ImagePolicy
from mmjax.image.processors import digest, find_image_processor_config
from mmjax.models.family import EncodeCall, Family, ImageInput, ImageOptions, VisionLanguageModel
from mmjax.models.hf_config import require, tie_word_embeddings
from mmjax.models.idefics3 import Idefics3Family
from mmjax.models.nn.linear import Linear
from mmjax.models.nn.weights import build
from mmjax.models.text.llama4 import Llama4TextConfig
from mmjax.models.vision.llama4 import Llama4VisionConfig, Llama4VisionModel

TOKENS = ("<|image_start|>", "<|image_end|>", "<|image|>", "<|patch|>", "<|tile_x_separator|>",
          "<|tile_y_separator|>")


@dataclass(frozen=True)
class Llama4Config:
    vision: Llama4VisionConfig
    text: Llama4TextConfig
    image_token_id: int          # <|patch|>: the positions that take features

    @classmethod
    def from_hf(cls, cfg: dict) -> "Llama4Config":
        text_cfg = dict(require(cfg, "text_config", "config"))
        text = Llama4TextConfig.from_hf(text_cfg, "text_config",
                                        tie_word_embeddings=tie_word_embeddings(cfg, text_cfg))
        vision = Llama4VisionConfig.from_hf(dict(require(cfg, "vision_config", "config")), "vision_config")
        token = cfg.get("image_token_index", cfg.get("image_token_id", 200092))
        return cls(vision=vision, text=text, image_token_id=int(token))


class Llama4MultiModalProjector(nnx.Module):
    """`linear_1`: vision_output_dim -> text hidden, no bias (replicated under tensor parallelism)."""

    def __init__(self, d_in: int, d_out: int, dtype=jnp.float32):
        self.linear_1 = Linear(d_in, d_out, dtype=dtype, axes=(None, None))

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.linear_1(x)


class Llama4Model(VisionLanguageModel):
    """Llama4ForConditionalGeneration: vision_model, multi_modal_projector, language_model (HF's
    `language_model.model` with `language_model.lm_head`)."""

    def __init__(self, cfg: Llama4Config, dtype=jnp.float32):
        self.config = cfg
        self.vision_model = Llama4VisionModel(cfg.vision, dtype)
        self.multi_modal_projector = Llama4MultiModalProjector(cfg.vision.vision_output_dim, cfg.text.hidden_size,
                                                               dtype)
        self.language_model = cfg.text.build(dtype)

    def encode(self, pixels: jax.Array) -> jax.Array:
        """pixels [tiles, size, size, 3] -> [tiles, tokens_per_tile, text_hidden]."""
        return self.multi_modal_projector(self.vision_model(pixels)).astype(self.embed_dtype)

    def hf_weights(self, w, name: str = "") -> None:
        self.vision_model.hf_weights(w, "vision_model")
        self.multi_modal_projector.linear_1.hf_weights(w, "multi_modal_projector.linear_1")
        self.language_model.hf_weights(w, "language_model.model", "language_model.lm_head.weight")


@dataclass
class TiledImage(ImageInput):
    """An ImageInput with its tile grid (rows, cols); (1, 1): one tile, no global tile."""
    rows: int = 1
    cols: int = 1


@dataclass(eq=False)
class Llama4Family(Family):
    """A loaded Llama 4 model: every view is one tile of `tokens_per_tile` `<|patch|>` tokens."""
    cfg: Llama4Config
    policy: Llama4ImagePolicy
    image_token: str = "<|image|>"
    name: str = "llama4"

    @property
    def image_token_id(self) -> int:
        return self.cfg.image_token_id

    @property
    def tokens_per_tile(self) -> int:
        return self.cfg.vision.tokens_per_tile

    # ---- host ---------------------------------------------------------------------------------
    def _max_patches(self, opts: ImageOptions) -> int:
        cap = opts.max_tiles
        return self.policy.max_patches if cap is None else max(1, min(cap, self.policy.max_patches))

    def prepare_image(self, img, opts: ImageOptions = ImageOptions()) -> TiledImage:
        """Decoded RGB PIL image -> views [rows*cols (+1 global), size, size, 3]; tokens = views *
        tokens_per_tile. Over the token budget: a ContextLengthError before any resize."""
        mp = self._max_patches(opts)
        rows, cols = self.policy.grid(img.height, img.width, mp)
        views = rows * cols + (1 if rows * cols > 1 else 0)
        n = views * self.tokens_per_tile
        if opts.max_tokens is not None and n > opts.max_tokens:
            raise ContextLengthError(f"this image takes {n} tokens ({views} tile(s) of {self.tokens_per_tile}), "
                                     f"over image_max_tokens={opts.max_tokens}", param="image_max_tokens")
        pixels, r, c = self.policy(img, mp)
        assert (r, c) == (rows, cols), "image grid disagrees with the processor arithmetic"
        key = f"{self.name}:{pixel_hash(img)}:{digest(self.policy.cache_key(mp))}"
        side = self.cfg.vision.patches_per_side
        return TiledImage(pixels=pixels, num_tokens=n, key=key, grid=(views, side, side), rows=rows, cols=cols,
                          source_size=(img.width, img.height))

    def fit_options(self, max_tokens: int) -> ImageOptions:
        """The most tiles whose tokens (with the global tile's) fit the budget (one tile at least)."""
        return ImageOptions(max_tiles=max(1, max_tokens // self.tokens_per_tile - 1))

    def image_prompt(self, image: ImageInput) -> str:
        """Llama4Processor's `_prompt_split_image` text for one image (a pooled image,
        mmjax.research.Pool, has fewer tokens per view)."""
        rows, cols = getattr(image, "rows", 1), getattr(image, "cols", 1)
        run = "<|patch|>" * (image.num_tokens // len(image.pixels))
        text = "<|image_start|>"
        if rows * cols > 1:
            text += "".join("<|tile_x_separator|>".join([run] * cols) + "<|tile_y_separator|>" for _ in range(rows))
        return text + "<|image|>" + run + "<|image_end|>"

    def pixel_views(self, image: ImageInput, height: int, width: int) -> list:
        """The canvas tiles (row-major), then the global tile."""
        mp = len(image.pixels) - (1 if len(image.pixels) > 1 else 0)
        rows, cols = getattr(image, "rows", 1), getattr(image, "cols", 1)
        frames = self.policy.frames(height, width, max(mp, rows * cols))
        return [((k,), f) for k, f in enumerate(frames)]

    def token_grid(self, image: ImageInput) -> tuple[int, int, int]:
        """(views, rows, cols): each view's tokens are a square grid."""
        if image.token_grid is not None:
            return image.token_grid
        side = self.cfg.vision.patches_per_side // self.cfg.vision.shuffle
        return (image.num_tokens // (side * side), side, side)

    # ---- encode -------------------------------------------------------------------------------
    def encode_plan(self, images: list[ImageInput], max_batch: int, shards: int = 1) -> list[EncodeCall]:
        """Idefics3's tile stream (its docstring): equally shaped tiles, whole images or not."""
        return Idefics3Family.encode_plan(self, images, max_batch, shards)

    def warmup_plan(self, max_batch: int, shards: int = 1) -> list[EncodeCall]:
        size = self.policy.tile
        return [EncodeCall((b, size, size, 3), np.zeros((b, size, size, 3), np.float32), list)
                for b in pow2_ladder(1, max_batch)]


def _added_tokens(path: Path) -> set[str]:
    p = path / "tokenizer.json"
    return {t["content"] for t in json.loads(p.read_text()).get("added_tokens", [])} if p.is_file() else set()


def load(path: Path, hf_cfg: dict, dtype=jnp.float32) -> tuple[Llama4Family, Llama4Model, TensorSource]:
    """config.json + Llama4Processor configs -> (family, the abstract model, its tensors)."""
    cfg = Llama4Config.from_hf(hf_cfg)
    ipc = find_image_processor_config(path)
    kind = str(ipc.get("image_processor_type", ""))
    if not kind.startswith("Llama4ImageProcessor"):
        raise CheckpointError(f"llama4 needs a Llama4ImageProcessor, the checkpoint has {kind!r}",
                              param="image_processor_type")
    policy = Llama4ImagePolicy.from_config(ipc)
    if policy.tile != cfg.vision.image_size:
        raise CheckpointError(f"image processor size={policy.tile} != vision_config.image_size="
                              f"{cfg.vision.image_size}: tiles of another size are not supported", param="size")
    proc = path / "processor_config.json"
    pc = json.loads(proc.read_text()) if proc.is_file() else {}
    patch = int(pc.get("patch_size", cfg.vision.patch_size))
    ratio = float(pc.get("pixel_shuffle_ratio", cfg.vision.pixel_shuffle_ratio))
    per_tile = (policy.tile // patch) ** 2 // int(round(1 / ratio ** 2))
    if per_tile != cfg.vision.tokens_per_tile:
        raise CheckpointError(f"processor patch_size={patch} / pixel_shuffle_ratio={ratio} give {per_tile} tokens per "
                              f"tile, the vision tower {cfg.vision.tokens_per_tile}", param="patch_size")
    added = _added_tokens(path)
    for t in TOKENS:
        if added and t not in added:
            raise CheckpointError(f"tokenizer has no {t!r} token", param="tokenizer")
    return Llama4Family(cfg, policy), build(lambda: Llama4Model(cfg, dtype)), TensorSource(path, lambda n: n)
