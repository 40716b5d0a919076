"""`mmjax bench engine` / `python -m benchmarks.engine`: serving throughput of the engine.

On one random-weight LLaVA-architecture checkpoint (default ~342M params: CLIP ViT-B/16 224 px +
16-layer Llama hidden 1024; `--smoke` for a toy one), the same requests (a distinct 224x224 image
+ ~32-token question each, 64 new tokens, greedy, EOS ignored) are run:
  - by mmjax's AsyncEngine with 1, 4 and 16 concurrent closed-loop clients (continuous batching),
  - by transformers `generate` on one left-padded batch of the same requests as mmjax's highest
    concurrency level (same images, prompts, max_new_tokens, greedy: the way a transformers user
    batches; the strongest ordinary peer),
  - one at a time through transformers `generate` (the sequential peer), in the same run.
Reports output tokens/s, TTFT p50/p99 (submit -> first token, preprocessing included), per-request
latency p50 (submit -> last token; a batch's requests all end with the batch), and the ratios to
both transformers runs; `--pack-ab` also runs the same requests on an engine without packed
prefill (one prefill call per request, `pack_prefill=False`) in the same run (`--no-pack`: only
that one); plus what the decode step pays for: one decode step of 1 row vs every slot,
with 128 cache positions in use vs the whole max_model_len; and for each mmjax run, where the
device's time went (`DeviceTimeline`: busy seconds per call kind, idle seconds, each kind's rate
against the probed limits). Compile time (warmup) is reported apart.
Prints a table, then one JSON line.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time

import numpy as np


def percentile(xs, q):
    return float(np.percentile(np.asarray(xs, np.float64), q)) if xs else float("nan")


def make_requests(n: int, size: int, seed: int = 0):
    from PIL import Image
    rng = np.random.default_rng(seed)
    qs = ["What is in this picture? Describe the colors and the objects you can see in it please.",
          "Describe the image in detail, including the background and any text that might appear.",
          "How many objects are there in the image, and what are their shapes and their colors?"]
    return [(Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8)), qs[i % len(qs)])
            for i in range(n)]


class DeviceTimeline:
    """When each of the runner's compiled calls finished on the device, without waiting for it
    on the engine's thread: every dispatched call's output (the sampled tokens or the features,
    never the donated cache) goes to a watcher thread that blocks on it and stamps the time.
    Calls run one after another on the device, so a call's device time is its ready time minus
    the later of its dispatch and the previous call's ready time, and the device sat idle
    between a call's ready time and a later dispatch. Calls that return only a cache (copy_slot,
    fill_cross) are not watched: their time counts in the next call's."""

    def __init__(self, runner):
        import queue
        import threading
        self.runner, self.events, self._queue = runner, [], queue.Queue()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()
        self._track = runner._track
        runner._track = self._tracked

    def _tracked(self, kind, shape, fn, *args, **kw):
        t0 = time.perf_counter()
        result = self._track(kind, shape, fn, *args, **kw)
        # (cache, state, out[, scores]): the cache and state are donated to the next call
        out = result[2:] if isinstance(result, tuple) and len(result) >= 3 else result
        if kind not in ("copy_slot", "fill_cross"):
            self._queue.put((kind, shape, t0, out))
        return result

    def _watch(self):
        import jax
        while (item := self._queue.get()) is not None:
            kind, shape, t0, out = item
            jax.block_until_ready(out)
            self.events.append((kind, shape, t0, time.perf_counter()))

    def close(self, start: float) -> dict:
        """Stop watching; device seconds per call kind, calls per kind, and idle seconds since
        `start` (perf_counter)."""
        self._queue.put(None)
        self._thread.join()
        self.runner._track = self._track
        busy, calls, idle, ready = {}, {}, 0.0, start
        for kind, _, t0, t1 in sorted(self.events, key=lambda e: e[3]):
            idle += max(0.0, t0 - ready)
            busy[kind] = busy.get(kind, 0.0) + t1 - max(t0, ready)
            calls[kind] = calls.get(kind, 0) + 1
            ready = t1
        return {"busy_s": busy, "calls": calls, "idle_s": idle, "last_ready_s": ready - start}


async def run_mmjax(vlm, ae, requests, concurrency: int, new_tokens: int):
    import mmjax
    sp = mmjax.SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    queue = list(requests)
    ttfts, latencies, prompt_lens, gaps, tokens = [], [], [], [], 0

    async def client():
        nonlocal tokens
        while queue:
            img, q = queue.pop()
            t0 = time.perf_counter()
            prompt, images = vlm.render_chat([{"role": "user", "content": [{"type": "image", "image": img},
                                                                           {"type": "text", "text": q}]}])
            req = vlm.engine.make_request(prompt, vlm.prepare_images(images), sp)
            prompt_lens.append(req.prompt_len)
            last = None
            async for d in ae.stream(req):
                if d.token_ids:
                    now = time.perf_counter()
                    if last is None:
                        ttfts.append(now - t0)
                    else:       # inter-token latency: a delta's gap spread over its tokens
                        gaps.extend([(now - last) / len(d.token_ids)] * len(d.token_ids))
                    last = now
                tokens += len(d.token_ids)
            latencies.append(time.perf_counter() - t0)

    before = dict(vlm.engine.runner.step_seconds)
    images_before = vlm.engine.counters["images_encoded"]
    timeline = DeviceTimeline(vlm.engine.runner)
    t0 = time.perf_counter()
    try:
        await asyncio.gather(*(client() for _ in range(concurrency)))
        wall = time.perf_counter() - t0
    finally:
        device = timeline.close(t0)
    steps = {k: v - before[k] for k, v in vlm.engine.runner.step_seconds.items()}
    return {"wall_s": wall, "tokens": tokens, "ttft": ttfts, "latency": latencies, "itl": gaps, "step_s": steps,
            "device": device, "images_encoded": vlm.engine.counters["images_encoded"] - images_before,
            "prompt_lens": prompt_lens, "concurrency": concurrency}


def roofline(arch, prompt_lens: list[int], new_tokens: int, concurrency: int, peak_flops: float,
             read_bw: float) -> dict:
    """The machine's floor for serving these requests (one image each) at `concurrency`: every
    FLOP at the probed f32 GEMM rate (encode, prefill with the LM head on the last token, then
    new_tokens - 1 decode tokens each, attention over the context so far), and no fewer weight
    reads than decode steps, each reading every decoder weight once at the probed read
    bandwidth (ceil(n / concurrency) x (new_tokens - 1) steps); the floor is the larger of the two
    (compute and reads overlapping perfectly). ceiling_tok_s: the output tokens over that floor."""
    n = len(prompt_lens)
    flops = sum(arch.encode_flops() + arch.prefill_flops(p) + sum(arch.decode_flops(p + t) for t in range(new_tokens - 1))
                for p in prompt_lens)
    steps = -(-n // concurrency) * (new_tokens - 1)
    compute_s, read_s = flops / peak_flops, steps * arch.decode_bytes(0, 0) / read_bw
    floor_s = max(compute_s, read_s)
    return {"flops": flops, "compute_s": compute_s, "read_s": read_s, "floor_s": floor_s,
            "ceiling_tok_s": n * new_tokens / floor_s, "peak_gemm_flops": peak_flops, "read_bw_bytes_s": read_bw}


class _Stamps:
    """A generate() streamer that only records when each put() arrives (the first is the prompt)."""

    def __init__(self):
        self.t: list[float] = []

    def put(self, value):
        self.t.append(time.perf_counter())

    def end(self):
        pass


def _hf_model(path, threads: int):
    import torch
    from transformers import AutoProcessor, LlavaForConditionalGeneration
    torch.set_num_threads(threads)
    model = LlavaForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    return model, AutoProcessor.from_pretrained(path)


def _hf_prompt(proc, q: str) -> str:
    msgs = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": q}]}]
    return proc.apply_chat_template(msgs, add_generation_prompt=True)


def run_hf(hf, requests, new_tokens: int):
    """transformers, one request at a time; hf: (model, processor) from _hf_model."""
    import torch
    model, proc = hf
    ttfts, latencies, tokens = [], [], 0
    t0 = time.perf_counter()
    for img, q in requests:
        t1 = time.perf_counter()
        inputs = proc(text=_hf_prompt(proc, q), images=img, return_tensors="pt")
        stamps = _Stamps()
        with torch.inference_mode():
            out = model.generate(**inputs, max_new_tokens=new_tokens, do_sample=False, pad_token_id=3,
                                 streamer=stamps)
        ttfts.append(stamps.t[1] - t1)  # stamps.t[0] is the prompt
        latencies.append(time.perf_counter() - t1)
        tokens += out.shape[1] - inputs["input_ids"].shape[1]
    return {"wall_s": time.perf_counter() - t0, "tokens": tokens, "ttft": ttfts, "latency": latencies}


def hf_batch_inputs(proc, requests, device):
    """The processor's tensors for (image, question) requests as one left-padded batch (decoder-
    only models pad on the left), on `device`."""
    return proc(text=[_hf_prompt(proc, q) for _, q in requests], images=[img for img, _ in requests],
                return_tensors="pt", padding=True, padding_side="left").to(device)


def run_hf_batched(hf, requests, new_tokens: int):
    """transformers, every request in one left-padded batch through one `generate` call (what a
    transformers user does with a list of prompts): preprocessing of the whole batch included;
    every request gets its first token at the batch's first step and ends with the batch."""
    import torch
    model, proc = hf
    t0 = time.perf_counter()
    inputs = hf_batch_inputs(proc, requests, model.device)
    stamps = _Stamps()
    with torch.inference_mode():
        out = model.generate(**inputs, max_new_tokens=new_tokens, do_sample=False, pad_token_id=3, streamer=stamps)
    wall = time.perf_counter() - t0
    n = len(requests)
    return {"wall_s": wall, "tokens": n * (out.shape[1] - inputs["input_ids"].shape[1]),
            "ttft": [stamps.t[1] - t0] * n, "latency": [wall] * n, "batch": n}


def decode_step_times(vlm, repeats: int = 5, grid: bool = False) -> list[dict]:
    """Median decode step time for 1 row and for every slot, with 128 cache positions in use
    (kv_len) and with max_model_len: what the decode-rows ladder and the skipped KV segments
    save. grid: every rows rung x kv_len 128, 256, 384, 512, 1024, max_model_len. Every row
    sits at position kv_len - 8 (the CPU attention kernel reads each row's own keys, so the rows'
    positions, not only kv_len, set the attention's cost)."""
    import dataclasses

    import jax.numpy as jnp

    r = vlm.engine.runner
    out = []
    top = r.max_model_len
    rows_ladder = r.buckets.decode if grid else sorted({1, r.num_slots})
    lengths = sorted({min(n, top) for n in ((128, 256, 384, 512, 1024, top) if grid else (128, top))})
    for rows in rows_ladder:
        for n in lengths:
            r.state = dataclasses.replace(r.state, lengths=jnp.full_like(r.state.lengths, max(n - 8, 0)))
            r.decode(n, rows)  # compile / warm
            times = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                r.decode(n, rows)
                times.append(time.perf_counter() - t0)
            out.append({"rows": rows, "kv_len": n, "step_s": statistics.median(times)})
    vlm.engine.reset_device_state()
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="mmjax bench engine", description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="LLaVA checkpoint dir (default: build a random one)")
    ap.add_argument("--smoke", action="store_true", help="toy checkpoint and few requests (CI)")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--requests", type=int, default=16, help="requests per concurrency level")
    ap.add_argument("--new-tokens", type=int, default=128,
                    help="output tokens per request (128, as vLLM's random benchmark dataset)")
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "bfloat16", "int8", "fp8"],
                    help="KV cache element type (int8 / fp8: per-token, per-KV-head scales)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                    help="mmjax's weights / activations (the transformers peers stay float32)")
    ap.add_argument("--quantize", default=None, choices=["int8", "fp8"], help="mmjax's 8-bit linear weights")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: cores)")
    ap.add_argument("--no-hf", action="store_true", help="skip the transformers peers")
    ap.add_argument("--no-hf-sequential", action="store_true",
                    help="skip transformers one request at a time (keep the batched peer)")
    ap.add_argument("--no-overlap", action="store_true",
                    help="the engine waits for every step before queuing the next (A/B of overlapped steps)")
    ap.add_argument("--no-pack", action="store_true", help="prefill one request per call (pack_prefill=False)")
    ap.add_argument("--page-size", type=int, default=None,
                    help="KV page size (default: the backend's; 0: a cache row per slot, the A/B for paging)")
    ap.add_argument("--decode-steps", type=int, default=1,
                    help="decode steps per engine call (multi-step decode; default 1)")
    ap.add_argument("--mixed-ab", action="store_true",
                    help="also run every concurrency level with each decode step in a call of its own (no mixed "
                         "steps: the decode step riding in a prefill call), on the same engine, in the same run")
    ap.add_argument("--pack-ab", action="store_true",
                    help="also run every concurrency level without packed prefill (A/B of TTFT in one run)")
    ap.add_argument("--rounds", type=int, default=1,
                    help="rounds of mmjax and transformers batched at the top concurrency, alternating which "
                         "goes first (the first round is the main run): the ratio per round and its median, "
                         "so a drift of the machine's speed between the two sides' runs shows")
    ap.add_argument("--decode-only", action="store_true",
                    help="only time the decode step over rows x cache length in use (A/B of decode changes)")
    args = ap.parse_args(argv)
    if args.smoke:
        args.requests, args.new_tokens, args.concurrency, args.max_model_len = 4, 8, [1, 4], 256

    import os

    import mmjax
    from benchmarks.checkpoints import build_llava
    from mmjax import progress

    progress.enable()       # the kernel build and each warmup shape (n of N, seconds) on stderr
    from mmjax.serving import AsyncEngine

    path = args.model or str(build_llava("smoke" if args.smoke else "default"))
    threads = args.threads or os.cpu_count()
    engine_kw = dict(max_num_seqs=max(args.concurrency), max_model_len=args.max_model_len,
                     prefill_chunk=64 if args.smoke else 256, max_encode_batch=8, overlap=not args.no_overlap,
                     kv_cache_dtype=args.kv_cache_dtype, dtype=args.dtype, quantize=args.quantize,
                     decode_steps=args.decode_steps,
                     **({} if args.page_size is None else {"page_size": args.page_size}))
    if (args.dtype != "float32" or args.quantize) and not args.no_hf:
        ap.error("--dtype / --quantize change mmjax's precision only: add --no-hf (peers compare at the same precision)")
    vlm = mmjax.load(path, pack_prefill=not args.no_pack, **engine_kw)
    size = vlm.family.cfg.vision.image_size
    t0 = time.perf_counter()
    compiled = vlm.engine.warmup()
    compile_s = time.perf_counter() - t0
    decode_steps = decode_step_times(vlm, repeats=7 if args.decode_only else 5, grid=args.decode_only)
    if args.decode_only:
        lengths = sorted({d["kv_len"] for d in decode_steps})
        print(f"decode step ms (median of 7), rows x kv_len (cache positions in use); warmup {compile_s:.1f}s")
        print(f"{'rows':>5}" + "".join(f"{n:>9}" for n in lengths))
        for rows in sorted({d["rows"] for d in decode_steps}):
            ms = {d["kv_len"]: d["step_s"] * 1e3 for d in decode_steps if d["rows"] == rows}
            print(f"{rows:>5}" + "".join(f"{ms[n]:>9.1f}" for n in lengths))
        print(json.dumps({"bench": "engine_decode", "checkpoint": path, "compile_s": compile_s,
                          "decode_steps": decode_steps}))
        return 0

    from benchmarks import machine
    from benchmarks.kernel import Arch
    # the f32 roofline: probed around the runs (the best probe: the box drifts); bf16 / int8
    # weights have other limits, so they get none
    f32 = args.dtype == "float32" and not args.quantize
    probes = [machine.measure(smoke=args.smoke, quick=True)] if f32 else []

    def serve(vlm, levels=args.concurrency):
        out = {}
        ae = AsyncEngine(vlm.engine, max_waiting=10_000)
        try:
            for c in levels:
                out[c] = asyncio.run(run_mmjax(vlm, ae, make_requests(args.requests, size, seed=c), c,
                                               args.new_tokens))
        finally:
            ae.shutdown()
        return out
    def forget(eng):
        """The same images and prompts again on `eng`: no encoder- or prefix-cache hits."""
        from mmjax.serving.caches import EncoderCache
        eng.encoder_cache = EncoderCache(eng.encoder_cache.max_bytes)
        eng.reset_device_state()

    label = "mmjax (no pack)" if args.no_pack else "mmjax engine"
    variants = {label: serve(vlm)}
    if args.mixed_ab and vlm.engine.runner.mixes:   # the same engine with its decode steps apart
        eng = vlm.engine
        forget(eng)
        eng._riders = lambda group: []      # the same compiled steps, nothing rides
        variants["mmjax (no mixed)"] = serve(vlm)
        del eng._riders
    if args.pack_ab and not args.no_pack:     # the same requests, one prefill call per request
        unpacked = mmjax.load(path, pack_prefill=False, **engine_kw)
        unpacked.engine.warmup()
        variants["mmjax (no pack)"] = serve(unpacked)
    top = max(args.concurrency)       # the batched peer gets the same requests as mmjax's top level
    peer = None if args.no_hf else _hf_model(path, threads)
    hfb = None if args.no_hf else run_hf_batched(peer, make_requests(args.requests, size, seed=top), args.new_tokens)
    hf = None if args.no_hf or args.no_hf_sequential else run_hf(peer, make_requests(args.requests, size, seed=99),
                                                                 args.new_tokens)
    rounds = []
    if hfb and args.rounds > 1:
        def again(who):
            if who == "transformers":
                return run_hf_batched(peer, make_requests(args.requests, size, seed=top), args.new_tokens)
            forget(vlm.engine)
            return serve(vlm, [top])[top]
        first = variants[label][top]
        rounds.append({"first": "mmjax", "mmjax_tok_s": first["tokens"] / first["wall_s"],
                       "mmjax_ttft_p50_s": percentile(first["ttft"], 50),
                       "hf_batched_tok_s": hfb["tokens"] / hfb["wall_s"]})
        for k in range(1, args.rounds):
            order = ("transformers", "mmjax") if k % 2 else ("mmjax", "transformers")
            got = {who: again(who) for who in order}
            rounds.append({"first": order[0].replace("transformers", "hf_batched"),
                           "mmjax_tok_s": got["mmjax"]["tokens"] / got["mmjax"]["wall_s"],
                           "mmjax_ttft_p50_s": percentile(got["mmjax"]["ttft"], 50),
                           "hf_batched_tok_s": got["transformers"]["tokens"] / got["transformers"]["wall_s"]})
        for r in rounds:
            r["ratio"] = r["mmjax_tok_s"] / r["hf_batched_tok_s"]

    if f32:
        probes.append(machine.measure(smoke=args.smoke, quick=True))
        arch = Arch.from_family(vlm.family)
        peak, bw = max(p["peak_flops"] for p in probes), max(p["read_bw"] for p in probes)

    def tps(r):
        return r["tokens"] / r["wall_s"] if r else None

    def limit(r, concurrency):
        """r's floor (roofline) and r's tok/s as a fraction of its ceiling (f32 only)."""
        if not f32:
            return None
        lens = variants[label][top]["prompt_lens"]     # the same prompts for every system
        roof = roofline(arch, lens, args.new_tokens, concurrency, peak, bw)
        return {**roof, "fraction": tps(r) / roof["ceiling_tok_s"]}

    hf_tps, hfb_tps = tps(hf), tps(hfb)

    def stats(r):
        return {"output_tok_s": tps(r), "ttft_p50_s": percentile(r["ttft"], 50), "ttft_p99_s": percentile(r["ttft"], 99),
                "latency_p50_s": percentile(r["latency"], 50), "wall_s": r["wall_s"],
                "itl_p50_s": percentile(r["itl"], 50) if r.get("itl") else None,
                "itl_p99_s": percentile(r["itl"], 99) if r.get("itl") else None,
                "roofline": limit(r, r.get("batch") or r.get("concurrency", 1))}

    def device_rates(r) -> dict:
        """Per call kind, the device's rate against the probes (f32): encode and prefill in
        GFLOP/s of their matmuls and attention (prefill: the prompts' tokens only, not the decode
        rows riding in the calls), decode in GB/s of the decoder weights (a lower bound on what
        a step reads: its rows' K / V are not counted)."""
        busy = r["device"]["busy_s"]
        work = {"encode": (r["images_encoded"] * arch.encode_flops(), peak, "GFLOP/s"),
                "prefill": (sum(arch.prefill_flops(p) for p in r["prompt_lens"]), peak, "GFLOP/s (prompt tokens)"),
                "decode": (r["device"]["calls"].get("decode", 0) * arch.decode_bytes(0, 0), bw, "GB/s (weights)")}
        return {k: {"rate": w / busy[k] / 1e9, "unit": unit, "fraction": w / busy[k] / lim}
                for k, (w, lim, unit) in work.items() if busy.get(k)}

    rows = []
    for who, c, r in ((w, c, r) for w, res in variants.items() for c, r in res.items()):
        device = {**r["device"], "rates": device_rates(r)} if f32 else r["device"]
        rows.append({"who": who, "concurrency": c, "requests": args.requests, **stats(r),
                     "vs_hf_sequential": tps(r) / hf_tps if hf_tps else None,
                     "vs_hf_batched": tps(r) / hfb_tps if hfb_tps else None, "step_s": r["step_s"],
                     "device": device})
    precision = args.dtype + (f" + {args.quantize} weights" if args.quantize else "")
    print(f"checkpoint: {path}  ({'smoke' if args.smoke else 'default'}, {precision}, {threads} threads, "
          f"{'synchronous' if args.no_overlap else 'overlapped'} engine steps, {args.decode_steps} decode step(s) a call)")
    print(f"warmup: {sum(compiled.values())} compiled shapes {compiled} in {compile_s:.1f}s (excluded below)")
    print(f"{'who':<24}{'conc':>5}{'tok/s':>10}{'TTFT p50':>10}{'TTFT p99':>10}{'ITL p50':>9}{'ITL p99':>9}"
          f"{'lat. p50':>10}{'vs HF seq':>11}{'vs HF batch':>13}{'% roofline':>12}")

    def line(who, conc, st, seq, bat):
        x = lambda v: f"{v:.2f}x" if v else "-"  # noqa: E731
        ms = lambda v: f"{v * 1e3:>7.0f}ms" if v is not None else f"{'-':>9}"  # noqa: E731
        print(f"{who:<24}{conc:>5}{st['output_tok_s']:>10.1f}{st['ttft_p50_s'] * 1e3:>8.0f}ms"
              f"{st['ttft_p99_s'] * 1e3:>8.0f}ms{ms(st['itl_p50_s'])}{ms(st['itl_p99_s'])}"
              f"{st['latency_p50_s']:>9.1f}s{x(seq):>11}{x(bat):>13}"
              + (f"{100 * st['roofline']['fraction']:>11.0f}%" if st["roofline"] else f"{'-':>12}"))
    for row in rows:
        line(row["who"], row["concurrency"], row, row["vs_hf_sequential"], row["vs_hf_batched"])
    if hfb:
        line(f"transformers (batch {hfb['batch']})", hfb["batch"], stats(hfb), hfb_tps / hf_tps if hf_tps else None,
             1.0)
    if hf:
        line("transformers (seq.)", 1, stats(hf), 1.0, hf_tps / hfb_tps if hfb_tps else None)
    for row in rows:
        busy = sum(row["step_s"].values())
        print(f"{row['who']} time at concurrency {row['concurrency']}: wall {row['wall_s']:.2f}s = "
              + " + ".join(f"{k} {v:.2f}s" for k, v in row["step_s"].items())
              + f" + host/idle {row['wall_s'] - busy:.2f}s")
    for row in rows:
        dev = row["device"]
        print(f"{row['who']} device at concurrency {row['concurrency']}: busy {sum(dev['busy_s'].values()):.2f}s of wall "
              f"{row['wall_s']:.2f}s, idle {dev['idle_s']:.2f}s: " + ", ".join(
                  f"{k} {dev['calls'][k]} calls {v:.2f}s ({1e3 * v / dev['calls'][k]:.1f} ms each"
                  + (f", {dev['rates'][k]['rate']:.0f} {dev['rates'][k]['unit']}, {100 * dev['rates'][k]['fraction']:.0f}%"
                     if k in dev.get("rates", {}) else "") + ")"
                  for k, v in dev["busy_s"].items()))
    for row in rows if f32 else ():
        roof = row["roofline"]
        print(f"roofline at concurrency {row['concurrency']} ({row['who']}): {roof['flops'] / 1e12:.2f} TFLOP at "
              f"{peak / 1e9:.0f} GFLOP/s = {roof['compute_s']:.2f}s, weight reads {roof['read_s']:.2f}s at "
              f"{bw / 1e9:.1f} GB/s -> floor {roof['floor_s']:.2f}s, ceiling {roof['ceiling_tok_s']:.1f} tok/s")
    for i, r in enumerate(rounds):
        print(f"round {i + 1} at concurrency {top} ({r['first']} first): mmjax {r['mmjax_tok_s']:.1f} tok/s "
              f"(TTFT p50 {r['mmjax_ttft_p50_s'] * 1e3:.0f} ms), transformers batched {r['hf_batched_tok_s']:.1f} "
              f"tok/s: {r['ratio']:.2f}x")
    if rounds:
        print(f"rounds: median ratio {statistics.median(r['ratio'] for r in rounds):.2f}x, "
              f"range {min(r['ratio'] for r in rounds):.2f}-{max(r['ratio'] for r in rounds):.2f}x")
    print("decode step: " + ", ".join(f"{d['rows']} rows x kv_len {d['kv_len']} -> {d['step_s'] * 1e3:.1f} ms"
                                      for d in decode_steps))
    summary = {"bench": "engine", "checkpoint": path, "smoke": args.smoke, "threads": threads, "dtype": args.dtype, "quantize": args.quantize,
               "overlap": not args.no_overlap, "steps_per_decode_call": args.decode_steps,
               "new_tokens": args.new_tokens, "compile_s": compile_s, "compiled_shapes": compiled,
               "mmjax": rows, "decode_steps": decode_steps, "machine_probes": probes,
               "hf_sequential": None if not hf else stats(hf),
               "hf_batched": None if not hfb else {"batch": hfb["batch"], **stats(hfb)}, "rounds": rounds,
               "rounds_median_ratio": statistics.median(r["ratio"] for r in rounds) if rounds else None}
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
