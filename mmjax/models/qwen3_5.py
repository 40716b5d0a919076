"""Qwen3.5 and Qwen3.5-MoE (Qwen3_5ForConditionalGeneration, Qwen3_5MoeForConditionalGeneration).

The host side and the vision tower are Qwen3-VL's (models/qwen3_vl.py: Qwen3VLProcessor, which
transformers maps qwen3_5 to, smart_resize images, Qwen3VLVideoProcessor videos with timestamp
text per temporal patch, the same get_rope_index); what differs:
- the tower has no DeepStack (Qwen3_5VisionModel drops deepstack_visual_indexes and its
  mergers): image features are [tokens, hidden], the merger's output only;
- the decoder is the hybrid Gated DeltaNet / gated full attention model (text/qwen3_5.py), whose
  per-slot recurrent states live beside the KV cache; a cached prefix resumes where a snapshot
  of those states ends (serving/state_snapshots.py).

Hub checkpoints may carry multi-token-prediction weights (`mtp.*`): not used for serving, read
past.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import jax.numpy as jnp

from mmjax.checkpoint import TensorSource
from mmjax.errors import CheckpointError, UnsupportedModelError
from mmjax.models.hf_config import tie_word_embeddings
from mmjax.models.nn.weights import build
from mmjax.models.qwen2_vl import QwenVLConfig, checked_policy, checked_video_policy, normalize_name
from mmjax.models.qwen3_vl import Qwen3VLFamily, Qwen3VLModel
from mmjax.models.text.qwen3_5 import Qwen35TextConfig
from mmjax.models.vision.qwen3_vl import Qwen3VisionConfig
from mmjax.video.processors import Qwen3VLVideoPolicy

MODEL_TYPES = ("qwen3_5", "qwen3_5_moe")


@dataclass(frozen=True)
class Qwen35Config(QwenVLConfig):
    vision: Qwen3VisionConfig

    @classmethod
    def from_hf(cls, cfg: dict) -> "Qwen35Config":
        mt = cfg.get("model_type")
        if mt not in MODEL_TYPES:
            raise UnsupportedModelError(f"config.json: model_type={mt!r} is not Qwen3.5", param="model_type")
        tc = cfg.get("text_config")
        if not isinstance(tc, dict):
            raise CheckpointError("config.json: text_config is missing", param="text_config")
        # Qwen3_5VisionConfig has no DeepStack (Qwen3-VL's parser would default to three layers)
        vision = Qwen3VisionConfig.from_hf({**(cfg.get("vision_config") or {}), "deepstack_visual_indexes": []})
        text = Qwen35TextConfig.from_hf(tc, "text_config", tie_word_embeddings=tie_word_embeddings(cfg, tc))
        if mt == "qwen3_5_moe" and text.moe is None:
            raise CheckpointError("config.json: text_config.num_experts is missing", param="text_config.num_experts")
        if vision.out_hidden_size != text.hidden_size:
            raise CheckpointError(f"config.json: vision out_hidden_size {vision.out_hidden_size} != text hidden size "
                                  f"{text.hidden_size}", param="vision_config.out_hidden_size")
        token = cfg.get("image_token_id", 248056)
        video = cfg.get("video_token_id", 248057)
        return cls(vision=vision, text=text, image_token_id=int(token),
                   vision_start_token_id=cfg.get("vision_start_token_id", 248053), model_type=mt,
                   video_token_id=None if video is None else int(video))


class Qwen35Model(Qwen3VLModel):
    """`visual` (Qwen3-VL's packed tower, no DeepStack) and `language_model` (the hybrid decoder)."""

    def hf_weights(self, w, name: str = "") -> None:
        w.ignore(r"mtp\..*")
        super().hf_weights(w, name)


def load(path: Path, hf_cfg: dict, dtype=jnp.float32) -> tuple[Qwen3VLFamily, Qwen35Model, TensorSource]:
    """config.json + preprocessor configs -> (family, the abstract model, its tensors)."""
    cfg = Qwen35Config.from_hf(hf_cfg)
    family = Qwen3VLFamily(cfg, checked_policy(path, cfg),
                           video_policy=checked_video_policy(path, cfg, Qwen3VLVideoPolicy))
    return family, build(lambda: Qwen35Model(cfg, dtype)), TensorSource(path, normalize_name)
