"""The compiled steps of one model: `encode`, `prefill`, `decode` (DESIGN.md compilation contract).

The runner drives; the family and its text model provide pure functions. Device state is the
text model's KV cache plus a `DecodeState` pytree (one row per slot); both are donated to every
prefill/decode call so XLA updates them in place. Every shape comes from `Buckets` (the family's
encode plan for encode); the shapes compiled so far are recorded in `compiled` (engine.stats(),
/metrics). Where arrays live comes from the placement seam (mmjax.sharding); backend-specific
tuning from mmjax.backend.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import os
import threading
import time
from dataclasses import dataclass, fields

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from mmjax import packed_weights
from mmjax.backend import Tuning, compiling_for, tuning
from mmjax.buckets import Buckets, bucket_for, pow2_ladder
from mmjax.errors import InvalidRequestError
from mmjax.kernels import cpu_gemv
from mmjax.models.family import EncodeCall, Family
from mmjax.models.nn import kv_quant
from mmjax.models.nn.capture import Capture, captured
from mmjax.models.nn.metadata import AttentionMetadata, Dropped, Prune
from mmjax.models.nn.packing import NO_INDEX, DecodeRows, Packing
from mmjax.serving.sampling import MAX_TOP_LOGPROBS, SamplingParams, SlotHistory, SlotSampling, VocabRow, sample
from jax.sharding import NamedSharding, PartitionSpec

from mmjax.models.nn.kv_cache import allocate_cache
from mmjax.serving.placed_model import PlacedModel
from mmjax.sharding import MODEL, Placement, per_device_bytes, step_shardings

log = logging.getLogger("mmjax.runner")


@dataclass
class DecodeState:
    """Per-slot decode state [slots]: the last sampled token, tokens in cache, the RoPE offset
    (decode position = cache index + rope_delta), sampling parameters and PRNG key [slots, 2];
    `pages` [slots, max_pages]: each slot's KV pages (the host's `pages.KVPages.table`, set by
    `ModelRunner.set_pages`; [slots, 0] for a cache with a row per slot);
    for rows whose image tokens were pruned (FastV), the layer after which `dropped` positions
    left the cache (`drop_after` = num_layers: never); `hist`: what penalties, logit_bias,
    allowed tokens and min_tokens read (vocab-sized rows, see sampling.SlotHistory); `adapter`:
    the slot's LoRA adapter slot (-1: the base model; models/nn/lora.py)."""
    tokens: jax.Array
    lengths: jax.Array
    rope_delta: jax.Array
    keys: jax.Array
    sampling: SlotSampling
    drop_after: jax.Array
    dropped: jax.Array
    hist: SlotHistory
    pages: jax.Array
    adapter: jax.Array

    @classmethod
    def zeros(cls, num_slots: int, vocab: int, max_pages: int = 0, num_pages: int = 0) -> "DecodeState":
        return cls(jnp.zeros((num_slots,), jnp.int32), jnp.zeros((num_slots,), jnp.int32),
                   jnp.zeros((num_slots,), jnp.int32), jnp.zeros((num_slots, 2), jnp.uint32),
                   SlotSampling.zeros(num_slots), jnp.zeros((num_slots,), jnp.int32),
                   jnp.zeros((num_slots,), jnp.int32), SlotHistory.zeros(num_slots, vocab),
                   jnp.full((num_slots, max_pages), num_pages, jnp.int32), jnp.full((num_slots,), -1, jnp.int32))

    @property
    def page_table(self) -> jax.Array | None:
        """The page table [slots, max_pages] of a paged cache (None: a row per slot)."""
        return self.pages if self.pages.shape[1] else None

    def head(self, rows: int) -> "DecodeState":
        """The first `rows` slots."""
        return jax.tree.map(lambda x: x[:rows], self)

    def advance(self, tokens: jax.Array, keys: jax.Array) -> "DecodeState":
        """After a decode step of the first rows = len(tokens) slots: their sampled tokens [rows],
        one more cached position, their next PRNG keys [rows, 2] and the penalties' history.
        Nothing else is written: rewriting the unchanged leaves (the vocab-sized sampling rows
        among them) made XLA copy them, twice, every step (1 ms of a batch-1 bf16 step)."""
        rows = tokens.shape[0]
        return dataclasses.replace(self, tokens=self.tokens.at[:rows].set(tokens),
                                   lengths=self.lengths.at[:rows].add(1), keys=self.keys.at[:rows].set(keys),
                                   hist=self.hist.after(tokens))

    def advance_slots(self, slots: jax.Array, tokens: jax.Array, keys: jax.Array) -> "DecodeState":
        """`advance` for the rows of slots [n] (a slot past the end: dropped) instead of the
        first n: their sampled tokens [n], next PRNG keys [n, 2] and history."""
        return dataclasses.replace(
            self, tokens=self.tokens.at[slots].set(tokens, mode="drop"),
            lengths=self.lengths.at[slots].add(1, mode="drop"), keys=self.keys.at[slots].set(keys, mode="drop"),
            hist=self.hist.after_slots(slots, tokens))

    def set_slot(self, slot: jax.Array, row: "DecodeState") -> "DecodeState":
        return jax.tree.map(lambda x, y: x.at[slot].set(y), self, row)

    def set_slots(self, slots: jax.Array, rows: "DecodeState") -> "DecodeState":
        """Rows [n] into slots [n]; a slot index past the end (an unused segment) is dropped."""
        return jax.tree.map(lambda x, y: x.at[slots].set(y, mode="drop"), self, rows)


jax.tree_util.register_dataclass(DecodeState, data_fields=[f.name for f in fields(DecodeState)], meta_fields=[])


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
            # (np.asarray per output waited for each copy in turn: 0.3-0.7 ms each on an H200)
            self._out = StepOutput(*(pick(x) for x in jax.device_get(tuple(self._arrays))))
            self._runner.step_seconds[self._kind] += time.perf_counter() - t0
            self._arrays = None
        return self._out


def step_spans(family: Family, spans: jax.Array) -> jax.Array | None:
    """The metadata's spans for spans [b, t] (image-token run ids, -1 elsewhere): bidirectional
    runs for families that want them, cross ranges for cross-attention families; else None
    (plain causal: `spans` goes unused and jit drops it)."""
    return spans if family.bidirectional_images or family.cross_attention else None


def _gathered(logits: jax.Array, shardings) -> jax.Array:
    """Vocab-parallel logits [rows, vocab] gathered once (one all-gather of the logits, never
    of the LM head: XLA may otherwise pick that) so that sampling runs locally on every device;
    shardings = (vocab-sharded, replicated) or None without tensor parallelism (the graph is
    then the single-device one)."""
    if shardings is None:
        return logits
    by_vocab, replicated = shardings
    if logits.shape[-1] % by_vocab.mesh.shape["model"] == 0:
        logits = jax.lax.with_sharding_constraint(logits, by_vocab)
    return jax.lax.with_sharding_constraint(logits, replicated)


def _first_token(logits, key, sampling, vrow, bits):
    """Sample a sequence's first token from logits [1, vocab] -> (key, sample outputs, the
    slot's SlotHistory row after it)."""
    key, sub = jax.random.split(key)
    one = jax.tree.map(lambda x: x[None], sampling)
    vocab = logits.shape[-1]
    hist = SlotHistory(jax.tree.map(lambda x: x[None], vrow), jnp.zeros((1, vocab), jnp.int32),
                       jnp.zeros((1,), jnp.int32))
    res = sample(logits, sub[None], one, hist, bits[None])
    return key, res, jax.tree.map(lambda x: x[0], hist.after(res[0]))


def prompt_scores(logits: jax.Array, next_ids: jax.Array) -> tuple[jax.Array, ...]:
    """The prompt's own logprobs from a chunk's logits [c, vocab]: for each position the log-prob
    of the prompt's next token next_ids [c], its rank (1 = the argmax) and the top
    MAX_TOP_LOGPROBS (ids, logprobs): (chosen [c], rank [c], top_ids [c, K], top_lp [c, K])."""
    lp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    chosen = jnp.take_along_axis(lp, next_ids[:, None], axis=-1)[:, 0]
    rank = (lp > chosen[:, None]).sum(-1).astype(jnp.int32) + 1
    top_lp, top_ids = jax.lax.top_k(lp, MAX_TOP_LOGPROBS)
    return chosen, rank, top_ids.astype(jnp.int32), top_lp


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


@dataclass
class Segments:
    """The per-segment inputs of a packed prefill call, S rows each (a pytree): cache row `slot`
    (unused segments: the slot count, so their writes are dropped), first cache index `start`,
    `offset` in the packed row, `n_valid` tokens, `rope_delta`, sampling (SlotSampling [S]),
    keys [S, 2] uint32, vrow (VocabRow [S, vocab]), bits [S, bit_words] uint32, adapter [S] int32
    (LoRA adapter slot, -1: none)."""
    slot: jax.Array
    start: jax.Array
    offset: jax.Array
    n_valid: jax.Array
    rope_delta: jax.Array
    sampling: SlotSampling
    keys: jax.Array
    vrow: VocabRow
    bits: jax.Array
    adapter: jax.Array


jax.tree_util.register_dataclass(Segments, data_fields=[f.name for f in fields(Segments)], meta_fields=[])


@dataclass
class Riders:
    """The running requests whose next token a packed prefill call computes too (a mixed step;
    models/text/packing.DecodeRows): ride [D] bool, slot j's next token rides; offset (int32
    scalar), the row position of the first rider, the others after it in slot order. D is
    static: 0 (no mixed steps: the graph is the plain prefill) or the slot count."""
    ride: jax.Array
    offset: jax.Array


jax.tree_util.register_dataclass(Riders, data_fields=["ride", "offset"], meta_fields=[])


def make_prefill_step(family: Family, tune: Tuning, lm_of, logits_sharding=None, scores: bool = False):
    """(lm_leaves, cache, state, token_ids [T], image_embeds [T, width] (width: the decoder's
    `feature_width`, hidden or more with per-layer image features), image_mask [T], positions
    [rows, T], spans [T] int32, token_seg [T] int32, seg: Segments of S rows, riders) -> (cache,
    state, sample outputs [S]). `lm_of(lm_leaves)` is the decoder (`nnx.merge` of the runner's
    split, inside the trace).

    The chunks of S sequences packed back to back in one row of T tokens (S = 1: one chunk, the
    plain one-sequence prefill), each into its own cache row (nn/packing.py: one GEMM per weight
    over all T tokens; attention in query blocks of one sequence each). Each sequence's first
    token is sampled from the logits of its chunk's last valid token and its slot's decode-state
    row is set up (the host only uses it after the final chunk). spans: image-token run ids of
    each chunk (-1 elsewhere), used by families with bidirectional image attention; token_seg:
    each token's segment (padding: the last used one).

    scores=True (prompt_logprobs; S = 1 only): one more argument, next_ids [T] int32 (each
    position's next prompt token), and one more output, `prompt_scores` of the logits of every
    chunk position (the forward computed their hidden states anyway: the LM head runs over T
    rows, not 1).

    riders: Riders of D rows (D static; D > 0: decoders with `supports_riders`, S > 1): the
    decode step of those slots rides in the call, each slot's token from the decode state taking
    a padding position of the row (unconstrained, one step). The outputs are then D rider rows
    (as `make_decode_step`'s rows) followed by the S segments' rows, and the riders' decode
    state advances as a decode step advances it."""

    def prefill(lm_leaves, cache, state, token_ids, image_embeds, image_mask, positions, spans, token_seg, seg,
                riders, next_ids=None):
        lm = lm_of(lm_leaves)
        t, s, d = token_ids.shape[0], seg.slot.shape[0], riders.ride.shape[0]
        ride = None
        adapters = seg.adapter[token_seg]       # each token's LoRA adapter slot
        if d:           # the riders' tokens, positions and cache indexes, from the decode state
            st = state.head(d)
            ride = DecodeRows(jnp.where(riders.ride, st.lengths, NO_INDEX),
                              jnp.where(riders.ride, riders.offset + jnp.cumsum(riders.ride) - 1, t))
            token_ids = token_ids.at[ride.position].set(st.tokens, mode="drop")
            adapters = adapters.at[ride.position].set(st.adapter, mode="drop")
            positions = positions.at[:, ride.position].set(
                jnp.broadcast_to(st.lengths + st.rope_delta, (positions.shape[0], d)), mode="drop")
        embeds, extra = lm.inputs(token_ids[None], image_embeds[None], image_mask[None])
        # the row's tokens (chunks back to back, then the riders) end here; the rest is the
        # bucket's padding, which the decoder's packed matmuls skip
        used = jnp.max(seg.offset + seg.n_valid)
        if d:
            used = jnp.maximum(used, riders.offset + jnp.sum(riders.ride.astype(jnp.int32)))
        valid = None
        if s == 1 and not d:    # one sequence: the row is its chunk (no gathers around attention)
            kv_len, packing = seg.start[0] + t, None
            # its real tokens (positions cannot tell: canvas M-RoPE repeats a column inside an image)
            valid = ((jnp.arange(t) >= seg.offset[0]) & (jnp.arange(t) < seg.offset[0] + seg.n_valid[0]))[None]
        else:
            if scores:
                raise ValueError("prompt scores come from a one-sequence prefill")
            packing = Packing(seg.slot, seg.start, seg.offset, seg.n_valid, token_seg, ride)
            kv_len = packing.kv_len if ride is None else jnp.maximum(packing.kv_len, ride.kv_len)
        meta = AttentionMetadata(positions[:, None, :], seg.start, kv_len, slots=seg.slot,
                                 spans=step_spans(family, spans[None]), packing=packing, pages=state.page_table,
                                 valid=valid, adapters=adapters[None],
                                 reduce_small=tune.reduce_small_attention)
        # the prompt rows (before the riders) go to the packed matmuls' AMX path, the riders
        # and the LM heads to their FMAs as in a decode step: a row's bits depend on what it is,
        # not on what shares its call (packed_weights.leading_rows)
        with packed_weights.leading_rows(t, used, amx=riders.offset if d else None):
            hidden, cache = lm(embeds, meta, cache, **extra)
        last = jnp.clip(seg.offset + seg.n_valid - 1, 0, t - 1)

        def head(hidden):    # the LM head on the FMAs, as the decode step's (its rows are decode rows)
            with packed_weights.fma_only():
                return _gathered(lm.logits(hidden), logits_sharding)
        if scores:
            every = head(hidden[0])                 # [T, vocab]
            logits = every[last]
        elif not d:
            logits = head(hidden[0][last])          # [S, vocab]
        else:       # the riders' sampling and state, as a decode step's (make_decode_step)
            row_split = jax.vmap(jax.random.split)(st.keys)

            def riding():       # one LM head call for the segments' last tokens and the riders
                rows = jnp.concatenate([last, jnp.clip(ride.position, 0, t - 1)])
                both = head(hidden[0][rows])
                return both[:s], sample(both[s:], row_split[:, 1], st.sampling, st.hist,
                                        jnp.full((d, seg.bits.shape[1]), 0xFFFFFFFF, jnp.uint32))

            def idle():         # none rides: the LM head and sampling of D rows skipped
                shapes = jax.eval_shape(riding)[1]
                return head(hidden[0][last]), jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), shapes)
            logits, row_res = jax.lax.cond(riders.ride.any(), riding, idle)
            state = state.advance_slots(jnp.where(riders.ride, jnp.arange(d), state.tokens.shape[0]), row_res[0],
                                        row_split[:, 0])
        split = jax.vmap(jax.random.split)(seg.keys)
        hist = SlotHistory(seg.vrow, jnp.zeros((s, logits.shape[-1]), jnp.int32), jnp.zeros((s,), jnp.int32))
        res = sample(logits, split[:, 1], seg.sampling, hist, seg.bits)
        rows = DecodeState(res[0], seg.start + seg.n_valid, seg.rope_delta, split[:, 0], seg.sampling,
                           jnp.full((s,), lm.num_layers, jnp.int32), jnp.zeros((s,), jnp.int32), hist.after(res[0]),
                           jnp.take(state.pages, seg.slot, axis=0, mode="clip"), seg.adapter)
        if scores:
            return cache, state.set_slots(seg.slot, rows), res, prompt_scores(every, next_ids)
        if d:
            res = tuple(jnp.concatenate([a, b]) for a, b in zip(row_res, res))
        return cache, state.set_slots(seg.slot, rows), res
    return prefill


def make_pruned_prefill_step(family: Family, tune: Tuning, lm_of, logits_sharding=None):
    """(lm_leaves, cache, state, token_ids [c], image_embeds, image_mask, positions, slot, n_valid,
    rope_delta, sampling, key, spans, vrow, bits, *, layer, keep, out_len) -> (cache, state, sample
    outputs): a whole prompt (from cache index 0) in one call with FastV pruning after decoder
    `layer` (static, as are `keep` image tokens and the `out_len` rows later layers compute);
    decoders with `supports_prune` only."""

    def prefill(lm_leaves, cache, state, token_ids, image_embeds, image_mask, positions, slot, n_valid,
                rope_delta, sampling, key, spans, vrow, bits, *, layer, keep, out_len):
        lm = lm_of(lm_leaves)
        c = token_ids.shape[0]
        embeds, extra = lm.inputs(token_ids[None], image_embeds[None], image_mask[None])
        prune = Prune(layer, keep, out_len, image_mask[None], (n_valid - 1)[None])
        meta = AttentionMetadata(positions[:, None, :], jnp.zeros((1,), jnp.int32), c, slots=slot[None],
                                 spans=step_spans(family, spans[None]), pages=state.page_table,
                                 reduce_small=tune.reduce_small_attention)
        hidden, cache, dropped = lm.forward_pruned(embeds, meta, cache, prune, **extra)
        dropped = dropped[0]
        logits = _gathered(lm.logits(jax.lax.dynamic_index_in_dim(hidden[0], n_valid - 1 - dropped,
                                                                  keepdims=True)), logits_sharding)
        key, res, hist = _first_token(logits, key, sampling, vrow, bits)
        row = DecodeState(res[0][0], n_valid, rope_delta, key, sampling, jnp.int32(layer), dropped, hist,
                          state.pages[slot], jnp.int32(-1))
        return cache, state.set_slot(slot, row), res
    return prefill


def make_decode_step(tune: Tuning, lm_of, logits_sharding=None):
    """(lm_leaves, cache, state, kv_lens, bits, *, rows, steps=1) -> (cache, state, sample
    outputs): one token for each of the first `rows` slots (static); bits [rows, words] uint32:
    each row's allowed-token bitmask (all ones: unconstrained); the other slots' cache and state
    rows are untouched. Inactive slots below `rows` compute garbage in their own cache row only.
    kv_lens [num_layers] int32: cache positions the active rows use after the step, per layer
    (they differ after pruned layers). steps > 1 (static): that many steps in one call (a
    `lax.scan`, each step reading the tokens the one before sampled), the outputs stacked [steps,
    rows, ...], kv_lens then the positions in use after the last step and `bits` the same for
    every step: one host dispatch for several tokens a row."""

    def one(lm, cache, state, kv_lens, bits, rows):
        st = state.head(rows)
        embeds, extra = lm.token_inputs(st.tokens[:, None])
        pos = jnp.broadcast_to((st.lengths + st.rope_delta)[None, :, None], (lm.position_rows, rows, 1))
        dropped = Dropped(st.drop_after, st.dropped, kv_lens) if lm.supports_prune else None
        meta = AttentionMetadata(pos, st.lengths, kv_lens.max(), dropped=dropped, pages=st.page_table,
                                 adapters=st.adapter[:, None],
                                 reduce_small=tune.reduce_small_attention)
        with packed_weights.fma_only():   # whatever the row count
            hidden, cache = lm(embeds, meta, cache, **extra)
            logits = _gathered(lm.logits(hidden[:, 0]), logits_sharding)
        split = jax.vmap(jax.random.split)(st.keys)
        res = sample(logits, split[:, 1], st.sampling, st.hist, bits)
        return cache, state.advance(res[0], split[:, 0]), res

    def decode(lm_leaves, cache, state, kv_lens, bits, *, rows, steps=1):
        lm = lm_of(lm_leaves)
        if steps == 1:
            return one(lm, cache, state, kv_lens, bits, rows)

        def body(carry, _):
            cache, state, res = one(lm, *carry, kv_lens, bits, rows)
            return (cache, state), res
        (cache, state), res = jax.lax.scan(body, (cache, state), None, length=steps)
        return cache, state, res
    return decode


def _shard_bytes(x) -> int:
    """Bytes one device holds of an abstract array (its sharding's shard shape, else all of it)."""
    sharding = getattr(x, "sharding", None)
    shape = sharding.shard_shape(x.shape) if sharding is not None else x.shape
    return int(np.prod(shape)) * np.dtype(x.dtype).itemsize


def device_memory_bytes(x) -> int:
    """Memory of the device holding x: the allocator's limit where the backend reports one (GPUs),
    else the host's physical memory (CPU: device memory is host memory)."""
    device = next(iter(x.devices()))
    stats = device.memory_stats() or {}
    if "bytes_limit" in stats:
        return int(stats["bytes_limit"])
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def make_encode_step(family: Family, model_of):
    """A jittable (vision leaves, one EncodeCall's inputs, adapter int32 scalar) -> features: the
    family's encode with every image of the call under LoRA adapter slot `adapter` (-1: none;
    nn/lora.py; a model without encoder adapter slots ignores it)."""
    from mmjax.models.nn import lora

    def encode(leaves, inputs, adapter):
        with lora.adapter_rows(adapter):
            return family.encode(model_of(leaves), inputs)
    return encode


def make_prompt_forward(family: Family, capture: Capture = Capture(), hidden: bool = False, tp: int = 1):
    """A jittable (lm, ids [t], image_embeds [t, d], image_mask [t], positions [rows, t], spans [t]
    int32 (image-token run ids, see models.family.run_spans; None: no runs)) -> (logits [t, vocab]
    float32, intermediates) over a whole prompt with a private one-slot cache (research / parity
    use; `capture` picks the intermediates, nn/capture.Capture; `lm`: the decoder module).
    hidden=True: the final (normed) hidden states [t, hidden] instead of the logits (embeddings).
    tp: the tensor-parallel shards the decoder's weights are laid out for (its cache's KV heads).
    adapter: an int32 scalar, the LoRA adapter slot of every token (None: no adapter)."""

    def fn(lm, ids, image_embeds, image_mask, positions, spans=None, adapter=None):
        t = ids.shape[0]
        embeds, extra = lm.inputs(ids[None], image_embeds[None], image_mask[None])
        cache = lm.init_cache(1, t, image_embeds.dtype, max_chunk=t, tp=tp)
        meta = AttentionMetadata(positions[:, None, :], jnp.zeros((1,), jnp.int32), t,
                                 spans=None if spans is None else step_spans(family, spans[None]),
                                 capture=tuple(capture.attn_layers), valid=jnp.ones((1, t), bool),
                                 adapters=None if adapter is None else jnp.full((1, t), adapter, jnp.int32))
        (out, _), inter = captured(lambda m, *a, **kw: m(*a, **kw), capture)(lm, embeds, meta, cache, **extra)
        return (out[0] if hidden else lm.logits(out[0])), inter
    return fn


def make_embed_forward(family: Family, tp: int = 1):
    """A jittable (lm, ids [b, t], image_embeds [b, t, d], image_mask [b, t], positions [rows, b,
    t], spans [b, t] int32 or None, lengths [b] int32) -> (last [b, hidden], mean [b, hidden])
    float32: the final normed hidden state of each prompt's last token and its mean over the
    prompt's tokens, for b prompts right-padded to t tokens (causal: padding after a prompt
    changes nothing before it) in one forward (embeddings); tp as in `make_prompt_forward`."""

    def fn(lm, ids, image_embeds, image_mask, positions, spans, lengths):
        b, t = ids.shape
        embeds, extra = lm.inputs(ids, image_embeds, image_mask)
        cache = lm.init_cache(b, t, image_embeds.dtype, max_chunk=t, tp=tp)
        meta = AttentionMetadata(positions, jnp.zeros((b,), jnp.int32), t,
                                 spans=None if spans is None else step_spans(family, spans),
                                 valid=jnp.arange(t)[None, :] < lengths[:, None])
        h = lm(embeds, meta, cache, **extra)[0].astype(jnp.float32)
        last = jnp.take_along_axis(h, (lengths - 1)[:, None, None], axis=1)[:, 0]
        valid = (jnp.arange(t)[None, :] < lengths[:, None]).astype(jnp.float32)
        mean = (h * valid[..., None]).sum(1) / lengths[:, None].astype(jnp.float32)
        return last, mean
    return fn


def _abstract(x):
    """An argument as the abstract value a step is lowered for (its sharding kept)."""
    if isinstance(x, jax.Array):
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
    if isinstance(x, (np.ndarray, np.generic)):
        return jax.ShapeDtypeStruct(np.shape(x), x.dtype)
    return x


_COMPILER: concurrent.futures.ThreadPoolExecutor | None = None
_COMPILER_LOCK = threading.Lock()


def _compile_pool() -> concurrent.futures.ThreadPoolExecutor:
    """One thread compiling steps ahead of time for every runner (`ModelRunner.ready`)."""
    global _COMPILER
    with _COMPILER_LOCK:
        if _COMPILER is None:
            _COMPILER = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="mmjax-compile")
        return _COMPILER


class ModelRunner:
    """Owns the KV cache and decode state of one model on its devices, the model's weights as
    its platform keeps them (`PlacedModel`), and the jitted steps over them."""

    def __init__(self, family: Family, model, *, max_num_seqs: int, max_model_len: int,
                 prefill_chunk: int, max_encode_batch: int, dtype=None, mesh=None, platform: str | None = None,
                 vision_tensor_parallel: bool = False, vision_offload: bool = False,
                 memory_budget: int | float | None = None, kv_cache_dtype: str | None = None,
                 max_prefill_seqs: int = 8, decode_steps: int = 1, primary: bool = False,
                 page_size: int | None = None, kv_cache_bytes: int | None = None):
        """model: the family's live `VisionLanguageModel` (`vlm.model`). max_prefill_seqs: the
        most sequences one prefill call packs (1: one per call). decode_steps: the decode steps
        a multi-step decode call takes (`decode(steps=)`; 1: none), compiled beside the one-step
        calls. primary: this runner's placed weights become the live module's (the engine's runner;
        any other runner, e.g. one for another platform or a data-parallel replica past the
        first, keeps what it places to itself). page_size: positions per KV page (None: the
        backend's, `Tuning.page_size`; 0: a cache row of max_model_len per slot, as decoders
        whose cache is not K/V per position have anyway: `Decoder.pages_kv`). kv_cache_bytes: the paged
        cache's size per device (None: from memory_budget when given, else as many pages as
        max_num_seqs full-length rows would take)."""
        if decode_steps < 1:
            raise ValueError(f"decode_steps must be >= 1, got {decode_steps}")
        self.decode_steps = decode_steps
        self._decode_step_counts = sorted({1, decode_steps})     # the decode shapes per row bucket
        self.family = family
        self.model = model
        self.placement = Placement(mesh, vision_tp=vision_tensor_parallel)
        lm = model.language_model
        narrow = {jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.int8), jnp.dtype(jnp.uint8), jnp.dtype(jnp.float8_e4m3fn)}
        self.tuning = dataclasses.replace(tuning(platform), sharded=self.placement.num_devices > 1,
                                          narrow_weights=any(x.dtype in narrow for x in jax.tree.leaves(nnx.state(lm))))
        # f32 / bf16 / int8 weights packed for the CPU matmul kernels where they run, [in, out]
        # elsewhere (a no-op for a model loaded on this platform: mmjax.load packs on a CPU host);
        # the decoder's weights regrouped per shard under tensor parallelism; all placed
        self.weights = PlacedModel(model, self.placement, pack=self.tuning.cpu_kernels and cpu_gemv.simd(),
                                   primary=primary, offload=vision_offload)
        self.dtype = dtype or lm.embed_tokens.embedding.get_value().dtype
        # the KV cache's element dtype: the model's ("auto"), bfloat16, or int8 / fp8 with scales
        self.kv_cache_dtype = kv_quant.resolve(kv_cache_dtype, self.tuning.auto_kv_cache_dtype(self.dtype))
        # packed encodes (Qwen-style patch packing) split per device unless the ViT is tensor parallel
        self.encode_shards = 1 if vision_tensor_parallel else self.placement.num_devices
        self.hidden_size = lm.hidden_size
        # columns of one image token's features (hidden, or more with per-layer image features)
        self.feature_width = lm.feature_width
        self.vocab_size = int(lm.vocab_size)                   # logits columns
        self.bit_words = (self.vocab_size + 31) // 32           # words of a token bitmask row
        v = self.vocab_size
        self._default_row = VocabRow(np.zeros(v, np.float32), np.zeros(v, bool), np.zeros(v, bool))
        self.max_model_len = max_model_len
        self.max_encode_batch = max_encode_batch
        self.prefill_chunk = prefill_chunk
        self.max_prefill_seqs = max_prefill_seqs
        self._idle_sampling = SlotSampling.from_params(SamplingParams(temperature=0.0))   # unused segments
        self.compiled: dict[str, set] = {"encode": set(), "prefill": set(), "decode": set(), "prefill_pruned": set(),
                                         "copy_slot": set(), "prefill_scores": set()}
        if family.cross_attention:       # the per-slot cross-attention K/V fill (Mllama)
            self.compiled["fill_cross"] = set()
        if lm.state_layers:     # recurrent-state snapshots to / from the pool (`init_state_pool`)
            self.compiled["copy_state"] = set()
        self.state_pool = None
        # mixed steps: running requests' decode step riding in packed prefill calls (Riders)
        self.mixes = self.tuning.mixed_steps and self.max_prefill_seqs > 1 and lm.supports_riders
        self._memory_plan: dict | None = None
        # the paged cache: a pool of num_pages pages of page_size positions for the layers that
        # grow with the sequence, each slot's pages in the decode state's page table
        if page_size is None:
            page_size = self.tuning.page_size
        self.paged = bool(page_size) and lm.pages_kv
        self.page_size = min(page_size, max_model_len) if self.paged else 0
        self.max_pages = -(-max_model_len // self.page_size) if self.paged else 0
        self.num_pages = max_num_seqs * self.max_pages
        if self.paged and kv_cache_bytes is not None:
            self.num_pages = self._pages_for_bytes(kv_cache_bytes)
        # the slots axis is never sharded: one set of cache shardings and jitted steps serves
        # every slot count, so they exist before memory_budget sizes the slots
        self.cache_shardings = self._cache_shardings(max_num_seqs)
        self._jit_steps()
        if memory_budget is not None:   # sized before anything big is allocated
            if self.paged and kv_cache_bytes is None:
                self.num_pages = self._fit_pages(memory_budget, max_num_seqs)
            else:
                max_num_seqs = self._fit_slots(memory_budget, max_num_seqs)
        self.num_slots = max_num_seqs
        self.buckets = self._buckets(max_num_seqs)
        # prompt_logprobs chunks (the prefill_scores step): the powers of two of the prefill
        # ladder, its largest rung included: few shapes for warmup to compile
        self.score_buckets = self._score_buckets(self.buckets)
        self.cache = self.fresh_cache()
        self.state = self.fresh_state()
        # measured now, while no step holds the (donated) cache: stats() may run on any thread
        self._memory: dict | None = self._measure_memory()
        # multi-host: on a mesh spanning processes, the leader announces each call to the
        # followers before making it (mmjax/distributed.py); None otherwise
        from mmjax import distributed
        index = distributed.register(self)
        self._announce = distributed.Leader(index) if index is not None and distributed.is_leader() else None
        # shapes compiled so far (`compiled`, set above); "decode": (rows, steps a call);
        # "prefill_pruned": (chunk, layer, keep, out_len) of FastV prefills
        self.compile_seconds = 0.0
        # shapes compiled ahead of time off the calling thread (`ready`): (kind, shape) -> executable,
        # and the compiles still running
        self._aot: dict[tuple, object] = {}
        self._compiling: dict[tuple, concurrent.futures.Future] = {}
        self.calls = {k: 0 for k in self.compiled}  # compiled-step invocations
        # wall seconds of each step kind until its outputs are ready, first-call compiles excluded
        self.step_seconds = {k: 0.0 for k in self.compiled}
        # called as on_compile(kind, shape, seconds) after each shape's first call (Engine.warmup's progress)
        self.on_compile = None

    @property
    def text_model(self):
        """The decoder module as this runner runs it (static facts: num_layers, ...)."""
        return self.model.language_model

    @property
    def lm_leaves(self) -> list:
        """What the text steps (prefill, decode, fill_cross) take: only the decoder's weight
        leaves, flat (a jitted call's host time grows with its argument leaves)."""
        return self.weights.split.lm_leaves

    def refresh(self) -> set[str]:
        """After an edit of the live model (values, or a replaced submodule): re-split and
        re-place the parts that changed, and rebuild the steps of a part whose module graph
        changed (jit then compiles only those on their next call; a value edit compiles
        nothing) -> the parts that changed ("language_model", "vision")."""
        before = self.weights.split
        changed = self.weights.refresh()
        after = self.weights.split
        if "language_model" in changed and after.lm_graphdef != before.lm_graphdef:
            for kind in self.compiled:
                if kind not in ("encode", "copy_slot", "copy_state"):
                    self.compiled[kind] = set()
            self._aot = {k: v for k, v in self._aot.items() if k[0] == "encode"}
            self._jit_lm_steps()
        if "vision" in changed and after.graphdef != before.graphdef:
            self.compiled["encode"] = set()
            self._jit_encode()
        return changed

    def _init_cache(self, num_slots: int, sharding=None, max_chunk: int | None = None, num_pages: int | None = None):
        """The decoder's zero cache, laid out for this runner's platform (the KV segment ladder is
        the platform's: `backend.Tuning.kv_segment_ladder`), allocated in its shardings."""
        lm = self.text_model
        with compiling_for(self.tuning.platform):
            return allocate_cache(lambda: lm.init_cache(num_slots, self.max_model_len, self.kv_cache_dtype,
                                                        max_chunk=max_chunk or self._buckets(num_slots).prefill[-1],
                                                        tp=self.placement.tp, pages=self._pages_arg(num_pages)),
                                  sharding)

    def _pages_arg(self, num_pages: int | None = None) -> tuple[int, int] | None:
        if not self.paged:
            return None
        return (self.num_pages if num_pages is None else num_pages, self.page_size)

    def page_bytes(self) -> int:
        """Device bytes of one KV page over every paged layer (the most loaded device)."""
        def kv(n):
            shape = jax.eval_shape(lambda: self._init_cache(1, max_chunk=self.prefill_chunk, num_pages=n))
            shardings = self.placement.cache_shardings(shape)
            if shardings is not None:
                shape = jax.tree.map(lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh), shape, shardings)
            return sum(_shard_bytes(x) for x in jax.tree.leaves(shape))
        return kv(2) - kv(1)

    def _fit_pages(self, budget: int | float, slots: int) -> int:
        """The most KV pages a plan with `slots` decode rows fits in `budget` bytes per device (a
        float in (0, 1]: that fraction of the device's memory): vLLM's gpu_memory_utilization,
        the steps' temporaries from their compiled memory analysis."""
        if isinstance(budget, float):
            if not 0 < budget <= 1:
                raise InvalidRequestError(f"memory_budget as a fraction must lie in (0, 1], got {budget}",
                                          param="memory_budget")
            budget = int(budget * device_memory_bytes(self.lm_leaves[0]))
        self.num_pages = self.max_pages
        temp = self.step_temp_bytes(slots)
        base = self._plan_for(slots, temp)
        n = self.max_pages + (budget - base["peak"]) // max(self.page_bytes(), 1)
        if n < self.max_pages:
            raise InvalidRequestError(
                f"memory budget {budget:,} bytes is too small: {base['peak']:,} bytes per device with the KV pages of "
                f"one max_model_len sequence", param="memory_budget")
        self.num_pages = int(n)
        self._memory_plan = self._plan_for(slots, temp)
        return self.num_pages

    def _pages_for_bytes(self, kv_bytes: int) -> int:
        n = int(kv_bytes) // max(self.page_bytes(), 1)
        if n < self.max_pages:
            raise InvalidRequestError(
                f"kv_cache_bytes {int(kv_bytes):,} holds {n} pages of {self.page_size} positions: fewer than one "
                f"max_model_len sequence needs ({self.max_pages})", param="kv_cache_bytes")
        return n

    def _cache_shardings(self, num_slots: int):
        return self.placement.cache_shardings(jax.eval_shape(lambda: self._init_cache(num_slots)))

    def _buckets(self, num_slots: int) -> Buckets:
        return Buckets.make(prefill_chunk=self.prefill_chunk, max_num_seqs=num_slots,
                            max_segments=self.max_prefill_seqs, fine=self.tuning.fine_prefill_ladder)

    @staticmethod
    def _score_buckets(buckets: Buckets) -> tuple[int, ...]:
        return pow2_ladder(buckets.prefill[0], buckets.prefill[-1])

    def _jit_steps(self) -> None:
        """The jitted steps of this model version (their shapes come from the arguments: one set
        serves any slot count); each merges the decoder (or the model) from its flat leaves."""
        p = self.placement
        self._jit_encode()
        self._jit_lm_steps()
        # a row per slot: every leaf's row; paged: the page of the paged leaves (`Decoder.copy_pages`)
        tm = self.text_model
        copy = ((lambda cache, src, dst: tm.copy_pages(cache, src, dst)) if self.paged
                else lambda cache, src, dst: jax.tree.map(lambda x: x.at[dst].set(x[src]), cache))
        self._copy = jax.jit(copy, donate_argnums=(0,), out_shardings=self.cache_shardings)
        self._restore = jax.jit(lambda state, slot, row: state.set_slot(
            slot, dataclasses.replace(row, pages=state.pages[slot])), donate_argnums=(0,))
        # jitted, not an eager .at[].set: right after a step the eager op took ~10 ms a park
        # (inside generate()'s time to first token on the 2-core box), this 3-4 ms
        self._park_lengths = jax.jit(lambda lengths, slot: lengths.at[slot].set(self.max_model_len),
                                     out_shardings=p.sharding("state"))

    def _jit_encode(self) -> None:
        family, p, t = self.family, self.placement, self.tuning
        model_of = self.weights.model_of()
        self._encode_of = model_of
        self._encode = jax.jit(t.traced(make_encode_step(family, model_of)),
                               out_shardings=p.sharding("outputs"), compiler_options=t.compiler_options("encode"))

    def _jit_lm_steps(self) -> None:
        family, p, t = self.family, self.placement, self.tuning
        lm_of = self.weights.lm_of()
        outs = step_shardings(self.cache_shardings, p.sharding("state"), p.sharding("outputs"))
        gather = (NamedSharding(p.mesh, PartitionSpec(None, MODEL)), p.sharding("outputs")) if p.tp > 1 else None
        self._prefill = jax.jit(t.traced(make_prefill_step(family, t, lm_of, gather)), donate_argnums=(1, 2),
                                out_shardings=outs, compiler_options=t.compiler_options("prefill"))
        scores_outs = step_shardings(self.cache_shardings, p.sharding("state"), p.sharding("outputs"),
                                     p.sharding("outputs"))
        self._prefill_scores = jax.jit(t.traced(make_prefill_step(family, t, lm_of, gather, scores=True)),
                                       donate_argnums=(1, 2), out_shardings=scores_outs,
                                       compiler_options=t.compiler_options("prefill"))
        self._decode = jax.jit(t.traced(make_decode_step(t, lm_of, gather)),
                               static_argnames=("rows", "steps"),
                               donate_argnums=(1, 2), out_shardings=outs,
                               compiler_options=t.compiler_options("decode"))
        if family.cross_attention:
            self._fill_cross = jax.jit(t.traced(lambda leaves, cache, *a: lm_of(leaves).fill_cross(cache, *a)),
                                       donate_argnums=(1,), out_shardings=self.cache_shardings)
        self._prefill_pruned = jax.jit(t.traced(make_pruned_prefill_step(family, t, lm_of, gather)),
                                       donate_argnums=(1, 2), static_argnames=("layer", "keep", "out_len"),
                                       out_shardings=outs, compiler_options=t.compiler_options("prefill"))

    def encode_model(self, leaves: list | None = None):
        """The model as the encode step sees it (inside a trace: from `leaves`, default this
        runner's vision leaves): what research code differentiates encode through."""
        return self._encode_of(self.weights.split.vision_leaves if leaves is None else leaves)

    def fresh_cache(self):
        return self._init_cache(self.num_slots, self.cache_shardings, self.buckets.prefill[-1])

    def fresh_state(self) -> DecodeState:
        return self.placement.place(DecodeState.zeros(self.num_slots, self.vocab_size, self.max_pages, self.num_pages),
                                    "state")

    def default_row(self) -> VocabRow:
        """The VocabRow of a request without penalties, bias or token limits."""
        return self._default_row

    def all_allowed(self, rows: int | None = None) -> np.ndarray:
        """An unconstrained token bitmask: [bit_words] (rows None) or [rows, bit_words] uint32."""
        shape = (self.bit_words,) if rows is None else (rows, self.bit_words)
        return np.full(shape, 0xFFFFFFFF, np.uint32)

    def reset_device_state(self) -> None:
        """Fresh KV cache and decode state (after a failed step may have consumed donated buffers)."""
        if self._announce is not None:
            return self._announce("reset", None, self._reset)
        self._reset()

    def _reset(self) -> None:
        self.cache = self.fresh_cache()
        self.state = self.fresh_state()
        if self.state_pool is not None:     # a failed snapshot copy may have consumed it
            self.init_state_pool(self.state_pool.rows)

    def copy_slot(self, src: int, dst: int) -> None:
        """Copy cache row `src` into row `dst` (n > 1 siblings share their prompt's KV). Every
        text model's cache leaves have the slot axis first (models/text TextModel.init_cache);
        a paged cache's rows are pages, its per-slot leaves (Mllama's cross cache) left alone
        (`copy_pages`)."""
        if self._announce is not None:
            return self._announce("copy_slot", (src, dst), lambda: self._copy_slot(src, dst))
        self._copy_slot(src, dst)

    def _copy_slot(self, src: int, dst: int) -> None:
        self.cache = self._track("copy_slot", 0, self._copy, self.cache, np.int32(src), np.int32(dst))

    def init_state_pool(self, rows: int) -> None:
        """A pool of `rows` snapshots of the recurrent decoder's per-slot states (a hybrid
        decoder's `state_layers`) beside the cache: serving/state_snapshots.py."""
        from mmjax.serving.state_snapshots import StatePool
        self.state_pool = StatePool(self.cache, self.text_model.state_layers, rows, self.cache_shardings)

    def save_state(self, slot: int, row: int) -> None:
        """Snapshot slot `slot`'s recurrent states into pool row `row`."""
        if self._announce is not None:
            return self._announce("save_state", (slot, row), lambda: self._save_state(slot, row))
        self._save_state(slot, row)

    def _save_state(self, slot: int, row: int) -> None:
        self._track("copy_state", "save", self.state_pool.save, self.cache, slot, row, wait=False)

    def load_state(self, row: int, slot: int) -> None:
        """Slot `slot`'s recurrent states <- pool row `row` (a prefix resumed from its snapshot)."""
        if self._announce is not None:
            return self._announce("load_state", (row, slot), lambda: self._load_state(row, slot))
        self._load_state(row, slot)

    def _load_state(self, row: int, slot: int) -> None:
        self.cache = self._track("copy_state", "load", self.state_pool.load, self.cache, row, slot, wait=False)

    def set_pages(self, table: np.ndarray) -> None:
        """The host page table [slots, max_pages] int32 (`pages.KVPages.table`) into the decode
        state, read by every later step (a paged cache only)."""
        if self.state.pages.is_deleted():     # a failed step consumed the state: it is being reset
            return
        if self._announce is not None:
            return self._announce("set_pages", (table,), lambda: self._set_pages(table))
        self._set_pages(table)

    def _set_pages(self, table: np.ndarray) -> None:
        # placed as fresh_state places it (an explicit sharding on one device would commit the
        # array and make every step's jit cache miss: a recompile after warmup)
        pages = self.placement.place(np.ascontiguousarray(table, np.int32), "state")
        self.state = dataclasses.replace(self.state, pages=pages)

    def copy_pages(self, pairs: list[tuple[int, int]]) -> None:
        """Copy KV page src into page dst for each (src, dst) (a forked sibling's partial last
        page): a paged cache's `copy_slot` copies pages of its paged part (`Decoder.copy_pages`)."""
        for src, dst in pairs:
            self.copy_slot(src, dst)

    def save_row(self, slot: int):
        """A host copy of slot `slot`'s decode-state row (a preempted request's sampling key,
        last token, penalties' history: `restore_row` puts it back after its KV is recomputed)."""
        return jax.tree.map(lambda x: np.asarray(x[slot]), self.state)

    def restore_row(self, slot: int, row) -> None:
        """Slot `slot`'s decode-state row from `save_row` (its page-table row kept)."""
        if self._announce is not None:
            return self._announce("restore_row", (slot, row), lambda: self._restore_row(slot, row))
        self._restore_row(slot, row)

    def _restore_row(self, slot: int, row) -> None:
        self.state = self._restore(self.state, np.int32(slot), row)

    def park(self, slot: int) -> None:
        """A released slot's decode row points past the cache (length max_model_len): the decode
        steps whose rows still cover it then write nothing into the KV it keeps for the prefix
        cache (segments drop indexes past max_len; a ring-buffer sliding-window layer, which
        would otherwise evict the window a resume needs, drops indexes >= kv_len)."""
        if self.state.lengths.is_deleted():   # a failed step consumed the state: it is being reset
            return
        if self._announce is not None:        # a computation on the global state: every process runs it
            return self._announce("park", (slot,), lambda: self._park(slot))
        self._park(slot)

    def _park(self, slot: int) -> None:
        self.state = dataclasses.replace(self.state, lengths=self._park_lengths(self.state.lengths, np.int32(slot)))

    def device_state_lost(self) -> bool:
        """Did a failed call consume the donated cache or state?"""
        return any(x.is_deleted() for x in jax.tree.leaves((self.cache, self.state)))

    # ---- host entry points -----------------------------------------------------------------
    def _track(self, kind: str, shape, fn, *args, wait: bool = True, **kw):
        """Run one compiled step and wait for it (its outputs are read on the host right after
        anyway); the time goes to compile_seconds on a shape's first call, else step_seconds.
        wait=False (overlapped steps): only dispatch it (a shape's first call still waits, so
        that its compile time is measured); step_seconds then gets the dispatch time, and
        `PendingOutput.result` adds the time the host waits for the outputs."""
        self.calls[kind] += 1
        first = shape not in self.compiled[kind]
        t0 = time.perf_counter()
        aot = self._aot.get((kind, shape))
        if aot is not None:     # compiled off this thread (`ready`): the executable itself, no trace
            fn, kw = aot, {}
        with compiling_for(self.tuning.platform):
            result = fn(*args, **kw)
            if wait or first:
                result = jax.block_until_ready(result)
        dt = time.perf_counter() - t0
        if first:
            self.compile_seconds += dt
            self.compiled[kind].add(shape)
            if self.on_compile is not None:     # a warmup: its progress line (n of N) says it
                self.on_compile(kind, shape, dt)
            else:
                log.info("compiled %s %s in %.2fs", kind, shape, dt)
        else:
            self.step_seconds[kind] += dt
        return result

    def encode(self, calls: list[EncodeCall], adapter: int = -1) -> list[np.ndarray]:
        """Run a family's encode plan -> one feature array [num_tokens, hidden] per image, in order.
        adapter: the LoRA adapter slot every call runs under (-1: none; `make_encode_step`)."""
        if self._announce is not None:
            return self._announce("encode", [(c.bucket, c.inputs) for c in calls], lambda: self._encode_calls(calls))
        return self._encode_calls(calls, adapter)

    def _encode_calls(self, calls: list[EncodeCall], adapter: int = -1) -> list[np.ndarray]:
        out: list[np.ndarray] = []
        for call in calls:
            inputs = call.inputs
            if isinstance(inputs, np.ndarray) or self.encode_shards > 1:
                # data-parallel vision tower: the images of the call (or the family's packed
                # groups, one per device) split over the replica's devices
                inputs = jax.tree.map(self._encode_input, inputs)
            feats = np.asarray(self._track("encode", call.bucket, self._encode, self.weights.split.vision_leaves,
                                           inputs, np.int32(adapter)))
            out.extend(call.split(feats))
        return out

    def _encode_input(self, x: np.ndarray):
        s = self.placement.encode_input_sharding(np.shape(x))
        return x if s is None else jax.device_put(x, s)

    def encode_plan(self, images: list) -> list[EncodeCall]:
        """The family's encode plan for this runner (its batch limit and device count)."""
        return self.family.encode_plan(images, self.max_encode_batch, shards=self.encode_shards)

    def warmup_plan(self) -> list[EncodeCall]:
        return self.family.warmup_plan(self.max_encode_batch, shards=self.encode_shards)

    def encode_images(self, images: list, adapter: int = -1) -> list[np.ndarray]:
        """Prepared images -> features [num_tokens, hidden] (the family's plan, then `encode` under
        LoRA adapter slot `adapter`, then each image's host `post` transform, if an intervention
        set one)."""
        feats = self.encode(self.encode_plan(images), adapter)
        return [f if im.post is None else im.post(f) for im, f in zip(images, feats)]

    def rider_rows(self, buckets: Buckets | None = None) -> int:
        """D, the rider rows every packed prefill call has (0: no mixed steps): every slot."""
        return (buckets or self.buckets).decode[-1] if self.mixes else 0

    def prefill(self, chunks: list[PrefillChunk], prune: tuple[int, int] | None = None,
                wait: bool = True, riders: list[int] = ()) -> StepOutput | PendingOutput:
        """Prefill the chunks of up to `buckets.segments[-1]` sequences (distinct slots, <=
        prefill_chunk tokens together) in one call, packed into one row (one chunk: a plain
        one-sequence prefill). prune (layer, keep): FastV pruning of the image tokens after
        `layer` (one chunk, the whole prompt from cache index 0; later layers compute the
        remaining tokens' bucket). A chunk with next_ids (prompt_logprobs) goes alone: its
        output's `scores` then holds `prompt_scores` of the chunk's positions (no pruning; such a
        step always waits). Outputs have one row per chunk, in order. wait=False: return a
        PendingOutput without waiting for the step.

        riders (a mixed step; runners that `mixes`, packed chunks without prune or prompt scores):
        the slots of running requests whose next token this call computes too, as a one-step
        unconstrained decode does; their tokens follow the chunks in the row (<= the largest rung
        together). Outputs: one row per rider in slot order, then one per chunk."""
        if self._announce is not None:
            return self._announce("prefill", (chunks, prune, True, riders),
                                  lambda: self._prefill_call(chunks, prune, wait, riders))
        return self._prefill_call(chunks, prune, wait, riders)

    def _output(self, kind: str, out, wait: bool, rows: int | None = None,
                take: np.ndarray | None = None) -> StepOutput | PendingOutput:
        pending = PendingOutput(self, kind, out, rows, take)
        return pending.result() if wait else pending

    def _prefill_call(self, chunks: list[PrefillChunk], prune=None, wait: bool = True,
                      riders: list[int] = ()) -> StepOutput | PendingOutput:
        if riders and (not self.mixes or prune is not None or any(c.next_ids is not None for c in chunks)):
            raise ValueError("riders take a packed prefill call without prune or prompt scores on a runner that mixes")
        if prune is not None:
            if len(chunks) != 1 or chunks[0].start != 0:
                raise ValueError("a pruned prefill takes one whole prompt from cache index 0")
            if chunks[0].next_ids is not None:
                raise ValueError("prompt scores of a pruned prefill are not defined")
            return self._prefill_pruned_call(chunks[0], prune, wait)
        k = len(chunks)
        scoring = any(c.next_ids is not None for c in chunks)
        if scoring and k != 1:
            raise ValueError("a prompt_logprobs chunk is prefilled alone")
        # the scores step is the one-sequence graph (S = 1) whatever the segment rung
        s = 1 if scoring else bucket_for(k, self.buckets.segments)
        d = 0 if scoring else self.rider_rows()
        if scoring:
            c = chunks[0]
            c_len, args = self._scores_args(c)
            self.cache, self.state, out, sc = self._track("prefill_scores", c_len, self._prefill_scores, self.lm_leaves,
                                                          self.cache, self.state, *args)
            n = len(c.token_ids)
            return StepOutput(*(np.asarray(x) for x in out), scores=tuple(np.asarray(x)[:n] for x in sc))
        c_len, args = self._pack(chunks, s, riders, d)
        self.cache, self.state, out = self._track("prefill", (c_len, s), self._prefill, self.lm_leaves, self.cache,
                                                  self.state, *args, wait=wait)
        if not d:
            return self._output("prefill", out, wait, rows=k)
        # the riders' rows (row j: slot j), then the chunks' (after all D rider rows)
        return self._output("prefill", out, wait, take=np.r_[np.sort(np.asarray(riders, np.int64)), d + np.arange(k)])

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

    def _prefill_pruned_call(self, chunk: PrefillChunk, prune: tuple[int, int],
                             wait: bool = True) -> StepOutput | PendingOutput:
        shape, args, kw = self._pruned_args(chunk, prune)
        self.cache, self.state, out = self._track("prefill_pruned", shape, self._prefill_pruned, self.lm_leaves,
                                                  self.cache, self.state, *args, **kw, wait=wait)
        return self._output("prefill_pruned", out, wait)

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

    # ---- shapes compiled off the engine thread --------------------------------------------------
    def ready(self, chunks: list[PrefillChunk], prune: tuple[int, int] | None = None) -> bool:
        """Can `prefill(chunks, prune)` run now without compiling on the calling thread? The
        steps a single request reaches beyond the ladders `warmup` compiles, a FastV call
        (prefill_pruned: one shape per chunk, layer, keep and output length) and a
        prompt_logprobs call not warmed up (prefill_scores), compile in a background thread,
        ahead of time, their executable then kept for that shape: until it is done this says
        False (the engine serves the shapes that exist meanwhile). The compile's error, if it
        failed, is raised here once. Other calls: True (they compile on first use; `warmup`
        compiles them all up front)."""
        spec = self._ahead_spec(chunks, prune)
        if spec is None:
            return True
        kind, shape, fn, args, kw = spec
        if shape in self.compiled[kind]:
            return True
        key = (kind, shape)
        fut = self._compiling.get(key)
        if fut is None:
            abstract = jax.tree.map(_abstract, (self.lm_leaves, self.cache, self.state) + tuple(args))
            self._compiling[key] = _compile_pool().submit(self._compile_ahead, kind, shape, fn, abstract, kw)
            return False
        if not fut.done():
            return False
        del self._compiling[key]
        executable, dt = fut.result()        # its error, if the compile failed
        self._aot[key] = executable
        self.compiled[kind].add(shape)
        self.compile_seconds += dt
        return True

    def _ahead_spec(self, chunks: list[PrefillChunk], prune):
        """(kind, shape, jitted step, array arguments after params / cache / state, static kwargs) of a
        call `ready` compiles off the calling thread; None for the others."""
        if self._announce is not None or not chunks:       # multi-host: every process compiles in step
            return None
        if prune is not None:
            shape, args, kw = self._pruned_args(chunks[0], prune)
            return "prefill_pruned", shape, self._prefill_pruned, args, kw
        if chunks[0].next_ids is not None:
            shape, args = self._scores_args(chunks[0])
            return "prefill_scores", shape, self._prefill_scores, args, {}
        return None

    def compile_key(self, chunks: list[PrefillChunk], prune=None) -> tuple | None:
        """(kind, shape) of the call `ready` looked at (None: one that never waits)."""
        spec = self._ahead_spec(chunks, prune)
        return None if spec is None else spec[:2]

    def compile_done(self, key: tuple | None) -> bool:
        """Is the background compile of `key` (`compile_key`) over (or none running)?"""
        fut = self._compiling.get(key) if key is not None else None
        return fut is None or fut.done()

    def _compile_ahead(self, kind: str, shape, fn, abstract: tuple, kw: dict):
        """(executable, seconds) of `fn` for these abstract arguments (in the compile thread)."""
        t0 = time.perf_counter()
        with compiling_for(self.tuning.platform):
            executable = fn.lower(*abstract, **kw).compile()
        dt = time.perf_counter() - t0
        log.info("compiled %s %s in %.2fs (in the background)", kind, shape, dt)
        return executable, dt

    def compiling(self) -> int:
        """Compiles running in the background (`ready`)."""
        return len(self._compiling)

    def wait_compiling(self, timeout: float) -> None:
        """Wait up to `timeout` s for one of the background compiles to finish."""
        if self._compiling:
            concurrent.futures.wait(list(self._compiling.values()), timeout,
                                    return_when=concurrent.futures.FIRST_COMPLETED)

    def fill_cross(self, slot: int, feats: list[np.ndarray], n_tiles: list[int], dec: int) -> None:
        """Cross-attention families: write one request's images (feats: per image [vision tokens,
        hidden]; none for a text-only request) into cache row `slot`'s cross-attention K/V,
        once per request; `dec`: its decode tokens' packed image range."""
        if self._announce is not None:
            return self._announce("fill_cross", (slot, feats, n_tiles, dec),
                                  lambda: self._fill_cross_row(slot, feats, n_tiles, dec))
        self._fill_cross_row(slot, feats, n_tiles, dec)

    def _fill_cross_row(self, slot, feats, n_tiles, dec) -> None:
        tm = self.text_model
        if len(feats) > tm.max_images:
            raise InvalidRequestError(f"{len(feats)} images in one request; the cross-attention cache holds "
                                      f"{tm.max_images}", param="images", code="too_many_images")
        x = np.zeros((tm.n_vis, self.hidden_size), self.dtype)
        if feats:
            x[:sum(len(f) for f in feats)] = np.concatenate(feats)
        tiles = np.zeros(tm.max_images, np.int32)
        tiles[:len(n_tiles)] = n_tiles
        self.cache = self._track("fill_cross", (), self._fill_cross, self.lm_leaves, self.cache, np.int32(slot), x,
                                 np.int32(len(feats)), tiles, np.int32(dec))

    def decode(self, max_length: int | np.ndarray, active_rows: int | None = None,
               bits: np.ndarray | None = None, wait: bool = True, steps: int = 1) -> StepOutput | PendingOutput:
        """Advance the first `active_rows` slots (default: all; rounded up to the decode ladder)
        by one token; `max_length` = longest active sequence after the step (per layer
        [num_layers] where pruned rows make later layers shorter); bits [>= active_rows,
        bit_words] uint32: allowed-token bitmasks of the slots (None: all allowed; missing rows
        are unconstrained). Outputs have one row per advanced slot. The step reads each slot's
        input token from the decode state on the device (the previous step's sample), so with
        wait=False (a PendingOutput comes back) the next step can be queued before the host
        reads this one's tokens. steps = this runner's `decode_steps`: that many tokens a slot in
        one call (max_length: after the last; the same bits for each), outputs [steps, rows]
        (`StepOutput.steps()` splits them)."""
        if steps not in self._decode_step_counts:
            raise ValueError(f"steps must be 1 or this runner's decode_steps ({self.decode_steps}), got {steps}")
        if self._announce is not None:
            return self._announce("decode", (max_length, active_rows, bits, True, steps),
                                  lambda: self._decode_rows(max_length, active_rows, bits, wait, steps))
        return self._decode_rows(max_length, active_rows, bits, wait, steps)

    def _decode_rows(self, max_length: int | np.ndarray, active_rows: int | None, bits=None,
                     wait: bool = True, steps: int = 1) -> StepOutput | PendingOutput:
        rows = bucket_for(self.num_slots if active_rows is None else active_rows, self.buckets.decode)
        kv_lens = np.broadcast_to(np.asarray(max_length, np.int32), (self.text_model.num_layers,))
        full = self.all_allowed(rows)
        if bits is not None:
            k = min(rows, len(bits))
            full[:k] = bits[:k]
        self.cache, self.state, out = self._track("decode", (rows, steps), self._decode, self.lm_leaves, self.cache,
                                                  self.state, np.ascontiguousarray(kv_lens), full, rows=rows,
                                                  steps=steps, wait=wait)
        return self._output("decode", out, wait)

    def warmup(self) -> None:
        """Compile every bucket of every step (leaves garbage in slot 0: reset afterwards)."""
        self.encode(self.warmup_plan())
        if self.family.cross_attention:
            self.fill_cross(0, [], [], 0)
        rows = self.text_model.position_rows
        for c in self.buckets.prefill:
            for s in self.buckets.segments:       # s chunks of c // s tokens (slots 0..s-1)
                self.prefill([PrefillChunk(i, 0, np.zeros(c // s, np.int32), None, np.zeros(c // s, bool),
                                           np.zeros((rows, c // s), np.int32), 0, self._idle_sampling,
                                           np.zeros(2, np.uint32)) for i in range(s)])
        for c in self.score_buckets:              # prompt_logprobs: the prefill_scores step
            self.prefill([PrefillChunk(0, 0, np.zeros(c, np.int32), None, np.zeros(c, bool),
                                       np.zeros((rows, c), np.int32), 0, self._idle_sampling, np.zeros(2, np.uint32),
                                       next_ids=np.zeros(c, np.int32))])
        for r in self.buckets.decode:
            for steps in self._decode_step_counts:
                self.decode(steps, r, steps=steps)
        self.copy_slot(0, 0)

    def step_signatures(self, num_slots: int | None = None) -> list[tuple[str, object, tuple, dict]]:
        """(name, jitted step, abstract args, static kwargs) for every compiled shape this runner
        can produce: what tests/test_cuda_lowering.py exports for CUDA. num_slots: the shapes a
        runner with that many slots would have (nothing allocated; memory planning)."""
        mesh = self.placement.mesh
        cache, state, buckets = self._abstract_device_state(num_slots)

        def spec(x, sharding=None):
            # with a mesh, the abstract args carry the placed arrays' shardings (what export sees)
            # (and so do offloaded weights: their host memory kind is part of the signature)
            placed = getattr(x, "sharding", None)
            offloaded = placed is not None and placed.memory_kind not in (None, "device")
            sharding = sharding or (placed if mesh is not None or offloaded else None)
            return jax.ShapeDtypeStruct(np.shape(x), jnp.asarray(x).dtype if not hasattr(x, "dtype") else x.dtype,
                                        sharding=sharding)

        split = self.weights.split
        lm, vision, cache, state = (jax.tree.map(spec, t) for t in (split.lm_leaves, split.vision_leaves, cache, state))
        out = []
        for call in self.warmup_plan():
            inputs = call.inputs
            if isinstance(inputs, np.ndarray):
                inputs = spec(inputs, self.placement.encode_input_sharding(inputs.shape))
            else:
                inputs = jax.tree.map(spec, inputs)
            out.append((f"encode{call.bucket}", self._encode, (vision, inputs, jax.ShapeDtypeStruct((), jnp.int32)), {}))
        rows = self.text_model.position_rows
        i32 = jax.ShapeDtypeStruct((), jnp.int32)
        samp = jax.tree.map(spec, SlotSampling.from_params(SamplingParams(temperature=0.0)))
        vrow = jax.tree.map(spec, self.default_row())
        bits = jax.ShapeDtypeStruct((self.bit_words,), jnp.uint32)
        shape = jax.ShapeDtypeStruct
        for c in buckets.prefill:
            tokens = (shape((c,), jnp.int32), shape((c, self.feature_width), self.dtype), shape((c,), jnp.bool_),
                      shape((rows, c), jnp.int32))

            def seg_args(s, d=self.rider_rows(buckets)):
                per = shape((s,), jnp.int32)
                seg = Segments(per, per, per, per, per, jax.tree.map(lambda x: shape((s,), x.dtype), samp),
                               shape((s, 2), jnp.uint32), jax.tree.map(lambda x: shape((s,) + x.shape, x.dtype), vrow),
                               shape((s, self.bit_words), jnp.uint32), per)
                return (lm, cache, state, *tokens, shape((c,), jnp.int32), shape((c,), jnp.int32), seg,
                        Riders(shape((d,), jnp.bool_), i32))
            for s in buckets.segments:
                out.append((f"prefill[{c}]" if s == 1 else f"prefill[{c},{s}]", self._prefill, seg_args(s), {}))
            if c == buckets.prefill[0]:     # prompt_logprobs: the one-sequence prefill with every position's logits
                out.append((f"prefill_scores[{c}]", self._prefill_scores, seg_args(1, 0) + (shape((c,), jnp.int32),),
                            {}))
            if c == buckets.prefill[0] and self.family.cross_attention:
                tm = self.text_model
                out.append(("fill_cross", self._fill_cross,
                            (lm, cache, i32, jax.ShapeDtypeStruct((tm.n_vis, self.hidden_size), self.dtype), i32,
                             jax.ShapeDtypeStruct((tm.max_images,), jnp.int32), i32), {}))
            if c == buckets.prefill[-1] and self.text_model.supports_prune:
                # one FastV variant (each (chunk, layer, keep, out_len) a request uses compiles like it)
                pruned = (lm, cache, state, *tokens, i32, i32, i32, samp, shape((2,), jnp.uint32),
                          shape((c,), jnp.int32), vrow, bits)
                out.append((f"prefill_pruned[{c}]", self._prefill_pruned, pruned,
                            {"layer": 0, "keep": 1, "out_len": buckets.prefill[0]}))
        out.append(("copy_slot", self._copy, (cache, i32, i32), {}))
        if self.text_model.state_layers:    # a hybrid decoder's state snapshots (serving/state_snapshots.py)
            from mmjax.serving.state_snapshots import StatePool
            sp = self.state_pool or StatePool(cache, self.text_model.state_layers, 1, self.cache_shardings,
                                              allocate=False)
            pool, states = jax.tree.map(spec, sp.pool), [cache[i] for i in sp.layers]
            out += [("copy_state(save)", sp._save, (pool, states, i32, i32), {}),
                    ("copy_state(load)", sp._load, (states, pool, i32, i32), {})]
        for r in buckets.decode:
            lens = jax.ShapeDtypeStruct((self.text_model.num_layers,), jnp.int32)
            for steps in self._decode_step_counts:
                out.append((f"decode[{r}]" if steps == 1 else f"decode[{r}]x{steps}", self._decode,
                            (lm, cache, state, lens, jax.ShapeDtypeStruct((r, self.bit_words), jnp.uint32)),
                            {"rows": r, "steps": steps}))
        return out

    def _abstract_device_state(self, num_slots: int | None):
        """(cache, state, buckets): this runner's, or abstract ones for `num_slots` slots carrying
        the shardings they would be placed with."""
        if num_slots is None:
            return self.cache, self.state, self.buckets
        buckets = self._buckets(num_slots)
        shape = jax.eval_shape(lambda: self._init_cache(num_slots, max_chunk=buckets.prefill[-1]))
        shardings = self._cache_shardings(num_slots)
        with_sharding = (lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh)) if shardings is not None \
            else (lambda x, sh: x)
        cache = jax.tree.map(with_sharding, shape, shardings) if shardings is not None else shape
        state = jax.eval_shape(lambda: DecodeState.zeros(num_slots, self.vocab_size, self.max_pages, self.num_pages))
        return cache, state, buckets

    def step_temp_bytes(self, num_slots: int | None = None) -> dict[str, int]:
        """Temporary device bytes of the largest compiled step of each kind (the largest encode
        bucket, prefill chunk and decode rows), from XLA's own `memory_analysis()` of steps
        compiled ahead of time for `num_slots` slots (default: this runner's)."""
        largest: dict[str, tuple] = {}
        for name, fn, args, kw in self.step_signatures(num_slots):
            kind = name.split("[")[0].split("(")[0]
            if kind in ("encode", "prefill", "decode"):
                largest[kind] = (fn, args, kw)       # each kind's signatures go smallest to largest
        out = {}
        with compiling_for(self.tuning.platform):
            for kind, (fn, args, kw) in largest.items():
                analysis = fn.lower(*args, **kw).compile().memory_analysis()
                out[kind] = 0 if analysis is None else int(analysis.temp_size_in_bytes)
        return out

    def _plan_for(self, num_slots: int, temp: dict[str, int]) -> dict:
        """The device memory plan, bytes per device (the most loaded one): weights by part, KV
        cache and decode state for `num_slots` slots, each step kind's temporaries, and the peak.
        Offloaded vision weights occupy the device only during encode (counted there)."""
        split = self.weights.split
        text = max(per_device_bytes(split.lm_leaves).values(), default=0)
        vision = max(per_device_bytes(split.vision_leaves).values(), default=0)
        host = vision if self.weights.offload else 0
        cache, state, _ = self._abstract_device_state(num_slots)
        kv = sum(_shard_bytes(x) for x in jax.tree.leaves(cache))
        st = sum(int(np.prod(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(state))
        # a hybrid decoder's state-snapshot pool: ROWS_PER_SLOT copies of each slot's states
        from mmjax.serving.state_snapshots import ROWS_PER_SLOT
        snaps = ROWS_PER_SLOT * sum(_shard_bytes(x) for i in self.text_model.state_layers
                                    for x in jax.tree.leaves(cache[i]))
        resident = text + vision - host + kv + st + snaps
        step = max(temp.get("encode", 0) + host, temp.get("prefill", 0), temp.get("decode", 0))
        return {"slots": num_slots, **({"pages": self.num_pages, "page_size": self.page_size} if self.paged else {}),
                "weights_text": text, "weights_vision": vision,
                "vision_offloaded": self.weights.offload, "kv_cache": kv, "decode_state": st,
                **({"state_snapshots": snaps} if snaps else {}),
                "kv_cache_dtype": kv_quant.dtype_name(self.kv_cache_dtype),
                "temp_encode": temp.get("encode", 0), "temp_prefill": temp.get("prefill", 0),
                "temp_decode": temp.get("decode", 0), "peak": resident + step}

    def memory_plan(self) -> dict:
        """This runner's device memory plan (`_plan_for`; the steps' temporaries are compiled for it
        once, on first call: the server does it at startup)."""
        if self._memory_plan is None:
            self._memory_plan = self._plan_for(self.num_slots, self.step_temp_bytes())
        return dict(self._memory_plan)

    def _fit_slots(self, budget: int | float, most: int) -> int:
        """The most slots (<= `most`) whose plan's peak fits `budget` bytes per device (a float in
        (0, 1]: that fraction of the device's memory): vLLM's gpu_memory_utilization, computed
        from the compiled steps' memory analysis instead of a profiling run."""
        if isinstance(budget, float):
            if not 0 < budget <= 1:
                raise InvalidRequestError(f"memory_budget as a fraction must lie in (0, 1], got {budget}",
                                          param="memory_budget")
            budget = int(budget * device_memory_bytes(self.lm_leaves[0]))
        slots = most
        for _ in range(3):     # temporaries shrink with the slot count: settle in a few rounds
            temp = self.step_temp_bytes(slots)
            one, two = self._plan_for(1, temp), self._plan_for(2, temp)
            per_slot = two["peak"] - one["peak"]
            fit = min(most, 1 + (budget - one["peak"]) // max(per_slot, 1))
            if fit < 1:
                raise InvalidRequestError(
                    f"memory budget {budget:,} bytes is too small: weights {one['weights_text'] + one['weights_vision']:,}"
                    f" + one sequence's KV cache {one['kv_cache']:,} + decode state and the largest step's temporaries "
                    f"{one['peak'] - one['weights_text'] - one['weights_vision'] - one['kv_cache']:,} = "
                    f"{one['peak']:,} bytes per device", param="memory_budget")
            if fit == slots:
                break
            slots = fit
        self._memory_plan = self._plan_for(slots, temp) if fit == slots else None
        return int(slots)

    def memory_report(self) -> dict:
        """The mesh and the bytes of weights and KV cache on each device (addressable shards;
        computed once: shapes and shardings never change)."""
        if self._memory is None:
            self._memory = self._measure_memory()
        out = dict(self._memory)
        if self._memory_plan is not None:
            out["memory_plan"] = dict(self._memory_plan)
        return out

    def _measure_memory(self) -> dict:
        split = self.weights.split
        w, kv = per_device_bytes(split.lm_leaves + split.vision_leaves), per_device_bytes(self.cache)
        return {"mesh": self.placement.describe(), "kv_cache_dtype": kv_quant.dtype_name(self.kv_cache_dtype),
                "weight_bytes_per_device": w, "kv_cache_bytes_per_device": kv,
                "weight_bytes_max_device": max(w.values(), default=0),
                "kv_cache_bytes_max_device": max(kv.values(), default=0)}

    def compiled_counts(self) -> dict[str, int]:
        """Distinct shapes compiled per step kind ("prefill_pruned" only once a FastV request ran,
        "prefill_scores" once a prompt_logprobs request or warmup did: FastV shapes are not part
        of warmup, they compile in the background, `ready`)."""
        return {k: len(v) for k, v in self.compiled.items()
                if v or k not in ("prefill_pruned", "copy_slot", "prefill_scores", "copy_state")}

    def max_compilations(self) -> dict[str, int]:
        """Upper bound on distinct compiled shapes per step kind (encode: the family's buckets)."""
        return {"encode": len(self.warmup_plan()),
                "prefill": len(self.buckets.prefill) * len(self.buckets.segments),
                "decode": len(self.buckets.decode) * len(self._decode_step_counts), "copy_slot": 1,
                "prefill_scores": len(self.score_buckets),
                **({"fill_cross": 1} if self.family.cross_attention else {}),
                **({"copy_state": 2} if "copy_state" in self.compiled else {})}
