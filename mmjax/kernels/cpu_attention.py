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

_TARGETS = {jnp.dtype(jnp.float32): "mmjax_decode_attention_f32", jnp.dtype(jnp.bfloat16): "mmjax_decode_attention_bf16",
            jnp.dtype(jnp.int8): "mmjax_decode_attention_s8",
            jnp.dtype(jnp.float8_e4m3fn): "mmjax_decode_attention_f8e4m3fn"}
_SCALED = {jnp.dtype(jnp.int8), jnp.dtype(jnp.float8_e4m3fn)}     # caches stored with per-token scales
_SCALE_DTYPE = jnp.dtype(jnp.bfloat16)


def covers(kts: list, vs: list, scales: tuple | None = None) -> bool:
    """Does the kernel take attention over these cache segments here? (trace time: `enabled()`;
    f32 or bf16 segments, all of one dtype, or int8 / fp8 (e4m3) segments with their bf16 scales)"""
    dtypes = {jnp.dtype(x.dtype) for x in (*kts, *vs)}
    if len(dtypes) != 1 or not enabled():
        return False
    (dtype,) = dtypes
    if dtype in _SCALED:
        return scales is not None and {jnp.dtype(x.dtype) for x in (*scales[0], *scales[1])} == {_SCALE_DTYPE}
    return dtype in _TARGETS and scales is None


def reference(qn: jax.Array, kts: list, vs: list, lo: jax.Array, hi: jax.Array, scale: float,
              scales: tuple | None = None) -> jax.Array:
    """What the kernel computes, in XLA ops (its derivative rule, and the tests' reference):
    qn [b, kvh, n, hd]; kts K^T segments [slots, kvh, hd, L_i]; vs V segments [slots, kvh, L_i, hd];
    scales (an int8 / fp8 cache): (K scale segments, V scale segments) [slots, kvh, L_i], x ~= q * scale;
    row i attends the cache indexes [lo_i, hi_i) of cache row i -> f32 [b, kvh, n, hd] (zeros for
    a row that sees nothing)."""
    b = qn.shape[0]
    kt = jnp.concatenate([k[:b] for k in kts], axis=3).astype(jnp.float32)       # [b, kvh, hd, T]
    v = jnp.concatenate([x[:b] for x in vs], axis=2).astype(jnp.float32)          # [b, kvh, T, hd]
    if scales is not None:
        ks, vsc = (jnp.concatenate([x[:b] for x in part], axis=2).astype(jnp.float32) for part in scales)
        kt, v = kt * ks[:, :, None, :], v * vsc[..., None]
    s = jnp.einsum("bknd,bkdt->bknt", qn.astype(jnp.float32), kt) * scale
    idx = jnp.arange(kt.shape[3])
    visible = (idx[None] >= lo[:, None]) & (idx[None] < hi[:, None])              # [b, T]
    s = jnp.where(visible[:, None, None, :], s, -jnp.inf)
    top = s.max(axis=3, keepdims=True)
    w = jnp.exp(s - jnp.where(jnp.isfinite(top), top, 0.0))
    total = w.sum(axis=3, keepdims=True)
    return jnp.einsum("bknt,bktd->bknd", w, v) / jnp.where(total > 0, total, 1.0)


@functools.partial(jax.custom_jvp, nondiff_argnums=(5,))
def _attend(qn, kts, vs, lo, hi, scale, scales):
    target = _TARGETS[jnp.dtype(kts[0].dtype)]
    extra = [] if scales is None else [*scales[0], *scales[1]]
    return jax.ffi.ffi_call(target, jax.ShapeDtypeStruct(qn.shape, jnp.float32), vmap_method=VMAP)(
        qn.astype(jnp.float32), lo.astype(jnp.int32), hi.astype(jnp.int32), *kts, *vs, *extra, scale=np.float32(scale))


@_attend.defjvp
def _attend_jvp(scale, primals, tangents):
    qn, kts, vs, lo, hi, scales = primals
    _, tangent = jax.jvp(lambda qn, kts, vs, lo, hi, scales: reference(qn, kts, vs, lo, hi, scale, scales),
                         primals, tangents)
    return _attend(qn, kts, vs, lo, hi, scale, scales), tangent


def decode_attention(qn: jax.Array, kts: list, vs: list, lo: jax.Array, hi: jax.Array, *, scale: float,
                     scales: tuple | None = None) -> jax.Array:
    """Attention of one token per row over rows [0, b) of a segmented cache, each row over its own
    keys. qn [b, kvh, n, hd] (n queries per KV head: the GQA group); kts: K^T segments [slots,
    kvh, hd, L_i]; vs: V segments [slots, kvh, L_i, hd] (f32, bf16, int8 or fp8 e4m3, slots >= b),
    covering cache indexes [0, sum L_i) in order; scales (int8 / fp8 only): (K scale segments, V scale segments)
    bf16 [slots, kvh, L_i] (`mmjax.models.text.kv_quant`: scores times the key scales, softmax
    weights times the value scales); lo, hi [b] int32: row i sees indexes [lo_i, hi_i) (clipped
    to the cache). Returns f32 [b, kvh, n, hd] = softmax(scale q K^T) V over those keys; zeros
    for a row that sees nothing."""
    if not available():
        raise RuntimeError("mmjax's CPU kernels are unavailable (see the warning); use covers() first")
    scales = None if scales is None else (list(scales[0]), list(scales[1]))
    return _attend(qn, list(kts), list(vs), lo, hi, float(scale), scales)
