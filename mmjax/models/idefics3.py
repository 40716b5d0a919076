"""Idefics3 (Idefics3ForConditionalGeneration) and SmolVLM (SmolVLMForConditionalGeneration):
image tiles -> SigLIP-style ViT (models/vision/siglip.py) -> pixel-shuffle connector (space to
depth by `scale_factor`, then a linear projection) -> Llama decoder (models/text/llama.py).

Images: the processor (image/idefics3.py) cuts an image into a rows x cols grid of
`max_image_size` tiles plus the global image (or the global image alone: a small image, image
splitting off, `detail: "low"`); every view is one square tile of `image_seq_len` tokens, so
the token count is (rows * cols + 1) * image_seq_len, known from the image size alone.

Prompt: each `<image>` placeholder becomes the processor's text (`image_prompt`):
`<fake_token_around_image><row_1_col_1><image>*seq ... \\n` per row, then
`\\n<fake_token_around_image><global-img><image>*seq<fake_token_around_image>`; unsplit images get
only the global block. The `<image>` tokens take the features in view order. Positions are 1-D.

Encode: the views of all waiting images are one stream of equally shaped tiles, cut into calls
of `max_batch` tiles padded up the power-of-two ladder; an image's tiles may span calls (each
call's `split` hands over the images whose last tile it holds), so one image of 10 tiles and ten
images of one tile cost the same calls.

Position ids: every tile is full (the processors pad nothing), so the tower uses SigLIP's
row-major ids. transformers computes them with a float32 bucketize that is the identity for the
released grids (26, 27, 32 patches per side) but, by rounding, not for some others (19, 25,
29, ...); checkpoints with such grids would differ slightly there.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from mmjax.buckets import bucket_for, pow2_ladder
from mmjax.checkpoint import TensorSource
from mmjax.errors import CheckpointError, ContextLengthError
from mmjax.image.decode import pixel_hash
from mmjax.image.idefics3 import Idefics3ImagePolicy
from mmjax.image.processors import digest, find_image_processor_config
from mmjax.models.family import EncodeCall, Family, ImageInput, ImageOptions, VisionLanguageModel
from mmjax.models.hf_config import require, tie_word_embeddings
from mmjax.models.nn.linear import Linear
from mmjax.models.nn.weights import build, load_module
from mmjax.models.text import text_config
from mmjax.models.vision.siglip import SiglipVisionConfig, SiglipVisionModel

PROCESSORS = {"idefics3": "Idefics3ImageProcessor", "smolvlm": "SmolVLMImageProcessor"}


@dataclass(frozen=True)
class Idefics3Config:
    vision: SiglipVisionConfig
    text: object            # the decoder's config (models/text)
    scale_factor: int
    image_token_id: int
    model_type: str = "idefics3"

    @classmethod
    def from_hf(cls, cfg: dict) -> "Idefics3Config":
        text_cfg = dict(require(cfg, "text_config", "config"))
        text_cfg.setdefault("model_type", "llama")
        text = text_config(text_cfg, "text_config", tie_word_embeddings=tie_word_embeddings(cfg, text_cfg))
        # transformers builds Idefics3VisionTransformer whatever vision_config.model_type says
        # (hub configs say "idefics3", "idefics3_vision" or "smolvlm_vision")
        vision_cfg = {**require(cfg, "vision_config", "config"), "model_type": "idefics3_vision"}
        vision = SiglipVisionConfig.from_hf(vision_cfg, "vision_config")
        scale = int(cfg.get("scale_factor", 2))
        if scale <= 0 or vision.patches_per_side % scale:
            raise CheckpointError(f"config.json: scale_factor={scale} must divide the {vision.patches_per_side} "
                                  "patches per side", param="scale_factor")
        return cls(vision=vision, text=text, scale_factor=scale,
                   image_token_id=int(require(cfg, "image_token_id", "config")),
                   model_type=str(cfg.get("model_type", "idefics3")))

    @property
    def tokens_per_tile(self) -> int:
        """image_seq_len: (patches per side / scale_factor) ** 2."""
        return (self.vision.patches_per_side // self.scale_factor) ** 2


def pixel_shuffle(x: jax.Array, scale: int) -> jax.Array:
    """HF's Idefics3Connector.pixel_shuffle: [b, side*side, d] -> [b, (side/s)^2, d*s*s]; each
    output token holds an s x s block of patches (an s-row stack of s-patch runs)."""
    b, seq, d = x.shape
    side = int(round(seq ** 0.5))
    x = x.reshape(b, side, side // scale, d * scale)
    x = x.transpose(0, 2, 1, 3).reshape(b, side // scale, side // scale, d * scale * scale)
    return x.transpose(0, 2, 1, 3).reshape(b, seq // scale ** 2, d * scale * scale)


class Idefics3SimpleMLP(nnx.Module):
    """`proj`: vision_hidden * scale^2 -> text_hidden, no bias (one projection: replicated, also
    under vision tensor parallelism)."""

    def __init__(self, d_in: int, d_out: int, dtype=jnp.float32):
        self.proj = Linear(d_in, d_out, dtype=dtype, axes=(None, None))

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.proj(x)


class Idefics3Connector(nnx.Module):
    """HF's Idefics3Connector: pixel shuffle (space to depth by `scale_factor`), then
    `modality_projection`."""

    def __init__(self, cfg: Idefics3Config, dtype=jnp.float32):
        self.scale_factor = cfg.scale_factor
        self.modality_projection = Idefics3SimpleMLP(cfg.vision.hidden_size * cfg.scale_factor ** 2,
                                                     cfg.text.hidden_size, dtype)

    def __call__(self, x: jax.Array) -> jax.Array:
        """x [tiles, patches, vision_hidden] -> [tiles, tokens_per_tile, text_hidden]."""
        return self.modality_projection(pixel_shuffle(x, self.scale_factor))


class Idefics3Model(VisionLanguageModel):
    """Idefics3ForConditionalGeneration / SmolVLMForConditionalGeneration: vision_model (SigLIP;
    HF's `model.vision_model`), connector (`model.connector`), language_model (the Llama decoder:
    HF's `model.text_model` with the top-level `lm_head`)."""

    def __init__(self, cfg: Idefics3Config, dtype=jnp.float32):
        self.config = cfg
        self.vision_model = SiglipVisionModel(cfg.vision, dtype=dtype)
        self.connector = Idefics3Connector(cfg, dtype)
        self.language_model = cfg.text.build(dtype)

    def encode(self, pixels: jax.Array) -> jax.Array:
        """pixels [tiles, size, size, 3] -> [tiles, tokens_per_tile, text_hidden]: SigLIP's last
        hidden state (post-layernorm), pixel shuffle, projection."""
        return self.connector(self.vision_model(pixels)).astype(self.embed_dtype)

    def hf_weights(self, w, name: str = "") -> None:
        self.vision_model.hf_weights(w, "model.vision_model")
        load_module(self.connector, w, "model.connector")
        self.language_model.hf_weights(w, "model.text_model", "lm_head.weight")


@dataclass
class TiledImage(ImageInput):
    """An ImageInput with its tile grid (rows, cols); (0, 0): the global image only."""
    rows: int = 0
    cols: int = 0


@dataclass(eq=False)
class Idefics3Family(Family):
    """A loaded Idefics3 / SmolVLM model: every view is one tile of `tokens_per_tile` tokens."""
    cfg: Idefics3Config
    policy: Idefics3ImagePolicy
    image_token: str = "<image>"
    fake_token: str = "<fake_token_around_image>"
    global_token: str = "<global-img>"
    name: str = "idefics3"

    @property
    def image_token_id(self) -> int:
        return self.cfg.image_token_id

    # ---- host ---------------------------------------------------------------------------------
    def _settings(self, height: int, width: int, opts: ImageOptions) -> tuple[bool, int | None, int, int]:
        """(split, longest_edge, rows, cols) for this image under the options: max_tiles 0 turns
        splitting off (the global image alone); a smaller cap lowers the first resize's longest
        edge, a tile at a time, until the grid fits (as the processor with that `size`)."""
        cap = opts.max_tiles
        if cap == 0:
            return False, None, 0, 0
        rows, cols = self.policy.grid(height, width)
        if cap is None or rows * cols <= cap or not self.policy.do_resize:
            return self.policy.do_image_splitting, None, rows, cols
        t = self.policy.tile
        for m in range(self.policy.longest_edge // t, 0, -1):
            rows, cols = self.policy.grid(height, width, longest_edge=m * t)
            if rows * cols <= cap:
                return True, m * t, rows, cols
        return True, t, 0, 0

    def prepare_image(self, img, opts: ImageOptions = ImageOptions()) -> TiledImage:
        """Decoded RGB PIL image -> views [rows*cols + 1 (or 1), size, size, 3]; tokens =
        views * tokens_per_tile. Over the token budget: a ContextLengthError before any resize."""
        split, edge, rows, cols = self._settings(img.height, img.width, opts)
        views = rows * cols + 1
        n = views * self.cfg.tokens_per_tile
        if opts.max_tokens is not None and n > opts.max_tokens:
            raise ContextLengthError(f"this image takes {n} tokens ({views} tile(s) of {self.cfg.tokens_per_tile}), "
                                     f"over image_max_tokens={opts.max_tokens}", param="image_max_tokens")
        pixels, r, c = self.policy(img, split=split, longest_edge=edge)
        assert (r, c) == (rows, cols), "image grid disagrees with the processor arithmetic"
        key = f"{self.name}:{pixel_hash(img)}:{digest(self.policy.cache_key(split=split, longest_edge=edge))}"
        side = self.cfg.vision.patches_per_side
        return TiledImage(pixels=pixels, num_tokens=n, key=key, grid=(views, side, side), rows=rows, cols=cols)

    def fit_options(self, max_tokens: int) -> ImageOptions:
        """The most tiles whose tokens (with the global image's) fit the budget."""
        return ImageOptions(max_tiles=max(0, max_tokens // self.cfg.tokens_per_tile - 1))

    def image_prompt(self, image: ImageInput) -> str:
        """The processor's text for one image (Idefics3Processor / SmolVLMProcessor): per tile
        `<fake_token_around_image><row_r_col_c>` + its image tokens, a newline after each row, then
        `\\n<fake_token_around_image><global-img>` + the global image's tokens +
        `<fake_token_around_image>`. (A pooled image, mmjax.research.Pool, has fewer per view.)"""
        rows, cols = getattr(image, "rows", 0), getattr(image, "cols", 0)
        per_view = image.num_tokens // len(image.pixels)
        tokens = self.image_token * per_view
        glob = f"{self.fake_token}{self.global_token}{tokens}{self.fake_token}"
        if not rows:
            return glob
        text = "".join("".join(f"{self.fake_token}<row_{r + 1}_col_{c + 1}>{tokens}" for c in range(cols)) + "\n"
                       for r in range(rows))
        return text + "\n" + glob

    def pixel_views(self, image: ImageInput, height: int, width: int) -> list:
        """The tiles (row-major), then the global image."""
        rows, cols = getattr(image, "rows", 0), getattr(image, "cols", 0)
        return [((k,), f) for k, f in enumerate(self.policy.frames(height, width, rows, cols))]

    def token_grid(self, image: ImageInput) -> tuple[int, int, int]:
        """(views, rows, cols): each view's tokens are a square grid."""
        if image.token_grid is not None:
            return image.token_grid
        side = self.cfg.vision.patches_per_side // self.cfg.scale_factor
        return (image.num_tokens // (side * side), side, side)

    # ---- encode -------------------------------------------------------------------------------
    def encode_plan(self, images: list[ImageInput], max_batch: int, shards: int = 1) -> list[EncodeCall]:
        """All images' views as one stream of tiles, cut into calls of at most `max_batch` tiles,
        each padded up the power-of-two ladder (repeating its last tile). Call k's `split`
        stores its tiles' features and returns the images whose last tile it holds, in order
        (calls are split in order, as the runner runs them)."""
        ladder = pow2_ladder(1, max_batch)
        owner = np.concatenate([np.full(len(im.pixels), i) for i, im in enumerate(images)]) if images else []
        tiles = np.concatenate([im.pixels for im in images]) if images else np.zeros((0,))
        parts: list[list] = [[None] * len(im.pixels) for im in images]
        first = np.cumsum([0] + [len(im.pixels) for im in images])
        calls = []
        for lo in range(0, len(tiles), max_batch):
            part = tiles[lo:lo + max_batch]
            n = len(part)
            b = bucket_for(n, ladder)
            if b > n:
                part = np.concatenate([part, np.repeat(part[-1:], b - n, axis=0)])
            done = [i for i in sorted(set(owner[lo:lo + n].tolist())) if first[i + 1] <= lo + n]

            def split(f, lo=lo, n=n, done=done):
                for j in range(n):
                    i = int(owner[lo + j])
                    parts[i][lo + j - first[i]] = np.asarray(f[j])
                return [np.concatenate(parts[i]).reshape(-1, f.shape[-1]) for i in done]
            calls.append(EncodeCall((b,) + part.shape[1:], part, split))
        return calls

    def warmup_plan(self, max_batch: int, shards: int = 1) -> list[EncodeCall]:
        size = self.policy.tile
        return [EncodeCall((b, size, size, 3), np.zeros((b, size, size, 3), np.float32), list)
                for b in pow2_ladder(1, max_batch)]


def _added_tokens(path: Path) -> set[str]:
    p = path / "tokenizer.json"
    return {t["content"] for t in json.loads(p.read_text()).get("added_tokens", [])} if p.is_file() else set()


def load(path: Path, hf_cfg: dict, dtype=jnp.float32) -> tuple[Idefics3Family, Idefics3Model, TensorSource]:
    """config.json + Idefics3 / SmolVLM processor configs -> (family, the abstract model, its tensors)."""
    cfg = Idefics3Config.from_hf(hf_cfg)
    ipc = find_image_processor_config(path)
    kind = str(ipc.get("image_processor_type", ""))
    if not any(kind.startswith(k) for k in PROCESSORS.values()):
        raise CheckpointError(f"{cfg.model_type} needs an Idefics3ImageProcessor or SmolVLMImageProcessor, "
                              f"the checkpoint has {kind!r}", param="image_processor_type")
    policy = Idefics3ImagePolicy.from_config(ipc)
    if policy.tile != cfg.vision.image_size:
        raise CheckpointError(f"image processor max_image_size={policy.tile} != vision_config.image_size="
                              f"{cfg.vision.image_size}: tiles of another size are not supported",
                              param="max_image_size")
    proc = path / "processor_config.json"
    seq = json.loads(proc.read_text()).get("image_seq_len") if proc.is_file() else None
    if seq is not None and int(seq) != cfg.tokens_per_tile:
        raise CheckpointError(f"processor image_seq_len={seq} != (patches per side / scale_factor)^2 = "
                              f"{cfg.tokens_per_tile}", param="image_seq_len")
    strings = {}
    if cfg.model_type == "smolvlm":   # SmolVLMProcessor reads its token strings from the tokenizer
        tok_cfg = path / "tokenizer_config.json"
        named = json.loads(tok_cfg.read_text()) if tok_cfg.is_file() else {}
        if isinstance(named.get("extra_special_tokens"), dict):     # older saves nest them
            named = {**named, **named["extra_special_tokens"]}
        for field, key in (("image_token", "image_token"), ("fake_token", "fake_image_token"),
                           ("global_token", "global_image_token")):
            if isinstance(named.get(key), str):
                strings[field] = named[key]
    added = _added_tokens(path)
    for field in ("image_token", "fake_token"):
        value = strings.get(field, Idefics3Family.__dataclass_fields__[field].default)
        if added and value not in added:
            raise CheckpointError(f"tokenizer has no {value!r} token", param="tokenizer")
    return (Idefics3Family(cfg, policy, name=cfg.model_type, **strings), build(lambda: Idefics3Model(cfg, dtype)),
            TensorSource(path, lambda n: n))
