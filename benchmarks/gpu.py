"""`mmjax bench gpu` / `python -m benchmarks.gpu`: the GPU path, timed in one run.

On a GPU (bfloat16):
  1. attention TFLOP/s, non-causal, N = 1k..64k, head_dim 64 / 80 / 128: mmjax's Pallas flash
     kernel, cuDNN (jax.nn.dot_product_attention) and tokamax (if installed: `pip install
     tokamax`; its own choice of kernel and its Triton kernel), each as % of the device's
     measured bf16 matmul peak (benchmarks/attention.py);
  2. decode tok/s at batch 1 / 16 / 64 (one compiled decode step, 512 cache positions in use) on
     the "gpu" random-weight LLaVA checkpoint (CLIP ViT-L/14-336 + a 24-layer hidden-2048
     Llama, ~1.6B params), with the weight bytes each step streams over the device's measured
     read bandwidth (roofline), and where a step's time goes: the host's dispatch, steps queued
     back to back, 16 steps in one call, and the kernels' own time (a profiler trace);
  3. TTFT of one image request (median of 5, preprocessing included);
  4. a 3840x2160 image through a Qwen2.5-VL-sized vision tower at native resolution (42,196
     patches, 10,549 tokens; ViT depth 32, hidden 1280, head_dim 80);
  5. engine throughput (AsyncEngine, closed-loop clients, 128 new tokens, greedy) at
     concurrency 16 and 64, and the same with --decode-steps (4) decode steps a call;
  6. the peer: transformers on the same device and checkpoint (bf16, its own process): decode
     tok/s of a padded batch of 1 / 16 / 64, TTFT, and the engine's requests as padded batches;
  7. the kernels' accuracy as compiled on this device (flash and ragged decode against the test
     suite's float64 oracles, the paged kernel against XLA's paged path), and A/Bs: decode with
     XLA's attention instead of the ragged kernel, over a paged KV cache (pages of 64: the paged
     kernel), with fp8 and with int8 weights.
Sections run in that priority order (accuracy first), each timed; one that fails is reported
and the rest still run; `--out` writes the JSON after every section and `--deadline-s` starts no
section past a time limit, so a run on a lent GPU with a short lease keeps what it measured.
No section compiles shapes it does not time (no engine warmup of every bucket).
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
import subprocess
import tempfile
import time
import traceback

import numpy as np


def on_gpu() -> bool:
    import jax
    return jax.default_backend() in ("gpu", "cuda", "rocm")


def memory_bandwidth(nbytes: int) -> tuple[float, float]:
    """Device memory bandwidth, bytes/s: (copy: `a + 1` over an nbytes f32 buffer, counting read
    + write; read: a sum of it, counting the read), each the best of 3 rounds of 5 calls queued
    back to back (`queued_seconds`: a wait per call added the virtualised host's round trip,
    a third of a 2 GiB sum on the lent H200s). Decode streams its weights, so the read rate is
    the roofline's denominator."""
    import jax
    import jax.numpy as jnp
    from benchmarks.attention import queued_seconds
    x = jnp.ones((nbytes // 4,), jnp.float32)
    rates = []
    for fn, moved in ((jax.jit(lambda a: a + 1.0), 2 * nbytes), (jax.jit(jnp.sum), nbytes)):
        best = min(queued_seconds(lambda: fn(x), 5) for _ in range(3))
        rates.append(moved / best)
    return rates[0], rates[1]


def param_bytes(tree) -> int:
    import jax
    return sum(int(np.prod(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(tree))


def decode_rates(vlm, batches: list[int], kv_len: int, bandwidth: float, repeats: int) -> list[dict]:
    """One decode step of `b` rows at `kv_len` positions: tok/s and the roofline (LM weights +
    the rows' KV read once per step, over the read bandwidth), and where the step's time goes:
    the host's dispatch, steps queued back to back, 16 steps in one call, and (on a GPU) the
    kernels' own time from a profiler trace."""
    r = vlm.engine.runner
    lm_bytes = param_bytes(r.lm_leaves)
    cfg = r.text_model.config
    kv_per_pos = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * np.dtype(vlm.loaded.dtype).itemsize
    rows = []
    for b in batches:
        at_positions(r, kv_len - 4 * repeats - 80)      # the steps below advance it to ~kv_len
        r.decode(kv_len, b)
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            r.decode(kv_len, b)
            times.append(time.perf_counter() - t0)
        step = statistics.median(times)
        # where a step's time goes: the host's dispatch alone (the call returning before the
        # step ran), and steps queued back to back (the engine's overlapped loop): a pipelined
        # step near the dispatch time is host-bound, near the waited step device-bound
        dispatch, pending = [], []
        t0 = time.perf_counter()
        for _ in range(2 * repeats):
            t1 = time.perf_counter()
            pending.append(r.decode(kv_len, b, wait=False))
            dispatch.append(time.perf_counter() - t1)
        pending[-1].result()
        pipelined = (time.perf_counter() - t0) / len(pending)
        floor = (lm_bytes + b * kv_len * kv_per_pos) / bandwidth
        busy = kernel_seconds_per_step(r, kv_len, b)
        rows.append({"batch": b, "kv_len": kv_len, "step_ms": step * 1e3, "tok_s": b / step,
                     "roofline_tok_s": b / floor, "roofline": floor / step,
                     "dispatch_ms": statistics.median(dispatch) * 1e3, "pipelined_step_ms": pipelined * 1e3,
                     "loop_step_ms": loop_step_seconds(r, kv_len, b) * 1e3,
                     "kernel_ms": None if busy is None else busy * 1e3,
                     "kernel_roofline": None if busy is None else floor / busy})
    vlm.engine.reset_device_state()
    return rows


def at_positions(r, n: int) -> None:
    """Every slot's decode state at `n` cache positions in use: a decode step reads each row's
    own keys (its length), not `max_length`, so without this a bench run from a fresh state
    reads a few dozen positions a row while the roofline counts kv_len."""
    import dataclasses

    import jax.numpy as jnp
    r.state = dataclasses.replace(r.state, lengths=jnp.full_like(r.state.lengths, max(n, 0)))


def loop_step_seconds(r, kv_len: int, rows: int, steps: int = 16) -> float:
    """Seconds per decode step of `rows` rows with `steps` steps in one call (the runner's
    multi-step decode step, a `lax.scan`, each step feeding the next its sampled tokens): the
    host's dispatch paid once a call, what the engine's `decode_steps` gets (XLA's GPU runtime
    may still launch the loop body once per iteration)."""
    import jax

    from mmjax.backend import compiling_for
    lens = np.full(r.text_model.num_layers, kv_len, np.int32)
    bits = r.all_allowed(rows)
    times = []
    with compiling_for(r.tuning.platform):
        for _ in range(4):                   # the first compiles
            t0 = time.perf_counter()
            r.cache, r.state, _ = jax.block_until_ready(
                r._decode(r.lm_leaves, r.cache, r.state, lens, bits, rows=rows, steps=steps))
            times.append(time.perf_counter() - t0)
    return min(times[1:]) / steps


def kernel_seconds_per_step(r, kv_len: int, rows: int, steps: int = 10) -> float | None:
    """The GPU's kernel time per decode step (the durations on its compute streams in a
    `jax.profiler` trace of `steps` waited steps), None off a GPU. An H200 ran the 24-layer
    bf16 16-row step in 1.7 ms of kernels within 4-5 ms of wall (benchmarks/README.md): the
    rest is the host's."""
    import glob
    import gzip

    import jax
    if not on_gpu():
        return None
    with tempfile.TemporaryDirectory() as d:
        jax.profiler.start_trace(d)
        try:
            for _ in range(steps):
                r.decode(kv_len, rows)
        finally:
            jax.profiler.stop_trace()
        traces = glob.glob(f"{d}/**/*.trace.json.gz", recursive=True)
        if not traces:
            return None
        busy = compute_stream_seconds(json.load(gzip.open(traces[0]))["traceEvents"])
    return busy / steps if busy else None


def compute_stream_seconds(events: list[dict]) -> float:
    """Seconds of kernels on a GPU's compute streams in a profiler trace's `traceEvents`."""
    meta = [e for e in events if e.get("ph") == "M"]
    gpu = {e["pid"] for e in meta if e.get("name") == "process_name" and "/device:GPU" in e["args"]["name"]}
    compute = {(e["pid"], e["tid"]) for e in meta if e.get("name") == "thread_name" and e["pid"] in gpu
               and "Compute" in e["args"]["name"]}
    return sum(e.get("dur", 0) for e in events if e.get("ph") == "X" and (e["pid"], e["tid"]) in compute) / 1e6


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
    return statistics.median(times[1:])        # the first compiles the encode / prefill shapes


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
            # the shapes c clients reach, compiled before the clock starts (warmup() of every bucket
            # would spend minutes of a lent GPU on shapes this run never uses)
            asyncio.run(run_mmjax(vlm, ae, make_requests(c, size, seed=1000 + c), c, 4))
            compiled = vlm.engine.runner.compile_seconds
            r = asyncio.run(run_mmjax(vlm, ae, make_requests(2 * c, size, seed=c), c, new_tokens))
            # a shape the warm pass missed compiles inside the timed run: reported, not hidden
            rows.append({"concurrency": c, "requests": 2 * c, "output_tok_s": r["tokens"] / r["wall_s"],
                         "ttft_p50_s": percentile(r["ttft"], 50), "ttft_p99_s": percentile(r["ttft"], 99),
                         "compile_s_in_run": vlm.engine.runner.compile_seconds - compiled,
                         "step_s": r["step_s"]})
    finally:
        ae.shutdown()
    return rows


SECTIONS = ("accuracy", "decode", "ttft", "engine", "engine-steps", "hf", "qwen4k", "attention", "decode-xla",
            "decode-paged", "decode-fp8", "decode-int8")


def kernel_accuracy(smoke: bool, dtypes: list[str]) -> list[dict]:
    """mmjax's Pallas kernels as compiled on this device (interpreted off a GPU) against the
    float64 oracles of tests/test_attention.py (flash: every case, f32 and bf16) and
    tests/test_kv_cache.py (ragged decode: f32 / bf16 / int8 / fp8 caches, with its own
    tolerance check), and the paged kernel against XLA's paged path (tests/test_paged_pallas.py:
    decode and prefill cases, its own tolerance check). rel_err = max|out - ref| / max|ref|."""
    import functools

    import jax
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
    import test_attention as ta
    import test_kv_cache as tk
    import test_paged_pallas as tp
    from mmjax.attention.flash import flash_attention
    rows = []
    for case in (["len127_gqa2_causal_d80"] if smoke else list(ta.CASES)):
        kw = ta.CASES[case][6]
        for dt in dtypes:
            q, k, v, want = ta._case_data(case, dt)
            out = jax.jit(functools.partial(flash_attention, **kw))(q, k, v)
            rows.append({"kernel": "flash", "case": case, "dtype": dt, "rel_err": ta.rel_err(out, want)})
    mark = next(m for m in tk.test_gpu_ragged_decode_kernel_matches_oracle.pytestmark if m.name == "parametrize")
    for params in (mark.args[1][:1] if smoke else mark.args[1]):
        window, group, dtype = params
        row = {"kernel": "ragged_decode", "window": window, "group": group, "dtype": jax.numpy.dtype(dtype).name}
        try:
            tk.test_gpu_ragged_decode_kernel_matches_oracle(window, group, dtype)
            row["within_test_tolerance"] = True
        except AssertionError as e:
            row["within_test_tolerance"] = False
            row["error"] = str(e)[:400]
        rows.append(row)
    for case in (list(tp.CASES)[:1] if smoke else list(tp.CASES)):
        row = {"kernel": "paged", "case": case}
        try:
            tp.test_paged_kernel_matches_xla_paged_path(case)
            row["within_test_tolerance"] = True
        except AssertionError as e:
            row["within_test_tolerance"] = False
            row["error"] = str(e)[:400]
        rows.append(row)
    return rows


def hf_peer(path: str, smoke: bool, batches: list[int], concurrency: list[int], new_tokens: int,
            size: int) -> dict:
    """transformers on the same device and checkpoint (bf16 on a GPU, f32 smoke), run in its own
    process (`main` spawns it): decode tok/s of a left-padded batch of b image requests (the
    time of `generate` for 1 + T new tokens minus that for 1, over T), TTFT of one request, and
    the engine's workload as a transformers user runs it (the 2c requests as two padded batches
    of c through `generate`)."""
    import torch
    from benchmarks.engine import hf_batch_inputs, make_requests, run_hf_batched
    from transformers import AutoProcessor, LlavaForConditionalGeneration
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.float32 if smoke else torch.bfloat16
    model = LlavaForConditionalGeneration.from_pretrained(path, dtype=dtype).to(device).eval()
    model.generation_config.eos_token_id = None
    proc = AutoProcessor.from_pretrained(path)

    def sync():
        if device == "cuda":
            torch.cuda.synchronize()

    def generate(reqs, n):
        inputs = hf_batch_inputs(proc, reqs, device)
        sync()
        t0 = time.perf_counter()
        with torch.inference_mode():
            model.generate(**inputs, max_new_tokens=n, do_sample=False, pad_token_id=3)
        sync()
        return time.perf_counter() - t0

    out: dict = {"device": device, "dtype": str(dtype).removeprefix("torch."),
                 "torch": torch.__version__, "transformers": __import__("transformers").__version__}
    steps = 4 if smoke else 64
    rows = []
    for b in batches:
        reqs = make_requests(b, size, seed=b)
        generate(reqs, 2)                                    # warm (cuBLAS handles, caches)
        t1 = statistics.median(generate(reqs, 1) for _ in range(3))
        tn = statistics.median(generate(reqs, 1 + steps) for _ in range(3))
        per = (tn - t1) / steps
        rows.append({"batch": b, "step_ms": per * 1e3, "tok_s": b / per})
    out["decode"] = rows
    one = make_requests(6, size, seed=7)
    out["ttft_s"] = statistics.median(generate([r], 1) for r in one[1:])
    eng = []
    for c in concurrency:
        reqs = make_requests(2 * c, size, seed=c)
        runs = [run_hf_batched((model, proc), reqs[i:i + c], new_tokens) for i in (0, c)]
        sync()
        eng.append({"concurrency": c, "requests": 2 * c,
                    "output_tok_s": sum(r["tokens"] for r in runs) / sum(r["wall_s"] for r in runs)})
    out["engine_batched"] = eng
    return out


def decode_variant(path: str, dtype: str, batches: list[int], kv_len: int, bandwidth: float, repeats: int,
                   max_model_len: int, *, quantize: str | None = None, pallas: bool = True,
                   page_size: int | None = None) -> list[dict]:
    """decode_rates on a fresh load: 8-bit weights (`quantize`), XLA's decode attention instead
    of the ragged Pallas kernel (`pallas=False`: the A/B behind the GPU choice), or a paged KV
    cache of `page_size` positions a page (on a GPU the paged Pallas kernel: the A/B behind
    `Tuning.page_size`), each row given pages of its own (the bench decodes without the
    engine's page table)."""
    import mmjax
    from mmjax import backend
    saved = backend.Tuning.pallas_kernels
    if not pallas:
        backend.Tuning.pallas_kernels = property(lambda self: False)
    try:
        vlm = mmjax.load(path, dtype=dtype, quantize=quantize, max_num_seqs=max(batches),
                         max_model_len=max_model_len, **({} if page_size is None else {"page_size": page_size}))
        r = vlm.engine.runner
        if r.paged:
            r.set_pages(np.arange(r.num_slots * r.max_pages).reshape(r.num_slots, r.max_pages) % r.num_pages)
        return decode_rates(vlm, batches, kv_len, bandwidth, repeats)
    finally:
        backend.Tuning.pallas_kernels = saved


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="mmjax bench gpu", description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true", help="tiny sizes (the default off a GPU)")
    ap.add_argument("--skip", nargs="*", default=[], choices=SECTIONS)
    ap.add_argument("--out", default=None, help="also write the result JSON here after every section "
                    "(a run cut off keeps what it measured)")
    ap.add_argument("--deadline-s", type=float, default=None,
                    help="start no section after this many seconds (the rest are listed as not run)")
    ap.add_argument("--decode-batches", type=int, nargs="+", default=None,
                    help="mmjax's decode rows (default 1 16 64; the peer's stay 1 16 64): each is a compile")
    ap.add_argument("--attention-n", type=int, nargs="+", default=None, help="default 1024 4096 16384 65536")
    ap.add_argument("--attention-head-dims", type=int, nargs="+", default=None, help="default 64 80 128")
    ap.add_argument("--accuracy-dtypes", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16"],
                    help="the flash cases' dtypes in the accuracy section")
    ap.add_argument("--decode-steps", type=int, default=4,
                    help="decode steps a call in the engine-steps section (the engine A/B against one step)")
    ap.add_argument("--hf-peer", default=None, help=argparse.SUPPRESS)   # the peer's own process
    args = ap.parse_args(argv)
    t_start = time.perf_counter()
    # the transformers peer runs in a process of its own next to this one: leave it GPU memory
    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.6")
    smoke = args.smoke or not on_gpu()
    batches, conc = ([1, 2], [2]) if smoke else ([1, 16, 64], [16, 64])
    new_tokens = 8 if smoke else 128
    if args.hf_peer:
        size = json.loads(open(os.path.join(args.hf_peer, "config.json")).read())["vision_config"]["image_size"]
        print(json.dumps(hf_peer(args.hf_peer, smoke, batches, conc, new_tokens, size)))
        return 0

    import jax
    import jax.numpy as jnp

    import mmjax
    from benchmarks import attention as attn_bench
    from benchmarks.checkpoints import build_llava

    dtype = "float32" if smoke else "bfloat16"
    result = {"bench": "gpu", "smoke": smoke, "backend": jax.default_backend(),
              "device": str(jax.devices()[0].device_kind), "dtype": dtype, "jax": jax.__version__,
              "section_s": {}}
    copy_bw, bandwidth = memory_bandwidth(2**24 if smoke else 2**31)
    result["copy_bw_bytes_s"], result["read_bw_bytes_s"] = copy_bw, bandwidth
    repeats = 3 if smoke else 10
    kv_len, max_model_len = (128, 256) if smoke else (512, 2048)
    path = str(build_llava("smoke" if smoke else "gpu"))
    model: dict = {}

    def load(**kw):
        return mmjax.load(path, dtype=dtype, max_num_seqs=max(batches + conc), max_model_len=max_model_len,
                          prefill_chunk=64 if smoke else 1024, max_encode_batch=2 if smoke else 16, **kw)

    def vlm():
        if "vlm" not in model:
            model["vlm"] = load()
            result["lm_weight_bytes"] = param_bytes(model["vlm"].engine.runner.lm_leaves)
        return model["vlm"]

    def attention():
        impls = ["reference", "chunked"] if smoke else ["flash", "cudnn", "tokamax", "tokamax-triton"]
        ns, hds = ([256, 512], [64]) if smoke else ([1024, 4096, 16384, 65536], [64, 80, 128])
        ns, hds = args.attention_n or ns, args.attention_head_dims or hds
        return attn_bench.run(ns, hds, 4 if smoke else 16, 1, jnp.dtype(dtype), impls, 60.0 if smoke else 600.0,
                              False)

    def engine():
        v = vlm()
        before = v.engine.stats()["compile_seconds"]
        rows = engine_throughput(v, conc, new_tokens, v.family.cfg.vision.image_size)
        result["engine_compile_s"] = v.engine.stats()["compile_seconds"] - before
        return rows

    def engine_steps():      # the A/B: the same engine taking --decode-steps tokens a decode call
        release()            # two engines' KV caches (~26 GB each) would not fit an H100's 60%
        v = load(decode_steps=args.decode_steps)
        try:
            return {"decode_steps": args.decode_steps,
                    "rows": engine_throughput(v, conc, new_tokens, v.family.cfg.vision.image_size)}
        finally:
            del v

    def hf():
        cmd = [sys.executable, "-m", "benchmarks.gpu", "--hf-peer", path] + (["--smoke"] if smoke else [])
        env = dict(os.environ, CUDA_VISIBLE_DEVICES=os.environ.get("CUDA_VISIBLE_DEVICES", "0"))
        out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900,
                             cwd=os.path.join(os.path.dirname(__file__), ".."))
        if out.returncode != 0:
            raise RuntimeError(f"transformers peer failed: {out.stderr[-1500:]}")
        return json.loads(out.stdout.strip().splitlines()[-1])

    def qwen4k():
        with tempfile.TemporaryDirectory() as d:
            return qwen_4k_encode(smoke, d, 1 if smoke else 3)

    def release():            # the A/B loads below get the device memory of the first
        model.pop("vlm", None)
        import gc
        gc.collect()
        return None

    sections = [
        ("accuracy", "kernel_accuracy", lambda: kernel_accuracy(smoke, args.accuracy_dtypes)),
        ("decode", "decode", lambda: decode_rates(vlm(), args.decode_batches or batches, kv_len, bandwidth, repeats)),
        ("ttft", "ttft_s", lambda: ttft(vlm(), vlm().family.cfg.vision.image_size, 2 if smoke else 5)),
        ("engine", "engine", engine),
        ("engine-steps", "engine_multistep", engine_steps),
        ("hf", "transformers", hf),
        ("qwen4k", "qwen_4k_encode", qwen4k),
        ("attention", "attention", attention),
        ("decode-xla", "decode_xla_attention",
         lambda: release() or decode_variant(path, dtype, args.decode_batches or batches, kv_len, bandwidth, repeats, max_model_len,
                                             pallas=False)),
        ("decode-paged", "decode_paged_kv",
         lambda: decode_variant(path, dtype, args.decode_batches or batches, kv_len, bandwidth, repeats, max_model_len,
                                page_size=64)),
        ("decode-fp8", "decode_fp8_weights",
         lambda: decode_variant(path, dtype, args.decode_batches or batches, kv_len, bandwidth, repeats, max_model_len,
                                quantize="fp8")),
        ("decode-int8", "decode_int8_weights",
         lambda: decode_variant(path, dtype, args.decode_batches or batches, kv_len, bandwidth, repeats, max_model_len,
                                quantize="int8")),
    ]
    for name, key, fn in sections:
        if name in args.skip:
            continue
        elapsed = time.perf_counter() - t_start
        if args.deadline_s is not None and elapsed > args.deadline_s:
            result.setdefault("not_run", []).append(name)
            continue
        print(f"[bench gpu {elapsed:6.1f} s] {name}", file=sys.stderr, flush=True)
        t0 = time.perf_counter()
        try:
            result[key] = fn()
        except Exception as e:   # report it, measure the rest
            traceback.print_exc()
            result.setdefault("errors", {})[name] = f"{type(e).__name__}: {e}"[:2000]
        result["section_s"][name] = time.perf_counter() - t0
        if args.out:
            with open(args.out, "w") as f:
                json.dump(result, f)
    print(format_table(result))
    print(json.dumps(result))
    return 0


def format_table(r: dict) -> str:
    lines = [f"bench gpu: {r['device']} ({r['backend']}), {r['dtype']}{' [SMOKE: not figures]' if r['smoke'] else ''};"
             f" copy bandwidth {r['copy_bw_bytes_s'] / 1e9:.1f} GB/s, read {r['read_bw_bytes_s'] / 1e9:.1f} GB/s"
             " (the decode roofline's)"]
    if "attention" in r:
        from benchmarks.attention import format_table as attention_table
        lines.append(attention_table(r["attention"]))
    for a in r.get("kernel_accuracy", []):
        if a["kernel"] == "flash":
            lines.append(f"accuracy flash {a['case']:<28} {a['dtype']:<8} rel_err {a['rel_err']:.2e}")
        elif a["kernel"] == "paged":
            lines.append(f"accuracy paged {a['case']:<28} "
                         f"{'within' if a['within_test_tolerance'] else 'OUTSIDE'} the test's tolerance")
        else:
            lines.append(f"accuracy ragged decode window {a['window']} group {a['group']} {a['dtype']:<13} "
                         f"{'within' if a['within_test_tolerance'] else 'OUTSIDE'} the test's tolerance")
    hf = r.get("transformers", {})
    hf_decode = {d["batch"]: d for d in hf.get("decode", [])}
    for key, label in (("decode", "decode"), ("decode_xla_attention", "decode, XLA attention"),
                       ("decode_paged_kv", "decode, paged KV (64)"), ("decode_fp8_weights", "decode, fp8 weights"),
                       ("decode_int8_weights", "decode, int8 weights")):
        for d in r.get(key, []):
            peer = hf_decode.get(d["batch"]) if key == "decode" else None
            lines.append(f"{label} batch {d['batch']:>3} @ {d['kv_len']} positions: {d['step_ms']:8.2f} ms/step "
                         f"{d['tok_s']:9.1f} tok/s  (roofline {d['roofline_tok_s']:.0f} tok/s, "
                         f"{100 * d['roofline']:.0f}%; dispatch {d['dispatch_ms']:.2f} ms, queued back to back "
                         f"{d['pipelined_step_ms']:.2f} ms/step; 16 steps a call {d['loop_step_ms']:.2f} ms/step"
                         + ("" if d.get("kernel_ms") is None else f"; kernels {d['kernel_ms']:.2f} ms/step, "
                            f"{100 * d['kernel_roofline']:.0f}% of roofline") + ")"
                         + (f"; transformers {peer['tok_s']:.1f} tok/s, mmjax/hf "
                                                            f"{d['tok_s'] / peer['tok_s']:.2f}x" if peer else ""))
    shown = {d["batch"] for d in r.get("decode", [])}
    for d in hf.get("decode", []):
        if d["batch"] not in shown:
            lines.append(f"transformers decode batch {d['batch']:>3}: {d['step_ms']:8.2f} ms/step {d['tok_s']:9.1f} tok/s")
    if "ttft_s" in r:
        lines.append(f"TTFT one image request: {r['ttft_s'] * 1e3:.1f} ms"
                     + (f"; transformers {hf['ttft_s'] * 1e3:.1f} ms" if "ttft_s" in hf else ""))
    hf_engine = {e["concurrency"]: e for e in hf.get("engine_batched", [])}
    for c, e in hf_engine.items():
        if not any(x["concurrency"] == c for x in r.get("engine", [])):
            lines.append(f"transformers batched, concurrency {c:>3}: {e['output_tok_s']:9.1f} tok/s")
    if "ttft_s" in hf and "ttft_s" not in r:
        lines.append(f"transformers TTFT one image request: {hf['ttft_s'] * 1e3:.1f} ms")
    for e in r.get("engine", []):
        peer = hf_engine.get(e["concurrency"])
        lines.append(f"engine concurrency {e['concurrency']:>3}: {e['output_tok_s']:9.1f} tok/s, TTFT p50 "
                     f"{e['ttft_p50_s'] * 1e3:.0f} ms, p99 {e['ttft_p99_s'] * 1e3:.0f} ms, compiles in the run "
                     f"{e['compile_s_in_run']:.1f} s"
                     + (f"; transformers batched {peer['output_tok_s']:.1f} tok/s, mmjax/hf "
                        f"{e['output_tok_s'] / peer['output_tok_s']:.2f}x" if peer else ""))
    multi = r.get("engine_multistep", {})
    for e in multi.get("rows", []):
        one = next((x for x in r.get("engine", []) if x["concurrency"] == e["concurrency"]), None)
        lines.append(f"engine, {multi['decode_steps']} decode steps a call, concurrency {e['concurrency']:>3}: "
                     f"{e['output_tok_s']:9.1f} tok/s, TTFT p50 {e['ttft_p50_s'] * 1e3:.0f} ms, p99 "
                     f"{e['ttft_p99_s'] * 1e3:.0f} ms, compiles in the run {e['compile_s_in_run']:.1f} s"
                     + (f"; {e['output_tok_s'] / one['output_tok_s']:.2f}x one step a call" if one else ""))
    if "qwen_4k_encode" in r:
        q = r["qwen_4k_encode"]
        lines.append(f"Qwen2.5-VL image encode (3840x2160 native; smoke 320x240): {q['patches']} patches -> {q['tokens']} tokens in "
                     f"{q['encode_s']:.3f} s (first call {q['first_call_s']:.1f} s)")
    for name, err in r.get("errors", {}).items():
        lines.append(f"section {name} FAILED: {err.splitlines()[0][:200]}")
    if r.get("not_run"):
        lines.append(f"not run (--deadline-s): {', '.join(r['not_run'])}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
