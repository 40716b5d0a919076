"""Tiny random LLaVA-NeXT and LLaVA-OneVision checkpoints, built offline with the transformers
config classes + save_pretrained, the families' Pil image processors and processors, a trained
tokenizer and LLaVA's conversation template. Small grid pinpoints so that wide, tall and square
images pick different grids."""
from __future__ import annotations

import json
import os
from pathlib import Path

from tiny_checkpoints import LLAVA_CHAT_TEMPLATE, train_tokenizer

# (height, width) in pixels of 16-pixel tiles
NEXT_PINPOINTS = [[16, 32], [32, 16], [32, 32], [16, 48], [48, 16]]
SLIDING_WINDOW = 48      # Mistral's window in the "next" checkpoint: shorter than its tiled prompts
ONEVISION_PINPOINTS = [[16, 16], [16, 32], [32, 16], [32, 32], [32, 48], [48, 32], [48, 48]]


def onevision_processor(image_processor, tokenizer):
    """LlavaOnevisionProcessor without its video processor (which needs torchvision, not installed:
    this project serves OneVision's images only). The class check of the absent video processor
    is skipped while constructing."""
    from unittest import mock

    from transformers import LlavaOnevisionProcessor
    from transformers.processing_utils import ProcessorMixin
    with mock.patch.object(ProcessorMixin, "check_argument_for_proper_class", lambda *a, **k: None):
        return LlavaOnevisionProcessor(image_processor=image_processor, tokenizer=tokenizer, num_image_tokens=16,
                                       vision_feature_select_strategy="full", vision_aspect_ratio="anyres_max_2",
                                       chat_template=LLAVA_CHAT_TEMPLATE)


def load_processor(path: str | os.PathLike):
    """The checkpoint's processor (OneVision: rebuilt from the saved image processor + tokenizer)."""
    from transformers import AutoProcessor, AutoTokenizer
    from transformers.models.llava_onevision.image_processing_pil_llava_onevision import \
        LlavaOnevisionImageProcessorPil
    cfg = json.loads((Path(path) / "config.json").read_text())
    if cfg["model_type"] != "llava_onevision":
        return AutoProcessor.from_pretrained(path)
    ipc = json.loads((Path(path) / "preprocessor_config.json").read_text())
    ip = LlavaOnevisionImageProcessorPil(**{k: v for k, v in ipc.items() if k not in ("image_processor_type",)})
    return onevision_processor(ip, AutoTokenizer.from_pretrained(path))


def build_llava_next(out_dir: str | os.PathLike, *, variant: str = "next", seed: int = 0) -> Path:
    """variant "next": LlavaNextForConditionalGeneration, CLIP 16 px tiles of 4x4 patches,
        vision_feature_layer -2, "default" strategy, Llama GQA 4:2, untied head.
    variant "onevision": LlavaOnevisionForConditionalGeneration, SigLIP 16 px tiles of 4x4
        patches, vision_feature_layer [-2, -1] (concatenated), "full" strategy, Qwen2 (qkv bias)
        tied only in its text config (OneVision ties then), anyres_max_2 (grids over 2 tiles
        are downscaled), image mean 0.5 (the multi-image padding color).
    """
    import torch
    from transformers import (CLIPVisionConfig, LlavaNextConfig, MistralConfig, LlavaNextForConditionalGeneration,
                              LlavaNextProcessor, LlavaOnevisionConfig, LlavaOnevisionForConditionalGeneration,
                              Qwen2Config, SiglipVisionConfig)
    from transformers.models.llava_next.image_processing_pil_llava_next import LlavaNextImageProcessorPil
    from transformers.models.llava_onevision.image_processing_pil_llava_onevision import \
        LlavaOnevisionImageProcessorPil

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    tok = train_tokenizer(["<image>", "<video>"])
    tok.chat_template = LLAVA_CHAT_TEMPLATE
    image_id = tok.convert_tokens_to_ids("<image>")
    if variant == "next":
        vision = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                                  image_size=16, patch_size=4, projection_dim=16, hidden_act="quick_gelu")
        text = MistralConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                             rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
                             pad_token_id=3, sliding_window=SLIDING_WINDOW)
        cfg = LlavaNextConfig(vision_config=vision, text_config=text, image_token_index=image_id,
                              vision_feature_layer=-2, vision_feature_select_strategy="default",
                              image_grid_pinpoints=NEXT_PINPOINTS, tie_word_embeddings=False)
        model = LlavaNextForConditionalGeneration(cfg).eval()
        ip = LlavaNextImageProcessorPil(size={"shortest_edge": 16}, crop_size={"height": 16, "width": 16},
                                        image_grid_pinpoints=NEXT_PINPOINTS)
        proc = LlavaNextProcessor(image_processor=ip, tokenizer=tok, patch_size=4,
                                  vision_feature_select_strategy="default", num_additional_image_tokens=1,
                                  chat_template=LLAVA_CHAT_TEMPLATE)
    elif variant == "onevision":
        vision = SiglipVisionConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
                                    image_size=16, patch_size=4, vision_use_head=False)
        text = Qwen2Config(vocab_size=len(tok), hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                           rms_norm_eps=1e-6, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
                           pad_token_id=3)
        cfg = LlavaOnevisionConfig(vision_config=vision, text_config=text, image_token_index=image_id,
                                   video_token_index=tok.convert_tokens_to_ids("<video>"),
                                   vision_feature_layer=[-2, -1], vision_feature_select_strategy="full",
                                   image_grid_pinpoints=ONEVISION_PINPOINTS, vision_aspect_ratio="anyres_max_2")
        model = LlavaOnevisionForConditionalGeneration(cfg).eval()
        ip = LlavaOnevisionImageProcessorPil(size={"height": 16, "width": 16}, image_grid_pinpoints=ONEVISION_PINPOINTS,
                                             image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5])
        proc = onevision_processor(ip, tok)
    else:
        raise ValueError(variant)
    with torch.no_grad():   # norms start at 1 and biases at 0: perturb everything
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    model.save_pretrained(out, safe_serialization=True)
    if variant == "next":
        proc.save_pretrained(out)
    else:   # ProcessorMixin.save_pretrained needs the video processor: save the parts (hub layout)
        ip.save_pretrained(out)
        tok.save_pretrained(out)
        (out / "processor_config.json").write_text(json.dumps({
            "processor_class": "LlavaOnevisionProcessor", "image_token": "<image>", "video_token": "<video>",
            "num_image_tokens": 16, "vision_aspect_ratio": "anyres_max_2",
            "vision_feature_select_strategy": "full"}))
    (out / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 3}))
    return out
