"""Sampling parameters (host) and on-device sampling over a batch of slots, each with its own
temperature / top-k / top-p / min-p and PRNG key."""
from __future__ import annotations

from dataclasses import dataclass, field

import jax
import jax.numpy as jnp

from mmjax.errors import InvalidRequestError

MAX_TOP_LOGPROBS = 20  # the OpenAI API's limit; the decode step always computes this many


@dataclass
class SamplingParams:
    """Per-request sampling. temperature == 0 means greedy. `logprobs`: number of top
    alternatives to return per token (0 = only the chosen token's logprob, None = none)."""
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
        self.stop = [s for s in (self.stop or []) if s]
        checks = [
            (isinstance(self.max_tokens, int) and self.max_tokens >= 1, "max_tokens", "must be an integer >= 1"),
            (0.0 <= self.temperature <= 100.0, "temperature", "must be in [0, 100]"),
            (0.0 < self.top_p <= 1.0, "top_p", "must be in (0, 1]"),
            (isinstance(self.top_k, int) and self.top_k >= 0 or self.top_k == -1, "top_k", "must be >= 0 (0 or -1 = off)"),
            (0.0 <= self.min_p <= 1.0, "min_p", "must be in [0, 1]"),
            (self.logprobs is None or 0 <= self.logprobs <= MAX_TOP_LOGPROBS, "logprobs",
             f"must be in [0, {MAX_TOP_LOGPROBS}]"),
            (self.seed is None or isinstance(self.seed, int), "seed", "must be an integer"),
        ]
        for ok, name, msg in checks:
            if not ok:
                raise InvalidRequestError(f"{name} {msg} (got {getattr(self, name)!r})", param=name)
        if self.top_k == -1:
            self.top_k = 0


def sample(logits: jax.Array, keys: jax.Array, temperature: jax.Array, top_k: jax.Array,
           top_p: jax.Array, min_p: jax.Array):
    """logits [b, vocab] float32; keys [b, 2] uint32; per-row params [b].

    Returns (tokens [b] int32, chosen logprob [b], top logprobs [b, MAX_TOP_LOGPROBS] and their
    ids). Logprobs are of the raw model distribution (before temperature/filters), as in vLLM.
    """
    logprobs = jax.nn.log_softmax(logits, axis=-1)
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)

    def draw(_):
        vocab = logits.shape[-1]
        scaled = logits / jnp.maximum(temperature, 1e-6)[:, None]
        vals, idx = jax.lax.top_k(scaled, vocab)  # sorted descending
        probs = jax.nn.softmax(vals, axis=-1)
        rank = jnp.arange(vocab)[None, :]
        keep = rank < jnp.where(top_k > 0, top_k, vocab)[:, None]
        keep &= (jnp.cumsum(probs, axis=-1) - probs) < top_p[:, None]
        keep &= probs >= min_p[:, None] * probs[:, :1]
        vals = jnp.where(keep, vals, -jnp.inf)
        choice = jax.vmap(jax.random.categorical)(keys, vals)
        sampled = jnp.take_along_axis(idx, choice[:, None], axis=-1)[:, 0].astype(jnp.int32)
        return jnp.where(temperature > 0, sampled, greedy)

    # The full-vocab sort only runs when some row actually samples.
    tokens = jax.lax.cond(jnp.any(temperature > 0), draw, lambda _: greedy, None)
    chosen = jnp.take_along_axis(logprobs, tokens[:, None], axis=-1)[:, 0]
    top_vals, top_ids = jax.lax.top_k(logprobs, min(MAX_TOP_LOGPROBS, logits.shape[-1]))
    return tokens, chosen, top_vals, top_ids.astype(jnp.int32)
