"""The aiohttp application: OpenAI routes around an `AsyncEngine`.

    app = create_app(vlm, ServerConfig(served_model_name="tiny"))
    runner, site, port = await start_server(app, "127.0.0.1", 0)

This module builds the app (state, routes, lifecycle: watchdog, stats log, drain). The jobs live
apart, in the order a request meets them:

    serve/connection.py   head timeout, protocol errors as JSON, auth, body budget, body -> JSON
    serve/schema.py       the OpenAI request validated (clear 4xx)
    serve/inputs.py       model check; images fetched/decoded/resized (serve/media.py);
                          chat template + tokenization + validation in the pool (Engine.make_request)
    serve/completions.py  /v1/chat/completions, /v1/completions: the engine stream -> JSON
    serve/streaming.py    ... or SSE (tool-call streaming, usage chunk, [DONE])
    serve/generation.py   one engine Request as a route sees it; usage
    serve/logprobs.py     logprobs in the OpenAI shapes
    serve/routes.py       models, LoRA adapters, health, metrics, embeddings, tokenize

The first delta is awaited before any byte of a streaming response is sent, so every error that
happens before the first token (queue full, engine failure) still gets its proper HTTP status;
later failures arrive as an SSE `error` event. A client that goes away cancels its handler
(handler_cancellation) or fails a write; either way the stream generator's `finally` aborts the
request and frees its slot.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from concurrent.futures import ThreadPoolExecutor

from aiohttp import web

from mmjax.api import VLM
from mmjax.errors import InvalidRequestError
from mmjax.serving import AsyncEngine, Engine
from serve.completions import chat_completions, completions
from serve.config import ServerConfig
from serve.connection import auth_middleware, body_budget, error_middleware, keepalive_limit, start_server
from serve.media import MediaFetcher
from serve.metrics import ServerMetrics
from serve.routes import (detokenize, embeddings, get_model, health, list_models, load_lora_adapter, metrics_route,
                          tokenize, unload_lora_adapter)
from serve.schema import RequestLimits, UnavailableError
from serve.state import STATE, State

log = logging.getLogger("mmjax.serve")


def _as_vlm(obj) -> VLM:
    if isinstance(obj, Engine):
        return VLM.from_engine(obj)
    if isinstance(obj, VLM):
        return obj
    raise TypeError(f"create_app needs an mmjax VLM or Engine, got {type(obj).__name__}")


def configure_family(vlm: VLM, cfg: ServerConfig) -> None:
    """Server-wide image limits (a dynamic-resolution family's token cap shapes its encode
    bucket ladder, so this runs before the engine exists where possible)."""
    if cfg.image_max_tokens is not None:
        vlm.family.configure(image_max_tokens=cfg.image_max_tokens)
    if cfg.video_max_tokens is not None:
        if vlm.family.video_token_id is None:
            raise ValueError(f"--video-max-tokens: {vlm.family.name} does not take video")
        vlm.family.configure(video_max_tokens=cfg.video_max_tokens)


def create_app(vlm_or_engine, config: ServerConfig | None = None) -> web.Application:
    """Build the app. Starts the engine loop thread (an `AsyncEngine`) immediately; it stops in
    the app's cleanup. The engine must not be driven by anyone else while the app lives."""
    cfg = config or ServerConfig()
    vlm = _as_vlm(vlm_or_engine)
    if cfg.served_model_name is None:
        cfg.served_model_name = vlm.name
    configure_family(vlm, cfg)
    engine = vlm.engine
    for name, path in cfg.lora_modules.items():     # a bad adapter stops the start with its LoRAError
        if name == cfg.served_model_name:
            raise InvalidRequestError(f"LoRA adapter name {name!r} is the base model's name", param="lora_modules")
        engine.load_lora(name, path)
    if cfg.chat_template:
        vlm.tokenizer.chat_template = cfg.chat_template
    cfg.limit_images = min(cfg.limit_images, engine.max_images_per_request)
    if vlm.family.video_token_id is None:
        cfg.limit_videos = 0    # no video parts, and no body room for them
    aengine = AsyncEngine(engine, max_waiting=cfg.max_queue)
    executor = ThreadPoolExecutor(max_workers=cfg.media_workers, thread_name_prefix="mmjax-media")
    media_cfg = cfg.media_config()
    fetcher = MediaFetcher(media_cfg, vlm.family)   # decodes in its own pool; `executor` tokenizes
    metrics = ServerMetrics(engine.stats, aengine.queue_depth)
    fetcher.on_video = metrics.video_decode_seconds.observe
    st = State(vlm, engine, aengine, cfg, fetcher, metrics, executor)
    from serve.embeddings import EmbedLane
    st.embed_lane = EmbedLane(cfg.max_embed_queue)
    engine.grammars.max_bytes = max(cfg.grammar_cache_mib, 0) * 2**20

    st.body_cap, st.text_room = body_budget(cfg, engine.max_prompt_bytes)
    st.limits = RequestLimits(limit_images=cfg.limit_images, max_messages=cfg.max_messages,
                              limit_videos=cfg.limit_videos,
                              max_content_parts=cfg.max_content_parts, max_text_bytes=engine.max_prompt_bytes,
                              max_model_len=engine.max_model_len, image_embeds=cfg.enable_image_embeds)
    app = web.Application(middlewares=[error_middleware, auth_middleware], client_max_size=st.body_cap)
    app[STATE] = st
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/embeddings", embeddings)
    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/detokenize", detokenize)
    app.router.add_get("/v1/models", list_models)
    app.router.add_post("/v1/load_lora_adapter", load_lora_adapter)
    app.router.add_post("/v1/unload_lora_adapter", unload_lora_adapter)
    app.router.add_get("/v1/models/{model}", get_model)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics_route)
    app.on_startup.append(_on_startup)
    app.on_cleanup.append(_on_cleanup)
    app.on_response_prepare.append(keepalive_limit)
    return app


async def _watchdog(st: State) -> None:
    """If the engine thread ever dies, fail its waiting streams instead of leaving them hanging
    (new requests get 503 from serve/completions.py, /health turns 503)."""
    while st.aengine.alive():
        await asyncio.sleep(1.0)
    if st.aengine.stopped:
        return
    n = st.aengine.fail_all(UnavailableError("the engine loop stopped; the server must be restarted"))
    log.critical("the engine loop thread stopped; failed %d open request(s)", n)


async def _on_startup(app: web.Application) -> None:
    st = app[STATE]
    st.watchdog_task = asyncio.create_task(_watchdog(st))
    if st.config.log_stats_interval > 0:
        log_stats(st)  # baseline
        st.logger_task = asyncio.create_task(_stats_logger(st))


async def _on_cleanup(app: web.Application) -> None:
    st = app[STATE]
    if st.watchdog_task is not None:
        st.watchdog_task.cancel()
    if st.logger_task is not None:
        st.logger_task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await st.logger_task
        log_stats(st)  # what happened since the last line
    await st.fetcher.close()
    st.embed_lane.close()
    await asyncio.get_running_loop().run_in_executor(None, st.aengine.shutdown, 5.0)
    st.executor.shutdown(wait=False, cancel_futures=True)


# ---- step log --------------------------------------------------------------------------------------

async def _stats_logger(st: State) -> None:
    while True:
        await asyncio.sleep(st.config.log_stats_interval)
        log_stats(st)


def log_stats(st: State) -> None:
    """SGLang-style lines, one pair per interval in which the engine did work:
    `Prefill batch. #chunks, #new-token, #cached-token, cache hit rate, #running-req, #queue-req`
    `Decode batch. #running-req, #gen-token, gen throughput (token/s), #queue-req, #steps, ...`."""
    s = st.engine.stats()
    now = time.monotonic()
    prev, t_prev = st.stats_prev or (s, now)
    st.stats_prev = (s, now)
    dt = max(now - t_prev, 1e-9)
    d = {k: s.get(k, 0) - prev.get(k, 0) for k in ("tokens_prefilled", "tokens_cached", "tokens_decoded",
                                                   "decode_steps", "prefill_calls", "requests_finished",
                                                   "requests_aborted")}
    queued = st.aengine.queue_depth()
    if d["prefill_calls"]:
        total = d["tokens_prefilled"] + d["tokens_cached"]
        hit = d["tokens_cached"] / total if total else 0.0
        log.info("Prefill batch. #chunks: %d, #new-token: %d, #cached-token: %d, cache hit rate: %.2f%%, "
                 "#running-req: %d, #queue-req: %d", d["prefill_calls"], d["tokens_prefilled"],
                 d["tokens_cached"], 100 * hit, s.get("requests_running", 0), queued)
    if d["decode_steps"]:
        log.info("Decode batch. #running-req: %d, #gen-token: %d, gen throughput (token/s): %.2f, "
                 "#queue-req: %d, #steps: %d, #finished: %d, #aborted: %d", s.get("requests_running", 0),
                 d["tokens_decoded"], d["tokens_decoded"] / dt, queued, d["decode_steps"],
                 d["requests_finished"], d["requests_aborted"])


# ---- drain ---------------------------------------------------------------------------------------

async def drain(app: web.Application, site=None, timeout: float | None = None) -> None:
    """Stop accepting (listener closed, new requests 503), let running requests finish for up to
    `timeout` seconds, then abort the rest (their clients get a 503 / an SSE error event)."""
    st = app[STATE]
    st.draining = True
    if site is not None:
        await site.stop()
    timeout = st.config.drain_timeout if timeout is None else timeout
    deadline = time.monotonic() + timeout
    while st.active and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    if st.active:
        log.warning("drain timeout: aborting %d running request(s)", len(st.active))
        for rid in list(st.active):
            st.aengine.abort(rid)
        end = time.monotonic() + 5
        while st.active and time.monotonic() < end:
            await asyncio.sleep(0.05)


__all__ = ["ServerConfig", "create_app", "start_server", "drain", "STATE"]
