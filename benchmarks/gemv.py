"""Decode's weight matmuls alone: mmjax's CPU kernel (mmjax.kernels.cpu_gemv) vs XLA's dots.

    python -m benchmarks.gemv [--rows 1 8] [--shapes 1024x32000 2048x8192] [--repeat 5] [--chain [--blocks-ab]]

For each [rows, K] @ [K, N]: XLA's f32 dot (decode's f32 compiler options), the bf16 and int8
paths without the kernel (one row run as two on YNNPACK: `linear.one_row_as_two`, decode's
narrow-weight options), the row-major kernel's f32, bf16 and int8 calls, and the packed-weight
calls a model on a CPU host makes (f32 / bf16 panels, int8's whole W8A8 product). Median of `--repeat` runs of 20
calls, ms and weight GB/s (bytes of the weight / time). One weight called again and again stays
partly in the last-level cache; `--chain` also times what a decode step does: one jitted chain
through 8 layers of distinct weights of the bench model's shapes ([1024, 2048], [1024, 1024],
[1024, 5632], [2816, 1024]: 94 MB in int8, 375 MB in f32), each call's input depending on the
last (best of 25 runs). Prints tables and one JSON line. Run it alone on the machine (DESIGN.md
"Performance method").
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


CHAIN_SHAPES = ((1024, 2048), (1024, 1024), (1024, 5632), (2816, 1024))   # qkv, o, gate_up, down
CHAIN_LAYERS = 8


def chain(rows: list[int], layers: int = CHAIN_LAYERS, blocks_ab: bool = False) -> list[dict]:
    """Best time of one jitted chain through `layers` layers of distinct weights per path;
    blocks_ab: the packed paths also with the kernels' step blocks off (cpu_gemv.cc
    `mmjax_gemv_kblock`), rounds alternating, the same compiled chain."""
    from mmjax.kernels import cpu_library
    lib = cpu_library.load()
    rng = np.random.default_rng(1)
    shapes = [s for _ in range(layers) for s in CHAIN_SHAPES]
    out = []
    for path in ("f32 xla", "f32 kernel", "f32 packed", "bf16 kernel", "bf16 packed", "int8 kernel", "int8 packed"):
        dtype = {"f32": jnp.float32, "bf16": jnp.bfloat16, "int8": jnp.int8}[path.split()[0]]
        if path in ("f32 packed", "bf16 packed"):
            ws = [jnp.asarray(cpu_gemv.pack_panels(np.asarray(rng.standard_normal(s) * 0.02, dtype))) for s in shapes]
            call = lambda x, w, n: cpu_gemv.matmul_packed(x, w, n)
        elif path == "int8 packed":
            ws = [jnp.asarray(cpu_gemv.pack_s8(rng.integers(-127, 128, s).astype(np.int8))) for s in shapes]
            call = lambda x, w, n: cpu_gemv.qmatmul_s8p(x.astype(jnp.float32), w, jnp.full((1, n), 0.01, jnp.float32))
        elif dtype == jnp.int8:
            ws = [jnp.asarray(rng.integers(-127, 128, s), jnp.int8) for s in shapes]
            call = lambda x, w, n: cpu_gemv.gemv_s8(x, w)[:, 0].astype(jnp.float32)
        else:
            ws = [jnp.asarray(rng.standard_normal(s) * 0.02, dtype) for s in shapes]
            dot = (lambda x, w: x @ w) if path == "f32 xla" else (
                cpu_gemv.gemv_f32 if dtype == jnp.float32 else cpu_gemv.gemv_bf16)
            call = lambda x, w, n, dot=dot: dot(x, w)
        nbytes = sum(w.size * w.dtype.itemsize for w in ws)
        for m in rows:
            xs = {k: jnp.asarray(rng.integers(-100, 100, (m, k)), dtype) for k in {s[0] for s in CHAIN_SHAPES}}

            def f(xs, ws):
                acc = jnp.zeros((), jnp.float32)
                for w, (k, n) in zip(ws, shapes):   # each input depends on the last output: no overlap
                    x = xs[k] + (acc > 1e30).astype(dtype)
                    acc = acc + call(x, w, n)[0, 0].astype(jnp.float32)
                return acc
            opts = _CPU_DECODE_OPTIONS if dtype == jnp.float32 else _CPU_DECODE_OPTIONS_NARROW
            c = jax.jit(f).lower(xs, ws).compile(opts)
            c(xs, ws).block_until_ready()
            sides = ("blocks", "no blocks") if blocks_ab and "packed" in path else ("blocks",)
            steps = lib.mmjax_gemv_kblock(0, -1)        # the default (set back below)
            best = dict.fromkeys(sides, float("inf"))
            try:
                for _ in range(25):
                    for side in sides:
                        lib.mmjax_gemv_kblock(steps if side == "blocks" else 0, -1)
                        t0 = time.perf_counter()
                        c(xs, ws).block_until_ready()
                        best[side] = min(best[side], time.perf_counter() - t0)
            finally:
                lib.mmjax_gemv_kblock(steps, -1)
            for side in sides:
                name = path if side == "blocks" else f"{path} (no blocks)"
                out.append({"path": name, "rows": m, "ms": round(best[side] * 1e3, 3), "gb_s": _gb_s(nbytes, best[side])})
                print(f"chain {name:12s} rows {m:2d} {best[side] * 1e3:8.2f} ms {out[-1]['gb_s']:6.1f} GB/s", flush=True)
    return out


def _gb_s(nbytes: int, seconds: float) -> float:
    """GB/s to three significant figures: a tiny smoke shape's rate must not round to 0."""
    return float(f"{nbytes / seconds / 1e9:.3g}")


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--shapes", nargs="+", default=["1024x32000", "2048x8192"])
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--chain", action="store_true", help="also time chains of distinct layer weights")
    ap.add_argument("--chain-layers", type=int, default=CHAIN_LAYERS)
    ap.add_argument("--blocks-ab", action="store_true",
                    help="with --chain: the packed paths also without the step blocks (A/B, rounds alternating)")
    args = ap.parse_args(argv)
    if not cpu_gemv.available():
        raise SystemExit("the CPU kernel is unavailable (see the warning above)")
    rng = np.random.default_rng(0)
    rows_out = []
    for shape in args.shapes:
        k, n = (int(v) for v in shape.split("x"))
        wf = jnp.asarray(rng.standard_normal((k, n)) * 0.02, jnp.float32)
        wb, wq = wf.astype(jnp.bfloat16), jnp.asarray(rng.integers(-127, 128, (k, n)), jnp.int8)
        wp, scale = jnp.asarray(cpu_gemv.pack_s8(wq)), jnp.full((1, n), 0.01, jnp.float32)
        wpf, wpb = jnp.asarray(cpu_gemv.pack_panels(wf)), jnp.asarray(cpu_gemv.pack_panels(wb))
        for m in args.rows:
            x = jnp.asarray(rng.standard_normal((m, k)), jnp.float32)
            xb, xq = x.astype(jnp.bfloat16), jnp.asarray(rng.integers(-127, 128, (m, k)), jnp.int8)
            cases = {
                "f32 xla": (jax.jit(lambda x, w: x @ w, compiler_options=_CPU_DECODE_OPTIONS), x, wf),
                "bf16 xla": (jax.jit(_xla_dot(jnp.float32), compiler_options=_CPU_DECODE_OPTIONS_NARROW), xb, wb),
                "f32 kernel": (jax.jit(cpu_gemv.gemv_f32), x, wf),
                "bf16 kernel": (jax.jit(cpu_gemv.gemv_bf16), xb, wb),
                "int8 xla": (jax.jit(_xla_dot(jnp.int32), compiler_options=_CPU_DECODE_OPTIONS_NARROW), xq, wq),
                "int8 kernel": (jax.jit(lambda x, w: cpu_gemv.gemv_s8(x, w)), xq, wq),
                # what a model's matmuls are on a CPU host: the packed weight (int8: the whole
                # W8A8 product, activation quantization and rescale included)
                "f32 packed": (jax.jit(lambda x, w: cpu_gemv.matmul_packed(x, w, n)), x, wpf),
                "bf16 packed": (jax.jit(lambda x, w: cpu_gemv.matmul_packed(x, w, n)), xb, wpb),
                "int8 packed": (jax.jit(lambda x, w: cpu_gemv.qmatmul_s8p(x, w, scale)), x, wp),
            }
            for name, (f, a, w) in cases.items():
                s = _time(f, a, w, repeat=args.repeat)
                rows_out.append({"shape": f"[{m},{k}]x[{k},{n}]", "path": name, "ms": round(s * 1e3, 3),
                                 "gb_s": _gb_s(w.size * w.dtype.itemsize, s)})
                print(f"{rows_out[-1]['shape']:24s} {name:12s} {s * 1e3:8.3f} ms {rows_out[-1]['gb_s']:6.1f} GB/s",
                      flush=True)
    out = {"bench": "gemv", "rows": rows_out}
    if args.chain:
        out["chain"] = chain(args.rows, args.chain_layers, args.blocks_ab)
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
