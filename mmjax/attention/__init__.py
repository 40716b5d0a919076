"""One attention API, several implementations.

    attention(q, k, v, *, causal=False, segment_ids=None, lengths=None, window=None,
              scale=None, impl="auto") -> [batch, seq_q, heads, head_dim] in q.dtype

q [B, Sq, H, D]; k, v [B, Sk, Hkv, D] with H % Hkv == 0 (GQA: query head h uses kv head
h // (H // Hkv), the order of Hugging Face's repeat_kv). Masking semantics (bottom-right causal
alignment, window=(left, right), negative segment ids = padding, lengths = valid keys per row,
zeros for rows that see no key) are defined once in `mmjax.attention.common`.

impl:
  "reference"  plain jnp, O(N^2) scores (the oracle)
  "chunked"    blockwise XLA with online softmax, O(N * block) temporaries
  "flash"      Pallas tiled flash-attention kernel (GPU; interpret mode elsewhere)
  "cudnn"      jax.nn.dot_product_attention(implementation="cudnn") (GPU only)
  "cpu"        mmjax's CPU kernel (mmjax.kernels.cpu_attention.dense_attention): full
               attention with optional lengths only (no causal, window or segment ids)
  "auto"       flash on GPU; on the CPU full attention (the vision towers') goes to "cpu" where
               the kernel has a SIMD path (AVX2, AVX-512); otherwise chunked when the
               reference's score matrix would exceed AUTO_REFERENCE_MAX_SCORE_BYTES, reference
               otherwise (inside `auto_reference_up_to`, the reference up to its bound).
causal, window, scale and impl are static Python values and segment_ids / lengths may be traced
arrays, so `attention` works inside jax.jit.
"""
from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp

from mmjax.attention.chunked import chunked_attention
from mmjax.attention.common import SegmentIds, Window, check_shapes, normalize_window
from mmjax.attention.reference import reference_attention

__all__ = ["attention", "reference_attention", "chunked_attention", "flash_attention",
           "FlashBlockSizes", "IMPLS", "AUTO_REFERENCE_MAX_SCORE_BYTES",
           "auto_reference_up_to"]

IMPLS = ("auto", "reference", "chunked", "flash", "cudnn", "cpu")

# Above this many bytes of float32 scores (B * H * Sq * Sk * 4) "auto" leaves the reference.
# On the CPU chunked runs faster than the reference from a few hundred tokens on (the reference
# streams several N x N f32 arrays through memory; `mmjax bench attention`), but compiles slower
# (nested while loops), so only tiny problems (<= 1 MiB of scores, e.g. 16 heads x 128^2) stay
# on the reference.
AUTO_REFERENCE_MAX_SCORE_BYTES = 2**20
_DEFAULT_REFERENCE_MAX_SCORE_BYTES = AUTO_REFERENCE_MAX_SCORE_BYTES


@contextlib.contextmanager
def auto_reference_up_to(score_bytes: int):
    """While tracing inside this block, impl="auto" on CPU keeps the plain reference attention
    up to `score_bytes` of scores (training: same math, cheaper to differentiate). Restores the
    default on exit, so nothing else traced later in the process is affected."""
    global AUTO_REFERENCE_MAX_SCORE_BYTES
    before = AUTO_REFERENCE_MAX_SCORE_BYTES
    AUTO_REFERENCE_MAX_SCORE_BYTES = max(before, score_bytes)
    try:
        yield
    finally:
        AUTO_REFERENCE_MAX_SCORE_BYTES = before


def _on_gpu() -> bool:
    """Pick the Pallas flash kernel? (a CUDA GPU, and not inside a step sharded over a mesh:
    mmjax.backend.pallas_kernels_enabled)"""
    from mmjax.backend import pallas_kernels_enabled
    return pallas_kernels_enabled()


def _cpu_dense_covers(q, k, v) -> bool:
    """Does mmjax's CPU kernel take full attention on these operands here (trace time)?"""
    from mmjax.kernels.cpu_attention import dense_covers
    return dense_covers(q, k, v)


def _cudnn_attention(q, k, v, *, causal, segment_ids, lengths, window, scale):
    """Pass-through to cuDNN fused attention; it has no segment ids (would need an N x N mask)."""
    if segment_ids is not None:
        raise ValueError("impl='cudnn' does not support segment_ids; use impl='flash' or 'chunked'")
    if causal and q.shape[1] != k.shape[1]:
        raise ValueError("impl='cudnn' supports causal only with seq_q == seq_k")
    win = normalize_window(window)
    if win is not None:  # jax has no "unbounded" side: seq_k reaches every key
        left, right = (k.shape[1] if w is None else w for w in win)
        # Under causal masking the right side is 0 whatever was asked; cuDNN wants it said.
        win = (left, 0 if causal else right)
    if lengths is not None:
        lengths = jnp.asarray(lengths).astype(jnp.int32)
    return jax.nn.dot_product_attention(
        q, k, v, scale=scale, is_causal=causal, key_value_seq_lengths=lengths,
        local_window_size=win, implementation="cudnn")


def attention(q: jax.Array, k: jax.Array, v: jax.Array, *, causal: bool = False,
              segment_ids: SegmentIds = None, lengths: jax.Array | None = None,
              window: Window = None, scale: float | None = None, impl: str = "auto") -> jax.Array:
    """Multi-head attention; q [B, Sq, H, D], k/v [B, Sk, Hkv, D] -> [B, Sq, H, D] (q.dtype)."""
    b, sq, h, d, sk, hkv = check_shapes(q, k, v)
    kw = dict(causal=causal, segment_ids=segment_ids, lengths=lengths, window=window, scale=scale)
    if impl == "auto":
        score_bytes = b * h * sq * sk * 4
        # inside auto_reference_up_to (the bound raised for training) small problems keep the reference
        training = (AUTO_REFERENCE_MAX_SCORE_BYTES != _DEFAULT_REFERENCE_MAX_SCORE_BYTES
                    and score_bytes <= AUTO_REFERENCE_MAX_SCORE_BYTES)
        if _on_gpu():
            impl = "flash"
        elif not (causal or training or segment_ids is not None or window is not None) and _cpu_dense_covers(q, k, v):
            impl = "cpu"
        elif score_bytes > AUTO_REFERENCE_MAX_SCORE_BYTES:
            impl = "chunked"
        else:
            impl = "reference"
    if impl == "reference":
        return reference_attention(q, k, v, **kw)
    if impl == "chunked":
        return chunked_attention(q, k, v, **kw)
    if impl == "flash":
        from mmjax.attention.flash import flash_attention  # lazy: importing Pallas costs ~0.7 s
        return flash_attention(q, k, v, **kw)
    if impl == "cudnn":
        return _cudnn_attention(q, k, v, **kw)
    if impl == "cpu":
        if causal or segment_ids is not None or window is not None:
            raise ValueError("impl='cpu' is full attention: no causal, window or segment_ids (use 'auto')")
        from mmjax.kernels.cpu_attention import dense_attention
        return dense_attention(q, k, v, lengths, scale=scale)
    raise ValueError(f"unknown attention impl {impl!r}; expected one of {IMPLS}")


def __getattr__(name):
    if name in ("flash_attention", "FlashBlockSizes"):
        from mmjax.attention import flash
        return getattr(flash, name)
    raise AttributeError(name)
