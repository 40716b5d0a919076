"""mmjax's CPU matmul kernel for few-row f32 / bf16 / int8 matmuls (mmjax.kernels.cpu_gemv,
issues 25 and 28):

* the kernel against numpy: f32 and bf16 products summed in f32 (against float64,
  within the rounding of an f32 sum), int8 per-group integer sums exactly, each row's result the same bit
  for bit whatever rows are beside it, at 1 and 16 rows, odd K / N (not multiples of the
  kernel's tiles), groups whose size is not a multiple of 4, inside jit / lax.scan / lax.cond /
  vmap; on every code path the CPU runs (plain C++, AVX2, AVX-512);
* the packed int8 layout (`pack_s8`, a CPU runner's int8 weights) at any number of rows, exact;
  the packed f32 / bf16 layout (`pack_panels`, a CPU runner's f32 / bf16 weights) at any number of rows;
* wired in: layers.matmul / quant.qmatmul take it for few rows on the CPU (packed int8, f32 and bf16:
  any rows), with int8 results identical bit for bit to XLA's s8 dots (per channel and grouped),
  and never when tracing for CUDA or inside a step sharded over a mesh (a packed weight is
  unpacked in the step there); no compiler: one warning, XLA's dots.
"""
from __future__ import annotations

import dataclasses
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import kernel_path, rel_err
from mmjax.backend import compiling_for, cpu_kernels, tuning
from mmjax.kernels import cpu_gemv, cpu_library
from mmjax.models.nn.linear import matmul
from mmjax.packed_weights import PackedWeight, pack_weight
from mmjax import quant
from mmjax.quant import quantize_weight


def _bf16(rng, *shape):
    return jnp.asarray(rng.standard_normal(shape), jnp.bfloat16)


def _f32(rng, *shape):
    return jnp.asarray(rng.standard_normal(shape), jnp.float32)


def _s8(rng, *shape):
    return jnp.asarray(rng.integers(-127, 128, shape), jnp.int8)


def _s8_want(xq, w, groups: int) -> np.ndarray:
    """[M, K] int8 @ [K, N] int8 per block of K / groups rows -> [M, groups, N] (int64, exact)."""
    x, w = np.asarray(xq, np.int64), np.asarray(w, np.int64)
    k = x.shape[1] // groups
    return np.stack([x[:, i * k:(i + 1) * k] @ w[i * k:(i + 1) * k] for i in range(groups)], 1)


def _qmatmul_want(x: np.ndarray, wq, scale: np.ndarray) -> np.ndarray:
    """mmjax.quant.qmatmul's W8A8 formula in numpy float32 (int64 dots): x [M, K] f32, wq int8
    [K, N], scale [G, N] -> [M, N]."""
    m, k = x.shape
    g = scale.shape[0]
    xg = x.reshape(m, g, k // g)
    amax = np.abs(xg).max(-1, keepdims=True)
    s = np.where(amax > 0, amax * np.float32(1.0 / 127.0), np.float32(1.0)).astype(np.float32)
    xq = np.clip(np.rint(xg * (np.float32(1.0) / s)), -127, 127).astype(np.int8).reshape(m, k)
    acc = _s8_want(xq, wq, g).astype(np.int32).astype(np.float32)          # [M, G, N]
    y = None
    for i in range(g):
        part = acc[:, i] * s[:, i] * scale[i]
        y = part if y is None else y + part
    return y


def assert_f32_sum_error(got, want, x, w, what) -> None:
    """got (x @ w summed in f32, the products exact or rounded once) within 2 sqrt(K) f32 ulps
    of sum |x_k w_k| of want (float64), per element: the rounding of K additions is a random walk
    of K steps of at most an ulp of the partial sum, so this holds with a wide margin however the
    sum is ordered, and a lost or doubled term (an error of a whole |x_k w_k|, ~sqrt(K) times
    more at K >= 64) fails it. Not a multiple of XLA's own dot's error: that moves with the
    machine's library (oneDNN on AMX sums bf16 more accurately than one FMA chain)."""
    x64, w64 = np.asarray(x, np.float64), np.asarray(w, np.float64)
    bound = 2 * np.sqrt(x64.shape[1]) * 2.0 ** -24 * (np.abs(x64) @ np.abs(w64))
    err = np.abs(np.asarray(got, np.float64) - want)
    assert np.all(err <= bound), (what, float((err / np.maximum(bound, 1e-300)).max()))


def test_kernel_equals_reference():
    assert cpu_gemv.available()
    rng = np.random.default_rng(0)
    bf16, f32 = jax.jit(cpu_gemv.gemv_bf16), jax.jit(cpu_gemv.gemv_f32)
    s8 = jax.jit(cpu_gemv.gemv_s8, static_argnums=2)
    for path in cpu_library.isas():          # every code path this CPU runs
        with kernel_path(path):
            # (rows, K, N, groups): N below / across the 32- and 64-column tiles and split over
            # threads, odd K, groups of a size not a multiple of 4, each register-block size of rows;
            # up to 4 rows with enough K the weight's rows are split over threads (partial sums
            # added): odd K, a part ending inside a group, a last quad / pair cut short
            for m, k, n, g in ((1, 77, 1000, 1), (16, 130, 531, 2), (3, 96, 70, 3), (8, 1030, 4160, 5),
                               (1, 256, 8300, 2), (16, 9, 1, 1), (2, 1001, 300, 1), (4, 2050, 129, 2),
                               (1, 3000, 2000, 3)):
                for kernel, cast in ((bf16, _bf16), (f32, _f32)):
                    x, w = cast(rng, m, k), cast(rng, k, n)
                    got = np.asarray(kernel(x, w))
                    want = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
                    assert got.dtype == np.float32 and got.shape == (m, n)
                    # f32 sums (of exact products for bf16): within f32 rounding of float64
                    assert_f32_sum_error(got, want, x, w, (m, k, n, x.dtype))
                    # batch invariance: each row alone gives the same bits as in the batch
                    for i in {0, m - 1}:
                        np.testing.assert_array_equal(np.asarray(kernel(x[i:i + 1], w)), got[i:i + 1])
                xq, wq = _s8(rng, m, k - k % g), _s8(rng, k - k % g, n)
                np.testing.assert_array_equal(np.asarray(s8(xq, wq, g)), _s8_want(xq, wq, g))
            # extreme values: sums beyond 2^24 (where f32 accumulation would round) stay exact
            xq, wq = jnp.full((2, 4099), -127, jnp.int8), jnp.full((4099, 67), -127, jnp.int8)
            np.testing.assert_array_equal(np.asarray(s8(xq, wq, 1)), _s8_want(xq, wq, 1))
            # the packed int8 layout (mmjax_qmatmul_s8p, what a CPU runner's int8 weights are): the
            # whole W8A8 product at any number of rows (decode, prefill and encode sizes: register
            # blocks of 6 rows and a remainder, 64-quad blocks of a group and a shorter last one; AVX2: one row over a panel's 8 vectors, two over
            # 4, more over 2; rows quantized on the threads from 2^16 elements),
            # N cut inside a 64-column panel, groups, panels split over threads: the same bits as
            # numpy's float32 evaluation of mmjax.quant.qmatmul's formula
            s8p = jax.jit(cpu_gemv.qmatmul_s8p)
            for m, k, n, g in ((1, 4, 1, 1), (1, 1024, 1000, 1), (7, 96, 70, 3), (16, 2048, 129, 2),
                               (37, 256, 640, 4), (3, 1000, 8300, 2), (13, 64, 64, 1), (70, 1024, 200, 2),
                               (2, 512, 100, 2), (200, 1000, 96, 2)):
                x, wq = rng.standard_normal((m, k)).astype(np.float32), _s8(rng, k, n)
                x[0, :k // g] = 0.0                      # a group of zeros: scale 1
                x[-1, -1] = 1e4                          # an outlier
                scale = np.abs(rng.standard_normal((g, n))).astype(np.float32) / 100
                wp = cpu_gemv.pack_s8(wq)
                assert wp.dtype == np.uint8 and wp.shape == (-(-n // 64), k // 4, 64, 4)
                got = np.asarray(s8p(jnp.asarray(x), jnp.asarray(wp), jnp.asarray(scale)))
                np.testing.assert_array_equal(got, _qmatmul_want(x, wq, scale))
                np.testing.assert_array_equal(np.asarray(s8p(jnp.asarray(x[m - 1:]), jnp.asarray(wp), jnp.asarray(scale))),
                                              got[m - 1:])
                # rows: only the leading rows are multiplied (their bits unchanged), zeros after
                for r in {0, m // 2, m - 1} | ({m + 3} if m < 9 else set()):
                    part = np.asarray(s8p(jnp.asarray(x), jnp.asarray(wp), jnp.asarray(scale), jnp.int32(r)))
                    np.testing.assert_array_equal(part[:r], got[:r])
                    assert not part[r:].any(), (m, k, n, r)
            # the packed f32 / bf16 layouts (mmjax_matmul_f32p / _bf16p, what a CPU runner's f32 /
            # bf16 weights are), in 64- and 16-column panels (AVX-512's and AVX2's; every path reads
            # both): any number of rows (AVX-512: register blocks of 6 and row blocks of 192 across
            # several panels; AVX2: tiles of 1 x 8, 2 x 4 and 6 / 4 x 2 vectors over all of K, rows
            # in balanced groups), odd K (bf16: x's last pair completed by a zero), N cut inside a panel,
            # panels split over threads
            assert cpu_gemv.panel_width() == (64 if path == "avx512" else 16)
            packed = jax.jit(cpu_gemv.matmul_packed, static_argnums=2)
            nonzero = 0
            for m, k, n in ((1, 2, 1), (1, 1024, 1000), (2, 600, 100), (7, 97, 70), (16, 2048, 129), (37, 256, 640),
                            (3, 1001, 8300), (200, 64, 64), (70, 1023, 200)):
                for (cast, r), width in itertools.product(((_bf16, 2), (_f32, 1)), (16, 64)):
                    x, w = cast(rng, m, k), cast(rng, k, n)
                    wp = cpu_gemv.pack_panels(w, width)
                    assert wp.dtype == w.dtype and wp.shape == (-(-n // width), -(-k // r), width, r)
                    got = np.asarray(packed(x, jnp.asarray(wp), n))
                    want = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
                    assert got.dtype == np.float32 and got.shape == (m, n)
                    assert_f32_sum_error(got, want, x, w, (m, k, n, x.dtype, width))
                    for i in {0, m - 1}:
                        np.testing.assert_array_equal(np.asarray(packed(x[i:i + 1], jnp.asarray(wp), n)), got[i:i + 1])
                    # rows (a prefill's padding): the leading rows' bits unchanged, zeros after
                    # them (a count past M takes all M)
                    for r in {0, m // 2, m - 1, m + 5}:
                        part = np.asarray(packed(x, jnp.asarray(wp), n, jnp.int32(r)))
                        np.testing.assert_array_equal(part[:r], got[:r])
                        assert not part[r:].any(), (m, k, n, r)
                        nonzero += int(np.count_nonzero(got[r:]))
            assert nonzero > 0      # the zeros above replaced values that were not zeros

    # leading dims, inside scan / cond / vmap
    x, w, xq, wq = _bf16(rng, 2, 3, 64), _bf16(rng, 64, 96), _s8(rng, 4, 64), _s8(rng, 64, 96)
    np.testing.assert_array_equal(cpu_gemv.gemv_bf16(x, w), cpu_gemv.gemv_bf16(x.reshape(6, 64), w).reshape(2, 3, 96))

    def body(c, xs):
        y = jax.lax.cond(xs[0, 0] > 0, lambda: cpu_gemv.gemv_s8(xs, wq, 2), lambda: -cpu_gemv.gemv_s8(xs, wq, 2))
        return c + y.sum(), y
    _, ys = jax.jit(lambda xs: jax.lax.scan(body, jnp.int32(0), xs))(xq.reshape(2, 2, 64))
    want = _s8_want(xq, wq, 2).reshape(2, 2, 2, 96) * np.where(np.asarray(xq)[::2, 0] > 0, 1, -1)[:, None, None, None]
    np.testing.assert_array_equal(ys, want)
    np.testing.assert_array_equal(jax.jit(jax.vmap(lambda a: cpu_gemv.gemv_s8(a, wq)))(xq.reshape(2, 2, 64)),
                                  _s8_want(xq, wq, 1).reshape(2, 2, 1, 96))


def test_matmul_takes_the_kernel_on_cpu_only(monkeypatch, tmp_path):
    """int8 through layers.matmul equals XLA's s8 dots bit for bit (1 row, 16 rows, 3-D
    activations, groups); f32 and bf16 equal XLA's f32-result dots up to summation order; beyond
    16 rows (row-major kernels; packed ones: any rows), on the AVX2 path (row-major kernels), for
    CUDA, sharded, or with no compiler, XLA's dots."""
    rng = np.random.default_rng(1)
    wf = rng.standard_normal((96, 130)).astype(np.float32)
    wb = jnp.asarray(wf, jnp.bfloat16)

    def run(x, w, out_dtype=None):
        """(result, lowered text) of matmul, traced afresh (the kernel choice is made at trace time)."""
        f = jax.jit(lambda x, w: matmul(x, w, out_dtype))
        return f(x, w), f.lower(x, w).as_text()

    for shape in ((1, 96), (16, 96), (2, 3, 96), (17, 96)):
        x = jnp.asarray(rng.standard_normal(shape), jnp.float32)
        # the row-major kernels: up to 16 rows, on the AVX-512 path (they have no AVX2 one)
        taken = int(np.prod(shape[:-1])) <= cpu_gemv.MAX_ROWS and cpu_gemv.isa() == "avx512"
        for gs in (None, 32):
            w = quantize_weight(wf, "int8", gs)
            got, text = run(x, w)
            assert ("mmjax_gemv_s8" in text) == taken
            with cpu_kernels(False):
                want, text = run(x, w)
            assert "mmjax_gemv" not in text
            np.testing.assert_array_equal(got, want)
            # packed (what mmjax.load gives on a CPU host): the kernel at any number of rows, the
            # same bits per channel; with groups within an ulp (XLA:CPU's LLVM backend contracts
            # the group sum's multiply-adds into FMAs at -O2, not at the tests' -O0, conftest;
            # the kernel rounds each product as written); where the
            # kernel is off, the weight is unpacked inside the step
            wp = quant.pack(w)
            assert wp.packed and wp.shape == w.shape and quant.pack(wp) is wp
            np.testing.assert_array_equal(quant.unpack(wp).q, w.q)
            np.testing.assert_array_equal(jax.jit(quant.unpack)(wp).q, w.q)
            got, text = run(x, wp)
            assert "mmjax_qmatmul_s8p" in text and "mmjax_gemv" not in text
            if gs is None:
                np.testing.assert_array_equal(got, want)
            else:
                assert rel_err(got, want) < 1e-6
            with cpu_kernels(False):
                got, text = run(x, wp)
            assert "mmjax_" not in text
            np.testing.assert_array_equal(got, want)
        xb = x.astype(jnp.bfloat16)
        got, text = run(xb, wb, jnp.float32)
        assert ("mmjax_gemv_bf16" in text) == taken
        with cpu_kernels(False):
            want = run(xb, wb, jnp.float32)[0]
        assert rel_err(got, want) < 1e-6
        # packed f32 / bf16 (what mmjax.load gives on a CPU host): the kernel at any number of
        # rows; where the kernel is off, the weight is unpacked inside the step
        for xp, w, out in ((xb, wb, jnp.float32), (x, jnp.asarray(wf), None)):
            with cpu_kernels(False):
                want = run(xp, w, out)[0]
            wp = pack_weight(w)
            assert wp.shape == w.shape and wp.dtype == w.dtype and wp.ndim == 2
            np.testing.assert_array_equal(wp.unpack(), w)
            np.testing.assert_array_equal(jax.jit(lambda w: w.unpack())(wp), w)
            got, text = run(xp, wp, out)
            assert "mmjax_matmul_" in text and "mmjax_gemv" not in text
            assert got.dtype == want.dtype and rel_err(got, want) < 1e-6
            with cpu_kernels(False):
                got, text = run(xp, wp, out)
            assert "mmjax_" not in text and rel_err(got, want) < 1e-6
        assert run(xb, pack_weight(wb))[0].dtype == jnp.bfloat16
        got, text = run(x, jnp.asarray(wf))
        assert ("mmjax_gemv_f32" in text) == taken and got.dtype == jnp.float32
        with cpu_kernels(False):
            want, text = run(x, jnp.asarray(wf))
        assert "mmjax_gemv" not in text and rel_err(got, want) < 1e-6
    assert run(xb, wb)[0].dtype == jnp.bfloat16
    # never for CUDA (tests/test_cuda_lowering.py exports whole steps) nor under a mesh
    x = jnp.ones((1, 96), jnp.bfloat16)
    with compiling_for("cuda"):
        assert "mmjax_gemv" not in jax.jit(lambda x, w: matmul(x, w)).lower(x, wb).as_text()
        assert "mmjax_" not in jax.jit(lambda x, w: matmul(x, w)).lower(x, pack_weight(wb)).as_text()
    sharded = dataclasses.replace(tuning("cpu"), sharded=True)
    assert "mmjax_gemv" not in jax.jit(sharded.traced(lambda x, w: matmul(x, w))).lower(x, wb).as_text()
    assert ("mmjax_gemv" in jax.jit(tuning("cpu").traced(lambda x, w: matmul(x, w))).lower(x, wb).as_text()) == (
        cpu_gemv.isa() == "avx512")
    assert "mmjax_matmul_bf16p" in jax.jit(tuning("cpu").traced(lambda x, w: matmul(x, w))).lower(x, pack_weight(wb)).as_text()
    # no compiler: one warning, XLA's dots
    monkeypatch.setattr(cpu_library, "_state", {})
    monkeypatch.setenv("CXX", "no-such-compiler")
    monkeypatch.setenv("MMJAX_KERNEL_CACHE", str(tmp_path))
    with pytest.warns(RuntimeWarning, match="no C.. compiler"):
        assert not cpu_gemv.available()
    got, text = run(x, wb)
    assert "mmjax_gemv" not in text
    np.testing.assert_array_equal(got, jnp.matmul(x, wb, preferred_element_type=jnp.float32).astype(jnp.bfloat16))


def test_kernel_calls_differentiate():
    """Gradients through a kernel call (research code differentiates served steps: saliency)
    equal those through XLA's dots, in both operands, for f32 and bf16; jvp too; and through the
    packed int8 product."""
    rng = np.random.default_rng(2)
    for dtype in (jnp.float32, jnp.bfloat16):
        x = jnp.asarray(rng.standard_normal((3, 96)), dtype)
        w = jnp.asarray(rng.standard_normal((96, 130)) * 0.1, dtype)

        kernel = cpu_gemv.gemv_f32 if dtype == jnp.float32 else cpu_gemv.gemv_bf16

        def loss(x, w):        # the row-major kernel's call itself (layers.matmul takes it on AVX-512 only)
            return jnp.sin(kernel(x, w)).sum()

        def xla_loss(x, w):
            return jnp.sin(jnp.matmul(x, w, preferred_element_type=jnp.float32)).sum()
        grad = jax.jit(jax.grad(loss, argnums=(0, 1)))
        assert "mmjax_gemv" in grad.lower(x, w).as_text()
        got = grad(x, w)
        want = jax.jit(jax.grad(xla_loss, argnums=(0, 1)))(x, w)
        _, want_t = jax.jvp(xla_loss, (x, w), (x, w))
        for g, h in zip(got, want):
            tol = 1e-5 if dtype == jnp.float32 else 1e-2      # bf16 gradients are rounded to bf16
            assert g.dtype == h.dtype and rel_err(g.astype(jnp.float32), h.astype(jnp.float32)) < tol
        _, got_t = jax.jvp(loss, (x, w), (x, w))
        assert abs(float(got_t) - float(want_t)) <= 1e-3 * max(1.0, abs(float(want_t)))
    # a packed f32 / bf16 weight: XLA's dots' derivative, in the activations and the packed
    # weight (its gradient in the packed layout: unpacked, the [in, out] one's)
    for dtype, tol in ((jnp.float32, 1e-5), (jnp.bfloat16, 1e-2)):
        x = jnp.asarray(rng.standard_normal((5, 96)), dtype)
        w = jnp.asarray(rng.standard_normal((96, 130)) * 0.1, dtype)
        loss = lambda x, w: jnp.sin(matmul(x, w, jnp.float32)).sum()          # noqa: E731
        grad = jax.jit(jax.grad(loss, argnums=(0, 1)))
        assert "mmjax_matmul_" in grad.lower(x, pack_weight(w)).as_text()
        gx, gw = grad(x, pack_weight(w))
        with cpu_kernels(False):
            want = jax.grad(loss, argnums=(0, 1))(x, w)
        assert isinstance(gw, PackedWeight)
        for g, h in zip((gx, gw.unpack()), want):
            assert g.dtype == h.dtype and rel_err(g.astype(jnp.float32), h.astype(jnp.float32)) < tol
    # a packed int8 weight (the kernel's whole W8A8 product): XLA's formula's derivative, in the
    # activations (through the per-token scale) and the weight scales
    w = quant.pack(quantize_weight(rng.standard_normal((96, 130)).astype(np.float32), "int8"))
    x = jnp.asarray(rng.standard_normal((3, 96)), jnp.float32)

    def qloss(x, scale):
        return jnp.sin(matmul(x, quant.QArray(w.q, scale), jnp.float32)).sum()
    grad = jax.jit(jax.grad(qloss, argnums=(0, 1)))
    assert "mmjax_qmatmul_s8p" in grad.lower(x, w.scale).as_text()
    got = grad(x, w.scale)
    with cpu_kernels(False):
        want = jax.jit(jax.grad(qloss, argnums=(0, 1)))(x, w.scale)
    assert all(rel_err(g, h) < 1e-5 and float(jnp.abs(h).max()) > 0 for g, h in zip(got, want))


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            return next((set(line.split(":", 1)[1].split()) for line in f if line.startswith("flags")), set())
    except OSError:
        return set()


def test_packed_amx_path():
    """The packed products' AMX path (cpu_amx.cc): f32 split into three bf16 parts, six tile-dot
    products, within an f32 sum's error of float64 (plus the three dropped products, each under
    2^-24 |x w|), more accurate than the FMA kernel's bound; bf16 one tile dot a product, within
    the f32 sum's error of the exact products; every row the same bits alone as in any batch;
    the rows the caller gives it (amx_rows) and no others, the rest the FMA / vdpbf16ps kernel's
    bits exactly; padding rows zero; off (set_amx) or on a CPU without AMX, the FMA kernel's
    bits. The AMX path is taken where the CPU lists amx_bf16 (the OS on this project's machines
    grants the tile state), so on such a machine the test cannot pass on FMAs alone."""
    assert cpu_gemv.available()
    on = cpu_gemv.amx()
    flags = _cpu_flags()
    if cpu_gemv.isa() == "avx512" and {"amx_bf16", "amx_tile"} <= flags:
        assert on, "the CPU lists AMX-BF16 but the kernels do not use it"
    if not {"amx_bf16", "amx_tile"} <= flags:
        assert not on
    rng = np.random.default_rng(5)
    packed = jax.jit(cpu_gemv.matmul_packed, static_argnums=2)
    for cast, extra in ((_f32, 3), (_bf16, 0)):
        differs = 0
        # rows across the 32-row tiles and the 512-row blocks; K across the 32-column steps and
        # the 128-row weight blocks (odd, short); N cut inside a panel and groups of fewer than 4
        # panels
        for m, k, n in ((1, 2, 1), (5, 100, 70), (37, 301, 200), (16, 2048, 129), (70, 1023, 200),
                        (33, 130, 700), (600, 64, 70), (250, 257, 330)):
            x, w = cast(rng, m, k), cast(rng, k, n)
            wp = jnp.asarray(cpu_gemv.pack_panels(w, 64))
            fma = np.asarray(packed(x, wp, n, None, 0))
            got = np.asarray(packed(x, wp, n, None, m))
            want = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
            scale = np.abs(np.asarray(x, np.float64)) @ np.abs(np.asarray(w, np.float64))
            err = np.abs(got.astype(np.float64) - want)
            assert np.all(err <= (extra + 2 * np.sqrt(k)) * 2.0 ** -24 * scale), (
                m, k, n, x.dtype, float((err / scale).max()))
            differs += int(np.count_nonzero(got != fma))
            # batch invariance: the first and last rows alone, the same bits
            for i in {0, m - 1}:
                np.testing.assert_array_equal(np.asarray(packed(x[i:i + 1], wp, n, None, 1)), got[i:i + 1])
            # a split: rows [0, a) AMX's bits, [a, rows) the FMA kernel's, zeros past rows
            for a, r in {(m // 2, m), (m // 3, m - 1), (0, m), (m, m // 2)}:
                part = np.asarray(packed(x, wp, n, jnp.int32(r), jnp.int32(a)))
                a = min(a, r)
                np.testing.assert_array_equal(part[:a], got[:a])
                np.testing.assert_array_equal(part[a:r], fma[a:r])
                assert not part[r:].any()
            # forbidden: the FMA kernel's bits whatever amx_rows says
            assert not cpu_gemv.set_amx(False)
            try:
                np.testing.assert_array_equal(np.asarray(packed(x, wp, n, None, m)), fma)
            finally:
                assert cpu_gemv.set_amx(True) == on
        # the AMX path ran (its sums are ordered otherwise) exactly where it is on
        assert (differs > 0) == on, (x.dtype, differs)


def test_amx_rows_follow_the_step():
    """packed_weights.amx_rows: outside any step all rows of a matmul of more than MAX_ROWS rows
    (encoders, research forwards), none below; inside leading_rows the step's choice for its
    token rows and none for other matmuls; fma_only none. Traced into the kernel call's operand."""
    from mmjax import packed_weights as pw
    assert pw.amx_rows(17) == 17 and pw.amx_rows(16) == 0 and pw.amx_rows(1) == 0
    with pw.leading_rows(40, 30, amx=12):
        assert pw.amx_rows(40) == 12 and pw.amx_rows(17) == 0
        assert int(pw.rows_to_multiply(40)) == 30
    with pw.leading_rows(40, 30):
        assert pw.amx_rows(40) == 30 and pw.amx_rows(64) == 0
    with pw.fma_only():
        assert pw.amx_rows(300) == 0 and int(pw.rows_to_multiply(300)) == 300
    rng = np.random.default_rng(6)
    x, w = _f32(rng, 40, 96), pack_weight(_f32(rng, 96, 130))

    def f(x, w, a):
        with pw.leading_rows(40, 40, amx=a):
            return matmul(x, w)
    whole, fma = jax.jit(f)(x, w, 40), jax.jit(f)(x, w, 0)
    mixed = jax.jit(f)(x, w, 25)
    np.testing.assert_array_equal(mixed[:25], whole[:25])
    np.testing.assert_array_equal(mixed[25:], fma[25:])
    np.testing.assert_array_equal(jax.jit(lambda x, w: matmul(x, w))(x, w), whole)   # default: all 40


def test_kernel_build_says_so_in_one_line(tmp_path, monkeypatch, caplog, capfd):
    """A build of the CPU kernels (a fake compiler here: the real one takes about a minute) is one
    INFO line on the mmjax.progress logger naming the compiler and the cache directory; a cached
    library says nothing; by default (no logging set up, no verbose=) nothing reaches the terminal."""
    import logging

    fake = tmp_path / "fake-cxx"
    fake.write_text('#!/bin/sh\nif [ "$1" = --version ]; then echo "fake-cxx 1.0"; exit 0; fi\n'
                    'while [ $# -gt 0 ]; do if [ "$1" = -o ]; then : > "$2"; fi; shift; done\n')
    fake.chmod(0o755)
    monkeypatch.setenv("CXX", str(fake))
    monkeypatch.setenv("MMJAX_KERNEL_CACHE", str(tmp_path / "quiet"))
    cpu_library._build()
    assert capfd.readouterr().err == "" and not [r for r in caplog.records if r.name == "mmjax.progress"]
    monkeypatch.setenv("MMJAX_KERNEL_CACHE", str(tmp_path / "kernels"))
    with caplog.at_level(logging.INFO, logger="mmjax.progress"):
        built = cpu_library._build()
        again = cpu_library._build()
    lines = [r.getMessage() for r in caplog.records if r.name == "mmjax.progress" and r.levelno == logging.INFO]
    assert built == again and built.is_file() and built.parent == tmp_path / "kernels"
    assert len(lines) == 1 and str(fake) in lines[0] and str(tmp_path / "kernels") in lines[0], lines
