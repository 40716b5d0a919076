"""`mmjax bench gpu` / `python -m benchmarks.gpu`: the GPU path, timed in one run.

On a GPU (bfloat16):
  1. attention TFLOP/s, non-causal, N = 1k..64k, head_dim 64 / 80 / 128: mmjax's Pallas flash
     kernel, cuDNN (jax.nn.dot_product_attention) and tokamax (if installed: `pip install
     tokamax`), each as % of the device's measured bf16 matmul peak (benchmarks/attention.py);
  2. decode tok/s at batch 1 / 16 / 64 (one compiled decode step, 512 cache positions in use) on
     the "gpu" random-weight LLaVA checkpoint (CLIP ViT-L/14-336 + a 24-layer hidden-2048
     Llama, ~1.6B params), with the weight bytes each step streams over the device's measured
     copy bandwidth (roofline);
  3. TTFT of one image request (median of 5, preprocessing included);
  4. a 3840x2160 image through a Qwen2.5-VL-sized vision tower at native resolution (42,196
     patches, 10,549 tokens; ViT depth 32, hidden 1280, head_dim 80);
  5. engine throughput (AsyncEngine, closed-loop clients, 128 new tokens, greedy) at
     concurrency 16 and 64.
Elsewhere it runs in a smoke mode (tiny checkpoints, small N; float32): the same code end to end,
no figures worth reading. Prints a table, then one JSON line.

tokamax is a peer here, not inside mmjax's compiled steps: its ops refuse to trace off-GPU
("Not supported on cpu"), so a step using it could not be exported for CUDA in CI
(tests/test_cuda_lowering.py), which every compiled step must be.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time

import numpy as np


def on_gpu() -> bool:
    import jax
    return jax.default_backend() in ("gpu", "cuda", "rocm")


def copy_bandwidth(nbytes: int) -> float:
    """Device memory bandwidth, bytes/s: best of 5 copies of an nbytes buffer (read + write)."""
    import jax
    import jax.numpy as jnp
    x = jnp.ones((nbytes // 4,), jnp.float32)
    f = jax.jit(lambda a: a + 1.0)
    f(x).block_until_ready()
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        f(x).block_until_ready()
        best = min(best, time.perf_counter() - t0)
    return 2 * nbytes / best


def param_bytes(tree) -> int:
    import jax
    return sum(int(np.prod(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(tree))


def decode_rates(vlm, batches: list[int], kv_len: int, bandwidth: float, repeats: int) -> list[dict]:
    """One decode step of `b` rows at `kv_len` positions: tok/s and the roofline (LM weights +
    the rows' KV read once per step, over the copy bandwidth)."""
    r = vlm.engine.runner
    lm_bytes = param_bytes(r.params["text"])
    tm = vlm.family.text_model
    cfg = tm.cfg
    kv_per_pos = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * np.dtype(vlm.model.dtype).itemsize
    rows = []
    for b in batches:
        r.decode(kv_len, b)
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            r.decode(kv_len, b)
            times.append(time.perf_counter() - t0)
        step = statistics.median(times)
        floor = (lm_bytes + b * kv_len * kv_per_pos) / bandwidth
        rows.append({"batch": b, "kv_len": kv_len, "step_ms": step * 1e3, "tok_s": b / step,
                     "roofline_tok_s": b / floor, "roofline": floor / step})
    vlm.engine.reset_device_state()
    return rows


def ttft(vlm, size: int, repeats: int) -> float:
    """Median seconds from request to first token for one image + question (engine idle)."""
    import mmjax
    from benchmarks.engine import make_requests
    sp = mmjax.SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    times = []
    for img, q in make_requests(repeats + 1, size, seed=7):
        t0 = time.perf_counter()
        vlm.chat([{"role": "user", "content": [{"type": "image", "image": img}, {"type": "text", "text": q}]}], sp)
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])        # the first compiles nothing new but warms the caches


def qwen_4k_encode(smoke: bool, out_dir: str, repeats: int) -> dict:
    """A 3840x2160 image at native resolution through a Qwen2.5-VL vision tower of the released
    size (smoke: a 320x240 image through the tiny test tower)."""
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
    import mmjax
    from PIL import Image
    from tiny_qwen import build_qwen
    vision = None if smoke else dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16,
                                     out_hidden_size=64, hidden_act="silu", patch_size=14, spatial_merge_size=2,
                                     temporal_patch_size=2, window_size=112, fullatt_block_indexes=[7, 15, 23, 31])
    path = build_qwen(f"{out_dir}/qwen2_5_vl", family="qwen2_5_vl", vision_overrides=vision)
    vlm = mmjax.load(path, dtype="float32" if smoke else "bfloat16", max_num_seqs=1, max_model_len=256)
    f, r = vlm.family, vlm.engine.runner
    w, h = (320, 240) if smoke else (3840, 2160)
    f.configure(max_pixels=w * h, image_max_tokens=16384)
    img = Image.fromarray(np.random.default_rng(0).integers(0, 256, (h, w, 3), dtype=np.uint8))
    im = f.prepare_image(img)
    times = []
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        r.encode_images([im])
        times.append(time.perf_counter() - t0)
    return {"patches": int(np.prod(im.grid)), "tokens": im.num_tokens, "first_call_s": times[0],
            "encode_s": statistics.median(times[1:])}


def engine_throughput(vlm, concurrency: list[int], new_tokens: int, size: int) -> list[dict]:
    from benchmarks.engine import make_requests, percentile, run_mmjax
    from mmjax.serving import AsyncEngine
    ae = AsyncEngine(vlm.engine, max_waiting=10_000)
    rows = []
    try:
        for c in concurrency:
            r = asyncio.run(run_mmjax(vlm, ae, make_requests(2 * c, size, seed=c), c, new_tokens))
            rows.append({"concurrency": c, "requests": 2 * c, "output_tok_s": r["tokens"] / r["wall_s"],
                         "ttft_p50_s": percentile(r["ttft"], 50), "ttft_p99_s": percentile(r["ttft"], 99)})
    finally:
        ae.shutdown()
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="mmjax bench gpu", description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true", help="tiny sizes (the default off a GPU)")
    ap.add_argument("--skip", nargs="*", default=[], choices=["attention", "decode", "ttft", "qwen4k", "engine"])
    args = ap.parse_args(argv)
    smoke = args.smoke or not on_gpu()

    import jax
    import jax.numpy as jnp

    import mmjax
    from benchmarks import attention as attn_bench
    from benchmarks.checkpoints import build_llava

    dtype = "float32" if smoke else "bfloat16"
    result = {"bench": "gpu", "smoke": smoke, "backend": jax.default_backend(),
              "device": str(jax.devices()[0].device_kind), "dtype": dtype}
    bandwidth = copy_bandwidth(2**24 if smoke else 2**31)
    result["copy_bw_bytes_s"] = bandwidth
    if "attention" not in args.skip:
        impls = ["reference", "chunked"] if smoke else ["flash", "cudnn", "tokamax"]
        ns, hds = ([256, 512], [64]) if smoke else ([1024, 4096, 16384, 65536], [64, 80, 128])
        result["attention"] = attn_bench.run(ns, hds, 4 if smoke else 16, 1, jnp.dtype(dtype), impls,
                                             60.0 if smoke else 600.0, False)
    path = str(build_llava("smoke" if smoke else "gpu"))
    batches, conc = ([1, 2], [2]) if smoke else ([1, 16, 64], [16, 64])
    vlm = mmjax.load(path, dtype=dtype, max_num_seqs=max(batches + conc), max_model_len=256 if smoke else 2048,
                     prefill_chunk=64 if smoke else 1024, max_encode_batch=2 if smoke else 16)
    size = vlm.family.cfg.vision.image_size
    if not smoke:     # compile every shape first (smoke: only what runs, compiled as it runs)
        t0 = time.perf_counter()
        vlm.engine.warmup()
        result["warmup_s"] = time.perf_counter() - t0
    result["lm_weight_bytes"] = param_bytes(vlm.engine.runner.params["text"])
    repeats = 3 if smoke else 10
    if "decode" not in args.skip:
        result["decode"] = decode_rates(vlm, batches, 128 if smoke else 512, bandwidth, repeats)
    if "ttft" not in args.skip:
        result["ttft_s"] = ttft(vlm, size, 2 if smoke else 5)
    if "engine" not in args.skip:
        result["engine"] = engine_throughput(vlm, conc, 8 if smoke else 128, size)
    if "qwen4k" not in args.skip:
        with tempfile.TemporaryDirectory() as d:
            result["qwen_4k_encode"] = qwen_4k_encode(smoke, d, 1 if smoke else 3)
    print(format_table(result))
    print(json.dumps(result))
    return 0


def format_table(r: dict) -> str:
    lines = [f"bench gpu: {r['device']} ({r['backend']}), {r['dtype']}{' [SMOKE: not figures]' if r['smoke'] else ''};"
             f" copy bandwidth {r['copy_bw_bytes_s'] / 1e9:.1f} GB/s"]
    if "attention" in r:
        from benchmarks.attention import format_table as attention_table
        lines.append(attention_table(r["attention"]))
    for d in r.get("decode", []):
        lines.append(f"decode batch {d['batch']:>3} @ {d['kv_len']} positions: {d['step_ms']:8.2f} ms/step "
                     f"{d['tok_s']:9.1f} tok/s  (roofline {d['roofline_tok_s']:.0f} tok/s, {100 * d['roofline']:.0f}%)")
    if "ttft_s" in r:
        lines.append(f"TTFT one image request: {r['ttft_s'] * 1e3:.1f} ms")
    for e in r.get("engine", []):
        lines.append(f"engine concurrency {e['concurrency']:>3}: {e['output_tok_s']:9.1f} tok/s, TTFT p50 "
                     f"{e['ttft_p50_s'] * 1e3:.0f} ms, p99 {e['ttft_p99_s'] * 1e3:.0f} ms")
    if "qwen_4k_encode" in r:
        q = r["qwen_4k_encode"]
        lines.append(f"Qwen2.5-VL image encode (3840x2160 native; smoke 320x240): {q['patches']} patches -> {q['tokens']} tokens in "
                     f"{q['encode_s']:.3f} s (first call {q['first_call_s']:.1f} s)")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
