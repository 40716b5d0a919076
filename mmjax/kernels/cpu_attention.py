"""Decode attention on the CPU in one kernel call per layer (cpu_attention.cc; issues 25 and 28).

Why: XLA computes decode attention over the segmented KV cache segment by segment, each behind a
`lax.cond`, as 6-10 small fusions per segment and layer: at batch 1 with 235 cached tokens that
was 1.9 ms of a 14 ms int8 decode step for 7.7 MB of cache, and every row of a batch computes up
to the batch's longest row. The kernel reads each row's own visible keys [lo, hi), in place.

Built and registered with the other CPU kernels (mmjax/kernels/cpu_library.py); only on the CPU
(`enabled()` at trace time). Differentiable: derivatives go through `reference` (XLA ops).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from mmjax.kernels.cpu_library import VMAP, available, enabled

_TARGETS = {jnp.dtype(jnp.float32): "mmjax_decode_attention_f32", jnp.dtype(jnp.bfloat16): "mmjax_decode_attention_bf16"}


def covers(kts: list, vs: list) -> bool:
    """Does the kernel take attention over these cache segments here? (trace time: `enabled()`
    and f32 or bf16 segments, all of one dtype; an int8 / fp8 cache keeps XLA's path)"""
    dtypes = {jnp.dtype(x.dtype) for x in (*kts, *vs)}
    return len(dtypes) == 1 and next(iter(dtypes)) in _TARGETS and enabled()


def reference(qn: jax.Array, kts: list, vs: list, lo: jax.Array, hi: jax.Array, scale: float) -> jax.Array:
    """What the kernel computes, in XLA ops (its derivative rule, and the tests' reference):
    qn [b, kvh, n, hd]; kts K^T segments [slots, kvh, hd, L_i]; vs V segments [slots, kvh, L_i, hd];
    row i attends the cache indexes [lo_i, hi_i) of cache row i -> f32 [b, kvh, n, hd] (zeros for
    a row that sees nothing)."""
    b = qn.shape[0]
    kt = jnp.concatenate([k[:b] for k in kts], axis=3).astype(jnp.float32)       # [b, kvh, hd, T]
    v = jnp.concatenate([x[:b] for x in vs], axis=2).astype(jnp.float32)          # [b, kvh, T, hd]
    s = jnp.einsum("bknd,bkdt->bknt", qn.astype(jnp.float32), kt) * scale
    idx = jnp.arange(kt.shape[3])
    visible = (idx[None] >= lo[:, None]) & (idx[None] < hi[:, None])              # [b, T]
    s = jnp.where(visible[:, None, None, :], s, -jnp.inf)
    top = s.max(axis=3, keepdims=True)
    w = jnp.exp(s - jnp.where(jnp.isfinite(top), top, 0.0))
    total = w.sum(axis=3, keepdims=True)
    return jnp.einsum("bknt,bktd->bknd", w, v) / jnp.where(total > 0, total, 1.0)


@functools.partial(jax.custom_jvp, nondiff_argnums=(5,))
def _attend(qn, kts, vs, lo, hi, scale):
    target = _TARGETS[jnp.dtype(kts[0].dtype)]
    return jax.ffi.ffi_call(target, jax.ShapeDtypeStruct(qn.shape, jnp.float32), vmap_method=VMAP)(
        qn.astype(jnp.float32), lo.astype(jnp.int32), hi.astype(jnp.int32), *kts, *vs, scale=np.float32(scale))


@_attend.defjvp
def _attend_jvp(scale, primals, tangents):
    _, tangent = jax.jvp(lambda *a: reference(*a, scale), primals, tangents)
    return _attend(*primals, scale), tangent


def decode_attention(qn: jax.Array, kts: list, vs: list, lo: jax.Array, hi: jax.Array, *, scale: float) -> jax.Array:
    """Attention of one token per row over rows [0, b) of a segmented cache, each row over its own
    keys. qn [b, kvh, n, hd] (n queries per KV head: the GQA group); kts: K^T segments [slots,
    kvh, hd, L_i]; vs: V segments [slots, kvh, L_i, hd] (f32 or bf16, slots >= b), covering cache
    indexes [0, sum L_i) in order; lo, hi [b] int32: row i sees indexes [lo_i, hi_i) (clipped to
    the cache). Returns f32 [b, kvh, n, hd] = softmax(scale q K^T) V over those keys; zeros for a
    row that sees nothing."""
    if not available():
        raise RuntimeError("mmjax's CPU kernels are unavailable (see the warning); use covers() first")
    return _attend(qn, list(kts), list(vs), lo, hi, float(scale))
