"""The compiled steps' pure functions and the device pytrees they take (DESIGN.md compilation
contract): the prefill (packed chunks, optional riders, optional prompt scores), the FastV
pruned prefill, the decode step, and the whole-prompt forwards research and embeddings use.

Nothing here touches the host: `ModelRunner` (runner.py) jits these builders once per model
version with the shardings of its placement, and batching.py packs the host arrays they take.
Each builder gets `lm_of(lm_leaves)`, which merges the decoder from its flat weight leaves inside
the trace.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, fields
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from mmjax import packed_weights
from mmjax.backend import Tuning
from mmjax.models.family import Family
from mmjax.models.nn.capture import Capture, captured
from mmjax.models.nn.metadata import AttentionMetadata, Dropped, Prune
from mmjax.models.nn.packing import NO_INDEX, DecodeRows, Packing
from mmjax.serving.sampling import MAX_TOP_LOGPROBS, SlotHistory, SlotSampling, VocabRow, sample


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
        among them) makes XLA copy them, twice, every step."""
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
    models/nn/packing.DecodeRows): ride [D] bool, slot j's next token rides; offset (int32
    scalar), the row position of the first rider, the others after it in slot order. D is
    static: 0 (no mixed steps: the graph is the plain prefill) or the slot count."""
    ride: jax.Array
    offset: jax.Array


jax.tree_util.register_dataclass(Riders, data_fields=["ride", "offset"], meta_fields=[])


class PrefillOut(NamedTuple):
    """What a prefill step returns: the cache and decode state (donated in, updated), the sample
    outputs (tokens, logprobs, top_logprobs, top_ids) [rows, ...], and for the scores step
    `prompt_scores` of every chunk position (else None)."""
    cache: Any
    state: DecodeState
    outputs: tuple
    scores: tuple | None = None


def _lm_head(lm, hidden: jax.Array, logits_sharding) -> jax.Array:
    """The LM head on the FMAs, as the decode step's (a prefill's head rows are decode rows):
    hidden [rows, hidden] -> logits [rows, vocab]."""
    with packed_weights.fma_only():
        return _gathered(lm.logits(hidden), logits_sharding)


def _rider_inputs(state: DecodeState, riders: Riders, token_ids, adapters, positions):
    """The riders' tokens, LoRA adapter slots and positions written into the row's padding, from
    the decode state (each rider's last sampled token at its next position) -> (the decode
    state's first D rows, the riders' DecodeRows, token_ids, adapters, positions)."""
    t, d = token_ids.shape[0], riders.ride.shape[0]
    st = state.head(d)
    ride = DecodeRows(jnp.where(riders.ride, st.lengths, NO_INDEX),
                      jnp.where(riders.ride, riders.offset + jnp.cumsum(riders.ride) - 1, t))
    token_ids = token_ids.at[ride.position].set(st.tokens, mode="drop")
    adapters = adapters.at[ride.position].set(st.adapter, mode="drop")
    positions = positions.at[:, ride.position].set(
        jnp.broadcast_to(st.lengths + st.rope_delta, (positions.shape[0], d)), mode="drop")
    return st, ride, token_ids, adapters, positions


def _with_riders(head, hidden, last, st: DecodeState, ride: DecodeRows, riders: Riders, state: DecodeState,
                 bit_words: int):
    """The segments' logits [S, vocab] and the riders' sampling and state, as a decode step's
    (make_decode_step): one LM head call for the segments' last tokens and the riders, skipped for
    the riders when none rides -> (logits, the riders' sample outputs [D], state)."""
    t, s, d = hidden.shape[1], last.shape[0], riders.ride.shape[0]
    row_split = jax.vmap(jax.random.split)(st.keys)

    def riding():
        rows = jnp.concatenate([last, jnp.clip(ride.position, 0, t - 1)])
        both = head(hidden[0][rows])
        return both[:s], sample(both[s:], row_split[:, 1], st.sampling, st.hist,
                                jnp.full((d, bit_words), 0xFFFFFFFF, jnp.uint32))

    def idle():         # none rides: the LM head and sampling of D rows skipped
        shapes = jax.eval_shape(riding)[1]
        return head(hidden[0][last]), jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), shapes)
    logits, row_res = jax.lax.cond(riders.ride.any(), riding, idle)
    state = state.advance_slots(jnp.where(riders.ride, jnp.arange(d), state.tokens.shape[0]), row_res[0],
                                row_split[:, 0])
    return logits, row_res, state


def _first_tokens(lm, seg: Segments, state: DecodeState, logits: jax.Array):
    """Each segment's first token sampled from its last valid token's logits [S, vocab], and its
    slot's decode-state row set up -> (sample outputs [S], state)."""
    s = logits.shape[0]
    split = jax.vmap(jax.random.split)(seg.keys)
    hist = SlotHistory(seg.vrow, jnp.zeros((s, logits.shape[-1]), jnp.int32), jnp.zeros((s,), jnp.int32))
    res = sample(logits, split[:, 1], seg.sampling, hist, seg.bits)
    rows = DecodeState(res[0], seg.start + seg.n_valid, seg.rope_delta, split[:, 0], seg.sampling,
                       jnp.full((s,), lm.num_layers, jnp.int32), jnp.zeros((s,), jnp.int32), hist.after(res[0]),
                       jnp.take(state.pages, seg.slot, axis=0, mode="clip"), seg.adapter)
    return res, state.set_slots(seg.slot, rows)


def make_prefill_step(family: Family, tune: Tuning, lm_of, logits_sharding=None, scores: bool = False):
    """(lm_leaves, cache, state, token_ids [T], image_embeds [T, width] (width: the decoder's
    `feature_width`, hidden or more with per-layer image features), image_mask [T], positions
    [rows, T], spans [T] int32, token_seg [T] int32, seg: Segments of S rows, riders) ->
    PrefillOut(cache, state, sample outputs [S]). `lm_of(lm_leaves)` is the decoder (`nnx.merge`
    of the runner's split, inside the trace).

    The chunks of S sequences packed back to back in one row of T tokens (S = 1: one chunk, the
    plain one-sequence prefill), each into its own cache row (nn/packing.py: one GEMM per weight
    over all T tokens; attention in query blocks of one sequence each). Each sequence's first
    token is sampled from the logits of its chunk's last valid token and its slot's decode-state
    row is set up (the host only uses it after the final chunk). spans: image-token run ids of
    each chunk (-1 elsewhere), used by families with bidirectional image attention; token_seg:
    each token's segment (padding: the last used one).

    scores=True (prompt_logprobs; S = 1 only): one more argument, next_ids [T] int32 (each
    position's next prompt token), and PrefillOut.scores, `prompt_scores` of the logits of every
    chunk position (the forward computed their hidden states anyway: the LM head runs over T
    rows, not 1).

    riders: Riders of D rows (D static; D > 0: decoders with `supports_riders`, S > 1): the
    decode step of those slots rides in the call, each slot's token from the decode state taking
    a padding position of the row (unconstrained, one step). The outputs are then D rider rows
    (as `make_decode_step`'s rows) followed by the S segments' rows, and the riders' decode
    state advances as a decode step advances it."""

    def prefill(lm_leaves, cache, state, token_ids, image_embeds, image_mask, positions, spans, token_seg, seg,
                riders, next_ids=None) -> PrefillOut:
        lm = lm_of(lm_leaves)
        t, s, d = token_ids.shape[0], seg.slot.shape[0], riders.ride.shape[0]
        ride = None
        adapters = seg.adapter[token_seg]       # each token's LoRA adapter slot
        if d:           # the riders' tokens, positions and cache indexes, from the decode state
            st, ride, token_ids, adapters, positions = _rider_inputs(state, riders, token_ids, adapters, positions)
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
        head = lambda h: _lm_head(lm, h, logits_sharding)      # noqa: E731
        if scores:
            every = head(hidden[0])                 # [T, vocab]
            res, state = _first_tokens(lm, seg, state, every[last])
            return PrefillOut(cache, state, res, prompt_scores(every, next_ids))
        if not d:
            res, state = _first_tokens(lm, seg, state, head(hidden[0][last]))      # [S, vocab] logits
            return PrefillOut(cache, state, res)
        logits, row_res, state = _with_riders(head, hidden, last, st, ride, riders, state, seg.bits.shape[1])
        res, state = _first_tokens(lm, seg, state, logits)
        return PrefillOut(cache, state, tuple(jnp.concatenate([a, b]) for a, b in zip(row_res, res)))
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


