"""Tiny random-weight Qwen3-VL (dense) and Qwen3-VL-MoE checkpoints built offline (transformers
config classes + save_pretrained), and the real Qwen3VLProcessor over their tokenizer and image
processor.

Qwen3VLProcessor cannot be constructed without torchvision (its video-processor class check, see
/work/shared/notes/facts.md); `hf_processor` skips only that class check, so the text expansion,
pixel values, grids and mm_token_type_ids are the processor's own. Geometry is the real one
(patch 16, merge 2, temporal patch 2, mean/std 0.5); the pixel bounds are smaller (64..256 tokens)
to keep the tests fast.

Video: the checkpoints carry a Qwen3VLVideoProcessor config (small size ranges; the MoE one turns
on `cap_pixels_per_frame`), and `hf_processor` includes the real Qwen3VLVideoProcessor. It runs
as transformers' own code (sample_frames, its smart_resize, patchify, the processor's timestamp
text and mm_token_type_ids) inside `torchvision_stand_in`, which replaces only the torchvision
calls (torchvision is not installable here) by the torch code they run: the uint8 bicubic
antialiased resize (`torch.nn.functional.interpolate`, the CPU kernel tvF.resize dispatches
to), tvF.normalize's `sub(mean).div_(std)`, grayscale_to_rgb (frames are RGB already), and
decoding with transformers' PyAV loader (`load_video(backend="pyav")`) instead of torchcodec.
"""
from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path

from tiny_qwen import QWEN_CHAT_TEMPLATE, QWEN_SPECIAL, train_qwen_tokenizer

MIN_PIXELS, MAX_PIXELS = 32 * 32 * 4, 32 * 32 * 96
# video size ranges bound t * h * w (all sampled frames together)
VIDEO = {"dense": dict(size={"shortest_edge": 32 * 32 * 20, "longest_edge": 32 * 32 * 64}),
         "moe": dict(size={"shortest_edge": 32 * 32 * 4, "longest_edge": 32 * 32 * 64}, cap_pixels_per_frame=True,
                     max_video_tokens=10)}


def build_qwen3(out_dir: str | os.PathLike, *, kind: str = "dense", seed: int = 0) -> Path:
    """kind "dense": Qwen3VLForConditionalGeneration, 3 vision blocks with DeepStack after blocks
    0 and 1, a 6x6 position table, 2 decoder layers, untied head. "moe":
    Qwen3VLMoeForConditionalGeneration, 2 vision blocks (DeepStack after block 0), a 4x4 table,
    3 decoder layers of which layer 1 is dense (mlp_only_layers), 8 experts top-2, tied
    embeddings (the flag at the top level only, as transformers saves it). Each has a
    Qwen3VLVideoProcessor config (`VIDEO[kind]`)."""
    import torch
    from transformers import Qwen2VLImageProcessorPil
    # the module's class (the top-level name is a dummy that demands torchvision)
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    tokenizer = train_qwen_tokenizer()
    tokenizer.chat_template = QWEN_CHAT_TEMPLATE
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in QWEN_SPECIAL}
    text = dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, max_position_embeddings=8192, rms_norm_eps=1e-6,
                rope_parameters={"rope_type": "default", "rope_theta": 5000.0, "mrope_section": [2, 3, 3],
                                 "mrope_interleaved": True},
                bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|im_end|>"], pad_token_id=ids["<|endoftext|>"])
    vision = dict(hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=64, hidden_act="gelu_pytorch_tanh",
                  patch_size=16, spatial_merge_size=2, temporal_patch_size=2)
    tokens = dict(image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
                  vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"])
    if kind == "dense":
        from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration
        cfg = Qwen3VLConfig(text_config={**text, "num_hidden_layers": 2},
                            vision_config={**vision, "depth": 3, "deepstack_visual_indexes": [0, 1],
                                           "num_position_embeddings": 36},
                            tie_word_embeddings=False, **tokens)
        model = Qwen3VLForConditionalGeneration(cfg)
    elif kind == "moe":
        from transformers import Qwen3VLMoeConfig, Qwen3VLMoeForConditionalGeneration
        cfg = Qwen3VLMoeConfig(text_config={**text, "num_hidden_layers": 3, "num_experts": 8, "num_experts_per_tok": 2,
                                            "moe_intermediate_size": 48, "mlp_only_layers": [1], "initializer_range": 0.1,
                                            "decoder_sparse_step": 1},
                               vision_config={**vision, "depth": 2, "deepstack_visual_indexes": [0],
                                              "num_position_embeddings": 16},
                               tie_word_embeddings=True, **tokens)
        model = Qwen3VLMoeForConditionalGeneration(cfg)
    else:
        raise ValueError(kind)
    model = model.eval()
    # Random init leaves norms at 1 and biases at 0: perturb everything so parity cannot pass by
    # symmetry (the router's experts get distinct preferences too).
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


def hf_processor(path: str | os.PathLike):
    """The real Qwen3VLProcessor over the checkpoint's tokenizer, image processor and video
    processor (only the torchvision-dependent class check is skipped; videos need
    `torchvision_stand_in`)."""
    from unittest import mock

    from transformers import AutoTokenizer, Qwen2VLImageProcessorPil, Qwen3VLProcessor
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor
    from transformers.processing_utils import ProcessorMixin

    tok = AutoTokenizer.from_pretrained(path)
    ip = Qwen2VLImageProcessorPil.from_pretrained(path)
    vp = Qwen3VLVideoProcessor.from_pretrained(path)
    with mock.patch.object(ProcessorMixin, "check_argument_for_proper_class", lambda self, name, arg: None):
        return Qwen3VLProcessor(image_processor=ip, tokenizer=tok, video_processor=vp)


@contextlib.contextmanager
def torchvision_stand_in():
    """transformers' video processors with the torchvision calls they make replaced by the torch
    code those calls run (module docstring)."""
    from unittest import mock

    import torch
    from transformers.image_processing_backends import TorchvisionBackend
    from transformers.video_processing_utils import BaseVideoProcessor, VideoProcessorMixin
    from transformers.video_utils import load_video

    def resize(self, image, size, resample=None, antialias=True, **kwargs):
        assert int(resample) == 3 and antialias and image.dtype == torch.uint8   # bicubic, uint8 frames
        x = image.reshape(-1, *image.shape[-3:])
        x = torch.nn.functional.interpolate(x, size=(size.height, size.width), mode="bicubic", antialias=True,
                                            align_corners=False)
        return x.reshape(*image.shape[:-2], size.height, size.width)

    def normalize(self, image, mean, std, inplace=False, **kwargs):
        mean = torch.as_tensor(mean, dtype=image.dtype).view(-1, 1, 1)
        std = torch.as_tensor(std, dtype=image.dtype).view(-1, 1, 1)
        return (image.sub_(mean) if inplace else image.sub(mean)).div_(std)

    def convert_to_rgb(self, video):
        assert video.shape[-3] == 3
        return video

    def fetch_videos(self, urls, sample_indices_fn=None):
        if isinstance(urls, list):
            return list(zip(*[fetch_videos(self, u, sample_indices_fn) for u in urls]))
        return load_video(urls, backend="pyav", sample_indices_fn=sample_indices_fn)

    with mock.patch.object(TorchvisionBackend, "resize", resize), \
            mock.patch.object(TorchvisionBackend, "normalize", normalize), \
            mock.patch.object(BaseVideoProcessor, "convert_to_rgb", convert_to_rgb), \
            mock.patch.object(VideoProcessorMixin, "fetch_videos", fetch_videos):
        yield
