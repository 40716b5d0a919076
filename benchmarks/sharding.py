"""mmjax bench sharding: what a user needs to pick a mesh.

For the bench checkpoint (benchmarks/checkpoints.py, "default": Llama 1024 x 16 layers, 16 heads,
8 KV heads, vocab 32000, CLIP ViT-B/16) at tensor parallel 1/2/4/8 on fake CPU devices, and for a
Qwen2.5-VL-72B-shaped decoder (hidden 8192, 80 layers, 64 heads, 8 KV heads, MLP 29568, vocab
152064; abstract shapes, no weights), per TP size:

- weight bytes per device (decoder from its shardings; the vision tower is replicated, listed
  apart) and KV-cache bytes per device for the chosen slots x context;
- the collectives of one compiled decode step, counted in `compiled.as_text()`: how many, their
  payload bytes (the size of each collective's result) and the bytes each device sends with a
  ring implementation (all-reduce 2 (p-1)/p N, all-gather (p-1)/p N);
- the bench checkpoint's decode step wall time on fake devices, only as a sanity check (fake CPU
  devices share the host's cores: a TP step is not faster here).

The 72B decode step is compiled at 1 and 2 layers and its communication extrapolated linearly to
80 layers (a per-layer cost plus a fixed one), which the output says. Prints a table and one
JSON line. Runs itself in a subprocess with XLA_FLAGS=--xla_force_host_platform_device_count=8
when this process cannot see 8 devices.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time

DEVICES = 8
FLAG = f"--xla_force_host_platform_device_count={DEVICES}"
if "jax" not in sys.modules and FLAG not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + FLAG).strip()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

# Qwen2.5-VL-72B-Instruct's text config (config.json), and its vision tower's parameter count
# (32 blocks of width 1280 / MLP 3420, patch embed, 2x2 merger into 8192), computed below.
QWEN72B_TEXT = dict(model_type="qwen2", vocab_size=152064, hidden_size=8192, intermediate_size=29568,
                    num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8,
                    max_position_embeddings=128000, rms_norm_eps=1e-6, rope_theta=1000000.0,
                    rope_scaling={"type": "mrope", "mrope_section": [16, 24, 24]})


def qwen72b_vision_params() -> int:
    d, mlp, depth, out = 1280, 3420, 32, 8192
    block = (d * 3 * d + 3 * d) + (d * d + d) + 3 * (d * mlp + mlp) - mlp + d + 2 * d
    merger = d + (4 * d) * (4 * d) + 4 * d + (4 * d) * out + out
    return depth * block + 3 * 2 * 14 * 14 * d + merger


_SHAPE = re.compile(r"(pred|s8|u8|s16|u16|bf16|f16|s32|u32|f32|s64|u64|f64)\[([\d,]*)\]")
_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "bf16": 2, "f16": 2, "s32": 4, "u32": 4, "f32": 4,
          "s64": 8, "u64": 8, "f64": 8}
_COLL = re.compile(r"= (.+?) (all-reduce|all-gather|reduce-scatter|collective-permute|all-to-all)(?:-start)?\(")


def collectives(hlo_text: str, p: int) -> dict:
    """{count, by_op, payload_bytes, ring_bytes_per_device} of one compiled module's collectives."""
    count, by_op, payload, ring = 0, {}, 0, 0.0
    for shape, op in _COLL.findall(hlo_text):
        n = sum(_BYTES[t] * int(__import__("math").prod(int(d) for d in dims.split(",") if d))
                for t, dims in _SHAPE.findall(shape))
        count += 1
        by_op[op] = by_op.get(op, 0) + 1
        payload += n
        ring += n * (2 * (p - 1) / p if op == "all-reduce" else (p - 1) / p)
    return {"count": count, "by_op": by_op, "payload_bytes": payload, "ring_bytes_per_device": int(ring)}


def bytes_per_device(tree) -> int:
    """Bytes one device holds of `tree` (ShapeDtypeStructs with NamedShardings)."""
    import jax
    import numpy as np

    total = 0
    for x in jax.tree.leaves(tree):
        shard = x.sharding.shard_shape(x.shape) if x.sharding is not None else x.shape
        total += int(np.prod(shard)) * np.dtype(x.dtype).itemsize
    return total


def decode_figures(cfg, tp: int, slots: int, max_len: int, dtype) -> dict:
    """Per-device weight / KV bytes and the compiled decode step's collectives, all abstract: the
    Llama decoder of `cfg` built as shapes (`nnx.eval_shape`), laid out for tp shards and sharded
    by its logical axes as a runner places it."""
    import dataclasses

    import jax
    from flax import nnx

    from mmjax.backend import tuning
    from mmjax.models.nn.kv_cache import allocate_cache
    from mmjax.models.text.llama import LlamaModel
    from mmjax.serving.placed_model import tp_layout
    from mmjax.serving.runner import DecodeState, make_decode_step
    from mmjax.sharding import MODEL, Placement, make_mesh, step_shardings
    from jax.sharding import NamedSharding, PartitionSpec

    mesh = make_mesh(tp, 1, jax.devices()[:tp])
    pl = Placement(mesh)
    lm = nnx.eval_shape(lambda: LlamaModel(cfg, dtype))
    tp_layout(lm, tp)
    graphdef, state = nnx.split(lm)
    state = jax.tree.map(lambda v: v.replace(jax.tree.map(
        lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh), v.get_value(),
        pl.sharding_of(v.get_value(), v.get_metadata()["axes"]))), state, is_leaf=lambda x: isinstance(x, nnx.Variable))
    leaves, treedef = jax.tree.flatten(state)
    cache = jax.eval_shape(lambda: allocate_cache(lambda: lm.init_cache(slots, max_len, dtype, tp=tp)))
    cs = pl.cache_shardings(cache)
    cache = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), cache, cs)
    rep = pl.sharding("state")
    state = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=rep),
                         jax.eval_shape(lambda: DecodeState.zeros(slots, lm.vocab_size)))
    gather = (NamedSharding(mesh, PartitionSpec(None, MODEL)), pl.sharding("outputs")) if tp > 1 else None
    # the runner's step: traced with its tuning (a sharded step keeps XLA's dots, no CPU kernels)
    t = dataclasses.replace(tuning("cpu"), sharded=tp > 1)
    lm_of = lambda leaves: nnx.merge(graphdef, jax.tree.unflatten(treedef, leaves))       # noqa: E731
    fn = jax.jit(t.traced(make_decode_step(t, lm_of, gather)), static_argnames=("rows",),
                 donate_argnums=(1, 2), out_shardings=step_shardings(cs, rep, pl.sharding("outputs")))
    kv_lens = jax.ShapeDtypeStruct((lm.num_layers,), jax.numpy.int32)     # per layer (FastV-pruned layers)
    bits = jax.ShapeDtypeStruct((slots, (lm.vocab_size + 31) // 32), jax.numpy.uint32)
    compiled = fn.lower(leaves, cache, state, kv_lens, bits, rows=slots).compile()
    return {"weight_bytes": bytes_per_device(leaves), "kv_bytes": bytes_per_device(cache),
            "comm": collectives(compiled.as_text(), tp)}


def scaled(fig1: dict, fig2: dict, layers: int) -> dict:
    """Figures of an L-layer model from 1- and 2-layer ones (cost = fixed + L x per-layer)."""
    def lin(a, b):
        return a + (layers - 1) * (b - a)
    c1, c2 = fig1["comm"], fig2["comm"]
    return {"weight_bytes": lin(fig1["weight_bytes"], fig2["weight_bytes"]),
            "kv_bytes": lin(fig1["kv_bytes"], fig2["kv_bytes"]),
            "comm": {"count": lin(c1["count"], c2["count"]), "payload_bytes": lin(c1["payload_bytes"], c2["payload_bytes"]),
                     "ring_bytes_per_device": lin(c1["ring_bytes_per_device"], c2["ring_bytes_per_device"]),
                     "by_op": {k: lin(c1["by_op"].get(k, 0), c2["by_op"].get(k, 0))
                               for k in set(c1["by_op"]) | set(c2["by_op"])}}}


def wall_decode_ms(m, tp: int, slots: int, max_len: int, steps: int) -> float:
    """Median decode-step wall time of a real runner over the loaded model `m` (fake devices: a
    sanity check only)."""
    import numpy as np

    from mmjax.serving.runner import ModelRunner
    from mmjax.sharding import make_mesh
    import jax

    r = ModelRunner(m.family, m.module, max_num_seqs=slots, max_model_len=max_len, prefill_chunk=64,
                    max_encode_batch=1, mesh=make_mesh(tp, 1, jax.devices()[:tp]) if tp > 1 else None)
    r.decode(64, slots)
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        r.decode(64, slots)
        times.append(time.perf_counter() - t)
    return float(np.median(times) * 1e3)


def mib(n) -> str:
    return f"{n / 2**20:,.1f}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="mmjax bench sharding", description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="Llama-decoder checkpoint dir (default: the bench checkpoint)")
    ap.add_argument("--smoke", action="store_true", help="toy checkpoint, TP 1/2/4, 72B at TP 8 only (CI)")
    ap.add_argument("--tp", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--slots", type=int, default=16, help="decode slots (rows of the decode step)")
    ap.add_argument("--max-len", type=int, default=4096, help="context per slot (KV cache length)")
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"],
                    help="dtype of the 72B-shaped figures (the bench checkpoint runs in float32)")
    ap.add_argument("--steps", type=int, default=5, help="timed decode steps per TP size (sanity wall time)")
    ap.add_argument("--no-72b", action="store_true")
    args = ap.parse_args(argv)

    import jax
    if jax.device_count() < DEVICES and jax.default_backend() == "cpu":   # jax came up without the flag
        env = {**os.environ, "XLA_FLAGS": (os.environ.get("XLA_FLAGS", "") + " " + FLAG).strip()}
        return subprocess.call([sys.executable, "-m", "benchmarks.sharding", *(argv or sys.argv[1:])], env=env)
    import jax.numpy as jnp

    from mmjax.api import load_model
    from benchmarks.checkpoints import build_llava
    from flax import nnx

    from mmjax.models.text.llama import LlamaConfig

    if args.smoke:
        args.tp, args.slots, args.max_len, args.steps = [1, 2, 4], 4, 256, 2
    path = args.model or str(build_llava("smoke" if args.smoke else "default"))
    model = load_model(path)
    text_cfg = model.module.language_model.config
    vision_bytes = sum(x.nbytes for path, x in jax.tree_util.tree_leaves_with_path(nnx.state(model.module))
                       if path[0].key != "language_model")
    rows = []
    for tp in args.tp:
        f = decode_figures(text_cfg, tp, args.slots, args.max_len, jnp.float32)
        f["wall_ms"] = wall_decode_ms(model, tp, args.slots, args.max_len, args.steps)
        rows.append({"model": "bench", "tp": tp, "vision_bytes": vision_bytes, **f})

    note = None
    if not args.no_72b:
        cfg = LlamaConfig.from_hf(QWEN72B_TEXT)
        dtype = jnp.bfloat16 if args.dtype == "bfloat16" else jnp.float32
        vis = qwen72b_vision_params() * jnp.dtype(dtype).itemsize
        for tp in ([8] if args.smoke else args.tp):
            figs = []
            for layers in (1, 2):
                c = LlamaConfig(**{**cfg.__dict__, "num_layers": layers})
                figs.append(decode_figures(c, tp, args.slots, args.max_len, dtype))
            rows.append({"model": "qwen2.5-vl-72b-shaped", "tp": tp, "vision_bytes": vis,
                         **scaled(figs[0], figs[1], cfg.num_layers), "wall_ms": None})
        note = (f"72B-shaped rows: abstract shapes ({args.dtype}), decode compiled at 1 and 2 layers and "
                f"extrapolated to {cfg.num_layers}")

    print(f"decode step over {args.slots} slots x {args.max_len} context; bytes per device in MiB; comm from "
          f"the compiled HLO (payload = collective results, ring = bytes each device sends)")
    hdr = (f"{'model':<24}{'TP':>3}{'decoder W/dev':>15}{'vision W':>11}{'KV/dev':>11}{'#coll':>7}"
           f"{'payload':>11}{'ring/dev':>11}{'wall ms':>9}")
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        c = r["comm"]
        wall = f"{r['wall_ms']:.1f}" if r["wall_ms"] is not None else "-"
        print(f"{r['model']:<24}{r['tp']:>3}{mib(r['weight_bytes']):>15}{mib(r['vision_bytes']):>11}"
              f"{mib(r['kv_bytes']):>11}{c['count']:>7}{mib(c['payload_bytes']):>11}"
              f"{mib(c['ring_bytes_per_device']):>11}{wall:>9}")
    if note:
        print(note)
    print("wall ms: fake CPU devices share the host's cores; a sanity check, not a speed figure")
    print("XLA:CPU promotes bf16 all-reduces to f32 (reductions '_promoted'); on GPU they stay bf16, "
          "halving the 72B rows' all-reduce bytes")
    print(json.dumps({"bench": "sharding", "slots": args.slots, "max_len": args.max_len, "rows": rows,
                      "note": note}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
