"""Continuous batching over decode slots: the step loop.

Each `step()`: admit waiting requests into free slots (scheduler); plan this step's prefill
chunks and encode the images of those requests not in the encoder cache, batched across
requests (not every admitted request's: TTFT); prefill chunks up to `prefill_chunk` tokens in
total, the chunks of several requests packed into one call (`pack_prefill`; a long image prompt
is spread over several steps and never freezes running streams); one decode
step over the lowest slots that cover every running one (the decode ladder's rows), or, while a
step prefills, the running requests' tokens riding in its packed call (a mixed step: one weight
read for both; `_riders`). Host-only
work (tokenizing, stop strings, detokenizing) stays on the host (serving/output.py).

Overlapped steps (`overlap=True`, the default): a step's compiled calls are queued without
waiting for them, and the host reads the previous step's sampled tokens (detokenizing, stop
strings, streaming) while the device runs this one. Each decode step takes its input tokens
from the decode state on the device (the previous step's samples), so nothing waits for the
host. A request is known to be done at most one step late: a stop string, EOS, stop id or abort
seen in step N's tokens leaves one more token of it in step N + 1, which is discarded (its slot
is parked and freed after that step: every later call into the slot is ordered after it on the
device through the donated cache). A request that must end by max_tokens / max_model_len is
known in advance and not decoded again. Rows with host constraints (a grammar or multi-token
bad words: their next bitmask is computed from the previous token on the host) make a step
synchronous: while such a request decodes, the previous step is read before the next is queued.

Failures stay with their culprit: an image that fails to encode fails its own request; a prefill
that fails before it consumed the donated cache fails only its request (a packed call that fails
so is retried one request at a time). Only a failure that lost
the device state (a donated cache consumed by a failed call) ends the requests it held; prompts
that had produced nothing yet go back to the queue.
"""
from __future__ import annotations

import dataclasses
import itertools
import logging
import threading
import time
from typing import Any

import numpy as np

from mmjax.errors import ContextLengthError, InvalidRequestError, MMJaxError, PromptError, UnsupportedModelError
from mmjax.models.family import ImageInput, image_runs, run_spans
from mmjax.serving.caches import EncoderCache, PrefixCache, salt_keys, token_keys
from mmjax.serving import prompt_logprobs
from mmjax.serving.output import append_token
from mmjax.serving.pages import KVPages, page_hashes
from mmjax.serving.request import Delta, Request, RequestOutput
from mmjax.serving.runner import ModelRunner, PrefillChunk
from mmjax.serving.constraints import BadWords, bad_word_ids
from mmjax.serving.sampling import SamplingParams, SlotSampling, vocab_row
from mmjax.serving.scheduler import Scheduler
from mmjax.serving.state_snapshots import ROWS_PER_SLOT, SnapshotIndex
from mmjax.serving.structured import Grammar, GrammarCompiler, GrammarError, allowed_bits, grammar_constraint
from mmjax.tokenizer import IncrementalDetokenizer

log = logging.getLogger("mmjax.engine")

# requests whose chunks one prefill call packs at most (pack_prefill; models/nn/packing.py):
# each sequence past the first may add one 32-query attention block (an unaligned segment end);
# the compiled block layout holds S - 1 such blocks, skipped at run time while unneeded
MAX_PREFILL_SEQS = 8


def _as_error(exc: BaseException, what: str) -> MMJaxError:
    if isinstance(exc, MMJaxError):
        return exc
    return MMJaxError(f"internal error while {what}: {type(exc).__name__}: {exc}")


class Engine:
    def __init__(self, model, *, max_num_seqs: int = 8, max_model_len: int | None = None,
                 prefill_chunk: int = 256, max_encode_batch: int = 8, max_encode_tokens: int = 4096,
                 encoder_cache_bytes: int = 512 * 2**20, max_images_per_request: int = 16,
                 enable_prefix_cache: bool = True, mesh=None, vision_tensor_parallel: bool = False,
                 vision_offload: bool = False, memory_budget: int | float | None = None,
                 kv_cache_dtype: str = "auto", overlap: bool = True, pack_prefill: bool = True,
                 decode_steps: int = 1, primary: bool = True, page_size: int | None = None,
                 kv_cache_bytes: int | None = None, max_loras: int = 0, max_lora_rank: int = 16):
        """overlap: queue each step before reading the previous step's tokens (module docstring).
        primary: this engine's runner places the live module's weights (a data-parallel replica
        past the first places a copy on its own devices).
        pack_prefill: the prefill chunks of several requests in one packed call (False: one call
        per request). decode_steps: tokens a running request gets per decode call (vLLM's
        multi-step scheduling): the host's cost of a call is paid once for that many steps,
        while new requests' prefills and stop checks wait for the call; a request that stops
        inside a call has the rest of its tokens discarded. Calls with grammar-constrained or
        FastV-pruned requests, or a request within decode_steps of the context end, take one
        step. page_size / kv_cache_bytes: the paged KV cache (`ModelRunner`; page_size 0: a
        cache row of max_model_len per slot): requests are admitted by free pages, share
        prompt prefixes by page, and the latest admitted is preempted (recomputed later) when a
        running request needs a page and none is free.
        max_loras: LoRA adapters served at once (0: none), each of rank up to max_lora_rank
        (mmjax.lora; `load_lora`)."""
        self.model = model
        self.adapters = None
        if max_loras:      # the adapter slots, before the runner places the weights
            from mmjax.lora import Adapters
            self.adapters = Adapters.enable(model.module, max_loras, max_lora_rank, mesh)
        self.overlap = overlap
        # dispatched calls whose sampled tokens the host has not read yet, in dispatch order:
        # (PendingOutput, [(request, output row)], steps); see _collect
        self._pending: list[tuple[Any, list[tuple[Request, int]], int]] = []
        self.tokenizer = model.tokenizer
        self.family = model.family
        max_model_len = max_model_len or min(model.module.language_model.max_position_embeddings, 4096)
        self.max_model_len = max_model_len
        self.prefill_chunk = prefill_chunk
        self.max_encode_tokens = max_encode_tokens
        self.max_images_per_request = max_images_per_request
        self.runner = ModelRunner(model.family, model.module, max_num_seqs=max_num_seqs,
                                  max_model_len=max_model_len, prefill_chunk=prefill_chunk,
                                  max_encode_batch=max_encode_batch, mesh=mesh,
                                  vision_tensor_parallel=vision_tensor_parallel, vision_offload=vision_offload,
                                  memory_budget=memory_budget, kv_cache_dtype=kv_cache_dtype,
                                  max_prefill_seqs=MAX_PREFILL_SEQS if pack_prefill else 1,
                                  decode_steps=decode_steps, primary=primary, page_size=page_size,
                                  kv_cache_bytes=kv_cache_bytes)
        max_num_seqs = self.runner.num_slots        # what the memory budget left room for
        self.encoder_cache = EncoderCache(encoder_cache_bytes)
        r = self.runner
        # paged: the pages of every request and the page table the steps read (serving/pages.py);
        # the per-slot prefix cache is for decoders whose cache keeps a row per slot
        self.pages = KVPages(r.num_pages, r.page_size, max_num_seqs, max_model_len,
                             enable_cache=enable_prefix_cache) if r.paged else None
        self.prefix_cache = PrefixCache(max_num_seqs, enable_prefix_cache and not r.paged)
        self.snapshots = self._state_snapshots(enable_prefix_cache)
        self.scheduler = Scheduler(max_num_seqs, self.runner.buckets.decode, prefill_chunk, self.prefix_cache,
                                   min_resume=self._min_resume(), max_segments=self.runner.buckets.segments[-1],
                                   pages=self.pages, resume_at=None if self.snapshots is None else self.snapshots.longest)
        self.grammars = GrammarCompiler(self.tokenizer, self.runner.vocab_size, model.eos_token_ids)
        self.requests: dict[str, Request] = {}
        self._step_lock = threading.RLock()     # one step, or a refresh, at a time
        self._ids = itertools.count()
        self._seed_rng = np.random.default_rng()
        self.counters = {"requests_finished": 0, "requests_aborted": 0, "requests_failed": 0,
                         "tokens_prefilled": 0, "tokens_decoded": 0, "tokens_cached": 0,
                         "images_encoded": 0, "videos_encoded": 0, "decode_steps": 0, "prefill_calls": 0,
                         "prefill_chunks": 0, "mixed_steps": 0,
                         "tokens_pruned": 0, "preemptions": 0}

    def _state_snapshots(self, enabled: bool) -> SnapshotIndex | None:
        """A hybrid decoder's (`state_layers`) prefix cache of recurrent states: the host index of
        a pool of ROWS_PER_SLOT rows a slot (none when prefix caching is off: nothing then
        resumes); None for decoders without recurrent states."""
        if not self.runner.text_model.state_layers:
            return None
        rows = ROWS_PER_SLOT * self.runner.num_slots if enabled else 0
        if rows:
            self.runner.init_state_pool(rows)
        return SnapshotIndex(rows)

    def _snapshot_states(self, reqs: list[Request]) -> None:
        """After a prefill call: a hybrid decoder's states at the end of each of its chunks (the
        slot's row holds exactly them now, before any decode step) into the snapshot pool, keyed
        by the prompt prefix they end."""
        if self.snapshots is None or not self.prefix_cache.enabled:
            return
        try:
            for req in reqs:
                if req.prefilled <= req.prompt_len and req.prune is None:
                    row = self.snapshots.claim(req.keys[:req.prefilled])
                    if row is not None:
                        self.runner.save_state(req.slot, row)
        except Exception as e:
            self.snapshots.clear()
            self._device_failure(None, _as_error(e, "snapshotting recurrent states"), [])

    def _resume_states(self, req: Request, keys: np.ndarray, slot: int) -> None:
        """A hybrid decoder's request resuming after the prefix `keys` (from the prefix cache, or a
        forked sibling): slot `slot`'s recurrent states from the snapshot that ends it."""
        if self.snapshots is not None and len(keys):
            self.runner.load_state(self.snapshots.row(keys), slot)

    def _min_resume(self):
        """The decoder's prefix-reuse floor for this engine's caches."""
        tm, chunk = self.runner.text_model, self.runner.buckets.prefill[-1]
        return lambda held: tm.min_resume(held, chunk)

    # ---- requests ---------------------------------------------------------------------------
    @property
    def max_prompt_bytes(self) -> int:
        """Longest prompt text (UTF-8 bytes) that could still fit the context: anything longer is
        rejected before the tokenizer runs (tokenizing 100 MiB of text costs seconds and GBs)."""
        return self.max_model_len * self.tokenizer.max_token_bytes

    @property
    def waiting(self):
        return self.scheduler.waiting

    @property
    def slots(self) -> list[Request | None]:
        return self.scheduler.slots

    def add_request(self, prompt: str | list[int], images: list[ImageInput] = (),
                    sampling: SamplingParams | None = None, request_id: str | None = None,
                    prune: tuple[int, int] | None = None) -> str:
        """Queue a request. `prompt` holds one image placeholder per image (or is already ids
        with placeholders). Raises typed errors for requests that can never run."""
        return self.submit(self.make_request(prompt, images, sampling, request_id, prune))

    def make_request(self, prompt: str | list[int], images: list[ImageInput] = (),
                     sampling: SamplingParams | None = None, request_id: str | None = None,
                     prune: tuple[int, int] | None = None, lora: str | None = None) -> Request:
        """Validate and tokenize a request without touching engine state (safe from any thread).
        prune (layer, keep): FastV, keep `keep` image tokens after decoder `layer` (see
        mmjax.research.Prune). lora: the name of a loaded LoRA adapter (None: the base model)."""
        adapter = self.lora_slot(lora)
        if lora is not None and prune is not None:
            raise InvalidRequestError("image-token pruning cannot be combined with a LoRA adapter", param="model")
        sampling = sampling or SamplingParams()
        if not isinstance(sampling, SamplingParams):
            raise InvalidRequestError(f"sampling must be a SamplingParams, got {type(sampling).__name__}",
                                      param="sampling")
        images = list(images)
        if len(images) > self.max_images_per_request:
            raise InvalidRequestError(f"{len(images)} images in one request exceeds the limit of "
                                      f"{self.max_images_per_request}", param="images", code="too_many_images")
        counts = [im.num_tokens for im in images]
        if isinstance(prompt, str):
            try:
                n_bytes = len(prompt.encode("utf-8"))
            except UnicodeEncodeError as e:  # a lone surrogate (e.g. JSON "\ud800") is not text
                raise InvalidRequestError(f"prompt text is not valid Unicode: {e.reason} at character {e.start}",
                                          param="messages", code="invalid_text") from None
            if n_bytes > self.max_prompt_bytes:
                raise ContextLengthError(f"prompt text is {n_bytes} bytes, more than any prompt that fits the "
                                         f"context of {self.max_model_len} tokens can hold "
                                         f"({self.max_prompt_bytes} bytes)", param="messages")
            ids = self.tokenizer.encode_prompt(prompt, counts, self.family.image_prompts(images),
                                               [self.family.token_id_of(im) for im in images])
        else:
            ids = list(prompt)
        ids = np.asarray(ids, np.int32)
        if len(ids) == 0:
            raise InvalidRequestError("prompt is empty", param="prompt")
        if len(ids) >= self.max_model_len:
            raise ContextLengthError(f"prompt is {len(ids)} tokens (including {sum(counts)} image tokens); "
                                     f"the context is {self.max_model_len} tokens", param="messages")
        starts = self.family.image_starts(ids, counts)
        for i, (im, st) in enumerate(zip(images, starts)):
            if counts[i] and ids[st] != self.family.feature_token_id(im):
                raise PromptError(f"input {i} is {'a video' if im.kind == 'video' else 'an image'} but its "
                                  "placeholder tokens are not", param="videos" if im.kind == "video" else "images")
        runs = None
        if self.family.bidirectional_images:
            runs = image_runs(ids, self.family.image_token_id)
            longest = int((runs[:, 1] - runs[:, 0]).max(initial=0))
            if longest > self.prefill_chunk:
                raise ContextLengthError(f"an image of {longest} tokens must be prefilled in one chunk, but "
                                         f"prefill_chunk is {self.prefill_chunk}", param="images")
        positions, rope_delta = self.family.positions(ids, images, starts)
        cross = self.family.cross_ranges(ids, images) if self.family.cross_attention else None
        image_pos = np.flatnonzero(np.isin(ids, self.family.media_token_ids))
        if prune is not None:
            self._check_prune(prune, len(ids), len(image_pos))
            if sampling.prompt_logprobs is not None:
                raise InvalidRequestError("prompt_logprobs cannot be combined with image-token pruning",
                                          param="prompt_logprobs")
        seed = sampling.seed if sampling.seed is not None else int(self._seed_rng.integers(2**31))
        key = np.asarray([0, seed & 0xFFFFFFFF], np.uint32)  # == jax.random.PRNGKey(seed) for 32-bit seeds
        rid = request_id or f"req-{next(self._ids)}"
        vrow, constraints, allow = self._token_rules(sampling, ids)
        keys = token_keys(ids, images, image_pos, all_images_first=cross is not None)
        if lora is not None:           # the adapter's KV is not the base model's
            keys = salt_keys(keys, self.adapters.salt(lora))
        return Request(id=rid, prompt_ids=ids, images=images, image_starts=starts, positions=positions,
                       rope_delta=rope_delta, sampling=sampling, key=key,
                       detok=IncrementalDetokenizer(self.tokenizer, sampling.skip_special_tokens),
                       keys=keys, cross=cross, lora=lora, adapter=adapter,
                       encoder_salt=self.adapters.encoder_salt(lora) if lora is not None else "",
                       logprobs=[] if sampling.logprobs is not None else None, feats=[im.embeds for im in images],
                       image_pos=image_pos, runs=runs, prune=None if prune is None else tuple(prune),
                       vrow=vrow, constraints=constraints, allow=allow)

    def siblings(self, req: Request, n: int) -> list[Request]:
        """n > 1: `req` and n - 1 copies sampling the same prompt (ids `{id}-1` ...), each with its
        own PRNG stream (with a seed: (i, seed), so the same seed gives the same choices; request
        0 keeps the key a lone request with that seed has). The copies wait until `req`'s prompt
        is in the cache, then copy its cache row and recompute only the last prompt token."""
        out = [req]
        seed = req.sampling.seed
        for i in range(1, n):
            sp = dataclasses.replace(req.sampling, prompt_logprobs=None)   # choice 0 carries the prompt's
            key = (np.asarray([i, seed & 0xFFFFFFFF], np.uint32) if seed is not None
                   else np.asarray([0, int(self._seed_rng.integers(2**31))], np.uint32))
            vrow, constraints, allow = self._token_rules(sp, req.prompt_ids)
            out.append(dataclasses.replace(
                req, id=f"{req.id}-{i}", sampling=sp, key=key,
                detok=IncrementalDetokenizer(self.tokenizer, sp.skip_special_tokens),
                logprobs=[] if sp.logprobs is not None else None, feats=list(req.feats), vrow=vrow,
                constraints=constraints, allow=allow, parent=req, index=i, output_ids=[], arrival=time.monotonic()))
        return out

    def _fork(self, parent: Request) -> None:
        """`parent`'s prompt is now in its cache row: waiting siblings take free slots holding a
        copy of that row (all but the last prompt token count as cached)."""
        n = parent.prompt_len - 1
        if self.snapshots is not None:      # recurrent states: from the last snapshot of the prompt
            n = self.snapshots.longest(parent.keys, n)
        # a pruned row is compacted, a ring-buffer row may not resume that late, a last token
        # that is an image token needs its features again: those siblings prefill themselves
        if (parent.prune is not None or n < self.scheduler.min_resume(parent.prompt_len)
                or parent.prompt_ids[-1] in self.family.media_token_ids or (self.snapshots is not None and not n)):
            return
        for sib in [r for r in self.scheduler.waiting if r.parent is parent]:
            slot = self.scheduler.fork_slot()
            if slot is None:
                return
            if self.pages is not None:
                if not self._fork_pages(parent, sib, slot, n):
                    return
                continue
            try:
                self.runner.copy_slot(parent.slot, slot)
                self._resume_states(sib, parent.keys[:n], slot)
            except Exception as e:
                self._device_failure(None, _as_error(e, "copying a prompt's cache row"), [])
                return
            self.scheduler.waiting.remove(sib)
            self.scheduler.place(sib, slot, n)
            self.prefix_cache.retain(slot, parent.keys[:n])
            self.counters["tokens_cached"] += n

    def _fork_pages(self, parent: Request, sib: Request, slot: int, n: int) -> bool:
        """A paged sibling: parent's full prompt pages shared, its partial page copied, a page
        for the recomputed last token and the first decode (False: the pool is short; the
        sibling is admitted later, its prompt's pages shared through the prefix cache)."""
        kv = self.pages
        full = n // kv.page_size
        if kv.pool.num_free < kv.pages_for(min(parent.prompt_len + 1, kv.max_pages * kv.page_size)) - full \
                + len(self.scheduler.active()):
            return False
        copies = kv.fork(parent, sib, slot, n)
        if copies is None:
            return False
        kv.grow(sib, min(parent.prompt_len + 1, kv.max_pages * kv.page_size))
        try:
            self._sync_pages()
            self.runner.copy_pages(copies)
        except Exception as e:
            kv.release(sib)
            self._device_failure(None, _as_error(e, "copying a prompt's cache page"), [])
            return False
        self.scheduler.waiting.remove(sib)
        self.scheduler.place(sib, slot, n)
        self.counters["tokens_cached"] += n
        return True

    def _sync_pages(self) -> None:
        """The host page table to the device before a step reads it (when it changed)."""
        kv = self.pages
        if kv is not None and kv.dirty:
            self.runner.set_pages(kv.table)
            kv.dirty = False

    def _ensure_pages(self, reqs: list[Request], steps: int, deltas: list[Delta]) -> list[Request]:
        """Pages for the cache positions `steps` more decode steps of `reqs` write; where the
        pool runs dry, the latest admitted request is preempted (recomputed when pages free up)
        until they fit -> the requests of `reqs` still running (a request that fits
        max_model_len never fails for lack of pages: the pool holds at least one such)."""
        kv = self.pages
        if kv is None:
            return reqs
        top = kv.max_pages * kv.page_size
        while True:
            reqs = [r for r in reqs if r.finish_reason is None and r.slot is not None]
            short = [r for r in reqs
                     if not kv.grow(r, min(r.prompt_len + len(r.output_ids) + r.inflight + steps - 1, top))]
            if not short:
                break
            self._collect(deltas)       # nothing in flight: a preempted request resumes from what it produced
            victims = [r for r in self.scheduler.active() if r.finish_reason is None and r.prune is None]
            if not victims:
                for r in short:
                    self.fail_request(r, MMJaxError("out of KV cache pages and nothing to preempt"), deltas)
                continue
            self._preempt(max(victims, key=lambda r: r.admitted_seq))
        self._sync_pages()
        return reqs

    def _preempt(self, req: Request) -> None:
        """Free `req`'s pages and queue it again (first): its prompt, and the output tokens it
        produced but the last, are prefilled again when it is readmitted (their full pages often
        still cached), then its saved decode-state row is restored and it decodes on."""
        if not req.prefilling and req.output_ids:
            req.resume_row = self.runner.save_row(req.slot)
            req.resume_ids = np.asarray(req.output_ids[:-1], np.int32)
            req.page_hashes = page_hashes(req.seq_keys(), self.pages.page_size, req.cache_salt)
        elif req.resume_ids is None:
            req.prompt_scores = None        # recomputed with the prompt
        req.feats = [im.embeds for im in req.images]
        req.cross_filled = False
        self.runner.park(req.slot)
        self.scheduler.preempt(req)
        self.counters["preemptions"] += 1
        log.info("preempted request %s (%d tokens produced)", req.id, len(req.output_ids))

    def _token_rules(self, sp: SamplingParams, prompt_ids: np.ndarray):
        """(VocabRow or None, host constraints, allowed-token bitmask or None) of a request:
        penalties, logit_bias, allowed_token_ids, min_tokens and bad words (token ids checked
        against the vocabulary), and its structured-output grammar, if any (refused up front
        when it cannot be satisfied, within allowed_token_ids / bad words too). The bitmask
        holds the tokens allowed_token_ids and one-token bad words leave (None: all), for the
        per-step check that a constrained request still has a token to sample (`_bits`)."""
        vocab = self.runner.vocab_size
        for name, ids in (("logit_bias", list(sp.logit_bias or ())), ("allowed_token_ids", sp.allowed_token_ids or ())):
            bad = [t for t in ids if t >= vocab]
            if bad:
                raise InvalidRequestError(f"{name} holds token id {bad[0]}, out of the vocabulary (size {vocab})",
                                          param=name)
        constraints: list = []
        single: list[int] = []
        if sp.bad_words:
            seqs = bad_word_ids(self.tokenizer, sp.bad_words)
            single = [s[0] for s in seqs if len(s) == 1]
            if any(len(s) > 1 for s in seqs):
                constraints.append(BadWords(seqs))
        allow = allowed_bits(self.runner.bit_words, vocab, sp.allowed_token_ids, single)
        if allow is not None and not allow.any():
            raise InvalidRequestError("no token is left to sample: bad_words ban every one of allowed_token_ids",
                                      param="bad_words")
        if sp.structured is not None:
            constraints.append(grammar_constraint(self, sp.structured, allow))
        vrow = None
        if sp.needs_vocab_row:
            vrow = vocab_row(sp, vocab, prompt_ids, self.model.eos_token_ids, single)
        return vrow, constraints, (allow if constraints else None)

    def _bits(self, req: Request, out: np.ndarray) -> None:
        """AND `req`'s host constraints into its bitmask row out [bit_words]. Raises (the request's
        error: GrammarError for an output constraint) when its grammar's matcher fails or no
        token is left to sample (within allowed_token_ids / one-token bad words too)."""
        for c in req.constraints:
            c.fill(out, req.output_ids)
        left = out if req.allow is None else out & req.allow
        if not left.any():
            g = next((c for c in req.constraints if isinstance(c, Grammar)), None)
            if g is not None:
                raise GrammarError(f"the output constraint '{g.param}' cannot go on after {len(req.output_ids)} "
                                   "generated token(s): no token it allows is left"
                                   + (" within allowed_token_ids / bad_words" if req.allow is not None else ""),
                                   param=g.param)
            raise InvalidRequestError(f"no token is left to sample after {len(req.output_ids)} generated token(s): "
                                      "bad_words ban every token allowed_token_ids leaves", param="bad_words")

    def _check_prune(self, prune, prompt_len: int, n_image: int) -> None:
        tm = self.runner.text_model
        if not tm.supports_prune:
            raise UnsupportedModelError(f"token pruning is not implemented for {type(tm).__name__}",
                                        param="intervention")
        layer, keep = prune
        last = tm.max_prune_layer     # a later layer must remain
        if not 0 <= layer <= last:
            raise InvalidRequestError(f"Prune.layer must lie in [0, {last}] for this model, got {layer}",
                                      param="intervention.layer")
        if not 1 <= keep <= n_image:
            raise InvalidRequestError(f"Prune.keep must lie in [1, {n_image}] (the prompt's image tokens), "
                                      f"got {keep}", param="intervention.keep")
        if prompt_len > self.prefill_chunk:
            raise ContextLengthError(f"a pruned request is prefilled in one call: its prompt of {prompt_len} "
                                     f"tokens is over prefill_chunk={self.prefill_chunk}", param="intervention")

    def submit(self, req: Request) -> str:
        if req.lora is not None and self.lora_slot(req.lora) != req.adapter:   # unloaded since it was made
            from mmjax.errors import LoRANotFoundError
            raise LoRANotFoundError(f"the adapter {req.lora!r} was unloaded", param="model")
        if req.id in self.requests:
            raise InvalidRequestError(f"duplicate request id {req.id!r}", param="request_id")
        self.requests[req.id] = req
        if self.pages is not None:
            req.pages = []
            req.page_hashes = page_hashes(req.keys, self.pages.page_size, req.cache_salt)
        self.scheduler.add(req)
        return req.id

    def abort(self, request_id: str) -> bool:
        req = self.requests.get(request_id)
        if req is None or req.finish_reason is not None:
            return False
        self._finish(req, "abort")
        self.counters["requests_aborted"] += 1
        return True

    def warmup(self, progress=None) -> dict[str, int]:
        """Compile every bucket of every step up front (no request may be in flight). Each shape
        compiled is reported as `progress(n, total, kind, shape, seconds)` (shape n of the
        runner's `max_compilations()` total, the ones compiled before counted), by default one
        INFO line on the `mmjax.progress` logger (quiet unless logging or `verbose=` asks)."""
        from mmjax import progress as _progress

        if self.has_work():
            raise RuntimeError("warmup() needs an idle engine")
        runner, report = self.runner, progress or _progress.log_compiled
        bound = runner.max_compilations()
        done = [sum(len(runner.compiled.get(k, ())) for k in bound)]

        def on_compile(kind, shape, seconds):
            done[0] += 1
            report(done[0], max(done[0], sum(bound.values())), kind, shape, seconds)
        runner.on_compile = on_compile
        try:
            runner.warmup()
        finally:
            runner.on_compile = None
        self.reset_device_state()
        return self.runner.compiled_counts()

    @property
    def replicas(self) -> list["Engine"]:
        """The engines serving this model's requests: this one (DataParallelEngine: one per replica)."""
        return [self]

    # ---- LoRA adapters ----------------------------------------------------------------------
    def lora_slot(self, name: str | None) -> int:
        """The adapter slot of a loaded adapter (None: -1, the base model); LoRANotFoundError."""
        if name is None:
            return -1
        if self.adapters is None:
            from mmjax.errors import LoRANotFoundError
            raise LoRANotFoundError(f"the model {name!r} does not exist (this engine serves no LoRA adapters: "
                                    "max_loras=0)", param="model")
        return self.adapters.slot_of(name)

    @property
    def lora_names(self) -> list[str]:
        return [] if self.adapters is None else sorted(self.adapters.loaded)

    def load_lora(self, name: str, path, adapter=None) -> int:
        """Load a PEFT LoRA adapter (directory or hub id; or an already read `mmjax.lora.Adapter`)
        into a free slot under `name`, between steps -> its slot. Writes arrays only: nothing
        recompiles. LoRAError: malformed, unsupported, rank over max_lora_rank, no free slot."""
        from mmjax.errors import LoRAError
        from mmjax.lora import read_adapter
        if self.adapters is None:
            raise LoRAError("this engine serves no LoRA adapters (start it with max_loras > 0)", param="max_loras")
        import jax
        if jax.process_count() > 1:     # the followers' copies of the weights would not get it
            raise LoRAError("LoRA adapters are not supported on a multi-host engine", param="max_loras")
        adapter = adapter or read_adapter(path, name)       # off the step lock: reading may take a while
        with self._step_lock:
            busy = {r.adapter for r in self.requests.values() if r.finish_reason is None and r.adapter >= 0}
            slot = self.adapters.load(name, adapter, busy)
            self.runner.refresh()           # the changed leaves re-placed; same graph, no compile
            return slot

    def unload_lora(self, name: str) -> None:
        """Forget adapter `name`; its slot is reused once the requests still using it end."""
        with self._step_lock:
            if self.adapters is None:
                self.lora_slot(name)
            self.adapters.unload(name)

    def refresh(self) -> set[str]:
        """Serve the edited live model (`vlm.model`): the runner re-splits and re-places what
        changed (`ModelRunner.refresh`); features of the old vision weights leave the encoder
        cache and KV of the old weights the prefix cache. Between steps (the step lock): calls
        already dispatched finish on the weights they were given; requests already running keep
        the KV they have and continue on the new weights. -> the parts that changed."""
        with self._step_lock:
            changed = self.runner.refresh()
            if "vision" in changed:
                self.encoder_cache.clear()
            if changed:
                self.prefix_cache.clear()
                if self.snapshots is not None:
                    self.snapshots.clear()
                if self.pages is not None:
                    self.pages.pool.clear_cache()
            return changed

    def reset_device_state(self) -> None:
        """Fresh KV cache and decode state; the prefix cache forgets what the old one held (and
        tokens of steps still in flight are dropped)."""
        self._drop_pending()
        self.runner.reset_device_state()
        self.prefix_cache.clear()
        if self.snapshots is not None:
            self.snapshots.clear()
        if self.pages is not None:
            self.pages.reset()

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    # ---- the loop ---------------------------------------------------------------------------
    def step(self) -> list[Delta]:
        with self._step_lock:
            return self._step()

    def _step(self) -> list[Delta]:
        deltas: list[Delta] = []
        # running requests' pages for this step first (preempting if need be), then admissions
        self._ensure_pages([r for r in self.scheduler.decoding() if not self._must_end(r)],
                           self.runner.decode_steps, deltas)
        for req in self.scheduler.admit():
            if not req.preemptions:
                self.counters["tokens_cached"] += req.cached_tokens
            try:
                self._resume_states(req, req.keys[:req.prefilled], req.slot)
            except Exception as e:
                self._device_failure(req, _as_error(e, "restoring a prefix's recurrent states"), deltas)
        for req in self.scheduler.active():      # their step compiled in the background: take part again
            if req.compile_wait is not None and self.runner.compile_done(req.compile_wait):
                req.compile_wait = None
        # a chunked prompt leaves room for the requests that would ride in its call (mixed step)
        plan = self.scheduler.prefill_plan(reserve=len(self._riders([])))
        # only the images this step's prefill chunks need: encoding every admitted request's
        # images up front would put all of them before the first request's first token
        self._encode_missing([r for r, _ in plan], deltas)
        plan = [(r, n) for r, n in plan if r.finish_reason is None]
        # FastV (a whole prompt) and prompt_logprobs (the one-sequence scores step, which waits)
        # take a call of their own; the rest is packed, one call per step (scheduler budget)
        alone = [x for x in plan if x[0].prune is not None or self._scores_prompt(x[0])]
        for item in alone:
            if self._await_compile(*item, deltas):
                continue        # its shape compiles off this thread; the others go on meanwhile
            self._prefill([item], deltas)
        plan = [x for x in plan if not any(x[0] is a[0] for a in alone)]
        size = self.runner.buckets.segments[-1]
        groups = [plan[i:i + size] for i in range(0, len(plan), size)]
        # the requests decoding before this step's prefill ride in its last packed call (a mixed
        # step: one weight read for both) where they can
        riders = self._riders(groups[-1]) if groups else []
        for group in groups[:-1] if riders else groups:
            self._prefill(group, deltas)
        if riders and self._prefill(groups[-1], deltas, riders):
            # this step's decode is done; prompts the call finished decode from the next step on
            # (one with host constraints makes the engine synchronous from now, as below)
            sync = not self.overlap or any(r.constraints for r in self.scheduler.decoding())
            self._collect(deltas, keep=0 if sync else 1)
            return deltas
        running = self.scheduler.decoding()
        # host constraints need the previous token for the next bitmask: no overlap then
        sync = not self.overlap or any(r.constraints for r in running)
        if sync:
            self._collect(deltas)
        running = [r for r in self.scheduler.decoding() if not self._must_end(r)]
        queued = bool(running) and self._decode(running, deltas)
        # read what was queued before this step's decode (the previous decode, this step's
        # prefills) while the decode runs; synchronous: everything
        self._collect(deltas, keep=1 if queued and not sync else 0)
        if not deltas and not self._pending and any(r.compile_wait is not None for r in self.scheduler.active()):
            self.runner.wait_compiling(0.05)     # nothing else to do: do not spin
        return deltas

    def _await_compile(self, req: Request, n: int, deltas: list[Delta]) -> bool:
        """Is `req`'s call (FastV or prompt_logprobs: a shape of its own) still compiling in the
        background (`ModelRunner.ready`)? Then it waits, holding its slot, and the scheduler
        passes it over until the compile is done (True). A failed compile fails it."""
        try:
            chunk = self._prefill_chunk(req, n)
        except Exception:       # _prefill meets the same error and handles it
            return False
        try:
            if self.runner.ready([chunk], req.prune):
                return False
        except Exception as e:
            self.fail_request(req, _as_error(e, "compiling the request's step"), deltas)
            return True
        req.compile_wait = self.runner.compile_key([chunk], req.prune)
        return True

    def _riders(self, group: list[tuple[Request, int]]) -> list[Request]:
        """The running requests whose next token a mixed step computes beside `group`'s chunks
        (runner.mixes): all that decode this step, unless one needs the host between tokens
        (constraints), per-layer lengths (a pruned request) or their tokens would not fit the
        largest rung beside the chunks ([]: prefill and decode as two calls)."""
        if not self.runner.mixes:
            return []
        running = [x for x in self.scheduler.decoding() if not self._must_end(x)]
        if any(x.constraints or x.prune is not None for x in running):
            return []
        if sum(n for _, n in group) + len(running) > self.runner.buckets.prefill[-1]:
            return []
        return running

    def _must_end(self, req: Request) -> bool:
        """Will `req` end on a token already in flight (max_tokens or the context reached)? Then
        it is not decoded again (its row, if the step covers it, writes only its own slot)."""
        n = len(req.output_ids) + req.inflight
        return n >= req.sampling.max_tokens or req.prompt_len + n >= self.max_model_len

    def _collect(self, deltas: list[Delta], keep: int = 0) -> None:
        """Read the tokens of the dispatched calls, oldest first, all but the newest `keep`, and
        hand them to their requests (rows of requests that ended meanwhile are discarded). A
        call that failed on the device fails what it held (`_device_failure`)."""
        while len(self._pending) > keep:
            pending, rows, steps = self._pending.pop(0)
            for req, _ in rows:
                req.inflight -= steps
            try:
                outs = pending.result().steps()
            except Exception as e:
                self._device_failure(None, _as_error(e, "running a step"), deltas)
                return
            for out in outs:
                for req, row in rows:
                    if req.finish_reason is None:
                        if req.first_token_time is None:
                            req.first_token_time = time.monotonic()
                        self._emit_token(req, out, row, deltas)

    def _drop_pending(self) -> None:
        for _, rows, steps in self._pending:
            for req, _ in rows:
                req.inflight -= steps
        self._pending = []

    def _dispatched(self, pending, rows: list[tuple[Request, int]], steps: int = 1) -> None:
        for req, _ in rows:
            req.inflight += steps
        self._pending.append((pending, rows, steps))

    def fail_request(self, req: Request, err: MMJaxError, deltas: list[Delta]) -> None:
        """End `req` with `err` (an error delta is appended to `deltas`)."""
        if req.finish_reason is not None:
            return
        req.error = err
        self._finish(req, "error")
        self.counters["requests_failed"] += 1
        deltas.append(Delta(req.id, [], "", None, True, "error", error=err))

    def fail_active(self, err: MMJaxError) -> list[Delta]:
        """End every request holding a slot with `err` and start from a fresh device state
        (after a failure outside the step's own isolation); returns their error deltas."""
        out: list[Delta] = []
        for r in self.scheduler.active():
            self.fail_request(r, err, out)
        self.reset_device_state()
        return out

    def _encode_missing(self, reqs: list[Request], deltas: list[Delta]) -> None:
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
                if r.feats[i] is not None or key in todo or done:
                    continue
                cached = self.encoder_cache.get(key)
                if cached is not None:
                    self.encoder_cache.hits += 1
                    r.feats[i] = cached
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
                    self.fail_request(r, _as_error(e, "encoding the request's images"), deltas)
        for key, f in feats.items():
            self.encoder_cache.put(key, f)
        for r in reqs:
            for i, im in enumerate(r.images):
                key = r.feature_key(im)
                if r.feats[i] is None and key in feats:
                    r.feats[i] = feats[key]

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

    def _image_embeds(self, req: Request, lo: int, hi: int) -> tuple[np.ndarray | None, np.ndarray]:
        """Rows [lo, hi) of the prompt's image embeddings [hi - lo, feature width] and mask [hi - lo]."""
        mask = np.isin(req.seq_ids(lo, hi), self.family.media_token_ids)
        if not mask.any() or self.family.cross_attention:  # cross-attention: <|image|> keeps its embedding
            mask[:] = False
            return None, mask
        emb = np.zeros((hi - lo, self.runner.feature_width), np.float32)
        first, last = np.searchsorted(req.image_pos, [lo, hi])   # image tokens [first, last) are here
        offset = 0
        for feats, im in zip(req.feats, req.images):
            a, b = max(offset, first), min(offset + im.num_tokens, last)
            if a < b:
                emb[req.image_pos[a:b] - lo] = feats[a - offset:b - offset]
            offset += im.num_tokens
        return emb, mask

    def _prefill_chunk(self, req: Request, n: int) -> PrefillChunk:
        """The runner's input for prompt tokens [prefilled, prefilled + n) of `req` (cross-attention
        families: its images' K/V are written into its slot first, once)."""
        lo, hi = req.prefilled, req.prefilled + n
        emb, mask = self._image_embeds(req, lo, hi)
        spans = None if req.runs is None else run_spans(req.seq_ids(lo, hi), self.family.image_token_id)
        if req.cross is not None:
            if not req.cross_filled:   # the request's images' K/V, once, before its first chunk
                self.runner.fill_cross(req.slot, list(req.feats), [im.grid[0] for im in req.images],
                                       int(req.cross[-1]))
                req.cross_filled = True
            spans = req.cross[lo:hi]
        bits = None
        if req.constraints and hi == req.prompt_len and req.resume_ids is None:   # the first token's mask
            bits = self.runner.all_allowed()
            self._bits(req, bits)
        nxt = None
        if self._scores_prompt(req):    # prompt_logprobs: each position's next prompt token (0 past the end)
            nxt = np.zeros(hi - lo, np.int32)
            nxt[:len(req.prompt_ids[lo + 1:hi + 1])] = req.prompt_ids[lo + 1:hi + 1]
        return PrefillChunk(req.slot, lo, req.seq_ids(lo, hi), emb, mask, req.seq_positions(lo, hi), req.rope_delta,
                            SlotSampling.from_params(req.sampling), req.key, spans, req.vrow, bits, nxt,
                            req.adapter)

    @staticmethod
    def _scores_prompt(req: Request) -> bool:
        """Does `req`'s prefill score its prompt (prompt_logprobs; siblings share choice 0's)?"""
        return req.sampling.prompt_logprobs is not None and req.parent is None and req.resume_ids is None

    def _prefill(self, items: list[tuple[Request, int]], deltas: list[Delta], riders: list[Request] = ()) -> bool:
        """One prefill call over the chunks of `items` (request, tokens), packed (scheduler.
        prefill_plan keeps them within one call's token and segment budget). If a packed call
        fails and the device state survived, each chunk is retried alone, so that only a culprit
        fails. riders (`_riders`): the decode step of these running requests rides in the call
        (a mixed step); returns whether it did (False: they still need their decode step; a
        failed mixed call is retried as the prefill alone)."""
        if riders:       # their decode step rides in this call: pages for its position
            riders = self._ensure_pages(list(riders), 1, deltas)
            items = [(r, n) for r, n in items if r.finish_reason is None and r.slot is not None]
        self._sync_pages()
        todo, chunks = [], []
        for req, n in items:
            try:
                chunks.append(self._prefill_chunk(req, n))
                todo.append((req, n))
            except InvalidRequestError as e:     # its first token's constraint (a grammar) failed
                self.fail_request(req, e, deltas)
            except Exception as e:
                self._device_failure(req, _as_error(e, "prefilling the request"), deltas)
        if not todo:
            return False
        try:
            # queued without waiting (overlapped steps); a prompt_logprobs call has waited
            out = self.runner.prefill(chunks, prune=todo[0][0].prune if len(todo) == 1 else None, wait=False,
                                      riders=[r.slot for r in riders])
            for (req, _), chunk in zip(todo, chunks):
                if chunk.next_ids is not None:   # its output (a StepOutput) is on the host
                    req.prompt_scores = (req.prompt_scores or []) + [out.scores]
        except Exception as e:
            if riders and not self.runner.device_state_lost():
                log.warning("mixed step of %d prompts and %d decode rows failed (%s: %s); prefilling alone",
                            len(todo), len(riders), type(e).__name__, e)
                self._prefill(todo, deltas)
                return False
            if len(todo) > 1 and not self.runner.device_state_lost():
                log.warning("packed prefill of %d requests failed (%s: %s); prefilling one at a time", len(todo),
                            type(e).__name__, e)
                for item in todo:
                    self._prefill([item], deltas)
                return False
            self._device_failure(todo[0][0] if len(todo) == 1 else None, _as_error(e, "prefilling the request"),
                                 deltas)
            return False
        self.counters["prefill_calls"] += 1
        self.counters["prefill_chunks"] += len(todo)        # > prefill_calls: calls were packed
        first = []          # requests whose prompt this call finished: (request, its output row)
        for row, (req, n) in enumerate(todo):
            self.counters["tokens_prefilled"] += n
            self.counters["tokens_pruned"] += req.pruned_tokens
            req.prefilled += n
            if self.pages is not None:
                self.pages.written(req, req.prefilled)
            if not req.prefilling:
                req.feats = []  # the KV cache holds them now
                if req.resume_row is not None:      # a preempted request's KV is back: decode on
                    self.runner.restore_row(req.slot, req.resume_row)
                    req.resume_row = req.resume_ids = None
                    continue
                first.append((req, row))
            elif self.runner.text_model.state_layers:   # a recurrent state would take the garbage
                self.runner.park(req.slot)               # token decode steps feed this row until its next chunk
        self._snapshot_states([req for req, _ in todo])
        for req, _ in first:
            self._fork(req)
        if riders:      # the riders' rows come first in a mixed call's outputs
            self.counters["decode_steps"] += 1
            self.counters["mixed_steps"] += 1
            order = sorted(riders, key=lambda r: r.slot)        # the runner's rows: riders by slot
            self._dispatched(out, [(r, i) for i, r in enumerate(order)] + [(req, len(riders) + row)
                                                                         for req, row in first])
            return True
        if first:
            self._dispatched(out, first)    # their first tokens (row per request): read in _collect
        return False

    def _decode(self, running: list[Request], deltas: list[Delta]) -> bool:
        """Queue one decode step over `running` (True) or fail what it held (False). A request
        whose constraint fails (its grammar's matcher, or no token left) fails alone first."""
        bits = None
        if any(r.constraints for r in running):
            bits = self.runner.all_allowed(max(r.slot for r in running) + 1)
            for r in running:
                if r.constraints:
                    try:
                        self._bits(r, bits[r.slot])
                    except InvalidRequestError as e:
                        self.fail_request(r, e, deltas)
            running = [r for r in running if r.finish_reason is None]
            if not running:
                return False
        # positions in use after this step; per layer only when a pruned request (shorter after
        # its layer) is running
        lens = max(r.prompt_len + len(r.output_ids) + r.inflight for r in running)
        pruned = any(r.prune is not None for r in running)
        constrained = any(r.constraints for r in running)
        # several steps a call unless a row needs the host between tokens (its grammar's next
        # bitmask), per-layer lengths (pruning), or could run past the context
        steps = self.runner.decode_steps
        if pruned or constrained or lens + steps - 1 > self.max_model_len:
            steps = 1
        if self.pages is not None:    # a prompt this step finished decodes into a page of its own
            running = self._ensure_pages(running, steps, deltas)
            if not running:
                return False
            lens = max(r.prompt_len + len(r.output_ids) + r.inflight for r in running)
        lens += steps - 1
        if pruned:
            lens = np.asarray([max(r.kv_positions(i) for r in running)
                               for i in range(self.runner.text_model.num_layers)])
        rows = max(r.slot for r in running) + 1
        if bits is not None:
            bits = bits[:rows] if constrained else None
        try:
            out = self.runner.decode(lens, rows, bits, wait=False, steps=steps)
        except Exception as e:
            self._device_failure(None, _as_error(e, "decoding"), deltas)
            return False
        self.counters["decode_steps"] += steps
        self._dispatched(out, [(r, r.slot) for r in running], steps)
        return True

    def _emit_token(self, req: Request, out, row: int, deltas: list[Delta]) -> None:
        try:
            d = append_token(req, out, row, self.model.eos_token_ids, self.max_model_len)
        except Exception as e:
            self.fail_request(req, _as_error(e, "detokenizing"), deltas)
            return
        self.counters["tokens_decoded"] += 1
        deltas.append(d)
        if d.finished:
            self._finish(req, d.finish_reason)

    def _device_failure(self, culprit: Request | None, err: MMJaxError, deltas: list[Delta]) -> None:
        """A compiled call failed. If the donated cache/state survived, only the culprit fails.
        Otherwise every slot's KV is gone: requests that produced nothing yet go back to the
        queue (they restart from their prompt), the others fail."""
        log.error("%s (request %s)", err.message, culprit.id if culprit else "-")
        # the calls queued before this one finished (or failed) on their own: their tokens
        # count as produced, as if each step had been waited for
        self._collect(deltas)
        if not self.runner.device_state_lost():
            if culprit is not None:
                self.fail_request(culprit, err, deltas)
                return
        for r in self.scheduler.active():
            if r is culprit or r.output_ids:
                self.fail_request(r, err if r is culprit or culprit is None else MMJaxError(
                    f"internal error: the device state was lost while running request {culprit.id}"), deltas)
            else:
                self.scheduler.slots[r.slot] = None
                r.slot, r.prefilled, r.cached_tokens, r.cross_filled = None, 0, 0, False
                r.feats = [im.embeds for im in r.images]
                self.scheduler.waiting.appendleft(r)
        self.reset_device_state()

    def _finish(self, req: Request, reason: str) -> None:
        req.finish_reason = reason
        if req.slot is not None and self.scheduler.slots[req.slot] is req:
            self.runner.park(req.slot)
        self.scheduler.release(req)
        if reason not in ("abort", "error"):
            self.counters["requests_finished"] += 1

    # ---- results ----------------------------------------------------------------------------
    def output(self, request_id: str) -> RequestOutput:
        req = self.requests[request_id]
        out = req.output()
        sc = prompt_logprobs.prompt_scores(req, req.sampling.prompt_logprobs or 0)
        if sc is not None:
            out.prompt_logprobs = prompt_logprobs.per_position(sc, self._prompt_token_str)
        return out

    def _prompt_token_str(self, tid: int) -> str:
        """A prompt token's text (special tokens kept); image tokens show as the model's image
        placeholder, as the server shows them."""
        if tid == self.family.image_token_id and self.tokenizer.image_token:
            return self.tokenizer.image_token
        return self.tokenizer.decode([tid], skip_special_tokens=False)

    def release(self, request_id: str) -> None:
        """Forget a finished request (its output has been collected)."""
        r = self.requests.get(request_id)
        if r is not None and r.finish_reason is not None:
            del self.requests[request_id]

    def run_until_done(self, request_ids: list[str]) -> list[RequestOutput]:
        """Step until every request is done. A request that failed raises its error (after the
        others finished)."""
        pending = set(request_ids)
        while any(self.requests[r].finish_reason is None for r in pending):
            self.step()
        outs = [self.output(r) for r in request_ids]
        errors = [self.requests[r].error for r in request_ids if self.requests[r].error is not None]
        for r in request_ids:
            self.release(r)
        if errors:
            raise errors[0]
        return outs

    def stats(self) -> dict[str, Any]:
        running = len(self.scheduler.active())
        r = self.runner
        pages = {} if self.pages is None else {f"kv_{k}" if not k.startswith("prefix") else k: v
                                               for k, v in self.pages.stats().items()}
        return {**self.counters, **pages, "encoder_calls": r.calls["encode"],
                "requests_running": running, "requests_waiting": len(self.scheduler.waiting),
                "slots_total": len(self.scheduler.slots), "slots_used": running,
                "encoder_cache_hits": self.encoder_cache.hits, "encoder_cache_misses": self.encoder_cache.misses,
                "encoder_cache_entries": len(self.encoder_cache), "encoder_cache_bytes": self.encoder_cache.bytes,
                "compiled_shapes": r.compiled_counts(), "compiled_shapes_bound": r.max_compilations(),
                **({"cross_attention_cache_bytes": r.text_model.cross_cache_bytes(r.num_slots, r.kv_cache_dtype),
                    "cross_attention_slots": int(sum(1 for q in self.scheduler.active() if q.images))}
                   if self.family.cross_attention else {}),
                **({"state_snapshots": len(self.snapshots), "state_snapshot_hits": self.snapshots.hits}
                   if self.snapshots is not None else {}),
                **self.grammars.stats(),
                "compile_seconds": round(r.compile_seconds, 3),
                "step_seconds": {k: round(v, 3) for k, v in r.step_seconds.items()},
                **r.memory_report()}
