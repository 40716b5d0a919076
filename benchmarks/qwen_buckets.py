"""Qwen2-VL packed-encode bucket ladders: padding waste on real-world image sizes, compile counts,
and (with --time) the tiny model's 4K encode time, compile vs cached, plus memory_analysis.

    python -m benchmarks.qwen_buckets            # waste table (host only, seconds)
    python -m benchmarks.qwen_buckets --time     # + tiny-model 4K encode timings / memory

Waste = padded patches / bucket size, over (a) every image alone and (b) random packs of 1-4
images from the mix (one encode call each, at most `max_encode_patches` patches per call).
Prints a table and one JSON line.

Measured (2 shared CPU cores, default max_pixels 1003520; "1.25x+cap" is QwenVLFamily.encode_ladder:
x1.25 steps from 256 patches rounded to 64, plus a rung at the largest default-resized image
(5120 patches) and at the token cap, top 16384):

    ladder     rungs  alone: waste  worst   packs of 1-4: waste  worst
    pow2           7        37.5%   41.6%                26.9%  49.3%
    1.5x          12        26.8%   31.2%                16.0%  33.3%
    1.25x         19        16.6%   20.7%                10.2%  20.7%
    1.25x+cap     20         7.2%   20.7%                 8.8%  20.7%
    1.125x        32         8.2%   12.5%                 5.9%  12.7%

Tiny model, 3840x2160: default max_pixels -> 4888 patches (1222 tokens), bucket 5120: compile
~2.4-2.8 s, cached encode ~0.4 s, temp 8.5-8.9 MiB (naive O(N^2) attention: ~400 MiB). Native
(max_pixels=3840*2160) -> 42196 patches (10549 tokens), bucket 42316: compile ~2.3 s, cached
encode ~23-25 s (O(N^2) full-attention blocks on 2 cores), temp 67.5-70.1 MiB vs ~27 GB naive.
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np

from mmjax.models.vision.qwen2_vl import patch_ladder
from mmjax.image.processors import Qwen2VLImagePolicy

SIZES = [(640, 480), (800, 600), (1024, 768), (1280, 720), (1920, 1080), (1080, 1920), (2048, 1536),
         (3840, 2160), (4032, 3024), (512, 512), (300, 400), (1170, 2532)]  # (width, height)


def pow2_ladder(top: int, lo: int = 256) -> tuple[int, ...]:
    out, x = [], lo
    while x < top:
        out.append(x)
        x *= 2
    return tuple(out) + (top,)


def ladders(cap: int, top: int) -> dict[str, tuple[int, ...]]:
    """Candidates; `cap` = patches of the largest single image (image_max_tokens * 4)."""
    def with_cap(ladder):
        return tuple(sorted(set(ladder) | {cap}))
    # "1.25x+cap" is what QwenVLFamily.encode_ladder uses.
    return {
        "pow2": pow2_ladder(top),
        "pow2+cap": with_cap(pow2_ladder(top)),
        "1.5x": patch_ladder(top, ratio=1.5),
        "1.25x": patch_ladder(top, ratio=1.25),
        "1.25x+cap": patch_ladder(top, ratio=1.25, extra=(cap,)),
        "1.125x": patch_ladder(top, ratio=1.125),
    }


def bucket(n: int, ladder) -> int:
    return next(b for b in ladder if b >= n)


def waste_stats(calls: list[int], ladder) -> tuple[float, float]:
    """(total waste = padded/all bucket patches, worst single call)."""
    b = np.array([bucket(n, ladder) for n in calls])
    n = np.array(calls)
    return float((b - n).sum() / b.sum()), float(((b - n) / b).max())


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser()
    ap.add_argument("--time", action="store_true", help="also time the tiny model's 4K encode")
    ap.add_argument("--max-pixels", type=int, default=None, help="server max_pixels (default: HF's 1003520)")
    ap.add_argument("--packs", type=int, default=2000)
    args = ap.parse_args(argv)

    policy = Qwen2VLImagePolicy()
    hi = args.max_pixels or policy.max_pixels
    m2 = policy.merge_size ** 2
    patches = {f"{w}x{h}": policy.num_tokens(h, w, max_pixels=hi) * m2 for w, h in SIZES}
    cap = hi // policy.factor ** 2 * m2
    top = max(16384, cap)
    rng = np.random.default_rng(0)
    singles = list(patches.values())
    packs = []
    for _ in range(args.packs):
        k = int(rng.integers(1, 5))
        sel = [singles[i] for i in rng.integers(0, len(singles), k)]
        # greedy split at `top`, like QwenVLFamily.encode_batch
        cur = 0
        for s in sel:
            if cur and cur + s > top:
                packs.append(cur)
                cur = 0
            cur += s
        packs.append(cur)
    print(f"max_pixels={hi}: patches per image (tokens = patches / {m2})")
    for name, n in patches.items():
        print(f"  {name:>10}: {n:6d} patches")
    rows = {}
    print(f"\n{'ladder':>10} {'rungs':>5} {'alone: total':>13} {'worst':>6} {'packs: total':>13} {'worst':>6}")
    for name, ladder in ladders(cap, top).items():
        a, aw = waste_stats(singles, ladder)
        p, pw = waste_stats(packs, ladder)
        rows[name] = {"rungs": len(ladder), "alone_waste": round(a, 4), "alone_worst": round(aw, 4),
                      "pack_waste": round(p, 4), "pack_worst": round(pw, 4)}
        print(f"{name:>10} {len(ladder):5d} {a:13.1%} {aw:6.1%} {p:13.1%} {pw:6.1%}")
    result = {"bench": "qwen_buckets", "max_pixels": hi, "patches": patches, "ladders": rows}
    if args.time:
        result["encode_4k"] = time_4k()
    print(json.dumps(result))
    return result


def time_4k() -> dict:
    """Tiny Qwen2-VL / Qwen2.5-VL: 3840x2160 at default max_pixels and at native resolution."""
    import os
    import tempfile

    import jax

    os.environ.setdefault("MMJAX_COMPILATION_CACHE", "0")
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
    from flax import nnx

    import mmjax
    from mmjax.models.qwen2_vl import Qwen2VLModel
    from tiny_qwen import build_qwen

    img_rng = np.random.default_rng(0)
    from PIL import Image
    img = Image.fromarray(img_rng.integers(0, 256, (2160, 3840, 3), dtype=np.uint8))
    out = {}
    with tempfile.TemporaryDirectory() as d:
        for fam in ("qwen2_vl", "qwen2_5_vl"):
            vlm = mmjax.load(build_qwen(f"{d}/{fam}", family=fam), max_num_seqs=1, max_model_len=256)
            f, r = vlm.family, vlm.engine.runner
            for label, opts in (("default", {}), ("native", {"max_pixels": 3840 * 2160,
                                                            "image_max_tokens": 16384})):
                f.configure(**opts)
                t = time.perf_counter()
                im = f.prepare_image(img)
                prep = time.perf_counter() - t
                times = []
                for _ in range(2 if label == "native" else 4):
                    t = time.perf_counter()
                    r.encode_images([im])
                    times.append(time.perf_counter() - t)
                n = int(np.prod(im.grid))
                bucket_n = max(s[0] for s in r.compiled["encode"] if s[0] >= n)
                pk = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), f.dummy_packed(bucket_n))
                ps = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), nnx.state(vlm.model))
                mem, compile_s = {}, {}
                for impl in ("auto", "reference"):
                    gd = nnx.graphdef(nnx.eval_shape(lambda: Qwen2VLModel(f.cfg, attn_impl=impl)))
                    fn = jax.jit(lambda state, packed, gd=gd: nnx.merge(gd, state).encode(packed))
                    t = time.perf_counter()
                    compiled = fn.lower(ps, pk).compile()
                    compile_s[impl] = time.perf_counter() - t
                    mem[impl] = compiled.memory_analysis().temp_size_in_bytes
                row = {"patches": n, "tokens": im.num_tokens, "bucket": bucket_n, "preprocess_s": round(prep, 3),
                       "first_call_s": round(times[0], 3), "cached_median_s": round(float(np.median(times[1:])), 3),
                       "compile_only_s": round(compile_s["auto"], 3),
                       "temp_bytes": mem["auto"], "temp_bytes_naive": mem["reference"]}
                out[f"{fam}/{label}"] = row
                print(f"{fam:>11} {label:>8}: {n} patches -> bucket {bucket_n}, {im.num_tokens} tokens; "
                      f"first call {times[0]:.2f}s (compile + run), cached {np.median(times[1:]):.2f}s, "
                      f"compile alone {compile_s['auto']:.2f}s; "
                      f"temp {mem['auto'] / 2**20:.1f} MiB vs naive {mem['reference'] / 2**20:.0f} MiB", flush=True)
                f.limits = type(f.limits)()  # back to the checkpoint's defaults
    return out


if __name__ == "__main__":
    main()
