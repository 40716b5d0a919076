"""Mistral 3 (Mistral3ForConditionalGeneration: Mistral Small 3.1 / 3.2) and Pixtral-12B
(LlavaForConditionalGeneration with a Pixtral vision tower): Pixtral ViT at native resolution
(models/vision/pixtral.py) -> projector -> Mistral decoder (models/text/llama.py).

Projector: Mistral 3 applies RMSNorm, the `spatial_merge_size`**2 patch merger (one Linear over
each merge x merge block of patches) and Linear-act-Linear (HF's Mistral3MultiModalProjector);
LLaVA-Pixtral only Linear-act-Linear (spatial_merge_size 1).

Module tree (`Mistral3Model`, transformers' names): `vision_tower` (vision/pixtral.py),
`multi_modal_projector.{norm, patch_merger.merging_layer, linear_1, linear_2}` (no norm / merger
for LLaVA-Pixtral), `language_model` (the decoder with its lm_head).

Prompt: each `[IMG]` placeholder becomes the processor's text, rows of merged tokens each ended by
`[IMG_BREAK]`, the last row by `[IMG_END]` (`image_prompt`); the `[IMG]` tokens take the features
in row-major order. Positions are 1-D.

Encoding: images of any sizes (from any requests) are packed into one patch sequence with one
attention segment per image (Qwen2-VL's packing and patch ladder), so the number of encode
compilations is the ladder's length. An image's token count is known from its size before any
compute: (rows, cols) = ceil(resized side / (patch * merge)).
"""
from __future__ import annotations

import dataclasses
import json
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
from mmjax.image.pixtral import PixtralImagePolicy
from mmjax.image.processors import digest, find_image_processor_config, patchify
from mmjax.models.family import EncodeCall, Family, ImageInput, ImageOptions, VisionLanguageModel
from mmjax.models.hf_config import require, tie_word_embeddings
from mmjax.models.llava import normalize_name  # same weight layout (vision_tower / multi_modal_projector)
from mmjax.models.nn.linear import Linear, activation
from mmjax.models.nn.norm import RMSNorm
from mmjax.models.nn.weights import build, load_children
from mmjax.models.text import text_config
from mmjax.models.vision.pixtral import PixtralVisionConfig, PixtralVisionModel
from mmjax.models.vision.qwen2_vl import pack_images, patch_ladder, unpack_features


@dataclass(frozen=True)
class Mistral3Config:
    vision: PixtralVisionConfig
    text: object                  # the decoder's config (models/text)
    image_token_id: int
    merge_size: int               # spatial_merge_size (1 for LLaVA-Pixtral)
    feature_layer: int            # absolute index into the tower's hidden_states (0 = ln_pre output)
    projector_act: str
    projector_bias: bool
    merger: bool                  # Mistral 3's RMSNorm + patch merger before the MLP
    norm_eps: float               # the projector RMSNorm's eps (the text config's rms_norm_eps)
    model_type: str

    @classmethod
    def from_hf(cls, cfg: dict) -> "Mistral3Config":
        mt = cfg.get("model_type")
        text_cfg = dict(require(cfg, "text_config", "config"))
        text_cfg.setdefault("model_type", "mistral")
        vcfg = require(cfg, "vision_config", "config")
        if vcfg.get("model_type", "pixtral") != "pixtral":
            raise UnsupportedModelError(f"config.json: vision_config.model_type={vcfg.get('model_type')!r} is not "
                                        "pixtral", param="vision_config.model_type")
        vision = PixtralVisionConfig.from_hf(vcfg)
        merger = mt == "mistral3"
        text = text_config(text_cfg, "text_config", tie_word_embeddings=tie_word_embeddings(cfg, text_cfg, merger))
        layer = cfg.get("vision_feature_layer", -1)
        if isinstance(layer, (list, tuple)):
            if len(layer) != 1:  # HF's norm and merger are sized for one layer's width
                raise UnsupportedModelError(f"config.json: vision_feature_layer={layer}: several feature layers "
                                            "are not supported with a Pixtral tower", param="vision_feature_layer")
            layer = layer[0]
        layer = int(layer)
        n = vision.num_layers
        if not -(n + 1) <= layer <= n:
            raise CheckpointError(f"config.json: vision_feature_layer={layer} out of range for {n} vision layers",
                                  param="vision_feature_layer")
        if not merger and cfg.get("vision_feature_select_strategy", "default") != "full":
            raise UnsupportedModelError("config.json: a LLaVA checkpoint with a Pixtral tower needs "
                                        "vision_feature_select_strategy='full'", param="vision_feature_select_strategy")
        token = cfg.get("image_token_index", cfg.get("image_token_id"))
        if token is None:
            raise CheckpointError("config.json: image_token_index is missing", param="image_token_index")
        merge = int(cfg.get("spatial_merge_size", 2)) if merger else 1
        if merge < 1:
            raise CheckpointError(f"config.json: spatial_merge_size={merge}", param="spatial_merge_size")
        act = cfg.get("projector_hidden_act", "gelu")
        activation(act)
        return cls(vision=vision, text=text, image_token_id=int(token), merge_size=merge,
                   feature_layer=layer if layer >= 0 else n + 1 + layer, projector_act=act,
                   projector_bias=bool(cfg.get("multimodal_projector_bias", not merger)), merger=merger,
                   norm_eps=float(text_cfg.get("rms_norm_eps", 1e-6)), model_type=mt)

    @property
    def patch(self) -> int:
        """Pixels per side of one LLM token (vision patch * merge)."""
        return self.vision.patch_size * self.merge_size


class Mistral3PatchMerger(nnx.Module):
    """`merging_layer`: one Linear over each merge x merge block of patches. Its kernel is
    [m*m*d, out] with rows k*d + c, the order of a block of our merge-block-major patches
    reshaped flat (HF unfolds each block channel-major: input index c*m*m + k; reordered once at
    load)."""

    def __init__(self, d: int, merge_size: int, dtype=jnp.float32):
        self.d, self.merge_size = d, merge_size
        self.merging_layer = Linear(merge_size ** 2 * d, d, dtype=dtype, axes=(None, "embed"))

    def __call__(self, x: jax.Array) -> jax.Array:
        """x [N, d] (N a multiple of merge**2, merge-block major) -> [N / merge**2, d]."""
        return self.merging_layer(x.reshape(-1, self.merge_size ** 2 * x.shape[-1]))

    def hf_weights(self, w, name: str) -> None:
        d, m2 = self.d, self.merge_size ** 2
        hf = w.take(f"{name}.merging_layer.weight", (d, d * m2))
        w.set(self.merging_layer.kernel, np.ascontiguousarray(hf.reshape(d, d, m2).transpose(2, 1, 0).reshape(m2 * d, d)),
              matmul=True)


class Mistral3MultiModalProjector(nnx.Module):
    """HF's Mistral3MultiModalProjector: `norm` (RMSNorm), `patch_merger`, `linear_1`, act,
    `linear_2`; LLaVA-Pixtral's (LlavaMultiModalProjector) has no norm and no merger (None)."""

    def __init__(self, cfg: Mistral3Config, dtype=jnp.float32):
        d, dt = cfg.vision.hidden_size, cfg.text.hidden_size
        self.act = cfg.projector_act
        if cfg.merger:
            self.norm = RMSNorm(d, cfg.norm_eps, dtype=dtype)
            self.patch_merger = Mistral3PatchMerger(d, cfg.merge_size, dtype)
        else:
            self.norm = self.patch_merger = None
        self.linear_1 = Linear(d, dt, bias=cfg.projector_bias, dtype=dtype, axes=("embed", "vision_mlp"))
        self.linear_2 = Linear(dt, dt, bias=cfg.projector_bias, dtype=dtype, axes=("vision_mlp", "embed"))

    def __call__(self, x: jax.Array) -> jax.Array:
        """x [N, vision_hidden] (merge-block major) -> [N / merge**2, text_hidden]."""
        if self.patch_merger is not None:
            x = self.patch_merger(self.norm(x))
        return self.linear_2(activation(self.act)(self.linear_1(x)))


class Mistral3Model(VisionLanguageModel):
    """Mistral3ForConditionalGeneration (and LLaVA-Pixtral): vision_tower (Pixtral, cut after the
    feature layer), multi_modal_projector, language_model (the Mistral decoder with its lm_head)."""

    def __init__(self, cfg: Mistral3Config, dtype=jnp.float32):
        self.config = cfg
        self.vision_tower = PixtralVisionModel(cfg.vision, cfg.feature_layer, dtype)
        self.multi_modal_projector = Mistral3MultiModalProjector(cfg, dtype)
        self.language_model = cfg.text.build(dtype)

    def encode(self, packed: tuple) -> jax.Array:
        """The compiled encode step: packed (patches [N, C*p*p], pos_hw [N, 2], segment_ids [N],
        _) with N a multiple of merge**2 and each image's patches merge-block major -> LLM
        tokens [N / merge**2, text_hidden]."""
        patches, pos_hw, seg, _ = packed
        x = self.vision_tower(patches, pos_hw, seg)
        return self.multi_modal_projector(x).astype(self.embed_dtype)

    def hf_weights(self, w, name: str = "") -> None:
        """Tensor names as `llava.normalize_name` maps them."""
        self.vision_tower.hf_weights(w, "vision_tower")
        load_children(self.multi_modal_projector, w, "multi_modal_projector")
        self.language_model.hf_weights(w, "language_model.model", "language_model.lm_head.weight")


@dataclass
class Mistral3Limits:
    """Server-wide image controls.

    image_max_tokens: cap on the [IMG] tokens of one image (None: what the largest image the
        processor produces takes, (longest_edge / (patch * merge))**2).
    max_encode_patches: patches packed into one encode call (images are never split; the top
        bucket also covers one image at the processor's largest size).
    """
    image_max_tokens: int | None = None
    max_encode_patches: int = 16384


@dataclass(eq=False)
class Mistral3Family(Family):
    """A loaded Mistral 3 / Pixtral model: native-resolution images, packed encoding, 1-D RoPE."""
    cfg: Mistral3Config
    policy: PixtralImagePolicy
    image_token: str = "[IMG]"
    break_token: str = "[IMG_BREAK]"
    end_token: str = "[IMG_END]"
    limits: Mistral3Limits = field(default_factory=Mistral3Limits)

    @property
    def name(self) -> str:
        return self.cfg.model_type

    @property
    def image_token_id(self) -> int:
        return self.cfg.image_token_id

    # ---- limits -------------------------------------------------------------------------------
    def configure(self, *, image_max_tokens: int | None = None,
                  max_encode_patches: int | None = None) -> "Mistral3Family":
        """Set server-wide image limits (before serving; changes the encode bucket ladder)."""
        for name, v in (("image_max_tokens", image_max_tokens), ("max_encode_patches", max_encode_patches)):
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v <= 0):
                raise InvalidRequestError(f"{name} must be a positive integer, got {v!r}", param=name)
        self.limits = dataclasses.replace(self.limits, **{k: int(v) for k, v in dict(
            image_max_tokens=image_max_tokens, max_encode_patches=max_encode_patches).items() if v is not None})
        return self

    @property
    def largest_image_tokens(self) -> int:
        """[IMG] tokens of the largest image the processor produces."""
        h, w = self.policy.max_size
        return -(-h // self.policy.patch) * -(-w // self.policy.patch)

    @property
    def image_max_tokens(self) -> int:
        return self.limits.image_max_tokens or self.largest_image_tokens

    @property
    def encode_ladder(self) -> tuple[int, ...]:
        """Patch buckets: x1.25 steps up to the per-call budget, plus one rung at the largest
        image (photos are resized to the longest edge, so most sit just under it)."""
        one = min(self.image_max_tokens, self.largest_image_tokens) * self.cfg.merge_size ** 2
        return patch_ladder(max(self.limits.max_encode_patches, one), extra=(one,))

    # ---- host: images -------------------------------------------------------------------------
    def prepare_image(self, img, opts: ImageOptions = ImageOptions()) -> ImageInput:
        """Decoded RGB PIL image -> merge-block-major patches [rows*cols*m*m, C*p*p], grid
        (1, patch rows, patch cols), token count rows*cols ([IMG] tokens; the prompt adds one
        [IMG_BREAK]/[IMG_END] per row). Over-budget images raise ContextLengthError before the
        resize. Resolution options do not apply (the processor has one longest edge)."""
        rows, cols = self.policy.grid(img.height, img.width)
        n = rows * cols
        budget = self.image_max_tokens if opts.max_tokens is None else min(self.image_max_tokens, opts.max_tokens)
        if n > budget:
            raise ContextLengthError(f"image of {img.width}x{img.height} pixels is resized to "
                                     f"{cols * self.policy.patch}x{rows * self.policy.patch} and needs {n} image "
                                     f"tokens, over image_max_tokens={budget}", param="image_max_tokens")
        pixels = self.policy(img)
        m, p = self.cfg.merge_size, self.cfg.vision.patch_size
        key = f"{self.name}:{pixel_hash(img)}:{digest(self.policy.cache_key())}"
        return ImageInput(pixels=patchify(pixels, p, m, 1), num_tokens=n, key=key, grid=(1, rows * m, cols * m))

    def token_grid(self, image: ImageInput) -> tuple[int, int, int]:
        """(1, rows, cols) of the [IMG] tokens (row-major, as the features)."""
        if image.token_grid is not None:
            return image.token_grid
        m = self.cfg.merge_size
        return 1, image.grid[1] // m, image.grid[2] // m

    def image_prompt(self, image: ImageInput) -> str:
        """The processor's text for one image: each row of [IMG] tokens ends with [IMG_BREAK],
        the last with [IMG_END]."""
        _, rows, cols = self.token_grid(image)
        text = (self.image_token * cols + self.break_token) * rows
        return text[:len(text) - len(self.break_token)] + self.end_token

    def image_pixels(self, image: ImageInput) -> np.ndarray:
        """Merge-block-major patches -> the normalized resized image [H, W, C]."""
        p, m = self.cfg.vision.patch_size, self.cfg.merge_size
        _, gh, gw = (int(x) for x in image.grid)
        x = np.asarray(image.pixels).reshape(gh // m, gw // m, m, m, -1, p, p)
        return np.ascontiguousarray(x.transpose(0, 2, 5, 1, 3, 6, 4)).reshape(gh * p, gw * p, -1)

    def input_pixels(self, image: ImageInput, pixels: np.ndarray) -> np.ndarray:
        return patchify(np.asarray(pixels), self.cfg.vision.patch_size, self.cfg.merge_size, 1)

    # ---- encode -------------------------------------------------------------------------------
    @property
    def _packing(self) -> "_Packing":
        return _Packing(self.cfg.vision.patch_dim, self.cfg.merge_size)

    def encode_plan(self, images: list[ImageInput], max_batch: int, shards: int = 1) -> list[EncodeCall]:
        """Pack images (in order) into as few calls as the per-call patch budget allows, each
        padded up the patch ladder (`max_batch` does not apply: packing is by patches; one
        packed group a call whatever `shards`). The model's `encode` is the compiled step."""
        ladder, cap = self.encode_ladder, max(self.limits.max_encode_patches, self.encode_ladder[-1])
        groups, cur, n = [], [], 0
        for im in images:
            k = int(np.prod(im.grid))
            if k > ladder[-1]:
                raise ContextLengthError(f"image with patch grid {im.grid[1:]} has {k} patches, over the largest "
                                         f"encode bucket {ladder[-1]}", param="image_max_tokens")
            if cur and n + k > cap:
                groups.append(cur)
                cur, n = [], 0
            cur.append(im)
            n += k
        groups += [cur] if cur else []
        calls = []
        for group in groups:
            packed = pack_images(group, self._packing, bucket_for(sum(int(np.prod(im.grid)) for im in group), ladder))
            calls.append(EncodeCall((packed.n_pad,), packed.arrays(), lambda f, packed=packed: unpack_features(packed, f)))
        return calls

    def warmup_plan(self, max_batch: int, shards: int = 1) -> list[EncodeCall]:
        return [EncodeCall((n,), self.dummy_packed(n), list) for n in self.encode_ladder]

    def dummy_packed(self, n_pad: int) -> tuple:
        seg = np.zeros((n_pad,), np.int32)
        return (np.zeros((n_pad, self.cfg.vision.patch_dim), np.float32), np.zeros((n_pad, 2), np.int32), seg, seg)


@dataclass(frozen=True)
class _Packing:
    """What Qwen2-VL's `pack_images` reads from a vision config: Pixtral packs like an unwindowed
    Qwen2-VL tower (one segment per image, merge-block-major patches)."""
    patch_dim: int
    merge_size: int
    windowed: bool = False


def _processor_config(path: Path) -> dict:
    p = path / "processor_config.json"
    return json.loads(p.read_text()) if p.is_file() else {}


def load(path: Path, hf_cfg: dict, dtype=jnp.float32) -> tuple[Mistral3Family, Mistral3Model, TensorSource]:
    """config.json + PixtralProcessor config -> (family, the abstract model, its tensors)."""
    cfg = Mistral3Config.from_hf(hf_cfg)
    ipc = find_image_processor_config(path)
    kind = str(ipc.get("image_processor_type", ""))
    if not kind.startswith("PixtralImageProcessor"):
        raise CheckpointError(f"{cfg.model_type} needs a PixtralImageProcessor, the checkpoint has {kind!r}",
                              param="image_processor_type")
    proc = _processor_config(path)
    # PixtralProcessor resizes to multiples of its patch_size * spatial_merge_size (overriding the
    # image processor's patch_size); they must agree with the model's.
    p_patch = int(proc.get("patch_size", cfg.vision.patch_size))
    p_merge = int(proc.get("spatial_merge_size", cfg.merge_size))
    if (p_patch, p_merge) != (cfg.vision.patch_size, cfg.merge_size):
        raise CheckpointError(f"processor patch_size/spatial_merge_size {(p_patch, p_merge)} do not match "
                              f"config.json {(cfg.vision.patch_size, cfg.merge_size)}", param="spatial_merge_size")
    policy = PixtralImagePolicy.from_config(ipc, cfg.patch)
    strings = {k: proc[f] for k, f in (("image_token", "image_token"), ("break_token", "image_break_token"),
                                       ("end_token", "image_end_token")) if proc.get(f)}
    return (Mistral3Family(cfg, policy, **strings), build(lambda: Mistral3Model(cfg, dtype)),
            TensorSource(path, normalize_name))
