"""Tiny random-weight GLM-4.xV checkpoints built offline (transformers config classes +
save_pretrained), and the real Glm4vProcessor over their tokenizer and image processor.

Kinds: "dense" (Glm4vForConditionalGeneration: GLM-4.1V's dense decoder with post-norms),
"moe" (Glm4vMoeForConditionalGeneration: GLM-4.5V's decoder, a dense first layer then MoE layers
with a shared expert, 8 experts in 4 groups, top-2 of the best 2 groups), "46v"
(Glm46VForConditionalGeneration over a dense text config). Geometry is the real one (patch 14,
merge 2, temporal patch 2, CLIP mean / std, bicubic resize); the pixel bounds are small to keep
the tests fast. The tokenizer is a byte-level BPE with GLM's special tokens and a chat template
written as GLM-4.1V's (`[gMASK]<sop>`, `<|user|>`, `<|begin_of_image|><|image|><|end_of_image|>`).

Glm4vProcessor's constructor checks its video processor's class, which demands torchvision here
(not installable); `hf_processor` skips only that check, so the text expansion, pixel values,
grids and mm_token_type_ids are the processor's own. Videos: the checkpoints carry a
Glm4vVideoProcessor config (Glm46VVideoProcessor's for "46v"), run as transformers' own code inside
tiny_qwen3.torchvision_stand_in (only the torchvision calls replaced by the torch code they run).
"""
from __future__ import annotations

import json
import os
from pathlib import Path

GLM_SPECIAL = ["<|endoftext|>", "[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>",
               "<|begin_of_image|>", "<|end_of_image|>", "<|begin_of_video|>", "<|end_of_video|>",
               "<|image|>", "<|video|>"]

GLM_CHAT_TEMPLATE = (
    "[gMASK]<sop>"
    "{%- for msg in messages %}"
    "{%- if msg.role == 'system' %}<|system|>{{ '\n' }}{{ msg.content }}"
    "{%- elif msg.role == 'user' %}<|user|>{{ '\n' }}"
    "{%- if msg.content is string %}{{ msg.content }}"
    "{%- else %}{%- for item in msg.content %}"
    "{%- if item.type == 'video' or 'video' in item %}<|begin_of_video|><|video|><|end_of_video|>"
    "{%- elif item.type == 'image' or 'image' in item %}<|begin_of_image|><|image|><|end_of_image|>"
    "{%- elif item.type == 'text' %}{{ item.text }}{%- endif %}"
    "{%- endfor %}{%- endif %}"
    "{%- elif msg.role == 'assistant' %}<|assistant|>{{ '\n' }}{{ msg.content }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

MIN_PIXELS, MAX_PIXELS = 2 * 28 * 28 * 4, 2 * 28 * 28 * 80   # 4 .. 80 merged tokens (two frames)
# the video size range bounds all sampled frames together (t * h * w)
VIDEO_SIZE = {"shortest_edge": 28 * 28 * 8, "longest_edge": 28 * 28 * 96}


def train_glm_tokenizer(vocab_size: int = 480):
    """Byte-level BPE with GLM's special tokens (no BOS: the template writes [gMASK]<sop>)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from tiny_qwen import QWEN_WORDS
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=GLM_SPECIAL,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    words = [w for w in QWEN_WORDS if w]
    tok.train_from_iterator([" ".join(words[i:] + words[:i]) for i in range(len(words))], trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>",
                                   additional_special_tokens=GLM_SPECIAL[1:])


def build_glm4v(out_dir: str | os.PathLike, *, kind: str = "dense", seed: int = 0) -> Path:
    """A tiny checkpoint of `kind` (module docstring): vision 2 blocks of width 32 (2 heads, a 4x4
    position table: image_size 56), text hidden 64, 4 heads / 2 KV heads of 16, partial rotary
    0.5 with mrope_section [1, 1, 2], untied head; every weight perturbed."""
    import torch
    from transformers import Glm4vImageProcessorPil

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    tokenizer = train_glm_tokenizer()
    tokenizer.chat_template = GLM_CHAT_TEMPLATE
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in GLM_SPECIAL}
    text = dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=96, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=8192, rms_norm_eps=1e-5,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [1, 1, 2],
                                 "partial_rotary_factor": 0.5},
                eos_token_id=ids["<|endoftext|>"], pad_token_id=ids["<|endoftext|>"])
    vision = dict(depth=2, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=64,
                  hidden_act="silu", patch_size=14, spatial_merge_size=2, temporal_patch_size=2, image_size=56,
                  attention_bias=True, rms_norm_eps=1e-5)
    tokens = dict(image_token_id=ids["<|image|>"], video_token_id=ids["<|video|>"],
                  image_start_token_id=ids["<|begin_of_image|>"], image_end_token_id=ids["<|end_of_image|>"],
                  video_start_token_id=ids["<|begin_of_video|>"], video_end_token_id=ids["<|end_of_video|>"])
    if kind == "dense":
        from transformers import Glm4vConfig, Glm4vForConditionalGeneration
        cfg = Glm4vConfig(text_config={**text, "num_hidden_layers": 2}, vision_config=vision,
                          tie_word_embeddings=False, **tokens)
        model = Glm4vForConditionalGeneration(cfg)
    elif kind == "moe":
        from transformers import Glm4vMoeConfig, Glm4vMoeForConditionalGeneration
        cfg = Glm4vMoeConfig(text_config={**text, "num_hidden_layers": 3, "n_routed_experts": 8,
                                          "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                                          "n_shared_experts": 1, "n_group": 4, "topk_group": 2,
                                          "first_k_dense_replace": 1, "routed_scaling_factor": 1.5,
                                          "norm_topk_prob": True, "attention_bias": True},
                             vision_config=vision, tie_word_embeddings=False, **tokens)
        model = Glm4vMoeForConditionalGeneration(cfg)
    elif kind == "46v":
        from transformers import Glm46VConfig, Glm46VForConditionalGeneration
        cfg = Glm46VConfig(text_config={**text, "model_type": "glm4v_text", "num_hidden_layers": 2},
                           vision_config={**vision, "model_type": "glm4v_vision"}, tie_word_embeddings=False,
                           **tokens)
        model = Glm46VForConditionalGeneration(cfg)
    else:
        raise ValueError(kind)
    model = model.eval()
    # Random init leaves norms at 1, biases and the router's correction bias at 0: perturb all
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.add_(torch.randn_like(b) * 0.05)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    Glm4vImageProcessorPil(size={"shortest_edge": MIN_PIXELS, "longest_edge": MAX_PIXELS}).save_pretrained(out)
    video_processor_class(kind)(size=VIDEO_SIZE).save_pretrained(out)
    gen = {"eos_token_id": text["eos_token_id"], "pad_token_id": text["pad_token_id"]}
    (out / "generation_config.json").write_text(json.dumps(gen))
    return out


def video_processor_class(kind: str):
    """The module's class (the top-level name is a dummy that demands torchvision)."""
    if kind == "46v":    # its module imports torchvision's functional for type annotations only
        import sys
        import types
        from unittest import mock
        stub = types.ModuleType("torchvision.transforms.v2.functional")
        names = ("torchvision", "torchvision.transforms", "torchvision.transforms.v2")
        with mock.patch.dict(sys.modules, {**{n: types.ModuleType(n) for n in names}, stub.__name__: stub}):
            sys.modules["torchvision.transforms.v2"].functional = stub
            from transformers.models.glm46v.video_processing_glm46v import Glm46VVideoProcessor
        return Glm46VVideoProcessor
    from transformers.models.glm4v.video_processing_glm4v import Glm4vVideoProcessor
    return Glm4vVideoProcessor


def hf_processor(path: str | os.PathLike, kind: str = "dense"):
    """The real Glm4vProcessor (Glm46VProcessor for "46v") over the checkpoint's tokenizer, image
    and video processors (module docstring)."""
    from unittest import mock

    from transformers import AutoTokenizer, Glm4vImageProcessorPil, Glm4vProcessor
    from transformers.models.glm46v.processing_glm46v import Glm46VProcessor
    from transformers.processing_utils import ProcessorMixin

    tok = AutoTokenizer.from_pretrained(path)
    ip = Glm4vImageProcessorPil.from_pretrained(path)
    vp = video_processor_class(kind).from_pretrained(path)
    cls = Glm46VProcessor if kind == "46v" else Glm4vProcessor
    with mock.patch.object(ProcessorMixin, "check_argument_for_proper_class", lambda self, name, arg: None):
        return cls(image_processor=ip, tokenizer=tok, video_processor=vp, chat_template=tok.chat_template)
