"""Connection handling: what reaches a route and how errors outside the routes are answered.

- the body budget: the largest body a legitimate request can need (413 before reading more),
  and reading the body (size, time, encoding) and its JSON;
- the per-connection protocol: a request-head timeout and OpenAI-style JSON for the errors
  aiohttp answers itself, by subclassing aiohttp's RequestHandler / Server / AppRunner;
- the middlewares: errors -> OpenAI error JSON with metrics per route, bearer-key auth, and the
  keep-alive request limit.
"""
from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
from dataclasses import dataclass
from typing import Any

from aiohttp import web
from aiohttp.http_exceptions import ContentEncodingError, HttpProcessingError, LineTooLong
from aiohttp.web_protocol import RequestHandler, RequestPayloadError

from mmjax.errors import InvalidRequestError, MMJaxError
from serve import schema
from serve.config import ServerConfig
from serve.metrics import ServerMetrics
from serve.schema import AuthError, RequestTimeoutError, RequestTooLargeError
from serve.state import STATE, State

log = logging.getLogger("mmjax.serve")


# ---- body budget ---------------------------------------------------------------------------------

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


async def keepalive_limit(request: web.Request, response: web.StreamResponse) -> None:
    """After `keepalive_max_requests` responses on one connection, the next says Connection:
    close (a client cannot pin a connection, and the work queued on it, forever)."""
    limit = request.app[STATE].config.keepalive_max_requests
    proto = request.protocol
    if limit > 0 and isinstance(proto, _Protocol):
        proto.responses += 1
        if proto.responses >= limit:
            response.force_close()
            response.headers["Connection"] = "close"  # headers are computed before this hook runs


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
        self.responses = 0                           # counted by keepalive_limit
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


def route_name(request: web.Request) -> str:
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
async def error_middleware(request: web.Request, handler):
    st = request.app[STATE]
    t0 = time.monotonic()
    route = route_name(request)
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
async def auth_middleware(request: web.Request, handler):
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


# ---- reading the body ----------------------------------------------------------------------------

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


async def read_json(request: web.Request, st: State) -> Any:
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

