"""Tiny random-weight Qwen2-VL / Qwen2.5-VL checkpoints built offline (transformers config classes
+ save_pretrained), plus a stand-in for Qwen2VLProcessor's text expansion.

The real processor cannot be constructed without torchvision (video processor mapping, see
/work/shared/notes/facts.md), so tokenizer and image processor are saved separately and
`hf_processor_inputs` reproduces Qwen2VLProcessor.__call__ for images: every `<|image_pad|>` is
replaced by grid_t*grid_h*grid_w // merge_size**2 copies, then the tokenizer runs, and
mm_token_type_ids marks image tokens with 1.

Geometry is the real one (patch 14, merge 2, temporal patch 2, default min/max pixels), so the
token counts of real-world image sizes (4K included) are those of the released models.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

QWEN_SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
                "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>"]

QWEN_WORDS = (
    "system user assistant You are a helpful assistant . Describe this image in detail . What is "
    "in the picture ? How many objects are there ? Compare the two images . left right top bottom "
    "red green blue yellow cat dog car tree house sky water road one two three four five six seven "
    "eight nine ten yes no the a an of to is it and with on for that hello world café 東京 😀 "
    "0 1 2 3 4 5 6 7 8 9 , : ; ( ) ' \" - \n"
).split(" ")

# The Qwen2-VL chat template (image and video parts, as released; add_vision_id numbering).
QWEN_CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}"
    "{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}"
    "{% if add_vision_id %}Picture {{ image_count.value }}: {% endif %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}"
    "{% set video_count.value = video_count.value + 1 %}"
    "{% if add_vision_id %}Video {{ video_count.value }}: {% endif %}"
    "<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}"
    "{% endfor %}<|im_end|>\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


TINY_VIDEO_PROCESSOR = {
    "video_processor_type": "Qwen2VLVideoProcessor", "processor_class": "Qwen2VLProcessor",
    "size": {"shortest_edge": 56 * 56, "longest_edge": 28 * 28 * 16}, "patch_size": 14,
    "temporal_patch_size": 2, "merge_size": 2, "min_frames": 4, "max_frames": 768, "fps": 2.0,
    "do_sample_frames": True, "do_resize": True, "resample": 3, "do_rescale": True,
    "rescale_factor": 1 / 255, "do_normalize": True, "do_convert_rgb": True,
    "image_mean": [0.48145466, 0.4578275, 0.40821073], "image_std": [0.26862954, 0.26130258, 0.27577711],
}


def train_qwen_tokenizer(vocab_size: int = 480):
    """Byte-level BPE (no BOS, like Qwen's tokenizer) with the Qwen special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=QWEN_SPECIAL,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    words = [w for w in QWEN_WORDS if w]
    corpus = [" ".join(words[i:] + words[:i]) for i in range(len(words))]
    tok.train_from_iterator(corpus, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   additional_special_tokens=QWEN_SPECIAL[1:])


def build_qwen(out_dir: str | os.PathLike, *, family: str = "qwen2_vl", seed: int = 0,
               text_overrides: dict | None = None, vision_overrides: dict | None = None) -> Path:
    """Tiny checkpoint. family "qwen2_vl": LayerNorm/quick_gelu vision blocks, full attention;
    "qwen2_5_vl": RMSNorm/SwiGLU vision blocks, 112-px windows with full attention in blocks 1, 3.
    text_overrides: text config fields replaced (e.g. more heads for tensor-parallel tests);
    vision_overrides: the vision config replaced (benchmarks/gpu.py: the released tower's size)."""
    import torch
    from transformers import Qwen2VLImageProcessorPil

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    tokenizer = train_qwen_tokenizer()
    tokenizer.chat_template = QWEN_CHAT_TEMPLATE
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in QWEN_SPECIAL}
    vocab = len(tokenizer)
    text = dict(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=8192,
                rms_norm_eps=1e-6, rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                    "mrope_section": [2, 3, 3]},
                bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|im_end|>"],
                pad_token_id=ids["<|endoftext|>"])
    text.update(text_overrides or {})
    tokens = dict(image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
                  vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"])
    if family == "qwen2_vl":
        from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration
        vision = dict(depth=2, embed_dim=32, hidden_size=64, num_heads=2, mlp_ratio=2,
                      hidden_act="quick_gelu", patch_size=14, spatial_merge_size=2, temporal_patch_size=2)
        cfg = Qwen2VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=False, **tokens)
        model = Qwen2VLForConditionalGeneration(cfg)
    elif family == "qwen2_5_vl":
        from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration
        vision = dict(depth=4, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=64,
                      hidden_act="silu", patch_size=14, spatial_merge_size=2, temporal_patch_size=2,
                      window_size=112, fullatt_block_indexes=[1, 3], tokens_per_second=3)
        cfg = Qwen2_5_VLConfig(text_config=text, vision_config=vision_overrides or vision, tie_word_embeddings=False,
                               **tokens)
        model = Qwen2_5_VLForConditionalGeneration(cfg)
    else:
        raise ValueError(family)
    model = model.eval()
    # Random init leaves norms at 1 and biases at 0: perturb everything so parity cannot pass by
    # symmetry.
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    Qwen2VLImageProcessorPil().save_pretrained(out)  # default min/max pixels (56*56, 28*28*1280)
    # Qwen2VLVideoProcessor.save_pretrained needs torchvision: write what it writes (small frames
    # so the test videos stay a few dozen tokens; 2 fps sampling as qwen-vl-utils).
    (out / "video_preprocessor_config.json").write_text(json.dumps(TINY_VIDEO_PROCESSOR, indent=2))
    gen = {"bos_token_id": text["bos_token_id"], "eos_token_id": text["eos_token_id"],
           "pad_token_id": text["pad_token_id"]}
    (out / "generation_config.json").write_text(json.dumps(gen))
    return out


def hf_processor_inputs(tokenizer, image_processor, prompt: str, images=(), videos=None, **image_kwargs) -> dict:
    """Qwen2VLProcessor.__call__ for text + images (return_tensors="pt"), without constructing it.
    videos: the video processor's output {"pixel_values_videos", "video_grid_thw"[,
    "second_per_grid_ts"]} (tests/test_video.py builds it); each <|video_pad|> is expanded the
    same way and its tokens get mm_token_type_ids 2."""
    import torch

    out = {}
    if videos is not None:
        out.update(videos)
        counts = [int(g.prod()) // 4 for g in videos["video_grid_thw"]]
        parts = prompt.split("<|video_pad|>")
        assert len(parts) == len(counts) + 1, "one <|video_pad|> per video"
        prompt = parts[0] + "".join("<|video_pad|>" * n + p for n, p in zip(counts, parts[1:]))
    if images:
        img = image_processor(list(images), return_tensors="pt", **image_kwargs)
        out["pixel_values"] = img["pixel_values"]
        out["image_grid_thw"] = img["image_grid_thw"]
        merge = image_processor.merge_size ** 2
        counts = [int(g.prod()) // merge for g in img["image_grid_thw"]]
        parts = prompt.split("<|image_pad|>")
        assert len(parts) == len(counts) + 1, "one <|image_pad|> per image"
        prompt = parts[0] + "".join("<|image_pad|>" * n + p for n, p in zip(counts, parts[1:]))
    enc = tokenizer(prompt, return_tensors="pt")
    out["input_ids"] = enc["input_ids"]
    out["attention_mask"] = enc["attention_mask"]
    image_id = tokenizer.convert_tokens_to_ids("<|image_pad|>")
    video_id = tokenizer.convert_tokens_to_ids("<|video_pad|>")
    out["mm_token_type_ids"] = ((enc["input_ids"] == image_id).to(torch.int32)
                                + 2 * (enc["input_ids"] == video_id).to(torch.int32))
    return out


def hf_vision_features(model, pixel_values, grid_thw) -> list[np.ndarray]:
    """transformers' merged image features, one [tokens, hidden] array per image."""
    import torch

    with torch.no_grad():
        feats = model.model.get_image_features(pixel_values=pixel_values, image_grid_thw=grid_thw)
    feats = feats.pooler_output if hasattr(feats, "pooler_output") else feats
    return [f.numpy() for f in feats]
