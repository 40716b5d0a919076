"""Continuous batching over decode slots.

Each `step()`: admit waiting requests into free slots; encode every image that is not in the
encoder cache (batched across requests); prefill chunks up to `prefill_chunk` tokens in total (so
a long image prompt is spread over several steps and never freezes running streams); one decode
step for all running slots. Host-only work (tokenize, stop strings, detokenize) stays here.
"""
from __future__ import annotations

import itertools
import logging
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from mmjax.errors import ContextLengthError, InvalidRequestError, MMJaxError
from mmjax.runner import ModelRunner, StepOutput
from mmjax.sampling import SamplingParams
from mmjax.tokenizer import IncrementalDetokenizer

log = logging.getLogger("mmjax.engine")


@dataclass
class ImageInput:
    """One preprocessed image: model input, its LLM token count and its encoder-cache key."""
    pixels: np.ndarray
    num_tokens: int
    key: str
    grid_thw: tuple[int, int, int] | None = None


@dataclass
class Delta:
    """What one step produced for one request (streamed to clients)."""
    request_id: str
    token_ids: list[int]
    text: str
    logprobs: list[dict[int, float]] | None
    finished: bool = False
    finish_reason: str | None = None
    error: MMJaxError | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    logprobs: list[dict[int, float]] | None
    finish_reason: str | None
    num_image_tokens: int = 0
    cached_tokens: int = 0


@dataclass
class Request:
    id: str
    prompt_ids: np.ndarray           # [prompt_len] with image tokens expanded
    images: list[ImageInput]
    image_starts: list[int]          # prompt index of each image's first token
    positions: np.ndarray            # [prompt_len] or [3, prompt_len]
    rope_delta: int
    sampling: SamplingParams
    key: np.ndarray
    detok: IncrementalDetokenizer
    arrival: float = field(default_factory=time.monotonic)
    slot: int | None = None
    prefilled: int = 0
    cached_tokens: int = 0
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] | None = None
    text: str = ""                   # text after stop-string handling
    emitted: int = 0                 # chars of `text` already streamed
    finish_reason: str | None = None
    first_token_time: float | None = None
    feats: list = field(default_factory=list)  # per image: np.ndarray [tokens, hidden] once encoded

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)


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


class Engine:
    def __init__(self, model, *, max_num_seqs: int = 8, max_model_len: int | None = None,
                 prefill_chunk: int = 256, max_encode_batch: int = 8,
                 encoder_cache_bytes: int = 512 * 2**20, max_images_per_request: int = 16):
        self.model = model
        self.tokenizer = model.tokenizer
        self.family = model.family
        max_model_len = max_model_len or min(model.family.text.max_position_embeddings, 4096)
        self.max_model_len = max_model_len
        self.prefill_chunk = prefill_chunk
        self.max_images_per_request = max_images_per_request
        self.runner = ModelRunner(model.family, model.params, max_num_seqs=max_num_seqs,
                                  max_model_len=max_model_len, prefill_chunk=prefill_chunk,
                                  max_encode_batch=max_encode_batch)
        self.encoder_cache = EncoderCache(encoder_cache_bytes)
        self.waiting: deque[Request] = deque()
        self.slots: list[Request | None] = [None] * max_num_seqs
        self.requests: dict[str, Request] = {}
        self._ids = itertools.count()
        self._seed_rng = np.random.default_rng()
        self.counters = {"requests_finished": 0, "requests_aborted": 0, "tokens_prefilled": 0,
                         "tokens_decoded": 0, "tokens_cached": 0, "encoder_calls": 0,
                         "images_encoded": 0, "decode_steps": 0, "prefill_calls": 0}

    # ---- requests ---------------------------------------------------------------------------
    def add_request(self, prompt: str | list[int], images: list[ImageInput] = (),
                    sampling: SamplingParams | None = None, request_id: str | None = None) -> str:
        """Queue a request. `prompt` holds one image placeholder per image (or is already ids
        with placeholders). Raises typed errors for requests that can never run."""
        sampling = sampling or SamplingParams()
        images = list(images)
        if len(images) > self.max_images_per_request:
            raise InvalidRequestError(f"{len(images)} images in one request exceeds the limit of "
                                      f"{self.max_images_per_request}", param="images", code="too_many_images")
        counts = [im.num_tokens for im in images]
        if isinstance(prompt, str):
            ids = self.tokenizer.encode_prompt(prompt, counts)
        else:
            ids = list(prompt)
        ids = np.asarray(ids, np.int32)
        if len(ids) == 0:
            raise InvalidRequestError("prompt is empty", param="prompt")
        if len(ids) >= self.max_model_len:
            raise ContextLengthError(f"prompt is {len(ids)} tokens (including {sum(counts)} image tokens); "
                                     f"the context is {self.max_model_len} tokens", param="messages")
        starts = self.image_starts(ids, counts)
        positions, rope_delta = self.family.positions(ids, images, starts)
        seed = sampling.seed if sampling.seed is not None else int(self._seed_rng.integers(2**31))
        key = np.asarray([0, seed & 0xFFFFFFFF], np.uint32)  # == jax.random.PRNGKey(seed) for 32-bit seeds
        rid = request_id or f"req-{next(self._ids)}"
        if rid in self.requests:
            raise InvalidRequestError(f"duplicate request id {rid!r}", param="request_id")
        req = Request(id=rid, prompt_ids=ids, images=images, image_starts=starts, positions=positions,
                      rope_delta=rope_delta, sampling=sampling, key=key,
                      detok=IncrementalDetokenizer(self.tokenizer),
                      logprobs=[] if sampling.logprobs is not None else None)
        req.feats = [None] * len(images)
        self.requests[rid] = req
        self.waiting.append(req)
        return rid

    def image_starts(self, ids: np.ndarray, counts: list[int]) -> list[int]:
        """Prompt index of each image's first token. Adjacent images form one run of image
        tokens, split by the known per-image counts."""
        is_img = ids == self.family.image_token_id
        run_starts = [int(i) for i in np.flatnonzero(is_img & ~np.r_[False, is_img[:-1]])]
        starts, i = [], 0
        for s in run_starts:
            pos = s
            while i < len(counts) and pos < len(is_img) and is_img[pos]:
                starts.append(pos)
                pos += counts[i]
                i += 1
        if len(starts) != len(counts) or (counts and sum(counts) != int(is_img.sum())):
            from mmjax.errors import PromptError
            raise PromptError(f"prompt has {int(is_img.sum())} image tokens but the images need {sum(counts)}",
                              param="images")
        return starts

    def abort(self, request_id: str) -> bool:
        req = self.requests.get(request_id)
        if req is None or req.finish_reason is not None:
            return False
        self._finish(req, "abort")
        self.counters["requests_aborted"] += 1
        return True

    def has_work(self) -> bool:
        return bool(self.waiting) or any(s is not None for s in self.slots)

    # ---- the loop ---------------------------------------------------------------------------
    def step(self) -> list[Delta]:
        deltas: list[Delta] = []
        self._admit()
        prefilling = [r for r in self.slots if r is not None and r.prefilled < r.prompt_len]
        self._encode_missing(prefilling)
        budget = self.prefill_chunk
        for req in prefilling:
            if budget <= 0:
                break
            budget -= self._prefill_chunk(req, budget, deltas)
        running = [r for r in self.slots if r is not None and r.prefilled >= r.prompt_len
                   and r.finish_reason is None]
        if running:
            max_len = max(r.prompt_len + len(r.output_ids) for r in running)
            out = self.runner.decode(max_len)
            self.counters["decode_steps"] += 1
            for r in running:
                self._append_token(r, out, r.slot, deltas)
        return deltas

    def _admit(self) -> None:
        for i, s in enumerate(self.slots):
            if s is None and self.waiting:
                req = self.waiting.popleft()
                req.slot = i
                self.slots[i] = req

    def _encode_missing(self, reqs: list[Request]) -> None:
        """Give every prefilling request its image features: from the encoder cache, or by
        encoding all missing images of all these requests together (deduplicated by key)."""
        todo: dict[str, ImageInput] = {}
        for r in reqs:
            for i, im in enumerate(r.images):
                if r.feats[i] is not None or im.key in todo:
                    continue
                cached = self.encoder_cache.get(im.key)
                if cached is not None:
                    self.encoder_cache.hits += 1
                    r.feats[i] = cached
                else:
                    self.encoder_cache.misses += 1
                    todo[im.key] = im
        if not todo:
            return
        ims = list(todo.values())
        feats = dict(zip(todo, self.family.encode_batch(self.runner, ims)))
        self.counters["encoder_calls"] += 1
        self.counters["images_encoded"] += len(ims)
        for key, f in feats.items():
            self.encoder_cache.put(key, f)
        for r in reqs:
            for i, im in enumerate(r.images):
                if r.feats[i] is None:
                    r.feats[i] = feats[im.key]

    def _image_embeds(self, req: Request, lo: int, hi: int) -> tuple[np.ndarray | None, np.ndarray]:
        """Rows [lo, hi) of the prompt's image embeddings [hi - lo, hidden] and mask [hi - lo]."""
        mask = req.prompt_ids[lo:hi] == self.family.image_token_id
        if not mask.any():
            return None, mask
        emb = np.zeros((hi - lo, self.family.text.hidden_size), np.float32)
        for feats, s in zip(req.feats, req.image_starts):
            a, b = max(s, lo), min(s + len(feats), hi)
            if a < b:
                emb[a - lo:b - lo] = feats[a - s:b - s]
        return emb, mask

    def _prefill_chunk(self, req: Request, budget: int, deltas: list[Delta]) -> int:
        lo = req.prefilled
        hi = min(req.prompt_len, lo + budget)
        emb, mask = self._image_embeds(req, lo, hi)
        sp = req.sampling
        pos = req.positions[..., lo:hi]
        out = self.runner.prefill(req.slot, lo, req.prompt_ids[lo:hi], emb, mask, pos, req.rope_delta,
                                  (sp.temperature, sp.top_k, sp.top_p, sp.min_p), req.key)
        self.counters["prefill_calls"] += 1
        self.counters["tokens_prefilled"] += hi - lo
        req.prefilled = hi
        if hi == req.prompt_len:
            req.feats = []  # the KV cache holds them now
            req.first_token_time = time.monotonic()
            self._append_token(req, out, 0, deltas)
        return hi - lo

    def _append_token(self, req: Request, out: StepOutput, row: int, deltas: list[Delta]) -> None:
        tok = int(out.tokens[row])
        req.output_ids.append(tok)
        self.counters["tokens_decoded"] += 1
        lp = None
        if req.logprobs is not None:
            n = req.sampling.logprobs
            lp = {int(i): float(v) for i, v in zip(out.top_ids[row][:n], out.top_logprobs[row][:n])}
            lp[tok] = float(out.logprobs[row])
            req.logprobs.append(lp)
        sp = req.sampling
        reason = None
        if not sp.ignore_eos and tok in self.model.eos_token_ids:
            reason = "stop"
        elif tok in sp.stop_token_ids:
            reason = "stop"
        else:
            req.text += req.detok.add(tok)
        if reason is None and sp.stop:
            hit = min((req.text.find(s) for s in sp.stop if s in req.text), default=-1)
            if hit >= 0:
                req.text = req.text[:hit]
                reason = "stop"
        if reason is None and len(req.output_ids) >= sp.max_tokens:
            reason = "length"
        if reason is None and req.prompt_len + len(req.output_ids) >= self.max_model_len:
            reason = "length"
        if reason is not None and reason != "stop":
            req.text += req.detok.flush()
        # Hold back a tail that could still become a stop string.
        hold = max((len(s) - 1 for s in sp.stop), default=0) if reason is None else 0
        upto = max(req.emitted, len(req.text) - hold)
        text = req.text[req.emitted:upto]
        req.emitted = upto
        deltas.append(Delta(req.id, [tok], text, [lp] if lp is not None else None,
                            finished=reason is not None, finish_reason=reason))
        if reason is not None:
            self._finish(req, reason)

    def _finish(self, req: Request, reason: str) -> None:
        req.finish_reason = reason
        if req.slot is not None and self.slots[req.slot] is req:
            self.slots[req.slot] = None
        elif req in self.waiting:
            self.waiting.remove(req)
        if reason != "abort":
            self.counters["requests_finished"] += 1

    # ---- results ----------------------------------------------------------------------------
    def output(self, request_id: str) -> RequestOutput:
        r = self.requests[request_id]
        return RequestOutput(r.id, r.prompt_ids.tolist(), list(r.output_ids), r.text, r.logprobs,
                             r.finish_reason, sum(im.num_tokens for im in r.images), r.cached_tokens)

    def release(self, request_id: str) -> None:
        """Forget a finished request (its output has been collected)."""
        r = self.requests.get(request_id)
        if r is not None and r.finish_reason is not None:
            del self.requests[request_id]

    def run_until_done(self, request_ids: list[str]) -> list[RequestOutput]:
        pending = set(request_ids)
        while any(self.requests[r].finish_reason is None for r in pending):
            self.step()
        outs = [self.output(r) for r in request_ids]
        for r in request_ids:
            self.release(r)
        return outs

    def stats(self) -> dict[str, Any]:
        running = sum(1 for s in self.slots if s is not None)
        return {**self.counters,
                "requests_running": running, "requests_waiting": len(self.waiting),
                "slots_total": len(self.slots), "slots_used": running,
                "encoder_cache_hits": self.encoder_cache.hits, "encoder_cache_misses": self.encoder_cache.misses,
                "encoder_cache_entries": len(self.encoder_cache), "encoder_cache_bytes": self.encoder_cache.bytes,
                "compiled_shapes": self.runner.compiled_counts(),
                "compiled_shapes_bound": self.runner.buckets.max_compilations(),
                "compile_seconds": round(self.runner.compile_seconds, 3)}
