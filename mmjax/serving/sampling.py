"""Sampling parameters, defined once: the host dataclass every entry point builds (offline API,
server schema, CLI), its validation (the one set of ranges), the per-slot device copy of the
fields the compiled steps read (`SlotSampling`), and on-device sampling over a batch of slots.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field, fields
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from mmjax.backend import current_platform
from mmjax.errors import InvalidRequestError

MAX_TOP_LOGPROBS = 20  # the OpenAI API's limit; a step computes this many when any of its rows asks
INT32_MAX = 2**31 - 1
MAX_STOP_STRINGS = 16
MAX_STOP_TOKEN_IDS = 1024   # checked per generated token: bounded so no request slows every step
MAX_LOGIT_BIAS = 1024       # logit_bias entries per request
MAX_BAD_WORDS = 256
MAX_N = 16                  # choices per request (each takes a decode slot)
MAX_ALLOWED_TOKEN_IDS = 2**20


def _is_int(v) -> bool:
    return isinstance(v, (int, np.integer)) and not isinstance(v, bool)


def _is_num(v) -> bool:
    return isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, bool) and math.isfinite(v)


@dataclass
class SamplingParams:
    """Per-request sampling. temperature == 0 means greedy. `logprobs`: number of top
    alternatives to return per token (0 = only the chosen token's logprob, None = none).
    Invalid values raise InvalidRequestError naming the field (the server's 400)."""
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    logprobs: int | None = None
    ignore_eos: bool = False
    # vLLM's definitions: presence/frequency over generated tokens; repetition over prompt +
    # generated (logit / p if positive else logit * p)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None   # token id -> added to its logit ([-100, 100])
    min_tokens: int = 0                          # EOS / stop ids / stop strings suppressed until then
    allowed_token_ids: list[int] | None = None   # sample only among these
    bad_words: list[str] | None = None           # never generate these words (as vLLM: each word's
    #                                              token sequence, with and without a leading space)
    structured: Any = None                       # a structured-output spec (serving.structured)
    n: int = 1                                   # choices sampled from one prompt (its KV shared)
    skip_special_tokens: bool = True             # False: special tokens generated stay in the text
    prompt_logprobs: int | None = None           # the prompt's own logprobs (+ top-k), from the prefill's
    #                                              logits (no prefix-cache reuse for such a request)

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.stop is not None and not (isinstance(self.stop, (list, tuple))
                                          and all(isinstance(s, str) for s in self.stop)):
            raise InvalidRequestError("stop must be a string or a list of strings", param="stop")
        self.stop = [s for s in (self.stop or []) if s]
        checks = [
            (_is_int(self.max_tokens) and 1 <= self.max_tokens <= INT32_MAX, "max_tokens",
             f"must be an integer in [1, {INT32_MAX}]"),
            (_is_num(self.temperature) and 0.0 <= self.temperature <= 2.0, "temperature", "must be in [0, 2]"),
            (_is_num(self.top_p) and 0.0 < self.top_p <= 1.0, "top_p", "must be in (0, 1]"),
            (_is_int(self.top_k) and -1 <= self.top_k <= INT32_MAX, "top_k",
             f"must be an integer in [-1, {INT32_MAX}] (0 or -1 = off)"),
            (_is_num(self.min_p) and 0.0 <= self.min_p <= 1.0, "min_p", "must be in [0, 1]"),
            (self.logprobs is None or _is_int(self.logprobs) and 0 <= self.logprobs <= MAX_TOP_LOGPROBS,
             "logprobs", f"must be an integer in [0, {MAX_TOP_LOGPROBS}]"),
            (self.seed is None or _is_int(self.seed) and -(2**63) <= self.seed < 2**64, "seed",
             "must be a 64-bit integer"),
            (isinstance(self.stop_token_ids, (list, tuple, set, frozenset))
             and len(self.stop_token_ids) <= MAX_STOP_TOKEN_IDS
             and all(_is_int(t) and 0 <= t <= INT32_MAX for t in self.stop_token_ids),
             "stop_token_ids", f"must be a list of at most {MAX_STOP_TOKEN_IDS} non-negative integers"),
            (isinstance(self.ignore_eos, bool), "ignore_eos", "must be a boolean"),
            (isinstance(self.skip_special_tokens, bool), "skip_special_tokens", "must be a boolean"),
            (self.prompt_logprobs is None or _is_int(self.prompt_logprobs)
             and 0 <= self.prompt_logprobs <= MAX_TOP_LOGPROBS, "prompt_logprobs",
             f"must be an integer in [0, {MAX_TOP_LOGPROBS}]"),
            (_is_num(self.presence_penalty) and -2.0 <= self.presence_penalty <= 2.0, "presence_penalty",
             "must be in [-2, 2]"),
            (_is_num(self.frequency_penalty) and -2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty",
             "must be in [-2, 2]"),
            (_is_num(self.repetition_penalty) and 0.0 < self.repetition_penalty <= 2.0, "repetition_penalty",
             "must be in (0, 2]"),
            (_is_int(self.n) and 1 <= self.n <= MAX_N, "n", f"must be an integer in [1, {MAX_N}]"),
            (_is_int(self.min_tokens) and 0 <= self.min_tokens <= INT32_MAX, "min_tokens",
             f"must be an integer in [0, {INT32_MAX}]"),
            (self.bad_words is None or isinstance(self.bad_words, (list, tuple))
             and len(self.bad_words) <= MAX_BAD_WORDS and all(isinstance(w, str) and 0 < len(w) <= 256
                                                            for w in self.bad_words),
             "bad_words", f"must be a list of at most {MAX_BAD_WORDS} non-empty strings of at most 256 characters"),
            (self.allowed_token_ids is None or isinstance(self.allowed_token_ids, (list, tuple))
             and 0 < len(self.allowed_token_ids) <= MAX_ALLOWED_TOKEN_IDS
             and all(_is_int(t) and 0 <= t <= INT32_MAX for t in self.allowed_token_ids),
             "allowed_token_ids", "must be a non-empty list of non-negative integers"),
            (len(self.stop) <= MAX_STOP_STRINGS and all(len(s) <= 256 for s in self.stop), "stop",
             f"may hold at most {MAX_STOP_STRINGS} strings of at most 256 characters"),
        ]
        for ok, name, msg in checks:
            if not ok:
                raise InvalidRequestError(f"{name} {msg} (got {getattr(self, name)!r})", param=name)
        if self.top_k == -1:
            self.top_k = 0
        self.stop_token_ids = [int(t) for t in self.stop_token_ids]
        self.stop_token_set = frozenset(self.stop_token_ids)
        self.logit_bias = _logit_bias(self.logit_bias)

    @property
    def needs_vocab_row(self) -> bool:
        """Does this request change logits beyond temperature/top-k/top-p/min-p?"""
        return bool(self.logit_bias or self.allowed_token_ids or self.bad_words or self.min_tokens
                    or self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)


def _logit_bias(v) -> dict[int, float] | None:
    """{token id (int or its decimal string, as JSON sends it): bias in [-100, 100]}."""
    if v is None:
        return None
    if not isinstance(v, dict) or len(v) > MAX_LOGIT_BIAS:
        raise InvalidRequestError(f"logit_bias must be an object of at most {MAX_LOGIT_BIAS} token id -> bias "
                                  "entries", param="logit_bias")
    out = {}
    for k, b in v.items():
        try:
            t = int(k) if isinstance(k, str) else k
        except ValueError:
            t = None
        if not (_is_int(t) and 0 <= t <= INT32_MAX):
            raise InvalidRequestError(f"logit_bias key {k!r} is not a token id", param="logit_bias")
        if not (_is_num(b) and -100 <= b <= 100):
            raise InvalidRequestError(f"logit_bias[{k!r}] must be a number in [-100, 100], got {b!r}",
                                      param="logit_bias")
        out[int(t)] = float(b)
    return out


@dataclass
class SlotSampling:
    """The sampling scalars the compiled steps read, one entry per slot (a pytree). Built from
    SamplingParams by `from_params`; the only place those fields are listed for the device."""
    temperature: jax.Array   # [slots] float32
    top_k: jax.Array         # [slots] int32 (0 = off)
    top_p: jax.Array         # [slots] float32
    min_p: jax.Array         # [slots] float32
    presence: jax.Array      # [slots] float32
    frequency: jax.Array     # [slots] float32
    repetition: jax.Array    # [slots] float32 (1 = off)
    min_tokens: jax.Array    # [slots] int32
    logprobs: jax.Array      # [slots] int32 (top alternatives asked for; -1: no logprobs)
    plain: jax.Array         # [slots] bool: no mask, bias, limit or penalty (process_logits is the identity)

    @classmethod
    def zeros(cls, n: int) -> "SlotSampling":
        f = lambda v: jnp.full((n,), v, jnp.float32)  # noqa: E731
        return cls(f(0.0), jnp.zeros((n,), jnp.int32), f(1.0), f(0.0), f(0.0), f(0.0), f(1.0),
                   jnp.zeros((n,), jnp.int32), jnp.full((n,), -1, jnp.int32), jnp.ones((n,), bool))

    @classmethod
    def from_params(cls, sp: SamplingParams) -> "SlotSampling":
        """One slot's host scalars (numpy) from validated SamplingParams."""
        f = np.float32
        return cls(f(sp.temperature), np.int32(sp.top_k), f(sp.top_p), f(sp.min_p), f(sp.presence_penalty),
                   f(sp.frequency_penalty), f(sp.repetition_penalty), np.int32(min(sp.min_tokens, INT32_MAX)),
                   np.int32(-1 if sp.logprobs is None else sp.logprobs),
                   np.bool_(not (sp.needs_vocab_row or sp.structured is not None)))


jax.tree_util.register_dataclass(SlotSampling, data_fields=[f.name for f in fields(SlotSampling)], meta_fields=[])


@dataclass
class VocabRow:
    """A slot's vocab-sized sampling inputs, set once per request (at prefill): `bias` [.., vocab]
    float32 (logit_bias, and -inf for tokens outside allowed_token_ids and for one-token bad
    words), `prompt` [.., vocab] bool (tokens in the prompt: repetition penalty), `stops`
    [.., vocab] bool (tokens suppressed until min_tokens: EOS unless ignore_eos, stop_token_ids)."""
    bias: jax.Array
    prompt: jax.Array
    stops: jax.Array


jax.tree_util.register_dataclass(VocabRow, data_fields=["bias", "prompt", "stops"], meta_fields=[])


@dataclass
class SlotHistory:
    """Per-slot state the penalties read: `row` (VocabRow [slots, vocab]), `counts` [slots,
    vocab] int32 (how often each token was generated) and `generated` [slots] int32 (tokens
    generated so far)."""
    row: VocabRow
    counts: jax.Array
    generated: jax.Array

    @classmethod
    def zeros(cls, n: int, vocab: int) -> "SlotHistory":
        return cls(VocabRow(jnp.zeros((n, vocab), jnp.float32), jnp.zeros((n, vocab), bool),
                            jnp.zeros((n, vocab), bool)),
                   jnp.zeros((n, vocab), jnp.int32), jnp.zeros((n,), jnp.int32))

    def after(self, tokens: jax.Array) -> "SlotHistory":
        """The history once the first len(tokens) slots generated `tokens` [rows]."""
        n = tokens.shape[0]
        # a scatter of one count per row: no [rows, vocab] one-hot temporary per step
        return dataclasses.replace(self, counts=self.counts.at[jnp.arange(n), tokens].add(1),
                                   generated=self.generated.at[:n].add(1))

    def after_slots(self, slots: jax.Array, tokens: jax.Array) -> "SlotHistory":
        """The history once slots [n] generated `tokens` [n] (a slot past the end: dropped)."""
        return dataclasses.replace(self, counts=self.counts.at[slots, tokens].add(1, mode="drop"),
                                   generated=self.generated.at[slots].add(1, mode="drop"))


jax.tree_util.register_dataclass(SlotHistory, data_fields=["row", "counts", "generated"], meta_fields=[])


def vocab_row(sp: SamplingParams, vocab: int, prompt_ids: np.ndarray, eos_ids, bad_single: list[int] = ()
              ) -> VocabRow:
    """Host VocabRow (numpy, [vocab]) of one request; token ids are checked against `vocab`
    before this (Engine.make_request)."""
    bias = np.zeros(vocab, np.float32)
    if sp.allowed_token_ids:
        bias[:] = -np.inf
        bias[np.asarray(sp.allowed_token_ids, np.int64)] = 0.0
    if sp.logit_bias:
        ids = np.fromiter(sp.logit_bias.keys(), np.int64)
        bias[ids] += np.fromiter(sp.logit_bias.values(), np.float32)
    if len(bad_single):
        bias[np.asarray(bad_single, np.int64)] = -np.inf
    prompt = np.zeros(vocab, bool)
    if sp.repetition_penalty != 1.0:
        prompt[np.asarray(prompt_ids, np.int64)] = True
    stops = np.zeros(vocab, bool)
    if sp.min_tokens:
        stop_ids = set(sp.stop_token_ids) | (set() if sp.ignore_eos else set(eos_ids))
        stops[np.asarray(sorted(t for t in stop_ids if t < vocab), np.int64)] = True
    return VocabRow(bias, prompt, stops)


def unpack_bits(bits: jax.Array, vocab: int) -> jax.Array:
    """Token bitmask [b, ceil(vocab / 32)] (uint32; bit i of word j = token 32 j + i, the
    llguidance layout) -> allowed [b, vocab] bool."""
    shifts = jnp.arange(32, dtype=jnp.uint32)
    allowed = (bits[:, :, None] >> shifts) & jnp.uint32(1)
    return allowed.reshape(bits.shape[0], -1)[:, :vocab].astype(bool)


def process_logits(logits: jax.Array, sp: SlotSampling, hist: SlotHistory, bits: jax.Array) -> jax.Array:
    """The logits sampling chooses from, in vLLM's order: token masks (bitmask `bits` [b, words]
    from a grammar or multi-token bad words, allowed_token_ids, one-token bad words), min_tokens,
    logit_bias, then the penalties (repetition over prompt + generated tokens, frequency and
    presence over generated tokens). logits [b, vocab] float32; hist rows [b]."""
    vocab = logits.shape[-1]
    row = hist.row
    x = jnp.where(unpack_bits(bits, vocab), logits, -jnp.inf)
    x = jnp.where(row.stops & (hist.generated < sp.min_tokens)[:, None], -jnp.inf, x)
    x = x + row.bias
    seen = hist.counts > 0
    rep = jnp.where(row.prompt | seen, sp.repetition[:, None], 1.0)
    x = jnp.where(x > 0, x / rep, x * rep)
    x = x - sp.frequency[:, None] * hist.counts.astype(jnp.float32)
    return x - sp.presence[:, None] * seen.astype(jnp.float32)


def sample(logits: jax.Array, keys: jax.Array, sp: SlotSampling, hist: SlotHistory | None = None,
           bits: jax.Array | None = None):
    """logits [b, vocab] float32; keys [b, 2] uint32; sp: per-row params [b]; hist (rows [b])
    and bits [b, words]: see process_logits (None: no penalties, no masks).

    Returns (tokens [b] int32, chosen logprob [b], top logprobs [b, MAX_TOP_LOGPROBS] and their
    ids). Logprobs are of the raw model distribution (before penalties, masks, temperature and
    filters), as vLLM's default; they are computed only when some row asks for them (zeros
    otherwise: the log-softmax and top-k over the vocab are a visible share of a CPU decode step)."""
    raw = logits
    temperature = sp.temperature

    def pick(x):
        """Tokens from the logits x the rules have been applied to."""
        greedy = greedy_ids(x)

        def draw(_):
            vocab = x.shape[-1]
            scaled = x / jnp.maximum(temperature, 1e-6)[:, None]
            vals, idx = jax.lax.top_k(scaled, vocab)  # sorted descending
            probs = jax.nn.softmax(vals, axis=-1)
            rank = jnp.arange(vocab)[None, :]
            keep = rank < jnp.where(sp.top_k > 0, sp.top_k, vocab)[:, None]
            keep &= (jnp.cumsum(probs, axis=-1) - probs) < sp.top_p[:, None]
            keep &= probs >= sp.min_p[:, None] * probs[:, :1]
            vals = jnp.where(keep, vals, -jnp.inf)
            choice = jax.vmap(jax.random.categorical)(keys, vals)
            sampled = jnp.take_along_axis(idx, choice[:, None], axis=-1)[:, 0].astype(jnp.int32)
            return jnp.where(temperature > 0, sampled, greedy)

        # The full-vocab sort only runs when some row actually samples.
        return jax.lax.cond(jnp.any(temperature > 0), draw, lambda _: greedy, None)

    # On the CPU the rules' pass is skipped when no row has a rule (a plain row's VocabRow is
    # zeros and its bits all ones): it reads ~4 vocab-sized arrays a row; the cond returns tokens only (a [b, vocab] result would be one more copy of
    # the logits). Elsewhere the fused pass is cheap and a cond is a host sync: always applied.
    if hist is None:
        tokens = pick(logits)
    elif current_platform() == "cpu":
        tokens = jax.lax.cond(jnp.all(sp.plain), lambda: pick(logits),
                              lambda: pick(process_logits(logits, sp, hist, bits)))
    else:
        tokens = pick(process_logits(logits, sp, hist, bits))
    k = min(MAX_TOP_LOGPROBS, logits.shape[-1])

    def scores(_):
        logprobs = jax.nn.log_softmax(raw, axis=-1)
        chosen = jnp.take_along_axis(logprobs, tokens[:, None], axis=-1)[:, 0]
        top_vals, top_ids = jax.lax.top_k(logprobs, k)
        return chosen, top_vals, top_ids.astype(jnp.int32)

    def none(_):
        b = logits.shape[0]
        return jnp.zeros((b,), jnp.float32), jnp.zeros((b, k), jnp.float32), jnp.zeros((b, k), jnp.int32)

    chosen, top_vals, top_ids = jax.lax.cond(jnp.any(sp.logprobs >= 0), scores, none, None)
    return tokens, chosen, top_vals, top_ids


def greedy_ids(logits: jax.Array, block: int = 128) -> jax.Array:
    """jnp.argmax(logits, -1) as int32 (the first maximum; the first NaN where a row has one)
    for logits [b, vocab], over blocks of `block` logits: each block's max and whether it holds
    a NaN, the first block holding the row's max (or its first NaN), then the first match inside
    that block, each "first" an index min. XLA:CPU runs argmax's (value, index) pair reduction
    unvectorized, and the whole row's max, compare and index min cost two more passes over
    [b, vocab]; blocked, the row is read about once. (NaNs are found with isnan: XLA:CPU's vectorized max reductions may drop them.)"""
    b, vocab = logits.shape
    nb = -(-vocab // block)
    x = jnp.pad(logits, ((0, 0), (0, nb * block - vocab)), constant_values=-jnp.inf).reshape(b, nb, block)
    block_nan = jnp.any(jnp.isnan(x), axis=-1)                                       # [b, nb]
    block_max = jnp.where(block_nan, -jnp.inf, jnp.max(x, axis=-1))
    row_nan = jnp.any(block_nan, axis=-1, keepdims=True)                             # [b, 1]
    top = jnp.max(block_max, axis=-1, keepdims=True)                                 # [b, 1]

    def first(hit):         # the first True along the last axis (its length where none)
        index = jax.lax.broadcasted_iota(jnp.int32, hit.shape, hit.ndim - 1)
        return jnp.min(jnp.where(hit, index, hit.shape[-1]), axis=-1)
    at = first(jnp.where(row_nan, block_nan, block_max == top))                     # [b]
    row = jnp.take_along_axis(x, at[:, None, None], axis=1)[:, 0]                    # [b, block]
    return at * block + first(jnp.where(row_nan, jnp.isnan(row), row == top))
