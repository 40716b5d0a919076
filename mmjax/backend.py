"""Backend-specific tuning, in one place: everything a compiled step does differently on one
backend sits behind `tuning(platform)`, so the steps themselves stay device-independent (and
every one of them lowers for CUDA on a CPU-only machine: tests/test_cuda_lowering.py)."""
from __future__ import annotations

import contextlib
import functools
import threading
from dataclasses import dataclass
from typing import Iterator

import jax
import jax.numpy as jnp

# XLA CPU: keep the decode step's skinny [slots, in] @ [in, out] f32 matmuls off YNNPACK library
# fusions (slower for a few rows than XLA's own dot), but give YNN the reductions: decode
# attention's broadcast-multiply-reduce over a K^T segment runs faster there than in XLA's own
# reduction loop. Prefill/encode keep the default library fusions.
_CPU_DECODE_OPTIONS = {"xla_cpu_experimental_ynn_fusion_type": "LIBRARY_FUSION_TYPE_REDUCE"}
# bf16 / int8 weights: XLA:CPU has a bf16 x bf16 and an s8 x s8 dot only through a library; a
# dot it keeps for itself gets its operands converted to f32 / s32 first (the whole weight, every
# step: the operand upcaster), so narrow weights keep YNN's dots too.
_CPU_DECODE_OPTIONS_NARROW = {"xla_cpu_experimental_ynn_fusion_type":
                              "LIBRARY_FUSION_TYPE_INDIVIDUAL_DOT,LIBRARY_FUSION_TYPE_REDUCE"}


@dataclass(frozen=True)
class Tuning:
    """platform: "cpu", "cuda", "rocm" or "tpu" (what the steps are compiled for); sharded: the
    steps run over a multi-device mesh; narrow_weights: the weights are bf16 or 8-bit."""
    platform: str
    sharded: bool = False
    narrow_weights: bool = False

    @property
    def pallas_kernels(self) -> bool:
        """Pallas (Triton) kernels inside the steps: on CUDA GPUs, and only unsharded. XLA's SPMD
        partitioner cannot split a kernel's custom call (it would gather every operand, the KV
        cache included, onto each device), so a mesh keeps XLA's own attention ops."""
        return self.platform in ("gpu", "cuda") and not self.sharded

    @property
    def cpu_kernels(self) -> bool:
        """mmjax's own CPU kernels (mmjax.kernels: the narrow-weight decode matmul) inside the
        steps: on the CPU, and only unsharded (a custom call cannot be SPMD-partitioned either)."""
        return self.platform == "cpu" and not self.sharded

    def traced(self, fn):
        """fn, tracing with this tuning's kernel choices in effect (`pallas_kernels_enabled`,
        `cpu_kernels_enabled`)."""
        def wrapped(*args, **kw):
            with _scoped(pallas=self.pallas_kernels, cpu_kernels=self.cpu_kernels):
                return fn(*args, **kw)
        return functools.wraps(fn)(wrapped)

    @property
    def fine_prefill_ladder(self) -> bool:
        """Eight prefill chunk rungs per octave (`buckets.fine_ladder`) on the CPU, where a padded
        row costs its full compute; powers of two elsewhere: a GPU compile takes tens of
        seconds a shape, so a prefill_chunk of 1024 would mean 24 rungs where 7 do, while a GPU
        prefill of up to 2x the rows costs about the same as the rows it needs (its weights are
        read once)."""
        return self.platform == "cpu"

    @property
    def mixed_steps(self) -> bool:
        """Running requests' decode step rides in the packed prefill calls while prompts are
        prefilled (a mixed step, models/nn/packing.DecodeRows): on the CPU, where a decode step
        of its own reads every weight again while a token riding along costs only its share of
        the prefill's GEMMs. Elsewhere not yet, unmeasured: an unsharded GPU's riders would take the ragged Pallas decode kernel, but the
        riders' `lax.cond` is a host sync there on every prefill call, and a sharded step's riders
        take XLA's attention with a cond per KV segment and layer (Gemma 3's ring: always XLA)."""
        return self.platform == "cpu"

    @property
    def page_size(self) -> int:
        """Positions per KV page (serving/pages.py) by default: 64 on the CPU, whose attention
        kernels read page tables (mmjax/kernels/cpu_attention: each row's pages in place), so a
        paged cache costs no more per step than a row per slot while holding only the pages a
        request's tokens need and sharing prompt prefixes by page. 0 (a cache row of
        max_model_len per slot) elsewhere for now: a GPU's paged Pallas kernel
        (mmjax.attention.paged) is not measured against the slot kernels yet. Decoders whose
        cache cannot be paged (`Decoder.pages_kv` False: sliding-window rings, recurrent states,
        Mllama's cross-attention) keep slot rows whatever this says. `page_size=0` (engine
        kwarg, `--page-size 0`) turns paging off."""
        return 64 if self.platform == "cpu" else 0

    @property
    def kv_segment_ladder(self) -> tuple[int, int]:
        """(segment, fine) of the KV cache's segment ladder (models/nn/kv_cache.kv_segments:
        `fine` segments of `segment` positions, then each as long as all before it). Each
        segment is two cache leaves (a jitted call's host time grows with its leaves), two
        scatters a layer and step, and a `lax.cond` a layer in prefill; the CPU's decode
        attention kernel and a GPU's read each row's own keys whatever the segments, while
        prefill attention pays for the segments in use. The CPU takes 4 x 256 (fewer leaves than
        8 x 128 at the same reads, and a 230-token prompt still fills exactly one segment);
        elsewhere 1 x 512, since a GPU step's cost grew with its launches per segment (2048
        positions: 3 segments instead of 9; 32k: 7 instead of 13)."""
        return (256, 4) if self.platform == "cpu" else (512, 1)

    @property
    def reduce_small_attention(self) -> bool:
        """Few-query (decode) attention as broadcast-multiply-reduce instead of dots: a CPU win
        (see models/nn/kv_cache.cache_attention); GPUs keep the dots."""
        return self.platform == "cpu"

    def auto_kv_cache_dtype(self, model_dtype):
        """The KV cache dtype of kv_cache_dtype "auto": the model's, except a bf16 model's on CPU,
        float32. XLA:CPU has no bf16 scatter: every cache write would convert the whole cache
        segment to f32 and back (that alone made bf16 decode slower than f32 at batch 8), while
        attention reads the cache in f32 either way. `--kv-cache-dtype bfloat16` still asks for
        the half-size cache on CPU, at that cost."""
        if self.platform == "cpu" and jnp.dtype(model_dtype) == jnp.dtype(jnp.bfloat16):
            return jnp.float32
        return model_dtype

    def compiler_options(self, step: str) -> dict | None:
        """XLA compiler options for one kind of compiled step ("encode", "prefill", "decode")."""
        if self.platform == "cpu" and step == "decode":
            return dict(_CPU_DECODE_OPTIONS_NARROW if self.narrow_weights else _CPU_DECODE_OPTIONS)
        return None


_target = threading.local()


def current_platform() -> str:
    """The platform being compiled for: the innermost `compiling_for`, else JAX's default backend."""
    return getattr(_target, "platform", None) or jax.default_backend()


@contextlib.contextmanager
def compiling_for(platform: str) -> Iterator[None]:
    """Trace for `platform` (e.g. "cuda" while exporting on a CPU machine): kernel choices such
    as `mmjax.attention`'s impl="auto" read `current_platform()` at trace time."""
    with _scoped(platform=platform):
        yield


@contextlib.contextmanager
def _scoped(**values) -> Iterator[None]:
    """Set attributes of the thread's trace target (`_target`) for the block, then restore them."""
    prev = {k: getattr(_target, k, None) for k in values}
    for k, v in values.items():
        setattr(_target, k, v)
    try:
        yield
    finally:
        for k, v in prev.items():
            setattr(_target, k, v)


@contextlib.contextmanager
def pallas_kernels(enabled: bool) -> Iterator[None]:
    """Trace with the Pallas GPU kernels allowed or not (what `Tuning.traced` sets per step; off
    a GPU they run in the Pallas interpreter: tests compare them with XLA's path)."""
    with _scoped(pallas=enabled):
        yield


def pallas_kernels_enabled() -> bool:
    """May the code being traced use Pallas GPU kernels? Inside a step traced by `Tuning.traced`:
    its answer; elsewhere: whether the platform compiled for is a CUDA GPU."""
    chosen = getattr(_target, "pallas", None)
    return current_platform() in ("gpu", "cuda") if chosen is None else chosen


@contextlib.contextmanager
def cpu_kernels(enabled: bool) -> Iterator[None]:
    """Trace with mmjax's CPU kernels allowed or not (what `Tuning.traced` sets per step; tests
    compare against XLA's own dots with cpu_kernels(False))."""
    with _scoped(cpu_kernels=enabled):
        yield


def cpu_kernels_enabled() -> bool:
    """May the code being traced call mmjax's CPU kernels (custom calls)? Inside a step traced by
    `Tuning.traced`: its answer; elsewhere: whether the platform compiled for is the CPU. Never
    while compiling for a GPU / TPU (`compiling_for`)."""
    chosen = getattr(_target, "cpu_kernels", None)
    return current_platform() == "cpu" and (chosen is None or chosen)


def tuning(platform: str | None = None) -> Tuning:
    """The tuning for `platform` (default: the current platform)."""
    return Tuning(platform or current_platform())
