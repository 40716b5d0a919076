"""Tiny random-weight MiniCPM-V 4.6 / 4.7 checkpoints built offline (transformers config classes +
save_pretrained), and the real MiniCPMV4_6Processor / MiniCPMV4_7Processor over their tokenizer
and image processor.

Both use a 4-layer Qwen3.5 text model (Gated DeltaNet layers 0-2, full attention layer 3), a
3-layer vision tower (window merger after layer 1, patch 14, a 5x5 position table so the
nearest-bucket position ids are not the identity) and the 2x2 merger. The image processor keeps
the real slicing arithmetic with a small `scale_resolution` (112 px: a source view of about 8x8
patches, 4 tokens; slices of the same size, at most `MAX_SLICES`).

Video: a MiniCPMV4_6VideoProcessor config (one frame a second, at most `VIDEO_FRAMES`, frames
sliced into at most 2). That class runs as transformers' own code inside
`tiny_qwen3.torchvision_stand_in` (torchvision is not installable here); `hf_processor` skips
only the processor's class check. Weights that start constant (norms, biases, the merger's
block-diagonal linear_1) are perturbed before saving.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

from tiny_qwen import QWEN_WORDS

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<unk>", "<|video_pad|>", "<image>", "</image>",
           "<slice>", "</slice>", "<image_id>", "</image_id>"]
NAMED = {"image_token": "<unk>", "video_token": "<|video_pad|>", "image_start_token": "<image>",
         "image_end_token": "</image>", "slice_start_token": "<slice>", "slice_end_token": "</slice>",
         "image_id_start_token": "<image_id>", "image_id_end_token": "</image_id>"}
SCALE_RESOLUTION, MAX_SLICES, VIDEO_FRAMES = 112, 4, 4

CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}<unk>"
    "{% elif content['type'] == 'video' or 'video' in content %}<|video_pad|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}{% endif %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def train_tokenizer(vocab_size: int = 480):
    """Byte-level BPE with the MiniCPM-V markers as special tokens (named on the tokenizer as
    the processor reads them: `image_token`, `slice_start_token`, ...)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    words = [w for w in QWEN_WORDS if w]
    tok.train_from_iterator([" ".join(words[i:] + words[:i]) for i in range(len(words))], trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   additional_special_tokens=SPECIAL[1:], extra_special_tokens=NAMED)


def build_minicpmv(out_dir: str | os.PathLike, *, version: str = "4.6", seed: int = 0) -> Path:
    """version "4.6": MiniCPMV4_6ForConditionalGeneration (1-D positions); "4.7":
    MiniCPMV4_7ForConditionalGeneration (canvas M-RoPE from the marker ids in config.json)."""
    import torch
    from transformers.models.minicpmv4_6.image_processing_pil_minicpmv4_6 import MiniCPMV4_6ImageProcessorPil
    from transformers.models.minicpmv4_6.video_processing_minicpmv4_6 import MiniCPMV4_6VideoProcessor

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    tokenizer = train_tokenizer()
    tokenizer.chat_template = CHAT_TEMPLATE
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL}
    text = dict(model_type="qwen3_5_text", vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                num_hidden_layers=4, layer_types=["linear_attention"] * 3 + ["full_attention"],
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_conv_kernel_dim=4,
                linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2,
                linear_num_value_heads=4, max_position_embeddings=4096, rms_norm_eps=1e-6,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                                 "mrope_section": [2, 1, 1], "mrope_interleaved": True},
                bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|im_end|>"],
                pad_token_id=ids["<|endoftext|>"])
    vision = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=2,
                  image_size=70, patch_size=14, hidden_act="gelu_pytorch_tanh", layer_norm_eps=1e-6)
    common = dict(text_config=text, vision_config=vision, insert_layer_id=1, image_size=SCALE_RESOLUTION,
                  image_token_id=ids["<unk>"], video_token_id=ids["<|video_pad|>"], tie_word_embeddings=False)
    if version == "4.6":
        from transformers import MiniCPMV4_6Config, MiniCPMV4_6ForConditionalGeneration
        model = MiniCPMV4_6ForConditionalGeneration(MiniCPMV4_6Config(**common))
    elif version == "4.7":
        from transformers import MiniCPMV4_7Config, MiniCPMV4_7ForConditionalGeneration
        newline = tokenizer.encode("\n", add_special_tokens=False)
        assert len(newline) == 1
        model = MiniCPMV4_7ForConditionalGeneration(MiniCPMV4_7Config(
            **common, image_start_id=ids["<image>"], image_end_id=ids["</image>"], slice_start_id=ids["<slice>"],
            slice_end_id=ids["</slice>"], newline_id=newline[0]))
    else:
        raise ValueError(version)
    model = model.eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    MiniCPMV4_6ImageProcessorPil(scale_resolution=SCALE_RESOLUTION, max_slice_nums=MAX_SLICES,
                                 patch_size=14).save_pretrained(out)
    MiniCPMV4_6VideoProcessor(scale_resolution=SCALE_RESOLUTION, max_slice_nums=2, patch_size=14,
                              max_num_frames=VIDEO_FRAMES).save_pretrained(out)
    gen = {"bos_token_id": text["bos_token_id"], "eos_token_id": text["eos_token_id"],
           "pad_token_id": text["pad_token_id"]}
    (out / "generation_config.json").write_text(json.dumps(gen))
    return out


def hf_processor(path: str | os.PathLike, version: str = "4.6"):
    """The real MiniCPMV4_6Processor / MiniCPMV4_7Processor over the checkpoint's tokenizer and
    image and video processors (videos need `tiny_qwen3.torchvision_stand_in`)."""
    from unittest import mock

    from transformers import AutoTokenizer, MiniCPMV4_6Processor, MiniCPMV4_7Processor
    from transformers.models.minicpmv4_6.image_processing_pil_minicpmv4_6 import MiniCPMV4_6ImageProcessorPil
    from transformers.models.minicpmv4_6.video_processing_minicpmv4_6 import MiniCPMV4_6VideoProcessor
    from transformers.processing_utils import ProcessorMixin

    tok = AutoTokenizer.from_pretrained(path)
    ip = MiniCPMV4_6ImageProcessorPil.from_pretrained(path)
    vp = MiniCPMV4_6VideoProcessor.from_pretrained(path)
    cls = MiniCPMV4_6Processor if version == "4.6" else MiniCPMV4_7Processor
    with mock.patch.object(ProcessorMixin, "check_argument_for_proper_class", lambda self, name, arg: None):
        return cls(image_processor=ip, tokenizer=tok, video_processor=vp)
