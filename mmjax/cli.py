"""`mmjax` command line: generate, serve, convert, bench."""
from __future__ import annotations

import argparse
import sys
import time


def _model_arg(args) -> str:
    """--model, else the shipped model's name (mmjax.load resolves it)."""
    from mmjax.api import SHIPPED_MODEL
    return args.model or SHIPPED_MODEL


def cmd_generate(args) -> int:
    import mmjax
    from mmjax import progress
    from mmjax.errors import MMJaxError

    progress.enable()     # a first run's kernel build says so on stderr (mmjax.progress)

    t0 = time.perf_counter()
    vlm = mmjax.load(_model_arg(args), args.dtype, max_num_seqs=1, quantize=args.quantize)
    sp = mmjax.SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed)
    try:
        if vlm.tokenizer.chat_template and not args.raw:
            content = [{"type": "image", "image": im} for im in args.image] + [{"type": "text", "text": args.prompt}]
            prompt, images = vlm.render_chat([{"role": "user", "content": content}])
        else:
            prompt, images = args.prompt, args.image
        eng = vlm.engine
        rid = eng.add_request(prompt, vlm.prepare_images(images), sp)
        while eng.has_work():
            for d in eng.step():
                if d.request_id == rid and d.text:
                    sys.stdout.write(d.text)
                    sys.stdout.flush()
    except MMJaxError as e:
        print(f"mmjax: error: {e.message}", file=sys.stderr)
        return 2
    sys.stdout.write("\n")
    if args.verbose:
        st = eng.stats()
        print(f"[{time.perf_counter() - t0:.2f}s total, compile {st['compile_seconds']:.2f}s, "
              f"compiled shapes {st['compiled_shapes']}]", file=sys.stderr)
    return 0


def cmd_convert(args) -> int:
    import mmjax

    vlm = mmjax.load(args.model, args.dtype, quantize=args.quantize, quantize_group_size=args.quantize_group_size)
    out = vlm.save_params(args.out)
    what = f" ({args.quantize} weights)" if args.quantize else ""
    print(f"saved converted params{what} to {out}; load with mmjax.load({args.model!r}, params_dir={str(out)!r})")
    return 0


_BENCHES = {"kernel", "engine", "serve", "attention", "sharding", "gpu", "tiling", "precision", "lora"}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["serve"]:
        return _delegate("serve", argv[1:])
    if argv[:1] == ["bench"] and len(argv) > 1 and argv[1] in _BENCHES:
        return _delegate(f"benchmarks.{argv[1]}", argv[2:])
    parser = argparse.ArgumentParser(prog="mmjax", description="JAX serving kernel for vision-language models")
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="answer one prompt about images, streaming to the terminal")
    g.add_argument("--model", default=None, help="local HF-layout dir or hub id (default: shipped mmjax-shapes)")
    g.add_argument("--image", action="append", default=[], help="image file (repeatable)")
    g.add_argument("--prompt", required=True)
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    g.add_argument("--quantize", default=None, choices=["int8", "fp8"], help="8-bit linear-layer weights")
    g.add_argument("--raw", action="store_true", help="send --prompt as is (with <image> placeholders), no chat template")
    g.add_argument("-v", "--verbose", action="store_true", help="print timing and compile figures to stderr")
    g.set_defaults(fn=cmd_generate)

    c = sub.add_parser("convert", help="convert a HF checkpoint's weights to orbax params for fast reloads")
    c.add_argument("--model", required=True)
    c.add_argument("--out", required=True)
    c.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    c.add_argument("--quantize", default=None, choices=["int8", "fp8"],
                   help="8-bit linear-layer weights (mmjax.quant); the copy reloads quantized")
    c.add_argument("--quantize-group-size", type=int, default=None, help="int8 scales per group of N input rows")
    c.set_defaults(fn=cmd_convert)

    # serve and bench own their flags: dispatched before parsing (see _DELEGATES).
    sub.add_parser("serve", help="OpenAI-compatible server (mmjax serve --help)", add_help=False)
    b = sub.add_parser("bench", help="benchmarks: kernel | engine | serve | attention | sharding | gpu | tiling | precision | lora", add_help=False)
    b.add_argument("which", choices=sorted(_BENCHES))

    args = parser.parse_args(argv)
    return int(args.fn(args) or 0)


def _delegate(module: str, rest: list[str]) -> int:
    import importlib

    mod = importlib.import_module(module)
    return int(mod.main(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
