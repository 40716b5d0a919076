"""Capacity of the paged KV cache against a cache row of max_model_len per slot, at one KV
memory budget: a mixed workload (most prompts 300-600 tokens, one in `--long-every` 6000) is
submitted at once and run to the end by each engine; reported per mode: the most requests
running at once (the issue's target: pages >= 6x slots), KV pages in use at the peak,
preemptions, wall time and tokens/s. Prints a table and one JSON line.

    python -m benchmarks.pages                        # bench checkpoint, 8192 context, 256 MiB of KV
    python -m benchmarks.pages --size smoke --max-model-len 1024 --requests 12 --kv-mib 4   # smoke
"""
from __future__ import annotations

import argparse
import json
import time

import numpy as np


def workload(rng, n: int, max_model_len: int, max_tokens: int, long_every: int, vocab: int, avoid) -> list:
    """n prompts of token ids: 300-600 tokens, every long_every-th 6000 (capped to the context)."""
    pool = np.setdiff1d(np.arange(5, min(vocab, 500)), np.asarray(list(avoid), np.int64))
    out = []
    for i in range(n):
        length = 6000 if long_every and i % long_every == long_every - 1 else int(rng.integers(300, 601))
        length = min(length, max_model_len - max_tokens - 1)
        out.append(rng.choice(pool, length).tolist())
    return out


def run_mode(path: str, mode: str, args, prompts: list, kv_bytes: int) -> dict:
    import mmjax
    kw = dict(max_model_len=args.max_model_len, prefill_chunk=args.prefill_chunk)
    if mode == "pages":
        vlm = mmjax.load(path, max_num_seqs=args.max_num_seqs, page_size=args.page_size, kv_cache_bytes=kv_bytes, **kw)
    else:      # as many full-length slot rows as the same bytes hold
        probe = mmjax.load(path, max_num_seqs=1, page_size=0, **kw)
        per_slot = probe.engine.runner.memory_report()["kv_cache_bytes_max_device"]
        del probe
        slots = max(1, kv_bytes // per_slot)
        vlm = mmjax.load(path, max_num_seqs=int(slots), page_size=0, **kw)
    eng = vlm.engine
    sp = mmjax.SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    t0 = time.perf_counter()
    ids = [eng.add_request(p, [], sp) for p in prompts]
    most, pages_peak = 0, 0
    while any(eng.requests[r].finish_reason is None for r in ids):
        eng.step()
        st = eng.stats()
        most = max(most, st["requests_running"])
        pages_peak = max(pages_peak, st.get("kv_pages_used", 0))
    wall = time.perf_counter() - t0
    outs = [eng.output(r) for r in ids]
    st = eng.stats()
    tokens = sum(len(o.token_ids) for o in outs)
    return {"mode": mode, "slots": len(eng.scheduler.slots), "max_running": most,
            "kv_bytes": st["kv_cache_bytes_max_device"], "pages_total": st.get("kv_pages_total", 0),
            "pages_peak": pages_peak, "page_size": st.get("kv_page_size", 0), "preemptions": st["preemptions"],
            "wall_s": round(wall, 2), "tokens_per_s": round(tokens / wall, 2),
            "failed": sum(o.finish_reason != "length" for o in outs)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="default", help="benchmarks.checkpoints size (default, smoke)")
    ap.add_argument("--max-model-len", type=int, default=8192)
    ap.add_argument("--kv-mib", type=float, default=256.0, help="the KV budget both modes get, MiB per device")
    ap.add_argument("--requests", type=int, default=96)
    ap.add_argument("--long-every", type=int, default=16, help="one prompt in this many is 6000 tokens")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--max-num-seqs", type=int, default=128, help="decode slots of the paged engine")
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--prefill-chunk", type=int, default=512)
    args = ap.parse_args(argv)
    import mmjax
    from benchmarks.checkpoints import build_llava
    path = str(build_llava(args.size))
    tok = mmjax.load(path, max_num_seqs=1, max_model_len=256, page_size=0)
    avoid = set(int(x) for x in tok.family.media_token_ids) | set(int(x) for x in tok.engine.model.eos_token_ids)
    prompts = workload(np.random.default_rng(0), args.requests, args.max_model_len, args.max_tokens, args.long_every,
                       int(tok.engine.runner.vocab_size), avoid)
    del tok
    kv_bytes = int(args.kv_mib * 2**20)
    rows = [run_mode(path, m, args, prompts, kv_bytes) for m in ("slots", "pages")]
    ratio = rows[1]["max_running"] / max(rows[0]["max_running"], 1)
    print(f"KV budget {kv_bytes / 2**20:.1f} MiB, max_model_len {args.max_model_len}, {args.requests} requests "
          f"(prompt tokens: mean {np.mean([len(p) for p in prompts]):.0f}, max {max(len(p) for p in prompts)})")
    print(f"{'mode':>6}{'slots':>7}{'max running':>13}{'pages (peak/total)':>20}{'preempt':>9}{'wall s':>9}"
          f"{'tok/s':>9}{'failed':>8}")
    for r in rows:
        print(f"{r['mode']:>6}{r['slots']:>7}{r['max_running']:>13}{r['pages_peak']:>10}/{r['pages_total']:<9}"
              f"{r['preemptions']:>9}{r['wall_s']:>9}{r['tokens_per_s']:>9}{r['failed']:>8}")
    print(f"concurrency pages / slots: {ratio:.1f}x")
    print(json.dumps({"bench": "pages", "max_model_len": args.max_model_len, "kv_bytes": kv_bytes,
                      "requests": args.requests, "ratio": round(ratio, 2), "modes": rows}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
