"""Sampling parameters, defined once: the host dataclass every entry point builds (offline API,
server schema, CLI), its validation (the one set of ranges), the per-slot device copy of the
fields the compiled steps read (`SlotSampling`), and on-device sampling over a batch of slots.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, fields

import jax
import jax.numpy as jnp
import numpy as np

from mmjax.errors import InvalidRequestError

MAX_TOP_LOGPROBS = 20  # the OpenAI API's limit; the decode step always computes this many
INT32_MAX = 2**31 - 1
MAX_STOP_STRINGS = 16
MAX_STOP_TOKEN_IDS = 1024   # checked per generated token: bounded so no request slows every step


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


@dataclass
class SlotSampling:
    """The sampling fields the compiled steps read, one entry per slot (a pytree). Built from
    SamplingParams by `from_params`; the only place those fields are listed for the device."""
    temperature: jax.Array   # [slots] float32
    top_k: jax.Array         # [slots] int32 (0 = off)
    top_p: jax.Array         # [slots] float32
    min_p: jax.Array         # [slots] float32

    @classmethod
    def zeros(cls, n: int) -> "SlotSampling":
        return cls(jnp.zeros((n,), jnp.float32), jnp.zeros((n,), jnp.int32), jnp.ones((n,), jnp.float32),
                   jnp.zeros((n,), jnp.float32))

    @classmethod
    def from_params(cls, sp: SamplingParams) -> "SlotSampling":
        """One slot's host scalars (numpy) from validated SamplingParams."""
        return cls(np.float32(sp.temperature), np.int32(sp.top_k), np.float32(sp.top_p), np.float32(sp.min_p))


jax.tree_util.register_dataclass(SlotSampling, data_fields=[f.name for f in fields(SlotSampling)], meta_fields=[])


def sample(logits: jax.Array, keys: jax.Array, sp: SlotSampling):
    """logits [b, vocab] float32; keys [b, 2] uint32; sp: per-row params [b].

    Returns (tokens [b] int32, chosen logprob [b], top logprobs [b, MAX_TOP_LOGPROBS] and their
    ids). Logprobs are of the raw model distribution (before temperature/filters), as in vLLM.
    """
    logprobs = jax.nn.log_softmax(logits, axis=-1)
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    temperature = sp.temperature

    def draw(_):
        vocab = logits.shape[-1]
        scaled = logits / jnp.maximum(temperature, 1e-6)[:, None]
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
    tokens = jax.lax.cond(jnp.any(temperature > 0), draw, lambda _: greedy, None)
    chosen = jnp.take_along_axis(logprobs, tokens[:, None], axis=-1)[:, 0]
    top_vals, top_ids = jax.lax.top_k(logprobs, min(MAX_TOP_LOGPROBS, logits.shape[-1]))
    return tokens, chosen, top_vals, top_ids.astype(jnp.int32)
