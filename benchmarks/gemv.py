"""Decode's weight matmuls alone: mmjax's CPU kernel (mmjax.kernels.cpu_gemv) vs XLA's dots.

    python -m benchmarks.gemv [--rows 1 8] [--shapes 1024x32000 2048x8192] [--repeat 5]

For each [rows, K] @ [K, N]: XLA's f32 dot (decode's f32 compiler options), the bf16 and int8
paths without the kernel (one row run as two on YNNPACK: `layers.one_row_as_two`, decode's
narrow-weight options) and the kernel's bf16 and int8 calls. Median of `--repeat` runs of 20
calls, ms and weight GB/s (bytes of the weight / time). Prints a table and one JSON line. Run it
alone on the machine (DESIGN.md "Performance method").
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from mmjax.backend import _CPU_DECODE_OPTIONS, _CPU_DECODE_OPTIONS_NARROW
from mmjax.kernels import cpu_gemv


def _time(f, *args, repeat: int, calls: int = 20) -> float:
    f(*args).block_until_ready()
    runs = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        for _ in range(calls):
            r = f(*args)
        r.block_until_ready()
        runs.append((time.perf_counter() - t0) / calls)
    return statistics.median(runs)


def _xla_dot(acc_dtype):
    """x @ w with XLA's dot (a single row run as two rows, as decode does without the kernel)."""
    def f(x, w):
        rows = x.shape[0]
        xx = jnp.broadcast_to(x, (2, x.shape[1])) if rows == 1 else x
        y = jax.lax.dot_general(xx, w, (((1,), (0,)), ((), ())), preferred_element_type=acc_dtype)
        return y[:rows]
    return f


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--shapes", nargs="+", default=["1024x32000", "2048x8192"])
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args(argv)
    if not cpu_gemv.available():
        raise SystemExit("the CPU kernel is unavailable (see the warning above)")
    rng = np.random.default_rng(0)
    rows_out = []
    for shape in args.shapes:
        k, n = (int(v) for v in shape.split("x"))
        wf = jnp.asarray(rng.standard_normal((k, n)) * 0.02, jnp.float32)
        wb, wq = wf.astype(jnp.bfloat16), jnp.asarray(rng.integers(-127, 128, (k, n)), jnp.int8)
        for m in args.rows:
            x = jnp.asarray(rng.standard_normal((m, k)), jnp.float32)
            xb, xq = x.astype(jnp.bfloat16), jnp.asarray(rng.integers(-127, 128, (m, k)), jnp.int8)
            cases = {
                "f32 xla": (jax.jit(lambda x, w: x @ w, compiler_options=_CPU_DECODE_OPTIONS), x, wf),
                "bf16 xla": (jax.jit(_xla_dot(jnp.float32), compiler_options=_CPU_DECODE_OPTIONS_NARROW), xb, wb),
                "bf16 kernel": (jax.jit(cpu_gemv.gemv_bf16), xb, wb),
                "int8 xla": (jax.jit(_xla_dot(jnp.int32), compiler_options=_CPU_DECODE_OPTIONS_NARROW), xq, wq),
                "int8 kernel": (jax.jit(lambda x, w: cpu_gemv.gemv_s8(x, w)), xq, wq),
            }
            for name, (f, a, w) in cases.items():
                s = _time(f, a, w, repeat=args.repeat)
                rows_out.append({"shape": f"[{m},{k}]x[{k},{n}]", "path": name, "ms": round(s * 1e3, 3),
                                 "gb_s": round(w.size * w.dtype.itemsize / s / 1e9, 1)})
                print(f"{rows_out[-1]['shape']:24s} {name:12s} {s * 1e3:8.3f} ms {rows_out[-1]['gb_s']:6.1f} GB/s",
                      flush=True)
    out = {"bench": "gemv", "rows": rows_out}
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
