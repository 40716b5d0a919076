"""GLM-4.1V, GLM-4.5V and GLM-4.6V (Glm4vForConditionalGeneration, Glm4vMoeForConditionalGeneration,
Glm46VForConditionalGeneration).

The host side is Qwen2-VL's (models/qwen2_vl.py: dynamic-resolution patches, exact token counts,
the patch-ladder packed encode, limits), with Glm4vImageProcessor's resize rule
(image/glm4v.py: the pixel bounds count an image as temporal_patch_size frames). The prompt
layout is the chat template's `<|begin_of_image|><|image|><|end_of_image|>`, the `<|image|>`
placeholder expanded to the image's tokens. Positions are Qwen's M-RoPE rule as HF's
Glm4vModel.get_rope_index has it: each run of image tokens at text position s takes (s,
s + row, s + col) and text resumes at s + max(rows, cols).

The tower is models/vision/glm4v.py; the decoder models/text/glm4.py (dense GLM-4 layers with
post-norms for GLM-4.1V / 4.6V, the MoE text model with shared experts for GLM-4.5V). Modules as
transformers' Glm4vModel: `visual`, `language_model` (its `lm_head` included).

`detail` / `image_max_tokens` / `min_pixels` / `max_pixels` act on the processor's pixel bounds as
for Qwen2-VL, with the bounds counted over two frames (`fit_options`).

Video (`<|video|>` in the template's `<|begin_of_video|><|video|><|end_of_video|>`): the frame
plan, resize and patches are video/glm4v.py's port of the checkpoint's video processor; the
processor writes each temporal patch as `<|begin_of_image|>` + its `<|image|>` tokens +
`<|end_of_image|>` + its time (`image_prompt`; GLM-4.6V's processors, named by the checkpoint's
video processor type, write `{t:.1f} seconds` and sample at a rate set by the duration), so a video's tokens are image tokens
(`feature_token_id`) and each frame is positioned like an image (HF splits the video grid into
frames of t = 1); the tower encodes one attention segment per frame, as get_video_features does.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import jax.numpy as jnp
from flax import nnx

from mmjax.checkpoint import TensorSource
from mmjax.errors import CheckpointError, UnsupportedModelError
from mmjax.image.glm4v import Glm4vImagePolicy
from mmjax.image.processors import find_image_processor_config
from mmjax.models.family import ImageInput, ImageOptions
from mmjax.models.hf_config import tie_word_embeddings
from mmjax.models.nn.weights import build
from mmjax.models.qwen2_vl import QwenVLConfig, Qwen2VLModel
from mmjax.models.qwen3_vl import Qwen3VLFamily
from mmjax.models.text.glm4 import Glm4TextConfig
from mmjax.models.vision.glm4v import Glm4vVisionConfig, Glm4vVisionModel
from mmjax.video.glm4v import Glm4vVideoPolicy
from mmjax.video.processors import find_video_processor_config

MODEL_TYPES = ("glm4v", "glm4v_moe", "glm46v")


@dataclass(frozen=True)
class Glm4vConfig(QwenVLConfig):
    vision: Glm4vVisionConfig
    text: Glm4TextConfig

    @classmethod
    def from_hf(cls, cfg: dict) -> "Glm4vConfig":
        mt = cfg.get("model_type")
        if mt not in MODEL_TYPES:
            raise UnsupportedModelError(f"config.json: model_type={mt!r} is not GLM-4.xV", param="model_type")
        tc = cfg.get("text_config")
        if not isinstance(tc, dict):
            raise CheckpointError("config.json: text_config is missing", param="text_config")
        moe = mt == "glm4v_moe" or tc.get("model_type") == "glm4v_moe_text"
        text = Glm4TextConfig.from_glm(tc, moe=moe, tie=tie_word_embeddings(cfg, tc))
        vision = Glm4vVisionConfig.from_hf(cfg.get("vision_config") or {})
        if vision.out_hidden_size != text.hidden_size:
            raise CheckpointError(f"config.json: vision out_hidden_size {vision.out_hidden_size} != text hidden size "
                                  f"{text.hidden_size}", param="vision_config.out_hidden_size")
        token = cfg.get("image_token_id", tc.get("image_token_id"))
        if token is None:
            raise CheckpointError("config.json: image_token_id is missing", param="image_token_id")
        video = cfg.get("video_token_id", tc.get("video_token_id"))
        return cls(vision=vision, text=text, image_token_id=int(token),
                   vision_start_token_id=cfg.get("image_start_token_id"), model_type=mt,
                   video_token_id=None if video is None else int(video))


def normalize_name(name: str) -> str:
    """transformers 5 names (`model.language_model.*`, `model.visual.*`, `lm_head.weight`) and the
    hub's older ones (`model.layers.*`, `model.visual.*`) -> `model.*`, `visual.*`, `lm_head.weight`."""
    for old, new in (("model.language_model.", "model."), ("model.visual.", "visual.")):
        if name.startswith(old):
            return new + name[len(old):]
    return name


class Glm4vModel(Qwen2VLModel):
    """Glm4v(Moe)ForConditionalGeneration / Glm46VForConditionalGeneration: `visual` (the packed
    tower) and `language_model` (the GLM-4 decoder with its lm_head). `encode` (Qwen2VLModel's):
    one packed group (patches, pos_hw, image_seg, sizes_hw) -> [n_pad / merge**2, hidden]."""

    @staticmethod
    def make_visual(cfg, dtype, attn_impl: str) -> nnx.Module:
        return Glm4vVisionModel(cfg.vision, dtype, attn_impl)


@dataclass(eq=False)
class Glm4vFamily(Qwen3VLFamily):
    """A loaded GLM-4.xV model's family: Qwen's host side and packing (Qwen3-VL's, which carries each
    patch's grid size for the position-embedding resampling), GLM's resize rule and tokens."""
    image_token: str = "<|image|>"
    glm46v: bool = False           # GLM-4.6V's processors: "{t:.1f} seconds" frame times, dynamic sampling
    begin_image: str = "<|begin_of_image|>"
    end_image: str = "<|end_of_image|>"

    @property
    def video_token(self) -> str | None:
        return None if self.cfg.video_token_id is None else "<|video|>"

    @property
    def media_token_ids(self) -> tuple[int, ...]:
        """Images' and videos' tokens are both the image token."""
        return (self.image_token_id,)

    def feature_token_id(self, item: ImageInput) -> int:
        return self.image_token_id

    def image_prompt(self, image: ImageInput) -> str:
        """Glm4vProcessor's text for one input: an image's `<|image|>` run; a video's temporal
        patches, each `<|begin_of_image|>` + its tokens + `<|end_of_image|>` + its time
        (`int(seconds)`; GLM-4.6V's processor: `{seconds:.1f} seconds`)."""
        if image.kind != "video":
            return self.image_token * image.num_tokens
        lt, lh, lw = self.token_grid(image)
        frame = self.begin_image + self.image_token * (lh * lw) + self.end_image
        return "".join(frame + (f"{t:.1f} seconds" if self.glm46v else str(int(t))) for t in image.video.timestamps)

    def fit_options(self, max_tokens: int) -> ImageOptions:
        """max_pixels for max_tokens merged tokens: the bounds count temporal_patch_size frames."""
        lo, hi = self.pixel_bounds()
        per_token = self.policy.factor ** 2 * self.policy.temporal_patch_size
        return ImageOptions(max_pixels=max(lo, min(hi, max_tokens * per_token)))

    @property
    def default_image_tokens(self) -> int:
        _, hi = self.pixel_bounds()
        return max(1, hi // (self.policy.factor ** 2 * self.policy.temporal_patch_size))


def checked_policy(path: Path, cfg: Glm4vConfig) -> Glm4vImagePolicy:
    """The checkpoint's Glm4vImageProcessor config, checked against the tower's patch geometry."""
    pc = find_image_processor_config(path)
    kind = str(pc.get("image_processor_type") or "")
    if not kind.startswith("Glm4vImageProcessor") and not kind.startswith("Glm46VImageProcessor"):
        raise CheckpointError(f"{cfg.model_type} needs a Glm4vImageProcessor, the checkpoint has {kind!r}",
                              param="image_processor_type")
    policy = Glm4vImagePolicy.from_config(pc)
    v = cfg.vision
    if (policy.patch_size, policy.merge_size, policy.temporal_patch_size) != (
            v.patch_size, v.merge_size, v.temporal_patch_size):
        raise CheckpointError("image processor patch_size/merge_size/temporal_patch_size "
                              f"{(policy.patch_size, policy.merge_size, policy.temporal_patch_size)} do not match "
                              f"config.json {(v.patch_size, v.merge_size, v.temporal_patch_size)}", param="patch_size")
    return policy


def load(path: Path, hf_cfg: dict, dtype=jnp.float32) -> tuple[Glm4vFamily, Glm4vModel, TensorSource]:
    """config.json + preprocessor config -> (family, the abstract model, its tensors)."""
    cfg = Glm4vConfig.from_hf(hf_cfg)
    vc = find_video_processor_config(path)
    # GLM-4.6V ships Glm46V processors (also on a glm4v_moe config): the video processor's type says which
    glm46v = str((vc or {}).get("video_processor_type") or "").startswith("Glm46V") or (
        vc is None and cfg.model_type == "glm46v")
    video = Glm4vVideoPolicy.from_config(vc, dynamic=glm46v)
    v = cfg.vision
    if (video.patch_size, video.merge_size, video.temporal_patch_size) != (v.patch_size, v.merge_size,
                                                                          v.temporal_patch_size):
        raise CheckpointError("video processor patch_size/merge_size/temporal_patch_size do not match config.json",
                              param="video_preprocessor_config.patch_size")
    family = Glm4vFamily(cfg, checked_policy(path, cfg), video_policy=video, glm46v=glm46v)
    return family, build(lambda: Glm4vModel(cfg, dtype)), TensorSource(path, normalize_name)
