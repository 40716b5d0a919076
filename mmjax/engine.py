"""Continuous batching over decode slots.

Each `step()`: admit waiting requests into free slots; encode every image that is not in the
encoder cache (batched across requests); prefill chunks up to `prefill_chunk` tokens in total (so
a long image prompt is spread over several steps and never freezes running streams; only the
first prompt in line is ever cut to fit); one decode
step over the lowest slots that cover every running one (the decode ladder's rows). Host-only
work (tokenize, stop strings, detokenize) stays here.
"""
from __future__ import annotations

import itertools
import logging
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from mmjax.buckets import bucket_for
from mmjax.errors import ContextLengthError, InvalidRequestError, MMJaxError
from mmjax.runner import ModelRunner, StepOutput
from mmjax.sampling import SamplingParams
from mmjax.tokenizer import IncrementalDetokenizer

log = logging.getLogger("mmjax.engine")

# Shorter shared prefixes are not worth steering slot choice for (see Engine._admit).
MIN_PREFIX_HIT = 16


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
    keys: np.ndarray | None = None   # [prompt_len] int64 prefix-cache key of each prompt token

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)


IMAGE_KEY_BIT = np.int64(1) << np.int64(62)


def token_keys(ids: np.ndarray, images: list[ImageInput], starts: list[int]) -> np.ndarray:
    """Prefix-cache key per prompt token [prompt_len] int64: text tokens are their id; image
    token j of an image is (content hash of that image + preprocessing) + j with bit 62 set, so
    two different images of the same size never share KV (vllm#20261, sglang#6583)."""
    import hashlib

    keys = ids.astype(np.int64)
    for im, s in zip(images, starts):
        h = int.from_bytes(hashlib.sha256(im.key.encode()).digest()[:7], "little")  # 56 bits
        keys[s:s + im.num_tokens] = IMAGE_KEY_BIT | np.int64(h << 5) + np.arange(im.num_tokens, dtype=np.int64)
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


class Engine:
    def __init__(self, model, *, max_num_seqs: int = 8, max_model_len: int | None = None,
                 prefill_chunk: int = 256, max_encode_batch: int = 8, max_encode_tokens: int = 4096,
                 encoder_cache_bytes: int = 512 * 2**20, max_images_per_request: int = 16,
                 enable_prefix_cache: bool = True):
        self.model = model
        self.tokenizer = model.tokenizer
        self.family = model.family
        max_model_len = max_model_len or min(model.family.text.max_position_embeddings, 4096)
        self.max_model_len = max_model_len
        self.prefill_chunk = prefill_chunk
        self.max_encode_tokens = max_encode_tokens
        self.max_images_per_request = max_images_per_request
        self.enable_prefix_cache = enable_prefix_cache
        self.runner = ModelRunner(model.family, model.params, max_num_seqs=max_num_seqs,
                                  max_model_len=max_model_len, prefill_chunk=prefill_chunk,
                                  max_encode_batch=max_encode_batch)
        self.encoder_cache = EncoderCache(encoder_cache_bytes)
        self.waiting: deque[Request] = deque()
        self.slots: list[Request | None] = [None] * max_num_seqs
        # Prefix cache: the token keys of the KV each free slot still holds (see token_keys).
        self.slot_keys: list[np.ndarray] = [np.zeros(0, np.int64) for _ in range(max_num_seqs)]
        self.slot_last_used: list[float] = [0.0] * max_num_seqs
        self.requests: dict[str, Request] = {}
        self._ids = itertools.count()
        self._seed_rng = np.random.default_rng()
        self.counters = {"requests_finished": 0, "requests_aborted": 0, "tokens_prefilled": 0,
                         "tokens_decoded": 0, "tokens_cached": 0,
                         "images_encoded": 0, "decode_steps": 0, "prefill_calls": 0}

    # ---- requests ---------------------------------------------------------------------------
    def add_request(self, prompt: str | list[int], images: list[ImageInput] = (),
                    sampling: SamplingParams | None = None, request_id: str | None = None) -> str:
        """Queue a request. `prompt` holds one image placeholder per image (or is already ids
        with placeholders). Raises typed errors for requests that can never run."""
        return self.submit(self.make_request(prompt, images, sampling, request_id))

    def make_request(self, prompt: str | list[int], images: list[ImageInput] = (),
                     sampling: SamplingParams | None = None, request_id: str | None = None) -> Request:
        """Validate and tokenize a request without touching engine state (safe from any thread)."""
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
        req = Request(id=rid, prompt_ids=ids, images=images, image_starts=starts, positions=positions,
                      rope_delta=rope_delta, sampling=sampling, key=key,
                      detok=IncrementalDetokenizer(self.tokenizer),
                      logprobs=[] if sampling.logprobs is not None else None)
        req.feats = [None] * len(images)
        req.keys = token_keys(ids, images, starts)
        return req

    def submit(self, req: Request) -> str:
        if req.id in self.requests:
            raise InvalidRequestError(f"duplicate request id {req.id!r}", param="request_id")
        self.requests[req.id] = req
        self.waiting.append(req)
        return req.id

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

    def warmup(self) -> dict[str, int]:
        """Compile every bucket of every step up front (no request may be in flight)."""
        if self.has_work():
            raise RuntimeError("warmup() needs an idle engine")
        r = self.runner
        self.family.warmup_encode(r)
        for c in r.buckets.prefill:
            pos = np.zeros((3, c) if r.mrope else (c,), np.int32)
            r.prefill(0, 0, np.zeros(c, np.int32), None, np.zeros(c, bool), pos, 0, (0.0, 0, 1.0, 0.0),
                      np.zeros(2, np.uint32))
        for rows in r.buckets.decode:
            r.decode(1, rows)
        self.reset_device_state()
        return r.compiled_counts()

    def reset_device_state(self) -> None:
        """Fresh KV cache and decode state (after a failed step may have consumed donated buffers)."""
        from mmjax.runner import init_decode_state

        r = self.runner
        r.cache = r.fresh_cache()
        r.state = init_decode_state(r.num_slots)
        self.slot_keys = [np.zeros(0, np.int64) for _ in self.slots]

    def has_work(self) -> bool:
        return bool(self.waiting) or any(s is not None for s in self.slots)

    # ---- the loop ---------------------------------------------------------------------------
    def step(self) -> list[Delta]:
        deltas: list[Delta] = []
        self._admit()
        prefilling = [r for r in self.slots if r is not None and r.prefilled < r.prompt_len]
        self._encode_missing(prefilling)
        budget = self.prefill_chunk
        for i, req in enumerate(prefilling):
            # After the first, a prompt is only started if the rest of it fits: each prefill call
            # reads every weight, so a small head chunk (the budget's remainder) costs nearly a
            # full call and splits the prompt into two padded buckets.
            if budget <= 0 or (i and req.prompt_len - req.prefilled > budget):
                break
            budget -= self._prefill_chunk(req, budget, deltas)
        running = [r for r in self.slots if r is not None and r.prefilled >= r.prompt_len
                   and r.finish_reason is None]
        if running:
            max_len = max(r.prompt_len + len(r.output_ids) for r in running)
            out = self.runner.decode(max_len, max(r.slot for r in running) + 1)
            self.counters["decode_steps"] += 1
            for r in running:
                self._append_token(r, out, r.slot, deltas)
        return deltas

    def _admit(self) -> None:
        """Move waiting requests into free slots. With the prefix cache, each goes to the free
        slot whose retained KV shares the longest prefix with it and prefill starts after that
        prefix; at least one prompt token is always recomputed to get the first token's logits.
        Without a worthwhile match (< MIN_PREFIX_HIT tokens: the chat template's opening alone
        matches every slot) the request takes the free slot that keeps the decode step's row
        count (highest busy slot + 1, rounded up the decode ladder) smallest, then the least
        recently used one, so retained prefixes survive as long as possible."""
        ladder = self.runner.buckets.decode
        while self.waiting:
            free = [i for i, s in enumerate(self.slots) if s is None]
            if not free:
                return
            req = self.waiting.popleft()
            busy_rows = max((i + 1 for i, s in enumerate(self.slots) if s is not None), default=0)
            match = {i: common_prefix(self.slot_keys[i], req.keys) if self.enable_prefix_cache else 0
                     for i in free}
            slot = max(free, key=lambda i: (match[i] if match[i] >= MIN_PREFIX_HIT else 0,
                                            -bucket_for(max(busy_rows, i + 1), ladder),
                                            -self.slot_last_used[i]))
            cached = min(match[slot], req.prompt_len - 1)
            req.slot, req.prefilled, req.cached_tokens = slot, cached, cached
            self.counters["tokens_cached"] += cached
            self.slots[slot] = req
            self.slot_keys[slot] = self.slot_keys[slot][:cached]

    def _encode_missing(self, reqs: list[Request]) -> None:
        """Give every prefilling request its image features: from the encoder cache, or by
        encoding all missing images of all these requests together (deduplicated by key)."""
        todo: dict[str, ImageInput] = {}
        for r in reqs:
            for i, im in enumerate(r.images):
                if r.feats[i] is not None or im.key in todo or r.image_starts[i] + im.num_tokens <= r.prefilled:
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
        feats: dict[str, np.ndarray] = {}
        for group in self._encode_groups(list(todo.values())):
            feats.update(zip((im.key for im in group), self.family.encode_batch(self.runner, group)))
            self.counters["images_encoded"] += len(group)
        for key, f in feats.items():
            self.encoder_cache.put(key, f)
        for r in reqs:
            for i, im in enumerate(r.images):
                if r.feats[i] is None and im.key in feats:
                    r.feats[i] = feats[im.key]

    def _encode_groups(self, images: list[ImageInput]) -> list[list[ImageInput]]:
        """Split images into encode calls of at most `max_encode_tokens` image tokens each (an
        image larger than the budget goes alone)."""
        groups, cur, n = [], [], 0
        for im in images:
            if cur and n + im.num_tokens > self.max_encode_tokens:
                groups.append(cur)
                cur, n = [], 0
            cur.append(im)
            n += im.num_tokens
        return groups + ([cur] if cur else [])

    def _image_embeds(self, req: Request, lo: int, hi: int) -> tuple[np.ndarray | None, np.ndarray]:
        """Rows [lo, hi) of the prompt's image embeddings [hi - lo, hidden] and mask [hi - lo]."""
        mask = req.prompt_ids[lo:hi] == self.family.image_token_id
        if not mask.any():
            return None, mask
        emb = np.zeros((hi - lo, self.family.text.hidden_size), np.float32)
        for feats, im, s in zip(req.feats, req.images, req.image_starts):
            a, b = max(s, lo), min(s + im.num_tokens, hi)
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
            # The cache row holds the prompt (as far as prefilled) and every output token but the
            # last (sampled, never fed back).
            held = req.keys[:req.prefilled]
            if req.prefilled == req.prompt_len and len(req.output_ids) > 1:
                held = np.concatenate([held, np.asarray(req.output_ids[:-1], np.int64)])
            self.slot_keys[req.slot] = held
            self.slot_last_used[req.slot] = time.monotonic()
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
        return {**self.counters, "encoder_calls": self.runner.calls["encode"],
                "requests_running": running, "requests_waiting": len(self.waiting),
                "slots_total": len(self.slots), "slots_used": running,
                "encoder_cache_hits": self.encoder_cache.hits, "encoder_cache_misses": self.encoder_cache.misses,
                "encoder_cache_entries": len(self.encoder_cache), "encoder_cache_bytes": self.encoder_cache.bytes,
                "compiled_shapes": self.runner.compiled_counts(),
                "compiled_shapes_bound": self.runner.buckets.max_compilations(),
                "compile_seconds": round(self.runner.compile_seconds, 3),
                "step_seconds": {k: round(v, 3) for k, v in self.runner.step_seconds.items()}}


class AsyncEngine:
    """The engine loop in a background thread, driven from asyncio (the server's face).

    Validation and image preprocessing run in the caller's executor; only the loop thread touches
    engine state. A failure inside one step fails the requests involved, never the loop.
    """

    def __init__(self, engine: Engine, *, max_waiting: int = 256):
        import threading

        self.engine = engine
        self.max_waiting = max_waiting
        self._inbox: deque = deque()          # ("add", req, queue, loop) | ("abort", rid)
        self._streams: dict[str, tuple[Any, Any]] = {}  # rid -> (asyncio.Queue, loop)
        self._wake = threading.Event()
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="mmjax-engine", daemon=True)
        self.step_log: deque = deque(maxlen=1)  # last step summary (for the server's log line)
        self._thread.start()

    # ---- called from asyncio ---------------------------------------------------------------
    def submit(self, req: Request):
        """Queue a validated request; returns an asyncio.Queue of Deltas for it."""
        import asyncio

        from mmjax.errors import QueueFullError

        if len(self.engine.waiting) + len(self._inbox) >= self.max_waiting:
            raise QueueFullError(f"server is at capacity ({self.max_waiting} queued requests); retry later")
        q: asyncio.Queue = asyncio.Queue()
        self._inbox.append(("add", req, q, asyncio.get_running_loop()))
        self._wake.set()
        return q

    async def stream(self, req: Request):
        """Async iterator of Deltas for one request; aborts it if the consumer goes away."""
        q = self.submit(req)
        finished = False
        try:
            while not finished:
                d = await q.get()
                finished = d.finished  # before yielding: a consumer may stop at the final delta
                yield d
        finally:
            if not finished:
                self.abort(req.id)

    def abort(self, request_id: str) -> None:
        self._inbox.append(("abort", request_id))
        self._wake.set()

    def stats(self) -> dict:
        return self.engine.stats()

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop the loop after finishing running work (bounded by `timeout`)."""
        deadline = time.monotonic() + timeout
        while self.engine.has_work() and time.monotonic() < deadline:
            time.sleep(0.01)
        self._stop = True
        self._wake.set()
        self._thread.join(timeout=5)

    # ---- loop thread -------------------------------------------------------------------------
    def _emit(self, rid: str, delta: Delta) -> None:
        target = self._streams.get(rid)
        if target is None:
            return
        q, loop = target
        loop.call_soon_threadsafe(q.put_nowait, delta)
        if delta.finished:
            self._streams.pop(rid, None)
            self.engine.release(rid)

    def _drain_inbox(self) -> None:
        while self._inbox:
            item = self._inbox.popleft()
            if item[0] == "add":
                _, req, q, loop = item
                if req.id in self._streams or req.id in self.engine.requests:
                    # Never touch the stream of the request that owns this id.
                    err = InvalidRequestError(f"duplicate request id {req.id!r}", param="request_id")
                    loop.call_soon_threadsafe(q.put_nowait, Delta(req.id, [], "", None, True, "error", error=err))
                    continue
                self._streams[req.id] = (q, loop)
                try:
                    self.engine.submit(req)
                except MMJaxError as e:
                    self._emit(req.id, Delta(req.id, [], "", None, True, "error", error=e))
            else:
                rid = item[1]
                if self.engine.abort(rid):
                    self._emit(rid, Delta(rid, [], "", None, True, "abort"))
                self.engine.release(rid)

    def _run(self) -> None:
        while not self._stop:
            self._drain_inbox()
            if not self.engine.has_work():
                self._wake.wait(0.05)
                self._wake.clear()
                continue
            t0 = time.monotonic()
            try:
                deltas = self.engine.step()
            except Exception as e:  # a bug or device failure: fail what was in flight, keep serving
                log.exception("engine step failed")
                deltas = self._fail_active(e)
            for d in deltas:
                self._emit(d.request_id, d)
            self.step_log.append((time.monotonic() - t0, len(deltas)))

    def _fail_active(self, exc: Exception) -> list[Delta]:
        err = MMJaxError(f"internal error while running the request: {type(exc).__name__}: {exc}")
        out = []
        for r in [s for s in self.engine.slots if s is not None]:
            self.engine._finish(r, "error")
            out.append(Delta(r.id, [], "", None, True, "error", error=err))
        self.engine.reset_device_state()
        return out
