"""Gemma 4 (Gemma4ForConditionalGeneration), images: vision tower with position pooling
(models/vision/gemma4.py) -> soft tokens placed at the prompt's image tokens -> Gemma 4 decoder
(models/text/gemma4.py). Audio and video towers are out of scope: their weights, if a checkpoint
has them, are skipped at load and audio / video inputs are not accepted.

Module tree (`Gemma4Model`, HF's Gemma4Model names): `vision_tower` (Gemma4VisionModel),
`embed_vision` (Gemma4MultimodalEmbedder), `language_model` (Gemma4TextModel, with its lm_head).

Prompt: like Gemma4Processor, each image placeholder (the tokenizer's image token, e.g.
"<|image|>") is replaced by text before tokenizing: begin-of-image + one image token per soft
token + end-of-image (`image_prompt`). The soft-token count comes from the image size alone
(Gemma4ImageProcessor's aspect-ratio-preserving resize to at most max_soft_tokens * k**2 patches,
k = pooling_kernel_size). Each run of image tokens attends to itself both ways in the sliding
layers when the config says use_bidirectional_attention="vision".

Encode plan: images of different sizes have different patch counts; each is padded to a rung of
a short soft-token ladder (max_soft_tokens / 4, / 2, 1, times k**2 patches) and images of one
rung are stacked in power-of-two batches: (batch rung) x (patch rung) compiled shapes.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from mmjax.buckets import bucket_for, pow2_ladder
from mmjax.checkpoint import TensorSource
from mmjax.errors import CheckpointError, ContextLengthError, UnsupportedModelError
from mmjax.image.decode import pixel_hash
from mmjax.image.gemma4 import Gemma4ImagePolicy
from mmjax.image.processors import digest, find_image_processor_config
from mmjax.models.family import EncodeCall, Family, ImageInput, ImageOptions, VisionLanguageModel
from mmjax.models.hf_config import require
from mmjax.models.nn.weights import build, load_children
from mmjax.models.text.gemma4 import Gemma4TextConfig
from mmjax.models.vision.gemma4 import Gemma4MultimodalEmbedder, Gemma4VisionConfig, Gemma4VisionModel


@dataclass(frozen=True)
class Gemma4Config:
    vision: Gemma4VisionConfig
    text: Gemma4TextConfig
    image_token_id: int
    boi_token_id: int
    eoi_token_id: int
    has_audio: bool

    @classmethod
    def from_hf(cls, cfg: dict) -> "Gemma4Config":
        if cfg.get("model_type") != "gemma4":
            raise UnsupportedModelError(f"config.json: model_type={cfg.get('model_type')!r} is not Gemma 4",
                                        param="model_type")
        text_cfg = require(cfg, "text_config", "config")
        vision_cfg = cfg.get("vision_config")
        if not vision_cfg:
            raise UnsupportedModelError("config.json: Gemma 4 without a vision_config has no image input; "
                                        "mmjax serves image-text models", param="vision_config")
        ids = {k: int(require(cfg, k, "config", default=d)) for k, d in (
            ("image_token_id", 258_880), ("boi_token_id", 255_999), ("eoi_token_id", 258_882))}
        mm = tuple(int(cfg[k]) for k in ("image_token_id", "video_token_id", "audio_token_id")
                   if cfg.get(k) is not None)
        text = Gemma4TextConfig.from_hf(text_cfg, "text_config", multimodal_token_ids=mm)
        vision = Gemma4VisionConfig.from_hf(vision_cfg, text.hidden_size)
        return cls(vision=vision, text=text, has_audio=bool(cfg.get("audio_config")), **ids)


class Gemma4Model(VisionLanguageModel):
    """Gemma4ForConditionalGeneration, images: vision_tower (Gemma4VisionModel), embed_vision
    (Gemma4MultimodalEmbedder), language_model (the decoder with its lm_head). HF names:
    model.vision_tower.*, model.embed_vision.*, model.language_model.*, lm_head (the tied
    embedding unless the file holds one); audio weights are skipped."""

    def __init__(self, cfg: Gemma4Config, dtype=jnp.float32):
        self.config = cfg
        self.vision_tower = Gemma4VisionModel(cfg.vision, dtype)
        self.embed_vision = Gemma4MultimodalEmbedder(cfg.vision.hidden_size, cfg.text.hidden_size,
                                                     cfg.vision.rms_norm_eps, dtype)
        self.language_model = cfg.text.build(dtype)

    def encode(self, inputs: tuple, impl: str = "auto") -> jax.Array:
        """(patches [B, P, 3*p*p], positions [B, P, 2]) -> soft tokens [B, P / k**2, text_hidden]."""
        pixels, pos = inputs
        return self.embed_vision(self.vision_tower(pixels, pos, impl)).astype(self.embed_dtype)

    def hf_weights(self, w, name: str = "") -> None:
        self.vision_tower.hf_weights(w, "model.vision_tower")
        load_children(self.embed_vision, w, "model.embed_vision")
        self.language_model.hf_weights(w, "model.language_model", "lm_head.weight")
        w.ignore(r"model\.(audio_tower|embed_audio)\..*")


def _token_strings(path: Path, ids: list[int]) -> list[str]:
    """The strings of special token ids, from tokenizer.json's added tokens."""
    tj = path / "tokenizer.json"
    if not tj.is_file():
        raise CheckpointError(f"{path} has no tokenizer.json", param="tokenizer")
    added = {t["id"]: t["content"] for t in json.loads(tj.read_text()).get("added_tokens", [])}
    missing = [i for i in ids if i not in added]
    if missing:
        raise CheckpointError(f"tokenizer.json has no added token with id {missing[0]} (config.json's image / "
                              "begin-of-image / end-of-image token ids)", param="image_token_id")
    return [added[i] for i in ids]


@dataclass(eq=False)
class Gemma4Family(Family):
    """A loaded Gemma 4 model's family (images)."""
    cfg: Gemma4Config
    policy: Gemma4ImagePolicy
    image_token: str
    boi_token: str
    eoi_token: str
    attn_impl: str = "auto"
    name: str = "gemma4"

    @property
    def image_token_id(self) -> int:
        return self.cfg.image_token_id

    @property
    def bidirectional_images(self) -> bool:
        return self.cfg.text.bidirectional_vision

    # ---- host: images -------------------------------------------------------------------------
    def prepare_image(self, img, opts: ImageOptions = ImageOptions()) -> ImageInput:
        """Decoded RGB PIL image -> patches [n, 3*p*p] + grid (1, rows, cols) in patches + exact
        soft-token count + encoder-cache key. A count over opts.max_tokens is a ContextLengthError
        (before any resize)."""
        n = self.policy.num_tokens(img.height, img.width)
        if opts.max_tokens is not None and n > opts.max_tokens:
            raise ContextLengthError(f"image of {img.width}x{img.height} pixels takes {n} soft tokens with this "
                                     f"model, over image_max_tokens={opts.max_tokens}", param="image_max_tokens")
        patches, pos = self.policy(img)
        grid = (1, int(pos[-1, 1]) + 1, int(pos[-1, 0]) + 1)
        key = f"{self.name}:{pixel_hash(img)}:{digest(self.policy.cache_key())}"
        return ImageInput(pixels=patches, num_tokens=n, key=key, grid=grid)

    def image_prompt(self, image: ImageInput) -> str:
        """Gemma4Processor's replacement text for one image."""
        return f"{self.boi_token}{self.image_token * image.num_tokens}{self.eoi_token}"

    # ---- research hooks (heatmaps, pooling, pixel gradients) -----------------------------------
    def token_grid(self, image: ImageInput) -> tuple[int, int, int]:
        """(1, rows / k, cols / k): soft token j pools patch block (j % (cols/k), j // (cols/k))."""
        if image.token_grid is not None:
            return image.token_grid
        k = self.policy.pooling_kernel_size
        _, gh, gw = image.grid
        return 1, gh // k, gw // k

    def image_pixels(self, image: ImageInput) -> np.ndarray:
        """patches [rows*cols, p*p*3] -> the resized image [rows*p, cols*p, 3] (values in [0, 1])."""
        p = self.policy.patch_size
        _, gh, gw = image.grid
        x = np.asarray(image.pixels).reshape(gh, gw, p, p, 3).transpose(0, 2, 1, 3, 4)
        return np.ascontiguousarray(x).reshape(gh * p, gw * p, 3)

    def input_pixels(self, image: ImageInput, pixels: np.ndarray) -> np.ndarray:
        p = self.policy.patch_size
        h, w, c = pixels.shape
        x = np.asarray(pixels).reshape(h // p, p, w // p, p, c).transpose(0, 2, 1, 3, 4)
        return np.ascontiguousarray(x).reshape((h // p) * (w // p), p * p * c)

    def encoder_tokens(self, image: ImageInput) -> int:
        """Soft tokens the vision tower makes for this image (an intervention's `post` may
        change `num_tokens` afterwards)."""
        return len(image.pixels) // self.policy.pooling_kernel_size ** 2

    # ---- encode ---------------------------------------------------------------------------------
    @property
    def token_ladder(self) -> tuple[int, ...]:
        """Soft-token rungs an image is padded to (its patches: rung * k**2)."""
        m = self.policy.max_soft_tokens
        return tuple(sorted({-(-m // 4), -(-m // 2), m}))

    def encode(self, model: Gemma4Model, inputs: tuple) -> jax.Array:
        """(patches [B, P, 3*p*p], positions [B, P, 2]) -> soft tokens [B, P / k**2, text_hidden]."""
        return model.encode(inputs, self.attn_impl)

    def _call(self, images: list[ImageInput], rung: int, batch: int) -> EncodeCall:
        k2 = self.policy.pooling_kernel_size ** 2
        p = rung * k2
        pix = np.zeros((batch, p, self.policy.patch_dim), np.float32)
        pos = np.full((batch, p, 2), -1, np.int32)
        for b in range(batch):
            im = images[min(b, len(images) - 1)]   # pad the batch by repeating the last image
            n = len(im.pixels)
            _, gh, gw = im.grid
            gx, gy = np.meshgrid(np.arange(gw), np.arange(gh), indexing="xy")
            pix[b, :n] = im.pixels
            pos[b, :n] = np.stack([gx, gy], -1).reshape(-1, 2)
        counts = [self.encoder_tokens(im) for im in images]
        return EncodeCall((batch, p), (pix, pos), lambda f, counts=counts: [f[i, :c] for i, c in enumerate(counts)])

    def encode_plan(self, images: list[ImageInput], max_batch: int, shards: int = 1) -> list[EncodeCall]:
        """Group images by soft-token rung (in order within a rung), batches of at most
        max_batch padded up the power-of-two ladder; the split restores the input order."""
        ladder, batches = self.token_ladder, pow2_ladder(1, max_batch)
        groups: dict[int, list[int]] = {}
        for i, im in enumerate(images):
            n = self.encoder_tokens(im)
            if n > ladder[-1]:
                raise ContextLengthError(f"image of {n} soft tokens is over the largest encode "
                                         f"bucket {ladder[-1]}", param="image_max_tokens")
            groups.setdefault(bucket_for(n, ladder), []).append(i)
        calls, order = [], []
        for rung, idx in sorted(groups.items()):
            for s in range(0, len(idx), max_batch):
                part = idx[s:s + max_batch]
                calls.append(self._call([images[i] for i in part], rung, bucket_for(len(part), batches)))
                order.extend(part)
        if order == list(range(len(images))):
            return calls
        # the runner concatenates the calls' splits in call order: the last call puts them back
        return _reordered(calls, order)

    def warmup_plan(self, max_batch: int, shards: int = 1) -> list[EncodeCall]:
        k2 = self.policy.pooling_kernel_size ** 2
        out = []
        for rung in self.token_ladder:
            for b in pow2_ladder(1, max_batch):
                pos = np.full((b, rung * k2, 2), -1, np.int32)
                pos[:, 0] = 0   # one real patch per row
                out.append(EncodeCall((b, rung * k2), (np.zeros((b, rung * k2, self.policy.patch_dim), np.float32),
                                                       pos), list))
        return out


def _reordered(calls: list[EncodeCall], order: list[int]) -> list[EncodeCall]:
    """Calls whose concatenated splits come out in input order: every call but the last returns
    nothing and stashes its features; the last returns all of them, reordered."""
    held: list[np.ndarray] = []
    out = []
    for j, c in enumerate(calls):
        last = j == len(calls) - 1

        def split(f, c=c, last=last):
            held.extend(c.split(f))
            if not last:
                return []
            feats = [None] * len(order)
            for i, x in zip(order, held):
                feats[i] = x
            held.clear()
            return feats
        out.append(EncodeCall(c.bucket, c.inputs, split))
    return out


def load(path: Path, hf_cfg: dict, dtype=jnp.float32) -> tuple[Gemma4Family, Gemma4Model, TensorSource]:
    """config.json + processor config -> (family, the abstract model, its tensors)."""
    cfg = Gemma4Config.from_hf(hf_cfg)
    ipc = find_image_processor_config(path)
    kind = str(ipc.get("image_processor_type", ""))
    if not kind.startswith("Gemma4ImageProcessor"):
        raise CheckpointError(f"gemma4 needs a Gemma4ImageProcessor, the checkpoint has {kind or 'none'}",
                              param="image_processor_type")
    policy = Gemma4ImagePolicy.from_config(ipc)
    v = cfg.vision
    if (policy.patch_size, policy.pooling_kernel_size) != (v.patch_size, v.pooling_kernel_size):
        raise CheckpointError(f"image processor patch_size / pooling_kernel_size {(policy.patch_size, policy.pooling_kernel_size)} "
                              f"do not match config.json {(v.patch_size, v.pooling_kernel_size)}", param="patch_size")
    # the longest side an image can get, in patches (a 1 x k*max_soft_tokens strip of blocks)
    if policy.max_soft_tokens * policy.pooling_kernel_size > v.position_embedding_size:
        raise CheckpointError(f"image processor max_soft_tokens={policy.max_soft_tokens} allows image sides of "
                              f"{policy.max_soft_tokens * policy.pooling_kernel_size} patches, over the vision "
                              f"position table ({v.position_embedding_size})", param="max_soft_tokens")
    image, boi, eoi = _token_strings(path, [cfg.image_token_id, cfg.boi_token_id, cfg.eoi_token_id])
    return (Gemma4Family(cfg, policy, image_token=image, boi_token=boi, eoi_token=eoi),
            build(lambda: Gemma4Model(cfg, dtype)), TensorSource(path))
