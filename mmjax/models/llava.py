"""LLaVA-1.5 family (LlavaForConditionalGeneration): CLIP ViT -> MLP projector -> Llama decoder."""
from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from mmjax.checkpoint import TensorSource
from mmjax.config import LlavaConfig
from mmjax.models.decoder import load_decoder_params
from mmjax.models.projector import load_projector_params, project
from mmjax.models.vit import clip_hidden_states, load_clip_params

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


def load_params(src: TensorSource, cfg: LlavaConfig) -> dict:
    """Checkpoint tensors -> numpy params pytree {"vision", "projector", "text"}."""
    vision_in = cfg.vision.hidden_size * len(cfg.vision_feature_layers)
    params = {
        "vision": load_clip_params(src, cfg.vision, "vision_tower.", vision_layers_needed(cfg)),
        "projector": load_projector_params(src, "multi_modal_projector.", vision_in,
                                           cfg.text.hidden_size, cfg.projector_bias),
        "text": load_decoder_params(src, cfg.text, "language_model.model.", "language_model.lm_head.weight"),
    }
    src.check_all_used()
    return params


def encode_images(params: dict, pixels: jax.Array, cfg: LlavaConfig) -> jax.Array:
    """pixels [batch, H, W, 3] -> image token embeddings [batch, tokens_per_image, lm_hidden]."""
    states = clip_hidden_states(params["vision"], pixels, cfg.vision)
    feats = jnp.concatenate([states[i] for i in feature_layer_indices(cfg)], axis=-1)
    if cfg.select_strategy == "default":
        feats = feats[:, 1:]  # drop the class token
    return project(params["projector"], feats, cfg.projector_act).astype(params["text"]["embed"].dtype)


@dataclass(frozen=True)
class LlavaFamily:
    """Host-side description of a loaded LLaVA model; the compiled steps live in runner.py."""
    cfg: LlavaConfig
    policy: object = None  # vision_io.ClipImagePolicy
    name: str = "llava"

    @property
    def text(self):
        return self.cfg.text

    @property
    def image_token_id(self) -> int:
        return self.cfg.image_token_id

    def encode(self, params: dict, pixels: jax.Array) -> jax.Array:
        return encode_images(params, pixels, self.cfg)

    def check_pixels(self, pixels: np.ndarray) -> None:
        size = self.cfg.vision.image_size
        if pixels.shape != (size, size, 3):
            from mmjax.errors import CheckpointError
            raise CheckpointError(f"image processor produces {pixels.shape[:2]} pixels but the vision tower "
                                  f"expects {size}x{size}: the preprocessor config does not match config.json",
                                  param="image_size")

    # ---- host-side hooks used by the engine ---------------------------------------------------
    def prepare_image(self, img, **_) -> "ImageInput":
        """Decoded RGB PIL image -> model input + token count + encoder-cache key."""
        from mmjax.engine import ImageInput
        from mmjax.vision_io import pixel_hash

        pixels = self.policy(img)
        self.check_pixels(pixels)
        key = f"{self.name}:{pixel_hash(img)}:{hash(self.policy.cache_key())}"
        return ImageInput(pixels=pixels, num_tokens=self.cfg.image_tokens_per_image, key=key)

    def encode_batch(self, runner, images: list) -> list[np.ndarray]:
        """All images share one shape: stack, encode in bucketed batches, split per image."""
        feats = runner.encode(np.stack([im.pixels for im in images]))
        return [f for f in feats]

    def warmup_encode(self, runner) -> None:
        """Compile the encode step for every batch bucket."""
        size = self.cfg.vision.image_size
        for b in runner.buckets.encode:
            runner.encode(np.zeros((b, size, size, 3), np.float32))

    def positions(self, ids: np.ndarray, images: list, image_starts: list[int]) -> tuple[np.ndarray, int]:
        """1-D RoPE positions [prompt_len] and no offset for decode."""
        return np.arange(len(ids), dtype=np.int32), 0


def load(path, hf_cfg: dict) -> tuple[LlavaFamily, dict]:
    """config.json + safetensors + image processor config -> (family, numpy params)."""
    from mmjax.vision_io import find_image_processor_config, load_policy

    cfg = LlavaConfig.from_hf(hf_cfg)
    params = load_params(TensorSource(path, normalize_name), cfg)
    return LlavaFamily(cfg, load_policy(find_image_processor_config(path))), params


def image_token(path, hf_cfg: dict) -> str:
    """The placeholder string: processor_config.json's image_token, else '<image>'."""
    import json
    from pathlib import Path

    p = Path(path) / "processor_config.json"
    if p.is_file():
        tok = json.loads(p.read_text()).get("image_token")
        if tok:
            return tok
    return "<image>"
