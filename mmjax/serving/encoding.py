"""Image and video features for prefill chunks: from the encoder cache, or encoded for all the
requests of a step together (deduplicated, grouped by token budget and LoRA adapter), retried
one request at a time when a joint encode fails so that only the culprit fails; then assembled
into each prefill chunk's embedding rows (`embeds`)."""
from __future__ import annotations

import logging
from typing import Callable

import numpy as np

from mmjax.errors import MMJaxError
from mmjax.models.family import ImageInput
from mmjax.serving.caches import EncoderCache
from mmjax.serving.request import Request

log = logging.getLogger("mmjax.engine")


def as_error(exc: BaseException, what: str) -> MMJaxError:
    """`exc` as the typed error a request fails with (an untyped one as an internal error)."""
    if isinstance(exc, MMJaxError):
        return exc
    return MMJaxError(f"internal error while {what}: {type(exc).__name__}: {exc}")


class FeatureEncoder:
    def __init__(self, runner, family, encoder_cache: EncoderCache, max_encode_tokens: int, counters: dict):
        """runner: the engine's `ModelRunner` (its encode step and feature width); counters: the
        engine's counters (images_encoded, videos_encoded are counted here)."""
        self.runner = runner
        self.family = family
        self.encoder_cache = encoder_cache
        self.max_encode_tokens = max_encode_tokens
        self.counters = counters

    def encode_missing(self, reqs: list[Request], fail: Callable[[Request, MMJaxError], None]) -> None:
        """Give every prefilling request its image features: from the encoder cache, or by
        encoding all missing images of all these requests together (deduplicated by key: the
        image's, with the request's adapter where the adapter changes the encoder). If the joint
        encode fails, each request's images are encoded alone so that only the request whose
        image fails is failed."""
        todo: dict[str, tuple[ImageInput, int]] = {}
        for r in reqs:
            for i, im in enumerate(r.images):
                # cross-attention: every image is needed by the request's first chunk
                done = r.image_end(i) <= r.prefilled and not self.family.cross_attention
                key = r.feature_key(im)
                if r.features[i] is not None or key in todo or done:
                    continue
                cached = self.encoder_cache.get(key)
                if cached is not None:
                    self.encoder_cache.hits += 1
                    r.features[i] = cached
                else:
                    self.encoder_cache.misses += 1
                    todo[key] = (im, r.encoder_adapter)
        if not todo:
            return
        try:
            feats = self._encode_keyed(todo)
        except Exception as e:  # find the culprit(s): one request at a time
            log.warning("joint encode of %d images failed (%s: %s); encoding per request", len(todo),
                        type(e).__name__, e)
            feats = {}
            for r in reqs:
                mine = {k: todo[k] for k in map(r.feature_key, r.images) if k in todo and k not in feats}
                try:
                    feats.update(self._encode_keyed(mine))
                except Exception as e:
                    fail(r, as_error(e, "encoding the request's images"))
        for key, f in feats.items():
            self.encoder_cache.put(key, f)
        for r in reqs:
            for i, im in enumerate(r.images):
                key = r.feature_key(im)
                if r.features[i] is None and key in feats:
                    r.features[i] = feats[key]

    def _encode_keyed(self, todo: dict[str, tuple[ImageInput, int]]) -> dict[str, np.ndarray]:
        """{feature key: (image, encoder adapter slot)} -> {feature key: features}: one encode per
        adapter slot (the encode step runs one adapter per call)."""
        out: dict[str, np.ndarray] = {}
        for slot in sorted({s for _, s in todo.values()}):
            keys = [k for k, (_, s) in todo.items() if s == slot]
            feats = self._encode([todo[k][0] for k in keys], slot)
            out.update((k, feats[todo[k][0].key]) for k in keys)
        return out

    def _encode(self, images: list[ImageInput], adapter: int = -1) -> dict[str, np.ndarray]:
        """Encode in groups of at most `max_encode_tokens` image tokens (an image larger than the
        budget goes alone) under LoRA adapter slot `adapter` (-1: none) -> {image key: features}."""
        feats: dict[str, np.ndarray] = {}
        groups, cur, n = [], [], 0
        for im in images:
            if cur and n + im.num_tokens > self.max_encode_tokens:
                groups.append(cur)
                cur, n = [], 0
            cur.append(im)
            n += im.num_tokens
        for group in groups + ([cur] if cur else []):
            feats.update(zip((im.key for im in group), self.runner.encode_images(group, adapter)))
            self.counters["images_encoded"] += sum(im.kind != "video" for im in group)
            self.counters["videos_encoded"] += sum(im.kind == "video" for im in group)
        return feats

    def embeds(self, req: Request, lo: int, hi: int) -> tuple[np.ndarray | None, np.ndarray]:
        """Rows [lo, hi) of the prompt's image embeddings [hi - lo, feature width] and mask [hi - lo]."""
        mask = np.isin(req.seq_ids(lo, hi), self.family.media_token_ids)
        if not mask.any() or self.family.cross_attention:  # cross-attention: <|image|> keeps its embedding
            mask[:] = False
            return None, mask
        emb = np.zeros((hi - lo, self.runner.feature_width), np.float32)
        first, last = np.searchsorted(req.image_pos, [lo, hi])   # image tokens [first, last) are here
        offset = 0
        for feats, im in zip(req.features, req.images):
            a, b = max(offset, first), min(offset + im.num_tokens, last)
            if a < b:
                emb[req.image_pos[a:b] - lo] = feats[a - offset:b - offset]
            offset += im.num_tokens
        return emb, mask
