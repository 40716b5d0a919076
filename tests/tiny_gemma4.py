"""Tiny random-weight Gemma 4 checkpoints built offline (transformers config classes +
save_pretrained, a trained tokenizer with Gemma 4's special tokens, Gemma4Processor saved with
save_pretrained), and helpers that run transformers' own processor and model on them.

Gemma4Processor wants a video processor, and transformers 5.23's Gemma4VideoProcessor needs
torchvision (not installed here): `TinyGemma4Processor` is Gemma4Processor with the video
processor left out (its class check skipped for None, and not saved); every image and text path is
Gemma4Processor's own code.

Variants (both: vision tower with pooling 2, patch 4, max_soft_tokens 70 = up to 280 patches per
image; sliding window 12 < an image's run of soft tokens; final logit soft-capping; bidirectional
attention over vision tokens; tied embeddings as transformers saves them, i.e. no lm_head tensor):

- "dense": per-layer input embeddings, 5 layers [s, s, f, s, f] with the last 2 sharing KV
  (num_kv_shared_layers=2), attention_k_eq_v (full layers: v = k, 1 global KV head of width 32),
  double-wide MLP in the KV-shared layers, proportional RoPE on full layers, vision clipped linears.
- "moe": MoE block (4 experts, top 2) beside the dense MLP in every layer, no PLE, no KV sharing,
  separate v_proj, vision `standardize`.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

from tiny_checkpoints import train_tokenizer

GEMMA4_SPECIAL = ["<|image|>", "<|image>", "<image|>", "<|audio|>", "<|audio>", "<audio|>", "<|video|>",
                  "<|turn>", "<turn|>"]

# Gemma 4's turn format reduced to text and images: an image part renders the image placeholder,
# which the processor replaces by <|image> + soft tokens + <image|>.
GEMMA4_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "<|turn>{{ role }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<|image|>{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<turn|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|turn>model\n{% endif %}"
)


def _processor_class():
    from transformers import Gemma4Processor

    class TinyGemma4Processor(Gemma4Processor):
        """Gemma4Processor without a video processor (see the module docstring)."""
        saving = False

        def check_argument_for_proper_class(self, name, arg):
            if name == "video_processor" and arg is None:
                return None
            return super().check_argument_for_proper_class(name, arg)

        @classmethod
        def get_attributes(cls):
            attrs = super().get_attributes()
            return [a for a in attrs if a != "video_processor"] if cls.saving else attrs

    return TinyGemma4Processor


def make_processor(tokenizer, image_processor, chat_template=GEMMA4_CHAT_TEMPLATE):
    from transformers.models.gemma4.feature_extraction_gemma4 import Gemma4AudioFeatureExtractor
    cls = _processor_class()
    return cls(feature_extractor=Gemma4AudioFeatureExtractor(), image_processor=image_processor,
               tokenizer=tokenizer, video_processor=None, chat_template=chat_template,
               image_seq_length=image_processor.max_soft_tokens)


def load_processor(path):
    """The saved processor, rebuilt from its saved parts (tokenizer, image processor, template)."""
    from transformers import Gemma4ImageProcessorPil, PreTrainedTokenizerFast
    tok = PreTrainedTokenizerFast.from_pretrained(path)
    ip = Gemma4ImageProcessorPil.from_pretrained(path)
    return make_processor(tok, ip, (Path(path) / "chat_template.jinja").read_text())


def gemma4_tokenizer():
    from transformers import PreTrainedTokenizerFast
    base = train_tokenizer(GEMMA4_SPECIAL, vocab_size=420)
    return PreTrainedTokenizerFast(
        tokenizer_object=base._tokenizer, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
        pad_token="<pad>",
        extra_special_tokens={"image_token": "<|image|>", "boi_token": "<|image>", "eoi_token": "<image|>",
                              "audio_token": "<|audio|>", "boa_token": "<|audio>", "eoa_token": "<audio|>"})


def build_gemma4(out_dir: str | os.PathLike, *, variant: str = "dense", seed: int = 0) -> Path:
    import torch
    from transformers import Gemma4Config, Gemma4ForConditionalGeneration, Gemma4ImageProcessorPil

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    tok = gemma4_tokenizer()
    ids = {t: tok.convert_tokens_to_ids(t) for t in GEMMA4_SPECIAL}
    vocab = len(tok)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                  num_key_value_heads=2, head_dim=16, patch_size=4, pooling_kernel_size=2,
                  position_embedding_size=160, rms_norm_eps=1e-6,
                  rope_parameters={"rope_type": "axial", "rope_theta": 100.0},
                  use_clipped_linears=variant == "dense", standardize=variant == "moe")
    text = dict(vocab_size=vocab, hidden_size=64, intermediate_size=96, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, global_head_dim=32, sliding_window=12,
                max_position_embeddings=4096, rms_norm_eps=1e-6, final_logit_softcapping=30.0,
                use_bidirectional_attention="vision", pad_token_id=3, bos_token_id=1, eos_token_id=2,
                initializer_range=0.08,
                rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                 "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                                    "rope_theta": 1000000.0}})
    if variant == "dense":
        text.update(num_hidden_layers=5, layer_types=["sliding_attention", "sliding_attention", "full_attention",
                                                      "sliding_attention", "full_attention"],
                    num_kv_shared_layers=2, attention_k_eq_v=True, num_global_key_value_heads=1,
                    use_double_wide_mlp=True, hidden_size_per_layer_input=8, vocab_size_per_layer_input=vocab)
    elif variant == "moe":
        text.update(num_hidden_layers=3, layer_types=["sliding_attention", "full_attention", "full_attention"],
                    enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=24,
                    hidden_size_per_layer_input=0, attention_k_eq_v=False)
    else:
        raise ValueError(variant)
    cfg = Gemma4Config(text_config=text, vision_config=vision, audio_config=None,
                       boi_token_id=ids["<|image>"], eoi_token_id=ids["<image|>"], image_token_id=ids["<|image|>"],
                       video_token_id=ids["<|video|>"], boa_token_id=ids["<|audio>"],
                       eoa_token_index=ids["<audio|>"], audio_token_id=ids["<|audio|>"],
                       initializer_range=0.08, tie_word_embeddings=True)
    model = Gemma4ForConditionalGeneration(cfg).eval()
    # Random init leaves norms at 1, layer scalars at 1, position tables at 1: perturb every
    # parameter and buffer that is saved so parity cannot pass by symmetry.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or "scale" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            else:
                p.add_(torch.randn_like(p) * 0.02)
        for name, b in model.named_buffers():
            if name.endswith("layer_scalar"):
                b.copy_(0.8 + 0.4 * torch.rand_like(b))
            elif name.endswith(("input_min", "output_min")):
                b.fill_(-0.25 if "output" in name else -0.9)
            elif name.endswith(("input_max", "output_max")):
                b.fill_(0.25 if "output" in name else 0.9)
            elif name.endswith("std_bias"):
                b.copy_(0.1 * torch.randn_like(b))
            elif name.endswith("std_scale"):
                b.copy_(1.0 + 0.2 * torch.randn_like(b))
    model.save_pretrained(out, safe_serialization=True)
    ip = Gemma4ImageProcessorPil(patch_size=4, pooling_kernel_size=2, max_soft_tokens=70)
    proc = make_processor(tok, ip)
    type(proc).saving = True
    try:
        proc.save_pretrained(out)
    finally:
        type(proc).saving = False
    pc = json.loads((out / "processor_config.json").read_text())
    pc["processor_class"] = "Gemma4Processor"
    (out / "processor_config.json").write_text(json.dumps(pc, indent=2))
    tc = json.loads((out / "tokenizer_config.json").read_text())
    tc["processor_class"] = "Gemma4Processor"
    (out / "tokenizer_config.json").write_text(json.dumps(tc, indent=2))
    gen = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 3}
    (out / "generation_config.json").write_text(json.dumps(gen))
    return out


def hf_inputs(processor, prompt: str, images=()) -> dict:
    """Gemma4Processor(text, images) as torch tensors (one sequence)."""
    kw = {"images": [list(images)]} if images else {}
    return dict(processor(text=[prompt], return_tensors="pt", **kw))


def hf_image_features(model, pixel_values, position_ids) -> list[np.ndarray]:
    """transformers' image features after the embedder, one [tokens, text_hidden] array per image."""
    import torch
    with torch.no_grad():
        out = model.model.get_image_features(pixel_values, position_ids, return_dict=True)
    return [f.numpy() for f in out.pooler_output]
