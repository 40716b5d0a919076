"""8-bit weights: int8 (W8A8, per-output-channel weight scales, optional groups along the input)
and fp8 e4m3 (per-output-channel scales), applied to a loaded params pytree.

One formulation per kind, the same on every backend, so the numerics CI checks on CPU are the
ones a GPU runs:

- int8: the weight is stored int8 with a float32 scale per output channel (per group of
  `group_size` input rows when given); the activation is quantized per token (per token and group)
  to int8 at run time (symmetric, amax / 127), the dot is s8 x s8 -> s32, and the result is
  rescaled by x_scale * w_scale. Weight-only (`x @ (w.astype(f32) * s)` or `(x @ w.astype(f32)) * s`)
  was rejected: XLA:CPU does not fuse the int8 -> float convert into its dot, it materializes a
  float copy of every weight every step (checked on the optimized HLO; tests/test_precision.py
  asserts the compiled CPU step's dots read the s8 weight directly). cuBLAS has s8 x s8 -> s32
  gemms too, so the same graph serves GPUs.
- fp8: the weight is float8_e4m3fn with a float32 scale per output channel (also what fp8
  "compressed-tensors" / FBGEMM checkpoints store, see `from_fp8_checkpoint`); the activation is
  quantized per token to e4m3 (amax / 448) and the dot is e4m3 x e4m3 -> f32, the form XLA:GPU
  rewrites to an FP8 cuBLASLt gemm on Hopper. XLA:CPU has no fp8 dot: it upcasts the operands
  (a float copy of the weight per step), so fp8 is a GPU format here and int8 the CPU one.

MoE expert stacks [experts, in, out] get per (expert, channel) scales and `qragged_dot`, the
8-bit form of the grouped `jax.lax.ragged_dot` (the CPU skip loop indexes one expert, `w[j]`).

Applied at load (`nn.weights.Weights`: every `Linear` whose Param says `quantize`, i.e. the LM's
and ViT's linear layers, the LM head and the MoE expert stacks; embeddings, patch embeddings and
routers stay in float). Qwix (Google's JAX quantization library) was considered now that the
models are Flax modules and not used: it intercepts `dot_general` / `einsum`, while the CPU
runner's int8 products are mmjax's own FFI kernel over packed weights (`qmatmul` ->
`cpu_gemv.qmatmul_s8p`), which an interception cannot reach; a QArray value in a Linear's
kernel Param is all the steps need, on every backend.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from mmjax.errors import InvalidRequestError

KINDS = ("int8", "fp8")
_QMAX = {"int8": 127.0, "fp8": 448.0}
_QDTYPE = {"int8": jnp.int8, "fp8": jnp.float8_e4m3fn}


@jax.tree_util.register_dataclass
@dataclass
class QArray:
    """A quantized matmul weight standing in for a float [in, out] array.

    q: int8 or float8_e4m3fn [in, out]; scale: float32 [groups, out] (groups = in / group_size,
    1 for per-channel); dtype: the float dtype the model computes in (what `w.dtype` reported
    before quantization, so code that casts inputs to a weight's dtype keeps working). A stack
    of MoE expert weights is q [experts, in, out], scale [experts, 1, out]; `w[j]` is expert j.
    On the CPU an int8 [in, out] weight is kept packed for mmjax's matmul kernel (`pack`): q is
    then uint8 [ceil(out / 64), in / 4, 64, 4] and `shape` still reports [in, out]."""
    q: jax.Array
    scale: jax.Array
    dtype: Any = field(metadata=dict(static=True), default=np.dtype(np.float32))

    @property
    def packed(self) -> bool:
        return self.q.dtype == jnp.uint8

    @property
    def shape(self) -> tuple[int, ...]:
        if self.packed:
            return (4 * self.q.shape[1], self.scale.shape[-1])
        return tuple(self.q.shape)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def __getitem__(self, j) -> "QArray":
        """Expert j of a stacked [experts, in, out] weight."""
        return QArray(self.q[j], self.scale[j], self.dtype)

    @property
    def kind(self) -> str:
        return "fp8" if self.q.dtype == jnp.float8_e4m3fn else "int8"


def quantize_weight(w, kind: str = "int8", group_size: int | None = None, dtype=None,
                    on_device: bool = True, packed: bool = False) -> QArray:
    """w [in, out] float -> QArray with symmetric scales per output channel (and per group of
    `group_size` input rows): scale = amax / qmax, q = round(w / scale). Computed in numpy on
    the host (no per-shape compiles), the result placed where jnp puts it (the default device),
    or left as host numpy arrays with on_device=False (placed over a mesh later). packed: an int8
    [in, out] weight is stored packed for the CPU kernel where its shape allows (`pack`)."""
    import ml_dtypes
    if kind not in KINDS:
        raise InvalidRequestError(f"quantize must be one of {list(KINDS)}, got {kind!r}", param="quantize")
    dtype = np.dtype(dtype or w.dtype)
    wf = np.asarray(w, np.float32)
    if wf.ndim == 3:          # MoE experts [E, in, out]: per (expert, output channel) scales
        parts = [quantize_weight(e, kind, None, dtype, on_device=False) for e in wf]
        q, scale = np.stack([p.q for p in parts]), np.stack([p.scale for p in parts])
        return QArray(jnp.asarray(q), jnp.asarray(scale), dtype) if on_device else QArray(q, scale, dtype)
    d_in, d_out = wf.shape
    g = _groups(d_in, group_size)
    wg = wf.reshape(g, d_in // g, d_out)
    amax = np.abs(wg).max(axis=1)                                      # [g, out]
    scale = np.where(amax > 0, amax / _QMAX[kind], 1.0).astype(np.float32)
    x = wg / scale[:, None]
    q = (np.clip(np.rint(x), -127, 127).astype(np.int8) if kind == "int8"
         else x.astype(ml_dtypes.float8_e4m3fn))
    q = q.reshape(d_in, d_out)
    out = QArray(q, scale, dtype)
    if packed:
        out = pack(out)
    return QArray(jnp.asarray(out.q), jnp.asarray(scale), dtype) if on_device else out


def map_columns(fn, w):
    """A column re-layout `fn` (one acting on the last axis only: the tensor-parallel regrouping
    of fused q|k|v / gate|up, vocab padding) applied to a weight; a QArray's values and its
    per-column scales [groups, out] take the same re-layout, so each column keeps its scale."""
    return QArray(fn(w.q), fn(w.scale), w.dtype) if isinstance(w, QArray) else fn(w)


def as_2d(w: QArray) -> QArray:
    """A column-grouped QArray q [in, groups, cols] (tensor-parallel layout) as q [in, groups *
    cols], scale [g, groups * cols] (a reshape of the major axes: sharding-preserving)."""
    d_in, g, c = w.shape
    return QArray(w.q.reshape(d_in, g * c), w.scale.reshape(w.scale.shape[0], g * c), w.dtype)


def packable(w) -> bool:
    """Can `pack` take w: an int8 [in, out] QArray whose groups span whole quads of rows."""
    return (isinstance(w, QArray) and w.q.dtype == jnp.int8 and w.q.ndim == 2
            and w.q.shape[0] % (4 * w.scale.shape[0]) == 0)


def pack(w: QArray) -> QArray:
    """An int8 [in, out] weight -> the same weight packed for the CPU matmul kernel
    (`mmjax.kernels.cpu_gemv.pack_s8`: each 64-column panel one contiguous run, four rows per
    column adjacent); computed in numpy, on the host. Already packed or not packable: w as is."""
    from mmjax.kernels.cpu_gemv import pack_s8
    if not packable(w):
        return w
    q = pack_s8(np.asarray(w.q))
    return QArray(q if isinstance(w.q, np.ndarray) else jnp.asarray(q), w.scale, w.dtype)


def unpack(w: QArray) -> QArray:
    """A packed weight -> int8 [in, out] (jnp ops: also inside a traced step, where a packed
    weight meets a path without the CPU kernel, e.g. lowered for CUDA). Others: w as is."""
    if not (isinstance(w, QArray) and w.packed):
        return w
    d_in, d_out = w.shape
    xp = np if isinstance(w.q, np.ndarray) else jnp
    q = (w.q ^ xp.uint8(0x80)).view(xp.int8) if xp is np else jax.lax.bitcast_convert_type(w.q ^ jnp.uint8(0x80), jnp.int8)
    q = q.transpose(1, 3, 0, 2).reshape(d_in, -1)[:, :d_out]
    return QArray(q, w.scale, w.dtype)


def _groups(d_in: int, group_size: int | None) -> int:
    if not group_size:
        return 1
    if group_size <= 0 or d_in % group_size:
        raise InvalidRequestError(f"quantize group size {group_size} must divide every quantized layer's input "
                                  f"width (got one of {d_in})", param="quantize_group_size")
    return d_in // group_size


def _quantize_acts(x: jax.Array, kind: str, groups: int) -> tuple[jax.Array, jax.Array]:
    """x [..., in] -> (xq [..., groups, in/groups] int8/e4m3, scale [..., groups, 1] float32):
    symmetric per token (and group), computed in float32."""
    xf = x.astype(jnp.float32).reshape(*x.shape[:-1], groups, x.shape[-1] // groups)
    amax = jnp.abs(xf).max(-1, keepdims=True)
    # multiplies by reciprocals, written out: XLA rewrites the divisions into these anyway, and
    # written so, the CPU kernel (cpu_gemv.qmatmul_s8p) computes the same bits
    s = jnp.where(amax > 0, amax * np.float32(1.0 / _QMAX[kind]), 1.0)
    xs = xf * (1.0 / s)
    xq = (jnp.clip(jnp.round(xs), -127, 127) if kind == "int8" else xs).astype(_QDTYPE[kind])
    return xq, s


def qragged_dot(x: jax.Array, w: QArray, sizes: jax.Array) -> jax.Array:
    """jax.lax.ragged_dot(x [rows, in], w [experts, in, out], sizes) for stacked expert weights:
    rows grouped by expert (sizes[e] rows for expert e), each token quantized as in qmatmul, an
    8-bit ragged dot with a wide accumulator, rescaled by the row's expert's channel scales."""
    kind = w.kind
    xq, xs = _quantize_acts(x, kind, 1)
    acc = jax.lax.ragged_dot(xq[:, 0], w.q, sizes, preferred_element_type=jnp.int32 if kind == "int8" else jnp.float32)
    expert = jnp.searchsorted(jnp.cumsum(sizes), jnp.arange(x.shape[0]), side="right")      # [rows]
    scale = w.scale[jnp.minimum(expert, w.shape[0] - 1), 0]                                  # [rows, out]
    return (acc.astype(jnp.float32) * xs[:, 0] * scale).astype(x.dtype)


def qmatmul(x: jax.Array, w: QArray, out_dtype=None) -> jax.Array:
    """x [..., in] @ w -> [..., out] in out_dtype (default x's dtype): quantize x per token, an
    8-bit dot with a wide accumulator (s32 for int8, f32 for fp8), rescale in float32."""
    from mmjax.kernels import cpu_gemv
    if w.packed:
        if cpu_gemv.enabled():   # the whole product, any number of rows, in one kernel call
            from mmjax.packed_weights import rows_to_multiply
            rows = rows_to_multiply(math.prod(x.shape[:-1]))
            return _packed_qmatmul(x, w.q, w.scale, rows).astype(out_dtype or x.dtype)
        w = unpack(w)
    return _qmatmul(x, w, out_dtype)


@jax.custom_jvp
def _packed_qmatmul(x: jax.Array, q: jax.Array, scale: jax.Array, rows: jax.Array) -> jax.Array:
    """f32 [..., out]: the CPU kernel's product (of x's first `rows` rows; zeros after them),
    differentiable: its derivative is XLA's formula's over the unpacked weight (research code
    takes gradients of served steps)."""
    from mmjax.kernels import cpu_gemv
    return cpu_gemv.qmatmul_s8p(x, q, scale, rows)


@_packed_qmatmul.defjvp
def _packed_qmatmul_jvp(primals, tangents):
    x, q, scale, rows = primals
    dx, _, dscale, _ = tangents
    w = unpack(QArray(q, scale))
    ref = lambda x, scale: _qmatmul(x, QArray(w.q, scale), jnp.float32)    # noqa: E731
    return _packed_qmatmul(x, q, scale, rows), jax.jvp(ref, (x, scale), (dx, dscale))[1]


def _qmatmul(x: jax.Array, w: QArray, out_dtype=None) -> jax.Array:
    """qmatmul over an [in, out] weight with XLA's dots (or, for a few rows on the CPU, the
    row-major kernel's exact s32 dots)."""
    from mmjax.kernels import cpu_gemv
    kind = w.kind
    g = w.scale.shape[0]
    d_in, d_out = w.shape
    xq, xs = _quantize_acts(x, kind, g)
    acc_t = jnp.int32 if kind == "int8" else jnp.float32
    k = d_in // g
    # a few rows on the CPU: mmjax's kernel gives every group's exact s32 dot in one pass over
    # the weight (the same integers as the dots below, so the same result bit for bit)
    accs = cpu_gemv.gemv_s8(xq.reshape(*x.shape[:-1], d_in), w.q, g) if cpu_gemv.covers(x, w) else None
    y = None
    # groups: one 2-D dot per contiguous row block of the weight (a batched [g, k, out] dot
    # makes XLA:CPU copy / convert the weight every step; row slices of it are free views)
    for i in range(g):
        acc = accs[..., i, :] if accs is not None else jax.lax.dot_general(
            xq[..., i, :], w.q[i * k:(i + 1) * k], (((xq.ndim - 2,), (0,)), ((), ())),
            preferred_element_type=acc_t)                                   # [..., out]
        part = acc.astype(jnp.float32) * xs[..., i, :] * w.scale[i]
        y = part if y is None else y + part
    return y.astype(out_dtype or x.dtype)


def weight_bytes(params) -> int:
    """Bytes of every array leaf (a QArray counts its 8-bit values and scales)."""
    return int(sum(np.prod(x.shape) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(params)))


_SIDECAR = "mmjax_quantization.json"


def write_quantization(directory, quantize: str | None, group_size: int | None) -> None:
    """Record next to saved params how they are quantized (`read_quantization` restores it)."""
    import json
    from pathlib import Path
    if quantize is not None:
        (Path(directory) / _SIDECAR).write_text(json.dumps({"quantize": quantize, "group_size": group_size}))


def read_quantization(directory) -> dict | None:
    """{"quantize": kind, "group_size": n | None} for params saved quantized, else None."""
    import json
    from pathlib import Path
    f = Path(directory).absolute() / _SIDECAR
    return json.loads(f.read_text()) if f.is_file() else None


def abstract_quantized(x, kind: str, group_size: int | None = None) -> QArray:
    """The QArray `quantize_weight` makes of a float weight of x's shape, as ShapeDtypeStructs
    (orbax's restore target for a quantized saved copy)."""
    s = jax.ShapeDtypeStruct
    if len(x.shape) == 3:
        e, d_in, d_out = x.shape
        return QArray(s(x.shape, _QDTYPE[kind]), s((e, 1, d_out), jnp.float32), np.dtype(x.dtype))
    d_in, d_out = x.shape
    return QArray(s(x.shape, _QDTYPE[kind]), s((_groups(d_in, group_size), d_out), jnp.float32), np.dtype(x.dtype))
