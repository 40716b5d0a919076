"""Cost of the MoE feed-forward block (models/nn/moe.py: router + top-k + two ragged_dot grouped
matmuls) against dense gated MLPs at decode batch sizes, one jitted block per variant:

- moe-ragged:   E experts of width f, top-k routing, grouped matmuls
- moe-skip:     the same block as a loop that skips idle experts (what "auto" picks on CPU for decode)
- dense-active: one gated MLP of width k*f (the same FLOPs as the active experts)
- dense-all:    one gated MLP of width E*f (what a dense all-experts matmul would read)

Presets (`--preset`): "gemma4" (Gemma 4's router: scaled RMSNorm, per-expert scale; GELU experts)
and "qwen3-vl-moe" (Qwen3-VL-30B-A3B's decoder block: d 2048, 128 experts of width 768, top 8,
softmax router with renormalised top-k, SiLU experts). Explicit --d/--experts/--top-k/--f
override the preset's sizes; --smoke runs tiny sizes with few repeats (checks it runs, no timing).

Prints a table and one JSON line (median ms over repeats; each variant and batch runs at most
--repeats times and stops early once --budget-s seconds are spent, after at least 3 runs, so a
slow variant such as XLA:CPU's ragged_dot at batch 16 cannot hold the run for minutes; the JSON
says how many runs each median took). Usage:
    python -m benchmarks.moe_block [--preset gemma4|qwen3-vl-moe] [--d 1024 --experts 16 --top-k 2
        --f 512] [--batches 1 16] [--variants moe-skip dense-active ...] [--repeats 50] [--budget-s 20]
        [--smoke]
e.g. the Qwen3-VL-MoE figure at decode batch 16:
    python -m benchmarks.moe_block --preset qwen3-vl-moe --batches 16
"""
from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from mmjax.models.nn.linear import matmul
from mmjax.models.nn.moe import experts_forward, gemma4_route, softmax_topk_route

PRESETS = {
    "gemma4": dict(d=1024, experts=16, top_k=2, f=512, router="gemma4", act="gelu"),
    "qwen3-vl-moe": dict(d=2048, experts=128, top_k=8, f=768, router="softmax", act="silu"),
}


VARIANTS = ("moe-ragged", "moe-skip", "dense-active", "dense-all")


def _median_ms(fn, *args, repeats: int, budget_s: float | None = None) -> tuple[float, int]:
    """(median ms, runs): after one warm-up (compile) call, up to `repeats` timed calls, stopping
    once `budget_s` seconds of them are spent (at least 3 calls, or `repeats` if fewer)."""
    jax.block_until_ready(fn(*args))
    ts = []
    while len(ts) < repeats:
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        ts.append(time.perf_counter() - t0)
        if budget_s is not None and len(ts) >= 3 and sum(ts) >= budget_s:
            break
    return 1e3 * float(np.median(ts)), len(ts)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", choices=sorted(PRESETS), default="gemma4")
    ap.add_argument("--d", type=int)
    ap.add_argument("--experts", type=int)
    ap.add_argument("--top-k", type=int)
    ap.add_argument("--f", type=int)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    ap.add_argument("--repeats", type=int, default=50, help="most timed runs per variant and batch")
    ap.add_argument("--budget-s", type=float, default=20.0,
                    help="stop timing a variant at a batch after this many seconds (at least 3 runs)")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes, 2 repeats: checks that it runs")
    a = ap.parse_args()
    if a.repeats < 1 or not a.budget_s > 0:
        ap.error("--repeats and --budget-s must be positive")
    cfg = dict(PRESETS[a.preset])
    if a.smoke:
        cfg.update(d=64, experts=8, top_k=2, f=32)
    cfg.update({k: v for k, v in dict(d=a.d, experts=a.experts, top_k=a.top_k, f=a.f).items() if v is not None})
    repeats = 2 if a.smoke else a.repeats
    rng = np.random.default_rng(0)
    d, e, k, f = cfg["d"], cfg["experts"], cfg["top_k"], cfg["f"]
    w = lambda *s: jnp.asarray(rng.normal(size=s).astype(np.float32) * 0.02)
    moe = {"gate_up": w(e, d, 2 * f), "down": w(e, f, d)}
    if cfg["router"] == "gemma4":
        router = {"scale": jnp.ones(d), "proj": w(d, e), "per_expert_scale": jnp.ones(e)}
        route = lambda p, x: gemma4_route(p, x, k, 1e-6)
    else:   # Qwen3-MoE / Qwen3-VL-MoE: softmax, top-k, renormalised (norm_topk_prob)
        router = w(d, e)
        route = lambda p, x: softmax_topk_route(lambda h: matmul(h, p), x, k, True)
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

    makers = {"moe-ragged": lambda: moe_block("ragged"), "moe-skip": lambda: moe_block("skip"),
              "dense-active": lambda: dense(k * f), "dense-all": lambda: dense(e * f)}
    variants = {name: makers[name]() for name in VARIANTS if name in a.variants}
    rows = []
    for b in a.batches:
        x = w(b, d)
        row, runs = {"batch": b}, {}
        for name, fn in variants.items():
            ms, runs[name] = _median_ms(fn, x, repeats=repeats, budget_s=None if a.smoke else a.budget_s)
            row[name] = round(ms, 4)
        row["runs"] = runs
        rows.append(row)
        ratio = (f"  moe-skip/dense-active {row['moe-skip'] / row['dense-active']:.2f}x"
                 if "moe-skip" in row and "dense-active" in row else "")
        print(f"batch {b:3d}: " + "  ".join(f"{n} {row[n]:.3f} ms ({runs[n]} runs)" for n in variants) + ratio)
    print(json.dumps({"backend": jax.default_backend(), "preset": a.preset, "router": cfg["router"], "d": d,
                      "experts": e, "top_k": k, "f": f, "smoke": a.smoke, "rows": rows}))


if __name__ == "__main__":
    main()
