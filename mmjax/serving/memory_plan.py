"""The device memory plan of a ModelRunner (`MemoryPlanning`, a part of it): every compiled
step's abstract signature (also what tests/test_cuda_lowering.py exports for CUDA), the steps'
temporaries from XLA's own memory analysis, and from them the slots or KV pages that fit a
memory budget (vLLM's gpu_memory_utilization, without a profiling run)."""
from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np

from mmjax.backend import compiling_for
from mmjax.errors import InvalidRequestError
from mmjax.models.nn import kv_quant
from mmjax.serving.sampling import SamplingParams, SlotSampling
from mmjax.serving.steps import DecodeState, Riders, Segments
from mmjax.sharding import per_device_bytes


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



class MemoryPlanning:
    """ModelRunner's memory plan. Reads the runner's placement, weights, buckets, num_slots,
    paged-cache geometry (paged, page_size, max_pages, num_pages), cache / state and steps."""

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

