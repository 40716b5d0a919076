"""CPU matmul kernels: x [M, K] @ W [K, N] with W f32, bf16 or int8 (cpu_gemv.cc; issues 25 and
28). Two forms:

* row-major (`gemv_f32` / `gemv_bf16` / `gemv_s8`): M <= 16 rows of a weight stored [in, out],
  read as stored at memory bandwidth. Why: XLA:CPU's own one-row dot converts a bf16 / int8
  weight to f32 / s32 on every call, and YNNPACK's library dot (reached with two or more rows)
  reads narrow weights far below the memory's bandwidth; in f32, XLA's dots at 2-16 rows read
  below it too.
* packed (`matmul_packed` for f32 / bf16, `qmatmul_s8p` for int8's whole W8A8 product): any M,
  over a weight re-laid at load into panels (`pack_panels`: 64 columns on an AVX-512 CPU, 16 on
  an AVX2 one; `pack_s8`: 64), applied by mmjax.packed_weights / mmjax.quant: one contiguous
  stream per panel, the dot instructions' operands as they lie; decode at the read bandwidth,
  prefill and encode level with or faster than XLA's dots.

On AMX-BF16 CPUs the packed f32 / bf16 products give the rows their caller names (`amx_rows`:
a prefill's prompt rows, encoders) to AMX tile dots (cpu_amx.cc; f32 split into three bf16 parts,
six products, f32 accuracy), several times the FMA units' rate for these compute-bound products
(figures: benchmarks/README.md).

Code paths (cpu_library.isa): AVX-512 FMA / BF16 / VNNI; AVX2 + FMA (the packed kernels only:
bf16 widened by shifts, int8 through vpsignb + vpmaddubsw + vpmaddwd); plain C++ loops, which
nothing calls outside the tests (`enabled()` needs a SIMD path). The work is split over XLA's
intra-op threads.
Built and registered with the other CPU kernels by mmjax/kernels/cpu_library.py (one warning
and XLA's dots where no compiler is found); only on the CPU (`enabled()` at trace time).
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from mmjax.kernels.cpu_library import VMAP as _VMAP
from mmjax.kernels.cpu_library import amx, available, enabled, isa, set_amx, set_isa, simd  # noqa: F401 (the module's API)

MAX_ROWS = 16                 # rows one call handles (the .cc's kMaxRows)


def _ffi_dot(target: str):
    """[M, K] @ [K, N] -> f32 [M, N] through `target`, differentiable: the derivative is the
    same product through XLA's dots (linear in each operand, so reverse mode transposes it), for
    research code that takes gradients of a served model's steps (saliency)."""
    @jax.custom_jvp
    def f(x, w):
        return jax.ffi.ffi_call(target, jax.ShapeDtypeStruct((x.shape[0], w.shape[1]), jnp.float32),
                                vmap_method=_VMAP)(x, w)
    f.defjvps(lambda dx, y, x, w: jnp.matmul(dx, w, preferred_element_type=jnp.float32),
              lambda dw, y, x, w: jnp.matmul(x, dw, preferred_element_type=jnp.float32))
    return f


_dot_bf16, _dot_f32 = _ffi_dot("mmjax_gemv_bf16"), _ffi_dot("mmjax_gemv_f32")


def gemv_bf16(x: jax.Array, w: jax.Array) -> jax.Array:
    """x bf16 [..., K] (at most MAX_ROWS rows) @ w bf16 [K, N] -> f32 [..., N]: f32 sums of the
    exact bf16 products (jnp.matmul(x, w, preferred_element_type=f32) up to summation order)."""
    m, k, n = math.prod(x.shape[:-1]), x.shape[-1], w.shape[1]
    return _dot_bf16(x.reshape(m, k), w).reshape(*x.shape[:-1], n)


def gemv_f32(x: jax.Array, w: jax.Array) -> jax.Array:
    """x f32 [..., K] (at most MAX_ROWS rows) @ w f32 [K, N] -> f32 [..., N] (x @ w up to
    summation order)."""
    m, k, n = math.prod(x.shape[:-1]), x.shape[-1], w.shape[1]
    return _dot_f32(x.reshape(m, k), w).reshape(*x.shape[:-1], n)


def gemv_s8(xq: jax.Array, w: jax.Array, groups: int = 1) -> jax.Array:
    """xq int8 [..., K] (at most MAX_ROWS rows) @ w int8 [K, N], one dot per block of K / groups
    rows -> int32 [..., groups, N]: exact integer sums, what an s8 x s8 -> s32 dot of each row
    block gives (wrapping the same way on overflow)."""
    m, k, n = math.prod(xq.shape[:-1]), xq.shape[-1], w.shape[1]
    y = jax.ffi.ffi_call("mmjax_gemv_s8", jax.ShapeDtypeStruct((m, groups, n), jnp.int32), vmap_method=_VMAP)(
        xq.reshape(m, k), w, groups=int(groups))
    return y.reshape(*xq.shape[:-1], groups, n)


def covers(x: jax.Array, w) -> bool:
    """Does the row-major kernel take x [..., K] @ w here? Trace-time answer: `enabled()` on the
    AVX-512 path (the row-major kernels have no AVX2 one: a CPU runner's weights are packed, and
    the packed kernels have both), 1..MAX_ROWS rows, and w a 2-D f32 / bf16 array with x of its
    dtype, or a 2-D int8 `mmjax.quant.QArray` (the int8 dot inside qmatmul). At these row counts
    it beats both XLA's one-row dot and YNNPACK's library dot in bf16 and int8, and XLA's f32
    dot up to about 8 rows (`python -m benchmarks.gemv`)."""
    from mmjax.quant import QArray
    rows = 1
    for d in x.shape[:-1]:
        rows *= d
    if not 1 <= rows <= MAX_ROWS or getattr(w, "ndim", 0) != 2:
        return False
    if isinstance(w, QArray):
        ok = w.q.dtype == jnp.int8
    else:
        ok = x.dtype == w.dtype and x.dtype in (jnp.bfloat16, jnp.float32)
    return ok and enabled() and isa() == "avx512"


def pack_s8(q) -> "np.ndarray":
    """int8 [K, N] (K a multiple of 4) -> the packed layout mmjax_qmatmul_s8p reads: uint8
    [ceil(N / 64), K / 4, 64, 4], panel p = columns 64p..64p+63 (zero-padded), each column's four
    consecutive rows adjacent, stored as w ^ 0x80 (host numpy, once at load)."""
    import numpy as np
    q = np.asarray(q)
    k, n = q.shape
    p = -(-n // 64)
    qp = np.zeros((k, p * 64), np.int8)
    qp[:, :n] = q
    packed = qp.reshape(k // 4, 4, p, 64).transpose(2, 0, 3, 1)
    return np.ascontiguousarray(packed).view(np.uint8) ^ np.uint8(0x80)


def panel_width() -> int:
    """Columns per panel of the packed f32 / bf16 layout for this CPU: 64 on the AVX-512 path (a
    panel step is four zmm operands, one 256-byte run), 16 on the AVX2 one (one 64-byte line: the
    AVX2 tiles are 16 columns wide). The kernel reads either; this is the fast one here."""
    return 64 if isa() == "avx512" else 16


def pack_panels(w, width: int | None = None) -> "np.ndarray":
    """f32 / bf16 [K, N] -> the packed layout mmjax_matmul_f32p / _bf16p read: [ceil(N / PW),
    ceil(K / R), PW, R] of w's dtype (PW = `width` columns a panel, 64 or 16, default
    `panel_width()`; R = 1 for f32, 2 for bf16), panel p = columns PW p .. PW p + PW - 1, each
    column's R consecutive rows adjacent (zero-padded; host numpy, once at load)."""
    import numpy as np
    width = panel_width() if width is None else width
    assert width in (16, 64), width
    w = np.asarray(w)
    k, n = w.shape
    r = 2 if w.dtype == jnp.bfloat16 else 1
    p, kp = -(-n // width), -(-k // r)
    wp = np.zeros((r * kp, p * width), w.dtype)
    wp[:k, :n] = w
    return np.ascontiguousarray(wp.reshape(kp, r, p, width).transpose(2, 0, 3, 1))


def _rows(rows, m: int) -> jax.Array:
    """The packed kernels' `rows` operand: int32 scalar, all m rows when None."""
    return jnp.asarray(m if rows is None else rows, jnp.int32).reshape(())


def matmul_packed(x: jax.Array, wp: jax.Array, n: int, rows: jax.Array | int | None = None,
                  amx_rows: jax.Array | int = 0) -> jax.Array:
    """x [M, K] @ a packed weight (`pack_panels`) of N columns, both f32 or both bf16 -> f32 [M,
    N], any M: the f32 dot / f32 sums of the exact bf16 products, up to summation order. rows
    (int32 scalar, default M): only x's first `rows` rows are multiplied, the later rows of the
    result are zeros. amx_rows (int32 scalar): x's first amx_rows rows go to the AMX path where
    `amx()` (AMX-BF16 tile dots; f32: six bf16 products a multiply, f32 accuracy; bf16: one, the
    exact products; another summation order either way), the others to the FMA / vdpbf16ps
    kernel; a row's bits depend only on its path, never on the rows beside it. Not
    differentiable itself: mmjax.packed_weights.matmul gives it XLA's derivative."""
    target = "mmjax_matmul_bf16p" if wp.dtype == jnp.bfloat16 else "mmjax_matmul_f32p"
    operand = jnp.stack([_rows(rows, x.shape[0]), jnp.asarray(amx_rows, jnp.int32).reshape(())])
    return jax.ffi.ffi_call(target, jax.ShapeDtypeStruct((x.shape[0], n), jnp.float32), vmap_method=_VMAP)(
        x, wp, operand)


def qmatmul_s8p(x: jax.Array, wp: jax.Array, scale: jax.Array, rows: jax.Array | int | None = None) -> jax.Array:
    """x f32 [..., K] @ a packed int8 weight (`pack_s8`) with its scales f32 [G, N] -> f32
    [..., N], any number of rows: mmjax.quant.qmatmul's W8A8 product in one call, the same bits
    per channel (x quantized per row and group of K / G: s = amax * f32(1 / 127), q =
    clip(round(x * (1 / s))); exact s32 dots; y = sum over groups in order of (float(dot) * s) *
    scale). rows: as matmul_packed's, over x's rows flattened. Not differentiable itself:
    quant.qmatmul wraps it with XLA's derivative."""
    m, k, n = math.prod(x.shape[:-1]), x.shape[-1], scale.shape[-1]
    y = jax.ffi.ffi_call("mmjax_qmatmul_s8p", jax.ShapeDtypeStruct((m, n), jnp.float32), vmap_method=_VMAP)(
        x.astype(jnp.float32).reshape(m, k), wp, scale, _rows(rows, m))
    return y.reshape(*x.shape[:-1], n)
