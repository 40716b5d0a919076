"""`mmjax bench serve`: an async load generator for any OpenAI-compatible chat server.

Sends `--requests` streaming chat completions, at most `--concurrency` in flight, each with one
generated image per entry of `--image-sizes` cycled over requests (random noise encoded as a
data URI, different per request so no server-side image cache can help unless --same-image).
Per request it records the arrival time of every SSE chunk that carries content:

  TTFT   first content chunk - request sent
  ITL    gaps between successive content chunks (a chunk carrying several tokens counts once)
  TPOT   (last chunk - first chunk) / (output tokens - 1)
  e2e    last byte - request sent

and reports request throughput, output tokens/s (usage.completion_tokens when the server sends
usage, else the number of content chunks), p50/p90/p99 of each latency and the errors (HTTP
status, error payloads, timeouts, connection failures). A table, then one JSON line.

  mmjax bench serve --url http://127.0.0.1:8000 --concurrency 8 --requests 64 --image-sizes 224x224,640x480

`--llamacpp` adds llama.cpp's server as a peer in the same run: the same payloads against a
llama-server with `--parallel <concurrency>` slots started from an existing build
(benchmarks/llamacpp.py: the one ../shared/peers/llamacpp_peer.sh makes; a benchmark never builds
it). Without a build it prints the llama.cpp figures recorded on this machine class, labeled as
recorded.
"""
from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import sys
import time
from collections import Counter
from dataclasses import dataclass, field

import numpy as np

PERCENTILES = (50, 90, 99)


@dataclass
class Result:
    ok: bool = False
    status: int | None = None
    error: str | None = None
    sent: float = 0.0
    chunks: list[float] = field(default_factory=list)   # arrival time of each content chunk
    end: float = 0.0
    completion_tokens: int | None = None
    prompt_tokens: int | None = None
    text: str = ""

    @property
    def output_tokens(self) -> int:
        return self.completion_tokens if self.completion_tokens is not None else len(self.chunks)


def parse_sizes(spec: str) -> list[tuple[int, int]]:
    out = []
    for part in spec.split(","):
        part = part.strip().lower()
        if not part:
            continue
        w, _, h = part.partition("x")
        out.append((int(w), int(h or w)))
    if not out:
        raise ValueError(f"no image sizes in {spec!r}")
    return out


def image_data_uri(width: int, height: int, seed: int, fmt: str = "png") -> str:
    from PIL import Image

    rng = np.random.default_rng(seed)
    arr = rng.integers(0, 256, (height, width, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="PNG" if fmt == "png" else "JPEG")
    mime = "image/png" if fmt == "png" else "image/jpeg"
    return f"data:{mime};base64," + base64.b64encode(buf.getvalue()).decode()


def build_payloads(args, model: str) -> list[dict]:
    sizes = parse_sizes(args.image_sizes) if args.image_sizes else []
    payloads = []
    for i in range(args.requests):
        content: list[dict] = []
        for j in range(args.images_per_request if sizes else 0):
            w, h = sizes[(i * args.images_per_request + j) % len(sizes)]
            seed = 0 if args.same_image else 1000 * i + j + args.seed
            content.append({"type": "image_url", "image_url": {"url": image_data_uri(w, h, seed, args.image_format)}})
        content.append({"type": "text", "text": args.prompt})
        body = {"model": model, "messages": [{"role": "user", "content": content}], "stream": True,
                "stream_options": {"include_usage": True}, "max_tokens": args.max_tokens,
                "temperature": args.temperature}
        if args.ignore_eos:
            body["ignore_eos"] = True  # vLLM / SGLang / mmjax extension
        if args.extra_body:
            body.update(json.loads(args.extra_body))
        payloads.append(body)
    return payloads


async def _one(session, url: str, body: dict, headers: dict, timeout: float) -> Result:
    import aiohttp

    r = Result()
    r.sent = time.perf_counter()
    try:
        async with session.post(url, json=body, headers=headers,
                                timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
            r.status = resp.status
            if resp.status != 200:
                text = await resp.text()
                try:
                    msg = json.loads(text)["error"]["message"]
                except Exception:
                    msg = text[:200]
                r.error = f"HTTP {resp.status}: {msg}"
                r.end = time.perf_counter()
                return r
            buf = b""
            done = False
            async for data in resp.content.iter_any():
                now = time.perf_counter()
                buf += data
                while b"\n" in buf:
                    line, buf = buf.split(b"\n", 1)
                    line = line.strip()
                    if not line.startswith(b"data:"):
                        continue
                    payload = line[5:].strip()
                    if payload == b"[DONE]":
                        done = True
                        continue
                    try:
                        ev = json.loads(payload)
                    except json.JSONDecodeError:
                        r.error = f"bad SSE payload: {payload[:80]!r}"
                        continue
                    if "error" in ev:
                        err = ev["error"]
                        r.error = "stream error: " + (err.get("message", str(err)) if isinstance(err, dict) else str(err))
                        continue
                    for ch in ev.get("choices") or []:
                        delta = ch.get("delta") or {}
                        piece = delta.get("content")
                        if piece:
                            r.chunks.append(now)
                            r.text += piece
                        if ch.get("finish_reason") == "error":
                            r.error = r.error or "finish_reason=error"
                    usage = ev.get("usage")
                    if usage:
                        r.completion_tokens = usage.get("completion_tokens")
                        r.prompt_tokens = usage.get("prompt_tokens")
            r.end = time.perf_counter()
            if not done and r.error is None:
                r.error = "stream ended without [DONE]"
            r.ok = r.error is None
    except asyncio.TimeoutError:
        r.error, r.end = f"timeout after {timeout:.0f}s", time.perf_counter()
    except Exception as e:  # connection refused, reset, ...
        r.error, r.end = f"{type(e).__name__}: {e}", time.perf_counter()
    return r


async def discover_model(session, base: str, headers: dict) -> str:
    async with session.get(base + "/v1/models", headers=headers) as resp:
        resp.raise_for_status()
        data = await resp.json()
    return data["data"][0]["id"]


async def run_load(args) -> dict:
    import aiohttp

    base = args.url.rstrip("/")
    if base.endswith("/v1"):
        base = base[:-3]
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    # force_close: llama-server answers every stream with `Connection: close`; a pooled connector
    # would reuse the dead sockets (requests lost)
    conn = aiohttp.TCPConnector(limit=args.concurrency, force_close=getattr(args, "force_close", False))
    async with aiohttp.ClientSession(connector=conn) as session:
        model = args.model or await discover_model(session, base, headers)
        payloads = build_payloads(args, model)
        url = base + "/v1/chat/completions"
        for body in payloads[: args.warmup]:
            await _one(session, url, dict(body, max_tokens=min(4, args.max_tokens)), headers, args.timeout)
        queue: asyncio.Queue = asyncio.Queue()
        for p in payloads:
            queue.put_nowait(p)
        results: list[Result] = []

        async def worker():
            while True:
                try:
                    body = queue.get_nowait()
                except asyncio.QueueEmpty:
                    return
                results.append(await _one(session, url, body, headers, args.timeout))

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(min(args.concurrency, len(payloads)))))
        wall = time.perf_counter() - t0
    return summarize(results, wall, args, model)


def pct(xs, p):
    return float(np.percentile(xs, p)) if len(xs) else None


def summarize(results: list[Result], wall: float, args, model: str) -> dict:
    ok = [r for r in results if r.ok]
    ttft = [r.chunks[0] - r.sent for r in ok if r.chunks]
    itl = [b - a for r in ok for a, b in zip(r.chunks, r.chunks[1:])]
    tpot = [(r.chunks[-1] - r.chunks[0]) / (r.output_tokens - 1) for r in ok if r.chunks and r.output_tokens > 1]
    e2e = [r.end - r.sent for r in ok]
    out_tokens = sum(r.output_tokens for r in ok)
    errors = Counter(r.error for r in results if not r.ok)
    res = {
        "url": args.url, "model": model, "concurrency": args.concurrency, "requests": len(results),
        "image_sizes": args.image_sizes, "images_per_request": args.images_per_request if args.image_sizes else 0,
        "max_tokens": args.max_tokens, "duration_s": wall, "completed": len(ok), "errors": len(results) - len(ok),
        "error_kinds": dict(errors.most_common(10)),
        "request_throughput_rps": len(ok) / wall if wall > 0 else None,
        "output_tokens": out_tokens, "output_tokens_per_s": out_tokens / wall if wall > 0 else None,
        "prompt_tokens": sum(r.prompt_tokens or 0 for r in ok),
        "usage_reported": all(r.completion_tokens is not None for r in ok) if ok else False,
    }
    for name, xs in (("ttft", ttft), ("itl", itl), ("tpot", tpot), ("e2e", e2e)):
        res[f"{name}_mean_ms"] = 1e3 * float(np.mean(xs)) if xs else None
        for p in PERCENTILES:
            v = pct(xs, p)
            res[f"{name}_p{p}_ms"] = 1e3 * v if v is not None else None
    return res


def format_table(r: dict) -> str:
    def ms(x):
        return "-" if x is None else f"{x:.1f}"

    lines = [f"{r['requests']} requests to {r['url']} (model {r['model']}), concurrency {r['concurrency']}, "
             f"images {r['image_sizes'] or 'none'} x{r['images_per_request']}, max_tokens {r['max_tokens']}",
             f"completed {r['completed']}, errors {r['errors']}, duration {r['duration_s']:.2f} s",
             f"request throughput {r['request_throughput_rps']:.2f} req/s, output {r['output_tokens_per_s']:.1f} tok/s "
             f"({r['output_tokens']} tokens{'' if r['usage_reported'] else ', counted as chunks'})",
             "",
             f"{'latency (ms)':14s} {'mean':>9s} {'p50':>9s} {'p90':>9s} {'p99':>9s}",
             f"{'-' * 14} {'-' * 9} {'-' * 9} {'-' * 9} {'-' * 9}"]
    for name, label in (("ttft", "TTFT"), ("itl", "inter-token"), ("tpot", "TPOT"), ("e2e", "end-to-end")):
        lines.append(f"{label:14s} {ms(r[f'{name}_mean_ms']):>9s} {ms(r[f'{name}_p50_ms']):>9s} "
                     f"{ms(r[f'{name}_p90_ms']):>9s} {ms(r[f'{name}_p99_ms']):>9s}")
    for kind, n in r["error_kinds"].items():
        lines.append(f"error x{n}: {kind}")
    return "\n".join(lines)


def parse_args(argv):
    ap = argparse.ArgumentParser(prog="mmjax bench serve", description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", default=None, help="server base URL, e.g. http://127.0.0.1:8000 (required "
                    "unless --llamacpp)")
    ap.add_argument("--model", default=None, help="model name (default: the first of GET /v1/models)")
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--image-sizes", default="224x224", help="comma list WxH, cycled over requests ('' = text only)")
    ap.add_argument("--images-per-request", type=int, default=1)
    ap.add_argument("--image-format", choices=["png", "jpeg"], default="png")
    ap.add_argument("--same-image", action="store_true", help="one image for all requests (exercises caches)")
    ap.add_argument("--prompt", default="Describe this image in detail.")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--ignore-eos", action="store_true", help="send ignore_eos=true (vLLM/SGLang/mmjax extension)")
    ap.add_argument("--extra-body", default=None, help="JSON merged into every request body")
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--timeout", type=float, default=600.0, help="per-request timeout (s)")
    ap.add_argument("--warmup", type=int, default=1, help="requests sent (sequentially, 4 tokens) before timing")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--smoke", action="store_true", help="CI size: 4 requests, concurrency 2, 8 tokens, 64x64 images")
    ap.add_argument("--json-out", default=None)
    ap.add_argument("--force-close", action="store_true", help="a new connection per request")
    ap.add_argument("--llamacpp", action="store_true",
                    help="also drive llama.cpp's server (--parallel = concurrency) from an existing build; "
                         "without one, print its recorded figures")
    ap.add_argument("--llamacpp-dir", default=None, help="llama.cpp work dir (default $MMJAX_LLAMACPP_DIR or "
                                                         "~/.cache/mmjax/llamacpp)")
    ap.add_argument("--llamacpp-checkpoint", default=None, help="which converted checkpoint (default: the newest)")
    ap.add_argument("--llamacpp-threads", type=int, default=None, help="llama-server threads (default: cores)")
    ap.add_argument("--llamacpp-port", type=int, default=18931)
    a = ap.parse_args(argv)
    if a.url is None and not a.llamacpp:
        ap.error("--url is required (or --llamacpp alone)")
    if a.smoke:
        a.requests, a.concurrency, a.max_tokens = min(a.requests, 4), min(a.concurrency, 2), min(a.max_tokens, 8)
        if a.image_sizes == "224x224":
            a.image_sizes = "64x64,48x80"
    if a.concurrency < 1 or a.requests < 1:
        ap.error("--concurrency and --requests must be >= 1")
    return a


def run_llamacpp(args) -> dict:
    """The same load against llama-server from an existing build, or the recorded figures."""
    import copy
    import os
    import tempfile

    from benchmarks import llamacpp

    build = llamacpp.find_build(args.llamacpp_dir, args.llamacpp_checkpoint)
    if build is None:
        print(llamacpp.recorded_table())
        return {"peer": "llama.cpp", "measured": False, "recorded": llamacpp.RECORDED}
    la = copy.copy(args)
    la.force_close, la.model = True, None
    la.extra_body = json.dumps({**json.loads(args.extra_body or "{}"), "cache_prompt": False})
    log = os.path.join(tempfile.gettempdir(), f"llama-server-{os.getpid()}.log")
    with llamacpp.Server(build, parallel=args.concurrency, port=args.llamacpp_port,
                         threads=args.llamacpp_threads or os.cpu_count(), log_path=log) as srv:
        la.url = srv.url
        r = asyncio.run(run_load(la))
    print(f"llama.cpp peer (measured in this run: {build.server}, --parallel {args.concurrency})")
    print(format_table(r))
    return {"peer": "llama.cpp", "measured": True, "server": build.server, "gguf": build.text, **r}


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    r = {}
    if args.url:
        r = asyncio.run(run_load(args))
        print(format_table(r))
    if args.llamacpp:
        peer = run_llamacpp(args)
        if args.url and peer["measured"] and peer["output_tokens_per_s"]:
            r["vs_llamacpp_tok_s"] = r["output_tokens_per_s"] / peer["output_tokens_per_s"]
            print(f"output tok/s vs llama.cpp: {r['vs_llamacpp_tok_s']:.2f}x")
        r["llamacpp"] = peer
    line = json.dumps(r)
    print(line, flush=True)
    if args.json_out:
        with open(args.json_out, "w") as fh:
            fh.write(line + "\n")
    measured = [x for x in (r if args.url else None, r.get("llamacpp") if r.get("llamacpp", {}).get("measured")
                                                       else None) if x is not None]
    return 0 if all(x["completed"] > 0 for x in measured) else 1


if __name__ == "__main__":
    raise SystemExit(main())
