"""Tiny random Llama 3.2 Vision (MllamaForConditionalGeneration) checkpoints, built offline with
the transformers config classes + save_pretrained, a trained tokenizer with <|image|>, and
MllamaProcessor + MllamaImageProcessorPil."""
from __future__ import annotations

import json
import os
from pathlib import Path

from tiny_checkpoints import train_tokenizer

SPECIALS = ["<|image|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
# Llama 3.2 Vision's chat format (image parts as <|image|>), without the date/system preamble.
MLLAMA_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "<|start_header_id|>{{ message['role'] }}<|end_header_id|>\n\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<|image|>{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)


def build_mllama(out_dir: str | os.PathLike, *, variant: str = "tiles4", seed: int = 0) -> Path:
    """variant "tiles4": 28-px tiles of 7-px patches (17 tokens per tile, padded to 24), up to 4
        tiles, 4 local + 2 global vision layers, intermediate layers (1, 3), GQA decoder with
        cross-attention at text layers 1 and 3 of 5.
    variant "tiles2": 14-px tiles (5 tokens per tile, padded to 8), up to 2 tiles, 3 local + 1
        global layers, intermediate layers (0, 2), MHA decoder with cross-attention at layers 0
        and 2 of 4, rope_theta 5e5."""
    import torch
    from transformers import MllamaConfig, MllamaForConditionalGeneration
    from transformers.models.mllama.configuration_mllama import MllamaTextConfig, MllamaVisionConfig
    from transformers.models.mllama.image_processing_pil_mllama import MllamaImageProcessorPil

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    tok = train_tokenizer(SPECIALS)
    tok.chat_template = MLLAMA_CHAT_TEMPLATE
    image_id = tok.convert_tokens_to_ids("<|image|>")
    common = dict(vocab_size=len(tok) + 8, hidden_size=64, intermediate_size=128, max_position_embeddings=1024,
                  rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, pad_token_id=3)
    if variant == "tiles4":
        vision = MllamaVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_global_layers=2,
                                    attention_heads=2, image_size=28, patch_size=7, max_num_tiles=4,
                                    intermediate_layers_indices=[1, 3], vision_output_dim=96)
        text = MllamaTextConfig(**common, num_hidden_layers=5, num_attention_heads=4, num_key_value_heads=2,
                                cross_attention_layers=[1, 3],
                                rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
        tile, tiles = 28, 4
    elif variant == "tiles2":
        vision = MllamaVisionConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_global_layers=1,
                                    attention_heads=2, image_size=14, patch_size=7, max_num_tiles=2,
                                    intermediate_layers_indices=[0, 2], vision_output_dim=96,
                                    supported_aspect_ratios=[[1, 1], [1, 2], [2, 1]])
        text = MllamaTextConfig(**common, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4,
                                cross_attention_layers=[0, 2],
                                rope_parameters={"rope_type": "default", "rope_theta": 5e5})
        tile, tiles = 14, 2
    else:
        raise ValueError(variant)
    cfg = MllamaConfig(vision_config=vision, text_config=text, image_token_index=image_id)
    model = MllamaForConditionalGeneration(cfg).eval()
    with torch.no_grad():  # gates start at 0 (closed) and norms at 1: perturb everything
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(out, safe_serialization=True)
    ip = MllamaImageProcessorPil(size={"height": tile, "width": tile}, max_image_tiles=tiles)
    tok.save_pretrained(out)
    ip.save_pretrained(out)
    (out / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 3}))
    return out


def hf_processor(path):
    """transformers' MllamaProcessor over the checkpoint (PIL image processor)."""
    from transformers import AutoTokenizer
    from transformers.models.mllama.image_processing_pil_mllama import MllamaImageProcessorPil
    from transformers.models.mllama.processing_mllama import MllamaProcessor
    return MllamaProcessor(image_processor=MllamaImageProcessorPil.from_pretrained(path),
                           tokenizer=AutoTokenizer.from_pretrained(path))
