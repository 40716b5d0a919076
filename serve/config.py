"""The server's options, each defined once: `ServerConfig`'s keywords and `mmjax serve`'s flags.

    cfg = ServerConfig(served_model_name="tiny", limit_images=4)      # Python
    ServerConfig.add_cli_args(parser); ServerConfig.from_cli_args(ns)  # CLI (serve/cli.py)

Each field is an `mmjax.options.option`: default, help, and the flag when it is not
`--field-name`. A field with `media="..."` also sets that attribute of the `MediaConfig` the
image/video fetcher gets (`media_config()`; "limits.max_bytes" = `MediaConfig.limits.max_bytes`).
Adding a server option: one field here.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass, fields
from pathlib import Path

from mmjax.options import Options, key_value, non_negative_int, option, positive_float, positive_int


def _opt(default=None, help=None, *, media: str | None = None, **kw):
    return option(default, help=help, meta={"media": media}, **kw)


def _read_template(path: str | None) -> str | None:
    return Path(path).read_text() if path else None


@dataclass
class ServerConfig(Options):
    served_model_name: str | None = _opt(
        None, "model id clients send (default: the model's name: mmjax-shapes, a directory's base name or the hub id)")
    api_key: str | None = _opt(
        None, "require 'Authorization: Bearer KEY' on /v1/* (default: $MMJAX_API_KEY, else none)",
        env="MMJAX_API_KEY", convert=lambda v: v or None)
    # ---- images and videos per request ---------------------------------------------------------
    limit_images: int = _opt(8, "images per request", type=int)
    limit_videos: int = _opt(2, "videos (video_url parts) per request", type=int)
    max_video_bytes: int = _opt(100 * 2**20, "encoded bytes per video", type=int, media="video_limits.max_bytes")
    max_video_duration: float = _opt(3600.0, "seconds per video (from the container)", type=float,
                                     media="video_limits.max_duration_s")
    max_video_frames: int = _opt(768, "frames sampled from one video", type=int, media="video_limits.max_frames")
    max_video_pixels: int = _opt(
        4096 * 2304, "declared width*height of a video frame (video-bomb guard, checked before decoding)",
        type=int, media="video_limits.max_pixels")
    video_decode_timeout: float = _opt(60.0, "seconds to decode one video", type=float,
                                       media="video_limits.decode_timeout_s")
    video_max_tokens: int | None = _opt(
        None, "per-video token budget (default: the family's, = its per-image cap); larger: 400", type=int)
    video_workers: int = _opt(2, "threads decoding videos", type=int, media="video_workers")
    max_image_bytes: int = _opt(20 * 2**20, "encoded bytes per image", type=int, media="limits.max_bytes")
    max_image_pixels: int = _opt(40_000_000, "decoded width*height per image", type=int, media="limits.max_pixels")
    image_max_tokens: int | None = _opt(
        None, "per-image token budget (dynamic-resolution families resize to fit; others: 400)", type=int,
        media="image_max_tokens")
    low_detail_image_tokens: int = _opt(
        256, "token budget of image_url detail='low' (dynamic-resolution families)", type=int,
        media="low_detail_tokens")
    pan_and_scan: bool | None = _opt(
        None, "Gemma 3 pan-and-scan crops for images with detail 'auto' ('high' always, 'low' never; "
              "default: the checkpoint's processor setting)",
        action=argparse.BooleanOptionalAction, media="pan_and_scan")
    max_image_tiles: int | None = _opt(
        None, "tiles per image for image_url detail 'auto'/'high' in tiling families (Idefics3, SmolVLM: "
              "fewer tiles by a lower resize; LLaVA-NeXT / OneVision: grids over the cap are not used; 0: the "
              "global image alone, as detail 'low'; default: all)", type=non_negative_int, media="max_tiles")
    # ---- where media may come from ---------------------------------------------------------------
    allowed_local_media_path: str | None = _opt(
        None, "allow file:// image URLs under this directory (default: refused)", media="allowed_local_path")
    allowed_media_domains: tuple[str, ...] = _opt(
        (), "only fetch http(s) images from these hosts ('*.example.com' for subdomains)", nargs="*",
        media="allowed_domains")
    allow_private_media_urls: bool = _opt(
        False, "allow image URLs resolving to loopback/private/link-local addresses (refused by default)",
        media="allow_private_urls")
    enable_image_embeds: bool = _opt(     # off: a client could feed arbitrary features past the vision tower
        False, "accept {'type': 'image_embeds'} content parts (precomputed image features, base64 .npy)")
    media_fetch_timeout: float = _opt(10.0, "seconds per image URL fetch", type=float, media="fetch_timeout")
    media_max_redirects: int = _opt(3, type=int, media="max_redirects")
    # ---- queues, pools and caches ----------------------------------------------------------------
    max_queue: int = _opt(256, "requests waiting for a slot before 503", type=int)
    max_embed_queue: int = _opt(
        64, "embedding requests waiting for the embeddings lane before new ones get 503 queue_full", type=positive_int)
    embed_batch_tokens: int = _opt(
        4096, "padded tokens of one embedding forward: the unit the embeddings lane runs before it "
              "turns to another request or drops one whose client left", type=positive_int)
    grammar_cache_mib: int = _opt(
        128, "heap the cached compiled structured-output matchers may hold (LRU; 0 = no cache)", type=non_negative_int)
    media_workers: int = _opt(4, cli=False)    # tokenization/templating pool (images have their own)
    decode_workers: int = _opt(
        4, "worker processes decoding and resizing images (apart from tokenization; default 4)", type=int,
        media="decode_workers")
    decode_workers_per_request: int = _opt(
        2, "images of one request decoding at once; its others wait so other requests get workers", type=int,
        media="decode_workers_per_request")
    max_decode_queue: int = _opt(
        64, "images waiting for a decode worker before new ones get 503 decode_queue_full", type=int,
        media="max_decode_queue")
    max_request_image_pixels: int | None = _opt(
        None, "decoded pixels of all images of one request, from their headers before any decode "
              "(default: 4 x --max-image-pixels)", type=int, media="max_request_pixels")
    max_request_decode_seconds: float = _opt(
        30.0, "decode seconds one request's images may use; a worker past it is killed (0 = no limit)", type=float,
        media="max_request_decode_seconds")
    decode_processes: bool = _opt(
        True, "decode images in threads of the server process instead of worker processes",
        flag="--decode-threads", media="decode_processes")
    log_stats_interval: float = _opt(1.0, "seconds between engine step log lines (0 = off)", type=float)
    drain_timeout: float = _opt(
        30.0, "on SIGTERM, seconds to let running requests finish before aborting them", type=float)
    # ---- chat ------------------------------------------------------------------------------------
    chat_template: str | None = _opt(       # the template's text; the flag names a file
        None, "jinja2 chat template file (overrides the checkpoint's)", convert=_read_template)
    tool_call_parser: str | None = _opt(
        None, "tool-call format (default: chosen from the chat template and vocabulary)",
        choices=("hermes", "llama3_json", "mistral"))
    # ---- request size ----------------------------------------------------------------------------
    max_body_bytes: int | None = _opt(
        None, "HTTP body cap (default: what a request can need: text that fits the context, JSON-escaped, "
              "plus --limit-images base64 images of --max-image-bytes)", type=int)
    max_messages: int = _opt(4096, "chat messages per request", type=positive_int)
    max_content_parts: int = _opt(512, "content parts per chat message", type=positive_int)
    # ---- connections: every phase is bounded in time ---------------------------------------------
    header_timeout: float = _opt(
        30.0, "seconds from a connection opening (or a request head's first byte) to the end of the head; "
              "then 408 and close", type=positive_float)
    body_timeout: float = _opt(30.0, "seconds to receive a request body; then 408 and close", type=positive_float)
    keepalive_timeout: float = _opt(75.0, "seconds an idle keep-alive connection is kept open", type=positive_float)
    keepalive_max_requests: int = _opt(
        1000, "responses per connection before 'Connection: close' (0 = no limit)", type=int)
    lingering_time: float = _opt(
        10.0, "seconds spent draining an unread request body after an early answer (413, 408, errors)", type=float)
    max_request_line: int = _opt(8190, "bytes of the HTTP request line", type=positive_int)
    max_header_size: int = _opt(8190, "bytes of one HTTP header field", type=positive_int)
    max_headers: int = _opt(128, "HTTP header fields per request", type=positive_int)
    # ---- LoRA adapters (the engine's slots: --max-loras, --max-lora-rank) -------------------------
    lora_modules: dict = option(
        default_factory=dict, type=key_value, nargs="+", convert=dict,
        help="PEFT LoRA adapters served beside the base model, NAME=PATH (a directory or hub id) each; a "
             "request's \"model\" picks one (with no --max-loras: 4 slots, or one per adapter if more)")
    extra: dict = option(cli=False, default_factory=dict)

    def media_config(self):
        """The `MediaConfig` of the image/video fetcher: every field marked `media=`."""
        from mmjax.image.decode import ImageLimits
        from mmjax.video import VideoLimits
        from serve.media import MediaConfig
        kw: dict = {"limits": {}, "video_limits": {}}
        for f in fields(self):
            path = f.metadata.get("media")
            if path:
                group, _, name = path.rpartition(".")
                (kw[group] if group else kw)[name] = getattr(self, f.name)
        kw["limits"], kw["video_limits"] = ImageLimits(**kw["limits"]), VideoLimits(**kw["video_limits"])
        return MediaConfig(**kw)
