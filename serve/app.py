"""The aiohttp application: OpenAI routes around an `AsyncEngine`.

    app = create_app(vlm, ServerConfig(served_model_name="tiny"))
    runner, port = await start_server(app, "127.0.0.1", 0)

Request path: auth -> JSON -> schema (serve.schema) -> images fetched/decoded/resized in a thread
pool (serve.media) -> chat template + tokenization + validation in the pool
(`Engine.make_request`) -> `AsyncEngine.stream` -> JSON or SSE. The first delta is awaited before
any byte of a streaming response is sent, so every error that happens before the first token
(queue full, engine failure) still gets its proper HTTP status; later failures arrive as an SSE
`error` event. A client that goes away cancels its handler (handler_cancellation) or fails a
write; either way the stream generator's `finally` aborts the request and frees its slot.
"""
from __future__ import annotations

import asyncio
import base64
import contextlib
import dataclasses
import hmac
import json
import logging
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web
from aiohttp.http_exceptions import ContentEncodingError, HttpProcessingError, LineTooLong
from aiohttp.web_protocol import RequestHandler, RequestPayloadError

from mmjax.api import VLM
from mmjax.errors import ContextLengthError, InvalidRequestError, MMJaxError, PromptError
from mmjax.serving import AsyncEngine, Engine, prompt_logprobs
from serve import schema, tools
from serve.config import ServerConfig
from serve.media import MediaFetcher
from serve.metrics import ServerMetrics
from serve.schema import (AuthError, NotFoundError, RequestLimits, RequestTimeoutError, RequestTooLargeError,
                          UnavailableError)

log = logging.getLogger("mmjax.serve")


@dataclass
class State:
    vlm: Any
    engine: Any
    aengine: Any
    config: ServerConfig
    fetcher: MediaFetcher
    metrics: ServerMetrics
    executor: ThreadPoolExecutor
    created: int = field(default_factory=lambda: int(time.time()))
    draining: bool = False
    active: set = field(default_factory=set)     # request ids being served
    logger_task: Any = None
    watchdog_task: Any = None
    token_cache: dict = field(default_factory=dict)   # token id -> (text, bytes) for logprobs
    body_cap: int = 0
    text_room: int = 0                                 # body bytes outside image data URIs
    limits: RequestLimits = field(default_factory=RequestLimits)
    stats_prev: Any = None                             # (engine stats, time) of the last log line
    embed_lane: Any = None                             # serve.embeddings.EmbedLane (/v1/embeddings work)
    _tool_parser: Any = None                           # (chat template, ToolParser) last chosen

    def tool_parser(self):
        """The tool-call format: --tool-call-parser, else chosen from the chat template and
        vocabulary (serve/tool_parsers.choose), again whenever the template changes."""
        tok = self.vlm.tokenizer
        if self._tool_parser is None or self._tool_parser[0] != tok.chat_template:
            from serve.tool_parsers import choose
            self._tool_parser = (tok.chat_template, choose(tok, self.config.tool_call_parser))
        return self._tool_parser[1]


STATE = web.AppKey("mmjax_state", State)


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
    app = web.Application(middlewares=[_error_middleware, _auth_middleware], client_max_size=st.body_cap)
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
    app.on_response_prepare.append(_keepalive_limit)
    return app


# JSON escapes make text at most 6x longer ("\u0001" for one byte); each message costs its keys.
_JSON_TEXT_FACTOR = 6
_MESSAGE_OVERHEAD = 256
_FIXED_OVERHEAD = 2**20          # sampling fields, stop strings and ids, image URLs, whitespace
_IMAGE_OVERHEAD = 1024           # a data URI's header and its part's keys


def _base64_len(n: int) -> int:
    return (n + 2) // 3 * 4


def body_budget(cfg: ServerConfig, max_prompt_bytes: int) -> tuple[int, int]:
    """(body cap, text room): what a legitimate request can need. Text room covers all of a
    request but its images' data URIs: prompt text that can still fit the context (the engine's
    `max_prompt_bytes`), JSON-escaped, plus per-message and fixed overhead. The body cap adds
    `limit_images` base64 images of `max_image_bytes`. Anything larger cannot be served, so it
    is refused (413) before it is read or parsed."""
    text_room = _JSON_TEXT_FACTOR * max_prompt_bytes + _MESSAGE_OVERHEAD * cfg.max_messages + _FIXED_OVERHEAD
    image_room = max(cfg.limit_images, 0) * (_base64_len(cfg.max_image_bytes) + _IMAGE_OVERHEAD)
    video_room = max(cfg.limit_videos, 0) * (_base64_len(cfg.max_video_bytes) + _IMAGE_OVERHEAD)
    cap = cfg.max_body_bytes or text_room + image_room + video_room
    return cap, min(text_room, cap)


async def _keepalive_limit(request: web.Request, response: web.StreamResponse) -> None:
    """After `keepalive_max_requests` responses on one connection, the next says Connection:
    close (a client cannot pin a connection, and the work queued on it, forever)."""
    limit = request.app[STATE].config.keepalive_max_requests
    proto = request.protocol
    if limit > 0 and isinstance(proto, _Protocol):
        proto.responses += 1
        if proto.responses >= limit:
            response.force_close()
            response.headers["Connection"] = "close"  # headers are computed before this hook runs


async def _watchdog(st: State) -> None:
    """If the engine thread ever dies, fail its waiting streams instead of leaving them hanging
    (new requests get 503 from `_generate`, /health turns 503)."""
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


async def start_server(app: web.Application, host: str = "127.0.0.1", port: int = 0):
    """Serve `app` (client disconnects cancel their handler) with the connection limits of its
    ServerConfig. Returns (runner, site, bound port)."""
    st = app[STATE]
    cfg = st.config
    runner = _Runner(app, hygiene=_Hygiene(cfg.header_timeout, st.metrics), handler_cancellation=True,
                     access_log=None, keepalive_timeout=cfg.keepalive_timeout, lingering_time=cfg.lingering_time,
                     max_line_size=cfg.max_request_line, max_field_size=cfg.max_header_size,
                     max_headers=cfg.max_headers)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    return runner, site, runner.addresses[0][1] if runner.addresses else port


# ---- connections ---------------------------------------------------------------------------------
# aiohttp bounds idle keep-alive time and line/header sizes itself (RequestHandler kwargs), but not
# the time a request head may take, and it answers its own parser errors in text/plain. The
# per-connection protocol below adds both. It subclasses aiohttp's RequestHandler and reads a few of
# its internals (_messages, _waiter, _request_in_progress, _request_count, _current_request, and
# Server's _loop, _kwargs): tests/test_hostile.py pins the behaviour, so an aiohttp upgrade that
# moves them fails there, not in production.

@dataclass(frozen=True)
class _Hygiene:
    header_timeout: float
    metrics: ServerMetrics | None = None


def _protocol_error(status: int, exc: BaseException | None, message: str | None) -> tuple[int, str, str, str]:
    """(status, type, code, message) for an error aiohttp answers itself."""
    if status >= 500:
        return status, "internal_error", "internal_error", "internal server error"
    text = (getattr(exc, "message", None) or message or str(exc or "") or "bad request").strip()
    text = text.splitlines()[0].rstrip(":") if text else "bad request"
    if isinstance(exc, LineTooLong) or "Too many headers" in text:
        return 431, "invalid_request_error", "headers_too_large", f"request line or headers too large: {text}"
    if isinstance(exc, ContentEncodingError):
        return 400, "invalid_request_error", "invalid_content_encoding", text
    return 400, "invalid_request_error", "invalid_http", f"malformed HTTP request: {text}"


def _raw_json_response(status: int, reason: str, body: dict) -> bytes:
    payload = json.dumps(body).encode()
    head = (f"HTTP/1.1 {status} {reason}\r\nContent-Type: application/json; charset=utf-8\r\n"
            f"Content-Length: {len(payload)}\r\nConnection: close\r\n\r\n")
    return head.encode() + payload


class _Protocol(RequestHandler):
    """One connection. A request head must be complete within `header_timeout` of the
    connection opening (for its first request) or of its first byte (later ones): a client that
    trickles a head byte by byte is answered 408 and closed. Errors aiohttp answers without the
    app (malformed request line, headers, Content-Length, chunking) are OpenAI error JSON."""

    def __init__(self, manager, *, hygiene: _Hygiene, **kwargs):
        super().__init__(manager, **kwargs)
        self.hygiene = hygiene
        self.responses = 0                           # counted by _keepalive_limit
        self._head_timer: asyncio.TimerHandle | None = None
        self._head_bytes = 0                         # bytes of an unfinished request head

    # -- head timeout --
    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._arm_head_timer()

    def connection_lost(self, exc) -> None:
        self._cancel_head_timer()
        super().connection_lost(exc)

    def _between_requests(self) -> bool:
        """Waiting for a request head: none queued or being handled, and not draining a body."""
        if self._messages or self._request_in_progress:
            return False
        waiting = self._waiter is not None and not self._waiter.done()
        return waiting or self._request_count == 0

    def data_received(self, data: bytes) -> None:
        idle = self._between_requests()
        queued = len(self._messages)
        super().data_received(data)
        if len(self._messages) > queued:        # a head completed: its handler takes it from here
            self._head_bytes = 0
            self._cancel_head_timer()
            self._fail_running_body(self._messages[queued][0])
        elif idle and data:
            self._head_bytes += len(data)
            self._arm_head_timer()

    def _fail_running_body(self, msg) -> None:
        """A parse error in the middle of a body (a bad chunk in a later packet) becomes a queued
        error message of its own, and the handler reading that body would wait for bytes that
        never come: hand it the error instead (its read fails at once, answered 400)."""
        exc = getattr(msg, "exc", None)  # aiohttp's _ErrInfo; a parsed head has no `exc`
        req = self._current_request
        if exc is None or req is None or req.content.is_eof():
            return
        err = RequestPayloadError(getattr(exc, "message", None) or str(exc))
        err.__cause__ = exc
        req.content.set_exception(err)

    def _arm_head_timer(self) -> None:
        t = self.hygiene.header_timeout
        if self._head_timer is None and t and t > 0:
            self._head_timer = asyncio.get_running_loop().call_later(t, self._head_timed_out)

    def _cancel_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self.transport is None or not self._between_requests():
            return
        m = self.hygiene.metrics
        if m is not None:
            m.timeouts.labels("header").inc()
        if self._head_bytes:  # a client that said something gets told why (a silent one is just closed)
            t = self.hygiene.header_timeout
            self.transport.write(_raw_json_response(408, "Request Timeout", schema.error_body(
                f"the request head did not arrive within {t:g}s", "invalid_request_error", None,
                "request_timeout")))
        self.force_close()

    # -- errors aiohttp answers itself --
    def handle_error(self, request, status: int = 500, exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:
        if request.writer.output_size > 0:  # as aiohttp: a started response cannot be replaced
            raise ConnectionError("response already started; cannot send the error")
        status, type_, code, text = _protocol_error(status, exc, message)
        if isinstance(exc, (ConnectionResetError, BrokenPipeError)):  # the client left mid-handler
            log.debug("client %s went away: %r", request.remote, exc)
        elif status >= 500:
            log.error("unhandled error outside the app: %r", exc, exc_info=exc)
        else:  # one line at debug: hostile clients must not be able to flood the log
            log.debug("protocol error from %s: %d %s", request.remote, status, text)
        m = self.hygiene.metrics
        if m is not None:
            m.protocol_errors.labels(str(status)).inc()
        resp = web.json_response(schema.error_body(text, type_, None, code), status=status)
        resp.force_close()
        return resp

    def log_exception(self, *args, **kw) -> None:
        # A body that failed to decode was already answered (400); aiohttp meets the same error
        # again while draining it and would log a traceback per hostile request.
        if isinstance(kw.get("exc_info"), (RequestPayloadError, HttpProcessingError)):
            log.debug("dropping a connection with an unreadable body: %s", kw["exc_info"])
            return
        super().log_exception(*args, **kw)


class _Server(web.Server):
    """aiohttp's low-level server, making `_Protocol` connections."""

    def __init__(self, handler, *, hygiene: _Hygiene, **kwargs):
        super().__init__(handler, **kwargs)
        self.hygiene = hygiene

    def __call__(self) -> _Protocol:
        return _Protocol(self, loop=self._loop, hygiene=self.hygiene, **self._kwargs)


class _Runner(web.AppRunner):
    """AppRunner whose server is a `_Server` (same handler, request factory and kwargs)."""

    def __init__(self, app: web.Application, *, hygiene: _Hygiene, **kwargs):
        super().__init__(app, **kwargs)
        self.hygiene = hygiene

    async def _make_server(self) -> web.Server:
        plain = await super()._make_server()
        return _Server(plain.request_handler, request_factory=plain.request_factory,
                       handler_cancellation=plain.handler_cancellation, loop=plain._loop,
                       hygiene=self.hygiene, **plain._kwargs)


# ---- middlewares ----------------------------------------------------------------------------------

def json_error(status: int, body: dict) -> web.Response:
    return web.json_response(body, status=status)


def _route_name(request: web.Request) -> str:
    info = request.match_info.route.resource
    return info.canonical if info is not None else "unmatched"


def _closing_if_body_unread(request: web.Request, resp: web.Response) -> web.Response:
    """An error answered before the body was read to its end (auth, a declared size over the cap,
    a timeout, an undecodable body) leaves the connection unable to carry another request:
    aiohttp would drain the rest and may fail doing so. Say Connection: close, so that a client
    does not reuse it and find a reset on its next request (seen as ~0.2% failed good requests in
    the 10-minute hostile soak before this)."""
    if request.body_exists and not request.content.is_eof():
        resp.force_close()
    return resp


@web.middleware
async def _error_middleware(request: web.Request, handler):
    st = request.app[STATE]
    t0 = time.monotonic()
    route = _route_name(request)
    status = 500
    try:
        resp = await handler(request)
        status = resp.status
        return resp
    except MMJaxError as e:
        status = e.status
        if status >= 500:
            log.warning("%s %s -> %d: %s", request.method, request.path, status, e.message)
        return _closing_if_body_unread(request, json_error(status, e.to_openai()))
    except web.HTTPException as e:
        status = e.status
        if e.status == 413:
            msg = (f"request body is larger than {request.app[STATE].body_cap} bytes "
                   "(images count against it; see --max-image-bytes and --limit-images)")
            return _closing_if_body_unread(request, json_error(
                413, schema.error_body(msg, "invalid_request_error", "body", "request_too_large")))
        if e.status == 404:
            return json_error(404, schema.error_body(f"no route {request.method} {request.path}",
                                                     "invalid_request_error", None, "not_found"))
        if e.status == 405:
            return json_error(405, schema.error_body(f"method {request.method} not allowed on {request.path}",
                                                     "invalid_request_error", None, "method_not_allowed"))
        return json_error(e.status, schema.error_body(e.reason or str(e), "invalid_request_error", None, None))
    except asyncio.CancelledError:
        status = 499  # client closed the connection
        raise
    except (ConnectionResetError, BrokenPipeError):
        status = 499
        raise
    except Exception as e:  # a bug: this request only
        log.exception("unhandled error on %s %s", request.method, request.path)
        return json_error(500, schema.error_body(f"internal error: {type(e).__name__}: {e}", "internal_error",
                                                 None, "internal_error"))
    finally:
        if route != "/metrics":
            st.metrics.requests.labels(route, str(status)).inc()
            st.metrics.latency.labels(route).observe(time.monotonic() - t0)


@web.middleware
async def _auth_middleware(request: web.Request, handler):
    key = request.app[STATE].config.api_key
    if key and (request.path.startswith("/v1") or request.path in ("/tokenize", "/detokenize")):
        auth = request.headers.get("Authorization", "")
        given = auth[7:].strip() if auth[:7].lower() == "bearer " else ""
        if not given:
            raise AuthError("missing API key: send 'Authorization: Bearer <key>'")
        try:  # header bytes that are not UTF-8 arrive as surrogate escapes: not any key
            given_b = given.encode("utf-8")
        except UnicodeEncodeError:
            raise AuthError("incorrect API key provided") from None
        if not hmac.compare_digest(given_b, key.encode("utf-8")):
            raise AuthError("incorrect API key provided")
    return await handler(request)


# ---- simple routes ----------------------------------------------------------------------------------

def _model_card(st: State) -> dict:
    return {"id": st.config.served_model_name, "object": "model", "created": st.created, "owned_by": "mmjax",
            "root": str(st.vlm.loaded.path), "max_model_len": st.engine.max_model_len,
            "image_token": st.vlm.tokenizer.image_token, "video_token": st.vlm.tokenizer.video_token}


def _lora_card(st: State, name: str) -> dict:
    _, adapter = st.engine.adapters.loaded[name]
    return {"id": name, "object": "model", "created": st.created, "owned_by": "mmjax", "root": adapter.path,
            "parent": st.config.served_model_name, "max_model_len": st.engine.max_model_len}


async def list_models(request: web.Request) -> web.Response:
    st = request.app[STATE]
    return web.json_response({"object": "list", "data": [_model_card(st)] + [_lora_card(st, n)
                                                                          for n in st.engine.lora_names]})


async def get_model(request: web.Request) -> web.Response:
    st = request.app[STATE]
    model = request.match_info["model"]
    _check_model(st, model)
    return web.json_response(_model_card(st) if model == st.config.served_model_name else _lora_card(st, model))


def _lora_name(body: Any) -> str:
    name = body.get("lora_name") if isinstance(body, dict) else None
    if not isinstance(name, str) or not name:
        raise InvalidRequestError("'lora_name' (a non-empty string) is required", param="lora_name")
    return name


async def load_lora_adapter(request: web.Request) -> web.Response:
    """vLLM's runtime adapter loading: {"lora_name", "lora_path"} -> a free adapter slot (no
    recompile). 400 (LoRAError) for a malformed adapter, a rank over --max-lora-rank, no free slot."""
    st = request.app[STATE]
    body = await _read_json(request, st)
    name, path = _lora_name(body), body.get("lora_path")
    if not isinstance(path, str) or not path:
        raise InvalidRequestError("'lora_path' (a non-empty string) is required", param="lora_path")
    if name == st.config.served_model_name:
        raise InvalidRequestError(f"{name!r} is the base model's name", param="lora_name")
    await asyncio.get_running_loop().run_in_executor(st.executor, st.engine.load_lora, name, path)
    return web.Response(text=f"Success: LoRA adapter '{name}' added successfully.")


async def unload_lora_adapter(request: web.Request) -> web.Response:
    st = request.app[STATE]
    name = _lora_name(await _read_json(request, st))
    if name == st.config.served_model_name:
        raise InvalidRequestError("the base model cannot be unloaded", param="lora_name")
    _check_model(st, name)
    st.engine.unload_lora(name)
    return web.Response(text=f"Success: LoRA adapter '{name}' removed successfully.")


async def health(request: web.Request) -> web.Response:
    st = request.app[STATE]
    if st.draining:
        return web.json_response({"status": "draining"}, status=503)
    if not st.aengine.alive():
        return web.json_response({"status": "engine loop stopped"}, status=503)
    return web.json_response({"status": "ok"})


async def metrics_route(request: web.Request) -> web.Response:
    from prometheus_client import CONTENT_TYPE_LATEST

    body = request.app[STATE].metrics.render()
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


# ---- /v1/embeddings --------------------------------------------------------------------------------

async def embeddings(request: web.Request) -> web.Response:
    """OpenAI embeddings: "input" (a string, a list of strings, token ids or lists of them) or
    vLLM's multimodal form "messages" (chat messages with images, rendered with the template).
    Extensions: "pooling" ("last", default, or "mean"), "normalize" (default true). Each input's
    final normed hidden state (VLM.embed's rule); encoding_format "float" or "base64"."""
    st = request.app[STATE]
    if st.draining:
        raise UnavailableError("the server is shutting down and accepts no new requests")
    body = await _read_json(request, st)
    if not isinstance(body, dict):
        raise InvalidRequestError("request body must be a JSON object", param=None)
    _check_model(st, body.get("model"))
    _warn_ignored(schema.unknown_fields(body, schema.EMBEDDING_FIELDS), request.path)
    fmt = body.get("encoding_format", "float")
    if fmt not in ("float", "base64"):
        raise InvalidRequestError("'encoding_format' must be 'float' or 'base64'", param="encoding_format")
    pooling = body.get("pooling", "last")
    if pooling not in ("last", "mean"):
        raise InvalidRequestError("'pooling' must be 'last' or 'mean'", param="pooling")
    normalize = schema._bool(body, "normalize", True)
    if body.get("dimensions") is not None:
        raise InvalidRequestError("'dimensions' is not supported (the embedding is the model's hidden size)",
                                  param="dimensions", code="unsupported_parameter")
    if "messages" in body:
        chat = {k: v for k, v in body.items() if k in ("model", "messages", "chat_template_kwargs",
                                                          "add_generation_prompt", "mm_processor_kwargs")}
        parsed = [schema.parse_chat(chat, limits=st.limits)]
    else:
        inp = body.get("input")
        items = inp if isinstance(inp, list) and inp and not all(schema._is_int(t) for t in inp) else [inp]
        if not items or len(items) > 256:
            raise InvalidRequestError("'input' must be a string, token ids, or a list of at most 256 of them",
                                      param="input")
        parsed = []
        for i, x in enumerate(items):
            try:
                parsed.append(schema.parse_completion({"prompt": x}, limits=st.limits))
            except InvalidRequestError as e:
                e.param = f"input[{i}]" if len(items) > 1 else "input"
                raise
    for p in parsed:
        for ref in p.images:
            ref.options = p.image_options
    try:
        images = [await _load_images(st, p.images) for p in parsed]
        # on the embeddings lane (serve/embeddings.py), never in the tokenization pool chat uses;
        # dropped before its next unit of work if the client leaves
        vecs, n_tok = await st.embed_lane.run(_embed_work(st, parsed, images, pooling, normalize))
    except asyncio.CancelledError:
        st.metrics.disconnects.inc()
        raise
    data = []
    for i, v in enumerate(vecs):
        emb = base64.b64encode(v.astype("<f4").tobytes()).decode() if fmt == "base64" else [float(x) for x in v]
        data.append({"object": "embedding", "index": i, "embedding": emb})
    return web.json_response({"object": "list", "data": data, "model": st.config.served_model_name,
                              "usage": {"prompt_tokens": n_tok, "total_tokens": n_tok}})


def _embed_work(st: State, parsed: list, images: list, pooling: str, normalize: bool):
    """An embedding request's work, unit by unit (a generator run by the lane: each `yield`
    ends a unit): tokenizing its inputs (32 a unit), then one forward per piece of at most
    `embed_batch_tokens` padded tokens (times the data-parallel replicas, which split a piece
    between them). Returns (vectors [inputs, hidden], prompt tokens)."""
    import numpy as np

    from mmjax.models.family import run_spans
    from mmjax.research.prompt import PromptInputs

    from serve.embeddings import pieces

    ps, n_tok = [], 0
    fam = st.vlm.family
    for i, (p, ims) in enumerate(zip(parsed, images)):
        req = _build_request(st, p, ims, "embed")[0]
        ps.append(PromptInputs(req.prompt_ids, req.images, req.image_pos, req.positions,
                               run_spans(req.prompt_ids, fam.image_token_id), req.prompt_len))
        n_tok += req.prompt_len
        if i % 32 == 31:
            yield
    yield
    budget = st.config.embed_batch_tokens
    replicas = len(st.engine.replicas)
    out = np.zeros((len(ps), st.vlm.model.language_model.hidden_size), np.float32)
    for piece in pieces([len(p.ids) for p in ps], budget * replicas):
        out[piece] = st.vlm.embed_prompts([ps[i] for i in piece], pooling, normalize, max_batch_tokens=budget)
        yield
    return out, n_tok


# ---- /tokenize, /detokenize (vLLM's extension routes) ------------------------------------------------

async def tokenize(request: web.Request) -> web.Response:
    """{"prompt" (+ "images") | "messages", "add_special_tokens", "add_generation_prompt",
    "chat_template_kwargs", "mm_processor_kwargs", "return_token_strs"} -> {"count", "max_model_len",
    "tokens", "image_tokens" (per image), "token_strs"?}: exactly the ids generation would see."""
    st = request.app[STATE]
    body = await _read_json(request, st)
    if not isinstance(body, dict):
        raise InvalidRequestError("request body must be a JSON object", param=None)
    if "messages" in body:
        chat = {k: v for k, v in body.items() if k in ("model", "messages", "chat_template_kwargs",
                                                          "add_generation_prompt", "mm_processor_kwargs", "tools")}
        parsed = schema.parse_chat(chat, limits=st.limits)
    else:
        comp = {k: v for k, v in body.items() if k in ("model", "prompt", "images", "mm_processor_kwargs")}
        parsed = schema.parse_completion(comp, limits=st.limits)
    _check_model(st, parsed.model)
    _warn_ignored(schema.unknown_fields(body, schema.TOKENIZE_FIELDS), request.path)
    add_special = schema._bool(body, "add_special_tokens", True)
    strs = schema._bool(body, "return_token_strs", False)
    for ref in parsed.images:
        ref.options = parsed.image_options
    images = await _load_images(st, parsed.images)

    def run():
        if parsed.kind == "completion" and isinstance(parsed.prompt, str) and not images and not add_special:
            ids = st.vlm.tokenizer.encode(parsed.prompt, add_special_tokens=False)
        else:
            ids = [int(t) for t in _build_request(st, parsed, images, "tokenize")[0].prompt_ids]
        out = {"count": len(ids), "max_model_len": st.engine.max_model_len, "tokens": ids,
               "image_tokens": [im.num_tokens for im in images]}
        if strs:
            out["token_strs"] = [st.vlm.tokenizer.id_to_token(t) for t in ids]
        return out
    return web.json_response(await asyncio.get_running_loop().run_in_executor(st.executor, run))


async def detokenize(request: web.Request) -> web.Response:
    """{"tokens": [ids]} -> {"prompt": text} (special tokens kept, as vLLM)."""
    st = request.app[STATE]
    body = await _read_json(request, st)
    if not isinstance(body, dict):
        raise InvalidRequestError("request body must be a JSON object", param=None)
    _check_model(st, body.get("model"))
    _warn_ignored(schema.unknown_fields(body, schema.DETOKENIZE_FIELDS), request.path)
    toks = body.get("tokens")
    vocab = st.vlm.tokenizer.vocab_size
    if not isinstance(toks, list) or len(toks) > st.engine.max_model_len * 4 or not all(
            schema._is_int(t) and 0 <= t < vocab for t in toks):
        raise InvalidRequestError(f"'tokens' must be a list of token ids in [0, {vocab})", param="tokens")
    text = await asyncio.get_running_loop().run_in_executor(
        st.executor, lambda: st.vlm.tokenizer.decode(toks, skip_special_tokens=False))
    return web.json_response({"prompt": text})


# ---- generation ---------------------------------------------------------------------------------------

def _check_model(st: State, model: str | None) -> None:
    if model is not None and model != st.config.served_model_name and model not in st.engine.lora_names:
        raise NotFoundError(f"the model {schema.short(model)} does not exist; this server serves "
                            f"{st.config.served_model_name!r}"
                            + (f" and the LoRA adapters {st.engine.lora_names}" if st.engine.lora_names else ""),
                            param="model")


def _lora_of(st: State, model: str | None) -> str | None:
    """The LoRA adapter a request's "model" names (None: the base model)."""
    return model if model is not None and model != st.config.served_model_name else None


def _too_large(st: State, n: int | None, what: str = "request body") -> RequestTooLargeError:
    size = f" of {n} bytes" if n is not None else ""
    return RequestTooLargeError(f"{what}{size} is larger than this server accepts ({st.body_cap} bytes: "
                                f"{st.text_room} for text, the rest for --limit-images data-URI images of "
                                f"--max-image-bytes; see --max-body-bytes)", param="body")


async def _read_body(request: web.Request, st: State) -> bytes:
    """The body, or a typed error: declared too large (before reading a byte), larger than the
    cap while reading (chunked), not complete within body_timeout, or not decodable
    (Content-Encoding, chunking)."""
    declared = request.content_length
    if declared is not None and declared > st.body_cap:
        raise _too_large(st, declared)
    timeout = st.config.body_timeout
    try:
        async with asyncio.timeout(timeout if timeout and timeout > 0 else None):
            return await request.read()
    except TimeoutError:
        st.metrics.timeouts.labels("body").inc()
        raise RequestTimeoutError(f"the request body did not arrive within {timeout:g}s", param="body") from None
    except web.HTTPRequestEntityTooLarge:
        raise _too_large(st, None) from None
    except RequestPayloadError as e:
        cause = e.__cause__
        msg = (getattr(cause, "message", None) or str(e)).strip().splitlines()[0].rstrip(":")
        code = "invalid_content_encoding" if isinstance(cause, ContentEncodingError) else "invalid_body"
        raise InvalidRequestError(f"the request body cannot be read: {msg}", param="body", code=code) from None


def _json_string_end(raw: bytes, i: int) -> int:
    """End (exclusive) of the JSON string whose opening quote is at `i`, or -1. bytes.find is
    memchr-fast: a 200 MB body of data URIs is scanned in milliseconds."""
    j = i
    while True:
        j = raw.find(b'"', j + 1)
        if j < 0:
            return -1
        k = j - 1
        while raw[k] == 0x5C:  # a quote after an odd run of backslashes is escaped
            k -= 1
        if (j - 1 - k) % 2 == 0:
            return j + 1


def _text_bytes_of(raw: bytes, limit_images: int) -> int:
    """Body bytes outside image data URIs (JSON strings starting with "data:"), which count
    against the image room instead. Only `limit_images` data URIs can be images: a body with
    many more "data: strings gets no exemption (they would be parsed as that many objects)."""
    n = raw.count(b'"data:')
    if n == 0 or n > limit_images + 8:
        return len(raw)
    exempt, i = 0, raw.find(b'"data:')
    while i >= 0:
        end = _json_string_end(raw, i)
        if end < 0:
            break
        exempt += end - i
        i = raw.find(b'"data:', end)
    return len(raw) - exempt


async def _read_json(request: web.Request, st: State) -> Any:
    raw = await _read_body(request, st)
    if _text_bytes_of(raw, st.config.limit_images + st.limits.limit_videos) > st.text_room:  # before json.loads
        raise _too_large(st, len(raw), "request body (outside image data URIs)")
    if not raw:
        raise InvalidRequestError("request body is empty; expected a JSON object", param=None,
                                  code="invalid_json")
    try:
        return json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise InvalidRequestError(f"request body is not valid JSON: {e}", param=None, code="invalid_json") from None
    except RecursionError:
        raise InvalidRequestError("request body is nested too deeply", param=None, code="invalid_json") from None


def _retrieve(task: asyncio.Future) -> None:
    """Mark a finished task's exception as retrieved: asyncio logs 'Task exception was never
    retrieved' for every one it collects otherwise (several images failing together, or failing
    after the request itself failed, was cancelled or its client left)."""
    if not task.cancelled():
        task.exception()


async def _load_embeds(st: State, ref):
    """An image_embeds part -> ImageInput (base64 .npy decoded and checked in the pool)."""
    from mmjax.image.embeds import decode_npy, image_from_embeds

    b64, grid = ref.embeds

    def run():
        return image_from_embeds(st.vlm.family, st.vlm.model.language_model, decode_npy(b64, st.config.max_image_bytes, ref.param), grid,
                                 param=ref.param)
    return await asyncio.get_running_loop().run_in_executor(st.executor, run)


async def _load_images(st: State, refs) -> list:
    """Fetch + decode all images concurrently; the first failure (in prompt order) cancels the
    rest. Every task's outcome is retrieved, whichever way this returns."""
    if not refs:
        return []
    n_images = sum(getattr(r, "kind", "image") == "image" for r in refs)    # a prompt's images (not videos)
    tasks = [asyncio.ensure_future(_load_embeds(st, r) if r.embeds is not None else st.fetcher.load(r, n_images=n_images))
             for r in refs]
    for t in tasks:
        t.add_done_callback(_retrieve)
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        for t in tasks:
            if t.done() and not t.cancelled() and t.exception() is not None:
                raise t.exception()
        return [t.result() for t in tasks]
    finally:
        for t in tasks:
            if not t.done():
                t.cancel()


def _warn_ignored(names: list[str], path: str) -> None:
    """Unknown request fields are ignored with a warning (vLLM's policy, every endpoint)."""
    if names:
        log.warning("%s: the following fields were present in the request but ignored: %s", path, names)


def _build_request(st: State, parsed: schema.ParsedRequest, images: list, rid: str):
    """Runs in the thread pool: template, tokenize, validate, size the completion."""
    eng = st.engine
    if parsed.kind == "chat":
        kw = dict(parsed.template_kwargs)
        if parsed.tools is not None and parsed.tools.template_tools:
            kw["tools"] = parsed.tools.template_tools
        prompt = st.vlm.tokenizer.render_chat(tools.normalize_messages(parsed.messages),
                                              add_generation_prompt=parsed.add_generation_prompt, **kw)
    else:
        prompt = parsed.prompt
        tok = st.vlm.tokenizer
        if isinstance(prompt, list):
            if images:
                raise InvalidRequestError("'images' needs a string prompt (token-id prompts cannot carry "
                                          "image placeholders)", param="images")
            bad = [t for t in prompt if t >= tok.vocab_size]
            if bad:
                raise InvalidRequestError(f"token id {bad[0]} is out of the vocabulary (size {tok.vocab_size})",
                                          param="prompt")
        elif images and tok.image_token and tok.image_token not in prompt:
            prompt = (tok.image_token + "\n") * len(images) + prompt
    extra = {}
    if parsed.intervention is not None:      # research extension: Pool / Ablate on the features, Prune in the LLM
        images = [parsed.intervention.apply(st.vlm.family, im) for im in images]
        extra = parsed.intervention.engine_args(sum(im.num_tokens for im in images))
    try:
        req = eng.make_request(prompt, images, dataclasses.replace(parsed.sampling), request_id=rid,
                               lora=_lora_of(st, parsed.model), **extra)
    except ContextLengthError as e:
        if parsed.kind == "completion" and e.param == "messages":
            e.param = "prompt"
        raise
    except PromptError as e:
        if parsed.kind == "completion" and e.param == "messages":
            e.param = "prompt"
        raise
    room = eng.max_model_len - req.prompt_len
    if parsed.max_tokens is None:
        req.sampling.max_tokens = room
    elif parsed.max_tokens > room:
        raise ContextLengthError(
            f"this model's maximum context length is {eng.max_model_len} tokens; you requested "
            f"{req.prompt_len + parsed.max_tokens} tokens ({req.prompt_len} in the prompt, including "
            f"{sum(im.num_tokens for im in images)} image and video tokens, and {parsed.max_tokens} for the completion, "
            f"'{parsed.max_tokens_param}')", param=parsed.max_tokens_param)
    else:
        req.sampling.max_tokens = parsed.max_tokens
    return eng.siblings(req, parsed.n)


class _Acc:
    """What a request produced so far."""

    def __init__(self):
        self.text = []
        self.n_tokens = 0
        self.logprobs: list = []
        self.finish_reason = None
        self.first_token_at = None


def _byte_decoder() -> dict[str, int]:
    """GPT-2 byte-level BPE: printable stand-in character -> byte."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("\xa1"), ord("\xac") + 1)) + \
        list(range(ord("\xae"), ord("\xff") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


_BYTE_DECODER = _byte_decoder()


def _token_info(st: State, tid: int) -> tuple[str, list[int]]:
    """(text, raw bytes) of one token; a token holding part of a UTF-8 character has text with
    U+FFFD but its true bytes (as in the OpenAI API's `bytes`)."""
    cache = st.token_cache
    hit = cache.get(tid)
    if hit is not None:
        return hit
    tok = st.vlm.tokenizer
    text = tok.decode([tid], skip_special_tokens=False)
    piece = tok.id_to_token(tid) or ""
    if piece and all(ch in _BYTE_DECODER for ch in piece) and "\ufffd" in text:
        raw = bytes(_BYTE_DECODER[ch] for ch in piece)
    elif len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
        raw = bytes([int(piece[3:5], 16)])
    else:
        raw = text.encode("utf-8")
    if len(cache) < 200_000:
        cache[tid] = (text, list(raw))
    return text, list(raw)


def _token_str(st: State, tid: int) -> str:
    return _token_info(st, tid)[0]


def _chat_lp(st: State, d, n: int) -> list[dict]:
    """Delta logprobs -> OpenAI chat entries. The engine's per-token dict holds the top-n
    alternatives plus the chosen token (which may or may not be among them)."""
    out = []
    for tid, lp in zip(d.token_ids, d.logprobs or []):
        top = sorted(lp.items(), key=lambda kv: -kv[1])[:n]
        tok, raw = _token_info(st, tid)
        alts = []
        for i, v in top:
            t, b = _token_info(st, i)
            alts.append({"token": t, "logprob": v, "bytes": b})
        out.append({"token": tok, "logprob": lp[tid], "bytes": raw, "top_logprobs": alts})
    return out


class Generation:
    """One request through the engine: shared by both routes, both modes."""

    def __init__(self, st: State, parsed: schema.ParsedRequest, req, route: str, t0: float, rid: str):
        self.st, self.parsed, self.req, self.route, self.t0, self.rid = st, parsed, req, route, t0, rid
        self.acc = _Acc()
        self.gen = st.aengine.stream(req)
        self.scores: dict | None = None      # the prompt's own logprobs (prompt_logprobs, echo)
        self.n_images = len(req.images)
        self.image_tokens = req.num_image_tokens
        self.video_tokens = req.num_video_tokens

    async def next(self):
        try:
            d = await self.gen.__anext__()
        except StopAsyncIteration:
            return None
        a = self.acc
        if d.error is not None:
            raise d.error
        if d.finish_reason == "abort":
            raise UnavailableError("the request was aborted because the server is shutting down")
        if d.token_ids and a.first_token_at is None:
            a.first_token_at = time.monotonic()
            self.st.metrics.ttft.labels(self.route).observe(a.first_token_at - self.t0)
        a.n_tokens += len(d.token_ids)
        a.text.append(d.text)
        if d.finished:
            a.finish_reason = d.finish_reason
            self._account()
        return d

    def _account(self) -> None:
        m, a = self.st.metrics, self.acc
        if self.req.index == 0:       # n > 1: the prompt counts once
            m.prompt_tokens.inc(self.req.prompt_len)
            m.image_tokens.inc(self.image_tokens)
            m.video_tokens.inc(self.video_tokens)
            m.cached_tokens.inc(self.req.cached_tokens)
        m.completion_tokens.inc(a.n_tokens)

    def usage(self) -> dict:
        return usage_of([self])

    async def close(self) -> None:
        await self.gen.aclose()

    def logprob_entries(self, d) -> list:
        return _chat_lp(self.st, d, self.parsed.logprobs or 0) if d.logprobs is not None else []


def usage_of(gens: list[Generation]) -> dict:
    """OpenAI usage of one request's choices: the prompt once, the completions summed."""
    g = gens[0]
    out = schema.usage(g.req.prompt_len, sum(x.acc.n_tokens for x in gens), int(g.req.cached_tokens),
                       g.image_tokens, g.video_tokens)
    if g.req.pruned_tokens:   # the `intervention` extension's FastV: image tokens dropped after its layer
        out["prompt_tokens_details"]["pruned_tokens"] = int(g.req.pruned_tokens)
    return out


def _prompt_token_str(st: State, tid: int) -> str:
    """A prompt token as text; image tokens show as the model's image placeholder."""
    if tid == st.vlm.family.image_token_id and st.vlm.tokenizer.image_token:
        return st.vlm.tokenizer.image_token
    return _token_str(st, tid)


def _vllm_prompt_logprobs(st: State, sc: dict) -> list:
    """vLLM's `prompt_logprobs`: None for the first token, then {id: {logprob, rank,
    decoded_token}} holding the prompt token and the top-k."""
    return [d if d is None else {str(t): v for t, v in d.items()} for d in prompt_logprobs.per_position(
        sc, lambda t: _prompt_token_str(st, t), lambda lp, r, s: {"logprob": lp, "rank": r, "decoded_token": s})]


def _echo_entries(st: State, sc: dict | None, ids: list[int], k: int | None) -> list[dict]:
    """Completion logprob entries of the echoed prompt (the first token has none)."""
    entries = []
    for j, tid in enumerate(ids):
        e = {"token": _prompt_token_str(st, tid), "logprob": None, "top_logprobs": []}
        if j and sc is not None:
            e["logprob"] = sc["chosen"][j - 1]
            e["top_logprobs"] = [{"token": _prompt_token_str(st, a), "logprob": v}
                                 for a, v in zip(sc["top"][j - 1][:k or 0], sc["top_lp"][j - 1][:k or 0])]
        entries.append(e)
    return entries


def _echo_text(st: State, parsed: schema.ParsedRequest, req) -> str:
    """The prompt as echoed: a string prompt as given (with the image placeholders the server
    prepended, if any), token ids decoded (special tokens kept)."""
    if isinstance(parsed.prompt, str):
        tok = st.vlm.tokenizer
        if parsed.images and tok.image_token and tok.image_token not in parsed.prompt:
            return (tok.image_token + "\n") * len(parsed.images) + parsed.prompt
        return parsed.prompt
    return st.vlm.tokenizer.decode(req.prompt_ids, skip_special_tokens=False)


def _completion_lp(entries: list[dict], offset: int) -> tuple[dict, int]:
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for e in entries:
        out["tokens"].append(e["token"])
        out["token_logprobs"].append(e["logprob"])
        out["top_logprobs"].append({t["token"]: t["logprob"] for t in e["top_logprobs"]}
                                   if e["logprob"] is not None else None)
        out["text_offset"].append(offset)
        offset += len(e["token"])
    return out, offset


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, "chat")


async def completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, "completion")


async def _generate(request: web.Request, kind: str) -> web.StreamResponse:
    st = request.app[STATE]
    t0 = time.monotonic()
    if st.draining:
        raise UnavailableError("the server is shutting down and accepts no new requests")
    if not st.aengine.alive():
        raise UnavailableError("the engine loop stopped; the server must be restarted")
    body = await _read_json(request, st)
    parsed = schema.parse_chat(body, limits=st.limits, tool_parser=st.tool_parser()) if kind == "chat" else \
        schema.parse_completion(body, limits=st.limits)
    _check_model(st, parsed.model)
    _warn_ignored(parsed.ignored, request.path)
    for ref in parsed.images:
        ref.options = parsed.image_options
    st.metrics.images.inc(sum(r.kind == "image" for r in parsed.images))
    st.metrics.videos.inc(sum(r.kind == "video" for r in parsed.images))
    images = await _load_images(st, parsed.images)
    rid = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"
    loop = asyncio.get_running_loop()
    echo_lp = parsed.kind == "completion" and parsed.echo and parsed.logprobs is not None
    k_prompt = max(parsed.prompt_logprobs or 0, parsed.logprobs or 0)
    if parsed.prompt_logprobs is not None or echo_lp:     # from the prefill's logits of every prompt position
        parsed.sampling.prompt_logprobs = k_prompt
    reqs = await loop.run_in_executor(st.executor, _build_request, st, parsed, images, rid)
    if st.draining:
        raise UnavailableError("the server is shutting down and accepts no new requests")
    route = _route_name(request)
    gens = [Generation(st, parsed, r, route, t0, rid) for r in reqs]
    st.active.add(rid)
    st.metrics.in_flight.inc()
    try:
        # QueueFullError / engine failure surface here, before any header
        firsts = [await g.next() for g in gens]
        if parsed.sampling.prompt_logprobs is not None:     # choice 0's prefill wrote them before its first token
            scores = prompt_logprobs.prompt_scores(reqs[0], k_prompt)
            for g in gens:
                g.scores = scores
        if parsed.stream:
            return await _stream(request, gens, firsts, kind)
        return await _collect(gens, firsts, kind)
    except asyncio.CancelledError:
        st.metrics.disconnects.inc()
        raise
    finally:
        st.active.discard(rid)
        st.metrics.in_flight.dec()
        for g in gens:
            await g.close()


async def _collect_one(g: Generation, d, kind: str) -> dict:
    entries = []
    while d is not None:
        entries.extend(g.logprob_entries(d))
        if d.finished:
            break
        d = await g.next()
    a = g.acc
    text = "".join(a.text)
    lp = None
    echo = kind == "completion" and g.parsed.echo
    if echo:
        text = _echo_text(g.st, g.parsed, g.req) + text
    if g.parsed.logprobs is not None:
        if kind == "chat":
            lp = schema.chat_logprobs(entries)
        else:
            if echo:
                entries = _echo_entries(g.st, g.scores, g.req.prompt_ids.tolist(), g.parsed.logprobs) + entries
            lp = _completion_lp(entries, 0)[0]
    i = g.req.index
    if kind == "chat":
        msg, fr = {"role": "assistant", "content": text}, a.finish_reason
        if g.parsed.tools is not None and g.parsed.tools.parse:
            content, calls = tools.parse_output(g.parsed.tools, text)
            if calls:
                msg = {"role": "assistant", "content": content or None, "tool_calls": calls}
                fr = "tool_calls" if fr == "stop" else fr
        return {"index": i, "message": msg, "logprobs": lp, "finish_reason": fr}
    return {"index": i, "text": text, "logprobs": lp, "finish_reason": a.finish_reason}


async def _collect(gens: list[Generation], firsts: list, kind: str) -> web.Response:
    choices = await asyncio.gather(*(_collect_one(g, d, kind) for g, d in zip(gens, firsts)))
    g, st = gens[0], gens[0].st
    obj = "chat.completion" if kind == "chat" else "text_completion"
    out = {"id": g.rid, "object": obj, "created": schema.now(), "model": g.req.lora or st.config.served_model_name,
           "choices": list(choices), "usage": usage_of(gens)}
    if g.parsed.prompt_logprobs is not None:
        out["prompt_logprobs"] = _vllm_prompt_logprobs(st, g.scores)
    return web.json_response(out)


def _sse(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


async def _pump(i: int, g: Generation, d, q: asyncio.Queue) -> None:
    """Feed one choice's deltas into the request's stream queue: (i, delta, None), an error as
    (i, None, error), and (i, None, None) when it is done."""
    try:
        while d is not None:
            await q.put((i, d, None))
            if d.finished:
                break
            d = await g.next()
    except MMJaxError as e:
        await q.put((i, None, e))
    await q.put((i, None, None))


async def _stream(request: web.Request, gens: list[Generation], firsts: list, kind: str) -> web.StreamResponse:
    g0 = gens[0]
    st = g0.st
    resp = web.StreamResponse(status=200, headers={"Content-Type": "text/event-stream; charset=utf-8",
                                                   "Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    created = schema.now()
    model = g0.req.lora or st.config.served_model_name       # an adapter's request answers as that model
    include_usage = g0.parsed.include_usage
    want_lp = g0.parsed.logprobs is not None
    offsets = [0] * len(gens)

    def chunk(choice: dict | None) -> dict:
        obj = {"id": g0.rid, "object": "chat.completion.chunk" if kind == "chat" else "text_completion",
               "created": created, "model": model, "choices": [choice] if choice is not None else []}
        if include_usage:
            obj["usage"] = None
        return obj

    parse_tools = kind == "chat" and g0.parsed.tools is not None and g0.parsed.tools.parse
    parser = g0.parsed.tools.parser if parse_tools else None
    full, sent = [""] * len(gens), [0] * len(gens)
    tstreams = [tools.ToolStream(g0.parsed.tools) for _ in gens] if parse_tools else []
    q: asyncio.Queue = asyncio.Queue()
    pumps: list[asyncio.Task] = []
    try:
        await resp.prepare(request)  # inside: a client that resets before the headers is a disconnect too
        if kind == "chat":
            for g in gens:
                await resp.write(_sse(chunk({"index": g.req.index, "delta": {"role": "assistant", "content": ""},
                                             "logprobs": None, "finish_reason": None})))
        if kind == "completion" and g0.parsed.echo:
            for i, g in enumerate(gens):
                lp = None
                if want_lp:
                    lp, offsets[i] = _completion_lp(_echo_entries(st, g.scores, g.req.prompt_ids.tolist(),
                                                                  g.parsed.logprobs), 0)
                await resp.write(_sse(chunk({"index": g.req.index, "text": _echo_text(st, g.parsed, g.req),
                                             "logprobs": lp, "finish_reason": None})))
        if g0.parsed.prompt_logprobs is not None:
            first = chunk(None)
            first["prompt_logprobs"] = _vllm_prompt_logprobs(st, g0.scores)
            await resp.write(_sse(first))
        pumps = [asyncio.ensure_future(_pump(i, g, d, q)) for i, (g, d) in enumerate(zip(gens, firsts))]
        running, failed = len(gens), False
        while running:
            i, d, err = await q.get()
            if d is None:
                if err is not None:  # after the headers: report in-band
                    log.warning("request %s failed mid-stream: %s", g0.rid, err.message)
                    await resp.write(_sse(err.to_openai()))
                    failed = True
                    break
                running -= 1
                continue
            g = gens[i]
            lp = None
            if want_lp:
                entries = g.logprob_entries(d)
                if kind == "chat":
                    lp = schema.chat_logprobs(entries)
                else:
                    lp, offsets[i] = _completion_lp(entries, offsets[i])
            text = d.text
            fr = d.finish_reason if d.finished else None
            frags: list[dict] = []
            if parse_tools:   # content streams until a tool call starts; then the calls, argument by argument
                full[i] += d.text
                k = parser.find(full[i])
                if d.finished:
                    _, calls = tools.parse_output(g0.parsed.tools, full[i])
                    upto = (k if k >= 0 else len(full[i])) if calls else len(full[i])
                    fr = "tool_calls" if calls and fr == "stop" else fr
                    frags = tstreams[i].finish(calls)
                else:
                    upto = k if k >= 0 else len(full[i]) - parser.held_back(full[i])
                    frags = tstreams[i].update(full[i]) if k >= 0 else []
                text = full[i][sent[i]:max(sent[i], upto)]
                sent[i] = max(sent[i], upto)
            if text or lp is not None or d.finished or frags:
                if kind == "chat":   # one chunk per tool-call fragment (as vLLM); the last one finishes
                    deltas = ([{"content": text}] if text else []) + [{"tool_calls": [f]} for f in frags] or [{}]
                    for n, delta in enumerate(deltas):
                        await resp.write(_sse(chunk({"index": g.req.index, "delta": delta,
                                                     "logprobs": lp if n == 0 else None,
                                                     "finish_reason": fr if n == len(deltas) - 1 else None})))
                else:
                    await resp.write(_sse(chunk({"index": g.req.index, "text": d.text, "logprobs": lp,
                                                 "finish_reason": fr})))
        if include_usage and not failed and all(g.acc.finish_reason is not None for g in gens):
            u = chunk(None)
            u["usage"] = usage_of(gens)
            await resp.write(_sse(u))
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
    except (ConnectionResetError, BrokenPipeError, RuntimeError) as e:
        # client went away mid-stream (aiohttp raises ConnectionResetError / ClientConnectionResetError)
        if isinstance(e, RuntimeError) and "closing" not in str(e).lower():
            raise
        st.metrics.disconnects.inc()
        log.info("client disconnected from %s; request aborted", g0.rid)
    finally:
        for p in pumps:
            if not p.done():
                p.cancel()
        # the pumps must have left their generators before _generate closes them (aclose() on a
        # generator another task is still running raises)
        await asyncio.gather(*pumps, return_exceptions=True)
    return resp


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
