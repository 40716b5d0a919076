"""Weights re-laid for mmjax's CPU matmul kernels: f32 and bf16 weights in panels of 64 (AVX-512)
or 16 (AVX2) columns
(`PackedWeight`), int8 ones inside their `mmjax.quant.QArray` (`quant.pack`).

Why: a weight stored [in, out] is read by a matmul kernel as many short row streams that it must
interleave in registers; a panel is one contiguous run already in the operand order of the dot
instructions (FMA / vdpbf16ps / vpdpbusd). One kernel call then serves every number of rows:
decode streams the weight at the read bandwidth, and prefill / encode run faster than XLA's dots
on the [in, out] weight (benchmarks/README.md), so one packed copy is all a CPU runner keeps.

The packed form is the CPU runner's: `mmjax.load` packs a linear layer's weight on a CPU host
(kernels available) as it places it (`nn.weights.Weights`); a runner for another platform or a
mesh, `save_params` and `mmjax convert` take the [in, out] layout (`unpacked`,
`serving.placed_model.for_platform`), and a traced step that meets a packed weight without the
kernel (lowered for CUDA, kernels off) unpacks it inside the step.
"""
from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass, field
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

_PACKED_DTYPES = (np.dtype(np.float32), np.dtype(jnp.bfloat16))


@jax.tree_util.register_dataclass
@dataclass
class PackedWeight:
    """An f32 / bf16 [in, out] matmul weight packed for the CPU kernel: data [ceil(out / PW),
    ceil(in / R), PW, R] of the weight's dtype (PW = 64 columns a panel on AVX-512, 16 on AVX2; R
    = 1 for f32, 2 for bf16), panel p = columns PW p .. PW p + PW - 1 (zero-padded), each
    column's R consecutive rows adjacent
    (`mmjax.kernels.cpu_gemv.pack_panels`). `shape` / `ndim` / `dtype` report the logical weight,
    so model code that inspects a weight reads it as the array it stands for."""
    data: jax.Array
    d_in: int = field(metadata=dict(static=True))
    d_out: int = field(metadata=dict(static=True))

    @property
    def shape(self) -> tuple[int, int]:
        return (self.d_in, self.d_out)

    @property
    def ndim(self) -> int:
        return 2

    @property
    def dtype(self):
        return self.data.dtype

    def unpack(self) -> jax.Array:
        """[in, out] (jnp ops: also inside a traced step; numpy for host data)."""
        return _unpack(self.data, self.d_in, self.d_out)


def _unpack(data, d_in: int, d_out: int):
    p, kp, width, r = data.shape
    return data.transpose(1, 3, 0, 2).reshape(r * kp, width * p)[:d_in, :d_out]


def pack_weight(w) -> PackedWeight:
    """f32 / bf16 [in, out] -> PackedWeight (host numpy; the data placed as w was: numpy stays
    numpy)."""
    from mmjax.kernels.cpu_gemv import pack_panels
    data = pack_panels(np.asarray(w))
    return PackedWeight(data if isinstance(w, np.ndarray) else jnp.asarray(data), *w.shape)


def cpu_packs() -> bool:
    """Are weights kept packed here: the default backend is the CPU and the kernels build and run
    a SIMD path (`cpu_library.simd`)."""
    from mmjax.kernels import cpu_gemv
    return jax.default_backend() == "cpu" and cpu_gemv.simd()


def unpacked(tree):
    """`tree` (weights, an nnx.State, ...) with every packed weight in its [in, out] layout: f32 /
    bf16 PackedWeights as arrays, packed int8 QArrays as [in, out] ones (saving, research code
    that edits weights)."""
    from mmjax.quant import QArray, unpack

    def one(x):
        if isinstance(x, QArray):
            return unpack(x)
        return x.unpack() if isinstance(x, PackedWeight) else x
    return jax.tree.map(one, tree, is_leaf=lambda x: isinstance(x, (QArray, PackedWeight)))


_LEADING_ROWS: contextvars.ContextVar = contextvars.ContextVar("leading_rows", default=None)


@contextlib.contextmanager
def leading_rows(total: int, n: jax.Array | int, amx: jax.Array | int | None = None):
    """While a step is traced inside the block, the packed matmuls (f32, bf16, int8) whose input
    has `total` rows (flattened) multiply only its first `n` (int32 scalar, traced) and give
    zeros for the others: a prefill's rows past its tokens are its bucket's padding (a 230-token
    prompt in the 240-row bucket: the kernels' FMAs for 10 rows, 3% of the prefill's matmuls).
    The caller wraps only code whose `total`-row matmuls are over those token rows.

    amx: which rows the packed f32 / bf16 matmuls give to the AMX path (`cpu_gemv.amx()`; the
    same accuracy by another summation order): the first `amx` of the `total`-row matmuls (None: all), and
    none of any other matmul in the block. A step picks the path by what a row is, so a row's
    bits never depend on the rows beside it: the decode step gives AMX nothing, a prefill its
    prompt rows and not the decode rows riding in it (their bits are the decode step's)."""
    token = _LEADING_ROWS.set((total, n, n if amx is None else amx))
    try:
        yield
    finally:
        _LEADING_ROWS.reset(token)


def fma_only():
    """A block whose packed f32 / bf16 matmuls all take the FMA kernel (`leading_rows` with no rows of
    its own): the decode step and the LM heads of a prefill, whose rows are decode rows or must
    match them."""
    return leading_rows(-1, 0, amx=0)


def rows_to_multiply(m: int) -> jax.Array:
    """The `rows` operand of a packed matmul over m rows: the traced count inside
    `leading_rows(m, n)`, else all m."""
    ctx = _LEADING_ROWS.get()
    return ctx[1] if ctx is not None and ctx[0] == m else jnp.int32(m)


def amx_rows(m: int) -> jax.Array | int:
    """How many leading rows of a packed f32 / bf16 matmul over m rows go to the AMX path: inside
    `leading_rows`, its choice; elsewhere (encoders, research code calling a forward) all of them
    from more than `cpu_gemv.MAX_ROWS` rows on (AMX pays for converting each weight block once
    over many rows; a few rows stream the weight faster through the FMAs), none below."""
    from mmjax.kernels.cpu_gemv import MAX_ROWS
    ctx = _LEADING_ROWS.get()
    if ctx is None:
        return m if m > MAX_ROWS else 0
    return ctx[2] if ctx[0] == m else 0


def matmul(x: jax.Array, w: PackedWeight) -> jax.Array:
    """x [..., in] (w's dtype) @ w -> f32 [..., out] through the kernel, any number of rows (the
    f32 dot / f32 sums of the exact bf16 products, up to summation order)."""
    m = 1
    for d in x.shape[:-1]:
        m *= d
    y = _matmul(x.reshape(m, w.d_in), w.data, rows_to_multiply(m), jnp.asarray(amx_rows(m), jnp.int32), w.d_out)
    return y.reshape(*x.shape[:-1], w.d_out)


# differentiable for research code (gradients through a served model's steps): the derivative
# is XLA's dots over the unpacked weight (the product is linear in each operand)
@partial(jax.custom_jvp, nondiff_argnums=(4,))
def _matmul(x: jax.Array, data: jax.Array, rows: jax.Array, amx: jax.Array, d_out: int) -> jax.Array:
    from mmjax.kernels import cpu_gemv
    return cpu_gemv.matmul_packed(x, data, d_out, rows, amx)


@_matmul.defjvp
def _matmul_jvp(d_out, primals, tangents):
    x, data, rows, amx = primals
    dx, ddata, _, _ = tangents
    d_in = x.shape[-1]
    dot = lambda a, b: jnp.matmul(a, b, preferred_element_type=jnp.float32)   # noqa: E731
    return (_matmul(x, data, rows, amx, d_out),
            dot(dx, _unpack(data, d_in, d_out)) + dot(x, _unpack(ddata, d_in, d_out)))
