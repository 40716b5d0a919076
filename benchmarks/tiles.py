"""Tiling families (Idefics3, SmolVLM): encode cost of one tiled image vs as many one-view images.

    python -m benchmarks.tiles --model DIR_OR_HUB_ID [--tiles 4] [--max-encode-batch 8] [--repeat 5]

Every tile (and the global image) is one compiled shape, so the views of one image with `--tiles`
tiles (+ its global image) and `--tiles + 1` images sent with `max_tiles=0` (global image only)
go through the same encode batch ladder: the same calls, the same compiled buckets and, on an
idle machine, the same time. Prints a table (encode calls, buckets, median seconds after a warm-up
call) and one JSON line. Run it alone on the machine (DESIGN.md "Performance method").
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np
from PIL import Image

import mmjax


def tiled_size(family, tiles: int) -> tuple[int, int]:
    """(width, height) of an input whose grid has exactly `tiles` tiles (the grid follows the
    aspect ratio: inputs are resized to the processor's longest edge first)."""
    for w in range(64, 4097, 32):
        for h in range(64, w + 1, 32):
            rows, cols = family.policy.grid(h, w)
            if rows * cols == tiles:
                return w, h
    raise SystemExit(f"no image size gives a grid of {tiles} tiles with this checkpoint's processor")


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--tiles", type=int, default=4)
    ap.add_argument("--max-encode-batch", type=int, default=8)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--dtype", default="float32")
    args = ap.parse_args(argv)
    vlm = mmjax.load(args.model, dtype=args.dtype, max_num_seqs=1, max_encode_batch=args.max_encode_batch)
    fam, runner = vlm.family, vlm.engine.runner
    if not hasattr(fam, "policy") or not hasattr(fam.policy, "tile"):
        raise SystemExit(f"{fam.name} is not a tiling family")
    rng = np.random.default_rng(0)

    def noise(w, h):
        return Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))
    w, h = tiled_size(fam, args.tiles)
    one = vlm.prepare_images([noise(w, h)])
    many = vlm.prepare_images([noise(w, h) for _ in range(args.tiles + 1)], {"max_tiles": 0})
    rows = {}
    for name, images in (("1 tiled image", one), (f"{len(many)} one-view images", many)):
        plan = fam.encode_plan(images, args.max_encode_batch)
        runner.encode_images(images)                                   # compile / warm
        times = []
        for _ in range(args.repeat):
            t0 = time.perf_counter()
            runner.encode_images(images)
            times.append(time.perf_counter() - t0)
        rows[name] = {"views": sum(len(im.pixels) for im in images), "calls": len(plan),
                      "buckets": [c.bucket[0] for c in plan], "median_s": statistics.median(times)}
    print(f"{'input':<22} {'views':>5} {'calls':>5} {'buckets':<12} {'median s':>9}")
    for name, r in rows.items():
        print(f"{name:<22} {r['views']:>5} {r['calls']:>5} {str(r['buckets']):<12} {r['median_s']:>9.4f}")
    a, b = rows.values()
    out = {"model": args.model, "tiles": args.tiles, "views": a["views"], "calls_tiled": a["calls"],
           "calls_single": b["calls"], "encode_tiled_s": a["median_s"], "encode_single_s": b["median_s"],
           "tiled_vs_single": a["median_s"] / b["median_s"]}
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
