"""Tiny PEFT LoRA adapters over the tiny test checkpoints, made with peft itself (offline).

`init_lora_weights=False` draws B at random (PEFT's default starts it at zero, which would make
an adapter that changes nothing pass every parity test); B is then scaled so the adapter moves
the logits visibly without swamping the base model.
"""
from __future__ import annotations

import os
from pathlib import Path

LM_TARGETS = r".*language_model.*\.({})"


def hf_model(path, cls_name: str = "AutoModelForImageTextToText"):
    import torch
    import transformers
    return getattr(transformers, cls_name).from_pretrained(path, dtype=torch.float32).eval()


def make_adapter(base: str | os.PathLike, out: str | os.PathLike, *, r: int = 4, alpha: float = 8.0,
                 targets: tuple[str, ...] = ("q_proj", "v_proj"), seed: int = 0, rslora: bool = False,
                 rank_pattern: dict | None = None, alpha_pattern: dict | None = None, b_scale: float = 0.3,
                 target_modules=None, cls_name: str = "AutoModelForImageTextToText") -> Path:
    """A PEFT LoRA adapter of the language model's `targets` of checkpoint `base`, saved in `out`."""
    import torch
    from peft import LoraConfig, get_peft_model
    torch.manual_seed(seed)
    model = hf_model(base, cls_name)
    cfg = LoraConfig(r=r, lora_alpha=alpha, target_modules=target_modules or LM_TARGETS.format("|".join(targets)),
                     use_rslora=rslora, rank_pattern=rank_pattern or {}, alpha_pattern=alpha_pattern or {},
                     init_lora_weights=False, lora_dropout=0.0)
    peft = get_peft_model(model, cfg)
    with torch.no_grad():
        for name, p in peft.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, b_scale)
    out = Path(out)
    peft.save_pretrained(out)
    return out


def hf_with_adapter(base, adapter, cls_name: str = "AutoModelForImageTextToText"):
    """transformers model of `base` with the PEFT adapter applied (the reference)."""
    from peft import PeftModel
    return PeftModel.from_pretrained(hf_model(base, cls_name), str(adapter)).eval()
