"""The compiled steps of one model: `encode`, `prefill`, `decode` (DESIGN.md compilation contract).

Device state is a KV cache (`decoder.KVCache`) plus a per-slot decode state; both are donated to
every prefill/decode call so XLA updates them in place. Every shape comes from `Buckets`; the
shapes compiled so far are recorded in `compiled` (exposed by engine.stats() and /metrics).
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from mmjax.buckets import Buckets, bucket_for
from mmjax.models import decoder
from mmjax.sampling import sample

log = logging.getLogger("mmjax.runner")

# XLA CPU: keep the decode step's skinny [slots, in] @ [in, out] matmuls off YNNPACK library
# fusions (measured slower for M=8 than XLA's own dot), but give YNN the reductions: decode
# attention's broadcast-multiply-reduce over a K^T segment ran 2.2x faster there than in XLA's
# own reduction loop (benchmarks/README.md). Prefill/encode keep the default library fusions.
DECODE_COMPILER_OPTIONS = {"xla_cpu_experimental_ynn_fusion_type": "LIBRARY_FUSION_TYPE_REDUCE"}


def init_decode_state(num_slots: int) -> dict:
    """Per-slot decode state [slots]: the last sampled token, tokens in cache, M-RoPE offset,
    sampling parameters and PRNG key."""
    return {
        "tokens": jnp.zeros((num_slots,), jnp.int32),
        "lengths": jnp.zeros((num_slots,), jnp.int32),
        "rope_delta": jnp.zeros((num_slots,), jnp.int32),
        "temperature": jnp.zeros((num_slots,), jnp.float32),
        "top_k": jnp.zeros((num_slots,), jnp.int32),
        "top_p": jnp.ones((num_slots,), jnp.float32),
        "min_p": jnp.zeros((num_slots,), jnp.float32),
        "keys": jnp.zeros((num_slots, 2), jnp.uint32),
    }


@dataclass
class StepOutput:
    """Host copies of one step's sampling results, rows = slots (decode) or 1 (prefill)."""
    tokens: np.ndarray      # [rows] int32
    logprobs: np.ndarray    # [rows] float32, logprob of the chosen token
    top_logprobs: np.ndarray  # [rows, 20]
    top_ids: np.ndarray     # [rows, 20]


class ModelRunner:
    def __init__(self, family, params: dict, *, max_num_seqs: int, max_model_len: int,
                 prefill_chunk: int, max_encode_batch: int):
        self.family = family
        self.params = params
        self.text_cfg = family.text
        self.num_slots = max_num_seqs
        self.max_model_len = max_model_len
        self.buckets = Buckets.make(prefill_chunk=prefill_chunk, max_encode_batch=max_encode_batch,
                                    max_num_seqs=max_num_seqs)
        self.dtype = params["text"]["embed"].dtype
        self.cache = self.fresh_cache()
        self.state = init_decode_state(max_num_seqs)
        self.inv_freq = jnp.asarray(decoder.rope_inv_freq(self.text_cfg))
        self.mrope = self.text_cfg.rope.mrope_section is not None
        self.compiled: dict[str, set] = {"encode": set(), "prefill": set(), "decode": set()}
        self.compile_seconds = 0.0
        self.calls = {"encode": 0, "prefill": 0, "decode": 0}  # compiled-step invocations
        # wall seconds of each step kind until its outputs are ready, first-call compiles excluded
        self.step_seconds = {"encode": 0.0, "prefill": 0.0, "decode": 0.0}
        self._encode = jax.jit(family.encode)
        self._prefill = jax.jit(self._prefill_impl, donate_argnums=(1, 2))
        self._decode = jax.jit(self._decode_impl, static_argnames=("rows",), donate_argnums=(1, 2),
                               compiler_options=DECODE_COMPILER_OPTIONS if jax.default_backend() == "cpu" else None)

    def fresh_cache(self) -> decoder.KVCache:
        return decoder.init_kv_cache(self.text_cfg, self.num_slots, self.max_model_len, self.dtype)

    # ---- pure step bodies ------------------------------------------------------------------
    def _prefill_impl(self, params, cache, state, token_ids, image_embeds, image_mask, positions,
                      slot, start, n_valid, rope_delta, sampling, key):
        """One chunk of one sequence into cache row `slot`.

        token_ids [c] int32, image_embeds [c, hidden], image_mask [c] bool, positions [c] (or
        [3, c] for M-RoPE), slot/start/n_valid/rope_delta int32 scalars, sampling: (temperature,
        top_k, top_p, min_p) scalars, key [2] uint32. The first token is sampled from the logits of
        the chunk's last valid token and the slot's decode-state row is set up (the host only
        uses it after the final chunk).
        """
        text = params["text"]
        embeds = jnp.where(image_mask[:, None], image_embeds, decoder.embed_tokens(text, token_ids))
        pos = positions[:, None, :] if self.mrope else positions[None, :]
        hidden, cache = decoder.forward(text, self.text_cfg, embeds[None], pos, cache, start[None],
                                        start + token_ids.shape[0], slots=slot[None], inv_freq=self.inv_freq)
        logits = decoder.lm_logits(text, jax.lax.dynamic_index_in_dim(hidden[0], n_valid - 1, keepdims=True))
        key, sub = jax.random.split(key)
        temperature, top_k, top_p, min_p = sampling
        out = sample(logits, sub[None], temperature[None], top_k[None], top_p[None], min_p[None])
        row = {"tokens": out[0][0], "lengths": start + n_valid, "rope_delta": rope_delta,
               "temperature": temperature, "top_k": top_k, "top_p": top_p, "min_p": min_p, "keys": key}
        state = {k: state[k].at[slot].set(row[k]) for k in state}
        return cache, state, out

    def _decode_impl(self, params, cache, state, kv_len, *, rows):
        """One token for each of the first `rows` slots (static); the other slots' cache and
        state rows are untouched. Inactive slots below `rows` compute garbage in their own cache
        row only. kv_len (int32 scalar): cache positions the active rows use after the step."""
        text = params["text"]
        st = {k: v[:rows] for k, v in state.items()}
        embeds = decoder.embed_tokens(text, st["tokens"])[:, None]
        pos = (st["lengths"] + st["rope_delta"])[:, None]
        if self.mrope:
            pos = jnp.broadcast_to(pos[None], (3,) + pos.shape)
        hidden, cache = decoder.forward(text, self.text_cfg, embeds, pos, cache, st["lengths"], kv_len,
                                        inv_freq=self.inv_freq)
        logits = decoder.lm_logits(text, hidden[:, 0])
        split = jax.vmap(jax.random.split)(st["keys"])
        out = sample(logits, split[:, 1], st["temperature"], st["top_k"], st["top_p"], st["min_p"])
        st = dict(st, tokens=out[0], lengths=st["lengths"] + 1, keys=split[:, 0])
        state = {k: state[k].at[:rows].set(st[k]) for k in state}
        return cache, state, out

    # ---- host entry points -----------------------------------------------------------------
    def _track(self, kind: str, shape, fn, *args, **kw):
        """Run one compiled step and wait for it (its outputs are read on the host right after
        anyway); the time goes to compile_seconds on a shape's first call, else step_seconds."""
        self.calls[kind] += 1
        first = shape not in self.compiled[kind]
        t0 = time.perf_counter()
        result = jax.block_until_ready(fn(*args, **kw))
        dt = time.perf_counter() - t0
        if first:
            self.compile_seconds += dt
            self.compiled[kind].add(shape)
            log.info("compiled %s %s in %.2fs", kind, shape, dt)
        else:
            self.step_seconds[kind] += dt
        return result

    def encode(self, pixels: np.ndarray) -> np.ndarray:
        """pixels [n, ...] (one family-specific input per image) -> features [n, tokens, hidden].
        Pads n up to the encode bucket and splits into several calls above the largest bucket."""
        outs = []
        top = self.buckets.encode[-1]
        for i in range(0, len(pixels), top):
            part = pixels[i:i + top]
            b = bucket_for(len(part), self.buckets.encode)
            padded = np.concatenate([part, np.repeat(part[-1:], b - len(part), axis=0)]) if b > len(part) else part
            outs.append(self.encode_call((b,) + padded.shape[1:], padded)[: len(part)])
        return np.concatenate(outs)

    def encode_call(self, shape: tuple, *inputs) -> np.ndarray:
        """One compiled encode call on bucketed `inputs` (`shape` names its bucket) -> host
        features. Families with their own packing (Qwen2-VL) call this directly."""
        return np.asarray(self._track("encode", shape, self._encode, self.params, *inputs))

    def prefill(self, slot: int, start: int, token_ids: np.ndarray, image_embeds: np.ndarray | None,
                image_mask: np.ndarray, positions: np.ndarray, rope_delta: int, sampling: tuple,
                key: np.ndarray) -> StepOutput:
        """Prefill `len(token_ids)` (<= prefill_chunk) tokens of one sequence at cache index `start`."""
        n = len(token_ids)
        c = bucket_for(n, self.buckets.prefill)
        pad = c - n
        ids = np.pad(np.asarray(token_ids, np.int32), (0, pad))
        mask = np.pad(np.asarray(image_mask, bool), (0, pad))
        hidden = self.text_cfg.hidden_size
        emb = np.zeros((c, hidden), self.dtype) if image_embeds is None else \
            np.pad(np.asarray(image_embeds, self.dtype), ((0, pad), (0, 0)))
        pos = np.asarray(positions, np.int32)
        pos = np.pad(pos, ((0, 0), (0, pad)) if pos.ndim == 2 else (0, pad), mode="edge")
        t, k, p, m = sampling
        self.cache, self.state, out = self._track(
            "prefill", c, self._prefill, self.params, self.cache, self.state, ids, emb, mask, pos,
            np.int32(slot), np.int32(start), np.int32(n), np.int32(rope_delta),
            (np.float32(t), np.int32(k), np.float32(p), np.float32(m)), np.asarray(key, np.uint32))
        return StepOutput(*(np.asarray(x) for x in out))

    def decode(self, max_length: int, active_rows: int | None = None) -> StepOutput:
        """Advance the first `active_rows` slots (default: all; rounded up to the decode ladder)
        by one token; `max_length` = longest active sequence after the step. Outputs have one
        row per advanced slot."""
        rows = bucket_for(self.num_slots if active_rows is None else active_rows, self.buckets.decode)
        self.cache, self.state, out = self._track("decode", rows, self._decode, self.params, self.cache,
                                                  self.state, np.int32(max_length), rows=rows)
        return StepOutput(*(np.asarray(x) for x in out))

    def compiled_counts(self) -> dict[str, int]:
        return {k: len(v) for k, v in self.compiled.items()}


def prompt_logits_fn(text_cfg, inv_freq, mrope: bool):
    """A jittable (params, ids [t], image_embeds [t, d], image_mask [t], positions) -> logits
    [t, vocab] over a whole prompt, using a private one-slot cache (research / parity use)."""
    def fn(params, ids, image_embeds, image_mask, positions):
        text = params["text"]
        t = ids.shape[0]
        embeds = jnp.where(image_mask[:, None], image_embeds, decoder.embed_tokens(text, ids))
        cache = decoder.init_kv_cache(text_cfg, 1, t, text["embed"].dtype)
        pos = positions[:, None, :] if mrope else positions[None, :]
        hidden, _ = decoder.forward(text, text_cfg, embeds[None], pos, cache, jnp.zeros((1,), jnp.int32), t,
                                    inv_freq=inv_freq)
        return decoder.lm_logits(text, hidden[0])
    return fn
