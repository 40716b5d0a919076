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

import logging
import threading
import time
from typing import Any

import numpy as np

from mmjax.errors import InvalidRequestError, MMJaxError
from mmjax.models.family import ImageInput, run_spans
from mmjax.serving.caches import EncoderCache, PrefixCache
from mmjax.serving import prompt_logprobs
from mmjax.serving.encoding import FeatureEncoder, as_error
from mmjax.serving.inputs import InputProcessor, fill_bits
from mmjax.serving.output import append_token
from mmjax.serving.pages import KVPages, page_hashes
from mmjax.serving.request import Delta, Request, RequestOutput
from mmjax.serving.runner import ModelRunner, PrefillChunk
from mmjax.serving.sampling import SamplingParams, SlotSampling
from mmjax.serving.scheduler import Scheduler
from mmjax.serving.state_snapshots import ROWS_PER_SLOT, SnapshotIndex

log = logging.getLogger("mmjax.engine")

# requests whose chunks one prefill call packs at most (pack_prefill; models/nn/packing.py):
# each sequence past the first may add one 32-query attention block (an unaligned segment end);
# the compiled block layout holds S - 1 such blocks, skipped at run time while unneeded
MAX_PREFILL_SEQS = 8


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
        self.inputs = InputProcessor(model, self.runner, max_model_len=max_model_len, prefill_chunk=prefill_chunk,
                                     max_images_per_request=max_images_per_request, adapters=self.adapters)
        self.grammars = self.inputs.grammars
        self.requests: dict[str, Request] = {}
        self._step_lock = threading.RLock()     # one step, or a refresh, at a time
        self.counters = {"requests_finished": 0, "requests_aborted": 0, "requests_failed": 0,
                         "tokens_prefilled": 0, "tokens_decoded": 0, "tokens_cached": 0,
                         "images_encoded": 0, "videos_encoded": 0, "decode_steps": 0, "prefill_calls": 0,
                         "prefill_chunks": 0, "mixed_steps": 0,
                         "tokens_pruned": 0, "preemptions": 0}
        self.features = FeatureEncoder(self.runner, self.family, self.encoder_cache, max_encode_tokens, self.counters)

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
                    row = self.snapshots.claim(req.prefix_keys[:req.prefilled])
                    if row is not None:
                        self.runner.save_state(req.slot, row)
        except Exception as e:
            self.snapshots.clear()
            self._device_failure(None, as_error(e, "snapshotting recurrent states"), [])

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
        """Longest prompt text (UTF-8 bytes) that could still fit the context (`InputProcessor`)."""
        return self.inputs.max_prompt_bytes

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
        return self.inputs.make_request(prompt, images, sampling, request_id, prune, lora)

    def siblings(self, req: Request, n: int) -> list[Request]:
        """n > 1: `req` and n - 1 copies sampling the same prompt (`InputProcessor.siblings`); the
        copies wait until `req`'s prompt is in the cache, then copy it (`_fork`)."""
        return self.inputs.siblings(req, n)

    def _fork(self, parent: Request) -> None:
        """`parent`'s prompt is now in its cache row: waiting siblings take free slots holding a
        copy of that row (all but the last prompt token count as cached)."""
        n = parent.prompt_len - 1
        if self.snapshots is not None:      # recurrent states: from the last snapshot of the prompt
            n = self.snapshots.longest(parent.prefix_keys, n)
        # a pruned row is compacted, a ring-buffer row may not resume that late, a last token
        # that is an image token needs its features again: those siblings prefill themselves
        if (parent.prune is not None or n < self.scheduler.min_resume(parent.prompt_len)
                or parent.prompt_ids[-1] in self.family.media_token_ids or (self.snapshots is not None and not n)):
            return
        for sib in self.scheduler.siblings_waiting(parent):
            slot = self.scheduler.fork_slot()
            if slot is None:
                return
            if self.pages is not None:
                if not self._fork_pages(parent, sib, slot, n):
                    return
                continue
            try:
                self.runner.copy_slot(parent.slot, slot)
                self._resume_states(sib, parent.prefix_keys[:n], slot)
            except Exception as e:
                self._device_failure(None, as_error(e, "copying a prompt's cache row"), [])
                return
            self.scheduler.place_waiting(sib, slot, n)
            self.prefix_cache.retain(slot, parent.prefix_keys[:n])
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
            self._device_failure(None, as_error(e, "copying a prompt's cache page"), [])
            return False
        self.scheduler.place_waiting(sib, slot, n)
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
        req.features = [im.embeds for im in req.images]
        req.cross_filled = False
        self.runner.park(req.slot)
        self.scheduler.preempt(req)
        self.counters["preemptions"] += 1
        log.info("preempted request %s (%d tokens produced)", req.id, len(req.output_ids))

    def submit(self, req: Request) -> str:
        if req.lora is not None and self.lora_slot(req.lora) != req.adapter:   # unloaded since it was made
            from mmjax.errors import LoRANotFoundError
            raise LoRANotFoundError(f"the adapter {req.lora!r} was unloaded", param="model")
        if req.id in self.requests:
            raise InvalidRequestError(f"duplicate request id {req.id!r}", param="request_id")
        self.requests[req.id] = req
        if self.pages is not None:
            req.pages = []
            req.page_hashes = page_hashes(req.prefix_keys, self.pages.page_size, req.cache_salt)
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
        return self.inputs.lora_slot(name)

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
                self._resume_states(req, req.prefix_keys[:req.prefilled], req.slot)
            except Exception as e:
                self._device_failure(req, as_error(e, "restoring a prefix's recurrent states"), deltas)
        for req in self.scheduler.active():      # their step compiled in the background: take part again
            if req.compile_wait is not None and self.runner.compile_done(req.compile_wait):
                req.compile_wait = None
        # a chunked prompt leaves room for the requests that would ride in its call (mixed step)
        plan = self.scheduler.prefill_plan(reserve=len(self._riders([])))
        # only the images this step's prefill chunks need: encoding every admitted request's
        # images up front would put all of them before the first request's first token
        self.features.encode_missing([r for r, _ in plan], lambda r, e: self.fail_request(r, e, deltas))
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
            self.fail_request(req, as_error(e, "compiling the request's step"), deltas)
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
                self._device_failure(None, as_error(e, "running a step"), deltas)
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

    def _prefill_chunk(self, req: Request, n: int) -> PrefillChunk:
        """The runner's input for prompt tokens [prefilled, prefilled + n) of `req` (cross-attention
        families: its images' K/V are written into its slot first, once)."""
        lo, hi = req.prefilled, req.prefilled + n
        emb, mask = self.features.embeds(req, lo, hi)
        spans = None if req.runs is None else run_spans(req.seq_ids(lo, hi), self.family.image_token_id)
        if req.cross is not None:
            if not req.cross_filled:   # the request's images' K/V, once, before its first chunk
                self.runner.fill_cross(req.slot, list(req.features), [im.grid[0] for im in req.images],
                                       int(req.cross[-1]))
                req.cross_filled = True
            spans = req.cross[lo:hi]
        bits = None
        if req.constraints and hi == req.prompt_len and req.resume_ids is None:   # the first token's mask
            bits = self.runner.all_allowed()
            fill_bits(req, bits)
        nxt = None
        if self._scores_prompt(req):    # prompt_logprobs: each position's next prompt token (0 past the end)
            nxt = np.zeros(hi - lo, np.int32)
            nxt[:len(req.prompt_ids[lo + 1:hi + 1])] = req.prompt_ids[lo + 1:hi + 1]
        return PrefillChunk(req.slot, lo, req.seq_ids(lo, hi), emb, mask, req.seq_positions(lo, hi), req.rope_delta,
                            SlotSampling.from_params(req.sampling), req.rng_key, spans, req.vrow, bits, nxt,
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
                self._device_failure(req, as_error(e, "prefilling the request"), deltas)
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
            self._device_failure(todo[0][0] if len(todo) == 1 else None, as_error(e, "prefilling the request"),
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
                req.features = []  # the KV cache holds them now
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
                        fill_bits(r, bits[r.slot])
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
            self._device_failure(None, as_error(e, "decoding"), deltas)
            return False
        self.counters["decode_steps"] += steps
        self._dispatched(out, [(r, r.slot) for r in running], steps)
        return True

    def _emit_token(self, req: Request, out, row: int, deltas: list[Delta]) -> None:
        try:
            d = append_token(req, out, row, self.model.eos_token_ids, self.max_model_len)
        except Exception as e:
            self.fail_request(req, as_error(e, "detokenizing"), deltas)
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
                self.scheduler.requeue(r)
                r.cached_tokens, r.cross_filled = 0, False
                r.features = [im.embeds for im in r.images]
        self.reset_device_state()

    def _finish(self, req: Request, reason: str) -> None:
        req.finish_reason = reason
        if self.scheduler.holds(req):
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
