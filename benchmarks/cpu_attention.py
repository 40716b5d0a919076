"""`python -m benchmarks.cpu_attention`: the CPU decode-attention kernel (mmjax/kernels/cpu_attention)
against XLA's path, one run, side by side.

  layers    16 layers' decode attention of the bench model's shape (8 KV heads x 2 queries,
            head_dim 64, KV_SEGMENT-position segments (256); f32, or with --cache-dtype int8 / fp8 the quantized
            cache with its scales) over distinct caches, one jitted chain: `cache_attention`
            with the kernel and with `cpu_kernels(False)` (XLA's fusions per segment behind
            lax.cond); ms per 16 layers and GB/s of K + V (+ scales) read
  engine    (with --engine) decode steps of the bench checkpoint's engine, one built with the
            kernel and one without, in one process, interleaved rounds (medians), at the given
            rows and prompt lengths

Prints a table, then one JSON line (the last line of stdout).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import numpy as np


def layer_chain(rows: int, context: int, repeats: int, cache_dtype: str = "float32") -> dict:
    import jax
    import jax.numpy as jnp

    from mmjax.backend import cpu_kernels
    from mmjax.models.nn.kv_quant import quantize
    from mmjax.models.nn.kv_cache import KV_SEGMENT, cache_attention

    rng = np.random.default_rng(0)
    kvh, g, hd = 8, 2, 64
    size = -(-context // KV_SEGMENT) * KV_SEGMENT
    quantized = {"int8": jnp.int8, "fp8": jnp.float8_e4m3fn}.get(cache_dtype)

    def piece(shape):
        x = jnp.asarray(rng.standard_normal(shape), jnp.float32)
        return quantize(x, quantized) if quantized is not None else (x, None)

    def segments(x, axis):
        return [jax.lax.slice_in_dim(x, i, i + KV_SEGMENT, axis=axis) for i in range(0, size, KV_SEGMENT)]

    layers = []
    for _ in range(16):
        (kt, ks), (v, vs) = piece((rows, kvh, size, hd)), piece((rows, kvh, size, hd))
        kt = kt.swapaxes(2, 3)                                   # K^T [rows, kvh, hd, size]
        layers.append((segments(kt, 3), segments(v, 2), (segments(ks, 2), segments(vs, 2)) if quantized else None))
    q = jnp.asarray(rng.standard_normal((rows, 1, kvh * g, hd)), jnp.float32)
    q_index = jnp.full((rows, 1), context - 1, jnp.int32)

    def chain(q, layers, kv_len):
        for kts, vs, scales in layers:
            q = q + 1e-3 * cache_attention(q, kts, vs, q_index, kv_len, reduce_small=True, scales=scales)
        return q

    per_key = (hd + 2) if quantized else hd * 4                   # 8-bit values + a bf16 scale, or f32
    out = {"rows": rows, "context": context, "cache_dtype": cache_dtype, "bytes": 16 * rows * kvh * context * per_key * 2}
    for name, on in (("kernel", True), ("xla", False)):
        with cpu_kernels(on):
            f = jax.jit(lambda q, layers, n: chain(q, layers, n))
            f(q, layers, jnp.int32(context)).block_until_ready()
            times = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                f(q, layers, jnp.int32(context)).block_until_ready()
                times.append(time.perf_counter() - t0)
        out[f"{name}_ms"] = 1e3 * statistics.median(times)
        out[f"{name}_gb_s"] = out["bytes"] / statistics.median(times) / 1e9
    return out


def engine_ab(rows: int, extra_prompt: int, dtype: str, quantize: str | None, rounds: int,
              kv_cache_dtype: str = "auto") -> dict:
    import mmjax
    from benchmarks.checkpoints import build_llava
    from benchmarks.kernel import Arch, make_images, make_prompt
    from mmjax.kernels import cpu_attention

    path = str(build_llava("default"))

    def engine():
        vlm = mmjax.load(path, dtype, max_num_seqs=rows, max_model_len=4096, prefill_chunk=256, quantize=quantize,
                         kv_cache_dtype=kv_cache_dtype)
        prompt = make_prompt(vlm.tokenizer, Arch.from_family(vlm.family).img_tokens, 32 + extra_prompt)
        sp = mmjax.SamplingParams(max_tokens=10 ** 6, temperature=0.0, ignore_eos=True)
        for im in make_images(rows, 224, seed=7):
            vlm.engine.add_request(prompt, vlm.prepare_images([im]), sp)
        eng = vlm.engine
        while len(eng.scheduler.decoding()) < rows or min(len(r.output_ids) for r in eng.scheduler.decoding()) < 3:
            eng.step()
        for _ in range(10):
            eng.step()
        return vlm

    with_kernel = engine()
    covers = cpu_attention.covers
    cpu_attention.covers = lambda *a: False          # the second engine traces XLA's path
    try:
        without = engine()
    finally:
        cpu_attention.covers = covers
    times: dict = {"kernel": [], "xla": []}
    for _ in range(rounds):
        for name, vlm in (("kernel", with_kernel), ("xla", without)):
            for _ in range(6 if rows > 1 else 15):
                t0 = time.perf_counter()
                vlm.engine.step()
                times[name].append(time.perf_counter() - t0)
    r = with_kernel.engine.scheduler.decoding()[0]
    return {"rows": rows, "dtype": dtype, "quantize": quantize, "kv_cache_dtype": kv_cache_dtype,
            "context": r.prompt_len + len(r.output_ids),
            **{f"{k}_step_ms": 1e3 * statistics.median(v) for k, v in times.items()}}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.cpu_attention", description=__doc__.split("\n\n")[0])
    ap.add_argument("--chains", nargs="+", default=["1x235", "1x1000", "16x2000"], help="ROWSxCONTEXT")
    ap.add_argument("--repeats", type=int, default=50)
    ap.add_argument("--cache-dtype", nargs="+", default=["float32", "int8"], choices=["float32", "int8", "fp8"],
                    help="the layer chains' KV cache dtypes")
    ap.add_argument("--kv-cache-dtype", default="auto", help="the engine A/Bs' kv_cache_dtype")
    ap.add_argument("--engine", nargs="*", default=None,
                    help="ROWSxEXTRA_PROMPT_TOKENS[:int8|bf16] engine A/Bs, e.g. 1x0:int8 16x0 16x1700")
    ap.add_argument("--rounds", type=int, default=8)
    args = ap.parse_args(argv)
    os.environ.setdefault("MMJAX_COMPILATION_CACHE", "0")
    res: dict = {"bench": "cpu_attention", "cores": os.cpu_count(), "loadavg_1m": os.getloadavg()[0]}
    res["layers"] = []
    for spec in args.chains:
        rows, ctx = map(int, spec.split("x"))
        for cache_dtype in args.cache_dtype:
            res["layers"].append(layer_chain(rows, ctx, args.repeats if rows == 1 else max(3, args.repeats // 10),
                                             cache_dtype))
    print("16 layers of decode attention (8 KV heads x 2 queries, hd 64), ms (GB/s of K + V)")
    for r in res["layers"]:
        print(f"  {r['cache_dtype']:7s} cache, {r['rows']:3d} rows x {r['context']:5d} keys: "
              f"kernel {r['kernel_ms']:8.2f} ({r['kernel_gb_s']:.1f})   XLA {r['xla_ms']:8.2f} ({r['xla_gb_s']:.1f})")
    res["engine"] = []
    for spec in args.engine or []:
        shape, _, prec = spec.partition(":")
        rows, extra = map(int, shape.split("x"))
        dtype, quant = {"": ("float32", None), "int8": ("float32", "int8"), "bf16": ("bfloat16", None)}[prec]
        res["engine"].append(engine_ab(rows, extra, dtype, quant, args.rounds, args.kv_cache_dtype))
    if res["engine"]:
        print("engine decode step, kernel vs XLA's path (medians, interleaved rounds)")
        for r in res["engine"]:
            print(f"  {r['quantize'] or r['dtype']:8s} kv {r['kv_cache_dtype']:7s} {r['rows']:3d} rows, context ~{r['context']:5d}: "
                  f"kernel {r['kernel_step_ms']:7.2f} ms   XLA {r['xla_step_ms']:7.2f} ms")
    res["loadavg_1m_end"] = os.getloadavg()[0]
    print(json.dumps(res))
    return res


if __name__ == "__main__":
    main(sys.argv[1:])
