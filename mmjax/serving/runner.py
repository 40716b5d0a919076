"""The compiled steps of one model: `encode`, `prefill`, `decode` (DESIGN.md compilation contract).

The runner drives; the family and its text model provide pure functions. Device state is the
text model's KV cache plus a `DecodeState` pytree (one row per slot); both are donated to every
prefill/decode call so XLA updates them in place. Every shape comes from `Buckets` (the family's
encode plan for encode); the shapes compiled so far are recorded in `compiled` (engine.stats(),
/metrics). Where arrays live comes from the placement seam (mmjax.sharding); backend-specific
tuning from mmjax.backend.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, fields

import jax
import jax.numpy as jnp
import numpy as np

from mmjax.backend import Tuning, compiling_for, tuning
from mmjax.buckets import Buckets, bucket_for
from mmjax.models.family import EncodeCall, Family
from mmjax.models.text import Capture
from mmjax.serving.sampling import SamplingParams, SlotSampling, sample
from jax.sharding import NamedSharding, PartitionSpec

from mmjax.sharding import MODEL, Placement, per_device_bytes, step_shardings

log = logging.getLogger("mmjax.runner")


@dataclass
class DecodeState:
    """Per-slot decode state [slots]: the last sampled token, tokens in cache, the RoPE offset
    (decode position = cache index + rope_delta), sampling parameters and PRNG key [slots, 2]."""
    tokens: jax.Array
    lengths: jax.Array
    rope_delta: jax.Array
    keys: jax.Array
    sampling: SlotSampling

    @classmethod
    def zeros(cls, num_slots: int) -> "DecodeState":
        return cls(jnp.zeros((num_slots,), jnp.int32), jnp.zeros((num_slots,), jnp.int32),
                   jnp.zeros((num_slots,), jnp.int32), jnp.zeros((num_slots, 2), jnp.uint32),
                   SlotSampling.zeros(num_slots))

    def head(self, rows: int) -> "DecodeState":
        """The first `rows` slots."""
        return jax.tree.map(lambda x: x[:rows], self)

    def set_head(self, rows: int, new: "DecodeState") -> "DecodeState":
        return jax.tree.map(lambda x, y: x.at[:rows].set(y), self, new)

    def set_slot(self, slot: jax.Array, row: "DecodeState") -> "DecodeState":
        return jax.tree.map(lambda x, y: x.at[slot].set(y), self, row)


jax.tree_util.register_dataclass(DecodeState, data_fields=[f.name for f in fields(DecodeState)], meta_fields=[])


@dataclass
class StepOutput:
    """Host copies of one step's sampling results, rows = slots (decode) or 1 (prefill)."""
    tokens: np.ndarray      # [rows] int32
    logprobs: np.ndarray    # [rows] float32, logprob of the chosen token
    top_logprobs: np.ndarray  # [rows, 20]
    top_ids: np.ndarray     # [rows, 20]


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


def make_prefill_step(family: Family, tune: Tuning, tm=None, logits_sharding=None):
    """(params, cache, state, token_ids [c], image_embeds [c, hidden], image_mask [c], positions
    [rows, c], slot, start, n_valid, rope_delta (int32 scalars), sampling (SlotSampling of
    scalars), key [2] uint32) -> (cache, state, sample outputs).

    One chunk of one sequence into cache row `slot`. The first token is sampled from the logits
    of the chunk's last valid token and the slot's decode-state row is set up (the host only uses
    it after the final chunk). `tm`: the text model as placed (default: the family's)."""
    tm = tm or family.text_model

    def prefill(params, cache, state, token_ids, image_embeds, image_mask, positions, slot, start, n_valid,
                rope_delta, sampling, key):
        text = params["text"]
        embeds = jnp.where(image_mask[:, None], image_embeds, tm.embed(text, token_ids))
        out = tm.forward(text, embeds[None], positions[:, None, :], cache, start[None],
                         start + token_ids.shape[0], slots=slot[None], reduce_small=tune.reduce_small_attention)
        logits = _gathered(tm.logits(text, jax.lax.dynamic_index_in_dim(out.hidden[0], n_valid - 1, keepdims=True)),
                           logits_sharding)
        key, sub = jax.random.split(key)
        one = jax.tree.map(lambda x: x[None], sampling)
        res = sample(logits, sub[None], one)
        row = DecodeState(res[0][0], start + n_valid, rope_delta, key, sampling)
        return out.cache, state.set_slot(slot, row), res
    return prefill


def make_decode_step(family: Family, tune: Tuning, tm=None, logits_sharding=None):
    """(params, cache, state, kv_len, *, rows) -> (cache, state, sample outputs): one token for
    each of the first `rows` slots (static); the other slots' cache and state rows are
    untouched. Inactive slots below `rows` compute garbage in their own cache row only. kv_len
    (int32 scalar): cache positions the active rows use after the step. `tm` as in prefill."""
    tm = tm or family.text_model

    def decode(params, cache, state, kv_len, *, rows):
        text = params["text"]
        st = state.head(rows)
        embeds = tm.embed(text, st.tokens)[:, None]
        pos = jnp.broadcast_to((st.lengths + st.rope_delta)[None, :, None], (tm.position_rows, rows, 1))
        out = tm.forward(text, embeds, pos, cache, st.lengths, kv_len, reduce_small=tune.reduce_small_attention)
        logits = _gathered(tm.logits(text, out.hidden[:, 0]), logits_sharding)
        split = jax.vmap(jax.random.split)(st.keys)
        res = sample(logits, split[:, 1], st.sampling)
        st = DecodeState(res[0], st.lengths + 1, st.rope_delta, split[:, 0], st.sampling)
        return out.cache, state.set_head(rows, st), res
    return decode


def make_prompt_forward(family: Family, capture: Capture = Capture(), tm=None):
    """A jittable (params, ids [t], image_embeds [t, d], image_mask [t], positions [rows, t]) ->
    (logits [t, vocab] float32, intermediates) over a whole prompt with a private one-slot cache
    (research / parity use; `capture` picks the intermediates, see models/text.Capture; `tm`:
    the text model as placed, default the family's)."""
    tm = tm or family.text_model

    def fn(params, ids, image_embeds, image_mask, positions):
        text = params["text"]
        t = ids.shape[0]
        embeds = jnp.where(image_mask[:, None], image_embeds, tm.embed(text, ids))
        cache = tm.init_cache(1, t, image_embeds.dtype)
        out = tm.forward(text, embeds[None], positions[:, None, :], cache, jnp.zeros((1,), jnp.int32), t,
                         capture=capture)
        return tm.logits(text, out.hidden[0]), out.intermediates
    return fn


class ModelRunner:
    """Owns the params, KV cache and decode state of one model on its devices, and the jitted
    steps over them."""

    def __init__(self, family: Family, params: dict, *, max_num_seqs: int, max_model_len: int,
                 prefill_chunk: int, max_encode_batch: int, dtype=None, mesh=None, platform: str | None = None,
                 vision_tensor_parallel: bool = False):
        self.family = family
        self.placement = Placement(mesh, vision_tp=vision_tensor_parallel)
        # tensor parallel: the text model for tp shards and its params in per-shard layout
        self.text_model = self.placement.text_model(family.text_model)
        self.tuning = tuning(platform)
        self.dtype = dtype or jax.tree.leaves(params["text"])[0].dtype
        params = self.placement.layout_params(params, self.text_model)
        self.param_shardings = self.placement.param_shardings(params, self.text_model)
        self.params = self.placement.place_params(params, self.text_model)
        self.hidden_size = self.text_model.hidden_size
        self.num_slots = max_num_seqs
        self.max_model_len = max_model_len
        self.max_encode_batch = max_encode_batch
        self.buckets = Buckets.make(prefill_chunk=prefill_chunk, max_num_seqs=max_num_seqs)
        self.cache_shardings = self.placement.cache_shardings(jax.eval_shape(
            lambda: self.text_model.init_cache(max_num_seqs, max_model_len, self.dtype)))
        self.cache = self.fresh_cache()
        self.state = self.fresh_state()
        # measured now, while no step holds the (donated) cache: stats() may run on any thread
        self._memory: dict | None = self._measure_memory()
        # multi-host: on a mesh spanning processes, the leader announces each call to the
        # followers before making it (mmjax/distributed.py); None otherwise
        from mmjax import distributed
        index = distributed.register(self)
        self._announce = distributed.Leader(index) if index is not None and distributed.is_leader() else None
        self.compiled: dict[str, set] = {"encode": set(), "prefill": set(), "decode": set()}
        self.compile_seconds = 0.0
        self.calls = {"encode": 0, "prefill": 0, "decode": 0}  # compiled-step invocations
        # wall seconds of each step kind until its outputs are ready, first-call compiles excluded
        self.step_seconds = {"encode": 0.0, "prefill": 0.0, "decode": 0.0}
        p, t = self.placement, self.tuning
        outs = step_shardings(self.cache_shardings, p.sharding("state"), p.sharding("outputs"))
        self._encode = jax.jit(family.encode, out_shardings=p.sharding("outputs"),
                               compiler_options=t.compiler_options("encode"))
        gather = (NamedSharding(p.mesh, PartitionSpec(None, MODEL)), p.sharding("outputs")) if p.tp > 1 else None
        self._prefill = jax.jit(make_prefill_step(family, t, self.text_model, gather), donate_argnums=(1, 2),
                                out_shardings=outs, compiler_options=t.compiler_options("prefill"))
        self._decode = jax.jit(make_decode_step(family, t, self.text_model, gather), static_argnames=("rows",),
                               donate_argnums=(1, 2), out_shardings=outs,
                               compiler_options=t.compiler_options("decode"))

    def fresh_cache(self):
        return self.text_model.init_cache(self.num_slots, self.max_model_len, self.dtype,
                                          sharding=self.cache_shardings)

    def fresh_state(self) -> DecodeState:
        return self.placement.place(DecodeState.zeros(self.num_slots), "state")

    def reset_device_state(self) -> None:
        """Fresh KV cache and decode state (after a failed step may have consumed donated buffers)."""
        if self._announce is not None:
            return self._announce("reset", None, self._reset)
        self._reset()

    def _reset(self) -> None:
        self.cache = self.fresh_cache()
        self.state = self.fresh_state()

    def device_state_lost(self) -> bool:
        """Did a failed call consume the donated cache or state?"""
        return any(x.is_deleted() for x in jax.tree.leaves((self.cache, self.state)))

    # ---- host entry points -----------------------------------------------------------------
    def _track(self, kind: str, shape, fn, *args, **kw):
        """Run one compiled step and wait for it (its outputs are read on the host right after
        anyway); the time goes to compile_seconds on a shape's first call, else step_seconds."""
        self.calls[kind] += 1
        first = shape not in self.compiled[kind]
        t0 = time.perf_counter()
        with compiling_for(self.tuning.platform):
            result = jax.block_until_ready(fn(*args, **kw))
        dt = time.perf_counter() - t0
        if first:
            self.compile_seconds += dt
            self.compiled[kind].add(shape)
            log.info("compiled %s %s in %.2fs", kind, shape, dt)
        else:
            self.step_seconds[kind] += dt
        return result

    def encode(self, calls: list[EncodeCall]) -> list[np.ndarray]:
        """Run a family's encode plan -> one feature array [num_tokens, hidden] per image, in order."""
        if self._announce is not None:
            return self._announce("encode", [(c.bucket, c.inputs) for c in calls], lambda: self._encode_calls(calls))
        return self._encode_calls(calls)

    def _encode_calls(self, calls: list[EncodeCall]) -> list[np.ndarray]:
        out: list[np.ndarray] = []
        for call in calls:
            inputs = call.inputs
            s = self.placement.encode_input_sharding(np.shape(inputs)) if isinstance(inputs, np.ndarray) else None
            if s is not None:   # data-parallel vision tower: the images of the call split over devices
                inputs = jax.device_put(inputs, s)
            feats = np.asarray(self._track("encode", call.bucket, self._encode, self.params, inputs))
            out.extend(call.split(feats))
        return out

    def encode_images(self, images: list) -> list[np.ndarray]:
        """Prepared images -> features (the family's plan, then `encode`)."""
        return self.encode(self.family.encode_plan(images, self.max_encode_batch))

    def prefill(self, slot: int, start: int, token_ids: np.ndarray, image_embeds: np.ndarray | None,
                image_mask: np.ndarray, positions: np.ndarray, rope_delta: int, sampling: SlotSampling,
                key: np.ndarray) -> StepOutput:
        """Prefill `len(token_ids)` (<= prefill_chunk) tokens of one sequence at cache index
        `start`; positions [rows, n]."""
        if self._announce is not None:
            args = (slot, start, token_ids, image_embeds, image_mask, positions, rope_delta, sampling, key)
            return self._announce("prefill", args, lambda: self._prefill_chunk(*args))
        return self._prefill_chunk(slot, start, token_ids, image_embeds, image_mask, positions, rope_delta,
                                   sampling, key)

    def _prefill_chunk(self, slot, start, token_ids, image_embeds, image_mask, positions, rope_delta, sampling,
                       key) -> StepOutput:
        n = len(token_ids)
        c = bucket_for(n, self.buckets.prefill)
        pad = c - n
        ids = np.pad(np.asarray(token_ids, np.int32), (0, pad))
        mask = np.pad(np.asarray(image_mask, bool), (0, pad))
        emb = np.zeros((c, self.hidden_size), self.dtype) if image_embeds is None else \
            np.pad(np.asarray(image_embeds, self.dtype), ((0, pad), (0, 0)))
        pos = np.pad(np.asarray(positions, np.int32), ((0, 0), (0, pad)), mode="edge")
        self.cache, self.state, out = self._track(
            "prefill", c, self._prefill, self.params, self.cache, self.state, ids, emb, mask, pos,
            np.int32(slot), np.int32(start), np.int32(n), np.int32(rope_delta), sampling,
            np.asarray(key, np.uint32))
        return StepOutput(*(np.asarray(x) for x in out))

    def decode(self, max_length: int, active_rows: int | None = None) -> StepOutput:
        """Advance the first `active_rows` slots (default: all; rounded up to the decode ladder)
        by one token; `max_length` = longest active sequence after the step. Outputs have one
        row per advanced slot."""
        if self._announce is not None:
            return self._announce("decode", (max_length, active_rows), lambda: self._decode_rows(max_length, active_rows))
        return self._decode_rows(max_length, active_rows)

    def _decode_rows(self, max_length: int, active_rows: int | None) -> StepOutput:
        rows = bucket_for(self.num_slots if active_rows is None else active_rows, self.buckets.decode)
        self.cache, self.state, out = self._track("decode", rows, self._decode, self.params, self.cache,
                                                  self.state, np.int32(max_length), rows=rows)
        return StepOutput(*(np.asarray(x) for x in out))

    def warmup(self) -> None:
        """Compile every bucket of every step (leaves garbage in slot 0: reset afterwards)."""
        self.encode(self.family.warmup_plan(self.max_encode_batch))
        rows = self.text_model.position_rows
        for c in self.buckets.prefill:
            self.prefill(0, 0, np.zeros(c, np.int32), None, np.zeros(c, bool), np.zeros((rows, c), np.int32), 0,
                         SlotSampling.from_params(SamplingParams(temperature=0.0)), np.zeros(2, np.uint32))
        for r in self.buckets.decode:
            self.decode(1, r)

    def step_signatures(self) -> list[tuple[str, object, tuple, dict]]:
        """(name, jitted step, abstract args, static kwargs) for every compiled shape this runner
        can produce: what tests/test_cuda_lowering.py exports for CUDA."""
        mesh = self.placement.mesh

        def spec(x, sharding=None):
            # with a mesh, the abstract args carry the placed arrays' shardings (what export sees)
            sharding = sharding or (getattr(x, "sharding", None) if mesh is not None else None)
            return jax.ShapeDtypeStruct(np.shape(x), jnp.asarray(x).dtype if not hasattr(x, "dtype") else x.dtype,
                                        sharding=sharding)

        params, cache, state = (jax.tree.map(spec, t) for t in (self.params, self.cache, self.state))
        out = []
        for call in self.family.warmup_plan(self.max_encode_batch):
            inputs = call.inputs
            if isinstance(inputs, np.ndarray):
                inputs = spec(inputs, self.placement.encode_input_sharding(inputs.shape))
            else:
                inputs = jax.tree.map(spec, inputs)
            out.append((f"encode{call.bucket}", self._encode, (params, inputs), {}))
        rows = self.text_model.position_rows
        i32 = jax.ShapeDtypeStruct((), jnp.int32)
        samp = jax.tree.map(spec, SlotSampling.from_params(SamplingParams(temperature=0.0)))
        for c in self.buckets.prefill:
            args = (params, cache, state, jax.ShapeDtypeStruct((c,), jnp.int32),
                    jax.ShapeDtypeStruct((c, self.hidden_size), self.dtype), jax.ShapeDtypeStruct((c,), jnp.bool_),
                    jax.ShapeDtypeStruct((rows, c), jnp.int32), i32, i32, i32, i32, samp,
                    jax.ShapeDtypeStruct((2,), jnp.uint32))
            out.append((f"prefill[{c}]", self._prefill, args, {}))
        for r in self.buckets.decode:
            out.append((f"decode[{r}]", self._decode, (params, cache, state, i32), {"rows": r}))
        return out

    def memory_report(self) -> dict:
        """The mesh and the bytes of weights and KV cache on each device (addressable shards;
        computed once: shapes and shardings never change)."""
        if self._memory is None:
            self._memory = self._measure_memory()
        return dict(self._memory)

    def _measure_memory(self) -> dict:
        w, kv = per_device_bytes(self.params), per_device_bytes(self.cache)
        return {"mesh": self.placement.describe(),
                "weight_bytes_per_device": w, "kv_cache_bytes_per_device": kv,
                "weight_bytes_max_device": max(w.values(), default=0),
                "kv_cache_bytes_max_device": max(kv.values(), default=0)}

    def compiled_counts(self) -> dict[str, int]:
        return {k: len(v) for k, v in self.compiled.items()}

    def max_compilations(self) -> dict[str, int]:
        """Upper bound on distinct compiled shapes per step kind (encode: the family's buckets)."""
        return {"encode": len(self.family.warmup_plan(self.max_encode_batch)),
                "prefill": len(self.buckets.prefill), "decode": len(self.buckets.decode)}
