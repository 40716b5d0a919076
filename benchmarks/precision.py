"""`mmjax bench precision` / `python -m benchmarks.precision`: float32 vs bfloat16 vs int8 weights
(issue 25), one run, side by side, on the kernel bench's checkpoint (a random-weight LLaVA of
realistic size, built offline and cached, or --model DIR).

Per precision (`mmjax.load(dtype=..., quantize=...)`; bf16 = bf16 x bf16 -> f32 dots, int8 =
int8 weights + per-token int8 activations, s8 dots; see docs/precision.md):

  encode    vision tower + projector, images/s at batch 1 and 8 (pixels preprocessed)
  ttft      raw image + prompt -> first token (preprocess + encode + prefill)
  decode    steady-state tokens/s at batch 1 and 8 (median full-batch decode step, greedy)
  quality   against float32: greedy-token agreement (the fraction of float32's greedy tokens
            reproduced before the first divergence) over --quality-prompts prompts (a different
            image each) x --quality-tokens tokens, and the mean |logprob diff| of the chosen tokens
            over those common prefixes
  weights   bytes of the params pytree (8-bit weights + scales for int8)

Goals (issue 25, batch 1): bf16 decode >= 1.8x f32, int8 decode >= 3x f32, bf16 encode >= 2.5x f32.
Figures are medians of >= 3 repeats, taken in rounds over the precisions (all loaded at once), so
a drift of the machine's speed moves every precision alike. Prints a table, then one JSON line
(the last line of stdout).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np
from flax import nnx

from benchmarks.kernel import MMJaxSide, make_images, make_prompt, median
from mmjax.quant import weight_bytes

PRECISIONS = {"f32": ("float32", None), "bf16": ("bfloat16", None), "int8": ("float32", "int8")}
GOALS = {"decode_b1_bf16_vs_f32": 1.8, "decode_b1_int8_vs_f32": 3.0, "encode_b1_bf16_vs_f32": 2.5}


def quality(mx: MMJaxSide, prompt: str, images, new_tokens: int):
    """Greedy outputs (token ids, chosen-token logprobs) of each image's request, batch 8."""
    sp = mx.mmjax.SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True, logprobs=1)
    outs = mx.vlm8.generate([{"prompt": prompt, "images": [im]} for im in images], sp)
    return [(o.token_ids, [lp[t] for t, lp in zip(o.token_ids, o.logprobs)]) for o in outs]


def compare(ref, got) -> tuple[float, float]:
    """(greedy-token agreement, mean |logprob diff| of the chosen tokens over common prefixes)."""
    same, diffs = 0, []
    for (rt, rl), (gt, gl) in zip(ref, got):
        for a, b, la, lb in zip(rt, gt, rl, gl):
            if a != b:
                break
            same += 1
            diffs.append(abs(la - lb))
    return same / max(sum(len(r[0]) for r in ref), 1), float(np.mean(diffs)) if diffs else float("nan")


def run(args) -> dict:
    from benchmarks.checkpoints import build_llava

    log = (lambda *a: print(*a, file=sys.stderr, flush=True)) if not args.quiet else (lambda *a: None)
    if not args.compilation_cache:
        os.environ["MMJAX_COMPILATION_CACHE"] = "0"
    path = args.model or str(build_llava(args.size, log=log))
    reps = args.repeats
    res: dict = {"model": path, "size": None if args.model else args.size, "repeats": reps,
                 "cores": os.cpu_count(), "new_tokens": args.new_tokens, "loadavg_1m": [os.getloadavg()[0]],
                 "quality_prompts": args.quality_prompts, "quality_tokens": args.quality_tokens}
    images = make_images(8 + reps + 2 + args.quality_prompts, 224, seed=0)
    batch8, fresh, qimgs = images[:8], images[8:8 + reps + 2], images[8 + reps + 2:]
    # every precision loaded at once and each figure's repeats taken in rounds over them: this
    # box's read bandwidth drifts by up to ~30% over minutes (another VM's load), which moved
    # one precision's figures against another's when each was timed in its own stretch
    sides, prompts = {}, {}
    for name in args.precisions:
        dtype, quant = PRECISIONS[name]
        log(f"{name}: loading ...")
        sides[name] = MMJaxSide(path, args.max_model_len, args.prefill_chunk, dtype=dtype, quantize=quant)
        prompts[name] = make_prompt(sides[name].vlm1.tokenizer, sides[name].arch.img_tokens, args.prompt_tokens)
        mx = sides[name]
        res[name] = {"dtype": dtype, "quantize": quant, "weight_bytes": weight_bytes(nnx.state(mx.vlm1.model)), "load_s": mx.load_s}

    def rounds(warm, timed) -> dict[str, float]:
        """{precision: median seconds of `timed(name, i)` over `reps` rounds} (after one
        `warm(name)` each), the precisions taking turns within each round."""
        for name in sides:
            warm(name)
        times = {name: [] for name in sides}
        for i in range(reps):
            for name in sides:
                times[name].append(timed(name, i))
        return {name: median(t) for name, t in times.items()}

    for b in (1, 8):
        log(f"encode batch {b} ...")
        px = {name: mx.pixels(batch8[:b]) for name, mx in sides.items()}
        for name, sec in rounds(lambda n: sides[n].encode(px[n]), lambda n, i: sides[n].encode(px[n])).items():
            res[name][f"encode_b{b}_img_s"] = b / sec
    log("ttft ...")
    for name, sec in rounds(lambda n: sides[n].ttft(prompts[n], fresh[0]),
                            lambda n, i: sides[n].ttft(prompts[n], fresh[1 + i])).items():
        res[name]["ttft_s"] = sec
    for b in (1, 8):
        log(f"decode batch {b} ...")
        for name, sec in rounds(lambda n: sides[n].decode(prompts[n], batch8[:b], args.new_tokens),
                                lambda n, i: median(sides[n].decode(prompts[n], batch8[:b], args.new_tokens)[0])).items():
            res[name][f"decode_b{b}_tok_s"] = b / sec
    ref = None
    for name, mx in sides.items():
        log(f"{name}: quality ({args.quality_prompts} prompts x {args.quality_tokens} tokens) ...")
        got = quality(mx, prompts[name], qimgs, args.quality_tokens)
        ref = got if ref is None and name == "f32" else ref
        if ref is not None:
            res[name]["greedy_agreement"], res[name]["mean_abs_logprob_diff"] = compare(ref, got)
        res[name]["loadavg_1m"] = os.getloadavg()[0]
    if "f32" in res:
        f = res["f32"]
        for name in res.keys() & {"bf16", "int8"}:
            for k in ("encode_b1_img_s", "encode_b8_img_s", "decode_b1_tok_s", "decode_b8_tok_s"):
                res[f"{k.rsplit('_', 2)[0]}_{name}_vs_f32"] = res[name][k] / f[k]
            res[f"ttft_{name}_vs_f32"] = f["ttft_s"] / res[name]["ttft_s"]
        res["goals"] = {f"{k}>={v}": res.get(k, float("nan")) >= v for k, v in GOALS.items()}
    return res


def format_table(r: dict) -> str:
    names = [n for n in PRECISIONS if n in r]
    cols = [("weights (MB)", lambda x: f"{x['weight_bytes'] / 1e6:.1f}"),
            ("encode b1 (img/s)", lambda x: f"{x['encode_b1_img_s']:.2f}"),
            ("encode b8 (img/s)", lambda x: f"{x['encode_b8_img_s']:.2f}"),
            ("TTFT (ms)", lambda x: f"{x['ttft_s'] * 1e3:.0f}"),
            ("decode b1 (tok/s)", lambda x: f"{x['decode_b1_tok_s']:.1f}"),
            ("decode b8 (tok/s)", lambda x: f"{x['decode_b8_tok_s']:.1f}"),
            ("greedy agree", lambda x: f"{x.get('greedy_agreement', float('nan')):.3f}"),
            ("mean |dlogp|", lambda x: f"{x.get('mean_abs_logprob_diff', float('nan')):.2e}")]
    lines = [f"{'':20s}" + "".join(f"{n:>12s}" for n in names)]
    for label, fn in cols:
        lines.append(f"{label:20s}" + "".join(f"{fn(r[n]):>12s}" for n in names))
    for k, ok in r.get("goals", {}).items():
        lines.append(f"goal {k}: {'met' if ok else 'MISSED'}")
    return "\n".join(lines)


def parse_args(argv):
    ap = argparse.ArgumentParser(prog="mmjax bench precision", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="a LLaVA checkpoint dir (default: build the random one)")
    ap.add_argument("--size", default="default", choices=["default", "smoke"])
    ap.add_argument("--smoke", action="store_true", help="CI size: tiny model, 3 repeats, few tokens")
    ap.add_argument("--precisions", nargs="+", default=list(PRECISIONS), choices=list(PRECISIONS))
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=64, help="decode timing run length")
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--quality-prompts", type=int, default=16)
    ap.add_argument("--quality-tokens", type=int, default=256)
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--prefill-chunk", type=int, default=256)
    ap.add_argument("--compilation-cache", action="store_true", help="keep JAX's persistent compilation cache on")
    ap.add_argument("--json-out", default=None)
    ap.add_argument("--quiet", action="store_true")
    a = ap.parse_args(argv)
    if a.smoke:
        a.size, a.repeats = "smoke", 3
        a.new_tokens, a.quality_prompts, a.quality_tokens = min(a.new_tokens, 8), 2, 8
        a.max_model_len = min(a.max_model_len, 256)
    if a.repeats < 3:
        ap.error("--repeats must be >= 3 (figures are medians)")
    if a.max_model_len < a.quality_tokens + 64:
        ap.error("--max-model-len must hold the prompt and --quality-tokens")
    return a


def main(argv=None) -> int:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    args = parse_args(sys.argv[1:] if argv is None else argv)
    t0 = time.perf_counter()
    r = run(args)
    r["wall_s"] = time.perf_counter() - t0
    print(format_table(r))
    line = json.dumps(r, default=float)
    print(line, flush=True)
    if args.json_out:
        with open(args.json_out, "w") as fh:
            fh.write(line + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
