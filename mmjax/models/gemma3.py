"""Gemma 3 family (Gemma3ForConditionalGeneration): SigLIP -> soft-token pooling + RMSNorm +
projection -> Gemma 3 decoder (models/text/gemma3.py).

Prompt: each `<start_of_image>` placeholder becomes the processor's text
`"\\n\\n<start_of_image>" + "<image_soft_token>" * mm_tokens_per_image + "<end_of_image>\\n\\n"`
(with pan-and-scan: "Here is the original image ... and here are some crops to help you see
better ..." and one such block per crop), tokenized with the prompt (`image_prompt`). The soft
tokens take the image features in order; each run of them is one bidirectional span
(`bidirectional_images`), as transformers' token_type_ids mask. Positions are 1-D.
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
from mmjax.errors import CheckpointError, ContextLengthError, InvalidRequestError
from mmjax.image.decode import pixel_hash
from mmjax.image.gemma3 import Gemma3ImagePolicy
from mmjax.image.processors import digest, find_image_processor_config
from mmjax.models.family import EncodeCall, Family, ImageInput, ImageOptions, VisionLanguageModel
from mmjax.models.hf_config import require, tie_word_embeddings
from mmjax.models.llava import normalize_name  # Gemma 3 checkpoints use LLaVA's weight layout
from mmjax.models.nn.linear import Linear
from mmjax.models.nn.norm import RMSNorm
from mmjax.models.nn.weights import build
from mmjax.models.text import text_config
from mmjax.models.text.gemma3 import Gemma3TextConfig
from mmjax.models.vision.siglip import SiglipVisionConfig, SiglipVisionModel


@dataclass(frozen=True)
class Gemma3Config:
    vision: SiglipVisionConfig
    text: Gemma3TextConfig
    mm_tokens_per_image: int
    image_token_id: int          # <image_soft_token>: the positions that take features
    boi_token_id: int
    eoi_token_id: int

    @classmethod
    def from_hf(cls, cfg: dict) -> "Gemma3Config":
        text_cfg = dict(require(cfg, "text_config", "config"))
        text_cfg.setdefault("model_type", "gemma3_text")
        # transformers 5.23's Gemma3ForConditionalGeneration caps neither logits nor attention
        # scores whatever the text config says (only Gemma3ForCausalLM caps logits): do the same.
        text = text_config(text_cfg, "text_config", tie_word_embeddings=tie_word_embeddings(cfg, text_cfg, True),
                           final_logit_softcapping=None, attn_logit_softcapping=None)
        vision = SiglipVisionConfig.from_hf(require(cfg, "vision_config", "config"), "vision_config")
        mm = int(cfg.get("mm_tokens_per_image", 256))
        side = int(round(mm ** 0.5))
        if side * side != mm or vision.patches_per_side % side:
            raise CheckpointError(f"config.json: mm_tokens_per_image={mm} must be a square whose side divides the "
                                  f"{vision.patches_per_side} patches per side", param="mm_tokens_per_image")
        token = cfg.get("image_token_index", cfg.get("image_token_id", 262144))
        return cls(vision=vision, text=text, mm_tokens_per_image=mm, image_token_id=int(token),
                   boi_token_id=int(cfg.get("boi_token_index", 255999)),
                   eoi_token_id=int(cfg.get("eoi_token_index", 256000)))

    @property
    def pool(self) -> int:
        """Average-pooling kernel: patches per side / soft tokens per side."""
        return self.vision.patches_per_side // int(round(self.mm_tokens_per_image ** 0.5))


class Gemma3MultiModalProjector(nnx.Module):
    """HF's Gemma3MultiModalProjector: k x k average pooling of the patch grid, `mm_soft_emb_norm`
    (Gemma's (1 + w) RMSNorm), `mm_input_projection` (HF's raw `mm_input_projection_weight`
    [vision_hidden, text_hidden], already [in, out])."""

    def __init__(self, cfg: Gemma3Config, dtype=jnp.float32):
        self.config = cfg
        dv, dt = cfg.vision.hidden_size, cfg.text.hidden_size
        self.mm_soft_emb_norm = RMSNorm(dv, cfg.vision.layer_norm_eps, kind="gemma", dtype=dtype)
        # one projection: replicated, also under vision tensor parallelism (as the pooled input)
        self.mm_input_projection = Linear(dv, dt, dtype=dtype, axes=(None, None))

    def __call__(self, x: jax.Array) -> jax.Array:
        """x [views, patches, vision_hidden] -> [views, mm_tokens_per_image, text_hidden]."""
        v, _, d = x.shape
        side, k = self.config.vision.patches_per_side, self.config.pool
        x = x.reshape(v, side // k, k, side // k, k, d).mean(axis=(2, 4)).reshape(v, -1, d)
        return self.mm_input_projection(self.mm_soft_emb_norm(x))

    def hf_weights(self, w, name: str) -> None:
        dv, dt = self.config.vision.hidden_size, self.config.text.hidden_size
        self.mm_soft_emb_norm.hf_weights(w, f"{name}.mm_soft_emb_norm")
        w.set(self.mm_input_projection.kernel, w.take(f"{name}.mm_input_projection_weight", (dv, dt)), matmul=True)


class Gemma3Model(VisionLanguageModel):
    """Gemma3ForConditionalGeneration: vision_tower (SigLIP; HF's `vision_tower.vision_model`),
    multi_modal_projector, language_model (the Gemma 3 decoder with its lm_head)."""

    def __init__(self, cfg: Gemma3Config, dtype=jnp.float32):
        self.config = cfg
        self.vision_tower = SiglipVisionModel(cfg.vision, dtype=dtype)
        self.multi_modal_projector = Gemma3MultiModalProjector(cfg, dtype)
        self.language_model = cfg.text.build(dtype)

    def encode(self, pixels: jax.Array) -> jax.Array:
        """pixels [views, H, W, 3] -> soft tokens [views, mm_tokens_per_image, text_hidden]:
        SigLIP's last hidden state, pooled, normed and projected."""
        return self.multi_modal_projector(self.vision_tower(pixels)).astype(self.embed_dtype)

    def hf_weights(self, w, name: str = "") -> None:
        """Tensor names as LLaVA's `normalize_name` maps them."""
        self.vision_tower.hf_weights(w, "vision_tower")
        self.multi_modal_projector.hf_weights(w, "multi_modal_projector")
        self.language_model.hf_weights(w, "language_model.model", "language_model.lm_head.weight")


@dataclass(eq=False)
class Gemma3Family(Family):
    """A loaded Gemma 3 model: every view (the image, then its pan-and-scan crops) is one fixed
    size crop of `mm_tokens_per_image` soft tokens."""
    cfg: Gemma3Config
    policy: Gemma3ImagePolicy
    boi_token: str = "<start_of_image>"
    soft_token: str = "<image_soft_token>"
    eoi_token: str = "<end_of_image>"
    name: str = "gemma3"
    bidirectional_images: bool = True

    @property
    def image_token(self) -> str:
        return self.boi_token

    @property
    def image_token_id(self) -> int:
        return self.cfg.image_token_id

    @property
    def max_views(self) -> int:
        return 1 + self.policy.pan_and_scan.max_num_crops

    # ---- host ---------------------------------------------------------------------------------
    def prepare_image(self, img, opts: ImageOptions = ImageOptions()) -> ImageInput:
        """Decoded RGB PIL image -> views [1 + crops, size, size, 3]; tokens = mm * views. A
        token budget below that is a ContextLengthError (before any resize)."""
        policy = self.policy.with_pan_and_scan(opts.pan_and_scan)
        views = 1 + policy.num_crops(img.height, img.width)
        n = self.cfg.mm_tokens_per_image * views
        if opts.max_tokens is not None and n > opts.max_tokens:
            raise ContextLengthError(f"this image takes {n} tokens ({views} view(s) of {self.cfg.mm_tokens_per_image}), "
                                     f"over image_max_tokens={opts.max_tokens}", param="image_max_tokens")
        pixels = np.stack(policy(img))
        size = self.cfg.vision.image_size
        if pixels.shape[1:] != (size, size, 3):
            raise CheckpointError(f"image processor produces {pixels.shape[1:3]} pixels but the vision tower expects "
                                  f"{size}x{size}: the preprocessor config does not match config.json",
                                  param="image_size")
        prep = digest(policy.cache_key())
        key = f"{self.name}:{pixel_hash(img)}:{prep}"
        side = self.cfg.vision.patches_per_side
        return ImageInput(pixels=pixels, num_tokens=n, key=key, grid=(views, side, side))

    def fit_options(self, max_tokens: int) -> ImageOptions:
        """Pan-and-scan off when the budget cannot take the crops (one view always)."""
        return ImageOptions(pan_and_scan=False) if max_tokens < self.cfg.mm_tokens_per_image * self.max_views \
            else ImageOptions()

    def image_prompt(self, image: ImageInput) -> str:
        """The processor's replacement text for one `<start_of_image>` placeholder: one block of
        soft tokens per view (a pooled image, mmjax.research.Pool, has fewer per view)."""
        views = len(image.pixels)
        one = f"\n\n{self.boi_token}{self.soft_token * (image.num_tokens // views)}{self.eoi_token}\n\n"
        crops = views - 1
        if not crops:
            return one
        return (f"Here is the original image {one} and here are some crops to help you see better "
                + " ".join([one] * crops))

    def pixel_views(self, image: ImageInput, height: int, width: int) -> list:
        """The whole image, then its pan-and-scan crops (when the image has them), each resized."""
        frames = self.policy.with_pan_and_scan(len(image.pixels) > 1).frames(height, width)
        if len(frames) != len(image.pixels):
            raise InvalidRequestError(f"image has {len(image.pixels)} views; a {width}x{height} image gives "
                                      f"{len(frames)}", param="image")
        return [((k,), f) for k, f in enumerate(frames)]

    def token_grid(self, image: ImageInput) -> tuple[int, int, int]:
        """(views, rows, cols): each view's soft tokens are a square grid."""
        if image.token_grid is not None:
            return image.token_grid
        side = int(round(self.cfg.mm_tokens_per_image ** 0.5))
        return (image.num_tokens // self.cfg.mm_tokens_per_image, side, side)

    # ---- encode -------------------------------------------------------------------------------
    def _ladder(self, max_batch: int) -> tuple[int, ...]:
        # an image's views stay in one call: a call holds at least one whole image
        return pow2_ladder(1, max(max_batch, self.max_views))

    def encode_plan(self, images: list[ImageInput], max_batch: int, shards: int = 1) -> list[EncodeCall]:
        """Whole images' views stacked into calls of at most max(max_batch, views of one image)
        views, padded up the power-of-two ladder (repeating the last view)."""
        ladder = self._ladder(max_batch)
        limit = ladder[-1] if max_batch < self.max_views else max_batch
        groups, cur = [], []
        for im in images:
            if cur and sum(len(x.pixels) for x in cur) + len(im.pixels) > limit:
                groups.append(cur)
                cur = []
            cur.append(im)
        groups += [cur] if cur else []
        calls = []
        for group in groups:
            views = np.concatenate([im.pixels for im in group])
            b = bucket_for(len(views), ladder)
            if b > len(views):
                views = np.concatenate([views, np.repeat(views[-1:], b - len(views), axis=0)])
            cuts = np.cumsum([len(im.pixels) for im in group])[:-1]

            def split(f, cuts=cuts, n=int(sum(len(im.pixels) for im in group))):
                return [x.reshape(-1, x.shape[-1]) for x in np.split(f[:n], cuts)]
            calls.append(EncodeCall((b,) + views.shape[1:], views, split))
        return calls

    def warmup_plan(self, max_batch: int, shards: int = 1) -> list[EncodeCall]:
        size = self.cfg.vision.image_size
        return [EncodeCall((b, size, size, 3), np.zeros((b, size, size, 3), np.float32), list)
                for b in self._ladder(max_batch)]


def _token_strings(path: Path) -> dict[int, str]:
    """id -> content of the tokenizer's added (special) tokens."""
    p = path / "tokenizer.json"
    if not p.is_file():
        return {}
    return {int(t["id"]): t["content"] for t in json.loads(p.read_text()).get("added_tokens", [])}


def load(path: Path, hf_cfg: dict, dtype=jnp.float32) -> tuple[Gemma3Family, Gemma3Model, TensorSource]:
    """config.json + Gemma3 image processor config -> (family, the abstract model, its tensors)."""
    cfg = Gemma3Config.from_hf(hf_cfg)
    ipc = find_image_processor_config(path)
    kind = str(ipc.get("image_processor_type", ""))
    if not kind.startswith("Gemma3ImageProcessor"):
        raise CheckpointError(f"gemma3 needs a Gemma3ImageProcessor, the checkpoint has {kind!r}",
                              param="image_processor_type")
    policy = Gemma3ImagePolicy.from_config(ipc)
    proc = path / "processor_config.json"
    seq = json.loads(proc.read_text()).get("image_seq_length") if proc.is_file() else None
    if seq is not None and int(seq) != cfg.mm_tokens_per_image:
        raise CheckpointError(f"processor image_seq_length={seq} != config mm_tokens_per_image="
                              f"{cfg.mm_tokens_per_image}", param="image_seq_length")
    names = _token_strings(path)
    strings = {}
    for field, tid in (("boi_token", cfg.boi_token_id), ("soft_token", cfg.image_token_id),
                       ("eoi_token", cfg.eoi_token_id)):
        if tid in names:
            strings[field] = names[tid]
    return (Gemma3Family(cfg, policy, **strings), build(lambda: Gemma3Model(cfg, dtype)),
            TensorSource(path, normalize_name))
