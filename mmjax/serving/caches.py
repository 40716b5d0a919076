"""The engine's two caches: image features by content (`EncoderCache`) and the KV each free slot
still holds (`PrefixCache`, keyed per token so different images never share KV)."""
from __future__ import annotations

import hashlib
import time
from collections import OrderedDict

import numpy as np

from mmjax.models.family import ImageInput

IMAGE_KEY_BIT = np.int64(1) << np.int64(62)


def token_keys(ids: np.ndarray, images: list[ImageInput], image_pos: np.ndarray,
               all_images_first: bool = False) -> np.ndarray:
    """Prefix-cache key per prompt token [prompt_len] int64: text tokens are their id; image
    token j of an image is (content hash of that image + preprocessing) + j with bit 62 set, so
    two different images of the same size never share KV (vllm#20261, sglang#6583).
    image_pos: prompt index of every image token, in order (image i owns the next num_tokens)."""
    keys = ids.astype(np.int64)
    offset = 0
    for im in images:
        h = int.from_bytes(hashlib.sha256(im.key.encode()).digest()[:7], "little")  # 56 bits
        where = image_pos[offset:offset + im.num_tokens]
        keys[where] = IMAGE_KEY_BIT | np.int64(h << 5) + np.arange(im.num_tokens, dtype=np.int64)
        offset += im.num_tokens
    if all_images_first and images and len(keys):
        # cross-attention families: every token's KV depends on all of the request's images
        # (Mllama's text before the first image attends to them all), so the first token's key
        # names them all and no prefix is shared across different image sets
        h = int.from_bytes(hashlib.sha256("|".join(im.key for im in images).encode()).digest()[:7], "little")
        keys[0] = IMAGE_KEY_BIT | np.int64(h << 5)
    return keys


def salt_keys(keys: np.ndarray, salt: str) -> np.ndarray:
    """Prefix-cache keys of a request whose KV also depends on `salt` (a LoRA adapter): the first
    token's key mixed with it, so it shares no prefix with requests of another salt."""
    if not len(keys):
        return keys
    keys = keys.copy()
    h = int.from_bytes(hashlib.sha256(f"{salt}|{int(keys[0])}".encode()).digest()[:7], "little")
    keys[0] = IMAGE_KEY_BIT | np.int64(h << 5) | np.int64(31)   # bit pattern no image token's key has
    return keys


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if len(diff) else n


class EncoderCache:
    """Image embeddings keyed by content hash + preprocessing parameters; LRU bounded in bytes."""

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self.bytes = 0
        self._d: OrderedDict[str, np.ndarray] = OrderedDict()
        self.hits = 0
        self.misses = 0

    def get(self, key: str) -> np.ndarray | None:
        v = self._d.get(key)
        if v is not None:
            self._d.move_to_end(key)
        return v

    def put(self, key: str, value: np.ndarray) -> None:
        if key in self._d or value.nbytes > self.max_bytes:
            return
        self._d[key] = value
        self.bytes += value.nbytes
        while self.bytes > self.max_bytes:
            _, old = self._d.popitem(last=False)
            self.bytes -= old.nbytes

    def __len__(self) -> int:
        return len(self._d)

    def clear(self) -> None:
        """Forget every entry (the vision weights changed: `Engine.refresh`)."""
        self._d.clear()
        self.bytes = 0


class PrefixCache:
    """Per slot: the token keys of the KV its cache row holds, and when it was last released."""

    def __init__(self, num_slots: int, enabled: bool = True):
        self.enabled = enabled
        self.keys: list[np.ndarray] = [np.zeros(0, np.int64) for _ in range(num_slots)]
        self.last_used: list[float] = [0.0] * num_slots

    def match(self, slot: int, keys: np.ndarray) -> int:
        """Tokens of `keys` whose KV slot `slot` already holds."""
        return common_prefix(self.keys[slot], keys) if self.enabled else 0

    def truncate(self, slot: int, n: int) -> None:
        """The slot is reused: only its first n positions stay valid."""
        self.keys[slot] = self.keys[slot][:n]

    def retain(self, slot: int, keys: np.ndarray) -> None:
        """The slot was released holding the KV of `keys`."""
        self.keys[slot] = keys
        self.last_used[slot] = time.monotonic()

    def clear(self) -> None:
        self.keys = [np.zeros(0, np.int64) for _ in self.keys]
