"""`mmjax bench lora` / `python -m benchmarks.lora`: what serving LoRA adapters costs.

On `bench engine`'s random-weight LLaVA checkpoint (default ~342M params; `--smoke` a toy one),
the same closed-loop clients (a distinct image + question each, greedy, EOS ignored) run on three
engines, each in a process of its own (one engine's compiled shapes per process: XLA:CPU maps
~1,200 regions per shape of that model), side by side in one run:
  - base:   no adapter slots (`max_loras=0`): today's engine,
  - lora1:  one adapter slot of rank `--rank`, every request using that adapter (the per-token
            overhead of one adapter),
  - mixed:  `--adapters` slots, requests round-robin over that many different adapters (and a
            share on the base model with `--base-share`): the throughput of a mixed batch.
Adapters are random (PEFT layout: every attention and MLP projection of the decoder), written into
the slots as `Engine.load_lora` does. Reports output tokens/s at each concurrency, TTFT p50, the
decode step's median time at every slot with 128 positions in use (`bench engine`'s probe), and
each LoRA engine's ratios to the base one. Compile time (warmup) apart. Prints a table, then one
JSON line.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time

import numpy as np


def random_adapter(lm, name: str, rank: int, seed: int, scale: float = 0.02):
    """An `mmjax.lora.Adapter` of rank `rank` on every adapted projection of decoder `lm`."""
    from mmjax.lora import Adapter
    from mmjax.models.nn.lora import adapted_layers
    rng = np.random.default_rng(seed)
    mods = {}
    for rel, (layer, part) in adapted_layers(lm).items():
        width = layer.lora.widths[part]
        mods[f"model.language_model.{rel}"] = (rng.normal(0, scale, (layer.d_in, rank)).astype(np.float32),
                                               rng.normal(0, scale, (rank, width)).astype(np.float32))
    return Adapter(name, "random", rank, mods)


async def run_clients(vlm, ae, requests, loras: list, concurrency: int, new_tokens: int) -> dict:
    """Closed-loop clients over `requests` (image, question), request i using adapter loras[i]."""
    import mmjax
    sp = mmjax.SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    queue = list(zip(requests, loras))
    ttfts, tokens = [], 0

    async def client():
        nonlocal tokens
        while queue:
            (img, q), lora = queue.pop()
            t0 = time.perf_counter()
            prompt, images = vlm.render_chat([{"role": "user", "content": [{"type": "image", "image": img},
                                                                           {"type": "text", "text": q}]}])
            req = vlm.engine.make_request(prompt, vlm.prepare_images(images), sp, lora=lora)
            first = True
            async for d in ae.stream(req):
                if d.token_ids and first:
                    ttfts.append(time.perf_counter() - t0)
                    first = False
                tokens += len(d.token_ids)

    t0 = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(concurrency)))
    wall = time.perf_counter() - t0
    return {"concurrency": concurrency, "wall_s": wall, "tokens": tokens, "output_tok_s": tokens / wall,
            "ttft_p50_s": float(np.median(ttfts))}


def run_variant(path: str, variant: str, *, concurrency: list[int], requests: int, new_tokens: int, rank: int,
                adapters: int, base_share: float, max_model_len: int, prefill_chunk: int, warmup: bool = True) -> dict:
    """One engine's figures (in this process): variant "base" | "lora1" | "mixed"."""
    import mmjax
    from benchmarks.engine import decode_step_times, make_requests
    from mmjax.serving import AsyncEngine
    n = {"base": 0, "lora1": 1, "mixed": adapters}[variant]
    vlm = mmjax.load(path, max_num_seqs=max(concurrency), max_model_len=max_model_len, prefill_chunk=prefill_chunk,
                     max_encode_batch=8, **({"max_loras": n, "max_lora_rank": rank} if n else {}))
    lm = vlm.model.language_model
    for i in range(n):
        vlm.engine.load_lora(f"a{i}", None, adapter=random_adapter(lm, f"a{i}", rank, seed=i))
    t0 = time.perf_counter()
    compiled = vlm.engine.warmup() if warmup else {}
    compile_s = time.perf_counter() - t0
    decode = decode_step_times(vlm, repeats=5)
    size = vlm.family.cfg.vision.image_size
    rows = []
    ae = AsyncEngine(vlm.engine, max_waiting=10_000)
    try:
        for c in concurrency:
            reqs = make_requests(requests, size, seed=c)
            names = [None if variant == "base" or (i % 100) < base_share * 100 else f"a{i % n}"
                     for i in range(requests)]
            rows.append(asyncio.run(run_clients(vlm, ae, reqs, names, c, new_tokens)))
    finally:
        ae.shutdown()
    return {"variant": variant, "max_loras": n, "rank": rank if n else 0, "compile_s": compile_s,
            "compiled_shapes": compiled, "decode_steps": decode, "runs": rows}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="mmjax bench lora", description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="LLaVA checkpoint dir (default: bench engine's random one)")
    ap.add_argument("--smoke", action="store_true", help="toy checkpoint, few requests, one process (CI)")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[16])
    ap.add_argument("--requests", type=int, default=32, help="requests per concurrency level")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--adapters", type=int, default=4, help="adapters in the mixed run")
    ap.add_argument("--base-share", type=float, default=0.0, help="share of the mixed run's requests on the base model")
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--variants", nargs="+", default=["base", "lora1", "mixed"], choices=["base", "lora1", "mixed"])
    ap.add_argument("--variant", default=None, help=argparse.SUPPRESS)      # one variant, JSON out (subprocess)
    args = ap.parse_args(argv)
    if args.smoke:
        args.requests, args.new_tokens, args.concurrency, args.max_model_len = 4, 8, [2], 256
    from benchmarks.checkpoints import build_llava
    path = args.model or str(build_llava("smoke" if args.smoke else "default"))
    kw = dict(concurrency=args.concurrency, requests=args.requests, new_tokens=args.new_tokens, rank=args.rank,
              adapters=args.adapters, base_share=args.base_share, max_model_len=args.max_model_len,
              prefill_chunk=64 if args.smoke else 256, warmup=not args.smoke)
    if args.variant is not None:
        print(json.dumps(run_variant(path, args.variant, **kw)))
        return 0
    results = {}
    for v in args.variants:
        if args.smoke:
            results[v] = run_variant(path, v, **kw)
            continue
        cmd = [sys.executable, "-m", "benchmarks.lora", "--variant", v, "--model", path] + [
            a for a in (argv if argv is not None else sys.argv[1:]) if a not in ("--model", path)]
        out = subprocess.run(cmd, capture_output=True, text=True, cwd=os.path.dirname(os.path.dirname(__file__)))
        if out.returncode:
            sys.stderr.write(out.stderr[-3000:])
            return out.returncode
        results[v] = json.loads(out.stdout.strip().splitlines()[-1])
    base = results.get("base")
    print(f"{'engine':>8} {'slots':>5} {'rank':>4} {'conc':>4} {'tok/s':>8} {'vs base':>8} {'TTFT p50':>9} "
          f"{'decode ms (all rows, kv 128)':>28} {'vs base':>8}")
    for v, r in results.items():
        step = [d for d in r["decode_steps"] if d["kv_len"] == min(d["kv_len"] for d in r["decode_steps"])][-1]
        bstep = None if base is None else [d for d in base["decode_steps"] if d["rows"] == step["rows"]
                                           and d["kv_len"] == step["kv_len"]][0]
        r["decode_vs_base"] = None if bstep is None else step["step_s"] / bstep["step_s"]
        for i, run in enumerate(r["runs"]):
            run["vs_base"] = None if base is None else run["output_tok_s"] / base["runs"][i]["output_tok_s"]
            print(f"{v:>8} {r['max_loras']:>5} {r['rank']:>4} {run['concurrency']:>4} {run['output_tok_s']:>8.1f} "
                  f"{run['vs_base'] if run['vs_base'] is not None else float('nan'):>8.3f} {run['ttft_p50_s']:>8.2f}s "
                  f"{step['step_s'] * 1e3:>28.1f} {r['decode_vs_base'] or float('nan'):>8.3f}")
    print(json.dumps({"bench": "lora", "checkpoint": path, "results": results}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
