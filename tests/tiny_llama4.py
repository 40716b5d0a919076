"""Tiny random Llama 4 (Llama4ForConditionalGeneration) checkpoints, built offline with the
transformers config classes + save_pretrained, a trained tokenizer with Llama 4's special tokens,
and Llama4Processor (its own chat template) + Llama4ImageProcessor.

Llama4ImageProcessor exists only as a torchvision backend (torchvision is not installable
here): `torchvision_stand_in` serves `torchvision.transforms.v2.functional` with the torch code
the calls it makes run on CPU (uint8 bilinear antialiased resize = `F.interpolate(...,
antialias=True)`, zero `pad`, `normalize` as sub(mean).div_(std), grayscale_to_rgb), so the
processor runs unchanged otherwise (its bfloat16 rescale / normalize included).
"""
from __future__ import annotations

import contextlib
import json
import os
import sys
import types
from pathlib import Path

from tiny_checkpoints import train_tokenizer

SPECIALS = ["<|image_start|>", "<|image_end|>", "<|image|>", "<|patch|>", "<|tile_x_separator|>",
            "<|tile_y_separator|>", "<|header_start|>", "<|header_end|>", "<|eot|>", "<|python_start|>",
            "<|python_end|>"]

# variant -> (text config, vision config, image processor size, max_patches)
VARIANTS = {
    # QK-norm, RoPE/chunked layers 0-2 and a NoPE global layer 3 (interval 4), chunk 6 (the tests'
    # prefill calls of 16 end inside attention chunks), temperature tuning with floor_scale 4 (so
    # the NoPE scale changes inside short prompts), every layer MoE (4 experts, top 1)
    "qk": (dict(num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                attention_chunk_size=6, use_qk_norm=True, no_rope_layer_interval=4, attn_temperature_tuning=True,
                floor_scale=4, attn_scale=0.1, interleave_moe_layer_step=1, num_local_experts=4,
                num_experts_per_tok=1, rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
           dict(hidden_size=32, num_attention_heads=2, num_hidden_layers=2, image_size=28, patch_size=7),
           28, 4),
    # no QK-norm, an explicit [RoPE, NoPE, RoPE] pattern, chunk 16, no temperature tuning, one MoE
    # layer of two (3 experts, top 2), MHA, llama3 RoPE scaling
    "plain": (dict(num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, head_dim=16,
                   attention_chunk_size=16, use_qk_norm=False, no_rope_layers=[1, 0, 1],
                   attn_temperature_tuning=False, interleave_moe_layer_step=2, num_local_experts=3,
                   num_experts_per_tok=2,
                   rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                    "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                    "original_max_position_embeddings": 64}),
              dict(hidden_size=32, num_attention_heads=4, num_hidden_layers=2, image_size=32, patch_size=8),
              32, 6),
}


@contextlib.contextmanager
def torchvision_stand_in():
    """`torchvision.transforms.v2.functional` served by the torch code its CPU calls run (module
    docstring); the modules are removed again afterwards."""
    import torch
    import transformers.image_processing_backends  # noqa: F401  (imported before the stand-in exists)
    from torch.nn import functional as F

    def resize(image, size, antialias=True):
        x = image.reshape(-1, *image.shape[-3:])
        y = F.interpolate(x, size=tuple(size), mode="bilinear", antialias=antialias, align_corners=False)
        return y.reshape(*image.shape[:-2], *size)

    def pad(image, padding, fill=0, **kw):
        left, top, right, bottom = padding
        assert fill == 0 or list(fill) == [0] * len(fill), fill       # Llama 4 pads with zeros
        return F.pad(image, (left, right, top, bottom), value=0)

    def normalize(image, mean, std, inplace=False):
        mean = torch.as_tensor(mean, dtype=image.dtype).view(-1, 1, 1)
        std = torch.as_tensor(std, dtype=image.dtype).view(-1, 1, 1)
        return (image.sub_(mean) if inplace else image.sub(mean)).div_(std)

    def grayscale_to_rgb(image):
        return image.expand(*image.shape[:-3], 3, *image.shape[-2:]) if image.shape[-3] == 1 else image

    class InterpolationMode:
        BILINEAR = types.SimpleNamespace(value="bilinear")

    fn = types.ModuleType("torchvision.transforms.v2.functional")
    fn.resize, fn.pad, fn.normalize, fn.grayscale_to_rgb, fn.InterpolationMode = (
        resize, pad, normalize, grayscale_to_rgb, InterpolationMode)
    names = ["torchvision", "torchvision.transforms", "torchvision.transforms.v2",
             "torchvision.transforms.v2.functional"]
    mods = {n: types.ModuleType(n) for n in names[:-1]}
    mods[names[-1]] = fn
    mods["torchvision.transforms.v2"].functional = fn
    mods["torchvision.transforms"].v2 = mods["torchvision.transforms.v2"]
    mods["torchvision.transforms"].InterpolationMode = InterpolationMode
    mods["torchvision"].transforms = mods["torchvision.transforms"]
    saved = {n: sys.modules.get(n) for n in names}
    sys.modules.update(mods)
    try:
        from transformers.image_processing_backends import TorchvisionBackend
        import importlib
        from unittest import mock
        ipl = importlib.import_module("transformers.models.llama4.image_processing_llama4")

        def backend_resize(self, image, size, resample=None, antialias=True, **kwargs):
            assert resample is None or int(resample) == 2, resample      # Llama 4: bilinear
            return resize(image, (size.height, size.width), antialias)

        def backend_normalize(self, image, mean, std, inplace=False):
            return normalize(image, mean, std, inplace)
        with mock.patch.object(TorchvisionBackend, "resize", backend_resize), \
                mock.patch.object(TorchvisionBackend, "normalize", backend_normalize), \
                mock.patch.object(ipl, "tvF", fn):
            yield
    finally:
        for n, m in saved.items():
            if m is None:
                sys.modules.pop(n, None)
            else:
                sys.modules[n] = m


def build_llama4(out_dir: str | os.PathLike, *, variant: str = "qk", seed: int = 0) -> Path:
    """Llama4ForConditionalGeneration of `VARIANTS[variant]`: hidden 64 decoder, a 2-block 32-wide
    tower (4 patch tokens per tile after the pixel shuffle), all weights perturbed (norms start at
    1, the class and position embeddings are random already)."""
    import torch
    from transformers import Llama4Config, Llama4ForConditionalGeneration

    text_kw, vision_kw, size, max_patches = VARIANTS[variant]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    tok = train_tokenizer(SPECIALS)
    ids = {t: tok.convert_tokens_to_ids(t) for t in SPECIALS}
    text = dict(vocab_size=len(tok), hidden_size=64, intermediate_size=48, intermediate_size_mlp=96,
                max_position_embeddings=1024, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, pad_token_id=3,
                **text_kw)
    vision = dict(intermediate_size=vision_kw["hidden_size"] * 4, projector_input_dim=48, projector_output_dim=48,
                  vision_output_dim=48, pixel_shuffle_ratio=0.5, **vision_kw)
    cfg = Llama4Config(text_config=text, vision_config=vision, image_token_index=ids["<|patch|>"],
                       boi_token_index=ids["<|image_start|>"], eoi_token_index=ids["<|image_end|>"])
    model = Llama4ForConditionalGeneration(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    model.save_pretrained(out, safe_serialization=True)
    with torchvision_stand_in():
        from transformers import Llama4Processor
        ip = image_processor_class()(size={"height": size, "width": size}, max_patches=max_patches)
        Llama4Processor(image_processor=ip, tokenizer=tok, patch_size=vision_kw["patch_size"]).save_pretrained(out)
    (out / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 3}))
    return out


def image_processor_class():
    """Llama4ImageProcessor from its module (the top-level name is a dummy without torchvision);
    inside `torchvision_stand_in`."""
    import importlib
    return importlib.import_module("transformers.models.llama4.image_processing_llama4").Llama4ImageProcessor


def hf_processor(path):
    """transformers' Llama4Processor over the checkpoint; call it inside `torchvision_stand_in`."""
    from transformers import AutoTokenizer, Llama4Processor
    from transformers.processing_utils import ProcessorMixin
    from unittest import mock
    proc = json.loads((Path(path) / "processor_config.json").read_text())
    ip = image_processor_class().from_pretrained(path)
    with mock.patch.object(ProcessorMixin, "check_argument_for_proper_class", lambda self, name, arg: None):
        return Llama4Processor(image_processor=ip, tokenizer=AutoTokenizer.from_pretrained(path),
                               patch_size=proc.get("patch_size", 14),
                               pixel_shuffle_ratio=proc.get("pixel_shuffle_ratio", 0.5))
