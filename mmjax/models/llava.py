"""LLaVA-1.5 family (LlavaForConditionalGeneration): CLIP ViT -> MLP projector -> Llama decoder."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from mmjax.buckets import bucket_for, pow2_ladder
from mmjax.checkpoint import TensorSource
from mmjax.errors import CheckpointError, UnsupportedModelError
from mmjax.image.decode import pixel_hash
from mmjax.image.processors import ClipImagePolicy, digest, find_image_processor_config, load_policy
from mmjax.models.family import EncodeCall, Family, ImageInput, ImageOptions, VisionLanguageModel
from mmjax.models.hf_config import require, tie_word_embeddings
from mmjax.models.text import text_config
from mmjax.models.vision.clip import ClipVisionConfig, ClipVisionModel
from mmjax.models.nn.weights import build
from mmjax.models.vision.projector import LlavaMultiModalProjector

# LLaVA-1.5's conversation format ("USER: <image>\n... ASSISTANT:") as a jinja chat template, for
# checkpoints and fixtures that need one.
LLAVA_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}{{ message['content'] }}\n"
    "{% else %}{{ message['role'].upper() }}: "
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<image>\n{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{% if message['role'] == 'assistant' %}{{ eos_token }}{% endif %}\n"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}ASSISTANT:{% endif %}"
)


@dataclass(frozen=True)
class LlavaConfig:
    vision: ClipVisionConfig
    text: object            # the decoder's config (models/text)
    image_token_id: int
    vision_feature_layers: tuple[int, ...]
    select_strategy: str
    projector_act: str = "gelu"
    projector_bias: bool = True
    model_type: str = "llava"

    @classmethod
    def from_hf(cls, cfg: dict) -> "LlavaConfig":
        text_cfg = require(cfg, "text_config", "config")
        tie = tie_word_embeddings(cfg, text_cfg)
        text = text_config(text_cfg, "text_config", tie_word_embeddings=tie)
        vision = ClipVisionConfig.from_hf(require(cfg, "vision_config", "config"), "vision_config")
        layer = cfg.get("vision_feature_layer", -2)
        layers = tuple(layer) if isinstance(layer, (list, tuple)) else (int(layer),)
        strategy = cfg.get("vision_feature_select_strategy", "default")
        if strategy not in ("default", "full"):
            raise UnsupportedModelError(f"config.json: vision_feature_select_strategy={strategy!r} not supported",
                                        param="vision_feature_select_strategy")
        for l in layers:
            if not -(vision.num_layers + 1) <= l <= vision.num_layers:
                raise CheckpointError(f"config.json: vision_feature_layer={l} out of range for "
                                      f"{vision.num_layers} vision layers", param="vision_feature_layer")
        token = cfg.get("image_token_index", cfg.get("image_token_id"))
        if token is None:
            raise CheckpointError("config.json: image_token_index is missing", param="image_token_index")
        return cls(vision=vision, text=text, image_token_id=int(token), vision_feature_layers=layers,
                   select_strategy=strategy, projector_act=cfg.get("projector_hidden_act", "gelu"),
                   projector_bias=bool(cfg.get("multimodal_projector_bias", True)))

    @property
    def image_tokens_per_image(self) -> int:
        n = self.vision.num_patches + 1
        return n - 1 if self.select_strategy == "default" else n


def normalize_name(name: str) -> str:
    """Map every LLaVA weight naming seen on the hub to one scheme (`language_model.model.*`,
    `language_model.lm_head.*`, `vision_tower.*`, `multi_modal_projector.*`)."""
    for old, new in (("model.language_model.", "language_model.model."),
                     ("model.vision_tower.", "vision_tower."),
                     ("model.multi_modal_projector.", "multi_modal_projector.")):
        if name.startswith(old):
            name = new + name[len(old):]
    if name == "lm_head.weight":
        name = "language_model.lm_head.weight"
    if name.startswith("vision_tower.vision_model."):
        name = "vision_tower." + name[len("vision_tower.vision_model."):]
    return name


def feature_layer_indices(cfg: LlavaConfig) -> list[int]:
    """vision_feature_layer(s) as absolute indices into HF's hidden_states (0 = embeddings)."""
    n = cfg.vision.num_layers
    return [l if l >= 0 else n + 1 + l for l in cfg.vision_feature_layers]


def vision_layers_needed(cfg: LlavaConfig) -> int:
    """How many CLIP blocks must run: the deepest layer any feature layer reads."""
    return max(feature_layer_indices(cfg))


class LlavaModel(VisionLanguageModel):
    """LlavaForConditionalGeneration: vision_tower (CLIP, cut after the deepest feature layer),
    multi_modal_projector, language_model (the decoder with its lm_head)."""

    def __init__(self, cfg: LlavaConfig, dtype=jnp.float32):
        self.config = cfg
        self.vision_tower = ClipVisionModel(cfg.vision, vision_layers_needed(cfg), dtype)
        self.multi_modal_projector = LlavaMultiModalProjector(
            cfg.vision.hidden_size * len(cfg.vision_feature_layers), cfg.text.hidden_size, act=cfg.projector_act,
            bias=cfg.projector_bias, dtype=dtype)
        self.language_model = cfg.text.build(dtype)

    def encode(self, pixels: jax.Array) -> jax.Array:
        """pixels [batch, H, W, 3] -> image token embeddings [batch, tokens_per_image, lm_hidden]."""
        cfg = self.config
        states = self.vision_tower(pixels)
        feats = jnp.concatenate([states[i] for i in feature_layer_indices(cfg)], axis=-1)
        if cfg.select_strategy == "default":
            feats = feats[:, 1:]  # drop the class token
        return self.multi_modal_projector(feats).astype(self.embed_dtype)

    def hf_weights(self, w, name: str = "") -> None:
        """Tensor names as `normalize_name` maps them."""
        self.vision_tower.hf_weights(w, "vision_tower")
        self.multi_modal_projector.linear_1.hf_weights(w, "multi_modal_projector.linear_1")
        self.multi_modal_projector.linear_2.hf_weights(w, "multi_modal_projector.linear_2")
        self.language_model.hf_weights(w, "language_model.model", "language_model.lm_head.weight")


@dataclass(eq=False)
class LlavaFamily(Family):
    """A loaded LLaVA model's family: every image is one fixed-size crop with a fixed token count."""
    cfg: LlavaConfig
    policy: ClipImagePolicy
    image_token: str = "<image>"
    name: str = "llava"

    @property
    def image_token_id(self) -> int:
        return self.cfg.image_token_id

    def prepare_image(self, img, opts: ImageOptions = ImageOptions()) -> ImageInput:
        """Decoded RGB PIL image -> pixels [size, size, 3] + token count + encoder-cache key.
        Resolution options do not apply (one size); a token budget below the fixed count is a
        ContextLengthError."""
        from mmjax.errors import ContextLengthError

        n = self.cfg.image_tokens_per_image
        if opts.max_tokens is not None and n > opts.max_tokens:
            raise ContextLengthError(f"every image takes {n} tokens with this model, over image_max_tokens="
                                     f"{opts.max_tokens}", param="image_max_tokens")
        pixels = self.policy(img)
        size = self.cfg.vision.image_size
        if pixels.shape != (size, size, 3):
            raise CheckpointError(f"image processor produces {pixels.shape[:2]} pixels but the vision tower "
                                  f"expects {size}x{size}: the preprocessor config does not match config.json",
                                  param="image_size")
        key = f"{self.name}:{pixel_hash(img)}:{digest(self.policy.cache_key())}"
        side = size // self.cfg.vision.patch_size
        return ImageInput(pixels=pixels, num_tokens=n, key=key, grid=(1, side, side))

    def pixel_views(self, image: ImageInput, height: int, width: int) -> list:
        """One view: the CLIP processor's resize and center crop of the image."""
        from mmjax.image.geometry import Frame
        return [((), self.policy.frame(Frame.of(height, width)))]

    def encode_plan(self, images: list[ImageInput], max_batch: int, shards: int = 1) -> list[EncodeCall]:
        """Stack images into calls of at most `max_batch`, each padded up the power-of-two batch
        ladder (repeating its last image)."""
        ladder = pow2_ladder(1, max_batch)
        calls = []
        for i in range(0, len(images), max_batch):
            part = np.stack([im.pixels for im in images[i:i + max_batch]])
            b = bucket_for(len(part), ladder)
            if b > len(part):
                part = np.concatenate([part, np.repeat(part[-1:], b - len(part), axis=0)])
            n = min(max_batch, len(images) - i)
            calls.append(EncodeCall((b,) + part.shape[1:], part, lambda f, n=n: list(f[:n])))
        return calls

    def warmup_plan(self, max_batch: int, shards: int = 1) -> list[EncodeCall]:
        size = self.cfg.vision.image_size
        return [EncodeCall((b, size, size, 3), np.zeros((b, size, size, 3), np.float32), list)
                for b in pow2_ladder(1, max_batch)]


def load(path: Path, hf_cfg: dict, dtype=jnp.float32) -> tuple[LlavaFamily, LlavaModel, TensorSource]:
    """config.json + image processor config -> (family, the abstract model, its tensors)."""
    if (hf_cfg.get("vision_config") or {}).get("model_type") == "pixtral":  # Pixtral-12B: native resolution
        from mmjax.models import mistral3
        return mistral3.load(path, hf_cfg, dtype)
    cfg = LlavaConfig.from_hf(hf_cfg)
    policy = load_policy(find_image_processor_config(path))
    if not isinstance(policy, ClipImagePolicy):
        raise CheckpointError(f"llava needs a CLIPImageProcessor, the checkpoint has {type(policy).__name__}",
                              param="image_processor_type")
    return (LlavaFamily(cfg, policy, image_token=image_token(path)), build(lambda: LlavaModel(cfg, dtype)),
            TensorSource(path, normalize_name))


def image_token(path: Path) -> str:
    """The placeholder string: processor_config.json's image_token, else '<image>'."""
    p = Path(path) / "processor_config.json"
    if p.is_file():
        tok = json.loads(p.read_text()).get("image_token")
        if tok:
            return tok
    return "<image>"
