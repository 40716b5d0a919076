"""Which request runs where and how much of it each step: the waiting queue, the decode slots,
admission (prefix-cache aware) and the per-step prefill budget. Pure host bookkeeping."""
from __future__ import annotations

from collections import deque
from typing import Callable

import numpy as np

from mmjax.buckets import bucket_for
from mmjax.serving.caches import PrefixCache
from mmjax.serving.request import Request

# Shorter shared prefixes are not worth steering slot choice for (see Scheduler.admit).
MIN_PREFIX_HIT = 16


class Scheduler:
    def __init__(self, num_slots: int, decode_ladder: tuple[int, ...], prefill_chunk: int,
                 prefix_cache: PrefixCache, min_resume: Callable[[int], int] | None = None,
                 max_segments: int = 1, pages=None, resume_at: Callable[[np.ndarray, int], int] | None = None):
        """min_resume(held) (the text model's, optional): the shortest prefix a cache row holding
        `held` positions can resume from (ring-buffer sliding-window layers drop old positions).
        resume_at(keys, n) (optional): the longest prefix of `keys`, at most n tokens, that the
        engine can resume the decoder's recurrent states at (a hybrid decoder's state
        snapshots: serving/state_snapshots.py); None: any.
        max_segments: the most requests one (packed) prefill call takes; 1: one call each.
        pages: the paged cache's `pages.KVPages` (None: a cache row per slot): admission by free
        pages, prefix sharing by page, preemption (`preempt`)."""
        self.waiting: deque[Request] = deque()
        self.slots: list[Request | None] = [None] * num_slots
        self.decode_ladder = decode_ladder
        self.prefill_chunk = prefill_chunk
        self.prefix = prefix_cache
        self.min_resume = min_resume or (lambda held: 0)
        self.resume_at = resume_at
        self.max_segments = max_segments
        self.pages = pages
        self._admissions = 0

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def has_work(self) -> bool:
        return bool(self.waiting) or any(s is not None for s in self.slots)

    def active(self) -> list[Request]:
        return [r for r in self.slots if r is not None]

    def admit(self) -> list[Request]:
        """Move waiting requests into free slots; returns the admitted ones. With the prefix
        cache, each goes to the free slot whose retained KV shares the longest prefix with it and
        prefill starts after that prefix; at least one prompt token is always recomputed to get
        the first token's logits. Without a worthwhile match (< MIN_PREFIX_HIT tokens: the chat
        template's opening alone matches every slot) the request takes the free slot that keeps
        the decode step's row count (highest busy slot + 1, rounded up the decode ladder)
        smallest, then the least recently used one, so retained prefixes survive longest."""
        admitted = []
        while self.waiting:
            free = [i for i, s in enumerate(self.slots) if s is None]
            if not free:
                break
            # n > 1 siblings wait for their parent's prompt (Engine forks them from its cache row)
            req = next((r for r in self.waiting if not r.waits_for_parent()), None)
            if req is None:
                break
            if self.pages is not None:
                if not self._admit_paged(req, min(free)):
                    break
                admitted.append(req)
                continue
            self.waiting.remove(req)
            busy_rows = max((i + 1 for i, s in enumerate(self.slots) if s is not None), default=0)
            match = {i: self._resumable(i, req) for i in free}
            slot = max(free, key=lambda i: (match[i] if match[i] >= MIN_PREFIX_HIT else 0,
                                            -bucket_for(max(busy_rows, i + 1), self.decode_ladder),
                                            -self.prefix.last_used[i]))
            cached = match[slot]
            self.place(req, slot, cached)
            admitted.append(req)
        return admitted

    def _admit_paged(self, req: Request, slot: int) -> bool:
        """Admit `req` into free `slot` if the pool has pages for its whole prefill (+ the first
        decode position) beyond the cached pages it shares, keeping a page per running request
        free (each may need one more before the next admission's first token): vLLM's
        watermark. The lowest free slot keeps the decode step's rows fewest."""
        kv, n = self.pages, req.prefill_len
        cached = kv.cached(req, n) if self._shares_prefix(req) else []
        need = kv.fresh_needed(cached, min(n + 1, kv.max_pages * kv.page_size))
        if kv.pool.num_free - need < len(self.active()):
            return False
        if not kv.admit(req, slot, cached, min(n + 1, kv.max_pages * kv.page_size)):
            return False
        self.waiting.remove(req)
        self.place(req, slot, len(cached) * kv.page_size)
        return True

    @staticmethod
    def _shares_prefix(req: Request) -> bool:
        """May `req` start from cached KV? Not a pruned prompt (one call from index 0) nor one
        whose every prompt position's logits are computed (prompt_logprobs)."""
        return req.prune is None and (req.sampling.prompt_logprobs is None or req.resume_ids is not None)

    def place(self, req: Request, slot: int, cached: int) -> None:
        """Put `req` into free `slot` whose row holds the KV of its first `cached` prompt tokens."""
        req.slot, req.prefilled = slot, cached
        if not req.preemptions:      # usage counts the first admission's hit
            req.cached_tokens = cached
        self._admissions += 1
        req.admitted_seq = self._admissions
        self.slots[slot] = req
        if self.pages is None:
            self.prefix.truncate(slot, cached)

    def preempt(self, req: Request) -> None:
        """Take `req` out of its slot and pages and put it first in the queue (recompute: the
        engine set its `resume_ids` / `resume_row` if it had produced tokens)."""
        if req.slot is not None and self.slots[req.slot] is req:
            self.slots[req.slot] = None
        self.pages.release(req)
        req.slot, req.prefilled, req.compile_wait = None, 0, None
        req.preemptions += 1
        self.waiting.appendleft(req)

    def place_waiting(self, req: Request, slot: int, cached: int) -> None:
        """Take waiting `req` (a forked sibling) out of the queue into free `slot`, whose row holds
        the KV of its first `cached` prompt tokens."""
        self.waiting.remove(req)
        self.place(req, slot, cached)

    def siblings_waiting(self, parent: Request) -> list[Request]:
        """The n > 1 copies of `parent` still in the queue."""
        return [r for r in self.waiting if r.parent is parent]

    def holds(self, req: Request) -> bool:
        """Is `req` in a slot (and not yet released)?"""
        return req.slot is not None and self.slots[req.slot] is req

    def requeue(self, req: Request) -> None:
        """Put `req`, whose slot's KV was lost, first in the queue: it restarts from its prompt."""
        self.slots[req.slot] = None
        req.slot, req.prefilled = None, 0
        self.waiting.appendleft(req)

    def fork_slot(self) -> int | None:
        """A free slot for a sibling (the lowest: the decode step's row count grows least)."""
        return next((i for i, s in enumerate(self.slots) if s is None), None)

    def _resumable(self, slot: int, req: Request) -> int:
        """Prompt tokens whose KV `slot` holds and that `req` can start after (at least one prompt
        token is recomputed for the first token's logits)."""
        if req.prune is not None:       # pruned: the whole prompt in one call from index 0
            return 0
        if req.sampling.prompt_logprobs is not None:   # every prompt position's logits are computed
            return 0
        n = min(self.prefix.match(slot, req.prefix_keys), req.prompt_len - 1)
        if n and self.resume_at is not None:     # the row's KV, and recurrent states from a snapshot
            n = self.resume_at(req.prefix_keys, n)
        return n if n >= self.min_resume(len(self.prefix.keys[slot])) else 0

    def prefill_plan(self, reserve: int = 0) -> list[tuple[Request, int]]:
        """(request, tokens to prefill this step) within the `prefill_chunk` budget.

        The first prefilling request takes what it needs up to the budget (a longer prompt is
        chunked); after it, a prompt is only started if the rest of it fits. A head chunk in
        the budget's remainder would give no first token this step and lengthen the call every
        token of this step waits for, and its prompt's first token would still need a second
        call (benchmarks/README.md, "Figures behind code choices"). Packed
        (max_segments > 1): up to max_segments whole prompts that fit share the call (short
        prompts behind a long one go first); one call per request (max_segments = 1): the
        first that does not fit ends the plan. A chunk never ends inside a bidirectional image
        run (its tokens must see each other within one call); a FastV-pruned prompt goes whole.

        reserve: tokens of a mixed step's riders (running requests whose decode rides in the
        call). A prompt chunked anyway leaves them that much room (its chunk is shorter, and
        nothing is packed behind it), so that they ride instead of a decode call of their own;
        a prompt that fits whole is never split for them (its first token would wait a call).
        A request whose step is still compiling off the engine thread (`compile_wait`) is passed
        over: it takes no budget until that is done."""
        plan, budget, packed = [], self.prefill_chunk, self.max_segments > 1
        # a request whose step is compiling in the background (Engine._await_compile) waits
        for req in (r for r in self.slots if r is not None and r.prefilling and r.compile_wait is None):
            rest = req.prefill_len - req.prefilled
            if budget <= 0 or (packed and len(plan) == self.max_segments):
                break
            if plan and rest > budget:
                if packed:          # a shorter prompt behind it may fit whole
                    continue
                break
            n = _outside_runs(req, min(rest, budget))
            if req.prune is not None and n < rest:      # a pruned prompt goes in one call
                n = 0
            if 0 < n < rest and reserve and budget > reserve:
                n = _outside_runs(req, budget - reserve) or n     # chunked anyway: room for the riders
                budget -= reserve
            if n == 0:
                if packed:          # a later request's chunk may still fit
                    continue
                break
            plan.append((req, n))
            budget -= n
        return plan

    def decoding(self) -> list[Request]:
        """Requests whose prompt is in the cache and that are still generating."""
        return [r for r in self.slots if r is not None and not r.prefilling and r.finish_reason is None]

    def release(self, req: Request) -> None:
        """Take a request out of its slot (keeping the KV it leaves for the prefix cache) or out
        of the queue."""
        if self.pages is not None:
            if req.slot is not None and self.slots[req.slot] is req:
                self.slots[req.slot] = None
            if req.pages:
                self.pages.release(req)
            if req in self.waiting:
                self.waiting.remove(req)
            return
        if req.slot is not None and self.slots[req.slot] is req:
            self.slots[req.slot] = None
            # The cache row holds the prompt (as far as prefilled) and every output token but the
            # last (sampled, never fed back).
            held = req.prefix_keys[:req.prefilled]
            if not req.prefilling and len(req.output_ids) > 1:
                held = np.concatenate([held, np.asarray(req.output_ids[:-1], np.int64)])
            if req.prune is not None:   # later layers hold a compacted sequence: nothing to reuse
                held = held[:0]
            self.prefix.retain(req.slot, held)
        elif req in self.waiting:
            self.waiting.remove(req)


def _outside_runs(req: Request, n: int) -> int:
    """The longest chunk of at most n tokens from req.prefilled that does not end inside one of
    its bidirectional image runs (0: the run ahead needs more than n). A chunk may start inside
    a run (a prefix-cache hit): the run's earlier tokens are in the cache, computed with the
    whole run visible, so the rest sees the whole run too."""
    if req.runs is None or not len(req.runs):
        return n
    end = req.prefilled + n
    inside = (req.runs[:, 0] < end) & (end < req.runs[:, 1])
    if not inside.any():
        return n
    a = int(req.runs[inside][0, 0])
    return max(a - req.prefilled, 0)
