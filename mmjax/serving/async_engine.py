"""The engine loop in a background thread, driven from asyncio: the server's face.

Public API (all the server uses): `submit` / `stream` / `abort` a request, `alive`, `stopped`,
`queue_depth`, `stats`, `fail_all` (end every open stream with an error), `drain` (wait for the
work in flight) and `shutdown`. Validation and image preprocessing run in the caller's executor;
only the loop thread touches engine state. A failure inside one step fails the requests it
concerns (see serving/engine.py), never the loop.
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from typing import Any, AsyncIterator

from mmjax.errors import InvalidRequestError, MMJaxError, QueueFullError
from mmjax.serving.engine import Engine
from mmjax.serving.request import Delta, Request

log = logging.getLogger("mmjax.engine")


class AsyncEngine:
    def __init__(self, engine: Engine, *, max_waiting: int = 256):
        """`engine`: an Engine or anything with its interface (serving/data_parallel.py)."""
        self.engine = engine
        self.max_waiting = max_waiting
        self._inbox: deque = deque()          # ("add", req, queue, loop) | ("abort", rid)
        self._streams: dict[str, tuple[Any, Any]] = {}  # rid -> (asyncio.Queue, loop)
        self._lock = threading.Lock()         # _streams is read by fail_all from other threads
        self._wake = threading.Event()
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="mmjax-engine", daemon=True)
        self.step_log: deque = deque(maxlen=1)  # last step summary (for the server's log line)
        self._thread.start()

    # ---- state -----------------------------------------------------------------------------------
    def alive(self) -> bool:
        """Is the loop thread running?"""
        return self._thread.is_alive()

    @property
    def stopped(self) -> bool:
        """Was the loop asked to stop (shutdown), as opposed to dying?"""
        return self._stop

    def queue_depth(self) -> int:
        """Requests accepted but not yet in a decode slot."""
        return len(self.engine.waiting) + sum(1 for item in list(self._inbox) if item[0] == "add")

    def stats(self) -> dict:
        return self.engine.stats()

    # ---- called from asyncio ---------------------------------------------------------------
    def submit(self, req: Request) -> asyncio.Queue:
        """Queue a validated request; returns an asyncio.Queue of Deltas for it."""
        if self.queue_depth() >= self.max_waiting:
            raise QueueFullError(f"server is at capacity ({self.max_waiting} queued requests); retry later")
        q: asyncio.Queue = asyncio.Queue()
        self._inbox.append(("add", req, q, asyncio.get_running_loop()))
        self._wake.set()
        return q

    async def stream(self, req: Request) -> AsyncIterator[Delta]:
        """Async iterator of Deltas for one request; aborts it if the consumer goes away."""
        q = self.submit(req)
        finished = False
        try:
            while not finished:
                d = await q.get()
                finished = d.finished  # before yielding: a consumer may stop at the final delta
                yield d
        finally:
            if not finished:
                self.abort(req.id)

    def abort(self, request_id: str) -> None:
        self._inbox.append(("abort", request_id))
        self._wake.set()

    def fail_all(self, err: MMJaxError) -> int:
        """End every open stream (and every request still in the inbox) with `err`; returns how
        many. For when the loop cannot go on (it died): clients get an error, not a hang."""
        with self._lock:
            targets = list(self._streams.items())
            self._streams.clear()
        targets += [(item[1].id, (item[2], item[3])) for item in list(self._inbox) if item[0] == "add"]
        for rid, (q, loop) in targets:
            loop.call_soon_threadsafe(q.put_nowait, Delta(rid, [], "", None, True, "error", error=err))
        return len(targets)

    async def drain(self, timeout: float) -> bool:
        """Wait up to `timeout` s for the engine to run out of work; True if it did."""
        deadline = time.monotonic() + timeout
        while (self.engine.has_work() or self._inbox) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        return not (self.engine.has_work() or self._inbox)

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop the loop after finishing running work (bounded by `timeout`)."""
        deadline = time.monotonic() + timeout
        while self.engine.has_work() and time.monotonic() < deadline and self.alive():
            time.sleep(0.01)
        self._stop = True
        self._wake.set()
        self._thread.join(timeout=5)

    # ---- loop thread -------------------------------------------------------------------------
    def _emit(self, rid: str, delta: Delta) -> None:
        with self._lock:
            target = self._streams.get(rid)
            if target is not None and delta.finished:
                self._streams.pop(rid, None)
        if target is None:
            return
        q, loop = target
        loop.call_soon_threadsafe(q.put_nowait, delta)
        if delta.finished:
            self.engine.release(rid)

    def _drain_inbox(self) -> None:
        while self._inbox:
            item = self._inbox.popleft()
            if item[0] == "add":
                _, req, q, loop = item
                if req.id in self._streams or req.id in self.engine.requests:
                    # Never touch the stream of the request that owns this id.
                    err = InvalidRequestError(f"duplicate request id {req.id!r}", param="request_id")
                    loop.call_soon_threadsafe(q.put_nowait, Delta(req.id, [], "", None, True, "error", error=err))
                    continue
                with self._lock:
                    self._streams[req.id] = (q, loop)
                try:
                    self.engine.submit(req)
                except MMJaxError as e:
                    self._emit(req.id, Delta(req.id, [], "", None, True, "error", error=e))
            else:
                rid = item[1]
                if self.engine.abort(rid):
                    self._emit(rid, Delta(rid, [], "", None, True, "abort"))
                self.engine.release(rid)

    def _run(self) -> None:
        while not self._stop:
            self._drain_inbox()
            if not self.engine.has_work():
                self._wake.wait(0.05)
                self._wake.clear()
                continue
            t0 = time.monotonic()
            try:
                deltas = self.engine.step()
            except Exception as e:  # a bug outside the engine's own isolation: fail what is in flight
                log.exception("engine step failed")
                deltas = self._fail_active(e)
            for d in deltas:
                self._emit(d.request_id, d)
            self.step_log.append((time.monotonic() - t0, len(deltas)))

    def _fail_active(self, exc: Exception) -> list[Delta]:
        err = MMJaxError(f"internal error while running the request: {type(exc).__name__}: {exc}")
        return self.engine.fail_active(err)
