"""`python -m benchmarks.cpu_attention_paths`: the CPU attention kernels (mmjax/kernels/cpu_attention)
on each code path this CPU runs (AVX-512 / AVX2 / plain C++, `cpu_library.set_isa`) against XLA,
in one process, interleaved repeats, medians.

16 layers of the bench model's attention (16 query heads / 8 KV heads, head_dim 64, KV_SEGMENT-key
segments, distinct caches per layer) as one jitted chain, q <- q + 1e-3 attention(q):

  decode:RxC   R rows of one new token over C cached keys (`decode_attention`)
  prefill:1xT  one T-token causal prompt (`prefill_attention`)
  vision:BxN   B images of N patches through a ViT's full attention (`dense_attention`; CLIP
               ViT-B shapes instead: 12 layers, 12 heads, head_dim 64, distinct K / V a layer;
               q, k, v [B, N, heads, hd] as the tower holds them)

Columns, ms per 16 layers: the kernel on each path; `xla_model`: what the model runs without the
kernel (`cache_attention` traced with `cpu_kernels(False)`: per-segment fusions behind lax.cond,
kv_len traced as in the steps; for vision: `mmjax.attention`'s "auto" XLA choice, the chunked
online softmax); `xla_ref`: `cpu_attention.reference` jitted (the kernels' XLA definition, which
concatenates the segments; for vision `reference_attention`). Prints one line per case, then one JSON line.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import numpy as np

KVH, G, HD = 8, 2, 64


def _layers(rows: int, size: int, dtype: str, rng) -> list:
    import jax
    import jax.numpy as jnp

    from mmjax.models.nn.kv_quant import quantize
    from mmjax.models.nn.kv_cache import KV_SEGMENT

    quant = {"int8": jnp.int8, "fp8": jnp.float8_e4m3fn}.get(dtype)

    def piece(shape):
        x = jnp.asarray(rng.standard_normal(shape), jnp.float32)
        if quant is not None:
            return quantize(x, quant)
        return x.astype(jnp.bfloat16 if dtype == "bf16" else jnp.float32), None

    def segments(x, axis):
        return [jax.lax.slice_in_dim(x, i, i + KV_SEGMENT, axis=axis) for i in range(0, size, KV_SEGMENT)]

    layers = []
    for _ in range(16):
        (kt, ks), (v, vs) = piece((rows, KVH, size, HD)), piece((rows, KVH, size, HD))
        kt = kt.swapaxes(2, 3)                                              # K^T [rows, kvh, hd, size]
        layers.append((segments(kt, 3), segments(v, 2), (segments(ks, 2), segments(vs, 2)) if quant else None))
    return layers


def _chains(kind: str, rows: int, context: int):
    """(kernel, reference, model) chains over (q, layers, kv_len); q [rows, kvh, n, hd]."""
    import jax.numpy as jnp

    from mmjax.kernels import cpu_attention
    from mmjax.models.nn.kv_cache import cache_attention

    scale = HD ** -0.5
    if kind == "decode":
        lo, hi = jnp.zeros((rows,), jnp.int32), jnp.full((rows,), context, jnp.int32)
        q_index = jnp.full((rows, 1), context - 1, jnp.int32)

        def kernel(q, layers, kv_len):
            for kts, vs, sc in layers:
                q = q + 1e-3 * cpu_attention.decode_attention(q, kts, vs, lo, hi, scale=scale, scales=sc)
            return q

        def ref(q, layers, kv_len):
            for kts, vs, sc in layers:
                q = q + 1e-3 * cpu_attention.reference(q, kts, vs, lo, hi, scale, sc)
            return q

        def model(q, layers, kv_len):                                      # q [rows, 1, heads, hd]
            q = q.reshape(rows, 1, KVH * G, HD)
            for kts, vs, sc in layers:
                q = q + 1e-3 * cache_attention(q, kts, vs, q_index, kv_len, reduce_small=True, scales=sc)
            return q
        return kernel, ref, model

    tok = np.arange(context)
    lo, hi = jnp.zeros((1, context), jnp.int32), jnp.asarray((tok + 1)[None], jnp.int32)
    slots, starts = jnp.zeros((1,), jnp.int32), jnp.zeros((1,), jnp.int32)
    q_index = jnp.asarray(tok[None], jnp.int32)

    def kernel(q, layers, kv_len):
        for kts, vs, sc in layers:
            q = q + 1e-3 * cpu_attention.prefill_attention(q, kts, vs, lo, hi, slots, scale=scale, scales=sc)
        return q

    def ref(q, layers, kv_len):
        for kts, vs, sc in layers:
            q = q + 1e-3 * cpu_attention.reference(q, kts, vs, lo, hi, scale, sc, slots)
        return q

    def model(q, layers, kv_len):                                          # q [1, t, heads, hd]
        q = q.reshape(1, KVH, context, G, HD).transpose(0, 2, 1, 3, 4).reshape(1, context, KVH * G, HD)
        for kts, vs, sc in layers:
            q = q + 1e-3 * cache_attention(q, kts, vs, q_index, kv_len, slots, starts=starts, scales=sc)
        return q
    return kernel, ref, model


def _vision(batch: int, tokens: int, rng):
    """(q, layers, kernel, ref, model) for 12 CLIP-B layers' attention over `tokens` patches."""
    import jax.numpy as jnp

    from mmjax.attention import attention, reference_attention
    from mmjax.kernels import cpu_attention

    heads, hd = 12, 64
    x = lambda: jnp.asarray(rng.standard_normal((batch, tokens, heads, hd)), jnp.float32)  # noqa: E731
    q, layers = x(), [(x(), x()) for _ in range(12)]

    def chain(fn):
        def run(q, layers, _):
            for k, v in layers:
                q = q + 1e-3 * fn(q, k, v)
            return q
        return run
    return (q, layers, chain(lambda q, k, v: cpu_attention.dense_attention(q, k, v)),
            chain(reference_attention), chain(lambda q, k, v: attention(q, k, v)))


def bench(kind: str, rows: int, context: int, dtype: str, repeats: int, slow_every: int = 1) -> dict:
    """Medians (ms) of the chain per kernel path and for XLA; the slow plain-C++ path is timed
    every `slow_every`-th round only (rounds 0, slow_every, ...), the reference in a third as many
    rounds of its own."""
    import jax
    import jax.numpy as jnp

    from mmjax.backend import cpu_kernels
    from mmjax.kernels import cpu_library
    from mmjax.models.nn.kv_cache import KV_SEGMENT

    rng = np.random.default_rng(0)
    if kind == "vision":
        q, layers, *chains = _vision(rows, context, rng)
    else:
        size = -(-context // KV_SEGMENT) * KV_SEGMENT
        n = G if kind == "decode" else context * G
        q = jnp.asarray(rng.standard_normal((rows, KVH, n, HD)), jnp.float32)
        layers = _layers(rows, size, dtype, rng)
        chains = _chains(kind, rows, context)
    kernel, ref, model = (jax.jit(f) for f in chains)
    kv_len = jnp.int32(context)
    with cpu_kernels(False):                       # traced here: XLA's path
        model(q, layers, kv_len).block_until_ready()
    kernel(q, layers, kv_len).block_until_ready()
    ref(q, layers, kv_len).block_until_ready()
    paths = [(path, kernel, path) for path in reversed(cpu_library.isas())]
    times: dict = {}

    def timed(name, f, path):
        time.sleep(0.05)
        cpu_library.set_isa(path)
        try:
            t0 = time.perf_counter()
            f(q, layers, kv_len).block_until_ready()
            times.setdefault(name, []).append(time.perf_counter() - t0)
        finally:
            cpu_library.set_isa(None)
    # the kernel paths and XLA's path interleaved, in alternating order; the reference after them,
    # on its own (whatever ran right after its big concatenations ran up to 1.7x slower)
    for r in range(repeats):
        for name, f, path in paths + [("xla_model", model, None)] if r % 2 else [("xla_model", model, None)] + paths:
            if name != "generic" or r % slow_every == 0:
                timed(name, f, path)
    for _ in range(max(3, repeats // 3)):
        timed("xla_ref", ref, None)
    out = {"kind": kind, "rows": rows, "context": context, "dtype": dtype, "repeats": repeats}
    out.update({f"{k}_ms": float(f"{1e3 * statistics.median(v):.3g}") for k, v in times.items()})
    got, want = np.asarray(kernel(q, layers, kv_len)), np.asarray(ref(q, layers, kv_len))
    out["max_abs_diff_vs_ref"] = float(np.abs(got - want).max())
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.cpu_attention_paths", description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", nargs="+", default=["decode:1x300", "decode:16x300", "decode:16x2000", "prefill:1x240",
                                                    "vision:1x197", "vision:8x197"],
                    help="decode:ROWSxCONTEXT, prefill:1xTOKENS or vision:IMAGESxPATCHES")
    ap.add_argument("--dtypes", nargs="+", default=["f32"], choices=["f32", "bf16", "int8", "fp8"], help="cache dtypes")
    ap.add_argument("--repeats", type=int, default=21, help="rounds (a third, at least 5, above 10k rows x keys)")
    args = ap.parse_args(argv)
    os.environ.setdefault("MMJAX_COMPILATION_CACHE", "0")
    from mmjax.kernels import cpu_library

    res: dict = {"bench": "cpu_attention_paths", "paths": list(cpu_library.isas()), "cores": os.cpu_count(),
                 "loadavg_1m": os.getloadavg()[0], "cases": []}
    for case in args.cases:
        kind, shape = case.split(":")
        rows, ctx = map(int, shape.split("x"))
        for dtype in (args.dtypes if kind != "vision" else ["f32"]):
            big = rows * ctx > 10000
            r = bench(kind, rows, ctx, dtype, max(5, args.repeats // 3) if big else args.repeats, 3 if big else 1)
            res["cases"].append(r)
            print(f"{kind:7s} {rows:2d} x {ctx:5d} {dtype:4s}: " + "  ".join(
                f"{k[:-3]} {v:.2f}" for k, v in r.items() if k.endswith("_ms")), flush=True)
    res["loadavg_1m_end"] = os.getloadavg()[0]
    print(json.dumps(res))
    return res


if __name__ == "__main__":
    main(sys.argv[1:])
