"""Tiny random Idefics3 (Idefics3ForConditionalGeneration) and SmolVLM
(SmolVLMForConditionalGeneration) checkpoints, built offline with the transformers config classes +
save_pretrained, a trained tokenizer with the processors' special tokens (`<image>`,
`<fake_token_around_image>`, `<global-img>`, `<row_i_col_j>`, `<end_of_utterance>`), the real
processors (Idefics3Processor / SmolVLMProcessor over the Pil image processors) and the
checkpoints' chat templates.

The tiles are small (`max_image_size` 32 / 36 px) and `size.longest_edge` is three tiles, so wide,
tall and square images get different grids (up to 3x3 tiles + the global image)."""
from __future__ import annotations

import json
import os
from pathlib import Path

from tiny_checkpoints import train_tokenizer

# HuggingFaceM4/Idefics3-8B-Llama3's chat template, verbatim.
IDEFICS3_CHAT_TEMPLATE = (
    "<|begin_of_text|>{% for message in messages %}{{message['role'].capitalize()}}"
    "{% if message['content'][0]['type'] == 'image' %}{{':'}}{% else %}{{': '}}{% endif %}"
    "{% for line in message['content'] %}{% if line['type'] == 'text' %}{{line['text']}}"
    "{% elif line['type'] == 'image' %}{{ '<image>' }}{% endif %}{% endfor %}<end_of_utterance>\n{% endfor %}"
    "{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
)
# HuggingFaceTB/SmolVLM-Instruct's chat template (SmolVLMProcessor's default), verbatim.
SMOLVLM_CHAT_TEMPLATE = (
    "<|im_start|>{% for message in messages %}{{message['role'] | capitalize}}"
    "{% if message['content'][0]['type'] == 'image' %}{{':'}}{% else %}{{': '}}{% endif %}"
    "{% for line in message['content'] %}{% if line['type'] == 'text' %}{{line['text']}}"
    "{% elif line['type'] == 'image' %}{{ '<image>' }}{% elif line['type'] == 'video' %}{{ '<video>' }}"
    "{% endif %}{% endfor %}<end_of_utterance>\n{% endfor %}{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
)

ROW_COL = [f"<row_{i + 1}_col_{j + 1}>" for i in range(6) for j in range(6)]


def build_idefics3(out_dir: str | os.PathLike, *, variant: str = "idefics3", seed: int = 0) -> Path:
    """variant "idefics3": Idefics3ForConditionalGeneration, 32 px tiles (8x8 patches of 4),
        scale_factor 2 -> 16 tokens per tile, untied lm_head, GQA, longest_edge 96.
    variant "smolvlm": SmolVLMForConditionalGeneration, 36 px tiles (9x9 patches of 4),
        scale_factor 3 -> 9 tokens per tile, tied embeddings (top-level flag only), 2 vision
        heads, longest_edge 108, <|im_start|> template."""
    import torch
    from transformers import LlamaConfig, PreTrainedTokenizerFast

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    first = "<|begin_of_text|>" if variant == "idefics3" else "<|im_start|>"
    # the same vocabulary size and decoder shapes in both variants: their prefill / decode steps
    # compile to the same programs, which the persistent compilation cache then shares
    specials = ["<image>", "<fake_token_around_image>", "<global-img>", "<end_of_utterance>", first,
                "<video>"] + ROW_COL
    base = train_tokenizer(specials)
    # the template writes the first token itself (as the real checkpoints' BOS)
    tok = PreTrainedTokenizerFast(tokenizer_object=base.backend_tokenizer, bos_token=first,
                                  eos_token="<end_of_utterance>", unk_token="<unk>", pad_token="<pad>",
                                  extra_special_tokens={"image_token": "<image>",
                                                        "fake_image_token": "<fake_token_around_image>",
                                                        "global_image_token": "<global-img>",
                                                        "end_of_utterance_token": "<end_of_utterance>"})
    image_id = tok.convert_tokens_to_ids("<image>")
    eos = tok.convert_tokens_to_ids("<end_of_utterance>")
    text = dict(vocab_size=len(tok), hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                num_attention_heads=4, max_position_embeddings=1024, rms_norm_eps=1e-5,
                bos_token_id=1, eos_token_id=eos, pad_token_id=3)
    if variant == "idefics3":
        from transformers import (Idefics3Config, Idefics3ForConditionalGeneration, Idefics3Processor,
                                  Idefics3VisionConfig)
        from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil
        vision = Idefics3VisionConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                      num_attention_heads=4, image_size=32, patch_size=4)
        cfg = Idefics3Config(vision_config=vision.to_dict(),
                             text_config=LlamaConfig(**text, num_key_value_heads=2).to_dict(),
                             scale_factor=2, image_token_id=image_id, tie_word_embeddings=False)
        model = Idefics3ForConditionalGeneration(cfg).eval()
        ip = Idefics3ImageProcessorPil(size={"longest_edge": 96}, max_image_size={"longest_edge": 32})
        template, seq = IDEFICS3_CHAT_TEMPLATE, 16
        tok.chat_template = template
        proc = Idefics3Processor(image_processor=ip, tokenizer=tok, image_seq_len=seq, chat_template=template)
    elif variant == "smolvlm":
        from transformers import SmolVLMConfig, SmolVLMForConditionalGeneration, SmolVLMVisionConfig
        from transformers.models.smolvlm.image_processing_pil_smolvlm import SmolVLMImageProcessorPil
        vision = SmolVLMVisionConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                     num_attention_heads=2, image_size=36, patch_size=4)
        cfg = SmolVLMConfig(vision_config=vision.to_dict(),
                            text_config=LlamaConfig(**text, num_key_value_heads=2, tie_word_embeddings=False).to_dict(),
                            scale_factor=3, image_token_id=image_id, tie_word_embeddings=True)
        model = SmolVLMForConditionalGeneration(cfg).eval()
        ip = SmolVLMImageProcessorPil(size={"longest_edge": 108}, max_image_size={"longest_edge": 36})
        template, seq = SMOLVLM_CHAT_TEMPLATE, 9
        tok.chat_template = template
        proc = smolvlm_processor(ip, tok, image_seq_len=seq, chat_template=template)
    else:
        raise ValueError(variant)
    with torch.no_grad():  # small random weights everywhere (norms start at 1, biases at 0)
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.25)
    model.save_pretrained(out, safe_serialization=True)
    proc.save_pretrained(out)
    (out / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": eos,
                                                            "pad_token_id": 3}))
    return out



def smolvlm_processor(image_processor, tokenizer, **kw):
    """SmolVLMProcessor with its own video processor class, built without transformers' video
    processor registry (it needs torchvision, absent here; mmjax serves images only)."""
    from unittest import mock

    from transformers import SmolVLMProcessor
    from transformers.models.smolvlm.video_processing_smolvlm import SmolVLMVideoProcessor
    from transformers.processing_utils import ProcessorMixin
    check = ProcessorMixin.check_argument_for_proper_class

    def skip_video(self, name, arg):
        return None if name == "video_processor" else check(self, name, arg)
    with mock.patch.object(ProcessorMixin, "check_argument_for_proper_class", skip_video):
        return SmolVLMProcessor(image_processor=image_processor, tokenizer=tokenizer,
                                video_processor=SmolVLMVideoProcessor(), **kw)


def load_processor(path: str | os.PathLike):
    """The checkpoint's processor (AutoProcessor; SmolVLM's rebuilt by `smolvlm_processor`)."""
    from transformers import AutoProcessor, AutoTokenizer
    path = Path(path)
    if json.loads((path / "config.json").read_text())["model_type"] != "smolvlm":
        return AutoProcessor.from_pretrained(path)
    from transformers.models.smolvlm.image_processing_pil_smolvlm import SmolVLMImageProcessorPil
    cfg = json.loads((path / "processor_config.json").read_text())
    return smolvlm_processor(SmolVLMImageProcessorPil.from_pretrained(path), AutoTokenizer.from_pretrained(path),
                             image_seq_len=cfg["image_seq_len"],
                             chat_template=(path / "chat_template.jinja").read_text())
