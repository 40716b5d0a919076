"""Qwen3-VL and Qwen3-VL-MoE (Qwen3VLForConditionalGeneration, Qwen3VLMoeForConditionalGeneration).

Everything host-side is Qwen2-VL's (models/qwen2_vl.py: smart_resize preprocessing, exact token
counts, patch-ladder packed encoding, M-RoPE prompt positions, limits), so the family subclasses
it. What differs:
- the vision tower (models/vision/qwen3_vl.py): learned position embeddings resampled to each
  grid, DeepStack features from intermediate layers, each through its own merger;
- the decoder: Qwen3 (text/llama.py's LlamaModel with QK-norm) with interleaved M-RoPE, DeepStack's
  per-layer image features added after the first decoder layers (`image_feature_layers`), and for
  the MoE variant sparse-MoE feed-forward layers (nn/moe.py's SparseMoeBlock).

Image features are [tokens, (1 + n_deepstack) * hidden]: the input embedding, then one block per
DeepStack layer. They travel as one per-token array through the encoder cache and the prefill
chunks (LlamaModel.inputs splits them in the compiled step).

Modules (`Qwen3VLModel`, transformers' Qwen3VLModel tree): `visual` (models/vision/qwen3_vl.py)
and `language_model` (its `lm_head` included).

Video (`<|video_pad|>`): Qwen3VLVideoProcessor's sampling and sizing
(`mmjax.video.processors.Qwen3VLVideoPolicy`), encoded by the same packed tower (one attention
segment per temporal patch, DeepStack blocks included: HF's visual_pos_masks covers image and
video tokens). Qwen3VLProcessor writes each temporal patch as text, `<{t:.1f} seconds>` +
`<|vision_start|>` + its tokens + `<|vision_end|>` in place of the `<|video_pad|>` placeholder,
and of the `<|vision_start|>` / `<|vision_end|>` around it where the prompt has both, as
transformers 5.25's processor collapses the template's wrapper (`image_prompt`, a
`tokenizer.MediaText`; images expand to their `<|image_pad|>` run the same way, so mixed prompts
tokenize as HF's). Positions (HF get_rope_index): the video grid is split into frames of t = 1,
each placed like an image after the timestamp text before it.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import jax.numpy as jnp
import numpy as np
from flax import nnx

from mmjax.checkpoint import TensorSource
from mmjax.errors import CheckpointError, PromptError, UnsupportedModelError
from mmjax.models.family import ImageInput
from mmjax.models.hf_config import tie_word_embeddings
from mmjax.models.nn.weights import build
from mmjax.models.qwen2_vl import (QwenVLConfig, QwenVLFamily, Qwen2VLModel, checked_policy, checked_video_policy,
                                   normalize_name)
from mmjax.models.text.llama import LlamaConfig
from mmjax.models.vision.qwen3_vl import Qwen3VisionConfig, Qwen3VLVisionModel, pack
from mmjax.tokenizer import MediaText
from mmjax.video.processors import Qwen3VLVideoPolicy

DEFAULT_MROPE_SECTION = (24, 20, 20)  # HF's Qwen3VLTextRotaryEmbedding default


@dataclass(frozen=True)
class Qwen3VLConfig(QwenVLConfig):
    vision: Qwen3VisionConfig

    @classmethod
    def from_hf(cls, cfg: dict) -> "Qwen3VLConfig":
        mt = cfg.get("model_type")
        if mt not in ("qwen3_vl", "qwen3_vl_moe"):
            raise UnsupportedModelError(f"config.json: model_type={mt!r} is not Qwen3-VL", param="model_type")
        tc = cfg.get("text_config")
        if not isinstance(tc, dict):
            raise CheckpointError("config.json: text_config is missing", param="text_config")
        vision = Qwen3VisionConfig.from_hf(cfg.get("vision_config") or {})
        text_mt = "qwen3_vl_moe_text" if mt == "qwen3_vl_moe" else "qwen3_vl_text"
        tc = {**tc, "model_type": text_mt}
        # transformers' defaults where a config leaves them out: theta 5e5 (Qwen3VLTextConfig's
        # default_theta), and for the dense text config head_dim 128 (MoE: hidden / heads)
        rope = {**(tc.get("rope_scaling") or {}), **(tc.get("rope_parameters") or {})}
        if "rope_theta" not in rope and tc.get("rope_theta") is None:
            tc["rope_theta"] = 500000.0
        if mt == "qwen3_vl" and tc.get("head_dim") is None:
            tc["head_dim"] = 128
        text = LlamaConfig.from_hf(tc, "text_config",
                                   tie_word_embeddings=tie_word_embeddings(cfg, tc),
                                   image_feature_layers=len(vision.deepstack_visual_indexes))
        if text.moe is None and mt == "qwen3_vl_moe":
            raise CheckpointError("config.json: text_config.num_experts is missing", param="text_config.num_experts")
        if text.moe is not None:   # Qwen3-VL-MoE's router always renormalises (no norm_topk_prob flag)
            text = dataclasses.replace(text, moe=dataclasses.replace(text.moe, norm_topk_prob=True))
        # HF's Qwen3-VL rotary always interleaves the sections (mrope_interleaved is informative)
        section = text.rope.mrope_section or DEFAULT_MROPE_SECTION
        if len(section) != 3 or sum(section) != text.head_dim // 2:
            raise CheckpointError(f"config.json: rope_parameters.mrope_section={list(section)} must be three sections "
                                  f"summing to head_dim/2={text.head_dim // 2}",
                                  param="text_config.rope_parameters.mrope_section")
        text = dataclasses.replace(text, rope=dataclasses.replace(text.rope, mrope_section=tuple(section),
                                                                  mrope_interleaved=True))
        if vision.out_hidden_size != text.hidden_size:
            raise CheckpointError(f"config.json: vision out_hidden_size {vision.out_hidden_size} != text hidden size "
                                  f"{text.hidden_size}", param="vision_config.out_hidden_size")
        token = cfg.get("image_token_id", tc.get("image_token_id"))
        if token is None:
            raise CheckpointError("config.json: image_token_id is missing", param="image_token_id")
        video = cfg.get("video_token_id", tc.get("video_token_id"))
        return cls(vision=vision, text=text, image_token_id=int(token),
                   vision_start_token_id=cfg.get("vision_start_token_id"), model_type=mt,
                   video_token_id=None if video is None else int(video))


class Qwen3VLModel(Qwen2VLModel):
    """Qwen3VLForConditionalGeneration / Qwen3VLMoeForConditionalGeneration: `visual` (the packed
    tower with its DeepStack mergers) and `language_model` (the Qwen3 decoder: QK-norm,
    interleaved M-RoPE, DeepStack additions, MoE layers). `encode` (Qwen2VLModel's): one packed
    group (patches, pos_hw, image_seg, sizes_hw) -> [n_pad / merge**2, (1 + n_deepstack) * hidden]
    (final merger, then DeepStack blocks)."""

    @staticmethod
    def make_visual(cfg, dtype, attn_impl: str) -> nnx.Module:
        return Qwen3VLVisionModel(cfg.vision, dtype, attn_impl)


@dataclass(eq=False)
class Qwen3VLFamily(QwenVLFamily):
    """A loaded Qwen3-VL / Qwen3-VL-MoE model's family (Qwen2-VL's host side, Qwen3-VL's tower)."""
    vision_start: str = "<|vision_start|>"
    vision_end: str = "<|vision_end|>"

    def image_prompt(self, image: ImageInput) -> str:
        """Qwen3VLProcessor's text for one input: an image's `<|image_pad|>` run; a video's
        temporal patches, each `<{t:.1f} seconds><|vision_start|>` + its tokens + `<|vision_end|>`
        (replace_video_token). A `MediaText` whose wrapper is vision_start / vision_end: where
        the placeholder sits inside `<|vision_start|><|video_pad|><|vision_end|>` (Qwen's chat
        template, raw prompts) the whole triple is replaced, as the processor collapses it
        (get_text_with_replacements) before expanding the bare placeholder."""
        if image.kind != "video":
            return self.image_token * image.num_tokens
        lt, lh, lw = self.token_grid(image)
        frame = self.vision_start + self.video_token * (lh * lw) + self.vision_end
        stamps = image.video.timestamps
        if len(stamps) != lt:
            raise PromptError(f"video has {lt} temporal patches but {len(stamps)} timestamps", param="videos")
        return MediaText("".join(f"<{t:.1f} seconds>" + frame for t in stamps), (self.vision_start, self.vision_end))

    def positions(self, ids: np.ndarray, images: list[ImageInput], image_starts: list[int]
                  ) -> tuple[np.ndarray, int]:
        """M-RoPE positions [3, prompt_len] and the decode offset (HF Qwen3-VL get_rope_index).

        As Qwen2-VL's, except that a video is split into its temporal patches (grid t = 1 each;
        the timestamp text between them advances the text positions): each frame's tokens at
        text position s take (s, s + row, s + col) and text resumes at s + max(rows, cols)."""
        media = np.flatnonzero(np.isin(ids, self.media_token_ids))
        pos = np.zeros((3, len(ids)), np.int64)
        cur, prev, k = 0, 0, 0
        for im in images:
            lt, lh, lw = self.token_grid(im)
            frames = lt if im.kind == "video" else 1
            n = lt * lh * lw // frames
            rows, cols = np.meshgrid(np.arange(lh), np.arange(lw), indexing="ij")
            rows, cols = np.tile(rows.ravel(), lt // frames), np.tile(cols.ravel(), lt // frames)
            for _ in range(frames):
                s = int(media[k])
                if int(media[k + n - 1]) != s + n - 1:
                    raise PromptError(f"the tokens of one {im.kind} frame must be contiguous in the prompt",
                                      param="videos" if im.kind == "video" else "images")
                pos[:, prev:s] = cur + np.arange(s - prev)
                cur += s - prev
                pos[0, s:s + n] = cur
                pos[1, s:s + n] = cur + rows
                pos[2, s:s + n] = cur + cols
                cur += max(lh, lw)
                prev, k = s + n, k + n
        pos[:, prev:] = cur + np.arange(len(ids) - prev)
        delta = int(pos.max()) + 1 - len(ids) if len(ids) else 0
        return pos.astype(np.int32), delta

    def pack(self, images: list[ImageInput], n_pad: int):
        return pack(images, self.cfg.vision, n_pad)

    def dummy_packed(self, n_pad: int) -> tuple:
        v = self.cfg.vision
        return (np.zeros((n_pad, v.patch_dim), np.float32), np.zeros((n_pad, 2), np.int32),
                np.zeros((n_pad,), np.int32), np.ones((n_pad, 2), np.int32))


def load(path: Path, hf_cfg: dict, dtype=jnp.float32) -> tuple[Qwen3VLFamily, Qwen3VLModel, TensorSource]:
    """config.json + preprocessor configs -> (family, the abstract model, its tensors)."""
    cfg = Qwen3VLConfig.from_hf(hf_cfg)
    family = Qwen3VLFamily(cfg, checked_policy(path, cfg),
                           video_policy=checked_video_policy(path, cfg, Qwen3VLVideoPolicy))
    return family, build(lambda: Qwen3VLModel(cfg, dtype)), TensorSource(path, normalize_name)
