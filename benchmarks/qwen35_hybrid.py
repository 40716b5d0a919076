"""Qwen3.5's hybrid decoder against a same-size dense one: decode tokens/s at batch 1 and 16, and
the cache memory one sequence holds at 32k context.

Both checkpoints are built offline (tests/tiny_qwen35.build_qwen35, random weights): the hybrid
one with the default layer pattern (three Gated DeltaNet layers, then full attention), the dense
peer the same config with every layer full attention (same hidden size, heads, MLPs, vocab), so
the only difference is the token mixer. Default size (bounded so that the whole run takes
minutes on a small CPU): hidden 1024, 8 layers (6 Gated DeltaNet + 2 full attention in the hybrid),
8 heads of 256 (2 KV heads, partial RoPE 0.25), linear attention 16 key / 16 value heads of 128,
intermediate 3072, vocab 32000: ~220M decoder parameters hybrid, ~200M dense (the JSON's
`params`); `--smoke`: the tests' tiny shape.

Decode: one engine per model with 16 slots; text-only prompts of ~60 tokens; the figure is
batch / median wall time of an `engine.step()` holding only a decode step with every request of
the batch running (as `bench kernel`).

Memory per sequence: the bytes of one slot's cache as mmjax allocates it (`init_cache` under
`jax.eval_shape`) at 32768 positions: full-attention KV plus the linear layers' conv and recurrent
states, against the dense peer's KV. Computed from shapes, no allocation.

    python -m benchmarks.qwen35_hybrid [--smoke] [--dtype float32|bfloat16] [--new-tokens 32]

Prints a table, then one JSON line.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

SIZES = {
    "default": dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=8, num_attention_heads=8,
                    num_key_value_heads=2, head_dim=256, vocab_size=32000, linear_num_key_heads=16,
                    linear_num_value_heads=16, linear_key_head_dim=128, linear_value_head_dim=128,
                    rope_parameters={"rope_type": "default", "rope_theta": 1e7, "mrope_section": [11, 11, 10],
                                     "mrope_interleaved": True, "partial_rotary_factor": 0.25}),
    "smoke": {},
}
CONTEXT = 32768


def build(root: Path, size: str) -> dict[str, Path]:
    from tiny_qwen35 import build_qwen35
    over = SIZES[size]
    layers = over.get("num_hidden_layers", 4)
    full = {**over, "layer_types": ["full_attention"] * layers}
    return {"hybrid": build_qwen35(root / f"hybrid-{size}", text_overrides=over),
            "dense": build_qwen35(root / f"dense-{size}", text_overrides=full)}


def cache_bytes_per_sequence(vlm, context: int) -> dict:
    import jax
    import jax.numpy as jnp
    runner = vlm.engine.runner          # (outside the trace: the engine property may refresh the model)
    lm, dtype = runner.text_model, jnp.dtype(runner.kv_cache_dtype)
    shapes = jax.eval_shape(lambda: lm.init_cache(1, context, dtype))
    state_layers = set(getattr(lm, "state_layers", ()))
    kv = state = 0
    for i, entry in enumerate(shapes):
        n = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(entry))
        if i in state_layers:
            state += n
        else:
            kv += n
    return {"kv_bytes": kv, "state_bytes": state, "total_bytes": kv + state}


def decoder_params(vlm) -> int:
    """Parameters of the decoder (embeddings and LM head included)."""
    import jax
    from flax import nnx
    return int(sum(x.size for x in jax.tree.leaves(nnx.state(vlm.engine.runner.text_model, nnx.Param))))


def decode_rate(vlm, batch: int, new_tokens: int) -> float:
    import mmjax
    eng = vlm.engine
    sp = mmjax.SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    words = "please describe the picture in detail what is shown here and why".split()
    ids = [eng.add_request(" ".join(words[(i + j) % len(words)] for j in range(24)), [], sp) for i in range(batch)]
    steps = []
    while any(eng.requests[i].finish_reason is None for i in ids):
        running = sum(1 for r in eng.slots if r is not None and r.prefilled >= r.prompt_len
                      and r.finish_reason is None)
        pc, dc = eng.counters["prefill_calls"], eng.counters["decode_steps"]
        t0 = time.perf_counter()
        eng.step()
        dt = time.perf_counter() - t0
        if eng.counters["prefill_calls"] == pc and eng.counters["decode_steps"] == dc + 1 and running == batch:
            steps.append(dt)
    eng.run_until_done(ids)
    steps = steps[2:] or steps        # the first full-batch steps may still compile
    return batch / statistics.median(steps) if steps else float("nan")


def run(args) -> dict:
    import mmjax
    root = Path(args.out_dir or tempfile.mkdtemp(prefix="qwen35_bench_"))
    paths = build(root, "smoke" if args.smoke else "default")
    batches = [1, 2] if args.smoke else [1, 16]
    out = {"dtype": args.dtype, "context": CONTEXT, "batches": batches, "models": {}}
    for name, path in paths.items():
        vlm = mmjax.load(path, dtype=args.dtype, max_num_seqs=max(batches), max_model_len=512, prefill_chunk=64)
        rec = cache_bytes_per_sequence(vlm, CONTEXT)
        rec["params"] = decoder_params(vlm)
        for b in batches:
            decode_rate(vlm, b, 4)                      # compile this batch's shapes
            rec[f"decode_tok_s_b{b}"] = decode_rate(vlm, b, args.new_tokens)
        out["models"][name] = rec
        vlm.engine.shutdown() if hasattr(vlm.engine, "shutdown") else None
    h, d = out["models"]["hybrid"], out["models"]["dense"]
    out["memory_ratio"] = h["total_bytes"] / d["total_bytes"]
    for b in batches:
        out[f"decode_ratio_b{b}"] = h[f"decode_tok_s_b{b}"] / d[f"decode_tok_s_b{b}"]
    return out


def format_table(r: dict) -> str:
    rows = [f"{'model':8} {'params M':>9} {'KV MiB':>10} {'state MiB':>10} {'total MiB':>10} " +
            " ".join(f"{'tok/s b' + str(b):>10}" for b in r["batches"])]
    for name, m in r["models"].items():
        rows.append(f"{name:8} {m['params'] / 1e6:9.1f} {m['kv_bytes'] / 2**20:10.1f} {m['state_bytes'] / 2**20:10.2f} "
                    f"{m['total_bytes'] / 2**20:10.1f} " +
                    " ".join(f"{m[f'decode_tok_s_b{b}']:10.1f}" for b in r["batches"]))
    rows.append(f"cache per sequence at {r['context']} positions: hybrid / dense = {r['memory_ratio']:.3f}")
    return "\n".join(rows)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--smoke", action="store_true", help="the tests' tiny shape, batches 1 and 2")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--out-dir", default=None, help="where the checkpoints are built (default: a temp dir)")
    args = p.parse_args(argv)
    r = run(args)
    print(format_table(r))
    print(json.dumps(r))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
