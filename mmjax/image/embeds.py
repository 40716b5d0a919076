"""Image embeddings as input (vLLM's multimodal embedding inputs): a client's precomputed image
features [tokens, lm hidden] (what the family's vision tower + projector would produce) enter
the prompt in place of an encoded image; the vision tower never runs for them."""
from __future__ import annotations

import base64
import hashlib
import io
from typing import Any

import numpy as np

from mmjax.errors import InvalidRequestError
from mmjax.models.family import ImageInput

MAX_EMBED_TOKENS = 65536


def image_from_embeds(family, decoder, embeds: Any, grid: Any = None, param: str = "image_embeds") -> ImageInput:
    """np.ndarray [tokens, hidden] (float16/32/bfloat16-as-float) -> ImageInput. decoder: the
    model's language model (its hidden size and position rows). `grid`: the vision patch grid
    (t, h, w) families with M-RoPE positions need (Qwen2-VL's image_grid_thw); others lay the
    tokens out as one row."""
    hidden = decoder.hidden_size
    a = np.asarray(embeds)
    if a.dtype.kind != "f" or a.ndim != 2 or a.shape[1] != hidden or not 0 < a.shape[0] <= MAX_EMBED_TOKENS:
        raise InvalidRequestError(f"image_embeds must be a float array [tokens, {hidden}] with 1 to "
                                  f"{MAX_EMBED_TOKENS} tokens, got {a.dtype} {list(a.shape)}", param=param)
    a = np.ascontiguousarray(a, np.float32)
    if not np.isfinite(a).all():
        raise InvalidRequestError("image_embeds holds NaN or infinite values", param=param)
    n = a.shape[0]
    if decoder.position_rows > 1:
        if grid is None:
            raise InvalidRequestError("this model's positions need the image's patch grid: pass image_grid_thw "
                                      "(t, h, w) with image_embeds", param=param)
        g = tuple(int(x) for x in np.asarray(grid).reshape(-1))
        merge = getattr(getattr(getattr(family, "cfg", None), "vision", None), "merge_size", 2)
        if len(g) != 3 or min(g) < 1 or g[0] * g[1] * g[2] != n * merge * merge:
            raise InvalidRequestError(f"image_grid_thw {list(g)} does not match {n} image tokens", param=param)
    else:
        g = (1, 1, n)
    key = "embeds:" + hashlib.sha256(a.tobytes() + repr(g).encode()).hexdigest()
    return ImageInput(np.zeros(0, np.float32), n, key, g, embeds=a)


def decode_npy(b64: str, max_bytes: int, param: str) -> np.ndarray:
    """A base64 .npy (no pickles) -> array."""
    if not isinstance(b64, str):
        raise InvalidRequestError("image_embeds must be a base64 .npy string", param=param)
    if len(b64) > max_bytes * 4 // 3 + 8:
        raise InvalidRequestError(f"image_embeds is larger than {max_bytes} bytes", param=param)
    try:
        return np.load(io.BytesIO(base64.b64decode(b64, validate=True)), allow_pickle=False)
    except Exception as e:  # noqa: BLE001 - any decode failure is the client's data
        raise InvalidRequestError(f"image_embeds is not a base64 .npy array: {type(e).__name__}", param=param) from None
