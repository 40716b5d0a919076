"""The compiled steps of one model: `encode`, `prefill`, `decode` (DESIGN.md compilation contract).

The runner drives; the family and its text model provide pure functions. Device state is the
text model's KV cache plus a `DecodeState` pytree (one row per slot); both are donated to every
prefill/decode call so XLA updates them in place. Every shape comes from `Buckets` (the family's
encode plan for encode); the shapes compiled so far are recorded in `compiled` (engine.stats(),
/metrics). Where arrays live comes from the placement seam (mmjax.sharding); backend-specific
tuning from mmjax.backend.

ModelRunner is this module (device state, jitting, the host entry points) and three parts, one
job each: batching.HostBatching (host chunks packed into a step's arrays), memory_plan.MemoryPlanning
(step signatures, the memory budget) and compile_ahead.AheadOfTime (background compiles). The
step functions it jits are pure and live in steps.py.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from mmjax.backend import compiling_for, tuning
from mmjax.buckets import Buckets, bucket_for, pow2_ladder
from mmjax.errors import InvalidRequestError
from mmjax.kernels import cpu_gemv
from mmjax.models.family import EncodeCall, Family
from mmjax.models.nn import kv_quant
from mmjax.models.nn.kv_cache import allocate_cache
from mmjax.serving.batching import HostBatching, PendingOutput, PrefillChunk, StepOutput
from mmjax.serving.compile_ahead import AheadOfTime
from mmjax.serving.memory_plan import MemoryPlanning, device_memory_bytes
from mmjax.serving.placed_model import PlacedModel
from mmjax.serving.sampling import SamplingParams, SlotSampling, VocabRow
from mmjax.serving.steps import (DecodeState, PrefillOut, Riders, Segments, make_decode_step, make_embed_forward,
                                 make_encode_step,
                                 make_prefill_step, make_prompt_forward, make_pruned_prefill_step, prompt_scores,
                                 step_spans)
from mmjax.sharding import MODEL, Placement, step_shardings

log = logging.getLogger("mmjax.runner")

# what `from mmjax.serving.runner import ...` has always given (engine, output, api, research, tests)
__all__ = ["ModelRunner", "DecodeState", "PrefillChunk", "PrefillOut", "StepOutput", "PendingOutput", "Segments",
           "Riders", "make_prefill_step", "make_pruned_prefill_step", "make_decode_step", "make_encode_step",
           "make_prompt_forward",
           "make_embed_forward", "prompt_scores", "step_spans", "device_memory_bytes"]


class ModelRunner(HostBatching, MemoryPlanning, AheadOfTime):
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
            page_size = self.tuning.page_size if lm.pages_by_default else 0
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
        # jitted, not an eager .at[].set: right after a step the eager op is slower, and a park
        # lies inside generate()'s time to first token
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
        # the prefill steps return a PrefillOut: its shardings the same tuple (scores: None or the outputs')
        prefill_outs = None if outs is None else PrefillOut(*outs)
        self._prefill = jax.jit(t.traced(make_prefill_step(family, t, lm_of, gather)), donate_argnums=(1, 2),
                                out_shardings=prefill_outs, compiler_options=t.compiler_options("prefill"))
        scores_outs = None if outs is None else PrefillOut(*outs, scores=p.sharding("outputs"))
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
        return self._everywhere("reset", None, self._reset)

    def _reset(self) -> None:
        self.cache = self.fresh_cache()
        self.state = self.fresh_state()
        if self.state_pool is not None:     # a failed snapshot copy may have consumed it
            self.init_state_pool(self.state_pool.rows)

    def copy_slot(self, src: int, dst: int) -> None:
        """Copy cache row `src` into row `dst` (n > 1 siblings share their prompt's KV). Every
        text model's cache leaves have the slot axis first (models/nn/decoder.py Decoder.init_cache);
        a paged cache's rows are pages, its per-slot leaves (Mllama's cross cache) left alone
        (`copy_pages`)."""
        return self._everywhere("copy_slot", (src, dst), lambda: self._copy_slot(src, dst))

    def _copy_slot(self, src: int, dst: int) -> None:
        self.cache = self._track("copy_slot", 0, self._copy, self.cache, np.int32(src), np.int32(dst))

    def init_state_pool(self, rows: int) -> None:
        """A pool of `rows` snapshots of the recurrent decoder's per-slot states (a hybrid
        decoder's `state_layers`) beside the cache: serving/state_snapshots.py."""
        from mmjax.serving.state_snapshots import StatePool
        self.state_pool = StatePool(self.cache, self.text_model.state_layers, rows, self.cache_shardings)

    def save_state(self, slot: int, row: int) -> None:
        """Snapshot slot `slot`'s recurrent states into pool row `row`."""
        self._everywhere("save_state", (slot, row), lambda: self._save_state(slot, row))

    def _save_state(self, slot: int, row: int) -> None:
        self._track("copy_state", "save", self.state_pool.save, self.cache, slot, row, wait=False)

    def load_state(self, row: int, slot: int) -> None:
        """Slot `slot`'s recurrent states <- pool row `row` (a prefix resumed from its snapshot)."""
        self._everywhere("load_state", (row, slot), lambda: self._load_state(row, slot))

    def _load_state(self, row: int, slot: int) -> None:
        self.cache = self._track("copy_state", "load", self.state_pool.load, self.cache, row, slot, wait=False)

    def set_pages(self, table: np.ndarray) -> None:
        """The host page table [slots, max_pages] int32 (`pages.KVPages.table`) into the decode
        state, read by every later step (a paged cache only)."""
        if self.state.pages.is_deleted():     # a failed step consumed the state: it is being reset
            return
        return self._everywhere("set_pages", (table,), lambda: self._set_pages(table))

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
        return self._everywhere("restore_row", (slot, row), lambda: self._restore_row(slot, row))

    def _restore_row(self, slot: int, row) -> None:
        self.state = self._restore(self.state, np.int32(slot), row)

    def park(self, slot: int) -> None:
        """A released slot's decode row points past the cache (length max_model_len): the decode
        steps whose rows still cover it then write nothing into the KV it keeps for the prefix
        cache (segments drop indexes past max_len; a ring-buffer sliding-window layer, which
        would otherwise evict the window a resume needs, drops indexes >= kv_len)."""
        if self.state.lengths.is_deleted():   # a failed step consumed the state: it is being reset
            return
        # a computation on the global state: every process runs it
        return self._everywhere("park", (slot,), lambda: self._park(slot))

    def _park(self, slot: int) -> None:
        self.state = dataclasses.replace(self.state, lengths=self._park_lengths(self.state.lengths, np.int32(slot)))

    def device_state_lost(self) -> bool:
        """Did a failed call consume the donated cache or state?"""
        return any(x.is_deleted() for x in jax.tree.leaves((self.cache, self.state)))

    # ---- host entry points -----------------------------------------------------------------
    def _everywhere(self, op: str, args, run):
        """`run()` here; on a mesh spanning processes the leader first announces (op, args), and
        every follower makes the same call on its runner (mmjax/distributed.py `follow`)."""
        return run() if self._announce is None else self._announce(op, args, run)

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
        adapter: the LoRA adapter slot every call runs under (-1: none; `steps.make_encode_step`)."""
        return self._everywhere("encode", [(c.bucket, c.inputs) for c in calls],
                                lambda: self._encode_calls(calls, adapter))

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
        # followers always wait (wait=True): they read no outputs, the next announced call orders them
        return self._everywhere("prefill", (chunks, prune, True, riders),
                                lambda: self._prefill_call(chunks, prune, wait, riders))

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
            r = self._track("prefill_scores", c_len, self._prefill_scores, self.lm_leaves, self.cache, self.state,
                            *args)
            self.cache, self.state = r.cache, r.state
            n = len(c.token_ids)
            return StepOutput(*(np.asarray(x) for x in r.outputs), scores=tuple(np.asarray(x)[:n] for x in r.scores))
        c_len, args = self._pack(chunks, s, riders, d)
        r = self._track("prefill", (c_len, s), self._prefill, self.lm_leaves, self.cache, self.state, *args,
                        wait=wait)
        self.cache, self.state, out = r.cache, r.state, r.outputs
        if not d:
            return self._output("prefill", out, wait, rows=k)
        # the riders' rows (row j: slot j), then the chunks' (after all D rider rows)
        return self._output("prefill", out, wait, take=np.r_[np.sort(np.asarray(riders, np.int64)), d + np.arange(k)])

    def _prefill_pruned_call(self, chunk: PrefillChunk, prune: tuple[int, int],
                             wait: bool = True) -> StepOutput | PendingOutput:
        shape, args, kw = self._pruned_args(chunk, prune)
        self.cache, self.state, out = self._track("prefill_pruned", shape, self._prefill_pruned, self.lm_leaves,
                                                  self.cache, self.state, *args, **kw, wait=wait)
        return self._output("prefill_pruned", out, wait)

    def fill_cross(self, slot: int, feats: list[np.ndarray], n_tiles: list[int], dec: int) -> None:
        """Cross-attention families: write one request's images (feats: per image [vision tokens,
        hidden]; none for a text-only request) into cache row `slot`'s cross-attention K/V,
        once per request; `dec`: its decode tokens' packed image range."""
        return self._everywhere("fill_cross", (slot, feats, n_tiles, dec),
                                lambda: self._fill_cross_row(slot, feats, n_tiles, dec))

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
        return self._everywhere("decode", (max_length, active_rows, bits, True, steps),
                                lambda: self._decode_rows(max_length, active_rows, bits, wait, steps))

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
