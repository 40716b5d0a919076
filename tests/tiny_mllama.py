"""Tiny random Llama 3.2 Vision (MllamaForConditionalGeneration) checkpoints, built offline with
the transformers config classes + save_pretrained, a trained tokenizer with <|image|>, and
MllamaProcessor + MllamaImageProcessorPil."""
from __future__ import annotations

import json
import os
from pathlib import Path

from tiny_checkpoints import train_tokenizer

SPECIALS = ["<|image|>", "<|begin_of_text|>", "<|eot_id|>"]


def build_mllama(out_dir: str | os.PathLike, *, variant: str = "tiles4", seed: int = 0) -> Path:
    """variant "tiles4": 28-px tiles of 7-px patches (17 tokens per tile, padded to 24), up to 4
    tiles, 4 local + 2 global vision layers, intermediate layers (1, 3), cross-attention at text
    layers 1 and 3 of 5."""
    import torch
    from transformers import MllamaConfig, MllamaForConditionalGeneration
    from transformers.models.mllama.configuration_mllama import MllamaTextConfig, MllamaVisionConfig
    from transformers.models.mllama.image_processing_pil_mllama import MllamaImageProcessorPil

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    tok = train_tokenizer(SPECIALS)
    image_id = tok.convert_tokens_to_ids("<|image|>")
    vision = MllamaVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_global_layers=2,
                                attention_heads=2, image_size=28, patch_size=7, max_num_tiles=4,
                                intermediate_layers_indices=[1, 3], vision_output_dim=96)
    text = MllamaTextConfig(vocab_size=len(tok) + 8, hidden_size=64, intermediate_size=128, num_hidden_layers=5,
                            num_attention_heads=4, num_key_value_heads=2, cross_attention_layers=[1, 3],
                            max_position_embeddings=1024, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2,
                            pad_token_id=3, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    cfg = MllamaConfig(vision_config=vision, text_config=text, image_token_index=image_id)
    model = MllamaForConditionalGeneration(cfg).eval()
    with torch.no_grad():  # gates start at 0 (closed) and norms at 1: perturb everything
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(out, safe_serialization=True)
    ip = MllamaImageProcessorPil(size={"height": 28, "width": 28}, max_image_tiles=4)
    tok.save_pretrained(out)
    ip.save_pretrained(out)
    (out / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 3}))
    return out
