"""Cost of the MoE feed-forward block (models/text/moe.py: router + top-k + two ragged_dot grouped
matmuls) against dense gated MLPs at decode batch sizes, one jitted block per variant:

- moe-ragged:   E experts of width f, top-k routing (Gemma 4's router), grouped matmuls
- moe-skip:     the same block as a loop that skips idle experts (what "auto" picks on CPU for decode)
- dense-active: one gated MLP of width k*f (the same FLOPs as the active experts)
- dense-all:    one gated MLP of width E*f (what a dense all-experts matmul would read)

Prints a table and one JSON line (median ms over repeats). Usage:
    python benchmarks/moe_block.py [--d 1024 --experts 16 --top-k 2 --f 512 --batches 1 16]
"""
from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from mmjax.models.text.moe import experts_forward, gemma4_route


def _median_ms(fn, *args, repeats: int = 50) -> float:
    jax.block_until_ready(fn(*args))
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        ts.append(time.perf_counter() - t0)
    return 1e3 * float(np.median(ts))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--d", type=int, default=1024)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--f", type=int, default=512)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    a = ap.parse_args()
    rng = np.random.default_rng(0)
    d, e, k, f = a.d, a.experts, a.top_k, a.f
    w = lambda *s: jnp.asarray(rng.normal(size=s).astype(np.float32) * 0.02)
    moe = {"gate_up": w(e, d, 2 * f), "down": w(e, f, d)}
    router = {"scale": jnp.ones(d), "proj": w(d, e), "per_expert_scale": jnp.ones(e)}
    act = jax.nn.gelu

    # weights are arguments (as the serving steps' params are), not folded constants
    def moe_block(impl):
        @jax.jit
        def fn(p, x):
            wts, idx = gemma4_route(p["router"], x, k, 1e-6)
            return experts_forward(p["moe"], x, wts, idx, act, impl=impl)
        return lambda x: fn({"router": router, "moe": moe}, x)

    def dense(width):
        weights = {"gu": w(d, 2 * width), "down": w(width, d)}

        @jax.jit
        def fn(p, x):
            h = x @ p["gu"]
            return (act(h[:, :width]) * h[:, width:]) @ p["down"]
        return lambda x: fn(weights, x)

    variants = {"moe-ragged": moe_block("ragged"), "moe-skip": moe_block("skip"), "dense-active": dense(k * f),
                "dense-all": dense(e * f)}
    rows = []
    for b in a.batches:
        x = w(b, d)
        row = {"batch": b, **{name: round(_median_ms(fn, x), 4) for name, fn in variants.items()}}
        rows.append(row)
        print(f"batch {b:3d}: " + "  ".join(f"{n} {row[n]:.3f} ms" for n in variants)
              + f"  moe-skip/dense-active {row['moe-skip'] / row['dense-active']:.2f}x")
    print(json.dumps({"backend": jax.default_backend(), "d": d, "experts": e, "top_k": k, "f": f, "rows": rows}))


if __name__ == "__main__":
    main()
