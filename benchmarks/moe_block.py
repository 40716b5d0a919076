"""Cost of the MoE feed-forward block (models/text/moe.py: router + top-k + two ragged_dot grouped
matmuls) against dense gated MLPs at decode batch sizes, one jitted block per variant:

- moe-ragged:   E experts of width f, top-k routing, grouped matmuls
- moe-skip:     the same block as a loop that skips idle experts (what "auto" picks on CPU for decode)
- dense-active: one gated MLP of width k*f (the same FLOPs as the active experts)
- dense-all:    one gated MLP of width E*f (what a dense all-experts matmul would read)

Presets (`--preset`): "gemma4" (Gemma 4's router: scaled RMSNorm, per-expert scale; GELU experts)
and "qwen3-vl-moe" (Qwen3-VL-30B-A3B's decoder block: d 2048, 128 experts of width 768, top 8,
softmax router with renormalised top-k, SiLU experts). Explicit --d/--experts/--top-k/--f
override the preset's sizes; --smoke runs tiny sizes with few repeats (checks it runs, no timing).

Prints a table and one JSON line (median ms over repeats). Usage:
    python benchmarks/moe_block.py [--preset gemma4|qwen3-vl-moe] [--d 1024 --experts 16 --top-k 2
        --f 512] [--batches 1 16] [--smoke]
"""
from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from mmjax.models.text.moe import experts_forward, gemma4_route, softmax_topk_route

PRESETS = {
    "gemma4": dict(d=1024, experts=16, top_k=2, f=512, router="gemma4", act="gelu"),
    "qwen3-vl-moe": dict(d=2048, experts=128, top_k=8, f=768, router="softmax", act="silu"),
}


def _median_ms(fn, *args, repeats: int) -> float:
    jax.block_until_ready(fn(*args))
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        ts.append(time.perf_counter() - t0)
    return 1e3 * float(np.median(ts))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", choices=sorted(PRESETS), default="gemma4")
    ap.add_argument("--d", type=int)
    ap.add_argument("--experts", type=int)
    ap.add_argument("--top-k", type=int)
    ap.add_argument("--f", type=int)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--smoke", action="store_true", help="tiny sizes, 2 repeats: checks that it runs")
    a = ap.parse_args()
    cfg = dict(PRESETS[a.preset])
    if a.smoke:
        cfg.update(d=64, experts=8, top_k=2, f=32)
    cfg.update({k: v for k, v in dict(d=a.d, experts=a.experts, top_k=a.top_k, f=a.f).items() if v is not None})
    repeats = 2 if a.smoke else 50
    rng = np.random.default_rng(0)
    d, e, k, f = cfg["d"], cfg["experts"], cfg["top_k"], cfg["f"]
    w = lambda *s: jnp.asarray(rng.normal(size=s).astype(np.float32) * 0.02)
    moe = {"gate_up": w(e, d, 2 * f), "down": w(e, f, d)}
    if cfg["router"] == "gemma4":
        router = {"scale": jnp.ones(d), "proj": w(d, e), "per_expert_scale": jnp.ones(e)}
        route = lambda p, x: gemma4_route(p, x, k, 1e-6)
    else:   # Qwen3-MoE / Qwen3-VL-MoE: softmax, top-k, renormalised (norm_topk_prob)
        router = w(d, e)
        route = lambda p, x: softmax_topk_route(p, x, k, True)
    act = jax.nn.gelu if cfg["act"] == "gelu" else jax.nn.silu

    # weights are arguments (as the serving steps' params are), not folded constants
    def moe_block(impl):
        @jax.jit
        def fn(p, x):
            wts, idx = route(p["router"], x)
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
        row = {"batch": b, **{name: round(_median_ms(fn, x, repeats=repeats), 4) for name, fn in variants.items()}}
        rows.append(row)
        print(f"batch {b:3d}: " + "  ".join(f"{n} {row[n]:.3f} ms" for n in variants)
              + f"  moe-skip/dense-active {row['moe-skip'] / row['dense-active']:.2f}x")
    print(json.dumps({"backend": jax.default_backend(), "preset": a.preset, "router": cfg["router"], "d": d,
                      "experts": e, "top_k": k, "f": f, "smoke": a.smoke, "rows": rows}))


if __name__ == "__main__":
    main()
