"""Random-weight LLaVA-architecture checkpoints for benchmarks, built offline with transformers
config classes + save_pretrained (weights, tokenizer, processor, chat template), cached on disk.

Sizes:
  default  CLIP ViT-B/16 @ 224 px (hidden 768, 12 layers, vision_feature_layer -2), 2-layer MLP
           projector, Llama hidden 1024 / 16 layers / 16 heads / 8 KV heads / intermediate 2816,
           vocab 32000 (a 32000-token byte-level BPE tokenizer), ~342M params, float32.
  gpu      CLIP ViT-L/14 @ 336 px + Llama hidden 2048 / 24 layers / 16 heads / 8 KV heads, ~1.6B
           params (`mmjax bench gpu`).
  smoke    the same architecture at toy size (2-layer 64-hidden decoder) for CI.
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from mmjax.models.llava import LLAVA_CHAT_TEMPLATE as CHAT_TEMPLATE  # noqa: E402

SIZES = {
    "default": {
        "vision": dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
                       image_size=224, patch_size=16, projection_dim=512, hidden_act="quick_gelu"),
        "text": dict(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=16,
                     num_attention_heads=16, num_key_value_heads=8, max_position_embeddings=4096,
                     rms_norm_eps=1e-5),
        "vision_feature_layer": -2,
    },
    "gpu": {   # LLaVA-1.5-shaped vision (CLIP ViT-L/14 @ 336 px), a 1.3B Llama (head_dim 128): ~1.6B params
        "vision": dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=24, num_attention_heads=16,
                       image_size=336, patch_size=14, projection_dim=768, hidden_act="quick_gelu"),
        "text": dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=24,
                     num_attention_heads=16, num_key_value_heads=8, max_position_embeddings=4096,
                     rms_norm_eps=1e-5),
        "vision_feature_layer": -2,
    },
    "smoke": {
        "vision": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                       image_size=32, patch_size=8, projection_dim=16, hidden_act="quick_gelu"),
        "text": dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                     rms_norm_eps=1e-5),
        "vision_feature_layer": -2,
    },
}


def default_cache_dir() -> Path:
    return Path(os.environ.get("MMJAX_BENCH_DIR") or Path.home() / ".cache" / "mmjax" / "bench")


def train_tokenizer(vocab_size: int, seed: int = 0):
    """A byte-level BPE tokenizer with exactly `vocab_size` entries, trained in ~2 s on random
    pseudo-words (so every id a random model emits detokenizes to real text)."""
    import numpy as np
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    rng = np.random.default_rng(seed)
    letters = np.array(list("abcdefghijklmnopqrstuvwxyz"))
    n_words = max(2000, 2 * vocab_size)
    words = ["".join(rng.choice(letters, int(rng.integers(2, 9)))) for _ in range(n_words)]
    words += "USER ASSISTANT SYSTEM describe the image in detail please what is shown".split()
    corpus = [" ".join(words[i:i + 50]) for i in range(0, len(words), 50)]
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    special = ["<unk>", "<s>", "</s>", "<pad>", "<image>"]
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=special, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus, trainer)
    bos = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                       special_tokens=[("<s>", bos)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                   pad_token="<pad>", additional_special_tokens=["<image>"])


def _spec_hash(spec: dict, seed: int) -> str:
    return hashlib.sha1(json.dumps([spec, seed, 1], sort_keys=True).encode()).hexdigest()[:10]


def build_llava(size: str = "default", out_dir: str | os.PathLike | None = None, *, seed: int = 0,
                log=print) -> Path:
    """Build (or reuse, when a complete copy exists) the random-weight checkpoint of `size`."""
    spec = SIZES[size]
    out = Path(out_dir) if out_dir else default_cache_dir() / f"llava-{size}-{_spec_hash(spec, seed)}"
    marker = out / ".complete"
    if marker.is_file():
        return out
    import torch
    from transformers import (CLIPImageProcessor, CLIPVisionConfig, LlamaConfig, LlavaConfig,
                              LlavaForConditionalGeneration, LlavaProcessor)

    log(f"building random-weight LLaVA checkpoint '{size}' in {out} ...")
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    tokenizer = train_tokenizer(spec["text"]["vocab_size"], seed)
    tokenizer.chat_template = CHAT_TEMPLATE
    assert len(tokenizer) == spec["text"]["vocab_size"], len(tokenizer)
    image_token_id = tokenizer.convert_tokens_to_ids("<image>")
    vision = CLIPVisionConfig(**spec["vision"])
    text = LlamaConfig(**spec["text"], tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=3)
    cfg = LlavaConfig(vision_config=vision, text_config=text, image_token_index=image_token_id,
                      vision_feature_layer=spec["vision_feature_layer"], vision_feature_select_strategy="default",
                      projector_hidden_act="gelu", tie_word_embeddings=False)
    # initialised on a GPU where there is one: a lent GPU's minutes are short, and a 1.6B
    # model's init and perturbation take ~a minute on CPU cores (other random numbers than a
    # CPU build's, the same distribution)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = LlavaForConditionalGeneration(cfg).eval()
    with torch.no_grad():  # HF init leaves norms at 1 and biases at 0; perturb everything a little
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    model.save_pretrained(out, safe_serialization=True)
    img = spec["vision"]["image_size"]
    ip = CLIPImageProcessor(size={"shortest_edge": img}, crop_size={"height": img, "width": img})
    processor = LlavaProcessor(image_processor=ip, tokenizer=tokenizer, patch_size=spec["vision"]["patch_size"],
                               vision_feature_select_strategy="default", num_additional_image_tokens=1,
                               chat_template=CHAT_TEMPLATE)
    processor.save_pretrained(out)
    (out / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 3}))
    n_params = sum(p.numel() for p in model.parameters())
    (out / "bench_info.json").write_text(json.dumps({"size": size, "seed": seed, "params": n_params}))
    marker.write_text("ok\n")
    log(f"built {n_params / 1e6:.1f}M params")
    return out


def main(argv=None) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m benchmarks.checkpoints",
                                 description="build the random-weight benchmark checkpoint")
    ap.add_argument("--size", choices=sorted(SIZES), default="default")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    print(build_llava(a.size, a.out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
