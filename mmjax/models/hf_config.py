"""Reading Hugging Face config.json dicts: strict, so a bad checkpoint fails at load time with an
error naming the field, not inside a compiled step."""
from __future__ import annotations

import dataclasses
from typing import Any

from mmjax.errors import CheckpointError


def require(cfg: dict, key: str, where: str, default: Any = dataclasses.MISSING) -> Any:
    """cfg[key] if present and not None, else `default`; a missing required field raises
    CheckpointError naming `where.key`."""
    if key in cfg and cfg[key] is not None:
        return cfg[key]
    if default is dataclasses.MISSING:
        raise CheckpointError(f"config.json: required field '{where}.{key}' is missing", param=f"{where}.{key}")
    return default


def tie_word_embeddings(top: dict, text: dict | None, default: bool = False) -> bool:
    """transformers' rule: the top-level `tie_word_embeddings` of a multimodal config decides
    (LlavaConfig(..., tie_word_embeddings=True) saves it only there, with text_config saying
    false); a config without a top-level flag falls back to its text config, then `default`.
    Whether the checkpoint then really ties is decided at load: a file that holds its own
    lm_head.weight is not tied (the decoder's `hf_weights`)."""
    if top.get("tie_word_embeddings") is not None:
        return bool(top["tie_word_embeddings"])
    if text and text.get("tie_word_embeddings") is not None:
        return bool(text["tie_word_embeddings"])
    return default
