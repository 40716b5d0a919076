"""Tiny random-weight Qwen3.5 (dense) and Qwen3.5-MoE checkpoints built offline (transformers
config classes + save_pretrained), served by the family's own processor: transformers maps
qwen3_5 to Qwen3VLProcessor (Qwen2VLImageProcessor, Qwen3VLVideoProcessor), so tests/tiny_qwen3.py's
`hf_processor` and `torchvision_stand_in` apply unchanged; the tokenizer and chat template are
tiny_qwen's (the hub's Qwen3.5 template cannot be fetched offline).

Decoder: 4 layers, the default layer pattern (3 Gated DeltaNet layers, then full attention),
head_dim 32 with the default partial_rotary_factor 0.25 (8 rotary dims, mrope_section [2, 1, 1]),
linear attention with 2 key heads serving 4 value heads (the grouped path), conv kernel 4. MoE:
8 experts top-2 with the shared expert in every layer, tied embeddings. Every weight is perturbed
(norms start at zero, dt_bias at one) so parity cannot pass by symmetry.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

from tiny_qwen import QWEN_CHAT_TEMPLATE, QWEN_SPECIAL, train_qwen_tokenizer
from tiny_qwen3 import MAX_PIXELS, MIN_PIXELS, VIDEO, hf_processor, torchvision_stand_in  # noqa: F401


def qwen35_pretokenizer(tokenizer) -> None:
    """Qwen3_5Tokenizer's NFC normaliser and split regex (single digits) on the trained tokenizer:
    transformers builds a qwen3_5 checkpoint's tokenizer with them whatever tokenizer.json says, so
    the file must say the same (as the hub's does)."""
    from tokenizers import Regex, normalizers, pre_tokenizers
    from transformers.models.qwen3_5.tokenization_qwen3_5 import PRETOKENIZE_REGEX
    bt = tokenizer.backend_tokenizer
    bt.normalizer = normalizers.NFC()
    bt.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])


def build_qwen35(out_dir: str | os.PathLike, *, kind: str = "dense", seed: int = 0,
                 text_overrides: dict | None = None) -> Path:
    """kind "dense": Qwen3_5ForConditionalGeneration; "moe": Qwen3_5MoeForConditionalGeneration
    (module docstring). text_overrides: text config fields replaced (benchmarks/qwen35_hybrid.py:
    larger sizes, every layer full attention for the dense peer)."""
    import torch
    from transformers import Qwen2VLImageProcessorPil
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    tokenizer = train_qwen_tokenizer()
    tokenizer.chat_template = QWEN_CHAT_TEMPLATE
    qwen35_pretokenizer(tokenizer)
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in QWEN_SPECIAL}
    text = dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=8192,
                rms_norm_eps=1e-6, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                linear_value_head_dim=8, linear_conv_kernel_dim=4,
                rope_parameters={"rope_type": "default", "rope_theta": 5000.0, "mrope_section": [2, 1, 1],
                                 "mrope_interleaved": True, "partial_rotary_factor": 0.25},
                bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|im_end|>"], pad_token_id=ids["<|endoftext|>"])
    text.update(text_overrides or {})
    vision = dict(depth=2, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=64,
                  hidden_act="gelu_pytorch_tanh", patch_size=16, spatial_merge_size=2, temporal_patch_size=2,
                  num_position_embeddings=16)
    vision["out_hidden_size"] = text["hidden_size"]
    tokens = dict(image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
                  vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"])
    if kind == "dense":
        from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration
        cfg = Qwen3_5Config(text_config=text, vision_config=vision, tie_word_embeddings=False, **tokens)
        model = Qwen3_5ForConditionalGeneration(cfg)
    elif kind == "moe":
        from transformers import Qwen3_5MoeConfig, Qwen3_5MoeForConditionalGeneration
        cfg = Qwen3_5MoeConfig(text_config={**text, "num_experts": 8, "num_experts_per_tok": 2,
                                            "moe_intermediate_size": 48, "shared_expert_intermediate_size": 32,
                                            "initializer_range": 0.1},
                               vision_config=vision, tie_word_embeddings=True, **tokens)
        model = Qwen3_5MoeForConditionalGeneration(cfg)
    else:
        raise ValueError(kind)
    model = model.eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    Qwen2VLImageProcessorPil(patch_size=16, merge_size=2, temporal_patch_size=2, image_mean=[0.5] * 3,
                             image_std=[0.5] * 3,
                             size={"shortest_edge": MIN_PIXELS, "longest_edge": MAX_PIXELS}).save_pretrained(out)
    Qwen3VLVideoProcessor(**VIDEO[kind]).save_pretrained(out)
    gen = {"bos_token_id": text["bos_token_id"], "eos_token_id": text["eos_token_id"],
           "pad_token_id": text["pad_token_id"]}
    (out / "generation_config.json").write_text(json.dumps(gen))
    return out
