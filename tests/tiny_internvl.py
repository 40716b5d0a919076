"""Tiny random InternVL (InternVLForConditionalGeneration) checkpoints, built offline with the
transformers config classes + save_pretrained, a trained byte-level BPE tokenizer carrying
InternVL's tokens (`<img>`, `</img>`, `<IMG_CONTEXT>`, `<video>` named as the tokenizer's
start / end / context image tokens and video token), the real InternVLProcessor over
GotOcr2ImageProcessorPil, and the chat template transformers' conversion script writes.

InternVLVideoProcessor imports torchvision (not installable here): `hf_processor` imports it with
a stub torchvision module and runs it inside tiny_qwen3.torchvision_stand_in (the torch code the
torchvision calls run), so the video pixels and the `Frame{i}:` prompt are transformers' own.
The video processor config is written as that class saves it.
"""
from __future__ import annotations

import contextlib
import json
import os
import sys
import types
from pathlib import Path

# transformers' convert_internvl_weights_to_hf.py chat template, verbatim
INTERNVL_CHAT_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n'}}"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for content in message['content'] %}{% if content['type'] == 'image' %}{{ '<IMG_CONTEXT>\n' }}"
    "{% elif content['type'] == 'video' %}{{ '<video>\n' }}{% elif content['type'] == 'text' %}"
    "{{ content['text'] }}{% endif %}{% endfor %}{% endif %}{{'<|im_end|>\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{'<|im_start|>assistant\n' }}{% endif %}"
)
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<img>", "</img>", "<IMG_CONTEXT>", "<video>"]
WORDS = ("system user assistant Describe this image in detail . What is in the picture ? How many "
         "objects are there ? Compare the two images and the video . Frame left right red green blue cat dog "
         "car tree sky one two three yes no the a of to is it hello world café 東京 0 1 2 3 4 5 : , \n").split(" ")
CLIP_MEAN, CLIP_STD = [0.48145466, 0.4578275, 0.40821073], [0.26862954, 0.26130258, 0.27577711]

# variant -> (text model, vision tower, tile px, max_patches, video frames)
VARIANTS = {
    # InternVL 3: Qwen2 text (qkv bias), LayerNorm InternViT with mean pooling, tied embeddings,
    # 32-px tiles of 8x8 patches -> 16 tokens, up to 6 tiles + thumbnail
    "qwen2": dict(text=dict(model_type="qwen2", num_key_value_heads=2),
                  vision=dict(hidden_size=32, intermediate_size=64, num_attention_heads=2, image_size=32,
                              patch_size=4),
                  tile=32, max_patches=6, frames=4, tie=True),
    # InternVL 3.5: Qwen3-MoE text (QK-norm; layer 0 a dense MLP, layer 1 4 experts top-2, saved
    # one module per expert as the hub's files), RMSNorm InternViT with q/k norms, qkv bias and a
    # final layernorm (no mean pooling), untied head, 24-px tiles of 6x6 patches -> 9 tokens, up to 4 tiles
    "qwen3": dict(text=dict(model_type="qwen3_moe", num_key_value_heads=2, head_dim=16, num_experts=4,
                            num_experts_per_tok=2, moe_intermediate_size=32, decoder_sparse_step=1,
                            mlp_only_layers=[0]),
                  vision=dict(hidden_size=32, intermediate_size=48, num_attention_heads=4, image_size=24,
                              patch_size=4, norm_type="rms_norm", use_qk_norm=True, attention_bias=True,
                              use_mean_pooling=False),
                  tile=24, max_patches=4, frames=3, tie=False),
}


def train_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=420, special_tokens=SPECIAL, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    words = [w for w in WORDS if w]
    tok.train_from_iterator([" ".join(words[i:] + words[:i]) for i in range(len(words))], trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   extra_special_tokens={"start_image_token": "<img>", "end_image_token": "</img>",
                                                         "context_image_token": "<IMG_CONTEXT>",
                                                         "video_token": "<video>"})


def build_internvl(out_dir: str | os.PathLike, *, variant: str = "qwen2", seed: int = 0) -> Path:
    """A tiny checkpoint of `VARIANTS[variant]` (2 vision blocks, 2 decoder layers)."""
    import torch
    from transformers import InternVLConfig, InternVLForConditionalGeneration
    from transformers.models.got_ocr2.image_processing_pil_got_ocr2 import GotOcr2ImageProcessorPil

    v = VARIANTS[variant]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    tok = train_tokenizer()
    tok.chat_template = INTERNVL_CHAT_TEMPLATE
    ids = {t: tok.convert_tokens_to_ids(t) for t in SPECIAL}
    text = dict(vocab_size=len(tok), hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                num_attention_heads=4, max_position_embeddings=2048, rms_norm_eps=1e-6,
                bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|im_end|>"],
                pad_token_id=ids["<|endoftext|>"], **v["text"])
    vision = dict(num_hidden_layers=2, hidden_act="gelu", **v["vision"])
    cfg = InternVLConfig(vision_config=vision, text_config=text, image_token_id=ids["<IMG_CONTEXT>"],
                         downsample_ratio=0.5, image_seq_length=(v["tile"] // 8) ** 2,
                         tie_word_embeddings=v["tie"])
    model = InternVLForConditionalGeneration(cfg).eval()
    # norms start at 1, biases / class token / positions at 0, layer scales at 0.1: perturb all
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.add_(torch.randn_like(p) * (0.05 if "embed_tokens" in name else 0.2))
    model.save_pretrained(out, safe_serialization=True)
    ip = GotOcr2ImageProcessorPil(size={"height": v["tile"], "width": v["tile"]}, max_patches=v["max_patches"],
                                  min_patches=1)
    # the processor cannot be saved without its video processor: its parts and config as it saves them
    tok.save_pretrained(out)
    ip.save_pretrained(out)
    (out / "processor_config.json").write_text(json.dumps({"image_seq_length": cfg.image_seq_length,
                                                           "processor_class": "InternVLProcessor"}))
    (out / "video_preprocessor_config.json").write_text(json.dumps({
        "video_processor_type": "InternVLVideoProcessor", "do_sample_frames": True, "num_frames": v["frames"],
        "initial_shift": True, "size": {"height": v["tile"], "width": v["tile"]}, "resample": 3,
        "do_resize": True, "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True,
        "do_convert_rgb": True, "image_mean": CLIP_MEAN, "image_std": CLIP_STD}, indent=2))
    (out / "generation_config.json").write_text(json.dumps({"bos_token_id": text["bos_token_id"],
                                                            "eos_token_id": text["eos_token_id"],
                                                            "pad_token_id": text["pad_token_id"]}))
    return out


@contextlib.contextmanager
def _stub_torchvision():
    """`import torchvision.transforms.v2.functional` succeeds (video_processing_internvl's only use
    of it is a type annotation) while the block runs."""
    names = ["torchvision", "torchvision.transforms", "torchvision.transforms.v2", "torchvision.transforms.v2.functional"]
    saved = {n: sys.modules.get(n) for n in names}
    mods = [types.ModuleType(n) for n in names]
    for parent, child, n in zip(mods, mods[1:], names[1:]):
        setattr(parent, n.rsplit(".", 1)[1], child)
    sys.modules.update(dict(zip(names, mods)))
    try:
        yield
    finally:
        for n, m in saved.items():
            if m is None:
                sys.modules.pop(n, None)
            else:
                sys.modules[n] = m


def hf_processor(path: str | os.PathLike):
    """The real InternVLProcessor over the checkpoint's tokenizer, image processor and video
    processor (only the torchvision-dependent class check is skipped; videos need
    tiny_qwen3.torchvision_stand_in)."""
    from unittest import mock

    from transformers import AutoTokenizer, InternVLProcessor
    from transformers.models.got_ocr2.image_processing_pil_got_ocr2 import GotOcr2ImageProcessorPil
    from transformers.processing_utils import ProcessorMixin
    with _stub_torchvision():
        from transformers.models.internvl.video_processing_internvl import InternVLVideoProcessor
    path = Path(path)
    vp = InternVLVideoProcessor(**{k: v for k, v in json.loads((path / "video_preprocessor_config.json").read_text())
                                   .items() if k != "video_processor_type"})
    seq = json.loads((path / "processor_config.json").read_text())["image_seq_length"]
    with mock.patch.object(ProcessorMixin, "check_argument_for_proper_class", lambda self, name, arg: None):
        return InternVLProcessor(image_processor=GotOcr2ImageProcessorPil.from_pretrained(path),
                                 tokenizer=AutoTokenizer.from_pretrained(path), video_processor=vp,
                                 image_seq_length=seq, chat_template=INTERNVL_CHAT_TEMPLATE)
