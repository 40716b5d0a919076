"""Build tiny random-weight Hugging Face checkpoints offline (transformers config classes +
save_pretrained) for parity tests. Nothing here touches the network."""
from __future__ import annotations

import json
import os
from pathlib import Path

WORDS = (
    "the a an of to in is it what this that there are how many color shape image picture photo "
    "describe red green blue yellow circle square triangle yes no one two three left right top "
    "bottom big small cat dog car tree house person sky water road USER ASSISTANT SYSTEM you me "
    "please answer question 0 1 2 3 4 5 6 7 8 9 . , ? ! : ; ( ) ' \" - hello world café naïve 東京 😀"
).split()

from mmjax.models.llava import LLAVA_CHAT_TEMPLATE  # noqa: E402  (the LLaVA-1.5 conversation format)


def train_tokenizer(extra_special: list[str], vocab_size: int = 400):
    """A byte-level BPE tokenizer trained with `tokenizers` on a small corpus, wrapped for HF."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    special = ["<unk>", "<s>", "</s>", "<pad>"] + extra_special
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=special,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    corpus = [" ".join(WORDS[i:] + WORDS[:i]) for i in range(len(WORDS))]
    tok.train_from_iterator(corpus, trainer)
    bos = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                       special_tokens=[("<s>", bos)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>", pad_token="<pad>",
                                   additional_special_tokens=extra_special)


def build_llava(out_dir: str | os.PathLike, *, variant: str = "gqa", seed: int = 0,
                text_overrides: dict | None = None) -> Path:
    """Tiny LLaVA-1.5-architecture checkpoint.

    variant "gqa":  GQA 4:2, vision_feature_layer -2, 'default' strategy, untied lm_head, 32x32.
    variant "mha":  MHA, vision_feature_layer -1, 'full' strategy, tied embeddings, llama3 rope
                    scaling, 28x28 crop from shortest-edge resize.
    variant "tie-top": "gqa" saved as `LlavaConfig(..., tie_word_embeddings=True)` over a text
                    config that says false (transformers 5 ties it: no lm_head in the file).
    text_overrides: LlamaConfig fields replaced (e.g. more heads for tensor-parallel tests).
    """
    import torch
    from transformers import (CLIPImageProcessor, CLIPVisionConfig, LlamaConfig, LlavaConfig,
                              LlavaForConditionalGeneration, LlavaProcessor)

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    tokenizer = train_tokenizer(["<image>"])
    tokenizer.chat_template = LLAVA_CHAT_TEMPLATE
    image_token_id = tokenizer.convert_tokens_to_ids("<image>")
    vocab = len(tokenizer)
    if variant in ("gqa", "tie-top"):
        vision = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                  num_attention_heads=4, image_size=32, patch_size=8,
                                  projection_dim=16, hidden_act="quick_gelu")
        text = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128,
                           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                           max_position_embeddings=2048, rms_norm_eps=1e-5,
                           tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
                           pad_token_id=3)
        cfg = LlavaConfig(vision_config=vision, text_config=text, image_token_index=image_token_id,
                          vision_feature_layer=-2, vision_feature_select_strategy="default",
                          projector_hidden_act="gelu", tie_word_embeddings=variant == "tie-top")
        ip = CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
        strategy = "default"
    elif variant == "mha":
        vision = CLIPVisionConfig(hidden_size=48, intermediate_size=96, num_hidden_layers=2,
                                  num_attention_heads=4, image_size=28, patch_size=7,
                                  projection_dim=16, hidden_act="quick_gelu")
        text = LlamaConfig(vocab_size=vocab, hidden_size=48, intermediate_size=96,
                           num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
                           max_position_embeddings=4096, rms_norm_eps=1e-6,
                           tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
                           pad_token_id=3,
                           rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0,
                                            "factor": 8.0, "low_freq_factor": 1.0,
                                            "high_freq_factor": 4.0,
                                            "original_max_position_embeddings": 64})
        cfg = LlavaConfig(vision_config=vision, text_config=text, image_token_index=image_token_id,
                          vision_feature_layer=-1, vision_feature_select_strategy="full",
                          projector_hidden_act="gelu", tie_word_embeddings=True)
        ip = CLIPImageProcessor(size={"shortest_edge": 30}, crop_size={"height": 28, "width": 28})
        strategy = "full"
    else:
        raise ValueError(variant)
    for k, v in (text_overrides or {}).items():
        setattr(cfg.text_config, k, v)
    model = LlavaForConditionalGeneration(cfg).eval()
    # Random init leaves some tensors at constants (norm weights = 1, biases = 0); perturb all so
    # parity cannot pass by accident on a symmetric model.
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    model.save_pretrained(out, safe_serialization=True)
    processor = LlavaProcessor(image_processor=ip, tokenizer=tokenizer,
                               patch_size=cfg.vision_config.patch_size,
                               vision_feature_select_strategy=strategy,
                               num_additional_image_tokens=1, chat_template=LLAVA_CHAT_TEMPLATE)
    processor.save_pretrained(out)
    gen = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 3}
    (out / "generation_config.json").write_text(json.dumps(gen))
    return out
