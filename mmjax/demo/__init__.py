"""mmjax-shapes: the tiny trained LLaVA-architecture demo VLM (issue 7).

shapes.py     synthetic scenes, questions, exact answers, client-like PNG/JPEG round trip
tokenizer.py  the byte-level BPE tokenizer and the LLaVA-1.5-style chat template
config.py     the HF LlavaConfig dicts (shipped model and a smaller notebook variant)
export.py     writes a Hugging Face LLaVA-layout checkpoint without torch/transformers
train.py      trains the model from scratch on CPU (JAX + optax) and exports it
mixed_precision.py  bf16 x bf16 -> f32 matmuls for the training steps (2x faster on AMX CPUs)
evaluate.py   held-out accuracy through the offline chat API
checkpoint/   the shipped checkpoint (package data), see README.md
"""
from __future__ import annotations

from pathlib import Path

CHECKPOINT_DIR = Path(__file__).resolve().parent / "checkpoint"


def default_model_path() -> Path | None:
    """The shipped mmjax-shapes checkpoint directory (HF LLaVA layout), or None when the
    package was installed without it."""
    d = CHECKPOINT_DIR
    if (d / "config.json").is_file() and any(d.glob("*.safetensors")):
        return d
    return None
