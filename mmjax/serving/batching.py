"""The host side of the prefill and decode steps: the chunks that go in (`PrefillChunk`), the
outputs that come back (`StepOutput`, or `PendingOutput` while still on the device), and the
packing of chunks into the bucketed arrays a step takes (`HostBatching`, a part of ModelRunner).
numpy only: nothing here is traced."""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import jax
import numpy as np

from mmjax.buckets import Buckets, bucket_for
from mmjax.serving.sampling import SlotSampling, VocabRow
from mmjax.serving.steps import Riders, Segments

if TYPE_CHECKING:
    from mmjax.serving.runner import ModelRunner


@dataclass
class StepOutput:
    """Host copies of one step's sampling results, rows = slots (decode) or 1 (prefill)."""
    tokens: np.ndarray      # [rows] int32
    logprobs: np.ndarray    # [rows] float32, logprob of the chosen token
    top_logprobs: np.ndarray  # [rows, 20]
    top_ids: np.ndarray     # [rows, 20]
    scores: tuple | None = None   # prefill with next_ids: prompt_scores (chosen, rank, top_ids, top_lp) [n, ...]

    def result(self) -> "StepOutput":
        """Already on the host (the PendingOutput interface, for steps that always wait)."""
        return self

    def steps(self) -> list["StepOutput"]:
        """One StepOutput per decode step of a multi-step call (arrays [steps, rows, ...]); a
        one-step output is its own list."""
        if self.tokens.ndim == 1:
            return [self]
        return [StepOutput(*(x[j] for x in (self.tokens, self.logprobs, self.top_logprobs, self.top_ids)))
                for j in range(self.tokens.shape[0])]


class PendingOutput:
    """One dispatched step's sampling results, still on the device (overlapped steps: the host
    queues the next step before it reads these). `result()` waits for them and copies them to
    the host once; the wait is what the host spent on this step kind (`step_seconds`)."""

    def __init__(self, runner: "ModelRunner", kind: str, arrays, rows: int | None = None,
                 take: np.ndarray | None = None):
        self._runner, self._kind, self._arrays, self._rows, self._take = runner, kind, arrays, rows, take
        self._out: StepOutput | None = None

    def result(self) -> StepOutput:
        """rows (a packed prefill): the first `rows` output rows (one per chunk; the unused
        segments' rows are dropped); take: these rows instead (a mixed step's riders and chunks)."""
        if self._out is None:
            t0 = time.perf_counter()
            pick = (lambda x: x[:self._rows]) if self._take is None else (lambda x: x[self._take])  # noqa: E731
            # one device_get: every output's copy to the host starts before the first is read
            # (np.asarray per output waits for each copy in turn)
            self._out = StepOutput(*(pick(x) for x in jax.device_get(tuple(self._arrays))))
            self._runner.step_seconds[self._kind] += time.perf_counter() - t0
            self._arrays = None
        return self._out


@dataclass
class PrefillChunk:
    """One sequence's chunk for a (packed) prefill call, host arrays: n = len(token_ids) tokens
    at cache index `start` of cache row `slot`; image_embeds [n, feature width] or None (no
    image token), image_mask [n] bool, positions [position rows, n]; spans [n] int32: image-run
    ids (-1 elsewhere; None: none); sampling: SlotSampling of scalars; key [2] uint32; vrow:
    the request's VocabRow (None: no penalties/bias/limits); bits [bit_words] uint32: the first
    token's allowed-token bitmask (None: all); next_ids [n] int32 (prompt_logprobs): each
    position's next prompt token (such a chunk is prefilled alone, by the `prefill_scores` step);
    adapter: the request's LoRA adapter slot (-1: none)."""
    slot: int
    start: int
    token_ids: np.ndarray
    image_embeds: np.ndarray | None
    image_mask: np.ndarray
    positions: np.ndarray
    rope_delta: int
    sampling: SlotSampling
    key: np.ndarray
    spans: np.ndarray | None = None
    vrow: VocabRow | None = None
    bits: np.ndarray | None = None
    next_ids: np.ndarray | None = None
    adapter: int = -1



class HostBatching:
    """ModelRunner's packing of host chunks into a step's arguments. Reads the runner's
    buckets, score_buckets, num_slots, feature_width, dtype, mixes, text_model.position_rows,
    `_idle_sampling`, `default_row()` and `all_allowed()`."""

    def rider_rows(self, buckets: Buckets | None = None) -> int:
        """D, the rider rows every packed prefill call has (0: no mixed steps): every slot."""
        return (buckets or self.buckets).decode[-1] if self.mixes else 0

    def _scores_args(self, c: PrefillChunk) -> tuple[int, tuple]:
        """A prompt_logprobs chunk's (row length on the scores ladder, the prefill_scores step's
        array arguments after params, cache, state)."""
        c_len, args = self._pack([c], 1, (), 0, self.score_buckets)
        return c_len, args + (np.pad(np.asarray(c.next_ids, np.int32), (0, c_len - len(c.next_ids))),)

    def _pack(self, chunks: list[PrefillChunk], s: int, riders: list[int] = (), d: int = 0,
              ladder: tuple[int, ...] | None = None) -> tuple[int, tuple]:
        """The chunks packed into one row for S = s segments, the riders' tokens after them (D =
        d rider rows) -> (row length T, the step's array arguments after params, cache, state).
        ladder: the row lengths (default: the prefill ladder)."""
        n = [len(c.token_ids) for c in chunks]
        k = len(chunks)
        c_len = bucket_for(sum(n) + len(riders), ladder or self.buckets.prefill)
        rows = self.text_model.position_rows
        ids, mask = np.zeros(c_len, np.int32), np.zeros(c_len, bool)
        emb = np.zeros((c_len, self.feature_width), self.dtype)
        pos, spans = np.zeros((rows, c_len), np.int32), np.full(c_len, -1, np.int32)
        token_seg = np.full(c_len, k - 1, np.int32)        # padding: the last chunk's (past its end)
        slot = np.full(s, self.num_slots, np.int32)          # unused segments: past the cache, dropped
        start, offset, n_valid, rope = (np.zeros(s, np.int32) for _ in range(4))
        adapter = np.full(s, -1, np.int32)
        keys = np.zeros((s, 2), np.uint32)
        pad = s - k
        o = 0
        for i, (c, m) in enumerate(zip(chunks, n)):
            ids[o:o + m], mask[o:o + m], pos[:, o:o + m] = c.token_ids, c.image_mask, c.positions
            if c.image_embeds is not None:
                emb[o:o + m] = c.image_embeds
            if c.spans is not None:
                spans[o:o + m] = c.spans
            token_seg[o:o + m] = i
            slot[i], start[i], offset[i], n_valid[i], rope[i], keys[i] = c.slot, c.start, o, m, c.rope_delta, c.key
            adapter[i] = c.adapter
            o += m
        pos[:, o:] = pos[:, o - 1:o]        # padding repeats the last position (Gemma 3 reads it as padding)
        stack = lambda *x: np.stack(x)      # noqa: E731
        seg = Segments(slot, start, offset, n_valid, rope,
                       jax.tree.map(stack, *[c.sampling for c in chunks], *[self._idle_sampling] * pad), keys,
                       jax.tree.map(stack, *[c.vrow or self.default_row() for c in chunks],
                                    *[self.default_row()] * pad),
                       np.stack([self.all_allowed() if c.bits is None else np.asarray(c.bits, np.uint32)
                                 for c in chunks] + [self.all_allowed()] * pad), adapter)
        ride = np.zeros(d, bool)
        ride[list(riders)] = True
        return c_len, (ids, emb, mask, pos, spans, token_seg, seg, Riders(ride, np.int32(o)))

    def _pruned_args(self, chunk: PrefillChunk, prune: tuple[int, int]) -> tuple[tuple, tuple, dict]:
        """A FastV call's (shape, array arguments after params, cache, state, static kwargs)."""
        n = len(chunk.token_ids)
        vrow = self.default_row() if chunk.vrow is None else chunk.vrow
        bits = self.all_allowed() if chunk.bits is None else np.asarray(chunk.bits, np.uint32)
        c = bucket_for(n, self.buckets.prefill)
        pad = c - n
        ids = np.pad(np.asarray(chunk.token_ids, np.int32), (0, pad))
        mask = np.pad(np.asarray(chunk.image_mask, bool), (0, pad))
        emb = np.zeros((c, self.feature_width), self.dtype) if chunk.image_embeds is None else \
            np.pad(np.asarray(chunk.image_embeds, self.dtype), ((0, pad), (0, 0)))
        pos = np.pad(np.asarray(chunk.positions, np.int32), ((0, 0), (0, pad)), mode="edge")
        spans = np.full(c, -1, np.int32) if chunk.spans is None else \
            np.pad(np.asarray(chunk.spans, np.int32), (0, pad), constant_values=-1)
        layer, keep = prune
        out_len = bucket_for(n - (int(mask.sum()) - keep), self.buckets.prefill)
        return ((c, layer, keep, out_len),
                (ids, emb, mask, pos, np.int32(chunk.slot), np.int32(n), np.int32(chunk.rope_delta), chunk.sampling,
                 np.asarray(chunk.key, np.uint32), spans, vrow, bits),
                dict(layer=layer, keep=keep, out_len=out_len))

