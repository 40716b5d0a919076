"""`mmjax serve` / `python -m serve`: argument parsing, model loading, serving, SIGTERM drain."""
from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
from pathlib import Path

log = logging.getLogger("mmjax.serve")


SHIPPED_MODEL = "mmjax-shapes"


def add_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument("--model", default=SHIPPED_MODEL,
                   help=f"model directory or hub id (default: {SHIPPED_MODEL}, the trained model shipped with mmjax)")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000; 0 = any free port)")
    p.add_argument("--api-key", default=os.environ.get("MMJAX_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1/* (default: $MMJAX_API_KEY, else none)")
    p.add_argument("--served-model-name", default=None,
                   help="model id clients send (default: the model's name: mmjax-shapes, a directory's base name "
                        "or the hub id)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "bfloat16", "int8", "fp8"],
                   help="KV cache element type: auto (--dtype), bfloat16, or int8 / fp8 (e4m3) with one scale per "
                        "token and KV head: about half the bytes of bfloat16, so twice the concurrent context")
    p.add_argument("--quantize", default=None, choices=["int8", "fp8"],
                   help="8-bit linear-layer weights (LM + ViT): int8 = int8 weights with per-channel scales and "
                        "per-token int8 activations (s8 dots; CPU and GPU), fp8 = e4m3 weights and activations "
                        "(GPUs; CPUs upcast)")
    p.add_argument("--quantize-group-size", type=_positive_int, default=None,
                   help="with --quantize int8: one scale per group of N input rows instead of per output channel")
    p.add_argument("--max-num-seqs", type=int, default=8, help="decode slots = max concurrently running requests")
    p.add_argument("--tensor-parallel-size", "-tp", type=_positive_int, default=1,
                   help="devices each engine replica's decoder is split over (Megatron-style tensor parallel)")
    p.add_argument("--data-parallel-size", "-dp", type=_positive_int, default=1,
                   help="engine replicas behind this server, each over --tensor-parallel-size devices")
    p.add_argument("--vision-tensor-parallel", action="store_true",
                   help="split the vision tower over the tensor-parallel devices too (default: replicated ViT "
                        "weights, the images of an encode call split over the devices)")
    p.add_argument("--vision-offload", action="store_true",
                   help="keep the vision tower and projector weights in host memory (pinned where the "
                        "backend has it) and bring them to the device only inside encode steps")
    p.add_argument("--no-overlap", action="store_true",
                   help="wait for every engine step before queuing the next (default: step N + 1 is queued "
                        "before the host reads step N's tokens; A/B and debugging)")
    p.add_argument("--decode-steps", type=_positive_int, default=1,
                   help="decode steps per engine call (vLLM's --num-scheduler-steps): the host's per-call "
                        "cost paid once for that many tokens of each running request (an H200 ran a 16-row "
                        "step in 1.7 ms of kernels and 4-5 ms of wall); new requests and stops wait for "
                        "the call")
    p.add_argument("--memory-budget", type=_memory_budget, default=None,
                   help="device memory per device for weights + KV cache + step temporaries: bytes (e.g. "
                        "20000000000, 20GiB, 512MiB) or a fraction of the device's memory (e.g. 0.9); "
                        "sizes the decode slots (at most --max-num-seqs) from the compiled steps' memory analysis")
    p.add_argument("--coordinator-address", default=os.environ.get("MMJAX_COORDINATOR_ADDRESS"),
                   help="multi-host: host:port of process 0 (jax.distributed; env MMJAX_COORDINATOR_ADDRESS)")
    p.add_argument("--num-processes", type=_positive_int, default=int(os.environ.get("MMJAX_NUM_PROCESSES", 1)),
                   help="multi-host: processes (hosts) sharing the mesh (env MMJAX_NUM_PROCESSES)")
    p.add_argument("--process-id", type=int, default=int(os.environ.get("MMJAX_PROCESS_ID", 0)),
                   help="multi-host: this process's index; 0 serves HTTP, the others follow (env MMJAX_PROCESS_ID)")
    p.add_argument("--lora-modules", nargs="*", default=[], metavar="NAME=PATH",
                   help="PEFT LoRA adapters served beside the base model (a request's \"model\" picks one)")
    p.add_argument("--max-loras", type=_non_negative_int, default=None,
                   help="LoRA adapters served at once (default: 4 with --lora-modules, else 0; "
                        "/v1/load_lora_adapter loads more at run time)")
    p.add_argument("--max-lora-rank", type=_positive_int, default=16, help="largest LoRA rank served (default 16)")
    p.add_argument("--max-model-len", type=int, default=None, help="context length (prompt + completion)")
    p.add_argument("--prefill-chunk", type=int, default=256, help="prompt tokens prefilled per engine step")
    p.add_argument("--max-queue", type=int, default=256, help="requests waiting for a slot before 503")
    p.add_argument("--encoder-cache-mib", type=int, default=512,
                   help="image features kept by content hash (LRU; a repeated image skips the vision tower)")
    p.add_argument("--limit-images", type=int, default=8, help="images per request")
    p.add_argument("--max-image-bytes", type=int, default=20 * 2**20, help="encoded bytes per image")
    p.add_argument("--limit-videos", type=int, default=2, help="videos (video_url parts) per request")
    p.add_argument("--max-video-bytes", type=int, default=100 * 2**20, help="encoded bytes per video")
    p.add_argument("--max-video-duration", type=float, default=3600.0, help="seconds per video (from the container)")
    p.add_argument("--max-video-frames", type=int, default=768, help="frames sampled from one video")
    p.add_argument("--max-video-pixels", type=int, default=4096 * 2304,
                   help="declared width*height of a video frame (video-bomb guard, checked before decoding)")
    p.add_argument("--video-decode-timeout", type=float, default=60.0, help="seconds to decode one video")
    p.add_argument("--video-max-tokens", type=int, default=None,
                   help="per-video token budget (default: the family's, = its per-image cap); larger: 400")
    p.add_argument("--video-workers", type=int, default=2, help="threads decoding videos")
    p.add_argument("--max-body-bytes", type=int, default=None,
                   help="HTTP body cap (default: what a request can need: text that fits the context, JSON-escaped, "
                        "plus --limit-images base64 images of --max-image-bytes)")
    p.add_argument("--max-messages", type=_positive_int, default=4096, help="chat messages per request")
    p.add_argument("--max-content-parts", type=_positive_int, default=512, help="content parts per chat message")
    p.add_argument("--max-image-pixels", type=int, default=40_000_000, help="decoded width*height per image")
    p.add_argument("--image-max-tokens", type=int, default=None,
                   help="per-image token budget (dynamic-resolution families resize to fit; others: 400)")
    p.add_argument("--low-detail-image-tokens", type=int, default=256,
                   help="token budget of image_url detail='low' (dynamic-resolution families)")
    p.add_argument("--pan-and-scan", action=argparse.BooleanOptionalAction, default=None,
                   help="Gemma 3 pan-and-scan crops for images with detail 'auto' ('high' always, 'low' never; "
                        "default: the checkpoint's processor setting)")
    p.add_argument("--max-image-tiles", type=_non_negative_int, default=None,
                   help="tiles per image for image_url detail 'auto'/'high' in tiling families (Idefics3, SmolVLM: "
                        "fewer tiles by a lower resize; LLaVA-NeXT / OneVision: grids over the cap are not used; 0: the global image alone, as detail 'low'; default: all)")
    p.add_argument("--allowed-local-media-path", default=None,
                   help="allow file:// image URLs under this directory (default: refused)")
    p.add_argument("--allowed-media-domains", nargs="*", default=[],
                   help="only fetch http(s) images from these hosts ('*.example.com' for subdomains)")
    p.add_argument("--enable-image-embeds", action="store_true",
                   help="accept {'type': 'image_embeds'} content parts (precomputed image features, base64 .npy)")
    p.add_argument("--allow-private-media-urls", action="store_true",
                   help="allow image URLs resolving to loopback/private/link-local addresses (refused by default)")
    p.add_argument("--media-fetch-timeout", type=float, default=10.0, help="seconds per image URL fetch")
    p.add_argument("--media-max-redirects", type=int, default=3)
    p.add_argument("--decode-workers", type=int, default=4,
                   help="worker processes decoding and resizing images (apart from tokenization; default 4)")
    p.add_argument("--decode-threads", action="store_true",
                   help="decode images in threads of the server process instead of worker processes")
    p.add_argument("--decode-workers-per-request", type=int, default=2,
                   help="images of one request decoding at once; its others wait so other requests get workers")
    p.add_argument("--max-decode-queue", type=int, default=64,
                   help="images waiting for a decode worker before new ones get 503 decode_queue_full")
    p.add_argument("--max-request-image-pixels", type=int, default=None,
                   help="decoded pixels of all images of one request, from their headers before any decode "
                        "(default: 4 x --max-image-pixels)")
    p.add_argument("--max-request-decode-seconds", type=float, default=30.0,
                   help="decode seconds one request's images may use; a worker past it is killed (0 = no limit)")
    p.add_argument("--grammar-cache-mib", type=_non_negative_int, default=128,
                   help="heap the cached compiled structured-output matchers may hold (LRU; 0 = no cache)")
    p.add_argument("--embed-batch-tokens", type=_positive_int, default=4096,
                   help="padded tokens of one embedding forward: the unit the embeddings lane runs before it "
                        "turns to another request or drops one whose client left")
    p.add_argument("--max-embed-queue", type=_positive_int, default=64,
                   help="embedding requests waiting for the embeddings lane before new ones get 503 queue_full")
    p.add_argument("--chat-template", default=None, help="jinja2 chat template file (overrides the checkpoint's)")
    p.add_argument("--tool-call-parser", default=None, choices=("hermes", "llama3_json", "mistral"),
                   help="tool-call format (default: chosen from the chat template and vocabulary)")
    p.add_argument("--warmup", action="store_true",
                   help="compile every bucket of every step (encode, prefill, decode) before listening")
    p.add_argument("--header-timeout", type=_positive_float, default=30.0,
                   help="seconds from a connection opening (or a request head's first byte) to the end of the head; "
                        "then 408 and close")
    p.add_argument("--body-timeout", type=_positive_float, default=30.0,
                   help="seconds to receive a request body; then 408 and close")
    p.add_argument("--keepalive-timeout", type=_positive_float, default=75.0,
                   help="seconds an idle keep-alive connection is kept open")
    p.add_argument("--keepalive-max-requests", type=int, default=1000,
                   help="responses per connection before 'Connection: close' (0 = no limit)")
    p.add_argument("--lingering-time", type=float, default=10.0,
                   help="seconds spent draining an unread request body after an early answer (413, 408, errors)")
    p.add_argument("--max-request-line", type=_positive_int, default=8190, help="bytes of the HTTP request line")
    p.add_argument("--max-header-size", type=_positive_int, default=8190, help="bytes of one HTTP header field")
    p.add_argument("--max-headers", type=_positive_int, default=128, help="HTTP header fields per request")
    p.add_argument("--drain-timeout", type=float, default=30.0,
                   help="on SIGTERM, seconds to let running requests finish before aborting them")
    p.add_argument("--log-stats-interval", type=float, default=1.0,
                   help="seconds between engine step log lines (0 = off)")
    p.add_argument("--log-level", default="info")
    return p


def _positive_int(v: str) -> int:
    n = int(v)
    if n <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {v}")
    return n


def _non_negative_int(v: str) -> int:
    n = int(v)
    if n < 0:
        raise argparse.ArgumentTypeError(f"must be a non-negative integer, got {v}")
    return n


def _positive_float(v: str) -> float:
    x = float(v)
    if not x > 0:
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {v}")
    return x


def _memory_budget(text: str) -> int | float:
    """'0.9' -> 0.9 (a fraction of device memory); '20GiB' / '512MiB' / '2e10' -> bytes."""
    units = {"kib": 2**10, "mib": 2**20, "gib": 2**30, "kb": 10**3, "mb": 10**6, "gb": 10**9}
    t = text.strip().lower()
    unit = next((u for u in sorted(units, key=len, reverse=True) if t.endswith(u)), None)
    try:
        value = float(t[:-len(unit)] if unit else t)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a byte count or a fraction: {text!r}") from None
    if unit:
        value *= units[unit]
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be positive: {text!r}")
    return value if value <= 1 and not unit else int(value)


def log_memory_plan(engine) -> None:
    """The device memory plan of each engine replica, on the startup log."""
    for i, e in enumerate(engine.replicas):
        plan = e.runner.memory_plan()
        mib = {k: f"{v / 2**20:,.1f} MiB" for k, v in plan.items()
               if isinstance(v, int) and not isinstance(v, bool) and k != "slots"}
        log.info("memory plan (replica %d, %d slots, per device, vision offloaded: %s, KV cache %s): %s", i,
                 plan["slots"], plan["vision_offloaded"], plan["kv_cache_dtype"],
                 ", ".join(f"{k} {v}" for k, v in mib.items()))


def build_parser() -> argparse.ArgumentParser:
    return add_arguments(argparse.ArgumentParser(
        prog="mmjax serve", description="OpenAI-compatible server for an mmjax vision-language model"))


def config_from_args(args, model_path: str):
    from serve.app import ServerConfig

    tpl = Path(args.chat_template).read_text() if args.chat_template else None
    return ServerConfig(
        served_model_name=args.served_model_name,
        api_key=args.api_key or None, limit_images=args.limit_images, max_image_bytes=args.max_image_bytes,
        max_image_pixels=args.max_image_pixels, image_max_tokens=args.image_max_tokens,
        low_detail_image_tokens=args.low_detail_image_tokens, pan_and_scan=args.pan_and_scan,
        max_image_tiles=args.max_image_tiles,
        allowed_local_media_path=args.allowed_local_media_path,
        allowed_media_domains=tuple(args.allowed_media_domains or ()),
        allow_private_media_urls=args.allow_private_media_urls, enable_image_embeds=args.enable_image_embeds, media_fetch_timeout=args.media_fetch_timeout,
        media_max_redirects=args.media_max_redirects, max_queue=args.max_queue,
        decode_workers=args.decode_workers, decode_workers_per_request=args.decode_workers_per_request,
        max_decode_queue=args.max_decode_queue, max_request_image_pixels=args.max_request_image_pixels,
        max_request_decode_seconds=args.max_request_decode_seconds, decode_processes=not args.decode_threads,
        log_stats_interval=args.log_stats_interval, max_body_bytes=args.max_body_bytes,
        drain_timeout=args.drain_timeout, chat_template=tpl, tool_call_parser=args.tool_call_parser,
        max_messages=args.max_messages,
        max_content_parts=args.max_content_parts, header_timeout=args.header_timeout,
        body_timeout=args.body_timeout, keepalive_timeout=args.keepalive_timeout,
        keepalive_max_requests=args.keepalive_max_requests, lingering_time=args.lingering_time,
        max_request_line=args.max_request_line, max_header_size=args.max_header_size,
        max_headers=args.max_headers, limit_videos=args.limit_videos, max_video_bytes=args.max_video_bytes,
        max_video_duration=args.max_video_duration, max_video_frames=args.max_video_frames,
        max_video_pixels=args.max_video_pixels, video_decode_timeout=args.video_decode_timeout,
        video_max_tokens=args.video_max_tokens, video_workers=args.video_workers,
        grammar_cache_mib=args.grammar_cache_mib, embed_batch_tokens=args.embed_batch_tokens,
        max_embed_queue=args.max_embed_queue, lora_modules=lora_modules(args.lora_modules))


def lora_modules(specs: list[str]) -> dict[str, str]:
    """--lora-modules NAME=PATH ... -> {name: path}."""
    out = {}
    for spec in specs:
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            raise SystemExit(f"mmjax serve: --lora-modules takes NAME=PATH, got {spec!r}")
        out[name] = path
    return out


def lora_args(args) -> dict:
    """The engine's LoRA arguments from the flags ({} without adapters)."""
    n = args.max_loras if args.max_loras is not None else (max(4, len(args.lora_modules)) if args.lora_modules else 0)
    return {"max_loras": n, "max_lora_rank": args.max_lora_rank} if n else {}


def warmup(vlm) -> float:
    """Compile every bucket of every step before listening (`Engine.warmup`); returns seconds."""
    import time

    t = time.monotonic()
    counts = vlm.engine.warmup()
    log.info("compiled shapes after warmup: %s", counts)
    return time.monotonic() - t


async def serve_forever(vlm, cfg, host: str, port: int) -> int:
    from serve.app import create_app, drain, start_server

    app = create_app(vlm, cfg)
    runner, site, bound = await start_server(app, host, port)
    print(f"mmjax serve: model {cfg.served_model_name!r} listening on http://{host}:{bound} "
          f"(OpenAI API at http://{host}:{bound}/v1)", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("shutting down: draining running requests (up to %.0fs)", cfg.drain_timeout)
    await drain(app, site)
    await runner.cleanup()
    log.info("stopped")
    return 0


def run(args) -> int:
    logging.basicConfig(level=getattr(logging, str(args.log_level).upper(), logging.INFO),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    import mmjax
    from mmjax import distributed
    from mmjax.image.decode import ImageLimits
    multihost = distributed.initialize(args.coordinator_address, args.num_processes, args.process_id)
    vlm = mmjax.load(args.model, dtype=args.dtype, quantize=args.quantize, quantize_group_size=args.quantize_group_size,
                     image_limits=ImageLimits(args.max_image_bytes, args.max_image_pixels),
                     max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len,
                     prefill_chunk=args.prefill_chunk,
                     max_images_per_request=max(args.limit_images, 1) + max(args.limit_videos, 0),
                     encoder_cache_bytes=max(args.encoder_cache_mib, 0) * 2**20,
                     tensor_parallel=args.tensor_parallel_size, data_parallel=args.data_parallel_size,
                     **({"vision_tensor_parallel": True} if args.vision_tensor_parallel else {}),
                     **({"vision_offload": True} if args.vision_offload else {}),
                     **({"overlap": False} if args.no_overlap else {}),
                     **({"decode_steps": args.decode_steps} if args.decode_steps > 1 else {}),
                     **({"memory_budget": args.memory_budget} if args.memory_budget is not None else {}),
                     **({"kv_cache_dtype": args.kv_cache_dtype} if args.kv_cache_dtype != "auto" else {}),
                     **lora_args(args))
    cfg = config_from_args(args, args.model)
    from serve.app import configure_family
    configure_family(vlm, cfg)
    if multihost and not distributed.is_leader():
        # a follower: same model, same engine, no server; runs the leader's steps until it stops
        vlm.engine
        log.info("process %d following the leader's steps", args.process_id)
        log.info("followed %d steps; the leader stopped", distributed.follow())
        return 0
    if args.warmup:
        log.info("warmup done in %.1fs", warmup(vlm))
        log_memory_plan(vlm.engine)
    try:
        return asyncio.run(serve_forever(vlm, cfg, args.host, args.port))
    finally:
        distributed.stop_followers()


def main(argv: list[str] | None = None) -> int:
    return run(build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
