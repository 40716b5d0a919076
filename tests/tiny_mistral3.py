"""Tiny random Mistral 3 (Mistral3ForConditionalGeneration: Pixtral ViT + patch merger + Mistral
decoder) checkpoints, built offline with the transformers config classes + save_pretrained, a
trained tokenizer with Pixtral's special tokens, PixtralProcessor + PixtralImageProcessorPil and a
Mistral-style chat template."""
from __future__ import annotations

import json
import os
from pathlib import Path

from tiny_checkpoints import train_tokenizer

# Mistral's [INST] format with image parts as [IMG] (the processor expands each one).
MISTRAL3_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] == 'user' %}[INST]"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}[IMG]{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}[/INST]"
    "{% elif message['role'] == 'assistant' %}{{ message['content'] }}{{ eos_token }}"
    "{% endif %}{% endfor %}"
)

SPECIALS = ["[IMG]", "[IMG_BREAK]", "[IMG_END]", "[INST]", "[/INST]"]


def build_mistral3(out_dir: str | os.PathLike, *, variant: str = "merge2", seed: int = 0) -> Path:
    """variant "merge2": patch 8, spatial_merge_size 2 (tokens per 16x16 pixels), longest_edge 96,
        vision_feature_layer -1, tied embeddings (transformers' default for Mistral 3: no lm_head
        in the file), no projector bias, GQA decoder.
    variant "merge1": patch 6, spatial_merge_size 1, longest_edge 60, vision_feature_layer 1 (the
        first block's output of 3), untied lm_head, projector bias, gelu_pytorch_tanh projector,
        silu vision MLP, MHA decoder with rope_theta 1e6.
    variant "llava": Pixtral-12B's layout, LlavaForConditionalGeneration with a Pixtral tower
        (patch 8, longest_edge 64, no merger, 'full' feature strategy, projector bias), MQA decoder.
    """
    import torch
    from transformers import (LlavaConfig, LlavaForConditionalGeneration, Mistral3Config,
                              Mistral3ForConditionalGeneration, MistralConfig, PixtralVisionConfig)
    from transformers.models.pixtral.image_processing_pil_pixtral import PixtralImageProcessorPil
    PixtralProcessor = pixtral_processor_class()

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    tok = train_tokenizer(SPECIALS)
    tok.chat_template = MISTRAL3_CHAT_TEMPLATE
    ids = {t: tok.convert_tokens_to_ids(t) for t in SPECIALS}
    common = dict(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  max_position_embeddings=2048, rms_norm_eps=1e-5, head_dim=16, sliding_window=None,
                  bos_token_id=1, eos_token_id=2, pad_token_id=3)
    if variant == "merge2":
        vision = PixtralVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                                     patch_size=8, image_size=96, hidden_act="gelu",
                                     rope_parameters={"rope_type": "axial", "rope_theta": 10000.0})
        text = MistralConfig(**common, num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
                             rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
        cfg = Mistral3Config(vision_config=vision, text_config=text, image_token_index=ids["[IMG]"],
                             spatial_merge_size=2, vision_feature_layer=-1, multimodal_projector_bias=False,
                             projector_hidden_act="gelu", tie_word_embeddings=True)
        patch, merge, longest = 8, 2, 96
    elif variant == "merge1":
        vision = PixtralVisionConfig(hidden_size=48, intermediate_size=64, num_hidden_layers=3, num_attention_heads=3,
                                     patch_size=6, image_size=60, hidden_act="silu",
                                     rope_parameters={"rope_type": "axial", "rope_theta": 1000.0})
        text = MistralConfig(**common, num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=False,
                             rope_parameters={"rope_type": "default", "rope_theta": 1e6})
        cfg = Mistral3Config(vision_config=vision, text_config=text, image_token_index=ids["[IMG]"],
                             spatial_merge_size=1, vision_feature_layer=1, multimodal_projector_bias=True,
                             projector_hidden_act="gelu_pytorch_tanh", tie_word_embeddings=False)
        patch, merge, longest = 6, 1, 60
    elif variant == "llava":
        vision = PixtralVisionConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2,
                                     patch_size=8, image_size=64, hidden_act="gelu",
                                     rope_parameters={"rope_type": "axial", "rope_theta": 10000.0})
        text = MistralConfig(**common, num_attention_heads=4, num_key_value_heads=1, tie_word_embeddings=False,
                             rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
        cfg = LlavaConfig(vision_config=vision, text_config=text, image_token_index=ids["[IMG]"],
                          vision_feature_layer=-1, vision_feature_select_strategy="full",
                          projector_hidden_act="gelu", multimodal_projector_bias=True)
        patch, merge, longest = 8, 1, 64
    else:
        raise ValueError(variant)
    model = (LlavaForConditionalGeneration if variant == "llava" else Mistral3ForConditionalGeneration)(cfg).eval()
    with torch.no_grad():  # RMSNorm weights start at 1: perturb everything so no weight is trivial
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    model.save_pretrained(out, safe_serialization=True)
    ip = PixtralImageProcessorPil(size={"longest_edge": longest}, patch_size={"height": patch, "width": patch})
    PixtralProcessor(image_processor=ip, tokenizer=tok, patch_size=patch, spatial_merge_size=merge,
                     chat_template=MISTRAL3_CHAT_TEMPLATE).save_pretrained(out)
    (out / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 3}))
    return out


def pixtral_processor_class():
    """transformers' PixtralProcessor class. Its module imports the torchvision image processor
    only for `get_resize_output_image_size`, which the PIL processor module defines identically;
    without a working torchvision that import is served from the PIL module (test-only shim)."""
    import sys
    import types
    try:
        from transformers.models.pixtral.processing_pixtral import PixtralProcessor
    except ImportError:
        from transformers.models.pixtral import image_processing_pil_pixtral as pil
        shim = types.ModuleType("transformers.models.pixtral.image_processing_pixtral")
        shim.get_resize_output_image_size = pil.get_resize_output_image_size
        sys.modules[shim.__name__] = shim
        from transformers.models.pixtral.processing_pixtral import PixtralProcessor
    return PixtralProcessor


def hf_processor(path):
    """The checkpoint's PixtralProcessor with the PIL image processor (torchvision-free)."""
    from transformers import AutoTokenizer
    from transformers.models.pixtral.image_processing_pil_pixtral import PixtralImageProcessorPil
    PixtralProcessor = pixtral_processor_class()

    proc_cfg = json.loads((Path(path) / "processor_config.json").read_text())
    ip = PixtralImageProcessorPil.from_pretrained(path)
    return PixtralProcessor(image_processor=ip, tokenizer=AutoTokenizer.from_pretrained(path),
                            patch_size=proc_cfg["patch_size"], spatial_merge_size=proc_cfg["spatial_merge_size"])
