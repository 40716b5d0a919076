"""Tiny random Gemma 3 (Gemma3ForConditionalGeneration) checkpoints, built offline with the
transformers config classes + save_pretrained, a trained tokenizer with Gemma's special tokens,
Gemma3Processor + Gemma3ImageProcessorPil, and Gemma 3's chat template."""
from __future__ import annotations

import json
import os
from pathlib import Path

from tiny_checkpoints import train_tokenizer

# Gemma 3's chat template (google/gemma-3-4b-it), verbatim.
GEMMA3_CHAT_TEMPLATE = (
    "{{ bos_token }}\n"
    "{%- if messages[0]['role'] == 'system' -%}\n"
    "    {%- if messages[0]['content'] is string -%}\n"
    "        {%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}\n"
    "    {%- else -%}\n"
    "        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\n\n' -%}\n"
    "    {%- endif -%}\n"
    "    {%- set loop_messages = messages[1:] -%}\n"
    "{%- else -%}\n"
    "    {%- set first_user_prefix = \"\" -%}\n"
    "    {%- set loop_messages = messages -%}\n"
    "{%- endif -%}\n"
    "{%- for message in loop_messages -%}\n"
    "    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}\n"
    "        {{ raise_exception(\"Conversation roles must alternate user/assistant/user/assistant/...\") }}\n"
    "    {%- endif -%}\n"
    "    {%- if (message['role'] == 'assistant') -%}\n"
    "        {%- set role = \"model\" -%}\n"
    "    {%- else -%}\n"
    "        {%- set role = message['role'] -%}\n"
    "    {%- endif -%}\n"
    "    {{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else \"\") }}\n"
    "    {%- if message['content'] is string -%}\n"
    "        {{ message['content'] | trim }}\n"
    "    {%- elif message['content'] is iterable -%}\n"
    "        {%- for item in message['content'] -%}\n"
    "            {%- if item['type'] == 'image' -%}\n"
    "                {{ '<start_of_image>' }}\n"
    "            {%- elif item['type'] == 'text' -%}\n"
    "                {{ item['text'] | trim }}\n"
    "            {%- endif -%}\n"
    "        {%- endfor -%}\n"
    "    {%- else -%}\n"
    "        {{ raise_exception(\"Invalid content type\") }}\n"
    "    {%- endif -%}\n"
    "    {{ '<end_of_turn>\n' }}\n"
    "{%- endfor -%}\n"
    "{%- if add_generation_prompt -%}\n"
    "    {{'<start_of_turn>model\n'}}\n"
    "{%- endif -%}\n"
)

SPECIALS = ["<start_of_image>", "<end_of_image>", "<image_soft_token>", "<start_of_turn>", "<end_of_turn>"]


def build_gemma3(out_dir: str | os.PathLike, *, variant: str = "window", seed: int = 0, noise: float | None = None,
                 embed_scale: float = 0.1) -> Path:
    """variant "window": 56 px images (8x8 patches of 7) pooled to 16 soft tokens, sliding
        window 8 (shorter than an image and the prompts), layer_types sliding/full mixed, tied
        embeddings (no lm_head in the file, as transformers saves them), query_pre_attn_scalar
        != head_dim, pan-and-scan off by default (min crop 20 px, up to 3 crops).
    variant "softcap": 28 px images pooled to 4 tokens, default layer pattern (5 sliding : 1
        full, window 12), untied lm_head, final/attn logit softcapping set, linear RoPE scaling
        on global layers (pan-and-scan off by default, as the processor: its class defaults
        override the image processor config; tests pass the crop settings explicitly).
    """
    import torch
    from transformers import (Gemma3Config, Gemma3ForConditionalGeneration, Gemma3Processor, Gemma3TextConfig,
                              PreTrainedTokenizerFast, SiglipVisionConfig)
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    base = train_tokenizer(SPECIALS)
    tok = PreTrainedTokenizerFast(tokenizer_object=base.backend_tokenizer, bos_token="<s>", eos_token="</s>",
                                  unk_token="<unk>", pad_token="<pad>",
                                  extra_special_tokens={"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>",
                                                        "image_token": "<image_soft_token>"})
    tok.chat_template = GEMMA3_CHAT_TEMPLATE
    ids = {t: tok.convert_tokens_to_ids(t) for t in SPECIALS}
    common = dict(vocab_size=len(tok), hidden_size=64, intermediate_size=96, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, max_position_embeddings=1024, rms_norm_eps=1e-6,
                  bos_token_id=1, eos_token_id=2, pad_token_id=3, initializer_range=0.08)
    if variant == "window":
        vision = SiglipVisionConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                                    image_size=56, patch_size=7, vision_use_head=False)
        text = Gemma3TextConfig(**common, num_hidden_layers=5, sliding_window=8, query_pre_attn_scalar=24,
                                layer_types=["sliding_attention", "full_attention", "sliding_attention",
                                             "sliding_attention", "full_attention"],
                                rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                                 "full_attention": {"rope_type": "default", "rope_theta": 1e6}},
                                tie_word_embeddings=True)
        mm, tie, size = 16, True, 56
        pas = dict(do_pan_and_scan=False, pan_and_scan_min_crop_size=20, pan_and_scan_max_num_crops=3,
                   pan_and_scan_min_ratio_to_activate=1.2)
    elif variant == "softcap":
        vision = SiglipVisionConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2,
                                    image_size=28, patch_size=7, vision_use_head=False)
        text = Gemma3TextConfig(**common, num_hidden_layers=6, sliding_window=12, query_pre_attn_scalar=16,
                                final_logit_softcapping=30.0, attn_logit_softcapping=50.0,
                                rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                                 "full_attention": {"rope_type": "linear", "factor": 8.0,
                                                                    "rope_theta": 1e6}},
                                tie_word_embeddings=False)
        mm, tie, size = 4, False, 28
        pas = dict(do_pan_and_scan=False, pan_and_scan_min_crop_size=14, pan_and_scan_max_num_crops=4,
                   pan_and_scan_min_ratio_to_activate=1.2)
    else:
        raise ValueError(variant)
    cfg = Gemma3Config(vision_config=vision, text_config=text, mm_tokens_per_image=mm,
                       boi_token_index=ids["<start_of_image>"], eoi_token_index=ids["<end_of_image>"],
                       image_token_index=ids["<image_soft_token>"], tie_word_embeddings=tie, initializer_range=0.08)
    noise = noise if noise is not None else {"window": 0.15, "softcap": 0.08}[variant]
    model = Gemma3ForConditionalGeneration(cfg).eval()
    with torch.no_grad():  # norms start at 0 and the projector at 0: perturb everything
        for p in model.parameters():
            p.add_(torch.randn_like(p) * noise)
        if tie:  # a tied head reads the (sqrt(hidden)-scaled) input embedding back: keep it small
            model.get_input_embeddings().weight.mul_(embed_scale)  # or greedy repeats the last token
    model.save_pretrained(out, safe_serialization=True)
    ip = Gemma3ImageProcessorPil(size={"height": size, "width": size}, **pas)
    Gemma3Processor(image_processor=ip, tokenizer=tok, image_seq_length=mm,
                    chat_template=GEMMA3_CHAT_TEMPLATE).save_pretrained(out)
    (out / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 3}))
    return out
