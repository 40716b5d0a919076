"""Image and video sources -> family ImageInputs, off the event loop.

Videos (`video_url` parts) take the same URL kinds and the same SSRF guards, with their own
byte cap (`video_limits.max_bytes`). Each video is probed, planned, decoded and preprocessed by
`mmjax.video.prepare_video` in a small thread pool of its own (`video_workers`), so a video never
waits for, or holds up, image decoding or tokenization; PyAV releases the GIL while decoding. The
decode checks its deadline (`video_limits.decode_timeout_s`) at every frame and the awaiting
request gives up at the same deadline (a 400 `video_decode_timeout`). Prepared videos are kept in a
`VideoCache` by content hash + frame plan, so a video sent again is not decoded again.

Sources (the `url` of an `image_url` part):
- ``data:image/<type>;base64,...`` -- decoded by `mmjax.image.decode` (png, jpeg, webp, gif, bmp, ...).
- ``http://`` / ``https://`` -- fetched with aiohttp: total timeout, byte cap (Content-Length and
  streamed count), at most `max_redirects` redirects, each hop re-checked. The host is resolved
  and EVERY resolved address must be public: loopback, private (RFC 1918 / ULA), link-local
  (cloud metadata 169.254.169.254), multicast, reserved and unspecified addresses are refused
  unless `allow_private_urls` (``--allow-private-media-urls``). The connection itself goes
  through a resolver that re-applies the check, so a DNS answer that changes between the check
  and the connect (rebinding) cannot reach a private address. With `allowed_domains` set, only
  those hosts (exact names or IP literals; ``*.example.com`` for subdomains) may be fetched.
  Environment proxies are ignored.
- ``file://`` URLs -- only when `allowed_local_path` is set, and only for files whose real path
  (symlinks resolved) lies under it.

Every resolved address is checked, and so is every IPv4 address an IPv6 address embeds: IPv4-mapped
(``::ffff:a.b.c.d``), 6to4 (``2002::/16``), NAT64 (``64:ff9b::/96``; the local-use ``64:ff9b:1::/48``
in every RFC 6052 position), Teredo (``2001::/32``: server and client). The deprecated IPv4-compatible
form (``::a.b.c.d``) is refused whatever it embeds.

Decoding, validation and resizing (`mmjax.image.load_image` + the family's `prepare_image`) run in
their own pool (`DecodePool`), apart from the app's tokenization pool, so a text-only request never
waits for an image. Its workers are processes by default (`decode_processes`; niced, no GIL shared
with the server: a decode step that holds the GIL, such as Pillow's resize of a 1 x 40,000,000 image,
cannot stall the event loop, and a decoder that runs out of memory kills only its own job), threads
otherwise. The pool is shared fairly between requests:

- the images of one request form an `ImageGroup`. Their headers are read first (in a small thread
  pool: base64, file read, header parse) and the group's total decoded pixels (width x height from
  the headers) must fit `max_request_pixels` before ANY of its images is decoded
  (413 ``request_pixel_budget_exceeded``);
- a request runs at most `decode_workers_per_request` decodes at once; a free worker goes to the
  waiting request with the fewest decodes running (then the oldest), so one heavy request cannot
  take the pool from the others;
- at most `max_decode_queue` images wait for a worker (beyond: 503 ``server_busy`` /
  ``decode_queue_full``);
- a request whose decodes have used `max_request_decode_seconds` gets no more
  (413 ``request_decode_time_exceeded``); a worker process still decoding when the request's budget
  runs out is killed (a thread is not: one image's decode is then the overrun). Decode time runs
  from the moment a worker has the job: time queued for a worker and a worker's start-up (the
  pool starts its processes on first use, and again after a kill or a crash) are not charged.
"""
from __future__ import annotations

import asyncio
import dataclasses
import ipaddress
import itertools
import logging
import os
import socket
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote, urljoin, urlsplit

import aiohttp
from aiohttp.abc import AbstractResolver

from mmjax.errors import (ContextLengthError, ImageError, ImageTooLargeError, InvalidRequestError,
                          QueueFullError)
from mmjax.image.decode import ImageLimits, load_image
# header-only parsing (byte limit, format allow-list, bomb guard) without the full decode
from mmjax.image.decode import _check_dimensions, _open, _source_bytes
from mmjax.errors import VideoError, VideoTooLargeError
from mmjax.models.family import ImageOptions, VideoOptions
from mmjax.video import VideoCache, VideoLimits, prepare_video as _prepare_video

log = logging.getLogger("mmjax.serve")


class MediaForbiddenError(InvalidRequestError):
    code = "media_url_forbidden"


class MediaFetchError(InvalidRequestError):
    code = "media_fetch_failed"


@dataclass
class MediaConfig:
    limits: ImageLimits = ImageLimits()
    allowed_local_path: str | None = None
    allowed_domains: tuple[str, ...] = ()
    allow_private_urls: bool = False
    fetch_timeout: float = 10.0
    max_redirects: int = 3
    image_max_tokens: int | None = None     # per-image token budget
    low_detail_tokens: int = 256            # resolution budget of detail="low" (dynamic-res families)
    pan_and_scan: bool | None = None        # pan-and-scan for detail="auto" (Gemma 3; None: the checkpoint's)
    max_tiles: int | None = None            # tiles per image for detail "auto"/"high" (tiling families; None: all)
    decode_workers: int = 4                 # workers decoding + resizing images (not the tokenization pool)
    decode_workers_per_request: int = 2     # images of one request decoding at once; its others wait
    max_decode_queue: int = 64              # images waiting for a decode worker; beyond: 503 decode_queue_full
    max_request_pixels: int | None = None   # decoded pixels of all images of a request (None: 2 x limits.max_pixels)
    max_request_decode_seconds: float = 30.0  # decode seconds one request's images may use (0: no limit)
    decode_processes: bool = True           # decode in worker processes (False: threads of the server process)
    video_limits: VideoLimits = VideoLimits()
    video_workers: int = 2                  # threads decoding videos (apart from the image pool)
    video_cache_bytes: int = 256 * 2**20    # prepared videos kept by content + frame plan

    def __post_init__(self) -> None:
        self.allowed_domains = tuple(d.lower() for d in self.allowed_domains)
        for name in ("decode_workers", "decode_workers_per_request"):
            if getattr(self, name) < 1:
                raise ValueError(f"MediaConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.max_decode_queue < 0 or self.max_request_decode_seconds < 0:
            raise ValueError("MediaConfig.max_decode_queue and max_request_decode_seconds must be >= 0")
        if self.max_request_pixels is not None and self.max_request_pixels <= 0:
            raise ValueError(f"MediaConfig.max_request_pixels must be positive, got {self.max_request_pixels}")

    @property
    def request_pixel_budget(self) -> int:
        return self.max_request_pixels if self.max_request_pixels is not None else 4 * self.limits.max_pixels


class DecodeQueueFullError(QueueFullError):
    """More images waiting for a decode worker than `max_decode_queue` (503 server_busy)."""
    code = "decode_queue_full"


class RequestPixelBudgetError(ImageTooLargeError):
    """A request's images together decode to more pixels than `max_request_pixels` (413)."""
    code = "request_pixel_budget_exceeded"


class RequestDecodeTimeError(ImageTooLargeError):
    """A request's images used up `max_request_decode_seconds` of decode time (413)."""
    code = "request_decode_time_exceeded"


# ---- SSRF: which addresses may be fetched ---------------------------------------------------------

_V4_COMPATIBLE = ipaddress.ip_network("::/96")          # deprecated IPv4-compatible (includes :: and ::1)
_V4_MAPPED = ipaddress.ip_network("::ffff:0:0/96")
_SIX_TO_FOUR = ipaddress.ip_network("2002::/16")
_NAT64_WELL_KNOWN = ipaddress.ip_network("64:ff9b::/96")
_NAT64_LOCAL_USE = ipaddress.ip_network("64:ff9b:1::/48")
_TEREDO = ipaddress.ip_network("2001::/32")
# RFC 6052 positions of the IPv4 address (byte offsets into the IPv6 address; byte 8 is the zero
# "u" octet) for the prefix lengths a prefix inside the /48 local-use block can have.
_RFC6052_LAYOUTS = ((6, 7, 9, 10), (7, 9, 10, 11), (9, 10, 11, 12), (12, 13, 14, 15))  # /48 /56 /64 /96


def _base_forbidden(a: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    return (a.is_private or a.is_loopback or a.is_link_local or a.is_multicast or a.is_reserved
            or a.is_unspecified or not a.is_global)


def embedded_ipv4(a: ipaddress.IPv6Address) -> tuple[ipaddress.IPv4Address, ...] | None:
    """The IPv4 addresses a connection to `a` can end up at, when `a` is one of the IPv6 forms that
    embed an IPv4 address (IPv4-mapped, 6to4, NAT64, Teredo); None for any other address.
    The local-use NAT64 block's prefix length is site-specific, so every RFC 6052 position counts."""
    if a in _V4_MAPPED:
        return (a.ipv4_mapped,)
    if a in _SIX_TO_FOUR:
        return (a.sixtofour,)
    if a in _NAT64_WELL_KNOWN:
        return (ipaddress.IPv4Address(int(a) & 0xFFFFFFFF),)
    if a in _NAT64_LOCAL_USE:
        b = a.packed
        return tuple(ipaddress.IPv4Address(bytes(b[i] for i in layout)) for layout in _RFC6052_LAYOUTS)
    if a in _TEREDO:
        server, client = a.teredo
        return (server, client)
    return None


def ip_forbidden(ip: str) -> bool:
    """True unless `ip` (and every IPv4 address it embeds) is a public unicast address.

    An IPv6 address embedding IPv4 is judged by the IPv4 it reaches (6to4 ``2002:7f00:1::`` is
    127.0.0.1); the deprecated IPv4-compatible ``::a.b.c.d`` (and ``::``, ``::1``) is always refused.
    Anything that does not parse as an IP address is refused."""
    try:
        a = ipaddress.ip_address(ip.split("%", 1)[0])
    except ValueError:
        return True
    if isinstance(a, ipaddress.IPv6Address):
        if a in _V4_COMPATIBLE:
            return True
        embedded = embedded_ipv4(a)
        if embedded is not None:
            return any(_base_forbidden(v4) for v4 in embedded)
    return _base_forbidden(a)


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host.split("%", 1)[0])
        return True
    except ValueError:
        return False


class ForbiddenAddress(OSError):
    """Raised by GuardedResolver (an OSError so aiohttp's connector passes it through)."""


class GuardedResolver(AbstractResolver):
    """aiohttp resolver that refuses hosts resolving to any non-public address."""

    def __init__(self, allow_private: bool):
        self.allow_private = allow_private
        self._inner = aiohttp.ThreadedResolver()

    async def resolve(self, host: str, port: int = 0, family: int = socket.AF_INET):
        infos = await self._inner.resolve(host, port, family)
        if not self.allow_private:
            for info in infos:
                if ip_forbidden(info["host"]):
                    raise ForbiddenAddress(f"image URL host {host!r} resolves to a non-public address "
                                           f"{info['host']} (--allow-private-media-urls allows it)")
        return infos

    async def close(self) -> None:
        await self._inner.close()


# ---- the decode pool ----------------------------------------------------------------------------

class ImageGroup:
    """The images of one request. Each image reports its header size (or its failure); the group's
    pixel budget is judged on the sum before any image of it is decoded (`wait_headers`). It also
    carries the request's share of the `DecodePool` (running jobs, queued jobs, decode time used)."""

    _seq = itertools.count()

    def __init__(self, pixel_budget: int):
        self.seq = next(ImageGroup._seq)
        self.pixel_budget = pixel_budget
        self.params: list[str] = []
        self.pixels: list[int | None] = []       # per image: width*height from its header, None until known
        self.reported = 0
        self.sealed = False
        self.over: RequestPixelBudgetError | None = None
        self._ready: asyncio.Event | None = None
        # DecodePool accounting (event-loop thread only)
        self.running = 0
        self.pending: deque[_Job] = deque()
        self.inflight: set[_Job] = set()
        self.busy_s = 0.0

    def add(self, param: str) -> int:
        if self.sealed:
            raise RuntimeError("ImageGroup is sealed: all images of a request must be added at once")
        self.params.append(param)
        self.pixels.append(None)
        return len(self.params) - 1

    def seal(self) -> None:
        self.sealed = True
        self._update()

    def report(self, idx: int, size: tuple[int, int] | None) -> None:
        """Image `idx` has its header read (`size`) or failed before that (None)."""
        self.reported += 1
        if size is not None:
            self.pixels[idx] = size[0] * size[1]
        self._update()

    def _update(self) -> None:
        if self.over is None:
            total = 0
            for i, px in enumerate(self.pixels):
                total += px or 0
                if total > self.pixel_budget:
                    known = [p for p in self.pixels if p is not None]
                    amount = (f"{sum(known):,} pixels in total" if len(known) == len(self.pixels) else
                              f"at least {sum(known):,} pixels ({len(known)} of {len(self.pixels)} images read)")
                    self.over = RequestPixelBudgetError(
                        f"the request's images decode to {amount}, over the per-request budget of "
                        f"{self.pixel_budget:,} pixels (--max-request-image-pixels)", param=self.params[i])
                    break
        if self._ready is not None and (self.over is not None or (self.sealed and self.reported >= len(self.params))):
            self._ready.set()

    async def wait_headers(self) -> None:
        """Until every image of the group has its header read (or failed); raises
        RequestPixelBudgetError (naming the image that crosses the budget) when over budget."""
        if self._ready is None:
            self._ready = asyncio.Event()
            self._update()
        await self._ready.wait()
        if self.over is not None:
            raise RequestPixelBudgetError(self.over.message, param=self.over.param)

    def spent(self, now: float) -> float:
        """Decode seconds used so far (finished jobs + the running ones' time since their worker
        took them: a worker's start-up and time queued are not the request's decode time)."""
        return self.busy_s + sum(now - j.t_run for j in list(self.inflight) if j.t_run is not None)


def prepare_image(family, limits: ImageLimits, source: Any, options: ImageOptions, token_budget: int | None):
    """Full decode (`mmjax.image.load_image`) + the family's preprocessing + the per-image token
    budget: the job a decode worker runs."""
    img = load_image(source, limits)
    im = family.prepare_image(img, options)
    if token_budget is not None and im.num_tokens > token_budget:
        raise ContextLengthError(f"image needs {im.num_tokens} tokens, over the per-image budget of {token_budget} "
                                 "(--image-max-tokens)", code="image_token_budget_exceeded")
    return im


class DecoderCrashedError(ImageError):
    """The worker process decoding the image died (out of memory, a crash in a decoder) (400)."""
    code = "image_decoder_crashed"


class _ThreadBackend:
    """Decode jobs in threads of the server process (families that cannot be sent to a worker
    process, or `decode_processes=False`). GIL-holding steps of a decode (e.g. Pillow's resize
    coefficients for an extreme aspect ratio) then stall the whole process while they run, and
    the time budget is checked between jobs only."""

    kind = "threads"

    def __init__(self, family, limits: ImageLimits):
        self.family, self.limits = family, limits

    def call(self, slot: int, args: tuple, timeout: float | None, started=None):
        if started is not None:
            started()
        return prepare_image(self.family, self.limits, *args)

    def start_workers(self) -> None:
        pass

    def close(self) -> None:
        pass


def _decode_worker(conn, family_blob: bytes, limits: ImageLimits, nice: int) -> None:
    """A decode worker process: (source, options, token budget) in, (ok, ImageInput | error) out."""
    import pickle
    import signal
    import sys
    signal.signal(signal.SIGINT, signal.SIG_IGN)     # Ctrl-C is the server's; it closes its workers
    if nice:
        try:
            os.nice(nice)                             # serving threads before decoding
        except OSError:
            pass
    if "jax" in sys.modules:                          # never let preprocessing claim an accelerator
        try:
            sys.modules["jax"].config.update("jax_platforms", "cpu")
        except Exception:
            pass
    family = pickle.loads(family_blob)
    conn.send("ready")
    while True:
        try:
            args = conn.recv()
        except (EOFError, OSError):
            return
        try:
            out = (True, prepare_image(family, limits, *args))
        except Exception as e:
            out = (False, e)
        try:
            conn.send(out)
        except Exception as e:                        # an unpicklable exception or result
            conn.send((False, RuntimeError(f"decode worker could not return its result: "
                                           f"{type(out[1]).__name__}: {e}")))


class _ProcessBackend:
    """Decode jobs in worker processes, one per pool slot, started on first use and restarted after
    a crash or a kill: no GIL shared with the server, a job over its time budget is killed, and a
    decoder that runs out of memory or crashes takes down only its own job."""

    kind = "processes"

    def __init__(self, family, limits: ImageLimits, slots: int, nice: int = 10):
        import multiprocessing
        import pickle
        import threading
        self._blob = pickle.dumps(family)             # fails early for an unpicklable family
        self._limits, self._nice = limits, nice
        self._ctx = multiprocessing.get_context("spawn")
        self._procs: list[Any] = [None] * slots
        self._conns: list[Any] = [None] * slots
        self._locks = [threading.Lock() for _ in range(slots)]
        self._ready = [False] * slots
        self._closed = False

    START_TIMEOUT = 120.0

    def _alive(self, slot: int) -> bool:
        proc = self._procs[slot]
        return proc is not None and proc.is_alive()

    def _spawn(self, slot: int) -> None:
        self._discard(slot)
        if self._closed:
            raise QueueFullError("the image decode pool is shut down", code="decode_queue_full")
        parent, child = self._ctx.Pipe()
        proc = self._ctx.Process(target=_decode_worker, args=(child, self._blob, self._limits, self._nice),
                                 name=f"mmjax-decode-{slot}", daemon=True)
        proc.start()
        child.close()
        self._procs[slot], self._conns[slot] = proc, parent
        self._ready[slot] = False

    def _wait_ready(self, slot: int) -> None:
        if self._ready[slot]:
            return
        conn = self._conns[slot]
        try:
            if conn.poll(self.START_TIMEOUT) and conn.recv() == "ready":
                self._ready[slot] = True
                return
        except (EOFError, OSError):
            pass
        code = self._discard(slot)
        raise RuntimeError(f"image decode worker {slot} failed to start (exit code {code})")

    def _ensure(self, slot: int):
        if not self._alive(slot):
            self._spawn(slot)
        self._wait_ready(slot)
        return self._conns[slot]

    def start_workers(self) -> None:
        """Start every worker process now (they start on first use otherwise) and wait until ready."""
        held = [slot for slot in range(len(self._procs)) if self._locks[slot].acquire(blocking=False)]
        try:
            for slot in held:
                if not self._alive(slot):
                    self._spawn(slot)
            for slot in held:
                self._wait_ready(slot)
        finally:
            for slot in held:
                self._locks[slot].release()

    def pids(self) -> list[int | None]:
        return [p.pid if p is not None and p.is_alive() else None for p in self._procs]

    def _discard(self, slot: int) -> int | None:
        proc, conn = self._procs[slot], self._conns[slot]
        self._procs[slot] = self._conns[slot] = None
        code = None
        if proc is not None:
            if proc.is_alive():
                proc.kill()
            proc.join(5)
            code = proc.exitcode
        if conn is not None:
            conn.close()
        return code

    def call(self, slot: int, args: tuple, timeout: float | None, started=None):
        """Run one job in the slot's worker (started, and waited for, first if needed);
        `started()` is called when the worker has the job: its start-up is not decode time."""
        with self._locks[slot]:
            conn = self._ensure(slot)
            try:
                conn.send(args)
            except OSError:                 # died while idle: a fresh worker takes the job
                self._spawn(slot)
                conn = self._ensure(slot)
                conn.send(args)
            if started is not None:
                started()
            try:
                if not conn.poll(timeout):
                    self._replace(slot)
                    raise RequestDecodeTimeError(
                        f"decoding the image was stopped after {timeout:.1f}s: the request's images are over "
                        "their decode-time budget (--max-request-decode-seconds)")
                ok, value = conn.recv()
            except (EOFError, OSError):
                code = self._replace(slot)
                if self._closed:
                    raise QueueFullError("the image decode pool is shut down", code="decode_queue_full") from None
                how = f"killed by signal {-code}" if code is not None and code < 0 else f"exit code {code}"
                raise DecoderCrashedError(f"the process decoding this image died ({how}; out of memory?)") from None
        if ok:
            return value
        raise value

    def _replace(self, slot: int) -> int | None:
        """Kill the slot's worker and start its successor now, so that the next job (another
        request's, likely) does not pay the whole start-up. Returns the old worker's exit code."""
        code = self._discard(slot)
        if not self._closed:
            try:
                self._spawn(slot)
            except Exception as e:  # the next job retries (and reports) the start
                log.warning("cannot restart image decode worker %d: %s", slot, e)
        return code

    def close(self) -> None:
        self._closed = True
        for slot in range(len(self._procs)):
            proc = self._procs[slot]
            if proc is not None and proc.is_alive():
                proc.kill()           # a slot thread blocked on it gets EOF and gives up
        for slot in range(len(self._procs)):
            if self._locks[slot].acquire(timeout=5):
                try:
                    self._discard(slot)
                finally:
                    self._locks[slot].release()


class _Job:
    __slots__ = ("group", "args", "fut", "t0", "t_run", "seconds")

    def __init__(self, group: ImageGroup, args: tuple, fut: asyncio.Future):
        self.group, self.args, self.fut = group, args, fut
        self.t0 = 0.0                           # handed to a slot
        self.t_run: float | None = None         # its worker has it (after any worker start-up)
        self.seconds: float | None = None       # decode seconds: from t_run to the result


class DecodePool:
    """Bounded, fair decode capacity shared by all requests (`ImageGroup`s).

    `workers` slots, each a worker process (or a thread, see `_ThreadBackend`) driven by one
    thread of a private executor. Jobs are handed to a slot only when one is free, so nothing
    queues inside the executor; the waiting jobs are here, and a free slot goes to the request
    with the fewest running jobs, then the oldest request. A request never runs more than
    `per_request` jobs at once. When more than `max_waiting` jobs wait, new ones are refused
    (`DecodeQueueFullError`). A job whose request has used `time_budget` seconds is failed
    instead of run, and (worker processes) one that runs past the rest of its budget is killed.
    Scheduling state lives on the event loop.
    """

    def __init__(self, backend, workers: int, per_request: int, max_waiting: int, time_budget: float):
        self.backend = backend
        self.workers, self.per_request, self.max_waiting, self.time_budget = \
            workers, per_request, max_waiting, time_budget
        self.running = 0
        self.waiting = 0
        self.started = 0                              # jobs handed to a worker, ever
        self.refused = 0                              # jobs refused: queue full or over the time budget
        self._groups: dict[ImageGroup, None] = {}    # groups with waiting jobs (insertion-ordered set)
        self._idle = list(range(workers - 1, -1, -1))  # slot ids; pop() reuses the lowest (warm) slots
        self._executor: ThreadPoolExecutor | None = None
        self._closed = False

    def stats(self) -> dict:
        return {"backend": self.backend.kind, "workers": self.workers, "running": self.running,
                "waiting": self.waiting, "requests_waiting": len(self._groups), "started": self.started,
                "refused": self.refused}

    def start_workers(self) -> None:
        """Blocking: start every worker process now instead of on first use."""
        self.backend.start_workers()

    async def run(self, group: ImageGroup, *args):
        """`prepare_image(family, limits, *args)` in a slot, when the scheduler gives `group` one."""
        if self._closed:
            raise QueueFullError("the image decode pool is shut down", code="decode_queue_full")
        loop = asyncio.get_running_loop()
        job = _Job(group, args, loop.create_future())
        group.pending.append(job)
        self._groups[group] = None
        self.waiting += 1
        self._dispatch(loop)
        if self.waiting > self.max_waiting and job in group.pending:
            self._unqueue(job)
            self.refused += 1
            raise DecodeQueueFullError(
                f"the image decode queue is full ({self.waiting} images already wait for a decode worker, "
                f"--max-decode-queue {self.max_waiting}); retry later")
        try:
            return await job.fut
        except asyncio.CancelledError:
            self._unqueue(job)
            raise

    def _unqueue(self, job: _Job) -> None:
        g = job.group
        try:
            g.pending.remove(job)
        except ValueError:
            return      # already started: it runs to its end (or its deadline) and then frees its slot
        self.waiting -= 1
        if not g.pending:
            self._groups.pop(g, None)

    def _pick(self) -> _Job | None:
        best, best_key = None, None
        for g in self._groups:
            if g.running >= self.per_request or not g.pending:
                continue
            key = (g.running, g.seq)
            if best_key is None or key < best_key:
                best, best_key = g, key
        if best is None:
            return None
        job = best.pending.popleft()
        self.waiting -= 1
        if not best.pending:
            del self._groups[best]
        return job

    def _dispatch(self, loop: asyncio.AbstractEventLoop) -> None:
        while self._idle:
            job = self._pick()
            if job is None:
                return
            if job.fut.done():
                continue
            g = job.group
            now = time.monotonic()
            timeout = None
            if self.time_budget:
                spent = g.spent(now)
                if spent >= self.time_budget:
                    self.refused += 1
                    job.fut.set_exception(RequestDecodeTimeError(
                        f"the request's images used {spent:.1f}s of decode time, over the per-request "
                        f"budget of {self.time_budget:g}s (--max-request-decode-seconds)"))
                    continue
                timeout = self.time_budget - spent
            if self._executor is None:
                self._executor = ThreadPoolExecutor(max_workers=self.workers, thread_name_prefix="mmjax-decode")
            slot = self._idle.pop()
            job.t0 = now
            g.running += 1
            g.inflight.add(job)
            self.running += 1
            self.started += 1
            cf = self._executor.submit(self._call, slot, job, timeout)
            cf.add_done_callback(lambda cf, job=job, slot=slot: self._from_thread(loop, job, slot, cf))

    def _call(self, slot: int, job: _Job, timeout: float | None):   # in a slot thread
        def started():
            job.t_run = time.monotonic()
        try:
            return self.backend.call(slot, job.args, timeout, started)
        finally:
            job.seconds = time.monotonic() - job.t_run if job.t_run is not None else 0.0

    def _from_thread(self, loop, job: _Job, slot: int, cf) -> None:
        try:
            loop.call_soon_threadsafe(self._finished, loop, job, slot, cf)
        except RuntimeError:  # the loop is closed (shutdown)
            pass

    def _finished(self, loop, job: _Job, slot: int, cf) -> None:
        g = job.group
        self.running -= 1
        g.running -= 1
        g.inflight.discard(job)
        g.busy_s += job.seconds if job.seconds is not None else \
            (time.monotonic() - job.t_run if job.t_run is not None else 0.0)
        self._idle.append(slot)
        if not job.fut.done():
            if cf.cancelled():
                job.fut.cancel()
            elif cf.exception() is not None:
                job.fut.set_exception(cf.exception())
            else:
                job.fut.set_result(cf.result())
        if not self._closed:
            self._dispatch(loop)

    def close(self) -> None:
        """Refuse new jobs, cancel the waiting ones (on the event loop's thread), stop the workers
        (blocking: call `close_backend` from a thread, or after the loop)."""
        self._closed = True
        for g in list(self._groups):
            for job in g.pending:
                if not job.fut.done():
                    job.fut.cancel()
            g.pending.clear()
        self._groups.clear()
        self.waiting = 0

    def close_backend(self) -> None:
        self.backend.close()
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
            self._executor = None


# ---- the fetcher ------------------------------------------------------------------------------------

class MediaFetcher:
    """Image references -> ImageInputs; decoding runs in the fetcher's own `DecodePool` (`pool`)."""

    def __init__(self, cfg: MediaConfig, family):
        self.cfg = cfg
        self.family = family
        self._session: aiohttp.ClientSession | None = None
        self._open_groups: dict[Any, ImageGroup] = {}
        self._headers: ThreadPoolExecutor | None = None
        self._pool: DecodePool | None = None
        self._videos: ThreadPoolExecutor | None = None
        self.video_cache = VideoCache(cfg.video_cache_bytes)
        self.on_video = None    # callback(seconds) after each video is prepared (metrics)

    @property
    def pool(self) -> DecodePool:
        """The decode pool, built on first use (worker processes start when first needed)."""
        if self._pool is None:
            cfg = self.cfg
            backend = None
            if cfg.decode_processes:
                try:
                    backend = _ProcessBackend(self.family, cfg.limits, cfg.decode_workers)
                except Exception as e:   # e.g. a family that cannot be pickled
                    log.warning("image decoding falls back to threads: cannot use worker processes (%s: %s)",
                                type(e).__name__, e)
            if backend is None:
                backend = _ThreadBackend(self.family, cfg.limits)
            self._pool = DecodePool(backend, cfg.decode_workers, cfg.decode_workers_per_request,
                                    cfg.max_decode_queue, cfg.max_request_decode_seconds)
        return self._pool

    # ---- lifecycle ----------------------------------------------------------------------------
    async def session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            conn = aiohttp.TCPConnector(resolver=GuardedResolver(self.cfg.allow_private_urls), limit=32,
                                        use_dns_cache=False)
            self._session = aiohttp.ClientSession(
                connector=conn, trust_env=False, auto_decompress=True,
                timeout=aiohttp.ClientTimeout(total=self.cfg.fetch_timeout),
                headers={"User-Agent": "mmjax-serve/0.1"})
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
        if self._pool is not None:
            pool, self._pool = self._pool, None
            pool.close()
            await asyncio.get_running_loop().run_in_executor(None, pool.close_backend)
        if self._headers is not None:
            self._headers.shutdown(wait=False, cancel_futures=True)
            self._headers = None
        if self._videos is not None:
            self._videos.shutdown(wait=False, cancel_futures=True)
            self._videos = None

    def start_workers(self) -> None:
        """Blocking: start the decode worker processes now (call it from a thread, not the loop)."""
        self.pool.start_workers()

    # ---- requests -------------------------------------------------------------------------------
    def new_group(self) -> ImageGroup:
        return ImageGroup(self.cfg.request_pixel_budget)

    def _caller_group(self) -> ImageGroup:
        """The group of the request calling `load`: every `load` called from one task within one
        step of the event loop (the way `serve.inputs.load_images` starts all images of a request)
        joins one group; it is sealed at the next step."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            g = self.new_group()
            g.sealed = True
            return g
        task = asyncio.current_task(loop)
        g = self._open_groups.get(task)
        if g is None:
            g = self._open_groups[task] = self.new_group()
            loop.call_soon(self._seal, task, g)
        return g

    def _seal(self, task, g: ImageGroup) -> None:
        if self._open_groups.get(task) is g:
            del self._open_groups[task]
        g.seal()

    async def load_all(self, refs) -> list:
        """All images of one request (one group); the first failure cancels the rest."""
        g = self.new_group()
        n_images = sum(getattr(r, "kind", "image") == "image" for r in refs)
        tasks = [asyncio.ensure_future(self.load(r, g, n_images=n_images)) for r in refs]
        g.seal()
        try:
            return list(await asyncio.gather(*tasks))
        finally:
            for t in tasks:
                t.cancel()

    # ---- sources --------------------------------------------------------------------------------
    def load(self, ref, group: ImageGroup | None = None, n_images: int = 1):
        """ImageRef -> awaitable ImageInput (raises typed errors naming ref.param). n_images: the
        images of its request (a family may prepare the images of a multi-image prompt apart).

        The image joins `group`, or else the group of the calling request (see `_caller_group`);
        await (or cancel) every awaitable of a group: its images wait for each other's headers.
        A video reference (kind "video") is loaded on its own (`load_video`)."""
        if getattr(ref, "kind", "image") == "video":
            return self.load_video(ref)
        if group is None:
            group = self._caller_group()
        return self._load(ref, group, group.add(ref.param), n_images)

    async def _load(self, ref, group: ImageGroup, idx: int, n_images: int = 1) -> Any:
        url = ref.url
        try:
            try:
                scheme = url.split(":", 1)[0].lower() if ":" in url else ""
                if scheme == "data":
                    source: Any = url      # mmjax.image decodes it (byte cap before the base64 decode)
                elif scheme in ("http", "https"):
                    source = await self.fetch(url)
                elif scheme == "file":
                    source = self.local_path(url)
                else:
                    raise ImageError("image URL must be a data: URI, an http(s) URL or (when the server allows "
                                     f"local media) a file:// URL; got scheme {scheme or 'none'!r}")
                if self._headers is None:
                    self._headers = ThreadPoolExecutor(max_workers=2, thread_name_prefix="mmjax-image-header")
                data, size = await asyncio.get_running_loop().run_in_executor(self._headers, self._read_header,
                                                                              source)
            except BaseException:
                group.report(idx, None)
                raise
            group.report(idx, size)
            await group.wait_headers()
            opts = self._options(ref.detail, getattr(ref, "options", None), n_images)
            return await self.pool.run(group, data, opts, self.cfg.image_max_tokens)
        except InvalidRequestError as e:
            if e.param == "image_max_tokens" and isinstance(e, ContextLengthError):
                e.code = "image_token_budget_exceeded"
            if e.param in (None, "image_url", "images", "image_max_tokens"):
                e.param = ref.param
            raise

    async def load_video(self, ref) -> Any:
        """A `video_url` reference -> ImageInput(kind="video"); errors name ref.param."""
        url = ref.url
        limits = self.cfg.video_limits
        try:
            scheme = url.split(":", 1)[0].lower() if ":" in url else ""
            if scheme == "data":
                source: Any = url      # mmjax.video decodes it (byte cap before the base64 decode)
            elif scheme in ("http", "https"):
                source = await self.fetch(url, cap=limits.max_bytes, what="video")
            elif scheme == "file":
                source = self.local_path(url, what="video")
            else:
                raise VideoError("video URL must be a data: URI, an http(s) URL or (when the server allows "
                                 f"local media) a file:// URL; got scheme {scheme or 'none'!r}")
            if self._videos is None:
                self._videos = ThreadPoolExecutor(max_workers=self.cfg.video_workers,
                                                  thread_name_prefix="mmjax-video")
            t0 = time.monotonic()
            deadline = t0 + limits.decode_timeout_s
            fut = asyncio.get_running_loop().run_in_executor(
                self._videos, lambda: _prepare_video(self.family, source, limits, VideoOptions(), deadline,
                                                     self.video_cache))
            try:
                item = await asyncio.wait_for(fut, timeout=limits.decode_timeout_s + 1.0)
            except asyncio.TimeoutError:
                raise VideoError(f"decoding the video took longer than {limits.decode_timeout_s:g} s",
                                 code="video_decode_timeout") from None
            if self.on_video is not None:
                self.on_video(time.monotonic() - t0)
            return item
        except InvalidRequestError as e:
            if e.param == "video_max_tokens" and isinstance(e, ContextLengthError):
                e.code = "video_token_budget_exceeded"
            if e.param in (None, "video_url", "videos", "video_max_tokens", "image_url"):
                e.param = ref.param
            raise

    def _read_header(self, source: Any) -> tuple[bytes, tuple[int, int]]:
        """(encoded bytes, (width, height)) with the byte and per-image pixel limits checked from the
        header only (runs in a header thread: base64 decode, file read, header parse)."""
        data = _source_bytes(source, self.cfg.limits)
        img = _open(data, self.cfg.limits)
        try:
            size = img.size
        finally:
            img.close()
        _check_dimensions(size, self.cfg.limits)
        return data, size

    def _prepare(self, source: Any, detail: str):
        """One image, decoded and prepared in the calling thread (no pool)."""
        return prepare_image(self.family, self.cfg.limits, source, self._options(detail), self.cfg.image_max_tokens)

    def _options(self, detail: str, request: ImageOptions | None = None, n_images: int = 1) -> ImageOptions:
        """detail -> the family's options for the token budget (dynamic-resolution families
        resize to fit it; fixed-size families have one size, so detail is a no-op there).
        Pan-and-scan (families that crop, Gemma 3): "high" turns it on, "low" off, "auto" takes
        the server's --pan-and-scan; a budget too small for the crops turns it off. Tiling
        (Idefics3 / SmolVLM, LLaVA-NeXT / OneVision): "low" is the global image / overview alone
        (max_tiles 0), "auto"/"high" the checkpoint's tiling capped by --max-image-tiles. Last,
        the family's per-prompt rule (`prompt_options`: OneVision's multi-image prompts)."""
        tokens = self.cfg.image_max_tokens
        if detail == "low":
            tokens = min(tokens or self.cfg.low_detail_tokens, self.cfg.low_detail_tokens)
        opts = self.family.fit_options(tokens) if tokens else ImageOptions()
        pas = {"high": True, "low": False}.get(detail, self.cfg.pan_and_scan)
        if pas is not None and opts.pan_and_scan is None:
            opts = dataclasses.replace(opts, pan_and_scan=pas)
        if request is not None:    # mm_processor_kwargs: its bounds, under the server's token budget
            cap = opts.max_tokens
            mine = request.max_tokens
            opts = dataclasses.replace(
                opts, min_pixels=request.min_pixels or opts.min_pixels,
                max_pixels=min(x for x in (request.max_pixels, opts.max_pixels) if x) if (
                    request.max_pixels or opts.max_pixels) else None,
                max_tokens=min(x for x in (cap, mine) if x) if (cap or mine) else None,
                pan_and_scan=request.pan_and_scan if request.pan_and_scan is not None else opts.pan_and_scan,
                max_tiles=request.max_tiles if request.max_tiles is not None else opts.max_tiles)
        caps = [c for c in (opts.max_tiles, 0 if detail == "low" else self.cfg.max_tiles) if c is not None]
        opts = dataclasses.replace(opts, max_tiles=min(caps)) if caps else opts
        return self.family.prompt_options(opts, n_images)

    def local_path(self, url: str, what: str = "image") -> str:
        root = self.cfg.allowed_local_path
        if not root:
            raise MediaForbiddenError(f"file:// {what} URLs are disabled (start the server with "
                                      "--allowed-local-media-path DIR)", code="local_media_forbidden")
        parts = urlsplit(url)
        if parts.netloc not in ("", "localhost"):
            raise MediaForbiddenError("file:// URLs must not name a host", code="local_media_forbidden")
        path = os.path.realpath(unquote(parts.path))
        root_real = os.path.realpath(root)
        if os.path.commonpath([path, root_real]) != root_real:
            raise MediaForbiddenError(f"file:// {what} is outside --allowed-local-media-path",
                                      code="local_media_forbidden")
        return path

    def _check_host(self, host: str | None, what: str = "image") -> None:
        if not host:
            raise MediaFetchError(f"{what} URL has no host")
        host = host.lower().rstrip(".")
        doms = self.cfg.allowed_domains
        if doms and not any(host == d or (d.startswith("*.") and host.endswith(d[1:])) for d in doms):
            raise MediaForbiddenError(f"{what} URL host {host!r} is not in --allowed-media-domains")

    async def _check_ips(self, host: str, port: int, what: str = "image") -> None:
        if self.cfg.allow_private_urls:
            return
        if _is_ip(host):
            ips = [host]
        else:
            try:
                infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
            except OSError as e:
                raise MediaFetchError(f"cannot resolve {what} URL host {host!r}: {e}") from None
            ips = [i[4][0] for i in infos]
        if not ips or any(ip_forbidden(ip) for ip in ips):
            raise MediaForbiddenError(f"{what} URL host {host!r} is a private, loopback or link-local address "
                                      "(start the server with --allow-private-media-urls to allow it)")

    async def fetch(self, url: str, cap: int | None = None, what: str = "image") -> bytes:
        cap = self.cfg.limits.max_bytes if cap is None else cap
        too_large = VideoTooLargeError if what == "video" else ImageTooLargeError
        session = await self.session()
        try:
            for _hop in range(self.cfg.max_redirects + 1):
                parts = urlsplit(url)
                if parts.scheme.lower() not in ("http", "https"):
                    raise MediaFetchError(f"{what} URL redirected to a non-http(s) URL ({parts.scheme!r})")
                host = parts.hostname
                self._check_host(host, what)
                await self._check_ips(host, parts.port or (443 if parts.scheme.lower() == "https" else 80), what)
                async with session.get(url, allow_redirects=False) as resp:
                    if resp.status in (301, 302, 303, 307, 308):
                        loc = resp.headers.get("Location")
                        if not loc:
                            raise MediaFetchError(f"{what} URL answered {resp.status} without a Location")
                        url = urljoin(url, loc)
                        continue
                    if resp.status != 200:
                        raise MediaFetchError(f"fetching the {what} URL failed: HTTP {resp.status}")
                    if resp.content_length is not None and resp.content_length > cap:
                        raise too_large(f"{what} is {resp.content_length} bytes, over the limit of "
                                                 f"{cap} bytes")
                    buf = bytearray()
                    async for chunk in resp.content.iter_chunked(65536):
                        buf += chunk
                        if len(buf) > cap:
                            raise too_large(f"{what} is over the limit of {cap} bytes")
                    return bytes(buf)
            raise MediaFetchError(f"{what} URL redirected more than {self.cfg.max_redirects} times")
        except asyncio.TimeoutError:
            raise MediaFetchError(f"fetching the {what} URL timed out after {self.cfg.fetch_timeout}s") from None
        except aiohttp.ClientConnectorError as e:
            inner = getattr(e, "os_error", None) or e.__cause__
            if isinstance(inner, ForbiddenAddress):
                raise MediaForbiddenError(str(inner)) from None
            raise MediaFetchError(f"cannot connect to the {what} URL host: {e}") from None
        except aiohttp.ClientError as e:
            raise MediaFetchError(f"fetching the {what} URL failed: {type(e).__name__}: {e}") from None
        except ForbiddenAddress as e:
            raise MediaForbiddenError(str(e)) from None
        except (ValueError, UnicodeError) as e:
            raise MediaFetchError(f"invalid {what} URL: {e}") from None


__all__ = ["MediaConfig", "MediaFetcher", "MediaForbiddenError", "MediaFetchError", "ip_forbidden",
           "embedded_ipv4", "GuardedResolver", "DecodePool", "ImageGroup", "DecodeQueueFullError",
           "RequestPixelBudgetError", "RequestDecodeTimeError"]
