"""Attention benchmark: reference / chunked / flash / cudnn / tokamax, non-causal, side by side.

    python -m benchmarks.attention [--smoke] [--n 1024 4096 ...] [--head-dims 80 128]
                                   [--heads 16] [--dtype float32|bfloat16] [--sweep]

For every (N, head_dim) and implementation: compile time, compile-time temp memory
(`compiled.memory_analysis().temp_size_in_bytes`), median run time (short calls queued
back to back: `queued_seconds`), TFLOP/s (4 * B * H * N^2 * head_dim useful FLOPs, i.e. the
unpadded head_dim) and two ratios: to cuDNN (GPU) and to this device's own measured dense-matmul
peak in the same dtype. Implementations
that cannot run are listed with the reason (reference whose N x N scores do not fit, flash in
Pallas interpret mode on CPU, cudnn off GPU, calls estimated to run longer than --max-call-s).
Prints a table, then one JSON line.
"""
from __future__ import annotations

import argparse
import functools
import json
import statistics
import time

import jax
import jax.numpy as jnp

from mmjax.attention import attention
from mmjax.attention.flash import FlashBlockSizes, flash_attention

IMPLS = ("reference", "chunked", "flash", "cudnn", "tokamax", "tokamax-triton")


def on_gpu() -> bool:
    return jax.default_backend() in ("gpu", "cuda", "rocm")


def attention_flops(b: int, h: int, n: int, d: int) -> float:
    """Non-causal useful FLOPs: Q K^T and P V, 2 * N^2 * d multiply-adds each per head."""
    return 4.0 * b * h * n * n * d


def matmul_peak(dtype, n: int) -> float:
    """Best FLOP/s of an [n, n] @ [n, n] matmul in `dtype` on the default device (calls queued
    back to back, see `queued_seconds`)."""
    a = jax.random.normal(jax.random.key(0), (n, n), dtype)
    mm = jax.jit(jnp.matmul)
    mm(a, a).block_until_ready()
    best = min(queued_seconds(lambda: mm(a, a), 10) for _ in range(3))
    return 2.0 * n**3 / best


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def queued_seconds(call, n: int) -> float:
    """Seconds per call of `call` (dispatching one jitted computation) issued n times back to
    back, then waited for once: the device's time per call once it is busier than the host's
    dispatch. Waiting for every call instead adds a host round trip per call: on the lent H200s
    (a virtualised host) that was 0.1-0.3 ms, a fifth of an 8192^3 bf16 matmul, so the peak
    read 542-610 TFLOP/s and cuDNN's attention above 100% of it."""
    jax.block_until_ready(call())
    t0 = time.perf_counter()
    out = [call() for _ in range(n)]
    jax.block_until_ready(out)
    return (time.perf_counter() - t0) / n


def memory_budget() -> int:
    """Bytes an implementation's temporaries may use: 90% of device memory, 24 GiB on CPU."""
    if on_gpu():
        stats = jax.devices()[0].memory_stats() or {}
        if "bytes_limit" in stats:
            return int(0.9 * stats["bytes_limit"])
    return 24 * 2**30


def make_fn(impl: str, block_sizes: FlashBlockSizes | None = None):
    if impl.startswith("tokamax"):   # the maintained Pallas kernel library, as a peer
        import sys

        import tokamax
        from absl import flags
        if not flags.FLAGS.is_parsed():      # tokamax reads absl flags from sys.argv (ours are not its)
            flags.FLAGS(sys.argv[:1])
        # "tokamax": its own choice of kernel (Mosaic GPU first on Hopper); "tokamax-triton": its
        # Triton kernel (0.0.12's Mosaic kernel failed to trace on jax 0.11.2)
        kw = {"implementation": "triton"} if impl == "tokamax-triton" else {}
        return jax.jit(functools.partial(tokamax.dot_product_attention, **kw))
    if impl == "flash":
        return jax.jit(functools.partial(flash_attention, block_sizes=block_sizes))
    return jax.jit(functools.partial(attention, impl=impl))


def skip_reason(impl: str, b: int, h: int, n: int, budget: int) -> str | None:
    if impl == "flash" and not on_gpu():
        return "Pallas interpret mode on CPU is a correctness tool (tests), not timed"
    if impl in ("cudnn", "tokamax", "tokamax-triton") and not on_gpu():
        return "needs a CUDA GPU"
    if impl.startswith("tokamax"):
        try:
            import tokamax  # noqa: F401
        except ImportError:
            return "not installed (pip install tokamax)"
    if impl == "reference":
        need = 2 * b * h * n * n * 4  # f32 scores and their exp, both N x N per head
        if need > budget:
            return f"N x N scores would need {need / 1e9:.0f} GB (> {budget / 2**30:.0f} GiB)"
    return None


def bench_one(fn, q, k, v, flops: float, est_rate: float | None, max_call_s: float
              ) -> dict:
    """Compile, read temp memory, time. `est_rate` (FLOP/s seen at smaller N) guards run time."""
    row: dict = {}
    t0 = time.perf_counter()
    compiled = fn.lower(q, k, v).compile()
    row["compile_s"] = time.perf_counter() - t0
    mem = compiled.memory_analysis()
    row["temp_bytes"] = None if mem is None else int(mem.temp_size_in_bytes)
    est = flops / est_rate if est_rate else None
    if est is not None and est > max_call_s:
        row["skipped"] = f"estimated {est:.0f} s per call > --max-call-s {max_call_s:.0f}"
        return row
    first = _timed(lambda: compiled(q, k, v).block_until_ready())
    if first > 5:
        times = [first]
    elif first > 0.5:
        times = [_timed(lambda: compiled(q, k, v).block_until_ready()) for _ in range(3)]
    else:                   # short calls: queued, so the host's round trip per call is not timed
        times = [queued_seconds(lambda: compiled(q, k, v), 10) for _ in range(3)]
    row["time_s"] = statistics.median(times)
    row["tflops"] = flops / row["time_s"] / 1e12
    return row


def run(ns: list[int], head_dims: list[int], heads: int, batch: int, dtype, impls: list[str],
        max_call_s: float, sweep: bool) -> dict:
    budget = memory_budget()
    peak = matmul_peak(dtype, 8192 if on_gpu() else 2048)
    rows = []
    for d in head_dims:
        rate: dict[str, float] = {}  # last measured FLOP/s per impl, to estimate larger N
        for n in ns:
            keys = jax.random.split(jax.random.key(n * 1000 + d), 3)
            q, k, v = (jax.random.normal(kk, (batch, n, heads, d), dtype) for kk in keys)
            flops = attention_flops(batch, heads, n, d)
            variants = [(impl, None) for impl in impls]
            if sweep and on_gpu() and "flash" in impls:
                variants += [("flash", bs) for bs in sweep_blocks(d)]
            for impl, bs in variants:
                name = impl if bs is None else f"flash[{bs.block_q}x{bs.block_k} w{bs.num_warps} s{bs.num_stages}]"
                row = dict(impl=name, n=n, head_dim=d, heads=heads, batch=batch,
                           dtype=jnp.dtype(dtype).name)
                reason = skip_reason(impl, batch, heads, n, budget)
                if reason:
                    row["skipped"] = reason
                else:
                    try:
                        row.update(bench_one(make_fn(impl, bs), q, k, v, flops,
                                             rate.get(name), max_call_s))
                    except Exception as e:  # report, keep benchmarking the rest
                        row["skipped"] = f"error: {type(e).__name__}: {str(e).splitlines()[0][:120]}"
                if "tflops" in row:
                    rate[name] = row["tflops"] * 1e12
                    row["pct_matmul_peak"] = 100 * row["tflops"] * 1e12 / peak
                rows.append(row)
            cudnn = next((r for r in rows if r["impl"] == "cudnn" and r["n"] == n
                          and r["head_dim"] == d and "tflops" in r), None)
            for r in rows:
                if cudnn and r["n"] == n and r["head_dim"] == d and "tflops" in r:
                    r["vs_cudnn"] = r["tflops"] / cudnn["tflops"]
            del q, k, v
    return dict(bench="attention", backend=jax.default_backend(),
                device=str(jax.devices()[0].device_kind), matmul_peak_tflops=peak / 1e12,
                causal=False, rows=rows)


def sweep_blocks(d: int) -> list[FlashBlockSizes]:
    """A few tile configurations around the defaults, for tuning on a real GPU."""
    cands = [(128, 128, 8, 2), (128, 64, 4, 3), (128, 64, 8, 3), (64, 64, 4, 3),
             (128, 128, 4, 3), (128, 32, 4, 4)]
    default = FlashBlockSizes.for_head_dim(d)
    return [FlashBlockSizes(*c) for c in cands
            if (c[0], c[1], c[2], c[3]) != (default.block_q, default.block_k,
                                            default.num_warps, default.num_stages)]


def format_table(result: dict) -> str:
    lines = [f"attention benchmark: backend={result['backend']} device={result['device']} "
             f"matmul peak {result['matmul_peak_tflops']:.3f} TFLOP/s, non-causal",
             f"{'impl':<28}{'N':>7}{'d':>5}{'H':>4}  {'compile s':>9}  {'temp MB':>10}  "
             f"{'time s':>9}  {'TFLOP/s':>8}  {'%peak':>6}  {'/cudnn':>6}  note"]
    for r in result["rows"]:
        def f(key, fmt):
            return format(r[key], fmt) if r.get(key) is not None else "-"
        temp = f"{r['temp_bytes'] / 1e6:,.1f}" if r.get("temp_bytes") is not None else "-"
        lines.append(f"{r['impl']:<28}{r['n']:>7}{r['head_dim']:>5}{r['heads']:>4}  "
                     f"{f('compile_s', '9.2f'):>9}  {temp:>10}  {f('time_s', '9.4f'):>9}  "
                     f"{f('tflops', '8.4f'):>8}  {f('pct_matmul_peak', '6.1f'):>6}  "
                     f"{f('vs_cudnn', '6.2f'):>6}  {r.get('skipped', '')}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--smoke", action="store_true", help="tiny sizes, seconds")
    p.add_argument("--n", type=int, nargs="+", default=[1024, 4096, 16384, 42196],
                   help="sequence lengths (42196 = ViT patches of a 3840x2160 image, Qwen2-VL)")
    p.add_argument("--head-dims", type=int, nargs="+", default=[80, 128])
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--dtype", default=None, help="default: bfloat16 on GPU, float32 on CPU")
    p.add_argument("--impls", nargs="+", default=list(IMPLS), choices=IMPLS)
    p.add_argument("--max-call-s", type=float, default=None,
                   help="skip a call estimated to take longer (default 60 on CPU, 600 on GPU)")
    p.add_argument("--sweep", action="store_true", help="also time other flash tile configs (GPU)")
    a = p.parse_args(argv)
    if a.smoke:
        a.n, a.head_dims, a.heads = [256, 1024], [80], 4
    dtype = jnp.dtype(a.dtype or ("bfloat16" if on_gpu() else "float32"))
    max_call_s = a.max_call_s or (600.0 if on_gpu() else 60.0)
    result = run(a.n, a.head_dims, a.heads, a.batch, dtype, a.impls, max_call_s, a.sweep)
    print(format_table(result))
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
